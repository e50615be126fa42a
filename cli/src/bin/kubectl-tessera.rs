//! `kubectl tessera inspect`: the same CLI as `tessera`, installed as a kubectl plugin.
use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = tessera_cli::Cli::parse_from(
        std::iter::once("kubectl tessera".to_owned()).chain(std::env::args().skip(1)),
    );
    // `prepare` runs before the runtime: entering the host's mount namespace needs
    // a process with one thread.
    let started = tessera_cli::prepare(&cli).and_then(|prepared| {
        tokio::runtime::Runtime::new()?.block_on(tessera_cli::run(cli, prepared))
    });
    match started {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!(
                "kubectl tessera: {}",
                tessera_daemon::binary::error_chain(error.as_ref())
            );
            std::process::ExitCode::FAILURE
        }
    }
}
