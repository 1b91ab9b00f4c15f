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

/// Most pod directories the inotify thread watches (inotify watches are a per-user budget
/// shared with the kubelet and the container runtime). Pages in pod directories beyond it
/// are found by the once-a-second rescan.
pub(super) const MAX_WATCHED_PODS: usize = 1024;
/// A pod directory whose events come faster than this (per second) is no longer watched:
/// its pages are then found by the once-a-second rescan, and its churn costs the agent
/// nothing in between.
pub(super) const MAX_POD_EVENTS_PER_SECOND: u32 = 1000;

/// Where a change happened.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) enum Scope {
    /// The top directory (standalone pages).
    Top,
    /// `pods/<uid>`.
    Pod(String),
}

/// What the inotify thread saw since the loop last looked: which directories changed.
/// A directory already marked wakes nobody again, and one the loop has muted (it is
/// waiting its turn to be rescanned) stays marked until then: a directory changing in a
/// loop wakes the loop once per rescan, not once per change.
#[derive(Debug, Default)]
pub(super) struct Dirty {
    /// Something new changed: the loop's wait returns at once.
    pub(super) any: AtomicU32,
    /// Marked directories; true: muted.
    scopes: std::sync::Mutex<std::collections::HashMap<Scope, bool>>,
    /// Pod directories no longer watched because they changed too fast, since the start.
    pub(super) throttled: AtomicU32,
}

impl Dirty {
    /// Marks `scope`; true when the loop should be woken (it was not marked).
    pub(super) fn mark(&self, scope: Scope) -> bool {
        let mut s = self.scopes.lock().unwrap_or_else(|e| e.into_inner());
        if s.contains_key(&scope) {
            return false;
        }
        s.insert(scope, false);
        self.any.store(1, Release);
        true
    }

    /// The marked directories that are not muted (unmarked now).
    pub(super) fn take(&self) -> Vec<Scope> {
        let mut s = self.scopes.lock().unwrap_or_else(|e| e.into_inner());
        self.any.store(0, Release);
        let out: Vec<Scope> = s
            .iter()
            .filter(|(_, m)| !**m)
            .map(|(k, _)| k.clone())
            .collect();
        for k in &out {
            s.remove(k);
        }
        out
    }

    /// Keeps `scope` marked without waking anyone until [`Dirty::unmute`].
    pub(super) fn mute(&self, scope: Scope) {
        self.scopes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(scope, true);
    }

    /// Unmarks a muted `scope` (it is about to be rescanned): its next change wakes again.
    pub(super) fn unmute(&self, scope: &Scope) {
        self.scopes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(scope);
    }
}

/// A pod directory the agent reads: a real directory (not a link), named like a pod UID,
/// owned by root (the kubelet creates them) or by the agent's own user.
pub(super) fn trusted_pod_dir(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid cannot fail.
    let me = unsafe { libc::geteuid() };
    std::fs::symlink_metadata(path)
        .is_ok_and(|m| m.file_type().is_dir() && (m.uid() == 0 || m.uid() == me))
}

/// The inotify thread: marks the directory that changed dirty and wakes the loop. Watches
/// the top directory, `pods/`, and each trusted pod directory (at most
/// [`MAX_WATCHED_PODS`]), without following links and only on directories.
pub(super) struct Watcher;

impl Watcher {
    pub(super) fn spawn(dir: &Path, waker: Waker, dirty: Arc<Dirty>) -> std::io::Result<()> {
        // SAFETY: inotify_init1 returns a new fd or -1.
        let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // No IN_CLOSE_WRITE: a page is published by a rename, and rewriting a file in a
        // loop must not wake anyone.
        let mask = libc::IN_MOVED_TO
            | libc::IN_DELETE
            | libc::IN_MOVED_FROM
            | libc::IN_CREATE
            | libc::IN_ONLYDIR
            | libc::IN_DONT_FOLLOW;
        let raw = fd.as_raw_fd();
        let add = move |p: &Path| -> std::io::Result<i32> {
            use std::os::unix::ffi::OsStrExt;
            let c = std::ffi::CString::new(p.as_os_str().as_bytes())?;
            // SAFETY: a valid inotify fd (kept open by the thread) and C path.
            let r = unsafe { libc::inotify_add_watch(raw, c.as_ptr(), mask) };
            if r < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(r)
        };
        let top = add(dir)?;
        let pods = dir.join("pods");
        let pods_wd = add(&pods)?;
        // Watch descriptor -> pod UID.
        let mut watched: std::collections::HashMap<i32, String> = Default::default();
        // Per watched pod directory: the second its events are counted in, and how many.
        let mut rate: std::collections::HashMap<i32, (u64, u32)> = Default::default();
        // Pod directories no longer watched because they changed too fast (never again).
        let mut throttled: std::collections::HashSet<String> = Default::default();
        let watch_pod = move |watched: &mut std::collections::HashMap<i32, String>, uid: &str| {
            if watched.len() >= MAX_WATCHED_PODS || !super::dir::is_pod_dir_name(uid) {
                return false;
            }
            let path = pods.join(uid);
            if !trusted_pod_dir(&path) {
                return false;
            }
            match add(&path) {
                Ok(wd) => {
                    watched.insert(wd, uid.to_string());
                    true
                }
                Err(_) => false,
            }
        };
        if let Ok(rd) = std::fs::read_dir(dir.join("pods")) {
            for e in rd.flatten() {
                if let Some(uid) = e.file_name().to_str() {
                    watch_pod(&mut watched, uid);
                }
            }
        }
        std::thread::Builder::new()
            .name("coloc-doorbells".into())
            .spawn(move || {
                // Aligned for `inotify_event`.
                let mut buf = vec![0u64; 512];
                loop {
                    // SAFETY: reading into a buffer we own.
                    let n = unsafe {
                        libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len() * 8)
                    };
                    if n <= 0 {
                        if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
                        {
                            continue;
                        }
                        return;
                    }
                    // SAFETY: the kernel wrote `n` bytes of whole events into `buf`.
                    let bytes = unsafe {
                        std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), n as usize)
                    };
                    let mut off = 0;
                    let mut wake = false;
                    let head = std::mem::size_of::<libc::inotify_event>();
                    while off + head <= bytes.len() {
                        // SAFETY: a whole event header lies at `off` (the kernel writes whole
                        // events); read unaligned to be safe.
                        let ev: libc::inotify_event =
                            unsafe { std::ptr::read_unaligned(bytes[off..].as_ptr().cast()) };
                        let name_bytes =
                            &bytes[off + head..(off + head + ev.len as usize).min(bytes.len())];
                        let name = std::str::from_utf8(name_bytes)
                            .unwrap_or("")
                            .trim_end_matches('\0');
                        off += head + ev.len as usize;
                        if ev.mask & libc::IN_Q_OVERFLOW != 0 {
                            // Events were lost: everything is rescanned (the forced rescan
                            // once a second also does it).
                            wake |= dirty.mark(Scope::Top);
                            for uid in watched.values() {
                                wake |= dirty.mark(Scope::Pod(uid.clone()));
                            }
                        } else if ev.wd == top {
                            wake |= dirty.mark(Scope::Top);
                        } else if ev.wd == pods_wd {
                            // A new pod directory: watch it (its pages arrive after it).
                            if ev.mask & (libc::IN_CREATE | libc::IN_MOVED_TO) != 0
                                && ev.mask & libc::IN_ISDIR != 0
                                && !throttled.contains(name)
                                && watch_pod(&mut watched, name)
                            {
                                wake |= dirty.mark(Scope::Pod(name.to_string()));
                            }
                        } else if ev.mask & libc::IN_IGNORED != 0 {
                            // Removed (the directory is gone, or it changed too fast).
                            rate.remove(&ev.wd);
                            watched.remove(&ev.wd);
                        } else if let Some(uid) = watched.get(&ev.wd) {
                            wake |= dirty.mark(Scope::Pod(uid.clone()));
                            let sec = super::now_sec();
                            let r = rate.entry(ev.wd).or_insert((sec, 0));
                            if r.0 != sec {
                                *r = (sec, 0);
                            }
                            r.1 += 1;
                            if r.1 > MAX_POD_EVENTS_PER_SECOND {
                                tracing::warn!(pod_uid = %uid, events_per_second = MAX_POD_EVENTS_PER_SECOND,
                                    "Doorbell directory changing too fast: no longer watched, its pages are found by the once-a-second rescan");
                                throttled.insert(uid.clone());
                                dirty.throttled.fetch_add(1, Release);
                                // SAFETY: a watch descriptor of our inotify fd.
                                unsafe { libc::inotify_rm_watch(fd.as_raw_fd(), ev.wd) };
                                rate.remove(&ev.wd);
                            }
                        }
                    }
                    if wake {
                        waker.wake();
                    }
                }
            })?;
        Ok(())
    }
}
