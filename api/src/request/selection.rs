//! Which GPUs a pod may get and how to place it, from its annotations: HAMi's GPU
//! type and UUID lists and per-pod policies, Koordinator's device-allocate-hint.
//! Each keeps its own system's matching rules (docs/compat.md); what Tessera
//! cannot honour is refused, naming the annotation and its value.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use serde::Deserialize;

use super::RequestError;
use crate::resources::{DEVICE_TYPE_GPU, LABEL_GPU_MODEL, label_value};

/// HAMi: comma-separated GPU types the pod may use (substring of the model, any case).
pub const HAMI_USE_GPU_TYPE: &str = "nvidia.com/use-gputype";
/// HAMi: comma-separated GPU types the pod must not use.
pub const HAMI_NOUSE_GPU_TYPE: &str = "nvidia.com/nouse-gputype";
/// HAMi: comma-separated GPU UUIDs the pod may use.
pub const HAMI_USE_GPU_UUID: &str = "nvidia.com/use-gpuuuid";
/// HAMi: comma-separated GPU UUIDs the pod must not use.
pub const HAMI_NOUSE_GPU_UUID: &str = "nvidia.com/nouse-gpuuuid";
/// HAMi: which GPU on a node for this pod, `binpack` or `spread`.
pub const HAMI_GPU_SCHEDULER_POLICY: &str = "hami.io/gpu-scheduler-policy";
/// HAMi: which node for this pod, `binpack` or `spread`.
pub const HAMI_NODE_SCHEDULER_POLICY: &str = "hami.io/node-scheduler-policy";
/// Koordinator: per device type, a selector on device labels and how to allocate.
pub const KOORDINATOR_DEVICE_ALLOCATE_HINT: &str = "scheduling.koordinator.sh/device-allocate-hint";
/// Tessera: the sharing group of the pod. Pods of one group share one GPU, which
/// no pod outside the group gets while the group has pods there.
pub const SHARING_GROUP: &str = "tessera.io/sharing-group";
/// KubeShare: the pod's GPUID, a sharing group in Tessera's terms.
pub const KUBESHARE_GPUID: &str = "lsalab.nthu/GPUID";
/// KubeShare 2.0's `sharedgpu/gpu_model` label, as admission copies it: the GPU
/// model the pod must get, exactly (`NVIDIA-GeForce-GTX-1080`, any case), as
/// KubeShare's collector names models.
pub const KUBESHARE_GPU_MODEL: &str = "lsalab.nthu/gpu_model";

/// Where to put work, as a pod may ask for itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PlacementPolicy {
    /// Fill the fullest GPU (or node) that fits.
    Binpack,
    /// Use the emptiest.
    Spread,
}

/// A label selector's operator, as Kubernetes' `LabelSelectorRequirement` has them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LabelOperator {
    /// The label is one of the values.
    In,
    /// The label is absent or none of the values.
    NotIn,
    /// The label is present.
    Exists,
    /// The label is absent.
    DoesNotExist,
}

/// One requirement of a label selector (`matchLabels` entries are `In` one value).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabelRequirement {
    /// The label key.
    pub key: String,
    /// How it is compared.
    pub operator: LabelOperator,
    /// The values of `In` and `NotIn`.
    pub values: Vec<String>,
}

impl LabelRequirement {
    fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        let value = labels.get(&self.key);
        match self.operator {
            LabelOperator::In => value.is_some_and(|v| self.values.contains(v)),
            LabelOperator::NotIn => value.is_none_or(|v| !self.values.contains(v)),
            LabelOperator::Exists => value.is_some(),
            LabelOperator::DoesNotExist => value.is_none(),
        }
    }
}

/// How one rule picks GPUs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuMatch {
    /// The model contains one of these (HAMi `use-gputype`: upper-cased, label-safe).
    ModelIn(Vec<String>),
    /// The model contains none of these (HAMi `nouse-gputype`).
    ModelNotIn(Vec<String>),
    /// The model is this one (KubeShare's `gpu_model`: upper-cased, label-safe).
    ModelIs(String),
    /// The UUID is one of these (HAMi `use-gpuuuid`).
    UuidIn(Vec<String>),
    /// The UUID is none of these (HAMi `nouse-gpuuuid`).
    UuidNotIn(Vec<String>),
    /// The GPU's labels match every requirement (Koordinator's hint selector).
    Labels(Vec<LabelRequirement>),
}

/// One rule of a pod's GPU selection and the annotation it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuRule {
    /// The annotation's key.
    pub annotation: String,
    /// The annotation's value, as written.
    pub value: String,
    /// What it matches.
    pub matches: GpuMatch,
}

impl GpuRule {
    /// Whether the GPU `uuid` with `labels` passes this rule.
    pub fn allows(&self, uuid: &str, labels: &BTreeMap<String, String>) -> bool {
        let model = || {
            labels
                .get(LABEL_GPU_MODEL)
                .map(|m| m.to_ascii_uppercase())
                .unwrap_or_default()
        };
        match &self.matches {
            GpuMatch::ModelIn(types) => {
                let model = model();
                types.iter().any(|t| model.contains(t.as_str()))
            }
            GpuMatch::ModelNotIn(types) => {
                let model = model();
                !types.iter().any(|t| model.contains(t.as_str()))
            }
            GpuMatch::ModelIs(wanted) => model() == *wanted,
            GpuMatch::UuidIn(uuids) => uuids.iter().any(|u| u == uuid),
            GpuMatch::UuidNotIn(uuids) => !uuids.iter().any(|u| u == uuid),
            GpuMatch::Labels(requirements) => requirements.iter().all(|r| r.matches(labels)),
        }
    }
}

/// Where all of a pod's GPUs must be, together (Koordinator's `requiredTopologyScope`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopologyScope {
    /// Under one PCIe switch (`PCIe`).
    PcieSwitch,
    /// On one NUMA node (`NUMANode`).
    NumaNode,
}

impl TopologyScope {
    /// The scope as Koordinator writes it.
    pub fn name(self) -> &'static str {
        match self {
            Self::PcieSwitch => "PCIe",
            Self::NumaNode => "NUMANode",
        }
    }

    /// What one such place is called, for messages.
    pub fn noun(self) -> &'static str {
        match self {
            Self::PcieSwitch => "PCIe switch",
            Self::NumaNode => "NUMA node",
        }
    }
}

/// A required topology scope and the annotation it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScopeRule {
    /// The annotation's key.
    pub annotation: String,
    /// The annotation's value, as written.
    pub value: String,
    /// The scope every GPU of the pod must share.
    pub scope: TopologyScope,
}

/// Which GPUs a pod may get: those every rule allows; every GPU when there is no
/// rule. With a scope, all of them together in one such place of the node.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GpuSelection {
    /// The rules, all of which a GPU must pass.
    pub rules: Vec<GpuRule>,
    /// Where the pod's GPUs must all be, together.
    pub scope: Option<ScopeRule>,
}

impl GpuSelection {
    /// Whether the pod may get any GPU, anywhere on a node.
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty() && self.scope.is_none()
    }

    /// Whether the GPU `uuid` with `labels` may be given to the pod.
    pub fn allows(&self, uuid: &str, labels: &BTreeMap<String, String>) -> bool {
        self.rules.iter().all(|rule| rule.allows(uuid, labels))
    }

    /// The annotations and values of the rules, for messages:
    /// `nvidia.com/use-gputype="A100"`.
    pub fn describe(&self) -> String {
        let mut seen = Vec::new();
        for (annotation, value) in self
            .rules
            .iter()
            .map(|r| (&r.annotation, &r.value))
            .chain(self.scope.iter().map(|s| (&s.annotation, &s.value)))
        {
            let entry = format!("{annotation}={value:?}");
            // A hint with both a selector and a scope is one annotation.
            if !seen.contains(&entry) {
                seen.push(entry);
            }
        }
        seen.join(", ")
    }
}

/// What a pod's annotations say about its GPUs and placement.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PodRules {
    /// Which GPUs.
    pub selection: GpuSelection,
    /// Which GPU on a node.
    pub gpu_policy: Option<PlacementPolicy>,
    /// Which node.
    pub node_policy: Option<PlacementPolicy>,
    /// The sharing group ([`SHARING_GROUP`] or KubeShare's [`KUBESHARE_GPUID`]).
    pub sharing_group: Option<String>,
}

fn refuse(key: &str, value: &str, problem: impl Into<String>) -> RequestError {
    RequestError::Annotation {
        key: key.to_owned(),
        value: value.to_owned(),
        problem: problem.into(),
    }
}

/// The entries of a HAMi list: comma-separated, each trimmed, empty ones skipped.
/// `None` for a blank value, which HAMi reads as no constraint.
fn hami_list(key: &str, value: &str) -> Result<Option<Vec<String>>, RequestError> {
    if value.trim().is_empty() {
        return Ok(None);
    }
    let entries: Vec<String> = value
        .split(',')
        .map(str::trim)
        .filter(|entry| !entry.is_empty())
        .map(str::to_owned)
        .collect();
    if entries.is_empty() {
        // HAMi would match no GPU at all: a pod that can never run.
        return Err(refuse(key, value, "names nothing between its commas"));
    }
    Ok(Some(entries))
}

/// HAMi's policy list (`binpack`, or `binpack,numa`): the one of binpack and spread
/// it names. HAMi's `topology-aware` and `numa` are accepted: Tessera always
/// prefers NVLink, then a PCIe switch, then a NUMA node for multi-GPU requests.
fn hami_policy(
    key: &str,
    value: &str,
    node: bool,
) -> Result<Option<PlacementPolicy>, RequestError> {
    let mut chosen = None;
    for entry in value.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let policy = match entry {
            "binpack" => PlacementPolicy::Binpack,
            "spread" => PlacementPolicy::Spread,
            "topology-aware" | "numa" if !node => continue,
            "mutex" if !node => {
                return Err(refuse(
                    key,
                    value,
                    "mutex (only idle GPUs) is not supported; ask for whole GPUs with nvidia.com/gpu instead",
                ));
            }
            other => {
                let expected = if node {
                    "binpack or spread"
                } else {
                    "binpack or spread, optionally with topology-aware or numa"
                };
                return Err(refuse(
                    key,
                    value,
                    format!("{other:?}: expected {expected}"),
                ));
            }
        };
        if chosen.is_some_and(|c| c != policy) {
            return Err(refuse(key, value, "names both binpack and spread"));
        }
        chosen = Some(policy);
    }
    Ok(chosen)
}

/// One device type's hint, as Koordinator's `apis/extension.DeviceHint` has it.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct DeviceHint {
    #[serde(default)]
    selector: Option<LabelSelector>,
    #[serde(default)]
    vf_selector: Option<serde_json::Value>,
    #[serde(default)]
    allocate_strategy: String,
    #[serde(default)]
    required_topology_scope: String,
    #[serde(default)]
    exclusive_policy: String,
}

impl DeviceHint {
    fn is_empty(&self) -> bool {
        self.selector.is_none()
            && self.vf_selector.is_none()
            && self.allocate_strategy.is_empty()
            && self.required_topology_scope.is_empty()
            && self.exclusive_policy.is_empty()
    }
}

/// What a Koordinator hint asks of GPUs: label requirements, and a scope.
type Hint = (Option<Vec<LabelRequirement>>, Option<TopologyScope>);

/// Koordinator's `device-allocate-hint`: the GPU selector, as label requirements,
/// and the required topology scope. Hints Tessera cannot honour are refused: other
/// device types, VF selectors, allocate strategies, exclusive policies, the Device
/// scope.
fn koordinator_hint(value: &str) -> Result<Hint, RequestError> {
    let key = KOORDINATOR_DEVICE_ALLOCATE_HINT;
    let hints: BTreeMap<String, Option<DeviceHint>> = serde_json::from_str(value)
        .map_err(|e| refuse(key, value, format!("not a map of device type to hint: {e}")))?;
    let mut gpu = None;
    let mut scope = None;
    for (device_type, hint) in hints {
        let Some(hint) = hint.filter(|h| !h.is_empty()) else {
            continue;
        };
        if device_type != DEVICE_TYPE_GPU {
            return Err(refuse(
                key,
                value,
                format!("{device_type}: Tessera allocates only gpu devices"),
            ));
        }
        if hint.vf_selector.is_some() {
            return Err(refuse(
                key,
                value,
                "gpu.vfSelector: GPUs have no virtual functions here",
            ));
        }
        if !hint.allocate_strategy.is_empty() {
            return Err(refuse(
                key,
                value,
                format!(
                    "gpu.allocateStrategy {:?}: not supported; the GPU count comes from the resources",
                    hint.allocate_strategy
                ),
            ));
        }
        scope = match hint.required_topology_scope.as_str() {
            "" | "Node" => None,
            "PCIe" => Some(TopologyScope::PcieSwitch),
            "NUMANode" => Some(TopologyScope::NumaNode),
            other => {
                return Err(refuse(
                    key,
                    value,
                    format!(
                        "gpu.requiredTopologyScope {other:?}: expected Node, NUMANode or PCIe (Device scopes a GPU with its RDMA devices, which Tessera does not allocate)"
                    ),
                ));
            }
        };
        if !hint.exclusive_policy.is_empty() {
            return Err(refuse(
                key,
                value,
                format!(
                    "gpu.exclusivePolicy {:?}: not supported",
                    hint.exclusive_policy
                ),
            ));
        }
        if let Some(selector) = hint.selector {
            gpu = Some(requirements(&selector).map_err(|problem| refuse(key, value, problem))?);
        }
    }
    Ok((gpu, scope))
}

/// A Kubernetes label selector as requirements, checked as `LabelSelectorAsSelector` checks it.
fn requirements(selector: &LabelSelector) -> Result<Vec<LabelRequirement>, String> {
    let mut out: Vec<LabelRequirement> = selector
        .match_labels
        .iter()
        .flatten()
        .map(|(key, value)| LabelRequirement {
            key: key.clone(),
            operator: LabelOperator::In,
            values: vec![value.clone()],
        })
        .collect();
    for (index, expression) in selector.match_expressions.iter().flatten().enumerate() {
        let at = format!("gpu.selector.matchExpressions[{index}]");
        let values = expression.values.clone().unwrap_or_default();
        let operator = match expression.operator.as_str() {
            "In" => LabelOperator::In,
            "NotIn" => LabelOperator::NotIn,
            "Exists" => LabelOperator::Exists,
            "DoesNotExist" => LabelOperator::DoesNotExist,
            other => {
                return Err(format!(
                    "{at}.operator {other:?}: expected In, NotIn, Exists or DoesNotExist"
                ));
            }
        };
        let needs_values = matches!(operator, LabelOperator::In | LabelOperator::NotIn);
        if needs_values == values.is_empty() {
            let rule = if needs_values { "needs" } else { "takes no" };
            return Err(format!("{at}: {} {rule} values", expression.operator));
        }
        out.push(LabelRequirement {
            key: expression.key.clone(),
            operator,
            values,
        });
    }
    Ok(out)
}

impl PodRules {
    /// Reads the annotations Tessera honours; the others are not its business.
    pub fn parse(annotations: Option<&BTreeMap<String, String>>) -> Result<Self, RequestError> {
        let mut rules = Self::default();
        let Some(annotations) = annotations else {
            return Ok(rules);
        };
        let get = |key: &str| annotations.get(key).map(String::as_str);
        let model = |entry: &String| label_value(entry).to_ascii_uppercase();
        for (key, include) in [(HAMI_USE_GPU_TYPE, true), (HAMI_NOUSE_GPU_TYPE, false)] {
            let Some(value) = get(key) else { continue };
            if let Some(types) = hami_list(key, value)? {
                let types: Vec<String> = types.iter().map(model).collect();
                if types.iter().any(String::is_empty) {
                    return Err(refuse(key, value, "a GPU type has no letter or digit"));
                }
                rules.selection.rules.push(GpuRule {
                    annotation: key.to_owned(),
                    value: value.to_owned(),
                    matches: if include {
                        GpuMatch::ModelIn(types)
                    } else {
                        GpuMatch::ModelNotIn(types)
                    },
                });
            }
        }
        for (key, include) in [(HAMI_USE_GPU_UUID, true), (HAMI_NOUSE_GPU_UUID, false)] {
            let Some(value) = get(key) else { continue };
            if let Some(uuids) = hami_list(key, value)? {
                rules.selection.rules.push(GpuRule {
                    annotation: key.to_owned(),
                    value: value.to_owned(),
                    matches: if include {
                        GpuMatch::UuidIn(uuids)
                    } else {
                        GpuMatch::UuidNotIn(uuids)
                    },
                });
            }
        }
        if let Some(value) = get(KUBESHARE_GPU_MODEL) {
            let wanted = model(&value.to_owned());
            if wanted.is_empty() {
                return Err(refuse(
                    KUBESHARE_GPU_MODEL,
                    value,
                    "names no GPU model (a model as KubeShare names it, e.g. NVIDIA-GeForce-GTX-1080)",
                ));
            }
            rules.selection.rules.push(GpuRule {
                annotation: KUBESHARE_GPU_MODEL.to_owned(),
                value: value.to_owned(),
                matches: GpuMatch::ModelIs(wanted),
            });
        }
        if let Some(value) = get(KOORDINATOR_DEVICE_ALLOCATE_HINT) {
            let (requirements, scope) = koordinator_hint(value)?;
            if let Some(requirements) = requirements {
                rules.selection.rules.push(GpuRule {
                    annotation: KOORDINATOR_DEVICE_ALLOCATE_HINT.to_owned(),
                    value: value.to_owned(),
                    matches: GpuMatch::Labels(requirements),
                });
            }
            rules.selection.scope = scope.map(|scope| ScopeRule {
                annotation: KOORDINATOR_DEVICE_ALLOCATE_HINT.to_owned(),
                value: value.to_owned(),
                scope,
            });
        }
        if let Some(value) = get(crate::enforcement::REQUIRE_ENFORCEMENT) {
            let key = crate::enforcement::REQUIRE_ENFORCEMENT;
            let labels = crate::enforcement::required_labels(value)
                .map_err(|problem| refuse(key, value, &problem))?;
            rules.selection.rules.push(GpuRule {
                annotation: key.to_owned(),
                value: value.to_owned(),
                matches: GpuMatch::Labels(
                    labels
                        .into_iter()
                        .map(|label| LabelRequirement {
                            key: label.to_owned(),
                            operator: LabelOperator::In,
                            values: vec!["true".to_owned()],
                        })
                        .collect(),
                ),
            });
        }
        if let Some(value) = get(HAMI_GPU_SCHEDULER_POLICY) {
            rules.gpu_policy = hami_policy(HAMI_GPU_SCHEDULER_POLICY, value, false)?;
        }
        if let Some(value) = get(HAMI_NODE_SCHEDULER_POLICY) {
            rules.node_policy = hami_policy(HAMI_NODE_SCHEDULER_POLICY, value, true)?;
        }
        for key in [SHARING_GROUP, KUBESHARE_GPUID] {
            let Some(value) = get(key) else { continue };
            let name = value.trim();
            if name.is_empty() {
                return Err(refuse(key, value, "names no sharing group"));
            }
            if let Some(other) = rules.sharing_group.as_deref().filter(|g| *g != name) {
                return Err(refuse(
                    key,
                    value,
                    format!("names another sharing group than {SHARING_GROUP} ({other:?})"),
                ));
            }
            rules.sharing_group = Some(name.to_owned());
        }
        Ok(rules)
    }
}
