//! The `Device` custom resource (`scheduling.koordinator.sh/v1alpha1`), one per
//! node, named after it: the node's devices and, in an annotation, the GPUs held by
//! legacy (device-plugin) pods.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The node's devices.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "scheduling.koordinator.sh",
    version = "v1alpha1",
    kind = "Device",
    plural = "devices"
)]
pub struct DeviceSpec {
    /// One entry per device.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<DeviceInfo>,
}

/// One device of the node.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct DeviceInfo {
    /// Device type: `gpu`, `rdma`, …
    #[serde(rename = "type", default, skip_serializing_if = "String::is_empty")]
    pub device_type: String,
    /// The device's properties, for selectors (Koordinator's `labels`): for GPUs the
    /// model, `node.koordinator.sh/gpu-model` (label-safe), which HAMi's
    /// `nvidia.com/use-gputype` and Koordinator's `device-allocate-hint` match.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Device ID; for GPUs the UUID (`GPU-…`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub id: String,
    /// Device minor number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor: Option<i32>,
    /// Whether the device is healthy.
    #[serde(default)]
    pub health: bool,
    /// What the device offers, e.g. `koordinator.sh/gpu-core: 100`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub resources: BTreeMap<String, Quantity>,
    /// Where the device sits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topology: Option<DeviceTopology>,
}

/// A device's place in the node's topology.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct DeviceTopology {
    /// CPU socket.
    #[serde(rename = "socketID")]
    pub socket_id: i32,
    /// NUMA node (-1 when unknown).
    #[serde(rename = "nodeID")]
    pub node_id: i32,
    /// PCIe root or switch the device hangs off.
    #[serde(rename = "pcieID")]
    pub pcie_id: String,
    /// PCI bus ID, e.g. `0000:19:00.0`.
    #[serde(rename = "busID", default, skip_serializing_if = "String::is_empty")]
    pub bus_id: String,
}

/// One container's devices allocated by a device plugin through kubelet, as
/// published in the Device annotation `node.koordinator.sh/devices-checkpoints`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LegacyDeviceEntry {
    /// The pod's UID.
    #[serde(rename = "podUID")]
    pub pod_uid: String,
    /// The container's name.
    pub container_name: String,
    /// The extended resource, e.g. `nvidia.com/gpu`.
    pub resource_name: String,
    /// The devices held; GPU UUIDs for GPUs.
    #[serde(rename = "deviceIDs")]
    pub device_ids: Vec<String>,
}

/// The device-plugin grants in a Device CR's `devices-checkpoints` annotation
/// could not be read.
#[derive(Debug, thiserror::Error)]
#[error("Device {device}: annotation {annotation} is not a list of device-plugin grants")]
pub struct LegacyEntriesError {
    /// The Device CR (its node's name).
    pub device: String,
    /// The annotation.
    pub annotation: &'static str,
    /// What serde_json said.
    #[source]
    pub source: serde_json::Error,
}

impl Device {
    /// The Device CR of `node` as an object reference, for Events that relate to it
    /// (the reporter's, on a Node or a pod, about the node's GPUs).
    pub fn reference(node: &str) -> k8s_openapi::api::core::v1::ObjectReference {
        use kube::Resource;
        k8s_openapi::api::core::v1::ObjectReference {
            api_version: Some(Self::api_version(&()).into_owned()),
            kind: Some(Self::kind(&()).into_owned()),
            name: Some(node.to_owned()),
            ..Default::default()
        }
    }

    /// The device-plugin grants the reporter published on this Device CR
    /// (`node.koordinator.sh/devices-checkpoints`): none when the annotation is
    /// absent (a node with no device-plugin pod, or a reporter that predates it).
    pub fn legacy_entries(&self) -> Result<Vec<LegacyDeviceEntry>, LegacyEntriesError> {
        let annotation = crate::resources::DEVICES_CHECKPOINTS;
        let Some(text) = self
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(annotation))
        else {
            return Ok(Vec::new());
        };
        serde_json::from_str(text).map_err(|source| LegacyEntriesError {
            device: self.metadata.name.clone().unwrap_or_default(),
            annotation,
            source,
        })
    }
}

impl LegacyDeviceEntry {
    /// `entries` as the `devices-checkpoints` annotation's value
    /// ([`Device::legacy_entries`] reads it back).
    pub fn encode_all(entries: &[Self]) -> String {
        // A list of plain strings always serializes.
        serde_json::to_string(entries).unwrap_or_else(|_| "[]".into())
    }
}

#[cfg(test)]
mod tests {
    use kube::{CustomResourceExt, Resource};

    use super::*;

    #[test]
    fn names_match_the_design() {
        assert_eq!(
            Device::api_version(&()),
            "scheduling.koordinator.sh/v1alpha1"
        );
        assert_eq!(Device::kind(&()), "Device");
        let crd = Device::crd();
        assert_eq!(crd.spec.scope, "Cluster");
        assert_eq!(crd.spec.names.plural, "devices");
    }

    #[test]
    fn json_field_names() {
        let info = DeviceInfo {
            device_type: "gpu".into(),
            labels: [(
                "node.koordinator.sh/gpu-model".to_owned(),
                "NVIDIA-H100-80GB-HBM3".to_owned(),
            )]
            .into(),
            id: "GPU-1".into(),
            minor: Some(0),
            health: true,
            resources: [("koordinator.sh/gpu-core".to_owned(), Quantity("100".into()))].into(),
            topology: Some(DeviceTopology {
                socket_id: 0,
                node_id: 1,
                pcie_id: "0000:00:01.0".into(),
                bus_id: "0000:19:00.0".into(),
            }),
        };
        let json = serde_json::to_value(&info).expect("serializes");
        assert_eq!(
            json,
            serde_json::json!({"type":"gpu","labels":{"node.koordinator.sh/gpu-model":"NVIDIA-H100-80GB-HBM3"},"id":"GPU-1","minor":0,"health":true,
                "resources":{"koordinator.sh/gpu-core":"100"},
                "topology":{"socketID":0,"nodeID":1,"pcieID":"0000:00:01.0","busID":"0000:19:00.0"}})
        );
        let entry = LegacyDeviceEntry {
            pod_uid: "u".into(),
            container_name: "c".into(),
            resource_name: "nvidia.com/gpu".into(),
            device_ids: vec!["GPU-1".into()],
        };
        assert_eq!(
            serde_json::to_value(&entry).expect("serializes"),
            serde_json::json!({"podUID":"u","containerName":"c","resourceName":"nvidia.com/gpu","deviceIDs":["GPU-1"]})
        );
    }

    #[test]
    fn legacy_entries_round_trip_and_name_a_bad_annotation() {
        let entry = LegacyDeviceEntry {
            pod_uid: "u".into(),
            container_name: "c".into(),
            resource_name: "nvidia.com/gpu".into(),
            device_ids: vec!["GPU-1".into()],
        };
        let mut device = Device::new("n1", DeviceSpec::default());
        assert_eq!(device.legacy_entries().expect("absent"), Vec::new());
        let annotations = device.metadata.annotations.get_or_insert_default();
        annotations.insert(
            crate::resources::DEVICES_CHECKPOINTS.into(),
            LegacyDeviceEntry::encode_all(std::slice::from_ref(&entry)),
        );
        assert_eq!(device.legacy_entries().expect("parses"), vec![entry]);
        device.metadata.annotations.get_or_insert_default().insert(
            crate::resources::DEVICES_CHECKPOINTS.into(),
            "[{\"podUID\":".into(),
        );
        let error = device.legacy_entries().expect_err("truncated");
        assert!(
            error
                .to_string()
                .starts_with("Device n1: annotation node.koordinator.sh/devices-checkpoints"),
            "{error}"
        );
        assert_eq!(LegacyDeviceEntry::encode_all(&[]), "[]");
    }
}
