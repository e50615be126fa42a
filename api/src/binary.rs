//! What every Tessera binary does the same way at start: logging and the host name.

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
