//! The scheduler's fault cases on the real cluster, each with a real component
//! misbehaving: two replicas, a slow `pods/binding` (a real admission webhook that
//! sleeps), a leader SIGKILLed while its Bindings wait on that webhook, the API
//! server restarted during a burst (every watch breaks and relists), and
//! tessera-scheduler restarted during a burst.
//!
//! After each, [`check_books`]: every Running pod carries an allocation annotation
//! and its containers hold exactly the GPUs it names, and no GPU's booked compute
//! (summed over every annotation) exceeds 100. Each burst but the slow-binding one
//! (which leaves one share free, see there) fills the GPUs to their last share, so
//! a double booking shows either as a GPU over 100 or as a pod left Pending.
//! docs/fault-proofs.md lists, per scenario, the protection it proves and the
//! mutation of the scheduler that makes it fail.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{DeleteParams, ListParams};
use serde_json::{Value, json};
use tessera_harness::cluster::{
    ALLOCATED, Cluster, Component, EXTENDER_PORT, EXTENDER_REPLICA_PORT, allocated_gpus, is_running,
};
use tessera_harness::webhook::SlowWebhook;

use super::{assert_grant, create_one};

/// The first replica's identity (the harness's `--identity`).
const FIRST: &str = "tessera-scheduler-0";
/// The second replica's.
const SECOND: &str = "tessera-scheduler-1";
/// Where the slow webhook listens.
const WEBHOOK_PORT: u16 = 18943;
const WEBHOOK_NAME: &str = "tessera-harness-slow-binding";

// === scenarios ===

/// Two replicas, kube-scheduler talking to the follower: its filter and prioritize
/// come from the follower's cache, its binds are handed to the leader. A burst that
/// fills every GPU is placed whole, nothing double-booked.
pub async fn two_replicas(cluster: &mut Cluster) -> anyhow::Result<()> {
    let names = pod_names("replicas", 8);
    start_second_replica(cluster).await?;
    let outcome = async {
        call_follower(cluster).await?;
        burst(cluster, &names, 50).await?;
        settle(cluster, &names, Duration::from_secs(120)).await?;
        check_books(cluster, &names).await?;
        ensure_leader(cluster, FIRST, "the Lease changed hands during the burst").await?;
        bound_by_leader(cluster, &names)
    }
    .await;
    clean_up(
        cluster,
        &names,
        outcome,
        Replicas::Two { first_died: false },
    )
    .await
}

/// Every Binding waits 7 to 9 s on a real validating webhook: kube-scheduler's
/// 5 s `httpTimeout` runs out on every bind and, after its 1 s backoff, it retries
/// the bind while the first still runs. Each retry joins the running bind (one bind
/// per pod UID): the webhook reviews one Binding per pod. A second wave arrives
/// while the first wave's Bindings are held, seconds after they were reserved: the
/// first wave's GPUs stay reserved in flight until their Bindings land, so the
/// second wave takes the other GPUs. Seven pods leave one share free, so a bind
/// that ran twice would find room and be seen (a full node refuses it before it
/// writes). Every pod runs with exactly its annotation's GPUs, none over 100%.
pub async fn slow_binding(cluster: &mut Cluster) -> anyhow::Result<()> {
    let webhook = install_webhook(cluster, "slow-binding", 7..9).await?;
    let (first, second) = (pod_names("slowbind", 4), pod_names("slowlate", 3));
    let names = [first.as_slice(), second.as_slice()].concat();
    let outcome = async {
        burst(cluster, &first, 50).await?;
        wait_binding_held(cluster, &webhook, &first, Duration::from_secs(60)).await?;
        // Past a second of the ledger's clock: an in-flight hold that expired early
        // (or a 1 s `--reservation-ttl`) would be gone by the time the second wave
        // is placed, the first's Bindings still held for 4 s and more.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let held = pending_count(cluster, &first).await?;
        ensure!(
            held == first.len(),
            "only {held} of the first wave were unbound when the second came: the Bindings were not held"
        );
        burst(cluster, &second, 50).await?;
        settle(cluster, &names, Duration::from_secs(120)).await?;
        // The pods run once their first Binding lands; a retry's own bind, had it
        // run, would end up to 9 s later (its Binding held too). The books are read
        // after that.
        tokio::time::sleep(Duration::from_secs(10)).await;
        check_books(cluster, &names).await?;
        timed_out_in_kube_scheduler(cluster, &names)?;
        reviewed_each(&webhook, &names)
    }
    .await;
    clean_up(cluster, &names, outcome, Replicas::One).await
}

/// The leader is SIGKILLed while its Bindings, which carry the allocations, wait on
/// the slow webhook: the API server abandons them, nothing of them is written. The other replica takes the Lease (after the lease
/// duration: nothing released it) and the pods end Running with their annotation's
/// GPUs; none runs with GPUs its annotation does not name, none over 100%.
pub async fn leader_killed_mid_bind(cluster: &mut Cluster) -> anyhow::Result<()> {
    let names = pod_names("killed", 6);
    start_second_replica(cluster).await?;
    let outcome = async {
        call_follower(cluster).await?;
        let webhook = install_webhook(cluster, "leader-killed", 5..7).await?;
        burst(cluster, &names, 50).await?;
        // The window: the leader's Binding held by the webhook.
        let caught = wait_binding_held(cluster, &webhook, &names, Duration::from_secs(60)).await?;
        cluster.kill(Component::Extender)?;
        println!("    leader {FIRST} SIGKILLed while {caught} waited on its Binding");
        settle(cluster, &names, Duration::from_secs(150)).await?;
        check_books(cluster, &names).await?;
        ensure_leader(cluster, SECOND, "after the leader's death").await?;
        drop(webhook);
        Ok(())
    }
    .await;
    clean_up(cluster, &names, outcome, Replicas::Two { first_died: true }).await
}

/// kube-apiserver crashes and restarts during a burst whose Bindings wait on the
/// slow webhook: every watch of tessera-scheduler breaks and relists. It binds
/// nothing from a half-listed cache, so nothing is double-booked and every pod is
/// placed. (It found the extender counting a pod's own in-flight hold against
/// the pod's next cycle: parked Unschedulable until kube-scheduler's 5-minute
/// retry; `Ledger::set_aside` is the fix.)
pub async fn relist_during_binds(cluster: &mut Cluster) -> anyhow::Result<()> {
    let relists_before = relist_count(cluster);
    let names = pod_names("relist", 8);
    let outcome = relist_outcome(cluster, &names, relists_before).await;
    clean_up(cluster, &names, outcome, Replicas::One).await
}

async fn relist_outcome(
    cluster: &mut Cluster,
    names: &[String],
    relists_before: usize,
) -> anyhow::Result<()> {
    // Binds held 2 to 4 s by the webhook, so the crash lands while they go on.
    let webhook = install_webhook(cluster, "relist", 2..4).await?;
    burst(cluster, names, 50).await?;
    let caught = wait_binding_held(cluster, &webhook, names, Duration::from_secs(60)).await?;
    let pending = pending_count(cluster, names).await?;
    println!(
        "    kube-apiserver SIGKILLed while {caught}'s Binding waited, {pending} of {} unbound",
        names.len()
    );
    // SIGKILL: on SIGTERM kube-apiserver drains its long-running requests for more
    // than 20 s; a crash breaks every watch at once, which is the point here.
    cluster.kill(Component::ApiServer)?;
    cluster
        .start_again(Component::ApiServer)
        .await
        .context("starting kube-apiserver again")?;
    // Under the 30 s in-flight TTL: a retried bind must not wait out its own
    // earlier attempt's hold (it did, until the bind set it aside as filter does).
    settle(cluster, names, Duration::from_secs(25)).await?;
    check_books(cluster, names).await?;
    ensure!(
        relist_count(cluster) > relists_before,
        "tessera-scheduler's log shows no relist after kube-apiserver's restart: the fault did not reach it"
    );
    Ok(())
}

/// tessera-scheduler restarts (SIGTERM, drain, start) while 12 pods are pending,
/// their binds slowed by the webhook: none is lost, none double-booked, and none
/// waits on a bind the restart cut (SIGTERM lets running binds end first).
pub async fn restart_during_burst(cluster: &mut Cluster) -> anyhow::Result<()> {
    let names = pod_names("restart", 12);
    let outcome = restart_outcome(cluster, &names).await;
    clean_up(cluster, &names, outcome, Replicas::One).await
}

async fn restart_outcome(cluster: &mut Cluster, names: &[String]) -> anyhow::Result<()> {
    // Binds held 2 to 4 s by the webhook: the burst is still pending, some of it
    // mid-bind, when SIGTERM arrives.
    let webhook = install_webhook(cluster, "restart", 2..4).await?;
    burst(cluster, names, 30).await?;
    wait_binding_held(cluster, &webhook, names, Duration::from_secs(60)).await?;
    let pending = pending_count(cluster, names).await?;
    cluster
        .restart(Component::Extender)
        .await
        .context("restarting tessera-scheduler")?;
    println!("    tessera-scheduler restarted with {pending} of 12 pods unbound");
    ensure!(
        pending >= 10,
        "only {pending} pods were unbound when tessera-scheduler restarted: not a burst"
    );
    // Within 20 s, under the 30 s in-flight TTL: a pod annotated and unbound (as an
    // older version's cut bind left it) is held in flight by the new process until
    // the TTL, and a retry that waited that out would pass only slowly, with 150 s.
    settle(cluster, names, Duration::from_secs(20)).await?;
    check_books(cluster, names).await
}

// === checks ===

/// Every Running pod among `names` holds exactly its annotation's GPUs in each
/// container; the compute booked on each GPU, summed over every annotated pod in
/// `default`, is at most 100.
async fn check_books(cluster: &Cluster, names: &[String]) -> anyhow::Result<()> {
    let pods: Api<Pod> = Api::namespaced(cluster.client().await?, "default");
    let mut booked = BTreeMap::<String, u64>::new();
    let mut holders = BTreeMap::<String, Vec<String>>::new();
    for pod in pods.list(&ListParams::default()).await? {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let Some(text) = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(ALLOCATED))
        else {
            // A pod of the burst runs: it asked for GPUs, so it must say which.
            ensure!(
                !(names.contains(&name) && is_running(&pod)),
                "pod {name} runs without {ALLOCATED}: its GPUs are nobody's grant"
            );
            continue;
        };
        let value: Value = serde_json::from_str(text)
            .with_context(|| format!("pod {name}: {ALLOCATED} is not JSON: {text}"))?;
        for gpu in value["gpu"].as_array().into_iter().flatten() {
            let id = gpu["id"].as_str().unwrap_or_default().to_owned();
            let core = &gpu["resources"]["koordinator.sh/gpu-core"];
            let core = core
                .as_u64()
                .or_else(|| core.as_str().and_then(|s| s.parse().ok()))
                .with_context(|| format!("pod {name}: no gpu-core in {text}"))?;
            *booked.entry(id.clone()).or_default() += core;
            holders
                .entry(id)
                .or_default()
                .push(format!("{name}:{core}"));
        }
        if !names.contains(&name) || !is_running(&pod) {
            continue;
        }
        let gpus = allocated_gpus(&pod)?;
        for (container, spec) in cluster.container_specs(&pod)? {
            assert_grant(&name, &container, &spec, &gpus)?;
        }
    }
    ensure!(
        booked.values().all(|core| *core <= 100),
        "a GPU is booked over 100%: {holders:?}"
    );
    Ok(())
}

/// Fails unless the webhook reviewed exactly one Binding of each of `names`: none
/// missing (the fault was in the path), none twice (a retried bind joined the
/// running one instead of writing and binding again).
fn reviewed_each(webhook: &SlowWebhook, names: &[String]) -> anyhow::Result<()> {
    let reviewed = webhook.reviewed_bindings();
    let times = |n: &String| {
        reviewed
            .iter()
            .filter(|r| **r == format!("default/{n}"))
            .count()
    };
    let missing: Vec<&String> = names.iter().filter(|n| times(n) == 0).collect();
    ensure!(
        missing.is_empty(),
        "the slow webhook never saw the Binding of {missing:?} (it saw {reviewed:?}): the fault was not in the path"
    );
    let twice: Vec<&String> = names.iter().filter(|n| times(n) > 1).collect();
    ensure!(
        twice.is_empty(),
        "the slow webhook saw more than one Binding of {twice:?} (it saw {reviewed:?}): a retried bind ran again instead of joining the running one"
    );
    Ok(())
}

/// Fails unless kube-scheduler's log shows a bind of one of `names` outlasting its
/// `httpTimeout` (so it retried while that bind still ran).
fn timed_out_in_kube_scheduler(cluster: &Cluster, names: &[String]) -> anyhow::Result<()> {
    let log = cluster.log(Component::Scheduler);
    let timed_out = |name: &String| {
        log.lines().any(|line| {
            line.contains("Client.Timeout exceeded")
                && line.contains(&format!("pod=\"default/{name}\""))
        })
    };
    ensure!(
        names.iter().any(timed_out),
        "kube-scheduler's log shows no bind of {names:?} running past its httpTimeout: the fault was not in the path"
    );
    Ok(())
}

/// Fails unless the leader ([`FIRST`]) bound every pod of `names` and the follower
/// ([`SECOND`]) none: each `bound` line is in the leader's log. One ledger places
/// everything; a follower binding from its own would place this burst once, yet
/// twice beside a leader binding too.
fn bound_by_leader(cluster: &Cluster, names: &[String]) -> anyhow::Result<()> {
    let (leads, follows) = (
        cluster.log(Component::Extender),
        cluster.log(Component::ExtenderReplica),
    );
    let bound_in = |log: &str, name: &String| log.contains(&format!("bound pod=default/{name} "));
    let not_by_leader: Vec<&String> = names.iter().filter(|n| !bound_in(&leads, n)).collect();
    let by_follower: Vec<&String> = names.iter().filter(|n| bound_in(&follows, n)).collect();
    ensure!(
        not_by_leader.is_empty() && by_follower.is_empty(),
        "binds not handed to the leader {FIRST}: it bound none of {not_by_leader:?}, the follower {SECOND} bound {by_follower:?} itself"
    );
    Ok(())
}

// === set-up and clean-up ===

/// The extender replicas a scenario ran.
enum Replicas {
    /// The first only, as every scenario starts.
    One,
    /// Both (see [`start_second_replica`]); `first_died`: the first was killed.
    Two { first_died: bool },
}

/// Starts the second replica and waits until it is ready and the first leads.
async fn start_second_replica(cluster: &mut Cluster) -> anyhow::Result<()> {
    cluster.start_extender_replica().await?;
    wait_ready_http(EXTENDER_REPLICA_PORT, Duration::from_secs(60)).await?;
    wait_leader(cluster, FIRST, Duration::from_secs(40)).await
}

/// Points kube-scheduler at the second replica, the follower.
async fn call_follower(cluster: &mut Cluster) -> anyhow::Result<()> {
    cluster
        .set_extender(&format!("http://127.0.0.1:{EXTENDER_REPLICA_PORT}"), None)
        .await
}

/// Undoes a scenario whatever its `outcome`: the slow webhook's registration (none
/// is fine), the pods `names`, and with [`Replicas::Two`] the second replica. The
/// scenario's error comes first, then the clean-up's.
async fn clean_up(
    cluster: &mut Cluster,
    names: &[String],
    outcome: anyhow::Result<()>,
    replicas: Replicas,
) -> anyhow::Result<()> {
    let removed = remove_webhook(cluster).await;
    let deleted = delete_all(cluster, names).await;
    let restored = match replicas {
        Replicas::One => Ok(()),
        Replicas::Two { first_died } => back_to_one_replica(cluster, first_died).await,
    };
    outcome.and(removed).and(deleted).and(restored)
}

// === steps ===

/// Creates the pods `names` of `koordinator.sh/gpu: share`, all at once.
async fn burst(cluster: &Cluster, names: &[String], share: u32) -> anyhow::Result<()> {
    let creates = names.iter().map(|name| {
        create_one(
            cluster,
            name,
            json!({"koordinator.sh/gpu": share.to_string()}),
        )
    });
    for created in futures_util::future::join_all(creates).await {
        created?;
    }
    Ok(())
}

/// `<prefix>-0` … `<prefix>-<n-1>`.
fn pod_names(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

/// Waits until every pod of `names` runs, all within `timeout`.
async fn settle(cluster: &mut Cluster, names: &[String], timeout: Duration) -> anyhow::Result<()> {
    let started = Instant::now();
    for name in names {
        let left = timeout.saturating_sub(started.elapsed());
        cluster
            .wait_pod(
                name,
                left.max(Duration::from_secs(1)),
                "Running",
                is_running,
            )
            .await?;
    }
    println!(
        "    {} pods Running {:.1} s after the fault",
        names.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// How many of `names` have no node yet.
async fn pending_count(cluster: &Cluster, names: &[String]) -> anyhow::Result<usize> {
    let pods: Api<Pod> = Api::namespaced(cluster.client().await?, "default");
    let mut pending = 0;
    for name in names {
        let pod = pods.get(name).await?;
        if pod.spec.and_then(|s| s.node_name).is_none() {
            pending += 1;
        }
    }
    Ok(pending)
}

/// Waits until one pod of `names` has its Binding held by `webhook` (reviewed, the
/// pod still unbound) and returns its name: the window in which the Binding, which
/// carries the allocation, is in the API server and nothing of it is written yet.
async fn wait_binding_held(
    cluster: &Cluster,
    webhook: &SlowWebhook,
    names: &[String],
    timeout: Duration,
) -> anyhow::Result<String> {
    let pods: Api<Pod> = Api::namespaced(cluster.client().await?, "default");
    let started = Instant::now();
    loop {
        let reviewed = webhook.reviewed_bindings();
        for name in names {
            if !reviewed.contains(&format!("default/{name}")) {
                continue;
            }
            let pod = pods.get(name).await?;
            if pod
                .spec
                .as_ref()
                .and_then(|s| s.node_name.as_ref())
                .is_none()
            {
                return Ok(name.clone());
            }
        }
        if started.elapsed() > timeout {
            bail!("no Binding of {names:?} was held by the webhook within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Deletes `names` at once and waits until all are gone.
async fn delete_all(cluster: &Cluster, names: &[String]) -> anyhow::Result<()> {
    let pods: Api<Pod> = Api::namespaced(cluster.client().await?, "default");
    let params = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    for name in names {
        match pods.delete(name, &params).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(e.into()),
        }
    }
    let started = Instant::now();
    for name in names {
        while pods.get_opt(name).await?.is_some() {
            if started.elapsed() > Duration::from_secs(90) {
                bail!("pod {name} still there 90 s after its deletion");
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    Ok(())
}

/// The holder of tessera-scheduler's Lease.
async fn leader(cluster: &Cluster) -> anyhow::Result<Option<String>> {
    let leases: Api<Lease> = Api::namespaced(cluster.client().await?, "tessera-system");
    Ok(leases
        .get_opt("tessera-scheduler")
        .await?
        .and_then(|l| l.spec)
        .and_then(|s| s.holder_identity)
        .filter(|h| !h.is_empty()))
}

/// Fails unless `want` holds the Lease, saying `when`.
async fn ensure_leader(cluster: &Cluster, want: &str, when: &str) -> anyhow::Result<()> {
    let holder = leader(cluster).await?;
    ensure!(
        holder.as_deref() == Some(want),
        "{when}: the Lease is held by {holder:?}, want {want}"
    );
    Ok(())
}

async fn wait_leader(cluster: &Cluster, want: &str, timeout: Duration) -> anyhow::Result<()> {
    let started = Instant::now();
    loop {
        let holder = leader(cluster).await?;
        if holder.as_deref() == Some(want) {
            return Ok(());
        }
        if started.elapsed() > timeout {
            bail!("the Lease is held by {holder:?} after {timeout:?}, want {want}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Waits until the extender on `port` answers `GET /readyz` with 200 (its caches synced).
async fn wait_ready_http(port: u16, timeout: Duration) -> anyhow::Result<()> {
    let started = Instant::now();
    loop {
        let status = tokio::task::spawn_blocking(move || -> std::io::Result<String> {
            let mut stream = std::net::TcpStream::connect(("127.0.0.1", port))?;
            stream.set_read_timeout(Some(Duration::from_secs(2)))?;
            stream.write_all(b"GET /readyz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
            let mut text = String::new();
            stream.read_to_string(&mut text)?;
            Ok(text.lines().next().unwrap_or_default().to_owned())
        })
        .await?;
        if status.as_ref().is_ok_and(|s| s.contains(" 200")) {
            return Ok(());
        }
        if started.elapsed() > timeout {
            bail!("the extender on port {port} is not ready after {timeout:?}: {status:?}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// How many relists tessera-scheduler's log shows.
fn relist_count(cluster: &Cluster) -> usize {
    cluster
        .log(Component::Extender)
        .matches("relisting")
        .count()
}

/// Starts the slow webhook (`delay` seconds), registers it on `pods/binding`, and
/// waits until the API server calls it.
async fn install_webhook(
    cluster: &Cluster,
    tag: &str,
    delay: std::ops::Range<u64>,
) -> anyhow::Result<SlowWebhook> {
    let webhook = SlowWebhook::start(
        &cluster.dir().join(format!("webhook-{tag}")),
        WEBHOOK_PORT,
        Duration::from_secs(delay.start)..Duration::from_secs(delay.end),
    )?;
    let mut config = webhook.configuration(WEBHOOK_NAME);
    config["metadata"]["name"] = json!(WEBHOOK_NAME);
    cluster.apply(&config).await?;
    let active = async {
        webhook
            .wait_active(cluster.client().await?, "default", Duration::from_secs(30))
            .await
    }
    .await;
    if let Err(error) = active {
        // Registered with failurePolicy Fail and its server about to go: left
        // behind, it would refuse every later scenario's Binding.
        return Err(error.context(match remove_webhook(cluster).await {
            Ok(()) => "the slow webhook was not in force (its registration is removed)".to_owned(),
            Err(e) => format!(
                "the slow webhook was not in force, and removing its registration failed too: {e:#}"
            ),
        }));
    }
    Ok(webhook)
}

async fn remove_webhook(cluster: &Cluster) -> anyhow::Result<()> {
    let configs: Api<ValidatingWebhookConfiguration> = Api::all(cluster.client().await?);
    match configs.delete(WEBHOOK_NAME, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Leaves the cluster as the other scenarios expect it: the first replica running
/// and leading, the second stopped (its SIGTERM releases the Lease when it leads),
/// kube-scheduler calling the first. `first_died`: the first was killed, start it.
async fn back_to_one_replica(cluster: &mut Cluster, first_died: bool) -> anyhow::Result<()> {
    if first_died {
        cluster.start_again(Component::Extender).await?;
    }
    cluster.stop(Component::ExtenderReplica)?;
    cluster
        .set_extender(&format!("http://127.0.0.1:{EXTENDER_PORT}"), None)
        .await?;
    wait_leader(cluster, FIRST, Duration::from_secs(40)).await
}
