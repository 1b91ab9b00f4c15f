//! The submission path: the gate, the in-flight bound, the driver's call, the event.

use super::budget::{batch, bound, limit};
use super::gpus::{gpu_of_current, Gpu, GPUS};
use super::map::stale;
use super::streams::{cached, pool_for, record, ring_for, room, thread_tag, Key, Ring, POOLS};
use super::CUDA_SUCCESS;
use crate::launch::{capturing, stream_of, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD, KIND_PTDS};
use crate::mode::{self, GATED};
use coloc_doorbell::{futex_wait, futex_wake, now_ns, Entry};
use std::ffi::c_int;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering::*};
use std::sync::MutexGuard;

/// A blocked submission re-checks the gate (and the heartbeat) this often.
const BLOCK_RECHECK_NS: u64 = 50_000_000;

static STALE_WARNED: AtomicBool = AtomicBool::new(false);

/// What a submission holds between the gate and its end: its stream's ring, locked
/// (with its pool index), or the pool index of an unlocked submission, or neither (an
/// untracked one).
struct Ticket {
    gpu: &'static Gpu,
    entry: &'static Entry,
    ring: Option<(usize, MutexGuard<'static, Ring>)>,
    unlocked: Option<usize>,
}

thread_local! {
    /// The thread is inside a gated submission's driver call.
    static SUBMITTING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The calling thread is inside a gated submission's driver call: a submission it makes
/// now is the same one seen again through another interposer's hook (one that wraps the
/// driver's pointers the shim handed it, and that the shim wrapped in turn), and passes
/// straight through: gating it twice would hold the ring's lock twice.
#[inline]
pub fn submitting() -> bool {
    SUBMITTING.try_with(|s| s.get()).unwrap_or(false)
}

/// A gated submission: the gate, the in-flight bound, the driver's call, the event.
pub fn submit(kind: u32, real: usize, a: [usize; 12]) -> c_int {
    let t = catch_unwind(AssertUnwindSafe(|| enter(kind, &a))).unwrap_or_else(|_| {
        mode::disable("internal error at the launch gate");
        None
    });
    let _ = SUBMITTING.try_with(|s| s.set(true));
    // SAFETY: the driver's entry point for this request with the caller's arguments.
    let r = unsafe { crate::launch::call(real, a) };
    let _ = SUBMITTING.try_with(|s| s.set(false));
    if let Some(t) = t {
        match catch_unwind(AssertUnwindSafe(|| leave(t, r))) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => mode::disable(&e),
            Err(_) => mode::disable("internal error after a submission"),
        }
    }
    r
}

fn enter(kind: u32, a: &[usize; 12]) -> Option<Ticket> {
    let stream = stream_of(kind, a);
    if stream.is_some_and(|h| capturing(h, kind)) {
        return None;
    }
    let ctx = match stream {
        Some(h) if h > CU_STREAM_PER_THREAD => 0,
        _ => match crate::driver::current_ctx() {
            // No context: the driver refuses the call; nothing to gate.
            0 => return None,
            c => c,
        },
    };
    let key = match stream {
        None => None,
        Some(0) if kind & KIND_PTDS != 0 => Some(Key::PerThread(ctx, thread_tag())),
        Some(0) | Some(CU_STREAM_LEGACY) => Some(Key::Legacy(ctx)),
        Some(CU_STREAM_PER_THREAD) => Some(Key::PerThread(ctx, thread_tag())),
        Some(h) => Some(Key::Stream(h)),
    };
    // The thread's cached ring of this stream allows an unlocked submission (one taken
    // from its quota): no lock, no driver call, unless the gate is closed.
    let quick = key
        .and_then(cached)
        .filter(|c| POOLS[c.pool as usize].reserve(c.gen));
    let (pool, gpu) = match (quick, key) {
        (Some(c), _) => (Some(c.pool as usize), c.gpu as usize),
        (None, Some(k)) => {
            let (p, g) = pool_for(k, ctx)?;
            (Some(p), g)
        }
        (None, None) => (None, gpu_of_current(ctx)?),
    };
    let g = &GPUS[gpu];
    let Some(entry) = g.entry() else {
        if let Some(p) = quick {
            POOLS[p.pool as usize].release(false);
        }
        return None;
    };
    entry.in_submit.fetch_add(1, SeqCst);
    if quick.is_some() {
        if !closed_now(g) {
            return Some(Ticket {
                gpu: g,
                entry,
                ring: None,
                unlocked: pool,
            });
        }
        // Closed since: the reservation goes back unused, and this one waits at the gate.
        if let Some(p) = pool {
            POOLS[p].release(false);
        }
    }
    loop {
        let held = wait_at_gate(g, entry);
        let mut ring = match (pool, key) {
            (Some(p), Some(k)) => match ring_for(p, k, ctx) {
                Some((p, mut r)) => {
                    // Unlocked submissions since the last settle count from here.
                    POOLS[p].settle(&mut r, Some(entry));
                    if held {
                        // The time held at the gate is no submission's GPU time.
                        r.prev_done_ns = 0;
                    }
                    let rings = g.rings.load(Relaxed);
                    bound(&mut r, entry, rings, g.gate().map(|(_, s)| &s.closed));
                    Some((p, r))
                }
                // Lost the ring twice: this one submission goes untracked.
                None => {
                    entry.in_submit.fetch_sub(1, SeqCst);
                    return None;
                }
            },
            _ => None,
        };
        // Closed while this thread waited for its oldest event: back to the gate (a
        // submission now would only lengthen the drain).
        if let Some((_, r)) = ring.as_mut().filter(|_| closed_now(g)) {
            r.prev_done_ns = 0;
            continue;
        }
        return Some(Ticket {
            gpu: g,
            entry,
            ring,
            unlocked: None,
        });
    }
}

/// The gate of `g` is closed now, the agent alive, the gate in force.
fn closed_now(g: &Gpu) -> bool {
    mode::MODE.load(Acquire) == GATED
        && g.gate()
            .is_some_and(|(m, s)| s.closed.load(SeqCst) != 0 && !stale(m))
}

/// Blocks the calling thread while its GPU's gate is closed (and the agent alive); true
/// if it blocked.
fn wait_at_gate(g: &Gpu, entry: &Entry) -> bool {
    let mut stamp = 0;
    while let Some((m, slot)) = g.gate() {
        let c = slot.closed.load(SeqCst);
        if c == 0 || mode::MODE.load(Acquire) != GATED {
            break;
        }
        if stale(m) {
            crate::mode::warn_once(
                &STALE_WARNED,
                "the gpu-coloc agent's gate heartbeat is stale: the launch gate counts as open",
            );
            break;
        }
        if entry.in_submit.fetch_sub(1, SeqCst) == 1 {
            futex_wake(&entry.in_submit);
        }
        let now = now_ns();
        if stamp == 0 {
            stamp = match entry.blocked_ns.compare_exchange(0, now, AcqRel, Acquire) {
                Ok(_) => now,
                Err(v) => v,
            };
        }
        futex_wait(&slot.closed, c, BLOCK_RECHECK_NS);
        entry.in_submit.fetch_add(1, SeqCst);
    }
    if stamp != 0 {
        let _ = entry.blocked_ns.compare_exchange(stamp, 0, AcqRel, Acquire);
    }
    stamp != 0
}

fn leave(mut t: Ticket, r: c_int) -> Result<(), String> {
    let mut res = Ok(());
    if let Some(p) = t.unlocked {
        // Counted by the next settle, which waits for this: an event recorded after that
        // covers it.
        POOLS[p].release(r == CUDA_SUCCESS);
    } else if r == CUDA_SUCCESS {
        if let Some((p, ring)) = t.ring.as_mut() {
            // Closing now: the drain waits for an event covering this submission.
            let closing = t
                .gpu
                .gate()
                .is_some_and(|(_, s)| s.closed.load(SeqCst) != 0);
            let lim = limit(ring);
            let b = batch(lim);
            res = record(ring, t.entry, b, closing);
            t.entry.submitted.fetch_add(1, Relaxed);
            // Room under the bound and in the batch: the submissions up to it go
            // unlocked (none while closing).
            let n = if closing || res.is_err() {
                0
            } else {
                room(ring, lim, b)
            };
            POOLS[*p].allow(&mut *ring, n);
        } else {
            t.entry.submitted.fetch_add(1, Relaxed);
        }
    }
    drop(t.ring.take());
    if t.entry.in_submit.fetch_sub(1, SeqCst) == 1
        && t.gpu
            .gate()
            .is_some_and(|(_, s)| s.closed.load(SeqCst) != 0)
    {
        futex_wake(&t.entry.in_submit);
    }
    res
}
