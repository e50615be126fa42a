#!/usr/bin/env python3
"""torchcheck.py LABEL MODE [SECONDS]: what a process in a container gets of the GPU.

MODE full: 10 GiB then 30 GiB, then bf16 8192^3 matmuls for SECONDS (default 5);
     alloc: the two allocations only; hold: holds 10 GiB until /out/LABEL.release exists
     (at most SECONDS after the start); fill: 1 GiB blocks, then 64 MiB ones, until an
     allocation fails, then holds them like hold; over: up to 30 GiB in 1 GiB blocks, saving
     after each (a process killed part-way leaves how far it got), then holds them.
TORCHCHECK_OUT names another folder than /out (a process run on the host).
Before torch it records what needs no GPU: its env (how many variables, the limiter's),
/etc/ld.so.preload and whether libvgpu.so is mapped into it. Each phase rewrites
/out/LABEL.json (a host folder) and prints it as one line "TORCHCHECK {json}"."""
import json, os, sys, time

label, mode = sys.argv[1], sys.argv[2]
OUTDIR = os.environ.get("TORCHCHECK_OUT", "/out")
secs = float(sys.argv[3]) if len(sys.argv) > 3 else 5.0
t0 = time.time()
r = {"label": label, "mode": mode, "pid": os.getpid(), "envKeys": sorted(os.environ),
     "env": {k: v for k, v in os.environ.items() if k.startswith(("TESSERA_", "CUDA_", "LD_", "NVIDIA_"))}}
try:
    r["preloadList"] = open("/etc/ld.so.preload").read().strip()
except OSError:
    r["preloadList"] = None
r["libvgpuMapped"] = "libvgpu" in open("/proc/self/maps").read()


def save(phase):
    r["phase"], r["t"] = phase, round(time.time() - t0, 2)
    text = json.dumps(r)
    try:
        with open("%s/%s.json.tmp" % (OUTDIR, label), "w") as f:
            f.write(text)
        os.replace("%s/%s.json.tmp" % (OUTDIR, label), "%s/%s.json" % (OUTDIR, label))
    except OSError as e:
        r["outError"] = str(e)
    print("TORCHCHECK " + text, flush=True)


def alloc(gib):
    try:
        x = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        r["at%d" % gib] = time.time()
        return x, "ok"
    except Exception as e:  # noqa: BLE001 (torch.cuda.OutOfMemoryError, or HAMi-core's own)
        torch.cuda.empty_cache()
        return None, "%s: %s" % (type(e).__name__, str(e).splitlines()[0][:160] if str(e) else "")


save("start")
try:
    import torch
    r["torch"], r["torchCuda"] = torch.__version__, torch.version.cuda
    if not torch.cuda.is_available():
        raise RuntimeError("no GPU: torch.cuda.is_available() is False (device count %d)" % torch.cuda.device_count())
    r["device"] = torch.cuda.get_device_name(0)
    free, total = torch.cuda.mem_get_info(0)
    r["memGetInfo"] = {"free": free, "total": total}
    if mode in ("fill", "over"):
        blocks, r["blocks"], step, top = [], [], 1 << 30, (30 << 30 if mode == "over" else 1 << 40)
        r["held"] = 0
        while r["held"] < top:
            try:
                blocks.append(torch.empty(step, dtype=torch.uint8, device="cuda"))
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                torch.cuda.empty_cache()
                r["stoppedBy"] = "%s: %s" % (type(e).__name__, str(e).splitlines()[0][:160] if str(e) else "")
                if step > 64 << 20 and mode == "fill":
                    step = 64 << 20
                    continue
                break
            r["held"] += step
            if mode == "over":
                r["blocks"].append([r["held"] >> 30, round(time.time(), 3)])
                save("allocating")
        r["alloc10"] = "ok" if r["held"] >= 10 << 30 else "held %d bytes" % r["held"]
        save("holding")
        while time.time() - t0 < secs and not os.path.exists("%s/%s.release" % (OUTDIR, label)):
            time.sleep(0.2)
        r["releasedAt"] = time.time()
        del blocks
    elif mode == "hold":
        x, r["alloc10"] = alloc(10)
        save("holding")
        while time.time() - t0 < secs and not os.path.exists("%s/%s.release" % (OUTDIR, label)):
            time.sleep(0.2)  # held until the script says the other tenant is done, or SECONDS
        r["releasedAt"] = time.time()
        del x
    else:
        for gib in (10, 30):
            x, r["alloc%d" % gib] = alloc(gib)
            del x
            torch.cuda.empty_cache()
        save("allocated")
        if mode == "full":
            n = 8192
            a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
            for _ in range(3):
                a @ b
            torch.cuda.synchronize()
            it, t = 0, time.time()
            # TFLOP/s per 2 s window too: a share held over time shows in each.
            windows, wit, wt = [], 0, t
            while time.time() - t < secs:
                for _ in range(5):
                    a @ b
                torch.cuda.synchronize()
                it += 5
                wit += 5
                if time.time() - wt >= 2:
                    windows.append(round(2 * n ** 3 * wit / (time.time() - wt) / 1e12))
                    wit, wt = 0, time.time()
            el = time.time() - t
            r.update(matmuls=it, seconds=round(el, 3), tflops=round(2 * n ** 3 * it / el / 1e12, 1),
                     windows=windows)
except Exception as e:  # noqa: BLE001
    r["error"] = "%s: %s" % (type(e).__name__, str(e)[:300])
save("done")
