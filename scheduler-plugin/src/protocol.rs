//! The extender protocol as kube-scheduler speaks it (k8s.io/kube-scheduler/extender/v1,
//! PascalCase JSON): the arguments and answers of filter, prioritize, preempt and
//! bind, read fast where a call carries thousands of node names (`wire`) and
//! written without a string per name. Types only: no ledger, no I/O.

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, Pod};
use serde::{Deserialize, Serialize};

pub(crate) mod wire;

/// `ExtenderArgs`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderArgs {
    /// The pod being scheduled.
    pub pod: Pod,
    /// Candidate nodes (when the extender is not nodeCacheCapable).
    #[serde(default)]
    pub nodes: Option<NodeList>,
    /// Candidate node names (nodeCacheCapable).
    #[serde(default)]
    pub node_names: Option<Vec<String>>,
}

/// A `v1.NodeList` as kube-scheduler sends it.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
pub struct NodeList {
    /// The nodes.
    #[serde(default)]
    pub items: Vec<Node>,
}

/// A node name as the HTTP path reads it: borrowed from the request body (no
/// allocation per name; a call carries thousands), owned where JSON escapes made
/// the text differ from the bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Name<'a>(pub(crate) Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Name<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for Visitor<'a> {
            type Value = Name<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: serde::de::Error>(
                self,
                v: &'de str,
            ) -> Result<Self::Value, E> {
                Ok(Name(Cow::Borrowed(v)))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Name(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Name(Cow::Owned(v)))
            }
        }
        deserializer.deserialize_str(Visitor(std::marker::PhantomData))
    }
}

/// [`ExtenderArgs`] as the HTTP path reads it, node names borrowed from the body
/// (named so in errors too, which go back to the caller).
#[derive(Deserialize)]
#[serde(expecting = "struct ExtenderArgs", rename_all = "PascalCase")]
pub(crate) struct ExtenderArgsIn<'a> {
    pub(crate) pod: Pod,
    #[serde(default)]
    pub(crate) nodes: Option<NodeList>,
    #[serde(default, borrow)]
    pub(crate) node_names: Option<Vec<Name<'a>>>,
}

/// The candidate names of a call: `NodeNames`, else the names of `Nodes`.
pub(crate) fn candidate_names<'a>(
    node_names: Option<Vec<Name<'a>>>,
    nodes: Option<&NodeList>,
) -> Vec<Name<'a>> {
    node_names.unwrap_or_else(|| {
        names_of(nodes)
            .into_iter()
            .map(|name| Name(Cow::Owned(name)))
            .collect()
    })
}

/// [`ExtenderFilterResult`] with the node names borrowed from the call's: written
/// out as the same JSON, field for field.
#[derive(Debug, Default, Serialize)]
#[serde(rename_all = "PascalCase")]
pub(crate) struct FilterAnswer<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) nodes: Option<serde_json::Value>,
    pub(crate) node_names: Option<Vec<&'a str>>,
    pub(crate) failed_nodes: BTreeMap<&'a str, String>,
    pub(crate) failed_and_unresolvable_nodes: BTreeMap<&'a str, String>,
    pub(crate) error: String,
}

impl FilterAnswer<'_> {
    /// See [`ExtenderFilterResult::for_kube_scheduler`].
    pub(crate) fn for_kube_scheduler(mut self) -> Self {
        without_percent_signs(
            self.failed_nodes
                .values_mut()
                .chain(self.failed_and_unresolvable_nodes.values_mut()),
        );
        self
    }

    pub(crate) fn into_owned(self) -> ExtenderFilterResult {
        let owned = |map: BTreeMap<&str, String>| {
            map.into_iter()
                .map(|(name, why)| (name.to_owned(), why))
                .collect()
        };
        ExtenderFilterResult {
            nodes: self.nodes,
            node_names: self
                .node_names
                .map(|names| names.into_iter().map(str::to_owned).collect()),
            failed_nodes: owned(self.failed_nodes),
            failed_and_unresolvable_nodes: owned(self.failed_and_unresolvable_nodes),
            error: self.error,
        }
    }
}

/// [`HostPriority`] with the host borrowed from the call's names.
#[derive(Debug, Serialize)]
#[serde(rename_all = "PascalCase")]
pub(crate) struct HostScore<'a> {
    pub(crate) host: &'a str,
    pub(crate) score: i64,
}

/// `ExtenderFilterResult`.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderFilterResult {
    /// Nodes that fit (not nodeCacheCapable).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<serde_json::Value>,
    /// Names of nodes that fit.
    #[serde(default)]
    pub node_names: Option<Vec<String>>,
    /// Node → why it does not fit now (preemption may help: kube-scheduler's
    /// dry run considers these nodes).
    #[serde(default)]
    pub failed_nodes: BTreeMap<String, String>,
    /// Node → why it can never fit (no Device CR, too few or too small GPUs, an
    /// invalid request, an unsynced cache): preemption skips these nodes.
    #[serde(default)]
    pub failed_and_unresolvable_nodes: BTreeMap<String, String>,
    /// An error that fails the whole call (never used: it makes the pod retry in
    /// a hot loop; every refusal names the node instead).
    #[serde(default)]
    pub error: String,
}

impl ExtenderFilterResult {
    /// The answer as kube-scheduler prints it: it hands each reason to its event
    /// recorder as a printf format, so `50%` would read `50%!c(MISSING)` in the pod's
    /// events; `50 percent` reads the same there and in the pod's condition.
    pub fn for_kube_scheduler(mut self) -> Self {
        without_percent_signs(
            self.failed_nodes
                .values_mut()
                .chain(self.failed_and_unresolvable_nodes.values_mut()),
        );
        self
    }
}

/// Spells out `%` in `reasons` (see [`ExtenderFilterResult::for_kube_scheduler`]).
pub(crate) fn without_percent_signs<'r>(reasons: impl Iterator<Item = &'r mut String>) {
    for reason in reasons {
        if reason.contains('%') {
            *reason = reason.replace('%', " percent");
        }
    }
}

/// `HostPriority`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "PascalCase")]
pub struct HostPriority {
    /// Node name.
    pub host: String,
    /// 0..=10.
    pub score: i64,
}

/// `ExtenderPreemptionArgs`: the pod and, per candidate node, the victims
/// kube-scheduler's dry run chose (UIDs only when nodeCacheCapable, whole pods otherwise).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderPreemptionArgs {
    /// The preemptor.
    pub pod: Pod,
    /// Node → victims as pods (not nodeCacheCapable).
    #[serde(default)]
    pub node_name_to_victims: Option<BTreeMap<String, Option<Victims>>>,
    /// Node → victims as UIDs (nodeCacheCapable).
    #[serde(default)]
    pub node_name_to_meta_victims: Option<BTreeMap<String, Option<MetaVictims>>>,
}

/// `Victims`.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct Victims {
    /// The pods to evict.
    #[serde(default)]
    pub pods: Option<Vec<Pod>>,
    /// PodDisruptionBudgets their eviction violates.
    #[serde(default, rename = "NumPDBViolations")]
    pub num_pdb_violations: i64,
}

/// `MetaVictims`.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "PascalCase")]
pub struct MetaVictims {
    /// The pods to evict, by UID.
    #[serde(default)]
    pub pods: Option<Vec<MetaPod>>,
    /// PodDisruptionBudgets their eviction violates (kube-scheduler's count for
    /// the dry run's set: Tessera cannot see the budgets and passes it on).
    #[serde(default, rename = "NumPDBViolations")]
    pub num_pdb_violations: i64,
}

/// `MetaPod`.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct MetaPod {
    /// The pod's UID.
    #[serde(rename = "UID")]
    pub uid: String,
}

/// `ExtenderPreemptionResult`: the nodes where preemption helps, each with the
/// victims it takes. A node left out is no candidate.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderPreemptionResult {
    /// Node → victims.
    #[serde(default)]
    pub node_name_to_meta_victims: BTreeMap<String, MetaVictims>,
}

/// `ExtenderBindingArgs`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderBindingArgs {
    /// Pod name.
    pub pod_name: String,
    /// Pod namespace.
    pub pod_namespace: String,
    /// Pod UID.
    #[serde(rename = "PodUID")]
    pub pod_uid: String,
    /// The chosen node.
    pub node: String,
}

/// `ExtenderBindingResult`.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderBindingResult {
    /// Empty on success.
    #[serde(default)]
    pub error: String,
}

pub(crate) fn names_of(nodes: Option<&NodeList>) -> Vec<String> {
    nodes
        .map(|list| {
            list.items
                .iter()
                .filter_map(|n| n.metadata.name.clone())
                .collect()
        })
        .unwrap_or_default()
}

/// Writes `name` as a JSON string, as serde_json would: copied as it is when
/// nothing in it needs escaping (node names never do), else escaped by serde_json.
/// A call writes thousands of names; serde_json's string writer costs several
/// times a copy of one.
pub(crate) fn write_name(out: &mut Vec<u8>, name: &str) -> serde_json::Result<()> {
    if wire::plain_prefix(name.as_bytes()) == name.len() {
        out.reserve(name.len() + 2);
        out.push(b'"');
        out.extend_from_slice(name.as_bytes());
        out.push(b'"');
        Ok(())
    } else {
        serde_json::to_writer(out, name)
    }
}

/// Writes `score` as serde_json would (prioritize's scores are 0..=10).
pub(crate) fn write_score(out: &mut Vec<u8>, score: i64) -> serde_json::Result<()> {
    match u8::try_from(score) {
        Ok(digit @ 0..=9) => {
            out.push(b'0' + digit);
            Ok(())
        }
        _ => serde_json::to_writer(out, &score),
    }
}

/// Prioritize's answer as JSON: the bytes `serde_json::to_vec(scores)` writes
/// (a test holds them equal), written without serde's per-field machinery.
pub(crate) fn encode_scores(scores: &[HostScore<'_>]) -> serde_json::Result<Vec<u8>> {
    const ENTRY: usize = r#"{"Host":"","Score":10},"#.len();
    let bytes = scores.iter().map(|s| s.host.len() + ENTRY).sum::<usize>() + 2;
    let mut out = Vec::with_capacity(bytes);
    out.push(b'[');
    for (index, scored) in scores.iter().enumerate() {
        if index > 0 {
            out.push(b',');
        }
        out.extend_from_slice(br#"{"Host":"#);
        write_name(&mut out, scored.host)?;
        out.extend_from_slice(br#","Score":"#);
        write_score(&mut out, scored.score)?;
        out.push(b'}');
    }
    out.push(b']');
    Ok(out)
}

/// Filter's answer as JSON: the bytes `serde_json::to_vec(answer)` writes (a test
/// holds them equal), the node names copied as they are ([`write_name`]).
pub(crate) fn encode_filter(answer: &FilterAnswer<'_>) -> serde_json::Result<Vec<u8>> {
    let names = answer.node_names.as_deref().unwrap_or_default();
    let bytes = names.iter().map(|name| name.len() + 3).sum::<usize>() + 128;
    let mut out = Vec::with_capacity(bytes);
    out.push(b'{');
    if let Some(nodes) = &answer.nodes {
        out.extend_from_slice(br#""Nodes":"#);
        serde_json::to_writer(&mut out, nodes)?;
        out.push(b',');
    }
    out.extend_from_slice(br#""NodeNames":"#);
    match &answer.node_names {
        Some(names) => {
            out.push(b'[');
            for (index, name) in names.iter().enumerate() {
                if index > 0 {
                    out.push(b',');
                }
                write_name(&mut out, name)?;
            }
            out.push(b']');
        }
        None => out.extend_from_slice(b"null"),
    }
    for (field, reasons) in [
        (&br#","FailedNodes":"#[..], &answer.failed_nodes),
        (
            &br#","FailedAndUnresolvableNodes":"#[..],
            &answer.failed_and_unresolvable_nodes,
        ),
    ] {
        out.extend_from_slice(field);
        out.push(b'{');
        for (index, (name, why)) in reasons.iter().enumerate() {
            if index > 0 {
                out.push(b',');
            }
            write_name(&mut out, name)?;
            out.push(b':');
            serde_json::to_writer(&mut out, why)?;
        }
        out.push(b'}');
    }
    out.extend_from_slice(br#","Error":"#);
    serde_json::to_writer(&mut out, &answer.error)?;
    out.push(b'}');
    Ok(out)
}
