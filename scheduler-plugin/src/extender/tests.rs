//! The filter answer as kube-scheduler's preemption reads it: nodes the pod can
//! never fit are unresolvable (the dry run skips them), nodes full only of
//! current pods are merely failed; an invalid request refuses every node as
//! unresolvable, naming the pod and the bad value, instead of a hot-looping Error.

use serde_json::{Value, json};

use super::fixtures::{GIB, args, device, extender, one_container, pod};
use super::*;
use tessera_allocator::allocate::{GpuShare, Placement};

/// Books `gib` of GPU `index` on `node` for another pod, as a running pod would.
fn occupy(extender: &Extender, node: &str, index: u32, core: u64, gib: u64) {
    let share = GpuShare {
        uuid: format!("GPU-{node}-{index}"),
        minor: index,
        core,
        memory: gib * GIB,
        ratio: 0,
    };
    extender.ledger().reserve(
        &format!("other-{node}-{index}"),
        node,
        Placement {
            gpus: vec![share],
            group: None,
        },
        u64::MAX,
    );
}

fn filter(extender: &Extender, pod: Value, nodes: &[&str]) -> ExtenderFilterResult {
    extender.filter(args(&pod, nodes))
}

fn classes(result: &ExtenderFilterResult) -> (Vec<&str>, Vec<&str>, Vec<&str>) {
    (
        result
            .node_names
            .iter()
            .flatten()
            .map(String::as_str)
            .collect(),
        result.failed_nodes.keys().map(String::as_str).collect(),
        result
            .failed_and_unresolvable_nodes
            .keys()
            .map(String::as_str)
            .collect(),
    )
}

#[test]
fn too_few_gpus_is_unresolvable_gpus_in_use_are_not() {
    let extender = extender(&[
        device("fits", &[(16, true), (16, true)], &[]),
        device("one-gpu", &[(16, true)], &[]),
        device("busy", &[(16, true), (16, true)], &[]),
        device("plugin-held", &[(16, true), (16, true)], &[1]),
        device("one-sick", &[(16, true), (16, false)], &[]),
    ]);
    occupy(&extender, "busy", 0, 25, 4);
    let result = filter(
        &extender,
        one_container(json!({"nvidia.com/gpu": "2"})),
        &[
            "fits",
            "one-gpu",
            "busy",
            "plugin-held",
            "one-sick",
            "no-device",
        ],
    );
    assert_eq!(
        classes(&result),
        (
            vec!["fits"],
            // Evicting the pod using GPU 0, or the device-plugin pod, makes room.
            vec!["busy", "plugin-held"],
            // Nothing evicted adds a GPU or heals one.
            vec!["no-device", "one-gpu", "one-sick"],
        ),
        "{result:?}"
    );
    assert_eq!(
        result.failed_and_unresolvable_nodes["one-gpu"],
        "container main: never fits: 1 of 1 healthy GPUs (1 total) could hold 100% compute and 100% memory even with nothing running; 2 needed"
    );
    assert_eq!(
        result.failed_and_unresolvable_nodes["one-sick"],
        "container main: never fits: 1 of 1 healthy GPUs (2 total) could hold 100% compute and 100% memory even with nothing running; 2 needed"
    );
    assert!(result.error.is_empty());
}

#[test]
fn more_memory_than_any_gpu_has_is_unresolvable_less_than_is_free_is_not() {
    let extender = extender(&[
        device("small", &[(16, true), (16, true)], &[]),
        device("large", &[(80, true)], &[]),
    ]);
    occupy(&extender, "large", 0, 0, 60);
    let result = filter(
        &extender,
        one_container(json!({"koordinator.sh/gpu-memory": "32Gi"})),
        &["small", "large"],
    );
    assert_eq!(
        classes(&result),
        (vec![], vec!["large"], vec!["small"]),
        "{result:?}"
    );
    assert_eq!(
        result.failed_and_unresolvable_nodes["small"],
        "container main: never fits: 0 of 2 healthy GPUs (2 total) could hold 32.0 GiB of memory even with nothing running (the largest healthy GPU holds 16.0 GiB); 1 needed"
    );
    assert!(
        result.failed_nodes["large"].starts_with("container main: 0 of 1 usable GPUs"),
        "{result:?}"
    );
}

#[test]
fn containers_that_cannot_share_one_emptied_node_are_unresolvable() {
    let extender = extender(&[
        device("one-gpu", &[(16, true)], &[]),
        device("two-gpus", &[(16, true), (16, true)], &[]),
    ]);
    occupy(&extender, "two-gpus", 0, 50, 1);
    let containers = json!([
        {"name": "a", "image": "x", "resources": {"limits": {"koordinator.sh/gpu-core": "60", "koordinator.sh/gpu-memory-ratio": "10"}}},
        {"name": "b", "image": "x", "resources": {"limits": {"koordinator.sh/gpu-core": "60", "koordinator.sh/gpu-memory-ratio": "10"}}},
    ]);
    let result = filter(&extender, pod(containers), &["one-gpu", "two-gpus"]);
    // 60% + 60% never fit one GPU; on two GPUs they fit once the 50% pod is gone.
    assert_eq!(
        classes(&result),
        (vec![], vec!["two-gpus"], vec!["one-gpu"]),
        "{result:?}"
    );
    assert!(
        result.failed_and_unresolvable_nodes["one-gpu"]
            .starts_with("never fits, even with nothing running: container "),
        "{result:?}"
    );
}

#[test]
fn an_invalid_request_refuses_every_node_as_unresolvable_without_an_error() {
    let extender = extender(&[device("n1", &[(16, true)], &[])]);
    let result = filter(
        &extender,
        one_container(json!({"koordinator.sh/gpu-core": "150"})),
        &["n1", "n2"],
    );
    assert_eq!(result.error, "", "an Error makes the pod hot-loop");
    assert_eq!(result.node_names, Some(vec![]));
    assert!(result.failed_nodes.is_empty());
    let why = "pod default/p: container main: koordinator.sh/gpu-core 150: values above 100 must be multiples of 100 (whole GPUs)";
    for node in ["n1", "n2"] {
        assert_eq!(
            result.failed_and_unresolvable_nodes[node], why,
            "{result:?}"
        );
    }
    // kube-scheduler sending whole nodes gets an empty list back, not the nodes.
    let with_nodes: ExtenderArgs = serde_json::from_value(json!({
        "Pod": one_container(json!({"koordinator.sh/gpu-core": "150"})),
        "Nodes": {"items": [{"metadata": {"name": "n1"}}]},
    }))
    .expect("args");
    let result = extender.filter(with_nodes);
    assert_eq!(result.nodes, Some(json!({"items": []})));
    assert_eq!(result.failed_and_unresolvable_nodes["n1"], why);
}

/// The JSON names are the Go field names of k8s.io/kube-scheduler/extender/v1's
/// ExtenderFilterResult (no json tags there: encoding/json writes the field names).
#[test]
fn the_answer_uses_kube_schedulers_field_names() {
    let extender = extender(&[
        device("fits", &[(16, true)], &[]),
        device("busy", &[(16, true)], &[]),
    ]);
    occupy(&extender, "busy", 0, 100, 16);
    let result = filter(
        &extender,
        one_container(json!({"nvidia.com/gpu": "2"})),
        &["fits", "busy"],
    );
    let wire = serde_json::to_value(&result).expect("json");
    let keys: Vec<&str> = wire
        .as_object()
        .expect("object")
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        keys,
        vec![
            "Error",
            "FailedAndUnresolvableNodes",
            "FailedNodes",
            "NodeNames"
        ]
    );
    assert!(wire["FailedAndUnresolvableNodes"]["fits"].is_string());
    assert!(wire["FailedAndUnresolvableNodes"]["busy"].is_string());
}

// === A pod's own choices: GPU model and UUID, per-pod policies ===

/// A Device CR for `node` with `count` healthy 80 GiB GPUs of `model` (label-safe).
fn device_of_model(node: &str, model: &str, count: usize) -> Value {
    let devices: Vec<Value> = (0..count)
        .map(|i| {
            json!({"type": "gpu", "id": format!("GPU-{node}-{i}"), "minor": i, "health": true,
            "labels": {"node.koordinator.sh/gpu-model": model},
            "resources": {"koordinator.sh/gpu-memory": (80 * GIB).to_string()}})
        })
        .collect();
    json!({"apiVersion": "scheduling.koordinator.sh/v1alpha1", "kind": "Device",
        "metadata": {"name": node}, "spec": {"devices": devices}})
}

fn annotated(annotations: Value, limits: Value) -> Value {
    let mut pod = one_container(limits);
    pod["metadata"]["annotations"] = annotations;
    pod
}

fn mixed_cluster() -> Extender {
    extender(&[
        device_of_model("a100", "NVIDIA-A100-SXM4-80GB", 2),
        device_of_model("h100", "NVIDIA-H100-80GB-HBM3", 2),
    ])
}

#[test]
fn use_gputype_keeps_the_pod_on_gpus_of_that_model() {
    let extender = mixed_cluster();
    let result = filter(
        &extender,
        annotated(
            json!({"nvidia.com/use-gputype": "A100"}),
            json!({"nvidia.com/gpu": "1"}),
        ),
        &["a100", "h100"],
    );
    // No eviction turns an H100 into an A100: unresolvable, so preemption skips it.
    assert_eq!(
        classes(&result),
        (vec!["a100"], vec![], vec!["h100"]),
        "{result:?}"
    );
    assert_eq!(
        result.failed_and_unresolvable_nodes["h100"],
        r#"container main: never fits: 0 of 2 healthy GPUs (2 total) could hold 100% compute and 100% memory even with nothing running; 1 needed; 2 of 2 GPUs ruled out by nvidia.com/use-gputype="A100""#
    );
    let result = filter(
        &extender,
        annotated(
            json!({"nvidia.com/nouse-gputype": "a100"}),
            json!({"nvidia.com/gpu": "1"}),
        ),
        &["a100", "h100"],
    );
    assert_eq!(
        classes(&result),
        (vec!["h100"], vec![], vec!["a100"]),
        "{result:?}"
    );
}

/// The GPUs a selection allows being busy is only failed (preemption may free
/// them), while a node whose GPUs it rules out stays unresolvable.
#[test]
fn busy_gpus_the_selection_allows_are_failed_not_unresolvable() {
    let extender = mixed_cluster();
    occupy(&extender, "a100", 0, 25, 4);
    occupy(&extender, "a100", 1, 25, 4);
    let result = filter(
        &extender,
        annotated(
            json!({"nvidia.com/use-gputype": "A100"}),
            json!({"nvidia.com/gpu": "1"}),
        ),
        &["a100", "h100"],
    );
    assert_eq!(
        classes(&result),
        (vec![], vec!["a100"], vec!["h100"]),
        "{result:?}"
    );
    assert_eq!(
        result.failed_nodes["a100"],
        "container main: 0 of 2 usable GPUs (2 total) have room for 100% compute and 100% memory, 1 needed; the freest has 75% compute and 76.0 GiB of 80.0 GiB free"
    );
    assert!(
        result.failed_and_unresolvable_nodes["h100"].contains("ruled out"),
        "{result:?}"
    );
}

#[test]
fn a_model_no_node_has_refuses_every_node_naming_the_annotation() {
    let extender = mixed_cluster();
    let result = filter(
        &extender,
        annotated(
            json!({"nvidia.com/use-gputype": "V100"}),
            json!({"nvidia.com/gpu": "1"}),
        ),
        &["a100", "h100"],
    );
    assert_eq!(result.error, "");
    let why = r#"pod default/p: nvidia.com/use-gputype="V100" rules out every GPU of every node: no node has such a GPU (GPU models in the cluster: NVIDIA-A100-SXM4-80GB, NVIDIA-H100-80GB-HBM3)"#;
    for node in ["a100", "h100"] {
        assert_eq!(
            result.failed_and_unresolvable_nodes[node], why,
            "{result:?}"
        );
    }
    // The same for a Koordinator hint on the model label.
    let hint =
        r#"{"gpu":{"selector":{"matchLabels":{"node.koordinator.sh/gpu-model":"NVIDIA-V100"}}}}"#;
    let result = filter(
        &extender,
        annotated(
            json!({"scheduling.koordinator.sh/device-allocate-hint": hint}),
            json!({"koordinator.sh/gpu": "50"}),
        ),
        &["a100"],
    );
    assert!(
        result.failed_and_unresolvable_nodes["a100"].starts_with(
            "pod default/p: scheduling.koordinator.sh/device-allocate-hint=\"{\\\"gpu\\\""
        ),
        "{result:?}"
    );
}

#[test]
fn a_koordinator_hint_selects_gpus_by_model_label() {
    let extender = mixed_cluster();
    let hint = r#"{"gpu":{"selector":{"matchLabels":{"node.koordinator.sh/gpu-model":"NVIDIA-H100-80GB-HBM3"}}}}"#;
    let result = filter(
        &extender,
        annotated(
            json!({"scheduling.koordinator.sh/device-allocate-hint": hint}),
            json!({"koordinator.sh/gpu": "50"}),
        ),
        &["a100", "h100"],
    );
    assert_eq!(
        classes(&result),
        (vec!["h100"], vec![], vec!["a100"]),
        "{result:?}"
    );
}

#[test]
fn an_invalid_annotation_refuses_every_node_naming_it_and_its_value() {
    let extender = mixed_cluster();
    for (annotations, why) in [
        (
            json!({"hami.io/node-scheduler-policy": "fastest"}),
            r#"pod default/p: annotation hami.io/node-scheduler-policy: "fastest": "fastest": expected binpack or spread"#,
        ),
        (
            json!({"scheduling.koordinator.sh/device-allocate-hint": r#"{"rdma":{"vfSelector":{}}}"#}),
            r#"pod default/p: annotation scheduling.koordinator.sh/device-allocate-hint: "{\"rdma\":{\"vfSelector\":{}}}": rdma: Tessera allocates only gpu devices"#,
        ),
    ] {
        let result = filter(
            &extender,
            annotated(annotations, json!({"nvidia.com/gpu": "1"})),
            &["a100", "h100"],
        );
        assert_eq!(result.error, "");
        assert_eq!(result.node_names, Some(vec![]));
        for node in ["a100", "h100"] {
            assert_eq!(
                result.failed_and_unresolvable_nodes[node], why,
                "{result:?}"
            );
        }
    }
    // Conflicting resource names, the same way.
    let result = filter(
        &extender,
        one_container(
            json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024", "nvidia.com/gpumem-percentage": "50"}),
        ),
        &["a100"],
    );
    assert_eq!(
        result.failed_and_unresolvable_nodes["a100"],
        "pod default/p: container main: nvidia.com/gpumem and nvidia.com/gpumem-percentage cannot both be set: memory is either MiB or a percent of each GPU"
    );
}

#[test]
fn hami_node_policy_overrides_the_default_for_its_pod() {
    let extender = mixed_cluster();
    occupy(&extender, "a100", 0, 50, 40);
    let limits =
        json!({"nvidia.com/gpu": "1", "nvidia.com/gpucores": "10", "nvidia.com/gpumem": "1024"});
    let prioritize = |pod: Value| extender.prioritize(args(&pod, &["a100", "h100"]));
    let best = |scores: Vec<HostPriority>| {
        scores
            .into_iter()
            .max_by_key(|p| p.score)
            .map(|p| p.host)
            .unwrap_or_default()
    };
    // The default, binpack: the fuller node.
    assert_eq!(best(prioritize(one_container(limits.clone()))), "a100");
    let spread = annotated(json!({"hami.io/node-scheduler-policy": "spread"}), limits);
    assert_eq!(best(prioritize(spread)), "h100");
}

/// A namespace's sharing groups hold at most its allowance of GPUs (4 by
/// default): a new group past it is refused on every node and at bind, while a
/// pod joining a group that holds a GPU is not.
#[test]
fn a_new_sharing_group_past_its_namespaces_allowance_waits() {
    let extender = mixed_cluster();
    let hold = |pod: &str, node: &str, uuid: &str, minor: u32, group: &str| {
        extender.ledger().reserve(
            pod,
            node,
            Placement {
                gpus: vec![GpuShare {
                    uuid: uuid.into(),
                    minor,
                    core: 1,
                    memory: GIB,
                    ratio: 1,
                }],
                group: Some(format!("default/{group}")),
            },
            u64::MAX,
        );
    };
    hold("g1-0", "a100", "GPU-a100-0", 0, "g1");
    hold("g2-0", "a100", "GPU-a100-1", 1, "g2");
    hold("g3-0", "h100", "GPU-h100-0", 0, "g3");
    hold("g4-0", "h100", "GPU-h100-1", 1, "g4");
    let member = |group: &str| {
        annotated(
            json!({"tessera.io/sharing-group": group}),
            json!({"koordinator.sh/gpu-core": "1", "koordinator.sh/gpu-memory-ratio": "1"}),
        )
    };
    let result = filter(&extender, member("g5"), &["a100", "h100"]);
    let why = r#"sharing group "default/g5" is new, and the sharing groups of namespace "default" already hold 4 GPUs, the most one namespace's groups may hold (--max-group-gpus-per-namespace=4): it waits until one of them ends"#;
    assert_eq!(
        classes(&result),
        (vec![], vec![], vec!["a100", "h100"]),
        "{result:?}"
    );
    assert_eq!(result.failed_and_unresolvable_nodes["h100"], why);
    let request = pod_gpu_request(
        &serde_json::from_value(member("g5")).expect("pod"),
        &RequestOptions::default(),
    )
    .expect("valid")
    .expect("asks for GPUs");
    let refused = extender
        .reserve(
            &ExtenderBindingArgs {
                pod_name: "g5-0".into(),
                pod_namespace: "default".into(),
                pod_uid: "u-g5".into(),
                node: "h100".into(),
            },
            &request,
        )
        .expect_err("past the allowance");
    assert!(refused.to_string().contains(why), "{refused}");
    // Joining g1 takes no new GPU.
    let result = filter(&extender, member("g1"), &["a100", "h100"]);
    assert_eq!(classes(&result).0, vec!["a100"], "{result:?}");
}

/// A sharing group that holds a GPU on one node: its pods are unresolvable on
/// every other node, and a bind elsewhere (two binds of a new group racing) is refused.
#[test]
fn a_sharing_group_lives_on_one_node() {
    let extender = mixed_cluster();
    let share = GpuShare {
        uuid: "GPU-h100-1".into(),
        minor: 1,
        core: 25,
        memory: 20 * GIB,
        ratio: 25,
    };
    extender.ledger().reserve(
        "member-0",
        "h100",
        Placement {
            gpus: vec![share],
            group: Some("default/train".into()),
        },
        u64::MAX,
    );
    let member = annotated(
        json!({"tessera.io/sharing-group": "train"}),
        json!({"koordinator.sh/gpu": "25"}),
    );
    let result = filter(&extender, member.clone(), &["a100", "h100"]);
    assert_eq!(
        classes(&result),
        (vec!["h100"], vec![], vec!["a100"]),
        "{result:?}"
    );
    assert_eq!(
        result.failed_and_unresolvable_nodes["a100"],
        r#"sharing group "default/train" holds GPU GPU-h100-1 on node h100: its pods share that GPU only"#
    );
    // The same name in another namespace is another group: not pinned to h100.
    let mut stranger = member.clone();
    stranger["metadata"]["namespace"] = json!("team-b");
    let result = filter(&extender, stranger, &["a100", "h100"]);
    assert!(
        result.failed_and_unresolvable_nodes.is_empty() && !classes(&result).0.is_empty(),
        "a pod of team-b joined default's group: {result:?}"
    );
    let request = pod_gpu_request(
        &serde_json::from_value(member).expect("pod"),
        &RequestOptions::default(),
    )
    .expect("valid")
    .expect("asks for GPUs");
    let args = |node: &str| ExtenderBindingArgs {
        pod_name: "p".into(),
        pod_namespace: "default".into(),
        pod_uid: "u-p".into(),
        node: node.into(),
    };
    let refused = extender
        .reserve(&args("a100"), &request)
        .expect_err("the group lives on h100");
    assert!(
        refused
            .to_string()
            .contains(r#"sharing group "default/train" holds GPU GPU-h100-1"#),
        "{refused}"
    );
    let written = extender.reserve(&args("h100"), &request).expect("fits");
    assert!(written.contains(r#""id":"GPU-h100-1""#), "{written}");
    assert!(
        written.contains(r#""sharingGroup":"default/train""#),
        "{written}"
    );
    // A pod outside the group never gets its GPU.
    let outsider = extender
        .reserve(
            &ExtenderBindingArgs {
                pod_uid: "u-q".into(),
                ..args("h100")
            },
            &PodGpuRequest {
                sharing_group: None,
                ..request
            },
        )
        .expect("fits");
    assert!(outsider.contains(r#""id":"GPU-h100-0""#), "{outsider}");
}

#[test]
fn reasons_reach_kube_scheduler_without_printf_verbs() {
    let mut result = ExtenderFilterResult::default();
    result.failed_nodes.insert(
        "a".into(),
        "0 of 4 usable GPUs have 50% compute free".into(),
    );
    result
        .failed_and_unresolvable_nodes
        .insert("b".into(), "never fits: 100% compute and 20% memory".into());
    let result = result.for_kube_scheduler();
    assert_eq!(
        result.failed_nodes["a"],
        "0 of 4 usable GPUs have 50 percent compute free"
    );
    assert_eq!(
        result.failed_and_unresolvable_nodes["b"],
        "never fits: 100 percent compute and 20 percent memory"
    );
}

/// The HTTP path reads node names in place from the request and writes answers
/// that borrow them: byte for byte the JSON of the public answer types, for every
/// kind of answer, also when JSON escapes spell a name (`n\u0031` is `n1`) and
/// when kube-scheduler sends whole nodes.
#[test]
fn the_wire_path_answers_as_the_public_types_do() {
    let extender = extender(&[
        device("n1", &[(16, true), (16, true)], &[]),
        device("busy", &[(16, true)], &[]),
        device("small", &[(4, true)], &[]),
    ]);
    occupy(&extender, "busy", 0, 100, 16);
    let half = one_container(
        json!({"koordinator.sh/gpu-core": "50", "koordinator.sh/gpu-memory-ratio": "50"}),
    );
    let big = one_container(json!({"koordinator.sh/gpu-memory": "8Gi"}));
    let plain = pod(json!([{"name": "main", "image": "x"}]));
    let invalid = one_container(json!({"koordinator.sh/gpu-core": "150"}));
    let names = ["n1", "busy", "small", "gone", "n1"];
    let mut bodies: Vec<String> = [&half, &big, &plain, &invalid]
        .into_iter()
        .map(|pod| json!({"Pod": pod, "NodeNames": names}).to_string())
        .collect();
    bodies.push(json!({"Pod": half, "Nodes": {"items": [{"metadata": {"name": "n1"}}, {"metadata": {"name": "busy"}}]}}).to_string());
    // `"n1"` spelt with an escape, twice: names that cannot be borrowed.
    bodies.push(
        bodies[0]
            .replace(r#"["n1""#, r#"["n\u0031""#)
            .replace(r#","n1"]"#, r#","\u006e1"]"#),
    );
    assert!(bodies[5].contains(r"\u0031") && bodies[5].contains(r"\u006e"));
    let wire = |answer: serde_json::Result<serde_json::Result<Vec<u8>>>| {
        String::from_utf8(answer.expect("valid").expect("encoded")).expect("utf-8")
    };
    for body in &bodies {
        let args: ExtenderArgs = serde_json::from_str(body).expect("args");
        let filtered = extender.filter(args.clone()).for_kube_scheduler();
        let public = serde_json::to_string(&filtered).expect("json");
        assert_eq!(
            wire(extender.filter_json(body.as_bytes())),
            public,
            "filter {body}"
        );
        let public = serde_json::to_string(&extender.prioritize(args)).expect("json");
        assert_eq!(
            wire(extender.prioritize_json(body.as_bytes())),
            public,
            "prioritize {body}"
        );
    }
    // The escaped names were read as `n1`: it fits, and scores.
    let filtered: ExtenderFilterResult =
        serde_json::from_str(&wire(extender.filter_json(bodies[5].as_bytes()))).expect("answer");
    assert_eq!(
        filtered.node_names,
        Some(vec!["n1".to_owned(), "small".to_owned(), "n1".to_owned()])
    );
    assert!(filtered.failed_nodes.contains_key("busy"), "{filtered:?}");
    assert!(
        filtered.failed_and_unresolvable_nodes.contains_key("gone"),
        "{filtered:?}"
    );
    // Bad requests are refused with the public type's words.
    for bad in [
        json!({"Pod": half, "NodeNames": ["n1", 7]}).to_string(),
        json!(["n1"]).to_string(),
        json!(7).to_string(),
        json!({"NodeNames": ["n1"]}).to_string(),
    ] {
        let wire_error = extender.filter_json(bad.as_bytes()).expect_err("invalid");
        let public_error = serde_json::from_str::<ExtenderArgs>(&bad).expect_err("invalid");
        assert_eq!(wire_error.to_string(), public_error.to_string());
    }
}

#[test]
fn a_node_whose_switch_is_unproven_takes_no_gpu_pod_until_proven() {
    let mut unproven = device("unproven", &[(16, true)], &[]);
    let mark = |d: &mut Value, value: &str| {
        d["metadata"]["annotations"][tessera_api::resources::SWITCH_UNPROVEN] = json!(value);
    };
    mark(&mut unproven, "true");
    let extender = extender(&[unproven.clone(), device("proven", &[(16, true)], &[])]);
    let gpu_pod = || one_container(json!({"koordinator.sh/gpu": "25"}));
    let result = filter(&extender, gpu_pod(), &["unproven", "proven"]);
    assert_eq!(
        classes(&result),
        (vec!["proven"], vec![], vec!["unproven"]),
        "{result:?}"
    );
    assert_eq!(
        result.failed_and_unresolvable_nodes["unproven"],
        SWITCH_UNPROVEN_WHY
    );
    // A pod asking for no GPU is not the extender's to refuse.
    let plain = filter(&extender, one_container(json!({})), &["unproven"]);
    assert_eq!(classes(&plain).0, vec!["unproven"]);
    // Proven (the reporter says so once the taint goes): placed again.
    mark(&mut unproven, "false");
    extender
        .ledger()
        .apply_device(&serde_json::from_value(unproven).expect("a Device"));
    let result = filter(&extender, gpu_pod(), &["unproven"]);
    assert_eq!(classes(&result).0, vec!["unproven"], "{result:?}");
}

proptest::proptest! {
    /// The one-candidate pass picks what ranking every node picks: the best score,
    /// the earliest among equals, and a node that fits with no score last.
    #[test]
    fn the_best_candidate_is_the_ranked_first(scores in proptest::collection::vec(proptest::option::of(0i64..4), 0..40)) {
        let names: Vec<String> = (0..scores.len()).map(|i| format!("node-{i}")).collect();
        let fit: Vec<&str> = names.iter().map(String::as_str).collect();
        let (kept, kept_scores) = best_of(fit.clone(), scores.clone(), 1);
        let mut ranked: Vec<usize> = (0..scores.len()).collect();
        ranked.sort_by_key(|&i| (std::cmp::Reverse(scores[i]), i));
        let want: Vec<&str> = ranked.first().map(|&i| fit[i]).into_iter().collect();
        let want_scores: Vec<Option<i64>> = ranked.first().map(|&i| scores[i]).into_iter().collect();
        proptest::prop_assert_eq!(kept, want);
        proptest::prop_assert_eq!(kept_scores, want_scores);
    }
}
