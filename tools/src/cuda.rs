//! A minimal CUDA driver client, found as the CUDA runtime finds it (`dlopen("libcuda.so.1")`,
//! `dlsym(h, "cuGetProcAddress_v2")`, the rest through the getter), for benchmarks that
//! must submit through the driver API (so that `libcoloc_cuda.so` sees the launches). In
//! tests the driver is the simulated one (`coloc_sim::fake_libcuda_dir` on
//! `LD_LIBRARY_PATH`), whose kernels run for the nanoseconds in their first parameter.

use std::ffi::{c_char, c_int, c_void, CStr};

/// `cuGetProcAddress_v2`.
pub type Getter =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> c_int;
type Launch = unsafe extern "C" fn(
    *mut c_void,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    *mut c_void,
    *mut *mut c_void,
    *mut *mut c_void,
) -> c_int;
type Sync = unsafe extern "C" fn() -> c_int;
type StreamSync = unsafe extern "C" fn(*mut c_void) -> c_int;

/// A context on one device with a loaded kernel.
#[derive(Debug)]
pub struct Driver {
    launch: Launch,
    sync: Sync,
    stream_sync: StreamSync,
    func: *mut c_void,
    stream: *mut c_void,
}

/// The driver's getter, found as the CUDA runtime finds it: `dlopen("libcuda.so.1")`
/// (never closed), then `dlsym(h, "cuGetProcAddress_v2")`. Panics if either fails.
pub fn getter() -> Getter {
    // SAFETY: plain dlopen/dlsym; the symbol is the driver's cuGetProcAddress_v2,
    // whose C type `Getter` is.
    unsafe {
        let h = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW);
        assert!(!h.is_null(), "dlopen libcuda.so.1 (LD_LIBRARY_PATH)");
        let g = libc::dlsym(h, c"cuGetProcAddress_v2".as_ptr());
        assert!(!g.is_null(), "no cuGetProcAddress_v2");
        std::mem::transmute::<*mut c_void, Getter>(g)
    }
}

/// Entry point `name` as the getter gives it for CUDA version `ver`; panics if none.
pub fn get_at(getter: Getter, name: &CStr, ver: c_int) -> *mut c_void {
    let mut p = std::ptr::null_mut();
    // SAFETY: the driver's getter with valid pointers.
    let r = unsafe { getter(name.as_ptr(), &mut p, ver, 0, std::ptr::null_mut()) };
    assert!(
        r == 0 && !p.is_null(),
        "cuGetProcAddress({name:?}, {ver}): {r}"
    );
    p
}

/// Entry point `name` at CUDA 12.4.
pub fn get(getter: Getter, name: &CStr) -> *mut c_void {
    get_at(getter, name, 12040)
}

impl Driver {
    /// Loads the driver and sets up device `ordinal`. Panics with the driver's answer
    /// when something fails (benchmark support, not product code).
    pub fn open(ordinal: c_int) -> Driver {
        // SAFETY: FFI to the driver exactly as the CUDA runtime calls it; the handle
        // and every object live until the process exits; every transmute names the
        // entry point's C type.
        unsafe {
            let getter = getter();
            let init = std::mem::transmute::<*mut c_void, unsafe extern "C" fn(u32) -> c_int>(get(
                getter, c"cuInit",
            ));
            assert_eq!(init(0), 0, "cuInit");
            let dev_get = std::mem::transmute::<
                *mut c_void,
                unsafe extern "C" fn(*mut c_int, c_int) -> c_int,
            >(get(getter, c"cuDeviceGet"));
            let mut dev = 0;
            assert_eq!(dev_get(&mut dev, ordinal), 0, "cuDeviceGet");
            let ctx_create = std::mem::transmute::<
                *mut c_void,
                unsafe extern "C" fn(*mut *mut c_void, u32, c_int) -> c_int,
            >(get(getter, c"cuCtxCreate"));
            let mut ctx = std::ptr::null_mut();
            assert_eq!(ctx_create(&mut ctx, 0, dev), 0, "cuCtxCreate");
            let load = std::mem::transmute::<
                *mut c_void,
                unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> c_int,
            >(get(getter, c"cuModuleLoadData"));
            let mut module = std::ptr::null_mut();
            assert_eq!(load(&mut module, c"bench".as_ptr().cast()), 0);
            let getf = std::mem::transmute::<
                *mut c_void,
                unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *const c_char) -> c_int,
            >(get(getter, c"cuModuleGetFunction"));
            let mut func = std::ptr::null_mut();
            assert_eq!(getf(&mut func, module, c"work".as_ptr()), 0);
            let create = std::mem::transmute::<
                *mut c_void,
                unsafe extern "C" fn(*mut *mut c_void, u32) -> c_int,
            >(get(getter, c"cuStreamCreate"));
            let mut stream = std::ptr::null_mut();
            assert_eq!(create(&mut stream, 1), 0, "cuStreamCreate");
            Driver {
                stream,
                launch: std::mem::transmute::<*mut c_void, Launch>(get(getter, c"cuLaunchKernel")),
                sync: std::mem::transmute::<*mut c_void, Sync>(get(getter, c"cuCtxSynchronize")),
                stream_sync: std::mem::transmute::<*mut c_void, StreamSync>(get(
                    getter,
                    c"cuStreamSynchronize",
                )),
                func,
            }
        }
    }

    /// Launches a kernel busy for `ns` on the default stream.
    pub fn launch(&self, ns: u64) {
        self.launch_on(ns, std::ptr::null_mut());
    }

    /// Launches a kernel busy for `ns` on a created stream (non-blocking).
    pub fn launch_on_stream(&self, ns: u64) {
        self.launch_on(ns, self.stream);
    }

    fn launch_on(&self, ns: u64, stream: *mut c_void) {
        let mut arg = ns;
        let mut params = [&mut arg as *mut u64 as *mut c_void];
        // SAFETY: our context's function on a stream of it; params outlive the call.
        let r = unsafe {
            (self.launch)(
                self.func,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        assert_eq!(r, 0, "cuLaunchKernel");
    }

    /// Waits for everything launched.
    pub fn synchronize(&self) {
        // SAFETY: the current context is ours.
        assert_eq!(unsafe { (self.sync)() }, 0, "cuCtxSynchronize");
    }

    /// Waits for everything launched on the created stream.
    pub fn synchronize_stream(&self) {
        // SAFETY: our stream.
        assert_eq!(
            unsafe { (self.stream_sync)(self.stream) },
            0,
            "cuStreamSynchronize"
        );
    }
}
