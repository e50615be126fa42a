//! `tessera-demo`: Tessera on one machine, no cluster and no GPU needed (root needed).
//! Ctrl-C stops it and cleans up: processes, mounts and temporary directories.

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tessera_api::binary::init_logging("error");
    let mut stdout = std::io::stdout();
    tokio::select! {
        result = tessera_integration::demo::run(&mut stdout) => match result {
            Ok(_) => std::process::ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("tessera-demo: {error:#}");
                std::process::ExitCode::FAILURE
            }
        },
        // Dropping the demo's future kills containerd and its shims, unmounts and removes temp dirs.
        _ = tokio::signal::ctrl_c() => {
            eprintln!("tessera-demo: interrupted; cleaned up");
            std::process::ExitCode::from(130)
        }
    }
}
