//! Helpers shared by the scheduler's tests against the API server double.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tessera_allocator::ledger::Ledger;
use tessera_harness::apiserver::ApiServer;
use tessera_scheduler::extender::{Extender, ExtenderConfig};
use tessera_scheduler::leader::Leader;

/// An extender leading alone over `api`, its caches synced.
pub async fn extender(api: &ApiServer, config: ExtenderConfig) -> (Extender, Arc<Mutex<Ledger>>) {
    let client = api.client().expect("client");
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let view = tessera_scheduler::cluster::watch(client.clone(), Arc::clone(&ledger));
    for _ in 0..250 {
        if view.ready.load(Ordering::SeqCst) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(view.ready.load(Ordering::SeqCst), "cache never synced");
    let extender = Extender::new(
        Arc::clone(&ledger),
        Some(client),
        Some(view.pods),
        config,
        view.ready,
        Arc::new(Leader::new(true)),
    );
    (extender, ledger)
}
