//! `tessera-gpu-hook`: the GPU hook as an external `tessera.hook.v1` server, for
//! setups that run it outside the runtime proxy.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use tessera_hook_protocol::hook::v1::hook_server::HookServer as GeneratedServer;
use tessera_hook_protocol::server::HookServer;
use tessera_hooks::args::GpuHookArgs;
use tessera_hooks::server::GpuHook;
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;

/// Serves the GPU hook over tessera.hook.v1 on a unix socket. Register it with the
/// runtime proxy by a file in /etc/tessera/hooks.d/ (and run the proxy with --no-gpu-hook).
#[derive(Debug, Parser)]
#[command(name = "tessera-gpu-hook", version)]
struct Cli {
    /// Unix socket to serve on; its directory is created.
    #[arg(
        long,
        value_name = "PATH",
        default_value = "/run/tessera/hooks/gpu.sock"
    )]
    socket: PathBuf,
    /// Log lines as `text` (colour only on a terminal) or `json` (one object per line).
    #[arg(long, value_name = "text|json", env = tessera_daemon::binary::LOG_FORMAT_ENV, default_value_t = tessera_daemon::binary::LogFormat::Text)]
    log_format: tessera_daemon::binary::LogFormat,
    #[command(flatten)]
    gpu: GpuHookArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tessera_daemon::binary::init_logging_as("info", cli.log_format);
    if let Some(parent) = cli.socket.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    if cli.socket.exists() {
        std::fs::remove_file(&cli.socket)
            .with_context(|| format!("removing stale {}", cli.socket.display()))?;
    }
    let listener = UnixListener::bind(&cli.socket)
        .with_context(|| format!("binding {}", cli.socket.display()))?;
    // HAMi-core's preload list and directories, before any container mounts them.
    if let Some(files) = cli.gpu.hami_core_files() {
        files
            .install()
            .map_err(|e| anyhow::anyhow!("--hami-core-library: {e}"))?;
    }
    let hook = GpuHook::new(cli.gpu.config(), Arc::new(cli.gpu.probe()));
    tracing::info!(socket = %cli.socket.display(), config = ?hook.config(), "serving tessera.hook.v1");
    tonic::transport::Server::builder()
        .add_service(GeneratedServer::new(HookServer::new(hook)))
        // SIGTERM or SIGINT: stop accepting, let calls in flight finish.
        .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
            if let Err(error) = tessera_daemon::binary::shutdown_signal().await {
                tracing::error!(%error, "stopping: no signal handler");
            }
        })
        .await?;
    Ok(())
}
