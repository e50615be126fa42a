//! The `tessera` command line: `tessera inspect` reads Device CRs, Nodes and Pods
//! from any kubeconfig and prints who holds which share of which GPU;
//! `tessera image build` builds the daemons' OCI images.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::ListParams;
use kube::{Api, Client};
use tessera_api::Device;
use tessera_scheduler::inspect::{render, report};

pub mod images;

/// Tessera: fine-grained GPU sharing for Kubernetes.
#[derive(Debug, Parser)]
#[command(name = "tessera", version)]
pub struct Cli {
    /// kubeconfig file [default: $KUBECONFIG, ~/.kube/config, or in-cluster].
    #[arg(long, global = true, value_name = "PATH")]
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
        /// Only this node.
        #[arg(long)]
        node: Option<String>,
        /// Print JSON instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// OCI images of the cluster daemons.
    #[command(subcommand)]
    Image(ImageCommand),
}

/// `tessera image …`.
#[derive(Debug, Subcommand)]
pub enum ImageCommand {
    /// Builds OCI image archives (one layer: the binary and the shared libraries it
    /// loads, from this machine) of tessera-scheduler, tessera-reporter and
    /// tessera-gpu-hook, or only those named. Reproducible: the same binaries give
    /// the same digests. Import with `ctr -n k8s.io images import DIR/NAME.tar`,
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

/// A client from `--kubeconfig` or the usual places.
pub async fn client(kubeconfig: Option<PathBuf>) -> anyhow::Result<Client> {
    Ok(tessera_api::client::kube_client(kubeconfig.as_deref()).await?)
}

/// The inspect output for the cluster behind `client`.
pub async fn inspect(client: Client, node: Option<&str>, json: bool) -> anyhow::Result<String> {
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
    Ok(if json {
        serde_json::to_string_pretty(&reports)? + "\n"
    } else {
        render(&reports)
    })
}

/// Runs the CLI.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Inspect { node, json } => {
            let client = client(cli.kubeconfig).await?;
            print!("{}", inspect(client, node.as_deref(), json).await?);
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
