//! The ledger's node table: each node's GPU state and packed load, found by name
//! in one probe of a hash table whose keys hold short names in place.

use super::*;

/// A node's name as the key of the ledger's nodes: held in the hash table's own
/// slot when short (as node names mostly are), so that looking a name up reads
/// no other memory to compare it. Filter and prioritize look up thousands of
/// names per call, each slot cold in the cache.
#[derive(Debug, Clone)]
pub(super) enum NodeKey {
    /// `len` bytes of UTF-8.
    Inline {
        len: u8,
        bytes: [u8; NodeKey::INLINE],
    },
    /// Longer names.
    Heap(Box<str>),
}

impl NodeKey {
    pub(super) const INLINE: usize = 46;

    pub(super) fn new(name: &str) -> Self {
        match u8::try_from(name.len()) {
            Ok(len) if name.len() <= Self::INLINE => {
                let mut bytes = [0; Self::INLINE];
                bytes[..name.len()].copy_from_slice(name.as_bytes());
                Self::Inline { len, bytes }
            }
            _ => Self::Heap(name.into()),
        }
    }

    pub(super) fn as_str(&self) -> &str {
        match self {
            // Always valid: copied from a `str` whole.
            Self::Inline { .. } => std::str::from_utf8(self.as_bytes()).unwrap_or_default(),
            Self::Heap(name) => name,
        }
    }

    /// The name's UTF-8: what lookups hash and compare (no check of the UTF-8 on
    /// each of the thousands of lookups a call makes).
    pub(super) fn as_bytes(&self) -> &[u8] {
        match self {
            Self::Inline { len, bytes } => &bytes[..usize::from(*len)],
            Self::Heap(name) => name.as_bytes(),
        }
    }
}

// As a byte slice, so that `HashMap::get` takes a name's bytes (`Borrow` requires
// the same hash and equality as the borrowed form).
impl std::hash::Hash for NodeKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_bytes().hash(state);
    }
}

impl PartialEq for NodeKey {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for NodeKey {}

impl std::borrow::Borrow<[u8]> for NodeKey {
    fn borrow(&self) -> &[u8] {
        self.as_bytes()
    }
}

/// A node's GPUs with use applied and their load, which every change of them
/// refreshes (the only way to change them is [`LedgerNode::account`]).
#[derive(Debug)]
pub(super) struct LedgerNode {
    /// [`NodeLoad::of`] the state.
    pub(super) load: NodeLoad,
    pub(super) state: NodeState,
}

impl LedgerNode {
    pub(super) fn new(state: NodeState) -> Self {
        Self {
            load: NodeLoad::of(&state),
            state,
        }
    }

    /// Adds or removes a placement's use ([`account`]).
    pub(super) fn account(&mut self, placement: &Placement, add: bool) {
        account(&mut self.state, placement, add);
        self.load.refresh(&self.state);
    }
}

/// The ledger's nodes, counting the changes: every access that may change a node,
/// or which nodes there are, advances [`Nodes::generation`]. While it stays, what
/// was read of the nodes still holds (prioritize reuses filter's scores so).
///
/// A small name → slot index over a dense array of the nodes: filter looks up
/// thousands of names a call, and an index of 56-byte entries stays in the
/// processor's cache where a table holding whole nodes did not (each lookup then
/// missed it twice over, on the entry and on the node's load beside it).
#[derive(Debug, Default)]
pub(super) struct Nodes {
    /// Hashed by foldhash, seeded per process: SipHash cost a few percent of a
    /// filter call, and foldhash's seed still keeps crafted names from colliding.
    pub(super) index: HashMap<NodeKey, u32, foldhash::fast::RandomState>,
    /// The nodes, each with its name, at the slots `index` gives.
    pub(super) slots: Vec<(NodeKey, LedgerNode)>,
    pub(super) generation: u64,
    /// Per slot, the generation at which its node last changed (or was put there).
    pub(super) stamps: Vec<u64>,
    /// Advances whenever slots move or come and go (a node added or removed).
    pub(super) layout: u64,
}

impl Nodes {
    pub(super) fn slot(&self, name: &str) -> Option<usize> {
        self.index.get(name.as_bytes()).map(|&slot| slot as usize)
    }

    pub(super) fn get(&self, name: &str) -> Option<&LedgerNode> {
        self.slots.get(self.slot(name)?).map(|(_, node)| node)
    }

    /// The node to change (counted as changed, whether it is or not).
    pub(super) fn get_mut(&mut self, name: &str) -> Option<&mut LedgerNode> {
        self.generation = self.generation.wrapping_add(1);
        let slot = self.slot(name)?;
        if let Some(stamp) = self.stamps.get_mut(slot) {
            *stamp = self.generation;
        }
        self.slots.get_mut(slot).map(|(_, node)| node)
    }

    pub(super) fn insert(&mut self, name: &str, node: LedgerNode) {
        debug_assert_eq!(self.slots.len(), self.stamps.len(), "a stamp per slot");
        self.generation = self.generation.wrapping_add(1);
        if let Some(slot) = self.slot(name) {
            if let (Some(entry), Some(stamp)) =
                (self.slots.get_mut(slot), self.stamps.get_mut(slot))
            {
                entry.1 = node;
                *stamp = self.generation;
                return;
            }
        }
        // More than u32::MAX nodes is not a cluster Kubernetes runs; refused, not wrapped.
        let Ok(slot) = u32::try_from(self.slots.len()) else {
            return;
        };
        self.layout = self.layout.wrapping_add(1);
        self.index.insert(NodeKey::new(name), slot);
        self.slots.push((NodeKey::new(name), node));
        self.stamps.push(self.generation);
    }

    pub(super) fn remove(&mut self, name: &str) {
        self.generation = self.generation.wrapping_add(1);
        let Some(slot) = self.index.remove(name.as_bytes()) else {
            return;
        };
        self.layout = self.layout.wrapping_add(1);
        let slot = slot as usize;
        if slot >= self.slots.len() {
            return;
        }
        self.slots.swap_remove(slot);
        if slot < self.stamps.len() {
            self.stamps.swap_remove(slot);
        }
        // The last node moved into the freed slot.
        if let Some((moved, _)) = self.slots.get(slot)
            && let Some(entry) = self.index.get_mut(moved.as_bytes())
        {
            *entry = slot as u32;
        }
    }

    pub(super) fn retain(&mut self, mut keep: impl FnMut(&NodeKey, &mut LedgerNode) -> bool) {
        self.generation = self.generation.wrapping_add(1);
        self.layout = self.layout.wrapping_add(1);
        self.slots.retain_mut(|(name, node)| keep(name, node));
        // Every node counts as changed: the nodes kept may have been changed too.
        self.stamps = vec![self.generation; self.slots.len()];
        self.index.clear();
        for (slot, (name, _)) in self.slots.iter().enumerate() {
            self.index.insert(name.clone(), slot as u32);
        }
    }

    /// The generation at which the node at `slot` last changed.
    pub(super) fn stamp(&self, slot: usize) -> u64 {
        self.stamps.get(slot).copied().unwrap_or(u64::MAX)
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &LedgerNode> {
        self.slots.iter().map(|(_, node)| node)
    }
}
