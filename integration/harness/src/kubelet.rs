//! A kubelet-like CRI client: the calls kubelet makes, in kubelet's order, with
//! the fields kubelet fills in (pkg/kubelet/kuberuntime).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use hyper_util::rt::TokioIo;
use k8s_cri::v1 as cri;
use k8s_cri::v1::image_service_client::ImageServiceClient;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

/// Opens a tonic channel over a unix socket.
pub async fn unix_channel(socket: &Path) -> Result<Channel, tonic::transport::Error> {
    let socket = socket.to_path_buf();
    Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move {
                let io: TokioIo<UnixStream> = crate::unix::connect(&socket).await?;
                Ok::<_, std::io::Error>(io)
            }
        }))
        .await
}

/// A pod as kubelet would describe it to the runtime.
#[derive(Debug, Clone)]
pub struct PodSpec {
    /// Pod name.
    pub name: String,
    /// Namespace.
    pub namespace: String,
    /// Pod UID.
    pub uid: String,
    /// Pod annotations (the scheduler's allocation lands here).
    pub annotations: HashMap<String, String>,
    /// Pod labels.
    pub labels: HashMap<String, String>,
    /// Where container logs go [default: /tmp/tessera-pod-logs/<ns>_<name>_<uid>; kubelet's is /var/log/pods/…].
    pub log_directory: Option<PathBuf>,
}

impl PodSpec {
    /// A pod with a derived UID and no annotations.
    pub fn new(namespace: &str, name: &str) -> Self {
        Self {
            name: name.to_owned(),
            namespace: namespace.to_owned(),
            uid: format!(
                "{:08x}-0000-4000-8000-{:012x}",
                fnv(name) as u32,
                fnv(&format!("{namespace}/{name}")) & 0xffff_ffff_ffff
            ),
            annotations: HashMap::new(),
            labels: HashMap::new(),
            log_directory: None,
        }
    }

    /// The pod's log directory.
    pub fn log_directory(&self) -> PathBuf {
        self.log_directory
            .clone()
            // kubelet's is /var/log/pods/…; the driver keeps the host's own untouched.
            .unwrap_or_else(|| {
                format!(
                    "/tmp/tessera-pod-logs/{}_{}_{}",
                    self.namespace, self.name, self.uid
                )
                .into()
            })
    }

    /// The CRI log of a container of this pod (first attempt), as containerd writes it.
    pub fn container_log(&self, container: &str) -> String {
        std::fs::read_to_string(self.log_directory().join(format!("{container}/0.log")))
            .unwrap_or_default()
    }

    /// The RunPodSandbox config kubelet builds for a host-network pod (generatePodSandboxConfig).
    pub fn sandbox_config(&self) -> cri::PodSandboxConfig {
        let mut labels = self.labels.clone();
        labels.insert("io.kubernetes.pod.name".into(), self.name.clone());
        labels.insert("io.kubernetes.pod.namespace".into(), self.namespace.clone());
        labels.insert("io.kubernetes.pod.uid".into(), self.uid.clone());
        let mut annotations = self.annotations.clone();
        annotations.insert("kubernetes.io/config.source".into(), "api".into());
        cri::PodSandboxConfig {
            metadata: Some(cri::PodSandboxMetadata {
                name: self.name.clone(),
                uid: self.uid.clone(),
                namespace: self.namespace.clone(),
                attempt: 0,
            }),
            hostname: String::new(),
            log_directory: self.log_directory().to_string_lossy().into_owned(),
            dns_config: Some(cri::DnsConfig::default()),
            port_mappings: vec![],
            labels,
            annotations,
            linux: Some(cri::LinuxPodSandboxConfig {
                cgroup_parent: format!("/kubepods/besteffort/pod{}", self.uid),
                security_context: Some(cri::LinuxSandboxSecurityContext {
                    namespace_options: Some(cri::NamespaceOption {
                        network: cri::NamespaceMode::Node as i32,
                        pid: cri::NamespaceMode::Container as i32,
                        ipc: cri::NamespaceMode::Pod as i32,
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            windows: None,
        }
    }

    /// The CreateContainer config kubelet builds (generateContainerConfig).
    pub fn container_config(
        &self,
        name: &str,
        image: &str,
        envs: &[(&str, &str)],
    ) -> cri::ContainerConfig {
        let labels = HashMap::from([
            ("io.kubernetes.container.name".to_owned(), name.to_owned()),
            ("io.kubernetes.pod.name".to_owned(), self.name.clone()),
            (
                "io.kubernetes.pod.namespace".to_owned(),
                self.namespace.clone(),
            ),
            ("io.kubernetes.pod.uid".to_owned(), self.uid.clone()),
        ]);
        let annotations = HashMap::from([
            (
                "io.kubernetes.container.hash".to_owned(),
                format!("{:x}", fnv(name) as u32),
            ),
            (
                "io.kubernetes.container.restartCount".to_owned(),
                "0".to_owned(),
            ),
            (
                "io.kubernetes.container.terminationMessagePath".to_owned(),
                "/dev/termination-log".to_owned(),
            ),
            (
                "io.kubernetes.container.terminationMessagePolicy".to_owned(),
                "File".to_owned(),
            ),
            (
                "io.kubernetes.pod.terminationGracePeriod".to_owned(),
                "30".to_owned(),
            ),
        ]);
        cri::ContainerConfig {
            metadata: Some(cri::ContainerMetadata {
                name: name.to_owned(),
                attempt: 0,
            }),
            image: Some(cri::ImageSpec {
                image: image.to_owned(),
                ..Default::default()
            }),
            envs: envs
                .iter()
                .map(|(k, v)| cri::KeyValue {
                    key: (*k).into(),
                    value: (*v).into(),
                })
                .collect(),
            labels,
            annotations,
            log_path: format!("{name}/0.log"),
            linux: Some(cri::LinuxContainerConfig {
                resources: Some(cri::LinuxContainerResources {
                    cpu_period: 100_000,
                    cpu_shares: 2,
                    oom_score_adj: 1000,
                    ..Default::default()
                }),
                security_context: Some(cri::LinuxContainerSecurityContext {
                    namespace_options: Some(cri::NamespaceOption {
                        network: cri::NamespaceMode::Node as i32,
                        pid: cri::NamespaceMode::Container as i32,
                        ipc: cri::NamespaceMode::Pod as i32,
                        ..Default::default()
                    }),
                    masked_paths: vec!["/proc/kcore".into(), "/proc/keys".into()],
                    readonly_paths: vec!["/proc/sys".into()],
                    ..Default::default()
                }),
            }),
            ..Default::default()
        }
    }
}

fn fnv(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x100_0000_01b3)
    })
}

/// The value of `key` in an OCI spec's process env (the last one wins, as in execve).
pub fn spec_env(spec: &serde_json::Value, key: &str) -> Option<String> {
    spec["process"]["env"]
        .as_array()?
        .iter()
        .rev()
        .filter_map(serde_json::Value::as_str)
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v.to_owned())
}

/// A running pod: its sandbox and its containers.
#[derive(Debug, Clone)]
pub struct RunningPod {
    /// The runtime's sandbox ID.
    pub sandbox_id: String,
    /// The containers' IDs, in creation order.
    pub containers: Vec<String>,
    /// The pod's cgroup, which kubelet makes and removes (the runtime leaves it);
    /// empty when the caller owns its cgroups.
    pub cgroup_parent: String,
}

/// A CRI client that behaves like kubelet.
#[derive(Debug, Clone)]
pub struct KubeletDriver {
    /// The runtime service client.
    pub runtime: RuntimeServiceClient<Channel>,
    /// The image service client.
    pub image: ImageServiceClient<Channel>,
    socket: PathBuf,
}

impl KubeletDriver {
    /// Connects to a CRI socket (containerd's or the proxy's).
    pub async fn connect(socket: &Path) -> anyhow::Result<Self> {
        let channel = unix_channel(socket)
            .await
            .with_context(|| format!("connecting to {}", socket.display()))?;
        Ok(Self {
            runtime: RuntimeServiceClient::new(channel.clone()),
            image: ImageServiceClient::new(channel),
            socket: socket.to_path_buf(),
        })
    }

    /// The socket this driver talks to.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// `Version`, as kubelet calls it first.
    pub async fn version(&mut self) -> Result<cri::VersionResponse, tonic::Status> {
        Ok(self
            .runtime
            .version(cri::VersionRequest {
                version: "v1".into(),
            })
            .await?
            .into_inner())
    }

    /// Starts a pod the way kubelet's SyncPod does: RunPodSandbox, PodSandboxStatus,
    /// then per container ImageStatus, CreateContainer, StartContainer, ContainerStatus.
    pub async fn start_pod(
        &mut self,
        pod: &PodSpec,
        containers: &[cri::ContainerConfig],
    ) -> Result<RunningPod, tonic::Status> {
        let config = pod.sandbox_config();
        // kubelet creates the pod's log directory before RunPodSandbox.
        let _ = std::fs::create_dir_all(pod.log_directory());
        let sandbox_id = self
            .runtime
            .run_pod_sandbox(cri::RunPodSandboxRequest {
                config: Some(config.clone()),
                runtime_handler: String::new(),
            })
            .await?
            .into_inner()
            .pod_sandbox_id;
        self.runtime
            .pod_sandbox_status(cri::PodSandboxStatusRequest {
                pod_sandbox_id: sandbox_id.clone(),
                verbose: false,
            })
            .await?;
        let mut ids = Vec::new();
        for container in containers {
            let id = self
                .create_and_start(&sandbox_id, &config, container.clone())
                .await?;
            ids.push(id);
        }
        Ok(RunningPod {
            sandbox_id,
            containers: ids,
            cgroup_parent: config
                .linux
                .as_ref()
                .map(|l| l.cgroup_parent.clone())
                .unwrap_or_default(),
        })
    }

    /// ImageStatus, CreateContainer, StartContainer, ContainerStatus for one container.
    pub async fn create_and_start(
        &mut self,
        sandbox_id: &str,
        sandbox_config: &cri::PodSandboxConfig,
        container: cri::ContainerConfig,
    ) -> Result<String, tonic::Status> {
        let id = self.create(sandbox_id, sandbox_config, container).await?;
        self.runtime
            .start_container(cri::StartContainerRequest {
                container_id: id.clone(),
            })
            .await?;
        self.runtime
            .container_status(cri::ContainerStatusRequest {
                container_id: id.clone(),
                verbose: false,
            })
            .await?;
        Ok(id)
    }

    /// ImageStatus then CreateContainer, as kubelet's startContainer does.
    pub async fn create(
        &mut self,
        sandbox_id: &str,
        sandbox_config: &cri::PodSandboxConfig,
        container: cri::ContainerConfig,
    ) -> Result<String, tonic::Status> {
        self.image
            .image_status(cri::ImageStatusRequest {
                image: container.image.clone(),
                verbose: false,
            })
            .await?;
        // kubelet creates each container's log directory (<pod log dir>/<name>/).
        if let Some(parent) = Path::new(&sandbox_config.log_directory)
            .join(&container.log_path)
            .parent()
        {
            let _ = std::fs::create_dir_all(parent);
        }
        let request = cri::CreateContainerRequest {
            pod_sandbox_id: sandbox_id.to_owned(),
            config: Some(container),
            sandbox_config: Some(sandbox_config.clone()),
        };
        Ok(self
            .runtime
            .create_container(request)
            .await?
            .into_inner()
            .container_id)
    }

    /// Tears a pod down the way kubelet does: StopContainer each, StopPodSandbox,
    /// then (garbage collection) RemoveContainer each and RemovePodSandbox.
    pub async fn stop_and_remove_pod(&mut self, pod: &RunningPod) -> Result<(), tonic::Status> {
        for id in &pod.containers {
            self.runtime
                .stop_container(cri::StopContainerRequest {
                    container_id: id.clone(),
                    timeout: 10,
                })
                .await?;
        }
        self.runtime
            .stop_pod_sandbox(cri::StopPodSandboxRequest {
                pod_sandbox_id: pod.sandbox_id.clone(),
            })
            .await?;
        for id in &pod.containers {
            self.runtime
                .remove_container(cri::RemoveContainerRequest {
                    container_id: id.clone(),
                })
                .await?;
        }
        self.runtime
            .remove_pod_sandbox(cri::RemovePodSandboxRequest {
                pod_sandbox_id: pod.sandbox_id.clone(),
            })
            .await?;
        remove_pod_cgroup(&pod.cgroup_parent);
        Ok(())
    }

    /// The effective OCI runtime spec of a container (verbose ContainerStatus).
    pub async fn container_spec(
        &mut self,
        container_id: &str,
    ) -> anyhow::Result<serde_json::Value> {
        let status = self
            .runtime
            .container_status(cri::ContainerStatusRequest {
                container_id: container_id.to_owned(),
                verbose: true,
            })
            .await?
            .into_inner();
        let info = status
            .info
            .get("info")
            .context("verbose ContainerStatus has no \"info\"")?;
        let info: serde_json::Value = serde_json::from_str(info)?;
        info.get("runtimeSpec")
            .cloned()
            .context("ContainerStatus info has no runtimeSpec")
    }

    /// The state of a container.
    pub async fn container_state(
        &mut self,
        container_id: &str,
    ) -> Result<cri::ContainerState, tonic::Status> {
        let status = self
            .runtime
            .container_status(cri::ContainerStatusRequest {
                container_id: container_id.to_owned(),
                verbose: false,
            })
            .await?
            .into_inner();
        Ok(status
            .status
            .map_or(cri::ContainerState::ContainerUnknown, |s| s.state()))
    }
}

/// Removes a pod's cgroup as kubelet does once the pod is gone (runc removes only
/// its containers'), in the unified hierarchy and in each v1 controller's. A
/// cgroup still in use is not removable (`rmdir` refuses): it stays.
pub fn remove_pod_cgroup(parent: &str) {
    let relative = parent.trim_start_matches('/');
    if relative.is_empty() {
        return;
    }
    let root = std::path::Path::new("/sys/fs/cgroup");
    let _ = std::fs::remove_dir(root.join(relative));
    for controller in std::fs::read_dir(root).into_iter().flatten().flatten() {
        let _ = std::fs::remove_dir(controller.path().join(relative));
    }
}
