//! `tessera-reporter run` as the daemon operators start: JSON log lines, the
//! metrics endpoint, and a clean exit on SIGTERM.

use std::process::Stdio;
use std::time::Duration;

use serde_json::{Value, json};
use tessera_harness::apiserver::ApiServer;
use tokio::io::{AsyncBufReadExt, BufReader};

const BINARY: &str = env!("CARGO_BIN_EXE_tessera-reporter");

/// The next log line, which must be a JSON object.
async fn next_json(lines: &mut tokio::io::Lines<BufReader<tokio::process::ChildStderr>>) -> Value {
    let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
        .await
        .expect("a log line in time")
        .expect("stderr readable")
        .expect("the reporter is still logging");
    let value: Value =
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
    for key in ["timestamp", "level", "target", "fields"] {
        assert!(value.get(key).is_some(), "no {key:?} in {line}");
    }
    value
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_metrics_and_sigterm() {
    let dir = tempfile::tempdir().expect("tempdir");
    let library = tessera_harness::fake_nvml::install(
        &dir.path().join("driver"),
        &tessera_harness::fake_nvml::four_gpu_node(),
    )
    .expect("fake driver");
    let api = ApiServer::start().await.expect("api server");
    api.insert(
        "v1",
        "nodes",
        json!({"apiVersion":"v1","kind":"Node","metadata":{"name":"gpu-node-1"},"status":{"capacity":{"cpu":"8"}}}),
    );
    let kubeconfig = api.write_kubeconfig(dir.path()).expect("kubeconfig");

    let mut child = tokio::process::Command::new(BINARY)
        .args(["--log-format", "json", "run", "--node-name", "gpu-node-1"])
        .arg("--nvml-library")
        .arg(&library)
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .arg("--checkpoint")
        .arg(dir.path().join("no-checkpoint-here"))
        .args(["--metrics-addr", "127.0.0.1:0"])
        .env("RUST_LOG", "info")
        .env_remove("TESSERA_LOG_FORMAT")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("tessera-reporter runs");
    let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();

    // The metrics endpoint says where it is (port 0 picked one), in JSON.
    let addr = loop {
        let line = next_json(&mut lines).await;
        if line["fields"]["message"] == "serving metrics" {
            break line["fields"]["addr"]
                .as_str()
                .expect("addr field")
                .parse()
                .expect("a socket address");
        }
    };
    let mut body = String::new();
    for _ in 0..200 {
        body = tessera_daemon::metrics::scrape(addr, "/metrics")
            .await
            .expect("scrape")
            .1;
        if body.contains("tessera_reporter_publishes_total{object=\"node\",outcome=\"changed\"} 1")
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(body.contains("tessera_reporter_gpus 4\n"), "{body}");
    assert!(
        body.contains("tessera_reporter_publishes_total{object=\"device\",outcome=\"changed\"} 1"),
        "{body}"
    );

    let pid = child.id().expect("pid").to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(killed.success());
    loop {
        let line = next_json(&mut lines).await;
        if line["fields"]["message"] == "shutting down" {
            break;
        }
    }
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .expect("exits after SIGTERM")
        .expect("status");
    assert!(status.success(), "SIGTERM should exit 0, got {status}");
}

#[test]
fn bad_log_format_and_metrics_address_are_named() {
    let output = std::process::Command::new(BINARY)
        .args(["--log-format", "yaml", "crd"])
        .env_remove("TESSERA_LOG_FORMAT")
        .output()
        .expect("runs");
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("log format \"yaml\": expected text or json"),
        "{stderr}"
    );
    let output = std::process::Command::new(BINARY)
        .args(["run", "--node-name", "n", "--metrics-addr", "9465"])
        .output()
        .expect("runs");
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("metrics address \"9465\""), "{stderr}");
}
