//! A real one-node Kubernetes cluster on this machine: etcd, kube-apiserver,
//! kube-controller-manager, kube-scheduler (with tessera-scheduler as its
//! extender), kubelet → tessera-runtime-proxy → containerd 2.x, on a fake GPU node
//! (device nodes, the fake NVML library, NVIDIA's real device plugin on it) with
//! tessera-reporter publishing it.
//!
//! Every part is a real binary run as a child process; this module links none of
//! Tessera's crates, so it tests what users run. Where the binaries come from:
//! [`K8sBinaries::locate`] (`TESSERA_K8S_BIN`, then `../shared/k8s/bin`), and
//! Tessera's own next to the running test ([`tessera_binary`]).
//!
//! kubelet's device-plugin directory and checkpoint are compiled in
//! (`/var/lib/kubelet/device-plugins`), so one cluster runs on a machine at a
//! time: [`Cluster::start`] takes an exclusive lock on that directory.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{DynamicObject, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::discovery::{ApiCapabilities, ApiResource, Discovery, Scope};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};

use crate::gpu_node::FakeGpuNode;
use crate::{deploy, fake_nvml, image};

/// The environment variable naming a directory of Kubernetes binaries.
pub const K8S_BIN_ENV: &str = "TESSERA_K8S_BIN";
/// When set to `1`, a cluster test that cannot find its binaries fails instead of skipping (CI sets it).
pub const REQUIRE_ENV: &str = "TESSERA_REQUIRE_CLUSTER";
/// kubelet's compiled-in device-plugin directory.
pub const DEVICE_PLUGIN_DIR: &str = "/var/lib/kubelet/device-plugins";
/// kubelet's device checkpoint, in that directory.
pub const KUBELET_CHECKPOINT: &str = "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint";
/// The node's name.
pub const NODE_NAME: &str = "tessera-node";
/// Identity (service account user) tessera-scheduler runs as; the admission policy names it.
pub const SCHEDULER_USER: &str = "system:serviceaccount:tessera-system:tessera-scheduler";
/// Identity tessera-reporter runs as.
pub const REPORTER_USER: &str = "system:serviceaccount:tessera-system:tessera-reporter";
/// The reporter's service account: its namespace and name (deploy/reporter.yaml).
pub const REPORTER_NAMESPACE: &str = "tessera-system";
/// See [`REPORTER_NAMESPACE`].
pub const REPORTER_ACCOUNT: &str = "tessera-reporter";
/// Tessera's DRA driver, as `tessera_api::dra::DRIVER` names it (the harness links
/// no product crate).
pub const DRA_DRIVER: &str = "gpu.tessera.io";
/// An ordinary tenant: may create and change pods in `default`, nothing more.
pub const TENANT_USER: &str = "tenant";
/// A second scheduler: may bind pods and patch them, as any scheduler may.
pub const OTHER_SCHEDULER_USER: &str = "system:serviceaccount:kube-system:other-scheduler";

const ETCD_CLIENT: u16 = 12379;
const ETCD_PEER: u16 = 12380;
const APISERVER_PORT: u16 = 16443;
const KUBELET_PORT: u16 = 10250;
const KUBELET_HEALTHZ_PORT: u16 = 10248;
/// Where tessera-scheduler (the extender) listens; kube-scheduler calls it here.
pub const EXTENDER_PORT: u16 = 18888;
/// Where a second tessera-scheduler replica listens ([`Component::ExtenderReplica`]).
pub const EXTENDER_REPLICA_PORT: u16 = 18890;
/// The proxy's Prometheus endpoint.
pub const PROXY_METRICS_PORT: u16 = 19464;
/// tessera-reporter's Prometheus endpoint.
pub const REPORTER_METRICS_PORT: u16 = 19465;
/// tessera-scheduler's Prometheus endpoint.
pub const SCHEDULER_METRICS_PORT: u16 = 19466;
/// The second replica's Prometheus endpoint.
const REPLICA_METRICS_PORT: u16 = 19467;

// === impl K8sBinaries ===

/// Where the Kubernetes binaries are (etcd, kube-*, kubelet, containerd 2.x, ctr,
/// the NVIDIA device plugin, critest, crictl).
#[derive(Debug, Clone)]
pub struct K8sBinaries {
    dir: PathBuf,
}

impl K8sBinaries {
    /// `TESSERA_K8S_BIN` (plain binaries), else `../shared/k8s/bin` beside the
    /// repository (`*.xz`, decompressed once into `target/k8s-bin`). `Ok(None)`
    /// when neither exists: the caller skips, loudly, or fails under
    /// [`REQUIRE_ENV`].
    pub fn locate() -> anyhow::Result<Option<Self>> {
        if let Some(dir) = std::env::var_os(K8S_BIN_ENV) {
            let dir = PathBuf::from(dir);
            if !dir.join("kubelet").is_file() {
                bail!("{K8S_BIN_ENV}={}: no kubelet there", dir.display());
            }
            return Ok(Some(Self { dir }));
        }
        let repo = repo_root();
        let shared = repo.join("../shared/k8s/bin");
        if !shared.is_dir() {
            return Ok(None);
        }
        let cache = repo.join("target/k8s-bin");
        std::fs::create_dir_all(&cache)?;
        for entry in std::fs::read_dir(&shared)? {
            let path = entry?.path();
            let Some(name) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".xz"))
            else {
                continue;
            };
            let target = cache.join(name);
            let fresh = |t: &Path| -> bool {
                let (Ok(a), Ok(b)) = (t.metadata(), path.metadata()) else {
                    return false;
                };
                matches!((a.modified(), b.modified()), (Ok(a), Ok(b)) if a >= b)
            };
            if fresh(&target) {
                continue;
            }
            // Decompress to a temporary name first: an interrupted run leaves no half binary.
            let partial = cache.join(format!(".{name}.partial"));
            let out = std::fs::File::create(&partial)?;
            let status = Command::new("xz")
                .arg("-dc")
                .arg(&path)
                .stdout(out)
                .status()
                .context("running xz (apt-get install xz-utils)")?;
            if !status.success() {
                bail!("xz -dc {} failed with {status}", path.display());
            }
            std::fs::set_permissions(
                &partial,
                std::os::unix::fs::PermissionsExt::from_mode(0o755),
            )?;
            std::fs::rename(&partial, &target)?;
        }
        Ok(Some(Self { dir: cache }))
    }

    /// The binaries, or why a cluster test does not run: `Err` when
    /// [`REQUIRE_ENV`] is set (CI), `Ok(None)` after a loud message otherwise.
    pub fn require_or_skip(test: &str) -> anyhow::Result<Option<Self>> {
        if let Some(found) = Self::locate()? {
            return Ok(Some(found));
        }
        let why = format!(
            "{test}: no Kubernetes binaries: set {K8S_BIN_ENV} to a directory holding kubelet, \
             kube-apiserver, … or put ../shared/k8s/bin beside the repository"
        );
        if std::env::var(REQUIRE_ENV).as_deref() == Ok("1") {
            bail!("{why} ({REQUIRE_ENV}=1: a skipped cluster test is a failure)");
        }
        eprintln!("\n!!!!!!!! SKIPPED {why} !!!!!!!!\n");
        Ok(None)
    }

    /// The binary `name`.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

/// The repository root (this crate lives in `integration/harness/`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// One of Tessera's binaries from the target directory of the running test
/// (`cargo build --workspace --bins` puts them there), or `TESSERA_BIN_DIR`.
pub fn tessera_binary(name: &str) -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("TESSERA_BIN_DIR") {
        let path = PathBuf::from(dir).join(name);
        return if path.is_file() {
            Ok(path)
        } else {
            bail!("TESSERA_BIN_DIR has no {name}")
        };
    }
    let exe = std::env::current_exe()?;
    exe.ancestors()
        .skip(1)
        .take(3)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
        .with_context(|| {
            format!(
                "{name} not found near {}: run cargo build --workspace --bins first",
                exe.display()
            )
        })
}

// === impl Process ===

/// The JSON lines of a log file (none when it does not exist).
fn read_jsonl(path: &Path) -> anyhow::Result<Vec<Value>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e.into()),
    };
    text.lines()
        .map(|line| serde_json::from_str(line).with_context(|| format!("log line {line:?}")))
        .collect()
}

/// A component of the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Component {
    /// etcd.
    Etcd,
    /// kube-apiserver.
    ApiServer,
    /// kube-controller-manager.
    ControllerManager,
    /// kube-scheduler.
    Scheduler,
    /// tessera-scheduler, kube-scheduler's extender.
    Extender,
    /// A second tessera-scheduler replica, contending for the same Lease; only
    /// after [`Cluster::start_extender_replica`].
    ExtenderReplica,
    /// containerd 2.x.
    Containerd,
    /// tessera-runtime-proxy between kubelet and containerd.
    RuntimeProxy,
    /// kubelet.
    Kubelet,
    /// NVIDIA's device plugin on the fake NVML library.
    DevicePlugin,
    /// tessera-reporter.
    Reporter,
    /// `tessera-enforce mps-daemon` supervising the fake MPS control daemon
    /// (`fake-mps-control`); only with [`ClusterOptions::enforcement`].
    MpsDaemon,
}

impl fmt::Display for Component {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Etcd => "etcd",
            Self::ApiServer => "kube-apiserver",
            Self::ControllerManager => "kube-controller-manager",
            Self::Scheduler => "kube-scheduler",
            Self::Extender => "tessera-scheduler",
            Self::ExtenderReplica => "tessera-scheduler-replica",
            Self::Containerd => "containerd",
            Self::RuntimeProxy => "tessera-runtime-proxy",
            Self::Kubelet => "kubelet",
            Self::DevicePlugin => "nvidia-device-plugin",
            Self::Reporter => "tessera-reporter",
            Self::MpsDaemon => "tessera-mps",
        })
    }
}

/// A child process with its command kept for restarts and its output in a log file.
#[derive(Debug)]
struct Process {
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    log: PathBuf,
    child: Option<Child>,
}

impl Process {
    fn spawn(&mut self) -> anyhow::Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let child = Command::new(&self.program)
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("spawning {}", self.program.display()))?;
        self.child = Some(child);
        Ok(())
    }

    /// SIGTERM, then SIGKILL after `grace`; waits for the exit. How it exited,
    /// when by itself within `grace`.
    fn stop(&mut self, grace: Duration) -> Option<std::process::ExitStatus> {
        let mut child = self.child.take()?;
        if let Ok(pid) = i32::try_from(child.id()) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
        let started = Instant::now();
        while started.elapsed() < grace {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
        None
    }

    /// `Some(status)` when it has exited.
    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

// === impl Cluster ===

/// What to run besides the control plane and the node.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// Fake GPUs on the node.
    pub gpus: u32,
    /// Run NVIDIA's device plugin on the fake NVML library, serving `nvidia.com/gpu`.
    pub device_plugin: bool,
    /// Extra flags for tessera-runtime-proxy.
    pub proxy_args: Vec<String>,
    /// Run Tessera's cluster side as the harness does: deploy/'s CRD, RBAC and
    /// admission policies applied, tessera-scheduler and tessera-reporter as
    /// processes. `false` leaves all of it to an install (the Helm chart), and
    /// kube-scheduler's extender URL to [`Cluster::set_extender`].
    pub cluster_side: bool,
    /// NVLinks between the fake GPUs, as pairs of minors; `None`: each PCIe
    /// switch pair (0-1, 2-3) ([`fake_nvml::pair_nvlinks`]). [`Cluster::set_nvlinks`]
    /// changes them on a running cluster.
    pub nvlinks: Option<Vec<[u32; 2]>>,
    /// Enforced shares: the fake NVML has the driver's per-cgroup memory limits
    /// (its calls logged, [`Cluster::memory_limit_calls`]), containerd runs CDI
    /// hooks, and the proxy sets limits through `tessera-enforce` and preloads a
    /// stand-in for HAMi-core's `libvgpu.so`.
    pub enforcement: bool,
    /// With `enforcement`, MPS too: `tessera-enforce mps-daemon` supervises the
    /// fake MPS daemon ([`Component::MpsDaemon`]) and the proxy runs `--mps=on`.
    /// Off by default, as on a node: a container with shares of several GPUs is
    /// then placed only where MPS is not.
    pub mps: bool,
    /// The reporter publishes the node's GPUs for DRA (`tessera-reporter run
    /// --dra`): a ResourceSlice, and a Device CR with no GPU.
    pub dra: bool,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        Self {
            gpus: 4,
            device_plugin: true,
            proxy_args: Vec::new(),
            cluster_side: true,
            nvlinks: None,
            enforcement: false,
            mps: false,
            dra: false,
        }
    }
}

/// A running cluster. Dropping it stops every process, kills the containers,
/// unmounts what they left and removes its directory.
#[derive(Debug)]
pub struct Cluster {
    dir: tempfile::TempDir,
    k8s: K8sBinaries,
    processes: BTreeMap<Component, Process>,
    /// The fake GPU node's device nodes and driver files.
    pub gpu_node: FakeGpuNode,
    api_route: Option<ApiServiceRoute>,
    enforcement: bool,
    /// [`ClusterOptions::dra`].
    dra: bool,
    _lock: nix::fcntl::Flock<std::fs::File>,
}

impl Cluster {
    /// Brings the whole cluster up and waits until the node is Ready, its GPUs are
    /// published and the extender answers. Needs root.
    pub async fn start(k8s: K8sBinaries, options: ClusterOptions) -> anyhow::Result<Self> {
        if !nix::unistd::Uid::effective().is_root() {
            bail!("the cluster harness needs root (kubelet, containerd, runc, mknod)");
        }
        crate::containerd::require_tools(&["runc", "cc", "openssl", "iptables"])?;
        std::fs::create_dir_all(DEVICE_PLUGIN_DIR)?;
        // kubelet's device-plugin path is fixed, so only one cluster runs per machine:
        // a second waits its turn (20 minutes at most).
        let waiting = Instant::now();
        let mut said = false;
        let mut lock_file = std::fs::File::create("/var/lib/kubelet/.tessera-cluster.lock")?;
        let lock = loop {
            match nix::fcntl::Flock::lock(lock_file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
                Ok(lock) => break lock,
                Err((file, nix::errno::Errno::EWOULDBLOCK))
                    if waiting.elapsed() < Duration::from_secs(20 * 60) =>
                {
                    if !std::mem::replace(&mut said, true) {
                        eprintln!(
                            "another Tessera cluster runs on this machine (lock \
                             /var/lib/kubelet/.tessera-cluster.lock): waiting for it to end"
                        );
                    }
                    lock_file = file;
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Err((_, e)) => bail!(
                    "another Tessera cluster runs on this machine (lock /var/lib/kubelet/.tessera-cluster.lock: {e}, \
                     waited {:?}); kubelet's device-plugin path is fixed, so only one can",
                    waiting.elapsed()
                ),
            }
        };
        // A checkpoint or plugin socket left by an earlier cluster would be read as this one's.
        clear_dir(Path::new(DEVICE_PLUGIN_DIR))?;

        // Short path: unix socket paths are limited to 108 bytes.
        let dir = tempfile::Builder::new().prefix("tcl-").tempdir_in("/tmp")?;
        for sub in [
            "logs",
            "pki",
            "manifests",
            "kubelet",
            "cni/conf",
            "certs.d",
            "hooks.d",
        ] {
            std::fs::create_dir_all(dir.path().join(sub))?;
        }
        let gpu_node = FakeGpuNode::create(&dir.path().join("node"), options.gpus)?;
        let mut cluster = Self {
            dir,
            k8s,
            processes: BTreeMap::new(),
            gpu_node,
            api_route: None,
            enforcement: options.enforcement,
            dra: options.dra,
            _lock: lock,
        };
        cluster.write_files()?;
        let started = Instant::now();
        cluster.start_control_plane(&options).await?;
        cluster.start_node(&options).await?;
        tracing::info!(elapsed = ?started.elapsed(), "cluster up");
        Ok(cluster)
    }

    /// The cluster's directory (logs in `logs/`, kubeconfigs, configs).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// A running component's process ID (benchmarks read its CPU time).
    pub fn pid(&self, component: Component) -> Option<u32> {
        self.processes
            .get(&component)
            .and_then(|p| p.child.as_ref())
            .map(Child::id)
    }

    /// The admin kubeconfig (`system:masters`), for `kubectl --kubeconfig`.
    pub fn kubeconfig(&self) -> PathBuf {
        self.kubeconfig_for("admin")
    }

    /// A namespace tenant's kubeconfig: pods, their logs and exec in `default`,
    /// nothing cluster-wide (see `apply_test_rbac`).
    pub fn tenant_kubeconfig(&self) -> PathBuf {
        self.kubeconfig_for("tenant")
    }

    fn kubeconfig_for(&self, name: &str) -> PathBuf {
        self.dir.path().join(format!("{name}.kubeconfig"))
    }

    /// A client as the admin.
    pub async fn client(&self) -> anyhow::Result<kube::Client> {
        self.client_as("admin").await
    }

    /// A client as one of the cluster's identities: `admin`, `tenant`,
    /// `other-scheduler`, `extender`, `reporter`, `node`.
    pub async fn client_as(&self, name: &str) -> anyhow::Result<kube::Client> {
        let path = self.kubeconfig_for(name);
        let kubeconfig =
            Kubeconfig::read_from(&path).with_context(|| format!("reading {}", path.display()))?;
        let config =
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
        Ok(kube::Client::try_from(config)?)
    }

    /// A client that authenticates with a bearer `token` (e.g. a service
    /// account's, from [`Cluster::node_bound_token`]).
    pub async fn client_with_token(&self, token: &str) -> anyhow::Result<kube::Client> {
        let kubeconfig = Kubeconfig::from_yaml(&kubeconfig(
            Path::new(&self.path("pki/apiserver.crt")),
            token,
        ))?;
        let config =
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
        Ok(kube::Client::try_from(config)?)
    }

    /// containerd's CRI socket.
    pub fn containerd_socket(&self) -> PathBuf {
        self.dir.path().join("containerd.sock")
    }

    /// The proxy's socket, kubelet's runtime endpoint.
    pub fn proxy_socket(&self) -> PathBuf {
        self.dir.path().join("proxy.sock")
    }

    /// A Kubernetes binary of this cluster (`crictl`, `kubectl`, …).
    pub fn k8s_path(&self, name: &str) -> PathBuf {
        self.k8s.path(name)
    }

    /// The OCI spec containerd gave a container (`containerd://<id>` or `<id>`).
    pub fn oci_spec(&self, container_id: &str) -> anyhow::Result<Value> {
        let id = container_id.trim_start_matches("containerd://");
        let path = self
            .dir
            .path()
            .join("state/io.containerd.runtime.v2.task/k8s.io")
            .join(id)
            .join("config.json");
        let text = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        Ok(serde_json::from_slice(&text)?)
    }

    /// The last lines of a component's log.
    pub fn log_tail(&self, component: Component, lines: usize) -> String {
        self.processes
            .get(&component)
            .map(|p| p.log_tail(lines))
            .unwrap_or_default()
    }

    /// The whole log of a component.
    pub fn log(&self, component: Component) -> String {
        std::fs::read_to_string(self.log_path(component)).unwrap_or_default()
    }

    fn log_path(&self, component: Component) -> PathBuf {
        self.dir
            .path()
            .join("logs")
            .join(format!("{component}.log"))
    }

    /// Stops a component: SIGTERM, SIGKILL after 20 s. Fails when SIGTERM alone
    /// did not stop it (kubelet, systemd and container runtimes send nothing else
    /// before SIGKILL), and when one of Tessera's daemons did not handle it: dying
    /// of the signal's default action means no drain, and as a container's PID 1,
    /// where there is no default action, it would have waited for SIGKILL.
    pub fn stop(&mut self, component: Component) -> anyhow::Result<()> {
        let Some(process) = self.processes.get_mut(&component) else {
            return Ok(());
        };
        if process.child.is_none() {
            return Ok(());
        }
        let started = Instant::now();
        let Some(status) = process.stop(Duration::from_secs(20)) else {
            bail!("{component} ignored SIGTERM for 20 s and was killed");
        };
        let ours = matches!(
            component,
            Component::Extender
                | Component::ExtenderReplica
                | Component::RuntimeProxy
                | Component::Reporter
        );
        if ours && !status.success() {
            bail!("{component} did not handle SIGTERM: it exited with {status}");
        }
        tracing::info!(%component, %status, elapsed = ?started.elapsed(), "stopped on SIGTERM");
        Ok(())
    }

    /// Starts a stopped component again with the same command and waits until it is ready.
    pub async fn start_again(&mut self, component: Component) -> anyhow::Result<()> {
        let process = self
            .processes
            .get_mut(&component)
            .with_context(|| format!("{component} is not part of this cluster"))?;
        process.spawn()?;
        self.wait_ready(component).await
    }

    /// Gives the fake GPUs the NVLinks `links` (pairs of minors): rewrites the fake
    /// NVML description and restarts tessera-reporter, which reads NVML when it
    /// starts. The caller waits for the Device CR to show them.
    pub async fn set_nvlinks(&mut self, links: &[[u32; 2]]) -> anyhow::Result<()> {
        let description = self.nvml_description(links);
        std::fs::write(
            self.dir.path().join("nvml").join("fake-nvml.json"),
            serde_json::to_vec_pretty(&description)?,
        )?;
        self.restart(Component::Reporter).await
    }

    /// The fake NVML description of this node with `links`: with the driver's
    /// memory limits, logged, when the cluster enforces shares.
    fn nvml_description(&self, links: &[[u32; 2]]) -> Value {
        let description = fake_nvml::describe_with_nvlinks(&self.gpu_node, links);
        if self.enforcement {
            let description = fake_nvml::with_memory_limits(description, &self.memory_limits_log());
            let mut description =
                fake_nvml::with_compute_mode_log(description, &self.compute_mode_log());
            description["processUtilization"] =
                Value::String(self.gpu_processes_file().display().to_string());
            description
        } else {
            description
        }
    }

    /// The processes the fake NVML reports on the GPUs (`<GPU index> <pid>` lines),
    /// each using the GPU as much as it uses a CPU; a test writes it.
    pub fn gpu_processes_file(&self) -> PathBuf {
        self.dir.path().join("nvml").join("gpu-processes")
    }

    fn memory_limits_log(&self) -> PathBuf {
        self.dir.path().join("nvml").join("memory-limits.jsonl")
    }

    fn compute_mode_log(&self) -> PathBuf {
        self.dir.path().join("nvml").join("compute-mode.jsonl")
    }

    /// Every `nvmlDeviceSetComputeMode` call the fake NVML saw, in order:
    /// `{uuid, mode, pid, result}` (mode 3: exclusive process, 0: default).
    pub fn compute_mode_calls(&self) -> anyhow::Result<Vec<Value>> {
        read_jsonl(&self.compute_mode_log())
    }

    /// The fake MPS daemon's pipe directory.
    pub fn mps_pipe_dir(&self) -> PathBuf {
        self.dir.path().join("mps").join("pipe")
    }

    fn mps_log(&self) -> PathBuf {
        self.dir.path().join("mps").join("commands.jsonl")
    }

    /// What the fake MPS daemon saw, in order: `{"event":"start","args",
    /// "config"}` at each start, `{"event":"command","args","ok","output"}` per command.
    pub fn mps_events(&self) -> anyhow::Result<Vec<Value>> {
        read_jsonl(&self.mps_log())
    }

    /// Runs an MPS control command against the node's (fake) daemon; its output.
    pub fn mps_control(&self, args: &[&str]) -> anyhow::Result<String> {
        let output = Command::new(tessera_binary("fake-mps-control")?)
            .args(["-p", "3"])
            .args(args)
            .env("CUDA_MPS_PIPE_DIRECTORY", self.mps_pipe_dir())
            .output()?;
        anyhow::ensure!(
            output.status.success(),
            "mps control {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
    }

    /// Every `nvmlDeviceSetMemoryLimits_v1` call the fake NVML saw, in order:
    /// `{uuid, nameSpace, softLimit, hardLimit, pid, result}`.
    pub fn memory_limit_calls(&self) -> anyhow::Result<Vec<Value>> {
        read_jsonl(&self.memory_limits_log())
    }

    /// Where this cluster's proxy lists the node's enforcement backends (the
    /// reporter's `--enforcement-file`); a test may rewrite it.
    pub fn enforcement_backends_file(&self) -> PathBuf {
        self.dir.path().join("enforce").join("backends")
    }

    /// The checkpoint of Tessera's kubelet DRA plugin (under kubelet's root
    /// directory), which the proxy reads.
    pub fn dra_claims_file(&self) -> PathBuf {
        self.dir
            .path()
            .join("kubelet")
            .join("plugins")
            .join(DRA_DRIVER)
            .join("claims.json")
    }

    /// The CDI spec directory containerd reads.
    pub fn cdi_dir(&self) -> PathBuf {
        self.dir.path().join("cdi")
    }

    /// Kills a component with SIGKILL, as an OOM kill or a node loss would: no
    /// drain, no Lease released. [`Cluster::start_again`] brings it back.
    pub fn kill(&mut self, component: Component) -> anyhow::Result<()> {
        let process = self
            .processes
            .get_mut(&component)
            .with_context(|| format!("{component} is not part of this cluster"))?;
        if let Some(mut child) = process.child.take() {
            child.kill()?;
            child.wait()?;
        }
        tracing::info!(%component, "killed with SIGKILL");
        Ok(())
    }

    /// Starts a second tessera-scheduler replica ([`Component::ExtenderReplica`],
    /// identity `tessera-scheduler-1`, on [`EXTENDER_REPLICA_PORT`]) with the first's
    /// flags otherwise: both contend for the one Lease and a follower hands binds to
    /// the leader at the URL the Lease names. Started again if it was stopped.
    pub async fn start_extender_replica(&mut self) -> anyhow::Result<()> {
        if !self.processes.contains_key(&Component::ExtenderReplica) {
            let args = vec![
                "serve".into(),
                format!("--listen=127.0.0.1:{EXTENDER_REPLICA_PORT}"),
                format!("--kubeconfig={}", self.kubeconfig_for("extender").display()),
                format!("--advertise-url=http://127.0.0.1:{EXTENDER_REPLICA_PORT}"),
                "--identity=tessera-scheduler-1".into(),
                format!("--metrics-listen=127.0.0.1:{REPLICA_METRICS_PORT}"),
            ];
            self.launch(
                Component::ExtenderReplica,
                tessera_binary("tessera-scheduler")?,
                args,
                vec![("RUST_LOG".into(), "info".into())],
            )?;
        } else if self.processes[&Component::ExtenderReplica].child.is_none() {
            self.processes
                .get_mut(&Component::ExtenderReplica)
                .context("no replica")?
                .spawn()?;
        }
        self.wait_ready(Component::ExtenderReplica).await
    }

    /// Stops a component and starts it again.
    pub async fn restart(&mut self, component: Component) -> anyhow::Result<()> {
        let stopped = self.stop(component);
        self.start_again(component).await?;
        stopped
    }

    /// Fails, naming the component and its log, if any process has exited.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        for (component, process) in &mut self.processes {
            if process.child.is_some() {
                if let Some(status) = process.exited() {
                    bail!(
                        "{component} exited with {status}; its log ends:\n{}",
                        process.log_tail(30)
                    );
                }
            }
        }
        Ok(())
    }

    // --- start-up ---

    fn launch(
        &mut self,
        component: Component,
        program: PathBuf,
        args: Vec<String>,
        env: Vec<(String, String)>,
    ) -> anyhow::Result<()> {
        let mut process = Process {
            program,
            args,
            env,
            log: self.log_path(component),
            child: None,
        };
        process.spawn()?;
        self.processes.insert(component, process);
        Ok(())
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }

    fn write_files(&self) -> anyhow::Result<()> {
        let dir = self.dir.path();
        let key = dir.join("pki/sa.key");
        run(Command::new("openssl")
            .args(["genrsa", "-out"])
            .arg(&key)
            .arg("2048"))?;
        run(Command::new("openssl")
            .args(["rsa", "-pubout", "-in"])
            .arg(&key)
            .arg("-out")
            .arg(dir.join("pki/sa.pub")))?;
        // Static tokens: each identity the tests act as. Users named like service
        // accounts are what the admission policy and RBAC see for real ones. Random:
        // the API server and kubelet listen beyond loopback, and a guessable admin
        // token would open the machine to its network.
        let identities: Vec<_> = identities()
            .into_iter()
            .map(|(name, user, groups)| Ok((name, user, groups, random_token()?)))
            .collect::<anyhow::Result<_>>()?;
        let tokens: String = identities
            .iter()
            .map(|(name, user, groups, token)| format!("{token},{user},{name}-uid,\"{groups}\"\n"))
            .collect();
        std::fs::write(dir.join("tokens.csv"), tokens)?;
        kubelet_client_certificate(&dir.join("pki"))?;
        for (name, _, _, token) in &identities {
            std::fs::write(
                self.kubeconfig_for(name),
                kubeconfig(&dir.join("pki/apiserver.crt"), token),
            )?;
        }
        std::fs::write(
            dir.join("cni/conf/10-tessera.conflist"),
            json!({"cniVersion": "1.0.0", "name": "tessera", "plugins": [
                {"type": "bridge", "bridge": "tessera0", "isGateway": true, "ipMasq": false,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.88.0.0/16"}]],
                          "routes": [{"dst": "0.0.0.0/0"}]}},
                {"type": "loopback"}]})
            .to_string(),
        )?;
        std::fs::write(dir.join("containerd.toml"), containerd_config(dir))?;
        std::fs::write(dir.join("kubelet.yaml"), kubelet_config(dir, &node_ip()?))?;
        std::fs::write(
            dir.join("kube-scheduler.yaml"),
            scheduler_config(
                &self.kubeconfig_for("kube-scheduler"),
                &format!("http://127.0.0.1:{EXTENDER_PORT}"),
            )?,
        )?;
        Ok(())
    }

    async fn start_control_plane(&mut self, options: &ClusterOptions) -> anyhow::Result<()> {
        for port in [
            ETCD_CLIENT,
            ETCD_PEER,
            APISERVER_PORT,
            KUBELET_PORT,
            EXTENDER_PORT,
        ] {
            wait_port_free(port).await?;
        }
        let etcd = self.k8s.path("etcd");
        self.launch(
            Component::Etcd,
            etcd,
            vec![
                self.path("etcd"),
                format!("http://127.0.0.1:{ETCD_CLIENT}"),
                format!("http://127.0.0.1:{ETCD_PEER}"),
            ],
            vec![],
        )?;
        self.wait_ready(Component::Etcd).await?;
        let args = vec![
            format!("--etcd-servers=http://127.0.0.1:{ETCD_CLIENT}"),
            format!("--cert-dir={}", self.path("pki")),
            format!("--secure-port={APISERVER_PORT}"),
            // All addresses: pods on the pod network reach it through the
            // `kubernetes` Service's address (see `ApiServiceRoute`).
            "--bind-address=0.0.0.0".into(),
            "--advertise-address=127.0.0.1".into(),
            format!("--token-auth-file={}", self.path("tokens.csv")),
            "--authorization-mode=Node,RBAC".into(),
            "--service-account-issuer=https://kubernetes.default.svc".into(),
            format!("--service-account-key-file={}", self.path("pki/sa.pub")),
            format!(
                "--service-account-signing-key-file={}",
                self.path("pki/sa.key")
            ),
            "--service-cluster-ip-range=10.96.0.0/16".into(),
            "--allow-privileged=true".into(),
            // `kubectl logs` and `exec` go through the API server to kubelet: by
            // the node's address (its name, tessera-node, resolves nowhere), with a
            // client certificate kubelet trusts.
            "--kubelet-preferred-address-types=InternalIP".into(),
            format!(
                "--kubelet-client-certificate={}",
                self.path("pki/kubelet-client.crt")
            ),
            format!(
                "--kubelet-client-key={}",
                self.path("pki/kubelet-client.key")
            ),
        ];
        let apiserver = self.k8s.path("kube-apiserver");
        self.launch(Component::ApiServer, apiserver, args, vec![])?;
        self.wait_ready(Component::ApiServer).await?;
        self.api_route = Some(ApiServiceRoute::install()?);

        let kcm = self.k8s.path("kube-controller-manager");
        let args = vec![
            format!("--kubeconfig={}", self.kubeconfig().display()),
            "--use-service-account-credentials=false".into(),
            format!("--root-ca-file={}", self.path("pki/apiserver.crt")),
            format!(
                "--service-account-private-key-file={}",
                self.path("pki/sa.key")
            ),
            "--leader-elect=false".into(),
            "--secure-port=0".into(),
            "--controllers=*,-cloud-node-lifecycle".into(),
        ];
        self.launch(Component::ControllerManager, kcm, args, vec![])?;

        // Tessera's manifests, as an operator applies them (RBAC and policy only: the
        // scheduler and reporter run here as processes, not from images).
        let client = self.client().await?;
        if options.cluster_side {
            apply_manifests(&client, "crd-device.yaml").await?;
            apply_manifests(&client, "crd-sharepod.yaml").await?;
            apply_manifests(&client, "reporter.yaml").await?;
            apply_manifests(&client, "scheduler.yaml").await?;
            apply_manifests(&client, "admission-policy.yaml").await?;
            if options.dra {
                apply_dra_manifests(&client, Path::new(&self.path("chart-dra"))).await?;
            }
        }
        apply_test_rbac(&client).await?;

        if !options.cluster_side {
            // No extender yet: kube-scheduler places pods that ask for no GPU (the
            // install's own) and waits for `set_extender` for the others.
            self.launch_kube_scheduler()?;
            return Ok(());
        }
        let extender = tessera_binary("tessera-scheduler")?;
        let args = vec![
            "serve".into(),
            format!("--listen=127.0.0.1:{EXTENDER_PORT}"),
            format!("--kubeconfig={}", self.kubeconfig_for("extender").display()),
            format!("--advertise-url=http://127.0.0.1:{EXTENDER_PORT}"),
            "--identity=tessera-scheduler-0".into(),
            format!("--metrics-listen=127.0.0.1:{SCHEDULER_METRICS_PORT}"),
            // Below the node's 4 GPUs, so that the allowance, not a full node, is
            // what holds a namespace's third sharing group back.
            "--max-group-gpus-per-namespace=2".into(),
        ];
        self.launch(
            Component::Extender,
            extender,
            args,
            vec![("RUST_LOG".into(), "info".into())],
        )?;
        self.launch_kube_scheduler()?;
        self.wait_ready(Component::Extender).await?;
        Ok(())
    }

    fn launch_kube_scheduler(&mut self) -> anyhow::Result<()> {
        let scheduler = self.k8s.path("kube-scheduler");
        let args = vec![
            format!("--config={}", self.path("kube-scheduler.yaml")),
            "--secure-port=0".into(),
        ];
        self.launch(Component::Scheduler, scheduler, args, vec![])
    }

    /// Points kube-scheduler's extender at `url` (deploy/'s extender settings
    /// otherwise) and restarts it: for an extender installed as pods. An `https`
    /// URL takes `tls`, kube-scheduler's client certificate and what to trust.
    pub async fn set_extender(
        &mut self,
        url: &str,
        tls: Option<&ExtenderTls>,
    ) -> anyhow::Result<()> {
        let mut config: Value = serde_yaml::from_str(&scheduler_config(
            &self.kubeconfig_for("kube-scheduler"),
            url,
        )?)?;
        if let Some(tls) = tls {
            for extender in config["extenders"].as_array_mut().into_iter().flatten() {
                extender["enableHTTPS"] = json!(true);
                extender["tlsConfig"] = json!({
                    "certFile": tls.cert.display().to_string(),
                    "keyFile": tls.key.display().to_string(),
                    "caFile": tls.ca.display().to_string(),
                    "serverName": tls.server_name,
                });
            }
        }
        std::fs::write(
            self.dir.path().join("kube-scheduler.yaml"),
            serde_yaml::to_string(&config)?,
        )?;
        self.restart(Component::Scheduler).await
    }

    /// Sets kube-scheduler's API client to `qps` queries per second with bursts of
    /// `burst` (its configuration's `clientConnection`; deploy/ sets neither, so
    /// kube-scheduler's own 50 and 100 apply) and restarts it.
    pub async fn set_scheduler_client_qps(&mut self, qps: u32, burst: u32) -> anyhow::Result<()> {
        let path = self.dir.path().join("kube-scheduler.yaml");
        let mut config: Value = serde_yaml::from_str(&std::fs::read_to_string(&path)?)?;
        config["clientConnection"]["qps"] = json!(qps);
        config["clientConnection"]["burst"] = json!(burst);
        std::fs::write(&path, serde_yaml::to_string(&config)?)?;
        self.restart(Component::Scheduler).await
    }

    async fn start_node(&mut self, options: &ClusterOptions) -> anyhow::Result<()> {
        let dir = self.dir.path().to_path_buf();
        let ctd_path = format!(
            "{}:{}",
            self.k8s.dir.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let containerd = self.k8s.path("containerd");
        self.launch(
            Component::Containerd,
            containerd,
            vec!["--config".into(), self.path("containerd.toml")],
            vec![("PATH".into(), ctd_path)],
        )?;
        self.wait_ready(Component::Containerd).await?;
        let nvml_dir = dir.join("nvml");
        let nvlinks = options.nvlinks.clone().unwrap_or_else(|| {
            fake_nvml::pair_nvlinks(u32::try_from(self.gpu_node.gpus.len()).unwrap_or(0))
        });
        let library = fake_nvml::install(&nvml_dir, &self.nvml_description(&nvlinks))?;
        let images = dir.join("images");
        std::fs::create_dir_all(&images)?;
        for archive in [
            image::pause_archive(&images)?,
            image::probe_archive(&images)?,
            image::cuda_probe_archive(&images)?,
            image::device_plugin_archive(
                &self.k8s.path("nvidia-device-plugin"),
                &library,
                &images,
            )?,
        ] {
            self.import_image(&archive)?;
        }

        let mut args = vec![
            format!("--listen={}", self.proxy_socket().display()),
            format!("--runtime-endpoint={}", self.containerd_socket().display()),
            format!("--hooks-dir={}", self.path("hooks.d")),
            format!("--metrics-addr=127.0.0.1:{PROXY_METRICS_PORT}"),
            format!("--device-root={}", self.gpu_node.device_root.display()),
            format!("--driver-gpus={}", self.gpu_node.driver_gpus.display()),
            format!("--nvml-library={}", library.display()),
            format!("--kubelet-checkpoint={KUBELET_CHECKPOINT}"),
            format!("--dra-claims={}", self.dra_claims_file().display()),
        ];
        if options.enforcement {
            let hami = image::vgpu_stand_in(&dir.join("hami"))?;
            self.import_image(&image::preload_probe_archive(&images)?)?;
            args.extend([
                "--gpu-memory-limits=on".to_owned(),
                format!(
                    "--enforce-binary={}",
                    tessera_binary("tessera-enforce")?.display()
                ),
                format!("--hami-core-library={}", hami.display()),
                format!("--enforcement-dir={}", dir.join("enforce").display()),
                "--gpu-time=on".to_owned(),
            ]);
        } else {
            // Not on the host's own /run/tessera, which it would be by default: the
            // node's backends file and GPU memory report go to the cluster's folder.
            // No backend at all: the OOM kill off too.
            args.push("--gpu-time=off".to_owned());
            args.push("--oom-kill=off".to_owned());
            args.push(format!(
                "--enforcement-dir={}",
                dir.join("enforce").display()
            ));
        }
        if options.enforcement && options.mps {
            let control = tessera_binary("fake-mps-control")?;
            self.launch(
                Component::MpsDaemon,
                tessera_binary("tessera-enforce")?,
                vec![
                    "mps-daemon".into(),
                    format!("--control={}", control.display()),
                    format!("--pipe-dir={}", self.mps_pipe_dir().display()),
                    format!("--log-dir={}", dir.join("mps").join("log").display()),
                    format!("--state-dir={}", dir.join("enforce").join("mps").display()),
                    format!("--nvml-library={}", library.display()),
                ],
                vec![
                    ("RUST_LOG".into(), "info".into()),
                    ("FAKE_MPS_LOG".into(), self.mps_log().display().to_string()),
                ],
            )?;
            self.wait_ready(Component::MpsDaemon).await?;
            args.extend([
                "--mps=on".to_owned(),
                format!("--mps-control={}", control.display()),
                format!("--mps-pipe-dir={}", self.mps_pipe_dir().display()),
            ]);
        }
        args.extend(options.proxy_args.iter().cloned());
        self.launch(
            Component::RuntimeProxy,
            tessera_binary("tessera-runtime-proxy")?,
            args,
            vec![("RUST_LOG".into(), "info".into())],
        )?;
        self.wait_ready(Component::RuntimeProxy).await?;

        let args = vec![
            format!("--config={}", self.path("kubelet.yaml")),
            format!("--kubeconfig={}", self.kubeconfig_for("node").display()),
            format!("--root-dir={}", self.path("kubelet")),
            format!("--hostname-override={NODE_NAME}"),
            // The address it serves on (kubelet.yaml), which the API server dials.
            format!("--node-ip={}", node_ip()?),
        ];
        self.launch(Component::Kubelet, self.k8s.path("kubelet"), args, vec![])?;
        self.wait_ready(Component::Kubelet).await?;

        if options.device_plugin {
            let (args, env) = self.device_plugin_command();
            self.launch(
                Component::DevicePlugin,
                self.k8s.path("nvidia-device-plugin"),
                args,
                env,
            )?;
            self.wait_ready(Component::DevicePlugin).await?;
        }

        if !options.cluster_side {
            return Ok(());
        }
        // As in its DaemonSet, the reporter's token is its service account's, bound to
        // its node (admission policy tessera-node-agents-own-node reads the node from it).
        let token = self
            .node_bound_token(REPORTER_NAMESPACE, REPORTER_ACCOUNT, NODE_NAME)
            .await?;
        std::fs::write(
            self.kubeconfig_for("reporter-bound"),
            kubeconfig(Path::new(&self.path("pki/apiserver.crt")), &token),
        )?;
        let args = vec![
            "run".into(),
            format!("--node-name={NODE_NAME}"),
            format!(
                "--kubeconfig={}",
                self.kubeconfig_for("reporter-bound").display()
            ),
            format!("--nvml-library={}", library.display()),
            format!("--checkpoint={KUBELET_CHECKPOINT}"),
            "--interval=2".into(),
            format!("--metrics-addr=127.0.0.1:{REPORTER_METRICS_PORT}"),
            // Where this cluster's proxy lists the node's enforcement backends.
            format!(
                "--enforcement-file={}",
                dir.join("enforce").join("backends").display()
            ),
        ];
        let args = if self.dra {
            let kubelet = self.dir.path().join("kubelet");
            [
                args,
                vec![
                    "--dra".into(),
                    // The kubelet plugin, where this cluster's kubelet looks.
                    format!(
                        "--kubelet-plugins-dir={}",
                        kubelet.join("plugins").display()
                    ),
                    format!(
                        "--kubelet-registry-dir={}",
                        kubelet.join("plugins_registry").display()
                    ),
                ],
            ]
            .concat()
        } else {
            args
        };
        self.launch(
            Component::Reporter,
            tessera_binary("tessera-reporter")?,
            args,
            vec![("RUST_LOG".into(), "info".into())],
        )?;
        self.wait_ready(Component::Reporter).await?;
        Ok(())
    }

    /// A token of service account `namespace/account` bound to Node `node` (it
    /// must exist; waited for up to 30 s), valid a day: it carries the node's name,
    /// as a node agent pod's projected token does.
    pub async fn node_bound_token(
        &self,
        namespace: &str,
        account: &str,
        node: &str,
    ) -> anyhow::Result<String> {
        use k8s_openapi::api::authentication::v1::{
            BoundObjectReference, TokenRequest, TokenRequestSpec,
        };
        use k8s_openapi::api::core::v1::ServiceAccount;
        let client = self.client().await?;
        let nodes: Api<Node> = Api::all(client.clone());
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let uid = loop {
            if let Some(found) = nodes.get_opt(node).await? {
                break found.metadata.uid;
            }
            anyhow::ensure!(
                std::time::Instant::now() < deadline,
                "node {node} not registered within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let request = TokenRequest {
            spec: Some(TokenRequestSpec {
                audiences: None,
                bound_object_ref: Some(BoundObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Node".into()),
                    name: Some(node.into()),
                    uid,
                }),
                expiration_seconds: Some(86_400),
                ..TokenRequestSpec::default()
            }),
            ..TokenRequest::default()
        };
        let accounts: Api<ServiceAccount> = Api::namespaced(client, namespace);
        let granted = accounts
            .create_token_request(account, &Default::default(), &request)
            .await
            .with_context(|| {
                format!("TokenRequest for {namespace}/{account} bound to node {node}")
            })?;
        granted
            .status
            .and_then(|s| s.token)
            .context("TokenRequest answered without a token")
    }

    /// NVIDIA's device plugin's flags and env on this node's fake GPUs: the same
    /// whether it runs as a process or as a pod.
    fn device_plugin_command(&self) -> (Vec<String>, Vec<(String, String)>) {
        let root = self.gpu_node.root().display().to_string();
        let nvml_dir = self.dir.path().join("nvml");
        let args = vec![
            "--device-discovery-strategy=nvml".into(),
            format!("--driver-root={root}"),
            format!("--dev-root={root}"),
            "--fail-on-init-error=true".into(),
        ];
        let env = vec![
            ("LD_LIBRARY_PATH".into(), nvml_dir.display().to_string()),
            (
                "TESSERA_FAKE_NVML_CONFIG".into(),
                nvml_dir.join("fake-nvml.json").display().to_string(),
            ),
        ];
        (args, env)
    }

    /// A pod running NVIDIA's device plugin from its image, as NVIDIA's DaemonSet
    /// does: the kubelet's device-plugin directory and the driver root from the
    /// host, and no GPU request. The fake NVML library comes from the host as the
    /// NVIDIA container toolkit would inject the driver's.
    pub fn device_plugin_pod(&self, namespace: &str, name: &str) -> Value {
        let (args, env) = self.device_plugin_command();
        let env: Vec<Value> = env
            .into_iter()
            .map(|(name, value)| json!({"name": name, "value": value}))
            .collect();
        let host = |name: &str, path: &Path, read_only: bool| {
            let path = path.display().to_string();
            (
                json!({"name": name, "hostPath": {"path": path}}),
                json!({"name": name, "mountPath": path, "readOnly": read_only}),
            )
        };
        let (volumes, mounts): (Vec<Value>, Vec<Value>) = [
            host(
                "device-plugins",
                Path::new("/var/lib/kubelet/device-plugins"),
                false,
            ),
            host("driver-root", self.gpu_node.root(), true),
            host("nvml", &self.dir.path().join("nvml"), true),
        ]
        .into_iter()
        .unzip();
        json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "nodeName": NODE_NAME,
                "containers": [{
                    "name": "nvidia-device-plugin-ctr",
                    "image": image::DEVICE_PLUGIN_IMAGE,
                    "imagePullPolicy": "Never",
                    "args": args,
                    "env": env,
                    "securityContext": {
                        "allowPrivilegeEscalation": false,
                        "capabilities": {"drop": ["ALL"]},
                    },
                    "volumeMounts": mounts,
                }],
                "volumes": volumes,
            },
        })
    }

    /// What a pod's container wrote, every restart's log in order, from the
    /// files kubelet keeps under /var/log/pods.
    pub fn container_log(&self, pod: &Pod, container: &str) -> anyhow::Result<String> {
        let dir = Path::new("/var/log/pods")
            .join(format!(
                "{}_{}_{}",
                pod.metadata.namespace.as_deref().unwrap_or("default"),
                pod.metadata.name.as_deref().unwrap_or_default(),
                pod.metadata.uid.as_deref().unwrap_or_default()
            ))
            .join(container);
        let mut files: Vec<(u64, PathBuf)> = std::fs::read_dir(&dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .filter_map(|entry| {
                let path = entry.ok()?.path();
                let restart = path.file_stem()?.to_str()?.parse().ok()?;
                Some((restart, path))
            })
            .collect();
        files.sort();
        let mut text = String::new();
        for (_, path) in files {
            text.push_str(&std::fs::read_to_string(&path).unwrap_or_default());
        }
        Ok(text)
    }

    /// kubelet's `--config` file.
    pub fn kubelet_config_path(&self) -> PathBuf {
        self.dir.path().join("kubelet.yaml")
    }

    /// The proxy's metrics address.
    pub fn proxy_metrics_addr(&self) -> String {
        format!("127.0.0.1:{PROXY_METRICS_PORT}")
    }

    /// The proxy's metrics, as its endpoint serves them (`GET /metrics`).
    pub async fn proxy_metrics(&self) -> anyhow::Result<String> {
        let (_, body) = crate::monitoring::scrape(&self.proxy_metrics_addr()).await?;
        Ok(body)
    }

    /// tessera-reporter's metrics address.
    pub fn reporter_metrics_addr(&self) -> String {
        format!("127.0.0.1:{REPORTER_METRICS_PORT}")
    }

    /// tessera-scheduler's metrics address.
    pub fn scheduler_metrics_addr(&self) -> String {
        format!("127.0.0.1:{SCHEDULER_METRICS_PORT}")
    }

    /// Points kubelet's runtime and image endpoints at `socket` in its `--config`
    /// file, as a node looks before (or after) Tessera, and restarts it.
    pub async fn set_kubelet_endpoint(&mut self, socket: &Path) -> anyhow::Result<()> {
        let path = self.kubelet_config_path();
        let mut config: serde_yaml::Value = serde_yaml::from_str(&std::fs::read_to_string(&path)?)?;
        for key in ["containerRuntimeEndpoint", "imageServiceEndpoint"] {
            config[key] = format!("unix://{}", socket.display()).into();
        }
        std::fs::write(&path, serde_yaml::to_string(&config)?)?;
        self.restart(Component::Kubelet).await
    }

    /// Imports an OCI image archive into the node's containerd, where kubelet finds it.
    pub fn import_image(&self, archive: &Path) -> anyhow::Result<()> {
        run(Command::new(self.k8s.path("ctr"))
            .arg("-a")
            .arg(self.containerd_socket())
            .args(["-n", "k8s.io", "images", "import"])
            .arg(archive))
    }

    /// deploy/reporter.yaml's DaemonSet as an operator would apply it, with
    /// `image` (already imported: never pulled) and the host's driver directory
    /// where this node's (fake) `libnvidia-ml.so.1` is; nothing else changed.
    pub fn reporter_daemonset(&self, image: &str) -> anyhow::Result<Value> {
        let mut daemonset = deploy::documents("reporter.yaml")
            .into_iter()
            .find(|doc| doc["kind"] == "DaemonSet")
            .context("deploy/reporter.yaml has no DaemonSet")?;
        let spec = &mut daemonset["spec"]["template"]["spec"];
        let container = spec["containers"]
            .as_array_mut()
            .and_then(|c| c.first_mut())
            .context("deploy/reporter.yaml's DaemonSet has no container")?;
        container["image"] = json!(image);
        container["imagePullPolicy"] = json!("Never");
        // The volume holding the library `--nvml-library` names, whatever it is called.
        let library = container["args"]
            .as_array()
            .into_iter()
            .flatten()
            .find_map(|a| a.as_str()?.strip_prefix("--nvml-library="))
            .context("deploy/reporter.yaml's reporter has no --nvml-library")?
            .to_owned();
        let volume = container["volumeMounts"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|m| {
                m["mountPath"]
                    .as_str()
                    .is_some_and(|p| library.starts_with(&format!("{}/", p.trim_end_matches('/'))))
            })
            .and_then(|m| m["name"].as_str())
            .with_context(|| {
                format!("no volume of deploy/reporter.yaml's reporter holds {library}")
            })?
            .to_owned();
        let driver = spec["volumes"]
            .as_array_mut()
            .and_then(|v| v.iter_mut().find(|v| v["name"] == volume.as_str()))
            .with_context(|| format!("deploy/reporter.yaml's DaemonSet has no volume {volume}"))?;
        driver["hostPath"]["path"] = json!(self.dir.path().join("nvml").display().to_string());
        // And this cluster's proxy writes its node files (backends, kubelet's
        // connections) to the cluster's folder, not the host's /run/tessera.
        let enforcement = spec["volumes"]
            .as_array_mut()
            .and_then(|v| v.iter_mut().find(|v| v["name"] == "enforcement"))
            .context("deploy/reporter.yaml's DaemonSet has no volume enforcement")?;
        enforcement["hostPath"]["path"] =
            json!(self.dir.path().join("enforce").display().to_string());
        Ok(daemonset)
    }

    /// Server-side applies `doc` as the admin.
    pub async fn apply(&self, doc: &Value) -> anyhow::Result<()> {
        let client = self.client().await?;
        let discovery = discover(&client).await?;
        apply(&client, &discovery, doc).await
    }

    /// The host PID of a running container's init process (`ctr tasks ls`).
    pub fn container_pid(&self, container_id: &str) -> anyhow::Result<u32> {
        let id = container_id.trim_start_matches("containerd://");
        let output = std::process::Command::new(self.k8s.path("ctr"))
            .arg("-a")
            .arg(self.containerd_socket())
            .args(["-n", "k8s.io", "tasks", "ls"])
            .output()?;
        let text = String::from_utf8_lossy(&output.stdout);
        text.lines()
            .find_map(|line| {
                let mut fields = line.split_whitespace();
                (fields.next() == Some(id)).then(|| fields.next()?.parse().ok())?
            })
            .with_context(|| format!("no task {id} in ctr tasks ls:\n{text}"))
    }

    /// Kills a container's task as an OOM kill or crash would; kubelet restarts it.
    pub fn kill_container(&self, container_id: &str) -> anyhow::Result<()> {
        let id = container_id.trim_start_matches("containerd://");
        run(Command::new(self.k8s.path("ctr"))
            .arg("-a")
            .arg(self.containerd_socket())
            .args(["-n", "k8s.io", "tasks", "kill", "--signal", "SIGKILL", id]))
    }

    /// Waits until `component` does its job (60 s), failing early if it exits.
    pub async fn wait_ready(&mut self, component: Component) -> anyhow::Result<()> {
        let started = Instant::now();
        loop {
            if let Some(process) = self.processes.get_mut(&component) {
                if let Some(status) = process.exited() {
                    bail!(
                        "{component} exited with {status} while starting; its log ends:\n{}",
                        process.log_tail(30)
                    );
                }
            }
            let probe = self.probe(component).await;
            let Err(last) = probe else {
                tracing::info!(%component, elapsed = ?started.elapsed(), "ready");
                return Ok(());
            };
            if started.elapsed() > Duration::from_secs(60) {
                bail!(
                    "{component} not ready after 60 s ({last:#}); its log ends:\n{}",
                    self.log_tail(component, 30)
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn probe(&self, component: Component) -> anyhow::Result<()> {
        match component {
            Component::Etcd => connect(ETCD_CLIENT),
            Component::ApiServer => {
                let client = self.client().await?;
                let request = http::Request::get("/readyz").body(Vec::new())?;
                let text = client.request_text(request).await?;
                if text.trim() == "ok" {
                    Ok(())
                } else {
                    bail!("readyz: {text}")
                }
            }
            // No port of their own (--secure-port=0): alive is all we can see.
            Component::ControllerManager | Component::Scheduler => Ok(()),
            Component::Extender => connect(EXTENDER_PORT),
            Component::ExtenderReplica => connect(EXTENDER_REPLICA_PORT),
            Component::Containerd => run(Command::new(self.k8s.path("ctr"))
                .arg("-a")
                .arg(self.containerd_socket())
                .arg("version")),
            Component::RuntimeProxy => {
                std::os::unix::net::UnixStream::connect(self.proxy_socket())?;
                Ok(())
            }
            Component::Kubelet => {
                let nodes: Api<Node> = Api::all(self.client().await?);
                let node = nodes.get(NODE_NAME).await?;
                let ready = node
                    .status
                    .and_then(|s| s.conditions)
                    .unwrap_or_default()
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True");
                if ready {
                    Ok(())
                } else {
                    bail!("node {NODE_NAME} not Ready")
                }
            }
            Component::DevicePlugin => {
                let want = self.gpu_node.gpus.len().to_string();
                let nodes: Api<Node> = Api::all(self.client().await?);
                let node = nodes.get(NODE_NAME).await?;
                let have = node
                    .status
                    .and_then(|s| s.allocatable)
                    .and_then(|a| a.get("nvidia.com/gpu").map(|q| q.0.clone()));
                if have.as_deref() == Some(want.as_str()) {
                    Ok(())
                } else {
                    bail!("node allocatable nvidia.com/gpu is {have:?}, want {want}")
                }
            }
            Component::MpsDaemon => run(Command::new(tessera_binary("fake-mps-control")?)
                .args(["-p", "3", "server", "list"])
                .env("CUDA_MPS_PIPE_DIRECTORY", self.mps_pipe_dir())),
            Component::Reporter => {
                let client = self.client().await?;
                let devices = device_api(&client);
                let device = devices.get(NODE_NAME).await?;
                let count = device.data["spec"]["devices"]
                    .as_array()
                    .map_or(0, Vec::len);
                // In DRA mode the GPUs are in the node's ResourceSlice, and in the
                // Device CR none.
                let (want, slice) = if self.dra {
                    let slices: Api<k8s_openapi::api::resource::v1::ResourceSlice> =
                        Api::all(client);
                    let name = format!("{NODE_NAME}-{DRA_DRIVER}");
                    let listed = slices
                        .get_opt(&name)
                        .await?
                        .and_then(|s| s.spec.devices)
                        .map_or(0, |d| d.len());
                    if listed > self.gpu_node.gpus.len() {
                        bail!(
                            "the ResourceSlice of {NODE_NAME} lists {listed} GPUs, the node has {}",
                            self.gpu_node.gpus.len()
                        );
                    }
                    (0, Some(listed))
                } else {
                    (self.gpu_node.gpus.len(), None)
                };
                // The slice may leave out GPUs device-plugin pods hold (a restart
                // with such pods running): some GPU offered is enough.
                match slice {
                    _ if count != want => bail!("Device {NODE_NAME} lists {count} GPUs"),
                    Some(0) => bail!("the ResourceSlice of {NODE_NAME} offers no GPU"),
                    _ => Ok(()),
                }
            }
        }
    }

    // --- pods ---

    /// Creates a pod as `identity` and returns it as created.
    pub async fn create_pod(&self, identity: &str, pod: &Value) -> anyhow::Result<Pod> {
        self.create_pod_in(identity, "default", pod).await
    }

    /// Creates a pod in `namespace` as `identity` and returns it as created.
    pub async fn create_pod_in(
        &self,
        identity: &str,
        namespace: &str,
        pod: &Value,
    ) -> anyhow::Result<Pod> {
        let pods: Api<Pod> = Api::namespaced(self.client_as(identity).await?, namespace);
        let mut pod: Pod = serde_json::from_value(pod.clone())?;
        pod.metadata.namespace = Some(namespace.to_owned());
        Ok(pods.create(&Default::default(), &pod).await?)
    }

    /// Creates namespace `name` as admin; one that exists already is fine.
    pub async fn create_namespace(&self, name: &str) -> anyhow::Result<()> {
        let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(self.client().await?);
        let namespace = serde_json::from_value(
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}),
        )?;
        match namespaces.create(&Default::default(), &namespace).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
            Err(e) => Err(anyhow::Error::new(e).context(format!("creating namespace {name}"))),
        }
    }

    /// Sets label `key=value` on namespace `name`, as an admin.
    pub async fn label_namespace(&self, name: &str, key: &str, value: &str) -> anyhow::Result<()> {
        let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(self.client().await?);
        namespaces
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {key: value}}})),
            )
            .await
            .with_context(|| format!("labelling namespace {name} {key}={value}"))?;
        Ok(())
    }

    /// Waits until `pred` holds for pod `default/name` (`timeout`), returning it.
    pub async fn wait_pod(
        &mut self,
        name: &str,
        timeout: Duration,
        what: &str,
        pred: impl Fn(&Pod) -> bool,
    ) -> anyhow::Result<Pod> {
        self.wait_pod_in("default", name, timeout, what, pred).await
    }

    /// Waits until `pred` holds for pod `namespace/name` (`timeout`), returning it.
    pub async fn wait_pod_in(
        &mut self,
        namespace: &str,
        name: &str,
        timeout: Duration,
        what: &str,
        pred: impl Fn(&Pod) -> bool,
    ) -> anyhow::Result<Pod> {
        let pods: Api<Pod> = Api::namespaced(self.client().await?, namespace);
        let started = Instant::now();
        loop {
            self.check_alive()?;
            let pod = pods.get(name).await?;
            if pred(&pod) {
                return Ok(pod);
            }
            // A pod that has failed or succeeded stays so: waiting on it (an
            // evicted pod, say) only spends the timeout.
            let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
            let terminal = matches!(phase, Some("Failed" | "Succeeded"));
            if terminal || started.elapsed() > timeout {
                let status = serde_json::to_string(&pod.status).unwrap_or_default();
                let waited = started.elapsed().as_secs();
                bail!(
                    "pod {namespace}/{name}: not {what} after {waited}s; status {status}; events: {}",
                    self.events_in(namespace, name)
                        .await
                        .unwrap_or_default()
                        .join(" | ")
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Waits until pod `default/name` runs with every container started.
    pub async fn wait_running(&mut self, name: &str) -> anyhow::Result<Pod> {
        self.wait_pod(name, Duration::from_secs(90), "Running", is_running)
            .await
    }

    /// The messages of the events about pod `default/name`.
    pub async fn events_of(&self, name: &str) -> anyhow::Result<Vec<String>> {
        self.events_in("default", name).await
    }

    /// The messages of the events about pod `namespace/name`.
    pub async fn events_in(&self, namespace: &str, name: &str) -> anyhow::Result<Vec<String>> {
        let events: Api<k8s_openapi::api::core::v1::Event> =
            Api::namespaced(self.client().await?, namespace);
        let list = events
            .list(&kube::api::ListParams::default().fields(&format!("involvedObject.name={name}")))
            .await?;
        Ok(list
            .items
            .into_iter()
            .map(|e| {
                format!(
                    "{}: {}",
                    e.reason.unwrap_or_default(),
                    e.message.unwrap_or_default()
                )
            })
            .collect())
    }

    /// Waits (`timeout`) until the events about pod `namespace/name` hold one
    /// containing each of `wants`; returns them.
    pub async fn wait_events_in(
        &self,
        namespace: &str,
        name: &str,
        wants: &[&str],
        timeout: Duration,
    ) -> anyhow::Result<Vec<String>> {
        let started = Instant::now();
        loop {
            let events = self.events_in(namespace, name).await?;
            if wants
                .iter()
                .all(|want| events.iter().any(|e| e.contains(want)))
            {
                return Ok(events);
            }
            if started.elapsed() > timeout {
                bail!(
                    "pod {namespace}/{name}: no events saying {wants:?} after {timeout:?}: {events:?}"
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Creating `spec` in `namespace` as `identity` is refused with a message
    /// containing each of `wants`; a pod created anyway is deleted and fails.
    pub async fn expect_refused(
        &mut self,
        identity: &str,
        namespace: &str,
        spec: &Value,
        wants: &[&str],
    ) -> anyhow::Result<()> {
        let name = spec["metadata"]["name"].as_str().unwrap_or_default();
        match self.create_pod_in(identity, namespace, spec).await {
            Ok(_) => {
                self.delete_pod_in(namespace, name).await?;
                bail!("pod {namespace}/{name} was created; want a refusal saying {wants:?}");
            }
            Err(error) => {
                let text = format!("{error:#}");
                ensure!(
                    wants.iter().all(|want| text.contains(want)),
                    "pod {namespace}/{name}: refused with {text:?}, want {wants:?}"
                );
                Ok(())
            }
        }
    }

    /// The OCI specs of a running pod's containers, by container name.
    pub fn container_specs(&self, pod: &Pod) -> anyhow::Result<BTreeMap<String, Value>> {
        let statuses = pod
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.clone())
            .unwrap_or_default();
        statuses
            .iter()
            .map(|status| {
                let id = status
                    .container_id
                    .as_deref()
                    .with_context(|| format!("container {} has no ID yet", status.name))?;
                Ok((status.name.clone(), self.oci_spec(id)?))
            })
            .collect()
    }

    /// Binds pod `default/name` to the node as another scheduler would (no
    /// Tessera annotation): how pods placed before Tessera, or by a second
    /// scheduler, reach the node.
    pub async fn bind_as_other_scheduler(&self, name: &str) -> anyhow::Result<()> {
        let pods: Api<Pod> = Api::namespaced(self.client_as("other-scheduler").await?, "default");
        let binding = json!({"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
                             "target": {"apiVersion": "v1", "kind": "Node", "name": NODE_NAME}});
        pods.create_subresource::<Value, Value>("binding", name, &Default::default(), &binding)
            .await
            .with_context(|| format!("binding pod default/{name}"))?;
        Ok(())
    }

    /// Deletes pod `default/name` now and waits until it is gone.
    pub async fn delete_pod(&mut self, name: &str) -> anyhow::Result<()> {
        self.delete_pod_in("default", name).await
    }

    /// Deletes pod `namespace/name` now and waits until it is gone.
    pub async fn delete_pod_in(&mut self, namespace: &str, name: &str) -> anyhow::Result<()> {
        let pods: Api<Pod> = Api::namespaced(self.client().await?, namespace);
        let params = kube::api::DeleteParams {
            grace_period_seconds: Some(0),
            ..Default::default()
        };
        // Gone is this pod gone: a controller (a SharePod's) may make another of the
        // same name at once, which is not the one deleted.
        let Some(uid) = pods.get_opt(name).await?.and_then(|p| p.metadata.uid) else {
            return Ok(());
        };
        match pods.delete(name, &params).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        let started = Instant::now();
        while pods
            .get_opt(name)
            .await?
            .is_some_and(|p| p.metadata.uid.as_deref() == Some(uid.as_str()))
        {
            if started.elapsed() > Duration::from_secs(60) {
                bail!("pod {namespace}/{name} still there 60 s after its deletion");
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        Ok(())
    }

    // --- teardown ---

    fn teardown(&mut self) {
        // Node first (kubelet would restart what we kill), the control plane last.
        let order = [
            Component::Reporter,
            Component::DevicePlugin,
            Component::Kubelet,
            Component::RuntimeProxy,
            Component::Scheduler,
            Component::Extender,
            Component::ExtenderReplica,
            Component::ControllerManager,
            Component::ApiServer,
            Component::Etcd,
        ];
        for component in order {
            if let Some(process) = self.processes.get_mut(&component) {
                let _ = process.stop(Duration::from_secs(5));
            }
        }
        let dir = self.dir.path().display().to_string();
        // containerd last among the node's parts: its shims and containers are found
        // through it (command lines naming its socket, roots under its directory).
        if let Some(process) = self.processes.get_mut(&Component::Containerd) {
            let _ = process.stop(Duration::from_secs(5));
        }
        crate::containerd::kill_processes_mentioning(&dir);
        crate::containerd::unmount_under(&dir);
        remove_pod_cgroups();
        let _ = Command::new("ip")
            .args(["link", "delete", "tessera0"])
            .stderr(Stdio::null())
            .status();
        let _ = clear_dir(Path::new(DEVICE_PLUGIN_DIR));
        if let Some(route) = self.api_route.take() {
            route.remove();
        }
    }
}

/// The one Service this cluster routes, as kube-proxy would: the `kubernetes`
/// Service's address (the first of `--service-cluster-ip-range`), port 443, to the
/// API server, so pods use in-cluster config as on any cluster. NAT rules in the
/// host's `nat` table, for the host's own connections (host-network pods) and for
/// those arriving from the pod bridge; removed at teardown.
#[derive(Debug)]
struct ApiServiceRoute;

impl ApiServiceRoute {
    /// The `kubernetes` Service's ClusterIP.
    const ADDRESS: &str = "10.96.0.1";

    fn rule(chain: &str) -> Vec<String> {
        [
            chain,
            "-d",
            Self::ADDRESS,
            "-p",
            "tcp",
            "--dport",
            "443",
            "-m",
            "comment",
            "--comment",
            "tessera-harness",
            "-j",
            "REDIRECT",
            "--to-ports",
            &APISERVER_PORT.to_string(),
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect()
    }

    fn install() -> anyhow::Result<Self> {
        // A crashed run's rules first, so they never pile up.
        Self.remove();
        for chain in ["OUTPUT", "PREROUTING"] {
            run(Command::new("iptables")
                .args(["-t", "nat", "-A"])
                .args(Self::rule(chain)))?;
        }
        Ok(Self)
    }

    fn remove(&self) {
        for chain in ["OUTPUT", "PREROUTING"] {
            while Command::new("iptables")
                .args(["-t", "nat", "-D"])
                .args(Self::rule(chain))
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
            {}
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.teardown();
    }
}

// === pods ===

/// The allocation annotation, written by tessera-scheduler.
pub const ALLOCATED: &str = "scheduling.koordinator.sh/device-allocated";

/// A pod of the probe image with one container per `(name, limits)`.
pub fn probe_pod(name: &str, containers: &[(&str, Value)], env: &[(&str, &str)]) -> Value {
    let env: Vec<Value> = env
        .iter()
        .map(|(k, v)| json!({"name": k, "value": v}))
        .collect();
    let containers: Vec<Value> = containers
        .iter()
        .map(|(container, limits)| {
            json!({"name": container, "image": "tessera.local/probe:1", "imagePullPolicy": "Never",
                   "env": env, "resources": {"limits": limits}})
        })
        .collect();
    // dnsPolicy Default: the cluster runs no DNS, and with ClusterFirst kubelet
    // says so (MissingClusterDNS) at every pod sync.
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": "default"},
           "spec": {"containers": containers, "terminationGracePeriodSeconds": 0,
                    "automountServiceAccountToken": false, "dnsPolicy": "Default"}})
}

/// The value of `key` the runtime acts on: the last entry, as containerd's
/// merge and the NVIDIA toolkit read an env with an image's entries first.
pub fn runtime_env(spec: &Value, key: &str) -> Option<String> {
    env_values(spec, key).pop()
}

/// Whether a pod runs with every container started.
pub fn is_running(pod: &Pod) -> bool {
    pod.status.as_ref().is_some_and(|s| {
        s.phase.as_deref() == Some("Running")
            && s.container_statuses
                .as_ref()
                .is_some_and(|cs| cs.iter().all(|c| c.container_id.is_some()))
    })
}

/// The allocation annotation's GPUs: `(uuid, minor)`.
pub fn allocated_gpus(pod: &Pod) -> anyhow::Result<Vec<(String, u64)>> {
    let name = pod.metadata.name.as_deref().unwrap_or_default();
    let text = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ALLOCATED))
        .with_context(|| format!("pod {name} has no {ALLOCATED}"))?;
    let value: Value = serde_json::from_str(text)?;
    value["gpu"]
        .as_array()
        .with_context(|| format!("pod {name}: {ALLOCATED} has no gpu list: {text}"))?
        .iter()
        .map(|gpu| {
            Ok((
                gpu["id"].as_str().context("gpu without id")?.to_owned(),
                gpu["minor"].as_u64().context("gpu without minor")?,
            ))
        })
        .collect()
}

/// Every value of env `key` in an OCI spec, in order.
pub fn env_values(spec: &Value, key: &str) -> Vec<String> {
    spec["process"]["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .filter_map(|kv| kv.split_once('='))
        .filter(|(k, _)| *k == key)
        .map(|(_, v)| v.to_owned())
        .collect()
}

/// The `/dev/nvidia<N>` GPU nodes in an OCI spec, by minor.
pub fn gpu_device_minors(spec: &Value) -> BTreeSet<u64> {
    spec["linux"]["devices"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|d| {
            d["path"]
                .as_str()
                .and_then(|p| p.strip_prefix("/dev/nvidia"))
                .is_some_and(|rest| rest.chars().all(|c| c.is_ascii_digit()) && !rest.is_empty())
        })
        .filter_map(|d| d["minor"].as_u64())
        .collect()
}

// === helpers ===

/// `(kubeconfig name, user, groups)` of every identity in the token file.
fn identities() -> Vec<(&'static str, &'static str, &'static str)> {
    vec![
        ("admin", "admin", "system:masters"),
        ("node", "system:node:tessera-node", "system:nodes"),
        ("kube-scheduler", "system:kube-scheduler", ""),
        (
            "extender",
            SCHEDULER_USER,
            "system:serviceaccounts,system:serviceaccounts:tessera-system",
        ),
        (
            "reporter",
            REPORTER_USER,
            "system:serviceaccounts,system:serviceaccounts:tessera-system",
        ),
        ("tenant", TENANT_USER, ""),
        (
            "other-scheduler",
            OTHER_SCHEDULER_USER,
            "system:serviceaccounts,system:serviceaccounts:kube-system",
        ),
    ]
}

fn kubeconfig(ca: &Path, token: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: tessera\n  cluster:\n    server: https://127.0.0.1:{APISERVER_PORT}\n    certificate-authority: {}\nusers:\n- name: user\n  user:\n    token: {token}\ncontexts:\n- name: tessera\n  context: {{cluster: tessera, user: user}}\ncurrent-context: tessera\n",
        ca.display()
    )
}

fn containerd_config(dir: &Path) -> String {
    let dir = dir.display();
    format!(
        r#"version = 3
root = "{dir}/root"
state = "{dir}/state"

[grpc]
  address = "{dir}/containerd.sock"

[ttrpc]
  address = "{dir}/containerd.sock.ttrpc"

[plugins."io.containerd.cri.v1.runtime"]
  # negative oom_score_adj is refused on these machines
  restrict_oom_score_adj = true
  disable_apparmor = true
  # network namespaces under our directory, so teardown finds them
  netns_mounts_under_state_dir = true
  # CDI (containerd 2.x's default is on) from our directory only: the proxy writes
  # its enforcement hooks there
  enable_cdi = true
  cdi_spec_dirs = ["{dir}/cdi"]
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "/usr/sbin/runc"
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "{dir}/cni/conf"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "native"
  use_local_image_pull = true
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{pause}"
  [plugins."io.containerd.cri.v1.images".registry]
    config_path = "{dir}/certs.d"
"#,
        pause = image::PAUSE_IMAGE,
    )
}

/// The API server's client certificate towards kubelet (`system:masters`, so
/// kubelet's authorization webhook allows it), and the CA kubelet checks it with.
fn kubelet_client_certificate(pki: &Path) -> anyhow::Result<()> {
    let key = |name: &str| pki.join(format!("{name}.key"));
    let crt = |name: &str| pki.join(format!("{name}.crt"));
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    run(Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-days",
            "3650",
            "-subj",
            "/CN=tessera-kubelet-client-ca",
        ])
        .args(ec)
        .arg("-keyout")
        .arg(key("kubelet-client-ca"))
        .arg("-out")
        .arg(crt("kubelet-client-ca")))?;
    let csr = pki.join("kubelet-client.csr");
    run(Command::new("openssl")
        .args([
            "req",
            "-subj",
            "/O=system:masters/CN=kube-apiserver-kubelet-client",
        ])
        .args(ec)
        .arg("-keyout")
        .arg(key("kubelet-client"))
        .arg("-out")
        .arg(&csr))?;
    run(Command::new("openssl")
        .args(["x509", "-req", "-days", "3650", "-in"])
        .arg(&csr)
        .arg("-CA")
        .arg(crt("kubelet-client-ca"))
        .arg("-CAkey")
        .arg(key("kubelet-client-ca"))
        .arg("-CAcreateserial")
        .arg("-out")
        .arg(crt("kubelet-client")))
}

/// A random bearer token (128 bits, hex).
fn random_token() -> anyhow::Result<String> {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("reading /dev/urandom for a token")?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// The node's InternalIP, where kubelet serves and the API server dials it: this
/// machine's first global IPv4 address (kubelet refuses a loopback one).
pub fn node_ip() -> anyhow::Result<String> {
    let output = Command::new("ip")
        .args(["-4", "-o", "addr", "show", "scope", "global"])
        .output()
        .context("running ip -4 addr")?;
    String::from_utf8_lossy(&output.stdout)
        .lines()
        // `2: eth0    inet 192.0.2.2/24 brd …`; the pod bridge is not up yet, or
        // is Tessera's own (10.88.0.1): skip it.
        .filter(|line| !line.contains(" tessera0 "))
        .find_map(|line| {
            let mut words = line.split_whitespace();
            words.find(|w| *w == "inet")?;
            Some(words.next()?.split('/').next()?.to_owned())
        })
        .context(
            "no global IPv4 address on this machine: kubelet needs one for the node's InternalIP",
        )
}

/// kubelet serves on the node's InternalIP, where the API server dials it, and
/// only to a certificate or token it accepts (anonymous is off).
///
/// Disk eviction is off ("0%" is kubelet's "no threshold"): the test node shares a
/// disk with the build, and a machine whose disk ran low (a CI run had under 1 % of
/// 252 GB free) tainted the node `disk-pressure` and evicted every test pod after
/// it. A disk that is really full still fails the tests, on the write that fails.
fn kubelet_config(dir: &Path, node_ip: &str) -> String {
    let dir = dir.display();
    format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
failSwapOn: false
containerRuntimeEndpoint: unix://{dir}/proxy.sock
imageServiceEndpoint: unix://{dir}/proxy.sock
staticPodPath: {dir}/manifests
resolvConf: /etc/resolv.conf
address: {node_ip}
port: {KUBELET_PORT}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: {KUBELET_HEALTHZ_PORT}
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: true}}
  x509: {{clientCAFile: {dir}/pki/kubelet-client-ca.crt}}
authorization:
  mode: Webhook
evictionHard: {{"memory.available": "1Mi", "nodefs.available": "0%", "nodefs.inodesFree": "0%", "imagefs.available": "0%", "imagefs.inodesFree": "0%"}}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
syncFrequency: 5s
nodeStatusUpdateFrequency: 2s
"#
    )
}

/// kube-scheduler's client certificate for an extender serving mutual TLS.
#[derive(Debug, Clone)]
pub struct ExtenderTls {
    /// Client certificate (PEM).
    pub cert: PathBuf,
    /// Its key.
    pub key: PathBuf,
    /// The CA the extender's serving certificate is checked against.
    pub ca: PathBuf,
    /// The name the serving certificate must carry.
    pub server_name: String,
}

impl ExtenderTls {
    /// Makes the extender's CA and certificates in `dir` with `tessera-scheduler
    /// certs` for an extender in `namespace`, as an operator does
    /// (docs/extender-auth.md); returns kube-scheduler's side of them. The
    /// extender's own files are `dir`/tessera-scheduler.{crt,key} and `dir`/ca.crt.
    pub fn make(dir: &Path, namespace: &str) -> anyhow::Result<Self> {
        let output = Command::new(tessera_binary("tessera-scheduler")?)
            .args(["certs", "--namespace", namespace, "--out"])
            .arg(dir)
            .output()?;
        if !output.status.success() {
            bail!(
                "tessera-scheduler certs: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(Self::of(dir, namespace))
    }

    /// kube-scheduler's side of certificates [`ExtenderTls::make`] made in `dir`.
    pub fn of(dir: &Path, namespace: &str) -> Self {
        Self {
            cert: dir.join("tessera-kube-scheduler.crt"),
            key: dir.join("tessera-kube-scheduler.key"),
            ca: dir.join("ca.crt"),
            server_name: format!("tessera-scheduler.{namespace}.svc"),
        }
    }
}

/// deploy/scheduler-config.yaml with this cluster's kubeconfig and `url` for the
/// extender: the extender settings themselves are the deploy's. A plain `http`
/// URL (the harness's loopback extender) drops deploy/'s TLS settings, whose
/// certificate files are a control-plane host's.
fn scheduler_config(kubeconfig: &Path, url: &str) -> anyhow::Result<String> {
    let mut config = deploy::documents("scheduler-config.yaml")
        .into_iter()
        .next()
        .context("deploy/scheduler-config.yaml is empty")?;
    config["clientConnection"]["kubeconfig"] = json!(kubeconfig.display().to_string());
    config["leaderElection"] = json!({"leaderElect": false});
    let extenders = config["extenders"]
        .as_array_mut()
        .context("deploy/scheduler-config.yaml has no extenders")?;
    for extender in extenders {
        extender["urlPrefix"] = json!(url);
        if url.starts_with("http://") {
            if let Some(fields) = extender.as_object_mut() {
                fields.remove("tlsConfig");
            }
            extender["enableHTTPS"] = json!(false);
        }
    }
    Ok(serde_yaml::to_string(&config)?)
}

/// The API server's resources. A CRD created just before is listed in its group
/// before its version is served (404 until it is established): retried for 10 s.
async fn discover(client: &kube::Client) -> anyhow::Result<Discovery> {
    let started = Instant::now();
    loop {
        match Discovery::new(client.clone()).run().await {
            Ok(discovery) => return Ok(discovery),
            Err(kube::Error::Api(e))
                if e.code == 404 && started.elapsed() < Duration::from_secs(10) =>
            {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => {
                return Err(anyhow::Error::new(e).context("discovering the API server's resources"));
            }
        }
    }
}

/// Applies the documents of `deploy/<name>` (server-side apply), except
/// workloads and Services: the harness runs Tessera's daemons as processes.
async fn apply_manifests(client: &kube::Client, name: &str) -> anyhow::Result<()> {
    let discovery = discover(client).await?;
    for doc in deploy::documents(name) {
        let kind = doc["kind"].as_str().unwrap_or_default();
        if matches!(
            kind,
            "Deployment" | "DaemonSet" | "Service" | "PodDisruptionBudget"
        ) {
            continue;
        }
        apply(client, &discovery, &doc)
            .await
            .with_context(|| format!("applying {kind} from deploy/{name}"))?;
    }
    Ok(())
}

async fn apply(client: &kube::Client, discovery: &Discovery, doc: &Value) -> anyhow::Result<()> {
    let object: DynamicObject = serde_json::from_value(doc.clone())?;
    let types = object
        .types
        .as_ref()
        .context("manifest without apiVersion/kind")?;
    let gvk = kube::core::GroupVersionKind::try_from(types)?;
    let (resource, caps): (ApiResource, ApiCapabilities) = discovery
        .resolve_gvk(&gvk)
        .with_context(|| format!("{gvk:?} is not served"))?;
    let name = object
        .metadata
        .name
        .clone()
        .context("manifest without a name")?;
    let api: Api<DynamicObject> = match (caps.scope, object.metadata.namespace.as_deref()) {
        (Scope::Namespaced, Some(ns)) => Api::namespaced_with(client.clone(), ns, &resource),
        (Scope::Namespaced, None) => Api::default_namespaced_with(client.clone(), &resource),
        (Scope::Cluster, _) => Api::all_with(client.clone(), &resource),
    };
    api.patch(
        &name,
        &PatchParams::apply("tessera-harness").force(),
        &Patch::Apply(doc),
    )
    .await?;
    Ok(())
}

/// What the chart adds with `reporter.dra: true` (the DeviceClass, the reporter's
/// right to write ResourceSlices, admission policy tessera-node-agents-own-slice),
/// rendered by `scripts/chart.py` into `dir` and applied as an operator's
/// `helm upgrade --set reporter.dra=true` would; deploy/ is rendered without it.
async fn apply_dra_manifests(client: &kube::Client, dir: &Path) -> anyhow::Result<()> {
    let values = repo_root().join("charts/tessera/ci/deploy-values.yaml");
    let output = Command::new("python3")
        .current_dir(repo_root())
        .args([
            "scripts/chart.py",
            "render",
            "--set",
            "reporter.dra=true",
            "--values",
        ])
        .arg(&values)
        .arg("--out")
        .arg(dir)
        .output()
        .context("running python3 scripts/chart.py render")?;
    if !output.status.success() {
        bail!(
            "chart.py render --set reporter.dra=true: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let discovery = discover(client).await?;
    for name in ["dra.yaml", "admission-policy.yaml"] {
        let text = std::fs::read_to_string(dir.join(name))
            .with_context(|| format!("the chart rendered no {name}"))?;
        for doc in deploy::parse(&text)?.into_iter().filter(|d| !d.is_null()) {
            apply(client, &discovery, &doc)
                .await
                .with_context(|| format!("applying {} from the chart's {name}", doc["kind"]))?;
        }
    }
    Ok(())
}

/// RBAC for the test identities: the tenant may manage pods, StatefulSets (and SharePods) in
/// `default` (as a namespace admin may), the second scheduler may bind and patch pods anywhere.
async fn apply_test_rbac(client: &kube::Client) -> anyhow::Result<()> {
    let discovery = discover(client).await?;
    let docs = [
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
               "metadata": {"name": "tenant", "namespace": "default"},
               "rules": [{"apiGroups": [""], "resources": ["pods", "pods/status", "pods/binding", "bindings", "pods/log", "pods/exec"],
                          "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]},
                         // Workloads, as the migration guides' examples have them.
                         {"apiGroups": ["apps"], "resources": ["statefulsets"],
                          "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]}]}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": "tenant", "namespace": "default"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tenant"},
               "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": TENANT_USER}]}),
        // SharePods, through the chart's role that aggregates into `edit`.
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": "tenant-sharepods", "namespace": "default"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "tessera-sharepods-edit"},
               "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": TENANT_USER}]}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": "tenant-mtgpupods", "namespace": "default"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "tessera-mtgpupods-edit"},
               "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": TENANT_USER}]}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": "other-scheduler"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:kube-scheduler"},
               "subjects": [{"kind": "ServiceAccount", "name": "other-scheduler", "namespace": "kube-system"}]}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
               "metadata": {"name": "other-scheduler-pods"},
               "rules": [{"apiGroups": [""], "resources": ["pods", "pods/status", "pods/binding", "bindings"],
                          "verbs": ["get", "list", "watch", "create", "update", "patch"]}]}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": "other-scheduler-pods"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "other-scheduler-pods"},
               "subjects": [{"kind": "ServiceAccount", "name": "other-scheduler", "namespace": "kube-system"}]}),
    ];
    for doc in docs {
        apply(client, &discovery, &doc).await?;
    }
    // The suites' legacy pods, bound by another scheduler or by `nodeName` as before
    // Tessera, live in `default`: it is the namespace that still runs another GPU
    // scheduler, exempt from admission policy tessera-gpu-pods-scheduled (which
    // scenarios prove in a namespace of their own). Its privileged pods, which the GPU
    // hook's own rule must meet, are exempt from Pod Security (the chart suite holds
    // tenants to tessera-tenant-pod-security) as an administrator would mark them.
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    namespaces
        .patch(
            "default",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {
                "tessera.io/unscheduled-gpu-pods": "allowed",
                "pod-security.kubernetes.io/enforce": "privileged",
            }}})),
        )
        .await
        .context("labelling namespace default")?;
    Ok(())
}

/// The Device CRs (`scheduling.koordinator.sh/v1alpha1`), read as dynamic objects
/// so the harness does not link the reporter's type.
pub fn device_api(client: &kube::Client) -> Api<DynamicObject> {
    let resource = ApiResource {
        group: "scheduling.koordinator.sh".into(),
        version: "v1alpha1".into(),
        api_version: "scheduling.koordinator.sh/v1alpha1".into(),
        kind: "Device".into(),
        plural: "devices".into(),
    };
    Api::all_with(client.clone(), &resource)
}

fn run(command: &mut Command) -> anyhow::Result<()> {
    let output = command
        .output()
        .with_context(|| format!("running {command:?}"))?;
    if !output.status.success() {
        bail!(
            "{command:?} failed with {}: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

fn connect(port: u16) -> anyhow::Result<()> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    TcpStream::connect_timeout(&addr, Duration::from_millis(200))?;
    Ok(())
}

/// kube-apiserver and etcd keep their ports a few seconds after exiting.
async fn wait_port_free(port: u16) -> anyhow::Result<()> {
    let started = Instant::now();
    // Every address: kubelet and the API server listen beyond loopback.
    while TcpListener::bind(("0.0.0.0", port)).is_err() {
        if started.elapsed() > Duration::from_secs(60) {
            bail!("port {port} is still taken after 60 s: is another cluster running?");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Ok(())
}

fn clear_dir(dir: &Path) -> anyhow::Result<()> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if entry.file_name() == ".tessera-cluster.lock" {
            continue;
        }
        if path.is_dir() {
            std::fs::remove_dir_all(&path)?;
        } else {
            std::fs::remove_file(&path)?;
        }
    }
    Ok(())
}

/// Removes the (empty) pod cgroups kubelet made, deepest first: with kubelet
/// gone nobody else would.
fn remove_pod_cgroups() {
    let Ok(controllers) = std::fs::read_dir("/sys/fs/cgroup") else {
        return;
    };
    for controller in controllers.flatten() {
        let root = controller.path().join("kubepods");
        let mut dirs = Vec::new();
        collect_dirs(&root, &mut dirs);
        dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
        for dir in dirs {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

fn collect_dirs(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    out.push(dir.to_path_buf());
    for entry in entries.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            collect_dirs(&entry.path(), out);
        }
    }
}
