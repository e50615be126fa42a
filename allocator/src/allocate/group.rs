//! Sharing groups: where a group's GPUs are, and how many a namespace's groups
//! may hold; selections no GPU of the cluster passes.

use super::*;

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
