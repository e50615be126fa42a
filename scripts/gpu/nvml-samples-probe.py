#!/usr/bin/env python3
"""nvml-samples-probe.py OUT.json [SECONDS]: what NVML's per-process utilization samples
(nvmlDeviceGetProcessUtilization) say while processes time-slice one GPU and one is stopped,
the input tessera-enforce's gpu-time charges (enforce/src/throttle.rs). Host processes, no
containers, GPU 0:

  t=0   P1 runs bf16 8192^3 matmuls alone     t=2  P1 is stopped (SIGSTOP, as a freeze)
  t=3   P1 continues (SIGCONT)                 t=4  P2 starts the same matmuls
  t=8   P1 is stopped again, P2 runs           t=10 P1 continues
  t=14  both end

NVML is read every 100 ms with the last timestamp seen (as the proxy does); every sample is
written with the read it came in, plus the events, so the spacing of samples per process,
whether processes sampled together share a timestamp, and what a stopped process gets can be
read off. PROBE_WORKLOAD replaces the matmul program (fake mode: `sleep 20`)."""
import ctypes, json, os, signal, subprocess, sys, threading, time

out, total = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 14.0
MATMUL = r'''
import time, torch
n = 8192
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16); b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
print("ready", flush=True)
t = time.time()
while time.time() - t < 30:
    for _ in range(5):
        a @ b
    torch.cuda.synchronize()
'''


class Sample(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("timeStamp", ctypes.c_ulonglong), ("smUtil", ctypes.c_uint),
                ("memUtil", ctypes.c_uint), ("encUtil", ctypes.c_uint), ("decUtil", ctypes.c_uint)]


lib = ctypes.CDLL(os.environ.get("NVML_LIB", "libnvidia-ml.so.1"))
assert lib.nvmlInit_v2() == 0, "nvmlInit"
dev = ctypes.c_void_p()
assert lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(dev)) == 0, "handle"


def read(since):
    count = ctypes.c_uint(0)
    rc = lib.nvmlDeviceGetProcessUtilization(dev, None, ctypes.byref(count), ctypes.c_ulonglong(since))
    if rc not in (0, 7):  # 7: NVML_ERROR_INSUFFICIENT_SIZE, the count is filled in
        return rc, []
    if count.value == 0:
        return rc, []
    buf = (Sample * count.value)()
    rc = lib.nvmlDeviceGetProcessUtilization(dev, buf, ctypes.byref(count), ctypes.c_ulonglong(since))
    # Unused slots come back with pid 0 (seen on driver 580): left out.
    return rc, [dict(pid=s.pid, ts=s.timeStamp, sm=s.smUtil, mem=s.memUtil) for s in buf[:count.value] if s.pid]


def start(wait):
    cmd = os.environ.get("PROBE_WORKLOAD")
    args = cmd.split() if cmd else [sys.executable, "-c", MATMUL]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def lines():  # its output as events (P2's "ready" arrives while NVML is read)
        for line in p.stdout:
            events.append(dict(t=round(time.time() - t0, 3), what="%d says %s" % (p.pid, line.strip()[:120])))
    threading.Thread(target=lines, daemon=True).start()
    while wait and not cmd and not any(("%d says ready" % p.pid) in e["what"] for e in events) and p.poll() is None:
        time.sleep(0.05)
    return p


events, reads = [], []
t0 = time.time()
p1 = start(True)  # its CUDA context and operands ready before the clock starts
t0 = time.time()
events.append(dict(t=0.0, what="P1 started", pid=p1.pid))
p2 = None
since = int(time.time() * 1e6)
plan = [(2, "stop P1"), (3, "continue P1"), (4, "start P2"), (8, "stop P1"), (10, "continue P1")]
while time.time() - t0 < total:
    el = time.time() - t0
    while plan and el >= plan[0][0]:
        _, what = plan.pop(0)
        if what == "start P2":
            p2 = start(False)
            events.append(dict(t=time.time() - t0, what="P2 started", pid=p2.pid))
        elif what == "stop P1":
            os.kill(p1.pid, signal.SIGSTOP)
            events.append(dict(t=time.time() - t0, what="P1 stopped"))
        else:
            os.kill(p1.pid, signal.SIGCONT)
            events.append(dict(t=time.time() - t0, what="P1 continued"))
    at = time.time()
    rc, samples = read(since)
    reads.append(dict(t=round(at - t0, 3), since=since, rc=rc, samples=samples))
    for s in samples:
        since = max(since, s["ts"])
    time.sleep(0.1)
for p in (p1, p2):
    if p:
        p.kill()
        p.wait()
json.dump(dict(t0_us=int(t0 * 1e6), events=events, reads=reads,
               pids=dict(P1=p1.pid, P2=p2.pid if p2 else None)), open(out, "w"), indent=None)
# A short account for the log: per process, samples, median spacing, sm% seen, by phase.
by = {}
for r in reads:
    for s in r["samples"]:
        by.setdefault(s["pid"], []).append(s)
for pid, ss in by.items():
    ts = sorted(s["ts"] for s in ss)
    gaps = sorted(b - a for a, b in zip(ts, ts[1:]))
    name = "P1" if pid == p1.pid else "P2" if p2 and pid == p2.pid else str(pid)
    print("%s pid %d: %d samples, spacing median %.0f ms (min %.0f, max %.0f), sm%% %s" % (
        name, pid, len(ss), gaps[len(gaps) // 2] / 1e3 if gaps else 0, gaps[0] / 1e3 if gaps else 0,
        gaps[-1] / 1e3 if gaps else 0, sorted(set(s["sm"] for s in ss))[:20]))
shared = {}
for r in reads:
    for s in r["samples"]:
        shared.setdefault(s["ts"], set()).add(s["pid"])
print("timestamps shared by two processes: %d of %d" % (sum(1 for v in shared.values() if len(v) > 1), len(shared)))
