#!/usr/bin/env bash
# The main job for now: starts a private containerd, puts tessera-runtime-proxy
# (release build, as a separate process) in front of it, drives kubelet's calls
# through both, and prints direct vs proxied latency and the proxy's peak RSS.
# Needs root. Extra arguments go to `tessera-bench proxy` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
install_deps
cargo build --release --locked -p tessera-runtime-proxy -p tessera-integration
exec ./target/release/tessera-bench proxy "$@"
