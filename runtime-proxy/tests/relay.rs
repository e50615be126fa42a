//! The frame relay's own accounting: lifecycle calls whose body the relay holds,
//! rewrites and re-emits share one connection with passthrough calls, against a
//! runtime with HTTP/2's smallest windows, and the relay's own answers leave the
//! connection usable; a passthrough answer goes on as its bytes come.

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::{BufMut, Bytes, BytesMut};
use k8s_cri::v1 as cri;
use prost::Message;
use tessera_runtime_proxy::relay::RelayMode;
use tessera_runtime_proxy::{Hook, HookContext, HookRejection, LifecycleRequest, Proxy};
use tokio::net::{UnixListener, UnixStream};
use tonic::Code;

const RUN_POD: &str = "/runtime.v1.RuntimeService/RunPodSandbox";
const ECHO: &str = "/runtime.v1.RuntimeService/SomethingNewer";
/// What the growing hook adds: past the runtime's 65,535-byte windows, several times.
const GROWTH: usize = 200_000;

fn grpc_frame(message: &[u8]) -> Bytes {
    let mut frame = BytesMut::with_capacity(5 + message.len());
    frame.put_u8(0);
    frame.put_u32(message.len() as u32);
    frame.put_slice(message);
    frame.freeze()
}

/// Every request body the runtime read to its end, by path.
type Seen = Arc<Mutex<Vec<(String, Bytes)>>>;

/// An h2 runtime with h2's default (the protocol's initial) windows: echoes any
/// call's body, answers RunPodSandbox with a sandbox ID.
fn start_runtime(socket: &Path) -> Seen {
    let seen: Seen = Arc::default();
    let listener = UnixListener::bind(socket).expect("runtime socket");
    let record = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let record = Arc::clone(&record);
            tokio::spawn(async move {
                let Ok(mut connection) = h2::server::handshake(stream).await else {
                    return;
                };
                while let Some(Ok((request, mut respond))) = connection.accept().await {
                    let record = Arc::clone(&record);
                    tokio::spawn(async move {
                        let (parts, mut body) = request.into_parts();
                        let mut bytes = BytesMut::new();
                        loop {
                            match body.data().await {
                                Some(Ok(chunk)) => {
                                    let _ = body.flow_control().release_capacity(chunk.len());
                                    bytes.extend_from_slice(&chunk);
                                }
                                // Reset: the call never reached its end here.
                                Some(Err(_)) => return,
                                None => break,
                            }
                        }
                        let path = parts.uri.path().to_owned();
                        let bytes = bytes.freeze();
                        record
                            .lock()
                            .expect("lock")
                            .push((path.clone(), bytes.clone()));
                        let reply = if path == RUN_POD {
                            let request = cri::RunPodSandboxRequest::decode(bytes.slice(5..))
                                .expect("a RunPodSandboxRequest");
                            let name = request
                                .config
                                .and_then(|c| c.metadata)
                                .map(|m| m.name)
                                .unwrap_or_default();
                            grpc_frame(
                                &cri::RunPodSandboxResponse {
                                    pod_sandbox_id: format!("sandbox-{name}"),
                                }
                                .encode_to_vec(),
                            )
                        } else {
                            bytes
                        };
                        let response = http::Response::builder()
                            .header("content-type", "application/grpc")
                            .body(())
                            .expect("response");
                        let Ok(mut stream) = respond.send_response(response, false) else {
                            return;
                        };
                        stream.reserve_capacity(reply.len());
                        let _ = stream.send_data(reply, false);
                        let mut trailers = http::HeaderMap::new();
                        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
                        let _ = stream.send_trailers(trailers);
                    });
                }
            });
        }
    });
    seen
}

/// Grows every pod's config by [`GROWTH`] bytes; refuses pods named "refused".
#[derive(Debug)]
struct GrowOrRefuse;

#[async_trait]
impl Hook for GrowOrRefuse {
    fn name(&self) -> &str {
        "grow"
    }

    async fn pre(
        &self,
        _ctx: &HookContext,
        request: &mut LifecycleRequest,
    ) -> Result<(), HookRejection> {
        let LifecycleRequest::RunPodSandbox(request) = request else {
            return Ok(());
        };
        let Some(config) = request.config.as_mut() else {
            return Ok(());
        };
        if config
            .metadata
            .as_ref()
            .is_some_and(|m| m.name == "refused")
        {
            return Err(HookRejection::new(Code::PermissionDenied, "not this one"));
        }
        config
            .annotations
            .insert("grown".into(), "g".repeat(GROWTH));
        Ok(())
    }
}

struct Setup {
    _dir: tempfile::TempDir,
    socket: PathBuf,
    proxy: Arc<Proxy>,
    seen: Seen,
}

async fn start() -> Setup {
    let dir = tempfile::Builder::new()
        .prefix("trelay-")
        .tempdir_in("/tmp")
        .expect("tempdir");
    let runtime = dir.path().join("runtime.sock");
    let seen = start_runtime(&runtime);
    let socket = dir.path().join("proxy.sock");
    let hooks: Vec<Arc<dyn Hook>> = vec![Arc::new(GrowOrRefuse)];
    let proxy = common::serve_proxy(&runtime, &socket, hooks, RelayMode::Frames);
    Setup {
        _dir: dir,
        socket,
        proxy,
        seen,
    }
}

/// What a call got back: its body and grpc-status / grpc-message.
#[derive(Debug)]
struct Answer {
    body: Bytes,
    status: String,
    message: String,
}

/// One unary call over `client`; `content_length` as hyper sends it for a body of known size.
async fn call(
    mut client: h2::client::SendRequest<Bytes>,
    path: &str,
    body: Bytes,
    content_length: bool,
) -> Answer {
    let mut request = http::Request::post(format!("http://localhost{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if content_length {
        request = request.header("content-length", body.len());
    }
    client = client.ready().await.expect("ready");
    let (response, mut send) = client
        .send_request(request.body(()).expect("request"), false)
        .expect("send");
    send.reserve_capacity(body.len());
    send.send_data(body, true).expect("body");
    let response = tokio::time::timeout(Duration::from_secs(20), response)
        .await
        .expect("answered within 20s")
        .expect("response");
    let (parts, mut received) = response.into_parts();
    let mut data = BytesMut::new();
    while let Some(chunk) = received.data().await {
        let chunk = chunk.expect("body chunk");
        let _ = received.flow_control().release_capacity(chunk.len());
        data.extend_from_slice(&chunk);
    }
    let trailers = received.trailers().await.expect("trailers");
    let status_map = trailers.as_ref().unwrap_or(&parts.headers);
    let text = |name: &str| {
        status_map
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    Answer {
        body: data.freeze(),
        status: text("grpc-status"),
        message: text("grpc-message"),
    }
}

async fn connect(socket: &Path) -> h2::client::SendRequest<Bytes> {
    let stream = UnixStream::connect(socket).await.expect("connect");
    let (client, connection) = h2::client::handshake(stream).await.expect("handshake");
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client
}

fn run_pod(name: &str) -> Bytes {
    grpc_frame(
        &cri::RunPodSandboxRequest {
            config: Some(cri::PodSandboxConfig {
                metadata: Some(cri::PodSandboxMetadata {
                    name: name.into(),
                    uid: format!("uid-{name}"),
                    namespace: "default".into(),
                    attempt: 0,
                }),
                ..Default::default()
            }),
            runtime_handler: String::new(),
        }
        .encode_to_vec(),
    )
}

#[tokio::test]
async fn grown_lifecycle_bodies_and_large_passthrough_bodies_share_one_connection() {
    let setup = start().await;
    let client = connect(&setup.socket).await;
    let mut calls = Vec::new();
    for i in 0..8u8 {
        let client = client.clone();
        let body = grpc_frame(&vec![i; 150_000]);
        calls.push(tokio::spawn(async move {
            let answer = call(client, ECHO, body.clone(), false).await;
            assert_eq!(answer.status, "0", "echo {i}: {}", answer.message);
            assert!(answer.body == body, "echo {i}: body changed on the way");
        }));
    }
    for i in 0..4 {
        let client = client.clone();
        calls.push(tokio::spawn(async move {
            let name = format!("pod{i}");
            // Half with content-length: the relay re-encodes their header block without it.
            let answer = call(client, RUN_POD, run_pod(&name), i % 2 == 0).await;
            assert_eq!(answer.status, "0", "{name}: {}", answer.message);
            let response = cri::RunPodSandboxResponse::decode(answer.body.slice(5..))
                .expect("a RunPodSandboxResponse");
            assert_eq!(response.pod_sandbox_id, format!("sandbox-{name}"));
        }));
    }
    for call in calls {
        call.await.expect("call");
    }
    let seen = setup.seen.lock().expect("lock").clone();
    let pods: Vec<_> = seen
        .iter()
        .filter(|(path, _)| path == RUN_POD)
        .map(|(_, body)| {
            cri::RunPodSandboxRequest::decode(body.slice(5..)).expect("decodes at the runtime")
        })
        .collect();
    assert_eq!(pods.len(), 4);
    for pod in &pods {
        let config = pod.config.as_ref().expect("config");
        assert_eq!(config.annotations["grown"].len(), GROWTH);
    }
    assert_eq!(seen.iter().filter(|(path, _)| path == ECHO).count(), 8);
    for i in 0..4 {
        assert!(
            setup
                .proxy
                .store()
                .pod(&format!("sandbox-pod{i}"))
                .is_some(),
            "pod{i} stored by the post stage"
        );
    }
}

#[tokio::test]
async fn a_refused_call_is_answered_by_the_relay_and_the_connection_goes_on() {
    let setup = start().await;
    let client = connect(&setup.socket).await;
    let answer = call(client.clone(), RUN_POD, run_pod("refused"), true).await;
    assert_eq!(answer.status, (Code::PermissionDenied as i32).to_string());
    assert_eq!(answer.message, "tessera hook \"grow\": not this one");
    // Same connection: tables, windows and stream IDs still agree on both legs.
    for round in 0..3 {
        let body = grpc_frame(&[round; 100_000]);
        let answer = call(client.clone(), ECHO, body.clone(), true).await;
        assert_eq!(answer.status, "0");
        assert!(answer.body == body);
        let answer = call(
            client.clone(),
            RUN_POD,
            run_pod(&format!("after{round}")),
            false,
        )
        .await;
        assert_eq!(answer.status, "0", "{}", answer.message);
    }
    let seen = setup.seen.lock().expect("lock").clone();
    let names: Vec<String> = seen
        .iter()
        .filter(|(path, _)| path == RUN_POD)
        .filter_map(|(_, body)| cri::RunPodSandboxRequest::decode(body.slice(5..)).ok())
        .filter_map(|request| request.config?.metadata.map(|m| m.name))
        .collect();
    assert_eq!(
        names,
        ["after0", "after1", "after2"],
        "the refused call never reached the runtime"
    );
}

#[tokio::test]
async fn a_request_over_the_message_limit_is_refused_without_reaching_the_runtime() {
    let setup = start().await;
    let client = connect(&setup.socket).await;
    // 16 MiB limit: a RunPodSandbox body past it.
    let mut request =
        cri::RunPodSandboxRequest::decode(run_pod("huge").slice(5..)).expect("decode");
    if let Some(config) = request.config.as_mut() {
        config.hostname = "h".repeat(17 << 20);
    }
    let answer = call(
        client.clone(),
        RUN_POD,
        grpc_frame(&request.encode_to_vec()),
        false,
    )
    .await;
    assert_eq!(
        answer.status,
        (Code::ResourceExhausted as i32).to_string(),
        "{}",
        answer.message
    );
    let answer = call(client, ECHO, grpc_frame(b"still here"), false).await;
    assert_eq!(answer.status, "0");
    let seen = setup.seen.lock().expect("lock").clone();
    assert!(
        seen.iter().all(|(path, _)| path != RUN_POD),
        "{} calls seen",
        seen.len()
    );
}

/// Reads from `socket` until `want` bytes came, or fails after 5 s.
async fn read_exactly(socket: &mut UnixStream, want: usize) -> Vec<u8> {
    use tokio::io::AsyncReadExt;
    let mut got = vec![0; want];
    tokio::time::timeout(Duration::from_secs(5), socket.read_exact(&mut got))
        .await
        .unwrap_or_else(|_| panic!("{want} bytes within 5 s"))
        .expect("read");
    got
}

/// A frame relay with no hooks in front of a runtime socket the test plays
/// itself, and a kubelet connection that sent, in one write, the preface, empty
/// SETTINGS, a Version request's header block (`:path` a literal without
/// indexing; `flags` on its HEADERS) and `more`; the relay passed all of it to
/// the runtime unchanged.
struct RawCall {
    _dir: tempfile::TempDir,
    proxy: Arc<Proxy>,
    kubelet: UnixStream,
    runtime: UnixStream,
}

async fn raw_version_call(flags: u8, more: impl FnOnce(&mut BytesMut)) -> RawCall {
    use tessera_runtime_proxy::http2::frame::{PREFACE, flag, kind, put_head};
    use tokio::io::AsyncWriteExt;

    let dir = tempfile::Builder::new()
        .prefix("trelay-")
        .tempdir_in("/tmp")
        .expect("tempdir");
    let runtime_socket = dir.path().join("runtime.sock");
    let runtime = UnixListener::bind(&runtime_socket).expect("bind runtime");
    let socket = dir.path().join("proxy.sock");
    let proxy = common::serve_proxy(&runtime_socket, &socket, Vec::new(), RelayMode::Frames);

    let mut kubelet = UnixStream::connect(&socket).await.expect("connect");
    let mut request = BytesMut::from(&PREFACE[..]);
    put_head(&mut request, 0, kind::SETTINGS, 0, 0);
    let path = b"/runtime.v1.RuntimeService/Version";
    let mut block = vec![0x83, 0x86, 0x04, path.len() as u8];
    block.extend_from_slice(path);
    put_head(
        &mut request,
        block.len(),
        kind::HEADERS,
        flag::END_HEADERS | flags,
        1,
    );
    request.extend_from_slice(&block);
    more(&mut request);
    kubelet.write_all(&request).await.expect("request");
    let (mut runtime, _) = runtime.accept().await.expect("relay dials the runtime");
    assert_eq!(
        read_exactly(&mut runtime, request.len()).await,
        &request[..]
    );
    RawCall {
        _dir: dir,
        proxy,
        kubelet,
        runtime,
    }
}

/// The runtime's first frames on a [`raw_version_call`]: empty SETTINGS, then
/// HEADERS on stream 1 whose block is the one byte `block`.
fn answer_start(block: u8) -> BytesMut {
    use tessera_runtime_proxy::http2::frame::{flag, kind, put_head};

    let mut answer = BytesMut::new();
    put_head(&mut answer, 0, kind::SETTINGS, 0, 0);
    put_head(&mut answer, 1, kind::HEADERS, flag::END_HEADERS, 1);
    answer.put_u8(block);
    answer
}

#[tokio::test]
async fn a_passthrough_answer_goes_on_as_its_bytes_come_not_frame_by_frame() {
    use tessera_runtime_proxy::http2::frame::{flag, kind, put_head};
    use tokio::io::AsyncWriteExt;

    let RawCall {
        mut kubelet,
        mut runtime,
        ..
    } = raw_version_call(flag::END_STREAM, |_| {}).await;
    // The runtime: SETTINGS, `:status 200`, then a 10-byte DATA frame of which
    // only 4 bytes come for now.
    let mut answer = answer_start(0x88);
    put_head(&mut answer, 10, kind::DATA, flag::END_STREAM, 1);
    answer.extend_from_slice(b"0123");
    runtime.write_all(&answer).await.expect("answer");
    assert_eq!(read_exactly(&mut kubelet, answer.len()).await, &answer[..]);
    runtime.write_all(b"456789").await.expect("rest");
    assert_eq!(read_exactly(&mut kubelet, 6).await, b"456789");
}

#[tokio::test]
async fn a_call_reset_in_the_read_that_opened_it_is_recorded_at_once() {
    use tessera_runtime_proxy::http2::frame::{put_rst_stream, reason};

    // The relay opens a passthrough call's record after writing what it read;
    // the reset in the same read must still find it.
    let call = raw_version_call(0, |request| put_rst_stream(request, 1, reason::CANCEL)).await;
    // Both connections stay open: a call left open would be recorded (as
    // cancelled) only when they close.
    let metrics = call.proxy.metrics().encode();
    assert!(
        metrics.contains(r#"tessera_proxy_requests_total{method="Version",code="Cancelled"} 1"#),
        "{metrics}"
    );
}

#[tokio::test]
async fn an_answer_the_receiver_fails_on_goes_once_with_what_followed_it_then_the_end() {
    use tessera_runtime_proxy::http2::frame::{flag, put_head};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let RawCall {
        mut kubelet,
        mut runtime,
        ..
    } = raw_version_call(flag::END_STREAM, |_| {}).await;
    // In one write, while nothing of the answers could change (no lifecycle
    // call): SETTINGS, a header block that does not decode (index 0), a PING.
    let mut answer = answer_start(0x80);
    put_head(&mut answer, 8, 0x6, 0, 0); // PING
    answer.extend_from_slice(b"pingpong");
    runtime.write_all(&answer).await.expect("answer");
    // Kubelet reads each byte once, then the end of the relayed connection.
    let mut received = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), kubelet.read_to_end(&mut received))
        .await
        .expect("the relay ends the connection")
        .expect("read");
    assert_eq!(received, &answer[..]);
}
