//! The DRA service kubelet calls: prepares and unprepares claims, one call at a
//! time per claim, and keeps the checkpoint in step.
//!
//! A prepared claim's CDI devices (`gpu.tessera.io/claim=<UID>-<index>`) have no
//! spec in the runtime's CDI directory on purpose: they are tokens only the
//! runtime proxy redeems, replacing each with the claim's GPU and its
//! enforcement. A container that reaches the runtime without the proxy (kubelet
//! pointed back at containerd) fails on the unresolvable device instead of
//! getting the GPU with its share unheld.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use async_trait::async_trait;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use tessera_api::dra::prepared::{PreparedClaim, PreparedClaims};
use tessera_api::dra::{DRIVER, slice_name};
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::prepare::{prepared_claim, reserved_pods, slice_gpus};
use crate::proto::dra::{
    Claim, Device, NodePrepareResourceResponse, NodePrepareResourcesRequest,
    NodePrepareResourcesResponse, NodeUnprepareResourceResponse, NodeUnprepareResourcesRequest,
    NodeUnprepareResourcesResponse, dra_plugin_server,
};
use crate::store::{Checkpoint, StoreError};

/// What the plugin reads from the API server: behind a trait so that the
/// service's rules are tested without one.
#[async_trait]
pub trait ClusterReader: Send + Sync + std::fmt::Debug {
    /// The ResourceClaim `namespace/name`.
    async fn claim(&self, namespace: &str, name: &str) -> Result<ResourceClaim, String>;
    /// The Pod `namespace/name`; `None` when it does not exist.
    async fn pod(&self, namespace: &str, name: &str) -> Result<Option<Pod>, String>;
    /// The ResourceSlice `name`.
    async fn slice(&self, name: &str) -> Result<ResourceSlice, String>;
}

/// [`ClusterReader`] through the API server.
#[derive(Clone)]
pub struct KubeReader {
    client: kube::Client,
}

impl std::fmt::Debug for KubeReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeReader").finish_non_exhaustive()
    }
}

impl KubeReader {
    /// Reads with `client`.
    pub fn new(client: kube::Client) -> Self {
        Self { client }
    }
}

#[async_trait]
impl ClusterReader for KubeReader {
    async fn claim(&self, namespace: &str, name: &str) -> Result<ResourceClaim, String> {
        kube::Api::<ResourceClaim>::namespaced(self.client.clone(), namespace)
            .get(name)
            .await
            .map_err(|e| format!("reading ResourceClaim {namespace}/{name}: {e}"))
    }

    async fn pod(&self, namespace: &str, name: &str) -> Result<Option<Pod>, String> {
        kube::Api::<Pod>::namespaced(self.client.clone(), namespace)
            .get_opt(name)
            .await
            .map_err(|e| format!("reading Pod {namespace}/{name}: {e}"))
    }

    async fn slice(&self, name: &str) -> Result<ResourceSlice, String> {
        kube::Api::<ResourceSlice>::all(self.client.clone())
            .get(name)
            .await
            .map_err(|e| format!("reading ResourceSlice {name}: {e}"))
    }
}

/// The plugin's state: the prepared claims, mirrored in the checkpoint.
#[derive(Debug)]
pub struct Plugin {
    node: String,
    reader: Arc<dyn ClusterReader>,
    checkpoint: Checkpoint,
    /// The book in memory; the std lock is held only to read or change it.
    claims: Mutex<PreparedClaims>,
    /// One lock per claim being prepared or unprepared, held across the whole
    /// call (its API reads included): a prepare that read the claim before an
    /// unprepare finished must not bring it back.
    calls: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Serialises writes of the checkpoint (held across them, off the request
    /// path of any other component).
    writes: tokio::sync::Mutex<()>,
}

impl Plugin {
    /// A plugin for `node` that starts from what `checkpoint` holds (a restart
    /// loses nothing); an unreadable checkpoint is an error.
    pub fn start(
        node: String,
        reader: Arc<dyn ClusterReader>,
        checkpoint: Checkpoint,
    ) -> Result<Self, StoreError> {
        let claims = checkpoint.load()?;
        tracing::info!(
            prepared = claims.claims.len(),
            checkpoint = %checkpoint.path().display(),
            "kubelet plugin state loaded"
        );
        Ok(Self {
            node,
            reader,
            checkpoint,
            claims: Mutex::new(claims),
            calls: Mutex::new(HashMap::new()),
            writes: tokio::sync::Mutex::new(()),
        })
    }

    /// Runs `call` (a call for the claim `uid`) alone among the claim's calls;
    /// the claim's lock is forgotten when no other call holds or waits for it.
    async fn one_at_a_time<T>(&self, uid: &str, call: impl Future<Output = T>) -> T {
        let lock = {
            let mut calls = self.calls.lock().unwrap_or_else(PoisonError::into_inner);
            Arc::clone(calls.entry(uid.to_owned()).or_default())
        };
        let result = {
            let _call = lock.lock().await;
            call.await
        };
        let mut calls = self.calls.lock().unwrap_or_else(PoisonError::into_inner);
        // Ours and the map's: nobody else has it.
        if Arc::strong_count(&lock) == 2 {
            calls.remove(uid);
        }
        result
    }

    /// A copy of the book, for tests and the proxy's view.
    pub fn prepared(&self) -> PreparedClaims {
        self.book().clone()
    }

    fn book(&self) -> std::sync::MutexGuard<'_, PreparedClaims> {
        self.claims.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Prepares one claim: its devices for kubelet, or why not.
    pub async fn prepare(&self, claim: &Claim) -> Result<Vec<Device>, String> {
        self.one_at_a_time(&claim.uid, self.prepare_locked(claim))
            .await
    }

    async fn prepare_locked(&self, claim: &Claim) -> Result<Vec<Device>, String> {
        // Prepared already (kubelet's retries, and its calls after its own restart):
        // read again, so that the pods it is reserved for now are recorded.
        let known = self.book().claims.get(&claim.uid).cloned();
        let prepared = match (self.read(claim).await, &known) {
            (Ok(prepared), _) => prepared,
            // The API server unreachable, but the claim was prepared: what was
            // prepared stands (kubelet's restart path must not fail on it).
            (Err(_), Some(known)) => known.clone(),
            (Err(error), None) => return Err(error),
        };
        let _write = self.writes.lock().await;
        let snapshot = {
            let mut book = self.book();
            book.claims.insert(claim.uid.clone(), prepared.clone());
            book.clone()
        };
        if let Err(error) = self.persist(snapshot).await {
            // Not recorded: the book goes back to what the file holds.
            let mut book = self.book();
            match known {
                Some(known) => book.claims.insert(claim.uid.clone(), known),
                None => book.claims.remove(&claim.uid),
            };
            return Err(error);
        }
        Ok(devices(&prepared))
    }

    /// Unprepares one claim; an unknown claim is unprepared already.
    pub async fn unprepare(&self, claim: &Claim) -> Result<(), String> {
        self.one_at_a_time(&claim.uid, self.unprepare_locked(claim))
            .await
    }

    async fn unprepare_locked(&self, claim: &Claim) -> Result<(), String> {
        let _write = self.writes.lock().await;
        let (removed, snapshot) = {
            let mut book = self.book();
            let removed = book.claims.remove(&claim.uid);
            (removed, book.clone())
        };
        let Some(removed) = removed else {
            return Ok(());
        };
        if let Err(error) = self.persist(snapshot).await {
            self.book().claims.insert(claim.uid.clone(), removed);
            return Err(error);
        }
        Ok(())
    }

    /// Reads the claim, this node's slice and the claim's pods.
    async fn read(&self, claim: &Claim) -> Result<PreparedClaim, String> {
        let found = self.reader.claim(&claim.namespace, &claim.name).await?;
        let slice = self.reader.slice(&slice_name(&self.node)).await?;
        let mut pods = Vec::new();
        for (name, uid) in reserved_pods(&found) {
            // A pod gone (its reservation not yet cleaned up) or of the same name
            // recreated is not the one reserved.
            let pod = self.reader.pod(&claim.namespace, &name).await?;
            if let Some(pod) = pod.filter(|p| p.metadata.uid.as_deref() == Some(uid.as_str())) {
                pods.push(pod);
            }
        }
        prepared_claim(&found, &claim.uid, &self.node, &slice_gpus(&slice), &pods)
            .map_err(|e| e.to_string())
    }

    /// Writes the checkpoint.
    async fn persist(&self, snapshot: PreparedClaims) -> Result<(), String> {
        let checkpoint = self.checkpoint.clone();
        tokio::task::spawn_blocking(move || checkpoint.save(&snapshot))
            .await
            .map_err(|e| format!("writing the checkpoint: {e}"))?
            .map_err(|e| format!("writing the checkpoint: {e}"))
    }
}

/// kubelet's devices for a prepared claim: one per result, with its CDI device.
fn devices(claim: &PreparedClaim) -> Vec<Device> {
    claim
        .devices
        .iter()
        .map(|device| Device {
            request_names: vec![device.request.clone()],
            pool_name: device.pool.clone(),
            device_name: device.device.clone(),
            cdi_device_ids: vec![device.cdi_device.clone()],
        })
        .collect()
}

/// The gRPC face of [`Plugin`].
#[derive(Debug, Clone)]
pub struct DraService {
    plugin: Arc<Plugin>,
}

impl DraService {
    /// Serves `plugin`.
    pub fn new(plugin: Arc<Plugin>) -> Self {
        Self { plugin }
    }

    /// The tonic service.
    pub fn into_server(self) -> dra_plugin_server::DRAPluginServer<Self> {
        dra_plugin_server::DRAPluginServer::new(self)
    }
}

#[async_trait]
impl dra_plugin_server::DRAPlugin for DraService {
    async fn node_prepare_resources(
        &self,
        request: Request<NodePrepareResourcesRequest>,
    ) -> Result<Response<NodePrepareResourcesResponse>, Status> {
        let mut claims = HashMap::new();
        for claim in request.into_inner().claims {
            let span = tracing::info_span!(
                "prepare",
                driver = DRIVER,
                claim = %format!("{}/{}", claim.namespace, claim.name),
                uid = %claim.uid
            );
            let answer = async {
                match self.plugin.prepare(&claim).await {
                    Ok(devices) => {
                        tracing::info!(devices = devices.len(), "claim prepared");
                        NodePrepareResourceResponse {
                            devices,
                            error: String::new(),
                        }
                    }
                    Err(error) => {
                        tracing::warn!(%error, "claim not prepared");
                        NodePrepareResourceResponse {
                            devices: Vec::new(),
                            error,
                        }
                    }
                }
            }
            .instrument(span)
            .await;
            claims.insert(claim.uid, answer);
        }
        Ok(Response::new(NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<NodeUnprepareResourcesRequest>,
    ) -> Result<Response<NodeUnprepareResourcesResponse>, Status> {
        let mut claims = HashMap::new();
        for claim in request.into_inner().claims {
            let span = tracing::info_span!(
                "unprepare",
                driver = DRIVER,
                claim = %format!("{}/{}", claim.namespace, claim.name),
                uid = %claim.uid
            );
            let error = async {
                match self.plugin.unprepare(&claim).await {
                    Ok(()) => {
                        tracing::info!("claim unprepared");
                        String::new()
                    }
                    Err(error) => {
                        tracing::warn!(%error, "claim not unprepared");
                        error
                    }
                }
            }
            .instrument(span)
            .await;
            claims.insert(claim.uid, NodeUnprepareResourceResponse { error });
        }
        Ok(Response::new(NodeUnprepareResourcesResponse { claims }))
    }
}

#[cfg(test)]
mod tests;
