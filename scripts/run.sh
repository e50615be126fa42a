#!/usr/bin/env bash
# The main job: Tessera on one machine, no GPU needed. Needs root (containerd, runc, mknod).
#
#   bash scripts/run.sh            embedded: a private containerd with tessera-runtime-proxy
#                                  (embedded GPU hook) in front, a fake 4-GPU node published by
#                                  tessera-reporter to an API server double, a legacy pod holding
#                                  a GPU through kubelet's checkpoint, tessera-scheduler placing
#                                  sample pods through its extender API; prints `tessera inspect`
#                                  and what each container really got. No extra downloads.
#   bash scripts/run.sh --cluster  the same story on a real one-node Kubernetes cluster (binaries
#                                  from $TESSERA_K8S_BIN or ../shared/k8s/bin), kept up until
#                                  Ctrl-C with a kubeconfig path printed. Add --exit to tear it
#                                  down when the story is told.
# Cleans up after itself, also on Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
install_deps
if [ "${1:-}" = "--cluster" ]; then
    # The cluster runs Tessera's daemons as the binaries users install: build them all.
    cargo build --release --locked --workspace --bins
else
    cargo build --release --locked -p tessera-integration --bin tessera-demo
fi
exec ./target/release/tessera-demo "$@"
