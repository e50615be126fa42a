//! Header blocks as the relay reads them: HEADERS and CONTINUATION frames
//! gathered per stream, decoded only for a call's method and status.

use super::*;

/// The fields of a header block the relay acts on.
#[derive(Debug, Default)]
pub struct Fields {
    /// `:path`: the gRPC method.
    pub path: Option<String>,
    /// `grpc-timeout`, when it parses.
    pub timeout: Option<Duration>,
    /// `grpc-status`.
    pub status: Option<Code>,
    /// `grpc-message`, percent-decoded.
    pub message: Option<String>,
    /// `:path` names a lifecycle call.
    pub lifecycle: bool,
    /// A request of a lifecycle call that names its body's length, which the
    /// hooks may change: it is sent re-encoded without it ([`HeaderBlocks::reencoded`]).
    pub lifecycle_content_length: bool,
    /// The block changed the dynamic table.
    pub changed_table: bool,
}

/// A header block whose CONTINUATIONs have not all come.
#[derive(Debug)]
pub(super) struct Block {
    pub(super) stream: u32,
    /// The flags of its HEADERS frame (END_STREAM).
    pub(super) flags: u8,
    pub(super) fragments: Vec<u8>,
}

/// One side's header block reader: its decoder and any block still open. Pure:
/// fuzzed (`runtime-proxy/fuzz`, `relay_frames`).
#[derive(Debug)]
pub struct HeaderBlocks {
    pub(super) decoder: hpack::Decoder,
    pub(super) open: Option<Block>,
    /// The last block as literals that leave the receiver's table alone, without
    /// a lifecycle call's `content-length`.
    pub(super) encoded: BytesMut,
    /// Requests: blocks are re-encoded as they are decoded, for when they must be.
    pub(super) reencode: bool,
    /// A re-encoded block changed the sender's table but not the receiver's:
    /// every block from now on goes re-encoded.
    pub diverged: bool,
}

/// What to do with a frame after reading it.
#[derive(Debug)]
pub enum Step {
    /// Pass it on.
    Forward,
    /// Pass it on; a whole header block ended with it.
    Block(FrameHead, Fields),
    /// Pass it on, then read nothing more from this side: the receiver fails the
    /// connection on it exactly as it would have without the relay.
    Fatal,
}

impl HeaderBlocks {
    /// A reader of a new connection's answers: an empty table of the default size.
    pub fn answers() -> Self {
        Self {
            decoder: hpack::Decoder::new(frame::DEFAULT_TABLE_SIZE),
            open: None,
            encoded: BytesMut::new(),
            reencode: false,
            diverged: false,
        }
    }

    /// A reader of a new connection's requests, which also re-encodes each block
    /// ([`HeaderBlocks::reencoded`]).
    pub fn requests() -> Self {
        Self {
            reencode: true,
            ..Self::answers()
        }
    }

    /// Whether no header block is open: the relay's own frames may go in here.
    pub fn at_boundary(&self) -> bool {
        self.open.is_none()
    }

    /// Reads HEADERS and CONTINUATION frames; everything else is [`Step::Forward`],
    /// or [`Step::Fatal`] inside a header block.
    /// Reads one whole frame (header included). `max_table` is the largest
    /// SETTINGS_HEADER_TABLE_SIZE the decoding side advertised.
    pub fn read(&mut self, head: &FrameHead, frame: &[u8], max_table: usize) -> Step {
        let is_header = matches!(head.kind, kind::HEADERS | kind::CONTINUATION);
        match (&mut self.open, head.kind) {
            (None, kind::CONTINUATION) => return Step::Fatal,
            (None, _) if !is_header => return Step::Forward,
            (Some(open), kind::CONTINUATION) if open.stream == head.stream => {
                open.fragments.extend_from_slice(&frame[frame::HEAD_LEN..]);
            }
            (Some(_), _) => return Step::Fatal,
            (None, _) => {
                let Ok(range) = frame::header_fragment(head, frame) else {
                    return Step::Fatal;
                };
                if head.stream == 0 {
                    return Step::Fatal;
                }
                if !head.has(flag::END_HEADERS) {
                    self.open = Some(Block {
                        stream: head.stream,
                        flags: head.flags,
                        fragments: frame[range].to_vec(),
                    });
                    return Step::Forward;
                }
                return self.decode(*head, &frame[range], max_table);
            }
        }
        if !head.has(flag::END_HEADERS) {
            return Step::Forward;
        }
        let Some(open) = self.open.take() else {
            return Step::Fatal;
        };
        let first = FrameHead {
            len: 0,
            kind: kind::HEADERS,
            flags: open.flags,
            stream: open.stream,
        };
        self.decode(first, &open.fragments, max_table)
    }

    /// The last block re-encoded as literals: the same header list, without a
    /// lifecycle call's `content-length`, and no change to the receiver's table.
    /// Only blocks that may need it are re-encoded: a lifecycle call's request,
    /// and every block once [`HeaderBlocks::diverged`]; for others it is empty.
    pub fn reencoded(&self) -> &[u8] {
        &self.encoded
    }

    pub(super) fn decode(&mut self, head: FrameHead, block: &[u8], max_table: usize) -> Step {
        self.decoder.set_max_allowed(max_table);
        let changes = self.decoder.table_changes();
        let mut fields = Fields::default();
        let mut lifecycle = false;
        // Encoded as it is decoded while it may be needed (a block decodes once:
        // its table changes): until `:path` says the call is no lifecycle call,
        // unless blocks are already re-encoded. Pseudo-fields come first, so
        // that is after a few fields.
        let mut reencode = self.reencode;
        let diverged = self.diverged;
        let encoded = &mut self.encoded;
        encoded.clear();
        let decoded = self.decoder.decode(block, |name, value, indexing| {
            if name == b":path" {
                let path = String::from_utf8_lossy(value).into_owned();
                lifecycle = Method::from_path(&path).is_some();
                if !(lifecycle || diverged) {
                    reencode = false;
                    encoded.clear();
                }
                fields.path = Some(path);
            }
            if name == b"content-length" && lifecycle {
                fields.lifecycle_content_length = true;
            } else if reencode {
                hpack::encode_literal(name, value, indexing, encoded);
            }
            match name {
                b"grpc-timeout" => {
                    fields.timeout = std::str::from_utf8(value)
                        .ok()
                        .and_then(|v| crate::grpc::parse_timeout(v).ok());
                }
                b"grpc-status" => {
                    fields.status = std::str::from_utf8(value)
                        .ok()
                        .and_then(|v| v.parse::<i32>().ok())
                        .map(Code::from_i32);
                }
                b"grpc-message" => {
                    let value = String::from_utf8_lossy(value);
                    fields.message = Some(
                        percent_encoding::percent_decode_str(&value)
                            .decode_utf8_lossy()
                            .into_owned(),
                    );
                }
                _ => {}
            }
        });
        fields.lifecycle = lifecycle;
        fields.changed_table = self.decoder.table_changes() != changes;
        match decoded {
            Ok(()) => Step::Block(head, fields),
            Err(error) => {
                tracing::debug!(stream = head.stream, %error, "header block does not decode; the receiver fails the connection on it");
                Step::Fatal
            }
        }
    }
}
