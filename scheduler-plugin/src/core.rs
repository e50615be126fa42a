//! The allocation core: per-node, per-GPU accounting and the choice of GPUs.
//! Pure: no I/O, no clocks, no locks.

use std::collections::BTreeMap;

use tessera_api::request::{GpuMemory, GpuRequest};

/// One GPU's capacity and use.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GpuState {
    /// `GPU-…`: the key of everything.
    pub uuid: String,
    /// Device minor, written into the annotation for the hook.
    pub minor: u32,
    /// Whether the reporter says it is healthy.
    pub healthy: bool,
    /// Held by a device-plugin pod (kubelet checkpoint): not ours to give.
    pub legacy: bool,
    /// Total memory in bytes.
    pub memory_total: u64,
    /// Compute percent in use (0..=100).
    pub core_used: u64,
    /// Memory bytes in use.
    pub memory_used: u64,
    /// NUMA node (-1 unknown).
    pub numa: i32,
    /// PCIe switch group.
    pub pcie: String,
    /// UUIDs of NVLink peers.
    pub nvlink_peers: Vec<String>,
}

impl GpuState {
    fn usable(&self) -> bool {
        self.healthy && !self.legacy
    }

    fn free_core(&self) -> u64 {
        100u64.saturating_sub(self.core_used)
    }

    fn free_memory(&self) -> u64 {
        self.memory_total.saturating_sub(self.memory_used)
    }
}

/// A node's GPUs.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeState {
    /// Node name.
    pub name: String,
    /// Its GPUs.
    pub gpus: Vec<GpuState>,
}

/// Where to put work.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    serde::Deserialize,
    serde::Serialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    /// Fill the fullest GPU (and node) that fits: keeps whole GPUs free.
    #[default]
    Binpack,
    /// Use the emptiest: spreads load.
    Spread,
}

/// One GPU's share of a placement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuShare {
    /// `GPU-…`.
    pub uuid: String,
    /// Device minor.
    pub minor: u32,
    /// Compute percent.
    pub core: u64,
    /// Memory bytes.
    pub memory: u64,
    /// Memory percent of this GPU.
    pub ratio: u64,
}

/// The GPUs chosen for a pod on a node.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Placement {
    /// One share per GPU, in the order the pod sees them.
    pub gpus: Vec<GpuShare>,
}

/// The share `request` takes of `gpu`, when it fits.
fn share(gpu: &GpuState, request: &GpuRequest) -> Option<GpuShare> {
    if !gpu.usable() || gpu.memory_total == 0 {
        return None;
    }
    let (memory, ratio) = match request.memory {
        GpuMemory::None => (0, 0),
        GpuMemory::Bytes(bytes) => (
            bytes,
            (u128::from(bytes) * 100).div_ceil(u128::from(gpu.memory_total)) as u64,
        ),
        GpuMemory::Ratio(ratio) => (
            (u128::from(gpu.memory_total) * u128::from(ratio) / 100) as u64,
            ratio,
        ),
    };
    if request.is_whole() && (gpu.core_used > 0 || gpu.memory_used > 0) {
        return None;
    }
    (request.core <= gpu.free_core() && memory <= gpu.free_memory()).then(|| GpuShare {
        uuid: gpu.uuid.clone(),
        minor: gpu.minor,
        core: request.core,
        memory,
        ratio,
    })
}

/// How full the GPU would be after taking `share`, 0..=2 (compute + memory fractions).
fn fullness_after(gpu: &GpuState, share: &GpuShare) -> f64 {
    let core = (gpu.core_used + share.core) as f64 / 100.0;
    let memory = (gpu.memory_used + share.memory) as f64 / gpu.memory_total.max(1) as f64;
    core + memory
}

fn affinity(a: &GpuState, b: &GpuState) -> u32 {
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

/// Why a node cannot take a request.
pub fn unfit_reason(node: &NodeState, request: &GpuRequest) -> String {
    let usable = node.gpus.iter().filter(|g| g.usable()).count();
    if node.gpus.is_empty() {
        return "no GPUs reported (no Device CR)".into();
    }
    let fitting = node
        .gpus
        .iter()
        .filter(|g| share(g, request).is_some())
        .count();
    let memory = match request.memory {
        GpuMemory::None => String::new(),
        GpuMemory::Bytes(bytes) => format!(" and {} MiB", bytes >> 20),
        GpuMemory::Ratio(ratio) => format!(" and {ratio}% memory"),
    };
    format!(
        "{fitting} of {usable} usable GPUs ({} total) have {}% compute{memory} free; {} needed",
        node.gpus.len(),
        request.core,
        request.count
    )
}

/// Chooses GPUs for `request` on `node`, or says why it does not fit.
pub fn allocate(
    node: &NodeState,
    request: &GpuRequest,
    policy: Policy,
) -> Result<Placement, String> {
    let mut candidates: Vec<(usize, GpuShare, f64)> = node
        .gpus
        .iter()
        .enumerate()
        .filter_map(|(index, gpu)| share(gpu, request).map(|s| (index, fullness_after(gpu, &s), s)))
        .map(|(index, full, s)| (index, s, full))
        .collect();
    let count = request.count as usize;
    if candidates.len() < count || count == 0 {
        return Err(unfit_reason(node, request));
    }
    // Best first by policy; the minor breaks ties so choices are stable.
    candidates.sort_by(|a, b| {
        let order = match policy {
            Policy::Binpack => b.2.total_cmp(&a.2),
            Policy::Spread => a.2.total_cmp(&b.2),
        };
        order.then(a.1.minor.cmp(&b.1.minor))
    });
    if count == 1 {
        return Ok(Placement {
            gpus: vec![candidates[0].1.clone()],
        });
    }
    // Multi-GPU: for each anchor, grow a group by affinity (NVLink > PCIe switch >
    // NUMA), keep the group with the most affinity, then the best by policy.
    let mut best: Option<(u32, usize, Vec<usize>)> = None;
    for (anchor_rank, anchor) in candidates.iter().enumerate() {
        let mut group = vec![anchor_rank];
        while group.len() < count {
            let next = (0..candidates.len())
                .filter(|rank| !group.contains(rank))
                .max_by(|&x, &y| {
                    let score = |rank: usize| -> u32 {
                        group
                            .iter()
                            .map(|&g| {
                                affinity(
                                    &node.gpus[candidates[g].0],
                                    &node.gpus[candidates[rank].0],
                                )
                            })
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
            .map(|(a, b)| affinity(&node.gpus[candidates[a].0], &node.gpus[candidates[b].0]))
            .sum();
        let rank_sum: usize = group.iter().sum();
        let better = match &best {
            None => true,
            Some((best_total, best_ranks, _)) => {
                total > *best_total || (total == *best_total && rank_sum < *best_ranks)
            }
        };
        if better {
            best = Some((total, rank_sum, group));
        }
        let _ = anchor;
    }
    let (_, _, mut group) = best.ok_or_else(|| unfit_reason(node, request))?;
    group.sort_by_key(|&rank| candidates[rank].1.minor);
    Ok(Placement {
        gpus: group
            .into_iter()
            .map(|rank| candidates[rank].1.clone())
            .collect(),
    })
}

/// The extender score 0..=10 of placing `request` on `node`: binpack favours the
/// node that is fullest afterwards, spread the emptiest.
pub fn score(node: &NodeState, placement: &Placement, policy: Policy) -> i64 {
    let usable: Vec<&GpuState> = node.gpus.iter().filter(|g| g.usable()).collect();
    if usable.is_empty() {
        return 0;
    }
    let added_core: u64 = placement.gpus.iter().map(|s| s.core).sum();
    let added_memory: u64 = placement.gpus.iter().map(|s| s.memory).sum();
    let core_total = 100 * usable.len() as u64;
    let memory_total: u64 = usable.iter().map(|g| g.memory_total).sum();
    let core_used: u64 = usable.iter().map(|g| g.core_used).sum::<u64>() + added_core;
    let memory_used: u64 = usable.iter().map(|g| g.memory_used).sum::<u64>() + added_memory;
    let fullness = (core_used as f64 / core_total as f64
        + memory_used as f64 / memory_total.max(1) as f64)
        / 2.0;
    let fullness = fullness.clamp(0.0, 1.0);
    let value = match policy {
        Policy::Binpack => fullness,
        Policy::Spread => 1.0 - fullness,
    };
    (value * 10.0).round() as i64
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
        }
    }
}

#[cfg(test)]
mod tests;
