//! HTTP/2 at the wire, below both serving paths: frames cut and written (RFC 9113
//! §4, §6) and HPACK header blocks decoded (RFC 7541). The frame relay carries
//! kubelet's frames with them; the h2 path's `:authority` shim (`authority`) reads
//! kubelet's first HEADERS with them before h2 sees it.

pub mod frame;
pub mod hpack;
