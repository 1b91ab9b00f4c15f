//! Stream rings: one ring of events per stream a submission names (the legacy default
//! stream per context, the per-thread default stream per thread and context, every
//! created stream), at most [`MAX_POOLS`] at once.

use super::budget::mono_ns;
use super::events::{create_event, sync_event, with_ctx};
use super::gpus::{gpu_of_ctx, gpu_of_current, GPUS};
use super::CUDA_SUCCESS;
use crate::driver::gate_fns;
use crate::launch::{CU_STREAM_LEGACY, CU_STREAM_PER_THREAD};
use coloc_doorbell::Entry;
use std::cell::RefCell;
use std::collections::VecDeque;
use std::ffi::c_int;
use std::sync::atomic::{AtomicUsize, Ordering::*};
use std::sync::{Mutex, MutexGuard};

/// Stream rings at once.
pub const MAX_POOLS: usize = 256;

/// With `COLOC_SHIM_INFLIGHT=0` (unbounded), a ring still holds at most this many events
/// (the driver itself blocks a stream at about a thousand queued submissions).
pub(super) const UNBOUNDED_CAP: u64 = 4096;

/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` (900) to `CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD`
/// (908): an operation refused because of a stream capture.
const CAPTURE_ERRORS: std::ops::RangeInclusive<c_int> = 900..=908;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Key {
    /// The legacy default stream of a context.
    Legacy(usize),
    /// A thread's per-thread default stream in a context (thread: a TLS address).
    PerThread(usize, usize),
    /// A created stream.
    Stream(usize),
}

pub(super) struct Ring {
    pub(super) key: Option<Key>,
    pub(super) ctx: usize,
    /// The stream handle to record on.
    pub(super) record_on: usize,
    /// Recorded after a submission, not yet known complete, oldest first: (event, the
    /// sequence number of the last submission it covers, when it was recorded).
    pub(super) events: VecDeque<(usize, u64, u64)>,
    pub(super) free: Vec<usize>,
    /// Submissions made on the ring (tracked ones), the last known complete, the last
    /// covered by an event.
    pub(super) seq: u64,
    pub(super) done_seq: u64,
    pub(super) recorded_seq: u64,
    /// With a budget: the estimated wall-clock time of one submission on this stream (ns;
    /// 0: none yet), this ring's share of the budget (ns; 0: no budget), when the last
    /// completion was found while the stream stayed backlogged (0: the run broke), and
    /// when the first submission of the oldest batch in flight was made (0: unknown).
    pub(super) est_ns: u64,
    pub(super) share_ns: u64,
    pub(super) prev_done_ns: u64,
    pub(super) batch_start_ns: u64,
    /// `batch_start_ns` is the submission that found the stream idle (not a record made
    /// while earlier work was queued).
    pub(super) start_known: bool,
    /// Samples in `est_ns` so far (up to [`FIRST_SAMPLES`]).
    pub(super) samples: u32,
}

impl Ring {
    pub(super) const EMPTY: Ring = Ring {
        key: None,
        ctx: 0,
        record_on: 0,
        events: VecDeque::new(),
        free: Vec::new(),
        seq: 0,
        done_seq: 0,
        recorded_seq: 0,
        est_ns: 0,
        share_ns: 0,
        prev_done_ns: 0,
        batch_start_ns: 0,
        start_known: false,
        samples: 0,
    };

    /// Submissions made and not known complete (those not yet covered by an event too).
    pub(super) fn in_flight(&self) -> u64 {
        self.seq - self.done_seq
    }

    /// Forgets the timing (a new stream, a drained ring).
    fn reset_timing(&mut self) {
        self.est_ns = 0;
        self.prev_done_ns = 0;
        self.batch_start_ns = 0;
        self.samples = 0;
    }

    /// Everything submitted is complete (drained, or given up on).
    pub(super) fn all_done(&mut self) {
        self.done_seq = self.seq;
        self.recorded_seq = self.seq;
        self.prev_done_ns = 0;
        self.batch_start_ns = 0;
    }
}

pub(super) struct Pool {
    /// GPU index (`usize::MAX`: unassigned), readable without the lock.
    pub(super) gpu: AtomicUsize,
    pub(super) ring: Mutex<Ring>,
}

pub(super) static POOLS: [Pool; MAX_POOLS] = [const {
    Pool {
        gpu: AtomicUsize::new(usize::MAX),
        ring: Mutex::new(Ring::EMPTY),
    }
}; MAX_POOLS];

/// Which ring each key has (taken only without a ring lock held).
static DIRECTORY: Mutex<Vec<(Key, u16, u16)>> = Mutex::new(Vec::new());

static HAND: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Recently used stream rings: (key, pool index, GPU index).
    pub(super) static POOL_CACHE: RefCell<[Option<(Key, u16, u16)>; 4]> = const { RefCell::new([None; 4]) };
}

pub(super) fn lock<T>(m: &'static Mutex<T>) -> MutexGuard<'static, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Identifies the calling thread while it lives (the address of one of its thread-locals;
/// 1 while its thread-locals are being destroyed).
pub(super) fn thread_tag() -> usize {
    POOL_CACHE.try_with(|c| c as *const _ as usize).unwrap_or(1)
}

/// (pool index, GPU index) for `key`, assigning a ring if it has none.
pub(super) fn pool_for(key: Key, ctx: usize) -> Option<(usize, usize)> {
    let hit = POOL_CACHE
        .try_with(|c| c.borrow().iter().flatten().find(|x| x.0 == key).copied())
        .ok()
        .flatten();
    if let Some((_, p, g)) = hit {
        return Some((p as usize, g as usize));
    }
    let found = {
        let dir = lock(&DIRECTORY);
        dir.iter().find(|x| x.0 == key).copied()
    };
    let (p, g) = match found {
        Some((_, p, g)) => (p as usize, g as usize),
        None => assign(key, ctx)?,
    };
    let _ = POOL_CACHE.try_with(|c| {
        let mut c = c.borrow_mut();
        c.rotate_right(1);
        c[0] = Some((key, p as u16, g as u16));
    });
    Some((p, g))
}

/// Gives `key` a ring: a free one, or an idle one reclaimed (its events waited for and
/// destroyed).
fn assign(key: Key, cur_ctx: usize) -> Option<(usize, usize)> {
    let (ctx, record_on) = match key {
        Key::Legacy(c) => (c, CU_STREAM_LEGACY),
        Key::PerThread(c, _) => (c, CU_STREAM_PER_THREAD),
        Key::Stream(h) => {
            let mut c = 0usize;
            // SAFETY: the driver's cuStreamGetCtx with a valid out-pointer.
            if unsafe { (gate_fns().stream_get_ctx)(h, &mut c as *mut usize as usize) }
                != CUDA_SUCCESS
                || c == 0
            {
                return None;
            }
            (c, h)
        }
    };
    let gpu = if ctx == cur_ctx {
        gpu_of_current(ctx)?
    } else {
        gpu_of_ctx(ctx)?
    };
    let mut dir = lock(&DIRECTORY);
    // Another thread may have assigned it meanwhile.
    if let Some(&(_, p, g)) = dir.iter().find(|x| x.0 == key) {
        return Some((p as usize, g as usize));
    }
    let idx = (0..MAX_POOLS)
        .find(|&i| POOLS[i].gpu.load(Acquire) == usize::MAX)
        .or_else(|| reclaim(&mut dir))?;
    let mut r = lock(&POOLS[idx].ring);
    r.key = Some(key);
    r.ctx = ctx;
    r.record_on = record_on;
    r.reset_timing();
    r.all_done();
    POOLS[idx].gpu.store(gpu, Release);
    GPUS[gpu].rings.fetch_add(1, Relaxed);
    dir.push((key, idx as u16, gpu as u16));
    Some((idx, gpu))
}

/// Frees the first ring (round robin) that nobody holds: waits for its newest event,
/// destroys its events, and forgets its key.
pub(super) fn reclaim(dir: &mut Vec<(Key, u16, u16)>) -> Option<usize> {
    for _ in 0..MAX_POOLS {
        let i = HAND.fetch_add(1, Relaxed) % MAX_POOLS;
        let Ok(mut guard) = POOLS[i].ring.try_lock() else {
            continue;
        };
        let r = &mut *guard;
        let gpu = POOLS[i].gpu.load(Acquire);
        let ctx = r.ctx;
        if let Some(&(newest, _, _)) = r.events.back() {
            with_ctx(ctx, || sync_event(newest));
        }
        let n: u64 = r.recorded_seq - r.done_seq;
        r.all_done();
        let all: Vec<usize> = r
            .events
            .drain(..)
            .map(|x| x.0)
            .chain(r.free.drain(..))
            .collect();
        with_ctx(ctx, || {
            for e in all {
                // SAFETY: an event of ours, destroyed once.
                unsafe { (gate_fns().event_destroy)(e) };
            }
        });
        if let Some(g) = GPUS.get(gpu) {
            g.rings.fetch_sub(1, Relaxed);
            if let Some(e) = g.entry() {
                e.inflight.fetch_sub(n as u32, Relaxed);
            }
        }
        if let Some(k) = r.key.take() {
            dir.retain(|x| x.0 != k);
        }
        POOLS[i].gpu.store(usize::MAX, Release);
        return Some(i);
    }
    None
}

/// Counts a submission made on the ring's stream, and records an event after it where a
/// batch is full (`batch` submissions since the last event) or `now` says so (the gate is
/// closing: its drain waits for events).
pub(super) fn record(r: &mut Ring, entry: &Entry, batch: u64, now: bool) -> Result<(), String> {
    if r.seq == r.done_seq && r.share_ns != 0 {
        // The first submission of a run: its batch's sample starts here.
        r.batch_start_ns = mono_ns();
        r.start_known = true;
        r.prev_done_ns = 0;
    }
    r.seq += 1;
    if r.seq - r.recorded_seq < batch && !now {
        return Ok(());
    }
    for attempt in 0..2 {
        let e = match r.free.pop() {
            Some(e) => e,
            None => create_event(r.ctx).ok_or("cuEventCreate failed")?,
        };
        // SAFETY: the driver's cuEventRecord with our event and the ring's stream.
        let res = unsafe { (gate_fns().event_record)(e, r.record_on) };
        if res == CUDA_SUCCESS {
            let n = r.seq - r.recorded_seq;
            r.recorded_seq = r.seq;
            let at = if r.share_ns != 0 { mono_ns() } else { 0 };
            r.events.push_back((e, r.seq, at));
            entry.inflight.fetch_add(n as u32, Relaxed);
            return Ok(());
        }
        // A stream capture began meanwhile (on this stream after the check in `enter`, or
        // on a blocking stream while this is the legacy one): the submissions since the
        // last event go untracked; the ring and the gate stay as they are.
        if CAPTURE_ERRORS.contains(&res) {
            r.free.push(e);
            r.done_seq = r.done_seq.max(r.recorded_seq);
            return Ok(());
        }
        // The ring's events may be gone with a destroyed context, or a stream handle
        // reused in another: start the ring afresh once.
        if attempt == 0 {
            r.reset_timing();
            entry
                .inflight
                .fetch_sub((r.recorded_seq - r.done_seq) as u32, Relaxed);
            r.done_seq = r.recorded_seq;
            let dead: Vec<usize> = std::iter::once(e)
                .chain(r.free.drain(..))
                .chain(r.events.drain(..).map(|x| x.0))
                .collect();
            for d in dead {
                // SAFETY: events of ours, destroyed once (errors ignored).
                unsafe { (gate_fns().event_destroy)(d) };
            }
            if let Some(Key::Stream(h)) = r.key {
                let mut c = 0usize;
                // SAFETY: as in `assign`.
                if unsafe { (gate_fns().stream_get_ctx)(h, &mut c as *mut usize as usize) }
                    == CUDA_SUCCESS
                {
                    r.ctx = c;
                }
            }
        }
    }
    Err("cuEventRecord failed after a submission".into())
}

/// The ring of pool `p`, locked, if it is still `k`'s (else `k`'s new ring).
pub(super) fn ring_for(p: usize, k: Key, ctx: usize) -> Option<MutexGuard<'static, Ring>> {
    let r = lock(&POOLS[p].ring);
    if r.key == Some(k) {
        return Some(r);
    }
    // Reclaimed meanwhile (beyond MAX_POOLS streams): take a ring again.
    drop(r);
    let _ = POOL_CACHE.try_with(|c| {
        c.borrow_mut().iter_mut().for_each(|x| {
            if x.is_some_and(|x| x.0 == k) {
                *x = None
            }
        })
    });
    let r = pool_for(k, ctx).map(|(p, _)| lock(&POOLS[p].ring))?;
    (r.key == Some(k)).then_some(r)
}
