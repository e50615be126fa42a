#!/usr/bin/env bash
# Every benchmark, each printing its figures and ratios against a baseline taken in
# the same run, with verdicts against issue 11's targets where it has some: the proxy
# (direct vs proxied CRI latency, peak RSS), the GPU hook (CreateContainer added
# cost), the scheduler's simulate (placements/s, peak RSS; adaptive node sampling vs
# every node), its extender API (filter alone under deploy's --candidates 1, and filter+prioritize
# under --candidates 0, vs a pod asking no GPU; filter and
# bind on the mutual-TLS port alone vs under 2,000 idle connections and 100 MB bodies), its Pod
# store (full vs trimmed pods) and placements through a real kube-scheduler on the
# harness cluster (extender behind mutual TLS vs pods kube-scheduler places alone).
# Needs root; the cluster bench needs the Kubernetes binaries (tessera-harness).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
install_deps
cargo build --release --locked -p tessera-runtime-proxy -p tessera-hooks -p tessera-scheduler \
    -p tessera-reporter -p tessera-cli -p tessera-integration
./target/release/tessera-bench proxy
./target/release/tessera-bench gpu-hook
./target/release/tessera-scheduler simulate --cluster docs/examples/cluster.yaml --pods docs/examples/pods.yaml
./target/release/tessera-scheduler simulate --synthetic-nodes 5000
./target/release/tessera-bench simulate
./target/release/tessera-bench extender
./target/release/tessera-bench flood
./target/release/tessera-bench pod-cache
./target/release/tessera-bench cluster
