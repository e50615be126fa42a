//! `kubectl tessera inspect`: the same CLI as `tessera`, installed as a kubectl plugin.
use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = tessera_cli::Cli::parse_from(
        std::iter::once("kubectl tessera".to_owned()).chain(std::env::args().skip(1)),
    );
    match tessera_cli::run(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("kubectl tessera: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
