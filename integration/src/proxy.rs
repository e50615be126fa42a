//! The runtime proxy, run in-process on a socket of its own.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tessera_runtime_proxy::Hook;
use tessera_runtime_proxy::Metrics;
use tessera_runtime_proxy::relay;
pub use tessera_runtime_proxy::relay::RelayMode;
use tessera_runtime_proxy::{Proxy, ProxyOptions, server};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A proxy serving on `socket`, forwarding to a runtime socket.
#[derive(Debug)]
pub struct RunningProxy {
    /// The socket kubelet (the driver) talks to.
    pub socket: PathBuf,
    /// The proxy itself, for its store and metrics.
    pub proxy: Arc<Proxy>,
    /// Its metrics.
    pub metrics: Arc<Metrics>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl RunningProxy {
    /// Starts a proxy on `socket` in front of `runtime`, with `hooks`, serving
    /// kubelet's connections the default way; loads its store first.
    pub async fn start(
        socket: &Path,
        runtime: &Path,
        hooks: Vec<Arc<dyn Hook>>,
    ) -> anyhow::Result<Self> {
        let mode = RelayMode::for_endpoints(runtime, runtime);
        Self::start_mode(mode, socket, runtime, hooks).await
    }

    /// [`Self::start`] with the connection handling `mode` (`--relay`).
    pub async fn start_mode(
        mode: RelayMode,
        socket: &Path,
        runtime: &Path,
        hooks: Vec<Arc<dyn Hook>>,
    ) -> anyhow::Result<Self> {
        Self::start_with(mode, socket, runtime, hooks, None).await
    }

    /// [`Self::start`] that also counts the connections of this process (the
    /// stand-in for kubelet that drives it) as kubelet's, and writes them to
    /// `<enforcement_dir>/kubelet` for tessera-reporter, as the proxy binary does.
    pub async fn start_counting_kubelet(
        socket: &Path,
        runtime: &Path,
        hooks: Vec<Arc<dyn Hook>>,
        enforcement_dir: &Path,
    ) -> anyhow::Result<Self> {
        let mode = RelayMode::for_endpoints(runtime, runtime);
        Self::start_with(mode, socket, runtime, hooks, Some(enforcement_dir)).await
    }

    async fn start_with(
        mode: RelayMode,
        socket: &Path,
        runtime: &Path,
        hooks: Vec<Arc<dyn Hook>>,
        enforcement_dir: Option<&Path>,
    ) -> anyhow::Result<Self> {
        let metrics = Arc::new(Metrics::default());
        let options = ProxyOptions {
            runtime_endpoint: runtime.to_path_buf(),
            image_endpoint: runtime.to_path_buf(),
            max_message_bytes: 16 << 20,
        };
        let mut proxy = Proxy::new(&options, hooks, Arc::clone(&metrics));
        if let Some(dir) = enforcement_dir {
            let own = std::fs::read_to_string("/proc/self/comm")?;
            let kubelet =
                tessera_runtime_proxy::KubeletConnections::new(vec![own.trim_end().to_owned()]);
            tokio::spawn(Arc::clone(&kubelet).publish(dir.to_path_buf()));
            proxy = proxy.with_kubelet_connections(kubelet);
        }
        let proxy = Arc::new(proxy);
        if let Err(error) = proxy.resync().await {
            tracing::warn!(%error, "runtime not reachable at proxy start");
        }
        let (listener, _) = server::listen(socket)?;
        let (stop, stopped) = oneshot::channel::<()>();
        let shutdown = async move {
            let _ = stopped.await;
        };
        let served = Arc::clone(&proxy);
        let drain = Duration::from_secs(5);
        let task = tokio::spawn(async move {
            match mode {
                RelayMode::H2 => server::serve(listener, served, shutdown, drain).await,
                RelayMode::Frames => relay::serve(listener, served, shutdown, drain).await,
            }
        });
        Ok(Self {
            socket: socket.to_path_buf(),
            proxy,
            metrics,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// Stops accepting, drains and waits for the proxy to end.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for RunningProxy {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// Declares each listed case as two tests, `<case>::h2` and `<case>::frames`: the
/// case, an `async fn(RelayMode)`, runs once behind each way the proxy serves
/// kubelet, so both keep every promise the suite checks. Optional tokio test
/// arguments follow the name in parentheses.
#[macro_export]
macro_rules! each_relay_mode {
    ($($case:ident $(($($args:tt)*))?;)*) => {
        $(
            mod $case {
                #[tokio::test $(($($args)*))?]
                async fn h2() {
                    super::$case($crate::proxy::RelayMode::H2).await;
                }
                #[tokio::test $(($($args)*))?]
                async fn frames() {
                    super::$case($crate::proxy::RelayMode::Frames).await;
                }
            }
        )*
    };
}
