//! A doorbell page read from outside the process that writes it, as the agent reads it.

use crate::wait_for;
use std::path::Path;
use std::time::Duration;

/// A doorbell page mapped read-only, as the agent maps it.
pub struct MappedPage(*mut libc::c_void);

impl std::fmt::Debug for MappedPage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("MappedPage").field(&self.0).finish()
    }
}

impl MappedPage {
    /// Maps the page at `path` once the shim has sized and initialised it (5 s at most).
    pub fn open(path: &Path) -> MappedPage {
        use std::os::fd::AsRawFd;
        // The shim creates the file, then sizes it: mapping it before would fault.
        wait_for("the page sized", Duration::from_secs(5), || {
            std::fs::metadata(path).is_ok_and(|m| m.len() >= coloc_doorbell::PAGE as u64)
        })
        .unwrap();
        let f = std::fs::File::open(path).unwrap();
        // SAFETY: a read-only shared mapping of a page-long regular file.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                coloc_doorbell::PAGE,
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        let m = MappedPage(base);
        wait_for("the page initialised", Duration::from_secs(5), || {
            m.page().valid()
        })
        .unwrap();
        m
    }
    /// The page.
    pub fn page(&self) -> coloc_doorbell::Page<'_> {
        // SAFETY: a live read-only mapping; only reader-side methods are called.
        unsafe { coloc_doorbell::Page::from_raw(self.0.cast()) }
    }
    /// The gate fields of the (one) GPU the process submits to.
    pub fn gate(&self) -> Option<coloc_doorbell::GateReading> {
        let mut v = Vec::new();
        self.page().read_gate(&mut v);
        v.first().copied()
    }
    /// Its latest acknowledged gate epoch (0: none).
    pub fn ack(&self) -> u32 {
        self.gate().map_or(0, |r| r.gate_ack)
    }
}

impl Drop for MappedPage {
    fn drop(&mut self) {
        // SAFETY: our own mapping.
        unsafe { libc::munmap(self.0, coloc_doorbell::PAGE) };
    }
}
