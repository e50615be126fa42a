//! A slow admission webhook: a real HTTPS server, run as a child process, that
//! answers every AdmissionReview of a pod's subresource with "allowed" after
//! sleeping a random time in a range. Registered as a ValidatingWebhookConfiguration
//! on `pods/binding`, it makes the API server hold each Binding that long, as a slow
//! or overloaded webhook does. The same configuration sends it dry-run ConfigMaps
//! labelled [`PROBE_LABEL`], answered at once: one reviewed proves the API server
//! calls the webhook ([`SlowWebhook::wait_active`]).
//!
//! Its own CA (made with `openssl` here) signs its serving certificate for
//! `127.0.0.1`; the configuration carries that CA as `caBundle`, so the API server
//! trusts it without knowing the cluster's PKI. The server is Python's standard
//! library (`http.server` and `ssl`): no crate of its own to build or link.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::PostParams;
use serde_json::{Value, json};

/// The label of the dry-run ConfigMaps that [`SlowWebhook::wait_active`] creates:
/// the only ConfigMaps the configuration sends to the webhook.
pub const PROBE_LABEL: &str = "tessera-harness/webhook-probe";

/// How long the API server waits for a review: the most a webhook may take, so that
/// a Binding held up to the delay (9 s at most in the scenarios) never runs out of
/// it. A review that did would fail its Binding, and the retry would be a second
/// Binding the scenario did not cause.
const TIMEOUT_SECONDS: u32 = 30;

/// The server: one thread per request, so the API server's parallel reviews each wait
/// their own delay (a pod's subresource; anything else, the probe, is answered at
/// once). Each review is logged as one line `review <resource>/<subresource>
/// <namespace>/<name>` before the sleep.
const SERVER: &str = r#"
import http.server, json, random, ssl, sys, time
port, low, high, cert, key = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        review = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        request = review["request"]
        print("review %s/%s %s/%s" % (request["resource"]["resource"], request.get("subResource", ""),
              request.get("namespace", ""), request.get("name", "")), flush=True)
        if request["resource"]["resource"] == "pods":
            time.sleep(random.uniform(low, high))
        body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                           "response": {"uid": request["uid"], "allowed": True}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
server.daemon_threads = True
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(cert, key)
server.socket = context.wrap_socket(server.socket, server_side=True)
print("serving", flush=True)
server.serve_forever()
"#;

/// A running slow webhook server. Dropping it kills the server; the caller removes
/// the configuration that points at it (see [`SlowWebhook::configuration`]).
#[derive(Debug)]
pub struct SlowWebhook {
    child: Child,
    port: u16,
    ca: String,
    log: PathBuf,
}

impl SlowWebhook {
    /// Makes a CA and a serving certificate under `dir` and starts the server on
    /// `127.0.0.1:port`, answering after `delay` (a random time in that range).
    pub fn start(dir: &Path, port: u16, delay: std::ops::Range<Duration>) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let file = |name: &str| dir.join(name);
        openssl(
            &[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/CN=tessera-harness-webhook-ca",
                "-keyout",
            ],
            &[file("ca.key")],
            &["-out"],
            &[file("ca.crt")],
        )?;
        openssl(
            &[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-subj",
                "/CN=127.0.0.1",
                "-keyout",
            ],
            &[file("server.key")],
            &["-out"],
            &[file("server.csr")],
        )?;
        std::fs::write(file("san.ext"), "subjectAltName=IP:127.0.0.1\n")?;
        let status = Command::new("openssl")
            .args(["x509", "-req", "-days", "1", "-set_serial", "1", "-in"])
            .arg(file("server.csr"))
            .arg("-CA")
            .arg(file("ca.crt"))
            .arg("-CAkey")
            .arg(file("ca.key"))
            .arg("-extfile")
            .arg(file("san.ext"))
            .arg("-out")
            .arg(file("server.crt"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .context("running openssl x509")?;
        if !status.success() {
            bail!("openssl x509 -req failed with {status}");
        }
        let log = file("webhook.log");
        let out = std::fs::File::create(&log)?;
        let child = Command::new("python3")
            .arg("-c")
            .arg(SERVER)
            .arg(port.to_string())
            .arg(delay.start.as_secs_f64().to_string())
            .arg(delay.end.as_secs_f64().to_string())
            .arg(file("server.crt"))
            .arg(file("server.key"))
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .context("spawning python3 for the webhook server")?;
        let ca = std::fs::read_to_string(file("ca.crt"))?;
        let mut webhook = Self {
            child,
            port,
            ca,
            log,
        };
        let started = Instant::now();
        while !webhook.log_text().contains("serving") {
            if let Ok(Some(status)) = webhook.child.try_wait() {
                bail!(
                    "the webhook server exited with {status}: {}",
                    webhook.log_text()
                );
            }
            if started.elapsed() > Duration::from_secs(20) {
                bail!(
                    "the webhook server did not start in 20 s: {}",
                    webhook.log_text()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(webhook)
    }

    /// A ValidatingWebhookConfiguration `name` sending every `pods/binding` CREATE
    /// to this server, failing the Binding if the server does not answer in
    /// [`TIMEOUT_SECONDS`]; and the probe's ConfigMaps (labelled [`PROBE_LABEL`],
    /// ignored if the server is gone). One object: the API server takes both
    /// webhooks in the same update, so a reviewed probe proves the Bindings' one is
    /// in force too.
    pub fn configuration(&self, name: &str) -> Value {
        let client = json!({
            "url": format!("https://127.0.0.1:{}/validate", self.port),
            "caBundle": k8s_openapi::ByteString(self.ca.as_bytes().to_vec()),
        });
        json!({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": name},
            "webhooks": [{
                "name": "slow-binding.tessera-harness.local",
                "clientConfig": client,
                "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                           "resources": ["pods/binding"], "scope": "Namespaced"}],
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": TIMEOUT_SECONDS,
            }, {
                "name": "probe.tessera-harness.local",
                "clientConfig": client,
                "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                           "resources": ["configmaps"], "scope": "Namespaced"}],
                "objectSelector": {"matchLabels": {PROBE_LABEL: "true"}},
                "failurePolicy": "Ignore",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": 5,
            }],
        })
    }

    /// Waits until the API server calls this webhook: creates dry-run ConfigMaps
    /// labelled [`PROBE_LABEL`] in `namespace` (nothing is stored) until the
    /// server's log shows one reviewed. A blind wait after registering the
    /// configuration would let a Binding slip past a webhook not yet in force.
    pub async fn wait_active(
        &self,
        client: kube::Client,
        namespace: &str,
        timeout: Duration,
    ) -> anyhow::Result<()> {
        let configmaps: Api<ConfigMap> = Api::namespaced(client, namespace);
        let params = PostParams {
            dry_run: true,
            ..PostParams::default()
        };
        let started = Instant::now();
        let mut attempt = 0_u32;
        loop {
            attempt += 1;
            let name = format!("webhook-probe-{attempt}");
            let probe: ConfigMap = serde_json::from_value(json!({
                "metadata": {"name": name, "labels": {PROBE_LABEL: "true"}},
            }))?;
            configmaps
                .create(&params, &probe)
                .await
                .with_context(|| format!("creating the dry-run ConfigMap {namespace}/{name}"))?;
            let reviewed = format!("review configmaps/ {namespace}/{name}");
            if self.log_text().lines().any(|line| line == reviewed) {
                return Ok(());
            }
            if started.elapsed() > timeout {
                let log = self.log_text();
                let tail: Vec<&str> = log.lines().rev().take(5).collect();
                bail!(
                    "the API server did not call the webhook within {timeout:?} of its registration ({attempt} probes); its log ends: {}",
                    tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The names (`namespace/name`) of the pods whose Binding the server reviewed,
    /// once per review.
    pub fn reviewed_bindings(&self) -> Vec<String> {
        self.log_text()
            .lines()
            .filter_map(|line| line.strip_prefix("review pods/binding "))
            .map(str::to_owned)
            .collect()
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for SlowWebhook {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn openssl(
    args: &[&str],
    key: &[PathBuf],
    out_flag: &[&str],
    out: &[PathBuf],
) -> anyhow::Result<()> {
    let status = Command::new("openssl")
        .args(args)
        .args(key)
        .args(out_flag)
        .args(out)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .context("running openssl")?;
    if !status.success() {
        bail!("openssl {args:?} failed with {status}");
    }
    Ok(())
}
