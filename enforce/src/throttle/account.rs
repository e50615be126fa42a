//! What the throttle keeps per granted container and per GPU between samples.

use super::*;

/// One granted container's account.
#[derive(Debug)]
pub(super) struct Account {
    pub(super) grant: Grant,
    /// Seconds of each GPU it may still use (below zero: owed).
    pub(super) credit: BTreeMap<String, f64>,
    /// Its cgroup, once one of its processes was seen on a GPU.
    pub(super) cgroup: Option<PathBuf>,
    pub(super) frozen: bool,
    /// Seconds spent frozen, all told.
    pub(super) frozen_seconds: f64,
}

impl Account {
    pub(super) fn new(grant: Grant, cgroup: Option<PathBuf>) -> Self {
        // A GPU it may use whole is not held (and never owed on).
        let credit = grant
            .gpus
            .iter()
            .filter(|g| grant.percent_on(g) < 100)
            .map(|g| (g.clone(), 0.0))
            .collect();
        Self {
            grant,
            credit,
            cgroup,
            frozen: false,
            frozen_seconds: 0.0,
        }
    }

    pub(super) fn owes(&self) -> bool {
        self.credit.values().any(|c| *c < 0.0)
    }
}

/// Samples within this of an instant's first are of that instant: the driver
/// samples the whole GPU at once, and its period is 1/6 s or more (NVML's
/// documentation), so samples this close can only be stamped apart within one.
pub(super) const INSTANT_US: u64 = 50_000;
/// How many gaps between instants estimate the driver's sampling period.
pub(super) const GAPS_KEPT: usize = 16;
/// The gaps needed before they are trusted as the period; until then a window is
/// at most [`FIRST_PERIOD_US`] (an idle stretch before the first samples must not
/// be charged as use).
pub(super) const GAPS_TRUSTED: usize = 4;
/// The longest window charged before the period is known: the H100's (driver 580).
pub(super) const FIRST_PERIOD_US: u64 = 200_000;

/// What one GPU's sampling remembers.
#[derive(Debug, Default)]
pub(super) struct GpuSampling {
    /// The newest sampling instant's time.
    pub(super) last_us: u64,
    /// The latest gaps between instants, newest last.
    pub(super) gaps: std::collections::VecDeque<u64>,
    /// The window of the newest instant, in seconds.
    pub(super) last_window: f64,
}

impl GpuSampling {
    /// The driver's sampling period, as the gaps between its instants show it:
    /// their lower quartile, so that a stretch with no sample (a stalled sampler)
    /// does not lengthen it.
    pub(super) fn period_us(&self) -> Option<u64> {
        if self.gaps.len() < GAPS_TRUSTED {
            return None;
        }
        let mut gaps: Vec<u64> = self.gaps.iter().copied().collect();
        gaps.sort_unstable();
        gaps.get(gaps.len() / 4).copied()
    }
}
