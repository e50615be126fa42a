use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use proptest::prelude::*;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};

use super::*;
use crate::hpack::testing::{Representation, TestEncoder, representation};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const SOCKET_PATH: &str = "/var/run/containerd/containerd.sock";
const DATA: u8 = 0x0;
const SETTINGS: u8 = 0x4;

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut frame = BytesMut::new();
    put_frame_head(&mut frame, payload.len(), kind, flags, stream);
    frame.put_slice(payload);
    frame.to_vec()
}

fn hello() -> Vec<u8> {
    let mut bytes = PREFACE.to_vec();
    bytes.extend(frame(SETTINGS, 0, 0, &[]));
    bytes
}

/// A request block of literals without indexing.
fn literal_block(authority: &str, extra: &[(&str, &str)]) -> Vec<u8> {
    let mut block = BytesMut::new();
    for (name, value) in [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/runtime.v1.RuntimeService/Version"),
        (":authority", authority),
    ]
    .iter()
    .chain(extra)
    {
        hpack::encode_literal(
            name.as_bytes(),
            value.as_bytes(),
            hpack::Indexing::Allowed,
            &mut block,
        );
    }
    block.to_vec()
}

fn headers(stream: u32, block: &[u8]) -> Vec<u8> {
    frame(HEADERS, END_HEADERS | END_STREAM, stream, block)
}

/// Runs `input` through a fresh pass in one piece; returns it, with h2's input.
fn pass(input: &[u8]) -> (AuthorityNormaliser, Vec<u8>) {
    let mut normaliser = AuthorityNormaliser::new();
    let mut input = BytesMut::from(input);
    let mut output = BytesMut::new();
    normaliser.process(&mut input, &mut output);
    normaliser.finish(&mut input, &mut output);
    (normaliser, output.to_vec())
}

/// The same, `chunk` bytes at a time.
fn pass_chunked(input: &[u8], chunk: usize) -> (AuthorityNormaliser, Vec<u8>) {
    let mut normaliser = AuthorityNormaliser::new();
    let mut pending = BytesMut::new();
    let mut output = BytesMut::new();
    for piece in input.chunks(chunk) {
        pending.extend_from_slice(piece);
        normaliser.process(&mut pending, &mut output);
    }
    normaliser.finish(&mut pending, &mut output);
    (normaliser, output.to_vec())
}

#[derive(Debug)]
struct Parsed {
    kind: u8,
    flags: u8,
    stream: u32,
    payload: Vec<u8>,
}

/// The frames after the preface.
fn frames(bytes: &[u8]) -> Vec<Parsed> {
    let mut rest = bytes.strip_prefix(PREFACE).expect("preface first");
    let mut frames = Vec::new();
    while !rest.is_empty() {
        let head = FrameHead::parse(rest).expect("frame head");
        let payload = rest[FRAME_HEAD_LEN..FRAME_HEAD_LEN + head.len].to_vec();
        rest = &rest[FRAME_HEAD_LEN + head.len..];
        frames.push(Parsed {
            kind: head.kind,
            flags: head.flags,
            stream: head.stream,
            payload,
        });
    }
    frames
}

/// What h2 makes of `bytes`: each header block decoded in order, with one decoder.
fn h2_view(bytes: &[u8]) -> Vec<(u32, Vec<(String, String)>)> {
    let mut decoder = hpack::Decoder::new(HEADER_TABLE_SIZE);
    let mut blocks = Vec::new();
    let mut block = Vec::new();
    for frame in frames(bytes) {
        match frame.kind {
            HEADERS => {
                let mut start = 0;
                if frame.flags & PRIORITY != 0 {
                    start += PRIORITY_LEN;
                }
                assert_eq!(frame.flags & PADDED, 0, "re-encoded blocks have no padding");
                block = frame.payload[start..].to_vec();
            }
            CONTINUATION => block.extend_from_slice(&frame.payload),
            _ => continue,
        }
        if frame.flags & END_HEADERS != 0 {
            let fields =
                crate::hpack::testing::decode_all(&mut decoder, &std::mem::take(&mut block))
                    .expect("h2 decodes what it is given")
                    .into_iter()
                    .map(|(name, value, _)| {
                        (
                            String::from_utf8_lossy(&name).into_owned(),
                            String::from_utf8_lossy(&value).into_owned(),
                        )
                    })
                    .collect();
            blocks.push((frame.stream, fields));
        }
    }
    blocks
}

fn authorities(view: &[(u32, Vec<(String, String)>)]) -> Vec<String> {
    view.iter()
        .filter_map(|(_, fields)| fields.iter().find(|(n, _)| n == ":authority"))
        .map(|(_, v)| v.clone())
        .collect()
}

// === passing through ===

#[test]
fn valid_authorities_pass_byte_for_byte() {
    let mut input = hello();
    // With incremental indexing, then named by index: the table is followed.
    let mut block = BytesMut::new();
    block.put_slice(&[0x83, 0x86]);
    hpack::encode_literal(
        b":path",
        b"/runtime.v1.RuntimeService/Version",
        hpack::Indexing::Allowed,
        &mut block,
    );
    block.put_slice(&[0x41, 9]);
    block.put_slice(b"localhost");
    input.extend(frame(HEADERS, END_HEADERS, 1, &block));
    input.extend(frame(DATA, END_STREAM, 1, &[0, 0, 0, 0, 0]));
    input.extend(headers(3, &[0x83, 0x86, 0x84, 0xbe]));
    input.extend(frame(0x8, 0, 0, &[0, 0, 0x10, 0])); // WINDOW_UPDATE
    for chunk in [1, 7, 9, 4096] {
        let (normaliser, output) = pass_chunked(&input, chunk);
        assert_eq!(output, input, "chunks of {chunk}");
        assert!(!normaliser.is_rewriting());
    }
}

#[test]
fn a_refused_authority_turns_every_later_block_into_literals() {
    let mut input = hello();
    // A valid block that puts x-a: 1 into kubelet's table at 62.
    let mut first = literal_block("localhost", &[]);
    first.extend_from_slice(&[0x40, 3, b'x', b'-', b'a', 1, b'1']);
    input.extend(headers(1, &first));
    // The socket path, indexed: 62 becomes the path, 63 x-a.
    let mut second = vec![0x83, 0x86, 0x84, 0x41, SOCKET_PATH.len() as u8];
    second.extend_from_slice(SOCKET_PATH.as_bytes());
    input.extend(headers(3, &second));
    input.extend(frame(DATA, END_STREAM, 3, b"\0\0\0\0\0"));
    // Both named by index from kubelet's table: h2 has neither.
    input.extend(headers(5, &[0x83, 0x86, 0x84, 0xbe, 0xbf]));
    // A valid authority now, but x-a still named by kubelet's index.
    let mut fourth = literal_block("runtime.local", &[]);
    fourth.push(0xbf);
    input.extend(headers(7, &fourth));
    let (normaliser, output) = pass_chunked(&input, 5);
    assert!(normaliser.is_rewriting());
    let view = h2_view(&output);
    assert_eq!(
        authorities(&view),
        ["localhost", "localhost", "localhost", "runtime.local"]
    );
    assert_eq!(view[3].1.last(), Some(&("x-a".into(), "1".into())));
    let (stream, fields) = &view[2];
    assert_eq!(*stream, 5);
    assert!(fields.contains(&("x-a".into(), "1".into())), "{fields:?}");
    // The first block went through as it was; DATA always does.
    let untouched = hello().len() + FRAME_HEAD_LEN + first.len();
    assert_eq!(output[..untouched], input[..untouched]);
    assert!(
        frames(&output)
            .iter()
            .any(|f| f.kind == DATA && f.payload == b"\0\0\0\0\0")
    );
}

#[test]
fn percent_encoded_and_empty_authorities_are_refused_by_h2_and_normalised() {
    for authority in [
        "%2Fvar%2Frun%2Fcontainerd%2Fcontainerd.sock",
        "",
        "a b",
        "höst",
    ] {
        assert!(!h2_accepts_authority(authority.as_bytes()), "{authority:?}");
        let mut input = hello();
        input.extend(headers(1, &literal_block(authority, &[("te", "trailers")])));
        let (normaliser, output) = pass(&input);
        assert!(normaliser.is_rewriting(), "{authority:?}");
        let view = h2_view(&output);
        assert_eq!(authorities(&view), ["localhost"]);
        assert_eq!(view[0].1.last(), Some(&("te".into(), "trailers".into())));
    }
    for authority in [
        "localhost",
        "localhost:10010",
        "containerd.sock",
        "[::1]:80",
    ] {
        assert!(h2_accepts_authority(authority.as_bytes()), "{authority:?}");
    }
}

#[test]
fn padding_priority_and_continuations_are_read_and_rewritten() {
    let block = literal_block(SOCKET_PATH, &[("x-b", "2")]);
    let (a, rest) = block.split_at(10);
    let (b, c) = rest.split_at(20);
    let mut payload = vec![3]; // pad length
    payload.extend_from_slice(&[0, 0, 0, 0, 200]); // depends on stream 0, weight 201
    payload.extend_from_slice(a);
    payload.extend_from_slice(&[0xaa; 3]);
    let mut input = hello();
    input.extend(frame(HEADERS, PADDED | PRIORITY | END_STREAM, 1, &payload));
    input.extend(frame(CONTINUATION, 0, 1, b));
    input.extend(frame(CONTINUATION, END_HEADERS, 1, c));
    let (_, output) = pass_chunked(&input, 3);
    let out = frames(&output);
    let headers = out.iter().find(|f| f.kind == HEADERS).expect("HEADERS");
    assert_eq!(headers.flags, PRIORITY | END_STREAM | END_HEADERS);
    assert_eq!(headers.payload[..PRIORITY_LEN], [0, 0, 0, 0, 200]);
    assert!(out.iter().all(|f| f.kind != CONTINUATION));
    let view = h2_view(&output);
    assert_eq!(authorities(&view), ["localhost"]);
    assert_eq!(view[0].1.last(), Some(&("x-b".into(), "2".into())));
}

#[test]
fn a_block_over_one_frame_goes_out_in_continuations() {
    let big = "v".repeat(40_000);
    let block = literal_block(SOCKET_PATH, &[("x-big", &big)]);
    let mut input = hello();
    let mut chunks = block.chunks(MAX_FRAME_SIZE);
    let first = chunks.next().expect("some");
    let rest: Vec<_> = chunks.collect();
    input.extend(frame(HEADERS, 0, 1, first));
    for (i, chunk) in rest.iter().enumerate() {
        let flags = if i + 1 == rest.len() { END_HEADERS } else { 0 };
        input.extend(frame(CONTINUATION, flags, 1, chunk));
    }
    let (_, output) = pass(&input);
    let out = frames(&output);
    assert!(out.iter().all(|f| f.payload.len() <= MAX_FRAME_SIZE));
    assert_eq!(out.iter().filter(|f| f.kind == CONTINUATION).count(), 2);
    assert_eq!(out.last().map(|f| f.flags), Some(END_HEADERS));
    let view = h2_view(&output);
    assert_eq!(authorities(&view), ["localhost"]);
    assert_eq!(view[0].1.last().map(|(_, v)| v.len()), Some(40_000));
}

// === failing ===

#[test]
fn an_undecodable_block_fails_the_connection() {
    let mut input = hello();
    input.extend(headers(3, &[0x80 | 70]));
    input.extend(headers(5, &literal_block("localhost", &[])));
    let (normaliser, output) = pass(&input);
    assert!(normaliser.is_closed());
    let mut expected = hello();
    // h2 fails the connection on index 0 as it would have on index 70.
    expected.extend(frame(HEADERS, END_HEADERS | END_STREAM, 3, &[0x80]));
    assert_eq!(output, expected);
}

#[test]
fn what_h2_refuses_at_the_frame_level_is_left_to_h2() {
    let bad = headers(9, &literal_block(SOCKET_PATH, &[]));
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "CONTINUATION first",
            frame(CONTINUATION, END_HEADERS, 1, &[0x82]),
        ),
        (
            "HEADERS on stream 0",
            frame(HEADERS, END_HEADERS, 0, &[0x82]),
        ),
        (
            "frame over the size h2 advertised",
            frame(HEADERS, END_HEADERS, 1, &vec![0x82; MAX_FRAME_SIZE + 1]),
        ),
        (
            "padding past the payload",
            frame(HEADERS, END_HEADERS | PADDED, 1, &[5, 0x82]),
        ),
        (
            "padded, empty",
            frame(HEADERS, END_HEADERS | PADDED, 1, &[]),
        ),
        (
            "priority cut short",
            frame(HEADERS, END_HEADERS | PRIORITY, 1, &[0, 0, 0]),
        ),
        ("DATA inside a header block", {
            let mut bytes = frame(HEADERS, 0, 1, &[0x82]);
            bytes.extend(frame(DATA, 0, 1, b"x"));
            bytes
        }),
        ("CONTINUATION of another stream", {
            let mut bytes = frame(HEADERS, 0, 1, &[0x82]);
            bytes.extend(frame(CONTINUATION, END_HEADERS, 3, &[0x86]));
            bytes
        }),
        ("HEADERS inside a header block", {
            let mut bytes = frame(HEADERS, 0, 1, &[0x82]);
            bytes.extend(frame(HEADERS, END_HEADERS, 3, &[0x86]));
            bytes
        }),
    ];
    for (case, frames) in cases {
        let mut input = hello();
        input.extend(frames);
        input.extend(&bad);
        let (normaliser, output) = pass_chunked(&input, 4);
        assert_eq!(output, input, "{case}");
        assert!(!normaliser.is_rewriting(), "{case}");
    }
}

#[test]
fn too_many_continuations_are_left_to_h2() {
    let mut input = hello();
    input.extend(frame(HEADERS, 0, 1, &[0x82]));
    for _ in 0..=MAX_CONTINUATIONS {
        input.extend(frame(CONTINUATION, 0, 1, &[]));
    }
    input.extend(frame(CONTINUATION, END_HEADERS, 1, &[0x86]));
    let (normaliser, output) = pass(&input);
    assert_eq!(output, input);
    assert!(!normaliser.is_rewriting());
}

#[test]
fn a_self_dependent_stream_is_not_decoded_as_h2_does_not() {
    // h2 resets the stream without decoding: x-a never reaches its table, nor the pass's.
    let mut payload = vec![0, 0, 0, 1, 16];
    payload.extend_from_slice(&[0x40, 3, b'x', b'-', b'a', 1, b'1']);
    let mut input = hello();
    input.extend(frame(HEADERS, END_HEADERS | PRIORITY, 1, &payload));
    let (normaliser, output) = pass(&input);
    assert_eq!(output, input);
    let mut next = input.clone();
    next.extend(headers(3, &[0x83, 0x86, 0x84, 0xbe]));
    let (normaliser_next, _) = pass(&next);
    assert!(!normaliser.is_closed());
    assert!(
        normaliser_next.is_closed(),
        "index 62 names nothing, for h2 too"
    );
}

#[test]
fn a_partial_frame_at_the_end_goes_to_h2_as_it_is() {
    let mut input = hello();
    let whole = headers(1, &literal_block(SOCKET_PATH, &[]));
    input.extend(&whole[..whole.len() - 3]);
    let (_, output) = pass(&input);
    assert_eq!(output, input);
}

proptest! {
    /// Unless it re-encoded or failed, the pass hands h2 exactly what kubelet sent,
    /// however the bytes arrive; and it never panics.
    #[test]
    fn arbitrary_bytes_pass_unchanged_or_are_rewritten_never_panic(
        frames_in in proptest::collection::vec(
            (0u8..12, any::<u8>(), 0u32..6, proptest::collection::vec(any::<u8>(), 0..40)),
            0..12,
        ),
        noise in proptest::collection::vec(any::<u8>(), 0..64),
        chunk in 1usize..64,
    ) {
        let mut input = hello();
        for (kind, flags, stream, payload) in &frames_in {
            input.extend(frame(*kind, *flags, *stream, payload));
        }
        input.extend(noise);
        let (normaliser, output) = pass_chunked(&input, chunk);
        if !normaliser.is_rewriting() && !normaliser.is_closed() {
            prop_assert_eq!(output, input);
        }
    }
}

// === through h2 ===

/// Records what is read through it.
struct Tap<T> {
    inner: T,
    seen: Arc<Mutex<Vec<u8>>>,
}

impl<T: AsyncRead + Unpin> AsyncRead for Tap<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        this.seen
            .lock()
            .expect("lock")
            .extend_from_slice(&buf.filled()[before..]);
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Tap<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// What the proxy's h2 server accepted: authority, path and regular headers.
type Accepted = (Option<String>, String, Vec<(String, String)>);

/// Serves `io` with the proxy's h2 settings through the pass; sends every request
/// it accepts down `accepted`.
fn serve(
    io: impl AsyncRead + AsyncWrite + Unpin + Send + 'static,
    accepted: tokio::sync::mpsc::UnboundedSender<Accepted>,
) {
    tokio::spawn(async move {
        let Ok(mut connection) = served_h2()
            .handshake::<_, Bytes>(KubeletStream::new(io))
            .await
        else {
            return;
        };
        while let Some(Ok((request, mut respond))) = connection.accept().await {
            let headers = request
                .headers()
                .iter()
                .map(|(n, v)| {
                    (
                        n.to_string(),
                        String::from_utf8_lossy(v.as_bytes()).into_owned(),
                    )
                })
                .collect();
            let _ = accepted.send((
                request.uri().authority().map(|a| a.to_string()),
                request.uri().path().to_owned(),
                headers,
            ));
            let _ = respond.send_response(http::Response::new(()), true);
        }
    });
}

/// An h2 client (Huffman strings, a dynamic table) reaches h2 byte for byte.
#[tokio::test]
async fn an_h2_clients_bytes_reach_h2_unchanged() {
    let (client, server) = tokio::io::duplex(1 << 20);
    let raw = Arc::new(Mutex::new(Vec::new()));
    let given = Arc::new(Mutex::new(Vec::new()));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let tapped = Tap {
        inner: server,
        seen: Arc::clone(&raw),
    };
    // The outer tap sees what h2 reads from the pass.
    let io = Tap {
        inner: KubeletStream::new(tapped),
        seen: Arc::clone(&given),
    };
    tokio::spawn(async move {
        let Ok(mut connection) = served_h2().handshake::<_, Bytes>(io).await else {
            return;
        };
        while let Some(Ok((request, mut respond))) = connection.accept().await {
            let _ = tx.send(request.uri().to_string());
            let _ = respond.send_response(http::Response::new(()), true);
        }
    });
    let (mut sender, connection) = h2::client::handshake(client).await.expect("handshake");
    tokio::spawn(connection);
    for i in 0..20 {
        let request = http::Request::post(format!(
            "http://localhost/runtime.v1.RuntimeService/Version{}",
            i % 3
        ))
        .header("content-type", "application/grpc")
        .header("grpc-timeout", format!("{}m", 1000 + i))
        .header("user-agent", "grpc-go/1.60.1")
        .body(())
        .expect("request");
        sender = sender.ready().await.expect("ready");
        let (response, _) = sender.send_request(request, true).expect("send");
        response.await.expect("response");
    }
    for _ in 0..20 {
        assert!(
            rx.recv()
                .await
                .expect("request")
                .starts_with("http://localhost/")
        );
    }
    let raw = raw.lock().expect("lock").clone();
    let given = given.lock().expect("lock").clone();
    assert!(raw.len() > 500);
    assert_eq!(given, raw);
}

/// A request as the property test sends it.
#[derive(Debug, Clone)]
struct Call {
    authority: String,
    extra: Vec<(String, String)>,
    representations: Vec<(Representation, bool)>,
    split: usize,
    pad: Option<u8>,
    priority: bool,
}

fn call() -> impl Strategy<Value = Call> {
    (
        prop_oneof![
            Just("localhost".to_owned()),
            Just(SOCKET_PATH.to_owned()),
            Just("%2Frun%2Fcontainerd%2Fcontainerd.sock".to_owned()),
            Just(String::new()),
            "[a-z0-9.:%/-]{1,20}",
        ],
        // Distinct names: h2's HeaderMap groups repeated ones.
        proptest::collection::btree_map("x-[a-z]{1,6}", "[a-zA-Z0-9 ./:%-]{0,24}", 0..4)
            .prop_map(|map| map.into_iter().collect::<Vec<_>>()),
        proptest::collection::vec((representation(), any::<bool>()), 8),
        1usize..40,
        proptest::option::of(0u8..12),
        any::<bool>(),
    )
        .prop_map(
            |(authority, extra, representations, split, pad, priority)| Call {
                authority,
                extra,
                representations,
                split,
                pad,
                priority,
            },
        )
}

fn encode_call(encoder: &mut TestEncoder, call: &Call, stream: u32, out: &mut Vec<u8>) {
    let mut fields: Vec<(Vec<u8>, Vec<u8>)> = vec![
        (b":method".to_vec(), b"POST".to_vec()),
        (b":scheme".to_vec(), b"http".to_vec()),
        (
            b":path".to_vec(),
            b"/runtime.v1.RuntimeService/Version".to_vec(),
        ),
        (b":authority".to_vec(), call.authority.clone().into_bytes()),
    ];
    fields.extend(
        call.extra
            .iter()
            .map(|(n, v)| (n.clone().into_bytes(), v.clone().into_bytes())),
    );
    let fields: Vec<_> = fields
        .into_iter()
        .zip(call.representations.iter().cycle())
        .map(|((n, v), (r, h))| (n, v, *r, *h))
        .collect();
    let mut block = BytesMut::new();
    encoder.encode(&fields, None, &mut block);
    let (first, rest) = block.split_at(call.split.min(block.len()));
    let mut payload = Vec::new();
    let mut flags = END_STREAM;
    if let Some(pad) = call.pad {
        flags |= PADDED;
        payload.push(pad);
    }
    if call.priority {
        flags |= PRIORITY;
        payload.extend_from_slice(&[0, 0, 0, 0, 15]);
    }
    payload.extend_from_slice(first);
    payload.extend(std::iter::repeat_n(0, usize::from(call.pad.unwrap_or(0))));
    if rest.is_empty() {
        flags |= END_HEADERS;
    }
    out.extend(frame(HEADERS, flags, stream, &payload));
    let chunks: Vec<_> = rest.chunks(7).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        let flags = if i + 1 == chunks.len() {
            END_HEADERS
        } else {
            0
        };
        out.extend(frame(CONTINUATION, flags, stream, chunk));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// However kubelet encodes and frames its requests, the proxy's h2 server
    /// accepts each with its headers, `:authority` normalised where h2 would refuse it.
    #[test]
    fn h2_accepts_every_request_however_encoded(calls in proptest::collection::vec(call(), 1..8)) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let accepted: Vec<Accepted> = runtime.block_on(async {
            let (mut client, server) = tokio::io::duplex(1 << 20);
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
            serve(server, tx);
            let mut encoder = TestEncoder { table: Vec::new(), size: 0, max: HEADER_TABLE_SIZE };
            let mut bytes = hello();
            for (i, call) in calls.iter().enumerate() {
                encode_call(&mut encoder, call, 2 * i as u32 + 1, &mut bytes);
            }
            client.write_all(&bytes).await.expect("write");
            let mut accepted = Vec::new();
            for _ in &calls {
                match tokio::time::timeout(Duration::from_secs(5), rx.recv()).await {
                    Ok(Some(request)) => accepted.push(request),
                    _ => break,
                }
            }
            accepted
        });
        prop_assert_eq!(accepted.len(), calls.len());
        for (call, (authority, path, headers)) in calls.iter().zip(accepted) {
            let expected = if h2_accepts_authority(call.authority.as_bytes()) {
                call.authority.clone()
            } else {
                "localhost".to_owned()
            };
            prop_assert_eq!(authority.as_deref(), Some(expected.as_str()));
            prop_assert_eq!(path, "/runtime.v1.RuntimeService/Version");
            prop_assert_eq!(headers, call.extra.clone());
        }
    }
}

/// An h2 server with the settings the pass reads kubelet's frames by (h2's
/// defaults, named), as the runtime proxy and the kubelet plugin build theirs.
fn served_h2() -> h2::server::Builder {
    let mut builder = h2::server::Builder::new();
    builder
        .header_table_size(HEADER_TABLE_SIZE as u32)
        .max_frame_size(MAX_FRAME_SIZE as u32)
        .max_header_list_size(MAX_HEADER_LIST_SIZE as u32);
    builder
}
