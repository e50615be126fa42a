//! The driver's per-cgroup GPU memory limits, through NVML r615's
//! `nvmlDeviceSetMemoryLimits_v1` / `nvmlDeviceGetMemoryLimits_v1`.
//!
//! nvml-wrapper does not bind these two calls, so they are looked up by name in
//! the library nvml-wrapper loaded (the same instance, initialised once) and
//! called here: the only unsafe code outside the fake NVML. A library without
//! the symbols (drivers before r615, e.g. 580) is reported as
//! [`LimitError::Unsupported`], never called.
//!
//! The structs, as NVML's header and nvidia-ml-py 13.615 declare them (no version
//! field): `{const char *nameSpace; unsigned long long softLimit, hardLimit;}` and
//! the same with `currentUsed` for reads. `nameSpace` is the cgroup's full sysfs
//! path (`/sys/fs/cgroup/…/cri-containerd-<id>.scope`).
#![allow(unsafe_code)]

use std::ffi::{CString, c_char, c_ulonglong};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use nvml_wrapper::Nvml;
use nvml_wrapper_sys::bindings::{nvmlDevice_t, nvmlReturn_t};

use crate::{CgroupLimits, LimitError, MemoryLimiter};

/// `NVML_DEVICE_MEMORY_LIMIT_MAX`: a hard limit of this much is no limit.
pub const LIMIT_MAX: u64 = u64::MAX;

#[repr(C)]
struct SetMemoryLimitsV1 {
    name_space: *const c_char,
    soft_limit: c_ulonglong,
    hard_limit: c_ulonglong,
}

#[repr(C)]
struct GetMemoryLimitsV1 {
    name_space: *const c_char,
    soft_limit: c_ulonglong,
    hard_limit: c_ulonglong,
    current_used: c_ulonglong,
}

type SetFn = unsafe extern "C" fn(nvmlDevice_t, *mut SetMemoryLimitsV1) -> nvmlReturn_t;
type GetFn = unsafe extern "C" fn(nvmlDevice_t, *mut GetMemoryLimitsV1) -> nvmlReturn_t;

const SUCCESS: nvmlReturn_t = 0;

/// NVML loaded from `library` and initialised, or why not, in words.
pub(crate) fn load(library: &Path) -> Result<Nvml, String> {
    tessera_daemon::nvml::open(library).map_err(|e| {
        format!(
            "loading NVML from {}: {}",
            library.display(),
            e.nvml_error()
        )
    })
}

/// NVML's name of a return code, for messages.
fn return_name(code: nvmlReturn_t) -> String {
    let name = match code {
        1 => "NVML_ERROR_UNINITIALIZED",
        2 => "NVML_ERROR_INVALID_ARGUMENT",
        3 => "NVML_ERROR_NOT_SUPPORTED",
        4 => "NVML_ERROR_NO_PERMISSION (setting limits needs root)",
        6 => "NVML_ERROR_NOT_FOUND",
        9 => "NVML_ERROR_DRIVER_NOT_LOADED",
        13 => "NVML_ERROR_FUNCTION_NOT_FOUND",
        15 => "NVML_ERROR_GPU_IS_LOST",
        999 => "NVML_ERROR_UNKNOWN",
        _ => return format!("NVML error {code}"),
    };
    name.into()
}

/// The driver's limits, through the NVML library the node agent loaded.
pub struct NvmlMemoryLimits {
    nvml: Nvml,
    set: SetFn,
    get: GetFn,
}

impl std::fmt::Debug for NvmlMemoryLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlMemoryLimits").finish_non_exhaustive()
    }
}

impl NvmlMemoryLimits {
    /// Loads NVML from `library` and finds the two calls, then asks the driver
    /// once (the root cgroup's limits on the first GPU) whether it supports them:
    /// the symbols alone do not say that the kernel driver does.
    pub fn open(library: &Path) -> Result<Self, LimitError> {
        let nvml = load(library).map_err(LimitError::Unsupported)?;
        let lib = &nvml.lib().__library;
        // SAFETY: the symbols are NVML's, with the signatures above (NVML r615's
        // header); the function pointers are copied out and used only while
        // `nvml`, which owns the library, lives: they are fields of one struct.
        let (set, get) = unsafe {
            let set = lib.get::<SetFn>(b"nvmlDeviceSetMemoryLimits_v1\0");
            let get = lib.get::<GetFn>(b"nvmlDeviceGetMemoryLimits_v1\0");
            match (set, get) {
                (Ok(set), Ok(get)) => (*set, *get),
                (Err(e), _) | (_, Err(e)) => {
                    return Err(LimitError::Unsupported(format!(
                        "{} has no nvmlDeviceSetMemoryLimits_v1/nvmlDeviceGetMemoryLimits_v1 (driver before r615): {e}",
                        library.display()
                    )));
                }
            }
        };
        let limits = Self { nvml, set, get };
        let first = limits
            .nvml
            .device_by_index(0)
            .and_then(|d| d.uuid())
            .map_err(|e| LimitError::Unsupported(format!("no GPU to ask: {e}")))?;
        match limits.get(&first, &crate::cgroup::host_v2_mount()) {
            Err(LimitError::Call { reason, .. })
                if reason.contains("NOT_SUPPORTED") || reason.contains("FUNCTION_NOT_FOUND") =>
            {
                Err(LimitError::Unsupported(reason))
            }
            // Any other answer means the call exists in the driver: the root cgroup
            // may well be refused as a target without that saying anything.
            _ => Ok(limits),
        }
    }

    fn device(&self, uuid: &str) -> Result<nvmlDevice_t, LimitError> {
        let device = self
            .nvml
            .device_by_uuid(uuid)
            .map_err(|e| LimitError::Gpu {
                uuid: uuid.into(),
                reason: e.to_string(),
            })?;
        // SAFETY: the handle stays valid while `self.nvml` is initialised, and
        // is only passed to NVML below, within `&self`'s lifetime.
        Ok(unsafe { device.handle() })
    }
}

fn c_path(uuid: &str, cgroup: &Path) -> Result<CString, LimitError> {
    CString::new(cgroup.as_os_str().as_bytes()).map_err(|_| LimitError::Call {
        uuid: uuid.into(),
        cgroup: cgroup.display().to_string(),
        reason: "cgroup path holds a NUL byte".into(),
    })
}

/// NOT_SUPPORTED and FUNCTION_NOT_FOUND keep NVML's name in the reason, which
/// [`NvmlMemoryLimits::open`] reads to tell an unsupported driver apart.
fn call_error(uuid: &str, cgroup: &Path, code: nvmlReturn_t) -> LimitError {
    LimitError::Call {
        uuid: uuid.into(),
        cgroup: cgroup.display().to_string(),
        reason: return_name(code),
    }
}

impl MemoryLimiter for NvmlMemoryLimits {
    fn set(&self, uuid: &str, cgroup: &Path, bytes: u64) -> Result<(), LimitError> {
        let device = self.device(uuid)?;
        let name_space = c_path(uuid, cgroup)?;
        let mut limits = SetMemoryLimitsV1 {
            name_space: name_space.as_ptr(),
            soft_limit: bytes,
            hard_limit: bytes,
        };
        // SAFETY: `device` is a live handle of this library; `limits` and the
        // string it points to outlive the call, which only reads them.
        let code = unsafe { (self.set)(device, &mut limits) };
        if code != SUCCESS {
            return Err(call_error(uuid, cgroup, code));
        }
        Ok(())
    }

    fn get(&self, uuid: &str, cgroup: &Path) -> Result<CgroupLimits, LimitError> {
        let device = self.device(uuid)?;
        let name_space = c_path(uuid, cgroup)?;
        let mut limits = GetMemoryLimitsV1 {
            name_space: name_space.as_ptr(),
            soft_limit: 0,
            hard_limit: 0,
            current_used: 0,
        };
        // SAFETY: as in `set`; the driver writes the three out fields of `limits`.
        let code = unsafe { (self.get)(device, &mut limits) };
        if code != SUCCESS {
            return Err(call_error(uuid, cgroup, code));
        }
        Ok(CgroupLimits {
            soft: limits.soft_limit,
            hard: limits.hard_limit,
            used: limits.current_used,
        })
    }
}
