//! A fake GPU node in a directory: `/dev/nvidia*` character devices made with
//! mknod (major 195, as the NVIDIA driver's) and the driver's
//! `/proc/driver/nvidia/gpus/*/information` files. Needs root.

use std::path::{Path, PathBuf};

use anyhow::Context;
use nix::sys::stat::{Mode, SFlag, makedev, mknod};

/// The NVIDIA driver's character-device major.
pub const NVIDIA_MAJOR: u64 = 195;

/// One fake GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeGpu {
    /// `GPU-…`.
    pub uuid: String,
    /// Device minor.
    pub minor: u32,
    /// PCI bus ID, also the name of its driver information directory.
    pub bus_id: String,
}

/// A directory laid out like a GPU node's `/dev` and `/proc/driver/nvidia/gpus`.
#[derive(Debug)]
pub struct FakeGpuNode {
    /// Device root (stands in for `/dev`).
    pub device_root: PathBuf,
    /// Driver information root (stands in for `/proc/driver/nvidia/gpus`).
    pub driver_gpus: PathBuf,
    /// The GPUs, by minor.
    pub gpus: Vec<FakeGpu>,
    /// Where kubelet's device checkpoint goes (absent until [`Self::write_checkpoint`]).
    pub kubelet_checkpoint: PathBuf,
}

/// One device-plugin grant, as kubelet records it in its checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginGrant {
    /// The pod's UID.
    pub pod_uid: String,
    /// The container's name.
    pub container: String,
    /// Device IDs the plugin handed out (`GPU-…`).
    pub device_ids: Vec<String>,
}

fn char_device(path: &Path, major: u64, minor: u64) -> anyhow::Result<()> {
    mknod(
        path,
        SFlag::S_IFCHR,
        Mode::from_bits_truncate(0o666),
        makedev(major, minor),
    )
    .with_context(|| format!("mknod {} c {major} {minor} (needs root)", path.display()))
}

impl FakeGpuNode {
    /// Creates `count` GPUs, their control nodes and an RDMA function under `dir`.
    pub fn create(dir: &Path, count: u32) -> anyhow::Result<Self> {
        let device_root = dir.join("dev");
        let driver_gpus = dir.join("driver-gpus");
        std::fs::create_dir_all(device_root.join("infiniband"))?;
        let mut gpus = Vec::new();
        for minor in 0..count {
            char_device(
                &device_root.join(format!("nvidia{minor}")),
                NVIDIA_MAJOR,
                u64::from(minor),
            )?;
            let gpu = FakeGpu {
                uuid: format!("GPU-7e55e2a0-0000-4000-8000-00000000000{minor}"),
                minor,
                bus_id: format!("0000:{:02x}:00.0", 0x18 + minor),
            };
            let info_dir = driver_gpus.join(&gpu.bus_id);
            std::fs::create_dir_all(&info_dir)?;
            std::fs::write(
                info_dir.join("information"),
                format!(
                    "Model: \t\t Tessera Fake GPU\nIRQ:   \t\t 0\nGPU UUID: \t {}\nBus Location: \t {}\nDevice Minor: \t {minor}\nGPU Excluded:\t No\n",
                    gpu.uuid, gpu.bus_id
                ),
            )?;
            gpus.push(gpu);
        }
        char_device(&device_root.join("nvidiactl"), NVIDIA_MAJOR, 255)?;
        char_device(&device_root.join("nvidia-uvm"), 235, 0)?;
        char_device(&device_root.join("infiniband/uverbs0"), 231, 192)?;
        char_device(&device_root.join("infiniband/rdma_cm"), 10, 58)?;
        Ok(Self {
            device_root,
            driver_gpus,
            gpus,
            kubelet_checkpoint: dir.join("kubelet_internal_checkpoint"),
        })
    }

    /// Writes kubelet's device checkpoint (1.20+ format, NUMA node 0) recording
    /// `grants` of `nvidia.com/gpu` by the NVIDIA device plugin.
    pub fn write_checkpoint(&self, grants: &[PluginGrant]) -> anyhow::Result<()> {
        let entries: Vec<serde_json::Value> = grants
            .iter()
            .map(|grant| {
                serde_json::json!({
                    "PodUID": grant.pod_uid,
                    "ContainerName": grant.container,
                    "ResourceName": "nvidia.com/gpu",
                    "DeviceIDs": {"0": grant.device_ids},
                    "AllocResp": "",
                })
            })
            .collect();
        let all: Vec<&str> = self.gpus.iter().map(|g| g.uuid.as_str()).collect();
        let file = serde_json::json!({
            "Data": {"PodDeviceEntries": entries, "RegisteredDevices": {"nvidia.com/gpu": all}},
            "Checksum": 0,
        });
        std::fs::write(&self.kubelet_checkpoint, serde_json::to_vec(&file)?)
            .with_context(|| format!("writing {}", self.kubelet_checkpoint.display()))
    }

    /// The node's root: `dev/` holds its device nodes (NVIDIA's device plugin's `--dev-root`).
    pub fn root(&self) -> &Path {
        self.device_root.parent().unwrap_or(&self.device_root)
    }
}
