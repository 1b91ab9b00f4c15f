//! The doorbell page: set up on the first submission, rung on every one after (online).
//!
//! Modes: *unset* (nothing decided yet), *on* (online process with a doorbell page),
//! *open* (offline process with a page, gate not in force: pass-through), *gated*
//! (offline process, gate file mapped: see [`crate::gate`]), *off* (any other class, no
//! `COLOC_DOORBELL_DIR`, a forked child, or an internal failure). The launch path reads
//! the mode once; *off* and *open* cost that load and a branch.

use coloc_doorbell::{Entry, Page, CLASS_OFFLINE, CLASS_ONLINE, DEFAULT_WAKE_GAP_NS, PAGE};
use std::cell::Cell;
use std::ffi::{c_int, c_void, CStr, CString};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering::*};
use std::sync::{Once, OnceLock};

const UNSET: u8 = 0;
/// Online, with a doorbell page.
pub const ON: u8 = 1;
/// Pass-through.
pub const OFF: u8 = 2;
/// Offline with a page; the gate is not in force (no valid, fresh gate file yet).
pub const OPEN: u8 = 3;
/// Offline, gate file mapped: submissions go through [`crate::gate::submit`].
pub const GATED: u8 = 4;

pub(crate) static MODE: AtomicU8 = AtomicU8::new(UNSET);
static INIT: Once = Once::new();
static BASE: AtomicUsize = AtomicUsize::new(0);
static GAP_NS: AtomicU64 = AtomicU64::new(DEFAULT_WAKE_GAP_NS);
static PATH: OnceLock<CString> = OnceLock::new();
/// The driver's `cuStreamIsCapturing` (0: none).
pub(crate) static STREAM_IS_CAPTURING: AtomicUsize = AtomicUsize::new(0);
/// The process that created the page (the only one that removes it at exit).
static CREATOR: AtomicU32 = AtomicU32::new(0);
static FAILED: AtomicBool = AtomicBool::new(false);

type CtxGetCurrent = unsafe extern "C" fn(*mut usize) -> c_int;
type CtxGetDevice = unsafe extern "C" fn(*mut c_int) -> c_int;
type DeviceGetUuid = unsafe extern "C" fn(*mut [u8; 16], c_int) -> c_int;

static CTX_GET_CURRENT: AtomicUsize = AtomicUsize::new(0);
static CTX_GET_DEVICE: AtomicUsize = AtomicUsize::new(0);
static DEVICE_GET_UUID: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// (context, entry address) of this thread's latest launch.
    static CACHE: Cell<(usize, usize)> = const { Cell::new((0, 0)) };
}

/// The mode, deciding it on the first call (Acquire: a thread that sees *on* or *gated*
/// sees the page and the gate state set up before).
#[inline(always)]
pub fn mode() -> u8 {
    match MODE.load(Acquire) {
        UNSET => init_mode(),
        m => m,
    }
}

#[cold]
#[inline(never)]
fn init_mode() -> u8 {
    INIT.call_once(|| {
        let mode = std::panic::catch_unwind(init).unwrap_or(OFF);
        // A fork child or a failure may have turned the shim off meanwhile.
        let _ = MODE.compare_exchange(UNSET, mode, AcqRel, Acquire);
    });
    MODE.load(Acquire)
}

/// Turns the shim into a pass-through for good, with one line on stderr (any internal
/// failure after the start).
pub fn disable(msg: &str) {
    MODE.store(OFF, Release);
    crate::warn_once(&FAILED, &format!("{msg}; passing every call through"));
}

/// The process's page (null before it is created).
pub fn page() -> Option<Page<'static>> {
    let b = BASE.load(Acquire);
    // SAFETY: a non-zero BASE is the live page (never unmapped).
    (b != 0).then(|| unsafe { Page::from_raw(b as *mut u8) })
}

fn fail(msg: &str) -> u8 {
    crate::warn_once(&FAILED, &format!("{msg}; passing every call through"));
    OFF
}

fn init() -> u8 {
    let class = match std::env::var("COLOC_SHIM_CLASS").as_deref() {
        Ok("online") => CLASS_ONLINE,
        Ok("offline") => CLASS_OFFLINE,
        _ => return OFF,
    };
    let Some(dir) = std::env::var_os("COLOC_DOORBELL_DIR") else {
        return OFF;
    };
    if class == CLASS_ONLINE {
        if let Err(e) = wake_gap() {
            return fail(&e);
        }
    }
    if !resolve_helpers() {
        return fail("cannot find cuCtxGetCurrent/cuCtxGetDevice/cuDeviceGetUuid in the driver");
    }
    if class == CLASS_OFFLINE {
        if let Err(e) = crate::gate::configure() {
            return fail(&e);
        }
    }
    if let Err(e) = create_page(std::path::Path::new(&dir), class) {
        return fail(&format!(
            "cannot create a doorbell in {}: {e}",
            std::path::Path::new(&dir).display()
        ));
    }
    if class == CLASS_ONLINE {
        return ON;
    }
    // The gate is in force from the first submission if the agent's file is there.
    let mode = if crate::gate::map_at_start() {
        GATED
    } else {
        OPEN
    };
    match crate::gate::start_watcher() {
        Ok(()) => mode,
        Err(e) => fail(&e),
    }
}

fn wake_gap() -> Result<(), String> {
    if let Ok(v) = std::env::var("COLOC_SHIM_WAKE_GAP_MS") {
        match v.parse::<f64>() {
            Ok(ms) if ms.is_finite() && ms > 0.0 => GAP_NS.store((ms * 1e6) as u64, Relaxed),
            _ => {
                return Err(format!(
                    "COLOC_SHIM_WAKE_GAP_MS={v:?} is not a positive number of milliseconds"
                ))
            }
        }
    }
    Ok(())
}

/// A driver function by base name through the getter we saw (`cudaVersion` 12000, default
/// stream semantics), or else `exported` from the loaded `libcuda.so.1`. Never one of our
/// wrappers: the getter is the driver's own, and the names asked for are not wrapped.
pub fn lookup(base: &CStr, exported: &CStr) -> usize {
    {
        let name = base;
        let g = crate::hooks::ANY_GETTER.load(Acquire);
        if g != 0 {
            type Getter = unsafe extern "C" fn(
                *const std::ffi::c_char,
                *mut *mut c_void,
                c_int,
                u64,
                *mut c_int,
            ) -> c_int;
            let mut p: *mut c_void = std::ptr::null_mut();
            // SAFETY: the driver's own getter; a null status pointer is allowed.
            let r = unsafe {
                std::mem::transmute::<usize, Getter>(g)(
                    name.as_ptr(),
                    &mut p,
                    12000,
                    0,
                    std::ptr::null_mut(),
                )
            };
            if r == 0 && !p.is_null() {
                return p as usize;
            }
        }
    }
    // SAFETY: RTLD_NOLOAD only returns an already loaded library.
    let h = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    let h = if h.is_null() { libc::RTLD_NEXT } else { h };
    crate::dl::real_dlsym(h, exported) as usize
}

/// The driver's helper functions, through the getter we saw, or the loaded `libcuda.so.1`.
fn resolve_helpers() -> bool {
    let cur = lookup(c"cuCtxGetCurrent", c"cuCtxGetCurrent");
    let dev = lookup(c"cuCtxGetDevice", c"cuCtxGetDevice");
    let mut uuid = lookup(c"cuDeviceGetUuid", c"cuDeviceGetUuid_v2");
    if uuid == 0 {
        uuid = lookup(c"cuDeviceGetUuid", c"cuDeviceGetUuid");
    }
    // Optional (CUDA 10.0): without it nothing counts as captured.
    STREAM_IS_CAPTURING.store(
        lookup(c"cuStreamIsCapturing", c"cuStreamIsCapturing"),
        Relaxed,
    );
    CTX_GET_CURRENT.store(cur, Relaxed);
    CTX_GET_DEVICE.store(dev, Relaxed);
    DEVICE_GET_UUID.store(uuid, Relaxed);
    cur != 0 && dev != 0 && uuid != 0
}

fn create_page(dir: &std::path::Path, class: u32) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let pid = std::process::id();
    let nonce = coloc_doorbell::now_ns() ^ ((&MODE as *const _ as u64) << 16);
    let name = format!("{pid}-{nonce:016x}{}", coloc_doorbell::SUFFIX);
    let path = dir.join(&name);
    let cpath = CString::new(path.as_os_str().as_bytes())?;
    // Written under a name the agent ignores, then renamed: the page appears complete,
    // and the rename is the event that tells the agent (a close does not: the mapping
    // keeps the file open, so inotify's IN_CLOSE_WRITE comes only when the process exits).
    let tpath = dir.join(format!("{name}{}", coloc_doorbell::TEMP_SUFFIX));
    let ctpath = CString::new(tpath.as_os_str().as_bytes())?;
    // SAFETY: a valid C path; the flags never follow a symlink and never reuse a file.
    let fd = unsafe {
        libc::open(
            ctpath.as_ptr(),
            libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            0o644,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is ours; fchmod/ftruncate/mmap on it; the mapping outlives the fd.
    let base = unsafe {
        libc::fchmod(fd, 0o644);
        let ok = libc::ftruncate(fd, PAGE as libc::off_t) == 0;
        let base = if ok {
            libc::mmap(
                std::ptr::null_mut(),
                PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        } else {
            libc::MAP_FAILED
        };
        if base == libc::MAP_FAILED {
            let err = std::io::Error::last_os_error();
            libc::close(fd);
            libc::unlink(ctpath.as_ptr());
            return Err(err);
        }
        base
    };
    // SAFETY: a fresh page-sized shared mapping that is never unmapped.
    let page = unsafe { Page::from_raw(base.cast()) };
    page.init_class(pid, class, GAP_NS.load(Relaxed), coloc_doorbell::now_ns());
    // SAFETY: our own fd, closed once (the mapping stays).
    unsafe { libc::close(fd) };
    if let Err(e) = publish(&ctpath, &cpath) {
        // SAFETY: the mapping made above, never handed out; the temporary file, ours.
        unsafe {
            libc::munmap(base, PAGE);
            libc::unlink(ctpath.as_ptr());
        }
        return Err(e);
    }
    BASE.store(base as usize, Release);
    CREATOR.store(pid, Relaxed);
    let _ = PATH.set(cpath);
    // SAFETY: registering plain extern "C" functions.
    unsafe {
        libc::atexit(remove_page);
        libc::pthread_atfork(None, None, Some(after_fork_child));
    }
    Ok(())
}

/// Gives the complete page its name, never replacing a file that has it:
/// `renameat2(RENAME_NOREPLACE)`, or `link` + `unlink` where that is refused for any
/// reason but the name being taken.
fn publish(from: &CStr, to: &CStr) -> std::io::Result<()> {
    // SAFETY: valid C paths; renameat2 with AT_FDCWD and a flag.
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if r == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    // The name is taken: never replace a file. Any other refusal (a filesystem without
    // the flag, a seccomp profile without renameat2): try a link.
    if err.raw_os_error() == Some(libc::EEXIST) {
        return Err(err);
    }
    // SAFETY: valid C paths.
    if unsafe { libc::link(from.as_ptr(), to.as_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a valid C path.
    unsafe { libc::unlink(from.as_ptr()) };
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
    MODE.store(OFF, Relaxed);
}

/// Stamps the launch (online: called when the mode is [`ON`]). `captured()` is asked only
/// of a launch that would start a run: a launch captured into a CUDA graph runs nothing
/// now (its graph's launch rings when it runs), so it starts no run.
#[inline]
pub fn ring(captured: impl FnOnce() -> bool) {
    let cur = CTX_GET_CURRENT.load(Relaxed);
    let mut ctx = 0usize;
    // SAFETY: the driver's cuCtxGetCurrent with a valid out-pointer.
    if unsafe { std::mem::transmute::<usize, CtxGetCurrent>(cur)(&mut ctx) } != 0 || ctx == 0 {
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
    // SAFETY: BASE is the live page (set before MODE became ON); `entry` points into it.
    let page = unsafe { Page::from_raw(BASE.load(Relaxed) as *mut u8) };
    let e = unsafe { &*(entry as *const Entry) };
    if page.ring_unless(e, coloc_doorbell::now_ns(), GAP_NS.load(Relaxed), captured) {
        page.wake();
    }
}

/// The page's entry for the current context's GPU.
fn entry_for_current() -> Option<&'static Entry> {
    page()?.entry_for(&current_uuid()?)
}

/// The current context's GPU UUID (the driver's functions, never our wrappers).
pub fn current_uuid() -> Option<[u8; 16]> {
    let mut dev: c_int = 0;
    let mut uuid = [0u8; 16];
    // SAFETY: the driver's functions with valid out-pointers (resolved before any mode
    // that calls this is set).
    unsafe {
        if std::mem::transmute::<usize, CtxGetDevice>(CTX_GET_DEVICE.load(Relaxed))(&mut dev) != 0 {
            return None;
        }
        if std::mem::transmute::<usize, DeviceGetUuid>(DEVICE_GET_UUID.load(Relaxed))(
            &mut uuid, dev,
        ) != 0
        {
            return None;
        }
    }
    Some(uuid)
}

/// The calling thread's current context (0: none, or the driver failed).
#[inline]
pub fn current_ctx() -> usize {
    let mut ctx = 0usize;
    // SAFETY: the driver's cuCtxGetCurrent (resolved before any mode that calls this is
    // set) with a valid out-pointer.
    let r = unsafe {
        std::mem::transmute::<usize, CtxGetCurrent>(CTX_GET_CURRENT.load(Relaxed))(&mut ctx)
    };
    if r != 0 {
        0
    } else {
        ctx
    }
}
