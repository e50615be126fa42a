//! Preemption: the fewest pods to evict on a node so that a pod's GPU shares fit.

use super::*;

// === Preemption: victims per GPU ===

/// A running pod holding GPU shares on a node, as preemption sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuHolder {
    /// The pod's UID (kube-scheduler names victims by it).
    pub uid: String,
    /// Its `spec.priority`.
    pub priority: i32,
    /// What it books on each GPU.
    pub placement: Placement,
}

/// Why no eviction on a node makes room for a preemptor's GPUs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no eviction of lower-priority pods makes room: {reason}")]
pub struct NoVictims {
    /// The allocator's reason, with every lower-priority pod gone.
    pub reason: String,
}

/// The preemptor's GPU set on one node and whom it must evict there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct VictimSet {
    /// Indices into the holders, in the order of [`reprieve_order`].
    victims: Vec<usize>,
    /// kube-scheduler's ranking of a candidate node: the highest victim priority,
    /// the sum of victim priorities (each shifted to be positive), the count.
    rank: (i64, i64, usize),
}

/// The node with `placement`'s use taken off (`add` false) or put back.
pub(super) fn with_holder(node: &mut NodeState, holder: &GpuHolder, add: bool) {
    account(node, &holder.placement, add);
}

/// `node` with every GPU outside `set` unusable: a fit on it is a fit on `set`.
pub(super) fn only_gpus(node: &NodeState, set: &[String]) -> NodeState {
    let mut node = node.clone();
    for gpu in &mut node.gpus {
        if !set.contains(&gpu.uuid) {
            // Legacy is the one flag [`as_selected`] leaves as it is.
            gpu.legacy = true;
        }
    }
    node
}

/// Whether `holder` books anything on a GPU of `set`.
pub(super) fn touches(holder: &GpuHolder, set: &[String]) -> bool {
    holder.placement.gpus.iter().any(|s| set.contains(&s.uuid))
}

/// What `holder` books on `set`, as a fraction of GPUs (compute + memory).
pub(super) fn size_on(holder: &GpuHolder, node: &NodeState, set: &[String]) -> f64 {
    holder
        .placement
        .gpus
        .iter()
        .filter(|s| set.contains(&s.uuid))
        .map(|s| {
            let total = node
                .gpus
                .iter()
                .find(|g| g.uuid == s.uuid)
                .map_or(1, |g| g.memory_total.max(1));
            s.core as f64 / 100.0 + s.memory as f64 / total as f64
        })
        .sum()
}

/// The order in which victims are given back their place, as kube-scheduler's own
/// dry run does: the most important first (highest priority); among equals the
/// smallest first, so that fewer pods go; then by UID, so choices are stable.
pub(super) fn reprieve_order(
    holders: &[GpuHolder],
    node: &NodeState,
    set: &[String],
    of: &mut [usize],
) {
    of.sort_by(|&a, &b| {
        holders[b]
            .priority
            .cmp(&holders[a].priority)
            .then(size_on(&holders[a], node, set).total_cmp(&size_on(&holders[b], node, set)))
            .then(holders[a].uid.cmp(&holders[b].uid))
    });
}

/// The fewest, least important victims among `holders` that make room for the
/// pod on the GPUs of `set`, or `None` when evicting them all does not.
pub(super) fn victims_on(
    node: &NodeState,
    holders: &[GpuHolder],
    lower: &[usize],
    set: &[String],
    request: &PodGpuRequest,
    policy: Policy,
) -> Option<VictimSet> {
    let mut candidates: Vec<usize> = lower
        .iter()
        .copied()
        .filter(|&i| touches(&holders[i], set))
        .collect();
    let mut work = node.clone();
    for &i in &candidates {
        with_holder(&mut work, &holders[i], false);
    }
    if !fits_pod(&only_gpus(&work, set), request, policy) {
        return None;
    }
    reprieve_order(holders, node, set, &mut candidates);
    let mut victims = Vec::new();
    for i in candidates {
        with_holder(&mut work, &holders[i], true);
        if !fits_pod(&only_gpus(&work, set), request, policy) {
            with_holder(&mut work, &holders[i], false);
            victims.push(i);
        }
    }
    let shifted = |i: &usize| i64::from(holders[*i].priority) + i64::from(i32::MAX) + 1;
    let rank = (
        victims
            .iter()
            .map(|&i| i64::from(holders[i].priority))
            .max()
            .unwrap_or(i64::MIN),
        victims.iter().map(shifted).sum(),
        victims.len(),
    );
    Some(VictimSet { victims, rank })
}

/// Which running GPU pods of `node` must go so that the pod (of `priority`) gets
/// its GPUs there: empty when it fits now, else the set kube-scheduler would rank
/// best (lowest highest victim priority, then lowest sum, then fewest) among the
/// GPU sets tried — each single GPU, and the GPUs the allocator picks with every
/// lower-priority pod gone (the pod's set when it needs several GPUs). Only pods
/// of lower priority that book a GPU of the chosen set are ever victims; each is
/// kept when the pod fits with it back (most important first). Returns UIDs, the
/// most important first (kube-scheduler reads the first as the highest priority).
/// Reservations already applied to `node` (binds in flight, tentative choices)
/// stay: they are not running pods.
pub fn gpu_victims(
    node: &NodeState,
    holders: &[GpuHolder],
    request: &PodGpuRequest,
    priority: i32,
    policy: Policy,
) -> Result<Vec<String>, NoVictims> {
    if fits_pod(node, request, policy) {
        return Ok(Vec::new());
    }
    let lower: Vec<usize> = (0..holders.len())
        .filter(|&i| holders[i].priority < priority)
        .collect();
    let mut emptied = node.clone();
    for &i in &lower {
        with_holder(&mut emptied, &holders[i], false);
    }
    let picked = allocate_pod(&emptied, request, policy).map_err(|reason| NoVictims {
        reason: reason.to_string(),
    })?;
    let mut sets: Vec<Vec<String>> = vec![picked.booked.gpus.into_iter().map(|s| s.uuid).collect()];
    // With a scope, each place's own set too: the allocator picks one place, and
    // another may cost less to empty.
    if request.selection.scope.is_some() {
        for view in views(&emptied, request) {
            if let Ok(placed) = allocate_pod_on(&view, request, gpu_policy_of(request, policy)) {
                let set: Vec<String> = placed.booked.gpus.into_iter().map(|s| s.uuid).collect();
                if !sets.contains(&set) {
                    sets.push(set);
                }
            }
        }
    }
    for gpu in &node.gpus {
        let single = vec![gpu.uuid.clone()];
        if !sets.contains(&single) {
            sets.push(single);
        }
    }
    let mut best: Option<VictimSet> = None;
    for set in &sets {
        if let Some(found) = victims_on(node, holders, &lower, set, request, policy) {
            if best.as_ref().is_none_or(|b| found.rank < b.rank) {
                best = Some(found);
            }
        }
    }
    // The allocator's own set always fits on the emptied node, so `best` is set.
    let best = best.ok_or_else(|| NoVictims {
        reason: "no GPU set fits with its lower-priority pods gone".into(),
    })?;
    Ok(best
        .victims
        .into_iter()
        .map(|i| holders[i].uid.clone())
        .collect())
}

/// What kube-scheduler's dry run chose to evict on a node, and what Tessera knows
/// of those pods there.
#[derive(Clone, Copy)]
pub struct DryRun<'a> {
    /// The dry run's victims (UIDs), most important first.
    pub victims: &'a [String],
    /// Whether a pod holds GPU shares of the node (Tessera's) or GPUs through the
    /// device plugin: such pods are victims only where Tessera chose them.
    pub holds_gpus: &'a dyn Fn(&str) -> bool,
    /// A pod's priority, where the watch has shown it.
    pub priority: &'a dyn Fn(&str) -> Option<i32>,
}

impl std::fmt::Debug for DryRun<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DryRun")
            .field("victims", &self.victims)
            .finish_non_exhaustive()
    }
}

/// The victims to answer kube-scheduler with on one node: the GPU victims Tessera
/// chose ([`gpu_victims`]) and those of the dry run's that hold no GPU there (it
/// chose them for what it counts itself: CPU, memory, ports…). Pods holding GPUs
/// the dry run chose are dropped (on a GPU the pod will not use, or given their
/// place back). `None` when the answer would name no victim: kube-scheduler
/// refuses an empty set, and then nothing needs to go for the GPUs either.
/// Ordered most important first, the dry run's order breaking ties.
pub fn node_victims(dry_run: DryRun<'_>, gpu: Vec<String>) -> Option<Vec<String>> {
    let mut victims: Vec<String> = dry_run
        .victims
        .iter()
        .filter(|uid| !(dry_run.holds_gpus)(uid))
        .cloned()
        .collect();
    for uid in gpu {
        if !victims.contains(&uid) {
            victims.push(uid);
        }
    }
    if victims.is_empty() {
        return None;
    }
    // Stable: among equal (or unknown, counted lowest) priorities the order stays.
    victims
        .sort_by_key(|uid| std::cmp::Reverse((dry_run.priority)(uid).map_or(i64::MIN, i64::from)));
    Some(victims)
}
