//! GPU discovery and XID health through NVML (`nvml-wrapper`), behind small traits
//! so the Device CR logic is tested without a GPU.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::TopologyLevel;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::PciInfo;
use tessera_daemon::nvml::NvmlOpenError;

/// One GPU, as the node sees it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuInfo {
    /// `GPU-…`.
    pub uuid: String,
    /// NVML index.
    pub index: u32,
    /// Device minor (`/dev/nvidia<minor>`).
    pub minor: u32,
    /// Model name.
    pub model: String,
    /// Total memory in bytes.
    pub memory_bytes: u64,
    /// PCI bus ID as NVML prints it (`00000000:19:00.0`).
    pub bus_id: String,
    /// NUMA node, when the platform reports one.
    pub numa_node: Option<u32>,
    /// The PCIe switch group: the lowest bus ID among the GPUs sharing a PCIe
    /// switch with this one (its own bus ID when it shares none).
    pub pcie_id: String,
    /// UUIDs of the GPUs this one has an active NVLink to.
    pub nvlink_peers: Vec<String>,
}

/// The node's GPUs.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeGpus {
    /// NVIDIA driver version.
    pub driver_version: String,
    /// The GPUs, by index.
    pub gpus: Vec<GpuInfo>,
}

/// Why GPUs could not be read.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// The NVML library is not there or not loadable.
    #[error(
        "NVML library {path} could not be loaded; is the NVIDIA driver installed? (--nvml-library)"
    )]
    Library {
        path: String,
        #[source]
        source: NvmlError,
    },
    /// NVML loaded but the driver is not running.
    #[error("NVML could not initialise; is the NVIDIA kernel driver loaded?")]
    Init(#[source] NvmlError),
    /// A query failed.
    #[error("NVML {what}")]
    Query {
        what: String,
        #[source]
        source: NvmlError,
    },
}

fn query<T>(
    what: impl FnOnce() -> String,
    result: Result<T, NvmlError>,
) -> Result<T, DiscoveryError> {
    result.map_err(|source| DiscoveryError::Query {
        what: what(),
        source,
    })
}

/// Reads the node's GPUs.
pub trait GpuSource: Send + Sync + std::fmt::Debug {
    /// The GPUs now.
    fn discover(&self) -> Result<NodeGpus, DiscoveryError>;
}

/// NVML, loaded from a library path.
#[derive(Debug, Clone)]
pub struct NvmlSource {
    nvml: Arc<Nvml>,
}

/// Where the real driver's NVML library is.
pub const DEFAULT_NVML_LIBRARY: &str = "libnvidia-ml.so.1";

impl NvmlSource {
    /// Loads NVML from `library` (a file name searched by the loader, or a path).
    pub fn open(library: &Path) -> Result<Self, DiscoveryError> {
        let nvml = tessera_daemon::nvml::open(library).map_err(|error| match error {
            NvmlOpenError::Library { library, source } => DiscoveryError::Library {
                path: library,
                source,
            },
            NvmlOpenError::Init { source, .. } => DiscoveryError::Init(source),
        })?;
        Ok(Self {
            nvml: Arc::new(nvml),
        })
    }

    /// The NVML handle, shared with the health watcher.
    pub fn nvml(&self) -> Arc<Nvml> {
        Arc::clone(&self.nvml)
    }
}

fn pci_key(info: &PciInfo) -> (u32, u32, u32) {
    (info.domain, info.bus, info.device)
}

impl GpuSource for NvmlSource {
    fn discover(&self) -> Result<NodeGpus, DiscoveryError> {
        let nvml = &self.nvml;
        let driver_version = query(|| "driver version".into(), nvml.sys_driver_version())?;
        let count = query(|| "device count".into(), nvml.device_count())?;
        let mut devices = Vec::new();
        let mut gpus = Vec::new();
        let mut pci = Vec::new();
        for index in 0..count {
            let device = query(|| format!("device {index}"), nvml.device_by_index(index))?;
            let uuid = query(|| format!("device {index} UUID"), device.uuid())?;
            let info = query(|| format!("{uuid} PCI info"), device.pci_info())?;
            gpus.push(GpuInfo {
                index,
                minor: query(|| format!("{uuid} minor number"), device.minor_number())?,
                model: query(|| format!("{uuid} name"), device.name())?,
                memory_bytes: query(|| format!("{uuid} memory"), device.memory_info())?.total,
                bus_id: info.bus_id.clone(),
                // Not every platform reports NUMA affinity.
                numa_node: device.numa_node_id().ok(),
                pcie_id: String::new(),
                nvlink_peers: Vec::new(),
                uuid,
            });
            pci.push(pci_key(&info));
            devices.push(device);
        }
        // PCIe switch groups: GPUs whose common ancestor is a switch (SINGLE or MULTIPLE).
        for a in 0..devices.len() {
            let mut group = gpus[a].bus_id.clone();
            for b in 0..devices.len() {
                if a == b {
                    continue;
                }
                let level = nvml.topology_common_ancestor(&devices[a], &devices[b]);
                if matches!(level, Ok(TopologyLevel::Single | TopologyLevel::Multiple))
                    && gpus[b].bus_id < group
                {
                    group.clone_from(&gpus[b].bus_id);
                }
            }
            gpus[a].pcie_id = group;
        }
        let by_pci: BTreeMap<(u32, u32, u32), String> = pci
            .iter()
            .copied()
            .zip(gpus.iter().map(|g| g.uuid.clone()))
            .collect();
        for (index, device) in devices.iter().enumerate() {
            let mut peers = Vec::new();
            for link in 0..nvml_wrapper_sys_links() {
                let link = device.link_wrapper_for(link);
                if link.is_active().unwrap_or(false) {
                    if let Some(peer) = link
                        .remote_pci_info()
                        .ok()
                        .and_then(|info| by_pci.get(&pci_key(&info)))
                    {
                        if !peers.contains(peer) {
                            peers.push(peer.clone());
                        }
                    }
                }
            }
            gpus[index].nvlink_peers = peers;
        }
        Ok(NodeGpus {
            driver_version,
            gpus,
        })
    }
}

/// NVLink slots NVML knows (`NVML_NVLINK_MAX_LINKS`).
const fn nvml_wrapper_sys_links() -> u32 {
    18
}

/// Where the NVML library is, from the flag or the default.
pub fn library_path(flag: Option<PathBuf>) -> PathBuf {
    flag.unwrap_or_else(|| PathBuf::from(DEFAULT_NVML_LIBRARY))
}
