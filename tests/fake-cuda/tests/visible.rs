//! `CUDA_VISIBLE_DEVICES=1`: ordinal 0 is simulated GPU 1, in the UUID and in the slot
//! the work lands in; the UUID is the fake NVML's.

mod common;
use common::*;
use std::ffi::{c_char, c_uint, CStr};

#[test]
fn visible_devices_remap_ordinals_uuids_and_submissions() {
    let sim = sim(3);
    std::env::set_var("CUDA_VISIBLE_DEVICES", "1");
    let c = cu();
    // SAFETY: library calls with valid out-pointers.
    unsafe {
        assert_eq!((c.init)(0), OK);
        let mut n = 0;
        assert_eq!((c.device_count)(&mut n), OK);
        assert_eq!(n, 1);
        let mut u = [0u8; 16];
        assert_eq!((c.uuid_v2)(&mut u, 0), OK);
        assert_eq!(u, coloc_sim::gpu_uuid(1));
        // What the fake NVML says GPU 1 is.
        assert_eq!(fake_nvml::nvmlInit_v2(), 0);
        let mut dev = std::ptr::null_mut();
        assert_eq!(fake_nvml::nvmlDeviceGetHandleByIndex_v2(1, &mut dev), 0);
        let mut buf = [0 as c_char; 96];
        assert_eq!(
            fake_nvml::nvmlDeviceGetUUID(dev, buf.as_mut_ptr(), buf.len() as c_uint),
            0
        );
        let nvml_uuid = CStr::from_ptr(buf.as_ptr()).to_str().unwrap().to_owned();
        assert_eq!(coloc_sim::uuid_string(&u), nvml_uuid);
        assert_eq!(nvml_uuid, "GPU-c010c517-0000-0000-0000-000000000001");
    }
    let s = setup(0);
    assert_eq!(s.launch(3_000_000), OK);
    let me = std::process::id();
    assert_eq!(sim.slot_info(me, 1).unwrap().submitted_ns, 3_000_000);
    assert!(sim.slot_info(me, 0).is_none());
    // SAFETY: the current context from setup.
    unsafe { assert_eq!((c.ctx_sync)(), OK) };
    assert_eq!(sim.slot_info(me, 1).unwrap().completed_ns, 3_000_000);
}
