//! What a bind tells, against the API server double: the `GpuAllocated` Event on the
//! pod naming its GPU, a `GpuBindRefused` Event for a pod that does not fit, the
//! counts on the metrics endpoint; and an API server that refuses Events never fails
//! a bind. Plus deploy/'s RBAC lets the scheduler write the Events.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

mod common;

use k8s_openapi::api::events::v1::Event;
use kube::Api;
use serde_json::{Value, json};
use tessera_harness::apiserver::ApiServer;
use tessera_harness::deploy::{documents, role_allows};
use tessera_scheduler::events::{
    BindObserver, KubePodEvents, PodEvents, QUEUE_CAPACITY, RECORD_TIMEOUT,
};
use tessera_scheduler::extender::{Extender, ExtenderConfig};
use tessera_scheduler::leader::Leader;
use tessera_scheduler::metrics::{SchedulerMetrics, SchedulerState};
use tessera_scheduler::protocol::ExtenderBindingArgs;

const DEVICES: &str = "scheduling.koordinator.sh/v1alpha1";

fn device(node: &str, gpus: usize) -> Value {
    let devices: Vec<Value> = (0..gpus)
        .map(|i| json!({"type":"gpu","id":format!("GPU-{node}-{i}"),"minor":i,"health":true,
            "resources":{"koordinator.sh/gpu-core":"100","koordinator.sh/gpu-memory":(16u64 << 30).to_string(),"koordinator.sh/gpu-memory-ratio":"100"}}))
        .collect();
    json!({"apiVersion": DEVICES, "kind": "Device", "metadata": {"name": node}, "spec": {"devices": devices}})
}

fn gpu_pod(name: &str, share: &str) -> Value {
    json!({"apiVersion":"v1","kind":"Pod","metadata":{"name":name,"namespace":"default","uid":format!("u-{name}")},
        "spec":{"containers":[{"name":"main","image":"x","resources":{"limits":{"koordinator.sh/gpu":share}}}]},
        "status":{"phase":"Pending"}})
}

fn args(name: &str, node: &str) -> ExtenderBindingArgs {
    ExtenderBindingArgs {
        pod_name: name.into(),
        pod_namespace: "default".into(),
        pod_uid: format!("u-{name}"),
        node: node.into(),
    }
}

/// An extender over `api` whose Events go to `events_client` and whose metrics are
/// served on a loopback port; returns it, the metrics and their address.
async fn observed(
    api: &ApiServer,
    events_client: kube::Client,
) -> (Extender, Arc<SchedulerMetrics>, std::net::SocketAddr) {
    let (extender, ledger) = common::extender(api, ExtenderConfig::default()).await;
    let metrics = Arc::new(SchedulerMetrics::new(SchedulerState {
        ledger,
        ready: Arc::new(AtomicBool::new(true)),
        leader: Arc::new(Leader::new(true)),
        tls_not_after: None,
    }));
    let addr = metrics
        .serve("127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("metrics endpoint");
    let (events, _task) = PodEvents::spawn(
        KubePodEvents::new(events_client, "tessera-scheduler-0"),
        tessera_scheduler::events::counted_in(metrics.events.clone()),
        QUEUE_CAPACITY,
        RECORD_TIMEOUT,
    );
    let extender = extender.with_observer(BindObserver::new(Arc::clone(&metrics), events));
    (extender, metrics, addr)
}

/// The Events in `default` with `reason`, waiting up to 5 s for the first.
async fn events_with(api: &ApiServer, reason: &str) -> Vec<Event> {
    let events: Api<Event> = Api::namespaced(api.client().expect("client"), "default");
    for _ in 0..250 {
        let found: Vec<Event> = events
            .list(&Default::default())
            .await
            .expect("list events")
            .items
            .into_iter()
            .filter(|e| e.reason.as_deref() == Some(reason))
            .collect();
        if !found.is_empty() {
            return found;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Vec::new()
}

async fn scrape(addr: std::net::SocketAddr) -> String {
    tessera_daemon::metrics::scrape(addr, "/metrics")
        .await
        .expect("scrape")
        .1
}

fn assert_has(text: &str, lines: &[&str]) {
    for line in lines {
        assert!(text.contains(line), "lacks {line:?}:\n{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bind_tells_the_pod_its_gpu_and_counts_the_bind() {
    let api = ApiServer::start().await.expect("api");
    api.insert(DEVICES, "devices", device("n1", 2));
    api.insert("v1", "pods", gpu_pod("half", "50"));
    let (extender, _metrics, addr) = observed(&api, api.client().expect("client")).await;
    let result = extender.bind(&args("half", "n1"), false).await;
    assert_eq!(result.error, "");
    let annotation = api.get("v1", "pods", "default", "half").expect("pod")["metadata"]
        ["annotations"]["scheduling.koordinator.sh/device-allocated"]
        .as_str()
        .expect("annotation")
        .to_owned();
    let uuid = annotation
        .split("\"id\":\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .expect("a GPU UUID in the annotation");
    let events = events_with(&api, "GpuAllocated").await;
    assert_eq!(events.len(), 1, "{events:?}");
    let event = &events[0];
    assert_eq!(event.type_.as_deref(), Some("Normal"));
    assert_eq!(
        event.note.as_deref(),
        Some(format!("placed on GPU {uuid} (50% compute, 8GiB memory = 50%) on node n1").as_str())
    );
    let regarding = event.regarding.as_ref().expect("regarding");
    assert_eq!(
        (regarding.name.as_deref(), regarding.uid.as_deref()),
        (Some("half"), Some("u-half"))
    );
    let text = scrape(addr).await;
    assert_has(
        &text,
        &[
            "tessera_scheduler_binds_total{result=\"bound\"} 1\n",
            "tessera_scheduler_node_gpu_core_allocated_percent{node=\"n1\"} 50\n",
            "tessera_scheduler_node_gpu_core_free_percent{node=\"n1\"} 150\n",
            "tessera_scheduler_events_total{reason=\"GpuAllocated\",outcome=\"recorded\"} 1\n",
        ],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_that_does_not_fit_is_told_why() {
    let api = ApiServer::start().await.expect("api");
    api.insert(DEVICES, "devices", device("n1", 1));
    api.insert("v1", "pods", gpu_pod("two", "200"));
    let (extender, _metrics, addr) = observed(&api, api.client().expect("client")).await;
    let result = extender.bind(&args("two", "n1"), false).await;
    assert!(
        result.error.starts_with("pod default/two: node n1: "),
        "{result:?}"
    );
    let events = events_with(&api, "GpuBindRefused").await;
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].type_.as_deref(), Some("Warning"));
    let note = events[0].note.as_deref().expect("note");
    let why = result
        .error
        .strip_prefix("pod default/two: node n1: ")
        .expect("reason");
    assert_eq!(note, format!("not bound to node n1: {why}"));
    assert_has(
        &scrape(addr).await,
        &[
            "tessera_scheduler_binds_total{result=\"refused\"} 1\n",
            "tessera_scheduler_bind_errors_total{error=\"unfit\",result=\"refused\"} 1\n",
        ],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_server_that_refuses_events_never_fails_a_bind() {
    let api = ApiServer::start().await.expect("api");
    api.insert(DEVICES, "devices", device("n1", 1));
    api.insert("v1", "pods", gpu_pod("half", "50"));
    // Events go to a port where nothing listens: every write fails.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("port");
    let dead = format!("http://{}", closed.local_addr().expect("addr"));
    drop(closed);
    let dead =
        kube::Client::try_from(kube::Config::new(dead.parse().expect("url"))).expect("client");
    let (extender, metrics, _addr) = observed(&api, dead).await;
    let result = extender.bind(&args("half", "n1"), false).await;
    assert_eq!(result.error, "");
    assert_eq!(
        api.get("v1", "pods", "default", "half").expect("pod")["spec"]["nodeName"],
        "n1"
    );
    let failed = "tessera_scheduler_events_total{reason=\"GpuAllocated\",outcome=\"failed\"} 1\n";
    for _ in 0..250 {
        if metrics.encode().contains(failed) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_has(
        &metrics.encode(),
        &[
            failed,
            "tessera_scheduler_binds_total{result=\"bound\"} 1\n",
        ],
    );
}

#[test]
fn deploy_lets_the_scheduler_write_events_and_serves_metrics_apart() {
    let docs = documents("scheduler.yaml");
    let role = docs
        .iter()
        .find(|d| d["kind"] == "ClusterRole" && d["metadata"]["name"] == "tessera-scheduler")
        .expect("ClusterRole tessera-scheduler");
    assert!(role_allows(role, "events", "create"), "{role}");
    assert!(
        role["rules"]
            .as_array()
            .expect("rules")
            .iter()
            .any(|r| r["resources"] == json!(["events"])
                && r["apiGroups"] == json!(["events.k8s.io"])),
        "events.k8s.io: {role}"
    );
    let deployment = docs
        .iter()
        .find(|d| d["kind"] == "Deployment")
        .expect("Deployment");
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    let args: Vec<&str> = container["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(args.contains(&"--metrics-listen=0.0.0.0:9466"), "{args:?}");
    assert!(args.contains(&"--listen=0.0.0.0:8888"), "{args:?}");
    assert!(
        container["ports"]
            .as_array()
            .expect("ports")
            .iter()
            .any(|p| p["name"] == "metrics" && p["containerPort"] == 9466),
        "{container}"
    );
}

#[test]
fn metrics_on_the_extenders_or_the_probes_port_are_refused_at_startup() {
    for (args, flag) in [
        (&["--listen", "127.0.0.1:9466"][..], "--listen"),
        (
            &[
                "--listen",
                "127.0.0.1:8888",
                "--probe-listen",
                "127.0.0.1:9000",
                "--metrics-listen",
                "0.0.0.0:9000",
            ][..],
            "--probe-listen",
        ),
    ] {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_tessera-scheduler"))
            .arg("serve")
            .args(args)
            // Never a real cluster: the refusal comes before any API call.
            .env("KUBECONFIG", "/nonexistent")
            .output()
            .expect("running tessera-scheduler");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{stderr}");
        let port = if flag == "--listen" { 9466 } else { 9000 };
        assert!(
            stderr.contains(&format!(
                "port {port} is {flag}'s; metrics are served on a port of their own"
            )),
            "{stderr}"
        );
    }
}
