//! `tessera-bench enforce`: what each enforcement backend adds to a shared
//! container's CreateContainer + StartContainer, against a private containerd 2.x
//! with CDI on (Debian's 1.6 has none), on a fake GPU node whose fake NVML has the
//! driver's memory limits. Six paths, all in the same run: straight to
//! containerd (the floor), the proxy with the GPU hook alone, with driver memory
//! limits (a CDI `createRuntime` hook running `tessera-enforce`), with MPS (a
//! namespace made through the supervised fake MPS daemon, `fake-mps-control`),
//! with GPU time (the container's grant at its start) and with HAMi-core (its bind mounts). Each run also proves the path it timed ran: a
//! benchmark of a path that did nothing is worthless.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use k8s_cri::v1 as cri;
use serde_json::{Value, json};
use tessera_api::enforcement::{Backend, joined};
use tessera_api::resources::DEVICE_ALLOCATED;
use tessera_harness::cluster::{K8sBinaries, tessera_binary};
use tessera_harness::containerd::Containerd;
use tessera_harness::gpu_node::FakeGpuNode;
use tessera_harness::image::{PAUSE_IMAGE, vgpu_stand_in};
use tessera_harness::kubelet::{KubeletDriver, PodSpec, RunningPod, spec_env};
use tessera_hooks::gpu::enforce::{ENFORCEMENT_ENV, HAMI_CACHE_FILE, LD_SO_PRELOAD};

/// How many routes.
const ROUTES: usize = 6;

/// Every order of the routes (6! = 720), as `Route::ALL` indices.
fn orders() -> Vec<[usize; ROUTES]> {
    fn extend(prefix: &mut Vec<usize>, all: &mut Vec<[usize; ROUTES]>) {
        if prefix.len() == ROUTES {
            let mut order = [0; ROUTES];
            order.copy_from_slice(prefix);
            all.push(order);
            return;
        }
        for route in 0..ROUTES {
            if !prefix.contains(&route) {
                prefix.push(route);
                extend(prefix, all);
                prefix.pop();
            }
        }
    }
    let mut all = Vec::new();
    extend(&mut Vec::new(), &mut all);
    all
}

/// Bytes of the 25 % share of a fake 80 GiB GPU each container is granted.
const SHARE_BYTES: u64 = 20 << 30;

/// How a container reaches containerd, in the order the table prints them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Straight to containerd: the floor.
    Direct,
    /// The proxy, `--gpu-memory-limits=off`, no HAMi-core: the GPU hook's own edits.
    HookOnly,
    /// The proxy with driver memory limits.
    DriverMemory,
    /// The proxy with MPS, driver memory limits off.
    Mps,
    /// The proxy with GPU time (`--gpu-time=on`): the container's grant written
    /// at StartContainer, let go at StopContainer.
    GpuTime,
    /// The proxy with HAMi-core, driver memory limits off.
    HamiCore,
}

impl Route {
    /// Every route, in table order.
    pub const ALL: [Route; ROUTES] = [
        Route::Direct,
        Route::HookOnly,
        Route::DriverMemory,
        Route::Mps,
        Route::GpuTime,
        Route::HamiCore,
    ];

    fn name(self) -> &'static str {
        match self {
            Route::Direct => "direct to containerd (floor)",
            Route::HookOnly => "proxy, GPU hook only",
            Route::DriverMemory => "proxy + driver-memory",
            Route::Mps => "proxy + mps",
            Route::GpuTime => "proxy + gpu-time",
            Route::HamiCore => "proxy + hami-core",
        }
    }

    /// What the hook tells the container holds it (`TESSERA_ENFORCEMENT`).
    fn backends(self) -> Option<String> {
        match self {
            Route::Direct => None,
            Route::HookOnly => Some(joined(&[])),
            Route::DriverMemory => Some(joined(&[Backend::DriverMemory])),
            Route::Mps => Some(joined(&[Backend::Mps])),
            Route::GpuTime => Some(joined(&[Backend::GpuTime])),
            Route::HamiCore => Some(joined(&[Backend::HamiCore])),
        }
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// Rounds; each a fresh pod per route.
    pub rounds: usize,
    /// Containers each route starts per round, one route at a time.
    pub containers: usize,
    /// Where tessera-runtime-proxy, tessera-enforce and fake-mps-control are
    /// [default: beside this binary].
    pub bin_dir: Option<PathBuf>,
}

/// What a run measured and checked.
#[derive(Debug)]
pub struct Report {
    /// containerd's version, as its Version call reports it.
    pub runtime_version: String,
    /// CreateContainer + StartContainer per container, by [`Route::ALL`] index.
    pub samples: [Vec<Duration>; ROUTES],
    /// Per round, each route's p50, by [`Route::ALL`] index.
    pub round_p50s: Vec<[Duration; ROUTES]>,
    /// The fake NVML's `SetMemoryLimits` calls (one per driver-memory container, checked).
    pub limits_set: usize,
    /// Containers whose spec was checked for the preload mount (every hami-core one).
    pub preload_mounts: usize,
    /// mps containers whose namespace the MPS daemon was asked for and held the share.
    pub mps_namespaces: usize,
    /// gpu-time containers held from their start (grant file) and let go at their stop.
    pub gpu_time_grants: usize,
    /// CreateContainer calls refused with an unresolvable CDI device, then retried.
    pub cdi_unresolvable: usize,
}

/// The `q` quantile of `samples` (nearest rank).
pub fn quantile(samples: &[Duration], q: f64) -> Duration {
    let mut sorted = samples.to_vec();
    sorted.sort();
    let index = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted.get(index).copied().unwrap_or_default()
}

/// A pod sandbox of the bench, as kubelet would describe it again per container.
#[derive(Debug, Clone)]
struct Pod {
    spec: PodSpec,
    config: cri::PodSandboxConfig,
    sandbox_id: String,
}

/// The node and processes every route shares, and each route's socket.
struct Bench {
    containerd: Containerd,
    dir: tempfile::TempDir,
    gpu_uuid: String,
    limits_log: PathBuf,
    /// Kept to be killed on drop.
    _proxies: Vec<tokio::process::Child>,
    drivers: Vec<KubeletDriver>,
    /// Containers started through driver-memory, warm-up included.
    limited: usize,
    /// [`orders`], and how many turns took one so far.
    orders: Vec<[usize; ROUTES]>,
    turns: usize,
    preload_mounts: usize,
    mps_namespaces: usize,
    gpu_time_grants: usize,
    /// The fake MPS control program and its daemon's pipe directory.
    mps_control: PathBuf,
    mps_pipe: PathBuf,
    /// Kept to be killed on drop (after the proxies).
    _mps_daemon: tokio::process::Child,
    cdi_unresolvable: usize,
    /// Last: its drop removes the pods' cgroups once containerd's drop killed all.
    cgroups: PodCgroups,
}

/// The bench's pod cgroups: under a root of their own, not `/kubepods`, because a
/// kubelet on this machine (the cluster tier's) SIGKILLs every process in a pod
/// cgroup there that it does not know. Dropping it removes them, as no kubelet will.
struct PodCgroups(String);

impl Drop for PodCgroups {
    fn drop(&mut self) {
        let Ok(controllers) = std::fs::read_dir("/sys/fs/cgroup") else {
            return;
        };
        for controller in controllers.flatten() {
            let mut dirs = vec![controller.path().join(&self.0)];
            let mut index = 0;
            while let Some(dir) = dirs.get(index).cloned() {
                let children = std::fs::read_dir(&dir).into_iter().flatten().flatten();
                dirs.extend(children.map(|e| e.path()).filter(|p| p.is_dir()));
                index += 1;
            }
            // Deepest first: a cgroup with children cannot go.
            for dir in dirs.iter().rev() {
                let _ = std::fs::remove_dir(dir);
            }
        }
    }
}

/// Starts `program` with `args` (stderr to `log`, killed on drop) and waits up
/// to 10 s for it to serve `socket`; fails with its log if it exits or does not.
async fn spawn_serving(
    program: &Path,
    args: &[String],
    log: &Path,
    socket: &Path,
    what: &str,
) -> anyhow::Result<tokio::process::Child> {
    let mut child = tokio::process::Command::new(program)
        .args(args)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log)?)
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", program.display()))?;
    let begun = Instant::now();
    while !socket.exists() {
        if child.try_wait()?.is_some() || begun.elapsed() > Duration::from_secs(10) {
            bail!(
                "{what} did not serve {}: {}",
                socket.display(),
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(child)
}

/// Runs the bench; see the module docs.
pub async fn run(k8s: &K8sBinaries, options: &Options) -> anyhow::Result<Report> {
    ensure!(
        options.rounds >= 1 && options.containers >= 1,
        "--rounds and --containers must be at least 1"
    );
    let mut bench = Bench::start(k8s, options).await?;
    let runtime_version = bench.drivers[0].version().await?.runtime_version;
    // Warm-up, untimed: the first container of each path pays for cold caches.
    bench.round("warm", 1).await?;
    let mut samples: [Vec<Duration>; ROUTES] = Default::default();
    let mut round_p50s = Vec::new();
    for round in 0..options.rounds {
        let times = bench.round(&round.to_string(), options.containers).await?;
        round_p50s.push(std::array::from_fn(|i| quantile(&times[i], 0.5)));
        for (all, these) in samples.iter_mut().zip(times) {
            all.extend(these);
        }
    }
    Ok(Report {
        runtime_version,
        samples,
        round_p50s,
        limits_set: bench.limited,
        preload_mounts: bench.preload_mounts,
        mps_namespaces: bench.mps_namespaces,
        gpu_time_grants: bench.gpu_time_grants,
        cdi_unresolvable: bench.cdi_unresolvable,
    })
}

impl Bench {
    async fn start(k8s: &K8sBinaries, options: &Options) -> anyhow::Result<Self> {
        let binary = |name: &str| match &options.bin_dir {
            Some(dir) if dir.join(name).is_file() => Ok(dir.join(name)),
            Some(dir) => bail!("--bin-dir {}: no {name} there", dir.display()),
            None => tessera_binary(name),
        };
        let (proxy, enforce) = (binary("tessera-runtime-proxy")?, binary("tessera-enforce")?);
        let mps_control = binary("fake-mps-control")?;
        let containerd = Containerd::start_cdi(k8s).await?;
        // Short: unix socket paths are limited to 108 bytes.
        let dir = tempfile::Builder::new()
            .prefix("tbenf-")
            .tempdir_in("/tmp")?;
        let node = FakeGpuNode::create(dir.path(), 4)?;
        let limits_log = dir.path().join("memory-limits.jsonl");
        let description = tessera_harness::fake_nvml::with_compute_mode_log(
            tessera_harness::fake_nvml::with_memory_limits(
                tessera_harness::fake_nvml::describe(&node),
                &limits_log,
            ),
            &dir.path().join("compute-mode.jsonl"),
        );
        let nvml = tessera_harness::fake_nvml::install(&dir.path().join("nvml"), &description)?;
        // The node's MPS: Tessera's supervisor over the fake daemon.
        let mps_pipe = dir.path().join("mps");
        let mps_state = dir
            .path()
            .join(format!("enforce{}", Route::Mps as usize))
            .join("mps");
        let mps_args = vec![
            "mps-daemon".to_owned(),
            format!("--control={}", mps_control.display()),
            format!("--pipe-dir={}", mps_pipe.display()),
            format!("--log-dir={}", dir.path().join("mps-log").display()),
            format!("--state-dir={}", mps_state.display()),
            format!("--nvml-library={}", nvml.display()),
        ];
        let mps_daemon = spawn_serving(
            &enforce,
            &mps_args,
            &dir.path().join("mps-daemon.log"),
            &mps_pipe.join("control"),
            "the MPS supervisor's daemon",
        )
        .await?;
        let hami = vgpu_stand_in(&dir.path().join("hami"))?;
        let no_hooks = dir.path().join("no-hooks.d");
        std::fs::create_dir_all(&no_hooks)?;

        let mut drivers = vec![KubeletDriver::connect(&containerd.socket()).await?];
        let mut proxies = Vec::new();
        for (index, route) in Route::ALL.into_iter().enumerate().skip(1) {
            let socket = dir.path().join(format!("proxy{index}.sock"));
            let flag = |name: &str, path: &Path| format!("--{name}={}", path.display());
            let mut args = vec![
                flag("listen", &socket),
                flag("runtime-endpoint", &containerd.socket()),
                "--metrics-addr=off".into(),
                flag("hooks-dir", &no_hooks),
                flag("device-root", &node.device_root),
                flag("driver-gpus", &node.driver_gpus),
                flag("nvml-library", &nvml),
                // Absent: no device plugin gave any GPU.
                flag("kubelet-checkpoint", &node.kubelet_checkpoint),
                flag(
                    "enforcement-dir",
                    &dir.path().join(format!("enforce{index}")),
                ),
            ];
            match route {
                Route::DriverMemory => args.extend([
                    "--gpu-memory-limits=on".into(),
                    flag("enforce-binary", &enforce),
                    flag("cdi-spec-dir", &containerd.cdi_dir()),
                ]),
                Route::Mps => args.extend([
                    "--gpu-memory-limits=off".into(),
                    "--mps=on".into(),
                    flag("mps-control", &mps_control),
                    flag("mps-pipe-dir", &mps_pipe),
                ]),
                Route::HamiCore => args.extend([
                    "--gpu-memory-limits=off".into(),
                    flag("hami-core-library", &hami),
                    flag("enforce-binary", &enforce),
                ]),
                Route::GpuTime => {
                    args.extend(["--gpu-memory-limits=off".into(), "--gpu-time=on".into()])
                }
                _ => args.push("--gpu-memory-limits=off".into()),
            }
            if route != Route::GpuTime {
                args.push("--gpu-time=off".into());
            }
            // The OOM kill adds nothing to a create or start (it reads the GPUs every
            // 0.5 s, apart from any call): off, so each route is its one backend.
            args.push("--oom-kill=off".into());
            let log = dir.path().join(format!("proxy{index}.log"));
            let what = format!("{} ({})", proxy.display(), route.name());
            let child = spawn_serving(&proxy, &args, &log, &socket, &what).await?;
            drivers.push(KubeletDriver::connect(&socket).await?);
            proxies.push(child);
        }
        let cgroups = PodCgroups(format!(
            "tessera-bench-{}",
            dir.path().file_name().unwrap_or_default().to_string_lossy()
        ));
        Ok(Self {
            cgroups,
            containerd,
            gpu_uuid: node.gpus[0].uuid.clone(),
            dir,
            limits_log,
            _proxies: proxies,
            drivers,
            limited: 0,
            orders: orders(),
            turns: 0,
            preload_mounts: 0,
            mps_namespaces: 0,
            gpu_time_grants: 0,
            mps_control,
            mps_pipe,
            _mps_daemon: mps_daemon,
            cdi_unresolvable: 0,
        })
    }

    /// The scheduler's allocation: 25 % of GPU 0 for container `main`, per-container form.
    fn allocation(&self) -> String {
        let share = json!({"koordinator.sh/gpu-core": 25, "koordinator.sh/gpu-memory-ratio": 25, "koordinator.sh/gpu-memory": "20Gi"});
        json!({"gpu": [{"minor": 0, "id": self.gpu_uuid, "resources": share,
            "extension": {"containers": {"main": share}}}]})
        .to_string()
    }

    /// One pod per route, each made just before its first container (as kubelet
    /// does, so the CDI spec has only that gap to be read in); `containers` times
    /// one container on every route, each turn in the next of all 720 orders (so
    /// each route follows every other equally often, as `tessera-bench proxy`
    /// does); then the pods go. Returns each route's times.
    async fn round(
        &mut self,
        tag: &str,
        containers: usize,
    ) -> anyhow::Result<[Vec<Duration>; ROUTES]> {
        let mut pods: [Option<Pod>; ROUTES] = Default::default();
        let mut times: [Vec<Duration>; ROUTES] = Default::default();
        for attempt in 0..containers {
            let order = self.orders[self.turns % self.orders.len()];
            self.turns += 1;
            for index in order {
                let route = Route::ALL[index];
                let pod = match &pods[index] {
                    Some(pod) => pod.clone(),
                    None => pods[index].insert(self.open_pod(route, tag).await?).clone(),
                };
                let attempt = u32::try_from(attempt)?;
                times[index].push(self.container(route, &pod, attempt).await?);
            }
        }
        for (index, pod) in pods.into_iter().enumerate() {
            if let Some(pod) = pod {
                let sandbox = RunningPod {
                    sandbox_id: pod.sandbox_id,
                    containers: Vec::new(),
                    // The bench removes its own cgroup root.
                    cgroup_parent: String::new(),
                };
                self.drivers[index].stop_and_remove_pod(&sandbox).await?;
            }
        }
        Ok(times)
    }

    /// RunPodSandbox of a pod granted 25 % of GPU 0 for `main`, through `route`.
    async fn open_pod(&mut self, route: Route, tag: &str) -> anyhow::Result<Pod> {
        let mut pod = PodSpec::new("bench", &format!("enforce-{}-{tag}", route as usize));
        pod.log_directory = Some(self.dir.path().join("logs").join(&pod.name));
        pod.annotations
            .insert(DEVICE_ALLOCATED.into(), self.allocation());
        let mut config = pod.sandbox_config();
        if let Some(linux) = config.linux.as_mut() {
            linux.cgroup_parent = format!("/{}/pod{}", self.cgroups.0, pod.uid);
        }
        std::fs::create_dir_all(pod.log_directory().join("main"))?;
        let sandbox = self.drivers[route as usize]
            .runtime
            .run_pod_sandbox(cri::RunPodSandboxRequest {
                config: Some(config.clone()),
                runtime_handler: String::new(),
            })
            .await?
            .into_inner()
            .pod_sandbox_id;
        Ok(Pod {
            spec: pod,
            config,
            sandbox_id: sandbox,
        })
    }

    /// CreateContainer + StartContainer of `main` (timed; attempt `attempt`, as
    /// kubelet numbers a container's restarts), its checks, then StopContainer
    /// and RemoveContainer.
    async fn container(
        &mut self,
        route: Route,
        pod: &Pod,
        attempt: u32,
    ) -> anyhow::Result<Duration> {
        let mut driver = self.drivers[route as usize].clone();
        let mut config = pod.spec.container_config("main", PAUSE_IMAGE, &[]);
        config.metadata = Some(cri::ContainerMetadata {
            name: "main".into(),
            attempt,
        });
        config.log_path = format!("main/{attempt}.log");
        let request = cri::CreateContainerRequest {
            pod_sandbox_id: pod.sandbox_id.clone(),
            config: Some(config),
            sandbox_config: Some(pod.config.clone()),
        };
        let begun = Instant::now();
        let id = loop {
            match driver.runtime.create_container(request.clone()).await {
                Ok(response) => break response.into_inner().container_id,
                // containerd reads new CDI spec files asynchronously; the proxy
                // writes them at RunPodSandbox to leave it time. Counted, reported.
                Err(status)
                    if status.message().contains("unresolvable CDI devices")
                        && begun.elapsed() < Duration::from_secs(5) =>
                {
                    self.cdi_unresolvable += 1;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(status) => bail!("{}: CreateContainer: {status}", route.name()),
            }
        };
        let start = cri::StartContainerRequest {
            container_id: id.clone(),
        };
        driver
            .runtime
            .start_container(start)
            .await
            .with_context(|| {
                format!(
                    "{}: StartContainer; containerd's log:\n{}",
                    route.name(),
                    self.containerd.log_tail()
                )
            })?;
        let elapsed = begun.elapsed();
        self.limited += usize::from(route == Route::DriverMemory);
        self.check_spec(route, &mut driver, &id).await?;
        self.check_limits(route)?;
        if route == Route::Mps {
            self.check_namespace(&pod.spec.uid)?;
        }
        let grant = self
            .dir
            .path()
            .join(format!("enforce{}", Route::GpuTime as usize))
            .join("gpu-time")
            .join(format!("{}_{id}", pod.spec.uid));
        if route == Route::GpuTime {
            ensure!(
                grant.is_file(),
                "{}: container {id} started without its grant {}",
                route.name(),
                grant.display()
            );
        }
        let stop = cri::StopContainerRequest {
            container_id: id.clone(),
            timeout: 10,
        };
        driver.runtime.stop_container(stop).await?;
        if route == Route::GpuTime {
            ensure!(
                !grant.exists(),
                "{}: container {id} stopped, its grant {} still there",
                route.name(),
                grant.display()
            );
            self.gpu_time_grants += 1;
        }
        let remove = cri::RemoveContainerRequest { container_id: id };
        driver.runtime.remove_container(remove).await?;
        Ok(elapsed)
    }

    /// The container's spec shows the route's edits: its `TESSERA_ENFORCEMENT`
    /// (the hook ran, with the backends configured) and, for hami-core, the
    /// preload list mounted.
    async fn check_spec(
        &mut self,
        route: Route,
        driver: &mut KubeletDriver,
        id: &str,
    ) -> anyhow::Result<()> {
        let Some(backends) = route.backends() else {
            return Ok(());
        };
        let spec = driver.container_spec(id).await?;
        let told = spec_env(&spec, ENFORCEMENT_ENV);
        ensure!(
            told.as_deref() == Some(backends.as_str()),
            "{}: container {id} has {ENFORCEMENT_ENV}={told:?}, want {backends:?}: the path did not run as configured",
            route.name()
        );
        let preload = spec["mounts"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|m| m["destination"] == LD_SO_PRELOAD);
        ensure!(
            preload == (route == Route::HamiCore),
            "{}: container {id}: {LD_SO_PRELOAD} mounted: {preload}",
            route.name()
        );
        if preload {
            // Its region was written with the grant, by the primer, before it started
            // (the stand-in records its writer).
            let region = spec["mounts"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|m| m["destination"] == HAMI_CACHE_FILE)
                .and_then(|m| m["source"].as_str())
                .context("a hami-core container without its region mount")?;
            let written = std::fs::read_to_string(region)?;
            ensure!(
                written.contains("writer=tessera-enforce\nCUDA_DEVICE_MEMORY_LIMIT_0="),
                "hami-core: container {id}: region {region} holds {written:?}: not written by the primer"
            );
        }
        self.preload_mounts += usize::from(preload);
        Ok(())
    }

    /// The MPS daemon holds the container's namespace with the share: 20 GiB of
    /// pinned memory, 25 % of the threads (asked through the control program, as
    /// an operator would).
    fn check_namespace(&mut self, pod_uid: &str) -> anyhow::Result<()> {
        let name = tessera_enforce::mps::namespace_name(pod_uid, "main")
            .context("no namespace name for the bench pod")?;
        let get = |field: &str| -> anyhow::Result<String> {
            let output = std::process::Command::new(&self.mps_control)
                .args(["-p", "3", "namespace", "get", &name, "gpu_0", field])
                .env("CUDA_MPS_PIPE_DIRECTORY", &self.mps_pipe)
                .output()?;
            ensure!(
                output.status.success(),
                "MPS namespace {name}: {}",
                String::from_utf8_lossy(&output.stderr)
            );
            Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
        };
        let held = (
            get("pinned-memory-limit")?,
            get("active-thread-percentage")?,
        );
        ensure!(
            held == ("20G".to_owned(), "25.00".to_owned()),
            "MPS namespace {name} holds {held:?}, want 20G / 25.00"
        );
        self.mps_namespaces += 1;
        Ok(())
    }

    /// After `route`'s containers: the fake NVML logged one SetMemoryLimits call
    /// per driver-memory container (the hook runs inside runc create, so before
    /// StartContainer returns), none for any other, each the share on GPU 0, set.
    fn check_limits(&self, route: Route) -> anyhow::Result<()> {
        let text = std::fs::read_to_string(&self.limits_log).unwrap_or_default();
        let calls: Vec<Value> = text
            .lines()
            .map(|line| serde_json::from_str(line).with_context(|| format!("{line:?}")))
            .collect::<anyhow::Result<_>>()?;
        ensure!(
            calls.len() == self.limited,
            "after {}'s containers, the fake NVML logged {} SetMemoryLimits calls, want {} (one per driver-memory container)",
            route.name(),
            calls.len(),
            self.limited
        );
        for call in &calls {
            ensure!(
                call["uuid"] == self.gpu_uuid.as_str()
                    && call["softLimit"] == SHARE_BYTES
                    && call["hardLimit"] == SHARE_BYTES
                    && call["result"] == 0,
                "SetMemoryLimits call {call}: want {} soft = hard = {SHARE_BYTES}, result 0 (containerd log: {})",
                self.gpu_uuid,
                self.containerd.log_tail()
            );
        }
        Ok(())
    }
}

/// Prints the report: per route p50/p90/p99 and p50 ratios to the floor and to
/// the GPU hook alone, then what the run proved.
pub fn print(report: &Report, options: &Options) {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let p50 = |i: usize| ms(quantile(&report.samples[i], 0.5));
    println!(
        "tessera-bench enforce: containerd {} (CDI on), runc, pause image, fake 4-GPU node; each container \
         granted 25 % of GPU 0; {} rounds × {} containers per path (after one untimed each), interleaved \
         container by container, each turn in the next of all 720 orders; timed: CreateContainer + StartContainer",
        report.runtime_version, options.rounds, options.containers
    );
    println!(
        "{:<30} {:>9} {:>9} {:>9} {:>10} {:>13} {:>10}",
        "path", "p50", "p90", "p99", "/ direct", "/ hook only", "p50 added"
    );
    for (i, route) in Route::ALL.iter().enumerate() {
        let q = |q: f64| ms(quantile(&report.samples[i], q));
        println!(
            "{:<30} {:>6.1} ms {:>6.1} ms {:>6.1} ms {:>10.3} {:>13.3} {:>7.1} ms",
            route.name(),
            q(0.5),
            q(0.9),
            q(0.99),
            p50(i) / p50(0),
            p50(i) / p50(1),
            p50(i) - p50(0)
        );
    }
    let per_round = |i: usize| -> String {
        let each: Vec<String> = report
            .round_p50s
            .iter()
            .map(|r| format!("{:.3}", ms(r[i]) / ms(r[1])))
            .collect();
        each.join(" ")
    };
    println!("p50 / hook only's, round by round:");
    for i in 2..ROUTES {
        println!("  {:<28} {}", Route::ALL[i].name(), per_round(i));
    }
    println!(
        "checked: {} SetMemoryLimits calls (20 GiB soft = hard, result 0), one per container started through \
         driver-memory, none from other paths; {LD_SO_PRELOAD} mounted, and the region written with the grant \
         before the start, in all {} hami-core containers, and no preload in any other; the MPS daemon held 20G / 25.00 for all {} mps containers' namespaces; all {} gpu-time containers held from \
         their start and let go at their stop; {ENFORCEMENT_ENV} as \
         configured in every proxied container; CreateContainer refused for an unresolvable CDI device: {} times",
        report.limits_set,
        report.preload_mounts,
        report.mps_namespaces,
        report.gpu_time_grants,
        report.cdi_unresolvable
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders_are_the_720_permutations() {
        let all = orders();
        assert_eq!(all.len(), 720);
        assert!(
            all.iter()
                .all(|o| all.iter().filter(|p| *p == o).count() == 1)
        );
    }

    /// One container per path, end to end: every path runs and proves itself.
    #[tokio::test]
    async fn one_container_per_path_runs_and_is_checked() -> anyhow::Result<()> {
        let Some(k8s) = K8sBinaries::require_or_skip("bench_enforce")? else {
            return Ok(());
        };
        let options = Options {
            rounds: 1,
            containers: 1,
            bin_dir: None,
        };
        let report = run(&k8s, &options).await?;
        assert!(report.samples.iter().all(|s| s.len() == 1));
        // The warm-up's container and the round's.
        assert_eq!(
            (
                report.limits_set,
                report.preload_mounts,
                report.mps_namespaces,
                report.gpu_time_grants
            ),
            (2, 2, 2, 2)
        );
        print(&report, &options);
        Ok(())
    }
}
