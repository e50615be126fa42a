#!/usr/bin/env python3
"""Builds the stand-ins for the images critest pulls, as one OCI image layout.

No registry is reachable here, so scripts/critest.sh pushes these into a local one
and containerd mirrors registry.k8s.io, k8s.gcr.io and gcr.io to it. Every image is
Debian's static busybox (one binary, its applets as hard links in /bin, as in the
upstream busybox images) plus what the specs look at: a marker file that makes
test-image-1/2/3 differ, the image's USER, an nginx and an httpd that answer HTTP 200,
a setuid program for the no_new_privs specs, the static pause.

Usage: images.py --busybox BIN --pause BIN --nnp BIN --nginx BIN --out DIR

Writes the layout to DIR (one ref per image: oci:DIR:REF) and prints one line per
image to push, "REF PATH", PATH being the name under the registry (for example
e2e-test-images/busybox:1.29-2). The output is reproducible: fixed mtimes and owners,
gzip without a timestamp, so the same inputs give the same digests.
"""

import argparse
import gzip
import hashlib
import io
import json
import os
import platform
import subprocess
import tarfile

GO_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())

PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# As in the upstream busybox image.
PASSWD = """root:x:0:0:root:/root:/bin/sh
daemon:x:1:1:daemon:/usr/sbin:/bin/false
bin:x:2:2:bin:/bin:/bin/false
sys:x:3:3:sys:/dev:/bin/false
sync:x:4:100:sync:/bin:/bin/sync
mail:x:8:8:mail:/var/spool/mail:/bin/false
www-data:x:33:33:www-data:/var/www:/bin/false
operator:x:37:37:Operator:/var:/bin/false
nobody:x:65534:65534:nobody:/home:/bin/false
"""
GROUP = """root:x:0:
daemon:x:1:
bin:x:2:
sys:x:3:
adm:x:4:
tty:x:5:
disk:x:6:
lp:x:7:
mail:x:8:
kmem:x:9:
wheel:x:10:root
cdrom:x:11:
dialout:x:18:
floppy:x:19:
video:x:28:
audio:x:29:
tape:x:32:
www-data:x:33:
operator:x:37:
utmp:x:43:
plugdev:x:46:
staff:x:50:
lock:x:54:
netdev:x:82:
users:x:100:
nobody:x:65534:
"""

# Debian's busybox has no ipcs applet; the HostIpc specs run `ipcs -m` and look for a
# segment id, which /proc/sysvipc/shm lists for the caller's IPC namespace.
IPCS = """#!/bin/sh
# ipcs stand-in (Debian's busybox has none): the System V shared memory segments
# of this IPC namespace, as the kernel lists them.
cat /proc/sysvipc/shm
"""

# Nor pgrep: the execSync timeout spec runs `pgrep sleep || true` to see that the
# timed-out exec is gone.
PGREP = """#!/bin/sh
# pgrep stand-in (Debian's busybox has none): the pids of processes whose name
# matches the extended regular expression $1.
status=1
for dir in /proc/[0-9]*; do
    read -r name <"$dir/comm" 2>/dev/null || continue
    if echo "$name" | grep -qE -- "$1"; then
        echo "${dir#/proc/}"
        status=0
    fi
done
exit $status
"""

INDEX_HTML = "<html><body>critest stand-in</body></html>\n"

HTTPD_FOREGROUND = """#!/bin/sh
# httpd stand-in: busybox httpd in the foreground on port 80.
echo "httpd-foreground: busybox httpd serving /usr/local/apache2/htdocs on port 80"
exec httpd -f -v -p 80 -h /usr/local/apache2/htdocs
"""


class Layer:
    """One layer's tar, built in memory with root-owned entries and mtime 0."""

    def __init__(self):
        self.buf = io.BytesIO()
        self.tar = tarfile.open(fileobj=self.buf, mode="w", format=tarfile.PAX_FORMAT)
        self.dirs = set()

    def _info(self, name, kind, mode):
        info = tarfile.TarInfo(name)
        info.type = kind
        info.mode = mode
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        info.mtime = 0
        return info

    def dir(self, name, mode=0o755):
        parent = os.path.dirname(name)
        if parent and parent not in self.dirs:
            self.dir(parent)
        if name not in self.dirs:
            self.dirs.add(name)
            self.tar.addfile(self._info(name, tarfile.DIRTYPE, mode))

    def file(self, name, data, mode=0o644):
        if isinstance(data, str):
            data = data.encode()
        self.dir(os.path.dirname(name))
        info = self._info(name, tarfile.REGTYPE, mode)
        info.size = len(data)
        self.tar.addfile(info, io.BytesIO(data))

    def hardlink(self, name, target):
        self.dir(os.path.dirname(name))
        info = self._info(name, tarfile.LNKTYPE, 0o755)
        info.linkname = target
        self.tar.addfile(info)

    def close(self):
        self.tar.close()
        return self.buf.getvalue()


class Layout:
    """An OCI image layout: content-addressed blobs plus an index naming each image."""

    def __init__(self, out):
        self.out = out
        self.manifests = []
        os.makedirs(os.path.join(out, "blobs", "sha256"), exist_ok=True)
        with open(os.path.join(out, "oci-layout"), "w") as f:
            json.dump({"imageLayoutVersion": "1.0.0"}, f)

    def blob(self, data, media_type):
        digest = hashlib.sha256(data).hexdigest()
        with open(os.path.join(self.out, "blobs", "sha256", digest), "wb") as f:
            f.write(data)
        return {"mediaType": media_type, "digest": "sha256:" + digest, "size": len(data)}

    def image(self, ref, layers, config):
        """Adds an image: `layers` are uncompressed tars, `config` the image's runtime config."""
        descriptors, diff_ids = [], []
        for tar in layers:
            diff_ids.append("sha256:" + hashlib.sha256(tar).hexdigest())
            descriptors.append(
                self.blob(gzip.compress(tar, mtime=0), "application/vnd.oci.image.layer.v1.tar+gzip")
            )
        image_config = {
            "created": "1970-01-01T00:00:00Z",
            "architecture": GO_ARCH,
            "os": "linux",
            "config": {"Env": [PATH_ENV], **config},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
            "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "scripts/critest/images.py"}]
            * len(layers),
        }
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": self.blob(canonical(image_config), "application/vnd.oci.image.config.v1+json"),
            "layers": descriptors,
        }
        descriptor = self.blob(canonical(manifest), "application/vnd.oci.image.manifest.v1+json")
        descriptor["annotations"] = {"org.opencontainers.image.ref.name": ref}
        self.manifests.append(descriptor)

    def close(self):
        index = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": self.manifests,
        }
        with open(os.path.join(self.out, "index.json"), "wb") as f:
            f.write(canonical(index))


def canonical(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def read(path):
    with open(path, "rb") as f:
        return f.read()


def busybox_layer(busybox):
    """/bin/busybox with every applet hard-linked beside it, /etc/passwd and /etc/group."""
    applets = subprocess.run([busybox, "--list"], check=True, capture_output=True, text=True).stdout.split()
    layer = Layer()
    for name in ["dev", "proc", "sys", "etc", "home", "usr/sbin", "usr/bin", "var/run", "var/www"]:
        layer.dir(name)
    layer.dir("root", 0o700)
    layer.dir("tmp", 0o1777)
    layer.file("bin/busybox", read(busybox), 0o755)
    for applet in sorted(set(applets) - {"busybox", "ipcs", "pgrep"}):
        layer.hardlink("bin/" + applet, "bin/busybox")
    layer.file("bin/ipcs", IPCS, 0o755)
    layer.file("bin/pgrep", PGREP, 0o755)
    layer.file("etc/passwd", PASSWD)
    layer.file("etc/group", GROUP)
    return layer.close()


def one_file_layer(name, data, mode=0o644):
    layer = Layer()
    layer.file(name, data, mode)
    return layer.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for binary in ["busybox", "pause", "nnp", "nginx"]:
        parser.add_argument("--" + binary, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    layout = Layout(args.out)
    base = busybox_layer(args.busybox)
    sh = {"Cmd": ["sh"]}
    pushes = []

    def image(ref, layers, config, *paths):
        layout.image(ref, layers, config)
        pushes.extend((ref, path) for path in paths)

    # registry.k8s.io/e2e-test-images/…
    image("busybox", [base], sh, "e2e-test-images/busybox:1.29-2")

    nginx = Layer()
    nginx.file("usr/sbin/nginx", read(args.nginx), 0o755)
    nginx.file("usr/share/nginx/html/index.html", INDEX_HTML)
    nginx = nginx.close()
    image(
        "nginx",
        [base, nginx],
        {"Cmd": ["nginx", "-g", "daemon off;"], "ExposedPorts": {"80/tcp": {}}, "StopSignal": "SIGQUIT"},
        "e2e-test-images/nginx:1.14-2",
    )

    httpd = Layer()
    httpd.file("usr/local/bin/httpd-foreground", HTTPD_FOREGROUND, 0o755)
    httpd.file("usr/local/apache2/htdocs/index.html", INDEX_HTML)
    image(
        "httpd",
        [base, httpd.close()],
        {"Cmd": ["httpd-foreground"], "WorkingDir": "/usr/local/apache2", "ExposedPorts": {"80/tcp": {}}},
        "e2e-test-images/httpd:2.4.39-4",
    )

    # setuid root: without no_new_privs it runs with euid 0 whoever starts it.
    image(
        "nonewprivs",
        [base, one_file_layer("usr/local/bin/nnp", read(args.nnp), 0o4755)],
        {"Entrypoint": ["/usr/local/bin/nnp"]},
        "e2e-test-images/nonewprivs:1.3",
    )

    # registry.k8s.io/pause and k8s.gcr.io/pause (one mirror serves both).
    pause = one_file_layer("pause", read(args.pause), 0o755)
    pause_config = {"Entrypoint": ["/pause"], "User": "65535:65535"}
    image("pause", [pause], pause_config, "pause:3.9")
    # The sandbox image the containerd configurations name, a different image (by a
    # label): were it pause:3.9, that image would carry a third tag, pinned, which
    # the spec removing pause:3.9 from one of two registries does not expect.
    image("pause-sandbox", [pause], {**pause_config, "Labels": {"io.tessera.critest": "sandbox"}},
          "pause:3.10")

    # gcr.io/k8s-staging-cri-tools/…: busybox plus a file named after the image, so
    # that test-image-1, -2 and -3 are three images and test-image-tags:1..3 one.
    staging = "k8s-staging-cri-tools/"
    for name, tags in [
        ("test-image-1", ["latest"]),
        ("test-image-2", ["latest"]),
        ("test-image-3", ["latest"]),
        ("test-image-latest", ["latest"]),
        ("test-image-tag", ["test", "all"]),
        # critest pulls it by a digest of the real image, which no stand-in can have.
        ("test-image-digest", ["latest"]),
    ]:
        image(name, [base, one_file_layer(name, "")], sh, *[f"{staging}{name}:{tag}" for tag in tags])
    image(
        "test-image-tags",
        [base, one_file_layer("same-image", "")],
        sh,
        *[f"{staging}test-image-tags:{tag}" for tag in ["1", "2", "3"]],
    )
    for name, user in [
        ("test-image-user-uid", "1002"),
        ("test-image-user-username", "www-data"),
        ("test-image-user-uid-group", "1003:1004"),
        ("test-image-user-username-group", "www-data:1004"),
    ]:
        image(name, [base], {"Cmd": ["sh"], "User": user}, f"{staging}{name}:latest")

    # default-user (1000) belongs to group-defined-in-image (50000) in /etc/group.
    groups = Layer()
    groups.file("etc/passwd", PASSWD + "default-user:x:1000:1000:Linux User,,,:/home/default-user:/bin/sh\n")
    groups.file("etc/group", GROUP + "default-user:x:1000:\ngroup-defined-in-image:x:50000:default-user\n")
    groups.dir("home/default-user")
    image("test-image-predefined-group", [base, groups.close()], {"Cmd": ["sh"], "User": "1000"},
          f"{staging}test-image-predefined-group:latest")

    # The host-network web server listens on 12003 (cri-tools' images/hostnet-nginx).
    image(
        "hostnet-nginx",
        [base, nginx],
        {"Cmd": ["nginx"], "Env": [PATH_ENV, "NGINX_PORT=12003"], "ExposedPorts": {"12003/tcp": {}},
         "StopSignal": "SIGQUIT"},
        f"{staging}hostnet-nginx-{GO_ARCH}:latest",
    )

    layout.close()
    for ref, path in pushes:
        print(ref, path)


if __name__ == "__main__":
    main()
