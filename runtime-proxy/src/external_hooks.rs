//! External hook servers, registered by files in a directory (default
//! `/etc/tessera/hooks.d/`) and picked up when the files change, without a restart.
//!
//! One file per hook, TOML:
//!
//! ```toml
//! name = "limits"                          # default: the file name without .toml
//! endpoint = "/run/tessera/hooks/limits.sock"  # unix socket (unix:// accepted)
//! stages = ["PreCreateContainer", "PostStartContainer"]
//! failure_policy = "Fail"                  # or "Ignore"; default Fail
//! timeout = "2s"                           # default 2s; "500ms" accepted
//! ```
//!
//! Hooks run in the order of their file names; their edits apply one after the
//! other, so the later hook wins on the same env key, and device nodes stay
//! unique by container path.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use serde::Deserialize;
use tessera_hook_protocol::hook::v1::hook_client::HookClient;
use tonic::Code;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::convert;
use crate::hook::{CallOutcome, Hook, HookContext, HookRejection, LifecycleRequest, Method};

/// Default time a hook server has to answer.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);

/// What to do when a hook server fails, times out or is down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub enum FailurePolicy {
    /// Refuse the call: kubelet gets an error naming the hook and the cause.
    #[default]
    Fail,
    /// Log and forward the call as if the hook were not there.
    Ignore,
}

/// Pre or Post.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StageKind {
    /// Before the runtime sees the call.
    Pre,
    /// After the runtime answered.
    Post,
}

/// Why a registration file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum RegistrationError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file is not TOML of the expected shape.
    #[error("{path}: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: Box<toml::de::Error>,
    },
    /// A field holds a value that cannot be used.
    #[error("{path}: {field}: {problem}")]
    Invalid {
        path: PathBuf,
        field: &'static str,
        problem: String,
    },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RegistrationFile {
    name: Option<String>,
    endpoint: String,
    stages: Vec<String>,
    #[serde(default)]
    failure_policy: FailurePolicy,
    timeout: Option<String>,
}

/// One registered hook server.
#[derive(Debug)]
pub struct ExternalHook {
    /// Its name, for messages and metrics.
    pub name: String,
    /// The file that registered it.
    pub file: PathBuf,
    /// Its socket.
    pub endpoint: PathBuf,
    /// The stages it runs at.
    pub stages: HashSet<(StageKind, Method)>,
    /// What a failure does.
    pub policy: FailurePolicy,
    /// How long it may take.
    pub timeout: Duration,
    client: HookClient<Channel>,
}

fn parse_stage(text: &str) -> Option<(StageKind, Method)> {
    let (kind, method) = if let Some(rest) = text.strip_prefix("Pre") {
        (StageKind::Pre, rest)
    } else {
        (StageKind::Post, text.strip_prefix("Post")?)
    };
    Method::ALL
        .iter()
        .copied()
        .find(|m| m.name() == method)
        .map(|m| (kind, m))
}

/// A lazily connecting channel to a unix socket; it redials after failures.
fn unix_channel(path: PathBuf) -> Channel {
    Endpoint::from_static("http://tessera-hook").connect_with_connector_lazy(tower::service_fn(
        move |_: Uri| {
            let path = path.clone();
            async move { crate::backend::connect_unix(&path).await }
        },
    ))
}

impl ExternalHook {
    /// Reads one registration file.
    pub fn load(path: &Path) -> Result<Self, RegistrationError> {
        let text = std::fs::read_to_string(path).map_err(|source| RegistrationError::Read {
            path: path.into(),
            source,
        })?;
        let file: RegistrationFile =
            toml::from_str(&text).map_err(|source| RegistrationError::Parse {
                path: path.into(),
                source: Box::new(source),
            })?;
        let invalid = |field, problem: String| RegistrationError::Invalid {
            path: path.into(),
            field,
            problem,
        };
        let endpoint = PathBuf::from(
            file.endpoint
                .strip_prefix("unix://")
                .unwrap_or(&file.endpoint),
        );
        if !endpoint.is_absolute() {
            return Err(invalid(
                "endpoint",
                format!("{:?}: expected an absolute unix socket path", file.endpoint),
            ));
        }
        let mut stages = HashSet::new();
        for stage in &file.stages {
            let parsed = parse_stage(stage).ok_or_else(|| {
                invalid(
                    "stages",
                    format!(
                        "unknown stage {stage:?}; expected Pre or Post followed by one of {}",
                        method_names()
                    ),
                )
            })?;
            stages.insert(parsed);
        }
        if stages.is_empty() {
            return Err(invalid("stages", "empty: the hook would never run".into()));
        }
        let timeout = match &file.timeout {
            None => DEFAULT_TIMEOUT,
            Some(text) => match tessera_daemon::binary::parse_duration(text) {
                Ok(timeout) if !timeout.is_zero() => timeout,
                Ok(_) => return Err(invalid("timeout", format!("{text:?}: must be above zero"))),
                Err(error) => return Err(invalid("timeout", error.to_string())),
            },
        };
        let name = file.name.unwrap_or_else(|| {
            path.file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default()
        });
        Ok(Self {
            name,
            file: path.into(),
            client: HookClient::new(unix_channel(endpoint.clone())),
            endpoint,
            stages,
            policy: file.failure_policy,
            timeout,
        })
    }

    fn runs_at(&self, kind: StageKind, method: Method) -> bool {
        self.stages.contains(&(kind, method))
    }

    fn describe(&self) -> String {
        format!("hook {:?} ({})", self.name, self.file.display())
    }

    /// Runs the Pre stage: the edits are applied to `request`.
    async fn pre(
        &self,
        ctx: &HookContext,
        request: &mut LifecycleRequest,
    ) -> Result<(), (Code, String)> {
        let mut client = self.client.clone();
        let method = request.method();
        let call = async {
            if convert::is_sandbox_method(method) {
                let view = convert::sandbox_request(ctx, request);
                let edit = client.pre_pod_sandbox(view).await?.into_inner();
                convert::apply_sandbox_edit(request, &edit);
            } else {
                let view = convert::container_request(ctx, request);
                let edit = client.pre_container(view).await?.into_inner();
                convert::apply_container_edit(request, &edit);
            }
            Ok::<_, tonic::Status>(())
        };
        self.bounded(call).await
    }

    async fn post(
        &self,
        ctx: &HookContext,
        request: &LifecycleRequest,
        outcome: &CallOutcome,
    ) -> Result<(), (Code, String)> {
        let mut client = self.client.clone();
        let call = async {
            if convert::is_sandbox_method(request.method()) {
                let mut view = convert::sandbox_request(ctx, request);
                view.outcome = Some(convert::outcome(outcome));
                client.post_pod_sandbox(view).await?;
            } else {
                let mut view = convert::container_request(ctx, request);
                view.outcome = Some(convert::outcome(outcome));
                client.post_container(view).await?;
            }
            Ok::<_, tonic::Status>(())
        };
        self.bounded(call).await
    }

    async fn bounded(
        &self,
        call: impl Future<Output = Result<(), tonic::Status>>,
    ) -> Result<(), (Code, String)> {
        match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(status)) if status.code() == Code::Unavailable => Err((
                Code::Unavailable,
                format!(
                    "{} at {} is unavailable: {}",
                    self.describe(),
                    self.endpoint.display(),
                    status.message()
                ),
            )),
            Ok(Err(status)) => Err((
                status.code(),
                format!("{} refused: {}", self.describe(), status.message()),
            )),
            Err(_) => Err((
                Code::DeadlineExceeded,
                format!("{} timed out after {:?}", self.describe(), self.timeout),
            )),
        }
    }
}

fn method_names() -> String {
    Method::ALL
        .iter()
        .map(|m| m.name())
        .collect::<Vec<_>>()
        .join(", ")
}

type Signature = BTreeMap<PathBuf, (Option<SystemTime>, u64)>;

/// The hooks registered in a directory, reloaded when its files change.
#[derive(Debug)]
pub struct HookRegistry {
    dir: PathBuf,
    // Swapped whole on reload; read by cloning the Arc, never held across an await.
    hooks: RwLock<Arc<Vec<Arc<ExternalHook>>>>,
    seen: Mutex<Signature>,
}

impl HookRegistry {
    /// A registry of `dir`, loaded once now.
    pub fn new(dir: impl Into<PathBuf>) -> Arc<Self> {
        let registry = Arc::new(Self {
            dir: dir.into(),
            hooks: RwLock::default(),
            seen: Mutex::default(),
        });
        registry.reload_if_changed();
        registry
    }

    /// The directory of registrations.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The hooks now registered, in order.
    pub fn hooks(&self) -> Arc<Vec<Arc<ExternalHook>>> {
        Arc::clone(
            &self
                .hooks
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    fn signature(&self) -> Signature {
        std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|entry| entry.path())
            .filter(|path| path.extension().is_some_and(|ext| ext == "toml"))
            .map(|path| {
                let meta = std::fs::metadata(&path).ok();
                let stamp = (
                    meta.as_ref().and_then(|m| m.modified().ok()),
                    meta.map_or(0, |m| m.len()),
                );
                (path, stamp)
            })
            .collect()
    }

    /// Reloads when a file was added, removed or changed. A file that does not
    /// load keeps its previous registration, if any, and is logged.
    pub fn reload_if_changed(&self) -> bool {
        let signature = self.signature();
        {
            let mut seen = tessera_daemon::sync::lock(&self.seen);
            if *seen == signature && !signature.is_empty() {
                return false;
            }
            seen.clone_from(&signature);
        }
        let previous = self.hooks();
        let mut hooks = Vec::new();
        for path in signature.keys() {
            match ExternalHook::load(path) {
                Ok(hook) => {
                    tracing::info!(hook = %hook.name, file = %path.display(), endpoint = %hook.endpoint.display(), policy = ?hook.policy, "hook registered");
                    hooks.push(Arc::new(hook));
                }
                Err(error) => {
                    let kept = previous.iter().find(|h| &h.file == path);
                    tracing::error!(%error, kept_previous = kept.is_some(), "hook registration not loaded");
                    hooks.extend(kept.cloned());
                }
            }
        }
        *self
            .hooks
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(hooks);
        true
    }

    /// Polls the directory every `interval`, reloading on change.
    pub fn watch(self: &Arc<Self>, interval: Duration) -> tokio::task::JoinHandle<()> {
        let registry = Arc::clone(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(interval).await;
                let registry = Arc::clone(&registry);
                // Directory reads are blocking I/O: off the async threads.
                let _ = tokio::task::spawn_blocking(move || registry.reload_if_changed()).await;
            }
        })
    }
}

#[async_trait]
impl Hook for HookRegistry {
    fn name(&self) -> &str {
        "hooks.d"
    }

    async fn pre(
        &self,
        ctx: &HookContext,
        request: &mut LifecycleRequest,
    ) -> Result<(), HookRejection> {
        let method = request.method();
        for hook in self
            .hooks()
            .iter()
            .filter(|h| h.runs_at(StageKind::Pre, method))
        {
            if let Err((code, message)) = hook.pre(ctx, request).await {
                match hook.policy {
                    FailurePolicy::Fail => return Err(HookRejection::new(code, message)),
                    FailurePolicy::Ignore => {
                        tracing::warn!(hook = %hook.name, reason = %message, "hook failed; ignored by its policy")
                    }
                }
            }
        }
        Ok(())
    }

    async fn post(&self, ctx: &HookContext, request: &LifecycleRequest, outcome: &CallOutcome) {
        let method = request.method();
        for hook in self
            .hooks()
            .iter()
            .filter(|h| h.runs_at(StageKind::Post, method))
        {
            if let Err((_, message)) = hook.post(ctx, request, outcome).await {
                tracing::warn!(hook = %hook.name, reason = %message, "post hook failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, text).expect("write");
        path
    }

    #[test]
    fn stages_and_durations() {
        assert_eq!(
            parse_stage("PreCreateContainer"),
            Some((StageKind::Pre, Method::CreateContainer))
        );
        assert_eq!(
            parse_stage("PostRemovePodSandbox"),
            Some((StageKind::Post, Method::RemovePodSandbox))
        );
        assert_eq!(parse_stage("PreVersion"), None);
        assert_eq!(parse_stage("CreateContainer"), None);
    }

    #[tokio::test]
    async fn registration_errors_name_file_and_field() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cases = [
            (
                "a.toml",
                "endpoint = \"/x.sock\"\nstages = [\"PreVersion\"]\n",
                "stages: unknown stage \"PreVersion\"",
            ),
            (
                "b.toml",
                "endpoint = \"x.sock\"\nstages = [\"PreCreateContainer\"]\n",
                "endpoint: \"x.sock\"",
            ),
            (
                "c.toml",
                "endpoint = \"/x.sock\"\nstages = [\"PreCreateContainer\"]\ntimeout = \"soon\"\n",
                "timeout: invalid duration \"soon\"",
            ),
            (
                "z.toml",
                "endpoint = \"/x.sock\"\nstages = [\"PreCreateContainer\"]\ntimeout = \"0s\"\n",
                "timeout: \"0s\": must be above zero",
            ),
            (
                "d.toml",
                "endpoint = \"/x.sock\"\nstages = []\n",
                "stages: empty",
            ),
            (
                "e.toml",
                "endpoint = \"/x.sock\"\nstages = [\"PreCreateContainer\"]\nfailure_policy = \"Maybe\"\n",
                "Maybe",
            ),
        ];
        for (name, text, expected) in cases {
            let path = write(dir.path(), name, text);
            let error = ExternalHook::load(&path).expect_err(name).to_string();
            assert!(error.starts_with(&path.display().to_string()), "{error}");
            assert!(error.contains(expected), "{name}: {error}");
        }
    }

    #[tokio::test]
    async fn reload_picks_up_changes_in_file_order_and_keeps_last_good() {
        let dir = tempfile::tempdir().expect("tempdir");
        let registry = HookRegistry::new(dir.path());
        assert!(registry.hooks().is_empty());
        write(
            dir.path(),
            "20-b.toml",
            "endpoint = \"/b.sock\"\nstages = [\"PreCreateContainer\"]\n",
        );
        write(
            dir.path(),
            "10-a.toml",
            "name = \"first\"\nendpoint = \"unix:///a.sock\"\nstages = [\"PostStartContainer\"]\nfailure_policy = \"Ignore\"\ntimeout = \"300ms\"\n",
        );
        write(dir.path(), "README", "not a registration");
        assert!(registry.reload_if_changed());
        let hooks = registry.hooks();
        let names: Vec<&str> = hooks.iter().map(|h| h.name.as_str()).collect();
        assert_eq!(names, ["first", "20-b"]);
        assert_eq!(hooks[0].endpoint, PathBuf::from("/a.sock"));
        assert_eq!(
            (hooks[0].policy, hooks[0].timeout),
            (FailurePolicy::Ignore, Duration::from_millis(300))
        );
        assert_eq!(hooks[1].timeout, DEFAULT_TIMEOUT);
        assert!(!registry.reload_if_changed(), "nothing changed");

        // A broken edit keeps the last good registration.
        write(dir.path(), "20-b.toml", "endpoint = \n");
        assert!(registry.reload_if_changed());
        assert_eq!(registry.hooks().len(), 2);
        std::fs::remove_file(dir.path().join("10-a.toml")).expect("rm");
        assert!(registry.reload_if_changed());
        assert_eq!(
            registry
                .hooks()
                .iter()
                .map(|h| h.name.as_str())
                .collect::<Vec<_>>(),
            ["20-b"]
        );
    }
}
