//! Leader election against the API server double: a released Lease is taken at
//! once, a crashed leader's only after the lease duration, and a leader cut off
//! from the API server stops at its renew deadline although nobody tells it.
//! Never two leaders at one instant.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use tessera_harness::apiserver::ApiServer;
use tessera_scheduler::leader::{Election, ElectionTiming, Leader, LeaseConfig};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

const LEASE: Duration = Duration::from_secs(2);
const TIMING: ElectionTiming = ElectionTiming {
    renew_deadline: Duration::from_millis(1200),
    retry_period: Duration::from_millis(200),
};

struct Replica {
    leader: Arc<Leader>,
    election: Election,
}

fn replica(client: kube::Client, identity: &str) -> Replica {
    let leader = Arc::new(Leader::new(false));
    let election = Election::start(
        client,
        LeaseConfig {
            namespace: "tessera-system".into(),
            name: "tessera-scheduler".into(),
            identity: identity.into(),
            duration: LEASE,
            url: Some(format!("http://{identity}")),
        },
        TIMING,
        Arc::clone(&leader),
        Arc::new(AtomicBool::new(true)),
    );
    Replica { leader, election }
}

fn holder(api: &ApiServer) -> String {
    api.get(
        "coordination.k8s.io/v1",
        "leases",
        "tessera-system",
        "tessera-scheduler",
    )
    .and_then(|lease| lease["spec"]["holderIdentity"].as_str().map(str::to_owned))
    .unwrap_or_default()
}

/// Waits until `done`, checking every 10 ms that no two replicas lead; returns
/// how long it took.
async fn until(what: &str, replicas: &[&Arc<Leader>], mut done: impl FnMut() -> bool) -> Duration {
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(10) {
        let leading = replicas.iter().filter(|l| l.leading()).count();
        assert!(leading <= 1, "two leaders while waiting for: {what}");
        if done() {
            return started.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never: {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_lease_is_taken_at_once() {
    let api = ApiServer::start().await.expect("api");
    let a = replica(api.client().expect("client"), "a");
    until("a leads", &[&a.leader], || a.leader.leading()).await;
    let b = replica(api.client().expect("client"), "b");
    // b has watched a's renewals for more than a lease duration: a still leads.
    tokio::time::sleep(LEASE + Duration::from_millis(500)).await;
    assert!(a.leader.leading() && !b.leader.leading());
    assert_eq!(
        b.leader.url().as_deref(),
        Some("http://a"),
        "b knows where a listens"
    );

    let a_leader = Arc::clone(&a.leader);
    assert!(
        a.election.release().await.expect("release"),
        "a held the Lease"
    );
    assert!(!a_leader.leading(), "a stopped leading before it released");
    let took = until("b leads", &[&a_leader, &b.leader], || b.leader.leading()).await;
    // At b's next round (retry period plus jitter), not a lease duration later.
    assert!(took < LEASE, "took {took:?}");
    assert_eq!(holder(&api), "b");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_leader_is_replaced_only_after_the_lease_duration() {
    let api = ApiServer::start().await.expect("api");
    let a = replica(api.client().expect("client"), "a");
    until("a leads", &[&a.leader], || a.leader.leading()).await;
    let b = replica(api.client().expect("client"), "b");
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Crash: no release, no more renewals; the process (and its belief) is gone.
    a.election.abort();
    let crashed = Instant::now();
    until("b leads", &[&b.leader], || b.leader.leading()).await;
    let took = crashed.elapsed();
    // b's rounds come every 200-440 ms; it waits out the Lease it saw renewed
    // (at most a retry period and a round before the crash). Loose bound: a loaded
    // machine may stretch a round.
    assert!(
        took >= LEASE / 2,
        "b took over after {took:?}, before a's lease could have run out"
    );
    assert_eq!(holder(&api), "b");
}

/// A TCP relay to `target` that can be cut: from then on every connection,
/// open or new, hangs (a partition, not a refusal).
async fn cuttable_relay(target: SocketAddr) -> (SocketAddr, watch::Sender<bool>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("relay");
    let addr = listener.local_addr().expect("addr");
    let (cut, cut_seen) = watch::channel(false);
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            let mut cut_seen = cut_seen.clone();
            tokio::spawn(async move {
                if !*cut_seen.borrow() {
                    let Ok(mut outbound) = TcpStream::connect(target).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => return,
                        _ = cut_seen.wait_for(|cut| *cut) => {}
                    }
                }
                // Hold the socket open and answer nothing.
                std::future::pending::<()>().await;
                drop(inbound);
            });
        }
    });
    (addr, cut)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_off_from_the_api_server_stops_at_its_renew_deadline() {
    let api = ApiServer::start().await.expect("api");
    let (relay, cut) = cuttable_relay(
        api.url()
            .trim_start_matches("http://")
            .parse()
            .expect("addr"),
    )
    .await;
    let through_relay = kube::Client::try_from(kube::Config::new(
        format!("http://{relay}").parse().expect("url"),
    ))
    .expect("client");
    let a = replica(through_relay, "a");
    until("a leads", &[&a.leader], || a.leader.leading()).await;
    let b = replica(api.client().expect("client"), "b");
    tokio::time::sleep(Duration::from_millis(500)).await;

    cut.send(true).expect("cut");
    let cut_at = Instant::now();
    // One failed renewal is no reason to stop: a leads on until its deadline.
    tokio::time::sleep(TIMING.retry_period + Duration::from_millis(100)).await;
    assert!(a.leader.leading(), "a stopped on the first failed renewal");
    until("a stops", &[&a.leader, &b.leader], || !a.leader.leading()).await;
    let stopped = cut_at.elapsed();
    assert!(
        stopped <= TIMING.renew_deadline + Duration::from_millis(300),
        "a led {stopped:?} after it last could renew"
    );
    // Nobody told a: the Lease still names it, and b waits it out.
    assert_eq!(holder(&api), "a");
    until("b leads", &[&a.leader, &b.leader], || b.leader.leading()).await;
    assert!(
        cut_at.elapsed() >= LEASE / 2,
        "b took over before a's lease ran out"
    );
    assert!(!a.leader.leading());
    a.election.abort();
    b.election.abort();
}
