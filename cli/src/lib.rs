//! The `tessera` command line: `tessera inspect` reads Device CRs, Nodes and Pods
//! from any kubeconfig and prints who holds which share of which GPU.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::ListParams;
use kube::{Api, Client};
use tessera_api::Device;
use tessera_scheduler::inspect::{render, report};

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
    }
    Ok(())
}
