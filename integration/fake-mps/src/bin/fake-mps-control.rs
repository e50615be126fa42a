//! `fake-mps-control`: a stand-in for `nvidia-cuda-mps-control` (MPS v3), for
//! tests without a GPU. See the crate docs for what it emulates.
//!
//! - Daemon: `fake-mps-control -f [-p 3] [-m] [-a CONFIG]` listens on
//!   `$CUDA_MPS_PIPE_DIRECTORY/control` (default `/run/nvidia-mps`), writes
//!   `nvidia-cuda-mps-control.pid` there, applies CONFIG, and serves commands
//!   until a client sends `-q`.
//! - Client: `fake-mps-control [-p 3] <module> <verb> ...` or `-q` sends its
//!   arguments to the daemon, prints the answer, exits 1 on an error (printed on
//!   stderr), and 1 with "Cannot find MPS control daemon process" when none listens.
//!
//! With `FAKE_MPS_LOG` set, the daemon appends a JSON line for its start
//! (`{"event":"start","args":[…],"config":"…"}`) and one for each command
//! (`{"event":"command","args":[…],"ok":bool,"output":"…"}`).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use serde_json::{Value, json};
use tessera_fake_mps::FakeMps;

fn pipe_dir() -> PathBuf {
    std::env::var_os("CUDA_MPS_PIPE_DIRECTORY")
        .map(PathBuf::from)
        .unwrap_or_else(|| "/run/nvidia-mps".into())
}

fn log(event: &Value) {
    let Some(path) = std::env::var_os("FAKE_MPS_LOG") else {
        return;
    };
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(format!("{event}\n").as_bytes()));
    if let Err(error) = written {
        eprintln!(
            "fake-mps-control: log {}: {error}",
            Path::new(&path).display()
        );
    }
}

fn daemon(args: &[String]) -> Result<(), String> {
    let dir = pipe_dir();
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut mps = FakeMps::with_pipe_dir(&dir);
    let config = match args.iter().position(|a| a == "-a") {
        Some(i) => {
            let path = args.get(i + 1).ok_or("-a needs a file")?;
            std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?
        }
        None => String::new(),
    };
    if !config.is_empty() {
        mps.apply_config(&config)?;
    }
    let control = dir.join("control");
    let _ = std::fs::remove_file(&control);
    let listener =
        UnixListener::bind(&control).map_err(|e| format!("{}: {e}", control.display()))?;
    std::fs::write(
        dir.join("nvidia-cuda-mps-control.pid"),
        std::process::id().to_string(),
    )
    .map_err(|e| e.to_string())?;
    log(&json!({"event": "start", "args": args, "config": config, "pid": std::process::id()}));
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        let mut line = String::new();
        if BufReader::new(&stream).read_line(&mut line).is_err() {
            continue;
        }
        let Ok(command) = serde_json::from_str::<Vec<String>>(&line) else {
            continue;
        };
        if command.iter().any(|a| a == "-q") {
            log(&json!({"event": "quit"}));
            let _ = stream.write_all(format!("{}\n", json!({"ok": true, "output": ""})).as_bytes());
            let _ = std::fs::remove_file(&control);
            return Ok(());
        }
        let result = mps.execute(&command);
        let (ok, output) = match &result {
            Ok(out) => (true, out.clone()),
            Err(error) => (false, error.clone()),
        };
        log(&json!({"event": "command", "args": command, "ok": ok, "output": output}));
        let _ = stream.write_all(format!("{}\n", json!({"ok": ok, "output": output})).as_bytes());
    }
    Ok(())
}

fn client(args: &[String]) -> ExitCode {
    let control = pipe_dir().join("control");
    let Ok(mut stream) = UnixStream::connect(&control) else {
        eprintln!("Cannot find MPS control daemon process");
        return ExitCode::FAILURE;
    };
    let sent = serde_json::to_string(args)
        .map_err(|e| e.to_string())
        .and_then(|line| {
            stream
                .write_all(format!("{line}\n").as_bytes())
                .map_err(|e| e.to_string())
        });
    let mut answer = String::new();
    let read = sent.and_then(|()| {
        BufReader::new(&stream)
            .read_line(&mut answer)
            .map_err(|e| e.to_string())
    });
    let answer: Value =
        match read.and_then(|_| serde_json::from_str(&answer).map_err(|e| e.to_string())) {
            Ok(answer) => answer,
            Err(error) => {
                eprintln!("fake-mps-control: {error}");
                return ExitCode::FAILURE;
            }
        };
    let output = answer["output"].as_str().unwrap_or_default();
    if answer["ok"] == true {
        if !output.is_empty() {
            println!("{output}");
        }
        ExitCode::SUCCESS
    } else {
        eprintln!("{output}");
        ExitCode::FAILURE
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-f" || a == "-d") {
        return match daemon(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("fake-mps-control: {error}");
                ExitCode::FAILURE
            }
        };
    }
    client(&args)
}
