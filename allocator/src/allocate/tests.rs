use proptest::prelude::*;

use super::*;
use tessera_api::request::{ContainerGpuRequest, ContainerRole, PodGpuRequest};

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
    assert!(
        reason.to_string().contains("0 of 2 usable GPUs"),
        "{reason}"
    );
}

/// Why a pod waits, in words a user can act on: what was asked, what the freest
/// usable GPU has free, and what holds the GPUs that are not usable.
#[test]
fn the_unfit_reason_says_what_was_asked_what_is_free_and_what_holds_the_rest() {
    let held = GpuState {
        legacy: true,
        ..gpu(2, 16384, 16384)
    };
    let sick = GpuState {
        healthy: false,
        ..gpu(3, 16384, 16384)
    };
    let n = node(
        "n",
        vec![gpu(0, 16384, 4096), gpu(1, 16384, 8192), held, sick],
    );
    let request = GpuRequest {
        count: 1,
        core: 30,
        memory: GpuMemory::Bytes(10 << 30),
    };
    assert_eq!(
        allocate(&n, &request, Policy::Binpack).expect_err("unfit"),
        "0 of 2 usable GPUs (4 total: 1 held by device-plugin pods, 1 unhealthy) have room for 30% compute and 10.0 GiB, 1 needed; the freest has 100% compute and 8.0 GiB of 16.0 GiB free"
    );
    // Never: what the GPUs hold, beside the size asked.
    let huge = GpuRequest {
        count: 1,
        core: 0,
        memory: GpuMemory::Bytes(100 << 30),
    };
    assert_eq!(
        never_fits(&n, &huge).expect("never"),
        "never fits: 0 of 3 healthy GPUs (4 total) could hold 100.0 GiB of memory even with nothing running (the largest healthy GPU holds 16.0 GiB); 1 needed"
    );
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

// === Pods: a share per container ===

fn share(core: u64, ratio: u64) -> GpuRequest {
    GpuRequest {
        count: 1,
        core,
        memory: if ratio == 0 {
            GpuMemory::None
        } else {
            GpuMemory::Ratio(ratio)
        },
    }
}

fn whole_gpus(count: u32) -> GpuRequest {
    GpuRequest {
        count,
        core: 100,
        memory: GpuMemory::Ratio(100),
    }
}

fn pod(containers: &[(&str, ContainerRole, GpuRequest)]) -> PodGpuRequest {
    PodGpuRequest {
        containers: containers
            .iter()
            .map(|(name, role, gpu)| ContainerGpuRequest {
                name: (*name).into(),
                role: *role,
                gpu: *gpu,
                asked_as: None,
            })
            .collect(),
        ..PodGpuRequest::default()
    }
}

/// `(uuid, core, ratio)` of each share.
fn shares_of(gpus: &[GpuShare]) -> Vec<(&str, u64, u64)> {
    gpus.iter()
        .map(|s| (s.uuid.as_str(), s.core, s.ratio))
        .collect()
}

fn grant<'a>(placement: &'a PodPlacement, name: &str) -> Vec<(&'a str, u64, u64)> {
    let container = placement
        .containers
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("{name} not placed: {placement:?}"));
    shares_of(&container.gpus)
}

#[test]
fn two_quarter_containers_share_one_gpu_booked_half_each_limited_to_a_quarter() {
    let n = node("n", vec![gpu(0, 16384, 16384), gpu(1, 16384, 16384)]);
    let request = pod(&[
        ("a", ContainerRole::App, share(25, 25)),
        ("b", ContainerRole::App, share(25, 25)),
    ]);
    let placement = allocate_pod(&n, &request, Policy::Binpack).expect("fits");
    assert_eq!(shares_of(&placement.booked.gpus), [("GPU-0", 50, 50)]);
    assert_eq!(grant(&placement, "a"), [("GPU-0", 25, 25)]);
    assert_eq!(grant(&placement, "b"), [("GPU-0", 25, 25)]);
    // Spread puts them on two GPUs; each is still a quarter.
    let spread = allocate_pod(&n, &request, Policy::Spread).expect("fits");
    assert_eq!(
        shares_of(&spread.booked.gpus),
        [("GPU-0", 25, 25), ("GPU-1", 25, 25)]
    );
    assert_eq!(grant(&spread, "a").len(), 1);
    assert_ne!(grant(&spread, "a"), grant(&spread, "b"));
}

/// 60 + 60 and 200 + 50 used to be one request of 120 or 250 "per GPU".
#[test]
fn sums_above_100_fit_on_several_gpus() {
    let two = node("n", vec![gpu(0, 16384, 16384), gpu(1, 16384, 16384)]);
    let sixties = pod(&[
        ("a", ContainerRole::App, share(60, 60)),
        ("b", ContainerRole::App, share(60, 60)),
    ]);
    let placement = allocate_pod(&two, &sixties, Policy::Binpack).expect("two GPUs");
    assert_eq!(
        shares_of(&placement.booked.gpus),
        [("GPU-0", 60, 60), ("GPU-1", 60, 60)]
    );
    assert!(fits_pod(&two, &sixties, Policy::Binpack));
    let one = node("n", vec![gpu(0, 16384, 16384)]);
    assert!(!fits_pod(&one, &sixties, Policy::Binpack));
    let reason = unfit_reason_pod(&one, &sixties, Policy::Binpack);
    assert!(
        reason
            .to_string()
            .starts_with("container b: 0 of 1 usable GPUs"),
        "{reason}"
    );
    let three = node("n", (0..3).map(|i| gpu(i, 16384, 16384)).collect());
    let mixed = pod(&[
        ("a", ContainerRole::App, whole_gpus(2)),
        ("b", ContainerRole::App, share(50, 50)),
    ]);
    let placement = allocate_pod(&three, &mixed, Policy::Binpack).expect("fits");
    assert_eq!(grant(&placement, "a").len(), 2);
    let b = grant(&placement, "b");
    assert_eq!(b.len(), 1);
    assert!(
        !grant(&placement, "a").iter().any(|g| g.0 == b[0].0),
        "a whole GPU is not shared"
    );
    assert!(!fits_pod(&two, &mixed, Policy::Spread));
}

#[test]
fn init_containers_reuse_the_app_containers_gpus() {
    let one = node("n", vec![gpu(0, 16384, 16384), gpu(1, 16384, 16384)]);
    // A whole-GPU init container before a half-GPU app: one GPU, booked whole.
    let request = pod(&[
        ("init", ContainerRole::Init, whole_gpus(1)),
        ("app", ContainerRole::App, share(50, 50)),
    ]);
    let placement = allocate_pod(&one, &request, Policy::Binpack).expect("fits");
    assert_eq!(shares_of(&placement.booked.gpus), [("GPU-0", 100, 100)]);
    assert_eq!(grant(&placement, "init"), [("GPU-0", 100, 100)]);
    assert_eq!(grant(&placement, "app"), [("GPU-0", 50, 50)]);
    // Per resource: compute from the app, memory from the init container.
    let request = pod(&[
        ("init", ContainerRole::Init, share(10, 40)),
        ("app", ContainerRole::App, share(50, 10)),
    ]);
    let placement = allocate_pod(&one, &request, Policy::Spread).expect("fits");
    assert_eq!(shares_of(&placement.booked.gpus), [("GPU-0", 50, 40)]);
}

#[test]
fn sidecars_run_beside_app_and_later_init_containers() {
    let one = node("n", vec![gpu(0, 16384, 16384)]);
    let fits_with = |init: u64, app: u64| {
        allocate_pod(
            &one,
            &pod(&[
                ("proxy", ContainerRole::Sidecar, share(30, 30)),
                ("warmup", ContainerRole::Init, share(init, init)),
                ("app", ContainerRole::App, share(app, app)),
            ]),
            Policy::Binpack,
        )
    };
    let placement = fits_with(70, 70).expect("30 + 70 twice");
    assert_eq!(shares_of(&placement.booked.gpus), [("GPU-0", 100, 100)]);
    let reason = fits_with(80, 10).expect_err("the warm-up runs beside the sidecar");
    assert!(
        reason.to_string().starts_with("init container warmup:"),
        "{reason}"
    );
    let reason = fits_with(10, 80).expect_err("the app runs beside the sidecar");
    // The app (bigger) is placed first; the sidecar then finds no room.
    assert!(
        reason
            .to_string()
            .starts_with("init container proxy: 0 of 1 usable GPUs"),
        "{reason}"
    );
}

#[test]
fn one_container_pods_are_placed_as_before() {
    let n = node("n", vec![gpu(0, 16384, 8192), gpu(1, 16384, 16384)]);
    let request = share(25, 25);
    let before = allocate(&n, &request, Policy::Binpack).expect("fits");
    let after = allocate_pod(
        &n,
        &pod(&[("main", ContainerRole::App, request)]),
        Policy::Binpack,
    )
    .expect("fits");
    assert_eq!(after.booked, before);
    assert_eq!(after.containers[0].gpus, before.gpus);
    assert_eq!(
        score_pod(
            &n,
            &pod(&[("main", ContainerRole::App, request)]),
            Policy::Binpack,
            Policy::Binpack
        ),
        score_request(&n, &request, Policy::Binpack, Policy::Binpack)
    );
}

fn role() -> impl Strategy<Value = ContainerRole> {
    prop_oneof![
        Just(ContainerRole::Init),
        Just(ContainerRole::Sidecar),
        Just(ContainerRole::App)
    ]
}

fn container_request() -> impl Strategy<Value = GpuRequest> {
    prop_oneof![
        (1u64..=100, 0u64..=100).prop_map(|(core, ratio)| share(core, ratio)),
        (0u64..=100, 1u64..=8192).prop_map(|(core, mib)| GpuRequest {
            count: 1,
            core,
            memory: GpuMemory::Bytes(mib * MIB)
        }),
        (1u32..=2).prop_map(whole_gpus),
        (2u32..=3, 1u64..=100).prop_map(|(count, core)| GpuRequest {
            count,
            core,
            memory: GpuMemory::Ratio(core)
        }),
    ]
}

fn pod_request() -> impl Strategy<Value = PodGpuRequest> {
    proptest::collection::vec((role(), container_request()), 1..6).prop_map(|containers| {
        // Kubernetes' order: init containers (sidecars among them), then apps.
        let (init, apps): (Vec<_>, Vec<_>) = containers
            .into_iter()
            .enumerate()
            .partition(|(_, (role, _))| *role != ContainerRole::App);
        PodGpuRequest {
            containers: init
                .into_iter()
                .chain(apps)
                .map(|(i, (role, gpu))| ContainerGpuRequest {
                    name: format!("c{i}"),
                    role,
                    gpu,
                    asked_as: None,
                })
                .collect(),
            ..PodGpuRequest::default()
        }
    })
}

proptest! {
    /// Every container gets exactly its own request; the pod books, per GPU, what
    /// each phase uses at once and no more; the node is never over-allocated; the
    /// booking is at least Kubernetes' effective request.
    #[test]
    fn pods_get_what_each_container_asked_and_book_each_phase(
        request in pod_request(),
        used in proptest::option::of(proptest::collection::vec(0u64..=60, 16)),
        policy in prop_oneof![Just(Policy::Binpack), Just(Policy::Spread)],
    ) {
        let mut n = node("n", (0..16).map(|i| gpu(i, 16384, 16384)).collect());
        for (g, used) in n.gpus.iter_mut().zip(used.iter().flatten()) {
            g.core_used = *used;
            g.memory_used = *used * 16384 * MIB / 100;
        }
        let placement = match allocate_pod(&n, &request, policy) {
            Ok(placement) => placement,
            // Room for every container on GPUs of its own: it always fits.
            Err(reason) => {
                prop_assert!(used.is_some(), "an empty node of 16 GPUs: {}", reason);
                return Ok(());
            }
        };
        prop_assert_eq!(placement.containers.len(), request.containers.len());
        for (asked, got) in request.containers.iter().zip(&placement.containers) {
            prop_assert_eq!(&asked.name, &got.name);
            prop_assert_eq!(got.gpus.len(), asked.gpu.count as usize, "{:?}", got);
            let mut uuids: Vec<&str> = got.gpus.iter().map(|s| s.uuid.as_str()).collect();
            uuids.sort_unstable();
            uuids.dedup();
            prop_assert_eq!(uuids.len(), got.gpus.len(), "one GPU twice in {}", got.name);
            for s in &got.gpus {
                prop_assert_eq!(s.core, asked.gpu.core);
                match asked.gpu.memory {
                    GpuMemory::None => prop_assert_eq!(s.memory, 0),
                    GpuMemory::Bytes(bytes) => prop_assert_eq!(s.memory, bytes),
                    GpuMemory::Ratio(ratio) => prop_assert_eq!(s.ratio, ratio),
                }
            }
        }
        let booked: BTreeMap<&str, &GpuShare> = placement.booked.gpus.iter().map(|s| (s.uuid.as_str(), s)).collect();
        let mut most: BTreeMap<String, (u64, u64)> = BTreeMap::new();
        for phase in request.phases() {
            let mut sums: BTreeMap<String, (u64, u64)> = BTreeMap::new();
            for &index in &phase {
                let whole = request.containers[index].gpu.is_whole();
                for s in &placement.containers[index].gpus {
                    let sum = sums.entry(s.uuid.clone()).or_default();
                    sum.0 += s.core;
                    sum.1 += s.memory;
                    if whole {
                        // A whole GPU is nobody else's in its phase.
                        let others = phase.iter().filter(|&&other| other != index).any(|&other| {
                            placement.containers[other].gpus.iter().any(|o| o.uuid == s.uuid)
                        });
                        prop_assert!(!others, "whole GPU {} shared in phase {:?}", s.uuid, phase);
                    }
                }
            }
            for (uuid, (core, memory)) in sums {
                let b = booked.get(uuid.as_str()).copied();
                prop_assert!(b.is_some_and(|b| b.core >= core && b.memory >= memory), "{} not booked for {:?}", uuid, phase);
                let m = most.entry(uuid).or_default();
                *m = (m.0.max(core), m.1.max(memory));
            }
        }
        // Booked exactly the most any phase uses: nothing more.
        let exact: BTreeMap<String, (u64, u64)> = placement.booked.gpus.iter().map(|s| (s.uuid.clone(), (s.core, s.memory))).collect();
        prop_assert_eq!(exact, most);
        let total: u64 = placement.booked.gpus.iter().map(|s| s.core).sum();
        prop_assert!(total >= request.effective().core);
        account(&mut n, &placement.booked, true);
        for g in &n.gpus {
            prop_assert!(g.core_used <= 100 && g.memory_used <= g.memory_total, "{:?}", g);
        }
    }

    /// On one GPU, a pod of shares fits exactly when Kubernetes' effective request
    /// fits in the GPU, and books exactly that.
    #[test]
    fn on_one_gpu_the_booking_is_kubernetes_effective_request(
        containers in proptest::collection::vec((role(), 1u64..=60, 0u64..=60), 1..6),
    ) {
        let request = PodGpuRequest {
            containers: {
                let (init, apps): (Vec<_>, Vec<_>) = containers.into_iter().enumerate().partition(|(_, (role, ..))| *role != ContainerRole::App);
                init.into_iter().chain(apps).map(|(i, (role, core, ratio))| ContainerGpuRequest {
                    name: format!("c{i}"),
                    role,
                    gpu: share(core, ratio),
                    asked_as: None,
                }).collect()
            },
            ..PodGpuRequest::default()
        };
        let n = node("n", vec![gpu(0, 16384, 16384)]);
        let effective = request.effective();
        let result = allocate_pod(&n, &request, Policy::Binpack);
        prop_assert_eq!(result.is_ok(), effective.core <= 100 && effective.memory_ratio <= 100, "{:?} {:?}", effective, result);
        if let Ok(placement) = result {
            prop_assert_eq!(shares_of(&placement.booked.gpus), [("GPU-0", effective.core, effective.memory_ratio)]);
        }
    }
}

// === A pod's own choices: which GPUs, which policies ===

fn with_rules(annotations: &[(&str, &str)], gpu: GpuRequest) -> PodGpuRequest {
    let annotations: BTreeMap<String, String> = annotations
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    let rules = tessera_api::request::selection::PodRules::parse(Some(&annotations))
        .expect("valid annotations");
    PodGpuRequest {
        selection: rules.selection,
        gpu_policy: rules.gpu_policy,
        node_policy: rules.node_policy,
        ..pod(&[("main", ContainerRole::App, gpu)])
    }
}

fn of_model(mut gpu: GpuState, model: &str) -> GpuState {
    gpu.labels = Arc::new(BTreeMap::from([(
        LABEL_GPU_MODEL.to_owned(),
        model.to_owned(),
    )]));
    gpu
}

fn chosen(placement: &PodPlacement) -> Vec<&str> {
    placement
        .booked
        .gpus
        .iter()
        .map(|s| s.uuid.as_str())
        .collect()
}

/// A node of two models: HAMi's type and UUID lists choose among its GPUs; binpack
/// would otherwise take the fuller GPU 0.
#[test]
fn selection_rules_out_gpus_by_model_and_uuid() {
    let n = node(
        "n",
        vec![
            of_model(gpu(0, 16384, 8192), "Tesla-V100-PCIE-16GB"),
            of_model(gpu(1, 16384, 16384), "Tesla-T4"),
            of_model(gpu(2, 16384, 16384), "Tesla-T4"),
        ],
    );
    let quarter = mib(1024);
    let place = |annotations: &[(&str, &str)]| {
        allocate_pod(&n, &with_rules(annotations, quarter), Policy::Binpack)
    };
    assert_eq!(chosen(&place(&[]).expect("fits")), ["GPU-0"]);
    assert_eq!(
        chosen(&place(&[("nvidia.com/use-gputype", "t4")]).expect("fits")),
        ["GPU-1"]
    );
    assert_eq!(
        chosen(
            &place(&[
                ("nvidia.com/nouse-gputype", "V100"),
                ("nvidia.com/nouse-gpuuuid", "GPU-1")
            ])
            .expect("fits")
        ),
        ["GPU-2"]
    );
    assert_eq!(
        chosen(&place(&[("nvidia.com/use-gpuuuid", "GPU-2, GPU-9")]).expect("fits")),
        ["GPU-2"]
    );
    // A type as a person writes it, spaces included, is made label-safe before
    // it is matched (compat.md: "Tesla V100" matches Tesla-V100-PCIE-16GB).
    assert_eq!(
        chosen(&place(&[("nvidia.com/use-gputype", "Tesla V100")]).expect("fits")),
        ["GPU-0"]
    );
    let error = place(&[("nvidia.com/use-gputype", "A100")]).expect_err("no A100 here");
    assert_eq!(
        error,
        r#"container main: 0 of 0 usable GPUs (3 total) have room for 1.0 GiB of memory, 1 needed; 3 of 3 GPUs ruled out by nvidia.com/use-gputype="A100""#
    );
    let request = with_rules(&[("nvidia.com/use-gputype", "A100")], quarter);
    assert!(!fits_pod(&n, &request, Policy::Binpack));
    assert!(never_fits_pod(&n, &request, Policy::Binpack).is_some());
    assert_eq!(
        score_pod(&n, &request, Policy::Binpack, Policy::Binpack),
        None
    );
    assert_eq!(
        selected_nowhere([&n], &request.selection).as_deref(),
        Some(
            r#"nvidia.com/use-gputype="A100" rules out every GPU of every node: no node has such a GPU (GPU models in the cluster: Tesla-T4, Tesla-V100-PCIE-16GB)"#
        )
    );
    let t4 = with_rules(&[("nvidia.com/use-gputype", "T4")], quarter);
    assert_eq!(selected_nowhere([&n], &t4.selection), None);
}

/// `hami.io/gpu-scheduler-policy: spread` takes the emptiest GPU although the
/// scheduler's default is binpack, and the other way round.
#[test]
fn the_pods_gpu_policy_overrides_the_default() {
    let n = node("n", vec![gpu(0, 16384, 8192), gpu(1, 16384, 16384)]);
    let quarter = mib(1024);
    let spread = with_rules(&[("hami.io/gpu-scheduler-policy", "spread")], quarter);
    assert_eq!(
        chosen(&allocate_pod(&n, &spread, Policy::Binpack).expect("fits")),
        ["GPU-1"]
    );
    let binpack = with_rules(&[("hami.io/gpu-scheduler-policy", "binpack")], quarter);
    assert_eq!(
        chosen(&allocate_pod(&n, &binpack, Policy::Spread).expect("fits")),
        ["GPU-0"]
    );
    assert_eq!(gpu_policy_of(&spread, Policy::Binpack), Policy::Spread);
    assert_eq!(node_policy_of(&spread, Policy::Binpack), Policy::Binpack);
}

/// The score of a node is its fullness whatever the pod's selection rules out:
/// a pod limited to one GPU of an otherwise full node still sees it full.
#[test]
fn a_selection_does_not_change_how_full_a_node_looks() {
    let n = node("n", vec![gpu(0, 16384, 0), gpu(1, 16384, 16384)]);
    let request = with_rules(&[("nvidia.com/use-gpuuuid", "GPU-1")], mib(8192));
    let plain = pod(&[("main", ContainerRole::App, mib(8192))]);
    assert_eq!(
        score_pod(&n, &request, Policy::Binpack, Policy::Binpack),
        score_pod(&n, &plain, Policy::Binpack, Policy::Binpack)
    );
}

// === Sharing groups ===

fn in_group(group: &str, gpu: GpuRequest) -> PodGpuRequest {
    PodGpuRequest {
        sharing_group: Some(group.into()),
        ..pod(&[("main", ContainerRole::App, gpu)])
    }
}

fn quarter_share() -> GpuRequest {
    GpuRequest {
        count: 1,
        core: 25,
        memory: GpuMemory::Ratio(25),
    }
}

/// Places `request` on `n` and books it, as bind and the ledger do.
fn place_and_book(n: &mut NodeState, request: &PodGpuRequest, policy: Policy) -> Placement {
    let placement = allocate_pod(n, request, policy).expect("fits").booked;
    account(n, &placement, true);
    placement
}

/// KubeShare's rules: a new group takes a free GPU; its next pods share that GPU;
/// no pod outside the group gets it; when its last pod leaves it is anyone's.
#[test]
fn a_sharing_group_holds_one_gpu_while_it_has_pods() {
    let mut n = node(
        "n",
        vec![
            gpu(0, 16384, 8192),
            gpu(1, 16384, 16384),
            gpu(2, 16384, 16384),
        ],
    );
    let a1 = in_group("a", quarter_share());
    // Binpack would take the half-used GPU 0; a new group takes an idle one.
    let first = place_and_book(&mut n, &a1, Policy::Binpack);
    assert_eq!(first.gpus[0].uuid, "GPU-1");
    assert_eq!(first.group.as_deref(), Some("a"));
    assert_eq!(n.gpus[1].groups.get("a"), Some(&1));
    // Spread would take the idle GPU 2; the group's pods share its GPU.
    let second = place_and_book(&mut n, &in_group("a", quarter_share()), Policy::Spread);
    assert_eq!(second.gpus[0].uuid, "GPU-1");
    assert_eq!(n.gpus[1].groups.get("a"), Some(&2));
    // Binpack would take the group's GPU (fuller than GPU 2): not outside the group.
    let plain = pod(&[("main", ContainerRole::App, quarter_share())]);
    assert_eq!(
        allocate_pod(&n, &plain, Policy::Binpack)
            .expect("fits")
            .booked
            .gpus[0]
            .uuid,
        "GPU-0"
    );
    // Another group: the other idle GPU.
    let other = place_and_book(&mut n, &in_group("b", quarter_share()), Policy::Binpack);
    assert_eq!(other.gpus[0].uuid, "GPU-2");
    // A plain pod that only the groups' GPUs could hold is busy there, not
    // unresolvable: the groups' pods leaving frees them.
    let big = pod(&[("main", ContainerRole::App, mib(12288))]);
    assert!(!fits_pod(&n, &big, Policy::Binpack));
    assert_eq!(never_fits_pod(&n, &big, Policy::Binpack), None);
    // A third group finds no idle GPU: busy, not impossible (evictions free one).
    let third = in_group("c", quarter_share());
    assert!(!fits_pod(&n, &third, Policy::Binpack));
    assert_eq!(never_fits_pod(&n, &third, Policy::Binpack), None);
    assert_eq!(
        unfit_reason_pod(&n, &third, Policy::Binpack),
        r#"container main: 0 of 3 usable GPUs (3 total) have room for 25% compute and 25% memory, 1 needed; the freest has 75% compute and 12.0 GiB of 16.0 GiB free; sharing group "c" is new and takes an idle GPU (0 of 3 idle)"#
    );
    // The group's last pod leaves: GPU 1 is anyone's again.
    account(&mut n, &second, false);
    assert_eq!(n.gpus[1].groups.get("a"), Some(&1));
    account(&mut n, &first, false);
    assert!(n.gpus[1].groups.is_empty());
    assert_eq!(
        allocate_pod(&n, &third, Policy::Binpack)
            .expect("fits")
            .booked
            .gpus[0]
            .uuid,
        "GPU-1"
    );
}

/// A group's GPU full: its next pod waits on that GPU (preemption of the group's
/// pods may make room there); every other node is unresolvable.
#[test]
fn a_full_group_waits_for_its_own_gpu() {
    let mut n = node("n", vec![gpu(0, 16384, 16384), gpu(1, 16384, 16384)]);
    let half = GpuRequest {
        count: 1,
        core: 50,
        memory: GpuMemory::Ratio(50),
    };
    place_and_book(&mut n, &in_group("a", half), Policy::Binpack);
    place_and_book(&mut n, &in_group("a", half), Policy::Binpack);
    let third = in_group("a", half);
    assert!(!fits_pod(&n, &third, Policy::Binpack));
    assert_eq!(never_fits_pod(&n, &third, Policy::Binpack), None);
    assert_eq!(
        unfit_reason_pod(&n, &third, Policy::Binpack),
        r#"container main: 0 of 1 usable GPUs (2 total) have room for 50% compute and 50% memory, 1 needed; the freest has 0% compute and 0.0 GiB of 16.0 GiB free; sharing group "a" holds a GPU here and its pods use that GPU only"#
    );
    // Too big for the group's GPU even emptied: never.
    let whole_and_more = in_group(
        "a",
        GpuRequest {
            count: 1,
            core: 0,
            memory: GpuMemory::Bytes(20000 * MIB),
        },
    );
    assert!(never_fits_pod(&n, &whole_and_more, Policy::Binpack).is_some());
    let home = group_home([&n], &third);
    assert_eq!(home, Some(("n".to_owned(), "GPU-0".to_owned())));
    assert_eq!(group_elsewhere(home.as_ref(), &third, "n"), None);
    assert_eq!(
        group_elsewhere(home.as_ref(), &third, "m").as_deref(),
        Some(r#"sharing group "a" holds GPU GPU-0 on node n: its pods share that GPU only"#)
    );
    let plain = pod(&[("main", ContainerRole::App, half)]);
    assert_eq!(group_elsewhere(home.as_ref(), &plain, "m"), None);
}

// === The load: what filter and prioritize read of each candidate node ===

fn any_gpu(i: u32) -> impl Strategy<Value = GpuState> {
    (
        (
            any::<bool>(),
            any::<bool>(),
            prop_oneof![Just(0u64), Just(16384u64), Just(81920u64)],
        ),
        (0u64..=120, 0u64..=100),
        proptest::option::of(prop_oneof![Just("a"), Just("b")]),
        proptest::option::of(prop_oneof![Just("A100"), Just("T4")]),
    )
        .prop_map(
            move |((healthy, legacy, total_mib), (core_used, used_percent), group, model)| {
                let mut g = gpu(i, total_mib, total_mib);
                g.healthy = healthy || i == 0;
                g.legacy = legacy && i > 0;
                g.core_used = core_used;
                g.memory_used = g.memory_total / 100 * used_percent;
                if let Some(group) = group {
                    g.groups.insert(group.to_owned(), 1);
                }
                match model {
                    Some(model) => of_model(g, model),
                    None => g,
                }
            },
        )
}

fn any_node() -> impl Strategy<Value = NodeState> {
    // Beyond 8 GPUs, the load holds them on the heap ([`GpuLoads`]).
    (1u32..=10).prop_flat_map(|count| {
        (0..count)
            .map(any_gpu)
            .collect::<Vec<_>>()
            .prop_map(|gpus| node("n", gpus))
    })
}

fn any_pod_request() -> impl Strategy<Value = PodGpuRequest> {
    prop_oneof![
        4 => container_request().prop_map(|gpu| pod(&[("main", ContainerRole::App, gpu)])),
        1 => pod_request(),
        1 => container_request().prop_map(|gpu| in_group("a", gpu)),
        1 => container_request().prop_map(|gpu| with_rules(&[("nvidia.com/use-gputype", "A100")], gpu)),
    ]
}

/// A memory ratio takes more of a bigger GPU: the score is that of the GPU the
/// policy picks (binpack: the 80 GiB one, fuller), not of the first that fits.
#[test]
fn a_ratio_on_gpus_of_different_sizes_scores_the_gpu_the_policy_picks() {
    let mut big = gpu(1, 81920, 81920);
    big.core_used = 40;
    let n = node("n", vec![gpu(0, 16384, 16384), big]);
    let request = pod(&[(
        "main",
        ContainerRole::App,
        GpuRequest {
            count: 1,
            core: 10,
            memory: GpuMemory::Ratio(50),
        },
    )]);
    let load = NodeLoad::of(&n);
    assert_eq!(load.same_memory, None);
    let loaded = LoadedNode {
        state: &n,
        load: &load,
    };
    // (40 + 10) / 200 compute and 40 / 96 GiB memory: 3 (the 16 GiB GPU would give 2).
    assert_eq!(
        score_pod(&n, &request, Policy::Binpack, Policy::Binpack),
        Some(3)
    );
    assert_eq!(
        score_pod_loaded(loaded, &request, Policy::Binpack, Policy::Binpack),
        Some(3)
    );
}

/// A node's GPU loads are held in place up to 8 GPUs, on the heap beyond; a
/// refresh moves them between the two, and they read the same either way.
#[test]
fn gpu_loads_in_place_or_on_the_heap_read_the_same() {
    let mut load = NodeLoad::default();
    for count in [2u32, 12, 9, 8, 0, 3, 16] {
        let mut n = node("n", (0..count).map(|i| gpu(i, 16384, 8192)).collect());
        if let Some(last) = n.gpus.last_mut() {
            last.core_used = 70;
        }
        load.refresh(&n);
        let each: Vec<GpuLoad> = n.gpus.iter().map(GpuState::load).collect();
        assert_eq!(&*load.gpus, each.as_slice(), "{count} GPUs");
        assert_eq!(load, NodeLoad::of(&n), "{count} GPUs");
        let in_place = !load.gpus.spilled();
        assert_eq!(in_place, count <= 8, "{count} GPUs");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]
    /// Filter and prioritize judge a node from its load ([`NodeLoad`]) where that
    /// says all, else from the whole state: the answer is the same either way, for
    /// any health, use, sharing group, selection, count and policy.
    #[test]
    fn the_load_judges_a_node_as_its_state_does(
        n in any_node(),
        request in any_pod_request(),
        gpu_policy in prop_oneof![Just(Policy::Binpack), Just(Policy::Spread)],
        node_policy in prop_oneof![Just(Policy::Binpack), Just(Policy::Spread)],
    ) {
        let load = NodeLoad::of(&n);
        let loaded = LoadedNode { state: &n, load: &load };
        prop_assert_eq!(
            score_pod_loaded(loaded, &request, gpu_policy, node_policy),
            score_pod(&n, &request, gpu_policy, node_policy)
        );
        // Filter takes a score as the verdict that the pod fits (one reading of the
        // node): a node is scored exactly when the pod fits it.
        prop_assert_eq!(
            score_pod_loaded(loaded, &request, gpu_policy, node_policy).is_some(),
            fits_pod(&n, &request, gpu_policy)
        );
    }
}

// === Koordinator's required topology scope ===

fn on(mut gpu: GpuState, numa: i32, pcie: &str) -> GpuState {
    gpu.numa = numa;
    gpu.pcie = pcie.into();
    gpu
}

const PCIE_HINT: &str = r#"{"gpu": {"requiredTopologyScope": "PCIe"}}"#;
const NUMA_HINT: &str = r#"{"gpu": {"requiredTopologyScope": "NUMANode"}}"#;

/// Two switches of two GPUs, one NUMA node each. GPUs 0 and 2 are partly used, so
/// the free pairs are split across switches: two whole GPUs fit on the node, but
/// under no one switch, and the reason says so; once GPU 2 is free, switch b holds them.
#[test]
fn a_required_scope_keeps_the_pods_gpus_under_one_switch() {
    let hint = [(
        tessera_api::request::selection::KOORDINATOR_DEVICE_ALLOCATE_HINT,
        PCIE_HINT,
    )];
    let request = with_rules(&hint, whole_gpus(2));
    let mut n = node(
        "n",
        vec![
            on(gpu(0, 16384, 8192), 0, "a"),
            on(gpu(1, 16384, 16384), 0, "a"),
            on(gpu(2, 16384, 8192), 1, "b"),
            on(gpu(3, 16384, 16384), 1, "b"),
        ],
    );
    let plain = with_rules(&[], whole_gpus(2));
    assert!(
        fits_pod(&n, &plain, Policy::Binpack),
        "the node holds two whole GPUs"
    );
    assert!(!fits_pod(&n, &request, Policy::Binpack));
    assert_eq!(
        score_pod(&n, &request, Policy::Binpack, Policy::Binpack),
        None
    );
    let reason = allocate_pod(&n, &request, Policy::Binpack).expect_err("no switch has room");
    assert!(
        reason
            .to_string()
            .contains("requires all of the pod's GPUs under one PCIe switch"),
        "{reason}"
    );
    assert_eq!(unfit_reason_pod(&n, &request, Policy::Binpack), reason);
    // Emptied, switch a would hold them: preemption may help.
    assert_eq!(never_fits_pod(&n, &request, Policy::Binpack), None);

    n.gpus[2].memory_used = 0;
    let placement = allocate_pod(&n, &request, Policy::Binpack).expect("switch b has room");
    assert_eq!(chosen(&placement), ["GPU-2", "GPU-3"]);
    assert!(fits_pod(&n, &request, Policy::Binpack));
    assert!(score_pod(&n, &request, Policy::Binpack, Policy::Binpack).is_some());
}

/// NUMANode: four GPUs on one NUMA node (across its two switches) fit; a NUMA node
/// of two never holds four, whatever is evicted; a GPU whose NUMA node is not
/// reported holds a one-GPU pod alone, never beside another.
#[test]
fn a_numa_scope_spans_switches_but_not_nodes() {
    let hint = [(
        tessera_api::request::selection::KOORDINATOR_DEVICE_ALLOCATE_HINT,
        NUMA_HINT,
    )];
    let four = with_rules(&hint, whole_gpus(4));
    // Switches a and b, b on NUMA node `numa_of_b` (a on 0), all GPUs free.
    let two_switches = |numa_of_b: i32| {
        let gpus = (0..4)
            .map(|i| {
                let (numa, pcie) = if i < 2 { (0, "a") } else { (numa_of_b, "b") };
                on(gpu(i, 16384, 16384), numa, pcie)
            })
            .collect();
        node("n", gpus)
    };
    let placement =
        allocate_pod(&two_switches(0), &four, Policy::Binpack).expect("one NUMA node of four");
    assert_eq!(chosen(&placement).len(), 4);

    let split = two_switches(1);
    let never = never_fits_pod(&split, &four, Policy::Binpack).expect("never fits");
    assert!(
        never.to_string().contains("under one NUMA node")
            && never.to_string().contains("even with nothing running"),
        "{never}"
    );

    let unknown = node("u", vec![gpu(0, 16384, 16384), gpu(1, 16384, 16384)]);
    assert!(allocate_pod(&unknown, &with_rules(&hint, whole_gpus(1)), Policy::Binpack).is_ok());
    assert!(allocate_pod(&unknown, &with_rules(&hint, whole_gpus(2)), Policy::Binpack).is_err());
}

/// An allowance of 0 turns groups off: a pod naming a new group is refused, and the
/// reason says groups are off, not that it waits for others to end.
#[test]
fn an_allowance_of_zero_turns_sharing_groups_off() {
    let n = node("n", vec![gpu(0, 16384, 16384)]);
    let request = PodGpuRequest {
        sharing_group: Some("team/a".into()),
        ..pod(&[("main", ContainerRole::App, mib(1024))])
    };
    let why = group_over_allowance([&n], &request, None, 0).expect("off");
    assert!(
        why.contains("sharing groups are off") && why.contains("tessera.io/sharing-group"),
        "{why}"
    );
    assert_eq!(group_over_allowance([&n], &request, None, 1), None);
}

/// A scope holds every container's GPUs together (two one-GPU containers, the
/// node's free GPUs one under each switch: unfit); among switches that hold the
/// pod, the GPU policy picks (binpack the fuller, spread the emptier).
#[test]
fn a_scope_spans_the_pods_containers_and_the_policy_picks_among_switches() {
    let hint = [(
        tessera_api::request::selection::KOORDINATOR_DEVICE_ALLOCATE_HINT,
        PCIE_HINT,
    )];
    let two = PodGpuRequest {
        selection: with_rules(&hint, whole_gpus(1)).selection,
        ..pod(&[
            ("a", ContainerRole::App, whole_gpus(1)),
            ("b", ContainerRole::App, whole_gpus(1)),
        ])
    };
    let split = node(
        "split",
        vec![
            on(gpu(0, 16384, 0), 0, "a"),
            on(gpu(1, 16384, 16384), 0, "a"),
            on(gpu(2, 16384, 0), 1, "b"),
            on(gpu(3, 16384, 16384), 1, "b"),
        ],
    );
    let reason = allocate_pod(&split, &two, Policy::Binpack).expect_err("one free GPU per switch");
    assert!(
        reason.to_string().contains("under one PCIe switch"),
        "{reason}"
    );

    let quarter = with_rules(&hint, mib(4096));
    let both = node(
        "both",
        vec![
            on(gpu(0, 16384, 8192), 0, "a"),
            on(gpu(1, 16384, 16384), 0, "a"),
            on(gpu(2, 16384, 16384), 1, "b"),
            on(gpu(3, 16384, 16384), 1, "b"),
        ],
    );
    let two_quarters = PodGpuRequest {
        selection: quarter.selection.clone(),
        ..pod(&[(
            "main",
            ContainerRole::App,
            GpuRequest {
                count: 2,
                ..mib(4096)
            },
        )])
    };
    let binpack = allocate_pod(&both, &two_quarters, Policy::Binpack).expect("fits");
    assert_eq!(chosen(&binpack), ["GPU-0", "GPU-1"], "the fuller switch");
    let spread = allocate_pod(&both, &two_quarters, Policy::Spread).expect("fits");
    assert_eq!(chosen(&spread), ["GPU-2", "GPU-3"], "the emptier switch");
}

/// A scope alone keeps a pod off the load-only fast paths (which know no
/// topology), rules out no GPU by itself, and says when GPUs report no place.
#[test]
fn a_scope_alone_takes_the_full_path_and_names_unreported_places() {
    let hint = [(
        tessera_api::request::selection::KOORDINATOR_DEVICE_ALLOCATE_HINT,
        PCIE_HINT,
    )];
    let two = with_rules(&hint, whole_gpus(2));
    // Free GPUs 1 and 2, under different switches: the load alone would say it fits.
    let n = node(
        "n",
        vec![
            on(gpu(0, 16384, 0), 0, "a"),
            on(gpu(1, 16384, 16384), 0, "a"),
            on(gpu(2, 16384, 16384), 1, "b"),
            on(gpu(3, 16384, 0), 1, "b"),
        ],
    );
    let load = NodeLoad::of(&n);
    let loaded = LoadedNode {
        state: &n,
        load: &load,
    };
    assert_eq!(
        score_pod_loaded(loaded, &two, Policy::Binpack, Policy::Binpack),
        None
    );
    assert_eq!(selected_nowhere([&n], &two.selection), None);

    let bare = node("bare", vec![gpu(0, 16384, 16384), gpu(1, 16384, 16384)]);
    let reason = unfit_reason_pod(&bare, &two, Policy::Binpack);
    assert!(
        reason
            .to_string()
            .contains(r#"gpu.requiredTopologyScope "PCIe""#)
            && reason
                .to_string()
                .contains("2 of its 2 GPUs report no PCIe switch"),
        "{reason}"
    );
    assert_eq!(
        allocate_pod(&bare, &two, Policy::Binpack).expect_err("unfit"),
        reason,
        "bind says what filtering says"
    );
}

#[test]
fn rounding_without_libm_matches_f64_round_at_every_half() {
    for tenths in 0..=100u32 {
        for nudge in [-1e-12, 0.0, 1e-12] {
            let x = f64::from(tenths) / 10.0 + nudge;
            if x >= 0.0 {
                assert_eq!(round_small(x), x.round() as i64, "{x}");
            }
        }
    }
    // Just under a half, which adding 0.5 and truncating gets wrong.
    let below_half = 0.499_999_999_999_999_94_f64;
    assert_eq!(round_small(below_half), 0);
    assert_eq!(round_small(f64::NAN), f64::NAN.round() as i64);
}

proptest! {
    #[test]
    fn rounding_without_libm_is_f64_round(x in 0.0f64..1e6) {
        prop_assert_eq!(round_small(x), x.round() as i64);
    }

    #[test]
    fn a_share_in_64_bits_is_the_128_bit_share_saturated(total in any::<u64>(), ratio in any::<u64>()) {
        let wide: u64 = (u128::from(total) * u128::from(ratio) / 100).try_into().unwrap_or(u64::MAX);
        prop_assert_eq!(share_of(total, ratio), wide);
    }
}
