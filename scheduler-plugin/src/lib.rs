//! `tessera-scheduler`: a kube-scheduler extender that places GPU shares per GPU,
//! by UUID, and writes the allocation on the pod before binding it.
//!
//! - [`bind`]: the bind path's decisions and preconditioned writes;
//! - [`certs`]: the CA and certificates of the extender's mutual TLS;
//! - [`events`]: Kubernetes Events on pods (GPUs placed, bind refused), never
//!   holding a bind up;
//! - [`extender`]: filter, prioritize, preempt and bind over the ledger
//!   (`extender::binder` owns the bind I/O, `extender::routes` the HTTP routing);
//! - [`metrics`]: the Prometheus metrics served on `--metrics-listen`;
//! - [`protocol`]: the extender protocol's types as kube-scheduler sends them;
//! - [`sharepods`]: KubeShare's SharePods, each made into its pod;
//! - [`transport`]: who may call the extender: mutual TLS, `bind` only for
//!   kube-scheduler, plain HTTP only on loopback, the probe port;

pub mod bind;
pub mod certs;
pub mod cluster;
pub mod events;
pub mod extender;
pub mod leader;
pub mod metrics;
pub mod protocol;
pub mod sharepods;
pub mod transport;
