//! The agent's gate file, mapped read-only: found at the first submission or later by
//! the watcher, replaced when a restarted agent makes a new one (a new inode).

use super::{GATE_PATH, STALE_NS};
use coloc_doorbell::gate::{Gates, GATE_FILE_SIZE};
use coloc_doorbell::now_ns;
use std::sync::atomic::{AtomicPtr, AtomicU32, Ordering::*};

/// One mapping of a gate file (read-only). Never unmapped: submissions may hold references
/// into it; a replaced file costs one leaked page per agent restart.
pub(super) struct Mapping {
    pub(super) gates: Gates<'static>,
    /// Counts mappings (1, 2, …): caches made for an older one are refreshed.
    pub(super) epoch: u32,
    /// The file's identity (a new file is a new inode).
    dev: u64,
    ino: u64,
}

static MAPPING: AtomicPtr<Mapping> = AtomicPtr::new(std::ptr::null_mut());

static MAPPINGS: AtomicU32 = AtomicU32::new(0);

/// The current mapping (none before a valid, fresh file was seen).
pub(super) fn mapping() -> Option<&'static Mapping> {
    let m = MAPPING.load(Acquire);
    // SAFETY: a non-null MAPPING is a leaked Box, never freed.
    (!m.is_null()).then(|| unsafe { &*m })
}

/// The mapped file's heartbeat is stale: its gates count as open.
pub(super) fn stale(m: &Mapping) -> bool {
    m.gates.stale(now_ns(), STALE_NS.load(Relaxed))
}

/// Maps the gate file if it is a valid, fresh file other than `current`'s.
pub(super) fn map_gate_file(current: Option<&Mapping>) -> Option<&'static Mapping> {
    let path = GATE_PATH.get()?;
    // SAFETY: a valid C path; read-only, never following a symlink.
    let fd = unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK,
        )
    };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` is ours; fstat into a zeroed struct; mmap of a regular file at least a
    // gate file long; closed once.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        let ok = libc::fstat(fd, &mut st) == 0
            && (st.st_mode & libc::S_IFMT) == libc::S_IFREG
            && st.st_size >= GATE_FILE_SIZE as libc::off_t
            && current.is_none_or(|c| c.dev != st.st_dev || c.ino != st.st_ino);
        let base = if ok {
            libc::mmap(
                std::ptr::null_mut(),
                GATE_FILE_SIZE,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd,
                0,
            )
        } else {
            libc::MAP_FAILED
        };
        libc::close(fd);
        if base == libc::MAP_FAILED {
            return None;
        }
        let gates = Gates::from_raw(base as *const u8);
        if gates.stale(now_ns(), STALE_NS.load(Relaxed)) {
            libc::munmap(base, GATE_FILE_SIZE);
            return None;
        }
        // The agent's file, truncated under us, must not kill the process.
        crate::guard::register(base as usize);
        let m = Box::leak(Box::new(Mapping {
            gates,
            epoch: MAPPINGS.fetch_add(1, Relaxed) + 1,
            dev: st.st_dev,
            ino: st.st_ino,
        }));
        MAPPING.store(m, Release);
        Some(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use coloc_doorbell::file::{create_mapped, Place};
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;

    /// Writes a gate file at `path` with heartbeat `beat` (replacing any).
    fn agent_file(path: &std::path::Path, beat: u64) {
        let tmp = path.with_extension("tmp");
        let b = create_mapped(&tmp, path, GATE_FILE_SIZE, Place::Replace, |b| {
            // SAFETY: a fresh read-write mapping of a gate file's size.
            unsafe { Gates::from_raw(b.as_ptr()) }.init(1, beat)
        })
        .unwrap();
        // SAFETY: the mapping just made, unmapped once.
        unsafe { libc::munmap(b.as_ptr().cast(), GATE_FILE_SIZE) };
    }

    /// The only test that sets the gate file's path.
    #[test]
    fn a_fresh_file_is_mapped_once_and_a_new_one_replaces_it() {
        // Removed when dropped, passing or failing.
        let dir = tempfile::Builder::new()
            .prefix("coloc-shim-map-")
            .tempdir()
            .unwrap();
        let path = dir.path().join("gates");
        GATE_PATH
            .set(CString::new(path.as_os_str().as_bytes()).unwrap())
            .unwrap();
        assert!(map_gate_file(None).is_none(), "no file");
        std::fs::write(&path, b"short").unwrap();
        assert!(map_gate_file(None).is_none(), "shorter than a gate file");
        agent_file(&path, now_ns() - 10 * STALE_NS.load(Relaxed));
        assert!(map_gate_file(None).is_none(), "a stale heartbeat");
        agent_file(&path, now_ns());
        let first = map_gate_file(None).expect("a fresh file");
        assert!(std::ptr::eq(mapping().unwrap(), first));
        assert!(!stale(first));
        assert!(map_gate_file(Some(first)).is_none(), "the same file again");
        agent_file(&path, now_ns());
        let second = map_gate_file(Some(first)).expect("a restarted agent's file");
        assert_eq!(second.epoch, first.epoch + 1);
        assert!(std::ptr::eq(mapping().unwrap(), second));
    }
}
