//! A pod's shares, a container at a time (init containers in their phases),
//! within what the pod's selection and topology scope allow: fit, score, allocate
//! and the reasons a node is refused.

use super::*;

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
pub(super) fn add_shares(sums: &mut BTreeMap<String, GpuShare>, shares: &[GpuShare]) {
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
pub(super) fn phase_use(phase: &[usize], grants: &[Vec<GpuShare>]) -> BTreeMap<String, GpuShare> {
    let mut sums = BTreeMap::new();
    for &index in phase {
        add_shares(&mut sums, &grants[index]);
    }
    sums
}

/// Raises `booked` to hold `used` as well, resource by resource.
pub(super) fn book(booked: &mut BTreeMap<String, GpuShare>, used: BTreeMap<String, GpuShare>) {
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
pub(super) fn container_unfit(container: &ContainerGpuRequest, reason: Unfit) -> Unfit {
    Unfit::Container {
        noun: container.role.noun(),
        name: container.name.clone(),
        reason: Box::new(reason),
    }
}

/// Biggest first: whole and multi-GPU requests before shares, so shares fill around them.
pub(super) fn size(request: &GpuRequest) -> (u32, u64, u64, u64) {
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
pub(super) fn allocate_init(
    during: &NodeState,
    sidecars: &BTreeMap<String, GpuShare>,
    booked: &BTreeMap<String, GpuShare>,
    request: &GpuRequest,
    policy: Policy,
) -> Result<Vec<GpuShare>, Unfit> {
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
pub(super) fn allocate_pod_on(
    node: &NodeState,
    request: &PodGpuRequest,
    policy: Policy,
) -> Result<PodPlacement, Unfit> {
    if let [only] = request.containers.as_slice() {
        // The common case: one container, the whole pod's request.
        let placement =
            allocate(node, &only.gpu, policy).map_err(|reason| container_unfit(only, reason))?;
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
            .map_err(|reason| container_unfit(container, reason))?;
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
                .map_err(|reason| container_unfit(container, reason))?;
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
pub(super) fn as_selected<'a>(node: &'a NodeState, request: &PodGpuRequest) -> Cow<'a, NodeState> {
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
pub(super) fn views<'a>(node: &'a NodeState, request: &PodGpuRequest) -> Vec<Cow<'a, NodeState>> {
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
pub(super) enum Place<'a> {
    Switch(&'a str),
    Numa(i32),
    Alone(usize),
}

/// Each GPU's place for `scope`, in the node's order.
pub(super) fn places_of(node: &NodeState, scope: TopologyScope) -> Vec<Place<'_>> {
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
pub(super) fn scope_unfit(node: &NodeState, request: &PodGpuRequest) -> Option<Unfit> {
    let scope = request.selection.scope.as_ref()?;
    let unplaced = places_of(node, scope.scope)
        .iter()
        .filter(|p| matches!(p, Place::Alone(_)))
        .count();
    Some(Unfit::Scope(Box::new(ScopeUnfit {
        annotation: scope.annotation.to_string(),
        scope: scope.scope.name(),
        noun: scope.scope.noun(),
        unplaced,
        total: node.gpus.len(),
    })))
}

/// `reason`, saying what the pod's selection and sharing group leave it of the node.
pub(super) fn with_selection(reason: Unfit, node: &NodeState, request: &PodGpuRequest) -> Unfit {
    let total = node.gpus.len();
    let mut notes = Vec::new();
    let ruled_out = node
        .gpus
        .iter()
        .filter(|g| !request.selection.allows(&g.uuid, &g.labels))
        .count();
    if ruled_out > 0 {
        notes.push(Narrowing::RuledOut {
            count: ruled_out,
            total,
            selection: request.selection.describe(),
        });
    }
    let held = node.gpus.iter().filter(|g| !g.groups.is_empty()).count();
    match request.sharing_group.as_deref() {
        Some(group) if node.gpus.iter().any(|g| g.groups.contains_key(group)) => {
            notes.push(Narrowing::GroupHere {
                group: group.to_owned(),
            });
        }
        Some(group) => {
            let idle = node.gpus.iter().filter(|g| g.usable() && !g.closed).count();
            notes.push(Narrowing::GroupNew {
                group: group.to_owned(),
                idle,
                total,
            });
        }
        None if held > 0 => notes.push(Narrowing::HeldByGroups { held, total }),
        None => {}
    }
    if notes.is_empty() {
        return reason;
    }
    Unfit::Narrowed {
        reason: Box::new(reason),
        notes,
    }
}

/// Chooses GPUs for every container of a pod on `node`, or says which container
/// does not fit and why: [`allocate_pod_on`] over the GPUs the pod's selection
/// allows, by the pod's own GPU policy when it names one, else `policy`.
pub fn allocate_pod(
    node: &NodeState,
    request: &PodGpuRequest,
    policy: Policy,
) -> Result<PodPlacement, Unfit> {
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
            allocate_pod_on(&whole, request, policy)
                .err()
                .map_or(Unfit::NoGpu, |reason| {
                    with_selection(reason, &whole, request)
                })
        })),
    }
}

/// How much the GPU policy prefers a place of a scope for `placement`: the mean
/// fullness of the place's GPUs with it booked, higher for binpack (the fuller
/// place), lower for spread.
pub(super) fn place_rank(view: &NodeState, placement: &Placement, policy: Policy) -> f64 {
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
pub(super) fn unfit_in_scope(
    node: &NodeState,
    request: &PodGpuRequest,
    policy: Policy,
) -> Option<Unfit> {
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
pub(super) fn plain_request<'a>(
    node: LoadedNode<'_>,
    request: &'a PodGpuRequest,
) -> Option<&'a GpuRequest> {
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
pub(super) fn score_one_loaded(
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
pub fn unfit_reason_pod(node: &NodeState, request: &PodGpuRequest, policy: Policy) -> Unfit {
    if let Some(reason) = unfit_in_scope(node, request, gpu_policy_of(request, policy)) {
        return reason;
    }
    let node = as_selected(node, request);
    let reason = match request.containers.as_slice() {
        [only] => container_unfit(only, unfit_reason(&node, &only.gpu)),
        _ => allocate_pod_on(&node, request, gpu_policy_of(request, policy))
            .err()
            .unwrap_or(Unfit::Fits),
    };
    with_selection(reason, &node, request)
}

/// Whether `gpu` could hold one share of `request` with nothing else on it:
/// healthy, with memory, and big enough. A GPU held by a device-plugin pod counts:
/// that pod can be preempted like any other.
pub(super) fn could_ever_take(gpu: &GpuState, request: &GpuRequest) -> bool {
    let memory = match request.memory {
        GpuMemory::None => 0,
        GpuMemory::Bytes(bytes) => bytes,
        GpuMemory::Ratio(ratio) => share_of(gpu.memory_total, ratio),
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
pub fn never_fits(node: &NodeState, request: &GpuRequest) -> Option<Unfit> {
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
            .max(),
        _ => None,
    };
    Some(Unfit::Never(Box::new(Never {
        capable,
        healthy,
        total: node.gpus.len(),
        asked: asked(request),
        largest,
        needed: request.count,
    })))
}

/// Why the pod can never fit on `node`, even emptied of every pod (device-plugin
/// pods included), naming the container; `None` when preemption may help. Only
/// called for nodes the pod does not fit now. GPUs the pod's selection rules out
/// never count: no eviction changes a GPU's model or UUID.
pub fn never_fits_pod(node: &NodeState, request: &PodGpuRequest, policy: Policy) -> Option<Unfit> {
    if request.selection.scope.is_some() {
        // Some place of the scope that could ever hold the pod: preemption may help.
        let first = views(node, request)
            .iter()
            .map(|view| never_fits_on(view, request, policy))
            .collect::<Option<Vec<Unfit>>>()?
            .into_iter()
            .next();
        return match (
            scope_unfit(node, request),
            never_fits_on(&as_selected(node, request), request, policy),
        ) {
            // The node emptied would hold it, only not in one place of the scope.
            (Some(scope), None) => Some(Unfit::ScopeNever(Box::new(scope))),
            (_, reason) => reason.or(first),
        };
    }
    never_fits_on(&as_selected(node, request), request, policy)
}

/// [`never_fits_pod`] on a node view as the pod may use it.
pub(super) fn never_fits_on(
    node: &NodeState,
    request: &PodGpuRequest,
    policy: Policy,
) -> Option<Unfit> {
    let reason = match request.containers.as_slice() {
        [only] => never_fits(node, &only.gpu).map(|reason| container_unfit(only, reason)),
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
                .map(|reason| Unfit::NeverEmptied(Box::new(reason)))
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
