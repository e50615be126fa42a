#!/usr/bin/env python3
"""cri.py DIR WORK UUID MINOR MOUNTS_FILE LD_LIBRARY_PATH: the crictl pod and container configs.

Pods (host network, so no CNI), each with one container "main" running /pause, the GPU's
grant in scheduling.koordinator.sh/device-allocated as tessera-scheduler writes it:
  whole  the whole GPU (no limiter: the baseline)
  t1     tenant 1: 25 % / 20 GiB      (checks a, and the holder of c)
  envi   25 % / 20 GiB                (check b: its first CUDA process runs under env -i)
  t2     tenant 2: 25 % / 20 GiB      (check c)
Every container mounts the host folders in MOUNTS_FILE read-only at the same paths (python,
torch, the driver's libraries) and WORK/res/ctr at /out, where torchcheck.py writes."""
import json, os, sys

d, work, uuid, minor, mounts_file, ld_path = sys.argv[1:7]
os.makedirs(d, exist_ok=True)
SHARE = {"koordinator.sh/gpu-core": 25, "koordinator.sh/gpu-memory-ratio": 25, "koordinator.sh/gpu-memory": "20Gi"}
WHOLE = {"koordinator.sh/gpu-core": 100, "koordinator.sh/gpu-memory-ratio": 100}
mounts = [{"container_path": p, "host_path": p, "readonly": True}
          for p in open(mounts_file).read().split() if p]
mounts.append({"container_path": "/out", "host_path": os.path.join(work, "res", "ctr")})


def grant(share):
    return json.dumps({"gpu": [{"minor": int(minor), "id": uuid, "resources": share,
                                "extension": {"containers": {"main": share}}}]}, separators=(",", ":"))


for name, share in (("whole", WHOLE), ("t1", SHARE), ("envi", SHARE), ("t2", SHARE)):
    logs = os.path.join(work, "logs", name)
    os.makedirs(logs, exist_ok=True)
    pod = {"metadata": {"name": "gpucheck-" + name, "namespace": "gpucheck", "uid": "gpucheck-%s-uid" % name,
                        "attempt": 0},
           "annotations": {"scheduling.koordinator.sh/device-allocated": grant(share)},
           "log_directory": logs, "linux": {"security_context": {"namespace_options": {"network": 2}}}}
    ctr = {"metadata": {"name": "main"}, "image": {"image": "localhost/gpucheck:1"}, "command": ["/pause"],
           "envs": [{"key": "LD_LIBRARY_PATH", "value": ld_path}],
           "mounts": mounts, "log_path": "main.log", "linux": {}}
    json.dump(pod, open(os.path.join(d, name + "-pod.json"), "w"), indent=1)
    json.dump(ctr, open(os.path.join(d, name + "-ctr.json"), "w"), indent=1)
print("cri.py: share grant %s" % grant(SHARE))
