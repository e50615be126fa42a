//! Tessera's hooks. The GPU hook first: [`gpu::rewrite`] is a pure function of
//! (container, allocation annotation, node devices) returning the edits that give a
//! container exactly its GPUs; [`probe`] reads the node's devices; [`server`] makes
//! the GPU hook a `tessera_hook_protocol` container hook (the protocol crate applies
//! its edits and serves it over `tessera.hook.v1`).

pub mod args;
pub mod gpu;
pub mod probe;
pub mod server;

pub use gpu::{GpuHookConfig, GpuHookError, GpuMode, NodeDevices, rewrite};
