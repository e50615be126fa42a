//! Victims per GPU: only lower-priority pods on the GPUs the preemptor gets, the
//! fewest and least important of them; nodes where no eviction helps are refused.

use tessera_api::request::{ContainerGpuRequest, ContainerRole, PodGpuRequest};

use super::*;

const GIB: u64 = 1 << 30;

/// A running pod: its UID, priority and `(gpu, percent)` shares.
type Running<'a> = (&'a str, i32, &'a [(u32, u64)]);

/// A node of `gpus` 16 GiB GPUs with `holders` applied.
fn node_with(gpus: u32, holders: &[Running<'_>]) -> (NodeState, Vec<GpuHolder>) {
    let mut node = NodeState {
        name: "n".into(),
        gpus: (0..gpus)
            .map(|i| GpuState {
                uuid: format!("GPU-{i}"),
                minor: i,
                healthy: true,
                memory_total: 16 * GIB,
                numa: -1,
                ..GpuState::default()
            })
            .collect(),
    };
    let holders: Vec<GpuHolder> = holders
        .iter()
        .map(|(uid, priority, shares)| GpuHolder {
            uid: (*uid).into(),
            priority: *priority,
            placement: Placement {
                gpus: shares
                    .iter()
                    .map(|&(gpu, percent)| GpuShare {
                        uuid: format!("GPU-{gpu}"),
                        minor: gpu,
                        core: percent,
                        memory: 16 * GIB * percent / 100,
                        ratio: percent,
                    })
                    .collect(),
                group: None,
            },
        })
        .collect();
    for holder in &holders {
        account(&mut node, &holder.placement, true);
    }
    (node, holders)
}

/// A one-container pod asking `count` GPUs of `percent` compute and memory each.
fn asking(count: u32, percent: u64) -> PodGpuRequest {
    PodGpuRequest {
        containers: vec![ContainerGpuRequest {
            name: "main".into(),
            role: ContainerRole::App,
            gpu: GpuRequest {
                count,
                core: percent,
                memory: GpuMemory::Ratio(percent),
            },
            asked_as: None,
        }],
        ..PodGpuRequest::default()
    }
}

fn victims(
    node: &NodeState,
    holders: &[GpuHolder],
    request: &PodGpuRequest,
    priority: i32,
) -> Result<Vec<String>, NoVictims> {
    gpu_victims(node, holders, request, priority, Policy::Binpack)
}

/// kube-scheduler's own dry run counts GPU capacity in aggregate: with two GPUs at
/// 100% (A+B on GPU 0; C beside the high-priority H on GPU 1) it reprieves A and
/// evicts B and C, which frees 100% in sum but no whole GPU. Per GPU, only A and B
/// (the pods on the GPU the preemptor gets) go, and C stays.
#[test]
fn the_victims_are_the_pods_on_the_gpu_the_preemptor_gets_and_only_those() {
    let (node, holders) = node_with(
        2,
        &[
            ("a", 0, &[(0, 50)]),
            ("b", 0, &[(0, 50)]),
            ("c", 0, &[(1, 50)]),
            ("h", 100, &[(1, 50)]),
        ],
    );
    assert_eq!(
        victims(&node, &holders, &asking(1, 100), 100).expect("room"),
        ["a", "b"]
    );
    // Half a GPU: one pod goes, on GPU 1 beside H or on GPU 0; never two.
    let half = victims(&node, &holders, &asking(1, 50), 100).expect("room");
    assert_eq!(half.len(), 1, "{half:?}");
}

#[test]
fn the_fewest_pods_go_the_big_one_before_two_small_ones() {
    let (node, holders) = node_with(
        1,
        &[
            ("small-1", 0, &[(0, 25)]),
            ("small-2", 0, &[(0, 25)]),
            ("big", 0, &[(0, 50)]),
        ],
    );
    assert_eq!(
        victims(&node, &holders, &asking(1, 50), 10).expect("room"),
        ["big"]
    );
}

/// As kube-scheduler ranks nodes: the lowest highest victim priority first.
#[test]
fn the_least_important_pods_go_first() {
    let (node, holders) = node_with(2, &[("p5", 5, &[(0, 100)]), ("p1", 1, &[(1, 100)])]);
    assert_eq!(
        victims(&node, &holders, &asking(1, 100), 10).expect("room"),
        ["p1"]
    );
    // On one GPU, the more important pod keeps its place when the other suffices.
    let (node, holders) = node_with(1, &[("p5", 5, &[(0, 50)]), ("p1", 1, &[(0, 50)])]);
    assert_eq!(
        victims(&node, &holders, &asking(1, 50), 10).expect("room"),
        ["p1"]
    );
}

#[test]
fn pods_of_equal_or_higher_priority_are_never_victims() {
    let (node, holders) = node_with(1, &[("same", 10, &[(0, 50)]), ("low", 0, &[(0, 25)])]);
    let refused = victims(&node, &holders, &asking(1, 100), 10).expect_err("no room");
    assert!(
        refused.to_string().starts_with(
            "no eviction of lower-priority pods makes room: container main: 0 of 1 usable GPUs"
        ),
        "{refused}"
    );
    // Half a GPU fits once the low pod goes.
    assert_eq!(
        victims(&node, &holders, &asking(1, 50), 10).expect("room"),
        ["low"]
    );
}

#[test]
fn a_pod_that_fits_already_needs_no_gpu_victim() {
    let (node, holders) = node_with(2, &[("low", 0, &[(0, 100)])]);
    assert_eq!(
        victims(&node, &holders, &asking(1, 100), 10).expect("fits"),
        Vec::<String>::new()
    );
}

/// Two GPUs: the set the allocator picks with the low pods gone; the
/// high-priority pod's GPU is not among them and its neighbour stays.
#[test]
fn a_multi_gpu_pod_evicts_on_the_gpus_it_gets() {
    let (node, holders) = node_with(
        3,
        &[
            ("low-0", 0, &[(0, 50)]),
            ("low-1", 0, &[(1, 50)]),
            ("low-2", 0, &[(2, 25)]),
            ("high-2", 100, &[(2, 25)]),
        ],
    );
    assert_eq!(
        victims(&node, &holders, &asking(2, 100), 100).expect("room"),
        ["low-0", "low-1"]
    );
}

/// A victim spanning two GPUs frees both: evicting it alone is enough.
#[test]
fn a_victim_on_two_gpus_frees_both() {
    let (node, holders) = node_with(2, &[("wide", 0, &[(0, 100), (1, 100)])]);
    assert_eq!(
        victims(&node, &holders, &asking(2, 100), 1).expect("room"),
        ["wide"]
    );
}

fn answer(
    dry_run: &[&str],
    gpu_holders: &[&str],
    priorities: &[(&str, i32)],
    gpu: &[&str],
) -> Option<Vec<String>> {
    let victims: Vec<String> = dry_run.iter().map(|s| (*s).to_owned()).collect();
    let holds = |uid: &str| gpu_holders.contains(&uid);
    let priority = |uid: &str| priorities.iter().find(|(u, _)| *u == uid).map(|(_, p)| *p);
    node_victims(
        DryRun {
            victims: &victims,
            holds_gpus: &holds,
            priority: &priority,
        },
        gpu.iter().map(|s| (*s).to_owned()).collect(),
    )
}

/// The dry run's victims that hold no GPU stay (it chose them for CPU, memory…);
/// those holding GPUs go only where Tessera chose them; most important first.
#[test]
fn the_answer_keeps_the_dry_runs_other_victims_and_only_tesseras_gpu_victims() {
    assert_eq!(
        answer(
            &["cpu-hog", "gpu-elsewhere", "gpu-here"],
            &["gpu-elsewhere", "gpu-here", "gpu-reprieved"],
            &[("cpu-hog", 3), ("gpu-here", 1), ("gpu-extra", 5)],
            &["gpu-here", "gpu-extra"],
        ),
        Some(vec![
            "gpu-extra".to_owned(),
            "cpu-hog".to_owned(),
            "gpu-here".to_owned()
        ])
    );
    // Only GPU pods elsewhere in the dry run, none needed by Tessera: no candidate.
    assert_eq!(
        answer(&["gpu-elsewhere"], &["gpu-elsewhere"], &[], &[]),
        None
    );
}

/// With a required PCIe scope, each switch is a candidate: the cheaper one to
/// empty is chosen, not the one the allocator would pick on the emptied node.
#[test]
fn a_scope_preempts_on_the_switch_that_costs_least() {
    // GPU 0 (switch a) holds a priority-5 pod, GPU 2 (switch b) a priority-1 pod.
    let (mut node, holders) = node_with(4, &[("mid", 5, &[(0, 100)]), ("low", 1, &[(2, 100)])]);
    for gpu in &mut node.gpus {
        gpu.pcie = if gpu.minor < 2 { "a" } else { "b" }.into();
    }
    let mut request = asking(2, 100);
    request.selection.scope = Some(tessera_api::request::selection::ScopeRule {
        annotation: "scheduling.koordinator.sh/device-allocate-hint".into(),
        value: r#"{"gpu":{"requiredTopologyScope":"PCIe"}}"#.into(),
        scope: tessera_api::request::selection::TopologyScope::PcieSwitch,
    });
    let victims = gpu_victims(&node, &holders, &request, 10, Policy::Binpack).expect("room");
    assert_eq!(victims, ["low"]);
}
