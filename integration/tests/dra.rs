//! Tessera's GPUs through Kubernetes' own allocator (DRA with consumable
//! capacity, KEP-5075): the DeviceClass and the ResourceSlice that
//! `tessera_api::dra` builds from a node's Device CR, served by a real
//! kube-apiserver 1.36 and allocated by a real kube-scheduler 1.36 with its
//! default feature gates. The first test's node is a Node object with no kubelet,
//! so its pods bind and never run: it proves the allocation, each claim's consumed
//! share and the refusal. The second runs claims' pods on the harness's real node
//! through Tessera's kubelet plugin and the runtime proxy, and reads each
//! container's OCI spec.

use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::PostParams;
use serde_json::{Value, json};
use tessera_api::dra;
use tessera_harness::cluster::{Cluster, ClusterOptions, Component, K8sBinaries, probe_pod};

/// The Node object the slice is published for.
const NODE: &str = "dra-node";
const GIB: u64 = 1 << 30;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_scheduler_allocates_shares_of_a_published_gpu_and_never_more() {
    tessera_integration::init_tracing();
    let Some(binaries) = K8sBinaries::require_or_skip("DRA allocation").expect("binaries") else {
        return;
    };
    let cluster = Cluster::start(binaries, ClusterOptions::default())
        .await
        .expect("cluster");
    if let Err(error) = shares_of_one_gpu(&cluster).await {
        panic!("{error:#}");
    }
}

/// The harness's real node with `tessera-reporter run --dra`: its GPUs (from the
/// fake NVML library) are in its ResourceSlice and in no book of the extender's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dra_node_offers_its_gpus_to_dra_and_none_to_the_extender() {
    tessera_integration::init_tracing();
    let Some(binaries) = K8sBinaries::require_or_skip("DRA node").expect("binaries") else {
        return;
    };
    // Enforced shares on, as on a node with r615's driver: a claim's share is
    // held by the same backends as the extender's grant.
    let options = ClusterOptions {
        dra: true,
        enforcement: true,
        ..ClusterOptions::default()
    };
    // Started, the cluster has seen the slice list every GPU and the Device CR none.
    let mut cluster = Cluster::start(binaries, options).await.expect("cluster");
    if let Err(error) = one_book(&mut cluster).await {
        let kubelet: Vec<String> = cluster
            .log(Component::Kubelet)
            .lines()
            .filter(|l| l.contains(dra::DRIVER) || l.contains("plugin"))
            .map(str::to_owned)
            .collect();
        panic!(
            "{error:#}\nreporter log:\n{}\nkubelet on the plugin:\n{}",
            cluster.log_tail(Component::Reporter, 30),
            kubelet[kubelet.len().saturating_sub(30)..].join("\n")
        );
    }
}

async fn one_book(cluster: &mut Cluster) -> anyhow::Result<()> {
    let client = cluster.client().await?;
    let node = tessera_harness::cluster::NODE_NAME;
    let uuids: Vec<String> = cluster
        .gpu_node
        .gpus
        .iter()
        .map(|g| g.uuid.clone())
        .collect();
    let slice = Api::<ResourceSlice>::all(client.clone())
        .get(&dra::slice_name(node))
        .await?;
    let published = uuids_of(&slice);
    ensure!(
        published == uuids,
        "the slice lists {published:?}, the node has {uuids:?}"
    );
    ensure!(
        slice.spec.node_name.as_deref() == Some(node)
            && slice
                .metadata
                .owner_references
                .iter()
                .flatten()
                .any(|o| o.kind == "Node" && o.name == node),
        "the slice is not the node's: {:?} {:?}",
        slice.spec.node_name,
        slice.metadata.owner_references
    );
    // The reporter's token (bound to its node) cannot publish another node's GPUs
    // (admission policy tessera-node-agents-own-slice, from the chart).
    let token = cluster
        .node_bound_token("tessera-system", "tessera-reporter", node)
        .await?;
    let as_reporter: Api<ResourceSlice> = Api::all(cluster.client_with_token(&token).await?);
    // Another node's GPUs, and a slice for its own node under another node's name
    // (which would keep that node's reporter from ever publishing).
    let (other, _) = dra::resource_slice("other-node", &one_gpu_device("other-node")?, 1)?;
    let (mut squatted, _) = dra::resource_slice(node, &one_gpu_device(node)?, 1)?;
    squatted.metadata.name = Some(dra::slice_name("other-node"));
    for (what, slice) in [
        ("another node's", other),
        ("another node's name for its", squatted),
    ] {
        match as_reporter.create(&PostParams::default(), &slice).await {
            Err(kube::Error::Api(status))
                if status
                    .message
                    .contains("may write only the ResourceSlice of its own node") => {}
            wrote => bail!("the reporter wrote {what} ResourceSlice: {wrote:?}"),
        }
    }
    // No Tessera resource is offered to kube-scheduler's count.
    let capacity = Api::<Node>::all(client.clone())
        .get(node)
        .await?
        .status
        .and_then(|s| s.allocatable)
        .unwrap_or_default();
    for resource in ["koordinator.sh/gpu-core", "koordinator.sh/gpu-memory-ratio"] {
        ensure!(
            capacity.get(resource).map(|q| q.0.as_str()) == Some("0"),
            "node allocatable {resource} is {:?}, not 0",
            capacity.get(resource)
        );
    }
    // A fractional pod through the extender fits nowhere; a claim is allocated there.
    let fractional: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "extender-share", "namespace": "default"},
        "spec": {"containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
            "resources": {"limits": {"koordinator.sh/gpu-core": "25", "koordinator.sh/gpu-memory-ratio": "25"}}}]}
    }))?;
    Api::<Pod>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &fractional)
        .await?;
    // The chart installed the DeviceClass (reporter.dra): the same as the code's.
    let installed = Api::<DeviceClass>::all(client.clone())
        .get(dra::DEVICE_CLASS)
        .await?;
    ensure!(
        serde_json::to_value(&installed.spec)? == serde_json::to_value(dra::device_class().spec)?,
        "the chart's DeviceClass differs from tessera_api::dra::device_class: {:?}",
        installed.spec
    );
    // A device-plugin pod's GPU (kubelet's checkpoint) leaves the slice, as it is
    // held in the extender's ledger. First, so that the claims below are placed
    // around it (which GPU NVIDIA's plugin picks is its choice).
    let mut legacy = probe_pod("legacy", &[("main", json!({"nvidia.com/gpu": "1"}))], &[]);
    legacy["spec"]["schedulerName"] = json!("nobody");
    cluster.create_pod("admin", &legacy).await?;
    cluster.bind_as_other_scheduler("legacy").await?;
    let running = cluster.wait_running("legacy").await?;
    let specs = cluster.container_specs(&running)?;
    let held = specs
        .get("main")
        .map(|spec| tessera_harness::cluster::env_values(spec, "NVIDIA_VISIBLE_DEVICES"))
        .unwrap_or_default();
    ensure!(
        held.len() == 1,
        "the device-plugin pod sees {held:?}, not one GPU"
    );
    let started = Instant::now();
    let listed = loop {
        let listed = uuids_of(
            &Api::<ResourceSlice>::all(client.clone())
                .get(&dra::slice_name(node))
                .await?,
        );
        if listed.len() + 1 == uuids.len() && !listed.contains(&held[0]) {
            break listed;
        }
        ensure!(
            started.elapsed() < Duration::from_secs(30),
            "30 s after a device-plugin pod took a GPU, the slice still lists {listed:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let result = claim_and_pod(cluster, "dra-share", Some(quarter())).await?;
    ensure!(
        result["pool"] == json!(node) && result["consumedCapacity"] == quarter(),
        "dra-share: allocated {result}"
    );
    let why = wait_unschedulable(cluster, "extender-share").await?;
    ensure!(
        why.contains("Insufficient koordinator.sh/gpu-core"),
        "extender-share is unschedulable, but not for the GPU capacity: {why}"
    );
    // A Device CR still listing GPUs (a node switched from the extender's book) is
    // emptied by the reporter, not left to the extender.
    let devices: Api<tessera_api::Device> = Api::all(client.clone());
    let stale = json!({"spec": {"devices": one_gpu_device(node)?.spec.devices}});
    devices
        .patch(
            node,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&stale),
        )
        .await?;
    let started = Instant::now();
    while !devices.get(node).await?.spec.devices.is_empty() {
        ensure!(
            started.elapsed() < Duration::from_secs(30),
            "30 s on, the DRA node's Device CR still lists GPUs for the extender"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // Tessera's kubelet plugin prepares the claim and the proxy holds its share:
    // the pod runs with exactly its GPU and share in its OCI spec.
    let gpus: Vec<(String, u32)> = cluster
        .gpu_node
        .gpus
        .iter()
        .map(|g| (g.uuid.clone(), g.minor))
        .collect();
    let gpu_of = |result: &Value| -> anyhow::Result<(String, u64)> {
        let device = result["device"].as_str().context("a device name")?;
        let minor: u64 = device
            .strip_prefix("gpu-")
            .and_then(|m| m.parse().ok())
            .with_context(|| format!("device {device} is not gpu-<minor>"))?;
        let uuid = gpus
            .iter()
            .find(|g| u64::from(g.1) == minor)
            .map(|g| g.0.clone())
            .with_context(|| format!("no fake GPU of minor {minor}"))?;
        Ok((uuid, minor))
    };
    let (uuid, minor) = gpu_of(&result)?;
    let first = running_share(cluster, "dra-share", &uuid, minor, Some((25, 20 * 1024))).await?;
    // kubelet shows the claim's GPU health from the plugin's health stream
    // (NVML's view, through the reporter).
    let pod = cluster
        .wait_pod(
            "dra-share",
            Duration::from_secs(30),
            "showing its claimed GPU's health",
            |pod| !claimed_health(pod).is_empty(),
        )
        .await?;
    let health = claimed_health(&pod);
    ensure!(
        health == ["Healthy"],
        "dra-share: its claim's GPU health {health:?}"
    );
    // A second quarter claim pinned to the same GPU: two pods share it, each held
    // to its own quarter.
    let pinned = json!([{"cel": {"expression": format!(
        "device.attributes[\"{}\"].uuid == \"{uuid}\"", dra::DRIVER
    )}}]);
    create_claim_and_pod_with(cluster, "dra-share-2", Some(quarter()), Some(pinned)).await?;
    let second_result = wait_allocated(cluster, "dra-share-2", Duration::from_secs(60)).await?;
    ensure!(
        second_result["device"] == result["device"],
        "dra-share-2 pinned to {uuid} was allocated {second_result}"
    );
    let second = running_share(cluster, "dra-share-2", &uuid, minor, Some((25, 20 * 1024))).await?;
    // A whole-GPU claim: its own GPU, no limiter.
    let whole = claim_and_pod(cluster, "dra-whole", None).await?;
    let (whole_uuid, whole_minor) = gpu_of(&whole)?;
    ensure!(
        whole_uuid != uuid && !held.contains(&whole_uuid),
        "dra-whole shares a GPU: {whole}"
    );
    let whole_spec = running_share(cluster, "dra-whole", &whole_uuid, whole_minor, None).await?;

    // The plugin restarted (the reporter) and the proxy restarted lose nothing:
    // a container kubelet starts again gets the same share, and a pod deleted
    // after the restart has its claim unprepared (the checkpoint was reloaded).
    // A quarter two containers of one pod would use at once: each would be held
    // to the whole quarter, so the proxy refuses it.
    let exactly =
        json!({"deviceClassName": dra::DEVICE_CLASS, "capacity": {"requests": quarter()}});
    let two: ResourceClaim = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "dra-two", "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}
    }))?;
    Api::<ResourceClaim>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &two)
        .await?;
    let container = |name: &str| {
        json!({"name": name, "image": "tessera.local/probe:1", "imagePullPolicy": "Never",
               "resources": {"claims": [{"name": "gpu"}]}})
    };
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "dra-two", "namespace": "default"},
        "spec": {
            "resourceClaims": [{"name": "gpu", "resourceClaimName": "dra-two"}],
            "containers": [container("a"), container("b")],
            "terminationGracePeriodSeconds": 0, "automountServiceAccountToken": false,
            "dnsPolicy": "Default"
        }
    }))?;
    Api::<Pod>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &pod)
        .await?;
    let events = cluster
        .wait_events_in(
            "default",
            "dra-two",
            &["2 containers would use it at once"],
            Duration::from_secs(60),
        )
        .await?;
    let two_refused = events
        .into_iter()
        .find(|e| e.contains("would use it at once"))
        .unwrap_or_default();
    delete_pod_and_claim(cluster, "dra-two").await?;

    // One book with NVIDIA's device plugin: kubelet admits device-plugin pods
    // against the plugin's count alone, and the plugin does not know the claims.
    // Two more such pods: at most one GPU is free of claims, so at least one of
    // them is handed a GPU a running claim holds, and the proxy refuses it.
    let claimed = [uuid.clone(), whole_uuid.clone()];
    let mut refused = Vec::new();
    for name in ["legacy-2", "legacy-3"] {
        let mut pod = probe_pod(name, &[("main", json!({"nvidia.com/gpu": "1"}))], &[]);
        pod["spec"]["schedulerName"] = json!("nobody");
        cluster.create_pod("admin", &pod).await?;
        cluster.bind_as_other_scheduler(name).await?;
    }
    let started = Instant::now();
    for name in ["legacy-2", "legacy-3"] {
        loop {
            let events = cluster.events_of(name).await?;
            if let Some(event) = events.iter().find(|e| e.contains("is already held by")) {
                ensure!(
                    claimed.iter().any(|u| event.contains(u.as_str())),
                    "{name} refused, but not for a claimed GPU: {event}"
                );
                refused.push(event.clone());
                break;
            }
            let pod = Api::<Pod>::namespaced(client.clone(), "default")
                .get(name)
                .await?;
            if tessera_harness::cluster::is_running(&pod) {
                let seen = cluster
                    .container_specs(&pod)?
                    .get("main")
                    .map(|spec| {
                        tessera_harness::cluster::env_values(spec, "NVIDIA_VISIBLE_DEVICES")
                    })
                    .unwrap_or_default();
                ensure!(
                    seen.iter().all(|g| !claimed.contains(g)),
                    "device-plugin pod {name} runs with {seen:?}, a GPU a claim holds ({claimed:?})"
                );
                break;
            }
            ensure!(
                started.elapsed() < Duration::from_secs(90),
                "{name}: neither running nor refused after 90 s: {events:?}"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    ensure!(
        !refused.is_empty(),
        "no device-plugin pod was handed a claimed GPU, though at most one GPU was free"
    );
    for name in ["legacy-2", "legacy-3"] {
        cluster.delete_pod(name).await?;
    }

    // The driver holds each quarter's memory on its GPU (the fake NVML logs the
    // limits tessera-enforce set on each container's cgroup).
    let quarter_limits = |cluster: &Cluster| -> anyhow::Result<usize> {
        Ok(cluster
            .memory_limit_calls()?
            .iter()
            .filter(|c| {
                c["uuid"] == uuid.as_str() && c["hardLimit"] == 20 * GIB && c["result"] == 0
            })
            .count())
    };
    let held = quarter_limits(cluster)?;
    ensure!(
        held == 2,
        "{held} driver memory limits of 20 GiB on {uuid}, want one for each quarter: {:?}",
        cluster.memory_limit_calls()?
    );
    let checkpoint = cluster.dra_claims_file();
    let before = std::fs::read_to_string(&checkpoint)?;
    cluster.restart(Component::Reporter).await?;
    cluster.restart(Component::RuntimeProxy).await?;
    cluster.restart(Component::Kubelet).await?;
    ensure!(
        std::fs::read_to_string(&checkpoint)? == before,
        "the plugin's checkpoint changed across a restart"
    );
    let pod = cluster.wait_running("dra-share").await?;
    let container = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .and_then(|c| c.container_id.clone())
        .context("dra-share's container")?;
    cluster.kill_container(&container)?;
    let restarted = cluster
        .wait_pod(
            "dra-share",
            Duration::from_secs(90),
            "running again after its container was killed",
            restarted_and_running,
        )
        .await?;
    let spec = cluster
        .container_specs(&restarted)?
        .remove("main")
        .context("main's spec")?;
    check_share(
        &spec,
        "dra-share (restarted)",
        &uuid,
        minor,
        Some((25, 20 * 1024)),
    )?;
    ensure!(
        quarter_limits(cluster)? == 3,
        "the restarted container's cgroup got no 20 GiB limit: {:?}",
        cluster.memory_limit_calls()?
    );
    let claim_uid = Api::<ResourceClaim>::namespaced(client.clone(), "default")
        .get("dra-share-2")
        .await?
        .metadata
        .uid
        .context("a claim UID")?;
    ensure!(
        std::fs::read_to_string(&checkpoint)?.contains(&claim_uid),
        "dra-share-2's claim is not in the plugin's checkpoint"
    );
    cluster.delete_pod("dra-share-2").await?;
    let started = Instant::now();
    while std::fs::read_to_string(&checkpoint)?.contains(&claim_uid) {
        ensure!(
            started.elapsed() < Duration::from_secs(60),
            "60 s after its pod went, claim dra-share-2 is still prepared"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // The examples (docs/examples/dra.yaml), applied as a user would, one pod at
    // a time (the whole GPU first, while one is free): each runs with its share.
    let text = std::fs::read_to_string(
        tessera_harness::cluster::repo_root().join("docs/examples/dra.yaml"),
    )?;
    let mut examples = Vec::new();
    for mut doc in tessera_harness::deploy::parse(&text)? {
        if doc["kind"] == "Pod" {
            // The harness's image: no registry here.
            let main = &mut doc["spec"]["containers"][0];
            main["image"] = json!(tessera_harness::image::PROBE_IMAGE);
            main["imagePullPolicy"] = json!("Never");
            main.as_object_mut().map(|m| m.remove("command"));
            doc["spec"]["dnsPolicy"] = json!("Default");
            doc["spec"]["terminationGracePeriodSeconds"] = json!(0);
        }
        cluster.apply(&doc).await?;
        if doc["kind"] != "Pod" {
            continue;
        }
        let name = doc["metadata"]["name"]
            .as_str()
            .context("a pod name")?
            .to_owned();
        let pod = cluster.wait_running(&name).await?;
        let claim = pod
            .status
            .as_ref()
            .and_then(|s| s.resource_claim_statuses.as_ref())
            .and_then(|c| c.first())
            .and_then(|c| c.resource_claim_name.clone())
            .with_context(|| format!("{name}: no claim made from its template"))?;
        let claim = Api::<ResourceClaim>::namespaced(client.clone(), "default")
            .get(&claim)
            .await?;
        let result =
            serde_json::to_value(&claim.status)?["allocation"]["devices"]["results"][0].clone();
        let (gpu, minor) = gpu_of(&result)?;
        let share = match name.as_str() {
            "trains-on-a-whole-gpu" => None,
            "serves-on-a-quarter" => Some((25, 20 * 1024)),
            "caches-in-10gi" => Some((0, 10 * 1024)),
            other => bail!("docs/examples/dra.yaml has a pod {other} this test does not know"),
        };
        let spec = running_share(cluster, &name, &gpu, minor, share).await?;
        examples.push(format!(
            "{name}: {result}\n  spec env {:?}",
            share_env(&spec)
        ));
    }
    ensure!(
        examples.len() == 3,
        "docs/examples/dra.yaml: {} pods, want 3",
        examples.len()
    );

    println!(
        "examples:\n{}\ntwo containers on one quarter: {two_refused}\ndevice-plugin pods refused: {refused:?}\ndra-share: {result}\n  spec env {:?}\ndra-share-2: {second_result}\n  spec env {:?}\ndra-whole: {whole}\n  spec env {:?}\nextender-share: Pending: {why}\ndevice-plugin pod's GPU {held:?}; the slice then listed {listed:?}",
        examples.join("\n"),
        share_env(&first),
        share_env(&second),
        share_env(&whole_spec)
    );
    Ok(())
}

async fn shares_of_one_gpu(cluster: &Cluster) -> anyhow::Result<()> {
    let client = cluster.client().await?;
    let post = PostParams::default();
    // One GPU of 80 GiB, so every claim below competes for it.
    let device = one_gpu_device(NODE)?;
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE}},
        "status": {
            "capacity": {"cpu": "8", "memory": "64Gi", "pods": "110"},
            "allocatable": {"cpu": "8", "memory": "64Gi", "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                "message": "a Node object with no kubelet", "lastHeartbeatTime": now(), "lastTransitionTime": now()}]
        }
    }))?;
    Api::<Node>::all(client.clone())
        .create(&post, &node)
        .await
        .context("creating the node")?;
    Api::<DeviceClass>::all(client.clone())
        .create(&post, &dra::device_class())
        .await
        .context("creating the DeviceClass")?;
    let (slice, _) = dra::resource_slice(NODE, &device, 1)?;
    let stored = Api::<ResourceSlice>::all(client.clone())
        .create(&post, &slice)
        .await
        .context("creating the ResourceSlice")?;
    // kube-apiserver drops fields of features that are off: the consumable
    // capacity must have been kept as written.
    let gpu = stored
        .spec
        .devices
        .as_ref()
        .and_then(|d| d.first())
        .context("the stored slice has no device")?;
    ensure!(
        gpu.allow_multiple_allocations == Some(true)
            && gpu
                .capacity
                .as_ref()
                .and_then(|c| c.get(dra::CORES))
                .is_some_and(|c| c.request_policy.is_some()),
        "kube-apiserver stored the device without its consumable capacity: {gpu:?}"
    );

    // A claim that states no share asks the whole GPU (every default is all of it).
    let whole = claim_and_pod(cluster, "whole", None).await?;
    ensure!(
        whole["device"] == json!("gpu-0")
            && whole["consumedCapacity"]
                == json!({"cores": "100", "memory": (80 * GIB).to_string()}),
        "whole: allocated {whole}"
    );
    // While it holds the GPU, a quarter fits nowhere: Pending, kube-scheduler's reason.
    let why = claim_and_pending_pod(cluster, "quarter-a", Some(quarter())).await?;
    ensure!(
        why.contains("cannot allocate all claims"),
        "quarter-a is unschedulable, but not for its claim: {why}"
    );
    // The whole GPU given back (its pod and claim deleted), the quarter is allocated.
    delete_pod_and_claim(cluster, "whole").await?;
    let first = wait_allocated(cluster, "quarter-a", Duration::from_secs(90)).await?;
    // Another such share, and memory with no compute share (Tessera's memory-only
    // request): all three on the one GPU, each with its own share ID.
    let second = claim_and_pod(cluster, "quarter-b", Some(quarter())).await?;
    let memory_only = claim_and_pod(
        cluster,
        "memory-only",
        Some(json!({"cores": "0", "memory": "10Gi"})),
    )
    .await?;
    for (name, result, consumed) in [
        ("quarter-a", &first, quarter()),
        ("quarter-b", &second, quarter()),
        (
            "memory-only",
            &memory_only,
            json!({"cores": "0", "memory": "10Gi"}),
        ),
    ] {
        ensure!(
            result["device"] == json!("gpu-0")
                && result["pool"] == json!(NODE)
                && result["consumedCapacity"] == consumed,
            "{name}: allocated {result}"
        );
    }
    let ids = [&first, &second, &memory_only].map(|r| r["shareID"].as_str().map(str::to_owned));
    ensure!(
        ids.iter().all(Option::is_some) && ids[0] != ids[1] && ids[1] != ids[2] && ids[0] != ids[2],
        "shares of one GPU need their own share IDs: {ids:?}"
    );
    // 50 % of the compute and 50 GiB are taken: a second whole GPU fits nowhere.
    let why = claim_and_pending_pod(cluster, "whole-again", None).await?;
    ensure!(
        why.contains("cannot allocate all claims"),
        "whole-again is unschedulable, but not for its claim: {why}"
    );
    println!(
        "whole: {whole}\nquarter-a: {first}\nquarter-b: {second}\nmemory-only: {memory_only}\nwhole-again: Pending: {why}"
    );
    Ok(())
}

/// Creates claim `name` (asking `capacity`, or nothing: the device's defaults)
/// and a pod using it; waits until kube-scheduler has allocated the claim and
/// bound the pod; returns the claim's one device result.
async fn claim_and_pod(
    cluster: &Cluster,
    name: &str,
    capacity: Option<Value>,
) -> anyhow::Result<Value> {
    create_claim_and_pod(cluster, name, capacity).await?;
    wait_allocated(cluster, name, Duration::from_secs(60)).await
}

/// Waits (`within`) until claim `name` is allocated and its pod bound to the
/// node of the claim's GPU; returns the claim's one device result.
async fn wait_allocated(cluster: &Cluster, name: &str, within: Duration) -> anyhow::Result<Value> {
    let client = cluster.client().await?;
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let pods: Api<Pod> = Api::namespaced(client, "default");
    let started = Instant::now();
    loop {
        let claim = claims.get(name).await?;
        let pod = pods.get(name).await?;
        let bound = pod.spec.as_ref().and_then(|s| s.node_name.clone());
        let results = claim
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.devices.as_ref())
            .and_then(|d| d.results.clone());
        if let (Some(node), Some(results)) = (bound, results) {
            let [only] = results.as_slice() else {
                bail!("claim {name}: {} device results, not one", results.len());
            };
            // Each node's pool is named after it: the pod is where its GPU is.
            ensure!(
                only.pool == node,
                "pod {name} bound to {node}, its claim's GPU is in pool {}",
                only.pool
            );
            return Ok(serde_json::to_value(only)?);
        }
        if started.elapsed() > within {
            bail!(
                "claim {name} not allocated, or its pod not bound, after {within:?}: claim status {}, pod status {}",
                serde_json::to_string(&claim.status)?,
                serde_json::to_string(&pod.status)?
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// As [`claim_and_pod`] for a claim that fits nowhere: waits until its pod is
/// unschedulable, checks the claim unallocated, and returns kube-scheduler's reason.
async fn claim_and_pending_pod(
    cluster: &Cluster,
    name: &str,
    capacity: Option<Value>,
) -> anyhow::Result<String> {
    create_claim_and_pod(cluster, name, capacity).await?;
    let why = wait_unschedulable(cluster, name).await?;
    let claims: Api<ResourceClaim> = Api::namespaced(cluster.client().await?, "default");
    let claim = claims.get(name).await?;
    ensure!(
        claim
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .is_none(),
        "claim {name} allocated though its pod is unschedulable: {:?}",
        claim.status
    );
    Ok(why)
}

/// Waits until pod `name` is unschedulable, never bound; returns kube-scheduler's reason.
async fn wait_unschedulable(cluster: &Cluster, name: &str) -> anyhow::Result<String> {
    let pods: Api<Pod> = Api::namespaced(cluster.client().await?, "default");
    let started = Instant::now();
    loop {
        let pod = pods.get(name).await?;
        let unschedulable = pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|c| c.iter().find(|c| c.type_ == "PodScheduled"))
            .filter(|c| c.status == "False" && c.reason.as_deref() == Some("Unschedulable"))
            .and_then(|c| c.message.clone());
        if let Some(why) = unschedulable {
            return Ok(why);
        }
        ensure!(
            pod.spec
                .as_ref()
                .and_then(|s| s.node_name.as_ref())
                .is_none(),
            "pod {name} was bound: it fit after all"
        );
        if started.elapsed() > Duration::from_secs(60) {
            bail!(
                "pod {name} neither bound nor unschedulable after 60 s: {}",
                serde_json::to_string(&pod.status)?
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn create_claim_and_pod(
    cluster: &Cluster,
    name: &str,
    capacity: Option<Value>,
) -> anyhow::Result<()> {
    create_claim_and_pod_with(cluster, name, capacity, None).await
}

/// [`create_claim_and_pod`] with the request's `selectors`.
async fn create_claim_and_pod_with(
    cluster: &Cluster,
    name: &str,
    capacity: Option<Value>,
    selectors: Option<Value>,
) -> anyhow::Result<()> {
    let client = cluster.client().await?;
    let mut exactly = json!({"deviceClassName": dra::DEVICE_CLASS});
    if let Some(requests) = capacity {
        exactly["capacity"] = json!({"requests": requests});
    }
    if let Some(selectors) = selectors {
        exactly["selectors"] = selectors;
    }
    let claim: ResourceClaim = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}
    }))?;
    Api::<ResourceClaim>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &claim)
        .await
        .with_context(|| format!("creating claim {name}"))?;
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
            "containers": [{"name": "main", "image": "tessera.local/probe:1",
                "imagePullPolicy": "Never", "resources": {"claims": [{"name": "gpu"}]}}],
            "terminationGracePeriodSeconds": 0, "automountServiceAccountToken": false,
            "dnsPolicy": "Default"
        }
    }))?;
    Api::<Pod>::namespaced(client, "default")
        .create(&PostParams::default(), &pod)
        .await
        .with_context(|| format!("creating pod {name}"))?;
    Ok(())
}

/// Waits until pod `name` runs and checks its container `main`'s OCI spec holds
/// exactly GPU `uuid` (minor `minor`) and, for a share, its limits (`(cores,
/// MiB)`); returns the spec.
async fn running_share(
    cluster: &mut Cluster,
    name: &str,
    uuid: &str,
    minor: u64,
    share: Option<(u64, u64)>,
) -> anyhow::Result<Value> {
    let pod = cluster.wait_running(name).await?;
    let spec = cluster
        .container_specs(&pod)?
        .remove("main")
        .with_context(|| format!("{name}: no spec of container main"))?;
    check_share(&spec, name, uuid, minor, share)?;
    Ok(spec)
}

fn check_share(
    spec: &Value,
    name: &str,
    uuid: &str,
    minor: u64,
    share: Option<(u64, u64)>,
) -> anyhow::Result<()> {
    use tessera_harness::cluster::{env_values, gpu_device_minors, runtime_env};
    let visible = env_values(spec, "NVIDIA_VISIBLE_DEVICES");
    ensure!(
        visible == [uuid.to_owned()],
        "{name}: NVIDIA_VISIBLE_DEVICES {visible:?}, granted {uuid}"
    );
    let minors = gpu_device_minors(spec);
    ensure!(
        minors == [minor].into(),
        "{name}: GPU device nodes {minors:?}, granted minor {minor}"
    );
    let limits = (
        runtime_env(spec, "CUDA_DEVICE_SM_LIMIT"),
        runtime_env(spec, "CUDA_DEVICE_MEMORY_LIMIT_0"),
    );
    // Memory alone (cores 0): no compute limit.
    let want = share.map_or((None, None), |(cores, mib)| {
        (
            (cores > 0).then(|| cores.to_string()),
            Some(format!("{mib}m")),
        )
    });
    ensure!(
        limits == want,
        "{name}: limiter env {limits:?}, granted {want:?}"
    );
    // A share is held by the node's backends, named in the spec; a whole GPU
    // needs none.
    let enforcement = runtime_env(spec, "TESSERA_ENFORCEMENT");
    ensure!(
        share.is_none() == enforcement.is_none()
            && enforcement
                .as_deref()
                .is_none_or(|e| e.contains("driver-memory")),
        "{name}: TESSERA_ENFORCEMENT {enforcement:?} for share {share:?}"
    );
    Ok(())
}

/// The share's env in a spec, for the test's output.
fn share_env(spec: &Value) -> Vec<String> {
    spec["process"]["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .filter(|e| {
            e.starts_with("NVIDIA_VISIBLE_DEVICES=")
                || e.starts_with("CUDA_DEVICE_")
                || e.starts_with("TESSERA_")
        })
        .map(str::to_owned)
        .collect()
}

/// The health kubelet reports for `pod`'s claimed devices.
fn claimed_health(pod: &Pod) -> Vec<String> {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .into_iter()
        .flatten()
        .flat_map(|c| c.allocated_resources_status.iter().flatten())
        .flat_map(|r| r.resources.iter().flatten())
        .filter_map(|r| r.health.clone())
        .collect()
}

/// Whether `pod`'s first container was restarted and runs again.
fn restarted_and_running(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .is_some_and(|c| {
            c.restart_count > 0 && c.state.as_ref().is_some_and(|s| s.running.is_some())
        })
}

/// The UUIDs of the GPUs `slice` offers, in its order.
fn uuids_of(slice: &ResourceSlice) -> Vec<String> {
    slice
        .spec
        .devices
        .iter()
        .flatten()
        .filter_map(|d| d.attributes.as_ref()?.get("uuid")?.string.clone())
        .collect()
}

/// The Device CR of `node` with one 80 GiB GPU.
fn one_gpu_device(node: &str) -> anyhow::Result<tessera_api::Device> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "scheduling.koordinator.sh/v1alpha1", "kind": "Device",
        "metadata": {"name": node},
        "spec": {"devices": [{"type": "gpu", "id": format!("GPU-{node}-0"), "minor": 0, "health": true,
            "labels": {"node.koordinator.sh/gpu-model": "NVIDIA-H100-80GB-HBM3"},
            "resources": {"koordinator.sh/gpu-core": "100", "koordinator.sh/gpu-memory-ratio": "100",
                "koordinator.sh/gpu-memory": (80 * GIB).to_string()}}]}
    }))?)
}

/// 25 % of the GPU's compute and 20 GiB.
fn quarter() -> Value {
    json!({"cores": "25", "memory": "20Gi"})
}

/// Deletes pod `name` at once (no kubelet runs it to confirm a graceful delete)
/// and claim `name`, whose allocation the claim controller then gives back.
async fn delete_pod_and_claim(cluster: &Cluster, name: &str) -> anyhow::Result<()> {
    let client = cluster.client().await?;
    let now = kube::api::DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    Api::<Pod>::namespaced(client.clone(), "default")
        .delete(name, &now)
        .await
        .with_context(|| format!("deleting pod {name}"))?;
    Api::<ResourceClaim>::namespaced(client, "default")
        .delete(name, &Default::default())
        .await
        .with_context(|| format!("deleting claim {name}"))?;
    Ok(())
}

fn now() -> String {
    k8s_openapi::jiff::Timestamp::now().to_string()
}
