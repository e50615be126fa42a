//! The node side of share enforcement: what makes a container's GPU share hold
//! whatever its processes do, rather than only when its image cooperates.
//!
//! - [`nvml`]: the driver's per-cgroup device-memory limits (NVML r615's
//!   `nvmlDeviceSetMemoryLimits_v1`), set as root on the container's own cgroup
//!   before its first process runs, and read back.
//! - [`cgroup`]: the container's cgroup v2 directory, from its init process.
//! - [`mps`]: NVIDIA's Multi-Process Service v3: a namespace per shared
//!   container, holding its compute share, on GPUs in exclusive-process mode;
//!   [`compute`] sets the mode.
//! - [`hami`]: HAMi-core's shared region, written with the grant by HAMi-core
//!   itself before the container's first process.
//! - [`usage`]: what each container holds of each GPU's memory, per the driver.
//! - [`apply_memory_limits`]: the rule both use: set every GPU's hard limit, read
//!   each back, and fail unless the driver holds exactly the grant.
//!
//! Which backend a node has and which a container got is decided by the GPU hook
//! (`tessera_hooks::gpu`); `docs/enforcement.md` has the threat model.

use std::fmt;
use std::path::Path;

pub mod cdi;
pub mod cgroup;
pub mod compute;
pub mod hami;
pub mod mps;
pub mod nvml;
pub mod oom;
mod process;
pub mod throttle;
pub mod usage;

pub use tessera_api::enforcement::{Backend, Holds, UnknownBackend, joined};

/// Writes `text` to `file` whole (a temporary file renamed over it).
pub fn write_whole(file: &Path, text: &str) -> std::io::Result<()> {
    let name = file
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let temp = file.with_file_name(format!(".{name}.tmp"));
    std::fs::write(&temp, text)?;
    std::fs::rename(&temp, file)
}

/// The limits the driver holds for one cgroup on one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CgroupLimits {
    /// Bytes guaranteed before allocations may fail under memory pressure.
    pub soft: u64,
    /// Bytes the cgroup's processes may allocate at most.
    pub hard: u64,
    /// Bytes they hold now.
    pub used: u64,
}

/// Why the driver's limit could not be set or read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    /// NVML does not have the call, or the driver does not support it.
    #[error("the driver does not support per-cgroup GPU memory limits ({0})")]
    Unsupported(String),
    /// The GPU is not one NVML knows.
    #[error("GPU {uuid}: {reason}")]
    Gpu { uuid: String, reason: String },
    /// NVML refused the call.
    #[error("GPU {uuid}, cgroup {cgroup}: NVML: {reason}")]
    Call {
        uuid: String,
        cgroup: String,
        reason: String,
    },
}

/// Sets and reads the driver's per-cgroup GPU memory limits. The real one is
/// [`nvml::NvmlMemoryLimits`]; tests use a recording double.
pub trait MemoryLimiter: Send + Sync + fmt::Debug {
    /// Sets the cgroup's soft and hard limit on the GPU to `bytes`.
    fn set(&self, uuid: &str, cgroup: &Path, bytes: u64) -> Result<(), LimitError>;
    /// The cgroup's limits on the GPU now.
    fn get(&self, uuid: &str, cgroup: &Path) -> Result<CgroupLimits, LimitError>;
}

/// One GPU's granted memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryLimit {
    /// The GPU's UUID.
    pub uuid: String,
    /// Its granted bytes.
    pub bytes: u64,
}

/// Why a container's limits are not in force.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnforceError {
    /// Setting or reading failed.
    #[error(transparent)]
    Limit(#[from] LimitError),
    /// The driver took the call but holds another limit.
    #[error(
        "GPU {uuid}, cgroup {cgroup}: the driver holds a hard limit of {held} bytes after {wanted} bytes were set"
    )]
    NotHeld {
        uuid: String,
        cgroup: String,
        wanted: u64,
        held: u64,
    },
}

/// Sets each GPU's limit on `cgroup` (soft = hard = the grant: the grant is
/// booked, so it is also guaranteed), then reads each back. Fails on the first
/// GPU whose limit is not exactly in force: the caller must then not start the
/// container.
pub fn apply_memory_limits(
    limiter: &dyn MemoryLimiter,
    cgroup: &Path,
    limits: &[MemoryLimit],
) -> Result<(), EnforceError> {
    for limit in limits {
        limiter.set(&limit.uuid, cgroup, limit.bytes)?;
        let held = limiter.get(&limit.uuid, cgroup)?;
        if held.hard != limit.bytes {
            return Err(EnforceError::NotHeld {
                uuid: limit.uuid.clone(),
                cgroup: cgroup.display().to_string(),
                wanted: limit.bytes,
                held: held.hard,
            });
        }
    }
    Ok(())
}

/// Why the OCI hook did not put a container's limits in force.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HookError {
    /// The OCI state on stdin is not one.
    #[error("OCI state on stdin: {0}")]
    State(String),
    /// The container's cgroup could not be found.
    #[error(transparent)]
    Cgroup(#[from] cgroup::CgroupError),
    /// The limits are not in force.
    #[error(transparent)]
    Enforce(#[from] EnforceError),
}

/// The `createRuntime` hook's work: the container's init process from the OCI
/// `state` (JSON, as the runtime writes it on the hook's stdin), its cgroup,
/// and `limits` set there and read back. Returns the cgroup.
pub fn hook_memory_limits(
    state: &[u8],
    limits: &[MemoryLimit],
    limiter: &dyn MemoryLimiter,
    proc_root: &Path,
    cgroup_root: &Path,
) -> Result<std::path::PathBuf, HookError> {
    let state: serde_json::Value =
        serde_json::from_slice(state).map_err(|e| HookError::State(e.to_string()))?;
    let pid = state
        .get("pid")
        .and_then(serde_json::Value::as_u64)
        .and_then(|pid| u32::try_from(pid).ok())
        .filter(|pid| *pid > 0)
        .ok_or_else(|| HookError::State(format!("no process id (\"pid\") in {state}")))?;
    let dir = cgroup::of_pid(proc_root, cgroup_root, pid)?;
    apply_memory_limits(limiter, &dir, limits)?;
    Ok(dir)
}

/// Parses `UUID=BYTES`.
pub fn parse_limit(text: &str) -> Result<MemoryLimit, String> {
    let (uuid, bytes) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?}: expected GPU-UUID=BYTES"))?;
    if !uuid.starts_with("GPU-") {
        return Err(format!("{text:?}: {uuid:?} is not a GPU UUID (GPU-…)"));
    }
    let bytes = bytes
        .parse::<u64>()
        .ok()
        .filter(|b| *b > 0)
        .ok_or_else(|| format!("{text:?}: {bytes:?} is not a positive number of bytes"))?;
    Ok(MemoryLimit {
        uuid: uuid.to_owned(),
        bytes,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::path::PathBuf;
    use std::sync::Mutex;

    use super::*;

    /// Records limits; `lie` makes reads answer another hard limit.
    #[derive(Debug, Default)]
    struct Recording {
        held: Mutex<HashMap<(String, PathBuf), u64>>,
        lie: Option<u64>,
    }

    impl MemoryLimiter for Recording {
        fn set(&self, uuid: &str, cgroup: &Path, bytes: u64) -> Result<(), LimitError> {
            if uuid == "GPU-gone" {
                return Err(LimitError::Gpu {
                    uuid: uuid.into(),
                    reason: "not found".into(),
                });
            }
            self.held
                .lock()
                .map_err(|_| LimitError::Unsupported("poisoned".into()))?
                .insert((uuid.into(), cgroup.into()), bytes);
            Ok(())
        }

        fn get(&self, uuid: &str, cgroup: &Path) -> Result<CgroupLimits, LimitError> {
            let held = self
                .held
                .lock()
                .map_err(|_| LimitError::Unsupported("poisoned".into()))?;
            let hard = held
                .get(&(uuid.to_owned(), cgroup.to_owned()))
                .copied()
                .unwrap_or(u64::MAX);
            Ok(CgroupLimits {
                soft: 0,
                hard: self.lie.unwrap_or(hard),
                used: 0,
            })
        }
    }

    fn limit(uuid: &str, bytes: u64) -> MemoryLimit {
        MemoryLimit {
            uuid: uuid.into(),
            bytes,
        }
    }

    #[test]
    fn every_gpu_is_set_and_read_back() -> Result<(), EnforceError> {
        let limiter = Recording::default();
        let cgroup = Path::new("/sys/fs/cgroup/pod/ctr");
        apply_memory_limits(
            &limiter,
            cgroup,
            &[limit("GPU-a", 8 << 30), limit("GPU-b", 4 << 30)],
        )?;
        assert_eq!(limiter.get("GPU-a", cgroup)?.hard, 8 << 30);
        assert_eq!(limiter.get("GPU-b", cgroup)?.hard, 4 << 30);
        Ok(())
    }

    #[test]
    fn a_limit_the_driver_does_not_hold_fails() {
        let limiter = Recording {
            lie: Some(u64::MAX),
            ..Recording::default()
        };
        let error = apply_memory_limits(&limiter, Path::new("/cg"), &[limit("GPU-a", 1 << 30)]);
        assert_eq!(
            error,
            Err(EnforceError::NotHeld {
                uuid: "GPU-a".into(),
                cgroup: "/cg".into(),
                wanted: 1 << 30,
                held: u64::MAX
            })
        );
    }

    #[test]
    fn a_failed_set_stops_before_later_gpus() {
        let limiter = Recording::default();
        let result = apply_memory_limits(
            &limiter,
            Path::new("/cg"),
            &[limit("GPU-gone", 1), limit("GPU-b", 2)],
        );
        assert!(matches!(
            result,
            Err(EnforceError::Limit(LimitError::Gpu { .. }))
        ));
        assert!(limiter.held.lock().map(|h| h.is_empty()).unwrap_or(false));
    }

    #[test]
    fn the_hook_finds_the_process_cgroup_and_sets_it() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let (proc_root, cgroup_root) = (dir.path().join("proc"), dir.path().join("cg"));
        std::fs::create_dir_all(proc_root.join("77"))?;
        std::fs::create_dir_all(cgroup_root.join("kubepods/pod1/ctr"))?;
        std::fs::write(proc_root.join("77/cgroup"), "0::/kubepods/pod1/ctr\n")?;
        let limiter = Recording::default();
        let state =
            br#"{"ociVersion":"1.2.0","id":"c1","status":"creating","pid":77,"bundle":"/b"}"#;
        let cgroup = hook_memory_limits(
            state,
            &[limit("GPU-a", 5 << 30)],
            &limiter,
            &proc_root,
            &cgroup_root,
        )?;
        assert_eq!(cgroup, cgroup_root.join("kubepods/pod1/ctr"));
        assert_eq!(limiter.get("GPU-a", &cgroup)?.hard, 5 << 30);

        for bad in [&b"{}"[..], b"not json", br#"{"pid":0}"#] {
            let error = hook_memory_limits(bad, &[], &limiter, &proc_root, &cgroup_root);
            assert!(matches!(error, Err(HookError::State(_))), "{error:?}");
        }
        Ok(())
    }

    #[test]
    fn limits_parse_or_name_what_is_wrong() {
        assert_eq!(parse_limit("GPU-a=1024"), Ok(limit("GPU-a", 1024)));
        for bad in ["GPU-a", "nope=1", "GPU-a=0", "GPU-a=-1", "GPU-a=1Gi"] {
            let error = parse_limit(bad).err().unwrap_or_default();
            assert!(error.contains(bad), "{bad}: {error}");
        }
    }
}
