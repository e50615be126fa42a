//! Tessera's integration harness: the real parts, or their stand-ins, that the
//! end-to-end tests, the benchmarks and the demo run against.
//!
//! - [`cluster`]: a real one-node Kubernetes cluster (kubelet → proxy → containerd 2.x) on a fake GPU node.
//! - [`containerd`]: a private containerd + runc with its own root, state and socket.
//! - [`image`]: OCI images built locally from static binaries (no registry here).
//! - [`kubelet`]: a driver making the CRI calls kubelet makes, in kubelet's order.
//! - [`fake_runtime`]: a recording HTTP/2 runtime for byte-exact checks.
//! - [`proxy`]: the runtime proxy run in-process over a socket in a temp dir.

pub mod apiserver;
pub mod cluster;
pub mod cluster_demo;
pub mod containerd;
pub mod demo;
pub mod deploy;
pub mod fake_nvml;
pub mod fake_runtime;
pub mod gpu_node;
pub mod hook_server;
pub mod hooks;
pub mod image;
pub mod kubelet;
pub mod proxy;
pub mod raw;

/// Installs a test-friendly tracing subscriber once (`RUST_LOG` selects).
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
}
