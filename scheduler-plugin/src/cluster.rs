//! The cluster view: kube-rs reflectors over Device CRs and Pods whose events
//! also keep the [`Ledger`] current. On a (re)list the ledger is rebuilt from
//! what the list holds, so a restarted scheduler starts from the pods' annotations.
//!
//! Readiness: the view is ready only while every watch has listed and is live. A
//! relist makes it not ready until the list is done; a watch error ends the watch
//! and, after a backoff, starts a relist (so a watch that died and came back proves
//! it with a complete list, not with silence). [`synced_after`] decides it.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use kube::{Api, Client};
use tessera_api::Device;

use crate::ledger::Ledger;

/// Readers of the reflectors and readiness.
#[derive(Debug, Clone)]
pub struct ClusterView {
    /// Pods, for bind (the extender's bind args carry only names).
    pub pods: Store<Pod>,
    /// Device CRs.
    pub devices: Store<Device>,
    /// True while every watch has listed and is live (false at start, during a
    /// relist, after a watch error until its relist is done).
    pub ready: Arc<AtomicBool>,
}

fn lock(ledger: &Mutex<Ledger>) -> std::sync::MutexGuard<'_, Ledger> {
    ledger
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// How one kind of object feeds the ledger.
trait Feed:
    kube::Resource + Clone + std::fmt::Debug + Send + Sync + serde::de::DeserializeOwned + 'static
{
    /// The ledger's key of an object (node name, pod UID).
    fn key(&self) -> Option<String>;
    /// Added or changed.
    fn apply(&self, ledger: &mut Ledger);
    /// Deleted.
    fn delete(key: &str, ledger: &mut Ledger);
    /// After a relist: forget what was not listed.
    fn retain(seen: &HashSet<String>, ledger: &mut Ledger);
}

impl Feed for Device {
    fn key(&self) -> Option<String> {
        self.metadata.name.clone()
    }
    fn apply(&self, ledger: &mut Ledger) {
        ledger.apply_device(self);
    }
    fn delete(key: &str, ledger: &mut Ledger) {
        ledger.delete_device(key);
    }
    fn retain(seen: &HashSet<String>, ledger: &mut Ledger) {
        ledger.retain_devices(seen);
    }
}

impl Feed for Pod {
    fn key(&self) -> Option<String> {
        self.metadata.uid.clone()
    }
    fn apply(&self, ledger: &mut Ledger) {
        ledger.apply_pod(self);
    }
    fn delete(key: &str, ledger: &mut Ledger) {
        ledger.delete_pod(key);
    }
    fn retain(seen: &HashSet<String>, ledger: &mut Ledger) {
        ledger.retain_pods(seen);
    }
}

/// How many watches must be synced for the view to be ready.
const WATCHES: usize = 2;

/// Whether a watch is synced after `event`: `Some(false)` when a relist starts or
/// the watch failed, `Some(true)` when a list is complete, `None` when unchanged.
pub fn synced_after<K>(event: &Result<watcher::Event<K>, watcher::Error>) -> Option<bool> {
    match event {
        Ok(watcher::Event::Init) | Err(_) => Some(false),
        Ok(watcher::Event::InitDone) => Some(true),
        Ok(_) => None,
    }
}

/// Per-watch sync state; `ready` is true when all are synced.
#[derive(Debug)]
struct Readiness {
    synced: Mutex<[bool; WATCHES]>,
    ready: Arc<AtomicBool>,
}

impl Readiness {
    fn set(&self, watch: usize, synced: bool) {
        let mut all = self
            .synced
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        all[watch] = synced;
        let ready = all.iter().all(|s| *s);
        if self.ready.swap(ready, Ordering::SeqCst) != ready {
            tracing::info!(ready, "cluster cache readiness changed");
        }
    }
}

/// Shortest and longest wait before a relist after a watch error.
const RELIST_BACKOFF: (Duration, Duration) = (Duration::from_millis(200), Duration::from_secs(30));

/// Runs a reflector over every `K` and applies its events to the ledger; returns its store.
fn follow<K>(
    client: Client,
    ledger: Arc<Mutex<Ledger>>,
    readiness: Arc<Readiness>,
    watch: usize,
) -> Store<K>
where
    K: Feed<DynamicType = ()>,
{
    let (reader, mut writer) = reflector::store::<K>();
    let api = Api::<K>::all(client);
    tokio::spawn(async move {
        let mut seen = HashSet::new();
        let mut backoff = RELIST_BACKOFF.0;
        loop {
            let mut stream = std::pin::pin!(watcher(api.clone(), watcher::Config::default()));
            while let Some(event) = stream.next().await {
                if let Some(synced) = synced_after(&event) {
                    readiness.set(watch, synced);
                }
                let event = match event {
                    Ok(event) => event,
                    Err(error) => {
                        tracing::warn!(kind = %K::kind(&()), %error, ?backoff, "watch failed; relisting");
                        break;
                    }
                };
                writer.apply_watcher_event(&event);
                match event {
                    watcher::Event::Init => seen.clear(),
                    watcher::Event::InitApply(object) | watcher::Event::Apply(object) => {
                        seen.extend(object.key());
                        object.apply(&mut lock(&ledger));
                    }
                    watcher::Event::Delete(object) => {
                        if let Some(key) = object.key() {
                            K::delete(&key, &mut lock(&ledger));
                        }
                    }
                    watcher::Event::InitDone => {
                        K::retain(&seen, &mut lock(&ledger));
                        backoff = RELIST_BACKOFF.0;
                    }
                }
            }
            readiness.set(watch, false);
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(RELIST_BACKOFF.1);
        }
    });
    reader
}

/// Starts the watches; they run until the process ends, retrying with backoff.
pub fn watch(client: Client, ledger: Arc<Mutex<Ledger>>) -> ClusterView {
    let ready = Arc::new(AtomicBool::new(false));
    let readiness = Arc::new(Readiness {
        synced: Mutex::new([false; WATCHES]),
        ready: Arc::clone(&ready),
    });
    let devices = follow::<Device>(
        client.clone(),
        Arc::clone(&ledger),
        Arc::clone(&readiness),
        0,
    );
    let pods = follow::<Pod>(client, ledger, readiness, 1);
    ClusterView {
        pods,
        devices,
        ready,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watch_is_synced_from_a_complete_list_until_a_relist_or_an_error() {
        let event = |e: watcher::Event<Pod>| synced_after(&Ok(e));
        assert_eq!(event(watcher::Event::Init), Some(false));
        assert_eq!(event(watcher::Event::InitApply(Pod::default())), None);
        assert_eq!(event(watcher::Event::InitDone), Some(true));
        assert_eq!(event(watcher::Event::Apply(Pod::default())), None);
        assert_eq!(event(watcher::Event::Delete(Pod::default())), None);
        let failed: Result<watcher::Event<Pod>, _> = Err(watcher::Error::NoResourceVersion);
        assert_eq!(synced_after(&failed), Some(false));
    }

    #[test]
    fn ready_only_while_every_watch_is_synced() {
        let readiness = Readiness {
            synced: Mutex::new([false; WATCHES]),
            ready: Arc::new(AtomicBool::new(false)),
        };
        readiness.set(0, true);
        assert!(!readiness.ready.load(Ordering::SeqCst));
        readiness.set(1, true);
        assert!(readiness.ready.load(Ordering::SeqCst));
        readiness.set(1, false);
        assert!(!readiness.ready.load(Ordering::SeqCst));
    }
}
