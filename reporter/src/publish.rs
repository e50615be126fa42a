//! Writing the Device CR and the node's capacity and labels, only when they change.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use tessera_api::{Device, DeviceSpec};

use crate::report::NodePod;

/// Why publishing failed; the loop retries on its next round.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The API server refused or could not be reached.
    #[error("{what}")]
    Api {
        what: String,
        #[source]
        source: kube::Error,
    },
}

fn api(what: impl Into<String>) -> impl FnOnce(kube::Error) -> PublishError {
    let what = what.into();
    move |source| PublishError::Api { what, source }
}

/// Publishes one node's view.
#[derive(Clone)]
pub struct Publisher {
    client: Client,
    node: String,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

impl Publisher {
    /// A publisher for `node`.
    pub fn new(client: Client, node: impl Into<String>) -> Self {
        Self {
            client,
            node: node.into(),
        }
    }

    /// The pods bound to this node.
    pub async fn node_pods(&self) -> Result<Vec<NodePod>, PublishError> {
        let pods: Api<Pod> = Api::all(self.client.clone());
        let params = ListParams::default().fields(&format!("spec.nodeName={}", self.node));
        let list = pods
            .list(&params)
            .await
            .map_err(api(format!("listing pods on node {}", self.node)))?;
        Ok(list.items.iter().map(NodePod::from_pod).collect())
    }

    /// Creates or updates the Device CR named after the node, with `annotations`
    /// (those the reporter owns, see [`crate::report::device_annotations`]);
    /// returns whether it wrote.
    pub async fn publish_device(
        &self,
        spec: &DeviceSpec,
        annotations: &BTreeMap<String, String>,
    ) -> Result<bool, PublishError> {
        let devices: Api<Device> = Api::all(self.client.clone());
        let what = format!("Device {}", self.node);
        match devices
            .get_opt(&self.node)
            .await
            .map_err(api(format!("reading {what}")))?
        {
            Some(existing) => {
                let current = existing.metadata.annotations.unwrap_or_default();
                if existing.spec == *spec
                    && annotations.iter().all(|(k, v)| current.get(k) == Some(v))
                {
                    return Ok(false);
                }
                let patch = json!({"metadata": {"annotations": annotations}, "spec": spec});
                devices
                    .patch(&self.node, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map_err(api(format!("updating {what}")))?;
                Ok(true)
            }
            None => {
                let nodes: Api<Node> = Api::all(self.client.clone());
                let node = nodes
                    .get(&self.node)
                    .await
                    .map_err(api(format!("reading node {}", self.node)))?;
                let owner = OwnerReference {
                    api_version: "v1".into(),
                    kind: "Node".into(),
                    name: self.node.clone(),
                    uid: node.metadata.uid.unwrap_or_default(),
                    ..OwnerReference::default()
                };
                let device = Device {
                    metadata: ObjectMeta {
                        name: Some(self.node.clone()),
                        annotations: Some(annotations.clone()),
                        owner_references: Some(vec![owner]),
                        ..ObjectMeta::default()
                    },
                    spec: spec.clone(),
                };
                devices
                    .create(&PostParams::default(), &device)
                    .await
                    .map_err(api(format!("creating {what}")))?;
                Ok(true)
            }
        }
    }

    /// The node, read once a round: its taints and what it advertises.
    pub async fn node(&self) -> Result<Node, PublishError> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        nodes
            .get(&self.node)
            .await
            .map_err(api(format!("reading node {}", self.node)))
    }

    /// Sets the node's capacity, allocatable and labels where `node` (as read this
    /// round) differs; returns whether it wrote.
    pub async fn publish_node(
        &self,
        node: Node,
        capacity: &BTreeMap<String, Quantity>,
        labels: &BTreeMap<String, String>,
    ) -> Result<bool, PublishError> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let what = format!("node {}", self.node);
        let status = node.status.unwrap_or_default();
        let same = |current: Option<&BTreeMap<String, Quantity>>| {
            capacity
                .iter()
                .all(|(k, v)| current.and_then(|c| c.get(k)) == Some(v))
        };
        let mut wrote = false;
        if !same(status.capacity.as_ref()) || !same(status.allocatable.as_ref()) {
            let patch = json!({"status": {"capacity": capacity, "allocatable": capacity}});
            nodes
                .patch_status(&self.node, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map_err(api(format!("patching {what} status")))?;
            wrote = true;
        }
        let current = node.metadata.labels.unwrap_or_default();
        if labels.iter().any(|(k, v)| current.get(k) != Some(v)) {
            let patch = json!({"metadata": {"labels": labels}});
            nodes
                .patch(&self.node, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map_err(api(format!("labelling {what}")))?;
            wrote = true;
        }
        Ok(wrote)
    }
}
