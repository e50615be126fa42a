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
    AccountView, CgroupFreezer, Grant, HostProcesses, NvmlGpuTime, Throttle, ThrottleError,
};

/// How often the throttle samples the GPUs and decides.
pub const TICK: Duration = Duration::from_millis(100);

/// The node's GPU-time hold; clones share it.
#[derive(Debug, Clone)]
pub struct GpuTimeHold {
    throttle: Arc<Mutex<Throttle>>,
    stopped: Arc<AtomicBool>,
}

impl GpuTimeHold {
    /// The real node's: NVML from `nvml_library`, processes from `/proc`, cgroups
    /// under the host's cgroup v2 mount, grants kept in `dir`.
    pub fn open(nvml_library: &Path, dir: &Path) -> Result<Self, String> {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| format!("reading /proc/self/mountinfo: {e}"))?;
        let cgroup_root = tessera_enforce::cgroup::v2_mount(&mountinfo)
            .ok_or("no cgroup v2 hierarchy is mounted (cgroup.freeze needs one)")?;
        let gpu = NvmlGpuTime::open(nvml_library).map_err(|e| e.to_string())?;
        let throttle = Throttle::open(
            dir.to_owned(),
            Box::new(gpu),
            Box::new(HostProcesses {
                proc_root: "/proc".into(),
                cgroup_root,
            }),
            Box::new(CgroupFreezer),
        )
        .map_err(|e| e.to_string())?;
        Ok(Self::new(throttle))
    }

    /// A hold around `throttle`.
    pub fn new(throttle: Throttle) -> Self {
        Self {
            throttle: Arc::new(Mutex::new(throttle)),
            stopped: Arc::new(AtomicBool::new(false)),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Throttle> {
        // A panic while holding it left the accounts as they were: go on with them.
        self.throttle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Ticks the throttle every [`TICK`] on a thread of its own (NVML and cgroup
    /// files block) until [`GpuTimeHold::stop`].
    pub fn start(&self) -> std::io::Result<()> {
        let hold = self.clone();
        std::thread::Builder::new()
            .name("gpu-time".into())
            .spawn(move || {
                let start = Instant::now();
                while !hold.stopped.load(Ordering::Relaxed) {
                    hold.lock().tick(start.elapsed().as_secs_f64());
                    std::thread::sleep(TICK);
                }
            })
            .map(drop)
    }

    /// Stops ticking and thaws every frozen container (the proxy is stopping:
    /// none may stay frozen with no one to thaw it).
    pub fn stop(&self) {
        self.stopped.store(true, Ordering::Relaxed);
        self.lock().thaw_all();
    }

    /// Holds a container to its grant.
    pub async fn grant(&self, grant: Grant) -> Result<(), ThrottleError> {
        let hold = self.clone();
        blocking(move || hold.lock().grant(grant))
            .await
            .and_then(|granted| granted.map_err(|e| e.to_string()))
            .map_err(ThrottleError::Grant)
    }

    /// Lets a container go, thawed; whether it was held.
    pub async fn release(&self, container_id: String) -> Result<bool, String> {
        let hold = self.clone();
        blocking(move || hold.lock().release(&container_id)).await
    }

    /// Lets every container of a pod go, thawed; how many were held.
    pub async fn release_pod(&self, pod_uid: String) -> Result<usize, String> {
        let hold = self.clone();
        blocking(move || hold.lock().release_pod(&pod_uid)).await
    }

    /// Lets go the containers of every pod not in `live` (removed while the
    /// proxy was down); how many were held.
    pub async fn prune(&self, live: Vec<String>) -> Result<usize, String> {
        let hold = self.clone();
        blocking(move || {
            let mut throttle = hold.lock();
            let gone: Vec<String> = throttle
                .pods()
                .into_iter()
                .filter(|uid| !live.contains(uid))
                .collect();
            gone.iter().map(|uid| throttle.release_pod(uid)).sum()
        })
        .await
    }

    /// The held containers' states.
    pub fn accounts(&self) -> Vec<AccountView> {
        self.lock().accounts()
    }
}

/// Runs `f` off the async threads (it reads and writes files); its panic is an
/// error, never the caller's.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, String> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| format!("GPU-time task failed: {e}"))
}
