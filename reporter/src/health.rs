//! GPU health from NVML XID critical-error events.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;

/// XIDs caused by applications, not the GPU; the NVIDIA device plugin ignores them too.
pub const APPLICATION_XIDS: &[u64] = &[13, 31, 43, 45, 68, 109];

/// An XID critical error on a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XidEvent {
    /// The GPU's UUID.
    pub uuid: String,
    /// The XID.
    pub xid: u64,
}

/// Which GPUs are unhealthy, since when, and their last critical XID.
#[derive(Debug, Clone)]
pub struct HealthTracker {
    unhealthy: BTreeMap<String, (Instant, u64)>,
    recovery_after: Duration,
}

impl HealthTracker {
    /// A GPU is healthy again `recovery_after` after its last critical XID.
    pub fn new(recovery_after: Duration) -> Self {
        Self {
            unhealthy: BTreeMap::new(),
            recovery_after,
        }
    }

    /// Records an event; returns whether health changed.
    pub fn on_xid(&mut self, event: &XidEvent, now: Instant) -> bool {
        if APPLICATION_XIDS.contains(&event.xid) {
            return false;
        }
        self.unhealthy
            .insert(event.uuid.clone(), (now, event.xid))
            .is_none()
    }

    /// Marks GPUs healthy whose last critical XID is old enough; returns whether any recovered.
    pub fn recover(&mut self, now: Instant) -> bool {
        let before = self.unhealthy.len();
        let after = self.recovery_after;
        self.unhealthy
            .retain(|_, (since, _)| now.duration_since(*since) < after);
        self.unhealthy.len() != before
    }

    /// The unhealthy GPUs' UUIDs.
    pub fn unhealthy(&self) -> BTreeSet<String> {
        self.unhealthy.keys().cloned().collect()
    }

    /// The unhealthy GPUs' UUIDs, each with its last critical XID.
    pub fn unhealthy_xids(&self) -> BTreeMap<String, u64> {
        self.unhealthy
            .iter()
            .map(|(uuid, (_, xid))| (uuid.clone(), *xid))
            .collect()
    }
}

/// Watches XID critical errors on every GPU from a thread (NVML's wait blocks),
/// sending each to `events` until `stop` is set. Returns the thread.
pub fn watch_xids(
    nvml: Arc<Nvml>,
    events: tokio::sync::mpsc::UnboundedSender<XidEvent>,
    stop: Arc<AtomicBool>,
) -> Result<std::thread::JoinHandle<()>, NvmlError> {
    let thread = std::thread::Builder::new()
        .name("xid-watch".into())
        .spawn(move || {
            let result = (|| -> Result<(), NvmlError> {
                let mut set = nvml.create_event_set()?;
                for index in 0..nvml.device_count()? {
                    let device = nvml.device_by_index(index)?;
                    set = device
                        .register_events(EventTypes::CRITICAL_XID_ERROR, set)
                        .map_err(|e| e.error)?;
                }
                while !stop.load(Ordering::Relaxed) {
                    match set.wait(1000) {
                        Ok(data) => {
                            let uuid = data.device.uuid()?;
                            // An unknown XID is treated as critical (999 is NVIDIA's "unknown" code).
                            let xid = match data.event_data {
                                Some(XidError::Value(xid)) => xid,
                                Some(XidError::Unknown) | None => 999,
                            };
                            tracing::warn!(%uuid, xid, "XID critical error");
                            if events.send(XidEvent { uuid, xid }).is_err() {
                                return Ok(());
                            }
                        }
                        Err(NvmlError::Timeout) => {}
                        Err(error) => return Err(error),
                    }
                }
                Ok(())
            })();
            if let Err(error) = result {
                tracing::error!(%error, "XID watch stopped; GPU health is no longer tracked");
            }
        });
    // A thread that cannot be spawned leaves health untracked: say so as an NVML-level error.
    thread.map_err(|_| NvmlError::Unknown)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn critical_xids_mark_unhealthy_until_recovery() {
        let mut tracker = HealthTracker::new(Duration::from_secs(60));
        let t0 = Instant::now();
        assert!(
            !tracker.on_xid(
                &XidEvent {
                    uuid: "GPU-1".into(),
                    xid: 13
                },
                t0
            ),
            "application XID ignored"
        );
        assert!(tracker.on_xid(
            &XidEvent {
                uuid: "GPU-1".into(),
                xid: 79
            },
            t0
        ));
        assert!(
            !tracker.on_xid(
                &XidEvent {
                    uuid: "GPU-1".into(),
                    xid: 48
                },
                t0
            ),
            "already unhealthy"
        );
        assert_eq!(tracker.unhealthy(), BTreeSet::from(["GPU-1".to_owned()]));
        assert_eq!(
            tracker.unhealthy_xids(),
            BTreeMap::from([("GPU-1".to_owned(), 48)]),
            "the last critical XID"
        );
        assert!(!tracker.recover(t0 + Duration::from_secs(30)));
        assert!(tracker.recover(t0 + Duration::from_secs(61)));
        assert!(tracker.unhealthy().is_empty());
    }
}
