//! Running a helper program with a deadline: the MPS control program and
//! HAMi-core's region primer.

use std::io::Read;
use std::process::{Command, Output, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Why a program gave no output.
#[derive(Debug)]
pub(crate) enum RunError {
    /// It could not be started.
    Spawn(std::io::Error),
    /// Waiting for it failed.
    Wait(std::io::Error),
    /// It did not exit within the limit, and was killed.
    Timeout,
}

/// Runs `command` (stdin empty, stdout and stderr captured) until it exits, or
/// kills it once `limit` has passed. Both streams are read while it runs, so a
/// program that writes much cannot fill a pipe and stall until the deadline.
pub(crate) fn output_within(command: &mut Command, limit: Duration) -> Result<Output, RunError> {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(RunError::Spawn)?;
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().map_err(RunError::Wait)? {
            break status;
        }
        if started.elapsed() >= limit {
            let _ = child.kill();
            let _ = child.wait();
            return Err(RunError::Timeout);
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let collect = |reader: Option<JoinHandle<Vec<u8>>>| {
        reader.and_then(|r| r.join().ok()).unwrap_or_default()
    };
    Ok(Output {
        status,
        stdout: collect(stdout),
        stderr: collect(stderr),
    })
}

/// Reads `pipe` to its end on a thread of its own.
fn drain<R: Read + Send + 'static>(pipe: Option<R>) -> Option<JoinHandle<Vec<u8>>> {
    pipe.map(|mut pipe| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            bytes
        })
    })
}
