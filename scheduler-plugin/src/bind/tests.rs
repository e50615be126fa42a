//! The bind path's decisions and patches.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::PodSpec;
use kube::api::ObjectMeta;

use super::*;

fn pod(uid: &str, node: Option<&str>, annotation: Option<&str>) -> Pod {
    Pod {
        metadata: ObjectMeta {
            uid: Some(uid.into()),
            resource_version: Some("7".into()),
            annotations: annotation
                .map(|a| BTreeMap::from([(DEVICE_ALLOCATED.to_owned(), a.to_owned())])),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            node_name: node.map(str::to_owned),
            ..PodSpec::default()
        }),
        status: None,
    }
}

#[test]
fn an_unbound_pod_is_placed_and_its_previous_value_kept() {
    assert_eq!(
        decide(&pod("u", None, None), "u", "n1", true).expect("decides"),
        BindDecision::Place { previous: None }
    );
    assert_eq!(
        decide(&pod("u", None, Some("old")), "u", "n1", true).expect("decides"),
        BindDecision::Place {
            previous: Some("old".into())
        }
    );
}

#[test]
fn a_bound_pod_is_answered_from_its_state_never_placed_again() {
    assert_eq!(
        decide(&pod("u", Some("n1"), Some("ours")), "u", "n1", true).expect("decides"),
        BindDecision::AlreadyBound
    );
    assert_eq!(
        decide(&pod("u", Some("n1"), None), "u", "n1", false).expect("decides"),
        BindDecision::AlreadyBound
    );
    let elsewhere = decide(&pod("u", Some("n2"), Some("ours")), "u", "n1", true);
    assert_eq!(
        elsewhere.expect_err("bound elsewhere").to_string(),
        "binding to n1: already bound to node n2"
    );
    let bare = decide(&pod("u", Some("n1"), None), "u", "n1", true);
    assert_eq!(
        bare.expect_err("no allocation").to_string(),
        "binding to n1: already bound to it without scheduling.koordinator.sh/device-allocated"
    );
    let replaced = decide(&pod("v", None, None), "u", "n1", true);
    assert_eq!(
        replaced.expect_err("other pod").to_string(),
        "UID v is not the one scheduled (u)"
    );
}

#[test]
fn rollback_restores_only_what_this_bind_wrote() {
    let decide = |p: &Pod| decide_rollback(p, "u", "n1", "ours");
    assert_eq!(
        decide(&pod("u", None, Some("ours"))),
        RollbackDecision::Restore
    );
    // The Binding failed on the wire but took effect: never wipe a bound pod's value.
    assert_eq!(
        decide(&pod("u", Some("n1"), Some("ours"))),
        RollbackDecision::Bound
    );
    assert_eq!(
        decide(&pod("u", None, Some("theirs"))),
        RollbackDecision::Leave
    );
    assert_eq!(decide(&pod("u", None, None)), RollbackDecision::Leave);
    assert_eq!(
        decide(&pod("u", Some("n2"), Some("ours"))),
        RollbackDecision::Leave
    );
    assert_eq!(
        decide(&pod("v", None, Some("ours"))),
        RollbackDecision::Leave
    );
}

#[test]
fn writes_carry_their_preconditions() {
    assert_eq!(
        annotate_patch("u", Some("7"), "ours", None),
        json!({"metadata": {"uid": "u", "resourceVersion": "7",
            "annotations": {"scheduling.koordinator.sh/device-allocated": "ours",
                            "tessera.io/requested-as": null}}})
    );
    assert_eq!(
        annotate_patch(
            "u",
            Some("7"),
            "ours",
            Some(r#"{"main":"gpushare:1073741824"}"#)
        )["metadata"]["annotations"]["tessera.io/requested-as"],
        r#"{"main":"gpushare:1073741824"}"#
    );
    let path = "/metadata/annotations/scheduling.koordinator.sh~1device-allocated";
    assert_eq!(
        rollback_patch("u", "8", "ours", None),
        json!([
            {"op": "test", "path": "/metadata/uid", "value": "u"},
            {"op": "test", "path": "/metadata/resourceVersion", "value": "8"},
            {"op": "test", "path": path, "value": "ours"},
            {"op": "remove", "path": path},
        ])
    );
    assert_eq!(
        rollback_patch("u", "8", "ours", Some("old"))[3],
        json!({"op": "replace", "path": path, "value": "old"})
    );
}
