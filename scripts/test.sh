#!/usr/bin/env bash
# Runs every check and test: formatting, clippy -D warnings, unit, property and
# integration tests (against a real private containerd, and a real one-node Kubernetes
# cluster from ../shared/k8s or $TESSERA_K8S_BIN). Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
install_deps
install_chart_deps
# A one-off build gains nothing from incremental state, which only costs disk.
export CARGO_INCREMENTAL=0
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
# The Helm chart: strict lint (any finding fails), bad values refused naming the key,
# and deploy/ is the chart's rendered output.
python3 scripts/chart.py lint
python3 scripts/chart.py check-deploy
# The real-cluster tier (integration/harness/tests/cluster.rs) runs Tessera's binaries as
# processes: build them first. In CI a cluster test that cannot run is a failure.
cargo build --workspace --bins --locked
export TESSERA_REQUIRE_CLUSTER=1
cargo test --workspace --locked
# SIG Node's CRI conformance suite, directly and through the proxy, on both runtime
# versions Tessera supports: a spec that passes direct must pass through the proxy.
bash scripts/critest.sh --containerd both
