//! Test workload (`tests/e2e/tests/gate.rs`): batched copies (`cuMemcpyBatchAsync`) in
//! both of their ABIs, found as the CUDA runtime finds entry points (`dlopen`,
//! `cuGetProcAddress_v2`): asked for at CUDA 12.8 the getter gives the ABI with `failIdx`
//! before the stream, at 13.0 the one without. Each is called `N` times on a created
//! stream, then the stream is synchronised; then a child is forked that exits at once.
//! Prints one JSON line (the result codes and
//! what `failIdx` came back as), then waits for stdin to close before exiting (so that a
//! test can read the shim's page). In tests the driver is the fake one (`tests/fake-cuda`).

use coloc_tools::cuda::{get_at, getter};
use std::ffi::{c_int, c_void};

type H = *mut c_void;
type BatchV1 = unsafe extern "C" fn(
    *const u64,
    *const u64,
    *const usize,
    usize,
    *const c_void,
    *const usize,
    usize,
    *mut usize,
    H,
) -> c_int;
type BatchV2 = unsafe extern "C" fn(
    *const u64,
    *const u64,
    *const usize,
    usize,
    *const c_void,
    *const usize,
    usize,
    H,
) -> c_int;

/// Calls of each ABI.
const N: usize = 20;

fn main() {
    // SAFETY: FFI to the driver as the CUDA runtime calls it; every transmute names the
    // entry point's C type (cuda.h); the handle and objects live until exit.
    unsafe {
        let getter = getter();
        macro_rules! f {
            ($name:literal, $ver:expr, $t:ty) => {
                std::mem::transmute::<H, $t>(get_at(getter, $name, $ver))
            };
        }
        let init = f!(c"cuInit", 12040, unsafe extern "C" fn(u32) -> c_int);
        assert_eq!(init(0), 0, "cuInit");
        let mut ctx = std::ptr::null_mut();
        let retain = f!(
            c"cuDevicePrimaryCtxRetain",
            12040,
            unsafe extern "C" fn(*mut H, c_int) -> c_int
        );
        assert_eq!(retain(&mut ctx, 0), 0, "cuDevicePrimaryCtxRetain");
        let set = f!(c"cuCtxSetCurrent", 12040, unsafe extern "C" fn(H) -> c_int);
        assert_eq!(set(ctx), 0, "cuCtxSetCurrent");
        let create = f!(
            c"cuStreamCreate",
            12040,
            unsafe extern "C" fn(*mut H, u32) -> c_int
        );
        let mut s = std::ptr::null_mut();
        assert_eq!(create(&mut s, 1), 0, "cuStreamCreate");
        let sync = f!(
            c"cuStreamSynchronize",
            12040,
            unsafe extern "C" fn(H) -> c_int
        );
        let v1 = f!(c"cuMemcpyBatchAsync", 12080, BatchV1);
        let v2 = f!(c"cuMemcpyBatchAsync", 13000, BatchV2);
        let (dsts, srcs) = ([0u64; 2], [0u64; 2]);
        let sizes = [1usize << 20, 1 << 20];
        let mut codes1 = Vec::new();
        let mut fail_idx = 7usize;
        for _ in 0..N {
            codes1.push(v1(
                dsts.as_ptr(),
                srcs.as_ptr(),
                sizes.as_ptr(),
                2,
                std::ptr::null(),
                std::ptr::null(),
                0,
                &mut fail_idx,
                s,
            ));
        }
        let mut codes2 = Vec::new();
        for _ in 0..N {
            codes2.push(v2(
                dsts.as_ptr(),
                srcs.as_ptr(),
                sizes.as_ptr(),
                2,
                std::ptr::null(),
                std::ptr::null(),
                0,
                s,
            ));
        }
        let synced = sync(s);
        // A child that exits at once (its atexit handlers run, the shim's among them): the
        // page is the parent's and must stay.
        let child = libc::fork();
        if child == 0 {
            libc::exit(0);
        }
        let mut status = 0;
        libc::waitpid(child, &mut status, 0);
        println!(
            "{{\"v1\":{codes1:?},\"v2\":{codes2:?},\"fail_idx\":{},\"sync\":{synced}}}",
            if fail_idx == usize::MAX {
                -1
            } else {
                fail_idx as i64
            }
        );
    }
    use std::io::Read;
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
}
