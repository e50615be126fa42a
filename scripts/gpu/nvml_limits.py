#!/usr/bin/env python3
"""nvml_limits.py NVML_LIB UUID NAME=CGROUP_DIR ...: the driver's per-cgroup GPU memory limits
(NVML r615's nvmlDeviceGetMemoryLimits_v1, called through ctypes with the struct NVML's header
declares: {const char *nameSpace; unsigned long long softLimit, hardLimit, currentUsed;}),
read from outside the containers, as one JSON object on stdout."""
import ctypes, json, sys


class Limits(ctypes.Structure):
    _fields_ = [("nameSpace", ctypes.c_char_p), ("softLimit", ctypes.c_ulonglong),
                ("hardLimit", ctypes.c_ulonglong), ("currentUsed", ctypes.c_ulonglong)]


lib_path, uuid, targets = sys.argv[1], sys.argv[2], sys.argv[3:]
res = {"library": lib_path, "uuid": uuid, "containers": {}}
try:
    lib = ctypes.CDLL(lib_path)
    res["init"] = lib.nvmlInit_v2()
    dev = ctypes.c_void_p()
    res["handle"] = lib.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(dev))
    get = getattr(lib, "nvmlDeviceGetMemoryLimits_v1", None)
    res["symbol"] = get is not None
    for t in targets:
        name, _, cg = t.partition("=")
        if get is None:
            res["containers"][name] = {"cgroup": cg, "error": "no nvmlDeviceGetMemoryLimits_v1 (driver before r615)"}
            continue
        lim = Limits(cg.encode(), 0, 0, 0)
        rc = get(dev, ctypes.byref(lim))
        res["containers"][name] = {"cgroup": cg, "rc": rc, "soft": lim.softLimit, "hard": lim.hardLimit,
                                   "used": lim.currentUsed}
    lib.nvmlShutdown()
except OSError as e:
    res["error"] = str(e)
print(json.dumps(res))
