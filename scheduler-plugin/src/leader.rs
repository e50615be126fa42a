//! Lease-based leader election (coordination.k8s.io/v1): exactly one replica binds.
//! The leader writes where it listens into the Lease, so a follower that gets a
//! bind (kube-scheduler reaches replicas through one Service) hands it over.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};

/// Lease annotation holding the leader's extender URL.
pub const EXTENDER_URL_ANNOTATION: &str = "tessera.io/extender-url";

/// Lease settings.
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    /// Lease namespace.
    pub namespace: String,
    /// Lease name.
    pub name: String,
    /// This replica's identity.
    pub identity: String,
    /// How long a lease holds without renewal.
    pub duration: Duration,
    /// Where other replicas reach this one's extender (`http://<pod IP>:<port>`).
    pub url: Option<String>,
}

/// Who leads, as one replica last saw it.
#[derive(Debug, Default)]
pub struct Leader {
    leading: AtomicBool,
    // Held only to read or replace the string, never across an await.
    url: Mutex<Option<String>>,
}

impl Leader {
    /// A view that starts out leading or not, with no leader URL known.
    pub fn new(leading: bool) -> Self {
        Self {
            leading: AtomicBool::new(leading),
            url: Mutex::new(None),
        }
    }

    /// A follower's view of a leader reachable at `url`.
    pub fn following(url: impl Into<String>) -> Self {
        Self {
            leading: AtomicBool::new(false),
            url: Mutex::new(Some(url.into())),
        }
    }

    /// Whether this replica leads.
    pub fn leading(&self) -> bool {
        self.leading.load(Ordering::SeqCst)
    }

    /// The leader's extender URL, when it advertised one.
    pub fn url(&self) -> Option<String> {
        self.url
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Records the outcome of an election round; returns whether leadership changed.
    pub fn set(&self, state: LeaseState) -> bool {
        *self
            .url
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = state.leader_url;
        self.leading.swap(state.leading, Ordering::SeqCst) != state.leading
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

/// One attempt to acquire or renew the lease.
pub async fn try_lead(api: &Api<Lease>, config: &LeaseConfig) -> Result<LeaseState, kube::Error> {
    let mine = LeaseState {
        leading: true,
        leader_url: config.url.clone(),
    };
    let lost = |lease: Option<&Lease>| LeaseState {
        leading: false,
        leader_url: lease.and_then(advertised_url),
    };
    let annotations = config
        .url
        .as_ref()
        .map(|url| BTreeMap::from([(EXTENDER_URL_ANNOTATION.to_owned(), url.clone())]));
    let now = Timestamp::now();
    let spec = LeaseSpec {
        holder_identity: Some(config.identity.clone()),
        lease_duration_seconds: Some(i32::try_from(config.duration.as_secs()).unwrap_or(15)),
        renew_time: Some(MicroTime(now)),
        ..LeaseSpec::default()
    };
    match api.get_opt(&config.name).await? {
        None => {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(config.name.clone()),
                    namespace: Some(config.namespace.clone()),
                    annotations,
                    ..ObjectMeta::default()
                },
                spec: Some(LeaseSpec {
                    acquire_time: Some(MicroTime(now)),
                    ..spec
                }),
            };
            match api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(mine),
                // Someone else created it first: their URL is read next round.
                Err(kube::Error::Api(status)) if status.code == 409 => Ok(lost(None)),
                Err(error) => Err(error),
            }
        }
        Some(mut lease) => {
            let current = lease.spec.clone().unwrap_or_default();
            let held = current.holder_identity.as_deref() == Some(config.identity.as_str());
            let expired = current.renew_time.as_ref().is_none_or(|renewed| {
                let held = Duration::from_secs(
                    u64::try_from(current.lease_duration_seconds.unwrap_or(15)).unwrap_or(15),
                );
                now.duration_since(renewed.0).as_secs_f64() > held.as_secs_f64()
            });
            if !held && !expired {
                return Ok(lost(Some(&lease)));
            }
            let acquire = if held {
                current.acquire_time.clone()
            } else {
                Some(MicroTime(now))
            };
            let transitions = current.lease_transitions.unwrap_or(0) + i32::from(!held);
            lease.spec = Some(LeaseSpec {
                acquire_time: acquire,
                lease_transitions: Some(transitions),
                ..spec
            });
            let lease_annotations = lease.metadata.annotations.get_or_insert_default();
            match &config.url {
                Some(url) => {
                    lease_annotations.insert(EXTENDER_URL_ANNOTATION.to_owned(), url.clone());
                }
                None => {
                    lease_annotations.remove(EXTENDER_URL_ANNOTATION);
                }
            }
            // replace carries the resourceVersion: a concurrent taker gets a Conflict, not the lease.
            match api
                .replace(&config.name, &PostParams::default(), &lease)
                .await
            {
                Ok(_) => Ok(mine),
                Err(kube::Error::Api(status)) if status.code == 409 => Ok(lost(None)),
                Err(error) => Err(error),
            }
        }
    }
}

fn advertised_url(lease: &Lease) -> Option<String> {
    lease
        .metadata
        .annotations
        .as_ref()?
        .get(EXTENDER_URL_ANNOTATION)
        .cloned()
}

/// Reads the lease without contending: who leads (their URL), never this replica.
pub async fn observe(api: &Api<Lease>, config: &LeaseConfig) -> Result<LeaseState, kube::Error> {
    Ok(LeaseState {
        leading: false,
        leader_url: api
            .get_opt(&config.name)
            .await?
            .as_ref()
            .and_then(advertised_url),
    })
}

/// Whether a round contends for the lease: only with a synced cluster cache. A
/// leader whose cache is not synced (relist, dead watch) stops renewing: it binds
/// nothing meanwhile, and if it stays unsynced the lease passes to a synced replica.
pub fn contends(synced: bool) -> bool {
    synced
}

/// Every third of the lease duration: tries to lead while `synced` (the cluster
/// cache's readiness) is true, else only reads who leads; updates `leader`.
pub fn run(
    client: Client,
    config: LeaseConfig,
    leader: Arc<Leader>,
    synced: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let api: Api<Lease> = Api::namespaced(client, &config.namespace);
        loop {
            let round = if contends(synced.load(Ordering::SeqCst)) {
                try_lead(&api, &config).await
            } else {
                observe(&api, &config).await
            };
            let state = match round {
                Ok(state) => state,
                Err(error) => {
                    tracing::warn!(%error, "lease renewal failed");
                    LeaseState::default()
                }
            };
            let leading = state.leading;
            if leader.set(state) {
                tracing::info!(identity = %config.identity, leading, "leadership changed");
            }
            tokio::time::sleep(config.duration / 3).await;
        }
    })
}
