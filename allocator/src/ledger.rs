//! The scheduler's view of GPU use, derived from Device CRs and pods: per node, its
//! GPUs (from the Device CR) with the use of every assigned, non-terminated pod's
//! allocation annotation, plus reservations: tentative ones (taken when filter or
//! prioritize chose a node for a pod, so the next scheduling cycles see the choice
//! before its bind arrives), allocations in flight (reserved by a bind that has not
//! finished, or annotated on a pod that is not bound), both of which expire after
//! the TTL, and assumed ones (the Binding succeeded, the watch has not shown the
//! bound pod yet), which only the watch or a delete ends. It also knows, for
//! preemption, each running pod's priority and which pods hold GPUs through the
//! device plugin. Pure data: the cluster watchers feed it, the extender reads it.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use k8s_openapi::api::core::v1::Pod;
use tessera_api::resources::{
    DEVICE_ALLOCATED, DEVICE_TYPE_GPU, GPU_CORE, GPU_MEMORY, GPU_MEMORY_RATIO, NVLINK_PEERS,
    SWITCH_UNPROVEN,
};
use tessera_api::{Device, DeviceAllocation, DeviceAllocations, NvlinkPeers, Quantity};

use crate::allocate::{
    GpuHolder, GpuShare, GpuState, LoadedNode, NodeLoad, NodeState, Placement, PodPlacement,
    account,
};

/// A pod's use of one node.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PodUse {
    node: String,
    /// The annotation, kept to re-resolve ratios when the node's GPUs change.
    allocations: DeviceAllocations,
    placement: Placement,
    /// `spec.priority` (0 when unset, as kube-scheduler reads it).
    priority: i32,
}

/// Where a reservation stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Filter or prioritize chose this node for the pod; its bind has not begun.
    /// Replaced by the pod's next cycle or its bind, given back at `expires_at`.
    Tentative { expires_at: u64 },
    /// Reserve → bind not finished (or annotated, not bound): given back at `expires_at`.
    InFlight { expires_at: u64 },
    /// Bound: held until the watch shows the bound pod (then the pod counts) or it is deleted.
    Assumed,
}

/// An allocation made by this scheduler but not yet counted from the bound pod.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Reservation {
    node: String,
    placement: Placement,
    phase: Phase,
}

/// Pod's own in-flight hold, set aside while kube-scheduler judges the pod again
/// ([`Ledger::set_aside`]); [`Ledger::put_back`] restores it.
#[derive(Debug)]
#[must_use = "a hold set aside must be put back"]
pub struct SetAside {
    uid: String,
    reservation: Reservation,
}

mod convert;
mod nodes;
pub use convert::*;
use nodes::*;

/// Seconds an in-flight reservation holds unless told otherwise.
pub const DEFAULT_IN_FLIGHT_TTL: u64 = 30;

/// Per-node GPU state with every known use applied.
#[derive(Debug, Default)]
pub struct Ledger {
    /// Node → GPUs with use applied.
    nodes: Nodes,
    /// Pod UID → its use (from its annotation).
    pods: HashMap<String, PodUse>,
    /// Node → UIDs of pods using it.
    by_node: HashMap<String, BTreeSet<String>>,
    /// Pod UID → reserved allocation (in flight or assumed).
    reservations: HashMap<String, Reservation>,
    /// Pod UID → the annotation of an unbound pod whose GPUs are on no known node yet.
    unplaced: HashMap<String, DeviceAllocations>,
    /// Pod UID → `spec.priority` of every pod that holds its node (assigned, not
    /// finished), GPUs or not: preemption orders victims by it.
    priorities: HashMap<String, i32>,
    /// Node → UIDs of the pods holding its GPUs through the device plugin (from the
    /// Device CR's kubelet checkpoint).
    legacy_pods: HashMap<String, BTreeSet<String>>,
    /// Nodes whose Device CR says their switch to the runtime proxy is unproven
    /// (`tessera.io/switch-unproven: "true"`): no GPU pod goes there.
    unproven: BTreeSet<String>,
    /// The latest time [`Ledger::expire`] was given (seconds, the caller's clock).
    clock: u64,
    /// Seconds an in-flight reservation found on an unbound pod holds; 0 = the default.
    in_flight_ttl: u64,
}

impl Ledger {
    fn remove_use(&mut self, uid: &str) {
        if let Some(old) = self.pods.remove(uid) {
            if let Some(node) = self.nodes.get_mut(old.node.as_str()) {
                node.account(&old.placement, false);
            }
            if let Some(set) = self.by_node.get_mut(&old.node) {
                set.remove(uid);
            }
        }
    }

    fn remove_reservation(&mut self, uid: &str) -> Option<Reservation> {
        let reservation = self.reservations.remove(uid)?;
        if let Some(node) = self.nodes.get_mut(reservation.node.as_str()) {
            node.account(&reservation.placement, false);
        }
        Some(reservation)
    }

    /// A Device CR was added or changed: its node's GPUs, then every use re-applied.
    pub fn apply_device(&mut self, device: &Device) {
        let Some(name) = device.metadata.name.clone() else {
            return;
        };
        let mut node = NodeState {
            name: name.clone(),
            gpus: device_gpus(device),
        };
        for uid in self.by_node.get(&name).into_iter().flatten() {
            if let Some(used) = self.pods.get_mut(uid) {
                // Memory given as a ratio depends on the GPU's size: resolve it again.
                used.placement = placement_of(&used.allocations, &node.gpus);
                account(&mut node, &used.placement, true);
            }
        }
        for reservation in self.reservations.values().filter(|r| r.node == name) {
            account(&mut node, &reservation.placement, true);
        }
        self.nodes.insert(&name, LedgerNode::new(node));
        self.legacy_pods
            .insert(name.clone(), legacy_pod_uids(device));
        let unproven = device
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(SWITCH_UNPROVEN))
            .is_some_and(|v| v == "true");
        if unproven {
            self.unproven.insert(name.clone());
        } else {
            self.unproven.remove(&name);
        }
        // Unbound annotated pods seen before this node's GPUs: in flight here now.
        let arrived: Vec<String> = self
            .unplaced
            .iter()
            .filter(|(_, allocations)| self.node_of_gpus(allocations) == Some(name.as_str()))
            .map(|(uid, _)| uid.clone())
            .collect();
        for uid in arrived {
            if let Some(allocations) = self.unplaced.remove(&uid) {
                self.hold_unbound(&uid, &allocations);
            }
        }
    }

    /// The node holding the first GPU of `allocations` (GPU UUIDs are unique).
    fn node_of_gpus(&self, allocations: &DeviceAllocations) -> Option<&str> {
        let first = &allocations.gpus().first()?.id;
        self.nodes
            .values()
            .find(|node| node.state.gpus.iter().any(|gpu| &gpu.uuid == first))
            .map(|node| node.state.name.as_str())
    }

    /// An annotated pod that is not bound: its GPUs are in flight (its bind may be
    /// running, or may finish on a retry), unless a bind's reservation already holds
    /// them. A tentative one gives way: the annotation says where the pod goes.
    fn hold_unbound(&mut self, uid: &str, allocations: &DeviceAllocations) {
        if self
            .reservations
            .get(uid)
            .is_some_and(|r| !matches!(r.phase, Phase::Tentative { .. }))
        {
            return;
        }
        let Some(node) = self.node_of_gpus(allocations).map(str::to_owned) else {
            self.unplaced.insert(uid.to_owned(), allocations.clone());
            return;
        };
        let placement = self.placement_on(&node, allocations);
        let ttl = match self.in_flight_ttl {
            0 => DEFAULT_IN_FLIGHT_TTL,
            ttl => ttl,
        };
        let expires_at = self.clock + ttl;
        self.reserve(uid, &node, placement, expires_at);
    }

    /// The placement `allocations` make on node `name`, read against its GPUs as
    /// they are now ([`placement_of`]; against none when the node is unknown).
    fn placement_on(&self, name: &str, allocations: &DeviceAllocations) -> Placement {
        let gpus = self
            .nodes
            .get(name)
            .map_or(&[][..], |n| n.state.gpus.as_slice());
        placement_of(allocations, gpus)
    }

    /// Pod `uid`, read from the API server bound to `node` with `allocations`,
    /// before the watch shows it so: its GPUs are held as an assumed use, replacing
    /// whatever hold it had, until the watch shows the pod (then the pod itself
    /// counts) or its delete. Nothing when the watch has shown it already: its use
    /// counts, and a hold beside it would count it twice.
    pub fn hold_bound(&mut self, uid: &str, node: &str, allocations: &DeviceAllocations) {
        if self.pods.contains_key(uid) {
            return;
        }
        let placement = self.placement_on(node, allocations);
        self.reserve(uid, node, placement, u64::MAX);
        self.assume(uid);
    }

    /// Sets how long an in-flight reservation found on an unbound pod holds.
    pub fn set_in_flight_ttl(&mut self, seconds: u64) {
        self.in_flight_ttl = seconds;
    }

    /// A Device CR was deleted.
    pub fn delete_device(&mut self, name: &str) {
        self.nodes.remove(name);
        self.legacy_pods.remove(name);
        self.unproven.remove(name);
    }

    /// Whether node `name`'s switch to the runtime proxy is unproven (its Device
    /// CR says so): no GPU hook runs there yet.
    pub fn switch_unproven(&self, name: &str) -> bool {
        self.unproven.contains(name)
    }

    /// A pod was added or changed.
    pub fn apply_pod(&mut self, pod: &Pod) {
        let Some(uid) = pod.metadata.uid.clone() else {
            return;
        };
        self.remove_use(&uid);
        match holds_devices(pod) {
            Some(_) => {
                let priority = pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0);
                self.priorities.insert(uid.clone(), priority);
            }
            None => {
                self.priorities.remove(&uid);
            }
        }
        let annotation = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(DEVICE_ALLOCATED));
        let allocations = annotation.and_then(|text| DeviceAllocations::parse(text).ok());
        let Some(node_name) = holds_devices(pod) else {
            let finished = pod
                .status
                .as_ref()
                .and_then(|s| s.phase.as_deref())
                .is_some_and(|p| p == "Succeeded" || p == "Failed");
            if finished {
                // Finished pods give their GPUs back.
                self.remove_reservation(&uid);
                self.unplaced.remove(&uid);
            } else if let Some(allocations) = &allocations {
                // Annotated, not bound: in flight. (An unannotated event never ends
                // a reservation: it may predate the bind that made it.)
                self.hold_unbound(&uid, allocations);
            }
            return;
        };
        self.unplaced.remove(&uid);
        let Some(allocations) = allocations else {
            return;
        };
        // Seen bound: the pod's own annotation now counts, not the reservation.
        self.remove_reservation(&uid);
        let placement = self.placement_on(node_name, &allocations);
        if let Some(node) = self.nodes.get_mut(node_name) {
            node.account(&placement, true);
        }
        self.by_node
            .entry(node_name.to_owned())
            .or_default()
            .insert(uid.clone());
        let priority = self.priorities.get(&uid).copied().unwrap_or(0);
        self.pods.insert(
            uid,
            PodUse {
                node: node_name.to_owned(),
                allocations,
                placement,
                priority,
            },
        );
    }

    /// A pod was deleted.
    pub fn delete_pod(&mut self, uid: &str) {
        self.remove_use(uid);
        self.remove_reservation(uid);
        self.unplaced.remove(uid);
        self.priorities.remove(uid);
    }

    /// The pods holding GPU shares of node `name` from their allocation annotation
    /// (bound and seen so), with their priority: who preemption may evict there.
    /// Reservations (tentative, in flight, assumed) are not among them: their pods
    /// are not running on the node as kube-scheduler's dry run sees it.
    pub fn gpu_holders(&self, name: &str) -> Vec<GpuHolder> {
        self.by_node
            .get(name)
            .into_iter()
            .flatten()
            .filter_map(|uid| {
                let used = self.pods.get(uid)?;
                Some(GpuHolder {
                    uid: uid.clone(),
                    priority: used.priority,
                    placement: used.placement.clone(),
                })
            })
            .collect()
    }

    /// Whether pod `uid` holds GPUs of node `name` through the device plugin.
    pub fn holds_legacy_gpus(&self, name: &str, uid: &str) -> bool {
        self.legacy_pods
            .get(name)
            .is_some_and(|uids| uids.contains(uid))
    }

    /// `spec.priority` of a pod that holds its node, if the watch has shown it.
    pub fn priority(&self, uid: &str) -> Option<i32> {
        self.priorities.get(uid).copied()
    }

    /// The node's GPUs with all use applied, in flight included.
    pub fn node(&self, name: &str) -> Option<&NodeState> {
        self.nodes.get(name).map(|node| &node.state)
    }

    /// The node's GPUs with all use applied, and their load (what filter and
    /// prioritize read of each candidate node), in one lookup.
    pub fn loaded_node(&self, name: &str) -> Option<LoadedNode<'_>> {
        self.nodes.get(name).map(|node| LoadedNode {
            state: &node.state,
            load: &node.load,
        })
    }

    /// Advances with every change of any node's GPUs or use, and of which nodes
    /// there are: while it stays, what was read of [`Ledger::loaded_node`] holds.
    pub fn generation(&self) -> u64 {
        self.nodes.generation
    }

    /// [`Ledger::loaded_node`] with the node's slot: its place in the ledger's
    /// node table, stable while [`Ledger::layout`] stays.
    pub fn loaded_node_slot(&self, name: &str) -> Option<(usize, LoadedNode<'_>)> {
        let slot = self.nodes.slot(name)?;
        let (_, node) = self.nodes.slots.get(slot)?;
        Some((
            slot,
            LoadedNode {
                state: &node.state,
                load: &node.load,
            },
        ))
    }

    /// The node at `slot` ([`Ledger::loaded_node_slot`]).
    pub fn loaded_at(&self, slot: usize) -> Option<LoadedNode<'_>> {
        self.nodes.slots.get(slot).map(|(_, node)| LoadedNode {
            state: &node.state,
            load: &node.load,
        })
    }

    /// Advances whenever nodes come or go (slots move); a node's change shows in
    /// [`Ledger::changed_at`] instead.
    pub fn layout(&self) -> u64 {
        self.nodes.layout
    }

    /// The [`Ledger::generation`] at which the node at `slot` last changed (its
    /// GPUs, its use, its switch mark); `u64::MAX` for no such slot.
    pub fn changed_at(&self, slot: usize) -> u64 {
        self.nodes.stamp(slot)
    }

    /// Every node with a Device CR.
    pub fn nodes(&self) -> impl Iterator<Item = &NodeState> {
        self.nodes.values().map(|node| &node.state)
    }

    /// Holds `placement` on `node` for pod `uid` tentatively: filter or prioritize
    /// chose the node, so the cycles after this one see the GPUs taken before the
    /// pod's bind arrives. Replaces the pod's earlier tentative reservation; does
    /// nothing (returns false) when a bind holds the pod's GPUs already (in flight
    /// or assumed). Ends with the pod's bind ([`Ledger::reserve`]), its next cycle
    /// ([`Ledger::release_tentative`]), the bound pod seen, a delete, or
    /// `expires_at` passing.
    pub fn reserve_tentative(
        &mut self,
        uid: &str,
        node: &str,
        placement: Placement,
        expires_at: u64,
    ) -> bool {
        if !self.release_tentative(uid) && self.reservations.contains_key(uid) {
            return false;
        }
        if let Some(state) = self.nodes.get_mut(node) {
            state.account(&placement, true);
        }
        self.reservations.insert(
            uid.to_owned(),
            Reservation {
                node: node.to_owned(),
                placement,
                phase: Phase::Tentative { expires_at },
            },
        );
        true
    }

    /// Takes pod `uid`'s in-flight hold out of the count while kube-scheduler
    /// judges the pod again (filter, prioritize). kube-scheduler schedules only
    /// unbound pods, so the hold is left from an attempt that did not bind: a bind
    /// that failed or timed out without its outcome known, or the pod's annotation
    /// seen unbound after a relist. Counted against the pod itself it would keep
    /// the pod off its own GPUs until the hold expired, and kube-scheduler, which
    /// sees no event then, would leave the pod waiting for minutes. Nothing else
    /// sees the ledger meanwhile (the caller holds its lock), and an assumed
    /// reservation (bound) is never set aside.
    pub fn set_aside(&mut self, uid: &str) -> Option<SetAside> {
        let in_flight = self
            .reservations
            .get(uid)
            .is_some_and(|r| matches!(r.phase, Phase::InFlight { .. }));
        if !in_flight {
            return None;
        }
        let reservation = self.remove_reservation(uid)?;
        Some(SetAside {
            uid: uid.to_owned(),
            reservation,
        })
    }

    /// Restores what [`Ledger::set_aside`] took out; it supersedes whatever the pod
    /// was given meanwhile.
    pub fn put_back(&mut self, aside: Option<SetAside>) {
        let Some(SetAside { uid, reservation }) = aside else {
            return;
        };
        self.remove_reservation(&uid);
        if let Some(node) = self.nodes.get_mut(reservation.node.as_str()) {
            node.account(&reservation.placement, true);
        }
        self.reservations.insert(uid, reservation);
    }

    /// Gives back pod `uid`'s tentative reservation, if it has one (and only that:
    /// a bind's reservation stays); returns whether it had one.
    pub fn release_tentative(&mut self, uid: &str) -> bool {
        let tentative = self
            .reservations
            .get(uid)
            .is_some_and(|r| matches!(r.phase, Phase::Tentative { .. }));
        tentative && self.remove_reservation(uid).is_some()
    }

    /// The node of pod `uid`'s tentative reservation.
    pub fn tentative_node(&self, uid: &str) -> Option<&str> {
        self.reservations
            .get(uid)
            .filter(|r| matches!(r.phase, Phase::Tentative { .. }))
            .map(|r| r.node.as_str())
    }

    /// Holds `placement` for pod `uid` in flight: until [`Ledger::assume`], the
    /// bound pod seen, a delete, or `expires_at` passing. Replaces any reservation
    /// the pod had (its tentative one among them).
    pub fn reserve(&mut self, uid: &str, node: &str, placement: Placement, expires_at: u64) {
        self.remove_reservation(uid);
        if let Some(state) = self.nodes.get_mut(node) {
            state.account(&placement, true);
        }
        self.reservations.insert(
            uid.to_owned(),
            Reservation {
                node: node.to_owned(),
                placement,
                phase: Phase::InFlight { expires_at },
            },
        );
    }

    /// Pod `uid` was bound: its reservation no longer expires; only the watch
    /// showing the bound pod, or its delete, ends it. Returns whether one was held
    /// (none when the watch was faster than the Binding's answer).
    pub fn assume(&mut self, uid: &str) -> bool {
        self.reservations
            .get_mut(uid)
            .filter(|r| !matches!(r.phase, Phase::Tentative { .. }))
            .map(|reservation| reservation.phase = Phase::Assumed)
            .is_some()
    }

    /// Whether pod `uid` has a bind's reservation (in flight or assumed): a bind
    /// of it ran, and a cached copy of the pod may not show what it did.
    pub fn holds_bind(&self, uid: &str) -> bool {
        self.reservations
            .get(uid)
            .is_some_and(|r| !matches!(r.phase, Phase::Tentative { .. }))
    }

    /// Gives back pod `uid`'s in-flight allocation (bind failed).
    pub fn release(&mut self, uid: &str) -> bool {
        self.remove_reservation(uid).is_some()
    }

    /// Gives back in-flight and tentative reservations that expired at `now`
    /// (assumed ones never expire); returns how many in-flight ones (a bind that
    /// did not finish in time), not the tentative ones (a pod that was filtered
    /// and never bound: kube-scheduler chose no node, or is still in PreBind).
    pub fn expire(&mut self, now: u64) -> usize {
        self.clock = self.clock.max(now);
        let expired: Vec<(String, bool)> = self
            .reservations
            .iter()
            .filter_map(|(uid, r)| match r.phase {
                Phase::InFlight { expires_at } if expires_at <= now => Some((uid.clone(), true)),
                Phase::Tentative { expires_at } if expires_at <= now => Some((uid.clone(), false)),
                _ => None,
            })
            .collect();
        for (uid, _) in &expired {
            self.remove_reservation(uid);
        }
        expired.iter().filter(|(_, in_flight)| *in_flight).count()
    }

    /// Number of a bind's reservations, in flight or assumed (tentative ones not
    /// counted: [`Ledger::tentative`]).
    pub fn in_flight(&self) -> usize {
        self.reservations
            .values()
            .filter(|r| !matches!(r.phase, Phase::Tentative { .. }))
            .count()
    }

    /// Number of tentative reservations (filtered or prioritized, bind not begun).
    pub fn tentative(&self) -> usize {
        self.reservations
            .values()
            .filter(|r| matches!(r.phase, Phase::Tentative { .. }))
            .count()
    }

    /// Number of assumed reservations (bound, not yet seen bound).
    pub fn assumed(&self) -> usize {
        self.reservations
            .values()
            .filter(|r| r.phase == Phase::Assumed)
            .count()
    }

    /// Forgets nodes whose Device CR is not in `names` (after a relist: they are gone).
    pub fn retain_devices(&mut self, names: &std::collections::HashSet<String>) {
        self.nodes.retain(|name, _| names.contains(name.as_str()));
        self.legacy_pods.retain(|name, _| names.contains(name));
        self.unproven.retain(|name| names.contains(name));
    }

    /// Forgets the use of pods not in `uids` (after a relist: they are gone).
    pub fn retain_pods(&mut self, uids: &std::collections::HashSet<String>) {
        let gone: Vec<String> = self
            .pods
            .keys()
            .filter(|uid| !uids.contains(*uid))
            .cloned()
            .collect();
        for uid in gone {
            self.remove_use(&uid);
        }
        // Assumed pods not listed were deleted meanwhile. (In-flight ones belong to
        // binds still running and end with them or their TTL.)
        let gone: Vec<String> = self
            .reservations
            .iter()
            .filter(|(uid, r)| r.phase == Phase::Assumed && !uids.contains(*uid))
            .map(|(uid, _)| uid.clone())
            .collect();
        for uid in gone {
            self.remove_reservation(&uid);
        }
        self.unplaced.retain(|uid, _| uids.contains(uid));
        self.priorities.retain(|uid, _| uids.contains(uid));
    }
}

#[cfg(test)]
mod tests;
