//! `--candidates`: filter answers the nodes that score best for the pod's GPUs,
//! the first among equals in kube-scheduler's order; the rest fit and are left
//! out, while the nodes that do not fit keep their reasons.

use super::fixtures::{GIB, args, extender_with, healthy_device, share_pod};
use super::*;
use tessera_allocator::allocate::{GpuShare, Placement};

/// An extender over `nodes` (one 16 GiB GPU each), `busy` of them with 50 %
/// of their GPU booked, answering `candidates` nodes under `node_policy`.
fn cluster(nodes: &[&str], busy: &[&str], candidates: usize, node_policy: Policy) -> Extender {
    let mut ledger = Ledger::default();
    for node in nodes {
        let device = healthy_device(node, 1);
        ledger.apply_device(&serde_json::from_value(device).expect("device"));
    }
    for node in busy {
        let share = GpuShare {
            uuid: format!("GPU-{node}-0"),
            minor: 0,
            core: 50,
            memory: 8 * GIB,
            ratio: 0,
        };
        let placement = Placement {
            gpus: vec![share],
            group: None,
        };
        ledger.reserve(&format!("other-{node}"), node, placement, u64::MAX);
    }
    let config = ExtenderConfig {
        candidates,
        node_policy,
        ..ExtenderConfig::default()
    };
    extender_with(ledger, config)
}

fn answered(extender: &Extender, percent: u32, nodes: &[&str]) -> ExtenderFilterResult {
    extender.filter(args(&share_pod("p", percent), nodes))
}

#[test]
fn by_default_filter_answers_the_best_node_alone_and_holds_it() {
    assert_eq!(CANDIDATES, 1);
    let nodes = ["n3", "n1", "n2"];
    let extender = cluster(&nodes, &["n1"], CANDIDATES, Policy::Binpack);
    // Binpack: the node already half full scores best.
    let result = answered(&extender, 30, &nodes);
    assert_eq!(result.node_names, Some(vec!["n1".to_owned()]));
    assert!(result.failed_nodes.is_empty() && result.failed_and_unresolvable_nodes.is_empty());
    // kube-scheduler binds it without prioritize: filter held its GPUs for the bind.
    assert_eq!(extender.ledger().tentative_node("p"), Some("n1"));
    // Spread: the empty nodes tie; the first in kube-scheduler's order wins.
    let spread = cluster(&nodes, &["n1"], CANDIDATES, Policy::Spread);
    let result = answered(&spread, 30, &nodes);
    assert_eq!(result.node_names, Some(vec!["n3".to_owned()]));
}

#[test]
fn more_candidates_keep_the_best_in_kube_schedulers_order() {
    let nodes = ["n3", "n2", "n1", "n4"];
    let extender = cluster(&nodes, &["n1", "n4"], 3, Policy::Binpack);
    // n1 and n4 score best; of the empty ones, n3 comes first.
    let result = answered(&extender, 30, &nodes);
    assert_eq!(
        result.node_names,
        Some(vec!["n3".to_owned(), "n1".to_owned(), "n4".to_owned()])
    );
    // 0: every node that fits.
    let every = cluster(&nodes, &["n1", "n4"], 0, Policy::Binpack);
    assert_eq!(
        answered(&every, 30, &nodes).node_names.map(|n| n.len()),
        Some(4)
    );
}

#[test]
fn nodes_that_do_not_fit_keep_their_reasons_whatever_is_answered() {
    let nodes = ["n1", "n2", "n3"];
    let extender = cluster(&nodes, &["n1", "n2"], 1, Policy::Binpack);
    // 60 % fits only the empty n3; the busy ones say why.
    let result = answered(&extender, 60, &nodes);
    assert_eq!(result.node_names, Some(vec!["n3".to_owned()]));
    let failed: Vec<&str> = result.failed_nodes.keys().map(String::as_str).collect();
    assert_eq!(failed, ["n1", "n2"], "{result:?}");
    // Nothing fits: every node refused, with its reason, as before.
    let full = answered(&extender, 100, &["n1", "n2"]);
    assert_eq!(full.node_names, Some(vec![]));
    assert_eq!(full.failed_nodes.len(), 2, "{full:?}");
}

#[test]
fn best_of_keeps_all_when_asked_for_as_many_or_none() {
    let fit = vec!["a", "b"];
    let scores = vec![Some(1), Some(2)];
    assert_eq!(best_of(fit.clone(), scores.clone(), 0).0, ["a", "b"]);
    assert_eq!(best_of(fit.clone(), scores.clone(), 2).0, ["a", "b"]);
    assert_eq!(
        best_of(fit.clone(), scores.clone(), 1),
        (vec!["b"], vec![Some(2)])
    );
    // A node without a score ranks after every scored one.
    assert_eq!(best_of(vec!["a", "b"], vec![None, Some(0)], 1).0, ["b"]);
}
