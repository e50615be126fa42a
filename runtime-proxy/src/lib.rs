//! `tessera-runtime-proxy`: a CRI proxy between kubelet and the container runtime.
//!
//! Every call is forwarded frame by frame; lifecycle calls ([`hook::Method`]) are
//! decoded, passed through [`hook::Hook`]s, re-spliced at the wire level so fields
//! unknown to our CRI types survive ([`wire`]), and recorded in the [`store`].
//! kubelet's connection reaches h2 through [`authority`], so that an `:authority`
//! h2 would refuse (the socket path older kubelets send) does not fail its calls.
//! [`relay`] serves kubelet without terminating HTTP/2: frames relayed, lifecycle
//! calls through the same hook stages.

pub mod authority;
pub mod backend;
pub mod body;
pub mod config;
pub mod convert;
pub mod dispatch;
pub mod enforce;
pub mod gpu;
pub mod gpu_time;
pub mod grpc;
pub mod guard;
pub mod hook;
pub mod hpack;
pub mod kubelet_seen;
pub mod metrics;
pub mod proxy;
pub mod relay;
pub mod server;
pub mod store;
pub mod usage;
pub mod wire;

pub use config::{Cli, Config};
pub use hook::{
    CallOutcome, Hook, HookContext, HookRejection, LifecycleRequest, LifecycleResponse, Method,
};
pub use proxy::{Proxy, ProxyOptions};

use std::sync::Arc;
use std::time::Duration;

/// Keeps loading the runtime's pods and containers into the store until it answers once.
pub async fn resync_until_ready(proxy: Arc<Proxy>) {
    let mut warned = false;
    loop {
        match proxy.resync().await {
            Ok((pods, containers)) => {
                tracing::info!(pods, containers, "store loaded from runtime");
                return;
            }
            Err(error) => {
                if !warned {
                    tracing::warn!(runtime = %proxy.runtime().path().display(), %error,
                        "runtime not reachable yet; calls get Unavailable until it is; retrying every second");
                    warned = true;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}
