//! The NVML calls against the fake NVML library (integration/fake-nvml): a
//! driver before r615 is told apart, and a limit set is the one recorded and
//! read back.

use std::path::Path;

use serde_json::Value;
use tessera_enforce::nvml::NvmlMemoryLimits;
use tessera_enforce::{LimitError, MemoryLimit, MemoryLimiter, apply_memory_limits};
use tessera_harness::fake_nvml;

const GPU0: &str = "GPU-fa4e0000-0000-4000-8000-000000000000";

fn node(supported: bool, log: &Path) -> Value {
    let mut node = fake_nvml::four_gpu_node();
    node["memoryLimits"] = Value::Bool(supported);
    node["memoryLimitsLog"] = Value::String(log.display().to_string());
    node
}

#[test]
fn a_driver_before_r615_is_unsupported() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let library = fake_nvml::install(dir.path(), &node(false, &dir.path().join("log")))?;
    match NvmlMemoryLimits::open(&library) {
        Err(LimitError::Unsupported(reason)) => {
            assert!(reason.contains("FUNCTION_NOT_FOUND"), "{reason}");
        }
        other => panic!("expected unsupported, got {other:?}"),
    }
    Ok(())
}

#[test]
fn a_library_that_does_not_load_is_unsupported() {
    let result = NvmlMemoryLimits::open(Path::new("/nonexistent/libnvidia-ml.so.1"));
    assert!(
        matches!(result, Err(LimitError::Unsupported(_))),
        "{result:?}"
    );
}

#[test]
fn limits_are_set_on_the_cgroup_and_read_back() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let log = dir.path().join("limits.jsonl");
    let library = fake_nvml::install(&dir.path().join("nvml"), &node(true, &log))?;
    let limits = NvmlMemoryLimits::open(&library)?;
    let cgroup = dir.path().join("cgroup").join("ctr");
    std::fs::create_dir_all(&cgroup)?;

    apply_memory_limits(
        &limits,
        &cgroup,
        &[MemoryLimit {
            uuid: GPU0.into(),
            bytes: 20 << 30,
        }],
    )?;
    let held = limits.get(GPU0, &cgroup)?;
    assert_eq!((held.soft, held.hard), (20 << 30, 20 << 30));

    let lines: Vec<Value> = std::fs::read_to_string(&log)?
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["uuid"], GPU0);
    assert_eq!(lines[0]["nameSpace"], cgroup.display().to_string());
    assert_eq!(lines[0]["hardLimit"], 20u64 << 30);
    assert_eq!(lines[0]["pid"], std::process::id());

    // A cgroup that does not exist is refused by the driver (as the fake emulates).
    let gone = dir.path().join("cgroup").join("gone");
    let error = limits.set(GPU0, &gone, 1 << 30);
    assert!(
        matches!(&error, Err(LimitError::Call { reason, .. }) if reason.contains("INVALID_ARGUMENT")),
        "{error:?}"
    );
    // An unknown GPU names itself.
    let error = limits.set("GPU-00000000-0000-0000-0000-000000000000", &cgroup, 1 << 30);
    assert!(matches!(error, Err(LimitError::Gpu { .. })), "{error:?}");
    Ok(())
}

#[test]
fn compute_modes_are_set_read_back_and_seen_by_every_process() -> anyhow::Result<()> {
    use tessera_enforce::compute::NvmlComputeMode;
    use tessera_enforce::mps::{ComputeMode, GpuMode};
    let dir = tempfile::tempdir()?;
    let log = dir.path().join("compute-mode.jsonl");
    let mut description = node(true, &dir.path().join("limits.jsonl"));
    description["computeModeLog"] = Value::String(log.display().to_string());
    let library = fake_nvml::install(&dir.path().join("nvml"), &description)?;
    let modes = NvmlComputeMode::open(&library)?;
    assert_eq!(modes.mode(GPU0)?, GpuMode::Default);
    modes.set(GPU0, GpuMode::ExclusiveProcess)?;
    assert_eq!(modes.mode(GPU0)?, GpuMode::ExclusiveProcess);
    // The node's mode, as another process (the runtime proxy) reads it: the log.
    let line: Value = serde_json::from_str(
        std::fs::read_to_string(&log)?
            .lines()
            .last()
            .unwrap_or_default(),
    )?;
    assert_eq!(
        (line["uuid"].as_str(), line["mode"].as_u64()),
        (Some(GPU0), Some(3))
    );
    modes.set(GPU0, GpuMode::Prohibited)?;
    assert_eq!(modes.mode(GPU0)?, GpuMode::Prohibited);
    modes.set(GPU0, GpuMode::Default)?;
    assert_eq!(modes.mode(GPU0)?, GpuMode::Default);
    assert!(modes.mode("GPU-nope").is_err());
    Ok(())
}
