#!/usr/bin/env bash
# SIG Node's CRI conformance suite (critest) against a private containerd, first
# directly and then through tessera-runtime-proxy; fails when a spec that passes
# against containerd does not pass through the proxy. Needs root.
#
#   scripts/critest.sh [--containerd 2|1.6|both] [--relay h2|frames|both] [--focus REGEX] [--skip REGEX]...
#
#   --containerd 2     containerd 2.3.4 from the Kubernetes binaries (the default)
#   --containerd 1.6   Debian's containerd (1.6), configuration version 2
#   --containerd both  one after the other
#   --relay h2|frames  how the proxy serves the suite (its --relay); both (the
#                      default): a run through each, each compared with the direct one
#   --focus, --skip    passed on to critest as --ginkgo.focus / --ginkgo.skip
#
# Kubernetes binaries (containerd, containerd-shim-runc-v2, ctr, critest, crictl) come
# from $TESSERA_K8S_BIN, a directory of plain binaries, or else from ../shared/k8s/bin
# (xz-compressed, unpacked once into target/k8s-bin). critest pulls its images from
# registry.k8s.io and gcr.io, which cannot be reached here: stand-ins built from
# Debian's static busybox (scripts/critest/images.py) are pushed to a private
# docker-registry on 127.0.0.1:5000 that containerd mirrors those hosts to.
#
# Each critest run gets a fresh containerd, so the proxy run starts from the same
# state as the direct one. JUnit reports and the logs of containerd, the proxy and
# critest are kept in $TESSERA_CRITEST_OUT (default target/critest). Everything
# started (registry, containerd, shims, containers, proxy) is stopped, and what it
# mounted unmounted, on exit, Ctrl-C included.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

VERSIONS=2
RELAYS="h2 frames"
# Specs left out of every run: critest skips these two itself ("spec discrepancy")
# when containerd loses containers created while a late NRI plugin synchronizes, a
# race in containerd it documents, so whether they pass or skip is down to timing
# alone (the proxy's added latency included), and either way the proxy is not in
# that path: NRI plugins talk to containerd's own socket.
CRITEST_ARGS=(
    --ginkgo.skip="NRI plugin synchronization should receive a callback for container created during the Synchronize call"
    --ginkgo.skip="NRI plugin synchronization should receive information about all containers without the race condition"
)
while [ $# -gt 0 ]; do
    case "$1" in
    --containerd)
        case "${2-}" in
        2 | 1.6) VERSIONS=$2 ;;
        both) VERSIONS="1.6 2" ;;
        *) echo "error: --containerd: expected 2, 1.6 or both, got '${2-}'" >&2; exit 2 ;;
        esac
        shift 2 ;;
    --relay)
        case "${2-}" in
        h2 | frames) RELAYS=$2 ;;
        both) RELAYS="h2 frames" ;;
        *) echo "error: --relay: expected h2, frames or both, got '${2-}'" >&2; exit 2 ;;
        esac
        shift 2 ;;
    --focus) CRITEST_ARGS+=("--ginkgo.focus=${2:?--focus needs a regular expression}"); shift 2 ;;
    --skip) CRITEST_ARGS+=("--ginkgo.skip=${2:?--skip needs a regular expression}"); shift 2 ;;
    -h | --help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
    *) echo "error: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done

REGISTRY=127.0.0.1:5000
# The sandbox image both containerd configurations name; images.py pushes it.
SANDBOX_IMAGE=registry.k8s.io/pause:3.10
# Mirrored to $REGISTRY with paths and tags kept.
MIRRORED_HOSTS=(registry.k8s.io k8s.gcr.io gcr.io)
K8S_TOOLS=(containerd containerd-shim-runc-v2 ctr critest crictl)
OUT=${TESSERA_CRITEST_OUT:-$ROOT/target/critest}
# A bridge and a subnet of our own, so as not to meet another harness's network.
BRIDGE=tcritest0
SUBNET=10.237.0.0/16

log() { printf '==> %s\n' "$*"; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# === dependencies ===

# Debian packages this script needs, installed when missing (as scripts/deps.sh does
# for the build and the tests).
install_critest_deps() {
    [ "$(id -u)" = 0 ] || die "run as root: critest runs a private containerd and runc containers"
    local missing=()
    command -v docker-registry >/dev/null || missing+=(docker-registry)
    command -v skopeo >/dev/null || missing+=(skopeo)
    dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q 'ok installed' || missing+=(busybox-static)
    [ -x /usr/sbin/runc ] || missing+=(runc)
    [ -x /usr/lib/cni/bridge ] || missing+=(containernetworking-plugins)
    # the portmap plugin (host ports) programs iptables
    command -v iptables >/dev/null || missing+=(iptables)
    if [[ " $VERSIONS " == *" 1.6 "* ]]; then
        [ -x /usr/bin/containerd ] || missing+=(containerd)
    fi
    command -v xz >/dev/null || missing+=(xz-utils)
    command -v python3 >/dev/null || missing+=(python3)
    command -v cc >/dev/null || missing+=(gcc)
    [ -e /usr/lib/x86_64-linux-gnu/libc.a ] || [ -e /usr/lib/aarch64-linux-gnu/libc.a ] || missing+=(libc6-dev)
    command -v ipcmk >/dev/null || missing+=(util-linux)
    if [ ${#missing[@]} -gt 0 ]; then
        log "installing: ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
}

# Sets K8S_BIN to a directory holding plain copies of $K8S_TOOLS.
find_k8s_bin() {
    local name
    if [ -n "${TESSERA_K8S_BIN:-}" ]; then
        K8S_BIN=$TESSERA_K8S_BIN
    else
        local shared=$ROOT/../shared/k8s/bin
        K8S_BIN=$ROOT/target/k8s-bin
        mkdir -p "$K8S_BIN"
        for name in "${K8S_TOOLS[@]}"; do
            [ -e "$shared/$name.xz" ] || die "$shared/$name.xz not found: set TESSERA_K8S_BIN to a directory of Kubernetes binaries"
            if [ ! -x "$K8S_BIN/$name" ] || [ "$shared/$name.xz" -nt "$K8S_BIN/$name" ]; then
                log "unpacking $name into $K8S_BIN"
                xz -dc "$shared/$name.xz" >"$K8S_BIN/$name.tmp"
                chmod 755 "$K8S_BIN/$name.tmp"
                mv "$K8S_BIN/$name.tmp" "$K8S_BIN/$name"
            fi
        done
    fi
    for name in "${K8S_TOOLS[@]}"; do
        [ -x "$K8S_BIN/$name" ] || die "$K8S_BIN/$name: not found or not executable"
    done
}

# === cleanup ===

K8S_BIN=
PROXY_BIN=
WORK=
REGISTRY_PID=
CRITEST_PID=
CONTAINERD_PID=
CONTAINERD_DIR=
PROXY_PID=

# Sends SIGTERM, waits up to $2 seconds, then SIGKILL.
stop_pid() {
    local pid=$1 grace=$2 i
    kill -TERM "$pid" 2>/dev/null || return 0
    for ((i = 0; i < grace * 10; i++)); do
        kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null || true; return 0; }
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}

# The pids of processes whose command line mentions $1 (the shims name their
# containerd's socket), with all their descendants (the containers).
pids_of_tree_mentioning() {
    python3 - "$1" <<'EOF'
import os, sys
needle = sys.argv[1].encode()
parent, roots = {}, set()
for entry in os.listdir("/proc"):
    if not entry.isdigit():
        continue
    try:
        with open(f"/proc/{entry}/stat", "rb") as f:
            stat = f.read()
        with open(f"/proc/{entry}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        continue
    pid = int(entry)
    if pid == os.getpid():
        continue
    parent[pid] = int(stat[stat.rindex(b")") + 2:].split()[1])
    if needle in cmdline:
        roots.add(pid)
found = set(roots)
changed = True
while changed:
    changed = False
    for pid, ppid in parent.items():
        if ppid in found and pid not in found:
            found.add(pid)
            changed = True
print(" ".join(str(pid) for pid in sorted(found)))
EOF
}

# Lazily unmounts everything mounted under $1, deepest first.
unmount_under() {
    local point
    awk -v dir="$1/" 'index($5, dir) == 1 { print $5 }' /proc/self/mountinfo | awk '{ print length, $0 }' |
        sort -rn | cut -d' ' -f2- | while read -r point; do
        umount -l "$(printf '%b' "$point")" 2>/dev/null || true
    done
}

# Removes the sockets that killed shims of the containerd in $1 left in
# /run/containerd/s, a directory containerd does not move with its state: each is
# named by the sha256 of "ADDRESS/NAMESPACE/ID" (and ".../debug"), which no other
# containerd's shims share.
remove_shim_sockets() {
    local task name suffix
    for task in "$1"/state/io.containerd.runtime.v2.task/*/*; do
        [ -d "$task" ] || continue
        for suffix in "" /debug; do
            name=$(printf '%s' "$1/containerd.sock/${task#"$1"/state/io.containerd.runtime.v2.task/}$suffix" |
                sha256sum | cut -d' ' -f1)
            rm -f "/run/containerd/s/$name"
        done
    done
}

# Stops the proxy and containerd, after removing every pod (so that the shims exit
# and remove their sockets), then kills what is left of shims and containers.
stop_runtime() {
    if [ -n "$PROXY_PID" ]; then
        stop_pid "$PROXY_PID" 5
        PROXY_PID=
    fi
    if [ -n "$CONTAINERD_PID" ]; then
        if kill -0 "$CONTAINERD_PID" 2>/dev/null; then
            timeout 60 "$K8S_BIN/crictl" --runtime-endpoint "unix://$CONTAINERD_DIR/containerd.sock" \
                --image-endpoint "unix://$CONTAINERD_DIR/containerd.sock" --timeout 20s \
                rmp --all --force >/dev/null 2>&1 || true
        fi
        stop_pid "$CONTAINERD_PID" 10
        CONTAINERD_PID=
    fi
    if [ -n "$CONTAINERD_DIR" ]; then
        local pids
        pids=$(pids_of_tree_mentioning "$CONTAINERD_DIR")
        # shellcheck disable=SC2086
        [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
        remove_shim_sockets "$CONTAINERD_DIR"
        unmount_under "$CONTAINERD_DIR"
        CONTAINERD_DIR=
    fi
}

cleanup() {
    local status=$?
    trap - EXIT INT TERM
    set +e
    if [ -n "$CRITEST_PID" ]; then
        stop_pid "$CRITEST_PID" 5
    fi
    stop_runtime
    if [ -n "$REGISTRY_PID" ]; then
        stop_pid "$REGISTRY_PID" 5
    fi
    if [ -n "$WORK" ] && [ -d "$WORK" ]; then
        local pids
        pids=$(pids_of_tree_mentioning "$WORK")
        # shellcheck disable=SC2086
        [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
        unmount_under "$WORK"
        sleep 0.5
        pids=$(pids_of_tree_mentioning "$WORK")
        if [ -n "$pids" ]; then
            echo "warning: processes left behind:" >&2
            ps -o pid,ppid,args -p "${pids// /,}" >&2
        fi
        if awk -v dir="$WORK/" 'index($5, dir) == 1 { found = 1 } END { exit !found }' /proc/self/mountinfo; then
            echo "warning: mounts remain under $WORK; not removing it" >&2
        else
            rm -rf --one-file-system "$WORK"
        fi
    fi
    ip link delete "$BRIDGE" 2>/dev/null || true
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# === the registry and its images ===

start_registry() {
    if (exec 3<>/dev/tcp/127.0.0.1/5000) 2>/dev/null; then
        die "something already listens on $REGISTRY; critest's images are served there"
    fi
    mkdir -p "$WORK/registry"
    cat >"$WORK/registry/config.yml" <<EOF
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: $WORK/registry/data
  delete:
    enabled: true
http:
  addr: $REGISTRY
EOF
    docker-registry serve "$WORK/registry/config.yml" >"$OUT/registry.log" 2>&1 &
    REGISTRY_PID=$!
    local i
    for ((i = 0; i < 100; i++)); do
        if (exec 3<>/dev/tcp/127.0.0.1/5000) 2>/dev/null; then
            return 0
        fi
        kill -0 "$REGISTRY_PID" 2>/dev/null || die "docker-registry exited; see $OUT/registry.log"
        sleep 0.1
    done
    die "docker-registry did not listen on $REGISTRY within 10 s; see $OUT/registry.log"
}

push_images() {
    local bin=$WORK/bin
    mkdir -p "$bin"
    cc -static -O2 -o "$bin/pause" integration/harness/images/pause.c
    cc -static -O2 -o "$bin/nnp" scripts/critest/nnp.c
    cc -static -O2 -o "$bin/nginx" scripts/critest/nginx.c
    python3 scripts/critest/images.py --busybox /bin/busybox --pause "$bin/pause" --nnp "$bin/nnp" \
        --nginx "$bin/nginx" --out "$WORK/images" >"$WORK/images.txt"
    local ref path
    while read -r ref path; do
        # --insecure-policy: no dependence on the host's /etc/containers/policy.json.
        skopeo --insecure-policy copy --quiet --dest-tls-verify=false \
            "oci:$WORK/images:$ref" "docker://$REGISTRY/$path" ||
            die "skopeo copy oci:$WORK/images:$ref docker://$REGISTRY/$path failed"
    done <"$WORK/images.txt"
    log "pushed $(wc -l <"$WORK/images.txt") stand-in images to $REGISTRY"
}

# === containerd ===

write_cni_config() {
    mkdir -p "$WORK/cni/conf" "$WORK/cni/ipam"
    cat >"$WORK/cni/conf/10-critest.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "tessera-critest",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$BRIDGE",
      "isGateway": true,
      "ipMasq": true,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "dataDir": "$WORK/cni/ipam",
        "ranges": [[{ "subnet": "$SUBNET" }]],
        "routes": [{ "dst": "0.0.0.0/0" }]
      }
    },
    { "type": "portmap", "capabilities": { "portMappings": true } }
  ]
}
EOF
}

# containerd 2.x hosts.toml files, one per mirrored host.
write_registry_hosts() {
    local host
    for host in "${MIRRORED_HOSTS[@]}"; do
        mkdir -p "$WORK/certs.d/$host"
        cat >"$WORK/certs.d/$host/hosts.toml" <<EOF
server = "http://$REGISTRY"

[host."http://$REGISTRY"]
  capabilities = ["pull", "resolve"]
EOF
    done
}

# Configuration version 3 (containerd 2.x). $1: its directory.
containerd2_config() {
    cat <<EOF
version = 3
root = "$1/root"
state = "$1/state"

[grpc]
  address = "$1/containerd.sock"

[ttrpc]
  address = "$1/containerd.sock.ttrpc"

[debug]
  level = "info"

[plugins."io.containerd.cri.v1.runtime"]
  # negative oom_score_adj is refused on these machines
  restrict_oom_score_adj = true
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "$WORK/cni/conf"
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "/usr/sbin/runc"
        Root = "$1/runc"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "native"
  # the transfer service unpacks only for overlayfs, which this machine lacks
  use_local_image_pull = true
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "$SANDBOX_IMAGE"
  [plugins."io.containerd.cri.v1.images".registry]
    config_path = "$WORK/certs.d"

[plugins."io.containerd.nri.v1.nri"]
  socket_path = "$1/nri.sock"
EOF
}

# Configuration version 2 (Debian's containerd 1.6). $1: its directory.
containerd16_config() {
    cat <<EOF
version = 2
root = "$1/root"
state = "$1/state"

[grpc]
  address = "$1/containerd.sock"

[ttrpc]
  address = "$1/containerd.sock.ttrpc"

[debug]
  level = "info"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$SANDBOX_IMAGE"
  # negative oom_score_adj is refused on these machines
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "native"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "/usr/sbin/runc"
        Root = "$1/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$WORK/cni/conf"
EOF
    local host
    for host in "${MIRRORED_HOSTS[@]}"; do
        cat <<EOF
  [plugins."io.containerd.grpc.v1.cri".registry.mirrors."$host"]
    endpoint = ["http://$REGISTRY"]
EOF
    done
}

# Starts a fresh containerd of version $1 for the run named $2; sets CONTAINERD_DIR
# and CONTAINERD_PID.
start_containerd() {
    local version=$1 run=$2 binary path
    CONTAINERD_DIR=$WORK/$run
    mkdir -p "$CONTAINERD_DIR"
    if [ "$version" = 2 ]; then
        containerd2_config "$CONTAINERD_DIR" >"$CONTAINERD_DIR/config.toml"
        # its shim comes from the same directory
        binary=$K8S_BIN/containerd
        path=$K8S_BIN:$PATH
    else
        containerd16_config "$CONTAINERD_DIR" >"$CONTAINERD_DIR/config.toml"
        # Debian's containerd and shim, and no other shim on PATH
        binary=/usr/bin/containerd
        path=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
    fi
    PATH=$path "$binary" --config "$CONTAINERD_DIR/config.toml" >"$OUT/$run.containerd.log" 2>&1 &
    CONTAINERD_PID=$!
    wait_for_cri "$CONTAINERD_DIR/containerd.sock" "$CONTAINERD_PID" "$OUT/$run.containerd.log" containerd
    log "$run: $("$binary" --version)"
}

# Waits until the CRI answers on socket $1, served by pid $2 logging to $3.
wait_for_cri() {
    local i
    for ((i = 0; i < 300; i++)); do
        if [ -S "$1" ] && "$K8S_BIN/crictl" --runtime-endpoint "unix://$1" --image-endpoint "unix://$1" \
            --timeout 2s version >/dev/null 2>&1; then
            return 0
        fi
        kill -0 "$2" 2>/dev/null || die "$4 exited; see $3"
        sleep 0.1
    done
    die "$4 did not answer on $1 within 30 s; see $3"
}

# === the proxy ===

# A dev build: the test job's `cargo test --workspace` has already built it and its
# dependencies in this profile, so this is quick, while a release build would
# compile every dependency again; the proxy's speed does not matter to critest, and
# debug assertions stay on.
build_proxy() {
    log "building tessera-runtime-proxy"
    cargo build --locked -p tessera-runtime-proxy --bin tessera-runtime-proxy
    PROXY_BIN=$ROOT/target/debug/tessera-runtime-proxy
}

# Starts the proxy in front of the running containerd, for the run named $1,
# serving it the way $2 says (--relay).
start_proxy() {
    local run=$1 relay=$2 socket=$WORK/$1.proxy.sock
    mkdir -p "$WORK/hooks.d"
    # an empty hooks.d and no GPU hook: every call is forwarded as it is
    env -u TESSERA_PROXY_CONFIG RUST_LOG="${RUST_LOG:-info}" NO_COLOR=1 "$PROXY_BIN" --listen "$socket" \
        --runtime-endpoint "$CONTAINERD_DIR/containerd.sock" --hooks-dir "$WORK/hooks.d" \
        --no-gpu-hook --relay "$relay" >"$OUT/$run.proxy.log" 2>&1 &
    PROXY_PID=$!
    wait_for_cri "$socket" "$PROXY_PID" "$OUT/$run.proxy.log" tessera-runtime-proxy
    PROXY_SOCKET=$socket
}

# === critest ===

# Runs critest against socket $1 for the run named $2; the report goes to
# $OUT/$2.xml. critest's exit status is not ours: the report is what is compared.
run_critest() {
    local socket=$1 run=$2 args=()
    local started=$SECONDS
    # The NRI specs register a plugin on containerd's own NRI socket (2.x only).
    [ ! -S "$CONTAINERD_DIR/nri.sock" ] || args+=("-nri-socket=$CONTAINERD_DIR/nri.sock")
    mkdir -p "$WORK/tmp/$run"
    log "$run: critest against $socket"
    # TMPDIR: the specs' host directories and log directories land under $WORK,
    # which the cleanup unmounts and removes.
    # In the background, so that a signal reaches the trap at once.
    TMPDIR=$WORK/tmp/$run "$K8S_BIN/critest" --runtime-endpoint "unix://$socket" \
        --image-endpoint "unix://$socket" --ginkgo.junit-report "$OUT/$run.xml" \
        --ginkgo.no-color "${args[@]}" ${CRITEST_ARGS[@]+"${CRITEST_ARGS[@]}"} \
        >"$OUT/$run.critest.log" 2>&1 &
    CRITEST_PID=$!
    wait "$CRITEST_PID" || true
    CRITEST_PID=
    [ -s "$OUT/$run.xml" ] || die "$run: critest wrote no report; see $OUT/$run.critest.log"
    TIMES[$run]=$((SECONDS - started))
    log "$run: $(python3 scripts/critest/junit.py summary "$OUT/$run.xml") in ${TIMES[$run]} s"
}

# A spec that passed against containerd but not through the proxy is run again,
# alone, through a fresh proxy and containerd, up to RETRIES times: some of
# containerd's own specs fail now and then under load (a failed RunPodSandbox
# left behind when its cleanup raced, in one CI run). It counts as the proxy's
# only when it fails every time; one that passes on a retry is reported, by
# name, as flaky. Returns 1 when any still fails.
RETRIES=2
retry_through_proxy() {
    local version=$1 relay=$2 direct=$3 proxied=$4 focus left attempt run
    focus=$(python3 scripts/critest/junit.py focus "$OUT/$direct.xml" "$OUT/$proxied.xml")
    [ -n "$focus" ] || return 0
    for attempt in $(seq 1 "$RETRIES"); do
        run=$proxied-retry$attempt
        start_containerd "$version" "$run"
        start_proxy "$run" "$relay"
        CRITEST_ARGS+=("--ginkgo.focus=$focus")
        run_critest "$PROXY_SOCKET" "$run"
        unset 'CRITEST_ARGS[${#CRITEST_ARGS[@]}-1]'
        stop_runtime
        left=$(python3 scripts/critest/junit.py focus "$OUT/$direct.xml" "$OUT/$proxied.xml" "$OUT/$run.xml")
        if [ -z "$left" ]; then
            echo "containerd $version, --relay $relay: FLAKY: passed through the proxy on retry $attempt, alone (see $OUT/$run.critest.log)"
            return 0
        fi
    done
    echo "containerd $version, --relay $relay: still failing through the proxy after $RETRIES retries, alone: $left"
    python3 scripts/critest/junit.py failures "$OUT/$run.xml"
    return 1
}

declare -A TIMES
install_critest_deps
find_k8s_bin
build_proxy
mkdir -p "$OUT"
rm -f "$OUT"/containerd-*.xml "$OUT"/containerd-*.log "$OUT"/registry.log
WORK=$(mktemp -d /tmp/tcri-XXXXXX) # short: unix socket paths are limited to 108 bytes
start_registry
push_images
write_cni_config
write_registry_hosts

FAILED=0
for version in $VERSIONS; do
    direct=containerd-$version-direct
    start_containerd "$version" "$direct"
    run_critest "$CONTAINERD_DIR/containerd.sock" "$direct"
    stop_runtime
    echo
    echo "containerd $version, specs that did not pass against containerd itself:"
    python3 scripts/critest/junit.py failures "$OUT/$direct.xml"
    echo "containerd $version: direct: $(python3 scripts/critest/junit.py summary "$OUT/$direct.xml"), ${TIMES[$direct]} s"
    for relay in $RELAYS; do
        proxied=containerd-$version-proxy-$relay
        start_containerd "$version" "$proxied"
        start_proxy "$proxied" "$relay"
        run_critest "$PROXY_SOCKET" "$proxied"
        stop_runtime
        echo "containerd $version: proxy (--relay $relay): $(python3 scripts/critest/junit.py summary "$OUT/$proxied.xml"), ${TIMES[$proxied]} s"
        if ! python3 scripts/critest/junit.py compare "$OUT/$direct.xml" "$OUT/$proxied.xml"; then
            echo "containerd $version, --relay $relay: the proxy's warnings and errors (all in $OUT/$proxied.proxy.log):"
            grep -E ' (WARN|ERROR) ' "$OUT/$proxied.proxy.log" | tail -n 40 || true
            echo "containerd $version, --relay $relay: critest's log: $OUT/$proxied.critest.log"
            retry_through_proxy "$version" "$relay" "$direct" "$proxied" || FAILED=1
        fi
    done
    echo
done
exit "$FAILED"
