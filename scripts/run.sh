#!/usr/bin/env bash
# The main job for now: starts a private containerd, puts tessera-runtime-proxy
# (release build, as a separate process) in front of it, drives kubelet's calls
# through both, and prints direct vs proxied latency and the proxy's peak RSS;
# then CreateContainer of a half-GPU pod on a fake 4-GPU node with the embedded
# GPU hook and with tessera-gpu-hook as an external hook server; the scheduler's
# simulate (a small "what if" and 5,000 synthetic nodes) and its extender API
# latency. Needs root.
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
