//! Tessera's kubelet plugin for DRA (docs/dra.md): kubelet registers it through
//! its plugin watcher, then calls `NodePrepareResources` for each pod's claims of
//! driver `gpu.tessera.io` before the pod's sandbox is made, and
//! `NodeUnprepareResources` once the pod is gone.
//!
//! Preparing a claim reads it (its allocation on this node: GPUs and the
//! capacity each result consumed) and the pods it is reserved for (which of
//! their containers use it), records that in the checkpoint
//! ([`tessera_api::dra::prepared`]) that the runtime proxy reads, and answers
//! kubelet with a CDI device for each result: a token the runtime proxy
//! replaces with the claim's GPU and its enforcement (no CDI spec exists for it,
//! so without the proxy the container fails instead of running unheld). The
//! runtime proxy holds each container to exactly its claims' shares, as it holds
//! the extender's grants.

pub mod health;
pub mod plugin;
pub mod prepare;
pub mod proto;
pub mod server;
pub mod store;
