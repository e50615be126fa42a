//! The allocator: per-node, per-GPU accounting and the choice of GPUs.
//! Pure: no I/O, no clocks, no locks.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;

use tessera_api::request::selection::TopologyScope;
use tessera_api::request::{
    ContainerGpuRequest, ContainerRole, GpuMemory, GpuRequest, GpuSelection, PlacementPolicy,
    PodGpuRequest,
};
use tessera_api::resources::LABEL_GPU_MODEL;

mod gpu;
mod group;
mod pod;
mod preempt;
mod state;
mod unfit;

pub use gpu::*;
pub use group::*;
pub use pod::*;
pub use preempt::*;
pub use state::*;
pub use unfit::*;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod preemption_tests;
