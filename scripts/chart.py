#!/usr/bin/env python3
"""Tessera's Helm chart (charts/tessera) through Helm's own Go SDK.

No helm binary is needed: PyPI's helm-python-sdk bundles Helm's Go SDK as a shared
library (libhelm_c). When it is not importable, this script installs it (pinned) into
a virtual environment under target/chart-venv and runs itself from there.

  lint                    helm lint --strict of the chart with its default values and
                          each charts/tessera/ci/*.yaml; any finding (info included)
                          fails. Then bad values must fail rendering naming the key.
  render                  render the chart (helm template): to stdout, or one file per
                          template with --out DIR
  check-deploy            deploy/*.yaml must be the chart rendered with
                          charts/tessera/ci/deploy-values.yaml, document for document
  write-deploy            regenerate deploy/*.yaml from the chart
  install|upgrade|uninstall --kubeconfig PATH --namespace NS
                          the release on a cluster; nothing is waited for
  deps                    install helm-python-sdk if missing, and exit
"""

from __future__ import annotations

import argparse
import difflib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "tessera"
DEPLOY = ROOT / "deploy"
DEPLOY_VALUES = CHART / "ci" / "deploy-values.yaml"
DEPLOY_NAMESPACE = "tessera-system"
RELEASE = "tessera"
VENV = ROOT / "target" / "chart-venv"
SDK_VERSION = "0.2.2"
REQUIREMENTS = [f"helm-python-sdk=={SDK_VERSION}", "pyyaml==6.0.3"]

# deploy/scheduler-config.yaml is the KubeSchedulerConfiguration itself (what
# kube-scheduler --config reads), i.e. this ConfigMap key, not the ConfigMap.
SCHEDULER_CONFIG_FILE = "scheduler-config.yaml"
SCHEDULER_CONFIG_KEY = "scheduler-config.yaml"
# deploy/crd-device.yaml is `tessera-reporter crd`'s output byte for byte
# (reporter/tests/crd.rs); the chart renders charts/tessera/files/crd-device.yaml.
CRD_FILE = "crd-device.yaml"

HEADER = (
    "# Rendered from charts/tessera with {values} (namespace\n"
    "# {namespace}) by `python3 scripts/chart.py write-deploy`: edit the chart, not this\n"
    "# file; `python3 scripts/chart.py check-deploy` fails when they differ.\n"
)

# Bad values and the key each failure must name (`lint` checks every one).
BAD_VALUES = [
    ({"monitoring": {"serviceMonitor": {"enabled": True}}, "reporter": {"metricsPort": 0}}, "reporter.metricsPort"),
    ({"monitoring": {"serviceMonitor": {"enabled": True}}, "scheduler": {"metricsPort": 0}}, "scheduler.metricsPort"),
    ({"scheduler": {"metricsPort": 8889}}, "scheduler.metricsPort"),
    ({"monitoring": {"prometheusRule": {"publishStaleSeconds": 5}}}, "/monitoring/prometheusRule/publishStaleSeconds"),
    ({"scheduler": {"gpuPolicy": "pack"}}, "/scheduler/gpuPolicy"),
    ({"scheduler": {"replicas": 0}}, "/scheduler/replicas"),
    ({"scheduler": {"gpushareMemoryUnit": "KiB"}}, "/scheduler/gpushareMemoryUnit"),
    ({"scheduler": {"maxGroupGpusPerNamespace": -1}}, "/scheduler/maxGroupGpusPerNamespace"),
    ({"scheduler": {"networkPolicy": {"enabled": True}}}, "scheduler.networkPolicy.extenderFrom"),
    ({"scheduler": {"networkPolicy": {"extenderFrom": ["10.0.0.0/24"]}}}, "/scheduler/networkPolicy/extenderFrom/0"),
    ({"scheduler": {"replicas": "2"}}, "/scheduler/replicas"),
    ({"scheduler": {"serviceAccount": {"name": "Tessera_Scheduler"}}}, "/scheduler/serviceAccount/name"),
    ({"scheduler": {"podDisruptionBudget": {"maxUnavailable": "half"}}}, "/scheduler/podDisruptionBudget/maxUnavailable"),
    ({"scheduler": {"image": {"pullPolicy": "Sometimes"}}}, "/scheduler/image/pullPolicy"),
    ({"scheduler": {"extraArgs": "--gpu-policy=spread"}}, "/scheduler/extraArgs"),
    ({"scheduler": {"leaderElection": {"renewDeadlineSeconds": 15}}}, "scheduler.leaderElection.renewDeadlineSeconds"),
    ({"scheduler": {"leaderElection": {"retryPeriodSeconds": 9}}}, "scheduler.leaderElection.retryPeriodSeconds"),
    ({"kubeSchedulerConfig": {"extender": {"httpTimeoutSeconds": 3}}}, "/kubeSchedulerConfig/extender/httpTimeoutSeconds"),
    ({"kubeSchedulerConfig": {"percentageOfNodesToScore": 150}}, "/kubeSchedulerConfig/percentageOfNodesToScore"),
    ({"reporter": {"nodeSelctor": {"gpu": "true"}}}, "nodeSelctor"),
    ({"reporter": {"nodeSelector": {"tessera.io/gpu-node": True}}}, "/reporter/nodeSelector/tessera.io~1gpu-node"),
    ({"reporter": {"metricsPort": 70000}}, "/reporter/metricsPort"),
    ({"reporter": {"driverLibraryDir": "usr/lib"}}, "/reporter/driverLibraryDir"),
    ({"logFormat": "yaml"}, "/logFormat"),
    ({"image": {"registry": ""}}, "/image/registry"),
    ({"crd": {"install": "yes"}}, "/crd/install"),
    ({"nodeInstaller": {"endpoint": "/run/tessera/runtime-proxy.sock"}}, "/nodeInstaller/endpoint"),
    ({"nodeInstaller": {"proxyMetrics": "http://127.0.0.1:9464"}}, "/nodeInstaller/proxyMetrics"),
]


def ensure_sdk() -> None:
    """Runs this script under a Python that has helm_python, installing it if missing."""
    check = f"import helm_python, yaml; assert helm_python.__version__ == {SDK_VERSION!r}"
    try:
        exec(check, {})
        return
    except (ImportError, AssertionError):
        pass
    python = VENV / "bin" / "python"
    if Path(sys.prefix).resolve() == VENV.resolve():
        sys.exit(f"error: {python} lacks {REQUIREMENTS[0]}; remove {VENV} and run again")
    if not python.exists() or subprocess.run([python, "-c", check], capture_output=True).returncode:
        print(f"installing {' '.join(REQUIREMENTS)} into {VENV}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", "--clear", VENV], check=True)
        subprocess.run(
            [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *REQUIREMENTS],
            check=True,
        )
    os.execv(python, [str(python), __file__, *sys.argv[1:]])


def deep_merge(base: dict, override: dict) -> dict:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def user_values(files: list[str], sets: list[str]) -> dict:
    """--values files merged in order, then --set expressions (Helm's syntax)."""
    import helm_python
    import yaml

    values: dict = {}
    for file in files:
        loaded = yaml.safe_load(Path(file).read_text()) or {}
        if not isinstance(loaded, dict):
            sys.exit(f"error: {file}: values must be a mapping")
        values = deep_merge(values, loaded)
    for expression in sets:
        values = deep_merge(values, helm_python.parse_set_string(expression))
    return values


def render(values: dict, namespace: str, release: str = RELEASE) -> dict[str, str]:
    """Template path (tessera/templates/x.yaml) -> rendered manifest; exits naming the bad value."""
    import helm_python

    with helm_python.Chart.load(CHART) as chart:
        try:
            rendered = chart.render(values, name=release, namespace=namespace)
        except (helm_python.HelmValuesError, helm_python.HelmRenderError) as e:
            sys.exit(f"error: bad chart values: {str(e).strip()}")
    # NOTES.txt is the text Helm prints after an install, not a manifest.
    return {path: text for path, text in rendered.items() if path.endswith((".yaml", ".yml"))}


def documents(text: str) -> list:
    import yaml

    return [doc for doc in yaml.safe_load_all(text) if doc is not None]


def deploy_layout(rendered: dict[str, str]) -> dict[str, str]:
    """deploy/ file name -> its text, from the rendered chart."""
    import yaml

    files = {}
    for path, text in sorted(rendered.items()):
        name = Path(path).name
        if "/templates/" not in path or name.startswith("_") or not documents(text):
            continue
        if name == CRD_FILE:
            files[name] = text.strip("\n") + "\n"
            continue
        if name == SCHEDULER_CONFIG_FILE:
            (configmap,) = documents(text)
            text = configmap["data"][SCHEDULER_CONFIG_KEY]
            yaml.safe_load(text)
        header = HEADER.format(
            values=DEPLOY_VALUES.relative_to(ROOT), namespace=DEPLOY_NAMESPACE
        )
        files[name] = header + text.lstrip("\n")
    return files


def deploy_rendered() -> dict[str, str]:
    return deploy_layout(render(user_values([str(DEPLOY_VALUES)], []), DEPLOY_NAMESPACE))


def describe(doc) -> str:
    if isinstance(doc, dict) and "kind" in doc:
        return f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name', '?')}"
    return "the KubeSchedulerConfiguration" if isinstance(doc, dict) else repr(doc)[:40]


def cmd_check_deploy(_args) -> int:
    import yaml

    want = deploy_rendered()
    have = {p.name for p in DEPLOY.glob("*.yaml")}
    problems = []
    for name in sorted(have - want.keys()):
        problems.append(f"deploy/{name}: the chart renders no such file")
    for name in sorted(want.keys() - have):
        problems.append(f"deploy/{name}: missing; the chart renders it")
    for name in sorted(want.keys() & have):
        wanted, found = documents(want[name]), documents((DEPLOY / name).read_text())
        if wanted == found:
            continue
        for i in range(max(len(wanted), len(found))):
            w = wanted[i] if i < len(wanted) else None
            f = found[i] if i < len(found) else None
            if w != f:
                dump = lambda d: yaml.safe_dump(d, sort_keys=True).splitlines()
                diff = "\n".join(
                    difflib.unified_diff(
                        dump(f), dump(w), f"deploy/{name}", "chart", lineterm="", n=2
                    )
                )
                problems.append(
                    f"deploy/{name}: document {i + 1} ({describe(f)}) differs from the chart's "
                    f"({describe(w)}):\n{diff}"
                )
                break
    if problems:
        print("\n".join(problems), file=sys.stderr)
        hint = "run `python3 scripts/chart.py write-deploy`"
        if any(CRD_FILE in p for p in problems):
            hint += (
                "; for the CRD, `cargo run -p tessera-reporter -- crd > "
                "charts/tessera/files/crd-device.yaml` first"
            )
        print(f"deploy/ is not the chart's rendered output: {hint}", file=sys.stderr)
        return 1
    print(f"check-deploy: deploy/ ({', '.join(sorted(have))}) is the chart's rendered output")
    return 0


def cmd_write_deploy(_args) -> int:
    for name, text in deploy_rendered().items():
        (DEPLOY / name).write_text(text if text.endswith("\n") else text + "\n")
        print(f"wrote deploy/{name}")
    return 0


def cmd_render(args) -> int:
    rendered = render(user_values(args.values, args.set), args.namespace, args.release)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for path, text in sorted(rendered.items()):
            if documents(text):
                (out / Path(path).name).write_text(text.lstrip("\n"))
                print(f"wrote {out / Path(path).name}")
        return 0
    for path, text in sorted(rendered.items()):
        if documents(text):
            sys.stdout.write(f"---\n# Source: {path}\n{text.lstrip(chr(10))}")
            if not text.endswith("\n"):
                sys.stdout.write("\n")
    return 0


def cmd_lint(args) -> int:
    import helm_python
    import yaml

    values_sets = [("default values", {})]
    for file in sorted((CHART / "ci").glob("*.yaml")):
        values_sets.append((str(file.relative_to(ROOT)), yaml.safe_load(file.read_text()) or {}))
    if args.values:
        values_sets.append((", ".join(args.values), user_values(args.values, [])))
    failed = False
    for label, values in values_sets:
        report = helm_python.lint(CHART, values, strict=True, namespace=DEPLOY_NAMESPACE)
        findings = report.get("messages") or []
        severity = {0: "UNKNOWN", 1: "INFO", 2: "WARNING", 3: "ERROR"}
        for message in findings:
            failed = True
            print(
                f"lint ({label}): [{severity.get(message.get('severity'), '?')}] "
                f"{message.get('path')}: {str(message.get('error')).strip()}",
                file=sys.stderr,
            )
        for error in report.get("errors") or []:
            if not findings:
                failed = True
                print(f"lint ({label}): {str(error).strip()}", file=sys.stderr)
    # Bad values must fail rendering with a message that names the key.
    with helm_python.Chart.load(CHART) as chart:
        for values, key in BAD_VALUES:
            try:
                chart.render(values, name=RELEASE, namespace=DEPLOY_NAMESPACE)
                failed = True
                print(f"lint: values {values} rendered; they must be refused", file=sys.stderr)
            except (helm_python.HelmValuesError, helm_python.HelmRenderError) as e:
                if key not in str(e):
                    failed = True
                    print(
                        f"lint: values {values} were refused without naming {key}: {e}",
                        file=sys.stderr,
                    )
    if failed:
        print("lint: charts/tessera has findings", file=sys.stderr)
        return 1
    print(
        f"lint: charts/tessera clean with {len(values_sets)} value set(s); "
        f"{len(BAD_VALUES)} bad values refused naming their key"
    )
    return 0


def helm_config(args):
    import helm_python

    kubeconfig = Path(args.kubeconfig)
    if not kubeconfig.is_file():
        sys.exit(f"error: --kubeconfig {kubeconfig}: no such file")
    return helm_python.Config(kubeconfig_path=kubeconfig, namespace=args.namespace)


def summary(release: dict) -> str:
    """`release tessera, namespace tessera-system, revision 2, status deployed, chart tessera-0.1.0`."""
    parts = [f"release {release.get('name', '?')}"]
    for key in ("namespace", "revision", "status"):
        if release.get(key) is not None:
            parts.append(f"{key} {release[key]}")
    if release.get("chart_name"):
        parts.append(f"chart {release['chart_name']}-{release.get('chart_version', '?')}")
    return ", ".join(parts)


def cmd_release(args) -> int:
    import helm_python

    values = user_values(args.values, args.set) if args.command != "uninstall" else None
    if values is not None:
        render(values, args.namespace, args.release)  # bad values: fail naming the key
    with helm_config(args) as config:
        try:
            if args.command == "install":
                release = config.install(
                    CHART,
                    args.release,
                    values,
                    namespace=args.namespace,
                    create_namespace=args.create_namespace,
                    timeout=args.timeout,
                    wait="hookOnly",
                    dry_run=args.dry_run,
                )
            elif args.command == "upgrade":
                release = config.upgrade(
                    CHART,
                    args.release,
                    values,
                    namespace=args.namespace,
                    timeout=args.timeout,
                    wait="hookOnly",
                    dry_run=args.dry_run,
                )
            else:
                result = config.uninstall(
                    args.release,
                    timeout=args.timeout,
                    ignore_not_found=args.ignore_not_found,
                    wait="hookOnly",
                )
                release = result.get("release") or {"name": args.release}
        except helm_python.HelmError as e:
            sys.exit(f"error: {args.command} {args.release}: {str(e).strip()}")
    if getattr(args, "dry_run", None):
        sys.stdout.write(release.get("manifest", ""))
    print(f"{args.command}: {summary(release)}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="chart.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def values_args(p):
        p.add_argument("--values", "-f", action="append", default=[], metavar="FILE",
                       help="a values file (repeatable; later ones win)")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="a value in Helm's --set syntax (repeatable; after the files)")
        p.add_argument("--release", default=RELEASE, help=f"release name [{RELEASE}]")

    p = sub.add_parser("lint", help="strict lint, and bad values refused naming the key")
    p.add_argument("--values", "-f", action="append", default=[], metavar="FILE",
                   help="also lint with these values")
    p.set_defaults(run=cmd_lint)
    p = sub.add_parser("render", help="render the chart (helm template)")
    values_args(p)
    p.add_argument("--namespace", "-n", default=DEPLOY_NAMESPACE,
                   help=f"release namespace [{DEPLOY_NAMESPACE}]")
    p.add_argument("--out", metavar="DIR", help="one file per template in DIR, not stdout")
    p.set_defaults(run=cmd_render)
    p = sub.add_parser("check-deploy", help="deploy/ must be the chart's rendered output")
    p.set_defaults(run=cmd_check_deploy)
    p = sub.add_parser("write-deploy", help="regenerate deploy/ from the chart")
    p.set_defaults(run=cmd_write_deploy)
    for name in ("install", "upgrade", "uninstall"):
        p = sub.add_parser(name, help=f"helm {name} against --kubeconfig (waits for nothing)")
        p.add_argument("--kubeconfig", required=True, metavar="PATH")
        p.add_argument("--namespace", "-n", required=True, metavar="NS")
        p.add_argument("--timeout", type=int, default=300, metavar="SECS",
                       help="for the API calls themselves [300]")
        if name == "uninstall":
            p.add_argument("--release", default=RELEASE, help=f"release name [{RELEASE}]")
            p.add_argument("--ignore-not-found", action="store_true")
        else:
            values_args(p)
            p.add_argument("--dry-run", choices=["client", "server"],
                           help="render and check only; client: no cluster call but the release's")
        if name == "install":
            p.add_argument("--no-create-namespace", dest="create_namespace",
                           action="store_false", help="the namespace must exist already")
        p.set_defaults(run=cmd_release)
    p = sub.add_parser("deps", help="install helm-python-sdk if missing")
    p.set_defaults(run=lambda _args: 0)

    args = parser.parse_args()
    ensure_sdk()
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
