//! kubelet up to 1.30 and grpc-core clients send the unix socket's path as
//! `:authority`, raw or percent-encoded; containerd answers them, and so must the
//! proxy. h2 refuses such a request on both its sides, so the client here writes
//! HTTP/2 frames by hand, header blocks encoded as HPACK literals and indices.
//!
//! Every test runs against both ways of serving kubelet: the h2 path, which
//! hands the runtime `:authority: localhost` for such calls, and the frame relay,
//! which hands it the authority as it was sent.

mod common;

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use k8s_cri::v1 as cri;
use prost::Message;
use tessera_runtime_proxy::KubeletStream;
use tessera_runtime_proxy::Proxy;
use tessera_runtime_proxy::http2::{frame, hpack};
use tessera_runtime_proxy::relay::RelayMode;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{UnixListener, UnixStream};

const SOCKET_PATH: &str = "/var/run/containerd/containerd.sock";
const PERCENT_ENCODED: &str = "%2Fvar%2Frun%2Fcontainerd%2Fcontainerd.sock";
const VERSION: &str = "/runtime.v1.RuntimeService/Version";
const RUN_POD: &str = "/runtime.v1.RuntimeService/RunPodSandbox";

// === a recording runtime ===

/// One request as the runtime saw it.
#[derive(Debug, Clone)]
struct Seen {
    authority: Option<String>,
    path: String,
    body: Bytes,
}

fn grpc_frame(message: &[u8]) -> Bytes {
    let mut frame = BytesMut::with_capacity(5 + message.len());
    frame.put_u8(0);
    frame.put_u32(message.len() as u32);
    frame.put_slice(message);
    frame.freeze()
}

fn runtime_reply(path: &str) -> Bytes {
    let message = match path {
        VERSION => cri::VersionResponse {
            version: "0.1.0".into(),
            runtime_name: "recording-runtime".into(),
            runtime_version: "1".into(),
            runtime_api_version: "v1".into(),
        }
        .encode_to_vec(),
        RUN_POD => cri::RunPodSandboxResponse {
            pod_sandbox_id: "sandbox-1".into(),
        }
        .encode_to_vec(),
        // The proxy's own lookups (ListPodSandbox, ListContainers): nothing there.
        _ => Vec::new(),
    };
    grpc_frame(&message)
}

/// An HTTP/2 runtime on `socket` that answers every call and records it, with the
/// `:authority` it arrived with: as the client's bytes said (read by a [`Tap`]),
/// since the runtime's h2 only sees it through the authority pass, which accepts
/// any authority as containerd does.
fn start_runtime(socket: &Path) -> Arc<Mutex<Vec<Seen>>> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let listener = UnixListener::bind(socket).expect("runtime socket");
    let record = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let record = Arc::clone(&record);
            tokio::spawn(async move {
                let authorities = Arc::new(Mutex::new(std::collections::HashMap::new()));
                let tap = Tap::new(stream, Arc::clone(&authorities));
                let Ok(mut connection) = h2::server::handshake(KubeletStream::new(tap)).await
                else {
                    return;
                };
                while let Some(Ok((request, mut respond))) = connection.accept().await {
                    let record = Arc::clone(&record);
                    let stream_id = u32::from(respond.stream_id());
                    let authority = authorities.lock().expect("lock").remove(&stream_id);
                    tokio::spawn(async move {
                        let (parts, mut body) = request.into_parts();
                        let mut bytes = BytesMut::new();
                        while let Some(Ok(chunk)) = body.data().await {
                            let _ = body.flow_control().release_capacity(chunk.len());
                            bytes.extend_from_slice(&chunk);
                        }
                        let path = parts.uri.path().to_owned();
                        record.lock().expect("lock").push(Seen {
                            authority,
                            path: path.clone(),
                            body: bytes.freeze(),
                        });
                        let response = http::Response::builder()
                            .header("content-type", "application/grpc")
                            .body(())
                            .expect("response");
                        let mut stream = respond.send_response(response, false).expect("send");
                        stream.send_data(runtime_reply(&path), false).expect("data");
                        let mut trailers = http::HeaderMap::new();
                        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
                        stream.send_trailers(trailers).expect("trailers");
                    });
                }
            });
        }
    });
    seen
}

/// The runtime's socket, read through: records each stream's `:authority` as the
/// client encoded it. Header blocks in one HEADERS frame only, as the clients here send.
struct Tap {
    inner: UnixStream,
    input: BytesMut,
    preface: usize,
    decoder: hpack::Decoder,
    authorities: Arc<Mutex<std::collections::HashMap<u32, String>>>,
}

impl Tap {
    fn new(
        inner: UnixStream,
        authorities: Arc<Mutex<std::collections::HashMap<u32, String>>>,
    ) -> Self {
        Self {
            inner,
            input: BytesMut::new(),
            preface: 24,
            decoder: hpack::Decoder::new(4096),
            authorities,
        }
    }

    fn observe(&mut self, fresh: &[u8]) {
        let skip = self.preface.min(fresh.len());
        self.preface -= skip;
        self.input.extend_from_slice(&fresh[skip..]);
        while let Some((head, frame)) = frame::next_frame(&mut self.input) {
            if head.kind != HEADERS {
                continue;
            }
            let Ok(range) = frame::header_fragment(&head, &frame) else {
                continue;
            };
            let mut authority = None;
            let _ = self.decoder.decode(&frame[range], |name, value, _| {
                if name == b":authority" {
                    authority = Some(String::from_utf8_lossy(value).into_owned());
                }
            });
            if let Some(authority) = authority {
                self.authorities
                    .lock()
                    .expect("lock")
                    .insert(head.stream, authority);
            }
        }
    }
}

impl AsyncRead for Tap {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        std::task::ready!(Pin::new(&mut this.inner).poll_read(cx, buf))?;
        let fresh = buf.filled()[before..].to_vec();
        this.observe(&fresh);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Tap {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

struct Setup {
    mode: RelayMode,
    _dir: tempfile::TempDir,
    proxy_socket: PathBuf,
    proxy: Arc<Proxy>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Setup {
    async fn start(mode: RelayMode) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("tauth-")
            .tempdir_in("/tmp")
            .expect("tempdir");
        let runtime_socket = dir.path().join("runtime.sock");
        let seen = start_runtime(&runtime_socket);
        let proxy_socket = dir.path().join("proxy.sock");
        let proxy = common::serve_proxy(&runtime_socket, &proxy_socket, Vec::new(), mode);
        Self {
            mode,
            _dir: dir,
            proxy_socket,
            proxy,
            seen,
        }
    }

    /// The `:authority` the runtime sees for a call sent with `sent`: the h2 path
    /// normalises what h2 refuses, the relay hands on what it was given.
    fn expected_authority<'a>(&self, sent: &'a str) -> &'a str {
        match self.mode {
            RelayMode::H2 if !tessera_runtime_proxy::h2_accepts_authority(sent.as_bytes()) => {
                "localhost"
            }
            _ => sent,
        }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen
            .lock()
            .expect("lock")
            .iter()
            .filter(|s| {
                !s.path.ends_with("/ListPodSandbox") && !s.path.ends_with("/ListContainers")
            })
            .cloned()
            .collect()
    }
}

// === a hand-made HTTP/2 client ===

const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const GOAWAY: u8 = 0x7;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const ACK: u8 = 0x1;

/// How one header field is written into the block (RFC 7541 §6).
enum Rep<'a> {
    /// Literal without indexing, new name (§6.2.2).
    Literal(&'a str, &'a str),
    /// Literal with incremental indexing, name from the static table (§6.2.1).
    IndexingNamed(u8, &'a str),
    /// Indexed field, static or dynamic table (§6.1); indices under 127.
    Indexed(u8),
}

fn put_string(block: &mut BytesMut, value: &str) {
    assert!(value.len() < 127, "one-octet lengths only");
    block.put_u8(value.len() as u8);
    block.put_slice(value.as_bytes());
}

fn header_block(fields: &[Rep<'_>]) -> Bytes {
    let mut block = BytesMut::new();
    for field in fields {
        match *field {
            Rep::Literal(name, value) => {
                block.put_u8(0x00);
                put_string(&mut block, name);
                put_string(&mut block, value);
            }
            Rep::IndexingNamed(index, value) => {
                block.put_u8(0x40 | index);
                put_string(&mut block, value);
            }
            Rep::Indexed(index) => block.put_u8(0x80 | index),
        }
    }
    block.freeze()
}

/// A gRPC request's fields with `authority` sent as a literal without indexing.
fn request<'a>(path: &'a str, authority: &'a str) -> Vec<Rep<'a>> {
    vec![
        Rep::Indexed(3), // :method POST
        Rep::Indexed(6), // :scheme http
        Rep::Literal(":path", path),
        Rep::Literal(":authority", authority),
        Rep::Literal("content-type", "application/grpc"),
        Rep::Literal("te", "trailers"),
    ]
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut frame = Vec::with_capacity(9 + payload.len());
    frame.extend_from_slice(&(payload.len() as u32).to_be_bytes()[1..]);
    frame.push(kind);
    frame.push(flags);
    frame.extend_from_slice(&stream.to_be_bytes());
    frame.extend_from_slice(payload);
    frame
}

/// What came back on one stream.
#[derive(Debug, PartialEq)]
enum Answer {
    /// Its DATA, up to END_STREAM.
    Complete(Vec<u8>),
    /// RST_STREAM with this error code.
    Reset(u32),
    /// GOAWAY with this error code.
    GoAway(u32),
    /// The connection closed.
    Closed,
}

struct RawConnection {
    stream: UnixStream,
}

impl RawConnection {
    async fn open(socket: &Path) -> Self {
        let mut stream = UnixStream::connect(socket).await.expect("connect");
        let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        hello.extend(frame(SETTINGS, 0, 0, &[]));
        stream.write_all(&hello).await.expect("preface");
        Self { stream }
    }

    /// Sends a unary call: `block` as one HEADERS frame, then `message`.
    async fn call(&mut self, stream_id: u32, block: &[u8], message: &[u8]) -> Answer {
        let mut bytes = frame(HEADERS, END_HEADERS, stream_id, block);
        bytes.extend(frame(DATA, END_STREAM, stream_id, &grpc_frame(message)));
        self.stream.write_all(&bytes).await.expect("request");
        tokio::time::timeout(Duration::from_secs(10), self.answer(stream_id))
            .await
            .expect("an answer within 10s")
    }

    async fn answer(&mut self, stream_id: u32) -> Answer {
        let mut data = Vec::new();
        loop {
            let mut head = [0u8; 9];
            if self.stream.read_exact(&mut head).await.is_err() {
                return Answer::Closed;
            }
            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            let (kind, flags) = (head[3], head[4]);
            let id = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
            let mut payload = vec![0u8; len];
            if self.stream.read_exact(&mut payload).await.is_err() {
                return Answer::Closed;
            }
            let code = |at: usize| {
                payload
                    .get(at..at + 4)
                    .map_or(0, |b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
            };
            match kind {
                SETTINGS if flags & ACK == 0 => {
                    // Best effort: the server may have closed after a GOAWAY.
                    let _ = self.stream.write_all(&frame(SETTINGS, ACK, 0, &[])).await;
                }
                GOAWAY => return Answer::GoAway(code(4)),
                RST_STREAM if id == stream_id => return Answer::Reset(code(0)),
                DATA if id == stream_id => data.extend_from_slice(&payload),
                _ => {}
            }
            if id == stream_id && (kind == DATA || kind == HEADERS) && flags & END_STREAM != 0 {
                return Answer::Complete(data);
            }
        }
    }
}

fn version_request() -> Vec<u8> {
    cri::VersionRequest {
        version: "v1".into(),
    }
    .encode_to_vec()
}

fn run_pod_request(name: &str) -> Vec<u8> {
    cri::RunPodSandboxRequest {
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
    .encode_to_vec()
}

// === the tests ===

/// kubelet ≤ 1.30 (grpc-go before kubernetes#123463): the socket path, which
/// grpc-go's encoder puts in its dynamic table and the next call names by index.
async fn raw_socket_path_authority_is_served_passthrough_and_intercepted(mode: RelayMode) {
    let setup = Setup::start(mode).await;
    let mut kubelet = RawConnection::open(&setup.proxy_socket).await;

    let first = header_block(&[
        Rep::Indexed(3),
        Rep::Indexed(6),
        Rep::Literal(":path", VERSION),
        Rep::IndexingNamed(1, SOCKET_PATH), // :authority, into the table at 62
        Rep::Literal("content-type", "application/grpc"),
    ]);
    let answer = kubelet.call(1, &first, &version_request()).await;
    assert_eq!(
        answer,
        Answer::Complete(runtime_reply(VERSION).to_vec()),
        "Version with :authority {SOCKET_PATH}"
    );

    let second = header_block(&[
        Rep::Indexed(3),
        Rep::Indexed(6),
        Rep::Literal(":path", RUN_POD),
        Rep::Indexed(62), // :authority /var/run/containerd/containerd.sock
        Rep::Literal("content-type", "application/grpc"),
    ]);
    let message = run_pod_request("raw");
    let answer = kubelet.call(3, &second, &message).await;
    assert_eq!(
        answer,
        Answer::Complete(runtime_reply(RUN_POD).to_vec()),
        "RunPodSandbox with :authority {SOCKET_PATH} from the dynamic table"
    );

    let seen = setup.seen();
    let paths: Vec<_> = seen.iter().map(|s| s.path.as_str()).collect();
    assert_eq!(paths, [VERSION, RUN_POD]);
    for call in &seen {
        assert_eq!(
            call.authority.as_deref(),
            Some(setup.expected_authority(SOCKET_PATH)),
            "{}",
            call.path
        );
    }
    assert_eq!(seen[0].body, grpc_frame(&version_request()));
    assert_eq!(seen[1].body, grpc_frame(&message));
    // The intercepted path ran: the sandbox is in the proxy's store.
    let pod = setup.proxy.store().pod("sandbox-1").expect("pod stored");
    assert_eq!(pod.name, "raw");
}

/// grpc-core clients (and grpc-go's `unix:` target before 1.57 in some builds):
/// the path percent-encoded.
async fn percent_encoded_socket_path_authority_is_served_passthrough_and_intercepted(
    mode: RelayMode,
) {
    let setup = Setup::start(mode).await;
    let mut kubelet = RawConnection::open(&setup.proxy_socket).await;
    let answer = kubelet
        .call(
            1,
            &header_block(&request(VERSION, PERCENT_ENCODED)),
            &version_request(),
        )
        .await;
    assert_eq!(answer, Answer::Complete(runtime_reply(VERSION).to_vec()));
    let message = run_pod_request("percent");
    let answer = kubelet
        .call(
            3,
            &header_block(&request(RUN_POD, PERCENT_ENCODED)),
            &message,
        )
        .await;
    assert_eq!(answer, Answer::Complete(runtime_reply(RUN_POD).to_vec()));
    let seen = setup.seen();
    assert_eq!(seen.len(), 2, "{seen:?}");
    for call in &seen {
        assert_eq!(
            call.authority.as_deref(),
            Some(setup.expected_authority(PERCENT_ENCODED)),
            "{}",
            call.path
        );
    }
    assert!(setup.proxy.store().pod("sandbox-1").is_some());
}

/// A valid authority reaches the runtime as it was sent, also after an invalid one
/// on the same connection switched it to re-encoding.
async fn valid_authority_is_kept(mode: RelayMode) {
    let setup = Setup::start(mode).await;
    let mut kubelet = RawConnection::open(&setup.proxy_socket).await;
    for (stream, authority) in [
        (1, "runtime.local:1234"),
        (3, SOCKET_PATH),
        (5, "localhost"),
    ] {
        let answer = kubelet
            .call(
                stream,
                &header_block(&request(VERSION, authority)),
                &version_request(),
            )
            .await;
        assert_eq!(
            answer,
            Answer::Complete(runtime_reply(VERSION).to_vec()),
            ":authority {authority}"
        );
    }
    let authorities: Vec<_> = setup
        .seen()
        .into_iter()
        .map(|s| s.authority.unwrap_or_default())
        .collect();
    assert_eq!(
        authorities,
        [
            "runtime.local:1234",
            setup.expected_authority(SOCKET_PATH),
            "localhost"
        ]
    );
}

/// A header block that does not decode is a connection error, as in h2; the proxy
/// goes on serving other connections.
async fn undecodable_header_block_fails_only_its_connection(mode: RelayMode) {
    let setup = Setup::start(mode).await;
    let mut kubelet = RawConnection::open(&setup.proxy_socket).await;
    // Index 70: past the static table, and the dynamic one is empty.
    let answer = kubelet.call(1, &[0x80 | 70], &version_request()).await;
    assert!(
        matches!(answer, Answer::GoAway(code) if code == 0x1 || code == 0x9),
        "expected GOAWAY PROTOCOL_ERROR or COMPRESSION_ERROR, got {answer:?}"
    );
    let mut next = RawConnection::open(&setup.proxy_socket).await;
    let answer = next
        .call(
            1,
            &header_block(&request(VERSION, SOCKET_PATH)),
            &version_request(),
        )
        .await;
    assert_eq!(answer, Answer::Complete(runtime_reply(VERSION).to_vec()));
}

/// Each test above, once per way of serving kubelet.
macro_rules! both_ways {
    ($($name:ident),* $(,)?) => {
        mod h2_path {
            use super::RelayMode;
            $(#[tokio::test] async fn $name() { super::$name(RelayMode::H2).await })*
        }
        mod frame_relay {
            use super::RelayMode;
            $(#[tokio::test] async fn $name() { super::$name(RelayMode::Frames).await })*
        }
    };
}

both_ways!(
    raw_socket_path_authority_is_served_passthrough_and_intercepted,
    percent_encoded_socket_path_authority_is_served_passthrough_and_intercepted,
    valid_authority_is_kept,
    undecodable_header_block_fails_only_its_connection,
);
