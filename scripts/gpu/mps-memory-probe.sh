#!/usr/bin/env bash
# mps-memory-probe.sh OUTDIR: how NVML names an MPS client's GPU memory, which the proxy's
# usage report and OOM kill read (nvmlDeviceGetComputeRunningProcesses): under the client's
# pid, or the MPS server's? On the host, GPU 0: an MPS control daemon of its own (pipe and
# log folders under /tmp, the GPU's compute mode left as it is), one torch client holding
# 10 GiB, and what NVML's two process lists say meanwhile; then the daemon quits.
# Env: PY (a python with torch; default /opt/torch/.venv/bin/python3), NVML_LIB.
set -uo pipefail
out=${1:?OUTDIR}; mkdir -p "$out"
PY=${PY:-/opt/torch/.venv/bin/python3}
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-probe/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-probe/log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d || { echo "no MPS daemon"; exit 1; }
"$PY" - <<'EOF' > "$out/client.txt" 2>&1 &
import os, time, torch
x = torch.empty(10 << 30, dtype=torch.uint8, device="cuda"); torch.cuda.synchronize()
open("/tmp/mps-probe/ready", "w").write(str(os.getpid()))
time.sleep(8)
EOF
client=$!
for _ in $(seq 100); do [ -f /tmp/mps-probe/ready ] && break; sleep 0.2; done
NVML_LIB=${NVML_LIB:-libnvidia-ml.so.1} python3 - "$client" <<'EOF' | tee "$out/nvml.txt"
import ctypes, os, sys
class Info(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]
lib = ctypes.CDLL(os.environ["NVML_LIB"]); lib.nvmlInit_v2()
dev = ctypes.c_void_p(); lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(dev))
print("client (the shell's child) pid", sys.argv[1], "ready file pid", open("/tmp/mps-probe/ready").read())
for name in ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetMPSComputeRunningProcesses_v3"):
    n = ctypes.c_uint(64); buf = (Info * 64)()
    rc = getattr(lib, name)(dev, ctypes.byref(n), buf)
    rows = []
    for i in buf[:n.value]:
        try:
            comm = open("/proc/%d/comm" % i.pid).read().strip()
        except OSError:
            comm = "?"
        rows.append("pid %d (%s) %.2f GiB" % (i.pid, comm, i.usedGpuMemory / 2**30))
    print(name, "rc", rc, rows)
EOF
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv >> "$out/nvml.txt" 2>&1
wait "$client"
echo quit | nvidia-cuda-mps-control
sleep 1
cat "$out/client.txt"; tail -5 "$CUDA_MPS_LOG_DIRECTORY/control.log" 2>/dev/null
