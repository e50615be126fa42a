//! tessera-scheduler's extender API driven with the JSON kube-scheduler sends,
//! its cluster view fed by kube-rs reflectors from the API server double.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tessera_allocator::ledger::Ledger;
use tessera_api::request::{MemoryUnit, RequestOptions};
use tessera_integration::apiserver::ApiServer;
use tessera_scheduler::extender::{Extender, ExtenderConfig, serve};
use tessera_scheduler::leader::{EXTENDER_URL_ANNOTATION, Leader, LeaseConfig, try_lead};

const DEVICES: &str = "scheduling.koordinator.sh/v1alpha1";
const MIB: u64 = 1 << 20;

fn device(node: &str, free_mib: &[u64], legacy: &[&str]) -> Value {
    let devices: Vec<Value> = free_mib
        .iter()
        .enumerate()
        .map(|(i, _)| json!({"type":"gpu","id":format!("GPU-{node}-{i}"),"minor":i,"health":true,
            "resources":{"koordinator.sh/gpu-core":"100","koordinator.sh/gpu-memory":(16276 * MIB).to_string(),"koordinator.sh/gpu-memory-ratio":"100"}}))
        .collect();
    let legacy: Vec<Value> = legacy.iter().map(|id| json!({"podUID":"old","containerName":"c","resourceName":"nvidia.com/gpu","deviceIDs":[id]})).collect();
    json!({"apiVersion": DEVICES, "kind": "Device",
        "metadata": {"name": node, "annotations": {"node.koordinator.sh/devices-checkpoints": serde_json::to_string(&legacy).expect("json")}},
        "spec": {"devices": devices}})
}

/// A running pod holding `used_mib` of GPU `gpu` on `node`.
fn holder(node: &str, gpu: usize, used_mib: u64, name: &str) -> Value {
    let annotation = format!(
        r#"{{"gpu":[{{"minor":{gpu},"id":"GPU-{node}-{gpu}","resources":{{"koordinator.sh/gpu-memory":{}}}}}]}}"#,
        used_mib * MIB
    );
    json!({"apiVersion":"v1","kind":"Pod","metadata":{"name":name,"namespace":"default","annotations":{"scheduling.koordinator.sh/device-allocated":annotation}},
        "spec":{"nodeName":node,"containers":[{"name":"main","image":"x"}]},"status":{"phase":"Running"}})
}

fn pending(name: &str, limits: Value) -> Value {
    json!({"apiVersion":"v1","kind":"Pod","metadata":{"name":name,"namespace":"default"},
        "spec":{"containers":[{"name":"main","image":"x","resources":{"limits":limits}}]},"status":{"phase":"Pending"}})
}

struct Scheduler {
    api: ApiServer,
    url: String,
    http: reqwest_like::Client,
    _task: tokio::task::JoinHandle<()>,
}

/// A minimal JSON-over-HTTP client, as kube-scheduler's extender client is.
mod reqwest_like {
    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    use hyper_util::client::legacy::Client as HyperClient;
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::rt::TokioExecutor;

    #[derive(Clone)]
    pub struct Client(HyperClient<HttpConnector, Full<Bytes>>);

    impl Client {
        pub fn new() -> Self {
            Self(HyperClient::builder(TokioExecutor::new()).build_http())
        }

        pub async fn post(&self, url: &str, body: &serde_json::Value) -> serde_json::Value {
            let request = http::Request::post(url)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(body.to_string())))
                .expect("request");
            let response = self.0.request(request).await.expect("extender answers");
            let bytes = response
                .into_body()
                .collect()
                .await
                .expect("body")
                .to_bytes();
            serde_json::from_slice(&bytes)
                .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&bytes)))
        }

        pub async fn get_status(&self, url: &str) -> u16 {
            let request = http::Request::get(url)
                .body(Full::new(Bytes::new()))
                .expect("request");
            self.0
                .request(request)
                .await
                .expect("answers")
                .status()
                .as_u16()
        }
    }
}

async fn start(api: ApiServer, leader: bool) -> Scheduler {
    start_with(api, Leader::new(leader)).await
}

async fn start_with(api: ApiServer, leader: Leader) -> Scheduler {
    tessera_integration::init_tracing();
    let client = api.client().expect("client");
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let view = tessera_scheduler::cluster::watch(client.clone(), Arc::clone(&ledger));
    let extender = Extender::new(
        ledger,
        Some(client),
        Some(view.pods),
        // The gpushare seed counts MiB, as gpushare's device plugin with --memory-unit=MiB.
        ExtenderConfig {
            request: RequestOptions {
                gpushare_memory_unit: MemoryUnit::MiB,
                ..RequestOptions::default()
            },
            ..ExtenderConfig::default()
        },
        view.ready.clone(),
        Arc::new(leader),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let task = tokio::spawn(serve(listener, extender));
    let http = reqwest_like::Client::new();
    for _ in 0..200 {
        if http.get_status(&format!("{url}/readyz")).await == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        http.get_status(&format!("{url}/readyz")).await,
        200,
        "cache never synced"
    );
    assert_eq!(http.get_status(&format!("{url}/healthz")).await, 200);
    Scheduler {
        api,
        url,
        http,
        _task: task,
    }
}

impl Scheduler {
    fn pod(&self, name: &str) -> Value {
        self.api.get("v1", "pods", "default", name).expect("pod")
    }

    async fn filter(&self, pod: &str, nodes: &[&str]) -> Value {
        self.http
            .post(
                &format!("{}/filter", self.url),
                &json!({"Pod": self.pod(pod), "NodeNames": nodes}),
            )
            .await
    }

    async fn prioritize(&self, pod: &str, nodes: &[&str]) -> Value {
        self.http
            .post(
                &format!("{}/prioritize", self.url),
                &json!({"Pod": self.pod(pod), "NodeNames": nodes}),
            )
            .await
    }

    async fn bind(&self, pod: &str, node: &str) -> Value {
        let uid = self.pod(pod)["metadata"]["uid"].clone();
        self.http
            .post(
                &format!("{}/bind", self.url),
                &json!({"PodName": pod, "PodNamespace": "default", "PodUID": uid, "Node": node}),
            )
            .await
    }

    /// Waits until the ledger (through the watch) has seen `pod` with its annotation.
    async fn settle(&self) {
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
}

async fn seeded() -> ApiServer {
    let api = ApiServer::start().await.expect("api");
    // N1: 4069 MiB left in total; N2: 4069 free on each GPU; N3: 8138 free on one.
    api.insert(DEVICES, "devices", device("n1", &[0, 0], &[]));
    api.insert("v1", "pods", holder("n1", 0, 16276, "n1-a"));
    api.insert("v1", "pods", holder("n1", 1, 12207, "n1-b"));
    api.insert(DEVICES, "devices", device("n2", &[0, 0], &[]));
    api.insert("v1", "pods", holder("n2", 0, 12207, "n2-a"));
    api.insert("v1", "pods", holder("n2", 1, 12207, "n2-b"));
    api.insert(DEVICES, "devices", device("n3", &[0, 0], &[]));
    api.insert("v1", "pods", holder("n3", 0, 8138, "n3-a"));
    api.insert("v1", "pods", holder("n3", 1, 16276, "n3-b"));
    api
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpushare_seed_through_filter_prioritize_and_bind() {
    let api = seeded().await;
    api.insert(
        "v1",
        "pods",
        pending("wants-8138", json!({"aliyun.com/gpu-mem": "8138"})),
    );
    api.insert("v1", "pods", pending("cpu-only", json!({})));
    api.insert(
        "v1",
        "pods",
        pending("invalid", json!({"koordinator.sh/gpu-core": "150"})),
    );
    let s = start(api, true).await;

    let result = s.filter("wants-8138", &["n1", "n2", "n3", "n4"]).await;
    assert_eq!(result["NodeNames"], json!(["n3"]), "{result}");
    assert!(
        result["FailedNodes"]["n1"]
            .as_str()
            .is_some_and(|r| r.contains("0 of 2 usable GPUs")),
        "{result}"
    );
    assert!(result["FailedNodes"]["n2"].is_string());
    assert!(
        result["FailedAndUnresolvableNodes"]["n4"]
            .as_str()
            .is_some_and(|r| r.contains("no Device CR")),
        "{result}"
    );
    assert_eq!(result["Error"], "");

    let scores = s.prioritize("wants-8138", &["n1", "n3"]).await;
    // n3's memory would be full, its compute unused: (0% + 100%) / 2.
    assert_eq!(
        scores,
        json!([{"Host":"n1","Score":0},{"Host":"n3","Score":5}])
    );

    let bound = s.bind("wants-8138", "n3").await;
    assert_eq!(bound["Error"], "", "{bound}");
    let pod = s.pod("wants-8138");
    assert_eq!(pod["spec"]["nodeName"], "n3");
    let annotation: Value = serde_json::from_str(
        pod["metadata"]["annotations"]["scheduling.koordinator.sh/device-allocated"]
            .as_str()
            .expect("annotated"),
    )
    .expect("json");
    assert_eq!(annotation["gpu"][0]["id"], "GPU-n3-0");
    assert_eq!(
        annotation["gpu"][0]["resources"]["koordinator.sh/gpu-memory"],
        json!(8138 * MIB)
    );

    // A pod without GPUs passes every node; an invalid request says why, on every
    // node as unresolvable (no preemption dry run, no hot retry loop), not as an Error.
    assert_eq!(
        s.filter("cpu-only", &["n1", "n2"]).await["NodeNames"],
        json!(["n1", "n2"])
    );
    let invalid = s.filter("invalid", &["n1"]).await;
    assert!(
        invalid["Error"].as_str().unwrap_or_default().is_empty(),
        "{invalid}"
    );
    assert!(
        invalid["FailedAndUnresolvableNodes"]["n1"]
            .as_str()
            .is_some_and(
                |e| e.contains("pod default/invalid: container main: koordinator.sh/gpu-core 150")
            ),
        "{invalid}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_binds_never_over_allocate() {
    let api = ApiServer::start().await.expect("api");
    api.insert(DEVICES, "devices", device("n1", &[0, 0], &[]));
    for i in 0..12 {
        api.insert(
            "v1",
            "pods",
            pending(&format!("half-{i}"), json!({"koordinator.sh/gpu": "50"})),
        );
    }
    let s = Arc::new(start(api, true).await);
    let mut tasks = Vec::new();
    for i in 0..12 {
        let s = Arc::clone(&s);
        tasks.push(tokio::spawn(async move {
            s.bind(&format!("half-{i}"), "n1").await
        }));
    }
    let mut ok = 0;
    for task in tasks {
        if task.await.expect("joined")["Error"] == "" {
            ok += 1;
        }
    }
    assert_eq!(ok, 4, "two GPUs hold exactly four halves");
    let mut per_gpu = std::collections::BTreeMap::<String, u64>::new();
    for i in 0..12 {
        let pod = s.pod(&format!("half-{i}"));
        if let Some(text) =
            pod["metadata"]["annotations"]["scheduling.koordinator.sh/device-allocated"].as_str()
        {
            let a: Value = serde_json::from_str(text).expect("json");
            *per_gpu
                .entry(a["gpu"][0]["id"].as_str().expect("id").to_owned())
                .or_default() += a["gpu"][0]["resources"]["koordinator.sh/gpu-core"]
                .as_u64()
                .expect("core");
            assert_eq!(pod["spec"]["nodeName"], "n1");
        } else {
            assert!(
                pod["spec"]["nodeName"].is_null(),
                "an unannotated pod was bound"
            );
        }
    }
    assert!(per_gpu.values().all(|core| *core == 100), "{per_gpu:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_recovers_use_from_annotations_and_legacy_gpus_are_excluded() {
    let api = seeded().await;
    api.insert(DEVICES, "devices", device("n5", &[0, 0], &["GPU-n5-0"]));
    api.insert(
        "v1",
        "pods",
        pending("whole", json!({"nvidia.com/gpu": "1"})),
    );
    api.insert(
        "v1",
        "pods",
        pending("whole-2", json!({"nvidia.com/gpu": "1"})),
    );
    let first = start(api.clone(), true).await;
    assert_eq!(
        first.filter("whole", &["n1", "n2", "n3", "n5"]).await["NodeNames"],
        json!(["n5"]),
        "only n5's non-legacy GPU is whole-free"
    );
    assert_eq!(first.bind("whole", "n5").await["Error"], "");
    first.settle().await;
    drop(first);

    // A new replica rebuilds the same view from the pods' annotations.
    let second = start(api, true).await;
    let result = second.filter("whole-2", &["n1", "n2", "n3", "n5"]).await;
    assert_eq!(result["NodeNames"], json!([]), "{result}");
    assert!(
        result["FailedNodes"]["n5"]
            .as_str()
            .is_some_and(|r| r.contains(
                "0 of 1 usable GPUs (2 total: 1 held by device-plugin pods) have room for 100 percent compute"
            )),
        "{result}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_binding_rolls_back_annotation_and_capacity() {
    let api = ApiServer::start().await.expect("api");
    api.insert(DEVICES, "devices", device("n1", &[0], &[]));
    let mut taken = pending("already-bound", json!({"nvidia.com/gpu": "1"}));
    taken["spec"]["nodeName"] = json!("elsewhere");
    api.insert("v1", "pods", taken);
    api.insert(
        "v1",
        "pods",
        pending("next", json!({"nvidia.com/gpu": "1"})),
    );
    let s = start(api, true).await;
    // The Binding is refused (the pod is already assigned): nothing may stay behind.
    let bound = s.bind("already-bound", "n1").await;
    assert!(
        bound["Error"]
            .as_str()
            .is_some_and(|e| e.contains("binding to n1")),
        "{bound}"
    );
    assert!(s.pod("already-bound")["metadata"]["annotations"]["scheduling.koordinator.sh/device-allocated"].is_null(), "annotation not rolled back");
    assert_eq!(
        s.filter("next", &["n1"]).await["NodeNames"],
        json!(["n1"]),
        "capacity not released"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_leader_binds() {
    let api = ApiServer::start().await.expect("api");
    api.insert(DEVICES, "devices", device("n1", &[0], &[]));
    api.insert("v1", "pods", pending("p", json!({"nvidia.com/gpu": "1"})));
    let leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> =
        kube::Api::namespaced(api.client().expect("client"), "tessera-system");
    let config = |identity: &str| LeaseConfig {
        namespace: "tessera-system".into(),
        name: "tessera-scheduler".into(),
        identity: identity.into(),
        duration: Duration::from_secs(15),
        url: Some(format!("http://{identity}.example:8888")),
    };
    assert!(
        try_lead(&leases, &config("a"))
            .await
            .expect("a tries")
            .leading
    );
    let b = try_lead(&leases, &config("b")).await.expect("b tries");
    assert!(!b.leading, "two leaders");
    assert_eq!(
        b.leader_url.as_deref(),
        Some("http://a.example:8888"),
        "a follower learns where the leader listens"
    );
    assert!(
        try_lead(&leases, &config("a"))
            .await
            .expect("a renews")
            .leading
    );
    let lease = leases.get("tessera-scheduler").await.expect("lease");
    assert_eq!(
        lease.metadata.annotations.expect("annotations")[EXTENDER_URL_ANNOTATION],
        "http://a.example:8888"
    );

    let follower = start(api, false).await;
    let refused = follower.bind("p", "n1").await;
    assert!(
        refused["Error"]
            .as_str()
            .is_some_and(|e| e.contains("not the leader")),
        "{refused}"
    );
    assert!(follower.pod("p")["spec"]["nodeName"].is_null());
    assert_eq!(
        follower.filter("p", &["n1"]).await["NodeNames"],
        json!(["n1"]),
        "followers still filter"
    );
}

/// kube-scheduler reaches the replicas through one Service: a bind that lands on
/// a follower is handed to the leader and done there, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bind_sent_to_a_follower_is_done_by_the_leader() {
    let api = ApiServer::start().await.expect("api");
    api.insert(DEVICES, "devices", device("n1", &[0], &[]));
    api.insert(
        "v1",
        "pods",
        pending(
            "p",
            json!({"koordinator.sh/gpu-core": "50", "koordinator.sh/gpu-memory-ratio": "50"}),
        ),
    );
    api.insert(
        "v1",
        "pods",
        pending(
            "q",
            json!({"koordinator.sh/gpu-core": "50", "koordinator.sh/gpu-memory-ratio": "50"}),
        ),
    );
    let leader = start(api.clone(), true).await;
    let follower = start_with(api.clone(), Leader::following(leader.url.clone())).await;

    let answer = follower.bind("p", "n1").await;
    assert_eq!(answer["Error"], "", "{answer}");
    let bound = follower.pod("p");
    assert_eq!(bound["spec"]["nodeName"], "n1");
    assert!(
        bound["metadata"]["annotations"]["scheduling.koordinator.sh/device-allocated"].is_string(),
        "{bound}"
    );

    // A handed-over bind is never handed on: no loops between two stale views.
    let stale = start_with(api, Leader::following(follower.url.clone())).await;
    let refused = stale.bind("q", "n1").await;
    assert!(
        refused["Error"]
            .as_str()
            .is_some_and(|e| e.contains("not the leader")),
        "{refused}"
    );
    assert!(stale.pod("q")["spec"]["nodeName"].is_null());
}
