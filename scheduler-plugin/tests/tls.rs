//! Who may call the extender, over real sockets: mutual TLS refuses clients without a
//! certificate from the client CA in the handshake; a verified client that is not
//! kube-scheduler may filter but not bind; kube-scheduler's identity binds, also
//! through a follower that hands the bind to the leader with its own certificate;
//! plain HTTP serves on loopback and is refused at startup on 0.0.0.0.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

mod common;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore};
use serde_json::{Value, json};
use tessera_allocator::ledger::Ledger;
use tessera_harness::apiserver::ApiServer;
use tessera_scheduler::certs::{CertificateAuthority, Pem, service_dns_names};
use tessera_scheduler::extender::{Extender, ExtenderConfig, FORWARDED_HEADER, serve};
use tessera_scheduler::leader::Leader;
use tessera_scheduler::transport::{self, BindAccess, TlsFiles};
use tokio::net::TcpListener;

const DEVICES: &str = "scheduling.koordinator.sh/v1alpha1";
const SERVER_NAME: &str = "tessera-scheduler.tessera-system.svc";

/// The CA, the replicas' certificate and three clients: kube-scheduler, a tenant
/// with a certificate from the same CA, and an impostor whose certificate says
/// tessera-kube-scheduler but comes from another CA.
struct Pki {
    dir: tempfile::TempDir,
    ca: Pem,
    kube_scheduler: Pem,
    tenant: Pem,
    impostor: Pem,
}

impl Pki {
    fn new() -> Self {
        let ca = CertificateAuthority::new("test-ca", 1).expect("ca");
        let other = CertificateAuthority::new("other-ca", 1).expect("other ca");
        let dir = tempfile::tempdir().expect("tempdir");
        let scheduler = ca
            .issue(
                "tessera-scheduler",
                &service_dns_names("tessera-scheduler", "tessera-system"),
                true,
                true,
            )
            .expect("scheduler cert");
        let pki = Self {
            kube_scheduler: ca
                .issue("tessera-kube-scheduler", &[], false, true)
                .expect("kube-scheduler cert"),
            tenant: ca
                .issue("tenant", &["tenant.example".into()], false, true)
                .expect("tenant cert"),
            impostor: other
                .issue(
                    "tessera-kube-scheduler",
                    &["tessera-kube-scheduler".into()],
                    false,
                    true,
                )
                .expect("impostor cert"),
            ca: ca.pem().clone(),
            dir,
        };
        std::fs::write(pki.path("ca.crt"), &pki.ca.cert).expect("ca.crt");
        std::fs::write(pki.path("tls.crt"), &scheduler.cert).expect("tls.crt");
        std::fs::write(pki.path("tls.key"), &scheduler.key).expect("tls.key");
        pki
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn files(&self) -> TlsFiles {
        TlsFiles {
            cert: self.path("tls.crt"),
            key: self.path("tls.key"),
            client_ca: self.path("ca.crt"),
        }
    }

    /// A client trusting the CA for the extender's certificate, presenting `cert`.
    fn client(&self, cert: Option<&Pem>) -> Client<HttpsConnector<HttpConnector>, Full<Bytes>> {
        let mut roots = RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(self.ca.cert.as_bytes()).expect("ca pem"))
            .expect("root");
        let builder =
            ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .expect("versions")
                .with_root_certificates(roots);
        let config = match cert {
            Some(pem) => builder
                .with_client_auth_cert(
                    vec![CertificateDer::from_pem_slice(pem.cert.as_bytes()).expect("cert")],
                    PrivateKeyDer::from_pem_slice(pem.key.as_bytes()).expect("key"),
                )
                .expect("client cert"),
            None => builder.with_no_client_auth(),
        };
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(config)
            .https_only()
            .with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(
                ServerName::try_from(SERVER_NAME).expect("name"),
            ))
            .enable_http1()
            .build();
        Client::builder(hyper_util::rt::TokioExecutor::new()).build(connector)
    }
}

/// A mutual-TLS extender on a loopback port, serving `extender`.
async fn serve_tls(pki: &Pki, extender: Extender) -> SocketAddr {
    let tls = transport::server_config(&pki.files()).expect("server config");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("listen");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(transport::serve_tls(
        listener,
        tls,
        extender,
        Arc::new(BindAccess::default()),
    ));
    addr
}

async fn post<C>(
    client: &Client<C, Full<Bytes>>,
    url: String,
    body: &Value,
    forwarded: bool,
) -> Result<(StatusCode, String), String>
where
    C: hyper_util::client::legacy::connect::Connect + Clone + Send + Sync + 'static,
{
    let mut request = Request::post(url).header(http::header::CONTENT_TYPE, "application/json");
    if forwarded {
        request = request.header(FORWARDED_HEADER, "1");
    }
    let request = request
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("request");
    let response = client
        .request(request)
        .await
        .map_err(|e| format!("{e:?}"))?;
    let status = response.status();
    let bytes = response
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("{e:?}"))?
        .to_bytes();
    Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
}

fn device(node: &str) -> Value {
    json!({"apiVersion": DEVICES, "kind": "Device", "metadata": {"name": node}, "spec": {"devices": [
        {"type":"gpu","id":format!("GPU-{node}-0"),"minor":0,"health":true,
         "resources":{"koordinator.sh/gpu-core":"100","koordinator.sh/gpu-memory":(16u64 << 30).to_string(),"koordinator.sh/gpu-memory-ratio":"100"}}]}})
}

fn pod(name: &str) -> Value {
    json!({"apiVersion":"v1","kind":"Pod","metadata":{"name":name,"namespace":"default","uid":format!("u-{name}")},
        "spec":{"containers":[{"name":"main","image":"x","resources":{"limits":{"koordinator.sh/gpu":"50"}}}]},
        "status":{"phase":"Pending"}})
}

fn bind_args(name: &str) -> Value {
    json!({"PodName": name, "PodNamespace": "default", "PodUID": format!("u-{name}"), "Node": "n1"})
}

fn filter_args(name: &str) -> Value {
    json!({"Pod": pod(name), "NodeNames": ["n1"]})
}

async fn cluster() -> (ApiServer, Extender) {
    let api = ApiServer::start().await.expect("api");
    api.insert(DEVICES, "devices", device("n1"));
    api.insert("v1", "pods", pod("p1"));
    api.insert("v1", "pods", pod("p2"));
    let (extender, _) = common::extender(&api, ExtenderConfig::default()).await;
    (api, extender)
}

fn node_of(api: &ApiServer, name: &str) -> Value {
    api.get("v1", "pods", "default", name).expect("pod")["spec"]["nodeName"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_without_a_certificate_is_refused_in_the_handshake() {
    let pki = Pki::new();
    let (api, extender) = cluster().await;
    let addr = serve_tls(&pki, extender).await;
    let error = post(
        &pki.client(None),
        format!("https://{addr}/bind"),
        &bind_args("p1"),
        false,
    )
    .await
    .expect_err("no client certificate: no HTTP answer");
    assert!(
        refused_in_handshake(&error, &["CertificateRequired"]),
        "{error}"
    );
    assert_eq!(api.bindings(), 0);
}

/// Whether a request failed in the TLS handshake: with the server's `alerts`, or,
/// in TLS 1.3, where the client's side of the handshake ends before the server has
/// judged its certificate, with the connection closed before any answer (which of
/// the two the client sees first is down to timing).
fn refused_in_handshake(error: &str, alerts: &[&str]) -> bool {
    alerts.iter().any(|alert| error.contains(alert))
        || error.contains("connection was not ready")
        || error.contains("connection closed before message completed")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_from_another_ca_is_refused_in_the_handshake() {
    let pki = Pki::new();
    let (api, extender) = cluster().await;
    let addr = serve_tls(&pki, extender).await;
    // It names kube-scheduler's identity; only the CA's signature counts.
    let error = post(
        &pki.client(Some(&pki.impostor)),
        format!("https://{addr}/bind"),
        &bind_args("p1"),
        false,
    )
    .await
    .expect_err("another CA: no HTTP answer");
    assert!(
        refused_in_handshake(&error, &["UnknownCA", "BadCertificate"]),
        "{error}"
    );
    assert_eq!(api.bindings(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verified_client_may_filter_but_only_kube_scheduler_binds() {
    let pki = Pki::new();
    let (api, extender) = cluster().await;
    let addr = serve_tls(&pki, extender).await;
    let tenant = pki.client(Some(&pki.tenant));

    let (status, body) = post(
        &tenant,
        format!("https://{addr}/filter"),
        &filter_args("p1"),
        false,
    )
    .await
    .expect("filter");
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        serde_json::from_str::<Value>(&body).expect("json")["NodeNames"],
        json!(["n1"])
    );

    // Marking the bind as handed over by a replica does not help a tenant.
    for forwarded in [false, true] {
        let (status, body) = post(
            &tenant,
            format!("https://{addr}/bind"),
            &bind_args("p1"),
            forwarded,
        )
        .await
        .expect("bind answered");
        assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
        assert_eq!(
            body,
            "client CN=\"tenant\" DNS=\"tenant.example\" may not bind: only tessera-kube-scheduler may (--bind-client-name)"
        );
    }
    assert_eq!(api.bindings(), 0, "a tenant's bind reached the API server");
    assert_eq!(node_of(&api, "p1"), Value::Null);

    let (status, body) = post(
        &pki.client(Some(&pki.kube_scheduler)),
        format!("https://{addr}/bind"),
        &bind_args("p1"),
        false,
    )
    .await
    .expect("bind");
    assert_eq!((status, body.as_str()), (StatusCode::OK, r#"{"Error":""}"#));
    assert_eq!(api.bindings(), 1);
    assert_eq!(node_of(&api, "p1"), "n1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_hands_kube_schedulers_bind_to_the_leader_over_mutual_tls() {
    let pki = Pki::new();
    let (api, leader) = cluster().await;
    let leader_addr = serve_tls(&pki, leader).await;
    let files = pki.files();
    let follower = Extender::new(
        Arc::new(std::sync::Mutex::new(Ledger::default())),
        None,
        None,
        ExtenderConfig::default(),
        Arc::new(AtomicBool::new(true)),
        // The leader is dialled by IP; its certificate is checked for SERVER_NAME.
        Arc::new(Leader::following(format!("https://{leader_addr}"))),
    )
    .with_peer_tls(
        transport::peer_client_config(&files, &files.client_ca).expect("peer config"),
        transport::peer_server_name(None, &files.cert).expect("peer server name"),
    );
    let follower_addr = serve_tls(&pki, follower).await;
    let (status, body) = post(
        &pki.client(Some(&pki.kube_scheduler)),
        format!("https://{follower_addr}/bind"),
        &bind_args("p2"),
        false,
    )
    .await
    .expect("bind");
    assert_eq!((status, body.as_str()), (StatusCode::OK, r#"{"Error":""}"#));
    assert_eq!(node_of(&api, "p2"), "n1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_probe_port_serves_only_health_and_readiness() {
    let (_api, extender) = cluster().await;
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("listen");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(transport::serve_probes(listener, extender));
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(hyper_util::rt::TokioExecutor::new()).build(HttpConnector::new());
    for path in ["/healthz", "/readyz"] {
        let response = client
            .request(
                Request::get(format!("http://{addr}{path}"))
                    .body(Full::default())
                    .expect("request"),
            )
            .await
            .expect("probe");
        assert_eq!(response.status(), StatusCode::OK, "{path}");
    }
    for path in ["/bind", "/filter"] {
        let (status, _) = post(
            &client,
            format!("http://{addr}{path}"),
            &bind_args("p1"),
            false,
        )
        .await
        .expect("answered");
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_http_on_loopback_serves_every_verb() {
    let (api, extender) = cluster().await;
    assert_eq!(
        transport::choose_transport(
            "127.0.0.1:18888".parse().expect("addr"),
            None,
            None,
            None,
            false
        ),
        Ok(transport::Transport::PlainLoopback)
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("listen");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(serve(listener, extender));
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(hyper_util::rt::TokioExecutor::new()).build(HttpConnector::new());
    let (status, _) = post(
        &client,
        format!("http://{addr}/filter"),
        &filter_args("p1"),
        false,
    )
    .await
    .expect("filter");
    assert_eq!(status, StatusCode::OK);
    let (status, body) = post(
        &client,
        format!("http://{addr}/bind"),
        &bind_args("p1"),
        false,
    )
    .await
    .expect("bind");
    assert_eq!((status, body.as_str()), (StatusCode::OK, r#"{"Error":""}"#));
    assert_eq!(node_of(&api, "p1"), "n1");
}

fn run_serve(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_tessera-scheduler"))
        .arg("serve")
        .args(args)
        // Never a real cluster: the refusals come before any API call.
        .env("KUBECONFIG", "/nonexistent")
        .output()
        .expect("running tessera-scheduler")
}

#[test]
fn plain_http_on_the_network_is_refused_at_startup_naming_the_risk() {
    let output = run_serve(&["--listen", "0.0.0.0:0"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains(
            "--listen 0.0.0.0:0: plain HTTP on a non-loopback address is refused: anything that can reach it could POST /bind and place any pending pod on any node with tessera-scheduler's rights"
        ),
        "{stderr}"
    );
}

#[test]
fn bad_tls_files_are_refused_at_startup_naming_the_flag() {
    let pki = Pki::new();
    let path = |p: &Path| p.display().to_string();
    let files = pki.files();
    let output = run_serve(&[
        "--listen",
        "127.0.0.1:0",
        "--tls-cert-file",
        &path(&files.cert),
        "--tls-key-file",
        &path(&files.cert),
        "--client-ca-file",
        &path(&files.client_ca),
    ]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "--tls-key-file {}: no PRIVATE KEY in it",
            files.cert.display()
        )),
        "{stderr}"
    );
}

/// A client that connects and sends nothing is dropped once the header timeout
/// passes, so idle connections cannot exhaust the extender's file descriptors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_is_closed_after_the_header_timeout() {
    use tokio::io::AsyncReadExt;
    let (_api, extender) = cluster().await;
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("listen");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(serve(listener, extender));
    let mut idle = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let mut buffer = [0u8; 256];
    let read = tokio::time::timeout(std::time::Duration::from_secs(10), idle.read(&mut buffer))
        .await
        .expect("the server closes an idle connection within 10 s");
    // Closed (0 bytes) or answered 408 and closed: either way the slot is free.
    let read = read.unwrap_or(0);
    let text = String::from_utf8_lossy(&buffer[..read]);
    assert!(read == 0 || text.starts_with("HTTP/1.1 408"), "{text}");
}

/// A flood of idle connections (never a TLS handshake) and an oversized body do
/// not stop kube-scheduler's calls: the server holds at most
/// `transport::MAX_CONNECTIONS` of them (the rest wait in the kernel's backlog,
/// holding no descriptor of ours), drops each idle one after 1 s, and refuses a
/// body over the limit before it is held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_and_huge_bodies_do_not_stop_filter() {
    let pki = Pki::new();
    let (_api, extender) = cluster().await;
    let addr = serve_tls(&pki, extender).await;
    let open_files = || std::fs::read_dir("/proc/self/fd").map_or(0, Iterator::count);
    let flood = transport::MAX_CONNECTIONS + 100;
    let before = open_files();
    let mut idle = Vec::new();
    for _ in 0..flood {
        match tokio::net::TcpStream::connect(addr).await {
            Ok(stream) => idle.push(stream),
            Err(error) => panic!("connection {}: {error}", idle.len()),
        }
    }
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    // Client and server share this process: one descriptor per client socket,
    // and on the server side at most the cap, not one per connection.
    let held = open_files()
        .saturating_sub(before)
        .saturating_sub(idle.len());
    assert!(
        held <= transport::MAX_CONNECTIONS + 8,
        "the server holds {held} descriptors for {flood} idle connections"
    );
    let started = std::time::Instant::now();
    let (status, body) = post(
        &pki.client(Some(&pki.kube_scheduler)),
        format!("https://{addr}/filter"),
        &filter_args("p1"),
        false,
    )
    .await
    .expect("filter answered beside the idle connections");
    assert_eq!(status, StatusCode::OK, "{body}");
    // kube-scheduler's httpTimeout is 5 s (deploy/): well inside it.
    assert!(
        started.elapsed() < std::time::Duration::from_secs(4),
        "filter took {:?} beside {flood} idle connections",
        started.elapsed()
    );
    drop(idle);

    let huge = json!({"Pod": pod("p1"), "NodeNames": ["n1"], "Padding": "x".repeat(
        tessera_scheduler::extender::MAX_BODY_BYTES + 1)});
    let (status, body) = post(
        &pki.client(Some(&pki.kube_scheduler)),
        format!("https://{addr}/filter"),
        &huge,
        false,
    )
    .await
    .expect("answered");
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{body}");
    assert!(body.contains("request body over"), "{body}");
}
