//! The runtime proxy's proof that kubelet calls through it: written by
//! tessera-runtime-proxy to `<enforcement-dir>/`[`KUBELET_SEEN_FILE`], read by
//! tessera-reporter, which marks the node unproven (no GPU pod goes there) while
//! the proof is missing or stale.
//!
//! The taint `tessera.io/runtime-proxy` marks a switch in progress, but a node
//! that never carried it (registered without it, or its taint removed by hand)
//! would take GPU pods with no GPU hook in its runtime path, where an image's
//! `NVIDIA_VISIBLE_DEVICES=all` gets every GPU. So the node must also show, all
//! the time, that kubelet itself is connected to the proxy: the proxy names the
//! process at the other end of each connection (its peer credentials), and counts
//! those of kubelet.

use serde::{Deserialize, Serialize};

/// The file's name in the proxy's `--enforcement-dir`.
pub const KUBELET_SEEN_FILE: &str = "kubelet";

/// How often the proxy rewrites the file while it runs, in seconds.
pub const HEARTBEAT_SECS: u64 = 10;

/// Older than this (six heartbeats), the proof no longer counts: the proxy that
/// wrote it is gone.
pub const MAX_AGE_SECS: u64 = 60;

/// What the proxy writes: kubelet's open connections to it, as of `at`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KubeletSeen {
    /// kubelet's connections open now.
    pub connections: u32,
    /// The process of the last kubelet connection (host PID), for the operator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    /// When the proxy wrote this, in seconds since the Unix epoch.
    pub at: u64,
}

/// Why the proof does not hold; the message says it for the reporter's log.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unproven {
    /// No file: no proxy has run on this node since boot (or it cannot write there).
    #[error("no {KUBELET_SEEN_FILE} file from tessera-runtime-proxy: the proxy has not run here")]
    Missing,
    /// The file is not what the proxy writes.
    #[error("{KUBELET_SEEN_FILE} file not understood: {0}")]
    Unreadable(String),
    /// The proxy runs, but kubelet is not connected to it.
    #[error("kubelet is not connected to tessera-runtime-proxy (it calls the runtime another way)")]
    NotConnected,
    /// The proxy stopped writing: it is gone.
    #[error(
        "tessera-runtime-proxy last wrote {KUBELET_SEEN_FILE} {age} s ago (more than {MAX_AGE_SECS} s): it no longer runs"
    )]
    Stale {
        /// Seconds since the proxy last wrote the file.
        age: u64,
    },
}

impl KubeletSeen {
    /// Whether the file's text (`None`: no file) proves, at `now` (seconds since
    /// the epoch), that kubelet calls the runtime through the proxy.
    pub fn proves(text: Option<&str>, now: u64) -> Result<Self, Unproven> {
        let text = text.ok_or(Unproven::Missing)?;
        let seen: Self =
            serde_json::from_str(text).map_err(|e| Unproven::Unreadable(e.to_string()))?;
        // A clock stepped back makes a future `at`: that is fresh, not stale.
        let age = now.saturating_sub(seen.at);
        if age > MAX_AGE_SECS {
            return Err(Unproven::Stale { age });
        }
        if seen.connections == 0 {
            return Err(Unproven::NotConnected);
        }
        Ok(seen)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_file_with_a_kubelet_connection_proves_the_switch() {
        let text = r#"{"connections":1,"pid":812,"at":1000}"#;
        let seen = KubeletSeen::proves(Some(text), 1000 + MAX_AGE_SECS).expect("proven");
        assert_eq!(seen.pid, Some(812));
        // A clock stepped back: still fresh.
        assert!(KubeletSeen::proves(Some(text), 900).is_ok());
    }

    #[test]
    fn missing_stale_unconnected_or_garbled_is_unproven() {
        assert_eq!(KubeletSeen::proves(None, 5), Err(Unproven::Missing));
        assert_eq!(
            KubeletSeen::proves(Some(r#"{"connections":0,"at":1000}"#), 1001),
            Err(Unproven::NotConnected)
        );
        // Stale wins over connected: a proxy killed while kubelet was connected.
        assert_eq!(
            KubeletSeen::proves(Some(r#"{"connections":2,"at":1000}"#), 1061),
            Err(Unproven::Stale { age: 61 })
        );
        let error = KubeletSeen::proves(Some("connections=1"), 1000).expect_err("garbled");
        assert!(
            matches!(error, Unproven::Unreadable(_)),
            "garbled text: {error}"
        );
        assert!(
            Unproven::Stale { age: 61 }
                .to_string()
                .contains("61 s ago (more than 60 s)")
        );
    }
}
