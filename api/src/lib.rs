//! Tessera's shared contract, with no I/O: the cluster-level names (kept exactly as
//! the Koordinator "Fine-grained Device Scheduling" design has them), Kubernetes
//! quantities, pods' GPU requests container by container (with Kubernetes' rule for
//! effective pod requests), the one codec of the
//! `scheduling.koordinator.sh/device-allocated` pod annotation and its
//! per-container grants, used by the scheduler that writes it and the hook that
//! reads it, and the parser of kubelet's device checkpoint, read by the reporter (legacy pods'
//! GPUs) and the GPU hook (which device-plugin grants are real), and the codec of the
//! Device CR's NVLink peers, written by the reporter and read by the scheduler.

pub mod allocation;
pub mod asked;
pub mod checkpoint;
pub mod device;
pub mod dra;
pub mod enforcement;
pub mod kubelet_seen;
pub mod nvlink;
pub mod quantity;
pub mod request;
pub mod resources;
pub mod sharepod;
pub mod usage;

pub use allocation::{AllocationError, ContainerShares, DeviceAllocation, DeviceAllocations};
pub use device::{
    Device, DeviceInfo, DeviceSpec, DeviceTopology, LegacyDeviceEntry, LegacyEntriesError,
};
pub use nvlink::{NvlinkPeers, NvlinkPeersError};
pub use quantity::{Quantity, QuantityError};
