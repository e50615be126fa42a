//! The `tessera-runtime-proxy` binary itself: flags, systemd socket activation,
//! SIGTERM draining, and the unit files shipped in systemd/.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use tessera_harness::containerd::Containerd;
use tessera_harness::kubelet::KubeletDriver;

const BINARY: &str = env!("CARGO_BIN_EXE_tessera-runtime-proxy");
/// A fixed loopback port for the metrics endpoint of the socket-activation test.
const METRICS: &str = "127.0.0.1:39464";

#[test]
fn help_explains_every_flag() {
    let output = std::process::Command::new(BINARY)
        .arg("--help")
        .output()
        .expect("runs");
    assert!(output.status.success());
    let help = String::from_utf8_lossy(&output.stdout);
    for flag in [
        "--listen",
        "--runtime-endpoint",
        "--image-endpoint",
        "--metrics-addr",
        "--log-format",
        "--drain-timeout",
        "--config",
        "--max-message-bytes",
        "--hooks-dir",
        "--no-gpu-hook",
        "--gpu-mode",
        "--device-root",
        "--driver-gpus",
        "--no-limiter-env",
        "--keep-unallocated",
        "--nvml-library",
    ] {
        assert!(help.contains(flag), "--help lacks {flag}:\n{help}");
    }
    assert!(
        help.contains("/run/tessera/runtime-proxy.sock"),
        "default socket not documented"
    );
    assert!(
        help.contains("socket activation"),
        "socket activation not documented"
    );
}

#[test]
fn bad_setting_exits_2_naming_it() {
    let output = std::process::Command::new(BINARY)
        .args(["--runtime-endpoint", "tcp://10.0.0.1:1"])
        .output()
        .expect("runs");
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("setting runtime-endpoint"), "{stderr}");
}

async fn wait_for(path: &Path) {
    let started = Instant::now();
    while !path.exists() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{} never appeared",
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn socket_activation_and_sigterm_drain() {
    let containerd = Containerd::start().await.expect("containerd");
    let dir = tempfile::Builder::new()
        .prefix("tbin-")
        .tempdir_in("/tmp")
        .expect("tempdir");
    let activated = dir.path().join("activated.sock");
    let unused = dir.path().join("never-bound.sock");
    // systemd-socket-activate binds the socket and passes it as fd 3 with LISTEN_FDS=1.
    let mut child = tokio::process::Command::new("systemd-socket-activate")
        .arg("-l")
        .arg(&activated)
        .arg(BINARY)
        .arg("--listen")
        .arg(&unused)
        .arg("--runtime-endpoint")
        .arg(containerd.socket())
        .args(["--metrics-addr", METRICS])
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("systemd-socket-activate (Debian's systemd package)");
    wait_for(&activated).await;
    let mut kubelet = KubeletDriver::connect(&activated)
        .await
        .expect("connect to activated socket");
    let version = kubelet
        .version()
        .await
        .expect("Version through the activated proxy");
    assert_eq!(version.runtime_name, "containerd");
    assert!(
        !unused.exists(),
        "the proxy bound --listen although systemd passed a socket"
    );

    // The Prometheus endpoint counts that call.
    let mut stream = tokio::net::TcpStream::connect(METRICS)
        .await
        .expect("metrics endpoint");
    tokio::io::AsyncWriteExt::write_all(
        &mut stream,
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await
    .expect("send");
    let mut text = String::new();
    tokio::io::AsyncReadExt::read_to_string(&mut stream, &mut text)
        .await
        .expect("read");
    assert!(
        text.contains("tessera_proxy_requests_total{method=\"Version\",code=\"Ok\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("tessera_proxy_backend_connects_total"),
        "{text}"
    );

    let pid =
        nix::unistd::Pid::from_raw(i32::try_from(child.id().expect("pid")).expect("pid fits"));
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
    let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .expect("exits after SIGTERM")
        .expect("status");
    assert!(
        status.success(),
        "SIGTERM should drain and exit 0, got {status}"
    );
}

#[test]
fn systemd_units_order_the_proxy_between_containerd_and_kubelet() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../systemd");
    let service =
        std::fs::read_to_string(root.join("tessera-runtime-proxy.service")).expect("service unit");
    for line in [
        "After=containerd.service tessera-runtime-proxy.socket",
        "Before=kubelet.service",
        "Restart=always",
        "Requires=tessera-runtime-proxy.socket",
    ] {
        assert!(service.lines().any(|l| l == line), "service lacks {line}");
    }
    let socket =
        std::fs::read_to_string(root.join("tessera-runtime-proxy.socket")).expect("socket unit");
    assert!(
        socket
            .lines()
            .any(|l| l == "ListenStream=/run/tessera/runtime-proxy.sock")
    );
    assert!(socket.lines().any(|l| l == "SocketMode=0660"));
    let dropin =
        std::fs::read_to_string(root.join("kubelet.service.d/20-tessera-runtime-proxy.conf"))
            .expect("drop-in");
    assert!(dropin.contains("--container-runtime-endpoint=unix:///run/tessera/runtime-proxy.sock"));
    assert!(dropin.contains("--image-service-endpoint=unix:///run/tessera/runtime-proxy.sock"));
}

#[tokio::test]
async fn shipped_hook_registration_loads() {
    let dir = tempfile::tempdir().expect("tempdir");
    let shipped =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../systemd/hooks.d/10-gpu.toml");
    std::fs::copy(&shipped, dir.path().join("10-gpu.toml")).expect("copy");
    let registry = tessera_runtime_proxy::dispatch::HookRegistry::new(dir.path());
    let hooks = registry.hooks();
    assert_eq!(hooks.len(), 1, "{} does not load", shipped.display());
    assert_eq!(hooks[0].name, "gpu");
    assert_eq!(
        hooks[0].policy,
        tessera_runtime_proxy::dispatch::FailurePolicy::Fail
    );
}

/// `--log-format json`: every line the proxy writes is a JSON object; the metrics
/// endpoint (port 0 here: the log line says which it got) answers in OpenMetrics with
/// that content type. No runtime is needed: the proxy serves while it waits for one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_and_openmetrics_endpoint() {
    use tokio::io::AsyncBufReadExt;
    let dir = tempfile::Builder::new()
        .prefix("tbin-")
        .tempdir_in("/tmp")
        .expect("tempdir");
    let mut child = tokio::process::Command::new(BINARY)
        .arg("--listen")
        .arg(dir.path().join("proxy.sock"))
        .arg("--runtime-endpoint")
        .arg(dir.path().join("no-runtime.sock"))
        .arg("--hooks-dir")
        .arg(dir.path().join("hooks.d"))
        .args(["--metrics-addr", "127.0.0.1:0", "--log-format", "json"])
        .arg("--no-gpu-hook")
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("proxy runs");
    let mut lines = tokio::io::BufReader::new(child.stderr.take().expect("stderr")).lines();
    let mut next_json = async || -> serde_json::Value {
        let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
            .await
            .expect("a log line in time")
            .expect("stderr readable")
            .expect("the proxy is still logging");
        let value: serde_json::Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(
            value["level"].is_string() && value["target"].is_string(),
            "{line}"
        );
        value
    };
    let addr: std::net::SocketAddr = loop {
        let line = next_json().await;
        if line["fields"]["message"] == "serving metrics" {
            break line["fields"]["addr"]
                .as_str()
                .expect("addr")
                .parse()
                .expect("address");
        }
    };
    let (head, body) = tessera_api::binary::metrics::scrape(addr, "/metrics")
        .await
        .expect("scrape");
    assert!(
        head.lines().any(
            |l| l == "content-type: application/openmetrics-text; version=1.0.0; charset=utf-8"
        ),
        "{head}"
    );
    assert!(body.ends_with("# EOF\n"), "{body}");

    let pid =
        nix::unistd::Pid::from_raw(i32::try_from(child.id().expect("pid")).expect("pid fits"));
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
    let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .expect("exits after SIGTERM")
        .expect("status");
    assert!(status.success(), "SIGTERM should exit 0, got {status}");
}
