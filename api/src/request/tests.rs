use k8s_openapi::api::core::v1::{PodSpec, ResourceRequirements};

use super::*;

fn container(name: &str, resources: &[(&str, &str)]) -> Container {
    Container {
        name: name.into(),
        resources: Some(ResourceRequirements {
            limits: Some(
                resources
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), K8sQuantity((*v).to_owned())))
                    .collect(),
            ),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn pod(containers: Vec<Container>, init: Vec<Container>) -> Pod {
    Pod {
        spec: Some(PodSpec {
            containers,
            init_containers: Some(init),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The request of a pod with one app container `main` asking for `resources`.
fn request(resources: &[(&str, &str)]) -> Result<Option<GpuRequest>, RequestError> {
    let pod = pod_gpu_request(
        &pod(vec![container("main", resources)], vec![]),
        &RequestOptions::default(),
    )?;
    Ok(pod.map(|p| {
        assert_eq!(p.containers.len(), 1, "{p:?}");
        assert_eq!(p.containers[0].name, "main");
        p.containers[0].gpu
    }))
}

#[test]
fn shares_of_several_gpus_in_one_container_avoid_mps_gpus() {
    let mps = BTreeMap::from([(
        crate::enforcement::LABEL_ENFORCE_MPS.to_owned(),
        "true".to_owned(),
    )]);
    let plain = BTreeMap::new();
    let selection = |resources: &[(&str, &str)]| {
        pod_gpu_request(
            &pod(vec![container("main", resources)], vec![]),
            &RequestOptions::default(),
        )
        .map(|p| p.map(|p| p.selection))
    };
    // HAMi's two GPUs with 8 GiB each: not on a GPU whose node holds shares with MPS.
    let two = selection(&[("nvidia.com/gpu", "2"), ("nvidia.com/gpumem", "8192")])
        .ok()
        .flatten()
        .unwrap_or_default();
    assert!(!two.allows("GPU-a", &mps));
    assert!(two.allows("GPU-a", &plain));
    assert!(
        two.describe().contains("container main (shares of 2 GPUs)"),
        "{}",
        two.describe()
    );
    // One share, or whole GPUs: anywhere.
    for resources in [
        &[("nvidia.com/gpu", "1"), ("nvidia.com/gpumem", "8192")][..],
        &[("nvidia.com/gpu", "2")][..],
    ] {
        let any = selection(resources).ok().flatten().unwrap_or_default();
        assert!(any.allows("GPU-a", &mps), "{resources:?}");
    }
}

#[test]
fn every_name() {
    assert_eq!(request(&[]), Ok(None));
    assert_eq!(
        request(&[(GPU_SHARED, "50")]),
        Ok(Some(GpuRequest {
            count: 1,
            core: 50,
            memory: GpuMemory::Ratio(50)
        }))
    );
    assert_eq!(
        request(&[(GPU_SHARED, "200")]),
        Ok(Some(GpuRequest {
            count: 2,
            core: 100,
            memory: GpuMemory::Ratio(100)
        }))
    );
    assert_eq!(
        request(&[(GPU_CORE, "25"), (GPU_MEMORY, "8Gi")]),
        Ok(Some(GpuRequest {
            count: 1,
            core: 25,
            memory: GpuMemory::Bytes(8 << 30)
        }))
    );
    assert_eq!(
        request(&[(GPU_MEMORY_RATIO, "30")]),
        Ok(Some(GpuRequest {
            count: 1,
            core: 0,
            memory: GpuMemory::Ratio(30)
        }))
    );
    assert_eq!(
        request(&[(NVIDIA_GPU, "2")]),
        Ok(Some(GpuRequest {
            count: 2,
            core: 100,
            memory: GpuMemory::Ratio(100)
        }))
    );
    assert_eq!(
        request(&[(ALIYUN_GPU_MEM, "8")]),
        Ok(Some(GpuRequest {
            count: 1,
            core: 0,
            memory: GpuMemory::Bytes(8 << 30)
        }))
    );
    assert_eq!(
        request(&[
            (NVIDIA_GPU, "2"),
            (HAMI_GPU_MEM, "4096"),
            (HAMI_GPU_CORES, "30")
        ]),
        Ok(Some(GpuRequest {
            count: 2,
            core: 30,
            memory: GpuMemory::Bytes(4096 << 20)
        }))
    );
    assert_eq!(
        request(&[(VOLCANO_GPU_MEMORY, "1024")]),
        Ok(Some(GpuRequest {
            count: 1,
            core: 0,
            memory: GpuMemory::Bytes(1 << 30)
        }))
    );
    assert!(
        request(&[(NVIDIA_GPU, "1")])
            .expect("valid")
            .expect("gpu")
            .is_whole()
    );
}

/// A compute share with no memory would be limited to "0m", which HAMi-core
/// reads as unlimited: refused as Koordinator refuses it, naming the resource.
#[test]
fn compute_only_requests_are_refused_naming_the_resource() {
    let refused = "container main: koordinator.sh/gpu-core 50 asks for GPU compute and no GPU memory: add koordinator.sh/gpu-memory or koordinator.sh/gpu-memory-ratio (Koordinator refuses koordinator.sh/gpu-core alone too), or ask koordinator.sh/gpu for both";
    assert_eq!(
        request(&[(GPU_CORE, "50")]).map_err(|e| e.to_string()),
        Err(refused.to_owned())
    );
    assert_eq!(
        request(&[(GPU_CORE, "50"), (GPU_MEMORY_RATIO, "0")]).map_err(|e| e.to_string()),
        Err(refused.to_owned())
    );
    assert!(
        request(&[(GPU_CORE, "200")])
            .expect_err("whole GPUs' compute alone")
            .to_string()
            .contains("koordinator.sh/gpu-core 200 asks for GPU compute and no GPU memory")
    );
    assert!(
        request(&[(GPU_CORE, "50"), (ALIYUN_GPU_MEM, "0")])
            .expect_err("no memory")
            .to_string()
            .contains("asks for GPU compute and no GPU memory")
    );
    // HAMi's compute alone books each GPU's whole memory (its defaultMem 0).
    assert_eq!(
        request(&[(HAMI_GPU_CORES, "30")]),
        Ok(Some(GpuRequest {
            count: 1,
            core: 30,
            memory: GpuMemory::Ratio(100)
        }))
    );
}

#[test]
fn invalid_requests_say_why() {
    let error = request(&[(GPU_CORE, "150")])
        .expect_err("not a multiple")
        .to_string();
    assert_eq!(
        error,
        "container main: koordinator.sh/gpu-core 150: values above 100 must be multiples of 100 (whole GPUs)"
    );
    assert!(
        request(&[(NVIDIA_GPU, "1"), (GPU_CORE, "50")])
            .expect_err("mixed")
            .to_string()
            .contains("cannot be combined")
    );
    assert!(
        request(&[(GPU_MEMORY, "1Gi"), (GPU_MEMORY_RATIO, "10")])
            .expect_err("both")
            .to_string()
            .contains("cannot both be set")
    );
    assert!(
        request(&[(GPU_CORE, "x")])
            .expect_err("syntax")
            .to_string()
            .contains("koordinator.sh/gpu-core: expected a quantity")
    );
    assert!(
        request(&[(GPU_CORE, "200"), (GPU_MEMORY_RATIO, "300")])
            .expect_err("counts")
            .to_string()
            .contains("different numbers")
    );
}

fn sidecar(name: &str, resources: &[(&str, &str)]) -> Container {
    Container {
        restart_policy: Some("Always".into()),
        ..container(name, resources)
    }
}

fn shares(core: u64, ratio: u64) -> GpuRequest {
    GpuRequest {
        count: 1,
        core,
        memory: GpuMemory::Ratio(ratio),
    }
}

fn pod_request(apps: Vec<Container>, init: Vec<Container>) -> PodGpuRequest {
    pod_gpu_request(&pod(apps, init), &RequestOptions::default())
        .expect("valid")
        .expect("asks for GPUs")
}

/// Replaces the old `apps_sum_and_init_containers_take_the_max`, whose
/// assertion (one pod-level request of 50) was the bug: each container keeps
/// its own request, and the pod's total follows Kubernetes' rule.
#[test]
fn each_container_keeps_its_own_request() {
    let apps = vec![
        container("a", &[(GPU_CORE, "20"), (GPU_MEMORY_RATIO, "20")]),
        container("sidecar-without-gpu", &[]),
        container("b", &[(GPU_CORE, "30"), (GPU_MEMORY_RATIO, "30")]),
    ];
    let init = vec![container(
        "i",
        &[(GPU_CORE, "40"), (GPU_MEMORY_RATIO, "40")],
    )];
    let request = pod_request(apps, init);
    let listed: Vec<(&str, ContainerRole, GpuRequest)> = request
        .containers
        .iter()
        .map(|c| (c.name.as_str(), c.role, c.gpu))
        .collect();
    assert_eq!(
        listed,
        [
            ("i", ContainerRole::Init, shares(40, 40)),
            ("a", ContainerRole::App, shares(20, 20)),
            ("b", ContainerRole::App, shares(30, 30)),
        ]
    );
    assert_eq!(request.phases(), [vec![0], vec![1, 2]]);
    assert_eq!(
        request.effective(),
        GpuTotals {
            gpus: 2,
            core: 50,
            memory_bytes: 0,
            memory_ratio: 50
        }
    );
}

/// 60 + 60 and 200 + 50 used to be summed into 120 and 250 "per GPU": never
/// schedulable, with a reason about free compute. They are valid shares.
#[test]
fn sums_above_100_that_are_not_whole_gpus_are_valid() {
    let request = pod_request(
        vec![
            container("a", &[(GPU_CORE, "60"), (GPU_MEMORY_RATIO, "60")]),
            container("b", &[(GPU_CORE, "60"), (GPU_MEMORY_RATIO, "60")]),
        ],
        vec![],
    );
    assert_eq!(request.containers[0].gpu, shares(60, 60));
    assert_eq!(request.containers[1].gpu, shares(60, 60));
    assert_eq!(request.effective().core, 120);
    let request = pod_request(
        vec![
            container("a", &[(GPU_SHARED, "200")]),
            container("b", &[(GPU_SHARED, "50")]),
        ],
        vec![],
    );
    assert_eq!(
        request.containers[0].gpu,
        GpuRequest {
            count: 2,
            core: 100,
            memory: GpuMemory::Ratio(100)
        }
    );
    assert_eq!(request.containers[1].gpu, shares(50, 50));
    assert_eq!(request.effective().core, 250);
    // One container's value above 100 still has to be whole GPUs.
    let error = pod_gpu_request(
        &pod(
            vec![container("ok", &[(GPU_CORE, "50")])],
            vec![container("bad", &[(GPU_CORE, "150")])],
        ),
        &RequestOptions::default(),
    )
    .expect_err("150 in one container");
    assert_eq!(
        error.to_string(),
        "init container bad: koordinator.sh/gpu-core 150: values above 100 must be multiples of 100 (whole GPUs)"
    );
}

/// The old rule took the init container with the larger (count, core) and
/// dropped the other's memory: 50% compute + 10% memory won over 10% + 40%.
#[test]
fn init_containers_are_maxed_per_resource() {
    let request = pod_request(
        vec![container(
            "app",
            &[(GPU_CORE, "50"), (GPU_MEMORY_RATIO, "10")],
        )],
        vec![container(
            "init",
            &[(GPU_CORE, "10"), (GPU_MEMORY_RATIO, "40")],
        )],
    );
    let effective = request.effective();
    assert_eq!((effective.core, effective.memory_ratio), (50, 40));
}

/// Native sidecars run beside the app containers: added, not maxed; an init
/// container after a sidecar runs beside it.
#[test]
fn native_sidecars_are_added() {
    let request = pod_request(
        vec![container("app", &[(GPU_SHARED, "40")])],
        vec![
            sidecar("proxy", &[(GPU_SHARED, "30")]),
            container("warmup", &[(GPU_SHARED, "60")]),
        ],
    );
    assert_eq!(
        request
            .containers
            .iter()
            .map(|c| c.role)
            .collect::<Vec<_>>(),
        [
            ContainerRole::Sidecar,
            ContainerRole::Init,
            ContainerRole::App
        ]
    );
    assert_eq!(request.phases(), [vec![0], vec![0, 1], vec![0, 2]]);
    // max(30 + 40, 30 + 60): the warm-up runs beside the sidecar.
    assert_eq!(request.effective().core, 90);
    let only_apps = pod_request(
        vec![container("app", &[(GPU_SHARED, "40")])],
        vec![sidecar("proxy", &[(GPU_SHARED, "30")])],
    );
    assert_eq!(only_apps.effective().core, 70, "the old rule said 40");
}

/// HAMi's names in two containers were summed into one request: 2 GPUs at
/// 60% and 8 GiB each, for two containers that asked for one GPU at 30% and 4 GiB.
#[test]
fn hami_requests_in_several_containers_do_not_double_count() {
    let hami = [
        (NVIDIA_GPU, "1"),
        (HAMI_GPU_MEM, "4096"),
        (HAMI_GPU_CORES, "30"),
    ];
    let request = pod_request(vec![container("a", &hami), container("b", &hami)], vec![]);
    for c in &request.containers {
        assert_eq!(
            c.gpu,
            GpuRequest {
                count: 1,
                core: 30,
                memory: GpuMemory::Bytes(4096 << 20)
            }
        );
    }
    assert_eq!(
        request.effective(),
        GpuTotals {
            gpus: 2,
            core: 60,
            memory_bytes: 8192 << 20,
            memory_ratio: 0
        }
    );
}

// === Kubernetes' rule, transcribed ===

/// `PodRequests` of k8s.io/component-helpers/resource (v1.33+), for resources
/// whose requests equal their limits (extended resources), with no pod overhead:
/// app containers summed; each restartable init container added to that sum and
/// to the running sidecars; each init container's request is its own plus the
/// sidecars before it (a sidecar's: the sidecars so far); the result is the
/// maximum of the sum and every init request, resource by resource.
fn kubernetes_pod_requests(pod: &Pod) -> BTreeMap<String, u64> {
    fn requests(container: &Container) -> BTreeMap<String, u64> {
        container
            .resources
            .iter()
            .flat_map(|r| r.limits.iter().flatten())
            .map(|(name, q)| (name.clone(), Quantity::parse(&q.0).expect("valid").value()))
            .collect()
    }
    fn add(into: &mut BTreeMap<String, u64>, other: &BTreeMap<String, u64>) {
        for (name, value) in other {
            *into.entry(name.clone()).or_default() += value;
        }
    }
    fn max(into: &mut BTreeMap<String, u64>, other: &BTreeMap<String, u64>) {
        for (name, value) in other {
            let entry = into.entry(name.clone()).or_default();
            *entry = (*entry).max(*value);
        }
    }
    let spec = pod.spec.as_ref().expect("spec");
    let mut reqs = BTreeMap::new();
    for container in &spec.containers {
        add(&mut reqs, &requests(container));
    }
    let mut restartable = BTreeMap::new();
    let mut init_reqs = BTreeMap::new();
    for container in spec.init_containers.iter().flatten() {
        let mut container_reqs = requests(container);
        if container.restart_policy.as_deref() == Some("Always") {
            add(&mut reqs, &container_reqs);
            add(&mut restartable, &container_reqs);
            container_reqs = restartable.clone();
        } else {
            add(&mut container_reqs, &restartable);
        }
        max(&mut init_reqs, &container_reqs);
    }
    max(&mut reqs, &init_reqs);
    reqs
}

/// A container of a generated pod: its role, and what it asks for.
fn generated_container(
    index: usize,
    role: u8,
    resources: Vec<(&'static str, String)>,
) -> (bool, Container) {
    let pairs: Vec<(&str, &str)> = resources.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut c = container(&format!("c{index}"), &pairs);
    if role == 1 {
        c.restart_policy = Some("Always".into());
    }
    (role != 2, c)
}

fn generated_pod(containers: Vec<(bool, Container)>) -> Pod {
    let (init, apps): (Vec<_>, Vec<_>) = containers.into_iter().partition(|(init, _)| *init);
    pod(
        apps.into_iter().map(|(_, c)| c).collect(),
        init.into_iter().map(|(_, c)| c).collect(),
    )
}

/// Shares in the Koordinator names: compute (never alone: Koordinator refuses
/// it) and memory ratio of at most one GPU, or whole GPUs; or no GPU at all.
fn koordinator_resources() -> impl proptest::strategy::Strategy<Value = Vec<(&'static str, String)>>
{
    use proptest::prelude::*;
    prop_oneof![
        Just(vec![]),
        (1u64..=100, 1u64..=100).prop_map(|(core, ratio)| vec![
            (GPU_CORE, core.to_string()),
            (GPU_MEMORY_RATIO, ratio.to_string())
        ]),
        (1u64..=100).prop_map(|ratio| vec![(GPU_MEMORY_RATIO, ratio.to_string())]),
        (1u64..=3).prop_map(|n| vec![
            (GPU_CORE, (n * 100).to_string()),
            (GPU_MEMORY_RATIO, (n * 100).to_string())
        ]),
    ]
}

proptest::proptest! {
    /// Our effective request is Kubernetes' for every mix of init containers,
    /// sidecars and app containers, in any order.
    #[test]
    fn effective_request_is_kubernetes_own(
        spec in proptest::collection::vec((0u8..3, koordinator_resources()), 1..8),
    ) {
        let pod = generated_pod(
            spec.into_iter().enumerate().map(|(i, (role, r))| generated_container(i, role, r)).collect(),
        );
        let kubernetes = kubernetes_pod_requests(&pod);
        let ours = pod_gpu_request(&pod, &RequestOptions::default()).expect("valid");
        let effective = ours.as_ref().map(PodGpuRequest::effective).unwrap_or_default();
        proptest::prop_assert_eq!(effective.core, kubernetes.get(GPU_CORE).copied().unwrap_or(0));
        proptest::prop_assert_eq!(effective.memory_ratio, kubernetes.get(GPU_MEMORY_RATIO).copied().unwrap_or(0));
        proptest::prop_assert_eq!(ours.is_none(), kubernetes.values().all(|v| *v == 0));
    }

    /// The same for whole GPUs asked with `nvidia.com/gpu`.
    #[test]
    fn effective_whole_gpus_are_kubernetes_own(
        spec in proptest::collection::vec((0u8..3, 0u64..4), 1..8),
    ) {
        let pod = generated_pod(
            spec.into_iter().enumerate().map(|(i, (role, n))| {
                let resources = if n == 0 { vec![] } else { vec![(NVIDIA_GPU, n.to_string())] };
                generated_container(i, role, resources)
            }).collect(),
        );
        let kubernetes = kubernetes_pod_requests(&pod).get(NVIDIA_GPU).copied().unwrap_or(0);
        let effective = pod_gpu_request(&pod, &RequestOptions::default())
            .expect("valid")
            .map(|r| r.effective())
            .unwrap_or_default();
        proptest::prop_assert_eq!(effective.gpus, kubernetes);
        proptest::prop_assert_eq!(effective.core, kubernetes * 100);
        proptest::prop_assert_eq!(effective.memory_ratio, kubernetes * 100);
    }
}
