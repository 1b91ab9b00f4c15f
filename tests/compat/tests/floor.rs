//! The shim as images ship it needs no glibc symbol newer than 2.17, on x86_64 and
//! aarch64 (`scripts/build-compat`; `objdump -T`), and imports nothing without a version
//! but the weak symbols Rust's standard library does without.

use coloc_compat::*;

fn newest(so: &std::path::Path) -> (u32, u32, u32) {
    *glibc_versions(so)
        .last()
        .unwrap_or_else(|| panic!("{} names no GLIBC version", so.display()))
}

#[test]
fn the_shipped_shim_needs_nothing_newer_than_glibc_2_17() {
    // The reader itself: the host build (linked against this machine's glibc) names the
    // versions it needs; printed, since that build is not what images ship.
    let host = coloc_e2e::bin("libcoloc_cuda.so");
    let h = newest(&host);
    eprintln!("the host build of the shim needs GLIBC_{}.{}", h.0, h.1);
    assert!(h >= (2, 2, 5), "objdump's versions are read");
    let Some(b) = builds() else {
        eprintln!("NOTE: no Zig build: the 2.17 floor is not checked (only the reader above)");
        return;
    };
    let mut shims = vec![("x86_64", b.shim.clone())];
    match &b.shim_aarch64 {
        Some(p) => shims.push(("aarch64", p.clone())),
        None => eprintln!("NOTE: no aarch64 build here: its floor is not checked"),
    }
    for (arch, so) in shims {
        let loose = unversioned_imports(&so);
        assert!(
            loose.is_empty(),
            "{arch}: {} imports without a version (bound to whatever glibc has): {loose:?}",
            so.display()
        );
        let n = newest(&so);
        eprintln!(
            "{arch}: the shipped shim needs GLIBC_{}.{}.{}",
            n.0, n.1, n.2
        );
        assert!(
            (n.0, n.1) <= FLOOR,
            "{arch}: {} needs GLIBC_{}.{} (floor {}.{}): {:?}",
            so.display(),
            n.0,
            n.1,
            FLOOR.0,
            FLOOR.1,
            glibc_versions(&so)
        );
    }
    // The fake driver the old-userland tests load has the same floor.
    let fake = b.fake_cuda_dir.join("libcuda.so.1");
    assert!((newest(&fake).0, newest(&fake).1) <= FLOOR);
}
