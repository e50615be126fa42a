//! Prioritize takes the scores filter computed for the same pod ([`ScoreMemo`])
//! only while nothing they read changed: the ledger's nodes, the pod's request,
//! the node list. Any change, and it scores anew, as it would without filter.

use proptest::prelude::*;
use serde_json::Value;

use super::fixtures::{args, extender, fitting, healthy_device, share_pod};
use super::*;
use tessera_allocator::allocate::{GpuShare, Placement};

impl Extender {
    fn reused(&self) -> u64 {
        self.scores_reused.load(Ordering::Relaxed)
    }
}

/// kube-scheduler's order: filter, then prioritize over the nodes it let
/// through. Prioritize answers filter's scores, and they are what it computes
/// itself (scored again, a new cycle, without the memo: the same answer).
#[test]
fn prioritize_takes_filters_scores_while_nothing_changed() {
    let extender = extender(&[healthy_device("n1", 1), healthy_device("n2", 1)]);
    assert_eq!(
        fitting(&extender, &share_pod("running", 30), &["n1"]),
        ["n1"]
    );
    let a = share_pod("a", 60);
    assert_eq!(fitting(&extender, &a, &["n1", "n2"]), ["n1", "n2"]);
    let scores = extender.prioritize(args(&a, &["n1", "n2"]));
    assert_eq!(extender.reused(), 1, "filter's scores taken");
    assert!(scores[0].score > scores[1].score, "{scores:?}");
    assert_eq!(extender.ledger().tentative_node("a"), Some("n1"));
    // A second prioritize has no memo (one prioritize each): scored anew, alike.
    assert_eq!(extender.prioritize(args(&a, &["n1", "n2"])), scores);
    assert_eq!(extender.reused(), 1);
}

/// The ledger changes between filter and prioritize (another pod's hold, a
/// Device CR): prioritize scores from the ledger as it is now. With filter's
/// scores (a tie on two empty nodes) it would not prefer the node now fuller.
#[test]
fn a_ledger_change_after_filter_is_scored_anew() {
    let extender = extender(&[healthy_device("n1", 1), healthy_device("n2", 1)]);
    let a = share_pod("a", 20);
    assert_eq!(fitting(&extender, &a, &["n1", "n2"]), ["n1", "n2"]);
    // B's hold on n2 (one node fits: filter holds it).
    assert_eq!(fitting(&extender, &share_pod("b", 50), &["n2"]), ["n2"]);
    let scores = extender.prioritize(args(&a, &["n1", "n2"]));
    assert!(
        scores[1].score > scores[0].score,
        "binpack: n2 is fuller {scores:?}"
    );
    assert_eq!(extender.reused(), 0);

    // A Device CR changes: n2 now has two GPUs, one of them held by the device plugin.
    let extender = super::fixtures::extender(&[healthy_device("n1", 1), healthy_device("n2", 1)]);
    assert_eq!(fitting(&extender, &a, &["n1", "n2"]), ["n1", "n2"]);
    let changed = super::fixtures::device("n2", &[(16, true), (16, true)], &[1]);
    extender
        .ledger()
        .apply_device(&serde_json::from_value(changed).expect("device"));
    let fresh = extender.prioritize(args(&a, &["n1", "n2"]));
    assert_eq!(extender.reused(), 0);
    extender.ledger().release_tentative("a");
    assert_eq!(extender.prioritize(args(&a, &["n1", "n2"])), fresh);
}

/// The pod asks otherwise at prioritize than at filter (same UID): not filter's scores.
#[test]
fn another_request_is_scored_anew() {
    let extender = extender(&[healthy_device("n1", 1), healthy_device("n2", 1)]);
    assert_eq!(
        fitting(&extender, &share_pod("running", 30), &["n1"]),
        ["n1"]
    );
    let small = share_pod("a", 10);
    assert_eq!(fitting(&extender, &small, &["n1", "n2"]), ["n1", "n2"]);
    let big = share_pod("a", 80);
    let scores = extender.prioritize(args(&big, &["n1", "n2"]));
    assert_eq!(extender.reused(), 0);
    // 80 percent does not fit beside 30: n1 scores nothing.
    assert_eq!(scores[0].score, 0, "{scores:?}");
    assert!(scores[1].score > 0, "{scores:?}");
}

/// Another pod asking the same is scored anew: filter's scores left out the
/// filtered pod's own in-flight hold (an earlier attempt's, see
/// `Ledger::set_aside`), which counts against any other pod.
#[test]
fn another_pod_asking_the_same_is_scored_anew() {
    let extender = extender(&[healthy_device("n1", 1), healthy_device("n2", 1)]);
    let share = GpuShare {
        uuid: "GPU-n1-0".into(),
        minor: 0,
        core: 30,
        memory: 0,
        ratio: 0,
    };
    let placement = Placement {
        gpus: vec![share],
        group: None,
    };
    extender.ledger().reserve("a", "n1", placement, u64::MAX);
    let a = share_pod("a", 10);
    assert_eq!(fitting(&extender, &a, &["n1", "n2"]), ["n1", "n2"]);
    let scores = extender.prioritize(args(&share_pod("c", 10), &["n1", "n2"]));
    assert_eq!(extender.reused(), 0);
    assert!(
        scores[0].score > scores[1].score,
        "A's hold on n1 counts for C {scores:?}"
    );
}

/// Names in another order, fewer or others than filter let through: each name
/// gets its own score (filter's where it sits at the same place, else anew).
#[test]
fn names_out_of_filters_order_get_their_own_scores() {
    let devices = [
        healthy_device("n1", 1),
        healthy_device("n2", 1),
        healthy_device("n3", 1),
    ];
    let (with_memo, without) = (extender(&devices), extender(&devices));
    for extender in [&with_memo, &without] {
        assert_eq!(fitting(extender, &share_pod("r1", 30), &["n1"]), ["n1"]);
        assert_eq!(fitting(extender, &share_pod("r3", 60), &["n3"]), ["n3"]);
    }
    let a = share_pod("a", 20);
    let all = ["n1", "n2", "n3"];
    assert_eq!(fitting(&with_memo, &a, &all), all);
    let names = ["n3", "n2", "n1"];
    let scores = with_memo.prioritize(args(&a, &names));
    assert_eq!(with_memo.reused(), 1, "n2 sits where filter had it");
    assert_eq!(scores, without.prioritize(args(&a, &names)));
    assert!(scores[0].score > scores[2].score && scores[2].score > scores[1].score);
}

/// The cache goes unsynced between filter and prioritize: no preference, as
/// prioritize answers unsynced, not filter's scores.
#[test]
fn unsynced_after_filter_scores_nothing() {
    let extender = extender(&[healthy_device("n1", 1), healthy_device("n2", 1)]);
    assert_eq!(
        fitting(&extender, &share_pod("running", 30), &["n1"]),
        ["n1"]
    );
    let a = share_pod("a", 20);
    assert_eq!(fitting(&extender, &a, &["n1", "n2"]), ["n1", "n2"]);
    extender.ready.store(false, Ordering::SeqCst);
    let scores = extender.prioritize(args(&a, &["n1", "n2"]));
    assert!(scores.iter().all(|s| s.score == 0), "{scores:?}");
    assert_eq!(extender.reused(), 0);
}

/// One step of [`memo_never_changes_an_answer`].
#[derive(Debug, Clone)]
enum Step {
    /// Filter pod `pod` asking `percent` over the nodes of `mask`.
    Filter { pod: u8, percent: u32, mask: u8 },
    /// Prioritize it so.
    Prioritize { pod: u8, percent: u32, mask: u8 },
    /// Filter, then prioritize over the nodes filter let through (kube-scheduler's
    /// order), the ledger changed in between when `between` says so ([`Step::Occupy`]).
    Cycle {
        pod: u8,
        percent: u32,
        mask: u8,
        between: Option<(usize, u64)>,
    },
    /// Every tentative hold given back (the TTL passing).
    Expire,
    /// A bind's reservation of `percent` of GPU 0 of node `node` (a pod of the watch
    /// or a bind: a change of the ledger that no filter makes).
    Occupy { node: usize, percent: u64 },
}

fn step() -> impl Strategy<Value = Step> {
    let pod = 0u8..4;
    let percent = prop::sample::select(vec![10u32, 20, 30, 50, 70, 100]);
    let mask = 1u8..16;
    prop_oneof![
        (pod.clone(), percent.clone(), mask.clone())
            .prop_map(|(pod, percent, mask)| Step::Filter { pod, percent, mask }),
        (pod.clone(), percent.clone(), mask.clone())
            .prop_map(|(pod, percent, mask)| Step::Prioritize { pod, percent, mask }),
        (
            pod,
            percent,
            mask,
            prop::option::of((0usize..4, 1u64..=100))
        )
            .prop_map(|(pod, percent, mask, between)| Step::Cycle {
                pod,
                percent,
                mask,
                between
            }),
        Just(Step::Expire),
        (0usize..4, 1u64..=100).prop_map(|(node, percent)| Step::Occupy { node, percent }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Whatever happens between filter and prioritize, every answer is the one an
    /// extender without the memo gives (the twin, whose memo is dropped before
    /// each prioritize), and so is every hold left in the ledger.
    #[test]
    fn memo_never_changes_an_answer(steps in prop::collection::vec(step(), 1..24)) {
        let nodes = ["n1", "n2", "n3", "n4"];
        let devices: Vec<Value> = nodes.iter().map(|n| healthy_device(n, 2)).collect();
        let (memo, twin) = (extender(&devices), extender(&devices));
        let chosen = |mask: u8| -> Vec<&str> {
            nodes.iter().enumerate().filter(|(i, _)| mask & (1 << i) != 0).map(|(_, n)| *n).collect()
        };
        let occupy = |index: usize, node: usize, percent: u64| {
            let share = GpuShare {
                uuid: format!("GPU-{}-0", nodes[node]),
                minor: 0,
                core: percent,
                memory: 0,
                ratio: 0,
            };
            let placement = Placement { gpus: vec![share], group: None };
            for extender in [&memo, &twin] {
                let uid = format!("other-{index}");
                extender.ledger().reserve(&uid, nodes[node], placement.clone(), u64::MAX);
            }
        };
        for (index, step) in steps.into_iter().enumerate() {
            match step {
                Step::Filter { pod, percent, mask } => {
                    let pod = share_pod(&format!("p{pod}"), percent);
                    let names = chosen(mask);
                    prop_assert_eq!(memo.filter(args(&pod, &names)), twin.filter(args(&pod, &names)));
                }
                Step::Prioritize { pod, percent, mask } => {
                    let pod = share_pod(&format!("p{pod}"), percent);
                    let names = chosen(mask);
                    *lock(&twin.scores) = None;
                    prop_assert_eq!(memo.prioritize(args(&pod, &names)), twin.prioritize(args(&pod, &names)));
                }
                Step::Cycle { pod, percent, mask, between } => {
                    let pod = share_pod(&format!("p{pod}"), percent);
                    let names = chosen(mask);
                    let filtered = memo.filter(args(&pod, &names));
                    prop_assert_eq!(&filtered, &twin.filter(args(&pod, &names)));
                    let through = filtered.node_names.unwrap_or_default();
                    let through: Vec<&str> = through.iter().map(String::as_str).collect();
                    if let Some((node, percent)) = between {
                        occupy(index, node, percent);
                    }
                    *lock(&twin.scores) = None;
                    prop_assert_eq!(memo.prioritize(args(&pod, &through)), twin.prioritize(args(&pod, &through)));
                }
                Step::Occupy { node, percent } => occupy(index, node, percent),
                Step::Expire => {
                    for extender in [&memo, &twin] {
                        let later = extender.now() + extender.config.reservation_ttl.as_secs();
                        extender.ledger().expire(later);
                    }
                }
            }
            for n in nodes {
                let (a, b) = (memo.ledger(), twin.ledger());
                prop_assert_eq!(a.node(n), b.node(n));
            }
        }
    }
}
