//! The bind path against the API server double with faults injected: a slow
//! Binding that kube-scheduler retries, and a retry answered while the watch lags.

use std::sync::Mutex;
use std::time::Duration;

mod common;

use common::extender;
use serde_json::{Value, json};
use tessera_allocator::ledger::Ledger;
use tessera_api::resources::DEVICE_ALLOCATED;
use tessera_harness::apiserver::ApiServer;
use tessera_scheduler::extender::ExtenderConfig;
use tessera_scheduler::protocol::ExtenderBindingArgs;

const DEVICES: &str = "scheduling.koordinator.sh/v1alpha1";

fn device(node: &str, gpus: usize) -> Value {
    let devices: Vec<Value> = (0..gpus)
        .map(|i| json!({"type":"gpu","id":format!("GPU-{node}-{i}"),"minor":i,"health":true,
            "resources":{"koordinator.sh/gpu-core":"100","koordinator.sh/gpu-memory":(16u64 << 30).to_string(),"koordinator.sh/gpu-memory-ratio":"100"}}))
        .collect();
    json!({"apiVersion": DEVICES, "kind": "Device", "metadata": {"name": node}, "spec": {"devices": devices}})
}

fn half_gpu_pod(name: &str) -> Value {
    json!({"apiVersion":"v1","kind":"Pod","metadata":{"name":name,"namespace":"default","uid":format!("u-{name}")},
        "spec":{"containers":[{"name":"main","image":"x","resources":{"limits":{"koordinator.sh/gpu":"50"}}}]},
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

fn allocation(api: &ApiServer, name: &str) -> Value {
    api.get("v1", "pods", "default", name).expect("pod")["metadata"]["annotations"]
        [DEVICE_ALLOCATED]
        .clone()
}

fn core_used(ledger: &Mutex<Ledger>, node: &str) -> u64 {
    core_of(&ledger.lock().expect("ledger"), node)
}

fn core_of(ledger: &Ledger, node: &str) -> u64 {
    ledger
        .node(node)
        .expect("node")
        .gpus
        .iter()
        .map(|g| g.core_used)
        .sum()
}

/// Waits (5 s at most) until `settled` holds of the ledger, as the watch catches
/// up; panics naming `what` and n1's booked compute otherwise.
async fn until_settled(ledger: &Mutex<Ledger>, what: &str, settled: impl Fn(&Ledger) -> bool) {
    for _ in 0..250 {
        if settled(&ledger.lock().expect("ledger")) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{what}: booked {} of n1", core_used(ledger, "n1"));
}

/// kube-scheduler gives up after its httpTimeout while the Binding is slow and sends
/// the bind again: the second joins the first; one Binding, one allocation, no rollback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bind_repeated_while_the_first_runs_joins_it() {
    let api = ApiServer::start().await.expect("api");
    api.insert(DEVICES, "devices", device("n1", 2));
    api.insert("v1", "pods", half_gpu_pod("slow"));
    let (extender, ledger) = extender(&api, ExtenderConfig::default()).await;
    api.delay_bindings(Duration::from_millis(1500));
    let first = tokio::spawn({
        let extender = extender.clone();
        async move { extender.bind(&args("slow", "n1"), false).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = extender.bind(&args("slow", "n1"), false).await;
    let first = first.await.expect("first bind");
    assert_eq!((first.error.as_str(), second.error.as_str()), ("", ""));
    assert_eq!(api.bindings(), 1, "the repeated bind ran its own Binding");
    let pod = api.get("v1", "pods", "default", "slow").expect("pod");
    assert_eq!(pod["spec"]["nodeName"], "n1");
    assert!(allocation(&api, "slow").is_string(), "{pod}");
    assert_eq!(core_used(&ledger, "n1"), 50, "booked once");
}

/// The first bind finished, the watch has not shown it yet, kube-scheduler retries:
/// the retry is answered from the pod's state and never touches its annotation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_bind_of_a_bound_pod_keeps_its_allocation_under_watch_lag() {
    let api = ApiServer::start().await.expect("api");
    api.insert(DEVICES, "devices", device("n1", 2));
    api.insert(DEVICES, "devices", device("n2", 2));
    api.insert("v1", "pods", half_gpu_pod("done"));
    let (extender, ledger) = extender(&api, ExtenderConfig::default()).await;
    api.hold_watches(true);
    assert_eq!(extender.bind(&args("done", "n1"), false).await.error, "");
    let written = allocation(&api, "done");
    assert!(written.is_string());
    let retried = extender.bind(&args("done", "n1"), false).await;
    assert_eq!(retried.error, "", "a bound pod's retry is a success");
    assert_eq!(
        allocation(&api, "done"),
        written,
        "the annotation was touched"
    );
    assert_eq!(api.bindings(), 1);
    let elsewhere = extender.bind(&args("done", "n2"), false).await;
    assert_eq!(
        elsewhere.error,
        "pod default/done: binding to n2: already bound to node n1"
    );
    assert_eq!(allocation(&api, "done"), written);
    api.hold_watches(false);
    until_settled(&ledger, "not 50", |l| core_of(l, "n1") == 50).await;
}

/// A bound pod's allocation outlives the in-flight TTL while the watch lags: a
/// second pod that would need the same share finds no room, instead of being
/// placed on it once the clock ran out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bound_pods_share_is_held_under_watch_lag_past_the_ttl() {
    let api = ApiServer::start().await.expect("api");
    api.insert(DEVICES, "devices", device("n1", 1));
    api.insert("v1", "pods", half_gpu_pod("first"));
    let mut second = half_gpu_pod("second");
    second["spec"]["containers"][0]["resources"]["limits"]["koordinator.sh/gpu"] = json!("60");
    api.insert("v1", "pods", second.clone());
    let config = ExtenderConfig {
        reservation_ttl: Duration::from_secs(1),
        ..ExtenderConfig::default()
    };
    let (extender, ledger) = extender(&api, config).await;
    api.hold_watches(true);
    assert_eq!(extender.bind(&args("first", "n1"), false).await.error, "");
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(1100)).await;
        extender.expire_reservations();
    }
    assert_eq!(
        core_used(&ledger, "n1"),
        50,
        "the bound pod's share was given back"
    );
    let filtered = extender
        .filter(serde_json::from_value(json!({"Pod": second, "NodeNames": ["n1"]})).expect("args"));
    assert_eq!(filtered.node_names, Some(vec![]), "{filtered:?}");
    let placed = extender.bind(&args("second", "n1"), false).await;
    assert!(placed.error.contains("node n1:"), "{}", placed.error);
    api.hold_watches(false);
    until_settled(
        &ledger,
        "the watch never turned the assumed use into the pod's",
        |l| l.in_flight() == 0,
    )
    .await;
    assert_eq!(core_used(&ledger, "n1"), 50, "counted from the pod, once");
}

/// The allocation rides on the Binding: the API server takes one write for a GPU
/// pod's bind, and the pod is bound with its allocation at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_pods_bind_is_one_write_that_carries_its_allocation() {
    let api = ApiServer::start().await.expect("api");
    api.insert(DEVICES, "devices", device("n1", 2));
    api.insert("v1", "pods", half_gpu_pod("one"));
    let (extender, _ledger) = extender(&api, ExtenderConfig::default()).await;
    let before = api.resource_version();
    assert_eq!(extender.bind(&args("one", "n1"), false).await.error, "");
    assert_eq!(api.resource_version() - before, 1, "writes for one bind");
    let pod = api.get("v1", "pods", "default", "one").expect("pod");
    assert_eq!(pod["spec"]["nodeName"], "n1");
    assert!(allocation(&api, "one").is_string(), "{pod}");
    assert!(
        pod["metadata"]["annotations"]
            .get("tessera.io/requested-as")
            .is_none(),
        "{pod}"
    );
}

/// The pod changed after the cache saw it (its status, as kube-scheduler writes it
/// while a Binding waits): the Binding is not refused for it, and binds once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_changed_since_the_cache_saw_it_is_bound_once() {
    let api = ApiServer::start().await.expect("api");
    api.insert(DEVICES, "devices", device("n1", 2));
    let created = api.insert("v1", "pods", half_gpu_pod("changed"));
    let (extender, _ledger) = extender(&api, ExtenderConfig::default()).await;
    api.hold_watches(true);
    let mut changed = created.clone();
    changed["metadata"]["labels"] = json!({"changed": "yes"});
    api.insert("v1", "pods", changed);
    assert_eq!(extender.bind(&args("changed", "n1"), false).await.error, "");
    assert_eq!(api.bindings(), 1);
    let pod = api.get("v1", "pods", "default", "changed").expect("pod");
    assert_eq!(pod["spec"]["nodeName"], "n1");
    assert_eq!(pod["metadata"]["labels"]["changed"], "yes");
    assert!(allocation(&api, "changed").is_string(), "{pod}");
}

/// Bound elsewhere after the cache saw it (by another scheduler): the Binding is
/// refused as a conflict, the pod is read again and the bind answered from it,
/// and the GPUs it reserved are given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_bound_elsewhere_meanwhile_is_answered_from_its_state() {
    let api = ApiServer::start().await.expect("api");
    api.insert(DEVICES, "devices", device("n1", 2));
    let created = api.insert("v1", "pods", half_gpu_pod("taken"));
    let (extender, ledger) = extender(&api, ExtenderConfig::default()).await;
    api.hold_watches(true);
    let mut bound = created.clone();
    bound["spec"]["nodeName"] = json!("n2");
    api.insert("v1", "pods", bound);
    let answer = extender.bind(&args("taken", "n1"), false).await;
    assert_eq!(
        answer.error,
        "pod default/taken: binding to n1: already bound to node n2"
    );
    assert_eq!(api.bindings(), 1, "one Binding, refused");
    assert!(allocation(&api, "taken").is_null());
    assert_eq!(
        core_used(&ledger, "n1"),
        0,
        "the reservation was given back"
    );
}

/// The API server answers a Binding with a server error and applies nothing yet (a
/// webhook or etcd timed out; it may still apply it): the bind fails saying so,
/// and its GPUs stay reserved, lest another pod take them before the watch shows
/// where this one went.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_binding_whose_outcome_is_unknown_keeps_its_gpus_reserved() {
    let api = ApiServer::start().await.expect("api");
    api.insert(DEVICES, "devices", device("n1", 1));
    api.insert("v1", "pods", half_gpu_pod("unknown"));
    let (extender, ledger) = extender(&api, ExtenderConfig::default()).await;
    // 500: kube's client gives up at once (503 and 504 it retries, for minutes,
    // with backoff; a retry of a Binding that was applied meanwhile is refused as
    // already assigned, and the pod read again shows it bound with what it carried).
    api.fail_bindings(Some(500));
    let answer = extender.bind(&args("unknown", "n1"), false).await;
    assert!(
        answer.error.contains("the API server may still apply it"),
        "{}",
        answer.error
    );
    assert_eq!(core_used(&ledger, "n1"), 50, "the hold was given back");
    // A refusal for good (422) gives it back.
    api.fail_bindings(Some(422));
    let refused = extender.bind(&args("unknown", "n1"), false).await;
    assert!(refused.error.contains("binding to n1"), "{}", refused.error);
    assert_eq!(
        core_used(&ledger, "n1"),
        0,
        "the hold was kept after a refusal"
    );
}

/// An earlier bind of this pod was applied after its answer was lost, and the
/// watch has not shown it yet: the retry's Binding is refused (already assigned),
/// and the pod's own allocation, as read again, is held until the watch shows it,
/// never the retry's choice, never nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_refused_as_already_bound_holds_what_the_pod_holds() {
    let api = ApiServer::start().await.expect("api");
    api.insert(DEVICES, "devices", device("n1", 2));
    let created = api.insert("v1", "pods", half_gpu_pod("late"));
    let (extender, ledger) = extender(&api, ExtenderConfig::default()).await;
    api.hold_watches(true);
    let mut bound = created.clone();
    bound["spec"]["nodeName"] = json!("n1");
    bound["metadata"]["annotations"] = json!({DEVICE_ALLOCATED:
        r#"{"gpu":[{"minor":1,"id":"GPU-n1-1","resources":{"koordinator.sh/gpu-core":50,"koordinator.sh/gpu-memory-ratio":50}}]}"#});
    api.insert("v1", "pods", bound);
    assert_eq!(extender.bind(&args("late", "n1"), false).await.error, "");
    let held = |index: usize| {
        ledger
            .lock()
            .expect("ledger")
            .node("n1")
            .map(|n| n.gpus[index].core_used)
    };
    assert_eq!(
        (held(0), held(1)),
        (Some(0), Some(50)),
        "GPU-n1-1 is the pod's"
    );
    api.hold_watches(false);
    until_settled(&ledger, "not 50 once", |l| {
        core_of(l, "n1") == 50 && l.assumed() == 0
    })
    .await;
}
