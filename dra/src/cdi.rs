//! A prepared claim's CDI spec: one CDI device per allocation result, whose edits
//! give the GPU's device nodes and `NVIDIA_VISIBLE_DEVICES` (and, for a share,
//! the limiter env Tessera's GPU hook sets). The runtime proxy replaces these
//! devices with its own edits of the same grant plus its enforcement (the GPU
//! hook, docs/dra.md): the spec is what the claim means to a reader of the CDI
//! directory, the proxy is what holds it.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use tessera_api::dra::prepared::PreparedClaim;

use crate::prepare::CDI_KIND;

/// The CDI version the spec declares (hooks, device nodes and env need no more).
const CDI_VERSION: &str = "0.6.0";
/// Control nodes a GPU process opens, given where the host has them.
const CONTROL_NODES: &[&str] = &["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"];
/// The spec files' name prefix: `gpu.tessera.io-claim_<UID>.json`.
pub const SPEC_PREFIX: &str = "gpu.tessera.io-claim_";

/// Writes and removes claims' spec files in the runtime's CDI directory.
#[derive(Debug, Clone)]
pub struct CdiSpecs {
    /// The runtime's CDI directory (`/var/run/cdi`).
    pub dir: PathBuf,
    /// Where the host's device nodes are (`/dev`).
    pub dev_root: PathBuf,
}

impl CdiSpecs {
    /// The spec file of the claim with `uid`.
    pub fn path(&self, uid: &str) -> PathBuf {
        self.dir.join(format!("{SPEC_PREFIX}{uid}.json"))
    }

    /// The spec of `claim`.
    pub fn spec(&self, claim: &PreparedClaim) -> Value {
        let controls: Vec<&str> = CONTROL_NODES
            .iter()
            .copied()
            .filter(|name| self.dev_root.join(name).exists())
            .collect();
        let devices: Vec<Value> = claim
            .devices
            .iter()
            .map(|device| {
                let name = device
                    .cdi_device
                    .split_once('=')
                    .map_or(device.cdi_device.as_str(), |(_, name)| name);
                let mut env = vec![format!("NVIDIA_VISIBLE_DEVICES={}", device.uuid)];
                if !device.is_whole() {
                    env.push(format!(
                        "CUDA_DEVICE_MEMORY_LIMIT_0={}m",
                        device.memory >> 20
                    ));
                    if device.cores > 0 {
                        env.push(format!("CUDA_DEVICE_SM_LIMIT={}", device.cores));
                    }
                }
                let nodes: Vec<Value> = std::iter::once(format!("nvidia{}", device.minor))
                    .chain(controls.iter().map(|c| (*c).to_owned()))
                    .map(|node| {
                        json!({
                            "path": format!("/dev/{node}"),
                            "hostPath": self.dev_root.join(&node).display().to_string(),
                        })
                    })
                    .collect();
                json!({"name": name, "containerEdits": {"env": env, "deviceNodes": nodes}})
            })
            .collect();
        json!({"cdiVersion": CDI_VERSION, "kind": CDI_KIND, "devices": devices})
    }

    /// Writes `claim`'s spec (atomically: the runtime watches the directory).
    pub fn write(&self, claim: &PreparedClaim) -> std::io::Result<()> {
        std::fs::create_dir_all(&self.dir)?;
        let path = self.path(&claim.uid);
        let temp = self.dir.join(format!(".{SPEC_PREFIX}{}.tmp", claim.uid));
        std::fs::write(&temp, self.spec(claim).to_string())?;
        std::fs::rename(&temp, &path)
    }

    /// Removes the spec of the claim with `uid`; gone already is fine.
    pub fn remove(&self, uid: &str) -> std::io::Result<()> {
        match std::fs::remove_file(self.path(uid)) {
            Err(error) if error.kind() != std::io::ErrorKind::NotFound => Err(error),
            _ => Ok(()),
        }
    }

    /// Removes spec files of claims not in `keep` (a crash between the
    /// checkpoint and the spec): returns how many.
    pub fn sweep(&self, keep: &dyn Fn(&str) -> bool) -> usize {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return 0;
        };
        entries
            .filter_map(Result::ok)
            .filter_map(|entry| {
                let name = entry.file_name().to_string_lossy().into_owned();
                let uid = name.strip_prefix(SPEC_PREFIX)?.strip_suffix(".json")?;
                (!keep(uid)).then(|| entry.path())
            })
            .filter(|path| std::fs::remove_file(path).is_ok())
            .count()
    }
}

/// Whether `dir` holds a spec of the claim `uid`, for tests and messages.
pub fn has_spec(dir: &Path, uid: &str) -> bool {
    dir.join(format!("{SPEC_PREFIX}{uid}.json")).exists()
}
