use super::*;

fn args(line: &str) -> Vec<String> {
    line.split_whitespace().map(str::to_owned).collect()
}

#[test]
fn the_config_dir_wins_then_the_config_file() {
    assert_eq!(
            plan(&args("/usr/bin/kubelet --config=/var/lib/kubelet/config.yaml --config-dir /etc/kubernetes/kubelet.conf.d"))
                .expect("plan"),
            Plan::DropIn(PathBuf::from("/etc/kubernetes/kubelet.conf.d").join(DROP_IN))
        );
    assert_eq!(
        plan(&args("kubelet --config /var/lib/kubelet/config.yaml --v=2")).expect("plan"),
        Plan::EditConfig(PathBuf::from("/var/lib/kubelet/config.yaml"))
    );
}

#[test]
fn an_endpoint_flag_or_no_configuration_is_refused_with_the_reason() {
    let error = plan(&args(
            "kubelet --config-dir=/d --container-runtime-endpoint=unix:///run/containerd/containerd.sock",
        ))
        .expect_err("refused");
    assert!(
            error.to_string().contains("--container-runtime-endpoint=unix:///run/containerd/containerd.sock on its command line"),
            "{error}"
        );
    let error = plan(&args("kubelet --v=2")).expect_err("refused");
    assert!(
        error
            .to_string()
            .contains("neither --config nor --config-dir"),
        "{error}"
    );
}

#[test]
fn editing_the_config_sets_both_endpoints_and_keeps_the_rest() {
    let config = "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\ncgroupDriver: systemd\ncontainerRuntimeEndpoint: unix:///run/containerd/containerd.sock\n";
    let edited = edit_config(config, "unix:///run/tessera/runtime-proxy.sock").expect("edit");
    let value: serde_yaml::Value = serde_yaml::from_str(&edited).expect("yaml");
    assert_eq!(value["cgroupDriver"], "systemd");
    for key in ["containerRuntimeEndpoint", "imageServiceEndpoint"] {
        assert_eq!(value[key], "unix:///run/tessera/runtime-proxy.sock");
    }
    let error = edit_config("kind: Pod\n", "x").expect_err("refused");
    assert!(
        error.to_string().contains("not a KubeletConfiguration"),
        "{error}"
    );
}

#[test]
fn the_drop_in_is_a_kubelet_configuration() {
    let value: serde_yaml::Value = serde_yaml::from_str(&drop_in("unix:///p.sock")).expect("yaml");
    assert_eq!(value["kind"], "KubeletConfiguration");
    assert_eq!(value["containerRuntimeEndpoint"], "unix:///p.sock");
    assert_eq!(value["imageServiceEndpoint"], "unix:///p.sock");
}

#[test]
fn calls_are_summed_over_methods_and_codes() {
    let page = "# TYPE tessera_proxy_requests counter\n\
                    tessera_proxy_requests_total{method=\"Version\",code=\"Ok\"} 2\n\
                    tessera_proxy_requests_total{method=\"ListPodSandbox\",code=\"Ok\"} 40\n\
                    tessera_proxy_request_duration_seconds_count{method=\"Version\"} 2\n# EOF\n";
    assert_eq!(calls_in(page), 42);
}

#[test]
fn a_directory_others_may_write_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("dir");
    let open = dir.path().join("open");
    std::fs::create_dir(&open).expect("mkdir");
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let error = write_file(&open.join("config.yaml"), "x").expect_err("refused");
    assert!(error.to_string().contains("not ours alone"), "{error}");
}

#[test]
fn only_processes_of_this_mount_namespace_count() {
    assert!(same_mount_namespace(std::process::id()));
    assert!(!same_mount_namespace(u32::MAX));
}

#[test]
fn files_are_replaced_whole() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("d/config.yaml");
    write_file(&path, "a").expect("write");
    write_file(&path, "b").expect("write");
    assert_eq!(std::fs::read_to_string(&path).expect("read"), "b");
    assert_eq!(
        std::fs::read_dir(path.parent().expect("dir"))
            .expect("ls")
            .count(),
        1
    );
    assert_eq!(
        backup_of(&path),
        dir.path().join("d/config.yaml.tessera-backup")
    );
}

fn switch_to(endpoint: &str) -> Switch {
    Switch {
        node: "n".into(),
        kubelet_pid: std::process::id(),
        kubelet_args: vec![],
        endpoint: endpoint.into(),
        metrics: "127.0.0.1:1".into(),
        restart_command: "true".into(),
        verify_timeout: Duration::from_secs(1),
        enforcement_dir: PathBuf::from("/nonexistent"),
    }
}

#[test]
fn kubelet_is_on_the_proxy_only_by_a_fresh_connection_from_its_own_process() {
    let dir = tempfile::tempdir().expect("dir");
    let mut switch = switch_to("unix:///p.sock");
    switch.enforcement_dir = dir.path().to_path_buf();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    let write = |connections: u32, pid: u32, at: u64| {
        std::fs::write(
            dir.path().join("kubelet"),
            format!(
                r#"{{"connections":{connections},"runtime_call_at":{at},"pid":{pid},"at":{at}}}"#
            ),
        )
        .expect("write");
    };
    let error = switch.kubelet_on_proxy().expect_err("no file");
    assert!(error.to_string().contains("has not run here"), "{error}");
    write(2, switch.kubelet_pid, now);
    assert_eq!(switch.kubelet_on_proxy().expect("proven").connections, 2);
    write(1, switch.kubelet_pid + 1, now);
    let error = switch.kubelet_on_proxy().expect_err("another process");
    assert!(error.to_string().contains("not kubelet's"), "{error}");
    write(0, switch.kubelet_pid, now);
    assert!(switch.kubelet_on_proxy().is_err(), "no connection");
    write(1, switch.kubelet_pid, now - 600);
    assert!(switch.kubelet_on_proxy().is_err(), "a stale file");
}

#[test]
fn a_setting_already_in_place_is_recognised_and_nothing_else() {
    let dir = tempfile::tempdir().expect("dir");
    let switch = switch_to("unix:///p.sock");
    let path = dir.path().join(DROP_IN);
    let plan = Plan::DropIn(path.clone());
    assert!(!switch.already_set(&plan), "no drop-in yet");
    std::fs::write(&path, drop_in("unix:///other.sock")).expect("write");
    assert!(
        !switch.already_set(&plan),
        "a drop-in naming another endpoint"
    );
    std::fs::write(&path, drop_in("unix:///p.sock")).expect("write");
    assert!(switch.already_set(&plan));

    let config = dir.path().join("config.yaml");
    let plan = Plan::EditConfig(config.clone());
    let original = "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\ncontainerRuntimeEndpoint: unix:///run/containerd/containerd.sock\n";
    std::fs::write(&config, original).expect("write");
    assert!(!switch.already_set(&plan), "kubelet still names containerd");
    std::fs::write(
        &config,
        edit_config(original, "unix:///p.sock").expect("edit"),
    )
    .expect("write");
    assert!(switch.already_set(&plan));
}

fn status(code: u16) -> kube::Error {
    kube::Error::Api(
        kube::core::Status::failure("x", "y")
            .with_code(code)
            .boxed(),
    )
}

#[test]
fn only_a_deleted_or_unreadable_daemonset_switches_the_node_back() {
    use k8s_openapi::api::apps::v1::DaemonSet;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    assert_eq!(
        owner_from(Some(Ok(Some(DaemonSet::default())))),
        Owner::Present
    );
    let mut deleting = DaemonSet::default();
    deleting.metadata.deletion_timestamp = Some(Time(Default::default()));
    assert_eq!(owner_from(Some(Ok(Some(deleting)))), Owner::Uninstalled);
    assert_eq!(owner_from(Some(Ok(None))), Owner::Uninstalled);
    for code in [401, 403, 404] {
        assert_eq!(
            owner_from(Some(Err(status(code)))),
            Owner::Uninstalled,
            "{code}"
        );
    }
    // An API that fails or does not answer must not switch a node back.
    assert_eq!(owner_from(Some(Err(status(500)))), Owner::Unknown);
    assert_eq!(owner_from(None), Owner::Unknown);
}

/// kubelet's projected token layout: `token` -> `..data/token`, `..data` ->
/// a timestamped directory, swapped on each refresh.
#[test]
fn the_token_is_read_through_its_held_directory_and_follows_refreshes() -> anyhow::Result<()> {
    use std::os::unix::fs::symlink;
    let dir = tempfile::tempdir()?;
    let account = dir.path().join("serviceaccount");
    std::fs::create_dir_all(account.join("..2026_11_27_01"))?;
    std::fs::write(account.join("..2026_11_27_01/token"), "first")?;
    symlink("..2026_11_27_01", account.join("..data"))?;
    symlink("..data/token", account.join("token"))?;
    let path = token_through_fd(&account.join("token"))?;
    assert!(path.starts_with("/proc/self/fd/"), "{path}");
    assert_eq!(std::fs::read_to_string(&path)?, "first");
    // A refresh, as kubelet makes it: a new directory, then ..data swapped.
    std::fs::create_dir_all(account.join("..2026_11_27_02"))?;
    std::fs::write(account.join("..2026_11_27_02/token"), "second")?;
    symlink("..2026_11_27_02", account.join("..data_tmp"))?;
    std::fs::rename(account.join("..data_tmp"), account.join("..data"))?;
    std::fs::remove_dir_all(account.join("..2026_11_27_01"))?;
    assert_eq!(std::fs::read_to_string(&path)?, "second");
    // Even once the directory's own path is gone from this namespace's view.
    let moved = dir.path().join("elsewhere");
    std::fs::rename(&account, &moved)?;
    assert_eq!(std::fs::read_to_string(&path)?, "second");
    assert!(token_through_fd(&dir.path().join("missing/token")).is_err());
    Ok(())
}

#[test]
fn a_process_is_replaced_only_once_it_is_gone() {
    let me = std::process::id();
    let started = process_start(me);
    assert!(started.is_some());
    assert!(!replaced(me, started), "this process still runs");
    assert!(
        replaced(me, started.map(|s| s + 1)),
        "a reused pid is another process"
    );
    assert!(replaced(u32::MAX - 1, started), "no such process");
    assert!(!replaced(me, None), "never observed: not replaced");
}

#[test]
fn cleanup_removes_only_what_the_reporter_published() {
    let node: Node = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "n", "resourceVersion": "7", "labels": {
            "node.koordinator.sh/gpu-model": "H100", "kubernetes.io/hostname": "n",
            "tessera.io/gpu-node": "true"}},
        "status": {
            "capacity": {"cpu": "8", "koordinator.sh/gpu-core": "400", "nvidia.com/gpu": "4",
                         "aliyun.com/gpu-mem": "320"},
            "allocatable": {"cpu": "8", "koordinator.sh/gpu-core": "400"}}
    }))
    .expect("node");
    let (status, labels) = cleanup_patches(&node, false);
    assert_eq!(
        status,
        vec![
            serde_json::json!({"op": "test", "path": "/metadata/resourceVersion", "value": "7"}),
            serde_json::json!({"op": "remove", "path": "/status/capacity/koordinator.sh~1gpu-core"}),
            serde_json::json!({"op": "remove", "path": "/status/capacity/aliyun.com~1gpu-mem"}),
            serde_json::json!({"op": "remove", "path": "/status/allocatable/koordinator.sh~1gpu-core"}),
        ]
    );
    assert_eq!(
        labels[1],
        serde_json::json!({"op": "remove", "path": "/metadata/labels/node.koordinator.sh~1gpu-model"})
    );
    assert_eq!(labels.len(), 2, "the operator's labels stay: {labels:?}");
    let (status, _) = cleanup_patches(&node, true);
    assert!(
        status
            .iter()
            .any(|op| op["path"] == "/status/capacity/nvidia.com~1gpu")
    );
    let clean: Node =
        serde_json::from_value(serde_json::json!({"metadata": {"name": "n"}})).expect("node");
    assert_eq!(cleanup_patches(&clean, true), (vec![], vec![]));
}

#[test]
fn cleanup_lifts_the_switch_taint_and_only_it() {
    let node: Node = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "n", "resourceVersion": "9"},
        "spec": {"taints": [
            {"key": TAINT_KEY, "effect": "NoSchedule"},
            {"key": "dedicated", "value": "gpu", "effect": "NoSchedule"},
            {"key": TAINT_KEY, "effect": "NoSchedule"}]}
    }))
    .expect("node");
    let (status, object) = cleanup_patches(&node, false);
    assert!(status.is_empty());
    assert_eq!(
        object,
        vec![
            serde_json::json!({"op": "test", "path": "/metadata/resourceVersion", "value": "9"}),
            serde_json::json!({"op": "remove", "path": "/spec/taints/2"}),
            serde_json::json!({"op": "remove", "path": "/spec/taints/0"}),
        ],
        "the operator's taint stays; removals from the highest index"
    );
}

#[test]
fn only_a_refused_identity_counts_as_forbidden() {
    for (code, want) in [(401, true), (403, true), (404, false), (500, false)] {
        let error = anyhow::Error::new(status(code)).context("removing the taint");
        assert_eq!(forbidden(&error), want, "{code}");
    }
    assert!(!forbidden(&anyhow::anyhow!("timed out")));
}

#[test]
fn a_checkpoint_without_allocations_is_moved_aside_and_one_with_them_kept() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("kubelet_internal_checkpoint");
    // No file: nothing to do.
    assert_eq!(clear_stale_checkpoint(&path), None);
    // HAMi's plugin registered its vGPU devices; no pod holds any.
    std::fs::write(
        &path,
        r#"{"Data":{"PodDeviceEntries":null,"RegisteredDevices":{"nvidia.com/gpu":["GPU-a-0","GPU-a-1"]}},"Checksum":1}"#,
    )?;
    let done = clear_stale_checkpoint(&path).unwrap_or_default();
    assert!(
        done.contains("moved") && done.contains("nvidia.com/gpu"),
        "{done}"
    );
    assert!(!path.exists() && path.with_extension("tessera-stale").exists());
    // A real checkpoint of a pod holding a GPU: kept, naming the pod.
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/fixtures/kubelet-checkpoint/one-gpu-numa0.json");
    std::fs::copy(&fixture, &path)?;
    let done = clear_stale_checkpoint(&path).unwrap_or_default();
    assert!(
        done.contains("kept") && done.contains("hold devices"),
        "{done}"
    );
    assert!(path.exists());
    // Unreadable: left alone, said so.
    std::fs::write(&path, "not json")?;
    let done = clear_stale_checkpoint(&path).unwrap_or_default();
    assert!(done.contains("left as it is"), "{done}");
    assert!(path.exists());
    Ok(())
}
