//! `tessera-allocator`: where GPU shares are decided, with no I/O. The extender
//! (`tessera-scheduler`) and the `tessera` CLI both build on it.
//!
//! - [`allocate`]: per-node, per-GPU accounting; whether a pod fits, where
//!   (binpack/spread, topology, sharing groups), how a node scores, and whom
//!   preemption evicts;
//! - [`ledger`]: the cluster's GPU use, from Device CRs, pods and in-flight
//!   allocations;
//! - [`simulate`]: a whole cluster's placements, offline, from a snapshot;
//! - [`inspect`]: what the ledger says of each GPU, node and pod, as a report;
//! - [`upgrade`]: pod-level allocation annotations of running pods rewritten into
//!   per-container grants.

pub mod allocate;
pub mod inspect;
pub mod ledger;
pub mod simulate;
pub mod upgrade;
