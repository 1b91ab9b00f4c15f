//! Before `cuInit`, and `cuInit` without a simulated GPU.

mod common;
use common::*;
use std::ffi::{c_char, c_int, CStr};

#[test]
fn calls_before_init_and_init_without_a_simulated_gpu() {
    std::env::remove_var(coloc_sim::STATE_ENV);
    let c = cu();
    // SAFETY: exported functions with valid out-pointers.
    unsafe {
        let mut n: c_int = -1;
        assert_eq!((c.device_count)(&mut n), 3, "CUDA_ERROR_NOT_INITIALIZED");
        let version: FnPI = f(c"cuDriverGetVersion");
        assert_eq!(version(&mut n), OK);
        assert_eq!(n, 12040);
        // The getter works before cuInit.
        let mut p = std::ptr::null_mut();
        let mut q = -1;
        assert_eq!(
            (c.get_proc)(c"cuInit".as_ptr(), &mut p, 12040, 0, &mut q),
            OK
        );
        assert_eq!(p, sym(c"cuInit"));
        assert_eq!(
            (c.init)(0),
            100,
            "CUDA_ERROR_NO_DEVICE without COLOC_SIM_STATE"
        );
        assert_eq!((c.init)(0), 100);
        assert_eq!((c.device_count)(&mut n), 3);
        let name: unsafe extern "C" fn(c_int, *mut *const c_char) -> c_int = f(c"cuGetErrorName");
        let mut s: *const c_char = std::ptr::null();
        assert_eq!(name(500, &mut s), OK);
        assert_eq!(CStr::from_ptr(s), c"CUDA_ERROR_NOT_FOUND");
        assert_eq!(name(12345, &mut s), 1);
        assert!(s.is_null());
        let table: unsafe extern "C" fn(*mut *const u8, *const u8) -> c_int =
            f(c"cuGetExportTable");
        let mut t: *const u8 = std::ptr::null();
        assert_eq!(
            table(&mut t, [0u8; 16].as_ptr()),
            801,
            "CUDA_ERROR_NOT_SUPPORTED"
        );
    }
}
