//! The `scheduling.koordinator.sh/device-allocated` pod annotation:
//! `{"gpu":[{"minor":0,"id":"GPU-…","resources":{"koordinator.sh/gpu-core":50,…}}],"rdma":[…]}`.
//!
//! # Per-container grants
//!
//! Each device entry states what the *pod* books on that device (Koordinator's
//! form, which Koordinator-aware tools keep reading). Tessera adds, in the entry's
//! `extension`, which containers get the device and each one's share:
//!
//! ```json
//! {"gpu":[{"minor":0,"id":"GPU-a",
//!          "resources":{"koordinator.sh/gpu-core":50,"koordinator.sh/gpu-memory-ratio":50,"koordinator.sh/gpu-memory":8589934592},
//!          "extension":{"containers":{
//!            "a":{"koordinator.sh/gpu-core":25,"koordinator.sh/gpu-memory-ratio":25,"koordinator.sh/gpu-memory":4294967296},
//!            "b":{"koordinator.sh/gpu-core":25,"koordinator.sh/gpu-memory-ratio":25,"koordinator.sh/gpu-memory":4294967296}}}}]}
//! ```
//!
//! When any entry carries `extension.containers` the annotation is
//! **per-container**: a container gets exactly the devices whose entry names it,
//! with its own share of each, and nothing else (a container no entry names gets
//! no device). Otherwise it is the **pod-level** form of annotations written
//! before per-container grants: every device goes, with the pod's share, to each
//! container the caller decides may have it. A container's share is never more
//! than the pod's booking of the device; the shares of containers that run at
//! different times (init containers and app containers) may add up to more.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use crate::quantity::{Quantity, QuantityError};
use crate::resources::{DEVICE_TYPE_GPU, DEVICE_TYPE_RDMA, GPU_CORE, GPU_MEMORY, GPU_MEMORY_RATIO};

/// What is wrong with an annotation, and where (a JSON path such as `gpu[1].minor`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocationError {
    /// The annotation is not JSON.
    #[error("not valid JSON: {0}")]
    Json(String),
    /// A field has the wrong type or value.
    #[error("{path}: {problem}")]
    Field {
        /// Where in the annotation, e.g. `gpu[1].minor`.
        path: String,
        /// What is wrong, naming the value found.
        problem: String,
    },
    /// A resource value is not a quantity.
    #[error("{path}: {source}")]
    Quantity {
        /// Where in the annotation.
        path: String,
        /// Why the value is not a quantity.
        #[source]
        source: QuantityError,
    },
}

fn field(path: impl Into<String>, problem: impl Into<String>) -> AllocationError {
    AllocationError::Field {
        path: path.into(),
        problem: problem.into(),
    }
}

/// One allocated device: its minor number, its ID (the GPU UUID), and the share of it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DeviceAllocation {
    /// The device's minor number (`/dev/nvidia<minor>`, `/dev/infiniband/uverbs<minor>`).
    pub minor: u32,
    /// The device's ID; for GPUs the UUID (`GPU-…`). Empty when the writer gave none.
    pub id: String,
    /// Resources of this device given to the pod, e.g. `koordinator.sh/gpu-core: 50`.
    pub resources: BTreeMap<String, Quantity>,
    /// Per-container grants (`extension.containers`): container name → its share
    /// of this device, in the same resource names. `None` in the pod-level form.
    pub containers: Option<ContainerShares>,
    /// Device-type specific extras (e.g. RDMA virtual functions) other than
    /// `containers`, kept as they are.
    pub extension: Option<Value>,
}

/// Per-container grants of one device: container name → its share, in resource names.
pub type ContainerShares = BTreeMap<String, BTreeMap<String, Quantity>>;

/// The key of per-container grants inside a device entry's `extension`.
const CONTAINERS: &str = "containers";

fn parse_resources(
    value: Option<&Value>,
    path: &str,
) -> Result<BTreeMap<String, Quantity>, AllocationError> {
    let mut resources = BTreeMap::new();
    match value {
        None | Some(Value::Null) => {}
        Some(Value::Object(map)) => {
            for (name, value) in map {
                let at = format!("{path}[{name:?}]");
                let quantity = Quantity::from_json(value)
                    .map_err(|source| AllocationError::Quantity { path: at, source })?;
                resources.insert(name.clone(), quantity);
            }
        }
        Some(other) => {
            return Err(field(path, format!("expected an object, got {other}")));
        }
    }
    Ok(resources)
}

fn resources_json(resources: &BTreeMap<String, Quantity>) -> Value {
    resources
        .iter()
        .map(|(name, quantity)| {
            let value = if quantity.milli_value() % 1000 == 0 {
                Value::from(quantity.value())
            } else {
                Value::from(quantity.to_string())
            };
            (name.clone(), value)
        })
        .collect::<Map<String, Value>>()
        .into()
}

/// Splits an entry's `extension` into its per-container grants and the rest.
fn parse_extension(
    extension: Option<&Value>,
    path: &str,
) -> Result<(Option<ContainerShares>, Option<Value>), AllocationError> {
    let Some(Value::Object(object)) = extension else {
        return Ok((None, extension.cloned()));
    };
    let mut rest = object.clone();
    let containers = match rest.remove(CONTAINERS) {
        None | Some(Value::Null) => None,
        Some(Value::Object(map)) => {
            let mut containers = BTreeMap::new();
            for (name, share) in &map {
                let at = format!("{path}.extension.{CONTAINERS}[{name:?}]");
                if name.is_empty() {
                    return Err(field(at, "a container name is empty"));
                }
                if !share.is_object() {
                    return Err(field(
                        at,
                        format!("expected an object of resources, got {share}"),
                    ));
                }
                containers.insert(name.clone(), parse_resources(Some(share), &at)?);
            }
            Some(containers)
        }
        Some(other) => {
            return Err(field(
                format!("{path}.extension.{CONTAINERS}"),
                format!("expected an object of container names, got {other}"),
            ));
        }
    };
    let rest = (!rest.is_empty()).then_some(Value::Object(rest));
    Ok((containers, rest))
}

impl DeviceAllocation {
    /// Percent of the GPU's compute, when given.
    pub fn gpu_core(&self) -> Option<u64> {
        self.resources.get(GPU_CORE).map(Quantity::value)
    }

    /// GPU memory in bytes, when given.
    pub fn gpu_memory(&self) -> Option<u64> {
        self.resources.get(GPU_MEMORY).map(Quantity::value)
    }

    /// Percent of the GPU's memory, when given.
    pub fn gpu_memory_ratio(&self) -> Option<u64> {
        self.resources.get(GPU_MEMORY_RATIO).map(Quantity::value)
    }

    /// Whether this is less than the whole GPU (compute or memory).
    pub fn is_fractional(&self) -> bool {
        self.gpu_core().is_some_and(|core| core < 100)
            || self.gpu_memory_ratio().is_some_and(|ratio| ratio < 100)
    }

    fn parse(value: &Value, path: &str) -> Result<Self, AllocationError> {
        let object = value
            .as_object()
            .ok_or_else(|| field(path, format!("expected an object, got {value}")))?;
        let minor = match object.get("minor") {
            None => return Err(field(format!("{path}.minor"), "missing")),
            Some(Value::Number(n)) => {
                n.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| {
                        field(
                            format!("{path}.minor"),
                            format!("expected a device minor number, got {n}"),
                        )
                    })?
            }
            Some(other) => {
                return Err(field(
                    format!("{path}.minor"),
                    format!("expected a number, got {other}"),
                ));
            }
        };
        let id = match object.get("id") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(id)) => id.clone(),
            Some(other) => {
                return Err(field(
                    format!("{path}.id"),
                    format!("expected a string, got {other}"),
                ));
            }
        };
        let resources = parse_resources(object.get("resources"), &format!("{path}.resources"))?;
        let (containers, extension) = parse_extension(object.get("extension"), path)?;
        Ok(Self {
            minor,
            id,
            resources,
            containers,
            extension,
        })
    }

    fn to_json(&self) -> Value {
        let mut object = Map::new();
        object.insert("minor".into(), self.minor.into());
        if !self.id.is_empty() {
            object.insert("id".into(), self.id.clone().into());
        }
        if !self.resources.is_empty() {
            object.insert("resources".into(), resources_json(&self.resources));
        }
        let mut extension = self.extension.clone();
        if let Some(containers) = &self.containers {
            let containers: Map<String, Value> = containers
                .iter()
                .map(|(name, share)| (name.clone(), resources_json(share)))
                .collect();
            match &mut extension {
                Some(Value::Object(rest)) => {
                    rest.insert(CONTAINERS.into(), containers.into());
                }
                _ => {
                    // Another shape cannot hold both: the grants win, as the reader needs them.
                    extension = Some(Value::Object(Map::from_iter([(
                        CONTAINERS.to_owned(),
                        containers.into(),
                    )])));
                }
            }
        }
        if let Some(extension) = extension {
            object.insert("extension".into(), extension);
        }
        Value::Object(object)
    }
}

/// The whole annotation: allocations per device type.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DeviceAllocations {
    /// Allocations by device type (`gpu`, `rdma`, …), in annotation order.
    pub devices: BTreeMap<String, Vec<DeviceAllocation>>,
}

impl DeviceAllocations {
    /// Parses the annotation's value, checking every field and the GPU invariants:
    /// minors and UUIDs unique, shares in 0..=100 (whole multiples above).
    pub fn parse(text: &str) -> Result<Self, AllocationError> {
        let value: Value =
            serde_json::from_str(text).map_err(|e| AllocationError::Json(e.to_string()))?;
        let object = value.as_object().ok_or_else(|| {
            field(
                "$",
                format!("expected an object of device types, got {value}"),
            )
        })?;
        let mut devices = BTreeMap::new();
        for (kind, list) in object {
            let list = list
                .as_array()
                .ok_or_else(|| field(kind.as_str(), format!("expected a list, got {list}")))?;
            let parsed = list
                .iter()
                .enumerate()
                .map(|(index, entry)| DeviceAllocation::parse(entry, &format!("{kind}[{index}]")))
                .collect::<Result<Vec<_>, _>>()?;
            devices.insert(kind.clone(), parsed);
        }
        let allocations = Self { devices };
        allocations.check_gpus()?;
        allocations.check_containers()?;
        Ok(allocations)
    }

    /// A container's share of a device is never more than the pod's booking of it.
    fn check_containers(&self) -> Result<(), AllocationError> {
        for (kind, list) in &self.devices {
            for (index, device) in list.iter().enumerate() {
                for (name, share) in device.containers.iter().flatten() {
                    for (resource, value) in share {
                        let at = || {
                            format!(
                                "{kind}[{index}].extension.{CONTAINERS}[{name:?}][{resource:?}]"
                            )
                        };
                        if kind == DEVICE_TYPE_GPU
                            && [GPU_CORE, GPU_MEMORY_RATIO].contains(&resource.as_str())
                            && value.value() > 100
                        {
                            return Err(field(
                                at(),
                                format!(
                                    "{value} is more than one GPU (100) on a single device entry"
                                ),
                            ));
                        }
                        let Some(booked) = device.resources.get(resource) else {
                            continue;
                        };
                        if value > booked {
                            return Err(field(
                                at(),
                                format!("{value} is more than the pod's {booked} on this device"),
                            ));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Whether the annotation gives devices container by container (see the module
    /// docs): some device entry carries `extension.containers`.
    pub fn is_per_container(&self) -> bool {
        self.devices
            .values()
            .flatten()
            .any(|device| device.containers.is_some())
    }

    /// The devices of type `kind` that container `container` gets, each with its
    /// index in the annotation's list (for messages) and, as its `resources`, the
    /// container's own share, in annotation order. Per-container form: the entries
    /// that name the container (none when no entry does). Pod-level form: every
    /// entry, with the pod's share.
    pub fn devices_of_container(
        &self,
        kind: &str,
        container: &str,
    ) -> Vec<(usize, DeviceAllocation)> {
        let list = self.devices.get(kind).map_or(&[][..], Vec::as_slice);
        let per_container = self.is_per_container();
        list.iter()
            .enumerate()
            .filter_map(|(index, device)| {
                if !per_container {
                    return Some((index, device.clone()));
                }
                let share = device.containers.as_ref()?.get(container)?;
                Some((
                    index,
                    DeviceAllocation {
                        resources: share.clone(),
                        containers: None,
                        ..device.clone()
                    },
                ))
            })
            .collect()
    }

    /// [`Self::devices_of_container`] for GPUs.
    pub fn gpus_of_container(&self, container: &str) -> Vec<(usize, DeviceAllocation)> {
        self.devices_of_container(DEVICE_TYPE_GPU, container)
    }

    fn check_gpus(&self) -> Result<(), AllocationError> {
        let gpus = self.gpus();
        for (index, gpu) in gpus.iter().enumerate() {
            let path = format!("{DEVICE_TYPE_GPU}[{index}]");
            if let Some(twin) = gpus[..index]
                .iter()
                .position(|other| other.minor == gpu.minor)
            {
                return Err(field(
                    format!("{path}.minor"),
                    format!("minor {} is also gpu[{twin}]'s", gpu.minor),
                ));
            }
            if !gpu.id.is_empty() {
                if let Some(twin) = gpus[..index].iter().position(|other| other.id == gpu.id) {
                    return Err(field(
                        format!("{path}.id"),
                        format!("{} is also gpu[{twin}]'s", gpu.id),
                    ));
                }
            }
            for name in [GPU_CORE, GPU_MEMORY_RATIO] {
                if let Some(value) = gpu.resources.get(name).map(Quantity::value) {
                    if value > 100 {
                        return Err(field(
                            format!("{path}.resources[{name:?}]"),
                            format!("{value} is more than one GPU (100) on a single device entry"),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// The GPU allocations (empty when none).
    pub fn gpus(&self) -> &[DeviceAllocation] {
        self.devices.get(DEVICE_TYPE_GPU).map_or(&[], Vec::as_slice)
    }

    /// The RDMA allocations (empty when none).
    pub fn rdma(&self) -> &[DeviceAllocation] {
        self.devices
            .get(DEVICE_TYPE_RDMA)
            .map_or(&[], Vec::as_slice)
    }

    /// The annotation's value, as the scheduler writes it.
    pub fn to_annotation(&self) -> String {
        let object: Map<String, Value> = self
            .devices
            .iter()
            .map(|(kind, list)| {
                (
                    kind.clone(),
                    Value::Array(list.iter().map(DeviceAllocation::to_json).collect()),
                )
            })
            .collect();
        Value::Object(object).to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"{"gpu":[{"minor":0,"id":"GPU-0b1c","resources":{"koordinator.sh/gpu-core":50,"koordinator.sh/gpu-memory-ratio":50,"koordinator.sh/gpu-memory":"8Gi"}}]}"#;

    #[test]
    fn parses_the_design_example() {
        let parsed = DeviceAllocations::parse(EXAMPLE).expect("valid");
        let gpu = &parsed.gpus()[0];
        assert_eq!((gpu.minor, gpu.id.as_str()), (0, "GPU-0b1c"));
        assert_eq!(gpu.gpu_core(), Some(50));
        assert_eq!(gpu.gpu_memory(), Some(8 << 30));
        assert!(gpu.is_fractional());
        assert!(parsed.rdma().is_empty());
    }

    #[test]
    fn roundtrips() {
        let parsed = DeviceAllocations::parse(EXAMPLE).expect("valid");
        assert_eq!(
            DeviceAllocations::parse(&parsed.to_annotation()),
            Ok(parsed)
        );
    }

    #[test]
    fn errors_name_the_field_and_value() {
        let cases = [
            ("{", "not valid JSON"),
            ("[]", "$: expected an object"),
            (r#"{"gpu":{}}"#, "gpu: expected a list"),
            (
                r#"{"gpu":[{"minor":0},{"minor":"x"}]}"#,
                "gpu[1].minor: expected a number, got \"x\"",
            ),
            (r#"{"gpu":[{"id":"GPU-1"}]}"#, "gpu[0].minor: missing"),
            (
                r#"{"gpu":[{"minor":-1}]}"#,
                "gpu[0].minor: expected a device minor number, got -1",
            ),
            (
                r#"{"gpu":[{"minor":0,"id":7}]}"#,
                "gpu[0].id: expected a string, got 7",
            ),
            (
                r#"{"gpu":[{"minor":0,"resources":{"koordinator.sh/gpu-core":"lots"}}]}"#,
                "gpu[0].resources[\"koordinator.sh/gpu-core\"]: expected a quantity",
            ),
            (
                r#"{"gpu":[{"minor":0},{"minor":0}]}"#,
                "gpu[1].minor: minor 0 is also gpu[0]'s",
            ),
            (
                r#"{"gpu":[{"minor":0,"id":"GPU-a"},{"minor":1,"id":"GPU-a"}]}"#,
                "gpu[1].id: GPU-a is also gpu[0]'s",
            ),
            (
                r#"{"gpu":[{"minor":0,"resources":{"koordinator.sh/gpu-core":200}}]}"#,
                "200 is more than one GPU",
            ),
        ];
        for (text, expected) in cases {
            let error = DeviceAllocations::parse(text).expect_err(text).to_string();
            assert!(error.contains(expected), "{text}: {error}");
        }
    }

    /// Two containers of 25% on one GPU, booked 50% for the pod.
    const PER_CONTAINER: &str = r#"{"gpu":[{"minor":0,"id":"GPU-a","resources":{"koordinator.sh/gpu-core":50,"koordinator.sh/gpu-memory-ratio":50},"extension":{"containers":{"a":{"koordinator.sh/gpu-core":25,"koordinator.sh/gpu-memory-ratio":25},"b":{"koordinator.sh/gpu-core":25,"koordinator.sh/gpu-memory-ratio":25}}}},{"minor":1,"id":"GPU-b","resources":{"koordinator.sh/gpu-core":100,"koordinator.sh/gpu-memory-ratio":100},"extension":{"containers":{"b":{"koordinator.sh/gpu-core":100,"koordinator.sh/gpu-memory-ratio":100}}}}]}"#;

    #[test]
    fn per_container_grants_give_each_container_its_own() {
        let parsed = DeviceAllocations::parse(PER_CONTAINER).expect("valid");
        assert!(parsed.is_per_container());
        // The pod-level list is untouched: Koordinator-aware readers see the pod's booking.
        assert_eq!(parsed.gpus()[0].gpu_core(), Some(50));
        let a = parsed.gpus_of_container("a");
        assert_eq!(a.len(), 1);
        assert_eq!((a[0].0, a[0].1.id.as_str()), (0, "GPU-a"));
        assert_eq!(a[0].1.gpu_core(), Some(25));
        assert_eq!(a[0].1.gpu_memory_ratio(), Some(25));
        assert!(a[0].1.is_fractional());
        let b: Vec<(usize, String, Option<u64>)> = parsed
            .gpus_of_container("b")
            .into_iter()
            .map(|(index, gpu)| (index, gpu.id.clone(), gpu.gpu_core()))
            .collect();
        assert_eq!(
            b,
            [
                (0, "GPU-a".to_owned(), Some(25)),
                (1, "GPU-b".to_owned(), Some(100))
            ]
        );
        assert!(parsed.gpus_of_container("sidecar").is_empty());
        assert!(parsed.gpus_of_container("").is_empty());
        assert!(parsed.rdma().is_empty());
        assert_eq!(
            DeviceAllocations::parse(&parsed.to_annotation()),
            Ok(parsed)
        );
    }

    #[test]
    fn pod_level_form_gives_every_device_with_the_pods_share() {
        let parsed = DeviceAllocations::parse(EXAMPLE).expect("valid");
        assert!(!parsed.is_per_container());
        let any = parsed.gpus_of_container("whoever");
        assert_eq!(any.len(), 1);
        assert_eq!(any[0].1, parsed.gpus()[0]);
    }

    #[test]
    fn other_extension_fields_are_kept_beside_the_grants() {
        let text =
            r#"{"rdma":[{"minor":3,"extension":{"vfs":[{"minor":9}],"containers":{"a":{}}}}]}"#;
        let parsed = DeviceAllocations::parse(text).expect("valid");
        let rdma = &parsed.rdma()[0];
        assert_eq!(
            rdma.extension,
            Some(serde_json::json!({"vfs":[{"minor":9}]}))
        );
        assert!(parsed.devices_of_container(DEVICE_TYPE_RDMA, "a").len() == 1);
        assert!(
            parsed
                .devices_of_container(DEVICE_TYPE_RDMA, "b")
                .is_empty()
        );
        assert_eq!(
            DeviceAllocations::parse(&parsed.to_annotation()),
            Ok(parsed)
        );
    }

    #[test]
    fn malformed_grants_name_the_field_and_value() {
        let entry = |extension: &str| {
            format!(
                r#"{{"gpu":[{{"minor":0,"id":"GPU-a","resources":{{"koordinator.sh/gpu-core":50}},"extension":{extension}}}]}}"#
            )
        };
        let cases = [
            (
                entry(r#"{"containers":["a"]}"#),
                r#"gpu[0].extension.containers: expected an object of container names, got ["a"]"#,
            ),
            (
                entry(r#"{"containers":{"a":25}}"#),
                r#"gpu[0].extension.containers["a"]: expected an object of resources, got 25"#,
            ),
            (
                entry(r#"{"containers":{"a":{"koordinator.sh/gpu-core":"lots"}}}"#),
                r#"gpu[0].extension.containers["a"]["koordinator.sh/gpu-core"]: expected a quantity such as 100, 8Gi or 500m, got "lots""#,
            ),
            (
                entry(r#"{"containers":{"a":{"koordinator.sh/gpu-core":60}}}"#),
                r#"gpu[0].extension.containers["a"]["koordinator.sh/gpu-core"]: 60 is more than the pod's 50 on this device"#,
            ),
            (
                entry(r#"{"containers":{"a":{"koordinator.sh/gpu-memory-ratio":200}}}"#),
                r#"gpu[0].extension.containers["a"]["koordinator.sh/gpu-memory-ratio"]: 200 is more than one GPU (100) on a single device entry"#,
            ),
            (
                entry(r#"{"containers":{"":{}}}"#),
                r#"gpu[0].extension.containers[""]: a container name is empty"#,
            ),
        ];
        for (text, expected) in cases {
            let error = DeviceAllocations::parse(&text)
                .expect_err(&text)
                .to_string();
            assert_eq!(error, expected, "{text}");
        }
    }

    proptest::proptest! {
        #[test]
        fn never_panics(text in "\\PC{0,64}") {
            let _ = DeviceAllocations::parse(&text);
        }

        /// Any per-container annotation the scheduler can write reads back the same,
        /// and each container gets exactly the entries that name it.
        #[test]
        fn per_container_roundtrips(
            gpus in proptest::collection::vec(
                (1u64..=100, proptest::collection::btree_map("[a-c]", 0u64..=100, 0..3)),
                1..4,
            ),
        ) {
            let devices: Vec<DeviceAllocation> = gpus
                .iter()
                .enumerate()
                .map(|(minor, (booked, shares))| DeviceAllocation {
                    minor: minor as u32,
                    id: format!("GPU-{minor}"),
                    resources: BTreeMap::from([(GPU_CORE.to_owned(), Quantity::from_units(*booked))]),
                    containers: Some(
                        shares
                            .iter()
                            .map(|(name, core)| {
                                (name.clone(), BTreeMap::from([(GPU_CORE.to_owned(), Quantity::from_units((*core).min(*booked)))]))
                            })
                            .collect(),
                    ),
                    extension: None,
                })
                .collect();
            let allocations = DeviceAllocations {
                devices: BTreeMap::from([(DEVICE_TYPE_GPU.to_owned(), devices)]),
            };
            let parsed = DeviceAllocations::parse(&allocations.to_annotation());
            proptest::prop_assert_eq!(parsed.as_ref(), Ok(&allocations));
            for name in ["a", "b", "c", "d"] {
                let named: Vec<usize> = gpus
                    .iter()
                    .enumerate()
                    .filter(|(_, (_, shares))| shares.contains_key(name))
                    .map(|(index, _)| index)
                    .collect();
                let got: Vec<usize> = allocations.gpus_of_container(name).iter().map(|(index, _)| *index).collect();
                proptest::prop_assert_eq!(got, named);
            }
        }
    }
}
