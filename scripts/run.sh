#!/usr/bin/env bash
# The main job: Tessera on one machine, no cluster and no GPU needed. Starts a
# private containerd with tessera-runtime-proxy (embedded GPU hook) in front, a fake
# 4-GPU node published by tessera-reporter to an API server double, a legacy pod
# holding a GPU through kubelet's checkpoint, tessera-scheduler placing sample pods
# through its extender API, and creates them through the proxy; prints `tessera
# inspect` and what each container really got. Cleans up after itself, also on
# Ctrl-C. Needs root (containerd, runc, mknod).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
install_deps
cargo build --release --locked -p tessera-integration --bin tessera-demo
exec ./target/release/tessera-demo
