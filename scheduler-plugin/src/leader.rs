//! Lease-based leader election (coordination.k8s.io/v1) as client-go's
//! `leaderelection` does it: exactly one replica binds, and a replica that cannot
//! prove it still leads stops writing.
//!
//! - [`decide`] is the whole decision, pure: from the Lease as read, this
//!   replica's identity, the local clock and what it observed before, it says
//!   create, acquire, renew, wait or lost.
//! - Expiry is judged by the *local* time at which this replica first saw the
//!   current Lease record, plus the record's `leaseDurationSeconds`, never by the
//!   holder's `renewTime`: clocks of two machines may disagree by any amount.
//! - A leader believes it leads until `renew deadline` after the start of its last
//!   successful round ([`Leader`]); past it, it stops binding even if its renewal
//!   hangs (fencing). The deadline is shorter than the lease duration, so the old
//!   leader has stopped before any other replica can judge the Lease expired.
//! - Writes carry the resourceVersion read: of two replicas racing for one
//!   record, one gets a Conflict.
//! - [`Election::release`] hands the Lease over on SIGTERM (holder empty,
//!   duration 1 s, as client-go's `ReleaseOnCancel`), so a rollout costs no wait.
//!
//! The leader writes where it listens into the Lease, so a follower that gets a
//! bind (kube-scheduler reaches replicas through one Service) hands it over.

use std::collections::BTreeMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};

/// Lease annotation holding the leader's extender URL.
pub const EXTENDER_URL_ANNOTATION: &str = "tessera.io/extender-url";

/// client-go's `JitterFactor`: a follower waits between 1 and 2.2 retry periods.
pub const JITTER_FACTOR: f64 = 1.2;

/// Lease settings.
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    /// Lease namespace.
    pub namespace: String,
    /// Lease name.
    pub name: String,
    /// This replica's identity.
    pub identity: String,
    /// How long a lease holds without renewal, as written into the Lease (whole
    /// seconds, rounded up).
    pub duration: Duration,
    /// Where other replicas reach this one's extender (`http://<pod IP>:<port>`).
    pub url: Option<String>,
}

/// The timing of an election besides the lease duration (kube-scheduler's
/// `--leader-elect-renew-deadline` and `--leader-elect-retry-period`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ElectionTiming {
    /// How long a leader keeps leading after the start of its last successful
    /// round; it stops binding when this passes without a renewal.
    pub renew_deadline: Duration,
    /// Time between rounds (a follower's is jittered up to [`JITTER_FACTOR`] more).
    pub retry_period: Duration,
}

impl Default for ElectionTiming {
    fn default() -> Self {
        Self {
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }
}

/// Why the election's settings are refused at startup; each names its flags.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TimingError {
    /// A renew deadline not under the lease duration would let two replicas lead.
    #[error(
        "--leader-elect-lease-duration ({lease:?}) must be greater than --leader-elect-renew-deadline ({renew:?})"
    )]
    DeadlineNotUnderLease {
        /// The lease duration.
        lease: Duration,
        /// The renew deadline.
        renew: Duration,
    },
    /// The leader would give up before its first retry could succeed.
    #[error(
        "--leader-elect-renew-deadline ({renew:?}) must be greater than {JITTER_FACTOR} × --leader-elect-retry-period ({retry:?})"
    )]
    RetryNotUnderDeadline {
        /// The renew deadline.
        renew: Duration,
        /// The retry period.
        retry: Duration,
    },
    /// A zero retry period would spin.
    #[error("--leader-elect-retry-period must be greater than 0")]
    ZeroRetry,
}

impl ElectionTiming {
    /// Checks the settings together, as client-go's `NewLeaderElector` does.
    pub fn validate(&self, lease_duration: Duration) -> Result<(), TimingError> {
        if self.retry_period.is_zero() {
            return Err(TimingError::ZeroRetry);
        }
        if lease_duration <= self.renew_deadline {
            return Err(TimingError::DeadlineNotUnderLease {
                lease: lease_duration,
                renew: self.renew_deadline,
            });
        }
        if self.renew_deadline.as_secs_f64() <= JITTER_FACTOR * self.retry_period.as_secs_f64() {
            return Err(TimingError::RetryNotUnderDeadline {
                renew: self.renew_deadline,
                retry: self.retry_period,
            });
        }
        Ok(())
    }
}

pub use tessera_daemon::binary::{DurationError, parse_duration};

// === the decision (pure) ===

/// The fields of a Lease the election reads.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LeaseRecord {
    /// `holderIdentity`; empty when nobody holds it (released or never taken).
    pub holder: String,
    /// `leaseDurationSeconds`, as the holder wrote it.
    pub duration: Duration,
    /// `renewTime` as written, only to notice a change: never compared with a clock.
    pub renew_time: String,
    /// `metadata.resourceVersion`: changes on every write.
    pub resource_version: String,
}

impl LeaseRecord {
    /// The fields of `lease`.
    pub fn of(lease: &Lease) -> Self {
        let spec = lease.spec.as_ref();
        let seconds = spec
            .and_then(|s| s.lease_duration_seconds)
            .map_or(0, |d| u64::try_from(d).unwrap_or(0));
        Self {
            holder: spec
                .and_then(|s| s.holder_identity.clone())
                .unwrap_or_default(),
            duration: Duration::from_secs(seconds),
            renew_time: spec
                .and_then(|s| s.renew_time.as_ref())
                .map(|t| t.0.to_string())
                .unwrap_or_default(),
            resource_version: lease.metadata.resource_version.clone().unwrap_or_default(),
        }
    }
}

/// A Lease record and the local time this replica first saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observation {
    /// The record.
    pub record: LeaseRecord,
    /// When this replica first read it (its own monotonic clock).
    pub at: Instant,
}

/// What one round does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseDecision {
    /// No Lease exists: create it, held by us.
    Create,
    /// Nobody holds it, or its holder has not renewed it for its duration as we
    /// observed it: take it (transitions + 1).
    Acquire,
    /// We hold it: renew it.
    Renew,
    /// Another replica holds it and has renewed it within its duration: follow.
    Wait,
    /// We believed we led but the Lease names another holder: stop leading now.
    Lost,
}

/// Decides a round from the Lease as read (`current`, `None` when there is none),
/// at local time `now` (taken after the read), given the record observed before
/// and whether this replica believes it leads. Returns the decision and the
/// observation to keep: `observed` when the record is unchanged, else the new
/// record seen at `now`, so that expiry always counts from a local time.
pub fn decide(
    current: Option<&LeaseRecord>,
    identity: &str,
    now: Instant,
    observed: Option<&Observation>,
    leading: bool,
) -> (LeaseDecision, Option<Observation>) {
    let Some(current) = current else {
        return (LeaseDecision::Create, None);
    };
    let observed = match observed {
        Some(seen) if seen.record == *current => seen.clone(),
        _ => Observation {
            record: current.clone(),
            at: now,
        },
    };
    let decision = if current.holder == identity {
        LeaseDecision::Renew
    } else if leading {
        LeaseDecision::Lost
    } else if current.holder.is_empty() || expired(&observed, now) {
        LeaseDecision::Acquire
    } else {
        LeaseDecision::Wait
    };
    (decision, Some(observed))
}

/// Whether the observed record's holder has had its full duration, by our clock.
fn expired(observed: &Observation, now: Instant) -> bool {
    observed
        .at
        .checked_add(observed.record.duration)
        .is_none_or(|end| now >= end)
}

/// Until when a replica whose write succeeded leads: counted from the start of
/// the round (before the read), so never later than the write the others see.
pub fn leads_until(round_started: Instant, timing: &ElectionTiming) -> Instant {
    round_started + timing.renew_deadline
}

/// A follower's wait before its next round: `period` plus up to
/// [`JITTER_FACTOR`] × `period`, `unit` in `[0, 1)` picking where, so that
/// replicas started together do not race in step.
pub fn jittered(period: Duration, unit: f64) -> Duration {
    period.mul_f64(1.0 + JITTER_FACTOR * unit.clamp(0.0, 1.0))
}

fn random_unit() -> f64 {
    // Each RandomState is freshly seeded: enough randomness for spreading retries.
    let bits = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

// === impl Leader ===

#[derive(Debug, Clone, Copy)]
enum Term {
    Follower,
    Until(Instant),
    /// A single replica with no election (tests, the demo).
    Always,
}

/// Who leads, as one replica last saw it.
#[derive(Debug)]
pub struct Leader {
    // Each held only to read or replace a value, never across an await.
    term: Mutex<Term>,
    url: Mutex<Option<String>>,
}

impl Default for Leader {
    fn default() -> Self {
        Self::new(false)
    }
}

use tessera_daemon::sync::lock;

impl Leader {
    /// A view that leads for good (a single replica without election) or follows,
    /// with no leader URL known.
    pub fn new(leading: bool) -> Self {
        Self {
            term: Mutex::new(if leading {
                Term::Always
            } else {
                Term::Follower
            }),
            url: Mutex::new(None),
        }
    }

    /// A follower's view of a leader reachable at `url`.
    pub fn following(url: impl Into<String>) -> Self {
        Self {
            term: Mutex::new(Term::Follower),
            url: Mutex::new(Some(url.into())),
        }
    }

    /// Whether this replica leads now: false once its renew deadline has passed,
    /// however stuck the renewal is.
    pub fn leading(&self) -> bool {
        self.leading_at(Instant::now())
    }

    fn leading_at(&self, now: Instant) -> bool {
        match *lock(&self.term) {
            Term::Follower => false,
            Term::Until(until) => now < until,
            Term::Always => true,
        }
    }

    /// The leader's extender URL, when it advertised one.
    pub fn url(&self) -> Option<String> {
        lock(&self.url).clone()
    }

    /// Leads until `until`, reachable at `url`.
    pub fn lead_until(&self, until: Instant, url: Option<String>) {
        *lock(&self.url) = url;
        *lock(&self.term) = Term::Until(until);
    }

    /// Follows the leader at `url` (when known); stops leading at once.
    pub fn follow(&self, url: Option<String>) {
        *lock(&self.term) = Term::Follower;
        *lock(&self.url) = url;
    }

    /// Stops leading at once, keeping the leader URL.
    pub fn step_down(&self) {
        *lock(&self.term) = Term::Follower;
    }
}

/// The outcome of one election round.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LeaseState {
    /// Whether this replica holds the lease.
    pub leading: bool,
    /// The holder's extender URL, when it advertised one.
    pub leader_url: Option<String>,
}

// === impl Candidate ===

/// Why a round failed to reach a decision or carry it out. Leadership is kept
/// until its deadline: one failed call is not a reason to step down.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// Reading the Lease failed.
    #[error("reading Lease {lease}: {source}")]
    Read {
        /// `namespace/name`.
        lease: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// Creating, renewing, taking or releasing the Lease failed (not a Conflict).
    #[error("writing Lease {lease}: {source}")]
    Write {
        /// `namespace/name`.
        lease: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// The round took longer than it may.
    #[error("Lease {lease}: no answer in {after:?}")]
    Timeout {
        /// `namespace/name`.
        lease: String,
        /// The limit.
        after: Duration,
    },
}

/// One replica's side of the election: its settings and what it observed.
#[derive(Debug)]
pub struct Candidate {
    config: LeaseConfig,
    timing: ElectionTiming,
    observed: Option<Observation>,
}

fn is_conflict(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == 409)
}

fn advertised_url(lease: &Lease) -> Option<String> {
    lease
        .metadata
        .annotations
        .as_ref()?
        .get(EXTENDER_URL_ANNOTATION)
        .cloned()
}

impl Candidate {
    /// A candidate that has observed nothing yet.
    pub fn new(config: LeaseConfig, timing: ElectionTiming) -> Self {
        Self {
            config,
            timing,
            observed: None,
        }
    }

    fn lease_name(&self) -> String {
        format!("{}/{}", self.config.namespace, self.config.name)
    }

    /// The Lease as it is now, if it exists.
    async fn read(&self, api: &Api<Lease>) -> Result<Option<Lease>, LeaseError> {
        api.get_opt(&self.config.name)
            .await
            .map_err(|source| LeaseError::Read {
                lease: self.lease_name(),
                source,
            })
    }

    /// Whole seconds, at least 1: the Lease carries seconds, and rounding up only
    /// makes others wait longer.
    fn duration_seconds(&self) -> i32 {
        let secs = self.config.duration.as_secs_f64().ceil().max(1.0);
        i32::try_from(secs as i64).unwrap_or(i32::MAX)
    }

    /// One round: read, [`decide`], and write when the decision says so (only when
    /// `contend`: a replica whose cache is not synced reads who leads, and a leader
    /// among them stops leading). Updates `leader` and returns the decision.
    pub async fn round(
        &mut self,
        api: &Api<Lease>,
        contend: bool,
        leader: &Leader,
    ) -> Result<LeaseDecision, LeaseError> {
        let started = Instant::now();
        let current = self.read(api).await?;
        let record = current.as_ref().map(LeaseRecord::of);
        let (decision, observed) = decide(
            record.as_ref(),
            &self.config.identity,
            Instant::now(),
            self.observed.as_ref(),
            leader.leading(),
        );
        self.observed = observed;
        let holder_url = current.as_ref().and_then(advertised_url);
        if !contend {
            let ours = record
                .as_ref()
                .is_some_and(|r| r.holder == self.config.identity);
            leader.follow(if ours { None } else { holder_url });
            return Ok(decision);
        }
        let written = match (decision, current) {
            (LeaseDecision::Wait | LeaseDecision::Lost, _) => {
                leader.follow(holder_url);
                return Ok(decision);
            }
            (LeaseDecision::Create, _) | (_, None) => {
                let lease = self.new_lease();
                api.create(&PostParams::default(), &lease).await
            }
            (LeaseDecision::Acquire | LeaseDecision::Renew, Some(lease)) => {
                let lease = self.taken(lease, decision == LeaseDecision::Renew);
                // replace carries the resourceVersion read: a concurrent write wins.
                api.replace(&self.config.name, &PostParams::default(), &lease)
                    .await
            }
        };
        match written {
            Ok(lease) => {
                self.observed = Some(Observation {
                    record: LeaseRecord::of(&lease),
                    at: Instant::now(),
                });
                leader.lead_until(leads_until(started, &self.timing), self.config.url.clone());
                Ok(decision)
            }
            Err(error) if is_conflict(&error) => {
                // Someone else wrote it since our read: whatever we believed, stop.
                leader.follow(None);
                Ok(LeaseDecision::Lost)
            }
            Err(source) => Err(LeaseError::Write {
                lease: self.lease_name(),
                source,
            }),
        }
    }

    /// [`Candidate::round`] bounded in time, its trouble logged. A round may not
    /// outlive half the renew deadline: a hung call must leave time for another
    /// try before a leader has to stop.
    async fn logged_round(&mut self, api: &Api<Lease>, contend: bool, leader: &Leader) {
        let limit = self.timing.renew_deadline / 2;
        match tokio::time::timeout(limit, self.round(api, contend, leader)).await {
            Ok(Ok(LeaseDecision::Lost)) => {
                tracing::warn!(identity = %self.config.identity, "the Lease moved to another replica");
            }
            Ok(Ok(_)) => {}
            Ok(Err(error)) => tracing::warn!(%error, "leader election round failed"),
            Err(_) => {
                let error = LeaseError::Timeout {
                    lease: self.lease_name(),
                    after: limit,
                };
                tracing::warn!(%error, "leader election round failed");
            }
        }
    }

    fn annotations(&self) -> Option<BTreeMap<String, String>> {
        self.config
            .url
            .as_ref()
            .map(|url| BTreeMap::from([(EXTENDER_URL_ANNOTATION.to_owned(), url.clone())]))
    }

    fn new_lease(&self) -> Lease {
        let now = MicroTime(Timestamp::now());
        Lease {
            metadata: ObjectMeta {
                name: Some(self.config.name.clone()),
                namespace: Some(self.config.namespace.clone()),
                annotations: self.annotations(),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(self.config.identity.clone()),
                lease_duration_seconds: Some(self.duration_seconds()),
                acquire_time: Some(now.clone()),
                renew_time: Some(now),
                lease_transitions: Some(0),
                ..LeaseSpec::default()
            }),
        }
    }

    /// `lease` held by us: renewed (acquire time and transitions kept) or taken.
    fn taken(&self, mut lease: Lease, renew: bool) -> Lease {
        let now = MicroTime(Timestamp::now());
        let current = lease.spec.take().unwrap_or_default();
        let transitions = current.lease_transitions.unwrap_or(0);
        lease.spec = Some(LeaseSpec {
            holder_identity: Some(self.config.identity.clone()),
            lease_duration_seconds: Some(self.duration_seconds()),
            acquire_time: if renew {
                current.acquire_time.or_else(|| Some(now.clone()))
            } else {
                Some(now.clone())
            },
            renew_time: Some(now),
            lease_transitions: Some(if renew {
                transitions
            } else {
                transitions.saturating_add(1)
            }),
            ..current
        });
        let annotations = lease.metadata.annotations.get_or_insert_default();
        match &self.config.url {
            Some(url) => {
                annotations.insert(EXTENDER_URL_ANNOTATION.to_owned(), url.clone());
            }
            None => {
                annotations.remove(EXTENDER_URL_ANNOTATION);
            }
        }
        lease
    }

    /// Hands the Lease over when we hold it: holder empty, duration 1 s, renew and
    /// acquire time now (client-go's `ReleaseOnCancel`), conditional on the
    /// resourceVersion read. Returns whether a Lease we held was released. Call only
    /// once this replica has stopped leading and stopped its rounds.
    pub async fn release(&mut self, api: &Api<Lease>) -> Result<bool, LeaseError> {
        let read = self.read(api).await?;
        let Some(mut lease) = read else {
            return Ok(false);
        };
        if LeaseRecord::of(&lease).holder != self.config.identity {
            return Ok(false);
        }
        let now = MicroTime(Timestamp::now());
        let current = lease.spec.take().unwrap_or_default();
        lease.spec = Some(LeaseSpec {
            holder_identity: Some(String::new()),
            lease_duration_seconds: Some(1),
            acquire_time: Some(now.clone()),
            renew_time: Some(now),
            ..current
        });
        if let Some(annotations) = lease.metadata.annotations.as_mut() {
            annotations.remove(EXTENDER_URL_ANNOTATION);
        }
        match api
            .replace(&self.config.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Ok(true),
            // Written by someone else since our read: not ours to release any more.
            Err(error) if is_conflict(&error) => Ok(false),
            Err(source) => Err(LeaseError::Write {
                lease: self.lease_name(),
                source,
            }),
        }
    }
}

/// One round with nothing observed before: creates a missing Lease, takes a
/// released one or renews ours; a Lease held by another replica is never judged
/// expired (that needs an [`Election`] that has watched it for its duration).
pub async fn try_lead(api: &Api<Lease>, config: &LeaseConfig) -> Result<LeaseState, LeaseError> {
    let mut candidate = Candidate::new(config.clone(), ElectionTiming::default());
    let leader = Leader::new(false);
    candidate.round(api, true, &leader).await?;
    Ok(LeaseState {
        leading: leader.leading(),
        leader_url: leader.url(),
    })
}

// === impl Election ===

/// The election running in its own task, and what is needed to end it.
#[derive(Debug)]
pub struct Election {
    task: Option<tokio::task::JoinHandle<()>>,
    stop: Arc<tokio::sync::Notify>,
    api: Api<Lease>,
    config: LeaseConfig,
    timing: ElectionTiming,
    leader: Arc<Leader>,
}

impl Election {
    /// Runs rounds until stopped: every retry period while leading, a jittered
    /// one while following; contends only while `synced` (the cluster cache's
    /// readiness) is true. Updates `leader`.
    pub fn start(
        client: Client,
        config: LeaseConfig,
        timing: ElectionTiming,
        leader: Arc<Leader>,
        synced: Arc<AtomicBool>,
    ) -> Self {
        let api: Api<Lease> = Api::namespaced(client, &config.namespace);
        let stop = Arc::new(tokio::sync::Notify::new());
        let task = {
            let (api, leader, stop) = (api.clone(), Arc::clone(&leader), Arc::clone(&stop));
            let mut candidate = Candidate::new(config.clone(), timing);
            tokio::spawn(async move {
                let mut was_leading = false;
                loop {
                    let contend = synced.load(Ordering::SeqCst);
                    tokio::select! {
                        () = stop.notified() => return,
                        () = candidate.logged_round(&api, contend, &leader) => {}
                    }
                    let leading = leader.leading();
                    if leading != was_leading {
                        tracing::info!(identity = %candidate.config.identity, leading, "leadership changed");
                        was_leading = leading;
                    }
                    let wait = if leading {
                        timing.retry_period
                    } else {
                        jittered(timing.retry_period, random_unit())
                    };
                    tokio::select! {
                        () = stop.notified() => return,
                        () = tokio::time::sleep(wait) => {}
                    }
                }
            })
        };
        Self {
            task: Some(task),
            stop,
            api,
            config,
            timing,
            leader,
        }
    }

    /// Ends the rounds as a crash would: no release (tests).
    pub fn abort(&self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }

    /// Stops the rounds (none renews after this returns) and stops leading: from
    /// here no new bind of this replica writes. The Lease is left as it is; call
    /// [`Election::release`] once running binds have ended.
    pub async fn step_down(&mut self) {
        if let Some(task) = self.task.take() {
            self.stop.notify_one();
            // An aborted or panicked task has stopped all the same.
            let _ = task.await;
        }
        self.leader.step_down();
    }

    /// Stops the rounds and hands the Lease over when we hold it (SIGTERM), so a
    /// rollout's new leader takes it at its next round instead of after the lease
    /// duration. Returns whether a Lease we held was released.
    pub async fn release(mut self) -> Result<bool, LeaseError> {
        self.step_down().await;
        Candidate::new(self.config.clone(), self.timing)
            .release(&self.api)
            .await
    }
}

#[cfg(test)]
mod tests;
