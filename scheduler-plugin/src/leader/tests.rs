//! The lease decision, the leader's deadline and the flags' parsing; and a model
//! of replicas racing over one Lease on a server with resourceVersions, where no
//! two ever believe they lead at the same instant.

use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::*;

const SECOND: Duration = Duration::from_secs(1);

fn held_by(holder: &str, rv: &str) -> LeaseRecord {
    LeaseRecord {
        holder: holder.into(),
        duration: 15 * SECOND,
        renew_time: "2030-01-01T00:00:00Z".into(),
        resource_version: rv.into(),
    }
}

fn seen(record: &LeaseRecord, at: Instant) -> Observation {
    Observation {
        record: record.clone(),
        at,
    }
}

// === decide ===

#[test]
fn no_lease_is_created() {
    let now = Instant::now();
    assert_eq!(
        decide(None, "a", now, None, false),
        (LeaseDecision::Create, None)
    );
}

#[test]
fn decisions_by_holder_observation_and_belief() {
    let t0 = Instant::now();
    let other = held_by("b", "7");
    let released = LeaseRecord {
        holder: String::new(),
        duration: SECOND,
        ..held_by("", "8")
    };
    let ours = held_by("a", "9");
    let at = |secs: u64| t0 + Duration::from_secs(secs);
    let millis = |ms: u64| t0 + Duration::from_millis(ms);
    // (what, current, observed before, now, leading) → decision, observed at
    type Case<'a> = (
        &'a str,
        LeaseRecord,
        Option<Observation>,
        Instant,
        bool,
        LeaseDecision,
        Instant,
    );
    let cases: Vec<Case> = vec![
        (
            "ours: renew",
            ours.clone(),
            Some(seen(&ours, at(0))),
            at(3),
            true,
            LeaseDecision::Renew,
            at(0),
        ),
        (
            "ours after our deadline lapsed: renew (a stale write would conflict)",
            ours.clone(),
            Some(seen(&ours, at(0))),
            at(40),
            false,
            LeaseDecision::Renew,
            at(0),
        ),
        (
            "ours, never observed (restarted with the same identity)",
            ours.clone(),
            None,
            at(1),
            false,
            LeaseDecision::Renew,
            at(1),
        ),
        (
            "another's, first seen: wait a whole duration from now",
            other.clone(),
            None,
            at(100),
            false,
            LeaseDecision::Wait,
            at(100),
        ),
        (
            "another's, unchanged for just under its duration",
            other.clone(),
            Some(seen(&other, at(0))),
            millis(14_999),
            false,
            LeaseDecision::Wait,
            at(0),
        ),
        (
            "another's, unchanged for exactly its duration",
            other.clone(),
            Some(seen(&other, at(0))),
            at(15),
            false,
            LeaseDecision::Acquire,
            at(0),
        ),
        (
            "another's, unchanged for longer",
            other.clone(),
            Some(seen(&other, at(0))),
            at(60),
            false,
            LeaseDecision::Acquire,
            at(0),
        ),
        (
            "another's, renewed since we looked: the clock restarts now",
            other.clone(),
            Some(seen(&held_by("b", "6"), at(0))),
            at(60),
            false,
            LeaseDecision::Wait,
            at(60),
        ),
        (
            "another's, taken over since we looked: the clock restarts now",
            other.clone(),
            Some(seen(&held_by("c", "6"), at(0))),
            at(60),
            false,
            LeaseDecision::Wait,
            at(60),
        ),
        (
            "released: take it at once, even first seen",
            released.clone(),
            None,
            at(5),
            false,
            LeaseDecision::Acquire,
            at(5),
        ),
        (
            "we believed we led, another holds it: lost",
            other.clone(),
            Some(seen(&ours, at(0))),
            at(2),
            true,
            LeaseDecision::Lost,
            at(2),
        ),
        (
            "we believed we led, another's expired: still lost first",
            other.clone(),
            Some(seen(&other, at(0))),
            at(60),
            true,
            LeaseDecision::Lost,
            at(0),
        ),
        (
            "we believed we led, it was released: lost first",
            released.clone(),
            None,
            at(2),
            true,
            LeaseDecision::Lost,
            at(2),
        ),
    ];
    for (what, current, observed, now, leading, want, observed_at) in cases {
        let (decision, kept) = decide(Some(&current), "a", now, observed.as_ref(), leading);
        assert_eq!(decision, want, "{what}");
        assert_eq!(kept, Some(seen(&current, observed_at)), "{what}");
    }
}

#[test]
fn expiry_never_reads_the_holders_clock() {
    let t0 = Instant::now();
    // The holder's clock is a year behind: its renewTime looks ancient. Judged by
    // that, it would be expired; judged by when we saw it, it is fresh.
    let behind = LeaseRecord {
        renew_time: "2029-01-01T00:00:00Z".into(),
        ..held_by("b", "1")
    };
    assert_eq!(
        decide(Some(&behind), "a", t0, None, false).0,
        LeaseDecision::Wait
    );
    // Its clock is a year ahead: renewTime in the future. Unchanged for a duration
    // by our clock, it is expired all the same.
    let ahead = LeaseRecord {
        renew_time: "2031-01-01T00:00:00Z".into(),
        ..held_by("b", "1")
    };
    let observed = seen(&ahead, t0);
    assert_eq!(
        decide(Some(&ahead), "a", t0 + 16 * SECOND, Some(&observed), false).0,
        LeaseDecision::Acquire
    );
}

#[test]
fn a_lease_without_a_duration_expires_once_observed() {
    // As client-go: leaseDurationSeconds missing counts as 0.
    let t0 = Instant::now();
    let bare = LeaseRecord {
        duration: Duration::ZERO,
        ..held_by("b", "1")
    };
    assert_eq!(
        decide(Some(&bare), "a", t0, None, false).0,
        LeaseDecision::Acquire
    );
}

#[test]
fn the_record_is_read_from_the_lease() {
    let lease: Lease = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "l", "resourceVersion": "42"},
        "spec": {"holderIdentity": "b", "leaseDurationSeconds": 15, "renewTime": "2030-01-01T00:00:00.000000Z"}
    }))
    .expect("lease");
    let record = LeaseRecord::of(&lease);
    assert_eq!(record.holder, "b");
    assert_eq!(record.duration, 15 * SECOND);
    assert_eq!(record.resource_version, "42");
    assert!(!record.renew_time.is_empty());
    let empty: Lease =
        serde_json::from_value(serde_json::json!({"metadata": {"name": "l"}})).expect("lease");
    assert_eq!(LeaseRecord::of(&empty), LeaseRecord::default());
}

// === Leader ===

#[test]
fn a_leader_stops_at_its_deadline_without_being_told() {
    let t0 = Instant::now();
    let leader = Leader::new(false);
    assert!(!leader.leading_at(t0));
    let timing = ElectionTiming::default();
    leader.lead_until(leads_until(t0, &timing), Some("http://a".into()));
    assert!(leader.leading_at(t0 + 9 * SECOND));
    assert!(
        !leader.leading_at(t0 + 10 * SECOND),
        "past the renew deadline"
    );
    assert_eq!(leader.url().as_deref(), Some("http://a"));
    leader.step_down();
    assert!(!leader.leading_at(t0));
    assert_eq!(
        leader.url().as_deref(),
        Some("http://a"),
        "step_down keeps the URL"
    );
    leader.follow(Some("http://b".into()));
    assert_eq!(leader.url().as_deref(), Some("http://b"));
    assert!(Leader::new(true).leading_at(t0 + 1_000_000 * SECOND));
    assert!(!Leader::following("http://b").leading());
}

// === timing and flags ===

#[test]
fn kube_schedulers_defaults_are_valid() {
    assert_eq!(ElectionTiming::default().validate(15 * SECOND), Ok(()));
}

#[test]
fn timing_that_could_elect_two_leaders_is_refused() {
    let timing = ElectionTiming::default();
    assert_eq!(
        timing.validate(10 * SECOND).map_err(|e| e.to_string()),
        Err("--leader-elect-lease-duration (10s) must be greater than --leader-elect-renew-deadline (10s)".into())
    );
    let slow = ElectionTiming {
        renew_deadline: 10 * SECOND,
        retry_period: 9 * SECOND,
    };
    assert_eq!(
        slow.validate(15 * SECOND).map_err(|e| e.to_string()),
        Err("--leader-elect-renew-deadline (10s) must be greater than 1.2 × --leader-elect-retry-period (9s)".into())
    );
    let spin = ElectionTiming {
        retry_period: Duration::ZERO,
        ..timing
    };
    assert_eq!(spin.validate(15 * SECOND), Err(TimingError::ZeroRetry));
}

#[test]
fn followers_wait_between_one_and_2_2_retry_periods() {
    let period = 2 * SECOND;
    assert_eq!(jittered(period, 0.0), period);
    assert_eq!(jittered(period, 1.0), Duration::from_millis(4400));
    assert_eq!(
        jittered(period, 7.0),
        Duration::from_millis(4400),
        "clamped"
    );
    let unit = random_unit();
    assert!((0.0..1.0).contains(&unit), "{unit}");
}

// === the model: replicas racing over one Lease ===

/// A write on its way to the server.
#[derive(Debug, Clone)]
enum Write {
    /// Create, refused when a Lease exists.
    Create(LeaseRecord),
    /// Replace, refused unless the Lease's resourceVersion is `expect`.
    Replace { expect: String, record: LeaseRecord },
}

/// One replica's round, in the steps the network can interleave.
#[derive(Debug, Clone)]
enum Phase {
    Idle,
    /// GET sent at local time `started`, not served yet.
    Reading {
        started: Instant,
    },
    /// GET served; its answer travels back.
    Read {
        started: Instant,
        lease: Option<LeaseRecord>,
    },
    /// Write sent, not served yet.
    Writing {
        started: Instant,
        write: Write,
    },
    /// Write served (`Some`: the record written); its answer travels back.
    Written {
        started: Instant,
        done: Option<LeaseRecord>,
    },
    /// Releasing: GET sent after stepping down.
    ReleaseReading,
}

struct Replica {
    identity: String,
    /// Local clock: `t0 + base + real × rate` (any offset, a drift within 5%).
    base: f64,
    rate: f64,
    leader: Leader,
    observed: Option<Observation>,
    phase: Phase,
    /// Writes that are releases (their success never makes anyone lead).
    releasing: bool,
    /// Real time until which the replica is stalled.
    frozen_until: f64,
}

struct Server {
    lease: Option<LeaseRecord>,
    version: u64,
}

impl Server {
    fn apply(&mut self, write: &Write) -> Option<LeaseRecord> {
        let record = match write {
            Write::Create(record) if self.lease.is_none() => record,
            Write::Replace { expect, record }
                if self.lease.as_ref().map(|l| &l.resource_version) == Some(expect) =>
            {
                record
            }
            _ => return None,
        };
        self.version += 1;
        let written = LeaseRecord {
            resource_version: self.version.to_string(),
            ..record.clone()
        };
        self.lease = Some(written.clone());
        Some(written)
    }
}

#[derive(Debug, Clone, Copy)]
enum Op {
    /// The replica takes its next step (send, be served, receive).
    Step,
    /// Its write's answer is lost (timeout, reset): it learns nothing.
    LoseAnswer,
    /// It gives up on a write still on its way (round timeout); the write may
    /// still reach the server later.
    Abandon,
    /// SIGTERM: step down, then release when it holds the Lease.
    Release,
    /// An abandoned write reaches the server.
    Deliver,
    /// The replica stalls (GC pause, partition) for this many seconds: its ops
    /// until then do nothing, so its Lease can expire under it.
    Freeze(u64),
}

fn op() -> impl Strategy<Value = (usize, u64, Op)> {
    let kind = prop_oneof![
        8 => Just(Op::Step),
        1 => Just(Op::LoseAnswer),
        1 => Just(Op::Abandon),
        1 => Just(Op::Release),
        1 => Just(Op::Deliver),
        1 => (5..25u64).prop_map(Op::Freeze),
    ];
    // Mostly short gaps (a round's steps close together), some long ones:
    // rounds race, answers straggle and leases expire.
    (
        0..3usize,
        prop_oneof![6 => 0..200u64, 3 => 0..2_000u64, 1 => 0..9_000u64],
        kind,
    )
}

const LEASE: Duration = Duration::from_secs(15);

fn ours(identity: &str, duration: Duration) -> LeaseRecord {
    LeaseRecord {
        holder: identity.into(),
        duration,
        renew_time: String::new(),
        resource_version: String::new(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    /// Under any interleaving of reads, writes, lost answers, abandoned writes
    /// arriving late and releases, with clocks at any offset and drifting up to
    /// 5%, no two replicas believe they lead at the same instant.
    #[test]
    fn two_replicas_never_lead_at_once(
        clocks in proptest::collection::vec((0.0..1_000.0f64, 0.95..1.05f64), 3),
        ops in proptest::collection::vec(op(), 1..300),
    ) {
        let timing = ElectionTiming::default();
        let t0 = Instant::now();
        let mut replicas: Vec<Replica> = clocks
            .iter()
            .enumerate()
            .map(|(i, &(base, rate))| Replica {
                identity: format!("r{i}"),
                base,
                rate,
                leader: Leader::new(false),
                observed: None,
                phase: Phase::Idle,
                releasing: false,
                frozen_until: 0.0,
            })
            .collect();
        let mut server = Server { lease: None, version: 0 };
        let mut network: Vec<Write> = Vec::new();
        let mut real = 0.0f64;
        for (who, gap_ms, op) in ops {
            real += gap_ms as f64 / 1000.0;
            let local = |r: &Replica| t0 + Duration::from_secs_f64(r.base + real * r.rate);
            let r = &mut replicas[who];
            let now = local(r);
            if real < r.frozen_until {
                continue;
            }
            if let Op::Freeze(secs) = op {
                r.frozen_until = real + secs as f64;
                continue;
            }
            let phase = std::mem::replace(&mut r.phase, Phase::Idle);
            r.phase = match (phase, op) {
                (Phase::Idle, Op::Release) => {
                    r.leader.step_down();
                    Phase::ReleaseReading
                }
                (Phase::Idle, _) => {
                    r.releasing = false;
                    Phase::Reading { started: now }
                }
                (Phase::Reading { started }, _) => Phase::Read { started, lease: server.lease.clone() },
                (Phase::ReleaseReading, _) => match &server.lease {
                    Some(lease) if lease.holder == r.identity => {
                        r.releasing = true;
                        Phase::Writing {
                            started: now,
                            write: Write::Replace {
                                expect: lease.resource_version.clone(),
                                record: ours("", SECOND),
                            },
                        }
                    }
                    _ => Phase::Idle,
                },
                (Phase::Read { started, lease }, _) => {
                    let (decision, observed) = decide(
                        lease.as_ref(),
                        &r.identity,
                        now,
                        r.observed.as_ref(),
                        r.leader.leading_at(now),
                    );
                    r.observed = observed;
                    let mine = ours(&r.identity, LEASE);
                    match (decision, lease) {
                        (LeaseDecision::Create, _) => Phase::Writing { started, write: Write::Create(mine) },
                        (LeaseDecision::Acquire | LeaseDecision::Renew, Some(lease)) => Phase::Writing {
                            started,
                            write: Write::Replace { expect: lease.resource_version, record: mine },
                        },
                        _ => {
                            r.leader.follow(None);
                            Phase::Idle
                        }
                    }
                }
                (Phase::Writing { write, .. }, Op::Abandon) => {
                    network.push(write);
                    Phase::Idle
                }
                (Phase::Writing { started, write }, _) => Phase::Written { started, done: server.apply(&write) },
                (Phase::Written { .. }, Op::LoseAnswer) => Phase::Idle,
                (Phase::Written { started, done }, _) => {
                    match done {
                        Some(record) if !r.releasing => {
                            r.observed = Some(Observation { record, at: now });
                            r.leader.lead_until(leads_until(started, &timing), None);
                        }
                        Some(_) => {}
                        None => r.leader.follow(None),
                    }
                    Phase::Idle
                }
            };
            if matches!(op, Op::Deliver) && !network.is_empty() {
                let write = network.remove(0);
                server.apply(&write);
            }
            let leaders: Vec<&str> = replicas
                .iter()
                .filter(|r| r.leader.leading_at(local(r)))
                .map(|r| r.identity.as_str())
                .collect();
            prop_assert!(leaders.len() <= 1, "two leaders at {real:.3}s: {leaders:?}");
        }
    }
}
