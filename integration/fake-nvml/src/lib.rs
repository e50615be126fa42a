//! A fake `libnvidia-ml.so`. `nvml-wrapper` loads it through its library-path
//! option, so the real binding code runs against GPUs described by the JSON file
//! named in `TESSERA_FAKE_NVML_CONFIG`, or else `fake-nvml.json` beside the
//! library file (copy the library into a directory per fake node: each copy is
//! loaded as its own library, with its own state):
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
//! Only the functions Tessera calls exist; nvml-wrapper reports any other as
//! missing. XID events are delivered by `nvmlEventSetWait_v2`, each once, no
//! earlier than `afterMs` after `nvmlInit`.

use std::ffi::{c_char, c_uint, c_ulonglong};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nvml_wrapper_sys::bindings::{
    nvmlDevice_st, nvmlDevice_t, nvmlEnableState_t, nvmlEventData_t, nvmlEventSet_st,
    nvmlEventSet_t, nvmlGpuTopologyLevel_t, nvmlMemory_v2_t, nvmlPciInfo_t, nvmlReturn_t,
};
use serde::Deserialize;

const SUCCESS: nvmlReturn_t = 0;
const ERROR_UNINITIALIZED: nvmlReturn_t = 1;
const ERROR_INVALID_ARGUMENT: nvmlReturn_t = 2;
const ERROR_NOT_SUPPORTED: nvmlReturn_t = 3;
const ERROR_INSUFFICIENT_SIZE: nvmlReturn_t = 7;
const ERROR_DRIVER_NOT_LOADED: nvmlReturn_t = 9;
const ERROR_TIMEOUT: nvmlReturn_t = 10;
const ERROR_UNKNOWN: nvmlReturn_t = 999;

/// NVML's XID critical error event type.
const EVENT_XID_CRITICAL_ERROR: c_ulonglong = 0x8;

/// The JSON description.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct FakeNode {
    /// `nvmlSystemGetDriverVersion`.
    #[serde(default)]
    pub driver_version: String,
    /// The GPUs, by index.
    #[serde(default)]
    pub gpus: Vec<FakeGpu>,
    /// XID events to deliver.
    #[serde(default)]
    pub xid_events: Vec<FakeXid>,
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
    (device as usize)
        .checked_sub(1)
        .and_then(|index| state.node.gpus.get(index))
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
    let pending = node.xid_events.clone();
    *guard = Some(State {
        refs: 1,
        node,
        started: Instant::now(),
        pending,
    });
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> nvmlReturn_t {
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

#[unsafe(no_mangle)]
pub extern "C" fn nvmlErrorString(_result: nvmlReturn_t) -> *const c_char {
    c"tessera fake NVML error".as_ptr()
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlSystemGetDriverVersion(version: *mut c_char, length: c_uint) -> nvmlReturn_t {
    status(with_state(|s| {
        write_string(&s.node.driver_version, version, length)
    }))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> nvmlReturn_t {
    status(with_state(|s| write(count, s.node.gpus.len() as c_uint)))
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

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    status(with_state(|s| {
        let total = gpu(s, device)?.memory_bytes;
        write(
            memory,
            nvmlMemory_v2_t {
                version: 0x0200_0028,
                total,
                reserved: 0,
                free: total,
                used: 0,
            },
        )
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
        let on = gpu(s, device)?.nvlinks.iter().any(|l| l.link == link);
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
