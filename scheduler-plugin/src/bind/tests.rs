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
fn an_unbound_pod_is_placed_whatever_it_carries() {
    assert_eq!(
        decide(&pod("u", None, None), "u", "n1", true).expect("decides"),
        BindDecision::Place
    );
    assert_eq!(
        decide(&pod("u", None, Some("old")), "u", "n1", true).expect("decides"),
        BindDecision::Place
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
fn a_failed_binding_took_effect_only_if_the_pod_is_bound_here_with_what_it_carried() {
    let ours = |p: &Pod| took_effect(p, "u", "n1", Some("ours"));
    // The Binding failed on the wire but took effect.
    assert!(ours(&pod("u", Some("n1"), Some("ours"))));
    assert!(!ours(&pod("u", None, Some("ours"))));
    assert!(!ours(&pod("u", None, None)));
    assert!(!ours(&pod("u", Some("n1"), Some("theirs"))));
    assert!(!ours(&pod("u", Some("n2"), Some("ours"))));
    assert!(!ours(&pod("v", Some("n1"), Some("ours"))));
    // No allocation carried (a pod asking no GPU): bound here is enough.
    assert!(took_effect(&pod("u", Some("n1"), None), "u", "n1", None));
    assert!(!took_effect(&pod("u", Some("n2"), None), "u", "n1", None));
}

const TARGET: Target<'static> = Target {
    namespace: "ns",
    name: "p",
    uid: "u",
    node: "n1",
};

#[test]
fn a_binding_carries_the_allocation_and_the_pods_uid() {
    let allocation = Allocation {
        written: "ours",
        requested_as: None,
    };
    let placing = binding(&pod("u", None, None), TARGET, Some(&allocation));
    assert_eq!(
        serde_json::to_value(&placing).expect("serializes"),
        serde_json::json!({
            "apiVersion": "v1", "kind": "Binding",
            "metadata": {"name": "p", "namespace": "ns", "uid": "u",
                "annotations": {"scheduling.koordinator.sh/device-allocated": "ours"}},
            "target": {"apiVersion": "v1", "kind": "Node", "name": "n1"},
        })
    );
    // Without an allocation (no GPU asked): the UID alone, nothing else written.
    let plain = binding(&pod("u", None, None), TARGET, None);
    assert_eq!(plain.metadata.annotations, None);
    assert_eq!(plain.metadata.uid.as_deref(), Some("u"));
}

#[test]
fn a_binding_overwrites_a_requested_as_the_pod_came_with() {
    let annotations = |pod: &Pod, requested_as: Option<&str>| {
        let allocation = Allocation {
            written: "ours",
            requested_as: requested_as.map(str::to_owned),
        };
        binding(pod, TARGET, Some(&allocation))
            .metadata
            .annotations
            .unwrap_or_default()
    };
    let mut carrying = pod("u", None, None);
    carrying.metadata.annotations = Some(BTreeMap::from([(
        REQUESTED_AS.to_owned(),
        r#"{"main":"volcano:1"}"#.to_owned(),
    )]));
    let asked = r#"{"main":"gpushare:1073741824"}"#;
    assert_eq!(
        annotations(&carrying, Some(asked))
            .get(REQUESTED_AS)
            .map(String::as_str),
        Some(asked)
    );
    // A Binding cannot remove an annotation: an empty map says "no system".
    assert_eq!(
        annotations(&carrying, None)
            .get(REQUESTED_AS)
            .map(String::as_str),
        Some("{}")
    );
    assert_eq!(
        tessera_api::asked::parse("{}").map(|asked| asked.is_empty()),
        Ok(true)
    );
    // Nothing added to a pod that never carried one.
    assert!(!annotations(&pod("u", None, None), None).contains_key(REQUESTED_AS));
}

#[test]
fn only_a_client_error_is_a_refusal_for_good() {
    let status = |code: u16| {
        kube::Error::Api(
            kube::core::Status::failure("x", "y")
                .with_code(code)
                .boxed(),
        )
    };
    for code in [400, 403, 404, 409, 422, 429] {
        assert!(refused_for_good(&status(code)), "{code}");
    }
    for code in [500, 503, 504] {
        assert!(!refused_for_good(&status(code)), "{code}");
    }
    assert!(!refused_for_good(
        &kube::Error::LinesCodecMaxLineLengthExceeded
    ));
}

#[test]
fn a_bound_pods_allocation_is_read_only_when_it_parses() {
    let allocation =
        r#"{"gpu":[{"minor":0,"id":"GPU-0","resources":{"koordinator.sh/gpu-core":50}}]}"#;
    let bound = pod("u", Some("n1"), Some(allocation));
    let (node, parsed) = bound_allocation(&bound).expect("bound");
    assert_eq!((node, parsed.gpus().len()), ("n1", 1));
    assert!(bound_allocation(&pod("u", None, Some(allocation))).is_none());
    assert!(bound_allocation(&pod("u", Some("n1"), None)).is_none());
    assert!(bound_allocation(&pod("u", Some("n1"), Some("not json"))).is_none());
}
