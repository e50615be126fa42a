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
    }
}

/// A proxy child process that is killed on drop.
struct ProxyProcess(tokio::process::Child);

impl ProxyProcess {
    fn peak_rss_kib(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.0.id()?)).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
        line.split_whitespace().nth(1)?.parse().ok()
    }
}

async fn spawn_proxy(binary: &Path, socket: &Path, runtime: &Path) -> anyhow::Result<ProxyProcess> {
    let child = tokio::process::Command::new(binary)
        .arg("--listen")
        .arg(socket)
        .arg("--runtime-endpoint")
        .arg(runtime)
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .spawn()
        .with_context(|| {
            format!(
                "starting {} (build it with cargo build --release)",
                binary.display()
            )
        })?;
    let started = Instant::now();
    while !socket.exists() {
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(10),
            "proxy did not create {}",
            socket.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
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
fn spawn_relay(listen: &Path, target: &Path) -> anyhow::Result<()> {
    let listener = std::os::unix::net::UnixListener::bind(listen)?;
    listener.set_nonblocking(true)?;
    let target = target.to_path_buf();
    std::thread::spawn(move || -> std::io::Result<()> {
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
    Ok(())
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
    spawn_relay(&relay_socket, &containerd.socket())?;
    let mut relayed = KubeletDriver::connect(&relay_socket).await?;
    let [d, p, r] = measure(
        [&mut direct, &mut proxied, &mut relayed],
        iterations,
        |mut driver| async move {
            driver.version().await?;
            Ok(())
        },
    )
    .await?;
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

    let [d, p] = measure(
        [&mut direct, &mut proxied],
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
    println!(
        "{:<28} {:>12} {:>12} {:>12} {:>12} {:>9} {:>12} {:>9}",
        "method",
        "direct p50",
        "proxy p50",
        "direct p99",
        "proxy p99",
        "p50 ratio",
        "p50 added",
        "p99 ratio"
    );
    for row in rows.iter().chain([&relay_floor]) {
        let (d50, p50) = (row.direct.quantile(0.5), row.proxied.quantile(0.5));
        let (d99, p99) = (row.direct.quantile(0.99), row.proxied.quantile(0.99));
        println!(
            "{:<28} {:>10.0}µs {:>10.0}µs {:>10.0}µs {:>10.0}µs {:>9.3} {:>10.0}µs {:>9.3}",
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
    println!(
        "(the byte relay row is the floor of any extra process hop on this machine: no HTTP/2, no gRPC)"
    );
    match proxy.peak_rss_kib() {
        Some(kib) => println!("proxy peak RSS (VmHWM): {:.1} MiB", kib as f64 / 1024.0),
        None => println!("proxy peak RSS: unavailable"),
    }
    direct.stop_and_remove_pod(&population).await.ok();
    drop(proxy);
    Ok(())
}
