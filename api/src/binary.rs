//! What every Tessera binary does the same way: logging, the host name, shutdown on signals.

/// Logs to stderr (stdout is for a command's output), filtered by `RUST_LOG`,
/// `default` when it is unset or invalid. Colour only on a terminal: a journal,
/// a file or a container log gets plain text.
pub fn init_logging(default: &str) {
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| default.into()),
        )
        .with_writer(std::io::stderr)
        .init();
}

/// This machine's host name (the node name on a Kubernetes node, the pod name in a pod).
pub fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
}

/// Resolves on SIGTERM or SIGINT: what kubelet and systemd send to stop a daemon
/// (as PID 1 in a container nothing else does it). Fails only when the handlers
/// cannot be installed, naming the signal.
pub async fn shutdown_signal() -> std::io::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut terminate = signal(SignalKind::terminate())
        .map_err(|e| std::io::Error::new(e.kind(), format!("installing a SIGTERM handler: {e}")))?;
    let mut interrupt = signal(SignalKind::interrupt())
        .map_err(|e| std::io::Error::new(e.kind(), format!("installing a SIGINT handler: {e}")))?;
    tokio::select! {
        _ = terminate.recv() => {}
        _ = interrupt.recv() => {}
    }
    Ok(())
}
