//! GPU compute mode through NVML: `EXCLUSIVE_PROCESS` while a GPU's MPS server
//! holds shares (only the server may then have a context on it), `DEFAULT`
//! again once it holds none. Reading it is anyone's; setting it is a privileged
//! driver control (`CAP_SYS_ADMIN`), done by the MPS supervisor.

use std::path::Path;

use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::ComputeMode as NvmlMode;

use crate::mps::{ComputeMode, GpuMode, MpsError};

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
        let nvml = crate::nvml::load(library).map_err(|reason| MpsError::ComputeMode {
            uuid: "(all)".into(),
            reason,
        })?;
        Ok(Self { nvml })
    }
}

impl ComputeMode for NvmlComputeMode {
    fn mode(&self, uuid: &str) -> Result<GpuMode, MpsError> {
        let error = |e: &dyn std::fmt::Display| MpsError::ComputeMode {
            uuid: uuid.to_owned(),
            reason: e.to_string(),
        };
        let device = self.nvml.device_by_uuid(uuid).map_err(|e| error(&e))?;
        Ok(match device.compute_mode().map_err(|e| error(&e))? {
            NvmlMode::ExclusiveProcess => GpuMode::ExclusiveProcess,
            NvmlMode::Prohibited => GpuMode::Prohibited,
            _ => GpuMode::Default,
        })
    }

    fn set(&self, uuid: &str, mode: GpuMode) -> Result<(), MpsError> {
        let error = |e: &dyn std::fmt::Display| MpsError::ComputeMode {
            uuid: uuid.to_owned(),
            reason: e.to_string(),
        };
        let mut device = self.nvml.device_by_uuid(uuid).map_err(|e| error(&e))?;
        let nvml_mode = match mode {
            GpuMode::Default => NvmlMode::Default,
            GpuMode::ExclusiveProcess => NvmlMode::ExclusiveProcess,
            GpuMode::Prohibited => NvmlMode::Prohibited,
        };
        device.set_compute_mode(nvml_mode).map_err(|e| error(&e))?;
        let held = device.compute_mode().map_err(|e| error(&e))?;
        if held != nvml_mode {
            return Err(error(&format!(
                "the driver reports compute mode {held:?} after {nvml_mode:?} was set"
            )));
        }
        Ok(())
    }
}
