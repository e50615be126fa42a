//! NVIDIA's Multi-Process Service, v3 (driver ≥ r615), as a share's holder.
//!
//! One control daemon per node (`nvidia-cuda-mps-control -f -p 3 -m`, supervised
//! by `tessera-enforce mps-daemon`, see [`supervise`]). On demand, for each GPU
//! that holds shares, one MPS server (`gpu_<minor>`, root-owned, that GPU alone),
//! with the GPU in `EXCLUSIVE_PROCESS` compute mode (set by the supervisor, which
//! has the `CAP_SYS_ADMIN` the driver asks for) so that the server is the only
//! context on it: a process that avoids MPS gets no context at all instead of the
//! whole GPU. For each shared container, one namespace of that server, whose
//! pinned-memory limit and active-thread percentage are the grant. The container
//! is given that namespace's directory alone as its pipe directory: the server
//! routes it by the socket it connects to, so it can reach neither the control
//! daemon nor another tenant's namespace, and its own env can only lower the
//! namespace's compute limit.
//!
//! What MPS does not hold, and why `driver-memory` holds memory where it can:
//! NVIDIA's Dynamo guide measured (615.71.09) that a client whose
//! `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` names a GPU it cannot see drops every
//! pinned limit, the namespace's included. A process in the container can set
//! that env, so MPS's memory limit is advice; its compute limit is not. See
//! `docs/enforcement.md`.
//!
//! Namespaces and servers made after the daemon started live as long as it does:
//! each one's spec is also kept as a file ([`Mps::state_dir`]), from which
//! [`config_toml`] rebuilds them when the supervisor starts the daemon again.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

/// The node daemon's pipe directory unless configured: Tessera's own, so that
/// a daemon an operator runs by hand (`/run/nvidia-mps`) is not mistaken for it.
pub const DEFAULT_PIPE_DIR: &str = "/run/tessera/mps/pipe";
/// Where the runtime proxy keeps the namespace specs unless configured (its
/// default `--enforcement-dir`, `/run/tessera/enforce`, and `mps`).
pub const DEFAULT_STATE_DIR: &str = "/run/tessera/enforce/mps";
/// The MPS protocol version Tessera drives.
pub const PROTOCOL: &str = "3";
/// Where a shared container finds its namespace: the directory the CUDA driver
/// connects through when `CUDA_MPS_PIPE_DIRECTORY` says so, and the default of a
/// root client without it. The same directory is also at [`CONTAINER_PIPE_DIR_USER`].
pub const CONTAINER_PIPE_DIR: &str = "/run/nvidia-mps";
/// The default pipe directory of a non-root client without `CUDA_MPS_PIPE_DIRECTORY`
/// (`env -i`): the namespace again, so that it does not bypass MPS.
pub const CONTAINER_PIPE_DIR_USER: &str = "/tmp/nvidia-mps";
/// The client env Tessera sets; every tenant `CUDA_MPS_*` key is removed first.
pub const PIPE_ENV: &str = "CUDA_MPS_PIPE_DIRECTORY";
/// The client's compute ceiling (it can only lower the namespace's).
pub const THREAD_PERCENTAGE_ENV: &str = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE";
/// The client's pinned memory limit, per visible device ordinal.
pub const PINNED_MEMORY_ENV: &str = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT";
/// The prefix of every MPS client env key.
pub const ENV_PREFIX: &str = "CUDA_MPS_";

/// The server of the GPU with device minor `minor`.
pub fn server_name(minor: u32) -> String {
    format!("gpu_{minor}")
}

/// A pod's namespaces share this prefix, then `_`: its UID's hex digits when it
/// is a UUID or plain hex (kubelet's are UUIDs, or 32 hex digits for static
/// pods), or, for any other UID (a CRI client's own), `u` and 31 hex digits of its
/// SHA-256, so no two UIDs share one. `None` for an empty UID.
pub fn pod_prefix(pod_uid: &str) -> Option<String> {
    use sha2::Digest as _;
    if pod_uid.is_empty() {
        return None;
    }
    let lower_hex = |part: &str| {
        part.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    // A UUID (8-4-4-4-12) or plain hex: its digits, unambiguous either way.
    let groups: Vec<&str> = pod_uid.split('-').collect();
    let uuid = groups.iter().map(|g| g.len()).eq([8, 4, 4, 4, 12]);
    let hex: String = groups.concat();
    let readable = (uuid || groups.len() == 1) && hex.len() <= 40 && lower_hex(&hex);
    if readable {
        return Some(format!("{hex}_"));
    }
    let digest = sha2::Sha256::digest(pod_uid.as_bytes());
    let hashed: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    Some(format!("u{}_", &hashed[..31]))
}

/// The namespace of a pod's container: MPS names are `[a-z0-9_]`, at most 64
/// characters, so the pod UID's hex digits and 12 hex digits of the container
/// name's SHA-256 (a container name is up to 63 characters).
pub fn namespace_name(pod_uid: &str, container: &str) -> Option<String> {
    use sha2::Digest as _;
    if container.is_empty() {
        return None;
    }
    let digest = sha2::Sha256::digest(container.as_bytes());
    let short: String = digest.iter().take(6).map(|b| format!("{b:02x}")).collect();
    Some(format!("{}{short}", pod_prefix(pod_uid)?))
}

/// The directory of a server's namespace under the daemon's pipe directory: the
/// layout MPS v3 documents (`<pipe>/<server>/<namespace>/control`).
pub fn namespace_dir(pipe_dir: &Path, server: &str, namespace: &str) -> PathBuf {
    pipe_dir.join(server).join(namespace)
}

/// A shared container's namespace, as Tessera wants it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamespaceSpec {
    /// [`namespace_name`].
    pub name: String,
    /// [`server_name`] of its GPU.
    pub server: String,
    /// The GPU's UUID (the server's only device).
    pub uuid: String,
    /// Its pinned device memory limit.
    pub memory_bytes: u64,
    /// Its active thread percentage, 1–100.
    pub thread_percentage: u64,
}

impl NamespaceSpec {
    /// The limit as MPS takes it: whole MiB, rounded down (never above the grant).
    pub fn memory_flag(&self) -> String {
        format!("{}M", self.memory_bytes >> 20)
    }
}

/// Why MPS does not hold a share as it should.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MpsError {
    /// The control program could not be run, or the daemon did not answer.
    #[error("MPS control `{command}`: {reason}")]
    Control { command: String, reason: String },
    /// The daemon answers, but holds other limits than were set.
    #[error(
        "MPS namespace {namespace} on server {server}: {field} reads {held:?} after {wanted:?} was set"
    )]
    NotHeld {
        namespace: String,
        server: String,
        field: &'static str,
        wanted: String,
        held: String,
    },
    /// The GPU's compute mode could not be set.
    #[error("GPU {uuid}: setting its compute mode: {reason}")]
    ComputeMode { uuid: String, reason: String },
    /// Tessera's record of the namespaces could not be read or written.
    #[error("MPS state {path}: {reason}")]
    State { path: String, reason: String },
}

/// Runs one control command (`nvidia-cuda-mps-control <args>`) against the
/// node's daemon; returns its output. The real one is [`ControlProgram`].
pub trait Control: Send + Sync + fmt::Debug {
    /// The command's standard output, or why it failed (non-zero exit included).
    fn run(&self, args: &[String]) -> Result<String, MpsError>;
}

/// How long one control command may take.
pub const CONTROL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// `nvidia-cuda-mps-control`, talking to the daemon whose pipe directory is `pipe_dir`.
#[derive(Debug, Clone)]
pub struct ControlProgram {
    /// The program.
    pub binary: PathBuf,
    /// The daemon's `CUDA_MPS_PIPE_DIRECTORY`.
    pub pipe_dir: PathBuf,
}

impl Control for ControlProgram {
    fn run(&self, args: &[String]) -> Result<String, MpsError> {
        let command = || format!("{} {}", self.binary.display(), args.join(" "));
        let error = |reason: String| MpsError::Control {
            command: command(),
            reason,
        };
        let mut command_line = std::process::Command::new(&self.binary);
        command_line
            .args(["-p", PROTOCOL])
            .args(args)
            .env(PIPE_ENV, &self.pipe_dir);
        // A daemon that does not answer must not hold every shared container of
        // the node (calls are serialised): the command is killed at the deadline.
        let output = crate::process::output_within(&mut command_line, CONTROL_TIMEOUT).map_err(
            |failure| match failure {
                crate::process::RunError::Spawn(e) | crate::process::RunError::Wait(e) => {
                    error(e.to_string())
                }
                crate::process::RunError::Timeout => error(format!(
                    "no answer within {} s (is the MPS daemon hung?)",
                    CONTROL_TIMEOUT.as_secs()
                )),
            },
        )?;
        let stdout = String::from_utf8_lossy(&output.stdout).trim().to_owned();
        if output.status.success() {
            return Ok(stdout);
        }
        let stderr = String::from_utf8_lossy(&output.stderr);
        Err(MpsError::Control {
            command: command(),
            reason: format!("{}: {} {}", output.status, stdout, stderr.trim())
                .trim()
                .to_owned(),
        })
    }
}

/// The compute modes Tessera sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuMode {
    /// Any process may have a context.
    Default,
    /// One process may: the GPU's MPS server.
    ExclusiveProcess,
    /// None may: while no MPS daemon holds the shares on it.
    Prohibited,
}

/// A GPU's compute mode. The real one is NVML's (`compute::NvmlComputeMode`).
/// Setting it needs `CAP_SYS_ADMIN`, which the runtime proxy does not have: the
/// MPS supervisor sets it ([`supervise`]), the proxy only reads it.
pub trait ComputeMode: Send + Sync + fmt::Debug {
    /// The GPU's mode now (a mode Tessera does not set reads as `Default`).
    fn mode(&self, uuid: &str) -> Result<GpuMode, MpsError>;
    /// Sets the GPU's mode.
    fn set(&self, uuid: &str, mode: GpuMode) -> Result<(), MpsError>;
}

/// How long [`Mps::ensure`] waits for the supervisor to make a GPU exclusive.
pub const EXCLUSIVE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// The node's MPS: its daemon, Tessera's record of what it holds, and the GPUs'
/// compute mode. Calls block (they run the control program) and are serialised,
/// so that a server is never deleted while another call gives it a namespace.
#[derive(Debug, Clone)]
pub struct Mps {
    control: Arc<dyn Control>,
    compute: Arc<dyn ComputeMode>,
    pipe_dir: PathBuf,
    state_dir: PathBuf,
    exclusive_wait: std::time::Duration,
    lock: Arc<Mutex<()>>,
}

impl Mps {
    /// MPS through `control`, with namespaces under `pipe_dir` and their specs kept in `state_dir`.
    pub fn new(
        control: Arc<dyn Control>,
        compute: Arc<dyn ComputeMode>,
        pipe_dir: PathBuf,
        state_dir: PathBuf,
    ) -> Self {
        Self {
            control,
            compute,
            pipe_dir,
            state_dir,
            exclusive_wait: EXCLUSIVE_WAIT,
            lock: Arc::new(Mutex::new(())),
        }
    }

    /// The same, waiting at most `wait` for a GPU to go exclusive.
    pub fn with_exclusive_wait(mut self, wait: std::time::Duration) -> Self {
        self.exclusive_wait = wait;
        self
    }

    /// The daemon's pipe directory.
    pub fn pipe_dir(&self) -> &Path {
        &self.pipe_dir
    }

    /// Where the namespace specs are kept (`<name>.json`), for the supervisor.
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// Whether the daemon answers, and speaks MPS v3.
    pub fn probe(&self) -> Result<(), MpsError> {
        self.control
            .run(&args(&["server", "list", "--format=csv,noheader"]))
            .map(drop)
    }

    fn run(&self, parts: &[&str]) -> Result<String, MpsError> {
        self.control.run(&args(parts))
    }

    /// Puts `spec` in force: its GPU exclusive-process (the supervisor makes it
    /// so for every GPU of a kept spec; this waits up to [`EXCLUSIVE_WAIT`] for
    /// it), its GPU's server (made if missing), its namespace (made if missing),
    /// its limits (set unless already held: MPS refuses to change a namespace a
    /// client is attached to), read back. Returns the namespace's pipe directory.
    pub fn ensure(&self, spec: &NamespaceSpec) -> Result<PathBuf, MpsError> {
        // Recorded first: the supervisor makes the GPU exclusive from it, and a
        // daemon that restarts from here on brings the namespace back. Waited for
        // outside the lock: other containers' calls go on meanwhile.
        {
            let _serial = self.lock.lock().unwrap_or_else(|p| p.into_inner());
            self.write_state(spec)?;
        }
        self.wait_exclusive(&spec.uuid)?;
        let _serial = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let dir = self.ensure_locked(spec)?;
        // Still exclusive once all is made: the supervisor re-reads the kept
        // namespaces before handing a GPU back, and this closes the rest.
        if self.compute.mode(&spec.uuid)? != GpuMode::ExclusiveProcess {
            return Err(MpsError::ComputeMode {
                uuid: spec.uuid.clone(),
                reason: "no longer exclusive-process after its namespace was made".into(),
            });
        }
        Ok(dir)
    }

    fn ensure_locked(&self, spec: &NamespaceSpec) -> Result<PathBuf, MpsError> {
        let want = namespace_dir(&self.pipe_dir, &spec.server, &spec.name);
        // Held already (a container of a pod that has one, or one kubelet
        // restarts): two reads, no change.
        let held = self.held(spec).is_ok();
        if held && want.join("control").exists() {
            return Ok(want);
        }
        if self
            .run(&["server", "get", &spec.server, "status"])
            .is_err()
        {
            self.run(&[
                "server",
                "create",
                &spec.server,
                "--uid=0",
                &format!("--allowed-devices={}", spec.uuid),
            ])?;
            // A server whose device is gone exits after a successful create
            // (NVIDIA's Dynamo guide): ask again.
            self.run(&["server", "get", &spec.server, "status"])?;
        }
        if self.namespace_get(spec, "pipe-directory").is_err() {
            self.run(&[
                "namespace",
                "create",
                &spec.name,
                &format!("--server={}", spec.server),
            ])?;
        }
        if !held {
            self.run(&[
                "namespace",
                "set",
                &spec.name,
                &format!("--server={}", spec.server),
                &format!("--pinned-memory-limit={}", spec.memory_flag()),
                &format!("--active-thread-percentage={}", spec.thread_percentage),
            ])?;
        }
        self.held(spec)?;
        let dir = self.namespace_get(spec, "pipe-directory")?;
        if Path::new(dir.trim()) != want {
            return Err(MpsError::NotHeld {
                namespace: spec.name.clone(),
                server: spec.server.clone(),
                field: "pipe-directory",
                wanted: want.display().to_string(),
                held: dir,
            });
        }
        Ok(want)
    }

    /// Waits until the GPU is exclusive-process: no process may then reach it
    /// but through its MPS server.
    fn wait_exclusive(&self, uuid: &str) -> Result<(), MpsError> {
        let started = std::time::Instant::now();
        loop {
            if self.compute.mode(uuid)? == GpuMode::ExclusiveProcess {
                return Ok(());
            }
            if started.elapsed() >= self.exclusive_wait {
                return Err(MpsError::ComputeMode {
                    uuid: uuid.to_owned(),
                    reason: format!(
                        "not exclusive-process {:.1} s after its share was recorded in {} (the MPS supervisor, tessera-enforce mps-daemon, sets it: is it running with this --state-dir?)",
                        self.exclusive_wait.as_secs_f64(),
                        self.state_dir.display()
                    ),
                });
            }
            std::thread::sleep(std::time::Duration::from_millis(25));
        }
    }

    /// One field of the spec's namespace, as the daemon holds it.
    fn namespace_get(&self, spec: &NamespaceSpec, field: &str) -> Result<String, MpsError> {
        self.run(&["namespace", "get", &spec.name, &spec.server, field])
    }

    /// Reads the namespace's limits back; an error names the first that differs.
    fn held(&self, spec: &NamespaceSpec) -> Result<(), MpsError> {
        let get = |field| self.namespace_get(spec, field);
        let not_held = |field: &'static str, wanted: String, held: String| MpsError::NotHeld {
            namespace: spec.name.clone(),
            server: spec.server.clone(),
            field,
            wanted,
            held,
        };
        let memory = get("pinned-memory-limit")?;
        let want = spec.memory_bytes >> 20 << 20;
        if parse_size(&memory) != Some(want) {
            return Err(not_held("pinned-memory-limit", spec.memory_flag(), memory));
        }
        let percent = get("active-thread-percentage")?;
        let held = percent.trim().parse::<f64>().ok();
        // MPS prints it with decimals (`30.00`).
        if held.is_none_or(|p| (p - spec.thread_percentage as f64).abs() > 0.005) {
            return Err(not_held(
                "active-thread-percentage",
                spec.thread_percentage.to_string(),
                percent,
            ));
        }
        Ok(())
    }

    /// Deletes a pod's namespaces (their clients are gone with the pod; `--force`
    /// in case one lingers), and each server left without one (the supervisor
    /// then hands its GPU back to `DEFAULT` compute mode). Returns how many
    /// namespaces went.
    pub fn remove_pod(&self, pod_uid: &str) -> Result<usize, MpsError> {
        let Some(prefix) = pod_prefix(pod_uid) else {
            return Ok(0);
        };
        self.remove_where(|spec| spec.name.starts_with(&prefix))
    }

    /// Deletes the namespaces of every pod but `live` (pod UIDs, as known at
    /// `as_of`): those whose removal the proxy missed (it was down, or a cleanup
    /// failed). A namespace recorded after `as_of` is a pod's the list may not
    /// have seen, and stays. Returns how many went.
    pub fn prune(&self, live: &[String], as_of: std::time::SystemTime) -> Result<usize, MpsError> {
        let prefixes: Vec<String> = live.iter().filter_map(|uid| pod_prefix(uid)).collect();
        self.remove_where(|spec| {
            let recorded = std::fs::metadata(self.state_file(&spec.name))
                .and_then(|m| m.modified())
                .ok();
            !prefixes.iter().any(|p| spec.name.starts_with(p))
                && recorded.is_some_and(|t| t <= as_of)
        })
    }

    fn remove_where(&self, gone: impl Fn(&NamespaceSpec) -> bool) -> Result<usize, MpsError> {
        // Most pods hold no share: they never wait for the lock.
        if !self.read_state()?.iter().any(&gone) {
            return Ok(0);
        }
        let _serial = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let specs = self.read_state()?;
        let (gone, kept): (Vec<_>, Vec<_>) = specs.into_iter().partition(|s| gone(s));
        let mut first_error = None;
        for spec in &gone {
            let deleted = self.run(&[
                "namespace",
                "delete",
                &spec.name,
                &format!("--server={}", spec.server),
                "--force",
            ]);
            // Gone already (a daemon restarted without it) is as good as deleted.
            let still_there = deleted.is_err()
                && self
                    .run(&["namespace", "get", &spec.name, &spec.server, "name"])
                    .is_ok();
            if let (true, Err(error)) = (still_there, deleted) {
                first_error.get_or_insert(error);
                continue;
            }
            if let Err(error) = self.remove_state(&spec.name) {
                first_error.get_or_insert(error);
                continue;
            }
            if kept.iter().all(|k| k.server != spec.server)
                && let Err(error) = self.release_server(spec)
            {
                first_error.get_or_insert(error);
            }
        }
        match first_error {
            Some(error) => Err(error),
            None => Ok(gone.len()),
        }
    }

    fn release_server(&self, spec: &NamespaceSpec) -> Result<(), MpsError> {
        if self.run(&["server", "get", &spec.server, "status"]).is_ok() {
            self.run(&["server", "delete", &spec.server, "--force"])?;
        }
        Ok(())
    }

    fn state_file(&self, name: &str) -> PathBuf {
        self.state_dir.join(format!("{name}.json"))
    }

    fn write_state(&self, spec: &NamespaceSpec) -> Result<(), MpsError> {
        let path = self.state_file(&spec.name);
        let error = |e: &dyn fmt::Display| MpsError::State {
            path: path.display().to_string(),
            reason: e.to_string(),
        };
        std::fs::create_dir_all(&self.state_dir).map_err(|e| error(&e))?;
        let text = serde_json::to_vec(spec).map_err(|e| error(&e))?;
        let temp = self.state_dir.join(format!(".{}.tmp", spec.name));
        std::fs::write(&temp, text).map_err(|e| error(&e))?;
        std::fs::rename(&temp, &path).map_err(|e| error(&e))
    }

    fn remove_state(&self, name: &str) -> Result<(), MpsError> {
        let path = self.state_file(name);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(MpsError::State {
                path: path.display().to_string(),
                reason: e.to_string(),
            }),
            _ => Ok(()),
        }
    }

    /// Every namespace spec kept.
    pub fn read_state(&self) -> Result<Vec<NamespaceSpec>, MpsError> {
        read_state(&self.state_dir)
    }
}

/// The namespace specs kept in `dir` (none when it does not exist), by name.
pub fn read_state(dir: &Path) -> Result<Vec<NamespaceSpec>, MpsError> {
    let error = |path: &Path, e: &dyn fmt::Display| MpsError::State {
        path: path.display().to_string(),
        reason: e.to_string(),
    };
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(error(dir, &e)),
    };
    let mut specs = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') || !name.ends_with(".json") {
            continue;
        }
        let text = std::fs::read(&path).map_err(|e| error(&path, &e))?;
        specs.push(serde_json::from_slice(&text).map_err(|e| error(&path, &e))?);
    }
    specs.sort_by(|a: &NamespaceSpec, b| a.name.cmp(&b.name));
    Ok(specs)
}

/// The daemon's startup configuration (`-a`) that brings back every kept
/// namespace and its server after a restart: MPS v3's TOML schema 1.0.
pub fn config_toml(specs: &[NamespaceSpec]) -> String {
    let mut servers: BTreeMap<&str, (&str, Vec<&NamespaceSpec>)> = BTreeMap::new();
    for spec in specs {
        servers
            .entry(&spec.server)
            .or_insert((&spec.uuid, Vec::new()))
            .1
            .push(spec);
    }
    let mut text = String::from("schema_version = \"1.0\"\n");
    for (server, (uuid, namespaces)) in servers {
        text.push_str(&format!(
            "\n[servers.{server}]\nallowed_devices = \"{uuid}\"\nuid = 0\n"
        ));
        for ns in namespaces {
            text.push_str(&format!(
                "\n[servers.{server}.namespaces.{}]\npinned_memory_limit = \"{}\"\nactive_thread_percentage = \"{}\"\n",
                ns.name,
                ns.memory_flag(),
                ns.thread_percentage
            ));
        }
    }
    text
}

/// A size as MPS prints and takes it (`20G`, `512M`, `1024K`, `20.00G`, bytes
/// without a unit), in bytes; binary units.
pub fn parse_size(text: &str) -> Option<u64> {
    let text = text
        .trim()
        .trim_end_matches(['B', 'b'])
        .trim_end_matches('i');
    let (number, shift) = match text.chars().last()? {
        'K' | 'k' => (&text[..text.len() - 1], 10),
        'M' | 'm' => (&text[..text.len() - 1], 20),
        'G' | 'g' => (&text[..text.len() - 1], 30),
        'T' | 't' => (&text[..text.len() - 1], 40),
        _ => (text, 0),
    };
    let value: f64 = number.trim().parse().ok()?;
    (value.is_finite() && value >= 0.0).then(|| (value * (1u64 << shift) as f64).round() as u64)
}

fn args(parts: &[&str]) -> Vec<String> {
    parts.iter().map(|p| (*p).to_owned()).collect()
}

pub mod supervise;
pub use supervise::{DaemonConfig, supervise};

#[cfg(test)]
mod tests;
