//! What tessera-scheduler tells about a placement, on the real cluster: a fractional
//! pod that the real kube-scheduler places through the extender gets a `GpuAllocated`
//! Event naming the GPU of its allocation annotation, and tessera-scheduler's metrics
//! endpoint counts the bind and shows the node's allocated share grow by the pod's
//! share (and shrink back once the pod is gone).

use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use serde_json::json;
use tessera_harness::cluster::{ALLOCATED, Cluster, NODE_NAME, allocated_gpus};
use tessera_harness::monitoring::sample;

/// `GET /metrics` of tessera-scheduler: the response head and body.
async fn scrape(cluster: &Cluster) -> anyhow::Result<(String, String)> {
    tessera_harness::monitoring::scrape(&cluster.scheduler_metrics_addr()).await
}

const BOUND: &str = "tessera_scheduler_binds_total{result=\"bound\"}";

fn allocated_series() -> String {
    format!("tessera_scheduler_node_gpu_core_allocated_percent{{node=\"{NODE_NAME}\"}}")
}

/// Polls the metrics until `check` accepts them (10 s), returning the last body.
async fn scrape_until(
    cluster: &Cluster,
    what: &str,
    check: impl Fn(&str) -> bool,
) -> anyhow::Result<String> {
    let started = Instant::now();
    loop {
        let (_, body) = scrape(cluster).await?;
        if check(&body) {
            return Ok(body);
        }
        if started.elapsed() > Duration::from_secs(10) {
            bail!("tessera-scheduler's metrics: not {what} after 10 s:\n{body}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

pub(super) async fn gpu_allocated_event_and_metrics(cluster: &mut Cluster) -> anyhow::Result<()> {
    let name = "observed-half";
    let (head, before) = scrape(cluster).await?;
    ensure!(
        head.lines().any(|l| l.eq_ignore_ascii_case(
            "content-type: application/openmetrics-text; version=1.0.0; charset=utf-8"
        )),
        "tessera-scheduler's metrics: not OpenMetrics: {head}"
    );
    for line in [
        "tessera_scheduler_leader 1\n",
        "tessera_scheduler_cache_synced 1\n",
    ] {
        ensure!(
            before.contains(line),
            "tessera-scheduler's metrics lack {line:?}:\n{before}"
        );
    }
    let bound_before = sample(&before, BOUND).unwrap_or(0.0);
    let allocated_before = sample(&before, &allocated_series())
        .with_context(|| format!("no {} in:\n{before}", allocated_series()))?;

    super::create_one(cluster, name, json!({"koordinator.sh/gpu": "50"})).await?;
    let pod = cluster
        .wait_pod(
            name,
            Duration::from_secs(60),
            "bound with its allocation",
            |pod| {
                let bound = pod
                    .spec
                    .as_ref()
                    .and_then(|s| s.node_name.as_ref())
                    .is_some();
                let annotated = pod
                    .metadata
                    .annotations
                    .as_ref()
                    .is_some_and(|a| a.contains_key(ALLOCATED));
                bound && annotated
            },
        )
        .await?;
    let gpus = allocated_gpus(&pod)?;
    ensure!(
        gpus.len() == 1,
        "pod {name}: granted {gpus:?}, want one GPU"
    );
    let uuid = &gpus[0].0;

    // The Event names the GPU of the annotation, and the share.
    let want = format!("GpuAllocated: placed on GPU {uuid} (50% compute, ");
    let started = Instant::now();
    loop {
        let events = cluster.events_of(name).await?;
        if let Some(event) = events.iter().find(|e| e.starts_with(&want)) {
            ensure!(
                event.ends_with(&format!(" on node {NODE_NAME}")),
                "pod {name}: Event {event:?} does not name node {NODE_NAME}"
            );
            tracing::info!(event, "tessera-scheduler's Event");
            break;
        }
        if started.elapsed() > Duration::from_secs(30) {
            bail!("pod {name}: no Event starting {want:?} after 30 s; events: {events:?}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    // The bind is counted and the node's share grows by the pod's.
    let series = allocated_series();
    let after = scrape_until(cluster, "showing the bind and the share", |body| {
        sample(body, BOUND) == Some(bound_before + 1.0)
            && sample(body, &series) == Some(allocated_before + 50.0)
    })
    .await?;
    ensure!(
        after.contains(
            "tessera_scheduler_events_total{reason=\"GpuAllocated\",outcome=\"recorded\"}"
        ),
        "the Event is not counted:\n{after}"
    );

    // Gone with the pod.
    cluster.delete_pod(name).await?;
    scrape_until(cluster, "back to the share before the pod", |body| {
        sample(body, &series) == Some(allocated_before)
    })
    .await?;
    Ok(())
}
