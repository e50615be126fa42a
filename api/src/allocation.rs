//! The `scheduling.koordinator.sh/device-allocated` pod annotation:
//! `{"gpu":[{"minor":0,"id":"GPU-…","resources":{"koordinator.sh/gpu-core":50,…}}],"rdma":[…]}`.

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
    /// Device-type specific extras (e.g. RDMA virtual functions), kept as they are.
    pub extension: Option<Value>,
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
        let mut resources = BTreeMap::new();
        match object.get("resources") {
            None | Some(Value::Null) => {}
            Some(Value::Object(map)) => {
                for (name, value) in map {
                    let at = format!("{path}.resources[{name:?}]");
                    let quantity = Quantity::from_json(value)
                        .map_err(|source| AllocationError::Quantity { path: at, source })?;
                    resources.insert(name.clone(), quantity);
                }
            }
            Some(other) => {
                return Err(field(
                    format!("{path}.resources"),
                    format!("expected an object, got {other}"),
                ));
            }
        }
        Ok(Self {
            minor,
            id,
            resources,
            extension: object.get("extension").cloned(),
        })
    }

    fn to_json(&self) -> Value {
        let mut object = Map::new();
        object.insert("minor".into(), self.minor.into());
        if !self.id.is_empty() {
            object.insert("id".into(), self.id.clone().into());
        }
        if !self.resources.is_empty() {
            let resources = self
                .resources
                .iter()
                .map(|(name, quantity)| {
                    let value = if quantity.milli_value() % 1000 == 0 {
                        Value::from(quantity.value())
                    } else {
                        Value::from(quantity.to_string())
                    };
                    (name.clone(), value)
                })
                .collect();
            object.insert("resources".into(), Value::Object(resources));
        }
        if let Some(extension) = &self.extension {
            object.insert("extension".into(), extension.clone());
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
        Ok(allocations)
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

    proptest::proptest! {
        #[test]
        fn never_panics(text in "\\PC{0,64}") {
            let _ = DeviceAllocations::parse(&text);
        }
    }
}
