//! HTTP/2 framing (RFC 9113 §4, §6) as far as the relay needs it: cutting a byte
//! stream into frames, finding a header block's fragment and a DATA frame's
//! payload, reading SETTINGS and WINDOW_UPDATE, and writing the few frames the
//! relay sends itself. Pure: no I/O, fuzzed (`runtime-proxy/fuzz`, `relay_frames`).

use std::ops::Range;

use bytes::{BufMut, Bytes, BytesMut};

use crate::hpack;

/// The client connection preface (§3.4).
pub const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Length of a frame header.
pub const HEAD_LEN: usize = 9;
/// The largest frame every peer must accept (§4.2): what the relay's own frames stay under.
pub const MIN_MAX_FRAME_SIZE: usize = 16_384;
/// The connection and stream flow-control window before any SETTINGS or WINDOW_UPDATE (§6.9.2).
pub const DEFAULT_WINDOW: i64 = 65_535;
/// HPACK's dynamic table size before any SETTINGS (§6.5.2).
pub const DEFAULT_TABLE_SIZE: usize = 4096;

/// Frame types (§6).
pub mod kind {
    pub const DATA: u8 = 0x0;
    pub const HEADERS: u8 = 0x1;
    pub const RST_STREAM: u8 = 0x3;
    pub const SETTINGS: u8 = 0x4;
    pub const GOAWAY: u8 = 0x7;
    pub const WINDOW_UPDATE: u8 = 0x8;
    pub const CONTINUATION: u8 = 0x9;
}

/// Frame flags (§6).
pub mod flag {
    pub const END_STREAM: u8 = 0x1;
    pub const ACK: u8 = 0x1;
    pub const END_HEADERS: u8 = 0x4;
    pub const PADDED: u8 = 0x8;
    pub const PRIORITY: u8 = 0x20;
}

/// SETTINGS identifiers the relay reads (§6.5.2).
pub mod setting {
    pub const HEADER_TABLE_SIZE: u16 = 0x1;
    pub const INITIAL_WINDOW_SIZE: u16 = 0x4;
}

/// Error codes the relay sends (§7).
pub mod reason {
    pub const NO_ERROR: u32 = 0x0;
    pub const PROTOCOL_ERROR: u32 = 0x1;
    pub const CANCEL: u32 = 0x8;
    pub const REFUSED_STREAM: u32 = 0x7;
}

/// Why a frame cannot be read as its type says. The relay passes such a frame on
/// unchanged for the receiver to fail the connection on, and stops reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// A PADDED frame too short for its pad length, or padding past its end.
    #[error("{kind:#x} frame on stream {stream}: padding longer than the frame")]
    Padding {
        /// The frame's type.
        kind: u8,
        /// The frame's stream.
        stream: u32,
    },
    /// A HEADERS frame with the PRIORITY flag too short for its priority fields.
    #[error("HEADERS frame on stream {0}: shorter than its priority fields")]
    Priority(u32),
}

/// A frame header (§4.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHead {
    /// Payload length.
    pub len: usize,
    /// Frame type.
    pub kind: u8,
    /// Flags.
    pub flags: u8,
    /// Stream identifier, reserved bit cleared.
    pub stream: u32,
}

impl FrameHead {
    /// Reads a frame header from the first [`HEAD_LEN`] bytes, if they are there.
    pub fn parse(bytes: &[u8]) -> Option<Self> {
        let head: &[u8; HEAD_LEN] = bytes.get(..HEAD_LEN)?.try_into().ok()?;
        Some(Self {
            len: usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]),
            kind: head[3],
            flags: head[4],
            stream: u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff,
        })
    }

    /// Whether `flag` is set.
    pub fn has(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }
}

/// Takes one whole frame (header and payload) off the front of `input`, without
/// copying, or `None` when it has not all arrived.
pub fn next_frame(input: &mut BytesMut) -> Option<(FrameHead, BytesMut)> {
    let head = FrameHead::parse(input)?;
    if input.len() < HEAD_LEN + head.len {
        return None;
    }
    Some((head, input.split_to(HEAD_LEN + head.len)))
}

/// How many bytes at the front of `input` are whole frames.
pub fn whole_frames_len(input: &[u8]) -> usize {
    let mut at = 0;
    while let Some(head) = FrameHead::parse(&input[at..]) {
        let end = at + HEAD_LEN + head.len;
        if end > input.len() {
            break;
        }
        at = end;
    }
    at
}

/// Where the header block fragment of a HEADERS or CONTINUATION frame lies in
/// `frame` (header included), past padding and priority fields.
pub fn header_fragment(head: &FrameHead, frame: &[u8]) -> Result<Range<usize>, FrameError> {
    let mut start = HEAD_LEN;
    if head.kind != kind::HEADERS {
        return Ok(start..frame.len());
    }
    let (start_after_pad, end) = unpad(head, frame)?;
    start = start_after_pad;
    if head.has(flag::PRIORITY) {
        start += 5;
        if start > end {
            return Err(FrameError::Priority(head.stream));
        }
    }
    Ok(start..end)
}

/// Where the payload of a DATA frame lies in `frame` (header included), padding
/// removed.
pub fn data_payload(head: &FrameHead, frame: &[u8]) -> Result<Range<usize>, FrameError> {
    let (start, end) = unpad(head, frame)?;
    Ok(start..end)
}

fn unpad(head: &FrameHead, frame: &[u8]) -> Result<(usize, usize), FrameError> {
    if !head.has(flag::PADDED) {
        return Ok((HEAD_LEN, frame.len()));
    }
    let bad = FrameError::Padding {
        kind: head.kind,
        stream: head.stream,
    };
    let pad = usize::from(*frame.get(HEAD_LEN).ok_or(bad)?);
    let start = HEAD_LEN + 1;
    let end = frame
        .len()
        .checked_sub(pad)
        .filter(|&e| e >= start)
        .ok_or(bad)?;
    Ok((start, end))
}

/// The increment of a WINDOW_UPDATE frame (header included), if it is well formed.
pub fn window_increment(frame: &[u8]) -> Option<u32> {
    let payload: &[u8; 4] = frame.get(HEAD_LEN..)?.try_into().ok()?;
    Some(u32::from_be_bytes(*payload) & 0x7fff_ffff)
}

/// The (identifier, value) pairs of a SETTINGS frame (header included); an ACK or
/// a malformed one has none the relay acts on.
pub fn settings<'a>(head: &FrameHead, frame: &'a [u8]) -> impl Iterator<Item = (u16, u32)> + 'a {
    let payload = if head.has(flag::ACK) || head.stream != 0 || head.len % 6 != 0 {
        &[][..]
    } else {
        frame.get(HEAD_LEN..).unwrap_or_default()
    };
    payload.chunks_exact(6).map(|s| {
        (
            u16::from_be_bytes([s[0], s[1]]),
            u32::from_be_bytes([s[2], s[3], s[4], s[5]]),
        )
    })
}

// === frames the relay writes ===

/// Appends a frame header.
pub fn put_head(dst: &mut BytesMut, len: usize, kind: u8, flags: u8, stream: u32) {
    dst.put_uint(len as u64, 3);
    dst.put_u8(kind);
    dst.put_u8(flags);
    dst.put_u32(stream);
}

/// Appends a WINDOW_UPDATE.
pub fn put_window_update(dst: &mut BytesMut, stream: u32, increment: u32) {
    put_head(dst, 4, kind::WINDOW_UPDATE, 0, stream);
    dst.put_u32(increment);
}

/// Appends an RST_STREAM.
pub fn put_rst_stream(dst: &mut BytesMut, stream: u32, reason: u32) {
    put_head(dst, 4, kind::RST_STREAM, 0, stream);
    dst.put_u32(reason);
}

/// Appends a GOAWAY.
pub fn put_goaway(dst: &mut BytesMut, last_stream: u32, reason: u32) {
    put_head(dst, 8, kind::GOAWAY, 0, 0);
    dst.put_u32(last_stream);
    dst.put_u32(reason);
}

/// `payload` as DATA frames of at most [`MIN_MAX_FRAME_SIZE`], END_STREAM on the
/// last: one `Bytes` per frame, each its own flow-control unit.
pub fn data_frames(stream: u32, payload: &Bytes, end_stream: bool) -> Vec<Bytes> {
    let mut frames = Vec::with_capacity(payload.len() / MIN_MAX_FRAME_SIZE + 1);
    let mut offset = 0;
    loop {
        let len = (payload.len() - offset).min(MIN_MAX_FRAME_SIZE);
        let last = offset + len == payload.len();
        let mut frame = BytesMut::with_capacity(HEAD_LEN + len);
        let flags = if last && end_stream {
            flag::END_STREAM
        } else {
            0
        };
        put_head(&mut frame, len, kind::DATA, flags, stream);
        frame.put_slice(&payload[offset..offset + len]);
        frames.push(frame.freeze());
        offset += len;
        if last {
            return frames;
        }
    }
}

/// Appends `block` (an encoded header block) as the HEADERS frame `first` was,
/// keeping its END_STREAM, with CONTINUATIONs past [`MIN_MAX_FRAME_SIZE`].
pub fn put_block(dst: &mut BytesMut, first: &FrameHead, block: &[u8]) {
    let mut rest = block;
    let mut kind = kind::HEADERS;
    let mut flags = first.flags & flag::END_STREAM;
    loop {
        let (chunk, after) = rest.split_at(rest.len().min(MIN_MAX_FRAME_SIZE));
        if after.is_empty() {
            flags |= flag::END_HEADERS;
        }
        put_head(dst, chunk.len(), kind, flags, first.stream);
        dst.put_slice(chunk);
        if after.is_empty() {
            return;
        }
        rest = after;
        kind = kind::CONTINUATION;
        flags = 0;
    }
}

/// Appends a trailers-only gRPC answer (`:status 200`, content type, status and
/// message) ending `stream`, its fields literals that leave the receiver's
/// dynamic table as it was: the relay's own header block must not make the
/// client's table part from the runtime's encoder.
pub fn put_status_headers(dst: &mut BytesMut, stream: u32, code: i32, message: &str) {
    let mut block = BytesMut::with_capacity(64 + message.len());
    let code = code.to_string();
    let message = crate::encode_grpc_message(message);
    for (name, value) in [
        (&b":status"[..], &b"200"[..]),
        (b"content-type", b"application/grpc"),
        (b"grpc-status", code.as_bytes()),
        (b"grpc-message", message.as_bytes()),
    ] {
        hpack::encode_literal(name, value, hpack::Indexing::Allowed, &mut block);
    }
    let head = FrameHead {
        len: 0,
        kind: kind::HEADERS,
        flags: flag::END_STREAM,
        stream,
    };
    put_block(dst, &head, &block);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> BytesMut {
        let mut out = BytesMut::new();
        put_head(&mut out, payload.len(), kind, flags, stream);
        out.put_slice(payload);
        out
    }

    #[test]
    fn frames_are_cut_whole_and_only_when_complete() {
        let mut input = frame(kind::DATA, 0, 1, b"hello");
        input.extend_from_slice(&frame(kind::DATA, flag::END_STREAM, 3, b"x")[..5]);
        let (head, first) = next_frame(&mut input).expect("first frame");
        assert_eq!((head.len, head.kind, head.stream), (5, kind::DATA, 1));
        assert_eq!(&first[HEAD_LEN..], b"hello");
        assert!(next_frame(&mut input).is_none());
        assert_eq!(input.len(), 5);
    }

    #[test]
    fn whole_frames_end_before_a_partial_one() {
        let mut input = frame(kind::HEADERS, 0, 1, b"abc");
        input.extend_from_slice(&frame(kind::DATA, 0, 1, b"hello"));
        let whole = input.len();
        assert_eq!(whole_frames_len(&input), whole);
        // A head alone, then a head that promises more than came.
        input.extend_from_slice(&frame(kind::DATA, 0, 3, b"xyz")[..HEAD_LEN + 1]);
        assert_eq!(whole_frames_len(&input), whole);
        assert_eq!(whole_frames_len(&input[..whole - 1]), HEAD_LEN + 3);
        assert_eq!(whole_frames_len(&input[..4]), 0);
        assert_eq!(whole_frames_len(&[]), 0);
    }

    #[test]
    fn padding_and_priority_are_skipped_and_checked() {
        let f = frame(
            kind::HEADERS,
            flag::PADDED | flag::PRIORITY,
            1,
            &[2, 0, 0, 0, 3, 9, 0xaa, 0, 0],
        );
        let head = FrameHead::parse(&f).expect("head");
        assert_eq!(&f[header_fragment(&head, &f).expect("fragment")], &[0xaa]);
        let f = frame(kind::DATA, flag::PADDED, 1, &[9, 1]);
        let head = FrameHead::parse(&f).expect("head");
        assert_eq!(
            data_payload(&head, &f),
            Err(FrameError::Padding {
                kind: kind::DATA,
                stream: 1
            })
        );
        let f = frame(kind::HEADERS, flag::PRIORITY, 1, &[0, 0]);
        let head = FrameHead::parse(&f).expect("head");
        assert_eq!(header_fragment(&head, &f), Err(FrameError::Priority(1)));
    }

    #[test]
    fn data_is_split_at_the_minimum_frame_size() {
        let payload = Bytes::from(vec![7u8; MIN_MAX_FRAME_SIZE + 10]);
        let frames = data_frames(5, &payload, true);
        assert_eq!(frames.len(), 2);
        let heads: Vec<_> = frames
            .iter()
            .map(|f| FrameHead::parse(f).expect("head"))
            .collect();
        assert_eq!((heads[0].len, heads[0].flags), (MIN_MAX_FRAME_SIZE, 0));
        assert_eq!((heads[1].len, heads[1].flags), (10, flag::END_STREAM));
        assert_eq!(data_frames(5, &Bytes::new(), true).len(), 1);
    }

    #[test]
    fn status_headers_decode_and_leave_the_table_alone() {
        let mut out = BytesMut::new();
        put_status_headers(&mut out, 3, 7, "tessera hook \"gpu\": 100% no");
        let (head, f) = next_frame(&mut out).expect("frame");
        assert!(head.has(flag::END_STREAM) && head.has(flag::END_HEADERS));
        let mut decoder = hpack::Decoder::new(DEFAULT_TABLE_SIZE);
        let mut fields = Vec::new();
        decoder
            .decode(
                &f[header_fragment(&head, &f).expect("fragment")],
                |n, v, _| fields.push((n.to_vec(), v.to_vec())),
            )
            .expect("decode");
        assert_eq!(fields[2], (b"grpc-status".to_vec(), b"7".to_vec()));
        assert_eq!(fields[3].1, b"tessera hook \"gpu\": 100%25 no".to_vec());
        // An indexed reference to the first dynamic entry still fails: nothing entered.
        assert!(decoder.decode(&[0xbe], |_, _, _| {}).is_err());
    }

    #[test]
    fn settings_are_read_unless_ack_or_malformed() {
        let f = frame(
            kind::SETTINGS,
            0,
            0,
            &[0, 4, 0, 1, 0, 0, 0, 1, 0, 0, 0x10, 0],
        );
        let head = FrameHead::parse(&f).expect("head");
        let read: Vec<_> = settings(&head, &f).collect();
        assert_eq!(
            read,
            [
                (setting::INITIAL_WINDOW_SIZE, 65_536),
                (setting::HEADER_TABLE_SIZE, 4096)
            ]
        );
        let f = frame(kind::SETTINGS, flag::ACK, 0, &[]);
        let head = FrameHead::parse(&f).expect("head");
        assert_eq!(settings(&head, &f).count(), 0);
    }
}
