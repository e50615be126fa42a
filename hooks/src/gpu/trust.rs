//! Node policy for the containers the GPU rewrite cannot or should not narrow:
//! trusted GPU agents, which keep the device env they were given, and privileged
//! containers, which see every device node of the host whatever the rewrite does.
//!
//! # Why namespaces
//!
//! NVIDIA's own agents (the device plugin, dcgm-exporter, GPU feature discovery,
//! the GPU Operator's validators) ask Kubernetes for no GPU and rely on
//! `NVIDIA_VISIBLE_DEVICES=all`. Trust is granted by namespace because a
//! namespace is an RBAC boundary: who may create pods in `gpu-operator` is
//! written down in its RoleBindings and Pod Security labels, and an operator can
//! audit it (`kubectl auth can-i create pods -n gpu-operator --as …`, `kubectl
//! get rolebindings -n gpu-operator`). A pod label alone proves nothing: anyone
//! who may create pods in a namespace may set any label. So a label only
//! narrows a trusted namespace (`kube-system:name=nvidia-device-plugin-ds`
//! trusts the static device plugin manifest's pods, not every pod of
//! kube-system); it never grants trust by itself.

use std::fmt;
use std::str::FromStr;

use tessera_hook_protocol::hook::v1::PodMetadata;

/// One entry of `--trusted-gpu-agents`: `NAMESPACE` or `NAMESPACE:KEY=VALUE`.
/// A pod matches when it is in the namespace and, when a label is given, carries
/// it with that exact value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrustedGpuAgent {
    /// The namespace whose pods are trusted.
    pub namespace: String,
    /// A label that narrows the trust to some of the namespace's pods.
    pub label: Option<(String, String)>,
}

impl TrustedGpuAgent {
    /// Whether `pod` is one of the agents this entry trusts.
    pub fn matches(&self, pod: &PodMetadata) -> bool {
        self.admits(&pod.namespace, &pod.labels)
    }

    /// Whether a pod in `namespace` with `labels` is one of the agents this entry trusts.
    pub fn admits<S: std::hash::BuildHasher>(
        &self,
        namespace: &str,
        labels: &std::collections::HashMap<String, String, S>,
    ) -> bool {
        namespace == self.namespace
            && self
                .label
                .as_ref()
                .is_none_or(|(key, value)| labels.get(key) == Some(value))
    }
}

impl fmt::Display for TrustedGpuAgent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.label {
            Some((key, value)) => write!(f, "{}:{key}={value}", self.namespace),
            None => f.write_str(&self.namespace),
        }
    }
}

/// Why a `--trusted-gpu-agents` entry cannot be used; the message quotes it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TrustedGpuAgentError {
    /// The namespace part is not a Kubernetes namespace name (a DNS-1123 label).
    #[error(
        "{entry:?}: namespace {namespace:?} is not a namespace name (lowercase letters, digits and '-', at most 63, starting and ending with a letter or digit)"
    )]
    Namespace {
        /// The whole entry.
        entry: String,
        /// Its namespace part.
        namespace: String,
    },
    /// The part after `:` is not `KEY=VALUE`.
    #[error("{entry:?}: expected NAMESPACE or NAMESPACE:KEY=VALUE, got {label:?} after ':'")]
    LabelShape {
        /// The whole entry.
        entry: String,
        /// The part after `:`.
        label: String,
    },
    /// The label key or value is not one Kubernetes accepts, so no pod could match.
    #[error("{entry:?}: label {part} {text:?} is not a valid Kubernetes label {part}")]
    Label {
        /// The whole entry.
        entry: String,
        /// `key` or `value`.
        part: &'static str,
        /// The offending text.
        text: String,
    },
}

impl FromStr for TrustedGpuAgent {
    type Err = TrustedGpuAgentError;

    fn from_str(entry: &str) -> Result<Self, Self::Err> {
        let (namespace, label) = match entry.split_once(':') {
            Some((namespace, label)) => (namespace, Some(label)),
            None => (entry, None),
        };
        if !is_dns_label(namespace) {
            return Err(TrustedGpuAgentError::Namespace {
                entry: entry.to_owned(),
                namespace: namespace.to_owned(),
            });
        }
        let label = match label {
            None => None,
            Some(label) => {
                let Some((key, value)) = label.split_once('=') else {
                    return Err(TrustedGpuAgentError::LabelShape {
                        entry: entry.to_owned(),
                        label: label.to_owned(),
                    });
                };
                let bad = |part, text: &str| TrustedGpuAgentError::Label {
                    entry: entry.to_owned(),
                    part,
                    text: text.to_owned(),
                };
                if !is_label_key(key) {
                    return Err(bad("key", key));
                }
                if !(value.is_empty() || is_label_name(value)) {
                    return Err(bad("value", value));
                }
                Some((key.to_owned(), value.to_owned()))
            }
        };
        Ok(Self {
            namespace: namespace.to_owned(),
            label,
        })
    }
}

impl<'de> serde::Deserialize<'de> for TrustedGpuAgent {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// A DNS-1123 label: what a namespace name is.
fn is_dns_label(text: &str) -> bool {
    let bytes = text.as_bytes();
    (1..=63).contains(&bytes.len())
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        && bytes.first().is_some_and(u8::is_ascii_alphanumeric)
        && bytes.last().is_some_and(u8::is_ascii_alphanumeric)
}

/// A label name (a key's name part, or a value): at most 63 of `[A-Za-z0-9_.-]`,
/// starting and ending with a letter or digit.
fn is_label_name(text: &str) -> bool {
    let bytes = text.as_bytes();
    (1..=63).contains(&bytes.len())
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && bytes.first().is_some_and(u8::is_ascii_alphanumeric)
        && bytes.last().is_some_and(u8::is_ascii_alphanumeric)
}

/// A label key: `[prefix/]name`, the prefix a DNS subdomain.
fn is_label_key(text: &str) -> bool {
    match text.rsplit_once('/') {
        Some((prefix, name)) => {
            prefix.len() <= 253 && prefix.split('.').all(is_dns_label) && is_label_name(name)
        }
        None => is_label_name(text),
    }
}

/// What the GPU hook does with privileged containers on a node that has GPUs.
///
/// containerd gives a privileged container every host device, `/dev/nvidia*`
/// included, and the NVIDIA toolkit lets it use every GPU whatever
/// `NVIDIA_VISIBLE_DEVICES` says: the hook's rewrite does not confine it.
///
/// The default is [`PrivilegedPolicy::RefuseGpu`], not a blanket refusal: CNI
/// agents, CSI node plugins and kube-proxy run privileged on every node, GPU
/// nodes included, and refusing them would take the node's network and storage
/// down at their next restart. They ask for no GPU, get no driver libraries
/// (their `NVIDIA_VISIBLE_DEVICES` is voided), and being privileged already own
/// the node. A privileged container that asks for GPUs is the one that would
/// silently use GPUs granted to others: that one is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum PrivilegedPolicy {
    /// Refuse a privileged container that is not a trusted GPU agent and asks for
    /// GPUs (env `all` or IDs, a device plugin's grant, NVIDIA CDI devices), and
    /// any privileged container the scheduler granted GPUs.
    #[default]
    RefuseGpu,
    /// Refuse every privileged container that is not a trusted GPU agent, and any
    /// privileged container the scheduler granted GPUs.
    Refuse,
    /// No check: privileged containers are rewritten like others, and still see
    /// every device node (the behaviour before this setting existed).
    Allow,
}

impl PrivilegedPolicy {
    /// The flag's spelling of the value, for messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::RefuseGpu => "refuse-gpu",
            Self::Refuse => "refuse",
            Self::Allow => "allow",
        }
    }
}

impl fmt::Display for PrivilegedPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a privileged container is refused; the end of the message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PrivilegedReason {
    /// The scheduler granted it GPUs: privileged, it would use every GPU of the
    /// node, not its grant. Refused whatever the trust: trust never widens an
    /// allocation.
    Allocated,
    /// Its env, a device plugin or a CDI device asks for GPUs: `what` says which.
    AsksForGpus(String),
    /// `refuse`: it is not a trusted GPU agent.
    Untrusted,
}

impl fmt::Display for PrivilegedReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Allocated => f.write_str(
                "the scheduler granted it GPUs, and privileged it would use every GPU of the node",
            ),
            Self::AsksForGpus(what) => write!(f, "it asks for GPUs ({what})"),
            Self::Untrusted => f.write_str("it is not a trusted GPU agent"),
        }
    }
}
