//! The report of GPU memory use, and the OOM kill that holds it: every
//! [`EVERY`], what each container's processes hold of each GPU (the driver's
//! count, `tessera_enforce::usage`), against what its pod's grant gives it,
//! written whole to `<enforcement-dir>/gpu-memory.json` ([`tessera_api::usage`])
//! for tessera-reporter. Containers the proxy does not know (not made through
//! it), and those whose grant cannot be read now, are left out; a container on a
//! GPU it was not granted is reported with no grant, for the reporter to raise; a
//! trusted GPU agent's (`--trusted-gpu-agents`) as trusted. With the OOM kill on
//! (`--oom-kill`), a shared container holding more of a GPU than its grant plus
//! the margin loses its largest processes there (`tessera_enforce::oom`), and the
//! kill is kept in the file for the reporter to tell on the pod.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tessera_api::usage::{ContainerGpuMemory, GpuMemoryKill, MemoryGrant, NodeGpuMemory};
use tessera_enforce::oom::{HostKiller, KillError, Killer, victims};
use tessera_enforce::throttle::{HostProcesses, Processes};
use tessera_enforce::usage::{GpuMemory, NvmlGpuMemory, sums};
use tessera_enforce::usage::{Traced, trace};
use tessera_hooks::gpu::TrustedGpuAgent;

use crate::hook::HookRejection;
use crate::store::{PodInfo, PodStore};

/// Where the report learns what a container was granted of each GPU's memory:
/// the enforcement hook, which reads the pod's allocation against the node's GPUs.
#[async_trait::async_trait]
pub trait MemoryGrants: Send + Sync + std::fmt::Debug {
    /// What `container` of `pod` was granted of each GPU's memory (none for a pod
    /// the scheduler placed no GPU on).
    async fn granted_memory(
        &self,
        pod: &PodInfo,
        container: &str,
    ) -> Result<Vec<(String, MemoryGrant)>, HookRejection>;
}

/// How often the GPUs are read: also the longest an allocation past a grant
/// stands before the OOM kill sees it.
pub const EVERY: Duration = Duration::from_millis(500);

/// A process chosen to be killed: its pid and start time.
type Victim = (u32, Option<u64>);

/// How long a killed process is not counted (nor killed again) while the driver
/// still lists it: freeing a large context takes the driver a moment.
const DYING: Duration = Duration::from_secs(10);

/// The driver and the node's processes, read off the async threads.
pub struct Sampler {
    gpu: Box<dyn GpuMemory>,
    processes: Box<dyn Processes>,
    killer: Option<Box<dyn Killer>>,
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampler")
            .field("kills", &self.killer.is_some())
            .finish_non_exhaustive()
    }
}

impl Sampler {
    /// The real node's: NVML from `nvml_library`, processes from `/proc`.
    pub fn open(nvml_library: &Path) -> Result<Self, String> {
        let gpu = NvmlGpuMemory::open(nvml_library).map_err(|e| e.to_string())?;
        Ok(Self::new(Box::new(gpu), Box::new(HostProcesses::host()?)))
    }

    /// One over `gpu` and `processes`, which kills nothing.
    pub fn new(gpu: Box<dyn GpuMemory>, processes: Box<dyn Processes>) -> Self {
        Self {
            gpu,
            processes,
            killer: None,
        }
    }

    /// Kills the host's processes for the OOM kill from now on.
    pub fn kill_host_processes(&mut self) -> Result<(), String> {
        self.killer = Some(Box::new(HostKiller::new(HostProcesses::host()?)));
        Ok(())
    }

    /// This one, killing through `killer` for the OOM kill.
    pub fn killing(mut self, killer: Box<dyn Killer>) -> Self {
        self.killer = Some(killer);
        self
    }
}

/// The report's state between rounds.
#[derive(Debug)]
pub struct Report {
    sampler: Arc<Mutex<Sampler>>,
    hook: Arc<dyn MemoryGrants>,
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
    /// The OOM kill's margin above a grant, when it is on.
    margin: Option<u64>,
    /// Processes killed, by pid and start time, not counted until [`DYING`] has
    /// passed (a later process given the same pid is).
    dying: HashMap<Victim, Instant>,
    /// Containers whose processes could not be killed, said once each in the log.
    unkillable: HashSet<String>,
    /// Kills of the last [`tessera_api::usage::KILLS_KEPT_SECONDS`], for the file.
    kills: Vec<GpuMemoryKill>,
}

impl Report {
    /// A report written to `<dir>/gpu-memory.json`, with `trusted` GPU agents'
    /// containers marked as such.
    pub fn new(
        sampler: Sampler,
        hook: Arc<dyn MemoryGrants>,
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
            margin: None,
            dying: HashMap::new(),
            unkillable: HashSet::new(),
            kills: Vec::new(),
        }
    }

    /// With the OOM kill on, at `margin` bytes above each grant (the sampler must
    /// be [`Sampler::killing`]).
    pub fn with_oom_kill(mut self, margin: u64) -> Self {
        self.margin = Some(margin);
        self
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

    /// Reads the GPUs once, kills what holds more than its grant allows (with the
    /// OOM kill on), and writes the file if what it says changed. When the driver
    /// cannot be read, the file goes: no report is better than an old one.
    pub async fn round(&mut self) -> Result<(), String> {
        let sampler = Arc::clone(&self.sampler);
        let read = tokio::task::spawn_blocking(move || {
            let mut sampler = sampler.lock().unwrap_or_else(|e| e.into_inner());
            let read = sampler.gpu.processes()?;
            Ok::<_, tessera_enforce::usage::UsageError>((
                trace(&read.processes, sampler.processes.as_ref()),
                read.failed,
            ))
        })
        .await
        .map_err(|e| format!("GPU memory task failed: {e}"))?;
        let (mut traced, failed) = match read {
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
        // A process killed moments ago may still be listed while the driver frees
        // its memory: neither counted nor killed again.
        self.dying.retain(|_, at| at.elapsed() < DYING);
        traced.retain(|t| !self.dying.contains_key(&(t.process.pid, t.start)));
        let mut entries: Vec<(String, ContainerGpuMemory)> = Vec::new();
        let mut seen = HashSet::new();
        for ((container_id, gpu), used) in sums(&traced) {
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
            entries.push((
                container_id,
                ContainerGpuMemory {
                    namespace: pod.namespace.clone(),
                    pod: pod.name.clone(),
                    pod_uid: pod.uid.clone(),
                    container: container.name,
                    gpu,
                    used,
                    grant,
                },
            ));
        }
        self.grants.retain(|id, _| seen.contains(id));
        self.unkillable.retain(|id| seen.contains(id));
        if let Some(margin) = self.margin {
            self.oom_kill(&entries, &traced, margin).await;
        }
        let now = unix_now();
        self.kills
            .retain(|k| now.saturating_sub(k.at) < tessera_api::usage::KILLS_KEPT_SECONDS);
        let mut containers: Vec<ContainerGpuMemory> = entries.into_iter().map(|(_, e)| e).collect();
        containers.sort_by(|a, b| {
            (&a.namespace, &a.pod, &a.container, &a.gpu).cmp(&(
                &b.namespace,
                &b.pod,
                &b.container,
                &b.gpu,
            ))
        });
        self.write(Some(
            NodeGpuMemory {
                containers,
                kills: self.kills.clone(),
            }
            .to_json(),
        ))
        .await;
        Ok(())
    }

    /// Kills, in each shared container over its grant plus `margin` on a GPU, its
    /// largest processes there until the rest fit; each kill is logged and kept
    /// for the file. Only shares are held: a whole GPU, a trusted agent's and an
    /// ungranted use (the reporter's to judge against kubelet's checkpoint) are not.
    async fn oom_kill(
        &mut self,
        entries: &[(String, ContainerGpuMemory)],
        traced: &[Traced],
        margin: u64,
    ) {
        let mut orders = Vec::new();
        for (container_id, entry) in entries {
            let MemoryGrant::Share(limit) = entry.grant else {
                continue;
            };
            let allowance = limit.saturating_add(margin);
            if entry.used <= allowance {
                continue;
            }
            let processes: Vec<&Traced> = traced
                .iter()
                .filter(|t| t.container_id == *container_id && t.process.gpu == entry.gpu)
                .collect();
            let sizes: Vec<(u32, u64)> = processes
                .iter()
                .map(|t| (t.process.pid, t.process.used))
                .collect();
            // Each victim with its start time: a pid reused since is never killed.
            let chosen: Vec<Victim> = victims(&sizes, allowance)
                .into_iter()
                .map(|pid| {
                    let start = processes
                        .iter()
                        .find(|t| t.process.pid == pid)
                        .and_then(|t| t.start);
                    (pid, start)
                })
                .collect();
            orders.push((container_id.clone(), entry.clone(), chosen));
        }
        if orders.is_empty() {
            return;
        }
        let sampler = Arc::clone(&self.sampler);
        let done = tokio::task::spawn_blocking(move || {
            let sampler = sampler.lock().unwrap_or_else(|e| e.into_inner());
            orders
                .into_iter()
                .map(|(container_id, entry, pids)| {
                    let results: Vec<(Victim, Result<(), KillError>)> = pids
                        .into_iter()
                        .map(|(pid, start)| {
                            let result = match &sampler.killer {
                                Some(killer) => killer.kill(pid, start, &container_id),
                                None => Err(KillError::Failed(
                                    pid,
                                    std::io::Error::other("the sampler has no killer"),
                                )),
                            };
                            ((pid, start), result)
                        })
                        .collect();
                    (container_id, entry, results)
                })
                .collect::<Vec<_>>()
        })
        .await;
        let done = match done {
            Ok(done) => done,
            Err(error) => {
                tracing::warn!(%error, "OOM kill task failed");
                return;
            }
        };
        let at = unix_now();
        for (container_id, entry, results) in done {
            let limit = entry.limit().unwrap_or_default();
            let mut killed = Vec::new();
            for ((pid, start), result) in results {
                match result {
                    Ok(()) => {
                        self.dying.insert((pid, start), Instant::now());
                        killed.push(pid);
                    }
                    // Gone on its own (or its pid now another's): nothing to kill.
                    Err(KillError::Gone(..)) => {}
                    // Said once per container: it is tried again every reading.
                    Err(error) if self.unkillable.insert(container_id.clone()) => {
                        tracing::error!(pod = %format!("{}/{}", entry.namespace, entry.pod), container = %entry.container, gpu = %entry.gpu, %error, "GPU memory over its grant, and its process could not be killed");
                    }
                    Err(error) => tracing::debug!(%error, "OOM kill failed again"),
                }
            }
            if killed.is_empty() {
                continue;
            }
            tracing::warn!(
                pod = %format!("{}/{}", entry.namespace, entry.pod),
                container = %entry.container,
                gpu = %entry.gpu,
                used = entry.used,
                limit,
                margin,
                pids = ?killed,
                "GPU memory over the container's grant: its largest processes on that GPU killed"
            );
            self.kills.push(GpuMemoryKill {
                entry,
                margin,
                pids: killed,
                at,
            });
        }
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

/// Seconds since the Unix epoch (0 on a clock before it).
fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
