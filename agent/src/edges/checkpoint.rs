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

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::fmt;
use std::time::Duration;

/// What the driver says a process is in (`CUprocessState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessState {
    /// `CU_PROCESS_STATE_RUNNING`: the process can make CUDA calls.
    Running,
    /// `CU_PROCESS_STATE_LOCKED`: its CUDA calls block.
    Locked,
    /// `CU_PROCESS_STATE_CHECKPOINTED`: its device memory is on the host, its GPU
    /// resources released.
    Checkpointed,
    /// `CU_PROCESS_STATE_FAILED`: an uncorrectable error during checkpoint or restore.
    Failed,
    /// A value this build does not know (a newer driver's).
    Other(u32),
}

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

/// One of the driver's checkpoint operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// `cuCheckpointProcessGetState`.
    State,
    /// `cuCheckpointProcessLock`.
    Lock,
    /// `cuCheckpointProcessCheckpoint`.
    Checkpoint,
    /// `cuCheckpointProcessRestore`.
    Restore,
    /// `cuCheckpointProcessUnlock`.
    Unlock,
    /// `cuCheckpointProcessGetRestoreThreadId`.
    RestoreThread,
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

/// A checkpoint call the driver refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CuError {
    /// The call.
    pub op: Op,
    /// The driver's `CUresult`.
    pub code: i32,
    /// Its name (`CUDA_ERROR_…`), from the driver where it names it.
    pub name: String,
}

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
