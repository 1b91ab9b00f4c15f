//! The fake driver through its C ABI, loaded with `dlopen` as a program loads
//! `libcuda.so.1`, against a simulated GPU run in this process.

mod common;
use common::*;
use std::ffi::{c_int, c_void, CStr};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

const NOT_READY: c_int = 600;
const NOT_FOUND: c_int = 500;
const INVALID_HANDLE: c_int = 400;
const INVALID_CONTEXT: c_int = 201;
const INVALID_VALUE: c_int = 1;

/// Tests share the process's one slot per GPU: one at a time.
fn start() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    let g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    sim(2);
    g
}

fn me() -> u32 {
    std::process::id()
}

/// (submitted, completed) of this process's slot on `gpu`.
fn counters(gpu: u32) -> (u64, u64) {
    let s = sim(2)
        .slot_info(me(), gpu)
        .expect("this process has a slot");
    (s.submitted_ns, s.completed_ns)
}

fn get(name: &CStr, version: c_int, flags: u64) -> (c_int, H, c_int) {
    let mut p = null_mut();
    let mut q = -1;
    // SAFETY: valid name and out-pointers.
    let r = unsafe { (cu().get_proc)(name.as_ptr(), &mut p, version, flags, &mut q) };
    (r, p, q)
}

#[test]
fn get_proc_address_variants_versions_and_unknown_names() {
    let _g = start();
    // Per-thread default stream: the _ptsz export; default and legacy: the plain one.
    let (r0, p0, q0) = get(c"cuLaunchKernel", 12040, 0);
    let (r2, p2, _) = get(c"cuLaunchKernel", 12040, 2);
    let (r1, p1, _) = get(c"cuLaunchKernel", 12040, 1);
    assert_eq!((r0, r1, r2, q0), (OK, OK, OK, 0));
    assert_ne!(p0, p2);
    assert_eq!(p0, sym(c"cuLaunchKernel"));
    assert_eq!(p1, p0);
    assert_eq!(p2, sym(c"cuLaunchKernel_ptsz"));
    assert_eq!(
        get(c"cuMemcpyHtoDAsync", 12040, 2).1,
        sym(c"cuMemcpyHtoDAsync_v2_ptsz")
    );
    assert_eq!(
        get(c"cuMemcpyHtoDAsync", 12040, 0).1,
        sym(c"cuMemcpyHtoDAsync_v2")
    );
    assert_eq!(
        get(c"cuGraphLaunch", 12040, 2).1,
        sym(c"cuGraphLaunch_ptsz")
    );
    // No per-thread variant: the plain one either way; base names pick the _v2 ABI.
    assert_eq!(get(c"cuInit", 12040, 2).1, sym(c"cuInit"));
    assert_eq!(get(c"cuMemAlloc", 12040, 0).1, sym(c"cuMemAlloc_v2"));
    assert_eq!(
        get(c"cuDeviceGetUuid", 12040, 0).1,
        sym(c"cuDeviceGetUuid_v2")
    );
    assert_eq!(get(c"cuDeviceGetUuid", 11000, 0).1, sym(c"cuDeviceGetUuid"));
    // Unknown names, full names, too old a version.
    assert_eq!(
        get(c"cuNoSuchFunction", 12040, 0),
        (NOT_FOUND, null_mut(), 1)
    );
    assert_eq!(get(c"cuMemAlloc_v2", 12040, 0), (NOT_FOUND, null_mut(), 1));
    assert_eq!(
        get(c"cuLaunchKernelEx", 11040, 0),
        (NOT_FOUND, null_mut(), 2)
    );
    assert_eq!(get(c"cuLaunchKernel", 12040, 4).0, INVALID_VALUE);
    // Both getters reach themselves (v2 from 12.0) and each other.
    assert_eq!(
        get(c"cuGetProcAddress", 12040, 0).1,
        sym(c"cuGetProcAddress_v2")
    );
    assert_eq!(
        get(c"cuGetProcAddress", 11080, 0).1,
        sym(c"cuGetProcAddress")
    );
    let mut p = null_mut();
    // SAFETY: valid name and out-pointer.
    let r = unsafe { (cu().get_proc_v1)(c"cuGetProcAddress".as_ptr(), &mut p, 12040, 0) };
    assert_eq!((r, p), (OK, sym(c"cuGetProcAddress_v2")));
    // SAFETY: as above; the query result may be null.
    let r = unsafe { (cu().get_proc)(c"nope".as_ptr(), &mut p, 12040, 0, null_mut()) };
    assert_eq!((r, p), (NOT_FOUND, null_mut()));
    // SAFETY: as above.
    let r = unsafe { (cu().get_proc_v1)(c"nope".as_ptr(), &mut p, 12040, 0) };
    assert_eq!(r, NOT_FOUND);
}

#[test]
fn event_is_not_ready_until_the_kernel_before_it_completes() {
    let _g = start();
    let s = setup(0);
    let c = cu();
    let mut ev = null_mut();
    // SAFETY: valid out-pointer; handles from setup.
    unsafe { assert_eq!((c.event_create)(&mut ev, 0), OK) };
    let t0 = Instant::now();
    assert_eq!(s.launch(50_000_000), OK);
    // SAFETY: handles from setup and cuEventCreate.
    unsafe {
        assert_eq!((c.event_record)(ev, s.stream), OK);
        assert!(
            t0.elapsed() < Duration::from_millis(20),
            "launches do not block"
        );
        assert_eq!((c.event_query)(ev), NOT_READY);
        assert_eq!((c.stream_query)(s.stream), NOT_READY);
        while (c.event_query)(ev) == NOT_READY {
            assert!(
                t0.elapsed() < Duration::from_secs(2),
                "event never completed"
            );
            std::thread::sleep(Duration::from_micros(200));
        }
        let t = t0.elapsed();
        assert!(
            t >= Duration::from_millis(49) && t < Duration::from_millis(120),
            "event completed after {t:?}, kernel is 50 ms"
        );
        assert_eq!((c.event_query)(ev), OK);
        assert_eq!((c.stream_query)(s.stream), OK);
        // cuEventSynchronize waits for what was before the record, not after.
        assert_eq!(s.launch(30_000_000), OK);
        let t1 = Instant::now();
        assert_eq!((c.event_sync)(ev), OK);
        assert!(t1.elapsed() < Duration::from_millis(10));
        assert_eq!((c.event_record)(ev, s.stream), OK);
        assert_eq!((c.event_sync)(ev), OK);
        let t = t1.elapsed();
        assert!(t >= Duration::from_millis(25), "synchronised after {t:?}");
        assert_eq!((c.ctx_destroy)(s.ctx), OK);
    }
    assert!(
        sim(2).slot_info(me(), 0).is_none(),
        "last context gone: slot released"
    );
}

#[test]
fn the_1025th_outstanding_launch_blocks() {
    let _g = start();
    let s = setup(0);
    let (_, done0) = counters(0);
    let t0 = Instant::now();
    assert_eq!(s.launch(300_000_000), OK);
    for _ in 1..1024 {
        assert_eq!(s.launch(1_000), OK);
    }
    let (_, done) = counters(0);
    assert!(
        done < done0 + 300_000_000,
        "1024 launches returned before the first kernel completed ({:?})",
        t0.elapsed()
    );
    assert_eq!(s.launch(1_000), OK);
    let (_, done) = counters(0);
    assert!(
        done >= done0 + 300_000_000,
        "the 1025th launch returned before the oldest completed ({:?})",
        t0.elapsed()
    );
    // SAFETY: handles from setup.
    unsafe {
        assert_eq!((cu().ctx_sync)(), OK);
        assert_eq!((cu().ctx_destroy)(s.ctx), OK);
    }
}

static CALLED: AtomicBool = AtomicBool::new(false);

unsafe extern "C" fn callback(data: *mut c_void) {
    assert_eq!(data as usize, 42);
    CALLED.store(true, Ordering::SeqCst);
}

#[test]
fn graphs_copies_memsets_and_host_functions() {
    let _g = start();
    let s = setup(0);
    let c = cu();
    // SAFETY: handles from setup; buffers outlive the calls (copies are asynchronous in
    // name only: the fake moves no data).
    unsafe {
        let mut d = 0u64;
        assert_eq!((c.mem_alloc)(&mut d, 4 << 20), OK);
        assert_eq!(sim(2).slot_info(me(), 0).unwrap().mem_bytes, 4 << 20);
        let (sub0, _) = counters(0);
        let g = (c.fake_graph)(20_000_000);
        assert!(!g.is_null());
        assert_eq!((c.graph_launch)(g, s.stream), OK);
        let buf = vec![0u8; 1 << 20];
        assert_eq!(
            (c.htod)(d, buf.as_ptr() as *const c_void, 1 << 20, s.stream),
            OK
        );
        assert_eq!((c.memset8)(d + 100, 7, 100, s.stream), OK);
        let (sub1, _) = counters(0);
        assert_eq!(sub1 - sub0, 20_000_000 + (1 << 20) / 10 + 1_000);
        // Outside the allocation.
        assert_eq!(
            (c.memset8)(d + (4 << 20) - 10, 7, 100, s.stream),
            INVALID_VALUE
        );
        assert_eq!(
            (c.htod)(d - 1, buf.as_ptr() as *const c_void, 1, s.stream),
            INVALID_VALUE
        );
        CALLED.store(false, Ordering::SeqCst);
        assert_eq!(
            (c.host_func)(s.stream, Some(callback), 42 as *mut c_void),
            OK
        );
        assert_eq!(counters(0).0, sub1, "a host function takes no GPU time");
        assert!(
            !CALLED.load(Ordering::SeqCst),
            "ran before the graph completed"
        );
        assert_eq!((c.stream_sync)(s.stream), OK);
        assert!(
            CALLED.load(Ordering::SeqCst),
            "stream sync waits for the callback"
        );
        assert_eq!((c.graph_launch)(0x1234 as H, s.stream), INVALID_HANDLE);
        assert_eq!((c.ctx_destroy)(s.ctx), OK);
    }
}

#[test]
fn invalid_handles_and_missing_context() {
    let _g = start();
    let s = setup(0);
    let c = cu();
    let bogus = 0xdead_beef as H;
    // SAFETY: the library must reject the bogus handles without touching them.
    unsafe {
        assert_eq!((c.event_query)(bogus), INVALID_HANDLE);
        assert_eq!((c.stream_sync)(bogus), INVALID_HANDLE);
        assert_eq!((c.event_record)(bogus, s.stream), INVALID_HANDLE);
        assert_eq!((c.ctx_destroy)(bogus), INVALID_CONTEXT);
        let mut arg = 1u64;
        let mut params = [&mut arg as *mut u64 as *mut c_void];
        let r = (c.launch)(
            bogus,
            1,
            1,
            1,
            1,
            1,
            1,
            0,
            s.stream,
            params.as_mut_ptr(),
            null_mut(),
        );
        assert_eq!(r, INVALID_HANDLE);
        let r = (c.launch)(
            s.func,
            0,
            1,
            1,
            1,
            1,
            1,
            0,
            s.stream,
            params.as_mut_ptr(),
            null_mut(),
        );
        assert_eq!(r, INVALID_VALUE, "empty grid");
        let mut dev: c_int = 0;
        assert_eq!((c.device_get)(&mut dev, 2), 101, "2 GPUs: ordinals 0 and 1");
        // Another thread has no current context: the default stream has none.
        let func = s.func as usize;
        std::thread::spawn(move || {
            let mut arg = 1u64;
            let mut params = [&mut arg as *mut u64 as *mut c_void];
            let r = (c.launch)(
                func as H,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                null_mut(),
                params.as_mut_ptr(),
                null_mut(),
            );
            assert_eq!(r, INVALID_CONTEXT);
            assert_eq!((c.ctx_sync)(), INVALID_CONTEXT);
        })
        .join()
        .unwrap();
        assert_eq!((c.ctx_destroy)(s.ctx), OK);
        assert_eq!((c.ctx_destroy)(s.ctx), INVALID_CONTEXT);
        assert_eq!(
            (c.stream_sync)(s.stream),
            INVALID_HANDLE,
            "freed with its context"
        );
    }
}

#[test]
fn uuids_and_the_primary_context_slot() {
    let _g = start();
    let c = cu();
    // SAFETY: valid out-pointers.
    unsafe {
        assert_eq!((c.init)(0), OK);
        let mut n = 0;
        assert_eq!((c.device_count)(&mut n), OK);
        assert_eq!(n, 2);
        for dev in 0..2 {
            let (mut a, mut b) = ([0u8; 16], [0u8; 16]);
            assert_eq!((c.uuid)(&mut a, dev), OK);
            assert_eq!((c.uuid_v2)(&mut b, dev), OK);
            assert_eq!(a, coloc_sim::gpu_uuid(dev as u32));
            assert_eq!(a, b);
        }
        assert_eq!(
            coloc_sim::uuid_string(&coloc_sim::gpu_uuid(1)),
            "GPU-c010c517-0000-0000-0000-000000000001"
        );
        assert!(sim(2).slot_info(me(), 1).is_none());
        let (mut p1, mut p2) = (null_mut(), null_mut());
        assert_eq!((c.primary_retain)(&mut p1, 1), OK);
        assert_eq!((c.primary_retain)(&mut p2, 1), OK);
        assert_eq!(p1, p2, "one primary context per device");
        assert!(
            sim(2).slot_info(me(), 1).is_some(),
            "slot at context creation"
        );
        assert_eq!((c.primary_release)(1), OK);
        assert!(sim(2).slot_info(me(), 1).is_some(), "still retained once");
        assert_eq!((c.primary_release)(1), OK);
        assert!(
            sim(2).slot_info(me(), 1).is_none(),
            "released with the last retain"
        );
        assert_eq!((c.primary_release)(1), INVALID_CONTEXT);
    }
}

#[repr(C)]
struct LaunchConfig {
    grid: [u32; 3],
    block: [u32; 3],
    shared: u32,
    stream: H,
    attrs: H,
    n_attrs: u32,
}

#[test]
fn every_launch_entry_point_takes_the_first_parameter_as_duration() {
    let _g = start();
    let s = setup(0);
    let ptr = |name: &CStr| {
        let (r, p, _) = get(name, 12040, 2);
        assert_eq!(r, OK, "{name:?}");
        p
    };
    type Ex =
        unsafe extern "C" fn(*const LaunchConfig, H, *mut *mut c_void, *mut *mut c_void) -> c_int;
    type Coop =
        unsafe extern "C" fn(H, u32, u32, u32, u32, u32, u32, u32, H, *mut *mut c_void) -> c_int;
    type GetCtx = unsafe extern "C" fn(H, *mut H) -> c_int;
    // SAFETY: pointers from the getter for these cuda.h signatures; valid arguments.
    unsafe {
        let ex: Ex = std::mem::transmute::<H, Ex>(ptr(c"cuLaunchKernelEx"));
        let coop: Coop = std::mem::transmute::<H, Coop>(ptr(c"cuLaunchCooperativeKernel"));
        let launch: FnLaunch = std::mem::transmute::<H, FnLaunch>(ptr(c"cuLaunchKernel"));
        let get_ctx: GetCtx = std::mem::transmute::<H, GetCtx>(ptr(c"cuStreamGetCtx"));
        let mut ctx = null_mut();
        assert_eq!(get_ctx(s.stream, &mut ctx), OK);
        assert_eq!(ctx, s.ctx);
        assert_eq!(
            get_ctx(null_mut(), &mut ctx),
            OK,
            "default stream: current context"
        );
        assert_eq!(ctx, s.ctx);
        let (sub0, _) = counters(0);
        let mut a = 1_000u64;
        let mut b = 20_000u64;
        let mut params = [&mut a as *mut u64 as *mut c_void];
        let mut params_b = [&mut b as *mut u64 as *mut c_void];
        let cfg = LaunchConfig {
            grid: [2, 1, 1],
            block: [64, 1, 1],
            shared: 0,
            stream: s.stream,
            attrs: null_mut(),
            n_attrs: 0,
        };
        assert_eq!(ex(&cfg, s.func, params.as_mut_ptr(), null_mut()), OK);
        assert_eq!(
            coop(s.func, 1, 1, 1, 1, 1, 1, 0, s.stream, params_b.as_mut_ptr()),
            OK
        );
        // Parameters packed in `extra` (CU_LAUNCH_PARAM_BUFFER_POINTER/SIZE/END), on the
        // per-thread default stream.
        let mut buf = 300_000u64;
        let mut size = 8usize;
        let key = |k: usize| std::ptr::without_provenance_mut::<c_void>(k);
        let mut extra = [
            key(1),
            &mut buf as *mut u64 as *mut c_void,
            key(2),
            &mut size as *mut usize as *mut c_void,
            null_mut(),
        ];
        let r = launch(
            s.func,
            1,
            1,
            1,
            1,
            1,
            1,
            0,
            2 as H,
            null_mut(),
            extra.as_mut_ptr(),
        );
        assert_eq!(r, OK);
        assert_eq!(counters(0).0 - sub0, 1_000 + 20_000 + 300_000);
        assert_eq!((cu().ctx_sync)(), OK);
        assert_eq!((cu().ctx_destroy)(s.ctx), OK);
    }
}

/// `FakeStats` as the library fills it (submissions, most outstanding per stream, per GPU).
fn stats() -> [u64; 3] {
    let mut s = [0u64; 3];
    // SAFETY: the extra export's signature; `[u64; 3]` has FakeStats's layout.
    unsafe {
        let f: unsafe extern "C" fn(*mut [u64; 3]) -> c_int = f(c"coloc_fake_stats");
        assert_eq!(f(&mut s), OK);
    }
    s
}

#[test]
fn events_wait_across_threads_and_outstanding_work_is_counted() {
    let _g = start();
    let s = setup(0);
    let c = cu();
    let before = stats();
    // Three 20 ms kernels back to back on the stream: three outstanding on it at once.
    for _ in 0..3 {
        assert_eq!(s.launch(20_000_000), OK);
    }
    let mut ev = null_mut();
    // SAFETY: valid out-pointer; handles from setup.
    unsafe {
        assert_eq!((c.event_create)(&mut ev, 0x3), OK);
        assert_eq!((c.event_record)(ev, s.stream), OK);
    }
    let after = stats();
    assert_eq!(after[0] - before[0], 3, "submissions counted: {after:?}");
    assert!(after[1] >= 3, "three outstanding on the stream: {after:?}");
    assert!(after[2] >= 3, "and on the GPU: {after:?}");
    // Another thread, with no context current (as the shim's watcher), waits for the event.
    let ev_addr = ev as usize;
    let t0 = Instant::now();
    let waited = std::thread::spawn(move || {
        // SAFETY: an event of this process; cuEventSynchronize needs no current context.
        let r = unsafe { (cu().event_sync)(ev_addr as H) };
        (r, t0.elapsed())
    })
    .join()
    .unwrap();
    assert_eq!(waited.0, OK);
    assert!(
        waited.1 >= Duration::from_millis(55),
        "the other thread waited for the three kernels: {:?}",
        waited.1
    );
    let (sub, done) = counters(0);
    assert!(done >= sub, "complete when the wait returned");
    // SAFETY: the event is complete; querying it from yet another thread.
    let r = std::thread::spawn(move || unsafe { (cu().event_query)(ev_addr as H) })
        .join()
        .unwrap();
    assert_eq!(r, OK);
    // SAFETY: handles from setup.
    unsafe { assert_eq!((c.ctx_destroy)(s.ctx), OK) };
}

#[test]
fn stream_capture_records_work_and_enforces_the_global_mode_rule() {
    const UNSUPPORTED: c_int = 900;
    const INVALIDATED: c_int = 901;
    const CAPTURED_EVENT: c_int = 907;
    const GLOBAL: c_int = 0;
    const RELAXED: c_int = 2;
    let _g = start();
    let s = setup(0);
    let c = cu();
    // SAFETY: exported names with their cuda.h signatures; handles from setup; valid
    // out-pointers.
    unsafe {
        let begin: unsafe extern "C" fn(H, c_int) -> c_int = f(c"cuStreamBeginCapture_v2");
        let end: unsafe extern "C" fn(H, *mut H) -> c_int = f(c"cuStreamEndCapture");
        let is_capturing: unsafe extern "C" fn(H, *mut c_int) -> c_int = f(c"cuStreamIsCapturing");
        let exchange: FnPI = f(c"cuThreadExchangeStreamCaptureMode");
        let instantiate: unsafe extern "C" fn(*mut H, H, u64) -> c_int =
            f(c"cuGraphInstantiateWithFlags");
        for name in [
            c"cuStreamBeginCapture",
            c"cuStreamEndCapture",
            c"cuStreamIsCapturing",
            c"cuThreadExchangeStreamCaptureMode",
            c"cuGraphInstantiateWithFlags",
        ] {
            assert_eq!(get(name, 12040, 0).0, OK, "{name:?} through the getter");
        }
        let mut other = null_mut();
        assert_eq!((c.stream_create)(&mut other, 0), OK);
        let mut ev = null_mut();
        assert_eq!((c.event_create)(&mut ev, 0), OK);
        assert_eq!((c.event_record)(ev, other), OK);
        let mut st = -1;
        assert_eq!(is_capturing(s.stream, &mut st), OK);
        assert_eq!(st, 0);
        assert_eq!(begin(null_mut(), GLOBAL), UNSUPPORTED, "default stream");

        // A clean capture: launches run nothing, the graph runs them as one submission.
        let (sub0, _) = counters(0);
        assert_eq!(begin(s.stream, GLOBAL), OK);
        assert_eq!(is_capturing(s.stream, &mut st), OK);
        assert_eq!(st, 1);
        assert_eq!(s.launch(3_000_000), OK);
        assert_eq!(s.launch(2_000_000), OK);
        assert_eq!(counters(0).0, sub0, "captured work does not run");
        // A RELAXED thread may wait for an event of another stream.
        let mut mode = RELAXED;
        assert_eq!(exchange(&mut mode), OK);
        assert_eq!(mode, GLOBAL, "the previous mode");
        assert_eq!((c.event_sync)(ev), OK);
        assert_eq!((c.event_query)(ev), OK);
        assert_eq!(exchange(&mut mode), OK);
        assert_eq!(mode, RELAXED);
        // An event recorded in the capture is a captured event.
        let mut cev = null_mut();
        assert_eq!((c.event_create)(&mut cev, 0), OK);
        assert_eq!((c.event_record)(cev, s.stream), OK);
        let mut graph = null_mut();
        assert_eq!(end(s.stream, &mut graph), OK);
        assert!(!graph.is_null());
        assert_eq!(is_capturing(s.stream, &mut st), OK);
        assert_eq!(st, 0);
        assert_eq!((c.event_query)(cev), CAPTURED_EVENT);
        let mut exec = null_mut();
        assert_eq!(instantiate(&mut exec, graph, 0), OK);
        assert_eq!((c.graph_launch)(exec, s.stream), OK);
        assert_eq!(counters(0).0, sub0 + 5_000_000, "the graph runs both");

        // From another thread in mode GLOBAL (a thread's default): refused, and the
        // capture is invalidated.
        assert_eq!(begin(s.stream, GLOBAL), OK);
        let evu = ev as usize;
        let r = std::thread::spawn(move || (cu().event_sync)(evu as H))
            .join()
            .unwrap();
        assert_eq!(r, UNSUPPORTED);
        assert_eq!(is_capturing(s.stream, &mut st), OK);
        assert_eq!(st, 2, "invalidated");
        assert_eq!(end(s.stream, &mut graph), INVALIDATED);
        assert!(graph.is_null());
        // A RELAXED capture does not restrict other threads; a wait on the capturing
        // stream itself is refused anyway.
        assert_eq!(begin(s.stream, RELAXED), OK);
        assert_eq!((c.event_query)(ev), OK);
        assert_eq!((c.stream_sync)(s.stream), UNSUPPORTED);
        assert_eq!(end(s.stream, &mut graph), INVALIDATED);
        assert_eq!(end(s.stream, &mut graph), 401, "no capture");
        assert_eq!((c.ctx_destroy)(s.ctx), OK);
    }
}
