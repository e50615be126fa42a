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
use crate::metrics::{PublishOutcome, PublishedObject, ReporterMetrics};
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

/// Runs until `shutdown` resolves, with metrics nobody reads.
pub async fn run(
    source: Arc<dyn GpuSource>,
    publisher: Publisher,
    config: LoopConfig,
    xids: UnboundedReceiver<XidEvent>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let metrics = ReporterMetrics::default();
    run_with_metrics(source, publisher, config, &metrics, xids, shutdown).await;
}

/// Runs until `shutdown` resolves, recording into `metrics`.
pub async fn run_with_metrics(
    source: Arc<dyn GpuSource>,
    publisher: Publisher,
    config: LoopConfig,
    metrics: &ReporterMetrics,
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
            }
            _ = poll.tick() => {
                let now = stamp(&config.checkpoint);
                if now == last.checkpoint_stamp && !health.recover(Instant::now()) {
                    continue;
                }
                if now != last.checkpoint_stamp {
                    read_checkpoint(&config.checkpoint, &mut last, metrics);
                    last.checkpoint_stamp = now;
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
        if publish(&publisher, &config, &last, &health.unhealthy(), metrics).await {
            metrics.record_published_at(SystemTime::now());
        }
    }
}

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
    metrics.record_published_view(unhealthy, &legacy);
    let device = match publisher
        .publish_device(&device_spec(gpus, unhealthy), &legacy)
        .await
    {
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
    let node = match publisher
        .publish_node(
            &node_capacity(gpus, unhealthy, &config.capacity),
            &node_labels(gpus),
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
    device != PublishOutcome::Failed && node != PublishOutcome::Failed
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::path::Path;

    use serde_json::json;
    use tessera_harness::apiserver::ApiServer;

    use super::*;
    use crate::gpu::{DiscoveryError, GpuInfo};
    use crate::metrics::ReporterMetrics;

    const LEGACY_UID: &str = "513cb897-0262-4868-826f-aa943ee45a38";

    /// Two GPUs, always.
    #[derive(Debug)]
    struct TwoGpus;

    impl GpuSource for TwoGpus {
        fn discover(&self) -> Result<NodeGpus, DiscoveryError> {
            let gpu = |i: u32| GpuInfo {
                uuid: format!("GPU-{i}"),
                index: i,
                minor: i,
                model: "NVIDIA H100 80GB HBM3".into(),
                memory_bytes: 80 << 30,
                bus_id: format!("00000000:{:02X}:00.0", 0x19 + i),
                numa_node: Some(0),
                pcie_id: format!("00000000:{:02X}:00.0", 0x19 + i),
                nvlink_peers: vec![],
            };
            Ok(NodeGpus {
                driver_version: "550.54.15".into(),
                gpus: vec![gpu(0), gpu(1)],
            })
        }
    }

    /// Runs the loop for `node` with its metrics served on a loopback port; returns
    /// the port, the XID sender, and what stops it.
    async fn start(
        api: &ApiServer,
        node: &str,
        checkpoint: PathBuf,
    ) -> (
        SocketAddr,
        tokio::sync::mpsc::UnboundedSender<XidEvent>,
        tokio::sync::oneshot::Sender<()>,
    ) {
        let metrics = Arc::new(ReporterMetrics::default());
        let addr = metrics
            .serve("127.0.0.1:0".parse().expect("addr"))
            .await
            .expect("metrics endpoint");
        let (xid_tx, xid_rx) = tokio::sync::mpsc::unbounded_channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let config = LoopConfig {
            checkpoint,
            legacy_resources: vec!["nvidia.com/gpu".into()],
            interval: Duration::from_secs(3600),
            checkpoint_poll: Duration::from_secs(3600),
            capacity: CapacityOptions {
                aliases: false,
                nvidia_gpu: false,
                ..CapacityOptions::default()
            },
            recovery_after: Duration::from_secs(3600),
        };
        let publisher = Publisher::new(api.client().expect("client"), node);
        tokio::spawn(async move {
            run_with_metrics(
                Arc::new(TwoGpus),
                publisher,
                config,
                &metrics,
                xid_rx,
                async move {
                    let _ = stopped.await;
                },
            )
            .await;
        });
        (addr, xid_tx, stop)
    }

    /// Scrapes until every line is there; returns the last scrape.
    async fn scrape_until(addr: SocketAddr, lines: &[&str]) -> (String, String) {
        let mut last = (String::new(), String::new());
        for _ in 0..200 {
            last = tessera_api::binary::metrics::scrape(addr, "/metrics")
                .await
                .expect("scrape");
            if lines.iter().all(|l| last.1.contains(l)) {
                return last;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("metrics never had all of {lines:#?}:\n{}", last.1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn metrics_endpoint_shows_publishes_gpus_legacy_pods_and_xids() {
        let dir = tempfile::tempdir().expect("tempdir");
        let checkpoint = dir.path().join("kubelet_internal_checkpoint");
        std::fs::copy(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../shared/fixtures/kubelet-checkpoint/one-gpu-numa0.json"),
            &checkpoint,
        )
        .expect("checkpoint fixture");
        let api = ApiServer::start().await.expect("api server");
        api.insert(
            "v1",
            "nodes",
            json!({"apiVersion":"v1","kind":"Node","metadata":{"name":"gpu-node-1"},"status":{"capacity":{"cpu":"8"}}}),
        );
        api.insert(
            "v1",
            "pods",
            json!({"apiVersion":"v1","kind":"Pod","metadata":{"name":"legacy","namespace":"default","uid":LEGACY_UID},
                "spec":{"nodeName":"gpu-node-1","containers":[{"name":"app","image":"x"}]}}),
        );

        let (addr, xids, stop) = start(&api, "gpu-node-1", checkpoint.clone()).await;
        let (head, body) = scrape_until(
            addr,
            &[
                "tessera_reporter_publishes_total{object=\"device\",outcome=\"changed\"} 1\n",
                "tessera_reporter_publishes_total{object=\"node\",outcome=\"changed\"} 1\n",
                "tessera_reporter_gpus 2\n",
                "tessera_reporter_legacy_gpus 1\n",
                "tessera_reporter_legacy_pods 1\n",
                "tessera_reporter_unhealthy_gpus 0\n",
            ],
        )
        .await;
        assert!(
            head.lines()
                .any(|l| l
                    == "content-type: application/openmetrics-text; version=1.0.0; charset=utf-8"),
            "{head}"
        );
        let published_at: f64 = body
            .lines()
            .find_map(|l| l.strip_prefix("tessera_reporter_last_publish_timestamp_seconds "))
            .and_then(|v| v.parse().ok())
            .expect("a last-publish timestamp");
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .expect("after 1970")
            .as_secs_f64();
        assert!(
            (now - published_at).abs() < 60.0,
            "published at {published_at}, now {now}"
        );

        // A critical XID takes GPU 1 out: counted, and published again.
        xids.send(XidEvent {
            uuid: "GPU-1".into(),
            xid: 79,
        })
        .expect("loop running");
        scrape_until(
            addr,
            &[
                "tessera_reporter_xid_errors_total{gpu=\"GPU-1\",xid=\"79\"} 1\n",
                "tessera_reporter_unhealthy_gpus 1\n",
                "tessera_reporter_publishes_total{object=\"device\",outcome=\"changed\"} 2\n",
            ],
        )
        .await;
        let _ = stop.send(());

        // A node the API server does not have: both publishes fail, no timestamp.
        let (addr, _xids, stop) = start(&api, "no-such-node", checkpoint).await;
        let (_, body) = scrape_until(
            addr,
            &[
                "tessera_reporter_publishes_total{object=\"device\",outcome=\"failed\"} 1\n",
                "tessera_reporter_publishes_total{object=\"node\",outcome=\"failed\"} 1\n",
            ],
        )
        .await;
        assert!(
            body.contains("tessera_reporter_last_publish_timestamp_seconds 0.0\n"),
            "{body}"
        );
        let _ = stop.send(());
    }
}
