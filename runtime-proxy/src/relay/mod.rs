//! The frame relay: kubelet's HTTP/2 connection carried to the runtime frame by
//! frame, without terminating HTTP/2 (`--relay frames`).
//!
//! Each kubelet connection gets one runtime connection of its own. Frames pass
//! as they arrive and unchanged, so stream IDs, SETTINGS, PING, GOAWAY,
//! WINDOW_UPDATE and both HPACK tables are the two ends' own, and any
//! `:authority` reaches the runtime as it was sent. The relay decodes header
//! blocks only to learn each call's method and status; lifecycle calls go
//! through the same stages as on the h2 path ([`crate::Proxy`]'s pre and post
//! stages) with their request body held and re-emitted ([`conn`]).
//!
//! One runtime socket serves both CRI services here: with a separate image
//! endpoint use the h2 path.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;

use crate::proxy::Proxy;

pub mod conn;
mod io;

pub use conn::{Fields, HeaderBlocks, RelayError, Step};

/// Which way kubelet's calls reach the runtime (`--relay`, `relay = "…"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RelayMode {
    /// HTTP/2 terminated on both legs by h2 ([`crate::server::serve`]).
    H2,
    /// Frames relayed ([`serve`]).
    Frames,
}

impl RelayMode {
    /// The default for these endpoints: `frames` (cheaper, and any `:authority`
    /// passes) when one runtime socket serves both CRI services, as it does on
    /// containerd and CRI-O; `h2` when images are served elsewhere, since a
    /// relayed connection has one runtime end.
    pub fn for_endpoints(runtime: &std::path::Path, image: &std::path::Path) -> Self {
        if runtime == image {
            Self::Frames
        } else {
            Self::H2
        }
    }
}

impl std::fmt::Display for RelayMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::H2 => "h2",
            Self::Frames => "frames",
        })
    }
}

impl std::str::FromStr for RelayMode {
    type Err = String;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        match value {
            "h2" => Ok(Self::H2),
            "frames" => Ok(Self::Frames),
            other => Err(format!("expected \"h2\" or \"frames\", got {other:?}")),
        }
    }
}

/// Serves kubelet on `listener` by relaying frames to the proxy's runtime socket
/// until `shutdown` resolves; then sends every connection GOAWAY and waits up to
/// `drain` for their calls to end.
pub async fn serve(
    listener: UnixListener,
    proxy: Arc<Proxy>,
    shutdown: impl Future<Output = ()>,
    drain: Duration,
) {
    crate::server::accept_until(listener, proxy, shutdown, drain, serve_connection).await;
}

/// One kubelet connection, relayed to a runtime connection dialled for it.
async fn serve_connection(kubelet: UnixStream, proxy: Arc<Proxy>, stopping: watch::Receiver<bool>) {
    let runtime = match UnixStream::connect(proxy.runtime().path()).await {
        Ok(runtime) => runtime,
        Err(error) => {
            // No runtime to relay to: the h2 path serves this connection, which
            // answers Unavailable naming the socket and redials per call, so the
            // connection goes on working once the runtime is back.
            tracing::debug!(%error, "runtime not reachable; serving this connection on the h2 path");
            crate::server::serve_connection(kubelet, proxy, stopping).await;
            return;
        }
    };
    proxy.metrics().backend_connects.inc();
    if let Err(error) = conn::Relay::new(proxy)
        .run(kubelet, runtime, stopping)
        .await
    {
        tracing::debug!(%error, "relayed connection ended");
    }
}
