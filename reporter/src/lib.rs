//! `tessera-reporter`: what a GPU node has and who holds it.
//!
//! - [`gpu`]: NVML discovery (and [`health`]: XID events) behind small traits;
//! - [`checkpoint`]: kubelet's device checkpoint → legacy pods' GPUs;
//! - [`report`]: the pure step from those to the Device CR and node capacity;
//! - [`publish`]: writing them to the API server, only on change;
//! - [`metrics`]: what it saw and how publishing went, for Prometheus;
//! - [`events`]: Kubernetes Events on the Node when a GPU turns unhealthy or recovers,
//!   and on a pod whose container reaches its GPU memory limit;
//! - [`usage`]: each container's GPU memory, from the runtime proxy's file.

pub use tessera_api::checkpoint;
pub mod events;
pub mod gpu;
pub mod health;
pub mod metrics;
pub mod publish;
pub mod report;
pub mod run;
pub mod usage;
/// An error and its causes on one line, for logs: `a: b: c`.
pub use tessera_daemon::binary::error_chain as chain;
