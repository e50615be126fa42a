#!/usr/bin/env python3
"""summary.py WORK OUT: reads what gpu-enforce-check.sh left in WORK, writes OUT/summary.txt
(printed too), OUT/specs.json, OUT/torch.jsonl, OUT/limits.json and OUT/daemons.txt."""
import json, os, re, shlex, sys, time

W, OUT = sys.argv[1], sys.argv[2]
R = os.path.join(W, "res")
GIB = 1 << 30
SHARE = 20 * GIB
MAX = (1 << 64) - 1


def rd(path, limit=None):
    try:
        t = open(path if os.path.isabs(path) else os.path.join(R, path), errors="replace").read()
    except OSError:
        return ""
    return t if not limit or len(t) <= limit else "[... %d bytes cut ...]\n%s" % (len(t) - limit, t[-limit:])


def why(text):
    """The runtime's own words from a crictl error (its last `desc = ...`), else the text's end."""
    m = re.findall(r'desc = (.*?)"?\s*$', text, re.M)
    return (m[-1] if m else text.strip()[-300:]).replace('\\"', '"')[:300]


def rj(path):
    try:
        return json.loads(rd(path))
    except ValueError:
        return None


S = {}
for line in rd(os.path.join(W, "state.env")).splitlines():
    k, _, v = line.partition("=")
    try:
        S[k] = (shlex.split(v) or [""])[0]
    except ValueError:
        S[k] = v
fake = bool(os.environ.get("FAKE"))
uuid, minor = S.get("GPU_UUID", ""), S.get("GPU_MINOR", "")
backends = S.get("BACKENDS", "")
driver_on, hami_on = "driver-memory" in backends, "hami-core" in backends
mps_on = "mps" in backends.split("+")
L = []


def out(tag, text):
    L.append("%-5s %s" % (tag, text))


L.append("Tessera enforced shares through its own injection%s: %s" % (
    " (FAKE MODE: fake NVML, mknod'ed nodes, no GPU)" if fake else "", time.strftime("%Y-%m-%d %H:%M:%S %Z")))
out("INFO", "GPU %s (UUID %s, minor %s)" % (S.get("GPU_DESC", "?"), uuid, minor))
proxy_log = re.sub(r"\x1b\[[0-9;]*m", "", rd("proxy.log"))
why_off = re.search(r"GPU memory limits off[^\n]*", proxy_log)
out("INFO" if backends else "FAIL", "tessera-runtime-proxy: share enforcement backends=%s%s" % (
    backends or "? (no such line in its log)", "" if driver_on or not why_off else "; " + why_off.group(0)[:220]))
out("INFO", "HAMi-core: %s" % S.get("HAMI_FROM", "?"))
out("INFO", "MPS: %s" % S.get("MPS", "?"))
py = rj("python.json") or {}
out("INFO", "python %s %s, torch %s; mounted into the containers: %s" % (
    py.get("executable"), py.get("version"), py.get("torch") or py.get("torchError"), " ".join(py.get("mounts", []))))

# d: each container's OCI spec, as containerd received it through the proxy
specs, mounts_of = {}, {}
for p in ("whole", "t1", "envi", "t2"):
    insp = rj("inspect-%s.json" % p)
    err = (rd("runp-%s.err" % p) + rd("create-%s.err" % p) + rd("start-%s.err" % p)).strip()
    if not insp:
        out("FAIL", "%s: no container: %s" % (p, why(err) if err else "not run"))
        continue
    st, spec = insp.get("status") or {}, (insp.get("info") or {}).get("runtimeSpec") or {}
    env = dict(kv.split("=", 1) for kv in (spec.get("process") or {}).get("env", []) if "=" in kv)
    lin = spec.get("linux") or {}
    mounts = {m.get("destination"): m for m in spec.get("mounts", [])}
    mounts_of[p] = mounts
    hooks = [h for h in ((spec.get("hooks") or {}).get("createRuntime") or []) if "tessera-enforce" in h.get("path", "")]
    ann = (st.get("annotations") or {}).get("tessera.io/enforcement")
    specs[p] = {"state": st.get("state"), "createError": err or None, "annotations": st.get("annotations"),
                "env": (spec.get("process") or {}).get("env"), "linux.devices": lin.get("devices"),
                "hooks": spec.get("hooks"), "mounts": spec.get("mounts")}
    running = st.get("state") == "CONTAINER_RUNNING"
    te = env.get("TESSERA_ENFORCEMENT")
    probs = [] if running else ["state %s: %s" % (st.get("state"), err[-200:])]
    if p == "whole":
        if env.get("NVIDIA_VISIBLE_DEVICES") != uuid:
            probs.append("NVIDIA_VISIBLE_DEVICES=%s" % env.get("NVIDIA_VISIBLE_DEVICES"))
        if hooks:
            probs.append("a tessera-enforce hook")
        if "/etc/ld.so.preload" in mounts:
            probs.append("/etc/ld.so.preload mounted")
        probs += ["%s=%s" % (k, v) for k, v in env.items() if k.startswith("CUDA_DEVICE_")]
        out("FAIL" if probs else "PASS", "d whole-GPU container: the GPU, no limiter (no hook, no preload, no CUDA_DEVICE_* env); "
            "TESSERA_ENFORCEMENT=%s, annotation %s%s" % (te, ann, " -- " + "; ".join(probs) if probs else ""))
        continue
    if te != backends or ann != backends:
        probs.append("TESSERA_ENFORCEMENT=%s, annotation %s, the proxy's backends %s" % (te, ann, backends))
    if env.get("NVIDIA_VISIBLE_DEVICES") != uuid:
        probs.append("NVIDIA_VISIBLE_DEVICES=%s" % env.get("NVIDIA_VISIBLE_DEVICES"))
    nodes = sorted(d.get("path", "") for d in lin.get("devices") or [] if "nvidia" in d.get("path", ""))
    if not any(n.endswith("/nvidia%s" % minor) for n in nodes):
        probs.append("no /dev/nvidia%s in linux.devices %s" % (minor, nodes))
    if (env.get("CUDA_DEVICE_MEMORY_LIMIT_0"), env.get("CUDA_DEVICE_SM_LIMIT")) != ("20480m", "25"):
        probs.append("limiter env %s/%s" % (env.get("CUDA_DEVICE_MEMORY_LIMIT_0"), env.get("CUDA_DEVICE_SM_LIMIT")))
    if hami_on:
        for dst, ro in (("/usr/local/vgpu/libvgpu.so", True), ("/etc/ld.so.preload", True), ("/tmp/cudevshr.cache", False),
                        ("/tmp/vgpulock", False)):
            m = mounts.get(dst)
            if not m or ro != ("ro" in (m.get("options") or [])):
                probs.append("mount %s %s" % (dst, m.get("options") if m else "missing"))
    if mps_on:
        m = mounts.get("/run/nvidia-mps")
        if not m or "ro" not in (m.get("options") or []) or "/gpu_%s/" % minor not in m.get("source", ""):
            probs.append("MPS pipe mount %s" % m)
        mps_env = (env.get("CUDA_MPS_PIPE_DIRECTORY"), env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
                   env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"))
        if mps_env != ("/run/nvidia-mps", "25", "0=20480M"):
            probs.append("MPS env %s" % (mps_env,))
    want = "--limit=%s=%d" % (uuid, SHARE)
    if driver_on and not any(want in h.get("args", []) for h in hooks):
        probs.append("no createRuntime hook tessera-enforce %s: %s" % (want, hooks))
    if not driver_on and hooks:
        probs.append("a tessera-enforce hook although driver-memory is off")
    out("FAIL" if probs else "PASS", "d %s: running, TESSERA_ENFORCEMENT=%s (annotation %s), NVIDIA_VISIBLE_DEVICES=%s, "
        "limiter env %s/%s, %s, %s%s%s" % (
            p, te, ann, env.get("NVIDIA_VISIBLE_DEVICES"), env.get("CUDA_DEVICE_MEMORY_LIMIT_0"),
            env.get("CUDA_DEVICE_SM_LIMIT"), "HAMi-core mounts ok" if hami_on else "no HAMi-core",
            "tessera-enforce hook %s" % want if driver_on else "no hook (driver-memory off)",
            ", MPS namespace mount and env ok" if mps_on else "",
            " -- " + "; ".join(probs) if probs else ""))
if hami_on and "t1" in mounts_of and "t2" in mounts_of:
    a, b = (mounts_of[p].get("/tmp/cudevshr.cache", {}).get("source") for p in ("t1", "t2"))
    out("PASS" if a and b and a != b else "FAIL", "d tenants' HAMi-core regions are their own: %s vs %s" % (a, b))
after = rd("after-rmp.txt").strip()
if after:
    left = [l for l in after.splitlines() if l.startswith("left:") and l.strip() != "left:"]
    out("FAIL" if left else "PASS", "pods removed through the proxy: %s" % (
        "; ".join(left) if left else "no CDI spec file and no HAMi-core container folder left"))
if mps_on:
    shared = rd("compute-mode-shared.txt").strip()
    held = [l for l in shared.splitlines() if uuid in l]
    ok = any("Exclusive_Process" in l or '"mode":3' in l.replace(" ", "") for l in held)
    out("PASS" if ok else "FAIL", "m GPU %s exclusive-process while shared through MPS: %s" % (uuid, "; ".join(held) or shared or "nothing read"))
    modes = rd("compute-mode-after.txt").strip()
    if modes:
        out("PASS" if "Exclusive" not in modes else "FAIL", "m compute modes after the MPS supervisor stopped: %s" % modes.replace("\n", "; "))
json.dump(specs, open(os.path.join(OUT, "specs.json"), "w"), indent=1)

# e: the driver's limit on each container's cgroup
lim = rj("limits.json") or {}
json.dump({"nvml": lim, "fakeSetCalls": [json.loads(l) for l in rd("memory-limits.jsonl").splitlines() if l.strip()]},
          open(os.path.join(OUT, "limits.json"), "w"), indent=1)
cg = {p: c.get("cgroup") for p, c in (lim.get("containers") or {}).items()}
if not driver_on:
    out("INFO", "e driver-memory off: no limit to read (nvmlDeviceGetMemoryLimits_v1 %s in %s)" % (
        "present" if lim.get("symbol") else "absent", S.get("NVML_LIB")))
elif fake:  # the fake keeps limits per process: the hook's own calls, from its log, are the proof
    calls = [json.loads(l) for l in rd("memory-limits.jsonl").splitlines() if l.strip()]
    for p in ("t1", "envi", "t2", "whole"):
        on = [c for c in calls if cg.get(p) and c.get("nameSpace") == cg[p]]
        ok = (not on) if p == "whole" else (len(on) == 1 and on[0].get("hardLimit") == SHARE
                                             and on[0].get("softLimit") == SHARE and on[0].get("result") == 0
                                             and on[0].get("uuid") == uuid)
        out("PASS" if ok else "FAIL", "e %s: the hook's nvmlDeviceSetMemoryLimits_v1 calls on its cgroup %s: %s" % (
            p, cg.get(p), [(c.get("uuid"), c.get("softLimit"), c.get("hardLimit"), c.get("result")) for c in on] or "none"))
    out("INFO", "e nvmlDeviceGetMemoryLimits_v1 from another process: hard %s (the fake keeps limits per process)" % (
        sorted({c.get("hard") for c in (lim.get("containers") or {}).values()})))
else:
    for p in ("t1", "envi", "t2", "whole"):
        c = (lim.get("containers") or {}).get(p) or {}
        ok = c.get("rc") == 0 and c.get("hard") == SHARE
        out("INFO" if p == "whole" else "PASS" if ok else "FAIL", "e %s: nvmlDeviceGetMemoryLimits_v1 on %s: rc %s, soft %s, hard %s, used %s%s" % (
            p, c.get("cgroup"), c.get("rc"), c.get("soft"), c.get("hard"), c.get("used"), c.get("error", "")))

# a, b, c: what processes in the containers got
T = {}
with open(os.path.join(OUT, "torch.jsonl"), "w") as f:
    for lab in ("base", "a", "b", "b-join", "c-hold", "c", "f1", "f2", "g1", "g2", "k1", "k2", "k3"):
        r = rj(os.path.join(R, "ctr", lab + ".json"))
        if r is not None:
            r["execTail"] = rd("exec-%s.txt" % lab)[-400:]
            T[lab] = r
            f.write(json.dumps(r) + "\n")


def gpu_part(lab, what):
    """None when the run reached the GPU; else writes its INFO (fake) / FAIL line and returns False."""
    r = T.get(lab)
    if r and "alloc10" in r:
        return None
    text = (r or {}).get("error") or ("no result: " + why(rd("exec-%s.txt" % lab)) if r is None else "?")
    out("INFO" if fake else "FAIL", "%s: %s" % (what, "no GPU (fake mode): " + text if fake else text))
    return False


def short(v):
    return "ok" if v == "ok" else str(v).split(":")[0]


base = T.get("base") or {}
rate = base.get("tflops")
for lab, what in (("base", "whole-GPU container (baseline)"), ("a", "a shared container, its env"),
                  ("b", "b fresh shared container, `env -i` first"), ("b-join", "b' `env -i` in the shared container after (a)")):
    r = T.get(lab) or {}
    if hami_on and lab in T:
        want = lab != "base"
        keys = r.get("envKeys", [])
        out("PASS" if r.get("libvgpuMapped") == want else "FAIL", "%s: libvgpu.so %smapped (env: %s; "
            "TESSERA_ENFORCEMENT=%s, ld.so.preload %r)" % (what, "" if r.get("libvgpuMapped") else "not ",
                                                           " ".join(keys) if len(keys) < 4 else "%d variables" % len(keys),
                                                           r.get("env", {}).get("TESSERA_ENFORCEMENT"), r.get("preloadList")))
    if gpu_part(lab, what) is False:
        continue
    mem = "10 GiB %s, 30 GiB %s (memGetInfo total %.1f GiB)" % (
        short(r.get("alloc10")), short(r.get("alloc30")), (r.get("memGetInfo") or {}).get("total", 0) / GIB)
    if lab == "base":
        out("INFO" if r.get("alloc30") == "ok" else "FAIL", "%s: %s; %s TFLOP/s" % (what, mem, rate))
        continue
    held = r.get("alloc10") == "ok" and r.get("alloc30") not in (None, "ok")
    note = ""
    if lab in ("b", "b-join") and not held and not driver_on:
        note = (" (HAMi-core alone: the first process to create the container's region "
                "/tmp/cudevshr.cache sets its limits, and one started with env -i has none: "
                "docs/enforcement.md, 'What HAMi-core still leaves open')")
    out(("PASS" if held else "FAIL") if lab != "b-join" else "INFO", "%s: %s%s" % (what, mem, note))
    if lab in ("a", "b"):
        ratio = r["tflops"] / rate if r.get("tflops") and rate else None
        out("PASS" if ratio is not None and ratio <= 0.35 else "FAIL", "%s: bf16 matmul %s TFLOP/s = %s of the baseline's "
            "(<= 0.35 wanted, CUDA_DEVICE_SM_LIMIT=%s)" % (what, r.get("tflops"), "%.2f" % ratio if ratio else "?",
                                                          r.get("env", {}).get("CUDA_DEVICE_SM_LIMIT")))
        if r.get("windows"):
            out("INFO", "%s: TFLOP/s per 2 s window: %s" % (what, " ".join(str(w) for w in r["windows"])))
for pair, what in ((("f1", "f2"), "f two tenants at once, 25 % each"),
                   (("g1", "g2"), "g two processes at once in one 25 % container")):
    rs = [T.get(x) or {} for x in pair]
    if not any(rs) or not rate:
        continue
    rates = [x.get("tflops") or 0 for x in rs]
    total = sum(rates) / rate
    each = ", ".join("%s %s TFLOP/s (%.2f)" % (x, t, t / rate) for x, t in zip(pair, rates))
    if pair[0] == "f1":
        ok = all(0 < t / rate <= 0.35 for t in rates)
    else:
        ok = 0 < total <= 0.35
    out("PASS" if ok else "FAIL", "%s: %s; together %.2f of the baseline (<= 0.35 wanted %s)" % (
        what, each, total, "each" if pair[0] == "f1" else "together"))
    for x, r in zip(pair, rs):
        if r.get("windows"):
            out("INFO", "%s %s: TFLOP/s per 2 s window: %s" % (what.split()[0], x, " ".join(str(w) for w in r["windows"])))
        if r.get("error"):
            out("INFO", "%s %s: %s" % (what.split()[0], x, r["error"][:200]))
if "gpu-time" in backends.split("+"):
    held = re.findall(r"held to its share of GPU time[^\n]*", proxy_log)
    freezes = len(re.findall(r"GPU-time share[^\n]*frozen=true", proxy_log))
    thaws = len(re.findall(r"GPU-time share[^\n]*frozen=false", proxy_log))
    out("INFO", "gpu-time: %d container(s) held; their cgroups frozen %d times, thawed %d times (proxy log)%s" % (
        len(held), freezes, thaws, "; " + held[0][:200] if held else ""))
h, c = T.get("c-hold") or {}, T.get("c") or {}
if gpu_part("c", "c tenant 2 while tenant 1 holds 10 GiB") is None:
    during = h.get("at10") and c.get("at10") and h["at10"] <= c["at10"] <= h.get("releasedAt", float("inf"))
    ok = h.get("alloc10") == "ok" and c.get("alloc10") == "ok" and during
    out("PASS" if ok else "FAIL", "c tenant 2's own 10 GiB %s while tenant 1 holds 10 GiB (tenant 1's %s, %s); "
        "its 30 GiB %s" % (short(c.get("alloc10")), short(h.get("alloc10")),
                           "held throughout" if during else "NOT held at that moment", short(c.get("alloc30"))))
# k: the OOM kill. Its margin is the proxy's default unless its command line names one.
margin = 1 << 30
mm = re.search(r"--oom-kill-margin[= ](\d+)", rd("proxy.cmd"))
if mm:
    margin = int(mm.group(1))
kill_on = "oom-kill" in backends.split("+")


def report(name):
    try:
        return json.load(open(os.path.join(R, name)))
    except (OSError, ValueError):
        return {}


# The proxy's report at each moment the steps copied it, in one file.
with open(os.path.join(OUT, "gpu-memory.json"), "w") as f:
    json.dump({k: report("gpu-memory-%s.json" % k) or rd("gpu-memory-%s.json" % k)[:2000] or None
               for k in ("c", "k1", "k3")}, f, indent=1)


def entry(rep, pod):
    return next((c for c in rep.get("containers", []) if c.get("pod") == pod), None)


def kills(rep, pod):
    return [k for k in rep.get("kills", []) if k.get("pod") == pod]


if "k1" in T or "k3" in T or rd("exec-k1.txt"):
    if not kill_on:
        out("INFO", "k oom-kill is not among the node's backends (%s): the OOM kill was not checked" % backends)
    k1, rep1 = T.get("k1") or {}, report("gpu-memory-k1.json")
    e1 = entry(rep1, "gpucheck-t1")
    if gpu_part("k1", "k1 t1 filled to its limit") is None or (fake and e1):
        grant = ((e1 or {}).get("grant") or {}).get("share") if isinstance((e1 or {}).get("grant"), dict) else None
        used = (e1 or {}).get("used")
        over = (used - grant) if used is not None and grant else None
        alive = k1.get("phase") == "done" and not kills(rep1, "gpucheck-t1")
        out("PASS" if alive and kill_on else ("INFO" if not kill_on else "FAIL"),
            "k1 t1 filled its share (%s): torch held %.2f GiB; the driver counted %s against its %s grant (%s); %s" % (
                short(k1.get("stoppedBy", "?")), k1.get("held", 0) / GIB,
                "%.2f GiB" % (used / GIB) if used is not None else "nothing",
                "%.1f GiB" % (grant / GIB) if grant else "no",
                "%+d MiB over it, margin %d MiB" % (over >> 20, margin >> 20) if over is not None else "?",
                "not killed" if alive else "KILLED or not done (phase %s, kills %s)" % (k1.get("phase"), kills(rep1, "gpucheck-t1"))))
    k2 = T.get("k2") or {}
    k2rc = rd("k2-rc").strip()
    if not k2:
        out("INFO", "k2 a tenant's user namespace over /etc/ld.so.preload: it did not run (rc %s): %s" % (
            k2rc, why(rd("exec-k2.txt"))[:240]))
    else:
        bypassed = not k2.get("libvgpuMapped")
        reached = k2.get("held", 0) / GIB
        killed = k2rc == "137" or (k2.get("phase") != "done" and k2rc not in ("0", ""))
        bad = bypassed and reached > 21 and not killed
        out("FAIL" if bad else ("PASS" if bypassed and killed else "INFO"),
            "k2 a tenant's user namespace over /etc/ld.so.preload: libvgpu.so %s; it reached %.0f GiB (%s); %s (rc %s)" % (
                "NOT mapped (HAMi-core bypassed)" if bypassed else "still mapped", reached,
                short(k2.get("stoppedBy", "no failure")), "killed" if killed else "not killed", k2rc))
    k3, rep3 = T.get("k3") or {}, report("gpu-memory-k3.json")
    k3rc = rd("k3-rc").strip()
    if k3 or k3rc:
        blocks = k3.get("blocks") or []
        allowance = (20 << 30) + margin
        past = next((t for g, t in blocks if (g << 30) > allowance), None)
        try:
            ended = float(rd("k3-ended").strip())
        except ValueError:
            ended = None
        told = kills(rep3, "gpucheck-t2")
        took = "%.2f s after it passed %.0f GiB" % (ended - past, allowance / GIB) if past and ended else "?"
        ok = k3rc == "137" and bool(told)
        out("PASS" if ok else ("INFO" if fake or not kill_on else "FAIL"),
            "k3 a process without HAMi-core in t2's cgroup: reached %d GiB; %s (rc %s), %s; the proxy's record: %s" % (
                blocks[-1][0] if blocks else 0, "killed" if k3rc == "137" else "NOT killed", k3rc, took,
                json.dumps(told[-1]) if told else "none"))
st = rd(os.path.join(W, "steps.txt"))
bad = [l for l in st.splitlines() if " rc=0 " not in l + " "]
L.append("steps: %d, not clean: %s" % (len(st.splitlines()), "; ".join(bad) if bad else "none"))
L.append("files: summary.txt log.txt specs.json torch.jsonl limits.json daemons.txt gpu-memory.json")
text = "\n".join(L) + "\n"
open(os.path.join(OUT, "summary.txt"), "w").write(text)
print(text)
with open(os.path.join(OUT, "daemons.txt"), "w") as f:
    for title, name, limit in (("proxy", "proxy.cmd", None), ("proxy log", "proxy.log", 3000000),
                               ("containerd log", "containerd.log", 3000000), ("HAMi-core build", "hami-build.log", 200000),
                               ("CDI spec files and HAMi-core folders after RemovePodSandbox", "after-rmp.txt", None),
                               ("nvidia-smi -q -d MEMORY", "nvidia-smi-memory.txt", 100000),
                               ("nvidia-cuda-mps-control -p 3 -h (MPS v3?)", "mps-v3-help.txt", 20000),
                               ("MPS supervisor log", "mps.log", 1000000),
                               ("compute modes while shared", "compute-mode-shared.txt", 20000),
                               ("compute modes after", "compute-mode-after.txt", 20000)):
        body = rd(name, limit)
        if body:
            f.write("===== %s\n%s\n" % (title, body.rstrip("\n")))
    for lab in ("base", "a", "b", "b-join", "c-hold", "c", "f1", "f2", "g1", "g2", "k1", "k2", "k3"):
        body = rd("exec-%s.txt" % lab, 20000)
        if body:
            f.write("===== exec %s\n%s\n" % (lab, body.rstrip("\n")))
