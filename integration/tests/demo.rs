//! The node demo end to end: every sample pod placed as the scheduler decided, and
//! each container showing exactly its GPUs in its OCI spec and from inside.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_places_every_pod_and_containers_see_exactly_their_gpus() {
    tessera_integration::init_tracing();
    let cgroups_before = pod_cgroups();
    let mut out = Vec::new();
    let summary = tessera_integration::demo::run(&mut out)
        .await
        .expect("the demo runs");
    // kubelet removes a pod's cgroup once the pod is gone; the demo does as well.
    let left: Vec<_> = pod_cgroups().difference(&cgroups_before).cloned().collect();
    assert!(left.is_empty(), "the demo left pod cgroups: {left:?}");
    let printed = String::from_utf8_lossy(&out);
    let uuid = |minor: usize| summary.uuids[minor].clone();
    let placed = |name: &str| {
        summary
            .pods
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("{name} missing"))
    };

    // GPU 3 is the legacy pod's: nobody else may get it.
    for pod in &summary.pods {
        if let Ok(chosen) = &pod.placement {
            assert!(
                !chosen.contains(&uuid(3)),
                "{} got the legacy pod's GPU",
                pod.name
            );
            // The OCI spec and the running container agree with the scheduler, exactly.
            assert_eq!(
                pod.visible_devices.as_deref(),
                Some(chosen.join(",").as_str()),
                "{}",
                pod.name
            );
            let minors: Vec<usize> = chosen
                .iter()
                .map(|id| summary.uuids.iter().position(|u| u == id).expect("known"))
                .collect();
            let mut expected: Vec<String> = minors
                .iter()
                .map(|m| format!("/dev/nvidia{m}=195:{m}"))
                .collect();
            expected.extend([
                "/dev/nvidiactl=195:255".to_owned(),
                "/dev/nvidia-uvm=235:0".to_owned(),
            ]);
            expected.sort();
            let mut seen = pod.seen_inside.clone();
            seen.sort();
            assert_eq!(seen, expected, "{} sees other device nodes", pod.name);
        }
    }
    assert_eq!(placed("whole-gpu").placement, Ok(vec![uuid(0)]));
    assert_eq!(
        placed("two-gpus-shared").placement,
        Ok(vec![uuid(1), uuid(2)])
    );
    assert_eq!(
        placed("half-gpu")
            .limits
            .get("CUDA_DEVICE_SM_LIMIT")
            .map(String::as_str),
        Some("50")
    );
    assert_eq!(
        placed("half-gpu")
            .limits
            .get("CUDA_DEVICE_MEMORY_LIMIT_0")
            .map(String::as_str),
        Some("40960m")
    );
    assert_eq!(
        placed("memory-20gi")
            .limits
            .get("CUDA_DEVICE_MEMORY_LIMIT_0")
            .map(String::as_str),
        Some("20480m")
    );
    assert!(
        placed("whole-gpu").limits.is_empty(),
        "no limiter for a whole GPU"
    );
    // Shares are held by the node's backend (HAMi-core here), whole GPUs need none.
    assert_eq!(placed("half-gpu").enforcement.as_deref(), Some("hami-core"));
    assert_eq!(placed("whole-gpu").enforcement, None);
    assert!(
        summary.table.contains("shares held by: hami-core"),
        "{}",
        summary.table
    );
    assert!(
        placed("another-whole-gpu")
            .placement
            .as_ref()
            .is_err_and(|r| r.contains("0 of 3 usable GPUs")),
        "{:?}",
        placed("another-whole-gpu")
    );
    assert!(
        summary.table.contains("default/legacy-training (legacy)"),
        "{}",
        summary.table
    );
    assert!(printed.contains("$ tessera inspect"));
}

/// Every pod cgroup under `kubepods/besteffort`, in each cgroup hierarchy.
fn pod_cgroups() -> std::collections::BTreeSet<std::path::PathBuf> {
    let root = std::path::Path::new("/sys/fs/cgroup");
    let hierarchies = std::iter::once(root.to_path_buf()).chain(
        std::fs::read_dir(root)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path()),
    );
    hierarchies
        .flat_map(|h| {
            std::fs::read_dir(h.join("kubepods/besteffort"))
                .into_iter()
                .flatten()
                .flatten()
        })
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("pod"))
        })
        .collect()
}
