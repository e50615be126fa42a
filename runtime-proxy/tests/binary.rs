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
    assert!(
        dropin
            .lines()
            .any(|l| l == "After=tessera-runtime-proxy.socket")
    );
    // The endpoint is never set through the environment, which /etc/default/kubelet's
    // EnvironmentFile= silently overrides.
    assert!(!dropin.contains("KUBELET_EXTRA_ARGS"), "{dropin}");
}

/// The KubeletConfiguration drop-in names the socket the socket unit listens on.
#[test]
fn kubelet_config_drop_in_points_at_the_proxy_socket() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../systemd");
    let socket =
        std::fs::read_to_string(root.join("tessera-runtime-proxy.socket")).expect("socket unit");
    let listen = socket
        .lines()
        .find_map(|l| l.strip_prefix("ListenStream="))
        .expect("ListenStream=");
    assert_eq!(listen, tessera_runtime_proxy::DEFAULT_LISTEN);
    let fragment =
        std::fs::read_to_string(root.join("kubelet.conf.d/50-tessera-runtime-proxy.conf"))
            .expect("kubelet config drop-in");
    let config: serde_json::Value = serde_yaml::from_str(&fragment).expect("YAML");
    assert_eq!(config["apiVersion"], "kubelet.config.k8s.io/v1beta1");
    assert_eq!(config["kind"], "KubeletConfiguration");
    let endpoint = format!("unix://{listen}");
    assert_eq!(config["containerRuntimeEndpoint"], endpoint.as_str());
    assert_eq!(config["imageServiceEndpoint"], endpoint.as_str());
    let fields = config.as_object().expect("a mapping").len();
    assert_eq!(fields, 4, "only the two endpoints: {config}");
}

/// `systemd-analyze verify` accepts every unit and drop-in we ship, without a warning,
/// and `systemd-analyze security` rates each service's sandbox at most 3.0 ("OK").
/// Needs Debian's systemd package (scripts/test.sh installs it); fails without it.
#[test]
fn systemd_units_verify_and_are_sandboxed() {
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("../systemd");
    let root = tempfile::tempdir().expect("tempdir");
    let units = root.path().join("etc/systemd/system");
    std::fs::create_dir_all(units.join("kubelet.service.d")).expect("mkdir");
    // verify resolves ExecStart= and the units ours name under --root.
    std::fs::create_dir_all(root.path().join("usr/lib/systemd")).expect("mkdir");
    let status = std::process::Command::new("cp")
        .arg("-a")
        .arg("/usr/lib/systemd/system")
        .arg(root.path().join("usr/lib/systemd/"))
        .status()
        .expect("cp");
    assert!(
        status.success(),
        "copying /usr/lib/systemd/system: is Debian's systemd package installed?"
    );
    let bin = root.path().join("usr/local/bin");
    std::fs::create_dir_all(&bin).expect("mkdir");
    for name in [
        "tessera-runtime-proxy",
        "tessera-reporter",
        "tessera-gpu-hook",
        "tessera-enforce",
        "kubelet",
    ] {
        std::fs::write(bin.join(name), "#!/bin/sh\n").expect("stub");
        let mut permissions = std::fs::metadata(bin.join(name))
            .expect("stat")
            .permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut permissions, 0o755);
        std::fs::set_permissions(bin.join(name), permissions).expect("chmod");
    }
    // A stand-in kubelet unit for our kubelet drop-ins to attach to.
    std::fs::write(
        units.join("kubelet.service"),
        "[Service]\nExecStart=/usr/local/bin/kubelet $KUBELET_CONFIG_ARGS\n",
    )
    .expect("kubelet unit");
    let mut paths = Vec::new();
    for entry in std::fs::read_dir(&shipped).expect("systemd/") {
        let path = entry.expect("entry").path();
        if path
            .extension()
            .is_some_and(|e| e == "service" || e == "socket")
        {
            let target = units.join(path.file_name().expect("name"));
            std::fs::copy(&path, &target).expect("copy unit");
            paths.push(target);
        }
    }
    for entry in std::fs::read_dir(shipped.join("kubelet.service.d")).expect("drop-ins") {
        let path = entry.expect("entry").path();
        std::fs::copy(
            &path,
            units
                .join("kubelet.service.d")
                .join(path.file_name().expect("name")),
        )
        .expect("copy drop-in");
    }
    paths.push(units.join("kubelet.service"));
    let output = std::process::Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(format!("--root={}", root.path().display()))
        .args(&paths)
        .output()
        .expect("systemd-analyze (Debian's systemd package)");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stderr.trim().is_empty(),
        "systemd-analyze verify: {}\n{stderr}",
        output.status
    );
    for unit in [
        "tessera-runtime-proxy.service",
        "tessera-gpu-hook.service",
        "tessera-reporter.service",
        "tessera-mps.service",
    ] {
        let output = std::process::Command::new("systemd-analyze")
            .args(["security", "--offline=true", "--threshold=30"])
            .arg(format!("--root={}", root.path().display()))
            .arg(unit)
            .output()
            .expect("systemd-analyze security");
        let report = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "{unit}: sandbox exposure above 3.0:\n{report}{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

#[tokio::test]
async fn shipped_hook_registration_loads() {
    let dir = tempfile::tempdir().expect("tempdir");
    let shipped =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../systemd/hooks.d/10-gpu.toml");
    std::fs::copy(&shipped, dir.path().join("10-gpu.toml")).expect("copy");
    let registry = tessera_runtime_proxy::HookRegistry::new(dir.path());
    let hooks = registry.hooks();
    assert_eq!(hooks.len(), 1, "{} does not load", shipped.display());
    assert_eq!(hooks[0].name, "gpu");
    assert_eq!(hooks[0].policy, tessera_runtime_proxy::FailurePolicy::Fail);
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
    let (head, body) = tessera_daemon::metrics::scrape(addr, "/metrics")
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
