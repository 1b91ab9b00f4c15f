//! The process's doorbell page (`coloc_doorbell::Page`): created at the first submission
//! in `COLOC_DOORBELL_DIR`, rung on every submission after it in an online process, and
//! where an offline process acknowledges its gate closes ([`crate::gate`]). Removed at
//! exit by the process that created it.

use crate::mode;
use coloc_doorbell::file::{create_mapped, Place};
use coloc_doorbell::{Entry, Page, DEFAULT_WAKE_GAP_NS, PAGE};
use std::cell::Cell;
use std::ffi::CString;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::OnceLock;

static BASE: AtomicUsize = AtomicUsize::new(0);
static GAP_NS: AtomicU64 = AtomicU64::new(DEFAULT_WAKE_GAP_NS);
static PATH: OnceLock<CString> = OnceLock::new();
/// The process that created the page (the only one that removes it at exit).
static CREATOR: AtomicU32 = AtomicU32::new(0);

thread_local! {
    /// (context, entry address) of this thread's latest launch.
    static CACHE: Cell<(usize, usize)> = const { Cell::new((0, 0)) };
}

/// The process's page (null before it is created).
pub fn page() -> Option<Page<'static>> {
    let b = BASE.load(Acquire);
    // SAFETY: a non-zero BASE is the live page (never unmapped).
    (b != 0).then(|| unsafe { Page::from_raw(b as *mut u8) })
}

/// Creates the page of a process of `class` in `dir`, with its wake gap (online).
pub fn create(dir: &std::path::Path, class: u32, wake_gap_ns: u64) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    GAP_NS.store(wake_gap_ns, Relaxed);
    let pid = std::process::id();
    let nonce = coloc_doorbell::now_ns() ^ ((&BASE as *const _ as u64) << 16);
    let name = format!("{pid}-{nonce:016x}{}", coloc_doorbell::SUFFIX);
    let path = dir.join(&name);
    let cpath = CString::new(path.as_os_str().as_bytes())?;
    // Written under a name the agent ignores, then renamed: the page appears complete,
    // and the rename is the event that tells the agent (a close does not: the mapping
    // keeps the file open, so inotify's IN_CLOSE_WRITE comes only when the process exits).
    let tmp = dir.join(format!("{name}{}", coloc_doorbell::TEMP_SUFFIX));
    let base = create_mapped(&tmp, &path, PAGE, Place::NoReplace, |b| {
        // SAFETY: a fresh page-sized shared mapping that is never unmapped.
        let page = unsafe { Page::from_raw(b.as_ptr()) };
        page.init_class(pid, class, wake_gap_ns, coloc_doorbell::now_ns());
    })
    .map_err(|e| e.err)?;
    // A page truncated under us must not kill the process (see `guard`).
    crate::guard::register(base.as_ptr() as usize);
    BASE.store(base.as_ptr() as usize, Release);
    CREATOR.store(pid, Relaxed);
    let _ = PATH.set(cpath);
    // SAFETY: registering plain extern "C" functions.
    unsafe {
        libc::atexit(remove_page);
        libc::pthread_atfork(None, None, Some(after_fork_child));
    }
    Ok(())
}

extern "C" fn remove_page() {
    // A forked child inherits this handler: the page is its parent's, which lives on.
    if CREATOR.load(Relaxed) != std::process::id() {
        return;
    }
    if let Some(p) = PATH.get() {
        // SAFETY: a valid C path.
        unsafe { libc::unlink(p.as_ptr()) };
    }
}

/// A forked child is another process: it must not ring its parent's page.
extern "C" fn after_fork_child() {
    mode::MODE.store(mode::OFF, Relaxed);
}

/// Stamps the launch (online: called when the mode is *on*). `captured()` is asked only
/// of a launch that would start a run: a launch captured into a CUDA graph runs nothing
/// now (its graph's launch rings when it runs), so it starts no run.
#[inline]
pub fn ring(captured: impl FnOnce() -> bool) {
    let ctx = crate::driver::current_ctx();
    if ctx == 0 {
        return;
    }
    let (cached_ctx, cached) = CACHE.with(|c| c.get());
    let entry = if cached_ctx == ctx {
        cached
    } else {
        let e = entry_for_current().map_or(0, |e| e as *const Entry as usize);
        CACHE.with(|c| c.set((ctx, e)));
        e
    };
    if entry == 0 {
        return;
    }
    // SAFETY: BASE is the live page (set before the mode became on); `entry` points into
    // it.
    let page = unsafe { Page::from_raw(BASE.load(Relaxed) as *mut u8) };
    let e = unsafe { &*(entry as *const Entry) };
    if page.ring_unless(e, coloc_doorbell::now_ns(), GAP_NS.load(Relaxed), captured) {
        page.wake();
    }
}

/// The page's entry for the current context's GPU.
fn entry_for_current() -> Option<&'static Entry> {
    page()?.entry_for(&crate::driver::current_uuid()?)
}
