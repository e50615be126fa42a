//! Reads what the node has: device nodes under the device root, the GPUs'
//! UUID → minor mapping from NVML when it loads, else from
//! `/proc/driver/nvidia/gpus/*/information`, and the device-plugin grants in
//! kubelet's checkpoint.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nvml_wrapper::Nvml;

use tessera_api::checkpoint::parse_checkpoint;

use crate::gpu::{GpuDevice, NodeDevices, PluginGrants};

/// kubelet's device-manager checkpoint.
pub const KUBELET_CHECKPOINT: &str = "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint";

/// Where the probe looks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbePaths {
    /// Host device nodes (`/dev`).
    pub device_root: PathBuf,
    /// The driver's per-GPU information (`/proc/driver/nvidia/gpus`).
    pub driver_gpus: PathBuf,
    /// kubelet's device checkpoint ([`KUBELET_CHECKPOINT`]).
    pub kubelet_checkpoint: PathBuf,
}

impl Default for ProbePaths {
    fn default() -> Self {
        Self {
            device_root: "/dev".into(),
            driver_gpus: "/proc/driver/nvidia/gpus".into(),
            kubelet_checkpoint: KUBELET_CHECKPOINT.into(),
        }
    }
}

/// Reads the node's devices. A source that cannot be read leaves its part empty
/// (`gpus: None`): the rewrite then trusts the annotation, as documented.
pub trait DeviceProbe: Send + Sync + std::fmt::Debug {
    /// The node's devices now.
    fn probe(&self) -> NodeDevices;
}

/// The probe of the real host (or of a test directory laid out like it).
#[derive(Clone, Default)]
pub struct HostProbe {
    paths: ProbePaths,
    nvml: Option<Arc<Nvml>>,
}

impl std::fmt::Debug for HostProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostProbe")
            .field("paths", &self.paths)
            .field("nvml", &self.nvml.is_some())
            .finish()
    }
}

impl HostProbe {
    /// A probe of `paths`, without NVML.
    pub fn new(paths: ProbePaths) -> Self {
        Self { paths, nvml: None }
    }

    /// A probe that asks NVML (loaded from `library`) first. A library that does not
    /// load is logged and the probe falls back to the driver's /proc files.
    pub fn with_nvml(paths: ProbePaths, library: &Path) -> Self {
        let nvml = match tessera_daemon::nvml::open(library) {
            Ok(nvml) => Some(Arc::new(nvml)),
            Err(error) => {
                let error = error.nvml_error();
                tracing::info!(library = %library.display(), %error, "NVML not available; GPU inventory from /proc/driver/nvidia");
                None
            }
        };
        Self { paths, nvml }
    }

    /// Whether NVML is in use.
    pub fn has_nvml(&self) -> bool {
        self.nvml.is_some()
    }
}

impl DeviceProbe for HostProbe {
    fn probe(&self) -> NodeDevices {
        let gpus = self
            .nvml
            .as_deref()
            .and_then(read_nvml_gpus)
            .or_else(|| read_driver_gpus(&self.paths.driver_gpus));
        NodeDevices {
            gpus,
            nodes: device_nodes(&self.paths.device_root),
            plugin_grants: read_plugin_grants(&self.paths.kubelet_checkpoint),
            book: None,
        }
    }
}

/// What kubelet's checkpoint at `path` records; a missing file means no device
/// plugin has given anything on this node.
pub fn read_plugin_grants(path: &Path) -> PluginGrants {
    match std::fs::read(path) {
        Ok(bytes) => match parse_checkpoint(&bytes) {
            Ok(checkpoint) => PluginGrants::Recorded(checkpoint.entries),
            Err(error) => PluginGrants::Unreadable(format!("{}: {error}", path.display())),
        },
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => PluginGrants::NoCheckpoint,
        Err(error) => PluginGrants::Unreadable(format!("{}: {error}", path.display())),
    }
}

/// The GPUs NVML lists (UUID, minor, memory), or `None` if a query fails.
pub fn read_nvml_gpus(nvml: &Nvml) -> Option<Vec<GpuDevice>> {
    let result = (|| -> Result<Vec<GpuDevice>, nvml_wrapper::error::NvmlError> {
        let mut gpus = Vec::new();
        for index in 0..nvml.device_count()? {
            let device = nvml.device_by_index(index)?;
            gpus.push(GpuDevice {
                uuid: device.uuid()?,
                minor: device.minor_number()?,
                memory_bytes: device.memory_info().ok().map(|m| m.total),
            });
        }
        Ok(gpus)
    })();
    result
        .inspect_err(
            |error| tracing::warn!(%error, "NVML inventory failed; trying /proc/driver/nvidia"),
        )
        .ok()
}

/// Names of `nvidia*` nodes under `root` and of `infiniband/*` nodes.
pub fn device_nodes(root: &Path) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let list = |dir: &Path| -> Vec<String> {
        std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|entry| entry.file_name().into_string().ok())
            .collect()
    };
    names.extend(
        list(root)
            .into_iter()
            .filter(|name| name.starts_with("nvidia")),
    );
    names.extend(
        list(&root.join("infiniband"))
            .into_iter()
            .map(|name| format!("infiniband/{name}")),
    );
    names
}

/// The GPUs the driver lists, or `None` when the driver's directory is absent or unreadable.
pub fn read_driver_gpus(dir: &Path) -> Option<Vec<GpuDevice>> {
    let entries = std::fs::read_dir(dir).ok()?;
    let mut gpus = Vec::new();
    for entry in entries.flatten() {
        let text = std::fs::read_to_string(entry.path().join("information")).ok()?;
        gpus.push(parse_information(&text)?);
    }
    gpus.sort_by_key(|gpu| gpu.minor);
    Some(gpus)
}

/// Parses one `information` file: `GPU UUID:` and `Device Minor:` lines.
pub fn parse_information(text: &str) -> Option<GpuDevice> {
    let field = |name: &str| {
        text.lines().find_map(|line| {
            let (key, value) = line.split_once(':')?;
            (key.trim() == name).then(|| value.trim().to_owned())
        })
    };
    Some(GpuDevice {
        uuid: field("GPU UUID")?,
        minor: field("Device Minor")?.parse().ok()?,
        memory_bytes: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const INFORMATION: &str = "Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 0\nGPU UUID: \t GPU-5c0b3d4e-1f2a-4b6c-8d7e-9f0a1b2c3d4e\nVideo BIOS: \t 96.00.74.00.0d\nBus Type: \t PCIe\nDMA Size: \t 52 bits\nDMA Mask: \t 0xfffffffffffff\nBus Location: \t 0000:19:00.0\nDevice Minor: \t 3\nGPU Firmware: \t 535.104.05\nGPU Excluded:\t No\n";

    #[test]
    fn reads_driver_information() {
        let gpu = parse_information(INFORMATION).expect("parses");
        assert_eq!(gpu.uuid, "GPU-5c0b3d4e-1f2a-4b6c-8d7e-9f0a1b2c3d4e");
        assert_eq!(gpu.minor, 3);
        assert_eq!(parse_information("Model: x\n"), None);
    }

    #[test]
    fn probes_a_directory_laid_out_like_the_host() {
        let dir = tempfile::tempdir().expect("tempdir");
        let dev = dir.path().join("dev");
        std::fs::create_dir_all(dev.join("infiniband")).expect("mkdir");
        for name in ["nvidia0", "nvidiactl", "null", "infiniband/uverbs0"] {
            std::fs::write(dev.join(name), "").expect("touch");
        }
        let gpus = dir.path().join("gpus/0000:19:00.0");
        std::fs::create_dir_all(&gpus).expect("mkdir");
        std::fs::write(gpus.join("information"), INFORMATION).expect("write");
        let checkpoint = dir.path().join("kubelet_internal_checkpoint");
        std::fs::write(
            &checkpoint,
            r#"{"Data":{"PodDeviceEntries":[{"PodUID":"u1","ContainerName":"app","ResourceName":"nvidia.com/gpu","DeviceIDs":{"0":["GPU-a"]},"AllocResp":""}]},"Checksum":1}"#,
        )
        .expect("write");
        let node = HostProbe::new(ProbePaths {
            device_root: dev,
            driver_gpus: dir.path().join("gpus"),
            kubelet_checkpoint: checkpoint.clone(),
        })
        .probe();
        match &node.plugin_grants {
            PluginGrants::Recorded(entries) => {
                assert_eq!(entries.len(), 1);
                assert_eq!(entries[0].gpu_ids(), ["GPU-a"]);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            node.nodes.iter().map(String::as_str).collect::<Vec<_>>(),
            ["infiniband/uverbs0", "nvidia0", "nvidiactl"]
        );
        assert_eq!(node.gpus.map(|g| g.len()), Some(1));
        let missing = HostProbe::new(ProbePaths {
            device_root: dir.path().into(),
            driver_gpus: dir.path().join("none"),
            kubelet_checkpoint: dir.path().join("none"),
        })
        .probe();
        assert_eq!(missing.gpus, None);
        assert_eq!(missing.plugin_grants, PluginGrants::NoCheckpoint);

        std::fs::write(&checkpoint, "{not json").expect("write");
        match read_plugin_grants(&checkpoint) {
            PluginGrants::Unreadable(reason) => {
                assert!(reason.contains("kubelet_internal_checkpoint"), "{reason}");
                assert!(
                    reason.contains("not a kubelet device checkpoint"),
                    "{reason}"
                );
            }
            other => panic!("{other:?}"),
        }
    }
}
