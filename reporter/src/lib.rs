//! `tessera-reporter`: what a GPU node has and who holds it.
//!
//! - [`gpu`]: NVML discovery (and [`health`]: XID events) behind small traits;
//! - [`checkpoint`]: kubelet's device checkpoint → legacy pods' GPUs;
//! - [`report`]: the pure step from those to the Device CR and node capacity;
//! - [`publish`]: writing them to the API server, only on change;
//! - [`metrics`]: what it saw and how publishing went, for Prometheus;
//! - [`events`]: Kubernetes Events on the Node when a GPU turns unhealthy or recovers.

pub use tessera_api::checkpoint;
pub mod events;
pub mod gpu;
pub mod health;
pub mod metrics;
pub mod publish;
pub mod report;
pub mod run;

/// An error and its causes on one line, for logs: `a: b: c`.
pub fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
