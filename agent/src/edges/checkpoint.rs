//! The CUDA driver's checkpoint API: an external controller locks a process's CUDA calls,
//! copies its device memory to host memory and releases its GPU resources, then brings it
//! back. The driver enforces the lock; the process cannot forge or lift it.
//!
//! ```text
//!   running ──lock(timeout)──► locked ──checkpoint──► checkpointed
//!      ▲                        │  ▲                      │
//!      └────────unlock──────────┘  └───────restore────────┘
//! ```
//!
//! - `lock` blocks the process's further CUDA calls and waits for its already-submitted
//!   work to complete (up to the timeout; on timeout the process is left running).
//! - `checkpoint` needs a locked process; the device memory goes to host memory kept by
//!   the driver, and the process leaves NVML's process list.
//! - `restore` brings it back and leaves it locked. The driver does it on a thread inside
//!   the target (`restore_thread`), so the target must not be stopped or frozen then.
//! - `unlock` lets it run again.
//!
//! Entry points of the CUDA driver from CUDA 12.8 (display driver 570) on, looked up by
//! name in `libcuda.so.1`. A driver without them loads as [`LoadError::NoApi`], so the
//! caller can fall back to the other holds and say why.
//!
//! PIDs: the driver takes a bare PID, so a reused PID could be acted on between the
//! caller's check and the call. Callers check the process's identity (pidfd and start
//! time) right before each call; the window left is that of one system call.
//!
//! May touch: the CUDA driver library (its checkpoint entry points only; this module never
//! creates a context or submits work).

pub use crate::control::model::driver::{CallEnd, CuError, Done, Op, ProcessState};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::fmt;
use std::time::Duration;

impl ProcessState {
    /// From the driver's number.
    pub fn from_raw(v: u32) -> ProcessState {
        match v {
            0 => ProcessState::Running,
            1 => ProcessState::Locked,
            2 => ProcessState::Checkpointed,
            3 => ProcessState::Failed,
            v => ProcessState::Other(v),
        }
    }

    /// The name used in logs, `/state` and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            ProcessState::Running => "running",
            ProcessState::Locked => "locked",
            ProcessState::Checkpointed => "checkpointed",
            ProcessState::Failed => "failed",
            ProcessState::Other(_) => "other",
        }
    }
}

impl Op {
    /// Every operation.
    pub const ALL: [Op; 6] = [
        Op::State,
        Op::Lock,
        Op::Checkpoint,
        Op::Restore,
        Op::Unlock,
        Op::RestoreThread,
    ];

    /// Short name (logs, metric labels, command lines).
    pub fn as_str(self) -> &'static str {
        match self {
            Op::State => "state",
            Op::Lock => "lock",
            Op::Checkpoint => "checkpoint",
            Op::Restore => "restore",
            Op::Unlock => "unlock",
            Op::RestoreThread => "restore-thread",
        }
    }

    /// The driver's entry point.
    pub fn symbol(self) -> &'static CStr {
        match self {
            Op::State => c"cuCheckpointProcessGetState",
            Op::Lock => c"cuCheckpointProcessLock",
            Op::Checkpoint => c"cuCheckpointProcessCheckpoint",
            Op::Restore => c"cuCheckpointProcessRestore",
            Op::Unlock => c"cuCheckpointProcessUnlock",
            Op::RestoreThread => c"cuCheckpointProcessGetRestoreThreadId",
        }
    }

    /// From [`Op::as_str`].
    pub fn parse(s: &str) -> Option<Op> {
        Op::ALL.into_iter().find(|o| o.as_str() == s)
    }
}

/// The `CUresult` codes the checkpoint calls are documented or seen to answer, by name.
const NAMES: &[(c_int, &str)] = &[
    (0, "CUDA_SUCCESS"),
    (1, "CUDA_ERROR_INVALID_VALUE"),
    (2, "CUDA_ERROR_OUT_OF_MEMORY"),
    (3, "CUDA_ERROR_NOT_INITIALIZED"),
    (4, "CUDA_ERROR_DEINITIALIZED"),
    (100, "CUDA_ERROR_NO_DEVICE"),
    (101, "CUDA_ERROR_INVALID_DEVICE"),
    (201, "CUDA_ERROR_INVALID_CONTEXT"),
    (304, "CUDA_ERROR_OPERATING_SYSTEM"),
    (400, "CUDA_ERROR_INVALID_HANDLE"),
    (401, "CUDA_ERROR_ILLEGAL_STATE"),
    (500, "CUDA_ERROR_NOT_FOUND"),
    (600, "CUDA_ERROR_NOT_READY"),
    (800, "CUDA_ERROR_NOT_PERMITTED"),
    (801, "CUDA_ERROR_NOT_SUPPORTED"),
    (909, "CUDA_ERROR_TIMEOUT"),
    (999, "CUDA_ERROR_UNKNOWN"),
];

impl CuError {
    /// The driver does not offer this to this process (an unsupported driver, a process
    /// with memory the driver cannot checkpoint): fall back to another hold.
    pub fn is_not_supported(&self) -> bool {
        self.code == 801
    }

    /// The process is not in a state this call accepts.
    pub fn is_illegal_state(&self) -> bool {
        self.code == 401
    }

    /// The lock's timeout elapsed (the process is left running).
    pub fn is_timeout(&self) -> bool {
        self.code == 909
    }

    /// The short label for metrics: the name without its `CUDA_ERROR_` prefix, lower case.
    pub fn reason(&self) -> String {
        self.name
            .strip_prefix("CUDA_ERROR_")
            .unwrap_or(&self.name)
            .to_ascii_lowercase()
    }
}

impl fmt::Display for CuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({}) answered {} ({})",
            self.op.symbol().to_string_lossy(),
            self.op.as_str(),
            self.name,
            self.code
        )
    }
}

impl std::error::Error for CuError {}

/// Why the checkpoint API cannot be used at all.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The library did not load.
    #[error("cannot load the CUDA driver {lib:?}: {cause}")]
    NoLibrary {
        /// What was tried.
        lib: String,
        /// The loader's message.
        cause: String,
    },
    /// The driver has no checkpoint entry points (before CUDA 12.8 / display driver 570).
    #[error(
        "the CUDA driver {lib:?} (CUDA {version}) has no checkpoint API: {missing} is \
         missing (CUDA 12.8, display driver 570, or later needed)"
    )]
    NoApi {
        /// What was loaded.
        lib: String,
        /// `cuDriverGetVersion`, as `major.minor`, or `unknown`.
        version: String,
        /// The first entry point not found.
        missing: String,
    },
}

type GetState = unsafe extern "C" fn(c_int, *mut c_uint) -> c_int;
type WithArgs = unsafe extern "C" fn(c_int, *mut c_void) -> c_int;
type GetTid = unsafe extern "C" fn(c_int, *mut c_int) -> c_int;
type ErrorName = unsafe extern "C" fn(c_int, *mut *const c_char) -> c_int;
type DriverVersion = unsafe extern "C" fn(*mut c_int) -> c_int;

/// `CUcheckpointLockArgs`: `timeoutMs`, a reserved word, seven reserved `u64`s (64 bytes).
#[repr(C)]
#[derive(Debug, Default)]
struct LockArgs {
    timeout_ms: c_uint,
    reserved0: c_uint,
    reserved1: [u64; 7],
}

const _: () = assert!(std::mem::size_of::<LockArgs>() == 64);

/// The checkpoint entry points of one loaded CUDA driver.
#[derive(Debug)]
pub struct CudaCheckpoint {
    lib: String,
    version: Option<i32>,
    get_state: GetState,
    lock: WithArgs,
    checkpoint: WithArgs,
    restore: WithArgs,
    unlock: WithArgs,
    restore_tid: GetTid,
    error_name: Option<ErrorName>,
}

fn dl_error() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated message owned by the loader.
    unsafe {
        let e = libc::dlerror();
        if e.is_null() {
            "unknown loader error".into()
        } else {
            CStr::from_ptr(e).to_string_lossy().into_owned()
        }
    }
}

impl CudaCheckpoint {
    /// Loads `lib` (`libcuda.so.1` for the installed driver) and finds the checkpoint
    /// entry points. The library stays loaded for the life of the process.
    pub fn open(lib: &str) -> Result<CudaCheckpoint, LoadError> {
        let c = CString::new(lib).map_err(|_| LoadError::NoLibrary {
            lib: lib.into(),
            cause: "the path contains a NUL byte".into(),
        })?;
        // SAFETY: dlopen/dlsym with NUL-terminated names; the handle is never closed, so
        // the function pointers stay valid; each transmute names the entry point's C type
        // as cuda.h declares it.
        unsafe {
            let h = libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
            if h.is_null() {
                return Err(LoadError::NoLibrary {
                    lib: lib.into(),
                    cause: dl_error(),
                });
            }
            let sym = |name: &CStr| {
                let p = libc::dlsym(h, name.as_ptr());
                (!p.is_null()).then_some(p)
            };
            let version = sym(c"cuDriverGetVersion").and_then(|p| {
                let f = std::mem::transmute::<*mut c_void, DriverVersion>(p);
                let mut v = 0;
                (f(&mut v) == 0).then_some(v)
            });
            let mut found = Vec::new();
            for op in Op::ALL {
                match sym(op.symbol()) {
                    Some(p) => found.push(p),
                    None => {
                        return Err(LoadError::NoApi {
                            lib: lib.into(),
                            version: version
                                .map(|v| format!("{}.{}", v / 1000, v % 1000 / 10))
                                .unwrap_or_else(|| "unknown".into()),
                            missing: op.symbol().to_string_lossy().into_owned(),
                        })
                    }
                }
            }
            Ok(CudaCheckpoint {
                lib: lib.into(),
                version,
                get_state: std::mem::transmute::<*mut c_void, GetState>(found[0]),
                lock: std::mem::transmute::<*mut c_void, WithArgs>(found[1]),
                checkpoint: std::mem::transmute::<*mut c_void, WithArgs>(found[2]),
                restore: std::mem::transmute::<*mut c_void, WithArgs>(found[3]),
                unlock: std::mem::transmute::<*mut c_void, WithArgs>(found[4]),
                restore_tid: std::mem::transmute::<*mut c_void, GetTid>(found[5]),
                error_name: sym(c"cuGetErrorName")
                    .map(|p| std::mem::transmute::<*mut c_void, ErrorName>(p)),
            })
        }
    }

    /// The library this was loaded from.
    pub fn library(&self) -> &str {
        &self.lib
    }

    /// `cuDriverGetVersion` (e.g. 13000 for CUDA 13.0), if the driver answered.
    pub fn driver_version(&self) -> Option<i32> {
        self.version
    }

    fn check(&self, op: Op, code: c_int) -> Result<(), CuError> {
        if code == 0 {
            return Ok(());
        }
        let mut name = NAMES
            .iter()
            .find(|(c, _)| *c == code)
            .map(|(_, n)| n.to_string());
        if name.is_none() {
            if let Some(f) = self.error_name {
                let mut p: *const c_char = std::ptr::null();
                // SAFETY: the driver's cuGetErrorName with a valid out-pointer; the name
                // it returns is a static NUL-terminated string.
                if unsafe { f(code, &mut p) } == 0 && !p.is_null() {
                    name = Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned());
                }
            }
        }
        Err(CuError {
            op,
            code,
            name: name.unwrap_or_else(|| format!("CUresult {code}")),
        })
    }

    fn pid(pid: u32) -> c_int {
        // PIDs fit in an int (pid_max is at most 2^22).
        c_int::try_from(pid).unwrap_or(c_int::MAX)
    }

    /// `cuCheckpointProcessGetState`.
    pub fn state(&self, pid: u32) -> Result<ProcessState, CuError> {
        let mut s: c_uint = 0;
        // SAFETY: the entry point with a valid out-pointer.
        let r = unsafe { (self.get_state)(Self::pid(pid), &mut s) };
        self.check(Op::State, r).map(|_| ProcessState::from_raw(s))
    }

    /// `cuCheckpointProcessLock` with a timeout (zero: wait for ever, which a caller
    /// with a loop to run should never ask for).
    pub fn lock(&self, pid: u32, timeout: Duration) -> Result<(), CuError> {
        let mut args = LockArgs {
            timeout_ms: c_uint::try_from(timeout.as_millis()).unwrap_or(c_uint::MAX),
            ..LockArgs::default()
        };
        // SAFETY: the entry point with its argument struct (reserved fields zeroed).
        let r = unsafe { (self.lock)(Self::pid(pid), &mut args as *mut LockArgs as *mut c_void) };
        self.check(Op::Lock, r)
    }

    /// `cuCheckpointProcessCheckpoint` (no arguments).
    pub fn checkpoint(&self, pid: u32) -> Result<(), CuError> {
        // SAFETY: the entry point; its argument struct is optional (NULL).
        let r = unsafe { (self.checkpoint)(Self::pid(pid), std::ptr::null_mut()) };
        self.check(Op::Checkpoint, r)
    }

    /// `cuCheckpointProcessRestore` onto the same GPUs (no remapping).
    pub fn restore(&self, pid: u32) -> Result<(), CuError> {
        // SAFETY: the entry point; its argument struct is optional (NULL: same GPUs).
        let r = unsafe { (self.restore)(Self::pid(pid), std::ptr::null_mut()) };
        self.check(Op::Restore, r)
    }

    /// `cuCheckpointProcessUnlock`.
    pub fn unlock(&self, pid: u32) -> Result<(), CuError> {
        // SAFETY: the entry point; its argument struct is optional (NULL).
        let r = unsafe { (self.unlock)(Self::pid(pid), std::ptr::null_mut()) };
        self.check(Op::Unlock, r)
    }

    /// `cuCheckpointProcessGetRestoreThreadId`: the thread of the target that restores it.
    pub fn restore_thread(&self, pid: u32) -> Result<i32, CuError> {
        let mut tid: c_int = 0;
        // SAFETY: the entry point with a valid out-pointer.
        let r = unsafe { (self.restore_tid)(Self::pid(pid), &mut tid) };
        self.check(Op::RestoreThread, r).map(|_| tid)
    }
}

/// The driver's checkpoint calls, as the agent uses them (the real driver: [`CudaCheckpoint`];
/// tests: a fake).
pub trait DriverApi: Send + Sync {
    /// `cuCheckpointProcessGetState`.
    fn state(&self, pid: u32) -> Result<ProcessState, CuError>;
    /// `cuCheckpointProcessLock` with a timeout.
    fn lock(&self, pid: u32, timeout: Duration) -> Result<(), CuError>;
    /// `cuCheckpointProcessCheckpoint`.
    fn checkpoint(&self, pid: u32) -> Result<(), CuError>;
    /// `cuCheckpointProcessRestore`.
    fn restore(&self, pid: u32) -> Result<(), CuError>;
    /// `cuCheckpointProcessUnlock`.
    fn unlock(&self, pid: u32) -> Result<(), CuError>;
}

impl DriverApi for CudaCheckpoint {
    fn state(&self, pid: u32) -> Result<ProcessState, CuError> {
        CudaCheckpoint::state(self, pid)
    }
    fn lock(&self, pid: u32, timeout: Duration) -> Result<(), CuError> {
        CudaCheckpoint::lock(self, pid, timeout)
    }
    fn checkpoint(&self, pid: u32) -> Result<(), CuError> {
        CudaCheckpoint::checkpoint(self, pid)
    }
    fn restore(&self, pid: u32) -> Result<(), CuError> {
        CudaCheckpoint::restore(self, pid)
    }
    fn unlock(&self, pid: u32) -> Result<(), CuError> {
        CudaCheckpoint::unlock(self, pid)
    }
}

/// The driver's calls as the control loop makes them: each started at once, its end
/// collected later ([`DriverCalls`]: a thread per call over the real driver; tests: a model
/// of the driver on the loop's fake clock).
pub trait DriverWork: Send {
    /// Starts `op` on `key` (a lock with `lock_timeout`): the call's id.
    fn start(&mut self, key: crate::edges::procfs::ProcKey, op: Op, lock_timeout: Duration) -> u64;
    /// The calls that have ended since the last look.
    fn finished(&mut self) -> Vec<Done>;
    /// Waits up to `budget` for the next call to end; `None` when none did.
    fn wait_next(&mut self, budget: Duration) -> Option<Done>;
}

impl DriverWork for DriverCalls {
    fn start(&mut self, key: crate::edges::procfs::ProcKey, op: Op, lock_timeout: Duration) -> u64 {
        DriverCalls::start(self, key, op, lock_timeout)
    }
    fn finished(&mut self) -> Vec<Done> {
        DriverCalls::finished(self)
    }
    fn wait_next(&mut self, budget: Duration) -> Option<Done> {
        DriverCalls::wait_next(self, budget)
    }
}

/// Runs the driver's calls off the caller's thread, one thread per call: every call that
/// changes a process waits until that process runs, and a process that is stopped (by
/// its owner, or frozen) would otherwise stall whoever called. A call given up on may
/// still end later; its [`Done`] then says so. The identity of the process (PID and
/// start time) is checked right before each call: the driver takes a bare PID.
pub struct DriverCalls {
    api: std::sync::Arc<dyn DriverApi>,
    procfs: std::sync::Arc<dyn crate::edges::procfs::ProcFs>,
    tx: std::sync::mpsc::Sender<Done>,
    rx: std::sync::mpsc::Receiver<Done>,
    next: u64,
    /// Calls started and not yet collected: id → (process, op, started).
    running:
        std::collections::BTreeMap<u64, (crate::edges::procfs::ProcKey, Op, std::time::Instant)>,
}

impl fmt::Debug for DriverCalls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DriverCalls")
            .field("running", &self.running.len())
            .finish_non_exhaustive()
    }
}

impl DriverCalls {
    /// Calls `api`, checking identities through `procfs`.
    pub fn new(
        api: std::sync::Arc<dyn DriverApi>,
        procfs: std::sync::Arc<dyn crate::edges::procfs::ProcFs>,
    ) -> DriverCalls {
        let (tx, rx) = std::sync::mpsc::channel();
        DriverCalls {
            api,
            procfs,
            tx,
            rx,
            next: 1,
            running: std::collections::BTreeMap::new(),
        }
    }

    /// Starts `op` on `key` (a lock with `lock_timeout`) and returns at once: the call's id.
    pub fn start(
        &mut self,
        key: crate::edges::procfs::ProcKey,
        op: Op,
        lock_timeout: Duration,
    ) -> u64 {
        let id = self.next;
        self.next += 1;
        let started = std::time::Instant::now();
        self.running.insert(id, (key, op, started));
        let (api, procfs, tx) = (self.api.clone(), self.procfs.clone(), self.tx.clone());
        let run = move || {
            // The same process still? Its pidfd is opened only if PID and start time match.
            let mut state = None;
            let end = match procfs.open_pidfd(key) {
                Err(_) => CallEnd::Gone,
                Ok(_pin) => CallEnd::Answered(match op {
                    Op::Lock => api.lock(key.pid, lock_timeout),
                    Op::Checkpoint => api.checkpoint(key.pid),
                    Op::Restore => api.restore(key.pid),
                    Op::Unlock => api.unlock(key.pid),
                    Op::State => api.state(key.pid).map(|s| state = Some(s)),
                    Op::RestoreThread => Ok(()),
                }),
            };
            let _ = tx.send(Done {
                id,
                key,
                op,
                end,
                state,
                elapsed: started.elapsed(),
            });
        };
        if let Err(e) = std::thread::Builder::new()
            .name(format!("coloc-driver-{id}"))
            .spawn(run)
        {
            // No thread: the call ends here, refused (the caller falls back).
            let _ = self.tx.send(Done {
                id,
                key,
                op,
                end: CallEnd::Answered(Err(CuError {
                    op,
                    code: -1,
                    name: format!("no thread for the call: {e}"),
                })),
                state: None,
                elapsed: Duration::ZERO,
            });
        }
        id
    }

    /// The calls that have ended since the last look.
    pub fn finished(&mut self) -> Vec<Done> {
        let done: Vec<Done> = self.rx.try_iter().collect();
        for d in &done {
            self.running.remove(&d.id);
        }
        done
    }

    /// Calls still running: (id, process, op, how long so far).
    pub fn running(&self) -> Vec<(u64, crate::edges::procfs::ProcKey, Op, Duration)> {
        self.running
            .iter()
            .map(|(id, (k, op, t))| (*id, *k, *op, t.elapsed()))
            .collect()
    }

    /// Waits up to `budget` for the next call to end; `None` when none did.
    pub fn wait_next(&mut self, budget: Duration) -> Option<Done> {
        let d = self.rx.recv_timeout(budget).ok()?;
        self.running.remove(&d.id);
        Some(d)
    }

    /// Waits up to `budget` for every running call to end (shutdown); what ended.
    pub fn wait_all(&mut self, budget: Duration) -> Vec<Done> {
        let until = std::time::Instant::now() + budget;
        let mut out = Vec::new();
        while !self.running.is_empty() {
            let left = until.saturating_duration_since(std::time::Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(d) => {
                    self.running.remove(&d.id);
                    out.push(d);
                }
                Err(_) => break,
            }
        }
        out
    }
}

/// How long one driver call of a resume may take before it is given up (a process stopped
/// by someone else makes the driver wait for it): a restore of a whole GPU's memory took
/// up to 6.5 s on an H100 (31 GB).
pub const RESUME_CALL_BUDGET: Duration = Duration::from_secs(60);

/// The same at the agent's start, where it comes before the health file: a process its
/// owner keeps stopped must not keep the agent from starting (the chart's liveness probe
/// gives it about 30 s). What does not return in time stays recorded; the call may still
/// end on its own thread.
pub const START_CALL_BUDGET: Duration = Duration::from_secs(10);

/// Gives back what a lock or checkpoint entry of the record says the driver may hold:
/// asks the driver where `key` is, restores it if checkpointed (it must run: a caller
/// resumes every other entry first), then unlocks it. The identity is checked right before
/// each call. `Done` when it runs; `Gone` when the process exited or the driver does not
/// know it (no CUDA: nothing held); `Skipped` when the driver reports it failed (nothing
/// can be done); `Failed` when a call is refused or takes longer than `budget`.
pub fn resume_recorded(
    api: std::sync::Arc<dyn DriverApi>,
    key: crate::edges::procfs::ProcKey,
    budget: Duration,
) -> crate::edges::actuator::Progress {
    use crate::edges::actuator::{ActError, Progress};
    let call = |op: Op| -> Result<Option<ProcessState>, String> {
        if crate::edges::procfs::open_pidfd(key).is_err() {
            return Err("gone".into());
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let api = api.clone();
        std::thread::Builder::new()
            .name("coloc-resume-driver".into())
            .spawn(move || {
                let r = match op {
                    Op::State => api.state(key.pid).map(Some),
                    Op::Restore => api.restore(key.pid).map(|_| None),
                    Op::Unlock => api.unlock(key.pid).map(|_| None),
                    _ => Ok(None),
                };
                let _ = tx.send(r);
            })
            .map_err(|e| format!("no thread for the driver call: {e}"))?;
        match rx.recv_timeout(budget) {
            Ok(Ok(s)) => Ok(s),
            Ok(Err(e)) if e.code == 3 || e.code == 500 => Err("unknown".into()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!(
                "{} of pid {} did not return within {budget:?} (is the process stopped or frozen?)",
                op.symbol().to_string_lossy(),
                key.pid
            )),
        }
    };
    let fail = |e: String| Progress::Failed(ActError::Driver(e));
    let state = match call(Op::State) {
        Ok(Some(s)) => s,
        Ok(None) => return fail("the driver gave no state".into()),
        Err(e) if e == "gone" || e == "unknown" => return Progress::Gone,
        Err(e) => return fail(e),
    };
    if state == ProcessState::Checkpointed {
        match call(Op::Restore) {
            Ok(_) => {}
            Err(e) if e == "gone" => return Progress::Gone,
            Err(e) => return fail(e),
        }
    }
    match state {
        ProcessState::Running => Progress::Done,
        ProcessState::Failed | ProcessState::Other(_) => Progress::Skipped,
        ProcessState::Locked | ProcessState::Checkpointed => match call(Op::Unlock) {
            Ok(_) => Progress::Done,
            Err(e) if e == "gone" => Progress::Gone,
            Err(e) => fail(e),
        },
    }
}

/// A driver in memory, for tests: per-PID states with the real driver's rules (wrong
/// state: `CUDA_ERROR_ILLEGAL_STATE`; unknown PID: `CUDA_ERROR_NOT_INITIALIZED`),
/// refusals to inject per operation, and calls that block until released (a stopped
/// process).
#[cfg(test)]
pub mod fake {
    use super::*;
    use std::collections::BTreeMap;
    use std::sync::{Condvar, Mutex};

    /// The fake's state.
    #[derive(Debug, Default)]
    pub struct Inner {
        /// PID → state.
        pub states: BTreeMap<u32, ProcessState>,
        /// Operation → the code it answers instead.
        pub refuse: BTreeMap<&'static str, i32>,
        /// PIDs whose calls block (stopped processes) until removed.
        pub stopped: std::collections::BTreeSet<u32>,
        /// Every call made: (op, pid).
        pub calls: Vec<(Op, u32)>,
    }

    /// The fake driver.
    #[derive(Debug, Default)]
    pub struct FakeDriver {
        /// Its state.
        pub inner: Mutex<Inner>,
        cv: Condvar,
    }

    impl FakeDriver {
        /// A process with CUDA, running.
        pub fn add(&self, pid: u32) {
            self.inner
                .lock()
                .unwrap()
                .states
                .insert(pid, ProcessState::Running);
        }
        /// Stops (`true`) or continues a process: its calls block while stopped.
        pub fn stop(&self, pid: u32, stopped: bool) {
            let mut g = self.inner.lock().unwrap();
            if stopped {
                g.stopped.insert(pid);
            } else {
                g.stopped.remove(&pid);
            }
            self.cv.notify_all();
        }
        fn call(
            &self,
            op: Op,
            pid: u32,
            from: ProcessState,
            to: ProcessState,
        ) -> Result<(), CuError> {
            let err = |code: i32, name: &str| CuError {
                op,
                code,
                name: name.into(),
            };
            let mut g = self.inner.lock().unwrap();
            g.calls.push((op, pid));
            while g.stopped.contains(&pid) {
                g = self.cv.wait(g).unwrap();
            }
            if let Some(&code) = g.refuse.get(op.as_str()) {
                return Err(err(code, "CUDA_ERROR_INJECTED"));
            }
            match g.states.get(&pid).copied() {
                None => Err(err(3, "CUDA_ERROR_NOT_INITIALIZED")),
                Some(s) if s == from => {
                    g.states.insert(pid, to);
                    Ok(())
                }
                Some(_) => Err(err(401, "CUDA_ERROR_ILLEGAL_STATE")),
            }
        }
    }

    impl DriverApi for FakeDriver {
        fn state(&self, pid: u32) -> Result<ProcessState, CuError> {
            self.inner
                .lock()
                .unwrap()
                .states
                .get(&pid)
                .copied()
                .ok_or(CuError {
                    op: Op::State,
                    code: 3,
                    name: "CUDA_ERROR_NOT_INITIALIZED".into(),
                })
        }
        fn lock(&self, pid: u32, _t: Duration) -> Result<(), CuError> {
            self.call(Op::Lock, pid, ProcessState::Running, ProcessState::Locked)
        }
        fn checkpoint(&self, pid: u32) -> Result<(), CuError> {
            self.call(
                Op::Checkpoint,
                pid,
                ProcessState::Locked,
                ProcessState::Checkpointed,
            )
        }
        fn restore(&self, pid: u32) -> Result<(), CuError> {
            self.call(
                Op::Restore,
                pid,
                ProcessState::Checkpointed,
                ProcessState::Locked,
            )
        }
        fn unlock(&self, pid: u32) -> Result<(), CuError> {
            self.call(Op::Unlock, pid, ProcessState::Locked, ProcessState::Running)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_named() {
        let e = CudaCheckpoint::open("/nonexistent/libcuda.so.1").unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, LoadError::NoLibrary { .. }), "{msg}");
        assert!(msg.contains("/nonexistent/libcuda.so.1"), "{msg}");
    }

    #[test]
    fn a_library_without_the_api_says_which_entry_point_is_missing() {
        // libc is a library without any CUDA entry point.
        let e = CudaCheckpoint::open("libc.so.6").unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, LoadError::NoApi { .. }), "{msg}");
        assert!(msg.contains("cuCheckpointProcessGetState"), "{msg}");
        assert!(msg.contains("CUDA unknown"), "{msg}");
    }

    /// Identities: every process is itself except PIDs listed as gone.
    #[derive(Debug, Default)]
    struct Ids {
        gone: Vec<u32>,
    }

    impl crate::edges::procfs::ProcFs for Ids {
        fn read_proc(&self, _: u32) -> std::io::Result<crate::edges::procfs::ProcInfo> {
            unimplemented!()
        }
        fn read_stat(&self, _: u32) -> std::io::Result<crate::edges::procfs::Stat> {
            unimplemented!()
        }
        fn self_cgroups(&self) -> crate::edges::procfs::Cgroups {
            unimplemented!()
        }
        fn self_pid(&self) -> u32 {
            1
        }
        fn cgroup_members(&self, _: &std::path::Path) -> std::io::Result<Vec<u32>> {
            unimplemented!()
        }
        fn cgroup_tree_members(&self, _: &std::path::Path) -> std::io::Result<Vec<u32>> {
            unimplemented!()
        }
        fn open_pidfd(
            &self,
            key: crate::edges::procfs::ProcKey,
        ) -> std::io::Result<std::os::fd::OwnedFd> {
            if self.gone.contains(&key.pid) {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            // Any descriptor stands for the pin.
            Ok(std::fs::File::open("/dev/null")?.into())
        }
        fn exited(
            &self,
            pins: &[(crate::edges::procfs::ProcKey, &std::os::fd::OwnedFd)],
        ) -> Vec<bool> {
            vec![false; pins.len()]
        }
    }

    fn key(pid: u32) -> crate::edges::procfs::ProcKey {
        crate::edges::procfs::ProcKey { pid, start: 7 }
    }

    fn wait_done(calls: &mut DriverCalls, n: usize) -> Vec<Done> {
        let mut out = Vec::new();
        let t = std::time::Instant::now();
        while out.len() < n {
            out.extend(calls.finished());
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "calls did not end: {out:?}"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        out
    }

    #[test]
    fn calls_run_off_the_caller_and_a_stopped_process_stalls_only_its_own() {
        let drv = std::sync::Arc::new(fake::FakeDriver::default());
        drv.add(10);
        drv.add(11);
        drv.stop(11, true);
        let mut calls = DriverCalls::new(drv.clone(), std::sync::Arc::new(Ids::default()));
        let t = std::time::Instant::now();
        let a = calls.start(key(10), Op::Lock, Duration::from_secs(1));
        let b = calls.start(key(11), Op::Lock, Duration::from_secs(1));
        assert!(t.elapsed() < Duration::from_millis(50), "start blocked");
        let done = wait_done(&mut calls, 1);
        assert_eq!((done[0].id, &done[0].end), (a, &CallEnd::Answered(Ok(()))));
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            calls.finished().is_empty(),
            "the stopped process's lock ended"
        );
        assert_eq!(calls.running().len(), 1);
        assert_eq!(calls.running()[0].0, b);
        // Continued: the lock it was given ends after all (the caller may have given up).
        drv.stop(11, false);
        let done = wait_done(&mut calls, 1);
        assert_eq!((done[0].id, done[0].op), (b, Op::Lock));
        assert_eq!(drv.state(11), Ok(ProcessState::Locked));
        assert!(calls.running().is_empty());
    }

    #[test]
    fn a_process_that_is_not_itself_any_more_is_not_called() {
        let drv = std::sync::Arc::new(fake::FakeDriver::default());
        drv.add(12);
        let mut calls = DriverCalls::new(drv.clone(), std::sync::Arc::new(Ids { gone: vec![12] }));
        calls.start(key(12), Op::Lock, Duration::from_secs(1));
        let done = wait_done(&mut calls, 1);
        assert_eq!(done[0].end, CallEnd::Gone);
        assert!(
            drv.inner.lock().unwrap().calls.is_empty(),
            "the driver was called for a reused PID"
        );
    }

    #[test]
    fn refusals_come_back_named() {
        let drv = std::sync::Arc::new(fake::FakeDriver::default());
        drv.add(13);
        let mut calls = DriverCalls::new(drv.clone(), std::sync::Arc::new(Ids::default()));
        calls.start(key(13), Op::Checkpoint, Duration::ZERO);
        let done = wait_done(&mut calls, 1);
        match &done[0].end {
            CallEnd::Answered(Err(e)) => assert!(e.is_illegal_state(), "{e}"),
            other => panic!("{other:?}"),
        }
        assert!(calls.wait_all(Duration::from_millis(10)).is_empty());
    }

    #[test]
    fn states_and_ops_have_names() {
        assert_eq!(ProcessState::from_raw(2), ProcessState::Checkpointed);
        assert_eq!(ProcessState::from_raw(9), ProcessState::Other(9));
        for op in Op::ALL {
            assert_eq!(Op::parse(op.as_str()), Some(op));
        }
        let e = CuError {
            op: Op::Lock,
            code: 909,
            name: "CUDA_ERROR_TIMEOUT".into(),
        };
        assert!(e.is_timeout() && !e.is_not_supported());
        assert_eq!(e.reason(), "timeout");
        assert!(e.to_string().contains("cuCheckpointProcessLock"));
    }
}
