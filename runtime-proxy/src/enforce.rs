//! The node side of enforced shares that needs more than a container edit:
//!
//! - **driver memory limits**: writes each shared container's CDI spec (a
//!   `createRuntime` hook running `tessera-enforce`, see [`tessera_enforce::cdi`])
//!   in the runtime's CDI directory when its pod's sandbox is created, before any
//!   of its containers (containerd reads new spec files asynchronously), and again
//!   at CreateContainer when it is missing. A shared container whose limits the
//!   runtime would not run (CDI off in the runtime) is refused, never created
//!   unlimited.
//! - **MPS**: makes each shared container's namespace (and its GPU's server) at
//!   CreateContainer, before the runtime sees the container, so that its pipe
//!   directory exists with its limits in force when the container starts; a
//!   container whose namespace cannot be made is refused (kubelet retries).
//! - **cleanup**: a pod's spec files, MPS namespaces and HAMi-core directories go
//!   with its sandbox.
//!
//! The GPU hook (which runs first) names the CDI device on the container; this
//! hook makes sure the runtime has it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use k8s_cri::v1 as cri;
use tessera_api::DeviceAllocations;
use tessera_api::resources::DEVICE_ALLOCATED;
use tessera_enforce::MemoryLimit;
use tessera_enforce::cdi::{self, HookCommand};
use tessera_enforce::mps::{self, Mps};
use tessera_hooks::gpu::{Enforcement, NodeDevices, SharedLimits, shared_limits};
use tessera_hooks::probe::DeviceProbe;
use tokio::sync::OnceCell;
use tonic::Code;

use crate::backend::Backend;
use crate::gpu_time::GpuTimeHold;
use crate::hook::{CallOutcome, Hook, HookContext, HookRejection, LifecycleRequest};
use crate::metrics::{EnforcementLabels, Metrics};
use crate::store::PodInfo;
use tessera_enforce::throttle::Grant;

mod setup;
pub use setup::*;

/// Writes and removes enforcement files around the lifecycle; see the module docs.
#[derive(Debug)]
pub struct EnforceHook {
    enforcement: Enforcement,
    driver: Option<DriverMemory>,
    mps: Option<Mps>,
    gpu_time: Option<GpuTimeHold>,
    probe: Arc<dyn DeviceProbe>,
    cdi: OnceCell<RuntimeCdi>,
    metrics: Arc<Metrics>,
}

impl EnforceHook {
    /// A hook for `enforcement`, with `driver` when driver memory limits are on
    /// and `mps` when MPS is.
    pub fn new(
        enforcement: Enforcement,
        driver: Option<DriverMemory>,
        mps: Option<Mps>,
        probe: Arc<dyn DeviceProbe>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            enforcement,
            driver,
            mps,
            gpu_time: None,
            probe,
            cdi: OnceCell::new(),
            metrics,
        }
    }

    /// The hook holding shared containers to their GPU time with `hold`.
    pub fn with_gpu_time(mut self, hold: Option<GpuTimeHold>) -> Self {
        self.gpu_time = hold;
        self
    }

    /// GPU time once the proxy has listed the runtime's pods into `store`: holds
    /// the shared containers of live pods that have a compute share (those
    /// started while GPU time was off, or by a proxy without it, are held from now
    /// on; those already held keep their state), and lets go of the pods no
    /// longer on the node (removed while the proxy was down). Returns how many
    /// containers were newly held and how many let go; a container that cannot be
    /// held is warned about.
    pub async fn resync_gpu_time(&self, store: &crate::store::PodStore) -> (usize, usize) {
        let Some(hold) = &self.gpu_time else {
            return (0, 0);
        };
        let mut held = 0;
        for (container, pod) in store.live_containers() {
            if !pod.annotations.contains_key(DEVICE_ALLOCATED) {
                continue;
            }
            match self.hold_gpu_time(hold, &pod, &container).await {
                Ok(new) => held += usize::from(new),
                Err(error) => {
                    tracing::warn!(pod = %pod.display_name(), container = %container.name, %error, "a running shared container is not held to its GPU time");
                }
            }
        }
        let live: Vec<String> = store.live_pods().iter().map(|p| p.uid.clone()).collect();
        let hold = hold.clone();
        let let_go = match blocking(move || hold.prune(&live)).await {
            Ok(let_go) => let_go,
            Err(error) => {
                tracing::warn!(%error, "GPU-time holds of gone pods not let go");
                0
            }
        };
        (held, let_go)
    }

    /// Holds a shared container with a compute share to it (before it starts):
    /// refused when it cannot be. Returns whether it was newly held.
    async fn hold_gpu_time(
        &self,
        hold: &GpuTimeHold,
        pod: &PodInfo,
        container: &crate::store::ContainerInfo,
    ) -> Result<bool, HookRejection> {
        let mut new = false;
        for (_, limits) in self.limits(pod, vec![container.name.clone()]).await? {
            // Held where any GPU's share is below the whole; `percent` is the
            // highest such share, each GPU its own below.
            let Some(percent) = limits
                .compute_by_gpu
                .iter()
                .filter_map(|p| p.filter(|p| *p < 100))
                .max()
            else {
                continue;
            };
            if limits.is_empty() {
                continue;
            }
            // Each GPU its own share (a GPU with none is not held).
            let percents: Vec<u64> = limits
                .compute_by_gpu
                .iter()
                .map(|p| p.filter(|p| *p < 100).unwrap_or(100))
                .collect();
            let grant = Grant {
                pod_uid: pod.uid.clone(),
                container_id: container.id.clone(),
                percent,
                gpus: limits.memory.iter().map(|m| m.uuid.clone()).collect(),
                percents: if percents.iter().all(|p| *p == percent) {
                    Vec::new()
                } else {
                    percents
                },
            };
            let hold = hold.clone();
            new |= blocking(move || hold.grant(grant))
                .await?
                .map_err(|error| {
                    HookRejection::new(
                        Code::Unavailable,
                        format!(
                            "container {} of pod {}: its compute share cannot be held: {error}",
                            container.name,
                            pod.display_name()
                        ),
                    )
                })?;
            tracing::info!(pod = %pod.display_name(), container = %container.name, percent, "held to its share of GPU time");
        }
        Ok(new)
    }

    /// The CDI directory to write in; an error when the runtime will not run CDI hooks.
    async fn spec_dir(&self, driver: &DriverMemory) -> Result<PathBuf, HookRejection> {
        let cdi = self
            .cdi
            .get_or_try_init(|| driver.runtime.runtime_cdi())
            .await
            .map_err(|e| HookRejection::new(Code::Unavailable, e))?;
        if !cdi.enabled {
            return Err(HookRejection::new(
                Code::FailedPrecondition,
                "the runtime has CDI off (containerd: enable_cdi; containerd 1.6 has none), so it would not run the hook that sets a shared container's GPU memory limit; turn CDI on, or run the proxy with --gpu-memory-limits=off",
            ));
        }
        driver
            .spec_dir
            .clone()
            .or_else(|| cdi.spec_dir().map(Path::to_path_buf))
            .ok_or_else(|| {
                HookRejection::new(
                    Code::FailedPrecondition,
                    "the runtime names no CDI spec directory (cdi_spec_dirs); set --cdi-spec-dir",
                )
            })
    }

    /// The limits of each named container of `pod`, reading the node (blocking)
    /// off the async threads.
    async fn limits(
        &self,
        pod: &PodInfo,
        containers: Vec<String>,
    ) -> Result<Vec<(String, SharedLimits)>, HookRejection> {
        let Some(annotation) = pod.annotations.get(DEVICE_ALLOCATED).cloned() else {
            return Ok(Vec::new());
        };
        let probe = Arc::clone(&self.probe);
        let name = pod.display_name();
        let annotations = pod.annotations.clone();
        blocking(move || {
            let node: NodeDevices = probe.probe();
            containers
                .into_iter()
                .map(|container| {
                    let limits =
                        shared_limits(&name, &annotation, &container, &node, Some(&annotations))
                            .map_err(hook_rejection)?;
                    Ok((container, limits))
                })
                .collect()
        })
        .await?
    }

    /// Makes the MPS namespace of a shared container the GPU hook gave one (its
    /// pipe directory mounted), with the container's limits.
    async fn ensure_namespace(
        &self,
        mps: &Mps,
        pod: &PodInfo,
        container: String,
    ) -> Result<(), HookRejection> {
        let limits = self.limits(pod, vec![container.clone()]).await?;
        let Some(spec) = limits
            .first()
            .and_then(|(_, limits)| limits.mps_namespace(&pod.uid, &container))
        else {
            return Err(HookRejection::new(
                Code::FailedPrecondition,
                format!(
                    "container {container} has an MPS pipe directory but no single shared GPU to hold with it"
                ),
            ));
        };
        let mps = mps.clone();
        let made = blocking(move || mps.ensure(&spec).map(|dir| (spec, dir)))
            .await?
            .map_err(|e| {
                HookRejection::new(
                    Code::Unavailable,
                    format!("MPS did not take the container's share, so it is not created: {e}"),
                )
            })?;
        let (spec, dir) = made;
        tracing::info!(pod = %pod.display_name(), container, namespace = spec.name, server = spec.server, memory = spec.memory_flag(), thread_percentage = spec.thread_percentage, dir = %dir.display(), "MPS namespace in force");
        Ok(())
    }

    /// Writes each shared container's spec file; returns how many.
    async fn write_specs(
        &self,
        driver: &DriverMemory,
        pod: &PodInfo,
        containers: Vec<String>,
    ) -> Result<usize, HookRejection> {
        let shared: Vec<(String, Vec<MemoryLimit>)> = self
            .limits(pod, containers)
            .await?
            .into_iter()
            .filter(|(_, limits)| !limits.is_empty())
            .map(|(container, limits)| (container, limits.memory))
            .collect();
        if shared.is_empty() {
            return Ok(0);
        }
        let dir = self.spec_dir(driver).await?;
        let uid = pod.uid.clone();
        let hook = driver.hook.clone();
        let count = shared.len();
        blocking(move || write_spec_files(&dir, &uid, &shared, &hook))
            .await?
            .map_err(|e| {
                HookRejection::new(
                    Code::Internal,
                    format!("writing the CDI spec that sets GPU memory limits: {e}"),
                )
            })?;
        Ok(count)
    }
}

/// Runs blocking work (the node's files, NVML, MPS's control program) off the
/// async threads; a task that panicked is an internal refusal.
/// The GPU hook's refusal, as the enforcement hook's.
fn hook_rejection(error: tessera_hooks::gpu::GpuHookError) -> HookRejection {
    let status: tonic::Status = error.into();
    HookRejection::new(status.code(), status.message())
}

async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, HookRejection> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| HookRejection::new(Code::Internal, format!("enforcement task failed: {e}")))
}

/// One spec file per shared container, written whole (temp file, rename) so the
/// runtime never reads half of one.
fn write_spec_files(
    dir: &Path,
    pod_uid: &str,
    shared: &[(String, Vec<MemoryLimit>)],
    hook: &HookCommand,
) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for (container, limits) in shared {
        let Some(device) = cdi::device_name(pod_uid, container) else {
            continue;
        };
        let spec = cdi::pod_spec(pod_uid, &[(container.clone(), limits.clone())], hook);
        let path = cdi::spec_file(dir, &device);
        if std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .as_ref()
            == Some(&spec)
        {
            continue;
        }
        let temp = dir.join(format!(".{device}.tmp"));
        std::fs::write(&temp, serde_json::to_vec_pretty(&spec)?)?;
        std::fs::rename(&temp, &path)?;
    }
    Ok(())
}

/// Removes a pod's spec files (`tessera-enforce-<uid>_*.json`).
fn remove_spec_files(dir: &Path, pod_uid: &str) -> std::io::Result<usize> {
    let prefix = format!("tessera-enforce-{pod_uid}_");
    let mut removed = 0;
    for entry in std::fs::read_dir(dir)?.flatten() {
        let name = entry.file_name();
        if name.to_string_lossy().starts_with(&prefix) {
            std::fs::remove_file(entry.path())?;
            removed += 1;
        }
    }
    Ok(removed)
}

/// The containers the annotation grants GPUs by name (per-container form); the
/// pod-level form names none, and its containers' specs are written at creation.
fn named_containers(pod: &PodInfo) -> Vec<String> {
    let Some(Ok(allocations)) = pod
        .annotations
        .get(DEVICE_ALLOCATED)
        .map(|a| DeviceAllocations::parse(a))
    else {
        return Vec::new();
    };
    let mut names: Vec<String> = allocations
        .gpus()
        .iter()
        .filter_map(|gpu| gpu.containers.as_ref())
        .flat_map(|shares| shares.keys().cloned())
        .collect();
    names.sort();
    names.dedup();
    names
}

#[async_trait]
impl crate::usage::MemoryGrants for EnforceHook {
    /// From the pod's allocation annotation against the node's GPUs, read off the
    /// async threads.
    async fn granted_memory(
        &self,
        pod: &PodInfo,
        container: &str,
    ) -> Result<Vec<(String, tessera_api::usage::MemoryGrant)>, HookRejection> {
        let Some(annotation) = pod.annotations.get(DEVICE_ALLOCATED).cloned() else {
            return Ok(Vec::new());
        };
        let probe = Arc::clone(&self.probe);
        let name = pod.display_name();
        let container = container.to_owned();
        blocking(move || {
            tessera_hooks::gpu::granted_memory(&name, &annotation, &container, &probe.probe())
                .map_err(hook_rejection)
        })
        .await?
    }
}

#[async_trait]
impl Hook for EnforceHook {
    fn name(&self) -> &str {
        "enforce"
    }

    async fn pre(
        &self,
        ctx: &HookContext,
        request: &mut LifecycleRequest,
    ) -> Result<(), HookRejection> {
        // Let go before the runtime signals: a frozen process cannot take its
        // SIGTERM, and its grace period would pass frozen. By container ID, so
        // that a container whose pod is not known is let go too.
        if let Some(hold) = &self.gpu_time {
            let hold = hold.clone();
            let released = match (&*request, &ctx.pod) {
                (
                    LifecycleRequest::StopContainer(cri::StopContainerRequest {
                        container_id, ..
                    })
                    | LifecycleRequest::RemoveContainer(cri::RemoveContainerRequest { container_id }),
                    _,
                ) => {
                    let id = container_id.clone();
                    Some(blocking(move || hold.release(&id)).await.map(drop))
                }
                (LifecycleRequest::StopPodSandbox(_), Some(pod)) => {
                    let uid = pod.uid.clone();
                    Some(blocking(move || hold.release_pod(&uid)).await.map(drop))
                }
                _ => None,
            };
            if let Some(Err(error)) = released {
                tracing::warn!(%error, "GPU-time hold not released");
            }
        }
        let Some(pod) = &ctx.pod else {
            return Ok(());
        };
        match request {
            LifecycleRequest::StartContainer(_) => {
                if let (Some(hold), Some(container)) = (&self.gpu_time, &ctx.container)
                    && pod.annotations.contains_key(DEVICE_ALLOCATED)
                {
                    self.hold_gpu_time(hold, pod, container).await?;
                }
            }
            LifecycleRequest::RunPodSandbox(_) => {
                if let Some(driver) = &self.driver {
                    let written = self.write_specs(driver, pod, named_containers(pod)).await?;
                    if written > 0 {
                        tracing::info!(pod = %pod.display_name(), containers = written, "GPU memory limit hooks written");
                    }
                }
            }
            LifecycleRequest::CreateContainer(create) => {
                let name = ctx
                    .container
                    .as_ref()
                    .map(|c| c.name.clone())
                    .unwrap_or_default();
                let config = create.config.as_ref();
                let ours = config
                    .is_some_and(|c| c.cdi_devices.iter().any(|d| d.name.starts_with(cdi::KIND)));
                if let (Some(driver), true) = (&self.driver, ours) {
                    self.write_specs(driver, pod, vec![name.clone()]).await?;
                }
                // The GPU hook mounted a namespace's pipe directory (from under the
                // daemon's; a tenant's own mount there is not one): make it.
                if let Some(mps) = &self.mps {
                    let piped = config.is_some_and(|c| {
                        c.mounts.iter().any(|m| {
                            m.container_path == mps::CONTAINER_PIPE_DIR
                                && Path::new(&m.host_path).starts_with(mps.pipe_dir())
                        })
                    });
                    if piped {
                        self.ensure_namespace(mps, pod, name).await?;
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }

    async fn post(&self, ctx: &HookContext, request: &LifecycleRequest, outcome: &CallOutcome) {
        if !matches!(outcome, CallOutcome::Ok(_)) {
            return;
        }
        if let LifecycleRequest::CreateContainer(create) = request {
            // The GPU hook named the backends on each shared container it let through.
            let named = create.config.as_ref().and_then(|c| {
                c.envs
                    .iter()
                    .rfind(|e| e.key == tessera_hooks::gpu::enforce::ENFORCEMENT_ENV)
            });
            if let Some(env) = named {
                self.metrics
                    .shared_containers
                    .get_or_create(&EnforcementLabels {
                        enforcement: env.value.clone(),
                    })
                    .inc();
            }
            return;
        }
        // A stopped sandbox runs no container again (kubelet makes a new one), so
        // its MPS namespaces go at once: the GPU's server, and its exclusive
        // compute mode, must not outlive the pod while a whole-GPU grant may
        // already be on its way to the GPU. Everything else waits for removal.
        if let (LifecycleRequest::StopPodSandbox(_), Some(mps), Some(pod)) =
            (request, &self.mps, &ctx.pod)
        {
            let (mps, uid) = (mps.clone(), pod.uid.clone());
            match tokio::task::spawn_blocking(move || mps.remove_pod(&uid)).await {
                Ok(Ok(0)) => {}
                Ok(Ok(namespaces)) => {
                    tracing::info!(pod = %pod.display_name(), namespaces, "MPS namespaces of a stopped pod deleted");
                }
                Ok(Err(error)) => {
                    tracing::warn!(pod = %pod.display_name(), %error, "MPS namespaces of a stopped pod not all deleted; retried at its removal");
                }
                Err(error) => tracing::warn!(%error, "enforcement cleanup task failed"),
            }
            return;
        }
        if !matches!(request, LifecycleRequest::RemovePodSandbox(_)) {
            return;
        }
        let Some(pod) = &ctx.pod else {
            return;
        };
        let uid = pod.uid.clone();
        let enforcement = self.enforcement.clone();
        let mps = self.mps.clone();
        let gpu_time = self.gpu_time.clone();
        let dir = match &self.driver {
            Some(driver) => driver.spec_dir.clone().or_else(|| {
                self.cdi
                    .get()
                    .and_then(|c| c.spec_dir().map(Path::to_path_buf))
            }),
            None => None,
        };
        let result = tokio::task::spawn_blocking(move || {
            let specs = match &dir {
                Some(dir) if cdi::device_name(&uid, "x").is_some() => remove_spec_files(dir, &uid),
                _ => Ok(0),
            };
            let namespaces = mps.as_ref().map_or(Ok(0), |mps| mps.remove_pod(&uid));
            if let Some(hold) = &gpu_time {
                hold.release_pod(&uid);
            }
            (
                specs,
                tessera_hooks::gpu::enforce::remove_pod_dirs(&enforcement, &uid),
                namespaces,
            )
        })
        .await;
        match result {
            Ok((Ok(_), Ok(()), Ok(namespaces))) => {
                if namespaces > 0 {
                    tracing::info!(pod = %pod.display_name(), namespaces, "MPS namespaces of a removed pod deleted");
                }
            }
            Ok((specs, dirs, namespaces)) => {
                tracing::warn!(pod = %pod.display_name(), specs = ?specs.err(), dirs = ?dirs.err(), namespaces = ?namespaces.err(), "enforcement files or MPS namespaces of a removed pod not all removed");
            }
            Err(error) => tracing::warn!(%error, "enforcement cleanup task failed"),
        }
    }
}

#[cfg(test)]
mod tests;
