//! One container's share on one node: whether it fits, which GPUs it takes by
//! the policy, how a node scores, and the accounting of a placement.

use super::*;

/// What `request` takes of one GPU: compute, memory bytes, memory percent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Take {
    pub(super) core: u64,
    pub(super) memory: u64,
    pub(super) ratio: u64,
}

/// What `request` takes of `gpu`, when it fits. No allocation: this runs for
/// every GPU of every candidate node.
pub(super) fn take(gpu: &GpuState, request: &GpuRequest) -> Option<Take> {
    take_load(&gpu.load(), request)
}

/// [`take`] from the GPU's load.
pub(super) fn take_load(gpu: &GpuLoad, request: &GpuRequest) -> Option<Take> {
    if !gpu.open || gpu.memory_total == 0 {
        return None;
    }
    let (memory, ratio) = match request.memory {
        GpuMemory::None => (0, 0),
        GpuMemory::Bytes(bytes) => (bytes, percent_of(bytes, gpu.memory_total)),
        GpuMemory::Ratio(ratio) => (share_of(gpu.memory_total, ratio), ratio),
    };
    if request.is_whole() && (gpu.core_used > 0 || gpu.memory_used > 0) {
        return None;
    }
    (request.core <= gpu.free_core() && memory <= gpu.free_memory()).then_some(Take {
        core: request.core,
        memory,
        ratio,
    })
}

pub(super) fn to_share(gpu: &GpuState, take: Take) -> GpuShare {
    GpuShare {
        uuid: gpu.uuid.clone(),
        minor: gpu.minor,
        core: take.core,
        memory: take.memory,
        ratio: take.ratio,
    }
}

/// Whether `request` fits on `node` (cheaper than [`allocate`]: a group of
/// `count` fitting GPUs always exists once `count` GPUs fit).
pub fn fits(node: &NodeState, request: &GpuRequest) -> bool {
    fits_in(node.gpus.iter().map(GpuState::load), request)
}

/// [`fits`] over the GPUs' loads.
pub(super) fn fits_in(gpus: impl Iterator<Item = GpuLoad>, request: &GpuRequest) -> bool {
    let needed = request.count as usize;
    needed > 0
        && gpus
            .filter(|g| take_load(g, request).is_some())
            .take(needed)
            .count()
            == needed
}

/// How full the GPU would be after `take`, 0..=2 (compute + memory fractions).
pub(super) fn fullness_after(gpu: &GpuState, take: Take) -> f64 {
    fullness_after_load(&gpu.load(), take)
}

/// [`fullness_after`] from the GPU's load.
pub(super) fn fullness_after_load(gpu: &GpuLoad, take: Take) -> f64 {
    let core = (gpu.core_used + take.core) as f64 / 100.0;
    let memory = (gpu.memory_used + take.memory) as f64 / gpu.memory_total.max(1) as f64;
    core + memory
}

pub(super) fn affinity(a: &GpuState, b: &GpuState) -> u32 {
    if a.nvlink_peers.contains(&b.uuid) || b.nvlink_peers.contains(&a.uuid) {
        3
    } else if !a.pcie.is_empty() && a.pcie == b.pcie {
        2
    } else if a.numa >= 0 && a.numa == b.numa {
        1
    } else {
        0
    }
}

/// Why a node cannot take a request: how many of its usable GPUs could hold
/// what was asked (and what holds the unusable ones), what was asked, and what
/// the freest usable GPU has free, so that the reader can act on it.
pub fn unfit_reason(node: &NodeState, request: &GpuRequest) -> Unfit {
    if node.gpus.is_empty() {
        return Unfit::NoGpus;
    }
    let usable: Vec<&GpuState> = node.gpus.iter().filter(|g| g.usable()).collect();
    let fitting = usable.iter().filter(|g| take(g, request).is_some()).count();
    let count = |pick: fn(&GpuState) -> bool| node.gpus.iter().filter(|g| pick(g)).count();
    // The freest: the most free compute and memory together, as a fraction of each.
    let freest = usable
        .iter()
        .map(|g| {
            let memory_free = g.memory_total.saturating_sub(g.memory_used);
            let core_free = 100u64.saturating_sub(g.core_used);
            let room = core_free as f64 / 100.0 + memory_free as f64 / g.memory_total.max(1) as f64;
            (room, core_free, memory_free, g.memory_total)
        })
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, core, memory, total)| (core, memory, total));
    Unfit::NoRoom(Box::new(NoRoom {
        fitting,
        usable: usable.len(),
        total: node.gpus.len(),
        legacy: count(|g| g.legacy),
        unhealthy: count(|g| !g.healthy && !g.legacy),
        asked: asked(request),
        needed: request.count,
        freest,
    }))
}

/// What one GPU of `request` asks, in words: `50% compute and 50% memory`,
/// `30% compute and 8.0 GiB`, or `8.0 GiB of memory` (a share with no compute).
pub(super) fn asked(request: &GpuRequest) -> String {
    match (request.core, request.memory) {
        (0, GpuMemory::Bytes(bytes)) => format!("{} of memory", gib_text(bytes)),
        (0, GpuMemory::Ratio(ratio)) => format!("{ratio}% memory"),
        (core, GpuMemory::Bytes(bytes)) => format!("{core}% compute and {}", gib_text(bytes)),
        (core, GpuMemory::Ratio(ratio)) => format!("{core}% compute and {ratio}% memory"),
        (core, GpuMemory::None) => format!("{core}% compute"),
    }
}

/// Bytes as GiB with one decimal (`20.0 GiB`), as `tessera inspect` shows them.
pub(super) fn gib_text(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / f64::from(1u32 << 30))
}

/// Chooses GPUs for `request` on `node`, or says why it does not fit.
pub fn allocate(
    node: &NodeState,
    request: &GpuRequest,
    policy: Policy,
) -> Result<Placement, Unfit> {
    let better = |a: f64, b: f64| match policy {
        Policy::Binpack => a > b,
        Policy::Spread => a < b,
    };
    let count = request.count as usize;
    if count == 1 {
        // One GPU: a single pass, no sorting.
        let mut best: Option<(usize, Take, f64)> = None;
        for (index, gpu) in node.gpus.iter().enumerate() {
            if let Some(t) = take(gpu, request) {
                let full = fullness_after(gpu, t);
                if best.as_ref().is_none_or(|(_, _, b)| better(full, *b)) {
                    best = Some((index, t, full));
                }
            }
        }
        return match best {
            Some((index, t, _)) => Ok(Placement {
                gpus: vec![to_share(&node.gpus[index], t)],
                group: None,
            }),
            None => Err(unfit_reason(node, request)),
        };
    }
    let mut candidates: Vec<(usize, Take, f64)> = node
        .gpus
        .iter()
        .enumerate()
        .filter_map(|(index, gpu)| take(gpu, request).map(|t| (index, t, fullness_after(gpu, t))))
        .collect();
    if candidates.len() < count || count == 0 {
        return Err(unfit_reason(node, request));
    }
    // Best first by policy; the minor breaks ties so choices are stable.
    candidates.sort_by(|a, b| {
        let order = match policy {
            Policy::Binpack => b.2.total_cmp(&a.2),
            Policy::Spread => a.2.total_cmp(&b.2),
        };
        order.then(node.gpus[a.0].minor.cmp(&node.gpus[b.0].minor))
    });
    // Multi-GPU: for each anchor, grow a group by affinity (NVLink > PCIe switch >
    // NUMA), keep the group with the most affinity, then the best by policy.
    let gpu_of = |rank: usize| &node.gpus[candidates[rank].0];
    let mut best: Option<(u32, usize, Vec<usize>)> = None;
    for anchor in 0..candidates.len() {
        let mut group = vec![anchor];
        while group.len() < count {
            let next = (0..candidates.len())
                .filter(|rank| !group.contains(rank))
                .max_by(|&x, &y| {
                    let score = |rank: usize| -> u32 {
                        group
                            .iter()
                            .map(|&g| affinity(gpu_of(g), gpu_of(rank)))
                            .sum()
                    };
                    score(x).cmp(&score(y)).then(y.cmp(&x))
                });
            match next {
                Some(rank) => group.push(rank),
                None => break,
            }
        }
        let total: u32 = group
            .iter()
            .enumerate()
            .flat_map(|(i, &a)| group[i + 1..].iter().map(move |&b| (a, b)))
            .map(|(a, b)| affinity(gpu_of(a), gpu_of(b)))
            .sum();
        let rank_sum: usize = group.iter().sum();
        let wins = match &best {
            None => true,
            Some((best_total, best_ranks, _)) => {
                total > *best_total || (total == *best_total && rank_sum < *best_ranks)
            }
        };
        if wins {
            best = Some((total, rank_sum, group));
        }
    }
    let (_, _, mut group) = best.ok_or_else(|| unfit_reason(node, request))?;
    group.sort_by_key(|&rank| gpu_of(rank).minor);
    Ok(Placement {
        gpus: group
            .into_iter()
            .map(|rank| to_share(gpu_of(rank), candidates[rank].1))
            .collect(),
        group: None,
    })
}

/// The extender score 0..=10 of placing `request` on `node`, or `None` when it
/// does not fit. Same choice as [`allocate`], without building the placement.
pub fn score_request(
    node: &NodeState,
    request: &GpuRequest,
    gpu_policy: Policy,
    node_policy: Policy,
) -> Option<i64> {
    if request.count == 1 {
        return score_one(
            || node.gpus.iter().map(GpuState::load),
            request,
            gpu_policy,
            node_policy,
        );
    }
    allocate(node, request, gpu_policy)
        .ok()
        .map(|placement| score(node, &placement, node_policy))
}

/// [`score_request`] of a one-GPU request over the GPUs' loads (`gpus` gives them
/// afresh for each pass).
pub(super) fn score_one<I: Iterator<Item = GpuLoad>>(
    gpus: impl Fn() -> I,
    request: &GpuRequest,
    gpu_policy: Policy,
    node_policy: Policy,
) -> Option<i64> {
    let better = |a: f64, b: f64| match gpu_policy {
        Policy::Binpack => a > b,
        Policy::Spread => a < b,
    };
    let mut best: Option<(Take, f64)> = None;
    for gpu in gpus() {
        if let Some(t) = take_load(&gpu, request) {
            let full = fullness_after_load(&gpu, t);
            if best.as_ref().is_none_or(|(_, b)| better(full, *b)) {
                best = Some((t, full));
            }
        }
    }
    best.map(|(t, _)| score_added_in(gpus(), t.core, t.memory, node_policy))
}

/// The extender score 0..=10 of placing `request` on `node`: binpack favours the
/// node that is fullest afterwards, spread the emptiest.
pub fn score(node: &NodeState, placement: &Placement, policy: Policy) -> i64 {
    let added_core: u64 = placement.gpus.iter().map(|s| s.core).sum();
    let added_memory: u64 = placement.gpus.iter().map(|s| s.memory).sum();
    score_added(node, added_core, added_memory, policy)
}

pub(super) fn score_added(
    node: &NodeState,
    added_core: u64,
    added_memory: u64,
    policy: Policy,
) -> i64 {
    score_added_in(
        node.gpus.iter().map(GpuState::load),
        added_core,
        added_memory,
        policy,
    )
}

/// [`score_added`] over the GPUs' loads.
pub(super) fn score_added_in(
    gpus: impl Iterator<Item = GpuLoad>,
    added_core: u64,
    added_memory: u64,
    policy: Policy,
) -> i64 {
    // The node's fullness, whatever the pod's selection rules out.
    score_fullness(Fullness::of(gpus), added_core, added_memory, policy)
}

/// [`score_added`] from the node's [`Fullness`].
pub(super) fn score_fullness(
    sums: Fullness,
    added_core: u64,
    added_memory: u64,
    policy: Policy,
) -> i64 {
    let memory_total = sums.memory_total;
    let core_used = added_core + sums.core_used;
    let memory_used = added_memory + sums.memory_used;
    if sums.gpus == 0 {
        return 0;
    }
    let core_total = 100 * sums.gpus;
    let fullness = (core_used as f64 / core_total as f64
        + memory_used as f64 / memory_total.max(1) as f64)
        / 2.0;
    let fullness = fullness.clamp(0.0, 1.0);
    let value = match policy {
        Policy::Binpack => fullness,
        Policy::Spread => 1.0 - fullness,
    };
    round_small(value * 10.0)
}

/// `x.round() as i64` for 0 ≤ x < 2⁵², without a call into libm: the baseline
/// x86-64 target has no rounding instruction, and filter scores thousands of
/// nodes a call. Exact: `x` less its whole part is a float with no rounding.
pub(super) fn round_small(x: f64) -> i64 {
    let whole = x as i64;
    if x - whole as f64 >= 0.5 {
        whole + 1
    } else {
        whole
    }
}

/// `ratio` percent of `total`, rounded down, at most `u64::MAX` (a ratio far over
/// 100 must not wrap into a small take): in 64 bits when the product fits (it
/// always does for real GPUs), which spares a 128-bit division on every node
/// filter reads.
pub(super) fn share_of(total: u64, ratio: u64) -> u64 {
    match total.checked_mul(ratio) {
        Some(product) => product / 100,
        None => (u128::from(total) * u128::from(ratio) / 100)
            .try_into()
            .unwrap_or(u64::MAX),
    }
}

/// What percent of `total` `bytes` are, rounded up ([`share_of`]'s inverse).
fn percent_of(bytes: u64, total: u64) -> u64 {
    match bytes.checked_mul(100) {
        Some(product) => product.div_ceil(total),
        None => (u128::from(bytes) * 100)
            .div_ceil(u128::from(total))
            .try_into()
            .unwrap_or(u64::MAX),
    }
}

/// Adds (`sign` = 1) or removes (-1) a placement's use on the node.
pub fn account(node: &mut NodeState, placement: &Placement, add: bool) {
    let shares: BTreeMap<&str, &GpuShare> = placement
        .gpus
        .iter()
        .map(|s| (s.uuid.as_str(), s))
        .collect();
    for gpu in &mut node.gpus {
        if let Some(share) = shares.get(gpu.uuid.as_str()) {
            if add {
                gpu.core_used += share.core;
                gpu.memory_used += share.memory;
            } else {
                gpu.core_used = gpu.core_used.saturating_sub(share.core);
                gpu.memory_used = gpu.memory_used.saturating_sub(share.memory);
            }
            if let Some(group) = &placement.group {
                let pods = gpu.groups.entry(group.clone()).or_default();
                if add {
                    *pods += 1;
                } else {
                    *pods = pods.saturating_sub(1);
                }
                // The group's last pod left: the GPU is anyone's again.
                if *pods == 0 {
                    gpu.groups.remove(group);
                }
            }
        }
    }
}
