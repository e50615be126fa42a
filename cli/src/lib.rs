//! The `tessera` command line: `tessera inspect` reads Device CRs, Nodes and Pods
//! from any kubeconfig and prints who holds which share of which GPU;
//! `tessera image build` builds the daemons' OCI images; `tessera node switch-over`
//! points a node's kubelet at the runtime proxy and proves it.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::ListParams;
use kube::{Api, Client};
use tessera_allocator::inspect::{only_pod, render, report};
use tessera_api::Device;

pub mod images;
pub mod node;

/// Tessera: fine-grained GPU sharing for Kubernetes.
#[derive(Debug, Parser)]
#[command(name = "tessera", version)]
pub struct Cli {
    /// kubeconfig file, for `inspect` and `node` (also accepted after them)
    /// [default: $KUBECONFIG, ~/.kube/config, or in-cluster].
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,
    /// The command.
    #[command(subcommand)]
    pub command: Command,
}

/// Commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Per node and GPU: model, UUID, health, compute and memory allocated, and the
    /// pods holding them (device-plugin pods marked legacy).
    Inspect {
        /// The cluster.
        #[command(flatten)]
        kube: KubeArgs,
        /// Only this node.
        #[arg(long)]
        node: Option<String>,
        /// Only the GPUs this pod holds (NAMESPACE/NAME, or NAME in `default`):
        /// each container's share, the backends that hold it, and what it uses.
        #[arg(long, value_name = "NAMESPACE/NAME")]
        pod: Option<String>,
        /// Print JSON instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// OCI images of the cluster daemons.
    #[command(subcommand)]
    Image(ImageCommand),
    /// Switch this node's kubelet to the runtime proxy, or back (run on the node, as root).
    Node {
        /// The cluster (given before or after the `node` command's own).
        #[command(flatten)]
        kube: GlobalKubeArgs,
        /// The command.
        #[command(subcommand)]
        command: NodeCommand,
    },
}

/// Where the cluster is, for the commands that talk to it (`tessera image` does not).
#[derive(Debug, Clone, clap::Args)]
pub struct KubeArgs {
    /// kubeconfig file [default: $KUBECONFIG, ~/.kube/config, or in-cluster].
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,
}

/// [`KubeArgs`] for a command with subcommands: accepted on either side of them.
#[derive(Debug, Clone, clap::Args)]
pub struct GlobalKubeArgs {
    /// kubeconfig file [default: $KUBECONFIG, ~/.kube/config, or in-cluster].
    #[arg(long, global = true, value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,
}

/// `tessera node …`.
#[derive(Debug, Subcommand)]
pub enum NodeCommand {
    /// Points kubelet at the proxy where kubelet really reads it (its --config-dir,
    /// else its --config file, backed up; refused when a command-line flag would
    /// override either), taints the node `tessera.io/runtime-proxy:NoSchedule`,
    /// restarts kubelet, and removes the taint only once the proxy's metrics show
    /// kubelet's calls. Otherwise the taint stays and the reason is printed (exit 1).
    /// Where the proxy already sees kubelet's runtime calls (its --enforcement-dir
    /// says so), it writes nothing, restarts nothing, and says so.
    SwitchOver(SwitchArgs),
    /// Removes what switch-over wrote (the drop-in, or restores the backed-up
    /// --config file), restarts kubelet, and checks it no longer calls the proxy.
    SwitchBack(SwitchArgs),
    /// The chart's node installer (a privileged DaemonSet pod with hostPID and
    /// hostNetwork): enters the host (as --enter-host), switches the node over
    /// (exit 1 with the reason when that cannot be proven: the taint stays), then
    /// waits. Told to stop, it switches the node back only when its DaemonSet is
    /// gone (the chart was uninstalled); a rollout leaves the node switched.
    Installer(InstallerArgs),
    /// After uninstalling: removes from Nodes what tessera-reporter published there
    /// and nothing else: the koordinator.sh/* capacity and its aliases
    /// (aliyun.com/gpu-mem, nvidia.com/gpumem, nvidia.com/gpucores,
    /// volcano.sh/gpu-memory), the GPU model and driver labels, and the
    /// tessera.io/runtime-proxy taint an unproven switch-over left. Runs anywhere
    /// with a kubeconfig; refuses while a tessera-reporter pod runs on a node it would
    /// clean (the reporter would publish it all again), and fails when what it
    /// removed is back after --settle seconds (a reporter running outside the pods).
    Cleanup(CleanupArgs),
}

/// Settings of `tessera node cleanup`.
#[derive(Debug, clap::Args)]
pub struct CleanupArgs {
    /// Only this node [default: every node].
    #[arg(long)]
    pub node: Option<String>,
    /// Also remove nvidia.com/gpu, which the reporter published with
    /// --advertise-nvidia-gpu (the chart's reporter.advertiseNvidiaGpu). Leave it out
    /// where NVIDIA's device plugin serves nvidia.com/gpu.
    #[arg(long)]
    pub nvidia_gpu: bool,
    /// Seconds to look again after removing: what came back means a tessera-reporter
    /// still runs outside the cluster's pods (exit 1, naming the nodes). 0: do not look.
    #[arg(long, value_name = "SECONDS", default_value_t = 5)]
    pub settle: u64,
}

/// Settings of `tessera node installer`.
#[derive(Debug, clap::Args)]
pub struct InstallerArgs {
    /// The installer's DaemonSet, `NAMESPACE/NAME`, read when the pod is told to stop.
    #[arg(long, value_name = "NAMESPACE/NAME", value_parser = namespaced_name)]
    pub daemonset: String,
    /// The switch.
    #[command(flatten)]
    pub switch: SwitchArgs,
}

fn namespaced_name(value: &str) -> Result<String, String> {
    match value.split_once('/') {
        Some((namespace, name)) if !namespace.is_empty() && !name.is_empty() => {
            Ok(value.to_owned())
        }
        _ => Err(format!("{value:?} is not NAMESPACE/NAME")),
    }
}

/// Settings of `tessera node switch-over` and `switch-back`.
#[derive(Debug, clap::Args)]
pub struct SwitchArgs {
    /// This node's name in the cluster [default: $NODE_NAME, else the host name].
    #[arg(long)]
    pub node: Option<String>,
    /// The proxy's socket as kubelet names it: what switch-over writes, and what
    /// switch-back finds kubelet no longer calling.
    #[arg(long, default_value = "unix:///run/tessera/runtime-proxy.sock")]
    pub endpoint: String,
    /// The proxy's metrics address (its --metrics-addr), where kubelet's calls are
    /// counted: rising after switch-over's restart, still after switch-back's.
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:9464")]
    pub proxy_metrics: String,
    /// How kubelet is restarted.
    #[arg(long, default_value = "systemctl restart kubelet")]
    pub restart_command: String,
    /// kubelet's process ID [default: the process named kubelet].
    #[arg(long)]
    pub kubelet_pid: Option<u32>,
    /// The proxy's --enforcement-dir: its `kubelet` file there says whether kubelet
    /// already calls through it (switch-over then changes nothing).
    #[arg(long, value_name = "DIR", default_value = "/run/tessera/enforce")]
    pub enforcement_dir: PathBuf,
    /// Seconds kubelet has, after its restart, to show up at the proxy
    /// (switch-over) or to stop calling it (switch-back).
    #[arg(long, value_name = "SECONDS", default_value_t = 60)]
    pub verify_timeout: u64,
    /// Run from a privileged pod with hostPID: take the pod's in-cluster
    /// credentials, then enter the host's mount namespace (the runtime shim's), so kubelet's
    /// files and the restart command are the host's.
    #[arg(long)]
    pub enter_host: bool,
}

/// What must be done while the process has one thread, before the async runtime
/// starts (see [`prepare`]).
#[derive(Debug, Default)]
pub struct Prepared {
    /// The pod's in-cluster configuration, read before entering the host.
    config: Option<kube::Config>,
}

/// Enters the host for `--enter-host` and the installer: `setns` into another
/// mount namespace refuses a process with several threads, so call this before
/// starting the async runtime.
pub fn prepare(cli: &Cli) -> anyhow::Result<Prepared> {
    let enter = match &cli.command {
        Command::Node {
            command: NodeCommand::Installer(_),
            ..
        } => true,
        Command::Node {
            command: NodeCommand::SwitchOver(args) | NodeCommand::SwitchBack(args),
            ..
        } => args.enter_host,
        _ => false,
    };
    Ok(Prepared {
        config: if enter {
            Some(node::enter_host()?)
        } else {
            None
        },
    })
}

/// `tessera image …`.
#[derive(Debug, Subcommand)]
pub enum ImageCommand {
    /// Builds OCI image archives (one layer: the binary, stripped, and the shared
    /// libraries it loads, from this machine) of tessera-scheduler, tessera-reporter,
    /// tessera-gpu-hook and tessera (the node installer), or only those named. Each
    /// binary's debug info is kept beside its archive as DIR/NAME.debug (needs objcopy).
    /// Reproducible: the same binaries give the same digests. Import with `ctr -n k8s.io images import DIR/NAME.tar`,
    /// or push with `skopeo copy oci-archive:DIR/NAME.tar docker://REGISTRY/NAME:TAG`.
    Build {
        /// Where the archives go (`<DIR>/<name>.tar`).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// Where the binaries are [default: beside this `tessera` binary].
        #[arg(long, value_name = "DIR")]
        bin_dir: Option<PathBuf>,
        /// Registry part of each image's name.
        #[arg(long, default_value = "tessera.local")]
        registry: String,
        /// Tag of each image [default: this version].
        #[arg(long)]
        tag: Option<String>,
        /// Images to build [default: all].
        names: Vec<String>,
    },
}

/// `tessera node …`.
async fn node_command(
    kubeconfig: Option<PathBuf>,
    prepared: Prepared,
    command: NodeCommand,
) -> anyhow::Result<()> {
    let (args, installer) = match command {
        NodeCommand::Cleanup(args) => {
            let client = client(kubeconfig).await?;
            let settle = std::time::Duration::from_secs(args.settle);
            for line in node::cleanup(client, args.node.as_deref(), args.nvidia_gpu, settle).await?
            {
                println!("{line}");
            }
            return Ok(());
        }
        NodeCommand::SwitchBack(args) => {
            let client = node_client(kubeconfig, prepared).await?;
            println!("{}", switch(args)?.back(&Api::all(client)).await?);
            return Ok(());
        }
        NodeCommand::SwitchOver(args) => (args, None),
        NodeCommand::Installer(InstallerArgs { daemonset, switch }) => (switch, Some(daemonset)),
    };
    let client = node_client(kubeconfig, prepared).await?;
    let switch = switch(args)?;
    let nodes = Api::all(client.clone());
    println!("{}", switch.over(&nodes).await?);
    if let Some(daemonset) = installer {
        tessera_daemon::binary::shutdown_signal()
            .await
            .context("waiting for SIGTERM")?;
        match node::owner(client, &daemonset).await {
            node::Owner::Uninstalled => {
                println!("{daemonset} is gone: switching the node back");
                println!("{}", switch.back(&nodes).await?);
            }
            owner => println!("{daemonset}: {owner:?}; the node stays switched to the proxy"),
        }
    }
    Ok(())
}

/// The client of `tessera node`: the pod's own when it entered the host.
async fn node_client(kubeconfig: Option<PathBuf>, prepared: Prepared) -> anyhow::Result<Client> {
    match prepared.config {
        Some(config) => Client::try_from(config).context("a client from the pod's configuration"),
        None => client(kubeconfig).await,
    }
}

/// The switch `args` describe, on this node.
fn switch(args: SwitchArgs) -> anyhow::Result<node::Switch> {
    let node = args
        .node
        .or_else(|| std::env::var("NODE_NAME").ok())
        .or_else(tessera_daemon::binary::hostname)
        .context("no node name: pass --node")?;
    let kubelet_pid = match args.kubelet_pid {
        Some(pid) => pid,
        None => node::find_kubelet()?,
    };
    Ok(node::Switch {
        node,
        kubelet_pid,
        kubelet_args: node::kubelet_command_line(Some(kubelet_pid))?,
        endpoint: args.endpoint,
        metrics: args.proxy_metrics,
        restart_command: args.restart_command,
        verify_timeout: std::time::Duration::from_secs(args.verify_timeout),
        enforcement_dir: args.enforcement_dir,
    })
}

/// A client from `--kubeconfig` or the usual places.
pub async fn client(kubeconfig: Option<PathBuf>) -> anyhow::Result<Client> {
    Ok(tessera_daemon::client::kube_client(kubeconfig.as_deref()).await?)
}

/// The inspect output for the cluster behind `client`.
pub async fn inspect(
    client: Client,
    node: Option<&str>,
    pod: Option<&str>,
    json: bool,
) -> anyhow::Result<String> {
    let devices = Api::<Device>::all(client.clone())
        .list(&ListParams::default())
        .await
        .context("listing Device CRs (is the CRD installed?)")?;
    let nodes = Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await
        .context("listing nodes")?;
    let mut pod_params = ListParams::default();
    let filter;
    if let Some(node) = node {
        filter = format!("spec.nodeName={node}");
        pod_params = pod_params.fields(&filter);
    }
    let pods = Api::<Pod>::all(client)
        .list(&pod_params)
        .await
        .context("listing pods")?;
    let mut reports = report(&nodes.items, &devices.items, &pods.items);
    if let Some(node) = node {
        reports.retain(|r| r.name == node);
    }
    if let Some(pod) = pod {
        let pod = if pod.contains('/') {
            pod.to_owned()
        } else {
            format!("default/{pod}")
        };
        reports = only_pod(reports, &pod);
        if reports.is_empty() {
            anyhow::bail!(
                "pod {pod} holds no GPU{}: not found, not placed yet, or it asked for none",
                node.map(|n| format!(" on node {n}")).unwrap_or_default()
            );
        }
    }
    Ok(if json {
        serde_json::to_string_pretty(&reports)? + "\n"
    } else {
        render(&reports)
    })
}

/// Runs the CLI.
pub async fn run(cli: Cli, prepared: Prepared) -> anyhow::Result<()> {
    match cli.command {
        Command::Inspect {
            kube,
            node,
            pod,
            json,
        } => {
            let client = client(kube.kubeconfig.or(cli.kubeconfig)).await?;
            print!(
                "{}",
                inspect(client, node.as_deref(), pod.as_deref(), json).await?
            );
        }
        Command::Node { kube, command } => {
            node_command(kube.kubeconfig.or(cli.kubeconfig), prepared, command).await?;
        }
        Command::Image(_) if cli.kubeconfig.is_some() => {
            anyhow::bail!("--kubeconfig: tessera image reads no cluster");
        }
        Command::Image(ImageCommand::Build {
            out,
            bin_dir,
            registry,
            tag,
            names,
        }) => {
            let bin_dir = match bin_dir {
                Some(dir) => dir,
                None => std::env::current_exe()
                    .context("finding this binary")?
                    .parent()
                    .context("this binary has no directory")?
                    .to_path_buf(),
            };
            let tag = tag.unwrap_or_else(|| env!("CARGO_PKG_VERSION").to_owned());
            for built in images::build(&bin_dir, &registry, &tag, &names, &out)? {
                println!(
                    "{} {} {}",
                    built.reference,
                    built.digest,
                    built.archive.display()
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;

    fn kubeconfig_of(args: &[&str]) -> Option<PathBuf> {
        let cli = Cli::try_parse_from(args).expect("parses");
        match cli.command {
            Command::Inspect { kube, .. } => kube.kubeconfig.or(cli.kubeconfig),
            Command::Node { kube, .. } => kube.kubeconfig.or(cli.kubeconfig),
            Command::Image(_) => None,
        }
    }

    #[test]
    fn kubeconfig_is_offered_only_where_a_cluster_is_used() {
        let k = Some(PathBuf::from("k"));
        assert_eq!(
            kubeconfig_of(&["tessera", "inspect", "--kubeconfig", "k"]),
            k
        );
        // Before the command, as earlier versions took it.
        assert_eq!(
            kubeconfig_of(&["tessera", "--kubeconfig", "k", "inspect"]),
            k
        );
        assert_eq!(
            kubeconfig_of(&["tessera", "--kubeconfig", "k", "node", "cleanup"]),
            k
        );
        assert_eq!(
            kubeconfig_of(&["tessera", "node", "--kubeconfig", "k", "cleanup"]),
            k
        );
        assert_eq!(
            kubeconfig_of(&["tessera", "node", "cleanup", "--kubeconfig", "k"]),
            k
        );
        let error = Cli::try_parse_from([
            "tessera",
            "image",
            "build",
            "--out",
            "o",
            "--kubeconfig",
            "k",
        ])
        .expect_err("image build talks to no cluster");
        assert_eq!(error.kind(), clap::error::ErrorKind::UnknownArgument);
        let mut command = Cli::command();
        let build = command
            .find_subcommand_mut("image")
            .and_then(|c| c.find_subcommand_mut("build"))
            .expect("image build")
            .render_long_help()
            .to_string();
        assert!(!build.contains("kubeconfig"), "{build}");
        let given = Cli::try_parse_from([
            "tessera",
            "--kubeconfig",
            "k",
            "image",
            "build",
            "--out",
            "o",
        ])
        .expect("parses");
        let error = tokio::runtime::Runtime::new()
            .expect("test step")
            .block_on(run(given, Prepared::default()))
            .expect_err("refused");
        assert_eq!(
            error.to_string(),
            "--kubeconfig: tessera image reads no cluster"
        );
    }
}
