use proptest::prelude::*;

use super::*;

const MIB: u64 = 1 << 20;

fn gpu(i: u32, total_mib: u64, free_mib: u64) -> GpuState {
    GpuState {
        uuid: format!("GPU-{i}"),
        minor: i,
        healthy: true,
        memory_total: total_mib * MIB,
        memory_used: (total_mib - free_mib) * MIB,
        numa: -1,
        ..GpuState::default()
    }
}

fn node(name: &str, gpus: Vec<GpuState>) -> NodeState {
    NodeState {
        name: name.into(),
        gpus,
    }
}

fn mib(n: u64) -> GpuRequest {
    GpuRequest {
        count: 1,
        core: 0,
        memory: GpuMemory::Bytes(n * MIB),
    }
}

#[test]
fn gpushare_seed_only_n3_fits_8138() {
    let n1 = node("n1", vec![gpu(0, 16276, 0), gpu(1, 16276, 4069)]);
    let n2 = node("n2", vec![gpu(0, 16276, 4069), gpu(1, 16276, 4069)]);
    let n3 = node("n3", vec![gpu(0, 16276, 8138), gpu(1, 16276, 0)]);
    let request = mib(8138);
    assert!(allocate(&n1, &request, Policy::Binpack).is_err());
    assert!(
        allocate(&n2, &request, Policy::Binpack).is_err(),
        "8138 MiB free across two GPUs is not 8138 on one"
    );
    let placement = allocate(&n3, &request, Policy::Binpack).expect("fits");
    assert_eq!(placement.gpus[0].uuid, "GPU-0");
    let reason = allocate(&n2, &request, Policy::Binpack).expect_err("unfit");
    assert!(reason.contains("0 of 2 usable GPUs"), "{reason}");
}

#[test]
fn gpushare_seed_binpack_picks_the_tightest() {
    let n = node(
        "n",
        vec![
            gpu(0, 16276, 12207),
            gpu(1, 16276, 8138),
            gpu(2, 16276, 4069),
            gpu(3, 16276, 16276),
        ],
    );
    let placement = allocate(&n, &mib(8138), Policy::Binpack).expect("fits");
    assert_eq!(placement.gpus[0].uuid, "GPU-1");
    let spread = allocate(&n, &mib(8138), Policy::Spread).expect("fits");
    assert_eq!(spread.gpus[0].uuid, "GPU-3");
}

#[test]
fn whole_and_shared_conflict() {
    let mut n = node("n", vec![gpu(0, 16384, 16384), gpu(1, 16384, 16384)]);
    let half = GpuRequest {
        count: 1,
        core: 50,
        memory: GpuMemory::Ratio(50),
    };
    let whole = GpuRequest {
        count: 1,
        core: 100,
        memory: GpuMemory::Ratio(100),
    };
    let first = allocate(&n, &half, Policy::Binpack).expect("fits");
    account(&mut n, &first, true);
    let second = allocate(&n, &whole, Policy::Binpack).expect("the other GPU");
    assert_ne!(second.gpus[0].uuid, first.gpus[0].uuid);
    account(&mut n, &second, true);
    assert!(
        allocate(&n, &whole, Policy::Binpack).is_err(),
        "no whole GPU left"
    );
    let again = allocate(&n, &half, Policy::Binpack).expect("the shared GPU's other half");
    assert_eq!(again.gpus[0].uuid, first.gpus[0].uuid);
    account(&mut n, &again, true);
    assert!(
        allocate(
            &n,
            &GpuRequest {
                count: 1,
                core: 1,
                memory: GpuMemory::None
            },
            Policy::Binpack
        )
        .is_err()
    );
    account(&mut n, &again, false);
    assert!(allocate(&n, &half, Policy::Binpack).is_ok(), "released");
}

#[test]
fn multi_gpu_prefers_nvlink_then_pcie_then_numa() {
    let mut gpus: Vec<GpuState> = (0..8).map(|i| gpu(i, 81920, 81920)).collect();
    for g in &mut gpus {
        g.numa = (g.minor / 4) as i32;
        g.pcie = format!("sw{}", g.minor / 2);
    }
    gpus[1].nvlink_peers = vec!["GPU-6".into()];
    gpus[6].nvlink_peers = vec!["GPU-1".into()];
    let n = node("n", gpus.clone());
    let two = GpuRequest {
        count: 2,
        core: 100,
        memory: GpuMemory::Ratio(100),
    };
    let chosen: Vec<String> = allocate(&n, &two, Policy::Binpack)
        .expect("fits")
        .gpus
        .into_iter()
        .map(|s| s.uuid)
        .collect();
    assert_eq!(chosen, ["GPU-1", "GPU-6"], "NVLink pair");

    let mut no_link = gpus.clone();
    for g in &mut no_link {
        g.nvlink_peers.clear();
    }
    no_link[0].core_used = 10; // GPU 0 is not whole-free: its switch partner GPU 1 is alone
    let n = node("n", no_link.clone());
    let chosen: Vec<String> = allocate(&n, &two, Policy::Binpack)
        .expect("fits")
        .gpus
        .into_iter()
        .map(|s| s.uuid)
        .collect();
    assert_eq!(chosen, ["GPU-2", "GPU-3"], "same PCIe switch");

    let four = GpuRequest {
        count: 4,
        core: 100,
        memory: GpuMemory::Ratio(100),
    };
    let chosen: Vec<u32> = allocate(&n, &four, Policy::Binpack)
        .expect("fits")
        .gpus
        .iter()
        .map(|s| s.minor)
        .collect();
    assert_eq!(
        chosen,
        [4, 5, 6, 7],
        "a whole NUMA node rather than spanning both"
    );
}

#[test]
fn unhealthy_and_legacy_gpus_are_never_used() {
    let mut n = node("n", vec![gpu(0, 16384, 16384), gpu(1, 16384, 16384)]);
    n.gpus[0].healthy = false;
    n.gpus[1].legacy = true;
    assert!(allocate(&n, &mib(1), Policy::Binpack).is_err());
    n.gpus[1].legacy = false;
    assert_eq!(
        allocate(&n, &mib(1), Policy::Binpack).expect("GPU 1").gpus[0].uuid,
        "GPU-1"
    );
}

#[test]
fn ratio_translates_per_gpu() {
    let n = node("n", vec![gpu(0, 16384, 16384), gpu(1, 81920, 81920)]);
    let quarter = GpuRequest {
        count: 1,
        core: 25,
        memory: GpuMemory::Ratio(25),
    };
    let on_small = allocate(
        &node("n", vec![n.gpus[0].clone()]),
        &quarter,
        Policy::Binpack,
    )
    .expect("fits");
    assert_eq!(on_small.gpus[0].memory, 4096 * MIB);
    let on_big = allocate(
        &node("n", vec![n.gpus[1].clone()]),
        &quarter,
        Policy::Binpack,
    )
    .expect("fits");
    assert_eq!(on_big.gpus[0].memory, 20480 * MIB);
    let bytes = allocate(&n, &mib(8192), Policy::Spread).expect("fits");
    assert_eq!(
        (bytes.gpus[0].uuid.as_str(), bytes.gpus[0].ratio),
        ("GPU-1", 10)
    );
}

#[test]
fn scores_follow_the_policy() {
    let empty = node("a", vec![gpu(0, 16384, 16384)]);
    let mut busy = node("b", vec![gpu(0, 16384, 8192)]);
    busy.gpus[0].core_used = 50;
    let request = GpuRequest {
        count: 1,
        core: 25,
        memory: GpuMemory::Ratio(25),
    };
    let p_empty = allocate(&empty, &request, Policy::Binpack).expect("fits");
    let p_busy = allocate(&busy, &request, Policy::Binpack).expect("fits");
    assert!(score(&busy, &p_busy, Policy::Binpack) > score(&empty, &p_empty, Policy::Binpack));
    assert!(score(&busy, &p_busy, Policy::Spread) < score(&empty, &p_empty, Policy::Spread));
    assert!((0..=10).contains(&score(&busy, &p_busy, Policy::Binpack)));
    for policy in [Policy::Binpack, Policy::Spread] {
        assert_eq!(
            score_request(&busy, &request, Policy::Binpack, policy),
            Some(score(&busy, &p_busy, policy))
        );
    }
    let whole = GpuRequest {
        count: 1,
        core: 100,
        memory: GpuMemory::Ratio(100),
    };
    assert_eq!(
        score_request(&busy, &whole, Policy::Binpack, Policy::Binpack),
        None
    );
}

proptest! {
    #[test]
    fn never_over_allocates(requests in proptest::collection::vec((1u32..3, 1u64..=100, 0u64..=100), 1..40)) {
        let mut n = node("n", (0..4).map(|i| gpu(i, 16384, 16384)).collect());
        for (count, core, ratio) in requests {
            let memory = if ratio == 0 { GpuMemory::None } else { GpuMemory::Ratio(ratio) };
            let request = GpuRequest { count, core, memory };
            if let Ok(placement) = allocate(&n, &request, Policy::Binpack) {
                prop_assert_eq!(placement.gpus.len(), count as usize);
                let mut uuids: Vec<&str> = placement.gpus.iter().map(|s| s.uuid.as_str()).collect();
                uuids.dedup();
                prop_assert_eq!(uuids.len(), count as usize, "one GPU twice");
                account(&mut n, &placement, true);
            }
            for g in &n.gpus {
                prop_assert!(g.core_used <= 100 && g.memory_used <= g.memory_total, "{:?}", g);
            }
        }
    }
}
