//! What holds a shared container to its share, as edits to the container
//! (HAMi-core's files) and as the limits the node agent sets on its cgroup (the
//! driver's). Pure: the host files are named by [`HamiCoreFiles`], created by
//! [`prepare_host`]. `docs/enforcement.md` has the threat model.
//!
//! A container is *shared* when one of its GPUs is granted in part
//! ([`DeviceAllocation::is_fractional`]); a whole-GPU grant needs no limiter.

use std::path::{Path, PathBuf};

use tessera_api::DeviceAllocations;
use tessera_api::resources::ENFORCEMENT;
use tessera_enforce::{Backend, MemoryLimit};
use tessera_enforce::{cdi, hami, mps};
use tessera_hook_protocol::hook::v1::{
    CdiDevice, ContainerHookRequest, ContainerHookResponse, Mount,
};

use super::{GpuHookError, NodeDevices, ResolvedGpu, kv, resolve_gpus};

/// Where HAMi-core's library is in a shared container: HAMi's own path, so an
/// image built for HAMi finds it where it looks.
pub const HAMI_LIBRARY: &str = "/usr/local/vgpu/libvgpu.so";
/// The loader's preload list: read by every dynamically linked process, whatever
/// its env (`env -i` included), unlike `LD_PRELOAD`, which stays the user's.
pub const LD_SO_PRELOAD: &str = "/etc/ld.so.preload";
/// HAMi-core's node-wide lock directory, in the container, as HAMi mounts it.
pub const HAMI_LOCK_DIR: &str = "/tmp/vgpulock";
/// The container's own HAMi-core shared region (its limits and usage): HAMi-core's
/// default path, so a process started without `CUDA_DEVICE_MEMORY_SHARED_CACHE`
/// (`env -i`) maps the same region as the rest of the container. A bind-mounted
/// file: the tenant can neither replace nor remove it (a mount point).
pub const HAMI_CACHE_FILE: &str = "/tmp/cudevshr.cache";
/// HAMi-core's shared region: its limits and usage, per container.
pub const HAMI_CACHE_ENV: &str = "CUDA_DEVICE_MEMORY_SHARED_CACHE";
/// Env with which a process asks HAMi-core to stand down; never the tenant's to set.
pub const HAMI_DISABLE_ENV: &str = "CUDA_DISABLE_CONTROL";
/// Env naming the backends that hold the container's share (`driver-memory+hami-core`,
/// or `none`): for the application and for whoever reads the OCI spec. The same
/// value is in the container's `tessera.io/enforcement` annotation (CRI status).
pub const ENFORCEMENT_ENV: &str = "TESSERA_ENFORCEMENT";
/// Env keys HAMi-core reads that only the hook may set.
const HAMI_CONTROLLED_ENV: &[&str] = &[
    HAMI_CACHE_ENV,
    HAMI_DISABLE_ENV,
    "CUDA_OVERSUBSCRIBE",
    "GPU_CORE_UTILIZATION_POLICY",
    "CUDA_TASK_PRIORITY",
];

/// HAMi-core's files on the host, when the operator supplied `libvgpu.so`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HamiCoreFiles {
    /// `libvgpu.so`, mounted read-only at [`HAMI_LIBRARY`].
    pub library: PathBuf,
    /// A file naming [`HAMI_LIBRARY`], mounted read-only at [`LD_SO_PRELOAD`].
    pub preload: PathBuf,
    /// The node-wide lock directory, mounted at [`HAMI_LOCK_DIR`].
    pub lock_dir: PathBuf,
    /// Per-container directories (`<pod UID>/<container>`), whose region file is
    /// mounted at [`HAMI_CACHE_FILE`].
    pub cache_root: PathBuf,
    /// The `tessera-enforce` binary, whose `hami-prime` has HAMi-core write each
    /// new region with the grant before the container's first process runs.
    pub primer: PathBuf,
}

impl HamiCoreFiles {
    /// The files under `dir` for the library at `library`: `dir/ld.so.preload`,
    /// `dir/lock`, `dir/containers`; regions written through `primer`.
    pub fn under(dir: &Path, library: &Path, primer: &Path) -> Self {
        Self {
            library: library.to_owned(),
            preload: dir.join("ld.so.preload"),
            lock_dir: dir.join("lock"),
            cache_root: dir.join("containers"),
            primer: primer.to_owned(),
        }
    }

    /// Writes the preload list and makes the directories. The library and the
    /// primer must exist.
    pub fn install(&self) -> std::io::Result<()> {
        for (what, path) in [
            ("HAMi-core library", &self.library),
            ("tessera-enforce binary (--enforce-binary)", &self.primer),
        ] {
            if !path.is_file() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("{what} {} is not a file", path.display()),
                ));
            }
        }
        if let Some(parent) = self.preload.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(&self.preload, format!("{HAMI_LIBRARY}\n"))?;
        // Read by every process of every shared container, whatever its user;
        // written by none of them (the mount is read-only too).
        set_mode(&self.preload, 0o644)?;
        std::fs::create_dir_all(&self.lock_dir)?;
        // Shared by every shared container: sticky, so one tenant cannot remove
        // another's lock files.
        set_mode(&self.lock_dir, 0o1777)?;
        std::fs::create_dir_all(&self.cache_root)?;
        set_mode(&self.cache_root, 0o711)
    }

    /// The container's own region file on the host.
    fn cache_file(&self, pod_uid: &str, container: &str) -> PathBuf {
        self.cache_root
            .join(pod_uid)
            .join(container)
            .join("cudevshr.cache")
    }
}

/// Sets a path's mode whatever the process umask (the proxy's unit has 0077).
fn set_mode(path: &Path, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

/// The node's enforcement: which backends hold shared containers here.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Enforcement {
    /// The driver's per-cgroup memory limits, set by the runtime proxy at
    /// StartContainer (the hook only names them on the container).
    pub driver_memory: bool,
    /// MPS v3: each shared container gets its own namespace of its GPU's server,
    /// made by the runtime proxy at CreateContainer.
    pub mps: Option<MpsFiles>,
    /// GPU time: the runtime proxy freezes each shared container's cgroup while
    /// it has used more than its compute share of its GPUs.
    pub gpu_time: bool,
    /// The GPU memory OOM kill: the runtime proxy kills a shared container's
    /// largest processes on a GPU while they hold more than its grant there plus
    /// the node's margin, as the driver counts them.
    pub oom_kill: bool,
    /// HAMi-core, preloaded from these host files.
    pub hami_core: Option<HamiCoreFiles>,
}

/// Where the node's MPS daemon is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsFiles {
    /// Its pipe directory, under which each namespace has its own
    /// (`<pipe>/gpu_<minor>/<namespace>`).
    pub pipe_dir: PathBuf,
}

impl Enforcement {
    /// The backends, strongest first.
    pub fn backends(&self) -> Vec<Backend> {
        let mut backends = Vec::new();
        if self.driver_memory {
            backends.push(Backend::DriverMemory);
        }
        if self.mps.is_some() {
            backends.push(Backend::Mps);
        }
        if self.gpu_time {
            backends.push(Backend::GpuTime);
        }
        if self.oom_kill {
            backends.push(Backend::OomKill);
        }
        if self.hami_core.is_some() {
            backends.push(Backend::HamiCore);
        }
        backends
    }
}

/// A name safe as one path component: kubelet's pod UID and container name are,
/// but the hook does not build host paths from anything it has not checked.
fn path_component(value: &str) -> bool {
    !value.is_empty()
        && value != "."
        && value != ".."
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

/// The edits that hold a shared container to its share: the enforcement
/// annotation and, with HAMi-core, its preload, library, lock and cache mounts.
/// Returns (path, problem) for a pod UID or container name unfit for a host path.
pub(super) fn shared_edits(
    container: &ContainerHookRequest,
    gpus: &[ResolvedGpu<'_>],
    enforcement: &Enforcement,
    edit: &mut ContainerHookResponse,
) -> Result<(), (String, String)> {
    if !gpus.iter().any(|g| g.allocation.is_fractional()) {
        return Ok(());
    }
    let backends = tessera_enforce::joined(&enforcement.backends());
    edit.set_envs.push(kv(ENFORCEMENT_ENV, backends.clone()));
    edit.set_annotations
        .insert(ENFORCEMENT.to_owned(), backends);
    // Set by the tenant, these would turn HAMi-core off or point it at a region of
    // the tenant's choosing: removed whether or not HAMi-core is on.
    super::remove_envs_where(container, edit, |key| HAMI_CONTROLLED_ENV.contains(&key));
    // Only the device the runtime proxy wrote for this container runs the hook:
    // one named in the request is the tenant's, and goes.
    edit.remove_cdi_devices.extend(
        container
            .cdi_devices
            .iter()
            .filter(|c| c.name.starts_with(cdi::KIND))
            .map(|c| c.name.clone()),
    );
    let uid = container.pod.as_ref().map_or("", |p| p.uid.as_str());
    let name = container.container.as_ref().map_or("", |c| c.name.as_str());
    if enforcement.driver_memory {
        let device = cdi::device_name(uid, name).ok_or_else(|| {
            (
                "pod uid / container name".to_owned(),
                format!("{uid:?} / {name:?} cannot name the container's enforcement CDI device"),
            )
        })?;
        edit.add_cdi_devices.push(CdiDevice {
            name: cdi::qualified(&device),
        });
    }
    if let Some(files) = &enforcement.mps {
        mps_edits(container, gpus, files, uid, name, edit)?;
    }
    let Some(files) = &enforcement.hami_core else {
        return Ok(());
    };
    if !path_component(uid) || !path_component(name) {
        return Err((
            "pod uid / container name".into(),
            format!(
                "{uid:?} / {name:?} cannot name the container's HAMi-core directory (letters, digits, '-', '_', '.' only)"
            ),
        ));
    }
    let mount = |host: &Path, container_path: &str, readonly: bool| Mount {
        container_path: container_path.into(),
        host_path: host.to_string_lossy().into_owned(),
        readonly,
    };
    edit.add_mounts.extend([
        mount(&files.library, HAMI_LIBRARY, true),
        mount(&files.preload, LD_SO_PRELOAD, true),
        mount(&files.lock_dir, HAMI_LOCK_DIR, false),
        mount(&files.cache_file(uid, name), HAMI_CACHE_FILE, false),
    ]);
    edit.set_envs.push(kv(HAMI_CACHE_ENV, HAMI_CACHE_FILE));
    Ok(())
}

/// MPS's edits: the container's namespace directory as its pipe directory (at
/// both default paths, so that `env -i` does not leave MPS), read-only (a
/// client only connects to its socket; a writable host tmpfs would be the
/// tenant's to fill), and the client env from the grant. Every `CUDA_MPS_*` the
/// tenant set goes: none may point the client elsewhere (in exclusive-process
/// mode that fails rather than bypasses, but the message would mislead).
fn mps_edits(
    container: &ContainerHookRequest,
    gpus: &[ResolvedGpu<'_>],
    files: &MpsFiles,
    uid: &str,
    name: &str,
    edit: &mut ContainerHookResponse,
) -> Result<(), (String, String)> {
    let [gpu] = gpus else {
        return Err((
            "gpu".into(),
            format!(
                "the container holds shares of {} GPUs, and MPS holds one GPU's share per container (a namespace belongs to one GPU's server); ask for whole GPUs, or for a share of one, or run this node without --mps",
                gpus.len()
            ),
        ));
    };
    let namespace = mps::namespace_name(uid, name).ok_or_else(|| {
        (
            "pod uid / container name".to_owned(),
            format!("{uid:?} / {name:?} cannot name the container's MPS namespace"),
        )
    })?;
    let dir = mps::namespace_dir(&files.pipe_dir, &mps::server_name(gpu.minor), &namespace);
    for path in [mps::CONTAINER_PIPE_DIR, mps::CONTAINER_PIPE_DIR_USER] {
        edit.add_mounts.push(Mount {
            container_path: path.into(),
            host_path: dir.to_string_lossy().into_owned(),
            readonly: true,
        });
    }
    super::remove_envs_where(container, edit, |key| key.starts_with(mps::ENV_PREFIX));
    let annotations = container.pod.as_ref().map(|p| &p.annotations);
    let percent = super::compute_percent(gpus, annotations).unwrap_or(100);
    edit.set_envs
        .push(kv(mps::PIPE_ENV, mps::CONTAINER_PIPE_DIR));
    edit.set_envs
        .push(kv(mps::THREAD_PERCENTAGE_ENV, percent.to_string()));
    if let Some(bytes) = granted_bytes(gpu) {
        // The container sees its one GPU as ordinal 0.
        edit.set_envs
            .push(kv(mps::PINNED_MEMORY_ENV, format!("0={}M", bytes >> 20)));
    }
    Ok(())
}

/// Why the host side of a shared container's HAMi-core files could not be made.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// Its directory or region file.
    #[error("creating {path} on the host: {source}")]
    Files {
        path: PathBuf,
        source: std::io::Error,
    },
    /// HAMi-core did not write its region with the grant.
    #[error(transparent)]
    Region(#[from] hami::PrimeError),
    /// The container has no limit env for HAMi-core to read (`--no-limiter-env`).
    #[error(
        "HAMi-core would hold no limit: the container gets no CUDA_DEVICE_MEMORY_LIMIT_* env (--no-limiter-env is set beside --hami-core-library)"
    )]
    NoLimits,
}

/// Makes the host files an edit mounts from under HAMi-core's cache root (a bind
/// mount's source must exist): the container's directory and its region file,
/// written by HAMi-core from the grant's env before any process of the
/// container runs (else its first process would, from whatever env it has).
/// Side effect of the hook, after the pure rewrite.
pub fn prepare_host(
    edit: &ContainerHookResponse,
    enforcement: &Enforcement,
) -> Result<(), PrepareError> {
    let Some(files) = &enforcement.hami_core else {
        return Ok(());
    };
    for mount in &edit.add_mounts {
        let host = Path::new(&mount.host_path);
        if !host.starts_with(&files.cache_root) {
            continue;
        }
        let Some(container_dir) = host.parent() else {
            continue;
        };
        let files_error = |path: &Path| {
            let path = path.to_owned();
            move |source| PrepareError::Files { path, source }
        };
        std::fs::create_dir_all(container_dir).map_err(files_error(container_dir))?;
        // Kept across the container's restarts: the same grant, the same region.
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(host)
            .map_err(files_error(host))?;
        // Written by whatever user the container runs as; mounted into it alone
        // (the directories above it stay root's).
        set_mode(host, 0o666).map_err(files_error(host))?;
        set_mode(container_dir, 0o711).map_err(files_error(container_dir))?;
        if let Some(pod_dir) = container_dir.parent() {
            set_mode(pod_dir, 0o711).map_err(files_error(pod_dir))?;
        }
        // HAMi-core reads its limits from these; the region's name is the host's.
        let env: Vec<(String, String)> = edit
            .set_envs
            .iter()
            .filter(|kv| kv.key.starts_with("CUDA_DEVICE_") && kv.key != HAMI_CACHE_ENV)
            .map(|kv| (kv.key.clone(), kv.value.clone()))
            .collect();
        // A region written from no limit env would be an unlimited one.
        if !env
            .iter()
            .any(|(key, _)| key.starts_with("CUDA_DEVICE_MEMORY_LIMIT"))
        {
            return Err(PrepareError::NoLimits);
        }
        let primer = hami::Primer {
            binary: files.primer.clone(),
            library: files.library.clone(),
        };
        let started = std::time::Instant::now();
        if primer.prime(host, &env)? {
            tracing::info!(region = %host.display(), elapsed_ms = started.elapsed().as_millis(), "HAMi-core region written with the grant");
        }
    }
    Ok(())
}

/// Removes a pod's HAMi-core directories, once the pod is gone.
pub fn remove_pod_dirs(enforcement: &Enforcement, pod_uid: &str) -> std::io::Result<()> {
    let Some(files) = &enforcement.hami_core else {
        return Ok(());
    };
    if !path_component(pod_uid) {
        return Ok(());
    }
    match std::fs::remove_dir_all(files.cache_root.join(pod_uid)) {
        Err(error) if error.kind() != std::io::ErrorKind::NotFound => Err(error),
        _ => Ok(()),
    }
}

/// The bytes of GPU memory a GPU's share holds: its `gpu-memory`, or its ratio of
/// the GPU's memory when only that is known.
pub(super) fn granted_bytes(gpu: &ResolvedGpu<'_>) -> Option<u64> {
    gpu.allocation.gpu_memory().or_else(|| {
        let ratio = gpu.allocation.gpu_memory_ratio()?;
        let total = gpu.memory_total?;
        u64::try_from(u128::from(total) * u128::from(ratio) / 100).ok()
    })
}

/// What a shared container may use of its GPUs, as the node holds it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SharedLimits {
    /// Its bytes of each GPU, in the order the container sees the GPUs.
    pub memory: Vec<MemoryLimit>,
    /// The compute it may use, in percent of each GPU (`None`: memory only); the
    /// highest of [`SharedLimits::compute_by_gpu`].
    pub compute_percent: Option<u64>,
    /// The compute it may use of each GPU, in the order of `memory` (`None`: no
    /// compute share of that GPU).
    pub compute_by_gpu: Vec<Option<u64>>,
    /// The device minors of its GPUs, in the same order as `memory`.
    pub minors: Vec<u32>,
}

impl SharedLimits {
    /// A whole-GPU grant, or a container the grant does not name: nothing to hold.
    pub fn is_empty(&self) -> bool {
        self.memory.is_empty()
    }

    /// The MPS namespace that holds these limits for a pod's container: `None`
    /// when there is nothing to hold, or more than one GPU (the GPU hook refuses
    /// such a container under MPS), or names unfit for MPS.
    pub fn mps_namespace(&self, pod_uid: &str, container: &str) -> Option<mps::NamespaceSpec> {
        let ([limit], [minor]) = (self.memory.as_slice(), self.minors.as_slice()) else {
            return None;
        };
        Some(mps::NamespaceSpec {
            name: mps::namespace_name(pod_uid, container)?,
            server: mps::server_name(*minor),
            uuid: limit.uuid.clone(),
            memory_bytes: limit.bytes,
            thread_percentage: self.compute_percent.unwrap_or(100),
        })
    }
}

/// The limits of a container of a pod with allocation `annotation` (and pod
/// annotations `pod_annotations`, for KubeShare's compute ceiling): one memory
/// limit per GPU when one of its GPUs is shared, none otherwise. The same bytes
/// and percent as the limiter env. A shared GPU whose bytes are unknown (a memory
/// ratio of a GPU whose size the node does not know) is refused: its share could
/// not be held.
pub fn shared_limits<S: std::hash::BuildHasher>(
    pod: &str,
    annotation: &str,
    container: &str,
    node: &NodeDevices,
    pod_annotations: Option<&std::collections::HashMap<String, String, S>>,
) -> Result<SharedLimits, GpuHookError> {
    with_granted_gpus(pod, annotation, container, node, |gpus| {
        limits_of(pod, container, gpus, pod_annotations)
    })
}

/// Runs `then` over the GPUs the annotation grants `container`, resolved on `node`.
fn with_granted_gpus<T>(
    pod: &str,
    annotation: &str,
    container: &str,
    node: &NodeDevices,
    then: impl FnOnce(&[ResolvedGpu<'_>]) -> Result<T, GpuHookError>,
) -> Result<T, GpuHookError> {
    let allocations =
        DeviceAllocations::parse(annotation).map_err(|source| GpuHookError::Annotation {
            pod: pod.to_owned(),
            container: container.to_owned(),
            source,
        })?;
    let granted = allocations.gpus_of_container(container);
    then(&resolve_gpus(&granted, node, pod, container)?)
}

/// [`shared_limits`] of the container's resolved GPUs.
fn limits_of<S: std::hash::BuildHasher>(
    pod: &str,
    container: &str,
    gpus: &[ResolvedGpu<'_>],
    pod_annotations: Option<&std::collections::HashMap<String, String, S>>,
) -> Result<SharedLimits, GpuHookError> {
    if !gpus.iter().any(|g| g.allocation.is_fractional()) {
        return Ok(SharedLimits::default());
    }
    let memory = gpus
        .iter()
        .map(|gpu| {
            let bytes = granted_bytes(gpu).ok_or_else(|| GpuHookError::Device {
                pod: pod.to_owned(),
                container: container.to_owned(),
                path: format!("gpu[{}].resources", gpu.index),
                problem: format!(
                    "the share's GPU memory on GPU {} is unknown (no gpu-memory, and the node does not know the GPU's size), so its limit cannot be set",
                    gpu.uuid
                ),
            })?;
            Ok(MemoryLimit {
                uuid: gpu.uuid.clone(),
                bytes,
            })
        })
        .collect::<Result<Vec<_>, GpuHookError>>()?;
    Ok(SharedLimits {
        memory,
        compute_percent: super::compute_percent(gpus, pod_annotations),
        // KubeShare's ceiling is of one GPU; several GPUs each keep their core share.
        compute_by_gpu: if gpus.len() == 1 {
            vec![super::compute_percent(gpus, pod_annotations)]
        } else {
            gpus.iter()
                .map(|gpu| gpu.allocation.gpu_core().filter(|core| *core > 0))
                .collect()
        },
        minors: gpus.iter().map(|g| g.minor).collect(),
    })
}

/// What a container of a pod with allocation `annotation` was granted of each of
/// its GPUs' memory, by UUID, for the proxy's report of GPU memory use: a share's
/// bytes, or the whole GPU.
pub fn granted_memory(
    pod: &str,
    annotation: &str,
    container: &str,
    node: &NodeDevices,
) -> Result<Vec<(String, tessera_api::usage::MemoryGrant)>, GpuHookError> {
    use tessera_api::usage::MemoryGrant;
    with_granted_gpus(pod, annotation, container, node, |gpus| {
        gpus.iter()
            .map(|gpu| {
                let grant = match (gpu.allocation.is_fractional(), granted_bytes(gpu)) {
                    (true, Some(bytes)) => MemoryGrant::Share(bytes),
                    (false, _) => MemoryGrant::Whole,
                    // A ratio of a GPU whose size the node cannot say now (NVML
                    // unreadable): unknown, not a limit of the whole GPU.
                    (true, None) => {
                        return Err(GpuHookError::Device {
                            pod: pod.to_owned(),
                            container: container.to_owned(),
                            path: format!("gpu[{}].resources", gpu.index),
                            problem: format!(
                                "the share's GPU memory on GPU {} is unknown (the node does not know the GPU's size now)",
                                gpu.uuid
                            ),
                        });
                    }
                };
                Ok((gpu.uuid.clone(), grant))
            })
            .collect()
    })
}
