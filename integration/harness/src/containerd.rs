//! A private containerd (Debian's `containerd` and `runc`) with its own root,
//! state and socket, configured as this machine needs (see ARCHITECTURE.md).
//! [`Containerd::start_cdi`] runs containerd 2.x from the Kubernetes binaries
//! instead, with CDI on (Debian's 1.6 has none).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio::process::{Child, Command};

use crate::cluster::K8sBinaries;
use crate::image;

/// A running private containerd. Dropping it kills it, its shims and their
/// containers, unmounts what they left and removes its directory.
#[derive(Debug)]
pub struct Containerd {
    dir: tempfile::TempDir,
    child: Option<Child>,
    /// containerd 2.x's binaries (its shim and ctr too); `None`: Debian's on `PATH`.
    k8s: Option<K8sBinaries>,
}

impl Containerd {
    /// Starts containerd and imports the pause image. Needs root, `containerd`,
    /// `runc`, `ctr` and `cc`; says which is missing.
    pub async fn start() -> anyhow::Result<Self> {
        Self::start_from(None).await
    }

    /// Starts containerd 2.x from `k8s` (its own shim and ctr; Debian's runc) with
    /// CDI on, reading spec files from [`Self::cdi_dir`] only, and imports the pause
    /// and probe images. Needs root, `runc` and `cc`.
    pub async fn start_cdi(k8s: &K8sBinaries) -> anyhow::Result<Self> {
        Self::start_from(Some(k8s.clone())).await
    }

    async fn start_from(k8s: Option<K8sBinaries>) -> anyhow::Result<Self> {
        if !nix::unistd::Uid::effective().is_root() {
            bail!("the containerd harness needs root (it runs containerd and runc)");
        }
        match &k8s {
            None => require_tools(&["containerd", "runc", "ctr", "cc"])?,
            Some(_) => require_tools(&["runc", "cc"])?,
        }
        // Short path: unix socket paths are limited to 108 bytes.
        let dir = tempfile::Builder::new()
            .prefix("tctd-")
            .tempdir_in("/tmp")?;
        let config = match &k8s {
            None => config_toml(dir.path()),
            Some(_) => {
                std::fs::create_dir_all(dir.path().join("cdi"))?;
                config_v2_toml(dir.path())
            }
        };
        std::fs::write(dir.path().join("config.toml"), config)?;
        let mut containerd = Self {
            dir,
            child: None,
            k8s,
        };
        containerd.launch().await?;
        for archive in [
            image::pause_archive(containerd.dir.path())?,
            image::probe_archive(containerd.dir.path())?,
        ] {
            containerd.import(&archive).await?;
        }
        Ok(containerd)
    }

    /// The CRI socket.
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("containerd.sock")
    }

    /// The CDI spec directory of a [`Self::start_cdi`] containerd.
    pub fn cdi_dir(&self) -> PathBuf {
        self.dir.path().join("cdi")
    }

    /// The binary `name`: the Kubernetes binaries' for containerd 2.x, else from `PATH`.
    fn tool(&self, name: &str) -> PathBuf {
        self.k8s
            .as_ref()
            .map_or_else(|| name.into(), |k8s| k8s.path(name))
    }

    /// The harness directory (config, root, state, logs).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Imports an image archive into the `k8s.io` namespace.
    pub async fn import(&self, archive: &Path) -> anyhow::Result<()> {
        let output = Command::new(self.tool("ctr"))
            .arg("-a")
            .arg(self.socket())
            .args(["-n", "k8s.io", "images", "import"])
            .arg(archive)
            .output()
            .await?;
        if !output.status.success() {
            bail!(
                "ctr images import {}: {}",
                archive.display(),
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(())
    }

    async fn launch(&mut self) -> anyhow::Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("containerd.log"))?;
        let mut command = Command::new(self.tool("containerd"));
        if self.k8s.is_some() {
            // containerd finds its shim on PATH: 2.x's own, not Debian's.
            let shim = self.tool("containerd-shim-runc-v2");
            let bin = shim.parent().unwrap_or(Path::new("/"));
            let path = std::env::var("PATH").unwrap_or_default();
            command.env("PATH", format!("{}:{path}", bin.display()));
        }
        let child = command
            .arg("--config")
            .arg(self.dir.path().join("config.toml"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .context("spawning containerd")?;
        self.child = Some(child);
        let started = Instant::now();
        loop {
            if let Ok(mut driver) = crate::kubelet::KubeletDriver::connect(&self.socket()).await {
                if driver.version().await.is_ok() {
                    return Ok(());
                }
            }
            if started.elapsed() > Duration::from_secs(30) {
                bail!(
                    "containerd did not answer within 30 s; see {}",
                    self.dir.path().join("containerd.log").display()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops containerd (SIGTERM) and waits for it; containers keep running under their shims.
    pub async fn stop(&mut self) -> anyhow::Result<()> {
        if let Some(mut child) = self.child.take() {
            if let Some(pid) = child.id() {
                let pid = nix::unistd::Pid::from_raw(i32::try_from(pid)?);
                nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)?;
            }
            child.wait().await?;
        }
        Ok(())
    }

    /// Starts containerd again on the same root, state and socket.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.stop().await?;
        self.launch().await
    }

    /// The tail of containerd's log, for failure messages.
    pub fn log_tail(&self) -> String {
        let log =
            std::fs::read_to_string(self.dir.path().join("containerd.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.start_kill();
        }
        let dir = self.dir.path().to_string_lossy().into_owned();
        kill_processes_mentioning(&dir);
        unmount_under(&dir);
    }
}

/// Fails naming the first of `tools` not on `PATH`.
pub fn require_tools(tools: &[&str]) -> anyhow::Result<()> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    for tool in tools {
        if !std::env::split_paths(&path).any(|dir| dir.join(tool).is_file()) {
            bail!("{tool} not found on PATH: run the README's test command, which installs it");
        }
    }
    Ok(())
}

/// Kills what this containerd started: shims (their command lines name its socket)
/// and container processes (their `/` is mounted from a snapshot under its
/// directory, as their mountinfo shows), which a killed shim would leave running.
pub fn kill_processes_mentioning(needle: &str) {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let mounts = std::fs::read_to_string(entry.path().join("mountinfo")).unwrap_or_default();
        // mountinfo fields: id parent dev root mount-point …; the container's "/" comes from our snapshot.
        let root_from_us = mounts.lines().any(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            fields.get(4) == Some(&"/")
                && fields.get(3).is_some_and(|root| root.starts_with(needle))
        });
        if String::from_utf8_lossy(&cmdline).contains(needle) || root_from_us {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// Lazily unmounts every mount under `dir`, deepest first.
pub fn unmount_under(dir: &str) {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut points: Vec<&str> = mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .filter(|point| point.starts_with(dir))
        .collect();
    points.sort_by_key(|point| std::cmp::Reverse(point.len()));
    for point in points {
        let _ = nix::mount::umount2(point, nix::mount::MntFlags::MNT_DETACH);
    }
}

fn config_toml(dir: &Path) -> String {
    let dir = dir.display();
    format!(
        r#"version = 2
root = "{dir}/root"
state = "{dir}/state"

[grpc]
  address = "{dir}/containerd.sock"

[ttrpc]
  address = "{dir}/containerd.sock.ttrpc"

[debug]
  level = "info"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  # negative oom_score_adj is refused on these machines
  restrict_oom_score_adj = true
  disable_apparmor = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "native"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{dir}/cni/bin"
    conf_dir = "{dir}/cni/conf"
"#,
        pause = image::PAUSE_IMAGE,
    )
}

/// containerd 2.x's config: as [`config_toml`], plus CDI from `<dir>/cdi` only.
fn config_v2_toml(dir: &Path) -> String {
    let dir = dir.display();
    format!(
        r#"version = 3
root = "{dir}/root"
state = "{dir}/state"

[grpc]
  address = "{dir}/containerd.sock"

[ttrpc]
  address = "{dir}/containerd.sock.ttrpc"

[debug]
  level = "info"

[plugins."io.containerd.cri.v1.runtime"]
  # negative oom_score_adj is refused on these machines
  restrict_oom_score_adj = true
  disable_apparmor = true
  enable_cdi = true
  cdi_spec_dirs = ["{dir}/cdi"]
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{dir}/cni/bin"]
    conf_dir = "{dir}/cni/conf"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "native"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{pause}"

# NRI's socket is machine-wide (/var/run/nri): a cluster's containerd may hold it.
[plugins."io.containerd.nri.v1.nri"]
  disable = true
"#,
        pause = image::PAUSE_IMAGE,
    )
}
