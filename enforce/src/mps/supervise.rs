//! `tessera-enforce mps-daemon`: runs the node's MPS v3 control daemon in the
//! foreground and starts it again whenever it exits, each time with a
//! configuration that brings back every namespace Tessera keeps (servers and
//! namespaces made after the daemon started die with it). A separate service
//! from the runtime proxy, so that restarting the proxy never takes MPS, and
//! every shared container's GPU work, down with it.
//!
//! It also keeps each GPU's compute mode: `EXCLUSIVE_PROCESS` while a kept
//! namespace is on it and the daemon runs, `PROHIBITED` while one is and no
//! daemon runs (shares fail closed), `DEFAULT` once none is. The GPUs whose mode
//! it set are listed in `<state>/.exclusive`, so that a supervisor that restarts
//! hands back only those, never a mode the operator set.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tokio::process::Command;

use super::{ComputeMode, GpuMode, MpsError, PIPE_ENV, PROTOCOL, config_toml, read_state};

/// How the daemon is run.
#[derive(Debug, Clone)]
pub struct DaemonConfig {
    /// `nvidia-cuda-mps-control`.
    pub control: PathBuf,
    /// The daemon's `CUDA_MPS_PIPE_DIRECTORY`.
    pub pipe_dir: PathBuf,
    /// Its `CUDA_MPS_LOG_DIRECTORY`.
    pub log_dir: PathBuf,
    /// Where the runtime proxy keeps the namespace specs.
    pub state_dir: PathBuf,
    /// The wait before the first restart; doubled after each quick exit.
    pub min_backoff: Duration,
    /// The longest wait between restarts.
    pub max_backoff: Duration,
}

impl DaemonConfig {
    /// The startup configuration file written before each start.
    pub fn config_file(&self) -> PathBuf {
        self.state_dir.join(".daemon.toml")
    }

    /// The GPUs whose compute mode this supervisor set.
    pub fn exclusive_file(&self) -> PathBuf {
        self.state_dir.join(".exclusive")
    }
}

/// How often the kept namespaces are read for the GPUs' compute modes. The
/// NVML calls run on the supervisor's own single-threaded runtime, which has
/// nothing else to serve but the daemon's exit.
const RECONCILE: Duration = Duration::from_millis(50);

/// Keeps the compute modes. While the daemon runs: exclusive-process where a
/// kept namespace is (only its MPS server may have a context there). While none
/// runs (between restarts, after a stop or an error): prohibited there, so that
/// no tenant process, its MPS connection failing, gets the GPU alone and
/// unlimited: shares fail closed until MPS is back. Either way, `DEFAULT` again
/// where this supervisor changed the mode and no kept namespace is any more.
struct Modes<'a> {
    compute: &'a dyn ComputeMode,
    config: &'a DaemonConfig,
    made: BTreeSet<String>,
    /// The last error logged per GPU, so a GPU that keeps failing is logged once.
    failing: BTreeSet<String>,
}

impl<'a> Modes<'a> {
    fn load(config: &'a DaemonConfig, compute: &'a dyn ComputeMode) -> Self {
        let made = std::fs::read_to_string(config.exclusive_file())
            .unwrap_or_default()
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect();
        Self {
            compute,
            config,
            made,
            failing: BTreeSet::new(),
        }
    }

    /// Exclusive-process for `wanted` (the daemon runs).
    fn serve(&mut self, wanted: &BTreeSet<String>) {
        self.bring(wanted, GpuMode::ExclusiveProcess);
    }

    /// Prohibited for `wanted` (no daemon runs).
    fn hold(&mut self, wanted: &BTreeSet<String>) {
        self.bring(wanted, GpuMode::Prohibited);
    }

    /// `mode` for `wanted`; `DEFAULT` for the GPUs this supervisor changed that
    /// no kept namespace is on, the kept namespaces read once more first (a share
    /// recorded meanwhile keeps its GPU). A GPU that fails is tried again next time.
    fn bring(&mut self, wanted: &BTreeSet<String>, mode: GpuMode) {
        let before = self.made.clone();
        for uuid in wanted {
            // Read each time: a GPU reset or a hand-run nvidia-smi undoes it.
            if matches!(self.compute.mode(uuid), Ok(now) if now == mode) {
                self.failing.remove(uuid);
                continue;
            }
            match self.compute.set(uuid, mode) {
                Ok(()) => {
                    tracing::info!(%uuid, ?mode, "GPU compute mode set: its MPS server holds shares");
                    self.made.insert(uuid.clone());
                    self.failing.remove(uuid);
                }
                Err(error) => {
                    if self.failing.insert(uuid.clone()) {
                        tracing::error!(%error, ?mode, "GPU compute mode not set; its shares wait");
                    }
                }
            }
        }
        let mut stale: Vec<String> = self.made.difference(wanted).cloned().collect();
        if !stale.is_empty()
            && let Some(now) = kept_gpus(self.config)
        {
            stale.retain(|uuid| !now.contains(uuid));
        }
        for uuid in stale {
            match self.compute.set(&uuid, GpuMode::Default) {
                Ok(()) => {
                    tracing::info!(%uuid, "GPU back to DEFAULT compute mode: it holds no share");
                    self.made.remove(&uuid);
                }
                Err(error) => {
                    if self.failing.insert(uuid.clone()) {
                        tracing::error!(%error, "GPU not handed back to DEFAULT compute mode");
                    }
                }
            }
        }
        if self.made != before {
            let file = self.config.exclusive_file();
            let text: String = self.made.iter().map(|u| format!("{u}\n")).collect();
            if let Err(error) = std::fs::write(&file, text) {
                tracing::warn!(%error, file = %file.display(), "cannot record the GPUs whose mode was set");
            }
        }
    }
}

/// The GPUs of the kept namespaces; `None` when they cannot be read (nothing
/// changes then).
fn kept_gpus(config: &DaemonConfig) -> Option<BTreeSet<String>> {
    match read_state(&config.state_dir) {
        Ok(specs) => Some(specs.into_iter().map(|s| s.uuid).collect()),
        Err(error) => {
            tracing::warn!(%error, "kept MPS namespaces unreadable");
            None
        }
    }
}

/// A daemon that ran this long had settled: the next restart waits the least again.
const SETTLED: Duration = Duration::from_secs(60);

/// Runs the daemon until `stop` resolves, then asks it to quit (`-q`, which
/// stops its servers too) and waits for it. The GPUs of kept namespaces are then
/// left prohibited (their shares fail closed until MPS runs again), the others
/// this supervisor changed handed back to `DEFAULT`; the same on an error.
/// Returns how many times the daemon started.
pub async fn supervise(
    config: &DaemonConfig,
    compute: &dyn ComputeMode,
    stop: impl std::future::Future<Output = ()>,
) -> Result<u64, MpsError> {
    let mut modes = Modes::load(config, compute);
    let result = run(config, &mut modes, stop).await;
    // Unreadable state: hold every GPU this supervisor set, as if all were kept.
    let kept = kept_gpus(config).unwrap_or_else(|| modes.made.clone());
    modes.hold(&kept);
    result
}

async fn run(
    config: &DaemonConfig,
    modes: &mut Modes<'_>,
    stop: impl std::future::Future<Output = ()>,
) -> Result<u64, MpsError> {
    tokio::pin!(stop);
    let state = |path: &std::path::Path, e: std::io::Error| MpsError::State {
        path: path.display().to_string(),
        reason: e.to_string(),
    };
    for dir in [&config.pipe_dir, &config.log_dir, &config.state_dir] {
        std::fs::create_dir_all(dir).map_err(|e| state(dir, e))?;
    }
    let mut backoff = config.min_backoff;
    let mut starts = 0u64;
    loop {
        let specs = read_state(&config.state_dir)?;
        modes.serve(&specs.iter().map(|s| s.uuid.clone()).collect());
        let file = config.config_file();
        std::fs::write(&file, config_toml(&specs)).map_err(|e| state(&file, e))?;
        let started = Instant::now();
        let mut child = Command::new(&config.control)
            .args(["-f", "-p", PROTOCOL, "-m", "-a"])
            .arg(&file)
            .env(PIPE_ENV, &config.pipe_dir)
            .env("CUDA_MPS_LOG_DIRECTORY", &config.log_dir)
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| MpsError::Control {
                command: format!("{} -f", config.control.display()),
                reason: e.to_string(),
            })?;
        starts += 1;
        tracing::info!(
            pid = child.id(),
            namespaces = specs.len(),
            start = starts,
            "MPS control daemon started"
        );
        let mut tick = tokio::time::interval(RECONCILE);
        let status = loop {
            tokio::select! {
                status = child.wait() => break Some(status),
                _ = tick.tick() => {
                    if let Some(kept) = kept_gpus(config) {
                        modes.serve(&kept);
                    }
                }
                () = &mut stop => break None,
            }
        };
        match status {
            Some(status) => {
                let ran = started.elapsed();
                if ran >= SETTLED {
                    backoff = config.min_backoff;
                }
                tracing::warn!(status = ?status.ok(), ran_s = ran.as_secs_f64(), restart_in_s = backoff.as_secs_f64(), "MPS control daemon exited; starting it again");
                // No server holds the kept shares' GPUs until the daemon is back:
                // no process gets them meanwhile.
                let kept = kept_gpus(config).unwrap_or_else(|| modes.made.clone());
                modes.hold(&kept);
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    () = &mut stop => return Ok(starts),
                }
                backoff = (backoff * 2).min(config.max_backoff);
            }
            None => {
                quit(config, &mut child).await;
                return Ok(starts);
            }
        }
    }
}

/// Asks the daemon to quit with its servers; kills it if it has not within 10 s.
async fn quit(config: &DaemonConfig, child: &mut tokio::process::Child) {
    let asked = Command::new(&config.control)
        .args(["-p", PROTOCOL, "-q"])
        .env(PIPE_ENV, &config.pipe_dir)
        .stdin(std::process::Stdio::null())
        .status()
        .await;
    if let Err(error) = &asked {
        tracing::warn!(%error, "could not ask the MPS control daemon to quit");
    }
    if tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .is_err()
    {
        tracing::warn!("MPS control daemon did not quit within 10 s: killed");
        let _ = child.kill().await;
    }
    tracing::info!("MPS control daemon stopped");
}
