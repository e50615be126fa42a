use std::sync::Mutex;

use tessera_fake_mps::FakeMps;

use super::*;

/// The fake daemon's state machine, called in process.
#[derive(Debug, Default)]
struct InProcess {
    mps: Mutex<FakeMps>,
    calls: Mutex<Vec<String>>,
    /// Makes `namespace set` fail, as MPS does while a client is attached.
    attached: bool,
}

impl Control for InProcess {
    fn run(&self, args: &[String]) -> Result<String, MpsError> {
        let line = args.join(" ");
        self.calls
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(line.clone());
        if self.attached && line.starts_with("namespace set") {
            return Err(MpsError::Control {
                command: line,
                reason: "namespace has an active client".into(),
            });
        }
        self.mps
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .execute(args)
            .map_err(|reason| MpsError::Control {
                command: line,
                reason,
            })
    }
}

/// GPU compute modes as the supervisor keeps them: `stuck` never exclusive.
#[derive(Debug, Default)]
struct Modes {
    stuck: bool,
    asked: Mutex<Vec<String>>,
}

impl ComputeMode for Modes {
    fn mode(&self, uuid: &str) -> Result<GpuMode, MpsError> {
        self.asked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(uuid.to_owned());
        Ok(if self.stuck {
            GpuMode::Default
        } else {
            GpuMode::ExclusiveProcess
        })
    }

    fn set(&self, _: &str, _: GpuMode) -> Result<(), MpsError> {
        Err(MpsError::ComputeMode {
            uuid: "-".into(),
            reason: "the proxy never sets it".into(),
        })
    }
}

const UID: &str = "0b5e6a8c-1d2f-4e3a-9b8c-7d6e5f4a3b2c";

fn spec(container: &str, bytes: u64, percent: u64) -> NamespaceSpec {
    NamespaceSpec {
        name: namespace_name(UID, container).unwrap_or_default(),
        server: server_name(0),
        uuid: "GPU-a".into(),
        memory_bytes: bytes,
        thread_percentage: percent,
    }
}

fn setup(control: Arc<InProcess>) -> (Mps, Arc<Modes>, tempfile::TempDir) {
    setup_with(control, Modes::default())
}

fn setup_with(control: Arc<InProcess>, modes: Modes) -> (Mps, Arc<Modes>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let modes = Arc::new(modes);
    let mps = Mps::new(
        control,
        modes.clone(),
        "/run/nvidia-mps".into(),
        dir.path().join("state"),
    )
    .with_exclusive_wait(std::time::Duration::from_millis(100));
    (mps, modes, dir)
}

#[test]
fn names_fit_mps_and_keep_a_pod_together() {
    let name = namespace_name(
        UID,
        "a-very-long-container-name-of-sixty-three-characters-xxxxxxxxxx",
    )
    .unwrap_or_default();
    assert!(name.len() <= 64, "{name}");
    assert!(
        name.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
        "{name}"
    );
    let prefix = pod_prefix(UID).unwrap_or_default();
    assert!(name.starts_with(&prefix));
    assert_ne!(namespace_name(UID, "a"), namespace_name(UID, "b"));
    // A CRI client's own UID: hashed, still a name MPS takes, still one per pod.
    let other = namespace_name("../etc", "main").unwrap_or_default();
    assert!(other.starts_with('u') && other.len() <= 64, "{other}");
    assert!(
        other
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
    );
    assert_ne!(pod_prefix("../etc"), pod_prefix("ABC"));
    // Dashes are dropped only from a UUID: "ab-cd" and "abcd" are two pods.
    assert_ne!(pod_prefix("ab-cd"), pod_prefix("abcd"));
    assert_eq!(pod_prefix(""), None);
    assert_eq!(namespace_name(UID, ""), None);
}

#[test]
fn a_share_gets_its_gpus_server_and_its_own_namespace() -> Result<(), MpsError> {
    let control = Arc::new(InProcess::default());
    let (mps, modes, _dir) = setup(control.clone());
    let spec = spec("main", 20 << 30, 25);
    let dir = mps.ensure(&spec)?;
    assert_eq!(dir, Path::new("/run/nvidia-mps/gpu_0").join(&spec.name));
    // The GPU was exclusive before its server was made, and still is after.
    assert_eq!(
        *modes.asked.lock().unwrap_or_else(|p| p.into_inner()),
        ["GPU-a", "GPU-a"]
    );
    let calls = control
        .calls
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    assert!(calls.contains(&"server create gpu_0 --uid=0 --allowed-devices=GPU-a".to_owned()));
    assert!(calls.contains(&format!(
        "namespace set {} --server=gpu_0 --pinned-memory-limit=20480M --active-thread-percentage=25",
        spec.name
    )));
    // Again (kubelet restarts the container): nothing is made or set twice.
    let before = calls.len();
    mps.ensure(&spec)?;
    let calls = control
        .calls
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    assert!(
        calls[before..].iter().all(|c| c.contains(" get ")),
        "{:?}",
        &calls[before..]
    );
    assert_eq!(mps.read_state()?, [spec]);
    Ok(())
}

#[test]
fn limits_that_differ_are_set_and_a_refused_set_fails() -> Result<(), MpsError> {
    let control = Arc::new(InProcess::default());
    let (mps, _, _dir) = setup(control.clone());
    mps.ensure(&spec("main", 8 << 30, 50))?;
    mps.ensure(&spec("main", 4 << 30, 30))?;
    let held = control.run(&args(&[
        "namespace",
        "get",
        &spec("main", 0, 0).name,
        "gpu_0",
        "pinned-memory-limit",
    ]))?;
    assert_eq!(held, "4G");

    let attached = Arc::new(InProcess {
        attached: true,
        ..InProcess::default()
    });
    let (mps, _, _dir) = setup(attached);
    let error = mps.ensure(&spec("main", 1 << 30, 10));
    assert!(matches!(error, Err(MpsError::Control { .. })), "{error:?}");
    Ok(())
}

#[test]
fn a_gpu_that_does_not_go_exclusive_gets_no_server() {
    let control = Arc::new(InProcess::default());
    let stuck = Modes {
        stuck: true,
        ..Modes::default()
    };
    let (mps, _, _dir) = setup_with(control.clone(), stuck);
    let error = mps.ensure(&spec("main", 1 << 30, 10));
    assert!(
        matches!(&error, Err(MpsError::ComputeMode { reason, .. }) if reason.contains("mps-daemon")),
        "{error:?}"
    );
    let calls = control
        .calls
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    assert!(calls.is_empty(), "{calls:?}");
}

#[test]
fn the_last_namespace_of_a_gpu_takes_its_server_away() -> Result<(), MpsError> {
    let control = Arc::new(InProcess::default());
    let (mps, _, _dir) = setup(control.clone());
    mps.ensure(&spec("main", 1 << 30, 10))?;
    let other = NamespaceSpec {
        name: namespace_name("1111aaaa-0000-0000-0000-000000000000", "main").unwrap_or_default(),
        ..spec("main", 2 << 30, 20)
    };
    mps.ensure(&other)?;
    assert_eq!(mps.remove_pod(UID)?, 1);
    // The other pod's namespace keeps the server.
    assert!(
        control
            .run(&args(&["server", "get", "gpu_0", "status"]))
            .is_ok()
    );
    assert_eq!(mps.remove_pod("1111aaaa-0000-0000-0000-000000000000")?, 1);
    assert!(
        control
            .run(&args(&["server", "get", "gpu_0", "status"]))
            .is_err()
    );
    // With no spec left, the supervisor hands the GPU back.
    assert!(mps.read_state()?.is_empty());
    // A pod with nothing left: nothing to do.
    assert_eq!(mps.remove_pod(UID)?, 0);
    assert_eq!(mps.remove_pod("../x")?, 0);
    assert_eq!(mps.remove_pod("")?, 0);
    Ok(())
}

#[test]
fn the_kept_specs_rebuild_the_daemon() -> Result<(), Box<dyn std::error::Error>> {
    let control = Arc::new(InProcess::default());
    let (mps, _, _dir) = setup(control);
    let a = spec("main", 3 << 30, 30);
    mps.ensure(&a)?;
    let text = config_toml(&mps.read_state()?);
    let mut restarted = FakeMps::default();
    restarted.apply_config(&text)?;
    let held = restarted.execute(&args(&[
        "namespace",
        "get",
        &a.name,
        "gpu_0",
        "pinned-memory-limit",
    ]))?;
    assert_eq!(held, "3G");
    Ok(())
}

#[test]
fn sizes_parse_as_mps_prints_them() {
    assert_eq!(parse_size("20G"), Some(20 << 30));
    assert_eq!(parse_size("20480M"), Some(20 << 30));
    assert_eq!(parse_size("1.5G"), Some(3 << 29));
    assert_eq!(parse_size("512MiB"), Some(512 << 20));
    assert_eq!(parse_size("1024"), Some(1024));
    assert_eq!(parse_size("-"), None);
    assert_eq!(parse_size(""), None);
}

#[test]
fn prune_deletes_the_namespaces_of_pods_no_longer_there() -> Result<(), MpsError> {
    let control = Arc::new(InProcess::default());
    let (mps, _, _dir) = setup(control.clone());
    let other = "1111aaaa-0000-0000-0000-000000000000";
    mps.ensure(&spec("main", 1 << 30, 10))?;
    mps.ensure(&NamespaceSpec {
        name: namespace_name(other, "main").unwrap_or_default(),
        ..spec("main", 2 << 30, 20)
    })?;
    // Recorded after the list was made: kept.
    let before = std::time::SystemTime::UNIX_EPOCH;
    assert_eq!(mps.prune(&[], before)?, 0);
    // Only UID's pod is still on the node.
    let now = std::time::SystemTime::now();
    assert_eq!(mps.prune(&[UID.to_owned()], now)?, 1);
    let names: Vec<String> = mps.read_state()?.into_iter().map(|s| s.name).collect();
    assert_eq!(names, [namespace_name(UID, "main").unwrap_or_default()]);
    assert!(
        control
            .run(&args(&["server", "get", "gpu_0", "status"]))
            .is_ok()
    );
    assert_eq!(mps.prune(&[], now)?, 1);
    assert!(
        control
            .run(&args(&["server", "get", "gpu_0", "status"]))
            .is_err()
    );
    Ok(())
}
