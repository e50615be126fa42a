# Sourced by scripts/*.sh: installs what the build and the tests need on Debian, when missing.
# containerd + runc: the real runtime the proxy is tested against; protobuf-compiler:
# protoc for k8s-cri; gcc + libc6-dev: static test-image binaries; systemd:
# systemd-socket-activate for the socket-activation test; containernetworking-plugins,
# openssl, xz-utils, iproute2 and iptables: the real-cluster tier (pod networks, the
# service-account key, the compressed binaries in ../shared/k8s/bin, removing the pod
# bridge, routing the `kubernetes` Service to the API server); prometheus: the chart's
# alerts and dashboard loaded into a real Prometheus over the cluster tier's daemons;
# binutils: objcopy and readelf, `tessera image build` strips the daemons it packs.
install_deps() {
    if [ "$(id -u)" != 0 ]; then
        echo "error: run as root: the tests start a private containerd and runc containers" >&2
        exit 1
    fi
    local missing=()
    command -v containerd >/dev/null || missing+=(containerd)
    command -v runc >/dev/null || missing+=(runc)
    command -v protoc >/dev/null || missing+=(protobuf-compiler)
    command -v cc >/dev/null || missing+=(gcc)
    command -v objcopy >/dev/null || missing+=(binutils)
    [ -e /usr/lib/x86_64-linux-gnu/libc.a ] || [ -e /usr/lib/aarch64-linux-gnu/libc.a ] || missing+=(libc6-dev)
    command -v systemd-socket-activate >/dev/null || missing+=(systemd)
    [ -x /usr/lib/cni/bridge ] || missing+=(containernetworking-plugins)
    command -v openssl >/dev/null || missing+=(openssl)
    command -v xz >/dev/null || missing+=(xz-utils)
    command -v ip >/dev/null || missing+=(iproute2)
    command -v iptables >/dev/null || missing+=(iptables)
    command -v promtool >/dev/null || missing+=(prometheus)
    if [ ${#missing[@]} -gt 0 ]; then
        echo "installing: ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
}

# The Helm chart's checks (scripts/chart.py) use Helm's Go SDK through PyPI's
# helm-python-sdk (no helm binary): python3 with venv, then the pinned package in
# target/chart-venv, each only when missing.
install_chart_deps() {
    if ! command -v python3 >/dev/null || ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
        echo "installing: python3 python3-venv"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3 python3-venv >/dev/null
    fi
    python3 scripts/chart.py deps
}
