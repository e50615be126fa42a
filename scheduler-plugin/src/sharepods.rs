//! KubeShare's SharePods served: each SharePod (`kubeshare.nthu/v1`) gets its
//! pod ([`tessera_api::sharepod::pod_for`]), owned by it (deleted with it), and
//! the pod's phase and status are copied to the SharePod's status, as KubeShare's
//! device manager did. A SharePod that makes no pod gets `status.phase: Failed`
//! and the reason in `status.message`.
//!
//! Only the leading replica acts. Events come from two watches: the SharePods,
//! and the pods made from them (labelled [`tessera_api::sharepod::POD_LABEL`]);
//! every [`RESYNC`] each known SharePod is looked at again (a pod made by
//! KubeShare, unlabelled, deleted during a switch: its SharePod gets a new one).
//! Where the SharePod CRD is not installed the watch fails, is logged once, and
//! is retried with backoff, so installing it later needs no restart.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use tessera_api::sharepod::{GROUP, KIND, PLURAL, POD_LABEL, VERSION, owner_name, pod_for};

use crate::leader::Leader;

/// How often every known SharePod is looked at again.
pub const RESYNC: Duration = Duration::from_secs(60);

/// The SharePod resource, for dynamic clients.
pub fn resource() -> ApiResource {
    ApiResource {
        group: GROUP.into(),
        version: VERSION.into(),
        api_version: format!("{GROUP}/{VERSION}"),
        kind: KIND.into(),
        plural: PLURAL.into(),
    }
}

/// The status a SharePod should show: its pod's phase and status, or why it
/// has none.
pub fn status_of(pod: Result<&Pod, &str>) -> Value {
    match pod {
        Ok(pod) => {
            let status = pod.status.clone().unwrap_or_default();
            json!({
                "phase": status.phase.clone().unwrap_or_else(|| "Pending".into()),
                "podName": pod.name_any(),
                "podStatus": status,
            })
        }
        Err(message) => json!({"phase": "Failed", "message": message}),
    }
}

/// A SharePod to look at: its namespace and name.
type Due = (String, String);

/// Makes and follows SharePods' pods until the process ends.
pub async fn run(client: Client, leader: Arc<Leader>) {
    let sharepods: Api<DynamicObject> = Api::all_with(client.clone(), &resource());
    let pods: Api<Pod> = Api::all(client.clone());
    let mut backoff = Duration::from_secs(1);
    let mut said = false;
    let mut resync = tokio::time::interval(RESYNC);
    // A pass longer than the period starts the next one a period after it ends.
    resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        // Names only: a SharePod's spec (up to the API server's object size) is read
        // when it is looked at, never kept.
        let writer = reflector::store::Writer::new(resource());
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
            watcher::Config::default().labels(POD_LABEL)
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
                            tracing::info!(%error, "SharePods not served (is the kubeshare.nthu SharePod CRD installed?); retrying");
                            said = true;
                        }
                        break;
                    }
                    None => break,
                },
                event = made.next() => match event {
                    // A made pod changed or went: its SharePod shows it (or makes another).
                    Some(Ok(watcher::Event::Apply(pod) | watcher::Event::Delete(pod))) => {
                        let owner = owner_name(pod.owner_references()).map(str::to_owned);
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
                if let Err(error) = reconcile(&client, &namespace, &name).await {
                    tracing::warn!(sharepod = %format!("{namespace}/{name}"), %error, "SharePod not reconciled; retried at the next event or resync");
                }
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(300));
    }
}

/// Makes the SharePod's pod if it has none, and shows the pod's status (or why
/// there is none) on the SharePod.
async fn reconcile(client: &Client, namespace: &str, name: &str) -> Result<(), kube::Error> {
    let sharepods: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), namespace, &resource());
    let Some(mut sharepod) = sharepods.get_opt(name).await? else {
        return Ok(());
    };
    if sharepod.metadata.deletion_timestamp.is_some() {
        return Ok(());
    }
    let uid = sharepod.uid().unwrap_or_default();
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let object = serde_json::to_value(&sharepod).unwrap_or_default();
    let status = match pod_for(&object) {
        Err(refused) => status_of(Err(&refused.problem)),
        Ok(pod) => match pods.get_opt(name).await? {
            Some(existing) => {
                if owner_name(existing.owner_references()).is_some()
                    && existing.owner_references().iter().any(|o| o.uid == uid)
                {
                    status_of(Ok(&existing))
                } else {
                    status_of(Err(&format!(
                        "a pod named {name} exists in {namespace} and is not this SharePod's"
                    )))
                }
            }
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
                        tracing::info!(pod = %format!("{namespace}/{name}"), "pod made from its SharePod");
                        // The API server's answer is the pod as made.
                        let created: Pod = serde_json::to_value(created)
                            .and_then(serde_json::from_value)
                            .map_err(kube::Error::SerdeError)?;
                        status_of(Ok(&created))
                    }
                    // Admission refused it (a bad share, a policy): the SharePod says why.
                    Err(kube::Error::Api(refusal)) if refusal.code != 409 => {
                        status_of(Err(&format!("its pod was refused: {}", refusal.message)))
                    }
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
    fn the_status_is_the_pods_or_why_there_is_none() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "p"},
            "status": {"phase": "Running", "podIP": "10.0.0.1"}
        }))
        .expect("pod");
        let status = status_of(Ok(&pod));
        assert_eq!(status["phase"], "Running");
        assert_eq!(status["podName"], "p");
        assert_eq!(status["podStatus"]["podIP"], "10.0.0.1");
        let failed = status_of(Err("no"));
        assert_eq!(
            (failed["phase"].as_str(), failed["message"].as_str()),
            (Some("Failed"), Some("no"))
        );
        assert_eq!(resource().api_version, "kubeshare.nthu/v1");
    }
}
