//! GPU time held by freezing, for real: a busy process in a cgroup v2 named as a
//! container's, its use read through nvml-wrapper from the fake NVML (which
//! reports a listed process's CPU use as its GPU use, so that frozen means idle),
//! frozen and thawed by the kernel through `cgroup.freeze`. The process must get
//! about its share of a CPU, where unheld it gets a whole one.
//!
//! Needs root and a writable cgroup v2 hierarchy (CI has both); elsewhere it says
//! so and checks nothing.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use tessera_enforce::throttle::{
    CgroupFreezer, Grant, HostProcesses, NvmlGpuTime, Throttle, container_id_of,
};
use tessera_harness::fake_nvml::{self, cpu_seconds};

const GPU0: &str = "GPU-fa4e0000-0000-4000-8000-000000000000";
const ID: &str = "c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00";

/// A cgroup made for the test, removed (its process killed) when dropped.
struct TestCgroup {
    parent: PathBuf,
    dir: PathBuf,
    child: Child,
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        let _ = std::fs::write(self.dir.join("cgroup.freeze"), "0");
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir(&self.dir);
        let _ = std::fs::remove_dir(&self.parent);
    }
}

/// A busy shell loop in `<v2 mount>/tessera-gpu-time-<pid>-<test>/cri-containerd-<ID>.scope`.
fn busy_container(test: &str) -> anyhow::Result<Option<TestCgroup>> {
    let mount = tessera_enforce::cgroup::host_v2_mount();
    let parent = mount.join(format!("tessera-gpu-time-{}-{test}", std::process::id()));
    if let Err(error) = std::fs::create_dir(&parent) {
        eprintln!(
            "SKIPPED: cannot make a cgroup under {} ({error}): needs root and cgroup v2",
            mount.display()
        );
        return Ok(None);
    }
    let dir = parent.join(format!("cri-containerd-{ID}.scope"));
    std::fs::create_dir(&dir)?;
    let child = Command::new("sh")
        .args(["-c", "while :; do :; done"])
        .spawn()?;
    let cgroup = TestCgroup { parent, dir, child };
    std::fs::write(
        cgroup.dir.join("cgroup.procs"),
        cgroup.child.id().to_string(),
    )?;
    Ok(Some(cgroup))
}

/// Ticks `throttle` every 100 ms for `seconds`; returns the CPU seconds the
/// process used per wall second.
fn hold(
    throttle: &mut Throttle,
    gpu: &mut NvmlGpuTime,
    pid: u32,
    seconds: f64,
) -> anyhow::Result<f64> {
    let start = Instant::now();
    let before = cpu_seconds(pid)?;
    while start.elapsed().as_secs_f64() < seconds {
        throttle.tick(start.elapsed().as_secs_f64(), gpu);
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok((cpu_seconds(pid)? - before) / start.elapsed().as_secs_f64())
}

fn throttle(dir: &Path, library: &Path) -> anyhow::Result<(Throttle, NvmlGpuTime)> {
    let throttle = Throttle::open(
        dir.to_owned(),
        Box::new(HostProcesses {
            proc_root: "/proc".into(),
            cgroup_root: tessera_enforce::cgroup::host_v2_mount(),
        }),
        Box::new(CgroupFreezer),
    )?;
    Ok((throttle, NvmlGpuTime::open(library)?))
}

#[test]
fn a_busy_container_gets_its_share_and_is_thawed_when_released() -> anyhow::Result<()> {
    let Some(cgroup) = busy_container("share")? else {
        return Ok(());
    };
    assert_eq!(container_id_of(&cgroup.dir).as_deref(), Some(ID));
    let dir = tempfile::tempdir()?;
    let pids = dir.path().join("pids");
    std::fs::write(&pids, format!("0 {}\n", cgroup.child.id()))?;
    let mut node = fake_nvml::four_gpu_node();
    node["processUtilization"] = pids.display().to_string().into();
    let library = fake_nvml::install(&dir.path().join("nvml"), &node)?;
    let (mut throttle, mut gpu) = throttle(&dir.path().join("grants"), &library)?;

    // Unheld first: what the process gets on this machine now.
    let unheld = hold(&mut throttle, &mut gpu, cgroup.child.id(), 2.0)?;
    throttle.grant(Grant {
        pod_uid: "pod-1".into(),
        container_id: ID.into(),
        percent: 25,
        gpus: vec![GPU0.into()],
        percents: Vec::new(),
    })?;
    let held = hold(&mut throttle, &mut gpu, cgroup.child.id(), 8.0)?;
    let frozen = throttle.accounts()[0].frozen_seconds;
    eprintln!("unheld {unheld:.2} CPU, held at 25 %: {held:.2} CPU, frozen {frozen:.1} s of 8");
    // Its share of the 8 s, plus the 0.5 s burst it saved unheld, plus slack.
    assert!(
        held <= 0.25 + 0.5 / 8.0 + 0.07,
        "held at 25 %, the process used {held:.2} CPU against {unheld:.2} unheld"
    );
    assert!(frozen >= 3.0, "frozen only {frozen:.1} s of 8");

    // Released (the container is stopping): thawed at once, its file gone.
    assert!(throttle.release(ID));
    let events = std::fs::read_to_string(cgroup.dir.join("cgroup.events"))?;
    assert!(events.contains("frozen 0"), "{events}");
    assert_eq!(std::fs::read_dir(dir.path().join("grants"))?.count(), 0);
    let after = hold(&mut throttle, &mut gpu, cgroup.child.id(), 2.0)?;
    assert!(
        after > held + 0.2,
        "released, the process used {after:.2} CPU against {held:.2} held ({unheld:.2} unheld before)"
    );
    Ok(())
}

#[test]
fn a_proxy_that_died_with_a_container_frozen_thaws_it_at_start() -> anyhow::Result<()> {
    let Some(cgroup) = busy_container("restart")? else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let grants = dir.path().join("grants");
    std::fs::create_dir_all(&grants)?;
    // What a throttle leaves once it has seen the container's process.
    std::fs::write(
        grants.join(format!("pod-1_{ID}")),
        format!("percent=25\ngpus={GPU0}\ncgroup={}\n", cgroup.dir.display()),
    )?;
    std::fs::write(cgroup.dir.join("cgroup.freeze"), "1")?;
    let library = fake_nvml::install(&dir.path().join("nvml"), &fake_nvml::four_gpu_node())?;
    let (throttle, _) = throttle(&grants, &library)?;
    let events = std::fs::read_to_string(cgroup.dir.join("cgroup.events"))?;
    assert!(events.contains("frozen 0"), "still frozen: {events}");
    assert_eq!(throttle.accounts().len(), 1);
    Ok(())
}

#[test]
fn gpu_memory_is_traced_to_the_container_that_holds_it() -> anyhow::Result<()> {
    use tessera_enforce::usage::{GpuMemory, NvmlGpuMemory, per_container};
    let Some(cgroup) = busy_container("memory")? else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let pids = dir.path().join("pids");
    // The container's process on GPU 0 and 1, with a graphics context too on 2
    // (Vulkan, say); this test's own (no container's) on 0.
    std::fs::write(
        &pids,
        format!(
            "0 {pid} 3221225472\n1 {pid} 1024\n2 {pid} 4096 graphics\n0 {me} 999\n",
            pid = cgroup.child.id(),
            me = std::process::id()
        ),
    )?;
    let mut node = fake_nvml::four_gpu_node();
    node["processUtilization"] = pids.display().to_string().into();
    let library = fake_nvml::install(&dir.path().join("nvml"), &node)?;
    let read = NvmlGpuMemory::open(&library)?.processes()?;
    assert!(read.failed.is_empty(), "{:?}", read.failed);
    let processes = read.processes;
    assert_eq!(processes.len(), 4, "{processes:?}");
    let sums = per_container(
        &processes,
        &HostProcesses::host().map_err(anyhow::Error::msg)?,
    );
    let mine: Vec<(&str, u64)> = sums
        .iter()
        .map(|((id, gpu), used)| {
            assert_eq!(id, ID);
            (gpu.as_str(), *used)
        })
        .collect();
    assert_eq!(mine.len(), 3, "{sums:?}");
    assert!(mine.contains(&(GPU0, 3 << 30)), "{sums:?}");
    assert!(mine.iter().any(|(_, used)| *used == 1024), "{sums:?}");
    // Memory held through a graphics context is counted.
    assert!(mine.iter().any(|(_, used)| *used == 4096), "{sums:?}");
    Ok(())
}
