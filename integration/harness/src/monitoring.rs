//! Metric names in the chart's monitoring files (alerts in `templates/monitoring.yaml`,
//! the Grafana dashboard in `files/grafana-dashboard.json`) and in what a daemon serves:
//! the daemons' tests check that the chart names only metrics they serve, and the
//! cluster tier's Prometheus scenario that every query names only served families.

use std::collections::BTreeSet;

use anyhow::Context;

use crate::cluster::repo_root;

/// The text of `path` in the chart (`charts/tessera/<path>`).
pub fn chart_file(path: &str) -> anyhow::Result<String> {
    let path = repo_root().join("charts/tessera").join(path);
    std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
}

/// Every metric name in `text` that starts with `prefix` (e.g. `tessera_reporter_`),
/// as written: samples keep their `_total`, `_bucket`, … suffix.
pub fn metric_names(text: &str, prefix: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find(prefix) {
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        rest = &rest[at + name.len()..];
        names.insert(name);
    }
    names
}

/// The family a sample name belongs to: `name` without the suffix a counter
/// (`_total`, `_created`) or a histogram (`_bucket`, `_sum`, `_count`) adds.
pub fn family(name: &str) -> &str {
    ["_total", "_bucket", "_sum", "_count", "_created"]
        .iter()
        .find_map(|suffix| name.strip_suffix(suffix))
        .unwrap_or(name)
}

/// The `expr` of the alert named `name` in the alert rules `text` (one line each,
/// as `templates/monitoring.yaml` writes them), if there is such an alert.
pub fn alert_expr<'a>(text: &'a str, name: &str) -> Option<&'a str> {
    text.split("- alert: ")
        .skip(1)
        .find(|rule| rule.lines().next().map(str::trim) == Some(name))?
        .lines()
        .find_map(|l| l.trim().strip_prefix("expr: "))
}

/// The sample names of an OpenMetrics (or Prometheus) text exposition.
pub fn sample_names(exposition: &str) -> BTreeSet<String> {
    exposition
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect()
}

/// The value of the sample `series` (name and labels exactly as served), if
/// served.
pub fn sample(exposition: &str, series: &str) -> Option<f64> {
    exposition.lines().find_map(|line| {
        line.strip_prefix(series)?
            .strip_prefix(' ')?
            .split(' ')
            .next()?
            .parse()
            .ok()
    })
}

/// `GET /metrics` of the daemon serving plain HTTP at `addr`: the response head
/// and body.
pub async fn scrape(addr: &str) -> anyhow::Result<(String, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to the metrics at {addr}"))?;
    let request = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut text = String::new();
    stream.read_to_string(&mut text).await?;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .with_context(|| format!("no HTTP response from {addr}: {text:?}"))?;
    Ok((head.to_owned(), body.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_found_whole_and_only_with_the_prefix() {
        let expr = "sum(rate(tessera_scheduler_binds_total{result=\"failed\"}[5m])) / tessera_proxy_requests_total + tessera_scheduler_leader";
        assert_eq!(
            metric_names(expr, "tessera_scheduler_"),
            BTreeSet::from([
                "tessera_scheduler_binds_total".to_owned(),
                "tessera_scheduler_leader".to_owned()
            ])
        );
        assert_eq!(metric_names(expr, "tessera_").len(), 3);
        assert!(metric_names("up{job=\"x\"}", "tessera_").is_empty());
    }

    #[test]
    fn families_drop_counter_and_histogram_suffixes_only() {
        assert_eq!(
            family("tessera_proxy_requests_total"),
            "tessera_proxy_requests"
        );
        assert_eq!(
            family("tessera_proxy_request_duration_seconds_bucket"),
            "tessera_proxy_request_duration_seconds"
        );
        assert_eq!(
            family("tessera_scheduler_leader"),
            "tessera_scheduler_leader"
        );
    }

    #[test]
    fn samples_are_the_names_before_labels_or_value() {
        let text = "# TYPE a counter\na_total{x=\"1\"} 1\nb 2\n\n# EOF\n";
        assert_eq!(
            sample_names(text),
            BTreeSet::from(["a_total".to_owned(), "b".to_owned()])
        );
    }

    #[test]
    fn an_alert_expr_is_found_by_its_whole_name() {
        let rules = "groups:\n  - rules:\n    - alert: DownLong\n      expr: b > 1\n    - alert: Down\n      for: 5m\n      expr: up{job=\"x\"} == 0\n";
        assert_eq!(alert_expr(rules, "Down"), Some("up{job=\"x\"} == 0"));
        assert_eq!(alert_expr(rules, "DownLong"), Some("b > 1"));
        assert_eq!(alert_expr(rules, "Dow"), None);
    }

    #[test]
    fn chart_files_are_read_from_the_chart() {
        let text = chart_file("Chart.yaml").expect("Chart.yaml");
        assert!(text.contains("name: tessera"), "{text}");
        let error = chart_file("no-such-file").expect_err("missing");
        assert!(format!("{error:#}").contains("no-such-file"), "{error:#}");
    }
}
