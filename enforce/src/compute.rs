//! GPU compute mode through NVML: `EXCLUSIVE_PROCESS` while a GPU's MPS server
//! holds shares (only the server may then have a context on it), `DEFAULT`
//! again once it holds none. Reading it is anyone's; setting it is a privileged
//! driver control (`CAP_SYS_ADMIN`), done by the MPS supervisor.

use std::path::Path;

use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::ComputeMode as NvmlMode;

use crate::mps::{ComputeMode, MpsError};

/// NVML, loaded from the node's library, setting compute modes (needs root).
pub struct NvmlComputeMode {
    nvml: Nvml,
}

impl std::fmt::Debug for NvmlComputeMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlComputeMode").finish_non_exhaustive()
    }
}

impl NvmlComputeMode {
    /// Loads and initialises NVML from `library`.
    pub fn open(library: &Path) -> Result<Self, MpsError> {
        let nvml = Nvml::builder()
            .lib_path(library.as_os_str())
            .init()
            .map_err(|e| MpsError::ComputeMode {
                uuid: "(all)".into(),
                reason: format!("loading NVML from {}: {e}", library.display()),
            })?;
        Ok(Self { nvml })
    }
}

impl ComputeMode for NvmlComputeMode {
    fn is_exclusive(&self, uuid: &str) -> Result<bool, MpsError> {
        let error = |e: &dyn std::fmt::Display| MpsError::ComputeMode {
            uuid: uuid.to_owned(),
            reason: e.to_string(),
        };
        let device = self.nvml.device_by_uuid(uuid).map_err(|e| error(&e))?;
        Ok(device.compute_mode().map_err(|e| error(&e))? == NvmlMode::ExclusiveProcess)
    }

    fn set_exclusive(&self, uuid: &str, exclusive: bool) -> Result<(), MpsError> {
        let error = |e: &dyn std::fmt::Display| MpsError::ComputeMode {
            uuid: uuid.to_owned(),
            reason: e.to_string(),
        };
        let mut device = self.nvml.device_by_uuid(uuid).map_err(|e| error(&e))?;
        let mode = if exclusive {
            NvmlMode::ExclusiveProcess
        } else {
            NvmlMode::Default
        };
        device.set_compute_mode(mode).map_err(|e| error(&e))?;
        let held = device.compute_mode().map_err(|e| error(&e))?;
        if held != mode {
            return Err(error(&format!(
                "the driver reports compute mode {held:?} after {mode:?} was set"
            )));
        }
        Ok(())
    }
}
