//! `tessera node switch-over` / `switch-back`: points a node's kubelet at the
//! runtime proxy (or back at the runtime), and proves it did.
//!
//! Kubelet takes its runtime endpoint from, in order of precedence, its
//! `--container-runtime-endpoint` flag, its `--config-dir` drop-ins, its
//! `--config` file. An installer that writes one of them and hopes is what left
//! nodes silently unswitched before; this one:
//! 1. reads kubelet's real command line (`/proc/<pid>/cmdline`) and picks the place
//!    that decides ([`plan`]), refusing when a flag would override it;
//! 2. taints the node so no new pod lands while the switch is unproven;
//! 3. writes the setting, restarts kubelet (`--restart-command`);
//! 4. watches the proxy's own request counter: kubelet polls its runtime every
//!    second, so the count rises only if kubelet talks to the proxy;
//! 5. removes the taint only then. Otherwise the taint stays and the reason is
//!    printed, with a failing exit status.
//!
//! `switch-back` undoes exactly what `switch-over` wrote (a drop-in, or the
//! backup of an edited `--config` file) and proves the counter stops.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::{Node, Taint};
use kube::Api;
use kube::api::{Patch, PatchParams};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The taint a node carries while its switch is unproven.
pub const TAINT_KEY: &str = tessera_api::resources::SWITCH_TAINT;
/// The drop-in written into kubelet's `--config-dir`.
pub const DROP_IN: &str = "50-tessera-runtime-proxy.conf";
/// Suffix of the backup of an edited `--config` file.
pub const BACKUP_SUFFIX: &str = ".tessera-backup";

/// Where kubelet's runtime endpoint is decided, from its command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// A KubeletConfiguration drop-in in this `--config-dir`.
    DropIn(PathBuf),
    /// Edit this `--config` file (kubelet has no `--config-dir`).
    EditConfig(PathBuf),
}

/// The value of `--name` in `args` (`--name=value` or `--name value`).
fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    let long = format!("--{name}");
    let prefixed = format!("{long}=");
    args.iter().enumerate().find_map(|(i, arg)| {
        if let Some(value) = arg.strip_prefix(&prefixed) {
            Some(value)
        } else if *arg == long {
            args.get(i + 1).map(String::as_str)
        } else {
            None
        }
    })
}

/// Decides where to set the endpoint for a kubelet run with `args`.
pub fn plan(args: &[String]) -> anyhow::Result<Plan> {
    for name in ["container-runtime-endpoint", "image-service-endpoint"] {
        if let Some(value) = flag(args, name) {
            bail!(
                "kubelet runs with --{name}={value} on its command line, which wins over any \
                 configuration file: remove it where your kubelet unit sets it (kubeadm: \
                 /var/lib/kubelet/kubeadm-flags.env) and run this again"
            );
        }
    }
    if let Some(dir) = flag(args, "config-dir") {
        return Ok(Plan::DropIn(PathBuf::from(dir).join(DROP_IN)));
    }
    if let Some(file) = flag(args, "config") {
        return Ok(Plan::EditConfig(PathBuf::from(file)));
    }
    bail!(
        "kubelet runs with neither --config nor --config-dir, so only flags set its runtime \
         endpoint: give it a --config-dir (systemd/kubelet.service.d/30-tessera-kubeadm-config-dir.conf \
         does for kubeadm's unit) and run this again"
    )
}

/// A KubeletConfiguration drop-in pointing both CRI services at `endpoint`.
pub fn drop_in(endpoint: &str) -> String {
    format!(
        "# Written by `tessera node switch-over`; `tessera node switch-back` removes it.\n\
         apiVersion: kubelet.config.k8s.io/v1beta1\n\
         kind: KubeletConfiguration\n\
         containerRuntimeEndpoint: {endpoint}\n\
         imageServiceEndpoint: {endpoint}\n"
    )
}

/// `config` (a KubeletConfiguration) with both CRI endpoints set to `endpoint`,
/// everything else kept.
pub fn edit_config(config: &str, endpoint: &str) -> anyhow::Result<String> {
    let mut value: serde_yaml::Value =
        serde_yaml::from_str(config).context("kubelet's --config file is not YAML")?;
    let map = value
        .as_mapping_mut()
        .context("kubelet's --config file is not a YAML mapping")?;
    if map.get("kind").and_then(|k| k.as_str()) != Some("KubeletConfiguration") {
        bail!("kubelet's --config file is not a KubeletConfiguration");
    }
    for key in ["containerRuntimeEndpoint", "imageServiceEndpoint"] {
        map.insert(key.into(), endpoint.into());
    }
    Ok(serde_yaml::to_string(&value)?)
}

/// The proxy's CRI calls so far: the sum of `tessera_proxy_requests_total` in a
/// metrics page.
pub fn calls_in(metrics: &str) -> u64 {
    metrics
        .lines()
        .filter(|line| line.starts_with("tessera_proxy_requests_total"))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

/// Reads the proxy's metrics page from `addr` (`HOST:PORT`), plain HTTP/1.0,
/// within 5 s: a peer that never answers must not hold the tool (and the taint).
async fn scrape(addr: &str) -> anyhow::Result<String> {
    tokio::time::timeout(Duration::from_secs(5), scrape_now(addr))
        .await
        .with_context(|| format!("{addr}/metrics did not answer within 5 s"))?
}

async fn scrape_now(addr: &str) -> anyhow::Result<String> {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to the proxy's metrics at {addr}"))?;
    stream
        .write_all(format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .with_context(|| format!("{addr}: not an HTTP response"))?;
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        bail!(
            "{addr}/metrics answered {}",
            head.lines().next().unwrap_or_default()
        );
    }
    Ok(body.to_owned())
}

/// kubelet's command line: the process named `kubelet`, or `pid`.
pub fn kubelet_command_line(pid: Option<u32>) -> anyhow::Result<Vec<String>> {
    let pid = match pid {
        Some(pid) => pid,
        None => find_kubelet()?,
    };
    // Only the host's kubelet decides where this writes: a container's process
    // named kubelet (its /proc is the host's too) must not point it at files
    // the container controls.
    if !same_mount_namespace(pid) {
        bail!(
            "process {pid} is not in this host's mount namespace (a container's?): \
             refusing to take its command line as kubelet's"
        );
    }
    let raw = std::fs::read(format!("/proc/{pid}/cmdline"))
        .with_context(|| format!("reading kubelet's command line (pid {pid})"))?;
    Ok(raw
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect())
}

fn same_mount_namespace(pid: u32) -> bool {
    match (
        std::fs::read_link(format!("/proc/{pid}/ns/mnt")),
        std::fs::read_link("/proc/self/ns/mnt"),
    ) {
        (Ok(theirs), Ok(ours)) => theirs == ours,
        _ => false,
    }
}

/// When process `pid` started (clock ticks since boot, `/proc/<pid>/stat` field
/// 22): with the pid, it names one process even when pids are reused.
fn process_start(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count from its end.
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Whether the process `pid` that started at `start` is gone (or its pid now
/// names another process).
fn replaced(pid: u32, start: Option<u64>) -> bool {
    start.is_some() && process_start(pid) != start
}

/// The one process named `kubelet` in this host's mount namespace; more than
/// one is refused rather than guessed.
pub fn find_kubelet() -> anyhow::Result<u32> {
    let found: Vec<u32> = std::fs::read_dir("/proc")
        .context("reading /proc")?
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let comm = std::fs::read_to_string(entry.path().join("comm")).ok()?;
            (comm.trim() == "kubelet" && same_mount_namespace(pid)).then_some(pid)
        })
        .collect();
    match found[..] {
        [pid] => Ok(pid),
        [] => bail!("no kubelet process in this host's mount namespace (or pass --kubelet-pid)"),
        _ => bail!("several kubelet processes ({found:?}): pass --kubelet-pid"),
    }
}

/// What `switch-over` and `switch-back` act on.
#[derive(Debug, Clone)]
pub struct Switch {
    /// The node's name.
    pub node: String,
    /// kubelet's process, whose replacement proves the restart.
    pub kubelet_pid: u32,
    /// kubelet's command line.
    pub kubelet_args: Vec<String>,
    /// The proxy's socket as kubelet names it (`unix:///run/tessera/runtime-proxy.sock`).
    pub endpoint: String,
    /// The proxy's metrics address (`127.0.0.1:9464`).
    pub metrics: String,
    /// Restarts kubelet (`systemctl restart kubelet`).
    pub restart_command: String,
    /// How long kubelet has to show up at (or leave) the proxy.
    pub verify_timeout: Duration,
    /// The proxy's `--enforcement-dir`, where it says whether kubelet is connected
    /// ([`tessera_api::kubelet_seen`]).
    pub enforcement_dir: PathBuf,
}

/// Sets or removes the switch taint, retrying when another writer changed the
/// node's taints in between (the write is a compare-and-swap).
async fn set_taint(nodes: &Api<Node>, node: &str, present: bool) -> anyhow::Result<()> {
    let mut attempt = 0;
    loop {
        match try_set_taint(nodes, node, present).await {
            Err(kube::Error::Api(e)) if e.code == 409 && attempt < 5 => attempt += 1,
            result => {
                return result.with_context(|| {
                    format!(
                        "{} the taint {TAINT_KEY} on node {node}",
                        if present { "setting" } else { "removing" }
                    )
                });
            }
        }
    }
}

async fn try_set_taint(nodes: &Api<Node>, node: &str, present: bool) -> Result<(), kube::Error> {
    let current = nodes.get(node).await?;
    let mut taints: Vec<Taint> = current
        .spec
        .and_then(|s| s.taints)
        .unwrap_or_default()
        .into_iter()
        .filter(|t| t.key != TAINT_KEY)
        .collect();
    if present {
        taints.push(Taint {
            key: TAINT_KEY.into(),
            value: Some("switching".into()),
            effect: "NoSchedule".into(),
            time_added: None,
        });
    }
    // The resourceVersion makes this a compare-and-swap with other taint writers.
    let patch = serde_json::json!({
        "metadata": {"resourceVersion": current.metadata.resource_version},
        "spec": {"taints": taints},
    });
    nodes
        .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

async fn restart(command: &str) -> anyhow::Result<()> {
    let status = tokio::process::Command::new("sh")
        .args(["-c", command])
        .status()
        .await
        .with_context(|| format!("running {command:?}"))?;
    if !status.success() {
        bail!("restarting kubelet: {command:?} exited with {status}");
    }
    Ok(())
}

/// Waits until the proxy has answered `more` calls after this call starts.
async fn calls_rise(metrics: &str, more: u64, timeout: Duration) -> anyhow::Result<u64> {
    let started = Instant::now();
    let mut first = None;
    let mut last_error = None;
    while started.elapsed() < timeout {
        match scrape(metrics).await {
            Ok(page) => {
                let calls = calls_in(&page);
                let base = *first.get_or_insert(calls);
                if calls >= base + more {
                    return Ok(calls - base);
                }
            }
            Err(e) => last_error = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    match last_error {
        Some(e) if first.is_none() => Err(e.context("the proxy's metrics never answered")),
        _ => bail!(
            "kubelet made fewer than {more} calls to the proxy in {timeout:?} after its restart: \
             it does not talk to the proxy (check `systemctl status kubelet`, and that nothing \
             on its command line sets --container-runtime-endpoint)"
        ),
    }
}

/// kubelet's device-manager checkpoint: its device-plugin directory is fixed
/// (`pluginapi.DevicePluginPath`), whatever `--root-dir` says.
pub const KUBELET_CHECKPOINT: &str = "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint";

/// Before kubelet restarts onto the proxy: a device checkpoint that records no
/// allocation is moved aside (to `….tessera-stale`), so kubelet starts with a fresh
/// one. A node switched from HAMi or gpushare otherwise keeps the previous
/// plugin's registered devices, and kubelet refuses `nvidia.com/gpu` pods ("no
/// healthy devices") until their endpoint's grace period ends, minutes later. A
/// checkpoint with allocations is kept: pods hold devices through it. Returns what
/// was done, for the report.
pub fn clear_stale_checkpoint(path: &Path) -> Option<String> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return None,
        Err(error) => {
            return Some(format!(
                "kubelet's device checkpoint {} left as it is: {error}",
                path.display()
            ));
        }
    };
    let checkpoint = match tessera_api::checkpoint::parse_checkpoint(&bytes) {
        Ok(checkpoint) => checkpoint,
        Err(error) => {
            return Some(format!(
                "kubelet's device checkpoint {} left as it is: not readable ({error})",
                path.display()
            ));
        }
    };
    if !checkpoint.entries.is_empty() {
        let mut pods: Vec<&str> = checkpoint
            .entries
            .iter()
            .map(|e| e.pod_uid.as_str())
            .collect();
        pods.sort_unstable();
        pods.dedup();
        return Some(format!(
            "kubelet's device checkpoint {} kept: pods {} hold devices through it",
            path.display(),
            pods.join(", ")
        ));
    }
    if checkpoint.registered_devices.values().all(Vec::is_empty) {
        return None;
    }
    let aside = path.with_extension("tessera-stale");
    let resources: Vec<&str> = checkpoint
        .registered_devices
        .keys()
        .map(String::as_str)
        .collect();
    Some(match std::fs::rename(path, &aside) {
        Ok(()) => format!(
            "moved kubelet's device checkpoint aside to {} (it registered devices of {} and no pod held any): kubelet starts with a fresh one",
            aside.display(),
            resources.join(", ")
        ),
        Err(error) => format!(
            "kubelet's device checkpoint {} could not be moved aside ({error}); kubelet may refuse GPU pods until the previous plugin's devices expire",
            path.display()
        ),
    })
}

impl Switch {
    /// Points kubelet at the proxy and proves it; see the module docs. On failure
    /// the node keeps its taint.
    pub async fn over(&self, nodes: &Api<Node>) -> anyhow::Result<String> {
        let plan = plan(&self.kubelet_args);
        // kubelet already calls the runtime through the proxy, whatever names it
        // (another path to its socket, a command-line flag, a switch made by hand):
        // writing the setting and restarting kubelet would change nothing but risk.
        if let Ok(seen) = self.kubelet_on_proxy() {
            set_taint(nodes, &self.node, false).await?;
            let named = match &plan {
                Ok(plan) if self.already_set(plan) => {
                    format!("its configuration names {}", self.endpoint)
                }
                Ok(_) => format!(
                    "its configuration does not name {}: it reaches the proxy another way",
                    self.endpoint
                ),
                Err(_) => "its command line sets the runtime endpoint".to_owned(),
            };
            return Ok(format!(
                "already switched: kubelet (process {}) has {} connection(s) to the proxy and its runtime calls go through it ({named}); nothing written, kubelet not restarted; node {} has no {TAINT_KEY} taint",
                self.kubelet_pid, seen.connections, self.node
            ));
        }
        let plan = plan?;
        if self.already_set(&plan) {
            // A restarted installer pod (a rollout) must not restart kubelet again:
            // the setting is in place, so proof that kubelet uses it is enough.
            if let Ok(calls) = calls_rise(&self.metrics, 3, Duration::from_secs(10)).await {
                set_taint(nodes, &self.node, false).await?;
                return Ok(format!(
                    "already switched: kubelet's configuration names {} and kubelet made {calls} \
                     calls through the proxy; node {} has no {TAINT_KEY} taint",
                    self.endpoint, self.node
                ));
            }
        }
        set_taint(nodes, &self.node, true).await?;
        let wrote = match &plan {
            Plan::DropIn(path) => {
                write_file(path, &drop_in(&self.endpoint))?;
                format!("wrote {}", path.display())
            }
            Plan::EditConfig(path) => {
                let config = std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?;
                let backup = backup_of(path);
                if !backup.exists() {
                    write_file(&backup, &config)?;
                }
                write_file(path, &edit_config(&config, &self.endpoint)?)?;
                format!(
                    "set the endpoints in {} (backup {})",
                    path.display(),
                    backup.display()
                )
            }
        };
        let keeps = || {
            format!(
                "{wrote}; node {} keeps the taint {TAINT_KEY}:NoSchedule until the switch is proven",
                self.node
            )
        };
        let checkpoint = clear_stale_checkpoint(Path::new(KUBELET_CHECKPOINT))
            .map(|done| format!("; {done}"))
            .unwrap_or_default();
        let started = process_start(self.kubelet_pid);
        restart(&self.restart_command).await.with_context(keeps)?;
        // Calls through the proxy prove nothing by themselves: a kubelet already
        // on the proxy (another way than this setting) makes them unrestarted.
        self.restarted(started).await.with_context(keeps)?;
        let calls = calls_rise(&self.metrics, 3, self.verify_timeout)
            .await
            .with_context(keeps)?;
        set_taint(nodes, &self.node, false).await?;
        Ok(format!(
            "{wrote}{checkpoint}; kubelet restarted and made {calls} calls through the proxy; taint {TAINT_KEY} removed from node {}",
            self.node
        ))
    }

    /// Waits (`verify_timeout` at most) until the kubelet process that started at
    /// `started` has been replaced; an unobservable one is not a restart.
    async fn restarted(&self, started: Option<u64>) -> anyhow::Result<()> {
        let pid = self.kubelet_pid;
        if started.is_none() {
            bail!("kubelet's process {pid} cannot be read, so its restart cannot be observed");
        }
        let deadline = tokio::time::Instant::now() + self.verify_timeout;
        while !replaced(pid, started) {
            if tokio::time::Instant::now() >= deadline {
                bail!(
                    "kubelet was not restarted: its process {pid} still runs {}s after `{}`, so it cannot have read the new setting",
                    self.verify_timeout.as_secs(),
                    self.restart_command
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(())
    }

    /// Undoes what [`Switch::over`] wrote, restarts kubelet and proves it no longer
    /// calls the proxy.
    pub async fn back(&self, nodes: &Api<Node>) -> anyhow::Result<String> {
        let undone = match plan(&self.kubelet_args)? {
            Plan::DropIn(path) => {
                match std::fs::remove_file(&path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        bail!("{} does not exist: nothing to switch back", path.display())
                    }
                    Err(e) => {
                        return Err(e).with_context(|| format!("removing {}", path.display()));
                    }
                }
                format!("removed {}", path.display())
            }
            Plan::EditConfig(path) => {
                let backup = backup_of(&path);
                let original = std::fs::read_to_string(&backup).with_context(|| {
                    format!(
                        "reading {} (switch-over's backup): nothing to switch back",
                        backup.display()
                    )
                })?;
                write_file(&path, &original)?;
                std::fs::remove_file(&backup)
                    .with_context(|| format!("removing {}", backup.display()))?;
                format!("restored {} from its backup", path.display())
            }
        };
        restart(&self.restart_command).await?;
        // Calls in flight at the restart may still land; after a settling second
        // the count must stand still for as long again as kubelet's poll period x 3.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let before = calls_in(&scrape(&self.metrics).await?);
        tokio::time::sleep(Duration::from_secs(3)).await;
        let after = calls_in(&scrape(&self.metrics).await?);
        if after > before {
            bail!(
                "{undone}, but kubelet still made {} calls through the proxy in 3 s after its restart: \
                 something else sets its endpoint to the proxy",
                after - before
            );
        }
        // At an uninstall the installer's RBAC may already be gone: the switch back
        // is done and proven; only the taint (set only by an unproven switch-over)
        // cannot be checked, and that is said rather than failed.
        let taint = match set_taint(nodes, &self.node, false).await {
            Ok(()) => format!("node {} has no {TAINT_KEY} taint", self.node),
            Err(e) if forbidden(&e) => format!(
                "the {TAINT_KEY} taint of node {} could not be checked ({e:#}): `tessera node cleanup` removes it if an unproven switch-over left it",
                self.node
            ),
            Err(e) => return Err(e),
        };
        Ok(format!(
            "{undone}; kubelet restarted and no longer calls the proxy; {taint}"
        ))
    }
}

impl Switch {
    /// The proxy's word that this kubelet process calls the runtime through it:
    /// its kubelet file, fresh, with a connection from kubelet's PID.
    fn kubelet_on_proxy(&self) -> anyhow::Result<tessera_api::kubelet_seen::KubeletSeen> {
        let path = self
            .enforcement_dir
            .join(tessera_api::kubelet_seen::KUBELET_SEEN_FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => Some(text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let seen = tessera_api::kubelet_seen::KubeletSeen::proves(text.as_deref(), now)?;
        if seen.pid.is_some_and(|pid| pid != self.kubelet_pid) {
            bail!(
                "the proxy's kubelet connection is from process {:?}, not kubelet's {}",
                seen.pid,
                self.kubelet_pid
            );
        }
        Ok(seen)
    }

    /// Whether what [`Switch::over`] writes is already there.
    fn already_set(&self, plan: &Plan) -> bool {
        match plan {
            Plan::DropIn(path) => {
                std::fs::read_to_string(path).is_ok_and(|text| text == drop_in(&self.endpoint))
            }
            Plan::EditConfig(path) => std::fs::read_to_string(path).is_ok_and(|text| {
                edit_config(&text, &self.endpoint).is_ok_and(|edited| edited == text)
            }),
        }
    }
}

/// Reads this pod's in-cluster credentials and enters the host's mount namespace
/// (needs `hostPID` and a privileged container): from then on kubelet's files,
/// `/proc/<kubelet>/ns/mnt` and the restart command are the host's, as when run on
/// the node. The host's namespace is taken from this container's parent, the
/// runtime's shim (containerd-shim, conmon), which runs on the host and which no
/// other container can stand in for; PID 1's may not be readable (a sandboxed
/// node's init). The host's namespace cannot see the pod's files, so the token's
/// directory is held open first and the client reads the token through it
/// ([`token_through_fd`]): kubelet's refreshed tokens keep reaching it. `setns`
/// refuses a process with more than one thread: call this before the async runtime
/// starts.
pub fn enter_host() -> anyhow::Result<kube::Config> {
    let mut config = kube::Config::incluster()
        .context("--enter-host runs in a pod: reading its in-cluster configuration")?;
    if let Some(file) = config.auth_info.token_file.take() {
        config.auth_info.token_file = Some(token_through_fd(Path::new(&file))?);
    }
    // The CA is already in memory; the file it came from will not be visible.
    config.root_cert_file = None;
    let shim = nix::unistd::getppid();
    if shim.as_raw() <= 1 {
        bail!(
            "this container's parent is not visible (parent pid {shim}): the pod must run with hostPID"
        );
    }
    let path = format!("/proc/{shim}/ns/mnt");
    let host = std::fs::File::open(&path)
        .with_context(|| format!("opening {path}, the runtime shim's mount namespace"))?;
    nix::sched::setns(host, nix::sched::CloneFlags::CLONE_NEWNS).context(
        "entering the host's mount namespace (the container must be privileged, with hostPID)",
    )?;
    std::env::set_current_dir("/").context("changing to the host's /")?;
    Ok(config)
}

/// A path that reads the projected token `file` through a descriptor of its
/// directory, held open for the life of the process (`/proc/self/fd/<fd>/<name>`):
/// valid in any mount namespace, and it follows kubelet's refreshes, which swap the
/// directory's `..data` link (the token file is a link through it).
pub fn token_through_fd(file: &Path) -> anyhow::Result<String> {
    use std::os::fd::IntoRawFd;
    let (dir, name) = match (file.parent(), file.file_name()) {
        (Some(dir), Some(name)) => (dir, name),
        _ => bail!(
            "the service account token path {} names no file",
            file.display()
        ),
    };
    std::fs::read(file)
        .with_context(|| format!("reading the service account token {}", file.display()))?;
    let held = std::fs::File::open(dir)
        .with_context(|| format!("opening the token's directory {}", dir.display()))?;
    // Never closed: the client re-reads the token through it as long as it runs.
    let fd = held.into_raw_fd();
    Ok(format!("/proc/self/fd/{fd}/{}", name.to_string_lossy()))
}

mod cleanup;
pub use cleanup::*;

#[cfg(test)]
mod tests;
