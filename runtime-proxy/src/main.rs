use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use tessera_hooks::server::GpuHook;
use tessera_runtime_proxy::Backend;
use tessera_runtime_proxy::EmbeddedGpuHook;
use tessera_runtime_proxy::ExternalGpuHookGuard;
use tessera_runtime_proxy::Hook;
use tessera_runtime_proxy::HookRegistry;
use tessera_runtime_proxy::Metrics;
use tessera_runtime_proxy::PodStore;
use tessera_runtime_proxy::relay::{self, RelayMode};
use tessera_runtime_proxy::{Cli, Config, Proxy, ProxyOptions, resync_until_ready, server};
use tessera_runtime_proxy::{EnforceHook, NodeEnforcement, node_enforcement};
use tokio::signal::unix::{SignalKind, signal};

fn main() -> std::process::ExitCode {
    let config = match Config::resolve(Cli::parse()) {
        Ok(config) => config,
        Err(error) => {
            eprintln!("tessera-runtime-proxy: {error}");
            return std::process::ExitCode::from(2);
        }
    };
    // After the settings, which name the format; nothing logs before this.
    tessera_daemon::binary::init_logging_as("info", config.log_format);
    // One thread: kubelet's call rate is low, and a single thread saves the
    // cross-thread wake-ups that dominate a proxied call's added latency.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("tessera-runtime-proxy: starting the async runtime: {error}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(config)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("tessera-runtime-proxy: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(config: Config) -> anyhow::Result<()> {
    let metrics = Arc::new(Metrics::default());
    let options = ProxyOptions {
        runtime_endpoint: config.runtime_endpoint.clone(),
        image_endpoint: config.image_endpoint.clone(),
        max_message_bytes: config.max_message_bytes,
    };
    let mut hooks: Vec<Arc<dyn Hook>> = Vec::new();
    // The proxy's record of the node's pods, which the GPU hook checks grants against.
    let store = Arc::new(PodStore::with_claims(
        tessera_runtime_proxy::dra::DraClaims::new(&config.dra_claims),
    ));
    // MPS namespaces of pods that went while the proxy was not looking, deleted
    // once the runtime's sandboxes are known.
    let mut mps_gc: Option<tessera_enforce::mps::Mps> = None;
    // Dropped however main ends: GPU time stops and thaws every container.
    let mut thaw_guard: Option<tessera_runtime_proxy::StopGuard> = None;
    let mut enforce_hook: Option<Arc<EnforceHook>> = None;
    let mut usage: Option<tessera_runtime_proxy::UsageReport> = None;
    if let Some(gpu) = &config.gpu_hook {
        let probe = Arc::new(gpu.probe());
        // The hooks' own calls to the runtime (its CDI settings, its sandboxes): one
        // backend, apart from the proxy's forwarding.
        let runtime = Backend::new(&config.runtime_endpoint, Arc::clone(&metrics));
        let NodeEnforcement {
            enforcement,
            driver,
            mps,
            gpu_time: hold,
            usage: sampler,
        } = node_enforcement(gpu, Arc::new(runtime.clone()))?;
        mps_gc = mps.clone();
        if let Some(hold) = &hold {
            thaw_guard = Some(hold.guard());
            hold.start(Arc::clone(&metrics))
                .context("starting the GPU-time thread")?;
        }
        let oom_kill = enforcement.oom_kill;
        let mut hook_config = gpu.config();
        hook_config.enforcement = enforcement.clone();
        let trusted_agents = hook_config.trusted_agents.clone();
        // The settings in words at INFO; the whole struct only when debugging.
        tracing::info!(
            mode = ?hook_config.mode,
            privileged = ?hook_config.privileged,
            trusted_agents = hook_config.trusted_agents.len(),
            enforcement = %tessera_enforce::joined(&hook_config.enforcement.backends()),
            "embedded GPU hook on"
        );
        tracing::debug!(config = ?hook_config, "embedded GPU hook settings");
        hooks.push(Arc::new(
            EmbeddedGpuHook::new(GpuHook::new(
                hook_config,
                Arc::clone(&probe) as Arc<dyn tessera_hooks::probe::DeviceProbe>,
            ))
            .with_store(Arc::clone(&store), runtime),
        ));
        let enforce = Arc::new(
            EnforceHook::new(enforcement, driver, mps, probe, Arc::clone(&metrics))
                .with_gpu_time(hold),
        );
        enforce_hook = Some(Arc::clone(&enforce));
        // What each container holds of each GPU's memory, for the reporter, and
        // the OOM kill that holds it.
        if let Some(sampler) = sampler {
            let report = tessera_runtime_proxy::UsageReport::new(
                sampler,
                enforce.clone(),
                Arc::clone(&store),
                trusted_agents,
                &gpu.enforcement_dir,
            );
            usage = Some(if oom_kill {
                report.with_oom_kill(gpu.oom_kill_margin)
            } else {
                report
            });
        }
        hooks.push(enforce);
    }
    // External hooks run after the embedded GPU hook, in file-name order.
    let registry = HookRegistry::new(&config.hooks_dir);
    registry.watch(std::time::Duration::from_secs(2));
    tracing::info!(dir = %config.hooks_dir.display(), hooks = registry.hooks().len(), "watching hook registrations");
    if config.gpu_hook.is_none() {
        // External GPU hook mode fails closed: no valid registration, no GPU container.
        hooks.push(Arc::new(ExternalGpuHookGuard::new(
            Arc::clone(&registry),
            "gpu",
        )));
    }
    hooks.push(registry);
    // tessera-reporter takes the node as switched only while kubelet is connected.
    let kubelet = tessera_runtime_proxy::KubeletConnections::new(config.kubelet_processes.clone());
    tokio::spawn(Arc::clone(&kubelet).publish(config.enforcement_dir.clone()));
    let kubelet_closed = Arc::clone(&kubelet);
    let proxy = Arc::new(
        Proxy::with_store(&options, hooks, Arc::clone(&metrics), Arc::clone(&store))
            .with_kubelet_connections(kubelet),
    );
    let (listener, source) = server::listen(&config.listen)
        .with_context(|| format!("listening on {}", config.listen.display()))?;
    tracing::info!(listen = %config.listen.display(), ?source, runtime = %config.runtime_endpoint.display(), relay = %config.relay, "serving CRI");
    if let Some(addr) = config.metrics_addr {
        // Not fatal: every pod on the node depends on the proxy, and a taken port
        // must not cost them their runtime over metrics.
        if let Err(error) = tessera_runtime_proxy::serve_metrics(addr, &metrics).await {
            tracing::error!(%addr, %error, "metrics endpoint not served (--metrics-addr)");
        }
    }
    let resync = resync_until_ready(Arc::clone(&proxy));
    let live = Arc::clone(&store);
    tokio::spawn(async move {
        resync.await;
        // Once the runtime's containers are known: each traced process is named.
        if let Some(usage) = usage {
            tokio::spawn(usage.run());
        }
        if let Some(hook) = &enforce_hook {
            let (held, let_go) = hook.resync_gpu_time(&live).await;
            if held + let_go > 0 {
                tracing::info!(
                    held,
                    let_go,
                    "GPU time: running shared containers held from now on, holds of pods no longer on the node let go"
                );
            }
        }
        let Some(mps) = mps_gc else { return };
        let as_of = std::time::SystemTime::now();
        let uids: Vec<String> = live.live_pods().iter().map(|p| p.uid.clone()).collect();
        match tokio::task::spawn_blocking(move || mps.prune(&uids, as_of)).await {
            Ok(Ok(0)) => {}
            Ok(Ok(namespaces)) => {
                tracing::info!(
                    namespaces,
                    "MPS namespaces of pods no longer on the node deleted"
                );
            }
            Ok(Err(error)) => tracing::warn!(%error, "MPS namespaces of gone pods not all deleted"),
            Err(error) => tracing::warn!(%error, "MPS cleanup task failed"),
        }
    });
    let mut terminate = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
    let shutdown = async move {
        tokio::select! {
            _ = terminate.recv() => {},
            _ = interrupt.recv() => {},
        }
    };
    match config.relay {
        RelayMode::H2 => server::serve(listener, proxy, shutdown, config.drain_timeout).await,
        RelayMode::Frames => relay::serve(listener, proxy, shutdown, config.drain_timeout).await,
    }
    // kubelet is no longer served here: said now, not left to go stale.
    kubelet_closed.close(&config.enforcement_dir).await;
    // No container may stay frozen with no proxy to thaw it.
    drop(thaw_guard);
    Ok(())
}
