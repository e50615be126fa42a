//! Lease-based leader election (coordination.k8s.io/v1): exactly one replica binds.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};

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
}

/// One attempt to acquire or renew; returns whether this replica leads.
pub async fn try_lead(api: &Api<Lease>, config: &LeaseConfig) -> Result<bool, kube::Error> {
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
                    ..ObjectMeta::default()
                },
                spec: Some(LeaseSpec {
                    acquire_time: Some(MicroTime(now)),
                    ..spec
                }),
            };
            match api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
                Err(error) => Err(error),
            }
        }
        Some(mut lease) => {
            let current = lease.spec.clone().unwrap_or_default();
            let mine = current.holder_identity.as_deref() == Some(config.identity.as_str());
            let expired = current.renew_time.as_ref().is_none_or(|renewed| {
                let held = Duration::from_secs(
                    u64::try_from(current.lease_duration_seconds.unwrap_or(15)).unwrap_or(15),
                );
                now.duration_since(renewed.0).as_secs_f64() > held.as_secs_f64()
            });
            if !mine && !expired {
                return Ok(false);
            }
            let acquire = if mine {
                current.acquire_time.clone()
            } else {
                Some(MicroTime(now))
            };
            let transitions = current.lease_transitions.unwrap_or(0) + i32::from(!mine);
            lease.spec = Some(LeaseSpec {
                acquire_time: acquire,
                lease_transitions: Some(transitions),
                ..spec
            });
            // replace carries the resourceVersion: a concurrent taker gets a Conflict, not the lease.
            match api
                .replace(&config.name, &PostParams::default(), &lease)
                .await
            {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
                Err(error) => Err(error),
            }
        }
    }
}

/// Keeps trying to lead every third of the lease duration, updating `leader`.
pub fn run(
    client: Client,
    config: LeaseConfig,
    leader: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let api: Api<Lease> = Api::namespaced(client, &config.namespace);
        loop {
            let leading = match try_lead(&api, &config).await {
                Ok(leading) => leading,
                Err(error) => {
                    tracing::warn!(%error, "lease renewal failed");
                    false
                }
            };
            if leading != leader.swap(leading, Ordering::SeqCst) {
                tracing::info!(identity = %config.identity, leading, "leadership changed");
            }
            tokio::time::sleep(config.duration / 3).await;
        }
    })
}
