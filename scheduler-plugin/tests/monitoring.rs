//! The chart's alerts (templates/monitoring.yaml) and Grafana dashboard
//! (files/grafana-dashboard.json) name only metrics tessera-scheduler serves, and the
//! dashboard shows every one of them.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tessera_scheduler::bind::BindError;
use tessera_scheduler::ledger::Ledger;
use tessera_scheduler::metrics::{BindResult, EventLabels, SchedulerMetrics, SchedulerState, Verb};

fn chart_file(path: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../charts/tessera")
        .join(path);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every `tessera_scheduler_…` name in `text`.
fn used_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("tessera_scheduler_") {
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        rest = &rest[at + name.len()..];
        names.insert(name);
    }
    names
}

/// The sample names the scheduler serves, with a series in every family.
fn served() -> BTreeSet<String> {
    let device = serde_json::json!({"apiVersion": "scheduling.koordinator.sh/v1alpha1", "kind": "Device",
        "metadata": {"name": "n1"},
        "spec": {"devices": [{"type": "gpu", "id": "GPU-0", "minor": 0, "health": true,
            "resources": {"koordinator.sh/gpu-memory": "17179869184"}}]}});
    let mut ledger = Ledger::default();
    ledger.apply_device(&serde_json::from_value(device).expect("device"));
    let metrics = SchedulerMetrics::new(SchedulerState {
        ledger: Arc::new(Mutex::new(ledger)),
        ..SchedulerState::default()
    });
    metrics.record_request(Verb::Bind, Duration::from_millis(1));
    metrics.record_bind(BindResult::Bound);
    metrics.record_bind_error(&BindError::NotSynced);
    metrics
        .events
        .get_or_create(&EventLabels {
            reason: "GpuAllocated".into(),
            outcome: "recorded".into(),
        })
        .inc();
    metrics
        .encode()
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect()
}

#[test]
fn alerts_and_dashboard_name_only_served_metrics() {
    let served = served();
    for file in ["templates/monitoring.yaml", "files/grafana-dashboard.json"] {
        let used = used_names(&chart_file(file));
        assert!(!used.is_empty(), "{file} names no tessera-scheduler metric");
        for name in &used {
            assert!(
                served.contains(name),
                "{file}: {name} is not a metric tessera-scheduler serves ({served:?})"
            );
        }
    }
}

#[test]
fn dashboard_shows_every_scheduler_metric() {
    let used = used_names(&chart_file("files/grafana-dashboard.json"));
    let missing: Vec<_> = served().difference(&used).cloned().collect();
    assert!(missing.is_empty(), "no panel shows {missing:?}");
}

#[test]
fn alerts_cover_a_scheduler_down_unsynced_leaderless_or_failing_binds() {
    let text = chart_file("templates/monitoring.yaml");
    for (alert, metric) in [
        ("TesseraSchedulerDown", "up{"),
        (
            "TesseraSchedulerNotSynced",
            "tessera_scheduler_cache_synced{",
        ),
        ("TesseraSchedulerNoLeader", "tessera_scheduler_leader{"),
        (
            "TesseraSchedulerBindFailures",
            "tessera_scheduler_bind_errors_total{",
        ),
    ] {
        let at = text
            .find(&format!("alert: {alert}\n"))
            .unwrap_or_else(|| panic!("no alert {alert}"));
        let expr = text[at..]
            .lines()
            .find(|l| l.trim_start().starts_with("expr:"))
            .expect("expr");
        assert!(expr.contains(metric), "{alert}: {expr}");
    }
}
