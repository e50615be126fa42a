//! The cluster view: kube-rs reflectors over Device CRs and Pods whose events
//! also keep the [`Ledger`] current. On a (re)list the ledger is rebuilt from
//! what the list holds, so a restarted scheduler starts from the pods' annotations.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
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

/// Starts the watches; they run until the process ends, retrying with backoff.
pub fn watch(client: Client, ledger: Arc<Mutex<Ledger>>) -> ClusterView {
    let ready = Arc::new(AtomicBool::new(false));
    let devices_ready = Arc::new(AtomicBool::new(false));
    let pods_ready = Arc::new(AtomicBool::new(false));

    let (device_reader, device_writer) = reflector::store::<Device>();
    let device_stream = reflector::reflector(
        device_writer,
        watcher(
            Api::<Device>::all(client.clone()),
            watcher::Config::default(),
        ),
    )
    .default_backoff();
    {
        let ledger = Arc::clone(&ledger);
        let (mine, all) = (
            Arc::clone(&devices_ready),
            (Arc::clone(&pods_ready), Arc::clone(&ready)),
        );
        tokio::spawn(async move {
            let mut seen = HashSet::new();
            let mut stream = std::pin::pin!(device_stream);
            while let Some(event) = stream.next().await {
                match event {
                    Ok(watcher::Event::Init) => seen.clear(),
                    Ok(watcher::Event::InitApply(device) | watcher::Event::Apply(device)) => {
                        seen.extend(device.metadata.name.clone());
                        lock(&ledger).apply_device(&device);
                    }
                    Ok(watcher::Event::Delete(device)) => {
                        if let Some(name) = &device.metadata.name {
                            lock(&ledger).delete_device(name);
                        }
                    }
                    Ok(watcher::Event::InitDone) => {
                        let mut ledger = lock(&ledger);
                        let gone: Vec<String> = ledger
                            .nodes()
                            .map(|n| n.name.clone())
                            .filter(|n| !seen.contains(n))
                            .collect();
                        for name in gone {
                            ledger.delete_device(&name);
                        }
                        drop(ledger);
                        mine.store(true, Ordering::SeqCst);
                        all.1.store(all.0.load(Ordering::SeqCst), Ordering::SeqCst);
                    }
                    Err(error) => tracing::warn!(%error, "Device watch error; retrying"),
                }
            }
        });
    }

    let (pod_reader, pod_writer) = reflector::store::<Pod>();
    let pod_stream = reflector::reflector(
        pod_writer,
        watcher(Api::<Pod>::all(client), watcher::Config::default()),
    )
    .default_backoff();
    {
        let (mine, all) = (
            Arc::clone(&pods_ready),
            (Arc::clone(&devices_ready), Arc::clone(&ready)),
        );
        tokio::spawn(async move {
            let mut seen = HashSet::new();
            let mut stream = std::pin::pin!(pod_stream);
            while let Some(event) = stream.next().await {
                match event {
                    Ok(watcher::Event::Init) => seen.clear(),
                    Ok(watcher::Event::InitApply(pod) | watcher::Event::Apply(pod)) => {
                        seen.extend(pod.metadata.uid.clone());
                        lock(&ledger).apply_pod(&pod);
                    }
                    Ok(watcher::Event::Delete(pod)) => {
                        if let Some(uid) = &pod.metadata.uid {
                            lock(&ledger).delete_pod(uid);
                        }
                    }
                    Ok(watcher::Event::InitDone) => {
                        lock(&ledger).retain_pods(&seen);
                        mine.store(true, Ordering::SeqCst);
                        all.1.store(all.0.load(Ordering::SeqCst), Ordering::SeqCst);
                    }
                    Err(error) => tracing::warn!(%error, "Pod watch error; retrying"),
                }
            }
        });
    }
    ClusterView {
        pods: pod_reader,
        devices: device_reader,
        ready,
    }
}
