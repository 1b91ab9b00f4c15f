//! Shared by the fake driver's tests: load `libfake_cuda.so` by `dlopen` (as a program
//! loads `libcuda.so.1`; the rlib is never linked) and run a simulated GPU in-process.
//!
//! The library keeps one process-wide state, read at `cuInit` (`COLOC_SIM_STATE`,
//! `CUDA_VISIBLE_DEVICES`), so each test file is its own process with its own setup.
#![allow(dead_code, non_snake_case)]

use coloc_sim::{now_ns, Daemon, SimGpu};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

pub type H = *mut c_void;
pub const OK: c_int = 0;

/// `target/<profile>` of this test executable (`target/<profile>/deps/<test>`).
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap();
    if dir.ends_with("deps") {
        dir.parent().unwrap().to_path_buf()
    } else {
        dir.to_path_buf()
    }
}

/// The loaded library (through `coloc_sim::fake_libcuda_dir`'s `libcuda.so.1`).
pub struct Lib(pub H);
// SAFETY: a dlopen handle is usable from any thread.
unsafe impl Send for Lib {}
unsafe impl Sync for Lib {}

pub fn lib() -> &'static Lib {
    static L: OnceLock<Lib> = OnceLock::new();
    L.get_or_init(|| {
        let dir = coloc_sim::fake_libcuda_dir(&profile_dir()).unwrap();
        let p = std::ffi::CString::new(dir.join("libcuda.so.1").to_str().unwrap()).unwrap();
        // SAFETY: plain dlopen of the library under test; never closed.
        let h = unsafe { libc::dlopen(p.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(!h.is_null(), "dlopen {p:?} failed");
        Lib(h)
    })
}

/// `dlsym` on the library's handle (null if absent).
pub fn sym(name: &CStr) -> H {
    // SAFETY: dlsym on a live handle.
    unsafe { libc::dlsym(lib().0, name.as_ptr()) }
}

/// A typed exported function.
///
/// # Safety
/// `T` must be the C signature of `name`.
pub unsafe fn f<T: Copy>(name: &CStr) -> T {
    let p = sym(name);
    assert!(!p.is_null(), "{name:?} not exported");
    assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<H>());
    // SAFETY: same size; the caller vouches for the signature.
    unsafe { std::mem::transmute_copy(&p) }
}

/// The state file [`sim`] made: it lives as long as the process (the library reads it
/// from any test, at any time), so it is removed when the process exits.
static STATE_FILE: OnceLock<PathBuf> = OnceLock::new();

/// Removes [`STATE_FILE`]: an `atexit` handler, run when the test harness exits (through
/// `exit`, tests that failed included: it catches their panics).
extern "C" fn remove_state_file() {
    if let Some(p) = STATE_FILE.get() {
        let _ = std::fs::remove_file(p);
    }
}

/// Creates a state file with `gpus` simulated GPUs, points `COLOC_SIM_STATE` at it and runs
/// the model in a thread (every 100 µs, like `coloc-sim gpu`). Once per process; the file
/// is removed when the process exits.
pub fn sim(gpus: u32) -> &'static SimGpu {
    static SIM: OnceLock<&'static SimGpu> = OnceLock::new();
    SIM.get_or_init(|| {
        let path = std::env::temp_dir().join(format!(
            "fake-cuda-test-{}-{}",
            std::process::id(),
            std::thread::current()
                .name()
                .unwrap_or("t")
                .replace("::", "-")
        ));
        STATE_FILE.get_or_init(|| path.clone());
        // SAFETY: registers a plain function that only unlinks a file.
        assert_eq!(unsafe { libc::atexit(remove_state_file) }, 0);
        let sim: &'static SimGpu =
            Box::leak(Box::new(SimGpu::create(&path, gpus, 1_000_000).unwrap()));
        // Set before the library's cuInit; this process has no other reader.
        std::env::set_var(coloc_sim::STATE_ENV, &path);
        std::thread::spawn(move || {
            let mut d = Daemon::new(sim, now_ns());
            loop {
                d.advance(now_ns());
                std::thread::sleep(Duration::from_micros(100));
            }
        });
        sim
    })
}

pub type Fn0 = unsafe extern "C" fn() -> c_int;
pub type FnU = unsafe extern "C" fn(c_uint) -> c_int;
pub type FnH = unsafe extern "C" fn(H) -> c_int;
pub type FnHH = unsafe extern "C" fn(H, H) -> c_int;
pub type FnPI = unsafe extern "C" fn(*mut c_int) -> c_int;
pub type FnPH = unsafe extern "C" fn(*mut H) -> c_int;
pub type FnPHU = unsafe extern "C" fn(*mut H, c_uint) -> c_int;
pub type FnPHI = unsafe extern "C" fn(*mut H, c_int) -> c_int;
pub type FnPII = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
pub type FnUuid = unsafe extern "C" fn(*mut [u8; 16], c_int) -> c_int;
pub type FnGetProc = unsafe extern "C" fn(*const c_char, *mut H, c_int, u64, *mut c_int) -> c_int;
pub type FnGetProcV1 = unsafe extern "C" fn(*const c_char, *mut H, c_int, u64) -> c_int;
pub type FnLaunch = unsafe extern "C" fn(
    H,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    H,
    *mut *mut c_void,
    *mut *mut c_void,
) -> c_int;
pub type FnMemAlloc = unsafe extern "C" fn(*mut u64, usize) -> c_int;
pub type FnHtoD = unsafe extern "C" fn(u64, *const c_void, usize, H) -> c_int;
pub type FnMemset8 = unsafe extern "C" fn(u64, u8, usize, H) -> c_int;
pub type FnHostFunc =
    unsafe extern "C" fn(H, Option<unsafe extern "C" fn(*mut c_void)>, *mut c_void) -> c_int;
pub type FnGraph = unsafe extern "C" fn(u64) -> H;
pub type FnModGetFn = unsafe extern "C" fn(*mut H, H, *const c_char) -> c_int;

/// The functions the tests call, by their exported names.
pub struct Cu {
    pub init: FnU,
    pub device_get: FnPII,
    pub device_count: FnPI,
    pub uuid: FnUuid,
    pub uuid_v2: FnUuid,
    pub ctx_create: unsafe extern "C" fn(*mut H, c_uint, c_int) -> c_int,
    pub ctx_destroy: FnH,
    pub ctx_sync: Fn0,
    pub primary_retain: FnPHI,
    pub primary_release: unsafe extern "C" fn(c_int) -> c_int,
    pub set_current: FnH,
    pub stream_create: FnPHU,
    pub stream_sync: FnH,
    pub stream_query: FnH,
    pub event_create: FnPHU,
    pub event_record: FnHH,
    pub event_query: FnH,
    pub event_sync: FnH,
    pub module_load: unsafe extern "C" fn(*mut H, *const c_void) -> c_int,
    pub module_get_function: FnModGetFn,
    pub launch: FnLaunch,
    pub mem_alloc: FnMemAlloc,
    pub htod: FnHtoD,
    pub memset8: FnMemset8,
    pub host_func: FnHostFunc,
    pub graph_launch: FnHH,
    pub fake_graph: FnGraph,
    pub get_proc: FnGetProc,
    pub get_proc_v1: FnGetProcV1,
}

pub fn cu() -> &'static Cu {
    static C: OnceLock<Cu> = OnceLock::new();
    // SAFETY: each type is the cuda.h signature of the name.
    C.get_or_init(|| unsafe {
        Cu {
            init: f(c"cuInit"),
            device_get: f(c"cuDeviceGet"),
            device_count: f(c"cuDeviceGetCount"),
            uuid: f(c"cuDeviceGetUuid"),
            uuid_v2: f(c"cuDeviceGetUuid_v2"),
            ctx_create: f(c"cuCtxCreate_v2"),
            ctx_destroy: f(c"cuCtxDestroy_v2"),
            ctx_sync: f(c"cuCtxSynchronize"),
            primary_retain: f(c"cuDevicePrimaryCtxRetain"),
            primary_release: f(c"cuDevicePrimaryCtxRelease_v2"),
            set_current: f(c"cuCtxSetCurrent"),
            stream_create: f(c"cuStreamCreate"),
            stream_sync: f(c"cuStreamSynchronize"),
            stream_query: f(c"cuStreamQuery"),
            event_create: f(c"cuEventCreate"),
            event_record: f(c"cuEventRecord"),
            event_query: f(c"cuEventQuery"),
            event_sync: f(c"cuEventSynchronize"),
            module_load: f(c"cuModuleLoadData"),
            module_get_function: f(c"cuModuleGetFunction"),
            launch: f(c"cuLaunchKernel"),
            mem_alloc: f(c"cuMemAlloc_v2"),
            htod: f(c"cuMemcpyHtoDAsync_v2"),
            memset8: f(c"cuMemsetD8Async"),
            host_func: f(c"cuLaunchHostFunc"),
            graph_launch: f(c"cuGraphLaunch"),
            fake_graph: f(c"coloc_fake_graph"),
            get_proc: f(c"cuGetProcAddress_v2"),
            get_proc_v1: f(c"cuGetProcAddress"),
        }
    })
}

/// A context on `ordinal` (created, current on this thread), a kernel and a stream.
pub struct Setup {
    pub ctx: H,
    pub func: H,
    pub stream: H,
}

pub fn setup(ordinal: c_int) -> Setup {
    let c = cu();
    // SAFETY: library calls with valid out-pointers.
    unsafe {
        assert_eq!((c.init)(0), OK);
        let mut dev = 0;
        assert_eq!((c.device_get)(&mut dev, ordinal), OK);
        let mut ctx = std::ptr::null_mut();
        assert_eq!((c.ctx_create)(&mut ctx, 0, dev), OK);
        let mut m = std::ptr::null_mut();
        assert_eq!(
            (c.module_load)(&mut m, c"image".as_ptr() as *const c_void),
            OK
        );
        let mut func = std::ptr::null_mut();
        assert_eq!((c.module_get_function)(&mut func, m, c"busy".as_ptr()), OK);
        let mut stream = std::ptr::null_mut();
        assert_eq!((c.stream_create)(&mut stream, 0), OK);
        Setup { ctx, func, stream }
    }
}

impl Setup {
    /// Launches a kernel busy for `ns` on the stream (cuLaunchKernel's result).
    pub fn launch(&self, ns: u64) -> c_int {
        let mut arg = ns;
        let mut params = [&mut arg as *mut u64 as *mut c_void];
        // SAFETY: valid function, stream and parameter array.
        unsafe {
            (cu().launch)(
                self.func,
                1,
                1,
                1,
                32,
                1,
                1,
                0,
                self.stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
    }
}
