//! The throttle's hands on the host: containers' cgroups and processes under
//! /proc and /sys/fs/cgroup, the freezer, and NVML's per-process GPU time.

use super::*;

/// The container ID in a cgroup directory's name: `cri-containerd-<id>.scope`
/// (systemd driver), `crio-<id>.scope`, `docker-<id>.scope`, or `<id>` itself
/// (cgroupfs driver): 64 lowercase hex digits.
pub fn container_id_of(dir: &Path) -> Option<String> {
    let name = dir.file_name()?.to_str()?;
    let name = name.strip_suffix(".scope").unwrap_or(name);
    let id = name.rsplit('-').next()?;
    (id.len() == 64 && id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
        .then(|| id.to_owned())
}

/// The real node: `/proc` and the cgroup v2 hierarchy.
#[derive(Debug, Clone)]
pub struct HostProcesses {
    /// `/proc` on a host.
    pub proc_root: PathBuf,
    /// The cgroup v2 mount.
    pub cgroup_root: PathBuf,
}

impl HostProcesses {
    /// This host's: `/proc`, and the cgroup v2 hierarchy its mountinfo names.
    pub fn host() -> Result<Self, String> {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| format!("reading /proc/self/mountinfo: {e}"))?;
        let cgroup_root = crate::cgroup::v2_mount(&mountinfo)
            .ok_or("no cgroup v2 hierarchy is mounted (containers are found by their cgroup)")?;
        Ok(Self {
            proc_root: "/proc".into(),
            cgroup_root,
        })
    }
}

impl Processes for HostProcesses {
    fn cgroup(&self, pid: u32) -> Lookup {
        use crate::cgroup::CgroupError;
        match crate::cgroup::of_pid(&self.proc_root, &self.cgroup_root, pid) {
            Ok(dir) => container_cgroup(&self.cgroup_root, &dir)
                .map_or(Lookup::NotContainer, Lookup::Container),
            // The process, or its cgroup, is gone.
            Err(CgroupError::Read { .. } | CgroupError::Missing { .. }) => Lookup::Gone,
            Err(CgroupError::NotV2 { .. } | CgroupError::Root { .. }) => Lookup::NotContainer,
        }
    }

    fn start_time(&self, pid: u32) -> Option<u64> {
        let stat =
            std::fs::read_to_string(self.proc_root.join(pid.to_string()).join("stat")).ok()?;
        // Fields after the command name, which may hold spaces and parentheses: the
        // 22nd field of the line, `starttime`, is the 20th after it.
        stat.rsplit_once(')')?
            .1
            .split_whitespace()
            .nth(19)?
            .parse()
            .ok()
    }
}

/// The container cgroup `dir` is in: the first directory below `root` named
/// after a container. From the root down, so that a process in a sub-cgroup of
/// its container (systemd inside it, say) is its container's, and a sub-cgroup a
/// tenant named after another container is still its own container's.
pub fn container_cgroup(root: &Path, dir: &Path) -> Option<ProcessCgroup> {
    let relative = dir.strip_prefix(root).ok()?;
    let mut path = root.to_path_buf();
    for part in relative.components() {
        path.push(part);
        if let Some(container_id) = container_id_of(&path) {
            return Some(ProcessCgroup {
                container_id,
                dir: path,
            });
        }
    }
    None
}

/// cgroup v2's own freezer (`cgroup.freeze`), which also freezes every cgroup
/// below (a container's own sub-cgroups).
#[derive(Debug, Clone, Copy, Default)]
pub struct CgroupFreezer;

impl Freezer for CgroupFreezer {
    fn set(&self, dir: &Path, frozen: bool) -> std::io::Result<()> {
        std::fs::write(dir.join("cgroup.freeze"), if frozen { "1" } else { "0" })
    }
}

/// NVML's per-process utilization (`nvmlDeviceGetProcessUtilization`).
pub struct NvmlGpuTime {
    pub(super) nvml: nvml_wrapper::Nvml,
}

impl std::fmt::Debug for NvmlGpuTime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlGpuTime").finish_non_exhaustive()
    }
}

impl NvmlGpuTime {
    /// Loads NVML from `library` and checks that it has the call.
    pub fn open(library: &Path) -> Result<Self, ThrottleError> {
        let error = |reason: String| ThrottleError::Nvml {
            uuid: "(all)".into(),
            reason,
        };
        let nvml = crate::nvml::load(library).map_err(error)?;
        let count = nvml.device_count().map_err(|e| error(e.to_string()))?;
        for index in 0..count {
            let device = nvml
                .device_by_index(index)
                .map_err(|e| error(e.to_string()))?;
            match device.process_utilization_stats(0) {
                Ok(_) | Err(nvml_wrapper::error::NvmlError::NotFound) => {}
                Err(e) => return Err(error(format!("GPU {index}: process utilization: {e}"))),
            }
        }
        Ok(Self { nvml })
    }
}

/// NVML's error on GPU `uuid`, as the throttle reports it.
pub(super) fn nvml_error(
    uuid: &str,
) -> impl Fn(nvml_wrapper::error::NvmlError) -> ThrottleError + '_ {
    move |e| ThrottleError::Nvml {
        uuid: uuid.to_owned(),
        reason: e.to_string(),
    }
}

impl GpuTime for NvmlGpuTime {
    fn samples(&mut self, uuid: &str, since_us: u64) -> Result<Vec<Sample>, ThrottleError> {
        let device = self.nvml.device_by_uuid(uuid).map_err(nvml_error(uuid))?;
        match device.process_utilization_stats(since_us) {
            // Unused slots come back as pid 0 at time 0 (driver 580): not samples.
            Ok(samples) => Ok(samples
                .into_iter()
                .filter(|s| s.pid != 0 && s.timestamp != 0)
                .map(|s| Sample {
                    pid: s.pid,
                    timestamp_us: s.timestamp,
                    sm_percent: s.sm_util,
                })
                .collect()),
            // No process has run on it since.
            Err(nvml_wrapper::error::NvmlError::NotFound) => Ok(Vec::new()),
            Err(e) => Err(nvml_error(uuid)(e)),
        }
    }

    fn running(&mut self, uuid: &str) -> Result<Vec<u32>, ThrottleError> {
        let device = self.nvml.device_by_uuid(uuid).map_err(nvml_error(uuid))?;
        let processes = device
            .running_compute_processes()
            .map_err(nvml_error(uuid))?;
        Ok(processes.into_iter().map(|p| p.pid).collect())
    }
}
