//! Filter-time reservation: a pod's GPUs are held from the cycle that chose its
//! node, so the next pods' cycles see them taken before its bind arrives; the
//! hold is replaced by the pod's next cycle or its bind, and expires on the TTL.

use super::fixtures::{args, extender, fitting, healthy_device, share_pod};
use super::*;

/// One node fits: kube-scheduler takes it without prioritize, so filter holds
/// the GPUs. The next pod's filter sees them taken (without the hold it would
/// fit: A has not bound); A's own next cycle does not count A twice; the hold
/// expires on the TTL when no bind comes.
#[test]
fn the_next_cycle_sees_the_gpus_the_last_one_chose() {
    let extender = extender(&[healthy_device("n1", 1)]);
    let (a, b) = (share_pod("a", 60), share_pod("b", 60));
    assert_eq!(fitting(&extender, &a, &["n1"]), ["n1"]);
    let refused = extender.filter(args(&b, &["n1"]));
    assert_eq!(refused.node_names, Some(vec![]), "{refused:?}");
    assert!(
        refused.failed_nodes["n1"].contains("0 of 1 usable GPUs"),
        "{refused:?}"
    );
    // A again (a retry): its own hold is replaced, so it still fits.
    assert_eq!(fitting(&extender, &a, &["n1"]), ["n1"]);
    assert_eq!(extender.ledger().tentative(), 1);
    // No bind within the TTL: given back, and B fits.
    let ttl = extender.config.reservation_ttl.as_secs();
    assert_eq!(extender.ledger().expire(extender.now() + ttl), 0);
    assert_eq!(extender.ledger().tentative(), 0);
    assert_eq!(fitting(&extender, &b, &["n1"]), ["n1"]);
}

/// Several nodes fit: prioritize holds the GPUs on the node it scores best (here
/// binpack's fuller node), and the next pod's filter sees that node taken.
#[test]
fn prioritize_holds_the_gpus_on_the_node_it_scores_best() {
    let extender = extender(&[healthy_device("n1", 1), healthy_device("n2", 1)]);
    let running = share_pod("running", 30);
    assert_eq!(fitting(&extender, &running, &["n1"]), ["n1"]);
    let (a, b) = (share_pod("a", 60), share_pod("b", 60));
    assert_eq!(fitting(&extender, &a, &["n1", "n2"]), ["n1", "n2"]);
    assert_eq!(
        extender.ledger().tentative_node("a"),
        None,
        "two fit: no hold yet"
    );
    let scores = extender.prioritize(args(&a, &["n1", "n2"]));
    assert!(scores[0].score > scores[1].score, "{scores:?}");
    assert_eq!(extender.ledger().tentative_node("a"), Some("n1"));
    // Scored again (a new cycle): without its own hold, the same answer.
    assert_eq!(extender.prioritize(args(&a, &["n1", "n2"])), scores);
    // n1 holds 30% + A's 60%: B fits only on n2.
    assert_eq!(fitting(&extender, &b, &["n1", "n2"]), ["n2"]);
    assert_eq!(extender.ledger().tentative_node("b"), Some("n2"));
}

/// The pod's bind replaces its own hold instead of counting it: on a node where
/// the hold and the bind's share would not fit together, the bind still fits.
#[test]
fn the_bind_takes_over_the_pods_own_hold() {
    let extender = extender(&[healthy_device("n1", 1)]);
    let a = share_pod("a", 60);
    assert_eq!(fitting(&extender, &a, &["n1"]), ["n1"]);
    let pod: Pod = serde_json::from_value(a).expect("pod");
    let request = pod_gpu_request(&pod, &RequestOptions::default())
        .expect("valid")
        .expect("asks GPUs");
    let bind = ExtenderBindingArgs {
        pod_name: "a".into(),
        pod_namespace: "default".into(),
        pod_uid: "a".into(),
        node: "n1".into(),
    };
    extender
        .reserve(&bind, &request)
        .expect("its own hold does not crowd it out");
    let ledger = extender.ledger();
    assert_eq!((ledger.tentative(), ledger.in_flight()), (0, 1));
    assert_eq!(ledger.node("n1").expect("node").gpus[0].core_used, 60);
}

/// A pod whose earlier bind left an in-flight hold (a Binding whose outcome is
/// unknown, or its annotation seen unbound after a relist) is judged again
/// without that hold counted against it: it fits on its own GPUs. The hold stays
/// for every other pod, and is not replaced by a tentative one.
#[test]
fn an_earlier_attempts_hold_never_counts_against_the_pod_itself() {
    let extender = extender(&[healthy_device("n1", 1)]);
    let (a, b) = (share_pod("a", 60), share_pod("b", 60));
    let placement = {
        let ledger = extender.ledger();
        let node = ledger.node("n1").expect("n1");
        let request = pod_gpu_request(
            &serde_json::from_value(a.clone()).expect("pod"),
            &extender.config.request,
        )
        .expect("request")
        .expect("asks GPUs");
        allocate_pod(node, &request, extender.config.gpu_policy).expect("fits")
    };
    let ttl = extender.config.reservation_ttl.as_secs();
    let now = extender.now();
    extender
        .ledger()
        .reserve("a", "n1", placement.booked, now + ttl);
    assert_eq!(
        fitting(&extender, &a, &["n1"]),
        ["n1"],
        "A's own hold counted against A"
    );
    let scores = extender.prioritize(args(&a, &["n1"]));
    assert!(scores[0].score > 0, "{scores:?}");
    assert_eq!(
        fitting(&extender, &b, &["n1"]),
        Vec::<String>::new(),
        "A's hold not counted for B"
    );
    let ledger = extender.ledger();
    assert_eq!((ledger.in_flight(), ledger.tentative()), (1, 0));
}

/// A retried bind (kube-scheduler binds again after an attempt whose outcome was
/// lost) replaces the pod's own in-flight hold instead of counting it: without
/// this every retry was refused until the hold expired (30 s after a relist, seen
/// on the real cluster). A refused retry leaves the hold as it was.
#[test]
fn a_retried_bind_takes_over_the_earlier_attempts_hold() {
    let extender = extender(&[healthy_device("n1", 1)]);
    let pod: Pod = serde_json::from_value(share_pod("a", 60)).expect("pod");
    let request = pod_gpu_request(&pod, &extender.config.request)
        .expect("valid")
        .expect("asks GPUs");
    let placement = {
        let ledger = extender.ledger();
        allocate_pod(
            ledger.node("n1").expect("n1"),
            &request,
            extender.config.gpu_policy,
        )
        .expect("fits")
    };
    let expires = extender.now() + extender.config.reservation_ttl.as_secs();
    extender
        .ledger()
        .reserve("a", "n1", placement.booked, expires);
    let bind = |node: &str| ExtenderBindingArgs {
        pod_name: "a".into(),
        pod_namespace: "default".into(),
        pod_uid: "a".into(),
        node: node.into(),
    };
    let refused = extender.reserve(&bind("n9"), &request);
    assert!(
        matches!(refused, Err(BindError::NoDevice { .. })),
        "{refused:?}"
    );
    {
        let ledger = extender.ledger();
        assert_eq!(ledger.in_flight(), 1, "a refused retry gives the hold back");
        assert_eq!(ledger.node("n1").expect("n1").gpus[0].core_used, 60);
    }
    extender
        .reserve(&bind("n1"), &request)
        .expect("the earlier attempt's hold does not crowd out the retry");
    let ledger = extender.ledger();
    assert_eq!(ledger.in_flight(), 1);
    assert_eq!(
        ledger.node("n1").expect("n1").gpus[0].core_used,
        60,
        "booked once"
    );
}
