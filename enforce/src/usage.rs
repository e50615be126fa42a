//! What each container holds of each GPU's memory: the driver's per-process
//! count (`nvmlDeviceGetComputeRunningProcesses` and
//! `nvmlDeviceGetGraphicsRunningProcesses`, so that memory held through Vulkan,
//! EGL or OpenGL counts too), each process traced to its container by its cgroup, summed per container and GPU. It works on every
//! driver and with every backend (or none): it is what a share's limit is
//! measured against, not what holds it.

use std::collections::BTreeMap;
use std::path::Path;

use crate::throttle::{Lookup, Processes};

/// One process's memory on one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessMemory {
    /// The GPU's UUID.
    pub gpu: String,
    /// The process, in the host's PID namespace.
    pub pid: u32,
    /// Bytes it holds there (0 where the driver does not say).
    pub used: u64,
}

/// One of a container's processes on a GPU, as the driver counts it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Traced {
    /// The container whose cgroup it runs in.
    pub container_id: String,
    /// The process and its memory there.
    pub process: ProcessMemory,
    /// When it started (see [`Processes::start_time`]): the pid with it names this
    /// process, not a later one given the same pid.
    pub start: Option<u64>,
}

/// `processes` traced to their containers through `lookup`: processes of no
/// container (the node's, an MPS server's) and gone ones are left out.
pub fn trace(processes: &[ProcessMemory], lookup: &dyn Processes) -> Vec<Traced> {
    processes
        .iter()
        .filter_map(|process| match lookup.cgroup(process.pid) {
            Lookup::Container(cgroup) => Some(Traced {
                container_id: cgroup.container_id,
                process: process.clone(),
                start: lookup.start_time(process.pid),
            }),
            Lookup::NotContainer | Lookup::Gone => None,
        })
        .collect()
}

/// Why the driver could not be read.
#[derive(Debug, thiserror::Error)]
#[error("GPU memory use: NVML: {0}")]
pub struct UsageError(String);

impl From<String> for UsageError {
    fn from(reason: String) -> Self {
        Self(reason)
    }
}

/// What the driver said of the node's GPUs.
#[derive(Debug, Default)]
pub struct GpuProcesses {
    /// Every compute process on every GPU read, with its memory.
    pub processes: Vec<ProcessMemory>,
    /// The GPUs that could not be read (a lost GPU, a MIG device), and why: the
    /// others are still reported.
    pub failed: Vec<UsageError>,
}

/// The driver's view of the processes on the node's GPUs.
pub trait GpuMemory: Send {
    /// Every compute process on every GPU it can read; an error only when none
    /// can be (the driver itself failed).
    fn processes(&mut self) -> Result<GpuProcesses, UsageError>;
}

/// The real driver.
pub struct NvmlGpuMemory {
    nvml: nvml_wrapper::Nvml,
}

impl std::fmt::Debug for NvmlGpuMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlGpuMemory").finish_non_exhaustive()
    }
}

impl NvmlGpuMemory {
    /// Loads NVML from `library`.
    pub fn open(library: &Path) -> Result<Self, UsageError> {
        Ok(Self {
            nvml: crate::nvml::load(library).map_err(UsageError)?,
        })
    }
}

impl GpuMemory for NvmlGpuMemory {
    fn processes(&mut self) -> Result<GpuProcesses, UsageError> {
        let count = self
            .nvml
            .device_count()
            .map_err(|e| UsageError(e.to_string()))?;
        let mut all = GpuProcesses::default();
        for index in 0..count {
            let read = || -> Result<Vec<ProcessMemory>, nvml_wrapper::error::NvmlError> {
                let device = self.nvml.device_by_index(index)?;
                let uuid = device.uuid()?;
                // A process with compute and graphics contexts is in both lists,
                // with its memory in each: counted once, the larger.
                let mut by_pid: BTreeMap<u32, u64> = BTreeMap::new();
                let graphics = match device.running_graphics_processes() {
                    Ok(list) => list,
                    // A GPU with no graphics (some data-centre parts) says so; an
                    // NVML without the call has none to list.
                    Err(
                        nvml_wrapper::error::NvmlError::NotSupported
                        | nvml_wrapper::error::NvmlError::FailedToLoadSymbol(_),
                    ) => Vec::new(),
                    Err(e) => return Err(e),
                };
                for process in device
                    .running_compute_processes()?
                    .into_iter()
                    .chain(graphics)
                {
                    let used = match process.used_gpu_memory {
                        nvml_wrapper::enums::device::UsedGpuMemory::Used(bytes) => bytes,
                        nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => 0,
                    };
                    let entry = by_pid.entry(process.pid).or_default();
                    *entry = (*entry).max(used);
                }
                Ok(by_pid
                    .into_iter()
                    .map(|(pid, used)| ProcessMemory {
                        gpu: uuid.clone(),
                        pid,
                        used,
                    })
                    .collect())
            };
            match read() {
                Ok(processes) => all.processes.extend(processes),
                Err(e) => all.failed.push(UsageError(format!("GPU {index}: {e}"))),
            }
        }
        if count > 0 && all.failed.len() == count as usize {
            return Err(UsageError(format!(
                "no GPU could be read: {}",
                all.failed
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; ")
            )));
        }
        Ok(all)
    }
}

/// Bytes per (container ID, GPU UUID), from `processes` traced through
/// `lookup` ([`trace`]). Processes of no container (the node's, an
/// MPS server's) and gone ones are left out; a container with processes whose
/// memory the driver does not give is still listed (0 bytes), for it is on the
/// GPU.
pub fn per_container(
    processes: &[ProcessMemory],
    lookup: &dyn Processes,
) -> BTreeMap<(String, String), u64> {
    sums(&trace(processes, lookup))
}

/// Bytes per (container ID, GPU UUID) of processes already traced.
pub fn sums(traced: &[Traced]) -> BTreeMap<(String, String), u64> {
    let mut sums = BTreeMap::new();
    for t in traced {
        let sum: &mut u64 = sums
            .entry((t.container_id.clone(), t.process.gpu.clone()))
            .or_default();
        *sum = sum.saturating_add(t.process.used);
    }
    sums
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::throttle::{Lookup, ProcessCgroup};

    struct Table;

    impl Processes for Table {
        fn cgroup(&self, pid: u32) -> Lookup {
            match pid {
                1 | 2 => Lookup::Container(ProcessCgroup {
                    container_id: "a".into(),
                    dir: "/sys/fs/cgroup/a".into(),
                }),
                3 => Lookup::Container(ProcessCgroup {
                    container_id: "b".into(),
                    dir: "/sys/fs/cgroup/b".into(),
                }),
                4 => Lookup::NotContainer,
                _ => Lookup::Gone,
            }
        }
    }

    #[test]
    fn memory_is_summed_per_container_and_gpu() {
        let p = |gpu: &str, pid, used| ProcessMemory {
            gpu: gpu.into(),
            pid,
            used,
        };
        let sums = per_container(
            &[
                p("GPU-0", 1, 10),
                p("GPU-0", 2, 5),
                p("GPU-1", 2, 7),
                p("GPU-0", 3, 0),
                p("GPU-0", 4, 99),
                p("GPU-0", 5, 99),
            ],
            &Table,
        );
        let want: BTreeMap<(String, String), u64> = [
            (("a".to_owned(), "GPU-0".to_owned()), 15),
            (("a".to_owned(), "GPU-1".to_owned()), 7),
            (("b".to_owned(), "GPU-0".to_owned()), 0),
        ]
        .into();
        assert_eq!(sums, want);
    }
}
