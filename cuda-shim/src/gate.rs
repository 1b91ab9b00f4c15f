//! The launch gate, in offline processes (`COLOC_SHIM_CLASS=offline`).
//!
//! ```text
//!  submission (any wrapped entry point), mode gated:
//!    stream → pool (ring of events) and GPU (page entry, gate slot)
//!    in_submit += 1; closed? ─ yes ─► in_submit -= 1; FUTEX_WAIT(closed, 50 ms); again
//!    the bound reached on this stream (K events, or fewer: the budget)? wait for the oldest
//!      (cuEventSynchronize; with a budget, time it), recycle it; where the budget has room
//!      for part of one more (the lead), wait instead until the oldest is due to have
//!      that part left (FUTEX_WAIT on the gate word, so a close wakes it) and let one
//!      more in
//!    the driver's submission; cuEventRecord after it; inflight += 1; in_submit -= 1
//!  watcher thread (FUTEX_WAIT on the gate file's generation, 100 ms):
//!    a GPU of ours closed with an epoch not yet acknowledged (in this file):
//!    in_submit == 0 → the newest event of every stream on that GPU completes
//!    → entry.gate_ack = epoch; page wake += 1, FUTEX_WAKE
//! ```
//!
//! - **Gate off** (no gate file, an invalid one, or one whose heartbeat is stale when it
//!   is first seen): mode *open*, every call passes straight through (one load and a
//!   branch). The watcher looks for the file once a second, so an agent started later is
//!   picked up; a file replaced by a restarted agent (a new inode) is picked up once the
//!   old one's heartbeat is stale.
//! - **Fail-open**: a blocked submission re-checks every 50 ms (and at every wake-up);
//!   when the agent's heartbeat is older than `COLOC_GATE_STALE_MS` (default 1000) the
//!   gate counts as open, with one line on stderr the first time.
//! - **Which GPU**: the stream's context's (for the default streams: the calling thread's
//!   current context), by UUID, as the doorbell.
//! - **Streams**: the legacy default stream (`0` in a plain entry point, or
//!   `CU_STREAM_LEGACY`) is one per context; the per-thread default stream (`0` in a
//!   `_ptsz` entry point, or `CU_STREAM_PER_THREAD`) one per thread and context; any other
//!   handle is a stream of its own. Each has a ring of events (created with the driver's
//!   own functions, flags `CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC`), at most
//!   [`MAX_POOLS`] rings at once (the least recently assigned idle ring is drained and
//!   reused beyond that).
//! - **CUDA graph capture**: a submission to a stream in capture (`cuStreamIsCapturing`;
//!   `CU_STREAM_PER_THREAD` for stream 0 of a `_ptsz` entry point; never asked of the
//!   legacy stream, which cannot be captured) runs nothing on the GPU: it adds a node to the
//!   application's graph, whose later `cuGraphLaunch` is the submission that is gated. So
//!   it is forwarded untouched: no wait at the gate, no ring, no event (recorded there, our
//!   event would become a node of the graph, and waiting for it is illegal), not counted.
//!   Every event query or wait of the shim's own ([`relaxed`]: the bound, the watcher,
//!   ring reclaim) runs with the thread's capture mode exchanged to RELAXED and restored:
//!   while another thread captures in mode GLOBAL (PyTorch's default), the driver refuses
//!   such a call from a thread in another mode (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`)
//!   and invalidates that capture. Both entry points are optional (a driver older than
//!   CUDA 10.1: nothing is capturing, no mode to exchange).
//! - Any internal failure: [`crate::bell::disable`] (pass-through for good, one line).

use crate::bell::{self, GATED, OFF, OPEN};
use crate::hooks::{KIND_PTDS, KIND_SET, STREAM_IN_CONFIG, STREAM_NONE};
use coloc_doorbell::gate::{Gates, Slot, DEFAULT_GATE_FILE, DEFAULT_STALE_NS, GATE_FILE_SIZE};
use coloc_doorbell::{futex_wait, futex_wake, now_ns, Entry, MAX_GPUS};
use std::cell::RefCell;
use std::collections::VecDeque;
use std::ffi::{c_int, c_uint, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// Default in-flight bound per stream (`COLOC_SHIM_INFLIGHT`). See the crate docs for the
/// measurement behind it.
pub const DEFAULT_INFLIGHT: u32 = 4;
/// Default in-flight budget per stream, ms of estimated GPU time (`COLOC_SHIM_INFLIGHT_MS`;
/// see the crate docs).
pub const DEFAULT_INFLIGHT_MS: u64 = 3;
/// Stream rings at once.
pub const MAX_POOLS: usize = 256;
/// With `COLOC_SHIM_INFLIGHT=0` (unbounded), a ring still holds at most this many events
/// (the driver itself blocks a stream at about a thousand queued submissions).
const UNBOUNDED_CAP: usize = 4096;
/// A blocked submission re-checks the gate (and the heartbeat) this often.
const BLOCK_RECHECK_NS: u64 = 50_000_000;
/// The watcher re-checks the heartbeat this often while nothing wakes it.
const WATCH_RECHECK_NS: u64 = 100_000_000;
/// The watcher looks for a (new) gate file at most this often.
const FILE_RECHECK_NS: u64 = 1_000_000_000;

const CUDA_SUCCESS: c_int = 0;
const CUDA_ERROR_NOT_READY: c_int = 600;
/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` (900) to `CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD`
/// (908): an operation refused because of a stream capture.
const CAPTURE_ERRORS: std::ops::RangeInclusive<c_int> = 900..=908;
const CU_STREAM_LEGACY: usize = 1;
const CU_STREAM_PER_THREAD: usize = 2;
/// `CU_STREAM_CAPTURE_STATUS_NONE`.
const CAPTURE_STATUS_NONE: c_int = 0;
/// `CU_STREAM_CAPTURE_MODE_RELAXED`.
const CAPTURE_MODE_RELAXED: c_int = 2;
/// `CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING`.
const EVENT_FLAGS: c_uint = 0x1 | 0x2;

// ---------------------------------------------------------------------------------------
// Configuration and the driver's functions
// ---------------------------------------------------------------------------------------

static INFLIGHT: AtomicU32 = AtomicU32::new(DEFAULT_INFLIGHT);
/// In-flight budget per stream, ns of estimated GPU time (`COLOC_SHIM_INFLIGHT_MS`; 0: off).
static BUDGET_NS: AtomicU64 = AtomicU64::new(DEFAULT_INFLIGHT_MS * 1_000_000);
static STALE_NS: AtomicU64 = AtomicU64::new(DEFAULT_STALE_NS);
static GATE_PATH: OnceLock<CString> = OnceLock::new();
static STALE_WARNED: AtomicBool = AtomicBool::new(false);

type Fn1 = unsafe extern "C" fn(usize) -> c_int;
type Fn2 = unsafe extern "C" fn(usize, usize) -> c_int;

/// Driver entry points the gate uses, never the application's pointers.
struct Fns {
    stream_get_ctx: Fn2,
    ctx_push: Fn1,
    ctx_pop: Fn1,
    event_create: Fn2,
    event_record: Fn2,
    event_query: Fn1,
    event_sync: Fn1,
    event_destroy: Fn1,
    /// `cuThreadExchangeStreamCaptureMode` (CUDA 10.1; `None`: no capture modes).
    exchange_capture_mode: Option<Fn1>,
}

static FNS: OnceLock<Fns> = OnceLock::new();

fn fns() -> &'static Fns {
    // Set by `configure` before the mode can become gated.
    FNS.get().expect("gate configured")
}

/// Reads the environment and resolves the driver functions (offline processes, at the
/// first submission). An error is the line to print.
pub fn configure() -> Result<(), String> {
    if let Ok(v) = std::env::var("COLOC_SHIM_INFLIGHT") {
        match v.trim().parse::<u32>() {
            Ok(k) => INFLIGHT.store(k, Relaxed),
            Err(_) => {
                return Err(format!(
                    "COLOC_SHIM_INFLIGHT={v:?} is not a whole number of submissions (0: unbounded)"
                ))
            }
        }
    }
    if let Ok(v) = std::env::var("COLOC_SHIM_INFLIGHT_MS") {
        match v.trim().parse::<f64>() {
            // Any positive budget is at least 1 ns (0 alone means none).
            Ok(ms) if ms.is_finite() && ms >= 0.0 => {
                BUDGET_NS.store(((ms * 1e6) as u64).max(u64::from(ms > 0.0)), Relaxed)
            }
            _ => {
                return Err(format!(
                    "COLOC_SHIM_INFLIGHT_MS={v:?} is not a number of milliseconds (0: no budget)"
                ))
            }
        }
    }
    if let Ok(v) = std::env::var("COLOC_GATE_STALE_MS") {
        match v.trim().parse::<f64>() {
            Ok(ms) if ms.is_finite() && ms > 0.0 => STALE_NS.store((ms * 1e6) as u64, Relaxed),
            _ => {
                return Err(format!(
                    "COLOC_GATE_STALE_MS={v:?} is not a positive number of milliseconds"
                ))
            }
        }
    }
    let path = std::env::var_os("COLOC_GATE_FILE")
        .map(|p| p.into_encoded_bytes())
        .unwrap_or_else(|| DEFAULT_GATE_FILE.as_bytes().to_vec());
    let path = CString::new(path).map_err(|_| "COLOC_GATE_FILE contains a NUL byte".to_string())?;
    let _ = GATE_PATH.set(path);
    let get = |base: &std::ffi::CStr, exported: &std::ffi::CStr| -> Result<usize, String> {
        match bell::lookup(base, exported) {
            0 => Err(format!(
                "cannot find {} in the driver",
                base.to_string_lossy()
            )),
            p => Ok(p),
        }
    };
    // SAFETY (each transmute): the driver's entry point of that name, whose C signature
    // (cuda.h) takes handles, pointers and `unsigned int`s: one machine word each.
    let f = unsafe {
        Fns {
            stream_get_ctx: std::mem::transmute::<usize, Fn2>(get(
                c"cuStreamGetCtx",
                c"cuStreamGetCtx",
            )?),
            ctx_push: std::mem::transmute::<usize, Fn1>(get(
                c"cuCtxPushCurrent",
                c"cuCtxPushCurrent_v2",
            )?),
            ctx_pop: std::mem::transmute::<usize, Fn1>(get(
                c"cuCtxPopCurrent",
                c"cuCtxPopCurrent_v2",
            )?),
            event_create: std::mem::transmute::<usize, Fn2>(get(
                c"cuEventCreate",
                c"cuEventCreate",
            )?),
            event_record: std::mem::transmute::<usize, Fn2>(get(
                c"cuEventRecord",
                c"cuEventRecord",
            )?),
            event_query: std::mem::transmute::<usize, Fn1>(get(c"cuEventQuery", c"cuEventQuery")?),
            event_sync: std::mem::transmute::<usize, Fn1>(get(
                c"cuEventSynchronize",
                c"cuEventSynchronize",
            )?),
            event_destroy: std::mem::transmute::<usize, Fn1>(get(
                c"cuEventDestroy",
                c"cuEventDestroy_v2",
            )?),
            exchange_capture_mode: get(
                c"cuThreadExchangeStreamCaptureMode",
                c"cuThreadExchangeStreamCaptureMode",
            )
            .ok()
            .map(|p| std::mem::transmute::<usize, Fn1>(p)),
        }
    };
    let _ = FNS.set(f);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The gate file
// ---------------------------------------------------------------------------------------

/// One mapping of a gate file (read-only). Never unmapped: submissions may hold references
/// into it; a replaced file costs one leaked page per agent restart.
struct Mapping {
    gates: Gates<'static>,
    /// Counts mappings (1, 2, …): caches made for an older one are refreshed.
    epoch: u32,
    dev: u64,
    ino: u64,
}

static MAPPING: AtomicPtr<Mapping> = AtomicPtr::new(std::ptr::null_mut());
static MAPPINGS: AtomicU32 = AtomicU32::new(0);

fn mapping() -> Option<&'static Mapping> {
    let m = MAPPING.load(Acquire);
    // SAFETY: a non-null MAPPING is a leaked Box, never freed.
    (!m.is_null()).then(|| unsafe { &*m })
}

fn stale(m: &Mapping) -> bool {
    m.gates.stale(now_ns(), STALE_NS.load(Relaxed))
}

/// Maps the gate file if it is a valid, fresh file other than `current`'s.
fn map_gate_file(current: Option<&Mapping>) -> Option<&'static Mapping> {
    let path = GATE_PATH.get()?;
    // SAFETY: a valid C path; read-only, never following a symlink.
    let fd = unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK,
        )
    };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` is ours; fstat into a zeroed struct; mmap of a regular file at least a
    // gate file long; closed once.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        let ok = libc::fstat(fd, &mut st) == 0
            && (st.st_mode & libc::S_IFMT) == libc::S_IFREG
            && st.st_size >= GATE_FILE_SIZE as libc::off_t
            && current.is_none_or(|c| c.dev != st.st_dev || c.ino != st.st_ino);
        let base = if ok {
            libc::mmap(
                std::ptr::null_mut(),
                GATE_FILE_SIZE,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd,
                0,
            )
        } else {
            libc::MAP_FAILED
        };
        libc::close(fd);
        if base == libc::MAP_FAILED {
            return None;
        }
        let gates = Gates::from_raw(base as *const u8);
        if gates.stale(now_ns(), STALE_NS.load(Relaxed)) {
            libc::munmap(base, GATE_FILE_SIZE);
            return None;
        }
        let m = Box::leak(Box::new(Mapping {
            gates,
            epoch: MAPPINGS.fetch_add(1, Relaxed) + 1,
            dev: st.st_dev,
            ino: st.st_ino,
        }));
        MAPPING.store(m, Release);
        Some(m)
    }
}

// ---------------------------------------------------------------------------------------
// The GPUs this process submits to (indexed like its page's entries)
// ---------------------------------------------------------------------------------------

struct Gpu {
    /// The page entry (null until registered).
    entry: AtomicPtr<Entry>,
    uuid: OnceLock<[u8; 16]>,
    /// `mapping epoch (24 bits) | generation (32) | slot index (8, 0xff: none)`, or 0.
    slot: AtomicU64,
}

static GPUS: [Gpu; MAX_GPUS] = [const {
    Gpu {
        entry: AtomicPtr::new(std::ptr::null_mut()),
        uuid: OnceLock::new(),
        slot: AtomicU64::new(0),
    }
}; MAX_GPUS];

const NO_SLOT: u64 = 0xff;

impl Gpu {
    fn entry(&self) -> Option<&'static Entry> {
        let e = self.entry.load(Acquire);
        // SAFETY: a non-null pointer is an entry of the process's page (never unmapped).
        (!e.is_null()).then(|| unsafe { &*e })
    }

    /// This GPU's gate slot in the current mapping, if the agent manages it.
    fn gate(&self) -> Option<(&'static Mapping, &'static Slot)> {
        let m = mapping()?;
        let c = self.slot.load(Relaxed);
        let ep = u64::from(m.epoch) & 0xff_ffff;
        if c >> 40 == ep {
            let idx = c & 0xff;
            if idx != NO_SLOT {
                return m.gates.slot(idx as usize).map(|s| (m, s));
            }
            // No slot as of this generation: look again only once it moved (a claim
            // bumps it).
            if (c >> 8) as u32 == m.gates.generation() {
                return None;
            }
        }
        let gen = m.gates.generation();
        let idx = self
            .uuid
            .get()
            .and_then(|u| m.gates.find_index(u))
            .map_or(NO_SLOT, |i| i as u64);
        self.slot
            .store((ep << 40) | (u64::from(gen) << 8) | idx, Relaxed);
        (idx != NO_SLOT)
            .then(|| m.gates.slot(idx as usize).map(|s| (m, s)))
            .flatten()
    }
}

/// The GPU index for `uuid`, registering it (page entry claimed) if new.
fn gpu_for_uuid(uuid: &[u8; 16]) -> Option<usize> {
    let page = bell::page()?;
    let e = page.entry_for(uuid)?;
    let i = page.index_of(e)?;
    let g = &GPUS[i];
    let _ = g.uuid.set(*uuid);
    g.entry.store(e as *const Entry as *mut Entry, Release);
    Some(i)
}

thread_local! {
    /// (context, GPU index + 1) of this thread's latest submission on a default stream.
    static CTX_GPU: std::cell::Cell<(usize, usize)> = const { std::cell::Cell::new((0, 0)) };
    /// Recently used stream rings: (key, pool index, GPU index).
    static POOL_CACHE: RefCell<[Option<(Key, u16, u16)>; 4]> = const { RefCell::new([None; 4]) };
}

/// The GPU of the calling thread's current context `ctx`.
fn gpu_of_current(ctx: usize) -> Option<usize> {
    let (c, g) = CTX_GPU.try_with(|x| x.get()).unwrap_or((0, 0));
    if c == ctx && g != 0 {
        return Some(g - 1);
    }
    let g = gpu_for_uuid(&bell::current_uuid()?)?;
    let _ = CTX_GPU.try_with(|x| x.set((ctx, g + 1)));
    Some(g)
}

/// Runs `f` with `ctx` current on the calling thread (pushed, then popped).
fn with_ctx<T>(ctx: usize, f: impl FnOnce() -> T) -> T {
    let cur = bell::current_ctx();
    if ctx == 0 || cur == ctx {
        return f();
    }
    let fns = fns();
    // SAFETY: the driver's push/pop with a context handle of this process.
    let pushed = unsafe { (fns.ctx_push)(ctx) } == CUDA_SUCCESS;
    let r = f();
    if pushed {
        let mut popped = 0usize;
        // SAFETY: pops what we pushed; valid out-pointer.
        unsafe { (fns.ctx_pop)(&mut popped as *mut usize as usize) };
    }
    r
}

/// The GPU of context `ctx` (any thread's).
fn gpu_of_ctx(ctx: usize) -> Option<usize> {
    let cur = bell::current_ctx();
    if ctx == cur {
        return gpu_of_current(ctx);
    }
    let uuid = with_ctx(ctx, bell::current_uuid)?;
    gpu_for_uuid(&uuid)
}

// ---------------------------------------------------------------------------------------
// Stream rings
// ---------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Key {
    /// The legacy default stream of a context.
    Legacy(usize),
    /// A thread's per-thread default stream in a context (thread: a TLS address).
    PerThread(usize, usize),
    /// A created stream.
    Stream(usize),
}

struct Ring {
    key: Option<Key>,
    ctx: usize,
    /// The stream handle to record on.
    record_on: usize,
    /// Recorded after a submission, not yet known complete; oldest first.
    events: VecDeque<usize>,
    free: Vec<usize>,
    /// With a budget: the estimated wall-clock time of one submission on this stream (ns;
    /// 0: none yet), when the last submission alone in flight was made, and when the last
    /// timed wait for the oldest event returned while the stream stayed backlogged (0:
    /// the run broke).
    est_ns: u64,
    last_sub_ns: u64,
    prev_done_ns: u64,
    /// Samples in `est_ns` so far (up to [`FIRST_SAMPLES`]).
    samples: u32,
}

impl Ring {
    /// Forgets the timing (a new stream, a drained ring).
    fn reset_timing(&mut self) {
        self.est_ns = 0;
        self.last_sub_ns = 0;
        self.prev_done_ns = 0;
        self.samples = 0;
    }
}

struct Pool {
    /// GPU index (`usize::MAX`: unassigned), readable without the lock.
    gpu: AtomicUsize,
    ring: Mutex<Ring>,
}

static POOLS: [Pool; MAX_POOLS] = [const {
    Pool {
        gpu: AtomicUsize::new(usize::MAX),
        ring: Mutex::new(Ring {
            key: None,
            ctx: 0,
            record_on: 0,
            events: VecDeque::new(),
            free: Vec::new(),
            est_ns: 0,
            last_sub_ns: 0,
            prev_done_ns: 0,
            samples: 0,
        }),
    }
}; MAX_POOLS];

/// Which ring each key has (taken only without a ring lock held).
static DIRECTORY: Mutex<Vec<(Key, u16, u16)>> = Mutex::new(Vec::new());
static HAND: AtomicUsize = AtomicUsize::new(0);

fn lock<T>(m: &'static Mutex<T>) -> MutexGuard<'static, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The stream handle a submission names (`None`: no single stream).
fn stream_of(kind: u32, a: &[usize; 12]) -> Option<usize> {
    if kind & KIND_SET == 0 {
        return None;
    }
    match kind & 0xff {
        STREAM_NONE => None,
        STREAM_IN_CONFIG => {
            if a[0] == 0 {
                return None;
            }
            // SAFETY: cuLaunchKernelEx's first argument is a `const CUlaunchConfig *`:
            // seven `unsigned int`s, then `CUstream hStream` at byte 32 (cuda.h).
            Some(unsafe { std::ptr::read_unaligned((a[0] + 32) as *const usize) })
        }
        i if (i as usize) < a.len() => Some(a[i as usize]),
        _ => None,
    }
}

/// Identifies the calling thread while it lives (the address of one of its thread-locals;
/// 1 while its thread-locals are being destroyed).
fn thread_tag() -> usize {
    POOL_CACHE.try_with(|c| c as *const _ as usize).unwrap_or(1)
}

/// (pool index, GPU index) for `key`, assigning a ring if it has none.
fn pool_for(key: Key, ctx: usize) -> Option<(usize, usize)> {
    let hit = POOL_CACHE
        .try_with(|c| c.borrow().iter().flatten().find(|x| x.0 == key).copied())
        .ok()
        .flatten();
    if let Some((_, p, g)) = hit {
        return Some((p as usize, g as usize));
    }
    let found = {
        let dir = lock(&DIRECTORY);
        dir.iter().find(|x| x.0 == key).copied()
    };
    let (p, g) = match found {
        Some((_, p, g)) => (p as usize, g as usize),
        None => assign(key, ctx)?,
    };
    let _ = POOL_CACHE.try_with(|c| {
        let mut c = c.borrow_mut();
        c.rotate_right(1);
        c[0] = Some((key, p as u16, g as u16));
    });
    Some((p, g))
}

/// Gives `key` a ring: a free one, or an idle one reclaimed (its events waited for and
/// destroyed).
fn assign(key: Key, cur_ctx: usize) -> Option<(usize, usize)> {
    let (ctx, record_on) = match key {
        Key::Legacy(c) => (c, CU_STREAM_LEGACY),
        Key::PerThread(c, _) => (c, CU_STREAM_PER_THREAD),
        Key::Stream(h) => {
            let mut c = 0usize;
            // SAFETY: the driver's cuStreamGetCtx with a valid out-pointer.
            if unsafe { (fns().stream_get_ctx)(h, &mut c as *mut usize as usize) } != CUDA_SUCCESS
                || c == 0
            {
                return None;
            }
            (c, h)
        }
    };
    let gpu = if ctx == cur_ctx {
        gpu_of_current(ctx)?
    } else {
        gpu_of_ctx(ctx)?
    };
    let mut dir = lock(&DIRECTORY);
    // Another thread may have assigned it meanwhile.
    if let Some(&(_, p, g)) = dir.iter().find(|x| x.0 == key) {
        return Some((p as usize, g as usize));
    }
    let idx = (0..MAX_POOLS)
        .find(|&i| POOLS[i].gpu.load(Acquire) == usize::MAX)
        .or_else(|| reclaim(&mut dir))?;
    let mut r = lock(&POOLS[idx].ring);
    r.key = Some(key);
    r.ctx = ctx;
    r.record_on = record_on;
    r.reset_timing();
    POOLS[idx].gpu.store(gpu, Release);
    dir.push((key, idx as u16, gpu as u16));
    Some((idx, gpu))
}

/// Frees the first ring (round robin) that nobody holds: waits for its newest event,
/// destroys its events, and forgets its key.
fn reclaim(dir: &mut Vec<(Key, u16, u16)>) -> Option<usize> {
    for _ in 0..MAX_POOLS {
        let i = HAND.fetch_add(1, Relaxed) % MAX_POOLS;
        let Ok(mut guard) = POOLS[i].ring.try_lock() else {
            continue;
        };
        let r = &mut *guard;
        let gpu = POOLS[i].gpu.load(Acquire);
        let ctx = r.ctx;
        let n = r.events.len();
        if let Some(&newest) = r.events.back() {
            with_ctx(ctx, || sync_event(newest));
        }
        let all: Vec<usize> = r.events.drain(..).chain(r.free.drain(..)).collect();
        with_ctx(ctx, || {
            for e in all {
                // SAFETY: an event of ours, destroyed once.
                unsafe { (fns().event_destroy)(e) };
            }
        });
        if let Some(e) = GPUS.get(gpu).and_then(|g| g.entry()) {
            e.inflight.fetch_sub(n as u32, Relaxed);
        }
        if let Some(k) = r.key.take() {
            dir.retain(|x| x.0 != k);
        }
        POOLS[i].gpu.store(usize::MAX, Release);
        return Some(i);
    }
    None
}

/// Runs `f` (the shim's own event query or wait) with the calling thread's stream-capture
/// mode RELAXED, then restores the thread's mode, as PyTorch's
/// `CUDAStreamCaptureModeGuard` does: while another thread captures a stream in mode
/// GLOBAL (PyTorch's default), a query or wait from a thread in another mode fails with
/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and invalidates that capture. Our events are
/// never recorded on a capturing stream ([`capturing`]), so the wait itself is legal.
fn relaxed<T>(f: impl FnOnce() -> T) -> T {
    let Some(exchange) = fns().exchange_capture_mode else {
        return f();
    };
    let mut mode = CAPTURE_MODE_RELAXED;
    // SAFETY: the driver's cuThreadExchangeStreamCaptureMode with a valid in/out pointer.
    let swapped = unsafe { exchange(&mut mode as *mut c_int as usize) } == CUDA_SUCCESS;
    let r = f();
    if swapped {
        // SAFETY: as above; puts back the mode the thread had.
        unsafe { exchange(&mut mode as *mut c_int as usize) };
    }
    r
}

/// Waits for event `e` (an error, e.g. a destroyed context, counts as complete).
fn sync_event(e: usize) {
    // SAFETY: the driver's cuEventSynchronize on an event of ours.
    relaxed(|| unsafe { (fns().event_sync)(e) });
}

fn event_done(e: usize) -> bool {
    // SAFETY: the driver's cuEventQuery on an event of ours.
    relaxed(|| unsafe { (fns().event_query)(e) }) != CUDA_ERROR_NOT_READY
}

/// Whether a submission of `kind` with arguments `a` goes to a stream being captured into
/// a CUDA graph (the doorbell asks this of a launch that would start a run).
pub fn captured(kind: u32, a: &[usize; 12]) -> bool {
    stream_of(kind, a).is_some_and(|h| capturing(h, kind))
}

/// Whether stream `h`, as a submission of `kind` names it, is being captured into a CUDA
/// graph (an invalidated capture too). Such a submission runs nothing: it adds a node to
/// the graph, which runs later through `cuGraphLaunch`, itself a gated submission. So it
/// is neither held at the gate nor tracked: an event of ours recorded there would become
/// a node of the application's graph, and waiting for it is illegal. The legacy default
/// stream cannot be captured (not asked); a failed query counts as not capturing.
fn capturing(h: usize, kind: u32) -> bool {
    let f = bell::STREAM_IS_CAPTURING.load(Relaxed);
    if f == 0 {
        return false;
    }
    // SAFETY: a non-zero value is the driver's cuStreamIsCapturing.
    let is_capturing = unsafe { std::mem::transmute::<usize, Fn2>(f) };
    let h = match h {
        0 if kind & KIND_PTDS != 0 => CU_STREAM_PER_THREAD,
        0 | CU_STREAM_LEGACY => return false,
        h => h,
    };
    let mut status = CAPTURE_STATUS_NONE;
    // SAFETY: the driver's cuStreamIsCapturing with the caller's stream and a valid
    // out-pointer.
    let r = unsafe { is_capturing(h, &mut status as *mut c_int as usize) };
    r == CUDA_SUCCESS && status != CAPTURE_STATUS_NONE
}

fn create_event(ctx: usize) -> Option<usize> {
    let mut e = 0usize;
    // SAFETY: the driver's cuEventCreate with a valid out-pointer, in the ring's context.
    let r = with_ctx(ctx, || unsafe {
        (fns().event_create)(&mut e as *mut usize as usize, EVENT_FLAGS as usize)
    });
    (r == CUDA_SUCCESS && e != 0).then_some(e)
}

/// CLOCK_MONOTONIC, ns (the budget's timing: no jumps).
fn mono_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Samples a stream's estimate takes before the budget lets more than one submission in
/// flight: one odd first sample (a submission stamped late, a wake-up early) does not set
/// the bound.
const FIRST_SAMPLES: u32 = 4;

/// The ring's bound now: K (`UNBOUNDED_CAP` for 0), and with a budget B the number of
/// submissions whose estimated time fits in B, at least 1 and at most that (1 until
/// [`FIRST_SAMPLES`] samples).
fn limit(r: &Ring) -> usize {
    let k = INFLIGHT.load(Relaxed) as usize;
    let cap = if k == 0 { UNBOUNDED_CAP } else { k };
    match BUDGET_NS.load(Relaxed) {
        0 => cap,
        _ if r.samples < FIRST_SAMPLES => 1,
        b => ((b / r.est_ns) as usize).clamp(1, cap),
    }
}

/// Keeps the ring within the in-flight bound before a submission: waits for the oldest
/// event while the bound is reached (K = 0 without a budget: only recycles those already
/// complete). With a budget, each wait that blocks also times the submission it waited
/// for: from its start (its submission when it was alone in flight, else the previous
/// wait's return, the stream having stayed backlogged since) to the wait's return. That is
/// the wall-clock time the stream took for it, wake-ups and other contexts' time slices
/// included, not its GPU time alone. (When the bound is never reached, nothing is timed
/// and the estimate stays: the application itself keeps fewer in flight than the budget
/// allows. Time held at the gate breaks the run.)
fn bound(r: &mut Ring, entry: &Entry, closed: Option<&AtomicU32>) {
    let budget = BUDGET_NS.load(Relaxed) != 0;
    if INFLIGHT.load(Relaxed) == 0 && !budget {
        while let Some(&e) = r.events.front() {
            if !event_done(e) {
                break;
            }
            r.events.pop_front();
            r.free.push(e);
            entry.inflight.fetch_sub(1, Relaxed);
        }
    }
    let limit = limit(r);
    if r.events.len() < limit {
        // Not backlogged at the bound: the next wait has no previous one to start from.
        r.prev_done_ns = 0;
        return;
    }
    let lead = lead_ns(r, limit);
    let keep = if lead > 0 { limit + 1 } else { limit };
    while r.events.len() >= keep {
        wait_oldest(r, entry, budget);
    }
    if lead > 0 && r.events.len() == limit && !submit_ahead(r, lead, closed) {
        wait_oldest(r, entry, budget);
    }
}

/// Waits for the oldest submission in flight and recycles its event; with a budget, a
/// wait that blocks times it (see [`bound`]).
fn wait_oldest(r: &mut Ring, entry: &Entry, budget: bool) {
    let start = if r.events.len() == 1 {
        r.last_sub_ns.max(r.prev_done_ns)
    } else {
        r.prev_done_ns
    };
    let Some(e) = r.events.pop_front() else {
        return;
    };
    // Only a wait that blocks times anything: an event already complete finished at
    // some unknown time before (and breaks the run for the next one).
    let done_already = budget && event_done(e);
    if !done_already {
        sync_event(e);
    }
    r.free.push(e);
    entry.inflight.fetch_sub(1, Relaxed);
    if done_already {
        r.prev_done_ns = 0;
    } else if budget {
        let done = mono_ns();
        if start != 0 && done > start {
            r.est_ns = estimate(r.est_ns, done - start);
            r.samples = (r.samples + 1).min(FIRST_SAMPLES);
        }
        r.prev_done_ns = done;
    }
}

/// Where the budget holds a stream to one submission in flight and has room for part of
/// one more (3 ms, kernels of 2 ms: 1 ms), that part (ns, at most [`LEAD_MAX_NS`]), else
/// 0: the next submission may go in when the one in flight has about that much left, so
/// the GPU has it queued when the first ends instead of waiting for this thread to wake
/// and submit it. Work in flight by the estimate stays within the budget. Only at a
/// bound of one (with two or more in flight, one is always queued behind the running
/// one), under a budget (not K = 1), once the estimate is settled.
fn lead_ns(r: &Ring, limit: usize) -> u64 {
    let (b, k) = (BUDGET_NS.load(Relaxed), INFLIGHT.load(Relaxed) as usize);
    let cap = if k == 0 { UNBOUNDED_CAP } else { k };
    if b == 0 || r.samples < FIRST_SAMPLES || limit != 1 || cap == 1 || r.est_ns == 0 {
        return 0;
    }
    b.saturating_sub(r.est_ns.saturating_mul(limit as u64))
        .min(r.est_ns)
        .min(LEAD_MAX_NS)
}

/// The most a lead may be: enough to cover the submitting thread's wake-up on a loaded
/// host (100–200 µs on a busy 2-core machine) with room to spare, and no more, since
/// every microsecond of lead is work in flight that online waits for after a close.
const LEAD_MAX_NS: u64 = 500_000;

/// At the bound with a lead: waits until the oldest submission in flight is expected to
/// have `lead` left (its start, the previous wait's return or its submission when it was
/// alone, plus the estimate), or the gate closes, then lets the next one in (true).
/// Without a start (the run broke), false: the caller waits for the oldest as without a
/// lead.
fn submit_ahead(r: &mut Ring, lead: u64, closed: Option<&AtomicU32>) -> bool {
    let start = if r.events.len() == 1 {
        r.last_sub_ns.max(r.prev_done_ns)
    } else {
        r.prev_done_ns
    };
    let now = mono_ns();
    if start == 0 {
        return false;
    }
    let due = start.saturating_add(r.est_ns);
    let wake = due.saturating_sub(lead);
    if wake > now {
        match closed {
            // Woken at once by a close (the caller then goes back to the gate).
            Some(w) => {
                let c = w.load(SeqCst);
                if c == 0 {
                    futex_wait(w, 0, wake - now);
                }
            }
            None => std::thread::sleep(std::time::Duration::from_nanos(wake - now)),
        }
    }
    // Overslept: the oldest ended before its due time minus the lead, so the estimate
    // is too long (it leans long, and a stall can lift it). The one place it comes down
    // outside the timed waits: the wait for this event will find it complete and time
    // nothing, so without this a long estimate would never be corrected.
    if r.events.front().is_some_and(|&e| event_done(e)) {
        shorten(r, mono_ns().saturating_sub(start));
    }
    true
}

/// The submission in flight ended within `t` (ns) of the previous wait's return: the
/// estimate comes down an eighth of itself towards `t` if over. Not to `t` at once: the
/// previous wait returned a wake-up after the true end, so `t` may be short by that much;
/// and never so far that the bound grows (only the timed waits may do that).
fn shorten(r: &mut Ring, t: u64) {
    let floor = BUDGET_NS.load(Relaxed) / (limit(r) as u64 + 1) + 1;
    let next = t.max(r.est_ns - r.est_ns / 8).max(floor);
    if next < r.est_ns {
        r.est_ns = next;
    }
}

/// The estimate after sample `t` (ns; `est` 0: none yet): a quarter of the way up to a
/// longer sample, an eighth of the way down to a shorter one, a sample counting at most 8
/// times the estimate. Samples are noisy both ways (each is a wake-up late at its end and
/// starts from the previous wake-up): leaning a little long keeps the bound near the
/// budget on a loaded host; leaning more (half of the way up) held 50 µs kernels under
/// K = 4 at 14 % of submissions on this development VM (a quarter: 0.2 %).
fn estimate(est: u64, t: u64) -> u64 {
    let next = match est {
        0 => t,
        e => {
            let t = t.min(e.saturating_mul(8));
            if t > e {
                e + (t - e) / 4
            } else {
                e - (e - t) / 8
            }
        }
    };
    next.max(1)
}

/// Records an event after a submission on the ring's stream.
fn record(r: &mut Ring, entry: &Entry) -> Result<(), String> {
    for attempt in 0..2 {
        let e = match r.free.pop() {
            Some(e) => e,
            None => create_event(r.ctx).ok_or("cuEventCreate failed")?,
        };
        // SAFETY: the driver's cuEventRecord with our event and the ring's stream.
        let res = unsafe { (fns().event_record)(e, r.record_on) };
        if res == CUDA_SUCCESS {
            // The start of a submission alone in flight (what `bound` times from then).
            if r.events.is_empty() && BUDGET_NS.load(Relaxed) != 0 {
                r.last_sub_ns = mono_ns();
            }
            r.events.push_back(e);
            entry.inflight.fetch_add(1, Relaxed);
            return Ok(());
        }
        // A stream capture began meanwhile (on this stream after the check in `enter`, or
        // on a blocking stream while this is the legacy one): this one submission goes
        // untracked; the ring and the gate stay as they are.
        if CAPTURE_ERRORS.contains(&res) {
            r.free.push(e);
            return Ok(());
        }
        // The ring's events may be gone with a destroyed context, or a stream handle
        // reused in another: start the ring afresh once.
        if attempt == 0 {
            r.reset_timing();
            entry.inflight.fetch_sub(r.events.len() as u32, Relaxed);
            let dead: Vec<usize> = std::iter::once(e)
                .chain(r.free.drain(..))
                .chain(r.events.drain(..))
                .collect();
            for d in dead {
                // SAFETY: events of ours, destroyed once (errors ignored).
                unsafe { (fns().event_destroy)(d) };
            }
            if let Some(Key::Stream(h)) = r.key {
                let mut c = 0usize;
                // SAFETY: as in `assign`.
                if unsafe { (fns().stream_get_ctx)(h, &mut c as *mut usize as usize) }
                    == CUDA_SUCCESS
                {
                    r.ctx = c;
                }
            }
        }
    }
    Err("cuEventRecord failed after a submission".into())
}

// ---------------------------------------------------------------------------------------
// The submission path
// ---------------------------------------------------------------------------------------

/// What a submission holds between the gate and its end.
struct Ticket {
    gpu: &'static Gpu,
    entry: &'static Entry,
    ring: Option<MutexGuard<'static, Ring>>,
}

/// A gated submission: the gate, the in-flight bound, the driver's call, the event.
pub fn submit(kind: u32, real: usize, a: [usize; 12]) -> c_int {
    let t = catch_unwind(AssertUnwindSafe(|| enter(kind, &a))).unwrap_or_else(|_| {
        bell::disable("internal error at the launch gate");
        None
    });
    // SAFETY: the driver's entry point for this request with the caller's arguments.
    let r = unsafe { crate::hooks::call(real, a) };
    if let Some(t) = t {
        match catch_unwind(AssertUnwindSafe(|| leave(t, r))) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => bell::disable(&e),
            Err(_) => bell::disable("internal error after a submission"),
        }
    }
    r
}

fn enter(kind: u32, a: &[usize; 12]) -> Option<Ticket> {
    let stream = stream_of(kind, a);
    if stream.is_some_and(|h| capturing(h, kind)) {
        return None;
    }
    let ctx = match stream {
        Some(h) if h > CU_STREAM_PER_THREAD => 0,
        _ => match bell::current_ctx() {
            // No context: the driver refuses the call; nothing to gate.
            0 => return None,
            c => c,
        },
    };
    let key = match stream {
        None => None,
        Some(0) if kind & KIND_PTDS != 0 => Some(Key::PerThread(ctx, thread_tag())),
        Some(0) | Some(CU_STREAM_LEGACY) => Some(Key::Legacy(ctx)),
        Some(CU_STREAM_PER_THREAD) => Some(Key::PerThread(ctx, thread_tag())),
        Some(h) => Some(Key::Stream(h)),
    };
    let (pool, gpu) = match key {
        Some(k) => {
            let (p, g) = pool_for(k, ctx)?;
            (Some(p), g)
        }
        None => (None, gpu_of_current(ctx)?),
    };
    let g = &GPUS[gpu];
    let entry = g.entry()?;
    entry.in_submit.fetch_add(1, SeqCst);
    loop {
        let held = wait_at_gate(g, entry);
        let mut ring = match (pool, key) {
            (Some(p), Some(k)) => match ring_for(p, k, ctx) {
                Some(mut r) => {
                    if held {
                        // The time held at the gate is no submission's GPU time.
                        r.prev_done_ns = 0;
                    }
                    bound(&mut r, entry, g.gate().map(|(_, s)| &s.closed));
                    Some(r)
                }
                // Lost the ring twice: this one submission goes untracked.
                None => {
                    entry.in_submit.fetch_sub(1, SeqCst);
                    return None;
                }
            },
            _ => None,
        };
        // Closed while this thread waited for its oldest event: back to the gate (a
        // submission now would only lengthen the drain).
        if let Some(r) = ring.as_mut().filter(|_| closed_now(g)) {
            r.prev_done_ns = 0;
            continue;
        }
        return Some(Ticket {
            gpu: g,
            entry,
            ring,
        });
    }
}

/// The ring of pool `p`, locked, if it is still `k`'s (else `k`'s new ring).
fn ring_for(p: usize, k: Key, ctx: usize) -> Option<MutexGuard<'static, Ring>> {
    let r = lock(&POOLS[p].ring);
    if r.key == Some(k) {
        return Some(r);
    }
    // Reclaimed meanwhile (beyond MAX_POOLS streams): take a ring again.
    drop(r);
    let _ = POOL_CACHE.try_with(|c| {
        c.borrow_mut().iter_mut().for_each(|x| {
            if x.is_some_and(|x| x.0 == k) {
                *x = None
            }
        })
    });
    let r = pool_for(k, ctx).map(|(p, _)| lock(&POOLS[p].ring))?;
    (r.key == Some(k)).then_some(r)
}

/// The gate of `g` is closed now, the agent alive, the gate in force.
fn closed_now(g: &Gpu) -> bool {
    bell::MODE.load(Acquire) == GATED
        && g.gate()
            .is_some_and(|(m, s)| s.closed.load(SeqCst) != 0 && !stale(m))
}

/// Blocks the calling thread while its GPU's gate is closed (and the agent alive); true
/// if it blocked.
fn wait_at_gate(g: &Gpu, entry: &Entry) -> bool {
    let mut stamp = 0;
    while let Some((m, slot)) = g.gate() {
        let c = slot.closed.load(SeqCst);
        if c == 0 || bell::MODE.load(Acquire) != GATED {
            break;
        }
        if stale(m) {
            crate::warn_once(
                &STALE_WARNED,
                "the gpu-coloc agent's gate heartbeat is stale: the launch gate counts as open",
            );
            break;
        }
        if entry.in_submit.fetch_sub(1, SeqCst) == 1 {
            futex_wake(&entry.in_submit);
        }
        let now = now_ns();
        if stamp == 0 {
            stamp = match entry.blocked_ns.compare_exchange(0, now, AcqRel, Acquire) {
                Ok(_) => now,
                Err(v) => v,
            };
        }
        futex_wait(&slot.closed, c, BLOCK_RECHECK_NS);
        entry.in_submit.fetch_add(1, SeqCst);
    }
    if stamp != 0 {
        let _ = entry.blocked_ns.compare_exchange(stamp, 0, AcqRel, Acquire);
    }
    stamp != 0
}

fn leave(mut t: Ticket, r: c_int) -> Result<(), String> {
    let mut res = Ok(());
    if r == CUDA_SUCCESS {
        if let Some(ring) = t.ring.as_mut() {
            res = record(ring, t.entry);
        }
        t.entry.submitted.fetch_add(1, Relaxed);
    }
    drop(t.ring.take());
    if t.entry.in_submit.fetch_sub(1, SeqCst) == 1
        && t.gpu
            .gate()
            .is_some_and(|(_, s)| s.closed.load(SeqCst) != 0)
    {
        futex_wake(&t.entry.in_submit);
    }
    res
}

// ---------------------------------------------------------------------------------------
// The watcher
// ---------------------------------------------------------------------------------------

/// Maps the gate file at the first submission; true if it is valid and fresh (the gate
/// is then in force from this submission on).
pub fn map_at_start() -> bool {
    map_gate_file(None).is_some()
}

/// Starts the watcher thread (offline processes, at the first submission: never in a
/// constructor, never in a fork child, which has its mode off).
pub fn start_watcher() -> Result<(), String> {
    std::thread::Builder::new()
        .name("coloc-gate".into())
        .spawn(|| {
            if catch_unwind(watch).is_err() {
                bell::disable("internal error in the launch gate's watcher");
            }
        })
        .map(|_| ())
        .map_err(|e| format!("cannot start the launch gate's thread: {e}"))
}

fn watch() {
    // Signals meant for the application's threads are never delivered here.
    // SAFETY: a full set, applied to this thread only.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, std::ptr::null_mut());
    }
    // Per GPU: (mapping epoch, gate epoch) last acknowledged by this watcher.
    let mut acked = [(0u32, 0u32); MAX_GPUS];
    let mut next_file_check = 0u64;
    loop {
        if matches!(bell::MODE.load(Acquire), OFF) {
            return;
        }
        let now = now_ns();
        let current = mapping();
        let fresh = current.is_some_and(|m| !stale(m));
        if !fresh && now >= next_file_check {
            next_file_check = now + FILE_RECHECK_NS;
            map_gate_file(current);
        }
        let Some(m) = mapping() else {
            std::thread::sleep(std::time::Duration::from_nanos(
                next_file_check.saturating_sub(now_ns()).max(1_000_000),
            ));
            continue;
        };
        if !stale(m) {
            let _ = bell::MODE.compare_exchange(OPEN, GATED, AcqRel, Acquire);
        }
        let gen = m.gates.generation();
        if bell::MODE.load(Acquire) == GATED && !stale(m) {
            for (i, g) in GPUS.iter().enumerate() {
                if let Some(a) = acknowledge(g, i, acked[i]) {
                    acked[i] = a;
                }
            }
        }
        futex_wait(&m.gates.header().generation, gen, WATCH_RECHECK_NS);
    }
}

/// If GPU `i`'s gate is closed with an epoch not acknowledged yet: waits until no thread
/// is inside a submission for it and its in-flight work is complete, then acknowledges.
/// Returns the new (mapping epoch, gate epoch) acknowledged.
fn acknowledge(g: &Gpu, i: usize, last: (u32, u32)) -> Option<(u32, u32)> {
    let entry = g.entry()?;
    let (m, slot) = g.gate()?;
    let c = slot.closed.load(SeqCst);
    if c == 0 || (m.epoch, c) == last {
        return None;
    }
    loop {
        if slot.closed.load(SeqCst) != c || stale(m) || bell::MODE.load(Acquire) != GATED {
            return None;
        }
        let n = entry.in_submit.load(SeqCst);
        if n == 0 {
            break;
        }
        futex_wait(&entry.in_submit, n, 10_000_000);
    }
    for p in POOLS.iter() {
        if p.gpu.load(Acquire) != i {
            continue;
        }
        let mut r = lock(&p.ring);
        if p.gpu.load(Acquire) != i {
            continue;
        }
        if let Some(&newest) = r.events.back() {
            with_ctx(r.ctx, || sync_event(newest));
        }
        let n = r.events.len();
        let done: Vec<usize> = r.events.drain(..).collect();
        // Held at the gate: the stream's run is broken (its estimate stays).
        r.prev_done_ns = 0;
        r.free.extend(done);
        entry.inflight.fetch_sub(n as u32, Relaxed);
    }
    entry.gate_ack.store(c, SeqCst);
    if let Some(p) = bell::page() {
        p.bump_and_wake();
    }
    Some((m.epoch, c))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring(est_ns: u64, samples: u32) -> Ring {
        Ring {
            key: None,
            ctx: 0,
            record_on: 0,
            events: VecDeque::new(),
            free: Vec::new(),
            est_ns,
            last_sub_ns: 0,
            prev_done_ns: 0,
            samples,
        }
    }

    /// The lead is what the budget leaves beyond the one submission it allows, at most
    /// `LEAD_MAX_NS`, and none where K sets the bound, two or more fit, or the estimate
    /// is not settled;
    /// an overshot sleep brings the estimate down an eighth, never so far that the
    /// bound grows. (The only test here that sets the budget and K.)
    #[test]
    fn the_lead_and_its_correction() {
        BUDGET_NS.store(3_000_000, Relaxed);
        INFLIGHT.store(4, Relaxed);
        let r = ring(2_000_000, FIRST_SAMPLES);
        assert_eq!(limit(&r), 1);
        assert_eq!(lead_ns(&r, 1), LEAD_MAX_NS, "1 ms left over, capped");
        let r = ring(2_800_000, FIRST_SAMPLES);
        assert_eq!(lead_ns(&r, 1), 200_000, "what is left when under the cap");
        assert_eq!(lead_ns(&ring(2_000_000, 1), 1), 0, "not settled");
        let r = ring(500_000, FIRST_SAMPLES);
        assert_eq!(limit(&r), 4);
        assert_eq!(lead_ns(&r, 4), 0, "K sets the bound");
        let r = ring(1_200_000, FIRST_SAMPLES);
        assert_eq!(limit(&r), 2);
        assert_eq!(lead_ns(&r, 2), 0, "two in flight: one is always queued");
        INFLIGHT.store(1, Relaxed);
        assert_eq!(
            lead_ns(&ring(2_000_000, FIRST_SAMPLES), 1),
            0,
            "K = 1 sets it"
        );
        INFLIGHT.store(4, Relaxed);
        BUDGET_NS.store(0, Relaxed);
        assert_eq!(lead_ns(&ring(2_000_000, FIRST_SAMPLES), 1), 0, "no budget");
        BUDGET_NS.store(3_000_000, Relaxed);
        let mut r = ring(2_000_000, FIRST_SAMPLES);
        shorten(&mut r, 100_000);
        assert_eq!(r.est_ns, 1_750_000, "an eighth at a time");
        for _ in 0..20 {
            shorten(&mut r, 100_000);
        }
        assert_eq!(r.est_ns, 1_500_001, "never to where two fit the budget");
        assert_eq!(limit(&r), 1);
        shorten(&mut r, 1_600_000);
        assert_eq!(r.est_ns, 1_500_001, "never up");
        BUDGET_NS.store(DEFAULT_INFLIGHT_MS * 1_000_000, Relaxed);
        INFLIGHT.store(DEFAULT_INFLIGHT, Relaxed);
    }

    #[test]
    fn the_estimate_leans_long_and_caps_a_stall() {
        assert_eq!(
            estimate(0, 2_000),
            2_000,
            "the first sample is the estimate"
        );
        assert_eq!(estimate(1_000, 2_000), 1_250, "a quarter of the way up");
        assert_eq!(estimate(2_000, 1_000), 1_875, "an eighth of the way down");
        // A stall of 100 times the estimate counts as 8 times it.
        assert_eq!(estimate(1_000, 100_000), 1_000 + 7_000 / 4);
        // Kernels that became 10 times longer are followed within a few samples.
        let mut e = 1_000;
        for _ in 0..6 {
            e = estimate(e, 10_000);
        }
        assert!(e > 8_000, "{e}");
        // Short samples now and then do not pull a 2 ms estimate under 1.5 ms (where a
        // 3 ms budget would allow two kernels of 2 ms): one in four at a quarter.
        let mut e = 2_000_000;
        for i in 0..400 {
            e = estimate(e, if i % 4 == 0 { 500_000 } else { 2_000_000 });
        }
        assert!(e > 1_500_000, "{e}");
        assert_eq!(estimate(1, 0), 1, "never 0 (0 means none)");
    }
}
