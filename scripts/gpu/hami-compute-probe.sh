#!/usr/bin/env bash
# hami-compute-probe.sh: why HAMi-core's compute limit (CUDA_DEVICE_SM_LIMIT) does not
# hold on a GPU machine. On the host, no container: a bf16 matmul for 4 s with
# libvgpu.so preloaded at SM limit 25 and HAMi-core's debug log, while a second process
# asks NVML (pynvml) for per-process utilization, the samples HAMi-core's watcher needs.
# Usage: bash scripts/gpu/hami-compute-probe.sh LIBVGPU [PYTHON]   (OUT: where to write;
# MM_SECONDS, default 4: how long each matmul runs; MM_WINDOW: rate printed per window)
set -uo pipefail
LIB=$1; PY=${2:-python3}; OUT=${OUT:-/tmp/hami-compute-probe}; mkdir -p "$OUT"
R=$(mktemp -d)
cat > "$R/mm.py" <<'PY'
import time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
import os
secs, win = float(os.environ.get("MM_SECONDS", "4")), float(os.environ.get("MM_WINDOW", "4"))
torch.cuda.synchronize(); n, t0 = 0, time.time(); w0, wn, rates = t0, 0, []
while time.time() - t0 < secs:
    a @ b; n += 1; wn += 1
    if n % 20 == 0:
        torch.cuda.synchronize(); now = time.time()
        if now - w0 >= win: rates.append(round(2 * 8192**3 * wn / (now - w0) / 1e12)); w0, wn = now, 0
torch.cuda.synchronize(); dt = time.time() - t0
print("TFLOPS %.1f windows %s" % (2 * 8192**3 * n / dt / 1e12, rates), flush=True)
PY
cat > "$R/util.py" <<'PY'
import sys, time, pynvml
pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0)
for i in range(6):
    time.sleep(0.5)
    for name, f in (("procs", lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(h)),
                    ("proc-util", lambda: pynvml.nvmlDeviceGetProcessUtilization(h, int((time.time() - 1) * 1e6))),
                    ("util", lambda: pynvml.nvmlDeviceGetUtilizationRates(h))):
        try: v = f(); print(i, name, "ok", str(v)[:300], flush=True)
        except Exception as e: print(i, name, "ERR", repr(e), flush=True)
PY
"$PY" "$R/mm.py" > "$OUT/plain.txt" 2>&1
( sleep 1.5; "$PY" "$R/util.py" > "$OUT/nvml-util.txt" 2>&1 ) &
env LD_PRELOAD="$LIB" CUDA_DEVICE_SM_LIMIT=25 CUDA_DEVICE_MEMORY_LIMIT_0=20g LIBCUDA_LOG_LEVEL=4 \
  CUDA_DEVICE_MEMORY_SHARED_CACHE="$R/region" "$PY" "$R/mm.py" > "$OUT/limited.txt" 2>&1
wait
echo "plain: $(grep TFLOPS "$OUT/plain.txt")  limited (SM 25): $(grep TFLOPS "$OUT/limited.txt")"
grep -a -E "SET_TASK_PID|host pid|hostpid|pidfound|core utilization limit|util_switch|userutil|utilization|set_task_pid" "$OUT/limited.txt" |
  sed 's/([0-9:]*//' | cut -c1-220 | sort | uniq -c | sort -rn | head -25
cat "$OUT/nvml-util.txt" | head -20
rm -rf "$R"
