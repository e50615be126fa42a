//! The fake `libnvidia-ml.so` (integration/fake-nvml): where it is built, and
//! JSON descriptions of fake GPU nodes for it.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

/// The CPU seconds process `pid` has used: the figure the fake NVML reports as its
/// GPU use (`processUtilization`), read the same way.
pub fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    tessera_fake_nvml::cpu_ticks(pid)
        .map(|ticks| ticks as f64 / 100.0)
        .ok_or_else(|| anyhow::anyhow!("/proc/{pid}/stat cannot be read"))
}

/// The fake library built beside the running test or binary (cargo builds it as
/// a dependency of this crate, in the same target directory).
pub fn library() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let name = "libtessera_fake_nvml.so";
    exe.ancestors()
        .skip(1)
        .take(3)
        // deps/ first: cargo updates it whenever the crate builds, as a dependency or not.
        .flat_map(|dir| [dir.join("deps").join(name), dir.join(name)])
        .find(|candidate| candidate.exists())
        .ok_or_else(|| {
            anyhow::anyhow!(
                "{name} not found near {}: build with cargo build -p tessera-fake-nvml",
                exe.display()
            )
        })
}

/// A 4-GPU node: GPUs 0-1 and 2-3 share a PCIe switch and an NVLink, NUMA 0 and 1.
pub fn four_gpu_node() -> Value {
    let gpu = |i: u32, peer: u32| {
        json!({
            "uuid": format!("GPU-fa4e0000-0000-4000-8000-00000000000{i}"),
            "minor": i,
            "name": "NVIDIA H100 80GB HBM3",
            "memoryBytes": 85_899_345_920u64,
            "busId": format!("00000000:{:02X}:00.0", 0x18 + i * 0x10),
            "numaNode": i / 2,
            "pcieSwitch": format!("sw{}", i / 2),
            "nvlinks": [{"link": 0, "peerBusId": format!("00000000:{:02X}:00.0", 0x18 + peer * 0x10)}],
        })
    };
    json!({"driverVersion": "550.54.15", "cudaDriverVersion": 12040, "gpus": [gpu(0, 1), gpu(1, 0), gpu(2, 3), gpu(3, 2)], "xidEvents": []})
}

/// Installs a fake driver for `node` in `dir`: a copy of the library as
/// `libnvidia-ml.so.1` (its own instance when loaded) and `fake-nvml.json` beside
/// it. Returns the library path to give nvml-wrapper; for NVIDIA's
/// k8s-device-plugin, put `dir` on its `LD_LIBRARY_PATH` instead.
pub fn install(dir: &Path, node: &Value) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let library_copy = dir.join("libnvidia-ml.so.1");
    std::fs::copy(library()?, &library_copy)?;
    std::fs::write(dir.join("fake-nvml.json"), serde_json::to_vec_pretty(node)?)?;
    Ok(library_copy)
}

/// The NVLinks of a node of `gpus` GPUs unless told otherwise: each PCIe switch
/// pair (0-1, 2-3, …) also joined by an NVLink.
pub fn pair_nvlinks(gpus: u32) -> Vec<[u32; 2]> {
    (0..gpus / 2).map(|pair| [2 * pair, 2 * pair + 1]).collect()
}

/// A fake NVML description matching a [`crate::gpu_node::FakeGpuNode`]: the same
/// UUIDs and minors, 80 GiB each, GPU pairs (0-1, 2-3, …) on a PCIe switch and a
/// NUMA node, joined by the NVLinks [`pair_nvlinks`] lists.
pub fn describe(node: &crate::gpu_node::FakeGpuNode) -> Value {
    let count = u32::try_from(node.gpus.len()).unwrap_or(u32::MAX);
    describe_with_nvlinks(node, &pair_nvlinks(count))
}

/// [`describe`], with the NVLinks `links` (pairs of minors) instead: each link is
/// active on both GPUs, as NVML reports it from either side. Links naming a minor
/// the node lacks are left out.
pub fn describe_with_nvlinks(node: &crate::gpu_node::FakeGpuNode, links: &[[u32; 2]]) -> Value {
    let bus = |minor: u32| {
        node.gpus
            .iter()
            .find(|g| g.minor == minor)
            .map(|g| format!("0000{}", g.bus_id))
    };
    let gpus: Vec<Value> = node
        .gpus
        .iter()
        .map(|gpu| {
            let peers = links.iter().filter_map(|[a, b]| {
                if *a == gpu.minor {
                    bus(*b)
                } else if *b == gpu.minor {
                    bus(*a)
                } else {
                    None
                }
            });
            // One NVML link number per peer, as a GPU's links are numbered.
            let nvlinks: Vec<Value> = peers
                .enumerate()
                .map(|(link, peer)| json!({"link": link, "peerBusId": peer}))
                .collect();
            json!({
                "uuid": gpu.uuid, "minor": gpu.minor, "name": "NVIDIA H100 80GB HBM3",
                "memoryBytes": 85_899_345_920u64, "busId": bus(gpu.minor),
                "numaNode": gpu.minor / 2, "pcieSwitch": format!("sw{}", gpu.minor / 2),
                "nvlinks": nvlinks,
            })
        })
        .collect();
    json!({"driverVersion": "550.54.15", "cudaDriverVersion": 12040, "gpus": gpus, "xidEvents": []})
}

/// `description` (from [`describe`], [`describe_with_nvlinks`] or
/// [`four_gpu_node`]) with NVML r615's per-cgroup memory limit calls
/// (`nvmlDeviceSetMemoryLimits_v1`, `nvmlDeviceGetMemoryLimits_v1`) turned on, and
/// each set call appended to `log` as a JSON line (`uuid`, `nameSpace`,
/// `softLimit`, `hardLimit`, `pid`, `result`). Without it those calls answer
/// "function not found", as on drivers before r615.
pub fn with_memory_limits(mut description: Value, log: &Path) -> Value {
    if let Some(fields) = description.as_object_mut() {
        fields.insert("memoryLimits".into(), Value::Bool(true));
        fields.insert(
            "memoryLimitsLog".into(),
            Value::String(log.to_string_lossy().into_owned()),
        );
    }
    description
}

/// `description` with every `nvmlDeviceSetComputeMode` call logged to `log`.
pub fn with_compute_mode_log(mut description: Value, log: &Path) -> Value {
    if let Some(fields) = description.as_object_mut() {
        fields.insert(
            "computeModeLog".into(),
            Value::String(log.to_string_lossy().into_owned()),
        );
    }
    description
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn with_memory_limits_sets_both_fields_and_keeps_the_rest() {
        let node = with_memory_limits(four_gpu_node(), Path::new("/tmp/limits.jsonl"));
        assert_eq!(node["memoryLimits"], json!(true));
        assert_eq!(node["memoryLimitsLog"], json!("/tmp/limits.jsonl"));
        assert_eq!(node["gpus"], four_gpu_node()["gpus"]);
        assert!(four_gpu_node().get("memoryLimits").is_none());
    }
}
