#!/usr/bin/env bash
# gpu-enforce-check.sh: proves "Enforced shares" on a real NVIDIA GPU through Tessera's own
# injection (docs/enforcement.md). containerd 2.3 (CDI on) + runc, tessera-runtime-proxy in
# front with the real NVML, --gpu-memory-limits=auto and HAMi-core; pods driven with crictl.
# torch is the host's: its folders are mounted read-only into the containers, so nothing of
# CUDA is copied into an image. Checks, one PASS/FAIL/INFO line each in OUT/summary.txt:
#   a  a 25 % / 20 GiB container: 10 GiB ok, 30 GiB refused; bf16 8192^3 matmul for 20 s at
#      <= 0.35 of a whole-GPU container's rate (5 s), measured in the same run; with gpu-time
#      on (the proxy's default), the freezes and thaws of its cgroup are counted
#   b  the same in a fresh shared container whose first CUDA process runs under `env -i`
#   c  tenant 2 (another pod, 25 % of the same GPU) gets its own 10 GiB while tenant 1 holds 10
#   f  two tenants at once (25 % each, 20 s): each one's rate and their sum
#   g  two processes at once in one 25 % container: their sum (a share is the container's)
#   k  the OOM kill: t1 filled to HAMi-core's limit is not killed (the driver's count against
#      the grant: the margin's measure); a tenant's user namespace hiding /etc/ld.so.preload;
#      a host process without HAMi-core in t2's cgroup allocating 30 GiB is killed
#   d  each container's OCI spec (OUT/specs.json): TESSERA_ENFORCEMENT, limiter env,
#      HAMi-core's mounts, the tessera-enforce createRuntime hook
#   e  with driver-memory on (r615+): nvmlDeviceGetMemoryLimits_v1 on each shared cgroup
#   m  with MPS v3 (r615+; fake mode: fake-mps-control): each shared container's namespace
#      pipe directory (read-only) and client env; the GPU exclusive-process while shared,
#      DEFAULT after (nvidia-smi); on 580 an INFO line says why MPS is off
#
# As root, from the checkout's root:
#   bash scripts/gpu-enforce-check.sh --pack [DIR]  on the build machine: puts what does not
#       travel with the checkout in DIR (default target/gpucheck): the release binaries
#       (built with CARGO_TARGET_DIR=/tmp/gpucheck-target when missing), containerd, ctr,
#       crictl, runc + libseccomp, and HAMi-core's source from $HAMI_CORE_SRC (with
#       HAMI_INCLUDE=a folder holding cuda.h and nvml.h: those and a libvgpu.so built here too)
#   bash scripts/gpu-enforce-check.sh               on the GPU machine (carry target/gpucheck)
#   GPU_CHECK_FAKE=1 bash scripts/gpu-enforce-check.sh   no GPU: the fake NVML (memoryLimits on;
#       GPU_CHECK_FAKE_LIMITS=0: off, as driver 580), mknod'ed device nodes; the torch steps
#       report "no GPU", the spec checks must PASS
# Env: OUT (default /tmp/gpu-enforce-out; at most 7 files are written there), GPU_CHECK_BUDGET
# (420: no step starts after it, none runs past it; cleanup and summary still run),
# GPU_CHECK_WORK (/tmp/gpu-enforce-work), GPU_CHECK_PACK, TESSERA_BIN_DIR, HAMI_CORE_SRC (a
# HAMi-core work tree), HAMI_CORE_LIB (a built libvgpu.so), GPU_CHECK_PYTHON (python3),
# K8S_BIN (containerd's binaries, plain or .xz), GPU_CHECK_MPS (1: MPS v3 on a real GPU, which
# sets its compute mode while shares run and DEFAULT after; otherwise MPS is left off there),
# GPU_CHECK_SKIP (step names, space-separated: e.g. "torch-b" when time is short).
set -uo pipefail

SELF=$(realpath "$0"); ROOT=$(cd "$(dirname "$SELF")/.." && pwd); HELP=$ROOT/scripts/gpu
PACK=${GPU_CHECK_PACK:-$ROOT/target/gpucheck}
export SELF ROOT HELP PACK
export FAKE=${GPU_CHECK_FAKE:-} BUDGET=${GPU_CHECK_BUDGET:-420} W=${GPU_CHECK_WORK:-/tmp/gpu-enforce-work}
export OUT=${OUT:-/tmp/gpu-enforce-out}
for d in /usr/local/nvidia/bin /usr/local/cuda/bin; do [ -d "$d" ] && PATH=$PATH:$d; done; export PATH
SRC_K8S=(${K8S_BIN:+"$K8S_BIN"} "$ROOT/../shared/k8s/bin" "$ROOT/shared/k8s/bin")
SRC_BIN=(${TESSERA_BIN_DIR:+"$TESSERA_BIN_DIR"} "${CARGO_TARGET_DIR:-/tmp/gpucheck-target}/release" "$ROOT/target/release")
K8S_DIRS=("$PACK/k8s" "${SRC_K8S[@]}"); BIN_DIRS=("$PACK/bin" "${SRC_BIN[@]}") # a pack first: what was checked here

# ---------------------------------------------------------------- helpers
el() { echo $(( $(date +%s) - T0 )); }
log() { echo "[$(date +%H:%M:%S) +$(el)s] $*" | tee -a "$OUT/log.txt"; }
setstate() { printf '%s=%q\n' "$1" "$2" >> "$W/state.env"; }
loadstate() { [ -f "$W/state.env" ] && . "$W/state.env"; return 0; }
find_in() { # NAME DIR...: the first DIR/NAME or DIR/NAME.xz
  local n=$1 d; shift
  for d in "$@"; do for f in "$d/$n" "$d/$n.xz"; do [ -f "$f" ] && { echo "$f"; return 0; }; done; done
  return 1
}
getbin() { # NAME DEST DIR...: copies (or unpacks) NAME from the first DIR holding it
  local n=$1 dest=$2 f; shift 2
  f=$(find_in "$n" "$@") || { echo "getbin: no $n in $*"; return 1; }
  case $f in
    *.xz) if command -v xz >/dev/null; then xz -dc "$f" > "$dest"
          else python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$f" "$dest"; fi ;;
    *) cp "$f" "$dest" ;;
  esac && chmod +x "$dest" && echo "$n <- $f"
}
find_lib() { # NAME: the driver's copy (LD_LIBRARY_PATH, ldconfig, the usual folders)
  local n=$1 d p
  for d in ${LD_LIBRARY_PATH//:/ }; do [ -e "$d/$n" ] && case $d in *compat*) ;; *) echo "$d/$n"; return;; esac; done
  p=$(ldconfig -p 2>/dev/null | awk -v n="$n" '$1 == n && /x86-64/ && $NF !~ /compat/ {print $NF; exit}')
  [ -n "$p" ] && { echo "$p"; return; }
  for d in /usr/local/nvidia/lib64 /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib; do
    [ -e "$d/$n" ] && { echo "$d/$n"; return; }; done
}
crictl_() { "$W/bin/crictl" --config "$W/crictl.yaml" --timeout 120s "$@"; }
cid_of() { cat "$W/res/cid-$1" 2>/dev/null; }
texec() { # POD SECONDS LABEL MODE [env -i]: torchcheck.py in POD's container, through ExecSync
  # (the process gets the container's env, as with kubectl exec; `env -i` drops all of it);
  # the matmuls run MATMUL_SECONDS (5; 20 in shared containers, so that a share held over
  # time, gpu-time's, is measured past its 0.5 s burst)
  local pod=$1 t=$2 label=$3 mode=$4 rc secs=5; shift 4
  [ "$pod" = whole ] || secs=20
  [ -n "$(cid_of "$pod")" ] || { echo "$label: no container $pod" | tee "$W/res/exec-$label.txt"; return 1; }
  crictl_ exec -s --timeout "$t" "$(cid_of "$pod")" "$@" "$PY_EXE" /torchcheck.py "$label" "$mode" "$secs" > "$W/res/exec-$label.txt" 2>&1
  rc=$?; echo "$label ($pod, $*): rc=$rc"; tail -3 "$W/res/exec-$label.txt"
}

hami_build() { # SRC OUTDIR INCDIR...: libvgpu.so as ../shared/gpu/hami-build.sh builds it: gcc,
  # its build.sh's Debug flags and four hook options, no CMake (its CMakeLists need CMake < 4)
  local src out f o j fail=0 hash objs=(); src=$(realpath "$1"); out=$(realpath -m "$2"); shift 2
  mkdir -p "$out/config" "$out/obj"
  hash=$(cut -c1-7 "$src/COMMIT" 2>/dev/null || git -C "$src" rev-parse --short HEAD 2>/dev/null || echo unknown)
  sed -e 's/^#cmakedefine \(MULTIPROCESS_LIMIT_ENABLE\|DLSYM_HOOK_ENABLE\|HOOK_MEMINFO_ENABLE\|HOOK_NVML_ENABLE\)$/#define \1/' \
      -e 's/^#cmakedefine \(.*\)$/\/* #undef \1 *\//' -e "s/@GIT_HASH@/$hash/" -e "s/@GIT_BRANCH@/main/" \
      "$src/src/static_config.h.in" > "$out/config/static_config.h" || return 1
  local inc=(-I "$src/src" -I "$out/config")
  for f in "$@"; do inc+=(-I "$f"); done
  for f in libvgpu.c utils.c log_utils.c nvml/nvml_entry.c nvml/hook.c cuda/context.c cuda/device.c cuda/hook.c \
           cuda/event.c cuda/memory.c cuda/stream.c cuda/graph.c allocator/allocator.c \
           multiprocess/multiprocess_memory_limit.c multiprocess/multiprocess_utilization_watcher.c; do
    o=$out/obj/$(echo "$f" | tr / _).o; objs+=("$o")
    gcc -fPIC -g -D_GNU_SOURCE -Wall -Wno-unused-variable -Wno-unused-function "${inc[@]}" -c "$src/src/$f" -o "$o" 2>>"$out/warnings.log" &
  done
  for j in $(jobs -p); do wait "$j" || fail=1; done
  [ $fail = 0 ] || { echo "hami-build: a compile failed"; grep -m20 error "$out/warnings.log"; return 1; }
  gcc -shared -fPIC -g -o "$out/libvgpu.so" "${objs[@]}" -lpthread -ldl -lrt &&
    echo "hami-build: $out/libvgpu.so ($(stat -c %s "$out/libvgpu.so") bytes, HAMi-core $hash)"
}

pack() { # DIR: what a GPU run needs that does not travel with the checkout (~35 MB, for carry)
  local d=${1:-$PACK} n f missing=()
  mkdir -p "$d/bin" "$d/k8s" "$d/lib"
  for n in tessera-runtime-proxy tessera-enforce; do find_in "$n" "${SRC_BIN[@]}" >/dev/null || missing+=("-p" "$n"); done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "building ${missing[*]} (release) in ${CARGO_TARGET_DIR:-/tmp/gpucheck-target}"
    (cd "$ROOT" && CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/tmp/gpucheck-target} cargo build --release --bins "${missing[@]}") || return 1
  fi
  for n in tessera-runtime-proxy tessera-enforce; do
    f=$(find_in "$n" "${SRC_BIN[@]}") || return 1
    strip -o "$d/bin/$n" "$f" 2>/dev/null || cp "$f" "$d/bin/$n"
    xz -T0 -f "$d/bin/$n" && echo "$n <- $f"
  done
  for n in containerd containerd-shim-runc-v2 ctr crictl; do
    f=$(find_in "$n" "${SRC_K8S[@]}") || { echo "no $n"; return 1; }; cp "$f" "$d/k8s/"; done
  f=$(command -v runc || echo /usr/sbin/runc); xz -T0 -c "$f" > "$d/bin/runc.xz"
  gcc -static -O2 -o "$d/bin/pause" "$ROOT/integration/harness/images/pause.c" || return 1 # no libc.a needed there
  ldd "$f" | awk '/libseccomp/ {print $3}' | xargs -r -I{} cp -L {} "$d/lib/"
  if [ -n "${HAMI_CORE_SRC:-}" ]; then
    rm -rf "$d/hami-core"; mkdir -p "$d/hami-core"
    tar -C "$HAMI_CORE_SRC" --exclude=.git -cf - . | tar -C "$d/hami-core" -xf -
    f=$(git -C "$HAMI_CORE_SRC" rev-parse HEAD 2>/dev/null || echo "${HAMI_CORE_COMMIT:-}")
    [ -n "$f" ] && echo "$f" > "$d/hami-core/COMMIT"
    if [ -n "${HAMI_INCLUDE:-}" ]; then # headers for a machine without them, and a build made here as a fallback
      mkdir -p "$d/include"; cp "$HAMI_INCLUDE/cuda.h" "$HAMI_INCLUDE/nvml.h" "$d/include/" &&
        hami_build "$d/hami-core" "$d/hami-prebuilt" "$d/include" && rm -rf "$d/hami-prebuilt/obj"
    fi
  else echo "HAMI_CORE_SRC not set: no HAMi-core source packed (the GPU run then checks driver-memory alone)"; fi
  du -sh "$d"
}

# ---------------------------------------------------------------- steps
step_prepare() {
  local n
  mkdir -p "$W/bin" "$W/res/ctr" "$W/cdi" "$W/hooks.d" "$W/enforce" "$W/img"
  for n in containerd containerd-shim-runc-v2 ctr crictl; do getbin "$n" "$W/bin/$n" "${K8S_DIRS[@]}" || return 1; done
  for n in tessera-runtime-proxy tessera-enforce; do getbin "$n" "$W/bin/$n" "${BIN_DIRS[@]}" || return 1; done
  # runc: the machine's, else the packed one with its libseccomp (a wrapper: no system change)
  if command -v runc >/dev/null || [ -x /usr/sbin/runc ]; then setstate RUNC "$(command -v runc || echo /usr/sbin/runc)"
  elif getbin runc "$W/bin/runc.real" "$PACK/bin"; then
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$PACK/lib" "$W/bin/runc.real" > "$W/bin/runc"
    chmod +x "$W/bin/runc"; setstate RUNC "$W/bin/runc"
  else echo "no runc"; return 1; fi
  loadstate; "$RUNC" --version | head -1
  "$W/bin/containerd" --version; "$W/bin/tessera-runtime-proxy" --version
}

step_facts() {
  local smi q py
  if [ -n "$FAKE" ]; then # integration/harness fake_nvml::four_gpu_node, with the r615 calls on
    local fl=${FAKE_NVML_LIB:-$(find_in libtessera_fake_nvml.so "$ROOT/target/debug" "${CARGO_TARGET_DIR:-/tmp/gpucheck-target}/debug")} uvm
    [ -f "$fl" ] || { echo "no libtessera_fake_nvml.so: cargo build -p tessera-fake-nvml"; return 1; }
    mkdir -p "$W/fakelib" "$W/dev"; cp "$fl" "$W/fakelib/libnvidia-ml.so.1"
    python3 - "$W/fakelib/fake-nvml.json" "$W/res/memory-limits.jsonl" "${GPU_CHECK_FAKE_LIMITS:-1}" "$W/res/compute-mode.jsonl" "$W/res/fake-processes" <<'EOF'
import json, sys
gpu = lambda i, p: {"uuid": "GPU-fa4e0000-0000-4000-8000-00000000000%d" % i, "minor": i, "name": "NVIDIA H100 80GB HBM3",
                    "memoryBytes": 85899345920, "busId": "00000000:%02X:00.0" % (0x18 + i * 0x10), "numaNode": i // 2,
                    "pcieSwitch": "sw%d" % (i // 2), "nvlinks": [{"link": 0, "peerBusId": "00000000:%02X:00.0" % (0x18 + p * 0x10)}]}
json.dump({"driverVersion": "550.54.15", "cudaDriverVersion": 12040, "gpus": [gpu(0, 1), gpu(1, 0), gpu(2, 3), gpu(3, 2)],
           "xidEvents": [], "memoryLimits": sys.argv[3] != "0", "memoryLimitsLog": sys.argv[2], "computeModeLog": sys.argv[4],
           "processUtilization": sys.argv[5]},
          open(sys.argv[1], "w"), indent=1)
EOF
    uvm=$(awk '$2 == "nvidia-uvm" {print $1}' /proc/devices); uvm=${uvm:-510}
    for n in 0 1 2 3; do mknod "$W/dev/nvidia$n" c 195 $n; done
    mknod "$W/dev/nvidiactl" c 195 255; mknod "$W/dev/nvidia-uvm" c "$uvm" 0; mknod "$W/dev/nvidia-uvm-tools" c "$uvm" 1
    setstate NVML_LIB "$W/fakelib/libnvidia-ml.so.1"; setstate DRIVER_DIR "$W/fakelib"
    setstate DEV_ROOT "$W/dev"; setstate DRIVER_GPUS "$W/no-driver-gpus"
    setstate GPU_UUID GPU-fa4e0000-0000-4000-8000-000000000000; setstate GPU_MINOR 0
    setstate GPU_DESC "fake: NVIDIA H100 80GB HBM3 x4, driver 550.54.15 (fake NVML, memoryLimits ${GPU_CHECK_FAKE_LIMITS:-1})"
  else
    local nvml cuda dd
    nvml=$(find_lib libnvidia-ml.so.1); cuda=$(find_lib libcuda.so.1)
    echo "libnvidia-ml.so.1: ${nvml:-none}; libcuda.so.1: ${cuda:-none}"
    [ -n "$nvml" ] || { echo "no libnvidia-ml.so.1"; return 1; }
    dd=$(dirname "$(readlink -f "${cuda:-$nvml}")") # the folder the driver's files really are in
    [ -z "$cuda" ] || [ -e "$dd/libcuda.so.1" ] || dd=$(dirname "$cuda")
    smi=$(command -v nvidia-smi) || { echo "no nvidia-smi"; return 1; }
    timeout 20 "$smi" -L
    q=$(timeout 20 "$smi" -i 0 --query-gpu=uuid,name,memory.total,driver_version --format=csv,noheader)
    setstate GPU_UUID "$(echo "$q" | cut -d, -f1 | tr -d ' ')"
    setstate GPU_MINOR "$(timeout 20 "$smi" -q -i 0 | awk -F: '/Minor Number/ {gsub(/ /, "", $2); print $2; exit}')"
    setstate GPU_DESC "$q; cgroup $(stat -fc %T /sys/fs/cgroup)"
    setstate NVML_LIB "$nvml"; setstate DRIVER_DIR "$dd"; setstate DEV_ROOT /dev; setstate DRIVER_GPUS /proc/driver/nvidia/gpus
  fi
  loadstate
  # The folders the containers mount read-only at the same paths: python, its packages and
  # torch, /usr/{bin,lib,lib64}, the driver's. Whole /usr cannot be mounted: HAMi-core's
  # library lands in /usr/local/vgpu, which must be the container's own.
  py=${GPU_CHECK_PYTHON:-python3}
  "$py" - "$DRIVER_DIR" "$W/mounts.txt" "$W/res/python.json" <<'EOF'
import json, os, sys
dd, mounts, info = sys.argv[1:4]
paths = [sys.executable, os.path.realpath(sys.executable), sys.prefix, sys.base_prefix, sys.exec_prefix] + sys.path
out = {"executable": sys.executable, "version": sys.version.split()[0]}
try:
    import torch
    paths.append(os.path.dirname(os.path.dirname(torch.__file__))); out["torch"] = torch.__version__
except Exception as e:  # noqa: BLE001
    out["torchError"] = repr(e)[:200]
def root(p):
    parts = [x for x in p.split("/") if x]
    if not parts or parts[0] in ("etc", "proc", "sys", "dev", "run"):
        return None
    n = 3 if parts[0] == "usr" and len(parts) > 1 and parts[1] == "local" else 2
    return "/" + "/".join(parts[:n]) if len(parts) >= n else None
roots = {"/usr/bin", "/usr/lib", "/usr/lib64", dd}
for p in paths:
    for q in ({p, os.path.realpath(p)} if p else ()):
        r = root(q) if q and os.path.exists(q) else None
        if r and os.path.isdir(r) and not os.path.islink(r):
            roots.add(r)
for top in ("bin", "sbin", "lib", "lib64"):  # not merged-/usr hosts: the real folders
    if os.path.isdir("/" + top) and not os.path.islink("/" + top):
        roots.add("/" + top)
roots = sorted(r for r in roots if os.path.isdir(r))
roots = [r for r in roots if not any(r.startswith(o + "/") for o in roots)]
open(mounts, "w").write("\n".join(roots) + "\n")
out["mounts"] = roots
json.dump(out, open(info, "w"))
print("python:", json.dumps(out))
EOF
  setstate PY_EXE "$("$py" -c 'import sys; print(sys.executable)')"
}

step_build() {
  local cands=() d cuda_inc="" nvml_inc="" src=${HAMI_CORE_SRC:-$PACK/hami-core}
  if [ -n "${HAMI_CORE_LIB:-}" ]; then setstate HAMI_LIB "$HAMI_CORE_LIB"; setstate HAMI_FROM "HAMI_CORE_LIB"
  elif [ -f "$src/src/static_config.h.in" ]; then
    d=$(command -v nvcc) && cands+=("$(dirname "$(readlink -f "$d")")/../include")
    cands+=(${HAMI_INCLUDE:+"$HAMI_INCLUDE"} /usr/local/cuda/include /usr/local/cuda/targets/x86_64-linux/include /usr/include)
    while read -r d; do cands+=("$d"); done < <("${GPU_CHECK_PYTHON:-python3}" -c 'import site, glob
for s in site.getsitepackages(): [print(p) for p in sorted(glob.glob(s + "/nvidia/*/include") + glob.glob(s + "/nvidia/*/*/include"))]' 2>/dev/null)
    cands+=("$PACK/include")
    for d in "${cands[@]}"; do [ -z "$cuda_inc" ] && [ -f "$d/cuda.h" ] && cuda_inc=$(realpath "$d"); done
    for d in "${cands[@]}"; do [ -z "$nvml_inc" ] && [ -f "$d/nvml.h" ] && nvml_inc=$(realpath "$d"); done
    echo "HAMi-core from $src; cuda.h in ${cuda_inc:-nowhere}; nvml.h in ${nvml_inc:-nowhere}"
    if hami_build "$src" "$W/hami" ${cuda_inc:+"$cuda_inc"} ${nvml_inc:+"$nvml_inc"} > "$W/res/hami-build.log" 2>&1; then
      setstate HAMI_LIB "$W/hami/libvgpu.so"; setstate HAMI_FROM "built from $src: $(tail -1 "$W/res/hami-build.log")"
    elif [ -f "$PACK/hami-prebuilt/libvgpu.so" ]; then
      setstate HAMI_LIB "$PACK/hami-prebuilt/libvgpu.so"; setstate HAMI_FROM "the build --pack made (building here failed)"
    else echo "HAMi-core build failed"; cat "$W/res/hami-build.log"; fi
  fi
  loadstate
  # Fake mode: HAMi-core itself cannot initialise without libcuda.so.1 (it crashes in
  # dlclose(NULL)), and the proxy has it write each region: the harness's stand-in,
  # which writes its region from its env as HAMi-core does, takes its place.
  [ -n "$FAKE" ] && [ -z "${HAMI_CORE_LIB:-}" ] && [ -n "${HAMI_LIB:-}" ] && ! find_lib libcuda.so.1 | grep -q . &&
    { HAMI_BUILT=$HAMI_FROM; HAMI_LIB=""; }
  if [ -z "${HAMI_LIB:-}" ] && [ -n "$FAKE" ]; then # the preload and region paths still run
    mkdir -p "$W/hami"; gcc -shared -fPIC -O2 -o "$W/hami/libvgpu-stand-in.so" "$ROOT/integration/harness/images/vgpu-stand-in.c" -ldl -lpthread &&
      { setstate HAMI_LIB "$W/hami/libvgpu-stand-in.so"; setstate HAMI_FROM "the harness's stand-in (fake mode, no libcuda.so.1)${HAMI_BUILT:+; HAMi-core built too: $HAMI_BUILT}"; }
  fi
  [ -z "${HAMI_LIB:-}" ] && [ -z "$FAKE" ] && setstate HAMI_FROM "none: HAMI_CORE_SRC, $PACK/hami-core and HAMI_CORE_LIB all absent"
  # The sandbox's and every container's entrypoint: the harness's static pause.
  getbin pause "$W/pause" "$PACK/bin" || gcc -static -O2 -o "$W/pause" "$ROOT/integration/harness/images/pause.c" ||
    { echo "no pause: gcc -static failed (libc6-dev?) and no $PACK/bin/pause"; return 1; }
  loadstate; echo "HAMi-core: $HAMI_FROM"
}

step_up() {
  cat > "$W/containerd.toml" <<EOF
version = 3
root = "$W/ctrd/root"
state = "$W/ctrd/state"
[grpc]
  address = "$W/containerd.sock"
[ttrpc]
  address = "$W/containerd.sock.ttrpc"
[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true
  disable_apparmor = true
  enable_cdi = true
  cdi_spec_dirs = ["$W/cdi"]
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "$RUNC"
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["$W/cni"]
    conf_dir = "$W/cni"
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "native"
  use_local_image_pull = true
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "localhost/gpucheck-pause:1"
EOF
  printf 'runtime-endpoint: unix://%s/proxy.sock\nimage-endpoint: unix://%s/proxy.sock\n' "$W" "$W" > "$W/crictl.yaml"
  PATH="$W/bin:$PATH" "$W/bin/containerd" --config "$W/containerd.toml" > "$W/res/containerd.log" 2>&1 &
  echo $! > "$W/containerd.pid"
  for _ in $(seq 100); do [ -S "$W/containerd.sock" ] && break; sleep 0.1; done
  [ -S "$W/containerd.sock" ] || { echo "containerd did not start"; tail -20 "$W/res/containerd.log"; return 1; }
  # Images: pause; the workload's skeleton (/usr/bin etc. come from the host as mounts), with an
  # ld.so.cache naming the driver's folder, so `env -i` processes find libcuda.so.1 too.
  printf 'include /etc/ld.so.conf.d/*.conf\n%s\n' "$DRIVER_DIR" > "$W/img/ld.so.conf"
  ldconfig -X -C "$W/img/ld.so.cache" -f "$W/img/ld.so.conf" || return 1
  echo "root:x:0:0:root:/root:/bin/sh" > "$W/img/passwd"; echo "root:x:0:" > "$W/img/group"
  local e=(d:/etc d:/tmp:1777 d:/usr d:/usr/local d:/out d:/root:700 "f:$W/pause:/pause" "f:$HELP/torchcheck.py:/torchcheck.py"
           "f:$W/img/ld.so.cache:/etc/ld.so.cache" "f:$W/img/passwd:/etc/passwd" "f:$W/img/group:/etc/group") t
  for t in bin sbin lib lib64; do [ -L "/$t" ] && e+=("l:/$t:$(readlink "/$t")"); done
  python3 "$HELP/mkimg.py" "$W/img/pause.tar" localhost/gpucheck-pause:1 /pause -- "f:$W/pause:/pause" || return 1
  python3 "$HELP/mkimg.py" "$W/img/gpucheck.tar" localhost/gpucheck:1 /pause PATH=/usr/local/bin:/usr/bin:/bin -- "${e[@]}" || return 1
  for t in pause gpucheck; do "$W/bin/ctr" -a "$W/containerd.sock" -n k8s.io images import "$W/img/$t.tar" || return 1; done
  local args=(--listen "$W/proxy.sock" --runtime-endpoint "$W/containerd.sock" --hooks-dir "$W/hooks.d" --metrics-addr off
              --device-root "$DEV_ROOT" --driver-gpus "$DRIVER_GPUS" --nvml-library "$NVML_LIB"
              --kubelet-checkpoint "$W/no-checkpoint" --gpu-memory-limits auto --enforce-binary "$W/bin/tessera-enforce"
              --enforcement-dir "$W/enforce" --cdi-spec-dir "$W/cdi")
  [ -n "${HAMI_LIB:-}" ] && args+=(--hami-core-library "$HAMI_LIB")
  # MPS v3 (driver r615+): Tessera's supervised daemon first, then --mps auto on the proxy.
  # Fake mode: the fake daemon (fake-mps-control). Driver 580 has MPS v2 only: off, and why.
  local mpsctl=""
  if [ -n "$FAKE" ]; then mpsctl=$(find_in fake-mps-control "$ROOT/target/debug" "${CARGO_TARGET_DIR:-/tmp/gpucheck-target}/debug" "${BIN_DIRS[@]}")
  else mpsctl=$(command -v nvidia-cuda-mps-control); fi
  [ -n "$mpsctl" ] && [ -z "$FAKE" ] && timeout 10 "$mpsctl" -p 3 -h < /dev/null > "$W/res/mps-v3-help.txt" 2>&1
  # The supervisor sets the GPU's compute mode (exclusive-process while shared): on a machine
  # lent with "leave the accelerator's settings as they are", only when GPU_CHECK_MPS=1.
  if [ -n "$mpsctl" ] && [ -z "$FAKE" ] && [ "${GPU_CHECK_MPS:-}" != 1 ] && grep -q namespace "$W/res/mps-v3-help.txt"; then
    setstate MPS "off: MPS v3 is there, but it changes the GPU's compute mode: GPU_CHECK_MPS=1 allows that"
  elif [ -n "$mpsctl" ] && { [ -n "$FAKE" ] || grep -q namespace "$W/res/mps-v3-help.txt"; }; then
    FAKE_MPS_LOG="$W/res/mps-commands.jsonl" RUST_LOG=info "$W/bin/tessera-enforce" mps-daemon --control "$mpsctl" \
      --pipe-dir "$W/mps/pipe" --log-dir "$W/mps/log" --state-dir "$W/enforce/mps" --nvml-library "$NVML_LIB" \
      > "$W/res/mps.log" 2>&1 &
    echo $! > "$W/mps.pid"
    for _ in $(seq 100); do [ -S "$W/mps/pipe/control" ] && break; sleep 0.1; done
    args+=(--mps auto --mps-control "$mpsctl" --mps-pipe-dir "$W/mps/pipe")
    setstate MPS "on: $mpsctl, daemon $( [ -S "$W/mps/pipe/control" ] && echo up || echo 'not up')"
  elif [ -n "$mpsctl" ]; then setstate MPS "off: $mpsctl has no MPS v3 (-p 3 needs driver r615+): $(head -c 160 "$W/res/mps-v3-help.txt" | tr '\n' ' ')"
  else setstate MPS "off: no nvidia-cuda-mps-control"; fi
  echo "tessera-runtime-proxy ${args[*]}" | tee "$W/res/proxy.cmd"
  # gpu-time's freezes and thaws are logged at debug: the summary counts them.
  RUST_LOG=info,tessera_enforce::throttle=debug "$W/bin/tessera-runtime-proxy" "${args[@]}" > "$W/res/proxy.log" 2>&1 &
  echo $! > "$W/proxy.pid"
  for _ in $(seq 100); do [ -S "$W/proxy.sock" ] && break; kill -0 "$(cat "$W/proxy.pid")" 2>/dev/null || break; sleep 0.1; done
  [ -S "$W/proxy.sock" ] || { echo "the proxy did not start"; cat "$W/res/proxy.log"; return 1; }
  crictl_ version
  setstate BACKENDS "$(sed 's/\x1b\[[0-9;]*m//g' "$W/res/proxy.log" | grep -m1 -oE 'share enforcement.*backends=[^ ]+' | sed 's/.*backends=//')"
  loadstate; echo "share enforcement backends=$BACKENDS"; grep -iE 'memory limits|enforce' "$W/res/proxy.log" | head -5
}

step_pods() {
  local p pod cid
  python3 "$HELP/cri.py" "$W/cri" "$W" "$GPU_UUID" "$GPU_MINOR" "$W/mounts.txt" "$DRIVER_DIR" || return 1
  for p in whole t1 envi t2; do
    pod=$(crictl_ runp "$W/cri/$p-pod.json" 2> "$W/res/runp-$p.err") || { echo "$p: RunPodSandbox failed: $(cat "$W/res/runp-$p.err")"; continue; }
    echo "$pod" > "$W/res/pod-$p"
    if cid=$(crictl_ create --no-pull "$pod" "$W/cri/$p-ctr.json" "$W/cri/$p-pod.json" 2> "$W/res/create-$p.err"); then
      echo "$cid" > "$W/res/cid-$p"
      crictl_ start "$cid" 2> "$W/res/start-$p.err" || echo "$p: StartContainer failed: $(cat "$W/res/start-$p.err")"
      crictl_ inspect "$cid" > "$W/res/inspect-$p.json"
      echo "$p: $(python3 -c 'import json,sys; s=json.load(open(sys.argv[1]))["status"]; print(s["state"], s.get("annotations",{}).get("tessera.io/enforcement"))' "$W/res/inspect-$p.json")"
    else echo "$p: CreateContainer failed: $(cat "$W/res/create-$p.err")"; fi
  done
  ls -la "$W/cdi"; cat "$W/cdi"/* 2>/dev/null | head -c 3000; echo
}

step_mps_modes() { # m: the GPU's compute mode while shares run on it through MPS
  [ -f "$W/mps.pid" ] || { echo "MPS off"; return 0; }
  if [ -n "$FAKE" ]; then cat "$W/res/compute-mode.jsonl" > "$W/res/compute-mode-shared.txt" 2>&1
  else nvidia-smi --query-gpu=index,uuid,compute_mode --format=csv,noheader > "$W/res/compute-mode-shared.txt" 2>&1; fi
  cat "$W/res/compute-mode-shared.txt"; ls -R "$W/mps/pipe" | head -20
}

step_limits() { # e: the driver's limit on each shared container's own cgroup, read from outside
  local p pid cg v2 args=()
  v2=$(awk '$3 == "cgroup2" {print $2; exit}' /proc/mounts)
  for p in t1 envi t2 whole; do
    pid=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["info"]["pid"])' "$W/res/inspect-$p.json" 2>/dev/null) || continue
    cg=$(awk -F: '$1 == "0" {print $3}' "/proc/$pid/cgroup" 2>/dev/null)
    [ -n "$cg" ] && args+=("$p=$v2$cg")
  done
  echo "cgroups: ${args[*]}"
  timeout 20 python3 "$HELP/nvml_limits.py" "$NVML_LIB" "$GPU_UUID" "${args[@]}" | tee "$W/res/limits.json"
  [ -n "$FAKE" ] && { echo "fake NVML set calls:"; cat "$W/res/memory-limits.jsonl" 2>/dev/null; }
  [ -n "$FAKE" ] || [ -z "$(command -v nvidia-smi)" ] || timeout 20 nvidia-smi -q -d MEMORY > "$W/res/nvidia-smi-memory.txt" 2>&1
  return 0
}

# The torch runs: one at a time, so the matmul rates do not disturb each other.
step_torch_base() { texec whole 90 base full; }
step_torch_a() { texec t1 90 a full; }
step_torch_b() { # b: a fresh shared container whose first CUDA process has no env at all;
  # then (INFO) `env -i` in t1, where a process with the grant's env made HAMi-core's region first
  texec envi 90 b full env -i
  texec t1 60 b-join alloc env -i
}
step_torch_c() { # c: tenant 1 holds 10 GiB (in the background) while tenant 2 allocates
  [ -n "$(cid_of t1)" ] && [ -n "$(cid_of t2)" ] || { echo "c: no container t1 or t2" | tee "$W/res/exec-c.txt"; return 1; }
  crictl_ exec -s --timeout 90 "$(cid_of t1)" "$PY_EXE" /torchcheck.py c-hold hold 85 > "$W/res/exec-c-hold.txt" 2>&1 &
  local holder=$! i
  for i in $(seq 120); do grep -qE '"phase": "(holding|done)"' "$W/res/ctr/c-hold.json" 2>/dev/null && break; sleep 0.5; done
  # The proxy's report of each container's GPU memory while t1 holds 10 GiB (it reads
  # the driver every 2 s): the driver's count against the bytes held (the CUDA
  # context's margin), and MPS clients' memory as NVML gives it.
  sleep 3
  cp "$W/enforce/gpu-memory.json" "$W/res/gpu-memory-c.json" 2>/dev/null \
    || echo "no $W/enforce/gpu-memory.json" > "$W/res/gpu-memory-c.json"
  texec t2 60 c alloc
  touch "$W/res/ctr/c-hold.release"; wait "$holder"; echo "c-hold: rc=$?"; tail -2 "$W/res/exec-c-hold.txt"
}

step_torch_two() { # f: two tenants at once (t1, t2: 25 % each); g: two processes at once in t1
  local p
  for p in t1 t2; do [ -n "$(cid_of $p)" ] || { echo "f: no container $p"; return 1; }; done
  crictl_ exec -s --timeout 80 "$(cid_of t1)" "$PY_EXE" /torchcheck.py f1 full 20 > "$W/res/exec-f1.txt" 2>&1 &
  crictl_ exec -s --timeout 80 "$(cid_of t2)" "$PY_EXE" /torchcheck.py f2 full 20 > "$W/res/exec-f2.txt" 2>&1 &
  wait; tail -n 2 "$W/res/exec-f1.txt" "$W/res/exec-f2.txt"
  sleep 2 # t1's debt paid: an exec into a frozen container is refused by runc
  crictl_ exec -s --timeout 80 "$(cid_of t1)" "$PY_EXE" /torchcheck.py g1 full 20 > "$W/res/exec-g1.txt" 2>&1 &
  crictl_ exec -s --timeout 80 "$(cid_of t1)" "$PY_EXE" /torchcheck.py g2 full 20 > "$W/res/exec-g2.txt" 2>&1 &
  wait; tail -n 2 "$W/res/exec-g1.txt" "$W/res/exec-g2.txt"
}

step_torch_kill() { # k: the OOM kill (oom-kill), in three parts:
  # k1  t1 fills its share to HAMi-core's limit and holds it: not killed; the driver's count
  #     then, against the grant, is what --oom-kill-margin must cover (OUT/gpu-memory.json)
  # k2  in t2, a tenant's own user namespace bind-mounts /dev/null over /etc/ld.so.preload and
  #     allocates 30 GiB: does HAMi-core still load, and if not, does the OOM kill take it
  # k3  a host process without HAMi-core, moved into t2's cgroup, allocates 30 GiB in 1 GiB
  #     blocks: killed by the OOM kill, and how far it got (OUT/gpu-memory.json)
  local p i pid cpid cg
  for p in t1 t2; do [ -n "$(cid_of $p)" ] || { echo "k: no container $p"; return 1; }; done
  crictl_ exec -s --timeout 60 "$(cid_of t1)" "$PY_EXE" /torchcheck.py k1 fill 40 > "$W/res/exec-k1.txt" 2>&1 &
  pid=$!
  for i in $(seq 120); do grep -qE '"phase": "(holding|done)"' "$W/res/ctr/k1.json" 2>/dev/null && break; sleep 0.5; done
  sleep 2 # four of the proxy's readings
  cp "$W/enforce/gpu-memory.json" "$W/res/gpu-memory-k1.json" 2>/dev/null || echo "no report" > "$W/res/gpu-memory-k1.json"
  touch "$W/res/ctr/k1.release"; wait "$pid"; echo "k1: rc=$?"; tail -2 "$W/res/exec-k1.txt"
  # $0 of the inner shell is the python: no quoting of a path inside the quoted script.
  crictl_ exec -s --timeout 60 "$(cid_of t2)" unshare -Urm sh -c \
    'mount --bind /dev/null /etc/ld.so.preload && exec "$0" /torchcheck.py k2 over 8' "$PY_EXE" > "$W/res/exec-k2.txt" 2>&1
  echo $? > "$W/res/k2-rc"; echo "k2: rc=$(cat "$W/res/k2-rc")"; tail -3 "$W/res/exec-k2.txt"
  sleep 1
  cpid=$(crictl_ inspect "$(cid_of t2)" | python3 -c 'import json, sys; print(json.load(sys.stdin)["info"]["pid"])') || return 1
  cg=$(awk '$3 == "cgroup2" {print $2; exit}' /proc/mounts)$(awk -F: '$1 == "0" {print $3}' "/proc/$cpid/cgroup")
  [ -d "$cg" ] || { echo "k3: no cgroup $cg"; return 1; }
  echo "k3: t2's cgroup $cg"
  # Fake mode: no torch; a sleep that the fake NVML says holds 30 GiB of GPU 0.
  local run=("$PY_EXE" "$HELP/torchcheck.py" k3 over 8)
  [ -n "$FAKE" ] && run=(sleep 8)
  ( echo "$BASHPID" > "$cg/cgroup.procs" &&
    exec env -i PATH=/usr/bin:/bin TORCHCHECK_OUT="$W/res/ctr" LD_LIBRARY_PATH="$DRIVER_DIR" "${run[@]}" ) > "$W/res/exec-k3.txt" 2>&1 &
  pid=$!
  [ -n "$FAKE" ] && echo "0 $pid $((30 << 30))" > "$W/res/fake-processes"
  # The report while it allocates, until it ends (killed, or done after 8 s).
  while kill -0 "$pid" 2>/dev/null; do cp "$W/enforce/gpu-memory.json" "$W/res/gpu-memory-k3.json" 2>/dev/null; sleep 0.1; done
  date +%s.%N > "$W/res/k3-ended"
  wait "$pid"; echo $? > "$W/res/k3-rc"; echo "k3: rc=$(cat "$W/res/k3-rc") (137: SIGKILL)"; tail -3 "$W/res/exec-k3.txt"
  sleep 1; cp "$W/enforce/gpu-memory.json" "$W/res/gpu-memory-k3.json" 2>/dev/null
}

down() { # stops what this script started: pods (through the proxy first, so its cleanup
  # runs), proxy, containerd, shims (by their executable, this run's copy), mounts
  local p f c=("$W/bin/crictl" --config "$W/crictl.yaml" --timeout 15s)
  if [ -S "$W/proxy.sock" ] && [ -f "$W/proxy.pid" ]; then
    timeout 20 "${c[@]}" rmp -fa; sleep 1
    { echo "left: $(ls -A "$W/cdi" 2>/dev/null | tr '\n' ' ')"
      echo "left: $(ls -A "$W/enforce/hami-core/containers" 2>/dev/null | tr '\n' ' ')"; } > "$W/res/after-rmp.txt"
  fi
  [ -S "$W/containerd.sock" ] && timeout 20 "${c[@]}" --runtime-endpoint "unix://$W/containerd.sock" rmp -fa
  for p in proxy containerd; do [ -f "$W/$p.pid" ] && kill "$(cat "$W/$p.pid")" 2>/dev/null; done
  # The MPS supervisor quits its daemon and hands the GPUs back to DEFAULT compute mode: wait for it.
  if [ -f "$W/mps.pid" ]; then
    p=$(cat "$W/mps.pid"); kill "$p" 2>/dev/null
    for _ in $(seq 150); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$p" 2>/dev/null; rm -f "$W/mps.pid"
    [ -z "$FAKE" ] && command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=index,compute_mode --format=csv,noheader > "$W/res/compute-mode-after.txt" 2>&1
  fi
  sleep 1
  for f in /proc/[0-9]*; do # shims left behind: those running this run's own copy of the binary
    [ "$(readlink "$f/exe" 2>/dev/null)" = "$W/bin/containerd-shim-runc-v2" ] && kill "${f#/proc/}"; done
  for p in proxy containerd; do [ -f "$W/$p.pid" ] && kill -9 "$(cat "$W/$p.pid")" 2>/dev/null; rm -f "$W/$p.pid"; done
  grep " $W/" /proc/mounts | awk '{print $2}' | sort -r | while read -r m; do umount -l "$m"; done
  return 0
}
step_cleanup() { down; }
step_summary() { python3 "$HELP/summary.py" "$W" "$OUT"; }

# ---------------------------------------------------------------- main
case "${1:-}" in
  --pack) pack "${2:-}"; exit $? ;;
  --step) export T0=$GPU_CHECK_T0; loadstate; "step_${2//-/_}"; exit $? ;;
  -h|--help) sed -n '2,/^set -uo/p' "$SELF" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
esac
[ "$(id -u)" = 0 ] || { echo "run as root (containerd, runc, mknod, mounts)"; exit 1; }
export T0=$(date +%s) GPU_CHECK_T0=$(date +%s)
mkdir -p "$OUT"; rm -f "$OUT"/{log.txt,summary.txt,specs.json,torch.jsonl,limits.json,daemons.txt,gpu-memory.json}
[ -f "$W/state.env" ] && timeout 60 bash "$SELF" --step cleanup > /dev/null 2>&1 # an earlier run's leftovers
rm -rf "$W"; mkdir -p "$W/res"; : > "$W/state.env"; : > "$W/steps.txt"
log "gpu-enforce-check: checkout $ROOT, work $W, out $OUT, budget ${BUDGET}s${FAKE:+, FAKE MODE (no GPU)}"
# Not there and cargo is: build them now, outside the budget (on a GPU machine, --pack them instead).
if ! find_in tessera-enforce "${BIN_DIRS[@]}" >/dev/null && command -v cargo >/dev/null; then
  log "building the release binaries in ${CARGO_TARGET_DIR:-/tmp/gpucheck-target}"
  (cd "$ROOT" && CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/tmp/gpucheck-target} cargo build --release --bins \
    -p tessera-runtime-proxy -p tessera-enforce) >> "$OUT/log.txt" 2>&1
  export T0=$(date +%s) GPU_CHECK_T0=$(date +%s)
fi
# torch's libraries into the page cache while the first steps run: a cold first import can
# take tens of seconds of a torch step's limit.
[ -z "$FAKE" ] && ( sp=$("${GPU_CHECK_PYTHON:-python3}" -c 'import importlib.util as u, os; s = u.find_spec("torch"); print(os.path.dirname(os.path.dirname(s.origin)) if s else "")' 2>/dev/null)
  [ -d "$sp/torch" ] && timeout 120 find "$sp/torch/lib" "$sp/nvidia" -name '*.so*' -type f -exec cat {} + ) > /dev/null 2>&1 &
step() { # NAME LIMIT [always]: in its own process under `timeout`; its failure is logged, the rest run
  local name=$1 limit=$2 left t rc
  case " ${GPU_CHECK_SKIP:-} " in *" $name "*) log "SKIP $name: GPU_CHECK_SKIP"; echo "$name skipped" >> "$W/steps.txt"; return;; esac
  left=$(( BUDGET - $(el) ))
  if [ "${3:-}" != always ]; then
    if (( left < 10 )); then log "SKIP $name: the ${BUDGET}s budget is spent"; echo "$name skipped" >> "$W/steps.txt"; return; fi
    (( limit > left )) && limit=$left
  fi
  log "=== $name (limit ${limit}s)"
  t=$(date +%s)
  timeout -k 5 "$limit" bash "$SELF" --step "$name" >> "$OUT/log.txt" 2>&1; rc=$?
  (( rc == 124 || rc == 137 )) && log "!!! $name: stopped at its ${limit}s limit"
  log "--- $name: rc=$rc, $(( $(date +%s) - t ))s"
  echo "$name rc=$rc $(( $(date +%s) - t ))s" >> "$W/steps.txt"
}
trap 'bash "$SELF" --step cleanup >> "$OUT/log.txt" 2>&1' EXIT
trap 'exit 130' INT TERM
step prepare 60
step facts 60
step build 120
step up 90
step pods 90
step limits 30
step mps-modes 20
step torch-base 100
step torch-a 100
step torch-b 160
step torch-c 100
step torch-two 120
step torch-kill 90
step cleanup 40 always
step summary 30 always
trap - EXIT
cat "$OUT/summary.txt" 2>/dev/null
log "gpu-enforce-check: done in $(el)s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
