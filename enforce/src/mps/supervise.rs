//! `tessera-enforce mps-daemon`: runs the node's MPS v3 control daemon in the
//! foreground and starts it again whenever it exits, each time with a
//! configuration that brings back every namespace Tessera keeps (servers and
//! namespaces made after the daemon started die with it). A separate service
//! from the runtime proxy, so that restarting the proxy never takes MPS, and
//! every shared container's GPU work, down with it.
//!
//! It also keeps each GPU's compute mode: `EXCLUSIVE_PROCESS` while a kept
//! namespace is on it, `DEFAULT` once none is (and when it stops). The GPUs it
//! made exclusive are listed in `<state>/.exclusive`, so that a supervisor that
//! restarts hands back only those, never a mode the operator set.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tokio::process::Command;

use super::{ComputeMode, MpsError, PIPE_ENV, PROTOCOL, config_toml, read_state};

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

    /// The GPUs this supervisor made exclusive-process.
    pub fn exclusive_file(&self) -> PathBuf {
        self.state_dir.join(".exclusive")
    }
}

/// How often the kept namespaces are read for the GPUs' compute modes. The
/// NVML calls run on the supervisor's own single-threaded runtime, which has
/// nothing else to serve but the daemon's exit.
const RECONCILE: Duration = Duration::from_millis(50);

/// Keeps the compute modes: exclusive where a kept namespace is, default where
/// this supervisor made a GPU exclusive and none is any more.
struct Modes<'a> {
    compute: &'a dyn ComputeMode,
    file: PathBuf,
    made: BTreeSet<String>,
}

impl<'a> Modes<'a> {
    fn load(config: &DaemonConfig, compute: &'a dyn ComputeMode) -> Self {
        let file = config.exclusive_file();
        let made = std::fs::read_to_string(&file)
            .unwrap_or_default()
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect();
        Self {
            compute,
            file,
            made,
        }
    }

    /// Brings the modes to `wanted`; a GPU that fails is tried again next time.
    fn reconcile(&mut self, wanted: &BTreeSet<String>) {
        let before = self.made.clone();
        for uuid in wanted {
            // Read each time: a GPU reset or a hand-run nvidia-smi undoes it.
            match self.compute.is_exclusive(uuid) {
                Ok(true) => {
                    self.made.insert(uuid.clone());
                }
                _ => match self.compute.set_exclusive(uuid, true) {
                    Ok(()) => {
                        tracing::info!(%uuid, "GPU exclusive-process: its MPS server holds shares");
                        self.made.insert(uuid.clone());
                    }
                    Err(error) => {
                        tracing::error!(%error, "GPU not made exclusive-process; its shares wait")
                    }
                },
            }
        }
        let stale: Vec<String> = self.made.difference(wanted).cloned().collect();
        for uuid in stale {
            match self.compute.set_exclusive(&uuid, false) {
                Ok(()) => {
                    tracing::info!(%uuid, "GPU back to DEFAULT compute mode: it holds no share");
                    self.made.remove(&uuid);
                }
                Err(error) => {
                    tracing::error!(%error, "GPU not handed back to DEFAULT compute mode")
                }
            }
        }
        if self.made != before {
            let text: String = self.made.iter().map(|u| format!("{u}\n")).collect();
            if let Err(error) = std::fs::write(&self.file, text) {
                tracing::warn!(%error, file = %self.file.display(), "cannot record the GPUs made exclusive");
            }
        }
    }
}

/// The GPUs of the kept namespaces; `None` when they cannot be read (nothing
/// changes then).
fn wanted(config: &DaemonConfig) -> Option<BTreeSet<String>> {
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
/// stops its servers too), waits for it, and hands the GPUs it made exclusive
/// back to `DEFAULT`. Returns how many times the daemon started.
pub async fn supervise(
    config: &DaemonConfig,
    compute: &dyn ComputeMode,
    stop: impl std::future::Future<Output = ()>,
) -> Result<u64, MpsError> {
    let mut modes = Modes::load(config, compute);
    let result = run(config, &mut modes, stop).await;
    modes.reconcile(&BTreeSet::new());
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
        modes.reconcile(&specs.iter().map(|s| s.uuid.clone()).collect());
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
                    if let Some(wanted) = wanted(config) {
                        modes.reconcile(&wanted);
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
