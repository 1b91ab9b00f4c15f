//! Test workload (`tests/e2e/tests/gate.rs`): CUDA graph stream capture in mode GLOBAL
//! (PyTorch's default for `torch.cuda.graph`) while another thread keeps submitting, with
//! the CUDA driver reached as the runtime reaches it (`dlopen("libcuda.so.1")`,
//! `cuGetProcAddress_v2`, the rest through the getter), so that `libcoloc_cuda.so`, when
//! preloaded, sees every call. In tests the driver is the fake one (`tests/fake-cuda`).
//!
//! Steps, driven by the test through stdin (one line each) and stdout (one line each):
//!
//! 1. A second thread launches 1 ms kernels on stream `normal` until told to stop (the
//!    shim's in-flight bound makes it wait for its own events meanwhile); with
//!    `COLOC_CAPTURE_ALONE=1`, no second thread.
//! 2. The main thread begins a capture of stream `captured` (mode GLOBAL), launches 4 kernels
//!    of 2 ms into it, prints `capturing`, waits for a line.
//! 3. Launches 4 more into the capture, prints `more <ms>` (how long those took), waits for a
//!    line.
//! 4. Stops the second thread, ends the capture, instantiates the graph, prints `captured
//!    {json}`, waits for a line.
//! 5. `cuGraphLaunch` of the graph on `captured`, `cuStreamSynchronize`, prints `launched
//!    {json}`, waits for a line, exits 0.
//!
//! A driver error never stops it early: codes are reported in the JSON for the test to
//! judge (0: success; 900: capture unsupported; 901: capture invalidated).

use coloc_tools::cuda::{get, getter};
use std::ffi::{c_char, c_int, c_void};
use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Instant;

type H = *mut c_void;
type Launch =
    unsafe extern "C" fn(H, u32, u32, u32, u32, u32, u32, u32, H, *mut H, *mut H) -> c_int;

/// Kernels captured in each of steps 2 and 3, and their length (ns).
const CAPTURED: usize = 4;
const CAPTURED_NS: u64 = 2_000_000;
const NORMAL_NS: u64 = 1_000_000;

#[derive(Clone, Copy)]
struct Api {
    ctx_set_current: unsafe extern "C" fn(H) -> c_int,
    launch: Launch,
    begin_capture: unsafe extern "C" fn(H, c_int) -> c_int,
    end_capture: unsafe extern "C" fn(H, *mut H) -> c_int,
    instantiate: unsafe extern "C" fn(*mut H, H, u64) -> c_int,
    graph_launch: unsafe extern "C" fn(H, H) -> c_int,
    stream_sync: unsafe extern "C" fn(H) -> c_int,
    func: usize,
    ctx: usize,
}

// SAFETY: function pointers and driver handles, usable from any thread.
unsafe impl Send for Api {}

impl Api {
    fn launch(&self, s: H, ns: u64) -> c_int {
        let mut arg = ns;
        let mut params = [&mut arg as *mut u64 as *mut c_void];
        // SAFETY: our function on our stream; params outlive the call.
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

fn line() {
    let mut s = String::new();
    std::io::stdin().lock().read_line(&mut s).expect("stdin");
}

fn say(s: &str) {
    let mut o = std::io::stdout().lock();
    writeln!(o, "{s}").unwrap();
    o.flush().unwrap();
}

fn main() {
    // SAFETY: FFI to the driver as the CUDA runtime calls it; every transmute names the
    // entry point's C type (cuda.h); the handle and objects live until exit.
    let (api, captured, normal) = unsafe {
        let getter = getter();
        macro_rules! f {
            ($name:literal, $t:ty) => {
                std::mem::transmute::<H, $t>(get(getter, $name))
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
        let set = f!(c"cuCtxSetCurrent", unsafe extern "C" fn(H) -> c_int);
        assert_eq!(set(ctx), 0, "cuCtxSetCurrent");
        let load = f!(
            c"cuModuleLoadData",
            unsafe extern "C" fn(*mut H, *const c_void) -> c_int
        );
        let mut module = std::ptr::null_mut();
        assert_eq!(load(&mut module, c"capture".as_ptr().cast()), 0);
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
        let api = Api {
            ctx_set_current: set,
            launch: f!(c"cuLaunchKernel", Launch),
            begin_capture: f!(
                c"cuStreamBeginCapture",
                unsafe extern "C" fn(H, c_int) -> c_int
            ),
            end_capture: f!(
                c"cuStreamEndCapture",
                unsafe extern "C" fn(H, *mut H) -> c_int
            ),
            instantiate: f!(
                c"cuGraphInstantiateWithFlags",
                unsafe extern "C" fn(*mut H, H, u64) -> c_int
            ),
            graph_launch: f!(c"cuGraphLaunch", unsafe extern "C" fn(H, H) -> c_int),
            stream_sync: f!(c"cuStreamSynchronize", unsafe extern "C" fn(H) -> c_int),
            func: func as usize,
            ctx: ctx as usize,
        };
        (api, a, b as usize)
    };

    // 1. The other thread (none with COLOC_CAPTURE_ALONE=1).
    let alone = std::env::var("COLOC_CAPTURE_ALONE").is_ok_and(|v| v == "1");
    let stop = Arc::new(AtomicBool::new(false));
    let launched = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let other = {
        let (stop, launched, failed) = (stop.clone(), launched.clone(), failed.clone());
        std::thread::spawn(move || {
            // SAFETY: the process's context.
            assert_eq!(unsafe { (api.ctx_set_current)(api.ctx as H) }, 0);
            while !alone && !stop.load(SeqCst) {
                match api.launch(normal as H, NORMAL_NS) {
                    0 => launched.fetch_add(1, SeqCst),
                    _ => failed.fetch_add(1, SeqCst),
                };
            }
        })
    };
    while !alone && launched.load(SeqCst) < 5 {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }

    // 2. Capture (CU_STREAM_CAPTURE_MODE_GLOBAL = 0).
    let at_begin = launched.load(SeqCst);
    // SAFETY: our stream.
    let begin = unsafe { (api.begin_capture)(captured, 0) };
    let mut codes: Vec<c_int> = (0..CAPTURED)
        .map(|_| api.launch(captured, CAPTURED_NS))
        .collect();
    say("capturing");
    line();

    // 3. More, timed (the test closes the gate first: a capture must not wait at it).
    let t = Instant::now();
    codes.extend((0..CAPTURED).map(|_| api.launch(captured, CAPTURED_NS)));
    say(&format!("more {}", t.elapsed().as_secs_f64() * 1e3));
    line();

    // 4. End.
    stop.store(true, SeqCst);
    other.join().unwrap();
    let mut graph = std::ptr::null_mut();
    let mut exec = std::ptr::null_mut();
    // SAFETY: our stream and valid out-pointers.
    let (end, inst) = unsafe {
        let end = (api.end_capture)(captured, &mut graph);
        let inst = if end == 0 {
            (api.instantiate)(&mut exec, graph, 0)
        } else {
            -1
        };
        (end, inst)
    };
    say(&format!(
        "captured {}",
        serde_json::json!({
            "begin": begin,
            "codes": codes,
            "end": end,
            "instantiate": inst,
            "other_launches": launched.load(SeqCst),
            "other_at_begin": at_begin,
            "other_failed": failed.load(SeqCst),
            "graph_ns": CAPTURED as u64 * 2 * CAPTURED_NS,
        })
    ));
    line();

    // 5. Replay.
    // SAFETY: our graph and stream.
    let (launch, sync) = unsafe {
        let l = (api.graph_launch)(exec, captured);
        (l, (api.stream_sync)(captured))
    };
    say(&format!(
        "launched {}",
        serde_json::json!({"launch": launch, "sync": sync})
    ));
    // Until the test has read the simulated GPU (the slot goes with the process).
    line();
}
