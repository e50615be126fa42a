//! The `gpu-time` backend in the proxy: the throttle (`tessera_enforce::throttle`)
//! on a thread of its own, ticking every [`TICK`], and the calls the lifecycle
//! makes on it: a shared container with a compute share is held from its
//! StartContainer (refused if it cannot be), and let go, thawed, before its
//! StopContainer or its pod's StopPodSandbox, so that a frozen process can take
//! its signal.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tessera_enforce::throttle::{
    AccountView, CgroupFreezer, GpuTime, Grant, HostProcesses, NvmlGpuTime, Throttle,
    ThrottleError, Totals,
};

/// How often the throttle samples the GPUs and decides.
pub const TICK: Duration = Duration::from_millis(100);

/// The node's GPU-time hold; clones share it.
#[derive(Clone)]
pub struct GpuTimeHold {
    throttle: Arc<Mutex<Throttle>>,
    /// The driver, sampled by the ticking thread alone (taken at its start),
    /// never under the throttle's lock.
    gpu: Arc<Mutex<Option<Box<dyn GpuTime>>>>,
    stopped: Arc<AtomicBool>,
}

impl std::fmt::Debug for GpuTimeHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuTimeHold")
            .field("throttle", &self.throttle)
            .finish_non_exhaustive()
    }
}

/// Stops the hold when dropped: whatever way `main` leaves, no container stays
/// frozen with no one to thaw it.
#[derive(Debug)]
pub struct StopGuard(GpuTimeHold);

impl Drop for StopGuard {
    fn drop(&mut self) {
        self.0.stop();
    }
}

impl GpuTimeHold {
    /// The real node's: NVML from `nvml_library`, processes from `/proc`, cgroups
    /// under the host's cgroup v2 mount, grants kept in `dir`.
    pub fn open(nvml_library: &Path, dir: &Path) -> Result<Self, String> {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| format!("reading /proc/self/mountinfo: {e}"))?;
        let cgroup_root = tessera_enforce::cgroup::v2_mount(&mountinfo)
            .ok_or("no cgroup v2 hierarchy is mounted (cgroup.freeze needs one)")?;
        if tessera_enforce::cgroup::v2_mount_read_only(&mountinfo) == Some(true) {
            return Err(format!(
                "{} is mounted read-only here (systemd's ProtectControlGroups=yes?): containers could not be frozen",
                cgroup_root.display()
            ));
        }
        let gpu = NvmlGpuTime::open(nvml_library).map_err(|e| e.to_string())?;
        let throttle = Throttle::open(
            dir.to_owned(),
            Box::new(HostProcesses {
                proc_root: "/proc".into(),
                cgroup_root,
            }),
            Box::new(CgroupFreezer),
        )
        .map_err(|e| e.to_string())?;
        Ok(Self::new(throttle, Box::new(gpu)))
    }

    /// A hold around `throttle`, sampling `gpu`.
    pub fn new(throttle: Throttle, gpu: Box<dyn GpuTime>) -> Self {
        Self {
            throttle: Arc::new(Mutex::new(throttle)),
            gpu: Arc::new(Mutex::new(Some(gpu))),
            stopped: Arc::new(AtomicBool::new(false)),
        }
    }

    /// A guard that stops the hold when dropped.
    pub fn guard(&self) -> StopGuard {
        StopGuard(self.clone())
    }

    fn lock(&self) -> MutexGuard<'_, Throttle> {
        // A panic while holding it left the accounts as they were: go on with them.
        self.throttle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Ticks the throttle every [`TICK`] on a thread of its own (NVML and cgroup
    /// files block) until [`GpuTimeHold::stop`]. The driver is sampled between
    /// two short holds of the lock, so a slow driver never holds up a release.
    pub fn start(&self, metrics: Arc<crate::metrics::Metrics>) -> std::io::Result<()> {
        let Some(mut gpu) = tessera_daemon::sync::lock(&self.gpu).take() else {
            return Err(std::io::Error::other(
                "the GPU-time thread is already running",
            ));
        };
        let hold = self.clone();
        std::thread::Builder::new()
            .name("gpu-time".into())
            .spawn(move || {
                let start = Instant::now();
                let mut reported = Totals::default();
                while !hold.stopped.load(Ordering::Relaxed) {
                    let round = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        let wanted = hold.lock().wanted();
                        let (samples, running) =
                            tessera_enforce::throttle::sample(gpu.as_mut(), wanted);
                        let now = start.elapsed().as_secs_f64();
                        let mut throttle = hold.lock();
                        throttle.seen(&running, now);
                        throttle.apply(now, samples);
                    }));
                    // A round that panicked is skipped; the next one runs (a dead
                    // thread would leave frozen containers frozen).
                    if round.is_err() {
                        tracing::error!("a GPU-time round panicked; going on");
                    }
                    let totals = hold.lock().totals();
                    metrics.record_gpu_time(&totals, &reported);
                    reported = totals;
                    std::thread::sleep(TICK);
                }
            })
            .map(drop)
    }

    /// Stops ticking and thaws every frozen container (the proxy is stopping:
    /// none may stay frozen with no one to thaw it). Under the throttle's lock:
    /// a round that ends after it freezes nothing.
    pub fn stop(&self) {
        self.stopped.store(true, Ordering::Relaxed);
        self.lock().thaw_all();
    }

    // The calls below take the throttle's lock and write or remove files: call
    // them off the async threads.

    /// Holds a container to its grant; whether it was not held before.
    pub fn grant(&self, grant: Grant) -> Result<bool, ThrottleError> {
        self.lock().grant(grant)
    }

    /// Lets a container go, thawed; whether it was held.
    pub fn release(&self, container_id: &str) -> bool {
        self.lock().release(container_id)
    }

    /// Lets every container of a pod go, thawed; how many were held.
    pub fn release_pod(&self, pod_uid: &str) -> usize {
        self.lock().release_pod(pod_uid)
    }

    /// Lets go the containers of every pod not in `live` (removed while the
    /// proxy was down); how many were held.
    pub fn prune(&self, live: &[String]) -> usize {
        let mut throttle = self.lock();
        let gone: Vec<String> = throttle
            .pods()
            .into_iter()
            .filter(|uid| !live.contains(uid))
            .collect();
        gone.iter().map(|uid| throttle.release_pod(uid)).sum()
    }

    /// The held containers' states.
    pub fn accounts(&self) -> Vec<AccountView> {
        self.lock().accounts()
    }
}
