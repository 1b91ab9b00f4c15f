//! Stream rings: one ring of events per stream a submission names (the legacy default
//! stream per context, the per-thread default stream per thread and context, every
//! created stream), at most [`MAX_POOLS`] at once.
//!
//! A ring is locked by the submissions that record its events or wait at its bound. The
//! submissions between take no lock: a locked submission that leaves room under the
//! bound and in the batch sets the ring's *quota* (`left` in [`Pool::word`]), and a
//! submission that takes one of it ([`Pool::reserve`], one atomic exchange, which also
//! counts it *inside*) goes straight to the driver, and leaves ([`Pool::release`]) when
//! the driver's call returns. The next locked one (or the watcher, or a reclaim)
//! *settles* them into the ring's sequence before it records, waits or frees the ring:
//! it withdraws the quota and waits until no thread is inside, so that the sequence is
//! every submission made (however many threads took part: never more than the quota)
//! and an event recorded then covers them all.

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
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::*};
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
    /// Unlocked submissions the quota allowed since the last settle, and
    /// [`Pool::unmade`] as of the last settle.
    pub(super) granted: u64,
    pub(super) unmade_settled: u64,
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
        granted: 0,
        unmade_settled: 0,
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
    /// `generation (32 bits) | left (16) | inside (16)`: the generation is bumped each
    /// time the ring is given to a stream (a thread's cached (key, pool) pair allows an
    /// unlocked submission only while it matches); `left` is the unlocked submissions the
    /// quota still allows (raised only under the ring's lock, taken one at a time by
    /// [`Pool::reserve`]); `inside` the threads between that reservation and the end of
    /// their driver call ([`Pool::release`]).
    pub(super) word: AtomicU64,
    /// Reservations that made no submission (the driver's call failed, or the gate was
    /// found closed after the reservation).
    pub(super) unmade: AtomicU64,
    pub(super) ring: Mutex<Ring>,
}

/// One unlocked submission in [`Pool::word`]'s fields.
const INSIDE_ONE: u64 = 1;
const LEFT_ONE: u64 = 1 << 16;
const FIELD: u64 = 0xffff;
const LEFT_MASK: u64 = FIELD << 16;
const GEN_ONE: u64 = 1 << 32;

fn inside(w: u64) -> u64 {
    w & FIELD
}

fn left(w: u64) -> u64 {
    (w >> 16) & FIELD
}

pub(super) static POOLS: [Pool; MAX_POOLS] = [const {
    Pool {
        gpu: AtomicUsize::new(usize::MAX),
        word: AtomicU64::new(0),
        unmade: AtomicU64::new(0),
        ring: Mutex::new(Ring::EMPTY),
    }
}; MAX_POOLS];

/// Which ring each key has (taken only without a ring lock held).
static DIRECTORY: Mutex<Vec<(Key, u16, u16)>> = Mutex::new(Vec::new());

static HAND: AtomicUsize = AtomicUsize::new(0);

/// A thread's cached ring of a stream.
#[derive(Debug, Clone, Copy)]
pub(super) struct Cached {
    pub(super) key: Key,
    pub(super) pool: u16,
    pub(super) gpu: u16,
    /// The pool's [`Pool::gen`] when the ring was found.
    pub(super) gen: u32,
}

thread_local! {
    /// Recently used stream rings.
    pub(super) static POOL_CACHE: RefCell<[Option<Cached>; 4]> = const { RefCell::new([None; 4]) };
}

impl Pool {
    /// The ring's generation now.
    pub(super) fn gen(&self) -> u32 {
        (self.word.load(Acquire) >> 32) as u32
    }

    /// Takes one unlocked submission of the quota, if the ring is still at generation
    /// `gen` (as a thread cached it) and the quota allows one: the caller is then inside
    /// until [`Pool::release`]. No lock: one atomic exchange.
    #[inline]
    pub(super) fn reserve(&self, gen: u32) -> bool {
        let mut w = self.word.load(Relaxed);
        loop {
            if (w >> 32) as u32 != gen || left(w) == 0 {
                return false;
            }
            match self
                .word
                .compare_exchange_weak(w, w - LEFT_ONE + INSIDE_ONE, AcqRel, Relaxed)
            {
                Ok(_) => return true,
                Err(x) => w = x,
            }
        }
    }

    /// Ends a reservation: `made` if a submission was made (the driver's call returned
    /// successfully), else it is counted as unmade.
    #[inline]
    pub(super) fn release(&self, made: bool) {
        if !made {
            self.unmade.fetch_add(1, Relaxed);
        }
        self.word.fetch_sub(INSIDE_ONE, Release);
    }

    /// Withdraws the quota, waits until no thread is inside an unlocked submission of the
    /// ring (each is in a driver call: microseconds), and counts those made since the last
    /// settle into the ring's sequence (and the page's count of submissions). Under the
    /// ring's lock: from here until [`Pool::allow`] no submission goes unlocked, and the
    /// ring's sequence is every submission made on it.
    pub(super) fn settle(&self, r: &mut Ring, entry: Option<&Entry>) {
        let old = self.word.fetch_and(!LEFT_MASK, AcqRel);
        let mut w = old;
        let mut spins = 0u32;
        while inside(w) != 0 {
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else if spins < 1_000 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
            w = self.word.load(Acquire);
        }
        let unmade = self.unmade.load(Relaxed);
        let taken = r.granted - left(old);
        let n = taken.saturating_sub(unmade - r.unmade_settled);
        r.granted = 0;
        r.unmade_settled = unmade;
        if n == 0 {
            return;
        }
        r.seq += n;
        if let Some(e) = entry {
            e.submitted.fetch_add(n, Relaxed);
        }
    }

    /// Allows up to `n` unlocked submissions from now (0: none). Under the ring's lock.
    pub(super) fn allow(&self, r: &mut Ring, n: u64) {
        let n = n.min(FIELD);
        let old = self
            .word
            .fetch_update(Release, Relaxed, |w| Some((w & !LEFT_MASK) | n << 16))
            .unwrap_or_else(|w| w);
        r.granted = r.granted - left(old) + n;
    }
}

/// Settles every ring that has unlocked submissions not yet counted and that nobody
/// holds, into its GPU's page entry, so that the page's count of submissions stays true
/// for a stream gone quiet between records (the watcher, once a period). Its quota is
/// withdrawn: the stream's next submission takes the lock and grants it again.
pub(super) fn settle_all() {
    for p in POOLS.iter() {
        let gpu = p.gpu.load(Acquire);
        let Some(entry) = GPUS.get(gpu).and_then(|g| g.entry()) else {
            continue;
        };
        let Ok(mut r) = p.ring.try_lock() else {
            continue;
        };
        // One inside a driver call (which may block, e.g. while the driver's lock holds
        // the process) is left for the next period or the next locked submission.
        let w = p.word.load(Acquire);
        if p.gpu.load(Acquire) != gpu || r.granted == left(w) || inside(w) != 0 {
            continue;
        }
        p.settle(&mut r, Some(entry));
    }
}

/// Unlocked submissions a locked one leaves room for: up to one short of the bound
/// (`limit` in flight) and of the batch's record (`batch` since the last event), so that
/// the locked submission after them is the one that records or waits.
pub(super) fn room(r: &Ring, limit: u64, batch: u64) -> u64 {
    let bound = limit.saturating_sub(r.in_flight() + 1);
    let batch = batch.saturating_sub(r.seq - r.recorded_seq + 1);
    bound.min(batch)
}

pub(super) fn lock<T>(m: &'static Mutex<T>) -> MutexGuard<'static, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Identifies the calling thread while it lives (the address of one of its thread-locals;
/// 1 while its thread-locals are being destroyed).
pub(super) fn thread_tag() -> usize {
    POOL_CACHE.try_with(|c| c as *const _ as usize).unwrap_or(1)
}

/// The calling thread's cached ring of `key`, if any.
#[inline]
pub(super) fn cached(key: Key) -> Option<Cached> {
    POOL_CACHE
        .try_with(|c| c.borrow().iter().flatten().find(|x| x.key == key).copied())
        .ok()
        .flatten()
}

/// (pool index, GPU index) for `key`, assigning a ring if it has none.
pub(super) fn pool_for(key: Key, ctx: usize) -> Option<(usize, usize)> {
    if let Some(c) = cached(key) {
        return Some((c.pool as usize, c.gpu as usize));
    }
    let found = {
        let dir = lock(&DIRECTORY);
        dir.iter().find(|x| x.0 == key).copied()
    };
    let (p, g) = match found {
        Some((_, p, g)) => (p as usize, g as usize),
        None => assign(key, ctx)?,
    };
    remember(key, p, g);
    Some((p, g))
}

/// Caches `key`'s ring (pool `p` on GPU `g`, at its current generation) as the thread's
/// most recent.
fn remember(key: Key, p: usize, g: usize) {
    let gen = POOLS[p].gen();
    let _ = POOL_CACHE.try_with(|c| {
        let mut c = c.borrow_mut();
        let at = c.iter().position(|x| x.is_some_and(|x| x.key == key));
        c[..=at.unwrap_or(3)].rotate_right(1);
        c[0] = Some(Cached {
            key,
            pool: p as u16,
            gpu: g as u16,
            gen,
        });
    });
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
    POOLS[idx].renew(&mut r);
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
    for _ in 0..2 * MAX_POOLS {
        let i = HAND.fetch_add(1, Relaxed) % MAX_POOLS;
        let Ok(mut guard) = POOLS[i].ring.try_lock() else {
            continue;
        };
        let r = &mut *guard;
        let gpu = POOLS[i].gpu.load(Acquire);
        let entry = GPUS.get(gpu).and_then(|g| g.entry());
        // A ring that allows unlocked submissions, or has one in progress, is in use: its
        // unlocked submissions are counted (those in progress waited for), it allows none
        // from now, and it is taken on the next round if it stays unused.
        let w = POOLS[i].word.load(Acquire);
        POOLS[i].settle(r, entry);
        if left(w) > 0 || inside(w) > 0 {
            continue;
        }
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
        }
        if let Some(e) = entry {
            e.inflight.fetch_sub(n as u32, Relaxed);
        }
        if let Some(k) = r.key.take() {
            dir.retain(|x| x.0 != k);
        }
        POOLS[i].renew(r);
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
        // last event go untracked (out of the ring's sequence: no event will ever cover
        // them); what the events already recorded cover stays in flight until they
        // complete, in the ring and on the page.
        if CAPTURE_ERRORS.contains(&res) {
            r.free.push(e);
            r.seq = r.recorded_seq;
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

impl Pool {
    /// A new generation of the ring (assigned or freed): no unlocked submission from a
    /// cache of the old one, nothing of it left to settle (one still in progress is
    /// waited for and dropped: the caller has settled the ring first where it counts).
    fn renew(&self, r: &mut Ring) {
        self.settle(r, None);
        self.word.fetch_add(GEN_ONE, AcqRel);
    }
}

/// The ring of pool `p`, locked, if it is still `k`'s (else `k`'s new ring), with its
/// pool index.
pub(super) fn ring_for(p: usize, k: Key, ctx: usize) -> Option<(usize, MutexGuard<'static, Ring>)> {
    let r = lock(&POOLS[p].ring);
    if r.key == Some(k) {
        // Given to this stream again since the thread cached it: cached afresh.
        if cached(k).is_some_and(|c| c.gen != POOLS[p].gen()) {
            remember(k, p, POOLS[p].gpu.load(Acquire));
        }
        return Some((p, r));
    }
    // Reclaimed meanwhile (beyond MAX_POOLS streams): take a ring again.
    drop(r);
    let _ = POOL_CACHE.try_with(|c| {
        c.borrow_mut().iter_mut().for_each(|x| {
            if x.is_some_and(|x| x.key == k) {
                *x = None
            }
        })
    });
    let (p, _) = pool_for(k, ctx)?;
    let r = lock(&POOLS[p].ring);
    (r.key == Some(k)).then_some((p, r))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool() -> Pool {
        Pool {
            gpu: AtomicUsize::new(0),
            word: AtomicU64::new(0),
            unmade: AtomicU64::new(0),
            ring: Mutex::new(Ring::EMPTY),
        }
    }

    /// An event record refused because a stream capture began leaves the submissions it
    /// would have covered untracked, and nothing else: the events already recorded stay in
    /// flight, on the ring (its bound) and on the page (the agent's drain), until they
    /// complete. (Marking them complete at the refusal left the page's count of work in
    /// flight above zero for good: a gate close never acknowledged.)
    #[test]
    fn a_record_refused_by_a_capture_keeps_what_is_in_flight() {
        static RESULT: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);
        unsafe extern "C" fn record_stub(_: usize, _: usize) -> c_int {
            RESULT.load(SeqCst)
        }
        unsafe extern "C" fn ok1(_: usize) -> c_int {
            0
        }
        unsafe extern "C" fn ok2(_: usize, _: usize) -> c_int {
            0
        }
        unsafe extern "C" fn ok0() -> c_int {
            0
        }
        crate::driver::set_gate_fns(crate::driver::GateFns {
            stream_get_ctx: ok2,
            ctx_push: ok1,
            ctx_pop: ok1,
            event_create: ok2,
            event_record: record_stub,
            event_query: ok1,
            event_sync: ok1,
            event_destroy: ok1,
            ctx_sync: ok0,
            exchange_capture_mode: None,
        });
        // SAFETY: a page entry is atomics and integers, all valid at zero.
        let page: Entry = unsafe { std::mem::zeroed() };
        let mut r = Ring::EMPTY;
        r.free.extend([1, 2, 3]);
        // Eight submissions in two recorded batches of four, none complete.
        for _ in 0..8 {
            record(&mut r, &page, 4, false).unwrap();
        }
        assert_eq!((r.seq, r.recorded_seq, r.events.len()), (8, 8, 2));
        assert_eq!(page.inflight.load(Relaxed), 8);
        // A capture begins: the next batch's record is refused.
        RESULT.store(*CAPTURE_ERRORS.start(), SeqCst);
        for _ in 0..4 {
            record(&mut r, &page, 4, false).unwrap();
        }
        assert_eq!(r.events.len(), 2, "the events recorded before stay");
        assert_eq!(
            r.in_flight(),
            8,
            "the ring's bound counts what the events cover, not the untracked batch"
        );
        assert_eq!(
            page.inflight.load(Relaxed) as u64,
            r.recorded_seq - r.done_seq,
            "the page counts what the ring's events cover"
        );
        assert_eq!(page.inflight.load(Relaxed), 8);
    }

    /// A locked submission leaves room for unlocked ones up to one short of the bound and
    /// of the next record, and none at either.
    #[test]
    fn the_room_stops_one_short_of_the_bound_and_the_record() {
        let mut r = Ring::EMPTY;
        (r.seq, r.done_seq, r.recorded_seq) = (33, 32, 32);
        assert_eq!(
            room(&r, 64, 32),
            30,
            "the batch: 31 to the record, less one"
        );
        (r.seq, r.done_seq, r.recorded_seq) = (63, 10, 63);
        assert_eq!(room(&r, 64, 32), 10, "the bound: 53 in flight");
        (r.seq, r.done_seq, r.recorded_seq) = (64, 0, 64);
        assert_eq!(room(&r, 64, 32), 0, "at the bound");
        (r.seq, r.done_seq, r.recorded_seq) = (5, 5, 4);
        assert_eq!(
            room(&r, 2, 1),
            0,
            "a batch of one: every submission records"
        );
        assert_eq!(room(&r, 1, 1), 0, "a bound of one");
    }

    /// Unlocked submissions count into the ring's sequence and the page at the settle;
    /// the quota allows exactly what was granted, failed ones are not counted; a new
    /// generation (the ring given to another stream) allows nothing from an old cache and
    /// leaves nothing to settle.
    #[test]
    fn unlocked_submissions_are_settled_within_the_quota_and_the_generation() {
        let p = pool();
        let mut r = Ring::EMPTY;
        // SAFETY: a page entry is atomics and integers, all valid at zero.
        let page: Entry = unsafe { std::mem::zeroed() };
        p.renew(&mut r);
        let gen = p.gen();
        assert!(!p.reserve(gen), "nothing allowed before a grant");
        p.allow(&mut r, 3);
        assert!(!p.reserve(gen + 1), "another generation's cache");
        assert!(p.reserve(gen));
        p.release(true);
        assert!(p.reserve(gen));
        p.release(false);
        assert!(p.reserve(gen));
        p.release(true);
        assert!(!p.reserve(gen), "the quota is used up");
        p.settle(&mut r, Some(&page));
        assert_eq!(r.seq, 2, "the failed one is not counted");
        assert_eq!(page.submitted.load(Relaxed), 2);
        p.settle(&mut r, Some(&page));
        assert_eq!(r.seq, 2, "settled once");
        p.allow(&mut r, 5);
        assert!(p.reserve(gen));
        p.release(true);
        p.settle(&mut r, Some(&page));
        assert_eq!(r.seq, 3, "one of five taken");
        assert!(!p.reserve(gen), "the settle withdraws the rest");
        p.allow(&mut r, 5);
        p.allow(&mut r, 2);
        for _ in 0..2 {
            assert!(p.reserve(gen));
            p.release(true);
        }
        assert!(!p.reserve(gen), "a new grant replaces the old one");
        p.allow(&mut r, 5);
        for _ in 0..3 {
            assert!(p.reserve(gen));
            p.release(true);
        }
        p.renew(&mut r);
        assert_eq!(r.seq, 3 + 5, "the renewal settles the old stream's first");
        assert!(!p.reserve(gen), "the old generation");
        assert!(!p.reserve(p.gen()), "nothing allowed after a renewal");
        p.settle(&mut r, Some(&page));
        assert_eq!(r.seq, 8, "nothing of the old stream settles again");
    }

    /// Threads that each passed the quota's check together take no more than it allows:
    /// eight threads racing for a quota of three get three.
    #[test]
    fn racing_threads_take_no_more_than_the_quota() {
        let p = pool();
        let mut r = Ring::EMPTY;
        p.renew(&mut r);
        let gen = p.gen();
        for _ in 0..200 {
            p.allow(&mut r, 3);
            let start = std::sync::Barrier::new(8);
            let got = std::sync::atomic::AtomicU64::new(0);
            std::thread::scope(|s| {
                for _ in 0..8 {
                    s.spawn(|| {
                        start.wait();
                        if p.reserve(gen) {
                            got.fetch_add(1, Relaxed);
                            p.release(true);
                        }
                    });
                }
            });
            assert_eq!(got.load(Relaxed), 3);
            let before = r.seq;
            p.settle(&mut r, None);
            assert_eq!(r.seq - before, 3);
        }
    }

    /// A ring reclaimed (settled, renewed for another stream) while an unlocked submission
    /// of its old stream is inside the driver's call waits for it and counts it for the
    /// old stream: none of it settles into the new stream, and its reclaim cannot miss it.
    #[test]
    fn a_reclaim_waits_for_an_unlocked_submission_in_progress() {
        let p = pool();
        let mut r = Ring::EMPTY;
        p.renew(&mut r);
        let gen = p.gen();
        p.allow(&mut r, 1);
        assert!(p.reserve(gen), "a thread goes to the driver unlocked");
        let reclaimed = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            let reclaim = s.spawn(|| {
                // The reclaim: the old stream's submissions counted, then a new generation.
                p.settle(&mut r, None);
                let old = r.seq;
                p.renew(&mut r);
                reclaimed.store(true, SeqCst);
                p.settle(&mut r, None);
                (old, r.seq)
            });
            std::thread::sleep(std::time::Duration::from_millis(50));
            assert!(
                !reclaimed.load(SeqCst),
                "reclaimed while a submission of the old stream was in the driver"
            );
            p.release(true);
            let (old, new) = reclaim.join().unwrap();
            assert_eq!(old, 1, "counted for the old stream");
            assert_eq!(new, 1, "nothing settled into the new stream");
        });
    }
}
