//! Serving only from synced caches, against the API server double: before the
//! first list and while a watch is dead, filter refuses every node with a reason,
//! bind is refused, /readyz says 503 and the replica does not contend for the Lease.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tessera_allocator::ledger::Ledger;
use tessera_harness::apiserver::ApiServer;
use tessera_scheduler::extender::{Extender, ExtenderConfig, NOT_SYNCED, serve};
use tessera_scheduler::leader::{Election, ElectionTiming, Leader, LeaseConfig};
use tessera_scheduler::protocol::{ExtenderArgs, ExtenderBindingArgs};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const DEVICES: &str = "scheduling.koordinator.sh/v1alpha1";

fn device(node: &str) -> Value {
    json!({"apiVersion": DEVICES, "kind": "Device", "metadata": {"name": node}, "spec": {"devices": [
        {"type":"gpu","id":format!("GPU-{node}-0"),"minor":0,"health":true,
         "resources":{"koordinator.sh/gpu-memory":(16u64 << 30).to_string()}}]}})
}

fn pod(name: &str) -> Value {
    json!({"apiVersion":"v1","kind":"Pod","metadata":{"name":name,"namespace":"default","uid":format!("u-{name}")},
        "spec":{"containers":[{"name":"main","image":"x","resources":{"limits":{"koordinator.sh/gpu":"50"}}}]},
        "status":{"phase":"Pending"}})
}

fn filter_args(name: &str) -> ExtenderArgs {
    serde_json::from_value(json!({"Pod": pod(name), "NodeNames": ["n1", "n2"]})).expect("args")
}

async fn readyz(url: &str) -> String {
    let mut stream = tokio::net::TcpStream::connect(url.trim_start_matches("http://"))
        .await
        .expect("connect");
    stream
        .write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .expect("write");
    let mut response = String::new();
    stream.read_to_string(&mut response).await.expect("read");
    response.lines().next().unwrap_or_default().to_owned()
}

async fn until(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..500 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("never: {what}");
}

fn refuses_everything(extender: &Extender) {
    let result = extender.filter(filter_args("p"));
    assert_eq!(result.node_names, Some(vec![]), "{result:?}");
    for node in ["n1", "n2"] {
        assert_eq!(
            result
                .failed_and_unresolvable_nodes
                .get(node)
                .map(String::as_str),
            Some(NOT_SYNCED),
            "{result:?}"
        );
    }
}

#[tokio::test]
async fn nothing_is_served_before_the_first_list() {
    let mut ledger = Ledger::default();
    ledger.apply_device(&serde_json::from_value(device("n1")).expect("device"));
    let extender = Extender::new(
        Arc::new(Mutex::new(ledger)),
        None,
        None,
        ExtenderConfig::default(),
        Arc::new(AtomicBool::new(false)),
        Arc::new(Leader::new(true)),
    );
    refuses_everything(&extender);
    let args = ExtenderBindingArgs {
        pod_name: "p".into(),
        pod_namespace: "default".into(),
        pod_uid: "u-p".into(),
        node: "n1".into(),
    };
    assert_eq!(
        extender.bind(&args, false).await.error,
        "pod default/p: tessera-scheduler's cluster cache is not synced (starting, relisting or reconnecting a watch); retry"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_watch_makes_the_replica_unready_until_it_relisted() {
    let api = ApiServer::start().await.expect("api");
    api.insert(DEVICES, "devices", device("n1"));
    api.insert(DEVICES, "devices", device("n2"));
    api.insert("v1", "pods", pod("p"));
    let client = api.client().expect("client");
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let view = tessera_scheduler::cluster::watch(client.clone(), Arc::clone(&ledger));
    let ready = Arc::clone(&view.ready);
    // Every node that fits answered: both nodes' verdicts are what is checked.
    let config = ExtenderConfig {
        candidates: 0,
        ..ExtenderConfig::default()
    };
    let extender = Extender::new(
        ledger,
        Some(client),
        Some(view.pods),
        config,
        view.ready,
        Arc::new(Leader::new(true)),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("listen");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(serve(listener, extender.clone()));
    until("synced", || ready.load(Ordering::SeqCst)).await;
    assert_eq!(readyz(&url).await, "HTTP/1.1 200 OK");
    assert_eq!(
        extender.filter(filter_args("p")).node_names,
        Some(vec!["n1".to_owned(), "n2".to_owned()])
    );

    // The watches die and cannot come back.
    api.cut_watches(true);
    until("unready", || !ready.load(Ordering::SeqCst)).await;
    assert_eq!(readyz(&url).await, "HTTP/1.1 503 Service Unavailable");
    refuses_everything(&extender);
    let refused = extender
        .bind(
            &ExtenderBindingArgs {
                pod_name: "p".into(),
                pod_namespace: "default".into(),
                pod_uid: "u-p".into(),
                node: "n1".into(),
            },
            false,
        )
        .await;
    assert!(refused.error.contains("not synced"), "{}", refused.error);
    // Meanwhile a Device changes: the relist must bring it in before serving again.
    api.remove(DEVICES, "devices", "", "n2");

    api.cut_watches(false);
    until("ready again", || ready.load(Ordering::SeqCst)).await;
    assert_eq!(readyz(&url).await, "HTTP/1.1 200 OK");
    let result = extender.filter(filter_args("p"));
    assert_eq!(result.node_names, Some(vec!["n1".to_owned()]), "{result:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lease_is_contended_only_once_synced() {
    let api = ApiServer::start().await.expect("api");
    let synced = Arc::new(AtomicBool::new(false));
    let leading = Arc::new(Leader::new(false));
    let election = Election::start(
        api.client().expect("client"),
        LeaseConfig {
            namespace: "tessera-system".into(),
            name: "tessera-scheduler".into(),
            identity: "a".into(),
            duration: Duration::from_millis(600),
            url: Some("http://a".into()),
        },
        ElectionTiming {
            renew_deadline: Duration::from_millis(400),
            retry_period: Duration::from_millis(100),
        },
        Arc::clone(&leading),
        Arc::clone(&synced),
    );
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(!leading.leading());
    assert!(
        api.get(
            "coordination.k8s.io/v1",
            "leases",
            "tessera-system",
            "tessera-scheduler"
        )
        .is_none(),
        "an unsynced replica took the lease"
    );
    synced.store(true, Ordering::SeqCst);
    until("leading", || leading.leading()).await;
    election.abort();
}
