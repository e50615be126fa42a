//! NVLink peers end to end: fake NVML → tessera-reporter → the Device CR
//! annotation `tessera.io/nvlink-peers` → tessera-scheduler's model → the real
//! kube-scheduler's bind → the container's OCI spec.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use serde_json::{Value, json};
use tessera_harness::cluster::{Cluster, NODE_NAME, allocated_gpus, device_api, probe_pod};
use tessera_harness::fake_nvml::pair_nvlinks;

/// NVLinks that cross the node's PCIe switches ({0,1} and {2,3}, also its NUMA
/// nodes): only the NVLink tier can make a 2-GPU pick other than a switch pair.
const CROSSED: [[u32; 2]; 2] = [[0, 2], [1, 3]];

const SHARE: &str = "topo-share";
const PAIR: &str = "topo-pair";

/// With GPU x partly used, a pod asking two whole GPUs (`koordinator.sh/gpu: 200`)
/// gets the NVLink pair that leaves x out, not the PCIe switch pair (which the
/// tier below NVLink, or a pick by minor, would give). The node's default NVLinks
/// are restored afterwards, so the other scenarios see the node they expect.
pub(super) async fn two_gpu_pod_lands_on_an_nvlink_pair(
    cluster: &mut Cluster,
) -> anyhow::Result<()> {
    cluster.set_nvlinks(&CROSSED).await?;
    let outcome = match wait_for_links(cluster, &CROSSED).await {
        Ok(()) => place_on_nvlink_pair(cluster).await,
        Err(e) => Err(e),
    };
    for name in [PAIR, SHARE] {
        if let Err(e) = cluster.delete_pod(name).await {
            tracing::debug!(name, error = %e, "not deleted");
        }
    }
    let default = pair_nvlinks(u32::try_from(cluster.gpu_node.gpus.len())?);
    cluster.set_nvlinks(&default).await?;
    wait_for_links(cluster, &default).await?;
    outcome
}

async fn place_on_nvlink_pair(cluster: &mut Cluster) -> anyhow::Result<()> {
    cluster
        .create_pod(
            "admin",
            &probe_pod(SHARE, &[("main", json!({"koordinator.sh/gpu": "25"}))], &[]),
        )
        .await?;
    let share = cluster.wait_running(SHARE).await?;
    let shared = allocated_gpus(&share)?;
    ensure!(
        shared.len() == 1,
        "pod {SHARE} granted {shared:?}, want one GPU"
    );
    let busy = shared[0].1;

    cluster
        .create_pod(
            "admin",
            &probe_pod(PAIR, &[("main", json!({"koordinator.sh/gpu": "200"}))], &[]),
        )
        .await?;
    let pair = cluster.wait_running(PAIR).await?;
    let gpus = allocated_gpus(&pair)?;
    let minors: BTreeSet<u64> = gpus.iter().map(|(_, minor)| *minor).collect();
    let nvlinked = CROSSED
        .iter()
        .map(|[a, b]| BTreeSet::from([u64::from(*a), u64::from(*b)]))
        .find(|link| !link.contains(&busy))
        .context("every NVLink pair holds the shared GPU")?;
    // The PCIe switch pair of the three free GPUs: what the pick would be without NVLink.
    let switch_pair: BTreeSet<u64> = [0u64, 1, 2, 3]
        .into_iter()
        .filter(|m| m / 2 != busy / 2)
        .collect();
    ensure!(
        gpus.len() == 2 && minors == nvlinked,
        "pod {PAIR} granted minors {minors:?} while GPU {busy} holds a share; want the NVLink pair {nvlinked:?} (NVLinks {CROSSED:?}), not the PCIe switch pair {switch_pair:?}"
    );
    let specs = cluster.container_specs(&pair)?;
    let spec = specs.get("main").context("no spec for main")?;
    super::assert_grant(PAIR, "main", spec, &gpus)
}

/// Waits until the Device CR's NVLink annotation names exactly `links` (both ways).
async fn wait_for_links(cluster: &Cluster, links: &[[u32; 2]]) -> anyhow::Result<()> {
    let uuid = |minor: u32| {
        cluster
            .gpu_node
            .gpus
            .iter()
            .find(|g| g.minor == minor)
            .map(|g| g.uuid.clone())
            .with_context(|| format!("no fake GPU of minor {minor}"))
    };
    let mut want: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for [a, b] in links {
        want.entry(uuid(*a)?).or_default().insert(uuid(*b)?);
        want.entry(uuid(*b)?).or_default().insert(uuid(*a)?);
    }
    let want = serde_json::to_value(&want)?;
    let devices = device_api(&cluster.client().await?);
    let started = Instant::now();
    loop {
        let device = devices.get(NODE_NAME).await?;
        let have: Option<Value> = device
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("tessera.io/nvlink-peers"))
            .and_then(|text| serde_json::from_str(text).ok());
        if have.as_ref() == Some(&want) {
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(60) {
            bail!(
                "Device {NODE_NAME}: tessera.io/nvlink-peers is {have:?} after 60 s, want {want}"
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
