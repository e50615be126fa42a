//! `tessera-bench flood`: tessera-scheduler's mutual-TLS extender port under a
//! flood (issue "Integrity round 3"): filter and bind latency with nothing else
//! on the port, against the same calls while `idle` TCP connections that never
//! start a handshake are kept open (each one the server drops is opened again)
//! and a verified client keeps sending bodies of `body_mib` MiB. The extender
//! serves a synthetic cluster, as `tessera-bench extender` does, with no API
//! server: a bind is answered with its error, which is what is timed. A target is
//! met when every flooded call is answered within kube-scheduler's `httpTimeout`
//! (5 s, deploy/).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tessera_scheduler::certs;
use tessera_scheduler::extender::{Extender, ExtenderConfig};
use tessera_scheduler::transport::{self, BindAccess, TlsFiles};

/// kube-scheduler's `httpTimeout` for the extender (deploy/scheduler-config.yaml).
pub const HTTP_TIMEOUT: Duration = Duration::from_secs(5);

/// What to flood the port with.
#[derive(Debug, Clone)]
pub struct Options {
    /// Idle TCP connections kept open.
    pub idle: usize,
    /// MiB of each body the verified client sends, again and again.
    pub body_mib: usize,
    /// Calls of each kind timed in each phase.
    pub calls: usize,
    /// Nodes in the synthetic cluster (500 of them named in each filter).
    pub nodes: usize,
}

type TlsClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

/// Latencies of one kind of call in one phase.
#[derive(Debug, Default)]
struct Timed {
    samples: Vec<Duration>,
    statuses: std::collections::BTreeMap<u16, usize>,
    failed: usize,
}

impl Timed {
    fn quantile(&self, q: f64) -> Duration {
        let mut sorted = self.samples.clone();
        sorted.sort();
        let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
        sorted.get(i).copied().unwrap_or_default()
    }

    fn max(&self) -> Duration {
        self.samples.iter().copied().max().unwrap_or_default()
    }
}

/// Runs the benchmark and prints its table and verdict.
pub async fn run(options: Options) -> anyhow::Result<()> {
    raise_open_files(options.idle * 2 + 2048)?;
    let dir = tempfile::tempdir()?;
    let made = certs::generate("tessera-scheduler", "tessera-system", 1)
        .context("making the extender's certificates")?;
    let files = TlsFiles {
        cert: dir.path().join("tls.crt"),
        key: dir.path().join("tls.key"),
        client_ca: dir.path().join("ca.crt"),
    };
    std::fs::write(&files.cert, &made.scheduler.cert)?;
    std::fs::write(&files.key, &made.scheduler.key)?;
    std::fs::write(&files.client_ca, &made.ca.cert)?;
    let snapshot =
        tessera_allocator::simulate::synthetic_cluster(options.nodes, 8, options.nodes * 8);
    let ledger = tessera_allocator::simulate::ledger_of(&snapshot);
    drop(snapshot);
    let extender = Extender::new(
        Arc::new(std::sync::Mutex::new(ledger)),
        None,
        None,
        ExtenderConfig::default(),
        Arc::new(AtomicBool::new(true)),
        Arc::new(tessera_scheduler::leader::Leader::new(false)),
    );
    let tls = transport::server_config(&files).context("the extender's TLS settings")?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(transport::serve_tls(
        listener,
        tls,
        extender,
        Arc::new(BindAccess::default()),
    ));
    let client = client(&made.ca.cert, &made.kube_scheduler)?;
    let names: Vec<String> = (0..500.min(options.nodes))
        .map(|i| format!("node-{:05}", (i * 7919) % options.nodes))
        .collect();
    let pod = serde_json::json!({"apiVersion":"v1","kind":"Pod","metadata":{"name":"bench","namespace":"default","uid":"u"},
        "spec":{"containers":[{"name":"main","image":"x","resources":{"limits":{"koordinator.sh/gpu-core":"50","koordinator.sh/gpu-memory-ratio":"50"}}}]}});
    let filter = Bytes::from(serde_json::to_vec(
        &serde_json::json!({"Pod": pod, "NodeNames": names}),
    )?);
    let bind = Bytes::from(serde_json::to_vec(&serde_json::json!({
        "PodName": "bench", "PodNamespace": "default", "PodUID": "u", "Node": names[0]
    }))?);
    println!(
        "tessera-bench flood: extender on {addr} (mutual TLS, {nodes} nodes × 8 GPUs); {calls} filter (500 names) and {calls} bind calls per phase; flood: {idle} idle connections, {mib} MiB bodies",
        nodes = options.nodes,
        calls = options.calls,
        idle = options.idle,
        mib = options.body_mib,
    );
    let quiet = measure(&client, addr, &filter, &bind, options.calls).await;

    // The flood: idle connections topped up, and huge bodies, until it is over.
    let stop = Arc::new(AtomicBool::new(false));
    let open = Arc::new(AtomicUsize::new(0));
    let idle = tokio::spawn(keep_idle(
        addr,
        options.idle,
        Arc::clone(&open),
        Arc::clone(&stop),
    ));
    let huge_sent = Arc::new(AtomicUsize::new(0));
    let huge_refused = Arc::new(AtomicUsize::new(0));
    let body = Bytes::from(vec![b'x'; options.body_mib << 20]);
    let huge = {
        let (client, stop, sent, refused) = (
            client.clone(),
            Arc::clone(&stop),
            Arc::clone(&huge_sent),
            Arc::clone(&huge_refused),
        );
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let answered = call(&client, addr, "filter", body.clone()).await;
                sent.fetch_add(1, Ordering::Relaxed);
                // Refused with 413, or cut off while it was still sending: not held.
                if matches!(answered, Ok((413, _)) | Err(_)) {
                    refused.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
    };
    // Until the idle connections are up (or 10 s).
    let began = Instant::now();
    while open.load(Ordering::Relaxed) < options.idle && began.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let held_at_start = open.load(Ordering::Relaxed);
    let flooded = measure(&client, addr, &filter, &bind, options.calls).await;
    let held_at_end = open.load(Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    let _ = idle.await;
    let _ = huge.await;
    server.abort();

    println!(
        "flood: {held_at_start} idle connections open at the start of the timed calls, {held_at_end} at the end; {} bodies of {} MiB sent, {} refused (413, or cut off while sending)",
        huge_sent.load(Ordering::Relaxed),
        options.body_mib,
        huge_refused.load(Ordering::Relaxed)
    );
    println!(
        "{:<10} {:<8} {:>10} {:>10} {:>10} {:>10}  statuses",
        "call", "phase", "p50", "p99", "max", "p99 ratio"
    );
    let mut met = true;
    for (what, quiet, flooded) in [
        ("filter", &quiet.0, &flooded.0),
        ("bind", &quiet.1, &flooded.1),
    ] {
        for (phase, timed) in [("quiet", quiet), ("flooded", flooded)] {
            let ratio =
                timed.quantile(0.99).as_secs_f64() / quiet.quantile(0.99).as_secs_f64().max(1e-9);
            println!(
                "{:<10} {:<8} {:>10.2?} {:>10.2?} {:>10.2?} {:>9.2}×  {:?}{}",
                what,
                phase,
                timed.quantile(0.5),
                timed.quantile(0.99),
                timed.max(),
                ratio,
                timed.statuses,
                if timed.failed > 0 {
                    format!(", {} unanswered", timed.failed)
                } else {
                    String::new()
                }
            );
        }
        met &= flooded.failed == 0 && flooded.max() < HTTP_TIMEOUT;
    }
    println!(
        "target: every filter and bind answered within kube-scheduler's httpTimeout ({HTTP_TIMEOUT:?}) under {} idle connections and {} MiB bodies: {}",
        options.idle,
        options.body_mib,
        if met { "met" } else { "NOT met" }
    );
    Ok(())
}

/// `calls` filters and binds, one after the other, each timed until its answer.
async fn measure(
    client: &TlsClient,
    addr: SocketAddr,
    filter: &Bytes,
    bind: &Bytes,
    calls: usize,
) -> (Timed, Timed) {
    let (mut filters, mut binds) = (Timed::default(), Timed::default());
    for _ in 0..calls {
        for (path, body, timed) in [("filter", filter, &mut filters), ("bind", bind, &mut binds)] {
            let begun = Instant::now();
            match tokio::time::timeout(HTTP_TIMEOUT * 2, call(client, addr, path, body.clone()))
                .await
            {
                Ok(Ok((status, _))) => {
                    timed.samples.push(begun.elapsed());
                    *timed.statuses.entry(status).or_default() += 1;
                }
                Ok(Err(_)) | Err(_) => timed.failed += 1,
            }
        }
    }
    (filters, binds)
}

/// One POST to `/path`: its status and body.
async fn call(
    client: &TlsClient,
    addr: SocketAddr,
    path: &str,
    body: Bytes,
) -> anyhow::Result<(u16, Bytes)> {
    let request = http::Request::post(format!("https://{addr}/{path}"))
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(body))?;
    let response = client.request(request).await?;
    let status = response.status().as_u16();
    let body = response.into_body().collect().await?.to_bytes();
    Ok((status, body))
}

/// Keeps `want` TCP connections to `addr` open that never start a handshake,
/// opening another for each the server drops, until `stop`.
async fn keep_idle(addr: SocketAddr, want: usize, open: Arc<AtomicUsize>, stop: Arc<AtomicBool>) {
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..want {
        let (open, stop) = (Arc::clone(&open), Arc::clone(&stop));
        tasks.spawn(async move {
            use tokio::io::AsyncReadExt;
            while !stop.load(Ordering::Relaxed) {
                // Beyond the server's cap, a connection waits in the listen backlog
                // (or its SYN is retried): a connect that does not finish is retried.
                let Ok(Ok(mut stream)) = tokio::time::timeout(
                    Duration::from_secs(2),
                    tokio::net::TcpStream::connect(addr),
                )
                .await
                else {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                };
                open.fetch_add(1, Ordering::Relaxed);
                // Held until the server closes it (its handshake deadline) or the end.
                let mut byte = [0u8; 1];
                while !stop.load(Ordering::Relaxed) {
                    let read =
                        tokio::time::timeout(Duration::from_millis(200), stream.read(&mut byte))
                            .await;
                    // Closed by the server (or broken): open another.
                    if let Ok(Ok(0) | Err(_)) = read {
                        break;
                    }
                }
                open.fetch_sub(1, Ordering::Relaxed);
            }
        });
    }
    while tasks.join_next().await.is_some() {}
}

/// A client trusting `ca` for the extender and presenting `identity` (kube-scheduler's).
fn client(ca: &str, identity: &certs::Pem) -> anyhow::Result<TlsClient> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_slice(ca.as_bytes())?)?;
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_client_auth_cert(
        vec![CertificateDer::from_pem_slice(identity.cert.as_bytes())?],
        PrivateKeyDer::from_pem_slice(identity.key.as_bytes())?,
    )?;
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_only()
        .with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(
            ServerName::try_from("tessera-scheduler.tessera-system.svc")?.to_owned(),
        ))
        .enable_http1()
        .build();
    Ok(Client::builder(hyper_util::rt::TokioExecutor::new()).build(connector))
}

/// Lets this process hold `want` files (both ends of every idle connection are
/// here), up to the hard limit.
fn raise_open_files(want: usize) -> anyhow::Result<()> {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    let hard = limit.maximum;
    let soft = Some(
        hard.map_or(want as u64, |h| h.min(want as u64))
            .max(limit.current.unwrap_or(0)),
    );
    rustix::process::setrlimit(
        rustix::process::Resource::Nofile,
        rustix::process::Rlimit {
            current: soft,
            maximum: hard,
        },
    )
    .context("raising the open-file limit")?;
    Ok(())
}
