//! Completion stamps (online): when a synchronising call shows that all the work the
//! process submitted on a GPU is complete, the GPU's page entry gets the time
//! (`coloc_doorbell::Entry::drained_ns`). A launch time says when work was queued; the
//! agent needs to know when it finished to release offline work in the gaps between an
//! online service's requests.
//!
//! A call stamps only when it returned `CUDA_SUCCESS` and
//!
//! - it covered every submission the process made on that GPU since the last stamp: a
//!   context synchronize, when they all were in that context; a stream synchronize or
//!   query, or a device-to-host copy (on its default stream), when they all went to that
//!   stream; an event synchronize or query, when they all went to the stream the event was
//!   recorded on, before it was recorded (the thread records, [`crate::threads`]);
//! - no submission on that GPU was in progress when it began, and none began since (the
//!   doorbell's launch stamp is the same before the call and after it, and no thread is
//!   inside a submission at either end);
//!
//! and the stamp is the time read after the call returned. Anything else stamps nothing:
//! a missed stamp only leaves the agent to its idle window, as before.
//!
//! ```text
//!  synchronising call:  s0 := entry.last_launch; fence; any thread busy? → no stamp
//!                       the driver's call; not CUDA_SUCCESS → no stamp
//!                       t := now; fence; entry.last_launch ≠ s0 → no stamp
//!                       every record since the last stamp covered, none busy → stamp t
//! ```
//!
//! **Events**: an event's stream is known only from its record, so `cuEventRecord[WithFlags]`
//! notes (event → stream, context, thread, the launch stamp then, whether a submission was
//! in progress) in a table of [`EVENTS`] slots (a newer event in the same slot evicts the
//! older: no stamp for it); `cuEventCreate` and `cuEventDestroy` forget the handle, so a
//! reused handle never inherits an old record.
//!
//! **Not covered**, so a stamp can come early by them: stream operations the shim does not
//! watch at all (`cuStreamWriteValue*`/`WaitValue*`, `cuStreamBatchMemOp`, external
//! semaphores, `cuMemPrefetchAsync`), and events whose handle a context's destruction
//! freed and an IPC import reused.

use crate::launch::{key_of, Fwd, KIND_PTDS};
use crate::page::{find, here, Here};
use crate::threads::{any_busy, covered, Cover};
use crate::watch::*;
use coloc_doorbell::Entry;
use std::ffi::c_int;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, AtomicUsize, Ordering::*};

/// `CUDA_SUCCESS`.
const CUDA_SUCCESS: c_int = 0;

/// Calls a watched entry point (online, the mode *on*) and stamps what it shows.
pub fn call(kind: u32, f: usize, a: [usize; 12]) -> c_int {
    let ptds = kind & KIND_PTDS != 0;
    match what(kind) {
        W_STREAM => {
            let pre = find().and_then(|h| {
                let cover = Cover::Stream {
                    key: key_of(a[0], ptds),
                    ctx: h.ctx,
                    owner: crate::threads::own_slot(),
                };
                Before::take(h.index, h.entry, cover, None)
            });
            finish(pre, forward(f, a))
        }
        W_CTX => {
            let pre = find().and_then(|h| Before::take(h.index, h.entry, Cover::Ctx(h.ctx), None));
            finish(pre, forward(f, a))
        }
        W_CTX_ARG => {
            let pre = find()
                .filter(|h| a[0] == 0 || a[0] == h.ctx)
                .and_then(|h| Before::take(h.index, h.entry, Cover::Ctx(h.ctx), None));
            finish(pre, forward(f, a))
        }
        W_EVENT => {
            let pre = recorded(a[0]).and_then(|r| {
                if !r.clean {
                    return None;
                }
                let page = crate::page::page()?;
                let b = Before::take(r.index, page.entry(r.index)?, r.cover, None)?;
                // A submission on that GPU since the record: the event may not cover it.
                (b.s0 == r.s_rec).then_some(b)
            });
            finish(pre, forward(f, a))
        }
        W_RECORD => {
            let h = find();
            let before = h.map(|h| {
                let s_rec = h.entry.last_launch_ns.load(Acquire);
                fence(SeqCst);
                (h, s_rec, !any_busy(h.index, None))
            });
            let r = forward(f, a);
            match before {
                Some((h, s_rec, clean)) if r == CUDA_SUCCESS => {
                    note_record(a[0], &h, a[1], ptds, s_rec, clean)
                }
                _ => forget(a[0]),
            }
            r
        }
        W_CREATE => {
            let r = forward(f, a);
            if r == CUDA_SUCCESS && a[0] != 0 {
                // SAFETY: cuEventCreate succeeded, so argument 0 is a valid `CUevent *`.
                forget(unsafe { *(a[0] as *const usize) });
            }
            r
        }
        W_DESTROY => {
            let r = forward(f, a);
            forget(a[0]);
            r
        }
        W_COPY | W_COPY_DRAINS => {
            let key = key_of(0, ptds);
            // The copy itself is a submission to the default stream.
            let rec = crate::page::ring(key, || false);
            let pre = if what(kind) == W_COPY_DRAINS {
                here().and_then(|h| {
                    let cover = Cover::Stream {
                        key,
                        ctx: h.ctx,
                        owner: crate::threads::own_slot(),
                    };
                    Before::take(h.index, h.entry, cover, crate::threads::own_slot())
                })
            } else {
                None
            };
            let r = forward(f, a);
            crate::page::rung(rec);
            finish(pre, r)
        }
        _ => forward(f, a),
    }
}

/// Calls `f` with the caller's arguments.
#[inline(always)]
fn forward(f: usize, a: [usize; 12]) -> c_int {
    // SAFETY: `f` is the driver's entry point the caller asked for, called with the
    // caller's own arguments (twelve machine words: see `crate::launch`).
    unsafe {
        std::mem::transmute::<usize, Fwd>(f)(
            a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11],
        )
    }
}

/// What a synchronising call saw before it called the driver.
#[derive(Debug)]
struct Before {
    index: usize,
    entry: &'static Entry,
    cover: Cover,
    /// The calling thread's own submission (a synchronous copy's), not to be waited for.
    except: Option<usize>,
    /// The doorbell's launch stamp then.
    s0: u64,
}

impl Before {
    /// `None`: a submission on the GPU is in progress, so the call may not cover it.
    fn take(
        index: usize,
        entry: &'static Entry,
        cover: Cover,
        except: Option<usize>,
    ) -> Option<Before> {
        let s0 = entry.last_launch_ns.load(Acquire);
        fence(SeqCst);
        if any_busy(index, except) {
            return None;
        }
        Some(Before {
            index,
            entry,
            cover,
            except,
            s0,
        })
    }
}

/// After the driver's call returned `r`: stamps the time if the call covered everything.
fn finish(before: Option<Before>, r: c_int) -> c_int {
    if r == CUDA_SUCCESS {
        if let Some(b) = before {
            stamp(b);
        }
    }
    r
}

fn stamp(b: Before) {
    let Some(page) = crate::page::page() else {
        return;
    };
    let now = coloc_doorbell::now_ns();
    fence(SeqCst);
    if b.entry.last_launch_ns.load(Acquire) != b.s0 {
        return;
    }
    let since = b.entry.drained_ns.load(Acquire);
    if covered(b.index, since, b.cover, b.except) {
        page.stamp_drained(b.entry, now);
    }
}

/// Event records kept at once (a direct-mapped table by handle).
pub const EVENTS: usize = 1024;

/// What an event's record said.
#[derive(Debug, Clone, Copy)]
struct Recorded {
    /// The GPU entry of the context current at the record.
    index: usize,
    /// The stream it was recorded on.
    cover: Cover,
    /// The doorbell's launch stamp at the record.
    s_rec: u64,
    /// No submission on that GPU was in progress at the record.
    clean: bool,
}

struct EventSlot {
    lock: AtomicU32,
    handle: AtomicUsize,
    index: AtomicUsize,
    key: AtomicUsize,
    ctx: AtomicUsize,
    /// Slot + 1 of the recording thread (0: none).
    owner: AtomicUsize,
    s_rec: AtomicU64,
    clean: AtomicU32,
}

static TABLE: [EventSlot; EVENTS] = [const {
    EventSlot {
        lock: AtomicU32::new(0),
        handle: AtomicUsize::new(0),
        index: AtomicUsize::new(0),
        key: AtomicUsize::new(0),
        ctx: AtomicUsize::new(0),
        owner: AtomicUsize::new(0),
        s_rec: AtomicU64::new(0),
        clean: AtomicU32::new(0),
    }
}; EVENTS];

/// Runs `f` on `h`'s slot, locked (a spin lock: held for a few loads and stores).
fn with_slot<T>(h: usize, f: impl FnOnce(&EventSlot) -> T) -> T {
    let i = (h as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 54;
    let s = &TABLE[i as usize % EVENTS];
    let mut spins = 0u32;
    while s
        .lock
        .compare_exchange_weak(0, 1, Acquire, Relaxed)
        .is_err()
    {
        spins += 1;
        if spins.is_multiple_of(64) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    let out = f(s);
    s.lock.store(0, Release);
    out
}

fn note_record(ev: usize, h: &Here, stream: usize, ptds: bool, s_rec: u64, clean: bool) {
    if ev == 0 {
        return;
    }
    let owner = crate::threads::own_slot().map_or(0, |s| s + 1);
    with_slot(ev, |s| {
        s.handle.store(ev, Relaxed);
        s.index.store(h.index, Relaxed);
        s.key.store(key_of(stream, ptds), Relaxed);
        s.ctx.store(h.ctx, Relaxed);
        s.owner.store(owner, Relaxed);
        s.s_rec.store(s_rec, Relaxed);
        s.clean.store(u32::from(clean), Relaxed);
    });
}

fn forget(ev: usize) {
    if ev == 0 {
        return;
    }
    with_slot(ev, |s| {
        if s.handle.load(Relaxed) == ev {
            s.handle.store(0, Relaxed);
        }
    });
}

fn recorded(ev: usize) -> Option<Recorded> {
    if ev == 0 {
        return None;
    }
    with_slot(ev, |s| {
        (s.handle.load(Relaxed) == ev).then(|| Recorded {
            index: s.index.load(Relaxed),
            cover: Cover::Stream {
                key: s.key.load(Relaxed),
                ctx: s.ctx.load(Relaxed),
                owner: s.owner.load(Relaxed).checked_sub(1),
            },
            s_rec: s.s_rec.load(Relaxed),
            clean: s.clean.load(Relaxed) != 0,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_table_slot_belongs_to_its_latest_handle() {
        // SAFETY: an entry is atomics only, valid all zero.
        let entry: &'static Entry = Box::leak(Box::new(unsafe { std::mem::zeroed::<Entry>() }));
        let h = Here {
            ctx: 0x10,
            entry,
            index: 3,
            rec: None,
        };
        let ev = 0x7000_1230;
        assert!(recorded(ev).is_none(), "never recorded");
        note_record(ev, &h, 0, false, 55, true);
        let r = recorded(ev).unwrap();
        assert_eq!((r.index, r.s_rec, r.clean), (3, 55, true));
        assert_eq!(
            r.cover,
            Cover::Stream {
                key: crate::launch::KEY_LEGACY,
                ctx: 0x10,
                owner: None
            }
        );
        note_record(ev, &h, 0, true, 56, false);
        let r = recorded(ev).unwrap();
        assert_eq!((r.s_rec, r.clean), (56, false));
        assert!(matches!(
            r.cover,
            Cover::Stream {
                key: crate::launch::KEY_PER_THREAD,
                ..
            }
        ));
        forget(ev + 8);
        assert!(recorded(ev).is_some(), "another handle's forget");
        forget(ev);
        assert!(recorded(ev).is_none());
        // Another handle in the same slot evicts it.
        note_record(ev, &h, 0x9000, false, 1, true);
        let other = (1..1 << 20)
            .map(|k| ev + 16 * k)
            .find(|&o| {
                let slot = |x: usize| {
                    ((x as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 54) as usize % EVENTS
                };
                slot(o) == slot(ev)
            })
            .unwrap();
        note_record(other, &h, 0x9000, false, 2, true);
        assert!(recorded(ev).is_none(), "evicted: no stamp for it");
        assert_eq!(recorded(other).unwrap().s_rec, 2);
        forget(other);
    }
}
