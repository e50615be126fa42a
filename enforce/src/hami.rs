//! HAMi-core's shared region, written with the grant before a shared container's
//! first process runs.
//!
//! HAMi-core keeps a container's limits in a file that each of its processes maps
//! (its "shared region"). The first process to map it writes the limits from its
//! own env; later ones keep those, whatever their env says (measured on an H100,
//! `docs/enforcement.md`). So a container whose first CUDA process runs under
//! `env -i` would make a region with no limit, and every later process would
//! join it.
//!
//! At CreateContainer the GPU hook therefore has HAMi-core itself write the
//! region: it runs `tessera-enforce hami-prime` with the operator's library in
//! `LD_PRELOAD` and the grant's env and nothing else. That process looks up one
//! `cu*` symbol, which makes HAMi-core initialise (through its `dlsym` hook) and
//! create the region; then it exits, and HAMi-core frees its process slot.
//! HAMi-core writes its own layout, so no version of that private format is
//! assumed here.
#![allow(unsafe_code)]

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::process::RunError;

/// The env naming the region file, read by HAMi-core.
pub const REGION_ENV: &str = "CUDA_DEVICE_MEMORY_SHARED_CACHE";
/// The `tessera-enforce` subcommand that writes a region.
pub const SUBCOMMAND: &str = "hami-prime";
/// How long a primer may take: HAMi-core loads the CUDA driver library, no GPU.
pub const TIMEOUT: Duration = Duration::from_secs(10);
/// The symbol looked up: the one every CUDA program resolves first.
const SYMBOL: &[u8] = b"cuInit\0";

/// Why a region could not be written.
#[derive(Debug, thiserror::Error)]
pub enum PrimeError {
    /// The primer could not be started.
    #[error("running {binary} {SUBCOMMAND}: {source}")]
    Spawn {
        binary: PathBuf,
        source: std::io::Error,
    },
    /// The primer did not finish in time, and was killed.
    #[error("{binary} {SUBCOMMAND} did not finish within {limit:?} and was killed")]
    Timeout { binary: PathBuf, limit: Duration },
    /// The primer exited with an error.
    #[error("{binary} {SUBCOMMAND} failed ({status}): {stderr}")]
    Failed {
        binary: PathBuf,
        status: std::process::ExitStatus,
        stderr: String,
    },
    /// The region file could not be read.
    #[error("HAMi-core region {region}: {source}")]
    Region {
        region: PathBuf,
        source: std::io::Error,
    },
    /// The preloaded library did not write the region.
    #[error(
        "the preloaded library {library} did not write the region {region} when `cuInit` was looked up: is it HAMi-core's libvgpu.so?"
    )]
    NotWritten { library: String, region: PathBuf },
}

/// Writes regions through HAMi-core: the `tessera-enforce` binary that runs
/// [`SUBCOMMAND`], and the library it preloads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Primer {
    /// The `tessera-enforce` binary.
    pub binary: PathBuf,
    /// HAMi-core's `libvgpu.so` on the host.
    pub library: PathBuf,
}

impl Primer {
    /// Has HAMi-core write `region` from `env` (the limit env the container gets;
    /// the region's own name is set here), unless the region is written already:
    /// a container restarted by kubelet keeps its region and its grant. Returns
    /// whether it wrote.
    ///
    /// HAMi-core sizes its file before it writes the limits, so a primer that dies
    /// half way leaves a file that is not empty and not the grant's. It therefore
    /// writes a file of its own beside the region, renamed onto it only once the
    /// primer succeeded: a region that is not empty is always a whole one.
    pub fn prime(&self, region: &Path, env: &[(String, String)]) -> Result<bool, PrimeError> {
        if region_len(region)? > 0 {
            return Ok(false);
        }
        let region_error = |source| PrimeError::Region {
            region: region.to_owned(),
            source,
        };
        let name = region
            .file_name()
            .ok_or_else(|| region_error(std::io::Error::other("names no file")))?;
        let mut temporary_name = std::ffi::OsString::from(".");
        temporary_name.push(name);
        temporary_name.push(format!(".priming-{}", std::process::id()));
        let temporary = region.with_file_name(temporary_name);
        // A leftover of a primer this process ran before (killed with it) goes first.
        match std::fs::remove_file(&temporary) {
            Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                return Err(region_error(error));
            }
            _ => {}
        }
        let outcome = self.run(&temporary, env).and_then(|()| {
            // Written by whatever user the container runs as, as the region was.
            std::fs::set_permissions(
                &temporary,
                std::os::unix::fs::PermissionsExt::from_mode(0o666),
            )
            .and_then(|()| std::fs::rename(&temporary, region))
            .map_err(region_error)
        });
        if outcome.is_err() {
            let _ = std::fs::remove_file(&temporary);
        }
        outcome.map(|()| true)
    }

    /// Runs the primer on `region` and waits for it.
    fn run(&self, region: &Path, env: &[(String, String)]) -> Result<(), PrimeError> {
        let mut command = Command::new(&self.binary);
        command
            .arg(SUBCOMMAND)
            .arg("--region")
            .arg(region)
            // Nothing of the proxy's env: HAMi-core reads its settings from env,
            // and only the grant's may count.
            .env_clear()
            .env("LD_PRELOAD", &self.library)
            .envs(
                env.iter()
                    .filter(|(key, _)| key != REGION_ENV)
                    .map(|(k, v)| (k, v)),
            )
            .env(REGION_ENV, region)
            .current_dir("/");
        // Where the driver's libcuda.so.1 is, when the node says so this way.
        if let Some(path) = std::env::var_os("LD_LIBRARY_PATH") {
            command.env("LD_LIBRARY_PATH", path);
        }
        let output = crate::process::output_within(&mut command, TIMEOUT).map_err(|failure| {
            let binary = self.binary.clone();
            match failure {
                RunError::Spawn(source) | RunError::Wait(source) => {
                    PrimeError::Spawn { binary, source }
                }
                RunError::Timeout => PrimeError::Timeout {
                    binary,
                    limit: TIMEOUT,
                },
            }
        })?;
        if !output.status.success() {
            let stderr = String::from_utf8_lossy(&output.stderr);
            return Err(PrimeError::Failed {
                binary: self.binary.clone(),
                status: output.status,
                stderr: last_chars(stderr.trim(), 2000),
            });
        }
        Ok(())
    }
}

/// The region file's length (0 when it is not there yet).
fn region_len(region: &Path) -> Result<u64, PrimeError> {
    match std::fs::metadata(region) {
        Ok(meta) => Ok(meta.len()),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(0),
        Err(source) => Err(PrimeError::Region {
            region: region.to_owned(),
            source,
        }),
    }
}

/// The end of a long message, where a library's error usually is.
fn last_chars(text: &str, max: usize) -> String {
    let count = text.chars().count();
    if count <= max {
        return text.to_owned();
    }
    let tail: String = text.chars().skip(count - max).collect();
    format!("…{tail}")
}

/// [`SUBCOMMAND`], in the primer process: looks up `cuInit`, which makes a
/// preloaded HAMi-core create `region` from this process's env, and checks that
/// it did.
pub fn prime_here(region: &Path) -> Result<(), PrimeError> {
    let named = std::env::var_os(REGION_ENV);
    if named.as_deref() != Some(region.as_os_str()) {
        return Err(PrimeError::Region {
            region: region.to_owned(),
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{REGION_ENV} is {named:?}, not this region"),
            ),
        });
    }
    let library = std::env::var_os("LD_PRELOAD")
        .filter(|l| !l.is_empty())
        .unwrap_or_else(|| OsString::from("(none: LD_PRELOAD is empty)"));
    let this = libloading::os::unix::Library::this();
    // SAFETY: a lookup only: the symbol is never called, and its type is never
    // relied on. With HAMi-core preloaded, `dlsym` is HAMi-core's hook, which
    // initialises it (and writes the region) on the first `cu*` name.
    let _found = unsafe { this.get::<unsafe extern "C" fn(u32) -> i32>(SYMBOL) };
    if region_len(region)? == 0 {
        return Err(PrimeError::NotWritten {
            library: library.to_string_lossy().into_owned(),
            region: region.to_owned(),
        });
    }
    Ok(())
}
