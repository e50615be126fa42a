//! `tessera-bench proxy`: direct vs proxied CRI latency against one private containerd.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Parser, Subcommand};
use k8s_cri::v1 as cri;
use tessera_integration::containerd::Containerd;
use tessera_integration::image::PAUSE_IMAGE;
use tessera_integration::kubelet::{KubeletDriver, PodSpec};

#[derive(Debug, Parser)]
#[command(
    name = "tessera-bench",
    about = "Tessera benchmarks; each prints figures and ratios."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Direct vs proxied p50/p99 for Version, ListContainers, ContainerStatus and a
    /// create→start→stop→remove cycle, plus the proxy's peak RSS. Needs root.
    Proxy {
        /// Calls per measured method and path.
        #[arg(long, default_value_t = 2000)]
        iterations: usize,
        /// Containers that exist while ListContainers is measured.
        #[arg(long, default_value_t = 100)]
        containers: usize,
        /// Lifecycle cycles per path.
        #[arg(long, default_value_t = 60)]
        cycles: usize,
        /// The proxy binary [default: tessera-runtime-proxy beside this binary].
        #[arg(long)]
        proxy_bin: Option<PathBuf>,
    },
    /// CreateContainer of a half-GPU pod on a fake 4-GPU node: direct vs through the
    /// proxy with the embedded GPU hook vs through the proxy calling tessera-gpu-hook
    /// as an external hook server. Needs root.
    GpuHook {
        /// CreateContainer calls per path.
        #[arg(long, default_value_t = 60)]
        iterations: usize,
    },
    /// tessera-scheduler's extender over HTTP: filter + prioritize latency for one
    /// pod on a synthetic cluster (8 GPUs per node, one running shared pod per GPU).
    Extender {
        /// filter+prioritize pairs per NodeNames size.
        #[arg(long, default_value_t = 1000)]
        iterations: usize,
        /// Nodes in the cluster.
        #[arg(long, default_value_t = 5000)]
        nodes: usize,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Proxy {
            iterations,
            containers,
            cycles,
            proxy_bin,
        } => {
            let proxy_bin = match proxy_bin {
                Some(path) => path,
                None => std::env::current_exe()?.with_file_name("tessera-runtime-proxy"),
            };
            proxy_bench(&proxy_bin, iterations, containers, cycles).await
        }
        Command::GpuHook { iterations } => gpu_hook_bench(iterations).await,
        // kube-scheduler sends the nodes its own filters passed: with 5,000 nodes its
        // adaptive percentageOfNodesToScore stops at 500 feasible ones; all is the worst case.
        Command::Extender { iterations, nodes } => {
            extender_bench(iterations, nodes, &[500, nodes]).await
        }
    }
}

/// A proxy child process that is killed on drop.
struct ProxyProcess(tokio::process::Child);

impl ProxyProcess {
    /// CPU time the proxy's threads have used so far (scheduler accounting, ns).
    fn cpu_ns(&self) -> Option<u64> {
        let tasks = std::fs::read_dir(format!("/proc/{}/task", self.0.id()?)).ok()?;
        let mut total = 0;
        for task in tasks.flatten() {
            let stat = std::fs::read_to_string(task.path().join("schedstat")).ok()?;
            total += stat.split_whitespace().next()?.parse::<u64>().ok()?;
        }
        Some(total)
    }

    fn peak_rss_kib(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.0.id()?)).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
        line.split_whitespace().nth(1)?.parse().ok()
    }
}

async fn spawn_proxy(binary: &Path, socket: &Path, runtime: &Path) -> anyhow::Result<ProxyProcess> {
    spawn_proxy_with(binary, socket, runtime, &[]).await
}

async fn spawn_proxy_with(
    binary: &Path,
    socket: &Path,
    runtime: &Path,
    extra: &[std::ffi::OsString],
) -> anyhow::Result<ProxyProcess> {
    let child = tokio::process::Command::new(binary)
        .arg("--listen")
        .arg(socket)
        .arg("--runtime-endpoint")
        .arg(runtime)
        .args(extra)
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .spawn()
        .with_context(|| {
            format!(
                "starting {} (build it with cargo build --release)",
                binary.display()
            )
        })?;
    wait_for(socket).await?;
    Ok(ProxyProcess(child))
}

#[derive(Debug, Default)]
struct Samples(Vec<Duration>);

impl Samples {
    fn quantile(&self, q: f64) -> Duration {
        let mut sorted = self.0.clone();
        sorted.sort();
        let index = ((sorted.len() as f64 - 1.0) * q).round() as usize;
        sorted.get(index).copied().unwrap_or_default()
    }
}

/// Times `call` `n` times on each driver, alternating call by call so drift and
/// noise from the rest of the machine hit every path alike.
async fn measure<const N: usize, F, Fut>(
    drivers: [&mut KubeletDriver; N],
    n: usize,
    mut call: F,
) -> anyhow::Result<[Samples; N]>
where
    F: FnMut(KubeletDriver) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let mut samples: [Samples; N] = std::array::from_fn(|_| Samples::default());
    // Warm-up: connections, caches.
    for driver in drivers.iter() {
        for _ in 0..n.min(10) {
            call((*driver).clone()).await?;
        }
    }
    for _ in 0..n {
        for (index, driver) in drivers.iter().enumerate() {
            let started = Instant::now();
            call((*driver).clone()).await?;
            samples[index].0.push(started.elapsed());
        }
    }
    Ok(samples)
}

/// The floor of any extra hop: a byte relay (no HTTP/2 parsing) between two unix
/// sockets, on its own thread and single-threaded runtime like the proxy.
/// Returns the relay thread's id, for its CPU time.
fn spawn_relay(listen: &Path, target: &Path) -> anyhow::Result<i32> {
    let listener = std::os::unix::net::UnixListener::bind(listen)?;
    listener.set_nonblocking(true)?;
    let target = target.to_path_buf();
    let (tid_tx, tid_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || -> std::io::Result<()> {
        let _ = tid_tx.send(nix::unistd::gettid().as_raw());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        runtime.block_on(async move {
            let listener = tokio::net::UnixListener::from_std(listener)?;
            loop {
                let (mut inbound, _) = listener.accept().await?;
                let target = target.clone();
                tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::UnixStream::connect(&target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        })
    });
    Ok(tid_rx.recv()?)
}

/// CPU time a thread of this process has used (scheduler accounting, ns).
fn thread_cpu_ns(tid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).ok()?;
    stat.split_whitespace().next()?.parse().ok()
}

fn us(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e6
}

struct Row {
    name: String,
    direct: Samples,
    proxied: Samples,
}

async fn proxy_bench(
    binary: &Path,
    iterations: usize,
    containers: usize,
    cycles: usize,
) -> anyhow::Result<()> {
    let containerd = Containerd::start().await?;
    let dir = tempfile::Builder::new()
        .prefix("tbench-")
        .tempdir_in("/tmp")?;
    let socket = dir.path().join("proxy.sock");
    let proxy = spawn_proxy(binary, &socket, &containerd.socket()).await?;
    let mut direct = KubeletDriver::connect(&containerd.socket()).await?;
    let mut proxied = KubeletDriver::connect(&socket).await?;

    // The population ListContainers walks.
    let pod = PodSpec::new("bench", "population");
    let config = pod.sandbox_config();
    let population = direct.start_pod(&pod, &[]).await?;
    let mut first = String::new();
    for i in 0..containers {
        let id = direct
            .create(
                &population.sandbox_id,
                &config,
                pod.container_config(&format!("c{i}"), PAUSE_IMAGE, &[]),
            )
            .await?;
        if first.is_empty() {
            first = id;
        }
    }

    let mut rows = Vec::new();
    let relay_socket = dir.path().join("relay.sock");
    let relay_tid = spawn_relay(&relay_socket, &containerd.socket())?;
    let mut relayed = KubeletDriver::connect(&relay_socket).await?;
    let cpu_before = proxy.cpu_ns();
    let relay_cpu_before = thread_cpu_ns(relay_tid);
    let [d, p, r] = measure(
        [&mut direct, &mut proxied, &mut relayed],
        iterations,
        |mut driver| async move {
            driver.version().await?;
            Ok(())
        },
    )
    .await?;
    // Warm-up calls included: measure() makes min(n, 10) of them per path.
    let calls = (iterations + iterations.min(10)) as f64;
    let cpu_per_call = cpu_before
        .zip(proxy.cpu_ns())
        .map(|(before, after)| after.saturating_sub(before) as f64 / 1e3 / calls);
    let relay_cpu_per_call = relay_cpu_before
        .zip(thread_cpu_ns(relay_tid))
        .map(|(before, after)| after.saturating_sub(before) as f64 / 1e3 / calls);
    let relay_floor = Row {
        name: "Version via byte relay".into(),
        direct: Samples(d.0.clone()),
        proxied: r,
    };
    rows.push(Row {
        name: "Version".into(),
        direct: d,
        proxied: p,
    });

    let [d, p, r] = measure(
        [&mut direct, &mut proxied, &mut relayed],
        iterations / 4,
        |mut driver| async move {
            let listed = driver
                .runtime
                .list_containers(cri::ListContainersRequest::default())
                .await?
                .into_inner();
            anyhow::ensure!(
                listed.containers.len() >= containers,
                "listed {}",
                listed.containers.len()
            );
            Ok(())
        },
    )
    .await?;
    let list_floor = Row {
        name: format!("ListContainers ({containers}) via byte relay"),
        direct: Samples(d.0.clone()),
        proxied: r,
    };
    rows.push(Row {
        name: format!("ListContainers ({containers})"),
        direct: d,
        proxied: p,
    });

    let status_id = first.clone();
    let [d, p] = measure(
        [&mut direct, &mut proxied],
        iterations,
        move |mut driver| {
            let id = status_id.clone();
            async move {
                driver
                    .runtime
                    .container_status(cri::ContainerStatusRequest {
                        container_id: id,
                        verbose: false,
                    })
                    .await?;
                Ok(())
            }
        },
    )
    .await?;
    rows.push(Row {
        name: "ContainerStatus".into(),
        direct: d,
        proxied: p,
    });

    let lifecycle_pod = PodSpec::new("bench", "lifecycle");
    let lifecycle_config = lifecycle_pod.sandbox_config();
    let sandbox = direct.start_pod(&lifecycle_pod, &[]).await?.sandbox_id;
    let counter = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let [d, p] = measure([&mut direct, &mut proxied], cycles, |mut driver| {
        let sandbox = sandbox.clone();
        let config = lifecycle_config.clone();
        let name = format!(
            "cycle{}",
            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let container = lifecycle_pod.container_config(&name, PAUSE_IMAGE, &[]);
        async move {
            let id = driver
                .create_and_start(&sandbox, &config, container)
                .await?;
            driver
                .runtime
                .stop_container(cri::StopContainerRequest {
                    container_id: id.clone(),
                    timeout: 10,
                })
                .await?;
            driver
                .runtime
                .remove_container(cri::RemoveContainerRequest { container_id: id })
                .await?;
            Ok(())
        }
    })
    .await?;
    rows.push(Row {
        name: "create→start→stop→remove".into(),
        direct: d,
        proxied: p,
    });

    println!(
        "tessera-bench proxy: {iterations} calls per method ({} for ListContainers), {cycles} lifecycle cycles",
        iterations / 4
    );
    let all: Vec<Row> = rows.into_iter().chain([relay_floor, list_floor]).collect();
    print_rows(&all);
    println!(
        "(the byte relay rows are the floor of any extra process hop on this machine: no HTTP/2, no gRPC)"
    );
    if let (Some(proxy), Some(relay)) = (cpu_per_call, relay_cpu_per_call) {
        println!(
            "CPU per Version call (user + kernel): proxy {proxy:.1}µs, byte relay {relay:.1}µs"
        );
    }
    let rss_mib = proxy.peak_rss_kib().map(|kib| kib as f64 / 1024.0);
    match rss_mib {
        Some(mib) => println!("proxy peak RSS (VmHWM): {mib:.1} MiB"),
        None => println!("proxy peak RSS: unavailable"),
    }
    // rows: Version, ListContainers, ContainerStatus (passthrough), then the lifecycle.
    print_verdicts(&all[..3], &all[3], rss_mib);
    direct.stop_and_remove_pod(&population).await.ok();
    drop(proxy);
    Ok(())
}

/// The issue's targets, each with the figures it was judged on.
fn print_verdicts(passthrough: &[Row], lifecycle: &Row, rss_mib: Option<f64>) {
    let verdict = |met: bool| if met { "met" } else { "NOT met" };
    let ratio = |row: &Row| us(row.proxied.quantile(0.5)) / us(row.direct.quantile(0.5));
    let added = |row: &Row| us(row.proxied.quantile(0.5)) - us(row.direct.quantile(0.5));
    let list = |figure: &dyn Fn(&Row) -> f64, unit: &str| {
        passthrough
            .iter()
            .map(|row| format!("{} {:.2}{unit}", row.name, figure(row)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!("targets:");
    println!(
        "  passthrough p50 ratio <= 1.10: {} ({})",
        verdict(passthrough.iter().all(|row| ratio(row) <= 1.10)),
        list(&ratio, "")
    );
    println!(
        "  passthrough p50 added <= 100us: {} ({})",
        verdict(passthrough.iter().all(|row| added(row) <= 100.0)),
        list(&added, "us")
    );
    println!(
        "  lifecycle p50 ratio <= 1.05: {} ({:.3})",
        verdict(ratio(lifecycle) <= 1.05),
        ratio(lifecycle)
    );
    if let Some(mib) = rss_mib {
        println!(
            "  proxy RSS <= 20 MiB: {} ({mib:.1} MiB)",
            verdict(mib <= 20.0)
        );
    }
}

async fn wait_for(socket: &Path) -> anyhow::Result<()> {
    let started = Instant::now();
    while !socket.exists() {
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(10),
            "{} did not appear",
            socket.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

fn print_rows(rows: &[Row]) {
    println!(
        "{:<36} {:>12} {:>12} {:>12} {:>12} {:>9} {:>12} {:>9}",
        "path", "direct p50", "p50", "direct p99", "p99", "p50 ratio", "p50 added", "p99 ratio"
    );
    for row in rows {
        let (d50, p50) = (row.direct.quantile(0.5), row.proxied.quantile(0.5));
        let (d99, p99) = (row.direct.quantile(0.99), row.proxied.quantile(0.99));
        println!(
            "{:<36} {:>10.0}µs {:>10.0}µs {:>10.0}µs {:>10.0}µs {:>9.3} {:>10.0}µs {:>9.3}",
            row.name,
            us(d50),
            us(p50),
            us(d99),
            us(p99),
            us(p50) / us(d50),
            us(p50) - us(d50),
            us(p99) / us(d99)
        );
    }
}

async fn gpu_hook_bench(iterations: usize) -> anyhow::Result<()> {
    let here = std::env::current_exe()?;
    let proxy_bin = here.with_file_name("tessera-runtime-proxy");
    let hook_bin = here.with_file_name("tessera-gpu-hook");
    let containerd = Containerd::start().await?;
    let dir = tempfile::Builder::new()
        .prefix("tbench-")
        .tempdir_in("/tmp")?;
    let gpus = tessera_integration::gpu_node::FakeGpuNode::create(dir.path(), 4)?;
    let gpu_flags: Vec<std::ffi::OsString> = vec![
        "--device-root".into(),
        gpus.device_root.clone().into(),
        "--driver-gpus".into(),
        gpus.driver_gpus.clone().into(),
    ];

    // Proxy with the embedded GPU hook.
    let empty_hooks = dir.path().join("no-hooks.d");
    std::fs::create_dir_all(&empty_hooks)?;
    let mut embedded_flags = gpu_flags.clone();
    embedded_flags.extend(["--hooks-dir".into(), empty_hooks.into()]);
    let embedded_socket = dir.path().join("embedded.sock");
    let _embedded = spawn_proxy_with(
        &proxy_bin,
        &embedded_socket,
        &containerd.socket(),
        &embedded_flags,
    )
    .await?;

    // Proxy without it, calling tessera-gpu-hook through hooks.d.
    let hook_socket = dir.path().join("gpu-hook.sock");
    let _hook_server = tokio::process::Command::new(&hook_bin)
        .arg("--socket")
        .arg(&hook_socket)
        .args(&gpu_flags)
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .spawn()
        .with_context(|| {
            format!(
                "starting {} (cargo build --release -p tessera-hooks)",
                hook_bin.display()
            )
        })?;
    wait_for(&hook_socket).await?;
    let hooks_dir = dir.path().join("hooks.d");
    std::fs::create_dir_all(&hooks_dir)?;
    std::fs::write(
        hooks_dir.join("10-gpu.toml"),
        format!(
            "endpoint = \"{}\"\nstages = [\"PreCreateContainer\"]\n",
            hook_socket.display()
        ),
    )?;
    let external_socket = dir.path().join("external.sock");
    let external_flags: Vec<std::ffi::OsString> = vec![
        "--no-gpu-hook".into(),
        "--hooks-dir".into(),
        hooks_dir.into(),
    ];
    let _external = spawn_proxy_with(
        &proxy_bin,
        &external_socket,
        &containerd.socket(),
        &external_flags,
    )
    .await?;

    let mut direct = KubeletDriver::connect(&containerd.socket()).await?;
    let mut embedded = KubeletDriver::connect(&embedded_socket).await?;
    let mut external = KubeletDriver::connect(&external_socket).await?;

    let mut pod = PodSpec::new("bench", "half-gpu");
    pod.log_directory = Some(dir.path().join("logs"));
    pod.annotations.insert(
        tessera_api::resources::DEVICE_ALLOCATED.into(),
        format!(
            r#"{{"gpu":[{{"minor":1,"id":"{}","resources":{{"koordinator.sh/gpu-core":50,"koordinator.sh/gpu-memory-ratio":50,"koordinator.sh/gpu-memory":"8Gi"}}}}]}}"#,
            gpus.gpus[1].uuid
        ),
    );
    let config = pod.sandbox_config();
    let sandbox = direct.start_pod(&pod, &[]).await?.sandbox_id;
    let mut samples: [Samples; 3] = std::array::from_fn(|_| Samples::default());
    let mut counter = 0usize;
    for round in 0..iterations + 5 {
        for (index, driver) in [&mut direct, &mut embedded, &mut external]
            .into_iter()
            .enumerate()
        {
            counter += 1;
            let container = pod.container_config(
                &format!("c{counter}"),
                tessera_integration::image::PAUSE_IMAGE,
                &[],
            );
            let request = cri::CreateContainerRequest {
                pod_sandbox_id: sandbox.clone(),
                config: Some(container),
                sandbox_config: Some(config.clone()),
            };
            let started = Instant::now();
            let id = driver
                .runtime
                .create_container(request)
                .await?
                .into_inner()
                .container_id;
            let elapsed = started.elapsed();
            // The first rounds warm connections and caches.
            if round >= 5 {
                samples[index].0.push(elapsed);
            }
            driver
                .runtime
                .remove_container(cri::RemoveContainerRequest { container_id: id })
                .await?;
        }
    }
    let [d, e, x] = samples;
    println!(
        "tessera-bench gpu-hook: {iterations} CreateContainer calls per path (half-GPU pod, fake 4-GPU node)"
    );
    let rows = [
        Row {
            name: "proxy + embedded GPU hook".into(),
            direct: Samples(d.0.clone()),
            proxied: e,
        },
        Row {
            name: "proxy + external tessera-gpu-hook".into(),
            direct: d,
            proxied: x,
        },
    ];
    print_rows(&rows);
    Ok(())
}

async fn extender_bench(
    iterations: usize,
    nodes: usize,
    names_per_call: &[usize],
) -> anyhow::Result<()> {
    use http_body_util::{BodyExt, Full};
    use tessera_scheduler::extender::{Extender, ExtenderConfig, serve};

    let started = Instant::now();
    let snapshot = tessera_scheduler::simulate::synthetic_cluster(nodes, 8, nodes * 8);
    let ledger = tessera_scheduler::simulate::ledger_of(&snapshot);
    let pods = snapshot.pods.len();
    drop(snapshot);
    let built = started.elapsed();
    let ready = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let leader = std::sync::Arc::new(tessera_scheduler::leader::Leader::new(false));
    let extender = Extender::new(
        std::sync::Arc::new(std::sync::Mutex::new(ledger)),
        None,
        None,
        ExtenderConfig::default(),
        ready,
        leader,
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let server = tokio::spawn(serve(listener, extender));
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<bytes::Bytes>>();
    let pod = serde_json::json!({"apiVersion":"v1","kind":"Pod","metadata":{"name":"bench","namespace":"default","uid":"u"},
        "spec":{"containers":[{"name":"main","image":"x","resources":{"limits":{"koordinator.sh/gpu-core":"50","koordinator.sh/gpu-memory-ratio":"50"}}}]}});
    let rss = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .unwrap_or(0.0)
        / 1024.0;
    println!(
        "tessera-bench extender: {nodes} nodes × 8 GPUs, {pods} running shared pods (ledger built in {built:.2?}); RSS {rss:.1} MiB"
    );
    println!(
        "{:<28} {:>10} {:>10} {:>10}",
        "NodeNames per call", "p50", "p99", "max"
    );
    for &count in names_per_call {
        let names: Vec<String> = (0..count.min(nodes))
            .map(|i| format!("node-{:05}", (i * 7919) % nodes))
            .collect();
        let body = serde_json::to_vec(&serde_json::json!({"Pod": pod, "NodeNames": names}))?;
        let mut samples = Vec::with_capacity(iterations);
        for round in 0..iterations + 20 {
            let begun = Instant::now();
            for path in ["filter", "prioritize"] {
                let request = http::Request::post(format!("{url}/{path}"))
                    .header("content-type", "application/json")
                    .body(Full::new(bytes::Bytes::from(body.clone())))?;
                let response = client.request(request).await?;
                anyhow::ensure!(
                    response.status().is_success(),
                    "{path}: {}",
                    response.status()
                );
                response.into_body().collect().await?;
            }
            if round >= 20 {
                samples.push(begun.elapsed());
            }
        }
        let samples = Samples(samples);
        println!(
            "{:<28} {:>8.0}µs {:>8.0}µs {:>8.0}µs",
            format!("{} (filter+prioritize)", names.len()),
            us(samples.quantile(0.5)),
            us(samples.quantile(0.99)),
            us(samples.quantile(1.0))
        );
    }
    server.abort();
    Ok(())
}
