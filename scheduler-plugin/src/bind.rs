//! The bind path, decided in pure functions and acted on by a thin shell
//! ([`crate::extender::Extender::bind`]): reserve → bind (one write) → confirm.
//!
//! - [`decide`]: what a bind does with the pod as read (place it, or answer from
//!   its state when it is bound already: a retried bind never writes a bound pod);
//! - [`binding`]: the one write, a Binding that carries the allocation as
//!   annotations, with the pod's UID as precondition;
//! - [`took_effect`]: after a failed Binding, whether the pod as read again is
//!   bound to the node with what this bind wrote (its answer was lost).
//!
//! One write: kube-apiserver's binding registry sets `spec.nodeName` and merges
//! the Binding's annotations into the pod in one guarded update (its
//! `setPodNodeAndMetadata`, under the Binding's UID as precondition, refused
//! when the pod is bound already). The node and the allocation land together or not at all, so
//! a failed Binding leaves nothing to roll back, and a pod costs the API server
//! one write where an annotation patch before the Binding cost two.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Binding, ObjectReference, Pod};
use kube::api::ObjectMeta;
use tessera_api::DeviceAllocations;
use tessera_api::asked::REQUESTED_AS;
use tessera_api::request::RequestError;
use tessera_api::resources::DEVICE_ALLOCATED;

/// Why a bind failed; one variant per step. Shown after `pod NS/NAME: `.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// The cluster cache has not listed every kind yet (start, relist, dead watch).
    #[error(
        "tessera-scheduler's cluster cache is not synced (starting, relisting or reconnecting a watch); retry"
    )]
    NotSynced,
    /// This replica does not lead and cannot hand the bind over.
    #[error("this tessera-scheduler replica is not the leader; retry")]
    NotLeader,
    /// This replica stopped leading while the bind ran (renew deadline passed, the
    /// Lease moved, or it is shutting down), before writing anything.
    #[error("this tessera-scheduler replica stopped leading before writing the allocation; retry")]
    LeadershipLost,
    /// Handing the bind to the leader failed.
    #[error(
        "this tessera-scheduler replica is not the leader; handing the bind to the leader at {url}: {problem}; retry"
    )]
    Forward {
        /// The leader's URL.
        url: String,
        /// What went wrong on the way.
        problem: String,
    },
    /// The extender runs without an API server client.
    #[error("no API server client")]
    NoClient,
    /// Reading the pod from the API server failed.
    #[error("reading it: {0}")]
    Read(#[source] kube::Error),
    /// The pod with this name is not the one kube-scheduler scheduled.
    #[error("UID {found} is not the one scheduled ({wanted})")]
    UidMismatch {
        /// The UID found.
        found: String,
        /// The UID in the bind request.
        wanted: String,
    },
    /// The pod's GPU request is invalid.
    #[error(transparent)]
    Request(#[from] RequestError),
    /// The pod is bound already, to another node.
    #[error("binding to {wanted}: already bound to node {node}")]
    BoundElsewhere {
        /// Where it is bound.
        node: String,
        /// Where kube-scheduler asked for.
        wanted: String,
    },
    /// The pod is bound to the node but carries no allocation although it asks for GPUs.
    #[error("binding to {node}: already bound to it without {DEVICE_ALLOCATED}")]
    BoundWithoutAllocation {
        /// The node.
        node: String,
    },
    /// Reserve: the node reports no GPUs.
    #[error("node {node} has no Device CR")]
    NoDevice {
        /// The node.
        node: String,
    },
    /// Reserve: the request does not fit the node.
    #[error("node {node}: {reason}")]
    Unfit {
        /// The node.
        node: String,
        /// Why, in the allocator's words.
        reason: String,
    },
    /// Bind: the Binding failed, and the pod as read again is not bound with what
    /// it carried (a Binding writes all or nothing: nothing to roll back).
    #[error("binding to {node}: {source}")]
    Bind {
        /// The node.
        node: String,
        /// The Binding's error.
        #[source]
        source: kube::Error,
    },
    /// The Binding's outcome is unknown (the API server failed or did not answer, and
    /// may still apply it) and the pod, read again, is not bound yet: the allocation
    /// stays in flight until the watch or the TTL settles it.
    #[error(
        "binding to {node}: {bind}; the API server may still apply it: its allocation stays reserved until its bind is known"
    )]
    BindPending {
        /// The node.
        node: String,
        /// The Binding's error.
        #[source]
        bind: kube::Error,
    },
    /// Bind failed and the pod could not be read again: the allocation stays in flight.
    #[error(
        "binding to {node}: {bind}; reading the pod again failed ({source}): its allocation stays reserved until its bind is known"
    )]
    BindUnconfirmed {
        /// The node.
        node: String,
        /// The Binding's error (boxed: two API errors in one variant are large).
        bind: Box<kube::Error>,
        /// The read's error.
        #[source]
        source: kube::Error,
    },
}

/// A failed bind of one pod: the pod (`NS/NAME`) and the step's error.
#[derive(Debug, thiserror::Error)]
#[error("pod {pod}: {error}")]
pub struct BindFailure {
    /// `namespace/name`.
    pub pod: String,
    /// What failed.
    #[source]
    pub error: BindError,
}

/// What a bind does with the pod as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BindDecision {
    /// Bound already to the requested node with what it asked for: success, nothing written.
    AlreadyBound,
    /// Not bound: reserve and bind (the Binding replaces any allocation it carries).
    Place,
}

fn node_of(pod: &Pod) -> Option<&str> {
    pod.spec
        .as_ref()?
        .node_name
        .as_deref()
        .filter(|n| !n.is_empty())
}

/// The pod's allocation annotation, if any.
pub fn allocation_of(pod: &Pod) -> Option<&str> {
    pod.metadata
        .annotations
        .as_ref()?
        .get(DEVICE_ALLOCATED)
        .map(String::as_str)
}

/// Decides a bind of pod `uid` to `node` from the pod as read; `wants_gpus` is
/// whether it asks for any. A bound pod is answered from its state, never written.
pub fn decide(
    pod: &Pod,
    uid: &str,
    node: &str,
    wants_gpus: bool,
) -> Result<BindDecision, BindError> {
    let found = pod.metadata.uid.as_deref().unwrap_or_default();
    if found != uid {
        return Err(BindError::UidMismatch {
            found: found.to_owned(),
            wanted: uid.to_owned(),
        });
    }
    match node_of(pod) {
        Some(bound) if bound != node => Err(BindError::BoundElsewhere {
            node: bound.to_owned(),
            wanted: node.to_owned(),
        }),
        Some(_) if wants_gpus && allocation_of(pod).is_none() => {
            Err(BindError::BoundWithoutAllocation {
                node: node.to_owned(),
            })
        }
        Some(_) => Ok(BindDecision::AlreadyBound),
        None => Ok(BindDecision::Place),
    }
}

/// What a Binding writes besides the node: the allocation, and which system's
/// names the pod's containers asked in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation<'a> {
    /// The allocation annotation's value.
    pub written: &'a str,
    /// The [`REQUESTED_AS`] annotation's value, if any container asked in
    /// another system's names.
    pub requested_as: Option<String>,
}

/// Who a Binding binds where: the pod kube-scheduler named, and the node.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    /// The pod's namespace.
    pub namespace: &'a str,
    /// The pod's name.
    pub name: &'a str,
    /// The pod's UID, as kube-scheduler scheduled it.
    pub uid: &'a str,
    /// The node.
    pub node: &'a str,
}

/// The Binding of `pod` (as read, and decided [`BindDecision::Place`]) to the node,
/// with its UID as precondition and, with an `allocation`, the annotations the API
/// server merges into the pod as it binds it. Not its resourceVersion: while a
/// Binding waits (on admission webhooks, say), kube-scheduler and others write the
/// pod's status, and a Binding refused for that would be sent again for nothing.
/// The API server refuses a Binding of a pod bound already, and the GPU request of
/// a pending pod's containers cannot change; its annotations can (a GPU selection,
/// a sharing group), and the allocation follows the pod as read. Either way the
/// grant is the allocation the Binding carries, which the ledger books. A
/// [`REQUESTED_AS`] the pod came with is overwritten (`{}` when no container
/// asked in another system's names): a Binding can add and replace annotations,
/// not remove them, and no value but Tessera's may stand beside its allocation.
pub fn binding(pod: &Pod, target: Target<'_>, allocation: Option<&Allocation<'_>>) -> Binding {
    let annotations = allocation.map(|allocation| {
        let mut annotations =
            BTreeMap::from([(DEVICE_ALLOCATED.to_owned(), allocation.written.to_owned())]);
        let carried = pod
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(REQUESTED_AS));
        match &allocation.requested_as {
            Some(asked) => {
                annotations.insert(REQUESTED_AS.to_owned(), asked.clone());
            }
            None if carried => {
                annotations.insert(REQUESTED_AS.to_owned(), "{}".to_owned());
            }
            None => {}
        }
        annotations
    });
    Binding {
        metadata: ObjectMeta {
            name: Some(target.name.to_owned()),
            namespace: Some(target.namespace.to_owned()),
            uid: Some(target.uid.to_owned()),
            annotations,
            ..ObjectMeta::default()
        },
        target: ObjectReference {
            kind: Some("Node".into()),
            api_version: Some("v1".into()),
            name: Some(target.node.to_owned()),
            ..ObjectReference::default()
        },
    }
}

/// Whether the API server refused a write for good: it answered, and with a
/// client error (400 bad, 403 forbidden, 404 gone, 409 conflict, 422 invalid),
/// so nothing of it was or will be applied. A server error (500, 503, 504) or no
/// answer at all leaves the outcome unknown: a Binding held by a slow webhook or a
/// slow etcd may still be applied after its caller gave up.
pub fn refused_for_good(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if (400..500).contains(&status.code))
}

/// The node and the allocation of `pod` when it is bound with one (a parseable
/// allocation annotation), as read.
pub fn bound_allocation(pod: &Pod) -> Option<(&str, DeviceAllocations)> {
    let node = node_of(pod)?;
    let allocations = DeviceAllocations::parse(allocation_of(pod)?).ok()?;
    Some((node, allocations))
}

/// Whether a Binding whose answer failed took effect after all: the pod as read
/// again is pod `uid`, bound to `node`, carrying `written` (none: any allocation).
pub fn took_effect(pod: &Pod, uid: &str, node: &str, written: Option<&str>) -> bool {
    pod.metadata.uid.as_deref() == Some(uid)
        && node_of(pod) == Some(node)
        && written.is_none_or(|written| allocation_of(pod) == Some(written))
}

#[cfg(test)]
mod tests;
