//! Integrity round 3 on the real cluster: one GPU, one book, whoever asks.

use std::time::Duration;

use anyhow::{bail, ensure};
use serde_json::json;
use tessera_harness::cluster::{Cluster, NODE_NAME, allocated_gpus, probe_pod as pod};

use super::waiting_messages;

/// The device-plugin bypass: with every GPU holding a Tessera share, a tenant's
/// pod that names the node itself (`spec.nodeName`, so it never meets the
/// scheduler) and asks NVIDIA's real device plugin for `nvidia.com/gpu: 1` is
/// admitted by kubelet and handed a GPU by the plugin, and its container is then
/// refused: the GPU is Tessera's tenant's, and is never given twice.
pub async fn device_plugin_bypass_never_gets_a_shared_gpu(
    cluster: &mut Cluster,
) -> anyhow::Result<()> {
    let shares: Vec<String> = (0..4).map(|i| format!("book-share-{i}")).collect();
    for name in &shares {
        cluster
            .create_pod(
                "admin",
                &pod(name, &[("main", json!({"koordinator.sh/gpu": "60"}))], &[]),
            )
            .await?;
    }
    let mut held = std::collections::BTreeSet::new();
    for name in &shares {
        let running = cluster.wait_running(name).await?;
        held.extend(allocated_gpus(&running)?.into_iter().map(|(uuid, _)| uuid));
    }
    ensure!(held.len() == 4, "the shares hold {held:?}, want all 4 GPUs");

    let mut bypass = pod("bypass", &[("main", json!({"nvidia.com/gpu": "1"}))], &[]);
    bypass["spec"]["nodeName"] = json!(NODE_NAME);
    cluster.create_pod("tenant", &bypass).await?;
    let refused = cluster
        .wait_pod(
            "bypass",
            Duration::from_secs(60),
            "its container refused for a GPU already held",
            |p| {
                waiting_messages(p)
                    .iter()
                    .any(|m| m.contains("already held by"))
            },
        )
        .await?;
    let message = waiting_messages(&refused).join(" | ");
    ensure!(
        shares.iter().any(|s| message.contains(s.as_str())),
        "bypass: the refusal does not name the Tessera pod holding the GPU: {message}"
    );
    ensure!(
        held.iter().any(|g| message.contains(g.as_str())),
        "bypass: the refusal does not name the GPU: {message}"
    );
    ensure!(
        refused
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .is_some_and(|cs| cs.iter().all(|c| c.container_id.is_none())),
        "bypass: a container was created"
    );
    cluster.delete_pod("bypass").await?;
    for name in &shares {
        cluster.delete_pod(name).await?;
    }
    Ok(())
}

/// Pods written for another GPU system name its scheduler: kube-scheduler serves
/// those names as profiles calling Tessera's extender (deploy/'s configuration), so
/// each is placed with its grant instead of staying Pending with no event.
pub async fn other_systems_scheduler_names_are_served(cluster: &mut Cluster) -> anyhow::Result<()> {
    let cases = [
        (
            "koord-pod",
            "koord-scheduler",
            json!({"koordinator.sh/gpu": "25"}),
        ),
        (
            "volcano-pod",
            "volcano",
            json!({"volcano.sh/gpu-memory": "1024"}),
        ),
        (
            "kubeshare-pod",
            "kubeshare-scheduler",
            json!({"koordinator.sh/gpu-core": "30", "koordinator.sh/gpu-memory": "1Gi"}),
        ),
        (
            "hami-pod",
            "hami-scheduler",
            json!({"nvidia.com/gpumem": "2048", "nvidia.com/gpucores": "20"}),
        ),
    ];
    for (name, scheduler, limits) in &cases {
        let mut spec = pod(name, &[("main", limits.clone())], &[]);
        spec["spec"]["schedulerName"] = json!(scheduler);
        cluster.create_pod("admin", &spec).await?;
    }
    for (name, scheduler, _) in &cases {
        let running = cluster.wait_running(name).await.map_err(|e| {
            anyhow::anyhow!("pod {name} (schedulerName {scheduler}) not placed: {e:#}")
        })?;
        let gpus = allocated_gpus(&running)?;
        ensure!(
            gpus.len() == 1,
            "pod {name} (schedulerName {scheduler}): granted {gpus:?}, want one GPU"
        );
    }
    for (name, _, _) in &cases {
        cluster.delete_pod(name).await?;
    }
    Ok(())
}

/// A tenant cannot mount the node files the GPU promise rests on: kubelet's
/// device checkpoint (which the GPU hook trusts for device-plugin grants),
/// Tessera's node directories, the CDI specs of enforcement hooks, or a directory
/// above one of them. Another hostPath is not the policy's business.
pub async fn tenant_host_paths_to_node_files_are_refused(
    cluster: &mut Cluster,
) -> anyhow::Result<()> {
    let with_host_path = |name: &str, path: &str| {
        let mut spec = pod(name, &[("main", json!({}))], &[]);
        spec["spec"]["volumes"] = json!([{"name": "host", "hostPath": {"path": path}}]);
        spec["spec"]["containers"][0]["volumeMounts"] =
            json!([{"name": "host", "mountPath": "/host"}]);
        spec
    };
    for path in [
        "/var/lib/kubelet/device-plugins",
        "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint",
        "/var/lib/kubelet",
        "/var/lib/kubelet/",
        "/",
        "/etc/tessera",
        "/run",
        "/var/run/cdi",
        // ("/tmp/../var/lib/kubelet" the API server itself refuses: no `..` in a hostPath.)
    ] {
        match cluster
            .create_pod("tenant", &with_host_path("node-files", path))
            .await
        {
            Ok(_) => {
                cluster.delete_pod("node-files").await?;
                anyhow::bail!("a tenant created a pod mounting hostPath {path}");
            }
            Err(e) => {
                let text = format!("{e:#}");
                ensure!(
                    text.contains("reaches node files Tessera relies on"),
                    "hostPath {path}: refused, but not by the policy: {text}"
                );
            }
        }
    }
    // Elsewhere, the policy has nothing to say (Pod Security decides).
    cluster
        .create_pod("tenant", &with_host_path("other-files", "/srv/data"))
        .await?;
    cluster.delete_pod("other-files").await?;
    Ok(())
}

/// A pod asking for GPUs is placed by tessera-scheduler or not at all: in a
/// namespace that runs no other GPU scheduler, one naming its node, one naming a
/// scheduler no extender profile serves, and one tolerating the switch taint are
/// refused at creation (admission policy tessera-gpu-pods-scheduled), each with why;
/// the same pods without a GPU, and a GPU pod naming a served profile, are not.
pub async fn gpu_pods_that_would_skip_tessera_scheduler_are_refused(
    cluster: &mut Cluster,
) -> anyhow::Result<()> {
    const NS: &str = "strict";
    cluster.create_namespace(NS).await?;
    let gpu = json!({"koordinator.sh/gpu": "25"});
    let with = |name: &str, limits: &serde_json::Value, field: &str, value: serde_json::Value| {
        let mut spec = pod(name, &[("main", limits.clone())], &[]);
        spec["spec"][field] = value;
        spec
    };
    let refused = [
        (
            with(
                "by-node",
                &json!({"nvidia.com/gpu": "1"}),
                "nodeName",
                json!(NODE_NAME),
            ),
            "spec.nodeName",
        ),
        (
            with("by-other", &gpu, "schedulerName", json!("my-scheduler")),
            "never calls tessera-scheduler",
        ),
        (
            with(
                "tolerates-all",
                &gpu,
                "tolerations",
                json!([{"operator": "Exists"}]),
            ),
            "may not tolerate",
        ),
        (
            with(
                "tolerates-switch",
                &gpu,
                "tolerations",
                json!([{"key": "tessera.io/runtime-proxy", "operator": "Exists", "effect": "NoSchedule"}]),
            ),
            "may not tolerate",
        ),
    ];
    for (spec, want) in &refused {
        refused_at_creation(cluster, NS, spec, "tessera-gpu-pods-scheduled", want).await?;
    }
    // Without a GPU, or through a profile that calls the extender: admitted.
    for spec in [
        with("plain-by-node", &json!({}), "nodeName", json!(NODE_NAME)),
        with(
            "plain-tolerates",
            &json!({}),
            "tolerations",
            json!([{"operator": "Exists"}]),
        ),
        with("koord", &gpu, "schedulerName", json!("koord-scheduler")),
    ] {
        let name = spec["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        cluster
            .create_pod_in("admin", NS, &spec)
            .await
            .map_err(|e| anyhow::anyhow!("pod {name} refused: {e:#}"))?;
        if name == "koord" {
            // Kubernetes lets an update add tolerations: not this one.
            use kube::api::{Api, Patch, PatchParams};
            let pods: Api<k8s_openapi::api::core::v1::Pod> =
                Api::namespaced(cluster.client().await?, NS);
            let added = json!({"spec": {"tolerations": [{"key": "tessera.io/runtime-proxy",
                "operator": "Exists", "effect": "NoSchedule"}]}});
            let patched = pods
                .patch("koord", &PatchParams::default(), &Patch::Strategic(&added))
                .await;
            let text = format!("{patched:?}");
            ensure!(
                patched.is_err() && text.contains("may not tolerate"),
                "koord: an update adding the switch toleration was not refused: {text}"
            );
        }
        cluster.delete_pod_in(NS, &name).await?;
    }
    Ok(())
}

/// Node agents write only their own node (admission policy
/// tessera-node-agents-own-node): with the reporter's service-account token bound
/// to this node (as its pod's is), patching this node's Node, its status and its
/// Device CR is allowed, and the same on another node is Forbidden, naming both
/// nodes; the same account with a token bound to no node is Forbidden on any node.
/// The cluster's own reporter publishes with such a token throughout the suite.
pub async fn node_agents_write_only_their_own_node(cluster: &mut Cluster) -> anyhow::Result<()> {
    use k8s_openapi::api::core::v1::Node;
    use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
    use tessera_harness::cluster::{REPORTER_ACCOUNT, REPORTER_NAMESPACE, device_api};

    const OTHER: &str = "tcl-other-gpu-node";
    let admin = cluster.client().await?;
    let nodes: Api<Node> = Api::all(admin.clone());
    let other: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": OTHER, "labels": {"kubernetes.io/hostname": OTHER}}}))?;
    nodes.create(&PostParams::default(), &other).await?;
    let devices = device_api(&admin);
    let device: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "scheduling.koordinator.sh/v1alpha1", "kind": "Device",
        "metadata": {"name": OTHER}, "spec": {"devices": []}}))?;
    devices.create(&PostParams::default(), &device).await?;

    let outcome = async {
        let bound = cluster
            .node_bound_token(REPORTER_NAMESPACE, REPORTER_ACCOUNT, NODE_NAME)
            .await?;
        let reporter = cluster.client_with_token(&bound).await?;
        let label = Patch::Merge(json!({"metadata": {"labels": {"tessera.io/probe": "own-node"}}}));
        let params = PatchParams::default();
        let as_reporter_nodes: Api<Node> = Api::all(reporter.clone());
        let as_reporter_devices = device_api(&reporter);
        // Its own node: Node, status and Device CR.
        as_reporter_nodes.patch(NODE_NAME, &params, &label).await?;
        as_reporter_nodes
            .patch_status(NODE_NAME, &params, &Patch::Merge(json!({"status": {}})))
            .await?;
        as_reporter_devices
            .patch(NODE_NAME, &params, &label)
            .await?;
        // Another node: each write refused, naming both nodes.
        let refused = |what: &str, result: Result<(), kube::Error>| -> anyhow::Result<()> {
            let text = match result {
                Ok(()) => anyhow::bail!("{what}: allowed with a token bound to {NODE_NAME}"),
                Err(error) => format!("{error:#}"),
            };
            ensure!(
                text.contains("tessera-node-agents-own-node")
                    && text.contains(&format!("bound to node \"{NODE_NAME}\""))
                    && text.contains(OTHER),
                "{what}: refused, but not by the policy naming both nodes: {text}"
            );
            Ok(())
        };
        let untaint = Patch::Merge(json!({"spec": {"taints": null}}));
        refused(
            "patch another Node",
            as_reporter_nodes
                .patch(OTHER, &params, &untaint)
                .await
                .map(drop),
        )?;
        refused(
            "patch another Node's status",
            as_reporter_nodes
                .patch_status(
                    OTHER,
                    &params,
                    &Patch::Merge(
                        json!({"status": {"capacity": {"koordinator.sh/gpu-core": "800"}}}),
                    ),
                )
                .await
                .map(drop),
        )?;
        refused(
            "patch another node's Device CR",
            as_reporter_devices
                .patch(OTHER, &params, &label)
                .await
                .map(drop),
        )?;
        // The same account with a token bound to no node: refused everywhere.
        let unbound = cluster.client_as("reporter").await?;
        let text = match Api::<Node>::all(unbound)
            .patch(NODE_NAME, &params, &label)
            .await
        {
            Ok(_) => anyhow::bail!("a token bound to no node patched {NODE_NAME}"),
            Err(error) => format!("{error:#}"),
        };
        ensure!(
            text.contains("tessera-node-agents-own-node") && text.contains("bound to no node"),
            "unbound token: refused, but not as wanted: {text}"
        );
        Ok::<(), anyhow::Error>(())
    }
    .await;
    devices.delete(OTHER, &Default::default()).await?;
    nodes.delete(OTHER, &Default::default()).await?;
    let strip = Patch::Merge(json!({"metadata": {"labels": {"tessera.io/probe": null}}}));
    nodes
        .patch(NODE_NAME, &PatchParams::default(), &strip)
        .await?;
    devices
        .patch(NODE_NAME, &PatchParams::default(), &strip)
        .await?;
    outcome
}

/// GPU requests that can never be honoured are refused at creation (admission
/// policy tessera-gpu-requests), each message naming the pod, container, resource
/// and value in tessera-scheduler's words; valid requests in every system's names
/// are admitted.
pub async fn impossible_gpu_requests_are_refused_at_creation(
    cluster: &mut Cluster,
) -> anyhow::Result<()> {
    const NS: &str = "requests";
    cluster.create_namespace(NS).await?;
    let refused = [
        (
            "bad-multiple",
            json!({"koordinator.sh/gpu-core": "150", "koordinator.sh/gpu-memory-ratio": "50"}),
            "pod requests/bad-multiple: container main: koordinator.sh/gpu-core 150: values above 100 must be multiples of 100 (whole GPUs)",
        ),
        (
            "core-alone",
            json!({"koordinator.sh/gpu-core": "30"}),
            "pod requests/core-alone: container main: koordinator.sh/gpu-core 30 asks for GPU compute and no GPU memory: add koordinator.sh/gpu-memory or koordinator.sh/gpu-memory-ratio (Koordinator refuses koordinator.sh/gpu-core alone too), or ask koordinator.sh/gpu for both",
        ),
        (
            "whole-and-share",
            json!({"nvidia.com/gpu": "1", "koordinator.sh/gpu": "50"}),
            "pod requests/whole-and-share: container main: nvidia.com/gpu cannot be combined with koordinator.sh/* GPU resources",
        ),
        (
            // A HAMi name at 0 is unset: nvidia.com/gpu is whole GPUs again.
            "whole-hami-zero-and-share",
            json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "0", "koordinator.sh/gpu": "50"}),
            "pod requests/whole-hami-zero-and-share: container main: nvidia.com/gpu cannot be combined with koordinator.sh/* GPU resources",
        ),
        (
            "zero-share",
            json!({"koordinator.sh/gpu": "0"}),
            "pod requests/zero-share: container main: koordinator.sh/gpu 0 asks for no GPU: leave it out, or ask 1 to 100 (percent of one GPU) or a multiple of 100 (whole GPUs)",
        ),
    ];
    for (name, limits, want) in &refused {
        let spec = pod(name, &[("main", limits.clone())], &[]);
        refused_at_creation(cluster, NS, &spec, "tessera-gpu-requests", want).await?;
    }
    // Each system's own rules, refused in tessera-scheduler's words: the policy's
    // message is checked against the scheduler's request parser, not a copy of it.
    let systems = [
        (
            "koord-memory-twice",
            json!({"koordinator.sh/gpu-memory": "8Gi", "koordinator.sh/gpu-memory-ratio": "50"}),
        ),
        (
            "koord-gpu-and-memory",
            json!({"koordinator.sh/gpu": "50", "koordinator.sh/gpu-memory": "8Gi"}),
        ),
        (
            "hami-memory-twice",
            json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000", "nvidia.com/gpumem-percentage": "50"}),
        ),
        (
            "hami-cores-150",
            json!({"nvidia.com/gpu": "1", "nvidia.com/gpucores": "150"}),
        ),
        (
            "hami-percentage-150",
            json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "150"}),
        ),
        (
            "hami-and-koord",
            json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000", "koordinator.sh/gpu-core": "20"}),
        ),
        (
            "hami-and-volcano-number",
            json!({"nvidia.com/gpumem": "1000", "volcano.sh/gpu-number": "1"}),
        ),
        (
            "vgpu-and-koord",
            json!({"volcano.sh/vgpu-number": "1", "koordinator.sh/gpu-core": "20"}),
        ),
        (
            "vgpu-and-hami",
            json!({"volcano.sh/vgpu-memory": "1000", "nvidia.com/gpu": "1"}),
        ),
        ("vgpu-cores-alone", json!({"volcano.sh/vgpu-cores": "30"})),
        (
            "vgpu-memory-twice",
            json!({"volcano.sh/vgpu-number": "1", "volcano.sh/vgpu-memory": "1000", "volcano.sh/vgpu-memory-percentage": "50"}),
        ),
        (
            "vgpu-cores-150",
            json!({"volcano.sh/vgpu-number": "1", "volcano.sh/vgpu-cores": "150"}),
        ),
        (
            "shared-zero",
            json!({"koordinator.sh/gpu.shared": "0", "koordinator.sh/gpu-memory-ratio": "50"}),
        ),
        (
            "shared-and-gpu",
            json!({"koordinator.sh/gpu.shared": "2", "koordinator.sh/gpu": "100"}),
        ),
        (
            "shared-no-memory",
            json!({"koordinator.sh/gpu.shared": "2", "koordinator.sh/gpu-core": "100"}),
        ),
        (
            "shared-uneven",
            json!({"koordinator.sh/gpu.shared": "2", "koordinator.sh/gpu-core": "151", "koordinator.sh/gpu-memory-ratio": "100"}),
        ),
        (
            "shared-too-much",
            json!({"koordinator.sh/gpu.shared": "2", "koordinator.sh/gpu-core": "100", "koordinator.sh/gpu-memory-ratio": "300"}),
        ),
    ];
    for (name, limits) in &systems {
        let spec = pod(name, &[("main", limits.clone())], &[]);
        let typed: k8s_openapi::api::core::v1::Pod = serde_json::from_value(spec.clone())?;
        let parsed = tessera_api::request::pod_gpu_request(&typed, &Default::default());
        let Err(error) = parsed else {
            bail!("{name} ({limits}): tessera-scheduler's parser takes it: {parsed:?}");
        };
        let want = format!("pod {NS}/{name}: {error}");
        refused_at_creation(cluster, NS, &spec, "tessera-gpu-requests", &want).await?;
    }
    // Koordinator's v1.6 blog's spelling of gpu.shared: no node offers it, so the
    // pod would wait forever on "Insufficient …"; refused naming the name meant.
    let misspelled = pod(
        "gpu-shared",
        &[(
            "main",
            json!({"koordinator.sh/gpu-shared": "1", "koordinator.sh/gpu-memory-ratio": "50"}),
        )],
        &[],
    );
    refused_at_creation(
        cluster,
        NS,
        &misspelled,
        "tessera-deprecated-gpu-resources",
        "container main: koordinator.sh/gpu-shared 1: no such resource (Koordinator's v1.6 release notes spell it so; no node offers it, and the pod would wait forever): write koordinator.sh/gpu.shared: 1, the number of GPUs the share is spread over",
    )
    .await?;
    // Valid in each system's names: admitted (placed or not is the scheduler's).
    let admitted = [
        ("share", json!({"koordinator.sh/gpu": "25"})),
        (
            "two-whole",
            json!({"koordinator.sh/gpu-core": "200", "koordinator.sh/gpu-memory-ratio": "200"}),
        ),
        (
            "shared-count",
            json!({"koordinator.sh/gpu.shared": "2", "koordinator.sh/gpu-core": "150", "koordinator.sh/gpu-memory-ratio": "100"}),
        ),
        (
            "hami",
            json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000"}),
        ),
        (
            "hami-percentage",
            json!({"nvidia.com/gpu": "2", "nvidia.com/gpumem-percentage": "50", "nvidia.com/gpucores": "100"}),
        ),
        (
            "vgpu",
            json!({"volcano.sh/vgpu-number": "2", "volcano.sh/vgpu-memory": "3000", "volcano.sh/vgpu-cores": "50"}),
        ),
        (
            "vgpu-memory-alone",
            json!({"volcano.sh/vgpu-memory": "3000"}),
        ),
        (
            "shared-even",
            json!({"koordinator.sh/gpu.shared": "2", "koordinator.sh/gpu-core": "100", "koordinator.sh/gpu-memory": "16Gi"}),
        ),
        (
            "core-and-memory",
            json!({"koordinator.sh/gpu-core": "30", "koordinator.sh/gpu-memory": "1Gi"}),
        ),
        ("no-gpu", json!({})),
    ];
    for (name, limits) in &admitted {
        cluster
            .create_pod_in("admin", NS, &pod(name, &[("main", limits.clone())], &[]))
            .await
            .map_err(|e| anyhow::anyhow!("pod {name} ({limits}) refused: {e:#}"))?;
        cluster.delete_pod_in(NS, name).await?;
    }
    Ok(())
}

/// Creating `spec` in `namespace` as the admin is refused by admission policy
/// `policy` with a message containing `want`; a pod created anyway is deleted
/// and fails the test.
async fn refused_at_creation(
    cluster: &mut Cluster,
    namespace: &str,
    spec: &serde_json::Value,
    policy: &str,
    want: &str,
) -> anyhow::Result<()> {
    cluster
        .expect_refused("admin", namespace, spec, &[policy, want])
        .await
}

/// A namespace's sharing groups hold at most their allowance of GPUs (this
/// cluster's tessera-scheduler runs with `--max-group-gpus-per-namespace=2`):
/// through the real kube-scheduler a third one-pod group of 1 % waits, with the
/// reason in its FailedScheduling Event, while GPUs sit idle, and runs once one
/// of the namespace's groups ends.
pub async fn sharing_groups_hold_no_more_gpus_than_their_namespaces_allowance(
    cluster: &mut Cluster,
) -> anyhow::Result<()> {
    const NAMESPACE: &str = "groups";
    cluster.create_namespace(NAMESPACE).await?;
    let member = |name: &str| {
        let mut spec = pod(
            name,
            &[(
                "main",
                json!({"koordinator.sh/gpu-core": "1", "koordinator.sh/gpu-memory-ratio": "1"}),
            )],
            &[],
        );
        spec["metadata"]["annotations"] = json!({"tessera.io/sharing-group": name});
        spec
    };
    let running = |p: &k8s_openapi::api::core::v1::Pod| {
        p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
    };
    let mut gpus = Vec::new();
    for name in ["g1", "g2"] {
        cluster
            .create_pod_in("admin", NAMESPACE, &member(name))
            .await?;
        let pod = cluster
            .wait_pod_in(NAMESPACE, name, Duration::from_secs(90), "Running", running)
            .await?;
        gpus.push(allocated_gpus(&pod)?[0].0.clone());
    }
    ensure!(
        gpus[0] != gpus[1],
        "sharing groups g1 and g2 share GPU {}: each group takes its own",
        gpus[0]
    );
    cluster
        .create_pod_in("admin", NAMESPACE, &member("g3"))
        .await?;
    let want = "sharing group \"groups/g3\" is new, and the sharing groups of namespace \"groups\" already hold 2 GPUs";
    cluster
        .wait_events_in(NAMESPACE, "g3", &[want], Duration::from_secs(30))
        .await?;
    let pods: kube::Api<k8s_openapi::api::core::v1::Pod> =
        kube::Api::namespaced(cluster.client().await?, NAMESPACE);
    let g3 = pods.get("g3").await?;
    ensure!(
        g3.spec
            .as_ref()
            .and_then(|s| s.node_name.as_ref())
            .is_none(),
        "g3 was bound past its namespace's allowance"
    );
    // g1's group ends: g3's may take a GPU.
    cluster.delete_pod_in(NAMESPACE, "g1").await?;
    cluster
        .wait_pod_in(NAMESPACE, "g3", Duration::from_secs(90), "Running", running)
        .await?;
    for name in ["g2", "g3"] {
        cluster.delete_pod_in(NAMESPACE, name).await?;
    }
    Ok(())
}

/// The policy the chart installs with `admissionPolicy.tenantPodSecurity=true`.
const TENANT_POD_SECURITY: &str = "tessera-tenant-pod-security";

/// Whether `tessera-tenant-pod-security` is installed (the chart suite's values).
pub async fn tenant_pod_security_installed(cluster: &Cluster) -> anyhow::Result<bool> {
    use k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicy;
    let policies: kube::Api<ValidatingAdmissionPolicy> = kube::Api::all(cluster.client().await?);
    Ok(policies.get_opt(TENANT_POD_SECURITY).await?.is_some())
}

/// The chart's `tessera-tenant-pod-security` documents, rendered with it on
/// (`python3 scripts/chart.py render`), for a cluster whose install left it off.
fn rendered_tenant_pod_security() -> anyhow::Result<Vec<serde_json::Value>> {
    let docs: Vec<serde_json::Value> =
        super::rendered_chart(&["--set", "admissionPolicy.tenantPodSecurity=true"])?
            .into_iter()
            .filter(|doc| doc["metadata"]["name"] == TENANT_POD_SECURITY)
            .collect();
    ensure!(
        docs.len() == 2,
        "the chart rendered {} documents named {TENANT_POD_SECURITY}, want the policy and its binding",
        docs.len()
    );
    Ok(docs)
}

/// With `admissionPolicy.tenantPodSecurity` on, a tenant's pod is held to what of
/// Pod Security "baseline" the GPU grant rests on: a privileged container (init
/// and ephemeral ones too), a capability beyond baseline's, the host's network,
/// PID or IPC namespace, and any hostPath are refused at creation naming the
/// container or field; baseline's own capabilities and plain pods are admitted,
/// and so are privileged pods in namespaces an administrator exempted. The chart
/// suite installs it; the main suite applies the chart's rendering for this
/// scenario alone.
pub async fn tenant_pods_are_held_to_pod_security_where_the_chart_enforces_it(
    cluster: &mut Cluster,
) -> anyhow::Result<()> {
    let applied = if tenant_pod_security_installed(cluster).await? {
        Vec::new()
    } else {
        // A pod made before the policy, whose later updates it must not judge.
        cluster.create_namespace(BASELINE_NS).await?;
        let mut before = pod("before-policy", &[("main", json!({}))], &[]);
        before["spec"]["containers"][0]["securityContext"] = json!({"privileged": true});
        cluster.create_pod_in("admin", BASELINE_NS, &before).await?;
        let docs = rendered_tenant_pod_security()?;
        for doc in &docs {
            cluster.apply(doc).await?;
        }
        docs
    };
    let outcome = pod_security_cases(cluster, !applied.is_empty()).await;
    let mut cleanup = Vec::new();
    for doc in &applied {
        use k8s_openapi::api::admissionregistration::v1::{
            ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
        };
        let client = cluster.client().await?;
        let deleted = if doc["kind"] == "ValidatingAdmissionPolicy" {
            kube::Api::<ValidatingAdmissionPolicy>::all(client)
                .delete(TENANT_POD_SECURITY, &Default::default())
                .await
                .map(drop)
        } else {
            kube::Api::<ValidatingAdmissionPolicyBinding>::all(client)
                .delete(TENANT_POD_SECURITY, &Default::default())
                .await
                .map(drop)
        };
        if let Err(e) = deleted {
            cleanup.push(format!("{}: {e}", doc["kind"]));
        }
    }
    outcome?;
    ensure!(
        cleanup.is_empty(),
        "removing the policy applied for this scenario: {cleanup:?}"
    );
    Ok(())
}

/// The namespace the policy scenario's tenant pods are made in.
const BASELINE_NS: &str = "baseline-tenant";

async fn pod_security_cases(cluster: &mut Cluster, made_before: bool) -> anyhow::Result<()> {
    const NS: &str = BASELINE_NS;
    const EXEMPT: &str = "privileged-agents";
    const AGENTS: &str = "labelled-agents";
    for ns in [NS, EXEMPT, AGENTS] {
        cluster.create_namespace(ns).await?;
    }
    cluster
        .label_namespace(EXEMPT, "pod-security.kubernetes.io/enforce", "privileged")
        .await?;
    cluster
        .label_namespace(AGENTS, "tessera.io/node-agents", "true")
        .await?;
    // The policy's binding reaches the API server's admission a moment after it is
    // written: wait until a privileged pod is refused by it, or 30 s.
    let privileged = |name: &str, container: &str| {
        let mut spec = pod(name, &[("main", json!({}))], &[]);
        if container == "setup" {
            let mut init = spec["spec"]["containers"][0].clone();
            init["name"] = json!("setup");
            init["securityContext"] = json!({"privileged": true});
            spec["spec"]["initContainers"] = json!([init]);
        } else {
            spec["spec"]["containers"][0]["securityContext"] = json!({"privileged": true});
        }
        spec
    };
    let started = std::time::Instant::now();
    loop {
        match cluster
            .expect_refused(
                "admin",
                NS,
                &privileged("privileged-main", "main"),
                &[TENANT_POD_SECURITY],
            )
            .await
        {
            Ok(()) => break,
            Err(e) if started.elapsed() < Duration::from_secs(30) => {
                tracing::debug!(error = %e, "policy not in force yet");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(e.context("30 s after the policy was applied")),
        }
    }
    let with = |name: &str, field: &str, value: serde_json::Value| {
        let mut spec = pod(name, &[("main", json!({}))], &[]);
        spec["spec"][field] = value;
        spec
    };
    let with_caps = |name: &str, caps: serde_json::Value| {
        let mut spec = pod(name, &[("main", json!({}))], &[]);
        spec["spec"]["containers"][0]["securityContext"] = json!({"capabilities": {"add": caps}});
        spec
    };
    let mut host_path = pod("host-path", &[("main", json!({}))], &[]);
    host_path["spec"]["volumes"] =
        json!([{"name": "containerd", "hostPath": {"path": "/run/containerd"}}]);
    host_path["spec"]["containers"][0]["volumeMounts"] =
        json!([{"name": "containerd", "mountPath": "/host"}]);
    let mut both = with("host-pid-ipc", "hostPID", json!(true));
    both["spec"]["hostIPC"] = json!(true);
    let refused = [
        (
            privileged("privileged-main", "main"),
            "container main: securityContext.privileged",
        ),
        (
            privileged("privileged-init", "setup"),
            "container setup: securityContext.privileged",
        ),
        (
            with_caps("caps", json!(["NET_BIND_SERVICE", "CAP_SYS_ADMIN"])),
            "container main: securityContext.capabilities.add goes beyond Pod Security baseline",
        ),
        // containerd reads a capability as CAP_ + its upper case: so does the policy.
        (
            with_caps("caps-lower", json!(["sys_ptrace"])),
            "container main: securityContext.capabilities.add goes beyond Pod Security baseline",
        ),
        (
            with_caps("caps-all", json!(["ALL"])),
            "container main: securityContext.capabilities.add goes beyond Pod Security baseline",
        ),
        (
            with("host-network", "hostNetwork", json!(true)),
            "spec.hostNetwork: a tenant pod may not share the host's namespaces",
        ),
        (both, "spec.hostPID, spec.hostIPC: a tenant pod may not"),
        (
            host_path,
            "hostPath volume containerd (/run/containerd): a tenant pod may not mount node files",
        ),
    ];
    for (spec, want) in &refused {
        cluster
            .expect_refused("admin", NS, spec, &[TENANT_POD_SECURITY, want])
            .await?;
    }
    // A pod made before the policy: a label change (or a finalizer's removal) is
    // not refused for what it was made with.
    if made_before {
        let pods: kube::Api<k8s_openapi::api::core::v1::Pod> =
            kube::Api::namespaced(cluster.client().await?, NS);
        pods.patch(
            "before-policy",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"metadata": {"labels": {"relabelled": "yes"}}})),
        )
        .await
        .map_err(|e| anyhow::anyhow!("relabelling a pod made before the policy: {e}"))?;
        cluster.delete_pod_in(NS, "before-policy").await?;
    }
    // Baseline's own capabilities, in either spelling, and a plain pod: admitted.
    let mut plain = pod("plain", &[("main", json!({}))], &[]);
    plain["spec"]["containers"][0]["securityContext"] =
        json!({"capabilities": {"add": ["NET_BIND_SERVICE", "CAP_CHOWN"]}});
    cluster.create_pod_in("admin", NS, &plain).await?;
    // A privileged ephemeral container (`kubectl debug --profile sysadmin`) added to it.
    let pods: kube::Api<k8s_openapi::api::core::v1::Pod> =
        kube::Api::namespaced(cluster.client().await?, NS);
    let debug = json!({"spec": {"ephemeralContainers": [{
        "name": "debugger",
        "image": plain["spec"]["containers"][0]["image"],
        "securityContext": {"privileged": true},
    }]}});
    let added = pods
        .patch_ephemeral_containers(
            "plain",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Strategic(debug),
        )
        .await;
    cluster.delete_pod_in(NS, "plain").await?;
    match added {
        Ok(_) => anyhow::bail!("a privileged ephemeral container was added to {NS}/plain"),
        Err(e) => {
            let text = e.to_string();
            ensure!(
                text.contains(TENANT_POD_SECURITY)
                    && text.contains("container debugger: securityContext.privileged"),
                "the privileged ephemeral container was refused, but not by the policy: {text}"
            );
        }
    }
    // Namespaces an administrator exempted, and the node agents' (kube-system is
    // among admissionPolicy.nodeAgentNamespaces): admitted.
    for ns in [EXEMPT, AGENTS, "kube-system"] {
        cluster
            .create_pod_in("admin", ns, &privileged("agent", "main"))
            .await?;
        cluster.delete_pod_in(ns, "agent").await?;
    }
    Ok(())
}
