//! Tessera's end-to-end tests, benchmarks and demo: the harness
//! ([`tessera_harness`], re-exported here) plus what needs Tessera's own crates —
//! the proxy run in-process, hooks, the embedded demo.
//!
//! - [`proxy`]: the runtime proxy run in-process over a socket in a temp dir.
//! - [`demo`]: `tessera-demo`'s embedded story (its `--cluster` story is [`cluster_demo`]).
//! - [`bench_pods`], [`bench_cluster`]: `tessera-bench pod-cache` and `tessera-bench cluster`.
//! - [`bench_enforce`]: `tessera-bench enforce`.

pub use tessera_harness::{
    apiserver, cluster, cluster_demo, containerd, deploy, fake_nvml, fake_runtime, gpu_node, image,
    init_tracing, kubelet, raw,
};

pub mod bench_cluster;
pub mod bench_enforce;
pub mod bench_flood;
pub mod bench_pods;
pub mod demo;
pub mod hook_server;
pub mod hooks;
pub mod proxy;

/// Where the GPU hook's probe should look on a fake GPU node.
pub fn probe_paths(node: &gpu_node::FakeGpuNode) -> tessera_hooks::probe::ProbePaths {
    tessera_hooks::probe::ProbePaths {
        device_root: node.device_root.clone(),
        driver_gpus: node.driver_gpus.clone(),
        kubelet_checkpoint: node.kubelet_checkpoint.clone(),
    }
}
