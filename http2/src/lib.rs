//! HTTP/2 at the wire, below Tessera's node gRPC servers: frames cut and written
//! (RFC 9113 §4, §6), HPACK header blocks decoded (RFC 7541), and the pass
//! ([`authority::KubeletStream`]) that lets h2 serve kubelet, which sends a unix
//! socket's path as `:authority` on some of its connections (CRI before 1.31,
//! the plugin watcher's `GetInfo` still in 1.36). The runtime proxy's frame relay
//! and h2 path, and the kubelet DRA plugin, use them.

pub mod authority;
pub mod frame;
pub mod hpack;

use percent_encoding::{AsciiSet, CONTROLS, utf8_percent_encode};

/// Characters grpc-message must percent-encode (gRPC spec: outside 0x20..=0x7E, and '%').
const GRPC_MESSAGE: &AsciiSet = &CONTROLS.add(b'%');

/// `message` as a `grpc-message` value: percent-encoded where gRPC says.
pub fn encode_grpc_message(message: &str) -> String {
    utf8_percent_encode(message, GRPC_MESSAGE).to_string()
}
