//! Filter's verdicts kept across calls ([`super::fits`]) answer exactly as the
//! full judgement does: the same chosen node (best score, earliest in the call's
//! order among equals), the same refused nodes with the same reasons, through a
//! long run of calls with the names in changing orders, pods of several shapes
//! and uids holding and releasing GPUs, other pods booking and freeing GPUs,
//! nodes coming and going and names without a Device CR.

use serde_json::{Value, json};
use tessera_allocator::allocate::{GpuShare, Placement};
use tessera_allocator::simulate::synthetic_ledger;

use super::fixtures::{args, extender_with, share_pod};
use super::*;

/// A small deterministic generator (the run is the same every time).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, below: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 33) as usize) % below.max(1)
    }
}

fn pair(nodes: usize, fit_memo: bool) -> (Extender, Vec<String>) {
    // Half the nodes half-used, half empty (two quarter pods a GPU, in order).
    let (ledger, names) = synthetic_ledger(nodes, 2, nodes * 2);
    let mut extender = extender_with(
        ledger,
        ExtenderConfig {
            candidates: 1,
            ..ExtenderConfig::default()
        },
    );
    extender.fit_memo = fit_memo;
    (extender, names)
}

fn shapes(uid: &str, which: usize) -> Value {
    match which {
        0 => share_pod(uid, 25),
        1 => share_pod(uid, 60),
        2 => json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": uid, "namespace": "default", "uid": uid},
            "spec": {"containers": [{"name": "main", "image": "x",
                "resources": {"limits": {"nvidia.com/gpu": "2"}}}]}}),
        _ => json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": uid, "namespace": "default", "uid": uid},
            "spec": {"containers": [{"name": "main", "image": "x",
                "resources": {"limits": {"koordinator.sh/gpu-memory": "70Gi"}}}]}}),
    }
}

fn book(extender: &Extender, node: &str, gpu: u32, core: u64, id: &str) {
    let share = GpuShare {
        uuid: format!("GPU-{}-{gpu:02}", node.trim_start_matches("node-")),
        minor: gpu,
        core,
        memory: core << 30,
        ratio: 0,
    };
    extender.ledger().reserve(
        id,
        node,
        Placement {
            gpus: vec![share],
            group: None,
        },
        u64::MAX,
    );
}

#[test]
fn kept_verdicts_answer_as_the_full_judgement_does() {
    let (memo, names) = pair(24, true);
    let (full, _) = pair(24, false);
    let mut rng = Lcg(7);
    let mut booked: Vec<(String, String)> = Vec::new();
    for step in 0..600 {
        // Mostly the same pod shape over the same names, as a Deployment's pods
        // come: the memo's case. Now and then another shape, a subset of the
        // names, or a name without a Device CR.
        let shape = if rng.next(8) == 0 { rng.next(4) } else { 0 };
        let uid = format!("u{}", rng.next(3));
        let mut call: Vec<String> = match rng.next(10) {
            0 => names
                .iter()
                .take(rng.next(names.len()) + 1)
                .cloned()
                .collect(),
            1 => {
                let mut with = names.clone();
                with.push("no-device".into());
                with
            }
            _ => names.clone(),
        };
        for i in (1..call.len()).rev() {
            call.swap(i, rng.next(i + 1));
        }
        let call: Vec<&str> = call.iter().map(String::as_str).collect();
        let pod = shapes(&uid, shape);
        let want = full.filter(args(&pod, &call));
        let got = memo.filter(args(&pod, &call));
        assert_eq!(
            (
                &got.node_names,
                &got.failed_nodes,
                &got.failed_and_unresolvable_nodes
            ),
            (
                &want.node_names,
                &want.failed_nodes,
                &want.failed_and_unresolvable_nodes
            ),
            "step {step}: shape {shape}, uid {uid}, {} names",
            call.len()
        );
        // Other pods book and free GPUs on both ledgers alike.
        match rng.next(9) {
            0 => {
                let node = &names[rng.next(names.len())];
                let gpu = u32::try_from(rng.next(2)).unwrap_or(0);
                let id = format!("other-{step}");
                for extender in [&memo, &full] {
                    book(extender, node, gpu, 50, &id);
                }
                booked.push((id, node.clone()));
            }
            1 if !booked.is_empty() => {
                let (id, _) = booked.swap_remove(rng.next(booked.len()));
                for extender in [&memo, &full] {
                    extender.ledger().release(&id);
                }
            }
            // One of the filtered pods' own binds in flight: set aside while it is
            // judged again, put back after (its node changes twice a call).
            3 => {
                let node = &names[rng.next(names.len())];
                let owner = format!("u{}", rng.next(3));
                for extender in [&memo, &full] {
                    book(extender, node, 1, 25, &owner);
                }
            }
            // A Device CR updated in place: its switch mark on or off.
            4 => {
                let node = names[rng.next(names.len())].clone();
                let unproven = rng.next(2) == 0;
                let mut device = tessera_allocator::simulate::synthetic_cluster(24, 2, 0)
                    .devices
                    .into_iter()
                    .find(|d| d.metadata.name.as_deref() == Some(node.as_str()))
                    .expect("the node's device");
                if unproven {
                    device.metadata.annotations = Some(
                        [(
                            tessera_api::resources::SWITCH_UNPROVEN.to_owned(),
                            "true".to_owned(),
                        )]
                        .into(),
                    );
                }
                for extender in [&memo, &full] {
                    extender.ledger().apply_device(&device);
                }
            }
            2 if step % 97 == 0 => {
                // A node goes and comes back: slots move.
                let node = names[rng.next(names.len())].clone();
                for extender in [&memo, &full] {
                    let mut ledger = extender.ledger();
                    ledger.delete_device(&node);
                }
                for extender in [&memo, &full] {
                    let device = tessera_allocator::simulate::synthetic_cluster(24, 2, 0)
                        .devices
                        .into_iter()
                        .find(|d| d.metadata.name.as_deref() == Some(node.as_str()))
                        .expect("the node's device");
                    extender.ledger().apply_device(&device);
                }
            }
            _ => {}
        }
    }
    let served = memo.kept_verdict_answers();
    assert!(served > 250, "the memo answered {served} of 600 calls");
    assert!(
        lock(&memo.fits).len() > 1,
        "one shape over two name sets keeps both"
    );
    assert_eq!(full.kept_verdict_answers(), 0);
}
