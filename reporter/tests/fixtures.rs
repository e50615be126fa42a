//! The real kubelet checkpoints in ../shared/fixtures/kubelet-checkpoint parse.

use std::path::PathBuf;

use tessera_reporter::checkpoint::parse_checkpoint;

fn fixture(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/fixtures/kubelet-checkpoint")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (../shared must sit beside the checkout)",
            path.display()
        )
    })
}

#[test]
fn one_gpu_on_numa_0() {
    let checkpoint = parse_checkpoint(&fixture("one-gpu-numa0.json")).expect("parses");
    assert_eq!(checkpoint.entries.len(), 1);
    let entry = &checkpoint.entries[0];
    assert_eq!(entry.pod_uid, "513cb897-0262-4868-826f-aa943ee45a38");
    assert_eq!(entry.container_name, "app");
    assert_eq!(entry.resource_name, "nvidia.com/gpu");
    assert_eq!(
        entry.device_ids,
        ["GPU-77a702db-e37f-3a74-d46d-c5713f66058c"]
    );
    assert_eq!(entry.numa_nodes, [0]);
    assert_eq!(
        entry.visible_devices,
        ["GPU-77a702db-e37f-3a74-d46d-c5713f66058c"]
    );
    assert!(entry.device_nodes.contains(&"/dev/nvidia0".to_owned()));
    assert!(entry.device_nodes.contains(&"/dev/nvidiactl".to_owned()));
    assert_eq!(checkpoint.registered_devices["nvidia.com/gpu"].len(), 3);
    assert_eq!(checkpoint.checksum, Some(133_412_836));
}

#[test]
fn two_gpus_on_numa_1() {
    let checkpoint = parse_checkpoint(&fixture("two-gpus-numa1.json")).expect("parses");
    let entry = &checkpoint.entries[0];
    assert_eq!(entry.numa_nodes, [1]);
    assert_eq!(
        entry.gpu_ids(),
        [
            "GPU-9b341c59-f96b-ba85-c137-78c3652fea65",
            "GPU-c1e9f249-b37b-81c2-a8d9-ba5ca0294841"
        ]
    );
    assert_eq!(
        entry
            .device_nodes
            .iter()
            .filter(|p| p.starts_with("/dev/nvidia") && p[11..].parse::<u32>().is_ok())
            .count(),
        2
    );
}

#[test]
fn two_pods_two_numa_nodes() {
    let checkpoint = parse_checkpoint(&fixture("two-pods-two-numa.json")).expect("parses");
    let pods: Vec<(&str, Vec<String>)> = checkpoint
        .entries
        .iter()
        .map(|e| (e.pod_uid.as_str(), e.gpu_ids()))
        .collect();
    assert_eq!(pods.len(), 2);
    assert_eq!(pods[0].1, ["GPU-77a702db-e37f-3a74-d46d-c5713f66058c"]);
    assert_eq!(pods[1].0, "94283d1b-ce5a-4797-bff8-0cf0c7143b2b");
    assert_eq!(
        pods[1].1,
        [
            "GPU-c1e9f249-b37b-81c2-a8d9-ba5ca0294841",
            "GPU-9b341c59-f96b-ba85-c137-78c3652fea65"
        ]
    );
}

#[test]
fn device_without_numa_affinity() {
    let checkpoint = parse_checkpoint(&fixture("single-device-no-numa.json")).expect("parses");
    let entry = &checkpoint.entries[0];
    assert_eq!(entry.numa_nodes, [-1]);
    assert_eq!(entry.device_ids, ["tegra"]);
    assert_eq!(entry.visible_devices, ["tegra"]);
}
