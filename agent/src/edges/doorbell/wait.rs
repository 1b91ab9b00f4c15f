//! The loop's sleep on every page's wake word (`futex_waitv`), and the inotify thread.

use super::Waker;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering::*};
use std::sync::Arc;
use std::time::Duration;

/// `futex_waitv` takes at most this many words.
pub(super) const MAX_WAITERS: usize = 128;

#[repr(C)]
struct FutexWaitv {
    val: u64,
    uaddr: u64,
    flags: u32,
    reserved: u32,
}

/// Waits until one of `words` differs from its expected value, a wake, or `timeout`.
/// `Some(true)`: woken; `Some(false)`: timed out; `None`: `futex_waitv` does not exist.
pub(super) fn waitv(words: &[(&AtomicU32, u32)], timeout: Duration) -> Option<bool> {
    const SYS_FUTEX_WAITV: libc::c_long = 449; // same number on x86_64 and aarch64
    const FUTEX2_SIZE_U32: u32 = 0x02;
    let v: Vec<FutexWaitv> = words
        .iter()
        .map(|(w, val)| FutexWaitv {
            val: u64::from(*val),
            uaddr: w.as_ptr() as u64,
            flags: FUTEX2_SIZE_U32,
            reserved: 0,
        })
        .collect();
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    let end = now.tv_sec as u128 * 1_000_000_000 + now.tv_nsec as u128 + timeout.as_nanos();
    let ts = libc::timespec {
        tv_sec: (end / 1_000_000_000) as libc::time_t,
        tv_nsec: (end % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: `v` holds addresses of live atomics (mapped pages stay mapped while `words`
    // borrows them); `ts` is a valid absolute CLOCK_MONOTONIC time.
    let r = unsafe {
        libc::syscall(
            SYS_FUTEX_WAITV,
            v.as_ptr(),
            v.len() as libc::c_uint,
            0 as libc::c_uint,
            &ts as *const libc::timespec,
            libc::CLOCK_MONOTONIC,
        )
    };
    if r >= 0 {
        return Some(true);
    }
    match std::io::Error::last_os_error().raw_os_error() {
        Some(libc::ENOSYS) => None,
        Some(libc::ETIMEDOUT) => Some(false),
        // EAGAIN: a word had already changed; EINTR: a signal.
        _ => Some(true),
    }
}

/// The inotify thread: marks the set dirty and wakes the loop on any change.
pub(super) struct Watcher;

impl Watcher {
    pub(super) fn spawn(dir: &Path, waker: Waker, dirty: Arc<AtomicU32>) -> std::io::Result<()> {
        // SAFETY: inotify_init1 returns a new fd or -1.
        let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let mask = libc::IN_CLOSE_WRITE
            | libc::IN_MOVED_TO
            | libc::IN_DELETE
            | libc::IN_MOVED_FROM
            | libc::IN_CREATE;
        let raw = fd.as_raw_fd();
        let add = move |p: &Path| -> std::io::Result<()> {
            use std::os::unix::ffi::OsStrExt;
            let c = std::ffi::CString::new(p.as_os_str().as_bytes())?;
            // SAFETY: a valid inotify fd (kept open by the thread) and C path.
            let r = unsafe { libc::inotify_add_watch(raw, c.as_ptr(), mask) };
            if r < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        };
        add(dir)?;
        let pods = dir.join("pods");
        add(&pods)?;
        if let Ok(rd) = std::fs::read_dir(&pods) {
            for e in rd.flatten() {
                let _ = add(&e.path());
            }
        }
        std::thread::Builder::new()
            .name("coloc-doorbells".into())
            .spawn(move || {
                let mut buf = [0u8; 4096];
                loop {
                    // SAFETY: reading into a buffer we own.
                    let n =
                        unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
                    if n <= 0 {
                        if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
                        {
                            continue;
                        }
                        return;
                    }
                    // A new pod directory: watch it too (its pages arrive after it).
                    let _ = std::fs::read_dir(&pods).map(|rd| {
                        for e in rd.flatten() {
                            let _ = add(&e.path());
                        }
                    });
                    dirty.store(1, Release);
                    waker.wake();
                }
            })?;
        Ok(())
    }
}
