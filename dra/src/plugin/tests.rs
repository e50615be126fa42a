use std::collections::BTreeMap;
use std::sync::Mutex as StdMutex;

use serde_json::json;

use super::*;
use crate::prepare::CDI_KIND;

const GIB: u64 = 1 << 30;
const NODE: &str = "node-a";

#[derive(Debug, Default)]
struct FakeCluster {
    claims: StdMutex<BTreeMap<String, ResourceClaim>>,
    pods: StdMutex<BTreeMap<String, Pod>>,
    slice: StdMutex<Option<ResourceSlice>>,
    down: std::sync::atomic::AtomicBool,
}

#[async_trait]
impl ClusterReader for FakeCluster {
    async fn claim(&self, namespace: &str, name: &str) -> Result<ResourceClaim, String> {
        if self.down.load(std::sync::atomic::Ordering::SeqCst) {
            return Err("connection refused".into());
        }
        let claims = self.claims.lock().expect("lock");
        claims
            .get(&format!("{namespace}/{name}"))
            .cloned()
            .ok_or_else(|| format!("ResourceClaim {namespace}/{name} not found"))
    }

    async fn pod(&self, namespace: &str, name: &str) -> Result<Option<Pod>, String> {
        let pods = self.pods.lock().expect("lock");
        Ok(pods.get(&format!("{namespace}/{name}")).cloned())
    }

    async fn slice(&self, name: &str) -> Result<ResourceSlice, String> {
        assert_eq!(name, slice_name(NODE));
        self.slice
            .lock()
            .expect("lock")
            .clone()
            .ok_or_else(|| "no slice".to_owned())
    }
}

fn slice() -> ResourceSlice {
    serde_json::from_value(json!({
        "metadata": {"name": slice_name(NODE)},
        "spec": {
            "driver": DRIVER, "nodeName": NODE,
            "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {"name": "gpu-0", "attributes": {"uuid": {"string": "GPU-a"}, "minor": {"int": 0}},
                 "capacity": {"cores": {"value": "100"}, "memory": {"value": "80Gi"}}},
                {"name": "gpu-1", "attributes": {"uuid": {"string": "GPU-b"}, "minor": {"int": 1}},
                 "capacity": {"cores": {"value": "100"}, "memory": {"value": "80Gi"}}}
            ]
        }
    }))
    .expect("a slice")
}

fn claim(
    name: &str,
    uid: &str,
    results: serde_json::Value,
    pods: &[(&str, &str)],
) -> ResourceClaim {
    let reserved: Vec<_> = pods
        .iter()
        .map(|(name, uid)| json!({"resource": "pods", "name": name, "uid": uid}))
        .collect();
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "ns", "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
        "status": {
            "allocation": {"devices": {"results": results}},
            "reservedFor": reserved
        }
    }))
    .expect("a claim")
}

fn pod(name: &str, uid: &str, claim: &str, containers: serde_json::Value) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "ns", "uid": uid},
        "spec": {
            "resourceClaims": [{"name": "share", "resourceClaimTemplateName": "t"}],
            "containers": containers
        },
        "status": {"resourceClaimStatuses": [{"name": "share", "resourceClaimName": claim}]}
    }))
    .expect("a pod")
}

fn quarter(device: &str) -> serde_json::Value {
    json!([{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device,
            "consumedCapacity": {"cores": "25", "memory": "20Gi"}, "shareID": "abc"}])
}

struct Setup {
    dir: tempfile::TempDir,
    cluster: Arc<FakeCluster>,
}

impl Setup {
    fn new() -> Self {
        let cluster = Arc::new(FakeCluster::default());
        *cluster.slice.lock().expect("lock") = Some(slice());
        Self {
            dir: tempfile::tempdir().expect("tempdir"),
            cluster,
        }
    }

    fn add(&self, claim: ResourceClaim, pods: Vec<Pod>) {
        let key = format!("ns/{}", claim.metadata.name.clone().expect("a claim name"));
        self.cluster.claims.lock().expect("lock").insert(key, claim);
        for pod in pods {
            let key = format!("ns/{}", pod.metadata.name.clone().expect("a pod name"));
            self.cluster.pods.lock().expect("lock").insert(key, pod);
        }
    }

    fn plugin(&self) -> Plugin {
        Plugin::start(
            NODE.into(),
            self.cluster.clone(),
            Checkpoint::new(self.dir.path().join("plugin").join("claims.json")),
        )
        .expect("started")
    }
}

fn claim_ref(name: &str, uid: &str) -> Claim {
    Claim {
        namespace: "ns".into(),
        uid: uid.into(),
        name: name.into(),
    }
}

#[tokio::test]
async fn a_quarter_claim_is_prepared_checkpointed_and_specified_in_cdi() {
    let setup = Setup::new();
    setup.add(
        claim("q", "uid-q", quarter("gpu-1"), &[("p", "uid-p")]),
        vec![pod(
            "p",
            "uid-p",
            "q",
            json!([{"name": "app", "resources": {"claims": [{"name": "share"}]}},
                   {"name": "sidecar"}]),
        )],
    );
    let plugin = setup.plugin();
    let devices = plugin
        .prepare(&claim_ref("q", "uid-q"))
        .await
        .expect("prepared");
    assert_eq!(
        devices,
        vec![Device {
            request_names: vec!["gpu".into()],
            pool_name: NODE.into(),
            device_name: "gpu-1".into(),
            cdi_device_ids: vec![format!("{CDI_KIND}=uid-q-0")],
        }]
    );
    let book = plugin.prepared();
    let prepared = &book.claims["uid-q"];
    let device = &prepared.devices[0];
    assert_eq!(
        (
            device.uuid.as_str(),
            device.minor,
            device.cores,
            device.memory
        ),
        ("GPU-b", 1, 25, 20 * GIB)
    );
    assert_eq!(device.share_id.as_deref(), Some("abc"));
    assert_eq!(prepared.pods.len(), 1);
    assert_eq!(
        prepared.pods[0].containers,
        BTreeMap::from([("app".to_owned(), Vec::new())])
    );
    // The pod's containers as the proxy will read them.
    let pod_claims = book.of_pod("uid-p").expect("the pod's");
    assert_eq!(pod_claims.cdi_devices, vec![format!("{CDI_KIND}=uid-q-0")]);
    let allocation = pod_claims.allocation.expect("honoured");
    assert_eq!(
        allocation.gpus_of_container("app")[0].1.gpu_core(),
        Some(25)
    );
    assert!(allocation.gpus_of_container("sidecar").is_empty());

    // A restart finds what was prepared, and answers kubelet's retry the same
    // way even while the API server is away.
    drop(plugin);
    setup
        .cluster
        .down
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let restarted = setup.plugin();
    assert_eq!(restarted.prepared(), book);
    assert_eq!(
        restarted
            .prepare(&claim_ref("q", "uid-q"))
            .await
            .expect("again"),
        devices
    );

    restarted
        .unprepare(&claim_ref("q", "uid-q"))
        .await
        .expect("unprepared");
    assert!(restarted.prepared().claims.is_empty());
    // Unpreparing twice is fine (kubelet retries).
    restarted
        .unprepare(&claim_ref("q", "uid-q"))
        .await
        .expect("unprepared again");
    let reloaded = setup.plugin();
    assert!(reloaded.prepared().claims.is_empty());
}

#[tokio::test]
async fn refusals_name_the_claim_and_what_is_wrong() {
    let setup = Setup::new();
    setup.add(
        claim("gone-device", "u1", quarter("gpu-7"), &[]),
        Vec::new(),
    );
    setup.add(
        claim(
            "too-much",
            "u2",
            json!([{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0",
                    "consumedCapacity": {"cores": "150", "memory": "1Gi"}}]),
            &[],
        ),
        Vec::new(),
    );
    setup.add(
        serde_json::from_value(json!({
            "metadata": {"name": "pending", "namespace": "ns", "uid": "u3"},
            "spec": {"devices": {}}
        }))
        .expect("a claim"),
        Vec::new(),
    );
    let plugin = setup.plugin();
    let error = plugin
        .prepare(&claim_ref("gone-device", "u1"))
        .await
        .expect_err("refused");
    assert!(
        error.contains("ns/gone-device") && error.contains("gpu-7"),
        "{error}"
    );
    let error = plugin
        .prepare(&claim_ref("too-much", "u2"))
        .await
        .expect_err("refused");
    assert!(error.contains("cores 150"), "{error}");
    let error = plugin
        .prepare(&claim_ref("pending", "u3"))
        .await
        .expect_err("refused");
    assert!(error.contains("not allocated"), "{error}");
    let error = plugin
        .prepare(&claim_ref("too-much", "another-uid"))
        .await
        .expect_err("refused");
    assert!(error.contains("kubelet asked for another-uid"), "{error}");
    let error = plugin
        .prepare(&claim_ref("missing", "u9"))
        .await
        .expect_err("refused");
    assert!(error.contains("not found"), "{error}");
    assert!(plugin.prepared().claims.is_empty());
}

#[tokio::test]
async fn results_of_other_drivers_and_pools_are_not_ours_and_a_stale_pod_is_not_reserved() {
    let setup = Setup::new();
    setup.add(
        claim(
            "mixed",
            "u1",
            json!([
                {"request": "gpu", "driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-0"},
                {"request": "gpu", "driver": DRIVER, "pool": "node-b", "device": "gpu-0"},
                {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0"}
            ]),
            &[("p", "uid-old")],
        ),
        vec![pod(
            "p",
            "uid-new",
            "mixed",
            json!([{"name": "app", "resources": {"claims": [{"name": "share"}]}}]),
        )],
    );
    let plugin = setup.plugin();
    let devices = plugin
        .prepare(&claim_ref("mixed", "u1"))
        .await
        .expect("prepared");
    assert_eq!(devices.len(), 1);
    assert_eq!(devices[0].cdi_device_ids, vec![format!("{CDI_KIND}=u1-2")]);
    // No consumed capacity (allocated as an exclusive device): the whole GPU.
    let book = plugin.prepared();
    assert!(book.claims["u1"].devices[0].is_whole());
    // The pod of that name now is another pod: not the one reserved.
    assert!(book.claims["u1"].pods.is_empty());
}

#[tokio::test]
async fn an_unreadable_checkpoint_stops_the_plugin() {
    let setup = Setup::new();
    let path = setup.dir.path().join("plugin").join("claims.json");
    std::fs::create_dir_all(path.parent().expect("dir")).expect("dir");
    std::fs::write(&path, "not json").expect("write");
    let error = Plugin::start(NODE.into(), setup.cluster.clone(), Checkpoint::new(&path))
        .expect_err("refused");
    assert!(error.to_string().contains("claims.json"), "{error}");
}

#[tokio::test]
async fn admin_access_is_refused_a_gone_pod_is_skipped_and_init_containers_run_before() {
    let setup = Setup::new();
    setup.add(
        claim(
            "admin",
            "u1",
            json!([{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0",
                    "adminAccess": true}]),
            &[],
        ),
        Vec::new(),
    );
    setup.add(
        claim(
            "q",
            "u2",
            quarter("gpu-0"),
            &[("gone", "uid-gone"), ("p", "uid-p")],
        ),
        vec![pod(
            "p",
            "uid-p",
            "q",
            json!([{"name": "app", "resources": {"claims": [{"name": "share"}]}}]),
        )],
    );
    let mut with_init = pod(
        "p",
        "uid-p",
        "q",
        json!([{"name": "app", "resources": {"claims": [{"name": "share"}]}}]),
    );
    let spec = with_init.spec.as_mut().expect("a spec");
    spec.init_containers = Some(
        serde_json::from_value(json!([
            {"name": "setup", "resources": {"claims": [{"name": "share", "request": "gpu"}]}},
            {"name": "sidecar", "restartPolicy": "Always", "resources": {"claims": [{"name": "share"}]}}
        ]))
        .expect("containers"),
    );
    let plugin = setup.plugin();
    let error = plugin
        .prepare(&claim_ref("admin", "u1"))
        .await
        .expect_err("refused");
    assert!(error.contains("adminAccess"), "{error}");
    plugin
        .prepare(&claim_ref("q", "u2"))
        .await
        .expect("prepared");
    let book = plugin.prepared();
    let pods = &book.claims["u2"].pods;
    assert_eq!(pods.len(), 1, "{pods:?}");
    assert_eq!(pods[0].uid, "uid-p");

    // Init containers: one that runs before (its share free again when the app
    // starts), and a sidecar that runs beside the app.
    setup.add(
        claim("q", "u2", quarter("gpu-0"), &[("p", "uid-p")]),
        vec![with_init],
    );
    plugin
        .prepare(&claim_ref("q", "u2"))
        .await
        .expect("prepared again");
    let book = plugin.prepared();
    let pod = &book.claims["u2"].pods[0];
    assert_eq!(pod.run_before, vec!["setup".to_owned()]);
    assert_eq!(
        pod.containers.keys().cloned().collect::<Vec<_>>(),
        vec!["app".to_owned(), "setup".to_owned(), "sidecar".to_owned()]
    );
    assert_eq!(pod.containers["setup"], vec!["gpu".to_owned()]);
    // The sidecar and the app would use the quarter at once: refused.
    let why = book
        .of_pod("uid-p")
        .expect("the pod's")
        .allocation
        .expect_err("refused");
    assert!(
        why.contains("container sidecar") && why.contains("container app"),
        "{why}"
    );
}

#[tokio::test]
async fn a_failed_write_leaves_a_prepared_claim_prepared() {
    let setup = Setup::new();
    setup.add(claim("q", "u1", quarter("gpu-0"), &[]), Vec::new());
    let plugin = setup.plugin();
    plugin
        .prepare(&claim_ref("q", "u1"))
        .await
        .expect("prepared");
    let before = plugin.prepared();
    // The checkpoint's directory made unwritable: a file where it must be.
    let dir = setup.dir.path().join("plugin");
    std::fs::remove_dir_all(&dir).expect("remove");
    std::fs::write(&dir, "in the way").expect("write");
    let error = plugin
        .prepare(&claim_ref("q", "u1"))
        .await
        .expect_err("not written");
    assert!(error.contains("writing the checkpoint"), "{error}");
    assert_eq!(plugin.prepared(), before);
    let error = plugin
        .unprepare(&claim_ref("q", "u1"))
        .await
        .expect_err("not written");
    assert!(error.contains("writing the checkpoint"), "{error}");
    assert_eq!(plugin.prepared(), before);
}
