//! Why a pod's GPUs do not fit a node, typed: the allocator builds an [`Unfit`]
//! where it decides, callers tell the cases apart by its variants, and its
//! `Display` is the one text kube-scheduler's `FailedNodes`, the bind's refusal, the
//! pod's Event and `simulate` show.

use std::fmt;

use super::*;

/// Why a request does not fit a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unfit {
    /// The node reports no GPUs (no Device CR).
    NoGpus,
    /// Too few of the node's usable GPUs have room for one container's request now.
    NoRoom(Box<NoRoom>),
    /// Too few healthy GPUs could hold one container's request even with nothing
    /// running: no eviction helps.
    Never(Box<Never>),
    /// The pod's containers do not fit together even on the node emptied.
    NeverEmptied(Box<Unfit>),
    /// The node as a whole has room, but no place of the pod's required topology
    /// scope does.
    Scope(Box<ScopeUnfit>),
    /// [`Unfit::Scope`], and so even with nothing running.
    ScopeNever(Box<Unfit>),
    /// One of the pod's containers does not fit.
    Container {
        /// `container`, `init container` or `sidecar`.
        noun: &'static str,
        /// Its name.
        name: String,
        /// Why.
        reason: Box<Unfit>,
    },
    /// `reason`, on the GPUs the pod's selection and sharing group leave it; each
    /// note says what they took.
    Narrowed {
        /// Why, on what is left.
        reason: Box<Unfit>,
        /// What the selection and the sharing groups took, in order.
        notes: Vec<Narrowing>,
    },
    /// The pod fits after all, or asks no GPU: what a caller asked about a pod
    /// that does not need a reason gets.
    Fits,
    /// The pod's containers were placed but no GPU was booked.
    NoGpu,
}

/// [`Unfit::NoRoom`]: what the node has and what was asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoRoom {
    /// Usable GPUs with room for one share.
    pub fitting: usize,
    /// Usable GPUs.
    pub usable: usize,
    /// Every GPU the node reports.
    pub total: usize,
    /// GPUs held by device-plugin pods.
    pub legacy: usize,
    /// Unhealthy GPUs (not counting those held by device-plugin pods).
    pub unhealthy: usize,
    /// What one GPU of the request asks, in words.
    pub asked: String,
    /// GPUs the request needs.
    pub needed: u32,
    /// The freest usable GPU: free compute percent, free and total memory bytes.
    pub freest: Option<(u64, u64, u64)>,
}

/// [`Unfit::Never`]: how many healthy GPUs could ever hold one share.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Never {
    /// Healthy GPUs big enough for one share with nothing running.
    pub capable: usize,
    /// Healthy GPUs.
    pub healthy: usize,
    /// Every GPU the node reports.
    pub total: usize,
    /// What one GPU of the request asks, in words.
    pub asked: String,
    /// The largest healthy GPU's memory, when the request asks bytes.
    pub largest: Option<u64>,
    /// GPUs the request needs.
    pub needed: u32,
}

/// [`Unfit::Scope`]: the scope the pod requires and what the node reports of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScopeUnfit {
    /// The annotation that asked for it.
    pub annotation: String,
    /// The scope's name (`NUMANode`, `PCIeSwitch`, …).
    pub scope: &'static str,
    /// What one place of it is called (`NUMA node`, `PCIe switch`, …).
    pub noun: &'static str,
    /// GPUs that report no place of the scope, each one alone.
    pub unplaced: usize,
    /// Every GPU the node reports.
    pub total: usize,
}

/// What the pod's selection or sharing group took from a node, beside a reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Narrowing {
    /// GPUs the pod's selection (model, UUID) rules out.
    RuledOut {
        /// How many.
        count: usize,
        /// Of how many.
        total: usize,
        /// The selection, in words.
        selection: String,
    },
    /// The pod's sharing group holds a GPU here, the only one its pods use.
    GroupHere {
        /// The group.
        group: String,
    },
    /// The pod's sharing group is new and needs an idle GPU.
    GroupNew {
        /// The group.
        group: String,
        /// Idle GPUs.
        idle: usize,
        /// Every GPU.
        total: usize,
    },
    /// GPUs other sharing groups hold, shared with no other pod.
    HeldByGroups {
        /// How many.
        held: usize,
        /// Of how many.
        total: usize,
    },
}

impl fmt::Display for Unfit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoGpus => f.write_str("no GPUs reported (no Device CR)"),
            Self::NoRoom(room) => {
                let NoRoom {
                    fitting,
                    usable,
                    total,
                    legacy,
                    unhealthy,
                    asked,
                    needed,
                    freest,
                } = room.as_ref();
                let held: Vec<String> = [
                    (*legacy, "held by device-plugin pods"),
                    (*unhealthy, "unhealthy"),
                ]
                .into_iter()
                .filter(|(n, _)| *n > 0)
                .map(|(n, what)| format!("{n} {what}"))
                .collect();
                write!(f, "{fitting} of {usable} usable GPUs ({total} total")?;
                if !held.is_empty() {
                    write!(f, ": {}", held.join(", "))?;
                }
                write!(f, ") have room for {asked}, {needed} needed")?;
                if let Some((core, memory, of)) = freest {
                    write!(
                        f,
                        "; the freest has {core}% compute and {} of {} free",
                        gib_text(*memory),
                        gib_text(*of)
                    )?;
                }
                Ok(())
            }
            Self::Never(never) => {
                let Never {
                    capable,
                    healthy,
                    total,
                    asked,
                    largest,
                    needed,
                } = never.as_ref();
                write!(
                    f,
                    "never fits: {capable} of {healthy} healthy GPUs ({total} total) could hold {asked} even with nothing running"
                )?;
                if let Some(largest) = largest {
                    write!(f, " (the largest healthy GPU holds {})", gib_text(*largest))?;
                }
                write!(f, "; {needed} needed")
            }
            Self::NeverEmptied(reason) => {
                write!(f, "never fits, even with nothing running: {reason}")
            }
            Self::Scope(scope) => {
                let ScopeUnfit {
                    annotation,
                    scope,
                    noun,
                    unplaced,
                    total,
                } = scope.as_ref();
                write!(
                    f,
                    "{annotation} gpu.requiredTopologyScope {scope:?} requires all of the pod's GPUs under one {noun}, and no {noun} of this node has room for them"
                )?;
                if *unplaced > 0 {
                    write!(
                        f,
                        " ({unplaced} of its {total} GPUs report no {noun}, so each is one alone)"
                    )?;
                }
                Ok(())
            }
            Self::ScopeNever(scope) => {
                write!(f, "never fits: {scope}, even with nothing running")
            }
            Self::Container { noun, name, reason } => write!(f, "{noun} {name}: {reason}"),
            Self::Narrowed { reason, notes } => {
                write!(f, "{reason}")?;
                notes.iter().try_for_each(|note| write!(f, "; {note}"))
            }
            Self::Fits => f.write_str("fits"),
            Self::NoGpu => f.write_str("no GPU"),
        }
    }
}

impl fmt::Display for Narrowing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::RuledOut {
                count,
                total,
                selection,
            } => write!(f, "{count} of {total} GPUs ruled out by {selection}"),
            Self::GroupHere { group } => write!(
                f,
                "sharing group {group:?} holds a GPU here and its pods use that GPU only"
            ),
            Self::GroupNew { group, idle, total } => write!(
                f,
                "sharing group {group:?} is new and takes an idle GPU ({idle} of {total} idle)"
            ),
            Self::HeldByGroups { held, total } => write!(
                f,
                "{held} of {total} GPUs held by sharing groups, which share them with no other pod"
            ),
        }
    }
}

/// Compares the words: the tests hold the texts users see.
#[cfg(test)]
impl PartialEq<&str> for Unfit {
    fn eq(&self, other: &&str) -> bool {
        let words = self.to_string();
        words.as_str() == *other
    }
}

impl std::error::Error for Unfit {}
