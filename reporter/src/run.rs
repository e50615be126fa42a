//! The reporter loop: discover, read the checkpoint, publish on change.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tessera_api::LegacyDeviceEntry;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::checkpoint::{Checkpoint, parse_checkpoint};
use crate::gpu::{GpuSource, NodeGpus};
use crate::health::{HealthTracker, XidEvent};
use crate::publish::Publisher;
use crate::report::{CapacityOptions, device_spec, legacy_entries, node_capacity, node_labels};

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
}

/// The loop's memory: the last good inputs, so a bad read never unpublishes.
#[derive(Debug, Default)]
struct Last {
    gpus: Option<NodeGpus>,
    checkpoint: Checkpoint,
    checkpoint_stamp: Option<(SystemTime, u64)>,
}

fn stamp(path: &PathBuf) -> Option<(SystemTime, u64)> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}

/// Reads the checkpoint. A missing file means no device-plugin allocations; a
/// corrupt one is logged and the last good one stays.
fn read_checkpoint(path: &PathBuf, last: &mut Last) {
    match std::fs::read(path) {
        Ok(bytes) => match parse_checkpoint(&bytes) {
            Ok(checkpoint) => last.checkpoint = checkpoint,
            Err(error) => {
                tracing::error!(file = %path.display(), error = %crate::chain(&error), "checkpoint not usable; keeping the last good one")
            }
        },
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            last.checkpoint = Checkpoint::default()
        }
        Err(error) => {
            tracing::error!(file = %path.display(), %error, "checkpoint not readable; keeping the last good one")
        }
    }
}

/// Runs until `shutdown` resolves.
pub async fn run(
    source: Arc<dyn GpuSource>,
    publisher: Publisher,
    config: LoopConfig,
    mut xids: UnboundedReceiver<XidEvent>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let mut last = Last::default();
    let mut health = HealthTracker::new(config.recovery_after);
    let mut resync = tokio::time::interval(config.interval);
    let mut poll = tokio::time::interval(config.checkpoint_poll);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = resync.tick() => {
                let source = Arc::clone(&source);
                // NVML calls block: off the async threads.
                match tokio::task::spawn_blocking(move || source.discover()).await {
                    Ok(Ok(gpus)) => last.gpus = Some(gpus),
                    Ok(Err(error)) => tracing::error!(error = %crate::chain(&error), "GPU discovery failed; keeping the last good view"),
                    Err(error) => tracing::error!(%error, "GPU discovery task failed"),
                }
                read_checkpoint(&config.checkpoint, &mut last);
                last.checkpoint_stamp = stamp(&config.checkpoint);
                health.recover(Instant::now());
            }
            _ = poll.tick() => {
                let now = stamp(&config.checkpoint);
                if now == last.checkpoint_stamp && !health.recover(Instant::now()) {
                    continue;
                }
                if now != last.checkpoint_stamp {
                    read_checkpoint(&config.checkpoint, &mut last);
                    last.checkpoint_stamp = now;
                }
            }
            event = xids.recv() => match event {
                Some(event) => {
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
        publish(&publisher, &config, &last, &health.unhealthy()).await;
    }
}

async fn publish(
    publisher: &Publisher,
    config: &LoopConfig,
    last: &Last,
    unhealthy: &BTreeSet<String>,
) {
    let Some(gpus) = &last.gpus else { return };
    let legacy: Vec<LegacyDeviceEntry> = match publisher.node_pods().await {
        Ok(pods) => legacy_entries(&last.checkpoint, &pods, &config.legacy_resources, gpus),
        Err(error) => {
            tracing::error!(error = %crate::chain(&error), "cannot list the node's pods; not publishing this round");
            return;
        }
    };
    match publisher
        .publish_device(&device_spec(gpus, unhealthy), &legacy)
        .await
    {
        Ok(true) => tracing::info!(
            gpus = gpus.gpus.len(),
            unhealthy = unhealthy.len(),
            legacy = legacy.len(),
            "Device published"
        ),
        Ok(false) => {}
        Err(error) => {
            tracing::error!(error = %crate::chain(&error), "publishing the Device failed")
        }
    }
    match publisher
        .publish_node(
            &node_capacity(gpus, unhealthy, &config.capacity),
            &node_labels(gpus),
        )
        .await
    {
        Ok(true) => tracing::info!("node capacity and labels published"),
        Ok(false) => {}
        Err(error) => {
            tracing::error!(error = %crate::chain(&error), "publishing node capacity failed")
        }
    }
}
