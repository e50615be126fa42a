//! Whether kubelet itself calls through this proxy, written for tessera-reporter
//! ([`tessera_api::kubelet_seen`]): the process at the other end of each accepted
//! connection is named from its peer credentials and `/proc/<pid>/comm`; kubelet's
//! open connections are counted, with the time of the last `RuntimeService` call,
//! and written to `<enforcement-dir>/kubelet` at each change and every
//! [`HEARTBEAT_SECS`](tessera_api::kubelet_seen::HEARTBEAT_SECS), so a proxy that
//! is gone leaves a proof that goes stale. The proxy needs the host's PID
//! namespace and `/proc` for this (a systemd service has them).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tessera_api::kubelet_seen::{HEARTBEAT_SECS, KUBELET_SEEN_FILE, KubeletSeen};
use tokio::sync::watch;

/// kubelet's connections as the proxy counts them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Count {
    connections: u32,
    pid: Option<u32>,
}

/// Counts kubelet's connections to the proxy and writes the proof file.
#[derive(Debug)]
pub struct KubeletConnections {
    /// Process names (`/proc/<pid>/comm`) that are kubelet.
    names: Vec<String>,
    count: watch::Sender<Count>,
    /// The last `RuntimeService` call, seconds since the epoch (0: none yet).
    runtime_call_at: AtomicU64,
    /// Held while the file is written; [`Self::close`] writes the last one.
    writing: tokio::sync::Mutex<()>,
    closed: AtomicBool,
}

/// One open kubelet connection; dropping it (the connection ended) counts it out.
#[derive(Debug)]
pub struct Connection(Arc<KubeletConnections>);

impl Drop for Connection {
    fn drop(&mut self) {
        self.0.count.send_modify(|c| {
            c.connections = c.connections.saturating_sub(1);
        });
    }
}

impl KubeletConnections {
    /// Counts connections from processes named one of `names` (`kubelet`, or the
    /// binary a distribution runs kubelet inside).
    pub fn new(names: Vec<String>) -> Arc<Self> {
        Arc::new(Self {
            names,
            count: watch::Sender::new(Count::default()),
            runtime_call_at: AtomicU64::new(0),
            writing: tokio::sync::Mutex::new(()),
            closed: AtomicBool::new(false),
        })
    }

    /// A call on `path` was forwarded: a `RuntimeService` one is noted, as proof
    /// that the runtime (not only the image service) is reached through the
    /// proxy. The first is written at once; later ones with the heartbeat.
    pub fn call(&self, path: &str) {
        if !(path.starts_with("/runtime.v1.RuntimeService/")
            || path.starts_with("/runtime.v1alpha2.RuntimeService/"))
        {
            return;
        }
        let before = self.runtime_call_at.swap(now(), Ordering::Relaxed);
        if before == 0 {
            self.count.send_modify(|_| {});
        }
    }

    /// A connection accepted from process `pid` (its peer credentials): counted
    /// until the returned guard drops when that process is kubelet.
    pub async fn accepted(self: &Arc<Self>, pid: Option<i32>) -> Option<Connection> {
        let pid = u32::try_from(pid?).ok().filter(|p| *p > 0)?;
        // The name, not the path: kubelet's binary lives anywhere, and a process
        // cannot reach this socket without root on the node or a hostPath of
        // /run/tessera (admission policy tessera-node-files refuses tenants that).
        let comm = tokio::fs::read_to_string(format!("/proc/{pid}/comm"))
            .await
            .ok()?;
        let comm = comm.trim_end_matches('\n');
        if !self.names.iter().any(|name| name == comm) {
            tracing::debug!(pid, comm, "a CRI client that is not kubelet");
            return None;
        }
        self.count.send_modify(|c| {
            c.connections += 1;
            c.pid = Some(pid);
        });
        tracing::info!(pid, "kubelet connected");
        Some(Connection(Arc::clone(self)))
    }

    /// kubelet's connections open now.
    pub fn connections(&self) -> u32 {
        self.count.borrow().connections
    }

    /// Writes `<dir>/kubelet` now (no kubelet yet), at each change and every
    /// heartbeat, until the process ends. A failed write is logged and retried at
    /// the next: the node stays unproven meanwhile, which holds GPU pods back and
    /// nothing else.
    pub async fn publish(self: Arc<Self>, dir: PathBuf) {
        let mut changes = self.count.subscribe();
        let mut heartbeat = tokio::time::interval(Duration::from_secs(HEARTBEAT_SECS));
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failing = false;
        loop {
            let count = *changes.borrow_and_update();
            let written = {
                let _writing = self.writing.lock().await;
                if self.closed.load(Ordering::Relaxed) {
                    return;
                }
                write(&dir, count, self.runtime_call_at.load(Ordering::Relaxed)).await
            };
            match written {
                Ok(()) if failing => {
                    failing = false;
                    tracing::info!(dir = %dir.display(), "kubelet's connections written again");
                }
                Ok(()) => {}
                Err(error) if !failing => {
                    failing = true;
                    tracing::error!(dir = %dir.display(), %error, "cannot write kubelet's connections for tessera-reporter: the node reads as unproven (no GPU pods) until it can");
                }
                Err(_) => {}
            }
            tokio::select! {
                changed = changes.changed() => if changed.is_err() { return },
                _ = heartbeat.tick() => {}
            }
        }
    }

    /// The proxy stops: no connection is kubelet's any more, said now rather
    /// than left to go stale, and nothing is written after this.
    pub async fn close(&self, dir: &Path) {
        let _writing = self.writing.lock().await;
        self.closed.store(true, Ordering::Relaxed);
        if let Err(error) = write(dir, Count::default(), 0).await {
            tracing::warn!(dir = %dir.display(), %error, "kubelet's connections not written at shutdown; the proof goes stale in a minute");
        }
    }
}

/// Seconds since the epoch.
fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Writes the proof whole (a temporary file renamed over it).
async fn write(dir: &Path, count: Count, runtime_call_at: u64) -> std::io::Result<()> {
    let seen = KubeletSeen {
        connections: count.connections,
        runtime_call_at: (runtime_call_at > 0).then_some(runtime_call_at),
        pid: count.pid,
        at: now(),
    };
    let text = serde_json::to_string(&seen).map_err(std::io::Error::other)?;
    tokio::fs::create_dir_all(dir).await?;
    let temp = dir.join(format!(".{KUBELET_SEEN_FILE}.tmp"));
    tokio::fs::write(&temp, format!("{text}\n")).await?;
    tokio::fs::set_permissions(&temp, std::os::unix::fs::PermissionsExt::from_mode(0o644)).await?;
    tokio::fs::rename(&temp, dir.join(KUBELET_SEEN_FILE)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn own_comm() -> String {
        std::fs::read_to_string("/proc/self/comm")
            .expect("comm")
            .trim_end()
            .to_owned()
    }

    async fn read_until(
        dir: &Path,
        want: impl Fn(&KubeletSeen) -> bool,
    ) -> Result<KubeletSeen, String> {
        let file = dir.join(KUBELET_SEEN_FILE);
        for _ in 0..200 {
            if let Ok(text) = std::fs::read_to_string(&file)
                && let Ok(seen) = serde_json::from_str::<KubeletSeen>(&text)
                && want(&seen)
            {
                return Ok(seen);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Err(format!(
            "{}: {:?}",
            file.display(),
            std::fs::read_to_string(&file)
        ))
    }

    #[tokio::test]
    async fn kubelets_connections_are_counted_by_process_name_and_written_at_once()
    -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        // This test's own process stands for kubelet: a real peer, a real /proc.
        let connections = KubeletConnections::new(vec![own_comm()]);
        tokio::spawn(Arc::clone(&connections).publish(dir.path().to_owned()));
        read_until(dir.path(), |s| s.connections == 0).await?;

        let (one, _peer) = tokio::net::UnixStream::pair()?;
        let pid = one.peer_cred()?.pid();
        let first = connections
            .accepted(pid)
            .await
            .ok_or("own process not counted")?;
        let second = connections
            .accepted(pid)
            .await
            .ok_or("own process not counted")?;
        let seen = read_until(dir.path(), |s| s.connections == 2).await?;
        assert_eq!(seen.pid, pid.and_then(|p| u32::try_from(p).ok()));
        // Connected, but only image calls so far: not yet proof.
        connections.call("/runtime.v1.ImageService/ListImages");
        let text = std::fs::read_to_string(dir.path().join(KUBELET_SEEN_FILE))?;
        assert_eq!(
            KubeletSeen::proves(Some(&text), seen.at),
            Err(tessera_api::kubelet_seen::Unproven::NoRuntimeCalls)
        );
        // The first runtime call is written at once.
        connections.call("/runtime.v1.RuntimeService/Status");
        let seen = read_until(dir.path(), |s| s.runtime_call_at.is_some()).await?;
        KubeletSeen::proves(
            Some(&std::fs::read_to_string(
                dir.path().join(KUBELET_SEEN_FILE),
            )?),
            seen.at,
        )?;
        drop(first);
        read_until(dir.path(), |s| s.connections == 1).await?;
        drop(second);
        read_until(dir.path(), |s| s.connections == 0).await?;
        assert_eq!(connections.connections(), 0);
        // A stop says no kubelet at once, and nothing is written after it.
        let _again = connections
            .accepted(pid)
            .await
            .ok_or("own process not counted")?;
        read_until(dir.path(), |s| s.connections == 1).await?;
        connections.close(dir.path()).await;
        let closed = read_until(dir.path(), |s| s.connections == 0).await?;
        assert_eq!(closed.runtime_call_at, None);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(read_until(dir.path(), |_| true).await?, closed);
        Ok(())
    }

    #[tokio::test]
    async fn other_clients_and_unknown_peers_are_not_kubelet()
    -> Result<(), Box<dyn std::error::Error>> {
        let connections = KubeletConnections::new(vec!["kubelet".into()]);
        let (one, _peer) = tokio::net::UnixStream::pair()?;
        // crictl, or this test: connected, not counted.
        assert!(connections.accepted(one.peer_cred()?.pid()).await.is_none());
        assert!(connections.accepted(None).await.is_none());
        assert!(connections.accepted(Some(0)).await.is_none());
        assert_eq!(connections.connections(), 0);
        Ok(())
    }
}
