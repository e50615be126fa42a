//! The report of GPU memory use: every [`EVERY`], what each container's
//! processes hold of each GPU (the driver's count, `tessera_enforce::usage`),
//! against what its pod's grant gives it, written whole to
//! `<enforcement-dir>/gpu-memory.json` ([`tessera_api::usage`]) for
//! tessera-reporter. Containers the proxy does not know (not made through it),
//! and those whose grant cannot be read now, are left out; a container on a GPU
//! it was not granted is reported with no grant, for the reporter to raise; a
//! trusted GPU agent's (`--trusted-gpu-agents`) as trusted.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tessera_api::usage::{ContainerGpuMemory, MemoryGrant, NodeGpuMemory};
use tessera_enforce::throttle::{HostProcesses, Processes};
use tessera_enforce::usage::{GpuMemory, NvmlGpuMemory, per_container};
use tessera_hooks::gpu::TrustedGpuAgent;

use crate::enforce::EnforceHook;
use crate::store::PodStore;

/// How often the GPUs are read.
pub const EVERY: Duration = Duration::from_secs(2);

/// The driver and the node's processes, read off the async threads.
pub struct Sampler {
    gpu: Box<dyn GpuMemory>,
    processes: Box<dyn Processes>,
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampler").finish_non_exhaustive()
    }
}

impl Sampler {
    /// The real node's: NVML from `nvml_library`, processes from `/proc`.
    pub fn open(nvml_library: &Path) -> Result<Self, String> {
        let gpu = NvmlGpuMemory::open(nvml_library).map_err(|e| e.to_string())?;
        Ok(Self::new(Box::new(gpu), Box::new(HostProcesses::host()?)))
    }

    /// One over `gpu` and `processes`.
    pub fn new(gpu: Box<dyn GpuMemory>, processes: Box<dyn Processes>) -> Self {
        Self { gpu, processes }
    }
}

/// The report's state between rounds.
#[derive(Debug)]
pub struct Report {
    sampler: Arc<Mutex<Sampler>>,
    hook: Arc<EnforceHook>,
    store: Arc<PodStore>,
    trusted: Vec<TrustedGpuAgent>,
    file: PathBuf,
    /// Each known container's grants, by container ID (a pod's annotation does
    /// not change while it lives); only grants read whole.
    grants: HashMap<String, Vec<(String, MemoryGrant)>>,
    /// What the file holds: `None` before the first write, `Some(None)` when removed.
    written: Option<Option<String>>,
    /// The GPUs that could not be read last round, as said in the log.
    failed: Vec<String>,
}

impl Report {
    /// A report written to `<dir>/gpu-memory.json`, with `trusted` GPU agents'
    /// containers marked as such.
    pub fn new(
        sampler: Sampler,
        hook: Arc<EnforceHook>,
        store: Arc<PodStore>,
        trusted: Vec<TrustedGpuAgent>,
        dir: &Path,
    ) -> Self {
        Self {
            sampler: Arc::new(Mutex::new(sampler)),
            hook,
            store,
            trusted,
            file: dir.join(tessera_api::usage::USAGE_FILE),
            grants: HashMap::new(),
            written: None,
            failed: Vec::new(),
        }
    }

    /// Reads the GPUs every [`EVERY`], for ever.
    pub async fn run(mut self) {
        let mut every = tokio::time::interval(EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failing = false;
        loop {
            every.tick().await;
            match self.round().await {
                Ok(()) if failing => {
                    failing = false;
                    tracing::info!("GPU memory use read again");
                }
                Ok(()) => {}
                // Said once, not every round; the next round tries again.
                Err(error) if !failing => {
                    failing = true;
                    tracing::warn!(%error, "GPU memory use not read; its report is withdrawn until it is");
                }
                Err(_) => {}
            }
        }
    }

    /// Reads the GPUs once and writes the file if what it says changed. When the
    /// driver cannot be read, the file goes: no report is better than an old one.
    pub async fn round(&mut self) -> Result<(), String> {
        let sampler = Arc::clone(&self.sampler);
        let sums = tokio::task::spawn_blocking(move || {
            let mut sampler = sampler.lock().unwrap_or_else(|e| e.into_inner());
            let read = sampler.gpu.processes()?;
            Ok::<_, tessera_enforce::usage::UsageError>((
                per_container(&read.processes, sampler.processes.as_ref()),
                read.failed,
            ))
        })
        .await
        .map_err(|e| format!("GPU memory task failed: {e}"))?;
        let (sums, failed) = match sums {
            Ok(read) => read,
            Err(error) => {
                self.write(None).await;
                return Err(error.to_string());
            }
        };
        let failed: Vec<String> = failed.iter().map(ToString::to_string).collect();
        if failed != self.failed && !failed.is_empty() {
            tracing::warn!(gpus = %failed.join("; "), "GPU memory use not read on some GPUs; the others are reported");
        }
        self.failed = failed;
        let mut containers = Vec::new();
        let mut seen = HashSet::new();
        for ((container_id, gpu), used) in sums {
            let Some((container, Some(pod))) = self.store.container(&container_id) else {
                continue;
            };
            seen.insert(container_id.clone());
            let grant = if self
                .trusted
                .iter()
                .any(|agent| agent.admits(&pod.namespace, &pod.labels))
            {
                MemoryGrant::Trusted
            } else {
                if !self.grants.contains_key(&container_id) {
                    match self.hook.granted_memory(&pod, &container.name).await {
                        Ok(grants) => {
                            self.grants.insert(container_id.clone(), grants);
                        }
                        // Left out this round, not reported as ungranted; the next
                        // round asks again.
                        Err(error) => {
                            tracing::debug!(pod = %pod.display_name(), container = %container.name, error = %error.message, "grant not read for the GPU memory report");
                            continue;
                        }
                    }
                }
                self.grants[&container_id]
                    .iter()
                    .find(|(uuid, _)| *uuid == gpu)
                    .map_or(MemoryGrant::None, |(_, grant)| *grant)
            };
            containers.push(ContainerGpuMemory {
                namespace: pod.namespace.clone(),
                pod: pod.name.clone(),
                pod_uid: pod.uid.clone(),
                container: container.name,
                gpu,
                used,
                grant,
            });
        }
        self.grants.retain(|id, _| seen.contains(id));
        containers.sort_by(|a, b| {
            (&a.namespace, &a.pod, &a.container, &a.gpu).cmp(&(
                &b.namespace,
                &b.pod,
                &b.container,
                &b.gpu,
            ))
        });
        self.write(Some(NodeGpuMemory { containers }.to_json()))
            .await;
        Ok(())
    }

    /// Writes `text` whole (or removes the file for `None`) when it changed.
    async fn write(&mut self, text: Option<String>) {
        if self.written.as_ref() == Some(&text) {
            return;
        }
        let file = self.file.clone();
        let body = text.clone();
        let done = tokio::task::spawn_blocking(move || match body {
            Some(body) => tessera_enforce::write_whole(&file, &body),
            None => match std::fs::remove_file(&file) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            },
        })
        .await;
        match done {
            Ok(Ok(())) => self.written = Some(text),
            Ok(Err(error)) => {
                tracing::warn!(file = %self.file.display(), %error, "GPU memory report not written")
            }
            Err(error) => tracing::warn!(%error, "GPU memory report task failed"),
        }
    }
}
