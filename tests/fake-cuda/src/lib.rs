//! # fake-cuda — a test-only CUDA driver library (`libcuda.so.1`)
//!
//! A `cdylib` (`libfake_cuda.so`) exporting part of the CUDA driver API with the C ABI of
//! `cuda.h` (`CUresult` = `int`, handles are pointers, `CUdevice` = `int`, `CUuuid` = 16
//! bytes). Work submitted through it runs on the simulated GPUs of `coloc-sim` (state file
//! named by `COLOC_SIM_STATE`), so a program that reaches the driver as the CUDA 12
//! runtime does — `dlopen("libcuda.so.1")`, `dlsym(h, "cuGetProcAddress_v2")`, everything
//! else through that getter — drives the simulated GPU, and an `LD_PRELOAD` shim in front
//! of it sees the same calls as in front of the real driver. Tests put it on
//! `LD_LIBRARY_PATH` under the name `libcuda.so.1` with `coloc_sim::fake_libcuda_dir`.
//!
//! ## Test conventions (what the real driver would compute)
//!
//! - **Kernel duration**: every function from `cuModuleGetFunction` (any name, any module
//!   image) is busy on the GPU for the nanoseconds in its *first parameter*:
//!   `kernelParams[0]` points to a `u64`. The same for `cuLaunchKernelEx` and
//!   `cuLaunchCooperativeKernel`. With `kernelParams == NULL` the duration is the first 8
//!   bytes of the `extra` buffer (`CU_LAUNCH_PARAM_BUFFER_POINTER`), or 0 without one.
//! - **Graphs**: `coloc_fake_graph(ns)` (an extra export, not in `cuda.h`) returns a
//!   `CUgraphExec` whose `cuGraphLaunch` is busy for `ns`; `cuGraphExecDestroy` frees it.
//!   Other handle values are `CUDA_ERROR_INVALID_HANDLE`.
//! - **Stream capture** (`cuStreamBeginCapture[_v2]`, `cuStreamEndCapture`,
//!   `cuStreamIsCapturing`, `cuThreadExchangeStreamCaptureMode`, then
//!   `cuGraphInstantiateWithFlags`, `cuGraphDestroy`): created streams only (a default
//!   stream: `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`). A submission to a stream in capture
//!   runs nothing and is not counted: it adds its duration to the capture (a host function
//!   is never called); an event recorded there is a captured event (query or wait:
//!   `CUDA_ERROR_CAPTURED_EVENT`, 907). The executable graph's `cuGraphLaunch` is one
//!   submission busy for the captured durations' sum. The rule of the real driver for
//!   *potentially unsafe* calls (here `cuEventQuery`, `cuEventSynchronize`,
//!   `cuStreamQuery`, `cuStreamSynchronize`, `cuCtxSynchronize`): on the capturing stream
//!   itself, or from a thread whose exchanged mode is not RELAXED while any capture is in
//!   mode GLOBAL, the call answers `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` (900) and
//!   invalidates the capture(s): `cuStreamEndCapture` then answers
//!   `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` (901). (THREAD_LOCAL captures are not
//!   checked against other calls of their own thread: simplification.)
//! - **Copies and memsets** (`cuMemcpy{HtoD,DtoH,DtoD}Async_v2`, `cuMemsetD{8,32}Async`):
//!   10 GB/s, i.e. 0.1 ns per byte, at least 1 µs. No data moves (device memory does not
//!   exist); device ranges must lie inside one `cuMemAlloc` allocation
//!   (`CUDA_ERROR_INVALID_VALUE` otherwise). The synchronous copies
//!   (`cuMemcpy{DtoH,HtoD}_v2`, `_ptds`: the per-thread default stream) go to the default
//!   stream as the real driver's do: `DtoH` returns once the copy completed, `HtoD` once
//!   the stream's earlier work completed and the copy is queued (from pageable memory the
//!   real driver returns once the data is staged, its DMA maybe still running).
//! - **Host functions** (`cuLaunchHostFunc`): a zero-length submission; the callback runs
//!   on the library's one callback thread (in submission order) once the work submitted
//!   before it has completed. Stream and context synchronisation also wait for the
//!   callbacks enqueued before them; work submitted after a callback does *not* wait for
//!   it (simplification).
//!
//! ## Model
//!
//! - Device ordinal `i` is simulated GPU `i`, or, with `CUDA_VISIBLE_DEVICES` set, the
//!   `i`-th GPU listed there (indices, or `GPU-…` UUID prefixes; the list ends at the
//!   first invalid or repeated entry, as in the real driver; an empty list: no device).
//! - UUIDs: `coloc_sim::gpu_uuid(gpu)` = `c0 10 c5 17 00…00 hi lo`, the bytes whose NVML
//!   form (`coloc_sim::uuid_string`) the fake NVML library answers.
//! - A process holds one sim slot per GPU on which it has a live context (registered at
//!   the first context creation or primary-context retain, released with the last);
//!   its memory is the sum of its `cuMemAlloc`s there. All streams and contexts of the
//!   process on one GPU share that slot's FIFO (simplification: no concurrency between
//!   streams). A submission adds its duration to the slot (`SlotHandle::submit`) and
//!   returns at once; as on a real stream, once 1024 submissions of the process on that
//!   GPU are outstanding the next one blocks until the oldest completes. Queued work
//!   keeps running when the process is stopped (the simulated GPU's drain).
//! - **Counters**: `coloc_fake_stats` (an extra export) fills a [`FakeStats`]: submissions
//!   accepted, and the most submissions outstanding at once on one stream (the default
//!   streams of a GPU count as one) and on one GPU, counted at each submission. This is how
//!   tests see an in-flight bound (`COLOC_SHIM_INFLIGHT`) from outside the shim. It also
//!   counts every call of a `cuda.h` entry point (`driver_calls`), so that a test can hold
//!   a shim to a number of driver calls per launch.
//! - Events capture the completion target of their stream at `cuEventRecord`
//!   (`cuEventQuery`: `CUDA_SUCCESS` or `CUDA_ERROR_NOT_READY`; never recorded:
//!   `CUDA_SUCCESS`). `cuEventSynchronize`, `cuStreamSynchronize`, `cuCtxSynchronize` wait
//!   (futex, `SlotHandle::wait_completed`) for everything submitted before the call on
//!   that stream (created streams), or by the process on that GPU (the default streams
//!   `0`, `CU_STREAM_LEGACY`, `CU_STREAM_PER_THREAD`, and contexts).
//! - Contexts: a per-thread stack (`cuCtxCreate_v2` pushes, `cuCtxSetCurrent` replaces
//!   the top, `cuCtxPushCurrent_v2`/`cuCtxPopCurrent_v2`); the primary context of a
//!   device has one handle for the process's life and is active while retained.
//!   Destroying a context frees its streams, events, modules and allocations.
//! - `cuGetProcAddress` (4 args) and `cuGetProcAddress_v2` (5 args): lookup by *base
//!   name* (`"cuMemAlloc"` gives `cuMemAlloc_v2`; `"cuGetProcAddress"` gives the v2
//!   getter from `cudaVersion` 12000, the v1 one below; `"cuDeviceGetUuid"` the v2 from
//!   11040). Flag `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM` (2) gives the `_ptsz`
//!   variant where one exists; 0 (default) and 1 (legacy) the plain one. Unknown name:
//!   `CUDA_ERROR_NOT_FOUND` (500), query result `CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND`;
//!   a version below the entry point's first: `…_VERSION_NOT_SUFFICIENT`. Full exported
//!   names (`"cuMemAlloc_v2"`) are not base names and are not found.
//! - Errors: `cuInit` not called: `CUDA_ERROR_NOT_INITIALIZED` (3) (`cuDriverGetVersion`,
//!   `cuGetErrorName`/`String` and the getters work before it); `COLOC_SIM_STATE` unset
//!   or not a state file: `cuInit` answers `CUDA_ERROR_NO_DEVICE` (100) and prints one
//!   line on stderr; unknown handles: `CUDA_ERROR_INVALID_HANDLE` (400); no current
//!   context: `CUDA_ERROR_INVALID_CONTEXT` (201). No panic crosses the C boundary (a
//!   caught one answers `CUDA_ERROR_UNKNOWN`). A child forked after `cuInit` gets
//!   `CUDA_ERROR_NOT_INITIALIZED`.
//! - **Memory**: a GPU's memory (`coloc-sim gpu --memory-gib`, 80 GiB by default) is
//!   shared by every process on it: a `cuMemAlloc` that does not fit answers
//!   `CUDA_ERROR_OUT_OF_MEMORY`.
//! - **The checkpoint API** (`cuCheckpointProcess*`, see `checkpoint.rs` and
//!   `coloc_sim::checkpoint`): a restore thread started at `cuInit` carries out lock,
//!   checkpoint, restore and unlock on this process, so a stopped process stalls its
//!   callers as on the real driver; while locked, every entry point that needs the
//!   initialised driver blocks.
//! - `cuGetExportTable` answers `CUDA_ERROR_NOT_SUPPORTED` (the real CUDA runtime needs
//!   its private tables, so the runtime itself does not run on this library; programs
//!   that call the driver API, like `coloc-sim online --cuda`, do).
#![allow(non_snake_case, clippy::missing_safety_doc)]

use coloc_sim::checkpoint::ProcEntry;
use coloc_sim::{gpu_uuid, uuid_string, SimGpu, SlotHandle};

mod checkpoint;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard, OnceLock};

/// `CUresult`.
pub type CUresult = c_int;
/// `CUdevice`: the ordinal.
pub type CUdevice = c_int;
/// `CUdeviceptr`.
pub type CUdeviceptr = u64;
/// `CUcontext`.
pub type CUcontext = *mut c_void;
/// `CUstream`.
pub type CUstream = *mut c_void;
/// `CUevent`.
pub type CUevent = *mut c_void;
/// `CUmodule`.
pub type CUmodule = *mut c_void;
/// `CUfunction`.
pub type CUfunction = *mut c_void;
/// `CUgraphExec`.
pub type CUgraphExec = *mut c_void;
/// `CUgraph`.
pub type CUgraph = *mut c_void;
/// `CUhostFn`.
pub type CUhostFn = Option<unsafe extern "C" fn(*mut c_void)>;

/// `CUuuid`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CUuuid {
    /// The 16 bytes.
    pub bytes: [c_char; 16],
}

/// `CUlaunchConfig` (for `cuLaunchKernelEx`).
#[repr(C)]
#[derive(Debug)]
pub struct CUlaunchConfig {
    pub gridDimX: c_uint,
    pub gridDimY: c_uint,
    pub gridDimZ: c_uint,
    pub blockDimX: c_uint,
    pub blockDimY: c_uint,
    pub blockDimZ: c_uint,
    pub sharedMemBytes: c_uint,
    pub hStream: CUstream,
    pub attrs: *mut c_void,
    pub numAttrs: c_uint,
}

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
pub const CUDA_ERROR_NO_DEVICE: CUresult = 100;
pub const CUDA_ERROR_INVALID_DEVICE: CUresult = 101;
pub const CUDA_ERROR_INVALID_IMAGE: CUresult = 200;
pub const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;
pub const CUDA_ERROR_OPERATING_SYSTEM: CUresult = 304;
pub const CUDA_ERROR_INVALID_HANDLE: CUresult = 400;
pub const CUDA_ERROR_ILLEGAL_STATE: CUresult = 401;
pub const CUDA_ERROR_NOT_FOUND: CUresult = 500;
pub const CUDA_ERROR_NOT_READY: CUresult = 600;
pub const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;
pub const CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: CUresult = 900;
pub const CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: CUresult = 901;
pub const CUDA_ERROR_CAPTURED_EVENT: CUresult = 907;
pub const CUDA_ERROR_TIMEOUT: CUresult = 909;
pub const CUDA_ERROR_UNKNOWN: CUresult = 999;

/// `CUdriverProcAddressQueryResult` values.
pub const CU_GET_PROC_ADDRESS_SUCCESS: c_int = 0;
pub const CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND: c_int = 1;
pub const CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT: c_int = 2;
/// `CUstreamCaptureMode` values.
pub const CU_STREAM_CAPTURE_MODE_GLOBAL: c_int = 0;
pub const CU_STREAM_CAPTURE_MODE_THREAD_LOCAL: c_int = 1;
pub const CU_STREAM_CAPTURE_MODE_RELAXED: c_int = 2;
/// `CUstreamCaptureStatus` values.
pub const CU_STREAM_CAPTURE_STATUS_NONE: c_int = 0;
pub const CU_STREAM_CAPTURE_STATUS_ACTIVE: c_int = 1;
pub const CU_STREAM_CAPTURE_STATUS_INVALIDATED: c_int = 2;
/// `cuGetProcAddress` flags.
pub const CU_GET_PROC_ADDRESS_DEFAULT: u64 = 0;
pub const CU_GET_PROC_ADDRESS_LEGACY_STREAM: u64 = 1;
pub const CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: u64 = 2;

/// What `cuDriverGetVersion` answers (CUDA 12.4).
pub const DRIVER_VERSION: c_int = 12040;
/// Submissions of a process on one GPU that may be outstanding before a launch blocks.
pub const MAX_OUTSTANDING: usize = 1024;
/// Simulated copy bandwidth: bytes per nanosecond (10 GB/s).
pub const COPY_BYTES_PER_NS: u64 = 10;
/// Shortest copy or memset, ns.
pub const MIN_COPY_NS: u64 = 1_000;
/// `cuDeviceGetName` (the fake NVML's name too).
pub const DEVICE_NAME: &str = "Simulated GPU (coloc-sim)";

const CU_STREAM_LEGACY: usize = 1;
const CU_STREAM_PER_THREAD: usize = 2;
const CU_LAUNCH_PARAM_END: usize = 0;
const CU_LAUNCH_PARAM_BUFFER_POINTER: usize = 1;
const CU_LAUNCH_PARAM_BUFFER_SIZE: usize = 2;

type R = Result<(), CUresult>;

// ---------------------------------------------------------------------------------------
// Process-wide state
// ---------------------------------------------------------------------------------------

struct Driver {
    sim: &'static SimGpu,
    /// Ordinal → simulated GPU.
    visible: Vec<u32>,
    pid: u32,
    st: Mutex<State>,
    /// This process in the simulated driver's checkpoint table (see `checkpoint`).
    entry: &'static ProcEntry,
}

type Slot = Arc<SlotHandle<'static>>;

#[derive(Default)]
struct Gpu {
    slot: Option<Slot>,
    /// Live contexts (an active primary context counts once).
    users: u32,
    /// Completion targets of outstanding submissions, oldest first.
    queue: VecDeque<u64>,
    /// The same, of the default streams' submissions only.
    default_queue: VecDeque<u64>,
    mem: u64,
    primary: Option<usize>,
    primary_refs: u32,
}

struct Ctx {
    dev: usize,
    alive: bool,
    primary: bool,
}

struct Stream {
    ctx: usize,
    /// Completion target of its last submission.
    last: u64,
    /// Completion targets of its outstanding submissions, oldest first.
    queue: VecDeque<u64>,
}

struct Event {
    ctx: usize,
    recorded: Option<(Slot, u64)>,
    /// Last recorded on a stream in capture: a node of that graph, not GPU work.
    captured: bool,
}

/// A stream capture in progress.
struct Capture {
    mode: c_int,
    invalidated: bool,
    /// Work submissions captured, and their GPU time.
    nodes: u64,
    ns: u64,
}

struct Alloc {
    size: u64,
    ctx: usize,
}

#[derive(Default)]
struct State {
    next_handle: usize,
    next_dptr: u64,
    gpus: Vec<Gpu>,
    ctxs: HashMap<usize, Ctx>,
    streams: HashMap<usize, Stream>,
    events: HashMap<usize, Event>,
    /// Module → context.
    modules: HashMap<usize, usize>,
    /// Function → module.
    funcs: HashMap<usize, usize>,
    /// Graph exec → ns.
    graphs: HashMap<usize, u64>,
    /// Created stream → its capture in progress.
    captures: HashMap<usize, Capture>,
    /// Graph (from `cuStreamEndCapture`) → (nodes, ns).
    captured_graphs: HashMap<usize, (u64, u64)>,
    allocs: BTreeMap<u64, Alloc>,
    stats: FakeStats,
}

/// Counters of this process's submissions ([`coloc_fake_stats`]).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct FakeStats {
    /// Submissions accepted (kernels, graphs, copies, memsets, host functions).
    pub submissions: u64,
    /// Most submissions outstanding (submitted, not complete) on one stream at once,
    /// counted when a submission is accepted. The default streams (`0`,
    /// `CU_STREAM_LEGACY`, `CU_STREAM_PER_THREAD`) of a GPU count as one stream.
    pub max_outstanding_stream: u64,
    /// Most submissions of the process outstanding on one GPU at once.
    pub max_outstanding_gpu: u64,
    /// Submissions that found their stream with nothing outstanding: the GPU had run dry
    /// for that stream and waited for this one.
    pub idle_stream_submissions: u64,
    /// Entry points of `cuda.h` called in this process so far (every call, whatever it
    /// answered; the test helpers `coloc_fake_*` excepted). A shim's own calls are the
    /// difference to the same program without it.
    pub driver_calls: u64,
}

/// Calls of `cuda.h` entry points in this process ([`FakeStats::driver_calls`]).
static DRIVER_CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

static DRIVER: OnceLock<Result<Driver, CUresult>> = OnceLock::new();

/// This process's PID, cached (`getpid` is a system call; every entry point checks it, to
/// refuse use after a fork as the real driver does). Reset in a forked child.
static PID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

fn my_pid() -> u32 {
    use std::sync::atomic::Ordering::Relaxed;
    match PID.load(Relaxed) {
        0 => {
            extern "C" fn forked() {
                PID.store(0, std::sync::atomic::Ordering::Relaxed);
            }
            static ATFORK: std::sync::Once = std::sync::Once::new();
            // SAFETY: registering a plain extern "C" function.
            ATFORK.call_once(|| unsafe {
                libc::pthread_atfork(None, None, Some(forked));
            });
            let p = std::process::id();
            PID.store(p, Relaxed);
            p
        }
        p => p,
    }
}

thread_local! {
    static CTX_STACK: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

fn drv() -> Result<&'static Driver, CUresult> {
    let d = drv_unlocked()?;
    // A process locked through the checkpoint API: its driver calls block.
    d.entry.wait_gate();
    Ok(d)
}

/// The driver without waiting for a checkpoint lock (the restore thread, exit).
fn drv_unlocked() -> Result<&'static Driver, CUresult> {
    match DRIVER.get() {
        Some(Ok(d)) if d.pid == my_pid() => Ok(d),
        _ => Err(CUDA_ERROR_NOT_INITIALIZED),
    }
}

impl Driver {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn init() -> Result<Driver, CUresult> {
    let sim = match SimGpu::from_env() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("fake libcuda: {e:#}; cuInit answers CUDA_ERROR_NO_DEVICE");
            return Err(CUDA_ERROR_NO_DEVICE);
        }
    };
    let n = sim.n_gpus();
    let visible = parse_visible(std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref(), n);
    if visible.is_empty() {
        eprintln!("fake libcuda: CUDA_VISIBLE_DEVICES selects none of the {n} simulated GPU(s): CUDA_ERROR_NO_DEVICE");
        return Err(CUDA_ERROR_NO_DEVICE);
    }
    let sim: &'static SimGpu = Box::leak(Box::new(sim));
    let entry = sim.register_proc().map_err(|e| {
        eprintln!("fake libcuda: {e:#}");
        CUDA_ERROR_OUT_OF_MEMORY
    })?;
    let st = State {
        next_handle: 0x5eed_0000_0000,
        next_dptr: 0x7f00_0000_0000,
        gpus: visible.iter().map(|_| Gpu::default()).collect(),
        ..State::default()
    };
    // Release this process's slots at exit (the daemon would reap them later anyway).
    // SAFETY: registering a plain extern "C" function.
    unsafe { libc::atexit(release_at_exit) };
    checkpoint::start_restore_thread(entry);
    Ok(Driver {
        sim,
        visible,
        pid: std::process::id(),
        st: Mutex::new(st),
        entry,
    })
}

extern "C" fn release_at_exit() {
    if let Some(Ok(d)) = DRIVER.get() {
        d.sim.unregister_pid(std::process::id());
        d.sim.unregister_proc(std::process::id());
    }
}

/// `CUDA_VISIBLE_DEVICES` as the driver reads it: comma-separated indices or `GPU-` UUID
/// prefixes, up to the first invalid or repeated entry. Unset: every GPU.
pub fn parse_visible(spec: Option<&str>, n_gpus: u32) -> Vec<u32> {
    let Some(spec) = spec else {
        return (0..n_gpus).collect();
    };
    let mut out = Vec::new();
    for tok in spec.split(',') {
        let t = tok.trim();
        let gpu = if t.starts_with("GPU-") {
            let m: Vec<u32> = (0..n_gpus)
                .filter(|&g| uuid_string(&gpu_uuid(g)).starts_with(t))
                .collect();
            match m[..] {
                [g] => Some(g),
                _ => None,
            }
        } else {
            t.parse::<u32>().ok().filter(|&g| g < n_gpus)
        };
        match gpu {
            Some(g) if !out.contains(&g) => out.push(g),
            _ => break,
        }
    }
    out
}

impl State {
    fn handle(&mut self) -> usize {
        self.next_handle += 0x40;
        self.next_handle
    }

    /// The calling thread's current context, alive.
    fn current(&self) -> Result<usize, CUresult> {
        let c = current_ctx().ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        self.alive(c)
    }

    fn alive(&self, c: usize) -> Result<usize, CUresult> {
        match self.ctxs.get(&c) {
            Some(x) if x.alive => Ok(c),
            Some(_) => Err(CUDA_ERROR_INVALID_CONTEXT),
            None => Err(CUDA_ERROR_INVALID_CONTEXT),
        }
    }

    /// A stream handle → (context, created stream or None for a default stream).
    fn stream(&self, s: CUstream) -> Result<(usize, Option<usize>), CUresult> {
        let s = s as usize;
        if s == 0 || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD {
            return Ok((self.current()?, None));
        }
        let st = self.streams.get(&s).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        Ok((self.alive(st.ctx)?, Some(s)))
    }

    fn slot_of(&self, ctx: usize) -> Result<Slot, CUresult> {
        let dev = self.ctxs.get(&ctx).ok_or(CUDA_ERROR_INVALID_CONTEXT)?.dev;
        self.gpus[dev]
            .slot
            .clone()
            .ok_or(CUDA_ERROR_INVALID_CONTEXT)
    }

    /// What a sync or record on stream `s` waits for.
    fn stream_target(&self, s: CUstream) -> Result<(Slot, u64), CUresult> {
        let (ctx, stream) = self.stream(s)?;
        let slot = self.slot_of(ctx)?;
        let t = match stream {
            Some(s) => self.streams[&s].last,
            None => slot.submitted(),
        };
        Ok((slot, t))
    }

    fn attach(&mut self, sim: &'static SimGpu, phys: u32, dev: usize) -> R {
        let g = &mut self.gpus[dev];
        if g.slot.is_none() {
            let slot = sim.register(phys, g.mem).map_err(|e| {
                eprintln!("fake libcuda: {e:#}");
                CUDA_ERROR_OUT_OF_MEMORY
            })?;
            g.slot = Some(Arc::new(slot));
            g.queue.clear();
            g.default_queue.clear();
        }
        g.users += 1;
        Ok(())
    }

    fn detach(&mut self, dev: usize) {
        let g = &mut self.gpus[dev];
        g.users = g.users.saturating_sub(1);
        if g.users == 0 {
            g.slot = None;
            g.queue.clear();
            g.default_queue.clear();
        }
    }

    /// Frees what context `c` owns.
    fn free_ctx_objects(&mut self, c: usize) {
        self.streams.retain(|_, s| s.ctx != c);
        self.events.retain(|_, e| e.ctx != c);
        let mods: Vec<usize> = self
            .modules
            .iter()
            .filter(|(_, &x)| x == c)
            .map(|(&m, _)| m)
            .collect();
        for m in mods {
            self.modules.remove(&m);
            self.funcs.retain(|_, x| *x != m);
        }
        let dev = self.ctxs[&c].dev;
        let mut freed = 0;
        self.allocs.retain(|_, a| {
            let mine = a.ctx == c;
            if mine {
                freed += a.size;
            }
            !mine
        });
        self.set_mem(dev, self.gpus[dev].mem.saturating_sub(freed));
    }

    fn set_mem(&mut self, dev: usize, mem: u64) {
        let g = &mut self.gpus[dev];
        g.mem = mem;
        if let Some(s) = &g.slot {
            s.set_mem_bytes(mem);
        }
    }

    /// The allocation holding `[p, p + n)`, if any.
    fn check_range(&self, p: CUdeviceptr, n: u64) -> R {
        match self.allocs.range(..=p).next_back() {
            Some((&start, a)) if p.saturating_add(n) <= start + a.size => Ok(()),
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        }
    }
}

fn current_ctx() -> Option<usize> {
    CTX_STACK
        .try_with(|s| s.borrow().last().copied())
        .ok()
        .flatten()
}

fn with_stack<T>(f: impl FnOnce(&mut Vec<usize>) -> T) -> Result<T, CUresult> {
    CTX_STACK
        .try_with(|s| f(&mut s.borrow_mut()))
        .map_err(|_| CUDA_ERROR_UNKNOWN)
}

/// Runs an entry point's body: no panic crosses the C boundary.
fn ffi(f: impl FnOnce() -> R) -> CUresult {
    DRIVER_CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => CUDA_SUCCESS,
        Ok(Err(e)) => e,
        Err(_) => CUDA_ERROR_UNKNOWN,
    }
}

/// Writes an out-parameter (null: `CUDA_ERROR_INVALID_VALUE`).
fn put<T>(p: *mut T, v: T) -> R {
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null out-parameter from the caller, per the CUDA API contract.
    unsafe { p.write(v) };
    Ok(())
}

fn dev_index(d: &Driver, dev: CUdevice) -> Result<usize, CUresult> {
    usize::try_from(dev)
        .ok()
        .filter(|&i| i < d.visible.len())
        .ok_or(CUDA_ERROR_INVALID_DEVICE)
}

// ---------------------------------------------------------------------------------------
// Submission and waiting
// ---------------------------------------------------------------------------------------

/// Queues `ns` on the stream's GPU slot, blocking while `MAX_OUTSTANDING` submissions are
/// outstanding; returns the slot and the completion target. On a stream in capture: adds
/// a node to the capture instead (nothing runs) and returns `None`.
fn submit(s: CUstream, ns: u64) -> Result<Option<(Slot, u64)>, CUresult> {
    let d = drv()?;
    loop {
        // A lock that arrived while this call waited for room holds it here too.
        d.entry.wait_gate();
        let (slot, oldest) = {
            let mut st = d.lock();
            let (ctx, stream) = st.stream(s)?;
            if let Some(c) = stream.and_then(|x| st.captures.get_mut(&x)) {
                c.nodes += 1;
                c.ns += ns;
                return Ok(None);
            }
            let dev = st.ctxs[&ctx].dev;
            let g = &mut st.gpus[dev];
            let slot = g.slot.clone().ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
            let done = slot.completed();
            while g.queue.front().is_some_and(|&t| t <= done) {
                g.queue.pop_front();
            }
            if g.queue.len() < MAX_OUTSTANDING {
                let t = slot.submit(ns);
                if t > done {
                    g.queue.push_back(t);
                }
                let on_gpu = g.queue.len() as u64;
                let q = match stream.and_then(|x| st.streams.get_mut(&x)) {
                    Some(x) => {
                        x.last = t;
                        &mut x.queue
                    }
                    None => &mut st.gpus[dev].default_queue,
                };
                while q.front().is_some_and(|&x| x <= done) {
                    q.pop_front();
                }
                let idle = q.is_empty();
                if t > done {
                    q.push_back(t);
                }
                let on_stream = q.len() as u64;
                let s = &mut st.stats;
                s.submissions += 1;
                s.max_outstanding_stream = s.max_outstanding_stream.max(on_stream);
                s.max_outstanding_gpu = s.max_outstanding_gpu.max(on_gpu);
                s.idle_stream_submissions += u64::from(idle);
                return Ok(Some((slot, t)));
            }
            let oldest = g.queue.front().copied().unwrap_or(0);
            (slot, oldest)
        };
        // Outside the lock: other threads keep using the library meanwhile.
        slot.wait_completed(oldest);
    }
}

/// Host callbacks: enqueued and run counts, for synchronisation.
static HOST: (Mutex<(u64, u64)>, Condvar) = (Mutex::new((0, 0)), Condvar::new());

struct HostJob {
    slot: Slot,
    target: u64,
    f: unsafe extern "C" fn(*mut c_void),
    data: usize,
}

fn host_queue() -> &'static Mutex<mpsc::Sender<HostJob>> {
    static TX: OnceLock<Mutex<mpsc::Sender<HostJob>>> = OnceLock::new();
    TX.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<HostJob>();
        std::thread::Builder::new()
            .name("fake-cuda-host".into())
            .spawn(move || {
                for job in rx {
                    job.slot.wait_completed(job.target);
                    // SAFETY: the caller's host function with its user data, as CUDA
                    // calls it.
                    unsafe { (job.f)(job.data as *mut c_void) };
                    drop(job.slot);
                    let mut c = HOST.0.lock().unwrap_or_else(|e| e.into_inner());
                    c.1 += 1;
                    HOST.1.notify_all();
                }
            })
            .ok();
        Mutex::new(tx)
    })
}

/// Waits until the host callbacks enqueued so far have run.
fn wait_host_callbacks() {
    let mut c = HOST.0.lock().unwrap_or_else(|e| e.into_inner());
    let upto = c.0;
    while c.1 < upto {
        c = HOST.1.wait(c).unwrap_or_else(|e| e.into_inner());
    }
}

fn kernel_ns(params: *mut *mut c_void, extra: *mut *mut c_void) -> Result<u64, CUresult> {
    // SAFETY: per the cuLaunchKernel contract, kernelParams holds one pointer per kernel
    // parameter (our kernels take a u64 first) and extra is a CU_LAUNCH_PARAM_END-ended
    // list of pairs.
    unsafe {
        if !params.is_null() {
            let p0 = *params;
            if p0.is_null() {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            return Ok((p0 as *const u64).read_unaligned());
        }
        if extra.is_null() {
            return Ok(0);
        }
        let (mut buf, mut size) = (std::ptr::null::<u8>(), 0usize);
        let mut i = 0;
        while i < 64 {
            match *extra.add(i) as usize {
                CU_LAUNCH_PARAM_END => break,
                CU_LAUNCH_PARAM_BUFFER_POINTER => buf = *extra.add(i + 1) as *const u8,
                CU_LAUNCH_PARAM_BUFFER_SIZE => {
                    let p = *extra.add(i + 1) as *const usize;
                    if !p.is_null() {
                        size = *p;
                    }
                }
                _ => return Err(CUDA_ERROR_INVALID_VALUE),
            }
            i += 2;
        }
        if buf.is_null() || size < 8 {
            return Ok(0);
        }
        Ok((buf as *const u64).read_unaligned())
    }
}

#[allow(clippy::too_many_arguments)]
fn launch(
    f: CUfunction,
    grid: [c_uint; 3],
    block: [c_uint; 3],
    s: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> R {
    let d = drv()?;
    if !d.lock().funcs.contains_key(&(f as usize)) {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    if grid.contains(&0)
        || block.contains(&0)
        || block.iter().map(|&b| b as u64).product::<u64>() > 1024
    {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let ns = kernel_ns(params, extra)?;
    submit(s, ns).map(|_| ())
}

fn copy_ns(bytes: u64) -> u64 {
    (bytes / COPY_BYTES_PER_NS).max(MIN_COPY_NS)
}

fn copy(s: CUstream, dev_ranges: &[(CUdeviceptr, u64)], host: Option<*const c_void>, n: u64) -> R {
    let d = drv()?;
    if host.is_some_and(|h| h.is_null()) && n > 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    {
        let st = d.lock();
        for &(p, len) in dev_ranges {
            st.check_range(p, len)?;
        }
    }
    submit(s, copy_ns(n)).map(|_| ())
}

fn stream_sync(s: CUstream) -> R {
    let (slot, t) = {
        let mut st = drv()?.lock();
        st.unsafe_call(Some(s))?;
        st.stream_target(s)?
    };
    slot.wait_completed(t);
    wait_host_callbacks();
    Ok(())
}

fn stream_query(s: CUstream) -> R {
    let (slot, t) = {
        let mut st = drv()?.lock();
        st.unsafe_call(Some(s))?;
        st.stream_target(s)?
    };
    if slot.completed() >= t {
        Ok(())
    } else {
        Err(CUDA_ERROR_NOT_READY)
    }
}

fn event_record(e: CUevent, s: CUstream) -> R {
    let d = drv()?;
    let mut st = d.lock();
    let ev_ctx = st
        .events
        .get(&(e as usize))
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?
        .ctx;
    let (ctx, _) = st.stream(s)?;
    if ctx != ev_ctx {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    if st.captures.contains_key(&(s as usize)) {
        // A node of the graph being captured.
        if let Some(ev) = st.events.get_mut(&(e as usize)) {
            ev.recorded = None;
            ev.captured = true;
        }
        return Ok(());
    }
    let rec = st.stream_target(s)?;
    if let Some(ev) = st.events.get_mut(&(e as usize)) {
        ev.recorded = Some(rec);
        ev.captured = false;
    }
    Ok(())
}

fn stream_get_ctx(s: CUstream, out: *mut CUcontext) -> R {
    let (ctx, _) = drv()?.lock().stream(s)?;
    put(out, ctx as CUcontext)
}

fn stream_wait_event(s: CUstream, e: CUevent, _flags: c_uint) -> R {
    // One FIFO per GPU: work on any stream already runs after everything before it.
    let st = drv()?.lock();
    st.stream(s)?;
    if !st.events.contains_key(&(e as usize)) {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Initialisation, version, devices
// ---------------------------------------------------------------------------------------

#[no_mangle]
pub extern "C" fn cuInit(flags: c_uint) -> CUresult {
    ffi(|| {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        match DRIVER.get_or_init(init) {
            Ok(d) if d.pid == my_pid() => Ok(()),
            Ok(_) => Err(CUDA_ERROR_NOT_INITIALIZED),
            Err(e) => Err(*e),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(v: *mut c_int) -> CUresult {
    ffi(|| put(v, DRIVER_VERSION))
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(n: *mut c_int) -> CUresult {
    ffi(|| put(n, drv()?.visible.len() as c_int))
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(dev: *mut CUdevice, ordinal: c_int) -> CUresult {
    ffi(|| {
        let i = dev_index(drv()?, ordinal)?;
        put(dev, i as CUdevice)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    ffi(|| {
        dev_index(drv()?, dev)?;
        if name.is_null() || len <= 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let b = DEVICE_NAME.as_bytes();
        let n = b.len().min(len as usize - 1);
        // SAFETY: the caller's buffer holds `len` bytes; we write n + 1 <= len.
        unsafe {
            std::ptr::copy_nonoverlapping(b.as_ptr(), name as *mut u8, n);
            *name.add(n) = 0;
        }
        Ok(())
    })
}

fn device_uuid(uuid: *mut CUuuid, dev: CUdevice) -> R {
    let d = drv()?;
    let phys = d.visible[dev_index(d, dev)?];
    let bytes = gpu_uuid(phys).map(|b| b as c_char);
    put(uuid, CUuuid { bytes })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut CUuuid, dev: CUdevice) -> CUresult {
    ffi(|| device_uuid(uuid, dev))
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut CUuuid, dev: CUdevice) -> CUresult {
    ffi(|| device_uuid(uuid, dev))
}

// ---------------------------------------------------------------------------------------
// Contexts
// ---------------------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    ffi(|| {
        let d = drv()?;
        let i = dev_index(d, dev)?;
        if pctx.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut st = d.lock();
        let h = match st.gpus[i].primary {
            Some(h) => h,
            None => {
                let h = st.handle();
                st.ctxs.insert(
                    h,
                    Ctx {
                        dev: i,
                        alive: false,
                        primary: true,
                    },
                );
                st.gpus[i].primary = Some(h);
                h
            }
        };
        if st.gpus[i].primary_refs == 0 {
            st.attach(d.sim, d.visible[i], i)?;
            if let Some(c) = st.ctxs.get_mut(&h) {
                c.alive = true;
            }
        }
        st.gpus[i].primary_refs += 1;
        put(pctx, h as CUcontext)
    })
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    ffi(|| {
        let d = drv()?;
        let i = dev_index(d, dev)?;
        let mut st = d.lock();
        let (Some(h), 1..) = (st.gpus[i].primary, st.gpus[i].primary_refs) else {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        };
        st.gpus[i].primary_refs -= 1;
        if st.gpus[i].primary_refs == 0 {
            st.free_ctx_objects(h);
            if let Some(c) = st.ctxs.get_mut(&h) {
                c.alive = false;
            }
            st.detach(i);
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate_v2(
    pctx: *mut CUcontext,
    _flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    ffi(|| {
        let d = drv()?;
        let i = dev_index(d, dev)?;
        if pctx.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut st = d.lock();
        st.attach(d.sim, d.visible[i], i)?;
        let h = st.handle();
        st.ctxs.insert(
            h,
            Ctx {
                dev: i,
                alive: true,
                primary: false,
            },
        );
        with_stack(|s| s.push(h))?;
        put(pctx, h as CUcontext)
    })
}

#[no_mangle]
pub extern "C" fn cuCtxDestroy_v2(ctx: CUcontext) -> CUresult {
    ffi(|| {
        let d = drv()?;
        let c = ctx as usize;
        let mut st = d.lock();
        match st.ctxs.get(&c) {
            None => return Err(CUDA_ERROR_INVALID_CONTEXT),
            Some(x) if x.primary || !x.alive => return Err(CUDA_ERROR_INVALID_CONTEXT),
            Some(_) => {}
        }
        st.free_ctx_objects(c);
        let dev = st.ctxs[&c].dev;
        st.ctxs.remove(&c);
        st.detach(dev);
        with_stack(|s| s.retain(|&x| x != c))?;
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult {
    ffi(|| {
        let d = drv()?;
        let c = ctx as usize;
        if c != 0 && !d.lock().ctxs.contains_key(&c) {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        with_stack(|s| {
            s.pop();
            if c != 0 {
                s.push(c);
            }
        })
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(pctx: *mut CUcontext) -> CUresult {
    ffi(|| {
        drv()?;
        put(pctx, current_ctx().unwrap_or(0) as CUcontext)
    })
}

#[no_mangle]
pub extern "C" fn cuCtxPushCurrent_v2(ctx: CUcontext) -> CUresult {
    ffi(|| {
        let c = ctx as usize;
        if !drv()?.lock().ctxs.contains_key(&c) {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        with_stack(|s| s.push(c))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(pctx: *mut CUcontext) -> CUresult {
    ffi(|| {
        drv()?;
        let c = with_stack(|s| s.pop())?.ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        if !pctx.is_null() {
            put(pctx, c as CUcontext)?;
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(dev: *mut CUdevice) -> CUresult {
    ffi(|| {
        let st = drv()?.lock();
        let c = st.current()?;
        put(dev, st.ctxs[&c].dev as CUdevice)
    })
}

#[no_mangle]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    ffi(|| {
        let slot = {
            let mut st = drv()?.lock();
            st.unsafe_call(None)?;
            st.slot_of(st.current()?)?
        };
        slot.wait_completed(slot.submitted());
        wait_host_callbacks();
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------
// Streams and events
// ---------------------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(ps: *mut CUstream, flags: c_uint) -> CUresult {
    ffi(|| {
        if flags > 1 || ps.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut st = drv()?.lock();
        let ctx = st.current()?;
        st.slot_of(ctx)?;
        let h = st.handle();
        st.streams.insert(
            h,
            Stream {
                ctx,
                last: 0,
                queue: VecDeque::new(),
            },
        );
        put(ps, h as CUstream)
    })
}

#[no_mangle]
pub extern "C" fn cuStreamDestroy_v2(s: CUstream) -> CUresult {
    ffi(|| {
        let mut st = drv()?.lock();
        st.captures.remove(&(s as usize));
        st.streams
            .remove(&(s as usize))
            .map(|_| ())
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamGetCtx(s: CUstream, pctx: *mut CUcontext) -> CUresult {
    ffi(|| stream_get_ctx(s, pctx))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamGetCtx_ptsz(s: CUstream, pctx: *mut CUcontext) -> CUresult {
    ffi(|| stream_get_ctx(s, pctx))
}

#[no_mangle]
pub extern "C" fn cuStreamSynchronize(s: CUstream) -> CUresult {
    ffi(|| stream_sync(s))
}

#[no_mangle]
pub extern "C" fn cuStreamSynchronize_ptsz(s: CUstream) -> CUresult {
    ffi(|| stream_sync(s))
}

#[no_mangle]
pub extern "C" fn cuStreamQuery(s: CUstream) -> CUresult {
    ffi(|| stream_query(s))
}

#[no_mangle]
pub extern "C" fn cuStreamQuery_ptsz(s: CUstream) -> CUresult {
    ffi(|| stream_query(s))
}

#[no_mangle]
pub extern "C" fn cuStreamWaitEvent(s: CUstream, e: CUevent, flags: c_uint) -> CUresult {
    ffi(|| stream_wait_event(s, e, flags))
}

#[no_mangle]
pub extern "C" fn cuStreamWaitEvent_ptsz(s: CUstream, e: CUevent, flags: c_uint) -> CUresult {
    ffi(|| stream_wait_event(s, e, flags))
}

#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(pe: *mut CUevent, _flags: c_uint) -> CUresult {
    ffi(|| {
        if pe.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut st = drv()?.lock();
        let ctx = st.current()?;
        let h = st.handle();
        st.events.insert(
            h,
            Event {
                ctx,
                recorded: None,
                captured: false,
            },
        );
        put(pe, h as CUevent)
    })
}

#[no_mangle]
pub extern "C" fn cuEventRecord(e: CUevent, s: CUstream) -> CUresult {
    ffi(|| event_record(e, s))
}

#[no_mangle]
pub extern "C" fn cuEventRecord_ptsz(e: CUevent, s: CUstream) -> CUresult {
    ffi(|| event_record(e, s))
}

/// What a query of or wait for event `e` looks at (a potentially unsafe call during a
/// capture; a captured event: `CUDA_ERROR_CAPTURED_EVENT`).
fn event_target(e: CUevent) -> Result<Option<(Slot, u64)>, CUresult> {
    let mut st = drv()?.lock();
    if !st.events.contains_key(&(e as usize)) {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    st.unsafe_call(None)?;
    let ev = &st.events[&(e as usize)];
    if ev.captured {
        return Err(CUDA_ERROR_CAPTURED_EVENT);
    }
    Ok(ev.recorded.clone())
}

#[no_mangle]
pub extern "C" fn cuEventQuery(e: CUevent) -> CUresult {
    ffi(|| match event_target(e)? {
        Some((slot, t)) if slot.completed() < t => Err(CUDA_ERROR_NOT_READY),
        _ => Ok(()),
    })
}

#[no_mangle]
pub extern "C" fn cuEventSynchronize(e: CUevent) -> CUresult {
    ffi(|| {
        if let Some((slot, t)) = event_target(e)? {
            slot.wait_completed(t);
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuEventDestroy_v2(e: CUevent) -> CUresult {
    ffi(|| {
        drv()?
            .lock()
            .events
            .remove(&(e as usize))
            .map(|_| ())
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    })
}

// ---------------------------------------------------------------------------------------
// Modules, memory
// ---------------------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(pm: *mut CUmodule, image: *const c_void) -> CUresult {
    ffi(|| {
        if pm.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if image.is_null() {
            return Err(CUDA_ERROR_INVALID_IMAGE);
        }
        let mut st = drv()?.lock();
        let ctx = st.current()?;
        let h = st.handle();
        st.modules.insert(h, ctx);
        put(pm, h as CUmodule)
    })
}

#[no_mangle]
pub extern "C" fn cuModuleUnload(m: CUmodule) -> CUresult {
    ffi(|| {
        let mut st = drv()?.lock();
        let m = m as usize;
        st.modules.remove(&m).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        st.funcs.retain(|_, x| *x != m);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(
    pf: *mut CUfunction,
    m: CUmodule,
    name: *const c_char,
) -> CUresult {
    ffi(|| {
        if pf.is_null() || name.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut st = drv()?.lock();
        if !st.modules.contains_key(&(m as usize)) {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        let h = st.handle();
        st.funcs.insert(h, m as usize);
        put(pf, h as CUfunction)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, size: usize) -> CUresult {
    ffi(|| {
        if dptr.is_null() || size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let d = drv()?;
        let mut st = d.lock();
        let ctx = st.current()?;
        let dev = st.ctxs[&ctx].dev;
        let size = size as u64;
        let mem = st.gpus[dev].mem.saturating_add(size);
        // The GPU's memory is shared by every process on it (a checkpointed one holds
        // none).
        if d.sim.mem_used(d.visible[dev]).saturating_add(size) > d.sim.mem_total() {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let p = st.next_dptr;
        st.next_dptr = p + size.div_ceil(512) * 512;
        st.allocs.insert(p, Alloc { size, ctx });
        st.set_mem(dev, mem);
        put(dptr, p)
    })
}

#[no_mangle]
pub extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    ffi(|| {
        let mut st = drv()?.lock();
        let a = st.allocs.remove(&dptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let dev = st.ctxs.get(&a.ctx).map(|c| c.dev).unwrap_or(0);
        let mem = st.gpus[dev].mem.saturating_sub(a.size);
        st.set_mem(dev, mem);
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------
// Submission entry points
// ---------------------------------------------------------------------------------------

macro_rules! launch_kernel {
    ($name:ident) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            f: CUfunction,
            gx: c_uint,
            gy: c_uint,
            gz: c_uint,
            bx: c_uint,
            by: c_uint,
            bz: c_uint,
            _shared: c_uint,
            s: CUstream,
            params: *mut *mut c_void,
            extra: *mut *mut c_void,
        ) -> CUresult {
            ffi(|| launch(f, [gx, gy, gz], [bx, by, bz], s, params, extra))
        }
    };
}
launch_kernel!(cuLaunchKernel);
launch_kernel!(cuLaunchKernel_ptsz);

fn launch_ex(
    cfg: *const CUlaunchConfig,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> R {
    if cfg.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null config from the caller.
    let c = unsafe { &*cfg };
    launch(
        f,
        [c.gridDimX, c.gridDimY, c.gridDimZ],
        [c.blockDimX, c.blockDimY, c.blockDimZ],
        c.hStream,
        params,
        extra,
    )
}

#[no_mangle]
pub unsafe extern "C" fn cuLaunchKernelEx(
    cfg: *const CUlaunchConfig,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    ffi(|| launch_ex(cfg, f, params, extra))
}

#[no_mangle]
pub unsafe extern "C" fn cuLaunchKernelEx_ptsz(
    cfg: *const CUlaunchConfig,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    ffi(|| launch_ex(cfg, f, params, extra))
}

macro_rules! launch_coop {
    ($name:ident) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            f: CUfunction,
            gx: c_uint,
            gy: c_uint,
            gz: c_uint,
            bx: c_uint,
            by: c_uint,
            bz: c_uint,
            _shared: c_uint,
            s: CUstream,
            params: *mut *mut c_void,
        ) -> CUresult {
            ffi(|| {
                launch(
                    f,
                    [gx, gy, gz],
                    [bx, by, bz],
                    s,
                    params,
                    std::ptr::null_mut(),
                )
            })
        }
    };
}
launch_coop!(cuLaunchCooperativeKernel);
launch_coop!(cuLaunchCooperativeKernel_ptsz);

fn host_func(s: CUstream, f: CUhostFn, data: *mut c_void) -> R {
    let f = f.ok_or(CUDA_ERROR_INVALID_VALUE)?;
    // Captured: a host node of the graph, never called (simplification).
    let Some((slot, target)) = submit(s, 0)? else {
        return Ok(());
    };
    HOST.0.lock().unwrap_or_else(|e| e.into_inner()).0 += 1;
    let job = HostJob {
        slot,
        target,
        f,
        data: data as usize,
    };
    let sent = host_queue()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .send(job);
    if sent.is_err() {
        let mut c = HOST.0.lock().unwrap_or_else(|e| e.into_inner());
        c.0 -= 1;
        return Err(CUDA_ERROR_UNKNOWN);
    }
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuLaunchHostFunc(s: CUstream, f: CUhostFn, data: *mut c_void) -> CUresult {
    ffi(|| host_func(s, f, data))
}

#[no_mangle]
pub unsafe extern "C" fn cuLaunchHostFunc_ptsz(
    s: CUstream,
    f: CUhostFn,
    data: *mut c_void,
) -> CUresult {
    ffi(|| host_func(s, f, data))
}

fn graph_launch(g: CUgraphExec, s: CUstream) -> R {
    let ns = *drv()?
        .lock()
        .graphs
        .get(&(g as usize))
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    submit(s, ns).map(|_| ())
}

// ---------------------------------------------------------------------------------------
// Stream capture
// ---------------------------------------------------------------------------------------

thread_local! {
    /// This thread's `CUstreamCaptureMode` (`cuThreadExchangeStreamCaptureMode`).
    static CAPTURE_MODE: std::cell::Cell<c_int> =
        const { std::cell::Cell::new(CU_STREAM_CAPTURE_MODE_GLOBAL) };
}

impl State {
    /// The rule for a potentially unsafe call (an event or stream query or wait, on
    /// stream `s` if it names one): refused with `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`,
    /// invalidating the captures concerned, when `s` itself is capturing, or when any
    /// capture is in mode GLOBAL and the calling thread's mode is not RELAXED.
    fn unsafe_call(&mut self, s: Option<CUstream>) -> R {
        if self.captures.is_empty() {
            return Ok(());
        }
        if let Some(c) = s.and_then(|s| self.captures.get_mut(&(s as usize))) {
            c.invalidated = true;
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        let relaxed = CAPTURE_MODE
            .try_with(|m| m.get() == CU_STREAM_CAPTURE_MODE_RELAXED)
            .unwrap_or(false);
        let mut refused = false;
        for c in self.captures.values_mut() {
            if c.mode == CU_STREAM_CAPTURE_MODE_GLOBAL && !relaxed {
                c.invalidated = true;
                refused = true;
            }
        }
        if refused {
            Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
        } else {
            Ok(())
        }
    }
}

fn begin_capture(s: CUstream, mode: c_int) -> R {
    if !(CU_STREAM_CAPTURE_MODE_GLOBAL..=CU_STREAM_CAPTURE_MODE_RELAXED).contains(&mode) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut st = drv()?.lock();
    match st.stream(s)? {
        (_, Some(h)) if !st.captures.contains_key(&h) => {
            st.captures.insert(
                h,
                Capture {
                    mode,
                    invalidated: false,
                    nodes: 0,
                    ns: 0,
                },
            );
            Ok(())
        }
        (_, Some(_)) => Err(CUDA_ERROR_ILLEGAL_STATE),
        // The default streams are not captured here (simplification).
        (_, None) => Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED),
    }
}

#[no_mangle]
pub extern "C" fn cuStreamBeginCapture(s: CUstream) -> CUresult {
    ffi(|| begin_capture(s, CU_STREAM_CAPTURE_MODE_GLOBAL))
}

#[no_mangle]
pub extern "C" fn cuStreamBeginCapture_v2(s: CUstream, mode: c_int) -> CUresult {
    ffi(|| begin_capture(s, mode))
}

#[no_mangle]
pub extern "C" fn cuStreamBeginCapture_v2_ptsz(s: CUstream, mode: c_int) -> CUresult {
    ffi(|| begin_capture(s, mode))
}

fn end_capture(s: CUstream, out: *mut CUgraph) -> R {
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut st = drv()?.lock();
    let (_, h) = st.stream(s)?;
    let c = h
        .and_then(|h| st.captures.remove(&h))
        .ok_or(CUDA_ERROR_ILLEGAL_STATE)?;
    if c.invalidated {
        put(out, std::ptr::null_mut())?;
        return Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    }
    let g = st.handle();
    st.captured_graphs.insert(g, (c.nodes, c.ns));
    put(out, g as CUgraph)
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamEndCapture(s: CUstream, out: *mut CUgraph) -> CUresult {
    ffi(|| end_capture(s, out))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamEndCapture_ptsz(s: CUstream, out: *mut CUgraph) -> CUresult {
    ffi(|| end_capture(s, out))
}

fn is_capturing(s: CUstream, out: *mut c_int) -> R {
    let st = drv()?.lock();
    let (_, h) = st.stream(s)?;
    let status = match h.and_then(|h| st.captures.get(&h)) {
        None => CU_STREAM_CAPTURE_STATUS_NONE,
        Some(c) if c.invalidated => CU_STREAM_CAPTURE_STATUS_INVALIDATED,
        Some(_) => CU_STREAM_CAPTURE_STATUS_ACTIVE,
    };
    put(out, status)
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamIsCapturing(s: CUstream, out: *mut c_int) -> CUresult {
    ffi(|| is_capturing(s, out))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamIsCapturing_ptsz(s: CUstream, out: *mut c_int) -> CUresult {
    ffi(|| is_capturing(s, out))
}

#[no_mangle]
pub unsafe extern "C" fn cuThreadExchangeStreamCaptureMode(mode: *mut c_int) -> CUresult {
    ffi(|| {
        if mode.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: a non-null in/out pointer from the caller.
        let new = unsafe { *mode };
        if !(CU_STREAM_CAPTURE_MODE_GLOBAL..=CU_STREAM_CAPTURE_MODE_RELAXED).contains(&new) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let old = CAPTURE_MODE
            .try_with(|m| m.replace(new))
            .map_err(|_| CUDA_ERROR_UNKNOWN)?;
        put(mode, old)
    })
}

/// `cuGraphInstantiateWithFlags`: an executable graph whose `cuGraphLaunch` is one
/// submission busy for the captured work's total GPU time.
#[no_mangle]
pub unsafe extern "C" fn cuGraphInstantiateWithFlags(
    out: *mut CUgraphExec,
    g: CUgraph,
    _flags: u64,
) -> CUresult {
    ffi(|| {
        if out.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut st = drv()?.lock();
        let &(_, ns) = st
            .captured_graphs
            .get(&(g as usize))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let h = st.handle();
        st.graphs.insert(h, ns);
        put(out, h as CUgraphExec)
    })
}

#[no_mangle]
pub extern "C" fn cuGraphDestroy(g: CUgraph) -> CUresult {
    ffi(|| {
        drv()?
            .lock()
            .captured_graphs
            .remove(&(g as usize))
            .map(|_| ())
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    })
}

#[no_mangle]
pub extern "C" fn cuGraphLaunch(g: CUgraphExec, s: CUstream) -> CUresult {
    ffi(|| graph_launch(g, s))
}

#[no_mangle]
pub extern "C" fn cuGraphLaunch_ptsz(g: CUgraphExec, s: CUstream) -> CUresult {
    ffi(|| graph_launch(g, s))
}

#[no_mangle]
pub extern "C" fn cuGraphExecDestroy(g: CUgraphExec) -> CUresult {
    ffi(|| {
        drv()?
            .lock()
            .graphs
            .remove(&(g as usize))
            .map(|_| ())
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    })
}

/// Test helper (not in `cuda.h`): this process's submission counters ([`FakeStats`]).
/// `CUDA_ERROR_NOT_INITIALIZED` before `cuInit`.
#[no_mangle]
pub unsafe extern "C" fn coloc_fake_stats(out: *mut FakeStats) -> CUresult {
    // Not a driver call itself: read first, then undo the count `ffi` adds.
    let r = ffi(|| {
        let mut st = drv()?.lock().stats;
        st.driver_calls = DRIVER_CALLS.load(std::sync::atomic::Ordering::Relaxed);
        put(out, st)
    });
    DRIVER_CALLS.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    r
}

/// Test helper (not in `cuda.h`): a `CUgraphExec` whose `cuGraphLaunch` is busy on the GPU
/// for `ns` nanoseconds. Null before `cuInit`.
#[no_mangle]
pub extern "C" fn coloc_fake_graph(ns: u64) -> CUgraphExec {
    catch_unwind(|| match drv() {
        Ok(d) => {
            let mut st = d.lock();
            let h = st.handle();
            st.graphs.insert(h, ns);
            h as CUgraphExec
        }
        Err(_) => std::ptr::null_mut(),
    })
    .unwrap_or(std::ptr::null_mut())
}

macro_rules! memcpy_htod {
    ($name:ident) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            dst: CUdeviceptr,
            src: *const c_void,
            n: usize,
            s: CUstream,
        ) -> CUresult {
            ffi(|| copy(s, &[(dst, n as u64)], Some(src), n as u64))
        }
    };
}
memcpy_htod!(cuMemcpyHtoDAsync_v2);
memcpy_htod!(cuMemcpyHtoDAsync_v2_ptsz);

/// A synchronous copy of `n` bytes on default stream `s`: waits for the copy (`wait`,
/// device to host), or for the stream's earlier work and returns with the copy queued.
fn copy_sync(s: CUstream, dev: CUdeviceptr, host: *const c_void, n: u64, wait: bool) -> R {
    let d = drv()?;
    if host.is_null() && n > 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    d.lock().check_range(dev, n)?;
    if !wait {
        stream_sync(s)?;
    }
    if let Some((slot, t)) = submit(s, copy_ns(n))? {
        if wait {
            slot.wait_completed(t);
        }
    }
    Ok(())
}

macro_rules! memcpy_dtoh_sync {
    ($name:ident, $s:expr) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name(dst: *mut c_void, src: CUdeviceptr, n: usize) -> CUresult {
            ffi(|| copy_sync($s as CUstream, src, dst, n as u64, true))
        }
    };
}
memcpy_dtoh_sync!(cuMemcpyDtoH_v2, 0usize);
memcpy_dtoh_sync!(cuMemcpyDtoH_v2_ptds, CU_STREAM_PER_THREAD);

macro_rules! memcpy_htod_sync {
    ($name:ident, $s:expr) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name(dst: CUdeviceptr, src: *const c_void, n: usize) -> CUresult {
            ffi(|| copy_sync($s as CUstream, dst, src, n as u64, false))
        }
    };
}
memcpy_htod_sync!(cuMemcpyHtoD_v2, 0usize);
memcpy_htod_sync!(cuMemcpyHtoD_v2_ptds, CU_STREAM_PER_THREAD);

/// Total bytes of a batched copy's `count` sizes (`cuMemcpyBatchAsync`).
fn batch_bytes(sizes: *const usize, count: usize) -> Result<u64, CUresult> {
    if count == 0 || sizes.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the caller's array of `count` sizes.
    Ok(unsafe { std::slice::from_raw_parts(sizes, count) }
        .iter()
        .map(|&n| n as u64)
        .sum())
}

macro_rules! memcpy_batch_v1 {
    ($name:ident) => {
        /// CUDA 12.8's ABI: `failIdx` before the stream. One copy of the total size (the
        /// fake does not look at the addresses).
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            _dsts: *const CUdeviceptr,
            _srcs: *const CUdeviceptr,
            sizes: *const usize,
            count: usize,
            _attrs: *const c_void,
            _attrs_idxs: *const usize,
            _num_attrs: usize,
            fail_idx: *mut usize,
            s: CUstream,
        ) -> CUresult {
            ffi(|| {
                let n = batch_bytes(sizes, count)?;
                copy(s, &[], None, n)?;
                if !fail_idx.is_null() {
                    // SAFETY: the caller's out-pointer.
                    unsafe { *fail_idx = usize::MAX };
                }
                Ok(())
            })
        }
    };
}
memcpy_batch_v1!(cuMemcpyBatchAsync);
memcpy_batch_v1!(cuMemcpyBatchAsync_ptsz);

macro_rules! memcpy_batch_v2 {
    ($name:ident) => {
        /// CUDA 13.0's ABI (`_v2`): no `failIdx`.
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            _dsts: *const CUdeviceptr,
            _srcs: *const CUdeviceptr,
            sizes: *const usize,
            count: usize,
            _attrs: *const c_void,
            _attrs_idxs: *const usize,
            _num_attrs: usize,
            s: CUstream,
        ) -> CUresult {
            ffi(|| copy(s, &[], None, batch_bytes(sizes, count)?))
        }
    };
}
memcpy_batch_v2!(cuMemcpyBatchAsync_v2);
memcpy_batch_v2!(cuMemcpyBatchAsync_v2_ptsz);

macro_rules! memcpy_dtoh {
    ($name:ident) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            dst: *mut c_void,
            src: CUdeviceptr,
            n: usize,
            s: CUstream,
        ) -> CUresult {
            ffi(|| copy(s, &[(src, n as u64)], Some(dst as *const c_void), n as u64))
        }
    };
}
memcpy_dtoh!(cuMemcpyDtoHAsync_v2);
memcpy_dtoh!(cuMemcpyDtoHAsync_v2_ptsz);

macro_rules! memcpy_dtod {
    ($name:ident) => {
        #[no_mangle]
        pub extern "C" fn $name(
            dst: CUdeviceptr,
            src: CUdeviceptr,
            n: usize,
            s: CUstream,
        ) -> CUresult {
            ffi(|| copy(s, &[(dst, n as u64), (src, n as u64)], None, n as u64))
        }
    };
}
memcpy_dtod!(cuMemcpyDtoDAsync_v2);
memcpy_dtod!(cuMemcpyDtoDAsync_v2_ptsz);

macro_rules! memset {
    ($name:ident, $t:ty) => {
        #[no_mangle]
        pub extern "C" fn $name(dst: CUdeviceptr, _value: $t, n: usize, s: CUstream) -> CUresult {
            let bytes = (n as u64).saturating_mul(std::mem::size_of::<$t>() as u64);
            ffi(|| copy(s, &[(dst, bytes)], None, bytes))
        }
    };
}
memset!(cuMemsetD8Async, u8);
memset!(cuMemsetD8Async_ptsz, u8);
memset!(cuMemsetD32Async, c_uint);
memset!(cuMemsetD32Async_ptsz, c_uint);

// ---------------------------------------------------------------------------------------
// Errors, export tables, entry-point lookup
// ---------------------------------------------------------------------------------------

const ERRORS: &[(CUresult, &CStr, &CStr)] = &[
    (CUDA_SUCCESS, c"CUDA_SUCCESS", c"no error"),
    (
        CUDA_ERROR_INVALID_VALUE,
        c"CUDA_ERROR_INVALID_VALUE",
        c"invalid argument",
    ),
    (
        CUDA_ERROR_OUT_OF_MEMORY,
        c"CUDA_ERROR_OUT_OF_MEMORY",
        c"out of memory",
    ),
    (
        CUDA_ERROR_NOT_INITIALIZED,
        c"CUDA_ERROR_NOT_INITIALIZED",
        c"initialization error",
    ),
    (
        CUDA_ERROR_NO_DEVICE,
        c"CUDA_ERROR_NO_DEVICE",
        c"no CUDA-capable device is detected",
    ),
    (
        CUDA_ERROR_INVALID_DEVICE,
        c"CUDA_ERROR_INVALID_DEVICE",
        c"invalid device ordinal",
    ),
    (
        CUDA_ERROR_INVALID_IMAGE,
        c"CUDA_ERROR_INVALID_IMAGE",
        c"device kernel image is invalid",
    ),
    (
        CUDA_ERROR_INVALID_CONTEXT,
        c"CUDA_ERROR_INVALID_CONTEXT",
        c"invalid device context",
    ),
    (
        CUDA_ERROR_INVALID_HANDLE,
        c"CUDA_ERROR_INVALID_HANDLE",
        c"invalid resource handle",
    ),
    (
        CUDA_ERROR_NOT_FOUND,
        c"CUDA_ERROR_NOT_FOUND",
        c"named symbol not found",
    ),
    (
        CUDA_ERROR_NOT_READY,
        c"CUDA_ERROR_NOT_READY",
        c"device not ready",
    ),
    (
        CUDA_ERROR_NOT_SUPPORTED,
        c"CUDA_ERROR_NOT_SUPPORTED",
        c"operation not supported",
    ),
    (
        CUDA_ERROR_ILLEGAL_STATE,
        c"CUDA_ERROR_ILLEGAL_STATE",
        c"the operation cannot be performed in the present state",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
        c"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
        c"operation not permitted when stream is capturing",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
        c"CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
        c"operation failed due to a previous error during capture",
    ),
    (
        CUDA_ERROR_CAPTURED_EVENT,
        c"CUDA_ERROR_CAPTURED_EVENT",
        c"operation not permitted on an event last recorded in a capturing stream",
    ),
    (
        CUDA_ERROR_OPERATING_SYSTEM,
        c"CUDA_ERROR_OPERATING_SYSTEM",
        c"OS call failed or operation not supported on this OS",
    ),
    (
        CUDA_ERROR_TIMEOUT,
        c"CUDA_ERROR_TIMEOUT",
        c"the operation timed out",
    ),
    (CUDA_ERROR_UNKNOWN, c"CUDA_ERROR_UNKNOWN", c"unknown error"),
];

fn error_text(code: CUresult, out: *mut *const c_char, name: bool) -> CUresult {
    ffi(|| match ERRORS.iter().find(|e| e.0 == code) {
        Some(e) => put(out, if name { e.1 } else { e.2 }.as_ptr()),
        None => {
            let _ = put(out, std::ptr::null());
            Err(CUDA_ERROR_INVALID_VALUE)
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(code: CUresult, out: *mut *const c_char) -> CUresult {
    error_text(code, out, true)
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(code: CUresult, out: *mut *const c_char) -> CUresult {
    error_text(code, out, false)
}

#[no_mangle]
pub unsafe extern "C" fn cuGetExportTable(out: *mut *const c_void, _id: *const CUuuid) -> CUresult {
    ffi(|| {
        let _ = put(out, std::ptr::null());
        Err(CUDA_ERROR_NOT_SUPPORTED)
    })
}

/// One entry of the lookup table: base name, first CUDA version, plain and per-thread
/// default stream variants.
struct Entry {
    name: &'static str,
    since: c_int,
    plain: usize,
    ptsz: Option<usize>,
}

fn table() -> &'static [Entry] {
    static T: OnceLock<Vec<Entry>> = OnceLock::new();
    macro_rules! e {
        ($name:literal, $since:expr, $f:expr) => {
            Entry {
                name: $name,
                since: $since,
                plain: $f as *const () as usize,
                ptsz: None,
            }
        };
        ($name:literal, $since:expr, $f:expr, $p:expr) => {
            Entry {
                name: $name,
                since: $since,
                plain: $f as *const () as usize,
                ptsz: Some($p as *const () as usize),
            }
        };
    }
    T.get_or_init(|| {
        vec![
            e!("cuInit", 2000, cuInit),
            e!("cuDriverGetVersion", 2020, cuDriverGetVersion),
            e!("cuDeviceGetCount", 2000, cuDeviceGetCount),
            e!("cuDeviceGet", 2000, cuDeviceGet),
            e!("cuDeviceGetName", 2000, cuDeviceGetName),
            e!("cuDeviceGetUuid", 9020, cuDeviceGetUuid),
            e!("cuDeviceGetUuid", 11040, cuDeviceGetUuid_v2),
            e!("cuDevicePrimaryCtxRetain", 7000, cuDevicePrimaryCtxRetain),
            e!(
                "cuDevicePrimaryCtxRelease",
                11000,
                cuDevicePrimaryCtxRelease_v2
            ),
            e!("cuCtxCreate", 3020, cuCtxCreate_v2),
            e!("cuCtxDestroy", 4000, cuCtxDestroy_v2),
            e!("cuCtxSetCurrent", 4000, cuCtxSetCurrent),
            e!("cuCtxGetCurrent", 4000, cuCtxGetCurrent),
            e!("cuCtxPushCurrent", 4000, cuCtxPushCurrent_v2),
            e!("cuCtxPopCurrent", 4000, cuCtxPopCurrent_v2),
            e!("cuCtxGetDevice", 2000, cuCtxGetDevice),
            e!("cuCtxSynchronize", 2000, cuCtxSynchronize),
            e!("cuStreamCreate", 2000, cuStreamCreate),
            e!("cuStreamDestroy", 4000, cuStreamDestroy_v2),
            e!("cuStreamGetCtx", 9020, cuStreamGetCtx, cuStreamGetCtx_ptsz),
            e!(
                "cuStreamSynchronize",
                2000,
                cuStreamSynchronize,
                cuStreamSynchronize_ptsz
            ),
            e!("cuStreamQuery", 2000, cuStreamQuery, cuStreamQuery_ptsz),
            e!(
                "cuStreamWaitEvent",
                3020,
                cuStreamWaitEvent,
                cuStreamWaitEvent_ptsz
            ),
            e!("cuEventCreate", 2000, cuEventCreate),
            e!("cuEventRecord", 2000, cuEventRecord, cuEventRecord_ptsz),
            e!("cuEventQuery", 2000, cuEventQuery),
            e!("cuEventSynchronize", 2000, cuEventSynchronize),
            e!("cuEventDestroy", 4000, cuEventDestroy_v2),
            e!("cuModuleLoadData", 2000, cuModuleLoadData),
            e!("cuModuleUnload", 2000, cuModuleUnload),
            e!("cuModuleGetFunction", 2000, cuModuleGetFunction),
            e!("cuMemAlloc", 3020, cuMemAlloc_v2),
            e!("cuMemFree", 3020, cuMemFree_v2),
            e!("cuLaunchKernel", 4000, cuLaunchKernel, cuLaunchKernel_ptsz),
            e!(
                "cuLaunchKernelEx",
                11060,
                cuLaunchKernelEx,
                cuLaunchKernelEx_ptsz
            ),
            e!(
                "cuLaunchCooperativeKernel",
                9000,
                cuLaunchCooperativeKernel,
                cuLaunchCooperativeKernel_ptsz
            ),
            e!(
                "cuLaunchHostFunc",
                10000,
                cuLaunchHostFunc,
                cuLaunchHostFunc_ptsz
            ),
            e!("cuGraphLaunch", 10000, cuGraphLaunch, cuGraphLaunch_ptsz),
            e!("cuGraphExecDestroy", 10000, cuGraphExecDestroy),
            e!(
                "cuGraphInstantiateWithFlags",
                11040,
                cuGraphInstantiateWithFlags
            ),
            e!("cuGraphDestroy", 10000, cuGraphDestroy),
            e!("cuStreamBeginCapture", 10000, cuStreamBeginCapture),
            e!(
                "cuStreamBeginCapture",
                10010,
                cuStreamBeginCapture_v2,
                cuStreamBeginCapture_v2_ptsz
            ),
            e!(
                "cuStreamEndCapture",
                10000,
                cuStreamEndCapture,
                cuStreamEndCapture_ptsz
            ),
            e!(
                "cuStreamIsCapturing",
                10000,
                cuStreamIsCapturing,
                cuStreamIsCapturing_ptsz
            ),
            e!(
                "cuThreadExchangeStreamCaptureMode",
                10010,
                cuThreadExchangeStreamCaptureMode
            ),
            e!(
                "cuMemcpyHtoDAsync",
                3020,
                cuMemcpyHtoDAsync_v2,
                cuMemcpyHtoDAsync_v2_ptsz
            ),
            e!(
                "cuMemcpyDtoHAsync",
                3020,
                cuMemcpyDtoHAsync_v2,
                cuMemcpyDtoHAsync_v2_ptsz
            ),
            e!("cuMemcpyDtoH", 3020, cuMemcpyDtoH_v2, cuMemcpyDtoH_v2_ptds),
            e!("cuMemcpyHtoD", 3020, cuMemcpyHtoD_v2, cuMemcpyHtoD_v2_ptds),
            e!(
                "cuMemcpyDtoDAsync",
                3020,
                cuMemcpyDtoDAsync_v2,
                cuMemcpyDtoDAsync_v2_ptsz
            ),
            e!(
                "cuMemsetD8Async",
                3020,
                cuMemsetD8Async,
                cuMemsetD8Async_ptsz
            ),
            e!(
                "cuMemsetD32Async",
                3020,
                cuMemsetD32Async,
                cuMemsetD32Async_ptsz
            ),
            e!(
                "cuMemcpyBatchAsync",
                12080,
                cuMemcpyBatchAsync,
                cuMemcpyBatchAsync_ptsz
            ),
            e!(
                "cuMemcpyBatchAsync",
                13000,
                cuMemcpyBatchAsync_v2,
                cuMemcpyBatchAsync_v2_ptsz
            ),
            e!("cuGetErrorName", 6000, cuGetErrorName),
            e!("cuGetErrorString", 6000, cuGetErrorString),
            e!("cuGetExportTable", 3000, cuGetExportTable),
            e!("cuGetProcAddress", 11030, cuGetProcAddress),
            e!("cuGetProcAddress", 12000, cuGetProcAddress_v2),
        ]
    })
}

/// The lookup behind both getters: `(pointer, query result)` or an error code.
fn proc_address(
    symbol: *const c_char,
    version: c_int,
    flags: u64,
) -> Result<usize, (CUresult, c_int)> {
    if symbol.is_null() || flags > CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM {
        return Err((
            CUDA_ERROR_INVALID_VALUE,
            CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND,
        ));
    }
    // SAFETY: a NUL-terminated name from the caller.
    let name = unsafe { CStr::from_ptr(symbol) };
    let name = name.to_str().unwrap_or("");
    let mut found = false;
    let mut best: Option<&Entry> = None;
    for e in table().iter().filter(|e| e.name == name) {
        found = true;
        if e.since <= version && best.is_none_or(|b| e.since > b.since) {
            best = Some(e);
        }
    }
    match best {
        Some(e) if flags == CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM => {
            Ok(e.ptsz.unwrap_or(e.plain))
        }
        Some(e) => Ok(e.plain),
        None if found => Err((
            CUDA_ERROR_NOT_FOUND,
            CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT,
        )),
        None => Err((CUDA_ERROR_NOT_FOUND, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND)),
    }
}

fn get_proc(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    q: *mut c_int,
) -> CUresult {
    ffi(|| {
        if pfn.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (p, code, res) = match proc_address(symbol, version, flags) {
            Ok(p) => (p, CUDA_SUCCESS, CU_GET_PROC_ADDRESS_SUCCESS),
            Err((c, r)) => (0, c, r),
        };
        put(pfn, p as *mut c_void)?;
        if !q.is_null() {
            put(q, res)?;
        }
        if code == CUDA_SUCCESS {
            Ok(())
        } else {
            Err(code)
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
) -> CUresult {
    get_proc(symbol, pfn, cuda_version, flags, std::ptr::null_mut())
}

#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
    symbol_status: *mut c_int,
) -> CUresult {
    get_proc(symbol, pfn, cuda_version, flags, symbol_status)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn visible_devices_parse_like_the_driver() {
        assert_eq!(parse_visible(None, 3), vec![0, 1, 2]);
        assert_eq!(parse_visible(Some("1"), 3), vec![1]);
        assert_eq!(parse_visible(Some("2,0"), 3), vec![2, 0]);
        assert_eq!(
            parse_visible(Some("0,7,1"), 3),
            vec![0],
            "stops at the first invalid"
        );
        assert_eq!(
            parse_visible(Some("1,1,0"), 3),
            vec![1],
            "stops at a repeat"
        );
        assert_eq!(parse_visible(Some("-1"), 3), Vec::<u32>::new());
        assert_eq!(parse_visible(Some(""), 3), Vec::<u32>::new());
        let u1 = uuid_string(&gpu_uuid(1));
        assert_eq!(parse_visible(Some(&u1), 3), vec![1]);
        assert_eq!(
            parse_visible(Some("GPU-c010c517"), 3),
            Vec::<u32>::new(),
            "ambiguous prefix"
        );
    }

    #[test]
    fn copy_durations() {
        assert_eq!(copy_ns(0), MIN_COPY_NS);
        assert_eq!(copy_ns(1 << 30), (1 << 30) / 10);
    }
}
