//! The Events' words and fields, and that telling never waits on the API server.

use std::sync::Mutex;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

use super::*;

const HALF: &str = r#"{"gpu":[{"minor":0,"id":"GPU-7e55","resources":{"koordinator.sh/gpu-core":50,"koordinator.sh/gpu-memory-ratio":50,"koordinator.sh/gpu-memory":8589934592}}]}"#;

fn pod() -> PodRef {
    PodRef {
        namespace: "team-a".into(),
        name: "train-0".into(),
        uid: "u-train-0".into(),
    }
}

fn args() -> ExtenderBindingArgs {
    ExtenderBindingArgs {
        pod_name: "train-0".into(),
        pod_namespace: "team-a".into(),
        pod_uid: "u-train-0".into(),
        node: "gpu-node-1".into(),
    }
}

#[test]
fn allocated_names_each_gpu_and_its_share() {
    assert_eq!(
        allocated_note("gpu-node-1", HALF),
        "placed on GPU GPU-7e55 (50% compute, 8GiB memory = 50%) on node gpu-node-1"
    );
    let two = r#"{"gpu":[{"minor":0,"id":"GPU-a","resources":{"koordinator.sh/gpu-core":100,"koordinator.sh/gpu-memory-ratio":100}},{"minor":1,"id":"GPU-b","resources":{"koordinator.sh/gpu-memory":1536000000}}]}"#;
    assert_eq!(
        allocated_note("n1", two),
        "placed on GPU GPU-a (100% compute, 100% memory), GPU GPU-b (1536000000B memory) on node n1"
    );
    assert_eq!(
        allocated_note("n1", "{not json"),
        "placed on node n1: {not json"
    );
}

#[test]
fn allocated_event_regards_the_pod_by_uid_and_relates_to_the_node() {
    let now = Timestamp::from_second(1_700_000_000).expect("time");
    let event = pod_event(
        &PodEvent::Allocated {
            pod: pod(),
            node: "gpu-node-1".into(),
            annotation: HALF.into(),
        },
        "tessera-scheduler-0",
        now,
    );
    assert_eq!(event.type_.as_deref(), Some("Normal"));
    assert_eq!(event.reason.as_deref(), Some("GpuAllocated"));
    assert_eq!(event.action.as_deref(), Some("Bind"));
    assert_eq!(
        event.note.as_deref(),
        Some("placed on GPU GPU-7e55 (50% compute, 8GiB memory = 50%) on node gpu-node-1")
    );
    assert_eq!(event.metadata.namespace.as_deref(), Some("team-a"));
    assert_eq!(
        event.metadata.name.as_deref(),
        Some("train-0.17979cfe362a0000")
    );
    let regarding = event.regarding.expect("regarding");
    assert_eq!(
        (
            regarding.kind.as_deref(),
            regarding.namespace.as_deref(),
            regarding.name.as_deref(),
            regarding.uid.as_deref()
        ),
        (
            Some("Pod"),
            Some("team-a"),
            Some("train-0"),
            Some("u-train-0")
        )
    );
    let related = event.related.expect("related");
    assert_eq!(
        (related.kind.as_deref(), related.name.as_deref()),
        (Some("Node"), Some("gpu-node-1"))
    );
    assert_eq!(
        event.reporting_controller.as_deref(),
        Some("tessera.io/scheduler")
    );
    assert_eq!(
        event.reporting_instance.as_deref(),
        Some("tessera-scheduler-0")
    );
    assert_eq!(event.event_time, Some(MicroTime(now)));
}

#[test]
fn long_names_and_notes_are_cut_to_what_the_api_server_takes() {
    let long = PodEvent::Refused {
        pod: PodRef {
            name: "p".repeat(253),
            ..pod()
        },
        node: "n1".into(),
        why: "é".repeat(2000),
    };
    let event = pod_event(&long, &"i".repeat(300), Timestamp::now());
    assert!(event.metadata.name.expect("name").len() <= 253);
    assert_eq!(event.reporting_instance.expect("instance").len(), 128);
    let note = event.note.expect("note");
    assert!(note.len() <= 1024 && note.len() > 1000, "{}", note.len());
}

/// A sink that records what it is given, failing or never answering as told.
#[derive(Default)]
struct Recording {
    seen: Arc<Mutex<Vec<PodEvent>>>,
    hang: bool,
    fail: bool,
}

impl EventSink<PodEvent> for Recording {
    type Error = EventError;

    async fn record(&self, event: &PodEvent) -> Result<(), EventError> {
        self.seen.lock().expect("seen").push(event.clone());
        if self.hang {
            std::future::pending::<()>().await;
        }
        if self.fail {
            return Err(EventError::Api {
                namespace: event.pod().namespace.clone(),
                name: event.pod().name.clone(),
                reason: event.reason(),
                source: kube::Error::LinesCodecMaxLineLengthExceeded,
            });
        }
        Ok(())
    }
}

fn events_line(metrics: &SchedulerMetrics, reason: &str, outcome: &str) -> Option<u64> {
    let prefix =
        format!("tessera_scheduler_events_total{{reason=\"{reason}\",outcome=\"{outcome}\"}} ");
    metrics
        .encode()
        .lines()
        .find_map(|l| l.strip_prefix(&prefix).map(|v| v.parse().expect("count")))
}

fn unfit() -> BindFailure {
    BindFailure {
        pod: "team-a/train-0".into(),
        error: BindError::Unfit {
            node: "gpu-node-1".into(),
            reason: "GPU 0: 30% compute free, 50% asked".into(),
        },
    }
}

#[tokio::test]
async fn refusals_the_owner_must_see_become_events_others_only_counts() {
    let metrics = Arc::new(SchedulerMetrics::default());
    let sink = Recording::default();
    let seen = Arc::clone(&sink.seen);
    let (events, task) =
        PodEvents::spawn(sink, counted_in(metrics.events.clone()), 8, RECORD_TIMEOUT);
    let observer = BindObserver::new(Arc::clone(&metrics), events);
    observer.finished(&args(), &Err(unfit()));
    observer.refused(&args(), &BindError::NotLeader);
    observer.finished(&args(), &Ok(()));
    observer.placed(&args(), Some(HALF));
    // A pod that asks for no GPU gets no Event.
    observer.placed(&args(), None);
    drop(observer);
    task.await.expect("recording task");
    let seen = seen.lock().expect("seen").clone();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(
        seen[0].note(),
        "not bound to node gpu-node-1: GPU 0: 30% compute free, 50% asked"
    );
    assert_eq!(seen[0].reason(), "GpuBindRefused");
    assert_eq!(seen[0].kind().type_, "Warning");
    assert_eq!(seen[1].reason(), "GpuAllocated");
    assert_eq!(events_line(&metrics, "GpuBindRefused", "recorded"), Some(1));
    assert_eq!(events_line(&metrics, "GpuAllocated", "recorded"), Some(1));
    let text = metrics.encode();
    for line in [
        "tessera_scheduler_binds_total{result=\"refused\"} 2\n",
        "tessera_scheduler_binds_total{result=\"bound\"} 1\n",
        "tessera_scheduler_bind_errors_total{error=\"unfit\",result=\"refused\"} 1\n",
        "tessera_scheduler_bind_errors_total{error=\"not_leader\",result=\"refused\"} 1\n",
    ] {
        assert!(text.contains(line), "lacks {line:?}:\n{text}");
    }
}

#[tokio::test]
async fn a_hanging_api_server_never_holds_a_bind_up() {
    let timeout = Duration::from_millis(100);
    let metrics = Arc::new(SchedulerMetrics::default());
    let sink = Recording {
        hang: true,
        ..Recording::default()
    };
    let seen = Arc::clone(&sink.seen);
    let (events, task) = PodEvents::spawn(sink, counted_in(metrics.events.clone()), 2, timeout);
    let observer = BindObserver::new(Arc::clone(&metrics), events);
    // The first is taken by the task (and hangs there), two wait in the queue, the
    // rest are dropped: none of these calls waits.
    let started = std::time::Instant::now();
    for _ in 0..5 {
        observer.placed(&args(), Some(HALF));
    }
    assert!(started.elapsed() < timeout / 4, "{:?}", started.elapsed());
    tokio::time::sleep(timeout / 4).await;
    assert_eq!(seen.lock().expect("seen").len(), 1);
    let dropped = events_line(&metrics, "GpuAllocated", "dropped").unwrap_or(0);
    assert!((2..=3).contains(&dropped), "dropped {dropped}");
    drop(observer);
    // Each hanging write is given up after its timeout; the queue drains.
    task.await.expect("recording task");
    assert_eq!(
        events_line(&metrics, "GpuAllocated", "failed").unwrap_or(0) + dropped,
        5
    );
    assert!(started.elapsed() >= timeout);
}

#[tokio::test]
async fn a_refusing_api_server_is_counted_and_the_queue_goes_on() {
    let metrics = Arc::new(SchedulerMetrics::default());
    let sink = Recording {
        fail: true,
        ..Recording::default()
    };
    let (events, task) =
        PodEvents::spawn(sink, counted_in(metrics.events.clone()), 8, RECORD_TIMEOUT);
    let observer = BindObserver::new(Arc::clone(&metrics), events);
    observer.placed(&args(), Some(HALF));
    observer.finished(&args(), &Err(unfit()));
    drop(observer);
    task.await.expect("recording task");
    assert_eq!(events_line(&metrics, "GpuAllocated", "failed"), Some(1));
    assert_eq!(events_line(&metrics, "GpuBindRefused", "failed"), Some(1));
}
