#!/usr/bin/env bash
# Runs every check and test: formatting, clippy -D warnings, unit, property and
# integration tests (the latter against a real private containerd). Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
install_deps
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked
