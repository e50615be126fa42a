//! What the allocator reads of a node: each GPU's capacity and use
//! ([`GpuState`]), the same in one block for filter's hot loop ([`NodeLoad`]),
//! and what a placement takes ([`Placement`], [`GpuShare`]).

use super::*;

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
    pub(super) fn usable(&self) -> bool {
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
    pub(super) fn free_core(&self) -> u64 {
        100u64.saturating_sub(self.core_used)
    }

    pub(super) fn free_memory(&self) -> u64 {
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
    pub(super) fn of(gpus: impl Iterator<Item = GpuLoad>) -> Self {
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
