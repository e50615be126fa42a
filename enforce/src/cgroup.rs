//! A container's cgroup v2 directory, read from its init process.
//!
//! The path comes from `/proc/<pid>/cgroup` rather than from the runtime's
//! naming scheme: it is the same with the systemd and the cgroupfs drivers, with
//! containerd and CRI-O, and it is where the kernel actually put the process.

use std::path::{Path, PathBuf};

/// Where the cgroup v2 hierarchy is mounted on a host with cgroup v2 only.
pub const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// The fields before ` - ` of the first `cgroup2` mount in a
/// `/proc/<pid>/mountinfo` (4: its mount point, 5: its mount options).
fn first_v2_fields(mountinfo: &str) -> Option<Vec<&str>> {
    mountinfo.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        (right.split_whitespace().next()? == "cgroup2").then(|| left.split_whitespace().collect())
    })
}

/// Where the cgroup v2 hierarchy is mounted, from a `/proc/<pid>/mountinfo`: the
/// first `cgroup2` mount (`/sys/fs/cgroup` on a v2 host, `/sys/fs/cgroup/unified`
/// on a hybrid one).
pub fn v2_mount(mountinfo: &str) -> Option<PathBuf> {
    first_v2_fields(mountinfo)?.get(4).map(PathBuf::from)
}

/// Whether the first `cgroup2` mount of a `/proc/<pid>/mountinfo` is read-only
/// (its mount options include `ro`; systemd's `ProtectControlGroups=yes` makes
/// it so); `None` without one.
pub fn v2_mount_read_only(mountinfo: &str) -> Option<bool> {
    first_v2_fields(mountinfo).map(|fields| {
        fields
            .get(5)
            .is_some_and(|options| options.split(',').any(|o| o == "ro"))
    })
}

/// The cgroup v2 mount of this process's mount namespace, else [`CGROUP_ROOT`].
pub fn host_v2_mount() -> PathBuf {
    std::fs::read_to_string("/proc/self/mountinfo")
        .ok()
        .and_then(|text| v2_mount(&text))
        .unwrap_or_else(|| PathBuf::from(CGROUP_ROOT))
}

/// Why the container's cgroup could not be found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CgroupError {
    /// `/proc/<pid>/cgroup` could not be read (the process is gone, or /proc is not the host's).
    #[error("reading {path}: {reason}")]
    Read { path: String, reason: String },
    /// The file has no cgroup v2 entry (`0::/…`): a cgroup v1 host.
    #[error("{path} has no cgroup v2 entry (0::/…); per-cgroup GPU memory limits need cgroup v2")]
    NotV2 { path: String },
    /// The entry names no directory below the root (the process is in the root cgroup).
    #[error("{path}: process is in the root cgroup, not a container's")]
    Root { path: String },
    /// The directory the entry names does not exist under the cgroup root.
    #[error("cgroup directory {dir} (from {path}) does not exist")]
    Missing { path: String, dir: String },
}

/// The cgroup v2 path in a `/proc/<pid>/cgroup` file (`0::/kubepods.slice/…`).
pub fn v2_path(content: &str) -> Option<&str> {
    content
        .lines()
        .find_map(|line| line.strip_prefix("0::"))
        .map(str::trim_end)
}

/// The cgroup directory of process `pid`: `cgroup_root` joined with its v2 path,
/// checked to exist. `proc_root` is `/proc` on a host.
pub fn of_pid(proc_root: &Path, cgroup_root: &Path, pid: u32) -> Result<PathBuf, CgroupError> {
    let file = proc_root.join(pid.to_string()).join("cgroup");
    let path = file.display().to_string();
    let content = std::fs::read_to_string(&file).map_err(|e| CgroupError::Read {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    let relative = v2_path(&content).ok_or_else(|| CgroupError::NotV2 { path: path.clone() })?;
    // A removed cgroup reads "… (deleted)": no directory, so refused as Missing.
    let relative = relative.trim_start_matches('/');
    if relative.is_empty() || relative.split('/').any(|part| part == "..") {
        return Err(CgroupError::Root { path });
    }
    let dir = cgroup_root.join(relative);
    if !dir.is_dir() {
        return Err(CgroupError::Missing {
            path,
            dir: dir.display().to_string(),
        });
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_v2_entry_is_found_among_v1_lines() {
        let hybrid = "12:pids:/kubepods/x\n1:name=systemd:/kubepods/x\n0::/kubepods.slice/pod.slice/cri-containerd-abc.scope\n";
        assert_eq!(
            v2_path(hybrid),
            Some("/kubepods.slice/pod.slice/cri-containerd-abc.scope")
        );
        assert_eq!(v2_path("4:memory:/docker/x\n"), None);
    }

    #[test]
    fn a_process_cgroup_resolves_under_the_root() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let proc_root = dir.path().join("proc");
        let cgroup_root = dir.path().join("cgroup");
        std::fs::create_dir_all(proc_root.join("42"))?;
        std::fs::create_dir_all(cgroup_root.join("kubepods/ctr"))?;
        std::fs::write(proc_root.join("42/cgroup"), "0::/kubepods/ctr\n")?;
        assert_eq!(
            of_pid(&proc_root, &cgroup_root, 42)?,
            cgroup_root.join("kubepods/ctr")
        );

        std::fs::create_dir_all(proc_root.join("43"))?;
        std::fs::write(proc_root.join("43/cgroup"), "0::/\n")?;
        assert!(matches!(
            of_pid(&proc_root, &cgroup_root, 43),
            Err(CgroupError::Root { .. })
        ));
        std::fs::create_dir_all(proc_root.join("44"))?;
        std::fs::write(proc_root.join("44/cgroup"), "0::/kubepods/gone\n")?;
        assert!(matches!(
            of_pid(&proc_root, &cgroup_root, 44),
            Err(CgroupError::Missing { .. })
        ));
        std::fs::create_dir_all(proc_root.join("45"))?;
        std::fs::write(proc_root.join("45/cgroup"), "0::/../../etc\n")?;
        assert!(matches!(
            of_pid(&proc_root, &cgroup_root, 45),
            Err(CgroupError::Root { .. })
        ));
        assert!(matches!(
            of_pid(&proc_root, &cgroup_root, 46),
            Err(CgroupError::Read { .. })
        ));
        Ok(())
    }

    #[test]
    fn a_read_only_v2_mount_is_told_apart() {
        let rw = "29 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev - cgroup2 cgroup2 rw,nsdelegate\n";
        let ro = "29 23 0:26 / /sys/fs/cgroup ro,nosuid,nodev - cgroup2 cgroup2 rw,nsdelegate\n";
        assert_eq!(v2_mount_read_only(rw), Some(false));
        assert_eq!(v2_mount_read_only(ro), Some(true));
        assert_eq!(
            v2_mount_read_only("31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"),
            None
        );
    }

    #[test]
    fn the_v2_mount_is_found_on_v2_and_hybrid_hosts() {
        let v2 = "29 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n";
        assert_eq!(v2_mount(v2), Some(PathBuf::from("/sys/fs/cgroup")));
        let hybrid = "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n\
            35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n\
            41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";
        assert_eq!(
            v2_mount(hybrid),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        assert_eq!(
            v2_mount("35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw\n"),
            None
        );
    }
}
