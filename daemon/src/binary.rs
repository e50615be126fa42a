//! What every Tessera binary does the same way: logging, the host name, shutdown on
//! signals.

use std::fmt;
use std::str::FromStr;

use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::util::SubscriberInitExt;

/// The environment variable a daemon reads for its log format when no
/// `--log-format` flag says otherwise (daemons whose flags predate it read only this).
pub const LOG_FORMAT_ENV: &str = "TESSERA_LOG_FORMAT";

/// How a daemon writes its log lines. Parsed from `text` or `json`, also in config
/// files, where it is a string.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(try_from = "String")]
pub enum LogFormat {
    /// One human-readable line per event; colour only on a terminal.
    #[default]
    Text,
    /// One JSON object per line (`timestamp`, `level`, `target`, `fields`, `span`,
    /// `spans`), for log collectors.
    Json,
}

/// A `--log-format` value that is neither `text` nor `json`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("log format {0:?}: expected text or json")]
pub struct UnknownLogFormat(pub String);

impl FromStr for LogFormat {
    type Err = UnknownLogFormat;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "text" => Ok(Self::Text),
            "json" => Ok(Self::Json),
            other => Err(UnknownLogFormat(other.to_owned())),
        }
    }
}

impl TryFrom<String> for LogFormat {
    type Error = UnknownLogFormat;

    fn try_from(text: String) -> Result<Self, Self::Error> {
        text.parse()
    }
}

impl fmt::Display for LogFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Text => "text",
            Self::Json => "json",
        })
    }
}

/// Logs to stderr as [`init_logging_as`] does, in the format `TESSERA_LOG_FORMAT`
/// names (text when unset; a bad value is logged and text is used, since a daemon
/// should not refuse to start over how it logs).
pub fn init_logging(default: &str) {
    let (format, bad) = match std::env::var(LOG_FORMAT_ENV) {
        Ok(value) => match value.parse() {
            Ok(format) => (format, None),
            Err(error) => (LogFormat::Text, Some(error)),
        },
        Err(_) => (LogFormat::Text, None),
    };
    init_logging_as(default, format);
    if let Some(error) = bad {
        tracing::warn!(variable = LOG_FORMAT_ENV, %error, "logging as text");
    }
}

/// Logs to stderr (stdout is for a command's output), filtered by `RUST_LOG`,
/// `default` when it is unset or invalid, in `format`. Colour only on a terminal:
/// a journal, a file or a container log gets plain text. A second call does nothing.
pub fn init_logging_as(default: &str, format: LogFormat) {
    use std::io::IsTerminal;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| default.into());
    // Fails only when a subscriber is already set (tests, a second call): keep that one.
    let _ = log_subscriber(
        format,
        filter,
        std::io::stderr().is_terminal(),
        std::io::stderr,
    )
    .try_init();
}

/// The subscriber behind [`init_logging_as`], writing to `writer`.
fn log_subscriber<W>(
    format: LogFormat,
    filter: EnvFilter,
    ansi: bool,
    writer: W,
) -> Box<dyn tracing::Subscriber + Send + Sync>
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer);
    match format {
        LogFormat::Text => Box::new(builder.with_ansi(ansi).finish()),
        // Escape codes inside JSON strings would only corrupt a collector's fields.
        LogFormat::Json => Box::new(builder.with_ansi(false).json().finish()),
    }
}

/// An error and its causes on one line, for logs and exit messages: `a: b: c`,
/// each cause once: one whose text its parent already ends with (a library that
/// prints its own source, as kube's kubeconfig errors and libloading's do) is
/// not repeated.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let part = cause.to_string();
        if !text.ends_with(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = cause.source();
    }
    text
}

/// This machine's host name (the node name on a Kubernetes node, the pod name in a pod).
pub fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
}

/// Resolves on SIGTERM or SIGINT: what kubelet and systemd send to stop a daemon
/// (as PID 1 in a container nothing else does it). Fails only when the handlers
/// cannot be installed, naming the signal.
pub async fn shutdown_signal() -> std::io::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut terminate = signal(SignalKind::terminate())
        .map_err(|e| std::io::Error::new(e.kind(), format!("installing a SIGTERM handler: {e}")))?;
    let mut interrupt = signal(SignalKind::interrupt())
        .map_err(|e| std::io::Error::new(e.kind(), format!("installing a SIGINT handler: {e}")))?;
    tokio::select! {
        _ = terminate.recv() => {}
        _ = interrupt.recv() => {}
    }
    Ok(())
}

/// A duration flag or setting is not a Go duration (`15s`, `1m30s`, `500ms`, `1.5h`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid duration {value:?}: {problem} (expected a Go duration such as 15s, 500ms or 1m30s)"
)]
pub struct DurationError {
    /// The text given.
    pub value: String,
    /// What is wrong with it.
    pub problem: String,
}

/// Parses a Go duration as Kubernetes components take them (kube's parser, the
/// format of Go's `time.ParseDuration`; spaces between a number and its unit are
/// allowed, as the hook registrations always took them). Empty and negative
/// durations are refused: none of ours can be.
pub fn parse_duration(text: &str) -> Result<std::time::Duration, DurationError> {
    // kube's parser panics on a negative part after the first (`1s-1s`) and on a
    // product past what a Duration holds: both are refused here first, so a bad
    // flag or registration file is an error that names it, never a panic.
    const MAX_LEN: usize = 64;
    const MAX_DIGITS: usize = 12;
    let value = text.trim();
    let fail = |problem: &str| DurationError {
        value: value.to_owned(),
        problem: problem.to_owned(),
    };
    let compact: String = value.chars().filter(|c| !c.is_whitespace()).collect();
    if compact.is_empty() {
        return Err(fail("empty"));
    }
    if compact.starts_with('-') {
        return Err(fail("negative"));
    }
    if compact.len() > MAX_LEN {
        return Err(fail("too long"));
    }
    if let Some(bad) = compact
        .chars()
        .find(|c| !(c.is_ascii_digit() || *c == '.' || c.is_alphabetic()))
    {
        return Err(fail(&format!("{bad:?} is neither a number nor a unit")));
    }
    let longest_number = compact
        .split(|c: char| c.is_alphabetic())
        .map(str::len)
        .max()
        .unwrap_or(0);
    if longest_number > MAX_DIGITS {
        return Err(fail("a number too large"));
    }
    let parsed: kube::core::Duration = compact
        .parse()
        .map_err(|error: kube::core::duration::ParseError| fail(&error.to_string()))?;
    Ok(parsed.into())
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    #[test]
    fn go_durations_parse_and_bad_ones_say_why() {
        use std::time::Duration;
        let long = "999999999999h".repeat(6);
        for (text, want) in [
            ("15s", Duration::from_secs(15)),
            ("1m30s", Duration::from_secs(90)),
            ("500ms", Duration::from_millis(500)),
            ("1.5s", Duration::from_millis(1500)),
            ("2h", Duration::from_secs(7200)),
            ("0", Duration::ZERO),
            ("250us", Duration::from_micros(250)),
            (" 2s ", Duration::from_secs(2)),
            ("500 ms", Duration::from_millis(500)),
            ("2 s", Duration::from_secs(2)),
        ] {
            assert_eq!(parse_duration(text), Ok(want), "{text}");
        }
        for (text, problem) in [
            ("", "empty"),
            ("15", "missing a unit"),
            ("15x", "invalid unit"),
            ("s", "invalid floating-point number"),
            ("1..5s", "invalid floating-point number"),
            ("-1s", "negative"),
            // Each of these panicked in kube's parser: refused before it.
            ("1s-1s", "'-' is neither a number nor a unit"),
            ("99999999999999999999s", "a number too large"),
            (long.as_str(), "too long"),
            ("+1s", "'+' is neither a number nor a unit"),
        ] {
            let error = parse_duration(text).expect_err(text);
            assert_eq!(error.value, text.trim(), "{text}");
            assert!(error.problem.starts_with(problem), "{text}: {error}");
        }
        assert_eq!(
            parse_duration("15x").map_err(|e| e.to_string()),
            Err("invalid duration \"15x\": invalid unit: expected one of 'ns', 'us', '\u{b5}s', 'ms', 's', 'm', or 'h' (expected a Go duration such as 15s, 500ms or 1m30s)".into())
        );
    }

    #[test]
    fn error_chain_names_every_cause() {
        #[derive(Debug, thiserror::Error)]
        #[error("reading /x")]
        struct Outer(#[source] std::io::Error);
        let error = Outer(std::io::Error::other("denied"));
        assert_eq!(error_chain(&error), "reading /x: denied");
        assert_eq!(error_chain(&std::io::Error::other("alone")), "alone");
        // A cause its parent already prints is said once.
        #[derive(Debug, thiserror::Error)]
        #[error("failed to read kubeconfig: {0}")]
        struct Echoing(#[source] std::io::Error);
        #[derive(Debug, thiserror::Error)]
        #[error("reading kubeconfig /k")]
        struct Top(#[source] Echoing);
        let error = Top(Echoing(std::io::Error::other("No such file")));
        assert_eq!(
            error_chain(&error),
            "reading kubeconfig /k: failed to read kubeconfig: No such file"
        );
    }

    #[test]
    fn log_format_parses_text_and_json_only() {
        assert_eq!("text".parse::<LogFormat>(), Ok(LogFormat::Text));
        assert_eq!("json".parse::<LogFormat>(), Ok(LogFormat::Json));
        assert_eq!(LogFormat::default(), LogFormat::Text);
        let error = "JSON".parse::<LogFormat>().expect_err("case matters");
        assert_eq!(
            error.to_string(),
            "log format \"JSON\": expected text or json"
        );
        for format in [LogFormat::Text, LogFormat::Json] {
            assert_eq!(format.to_string().parse::<LogFormat>(), Ok(format));
        }
    }

    /// Collects what a subscriber writes.
    #[derive(Debug, Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .map_err(|_| std::io::Error::other("poisoned"))?
                .extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Captured {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().expect("not poisoned").clone()).expect("utf-8")
        }
    }

    fn log_with(format: LogFormat, ansi: bool) -> String {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber =
            log_subscriber(format, EnvFilter::new("info"), ansi, move || writer.clone());
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("call", method = "CreateContainer");
            let _entered = span.enter();
            tracing::info!(pod = "default/train-0", gpus = 2, "placed \"quoted\"");
            tracing::debug!("filtered out");
        });
        captured.text()
    }

    #[test]
    fn json_lines_are_json_with_level_target_and_fields() {
        let text = log_with(LogFormat::Json, true);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 1, "one line per event, debug filtered: {text}");
        let line: serde_json::Value = serde_json::from_str(lines[0]).expect("valid JSON");
        assert_eq!(line["level"], "INFO");
        assert_eq!(line["target"], module_path!());
        assert_eq!(line["fields"]["message"], "placed \"quoted\"");
        assert_eq!(line["fields"]["pod"], "default/train-0");
        assert_eq!(line["fields"]["gpus"], 2);
        assert_eq!(line["span"]["method"], "CreateContainer");
        assert!(line["timestamp"].is_string(), "{line}");
        assert!(!text.contains('\u{1b}'), "no escape codes in JSON: {text}");
    }

    #[test]
    fn text_has_colour_only_when_asked() {
        let plain = log_with(LogFormat::Text, false);
        assert!(plain.contains("placed"), "{plain}");
        assert!(plain.contains("pod=\"default/train-0\""), "{plain}");
        assert!(
            !plain.contains('\u{1b}'),
            "escape codes off a terminal: {plain}"
        );
        assert!(log_with(LogFormat::Text, true).contains('\u{1b}'));
    }
}
