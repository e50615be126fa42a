//! The chart's alerts (templates/monitoring.yaml) and Grafana dashboard
//! (files/grafana-dashboard.json) name only metrics tessera-scheduler serves, and the
//! dashboard shows every one of them.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tessera_allocator::ledger::Ledger;
use tessera_harness::monitoring::{alert_expr, chart_file, metric_names, sample_names};
use tessera_scheduler::bind::BindError;
use tessera_scheduler::metrics::{BindResult, EventLabels, SchedulerMetrics, SchedulerState, Verb};

/// Every `tessera_scheduler_…` name in the chart file `path`.
fn used_names(path: &str) -> BTreeSet<String> {
    metric_names(&chart_file(path).expect("chart file"), "tessera_scheduler_")
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
        tls_not_after: Some(1_900_000_000),
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
    sample_names(&metrics.encode())
}

#[test]
fn alerts_and_dashboard_name_only_served_metrics() {
    let served = served();
    for file in ["templates/monitoring.yaml", "files/grafana-dashboard.json"] {
        let used = used_names(file);
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
    let used = used_names("files/grafana-dashboard.json");
    let missing: Vec<_> = served().difference(&used).cloned().collect();
    assert!(missing.is_empty(), "no panel shows {missing:?}");
}

#[test]
fn alerts_cover_a_scheduler_down_unsynced_leaderless_or_failing_binds() {
    let text = chart_file("templates/monitoring.yaml").expect("chart file");
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
        (
            "TesseraExtenderCertificateExpiring",
            "tessera_scheduler_tls_certificate_expiry_timestamp_seconds{",
        ),
    ] {
        let expr = alert_expr(&text, alert).unwrap_or_else(|| panic!("no alert {alert}"));
        assert!(expr.contains(metric), "{alert}: {expr}");
    }
}
