//! `tessera-scheduler simulate`: pending pods placed on a cluster snapshot (or a
//! synthetic cluster, for benchmarks), in each of kube-scheduler's sampling modes.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use tessera_allocator::simulate::{self, SimulateOptions, Snapshot};

use crate::PolicyArgs;

/// `simulate`'s flags.
#[derive(Debug, Args)]
pub(crate) struct SimulateArgs {
    /// Nodes, Device CRs and running Pods (kubectl get -o yaml|json output, a List or documents).
    #[arg(long, value_name = "FILE", required_unless_present = "synthetic_nodes")]
    cluster: Option<PathBuf>,
    /// Pending pods, placed in file order.
    #[arg(long, value_name = "FILE", required_unless_present = "synthetic_nodes")]
    pods: Option<PathBuf>,
    /// Instead of files: a synthetic cluster of this many nodes (for benchmarks).
    #[arg(long, value_name = "N")]
    synthetic_nodes: Option<usize>,
    /// GPUs per synthetic node.
    #[arg(long, default_value_t = 8)]
    synthetic_gpus: u32,
    /// Running quarter-GPU pods in the synthetic cluster.
    #[arg(long, default_value_t = 40_000)]
    synthetic_running: usize,
    /// Pending pods to place in the synthetic cluster.
    #[arg(long, default_value_t = 20_000)]
    synthetic_pending: usize,
    /// kube-scheduler's percentageOfNodesToScore: each cycle the extender sees
    /// only the nodes kube-scheduler sampled. 0 is kube-scheduler's own default
    /// (50 − nodes/125 %, at least 5 % and 100 nodes); Tessera's deploy sets 100
    /// [default: both, each from the same start: 100 (the pods' lines), then 0]
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=100))]
    percentage_of_nodes_to_score: Option<u32>,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    policy: PolicyArgs,
}

/// Places the pods and prints each one's node and annotation, or why it fits
/// nowhere; the figures go to stderr.
pub(crate) fn run(args: SimulateArgs) -> anyhow::Result<()> {
    let SimulateArgs {
        cluster,
        pods,
        synthetic_nodes,
        synthetic_gpus,
        synthetic_running,
        synthetic_pending,
        percentage_of_nodes_to_score,
        json,
        policy,
    } = args;
    let options = |percentage_of_nodes_to_score| SimulateOptions {
        gpu_policy: policy.gpu_policy,
        node_policy: policy.node_policy,
        request: policy.request_options(),
        percentage_of_nodes_to_score,
        group_gpus_per_namespace: policy.max_group_gpus_per_namespace,
    };
    // The deploy's mode first: its outcomes are the pods' lines.
    let modes = match percentage_of_nodes_to_score {
        Some(percentage) => vec![percentage],
        None => vec![100, 0],
    };
    let mut first: Option<Vec<simulate::Outcome>> = None;
    for percentage in modes {
        let started = Instant::now();
        // The snapshot's pods are booked and dropped: the process then holds
        // what the extender would, not every Pod object. Each mode starts
        // from the same cluster.
        let (mut ledger, nodes, devices, running, pending) = match synthetic_nodes {
            Some(nodes) => {
                let (ledger, names) =
                    simulate::synthetic_ledger(nodes, synthetic_gpus, synthetic_running);
                // Made one at a time as simulate takes them.
                (ledger, names, nodes, synthetic_running, Vec::new())
            }
            None => {
                let read = |path: &PathBuf| -> anyhow::Result<Snapshot> {
                    let text = std::fs::read_to_string(path)
                        .with_context(|| format!("reading {}", path.display()))?;
                    Ok(simulate::parse_snapshot(
                        &text,
                        &path.display().to_string(),
                    )?)
                };
                let cluster = read(cluster.as_ref().context("--cluster is required")?)?;
                let pending = read(pods.as_ref().context("--pods is required")?)?.pods;
                let ledger = simulate::ledger_of(&cluster);
                let counts = (cluster.devices.len(), cluster.pods.len());
                (ledger, cluster.node_list(), counts.0, counts.1, pending)
            }
        };
        let loaded = started.elapsed();
        let options = options(percentage);
        let placing = Instant::now();
        let cpu = cpu_seconds();
        let outcomes = match synthetic_nodes {
            Some(_) => simulate::simulate(
                &mut ledger,
                &nodes,
                (0..synthetic_pending).map(simulate::synthetic_pending_pod),
                &options,
            ),
            None => simulate::simulate(&mut ledger, &nodes, &pending, &options),
        };
        let took = placing.elapsed();
        // CPU time too: on a busy machine the wall clock also counts others' work.
        let cpu = cpu_seconds().zip(cpu).map(|(after, before)| after - before);
        if first.is_none() && synthetic_nodes.is_none() {
            if json {
                println!("{}", serde_json::to_string_pretty(&outcomes)?);
            } else {
                for outcome in &outcomes {
                    println!("{}", outcome.line());
                }
            }
        }
        let placed = outcomes.iter().filter(|o| o.node.is_some()).count();
        eprintln!(
            "simulate: {} nodes ({devices} with Device CRs), {running} running pods loaded in {:.2?}; {} nodes sampled a cycle (percentageOfNodesToScore {percentage}); placed {placed} of {} pending pods in {:.2?} ({:.0} pods/s; {} per CPU-second); RSS {:.1} MiB (peak {:.1} MiB)",
            nodes.len(),
            loaded,
            simulate::nodes_to_find(percentage, nodes.len()),
            outcomes.len(),
            took,
            outcomes.len() as f64 / took.as_secs_f64().max(1e-9),
            // Under a tenth of a second of CPU the 10 ms ticks say nothing.
            cpu.filter(|c| *c >= 0.1)
                .map_or("-".to_owned(), |c| format!(
                    "{:.0}",
                    outcomes.len() as f64 / c
                )),
            rss_mib("VmRSS:").unwrap_or(0.0),
            rss_mib("VmHWM:").unwrap_or(0.0)
        );
        eprintln!(
            "simulate: percentageOfNodesToScore {percentage}: {}",
            simulate::unplaced_summary(&outcomes, first.as_deref(), 10)
        );
        drop(ledger);
        first.get_or_insert(outcomes);
    }
    Ok(())
}

/// This thread's CPU time (user + kernel) in seconds, from /proc/thread-self/stat.
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").ok()?;
    // Fields after the command (which may hold spaces) end with ')'.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

/// `field` of /proc/self/status (`VmRSS:` now, `VmHWM:` the peak) in MiB.
fn rss_mib(field: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: f64 = status
        .lines()
        .find(|l| l.starts_with(field))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kib / 1024.0)
}
