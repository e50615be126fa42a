//! The GPU memory OOM kill: a shared container whose processes hold more of a
//! GPU's memory than its grant plus the node's margin, as the driver counts it
//! (`crate::usage`), loses its largest users there, as the kernel's OOM killer
//! kills past a memory limit. It needs nothing of the driver beyond the
//! per-process memory every driver reports, and nothing in the container: a
//! process that avoided a preloaded limiter, linked CUDA statically or talks to
//! the driver directly is counted all the same. It holds after the fact: an
//! allocation past the grant stands until the next reading.

use std::os::fd::AsFd;

use crate::throttle::{HostProcesses, Lookup, Processes};

/// Which of one container's `processes` on one GPU (pid, bytes) to kill so that
/// what is left holds at most `allowance` bytes: the largest first, as few as
/// that takes (ties: the higher pid, the newer process, first). None when they
/// are within it.
pub fn victims(processes: &[(u32, u64)], allowance: u64) -> Vec<u32> {
    let mut left: u64 = processes
        .iter()
        .fold(0u64, |sum, (_, used)| sum.saturating_add(*used));
    let mut largest = processes.to_vec();
    largest.sort_by(|a, b| b.1.cmp(&a.1).then(b.0.cmp(&a.0)));
    let mut chosen = Vec::new();
    for (pid, used) in largest {
        if left <= allowance {
            break;
        }
        chosen.push(pid);
        left = left.saturating_sub(used);
    }
    chosen
}

/// Why a process was not killed.
#[derive(Debug, thiserror::Error)]
pub enum KillError {
    /// It is gone, or no longer in that container (its pid was reused): nothing
    /// to kill.
    #[error("process {0} is no longer in container {1}")]
    Gone(u32, String),
    /// The signal could not be sent.
    #[error("killing process {0}: {1}")]
    Failed(u32, std::io::Error),
}

/// Kills a container's process.
pub trait Killer: Send {
    /// Sends SIGKILL to `pid`, if it is still the process that started at `start`
    /// (when known) and runs in container `container_id`.
    fn kill(&self, pid: u32, start: Option<u64>, container_id: &str) -> Result<(), KillError>;
}

/// The host's processes, killed through a pidfd: the process is pinned first,
/// then checked to be the one traced (its start time) and in the container, so a
/// pid reused since it was traced is never the one killed.
#[derive(Debug)]
pub struct HostKiller {
    processes: HostProcesses,
}

impl HostKiller {
    /// One that checks containers through `processes`.
    pub fn new(processes: HostProcesses) -> Self {
        Self { processes }
    }

    /// Whether `pid` is still the traced process (its start time, when known) and
    /// in the container.
    fn still(&self, pid: u32, start: Option<u64>, container_id: &str) -> bool {
        start.is_none_or(|start| self.processes.start_time(pid) == Some(start))
            && matches!(self.processes.cgroup(pid), Lookup::Container(c) if c.container_id == container_id)
    }
}

impl Killer for HostKiller {
    fn kill(&self, pid: u32, start: Option<u64>, container_id: &str) -> Result<(), KillError> {
        let gone = || KillError::Gone(pid, container_id.to_owned());
        let raw = i32::try_from(pid).map_err(|_| gone())?;
        let Some(id) = rustix::process::Pid::from_raw(raw) else {
            return Err(gone());
        };
        match rustix::process::pidfd_open(id, rustix::process::PidfdFlags::empty()) {
            Ok(fd) => {
                if !self.still(pid, start, container_id) {
                    return Err(gone());
                }
                match rustix::process::pidfd_send_signal(fd.as_fd(), rustix::process::Signal::KILL)
                {
                    Ok(()) => Ok(()),
                    Err(rustix::io::Errno::SRCH) => Err(gone()),
                    Err(e) => Err(KillError::Failed(pid, e.into())),
                }
            }
            Err(rustix::io::Errno::SRCH) => Err(gone()),
            // A kernel before 5.3 has no pidfds, and an old seccomp filter may refuse
            // the call: checked, then killed by pid, with the reuse window of a
            // plain kill(2) between the two.
            Err(rustix::io::Errno::NOSYS | rustix::io::Errno::PERM) => {
                if !self.still(pid, start, container_id) {
                    return Err(gone());
                }
                match rustix::process::kill_process(id, rustix::process::Signal::KILL) {
                    Ok(()) => Ok(()),
                    Err(rustix::io::Errno::SRCH) => Err(gone()),
                    Err(e) => Err(KillError::Failed(pid, e.into())),
                }
            }
            Err(e) => Err(KillError::Failed(pid, e.into())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_go_first_until_the_rest_fits() {
        // 30 GiB in three processes against 21: the 16 GiB one is enough.
        let gib = |n: u64| n << 30;
        let p = [(10, gib(4)), (11, gib(16)), (12, gib(10))];
        assert_eq!(victims(&p, gib(21)), vec![11]);
        // Against 3: 16, then 10, then 4 (leaving none).
        assert_eq!(victims(&p, gib(3)), vec![11, 12, 10]);
        // Within: none, also exactly at the allowance.
        assert!(victims(&p, gib(30)).is_empty());
        assert!(victims(&[], 0).is_empty());
        // Ties: the newer (higher pid) first.
        assert_eq!(victims(&[(5, 8), (9, 8)], 10), vec![9]);
        // Processes whose memory the driver does not give (0) are never chosen
        // for it: they free nothing.
        assert_eq!(victims(&[(1, 0), (2, 50)], 10), vec![2]);
    }

    #[test]
    fn a_process_is_killed_only_while_in_its_container() {
        // A real child, seen through a /proc and cgroup tree of the test's own
        // that put it in container `id`.
        let id = "ab".repeat(32);
        let dir = tempfile::tempdir().expect("tempdir");
        let cgroup = dir.path().join("cgroup");
        std::fs::create_dir_all(cgroup.join(format!("kubepods/cri-containerd-{id}.scope")))
            .expect("cgroup dir");
        let processes = HostProcesses {
            proc_root: dir.path().join("proc"),
            cgroup_root: cgroup,
        };
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep");
        let pid = child.id();
        let file = dir.path().join(format!("proc/{pid}/cgroup"));
        std::fs::create_dir_all(file.parent().expect("parent")).expect("proc dir");
        std::fs::write(&file, format!("0::/kubepods/cri-containerd-{id}.scope\n"))
            .expect("cgroup file");
        std::fs::copy(format!("/proc/{pid}/stat"), file.with_file_name("stat")).expect("stat");
        let killer = HostKiller::new(processes);
        // Another container's: refused, and the child still runs; so is another
        // process given its pid (another start time).
        let refused = killer.kill(pid, None, &"cd".repeat(32));
        assert!(matches!(refused, Err(KillError::Gone(..))), "{refused:?}");
        let start = HostProcesses::host().expect("host").start_time(pid);
        assert!(start.is_some(), "no start time of {pid}");
        let other = killer.kill(pid, start.map(|s| s + 1), &id);
        assert!(matches!(other, Err(KillError::Gone(..))), "{other:?}");
        assert!(child.try_wait().expect("wait").is_none(), "killed anyway");
        // Its own: killed by SIGKILL.
        killer.kill(pid, start, &id).expect("killed");
        let status = child.wait().expect("wait");
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(9),
            "{status:?}"
        );
        // Gone now, and a pid that never was: nothing to kill.
        assert!(matches!(
            killer.kill(pid, None, &id),
            Err(KillError::Gone(..))
        ));
        assert!(matches!(
            killer.kill(i32::MAX as u32, None, &id),
            Err(KillError::Gone(..))
        ));
    }
}
