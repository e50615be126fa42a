//! `tessera inspect`: per node and GPU, what is allocated to whom — from the same
//! Device CRs and pod annotations the scheduler reads.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use k8s_openapi::api::core::v1::{Node, Pod};
use serde::Serialize;
use tessera_api::resources::{DEVICE_ALLOCATED, ENFORCEMENT};
use tessera_api::{Device, DeviceAllocation, DeviceAllocations, LegacyDeviceEntry};

use crate::ledger::{device_gpus, placement_of, pod_name};

/// A pod's share of a GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuTenant {
    /// `namespace/name` (or the UID for a legacy pod not found).
    pub pod: String,
    /// Compute percent.
    pub core: u64,
    /// Memory bytes.
    pub memory: u64,
    /// Allocated by the NVIDIA device plugin (kubelet checkpoint), not by Tessera.
    pub legacy: bool,
    /// Each container's share of this GPU (per-container grants); empty for an
    /// annotation in the pod-level form, where every container gets the pod's share.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub containers: Vec<ContainerTenant>,
    /// For a share of a GPU: the backends that hold it, the node's
    /// (`driver-memory+hami-core`, `none`); none for a whole GPU, which needs none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enforcement: Option<String>,
    /// Bytes its containers hold on this GPU now, as the node's driver counts
    /// them (the reporter's `tessera.io/gpu-memory-used`, rounded up to 256 MiB);
    /// none when the node does not report it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_used: Option<u64>,
}

/// A container's share of a GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerTenant {
    /// The container's name.
    pub name: String,
    /// Compute percent.
    pub core: u64,
    /// Memory bytes (resolved from a ratio against the GPU's memory).
    pub memory: u64,
    /// Bytes it holds on this GPU now (see [`GpuTenant::memory_used`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_used: Option<u64>,
}

/// Memory a container holds on a GPU it was not granted: a GPU reached around
/// Tessera's grant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct UngrantedUse {
    /// `namespace/name` of its pod.
    pub pod: String,
    /// The container's name.
    pub container: String,
    /// Bytes it holds.
    pub memory_used: u64,
}

/// One GPU's row.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuRow {
    /// Device minor.
    pub minor: u32,
    /// `GPU-…`.
    pub uuid: String,
    /// Health from the reporter.
    pub healthy: bool,
    /// Compute percent allocated.
    pub core_allocated: u64,
    /// Memory bytes allocated.
    pub memory_allocated: u64,
    /// Memory bytes in total.
    pub memory_total: u64,
    /// Who holds it.
    pub pods: Vec<GpuTenant>,
    /// Containers using it that were not granted it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ungranted: Vec<UngrantedUse>,
}

/// One node's table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeReport {
    /// Node name.
    pub name: String,
    /// GPU model (node label), when known.
    pub model: String,
    /// The backends that hold shares on this node, as its reporter publishes them
    /// (`driver-memory+hami-core`, `none`); `unknown` from a reporter before enforcement.
    pub enforcement: String,
    /// The GPUs.
    pub gpus: Vec<GpuRow>,
}

/// Builds the report from the cluster's objects.
pub fn report(nodes: &[Node], devices: &[Device], pods: &[Pod]) -> Vec<NodeReport> {
    let by_uid: BTreeMap<&str, &Pod> = pods
        .iter()
        .filter_map(|p| Some((p.metadata.uid.as_deref()?, p)))
        .collect();
    let mut reports: Vec<NodeReport> = devices
        .iter()
        .filter_map(|device| {
            let name = device.metadata.name.clone()?;
            let gpus = device_gpus(device);
            let model = nodes
                .iter()
                .find(|n| n.metadata.name.as_deref() == Some(name.as_str()))
                .and_then(|n| {
                    n.metadata
                        .labels
                        .as_ref()?
                        .get("node.koordinator.sh/gpu-model")
                        .cloned()
                })
                .unwrap_or_default();
            let enforcement = device
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(ENFORCEMENT))
                .cloned()
                .unwrap_or_else(|| "unknown".into());
            let mut rows: Vec<GpuRow> = gpus
                .iter()
                .map(|g| GpuRow {
                    minor: g.minor,
                    uuid: g.uuid.clone(),
                    healthy: g.healthy,
                    core_allocated: 0,
                    memory_allocated: 0,
                    memory_total: g.memory_total,
                    pods: Vec::new(),
                    ungranted: Vec::new(),
                })
                .collect();
            for pod in pods {
                let on_node =
                    pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(name.as_str());
                let running = !matches!(
                    pod.status.as_ref().and_then(|s| s.phase.as_deref()),
                    Some("Succeeded" | "Failed")
                );
                let annotation = pod
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(DEVICE_ALLOCATED));
                let Some(allocations) = annotation
                    .and_then(|a| DeviceAllocations::parse(a).ok())
                    .filter(|_| on_node && running)
                else {
                    continue;
                };
                // `placement_of` keeps the annotation's order: entry by entry.
                let entries = allocations.gpus();
                for (entry, share) in entries.iter().zip(placement_of(&allocations, &gpus).gpus) {
                    if let Some(row) = rows.iter_mut().find(|r| r.uuid == share.uuid) {
                        let containers = entry
                            .containers
                            .iter()
                            .flatten()
                            .map(|(name, resources)| {
                                let one = DeviceAllocation {
                                    resources: resources.clone(),
                                    ..DeviceAllocation::default()
                                };
                                let memory = one.gpu_memory().unwrap_or_else(|| {
                                    one.gpu_memory_ratio().map_or(0, |ratio| {
                                        (u128::from(row.memory_total) * u128::from(ratio) / 100)
                                            as u64
                                    })
                                });
                                ContainerTenant {
                                    name: name.clone(),
                                    core: one.gpu_core().unwrap_or(0),
                                    memory,
                                    memory_used: None,
                                }
                            })
                            .collect();
                        row.core_allocated += share.core;
                        row.memory_allocated += share.memory;
                        let shared = share.core < 100 || share.memory < row.memory_total;
                        row.pods.push(GpuTenant {
                            pod: pod_name(pod),
                            core: share.core,
                            memory: share.memory,
                            legacy: false,
                            containers,
                            enforcement: shared.then(|| enforcement.clone()),
                            memory_used: None,
                        });
                    }
                }
            }
            // Unreadable, as the scheduler sees it: every GPU held by a device-plugin
            // pod it cannot name.
            let legacy = device.legacy_entries().unwrap_or_else(|_| {
                vec![LegacyDeviceEntry {
                    pod_uid: "(unreadable devices-checkpoints annotation)".into(),
                    device_ids: rows.iter().map(|r| r.uuid.clone()).collect(),
                    ..LegacyDeviceEntry::default()
                }]
            });
            for entry in legacy {
                for id in &entry.device_ids {
                    if let Some(row) = rows.iter_mut().find(|r| &r.uuid == id) {
                        let who = by_uid
                            .get(entry.pod_uid.as_str())
                            .map_or_else(|| entry.pod_uid.clone(), |p| pod_name(p));
                        row.core_allocated = 100;
                        row.memory_allocated = row.memory_total;
                        row.pods.push(GpuTenant {
                            pod: who,
                            core: 100,
                            memory: row.memory_total,
                            legacy: true,
                            containers: Vec::new(),
                            enforcement: None,
                            memory_used: None,
                        });
                    }
                }
            }
            if let Some(usage) = device
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(tessera_api::usage::DEVICE_ANNOTATION))
                .and_then(|text| tessera_api::usage::NodeGpuMemory::parse(text).ok())
            {
                with_usage(&mut rows, &usage);
            }
            rows.sort_by_key(|r| r.minor);
            Some(NodeReport {
                name,
                model,
                enforcement,
                gpus: rows,
            })
        })
        .collect();
    reports.sort_by(|a, b| a.name.cmp(&b.name));
    reports
}

/// Puts each container's use on its GPU's row: on its pod's share, or, for a
/// GPU it was not granted, in the row's `ungranted`.
fn with_usage(rows: &mut [GpuRow], usage: &tessera_api::usage::NodeGpuMemory) {
    for entry in &usage.containers {
        let Some(row) = rows.iter_mut().find(|r| r.uuid == entry.gpu) else {
            continue;
        };
        let pod = format!("{}/{}", entry.namespace, entry.pod);
        // A trusted GPU agent holds no share and breaks no grant.
        if entry.grant == tessera_api::usage::MemoryGrant::Trusted {
            continue;
        }
        if entry.grant == tessera_api::usage::MemoryGrant::None {
            row.ungranted.push(UngrantedUse {
                pod,
                container: entry.container.clone(),
                memory_used: entry.used,
            });
            continue;
        }
        let Some(tenant) = row.pods.iter_mut().find(|t| t.pod == pod) else {
            continue;
        };
        *tenant.memory_used.get_or_insert(0) += entry.used;
        if let Some(container) = tenant
            .containers
            .iter_mut()
            .find(|c| c.name == entry.container)
        {
            container.memory_used = Some(entry.used);
        }
    }
}

/// `, using 3.5 GiB` when the use is known.
fn using(used: Option<u64>) -> String {
    used.map(|u| format!(", using {:.1} GiB", gib(u)))
        .unwrap_or_default()
}

/// What a share was allocated: `25%, 20.0 GiB`, or `memory only, 20.0 GiB` for a
/// share with no compute (it is not held to any, rather than given none).
fn allocated(core: u64, memory: u64) -> String {
    if core == 0 {
        format!("memory only, {:.1} GiB", gib(memory))
    } else {
        format!("{core}%, {:.1} GiB", gib(memory))
    }
}

fn bar(fraction: f64) -> String {
    let filled = (fraction.clamp(0.0, 1.0) * 10.0).round() as usize;
    format!("[{}{}]", "#".repeat(filled), ".".repeat(10 - filled))
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 30)
}

/// The report cut down to pod `pod` (`namespace/name`): the GPUs it holds, with
/// it alone among their tenants (the GPU's allocated totals stay the GPU's), and
/// the uses of GPUs it was not granted. Empty when it holds none.
pub fn only_pod(reports: Vec<NodeReport>, pod: &str) -> Vec<NodeReport> {
    reports
        .into_iter()
        .filter_map(|mut node| {
            node.gpus.retain_mut(|gpu| {
                gpu.pods.retain(|tenant| tenant.pod == pod);
                gpu.ungranted.retain(|used| used.pod == pod);
                !gpu.pods.is_empty() || !gpu.ungranted.is_empty()
            });
            (!node.gpus.is_empty()).then_some(node)
        })
        .collect()
}

/// The report as a text table.
pub fn render(reports: &[NodeReport]) -> String {
    let mut out = String::new();
    for node in reports {
        let _ = writeln!(
            out,
            "NODE {}{}  shares held by: {}",
            node.name,
            if node.model.is_empty() {
                String::new()
            } else {
                format!("  ({})", node.model)
            },
            node.enforcement
        );
        let _ = writeln!(
            out,
            "  {:<5} {:<42} {:<9} {:<18} {:<28} PODS",
            "GPU", "UUID", "HEALTH", "CORE ALLOCATED", "MEMORY ALLOCATED (GiB)"
        );
        for gpu in &node.gpus {
            let core = format!(
                "{} {:>3}%",
                bar(gpu.core_allocated as f64 / 100.0),
                gpu.core_allocated
            );
            let memory = format!(
                "{} {:>5.1}/{:<5.1}",
                bar(gpu.memory_allocated as f64 / gpu.memory_total.max(1) as f64),
                gib(gpu.memory_allocated),
                gib(gpu.memory_total)
            );
            let pods: Vec<String> = gpu
                .pods
                .iter()
                .map(|p| {
                    if p.legacy {
                        format!("{} (legacy{})", p.pod, using(p.memory_used))
                    } else if p.containers.is_empty()
                        || matches!(p.containers.as_slice(), [only] if only.core == p.core && only.memory == p.memory)
                    {
                        // One container holding the pod's share: nothing more to say.
                        format!(
                            "{} ({}{})",
                            p.pod,
                            allocated(p.core, p.memory),
                            using(p.memory_used)
                        )
                    } else {
                        let containers: Vec<String> = p
                            .containers
                            .iter()
                            .map(|c| {
                                format!(
                                    "{} {}{}",
                                    c.name,
                                    allocated(c.core, c.memory),
                                    using(c.memory_used)
                                )
                            })
                            .collect();
                        format!(
                            "{} ({}: {})",
                            p.pod,
                            allocated(p.core, p.memory),
                            containers.join("; ")
                        )
                    }
                })
                .chain(gpu.ungranted.iter().map(|u| {
                    format!(
                        "{} container {} NOT GRANTED this GPU, using {:.1} GiB",
                        u.pod,
                        u.container,
                        gib(u.memory_used)
                    )
                }))
                .collect();
            let _ = writeln!(
                out,
                "  {:<5} {:<42} {:<9} {:<18} {:<28} {}",
                gpu.minor,
                gpu.uuid,
                if gpu.healthy { "ok" } else { "UNHEALTHY" },
                core,
                memory,
                if pods.is_empty() {
                    "-".into()
                } else {
                    pods.join(", ")
                }
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_shares_and_legacy_pods() {
        let snapshot = crate::simulate::parse_snapshot(
            include_str!("../../docs/examples/cluster.yaml"),
            "cluster",
        )
        .expect("parses");
        let reports = report(&[], &snapshot.devices, &snapshot.pods);
        assert_eq!(reports.len(), 3);
        let n3 = &reports[2];
        assert_eq!(n3.gpus[0].memory_allocated, 8138 << 20);
        assert_eq!(n3.gpus[0].pods[0].pod, "default/n3-a");
        let text = render(&reports);
        assert!(text.contains("NODE n3"), "{text}");
        assert!(
            text.contains("default/n3-a (memory only, 7.9 GiB)"),
            "{text}"
        );
        // A reporter before enforcement publishes no backends.
        assert!(text.contains("shares held by: unknown"), "{text}");
    }

    #[test]
    fn shows_which_backends_hold_each_share() {
        let mut snapshot = crate::simulate::parse_snapshot(
            include_str!("../../docs/examples/cluster.yaml"),
            "cluster",
        )
        .expect("parses");
        for device in &mut snapshot.devices {
            device
                .metadata
                .annotations
                .get_or_insert_with(Default::default)
                .insert(ENFORCEMENT.to_owned(), "driver-memory".to_owned());
        }
        let reports = report(&[], &snapshot.devices, &snapshot.pods);
        let n3 = &reports[2];
        assert_eq!(n3.enforcement, "driver-memory");
        // n3-a holds part of its GPU: held by the node's backends.
        assert_eq!(
            n3.gpus[0].pods[0].enforcement.as_deref(),
            Some("driver-memory")
        );
        let whole: Vec<&GpuTenant> = reports
            .iter()
            .flat_map(|n| &n.gpus)
            .flat_map(|g| &g.pods)
            .filter(|p| p.core == 100)
            .collect();
        assert!(
            whole.iter().all(|p| p.enforcement.is_none()),
            "a whole GPU needs no limiter: {whole:?}"
        );
        assert!(render(&reports).contains("NODE n3  shares held by: driver-memory"));
    }

    /// Node n1 with one 16 GiB GPU, and pod default/two whose containers a and b
    /// hold a quarter of it each (its sidecar nothing).
    const TWO_CONTAINERS: &str = r#"
apiVersion: v1
kind: List
items:
- apiVersion: scheduling.koordinator.sh/v1alpha1
  kind: Device
  metadata: {name: n1}
  spec:
    devices:
    - {type: gpu, id: GPU-a, minor: 0, health: true, resources: {koordinator.sh/gpu-memory: "17179869184"}}
- apiVersion: v1
  kind: Pod
  metadata:
    name: two
    namespace: default
    uid: u1
    annotations:
      scheduling.koordinator.sh/device-allocated: '{"gpu":[{"minor":0,"id":"GPU-a","resources":{"koordinator.sh/gpu-core":50,"koordinator.sh/gpu-memory-ratio":50},"extension":{"containers":{"a":{"koordinator.sh/gpu-core":25,"koordinator.sh/gpu-memory-ratio":25},"b":{"koordinator.sh/gpu-core":25,"koordinator.sh/gpu-memory-ratio":25}}}}]}'
  spec:
    nodeName: n1
    containers: [{name: a, image: x}, {name: b, image: x}, {name: sidecar, image: x}]
  status: {phase: Running}
"#;

    #[test]
    fn shows_each_containers_share() {
        let text = TWO_CONTAINERS;
        let snapshot = crate::simulate::parse_snapshot(text, "cluster").expect("parses");
        let reports = report(&[], &snapshot.devices, &snapshot.pods);
        let tenant = &reports[0].gpus[0].pods[0];
        assert_eq!((tenant.core, tenant.memory), (50, 8 << 30));
        assert_eq!(
            tenant.containers,
            [
                ContainerTenant {
                    name: "a".into(),
                    core: 25,
                    memory: 4 << 30,
                    memory_used: None,
                },
                ContainerTenant {
                    name: "b".into(),
                    core: 25,
                    memory: 4 << 30,
                    memory_used: None,
                }
            ]
        );
        let rendered = render(&reports);
        assert!(
            rendered.contains("default/two (50%, 8.0 GiB: a 25%, 4.0 GiB; b 25%, 4.0 GiB)"),
            "{rendered}"
        );
    }

    #[test]
    fn shows_each_containers_memory_use_and_use_not_granted() {
        let used = r#"{"containers":[{"namespace":"default","pod":"two","podUid":"u1","container":"a","gpu":"GPU-a","used":3758096384,"grant":{"share":4294967296}},{"namespace":"default","pod":"two","podUid":"u1","container":"sidecar","gpu":"GPU-a","used":536870912}]}"#;
        let mut snapshot =
            crate::simulate::parse_snapshot(TWO_CONTAINERS, "cluster").expect("parses");
        snapshot.devices[0]
            .metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(
                tessera_api::usage::DEVICE_ANNOTATION.to_owned(),
                used.to_owned(),
            );
        let reports = report(&[], &snapshot.devices, &snapshot.pods);
        let gpu = &reports[0].gpus[0];
        assert_eq!(gpu.pods[0].memory_used, Some(3584 << 20));
        assert_eq!(gpu.pods[0].containers[0].memory_used, Some(3584 << 20));
        assert_eq!(gpu.pods[0].containers[1].memory_used, None);
        assert_eq!(
            gpu.ungranted,
            [UngrantedUse {
                pod: "default/two".into(),
                container: "sidecar".into(),
                memory_used: 512 << 20
            }]
        );
        let rendered = render(&reports);
        assert!(
            rendered.contains(
                "default/two (50%, 8.0 GiB: a 25%, 4.0 GiB, using 3.5 GiB; b 25%, 4.0 GiB)"
            ),
            "{rendered}"
        );
        assert!(
            rendered.contains("default/two container sidecar NOT GRANTED this GPU, using 0.5 GiB"),
            "{rendered}"
        );
        let json = serde_json::to_string(&reports).expect("json");
        assert!(json.contains(r#""memoryUsed":3758096384"#), "{json}");
    }

    #[test]
    fn one_pods_gpus_alone() {
        let snapshot = crate::simulate::parse_snapshot(
            include_str!("../../docs/examples/cluster.yaml"),
            "cluster",
        )
        .expect("parses");
        let reports = report(&[], &snapshot.devices, &snapshot.pods);
        let mine = only_pod(reports.clone(), "default/n3-a");
        assert_eq!(mine.len(), 1);
        assert_eq!(mine[0].name, "n3");
        assert_eq!(mine[0].gpus.len(), 1);
        assert_eq!(mine[0].gpus[0].pods.len(), 1);
        assert_eq!(mine[0].gpus[0].pods[0].pod, "default/n3-a");
        // Its GPU's totals are the GPU's, whoever else holds it.
        assert_eq!(
            mine[0].gpus[0].memory_allocated,
            reports[2].gpus[0].memory_allocated
        );
        assert!(only_pod(reports, "default/nobody").is_empty());
    }
}
