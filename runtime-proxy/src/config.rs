//! Typed, validated configuration: flags over an optional TOML file over defaults.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use serde::Deserialize;
use tessera_daemon::binary::LogFormat;
use tessera_daemon::metrics::MetricsListen;
use tessera_hooks::args::GpuHookArgs;
use tessera_hooks::gpu::{PrivilegedPolicy, TrustedGpuAgent};

use crate::relay::RelayMode;

/// Default socket kubelet talks to.
pub const DEFAULT_LISTEN: &str = "/run/tessera/runtime-proxy.sock";
/// Default runtime socket.
pub const DEFAULT_RUNTIME_ENDPOINT: &str = "/run/containerd/containerd.sock";
/// Default directory of external hook registrations.
pub const DEFAULT_HOOKS_DIR: &str = "/etc/tessera/hooks.d";
/// Default metrics endpoint. Loopback, because the proxy is a root host daemon in every
/// pod's CRI path and opening a port on each node's network is a firewall decision
/// operators make themselves (`--metrics-addr 0.0.0.0:9464`); a node-local scraper with
/// host networking reaches loopback. 9464 is the port the OpenTelemetry Prometheus
/// exporter made usual for this, clear of node-exporter (9100) and dcgm-exporter (9400).
pub const DEFAULT_METRICS_ADDR: SocketAddr =
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 9464));
const DEFAULT_DRAIN_SECS: u64 = 30;
const DEFAULT_MAX_MESSAGE_BYTES: usize = 16 << 20;

/// Command-line flags of `tessera-runtime-proxy`.
#[derive(Debug, Clone, Default, Parser)]
#[command(
    name = "tessera-runtime-proxy",
    version,
    about = "CRI proxy between kubelet and the container runtime.",
    long_about = "CRI proxy between kubelet and the container runtime (containerd).\n\n\
        Kubelet is pointed at --listen. Every CRI call is forwarded to --runtime-endpoint \
        unchanged, frame by frame; the lifecycle calls (RunPodSandbox, StopPodSandbox, \
        RemovePodSandbox, CreateContainer, StartContainer, StopContainer, RemoveContainer, \
        UpdateContainerResources) also run the configured hooks.\n\n\
        Settings come from flags, then from --config, then from defaults. When started by \
        systemd socket activation, the passed socket is used and --listen is ignored.\n\n\
        Logging follows RUST_LOG (default: info); --log-format picks text or JSON lines."
)]
pub struct Cli {
    /// TOML file with the proxy's own settings (keys as the flags, with '_' for '-':
    /// listen, runtime_endpoint, image_endpoint, metrics_addr, log_format,
    /// drain_timeout, max_message_bytes, hooks_dir, relay, kubelet_process), and of the
    /// GPU hook's only gpu_hook (true/false), trusted_gpu_agents and privileged; the
    /// hook's other settings are flags. Flags win over the file.
    #[arg(long, value_name = "FILE", env = "TESSERA_PROXY_CONFIG")]
    pub config: Option<PathBuf>,
    /// Unix socket to serve kubelet on; created 0660, its directory created if missing
    /// [default: /run/tessera/runtime-proxy.sock].
    #[arg(long, value_name = "PATH")]
    pub listen: Option<PathBuf>,
    /// Runtime service socket to forward to; a `unix://` prefix is accepted
    /// [default: /run/containerd/containerd.sock].
    #[arg(long, value_name = "PATH")]
    pub runtime_endpoint: Option<PathBuf>,
    /// Image service socket to forward image calls to [default: the runtime endpoint].
    #[arg(long, value_name = "PATH")]
    pub image_endpoint: Option<PathBuf>,
    /// Serve Prometheus (OpenMetrics) metrics at http://ADDR/metrics, or `off`
    /// [default: 127.0.0.1:9464].
    #[arg(long, value_name = "ADDR|off")]
    pub metrics_addr: Option<MetricsListen>,
    /// Log lines as `text` (colour only on a terminal) or `json` (one object per line)
    /// [default: text].
    #[arg(long, value_name = "text|json", env = tessera_daemon::binary::LOG_FORMAT_ENV)]
    pub log_format: Option<LogFormat>,
    /// Seconds to let in-flight calls finish after SIGTERM or SIGINT [default: 30].
    #[arg(long, value_name = "SECS")]
    pub drain_timeout: Option<u64>,
    /// Largest intercepted message, in bytes, the proxy holds to run hooks [default: 16777216].
    #[arg(long, value_name = "BYTES")]
    pub max_message_bytes: Option<usize>,
    /// Directory of external hook registrations (*.toml), reloaded when it changes
    /// [default: /etc/tessera/hooks.d].
    #[arg(long, value_name = "DIR")]
    pub hooks_dir: Option<PathBuf>,
    /// Turn the embedded GPU hook off (e.g. when tessera-gpu-hook runs as an external
    /// hook). A container that could see GPUs is then refused while no valid
    /// registration named "gpu" runs at PreCreateContainer with failure_policy Fail
    /// (systemd/hooks.d/10-gpu.toml).
    #[arg(long)]
    pub no_gpu_hook: bool,
    /// How kubelet's calls reach the runtime: `h2` terminates HTTP/2 on both sides,
    /// `frames` relays HTTP/2 frames on one runtime connection per kubelet
    /// connection (the image endpoint must be the runtime's) [default: frames
    /// when the image endpoint is the runtime's, h2 otherwise].
    #[arg(long, value_name = "h2|frames")]
    pub relay: Option<RelayMode>,
    /// The process names (as /proc/PID/comm gives them, at most 15 bytes) of
    /// kubelet: a connection from one of them counts as kubelet's, and
    /// tessera-reporter takes the node as switched only while kubelet is connected
    /// (<enforcement-dir>/kubelet). Where kubelet runs inside another binary (k3s),
    /// name that process; repeat the flag or separate names with ',' [default: kubelet]
    #[arg(long, value_name = "NAME", value_delimiter = ',')]
    pub kubelet_process: Vec<String>,
    /// The checkpoint of Tessera's kubelet DRA plugin (tessera-reporter run
    /// --dra): each pod with claims of driver gpu.tessera.io prepared there gets
    /// the GPUs and shares they were allocated, held as the extender's grants are;
    /// a container given such a claim's CDI device without one is refused. A
    /// missing file: no claims
    #[arg(long, value_name = "PATH", default_value = crate::dra::DEFAULT_CLAIMS_FILE)]
    pub dra_claims: PathBuf,
    /// Embedded GPU hook settings (flags only, except trusted_gpu_agents and
    /// privileged, which the file may also set).
    #[command(flatten, next_help_heading = "GPU hook")]
    pub gpu: GpuHookArgs,
}

/// The settings a config file may hold.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    listen: Option<PathBuf>,
    runtime_endpoint: Option<PathBuf>,
    image_endpoint: Option<PathBuf>,
    metrics_addr: Option<MetricsListen>,
    log_format: Option<LogFormat>,
    drain_timeout: Option<u64>,
    max_message_bytes: Option<usize>,
    hooks_dir: Option<PathBuf>,
    relay: Option<RelayMode>,
    kubelet_process: Option<Vec<String>>,
    gpu_hook: Option<bool>,
    /// The GPU hook's trusted agents; `--trusted-gpu-agents` replaces the list.
    trusted_gpu_agents: Option<Vec<TrustedGpuAgent>>,
    /// The GPU hook's policy for privileged containers.
    privileged: Option<PrivilegedPolicy>,
}

/// A setting that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("config file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The config file is not valid TOML of the expected shape.
    #[error("config file {path}: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: Box<toml::de::Error>,
    },
    /// A setting holds a value the proxy cannot use.
    #[error("setting {setting}: {problem}")]
    Invalid {
        setting: &'static str,
        problem: String,
    },
}

/// The proxy's resolved settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// Socket served to kubelet.
    pub listen: PathBuf,
    /// Runtime service socket.
    pub runtime_endpoint: PathBuf,
    /// Image service socket.
    pub image_endpoint: PathBuf,
    /// Metrics endpoint, if any.
    pub metrics_addr: Option<SocketAddr>,
    /// How log lines are written.
    pub log_format: LogFormat,
    /// How long SIGTERM waits for in-flight calls.
    pub drain_timeout: Duration,
    /// Largest intercepted message.
    pub max_message_bytes: usize,
    /// External hook registrations.
    pub hooks_dir: PathBuf,
    /// How kubelet's calls reach the runtime.
    pub relay: RelayMode,
    /// kubelet's process names (`/proc/PID/comm`).
    pub kubelet_processes: Vec<String>,
    /// Where the node's files for tessera-reporter go (`--enforcement-dir`),
    /// kubelet's connections among them, GPU hook or not.
    pub enforcement_dir: PathBuf,
    /// The kubelet DRA plugin's checkpoint (`--dra-claims`).
    pub dra_claims: PathBuf,
    /// The embedded GPU hook's settings; `None` when it is off.
    pub gpu_hook: Option<GpuHookArgs>,
}

fn endpoint(setting: &'static str, path: PathBuf) -> Result<PathBuf, ConfigError> {
    let text = path.to_string_lossy();
    let path = match text.strip_prefix("unix://") {
        Some(rest) => PathBuf::from(rest),
        None if text.contains("://") => {
            return Err(ConfigError::Invalid {
                setting,
                problem: format!("{text:?}: only unix sockets are supported"),
            });
        }
        None => path,
    };
    if !path.is_absolute() {
        return Err(ConfigError::Invalid {
            setting,
            problem: format!("{}: must be an absolute path", path.display()),
        });
    }
    Ok(path)
}

impl Config {
    /// Resolves flags over the file they name over defaults, and validates the result.
    pub fn resolve(cli: Cli) -> Result<Self, ConfigError> {
        let file = match &cli.config {
            Some(path) => Self::read_file(path)?,
            None => FileConfig::default(),
        };
        let listen = endpoint(
            "listen",
            cli.listen
                .or(file.listen)
                .unwrap_or_else(|| DEFAULT_LISTEN.into()),
        )?;
        let runtime_endpoint = endpoint(
            "runtime-endpoint",
            cli.runtime_endpoint
                .or(file.runtime_endpoint)
                .unwrap_or_else(|| DEFAULT_RUNTIME_ENDPOINT.into()),
        )?;
        let image_endpoint = match cli.image_endpoint.or(file.image_endpoint) {
            Some(path) => endpoint("image-endpoint", path)?,
            None => runtime_endpoint.clone(),
        };
        if listen == runtime_endpoint || listen == image_endpoint {
            return Err(ConfigError::Invalid {
                setting: "listen",
                problem: format!(
                    "{} is also the runtime endpoint; the proxy would call itself",
                    listen.display()
                ),
            });
        }
        let relay = cli
            .relay
            .or(file.relay)
            .unwrap_or_else(|| RelayMode::for_endpoints(&runtime_endpoint, &image_endpoint));
        if relay == RelayMode::Frames && image_endpoint != runtime_endpoint {
            return Err(ConfigError::Invalid {
                setting: "relay",
                problem: format!(
                    "frames relays every call to the runtime endpoint {}, but the image endpoint is {}; use h2",
                    runtime_endpoint.display(),
                    image_endpoint.display()
                ),
            });
        }
        let max_message_bytes = cli
            .max_message_bytes
            .or(file.max_message_bytes)
            .unwrap_or(DEFAULT_MAX_MESSAGE_BYTES);
        if max_message_bytes < 1024 {
            return Err(ConfigError::Invalid {
                setting: "max-message-bytes",
                problem: format!("{max_message_bytes} is too small; at least 1024"),
            });
        }
        let kubelet_processes = match cli.kubelet_process {
            names if !names.is_empty() => names,
            _ => file
                .kubelet_process
                .unwrap_or_else(|| vec!["kubelet".to_owned()]),
        };
        if kubelet_processes.is_empty() {
            return Err(ConfigError::Invalid {
                setting: "kubelet-process",
                problem: "an empty list: no connection would be kubelet's, and the node would never take GPU pods".into(),
            });
        }
        if let Some(name) = kubelet_processes
            .iter()
            .find(|n| n.is_empty() || n.len() > 15 || n.contains('/'))
        {
            return Err(ConfigError::Invalid {
                setting: "kubelet-process",
                problem: format!(
                    "{name:?}: a process name as /proc/PID/comm gives it (1 to 15 bytes, no '/'; the kernel keeps the first 15 of a longer one)"
                ),
            });
        }
        Ok(Self {
            kubelet_processes,
            enforcement_dir: cli.gpu.enforcement_dir.clone(),
            dra_claims: cli.dra_claims.clone(),
            listen,
            runtime_endpoint,
            image_endpoint,
            metrics_addr: cli
                .metrics_addr
                .or(file.metrics_addr)
                .unwrap_or(MetricsListen::At(DEFAULT_METRICS_ADDR))
                .addr(),
            log_format: cli.log_format.or(file.log_format).unwrap_or_default(),
            drain_timeout: Duration::from_secs(
                cli.drain_timeout
                    .or(file.drain_timeout)
                    .unwrap_or(DEFAULT_DRAIN_SECS),
            ),
            max_message_bytes,
            hooks_dir: cli
                .hooks_dir
                .or(file.hooks_dir)
                .unwrap_or_else(|| DEFAULT_HOOKS_DIR.into()),
            relay,
            gpu_hook: (!cli.no_gpu_hook && file.gpu_hook.unwrap_or(true)).then(|| {
                let mut gpu = cli.gpu;
                if gpu.trusted_gpu_agents.is_empty() {
                    gpu.trusted_gpu_agents = file.trusted_gpu_agents.unwrap_or_default();
                }
                gpu.privileged = gpu.privileged.or(file.privileged);
                gpu
            }),
        })
    }

    fn read_file(path: &Path) -> Result<FileConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.into(),
            source,
        })?;
        toml::from_str(&text).map_err(|source| ConfigError::Parse {
            path: path.into(),
            source: Box::new(source),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults() {
        let config = Config::resolve(Cli::default()).expect("valid");
        assert_eq!(config.listen, PathBuf::from(DEFAULT_LISTEN));
        assert_eq!(
            config.runtime_endpoint,
            PathBuf::from(DEFAULT_RUNTIME_ENDPOINT)
        );
        assert_eq!(config.image_endpoint, config.runtime_endpoint);
        assert_eq!(config.drain_timeout, Duration::from_secs(30));
        assert_eq!(
            config.metrics_addr,
            Some("127.0.0.1:9464".parse().expect("addr")),
            "metrics on by default, on loopback"
        );
        assert_eq!(config.log_format, LogFormat::Text);
        assert_eq!(
            config.relay,
            RelayMode::Frames,
            "one runtime socket for both services: the frame relay"
        );
    }

    #[test]
    fn kubelet_process_names_come_from_flags_or_the_file_and_must_be_comm_names() {
        let config = Config::resolve(Cli::default()).expect("valid");
        assert_eq!(config.kubelet_processes, ["kubelet"]);
        assert_eq!(
            config.enforcement_dir,
            PathBuf::from("/run/tessera/enforce")
        );
        let dir = tempfile::tempdir().expect("dir");
        let file = dir.path().join("proxy.toml");
        std::fs::write(&file, "kubelet_process = [\"k3s-agent\"]\n").expect("write");
        let from_file = Config::resolve(Cli {
            config: Some(file.clone()),
            ..Cli::default()
        })
        .expect("valid");
        assert_eq!(from_file.kubelet_processes, ["k3s-agent"]);
        std::fs::write(&file, "kubelet_process = []\n").expect("write");
        let empty = Config::resolve(Cli {
            config: Some(file.clone()),
            ..Cli::default()
        })
        .expect_err("an empty list")
        .to_string();
        assert!(empty.contains("an empty list"), "{empty}");
        std::fs::write(&file, "kubelet_process = [\"k3s-agent\"]\n").expect("write");
        let from_flags = Cli::try_parse_from([
            "tessera-runtime-proxy",
            "--config",
            file.to_str().expect("utf-8"),
            "--kubelet-process=kubelet,k3s-server",
        ])
        .expect("flags");
        assert_eq!(
            Config::resolve(from_flags)
                .expect("valid")
                .kubelet_processes,
            ["kubelet", "k3s-server"]
        );
        for bad in ["", "/usr/bin/kubelet", "a-name-of-16-chr"] {
            let error = Config::resolve(Cli {
                kubelet_process: vec![bad.into()],
                ..Cli::default()
            })
            .expect_err(bad)
            .to_string();
            assert!(
                error.starts_with("setting kubelet-process: ") && error.contains("/proc/PID/comm"),
                "{bad:?}: {error}"
            );
        }
    }

    #[test]
    fn relay_defaults_to_h2_with_a_separate_image_endpoint() {
        let config = Config::resolve(Cli {
            image_endpoint: Some("/run/images.sock".into()),
            ..Cli::default()
        })
        .expect("valid");
        assert_eq!(config.relay, RelayMode::H2);
        let config = Config::resolve(Cli {
            image_endpoint: Some(DEFAULT_RUNTIME_ENDPOINT.into()),
            ..Cli::default()
        })
        .expect("valid");
        assert_eq!(
            config.relay,
            RelayMode::Frames,
            "the same socket, named again"
        );
    }

    #[test]
    fn relay_from_flag_or_file_and_only_with_one_endpoint() {
        let config = Config::resolve(Cli {
            relay: Some(RelayMode::Frames),
            ..Cli::default()
        })
        .expect("valid");
        assert_eq!(config.relay, RelayMode::Frames);
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("proxy.toml");
        std::fs::write(
            &file,
            "relay = \"frames\"\nimage_endpoint = \"/run/images.sock\"\n",
        )
        .expect("write");
        let err = Config::resolve(Cli {
            config: Some(file),
            ..Cli::default()
        })
        .expect_err("two endpoints");
        assert_eq!(
            err.to_string(),
            "setting relay: frames relays every call to the runtime endpoint \
             /run/containerd/containerd.sock, but the image endpoint is /run/images.sock; use h2"
        );
        assert!(Cli::try_parse_from(["p", "--relay", "bytes"]).is_err());
    }

    #[test]
    fn metrics_and_log_format_from_flags_or_file() {
        let cli = Cli::try_parse_from([
            "tessera-runtime-proxy",
            "--metrics-addr=off",
            "--log-format=json",
        ])
        .expect("flags parse");
        let config = Config::resolve(cli).expect("valid");
        assert_eq!(config.metrics_addr, None);
        assert_eq!(config.log_format, LogFormat::Json);

        let err = Cli::try_parse_from(["tessera-runtime-proxy", "--metrics-addr=9464"])
            .expect_err("a port alone");
        assert!(err.to_string().contains("expected HOST:PORT"), "{err}");
        let err = Cli::try_parse_from(["tessera-runtime-proxy", "--log-format=yaml"])
            .expect_err("no yaml");
        assert!(
            err.to_string()
                .contains("log format \"yaml\": expected text or json"),
            "{err}"
        );

        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("proxy.toml");
        std::fs::write(&file, "metrics_addr = \"off\"\nlog_format = \"json\"\n").expect("write");
        let config = Config::resolve(Cli {
            config: Some(file.clone()),
            ..Cli::default()
        })
        .expect("valid");
        assert_eq!(config.metrics_addr, None);
        assert_eq!(config.log_format, LogFormat::Json);

        std::fs::write(&file, "log_format = \"xml\"\n").expect("write");
        let err = Config::resolve(Cli {
            config: Some(file),
            ..Cli::default()
        })
        .expect_err("bad format in the file");
        assert!(err.to_string().contains("log format \"xml\""), "{err}");
    }

    #[test]
    fn flags_override_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("proxy.toml");
        std::fs::write(&file, "runtime_endpoint = \"unix:///x/c.sock\"\nmetrics_addr = \"127.0.0.1:9\"\nlisten = \"/a.sock\"\n")
            .expect("write");
        let cli = Cli {
            config: Some(file),
            listen: Some("/b.sock".into()),
            ..Cli::default()
        };
        let config = Config::resolve(cli).expect("valid");
        assert_eq!(config.listen, PathBuf::from("/b.sock"));
        assert_eq!(config.runtime_endpoint, PathBuf::from("/x/c.sock"));
        assert_eq!(
            config.metrics_addr,
            Some("127.0.0.1:9".parse().expect("addr"))
        );
    }

    #[test]
    fn bad_settings_are_named() {
        let err = Config::resolve(Cli {
            runtime_endpoint: Some("tcp://1.2.3.4:5".into()),
            ..Cli::default()
        })
        .expect_err("tcp refused");
        assert!(
            err.to_string().starts_with("setting runtime-endpoint:"),
            "{err}"
        );
        let err = Config::resolve(Cli {
            listen: Some("relative.sock".into()),
            ..Cli::default()
        })
        .expect_err("relative");
        assert!(err.to_string().starts_with("setting listen:"), "{err}");
        let err = Config::resolve(Cli {
            listen: Some(DEFAULT_RUNTIME_ENDPOINT.into()),
            ..Cli::default()
        })
        .expect_err("loop");
        assert!(err.to_string().contains("call itself"), "{err}");

        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("proxy.toml");
        std::fs::write(&file, "listn = \"/a.sock\"\n").expect("write");
        let err = Config::resolve(Cli {
            config: Some(file),
            ..Cli::default()
        })
        .expect_err("unknown key");
        assert!(err.to_string().contains("listn"), "{err}");
    }

    #[test]
    fn gpu_agent_trust_and_privileged_policy_come_from_the_file_or_flags() {
        let config = Config::resolve(Cli::default()).expect("valid");
        let gpu = config.gpu_hook.expect("embedded hook on").config();
        assert!(gpu.trusted_agents.is_empty(), "nothing trusted by default");
        assert_eq!(gpu.privileged, PrivilegedPolicy::RefuseGpu);

        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("proxy.toml");
        std::fs::write(
            &file,
            "trusted_gpu_agents = [\"gpu-operator\", \"kube-system:name=nvidia-device-plugin-ds\"]\nprivileged = \"refuse\"\n",
        )
        .expect("write");
        let config = Config::resolve(Cli {
            config: Some(file.clone()),
            ..Cli::default()
        })
        .expect("valid");
        let gpu = config.gpu_hook.expect("embedded hook on").config();
        let agents: Vec<String> = gpu.trusted_agents.iter().map(ToString::to_string).collect();
        assert_eq!(
            agents,
            ["gpu-operator", "kube-system:name=nvidia-device-plugin-ds"]
        );
        assert_eq!(gpu.privileged, PrivilegedPolicy::Refuse);

        // Flags win: the list is replaced, not merged.
        let cli = Cli::try_parse_from([
            "tessera-runtime-proxy",
            "--config",
            &file.to_string_lossy(),
            "--trusted-gpu-agents=nvidia-device-plugin,tessera-agents",
            "--privileged=allow",
        ])
        .expect("flags parse");
        let gpu = Config::resolve(cli)
            .expect("valid")
            .gpu_hook
            .expect("on")
            .config();
        let agents: Vec<String> = gpu.trusted_agents.iter().map(ToString::to_string).collect();
        assert_eq!(agents, ["nvidia-device-plugin", "tessera-agents"]);
        assert_eq!(gpu.privileged, PrivilegedPolicy::Allow);

        // A bad entry is named, in the file and as a flag.
        std::fs::write(&file, "trusted_gpu_agents = [\"GPU_Operator\"]\n").expect("write");
        let err = Config::resolve(Cli {
            config: Some(file),
            ..Cli::default()
        })
        .expect_err("bad namespace");
        assert!(
            err.to_string()
                .contains("namespace \"GPU_Operator\" is not a namespace name"),
            "{err}"
        );
        let err = Cli::try_parse_from([
            "tessera-runtime-proxy",
            "--trusted-gpu-agents=kube-system:app",
        ])
        .expect_err("label without value");
        assert!(err.to_string().contains("NAMESPACE:KEY=VALUE"), "{err}");
    }
}
