//! Per-thread records of an online process's submissions, one per thread and GPU: what a
//! synchronising call needs to tell whether it covered all of the process's work on that
//! GPU ([`crate::drain`]).
//!
//! Each record has one writer, its thread, so the launch path keeps it with plain stores
//! (no lost updates between threads launching at once); synchronising calls of any thread
//! read them all. What the launch path adds to the doorbell's stamp:
//!
//! ```text
//!  launch:  busy := 1 (a swap: a full barrier)  ─ clock read, doorbell stamp, record ─
//!           the driver's submission ─ busy := 0
//!  record:  last_ns (the latest submission), key + ctx (its stream and context),
//!           other_stream_ns (the latest one to another stream or context),
//!           other_ctx_ns (the latest one in another context)
//! ```
//!
//! The swap before the clock read is the one atomic read-modify-write per launch: a
//! synchronising call that reads a clock after a launch's clock read, then fences, sees
//! that launch's `busy` (or, once its submission has returned, its stamp). Without it a
//! launch could read the clock before the call's stamp while its `busy` still sat in its
//! CPU's store buffer, and go unseen.
//!
//! Slots: a thread takes one at its first submission ([`NTHREADS`] at once) and gives it
//! up at its exit; a slot whose records still hold work no stamp has covered is kept (its
//! records are still read) until a stamp covers them. A thread that finds no slot turns the
//! stamps off for the process (its work could not be accounted for).

use coloc_doorbell::MAX_GPUS;
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering::*};

/// Threads with a record at once.
pub const NTHREADS: usize = 256;

/// One thread's submissions on one GPU.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct Rec {
    /// 1 from before the clock read of a submission until the driver's call returned.
    pub busy: AtomicU32,
    /// The thread's latest submission on this GPU, ns (`CLOCK_REALTIME`; 0: none).
    pub last_ns: AtomicU64,
    /// Its stream key (`crate::launch::key_of`).
    pub key: AtomicUsize,
    /// The context current at it.
    pub ctx: AtomicUsize,
    /// The thread's latest submission on this GPU to another stream or context than
    /// `key`/`ctx` (0: none).
    pub other_stream_ns: AtomicU64,
    /// The thread's latest submission on this GPU in another context than `ctx` (0: none).
    pub other_ctx_ns: AtomicU64,
}

impl Rec {
    const fn new() -> Rec {
        Rec {
            busy: AtomicU32::new(0),
            last_ns: AtomicU64::new(0),
            key: AtomicUsize::new(0),
            ctx: AtomicUsize::new(0),
            other_stream_ns: AtomicU64::new(0),
            other_ctx_ns: AtomicU64::new(0),
        }
    }

    fn clear(&self) {
        self.last_ns.store(0, Release);
        self.key.store(0, Relaxed);
        self.ctx.store(0, Relaxed);
        self.other_stream_ns.store(0, Relaxed);
        self.other_ctx_ns.store(0, Relaxed);
        self.busy.store(0, Release);
    }
}

/// Records by GPU entry index, then thread slot (a scan for one GPU reads one run).
static RECS: [[Rec; NTHREADS]; MAX_GPUS] = [const { [const { Rec::new() }; NTHREADS] }; MAX_GPUS];

const FREE: u8 = 0;
const LIVE: u8 = 1;
/// Its thread has exited; its records are read until a stamp covers them.
const DEAD: u8 = 2;
const TAKING: u8 = 3;
static STATE: [AtomicU8; NTHREADS] = [const { AtomicU8::new(FREE) }; NTHREADS];
/// One more than the highest slot ever taken (scans stop there).
static HIGH: AtomicUsize = AtomicUsize::new(0);
/// A thread found no slot: no stamp can be trusted any more.
static FULL: AtomicBool = AtomicBool::new(false);
static FULL_WARNED: AtomicBool = AtomicBool::new(false);

const UNKNOWN: u32 = 0;
const NONE: u32 = u32::MAX;
/// The thread gave its slot up (its exit hook ran) and submits again.
const GONE: u32 = u32::MAX - 1;

thread_local! {
    /// This thread's slot + 1 (0: not asked yet; `NONE`: none to be had; `GONE`: given up).
    static SLOT: Cell<u32> = const { Cell::new(UNKNOWN) };
    /// (context, entry address, record address) of this thread's latest submission
    /// (`crate::page`'s cache, kept here so that the exit hook can clear it).
    static CACHE: Cell<(usize, usize, usize)> = const { Cell::new((0, 0, 0)) };
}

/// The calling thread's cache of where its submissions go.
#[inline(always)]
pub fn cache() -> (usize, usize, usize) {
    CACHE.with(|c| c.get())
}

/// Sets the calling thread's cache.
pub fn set_cache(v: (usize, usize, usize)) {
    CACHE.with(|c| c.set(v));
}

/// The exit hook: a POSIX thread-specific key whose destructor gives the slot up (a
/// thread-local with a destructor would need `__cxa_thread_atexit_impl`, newer than the
/// shim's glibc floor).
fn exit_key() -> Option<libc::pthread_key_t> {
    static KEY: std::sync::OnceLock<Option<libc::pthread_key_t>> = std::sync::OnceLock::new();
    *KEY.get_or_init(|| {
        let mut k: libc::pthread_key_t = 0;
        // SAFETY: a valid out-pointer and a plain extern "C" destructor.
        (unsafe { libc::pthread_key_create(&mut k, Some(at_exit)) } == 0).then_some(k)
    })
}

/// Runs in an exiting thread that had a slot (its key's value is not null).
extern "C" fn at_exit(_: *mut std::ffi::c_void) {
    // The thread's record may be another thread's from now on: forget it.
    CACHE.with(|c| c.set((0, 0, 0)));
    let s = SLOT.with(|s| s.replace(GONE));
    if s != UNKNOWN && s != NONE && s != GONE {
        STATE[(s - 1) as usize].store(DEAD, Release);
    }
}

/// This thread's slot, taking one at the first call (`None`: none was free; the stamps are
/// then off). `covered(entry, t)`: whether a stamp on that GPU covers a submission at `t`
/// (an exited thread's slot is taken over only when all its records are covered). A thread
/// that submits after its exit hook ran (from another thread-local's destructor) takes a
/// slot it never gives back.
pub fn slot(covered: impl Fn(usize, u64) -> bool) -> Option<usize> {
    match SLOT.with(|s| s.get()) {
        NONE => None,
        s @ (UNKNOWN | GONE) => {
            let got = take(covered);
            SLOT.with(|c| c.set(got.map_or(NONE, |s| s as u32 + 1)));
            if got.is_some() && s == UNKNOWN {
                // Registers the exit hook; without one the slot is never given back.
                if let Some(k) = exit_key() {
                    // SAFETY: a key of ours; any non-null value makes the destructor run.
                    unsafe {
                        libc::pthread_setspecific(k, std::ptr::dangling::<std::ffi::c_void>())
                    };
                }
            } else if got.is_none() {
                FULL.store(true, SeqCst);
                crate::mode::warn_once(
                    &FULL_WARNED,
                    "more threads submit at once than the shim keeps records for: no completion stamps",
                );
            }
            got
        }
        s => Some((s - 1) as usize),
    }
}

/// This thread's slot if it has one (never takes one).
pub fn own_slot() -> Option<usize> {
    match SLOT.with(|s| s.get()) {
        UNKNOWN | NONE | GONE => None,
        s => Some((s - 1) as usize),
    }
}

fn take(covered: impl Fn(usize, u64) -> bool) -> Option<usize> {
    for (i, st) in STATE.iter().enumerate() {
        if st.compare_exchange(FREE, LIVE, AcqRel, Relaxed).is_ok() {
            HIGH.fetch_max(i + 1, SeqCst);
            return Some(i);
        }
    }
    // An exited thread's slot whose records every stamp since has covered.
    let high = HIGH.load(Acquire).min(NTHREADS);
    for (i, st) in STATE.iter().enumerate().take(high) {
        if st.compare_exchange(DEAD, TAKING, AcqRel, Relaxed).is_err() {
            continue;
        }
        let clean = (0..MAX_GPUS).all(|e| {
            let t = RECS[e][i].last_ns.load(Acquire);
            t == 0 || covered(e, t)
        });
        if clean {
            // Covered records say nothing to a reader whatever their state: clearing them
            // while one is read changes no verdict.
            for recs in RECS.iter() {
                recs[i].clear();
            }
            st.store(LIVE, Release);
            return Some(i);
        }
        st.store(DEAD, Release);
    }
    None
}

/// The record of slot `slot` on GPU entry `entry` (`None`: out of range).
pub fn rec(entry: usize, slot: usize) -> Option<&'static Rec> {
    RECS.get(entry)?.get(slot)
}

/// The thread's context for its submissions on this record's GPU is now `ctx` (called
/// before a submission, when the thread's context changed): its earlier submissions are
/// another context's and another stream's. Written before `ctx` (Release), so a reader
/// that sees the new context sees them.
pub fn enter_ctx(r: &Rec, ctx: usize) {
    if r.ctx.load(Relaxed) == ctx {
        return;
    }
    let last = r.last_ns.load(Relaxed);
    if last != 0 {
        r.other_ctx_ns.store(last, Relaxed);
        r.other_stream_ns.store(last, Relaxed);
    }
    r.ctx.store(ctx, Release);
}

/// A submission begins: from now until [`end`], synchronising calls stamp nothing on this
/// GPU. A full barrier: it is visible before the clock read that follows.
#[inline(always)]
pub fn begin(r: &Rec) {
    r.busy.swap(1, SeqCst);
}

/// The submission at `now` to stream `key` (the doorbell has stamped it).
#[inline(always)]
pub fn note(r: &Rec, now: u64, key: usize) {
    if r.key.load(Relaxed) != key {
        let last = r.last_ns.load(Relaxed);
        if last != 0 {
            r.other_stream_ns.store(last, Relaxed);
        }
        r.key.store(key, Release);
    }
    r.last_ns.store(now, Release);
}

/// The driver's submission call returned.
#[inline(always)]
pub fn end(r: &Rec) {
    r.busy.store(0, Release);
}

/// What a successful synchronising call waited for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cover {
    /// Everything submitted in context `ctx`.
    Ctx(usize),
    /// Everything submitted to stream `key` (`crate::launch::key_of`) before it began: the
    /// default streams' keys are those of context `ctx`, and the per-thread one that of
    /// the thread in slot `owner`.
    Stream {
        /// The stream's key.
        key: usize,
        /// The context current where the stream was named.
        ctx: usize,
        /// The slot of the thread that named it.
        owner: Option<usize>,
    },
}

/// Whether some thread other than `except` is inside a submission on GPU entry `entry`.
/// Call after a full fence.
pub fn any_busy(entry: usize, except: Option<usize>) -> bool {
    let Some(recs) = RECS.get(entry) else {
        return true;
    };
    let high = HIGH.load(Acquire).min(NTHREADS);
    recs[..high]
        .iter()
        .enumerate()
        .any(|(i, r)| Some(i) != except && r.busy.load(Acquire) != 0)
}

/// Whether `cover` covers every submission on GPU entry `entry` made after `since` (the
/// last stamp), no thread but `except` being inside one. Call after a full fence.
pub fn covered(entry: usize, since: u64, cover: Cover, except: Option<usize>) -> bool {
    if FULL.load(Acquire) {
        return false;
    }
    let Some(recs) = RECS.get(entry) else {
        return false;
    };
    let high = HIGH.load(Acquire).min(NTHREADS);
    recs[..high].iter().enumerate().all(|(i, r)| {
        if Some(i) != except && r.busy.load(Acquire) != 0 {
            return false;
        }
        if r.last_ns.load(Acquire) <= since {
            return true;
        }
        let (key, ctx) = (r.key.load(Acquire), r.ctx.load(Acquire));
        let other_stream = r.other_stream_ns.load(Relaxed);
        let other_ctx = r.other_ctx_ns.load(Relaxed);
        match cover {
            Cover::Ctx(c) => ctx == c && other_ctx <= since,
            Cover::Stream {
                key: k,
                ctx: c,
                owner,
            } => {
                use crate::launch::{KEY_LEGACY, KEY_PER_THREAD, KEY_UNKNOWN};
                key == k
                    && k != KEY_UNKNOWN
                    && other_stream <= since
                    && other_ctx <= since
                    && (k != KEY_LEGACY && k != KEY_PER_THREAD || ctx == c)
                    && (k != KEY_PER_THREAD || owner == Some(i))
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::{KEY_LEGACY, KEY_PER_THREAD, KEY_UNKNOWN};

    /// A record of its own (not the shared table, which other tests' threads use).
    fn rec() -> Rec {
        Rec::new()
    }

    fn launch(r: &Rec, now: u64, key: usize) {
        begin(r);
        note(r, now, key);
        end(r);
    }

    #[test]
    fn a_record_keeps_the_latest_submission_to_another_stream() {
        let r = rec();
        enter_ctx(&r, 0x10);
        launch(&r, 100, 0xa0);
        launch(&r, 110, 0xa0);
        assert_eq!(r.other_stream_ns.load(Relaxed), 0, "one stream so far");
        launch(&r, 120, 0xb0);
        assert_eq!(r.other_stream_ns.load(Relaxed), 110, "a's last submission");
        launch(&r, 130, 0xa0);
        assert_eq!(r.other_stream_ns.load(Relaxed), 120);
        assert_eq!(r.key.load(Relaxed), 0xa0);
        assert_eq!(r.other_ctx_ns.load(Relaxed), 0);
        // Another context: everything before is another context's and another stream's.
        enter_ctx(&r, 0x20);
        assert_eq!(r.other_ctx_ns.load(Relaxed), 130);
        assert_eq!(r.other_stream_ns.load(Relaxed), 130);
        enter_ctx(&r, 0x20);
        assert_eq!(
            r.other_ctx_ns.load(Relaxed),
            130,
            "same context: nothing moves"
        );
    }

    #[test]
    fn busy_lasts_from_begin_to_end() {
        let r = rec();
        begin(&r);
        assert_eq!(r.busy.load(Relaxed), 1);
        note(&r, 5, KEY_LEGACY);
        assert_eq!(r.busy.load(Relaxed), 1);
        end(&r);
        assert_eq!(r.busy.load(Relaxed), 0);
    }

    /// The verdicts of [`covered`], on records placed in the shared table at entry
    /// `MAX_GPUS - 1` (no other test uses that GPU entry).
    #[test]
    fn what_a_synchronising_call_covers() {
        let e = MAX_GPUS - 1;
        let slot = |i: usize| &RECS[e][i];
        HIGH.fetch_max(3, SeqCst);
        let (c1, c2) = (0x10, 0x20);
        let s = |k| Cover::Stream {
            key: k,
            ctx: c1,
            owner: Some(0),
        };
        // Slot 0: stream 0xa0 in c1 since 100; slot 1 nothing new since the last stamp.
        enter_ctx(slot(0), c1);
        launch(slot(0), 100, 0xa0);
        enter_ctx(slot(1), c1);
        launch(slot(1), 40, 0xb0);
        assert!(covered(e, 50, s(0xa0), None));
        assert!(covered(e, 50, Cover::Ctx(c1), None));
        assert!(!covered(e, 50, s(0xb0), None), "0xa0's work is not 0xb0's");
        assert!(!covered(e, 50, Cover::Ctx(c2), None));
        assert!(
            !covered(e, 30, s(0xa0), None),
            "slot 1's 0xb0 after the last stamp"
        );
        assert!(covered(e, 30, Cover::Ctx(c1), None), "one context");
        // A submission in progress: nothing is covered, unless it is the caller's own.
        begin(slot(1));
        assert!(!covered(e, 50, Cover::Ctx(c1), None));
        assert!(covered(e, 50, Cover::Ctx(c1), Some(1)));
        assert!(any_busy(e, None) && !any_busy(e, Some(1)));
        note(slot(1), 140, 0xa0);
        end(slot(1));
        assert!(
            covered(e, 50, s(0xa0), None),
            "both threads on 0xa0 since 50"
        );
        // Slot 1 switched streams after the stamp at 30: its 0xb0 work (40) is not covered
        // by a sync of 0xa0.
        assert!(!covered(e, 30, s(0xa0), None));
        // The default streams: the context and, for the per-thread one, the thread count.
        launch(slot(0), 200, KEY_PER_THREAD);
        launch(slot(1), 200, KEY_PER_THREAD);
        assert!(
            !covered(e, 150, s(KEY_PER_THREAD), None),
            "two threads' own streams"
        );
        launch(slot(1), 210, KEY_LEGACY);
        launch(slot(0), 210, KEY_LEGACY);
        launch(slot(0), 220, KEY_LEGACY);
        launch(slot(1), 220, KEY_LEGACY);
        assert!(
            covered(e, 215, s(KEY_LEGACY), None),
            "one legacy stream, one context"
        );
        let other_ctx = Cover::Stream {
            key: KEY_LEGACY,
            ctx: c2,
            owner: Some(0),
        };
        assert!(
            !covered(e, 215, other_ctx, None),
            "another context's legacy stream"
        );
        launch(slot(0), 230, KEY_UNKNOWN);
        assert!(
            !covered(e, 225, s(KEY_UNKNOWN), None),
            "no single stream matches"
        );
        assert!(covered(e, 225, Cover::Ctx(c1), None));
        // A thread in another context.
        enter_ctx(slot(2), c2);
        launch(slot(2), 240, 0xc0);
        assert!(!covered(e, 235, Cover::Ctx(c1), None));
        assert!(
            covered(e, 240, Cover::Ctx(c1), None),
            "covered by the last stamp"
        );
        for i in 0..3 {
            slot(i).clear();
        }
    }
}
