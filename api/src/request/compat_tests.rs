//! One table per system Tessera stands in for: manifests written the way that
//! system's own documentation writes them, and the request Tessera reads from each.

use super::selection::{GpuMatch, LabelOperator, LabelRequirement};
use super::*;
use crate::resources::LABEL_GPU_MODEL;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// What a manifest should read as: each GPU container's request, or the error.
type Expected = Result<Vec<GpuRequest>, &'static str>;

fn gpus(count: u32, core: u64, memory: GpuMemory) -> GpuRequest {
    GpuRequest {
        count,
        core,
        memory,
    }
}

fn parse(manifest: &str, options: &RequestOptions) -> Result<Option<PodGpuRequest>, RequestError> {
    let pod: Pod = serde_yaml::from_str(manifest).expect("the manifest is a Pod");
    pod_gpu_request(&pod, options)
}

fn check(system: &str, cases: &[(&str, &str, Expected)], options: &RequestOptions) {
    for (name, manifest, expected) in cases {
        let got = parse(manifest, options)
            .map(|request| {
                request
                    .map(|r| r.containers.iter().map(|c| c.gpu).collect::<Vec<_>>())
                    .unwrap_or_default()
            })
            .map_err(|e| e.to_string());
        match (expected, &got) {
            (Ok(want), Ok(got)) => assert_eq!(got, want, "{system} {name}"),
            (Err(want), Err(got)) => assert_eq!(got, want, "{system} {name}"),
            _ => panic!("{system} {name}: expected {expected:?}, got {got:?}"),
        }
    }
}

// === HAMi (README, docs/ and examples/nvidia/) ===

#[test]
fn hami() {
    let cases: &[(&str, &str, Expected)] = &[
        (
            "default_use.yaml",
            r#"
apiVersion: v1
kind: Pod
metadata:
  name: gpu-pod
spec:
  containers:
    - name: ubuntu-container
      image: ubuntu:18.04
      command: ["bash", "-c", "sleep 86400"]
      resources:
        limits:
          nvidia.com/gpu: 2 # requesting 2 vGPUs
          nvidia.com/gpumem: 3000 # Each vGPU contains 3000m device memory （Optional,Integer）
          nvidia.com/gpucores: 30 # Each vGPU uses 30% of the entire GPU （Optional,Integer)
"#,
            Ok(vec![gpus(2, 30, GpuMemory::Bytes(3000 * MIB))]),
        ),
        (
            "use_memory_fraction.yaml",
            r#"
apiVersion: v1
kind: Pod
metadata:
  name: gpu-pod
spec:
  containers:
    - name: ubuntu-container
      image: ubuntu:18.04
      command: ["bash", "-c", "sleep 86400"]
      resources:
        limits:
          nvidia.com/gpu: 2 # requesting 2 vGPUs
          nvidia.com/gpumem-percentage: 50 # Each vGPU contains 50% device memory of that GPU （Optional,Integer)
          nvidia.com/gpucores: 30 # Each vGPU uses 30% of the entire GPU （Optional,Integer)
"#,
            Ok(vec![gpus(2, 30, GpuMemory::Ratio(50))]),
        ),
        (
            "cores only: HAMi gives each GPU's whole memory (defaultMem 0)",
            r#"
apiVersion: v1
kind: Pod
metadata: {name: gpu-pod}
spec:
  containers:
    - name: ubuntu-container
      image: ubuntu:18.04
      resources:
        limits:
          nvidia.com/gpu: 1
          nvidia.com/gpucores: 30
"#,
            Ok(vec![gpus(1, 30, GpuMemory::Ratio(100))]),
        ),
        (
            "gpumem-percentage 0 reads as unset, as in HAMi",
            r#"
apiVersion: v1
kind: Pod
metadata: {name: gpu-pod}
spec:
  containers:
    - name: c
      image: ubuntu:18.04
      resources:
        limits:
          nvidia.com/gpu: 1
          nvidia.com/gpumem-percentage: 0
          nvidia.com/gpucores: 20
"#,
            Ok(vec![gpus(1, 20, GpuMemory::Ratio(100))]),
        ),
        (
            "gpumem and gpumem-percentage conflict",
            r#"
apiVersion: v1
kind: Pod
metadata: {name: gpu-pod}
spec:
  containers:
    - name: ubuntu-container
      image: ubuntu:18.04
      resources:
        limits:
          nvidia.com/gpu: 1
          nvidia.com/gpumem: 3000
          nvidia.com/gpumem-percentage: 50
"#,
            Err(
                "container ubuntu-container: nvidia.com/gpumem and nvidia.com/gpumem-percentage cannot both be set: memory is either MiB or a percent of each GPU",
            ),
        ),
        (
            "gpumem-percentage above 100",
            r#"
apiVersion: v1
kind: Pod
metadata: {name: gpu-pod}
spec:
  containers:
    - name: c
      image: ubuntu:18.04
      resources:
        limits:
          nvidia.com/gpu: 1
          nvidia.com/gpumem-percentage: 150
"#,
            Err(
                "container c: nvidia.com/gpumem-percentage 150: at most 100 (percent of each GPU's memory)",
            ),
        ),
        (
            "gpumem 0 reads as unset, as in HAMi",
            r#"
apiVersion: v1
kind: Pod
metadata: {name: gpu-pod}
spec:
  containers:
    - name: c
      image: ubuntu:18.04
      resources:
        limits:
          nvidia.com/gpu: 1
          nvidia.com/gpumem: 0
          nvidia.com/gpucores: 20
"#,
            Ok(vec![gpus(1, 20, GpuMemory::Ratio(100))]),
        ),
        (
            "every HAMi name at 0 reads as none: nvidia.com/gpu alone, whole GPUs",
            r#"
apiVersion: v1
kind: Pod
metadata: {name: gpu-pod}
spec:
  containers:
    - name: c
      image: ubuntu:18.04
      resources:
        limits:
          nvidia.com/gpu: 2
          nvidia.com/gpumem: 0
          nvidia.com/gpumem-percentage: 0
          nvidia.com/gpucores: 0
"#,
            Ok(vec![gpus(2, 100, GpuMemory::Ratio(100))]),
        ),
        (
            "a HAMi name at 0 alone is one GPU by its presence, as HAMi's webhook gives",
            r#"
apiVersion: v1
kind: Pod
metadata: {name: gpu-pod}
spec:
  containers:
    - name: c
      image: ubuntu:18.04
      resources:
        limits:
          nvidia.com/gpumem: 0
"#,
            Ok(vec![gpus(1, 0, GpuMemory::Ratio(100))]),
        ),
        (
            "a HAMi name at 0 beside nvidia.com/gpu and koordinator.sh/gpu: whole GPUs beside a share",
            r#"
apiVersion: v1
kind: Pod
metadata: {name: gpu-pod}
spec:
  containers:
    - name: c
      image: ubuntu:18.04
      resources:
        limits:
          nvidia.com/gpu: 1
          nvidia.com/gpumem: 0
          koordinator.sh/gpu: 50
"#,
            Err(
                "container c: nvidia.com/gpu cannot be combined with koordinator.sh/* GPU resources",
            ),
        ),
        (
            "gpucores above 100",
            r#"
apiVersion: v1
kind: Pod
metadata: {name: gpu-pod}
spec:
  containers:
    - name: c
      image: ubuntu:18.04
      resources:
        limits:
          nvidia.com/gpu: 1
          nvidia.com/gpucores: 150
"#,
            Err("container c: nvidia.com/gpucores 150: at most 100 (percent of one GPU)"),
        ),
        (
            "HAMi names with a koordinator share",
            r#"
apiVersion: v1
kind: Pod
metadata: {name: both}
spec:
  containers:
    - name: c
      image: x
      resources: {limits: {nvidia.com/gpumem: 1000, koordinator.sh/gpu-core: 50, koordinator.sh/gpu-memory-ratio: 50}}
"#,
            Err(
                "container c: HAMi's nvidia.com/gpumem, nvidia.com/gpumem-percentage and nvidia.com/gpucores cannot be combined with koordinator.sh/* GPU resources",
            ),
        ),
        (
            "HAMi names with volcano.sh/gpu-number",
            r#"
apiVersion: v1
kind: Pod
metadata: {name: both}
spec:
  containers:
    - name: c
      image: x
      resources: {limits: {volcano.sh/gpu-number: 1, nvidia.com/gpumem: 1000}}
"#,
            Err(
                "container c: volcano.sh/gpu-number cannot be combined with HAMi's names: the count is nvidia.com/gpu",
            ),
        ),
    ];
    check("HAMi", cases, &RequestOptions::default());
}

/// `examples/nvidia/specify_card_type_to_use.yaml`, `specify_scheduling_policy.yaml`
/// and the UUID annotations of HAMi's docs.
#[test]
fn hami_annotations() {
    let manifest = r#"
apiVersion: v1
kind: Pod
metadata:
  name: gpu-pod
  annotations:
    nvidia.com/use-gputype: "A100,V100" # Specify the card type for this job, use comma to separate, will not launch job on non-specified card
    nvidia.com/nouse-gpuuuid: "GPU-123456"
    hami.io/node-scheduler-policy: "spread"
    hami.io/gpu-scheduler-policy: "binpack"
spec:
  containers:
    - name: ubuntu-container
      image: ubuntu:18.04
      command: ["bash", "-c", "sleep 86400"]
      resources:
        limits:
          nvidia.com/gpu: 2 # requesting 2 vGPUs
"#;
    let request = parse(manifest, &RequestOptions::default())
        .expect("valid")
        .expect("asks for GPUs");
    assert_eq!(request.gpu_policy, Some(PlacementPolicy::Binpack));
    assert_eq!(request.node_policy, Some(PlacementPolicy::Spread));
    let matches: Vec<&GpuMatch> = request.selection.rules.iter().map(|r| &r.matches).collect();
    assert_eq!(
        matches,
        [
            &GpuMatch::ModelIn(vec!["A100".into(), "V100".into()]),
            &GpuMatch::UuidNotIn(vec!["GPU-123456".into()]),
        ]
    );
    let model = |m: &str| BTreeMap::from([(LABEL_GPU_MODEL.to_owned(), m.to_owned())]);
    // HAMi: the type is a substring of the model, in any case.
    assert!(
        request
            .selection
            .allows("GPU-a", &model("NVIDIA-A100-SXM4-80GB"))
    );
    assert!(
        request
            .selection
            .allows("GPU-a", &model("Tesla-V100-PCIE-32GB"))
    );
    assert!(
        !request
            .selection
            .allows("GPU-a", &model("NVIDIA-H100-80GB-HBM3"))
    );
    assert!(
        !request
            .selection
            .allows("GPU-123456", &model("NVIDIA-A100-SXM4-80GB"))
    );
    assert!(
        !request.selection.allows("GPU-a", &BTreeMap::new()),
        "no model reported"
    );
    assert_eq!(
        request.selection.describe(),
        r#"nvidia.com/use-gputype="A100,V100", nvidia.com/nouse-gpuuuid="GPU-123456""#
    );

    let with = |key: &str, value: &str| {
        let annotated = format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: gpu-pod\n  annotations: {{{key}: {value:?}}}\nspec:\n  containers:\n  - {{name: c, image: x, resources: {{limits: {{nvidia.com/gpu: 1}}}}}}\n"
        );
        parse(&annotated, &RequestOptions::default())
            .expect("valid")
            .expect("asks for GPUs")
    };
    // HAMi's own type string (`NVIDIA-` + NVML's name) matches no model here.
    let hami_type = with("nvidia.com/use-gputype", "NVIDIA-NVIDIA A100-SXM4-80GB");
    assert!(
        !hami_type
            .selection
            .allows("GPU-a", &model("NVIDIA-A100-SXM4-80GB"))
    );
    // A GPU with no model reported is never ruled out by nouse-gputype.
    let not_v100 = with("nvidia.com/nouse-gputype", "V100");
    assert!(not_v100.selection.allows("GPU-a", &BTreeMap::new()));
    assert!(
        !not_v100
            .selection
            .allows("GPU-a", &model("Tesla-V100-PCIE-32GB"))
    );
}

#[test]
fn hami_annotations_refused() {
    let cases: &[(&str, &str, &str)] = &[
        (
            "hami.io/gpu-scheduler-policy",
            "pack",
            r#"annotation hami.io/gpu-scheduler-policy: "pack": "pack": expected binpack or spread, optionally with topology-aware or numa"#,
        ),
        (
            "hami.io/gpu-scheduler-policy",
            "binpack,spread",
            r#"annotation hami.io/gpu-scheduler-policy: "binpack,spread": names both binpack and spread"#,
        ),
        (
            "hami.io/gpu-scheduler-policy",
            "mutex",
            r#"annotation hami.io/gpu-scheduler-policy: "mutex": mutex (only idle GPUs) is not supported; ask for whole GPUs with nvidia.com/gpu instead"#,
        ),
        (
            "hami.io/node-scheduler-policy",
            "numa",
            r#"annotation hami.io/node-scheduler-policy: "numa": "numa": expected binpack or spread"#,
        ),
        (
            "nvidia.com/use-gputype",
            ", ,",
            r#"annotation nvidia.com/use-gputype: ", ,": names nothing between its commas"#,
        ),
        ("nvidia.com/use-gputype", "A100,  ", ""),
        ("nvidia.com/use-gpuuuid", "  ", ""),
        ("hami.io/gpu-scheduler-policy", "spread,topology-aware", ""),
        ("hami.io/gpu-scheduler-policy", "binpack,numa", ""),
    ];
    let annotated = |key: &str, value: &str| {
        let mut pod: Pod = serde_yaml::from_str(
            r#"
apiVersion: v1
kind: Pod
metadata: {name: gpu-pod}
spec:
  containers:
    - name: c
      image: ubuntu:18.04
      resources: {limits: {nvidia.com/gpu: 1}}
"#,
        )
        .expect("pod");
        pod.metadata.annotations = Some([(key.to_owned(), value.to_owned())].into());
        pod_gpu_request(&pod, &RequestOptions::default())
    };
    for (key, value, expected) in cases {
        match annotated(key, value) {
            Ok(_) => assert_eq!(*expected, "", "{key}={value:?} was accepted"),
            Err(error) => assert_eq!(error.to_string(), *expected, "{key}={value:?}"),
        }
    }
    // topology-aware and numa change nothing: the policy is binpack or spread alone.
    for (value, policy) in [
        ("binpack,numa", PlacementPolicy::Binpack),
        ("spread,topology-aware", PlacementPolicy::Spread),
    ] {
        let request = annotated("hami.io/gpu-scheduler-policy", value)
            .expect("valid")
            .expect("asks for GPUs");
        assert_eq!(request.gpu_policy, Some(policy), "{value}");
        assert!(request.selection.is_empty(), "{value}");
    }
}

// === Volcano (docs/user-guide/how_to_use_gpu_number.md, how_to_use_gpu_sharing.md) ===

#[test]
fn volcano() {
    let gpu_memory = r#"
apiVersion: v1
kind: Pod
metadata:
  name: gpu-pod1
spec:
  schedulerName: volcano
  containers:
    - name: cuda-container
      image: nvidia/cuda:9.0-devel
      command: ["sleep"]
      args: ["100000"]
      resources:
        limits:
          volcano.sh/gpu-memory: 1024 # requesting 1024MB GPU memory
"#;
    let cases: &[(&str, &str, Expected)] = &[
        (
            "gpu-number",
            r#"
apiVersion: v1
kind: Pod
metadata:
  name: gpu-pod1
spec:
  schedulerName: volcano
  containers:
    - name: cuda-container
      image: nvidia/cuda:9.0-devel
      command: ["sleep"]
      args: ["100000"]
      resources:
        limits:
          volcano.sh/gpu-number: 1 # requesting 1 gpu cards
"#,
            Ok(vec![gpus(1, 100, GpuMemory::Ratio(100))]),
        ),
        (
            "gpu-number 2",
            r#"
apiVersion: v1
kind: Pod
metadata: {name: gpu-pod2}
spec:
  schedulerName: volcano
  containers:
    - name: cuda-container
      image: nvidia/cuda:9.0-devel
      resources:
        limits:
          volcano.sh/gpu-number: 2
"#,
            Ok(vec![gpus(2, 100, GpuMemory::Ratio(100))]),
        ),
        (
            "gpu-memory",
            gpu_memory,
            Ok(vec![gpus(1, 0, GpuMemory::Bytes(1024 * MIB))]),
        ),
        (
            "gpu-number with nvidia.com/gpu",
            r#"
apiVersion: v1
kind: Pod
metadata: {name: both}
spec:
  containers:
    - name: c
      image: x
      resources: {limits: {volcano.sh/gpu-number: 1, nvidia.com/gpu: 1}}
"#,
            Err(
                "container c: nvidia.com/gpu and volcano.sh/gpu-number cannot both be set: each asks for whole GPUs",
            ),
        ),
        (
            "gpu-number with gpu-memory",
            r#"
apiVersion: v1
kind: Pod
metadata: {name: both}
spec:
  containers:
    - name: c
      image: x
      resources: {limits: {volcano.sh/gpu-number: 1, volcano.sh/gpu-memory: 1024}}
"#,
            Err(
                "container c: volcano.sh/gpu-number asks for whole GPUs, with all their memory, and volcano.sh/gpu-memory for memory on one GPU: give one of them",
            ),
        ),
        (
            "gpu-number with a koordinator share",
            r#"
apiVersion: v1
kind: Pod
metadata: {name: both}
spec:
  containers:
    - name: c
      image: x
      resources: {limits: {volcano.sh/gpu-number: 1, koordinator.sh/gpu-core: 50}}
"#,
            Err(
                "container c: volcano.sh/gpu-number cannot be combined with koordinator.sh/* GPU resources",
            ),
        ),
        (
            "gpu-number with gpushare's memory",
            r#"
apiVersion: v1
kind: Pod
metadata: {name: both}
spec:
  containers:
    - name: c
      image: x
      resources: {limits: {volcano.sh/gpu-number: 1, aliyun.com/gpu-mem: 2}}
"#,
            Err(
                "container c: volcano.sh/gpu-number asks for whole GPUs, with all their memory, and aliyun.com/gpu-mem for memory on one GPU: give one of them",
            ),
        ),
        (
            "gpu-number with HAMi's memory",
            r#"
apiVersion: v1
kind: Pod
metadata: {name: both}
spec:
  containers:
    - name: c
      image: x
      resources: {limits: {volcano.sh/gpu-number: 1, nvidia.com/gpumem: 1000}}
"#,
            Err(
                "container c: volcano.sh/gpu-number cannot be combined with HAMi's names: the count is nvidia.com/gpu",
            ),
        ),
    ];
    check("Volcano", cases, &RequestOptions::default());
    // --volcano-memory-unit: bytes in one unit of volcano.sh/gpu-memory.
    check(
        "Volcano (--volcano-memory-unit 1GiB)",
        &[(
            "gpu-memory",
            gpu_memory,
            Ok(vec![gpus(1, 0, GpuMemory::Bytes(1024 * GIB))]),
        )],
        &RequestOptions {
            volcano_memory_unit: GIB,
            ..RequestOptions::default()
        },
    );
}

// === Volcano vGPU (volcano-sh/volcano@ed72c7c8 docs/user-guide/how_to_use_volcano_vgpu.md,
// Project-HAMi/volcano-vgpu-device-plugin@4fb76ba1 README.md and examples/) ===
//
// Read as Volcano's `ExtractResourceRequest` (pkg/scheduler/api/devices/util.go) reads them.

#[test]
fn volcano_vgpu() {
    let pod = |limits: &str| {
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: gpu-pod}}\nspec:\n  schedulerName: volcano\n  containers:\n  - {{name: c, image: x, resources: {{limits: {limits}}}}}\n"
        )
    };
    let hami_core_usage = r#"
metadata:
  name: hami-pod
  annotations:
    volcano.sh/vgpu-mode: "hami-core"
spec:
  schedulerName: volcano
  containers:
  - name: cuda-container
    image: nvidia/cuda:9.0-devel
    resources:
      limits:
        volcano.sh/vgpu-number: 1    # requesting 1 gpu cards
        volcano.sh/vgpu-cores: 50    # (optional)each vGPU uses 50%
        volcano.sh/vgpu-memory: 3000 # (optional)each vGPU uses 3G GPU memory
"#;
    let cases: &[(&str, &str, Expected)] = &[
        (
            "HAMI-core Usage",
            hami_core_usage,
            Ok(vec![gpus(1, 50, GpuMemory::Bytes(3000 * MIB))]),
        ),
        (
            "vgpu-mode: mig gets a HAMi-core share, not a MIG instance",
            &hami_core_usage.replace(r#"vgpu-mode: "hami-core""#, r#"vgpu-mode: "mig""#),
            Ok(vec![gpus(1, 50, GpuMemory::Bytes(3000 * MIB))]),
        ),
        (
            "GPU Exclusivity pod example",
            r#"
metadata:
  name: training-job
  labels:
    workloadType: training
spec:
  schedulerName: volcano
  containers:
  - name: trainer
    image: nvidia/cuda:12.0-base
    resources:
      limits:
        volcano.sh/vgpu-number: "4"
        volcano.sh/vgpu-memory: "16384"
"#,
            Ok(vec![gpus(4, 0, GpuMemory::Bytes(16384 * MIB))]),
        ),
        (
            "examples/vgpu-case03.yml: a container without GPU between two",
            r#"
apiVersion: v1
kind: Pod
metadata:
  name: gpu-pod12
spec:
  schedulerName: volcano
  containers:
    - name: ubuntu-container
      image: ubuntu:18.04
      command: ["bash", "-c", "sleep 86400"]
      resources:
        limits:
          volcano.sh/vgpu-number: 2 # requesting 2 vGPUs
          volcano.sh/vgpu-memory: 2000
          #volcano.sh/vgpu-memory-percentage: 50 #Each vGPU containers 50% device memory of that GPU. Can not be used with nvidia.com/gpumem
    - name: ubuntu-container0
      image: ubuntu:18.04
      command: ["bash", "-c", "sleep 86400"]
    - name: ubuntu-container1
      image: ubuntu:18.04
      command: ["bash", "-c", "sleep 86400"]
      resources:
        limits:
          volcano.sh/vgpu-number: 2 # requesting 2 vGPUs
          volcano.sh/vgpu-memory: 3000
"#,
            Ok(vec![
                gpus(2, 0, GpuMemory::Bytes(2000 * MIB)),
                gpus(2, 0, GpuMemory::Bytes(3000 * MIB)),
            ]),
        ),
        (
            "vgpu-case03.yml's commented percentage",
            &pod("{volcano.sh/vgpu-number: 2, volcano.sh/vgpu-memory-percentage: 50}"),
            Ok(vec![gpus(2, 0, GpuMemory::Ratio(50))]),
        ),
        (
            "2 distinct GPUs, each 3000 MiB and 50% compute",
            &pod(
                "{volcano.sh/vgpu-number: 2, volcano.sh/vgpu-memory: 3000, volcano.sh/vgpu-cores: 50}",
            ),
            Ok(vec![gpus(2, 50, GpuMemory::Bytes(3000 * MIB))]),
        ),
        (
            "number alone: the whole memory, 0% compute",
            &pod("{volcano.sh/vgpu-number: 1}"),
            Ok(vec![gpus(1, 0, GpuMemory::Ratio(100))]),
        ),
        (
            "0 of memory and cores reads as unset",
            &pod(
                "{volcano.sh/vgpu-number: 1, volcano.sh/vgpu-memory: 0, volcano.sh/vgpu-cores: 0}",
            ),
            Ok(vec![gpus(1, 0, GpuMemory::Ratio(100))]),
        ),
        (
            "0 of the memory percentage reads as unset",
            &pod("{volcano.sh/vgpu-number: 1, volcano.sh/vgpu-memory-percentage: 0}"),
            Ok(vec![gpus(1, 0, GpuMemory::Ratio(100))]),
        ),
        (
            "no memory name: each GPU's whole memory (MemPercentagereq 100)",
            &pod("{volcano.sh/vgpu-number: 1, volcano.sh/vgpu-cores: 30}"),
            Ok(vec![gpus(1, 30, GpuMemory::Ratio(100))]),
        ),
        (
            "memory alone: one vGPU (singledevice)",
            &pod("{volcano.sh/vgpu-memory: 3000}"),
            Ok(vec![gpus(1, 0, GpuMemory::Bytes(3000 * MIB))]),
        ),
        (
            "cores alone: Volcano reads no request",
            &pod("{volcano.sh/vgpu-cores: 50}"),
            Err(
                "container c: volcano.sh/vgpu-cores 50 alone asks Volcano for no vGPU (it reads one from volcano.sh/vgpu-number or volcano.sh/vgpu-memory): add volcano.sh/vgpu-number: 1",
            ),
        ),
        (
            "memory percentage alone: Volcano reads no request",
            &pod("{volcano.sh/vgpu-memory-percentage: 50}"),
            Err(
                "container c: volcano.sh/vgpu-memory-percentage 50 alone asks Volcano for no vGPU (it reads one from volcano.sh/vgpu-number or volcano.sh/vgpu-memory): add volcano.sh/vgpu-number: 1",
            ),
        ),
        (
            "memory and percentage",
            &pod(
                "{volcano.sh/vgpu-number: 1, volcano.sh/vgpu-memory: 3000, volcano.sh/vgpu-memory-percentage: 50}",
            ),
            Err(
                "container c: volcano.sh/vgpu-memory and volcano.sh/vgpu-memory-percentage cannot both be set: memory is either MiB or a percent of each GPU",
            ),
        ),
        (
            "cores above 100",
            &pod("{volcano.sh/vgpu-number: 1, volcano.sh/vgpu-cores: 150}"),
            Err("container c: volcano.sh/vgpu-cores 150: at most 100 (percent of one GPU)"),
        ),
        (
            "memory percentage above 100",
            &pod("{volcano.sh/vgpu-number: 1, volcano.sh/vgpu-memory-percentage: 150}"),
            Err(
                "container c: volcano.sh/vgpu-memory-percentage 150: at most 100 (percent of each GPU's memory)",
            ),
        ),
        (
            "with nvidia.com/gpu",
            &pod("{volcano.sh/vgpu-memory: 3000, nvidia.com/gpu: 1}"),
            Err(
                "container c: volcano.sh/vgpu-memory cannot be combined with nvidia.com/gpu: one system's names per container; Volcano's vGPU names are volcano.sh/vgpu-number, volcano.sh/vgpu-memory or volcano.sh/vgpu-memory-percentage, and volcano.sh/vgpu-cores",
            ),
        ),
        (
            "with a koordinator share",
            &pod("{volcano.sh/vgpu-number: 1, koordinator.sh/gpu-core: 50}"),
            Err(
                "container c: volcano.sh/vgpu-number cannot be combined with koordinator.sh/gpu-core: one system's names per container; Volcano's vGPU names are volcano.sh/vgpu-number, volcano.sh/vgpu-memory or volcano.sh/vgpu-memory-percentage, and volcano.sh/vgpu-cores",
            ),
        ),
        (
            "with HAMi's names",
            &pod("{volcano.sh/vgpu-number: 1, nvidia.com/gpumem: 1000}"),
            Err(
                "container c: volcano.sh/vgpu-number cannot be combined with nvidia.com/gpumem: one system's names per container; Volcano's vGPU names are volcano.sh/vgpu-number, volcano.sh/vgpu-memory or volcano.sh/vgpu-memory-percentage, and volcano.sh/vgpu-cores",
            ),
        ),
        (
            "with volcano.sh/gpu-memory",
            &pod("{volcano.sh/vgpu-number: 1, volcano.sh/gpu-memory: 1024}"),
            Err(
                "container c: volcano.sh/vgpu-number cannot be combined with volcano.sh/gpu-memory: one system's names per container; Volcano's vGPU names are volcano.sh/vgpu-number, volcano.sh/vgpu-memory or volcano.sh/vgpu-memory-percentage, and volcano.sh/vgpu-cores",
            ),
        ),
        (
            "number 0 asks for nothing",
            &pod("{volcano.sh/vgpu-number: 0}"),
            Ok(vec![]),
        ),
    ];
    check("Volcano vGPU", cases, &RequestOptions::default());
}

// === gpushare (gpushare-scheduler-extender docs/userguide.md) ===

#[test]
fn gpushare() {
    let userguide = r#"
apiVersion: v1
kind: Pod
metadata:
  name: binpack-1
spec:
  containers:
  - name: binpack-1
    image: cheyang/gpu-player:v2
    resources:
      limits:
        # GiB
        aliyun.com/gpu-mem: 3
"#;
    let seeded = r#"
apiVersion: v1
kind: Pod
metadata: {name: wants-8138}
spec:
  containers:
  - name: main
    image: x
    resources: {limits: {aliyun.com/gpu-mem: 8138}}
"#;
    check(
        "gpushare (GiB, its default)",
        &[
            (
                "userguide",
                userguide,
                Ok(vec![gpus(1, 0, GpuMemory::Bytes(3 * GIB))]),
            ),
            (
                "a MiB value read as GiB",
                seeded,
                Err(
                    "container main: aliyun.com/gpu-mem 8138: 8138 GiB is more than any GPU holds; gpushare counts GiB unless its device plugin runs with --memory-unit=MiB, and then tessera-scheduler needs --gpushare-memory-unit MiB",
                ),
            ),
        ],
        &RequestOptions::default(),
    );
    let mib = RequestOptions {
        gpushare_memory_unit: MemoryUnit::MiB,
        ..RequestOptions::default()
    };
    check(
        "gpushare (--memory-unit=MiB)",
        &[
            (
                "userguide",
                userguide,
                Ok(vec![gpus(1, 0, GpuMemory::Bytes(3 * MIB))]),
            ),
            (
                "8138 MiB",
                seeded,
                Ok(vec![gpus(1, 0, GpuMemory::Bytes(8138 * MIB))]),
            ),
        ],
        &mib,
    );
    assert_eq!("MiB".parse(), Ok(MemoryUnit::MiB));
    assert_eq!("gib".parse(), Ok(MemoryUnit::GiB));
    assert_eq!(
        "MB".parse::<MemoryUnit>()
            .expect_err("not a unit")
            .to_string(),
        r#"memory unit "MB": expected MiB or GiB"#
    );
}

// === Koordinator (docs: fine-grained device scheduling, device-allocate-hint) ===

#[test]
fn koordinator_hint() {
    let manifest = r#"
apiVersion: v1
kind: Pod
metadata:
  name: pod-example
  namespace: default
  annotations:
    scheduling.koordinator.sh/device-allocate-hint: |-
      {
        "gpu": {
          "selector": {
            "matchLabels": {"node.koordinator.sh/gpu-model": "NVIDIA-H100-80GB-HBM3"},
            "matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["b"]}]
          },
          "requiredTopologyScope": "Node"
        }
      }
spec:
  schedulerName: koord-scheduler
  containers:
  - name: main
    image: nginx:1.15.1
    resources:
      limits:
        cpu: "1"
        memory: "1Gi"
        koordinator.sh/gpu: "100"
"#;
    let request = parse(manifest, &RequestOptions::default())
        .expect("valid")
        .expect("asks for GPUs");
    assert_eq!(
        request.selection.rules[0].matches,
        GpuMatch::Labels(vec![
            LabelRequirement {
                key: LABEL_GPU_MODEL.into(),
                operator: LabelOperator::In,
                values: vec!["NVIDIA-H100-80GB-HBM3".into()]
            },
            LabelRequirement {
                key: "zone".into(),
                operator: LabelOperator::NotIn,
                values: vec!["b".into()]
            },
        ])
    );
    let h100 = BTreeMap::from([(
        LABEL_GPU_MODEL.to_owned(),
        "NVIDIA-H100-80GB-HBM3".to_owned(),
    )]);
    assert!(request.selection.allows("GPU-a", &h100));
    let mut zone_b = h100.clone();
    zone_b.insert("zone".into(), "b".into());
    assert!(!request.selection.allows("GPU-a", &zone_b));
    assert!(!request.selection.allows("GPU-a", &BTreeMap::new()));

    // Exists and DoesNotExist select by a label's presence alone.
    let mut pod: Pod = serde_yaml::from_str(manifest).expect("pod");
    pod.metadata.annotations = Some(
        [(
            selection::KOORDINATOR_DEVICE_ALLOCATE_HINT.to_owned(),
            r#"{"gpu": {"selector": {"matchExpressions": [{"key": "a", "operator": "Exists"}, {"key": "b", "operator": "DoesNotExist"}]}}}"#.to_owned(),
        )]
        .into(),
    );
    let presence = pod_gpu_request(&pod, &RequestOptions::default())
        .expect("valid")
        .expect("asks for GPUs");
    let labels = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    };
    assert!(presence.selection.allows("GPU-a", &labels(&[("a", "1")])));
    assert!(
        !presence
            .selection
            .allows("GPU-a", &labels(&[("a", "1"), ("b", "1")]))
    );
    assert!(!presence.selection.allows("GPU-a", &labels(&[])));

    let refused: &[(&str, &str)] = &[
        (
            r#"{"gpu": {"vfSelector": {}}}"#,
            "gpu.vfSelector: GPUs have no virtual functions here",
        ),
        (
            r#"{"rdma": {"vfSelector": {}}}"#,
            "rdma: Tessera allocates only gpu devices",
        ),
        (
            r#"{"gpu": {"allocateStrategy": "ApplyForAll"}}"#,
            r#"gpu.allocateStrategy "ApplyForAll": not supported; the GPU count comes from the resources"#,
        ),
        (
            r#"{"gpu": {"requiredTopologyScope": "Device"}}"#,
            r#"gpu.requiredTopologyScope "Device": expected Node, NUMANode or PCIe (Device scopes a GPU with its RDMA devices, which Tessera does not allocate)"#,
        ),
        (
            r#"{"gpu": {"exclusivePolicy": "DeviceLevel"}}"#,
            r#"gpu.exclusivePolicy "DeviceLevel": not supported"#,
        ),
        (
            r#"{"gpu": {"selector": {"matchExpressions": [{"key": "k", "operator": "Gt", "values": ["1"]}]}}}"#,
            r#"gpu.selector.matchExpressions[0].operator "Gt": expected In, NotIn, Exists or DoesNotExist"#,
        ),
        (
            r#"{"gpu": {"selector": {"matchExpressions": [{"key": "k", "operator": "In"}]}}}"#,
            "gpu.selector.matchExpressions[0]: In needs values",
        ),
        (
            r#"{"gpu": {"selector": {"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]}}}"#,
            "gpu.selector.matchExpressions[0]: Exists takes no values",
        ),
        (
            r#"["gpu"]"#,
            "not a map of device type to hint: invalid type: sequence, expected a map at line 1 column 0",
        ),
    ];
    for (hint, problem) in refused {
        let mut pod: Pod = serde_yaml::from_str(manifest).expect("pod");
        pod.metadata.annotations = Some(
            [(
                selection::KOORDINATOR_DEVICE_ALLOCATE_HINT.to_owned(),
                (*hint).to_owned(),
            )]
            .into(),
        );
        let error = pod_gpu_request(&pod, &RequestOptions::default()).expect_err(hint);
        assert_eq!(
            error.to_string(),
            format!(
                "annotation scheduling.koordinator.sh/device-allocate-hint: {hint:?}: {problem}"
            )
        );
    }
    // An empty hint, or one for a device type with nothing in it, asks nothing.
    let mut pod: Pod = serde_yaml::from_str(manifest).expect("pod");
    pod.metadata.annotations = Some(
        [(
            selection::KOORDINATOR_DEVICE_ALLOCATE_HINT.to_owned(),
            r#"{"gpu": {}, "rdma": null}"#.to_owned(),
        )]
        .into(),
    );
    let request = pod_gpu_request(&pod, &RequestOptions::default())
        .expect("valid")
        .expect("asks for GPUs");
    assert!(request.selection.is_empty());
}

/// Koordinator's required topology scopes, as its v1.6 release shows them
/// (koordinator-sh/website@48752606 blog/2025-02-24-release/index.md: "Allocate GPUs on the same
/// PCIe", "… on the same NUMA Node"): all the pod's GPUs under one PCIe switch or
/// on one NUMA node; `Node` is every placement.
#[test]
fn koordinator_required_topology_scopes() {
    use selection::TopologyScope;
    let pcie = r#"
apiVersion: v1
kind: Pod
metadata:
  annotations:
    scheduling.koordinator.sh/device-allocate-hint: |-
      {
        "gpu": {
          "requiredTopologyScope": "PCIe"
        }
      }
spec:
  containers:
    - resources:
        limits:
          koordinator.sh/gpu: 200
"#;
    // "… on the same NUMA Node": the same pod with that scope and four GPUs.
    let numa = pcie
        .replace("\"PCIe\"", "\"NUMANode\"")
        .replace("gpu: 200", "gpu: 400");
    for (manifest, count, scope) in [
        (pcie, 2, Some(TopologyScope::PcieSwitch)),
        (&numa, 4, Some(TopologyScope::NumaNode)),
        (&pcie.replace("PCIe", "Node"), 2, None),
    ] {
        let request = parse(manifest, &RequestOptions::default())
            .expect("valid")
            .expect("asks for GPUs");
        assert_eq!(request.containers[0].gpu.count, count);
        assert_eq!(request.selection.scope.as_ref().map(|s| s.scope), scope);
        assert!(
            request.selection.rules.is_empty(),
            "a scope selects no GPU by itself"
        );
        assert_eq!(request.selection.is_empty(), scope.is_none());
    }
    // A selector and a scope in one hint: one rule and one scope, named once.
    let both = pcie.replace(
        r#""requiredTopologyScope": "PCIe""#,
        r#""requiredTopologyScope": "PCIe", "selector": {"matchLabels": {"zone": "a"}}"#,
    );
    let request = parse(&both, &RequestOptions::default())
        .expect("valid")
        .expect("asks for GPUs");
    assert_eq!(request.selection.rules.len(), 1);
    assert!(request.selection.scope.is_some());
    assert_eq!(
        request
            .selection
            .describe()
            .matches("scheduling.koordinator.sh/device-allocate-hint")
            .count(),
        1
    );
}

/// `koordinator.sh/gpu.shared` (koordinator-sh/koordinator@a7a1b76b: the deviceshare
/// plugin's `ValidDeviceResourceCombinationsGPUShared` and
/// `calcDesiredRequestsAndCountForGPU`; docs/proposals/scheduling/20230803-enhance-gpu-share-api.md):
/// that many GPUs, the other names being totals over them.
#[test]
fn koordinator_gpu_shared() {
    let pod = |limits: &str| {
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: p}}\nspec:\n  schedulerName: koord-scheduler\n  containers:\n  - {{name: c, image: x, resources: {{limits: {limits}}}}}\n"
        )
    };
    let cases: &[(&str, &str, Expected)] = &[
        (
            // koordinator-sh/website@5123f048 docs/user-manuals/device-scheduling-gpu-share-with-hami.md
            "Use GPU Share With HAMi",
            r#"
apiVersion: v1
kind: Pod
metadata:
  name: pod-example
  namespace: default
  labels:
    koordinator.sh/gpu-isolation-provider: HAMi-core
spec:
  schedulerName: koord-scheduler
  containers:
  - command:
    - sleep
    - 365d
    image: nvidia/cuda:11.8.0-base-ubuntu22.04
    imagePullPolicy: IfNotPresent
    name: curlimage
    resources:
      limits:
        cpu: 4
        memory: 2Gi
        koordinator.sh/gpu.shared: 1
        koordinator.sh/gpu-core: 50
        koordinator.sh/gpu-memory-ratio: 50
      requests:
        cpu: 4
        memory: 2Gi
        koordinator.sh/gpu.shared: 1
        koordinator.sh/gpu-core: 50
        koordinator.sh/gpu-memory-ratio: 50
"#,
            Ok(vec![gpus(1, 50, GpuMemory::Ratio(50))]),
        ),
        (
            "the proposal's example: 4Gi and 100 over 2 GPUs",
            &pod(
                "{koordinator.sh/gpu-memory: 4Gi, koordinator.sh/gpu-core: 100, koordinator.sh/gpu.shared: 2}",
            ),
            Ok(vec![gpus(2, 50, GpuMemory::Bytes(2 * GIB))]),
        ),
        (
            "totals need not be whole GPUs",
            &pod(
                "{koordinator.sh/gpu.shared: 3, koordinator.sh/gpu-core: 150, koordinator.sh/gpu-memory-ratio: 150}",
            ),
            Ok(vec![gpus(3, 50, GpuMemory::Ratio(50))]),
        ),
        (
            "gpu.shared alone",
            &pod("{koordinator.sh/gpu.shared: 1}"),
            Err(
                "container c: koordinator.sh/gpu.shared 1 asks for no GPU memory: add koordinator.sh/gpu-memory or koordinator.sh/gpu-memory-ratio, the total over its GPUs (Koordinator refuses it without one too)",
            ),
        ),
        (
            "gpu.shared with gpu-core only",
            &pod("{koordinator.sh/gpu.shared: 2, koordinator.sh/gpu-core: 100}"),
            Err(
                "container c: koordinator.sh/gpu.shared 2 asks for no GPU memory: add koordinator.sh/gpu-memory or koordinator.sh/gpu-memory-ratio, the total over its GPUs (Koordinator refuses it without one too)",
            ),
        ),
        (
            "zero GPUs",
            &pod("{koordinator.sh/gpu.shared: 0, koordinator.sh/gpu-memory-ratio: 50}"),
            Err(
                "container c: koordinator.sh/gpu.shared 0: at least 1, the number of GPUs (Koordinator refuses 0 too)",
            ),
        ),
        (
            "a total that does not divide",
            &pod(
                "{koordinator.sh/gpu.shared: 3, koordinator.sh/gpu-core: 100, koordinator.sh/gpu-memory-ratio: 150}",
            ),
            Err(
                "container c: koordinator.sh/gpu-core 100: koordinator.sh/gpu.shared 3 spreads it over 3 GPUs, so it must be a multiple of 3 and at most 300",
            ),
        ),
        (
            "more than 100 per GPU",
            &pod("{koordinator.sh/gpu.shared: 2, koordinator.sh/gpu-memory-ratio: 300}"),
            Err(
                "container c: koordinator.sh/gpu-memory-ratio 300: koordinator.sh/gpu.shared 2 spreads it over 2 GPUs, so it must be a multiple of 2 and at most 200",
            ),
        ),
        (
            "with koordinator.sh/gpu",
            &pod("{koordinator.sh/gpu.shared: 1, koordinator.sh/gpu: 50}"),
            Err(
                "container c: koordinator.sh/gpu.shared and koordinator.sh/gpu cannot both be set (Koordinator refuses them together): with koordinator.sh/gpu.shared, ask koordinator.sh/gpu-core and koordinator.sh/gpu-memory-ratio",
            ),
        ),
        (
            "with nvidia.com/gpu",
            &pod(
                "{koordinator.sh/gpu.shared: 1, koordinator.sh/gpu-memory-ratio: 50, nvidia.com/gpu: 1}",
            ),
            Err(
                "container c: nvidia.com/gpu cannot be combined with koordinator.sh/* GPU resources",
            ),
        ),
    ];
    check("Koordinator gpu.shared", cases, &RequestOptions::default());
    // Koordinator's v1.6 release blog spells it gpu-shared: refused, naming the
    // name meant, as the admission policy refuses it at creation.
    let misspelled: &[(&str, &str, Expected)] = &[(
        "the v1.6 blog's spelling",
        &pod("{koordinator.sh/gpu-shared: 1, koordinator.sh/gpu-memory-ratio: 50}"),
        Err(
            "container c: koordinator.sh/gpu-shared 1: no such resource (Koordinator's v1.6 release notes spell it so; no node offers it, and the pod would wait forever): write koordinator.sh/gpu.shared: 1, the number of GPUs the share is spread over",
        ),
    )];
    check(
        "Koordinator gpu-shared",
        misspelled,
        &RequestOptions::default(),
    );
}

/// Koordinator's deprecated `kubernetes.io/gpu*` names (koordinator-sh/koordinator@a7a1b76b
/// apis/extension/deprecated.go) cannot reach the extender: kube-scheduler refuses a
/// `kubernetes.io/` name in `managedResources`. Refused, naming the new name; the
/// admission policy refuses them at creation with the same words.
#[test]
fn koordinator_deprecated_names() {
    let cases: &[(&str, &str, Expected)] = &[
        (
            // koordinator-sh/website@5123f048 docs/user-manuals/fine-grained-device-scheduling.md
            "apply pod",
            r#"
apiVersion: v1
kind: Pod
metadata:
  name: pod-example
  namespace: default
spec:
  schedulerName: koord-scheduler
  containers:
  - command:
    - sleep
    - 365d
    image: busybox
    imagePullPolicy: IfNotPresent
    name: curlimage
    resources:
      limits:
        cpu: 40m
        memory: 40Mi
      requests:
        cpu: 40m
        memory: 40Mi
        kubernetes.io/gpu: "100"
"#,
            Err(
                "container curlimage: kubernetes.io/gpu 100: Koordinator's deprecated name, which kube-scheduler never hands to an extender (no kubernetes.io/ resource is an extended resource): write koordinator.sh/gpu: 100 instead, with the same meaning",
            ),
        ),
        (
            "the same manual's gpu-core with gpu-memory",
            r#"
metadata: {name: p}
spec:
  initContainers:
  - name: warmup
    image: busybox
    resources:
      requests:
        cpu: 40m
        memory: 40Mi
        kubernetes.io/gpu-core: "100"
        kubernetes.io/gpu-memory: "16Mi"
  containers: [{name: c, image: x}]
"#,
            Err(
                "init container warmup: kubernetes.io/gpu-core 100: Koordinator's deprecated name, which kube-scheduler never hands to an extender (no kubernetes.io/ resource is an extended resource): write koordinator.sh/gpu-core: 100 instead, with the same meaning",
            ),
        ),
    ];
    check("Koordinator deprecated", cases, &RequestOptions::default());
}

/// A pod with annotations and no GPU resource asks for nothing: the annotations
/// are not read (and not refused).
#[test]
fn annotations_alone_ask_for_nothing() {
    let manifest = r#"
apiVersion: v1
kind: Pod
metadata:
  name: cpu
  annotations: {hami.io/gpu-scheduler-policy: "nonsense"}
spec:
  containers: [{name: c, image: x}]
"#;
    assert_eq!(parse(manifest, &RequestOptions::default()), Ok(None));
}

// === Sharing groups: Tessera's annotation, and KubeShare's GPUID ===

#[test]
fn sharing_groups() {
    // KubeShare's manifest once its gpu_request and gpu_mem are resources (the
    // admission policy translates them); the GPUID is read here.
    let kubeshare = r#"
apiVersion: v1
kind: Pod
metadata:
  name: sharepod1
  annotations:
    "lsalab.nthu/gpu_request": "0.5"
    "lsalab.nthu/gpu_limit": "0.5"
    "lsalab.nthu/gpu_mem": "1073741824"
    "lsalab.nthu/GPUID": "abcde"
spec:
  containers:
  - name: sleep
    image: busybox
    command: ["sh", "-c", "sleep infinity"]
    resources:
      limits:
        koordinator.sh/gpu-core: "50"
        koordinator.sh/gpu-memory: "1073741824"
"#;
    let request = parse(kubeshare, &RequestOptions::default())
        .expect("valid")
        .expect("asks for GPUs");
    // Groups are per namespace: the same name elsewhere is another group.
    assert_eq!(request.sharing_group.as_deref(), Some("default/abcde"));
    let mut elsewhere: Pod = serde_yaml::from_str(kubeshare).expect("pod");
    elsewhere.metadata.namespace = Some("team-b".into());
    let other = pod_gpu_request(&elsewhere, &RequestOptions::default())
        .expect("valid")
        .expect("asks for GPUs");
    assert_eq!(other.sharing_group.as_deref(), Some("team-b/abcde"));

    let with = |annotations: &[(&str, &str)], limits: &str| -> Result<Option<String>, String> {
        let mut pod: Pod = serde_yaml::from_str(&format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: p}}\nspec:\n  containers:\n  - {{name: c, image: x, resources: {{limits: {limits}}}}}\n"
        ))
        .expect("pod");
        pod.metadata.annotations = Some(
            annotations
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        );
        pod_gpu_request(&pod, &RequestOptions::default())
            .map(|r| r.and_then(|r| r.sharing_group))
            .map_err(|e| e.to_string())
    };
    let quarter = r#"{koordinator.sh/gpu: "25"}"#;
    assert_eq!(
        with(&[("tessera.io/sharing-group", " train ")], quarter),
        Ok(Some("default/train".into()))
    );
    assert_eq!(
        with(
            &[
                ("tessera.io/sharing-group", "a"),
                ("lsalab.nthu/GPUID", "a")
            ],
            quarter
        ),
        Ok(Some("default/a".into()))
    );
    assert_eq!(
        with(
            &[("tessera.io/sharing-group", "a"), ("lsalab.nthu/GPUID", "b")],
            quarter
        ),
        Err(r#"annotation lsalab.nthu/GPUID: "b": names another sharing group than tessera.io/sharing-group ("a")"#.into())
    );
    assert_eq!(
        with(&[("lsalab.nthu/GPUID", " ")], quarter),
        Err(r#"annotation lsalab.nthu/GPUID: " ": names no sharing group"#.into())
    );
    assert_eq!(
        with(&[("lsalab.nthu/GPUID", "abc")], r#"{nvidia.com/gpu: "2"}"#),
        Err(r#"annotation lsalab.nthu/GPUID: "abc": a sharing group shares one GPU; container c asks for 2"#.into())
    );
}

// === KubeShare 2.0's gpu_model label, as admission copies it ===

#[test]
fn kubeshare_gpu_model_is_an_exact_model() {
    // KubeShare 2.0's README pod, once admission has copied its labels to the
    // 1.x-form annotations and turned gpu_request into resources (no gpu_mem: a
    // memory share of the same fraction, as its "default depends on gpu_request").
    let pod = r#"
apiVersion: v1
kind: Pod
metadata:
  name: mnist
  labels:
    "sharedgpu/gpu_request": "0.5"
    "sharedgpu/gpu_limit": "1.0"
    "sharedgpu/gpu_model": "NVIDIA-GeForce-GTX-1080"
  annotations:
    "lsalab.nthu/gpu_request": "0.5"
    "lsalab.nthu/gpu_limit": "1.0"
    "lsalab.nthu/gpu_model": "NVIDIA-GeForce-GTX-1080"
spec:
  schedulerName: kubeshare-scheduler
  containers:
    - name: pytorch
      image: riyazhu/mnist:test
      resources:
        limits:
          koordinator.sh/gpu-core: "50"
          koordinator.sh/gpu-memory-ratio: "50"
"#;
    let request = parse(pod, &RequestOptions::default())
        .expect("valid")
        .expect("asks for GPUs");
    let model = |name: &str| {
        std::collections::BTreeMap::from([(
            crate::resources::LABEL_GPU_MODEL.to_owned(),
            name.to_owned(),
        )])
    };
    let allows = |name: &str| request.selection.allows("GPU-0", &model(name));
    assert!(allows("NVIDIA-GeForce-GTX-1080"));
    assert!(allows("nvidia-geforce-gtx-1080"));
    // Exactly that model, not one whose name contains it.
    assert!(!allows("NVIDIA-GeForce-GTX-1080-Ti"));
    assert!(!allows("NVIDIA-H100-80GB-HBM3"));
    assert_eq!(
        request.selection.describe(),
        r#"lsalab.nthu/gpu_model="NVIDIA-GeForce-GTX-1080""#
    );
    let blank = pod.replace(
        r#""lsalab.nthu/gpu_model": "NVIDIA-GeForce-GTX-1080""#,
        r#""lsalab.nthu/gpu_model": " ""#,
    );
    let refused = parse(&blank, &RequestOptions::default()).expect_err("no model");
    assert!(
        refused.to_string().contains("lsalab.nthu/gpu_model"),
        "{refused}"
    );
}
