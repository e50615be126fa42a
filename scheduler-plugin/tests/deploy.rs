//! deploy/ matches the code: managed resources, RBAC, the admission policy.

use serde::Deserialize;
use serde_json::Value;
use tessera_api::request::MANAGED_RESOURCES;

fn documents(name: &str) -> Vec<Value> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).expect("YAML"))
        .collect()
}

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
        docs.iter().filter(|d| d["kind"] == kind).any(|role| {
            role["rules"].as_array().into_iter().flatten().any(|rule| {
                rule["resources"]
                    .as_array()
                    .is_some_and(|r| r.iter().any(|x| x == resource))
                    && rule["verbs"]
                        .as_array()
                        .is_some_and(|v| v.iter().any(|x| x == verb))
            })
        })
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
