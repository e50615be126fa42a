//! `tessera.hook.v1`, the protocol between the runtime proxy and external hook
//! servers (see `proto/tessera/hook/v1/hook.proto`, documented field by field),
//! and the CRI v1 types, re-exported from `k8s-cri`.
//!
//! The Rust code is generated in `build.rs` from the .proto with protoc. Beside
//! it: the CRI lifecycle calls a proxy intercepts and its in-process hook trait
//! ([`lifecycle`]), the CRI ↔ `tessera.hook.v1` conversions ([`convert`]),
//! applying and merging a hook's container edits ([`edit`]), and serving a
//! container hook ([`server`]).

pub mod convert;
pub mod edit;
pub mod lifecycle;
pub mod server;

/// CRI v1 types and services.
pub use k8s_cri::v1 as cri;

/// The hook protocol.
pub mod hook {
    /// Version 1.
    #[allow(
        missing_docs,
        missing_debug_implementations,
        clippy::all,
        clippy::pedantic,
        unused_qualifications
    )]
    pub mod v1 {
        tonic::include_proto!("tessera.hook.v1");
    }
}
