//! A fake `libnvidia-ml.so`. `nvml-wrapper` loads it through its library-path
//! option, and NVIDIA's k8s-device-plugin (go-nvml) dlopens it as
//! `libnvidia-ml.so.1`, so real binding code runs against GPUs described by the
//! JSON file named in `TESSERA_FAKE_NVML_CONFIG`, or else `fake-nvml.json` beside
//! the library file (copy the library into a directory per fake node: each copy
//! is loaded as its own library, with its own state):
//!
//! ```json
//! {"driverVersion": "550.54.15", "cudaDriverVersion": 12040,
//!  "gpus": [{"uuid": "GPU-…", "minor": 0, "name": "NVIDIA H100 80GB HBM3",
//!            "memoryBytes": 85899345920, "busId": "00000000:19:00.0",
//!            "numaNode": 0, "pcieSwitch": "sw0",
//!            "nvlinks": [{"link": 0, "peerBusId": "00000000:3B:00.0"}]}],
//!  "xidEvents": [{"gpu": 1, "xid": 79, "afterMs": 200}]}
//! ```
//!
//! Optional per-GPU fields, with defaults that fit the model name:
//! `computeCapability` (`"9.0"`), `architecture` (`"Hopper"`, as go-nvlib
//! names them), `brand` (`"Nvidia"`), `reservedBytes` and `usedBytes` (0),
//! `migCapable` (false: MIG calls answer "not supported"; true: MIG mode is
//! disabled and there are no MIG devices).
//!
//! Optional node fields: `memoryLimits` (false) and `memoryLimitsLog` (absent),
//! for NVML r615's per-cgroup device-memory limits (below); `computeModeLog`
//! (absent), a file each `nvmlDeviceSetComputeMode` call appends
//! `{"uuid", "mode", "pid", "result"}` to (modes as NVML numbers them: 0 default,
//! 3 exclusive process).
//!
//! Optional node field `processUtilization` (absent): a file of `<GPU index>
//! <pid> [<bytes>]` lines naming the processes "on" each GPU (and the memory each
//! holds there, 0 when not given). `nvmlDeviceGetProcessUtilization`
//! gives each listed, living process one sample per call, timestamped now (µs
//! since the epoch), whose `smUtil` is the percent of one CPU the process used
//! since its previous sample (0 for its first): a stand-in for a process whose
//! GPU work follows its CPU work, so that a frozen process uses no GPU time.
//! No listed process, or none newer than `lastSeenTimeStamp`:
//! `NVML_ERROR_NOT_FOUND`, as the driver answers while no process runs.
//! `nvmlDeviceGetComputeRunningProcesses_v3` lists the living ones among them,
//! with their bytes as `usedGpuMemory`; a line with a fourth field `graphics`
//! names a process with a graphics context instead (Vulkan, EGL, OpenGL), listed
//! by `nvmlDeviceGetGraphicsRunningProcesses_v3` alone.
//!
//! Only the functions Tessera's reporter, its node agent and NVIDIA's
//! k8s-device-plugin call exist; callers report any other as missing. XID events
//! are delivered by `nvmlEventSetWait_v2`, each once, no earlier than `afterMs`
//! after `nvmlInit`.
//!
//! # Per-cgroup memory limits (NVML r615)
//!
//! `nvmlDeviceSetMemoryLimits_v1(device, nvmlSetMemoryLimits_v1_t *)` and
//! `nvmlDeviceGetMemoryLimits_v1(device, nvmlGetMemoryLimits_v1_t *)`, whose
//! structs (no version field) are `{const char *nameSpace; unsigned long long
//! softLimit, hardLimit;}`, the get one with `currentUsed` after them. `nameSpace`
//! is the full path of a cgroup v2 directory; soft 0 with hard
//! `NVML_DEVICE_MEMORY_LIMIT_MAX` (`u64::MAX`) means no limit.
//!
//! - `memoryLimits` false (the default) emulates a driver older than r615: once
//!   initialised, both calls answer `NVML_ERROR_FUNCTION_NOT_FOUND` (13), whatever
//!   the arguments, and record and log nothing.
//! - `memoryLimits` true: set checks, in order, that the library is initialised
//!   (`NVML_ERROR_UNINITIALIZED`); that the device is one of this library's and
//!   `limits` and `nameSpace` are non-null (`nameSpace` UTF-8); that `nameSpace` is
//!   an absolute path to an existing directory (as the driver refuses a cgroup that
//!   does not exist); that soft <= hard; and that hard is at most the GPU's
//!   `memoryBytes` or is MAX: each failure is `NVML_ERROR_INVALID_ARGUMENT`. Then it
//!   stores soft and hard for (GPU, `nameSpace` exactly as given), or forgets them
//!   when soft is 0 and hard is MAX, and succeeds. Get makes the same checks but
//!   for the directory's existence, and fills in the stored limits (soft 0, hard
//!   MAX for a `nameSpace` never set or cleared) and `currentUsed` 0. Limits live
//!   in the library's state: `nvmlShutdown` of the last handle forgets them.
//! - `memoryLimitsLog` (a file path), with `memoryLimits` true: every set call made
//!   after initialisation appends one JSON line, successful or not, `{"uuid":
//!   "GPU-…", "nameSpace": "/sys/fs/cgroup/…", "softLimit": n, "hardLimit": n,
//!   "pid": caller's pid, "result": nvmlReturn_t}` (`uuid` null for a device not
//!   of this library; `nameSpace`, `softLimit` and `hardLimit` null where the
//!   caller passed null pointers), in one `O_APPEND` write, so processes sharing
//!   the file do not interleave lines. Get calls are not logged.

use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_int, c_uint, c_ulonglong};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nvml_wrapper_sys::bindings::{
    nvmlBrandType_t, nvmlDevice_st, nvmlDevice_t, nvmlDeviceArchitecture_t, nvmlEnableState_t,
    nvmlEventData_t, nvmlEventSet_st, nvmlEventSet_t, nvmlGpuInstanceProfileInfo_t,
    nvmlGpuTopologyLevel_t, nvmlMemory_t, nvmlMemory_v2_t, nvmlPciInfo_t, nvmlProcessInfo_t,
    nvmlProcessUtilizationSample_t, nvmlReturn_t,
};
use serde::Deserialize;

const SUCCESS: nvmlReturn_t = 0;
const ERROR_UNINITIALIZED: nvmlReturn_t = 1;
const ERROR_INVALID_ARGUMENT: nvmlReturn_t = 2;
const ERROR_NOT_SUPPORTED: nvmlReturn_t = 3;
const ERROR_NOT_FOUND: nvmlReturn_t = 6;
const ERROR_INSUFFICIENT_SIZE: nvmlReturn_t = 7;
const ERROR_DRIVER_NOT_LOADED: nvmlReturn_t = 9;
const ERROR_TIMEOUT: nvmlReturn_t = 10;
const ERROR_FUNCTION_NOT_FOUND: nvmlReturn_t = 13;
const ERROR_ARGUMENT_VERSION_MISMATCH: nvmlReturn_t = 25;
const ERROR_UNKNOWN: nvmlReturn_t = 999;

/// NVML's XID critical error event type.
const EVENT_XID_CRITICAL_ERROR: c_ulonglong = 0x8;

/// `NVML_STRUCT_VERSION(Memory, 2)`: the size of `nvmlMemory_v2_t` and 2 << 24.
const MEMORY_V2_VERSION: c_uint = (std::mem::size_of::<nvmlMemory_v2_t>() as c_uint) | (2 << 24);

/// `NVML_DEVICE_MIG_DISABLE`.
const MIG_DISABLE: c_uint = 0;

/// MIG devices a MIG-capable GPU can hold (seven on A100/H100).
const MAX_MIG_DEVICES: c_uint = 7;

/// `NVML_NVLINK_MAX_LINKS` of the driver generation this fake stands in for.
const NVLINK_MAX_LINKS: c_uint = 18;

/// `NVML_DEVICE_ARCH_UNKNOWN`.
const ARCH_UNKNOWN: nvmlDeviceArchitecture_t = 0xffff_ffff;

/// `NVML_DEVICE_MEMORY_LIMIT_MAX`: a hard limit of "no limit".
pub const DEVICE_MEMORY_LIMIT_MAX: c_ulonglong = c_ulonglong::MAX;

/// `nvmlSetMemoryLimits_v1_t` (NVML r615; no version field).
#[allow(non_camel_case_types, non_snake_case)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct nvmlSetMemoryLimits_v1_t {
    /// Full path of the cgroup v2 directory the limits are for.
    pub nameSpace: *const c_char,
    /// Soft limit in bytes; 0: none.
    pub softLimit: c_ulonglong,
    /// Hard limit in bytes; [`DEVICE_MEMORY_LIMIT_MAX`]: none.
    pub hardLimit: c_ulonglong,
}

/// `nvmlGetMemoryLimits_v1_t` (NVML r615; no version field): `nameSpace` in, the
/// rest out.
#[allow(non_camel_case_types, non_snake_case)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct nvmlGetMemoryLimits_v1_t {
    /// Full path of the cgroup v2 directory to read the limits of.
    pub nameSpace: *const c_char,
    /// Soft limit in bytes; 0: none.
    pub softLimit: c_ulonglong,
    /// Hard limit in bytes; [`DEVICE_MEMORY_LIMIT_MAX`]: none.
    pub hardLimit: c_ulonglong,
    /// Device memory the cgroup's processes use.
    pub currentUsed: c_ulonglong,
}

/// CUDA driver version reported when the description gives none (CUDA 12.4,
/// which driver 550 ships with).
const DEFAULT_CUDA_DRIVER_VERSION: i32 = 12040;

/// The JSON description.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct FakeNode {
    /// `nvmlSystemGetDriverVersion`.
    #[serde(default)]
    pub driver_version: String,
    /// `nvmlSystemGetCudaDriverVersion`, as CUDA encodes it (12040 is 12.4);
    /// absent: 12040.
    #[serde(default)]
    pub cuda_driver_version: Option<i32>,
    /// The GPUs, by index.
    #[serde(default)]
    pub gpus: Vec<FakeGpu>,
    /// XID events to deliver.
    #[serde(default)]
    pub xid_events: Vec<FakeXid>,
    /// Whether NVML r615's per-cgroup memory limit calls work; false: they answer
    /// `NVML_ERROR_FUNCTION_NOT_FOUND`, as on older drivers.
    #[serde(default)]
    pub memory_limits: bool,
    /// A file each `nvmlDeviceSetMemoryLimits_v1` call appends a JSON line to.
    #[serde(default)]
    pub memory_limits_log: Option<PathBuf>,
    /// A file each `nvmlDeviceSetComputeMode` call appends a JSON line to.
    #[serde(default)]
    pub compute_mode_log: Option<PathBuf>,
    /// A file of `<GPU index> <pid>` lines: the processes
    /// `nvmlDeviceGetProcessUtilization` reports on those GPUs (read at each call).
    #[serde(default)]
    pub process_utilization: Option<PathBuf>,
}

/// One GPU.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct FakeGpu {
    /// `GPU-…`.
    pub uuid: String,
    /// Device minor.
    pub minor: u32,
    /// Model name.
    #[serde(default)]
    pub name: String,
    /// Total memory.
    #[serde(default)]
    pub memory_bytes: u64,
    /// `00000000:19:00.0`.
    #[serde(default)]
    pub bus_id: String,
    /// NUMA node; absent: not supported.
    #[serde(default)]
    pub numa_node: Option<u32>,
    /// GPUs with the same switch share a PCIe switch.
    #[serde(default)]
    pub pcie_switch: String,
    /// Active NVLinks.
    #[serde(default)]
    pub nvlinks: Vec<FakeNvLink>,
    /// CUDA compute capability, `"9.0"`; absent: by model name (9.0 if unknown).
    #[serde(default)]
    pub compute_capability: Option<String>,
    /// Architecture as go-nvlib names it (`"Hopper"`, `"Ampere"`, `"Ada Lovelace"`…);
    /// absent: from the compute capability.
    #[serde(default)]
    pub architecture: Option<String>,
    /// Brand as go-nvlib names it (`"Nvidia"`, `"Tesla"`, `"GeForce"`…); absent: `"Nvidia"`.
    #[serde(default)]
    pub brand: Option<String>,
    /// Memory the driver reserves (memory info v2 reports it apart; v1 counts it as used).
    #[serde(default)]
    pub reserved_bytes: u64,
    /// Memory in use by processes.
    #[serde(default)]
    pub used_bytes: u64,
    /// Whether the GPU supports MIG. false: MIG calls answer "not supported", as on
    /// GPUs without MIG; true: MIG mode is disabled and no MIG devices exist.
    #[serde(default)]
    pub mig_capable: bool,
}

impl FakeGpu {
    /// `(major, minor)` compute capability: the description's, else by model name.
    pub fn compute_capability(&self) -> (c_int, c_int) {
        if let Some((major, minor)) = self
            .compute_capability
            .as_deref()
            .and_then(|text| text.trim().split_once('.'))
            .and_then(|(major, minor)| Some((major.parse().ok()?, minor.parse().ok()?)))
        {
            return (major, minor);
        }
        // Model names as NVML reports them, matched by word: "NVIDIA A100-SXM4-80GB".
        const MODELS: &[(&str, (c_int, c_int))] = &[
            ("GB200", (10, 0)),
            ("B200", (10, 0)),
            ("B100", (10, 0)),
            ("GH200", (9, 0)),
            ("H200", (9, 0)),
            ("H100", (9, 0)),
            ("H800", (9, 0)),
            ("H20", (9, 0)),
            ("L40S", (8, 9)),
            ("L40", (8, 9)),
            ("L4", (8, 9)),
            ("A100", (8, 0)),
            ("A800", (8, 0)),
            ("A30", (8, 0)),
            ("A40", (8, 6)),
            ("A10", (8, 6)),
            ("A16", (8, 6)),
            ("A2", (8, 6)),
            ("T4", (7, 5)),
            ("V100", (7, 0)),
            ("P100", (6, 0)),
            ("P40", (6, 1)),
            ("P4", (6, 1)),
        ];
        let words: Vec<&str> = self
            .name
            .split(|c: char| c.is_whitespace() || c == '-')
            .collect();
        MODELS
            .iter()
            .find(|(model, _)| words.iter().any(|word| word.eq_ignore_ascii_case(model)))
            .map_or((9, 0), |&(_, capability)| capability)
    }

    /// `NVML_DEVICE_ARCH_*`: the description's architecture, else the one that
    /// goes with the compute capability.
    pub fn architecture(&self) -> nvmlDeviceArchitecture_t {
        if let Some(name) = &self.architecture {
            const NAMES: &[(&str, nvmlDeviceArchitecture_t)] = &[
                ("kepler", 2),
                ("maxwell", 3),
                ("pascal", 4),
                ("volta", 5),
                ("turing", 6),
                ("ampere", 7),
                ("ada", 8),
                ("ada lovelace", 8),
                ("hopper", 9),
                ("blackwell", 10),
                ("rubin", 13),
            ];
            return NAMES
                .iter()
                .find(|(known, _)| known.eq_ignore_ascii_case(name.trim()))
                .map_or(ARCH_UNKNOWN, |&(_, arch)| arch);
        }
        match self.compute_capability() {
            (3, _) => 2,
            (5, _) => 3,
            (6, _) => 4,
            (7, 5) => 6,
            (7, _) => 5,
            (8, 9) => 8,
            (8, _) => 7,
            (9, _) => 9,
            (10 | 12, _) => 10,
            _ => ARCH_UNKNOWN,
        }
    }

    /// `NVML_BRAND_*`: the description's brand, else `NVML_BRAND_NVIDIA`, as data
    /// centre GPUs report.
    pub fn brand(&self) -> nvmlBrandType_t {
        const NAMES: &[&str] = &[
            "Unknown",
            "Quadro",
            "Tesla",
            "NVS",
            "Grid",
            "GeForce",
            "Titan",
            "NvidiaVApps",
            "NvidiaVPC",
            "NvidiaVCS",
            "NvidiaVWS",
            "NvidiaCloudGaming",
            "QuadroRTX",
            "NvidiaRTX",
            "Nvidia",
            "GeForceRTX",
            "TitanRTX",
        ];
        let name = self.brand.as_deref().unwrap_or("Nvidia").trim();
        NAMES
            .iter()
            .position(|known| known.eq_ignore_ascii_case(name))
            .map_or(0, |brand| brand as nvmlBrandType_t)
    }
}

/// An active NVLink.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct FakeNvLink {
    /// Link number (0..18).
    pub link: u32,
    /// The peer's PCI bus ID.
    pub peer_bus_id: String,
}

/// An XID event to deliver.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct FakeXid {
    /// GPU index.
    pub gpu: usize,
    /// The XID.
    pub xid: u64,
    /// Not before this many milliseconds after init.
    #[serde(default)]
    pub after_ms: u64,
}

struct State {
    // nvmlInit may be called more than once (one handle per thread); each needs a shutdown.
    refs: usize,
    node: FakeNode,
    started: Instant,
    pending: Vec<FakeXid>,
    /// (GPU index, nameSpace) -> (soft, hard) per-cgroup memory limits.
    memory_limits: HashMap<(usize, String), (c_ulonglong, c_ulonglong)>,
    /// GPU index -> compute mode set (`NVML_COMPUTEMODE_DEFAULT` when absent).
    compute_modes: HashMap<usize, c_uint>,
    /// (GPU index, pid) -> (when, CPU clock ticks) at its last sample.
    cpu_seen: HashMap<(usize, u32), (Instant, u64)>,
}

impl State {
    fn new(node: FakeNode) -> Self {
        let pending = node.xid_events.clone();
        Self {
            refs: 1,
            node,
            started: Instant::now(),
            pending,
            memory_limits: HashMap::new(),
            compute_modes: HashMap::new(),
            cpu_seen: HashMap::new(),
        }
    }
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

fn with_state<T>(f: impl FnOnce(&mut State) -> Result<T, nvmlReturn_t>) -> Result<T, nvmlReturn_t> {
    let mut guard = STATE.lock().map_err(|_| ERROR_UNKNOWN)?;
    let state = guard.as_mut().ok_or(ERROR_UNINITIALIZED)?;
    f(state)
}

fn status(result: Result<(), nvmlReturn_t>) -> nvmlReturn_t {
    result.err().unwrap_or(SUCCESS)
}

/// Handles are index + 1 disguised as pointers; they are never dereferenced.
fn handle(index: usize) -> nvmlDevice_t {
    (index + 1) as *mut nvmlDevice_st
}

fn gpu(state: &State, device: nvmlDevice_t) -> Result<&FakeGpu, nvmlReturn_t> {
    gpu_index(state, device).map(|index| &state.node.gpus[index])
}

/// The index of the GPU behind `device`.
fn gpu_index(state: &State, device: nvmlDevice_t) -> Result<usize, nvmlReturn_t> {
    (device as usize)
        .checked_sub(1)
        .filter(|&index| index < state.node.gpus.len())
        .ok_or(ERROR_INVALID_ARGUMENT)
}

/// The file this library was loaded from, found in /proc/self/maps by the
/// address of one of its functions.
fn own_path() -> Option<std::path::PathBuf> {
    let address = nvmlInit_v2 as *const () as usize;
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let (start, end) = fields.next()?.split_once('-')?;
        let (start, end) = (
            usize::from_str_radix(start, 16).ok()?,
            usize::from_str_radix(end, 16).ok()?,
        );
        let path = fields.nth(4)?;
        (start <= address && address < end && path.starts_with('/')).then(|| path.into())
    })
}

/// The description: `$TESSERA_FAKE_NVML_CONFIG`, else `fake-nvml.json` beside the
/// library, so each copy of the library (each test) describes its own node.
fn load() -> Result<FakeNode, nvmlReturn_t> {
    let path = match std::env::var_os("TESSERA_FAKE_NVML_CONFIG") {
        Some(path) => path.into(),
        None => own_path()
            .ok_or(ERROR_DRIVER_NOT_LOADED)?
            .with_file_name("fake-nvml.json"),
    };
    let text = std::fs::read_to_string(path).map_err(|_| ERROR_DRIVER_NOT_LOADED)?;
    serde_json::from_str(&text).map_err(|_| ERROR_UNKNOWN)
}

/// Copies `text` and a NUL into the caller's `buffer` of `length` bytes.
fn write_string(text: &str, buffer: *mut c_char, length: c_uint) -> Result<(), nvmlReturn_t> {
    if buffer.is_null() {
        return Err(ERROR_INVALID_ARGUMENT);
    }
    let bytes = text.as_bytes();
    if bytes.len() + 1 > length as usize {
        return Err(ERROR_INSUFFICIENT_SIZE);
    }
    // SAFETY: the caller gave `length` writable bytes at `buffer` (NVML's contract),
    // and we write at most bytes.len() + 1 <= length of them.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), buffer, bytes.len());
        *buffer.add(bytes.len()) = 0;
    }
    Ok(())
}

/// Writes `value` through the caller's out-pointer.
fn write<T>(out: *mut T, value: T) -> Result<(), nvmlReturn_t> {
    if out.is_null() {
        return Err(ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: non-null, and NVML's contract is that out-pointers point to a valid,
    // writable, aligned T owned by the caller.
    unsafe { out.write(value) };
    Ok(())
}

/// Reads the NUL-terminated string the caller passed.
fn read_string<'a>(text: *const c_char) -> Result<&'a str, nvmlReturn_t> {
    read_c_string(text)?
        .to_str()
        .map_err(|_| ERROR_INVALID_ARGUMENT)
}

/// Reads the NUL-terminated string the caller passed, as bytes.
fn read_c_string<'a>(text: *const c_char) -> Result<&'a CStr, nvmlReturn_t> {
    if text.is_null() {
        return Err(ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: non-null, and NVML's contract is that string arguments are
    // NUL-terminated and stay valid for the duration of the call, which is as long
    // as the returned borrow is used.
    Ok(unsafe { CStr::from_ptr(text) })
}

/// Reads the struct the caller passed.
fn read<T: Copy>(input: *const T) -> Result<T, nvmlReturn_t> {
    if input.is_null() {
        return Err(ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: non-null, and NVML's contract is that struct arguments point to a
    // valid, aligned, initialised T owned by the caller for the duration of the call.
    Ok(unsafe { input.read() })
}

/// Reads the `version` field that opens a versioned NVML struct.
fn read_version(versioned: *const c_uint) -> Result<c_uint, nvmlReturn_t> {
    if versioned.is_null() {
        return Err(ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: non-null, and NVML's contract is that a versioned struct argument is
    // a valid, aligned struct owned by the caller whose first field is the
    // `unsigned int version`.
    Ok(unsafe { versioned.read() })
}

/// `(domain, bus, device, function)` of a PCI bus ID in any of NVML's spellings:
/// `00000000:19:00.0`, `0000:19:00.0` or `19:00.0`, any case.
fn parse_bus_id(bus_id: &str) -> Option<(u32, u32, u32, u32)> {
    let (rest, function) = bus_id.trim().trim_end_matches('\0').rsplit_once('.')?;
    let mut parts: Vec<&str> = rest.split(':').collect();
    if parts.len() == 2 {
        parts.insert(0, "0");
    }
    let [domain, bus, device] = parts.as_slice() else {
        return None;
    };
    let hex = |part: &str| u32::from_str_radix(part, 16).ok();
    Some((hex(domain)?, hex(bus)?, hex(device)?, hex(function)?))
}

/// The handle of the GPU whose description matches.
fn find_gpu(
    state: &State,
    matches: impl Fn(&FakeGpu) -> bool,
) -> Result<nvmlDevice_t, nvmlReturn_t> {
    state
        .node
        .gpus
        .iter()
        .position(matches)
        .map(handle)
        .ok_or(ERROR_NOT_FOUND)
}

/// A MIG call on `device`: "not supported" unless the GPU is MIG-capable.
fn mig_capable(state: &State, device: nvmlDevice_t) -> Result<(), nvmlReturn_t> {
    if gpu(state, device)?.mig_capable {
        Ok(())
    } else {
        Err(ERROR_NOT_SUPPORTED)
    }
}

fn pci_info(bus_id: &str) -> nvmlPciInfo_t {
    let mut info = nvmlPciInfo_t {
        busIdLegacy: [0; 16],
        domain: 0,
        bus: 0,
        device: 0,
        pciDeviceId: 0x2330_10de,
        pciSubSystemId: 0,
        busId: [0; 32],
    };
    // "DDDDDDDD:BB:DD.F"
    let mut parts = bus_id.split([':', '.']);
    info.domain = parts
        .next()
        .and_then(|p| u32::from_str_radix(p, 16).ok())
        .unwrap_or(0);
    info.bus = parts
        .next()
        .and_then(|p| u32::from_str_radix(p, 16).ok())
        .unwrap_or(0);
    info.device = parts
        .next()
        .and_then(|p| u32::from_str_radix(p, 16).ok())
        .unwrap_or(0);
    for (slot, byte) in info.busId.iter_mut().zip(bus_id.bytes().take(31)) {
        *slot = byte as c_char;
    }
    for (slot, byte) in info
        .busIdLegacy
        .iter_mut()
        .zip(bus_id.bytes().skip(4).take(15))
    {
        *slot = byte as c_char;
    }
    info
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    let Ok(mut guard) = STATE.lock() else {
        return ERROR_UNKNOWN;
    };
    if let Some(state) = guard.as_mut() {
        state.refs += 1;
        return SUCCESS;
    }
    let node = match load() {
        Ok(node) => node,
        Err(code) => return code,
    };
    *guard = Some(State::new(node));
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> nvmlReturn_t {
    nvmlInit_v2()
}

/// The pre-`_v2` entry point; the same here.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit() -> nvmlReturn_t {
    nvmlInit_v2()
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    let Ok(mut guard) = STATE.lock() else {
        return ERROR_UNKNOWN;
    };
    match guard.as_mut() {
        None => ERROR_UNINITIALIZED,
        Some(state) if state.refs > 1 => {
            state.refs -= 1;
            SUCCESS
        }
        Some(_) => {
            *guard = None;
            SUCCESS
        }
    }
}

/// NVML's own text for each return code.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    let text = match result {
        SUCCESS => c"Success",
        ERROR_UNINITIALIZED => c"Uninitialized",
        ERROR_INVALID_ARGUMENT => c"Invalid Argument",
        ERROR_NOT_SUPPORTED => c"Not Supported",
        4 => c"Insufficient Permissions",
        5 => c"Already Initialized",
        ERROR_NOT_FOUND => c"Not Found",
        ERROR_INSUFFICIENT_SIZE => c"Insufficient Size",
        8 => c"Insufficient External Power",
        ERROR_DRIVER_NOT_LOADED => c"Driver Not Loaded",
        ERROR_TIMEOUT => c"Timeout",
        ERROR_FUNCTION_NOT_FOUND => c"Function Not Found",
        15 => c"GPU is lost",
        ERROR_ARGUMENT_VERSION_MISMATCH => c"Argument version mismatch",
        _ => c"Unknown Error",
    };
    text.as_ptr()
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlSystemGetDriverVersion(version: *mut c_char, length: c_uint) -> nvmlReturn_t {
    status(with_state(|s| {
        write_string(&s.node.driver_version, version, length)
    }))
}

/// `major * 1000 + minor * 10` of the CUDA version the driver supports.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlSystemGetCudaDriverVersion(version: *mut c_int) -> nvmlReturn_t {
    status(with_state(|s| {
        write(
            version,
            s.node
                .cuda_driver_version
                .unwrap_or(DEFAULT_CUDA_DRIVER_VERSION),
        )
    }))
}

/// The same as [`nvmlSystemGetCudaDriverVersion`] (real NVML reads it from
/// libcuda instead of the kernel driver).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlSystemGetCudaDriverVersion_v2(version: *mut c_int) -> nvmlReturn_t {
    nvmlSystemGetCudaDriverVersion(version)
}

/// NVML's version: the CUDA major version, then the driver version (`12.550.54.15`).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlSystemGetNVMLVersion(version: *mut c_char, length: c_uint) -> nvmlReturn_t {
    status(with_state(|s| {
        let cuda = s
            .node
            .cuda_driver_version
            .unwrap_or(DEFAULT_CUDA_DRIVER_VERSION);
        let text = format!("{}.{}", cuda / 1000, s.node.driver_version);
        write_string(&text, version, length)
    }))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> nvmlReturn_t {
    status(with_state(|s| write(count, s.node.gpus.len() as c_uint)))
}

/// The pre-`_v2` entry point (which skipped GPUs the caller may not use); the same here.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetCount(count: *mut c_uint) -> nvmlReturn_t {
    nvmlDeviceGetCount_v2(count)
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    status(with_state(|s| {
        if index as usize >= s.node.gpus.len() {
            return Err(ERROR_INVALID_ARGUMENT);
        }
        write(device, handle(index as usize))
    }))
}

/// The pre-`_v2` entry point; the same here.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetHandleByIndex(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    nvmlDeviceGetHandleByIndex_v2(index, device)
}

/// The GPU with this `GPU-…` UUID; "not found" for any other.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    status(with_state(|s| {
        let uuid = read_string(uuid)?;
        write(device, find_gpu(s, |gpu| gpu.uuid == uuid)?)
    }))
}

/// The GPU at this PCI bus ID (`00000000:19:00.0`, `0000:19:00.0` or `19:00.0`).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetHandleByPciBusId_v2(
    bus_id: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    status(with_state(|s| {
        let wanted = parse_bus_id(read_string(bus_id)?).ok_or(ERROR_INVALID_ARGUMENT)?;
        let found = find_gpu(s, |gpu| parse_bus_id(&gpu.bus_id) == Some(wanted))?;
        write(device, found)
    }))
}

/// The pre-`_v2` entry point; the same here.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetHandleByPciBusId(
    bus_id: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    nvmlDeviceGetHandleByPciBusId_v2(bus_id, device)
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetIndex(device: nvmlDevice_t, index: *mut c_uint) -> nvmlReturn_t {
    status(with_state(|s| {
        gpu(s, device)?;
        write(index, (device as usize - 1) as c_uint)
    }))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetUUID(
    device: nvmlDevice_t,
    uuid: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    status(with_state(|s| {
        write_string(&gpu(s, device)?.uuid, uuid, length)
    }))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetName(
    device: nvmlDevice_t,
    name: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    status(with_state(|s| {
        write_string(&gpu(s, device)?.name, name, length)
    }))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetMinorNumber(
    device: nvmlDevice_t,
    minor: *mut c_uint,
) -> nvmlReturn_t {
    status(with_state(|s| write(minor, gpu(s, device)?.minor)))
}

/// Memory info, version 1: `used` includes what the driver reserves.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetMemoryInfo(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_t,
) -> nvmlReturn_t {
    status(with_state(|s| {
        let gpu = gpu(s, device)?;
        let used = gpu.used_bytes.saturating_add(gpu.reserved_bytes);
        write(
            memory,
            nvmlMemory_t {
                total: gpu.memory_bytes,
                free: gpu.memory_bytes.saturating_sub(used),
                used,
            },
        )
    }))
}

/// Memory info, version 2: the caller sets `version` to `nvmlMemory_v2`, and the
/// driver's reservation is reported apart from `used`.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    status(with_state(|s| {
        let gpu = gpu(s, device)?;
        if read_version(memory.cast::<c_uint>())? != MEMORY_V2_VERSION {
            return Err(ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        let (reserved, used) = (gpu.reserved_bytes, gpu.used_bytes);
        write(
            memory,
            nvmlMemory_v2_t {
                version: MEMORY_V2_VERSION,
                total: gpu.memory_bytes,
                reserved,
                free: gpu
                    .memory_bytes
                    .saturating_sub(reserved.saturating_add(used)),
                used,
            },
        )
    }))
}

/// Checks a set of per-cgroup memory limits and stores it, or forgets the
/// cgroup's limits when it clears them.
fn set_memory_limits(
    state: &mut State,
    device: nvmlDevice_t,
    limits: Option<nvmlSetMemoryLimits_v1_t>,
) -> Result<(), nvmlReturn_t> {
    let index = gpu_index(state, device)?;
    let limits = limits.ok_or(ERROR_INVALID_ARGUMENT)?;
    let name_space = read_string(limits.nameSpace)?;
    let (soft, hard) = (limits.softLimit, limits.hardLimit);
    let path = Path::new(name_space);
    if !path.is_absolute() || !path.is_dir() {
        return Err(ERROR_INVALID_ARGUMENT);
    }
    if soft > hard {
        return Err(ERROR_INVALID_ARGUMENT);
    }
    if hard != DEVICE_MEMORY_LIMIT_MAX && hard > state.node.gpus[index].memory_bytes {
        return Err(ERROR_INVALID_ARGUMENT);
    }
    let key = (index, name_space.to_owned());
    if (soft, hard) == (0, DEVICE_MEMORY_LIMIT_MAX) {
        state.memory_limits.remove(&key);
    } else {
        state.memory_limits.insert(key, (soft, hard));
    }
    Ok(())
}

/// Appends `line` and a newline to `path` in one `O_APPEND` write.
fn append_line(path: &Path, line: &str) {
    use std::io::Write as _;
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut file| file.write_all(format!("{line}\n").as_bytes()));
    if let Err(error) = written {
        eprintln!("fake NVML: cannot append to {}: {error}", path.display());
    }
}

/// NVML r615's per-cgroup memory limit: see the module docs. "Function not found"
/// unless the description turns `memoryLimits` on.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceSetMemoryLimits_v1(
    device: nvmlDevice_t,
    limits: *mut nvmlSetMemoryLimits_v1_t,
) -> nvmlReturn_t {
    let mut log = None;
    let result = status(with_state(|s| {
        if !s.node.memory_limits {
            return Err(ERROR_FUNCTION_NOT_FOUND);
        }
        let given = read(limits.cast_const()).ok();
        let result = status(set_memory_limits(s, device, given));
        if let Some(path) = &s.node.memory_limits_log {
            let uuid = gpu(s, device).ok().map(|gpu| gpu.uuid.clone());
            let name_space = given
                .and_then(|given| read_c_string(given.nameSpace).ok())
                .map(|text| text.to_string_lossy().into_owned());
            let line = serde_json::json!({
                "uuid": uuid,
                "nameSpace": name_space,
                "softLimit": given.map(|given| given.softLimit),
                "hardLimit": given.map(|given| given.hardLimit),
                "pid": std::process::id(),
                "result": result,
            });
            log = Some((path.clone(), line.to_string()));
        }
        match result {
            SUCCESS => Ok(()),
            code => Err(code),
        }
    }));
    // Written after the state's lock is released.
    if let Some((path, line)) = log {
        append_line(&path, &line);
    }
    result
}

/// The per-cgroup memory limits set for `nameSpace` (soft 0, hard
/// `NVML_DEVICE_MEMORY_LIMIT_MAX` if none), and `currentUsed` 0. "Function not
/// found" unless the description turns `memoryLimits` on.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetMemoryLimits_v1(
    device: nvmlDevice_t,
    limits: *mut nvmlGetMemoryLimits_v1_t,
) -> nvmlReturn_t {
    status(with_state(|s| {
        if !s.node.memory_limits {
            return Err(ERROR_FUNCTION_NOT_FOUND);
        }
        let index = gpu_index(s, device)?;
        // Only `nameSpace`, the first field, is input: the rest may be uninitialised.
        let name_space_ptr = read(limits.cast::<*const c_char>().cast_const())?;
        let name_space = read_string(name_space_ptr)?;
        let (soft, hard) = s
            .memory_limits
            .get(&(index, name_space.to_owned()))
            .copied()
            .unwrap_or((0, DEVICE_MEMORY_LIMIT_MAX));
        write(
            limits,
            nvmlGetMemoryLimits_v1_t {
                nameSpace: name_space_ptr,
                softLimit: soft,
                hardLimit: hard,
                currentUsed: 0,
            },
        )
    }))
}

/// `NVML_COMPUTEMODE_*`: default, exclusive thread (deprecated), prohibited,
/// exclusive process.
const COMPUTE_MODES: [c_uint; 4] = [0, 1, 2, 3];

/// Sets the GPU's compute mode (kept in the library's state, as the driver keeps
/// it until reboot; here until the last `nvmlShutdown`); logged with
/// `computeModeLog` as `{"uuid", "mode", "pid", "result"}`.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceSetComputeMode(device: nvmlDevice_t, mode: c_uint) -> nvmlReturn_t {
    let mut log = None;
    let result = status(with_state(|s| {
        let result = status(gpu_index(s, device).and_then(|index| {
            if !COMPUTE_MODES.contains(&mode) {
                return Err(ERROR_INVALID_ARGUMENT);
            }
            s.compute_modes.insert(index, mode);
            Ok(())
        }));
        if let Some(path) = &s.node.compute_mode_log {
            let uuid = gpu(s, device).ok().map(|gpu| gpu.uuid.clone());
            let line = serde_json::json!({
                "uuid": uuid,
                "mode": mode,
                "pid": std::process::id(),
                "result": result,
            });
            log = Some((path.clone(), line.to_string()));
        }
        match result {
            SUCCESS => Ok(()),
            code => Err(code),
        }
    }));
    if let Some((path, line)) = log {
        append_line(&path, &line);
    }
    result
}

/// The compute mode set, or `NVML_COMPUTEMODE_DEFAULT`. With `computeModeLog`,
/// the last successful set of any process in the log: the driver's mode is the
/// node's, not one process's.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetComputeMode(
    device: nvmlDevice_t,
    mode: *mut c_uint,
) -> nvmlReturn_t {
    status(with_state(|s| {
        let index = gpu_index(s, device)?;
        let logged = s
            .node
            .compute_mode_log
            .as_deref()
            .and_then(|path| logged_compute_mode(path, &s.node.gpus[index].uuid));
        let current = logged.unwrap_or_else(|| s.compute_modes.get(&index).copied().unwrap_or(0));
        write(mode, current)
    }))
}

/// The mode of the last successful set of `uuid` in the log.
fn logged_compute_mode(path: &Path, uuid: &str) -> Option<c_uint> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines()
        .rev()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|entry| entry["uuid"] == uuid && entry["result"] == SUCCESS)
        .find_map(|entry| {
            entry["mode"]
                .as_u64()
                .and_then(|m| c_uint::try_from(m).ok())
        })
}

/// The CPU clock ticks (user + system, in USER_HZ, 100 a second on Linux) process
/// `pid` has used, from `/proc/<pid>/stat`: what this fake reports as its GPU use,
/// and what tests measure a held process by (`tessera_harness::cpu_seconds`).
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which may hold spaces and parentheses.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line: 12 and 13 after the name.
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

/// The processes `processUtilization` lists on GPU `index`.
fn listed_processes(node: &FakeNode, index: usize) -> Vec<u32> {
    listed_memory(node, index)
        .into_iter()
        .map(|(pid, _)| pid)
        .collect()
}

/// The processes `processUtilization` lists on GPU `index`, with their bytes.
fn listed_memory(node: &FakeNode, index: usize) -> Vec<(u32, u64)> {
    listed_contexts(node, index, None)
}

/// The processes `processUtilization` lists on GPU `index` with their bytes: of
/// one kind of context (`Some(true)`: graphics), or all.
fn listed_contexts(node: &FakeNode, index: usize, graphics: Option<bool>) -> Vec<(u32, u64)> {
    node.process_utilization
        .as_deref()
        .and_then(|path| std::fs::read_to_string(path).ok())
        .unwrap_or_default()
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let gpu: usize = fields.next()?.parse().ok()?;
            let pid: u32 = fields.next()?.parse().ok()?;
            let bytes: u64 = fields.next().map_or(Some(0), |b| b.parse().ok())?;
            let is_graphics = fields.next() == Some("graphics");
            (gpu == index && graphics.is_none_or(|g| g == is_graphics)).then_some((pid, bytes))
        })
        .collect()
}

/// The living processes listed on the GPU, as processes with a compute context
/// (their listed memory, no MIG instance).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    running_processes(device, count, infos, false)
}

/// The living processes listed on the GPU with `graphics`, as processes with a
/// graphics context.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetGraphicsRunningProcesses_v3(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    running_processes(device, count, infos, true)
}

/// The living listed processes of one kind of context, as NVML's two lists give them.
fn running_processes(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
    graphics: bool,
) -> nvmlReturn_t {
    status(with_state(|s| {
        let index = gpu_index(s, device)?;
        if count.is_null() {
            return Err(ERROR_INVALID_ARGUMENT);
        }
        let living: Vec<(u32, u64)> = listed_contexts(&s.node, index, Some(graphics))
            .into_iter()
            .filter(|(pid, _)| Path::new(&format!("/proc/{pid}")).exists())
            .collect();
        let capacity = read(count.cast_const())? as usize;
        write(count, living.len() as c_uint)?;
        if living.is_empty() {
            return Ok(());
        }
        if infos.is_null() || capacity < living.len() {
            return Err(ERROR_INSUFFICIENT_SIZE);
        }
        // `infos` holds `capacity` entries (NVML's contract), and no more than
        // living.len() <= capacity are written.
        for (i, (pid, bytes)) in living.into_iter().enumerate() {
            let info = nvmlProcessInfo_t {
                pid,
                usedGpuMemory: bytes,
                gpuInstanceId: c_uint::MAX,
                computeInstanceId: c_uint::MAX,
            };
            write(infos.wrapping_add(i), info)?;
        }
        Ok(())
    }))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetProcessUtilization(
    device: nvmlDevice_t,
    utilization: *mut nvmlProcessUtilizationSample_t,
    count: *mut c_uint,
    last_seen: c_ulonglong,
) -> nvmlReturn_t {
    status(with_state(|s| {
        let index = gpu_index(s, device)?;
        if count.is_null() {
            return Err(ERROR_INVALID_ARGUMENT);
        }
        let listed = listed_processes(&s.node, index);
        let now_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        if listed.is_empty() || now_us <= last_seen {
            return Err(ERROR_NOT_FOUND);
        }
        let capacity = read(count.cast_const())? as usize;
        if utilization.is_null() || capacity < listed.len() {
            write(count, listed.len() as c_uint)?;
            return Err(ERROR_INSUFFICIENT_SIZE);
        }
        // `utilization` holds `capacity` samples (NVML's contract), and no more
        // than listed.len() <= capacity are written.
        let mut written = 0usize;
        for pid in listed {
            let Some(ticks) = cpu_ticks(pid) else {
                continue;
            };
            let now = Instant::now();
            let sm = match s.cpu_seen.insert((index, pid), (now, ticks)) {
                Some((then, before)) => {
                    let wall = now.duration_since(then).as_secs_f64();
                    let cpu = ticks.saturating_sub(before) as f64 / 100.0;
                    if wall > 0.0 {
                        (cpu / wall * 100.0).min(100.0) as c_uint
                    } else {
                        0
                    }
                }
                None => 0,
            };
            let sample = nvmlProcessUtilizationSample_t {
                pid,
                timeStamp: now_us,
                smUtil: sm,
                memUtil: 0,
                encUtil: 0,
                decUtil: 0,
            };
            write(utilization.wrapping_add(written), sample)?;
            written += 1;
        }
        if written == 0 {
            return Err(ERROR_NOT_FOUND);
        }
        write(count, written as c_uint)
    }))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetCudaComputeCapability(
    device: nvmlDevice_t,
    major: *mut c_int,
    minor: *mut c_int,
) -> nvmlReturn_t {
    status(with_state(|s| {
        let (cc_major, cc_minor) = gpu(s, device)?.compute_capability();
        if minor.is_null() {
            return Err(ERROR_INVALID_ARGUMENT);
        }
        write(major, cc_major)?;
        write(minor, cc_minor)
    }))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetArchitecture(
    device: nvmlDevice_t,
    arch: *mut nvmlDeviceArchitecture_t,
) -> nvmlReturn_t {
    status(with_state(|s| write(arch, gpu(s, device)?.architecture())))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetBrand(
    device: nvmlDevice_t,
    brand: *mut nvmlBrandType_t,
) -> nvmlReturn_t {
    status(with_state(|s| write(brand, gpu(s, device)?.brand())))
}

/// Current and pending MIG mode: disabled on MIG-capable GPUs, else "not supported".
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetMigMode(
    device: nvmlDevice_t,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> nvmlReturn_t {
    status(with_state(|s| {
        mig_capable(s, device)?;
        if pending.is_null() {
            return Err(ERROR_INVALID_ARGUMENT);
        }
        write(current, MIG_DISABLE)?;
        write(pending, MIG_DISABLE)
    }))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    device: nvmlDevice_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    status(with_state(|s| {
        mig_capable(s, device)?;
        write(count, MAX_MIG_DEVICES)
    }))
}

/// No MIG device exists (MIG mode is never enabled): "not found" at every index.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    device: nvmlDevice_t,
    index: c_uint,
    mig: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    status(with_state(|s| {
        mig_capable(s, device)?;
        if index >= MAX_MIG_DEVICES || mig.is_null() {
            return Err(ERROR_INVALID_ARGUMENT);
        }
        Err(ERROR_NOT_FOUND)
    }))
}

/// Every handle is a whole GPU's.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceIsMigDeviceHandle(
    device: nvmlDevice_t,
    is_mig: *mut c_uint,
) -> nvmlReturn_t {
    status(with_state(|s| {
        gpu(s, device)?;
        write(is_mig, 0)
    }))
}

/// Only MIG device handles have a parent, and there are none.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
    mig: nvmlDevice_t,
    _device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    status(with_state(|s| {
        gpu(s, mig)?;
        Err(ERROR_INVALID_ARGUMENT)
    }))
}

/// MIG profiles are not modelled: "not supported" for every profile, which
/// callers skip.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetGpuInstanceProfileInfo(
    device: nvmlDevice_t,
    _profile: c_uint,
    _info: *mut nvmlGpuInstanceProfileInfo_t,
) -> nvmlReturn_t {
    status(with_state(|s| {
        gpu(s, device)?;
        Err(ERROR_NOT_SUPPORTED)
    }))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetPciInfo_v3(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    status(with_state(|s| {
        write(pci, pci_info(&gpu(s, device)?.bus_id))
    }))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetNumaNodeId(device: nvmlDevice_t, node: *mut c_uint) -> nvmlReturn_t {
    status(with_state(|s| {
        write(node, gpu(s, device)?.numa_node.ok_or(ERROR_NOT_SUPPORTED)?)
    }))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetTopologyCommonAncestor(
    device1: nvmlDevice_t,
    device2: nvmlDevice_t,
    level: *mut nvmlGpuTopologyLevel_t,
) -> nvmlReturn_t {
    status(with_state(|s| {
        let (a, b) = (gpu(s, device1)?, gpu(s, device2)?);
        let common = if device1 == device2 {
            0 // NVML_TOPOLOGY_INTERNAL
        } else if !a.pcie_switch.is_empty() && a.pcie_switch == b.pcie_switch {
            10 // NVML_TOPOLOGY_SINGLE
        } else if a.numa_node.is_some() && a.numa_node == b.numa_node {
            40 // NVML_TOPOLOGY_NODE
        } else {
            50 // NVML_TOPOLOGY_SYSTEM
        };
        write(level, common)
    }))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetNvLinkState(
    device: nvmlDevice_t,
    link: c_uint,
    active: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    status(with_state(|s| {
        let gpu = gpu(s, device)?;
        if link >= NVLINK_MAX_LINKS {
            return Err(ERROR_INVALID_ARGUMENT);
        }
        let on = gpu.nvlinks.iter().any(|l| l.link == link);
        write(active, c_uint::from(on))
    }))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetNvLinkRemotePciInfo_v2(
    device: nvmlDevice_t,
    link: c_uint,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    status(with_state(|s| {
        let peer = gpu(s, device)?
            .nvlinks
            .iter()
            .find(|l| l.link == link)
            .ok_or(ERROR_NOT_SUPPORTED)?;
        write(pci, pci_info(&peer.peer_bus_id))
    }))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) -> nvmlReturn_t {
    // One global event queue: the handle only needs to be non-null.
    status(with_state(|_| {
        write(set, std::ptr::dangling_mut::<nvmlEventSet_st>())
    }))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlEventSetFree(_set: nvmlEventSet_t) -> nvmlReturn_t {
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetSupportedEventTypes(
    device: nvmlDevice_t,
    types: *mut c_ulonglong,
) -> nvmlReturn_t {
    status(with_state(|s| {
        gpu(s, device)?;
        write(types, EVENT_XID_CRITICAL_ERROR)
    }))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceRegisterEvents(
    device: nvmlDevice_t,
    _types: c_ulonglong,
    _set: nvmlEventSet_t,
) -> nvmlReturn_t {
    status(with_state(|s| gpu(s, device).map(|_| ())))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlEventSetWait_v2(
    _set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeout_ms: c_uint,
) -> nvmlReturn_t {
    let deadline = Instant::now() + Duration::from_millis(u64::from(timeout_ms));
    loop {
        let due = with_state(|s| {
            let elapsed = s.started.elapsed().as_millis() as u64;
            let index = s.pending.iter().position(|e| e.after_ms <= elapsed);
            Ok(index.map(|i| s.pending.remove(i)))
        });
        match due {
            Err(code) => return code,
            Ok(Some(event)) => {
                let value = nvmlEventData_t {
                    device: handle(event.gpu),
                    eventType: EVENT_XID_CRITICAL_ERROR,
                    eventData: event.xid,
                    gpuInstanceId: c_uint::MAX,
                    computeInstanceId: c_uint::MAX,
                };
                return status(write(data, value));
            }
            Ok(None) if Instant::now() >= deadline => return ERROR_TIMEOUT,
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::MutexGuard;

    use super::*;

    /// Serialises the tests that touch the library's global state.
    static STATE_TESTS: Mutex<()> = Mutex::new(());

    /// Initialises the library with `node`, as `nvmlInit` does from the JSON file,
    /// holding the returned guard so no other test touches the state meanwhile.
    fn init_with(node: FakeNode) -> MutexGuard<'static, ()> {
        let guard = STATE_TESTS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *STATE
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(State::new(node));
        guard
    }

    fn h100(uuid: &str, bus_id: &str) -> FakeGpu {
        FakeGpu {
            uuid: uuid.into(),
            name: "NVIDIA H100 80GB HBM3".into(),
            memory_bytes: 80 << 30,
            bus_id: bus_id.into(),
            ..FakeGpu::default()
        }
    }

    #[test]
    fn bus_ids_parse_in_every_spelling() {
        let want = Some((0, 0x19, 0, 0));
        assert_eq!(parse_bus_id("00000000:19:00.0"), want);
        assert_eq!(parse_bus_id("0000:19:00.0"), want);
        assert_eq!(parse_bus_id("19:00.0"), want);
        assert_eq!(parse_bus_id("0000:3b:00.1"), Some((0, 0x3b, 0, 1)));
        assert_eq!(parse_bus_id("garbage"), None);
    }

    #[test]
    fn models_get_their_compute_capability_architecture_and_brand() {
        let mut gpu = h100("GPU-a", "00000000:19:00.0");
        assert_eq!(gpu.compute_capability(), (9, 0));
        assert_eq!(gpu.architecture(), 9);
        assert_eq!(gpu.brand(), 14);
        gpu.name = "NVIDIA A100-SXM4-80GB".into();
        assert_eq!((gpu.compute_capability(), gpu.architecture()), ((8, 0), 7));
        gpu.name = "NVIDIA L4".into();
        assert_eq!((gpu.compute_capability(), gpu.architecture()), ((8, 9), 8));
        gpu.name = "Tesla T4".into();
        assert_eq!((gpu.compute_capability(), gpu.architecture()), ((7, 5), 6));
        gpu.compute_capability = Some("10.0".into());
        gpu.architecture = Some("Ada Lovelace".into());
        gpu.brand = Some("tesla".into());
        assert_eq!(gpu.compute_capability(), (10, 0));
        assert_eq!(gpu.architecture(), 8);
        assert_eq!(gpu.brand(), 2);
        gpu.architecture = Some("Fermi".into());
        assert_eq!(gpu.architecture(), ARCH_UNKNOWN);
    }

    /// The calls NVIDIA's k8s-device-plugin makes, in-process.
    #[test]
    fn device_plugin_calls() {
        let mut second = h100("GPU-b", "00000000:3B:00.0");
        second.mig_capable = true;
        second.reserved_bytes = 1 << 29;
        second.used_bytes = 1 << 30;
        let _state = init_with(FakeNode {
            driver_version: "550.54.15".into(),
            cuda_driver_version: None,
            gpus: vec![h100("GPU-a", "00000000:19:00.0"), second],
            ..FakeNode::default()
        });

        let mut device: nvmlDevice_t = std::ptr::null_mut();
        assert_eq!(
            nvmlDeviceGetHandleByUUID(c"GPU-b".as_ptr(), &mut device),
            SUCCESS
        );
        assert_eq!(device, handle(1));
        assert_eq!(
            nvmlDeviceGetHandleByUUID(c"GPU-c".as_ptr(), &mut device),
            ERROR_NOT_FOUND
        );
        assert_eq!(
            nvmlDeviceGetHandleByUUID(std::ptr::null(), &mut device),
            ERROR_INVALID_ARGUMENT
        );
        assert_eq!(
            nvmlDeviceGetHandleByPciBusId_v2(c"0000:3b:00.0".as_ptr(), &mut device),
            SUCCESS
        );
        assert_eq!(device, handle(1));

        let mut v1 = nvmlMemory_t {
            total: 0,
            free: 0,
            used: 0,
        };
        assert_eq!(nvmlDeviceGetMemoryInfo(handle(1), &mut v1), SUCCESS);
        assert_eq!(
            (v1.total, v1.used, v1.free),
            (
                80 << 30,
                (1 << 30) + (1 << 29),
                (80 << 30) - (1 << 30) - (1 << 29)
            )
        );
        let mut v2 = nvmlMemory_v2_t {
            version: 0,
            total: 0,
            reserved: 0,
            free: 0,
            used: 0,
        };
        assert_eq!(
            nvmlDeviceGetMemoryInfo_v2(handle(1), &mut v2),
            ERROR_ARGUMENT_VERSION_MISMATCH
        );
        v2.version = MEMORY_V2_VERSION;
        assert_eq!(nvmlDeviceGetMemoryInfo_v2(handle(1), &mut v2), SUCCESS);
        assert_eq!((v2.reserved, v2.used, v2.free), (1 << 29, 1 << 30, v1.free));

        let (mut major, mut minor) = (0, 0);
        assert_eq!(
            nvmlDeviceGetCudaComputeCapability(handle(0), &mut major, &mut minor),
            SUCCESS
        );
        assert_eq!((major, minor), (9, 0));

        let (mut current, mut pending) = (9, 9);
        assert_eq!(
            nvmlDeviceGetMigMode(handle(0), &mut current, &mut pending),
            ERROR_NOT_SUPPORTED
        );
        assert_eq!(
            nvmlDeviceGetMigMode(handle(1), &mut current, &mut pending),
            SUCCESS
        );
        assert_eq!((current, pending), (MIG_DISABLE, MIG_DISABLE));
        let mut mig: nvmlDevice_t = std::ptr::null_mut();
        assert_eq!(
            nvmlDeviceGetMigDeviceHandleByIndex(handle(1), 0, &mut mig),
            ERROR_NOT_FOUND
        );

        let mut cuda = 0;
        assert_eq!(nvmlSystemGetCudaDriverVersion_v2(&mut cuda), SUCCESS);
        assert_eq!(cuda, DEFAULT_CUDA_DRIVER_VERSION);
        let mut text = [0 as c_char; 80];
        assert_eq!(nvmlSystemGetNVMLVersion(text.as_mut_ptr(), 80), SUCCESS);
        // SAFETY: nvmlSystemGetNVMLVersion succeeded, so `text` holds a NUL-terminated string.
        let version = unsafe { CStr::from_ptr(text.as_ptr()) };
        assert_eq!(version.to_str(), Ok("12.550.54.15"));

        let mut active = 1;
        assert_eq!(
            nvmlDeviceGetNvLinkState(handle(0), NVLINK_MAX_LINKS, &mut active),
            ERROR_INVALID_ARGUMENT
        );
        assert_eq!(nvmlShutdown(), SUCCESS);
        assert_eq!(nvmlDeviceGetCount_v2(&mut current), ERROR_UNINITIALIZED);
    }

    /// A directory of the test's own under the system's temporary directory,
    /// removed when dropped.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> Self {
            let dir = std::env::temp_dir()
                .join(format!("tessera-fake-nvml-{}-{name}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("temporary directory");
            Self(dir)
        }

        /// `self`/`name` as a C string.
        fn c_path(&self, name: &str) -> std::ffi::CString {
            let path = self.0.join(name);
            std::ffi::CString::new(path.to_str().expect("UTF-8 path")).expect("no NUL")
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A node of two H100s with memory limits on, logging to `log`.
    fn limits_node(log: Option<PathBuf>) -> FakeNode {
        FakeNode {
            driver_version: "615.10".into(),
            gpus: vec![
                h100("GPU-a", "00000000:19:00.0"),
                h100("GPU-b", "00000000:3B:00.0"),
            ],
            memory_limits: true,
            memory_limits_log: log,
            ..FakeNode::default()
        }
    }

    fn set(device: nvmlDevice_t, name_space: &CStr, soft: u64, hard: u64) -> nvmlReturn_t {
        let mut limits = nvmlSetMemoryLimits_v1_t {
            nameSpace: name_space.as_ptr(),
            softLimit: soft,
            hardLimit: hard,
        };
        nvmlDeviceSetMemoryLimits_v1(device, &mut limits)
    }

    /// `(result, soft, hard, currentUsed)` of a get.
    fn get(device: nvmlDevice_t, name_space: &CStr) -> (nvmlReturn_t, u64, u64, u64) {
        let mut limits = nvmlGetMemoryLimits_v1_t {
            nameSpace: name_space.as_ptr(),
            softLimit: 1,
            hardLimit: 2,
            currentUsed: 3,
        };
        let result = nvmlDeviceGetMemoryLimits_v1(device, &mut limits);
        assert_eq!(limits.nameSpace, name_space.as_ptr());
        (
            result,
            limits.softLimit,
            limits.hardLimit,
            limits.currentUsed,
        )
    }

    fn log_lines(path: &Path) -> Vec<serde_json::Value> {
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .map(|line| serde_json::from_str(line).expect("a JSON line"))
            .collect()
    }

    #[test]
    fn memory_limits_are_function_not_found_by_default() {
        let dir = TempDir::new("default");
        let log = dir.0.join("limits.jsonl");
        let cgroup = dir.c_path("");
        let _state = init_with(FakeNode {
            gpus: vec![h100("GPU-a", "00000000:19:00.0")],
            memory_limits_log: Some(log.clone()),
            ..FakeNode::default()
        });
        assert_eq!(
            set(handle(0), &cgroup, 0, 1 << 30),
            ERROR_FUNCTION_NOT_FOUND
        );
        assert_eq!(get(handle(0), &cgroup).0, ERROR_FUNCTION_NOT_FOUND);
        assert_eq!(
            nvmlDeviceSetMemoryLimits_v1(handle(0), std::ptr::null_mut()),
            ERROR_FUNCTION_NOT_FOUND
        );
        assert!(!log.exists(), "nothing logged");
        assert!(
            STATE
                .lock()
                .unwrap()
                .as_ref()
                .unwrap()
                .memory_limits
                .is_empty()
        );
        assert_eq!(nvmlShutdown(), SUCCESS);
        assert_eq!(set(handle(0), &cgroup, 0, 1 << 30), ERROR_UNINITIALIZED);
    }

    #[test]
    fn memory_limits_round_trip_per_gpu_and_cgroup() {
        let dir = TempDir::new("round-trip");
        std::fs::create_dir(dir.0.join("pod")).unwrap();
        let (cgroup, pod) = (dir.c_path(""), dir.c_path("pod"));
        let _state = init_with(limits_node(None));
        assert_eq!(
            get(handle(0), &cgroup),
            (SUCCESS, 0, DEVICE_MEMORY_LIMIT_MAX, 0)
        );
        assert_eq!(set(handle(0), &cgroup, 1 << 30, 2 << 30), SUCCESS);
        assert_eq!(set(handle(1), &pod, 0, 80 << 30), SUCCESS);
        assert_eq!(get(handle(0), &cgroup), (SUCCESS, 1 << 30, 2 << 30, 0));
        assert_eq!(get(handle(1), &pod), (SUCCESS, 0, 80 << 30, 0));
        // Per GPU and per cgroup.
        assert_eq!(
            get(handle(1), &cgroup),
            (SUCCESS, 0, DEVICE_MEMORY_LIMIT_MAX, 0)
        );
        assert_eq!(
            get(handle(0), &pod),
            (SUCCESS, 0, DEVICE_MEMORY_LIMIT_MAX, 0)
        );
        // A soft limit alone (hard MAX) is a limit.
        assert_eq!(
            set(handle(0), &pod, 4 << 30, DEVICE_MEMORY_LIMIT_MAX),
            SUCCESS
        );
        assert_eq!(
            get(handle(0), &pod),
            (SUCCESS, 4 << 30, DEVICE_MEMORY_LIMIT_MAX, 0)
        );
        // Get needs no directory.
        assert_eq!(
            get(handle(0), c"/sys/fs/cgroup/no/such/cgroup"),
            (SUCCESS, 0, DEVICE_MEMORY_LIMIT_MAX, 0)
        );
        assert_eq!(get(handle(2), &cgroup).0, ERROR_INVALID_ARGUMENT);
        assert_eq!(get(std::ptr::null_mut(), &cgroup).0, ERROR_INVALID_ARGUMENT);
        assert_eq!(
            nvmlDeviceGetMemoryLimits_v1(handle(0), std::ptr::null_mut()),
            ERROR_INVALID_ARGUMENT
        );
        let mut no_name = nvmlGetMemoryLimits_v1_t {
            nameSpace: std::ptr::null(),
            softLimit: 0,
            hardLimit: 0,
            currentUsed: 0,
        };
        assert_eq!(
            nvmlDeviceGetMemoryLimits_v1(handle(0), &mut no_name),
            ERROR_INVALID_ARGUMENT
        );
        assert_eq!(nvmlShutdown(), SUCCESS);
        assert_eq!(get(handle(0), &cgroup).0, ERROR_UNINITIALIZED);
    }

    #[test]
    fn memory_limits_clear() {
        let dir = TempDir::new("clear");
        let cgroup = dir.c_path("");
        let _state = init_with(limits_node(None));
        assert_eq!(set(handle(0), &cgroup, 1 << 30, 2 << 30), SUCCESS);
        assert_eq!(set(handle(0), &cgroup, 0, DEVICE_MEMORY_LIMIT_MAX), SUCCESS);
        assert_eq!(
            get(handle(0), &cgroup),
            (SUCCESS, 0, DEVICE_MEMORY_LIMIT_MAX, 0)
        );
        assert!(
            STATE
                .lock()
                .unwrap()
                .as_ref()
                .unwrap()
                .memory_limits
                .is_empty()
        );
        // Clearing what was never set succeeds too.
        assert_eq!(set(handle(1), &cgroup, 0, DEVICE_MEMORY_LIMIT_MAX), SUCCESS);
    }

    #[test]
    fn memory_limits_refuse_a_cgroup_that_does_not_exist() {
        let dir = TempDir::new("missing");
        std::fs::write(dir.0.join("file"), "").unwrap();
        let _state = init_with(limits_node(None));
        for name_space in [
            dir.c_path("gone"),
            dir.c_path("file"),
            std::ffi::CString::new("relative/cgroup").unwrap(),
            std::ffi::CString::new("").unwrap(),
        ] {
            assert_eq!(
                set(handle(0), &name_space, 0, 1 << 30),
                ERROR_INVALID_ARGUMENT,
                "{name_space:?}"
            );
        }
        let mut no_name = nvmlSetMemoryLimits_v1_t {
            nameSpace: std::ptr::null(),
            softLimit: 0,
            hardLimit: 1 << 30,
        };
        assert_eq!(
            nvmlDeviceSetMemoryLimits_v1(handle(0), &mut no_name),
            ERROR_INVALID_ARGUMENT
        );
        assert_eq!(
            nvmlDeviceSetMemoryLimits_v1(handle(0), std::ptr::null_mut()),
            ERROR_INVALID_ARGUMENT
        );
        let cgroup = dir.c_path("");
        assert_eq!(set(handle(2), &cgroup, 0, 1 << 30), ERROR_INVALID_ARGUMENT);
        assert_eq!(
            set(std::ptr::null_mut(), &cgroup, 0, 1 << 30),
            ERROR_INVALID_ARGUMENT
        );
        assert!(
            STATE
                .lock()
                .unwrap()
                .as_ref()
                .unwrap()
                .memory_limits
                .is_empty()
        );
    }

    #[test]
    fn memory_limits_refuse_soft_above_hard() {
        let dir = TempDir::new("soft-above-hard");
        let cgroup = dir.c_path("");
        let _state = init_with(limits_node(None));
        assert_eq!(
            set(handle(0), &cgroup, 2 << 30, 1 << 30),
            ERROR_INVALID_ARGUMENT
        );
        assert_eq!(set(handle(0), &cgroup, 2 << 30, 2 << 30), SUCCESS);
        assert_eq!(
            set(handle(0), &cgroup, 3 << 30, 2 << 30),
            ERROR_INVALID_ARGUMENT
        );
        // A refused set leaves the earlier limits.
        assert_eq!(get(handle(0), &cgroup), (SUCCESS, 2 << 30, 2 << 30, 0));
    }

    #[test]
    fn memory_limits_refuse_hard_above_the_gpu_memory() {
        let dir = TempDir::new("hard-above-memory");
        let cgroup = dir.c_path("");
        let _state = init_with(limits_node(None));
        assert_eq!(
            set(handle(0), &cgroup, 0, (80 << 30) + 1),
            ERROR_INVALID_ARGUMENT
        );
        assert_eq!(
            set(handle(0), &cgroup, 0, DEVICE_MEMORY_LIMIT_MAX - 1),
            ERROR_INVALID_ARGUMENT
        );
        assert_eq!(set(handle(0), &cgroup, 0, 80 << 30), SUCCESS);
        assert_eq!(get(handle(0), &cgroup), (SUCCESS, 0, 80 << 30, 0));
    }

    #[test]
    fn memory_limits_log_every_set_call() {
        let dir = TempDir::new("log");
        let log = dir.0.join("limits.jsonl");
        let cgroup = dir.c_path("");
        let missing = dir.c_path("gone");
        let _state = init_with(limits_node(Some(log.clone())));
        assert_eq!(set(handle(1), &cgroup, 1 << 30, 2 << 30), SUCCESS);
        assert_eq!(get(handle(1), &cgroup).0, SUCCESS);
        assert_eq!(set(handle(0), &missing, 0, 1 << 30), ERROR_INVALID_ARGUMENT);
        assert_eq!(
            nvmlDeviceSetMemoryLimits_v1(handle(5), std::ptr::null_mut()),
            ERROR_INVALID_ARGUMENT
        );
        let pid = std::process::id();
        assert_eq!(
            log_lines(&log),
            [
                serde_json::json!({
                    "uuid": "GPU-b", "nameSpace": cgroup.to_str().unwrap(),
                    "softLimit": 1u64 << 30, "hardLimit": 2u64 << 30, "pid": pid, "result": 0,
                }),
                serde_json::json!({
                    "uuid": "GPU-a", "nameSpace": missing.to_str().unwrap(),
                    "softLimit": 0, "hardLimit": 1u64 << 30, "pid": pid, "result": 2,
                }),
                serde_json::json!({
                    "uuid": null, "nameSpace": null, "softLimit": null, "hardLimit": null,
                    "pid": pid, "result": 2,
                }),
            ]
        );
        // Not logged once shut down.
        assert_eq!(nvmlShutdown(), SUCCESS);
        assert_eq!(
            set(handle(1), &cgroup, 1 << 30, 2 << 30),
            ERROR_UNINITIALIZED
        );
        assert_eq!(log_lines(&log).len(), 3);
    }

    #[test]
    fn memory_limit_fields_come_from_the_json() {
        let node: FakeNode = serde_json::from_str(
            r#"{"gpus": [], "memoryLimits": true, "memoryLimitsLog": "/tmp/limits.jsonl"}"#,
        )
        .unwrap();
        assert!(node.memory_limits);
        assert_eq!(
            node.memory_limits_log,
            Some(PathBuf::from("/tmp/limits.jsonl"))
        );
        let node: FakeNode = serde_json::from_str(r#"{"gpus": []}"#).unwrap();
        assert!(!node.memory_limits);
        assert_eq!(node.memory_limits_log, None);
    }
}
