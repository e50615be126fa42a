//! The Device CR annotation `tessera.io/nvlink-peers`: which GPUs of the node are
//! joined by an active NVLink, written by the reporter (from NVML) and read by the
//! scheduler, whose multi-GPU choice prefers NVLink pairs.
//!
//! ```json
//! {"GPU-a":["GPU-b"],"GPU-b":["GPU-a"],"GPU-c":["GPU-d"],"GPU-d":["GPU-c"]}
//! ```
//!
//! An annotation, not a field of `spec.devices[]`: the Device CRD is Koordinator's
//! (`scheduling.koordinator.sh/v1alpha1`), whose `topology` has no place for peers,
//! and a cluster that installs Koordinator's own CRD would prune an unknown field
//! (structural schema) without a word. An annotation under `tessera.io/` survives
//! either CRD and means nothing to Koordinator's tools.
//!
//! A link joins two GPUs both ways: a link listed on one side only is read as
//! listed on both. Malformed text is refused whole (nothing in it is trusted);
//! peers that name no GPU of the node are left to the reader
//! ([`NvlinkPeers::retain_known`]).

use std::collections::{BTreeMap, BTreeSet};

use crate::resources::NVLINK_PEERS;

/// What is wrong with the annotation's value, and where.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NvlinkPeersError {
    /// Not a JSON object of GPU UUIDs to lists of GPU UUIDs.
    #[error(
        "annotation {NVLINK_PEERS}: expected a JSON object of GPU UUID to a list of peer GPU UUIDs: {0}"
    )]
    Json(String),
    /// A GPU or a peer is not a GPU UUID.
    #[error("annotation {NVLINK_PEERS}: {path}: expected a GPU UUID (GPU-…), got {value:?}")]
    NotAUuid {
        /// Where, e.g. `["GPU-a"][1]`.
        path: String,
        /// What was found.
        value: String,
    },
    /// A GPU named as its own peer.
    #[error("annotation {NVLINK_PEERS}: {path}: {uuid} names itself as its NVLink peer")]
    SelfLink {
        /// Where, e.g. `["GPU-a"][0]`.
        path: String,
        /// The GPU.
        uuid: String,
    },
}

/// The NVLinks between a node's GPUs, both ways.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NvlinkPeers {
    peers: BTreeMap<String, BTreeSet<String>>,
}

fn is_gpu_uuid(text: &str) -> bool {
    text.len() > "GPU-".len()
        && text.starts_with("GPU-")
        && text.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
}

impl NvlinkPeers {
    /// Records an NVLink between `a` and `b` (both ways). A GPU is not its own
    /// peer: `a == b` records nothing.
    pub fn link(&mut self, a: &str, b: &str) {
        if a == b {
            return;
        }
        self.peers
            .entry(a.to_owned())
            .or_default()
            .insert(b.to_owned());
        self.peers
            .entry(b.to_owned())
            .or_default()
            .insert(a.to_owned());
    }

    /// The GPUs `uuid` has an NVLink to, in UUID order.
    pub fn peers_of(&self, uuid: &str) -> impl Iterator<Item = &str> {
        self.peers
            .get(uuid)
            .into_iter()
            .flatten()
            .map(String::as_str)
    }

    /// Whether no GPU has a peer.
    pub fn is_empty(&self) -> bool {
        self.peers.is_empty()
    }

    /// Drops every link with a GPU not in `known` (the node's GPUs); returns the
    /// UUIDs dropped. Such a link can be part of no placement on the node, so
    /// dropping it changes no choice, while the node's real links stay usable.
    pub fn retain_known(&mut self, known: &BTreeSet<&str>) -> BTreeSet<String> {
        let mut dropped = BTreeSet::new();
        self.peers.retain(|gpu, peers| {
            if !known.contains(gpu.as_str()) {
                dropped.insert(gpu.clone());
                return false;
            }
            peers.retain(|peer| {
                let keep = known.contains(peer.as_str());
                if !keep {
                    dropped.insert(peer.clone());
                }
                keep
            });
            !peers.is_empty()
        });
        dropped
    }

    /// The annotation's value: a JSON object, GPUs and peers in UUID order, only
    /// GPUs with a peer (`{}` when there are none).
    pub fn encode(&self) -> String {
        serde_json::to_string(&self.peers).unwrap_or_else(|_| "{}".to_owned())
    }

    /// Reads the annotation's value; refuses it whole when malformed.
    pub fn decode(text: &str) -> Result<Self, NvlinkPeersError> {
        let raw: BTreeMap<String, Vec<String>> =
            serde_json::from_str(text).map_err(|e| NvlinkPeersError::Json(e.to_string()))?;
        let mut links = Self::default();
        for (gpu, peers) in &raw {
            if !is_gpu_uuid(gpu) {
                return Err(NvlinkPeersError::NotAUuid {
                    path: format!("{gpu:?}"),
                    value: gpu.clone(),
                });
            }
            for (index, peer) in peers.iter().enumerate() {
                let path = format!("[{gpu:?}][{index}]");
                if !is_gpu_uuid(peer) {
                    return Err(NvlinkPeersError::NotAUuid {
                        path,
                        value: peer.clone(),
                    });
                }
                if peer == gpu {
                    return Err(NvlinkPeersError::SelfLink {
                        path,
                        uuid: gpu.clone(),
                    });
                }
                links.link(gpu, peer);
            }
        }
        Ok(links)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn two_pairs() -> NvlinkPeers {
        let mut links = NvlinkPeers::default();
        links.link("GPU-a", "GPU-b");
        links.link("GPU-d", "GPU-c");
        links
    }

    #[test]
    fn encodes_both_ways_in_uuid_order() {
        assert_eq!(
            two_pairs().encode(),
            r#"{"GPU-a":["GPU-b"],"GPU-b":["GPU-a"],"GPU-c":["GPU-d"],"GPU-d":["GPU-c"]}"#
        );
        assert_eq!(NvlinkPeers::default().encode(), "{}");
        let mut itself = NvlinkPeers::default();
        itself.link("GPU-a", "GPU-a");
        assert!(itself.is_empty());
    }

    #[test]
    fn round_trips() {
        let links = two_pairs();
        assert_eq!(NvlinkPeers::decode(&links.encode()), Ok(links.clone()));
        assert_eq!(links.peers_of("GPU-c").collect::<Vec<_>>(), ["GPU-d"]);
        assert_eq!(links.peers_of("GPU-x").count(), 0);
    }

    #[test]
    fn a_link_listed_on_one_side_joins_both() {
        let links = NvlinkPeers::decode(r#"{"GPU-a":["GPU-b","GPU-c"]}"#).expect("valid");
        assert_eq!(links.peers_of("GPU-b").collect::<Vec<_>>(), ["GPU-a"]);
        assert_eq!(links.peers_of("GPU-c").collect::<Vec<_>>(), ["GPU-a"]);
    }

    #[test]
    fn malformed_values_are_refused_naming_where() {
        let refused = |text: &str| NvlinkPeers::decode(text).expect_err(text).to_string();
        assert!(
            refused(r#"["GPU-a","GPU-b"]"#).starts_with(
                "annotation tessera.io/nvlink-peers: expected a JSON object of GPU UUID to a list of peer GPU UUIDs: "
            ),
            "{}",
            refused(r#"["GPU-a","GPU-b"]"#)
        );
        assert!(refused(r#"{"GPU-a":"GPU-b"}"#).contains("expected a JSON object"));
        assert!(refused("not json").contains("expected a JSON object"));
        assert_eq!(
            refused(r#"{"GPU-a":["GPU-b",""]}"#),
            r#"annotation tessera.io/nvlink-peers: ["GPU-a"][1]: expected a GPU UUID (GPU-…), got """#
        );
        assert_eq!(
            refused(r#"{"0":["GPU-b"]}"#),
            r#"annotation tessera.io/nvlink-peers: "0": expected a GPU UUID (GPU-…), got "0""#
        );
        assert_eq!(
            refused(r#"{"GPU-a":["GPU-a"]}"#),
            r#"annotation tessera.io/nvlink-peers: ["GPU-a"][0]: GPU-a names itself as its NVLink peer"#
        );
    }

    #[test]
    fn links_to_gpus_the_node_lacks_are_dropped_and_named() {
        let mut links = two_pairs();
        links.link("GPU-a", "GPU-gone");
        links.link("GPU-gone", "GPU-elsewhere");
        let dropped = links.retain_known(&BTreeSet::from(["GPU-a", "GPU-b", "GPU-c"]));
        assert_eq!(
            dropped,
            BTreeSet::from([
                "GPU-d".to_owned(),
                "GPU-elsewhere".to_owned(),
                "GPU-gone".to_owned()
            ])
        );
        let mut want = NvlinkPeers::default();
        want.link("GPU-a", "GPU-b");
        assert_eq!(links, want);
    }

    proptest! {
        /// Whatever links are recorded, the text decodes to the same links.
        #[test]
        fn any_links_round_trip(pairs in proptest::collection::vec((0u8..12, 0u8..12), 0..20)) {
            let mut links = NvlinkPeers::default();
            for (a, b) in pairs {
                links.link(&format!("GPU-{a:02x}"), &format!("GPU-{b:02x}"));
            }
            prop_assert_eq!(NvlinkPeers::decode(&links.encode()), Ok(links));
        }

        /// No text makes decoding panic.
        #[test]
        fn decoding_never_panics(text in ".{0,64}") {
            let _ = NvlinkPeers::decode(&text);
        }
    }
}
