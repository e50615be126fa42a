//! The allocation core: per-node, per-GPU accounting and the choice of GPUs.
//! Pure: no I/O, no clocks, no locks.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;

use tessera_api::request::selection::TopologyScope;
use tessera_api::request::{
    ContainerGpuRequest, ContainerRole, GpuMemory, GpuRequest, GpuSelection, PlacementPolicy,
    PodGpuRequest,
};
use tessera_api::resources::LABEL_GPU_MODEL;

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
    /// The Device CR's labels of this GPU (the model among them); shared, as
    /// every copy of the node's state holds them.
    pub labels: Arc<BTreeMap<String, String>>,
    /// Sharing group → how many of its pods use this GPU (normally one group at most).
    pub groups: BTreeMap<String, u32>,
    /// Ruled out for the pod being placed, whatever is evicted: by its GPU selection,
    /// or as not its sharing group's GPU (never set in the ledger).
    pub excluded: bool,
    /// Closed to the pod being placed until pods leave: held by a sharing group not
    /// its own, or in use while its new group needs an idle GPU (never set in the ledger).
    pub closed: bool,
}

impl GpuState {
    fn usable(&self) -> bool {
        self.healthy && !self.legacy && !self.excluded
    }

    /// The figures fitting and scoring read of this GPU.
    pub fn load(&self) -> GpuLoad {
        GpuLoad {
            memory_total: self.memory_total,
            memory_used: self.memory_used,
            core_used: self.core_used,
            counted: self.healthy && !self.legacy,
            open: self.usable() && !self.closed,
        }
    }
}

/// What fitting and scoring read of one GPU ([`GpuState::load`]), packed: filter
/// and prioritize read it for every GPU of thousands of candidate nodes per call,
/// and the whole [`GpuState`] (names, labels, topology) is several cache lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GpuLoad {
    /// Total memory in bytes.
    pub memory_total: u64,
    /// Memory bytes in use.
    pub memory_used: u64,
    /// Compute percent in use.
    pub core_used: u64,
    /// Healthy and not held by a device-plugin pod: counts in the node's fullness.
    pub counted: bool,
    /// Counted, and neither ruled out nor closed for the pod being placed.
    pub open: bool,
}

impl GpuLoad {
    fn free_core(&self) -> u64 {
        100u64.saturating_sub(self.core_used)
    }

    fn free_memory(&self) -> u64 {
        self.memory_total.saturating_sub(self.memory_used)
    }
}

/// A node's GPUs as fitting and scoring read them, in one block: the ledger keeps
/// it beside each node's [`NodeState`] ([`NodeLoad::of`] of it, always), so that
/// filter and prioritize judge a node from a few cache lines ([`score_pod_loaded`],
/// whose score is also the verdict that the pod fits).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeLoad {
    /// Per GPU, in the node's order.
    pub gpus: GpuLoads,
    /// Some GPU is held by a sharing group: the pod's view of the node
    /// ([`as_selected`]) needs the whole state.
    pub grouped: bool,
    /// Every GPU has this much memory: a one-GPU share then takes the same of
    /// whichever GPU the policy picks, and so scores the same.
    pub same_memory: Option<u64>,
    /// The node's fullness as scoring counts it.
    pub fullness: Fullness,
}

/// A node's [`GpuLoad`]s, in place up to [`INLINE_GPUS`] (nodes mostly have 8 at
/// most): the ledger's node table then holds the whole load, and a cold node read
/// by filter costs one place in memory, not two. On thousands of nodes per call,
/// each a cache and TLB miss, the second place cost as much as the first.
pub type GpuLoads = smallvec::SmallVec<[GpuLoad; INLINE_GPUS]>;

/// GPUs a node's [`GpuLoads`] holds in place.
pub const INLINE_GPUS: usize = 8;

/// Sums over a node's counted GPUs ([`GpuLoad::counted`]): what scoring reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Fullness {
    /// How many GPUs count.
    pub gpus: u64,
    /// Their memory, bytes.
    pub memory_total: u64,
    /// Their compute in use, percent.
    pub core_used: u64,
    /// Their memory in use, bytes.
    pub memory_used: u64,
}

impl Fullness {
    fn of(gpus: impl Iterator<Item = GpuLoad>) -> Self {
        let mut sums = Self::default();
        for gpu in gpus.filter(|g| g.counted) {
            sums.gpus += 1;
            sums.memory_total += gpu.memory_total;
            sums.core_used += gpu.core_used;
            sums.memory_used += gpu.memory_used;
        }
        sums
    }
}

impl NodeLoad {
    /// The load of `node`.
    pub fn of(node: &NodeState) -> Self {
        let mut load = Self::default();
        load.refresh(node);
        load
    }

    /// Becomes the load of `node` again (after its use changed), reusing its memory.
    pub fn refresh(&mut self, node: &NodeState) {
        let loads = node.gpus.iter().map(GpuState::load);
        if self.gpus.spilled() && loads.len() > INLINE_GPUS {
            self.gpus.clear();
            self.gpus.extend(loads);
        } else {
            // In place again when they fit.
            self.gpus = loads.collect();
        }
        self.grouped = node.gpus.iter().any(|g| !g.groups.is_empty());
        self.same_memory = match node.gpus.split_first() {
            Some((first, rest)) if rest.iter().all(|g| g.memory_total == first.memory_total) => {
                Some(first.memory_total)
            }
            _ => None,
        };
        self.fullness = Fullness::of(self.gpus.iter().copied());
    }
}

/// A node's state and its load ([`NodeLoad::of`] the state), as the ledger keeps them.
#[derive(Debug, Clone, Copy)]
pub struct LoadedNode<'a> {
    /// The whole state.
    pub state: &'a NodeState,
    /// Its load.
    pub load: &'a NodeLoad,
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
    /// The pod's sharing group, which holds these GPUs while it has pods there.
    pub group: Option<String>,
}

/// What `request` takes of one GPU: compute, memory bytes, memory percent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Take {
    core: u64,
    memory: u64,
    ratio: u64,
}

/// What `request` takes of `gpu`, when it fits. No allocation: this runs for
/// every GPU of every candidate node.
fn take(gpu: &GpuState, request: &GpuRequest) -> Option<Take> {
    take_load(&gpu.load(), request)
}

/// [`take`] from the GPU's load.
fn take_load(gpu: &GpuLoad, request: &GpuRequest) -> Option<Take> {
    if !gpu.open || gpu.memory_total == 0 {
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
    (request.core <= gpu.free_core() && memory <= gpu.free_memory()).then_some(Take {
        core: request.core,
        memory,
        ratio,
    })
}

fn to_share(gpu: &GpuState, take: Take) -> GpuShare {
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
fn fits_in(gpus: impl Iterator<Item = GpuLoad>, request: &GpuRequest) -> bool {
    let needed = request.count as usize;
    needed > 0
        && gpus
            .filter(|g| take_load(g, request).is_some())
            .take(needed)
            .count()
            == needed
}

/// How full the GPU would be after `take`, 0..=2 (compute + memory fractions).
fn fullness_after(gpu: &GpuState, take: Take) -> f64 {
    fullness_after_load(&gpu.load(), take)
}

/// [`fullness_after`] from the GPU's load.
fn fullness_after_load(gpu: &GpuLoad, take: Take) -> f64 {
    let core = (gpu.core_used + take.core) as f64 / 100.0;
    let memory = (gpu.memory_used + take.memory) as f64 / gpu.memory_total.max(1) as f64;
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

/// Why a node cannot take a request: how many of its usable GPUs could hold
/// what was asked (and what holds the unusable ones), what was asked, and what
/// the freest usable GPU has free, so that the reader can act on it.
pub fn unfit_reason(node: &NodeState, request: &GpuRequest) -> String {
    if node.gpus.is_empty() {
        return "no GPUs reported (no Device CR)".into();
    }
    let usable: Vec<&GpuState> = node.gpus.iter().filter(|g| g.usable()).collect();
    let fitting = usable.iter().filter(|g| take(g, request).is_some()).count();
    let count = |pick: fn(&GpuState) -> bool| node.gpus.iter().filter(|g| pick(g)).count();
    let held: Vec<String> = [
        (count(|g| g.legacy), "held by device-plugin pods"),
        (count(|g| !g.healthy && !g.legacy), "unhealthy"),
    ]
    .into_iter()
    .filter(|(n, _)| *n > 0)
    .map(|(n, what)| format!("{n} {what}"))
    .collect();
    let total = if held.is_empty() {
        format!("{} total", node.gpus.len())
    } else {
        format!("{} total: {}", node.gpus.len(), held.join(", "))
    };
    let asked = asked(request);
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
        .map_or_else(String::new, |(_, core, memory, total)| {
            format!(
                "; the freest has {core}% compute and {} of {} free",
                gib_text(memory),
                gib_text(total)
            )
        });
    format!(
        "{fitting} of {} usable GPUs ({total}) have room for {asked}, {} needed{freest}",
        usable.len(),
        request.count
    )
}

/// What one GPU of `request` asks, in words: `50% compute and 50% memory`,
/// `30% compute and 8.0 GiB`, or `8.0 GiB of memory` (a share with no compute).
fn asked(request: &GpuRequest) -> String {
    match (request.core, request.memory) {
        (0, GpuMemory::Bytes(bytes)) => format!("{} of memory", gib_text(bytes)),
        (0, GpuMemory::Ratio(ratio)) => format!("{ratio}% memory"),
        (core, GpuMemory::Bytes(bytes)) => format!("{core}% compute and {}", gib_text(bytes)),
        (core, GpuMemory::Ratio(ratio)) => format!("{core}% compute and {ratio}% memory"),
        (core, GpuMemory::None) => format!("{core}% compute"),
    }
}

/// Bytes as GiB with one decimal (`20.0 GiB`), as `tessera inspect` shows them.
fn gib_text(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / f64::from(1u32 << 30))
}

/// Chooses GPUs for `request` on `node`, or says why it does not fit.
pub fn allocate(
    node: &NodeState,
    request: &GpuRequest,
    policy: Policy,
) -> Result<Placement, String> {
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
fn score_one<I: Iterator<Item = GpuLoad>>(
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

fn score_added(node: &NodeState, added_core: u64, added_memory: u64, policy: Policy) -> i64 {
    score_added_in(
        node.gpus.iter().map(GpuState::load),
        added_core,
        added_memory,
        policy,
    )
}

/// [`score_added`] over the GPUs' loads.
fn score_added_in(
    gpus: impl Iterator<Item = GpuLoad>,
    added_core: u64,
    added_memory: u64,
    policy: Policy,
) -> i64 {
    // The node's fullness, whatever the pod's selection rules out.
    score_fullness(Fullness::of(gpus), added_core, added_memory, policy)
}

/// [`score_added`] from the node's [`Fullness`].
fn score_fullness(sums: Fullness, added_core: u64, added_memory: u64, policy: Policy) -> i64 {
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

// === Pods: a share per container ===

/// One container's GPUs, and its share of each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerPlacement {
    /// The container's name.
    pub name: String,
    /// Its shares, in the order it sees the GPUs.
    pub gpus: Vec<GpuShare>,
}

/// The GPUs chosen for a pod, container by container.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PodPlacement {
    /// What the pod books on each GPU, by minor: per resource, the most its
    /// containers use at once (Kubernetes' phases, [`PodGpuRequest::phases`]).
    /// This is what the ledger counts and the annotation's pod-level list says.
    pub booked: Placement,
    /// Each container that asked for GPUs, in the request's order.
    pub containers: Vec<ContainerPlacement>,
}

/// Adds `shares` into per-GPU sums.
fn add_shares(sums: &mut BTreeMap<String, GpuShare>, shares: &[GpuShare]) {
    for share in shares {
        let sum = sums.entry(share.uuid.clone()).or_insert_with(|| GpuShare {
            core: 0,
            memory: 0,
            ratio: 0,
            ..share.clone()
        });
        sum.core += share.core;
        sum.memory += share.memory;
        sum.ratio += share.ratio;
    }
}

/// What `phase` (indices into the request) uses of each GPU, given each container's shares.
fn phase_use(phase: &[usize], grants: &[Vec<GpuShare>]) -> BTreeMap<String, GpuShare> {
    let mut sums = BTreeMap::new();
    for &index in phase {
        add_shares(&mut sums, &grants[index]);
    }
    sums
}

/// Raises `booked` to hold `used` as well, resource by resource.
fn book(booked: &mut BTreeMap<String, GpuShare>, used: BTreeMap<String, GpuShare>) {
    for (uuid, used) in used {
        let entry = booked.entry(uuid).or_insert_with(|| GpuShare {
            core: 0,
            memory: 0,
            ratio: 0,
            ..used.clone()
        });
        entry.core = entry.core.max(used.core);
        entry.memory = entry.memory.max(used.memory);
        // Ratios of byte requests are rounded up one by one: their sum may pass
        // 100 while the bytes fit. A booking is never more than the GPU.
        entry.ratio = entry.ratio.max(used.ratio).min(100);
    }
}

/// The message of a container that does not fit.
fn container_unfit(container: &ContainerGpuRequest, reason: &str) -> String {
    format!("{} {}: {reason}", container.role.noun(), container.name)
}

/// Biggest first: whole and multi-GPU requests before shares, so shares fill around them.
fn size(request: &GpuRequest) -> (u32, u64, u64, u64) {
    let (ratio, bytes) = match request.memory {
        GpuMemory::None => (0, 0),
        GpuMemory::Bytes(bytes) => (0, bytes),
        GpuMemory::Ratio(ratio) => (ratio, 0),
    };
    (request.count, request.core, ratio, bytes)
}

/// Chooses GPUs for an init container on `during` (the node with the sidecars
/// started before it), preferring GPUs the pod already books enough of: an init
/// container runs before the app containers, so it may reuse their shares.
fn allocate_init(
    during: &NodeState,
    sidecars: &BTreeMap<String, GpuShare>,
    booked: &BTreeMap<String, GpuShare>,
    request: &GpuRequest,
    policy: Policy,
) -> Result<Vec<GpuShare>, String> {
    let count = request.count as usize;
    let mut candidates: Vec<(f64, f64, &GpuState, Take)> = during
        .gpus
        .iter()
        .filter_map(|gpu| {
            let t = take(gpu, request)?;
            let zero = GpuShare {
                uuid: String::new(),
                minor: 0,
                core: 0,
                memory: 0,
                ratio: 0,
            };
            let before = sidecars.get(&gpu.uuid).unwrap_or(&zero);
            let held = booked.get(&gpu.uuid).unwrap_or(&zero);
            // What the pod would book beyond what it books already.
            let extra_core = (before.core + t.core).saturating_sub(held.core) as f64 / 100.0;
            let extra_memory = (before.memory + t.memory).saturating_sub(held.memory) as f64
                / gpu.memory_total.max(1) as f64;
            Some((extra_core + extra_memory, fullness_after(gpu, t), gpu, t))
        })
        .collect();
    if candidates.len() < count || count == 0 {
        return Err(unfit_reason(during, request));
    }
    candidates.sort_by(|a, b| {
        let by_policy = match policy {
            Policy::Binpack => b.1.total_cmp(&a.1),
            Policy::Spread => a.1.total_cmp(&b.1),
        };
        a.0.total_cmp(&b.0)
            .then(by_policy)
            .then(a.2.minor.cmp(&b.2.minor))
    });
    let mut chosen: Vec<GpuShare> = candidates[..count]
        .iter()
        .map(|(_, _, gpu, t)| to_share(gpu, *t))
        .collect();
    chosen.sort_by_key(|share| share.minor);
    Ok(chosen)
}

/// Chooses GPUs for every container of a pod on `node`, or says which container
/// does not fit and why. The containers that run for the pod's life (sidecars and
/// app containers) are placed together, biggest first, each beside the ones placed
/// before it (two 25% containers may share one GPU, booked 50%, or use two, as
/// [`allocate`] decides); then each init container, in order, beside the sidecars
/// started before it, on GPUs the pod books already where it can. The pod books,
/// per GPU and resource, the most any phase uses.
fn allocate_pod_on(
    node: &NodeState,
    request: &PodGpuRequest,
    policy: Policy,
) -> Result<PodPlacement, String> {
    if let [only] = request.containers.as_slice() {
        // The common case: one container, the whole pod's request.
        let placement =
            allocate(node, &only.gpu, policy).map_err(|reason| container_unfit(only, &reason))?;
        return Ok(PodPlacement {
            containers: vec![ContainerPlacement {
                name: only.name.clone(),
                gpus: placement.gpus.clone(),
            }],
            booked: placement,
        });
    }
    let containers = &request.containers;
    let phases = request.phases();
    let mut grants: Vec<Vec<GpuShare>> = vec![Vec::new(); containers.len()];
    // The pod's life: sidecars and app containers, each beside those placed before it.
    let running = phases.last().cloned().unwrap_or_default();
    let mut order = running.clone();
    order.sort_by_key(|&index| std::cmp::Reverse(size(&containers[index].gpu)));
    let mut work = node.clone();
    for index in order {
        let container = &containers[index];
        let placement = allocate(&work, &container.gpu, policy)
            .map_err(|reason| container_unfit(container, &reason))?;
        account(&mut work, &placement, true);
        grants[index] = placement.gpus;
    }
    let mut booked = BTreeMap::new();
    book(&mut booked, phase_use(&running, &grants));
    // Init containers, in order; a sidecar's own start uses a part of `running`.
    for phase in &phases[..phases.len().saturating_sub(1)] {
        let Some((&last, before)) = phase.split_last() else {
            continue;
        };
        let container = &containers[last];
        if container.role == ContainerRole::Init {
            let sidecars = phase_use(before, &grants);
            let mut during = node.clone();
            for &sidecar in before {
                account(
                    &mut during,
                    &Placement {
                        gpus: grants[sidecar].clone(),
                        group: None,
                    },
                    true,
                );
            }
            grants[last] = allocate_init(&during, &sidecars, &booked, &container.gpu, policy)
                .map_err(|reason| container_unfit(container, &reason))?;
        }
        book(&mut booked, phase_use(phase, &grants));
    }
    let mut booked: Vec<GpuShare> = booked.into_values().collect();
    booked.sort_by_key(|share| share.minor);
    Ok(PodPlacement {
        booked: Placement {
            gpus: booked,
            group: None,
        },
        containers: containers
            .iter()
            .zip(grants)
            .map(|(container, gpus)| ContainerPlacement {
                name: container.name.clone(),
                gpus,
            })
            .collect(),
    })
}

// === A pod's own choices: which GPUs, which policies ===

impl From<PlacementPolicy> for Policy {
    fn from(policy: PlacementPolicy) -> Self {
        match policy {
            PlacementPolicy::Binpack => Self::Binpack,
            PlacementPolicy::Spread => Self::Spread,
        }
    }
}

/// Which GPU on a node for `request`: its own (`hami.io/gpu-scheduler-policy`), else `default`.
pub fn gpu_policy_of(request: &PodGpuRequest, default: Policy) -> Policy {
    request.gpu_policy.map_or(default, Policy::from)
}

/// Which node for `request`: its own (`hami.io/node-scheduler-policy`), else `default`.
pub fn node_policy_of(request: &PodGpuRequest, default: Policy) -> Policy {
    request.node_policy.map_or(default, Policy::from)
}

/// The node as the pod may use it. GPUs its selection rules out are marked
/// excluded (kept, so that messages count them). Sharing groups: a GPU holding a
/// group is closed to every pod outside it; a pod of a group that holds a GPU here
/// may use that GPU only; a pod of a new group takes an idle GPU. No copy when
/// none of this applies.
fn as_selected<'a>(node: &'a NodeState, request: &PodGpuRequest) -> Cow<'a, NodeState> {
    let group = request.sharing_group.as_deref();
    let groups_here = node.gpus.iter().any(|g| !g.groups.is_empty());
    if request.selection.is_empty() && group.is_none() && !groups_here {
        return Cow::Borrowed(node);
    }
    let home_here = group.is_some_and(|g| node.gpus.iter().any(|gpu| gpu.groups.contains_key(g)));
    let mut node = node.clone();
    for gpu in &mut node.gpus {
        gpu.excluded = !request.selection.allows(&gpu.uuid, &gpu.labels);
        match group {
            None => gpu.closed = !gpu.groups.is_empty(),
            Some(g) if home_here => gpu.excluded |= !gpu.groups.contains_key(g),
            Some(_) => {
                gpu.closed = !gpu.groups.is_empty() || gpu.core_used > 0 || gpu.memory_used > 0;
            }
        }
    }
    Cow::Owned(node)
}

/// The node as the pod may use it ([`as_selected`]), once per place of the scope
/// its selection requires (Koordinator's `requiredTopologyScope`): each view
/// leaves only one PCIe switch's or one NUMA node's GPUs usable, so a placement on
/// a view keeps all the pod's GPUs together there. A GPU whose switch or NUMA node
/// is not reported is a place of its own: it can hold a one-GPU pod, never share one
/// with another GPU. One view, the node, when there is no scope.
fn views<'a>(node: &'a NodeState, request: &PodGpuRequest) -> Vec<Cow<'a, NodeState>> {
    let selected = as_selected(node, request);
    let Some(scope) = request.selection.scope.as_ref() else {
        return vec![selected];
    };
    let places = places_of(&selected, scope.scope);
    // A place with fewer usable GPUs than the pod's largest container asks can never
    // hold it: no copy of the node for it.
    let needed = request
        .containers
        .iter()
        .map(|c| c.gpu.count as usize)
        .max()
        .unwrap_or(0);
    let mut usable: BTreeMap<Place<'_>, usize> = BTreeMap::new();
    for (gpu, place) in selected.gpus.iter().zip(&places) {
        *usable.entry(*place).or_default() += usize::from(gpu.usable());
    }
    usable
        .into_iter()
        .filter(|(_, count)| *count >= needed.max(1))
        .map(|(here, _)| {
            let mut view = selected.clone().into_owned();
            for (gpu, place) in view.gpus.iter_mut().zip(&places) {
                gpu.excluded |= *place != here;
            }
            Cow::Owned(view)
        })
        .collect()
}

/// Where a GPU is, for a scope: its PCIe switch, its NUMA node, or (neither
/// reported) the GPU alone, by its index on the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Place<'a> {
    Switch(&'a str),
    Numa(i32),
    Alone(usize),
}

/// Each GPU's place for `scope`, in the node's order.
fn places_of(node: &NodeState, scope: TopologyScope) -> Vec<Place<'_>> {
    node.gpus
        .iter()
        .enumerate()
        .map(|(index, gpu)| match scope {
            TopologyScope::PcieSwitch if !gpu.pcie.is_empty() => Place::Switch(&gpu.pcie),
            TopologyScope::NumaNode if gpu.numa >= 0 => Place::Numa(gpu.numa),
            _ => Place::Alone(index),
        })
        .collect()
}

/// Why the pod, which fits on the node as a whole, fits in no single place of its
/// required scope.
fn scope_unfit(node: &NodeState, request: &PodGpuRequest) -> Option<String> {
    let scope = request.selection.scope.as_ref()?;
    let unplaced = places_of(node, scope.scope)
        .iter()
        .filter(|p| matches!(p, Place::Alone(_)))
        .count();
    let unreported = if unplaced > 0 {
        format!(
            " ({unplaced} of its {} GPUs report no {}, so each is one alone)",
            node.gpus.len(),
            scope.scope.noun()
        )
    } else {
        String::new()
    };
    Some(format!(
        "{} gpu.requiredTopologyScope {:?} requires all of the pod's GPUs under one {}, and no {} of this node has room for them{unreported}",
        scope.annotation,
        scope.scope.name(),
        scope.scope.noun(),
        scope.scope.noun()
    ))
}

/// `reason`, saying what the pod's selection and sharing group leave it of the node.
fn with_selection(reason: String, node: &NodeState, request: &PodGpuRequest) -> String {
    let total = node.gpus.len();
    let mut reason = reason;
    let ruled_out = node
        .gpus
        .iter()
        .filter(|g| !request.selection.allows(&g.uuid, &g.labels))
        .count();
    if ruled_out > 0 {
        reason.push_str(&format!(
            "; {ruled_out} of {total} GPUs ruled out by {}",
            request.selection.describe()
        ));
    }
    let held = node.gpus.iter().filter(|g| !g.groups.is_empty()).count();
    match request.sharing_group.as_deref() {
        Some(group) if node.gpus.iter().any(|g| g.groups.contains_key(group)) => {
            reason.push_str(&format!(
                "; sharing group {group:?} holds a GPU here and its pods use that GPU only"
            ));
        }
        Some(group) => {
            let idle = node.gpus.iter().filter(|g| g.usable() && !g.closed).count();
            reason.push_str(&format!(
                "; sharing group {group:?} is new and takes an idle GPU ({idle} of {total} idle)"
            ));
        }
        None if held > 0 => {
            reason.push_str(&format!(
                "; {held} of {total} GPUs held by sharing groups, which share them with no other pod"
            ));
        }
        None => {}
    }
    reason
}

/// Where the pod's sharing group lives while it has pods: its node and GPU.
/// `None` for a pod in no group, or a group holding no GPU (a new group).
pub fn group_home<'a>(
    nodes: impl IntoIterator<Item = &'a NodeState>,
    request: &PodGpuRequest,
) -> Option<(String, String)> {
    let group = request.sharing_group.as_deref()?;
    nodes.into_iter().find_map(|node| {
        node.gpus
            .iter()
            .find(|gpu| gpu.groups.contains_key(group))
            .map(|gpu| (node.name.clone(), gpu.uuid.clone()))
    })
}

/// Why the pod cannot go to `node` because its sharing group lives on another
/// node (`home`, from [`group_home`]): a group is one GPU while it has pods.
pub fn group_elsewhere(
    home: Option<&(String, String)>,
    request: &PodGpuRequest,
    node: &str,
) -> Option<String> {
    let (home, uuid) = home?;
    let group = request.sharing_group.as_deref()?;
    (home != node).then(|| {
        format!(
            "sharing group {group:?} holds GPU {uuid} on node {home}: its pods share that GPU only"
        )
    })
}

/// How many GPUs the sharing groups of one namespace may hold at once, unless
/// set otherwise (`--max-group-gpus-per-namespace`).
pub const GROUP_GPUS_PER_NAMESPACE: u32 = 4;

/// Why the pod's sharing group may not take a GPU now: the group is new (it
/// holds none: `home`, from [`group_home`], is `None`) and the groups of its
/// namespace already hold `allowance` GPUs. A group closes its GPU to every
/// other pod, however small its pods' shares, while ResourceQuota counts only
/// those shares: without a cap, one namespace's 1 % groups could hold every GPU.
/// `None` for a pod in no group, a group joining its GPU, or room left.
pub fn group_over_allowance<'a>(
    nodes: impl IntoIterator<Item = &'a NodeState>,
    request: &PodGpuRequest,
    home: Option<&(String, String)>,
    allowance: u32,
) -> Option<String> {
    let group = request.sharing_group.as_deref()?;
    if home.is_some() {
        return None;
    }
    if allowance == 0 {
        return Some(format!(
            "sharing group {group:?}: sharing groups are off in this cluster (--max-group-gpus-per-namespace=0), so no pod that names one is placed: drop its {} or {} annotation",
            tessera_api::request::selection::SHARING_GROUP,
            tessera_api::request::selection::KUBESHARE_GPUID
        ));
    }
    // Group keys are `namespace/name` (tessera_api::request).
    let namespace = group.split_once('/').map_or("", |(namespace, _)| namespace);
    let prefix = format!("{namespace}/");
    let held = nodes
        .into_iter()
        .flat_map(|node| &node.gpus)
        .filter(|gpu| gpu.groups.keys().any(|g| g.starts_with(&prefix)))
        .count();
    (held >= allowance as usize).then(|| {
        format!(
            "sharing group {group:?} is new, and the sharing groups of namespace {namespace:?} already hold {held} GPUs, the most one namespace's groups may hold (--max-group-gpus-per-namespace={allowance}): it waits until one of them ends"
        )
    })
}

/// Why no node could ever give the pod a GPU: its selection rules out every GPU
/// of every node (a model or UUID no node has). Names the annotations, their
/// values and the models the cluster has; `None` when some GPU passes.
pub fn selected_nowhere<'a>(
    nodes: impl IntoIterator<Item = &'a NodeState>,
    selection: &GpuSelection,
) -> Option<String> {
    // A scope alone rules out no GPU: where it is, not which.
    if selection.rules.is_empty() {
        return None;
    }
    let mut models = std::collections::BTreeSet::new();
    for gpu in nodes.into_iter().flat_map(|node| &node.gpus) {
        if selection.allows(&gpu.uuid, &gpu.labels) {
            return None;
        }
        models.insert(
            gpu.labels
                .get(LABEL_GPU_MODEL)
                .map_or("(model not reported)", String::as_str),
        );
    }
    let models = if models.is_empty() {
        "none".to_owned()
    } else {
        models.into_iter().collect::<Vec<_>>().join(", ")
    };
    Some(format!(
        "{} rules out every GPU of every node: no node has such a GPU (GPU models in the cluster: {models})",
        selection.describe()
    ))
}

/// Chooses GPUs for every container of a pod on `node`, or says which container
/// does not fit and why: [`allocate_pod_on`] over the GPUs the pod's selection
/// allows, by the pod's own GPU policy when it names one, else `policy`.
pub fn allocate_pod(
    node: &NodeState,
    request: &PodGpuRequest,
    policy: Policy,
) -> Result<PodPlacement, String> {
    let policy = gpu_policy_of(request, policy);
    let views = views(node, request);
    if let [view] = views.as_slice() {
        // No scope, or one place of it: as it is, with no ranking to do.
        let mut placement = allocate_pod_on(view, request, policy).map_err(|reason| {
            unfit_in_scope(node, request, policy)
                .unwrap_or_else(|| with_selection(reason, view, request))
        })?;
        placement.booked.group.clone_from(&request.sharing_group);
        return Ok(placement);
    }
    let mut best: Option<(f64, PodPlacement)> = None;
    for view in views {
        // Of the scope's places, the one the GPU policy prefers (the first on a tie).
        if let Ok(placement) = allocate_pod_on(&view, request, policy) {
            let rank = place_rank(&view, &placement.booked, policy);
            if best.as_ref().is_none_or(|(b, _)| rank > *b) {
                best = Some((rank, placement));
            }
        }
    }
    match best {
        Some((_, mut placement)) => {
            placement.booked.group.clone_from(&request.sharing_group);
            Ok(placement)
        }
        // The reason filtering gives: the scope's, or the whole node's own.
        None => Err(unfit_in_scope(node, request, policy).unwrap_or_else(|| {
            let whole = as_selected(node, request);
            allocate_pod_on(&whole, request, policy).err().map_or_else(
                || "no GPU".into(),
                |reason| with_selection(reason, &whole, request),
            )
        })),
    }
}

/// How much the GPU policy prefers a place of a scope for `placement`: the mean
/// fullness of the place's GPUs with it booked, higher for binpack (the fuller
/// place), lower for spread.
fn place_rank(view: &NodeState, placement: &Placement, policy: Policy) -> f64 {
    let mut after = view.clone();
    account(&mut after, placement, true);
    let none = Take {
        core: 0,
        memory: 0,
        ratio: 0,
    };
    let (sum, count) = after
        .gpus
        .iter()
        .filter(|gpu| !gpu.excluded)
        .fold((0.0, 0_u32), |(sum, count), gpu| {
            (sum + fullness_after(gpu, none), count + 1)
        });
    let mean = sum / f64::from(count.max(1));
    match policy {
        Policy::Binpack => mean,
        Policy::Spread => -mean,
    }
}

/// Why a pod with a required scope fits nowhere on the node: the scope's reason
/// when the node as a whole would hold it, `None` (the allocator's own reason
/// stands) otherwise or with no scope.
fn unfit_in_scope(node: &NodeState, request: &PodGpuRequest, policy: Policy) -> Option<String> {
    request.selection.scope.as_ref()?;
    let whole = as_selected(node, request);
    allocate_pod_on(&whole, request, policy)
        .ok()
        .and_then(|_| scope_unfit(node, request))
        .map(|reason| with_selection(reason, &whole, request))
}

/// Whether the pod fits on `node` when placed by `policy`, as bind will place it
/// (for one container, as cheap as [`fits`]).
pub fn fits_pod(node: &NodeState, request: &PodGpuRequest, policy: Policy) -> bool {
    views(node, request)
        .iter()
        .any(|view| match request.containers.as_slice() {
            [only] => fits(view, &only.gpu),
            _ => allocate_pod_on(view, request, gpu_policy_of(request, policy)).is_ok(),
        })
}

/// The one container's request when the pod sees `node` as it is: one container,
/// no GPU selection, no sharing group, no GPU held by a group there. Then
/// [`as_selected`] leaves the node as it is and the node's load says all that
/// fitting and scoring read.
fn plain_request<'a>(node: LoadedNode<'_>, request: &'a PodGpuRequest) -> Option<&'a GpuRequest> {
    match request.containers.as_slice() {
        [only]
            if request.selection.is_empty()
                && request.sharing_group.is_none()
                && !node.load.grouped =>
        {
            Some(&only.gpu)
        }
        _ => None,
    }
}

/// [`score_pod`], reading only the node's load when that says all (a one-GPU
/// request; several GPUs are chosen by topology, from the whole state).
pub fn score_pod_loaded(
    node: LoadedNode<'_>,
    request: &PodGpuRequest,
    gpu_policy: Policy,
    node_policy: Policy,
) -> Option<i64> {
    match plain_request(node, request) {
        Some(gpu) if gpu.count == 1 => score_one_loaded(
            node.load,
            gpu,
            gpu_policy_of(request, gpu_policy),
            node_policy_of(request, node_policy),
        ),
        _ => score_pod(node.state, request, gpu_policy, node_policy),
    }
}

/// [`score_one`] from the node's load. The score counts what the pod takes of
/// the GPU the policy picks: its compute, and its memory, which is the same on
/// every GPU unless it is a ratio of GPUs of different sizes. When it is the same,
/// any GPU that fits scores as the picked one would, and the node's sums say the
/// rest: no GPU is read beyond the first that fits.
fn score_one_loaded(
    load: &NodeLoad,
    request: &GpuRequest,
    gpu_policy: Policy,
    node_policy: Policy,
) -> Option<i64> {
    let same_take = match request.memory {
        GpuMemory::None | GpuMemory::Bytes(_) => true,
        GpuMemory::Ratio(_) => load.same_memory.is_some(),
    };
    if !same_take {
        return score_one(
            || load.gpus.iter().copied(),
            request,
            gpu_policy,
            node_policy,
        );
    }
    let t = load.gpus.iter().find_map(|gpu| take_load(gpu, request))?;
    Some(score_fullness(load.fullness, t.core, t.memory, node_policy))
}

/// Why the pod does not fit on `node`, naming the container that does not.
pub fn unfit_reason_pod(node: &NodeState, request: &PodGpuRequest, policy: Policy) -> String {
    if let Some(reason) = unfit_in_scope(node, request, gpu_policy_of(request, policy)) {
        return reason;
    }
    let node = as_selected(node, request);
    let reason = match request.containers.as_slice() {
        [only] => container_unfit(only, &unfit_reason(&node, &only.gpu)),
        _ => allocate_pod_on(&node, request, gpu_policy_of(request, policy))
            .err()
            .unwrap_or_else(|| "fits".into()),
    };
    with_selection(reason, &node, request)
}

/// Whether `gpu` could hold one share of `request` with nothing else on it:
/// healthy, with memory, and big enough. A GPU held by a device-plugin pod counts:
/// that pod can be preempted like any other.
fn could_ever_take(gpu: &GpuState, request: &GpuRequest) -> bool {
    let memory = match request.memory {
        GpuMemory::None => 0,
        GpuMemory::Bytes(bytes) => bytes,
        GpuMemory::Ratio(ratio) => (u128::from(gpu.memory_total) * u128::from(ratio) / 100)
            .try_into()
            .unwrap_or(u64::MAX),
    };
    gpu.healthy
        && !gpu.excluded
        && gpu.memory_total > 0
        && request.core <= 100
        && memory <= gpu.memory_total
}

/// Why `request` can never fit on `node`, whatever runs there or is evicted: too
/// few healthy GPUs big enough for one share. `None` when emptying the node would
/// make room, so preemption may help.
pub fn never_fits(node: &NodeState, request: &GpuRequest) -> Option<String> {
    let capable = node
        .gpus
        .iter()
        .filter(|g| could_ever_take(g, request))
        .count();
    if request.count > 0 && capable >= request.count as usize {
        return None;
    }
    let healthy = node.gpus.iter().filter(|g| g.healthy).count();
    // Bytes asked: what the GPUs hold, beside it.
    let largest = match request.memory {
        GpuMemory::Bytes(_) => node
            .gpus
            .iter()
            .filter(|g| g.healthy)
            .map(|g| g.memory_total)
            .max()
            .map(|largest| format!(" (the largest healthy GPU holds {})", gib_text(largest)))
            .unwrap_or_default(),
        _ => String::new(),
    };
    Some(format!(
        "never fits: {capable} of {healthy} healthy GPUs ({} total) could hold {} even with nothing running{largest}; {} needed",
        node.gpus.len(),
        asked(request),
        request.count
    ))
}

/// Why the pod can never fit on `node`, even emptied of every pod (device-plugin
/// pods included), naming the container; `None` when preemption may help. Only
/// called for nodes the pod does not fit now. GPUs the pod's selection rules out
/// never count: no eviction changes a GPU's model or UUID.
pub fn never_fits_pod(node: &NodeState, request: &PodGpuRequest, policy: Policy) -> Option<String> {
    if request.selection.scope.is_some() {
        // Some place of the scope that could ever hold the pod: preemption may help.
        let first = views(node, request)
            .iter()
            .map(|view| never_fits_on(view, request, policy))
            .collect::<Option<Vec<String>>>()?
            .into_iter()
            .next();
        return match (
            scope_unfit(node, request),
            never_fits_on(&as_selected(node, request), request, policy),
        ) {
            // The node emptied would hold it, only not in one place of the scope.
            (Some(scope), None) => Some(format!("never fits: {scope}, even with nothing running")),
            (_, reason) => reason.or(first),
        };
    }
    never_fits_on(&as_selected(node, request), request, policy)
}

/// [`never_fits_pod`] on a node view as the pod may use it.
fn never_fits_on(node: &NodeState, request: &PodGpuRequest, policy: Policy) -> Option<String> {
    let reason = match request.containers.as_slice() {
        [only] => never_fits(node, &only.gpu).map(|reason| container_unfit(only, &reason)),
        _ => {
            // Several containers share GPUs: place them all on the node emptied.
            let mut empty = node.clone();
            for gpu in &mut empty.gpus {
                gpu.core_used = 0;
                gpu.memory_used = 0;
                gpu.legacy = false;
                gpu.closed = false;
            }
            allocate_pod_on(&empty, request, gpu_policy_of(request, policy))
                .err()
                .map(|reason| format!("never fits, even with nothing running: {reason}"))
        }
    }?;
    Some(with_selection(reason, node, request))
}

/// The extender score 0..=10 of placing the pod on `node`, or `None` when it
/// does not fit (for one container, as cheap as [`score_request`]). The pod's own
/// policies, when it names them, stand in for `gpu_policy` and `node_policy`.
pub fn score_pod(
    node: &NodeState,
    request: &PodGpuRequest,
    gpu_policy: Policy,
    node_policy: Policy,
) -> Option<i64> {
    let (gpu_policy, node_policy) = (
        gpu_policy_of(request, gpu_policy),
        node_policy_of(request, node_policy),
    );
    views(node, request)
        .iter()
        .filter_map(|view| match request.containers.as_slice() {
            [only] => score_request(view, &only.gpu, gpu_policy, node_policy),
            _ => allocate_pod_on(view, request, gpu_policy)
                .ok()
                .map(|placement| score(view, &placement.booked, node_policy)),
        })
        .max()
}

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
struct VictimSet {
    /// Indices into the holders, in the order of [`reprieve_order`].
    victims: Vec<usize>,
    /// kube-scheduler's ranking of a candidate node: the highest victim priority,
    /// the sum of victim priorities (each shifted to be positive), the count.
    rank: (i64, i64, usize),
}

/// The node with `placement`'s use taken off (`add` false) or put back.
fn with_holder(node: &mut NodeState, holder: &GpuHolder, add: bool) {
    account(node, &holder.placement, add);
}

/// `node` with every GPU outside `set` unusable: a fit on it is a fit on `set`.
fn only_gpus(node: &NodeState, set: &[String]) -> NodeState {
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
fn touches(holder: &GpuHolder, set: &[String]) -> bool {
    holder.placement.gpus.iter().any(|s| set.contains(&s.uuid))
}

/// What `holder` books on `set`, as a fraction of GPUs (compute + memory).
fn size_on(holder: &GpuHolder, node: &NodeState, set: &[String]) -> f64 {
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
fn reprieve_order(holders: &[GpuHolder], node: &NodeState, set: &[String], of: &mut [usize]) {
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
fn victims_on(
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
    let picked = allocate_pod(&emptied, request, policy).map_err(|reason| NoVictims { reason })?;
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

#[cfg(test)]
mod tests;

#[cfg(test)]
mod preemption_tests;
