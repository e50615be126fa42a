//! The pod/container store: which pod a container ID belongs to, for calls that
//! carry only IDs.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use k8s_cri::v1 as cri;
pub use tessera_hook_protocol::lifecycle::{ContainerInfo, PodInfo};

#[derive(Debug, Default)]
struct Inner {
    pods: HashMap<String, Arc<PodInfo>>,
    containers: HashMap<String, ContainerInfo>,
    /// Sandboxes stopped (StopPodSandbox, or NOTREADY when listed): their pods
    /// hold nothing until the sandbox is removed or recreated.
    stopped: std::collections::HashSet<String>,
}

impl Inner {
    /// Records whether a listed sandbox is stopped (anything but READY).
    fn note_state(&mut self, sandbox: &cri::PodSandbox) {
        if sandbox.state != cri::PodSandboxState::SandboxReady as i32 {
            self.stopped.insert(sandbox.id.clone());
        }
    }
}

/// Maps sandbox IDs to pods and container IDs to containers.
///
/// The lock is a std `RwLock` held only for map operations, never across an await.
#[derive(Debug, Default)]
pub struct PodStore {
    inner: RwLock<Inner>,
    /// Tessera's DRA claims, which give pods their allocation (`None`: the
    /// proxy's own marks are still dropped).
    claims: Option<Arc<crate::dra::DraClaims>>,
}

impl PodStore {
    /// A store whose pods get their allocation from `claims` too.
    pub fn with_claims(claims: crate::dra::DraClaims) -> Self {
        Self {
            inner: RwLock::default(),
            claims: Some(Arc::new(claims)),
        }
    }

    /// The pod kubelet's sandbox config describes, with its DRA claims' allocation.
    pub fn pod_from_config(&self, sandbox_id: &str, config: &cri::PodSandboxConfig) -> PodInfo {
        let claims = self.read_claims();
        annotated(claims.as_ref(), PodInfo::from_config(sandbox_id, config))
    }

    /// The pod a runtime listing describes, with its DRA claims' allocation.
    pub fn pod_from_sandbox(&self, sandbox: &cri::PodSandbox) -> PodInfo {
        let claims = self.read_claims();
        annotated(claims.as_ref(), PodInfo::from_sandbox(sandbox))
    }

    /// The pods a runtime listing describes, the claims read once for all.
    fn pods_from_sandboxes(&self, sandboxes: &[cri::PodSandbox]) -> Vec<PodInfo> {
        let claims = self.read_claims();
        sandboxes
            .iter()
            .map(|s| annotated(claims.as_ref(), PodInfo::from_sandbox(s)))
            .collect()
    }

    fn read_claims(&self) -> Option<tessera_api::dra::prepared::PreparedClaims> {
        self.claims.as_ref().map(|claims| claims.read())
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Inner> {
        self.inner
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Inner> {
        self.inner
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records a pod.
    pub fn insert_pod(&self, pod: PodInfo) -> Arc<PodInfo> {
        let pod = Arc::new(pod);
        let mut inner = self.write();
        inner.stopped.remove(&pod.sandbox_id);
        inner.pods.insert(pod.sandbox_id.clone(), Arc::clone(&pod));
        pod
    }

    /// Records that a sandbox was stopped.
    pub fn mark_stopped(&self, sandbox_id: &str) {
        self.write().stopped.insert(sandbox_id.to_owned());
    }

    /// The pods whose sandbox is up.
    pub fn live_pods(&self) -> Vec<Arc<PodInfo>> {
        let inner = self.read();
        inner
            .pods
            .iter()
            .filter(|(id, _)| !inner.stopped.contains(*id))
            .map(|(_, pod)| Arc::clone(pod))
            .collect()
    }

    /// Every known container whose sandbox is up, with its pod.
    pub fn live_containers(&self) -> Vec<(ContainerInfo, Arc<PodInfo>)> {
        let inner = self.read();
        inner
            .containers
            .values()
            .filter(|c| !inner.stopped.contains(&c.sandbox_id))
            .filter_map(|c| Some((c.clone(), inner.pods.get(&c.sandbox_id).cloned()?)))
            .collect()
    }

    /// Records a container.
    pub fn insert_container(&self, container: ContainerInfo) {
        self.write()
            .containers
            .insert(container.id.clone(), container);
    }

    /// The pod of a sandbox.
    pub fn pod(&self, sandbox_id: &str) -> Option<Arc<PodInfo>> {
        self.read().pods.get(sandbox_id).cloned()
    }

    /// The container with this ID and its pod, when both are known.
    pub fn container(&self, container_id: &str) -> Option<(ContainerInfo, Option<Arc<PodInfo>>)> {
        let inner = self.read();
        let container = inner.containers.get(container_id)?.clone();
        let pod = inner.pods.get(&container.sandbox_id).cloned();
        Some((container, pod))
    }

    /// Forgets a sandbox and every container in it.
    pub fn remove_pod(&self, sandbox_id: &str) {
        let mut inner = self.write();
        inner.pods.remove(sandbox_id);
        inner.stopped.remove(sandbox_id);
        inner
            .containers
            .retain(|_, container| container.sandbox_id != sandbox_id);
    }

    /// Forgets a container.
    pub fn remove_container(&self, container_id: &str) {
        self.write().containers.remove(container_id);
    }

    /// Adds what the runtime lists. Entries are added, never cleared, so a call
    /// recorded while the listing was in flight is not lost.
    pub fn load(&self, sandboxes: &[cri::PodSandbox], containers: &[cri::Container]) {
        // Read before the lock: the claims file is not read under it.
        let pods = self.pods_from_sandboxes(sandboxes);
        let mut inner = self.write();
        for (sandbox, pod) in sandboxes.iter().zip(pods) {
            inner.pods.insert(sandbox.id.clone(), Arc::new(pod));
            inner.note_state(sandbox);
        }
        for container in containers {
            inner
                .containers
                .insert(container.id.clone(), container_info(container));
        }
    }

    /// Makes the pods match the runtime's listing of every sandbox: a pod the
    /// runtime no longer has is forgotten (kubelet may have removed it without the
    /// proxy, e.g. while switched back to the runtime), and each sandbox's state is
    /// taken from the listing. Containers of forgotten pods go with them.
    pub fn reconcile(&self, sandboxes: &[cri::PodSandbox]) {
        let fresh = self.pods_from_sandboxes(sandboxes);
        let mut inner = self.write();
        let listed: std::collections::HashSet<&str> =
            sandboxes.iter().map(|s| s.id.as_str()).collect();
        inner.pods.retain(|id, _| listed.contains(id.as_str()));
        let pods: std::collections::HashSet<String> = inner.pods.keys().cloned().collect();
        inner
            .containers
            .retain(|_, container| pods.contains(&container.sandbox_id));
        inner.stopped.clear();
        for (sandbox, pod) in sandboxes.iter().zip(fresh) {
            inner
                .pods
                .entry(sandbox.id.clone())
                .or_insert_with(|| Arc::new(pod));
            inner.note_state(sandbox);
        }
    }

    /// Numbers of pods and containers known.
    pub fn len(&self) -> (usize, usize) {
        let inner = self.read();
        (inner.pods.len(), inner.containers.len())
    }

    /// Whether the store knows nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == (0, 0)
    }
}

/// `pod` with the allocation its prepared claims amount to (`None`: the proxy's
/// own marks dropped only).
fn annotated(
    claims: Option<&tessera_api::dra::prepared::PreparedClaims>,
    mut pod: PodInfo,
) -> PodInfo {
    match claims {
        Some(claims) => crate::dra::annotate(claims, &mut pod),
        None => crate::dra::drop_marks(&mut pod),
    }
    pod
}

/// The store's view of a ListContainers entry.
pub fn container_info(container: &cri::Container) -> ContainerInfo {
    ContainerInfo {
        id: container.id.clone(),
        name: container
            .metadata
            .as_ref()
            .map(|m| m.name.clone())
            .unwrap_or_default(),
        sandbox_id: container.pod_sandbox_id.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sandbox(id: &str, name: &str) -> cri::PodSandbox {
        cri::PodSandbox {
            id: id.into(),
            metadata: Some(cri::PodSandboxMetadata {
                name: name.into(),
                uid: format!("uid-{name}"),
                namespace: "default".into(),
                attempt: 0,
            }),
            annotations: [("a".to_owned(), "b".to_owned())].into(),
            state: if id == "s2" {
                cri::PodSandboxState::SandboxNotready as i32
            } else {
                cri::PodSandboxState::SandboxReady as i32
            },
            ..Default::default()
        }
    }

    fn container(id: &str, sandbox: &str) -> cri::Container {
        cri::Container {
            id: id.into(),
            pod_sandbox_id: sandbox.into(),
            metadata: Some(cri::ContainerMetadata {
                name: format!("c-{id}"),
                attempt: 0,
            }),
            ..Default::default()
        }
    }

    #[test]
    fn load_then_lookup_and_remove() {
        let store = PodStore::default();
        store.load(
            &[sandbox("s1", "p1"), sandbox("s2", "p2")],
            &[container("c1", "s1"), container("c2", "s2")],
        );
        let (info, pod) = store.container("c1").expect("known");
        assert_eq!(info.name, "c-c1");
        let pod = pod.expect("pod known");
        assert_eq!(pod.display_name(), "default/p1");
        assert_eq!(pod.annotations.get("a").map(String::as_str), Some("b"));

        assert_eq!(store.live_pods().len(), 1, "s2 is listed NOTREADY");
        store.mark_stopped("s1");
        assert!(store.live_pods().is_empty());
        store.insert_pod(PodInfo::from_sandbox(&sandbox("s1", "p1")));
        assert_eq!(store.live_pods().len(), 1, "a sandbox run again is live");

        // The runtime lists s1 only: s2, removed behind the proxy's back, is forgotten.
        let s1 = sandbox("s1", "p1");
        store.reconcile(std::slice::from_ref(&s1));
        assert_eq!(store.len(), (1, 1));
        assert_eq!(store.live_pods().len(), 1);
        store.load(&[sandbox("s2", "p2")], &[container("c2", "s2")]);

        store.remove_container("c1");
        assert!(store.container("c1").is_none());
        store.remove_pod("s2");
        assert!(store.container("c2").is_none());
        assert_eq!(store.len(), (1, 0));
    }
}
