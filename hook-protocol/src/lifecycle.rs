//! The CRI lifecycle calls a runtime proxy intercepts, what it knows of their pod
//! and container ([`PodInfo`], [`ContainerInfo`]), and the [`Hook`] that sees them
//! in process.

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use k8s_cri::v1 as cri;
use prost::Message;
use tonic::Code;

/// What the proxy knows of a pod sandbox.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodInfo {
    /// The runtime's sandbox ID.
    pub sandbox_id: String,
    /// The Kubernetes pod UID.
    pub uid: String,
    /// The pod name.
    pub name: String,
    /// The pod namespace.
    pub namespace: String,
    /// The pod labels, as kubelet passed them to the runtime.
    pub labels: HashMap<String, String>,
    /// The pod annotations, as kubelet passed them to the runtime.
    pub annotations: HashMap<String, String>,
}

impl PodInfo {
    /// Builds the pod from the config kubelet sends with RunPodSandbox and CreateContainer.
    pub fn from_config(sandbox_id: &str, config: &cri::PodSandboxConfig) -> Self {
        let metadata = config.metadata.clone().unwrap_or_default();
        Self {
            sandbox_id: sandbox_id.to_owned(),
            uid: metadata.uid,
            name: metadata.name,
            namespace: metadata.namespace,
            labels: config.labels.clone(),
            annotations: config.annotations.clone(),
        }
    }

    /// Builds the pod from a ListPodSandbox entry.
    pub fn from_sandbox(sandbox: &cri::PodSandbox) -> Self {
        let metadata = sandbox.metadata.clone().unwrap_or_default();
        Self {
            sandbox_id: sandbox.id.clone(),
            uid: metadata.uid,
            name: metadata.name,
            namespace: metadata.namespace,
            labels: sandbox.labels.clone(),
            annotations: sandbox.annotations.clone(),
        }
    }

    /// `namespace/name`, for messages.
    pub fn display_name(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// What the proxy knows of a container.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerInfo {
    /// The runtime's container ID.
    pub id: String,
    /// The container name within its pod.
    pub name: String,
    /// The sandbox the container runs in.
    pub sandbox_id: String,
}

macro_rules! lifecycle {
    ($($method:ident => $req:ident, $resp:ident;)*) => {
        /// A CRI method the proxy intercepts.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Method { $($method,)* }

        impl Method {
            /// Every intercepted method.
            pub const ALL: &[Method] = &[$(Method::$method,)*];

            /// The method's short name, as in the CRI service definition.
            pub fn name(self) -> &'static str {
                match self { $(Method::$method => stringify!($method),)* }
            }

            /// The intercepted method served at this HTTP/2 path, if any.
            pub fn from_path(path: &str) -> Option<Method> {
                // v1alpha2 (containerd 1.6/1.7, kubelets before 1.26) has the same
                // messages on the wire: a call on it must not slip past the hooks.
                let name = path
                    .strip_prefix("/runtime.v1.RuntimeService/")
                    .or_else(|| path.strip_prefix("/runtime.v1alpha2.RuntimeService/"))?;
                Method::ALL.iter().copied().find(|method| method.name() == name)
            }

            /// Decodes this method's request message.
            pub fn decode_request(self, bytes: &[u8]) -> Result<LifecycleRequest, prost::DecodeError> {
                Ok(match self {
                    $(Method::$method => LifecycleRequest::$method(cri::$req::decode(bytes)?),)*
                })
            }

            /// Decodes this method's response message.
            pub fn decode_response(self, bytes: &[u8]) -> Result<LifecycleResponse, prost::DecodeError> {
                Ok(match self {
                    $(Method::$method => LifecycleResponse::$method(cri::$resp::decode(bytes)?),)*
                })
            }
        }

        /// The request of an intercepted call, typed.
        // One lives per call, on its way through the hooks: boxing buys nothing.
        #[allow(clippy::large_enum_variant)]
        #[derive(Debug, Clone, PartialEq)]
        pub enum LifecycleRequest { $($method(cri::$req),)* }

        impl LifecycleRequest {
            /// Which method this request belongs to.
            pub fn method(&self) -> Method {
                match self { $(LifecycleRequest::$method(_) => Method::$method,)* }
            }

            /// The request's protobuf encoding (known fields only).
            pub fn encode_to_vec(&self) -> Vec<u8> {
                match self { $(LifecycleRequest::$method(req) => req.encode_to_vec(),)* }
            }
        }

        /// The response of an intercepted call, typed.
        #[derive(Debug, Clone, PartialEq)]
        pub enum LifecycleResponse { $($method(cri::$resp),)* }
    };
}

lifecycle! {
    RunPodSandbox => RunPodSandboxRequest, RunPodSandboxResponse;
    StopPodSandbox => StopPodSandboxRequest, StopPodSandboxResponse;
    RemovePodSandbox => RemovePodSandboxRequest, RemovePodSandboxResponse;
    CreateContainer => CreateContainerRequest, CreateContainerResponse;
    StartContainer => StartContainerRequest, StartContainerResponse;
    StopContainer => StopContainerRequest, StopContainerResponse;
    RemoveContainer => RemoveContainerRequest, RemoveContainerResponse;
    UpdateContainerResources => UpdateContainerResourcesRequest, UpdateContainerResourcesResponse;
}

/// What a hook knows about the call beyond its request.
#[derive(Debug, Clone, Default)]
pub struct HookContext {
    /// The pod the call concerns, from the request or the store.
    pub pod: Option<Arc<PodInfo>>,
    /// The container the call concerns, for container calls on a known container.
    pub container: Option<ContainerInfo>,
}

/// How an intercepted call ended at the runtime.
#[derive(Debug, Clone, PartialEq)]
pub enum CallOutcome {
    /// The runtime answered OK with this response.
    Ok(LifecycleResponse),
    /// The runtime (or the way to it) failed the call.
    Failed { code: Code, message: String },
}

/// A hook's refusal of a call: returned to kubelet as a gRPC error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct HookRejection {
    /// The gRPC code kubelet receives.
    pub code: Code,
    /// The message kubelet receives; it should name the object and the cause.
    pub message: String,
}

impl HookRejection {
    /// A rejection with `code` and `message`.
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

/// Runs around intercepted calls: `pre` before the runtime sees the request (it may
/// change the request or refuse it), `post` after the runtime answered.
#[async_trait]
pub trait Hook: Send + Sync + std::fmt::Debug {
    /// A short name for logs, metrics and error messages.
    fn name(&self) -> &str;

    /// Called before the call is forwarded; may rewrite `request` or refuse it.
    async fn pre(
        &self,
        _ctx: &HookContext,
        _request: &mut LifecycleRequest,
    ) -> Result<(), HookRejection> {
        Ok(())
    }

    /// Called after the runtime answered; observes only.
    async fn post(&self, _ctx: &HookContext, _request: &LifecycleRequest, _outcome: &CallOutcome) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_map_to_methods() {
        assert_eq!(
            Method::from_path("/runtime.v1.RuntimeService/CreateContainer"),
            Some(Method::CreateContainer)
        );
        assert_eq!(
            Method::from_path("/runtime.v1.RuntimeService/Version"),
            None
        );
        assert_eq!(
            Method::from_path("/runtime.v1alpha2.RuntimeService/CreateContainer"),
            Some(Method::CreateContainer)
        );
        assert_eq!(
            Method::from_path("/runtime.v1alpha2.ImageService/PullImage"),
            None
        );
        assert_eq!(Method::ALL.len(), 8);
        for method in Method::ALL {
            let path = format!("/runtime.v1.RuntimeService/{}", method.name());
            assert_eq!(Method::from_path(&path), Some(*method));
        }
    }
}
