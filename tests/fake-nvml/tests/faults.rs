//! Fault injection, through the exported C functions, against a simulated GPU state file.
//!
//! The library keeps one process-wide state (as the real one does), so every test takes
//! `LOCK` and starts from `nvml_clear()`; counters are compared before and after.

use coloc_sim::{Daemon, NvmlFunc, SimGpu, SlotHandle};
use fake_nvml::*;
use std::ffi::{c_char, c_uint};
use std::ptr::null_mut;
use std::sync::mpsc::{channel, RecvTimeoutError};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

const OK: c_uint = 0;
const INVALID_ARGUMENT: c_uint = 2;
const INSUFFICIENT_SIZE: c_uint = 7;
const DRIVER_NOT_LOADED: c_uint = 9;
const TIMEOUT: c_uint = 10;
const GPU_IS_LOST: c_uint = 15;

static LOCK: Mutex<()> = Mutex::new(());

/// The state file, shared with the library: one process (this one) on each of 2 GPUs,
/// with utilisation samples on both. The first call initialises the library.
fn sim() -> &'static SimGpu {
    static SIM: OnceLock<SimGpu> = OnceLock::new();
    static SLOTS: OnceLock<Vec<SlotHandle<'static>>> = OnceLock::new();
    let sim = SIM.get_or_init(|| {
        let path = std::env::temp_dir().join(format!("fake-nvml-faults-{}", std::process::id()));
        let sim = SimGpu::create(&path, 2, 1_000_000).unwrap();
        // Set before the first nvmlInit, under LOCK; nothing else reads the environment.
        std::env::set_var(coloc_sim::STATE_ENV, &path);
        sim
    });
    SLOTS.get_or_init(|| {
        let a = sim.register(0, 1 << 20).unwrap();
        let b = sim.register(1, 1 << 20).unwrap();
        let t0 = 1_000_000_000_000u64; // a period boundary, long ago
        let mut d = Daemon::new(sim, t0);
        a.submit_at(3_000_000, t0);
        b.submit_at(2_000_000, t0);
        d.advance(t0 + 5_000_000);
        assert_eq!(nvmlInit_v2(), OK);
        std::fs::remove_file(std::env::var_os(coloc_sim::STATE_ENV).unwrap()).ok();
        vec![a, b]
    });
    sim
}

/// Samples on `gpu` newer than 0.
fn samples(gpu: u32) -> u32 {
    sim().samples(gpu, 0).len() as u32
}

fn setup() -> (MutexGuard<'static, ()>, &'static SimGpu) {
    let g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let sim = sim();
    sim.nvml_clear();
    assert!(samples(0) >= 3 && samples(1) >= 2);
    (g, sim)
}

fn handle(gpu: u32) -> (c_uint, NvmlDevice) {
    let mut d = null_mut();
    // SAFETY: `d` is a valid out-pointer.
    let r = unsafe { nvmlDeviceGetHandleByIndex_v2(gpu, &mut d) };
    (r, d)
}

fn dev(gpu: u32) -> NvmlDevice {
    let (r, d) = handle(gpu);
    assert_eq!(r, OK, "handle of GPU {gpu}");
    d
}

fn count() -> c_uint {
    let mut n = 0;
    // SAFETY: valid out-pointer.
    unsafe { nvmlDeviceGetCount_v2(&mut n) }
}

fn uuid(gpu: u32) -> c_uint {
    let mut buf = [0 as c_char; 96];
    // SAFETY: the buffer holds 96 bytes.
    unsafe { nvmlDeviceGetUUID(dev(gpu), buf.as_mut_ptr(), 96) }
}

fn name(gpu: u32) -> c_uint {
    let mut buf = [0 as c_char; 96];
    // SAFETY: the buffer holds 96 bytes.
    unsafe { nvmlDeviceGetName(dev(gpu), buf.as_mut_ptr(), 96) }
}

/// Count call of the process list: (code, count).
fn procs_count(gpu: u32) -> (c_uint, c_uint) {
    let mut n = 0;
    // SAFETY: valid out-pointer; null buffer.
    let r = unsafe { nvmlDeviceGetComputeRunningProcesses_v3(dev(gpu), &mut n, null_mut()) };
    (r, n)
}

/// Data call of the process list with room for `cap`: (code, count).
fn procs_data(gpu: u32, cap: u32) -> (c_uint, c_uint) {
    let zero = NvmlProcessInfo {
        pid: 0,
        usedGpuMemory: 0,
        gpuInstanceId: 0,
        computeInstanceId: 0,
    };
    let mut buf = vec![zero; cap as usize];
    let mut n = cap;
    // SAFETY: the buffer holds `cap` entries.
    let r = unsafe { nvmlDeviceGetComputeRunningProcesses_v3(dev(gpu), &mut n, buf.as_mut_ptr()) };
    (r, n)
}

fn util_count(gpu: u32) -> (c_uint, c_uint) {
    let mut n = 0;
    // SAFETY: valid out-pointer; null buffer.
    let r = unsafe { nvmlDeviceGetProcessUtilization(dev(gpu), null_mut(), &mut n, 0) };
    (r, n)
}

fn util_data(gpu: u32, cap: u32) -> (c_uint, c_uint) {
    let zero = NvmlProcessUtilizationSample {
        pid: 0,
        timeStamp: 0,
        smUtil: 0,
        memUtil: 0,
        encUtil: 0,
        decUtil: 0,
    };
    let mut buf = vec![zero; cap as usize];
    let mut n = cap;
    // SAFETY: the buffer holds `cap` entries.
    let r = unsafe { nvmlDeviceGetProcessUtilization(dev(gpu), buf.as_mut_ptr(), &mut n, 0) };
    (r, n)
}

/// The code of one call of `func` (on GPU `gpu` where it names one), as the agent makes it.
fn call(func: NvmlFunc, gpu: u32) -> c_uint {
    match func {
        NvmlFunc::Init => nvmlInit_v2(),
        NvmlFunc::Shutdown => nvmlShutdown(),
        NvmlFunc::DeviceGetCount => count(),
        NvmlFunc::DeviceGetHandleByIndex => handle(gpu).0,
        NvmlFunc::DeviceGetUUID => uuid(gpu),
        NvmlFunc::DeviceGetName => name(gpu),
        NvmlFunc::DeviceGetComputeRunningProcesses => procs_data(gpu, 8).0,
        NvmlFunc::DeviceGetProcessUtilization => util_data(gpu, samples(gpu)).0,
        NvmlFunc::DeviceGetIndex => {
            let mut i = 0;
            // SAFETY: valid out-pointer.
            unsafe { nvmlDeviceGetIndex(dev(gpu), &mut i) }
        }
        NvmlFunc::SystemGetDriverVersion => {
            let mut buf = [0 as c_char; 64];
            // SAFETY: the buffer holds 64 bytes.
            unsafe { nvmlSystemGetDriverVersion(buf.as_mut_ptr(), 64) }
        }
        NvmlFunc::DeviceGetMemoryInfo => memory(gpu).0,
    }
}

/// `nvmlDeviceGetMemoryInfo_v2`: (code, total, free, used).
fn memory(gpu: u32) -> (c_uint, u64, u64, u64) {
    let mut m = NvmlMemoryV2 {
        version: 0,
        total: 0,
        reserved: 0,
        free: 0,
        used: 0,
    };
    // SAFETY: a valid out-pointer.
    let r = unsafe { nvmlDeviceGetMemoryInfo_v2(dev(gpu), &mut m) };
    (r, m.total, m.free, m.used)
}

#[test]
fn memory_info_is_the_gpu_s_memory_less_what_its_listed_processes_hold() {
    let (_g, sim) = setup();
    // One process of 1 MiB on each GPU (see sim()); the default 80 GiB each.
    assert_eq!(memory(0), (OK, 80 << 30, (80 << 30) - (1 << 20), 1 << 20));
    sim.set_mem_total(4 << 20);
    assert_eq!(memory(1), (OK, 4 << 20, 3 << 20, 1 << 20));
    sim.set_mem_total(coloc_sim::DEFAULT_MEM_TOTAL);
    // SAFETY: a null out-pointer is refused, not written.
    assert_eq!(
        unsafe { nvmlDeviceGetMemoryInfo_v2(dev(0), null_mut()) },
        INVALID_ARGUMENT
    );
}

#[test]
fn no_fault_answers_normally() {
    let (_g, sim) = setup();
    let calls0 = NvmlFunc::ALL.map(|f| sim.nvml_call_count(f));
    for f in NvmlFunc::ALL {
        for gpu in [0, 1] {
            assert_eq!(call(f, gpu), OK, "{f} on GPU {gpu}");
        }
    }
    assert_eq!(procs_count(0), (INSUFFICIENT_SIZE, 1));
    assert_eq!(procs_data(1, 6), (OK, 1));
    let n = samples(0);
    assert_eq!(util_count(0), (INSUFFICIENT_SIZE, n));
    assert_eq!(util_data(0, n), (OK, n));
    // Counted per function: the loop made 2 calls of each; the handle calls of dev()
    // add one per call on a device.
    let made = |f: NvmlFunc| sim.nvml_call_count(f) - calls0[f as usize];
    assert_eq!(made(NvmlFunc::DeviceGetCount), 2);
    assert_eq!(made(NvmlFunc::DeviceGetComputeRunningProcesses), 4);
    assert_eq!(made(NvmlFunc::DeviceGetProcessUtilization), 4);
    assert_eq!(made(NvmlFunc::DeviceGetUUID), 2);
    assert_eq!(made(NvmlFunc::DeviceGetHandleByIndex), 2 + 2 * 6 + 4);
    assert!(NvmlFunc::ALL.iter().all(|&f| sim.nvml_in_flight(f) == 0));
}

#[test]
fn injection_answers_the_code_for_n_calls_of_each_function() {
    let (_g, sim) = setup();
    for f in NvmlFunc::ALL {
        let (calls0, inj0) = (sim.nvml_call_count(f), sim.nvml_injected_count(f));
        sim.nvml_inject(f, None, TIMEOUT, 2, false).unwrap();
        assert_eq!(call(f, 0), TIMEOUT, "{f}: 1st");
        assert_eq!(call(f, 1), TIMEOUT, "{f}: 2nd (any GPU)");
        assert_eq!(call(f, 0), OK, "{f}: 3rd, count used up");
        assert_eq!(sim.nvml_call_count(f) - calls0, 3, "{f}");
        assert_eq!(sim.nvml_injected_count(f) - inj0, 2, "{f}");
        // Other functions unaffected while one is injected.
        sim.nvml_inject(f, None, GPU_IS_LOST, 1, false).unwrap();
        for other in NvmlFunc::ALL.into_iter().filter(|&o| o != f) {
            // Calls on a device need a handle: skip the handle call itself when it is `f`.
            if f == NvmlFunc::DeviceGetHandleByIndex && other.per_gpu() {
                continue;
            }
            assert_eq!(call(other, 0), OK, "{other} while {f} is injected");
        }
        assert_eq!(call(f, 0), GPU_IS_LOST, "{f}");
        assert_eq!(call(f, 0), OK, "{f}");
    }
}

#[test]
fn injection_with_count_zero_lasts_until_cleared() {
    let (_g, sim) = setup();
    sim.nvml_inject(NvmlFunc::DeviceGetCount, None, GPU_IS_LOST, 0, false)
        .unwrap();
    for _ in 0..20 {
        assert_eq!(count(), GPU_IS_LOST);
    }
    sim.nvml_uninject(NvmlFunc::DeviceGetCount);
    assert_eq!(count(), OK);
    sim.nvml_inject(NvmlFunc::DeviceGetUUID, None, GPU_IS_LOST, 0, false)
        .unwrap();
    assert_eq!(uuid(0), GPU_IS_LOST);
    sim.nvml_clear();
    assert_eq!(uuid(0), OK);
}

#[test]
fn injection_for_one_gpu_leaves_the_others_alone() {
    let (_g, sim) = setup();
    for f in [
        NvmlFunc::DeviceGetHandleByIndex,
        NvmlFunc::DeviceGetUUID,
        NvmlFunc::DeviceGetComputeRunningProcesses,
        NvmlFunc::DeviceGetProcessUtilization,
    ] {
        sim.nvml_inject(f, Some(1), GPU_IS_LOST, 2, false).unwrap();
        assert_eq!(call(f, 0), OK, "{f} GPU 0");
        assert_eq!(call(f, 1), GPU_IS_LOST, "{f} GPU 1");
        assert_eq!(call(f, 0), OK, "{f} GPU 0 does not use up GPU 1's count");
        assert_eq!(call(f, 1), GPU_IS_LOST, "{f} GPU 1, 2nd");
        assert_eq!(call(f, 1), OK, "{f} GPU 1, count used up");
    }
    // One for a GPU is consulted before one for all GPUs.
    let f = NvmlFunc::DeviceGetUUID;
    sim.nvml_inject(f, None, TIMEOUT, 0, false).unwrap();
    sim.nvml_inject(f, Some(0), GPU_IS_LOST, 1, false).unwrap();
    assert_eq!(uuid(0), GPU_IS_LOST);
    assert_eq!(uuid(0), TIMEOUT);
    assert_eq!(uuid(1), TIMEOUT);
    // Functions that name no GPU refuse a per-GPU injection.
    assert!(sim
        .nvml_inject(NvmlFunc::DeviceGetCount, Some(0), 9, 1, false)
        .is_err());
    assert!(
        sim.nvml_inject(f, Some(2), 9, 1, false).is_err(),
        "only 2 GPUs"
    );
}

#[test]
fn data_call_only_hits_the_data_call_and_reports_the_needed_count() {
    let (_g, sim) = setup();
    // Utilisation: the driver's race. The count call succeeds; the data call, sized by
    // it, answers INSUFFICIENT_SIZE with a larger count; the retry succeeds.
    let n = samples(0);
    let f = NvmlFunc::DeviceGetProcessUtilization;
    let inj0 = sim.nvml_injected_count(f);
    sim.nvml_inject(f, None, INSUFFICIENT_SIZE, 1, true)
        .unwrap();
    for _ in 0..3 {
        assert_eq!(
            util_count(0),
            (INSUFFICIENT_SIZE, n),
            "count calls are served normally"
        );
    }
    assert_eq!(
        sim.nvml_injected_count(f),
        inj0,
        "count calls do not use up the count"
    );
    assert_eq!(util_data(0, n), (INSUFFICIENT_SIZE, n + 1));
    assert_eq!(util_data(0, n), (OK, n));
    assert_eq!(sim.nvml_injected_count(f) - inj0, 1);

    // Process list: a buffer larger than needed still gets a needed count beyond it.
    let f = NvmlFunc::DeviceGetComputeRunningProcesses;
    sim.nvml_inject(f, Some(1), INSUFFICIENT_SIZE, 1, true)
        .unwrap();
    assert_eq!(procs_count(1), (INSUFFICIENT_SIZE, 1));
    assert_eq!(procs_data(0, 6), (OK, 1), "other GPU");
    assert_eq!(procs_data(1, 6), (INSUFFICIENT_SIZE, 7));
    assert_eq!(procs_data(1, 6), (OK, 1));

    // Another code on the data call only: the count call is untouched.
    sim.nvml_inject(f, None, GPU_IS_LOST, 0, true).unwrap();
    assert_eq!(procs_count(0), (INSUFFICIENT_SIZE, 1));
    assert_eq!(procs_data(0, 6).0, GPU_IS_LOST);
    // Without data_call_only, the count call is hit too; INSUFFICIENT_SIZE on a count
    // call reports the real count.
    sim.nvml_inject(f, None, GPU_IS_LOST, 1, false).unwrap();
    assert_eq!(procs_count(0).0, GPU_IS_LOST);
    assert!(sim
        .nvml_inject(NvmlFunc::DeviceGetUUID, None, 7, 1, true)
        .is_err());
}

#[test]
fn delay_delays_every_call_of_that_function_only() {
    let (_g, sim) = setup();
    let d = Duration::from_millis(150);
    sim.nvml_delay(NvmlFunc::DeviceGetUUID, d);
    for _ in 0..2 {
        let t = Instant::now();
        assert_eq!(uuid(0), OK);
        assert!(t.elapsed() >= d, "{:?}", t.elapsed());
    }
    let t = Instant::now();
    assert_eq!(name(0), OK);
    assert!(t.elapsed() < d, "another function: {:?}", t.elapsed());
    sim.nvml_delay(NvmlFunc::DeviceGetUUID, Duration::ZERO);
    let t = Instant::now();
    assert_eq!(uuid(0), OK);
    assert!(t.elapsed() < d, "cleared: {:?}", t.elapsed());
}

/// Releases a hang even when the test fails, so no thread stays blocked.
struct Unhang(&'static SimGpu, NvmlFunc);
impl Drop for Unhang {
    fn drop(&mut self) {
        self.0.nvml_hang(self.1, false);
    }
}

fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + limit;
    while !f() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn hang_blocks_until_cleared_then_answers_normally() {
    let (_g, sim) = setup();
    let f = NvmlFunc::DeviceGetComputeRunningProcesses;
    let _unhang = Unhang(sim, f);
    sim.nvml_hang(f, true);
    let (tx, rx) = channel();
    let t = std::thread::spawn(move || tx.send(procs_count(0)).unwrap());
    wait_for("the call to block", Duration::from_secs(5), || {
        sim.nvml_hung_count(f) == 1
    });
    assert_eq!(sim.nvml_in_flight(f), 1);
    assert_eq!(
        rx.recv_timeout(Duration::from_millis(300)),
        Err(RecvTimeoutError::Timeout),
        "returned while hung"
    );
    // Other functions still answer.
    assert_eq!(uuid(0), OK);
    assert_eq!(sim.nvml_hung_count(NvmlFunc::DeviceGetUUID), 0);
    sim.nvml_hang(f, false);
    assert_eq!(
        rx.recv_timeout(Duration::from_secs(5)),
        Ok((INSUFFICIENT_SIZE, 1)),
        "normal answer after the hang"
    );
    t.join().unwrap();
    assert_eq!(sim.nvml_hung_count(f), 0);
    assert_eq!(sim.nvml_in_flight(f), 0);
    // Cleared: no longer blocks.
    let t = Instant::now();
    assert_eq!(procs_count(0), (INSUFFICIENT_SIZE, 1));
    assert!(t.elapsed() < Duration::from_secs(1));
}

#[test]
fn hang_then_gone_answers_gone_and_clear_releases() {
    let (_g, sim) = setup();
    let f = NvmlFunc::DeviceGetUUID;
    let _unhang = Unhang(sim, f);
    sim.nvml_hang(f, true);
    let (tx, rx) = channel();
    let t = std::thread::spawn(move || tx.send(uuid(1)).unwrap());
    wait_for("the call to block", Duration::from_secs(5), || {
        sim.nvml_hung_count(f) == 1
    });
    sim.nvml_gone(true);
    sim.nvml_hang(f, false);
    assert_eq!(
        rx.recv_timeout(Duration::from_secs(5)),
        Ok(DRIVER_NOT_LOADED)
    );
    t.join().unwrap();
    // nvml_clear wakes hung calls too.
    sim.nvml_clear();
    sim.nvml_hang(f, true);
    let (tx, rx) = channel();
    let t = std::thread::spawn(move || tx.send(uuid(0)).unwrap());
    wait_for("the call to block", Duration::from_secs(5), || {
        sim.nvml_hung_count(f) == 1
    });
    sim.nvml_clear();
    assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(OK));
    t.join().unwrap();
}

#[test]
fn gone_fails_every_call_until_cleared() {
    let (_g, sim) = setup();
    let d0 = dev(0); // a handle taken before the driver went away
    sim.nvml_gone(true);
    for f in NvmlFunc::ALL {
        if f.per_gpu() && f != NvmlFunc::DeviceGetHandleByIndex {
            continue; // checked with `d0` below: dev() would fail first
        }
        assert_eq!(call(f, 0), DRIVER_NOT_LOADED, "{f}");
    }
    let mut buf = [0 as c_char; 96];
    let mut n = 0;
    // SAFETY: valid buffers and out-pointers.
    unsafe {
        assert_eq!(
            nvmlDeviceGetUUID(d0, buf.as_mut_ptr(), 96),
            DRIVER_NOT_LOADED
        );
        assert_eq!(
            nvmlDeviceGetName(d0, buf.as_mut_ptr(), 96),
            DRIVER_NOT_LOADED
        );
        assert_eq!(nvmlDeviceGetIndex(d0, &mut n), DRIVER_NOT_LOADED);
        assert_eq!(
            nvmlDeviceGetComputeRunningProcesses_v3(d0, &mut n, null_mut()),
            DRIVER_NOT_LOADED
        );
        assert_eq!(
            nvmlDeviceGetProcessUtilization(d0, null_mut(), &mut n, 0),
            DRIVER_NOT_LOADED
        );
        // The error string still works, as in the real library.
        let s = std::ffi::CStr::from_ptr(nvmlErrorString(DRIVER_NOT_LOADED));
        assert_eq!(s.to_str(), Ok("Driver Not Loaded"));
    }
    sim.nvml_gone(false);
    for f in NvmlFunc::ALL {
        assert_eq!(call(f, 0), OK, "{f} after the driver came back");
    }
    sim.nvml_gone_code(12);
    assert_eq!(nvmlInit_v2(), 12);
    sim.nvml_clear();
    assert_eq!(nvmlInit_v2(), OK);
}

#[test]
fn legacy_nvml_fail_still_fails_device_calls() {
    use std::sync::atomic::Ordering::SeqCst;
    let (_g, sim) = setup();
    let calls0 = sim.header().nvml_calls.load(SeqCst);
    sim.header().nvml_fail.store(1, SeqCst);
    assert_eq!(uuid(0), GPU_IS_LOST);
    assert_eq!(procs_count(1).0, GPU_IS_LOST);
    assert_eq!(count(), OK, "not a device call");
    assert_eq!(sim.header().nvml_calls.load(SeqCst) - calls0, 2);
    sim.header().nvml_fail.store(0, SeqCst);
    assert_eq!(uuid(0), OK);
    sim.header().nvml_fail.store(1, SeqCst);
    sim.nvml_clear();
    assert_eq!(uuid(0), OK, "nvml_clear clears nvml_fail too");
    // An invalid handle is still refused.
    let mut buf = [0 as c_char; 96];
    // SAFETY: valid buffer; the handle is bogus on purpose.
    let r = unsafe { nvmlDeviceGetUUID(99 as NvmlDevice, buf.as_mut_ptr(), 96) };
    assert_eq!(r, INVALID_ARGUMENT);
}
