//! Test workload (`tests/e2e/tests/drain.rs`): submissions and synchronising calls in an
//! order the test dictates, with the CUDA driver reached as the runtime reaches it
//! (`dlopen("libcuda.so.1")`, `cuGetProcAddress_v2`, the rest through the getter), so that
//! `libcoloc_cuda.so`, when preloaded, sees every call. In tests the driver is the fake one
//! (`tests/fake-cuda`), whose kernels run for the nanoseconds in their first parameter.
//!
//! `coloc-syncs [--per-thread]`: with `--per-thread`, every entry point is asked of the
//! getter with `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM` (the `_ptsz`/`_ptds`
//! variants: stream 0 is the calling thread's own). Prints `ready`, then reads one command
//! a line and answers each with one line, `ok <CUresult>`:
//!
//! - `launch S MS`: a kernel of MS milliseconds on stream S (`a`, `b`: two created
//!   streams; `0`: the default stream; `legacy`, `per-thread`: `CU_STREAM_LEGACY`,
//!   `CU_STREAM_PER_THREAD`)
//! - `sync S`, `query S`: `cuStreamSynchronize`, `cuStreamQuery`
//! - `ctx-sync`: `cuCtxSynchronize`
//! - `record S`, `event-sync`, `event-query`: `cuEventRecord` of the one event on S,
//!   `cuEventSynchronize`, `cuEventQuery`
//! - `dtoh`, `htod`: a synchronous copy of 1 MiB (`cuMemcpyDtoH`, `cuMemcpyHtoD`)
//! - `destroy S`: `cuStreamDestroy` (S still names the destroyed handle after it)
//! - `thread S MS DELAY`: another thread, in the same context, launches a kernel of MS
//!   milliseconds on S after DELAY milliseconds (answered at once with `ok 0`; `join`
//!   waits for it and answers with its launch's code)
//! - `burst S N FIRST LAST`: another thread launches on S a kernel of FIRST ms, N empty
//!   ones, then one of LAST ms (answered at once; `join` as above). With N = 1023 the last
//!   launch waits inside the driver, whose queue is full, until the first kernel ends.
//! - `new-ctx`: `cuCtxCreate` on the device, made current; `primary`: the primary context
//!   current again (streams `a` and `b` are the primary context's)
//! - `sleep MS`
//! - `exit`

use coloc_tools::cuda::{getter, Getter};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::io::{BufRead, Write};

type H = *mut c_void;
type Launch =
    unsafe extern "C" fn(H, u32, u32, u32, u32, u32, u32, u32, H, *mut H, *mut H) -> c_int;
type Fn1 = unsafe extern "C" fn(H) -> c_int;
type Fn2 = unsafe extern "C" fn(H, H) -> c_int;
type Copy = unsafe extern "C" fn(usize, usize, usize) -> c_int;

/// Bytes of each synchronous copy.
const COPY_BYTES: usize = 1 << 20;

#[derive(Clone, Copy)]
struct Api {
    ctx_set_current: Fn1,
    launch: Launch,
    stream_sync: Fn1,
    stream_query: Fn1,
    stream_destroy: Fn1,
    ctx_sync: unsafe extern "C" fn() -> c_int,
    ctx_create: unsafe extern "C" fn(*mut H, u32, c_int) -> c_int,
    event_record: Fn2,
    event_sync: Fn1,
    event_query: Fn1,
    dtoh: Copy,
    htod: Copy,
    func: usize,
    ctx: usize,
}

// SAFETY: function pointers and driver handles, usable from any thread.
unsafe impl Send for Api {}

impl Api {
    fn launch(&self, s: H, ms: f64) -> c_int {
        let mut arg = (ms * 1e6) as u64;
        let mut params = [&mut arg as *mut u64 as *mut c_void];
        // SAFETY: our function on a stream of our context; params outlive the call.
        unsafe {
            (self.launch)(
                self.func as H,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                s,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
    }
}

fn get(g: Getter, name: &CStr, flags: u64) -> H {
    let mut p = std::ptr::null_mut();
    // SAFETY: the driver's getter with valid pointers.
    let r = unsafe { g(name.as_ptr(), &mut p, 12040, flags, std::ptr::null_mut()) };
    assert!(r == 0 && !p.is_null(), "cuGetProcAddress({name:?}): {r}");
    p
}

fn say(s: &str) {
    let mut o = std::io::stdout().lock();
    writeln!(o, "{s}").unwrap();
    o.flush().unwrap();
}

fn main() {
    let per_thread = std::env::args().any(|a| a == "--per-thread");
    let flags = if per_thread { 2 } else { 0 };
    // SAFETY: FFI to the driver as the CUDA runtime calls it; every transmute names the
    // entry point's C type (cuda.h); the handle and objects live until exit.
    let (api, streams, event, dev_buf) = unsafe {
        let g = getter();
        macro_rules! f {
            ($name:literal, $t:ty) => {
                std::mem::transmute::<H, $t>(get(g, $name, flags))
            };
        }
        let init = f!(c"cuInit", unsafe extern "C" fn(u32) -> c_int);
        assert_eq!(init(0), 0, "cuInit");
        let dev_get = f!(
            c"cuDeviceGet",
            unsafe extern "C" fn(*mut c_int, c_int) -> c_int
        );
        let mut dev = 0;
        assert_eq!(dev_get(&mut dev, 0), 0, "cuDeviceGet");
        let retain = f!(
            c"cuDevicePrimaryCtxRetain",
            unsafe extern "C" fn(*mut H, c_int) -> c_int
        );
        let mut ctx = std::ptr::null_mut();
        assert_eq!(retain(&mut ctx, dev), 0, "cuDevicePrimaryCtxRetain");
        let set = f!(c"cuCtxSetCurrent", Fn1);
        assert_eq!(set(ctx), 0, "cuCtxSetCurrent");
        let load = f!(
            c"cuModuleLoadData",
            unsafe extern "C" fn(*mut H, *const c_void) -> c_int
        );
        let mut module = std::ptr::null_mut();
        assert_eq!(load(&mut module, c"syncs".as_ptr().cast()), 0);
        let getf = f!(
            c"cuModuleGetFunction",
            unsafe extern "C" fn(*mut H, H, *const c_char) -> c_int
        );
        let mut func = std::ptr::null_mut();
        assert_eq!(getf(&mut func, module, c"work".as_ptr()), 0);
        let create = f!(
            c"cuStreamCreate",
            unsafe extern "C" fn(*mut H, u32) -> c_int
        );
        let (mut a, mut b) = (std::ptr::null_mut(), std::ptr::null_mut());
        assert_eq!(create(&mut a, 1), 0, "cuStreamCreate");
        assert_eq!(create(&mut b, 1), 0, "cuStreamCreate");
        let ev_create = f!(c"cuEventCreate", unsafe extern "C" fn(*mut H, u32) -> c_int);
        let mut ev = std::ptr::null_mut();
        assert_eq!(ev_create(&mut ev, 0), 0, "cuEventCreate");
        let alloc = f!(
            c"cuMemAlloc",
            unsafe extern "C" fn(*mut u64, usize) -> c_int
        );
        let mut dptr = 0u64;
        assert_eq!(alloc(&mut dptr, COPY_BYTES), 0, "cuMemAlloc");
        let api = Api {
            ctx_set_current: set,
            launch: f!(c"cuLaunchKernel", Launch),
            stream_sync: f!(c"cuStreamSynchronize", Fn1),
            stream_query: f!(c"cuStreamQuery", Fn1),
            stream_destroy: f!(c"cuStreamDestroy", Fn1),
            ctx_sync: f!(c"cuCtxSynchronize", unsafe extern "C" fn() -> c_int),
            ctx_create: f!(
                c"cuCtxCreate",
                unsafe extern "C" fn(*mut H, u32, c_int) -> c_int
            ),
            event_record: f!(c"cuEventRecord", Fn2),
            event_sync: f!(c"cuEventSynchronize", Fn1),
            event_query: f!(c"cuEventQuery", Fn1),
            dtoh: f!(c"cuMemcpyDtoH", Copy),
            htod: f!(c"cuMemcpyHtoD", Copy),
            func: func as usize,
            ctx: ctx as usize,
        };
        (api, [a as usize, b as usize], ev as usize, dptr as usize)
    };
    let host = vec![0u8; COPY_BYTES];
    let stream = |s: &str, streams: &[usize; 2]| -> H {
        match s {
            "a" => streams[0] as H,
            "b" => streams[1] as H,
            "0" => std::ptr::null_mut(),
            "legacy" => 1usize as H,
            "per-thread" => 2usize as H,
            other => panic!("no stream {other:?}"),
        }
    };
    let mut other: Option<std::thread::JoinHandle<c_int>> = None;
    say("ready");
    for line in std::io::stdin().lock().lines() {
        let line = line.expect("stdin");
        let w: Vec<&str> = line.split_whitespace().collect();
        let ms = |i: usize| w[i].parse::<f64>().expect("milliseconds");
        // SAFETY (every call below): the driver's entry points with handles of this
        // process's context and valid pointers.
        let r = unsafe {
            match w.as_slice() {
                ["launch", s, _] => api.launch(stream(s, &streams), ms(2)),
                ["sync", s] => (api.stream_sync)(stream(s, &streams)),
                ["query", s] => (api.stream_query)(stream(s, &streams)),
                ["ctx-sync"] => (api.ctx_sync)(),
                ["record", s] => (api.event_record)(event as H, stream(s, &streams)),
                ["event-sync"] => (api.event_sync)(event as H),
                ["event-query"] => (api.event_query)(event as H),
                ["dtoh"] => (api.dtoh)(host.as_ptr() as usize, dev_buf, COPY_BYTES),
                ["htod"] => (api.htod)(dev_buf, host.as_ptr() as usize, COPY_BYTES),
                // The name keeps the destroyed handle: a later call on it fails.
                ["destroy", s] => (api.stream_destroy)(stream(s, &streams)),
                ["thread", s, _, _] => {
                    let (h, kernel, delay) = (stream(s, &streams) as usize, ms(2), ms(3));
                    other = Some(std::thread::spawn(move || {
                        assert_eq!((api.ctx_set_current)(api.ctx as H), 0);
                        std::thread::sleep(std::time::Duration::from_secs_f64(delay / 1e3));
                        api.launch(h as H, kernel)
                    }));
                    0
                }
                ["burst", s, n, _, _] => {
                    let h = stream(s, &streams) as usize;
                    let (n, first, last) = (n.parse::<u32>().expect("count"), ms(3), ms(4));
                    other = Some(std::thread::spawn(move || {
                        assert_eq!((api.ctx_set_current)(api.ctx as H), 0);
                        let mut r = api.launch(h as H, first);
                        for _ in 0..n {
                            r = r.max(api.launch(h as H, 0.0));
                        }
                        r.max(api.launch(h as H, last))
                    }));
                    0
                }
                ["join"] => other.take().map_or(-1, |t| t.join().unwrap()),
                ["new-ctx"] => {
                    let mut c = std::ptr::null_mut();
                    (api.ctx_create)(&mut c, 0, 0)
                }
                ["primary"] => (api.ctx_set_current)(api.ctx as H),
                ["sleep", _] => {
                    std::thread::sleep(std::time::Duration::from_secs_f64(ms(1) / 1e3));
                    0
                }
                ["exit"] => break,
                _ => panic!("unknown command {line:?}"),
            }
        };
        say(&format!("ok {r}"));
    }
}
