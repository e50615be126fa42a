#!/usr/bin/env python3
"""mkimg.py OUT.tar NAME ENTRYPOINT [ENV=VAL ...] -- ENTRY ...

A one-layer OCI image archive for `ctr images import`. ENTRY is one of
  f:SRC:DST        the file SRC at DST (its mode kept)
  d:DST[:MODE]     a directory (octal MODE, default 755)
  l:DST:TARGET     a symbolic link
The layer is written to a temporary file beside OUT, not held in memory."""
import hashlib, io, json, os, sys, tarfile

out, name, entrypoint, rest = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
sep = rest.index("--")
envs, entries = rest[:sep], rest[sep + 1:]


def sha(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


layer_path = out + ".layer"
with tarfile.open(layer_path, "w") as t:
    for e in entries:
        kind, _, spec = e.partition(":")
        if kind == "f":
            src, dst = spec.split(":")
            ti = t.gettarinfo(os.path.realpath(src), arcname=dst.lstrip("/"))
            ti.uid = ti.gid = 0
            ti.uname = ti.gname = "root"
            with open(src, "rb") as fh:
                t.addfile(ti, fh)
        elif kind == "d":
            dst, _, mode = spec.partition(":")
            ti = tarfile.TarInfo(dst.lstrip("/"))
            ti.type, ti.mode = tarfile.DIRTYPE, int(mode or "755", 8)
            t.addfile(ti)
        elif kind == "l":
            dst, target = spec.split(":")
            ti = tarfile.TarInfo(dst.lstrip("/"))
            ti.type, ti.linkname = tarfile.SYMTYPE, target
            t.addfile(ti)
        else:
            sys.exit("mkimg.py: bad entry %r" % e)
h = hashlib.sha256()
with open(layer_path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
layer_digest, layer_size = "sha256:" + h.hexdigest(), os.path.getsize(layer_path)
cfg = json.dumps({"architecture": "amd64", "os": "linux",
                  "config": {"Entrypoint": [entrypoint], "Env": envs},
                  "rootfs": {"type": "layers", "diff_ids": [layer_digest]}}).encode()
man = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                  "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": sha(cfg), "size": len(cfg)},
                  "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest,
                              "size": layer_size}]}).encode()
idx = json.dumps({"schemaVersion": 2, "manifests": [{
    "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": sha(man), "size": len(man),
    "annotations": {"org.opencontainers.image.ref.name": name, "io.containerd.image.name": name}}]}).encode()
with tarfile.open(out, "w") as t:
    def add(n, d):
        ti = tarfile.TarInfo(n)
        ti.size = len(d)
        t.addfile(ti, io.BytesIO(d))
    add("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
    add("index.json", idx)
    t.add(layer_path, "blobs/sha256/" + layer_digest[7:])
    for d in (cfg, man):
        add("blobs/sha256/" + sha(d)[7:], d)
os.unlink(layer_path)
