//! Tessera's test harness: the real parts, or their stand-ins, that the end-to-end
//! tests, the benchmarks and the demo run against. It links none of Tessera's
//! product crates (youki keeps its harness apart the same way): a crate's tests
//! depend on it without compiling the rest of the workspace, and the real-cluster
//! tier runs the very binaries users install.
//!
//! - [`cluster`]: a real one-node Kubernetes cluster (kubelet → proxy → containerd 2.x) on a fake GPU node;
//!   [`cluster_demo`]: `tessera-demo --cluster` on it.
//! - [`containerd`]: a private containerd + runc with its own root, state and socket.
//! - [`image`]: OCI images built locally from static binaries (no registry here).
//! - [`kubelet`]: a driver making the CRI calls kubelet makes, in kubelet's order.
//! - [`fake_runtime`]: a recording HTTP/2 runtime for byte-exact checks.
//! - [`apiserver`]: an API server double, for faults a real one cannot produce on demand.
//! - [`gpu_node`], [`fake_nvml`]: a fake GPU node's device nodes, driver files and NVML.
//! - [`monitoring`]: metric names in the chart's alerts and dashboard, and in what a daemon serves.

pub mod apiserver;
pub mod cluster;
pub mod cluster_demo;
pub mod containerd;
pub mod deploy;
pub mod fake_nvml;
pub mod fake_runtime;
pub mod gpu_node;
pub mod image;
pub mod kubelet;
pub mod monitoring;
pub mod raw;
pub mod unix;
pub mod webhook;

/// Installs a test-friendly tracing subscriber once (`RUST_LOG` selects). By
/// default kube's client does not log each failed request: the harness polls
/// components that are still starting and reports its own errors.
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,kube_client::client::builder=off".into()),
        )
        .with_test_writer()
        .try_init();
}

/// Polls `check` every 250 ms until it says yes, or fails naming `what` after
/// `timeout`: for a state the cluster reaches on its own time (a controller's
/// pod made, the garbage collector's delete).
pub async fn until<F, Fut>(
    what: &str,
    timeout: std::time::Duration,
    mut check: F,
) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<bool>>,
{
    let started = std::time::Instant::now();
    while !check().await? {
        anyhow::ensure!(
            started.elapsed() < timeout,
            "{what}: not within {timeout:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
    Ok(())
}
