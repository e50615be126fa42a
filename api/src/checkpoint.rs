//! kubelet's device-manager checkpoint
//! (`/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint`): which devices
//! kubelet gave to which container through a device plugin.
//!
//! Both formats are read: 1.20+ (`DeviceIDs` keyed by NUMA node as JSON strings,
//! `"-1"` for none) and older (a plain list). `AllocResp` (base64 of the plugin's
//! protobuf `ContainerAllocateResponse`) is decoded for `NVIDIA_VISIBLE_DEVICES`, the
//! toolkit's other device variables ([`DEVICE_SWITCHES`]), mounts and device nodes.
//! `Checksum` is kubelet's FNV-32a over a Go dump of `Data`
//! that cannot be reproduced outside Go: the file is read leniently and entries are
//! cross-checked against the pods on the node by the caller.
//!
//! The NVIDIA container toolkit's names live here too: they are what the device
//! plugin writes into `AllocResp`, and the GPU hook reads and writes the same ones.

use std::collections::{BTreeMap, HashMap};

use base64::Engine;
use prost::Message;
use serde::Deserialize;

use crate::LegacyDeviceEntry;

// === the NVIDIA container toolkit's names ===

/// The env the toolkit reads to pick GPUs: UUIDs, indices, `all`, `none`, `void`.
pub const VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";

/// The volume-mounts device-list strategy: a mount of `/dev/null` at `<root>/<id>`
/// names device `<id>`. The toolkit (with `accept-nvidia-visible-devices-as-volume-mounts`)
/// reads these before the env, and matches the root as a plain string prefix.
pub const DEVICE_LIST_MOUNT_ROOT: &str = "/var/run/nvidia-container-devices";

/// The toolkit's env variables that inject devices besides `NVIDIA_VISIBLE_DEVICES`,
/// each with the value that switches it off. The four feature switches read
/// `enabled`/`true` as on and `disabled`/`false` as off, anything else (unset
/// included) as the node's config default, so off is said explicitly. The three
/// lists name channels or MIG devices; empty names none.
pub const DEVICE_SWITCHES: &[(&str, &str)] = &[
    // All RDMA (/dev/infiniband/*) devices of the node.
    ("NVIDIA_MOFED", "disabled"),
    // NVSwitch fabric devices (/dev/nvidia-nvswitch*).
    ("NVIDIA_NVSWITCH", "disabled"),
    // GPUDirect Storage (/dev/nvidia-fs*).
    ("NVIDIA_GDS", "disabled"),
    // GDRCopy (/dev/gdrdrv).
    ("NVIDIA_GDRCOPY", "disabled"),
    // IMEX channels (/dev/nvidia-caps-imex-channels/channel<N>): memory shared across nodes.
    ("NVIDIA_IMEX_CHANNELS", ""),
    // MIG configuration and monitoring capabilities (privileged containers).
    ("NVIDIA_MIG_CONFIG_DEVICES", ""),
    ("NVIDIA_MIG_MONITOR_DEVICES", ""),
];

/// A device ID without a time-slicing replica suffix: `GPU-…::3` → `GPU-…`.
pub fn without_replica(id: &str) -> &str {
    id.split("::").next().unwrap_or(id)
}

/// Whether `id` is a GPU or MIG device UUID (`GPU-…`, `MIG-…`), as opposed to an
/// index, a path or another plugin's name.
pub fn is_device_uuid(id: &str) -> bool {
    ["GPU-", "MIG-"].iter().any(|prefix| {
        id.len() > prefix.len()
            && id
                .get(..prefix.len())
                .is_some_and(|head| head.eq_ignore_ascii_case(prefix))
    })
}

/// The NVML index of the GPU a device ID names under the device plugin's
/// `--device-id-strategy index`: `2` (a GPU) or `2:1` (MIG device 1 on GPU 2),
/// replica suffix or not.
pub fn gpu_index(id: &str) -> Option<u32> {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let id = without_replica(id);
    let (gpu, mig) = match id.split_once(':') {
        Some((gpu, mig)) => (gpu, Some(mig)),
        None => (id, None),
    };
    if !digits(gpu) || mig.is_some_and(|mig| !digits(mig)) {
        return None;
    }
    gpu.parse().ok()
}

/// Why the checkpoint cannot be used. The last good state stays published.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Not JSON of the checkpoint's shape (truncated, corrupt, another file).
    #[error("not a kubelet device checkpoint")]
    Json(#[source] serde_json::Error),
    /// An entry's `AllocResp` is not base64.
    #[error("PodDeviceEntries[{index}].AllocResp: not base64")]
    Base64 {
        index: usize,
        #[source]
        source: base64::DecodeError,
    },
    /// An entry's `AllocResp` is not a ContainerAllocateResponse.
    #[error("PodDeviceEntries[{index}].AllocResp: not a ContainerAllocateResponse")]
    Protobuf {
        index: usize,
        #[source]
        source: prost::DecodeError,
    },
    /// A `DeviceIDs` NUMA key is not a number.
    #[error("PodDeviceEntries[{index}].DeviceIDs: NUMA node key {key:?} is not a number")]
    NumaKey { index: usize, key: String },
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct File {
    data: Data,
    #[serde(default)]
    checksum: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Data {
    #[serde(default)]
    pod_device_entries: Option<Vec<RawEntry>>,
    #[serde(default)]
    registered_devices: Option<BTreeMap<String, Vec<String>>>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct RawEntry {
    #[serde(rename = "PodUID")]
    pod_uid: String,
    container_name: String,
    resource_name: String,
    #[serde(rename = "DeviceIDs")]
    device_ids: DeviceIds,
    #[serde(default)]
    alloc_resp: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum DeviceIds {
    /// 1.20+: NUMA node → device IDs.
    ByNuma(BTreeMap<String, Vec<String>>),
    /// Before 1.20.
    Plain(Vec<String>),
}

/// The device plugin's `ContainerAllocateResponse` (k8s.io/kubelet deviceplugin v1beta1),
/// only the fields read here.
#[derive(Clone, PartialEq, Message)]
struct ContainerAllocateResponse {
    #[prost(map = "string, string", tag = "1")]
    envs: HashMap<String, String>,
    #[prost(message, repeated, tag = "2")]
    mounts: Vec<MountSpec>,
    #[prost(message, repeated, tag = "3")]
    devices: Vec<DeviceSpec>,
}

#[derive(Clone, PartialEq, Message)]
struct MountSpec {
    #[prost(string, tag = "1")]
    container_path: String,
    #[prost(string, tag = "2")]
    host_path: String,
    #[prost(bool, tag = "3")]
    read_only: bool,
}

#[derive(Clone, PartialEq, Message)]
struct DeviceSpec {
    #[prost(string, tag = "1")]
    container_path: String,
    #[prost(string, tag = "2")]
    host_path: String,
    #[prost(string, tag = "3")]
    permissions: String,
}

/// One container's device-plugin allocation.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointEntry {
    /// The pod's UID.
    #[serde(rename = "podUID")]
    pub pod_uid: String,
    /// The container's name.
    pub container_name: String,
    /// The extended resource (`nvidia.com/gpu`).
    pub resource_name: String,
    /// kubelet's device IDs, in NUMA-node order.
    #[serde(rename = "deviceIDs")]
    pub device_ids: Vec<String>,
    /// The NUMA nodes they sit on (-1: none), when the file records them.
    pub numa_nodes: Vec<i64>,
    /// `NVIDIA_VISIBLE_DEVICES` the plugin gave the container, split on commas: GPU
    /// UUIDs, or indices, the volume-mounts path, `void`, `tegra`, … as the plugin
    /// is set up.
    pub visible_devices: Vec<String>,
    /// The plugin's values of the toolkit's other device variables ([`DEVICE_SWITCHES`]).
    pub device_envs: BTreeMap<String, String>,
    /// Container paths of the plugin's mounts (the volume-mounts strategy's
    /// `/var/run/nvidia-container-devices/<id>` among them).
    pub mounts: Vec<String>,
    /// Device nodes the plugin gave the container (host paths).
    pub device_nodes: Vec<String>,
}

impl CheckpointEntry {
    /// The devices the container holds, by ID: the plugin's `NVIDIA_VISIBLE_DEVICES`
    /// when every item of it is a GPU or MIG UUID, else kubelet's device IDs (the
    /// plugin's value may be a path, `void`, `tegra` or indices, none of which the
    /// scheduler can match to a GPU). Replica suffixes (`GPU-…::1`, from
    /// time-slicing) stripped, duplicates dropped. Under `--device-id-strategy index`
    /// these are NVML indices; [`Self::legacy_entry`] maps them to UUIDs.
    pub fn gpu_ids(&self) -> Vec<String> {
        let names_uuids = !self.visible_devices.is_empty()
            && self.visible_devices.iter().all(|id| is_device_uuid(id));
        let source = if names_uuids {
            &self.visible_devices
        } else {
            &self.device_ids
        };
        let mut ids: Vec<String> = Vec::new();
        for id in source {
            let id = without_replica(id).to_owned();
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        ids
    }

    /// This allocation as the Device CR publishes it: the container's GPUs by UUID.
    /// `uuid_of_index` gives the UUID of the GPU at an NVML index, for plugins run
    /// with `--device-id-strategy index` (a MIG device `2:1` counts as its GPU 2);
    /// an ID it cannot map (no such GPU, or not an index) is published as it is.
    pub fn legacy_entry(&self, uuid_of_index: impl Fn(u32) -> Option<String>) -> LegacyDeviceEntry {
        let mut device_ids: Vec<String> = Vec::new();
        for id in self.gpu_ids() {
            let id = if is_device_uuid(&id) {
                id
            } else {
                gpu_index(&id).and_then(&uuid_of_index).unwrap_or(id)
            };
            if !device_ids.contains(&id) {
                device_ids.push(id);
            }
        }
        LegacyDeviceEntry {
            pod_uid: self.pod_uid.clone(),
            container_name: self.container_name.clone(),
            resource_name: self.resource_name.clone(),
            device_ids,
        }
    }
}

/// The parsed checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Checkpoint {
    /// Allocations, in file order.
    pub entries: Vec<CheckpointEntry>,
    /// Devices each plugin registered.
    pub registered_devices: BTreeMap<String, Vec<String>>,
    /// The checksum kubelet wrote (not verified; see the module docs).
    pub checksum: Option<u64>,
}

/// Parses a checkpoint file's bytes.
pub fn parse_checkpoint(bytes: &[u8]) -> Result<Checkpoint, CheckpointError> {
    let file: File = serde_json::from_slice(bytes).map_err(CheckpointError::Json)?;
    let mut entries = Vec::new();
    for (index, raw) in file
        .data
        .pod_device_entries
        .unwrap_or_default()
        .into_iter()
        .enumerate()
    {
        let (device_ids, numa_nodes) = match raw.device_ids {
            DeviceIds::Plain(ids) => (ids, Vec::new()),
            DeviceIds::ByNuma(map) => {
                let mut by_node = Vec::new();
                for (key, ids) in map {
                    let node: i64 = key.parse().map_err(|_| CheckpointError::NumaKey {
                        index,
                        key: key.clone(),
                    })?;
                    by_node.push((node, ids));
                }
                by_node.sort_by_key(|(node, _)| *node);
                let numa = by_node.iter().map(|(node, _)| *node).collect();
                (by_node.into_iter().flat_map(|(_, ids)| ids).collect(), numa)
            }
        };
        let response = match raw.alloc_resp.as_deref().filter(|s| !s.is_empty()) {
            None => ContainerAllocateResponse::default(),
            Some(encoded) => {
                let bytes = base64::engine::general_purpose::STANDARD
                    .decode(encoded)
                    .map_err(|source| CheckpointError::Base64 { index, source })?;
                ContainerAllocateResponse::decode(bytes.as_slice())
                    .map_err(|source| CheckpointError::Protobuf { index, source })?
            }
        };
        let visible_devices = response
            .envs
            .get(VISIBLE_DEVICES)
            .map(|v| {
                v.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        let device_envs = DEVICE_SWITCHES
            .iter()
            .filter_map(|(key, _)| Some(((*key).to_owned(), response.envs.get(*key)?.clone())))
            .collect();
        entries.push(CheckpointEntry {
            pod_uid: raw.pod_uid,
            container_name: raw.container_name,
            resource_name: raw.resource_name,
            device_ids,
            numa_nodes,
            visible_devices,
            device_envs,
            mounts: response
                .mounts
                .into_iter()
                .map(|m| m.container_path)
                .collect(),
            device_nodes: response.devices.into_iter().map(|d| d.host_path).collect(),
        });
    }
    Ok(Checkpoint {
        entries,
        registered_devices: file.data.registered_devices.unwrap_or_default(),
        checksum: file.checksum,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pre_1_20_plain_list() {
        let text = r#"{"Data":{"PodDeviceEntries":[{"PodUID":"u1","ContainerName":"c","ResourceName":"nvidia.com/gpu","DeviceIDs":["GPU-a","GPU-b::1"],"AllocResp":""}],"RegisteredDevices":{"nvidia.com/gpu":["GPU-a","GPU-b"]}},"Checksum":1}"#;
        let checkpoint = parse_checkpoint(text.as_bytes()).expect("parses");
        let entry = &checkpoint.entries[0];
        assert_eq!(entry.device_ids, ["GPU-a", "GPU-b::1"]);
        assert!(entry.numa_nodes.is_empty());
        assert_eq!(entry.gpu_ids(), ["GPU-a", "GPU-b"]);
    }

    #[test]
    fn corrupt_files_are_named_errors() {
        let full = r#"{"Data":{"PodDeviceEntries":[{"PodUID":"u1","ContainerName":"c","ResourceName":"r","DeviceIDs":{"0":["a"]}}]}}"#;
        for cut in [0, 1, 10, full.len() - 1] {
            let error = parse_checkpoint(&full.as_bytes()[..cut]).expect_err("truncated");
            assert!(
                error
                    .to_string()
                    .starts_with("not a kubelet device checkpoint"),
                "{error}"
            );
        }
        let bad_numa = full.replace(r#"{"0":"#, r#"{"zero":"#);
        assert!(
            parse_checkpoint(bad_numa.as_bytes())
                .expect_err("numa")
                .to_string()
                .contains("\"zero\" is not a number")
        );
        let bad_b64 = full.replace(r#""DeviceIDs""#, r#""AllocResp":"!!!","DeviceIDs""#);
        assert!(
            parse_checkpoint(bad_b64.as_bytes())
                .expect_err("b64")
                .to_string()
                .contains("AllocResp: not base64")
        );
        let bad_pb = full.replace(r#""DeviceIDs""#, r#""AllocResp":"/////w==","DeviceIDs""#);
        assert!(
            parse_checkpoint(bad_pb.as_bytes())
                .expect_err("pb")
                .to_string()
                .contains("not a ContainerAllocateResponse")
        );
    }

    /// A 1.20+ checkpoint of one `nvidia.com/gpu` entry: `device_ids` (JSON) and an
    /// `AllocResp` carrying `envs` and mounts at `mounts` (container paths).
    fn one_entry(device_ids: &str, envs: &[(&str, &str)], mounts: &[&str]) -> CheckpointEntry {
        let response = ContainerAllocateResponse {
            envs: envs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            mounts: mounts
                .iter()
                .map(|path| MountSpec {
                    container_path: (*path).to_owned(),
                    host_path: "/dev/null".into(),
                    read_only: false,
                })
                .collect(),
            devices: Vec::new(),
        };
        let alloc_resp = base64::engine::general_purpose::STANDARD.encode(response.encode_to_vec());
        let text = format!(
            r#"{{"Data":{{"PodDeviceEntries":[{{"PodUID":"u1","ContainerName":"c","ResourceName":"nvidia.com/gpu","DeviceIDs":{device_ids},"AllocResp":"{alloc_resp}"}}]}},"Checksum":1}}"#
        );
        let mut checkpoint = parse_checkpoint(text.as_bytes()).expect("parses");
        checkpoint.entries.remove(0)
    }

    const A: &str = "GPU-77a702db-e37f-3a74-d46d-c5713f66058c";
    const B: &str = "GPU-9b341c59-f96b-ba85-c137-78c3652fea65";

    /// NVML's index → UUID on the node of these tests: A at 0, B at 1.
    fn uuid_of_index(index: u32) -> Option<String> {
        [A, B].get(index as usize).map(|uuid| (*uuid).to_owned())
    }

    /// Every way the NVIDIA device plugin names a container's GPUs in the checkpoint
    /// (`--device-list-strategy`, `--device-id-strategy`, time-slicing, CDI), and
    /// what is published for it: GPU UUIDs, never the plugin's path, `void` or indices.
    #[test]
    fn each_device_list_strategy_publishes_gpu_uuids() {
        let path = DEVICE_LIST_MOUNT_ROOT;
        let mount = |id: &str| format!("{DEVICE_LIST_MOUNT_ROOT}/{id}");
        let (mount_a, mount_0, mount_1) = (mount(A), mount("0"), mount("1"));
        let pair = format!("{A},{B}");
        /// One row: the plugin's set-up, what kubelet and the plugin recorded, what comes out.
        struct Case<'a> {
            strategy: &'a str,
            device_ids: String,
            envs: Vec<(&'a str, &'a str)>,
            mounts: Vec<&'a str>,
            gpu_ids: &'a [&'a str],
            published: &'a [&'a str],
        }
        let case = |strategy, device_ids: &str, envs, mounts, gpu_ids, published| Case {
            strategy,
            device_ids: device_ids.to_owned(),
            envs,
            mounts,
            gpu_ids,
            published,
        };
        let (ab, a_only, b_only) = (
            format!(r#"{{"0":["{A}","{B}"]}}"#),
            format!(r#"{{"0":["{A}"]}}"#),
            format!(r#"{{"0":["{B}"]}}"#),
        );
        let (replicas, a_replica) = (
            format!(r#"{{"0":["{B}::0","{B}::3"]}}"#),
            format!(r#"["{A}::1"]"#),
        );
        #[rustfmt::skip]
        let table = [
            case("envvar, uuid", &ab, vec![(VISIBLE_DEVICES, &pair)], vec![], &[A, B], &[A, B]),
            case("envvar, index", r#"{"0":["1"]}"#, vec![(VISIBLE_DEVICES, "1")], vec![], &["1"], &[B]),
            case("volume-mounts, uuid", &a_only, vec![(VISIBLE_DEVICES, path)], vec![&mount_a], &[A], &[A]),
            case("volume-mounts, index", r#"{"-1":["0","1"]}"#, vec![(VISIBLE_DEVICES, path)], vec![&mount_0, &mount_1], &["0", "1"], &[A, B]),
            case("time-slicing replicas, uuid", &replicas, vec![(VISIBLE_DEVICES, B)], vec![], &[B], &[B]),
            case("time-slicing replicas, index", r#"{"0":["1::2"]}"#, vec![(VISIBLE_DEVICES, "1")], vec![], &["1"], &[B]),
            case("cdi-cri, env void", &b_only, vec![(VISIBLE_DEVICES, "void")], vec![], &[B], &[B]),
            case("mig, index", r#"{"0":["1:0","1:2"]}"#, vec![(VISIBLE_DEVICES, "1:0,1:2")], vec![], &["1:0", "1:2"], &[B]),
            case("tegra", r#"{"-1":["tegra"]}"#, vec![(VISIBLE_DEVICES, "tegra")], vec![], &["tegra"], &["tegra"]),
            case("index of a GPU the node no longer has", r#"["7"]"#, vec![(VISIBLE_DEVICES, "7")], vec![], &["7"], &["7"]),
            case("no env, pre-1.20 list", &a_replica, vec![], vec![], &[A], &[A]),
        ];
        for Case {
            strategy,
            device_ids,
            envs,
            mounts,
            gpu_ids,
            published,
        } in table
        {
            let entry = one_entry(&device_ids, &envs, &mounts);
            assert_eq!(entry.gpu_ids(), gpu_ids, "{strategy}: gpu_ids");
            assert_eq!(
                entry.legacy_entry(uuid_of_index).device_ids,
                published,
                "{strategy}: published"
            );
            assert_eq!(entry.mounts, mounts, "{strategy}: mounts");
        }
    }

    #[test]
    fn the_plugins_other_device_variables_are_kept() {
        let entry = one_entry(
            r#"{"0":["0"]}"#,
            &[
                (VISIBLE_DEVICES, "0"),
                ("NVIDIA_IMEX_CHANNELS", "0,3"),
                ("NVIDIA_GDS", "enabled"),
                ("UNRELATED", "x"),
            ],
            &[],
        );
        assert_eq!(
            entry.device_envs,
            BTreeMap::from([
                ("NVIDIA_GDS".to_owned(), "enabled".to_owned()),
                ("NVIDIA_IMEX_CHANNELS".to_owned(), "0,3".to_owned()),
            ])
        );
    }

    #[test]
    fn device_ids_by_kind() {
        for (id, uuid, index) in [
            (A, true, None),
            ("mig-0c5a0e11-6a1b-5c53-9d1c-2f3c9b1f0b3e", true, None),
            ("GPU-", false, None),
            ("3", false, Some(3)),
            ("3::1", false, Some(3)),
            ("3:1", false, Some(3)),
            ("3:x", false, None),
            (":1", false, None),
            ("tegra", false, None),
            (DEVICE_LIST_MOUNT_ROOT, false, None),
            ("99999999999", false, None),
        ] {
            assert_eq!(is_device_uuid(id), uuid, "{id}");
            assert_eq!(gpu_index(id), index, "{id}");
        }
    }

    /// The real kubelet files in ../shared/fixtures/kubelet-checkpoint (see its README).
    #[test]
    fn real_kubelet_checkpoints() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../shared/fixtures/kubelet-checkpoint");
        let read = |name: &str| {
            let path = dir.join(name);
            let bytes = std::fs::read(&path).unwrap_or_else(|e| {
                panic!(
                    "{}: {e} (../shared must sit beside the checkout)",
                    path.display()
                )
            });
            parse_checkpoint(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"))
        };
        let published = |name: &str| -> Vec<Vec<String>> {
            read(name)
                .entries
                .iter()
                .map(|e| e.legacy_entry(uuid_of_index).device_ids)
                .collect()
        };
        let (c, one_numa) = (
            "GPU-c1e9f249-b37b-81c2-a8d9-ba5ca0294841",
            read("one-gpu-numa0.json"),
        );
        assert_eq!(one_numa.entries[0].visible_devices, [A]);
        assert!(
            one_numa.entries[0]
                .device_nodes
                .contains(&"/dev/nvidia0".to_owned())
        );
        assert_eq!(published("one-gpu-numa0.json"), [vec![A]]);
        assert_eq!(published("two-gpus-numa1.json"), [vec![B, c]]);
        assert_eq!(published("two-pods-two-numa.json"), [vec![A], vec![c, B]]);
        // Not a GPU UUID, not an index: published as kubelet has it.
        assert_eq!(published("single-device-no-numa.json"), [vec!["tegra"]]);
    }

    proptest::proptest! {
        #[test]
        fn never_panics(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256)) {
            let _ = parse_checkpoint(&bytes);
        }
    }
}
