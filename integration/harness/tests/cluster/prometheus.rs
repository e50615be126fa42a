//! The chart's monitoring objects in a real Prometheus (Debian's `prometheus`
//! package), scraping the real daemons of the cluster: the PrometheusRule's groups
//! pass `promtool check rules` and load with every rule evaluating without error;
//! every alert and every dashboard panel query runs, and every Tessera metric they
//! name is one the daemons serve (a renamed metric would leave a panel or an alert
//! silently empty); and the numbers that matter show this node: its GPUs, one
//! synced leader, the bind of a pod placed meanwhile, kubelet's calls through the
//! proxy.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use serde_json::{Value, json};
use tessera_harness::cluster::{Cluster, NODE_NAME};
use tessera_harness::monitoring::{family, metric_names};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Metrics a daemon serves only with mutual TLS, which the harness's extender does
/// not use; `scheduler-plugin/tests/monitoring.rs` checks the scheduler serves them.
const TLS_ONLY: &[&str] = &["tessera_scheduler_tls_certificate_expiry_timestamp_seconds"];

/// Where the scenario's Prometheus listens.
const LISTEN: &str = "127.0.0.1:19090";

fn binary(name: &str) -> anyhow::Result<PathBuf> {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(name))
        .find(|path| path.is_file())
        .with_context(|| {
            format!("no {name} on PATH: install Debian's prometheus package (scripts/deps.sh does)")
        })
}

/// The chart rendered with every monitoring object on: the PrometheusRule's
/// `spec` and the dashboard's JSON.
fn rendered_monitoring() -> anyhow::Result<(Value, Value)> {
    let (mut rules, mut dashboard) = (None, None);
    for doc in super::rendered_chart(&["--values", "charts/tessera/ci/monitoring-values.yaml"])? {
        match doc["kind"].as_str() {
            Some("PrometheusRule") => rules = Some(doc["spec"].clone()),
            Some("ConfigMap") => {
                if let Some(json) = doc["data"]
                    .as_object()
                    .and_then(|d| d.iter().find(|(k, _)| k.ends_with(".json")))
                    .and_then(|(_, v)| v.as_str())
                {
                    dashboard = Some(serde_json::from_str(json)?);
                }
            }
            _ => {}
        }
    }
    Ok((
        rules.context("no PrometheusRule in the rendered chart")?,
        dashboard.context("no dashboard ConfigMap in the rendered chart")?,
    ))
}

/// Every query of the alerts and of the dashboard's panels, Grafana's variables
/// set to this cluster's values, each with where it comes from.
fn queries(rules: &Value, dashboard: &Value) -> Vec<(String, String)> {
    let mut queries = Vec::new();
    for group in rules["groups"].as_array().into_iter().flatten() {
        for rule in group["rules"].as_array().into_iter().flatten() {
            let name = rule["alert"].as_str().or(rule["record"].as_str());
            if let (Some(name), Some(expr)) = (name, rule["expr"].as_str()) {
                queries.push((format!("alert {name}"), expr.to_owned()));
            }
        }
    }
    let mut panels: Vec<&Value> = dashboard["panels"]
        .as_array()
        .into_iter()
        .flatten()
        .collect();
    while let Some(panel) = panels.pop() {
        // Rows nest their panels.
        panels.extend(panel["panels"].as_array().into_iter().flatten());
        for target in panel["targets"].as_array().into_iter().flatten() {
            if let Some(expr) = target["expr"].as_str() {
                let title = panel["title"].as_str().unwrap_or("?");
                queries.push((format!("panel {title:?}"), grafana_variables(expr)));
            }
        }
    }
    queries
}

fn grafana_variables(expr: &str) -> String {
    expr.replace("$__rate_interval", "1m")
        .replace("$sjob", "tessera-scheduler")
        .replace("$job", "tessera-reporter")
        .replace("$node", ".*")
        .replace("$proxy", ".*")
}

/// The `tessera_*` metric families `expr` names (suffixes of counters and
/// histograms taken off).
fn families(expr: &str) -> BTreeSet<String> {
    metric_names(expr, "tessera_")
        .iter()
        .map(|name| family(name).to_owned())
        .collect()
}

fn percent_encode(text: &str) -> String {
    text.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// `GET path` of the Prometheus API (HTTP/1.0: one whole answer, no chunks); its `data`.
async fn api(path: &str) -> anyhow::Result<Value> {
    let mut stream = tokio::net::TcpStream::connect(LISTEN).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: {LISTEN}\r\n\r\n").as_bytes())
        .await?;
    let mut text = String::new();
    stream.read_to_string(&mut text).await?;
    let (_, body) = text
        .split_once("\r\n\r\n")
        .with_context(|| format!("{path}: no HTTP answer"))?;
    let answer: Value =
        serde_json::from_str(body).with_context(|| format!("{path}: not JSON: {body}"))?;
    if answer["status"] != "success" {
        bail!("{path}: {}", answer);
    }
    Ok(answer["data"].clone())
}

async fn query(expr: &str) -> anyhow::Result<Value> {
    api(&format!("/api/v1/query?query={}", percent_encode(expr))).await
}

/// The value of a query whose answer is one sample.
async fn scalar(expr: &str) -> anyhow::Result<f64> {
    let data = query(expr).await?;
    data["result"][0]["value"][1]
        .as_str()
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("{expr}: no single value in {data}"))
}

/// Polls `check` every 500 ms for 60 s.
async fn eventually<F, Fut>(what: &str, mut check: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let started = Instant::now();
    loop {
        match check().await {
            Ok(()) => return Ok(()),
            Err(e) if started.elapsed() > Duration::from_secs(60) => {
                return Err(e.context(format!("{what} (60 s)")));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
}

fn write_config(dir: &Path, cluster: &Cluster) -> anyhow::Result<PathBuf> {
    let config = json!({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [dir.join("rules.yml")],
        "scrape_configs": [
            // The job names the chart's alerts select (monitoring.reporterJob,
            // schedulerJob); `node` as the ServiceMonitor's relabelling sets it.
            {"job_name": "tessera-reporter", "static_configs": [
                {"targets": [cluster.reporter_metrics_addr()], "labels": {"node": NODE_NAME}}]},
            {"job_name": "tessera-scheduler", "static_configs": [
                {"targets": [cluster.scheduler_metrics_addr()]}]},
            {"job_name": "tessera-runtime-proxy", "static_configs": [
                {"targets": [cluster.proxy_metrics_addr()]}]},
        ],
    });
    let path = dir.join("prometheus.yml");
    std::fs::write(&path, serde_yaml::to_string(&config)?)?;
    Ok(path)
}

pub(super) async fn chart_monitoring_in_a_real_prometheus(
    cluster: &mut Cluster,
) -> anyhow::Result<()> {
    let (prometheus, promtool) = (binary("prometheus")?, binary("promtool")?);
    let dir = tempfile::tempdir()?;
    let (rules, dashboard) = rendered_monitoring()?;
    let rules_file = dir.path().join("rules.yml");
    std::fs::write(&rules_file, serde_yaml::to_string(&rules)?)?;
    let check = std::process::Command::new(&promtool)
        .args(["check", "rules"])
        .arg(&rules_file)
        .output()?;
    ensure!(
        check.status.success(),
        "promtool check rules: {}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );

    // A pod placed while Prometheus watches: the bind must show.
    let name = "prometheus-watched";
    super::create_one(cluster, name, json!({"koordinator.sh/gpu": "10"})).await?;
    let config = write_config(dir.path(), cluster)?;
    let _prometheus = tokio::process::Command::new(&prometheus)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("data").display()
        ))
        .arg(format!("--web.listen-address={LISTEN}"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("prometheus.log"))?)
        .kill_on_drop(true)
        .spawn()
        .context("starting prometheus")?;
    cluster.wait_running(name).await?;

    eventually("every target up", || async {
        let data = api("/api/v1/targets").await?;
        let targets = data["activeTargets"].as_array().context("no targets")?;
        let down: Vec<_> = targets
            .iter()
            .filter(|t| t["health"] != "up")
            .map(|t| (t["scrapePool"].clone(), t["lastError"].clone()))
            .collect();
        ensure!(
            targets.len() == 3 && down.is_empty(),
            "targets down: {down:?}"
        );
        Ok(())
    })
    .await?;
    eventually("every rule loaded and evaluated without error", || async {
        let data = api("/api/v1/rules").await?;
        let rules: Vec<&Value> = data["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().into_iter().flatten())
            .collect();
        let bad: Vec<_> = rules
            .iter()
            .filter(|r| r["health"] != "ok")
            .map(|r| {
                (
                    r["name"].clone(),
                    r["health"].clone(),
                    r["lastError"].clone(),
                )
            })
            .collect();
        ensure!(!rules.is_empty() && bad.is_empty(), "rules: {bad:?}");
        Ok(())
    })
    .await?;

    // Every query runs, and every metric it names is served by a daemon (those
    // served only with mutual TLS by the scheduler unit-tested instead: the
    // harness's extender serves plain HTTP on loopback).
    let served: BTreeSet<String> = api("/api/v1/metadata")
        .await?
        .as_object()
        .context("no metadata")?
        .keys()
        .cloned()
        .collect();
    let queries = queries(&rules, &dashboard);
    ensure!(
        queries.len() >= 20,
        "only {} queries found in the chart's alerts and dashboard",
        queries.len()
    );
    for (source, expr) in &queries {
        query(expr)
            .await
            .with_context(|| format!("{source}: {expr}"))?;
        let unknown: Vec<_> = families(expr)
            .into_iter()
            .filter(|f| !served.contains(f) && !TLS_ONLY.contains(&f.as_str()))
            .collect();
        ensure!(
            unknown.is_empty(),
            "{source} names metrics no daemon serves: {unknown:?} (served: {served:?})"
        );
    }

    // The numbers that matter, as the dashboard would show them.
    let gpus = cluster.gpu_node.gpus.len() as f64;
    eventually("the node's GPUs, one synced leader, the bind, kubelet's calls", || async {
        let reporter = scalar("sum(tessera_reporter_gpus{job=\"tessera-reporter\"})").await?;
        let leader = scalar("sum(tessera_scheduler_leader{job=\"tessera-scheduler\"})").await?;
        let synced = scalar("sum(tessera_scheduler_cache_synced{job=\"tessera-scheduler\"})").await?;
        let binds = scalar("sum(tessera_scheduler_binds_total{job=\"tessera-scheduler\"})").await?;
        let calls = scalar("sum(tessera_proxy_requests_total)").await?;
        ensure!(
            reporter == gpus && leader == 1.0 && synced == 1.0 && binds >= 1.0 && calls > 0.0,
            "GPUs {reporter} (want {gpus}), leaders {leader}, synced {synced}, binds {binds}, proxy calls {calls}"
        );
        Ok(())
    })
    .await?;
    cluster.delete_pod(name).await
}
