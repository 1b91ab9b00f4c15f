//! The CUDA shim's cost per launch, through the real dynamic linker: `cuLaunchKernel` of
//! the fake driver, found as the CUDA runtime finds it (`dlopen("libcuda.so.1")`,
//! `dlsym(h, "cuGetProcAddress_v2")`, then the getter), in three processes:
//!
//! - `launch/no-shim`: no `LD_PRELOAD` (the fake driver's own cost);
//! - `launch/shim-pass-through`: `libcoloc_cuda.so` preloaded, no class (offline or a host
//!   with no agent): the cost of the wrapper alone;
//! - `launch/shim-doorbell`: class online with a doorbell directory: every launch stamps
//!   its time (launches closer than the wake gap: the busy fast path, no system call).
//!
//! The shim's cost is the difference to `no-shim`. The parent re-runs this binary once
//! per mode with the environment set (the preload must be there from the start).
//! `cargo bench -p coloc-e2e --bench shim_launch`.

// Function pointers from the driver's getter: each transmute names its type in the binding.
#![allow(clippy::missing_transmute_annotations)]

use criterion::{criterion_group, Criterion};
use std::ffi::{c_char, c_int, c_void};
use std::path::PathBuf;

type Getter =
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

struct Driver {
    launch: Launch,
    func: *mut c_void,
}

unsafe fn get(getter: Getter, name: &std::ffi::CStr) -> *mut c_void {
    let mut p = std::ptr::null_mut();
    // SAFETY: the driver's getter with valid pointers.
    let r = unsafe { getter(name.as_ptr(), &mut p, 12040, 0, std::ptr::null_mut()) };
    assert!(r == 0 && !p.is_null(), "{name:?}: {r}");
    p
}

fn driver() -> Driver {
    // SAFETY: FFI to the (fake) driver exactly as the CUDA runtime calls it; every handle
    // lives until the process exits.
    unsafe {
        let h = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW);
        assert!(!h.is_null(), "dlopen libcuda.so.1 (LD_LIBRARY_PATH)");
        let g = libc::dlsym(h, c"cuGetProcAddress_v2".as_ptr());
        assert!(!g.is_null());
        let getter: Getter = std::mem::transmute(g);
        let init: unsafe extern "C" fn(u32) -> c_int = std::mem::transmute(get(getter, c"cuInit"));
        assert_eq!(init(0), 0);
        let dev_get: unsafe extern "C" fn(*mut c_int, c_int) -> c_int =
            std::mem::transmute(get(getter, c"cuDeviceGet"));
        let mut dev = 0;
        assert_eq!(dev_get(&mut dev, 0), 0);
        let ctx_create: unsafe extern "C" fn(*mut *mut c_void, u32, c_int) -> c_int =
            std::mem::transmute(get(getter, c"cuCtxCreate"));
        let mut ctx = std::ptr::null_mut();
        assert_eq!(ctx_create(&mut ctx, 0, dev), 0);
        let load: unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> c_int =
            std::mem::transmute(get(getter, c"cuModuleLoadData"));
        let mut module = std::ptr::null_mut();
        assert_eq!(load(&mut module, c"bench".as_ptr().cast()), 0);
        let getf: unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *const c_char) -> c_int =
            std::mem::transmute(get(getter, c"cuModuleGetFunction"));
        let mut func = std::ptr::null_mut();
        assert_eq!(getf(&mut func, module, c"noop".as_ptr()), 0);
        Driver {
            launch: std::mem::transmute(get(getter, c"cuLaunchKernel")),
            func,
        }
    }
}

fn bench(c: &mut Criterion) {
    let mode = std::env::var("COLOC_BENCH_MODE").unwrap_or_default();
    let d = driver();
    c.bench_function(&format!("launch/{mode}"), |b| {
        b.iter(|| {
            let mut ns = 0u64;
            let mut params = [&mut ns as *mut u64 as *mut c_void];
            // SAFETY: a zero-length kernel on the default stream of our context.
            let r = unsafe {
                (d.launch)(
                    d.func,
                    1,
                    1,
                    1,
                    1,
                    1,
                    1,
                    0,
                    std::ptr::null_mut(),
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            };
            assert_eq!(r, 0);
        })
    });
}

criterion_group!(benches, bench);

fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    deps.parent().unwrap().to_path_buf()
}

fn main() {
    if std::env::var_os("COLOC_BENCH_MODE").is_some() {
        benches();
        Criterion::default().configure_from_args().final_summary();
        return;
    }
    let dir = target_dir();
    let state = PathBuf::from("/dev/shm").join(format!("coloc-bench-shim-{}", std::process::id()));
    let _sim = coloc_sim::SimGpu::create(&state, 1, 100_000_000).expect("simulated GPU state");
    let cuda = coloc_sim::fake_libcuda_dir(&dir).expect("fake libcuda (cargo build -p fake-cuda)");
    let shim = dir.join("libcoloc_cuda.so");
    assert!(
        shim.exists(),
        "{} missing: cargo build -p coloc-cuda-shim",
        shim.display()
    );
    let bells = std::env::temp_dir().join(format!("coloc-bench-bells-{}", std::process::id()));
    std::fs::create_dir_all(&bells).unwrap();
    for mode in ["no-shim", "shim-pass-through", "shim-doorbell"] {
        let mut c = std::process::Command::new(std::env::current_exe().unwrap());
        c.args(std::env::args_os().skip(1))
            .env("COLOC_BENCH_MODE", mode)
            .env("COLOC_SIM_STATE", &state)
            .env("LD_LIBRARY_PATH", &cuda);
        if mode != "no-shim" {
            c.env("LD_PRELOAD", &shim);
        }
        if mode == "shim-doorbell" {
            c.env("COLOC_SHIM_CLASS", "online")
                .env("COLOC_DOORBELL_DIR", &bells);
        }
        let st = c.status().expect("run the bench");
        assert!(st.success(), "{mode}: {st}");
    }
    let _ = std::fs::remove_dir_all(&bells);
    let _ = std::fs::remove_file(&state);
}
