#!/usr/bin/env bash
# Every benchmark, each printing its figures and ratios: the proxy (direct vs
# proxied CRI latency, peak RSS), the GPU hook (CreateContainer added cost), the
# scheduler's simulate (placements/s, RSS) and its extender API (filter+prioritize).
# Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
install_deps
cargo build --release --locked -p tessera-runtime-proxy -p tessera-hooks -p tessera-scheduler -p tessera-integration
./target/release/tessera-bench proxy
./target/release/tessera-bench gpu-hook
./target/release/tessera-scheduler simulate --cluster docs/examples/cluster.yaml --pods docs/examples/pods.yaml
./target/release/tessera-scheduler simulate --synthetic-nodes 5000
./target/release/tessera-bench extender
