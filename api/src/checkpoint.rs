//! kubelet's device-manager checkpoint
//! (`/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint`): which devices
//! kubelet gave to which container through a device plugin.
//!
//! Both formats are read: 1.20+ (`DeviceIDs` keyed by NUMA node as JSON strings,
//! `"-1"` for none) and older (a plain list). `AllocResp` (base64 of the plugin's
//! protobuf `ContainerAllocateResponse`) is decoded for `NVIDIA_VISIBLE_DEVICES`
//! and device nodes. `Checksum` is kubelet's FNV-32a over a Go dump of `Data`
//! that cannot be reproduced outside Go: the file is read leniently and entries are
//! cross-checked against the pods on the node by the caller.

use std::collections::{BTreeMap, HashMap};

use base64::Engine;
use prost::Message;
use serde::Deserialize;

use crate::LegacyDeviceEntry;

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
    #[prost(message, repeated, tag = "3")]
    devices: Vec<DeviceSpec>,
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
    /// `NVIDIA_VISIBLE_DEVICES` the plugin gave the container, split on commas.
    pub visible_devices: Vec<String>,
    /// Device nodes the plugin gave the container (host paths).
    pub device_nodes: Vec<String>,
}

impl CheckpointEntry {
    /// The GPUs the container holds: the plugin's `NVIDIA_VISIBLE_DEVICES` when it
    /// names them, else kubelet's device IDs; replica suffixes (`GPU-…::1`, from
    /// time-slicing) stripped, duplicates dropped.
    pub fn gpu_ids(&self) -> Vec<String> {
        let source = if self.visible_devices.is_empty() {
            &self.device_ids
        } else {
            &self.visible_devices
        };
        let mut ids: Vec<String> = Vec::new();
        for id in source {
            let id = id.split("::").next().unwrap_or(id).to_owned();
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        ids
    }

    /// This allocation as the Device CR publishes it: the container's GPUs by ID.
    pub fn legacy_entry(&self) -> LegacyDeviceEntry {
        LegacyDeviceEntry {
            pod_uid: self.pod_uid.clone(),
            container_name: self.container_name.clone(),
            resource_name: self.resource_name.clone(),
            device_ids: self.gpu_ids(),
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
        let (visible_devices, device_nodes) =
            match raw.alloc_resp.as_deref().filter(|s| !s.is_empty()) {
                None => (Vec::new(), Vec::new()),
                Some(encoded) => {
                    let bytes = base64::engine::general_purpose::STANDARD
                        .decode(encoded)
                        .map_err(|source| CheckpointError::Base64 { index, source })?;
                    let response = ContainerAllocateResponse::decode(bytes.as_slice())
                        .map_err(|source| CheckpointError::Protobuf { index, source })?;
                    let visible = response
                        .envs
                        .get("NVIDIA_VISIBLE_DEVICES")
                        .map(|v| {
                            v.split(',')
                                .map(str::trim)
                                .filter(|s| !s.is_empty())
                                .map(str::to_owned)
                                .collect()
                        })
                        .unwrap_or_default();
                    (
                        visible,
                        response.devices.into_iter().map(|d| d.host_path).collect(),
                    )
                }
            };
        entries.push(CheckpointEntry {
            pod_uid: raw.pod_uid,
            container_name: raw.container_name,
            resource_name: raw.resource_name,
            device_ids,
            numa_nodes,
            visible_devices,
            device_nodes,
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

    proptest::proptest! {
        #[test]
        fn never_panics(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256)) {
            let _ = parse_checkpoint(&bytes);
        }
    }
}
