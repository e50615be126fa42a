//! The bind path, decided in pure functions and acted on by a thin shell
//! ([`crate::extender::Extender::bind`]): reserve → annotate → bind → rollback.
//!
//! - [`decide`]: what a bind does with the pod as read (place it, or answer from
//!   its state when it is bound already: a retried bind never patches a bound pod);
//! - [`decide_rollback`]: after a failed Binding, what the pod as read again says
//!   (it bound after all, restore what was there before, or leave a value we did
//!   not write alone);
//! - [`annotate_patch`] / [`rollback_patch`]: the writes, each with preconditions.
//!
//! Preconditions: the annotation is written with a JSON merge patch that carries
//! `metadata.uid` and `metadata.resourceVersion` (the API server refuses it when the
//! pod was replaced or changed since it was read); the rollback is a JSON patch whose
//! `test` ops check the UID, the resourceVersion of the pod as read after the failed
//! Binding, and that the annotation still holds exactly what this bind wrote.

use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};
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
    /// Annotate: writing the allocation annotation failed.
    #[error("writing {DEVICE_ALLOCATED}: {0}")]
    Annotate(#[source] kube::Error),
    /// Bind: the Binding failed; the annotation was rolled back (or was not ours to roll back).
    #[error("binding to {node}: {source}")]
    Bind {
        /// The node.
        node: String,
        /// The Binding's error.
        #[source]
        source: kube::Error,
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
    /// Rollback: the Binding failed and restoring the annotation failed too.
    #[error("binding to {node}: {bind}; rolling back {DEVICE_ALLOCATED}: {source}")]
    Rollback {
        /// The node.
        node: String,
        /// The Binding's error (boxed: two API errors in one variant are large).
        bind: Box<kube::Error>,
        /// The rollback's error.
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
    /// Not bound: reserve, annotate, bind. `previous` is the annotation before (restored on rollback).
    Place {
        /// The annotation's value before this bind, if any.
        previous: Option<String>,
    },
}

/// What a rollback does with the pod as read again after a failed Binding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RollbackDecision {
    /// The pod is bound to the node with what this bind wrote: the bind succeeded after all.
    Bound,
    /// The annotation is still what this bind wrote: put `previous` back (remove when none).
    Restore,
    /// The pod changed (replaced, bound elsewhere, annotation rewritten): write nothing.
    Leave,
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
/// whether it asks for any. A bound pod is answered from its state, never patched.
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
        None => Ok(BindDecision::Place {
            previous: allocation_of(pod).map(str::to_owned),
        }),
    }
}

/// Decides a rollback from the pod as read again after its Binding failed.
pub fn decide_rollback(pod: &Pod, uid: &str, node: &str, written: &str) -> RollbackDecision {
    if pod.metadata.uid.as_deref() != Some(uid) || allocation_of(pod) != Some(written) {
        return RollbackDecision::Leave;
    }
    match node_of(pod) {
        Some(bound) if bound == node => RollbackDecision::Bound,
        Some(_) => RollbackDecision::Leave,
        None => RollbackDecision::Restore,
    }
}

/// The merge patch that writes `value` as the allocation, and `requested_as`
/// as which system's names its containers asked in (removed when `None`, so a
/// value the pod came with never stands beside Tessera's allocation), refused by
/// the API server unless the pod still has `uid` and `resource_version`.
pub fn annotate_patch(
    uid: &str,
    resource_version: Option<&str>,
    value: &str,
    requested_as: Option<&str>,
) -> Value {
    json!({"metadata": {
        "uid": uid,
        "resourceVersion": resource_version,
        "annotations": {DEVICE_ALLOCATED: value, REQUESTED_AS: requested_as},
    }})
}

/// The JSON patch that puts `previous` back (or removes the annotation), applied
/// only while the pod has `uid` and `resource_version` and still holds `written`.
pub fn rollback_patch(
    uid: &str,
    resource_version: &str,
    written: &str,
    previous: Option<&str>,
) -> Value {
    let path = format!(
        "/metadata/annotations/{}",
        DEVICE_ALLOCATED.replace('/', "~1")
    );
    let restore = match previous {
        Some(previous) => json!({"op": "replace", "path": path, "value": previous}),
        None => json!({"op": "remove", "path": path}),
    };
    json!([
        {"op": "test", "path": "/metadata/uid", "value": uid},
        {"op": "test", "path": "/metadata/resourceVersion", "value": resource_version},
        {"op": "test", "path": path, "value": written},
        restore,
    ])
}

#[cfg(test)]
mod tests;
