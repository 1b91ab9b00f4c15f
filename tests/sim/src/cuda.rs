//! The `--cuda` path of the workloads: reach the CUDA driver as the CUDA 12 runtime does.
//!
//! `dlopen("libcuda.so.1", RTLD_NOW)`, `dlsym(h, "cuGetProcAddress_v2")` (falling back to
//! `cuGetProcAddress`), and every other entry point through that getter by base name
//! (`cudaVersion` 12040; flags 0, or 2 = per-thread default stream with
//! `--per-thread-stream`). Nothing is linked directly, so an `LD_PRELOAD` shim that
//! interposes `dlsym` and the getter sees exactly what it sees in front of the runtime.
//! In tests `libcuda.so.1` is the fake driver (`tests/fake-cuda`, on `LD_LIBRARY_PATH`
//! via `coloc_sim::fake_libcuda_dir`), whose kernels run for the nanoseconds in their
//! first parameter.

use anyhow::{bail, Context, Result};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

type CUresult = c_int;
type Handle = *mut c_void;

/// The CUDA version the workloads ask the getter for (as a CUDA 12.4 runtime does).
pub const CUDA_VERSION: c_int = 12040;
const CUDA_ERROR_NOT_READY: CUresult = 600;

type GetProcV2 =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CUresult;
type Getter = Box<dyn Fn(&CStr) -> Result<*mut c_void>>;

/// A function pointer from a `void*` the driver returned.
///
/// # Safety
/// `p` must be a function whose C signature is `T`.
unsafe fn fn_ptr<T: Copy>(p: *mut c_void) -> T {
    assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: same size; the caller vouches for the signature.
    unsafe { std::mem::transmute_copy(&p) }
}

type GetProcV1 = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> CUresult;

/// Driver entry points, all obtained through `cuGetProcAddress[_v2]`.
#[derive(Debug)]
struct Api {
    init: unsafe extern "C" fn(c_uint) -> CUresult,
    device_get: unsafe extern "C" fn(*mut c_int, c_int) -> CUresult,
    primary_retain: unsafe extern "C" fn(*mut Handle, c_int) -> CUresult,
    primary_release: unsafe extern "C" fn(c_int) -> CUresult,
    ctx_set_current: unsafe extern "C" fn(Handle) -> CUresult,
    module_load_data: unsafe extern "C" fn(*mut Handle, *const c_void) -> CUresult,
    module_get_function: unsafe extern "C" fn(*mut Handle, Handle, *const c_char) -> CUresult,
    stream_create: unsafe extern "C" fn(*mut Handle, c_uint) -> CUresult,
    stream_destroy: unsafe extern "C" fn(Handle) -> CUresult,
    stream_sync: unsafe extern "C" fn(Handle) -> CUresult,
    #[allow(clippy::type_complexity)]
    launch_kernel: unsafe extern "C" fn(
        Handle,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        Handle,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> CUresult,
    mem_alloc: unsafe extern "C" fn(*mut u64, usize) -> CUresult,
    event_create: unsafe extern "C" fn(*mut Handle, c_uint) -> CUresult,
    event_record: unsafe extern "C" fn(Handle, Handle) -> CUresult,
    event_query: unsafe extern "C" fn(Handle) -> CUresult,
    event_sync: unsafe extern "C" fn(Handle) -> CUresult,
    event_destroy: unsafe extern "C" fn(Handle) -> CUresult,
    error_name: unsafe extern "C" fn(CUresult, *mut *const c_char) -> CUresult,
}

/// One GPU through the driver API: the device's primary context (current on the
/// calling thread), a module with the kernel, and a stream.
#[derive(Debug)]
pub struct CudaGpu {
    api: Api,
    dev: c_int,
    /// The device's primary context.
    ctx: Handle,
    func: Handle,
    stream: Handle,
    /// Where work goes: `stream`, or the default stream (null) with `--default-stream`.
    target: Handle,
    /// The fake driver's `coloc_fake_stats`, when the driver has it.
    stats: Option<unsafe extern "C" fn(*mut FakeStats) -> CUresult>,
}

/// The fake driver's counters (`coloc_fake_stats` in `tests/fake-cuda`).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct FakeStats {
    /// Submissions the driver accepted.
    pub submissions: u64,
    /// Most submissions outstanding on one stream at once.
    pub max_outstanding_stream: u64,
    /// Most submissions outstanding on the GPU at once.
    pub max_outstanding_gpu: u64,
    /// Submissions that found their stream with nothing outstanding.
    pub idle_stream_submissions: u64,
    /// Calls of the driver's entry points in this process (the application's and a
    /// shim's).
    pub driver_calls: u64,
}

// SAFETY: the handles are the driver's, which is thread-safe; the struct is only read
// after `open`.
unsafe impl Sync for CudaGpu {}

/// A recorded event.
#[derive(Debug)]
pub struct Event(Handle);

fn dl_error() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated message.
    unsafe {
        let e = libc::dlerror();
        if e.is_null() {
            "unknown dlopen error".into()
        } else {
            CStr::from_ptr(e).to_string_lossy().into_owned()
        }
    }
}

impl CudaGpu {
    /// Loads the driver, initialises it and sets up device `ordinal` (as numbered by
    /// the driver, i.e. after `CUDA_VISIBLE_DEVICES`), holding `mem_bytes` of device
    /// memory (what NVML then lists for the process, as on the non-CUDA path).
    ///
    /// With `default_stream`, work goes to stream 0 (the legacy default stream, or the
    /// thread's own with `per_thread_stream`) instead of a created stream.
    pub fn open(
        ordinal: u32,
        per_thread_stream: bool,
        default_stream: bool,
        mem_bytes: usize,
    ) -> Result<CudaGpu> {
        let mut stats = None;
        // SAFETY: plain dlopen/dlsym of the driver library; the handle is never closed
        // (as the runtime never closes it), so the function pointers stay valid.
        let getter: Getter = unsafe {
            let h = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW);
            if h.is_null() {
                bail!("dlopen(libcuda.so.1): {}", dl_error());
            }
            let st = libc::dlsym(h, c"coloc_fake_stats".as_ptr());
            if !st.is_null() {
                stats = Some(fn_ptr::<unsafe extern "C" fn(*mut FakeStats) -> CUresult>(
                    st,
                ));
            }
            let flags = if per_thread_stream { 2 } else { 0 };
            let v2 = libc::dlsym(h, c"cuGetProcAddress_v2".as_ptr());
            if !v2.is_null() {
                let f: GetProcV2 = std::mem::transmute::<*mut c_void, GetProcV2>(v2);
                Box::new(move |name: &CStr| {
                    let mut p = std::ptr::null_mut();
                    let mut q: c_int = 0;
                    let r = f(name.as_ptr(), &mut p, CUDA_VERSION, flags, &mut q);
                    if r != 0 || p.is_null() {
                        bail!("cuGetProcAddress_v2({name:?}): error {r}, query result {q}");
                    }
                    Ok(p)
                })
            } else {
                let v1 = libc::dlsym(h, c"cuGetProcAddress".as_ptr());
                if v1.is_null() {
                    bail!("libcuda.so.1 exports neither cuGetProcAddress_v2 nor cuGetProcAddress");
                }
                let f: GetProcV1 = std::mem::transmute::<*mut c_void, GetProcV1>(v1);
                Box::new(move |name: &CStr| {
                    let mut p = std::ptr::null_mut();
                    let r = f(name.as_ptr(), &mut p, CUDA_VERSION, flags);
                    if r != 0 || p.is_null() {
                        bail!("cuGetProcAddress({name:?}): error {r}");
                    }
                    Ok(p)
                })
            }
        };
        macro_rules! get {
            ($name:literal) => {{
                let p = getter($name)?;
                // SAFETY: the driver's entry point for this base name, whose C signature
                // the field's type spells out (cuda.h).
                unsafe { fn_ptr(p) }
            }};
        }
        let api = Api {
            init: get!(c"cuInit"),
            device_get: get!(c"cuDeviceGet"),
            primary_retain: get!(c"cuDevicePrimaryCtxRetain"),
            primary_release: get!(c"cuDevicePrimaryCtxRelease"),
            ctx_set_current: get!(c"cuCtxSetCurrent"),
            module_load_data: get!(c"cuModuleLoadData"),
            module_get_function: get!(c"cuModuleGetFunction"),
            stream_create: get!(c"cuStreamCreate"),
            stream_destroy: get!(c"cuStreamDestroy"),
            stream_sync: get!(c"cuStreamSynchronize"),
            launch_kernel: get!(c"cuLaunchKernel"),
            mem_alloc: get!(c"cuMemAlloc"),
            event_create: get!(c"cuEventCreate"),
            event_record: get!(c"cuEventRecord"),
            event_query: get!(c"cuEventQuery"),
            event_sync: get!(c"cuEventSynchronize"),
            event_destroy: get!(c"cuEventDestroy"),
            error_name: get!(c"cuGetErrorName"),
        };
        let mut g = CudaGpu {
            api,
            dev: -1,
            ctx: std::ptr::null_mut(),
            func: std::ptr::null_mut(),
            stream: std::ptr::null_mut(),
            target: std::ptr::null_mut(),
            stats,
        };
        // SAFETY (all calls below): driver entry points with valid out-pointers.
        unsafe {
            g.check("cuInit", (g.api.init)(0))?;
            let mut dev = 0;
            let ord = c_int::try_from(ordinal).context("device ordinal")?;
            g.check("cuDeviceGet", (g.api.device_get)(&mut dev, ord))?;
            let mut ctx = std::ptr::null_mut();
            g.check(
                "cuDevicePrimaryCtxRetain",
                (g.api.primary_retain)(&mut ctx, dev),
            )?;
            g.dev = dev;
            g.ctx = ctx;
            g.check("cuCtxSetCurrent", (g.api.ctx_set_current)(ctx))?;
            // The fake driver accepts any image; a real one would want a cubin here.
            static IMAGE: [u8; 16] = *b"coloc-sim kernel";
            let mut module = std::ptr::null_mut();
            g.check(
                "cuModuleLoadData",
                (g.api.module_load_data)(&mut module, IMAGE.as_ptr() as *const c_void),
            )?;
            let mut dptr = 0u64;
            g.check("cuMemAlloc", (g.api.mem_alloc)(&mut dptr, mem_bytes))?;
            let mut func = std::ptr::null_mut();
            let r = (g.api.module_get_function)(&mut func, module, c"coloc_busy".as_ptr());
            g.check("cuModuleGetFunction", r)?;
            g.func = func;
            // CU_STREAM_NON_BLOCKING, as PyTorch's side streams.
            let mut stream = std::ptr::null_mut();
            g.check("cuStreamCreate", (g.api.stream_create)(&mut stream, 1))?;
            g.stream = stream;
            g.target = if default_stream {
                std::ptr::null_mut()
            } else {
                stream
            };
        }
        Ok(g)
    }

    /// Makes the device's primary context current on the calling thread (a thread other
    /// than the one that opened it).
    pub fn bind(&self) -> Result<()> {
        // SAFETY: our retained primary context.
        self.check("cuCtxSetCurrent", unsafe {
            (self.api.ctx_set_current)(self.ctx)
        })
    }

    /// Allocates `bytes` of device memory, trying again every 5 ms while the driver
    /// answers `CUDA_ERROR_OUT_OF_MEMORY`, for at most `wait`: how long it waited (an
    /// online service that starts while offline work holds the GPU's memory).
    pub fn alloc_waiting(
        &self,
        bytes: usize,
        wait: std::time::Duration,
    ) -> Result<std::time::Duration> {
        let t0 = std::time::Instant::now();
        loop {
            let mut dptr = 0u64;
            // SAFETY: the driver's entry point with a valid out-pointer.
            let r = unsafe { (self.api.mem_alloc)(&mut dptr, bytes) };
            if r == 0 {
                return Ok(t0.elapsed());
            }
            if r != 2 || t0.elapsed() >= wait {
                return self.check("cuMemAlloc", r).map(|_| t0.elapsed());
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// The fake driver's counters for this process (`None` with another driver).
    pub fn stats(&self) -> Option<FakeStats> {
        let f = self.stats?;
        let mut s = FakeStats::default();
        // SAFETY: the fake driver's export with a valid out-pointer.
        (unsafe { f(&mut s) } == 0).then_some(s)
    }

    fn check(&self, what: &str, r: CUresult) -> Result<()> {
        if r == 0 {
            return Ok(());
        }
        let mut name: *const c_char = std::ptr::null();
        // SAFETY: driver entry point; the name is a static NUL-terminated string.
        let name = unsafe {
            if (self.api.error_name)(r, &mut name) == 0 && !name.is_null() {
                CStr::from_ptr(name).to_string_lossy().into_owned()
            } else {
                "unknown error".into()
            }
        };
        bail!("{what}: {name} ({r})")
    }

    /// Queues a kernel busy for `ns` on the stream (or the default stream) (the fake driver's convention: the
    /// duration is the kernel's first parameter).
    pub fn launch(&self, ns: u64) -> Result<()> {
        let mut arg = ns;
        let mut params = [&mut arg as *mut u64 as *mut c_void];
        // SAFETY: a function and stream of this context; params outlive the call.
        let r = unsafe {
            (self.api.launch_kernel)(
                self.func,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                self.target,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        self.check("cuLaunchKernel", r)
    }

    /// Waits for everything queued on the stream.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: our stream.
        self.check("cuStreamSynchronize", unsafe {
            (self.api.stream_sync)(self.target)
        })
    }

    /// Records an event after the work queued so far.
    pub fn record(&self) -> Result<Event> {
        let mut e = std::ptr::null_mut();
        // SAFETY: valid out-pointer; our stream.
        unsafe {
            self.check("cuEventCreate", (self.api.event_create)(&mut e, 0))?;
            self.check("cuEventRecord", (self.api.event_record)(e, self.target))?;
        }
        Ok(Event(e))
    }

    /// Whether the work before the event has completed.
    pub fn done(&self, e: &Event) -> Result<bool> {
        // SAFETY: an event of ours.
        match unsafe { (self.api.event_query)(e.0) } {
            CUDA_ERROR_NOT_READY => Ok(false),
            r => self.check("cuEventQuery", r).map(|_| true),
        }
    }

    /// Waits for the event, then frees it.
    pub fn wait(&self, e: Event) -> Result<()> {
        // SAFETY: an event of ours, destroyed once.
        unsafe {
            self.check("cuEventSynchronize", (self.api.event_sync)(e.0))?;
            self.check("cuEventDestroy", (self.api.event_destroy)(e.0))
        }
    }
}

impl Drop for CudaGpu {
    fn drop(&mut self) {
        // SAFETY: our stream and our retain of the primary context (which releases the
        // simulated GPU slot with the last context).
        unsafe {
            if !self.stream.is_null() {
                (self.api.stream_destroy)(self.stream);
            }
            if self.dev >= 0 {
                (self.api.primary_release)(self.dev);
            }
        }
    }
}
