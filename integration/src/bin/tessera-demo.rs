//! `tessera-demo`: Tessera on one machine, no GPU needed (root needed).
//!
//! - no flag: the embedded demo, no cluster: a private containerd behind the proxy, an
//!   API server double, the scheduler's extender called directly.
//! - `--cluster`: the same story on a real one-node Kubernetes cluster (binaries from
//!   `TESSERA_K8S_BIN` or `../shared/k8s/bin`), kept up until Ctrl-C.
//!
//! Ctrl-C (or SIGTERM) stops it and cleans up: processes, mounts and temporary directories.

const HELP: &str = "Usage: tessera-demo [--cluster [--exit]]

Tessera on one machine, no GPU needed (root needed).

  (no flag)   embedded demo: private containerd behind tessera-runtime-proxy, an API server
              double, the extender called directly; exits when done
  --cluster   the same story on a real one-node Kubernetes cluster (kube-apiserver,
              kube-scheduler + tessera-scheduler, kubelet -> proxy -> containerd 2.x, NVIDIA's
              device plugin on a fake 4-GPU node); binaries from $TESSERA_K8S_BIN or
              ../shared/k8s/bin. Stays up until Ctrl-C and prints a kubeconfig path
  --exit      with --cluster: tear the cluster down when the story is told
  -h, --help  this text";

#[tokio::main]
async fn main() -> std::process::ExitCode {
    // kube's client logs each 500 of an API server still starting as an ERROR;
    // the demo waits those out and reports its own failures.
    tessera_daemon::binary::init_logging("error,kube_client=off");
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{HELP}");
        return std::process::ExitCode::SUCCESS;
    }
    if let Some(bad) = args
        .iter()
        .find(|a| !matches!(a.as_str(), "--cluster" | "--exit"))
    {
        eprintln!("tessera-demo: unknown argument {bad:?}\n\n{HELP}");
        return std::process::ExitCode::from(2);
    }
    let cluster = args.iter().any(|a| a == "--cluster");
    let keep_up = !args.iter().any(|a| a == "--exit");
    let mut stdout = std::io::stdout();
    let story = async {
        if cluster {
            tessera_integration::cluster_demo::run(&mut stdout, keep_up)
                .await
                .map(drop)
        } else {
            tessera_integration::demo::run(&mut stdout).await.map(drop)
        }
    };
    tokio::select! {
        result = story => match result {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("tessera-demo: {error:#}");
                std::process::ExitCode::FAILURE
            }
        },
        // Dropping the story's future stops the cluster or containerd, kills their
        // containers, unmounts and removes temp dirs: on Ctrl-C, and on SIGTERM
        // (`timeout`, systemd, kill), which once left a whole cluster running.
        _ = tessera_daemon::binary::shutdown_signal() => {
            eprintln!("tessera-demo: interrupted; cleaned up");
            std::process::ExitCode::from(130)
        }
    }
}
