//! `tessera-enforce mps-daemon`: runs the node's MPS v3 control daemon in the
//! foreground and starts it again whenever it exits, each time with a
//! configuration that brings back every namespace Tessera keeps (servers and
//! namespaces made after the daemon started die with it). A separate service
//! from the runtime proxy, so that restarting the proxy never takes MPS, and
//! every shared container's GPU work, down with it.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use tokio::process::Command;

use super::{MpsError, PIPE_ENV, PROTOCOL, config_toml, read_state};

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
}

/// A daemon that ran this long had settled: the next restart waits the least again.
const SETTLED: Duration = Duration::from_secs(60);

/// Runs the daemon until `stop` resolves, then asks it to quit (`-q`, which
/// stops its servers too) and waits for it. Returns how many times it started.
pub async fn supervise(
    config: &DaemonConfig,
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
        tokio::select! {
            status = child.wait() => {
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
            () = &mut stop => {
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
