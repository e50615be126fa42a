//! The MPS supervisor against the fake control daemon (`fake-mps-control`, run as
//! a real process over its socket): a GPU goes exclusive-process while a kept
//! namespace is on it, namespaces made live through the control program come
//! back after the daemon dies, and a stop asks it to quit and hands the GPU back.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tessera_enforce::mps::{
    ComputeMode, ControlProgram, DaemonConfig, GpuMode, Mps, MpsError, NamespaceSpec,
    namespace_name, server_name, supervise,
};

/// The GPUs' compute modes, as the driver would keep them.
#[derive(Debug, Default)]
struct Modes(Mutex<BTreeMap<String, GpuMode>>);

impl Modes {
    fn of(&self, uuid: &str) -> GpuMode {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(uuid)
            .copied()
            .unwrap_or(GpuMode::Default)
    }
}

impl ComputeMode for Modes {
    fn mode(&self, uuid: &str) -> Result<GpuMode, MpsError> {
        Ok(self.of(uuid))
    }

    fn set(&self, uuid: &str, mode: GpuMode) -> Result<(), MpsError> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(uuid.to_owned(), mode);
        Ok(())
    }
}

fn pid(pipe: &Path) -> Option<String> {
    std::fs::read_to_string(pipe.join("nvidia-cuda-mps-control.pid")).ok()
}

/// Waits until `check` holds, for up to 10 s.
async fn until(what: &str, mut check: impl FnMut() -> bool) -> anyhow::Result<()> {
    for _ in 0..200 {
        if check() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!("timed out waiting for {what}")
}

fn spec(container: &str, gib: u64) -> NamespaceSpec {
    NamespaceSpec {
        name: namespace_name("0b5e6a8c-1d2f-4e3a-9b8c-7d6e5f4a3b2c", container).unwrap_or_default(),
        server: server_name(0),
        uuid: "GPU-a".into(),
        memory_bytes: gib << 30,
        thread_percentage: 25,
    }
}

#[tokio::test]
async fn namespaces_outlive_the_daemon_and_a_stop_quits_it() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let control: PathBuf = tessera_harness::cluster::tessera_binary("fake-mps-control")?;
    let config = DaemonConfig {
        control: control.clone(),
        pipe_dir: dir.path().join("pipe"),
        log_dir: dir.path().join("log"),
        state_dir: dir.path().join("state"),
        min_backoff: Duration::from_millis(100),
        max_backoff: Duration::from_millis(400),
    };
    let modes = Arc::new(Modes::default());
    let mps = Mps::new(
        Arc::new(ControlProgram {
            binary: control,
            pipe_dir: config.pipe_dir.clone(),
        }),
        modes.clone(),
        config.pipe_dir.clone(),
        config.state_dir.clone(),
    );
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let supervisor = {
        let (config, modes) = (config.clone(), modes.clone());
        tokio::spawn(async move {
            supervise(&config, modes.as_ref(), async {
                let _ = stop_rx.await;
            })
            .await
        })
    };
    until("the daemon", || mps.probe().is_ok()).await?;
    let a = spec("a", 3);
    let made = tokio::task::spawn_blocking({
        let (mps, a) = (mps.clone(), a.clone());
        move || mps.ensure(&a)
    })
    .await??;
    assert!(
        made.join("control").exists(),
        "no socket in {}",
        made.display()
    );

    // The daemon dies: the supervisor starts it again, with the namespace.
    let first = pid(&config.pipe_dir).unwrap_or_default();
    let killed = std::process::Command::new("kill")
        .args(["-9", &first])
        .status()?;
    assert!(killed.success());
    until("a new daemon", || {
        pid(&config.pipe_dir).is_some_and(|p| p != first) && mps.probe().is_ok()
    })
    .await?;
    // Back from the supervisor's configuration, before anyone asks for it again.
    let program = ControlProgram {
        binary: tessera_harness::cluster::tessera_binary("fake-mps-control")?,
        pipe_dir: config.pipe_dir.clone(),
    };
    let held = tessera_enforce::mps::Control::run(
        &program,
        &[
            "namespace",
            "get",
            &a.name,
            &a.server,
            "pinned-memory-limit",
        ]
        .map(str::to_owned),
    )?;
    assert_eq!(held, "3G");
    let again = tokio::task::spawn_blocking({
        let (mps, a) = (mps.clone(), a.clone());
        move || mps.ensure(&a)
    })
    .await??;
    assert_eq!(again, made);
    assert!(again.join("control").exists());

    stop_tx.send(()).ok();
    let starts = tokio::time::timeout(Duration::from_secs(15), supervisor).await???;
    assert_eq!(starts, 2);
    assert!(
        mps.probe().is_err(),
        "the daemon still answers after the stop"
    );
    Ok(())
}
