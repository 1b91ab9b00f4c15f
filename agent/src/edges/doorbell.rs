//! Doorbell pages: the launch times that `libcoloc_cuda.so` writes in online processes,
//! and the loop's sleep, which a launch cuts short.
//!
//! ```text
//!  <dir>/<pid>-<nonce>.bell              standalone: a page of process <pid>
//!  <dir>/pods/<pod-uid>/<pid>-<nonce>.bell  Kubernetes: a page of pod <pod-uid>
//!     │ inotify (new, closed, gone) ─► rescan ─► map read-only, check the layout
//!     │ futex_waitv on every page's wake word (+ our own word for inotify and stop)
//!     ▼
//!  read(): (page, GPU UUID, last launch, run start) for the loop to attribute
//! ```
//!
//! This module decides nothing about trust: it reports where a page lies (its claimed
//! owner), the page file's owner UID, and what the page says, bounds-checked. The loop
//! attributes a page only to a process it already classifies as online (see
//! `control::bells`). Pages are mapped read-only: nothing a tenant writes can make the
//! agent write anywhere.

use coloc_doorbell::{Page, Reading, PAGE, SUFFIX};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering::*};
use std::sync::Arc;
use std::time::Duration;
use tracing::{debug, info, warn};

/// Who a page says it belongs to, from where it lies.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Owner {
    /// Standalone: the process with this PID (from the file name).
    Pid(u32),
    /// Kubernetes: the pod with this UID (from the directory name).
    Pod(String),
}

/// A mapped page, as the loop sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageInfo {
    /// Stable id while mapped.
    pub id: u64,
    /// Where it lies.
    pub path: PathBuf,
    /// Claimed owner.
    pub owner: Owner,
    /// UID owning the file.
    pub file_uid: u32,
    /// The writer's wake gap, ns.
    pub wake_gap_ns: u64,
}

/// One reading of one page entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BellReading {
    /// [`PageInfo::id`].
    pub page: u64,
    /// The entry.
    pub reading: Reading,
}

/// Source of doorbell readings and the loop's sleep.
pub trait Doorbells: Send {
    /// Picks up new pages and drops vanished ones when something changed (or when
    /// `force`); returns true when the set changed.
    fn rescan(&mut self, force: bool) -> bool;
    /// Pages mapped now.
    fn pages(&self) -> Vec<PageInfo>;
    /// Appends every mapped page's entries. Also notes each page's wake word (and the
    /// waker's) before reading it: [`Doorbells::wait`] returns at once if any changed
    /// since, so a run that starts while the loop works on the readings is never missed.
    fn read(&mut self, out: &mut Vec<BellReading>);
    /// Sleeps for at most `timeout`; returns early (true) when a launch starts a run on a
    /// mapped page (after the latest [`Doorbells::read`]), a page appears or goes, or
    /// [`Doorbells::waker`] is woken.
    fn wait(&mut self, timeout: Duration) -> bool;
    /// A handle that cuts the current or next [`Doorbells::wait`] short (shutdown).
    fn waker(&self) -> Waker;
}

/// Wakes a waiting loop from another thread.
#[derive(Debug, Clone, Default)]
pub struct Waker(Arc<AtomicU32>);

impl Waker {
    /// Cuts the loop's sleep short.
    pub fn wake(&self) {
        self.0.fetch_add(1, Release);
        coloc_doorbell::futex_wake(&self.0);
    }
}

/// No doorbells (`--no-doorbells`): a plain sleep, cut short only by the waker.
#[derive(Debug, Default)]
pub struct NoBells {
    waker: Waker,
    seen: u32,
}

impl Doorbells for NoBells {
    fn rescan(&mut self, _force: bool) -> bool {
        false
    }
    fn pages(&self) -> Vec<PageInfo> {
        Vec::new()
    }
    fn read(&mut self, _out: &mut Vec<BellReading>) {
        self.seen = self.waker.0.load(Acquire);
    }
    fn wait(&mut self, timeout: Duration) -> bool {
        waitv(&[(&self.waker.0, self.seen)], timeout).unwrap_or_else(|| {
            std::thread::sleep(timeout);
            false
        })
    }
    fn waker(&self) -> Waker {
        self.waker.clone()
    }
}

struct Mapped {
    info: PageInfo,
    base: *mut libc::c_void,
    /// The wake word as of the latest read.
    seen: u32,
}

// SAFETY: the mapping is read-only shared memory accessed only through atomics; it is
// unmapped once, on drop, by whoever owns the `Mapped`.
unsafe impl Send for Mapped {}

impl Mapped {
    fn page(&self) -> Page<'_> {
        // SAFETY: `base` is a live PROT_READ mapping of PAGE bytes; `Page` only loads
        // through atomics (the agent never calls the writer-side methods on it).
        unsafe { Page::from_raw(self.base.cast()) }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unmapped once.
        unsafe { libc::munmap(self.base, PAGE) };
    }
}

/// Pages under a directory, watched with inotify.
pub struct DirBells {
    dir: PathBuf,
    pages: HashMap<PathBuf, Mapped>,
    /// Files seen that are not (yet) valid pages, with the reason (logged once).
    rejected: HashMap<PathBuf, String>,
    next_id: u64,
    /// Bumped by the inotify thread and by [`Waker`]s.
    waker: Waker,
    /// The inotify thread saw a change since the latest rescan.
    dirty: Arc<AtomicU32>,
    /// `futex_waitv` is missing (Linux < 5.16): the loop polls instead.
    no_waitv: bool,
    /// Some file was not a valid page yet: look again at the next rescan.
    incomplete: bool,
    /// The waker's word as of the latest read.
    waker_seen: u32,
}

impl std::fmt::Debug for DirBells {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirBells")
            .field("dir", &self.dir)
            .field("pages", &self.pages.len())
            .finish_non_exhaustive()
    }
}

impl DirBells {
    /// Watches `dir` (created, mode 1777 — any user's process may add its page, none may
    /// remove another's — with `pods/` inside, if missing).
    pub fn new(dir: &Path) -> anyhow::Result<DirBells> {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        for d in [dir.to_path_buf(), dir.join("pods")] {
            if !d.exists() {
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o1777)
                    .create(&d)
                    .map_err(|e| anyhow::anyhow!("creating --doorbell-dir {}: {e}", d.display()))?;
                // The umask may have cut the mode.
                std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o1777)).ok();
            }
        }
        let waker = Waker::default();
        let dirty = Arc::new(AtomicU32::new(1));
        let watcher = Watcher::spawn(dir, waker.clone(), dirty.clone());
        if let Err(err) = &watcher {
            warn!(%err, dir = %dir.display(), "Cannot watch the doorbell directory: new pages are found every second instead of at once");
        }
        Ok(DirBells {
            dir: dir.to_path_buf(),
            pages: HashMap::new(),
            rejected: HashMap::new(),
            next_id: 1,
            waker,
            dirty,
            no_waitv: false,
            incomplete: false,
            waker_seen: 0,
        })
    }

    fn candidates(&self) -> Vec<(PathBuf, Owner)> {
        let mut out = Vec::new();
        let bells = |d: &Path| -> Vec<PathBuf> {
            std::fs::read_dir(d)
                .map(|rd| {
                    rd.flatten()
                        .map(|e| e.path())
                        .filter(|p| p.to_str().is_some_and(|s| s.ends_with(SUFFIX)))
                        .collect()
                })
                .unwrap_or_default()
        };
        for p in bells(&self.dir) {
            let pid = p
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.split(['-', '.']).next())
                .and_then(|n| n.parse::<u32>().ok());
            if let Some(pid) = pid {
                // A process killed before it could remove its page: remove it for it.
                if !Path::new(&format!("/proc/{pid}")).exists() {
                    if std::fs::remove_file(&p).is_ok() {
                        debug!(page = %p.display(), pid, "Removed the doorbell page of an exited process");
                    }
                    continue;
                }
                out.push((p, Owner::Pid(pid)));
            }
        }
        if let Ok(rd) = std::fs::read_dir(self.dir.join("pods")) {
            for pod in rd.flatten() {
                let Some(uid) = pod.file_name().to_str().map(str::to_string) else {
                    continue;
                };
                if !is_pod_uid(&uid) {
                    continue;
                }
                for p in bells(&pod.path()) {
                    out.push((p, Owner::Pod(uid.clone())));
                }
            }
        }
        out
    }

    fn map(&mut self, path: &Path, owner: Owner) -> Result<Mapped, String> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| format!("open: {e}"))?;
        let md = f.metadata().map_err(|e| format!("stat: {e}"))?;
        if !md.file_type().is_file() {
            return Err("not a regular file".into());
        }
        if md.len() < PAGE as u64 {
            return Err(format!("{} bytes, a page is {PAGE}", md.len()));
        }
        // SAFETY: mapping PAGE bytes of a regular file at least that long, read-only and
        // shared; the fd may be closed afterwards.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PAGE,
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(format!("mmap: {}", std::io::Error::last_os_error()));
        }
        let mut m = Mapped {
            info: PageInfo {
                id: 0,
                path: path.to_path_buf(),
                owner,
                file_uid: md.uid(),
                wake_gap_ns: 0,
            },
            base,
            seen: 0,
        };
        if !m.page().valid() {
            return Err("not a doorbell page of this version (yet)".into());
        }
        m.info.wake_gap_ns = m.page().wake_gap_ns();
        m.info.id = self.next_id;
        self.next_id += 1;
        Ok(m)
    }
}

use std::os::unix::fs::OpenOptionsExt;

/// Kubernetes pod UIDs are RFC 4122 strings; anything else under `pods/` is ignored.
fn is_pod_uid(s: &str) -> bool {
    s.len() == 36 && s.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
}

impl Doorbells for DirBells {
    fn rescan(&mut self, force: bool) -> bool {
        if self.dirty.swap(0, AcqRel) == 0 && !force && !self.incomplete {
            return false;
        }
        self.incomplete = false;
        let found = self.candidates();
        let mut changed = false;
        let live: std::collections::HashSet<&PathBuf> = found.iter().map(|(p, _)| p).collect();
        let before = self.pages.len();
        self.pages.retain(|p, _| live.contains(p));
        self.rejected.retain(|p, _| live.contains(p));
        changed |= self.pages.len() != before;
        for (path, owner) in found {
            if self.pages.contains_key(&path) {
                continue;
            }
            match self.map(&path, owner) {
                Ok(m) => {
                    info!(page = %path.display(), owner = ?m.info.owner, uid = m.info.file_uid, "Doorbell page found");
                    self.rejected.remove(&path);
                    self.pages.insert(path, m);
                    changed = true;
                }
                Err(why) => {
                    if self.rejected.insert(path.clone(), why.clone()).as_ref() != Some(&why) {
                        debug!(page = %path.display(), %why, "Not a usable doorbell page");
                    }
                    // Still being written: look again at the next rescan.
                    self.incomplete = true;
                }
            }
        }
        metrics::gauge!("coloc_doorbell_pages").set(self.pages.len() as f64);
        changed
    }

    fn pages(&self) -> Vec<PageInfo> {
        self.pages.values().map(|m| m.info.clone()).collect()
    }

    fn read(&mut self, out: &mut Vec<BellReading>) {
        self.waker_seen = self.waker.0.load(Acquire);
        let mut tmp = Vec::with_capacity(coloc_doorbell::MAX_GPUS);
        for m in self.pages.values_mut() {
            tmp.clear();
            // The word first: a run that starts after this load bumps it, and the wait
            // that follows returns at once.
            m.seen = m.page().header().wake.load(Acquire);
            m.page().read(&mut tmp);
            out.extend(tmp.iter().map(|r| BellReading {
                page: m.info.id,
                reading: *r,
            }));
        }
    }

    fn wait(&mut self, timeout: Duration) -> bool {
        // A change the watcher saw since the latest rescan: rescan now.
        if self.dirty.load(Acquire) != 0 {
            return true;
        }
        // The values seen by the latest read: a run started since then has changed its
        // word, and the wait returns at once (no lost wake-up).
        let mut words: Vec<(&AtomicU32, u32)> = Vec::with_capacity(self.pages.len() + 1);
        words.push((&self.waker.0, self.waker_seen));
        for m in self.pages.values().take(MAX_WAITERS - 1) {
            words.push((&m.page().header().wake, m.seen));
        }
        // Pages beyond futex_waitv's 128, or a file not yet a complete page: look again soon.
        let polled = self.pages.len() >= MAX_WAITERS || self.incomplete;
        let timeout = if polled || self.no_waitv {
            // Pages beyond futex_waitv's 128 (or an old kernel): read at least every ms.
            timeout.min(Duration::from_millis(1))
        } else {
            timeout
        };
        if !self.no_waitv {
            match waitv(&words, timeout) {
                Some(woken) => return woken,
                None => {
                    warn!("futex_waitv is not available (Linux < 5.16): doorbells are polled every millisecond");
                    self.no_waitv = true;
                }
            }
        }
        std::thread::sleep(timeout);
        false
    }

    fn waker(&self) -> Waker {
        self.waker.clone()
    }
}

/// `futex_waitv` takes at most this many words.
const MAX_WAITERS: usize = 128;

#[repr(C)]
struct FutexWaitv {
    val: u64,
    uaddr: u64,
    flags: u32,
    reserved: u32,
}

/// Waits until one of `words` differs from its expected value, a wake, or `timeout`.
/// `Some(true)`: woken; `Some(false)`: timed out; `None`: `futex_waitv` does not exist.
fn waitv(words: &[(&AtomicU32, u32)], timeout: Duration) -> Option<bool> {
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
struct Watcher;

impl Watcher {
    fn spawn(dir: &Path, waker: Waker, dirty: Arc<AtomicU32>) -> std::io::Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn write_page(path: &Path, uuid: [u8; 16], at: u64) -> memmap_page::Owned {
        memmap_page::Owned::create(path, uuid, at)
    }

    /// A writer-side page in a test (what the shim does, minus CUDA).
    mod memmap_page {
        use super::*;
        pub struct Owned(*mut libc::c_void);
        impl Owned {
            pub fn create(path: &Path, uuid: [u8; 16], at: u64) -> Owned {
                let f = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create_new(true)
                    .open(path)
                    .unwrap();
                f.set_len(PAGE as u64).unwrap();
                // SAFETY: a fresh shared RW mapping of a page-long file.
                let base = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        PAGE,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_SHARED,
                        f.as_raw_fd(),
                        0,
                    )
                };
                assert_ne!(base, libc::MAP_FAILED);
                let o = Owned(base);
                let p = o.page();
                p.init(std::process::id(), 0, at);
                let e = p.entry_for(&uuid).unwrap();
                p.ring(e, at, coloc_doorbell::DEFAULT_WAKE_GAP_NS);
                o
            }
            pub fn page(&self) -> Page<'_> {
                // SAFETY: our own live mapping.
                unsafe { Page::from_raw(self.0.cast()) }
            }
        }
        impl Drop for Owned {
            fn drop(&mut self) {
                // SAFETY: our own mapping.
                unsafe { libc::munmap(self.0, PAGE) };
            }
        }
    }

    fn tmpdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("coloc-bells-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn pages_are_found_read_and_a_run_start_wakes_the_wait() {
        let dir = tmpdir("wake");
        let mut b = DirBells::new(&dir).unwrap();
        assert!(!b.rescan(true));
        let me = std::process::id();
        let w = write_page(&dir.join(format!("{me}-1.bell")), [5; 16], 1_000);
        let pod = "0b7f7c1e-8d52-4c4a-9b0e-2f0b1d6c5a11";
        std::fs::create_dir_all(dir.join("pods").join(pod)).unwrap();
        let _p = write_page(&dir.join("pods").join(pod).join("7-2.bell"), [6; 16], 2_000);
        std::fs::write(dir.join("junk.bell"), b"short").unwrap();
        // A page left by a process that no longer exists is removed.
        let dead = dir.join(format!("{}-3.bell", u32::MAX - 1));
        std::fs::write(&dead, [0u8; PAGE]).unwrap();
        assert!(b.rescan(true));
        let mut pages = b.pages();
        pages.sort_by_key(|p| p.id);
        let owners: Vec<_> = pages.iter().map(|p| p.owner.clone()).collect();
        assert!(owners.contains(&Owner::Pid(me)), "{owners:?}");
        assert!(owners.contains(&Owner::Pod(pod.into())), "{owners:?}");
        assert_eq!(pages.len(), 2, "the short file is not a page");
        assert!(!dead.exists(), "the dead process's page was removed");
        let mut r = Vec::new();
        b.read(&mut r);
        assert_eq!(r.len(), 2);
        // The watcher's events for the writes above arrive asynchronously: once they are
        // consumed and nothing rings, a wait lasts its timeout.
        let mut quiet = false;
        for _ in 0..20 {
            let t = std::time::Instant::now();
            if !b.wait(Duration::from_millis(30)) {
                assert!(t.elapsed() >= Duration::from_millis(29));
                quiet = true;
                break;
            }
            // As the loop does every tick: rescan and read (noting the wake words).
            b.rescan(false);
            b.read(&mut Vec::new());
        }
        assert!(quiet, "the wait never timed out");
        // A launch that starts a run, from another thread, cuts the wait short.
        let page = w.page();
        let ring = std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                let e = page.entry_for(&[5; 16]).unwrap();
                let now = coloc_doorbell::now_ns();
                assert!(page.ring(e, now, 1));
                page.wake();
            });
            let t = std::time::Instant::now();
            let woken = b.wait(Duration::from_secs(5));
            (woken, t.elapsed())
        });
        assert!(ring.0, "woken by the ring");
        assert!(ring.1 < Duration::from_secs(1), "woke after {:?}", ring.1);
        // A run that starts after the loop read the pages but before it sleeps (while it
        // works on the readings) still cuts the sleep short: no lost wake-up.
        r.clear();
        b.read(&mut r);
        let e = page.entry_for(&[5; 16]).unwrap();
        assert!(page.ring(e, coloc_doorbell::now_ns() + 10_000_000_000, 1));
        page.wake();
        let t = std::time::Instant::now();
        assert!(
            b.wait(Duration::from_secs(5)),
            "the run between read and wait was missed"
        );
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_new_page_wakes_the_wait_through_inotify() {
        let dir = tmpdir("inotify");
        let mut b = DirBells::new(&dir).unwrap();
        b.rescan(true);
        let path = dir.join(format!("{}-9.bell", std::process::id()));
        let woken = std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                let o = write_page(&path, [1; 16], 5);
                std::mem::forget(o);
            });
            b.wait(Duration::from_secs(5))
        });
        assert!(woken);
        // The file may be seen before it is a valid page; a second rescan settles it.
        let mut found = false;
        for _ in 0..50 {
            b.rescan(false);
            if !b.pages().is_empty() {
                found = true;
                break;
            }
            b.wait(Duration::from_millis(10));
        }
        assert!(found, "the new page was mapped");
        // As the loop does every tick: read (noting the wake words), then sleep.
        b.read(&mut Vec::new());
        std::fs::remove_file(&path).unwrap();
        let mut gone = false;
        for _ in 0..50 {
            assert!(b.wait(Duration::from_secs(5)), "a removal wakes too");
            if b.rescan(false) {
                gone = true;
                break;
            }
            b.read(&mut Vec::new());
        }
        assert!(gone, "the removal was seen");
        assert!(b.pages().is_empty());
        std::fs::remove_dir_all(&dir).ok();
    }
}
