//! The driver's memory limits reach a container through a CDI device of
//! Tessera's own, whose only edit is an OCI `createRuntime` hook.
//!
//! Why there: containerd's CRI `CreateContainer` only records the container;
//! `StartContainer` runs `runc create` and `runc start` back to back, so a CRI
//! proxy never sees the container's cgroup before its process runs. runc runs
//! `createRuntime` hooks inside `runc create`, after it has put the container's
//! init process in the container's cgroup and before that process executes
//! anything of the image: the one moment the cgroup exists and nothing in it has
//! touched the GPU. A hook that fails fails `runc create`, so the container never
//! starts without its limit. A container kubelet restarts is a new container and
//! runs the hook again.
//!
//! The runtime proxy writes a spec file per shared container ([`spec_file`],
//! its device named by [`device_name`]) when the pod's sandbox is created, before
//! any of its containers, and removes them with the pod.

use std::path::Path;

use serde_json::{Value, json};

use crate::MemoryLimit;

/// The CDI kind of Tessera's enforcement devices.
pub const KIND: &str = "tessera.io/enforce";
/// The CDI spec version written: hooks and `createRuntime` need 0.5.0 or later.
pub const CDI_VERSION: &str = "0.6.0";

/// Whether `text` is a valid CDI device name (`[A-Za-z0-9][A-Za-z0-9_.:-]*`).
fn valid_name(text: &str) -> bool {
    let mut bytes = text.bytes();
    bytes.next().is_some_and(|b| b.is_ascii_alphanumeric())
        && bytes.all(|b| b.is_ascii_alphanumeric() || b"_.:-".contains(&b))
}

/// The device of a pod's container: `<pod UID>_<container>`, or `None` when
/// either part is not fit for a CDI name (kubelet's never are).
pub fn device_name(pod_uid: &str, container: &str) -> Option<String> {
    let name = format!("{pod_uid}_{container}");
    (valid_name(pod_uid) && valid_name(container) && !container.contains('_')).then_some(name)
}

/// The fully qualified device (`tessera.io/enforce=<name>`).
pub fn qualified(name: &str) -> String {
    format!("{KIND}={name}")
}

/// The spec file of a device ([`device_name`]) in a CDI spec directory:
/// `tessera-enforce-<pod UID>_<container>.json`, so a pod's files share a prefix.
pub fn spec_file(dir: &Path, device: &str) -> std::path::PathBuf {
    dir.join(format!("tessera-enforce-{device}.json"))
}

/// What the hook runs: the `tessera-enforce` binary and the NVML library it loads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HookCommand {
    /// The binary's path on the host.
    pub binary: std::path::PathBuf,
    /// The NVML library it loads.
    pub nvml_library: std::path::PathBuf,
}

impl HookCommand {
    /// The hook's argv for `limits`.
    pub fn args(&self, limits: &[MemoryLimit]) -> Vec<String> {
        let mut args = vec![
            "tessera-enforce".to_owned(),
            "memory-limits".to_owned(),
            format!("--nvml-library={}", self.nvml_library.display()),
        ];
        args.extend(
            limits
                .iter()
                .map(|l| format!("--limit={}={}", l.uuid, l.bytes)),
        );
        args
    }
}

/// A pod's CDI spec: for each shared container, named by [`device_name`], one
/// `createRuntime` hook setting its limits. Containers whose names cannot name a
/// device are left out (their creation is refused by the GPU hook).
pub fn pod_spec(
    pod_uid: &str,
    containers: &[(String, Vec<MemoryLimit>)],
    hook: &HookCommand,
) -> Value {
    let devices: Vec<Value> = containers
        .iter()
        .filter(|(_, limits)| !limits.is_empty())
        .filter_map(|(container, limits)| {
            let name = device_name(pod_uid, container)?;
            Some(json!({
                "name": name,
                "containerEdits": {
                    "hooks": [{
                        "hookName": "createRuntime",
                        "path": hook.binary.display().to_string(),
                        "args": hook.args(limits),
                        "timeout": 10,
                    }],
                },
            }))
        })
        .collect();
    json!({"cdiVersion": CDI_VERSION, "kind": KIND, "devices": devices})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hook() -> HookCommand {
        HookCommand {
            binary: "/usr/local/bin/tessera-enforce".into(),
            nvml_library: "libnvidia-ml.so.1".into(),
        }
    }

    #[test]
    fn names_are_cdi_names_or_none() {
        assert_eq!(
            device_name("5f0c-11", "main").as_deref(),
            Some("5f0c-11_main")
        );
        assert_eq!(device_name("5f0c", "a_b"), None);
        assert_eq!(device_name("../x", "main"), None);
        assert_eq!(device_name("", "main"), None);
        assert_eq!(device_name("uid", "-x"), None);
        assert_eq!(qualified("u_main"), "tessera.io/enforce=u_main");
    }

    #[test]
    fn a_pod_spec_has_a_hook_per_shared_container() {
        let limits = vec![
            MemoryLimit {
                uuid: "GPU-a".into(),
                bytes: 20 << 30,
            },
            MemoryLimit {
                uuid: "GPU-b".into(),
                bytes: 1 << 30,
            },
        ];
        let spec = pod_spec(
            "uid-1",
            &[
                ("main".into(), limits),
                ("sidecar".into(), Vec::new()),
                (
                    "bad_name".into(),
                    vec![MemoryLimit {
                        uuid: "GPU-a".into(),
                        bytes: 1,
                    }],
                ),
            ],
            &hook(),
        );
        assert_eq!(
            spec,
            json!({
                "cdiVersion": "0.6.0",
                "kind": "tessera.io/enforce",
                "devices": [{
                    "name": "uid-1_main",
                    "containerEdits": {"hooks": [{
                        "hookName": "createRuntime",
                        "path": "/usr/local/bin/tessera-enforce",
                        "args": ["tessera-enforce", "memory-limits", "--nvml-library=libnvidia-ml.so.1",
                                 "--limit=GPU-a=21474836480", "--limit=GPU-b=1073741824"],
                        "timeout": 10,
                    }]},
                }],
            })
        );
    }
}
