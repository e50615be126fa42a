//! deploy/ matches the code: managed resources, RBAC, the admission policy.

use tessera_api::request::MANAGED_RESOURCES;
use tessera_harness::deploy::{documents, role_allows};

#[test]
fn scheduler_config_manages_every_resource_name() {
    let config = &documents("scheduler-config.yaml")[0];
    let extender = &config["extenders"][0];
    assert_eq!(extender["nodeCacheCapable"], true);
    assert_eq!(
        (
            extender["filterVerb"].as_str(),
            extender["prioritizeVerb"].as_str(),
            extender["bindVerb"].as_str(),
            extender["preemptVerb"].as_str()
        ),
        (
            Some("filter"),
            Some("prioritize"),
            Some("bind"),
            Some("preempt")
        )
    );
    let managed = extender["managedResources"]
        .as_array()
        .expect("managedResources");
    for name in MANAGED_RESOURCES {
        let entry = managed
            .iter()
            .find(|m| m["name"] == *name)
            .unwrap_or_else(|| panic!("{name} not managed"));
        // kube-scheduler counts whole GPUs, and the aggregate compute and memory
        // percent its preemption dry run needs (docs/preemption.md).
        let counted = [
            "nvidia.com/gpu",
            "koordinator.sh/gpu-core",
            "koordinator.sh/gpu-memory-ratio",
        ];
        assert_eq!(
            entry["ignoredByScheduler"],
            !counted.contains(name),
            "{name}"
        );
    }
    assert_eq!(managed.len(), MANAGED_RESOURCES.len());
}

#[test]
fn rbac_covers_what_the_scheduler_calls() {
    let docs = documents("scheduler.yaml");
    let allows = |kind: &str, resource: &str, verb: &str| {
        docs.iter()
            .filter(|d| d["kind"] == kind)
            .any(|role| role_allows(role, resource, verb))
    };
    for (resource, verb) in [
        ("pods", "watch"),
        ("pods", "list"),
        ("pods", "get"),
        ("pods", "patch"),
        ("pods/binding", "create"),
        ("devices", "watch"),
    ] {
        assert!(
            allows("ClusterRole", resource, verb),
            "ClusterRole lacks {verb} {resource}"
        );
    }
    for verb in ["get", "create", "update"] {
        assert!(allows("Role", "leases", verb), "Role lacks {verb} leases");
    }
}

#[test]
fn admission_policy_guards_the_annotation() {
    let docs = documents("admission-policy.yaml");
    let policy = docs
        .iter()
        .find(|d| d["kind"] == "ValidatingAdmissionPolicy")
        .expect("policy");
    let text = policy.to_string();
    assert!(text.contains("scheduling.koordinator.sh/device-allocated"));
    assert!(text.contains("system:serviceaccount:tessera-system:tessera-scheduler"));
    let binding = docs
        .iter()
        .find(|d| d["kind"] == "ValidatingAdmissionPolicyBinding")
        .expect("binding");
    assert_eq!(binding["spec"]["policyName"], policy["metadata"]["name"]);
    assert_eq!(binding["spec"]["validationActions"][0], "Deny");
}

#[test]
fn kube_scheduler_scores_every_node() {
    // Below 100, kube-scheduler samples nodes before the extender sees them, and
    // GPU share outside the sample is never found.
    let config = &documents("scheduler-config.yaml")[0];
    assert_eq!(config["percentageOfNodesToScore"], 100);
}

#[test]
fn admission_policy_covers_every_write_path_of_the_annotation() {
    // kube-apiserver merges a Binding's annotations into the pod it binds, and
    // pods/status patches change annotations too.
    let policy = &documents("admission-policy.yaml")[0];
    let rules = policy["spec"]["matchConstraints"]["resourceRules"]
        .as_array()
        .expect("resourceRules");
    for resource in ["pods", "pods/status", "pods/binding", "bindings"] {
        assert!(
            rules.iter().any(|rule| rule["resources"]
                .as_array()
                .is_some_and(|r| r.iter().any(|x| x == resource))),
            "the admission policy does not match {resource}"
        );
    }
}

/// A follower's wait for the leader sits well inside kube-scheduler's httpTimeout.
#[test]
fn forwarding_to_the_leader_answers_inside_the_extender_http_timeout() {
    let config = &documents("scheduler-config.yaml")[0];
    let timeout = config["extenders"][0]["httpTimeout"]
        .as_str()
        .and_then(|t| t.strip_suffix('s'))
        .and_then(|t| t.parse::<f64>().ok())
        .expect("httpTimeout in seconds");
    let forward = tessera_scheduler::extender::FORWARD_TIMEOUT.as_secs_f64();
    assert!(
        forward + 1.0 <= timeout,
        "forwarding waits {forward} s, kube-scheduler's httpTimeout is {timeout} s"
    );
}

/// The deploy's default is the authenticated extender: mutual TLS on the extender
/// port, kube-scheduler configured with its client certificate and the name the
/// replicas' certificate (`tessera-scheduler certs`) carries, and the identity that
/// certificate gives kube-scheduler is the one allowed to bind.
#[test]
fn the_extender_serves_mutual_tls_by_default_and_kube_scheduler_may_bind() {
    let config = &documents("scheduler-config.yaml")[0];
    let extender = &config["extenders"][0];
    assert!(
        extender["urlPrefix"]
            .as_str()
            .is_some_and(|url| url.starts_with("https://")),
        "{extender}"
    );
    assert_eq!(extender["enableHTTPS"], true);
    let tls = &extender["tlsConfig"];
    for key in ["certFile", "keyFile", "caFile"] {
        assert!(
            tls[key].as_str().is_some_and(|p| p.starts_with('/')),
            "{key}: {tls}"
        );
    }
    assert!(tls.get("insecure").is_none_or(|v| v == false), "{tls}");

    let docs = documents("scheduler.yaml");
    let deployment = docs
        .iter()
        .find(|d| d["kind"] == "Deployment")
        .expect("Deployment");
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    let args: Vec<&str> = container["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    let value = |flag: &str| {
        args.iter()
            .find_map(|a| a.strip_prefix(&format!("{flag}=")))
            .unwrap_or_else(|| panic!("no {flag} in {args:?}"))
    };
    assert!(!args.contains(&"--insecure-listen"), "{args:?}");
    for flag in ["--tls-cert-file", "--tls-key-file", "--client-ca-file"] {
        value(flag);
    }
    assert_eq!(value("--peer-server-name"), tls["serverName"]);
    let certs = tessera_scheduler::certs::generate("tessera-scheduler", "tessera-system", 1)
        .expect("certs");
    let names = |pem: &str| {
        let der = <rustls::pki_types::CertificateDer as rustls::pki_types::pem::PemObject>::from_pem_slice(pem.as_bytes())
            .expect("pem");
        tessera_scheduler::transport::ClientIdentity::from_der(&der).expect("identity")
    };
    assert!(names(&certs.scheduler.cert).is(value("--peer-server-name")));
    assert!(names(&certs.scheduler.cert).is(value("--peer-client-name")));
    assert!(names(&certs.kube_scheduler.cert).is(value("--bind-client-name")));
    // kubelet probes the plain probe port, never the mutual-TLS one.
    let probe = value("--probe-listen").rsplit(':').next().expect("port");
    let ports = container["ports"].as_array().expect("ports");
    let probes = ports
        .iter()
        .find(|p| p["name"] == "probes")
        .expect("probes port");
    assert_eq!(probes["containerPort"].to_string(), probe);
    for probe in ["readinessProbe", "livenessProbe"] {
        assert_eq!(container[probe]["httpGet"]["port"], "probes", "{probe}");
    }
}

/// `--flag`'s `[default: …]` in a binary's `--help`.
fn help_default(help: &str, flag: &str) -> Option<String> {
    let entry: Vec<&str> = help
        .lines()
        .map(str::trim)
        .skip_while(|line| !line.starts_with(&format!("{flag} ")))
        .enumerate()
        .take_while(|(i, line)| *i == 0 || !line.starts_with('-'))
        .map(|(_, line)| line)
        .collect();
    let rest = entry.join(" ");
    let value = rest.split("[default: ").nth(1)?.split(']').next()?;
    Some(value.to_owned())
}

/// deploy/ is the chart rendered with its defaults (charts/tessera/ci/deploy-values.yaml
/// only creates the namespace), and they are docs/compat.md's: a namespace's sharing
/// groups hold at most 4 GPUs (`scheduler.maxGroupGpusPerNamespace`), and the
/// scheduler and the reporter both count `aliyun.com/gpu-mem` in GiB
/// (`scheduler.gpushareMemoryUnit`), which is also tessera-scheduler's own default.
#[test]
fn the_deploy_caps_sharing_groups_at_4_gpus_and_counts_gpushare_in_gib() {
    let args = |file: &str, kind: &str| -> Vec<String> {
        let docs = documents(file);
        let workload = docs
            .iter()
            .find(|d| d["kind"] == kind)
            .unwrap_or_else(|| panic!("no {kind} in {file}"));
        workload["spec"]["template"]["spec"]["containers"][0]["args"]
            .as_array()
            .expect("args")
            .iter()
            .filter_map(|a| a.as_str().map(str::to_owned))
            .collect()
    };
    let scheduler = args("scheduler.yaml", "Deployment");
    for flag in [
        "--max-group-gpus-per-namespace=4",
        "--gpushare-memory-unit=GiB",
    ] {
        assert!(scheduler.iter().any(|a| a == flag), "{flag}: {scheduler:?}");
    }
    let reporter = args("reporter.yaml", "DaemonSet");
    assert!(
        reporter.iter().any(|a| a == "--gpushare-memory-unit=GiB"),
        "{reporter:?}"
    );

    let output = std::process::Command::new(env!("CARGO_BIN_EXE_tessera-scheduler"))
        .args(["serve", "--help"])
        .output()
        .expect("runs");
    assert!(output.status.success(), "{output:?}");
    let help = String::from_utf8_lossy(&output.stdout);
    assert_eq!(
        help_default(&help, "--max-group-gpus-per-namespace").as_deref(),
        Some("4"),
        "{help}"
    );
    assert_eq!(
        help_default(&help, "--gpushare-memory-unit").as_deref(),
        Some("GiB"),
        "{help}"
    );
}

/// `--gpushare-memory-unit` takes gpushare's spellings (MiB, GiB, in any case) and
/// refuses another, naming the flag and the value, before anything starts: both
/// `serve` and `simulate` read it.
#[test]
fn the_gpushare_memory_unit_flag_takes_mib_or_gib_and_refuses_others() {
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_tessera-scheduler"))
            .args(args)
            .output()
            .expect("runs")
    };
    for command in ["serve", "simulate"] {
        let refused = run(&[command, "--gpushare-memory-unit", "MB"]);
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert_eq!(refused.status.code(), Some(2), "{command}: {stderr}");
        assert!(
            stderr.contains("--gpushare-memory-unit")
                && stderr.contains("memory unit \"MB\": expected MiB or GiB"),
            "{command}: {stderr}"
        );
    }
    // Accepted spellings get past the flag, to the next missing input.
    for unit in ["MiB", "gib"] {
        let output = run(&["simulate", "--gpushare-memory-unit", unit]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.code() == Some(2)
                && !stderr.contains("memory unit")
                && stderr.contains("--cluster <FILE>"),
            "{unit}: {stderr}"
        );
    }
}
