//! The process's doorbell page (`coloc_doorbell::Page`): created at the first submission
//! in `COLOC_DOORBELL_DIR`, rung on every submission after it in an online process (with
//! the thread's record of it, [`crate::threads`]), stamped when the process's work on a
//! GPU was seen complete ([`crate::drain`]), and where an offline process acknowledges its
//! gate closes ([`crate::gate`]). Removed at exit by the process that created it.

use crate::mode;
use crate::threads::Rec;
use coloc_doorbell::file::{create_mapped, Place};
use coloc_doorbell::{Entry, Page, DEFAULT_WAKE_GAP_NS, PAGE};
use std::ffi::CString;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::OnceLock;

static BASE: AtomicUsize = AtomicUsize::new(0);
static GAP_NS: AtomicU64 = AtomicU64::new(DEFAULT_WAKE_GAP_NS);
static PATH: OnceLock<CString> = OnceLock::new();
/// The process that created the page (the only one that removes it at exit).
static CREATOR: AtomicU32 = AtomicU32::new(0);

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

/// Where the calling thread's work goes: its current context, the page's entry for that
/// context's GPU, and the thread's record there ([`crate::threads`]; `None` when no slot
/// was to be had).
#[derive(Debug, Clone, Copy)]
pub struct Here {
    /// The current context.
    pub ctx: usize,
    /// The page's entry for its GPU.
    pub entry: &'static Entry,
    /// The entry's index in the page.
    pub index: usize,
    /// The thread's record of its submissions there.
    pub rec: Option<&'static Rec>,
}

/// Where the calling thread's submission goes (online: the mode is *on*), claiming the
/// GPU's entry and the thread's record at its first: `None` without a current context, or
/// when the page has no room for its GPU.
#[inline(always)]
pub fn here() -> Option<Here> {
    let ctx = crate::driver::current_ctx();
    if ctx == 0 {
        return None;
    }
    let (cached_ctx, entry, rec) = crate::threads::cache();
    let (entry, rec) = if cached_ctx == ctx {
        (entry, rec)
    } else {
        refill(ctx)
    };
    if entry == 0 {
        return None;
    }
    // SAFETY: `entry` points into the live page (never unmapped); `rec`, when not 0, into
    // the static records.
    let entry = unsafe { &*(entry as *const Entry) };
    let rec = (rec != 0).then(|| unsafe { &*(rec as *const Rec) });
    Some(Here {
        ctx,
        entry,
        index: index_of(entry),
        rec,
    })
}

/// Where the calling thread's synchronising call looks (online): its current context and
/// the page's entry for that context's GPU, never claimed (`rec` is the thread's record if
/// its cache has it). `None` without a context, or when the process never submitted to
/// that GPU.
pub fn find() -> Option<Here> {
    let ctx = crate::driver::current_ctx();
    if ctx == 0 {
        return None;
    }
    match crate::threads::cache() {
        (c, entry, rec) if c == ctx && entry != 0 => {
            // SAFETY: as in `here`.
            let entry = unsafe { &*(entry as *const Entry) };
            let rec = (rec != 0).then(|| unsafe { &*(rec as *const Rec) });
            Some(Here {
                ctx,
                entry,
                index: index_of(entry),
                rec,
            })
        }
        _ => {
            let entry = page()?.find(&crate::driver::current_uuid()?)?;
            Some(Here {
                ctx,
                entry,
                index: index_of(entry),
                rec: None,
            })
        }
    }
}

/// The index of entry `e` of the page.
fn index_of(e: &Entry) -> usize {
    (e as *const Entry as usize - BASE.load(Relaxed) - HEADER) / std::mem::size_of::<Entry>()
}

/// Offset of the first entry in the page.
const HEADER: usize = std::mem::size_of::<coloc_doorbell::Header>();

/// The thread's context changed: its entry and record, cached (entry 0: none).
#[cold]
#[inline(never)]
fn refill(ctx: usize) -> (usize, usize) {
    let found = page().and_then(|p| {
        let e = p.entry_for(&crate::driver::current_uuid()?)?;
        Some((e, p.index_of(e)?))
    });
    let Some((e, index)) = found else {
        crate::threads::set_cache((ctx, 0, 0));
        return (0, 0);
    };
    let rec = crate::threads::slot(covered_by_stamp).and_then(|s| crate::threads::rec(index, s));
    if let Some(r) = rec {
        crate::threads::enter_ctx(r, ctx);
    }
    let out = (
        e as *const Entry as usize,
        rec.map_or(0, |r| r as *const Rec as usize),
    );
    crate::threads::set_cache((ctx, out.0, out.1));
    out
}

/// Whether the stamp of entry `index` covers a submission at `t`.
fn covered_by_stamp(index: usize, t: u64) -> bool {
    page()
        .and_then(|p| p.entry(index))
        .is_some_and(|e| e.drained_ns.load(Acquire) >= t)
}

/// Stamps a submission to stream `key` (online: called when the mode is *on*), and marks
/// the thread as inside it until [`rung`] with what this returns. `captured()` is asked
/// only of a launch that would start a run: a launch captured into a CUDA graph runs
/// nothing now (its graph's launch rings when it runs), so it starts no run.
#[inline]
pub fn ring(key: usize, captured: impl FnOnce() -> bool) -> Option<&'static Rec> {
    let h = here()?;
    if let Some(r) = h.rec {
        crate::threads::begin(r);
    }
    // SAFETY: BASE is the live page (set before the mode became on).
    let page = unsafe { Page::from_raw(BASE.load(Relaxed) as *mut u8) };
    let now = coloc_doorbell::now_ns();
    if page.ring_unless(h.entry, now, GAP_NS.load(Relaxed), captured) {
        page.wake();
    }
    if let Some(r) = h.rec {
        crate::threads::note(r, now, key);
    }
    h.rec
}

/// The driver's call for a submission [`ring`] stamped returned.
#[inline(always)]
pub fn rung(rec: Option<&'static Rec>) {
    if let Some(r) = rec {
        crate::threads::end(r);
    }
}
