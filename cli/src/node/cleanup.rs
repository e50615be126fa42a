//! Taking Tessera off nodes: whether an installer pod's DaemonSet still stands (a
//! rollout keeps the node switched, an uninstall switches it back), and `tessera
//! node cleanup`, which removes what tessera-reporter published on nodes.

use super::*;

/// How an installer pod's DaemonSet stands when the pod is told to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    /// It is there: a rollout or a drain; the node stays switched.
    Present,
    /// Deleted, being deleted, or forbidden to this pod (its RBAC goes with the
    /// chart): an uninstall; the node is switched back.
    Uninstalled,
    /// Not known (the API did not answer): the node stays switched, because a
    /// node switched back without need runs containers with no GPU hook.
    Unknown,
}

/// Reads the DaemonSet `namespace/name` of an installer pod.
pub async fn owner(client: kube::Client, daemonset: &str) -> Owner {
    use k8s_openapi::api::apps::v1::DaemonSet;
    let Some((namespace, name)) = daemonset.split_once('/') else {
        return Owner::Unknown;
    };
    let api: Api<DaemonSet> = Api::namespaced(client, namespace);
    let read = tokio::time::timeout(Duration::from_secs(10), api.get_opt(name)).await;
    owner_from(read.ok())
}

pub(super) fn owner_from(
    read: Option<Result<Option<k8s_openapi::api::apps::v1::DaemonSet>, kube::Error>>,
) -> Owner {
    match read {
        Some(Ok(Some(set))) if set.metadata.deletion_timestamp.is_none() => Owner::Present,
        Some(Ok(_)) => Owner::Uninstalled,
        // The token is kept fresh (`token_through_fd`): a 401 means the service
        // account is gone, which `helm uninstall` does beside the DaemonSet.
        Some(Err(kube::Error::Api(e))) if matches!(e.code, 401 | 403 | 404) => Owner::Uninstalled,
        _ => Owner::Unknown,
    }
}

/// What tessera-reporter publishes on a Node: capacity (and allocatable) names,
/// and labels. `nvidia.com/gpu` only with `--advertise-nvidia-gpu`.
pub(super) const REPORTER_RESOURCES: &[&str] = &[
    "koordinator.sh/gpu-core",
    "koordinator.sh/gpu-memory",
    "koordinator.sh/gpu-memory-ratio",
    "aliyun.com/gpu-mem",
    "nvidia.com/gpumem",
    "nvidia.com/gpucores",
    "volcano.sh/gpu-memory",
];
pub(super) const REPORTER_LABELS: &[&str] = &[
    "node.koordinator.sh/gpu-model",
    "node.koordinator.sh/gpu-driver-version",
    tessera_api::resources::SWITCH_UNPROVEN,
];

/// JSON pointer escaping of one path segment (RFC 6901).
pub(super) fn pointer(segment: &str) -> String {
    segment.replace('~', "~0").replace('/', "~1")
}

/// The JSON patches (status, then the object: labels and taint) that remove what
/// the reporter published on `node`, and the switch taint an unproven switch-over
/// left (its installer may have lost the rights to lift it at an uninstall), each guarded by a `test` of the resourceVersion so that a
/// concurrent writer makes it fail rather than be overwritten; empty when there is
/// nothing to remove.
pub fn cleanup_patches(
    node: &Node,
    nvidia_gpu: bool,
) -> (Vec<serde_json::Value>, Vec<serde_json::Value>) {
    use serde_json::json;
    let guard = || {
        json!({"op": "test", "path": "/metadata/resourceVersion",
               "value": node.metadata.resource_version.clone().unwrap_or_default()})
    };
    let mut resources: Vec<&str> = REPORTER_RESOURCES.to_vec();
    if nvidia_gpu {
        resources.push(tessera_api::resources::NVIDIA_GPU);
    }
    let status = node.status.as_ref();
    let mut status_ops = Vec::new();
    for field in ["capacity", "allocatable"] {
        let present = status.and_then(|s| match field {
            "capacity" => s.capacity.as_ref(),
            _ => s.allocatable.as_ref(),
        });
        for name in &resources {
            if present.is_some_and(|m| m.contains_key(*name)) {
                status_ops.push(
                    json!({"op": "remove", "path": format!("/status/{field}/{}", pointer(name))}),
                );
            }
        }
    }
    let labels = node.metadata.labels.as_ref();
    let label_ops = REPORTER_LABELS
        .iter()
        .filter(|l| labels.is_some_and(|m| m.contains_key(**l)))
        .map(|l| json!({"op": "remove", "path": format!("/metadata/labels/{}", pointer(l))}));
    // Highest index first, so each removal leaves the next one's index valid.
    let taint_ops = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .into_iter()
        .flat_map(|taints| taints.iter().enumerate().rev())
        .filter(|(_, t)| t.key == TAINT_KEY)
        .map(|(i, _)| json!({"op": "remove", "path": format!("/spec/taints/{i}")}));
    let object_ops: Vec<_> = label_ops.chain(taint_ops).collect();
    let guarded = |ops: Vec<serde_json::Value>| {
        if ops.is_empty() {
            ops
        } else {
            std::iter::once(guard()).chain(ops).collect()
        }
    };
    (guarded(status_ops), guarded(object_ops))
}

/// Removes what tessera-reporter published from `node` (every node when `None`);
/// one line per node saying what went. Refuses a node on which a tessera-reporter
/// pod still runs: it would publish everything again.
pub async fn cleanup(
    client: kube::Client,
    node: Option<&str>,
    nvidia_gpu: bool,
    settle: Duration,
) -> anyhow::Result<Vec<String>> {
    use k8s_openapi::api::core::v1::Pod;
    use kube::api::ListParams;
    let nodes: Api<Node> = Api::all(client.clone());
    let targets = match node {
        Some(name) => vec![
            nodes
                .get(name)
                .await
                .with_context(|| format!("reading node {name}"))?,
        ],
        None => {
            nodes
                .list(&ListParams::default())
                .await
                .context("listing nodes")?
                .items
        }
    };
    let reporters: Vec<Pod> = Api::<Pod>::all(client)
        .list(&ListParams::default().labels("app.kubernetes.io/name=tessera-reporter"))
        .await
        .context("listing tessera-reporter pods")?
        .items;
    let mut done = Vec::new();
    let mut cleaned = Vec::new();
    for target in targets {
        let name = target.metadata.name.clone().unwrap_or_default();
        if reporters.iter().any(|p| {
            p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(name.as_str())
                && p.metadata.deletion_timestamp.is_none()
        }) {
            bail!(
                "a tessera-reporter pod still runs on node {name}: uninstall Tessera first (it would publish everything again)"
            );
        }
        let (status, object) = cleanup_patches(&target, nvidia_gpu);
        let removed = status.len().saturating_sub(1) + object.len().saturating_sub(1);
        let json_patch = |ops: Vec<serde_json::Value>| -> anyhow::Result<Patch<()>> {
            Ok(Patch::Json(serde_json::from_value(
                serde_json::Value::Array(ops),
            )?))
        };
        if !status.is_empty() {
            nodes
                .patch_status(&name, &PatchParams::default(), &json_patch(status)?)
                .await
                .with_context(|| format!("removing Tessera's capacity from node {name}"))?;
        }
        if !object.is_empty() {
            // The status patch moved the resourceVersion: guard the object on the new one.
            let fresh = nodes.get(&name).await?;
            let (_, object) = cleanup_patches(&fresh, nvidia_gpu);
            nodes
                .patch(&name, &PatchParams::default(), &json_patch(object)?)
                .await
                .with_context(|| format!("removing Tessera's labels and taint from node {name}"))?;
        }
        done.push(if removed == 0 {
            format!("node {name}: nothing of Tessera's")
        } else {
            cleaned.push(name.clone());
            format!("node {name}: removed {removed} capacity, allocatable, label and taint entries")
        });
    }
    // A reporter outside the cluster's pods (a systemd service, a process left
    // running) puts it all back within seconds: look again before saying it is gone.
    if !cleaned.is_empty() && !settle.is_zero() {
        tokio::time::sleep(settle).await;
        let mut back = Vec::new();
        for name in &cleaned {
            let node = nodes
                .get(name)
                .await
                .with_context(|| format!("reading node {name} again"))?;
            let (status, object) = cleanup_patches(&node, nvidia_gpu);
            if !status.is_empty() || !object.is_empty() {
                back.push(name.as_str());
            }
        }
        if !back.is_empty() {
            bail!(
                "Tessera's capacity or labels came back on node(s) {} within {} s of their removal: a tessera-reporter still runs for them outside this cluster's pods (a systemd service or a process): stop it (systemctl stop tessera-reporter), then run cleanup again",
                back.join(", "),
                settle.as_secs()
            );
        }
    }
    Ok(done)
}

/// Whether `error` is the API server refusing this identity (401 or 403).
pub(super) fn forbidden(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        matches!(cause.downcast_ref::<kube::Error>(), Some(kube::Error::Api(e)) if matches!(e.code, 401 | 403))
    })
}

pub(super) fn backup_of(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(BACKUP_SUFFIX);
    PathBuf::from(name)
}

/// Writes `text` to `path` through a new temporary file (created exclusively,
/// never through a link) and a rename: kubelet never reads half a file, and
/// nothing planted in the directory redirects the write. The directory must be
/// root's and writable by no one else.
pub(super) fn write_file(path: &Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::MetadataExt;
    let dir = path
        .parent()
        .with_context(|| format!("{} has no directory", path.display()))?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let meta = std::fs::metadata(dir).with_context(|| format!("reading {}", dir.display()))?;
    // Ours (root's, run as root) and writable by no one else.
    let us = std::fs::metadata("/proc/self").map_or(0, |m| m.uid());
    if meta.uid() != us || meta.mode() & 0o022 != 0 {
        bail!(
            "{} is not ours alone (owner {}, mode {:o}): refusing to write kubelet's configuration there",
            dir.display(),
            meta.uid(),
            meta.mode() & 0o7777
        );
    }
    let mut temporary = tempfile::NamedTempFile::new_in(dir)
        .with_context(|| format!("creating a temporary file in {}", dir.display()))?;
    temporary
        .write_all(text.as_bytes())
        .with_context(|| format!("writing {}", temporary.path().display()))?;
    // Readable as kubelet configuration usually is; tempfile creates it 0600.
    temporary
        .as_file()
        .set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o644))
        .with_context(|| format!("writing {}", temporary.path().display()))?;
    temporary
        .persist(path)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
