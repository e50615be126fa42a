//! A fake MPS v3 control daemon: the commands Tessera sends, with the semantics
//! NVIDIA's MPS v3 documentation gives them, and the pipe directory's layout.
//!
//! - [`FakeMps::execute`] runs one command (`server create|delete|get|list`,
//!   `namespace create|set|get|delete|list`; a leading `-p 3` is ignored) and
//!   answers its output or its error, as the real control program prints them.
//! - With a pipe directory, servers and namespaces get their directories and a
//!   listening `control` socket in each (`<pipe>/<server>/<namespace>/control`),
//!   as a client would find them; without one (unit tests) they live in memory.
//! - Names are `[a-z0-9_]`, at most 64 characters; a namespace's limits are one
//!   pinned-memory value and one active-thread percentage; a new namespace has
//!   none (MPS: "a namespace that sets no limits gets the whole GPU"), which
//!   `namespace get` prints as `-`.
//! - Multi-user mode: `server create` takes only `--uid=0`.
//!
//! The binary `fake-mps-control` is the daemon (`-f`, with `-a` config) and the
//! client (anything else), talking over `<pipe>/control`.

use std::collections::BTreeMap;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};

/// One namespace.
#[derive(Debug, Default)]
pub struct Namespace {
    /// Pinned device memory limit, bytes.
    pub pinned_memory: Option<u64>,
    /// Active thread percentage.
    pub thread_percentage: Option<f64>,
    // Held so the socket keeps listening while the entry lives.
    _socket: Option<UnixListener>,
}

/// One server.
#[derive(Debug, Default)]
pub struct Server {
    /// Owner.
    pub uid: u32,
    /// `--allowed-devices`.
    pub allowed_devices: String,
    /// Its namespaces, by name.
    pub namespaces: BTreeMap<String, Namespace>,
    // Held so the socket keeps listening while the entry lives.
    _socket: Option<UnixListener>,
}

/// The daemon's state.
#[derive(Debug, Default)]
pub struct FakeMps {
    /// Servers, by name.
    pub servers: BTreeMap<String, Server>,
    /// Where the sockets go; `None`: in memory only.
    pub pipe_dir: Option<PathBuf>,
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

/// A size as MPS takes it (`20G`, `512M`, `1024K`), in bytes.
pub fn parse_size(text: &str) -> Option<u64> {
    let (number, shift) = match text.chars().last()? {
        'K' => (&text[..text.len() - 1], 10),
        'M' => (&text[..text.len() - 1], 20),
        'G' => (&text[..text.len() - 1], 30),
        'T' => (&text[..text.len() - 1], 40),
        _ => (text, 0),
    };
    number.parse::<u64>().ok()?.checked_mul(1 << shift)
}

/// A size as MPS prints it: the largest unit it divides into.
pub fn format_size(bytes: u64) -> String {
    for (unit, shift) in [("T", 40), ("G", 30), ("M", 20), ("K", 10)] {
        if bytes != 0 && bytes % (1u64 << shift) == 0 {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// A listening socket at `dir/control`, made with its directory.
fn bind(dir: &Path) -> Result<UnixListener, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join("control");
    let _ = std::fs::remove_file(&path);
    UnixListener::bind(&path).map_err(|e| format!("{}: {e}", path.display()))
}

/// The command's `--key=value` options and its positional words.
fn split(args: &[String]) -> (Vec<&str>, BTreeMap<&str, &str>) {
    let mut words = Vec::new();
    let mut options = BTreeMap::new();
    for arg in args {
        match arg.strip_prefix("--") {
            Some(option) => {
                let (key, value) = option.split_once('=').unwrap_or((option, ""));
                options.insert(key, value);
            }
            None => words.push(arg.as_str()),
        }
    }
    (words, options)
}

impl FakeMps {
    /// A daemon whose sockets go under `pipe_dir`.
    pub fn with_pipe_dir(pipe_dir: &Path) -> Self {
        Self {
            pipe_dir: Some(pipe_dir.to_owned()),
            ..Self::default()
        }
    }

    /// Applies a startup configuration (`-a`): MPS v3's TOML, its servers
    /// (`allowed_devices`, `uid`) and their namespaces' limits.
    pub fn apply_config(&mut self, text: &str) -> Result<(), String> {
        let config: toml::Table = text.parse().map_err(|e| format!("config: {e}"))?;
        if config.get("schema_version").and_then(toml::Value::as_str) != Some("1.0") {
            return Err("config: schema_version must be \"1.0\"".into());
        }
        let Some(servers) = config.get("servers").and_then(toml::Value::as_table) else {
            return Ok(());
        };
        for (name, server) in servers {
            let field = |key: &str| server.get(key).and_then(toml::Value::as_str);
            let uid = server
                .get("uid")
                .and_then(toml::Value::as_integer)
                .unwrap_or(0);
            self.execute(&[
                "server".into(),
                "create".into(),
                name.clone(),
                format!("--uid={uid}"),
                format!(
                    "--allowed-devices={}",
                    field("allowed_devices").unwrap_or("")
                ),
            ])?;
            let namespaces = server.get("namespaces").and_then(toml::Value::as_table);
            for (ns, limits) in namespaces.into_iter().flatten() {
                self.execute(&[
                    "namespace".into(),
                    "create".into(),
                    ns.clone(),
                    format!("--server={name}"),
                ])?;
                let mut set = vec![
                    "namespace".into(),
                    "set".into(),
                    ns.clone(),
                    format!("--server={name}"),
                ];
                for (key, flag) in [
                    ("pinned_memory_limit", "--pinned-memory-limit"),
                    ("active_thread_percentage", "--active-thread-percentage"),
                ] {
                    if let Some(value) = limits.get(key).and_then(toml::Value::as_str) {
                        set.push(format!("{flag}={value}"));
                    }
                }
                self.execute(&set)?;
            }
        }
        Ok(())
    }

    /// Runs one command; its output, or its error message.
    pub fn execute(&mut self, args: &[String]) -> Result<String, String> {
        let args: Vec<String> = match args {
            [p, v, rest @ ..] if p == "-p" && v == "3" => rest.to_vec(),
            _ => args.to_vec(),
        };
        let (words, options) = split(&args);
        match words.as_slice() {
            ["server", "create", name] => self.server_create(name, &options),
            ["server", "delete", name] => {
                let server = self
                    .servers
                    .get(*name)
                    .ok_or_else(|| format!("Server {name} not found"))?;
                if !server.namespaces.is_empty() && !options.contains_key("force") {
                    return Err(format!("Server {name} has namespaces; use --force"));
                }
                self.servers.remove(*name);
                self.remove_dir(&[name]);
                Ok(String::new())
            }
            ["server", "get", name, field] => {
                let server = self
                    .servers
                    .get(*name)
                    .ok_or_else(|| format!("Server {name} not found"))?;
                match *field {
                    "name" => Ok((*name).to_owned()),
                    "uid" => Ok(server.uid.to_string()),
                    "status" => Ok("Ready".into()),
                    "pid" => Ok(std::process::id().to_string()),
                    "allowed-devices" => Ok(server.allowed_devices.clone()),
                    "pipe-directory" => Ok(self.dir(&[name]).display().to_string()),
                    other => Err(format!("Unknown field {other}")),
                }
            }
            ["server", "list", ..] => Ok(self
                .servers
                .iter()
                .map(|(name, s)| {
                    format!(
                        "{name},{},{},Ready,{},{},-",
                        s.uid,
                        std::process::id(),
                        self.dir(&[name]).display(),
                        s.allowed_devices
                    )
                })
                .collect::<Vec<_>>()
                .join("\n")),
            ["namespace", "create", name] => {
                if !valid_name(name) {
                    return Err(format!(
                        "Invalid namespace name {name}: lowercase letters, digits and underscores, at most 64 characters"
                    ));
                }
                let server_name = self.server_option(&options)?;
                if self
                    .server_mut(&server_name)?
                    .namespaces
                    .contains_key(*name)
                {
                    return Err(format!("Namespace {name} already exists"));
                }
                let socket = self.bind(&[&server_name, name])?;
                let server = self.server_mut(&server_name)?;
                server.namespaces.insert(
                    (*name).to_owned(),
                    Namespace {
                        _socket: socket,
                        ..Namespace::default()
                    },
                );
                Ok(String::new())
            }
            ["namespace", "set", name] => {
                let server_name = self.server_option(&options)?;
                let memory = match options.get("pinned-memory-limit") {
                    Some(text) => {
                        Some(parse_size(text).ok_or_else(|| format!("Invalid limit {text}"))?)
                    }
                    None => None,
                };
                let percent = match options.get("active-thread-percentage") {
                    Some(text) => Some(
                        text.parse::<f64>()
                            .ok()
                            .filter(|p| (1.0..=100.0).contains(p))
                            .ok_or_else(|| format!("Invalid percentage {text}"))?,
                    ),
                    None => None,
                };
                if memory.is_none() && percent.is_none() {
                    return Err("At least one option is required".into());
                }
                let ns = self.namespace_mut(&server_name, name)?;
                ns.pinned_memory = memory.or(ns.pinned_memory);
                ns.thread_percentage = percent.or(ns.thread_percentage);
                Ok(String::new())
            }
            ["namespace", "get", name, server, field] => {
                let dir = self.dir(&[server, name]);
                let ns = self.namespace_mut(server, name)?;
                match *field {
                    "name" => Ok((*name).to_owned()),
                    "server" => Ok((*server).to_owned()),
                    "server-status" => Ok("Ready".into()),
                    "pinned-memory-limit" => Ok(ns.pinned_memory.map_or("-".into(), format_size)),
                    "active-thread-percentage" => Ok(ns
                        .thread_percentage
                        .map_or("-".into(), |p| format!("{p:.2}"))),
                    "client-priority" => Ok("0".into()),
                    "pipe-directory" => Ok(dir.display().to_string()),
                    other => Err(format!("Unknown field {other}")),
                }
            }
            ["namespace", "delete", name] => {
                let server_name = self.server_option(&options)?;
                let server = self.server_mut(&server_name)?;
                server
                    .namespaces
                    .remove(*name)
                    .ok_or_else(|| format!("Namespace {name} not found"))?;
                self.remove_dir(&[&server_name, name]);
                Ok(String::new())
            }
            ["namespace", "list", ..] => Ok(self
                .servers
                .iter()
                .flat_map(|(server, s)| {
                    s.namespaces.iter().map(move |(name, ns)| {
                        format!(
                            "{name},{server},Ready,{},{},0",
                            ns.pinned_memory.map_or("-".into(), format_size),
                            ns.thread_percentage
                                .map_or("-".into(), |p| format!("{p:.2}"))
                        )
                    })
                })
                .collect::<Vec<_>>()
                .join("\n")),
            _ => Err(format!("Unknown command: {}", args.join(" "))),
        }
    }

    fn server_create(
        &mut self,
        name: &str,
        options: &BTreeMap<&str, &str>,
    ) -> Result<String, String> {
        if !valid_name(name) {
            return Err(format!("Invalid server name {name}"));
        }
        if self.servers.contains_key(name) {
            return Err(format!("Server {name} already exists"));
        }
        let uid = options.get("uid").copied().unwrap_or("0");
        if uid != "0" {
            return Err(format!(
                "Multiuser mode: only --uid=0 is allowed (got --uid={uid})"
            ));
        }
        let socket = self.bind(&[name])?;
        self.servers.insert(
            name.to_owned(),
            Server {
                uid: 0,
                allowed_devices: options.get("allowed-devices").unwrap_or(&"").to_string(),
                namespaces: BTreeMap::new(),
                _socket: socket,
            },
        );
        Ok(String::new())
    }

    fn server_option(&self, options: &BTreeMap<&str, &str>) -> Result<String, String> {
        options
            .get("server")
            .map(|s| (*s).to_owned())
            .ok_or_else(|| "--server=<name> is required".to_owned())
    }

    fn server_mut(&mut self, name: &str) -> Result<&mut Server, String> {
        self.servers
            .get_mut(name)
            .ok_or_else(|| format!("Server {name} not found"))
    }

    fn namespace_mut(&mut self, server: &str, name: &str) -> Result<&mut Namespace, String> {
        self.server_mut(server)?
            .namespaces
            .get_mut(name)
            .ok_or_else(|| format!("Namespace {name} not found on server {server}"))
    }

    fn dir(&self, parts: &[&str]) -> PathBuf {
        let mut dir = self
            .pipe_dir
            .clone()
            .unwrap_or_else(|| "/run/nvidia-mps".into());
        dir.extend(parts);
        dir
    }

    fn bind(&self, parts: &[&str]) -> Result<Option<UnixListener>, String> {
        match &self.pipe_dir {
            Some(_) => bind(&self.dir(parts)).map(Some),
            None => Ok(None),
        }
    }

    fn remove_dir(&self, parts: &[&str]) {
        if self.pipe_dir.is_some() {
            let _ = std::fs::remove_dir_all(self.dir(parts));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(mps: &mut FakeMps, line: &str) -> Result<String, String> {
        let args: Vec<String> = line.split_whitespace().map(str::to_owned).collect();
        mps.execute(&args)
    }

    #[test]
    fn namespaces_hold_what_is_set() -> Result<(), String> {
        let mut mps = FakeMps::default();
        run(
            &mut mps,
            "-p 3 server create gpu_0 --uid=0 --allowed-devices=GPU-a",
        )?;
        assert!(run(&mut mps, "server create gpu_1 --uid=1000").is_err());
        run(&mut mps, "namespace create ab_12 --server=gpu_0")?;
        assert_eq!(
            run(&mut mps, "namespace get ab_12 gpu_0 pinned-memory-limit")?,
            "-"
        );
        run(
            &mut mps,
            "namespace set ab_12 --server=gpu_0 --pinned-memory-limit=20480M --active-thread-percentage=25",
        )?;
        assert_eq!(
            run(&mut mps, "namespace get ab_12 gpu_0 pinned-memory-limit")?,
            "20G"
        );
        assert_eq!(
            run(
                &mut mps,
                "namespace get ab_12 gpu_0 active-thread-percentage"
            )?,
            "25.00"
        );
        assert!(run(&mut mps, "namespace create Bad-Name --server=gpu_0").is_err());
        assert!(run(&mut mps, "namespace create ab_12 --server=gpu_0").is_err());
        assert!(run(&mut mps, "server delete gpu_0").is_err());
        run(&mut mps, "namespace delete ab_12 --server=gpu_0 --force")?;
        run(&mut mps, "server delete gpu_0")?;
        assert!(run(&mut mps, "server get gpu_0 status").is_err());
        Ok(())
    }

    #[test]
    fn a_config_brings_servers_and_namespaces_back() -> Result<(), String> {
        let mut mps = FakeMps::default();
        mps.apply_config(
            "schema_version = \"1.0\"\n[servers.gpu_1]\nallowed_devices = \"GPU-b\"\nuid = 0\n[servers.gpu_1.namespaces.x_1]\npinned_memory_limit = \"512M\"\nactive_thread_percentage = \"30\"\n",
        )?;
        assert_eq!(
            run(&mut mps, "namespace get x_1 gpu_1 pinned-memory-limit")?,
            "512M"
        );
        assert_eq!(run(&mut mps, "server get gpu_1 allowed-devices")?, "GPU-b");
        Ok(())
    }
}
