//! KubeShare's SharePods (`kubeshare.nthu/v1`) and K8sGPUSharing's MtgpuPods
//! (`lsalab.nthu/v1`) served, one controller per kind
//! ([`tessera_api::sharepod::ShareKind`]): each object gets its pod
//! ([`ShareKind::pod_for`]), owned by it (deleted with it), and the pod's status
//! is copied to the object's in that kind's shape ([`ShareKind::status_of`]), as
//! their own controllers did. One that makes no pod shows why there.
//!
//! Only the leading replica acts. Events come from two watches: the objects, and
//! the pods made from them (labelled with the kind's `pod_label`); every
//! [`RESYNC`] each known object is looked at again (a pod made by KubeShare,
//! unlabelled, deleted during a switch: its object gets a new one). Where the
//! kind's CRD is not installed the watch fails, is logged once, and is retried
//! with backoff, so installing it later needs no restart.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Client, ResourceExt};
use serde_json::Value;
use tessera_api::sharepod::ShareKind;

use crate::leader::Leader;

/// How often every known SharePod is looked at again.
pub const RESYNC: Duration = Duration::from_secs(60);

/// A kind's resource, for dynamic clients.
pub fn resource(kind: &ShareKind) -> ApiResource {
    ApiResource {
        group: kind.group.into(),
        version: kind.version.into(),
        api_version: kind.api_version(),
        kind: kind.kind.into(),
        plural: kind.plural.into(),
    }
}

/// An object to look at: its namespace and name.
type Due = (String, String);

/// Makes and follows the pods of `kind`'s objects until the process ends.
pub async fn run(client: Client, leader: Arc<Leader>, kind: ShareKind) {
    let sharepods: Api<DynamicObject> = Api::all_with(client.clone(), &resource(&kind));
    let pods: Api<Pod> = Api::all(client.clone());
    let mut backoff = Duration::from_secs(1);
    let mut said = false;
    let mut resync = tokio::time::interval(RESYNC);
    // A pass longer than the period starts the next one a period after it ends.
    resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        // Names only: a SharePod's spec (up to the API server's object size) is read
        // when it is looked at, never kept.
        let writer = reflector::store::Writer::new(resource(&kind));
        let known = writer.as_reader();
        let mut shares = std::pin::pin!(
            watcher(sharepods.clone(), watcher::Config::default())
                .modify(|object: &mut DynamicObject| {
                    object.data = Value::Null;
                    object.metadata.managed_fields = None;
                    object.metadata.annotations = None;
                    object.metadata.labels = None;
                })
                .reflect(writer)
        );
        let mut made = std::pin::pin!(watcher(
            pods.clone(),
            watcher::Config::default().labels(kind.pod_label)
        ));
        loop {
            let mut due: Vec<Due> = Vec::new();
            tokio::select! {
                _ = resync.tick() => {
                    due.extend(known.state().iter().filter_map(|s| Some((s.namespace()?, s.name_any()))));
                }
                event = shares.next() => match event {
                    Some(Ok(watcher::Event::Apply(object) | watcher::Event::InitApply(object))) => {
                        due.extend(object.namespace().map(|ns| (ns, object.name_any())));
                    }
                    Some(Ok(_)) => {}
                    Some(Err(error)) => {
                        if !said {
                            tracing::info!(%error, kind = kind.kind, "not served (is its CRD, {}.{}, installed?); retrying", kind.plural, kind.group);
                            said = true;
                        }
                        break;
                    }
                    None => break,
                },
                event = made.next() => match event {
                    // A made pod changed or went: its SharePod shows it (or makes another).
                    Some(Ok(watcher::Event::Apply(pod) | watcher::Event::Delete(pod))) => {
                        let owner = kind.owner_name(pod.owner_references()).map(str::to_owned);
                        due.extend(pod.namespace().zip(owner));
                    }
                    Some(Ok(_)) => {}
                    Some(Err(_)) | None => break,
                },
            }
            backoff = Duration::from_secs(1);
            if !leader.leading() {
                continue;
            }
            for (namespace, name) in due {
                if let Err(error) = reconcile(&client, &kind, &namespace, &name).await {
                    tracing::warn!(kind = kind.kind, object = %format!("{namespace}/{name}"), %error, "not reconciled; retried at the next event or resync");
                }
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(300));
    }
}

/// The status of the object `name` (UID `uid`) whose pod's name `existing`
/// already has: its pod's, or whose pod it is instead.
fn existing_status(
    kind: &ShareKind,
    existing: &Pod,
    namespace: &str,
    name: &str,
    uid: &str,
) -> Value {
    if kind.made(existing, name, uid) {
        return kind.status_of(Ok(existing));
    }
    let owner = existing
        .owner_references()
        .iter()
        .find(|o| o.controller == Some(true))
        .map_or_else(String::new, |o| format!(" (it is {} {}'s)", o.kind, o.name));
    kind.status_of(Err(&format!(
        "a pod named {name} exists in {namespace} and is not this {}'s{owner}",
        kind.kind
    )))
}

/// Makes the object's pod if it has none, and shows the pod's status (or why
/// there is none) on the object.
async fn reconcile(
    client: &Client,
    kind: &ShareKind,
    namespace: &str,
    name: &str,
) -> Result<(), kube::Error> {
    let sharepods: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), namespace, &resource(kind));
    let Some(mut sharepod) = sharepods.get_opt(name).await? else {
        return Ok(());
    };
    if sharepod.metadata.deletion_timestamp.is_some() {
        return Ok(());
    }
    let uid = sharepod.uid().unwrap_or_default();
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let object = serde_json::to_value(&sharepod).unwrap_or_default();
    let status = match kind.pod_for(&object) {
        Err(refused) => kind.status_of(Err(&refused.problem)),
        Ok(pod) => match pods.get_opt(name).await? {
            Some(existing) => existing_status(kind, &existing, namespace, name, &uid),
            None => {
                // As JSON: the spec as written reaches the API server.
                let dynamic: Api<DynamicObject> = Api::namespaced_with(
                    client.clone(),
                    namespace,
                    &ApiResource::erase::<Pod>(&()),
                );
                let pod: DynamicObject =
                    serde_json::from_value(pod).map_err(kube::Error::SerdeError)?;
                match dynamic.create(&PostParams::default(), &pod).await {
                    Ok(created) => {
                        tracing::info!(pod = %format!("{namespace}/{name}"), kind = kind.kind, "pod made from its object");
                        // The API server's answer is the pod as made.
                        let created: Pod = serde_json::to_value(created)
                            .and_then(serde_json::from_value)
                            .map_err(kube::Error::SerdeError)?;
                        kind.status_of(Ok(&created))
                    }
                    // Admission refused it (a bad share, a policy): the object says why.
                    Err(kube::Error::Api(refusal)) if refusal.code != 409 => {
                        kind.status_of(Err(&format!("its pod was refused: {}", refusal.message)))
                    }
                    // Made meanwhile (by the other kind's controller for an object of
                    // the same name, say): said now, not at the next resync.
                    Err(kube::Error::Api(_)) => match pods.get_opt(name).await? {
                        Some(existing) => existing_status(kind, &existing, namespace, name, &uid),
                        None => return Ok(()),
                    },
                    Err(error) => return Err(error),
                }
            }
        },
    };
    if sharepod.data.get("status") == Some(&status) {
        return Ok(());
    }
    // The whole status, replaced (a merge would keep keys of the last one).
    sharepod.data["status"] = status;
    sharepods
        .replace_status(name, &PostParams::default(), &sharepod)
        .await
        .map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_is_its_own_resource() {
        use tessera_api::sharepod::{MTGPU_POD, SHARE_POD};
        assert_eq!(resource(&SHARE_POD).api_version, "kubeshare.nthu/v1");
        let mtgpu = resource(&MTGPU_POD);
        assert_eq!(
            (
                mtgpu.api_version.as_str(),
                mtgpu.plural.as_str(),
                mtgpu.kind.as_str()
            ),
            ("lsalab.nthu/v1", "mtgpupods", "MtgpuPod")
        );
    }
}
