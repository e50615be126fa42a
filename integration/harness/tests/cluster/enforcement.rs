//! Enforced shares on the real cluster (issue "Enforced shares"): what holds a
//! shared container to its grant, checked where it takes effect.
//!
//! - Driver memory limits: the fake NVML logs every `nvmlDeviceSetMemoryLimits_v1`
//!   call; the one for a shared container must name the cgroup its process really
//!   runs in (`/proc/<pid>/cgroup`), with its granted bytes, and come again for the
//!   new container when kubelet restarts it.
//! - HAMi-core (a stand-in `libvgpu.so`): mapped into the container's process and
//!   into a child it starts with an empty environment, through `/etc/ld.so.preload`.

use anyhow::{Context, ensure};
use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};
use tessera_harness::cluster::{Cluster, allocated_gpus, env_values, probe_pod as pod};
use tessera_harness::image::PRELOAD_PROBE_IMAGE;

const GIB: u64 = 1 << 30;

/// The container ID kubelet reports for `container`.
fn container_id(pod: &Pod, container: &str) -> anyhow::Result<String> {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.name == container))
        .and_then(|c| c.container_id.clone())
        .with_context(|| format!("no container ID for {container}"))
}

/// The sysfs cgroup v2 directory the process `pid` runs in: its `0::` path
/// under the host's cgroup2 mount (`/sys/fs/cgroup`, or `/sys/fs/cgroup/unified`
/// on a hybrid host such as these machines).
fn cgroup_of(pid: u32) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
    let path = text
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .context("no cgroup v2 line")?;
    let mounts = std::fs::read_to_string("/proc/self/mountinfo")?;
    let mount = mounts
        .lines()
        .find_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            right
                .starts_with("cgroup2 ")
                .then(|| left.split_whitespace().nth(4))?
        })
        .context("no cgroup2 mount")?;
    Ok(format!("{mount}{path}"))
}

/// The `SetMemoryLimits` calls naming `cgroup`.
fn calls_on(cluster: &Cluster, cgroup: &str) -> anyhow::Result<Vec<Value>> {
    Ok(cluster
        .memory_limit_calls()?
        .into_iter()
        .filter(|c| c["nameSpace"] == cgroup)
        .collect())
}

/// Checks that the driver holds `bytes` on `uuid` for the cgroup of `pod`'s
/// container `main` as it runs now.
fn assert_limit_on_running(
    cluster: &Cluster,
    pod: &Pod,
    uuid: &str,
    bytes: u64,
) -> anyhow::Result<String> {
    let id = container_id(pod, "main")?;
    let pid = cluster.container_pid(&id)?;
    let cgroup = cgroup_of(pid)?;
    let calls = calls_on(cluster, &cgroup)?;
    ensure!(
        calls.len() == 1,
        "container {id} (pid {pid}, cgroup {cgroup}): {} SetMemoryLimits calls on its cgroup, want 1; all calls: {:?}",
        calls.len(),
        cluster.memory_limit_calls()?
    );
    let call = &calls[0];
    ensure!(
        call["uuid"] == uuid
            && call["hardLimit"] == bytes
            && call["softLimit"] == bytes
            && call["result"] == 0,
        "container {id}: SetMemoryLimits call {call}, want {uuid} soft = hard = {bytes}, result 0"
    );
    ensure!(
        call["pid"] != pid,
        "the limit was set by the container's own process {pid}, not by the runtime's hook"
    );
    Ok(cgroup)
}

/// A shared container's driver memory limit is on its own cgroup before it runs,
/// and on its next cgroup after kubelet restarts it; a whole-GPU container and a
/// GPU-less one get none; the container's spec says which backends hold it.
pub async fn driver_memory_limits_on_the_containers_own_cgroup(
    cluster: &mut Cluster,
) -> anyhow::Result<()> {
    let calls_before = cluster.memory_limit_calls()?.len();
    cluster
        .create_pod(
            "admin",
            &pod(
                "enforced",
                &[(
                    "main",
                    json!({"koordinator.sh/gpu-core": "25", "koordinator.sh/gpu-memory-ratio": "25"}),
                )],
                &[],
            ),
        )
        .await?;
    cluster
        .create_pod(
            "admin",
            &pod(
                "whole",
                &[("main", json!({"koordinator.sh/gpu": "100"}))],
                &[],
            ),
        )
        .await?;
    cluster
        .create_pod("admin", &pod("plain", &[("main", json!({}))], &[]))
        .await?;
    let enforced = cluster.wait_running("enforced").await?;
    let whole = cluster.wait_running("whole").await?;
    let plain = cluster.wait_running("plain").await?;

    let gpus = allocated_gpus(&enforced)?;
    ensure!(gpus.len() == 1, "enforced: granted {gpus:?}");
    let uuid = gpus[0].0.clone();
    // 25 % of the fake GPU's 80 GiB.
    let bytes = 20 * GIB;
    let first = assert_limit_on_running(cluster, &enforced, &uuid, bytes)?;

    let spec = cluster
        .container_specs(&enforced)?
        .remove("main")
        .context("no spec")?;
    ensure!(
        env_values(&spec, "TESSERA_ENFORCEMENT")
            == ["driver-memory+mps+gpu-time+oom-kill+hami-core"],
        "enforced: TESSERA_ENFORCEMENT {:?}, want [driver-memory+mps+gpu-time+oom-kill+hami-core]",
        env_values(&spec, "TESSERA_ENFORCEMENT")
    );
    let hooks = spec["hooks"]["createRuntime"].to_string();
    ensure!(
        hooks.contains("tessera-enforce") && hooks.contains(&format!("--limit={uuid}={bytes}")),
        "enforced: createRuntime hooks {hooks}, want tessera-enforce with --limit={uuid}={bytes}"
    );

    // kubelet restarts the container: a new container, a new cgroup, the limit again.
    let restarts_before = cluster.memory_limit_calls()?.len();
    cluster.kill_container(&container_id(&enforced, "main")?)?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let restarted = loop {
        let pod = cluster.wait_running("enforced").await?;
        let restarted = pod
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .and_then(|cs| cs.first())
            .is_some_and(|c| c.restart_count >= 1 && c.ready);
        if restarted {
            break pod;
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "enforced: not restarted within 60 s of its container being killed"
        );
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    };
    let second = assert_limit_on_running(cluster, &restarted, &uuid, bytes)?;
    ensure!(
        second != first,
        "the restarted container runs in the cgroup of the one before ({first})"
    );
    ensure!(
        cluster.memory_limit_calls()?.len() == restarts_before + 1,
        "the restart made {} SetMemoryLimits calls, want 1",
        cluster.memory_limit_calls()?.len() - restarts_before
    );

    // Whole GPUs and no GPUs: no limit, no backend named, no hook.
    for pod in [&whole, &plain] {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let pid = cluster.container_pid(&container_id(pod, "main")?)?;
        ensure!(
            calls_on(cluster, &cgroup_of(pid)?)?.is_empty(),
            "{name}: a container without a share got a memory limit"
        );
        let spec = cluster
            .container_specs(pod)?
            .remove("main")
            .context("no spec")?;
        ensure!(
            env_values(&spec, "TESSERA_ENFORCEMENT").is_empty()
                && !spec["hooks"].to_string().contains("tessera-enforce"),
            "{name}: enforcement on a container without a share: TESSERA_ENFORCEMENT {:?}, hooks {}",
            env_values(&spec, "TESSERA_ENFORCEMENT"),
            spec["hooks"]
        );
    }
    ensure!(
        cluster.memory_limit_calls()?.len() == calls_before + 2,
        "{} SetMemoryLimits calls in this scenario, want 2 (start and restart of the shared container)",
        cluster.memory_limit_calls()?.len() - calls_before
    );
    // The pod's CDI spec goes with the pod.
    let uid = enforced.metadata.uid.clone().unwrap_or_default();
    for name in ["enforced", "whole", "plain"] {
        cluster.delete_pod(name).await?;
    }
    let cdi = cluster.cdi_dir();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let left: Vec<String> = std::fs::read_dir(&cdi)?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(&uid))
            .collect();
        if left.is_empty() {
            break;
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "CDI specs of deleted pod {uid} still in {}: {left:?}",
            cdi.display()
        );
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    Ok(())
}

/// HAMi-core, when the operator supplies it, is preloaded in a shared
/// container: mapped into its process and into a child started with an empty
/// environment, with the tenant's own switches removed, and its region already
/// written with the grant; a container without a share does not get it.
pub async fn hami_core_is_preloaded_even_under_env_i(cluster: &mut Cluster) -> anyhow::Result<()> {
    let preload_pod = |name: &str, limits: Value| {
        json!({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": "default"},
               "spec": {"containers": [{
                   "name": "main", "image": PRELOAD_PROBE_IMAGE, "imagePullPolicy": "Never",
                   "env": [{"name": "CUDA_DISABLE_CONTROL", "value": "true"},
                           {"name": "LD_PRELOAD", "value": "/nonexistent-user-lib.so"}],
                   "resources": {"limits": limits}}],
                        "terminationGracePeriodSeconds": 0,
                        "automountServiceAccountToken": false}})
    };
    cluster
        .create_pod(
            "admin",
            &preload_pod("preloaded", json!({"koordinator.sh/gpu": "30"})),
        )
        .await?;
    cluster
        .create_pod("admin", &preload_pod("unshared", json!({})))
        .await?;
    let preloaded = cluster.wait_running("preloaded").await?;
    let unshared = cluster.wait_running("unshared").await?;
    let lines = |pod: &Pod| -> anyhow::Result<Vec<String>> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let log = cluster.container_log(pod, "main")?;
            let lines: Vec<String> = log
                .lines()
                .filter_map(|l| l.split_once("preload ").map(|(_, rest)| rest.to_owned()))
                .collect();
            if lines.len() >= 2 || std::time::Instant::now() > deadline {
                return Ok(lines);
            }
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    };
    let library = "/usr/local/vgpu/libvgpu.so";
    let seen = lines(&preloaded)?;
    ensure!(
        seen.len() == 2
            && seen[0].starts_with("main:")
            && seen[0].ends_with(&format!("mapped={library}"))
            && seen[1] == format!("env-i: env=0 mapped={library}"),
        "preloaded: the probe printed {seen:?}, want libvgpu.so mapped in main and in the env -i child"
    );
    let seen = lines(&unshared)?;
    ensure!(
        seen.len() == 2 && seen.iter().all(|l| l.ends_with("mapped=none")),
        "unshared: the probe printed {seen:?}, want no libvgpu.so"
    );
    let spec = cluster
        .container_specs(&preloaded)?
        .remove("main")
        .context("no spec")?;
    ensure!(
        env_values(&spec, "CUDA_DISABLE_CONTROL").is_empty(),
        "preloaded: the tenant's CUDA_DISABLE_CONTROL reached the runtime"
    );
    ensure!(
        env_values(&spec, "LD_PRELOAD") == ["/nonexistent-user-lib.so"],
        "preloaded: the user's LD_PRELOAD was changed: {:?}",
        env_values(&spec, "LD_PRELOAD")
    );
    ensure!(
        env_values(&spec, "CUDA_DEVICE_MEMORY_SHARED_CACHE") == ["/tmp/cudevshr.cache"],
        "preloaded: CUDA_DEVICE_MEMORY_SHARED_CACHE {:?}",
        env_values(&spec, "CUDA_DEVICE_MEMORY_SHARED_CACHE")
    );
    let mounts: Vec<(String, bool)> = spec["mounts"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| {
            let destination = m["destination"].as_str()?.to_owned();
            let readonly = m["options"]
                .as_array()
                .is_some_and(|o| o.iter().any(|x| x == "ro"));
            Some((destination, readonly))
        })
        .filter(|(d, _)| {
            [
                "/etc/ld.so.preload",
                library,
                "/tmp/cudevshr.cache",
                "/tmp/vgpulock",
            ]
            .contains(&d.as_str())
        })
        .collect();
    let mut mounts = mounts;
    mounts.sort();
    let want = [
        ("/etc/ld.so.preload".to_owned(), true),
        ("/tmp/cudevshr.cache".to_owned(), false),
        ("/tmp/vgpulock".to_owned(), false),
        (library.to_owned(), true),
    ];
    ensure!(
        mounts == want,
        "preloaded: HAMi-core mounts (destination, read-only) {mounts:?}, want {want:?}"
    );
    // The region was written with the grant by the proxy's primer (HAMi-core's
    // own code; here the stand-in, which records who wrote it), before the
    // container's first process: an `env -i` first process finds the grant.
    let region = spec["mounts"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["destination"] == "/tmp/cudevshr.cache")
        .and_then(|m| m["source"].as_str())
        .context("no region mount")?;
    let written = std::fs::read_to_string(region)?;
    let want = format!(
        "tessera-vgpu-stand-in region\nwriter=tessera-enforce\nCUDA_DEVICE_MEMORY_LIMIT_0={}\nCUDA_DEVICE_SM_LIMIT={}\n",
        env_values(&spec, "CUDA_DEVICE_MEMORY_LIMIT_0").join(","),
        env_values(&spec, "CUDA_DEVICE_SM_LIMIT").join(",")
    );
    ensure!(
        written == want,
        "preloaded: region {region} holds {written:?}, want {want:?}"
    );
    for name in ["preloaded", "unshared"] {
        cluster.delete_pod(name).await?;
    }
    Ok(())
}

/// The node's backends, as the proxy lists them, reach the Device CR through the
/// reporter, and a pod's `tessera.io/require-enforcement` lands only where they
/// hold what it asks: with compute no longer held, a pod requiring it stays
/// Pending with the reason, and places once it is held again.
pub async fn required_enforcement_places_only_where_held(
    cluster: &mut Cluster,
) -> anyhow::Result<()> {
    let devices = tessera_harness::cluster::device_api(&cluster.client().await?);
    let wait_labels = |want: &'static str, want_compute: bool| {
        let devices = devices.clone();
        async move {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
            loop {
                let device = devices.get(tessera_harness::cluster::NODE_NAME).await?;
                let annotation = device
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get("tessera.io/enforcement").cloned());
                let gpus = device.data["spec"]["devices"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default();
                let labelled =
                    |key: &str| !gpus.is_empty() && gpus.iter().all(|d| d["labels"][key] == "true");
                if annotation.as_deref() == Some(want)
                    && labelled("tessera.io/enforce-memory")
                    && labelled("tessera.io/enforce-compute") == want_compute
                {
                    return Ok::<(), anyhow::Error>(());
                }
                ensure!(
                    std::time::Instant::now() < deadline,
                    "the Device CR does not show {want} within 30 s: annotation {annotation:?}, GPUs {gpus:?}"
                );
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            }
        }
    };
    wait_labels("driver-memory+mps+gpu-time+oom-kill+hami-core", true).await?;

    let requiring = |name: &str, value: &str| {
        let mut pod = pod(name, &[("main", json!({"koordinator.sh/gpu": "10"}))], &[]);
        pod["metadata"]["annotations"] = json!({"tessera.io/require-enforcement": value});
        pod
    };
    // Held: placed.
    cluster
        .create_pod("admin", &requiring("needs-both", "memory,compute"))
        .await?;
    cluster.wait_running("needs-both").await?;

    // The proxy now lists no MPS (as on a node without the MPS daemon): HAMi-core's
    // compute limit is not counted as held (it did not hold on an H100).
    let file = cluster.enforcement_backends_file();
    let before = std::fs::read_to_string(&file)?;
    std::fs::write(&file, "driver-memory+hami-core\n")?;
    let outcome = async {
        wait_labels("driver-memory+hami-core", false).await?;
        cluster
            .create_pod("admin", &requiring("needs-compute", "compute"))
            .await?;
        cluster
            .create_pod("admin", &requiring("needs-memory", "memory"))
            .await?;
        cluster.wait_running("needs-memory").await?;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let events = cluster.events_of("needs-compute").await?;
            if let Some(event) = events.iter().find(|e| e.starts_with("FailedScheduling")) {
                ensure!(
                    event.contains("tessera.io/require-enforcement"),
                    "needs-compute: the reason does not name the annotation: {event}"
                );
                break;
            }
            ensure!(
                std::time::Instant::now() < deadline,
                "needs-compute: no FailedScheduling within 60 s: {events:?}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        }
        Ok::<(), anyhow::Error>(())
    }
    .await;
    std::fs::write(&file, before)?;
    outcome?;
    // Held again: the waiting pod places.
    wait_labels("driver-memory+mps+gpu-time+oom-kill+hami-core", true).await?;
    cluster.wait_running("needs-compute").await?;

    // A value that names neither part is refused with the annotation named.
    cluster
        .create_pod("admin", &requiring("needs-typo", "memroy"))
        .await?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let events = cluster.events_of("needs-typo").await?;
        if let Some(event) = events.iter().find(|e| e.contains("\"memroy\"")) {
            ensure!(
                event.contains("tessera.io/require-enforcement"),
                "needs-typo: {event}"
            );
            break;
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "needs-typo: no event naming the bad value within 60 s: {events:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    for name in ["needs-both", "needs-compute", "needs-memory", "needs-typo"] {
        cluster.delete_pod(name).await?;
    }
    Ok(())
}

/// The mount of `path` in an OCI spec: (source, options).
fn mount_of(spec: &Value, path: &str) -> Option<(String, Vec<String>)> {
    spec["mounts"].as_array()?.iter().rev().find_map(|m| {
        (m["destination"] == path).then(|| {
            let options = m["options"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|o| o.as_str().map(str::to_owned))
                .collect();
            (m["source"].as_str().unwrap_or_default().to_owned(), options)
        })
    })
}

/// Waits up to 30 s for `check` to hold; `what` names it in the error.
async fn eventually(
    what: &str,
    mut check: impl FnMut() -> anyhow::Result<bool>,
) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        if check()? {
            return Ok(());
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "{what}: not within 30 s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
}

/// MPS: a shared container gets a namespace of its GPU's server, made before it
/// starts with its grant as limits, and that namespace's directory alone as its
/// pipe directory (read-only, at both default paths), whatever MPS env the tenant
/// set; the GPU goes exclusive-process while it holds the share. The namespace
/// survives the MPS daemon's death (the supervisor brings it back) and goes with
/// the pod, the server and exclusivity with it. A container asking for shares of
/// two GPUs is not placed on the MPS node, with the reason.
pub async fn mps_holds_each_shared_container_in_its_own_namespace(
    cluster: &mut Cluster,
) -> anyhow::Result<()> {
    cluster
        .create_pod(
            "admin",
            &pod(
                "mps-share",
                &[(
                    "main",
                    json!({"koordinator.sh/gpu-core": "25", "koordinator.sh/gpu-memory-ratio": "25"}),
                )],
                &[
                    ("CUDA_MPS_PIPE_DIRECTORY", "/tmp/elsewhere"),
                    ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100"),
                ],
            ),
        )
        .await?;
    let shared = cluster.wait_running("mps-share").await?;
    let gpus = allocated_gpus(&shared)?;
    ensure!(gpus.len() == 1, "mps-share: granted {gpus:?}");
    let (uuid, minor) = gpus[0].clone();
    let server = format!("gpu_{minor}");
    let spec = cluster
        .container_specs(&shared)?
        .remove("main")
        .context("no spec")?;

    // The pipe directory: the namespace's own, read-only, at both default paths.
    let pipe = cluster.mps_pipe_dir().join(&server);
    let (source, options) =
        mount_of(&spec, "/run/nvidia-mps").context("no /run/nvidia-mps mount")?;
    let namespace = std::path::Path::new(&source)
        .strip_prefix(&pipe)
        .ok()
        .and_then(|rest| rest.to_str())
        .filter(|rest| !rest.contains('/'))
        .with_context(|| {
            format!(
                "/run/nvidia-mps comes from {source}, not a namespace of {}",
                pipe.display()
            )
        })?
        .to_owned();
    ensure!(
        options.iter().any(|o| o == "ro"),
        "/run/nvidia-mps is not read-only: {options:?}"
    );
    ensure!(
        mount_of(&spec, "/tmp/nvidia-mps")
            .is_some_and(|(s, o)| s == source && o.iter().any(|o| o == "ro")),
        "/tmp/nvidia-mps is not the same read-only namespace: {:?}",
        mount_of(&spec, "/tmp/nvidia-mps")
    );
    for (key, want) in [
        ("CUDA_MPS_PIPE_DIRECTORY", "/run/nvidia-mps"),
        ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "25"),
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=20480M"),
        (
            "TESSERA_ENFORCEMENT",
            "driver-memory+mps+gpu-time+oom-kill+hami-core",
        ),
    ] {
        ensure!(
            env_values(&spec, key) == [want],
            "mps-share: {key} is {:?}, want only {want:?}",
            env_values(&spec, key)
        );
    }
    // In the container's own mount namespace, its pipe directory holds the
    // namespace's socket.
    use std::os::unix::fs::FileTypeExt as _;
    let pid = cluster.container_pid(&container_id(&shared, "main")?)?;
    let socket = format!("/proc/{pid}/root/run/nvidia-mps/control");
    ensure!(
        std::fs::metadata(&socket).is_ok_and(|m| m.file_type().is_socket()),
        "{socket} is not the namespace's socket"
    );

    // The daemon holds the grant: 20 GiB (25 % of 80 GiB) and 25 % of the threads.
    let held = |cluster: &Cluster| -> anyhow::Result<(String, String)> {
        Ok((
            cluster.mps_control(&[
                "namespace",
                "get",
                &namespace,
                &server,
                "pinned-memory-limit",
            ])?,
            cluster.mps_control(&[
                "namespace",
                "get",
                &namespace,
                &server,
                "active-thread-percentage",
            ])?,
        ))
    };
    let want = ("20G".to_owned(), "25.00".to_owned());
    ensure!(
        held(cluster)? == want,
        "namespace {namespace}: {:?}, want {want:?}",
        held(cluster)?
    );
    let exclusive = |cluster: &Cluster, mode: u64| {
        cluster.compute_mode_calls().map(|calls| {
            calls
                .iter()
                .any(|c| c["uuid"] == uuid.as_str() && c["mode"] == mode && c["result"] == 0)
        })
    };
    ensure!(
        exclusive(cluster, 3)?,
        "GPU {uuid} was not made exclusive-process: {:?}",
        cluster.compute_mode_calls()?
    );

    // The control daemon dies: the supervisor starts it again with the namespace.
    let pid_file = cluster.mps_pipe_dir().join("nvidia-cuda-mps-control.pid");
    let first = std::fs::read_to_string(&pid_file)?;
    let first_pid: i32 = first.trim().parse()?;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(first_pid),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    eventually("the MPS daemon's return", || {
        Ok(std::fs::read_to_string(&pid_file).is_ok_and(|p| p != first) && held(cluster).is_ok())
    })
    .await?;
    ensure!(
        held(cluster)? == want,
        "after the daemon's restart: {:?}, want {want:?}",
        held(cluster)?
    );

    // A namespace whose pod went while the proxy was down (kept, never deleted): the
    // proxy deletes it once it knows the runtime's sandboxes again, and keeps the
    // live pod's.
    let stale = "ffffffffffffffffffffffffffffffff_000000000000";
    let kept_dir = cluster
        .enforcement_backends_file()
        .parent()
        .context("no enforcement dir")?
        .join("mps");
    cluster.mps_control(&["namespace", "create", stale, &format!("--server={server}")])?;
    std::fs::write(
        kept_dir.join(format!("{stale}.json")),
        json!({"name": stale, "server": server, "uuid": uuid,
               "memory_bytes": 1u64 << 30, "thread_percentage": 10})
        .to_string(),
    )?;
    cluster
        .restart(tessera_harness::cluster::Component::RuntimeProxy)
        .await?;
    eventually("the stale namespace's deletion", || {
        Ok(cluster
            .mps_control(&["namespace", "get", stale, &server, "name"])
            .is_err()
            && !kept_dir.join(format!("{stale}.json")).exists())
    })
    .await?;
    ensure!(
        held(cluster)? == want,
        "the live pod's namespace went with the stale one"
    );

    // HAMi's two GPUs with 8 GiB each in one container: MPS holds one GPU's share per
    // container, so the scheduler places it only where MPS is not (here: nowhere).
    cluster
        .create_pod(
            "admin",
            &pod(
                "mps-two",
                &[(
                    "main",
                    json!({"nvidia.com/gpu": "2", "nvidia.com/gpumem": "8192"}),
                )],
                &[],
            ),
        )
        .await?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let events = cluster.events_of("mps-two").await?;
        if let Some(event) = events.iter().find(|e| e.starts_with("FailedScheduling")) {
            ensure!(
                event.contains("shares of 2 GPUs") && event.contains("MPS"),
                "mps-two: the reason does not say MPS holds one GPU per container: {event}"
            );
            break;
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "mps-two: no FailedScheduling within 60 s: {events:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    cluster.delete_pod("mps-two").await?;

    // The pod goes: its namespace, the GPU's server and exclusivity with it.
    cluster.delete_pod("mps-share").await?;
    eventually("the namespace's deletion", || {
        Ok(cluster
            .mps_control(&["namespace", "get", &namespace, &server, "name"])
            .is_err())
    })
    .await?;
    ensure!(
        cluster
            .mps_control(&["server", "get", &server, "status"])
            .is_err(),
        "server {server} outlived its last namespace"
    );
    ensure!(
        exclusive(cluster, 0)?,
        "GPU {uuid} was not handed back to DEFAULT compute mode"
    );
    Ok(())
}

/// CPU seconds `pid` used per wall second over `window`, and the fraction of
/// 50 ms samples in which `cgroup` (a v2 directory) was frozen.
async fn cpu_and_frozen(
    pid: u32,
    cgroup: &str,
    window: std::time::Duration,
) -> anyhow::Result<(f64, f64)> {
    let cpu = || tessera_harness::fake_nvml::cpu_seconds(pid);
    let start = std::time::Instant::now();
    let before = cpu()?;
    let (mut samples, mut frozen) = (0u32, 0u32);
    while start.elapsed() < window {
        let events = std::fs::read_to_string(format!("{cgroup}/cgroup.events"))?;
        samples += 1;
        frozen += u32::from(events.lines().any(|l| l == "frozen 1"));
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let used = (cpu()? - before) / start.elapsed().as_secs_f64();
    Ok((used, f64::from(frozen) / f64::from(samples.max(1))))
}

/// A shared container's compute share holds as GPU time (`gpu-time`): its
/// process, busy on a CPU and reported by the fake NVML as using the GPU as much,
/// runs about its share of the time once on the GPU, its real cgroup frozen by
/// the kernel the rest; an exec liveness probe does not restart it; deleted, it
/// is let go (its grant file gone).
pub async fn gpu_time_holds_a_compute_share(cluster: &mut Cluster) -> anyhow::Result<()> {
    let mut spinner = pod(
        "gpu-time",
        &[("main", json!({"koordinator.sh/gpu": "25"}))],
        &[],
    );
    spinner["spec"]["containers"][0]["args"] = json!(["spin"]);
    spinner["spec"]["containers"][0]["livenessProbe"] = json!({
        "exec": {"command": ["/probe", "ok"]},
        "periodSeconds": 2, "timeoutSeconds": 2, "failureThreshold": 3,
    });
    cluster.create_pod("admin", &spinner).await?;
    let running = cluster.wait_running("gpu-time").await?;
    let spec = cluster
        .container_specs(&running)?
        .remove("main")
        .context("no spec")?;
    let backends = env_values(&spec, "TESSERA_ENFORCEMENT");
    ensure!(
        backends.iter().all(|b| b.contains("gpu-time")) && !backends.is_empty(),
        "gpu-time: TESSERA_ENFORCEMENT {backends:?} does not name gpu-time"
    );
    let id = container_id(&running, "main")?;
    let pid = cluster.container_pid(&id)?;
    let cgroup = cgroup_of(pid)?;
    let grants = cluster
        .enforcement_backends_file()
        .with_file_name("gpu-time");
    let held_files = || -> anyhow::Result<Vec<String>> {
        Ok(std::fs::read_dir(&grants)?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| !n.starts_with('.'))
            .collect())
    };
    let uid = running.metadata.uid.clone().context("no uid")?;
    let bare_id = id.trim_start_matches("containerd://");
    let mine = format!("{uid}_{bare_id}");
    ensure!(
        held_files()?.contains(&mine),
        "gpu-time: grant files {:?}, want the container's ({mine})",
        held_files()?
    );
    // Its MPS namespace (MPS is on in this cluster too), to see it gone with the pod.
    let gpus = allocated_gpus(&running)?;
    ensure!(gpus.len() == 1, "gpu-time: granted {gpus:?}");
    let server = format!("gpu_{}", gpus[0].1);
    let namespace = mount_of(&spec, "/run/nvidia-mps")
        .and_then(|(source, _)| {
            std::path::Path::new(&source)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
        })
        .context("gpu-time: no MPS namespace mounted")?;

    // Not yet on a GPU: it spins unheld.
    let (unheld, frozen) = cpu_and_frozen(pid, &cgroup, std::time::Duration::from_secs(2)).await?;
    ensure!(
        frozen == 0.0,
        "gpu-time: frozen {frozen:.2} of the time before it used a GPU"
    );
    // On every GPU (only its granted one counts for it).
    let gpus = (0..4).map(|i| format!("{i} {pid}\n")).collect::<String>();
    std::fs::write(cluster.gpu_processes_file(), gpus)?;
    let held = cpu_and_frozen(pid, &cgroup, std::time::Duration::from_secs(10)).await;
    std::fs::write(cluster.gpu_processes_file(), "")?;
    let (held, frozen) = held?;
    eprintln!(
        "gpu-time: unheld {unheld:.2} CPU; held at 25 %: {held:.2} CPU, frozen {frozen:.2} of the time"
    );
    // Its share of the 10 s, plus the 0.5 s it saved while off the GPU, plus slack:
    // whatever this machine gives it unheld (about one CPU).
    ensure!(
        held <= 0.25 + 0.05 + 0.07,
        "gpu-time: held at 25 %, the container used {held:.2} CPU against {unheld:.2} unheld"
    );
    ensure!(
        frozen >= 0.4,
        "gpu-time: frozen only {frozen:.2} of the time at 25 %"
    );
    // The proxy's metrics say so.
    let metrics = cluster.proxy_metrics().await?;
    let value = |series: &str| tessera_harness::monitoring::sample(&metrics, series);
    let freezes = value("tessera_proxy_gpu_time_freezes_total").unwrap_or(0.0);
    let frozen_seconds = value("tessera_proxy_gpu_time_frozen_seconds_total").unwrap_or(0.0);
    let held_now = value("tessera_proxy_gpu_time_held_containers").unwrap_or(0.0);
    ensure!(
        freezes >= 5.0 && frozen_seconds >= 4.0 && held_now >= 1.0,
        "gpu-time: proxy metrics freezes {freezes}, frozen seconds {frozen_seconds}, held {held_now}"
    );
    // Off the GPU again: its debt paid, it is thawed for good.
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let (_, frozen) = cpu_and_frozen(pid, &cgroup, std::time::Duration::from_secs(1)).await?;
    ensure!(
        frozen == 0.0,
        "gpu-time: still frozen {frozen:.2} after leaving the GPU"
    );

    let pods: kube::Api<Pod> = kube::Api::namespaced(cluster.client().await?, "default");
    let restarts = pods
        .get("gpu-time")
        .await?
        .status
        .and_then(|s| s.container_statuses)
        .and_then(|cs| cs.first().map(|c| c.restart_count))
        .unwrap_or(-1);
    ensure!(
        restarts == 0,
        "gpu-time: restarted {restarts} times under its exec probe"
    );
    // Deleted with no grace, the pod leaves the API before kubelet stops it:
    // its grant goes when kubelet does.
    cluster.delete_pod("gpu-time").await?;
    eventually("gpu-time: the grant file goes with the pod", || {
        Ok(!held_files()?.contains(&mine))
    })
    .await?;
    // Gone whole before the next scenario, which counts the GPU's MPS server.
    eventually("gpu-time: the pod's MPS namespace goes", || {
        Ok(cluster
            .mps_control(&["namespace", "get", &namespace, &server, "name"])
            .is_err())
    })
    .await?;
    Ok(())
}

/// Each container's GPU memory, as the node's driver counts it (here the fake
/// NVML's bytes for its process), is reported against its grant: the proxy's
/// file, the reporter's metrics and Device CR annotation, `tessera inspect`, and
/// a Warning Event on the pod when a container reaches its limit or holds memory
/// on a GPU it was not granted.
pub async fn gpu_memory_use_is_reported_against_each_grant(
    cluster: &mut Cluster,
) -> anyhow::Result<()> {
    let spec = pod(
        "gpu-memory",
        &[
            ("main", json!({"koordinator.sh/gpu": "25"})),
            ("sidecar", json!({})),
        ],
        &[],
    );
    cluster.create_pod("admin", &spec).await?;
    let running = cluster.wait_running("gpu-memory").await?;
    let gpus = allocated_gpus(&running)?;
    ensure!(gpus.len() == 1, "gpu-memory: granted {gpus:?}");
    let (uuid, minor) = gpus[0].clone();
    let main = cluster.container_pid(&container_id(&running, "main")?)?;
    let sidecar = cluster.container_pid(&container_id(&running, "sidecar")?)?;
    let report = cluster
        .enforcement_backends_file()
        .with_file_name("gpu-memory.json");
    // Its entries (tessera_api::usage's form), none while it is missing.
    let read = || -> anyhow::Result<Option<Vec<Value>>> {
        match std::fs::read_to_string(&report) {
            Ok(text) => {
                let value: Value = serde_json::from_str(&text)?;
                Ok(Some(
                    value["containers"].as_array().cloned().unwrap_or_default(),
                ))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e.into()),
        }
    };
    let limit_of = || -> anyhow::Result<Option<u64>> {
        Ok(read()?.and_then(|r| {
            r.iter()
                .find(|c| c["pod"] == "gpu-memory" && c["container"] == "main")
                .and_then(|c| c["grant"]["share"].as_u64())
        }))
    };
    // On its GPU with 1 GiB: the proxy names it, with its grant.
    std::fs::write(
        cluster.gpu_processes_file(),
        format!("{minor} {main} {}\n", 1u64 << 30),
    )?;
    eventually("gpu-memory: the proxy reports the container's use", || {
        Ok(limit_of()?.is_some())
    })
    .await?;
    let limit = limit_of()?.context("no limit")?;
    // A quarter of the fake GPU's 80 GiB.
    ensure!(
        limit == 20 << 30,
        "gpu-memory: the report's limit is {limit} bytes, want 20 GiB"
    );
    // At 97 % of its limit, and the sidecar on a GPU it was not granted.
    let used = limit / 100 * 97;
    std::fs::write(
        cluster.gpu_processes_file(),
        format!(
            "{minor} {main} {used}\n{minor} {sidecar} {}\n",
            512u64 << 20
        ),
    )?;
    let result = async {
        eventually("gpu-memory: the proxy reports both", || {
            Ok(read()?.is_some_and(|r| {
                r.iter().any(|c| {
                    c["container"] == "sidecar" && c["grant"] == "none" && c["gpu"] == uuid.as_str()
                }) && r
                    .iter()
                    .any(|c| c["container"] == "main" && c["used"] == used)
            }))
        })
        .await?;
        // Told on the pod.
        let events = cluster
            .wait_events_in(
                "default",
                "gpu-memory",
                &["GpuMemoryAtLimit", "GpuUsedWithoutGrant"],
                std::time::Duration::from_secs(30),
            )
            .await?;
        ensure!(
            events.iter().any(|e| e.contains("container main uses 19.4 GiB of its 20.0 GiB limit")),
            "gpu-memory: the limit Event does not say the use and the limit: {events:?}"
        );
        ensure!(
            events
                .iter()
                .any(|e| e.contains(&format!("container sidecar holds 0.5 GiB on GPU {uuid}, which it was not granted"))),
            "gpu-memory: the ungranted Event does not name the container and GPU: {events:?}"
        );
        // The reporter's metrics.
        let (_, metrics) = tessera_harness::monitoring::scrape(&cluster.reporter_metrics_addr()).await?;
        let labels = |container: &str| {
            format!("{{namespace=\"default\",pod=\"gpu-memory\",container=\"{container}\",gpu=\"{uuid}\"}}")
        };
        for series in [
            format!("tessera_reporter_container_gpu_memory_used_bytes{}", labels("main")),
            format!("tessera_reporter_container_gpu_memory_limit_bytes{}", labels("main")),
            format!("tessera_reporter_container_gpu_ungranted{}", labels("sidecar")),
        ] {
            ensure!(
                tessera_harness::monitoring::sample(&metrics, &series).is_some(),
                "gpu-memory: the reporter exports no {series}"
            );
        }
        // tessera inspect, from the Device CR.
        let inspect = std::process::Command::new(tessera_harness::cluster::tessera_binary("tessera")?)
            .arg("--kubeconfig")
            .arg(cluster.kubeconfig())
            .arg("inspect")
            .output()?;
        let table = String::from_utf8_lossy(&inspect.stdout);
        ensure!(
            inspect.status.success()
                && table.contains("using 19.5 GiB")
                && table.contains("default/gpu-memory container sidecar NOT GRANTED this GPU, using 0.5 GiB"),
            "gpu-memory: tessera inspect does not show the use:\n{table}{}",
            String::from_utf8_lossy(&inspect.stderr)
        );
        // The pod's own GPUs alone (`--pod`), and a pod with none said so.
        let only = |pod: &str| {
            std::process::Command::new(tessera_harness::cluster::tessera_binary("tessera")?)
                .arg("--kubeconfig")
                .arg(cluster.kubeconfig())
                .args(["inspect", "--pod", pod])
                .output()
                .map_err(anyhow::Error::from)
        };
        let mine = only("default/gpu-memory")?;
        let table = String::from_utf8_lossy(&mine.stdout);
        ensure!(
            mine.status.success()
                && table.contains(&uuid)
                && table.contains("default/gpu-memory (25%")
                && table.lines().filter(|l| l.contains("GPU-")).count() == 1,
            "gpu-memory: tessera inspect --pod shows other GPUs or not the pod's:\n{table}"
        );
        let none = only("default/no-such-pod")?;
        ensure!(
            !none.status.success()
                && String::from_utf8_lossy(&none.stderr).contains("pod default/no-such-pod holds no GPU"),
            "gpu-memory: tessera inspect --pod of a pod with no GPU: {none:?}"
        );
        // Past its grant and the node's 1 GiB margin (--oom-kill-margin's
        // default): the OOM kill kills its process, the container's own, so
        // kubelet starts it again; the pod is told, and the metric counts it.
        ensure!(
            !cluster
                .log(tessera_harness::cluster::Component::RuntimeProxy)
                .contains("largest processes on that GPU killed"),
            "gpu-memory: the OOM kill acted within the grant"
        );
        let over = limit + (2u64 << 30);
        std::fs::write(cluster.gpu_processes_file(), format!("{minor} {main} {over}\n"))?;
        let killed = cluster
            .wait_events_in(
                "default",
                "gpu-memory",
                &["GpuMemoryOomKilled"],
                std::time::Duration::from_secs(30),
            )
            .await?;
        let told = format!(
            "container main held 22.0 GiB on GPU {uuid}, past its 20.0 GiB grant and the node's 1.0 GiB margin: its process {main} was killed (oom-kill)"
        );
        ensure!(
            killed.iter().any(|e| e.contains(&told)),
            "gpu-memory: the OOM kill's Event does not say what was killed: {killed:?}"
        );
        let restarted = cluster
            .wait_pod(
                "gpu-memory",
                std::time::Duration::from_secs(60),
                "main restarted after its OOM kill",
                |pod| {
                    pod.status
                        .as_ref()
                        .and_then(|s| s.container_statuses.as_ref())
                        .is_some_and(|all| {
                            all.iter().any(|c| c.name == "main" && c.restart_count >= 1)
                        })
                },
            )
            .await?;
        let again = cluster.container_pid(&container_id(&restarted, "main")?)?;
        ensure!(again != main, "gpu-memory: main's process was not replaced");
        // The sidecar, with no grant to hold, was left alone.
        ensure!(
            std::path::Path::new(&format!("/proc/{sidecar}")).exists(),
            "gpu-memory: the sidecar's process went too"
        );
        let (_, metrics) = tessera_harness::monitoring::scrape(&cluster.reporter_metrics_addr()).await?;
        let kills = format!(
            "tessera_reporter_container_gpu_memory_oom_kills{}",
            labels("main")
        );
        ensure!(
            tessera_harness::monitoring::sample(&metrics, &kills).is_some_and(|v| v >= 1.0),
            "gpu-memory: the reporter does not count the OOM kill ({kills})"
        );
        Ok(())
    }
    .await;
    std::fs::write(cluster.gpu_processes_file(), "")?;
    result?;
    cluster.delete_pod("gpu-memory").await?;
    eventually("gpu-memory: the pod leaves the report", || {
        Ok(read()?.is_some_and(|r| r.iter().all(|c| c["pod"] != "gpu-memory")))
    })
    .await?;
    Ok(())
}
