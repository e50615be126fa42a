//! The runtime proxy's proof that kubelet calls through it: written by
//! tessera-runtime-proxy to `<enforcement-dir>/`[`KUBELET_SEEN_FILE`], read by
//! tessera-reporter, which marks the node unproven (no GPU pod goes there) while
//! the proof is missing or stale.
//!
//! The taint `tessera.io/runtime-proxy` marks a switch in progress, but a node
//! that never carried it (registered without it, or its taint removed by hand)
//! would take GPU pods with no GPU hook in its runtime path, where an image's
//! `NVIDIA_VISIBLE_DEVICES=all` gets every GPU. So the node must also show, all
//! the time, that kubelet itself is connected to the proxy and runtime calls go
//! through it: the proxy names the process at the other end of each connection
//! (its peer credentials), counts those of kubelet, and notes its last
//! `RuntimeService` call (kubelet makes one every few seconds: `Status` every 5 s,
//! `ListPodSandbox` every second), so a kubelet whose image service alone is the
//! proxy does not count.

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
    /// When the proxy last forwarded a `RuntimeService` call (seconds since the
    /// epoch; absent before the first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_call_at: Option<u64>,
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
    /// Written after now: the clock was stepped back since, and a live proxy
    /// would have written again within a heartbeat.
    #[error(
        "tessera-runtime-proxy wrote {KUBELET_SEEN_FILE} {ahead} s in the future (the clock was stepped back, and the proxy has not written since)"
    )]
    Future {
        /// Seconds the file's time is ahead of now.
        ahead: u64,
    },
    /// kubelet is connected, but no runtime call has come through the proxy
    /// for a while: its runtime endpoint is another (the image endpoint alone is
    /// the proxy).
    #[error(
        "kubelet is connected to tessera-runtime-proxy, but no runtime call came through it in the last {MAX_AGE_SECS} s (is kubelet's runtime endpoint another, its image endpoint alone the proxy?)"
    )]
    NoRuntimeCalls,
}

impl Unproven {
    /// Which case this is, without its figures: a stale file's age grows every
    /// second, and is still the same finding.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Missing => "missing",
            Self::Unreadable(_) => "unreadable",
            Self::NotConnected => "not-connected",
            Self::Stale { .. } => "stale",
            Self::Future { .. } => "future",
            Self::NoRuntimeCalls => "no-runtime-calls",
        }
    }
}

impl KubeletSeen {
    /// Whether the file's text (`None`: no file) proves, at `now` (seconds since
    /// the epoch), that kubelet calls the runtime through the proxy.
    pub fn proves(text: Option<&str>, now: u64) -> Result<Self, Unproven> {
        let text = text.ok_or(Unproven::Missing)?;
        let seen: Self =
            serde_json::from_str(text).map_err(|e| Unproven::Unreadable(e.to_string()))?;
        // A live proxy writes every heartbeat, with the clock as it is then.
        let ahead = seen.at.saturating_sub(now);
        if ahead > 2 * HEARTBEAT_SECS {
            return Err(Unproven::Future { ahead });
        }
        let age = now.saturating_sub(seen.at);
        if age > MAX_AGE_SECS {
            return Err(Unproven::Stale { age });
        }
        if seen.connections == 0 {
            return Err(Unproven::NotConnected);
        }
        // Both times are the proxy's clock.
        let quiet = seen
            .runtime_call_at
            .map_or(u64::MAX, |call| seen.at.saturating_sub(call));
        if quiet > MAX_AGE_SECS {
            return Err(Unproven::NoRuntimeCalls);
        }
        Ok(seen)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_file_with_a_kubelet_connection_and_runtime_calls_proves_the_switch() {
        let text = r#"{"connections":1,"runtime_call_at":995,"pid":812,"at":1000}"#;
        let seen = KubeletSeen::proves(Some(text), 1000 + MAX_AGE_SECS).expect("proven");
        assert_eq!(seen.pid, Some(812));
        // A clock stepped back less than two heartbeats: still fresh.
        assert!(KubeletSeen::proves(Some(text), 1000 - 2 * HEARTBEAT_SECS).is_ok());
    }

    #[test]
    fn missing_stale_unconnected_quiet_or_garbled_is_unproven() {
        let proves = |text: &str, now| KubeletSeen::proves(Some(text), now);
        assert_eq!(KubeletSeen::proves(None, 5), Err(Unproven::Missing));
        assert_eq!(
            proves(
                r#"{"connections":0,"runtime_call_at":1000,"at":1000}"#,
                1001
            ),
            Err(Unproven::NotConnected)
        );
        // Stale wins over connected: a proxy killed while kubelet was connected.
        assert_eq!(
            proves(
                r#"{"connections":2,"runtime_call_at":1000,"at":1000}"#,
                1061
            ),
            Err(Unproven::Stale { age: 61 })
        );
        // A proxy that died before the clock was stepped back an hour.
        assert_eq!(
            proves(
                r#"{"connections":1,"runtime_call_at":1000,"at":4600}"#,
                1000
            ),
            Err(Unproven::Future { ahead: 3600 })
        );
        // kubelet's image endpoint alone is the proxy: connected, no runtime call.
        assert_eq!(
            proves(r#"{"connections":1,"at":1000}"#, 1000),
            Err(Unproven::NoRuntimeCalls)
        );
        assert_eq!(
            proves(r#"{"connections":1,"runtime_call_at":900,"at":1000}"#, 1000),
            Err(Unproven::NoRuntimeCalls)
        );
        let error = proves("connections=1", 1000).expect_err("garbled");
        assert!(
            matches!(error, Unproven::Unreadable(_)),
            "garbled text: {error}"
        );
        assert!(
            Unproven::Stale { age: 61 }
                .to_string()
                .contains("61 s ago (more than 60 s)")
        );
        // The same finding, whatever its figures.
        assert_eq!(
            Unproven::Stale { age: 61 }.kind(),
            Unproven::Stale { age: 3000 }.kind()
        );
    }
}
