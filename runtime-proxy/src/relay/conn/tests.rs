use bytes::BytesMut;

use super::*;
use crate::http2::hpack::testing::{Representation, TestEncoder, decode_all};

const CREATE: &[u8] = b"/runtime.v1.RuntimeService/CreateContainer";
const VERSION: &[u8] = b"/runtime.v1.RuntimeService/Version";

/// A gRPC request's fields as kubelet's encoder sends them: every one with
/// incremental indexing, `:path` Huffman-coded.
fn request(path: &[u8], length: &str) -> Vec<(Vec<u8>, Vec<u8>, Representation, bool)> {
    [
        (&b":method"[..], &b"POST"[..]),
        (b":scheme", b"http"),
        (b":path", path),
        (b":authority", b"/var/run/containerd/containerd.sock"),
        (b"content-type", b"application/grpc"),
        (b"content-length", length.as_bytes()),
        (b"te", b"trailers"),
    ]
    .into_iter()
    .map(|(n, v)| {
        (
            n.to_vec(),
            v.to_vec(),
            Representation::WithIndexing,
            n == b":path",
        )
    })
    .collect()
}

/// One HEADERS frame carrying `block` on `stream`, END_HEADERS set.
fn headers(stream: u32, block: &[u8]) -> (FrameHead, BytesMut) {
    let mut frame = BytesMut::new();
    frame::put_head(
        &mut frame,
        block.len(),
        kind::HEADERS,
        flag::END_HEADERS,
        stream,
    );
    frame.extend_from_slice(block);
    (FrameHead::parse(&frame).expect("head"), frame)
}

fn names_and_values(fields: Vec<(Vec<u8>, Vec<u8>, hpack::Indexing)>) -> Vec<(Vec<u8>, Vec<u8>)> {
    fields.into_iter().map(|(n, v, _)| (n, v)).collect()
}

fn sent(fields: &[(Vec<u8>, Vec<u8>, Representation, bool)]) -> Vec<(Vec<u8>, Vec<u8>)> {
    fields
        .iter()
        .map(|(n, v, _, _)| (n.clone(), v.clone()))
        .collect()
}

#[test]
fn only_lifecycle_requests_are_reencoded_and_the_table_follows_the_encoder() {
    let mut encoder = TestEncoder {
        table: Vec::new(),
        size: 0,
        max: frame::DEFAULT_TABLE_SIZE,
    };
    let mut blocks = HeaderBlocks::requests();
    // The receiver's table never sees a re-encoded block's fields: a fresh decoder.
    let mut receiver = hpack::Decoder::new(frame::DEFAULT_TABLE_SIZE);
    for (stream, path, lifecycle) in [(1, VERSION, false), (3, CREATE, true), (5, VERSION, false)] {
        let fields = request(path, &format!("{stream}00"));
        let mut block = BytesMut::new();
        encoder.encode(&fields, None, &mut block);
        let (head, frame) = headers(stream, &block);
        let Step::Block(_, read) = blocks.read(&head, &frame, frame::DEFAULT_TABLE_SIZE) else {
            panic!("stream {stream}: a whole block");
        };
        assert_eq!(read.path.as_deref().map(str::as_bytes), Some(path));
        assert_eq!(read.lifecycle_content_length, lifecycle);
        assert!(read.changed_table);
        // Every field entered the table: the relay's count is the encoder's.
        assert_eq!(blocks.decoder.table_size(), encoder.size, "stream {stream}");
        if lifecycle {
            let mut expected = sent(&fields);
            expected.retain(|(n, _)| n != b"content-length");
            let reencoded = decode_all(&mut receiver, blocks.reencoded()).expect("decodes");
            assert_eq!(names_and_values(reencoded), expected);
            assert_eq!(
                receiver.table_size(),
                0,
                "literals that leave the table alone"
            );
        } else {
            assert!(
                blocks.reencoded().is_empty(),
                "stream {stream}: passed on as sent"
            );
        }
    }
}

#[test]
fn once_diverged_every_request_is_reencoded() {
    let mut encoder = TestEncoder {
        table: Vec::new(),
        size: 0,
        max: frame::DEFAULT_TABLE_SIZE,
    };
    let mut blocks = HeaderBlocks::requests();
    blocks.diverged = true;
    let fields = request(VERSION, "5");
    let mut block = BytesMut::new();
    encoder.encode(&fields, None, &mut block);
    let (head, frame) = headers(1, &block);
    assert!(matches!(
        blocks.read(&head, &frame, frame::DEFAULT_TABLE_SIZE),
        Step::Block(..)
    ));
    let mut receiver = hpack::Decoder::new(frame::DEFAULT_TABLE_SIZE);
    let reencoded = decode_all(&mut receiver, blocks.reencoded()).expect("decodes");
    assert_eq!(names_and_values(reencoded), sent(&fields));
}

#[test]
fn answers_are_read_for_status_and_message_and_never_reencoded() {
    let mut encoder = TestEncoder {
        table: Vec::new(),
        size: 0,
        max: frame::DEFAULT_TABLE_SIZE,
    };
    let mut blocks = HeaderBlocks::answers();
    let trailers: Vec<_> = [
        (&b"grpc-status"[..], &b"5"[..]),
        (b"grpc-message", b"container %22x%22 not found"),
    ]
    .into_iter()
    .map(|(n, v)| (n.to_vec(), v.to_vec(), Representation::WithIndexing, true))
    .collect();
    // Twice: literals first, then indices into the table the first one filled.
    for _ in 0..2 {
        let mut block = BytesMut::new();
        encoder.encode(&trailers, None, &mut block);
        let (head, frame) = headers(1, &block);
        let Step::Block(_, read) = blocks.read(&head, &frame, frame::DEFAULT_TABLE_SIZE) else {
            panic!("a whole block");
        };
        assert_eq!(read.status, Some(Code::NotFound));
        assert_eq!(read.message.as_deref(), Some("container \"x\" not found"));
        assert_eq!(blocks.decoder.table_size(), encoder.size);
        assert!(blocks.reencoded().is_empty());
    }
}
