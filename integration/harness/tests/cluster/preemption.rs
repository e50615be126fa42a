//! Preemption of GPU shares through the real kube-scheduler: its dry run counts
//! the aggregate `koordinator.sh/gpu-core` / `gpu-memory-ratio` (deploy/'s
//! configuration no longer ignores them), tessera-scheduler's `preempt` verb keeps
//! only the victims on the GPU the preemptor gets, kube-scheduler evicts them, and
//! the preemptor runs with its grant in its OCI spec.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::Api;
use serde_json::{Value, json};
use tessera_harness::cluster::{Cluster, allocated_gpus, probe_pod};

const LOW: &str = "tessera-preemption-low";
const HIGH: &str = "tessera-preemption-high";
const URGENT: &str = "preempt-urgent";

/// Half a GPU, in the names kube-scheduler counts.
fn half() -> Value {
    json!({"koordinator.sh/gpu-core": "50", "koordinator.sh/gpu-memory-ratio": "50"})
}

/// Pod `name` of priority class `class` asking `limits`; it stops at once when
/// evicted (the probe does not wait for SIGTERM's grace period).
fn pod_of(name: &str, class: &str, limits: Value) -> Value {
    let mut pod = probe_pod(name, &[("main", limits)], &[]);
    pod["spec"]["priorityClassName"] = json!(class);
    pod["spec"]["terminationGracePeriodSeconds"] = json!(1);
    pod
}

/// Every GPU of the 4-GPU node is full: GPU x holds two low-priority half-GPU pods,
/// each other GPU one low-priority and one high-priority half. kube-scheduler's
/// dry run alone, on the sum (400 of 400 used, 100 needed), reprieves the oldest
/// low pods and evicts the two newest — on two other GPUs, which frees no whole
/// GPU. A high-priority pod asking a whole GPU must evict exactly the two pods of
/// GPU x (the only GPU it can get: the others keep a pod of its own priority), no
/// other pod, and then run on GPU x with its grant.
pub(super) async fn only_the_pods_on_the_gpu_the_preemptor_gets_are_evicted(
    cluster: &mut Cluster,
) -> anyhow::Result<()> {
    for (name, value) in [(LOW, 1000), (HIGH, 100_000)] {
        cluster
            .apply(
                &json!({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                "metadata": {"name": name}, "value": value,
                "description": "tessera cluster tier: preemption scenario"}),
            )
            .await?;
    }
    let mut names = Vec::new();
    let outcome = preempt(cluster, &mut names).await;
    names.push(URGENT.to_owned());
    for name in &names {
        if let Err(e) = cluster.delete_pod(name).await {
            tracing::debug!(name, error = %e, "not deleted");
        }
    }
    let classes: Api<PriorityClass> = Api::all(cluster.client().await?);
    for name in [LOW, HIGH] {
        if let Err(e) = classes.delete(name, &Default::default()).await {
            tracing::debug!(name, error = %e, "PriorityClass not deleted");
        }
    }
    outcome
}

async fn preempt(cluster: &mut Cluster, names: &mut Vec<String>) -> anyhow::Result<()> {
    let gpus = cluster.gpu_node.gpus.len();
    ensure!(
        gpus >= 2,
        "the node has {gpus} GPU(s), the scenario needs 2 or more"
    );
    // One at a time, each Running before the next: binpack fills GPU x with the
    // two low pods, then each other GPU with a high and a low pod.
    let mut plan = vec![
        ("preempt-x-1".to_owned(), LOW),
        ("preempt-x-2".to_owned(), LOW),
    ];
    for i in 1..gpus {
        plan.push((format!("preempt-keep-{i}"), HIGH));
        plan.push((format!("preempt-low-{i}"), LOW));
    }
    let mut placed: BTreeMap<String, (String, u64)> = BTreeMap::new();
    for (name, class) in &plan {
        names.push(name.clone());
        cluster
            .create_pod("admin", &pod_of(name, class, half()))
            .await?;
        let pod = cluster.wait_running(name).await?;
        let granted = allocated_gpus(&pod)?;
        ensure!(
            granted.len() == 1,
            "pod {name}: granted {granted:?}, want one GPU"
        );
        placed.insert(name.clone(), granted[0].clone());
    }
    let x = placed["preempt-x-1"].clone();
    ensure!(
        placed["preempt-x-2"] == x,
        "the two low pods did not share one GPU: {placed:?}"
    );
    for i in 1..gpus {
        let (keep, low) = (
            &placed[&format!("preempt-keep-{i}")],
            &placed[&format!("preempt-low-{i}")],
        );
        ensure!(
            keep == low && *keep != x,
            "GPU {i}'s pair is not on one GPU other than {x:?}: {placed:?}"
        );
    }
    let pods: Api<Pod> = Api::namespaced(cluster.client().await?, "default");
    let uids: BTreeMap<String, String> = {
        let mut uids = BTreeMap::new();
        for name in placed.keys() {
            let pod = pods.get(name).await?;
            uids.insert(name.clone(), pod.metadata.uid.unwrap_or_default());
        }
        uids
    };

    cluster
        .create_pod(
            "admin",
            &pod_of(
                URGENT,
                HIGH,
                json!({"koordinator.sh/gpu-core": "100", "koordinator.sh/gpu-memory-ratio": "100"}),
            ),
        )
        .await?;
    let urgent = cluster
        .wait_pod(
            URGENT,
            Duration::from_secs(120),
            "Running",
            tessera_harness::cluster::is_running,
        )
        .await?;

    // The two pods of GPU x were evicted; every other pod runs untouched.
    let started = Instant::now();
    loop {
        let mut gone = Vec::new();
        let mut left = Vec::new();
        for name in placed.keys() {
            match pods.get_opt(name).await? {
                Some(pod)
                    if pod.metadata.deletion_timestamp.is_none()
                        && pod.metadata.uid.as_ref() == uids.get(name) =>
                {
                    left.push(name.clone())
                }
                _ => gone.push(name.clone()),
            }
        }
        let want_gone = vec!["preempt-x-1".to_owned(), "preempt-x-2".to_owned()];
        if gone == want_gone {
            break;
        }
        if gone.iter().any(|name| !want_gone.contains(name))
            || started.elapsed() > Duration::from_secs(30)
        {
            bail!(
                "evicted {gone:?}, want exactly {want_gone:?} (the pods of GPU {x:?}); still running {left:?}; {URGENT}'s events: {}",
                cluster
                    .events_of(URGENT)
                    .await
                    .unwrap_or_default()
                    .join(" | ")
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    for (name, _) in placed
        .iter()
        .filter(|(name, _)| !name.starts_with("preempt-x-"))
    {
        let pod = pods.get(name).await?;
        ensure!(
            tessera_harness::cluster::is_running(&pod),
            "pod {name} is not running after the preemption"
        );
    }

    let granted = allocated_gpus(&urgent)?;
    ensure!(
        granted == [x.clone()],
        "pod {URGENT}: granted {granted:?}, want the GPU its victims left, {x:?}"
    );
    let specs = cluster.container_specs(&urgent)?;
    let spec = specs.get("main").context("no spec for main")?;
    super::assert_grant(URGENT, "main", spec, &granted)
}
