//! The `tessera-reporter` binary: discover against the fake NVML, checkpoint on a
//! real kubelet file, and clear errors.

use std::path::PathBuf;
use std::process::Command;

const BINARY: &str = env!("CARGO_BIN_EXE_tessera-reporter");

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/fixtures/kubelet-checkpoint")
        .join(name)
}

#[test]
fn discover_prints_the_device_cr() {
    let dir = tempfile::tempdir().expect("tempdir");
    let library = tessera_harness::fake_nvml::install(
        dir.path(),
        &tessera_harness::fake_nvml::four_gpu_node(),
    )
    .expect("fake driver");
    let output = Command::new(BINARY)
        .args(["discover", "--node-name", "n1", "--nvml-library"])
        .arg(&library)
        .output()
        .expect("runs");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let yaml = String::from_utf8_lossy(&output.stdout);
    let device: serde_json::Value = serde_yaml::from_str(&yaml).expect("YAML");
    assert_eq!(device["apiVersion"], "scheduling.koordinator.sh/v1alpha1");
    assert_eq!(device["kind"], "Device");
    assert_eq!(device["metadata"]["name"], "n1");
    assert_eq!(device["spec"]["devices"].as_array().map(Vec::len), Some(4));
    assert_eq!(device["spec"]["devices"][3]["minor"], 3);
    assert_eq!(
        device["spec"]["devices"][3]["topology"]["busID"],
        "00000000:48:00.0"
    );
}

#[test]
fn checkpoint_prints_legacy_entries() {
    let output = Command::new(BINARY)
        .args(["checkpoint", "--file"])
        .arg(fixture("two-gpus-numa1.json"))
        .output()
        .expect("runs");
    assert!(output.status.success());
    let entries: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON");
    assert_eq!(
        entries,
        serde_json::json!([{"podUID":"de6df8b8-a6b7-41cc-97a6-19d0fbd44714","containerName":"app","resourceName":"nvidia.com/gpu",
            "deviceIDs":["GPU-9b341c59-f96b-ba85-c137-78c3652fea65","GPU-c1e9f249-b37b-81c2-a8d9-ba5ca0294841"]}])
    );
}

#[test]
fn errors_are_clear() {
    let output = Command::new(BINARY)
        .args([
            "discover",
            "--nvml-library",
            "/nonexistent/libnvidia-ml.so.1",
        ])
        .output()
        .expect("runs");
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("NVML library /nonexistent/libnvidia-ml.so.1 could not be loaded; is the NVIDIA driver installed?"), "{stderr}");

    let dir = tempfile::tempdir().expect("tempdir");
    let truncated = dir.path().join("checkpoint");
    std::fs::write(
        &truncated,
        &std::fs::read(fixture("one-gpu-numa0.json")).expect("fixture")[..100],
    )
    .expect("write");
    let output = Command::new(BINARY)
        .args(["checkpoint", "--file"])
        .arg(&truncated)
        .output()
        .expect("runs");
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("not a kubelet device checkpoint"),
        "{stderr}"
    );
}

/// `--flag`'s `[default: …]` in `--help`: in its text, before the next option.
fn help_default(help: &str, flag: &str) -> Option<String> {
    let text = &help[help.find(&format!("{flag} "))?..];
    let own = text[flag.len()..]
        .find("\n  -")
        .map_or(text, |end| &text[..flag.len() + end]);
    Some(
        own.split_once("[default: ")?
            .1
            .split_once(']')?
            .0
            .to_owned(),
    )
}

/// docs/compat.md: `--nvidia-gpu-split` is 1 by default on tessera-reporter (the
/// chart sets HAMi's 10), and its `--gpushare-memory-unit` is GiB, as the scheduler's.
#[test]
fn run_defaults_to_one_slot_per_gpu_and_gpushare_in_gib() {
    let output = Command::new(BINARY)
        .args(["run", "--help"])
        .output()
        .expect("runs");
    assert!(output.status.success(), "{output:?}");
    let help = String::from_utf8_lossy(&output.stdout);
    assert_eq!(
        help_default(&help, "--nvidia-gpu-split").as_deref(),
        Some("1"),
        "{help}"
    );
    assert_eq!(
        help_default(&help, "--gpushare-memory-unit").as_deref(),
        Some("GiB"),
        "{help}"
    );
}
