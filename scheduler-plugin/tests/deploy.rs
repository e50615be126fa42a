//! deploy/ matches the code: managed resources, RBAC, the admission policy.

use tessera_api::request::MANAGED_RESOURCES;
use tessera_harness::deploy::{documents, role_allows};

#[test]
fn scheduler_config_manages_every_resource_name() {
    let config = &documents("scheduler-config.yaml")[0];
    let extender = &config["extenders"][0];
    assert_eq!(extender["nodeCacheCapable"], true);
    assert_eq!(
        (
            extender["filterVerb"].as_str(),
            extender["prioritizeVerb"].as_str(),
            extender["bindVerb"].as_str()
        ),
        (Some("filter"), Some("prioritize"), Some("bind"))
    );
    let managed = extender["managedResources"]
        .as_array()
        .expect("managedResources");
    for name in MANAGED_RESOURCES {
        let entry = managed
            .iter()
            .find(|m| m["name"] == *name)
            .unwrap_or_else(|| panic!("{name} not managed"));
        assert_eq!(
            entry["ignoredByScheduler"],
            *name != "nvidia.com/gpu",
            "{name}"
        );
    }
    assert_eq!(managed.len(), MANAGED_RESOURCES.len());
}

#[test]
fn rbac_covers_what_the_scheduler_calls() {
    let docs = documents("scheduler.yaml");
    let allows = |kind: &str, resource: &str, verb: &str| {
        docs.iter()
            .filter(|d| d["kind"] == kind)
            .any(|role| role_allows(role, resource, verb))
    };
    for (resource, verb) in [
        ("pods", "watch"),
        ("pods", "list"),
        ("pods", "get"),
        ("pods", "patch"),
        ("pods/binding", "create"),
        ("devices", "watch"),
    ] {
        assert!(
            allows("ClusterRole", resource, verb),
            "ClusterRole lacks {verb} {resource}"
        );
    }
    for verb in ["get", "create", "update"] {
        assert!(allows("Role", "leases", verb), "Role lacks {verb} leases");
    }
}

#[test]
fn admission_policy_guards_the_annotation() {
    let docs = documents("admission-policy.yaml");
    let policy = docs
        .iter()
        .find(|d| d["kind"] == "ValidatingAdmissionPolicy")
        .expect("policy");
    let text = policy.to_string();
    assert!(text.contains("scheduling.koordinator.sh/device-allocated"));
    assert!(text.contains("system:serviceaccount:tessera-system:tessera-scheduler"));
    let binding = docs
        .iter()
        .find(|d| d["kind"] == "ValidatingAdmissionPolicyBinding")
        .expect("binding");
    assert_eq!(binding["spec"]["policyName"], policy["metadata"]["name"]);
    assert_eq!(binding["spec"]["validationActions"][0], "Deny");
}

#[test]
fn kube_scheduler_scores_every_node() {
    // Below 100, kube-scheduler samples nodes before the extender sees them, and
    // GPU share outside the sample is never found.
    let config = &documents("scheduler-config.yaml")[0];
    assert_eq!(config["percentageOfNodesToScore"], 100);
}

#[test]
fn admission_policy_covers_every_write_path_of_the_annotation() {
    // kube-apiserver merges a Binding's annotations into the pod it binds, and
    // pods/status patches change annotations too.
    let policy = &documents("admission-policy.yaml")[0];
    let rules = policy["spec"]["matchConstraints"]["resourceRules"]
        .as_array()
        .expect("resourceRules");
    for resource in ["pods", "pods/status", "pods/binding", "bindings"] {
        assert!(
            rules.iter().any(|rule| rule["resources"]
                .as_array()
                .is_some_and(|r| r.iter().any(|x| x == resource))),
            "the admission policy does not match {resource}"
        );
    }
}

/// A follower's wait for the leader sits well inside kube-scheduler's httpTimeout.
#[test]
fn forwarding_to_the_leader_answers_inside_the_extender_http_timeout() {
    let config = &documents("scheduler-config.yaml")[0];
    let timeout = config["extenders"][0]["httpTimeout"]
        .as_str()
        .and_then(|t| t.strip_suffix('s'))
        .and_then(|t| t.parse::<f64>().ok())
        .expect("httpTimeout in seconds");
    let forward = tessera_scheduler::extender::FORWARD_TIMEOUT.as_secs_f64();
    assert!(
        forward + 1.0 <= timeout,
        "forwarding waits {forward} s, kube-scheduler's httpTimeout is {timeout} s"
    );
}
