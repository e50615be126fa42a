//! What the proxy's test files share: a proxy in front of a runtime socket.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tessera_runtime_proxy::Hook;
use tessera_runtime_proxy::Metrics;
use tessera_runtime_proxy::relay::{self, RelayMode};
use tessera_runtime_proxy::{Proxy, ProxyOptions, server};

/// A proxy with `hooks` serving `socket` the `mode` way, in front of the runtime
/// at `runtime` (both CRI services), on a spawned task that runs until the test ends.
pub fn serve_proxy(
    runtime: &Path,
    socket: &Path,
    hooks: Vec<Arc<dyn Hook>>,
    mode: RelayMode,
) -> Arc<Proxy> {
    let options = ProxyOptions {
        runtime_endpoint: runtime.to_path_buf(),
        image_endpoint: runtime.to_path_buf(),
        max_message_bytes: 16 << 20,
    };
    let proxy = Arc::new(Proxy::new(&options, hooks, Arc::new(Metrics::default())));
    let (listener, _) = server::listen(socket).expect("listen");
    let (stop, drain) = (std::future::pending(), Duration::from_secs(1));
    match mode {
        RelayMode::H2 => tokio::spawn(server::serve(listener, Arc::clone(&proxy), stop, drain)),
        RelayMode::Frames => tokio::spawn(relay::serve(listener, Arc::clone(&proxy), stop, drain)),
    };
    proxy
}
