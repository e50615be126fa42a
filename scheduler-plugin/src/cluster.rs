//! The cluster view: kube-rs reflectors over Device CRs and Pods whose events
//! also keep the [`Ledger`] current. On a (re)list the ledger is rebuilt from
//! what the list holds, so a restarted scheduler starts from the pods' annotations.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
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
    /// True once both watches have listed everything once.
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

/// How many watches must list once before the view is ready.
const WATCHES: usize = 2;

/// Runs a reflector over every `K` and applies its events to the ledger; returns its store.
fn follow<K>(
    client: Client,
    ledger: Arc<Mutex<Ledger>>,
    synced: Arc<AtomicUsize>,
    ready: Arc<AtomicBool>,
) -> Store<K>
where
    K: Feed<DynamicType = ()>,
{
    let (reader, writer) = reflector::store::<K>();
    let stream = reflector::reflector(
        writer,
        watcher(Api::<K>::all(client), watcher::Config::default()),
    )
    .default_backoff();
    tokio::spawn(async move {
        let mut seen = HashSet::new();
        let mut listed_once = false;
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            match event {
                Ok(watcher::Event::Init) => seen.clear(),
                Ok(watcher::Event::InitApply(object) | watcher::Event::Apply(object)) => {
                    seen.extend(object.key());
                    object.apply(&mut lock(&ledger));
                }
                Ok(watcher::Event::Delete(object)) => {
                    if let Some(key) = object.key() {
                        K::delete(&key, &mut lock(&ledger));
                    }
                }
                Ok(watcher::Event::InitDone) => {
                    K::retain(&seen, &mut lock(&ledger));
                    if !std::mem::replace(&mut listed_once, true)
                        && synced.fetch_add(1, Ordering::SeqCst) + 1 == WATCHES
                    {
                        ready.store(true, Ordering::SeqCst);
                    }
                }
                Err(error) => tracing::warn!(kind = %K::kind(&()), %error, "watch error; retrying"),
            }
        }
    });
    reader
}

/// Starts the watches; they run until the process ends, retrying with backoff.
pub fn watch(client: Client, ledger: Arc<Mutex<Ledger>>) -> ClusterView {
    let ready = Arc::new(AtomicBool::new(false));
    let synced = Arc::new(AtomicUsize::new(0));
    let devices = follow::<Device>(
        client.clone(),
        Arc::clone(&ledger),
        Arc::clone(&synced),
        Arc::clone(&ready),
    );
    let pods = follow::<Pod>(client, ledger, synced, Arc::clone(&ready));
    ClusterView {
        pods,
        devices,
        ready,
    }
}
