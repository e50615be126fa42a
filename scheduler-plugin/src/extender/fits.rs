//! Filter's verdicts kept across calls (issue 24): with deploy's `--candidates 1`
//! kube-scheduler calls filter once per pod with every feasible node, and pods of
//! one Deployment ask the same. Between two such calls only the nodes that
//! changed (a bind, the pod's own hold) can judge differently, so the verdict of
//! every other node is taken from the last call instead of looking the node up
//! and scoring it again, thousands of times a call.
//!
//! A call is answered from the memo only when all of this holds, else it is
//! judged in full and the memo made anew:
//! - the pod asks exactly what the memo's pod asked and is in no sharing group
//!   (a group's verdicts depend on where its other pods are);
//! - no node came or went since ([`Ledger::layout`]);
//! - the call's names are the memo's, in any order: their count and two
//!   order-free sums of their hashes match, and every name read is compared
//!   with the memo's whole.
//!
//! Nodes whose [`Ledger::changed_at`] is past the memo's generation are judged
//! again first. The answer is the one the full judgement gives: the best score,
//! the earliest in the call's order among equals, and every refused node with its
//! reason.

use std::hash::BuildHasher;

use tessera_allocator::allocate::{LoadedNode, never_fits_pod, score_pod_loaded, unfit_reason_pod};
use tessera_allocator::ledger::Ledger;
use tessera_api::request::PodGpuRequest;

use super::{ExtenderConfig, SWITCH_UNPROVEN_WHY};

/// Why a node without a Device CR takes no GPU pod.
pub(super) const NO_DEVICE: &str = "no Device CR: the node reports no GPUs";

/// One node's verdict for the pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Verdict {
    /// It fits, with this score.
    Fit(i64),
    /// It does not fit now; evicting pods may make room.
    Failed(String),
    /// It never fits, whatever is evicted.
    Unresolvable(String),
}

/// Judges node `name` (`found`: its GPUs and load) for `request`, outside any
/// sharing group.
pub(super) fn judge(
    ledger: &Ledger,
    name: &str,
    found: Option<LoadedNode<'_>>,
    request: &PodGpuRequest,
    config: &ExtenderConfig,
) -> Verdict {
    // No GPU hook runs there yet: whatever the pod tolerates, and however
    // empty its GPUs, nothing is placed until the switch is proven.
    if ledger.switch_unproven(name) {
        return Verdict::Unresolvable(SWITCH_UNPROVEN_WHY.into());
    }
    let Some(node) = found else {
        return Verdict::Unresolvable(NO_DEVICE.into());
    };
    // Scored at once: a score is what a node that fits gets, and the fit test
    // alone would read the node's load a second time.
    if let Some(score) = score_pod_loaded(node, request, config.gpu_policy, config.node_policy) {
        return Verdict::Fit(score);
    }
    // Never fits, even emptied: kube-scheduler's preemption must not pick it
    // (its own dry run ignores GPU shares and would see room).
    match never_fits_pod(node.state, request, config.gpu_policy) {
        Some(reason) => Verdict::Unresolvable(reason.to_string()),
        None => {
            Verdict::Failed(unfit_reason_pod(node.state, request, config.gpu_policy).to_string())
        }
    }
}

/// A call's names as a set: their count and two order-free sums of hashes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct Fingerprint {
    count: usize,
    sum: u64,
    mixed: u64,
}

impl Fingerprint {
    /// The fingerprint of names hashed to `hashes`.
    pub(super) fn of(hashes: &[u64]) -> Self {
        let mut print = Self {
            count: hashes.len(),
            ..Self::default()
        };
        for &hash in hashes {
            print.sum = print.sum.wrapping_add(hash);
            // A second, independent sum (splitmix64's finaliser of the hash).
            let mut z = hash ^ (hash >> 30);
            z = z.wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z ^= z >> 27;
            z = z.wrapping_mul(0x94d0_49bb_1331_11eb);
            print.mixed = print.mixed.wrapping_add(z ^ (z >> 31));
        }
        print
    }
}

/// The hashes of `names`, by `hasher`.
pub(super) fn hashes<'a>(
    hasher: &foldhash::fast::RandomState,
    names: impl Iterator<Item = &'a str>,
) -> Vec<u64> {
    names.map(|name| hasher.hash_one(name.as_bytes())).collect()
}

/// Pod shapes whose verdicts are kept: a few Deployments' pods interleaved in
/// kube-scheduler's queue each find theirs.
const KEPT: usize = 8;

/// The memos of the last few pod shapes, and the shapes lately seen without one:
/// a call is judged in full and recorded only for a shape seen before, so that
/// shapes that come once (or more of them by turns than are kept) cost no more
/// than the full judgement.
#[derive(Debug, Default)]
pub(super) struct FitMemos {
    /// The latest first.
    memos: Vec<FitMemo>,
    /// The shapes of the last calls that had no memo, the latest first.
    seen: std::collections::VecDeque<PodGpuRequest>,
    /// A memo's buffers, emptied, for the next call recorded: a recording
    /// neither allocates nor touches fresh pages for thousands of entries.
    spare: Option<Entries>,
}

impl FitMemos {
    /// Whether a call for `request` over `count` names is worth hashing its
    /// names: a memo may answer it, or it is the shape's second call lately and
    /// is to be recorded (a shape seen for the first time is remembered, not
    /// recorded). If so, the buffer to record its verdicts in.
    pub(super) fn worth_hashing(
        &mut self,
        request: &PodGpuRequest,
        count: usize,
    ) -> Option<Entries> {
        let worth = if self.memos.iter().any(|m| m.is_for(request)) {
            true
        } else if let Some(at) = self.seen.iter().position(|r| r == request) {
            self.seen.remove(at);
            true
        } else {
            self.seen.push_front(request.clone());
            self.seen.truncate(KEPT);
            false
        };
        worth.then(|| {
            self.spare
                .take()
                .unwrap_or_else(|| Entries::with_capacity(count))
        })
    }

    /// Takes back a buffer, emptied, for the next recording: one
    /// [`FitMemos::worth_hashing`] gave that was not needed, or a dropped memo's.
    pub(super) fn recycle(&mut self, mut entries: Entries) {
        entries.clear();
        self.spare = Some(entries);
    }

    /// The memo that may answer a call for `request` over names of
    /// `fingerprint`, made the latest.
    pub(super) fn serving(
        &mut self,
        request: &PodGpuRequest,
        ledger: &Ledger,
        fingerprint: Fingerprint,
    ) -> Option<&mut FitMemo> {
        let found = self
            .memos
            .iter()
            .position(|m| m.serves(request, ledger, fingerprint))?;
        self.memos[..=found].rotate_right(1);
        self.memos.first_mut()
    }

    /// Keeps `memo`, in place of an older one of its shape over the same names
    /// (one shape over other names — another Deployment's node selector — keeps
    /// its own); the memo least lately used goes when there are too many.
    pub(super) fn keep(&mut self, memo: FitMemo) {
        let replaced = self
            .memos
            .iter()
            .position(|m| m.request == memo.request && m.fingerprint == memo.fingerprint);
        let gone = match replaced {
            Some(at) => Some(self.memos.remove(at)),
            None if self.memos.len() >= KEPT => self.memos.pop(),
            None => None,
        };
        if let Some(gone) = gone {
            self.recycle(gone.recorded);
        }
        self.memos.insert(0, memo);
    }

    /// How many verdict sets are kept.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.memos.len()
    }
}

/// The verdicts of the last call judged in full, kept up to date.
#[derive(Debug)]
pub(super) struct FitMemo {
    request: PodGpuRequest,
    layout: u64,
    /// The ledger's generation the verdicts hold at.
    generation: u64,
    fingerprint: Fingerprint,
    /// That call's names and verdicts, kept up to date.
    recorded: Entries,
    /// Each name's hash, in the entries' order.
    hashes: Vec<u64>,
    /// An open-addressing table of the hashes: entry index + 1 (0: empty), at
    /// the hash's place and on, masked to its power-of-two length.
    table: Vec<u32>,
    /// How many entries are refused (not [`Verdict::Fit`]).
    refused: usize,
}

/// Names kept in one buffer, each found by its index: a call's thousands of
/// names kept without an allocation each (filter's scores for prioritize, and
/// the verdicts kept across calls).
#[derive(Debug, Default)]
pub(super) struct JoinedNames {
    text: String,
    /// Where each name ends in `text`.
    ends: Vec<usize>,
}

impl JoinedNames {
    /// Room for `count` names of about node-name length.
    pub(super) fn with_capacity(count: usize) -> Self {
        Self {
            text: String::with_capacity(count * 16),
            ends: Vec::with_capacity(count),
        }
    }

    pub(super) fn push(&mut self, name: &str) {
        self.text.push_str(name);
        self.ends.push(self.text.len());
    }

    /// The `index`-th name.
    pub(super) fn get(&self, index: usize) -> Option<&str> {
        let end = *self.ends.get(index)?;
        let start = index
            .checked_sub(1)
            .and_then(|before| self.ends.get(before))
            .map_or(0, |&end| end);
        self.text.get(start..end)
    }

    /// The names, in order.
    pub(super) fn iter(&self) -> impl Iterator<Item = &str> {
        let mut start = 0;
        self.ends.iter().map(move |&end| {
            let name = self.text.get(start..end).unwrap_or_default();
            start = end;
            name
        })
    }

    fn clear(&mut self) {
        self.text.clear();
        self.ends.clear();
    }
}

/// A full judgement's verdicts, recorded as they are made, per name: its node's
/// slot (`None`: no Device CR) and its verdict.
#[derive(Debug, Default)]
pub(super) struct Entries {
    names: JoinedNames,
    verdicts: Vec<(Option<usize>, Verdict)>,
}

impl Entries {
    /// Room for `count` names.
    pub(super) fn with_capacity(count: usize) -> Self {
        Self {
            names: JoinedNames::with_capacity(count),
            verdicts: Vec::with_capacity(count),
        }
    }

    /// Records `name`'s verdict (its node at `slot`).
    pub(super) fn push(&mut self, name: &str, slot: Option<usize>, verdict: Verdict) {
        self.names.push(name);
        self.verdicts.push((slot, verdict));
    }

    fn clear(&mut self) {
        self.names.clear();
        self.verdicts.clear();
    }
}

/// The memo's answer for a call: the node chosen (if any fits) and the refused
/// nodes with their reasons, names borrowed from the call.
#[derive(Debug, Default)]
pub(super) struct MemoAnswer<'n> {
    /// The node chosen, with its score.
    pub(super) chosen: Option<(&'n str, i64)>,
    pub(super) failed: Vec<(&'n str, String)>,
    pub(super) unresolvable: Vec<(&'n str, String)>,
}

impl FitMemo {
    /// The memo of a call judged in full: `entries` per name, in its order, the
    /// ledger at `generation`.
    pub(super) fn new(
        request: &PodGpuRequest,
        ledger: &Ledger,
        generation: u64,
        hashes: Vec<u64>,
        recorded: Entries,
    ) -> Self {
        // At most half full: a probe ends within a few places.
        let mut table = vec![0u32; (hashes.len() * 2).next_power_of_two().max(2)];
        let mask = table.len() - 1;
        for (index, &hash) in hashes.iter().enumerate() {
            let Ok(value) = u32::try_from(index + 1) else {
                break;
            };
            let mut at = (hash as usize) & mask;
            while table[at] != 0 {
                at = (at + 1) & mask;
            }
            table[at] = value;
        }
        let refused = recorded
            .verdicts
            .iter()
            .filter(|(_, v)| !matches!(v, Verdict::Fit(_)))
            .count();
        Self {
            request: request.clone(),
            layout: ledger.layout(),
            generation,
            fingerprint: Fingerprint::of(&hashes),
            recorded,
            hashes,
            table,
            refused,
        }
    }

    /// Whether a call for `request` over names of `fingerprint` may be answered
    /// from this memo with the ledger as it is.
    pub(super) fn serves(
        &self,
        request: &PodGpuRequest,
        ledger: &Ledger,
        fingerprint: Fingerprint,
    ) -> bool {
        self.fingerprint == fingerprint
            && self.layout == ledger.layout()
            && self.request == *request
    }

    /// Judges again the nodes changed since the memo's generation.
    pub(super) fn refresh(&mut self, ledger: &Ledger, config: &ExtenderConfig) {
        let mut refused = 0;
        let Entries { names, verdicts } = &mut self.recorded;
        for (name, (slot, verdict)) in names.iter().zip(verdicts.iter_mut()) {
            if let Some(slot) = *slot {
                if ledger.changed_at(slot) > self.generation {
                    *verdict = judge(ledger, name, ledger.loaded_at(slot), &self.request, config);
                }
            }
            refused += usize::from(!matches!(verdict, Verdict::Fit(_)));
        }
        self.refused = refused;
        self.generation = ledger.generation();
    }

    /// The entry of the name hashed to `hash` (the first of equal hashes).
    fn find(&self, hash: u64) -> Option<usize> {
        let mask = self.table.len().checked_sub(1)?;
        let mut at = (hash as usize) & mask;
        loop {
            let index = (*self.table.get(at)? as usize).checked_sub(1)?;
            if self.hashes.get(index) == Some(&hash) {
                return Some(index);
            }
            at = (at + 1) & mask;
        }
    }

    /// Whether this memo is for `request`.
    pub(super) fn is_for(&self, request: &PodGpuRequest) -> bool {
        self.request == *request
    }

    /// The answer for the call's `names` (hashed to `hashes`), as a full judgement
    /// gives it; `None` when a name is not the memo's after all (the call is then
    /// judged in full).
    pub(super) fn answer<'n>(
        &self,
        names: &'n [crate::protocol::Name<'_>],
        hashes: &[u64],
    ) -> Option<MemoAnswer<'n>> {
        let best = self
            .recorded
            .verdicts
            .iter()
            .filter_map(|(_, v)| match v {
                Verdict::Fit(score) => Some(*score),
                _ => None,
            })
            .max();
        let mut answer = MemoAnswer::default();
        let mut refused_left = self.refused;
        for (name, hash) in names.iter().zip(hashes) {
            if (answer.chosen.is_some() || best.is_none()) && refused_left == 0 {
                break;
            }
            let name: &'n str = name.0.as_ref();
            let index = self.find(*hash)?;
            let (_, verdict) = self.recorded.verdicts.get(index)?;
            if self.recorded.names.get(index) != Some(name) {
                return None;
            }
            match verdict {
                Verdict::Fit(score) => {
                    if answer.chosen.is_none() && Some(*score) == best {
                        answer.chosen = Some((name, *score));
                    }
                }
                Verdict::Failed(why) => {
                    answer.failed.push((name, why.clone()));
                    refused_left = refused_left.checked_sub(1)?;
                }
                Verdict::Unresolvable(why) => {
                    answer.unresolvable.push((name, why.clone()));
                    refused_left = refused_left.checked_sub(1)?;
                }
            }
        }
        (refused_left == 0 && (best.is_none() || answer.chosen.is_some())).then_some(answer)
    }
}

#[cfg(test)]
mod tests {
    use super::JoinedNames;

    #[test]
    fn joined_names_are_found_by_index_and_in_order() {
        let mut names = JoinedNames::with_capacity(3);
        for name in ["node-a", "", "node-bc"] {
            names.push(name);
        }
        assert_eq!(
            [0, 1, 2, 3].map(|i| names.get(i)),
            [Some("node-a"), Some(""), Some("node-bc"), None]
        );
        assert_eq!(names.iter().collect::<Vec<_>>(), ["node-a", "", "node-bc"]);
        names.clear();
        assert_eq!(names.get(0), None);
        assert_eq!(names.iter().count(), 0);
    }
}
