//! `tessera-runtime-proxy`: a CRI proxy between kubelet and the container runtime.
//!
//! Every call is forwarded frame by frame; lifecycle calls ([`Method`]) are
//! decoded, passed through [`Hook`]s, re-spliced at the wire level so fields
//! unknown to our CRI types survive ([`merge`]), and recorded in the [`PodStore`].
//! Two serving paths share the hook stages: [`server`] terminates HTTP/2 with h2
//! (kubelet's connection goes through [`KubeletStream`] first, so that an
//! `:authority` h2 would refuse, the socket path older kubelets send, does not fail
//! its calls); [`relay`] carries kubelet's frames without terminating HTTP/2. Both
//! read the wire with [`http2`].
//!
//! The modules are the proxy's own; what the binary, the tests and the
//! integration crate use is exported below.
// The hook protocol's CRI side, under the names the proxy's modules use.
use tessera_hook_protocol::{convert, lifecycle as hook};

mod backend;
mod body;
mod config;
pub mod dra;
mod enforce;
mod external_hooks;
mod gpu;
mod gpu_time;
mod grpc;
mod guard;
/// HTTP/2 at the wire (frames, HPACK, the `:authority` pass), shared with the
/// kubelet DRA plugin.
pub use tessera_http2 as http2;
mod kubelet_seen;
mod metrics;
mod proxy;
pub mod relay;
pub mod server;
mod store;
mod usage;
mod wire;

// What the binary, the tests and the integration crate use; the rest is the
// proxy's own.
pub use backend::Backend;
pub use config::{Cli, Config, DEFAULT_LISTEN};
pub use enforce::{EnforceHook, NodeEnforcement, node as node_enforcement};
pub use external_hooks::{FailurePolicy, HookRegistry};
pub use gpu::EmbeddedGpuHook;
pub use gpu_time::StopGuard;
pub use grpc::{decode_frame, status_message};
pub use guard::ExternalGpuHookGuard;
pub use hook::{
    CallOutcome, Hook, HookContext, HookRejection, LifecycleRequest, LifecycleResponse, Method,
};
pub use kubelet_seen::KubeletConnections;
pub use metrics::{Metrics, serve as serve_metrics};
pub use proxy::{Proxy, ProxyOptions};
pub use store::PodStore;
pub use tessera_http2::authority::{
    AuthorityNormaliser, HEADER_TABLE_SIZE, KubeletStream, h2_accepts_authority,
};
pub use usage::{MemoryGrants, Report as UsageReport};
pub use wire::merge;

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
