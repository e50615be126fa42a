//! Compute shares held as GPU time (`gpu-time`): each shared container may use
//! its granted percent of each of its GPUs' time, as the driver measures it
//! (NVML's per-process utilization), and its cgroup is frozen while it has used
//! more, until the time it was owed has passed.
//!
//! Why this holds where HAMi-core's limiter did not (docs/enforcement.md): the
//! measure is the driver's, of every process of the container, however it
//! reached the GPU (static binaries and direct ioctls included), and the freeze is
//! the kernel's, on the container's own cgroup, which none of its processes can
//! leave. What it does not do: stop a kernel already on the GPU. Work a frozen
//! container queued still runs, and is charged: the container stays frozen
//! longer, so its share holds over time (a window of about [`BURST_SECONDS`] plus
//! its longest run of queued work), not within each kernel.
//!
//! The accounting is a bucket of GPU seconds per container and GPU: it fills at
//! the share's rate up to [`BURST_SECONDS`] and is drawn by each sample's use; a
//! container whose bucket on any of its GPUs is below zero is frozen.
//!
//! The grants are files under `<enforcement-dir>/gpu-time`, one per container
//! (`<pod uid>_<container id>`), so that a restarted proxy holds the same
//! containers and thaws any it left frozen.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use crate::write_whole;

/// How far ahead of its share a container may run, in seconds of a whole GPU.
pub const BURST_SECONDS: f64 = 0.5;
/// The longest gap between two samples charged as use (a stalled sampler must not
/// turn into a long freeze).
const MAX_SAMPLE_GAP_SECONDS: f64 = 1.0;
/// How long a process's cgroup is remembered after its last sample.
const PID_CACHE_SECONDS: f64 = 30.0;

/// One shared container's grant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// Its pod's UID (its grants go with the pod).
    pub pod_uid: String,
    /// The runtime's container ID (64 hex digits), as its cgroup's name carries it.
    pub container_id: String,
    /// Its percent of each of its GPUs' time (1–99): the highest of
    /// [`Grant::percents`] when those are given.
    pub percent: u64,
    /// Its GPUs' UUIDs.
    pub gpus: Vec<String>,
    /// Its percent of each GPU, in the order of `gpus` (1–100; 100: that GPU is
    /// not held), when its shares of its GPUs differ; empty: `percent` on each.
    pub percents: Vec<u64>,
}

/// One sample of one process's use of one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// The process, in the host's PID namespace.
    pub pid: u32,
    /// When it was taken (µs; only differences are used).
    pub timestamp_us: u64,
    /// The percent of the sample's period the process had work on the GPU.
    pub sm_percent: u32,
}

/// Why a grant, a sample or a freeze failed.
#[derive(Debug, thiserror::Error)]
pub enum ThrottleError {
    /// A value that cannot be a grant (it names what was wrong).
    #[error("GPU-time grant: {0}")]
    Grant(String),
    /// A grant file could not be written, read or removed.
    #[error("GPU-time grant file {path}: {source}")]
    File {
        path: PathBuf,
        source: std::io::Error,
    },
    /// NVML could not be loaded or answered with an error.
    #[error("GPU {uuid}: NVML: {reason}")]
    Nvml { uuid: String, reason: String },
}

/// The driver's per-process utilization of a GPU.
pub trait GpuTime: Send {
    /// The samples of `uuid` taken after `since_us` (none when no process ran).
    fn samples(&mut self, uuid: &str, since_us: u64) -> Result<Vec<Sample>, ThrottleError>;

    /// The processes with a context on `uuid` now: looked up while they live, so
    /// that one gone before its samples arrive is still charged to its container.
    fn running(&mut self, _uuid: &str) -> Result<Vec<u32>, ThrottleError> {
        Ok(Vec::new())
    }
}

/// Where a process runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessCgroup {
    /// The container ID its cgroup is named after.
    pub container_id: String,
    /// The cgroup's v2 directory.
    pub dir: PathBuf,
}

/// Where a process was found to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// In this container's cgroup.
    Container(ProcessCgroup),
    /// In no container's cgroup (a process of the node).
    NotContainer,
    /// Gone: where it ran cannot be read any more.
    Gone,
}

/// Finds a process's container cgroup.
pub trait Processes: Send {
    /// Where process `pid` runs.
    fn cgroup(&self, pid: u32) -> Lookup;

    /// When process `pid` started (in clock ticks since boot, as `/proc/<pid>/stat`
    /// gives it), which tells it from a later process given the same pid; `None`
    /// when it cannot be read.
    fn start_time(&self, _pid: u32) -> Option<u64> {
        None
    }
}

/// Freezes and thaws cgroups.
pub trait Freezer: Send {
    /// Sets the cgroup at `dir` frozen or thawed.
    fn set(&self, dir: &Path, frozen: bool) -> std::io::Result<()>;
}

mod account;
mod grant;
mod host;
use account::*;
pub use host::*;

/// A granted container's state, for `tessera inspect`-like reports and tests.
#[derive(Debug, Clone, PartialEq)]
pub struct AccountView {
    /// The container ID.
    pub container_id: String,
    /// Its share.
    pub percent: u64,
    /// Frozen now.
    pub frozen: bool,
    /// Seconds spent frozen.
    pub frozen_seconds: f64,
    /// Its lowest credit among its GPUs (seconds).
    pub credit: f64,
}

/// Holds granted containers to their share of GPU time; see the module docs.
///
/// A round is [`Throttle::wanted`], then [`sample`] (the driver's samples of those
/// GPUs and the processes on them), then [`Throttle::seen`] and
/// [`Throttle::apply`]: the sampling needs no `&mut Throttle`, so a caller
/// sharing it behind a lock samples without holding it, and a slow driver never
/// holds up a release. [`Throttle::tick`] does it all at once.
pub struct Throttle {
    dir: PathBuf,
    processes: Box<dyn Processes>,
    freezer: Box<dyn Freezer>,
    accounts: BTreeMap<String, Account>,
    sampling: HashMap<String, GpuSampling>,
    /// pid → its container cgroup (None: not a container's), when it was looked
    /// up and when it was last seen (s).
    pid_cache: HashMap<u32, (Option<ProcessCgroup>, f64, f64)>,
    last_tick: Option<f64>,
    /// Set by [`Throttle::thaw_all`]: no round freezes anything after it.
    stopped: bool,
    /// GPUs whose sampling failed, warned about once.
    failing: std::collections::HashSet<String>,
    /// Freezes made, and seconds spent frozen, since the start (all accounts).
    freezes: u64,
    frozen_seconds: f64,
}

/// What a throttle holds now and has done since its start.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Totals {
    /// Containers held.
    pub held: usize,
    /// Of those, frozen now.
    pub frozen: usize,
    /// Freezes made.
    pub freezes: u64,
    /// Seconds containers spent frozen, added up.
    pub frozen_seconds: f64,
    /// Granted GPUs whose last sampling failed: their containers are not held.
    pub unsampled_gpus: usize,
}

impl std::fmt::Debug for Throttle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Throttle")
            .field("dir", &self.dir)
            .field("accounts", &self.accounts)
            .finish_non_exhaustive()
    }
}

/// How long a process's container is trusted before it is looked up again (a
/// pid can be reused by another process).
const PID_LOOKUP_SECONDS: f64 = 5.0;

/// The grants in `dir`, read at start: each valid one with the cgroup it
/// recorded. Unreadable or invalid files are removed (a torn write cannot be one:
/// files are written whole), each with a warning.
/// The cgroup a grant file that is not one still names, when it is the file's
/// container's: it may be frozen, and nothing else would thaw it.
fn orphan_cgroup(name: &str, text: &str) -> Option<PathBuf> {
    let (_, container_id) = name.split_once('_')?;
    let dir = PathBuf::from(text.lines().find_map(|l| l.strip_prefix("cgroup="))?);
    (dir.is_absolute()
        && !dir
            .components()
            .any(|c| c == std::path::Component::ParentDir)
        && container_id_of(&dir).as_deref() == Some(container_id))
    .then_some(dir)
}

/// Thaws the cgroup a removed grant file named (see [`orphan_cgroup`]).
fn thaw_orphan(name: &str, text: &str, freezer: &dyn Freezer) {
    if let Some(dir) = orphan_cgroup(name, text)
        && let Err(error) = freezer.set(&dir, false)
        && error.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(cgroup = %dir.display(), %error, "could not thaw the cgroup of a GPU-time grant file that is not one");
    }
}

fn read_grants(dir: &Path, freezer: &dyn Freezer) -> Vec<(Grant, Option<PathBuf>)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut grants = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if name.starts_with('.') {
            // A write that never got renamed.
            let _ = std::fs::remove_file(&path);
            continue;
        }
        let text = std::fs::read_to_string(&path).map_err(|e| e.to_string());
        match text
            .as_ref()
            .map_err(Clone::clone)
            .and_then(|text| Grant::from_file(&name, text).map_err(|e| e.to_string()))
        {
            Ok(grant) => grants.push(grant),
            Err(error) => {
                tracing::warn!(file = %path.display(), %error, "GPU-time grant file ignored and removed");
                if let Ok(text) = &text {
                    thaw_orphan(&name, text, freezer);
                }
                let _ = std::fs::remove_file(&path);
            }
        }
    }
    grants
}

/// What a round asks of the driver for the `wanted` GPUs: their new samples, and
/// the processes running on them (a GPU whose list fails lists none).
pub fn sample(gpu: &mut dyn GpuTime, wanted: Vec<(String, u64)>) -> (Vec<GpuSamples>, Vec<u32>) {
    let mut running = Vec::new();
    let samples = wanted
        .into_iter()
        .map(|(uuid, since)| {
            running.extend(gpu.running(&uuid).unwrap_or_default());
            let result = gpu.samples(&uuid, since);
            (uuid, result)
        })
        .collect();
    (samples, running)
}

/// One GPU's samples for a round, or why there are none.
pub type GpuSamples = (String, Result<Vec<Sample>, ThrottleError>);

/// Thaws the cgroups the grants in `dir` name and removes the grants: for a
/// node where GPU time is off now but was on before (a proxy that stopped with a
/// container frozen must not leave it so). Returns how many grants there were.
pub fn thaw_leftovers(dir: &Path, freezer: &dyn Freezer) -> usize {
    let grants = read_grants(dir, freezer);
    for (grant, cgroup) in &grants {
        if let Some(cgroup) = cgroup
            && let Err(error) = freezer.set(cgroup, false)
            && error.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(cgroup = %cgroup.display(), %error, "could not thaw a container GPU time held before");
        }
        let _ = std::fs::remove_file(dir.join(grant.file_name()));
    }
    grants.len()
}

impl Throttle {
    /// A throttle keeping its grants in `dir`, loading those already there (a
    /// restart) and thawing the cgroups they name: a proxy that stopped while
    /// one was frozen must not leave it so. One it cannot thaw now is counted as
    /// frozen, so that every round tries again.
    pub fn open(
        dir: PathBuf,
        processes: Box<dyn Processes>,
        freezer: Box<dyn Freezer>,
    ) -> Result<Self, ThrottleError> {
        std::fs::create_dir_all(&dir).map_err(|source| ThrottleError::File {
            path: dir.clone(),
            source,
        })?;
        let mut accounts = BTreeMap::new();
        for (grant, cgroup) in read_grants(&dir, freezer.as_ref()) {
            let mut account = Account::new(grant, cgroup);
            if let Some(cgroup) = &account.cgroup {
                match freezer.set(cgroup, false) {
                    Ok(()) => {}
                    Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                        account.cgroup = None;
                    }
                    Err(error) => {
                        tracing::warn!(cgroup = %cgroup.display(), %error, "could not thaw a granted container's cgroup at start; trying again every round");
                        account.frozen = true;
                    }
                }
            }
            accounts.insert(account.grant.container_id.clone(), account);
        }
        Ok(Self {
            dir,
            processes,
            freezer,
            accounts,
            sampling: HashMap::new(),
            pid_cache: HashMap::new(),
            last_tick: None,
            stopped: false,
            failing: std::collections::HashSet::new(),
            freezes: 0,
            frozen_seconds: 0.0,
        })
    }

    /// Holds a container to `grant` from now on (its file written first);
    /// whether it was not held before. A container already held keeps its cgroup
    /// and its state: a grant must never lose track of a frozen cgroup.
    pub fn grant(&mut self, grant: Grant) -> Result<bool, ThrottleError> {
        let grant = grant.check()?;
        let previous = self.accounts.remove(&grant.container_id);
        let cgroup = previous.as_ref().and_then(|a| a.cgroup.clone());
        let file = self.dir.join(grant.file_name());
        if let Err(source) = write_whole(&file, &grant.to_text(cgroup.as_deref())) {
            if let Some(previous) = previous {
                self.accounts
                    .insert(previous.grant.container_id.clone(), previous);
            }
            return Err(ThrottleError::File { path: file, source });
        }
        let mut account = Account::new(grant, cgroup);
        account.frozen = previous.as_ref().is_some_and(|p| p.frozen);
        self.accounts
            .insert(account.grant.container_id.clone(), account);
        Ok(previous.is_none())
    }

    /// Stops holding a container (it is stopping: a frozen one could not take its
    /// signal), thawing it if frozen. Returns whether it was held.
    pub fn release(&mut self, container_id: &str) -> bool {
        let Some(account) = self.accounts.remove(container_id) else {
            return false;
        };
        self.forget(account);
        true
    }

    /// Stops holding every container of a pod; returns how many were held.
    pub fn release_pod(&mut self, pod_uid: &str) -> usize {
        let ids: Vec<String> = self
            .accounts
            .values()
            .filter(|a| a.grant.pod_uid == pod_uid)
            .map(|a| a.grant.container_id.clone())
            .collect();
        for id in &ids {
            self.release(id);
        }
        ids.len()
    }

    /// The pods whose containers are held.
    pub fn pods(&self) -> Vec<String> {
        let mut pods: Vec<String> = self
            .accounts
            .values()
            .map(|a| a.grant.pod_uid.clone())
            .collect();
        pods.sort();
        pods.dedup();
        pods
    }

    /// Thaws every frozen container and freezes none after (the proxy is
    /// stopping); grants stay, for the next start.
    pub fn thaw_all(&mut self) {
        self.stopped = true;
        let frozen: Vec<(String, PathBuf)> = self
            .accounts
            .values()
            .filter(|a| a.frozen)
            .filter_map(|a| Some((a.grant.container_id.clone(), a.cgroup.clone()?)))
            .collect();
        for (id, dir) in frozen {
            self.set_frozen(&id, &dir, false);
        }
    }

    fn forget(&self, account: Account) {
        if account.frozen
            && let Some(dir) = &account.cgroup
            && let Err(error) = self.freezer.set(dir, false)
            && error.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(container = %account.grant.container_id, %error, "could not thaw a released container");
        }
        let file = self.dir.join(account.grant.file_name());
        if let Err(error) = std::fs::remove_file(&file)
            && error.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(file = %file.display(), %error, "GPU-time grant file not removed");
        }
    }

    /// The granted containers' states.
    pub fn accounts(&self) -> Vec<AccountView> {
        self.accounts
            .values()
            .map(|a| AccountView {
                container_id: a.grant.container_id.clone(),
                percent: a.grant.percent,
                frozen: a.frozen,
                frozen_seconds: a.frozen_seconds,
                credit: a.credit.values().copied().fold(f64::INFINITY, f64::min),
            })
            .collect()
    }

    /// What it holds now and has done since its start.
    pub fn totals(&self) -> Totals {
        Totals {
            held: self.accounts.len(),
            frozen: self.accounts.values().filter(|a| a.frozen).count(),
            freezes: self.freezes,
            frozen_seconds: self.frozen_seconds,
            unsampled_gpus: self.failing.len(),
        }
    }

    /// The GPUs the next round samples, each with the time of its newest sample
    /// seen (µs; 0: none yet). A clock stepped back by more than a second starts
    /// the GPU's sampling over: NVML's timestamps are the wall clock's, and no
    /// sample would otherwise be newer than the last one seen until it caught up.
    pub fn wanted(&mut self) -> Vec<(String, u64)> {
        let wall_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
        let mut gpus: Vec<String> = self
            .accounts
            .values()
            .flat_map(|a| a.grant.gpus.iter().cloned())
            .collect();
        gpus.sort();
        gpus.dedup();
        self.sampling.retain(|uuid, _| gpus.contains(uuid));
        gpus.into_iter()
            .map(|uuid| {
                let sampling = self.sampling.entry(uuid.clone()).or_default();
                if sampling.last_us > wall_us.saturating_add(1_000_000) {
                    tracing::warn!(gpu = %uuid, "the clock went back: GPU-time sampling starts over");
                    *sampling = GpuSampling::default();
                }
                (uuid, sampling.last_us)
            })
            .collect()
    }

    /// One round at `now` (seconds, monotonic) with the samples of the GPUs
    /// [`Throttle::wanted`] named: charge each granted container's, refill its
    /// buckets for the time passed, and freeze or thaw it.
    pub fn apply(&mut self, now: f64, samples: Vec<GpuSamples>) {
        let elapsed = self
            .last_tick
            .map_or(0.0, |last| (now - last).clamp(0.0, MAX_SAMPLE_GAP_SECONDS));
        self.last_tick = Some(now);
        for (uuid, result) in samples {
            match result {
                Ok(samples) => {
                    self.failing.remove(&uuid);
                    self.charge(&uuid, samples, now);
                }
                Err(error) => {
                    // Unsampled, a GPU's containers are not held: say so once.
                    if self.failing.insert(uuid.clone()) {
                        tracing::warn!(gpu = %uuid, %error, "GPU time cannot be sampled: its shared containers are not held while this lasts");
                    } else {
                        tracing::debug!(gpu = %uuid, %error, "no GPU-time samples");
                    }
                }
            }
        }
        self.pid_cache
            .retain(|_, (_, _, seen)| now - *seen < PID_CACHE_SECONDS);

        let mut changes = Vec::new();
        for account in self.accounts.values_mut() {
            for (uuid, credit) in account.credit.iter_mut() {
                let rate = account.grant.percent_on(uuid) as f64 / 100.0;
                *credit = (*credit + rate * elapsed).min(BURST_SECONDS);
            }
            if account.frozen {
                account.frozen_seconds += elapsed;
                self.frozen_seconds += elapsed;
            }
            let owes = account.owes() && !self.stopped;
            if owes != account.frozen
                && let Some(dir) = &account.cgroup
            {
                changes.push((account.grant.container_id.clone(), dir.clone(), owes));
            }
        }
        for (id, dir, frozen) in changes {
            self.set_frozen(&id, &dir, frozen);
        }
    }

    /// A whole round with `gpu` sampled in it.
    pub fn tick(&mut self, now: f64, gpu: &mut dyn GpuTime) {
        let (samples, running) = sample(gpu, self.wanted());
        self.seen(&running, now);
        self.apply(now, samples);
    }

    fn set_frozen(&mut self, id: &str, dir: &Path, frozen: bool) {
        match self.freezer.set(dir, frozen) {
            Ok(()) => {
                if let Some(account) = self.accounts.get_mut(id) {
                    account.frozen = frozen;
                }
                self.freezes += u64::from(frozen);
                tracing::debug!(container = %id, frozen, "GPU-time share");
            }
            // The cgroup is gone (the container exited): nothing is frozen, and
            // its next process's cgroup is learned from its samples.
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                if let Some(account) = self.accounts.get_mut(id) {
                    account.frozen = false;
                    account.cgroup = None;
                }
            }
            Err(error) => {
                tracing::warn!(container = %id, cgroup = %dir.display(), frozen, %error, "could not freeze or thaw a container held to its GPU time");
            }
        }
    }

    /// The container cgroup of process `pid`, looked up again once the last
    /// lookup is [`PID_LOOKUP_SECONDS`] old. A process gone since it was looked
    /// up keeps its container: its last samples come after it ended.
    fn cgroup_of(&mut self, pid: u32, now: f64) -> Option<ProcessCgroup> {
        if let Some((cgroup, looked_up, seen)) = self.pid_cache.get_mut(&pid)
            && now - *looked_up < PID_LOOKUP_SECONDS
        {
            *seen = now;
            return cgroup.clone();
        }
        let cgroup = match self.processes.cgroup(pid) {
            Lookup::Container(cgroup) => Some(cgroup),
            Lookup::NotContainer => None,
            Lookup::Gone => match self.pid_cache.get(&pid) {
                Some((known, _, _)) => known.clone(),
                None => None,
            },
        };
        self.pid_cache.insert(pid, (cgroup.clone(), now, now));
        cgroup
    }

    /// Looks up processes with a context on a granted GPU while they live (the
    /// driver's list of them; see [`GpuTime::running`]).
    pub fn seen(&mut self, pids: &[u32], now: f64) {
        for pid in pids {
            self.cgroup_of(*pid, now);
        }
    }

    /// Charges `samples` of GPU `uuid` to the containers they belong to.
    ///
    /// The driver samples the whole GPU at instants one sampling period apart
    /// (0.2 s on an H100, driver 580), and gives each process that held the GPU
    /// over the window before an instant its utilization there; while the GPU is
    /// idle, the process that ran last gets 0 %. Time-sliced processes take the
    /// GPU in turns, one per window (`scripts/gpu/nvml-samples-probe.py`,
    /// docs/gpu-runs/h100-2026-11-27c/). So a sample is charged its window (the
    /// time since the GPU's previous instant, at most one period) at its
    /// utilization, never the time since its own process's previous sample, which
    /// would charge a process for the windows the other tenant held. A GPU's time
    /// is one: when the charges of one instant add up to more than its window
    /// (processes reported busy at once), each is scaled down to its part.
    fn charge(&mut self, uuid: &str, mut samples: Vec<Sample>, now: f64) {
        samples.sort_by_key(|s| s.timestamp_us);
        let sampling = self.sampling.entry(uuid.to_owned()).or_default();
        let since = sampling.last_us;
        // (pid, seconds of the whole GPU it used).
        let mut used: Vec<(u32, f64)> = Vec::with_capacity(samples.len());
        // NVML answers with samples after `since`; one that is not is old.
        samples.retain(|s| s.timestamp_us > since && s.pid != 0);
        let mut rest = samples.as_slice();
        while let Some(first) = rest.first() {
            let size = rest
                .iter()
                .take_while(|s| s.timestamp_us - first.timestamp_us <= INSTANT_US)
                .count();
            let (instant, next) = rest.split_at(size);
            rest = next;
            let at = instant
                .last()
                .map_or(first.timestamp_us, |s| s.timestamp_us);
            // Nothing before the very first instant: its window is unknown.
            let gap = at.saturating_sub(sampling.last_us);
            let window = if sampling.last_us == 0 {
                0.0
            } else if gap <= INSTANT_US {
                // More of the newest instant, read a round later: its window.
                sampling.last_window
            } else {
                sampling.gaps.push_back(gap);
                if sampling.gaps.len() > GAPS_KEPT {
                    sampling.gaps.pop_front();
                }
                let period = sampling.period_us().unwrap_or(FIRST_PERIOD_US);
                (gap.min(period) as f64 / 1e6).min(MAX_SAMPLE_GAP_SECONDS)
            };
            sampling.last_window = window;
            sampling.last_us = sampling.last_us.max(at);
            let busy: f64 = instant
                .iter()
                .map(|s| f64::from(s.sm_percent.min(100)) / 100.0)
                .sum();
            let scale = if busy > 1.0 { 1.0 / busy } else { 1.0 };
            used.extend(instant.iter().map(|s| {
                (
                    s.pid,
                    window * f64::from(s.sm_percent.min(100)) / 100.0 * scale,
                )
            }));
        }
        for (pid, seconds) in used {
            let Some(cgroup) = self.cgroup_of(pid, now) else {
                continue;
            };
            let Some(account) = self.accounts.get_mut(&cgroup.container_id) else {
                continue;
            };
            if account.cgroup.as_ref() != Some(&cgroup.dir) {
                // Kept with the grant first, so that a restarted proxy can thaw
                // it: a cgroup not on record is never frozen.
                let file = self.dir.join(account.grant.file_name());
                match write_whole(&file, &account.grant.to_text(Some(&cgroup.dir))) {
                    Ok(()) => {
                        let old = account.cgroup.replace(cgroup.dir.clone());
                        if account.frozen
                            && let Some(old) = old
                        {
                            // Its old cgroup is not its now: thaw it, and let the
                            // next round freeze the new one if it still owes.
                            let _ = self.freezer.set(&old, false);
                            account.frozen = false;
                        }
                    }
                    Err(error) => {
                        tracing::warn!(file = %file.display(), %error, "GPU-time grant file not updated: the container is not held until it is");
                    }
                }
            }
            if let Some(credit) = account.credit.get_mut(uuid) {
                *credit -= seconds;
            }
        }
    }
}

#[cfg(test)]
mod tests;
