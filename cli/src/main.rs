use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    match tessera_cli::run(tessera_cli::Cli::parse()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("tessera: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
