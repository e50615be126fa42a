//! The reporter loop: discover, read the checkpoint, publish on change.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tessera_api::LegacyDeviceEntry;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::checkpoint::{Checkpoint, parse_checkpoint};
use crate::events::{GpuEvents, health_changes};
use crate::gpu::{GpuSource, NodeGpus};
use crate::health::{HealthTracker, XidEvent};
use crate::metrics::{PublishOutcome, PublishedObject, ReporterMetrics};
use crate::publish::Publisher;
use crate::report::{
    CapacityOptions, device_annotations, device_spec, legacy_entries, node_capacity, node_labels,
    plugin_grants, read_enforcement, switch_unproven, with_enforcement, with_switch,
};
use crate::usage::{MemoryAlerts, read_usage, with_legacy};

/// Settings of the loop.
#[derive(Debug, Clone)]
pub struct LoopConfig {
    /// kubelet's device checkpoint.
    pub checkpoint: PathBuf,
    /// Extended resources whose checkpoint entries are published (`nvidia.com/gpu`).
    pub legacy_resources: Vec<String>,
    /// Full resync period.
    pub interval: Duration,
    /// How often the checkpoint file's change time is checked.
    pub checkpoint_poll: Duration,
    /// What the node advertises.
    pub capacity: CapacityOptions,
    /// A GPU is healthy again this long after its last critical XID.
    pub recovery_after: Duration,
    /// The runtime proxy's list of the node's enforcement backends; its GPU
    /// memory report ([`tessera_api::usage::USAGE_FILE`]) is beside it.
    pub enforcement_file: PathBuf,
    /// The node's GPUs go to Kubernetes' own allocator (DRA, docs/dra.md): they
    /// are published as a ResourceSlice, and the Device CR and the node's
    /// capacity offer none of them to tessera-scheduler, so that no GPU is in
    /// two books.
    pub dra: bool,
    /// Where each round's GPU health goes to the kubelet plugin's health
    /// service (with `dra`).
    pub dra_health: Option<tessera_dra::health::HealthFeed>,
}

impl LoopConfig {
    /// The runtime proxy's report of each container's GPU memory.
    pub fn usage_file(&self) -> PathBuf {
        self.enforcement_file
            .with_file_name(tessera_api::usage::USAGE_FILE)
    }

    /// The runtime proxy's count of kubelet's connections to it.
    pub fn kubelet_seen_file(&self) -> PathBuf {
        self.enforcement_file
            .with_file_name(tessera_api::kubelet_seen::KUBELET_SEEN_FILE)
    }
}

/// Whether kubelet calls the runtime through the proxy now, from the proxy's file
/// ([`tessera_api::kubelet_seen`]); why not, when it does not.
pub fn kubelet_seen(file: &std::path::Path) -> Result<(), tessera_api::kubelet_seen::Unproven> {
    let text = match std::fs::read_to_string(file) {
        Ok(text) => Some(text),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => None,
        Err(error) => {
            return Err(tessera_api::kubelet_seen::Unproven::Unreadable(
                error.to_string(),
            ));
        }
    };
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    tessera_api::kubelet_seen::KubeletSeen::proves(text.as_deref(), now).map(drop)
}

/// The loop's memory: the last good inputs, so a bad read never unpublishes.
#[derive(Debug, Default)]
struct Last {
    gpus: Option<NodeGpus>,
    checkpoint: Checkpoint,
    checkpoint_stamp: Option<(SystemTime, u64)>,
    usage_stamp: Option<(SystemTime, u64)>,
    /// The proxy's report as last read.
    usage: Option<tessera_api::usage::NodeGpuMemory>,
    /// The Device CR's GPU memory annotation, as it should be now.
    usage_published: String,
    alerts: MemoryAlerts,
    /// Which finding made kubelet's use of the proxy unproven, last time
    /// ([`tessera_api::kubelet_seen::Unproven::kind`]; logged on change).
    kubelet_unseen: Option<&'static str>,
}

fn stamp(path: &PathBuf) -> Option<(SystemTime, u64)> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}

/// Reads the checkpoint. A missing file means no device-plugin allocations; a
/// corrupt one is logged and the last good one stays.
fn read_checkpoint(path: &PathBuf, last: &mut Last, metrics: &ReporterMetrics) {
    match std::fs::read(path) {
        Ok(bytes) => match parse_checkpoint(&bytes) {
            Ok(checkpoint) => last.checkpoint = checkpoint,
            Err(error) => {
                metrics.checkpoint_errors.inc();
                tracing::error!(file = %path.display(), error = %crate::chain(&error), "checkpoint not usable; keeping the last good one")
            }
        },
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            last.checkpoint = Checkpoint::default()
        }
        Err(error) => {
            metrics.checkpoint_errors.inc();
            tracing::error!(file = %path.display(), %error, "checkpoint not readable; keeping the last good one")
        }
    }
}

/// Runs until `shutdown` resolves, with metrics nobody reads and no Events.
pub async fn run(
    source: Arc<dyn GpuSource>,
    publisher: Publisher,
    config: LoopConfig,
    xids: UnboundedReceiver<XidEvent>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let metrics = ReporterMetrics::default();
    run_with_metrics(
        source,
        publisher,
        config,
        &metrics,
        GpuEvents::none(),
        xids,
        shutdown,
    )
    .await;
}

/// Runs until `shutdown` resolves, recording into `metrics` and announcing GPU health
/// changes to `events`.
pub async fn run_with_metrics(
    source: Arc<dyn GpuSource>,
    publisher: Publisher,
    config: LoopConfig,
    metrics: &ReporterMetrics,
    events: GpuEvents,
    mut xids: UnboundedReceiver<XidEvent>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    // Unproven until the proxy's file has been read.
    let mut last = Last {
        kubelet_unseen: Some("not read yet"),
        ..Last::default()
    };
    let mut health = HealthTracker::new(config.recovery_after);
    // The unhealthy GPUs (and their XIDs) the node has been told about.
    let mut announced = BTreeMap::new();
    let mut resync = tokio::time::interval(config.interval);
    let mut poll = tokio::time::interval(config.checkpoint_poll);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = resync.tick() => {
                let source = Arc::clone(&source);
                // NVML calls block: off the async threads.
                match tokio::task::spawn_blocking(move || source.discover()).await {
                    Ok(Ok(gpus)) => {
                        metrics.gpus.set(i64::try_from(gpus.gpus.len()).unwrap_or(i64::MAX));
                        last.gpus = Some(gpus);
                    }
                    Ok(Err(error)) => {
                        metrics.discovery_failures.inc();
                        tracing::error!(error = %crate::chain(&error), "GPU discovery failed; keeping the last good view");
                    }
                    Err(error) => {
                        metrics.discovery_failures.inc();
                        tracing::error!(%error, "GPU discovery task failed");
                    }
                }
                read_checkpoint(&config.checkpoint, &mut last, metrics);
                last.checkpoint_stamp = stamp(&config.checkpoint);
                health.recover(Instant::now());
                observe_usage(&config, &mut last, metrics, &events, true);
                observe_kubelet(&config, &mut last);
            }
            _ = poll.tick() => {
                let now = stamp(&config.checkpoint);
                let changed = now != last.checkpoint_stamp;
                if changed {
                    read_checkpoint(&config.checkpoint, &mut last, metrics);
                    last.checkpoint_stamp = now;
                }
                // After the checkpoint: a device plugin's new grant is known
                // before its container's memory is judged.
                observe_usage(&config, &mut last, metrics, &events, false);
                // kubelet leaving the proxy publishes at once: no GPU pod may be
                // placed where no GPU hook runs.
                // A failed publish of it is retried with the next --interval, as
                // any other (not every poll: that would press a failing API server).
                let kubelet = observe_kubelet(&config, &mut last);
                // The usage annotation alone never publishes: it goes with the
                // next publish (every --interval at the latest).
                if !changed && !kubelet && !health.recover(Instant::now()) {
                    continue;
                }
            }
            event = xids.recv() => match event {
                Some(event) => {
                    metrics.record_xid(&event.uuid, event.xid);
                    if !health.on_xid(&event, Instant::now()) {
                        continue;
                    }
                    tracing::warn!(uuid = %event.uuid, xid = event.xid, "GPU marked unhealthy");
                }
                // The watcher stopped (logged there); the loop goes on without it.
                None => xids = tokio::sync::mpsc::unbounded_channel().1,
            },
            () = &mut shutdown => return,
        }
        let unhealthy = health.unhealthy_xids();
        for change in health_changes(&announced, &unhealthy) {
            events.send(change);
        }
        announced = unhealthy;
        if publish(&publisher, &config, &last, &health.unhealthy(), metrics).await {
            metrics.record_published_at(SystemTime::now());
        }
    }
}

/// Reads whether kubelet calls through the proxy ([`kubelet_seen`]) into `last`;
/// true when that changed. A change is logged with why.
fn observe_kubelet(config: &LoopConfig, last: &mut Last) -> bool {
    let why = kubelet_seen(&config.kubelet_seen_file()).err();
    // The finding, not its figures: a stale file's age changes every second.
    let now = why.as_ref().map(tessera_api::kubelet_seen::Unproven::kind);
    if now == last.kubelet_unseen {
        return false;
    }
    match &why {
        Some(why) => tracing::warn!(
            file = %config.kubelet_seen_file().display(),
            %why,
            "the node's switch to the runtime proxy is unproven: no GPU pod goes here"
        ),
        None => tracing::info!("kubelet calls through the runtime proxy: the switch is proven"),
    }
    last.kubelet_unseen = now;
    true
}

/// Reads the runtime proxy's GPU memory report when it changed (or `force`), and
/// judges it against kubelet's checkpoint: records it as metrics, tells containers newly at their limit or on a GPU they
/// were not granted, and keeps the Device CR's annotation for the next publish.
fn observe_usage(
    config: &LoopConfig,
    last: &mut Last,
    metrics: &ReporterMetrics,
    events: &GpuEvents,
    force: bool,
) {
    // Without the GPUs, a device plugin's grant by index could not be told from
    // no grant: nothing is judged before the first discovery.
    let Some(gpus) = &last.gpus else {
        return;
    };
    let file = config.usage_file();
    let now = stamp(&file);
    if force || now != last.usage_stamp {
        last.usage_stamp = now;
        last.usage = read_usage(&file);
    }
    // Judged again each time, file changed or not: against the checkpoint as it is
    // now, and so that a suspicion is confirmed or cleared at the next reading.
    // Every device-plugin grant kubelet recorded, whoever's pod: no pod list needed.
    let legacy = plugin_grants(&last.checkpoint, &config.legacy_resources, gpus);
    let usage = last.usage.clone().map(|usage| with_legacy(usage, &legacy));
    metrics.record_gpu_memory(usage.as_ref());
    if let Some(usage) = &usage {
        // Named only in a limit's Event: read only when a container is at one.
        let backends = if usage.containers.iter().any(|c| c.at_limit()) {
            tessera_api::enforcement::joined(&read_enforcement(&config.enforcement_file))
        } else {
            String::new()
        };
        for event in last.alerts.changes(usage, &backends, Instant::now()) {
            events.send(event);
        }
    }
    last.usage_published = usage.map_or_else(|| USAGE_UNKNOWN.to_owned(), |u| u.published());
}

/// The Device CR's GPU memory annotation while the proxy's report is missing.
pub const USAGE_UNKNOWN: &str = "unknown";

/// Publishes the Device CR and the node; returns whether both are now current.
async fn publish(
    publisher: &Publisher,
    config: &LoopConfig,
    last: &Last,
    unhealthy: &BTreeSet<String>,
    metrics: &ReporterMetrics,
) -> bool {
    let Some(gpus) = &last.gpus else { return false };
    let legacy: Vec<LegacyDeviceEntry> = match publisher.node_pods().await {
        Ok(pods) => legacy_entries(&last.checkpoint, &pods, &config.legacy_resources, gpus),
        Err(error) => {
            // The Device needs the pod list: without it, it is not published.
            metrics.record_publish(PublishedObject::Device, PublishOutcome::Failed);
            tracing::error!(error = %crate::chain(&error), "cannot list the node's pods; not publishing this round");
            return false;
        }
    };
    // The switch taint unread, nothing is published this round (the last stands).
    let node = match publisher.node().await {
        Ok(node) => node,
        Err(error) => {
            metrics.record_publish(PublishedObject::Device, PublishOutcome::Failed);
            metrics.record_publish(PublishedObject::Node, PublishOutcome::Failed);
            tracing::error!(error = %crate::chain(&error), "cannot read the node's taints; not publishing this round");
            return false;
        }
    };
    metrics.record_published_view(unhealthy, &legacy);
    let mut spec = device_spec(gpus, unhealthy);
    let mut annotations = device_annotations(gpus, &legacy);
    let backends = read_enforcement(&config.enforcement_file);
    metrics.record_enforcement(&backends);
    with_enforcement(&mut spec, &mut annotations, &backends);
    let unproven = switch_unproven(&node) || last.kubelet_unseen.is_some();
    if let Some(feed) = &config.dra_health {
        feed.publish(gpu_health(&spec));
    }
    // DRA: one book per node. The slice gets the GPUs, the extender none; the
    // GPUs leave the extender's book (Device CR, capacity) before the slice offers
    // them, so a failed write leaves them in neither, never in both.
    let offered = config.dra.then(|| {
        let mut offered = spec.clone();
        // Not offered: GPUs device-plugin pods hold (as the extender's ledger holds
        // them), and every GPU while no GPU hook is proven to run on the node (as
        // the extender places no GPU pod there then).
        let held: BTreeSet<&str> = legacy
            .iter()
            .flat_map(|entry| entry.device_ids.iter().map(String::as_str))
            .collect();
        offered
            .devices
            .retain(|d| !unproven && !held.contains(d.id.as_str()));
        spec.devices
            .retain(|d| d.device_type != tessera_api::resources::DEVICE_TYPE_GPU);
        offered
    });
    with_switch(&mut annotations, unproven);
    annotations.insert(
        tessera_api::usage::DEVICE_ANNOTATION.to_owned(),
        if last.usage_published.is_empty() {
            USAGE_UNKNOWN.to_owned()
        } else {
            last.usage_published.clone()
        },
    );
    let device = match publisher.publish_device(&spec, &annotations).await {
        Ok(true) => {
            tracing::info!(
                gpus = gpus.gpus.len(),
                unhealthy = unhealthy.len(),
                legacy = legacy.len(),
                "Device published"
            );
            PublishOutcome::Changed
        }
        Ok(false) => PublishOutcome::Unchanged,
        Err(error) => {
            tracing::error!(error = %crate::chain(&error), "publishing the Device failed");
            PublishOutcome::Failed
        }
    };
    metrics.record_publish(PublishedObject::Device, device);
    // The same mark as a Node label: its change is a Node update, on which
    // kube-scheduler retries the pods the extender refused for it (it does not
    // watch Device CRs).
    let mut labels = node_labels(gpus);
    labels.insert(
        tessera_api::resources::SWITCH_UNPROVEN.to_owned(),
        unproven.to_string(),
    );
    let node = match publisher
        .publish_node(
            node,
            &node_capacity(
                if config.dra { &NO_GPUS } else { gpus },
                unhealthy,
                &config.capacity,
            ),
            &labels,
        )
        .await
    {
        Ok(true) => {
            tracing::info!("node capacity and labels published");
            PublishOutcome::Changed
        }
        Ok(false) => PublishOutcome::Unchanged,
        Err(error) => {
            tracing::error!(error = %crate::chain(&error), "publishing node capacity failed");
            PublishOutcome::Failed
        }
    };
    metrics.record_publish(PublishedObject::Node, node);
    let slice = match offered {
        None => PublishOutcome::Unchanged,
        Some(_) if device == PublishOutcome::Failed || node == PublishOutcome::Failed => {
            tracing::warn!(
                "ResourceSlice not published this round: the GPUs are not out of the extender's book yet"
            );
            PublishOutcome::Failed
        }
        Some(offered) => match publisher.publish_slice(&offered).await {
            Ok(true) => PublishOutcome::Changed,
            Ok(false) => PublishOutcome::Unchanged,
            Err(error) => {
                tracing::error!(error = %crate::chain(&error), "publishing the ResourceSlice failed");
                PublishOutcome::Failed
            }
        },
    };
    if config.dra {
        metrics.record_publish(PublishedObject::Slice, slice);
    }
    [slice, device, node]
        .iter()
        .all(|outcome| *outcome != PublishOutcome::Failed)
}

/// The health of each GPU of `spec`, by its DRA device name.
fn gpu_health(spec: &tessera_api::device::DeviceSpec) -> Vec<tessera_dra::health::GpuHealth> {
    spec.devices
        .iter()
        .filter(|d| d.device_type == tessera_api::resources::DEVICE_TYPE_GPU)
        .enumerate()
        .map(|(index, gpu)| tessera_dra::health::GpuHealth {
            device: tessera_api::dra::device_name(gpu, index),
            healthy: gpu.health,
        })
        .collect()
}

/// What a node in DRA mode offers tessera-scheduler: no GPU (its capacity of
/// every Tessera resource is zero).
static NO_GPUS: crate::gpu::NodeGpus = crate::gpu::NodeGpus {
    driver_version: String::new(),
    gpus: Vec::new(),
};

#[cfg(test)]
mod tests;
