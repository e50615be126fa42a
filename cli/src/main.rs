use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = tessera_cli::Cli::parse();
    match start(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!(
                "tessera: {}",
                tessera_daemon::binary::error_chain(error.as_ref())
            );
            std::process::ExitCode::FAILURE
        }
    }
}

/// `prepare` runs before the runtime: entering the host's mount namespace needs
/// a process with one thread.
fn start(cli: tessera_cli::Cli) -> anyhow::Result<()> {
    let prepared = tessera_cli::prepare(&cli)?;
    tokio::runtime::Runtime::new()?.block_on(tessera_cli::run(cli, prepared))
}
