use std::net::SocketAddr;
use std::path::Path;

use serde_json::json;
use tessera_harness::apiserver::ApiServer;

use k8s_openapi::api::events::v1::Event;
use kube::Api;
use kube::api::ListParams;
use prometheus_client::metrics::family::Family;

use super::*;
use crate::events::{
    EventError, GpuHealthChange, KubeNodeEvents, QUEUE_CAPACITY, RECORD_TIMEOUT, ReporterEvent,
    counted_in,
};
use crate::gpu::{DiscoveryError, GpuInfo};
use crate::metrics::{EventLabels, ReporterMetrics};
use tessera_daemon::events::EventSink;

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

/// The XID sender of a running loop, and what stops it.
type Running = (
    tokio::sync::mpsc::UnboundedSender<XidEvent>,
    tokio::sync::oneshot::Sender<()>,
);

/// Copies kubelet's checkpoint fixture (one device-plugin GPU, held by pod
/// [`LEGACY_UID`]) into `dir`, and gives `api` the node `gpu-node-1` and that pod;
/// returns the checkpoint's path.
fn legacy_node(api: &ApiServer, dir: &Path) -> PathBuf {
    let checkpoint = dir.join("kubelet_internal_checkpoint");
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../shared/fixtures/kubelet-checkpoint/one-gpu-numa0.json"),
        &checkpoint,
    )
    .expect("checkpoint fixture");
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
    checkpoint
}

/// Spawns the loop for `node` on `api` over [`TwoGpus`], recording into `metrics`
/// and sending Events to `events`.
fn spawn_loop(
    api: &ApiServer,
    node: &str,
    config: LoopConfig,
    metrics: Arc<ReporterMetrics>,
    events: GpuEvents,
) -> Running {
    let (xid_tx, xid_rx) = tokio::sync::mpsc::unbounded_channel();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let publisher = Publisher::new(api.client().expect("client"), node);
    tokio::spawn(async move {
        run_with_metrics(
            Arc::new(TwoGpus),
            publisher,
            config,
            &metrics,
            events,
            xid_rx,
            async move {
                let _ = stopped.await;
            },
        )
        .await;
    });
    (xid_tx, stop)
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
        // No proxy here: the node holds no share (none).
        enforcement_file: "/nonexistent/tessera-enforcement".into(),
        dra: false,
        dra_health: None,
    };
    let (xids, stop) = spawn_loop(api, node, config, metrics, GpuEvents::none());
    (addr, xids, stop)
}

/// Scrapes until every line is there; returns the last scrape.
async fn scrape_until(addr: SocketAddr, lines: &[&str]) -> (String, String) {
    let mut last = (String::new(), String::new());
    for _ in 0..200 {
        last = tessera_daemon::metrics::scrape(addr, "/metrics")
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
    let api = ApiServer::start().await.expect("api server");
    let checkpoint = legacy_node(&api, dir.path());

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
            // No proxy list here: no backend holds shares.
            "tessera_reporter_enforcement{backend=\"driver-memory\"} 0\n",
            "tessera_reporter_enforcement{backend=\"hami-core\"} 0\n",
        ],
    )
    .await;
    assert!(
        head.lines().any(
            |l| l == "content-type: application/openmetrics-text; version=1.0.0; charset=utf-8"
        ),
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

// === GPU health Events ===

/// Runs the loop for `gpu-node-1` on `api` with a legacy pod in kubelet's checkpoint,
/// GPUs healthy again `recovery_after` after a critical XID, and Events going to
/// `events`; returns the metrics, the XID sender, and what stops it.
async fn start_with_events(
    api: &ApiServer,
    dir: &Path,
    recovery_after: Duration,
    events: GpuEvents,
) -> (
    Arc<ReporterMetrics>,
    tokio::sync::mpsc::UnboundedSender<XidEvent>,
    tokio::sync::oneshot::Sender<()>,
) {
    let config = LoopConfig {
        checkpoint: legacy_node(api, dir),
        legacy_resources: vec!["nvidia.com/gpu".into()],
        interval: Duration::from_secs(3600),
        checkpoint_poll: Duration::from_millis(20),
        capacity: CapacityOptions::default(),
        recovery_after,
        enforcement_file: "/nonexistent/tessera-enforcement".into(),
        dra: false,
        dra_health: None,
    };
    let metrics = Arc::new(ReporterMetrics::default());
    let (xids, stop) = spawn_loop(api, "gpu-node-1", config, Arc::clone(&metrics), events);
    (metrics, xids, stop)
}

/// Records what it is given.
#[derive(Debug, Clone, Default)]
struct RecordingSink(Arc<std::sync::Mutex<Vec<ReporterEvent>>>);

impl RecordingSink {
    fn seen(&self) -> Vec<GpuHealthChange> {
        self.0
            .lock()
            .expect("not poisoned")
            .iter()
            .filter_map(|e| match e {
                ReporterEvent::Health(change) => Some(change.clone()),
                ReporterEvent::Memory(_) => None,
            })
            .collect()
    }
}

/// The reporter's queue as the daemon spawns it, counting into `counts`.
fn spawn_events(
    sink: impl EventSink<ReporterEvent>,
    counts: Family<EventLabels, prometheus_client::metrics::counter::Counter>,
) -> (GpuEvents, tokio::task::JoinHandle<()>) {
    GpuEvents::spawn(sink, counted_in(counts), QUEUE_CAPACITY, RECORD_TIMEOUT)
}

impl EventSink<ReporterEvent> for RecordingSink {
    type Error = EventError;

    async fn record(&self, event: &ReporterEvent) -> Result<(), EventError> {
        self.0.lock().expect("not poisoned").push(event.clone());
        Ok(())
    }
}

async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..400 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("never: {what}");
}

/// The node's switch mark follows the proxy's count of kubelet's connections,
/// taint or no taint: unproven with no file, proven while kubelet is connected
/// and the file fresh, unproven again (within a checkpoint poll, not an
/// interval) once kubelet is gone or the file goes stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_switch_is_proven_only_while_kubelet_is_connected_to_the_proxy() {
    let dir = tempfile::tempdir().expect("tempdir");
    let api = ApiServer::start().await.expect("api server");
    let checkpoint = legacy_node(&api, dir.path());
    let config = LoopConfig {
        checkpoint,
        legacy_resources: vec!["nvidia.com/gpu".into()],
        interval: Duration::from_secs(3600),
        checkpoint_poll: Duration::from_millis(20),
        capacity: CapacityOptions::default(),
        recovery_after: Duration::from_secs(3600),
        enforcement_file: dir.path().join("backends"),
        dra: false,
        dra_health: None,
    };
    let seen_file = config.kubelet_seen_file();
    let metrics = Arc::new(ReporterMetrics::default());
    let (_xids, stop) = spawn_loop(
        &api,
        "gpu-node-1",
        config,
        Arc::clone(&metrics),
        GpuEvents::none(),
    );
    let devices: Api<tessera_api::Device> = Api::all(api.client().expect("client"));
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(api.client().expect("client"));
    let marked = |want: &'static str| {
        let (devices, nodes) = (devices.clone(), nodes.clone());
        async move {
            for _ in 0..400 {
                let device = devices
                    .get("gpu-node-1")
                    .await
                    .ok()
                    .and_then(|d| d.metadata.annotations)
                    .and_then(|a| a.get(tessera_api::resources::SWITCH_UNPROVEN).cloned());
                let node = nodes
                    .get("gpu-node-1")
                    .await
                    .ok()
                    .and_then(|n| n.metadata.labels)
                    .and_then(|l| l.get(tessera_api::resources::SWITCH_UNPROVEN).cloned());
                if device.as_deref() == Some(want) && node.as_deref() == Some(want) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            panic!("the switch mark never became {want}");
        }
    };
    let now = || {
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .expect("after 1970")
            .as_secs()
    };
    // No proxy has written anything: unproven, though the node has no taint.
    marked("true").await;
    let write = |connections: u32, at: u64| {
        std::fs::write(
            &seen_file,
            format!(
                r#"{{"connections":{connections},"runtime_call_at":{at},"pid":4242,"at":{at}}}"#
            ),
        )
        .expect("write");
    };
    write(1, now());
    marked("false").await;
    // kubelet went back to containerd directly.
    write(0, now());
    marked("true").await;
    write(1, now());
    marked("false").await;
    // The proxy that wrote it is gone (its last write over a minute old).
    write(1, now() - 61);
    marked("true").await;
    // Stale it stays: its age grows, but that is no new finding to publish.
    let publishes = |text: &str| -> u64 {
        text.lines()
            .filter(|l| l.starts_with("tessera_reporter_publishes_total{object=\"device\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    };
    let before = publishes(&metrics.encode());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        publishes(&metrics.encode()),
        before,
        "republished a stale proof"
    );
    let _ = stop.send(());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_critical_xid_announces_unhealthy_once_and_recovery_healthy() {
    let dir = tempfile::tempdir().expect("tempdir");
    let api = ApiServer::start().await.expect("api server");
    let sink = RecordingSink::default();
    let counts = Family::default();
    let (events, _task) = spawn_events(sink.clone(), counts.clone());
    let (_metrics, xids, stop) =
        start_with_events(&api, dir.path(), Duration::from_millis(600), events).await;
    let send = |uuid: &str, xid| {
        xids.send(XidEvent {
            uuid: uuid.into(),
            xid,
        })
        .expect("loop running")
    };
    // An application XID leaves the GPU healthy: nothing to say.
    send("GPU-1", 13);
    // A critical one takes it out; another on the same GPU says nothing new.
    send("GPU-1", 79);
    send("GPU-1", 48);
    wait_for("the unhealthy GPU's Event", || !sink.seen().is_empty()).await;
    assert_eq!(
        sink.seen(),
        vec![GpuHealthChange::Unhealthy {
            uuid: "GPU-1".into(),
            xid: 79
        }]
    );
    wait_for("recovery", || sink.seen().len() == 2).await;
    assert_eq!(
        sink.seen()[1],
        GpuHealthChange::Healthy {
            uuid: "GPU-1".into()
        }
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(sink.seen().len(), 2, "{:?}", sink.seen());
    let _ = stop.send(());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_health_events_go_on_the_node_and_never_on_device_plugin_pods() {
    let dir = tempfile::tempdir().expect("tempdir");
    let api = ApiServer::start().await.expect("api server");
    let client = api.client().expect("client");
    let recorder_metrics = ReporterMetrics::default();
    let (events, _task) = spawn_events(
        KubeNodeEvents::new(client.clone(), "gpu-node-1", Duration::from_millis(600)),
        recorder_metrics.events.clone(),
    );
    let (metrics, xids, stop) =
        start_with_events(&api, dir.path(), Duration::from_millis(600), events).await;
    // The legacy pod is published before the XID arrives.
    wait_for("the Device with the legacy pod", || {
        metrics
            .encode()
            .contains("tessera_reporter_legacy_pods 1\n")
    })
    .await;
    xids.send(XidEvent {
        uuid: "GPU-1".into(),
        xid: 79,
    })
    .expect("loop running");
    let listed = Api::<Event>::namespaced(client.clone(), "default");
    let mut all = Vec::new();
    for _ in 0..400 {
        all = listed
            .list(&ListParams::default())
            .await
            .expect("events listed")
            .items;
        if all.len() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    all.sort_by_key(|e| e.event_time.clone().map(|t| t.0));
    let seen: Vec<_> = all
        .iter()
        .map(|e| {
            let regarding = e.regarding.clone().unwrap_or_default();
            (
                regarding.kind.unwrap_or_default(),
                regarding.name.unwrap_or_default(),
                e.type_.clone().unwrap_or_default(),
                e.reason.clone().unwrap_or_default(),
                e.note.clone().unwrap_or_default(),
            )
        })
        .collect();
    let node = |type_: &str, reason: &str, note: &str| {
        (
            "Node".to_owned(),
            "gpu-node-1".to_owned(),
            type_.to_owned(),
            reason.to_owned(),
            note.to_owned(),
        )
    };
    assert_eq!(
        seen,
        vec![
            node(
                "Warning",
                "GpuUnhealthy",
                "GPU GPU-1 unhealthy: XID 79; taken out of the node's capacity until 600ms pass without a critical XID"
            ),
            node(
                "Normal",
                "GpuHealthy",
                "GPU GPU-1 healthy again: no critical XID for 600ms; back in the node's capacity"
            ),
        ]
    );
    assert!(
        all.iter()
            .all(|e| e.reporting_controller.as_deref() == Some("tessera.io/reporter")),
        "{all:#?}"
    );
    let text = recorder_metrics.encode();
    for line in [
        "tessera_reporter_events_total{reason=\"GpuUnhealthy\",outcome=\"recorded\"} 1\n",
        "tessera_reporter_events_total{reason=\"GpuHealthy\",outcome=\"recorded\"} 1\n",
    ] {
        assert!(text.contains(line), "lacks {line:?}:\n{text}");
    }
    let _ = stop.send(());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_memory_use_is_published_exported_and_told_to_the_pod() {
    use tessera_api::usage::{ContainerGpuMemory, MemoryGrant, NodeGpuMemory};
    const GIB: u64 = 1 << 30;
    let dir = tempfile::tempdir().expect("tempdir");
    let api = ApiServer::start().await.expect("api server");
    let checkpoint = legacy_node(&api, dir.path());
    std::fs::write(dir.path().join("backends"), "mps\n").expect("backends");
    let entry =
        |pod: &str, uid: &str, container: &str, gpu: &str, used, grant| ContainerGpuMemory {
            namespace: "default".into(),
            pod: pod.into(),
            pod_uid: uid.into(),
            container: container.into(),
            gpu: gpu.into(),
            used,
            grant,
        };
    let usage = NodeGpuMemory {
        containers: vec![
            // The device plugin's pod, on its own GPU: no breach.
            entry(
                "legacy",
                LEGACY_UID,
                "app",
                "GPU-77a702db-e37f-3a74-d46d-c5713f66058c",
                GIB,
                MemoryGrant::None,
            ),
            entry(
                "train",
                "uid-t",
                "main",
                "GPU-0",
                19 * GIB + GIB / 2,
                MemoryGrant::Share(20 * GIB),
            ),
            entry("train", "uid-t", "sidecar", "GPU-1", GIB, MemoryGrant::None),
        ],
        kills: Vec::new(),
    };
    let file = dir.path().join(tessera_api::usage::USAGE_FILE);
    std::fs::write(&file, usage.to_json()).expect("usage");
    let sink = RecordingSink::default();
    let (events, _task) = spawn_events(sink.clone(), Family::default());
    let metrics = Arc::new(ReporterMetrics::default());
    let config = LoopConfig {
        checkpoint,
        legacy_resources: vec!["nvidia.com/gpu".into()],
        // The usage annotation goes with each publish: every interval.
        interval: Duration::from_millis(300),
        checkpoint_poll: Duration::from_millis(20),
        capacity: CapacityOptions::default(),
        recovery_after: Duration::from_secs(3600),
        enforcement_file: dir.path().join("backends"),
        dra: false,
        dra_health: None,
    };
    let (_xids, stop) = spawn_loop(&api, "gpu-node-1", config, Arc::clone(&metrics), events);
    let memory = |sink: &RecordingSink| -> Vec<(String, String)> {
        sink.0
            .lock()
            .expect("not poisoned")
            .iter()
            .filter_map(|e| match e {
                ReporterEvent::Memory(m) => Some((
                    m.kind().reason.to_owned(),
                    m.container().container.to_owned(),
                )),
                ReporterEvent::Health(_) => None,
            })
            .collect()
    };
    wait_for("the memory Events", || memory(&sink).len() == 2).await;
    let mut told = memory(&sink);
    told.sort();
    assert_eq!(
        told,
        [
            ("GpuMemoryAtLimit".to_owned(), "main".to_owned()),
            ("GpuUsedWithoutGrant".to_owned(), "sidecar".to_owned()),
        ]
    );
    let text = metrics.encode();
    for line in [
        "tessera_reporter_container_gpu_memory_used_bytes{namespace=\"default\",pod=\"train\",container=\"main\",gpu=\"GPU-0\"} 20937965568\n",
        "tessera_reporter_container_gpu_memory_limit_bytes{namespace=\"default\",pod=\"train\",container=\"main\",gpu=\"GPU-0\"} 21474836480\n",
        "tessera_reporter_container_gpu_ungranted{namespace=\"default\",pod=\"train\",container=\"sidecar\",gpu=\"GPU-1\"} 1\n",
    ] {
        assert!(text.contains(line), "lacks {line:?}:\n{text}");
    }
    assert!(
        !text.contains("gpu_ungranted{namespace=\"default\",pod=\"legacy\""),
        "{text}"
    );
    // On the Device CR, rounded up to 256 MiB.
    let devices: Api<tessera_api::Device> = Api::all(api.client().expect("client"));
    let published = || async {
        devices
            .get("gpu-node-1")
            .await
            .ok()
            .and_then(|d| d.metadata.annotations)
            .and_then(|a| a.get(tessera_api::usage::DEVICE_ANNOTATION).cloned())
            .and_then(|text| NodeGpuMemory::parse(&text).ok())
    };
    let mut seen = None;
    for _ in 0..400 {
        seen = published().await;
        if seen.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let seen = seen.expect("the annotation");
    assert_eq!(seen.containers.len(), 3);
    assert_eq!(seen.containers[1].used, 19 * GIB + GIB / 2);
    assert_eq!(seen.containers[0].grant, MemoryGrant::Whole);
    // The report gone (the proxy could not read the driver): unknown, no series.
    std::fs::remove_file(&file).expect("remove");
    let mut unknown = false;
    for _ in 0..400 {
        let annotation = devices
            .get("gpu-node-1")
            .await
            .ok()
            .and_then(|d| d.metadata.annotations)
            .and_then(|a| a.get(tessera_api::usage::DEVICE_ANNOTATION).cloned());
        unknown = annotation.as_deref() == Some(USAGE_UNKNOWN);
        if unknown {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(unknown, "the annotation never said unknown");
    assert!(
        !metrics
            .encode()
            .contains("container_gpu_memory_used_bytes{")
    );
    let _ = stop.send(());
}

#[tokio::test]
async fn an_event_the_api_server_refuses_is_counted_and_the_rest_go_on() {
    // Nothing listens on port 1.
    let config = kube::Config::new("http://127.0.0.1:1".parse().expect("url"));
    let client = kube::Client::try_from(config).expect("client");
    let counts = Family::default();
    let (events, task) = spawn_events(
        KubeNodeEvents::new(client, "gpu-node-1", Duration::from_secs(300)),
        counts.clone(),
    );
    events.send(GpuHealthChange::Unhealthy {
        uuid: "GPU-0".into(),
        xid: 79,
    });
    events.send(GpuHealthChange::Healthy {
        uuid: "GPU-0".into(),
    });
    drop(events);
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the task ends once its handle is gone")
        .expect("no panic");
    let failed = |reason: &str| {
        counts
            .get_or_create(&EventLabels {
                reason: reason.into(),
                outcome: "failed".into(),
            })
            .get()
    };
    assert_eq!((failed("GpuUnhealthy"), failed("GpuHealthy")), (1, 1));
}
