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
    /// The node's GPUs cannot be published as a ResourceSlice.
    #[error(transparent)]
    Slice(#[from] tessera_api::dra::SliceError),
}

/// The annotation on the node's ResourceSlice that holds a digest of the devices
/// the reporter last wrote there: the slice is rewritten (and its pool generation
/// advanced) only when they change, whatever the API server adds to what it stores.
pub const SLICE_DIGEST: &str = "tessera.io/devices-digest";

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
                // The devices written out even when empty: `spec` alone serializes
                // an empty list away, and a merge patch of `{}` would keep the GPUs
                // (a node switched to DRA would then stay in the extender's book).
                let patch = json!({
                    "metadata": {"annotations": annotations},
                    "spec": {"devices": &spec.devices},
                });
                devices
                    .patch(&self.node, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map_err(api(format!("updating {what}")))?;
                Ok(true)
            }
            None => {
                let owner = self.node_owner().await?;
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

    /// Creates or replaces the node's ResourceSlice with the GPUs of `spec`
    /// ([`tessera_api::dra::resource_slice`]); returns whether it wrote (and logs
    /// how many GPUs it offers when it did). Each
    /// rewrite advances the pool's generation, which kube-scheduler reads to know
    /// the slice is the pool's newest.
    pub async fn publish_slice(&self, spec: &DeviceSpec) -> Result<bool, PublishError> {
        use k8s_openapi::api::resource::v1::ResourceSlice;
        use sha2::Digest;
        let slices: Api<ResourceSlice> = Api::all(self.client.clone());
        let name = tessera_api::dra::slice_name(&self.node);
        let what = format!("ResourceSlice {name}");
        let device = Device::new(&self.node, spec.clone());
        let (mut slice, left_out) = tessera_api::dra::resource_slice(&self.node, &device, 1)?;
        for why in &left_out {
            tracing::warn!(%why, "GPU not offered for DRA");
        }
        let devices = serde_json::to_vec(&slice.spec.devices).unwrap_or_default();
        let digest = format!("{:x}", sha2::Sha256::digest(&devices));
        slice.metadata.annotations =
            Some(BTreeMap::from([(SLICE_DIGEST.to_owned(), digest.clone())]));
        match slices
            .get_opt(&name)
            .await
            .map_err(api(format!("reading {what}")))?
        {
            Some(existing) => {
                let written = existing
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(SLICE_DIGEST));
                if written == Some(&digest) {
                    return Ok(false);
                }
                slice.spec.pool.generation = existing.spec.pool.generation.saturating_add(1);
                slice.metadata.resource_version = existing.metadata.resource_version;
                slice.metadata.owner_references = existing.metadata.owner_references;
                let stored = slices
                    .replace(&name, &PostParams::default(), &slice)
                    .await
                    .map_err(api(format!("replacing {what}")))?;
                warn_if_not_shared(&stored);
            }
            None => {
                slice.metadata.owner_references = Some(vec![self.node_owner().await?]);
                let stored = slices
                    .create(&PostParams::default(), &slice)
                    .await
                    .map_err(api(format!("creating {what}")))?;
                warn_if_not_shared(&stored);
            }
        }
        let offered = slice.spec.devices.as_ref().map_or(0, Vec::len);
        tracing::info!(offered, "ResourceSlice published");
        Ok(true)
    }

    /// The node as the owner of what the reporter publishes for it, so that
    /// deleting the Node deletes them.
    async fn node_owner(&self) -> Result<OwnerReference, PublishError> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let node = nodes
            .get(&self.node)
            .await
            .map_err(api(format!("reading node {}", self.node)))?;
        Ok(OwnerReference {
            api_version: "v1".into(),
            kind: "Node".into(),
            name: self.node.clone(),
            uid: node.metadata.uid.unwrap_or_default(),
            ..OwnerReference::default()
        })
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

/// Says so when kube-apiserver stored the slice's GPUs without their consumable
/// capacity: a server with the feature (DRAConsumableCapacity) off drops those
/// fields, and each GPU is then one whole device to every claim.
fn warn_if_not_shared(stored: &k8s_openapi::api::resource::v1::ResourceSlice) {
    let dropped = stored.spec.devices.iter().flatten().any(|d| {
        d.allow_multiple_allocations != Some(true)
            || d.capacity
                .as_ref()
                .and_then(|c| c.get(tessera_api::dra::CORES))
                .is_none_or(|c| c.request_policy.is_none())
    });
    if dropped {
        tracing::error!(
            slice = stored.metadata.name.as_deref().unwrap_or_default(),
            "kube-apiserver stored the GPUs without their consumable capacity (feature gate DRAConsumableCapacity off?): each GPU is a whole device to DRA, no share is possible"
        );
    }
}
