//! The harness's unix-socket connector. The proxy has its own; the harness stays
//! free of product crates, so a test client never shares code with what it tests.

use std::path::Path;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;

/// Connects to a unix socket, wrapped for hyper and tonic.
pub async fn connect(path: &Path) -> std::io::Result<TokioIo<UnixStream>> {
    UnixStream::connect(path).await.map(TokioIo::new)
}
