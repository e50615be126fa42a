//! `tessera-daemon`: the plumbing Tessera's binaries share, so that each binary
//! stays config → build → run over its library. `tessera-api` keeps the contract
//! (types and codecs, no I/O); this crate is where the I/O every daemon does alike
//! lives.
//!
//! - [`binary`]: logging (text or JSON), error chains, the host name, shutdown on
//!   signals;
//! - [`metrics`] (feature `metrics`): the Prometheus endpoint;
//! - [`nvml`] (feature `nvml`): NVML loaded from a `--nvml-library` flag;
//! - [`client`] (feature `client`): a kube client from a kubeconfig or the pod's
//!   service account;
//! - [`events`] (feature `client`): events.k8s.io Events, built and written, and
//!   the one queue that keeps writing them off a daemon's hot path;
//! - [`sync`]: the one way a daemon takes a lock (past a poisoned one).

pub mod binary;
#[cfg(feature = "client")]
pub mod client;
#[cfg(feature = "client")]
pub mod events;
#[cfg(feature = "metrics")]
pub mod metrics;
#[cfg(feature = "nvml")]
pub mod nvml;
pub mod sync;
