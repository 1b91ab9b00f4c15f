//! The watcher thread: finds the gate file, and acknowledges each close of a GPU of this
//! process once its submissions are blocked and its work in flight is complete.

use super::events::{sync_ctx, sync_event, with_ctx};
use super::gpus::{Gpu, GPUS};
use super::map::{map_gate_file, mapping, stale};
use super::streams::{lock, settle_all, POOLS};
use super::CUDA_SUCCESS;
use crate::mode::{self, GATED, OFF, OPEN};
use coloc_doorbell::{futex_wait, now_ns, MAX_GPUS};
use std::panic::catch_unwind;
use std::sync::atomic::Ordering::*;

/// The watcher re-checks the heartbeat this often while nothing wakes it.
const WATCH_RECHECK_NS: u64 = 100_000_000;

/// The watcher looks for a (new) gate file at most this often.
const FILE_RECHECK_NS: u64 = 1_000_000_000;

/// Maps the gate file at the first submission; true if it is valid and fresh (the gate
/// is then in force from this submission on).
pub fn map_at_start() -> bool {
    map_gate_file(None).is_some()
}

/// Starts the watcher thread (offline processes, at the first submission: never in a
/// constructor, never in a fork child, which has its mode off).
pub fn start_watcher() -> Result<(), String> {
    std::thread::Builder::new()
        .name("coloc-gate".into())
        .spawn(|| {
            if catch_unwind(watch).is_err() {
                mode::disable("internal error in the launch gate's watcher");
            }
        })
        .map(|_| ())
        .map_err(|e| format!("cannot start the launch gate's thread: {e}"))
}

fn watch() {
    // Signals meant for the application's threads are never delivered here.
    // SAFETY: a full set, applied to this thread only.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, std::ptr::null_mut());
    }
    // Per GPU: (mapping epoch, gate epoch) last acknowledged by this watcher.
    let mut acked = [(0u32, 0u32); MAX_GPUS];
    let mut next_file_check = 0u64;
    let mut next_settle = 0u64;
    loop {
        if matches!(mode::MODE.load(Acquire), OFF) {
            return;
        }
        let now = now_ns();
        let current = mapping();
        let fresh = current.is_some_and(|m| !stale(m));
        if !fresh && now >= next_file_check {
            next_file_check = now + FILE_RECHECK_NS;
            map_gate_file(current);
        }
        let Some(m) = mapping() else {
            std::thread::sleep(std::time::Duration::from_nanos(
                next_file_check.saturating_sub(now_ns()).max(1_000_000),
            ));
            continue;
        };
        if !stale(m) {
            let _ = mode::MODE.compare_exchange(OPEN, GATED, AcqRel, Acquire);
        }
        let gen = m.gates.generation();
        if mode::MODE.load(Acquire) == GATED && !stale(m) {
            for (i, g) in GPUS.iter().enumerate() {
                if let Some(a) = acknowledge(g, i, acked[i]) {
                    acked[i] = a;
                }
            }
            // Unlocked submissions of streams gone quiet between records: counted.
            if now >= next_settle {
                next_settle = now + WATCH_RECHECK_NS;
                settle_all();
            }
        }
        futex_wait(&m.gates.header().generation, gen, WATCH_RECHECK_NS);
    }
}

/// If GPU `i`'s gate is closed with an epoch not acknowledged yet: waits until no thread
/// is inside a submission for it and its in-flight work is complete, then acknowledges.
/// Returns the new (mapping epoch, gate epoch) acknowledged.
fn acknowledge(g: &Gpu, i: usize, last: (u32, u32)) -> Option<(u32, u32)> {
    let entry = g.entry()?;
    let (m, slot) = g.gate()?;
    let c = slot.closed.load(SeqCst);
    if c == 0 || (m.epoch, c) == last {
        return None;
    }
    loop {
        if slot.closed.load(SeqCst) != c || stale(m) || mode::MODE.load(Acquire) != GATED {
            return None;
        }
        let n = entry.in_submit.load(SeqCst);
        if n == 0 {
            break;
        }
        futex_wait(&entry.in_submit, n, 10_000_000);
    }
    for p in POOLS.iter() {
        if p.gpu.load(Acquire) != i {
            continue;
        }
        let mut r = lock(&p.ring);
        if p.gpu.load(Acquire) != i {
            continue;
        }
        // Every unlocked submission is counted (one still inside its driver call is waited
        // for), and none goes unlocked until a locked one allows it again.
        p.settle(&mut r, Some(entry));
        // Submissions since the last event (fewer than a batch) are covered by no event:
        // the context's own synchronisation waits for them (every stream of this process
        // in that context; nothing else of ours runs there while the gate is closed),
        // with the newest event as the fallback where the driver refuses it.
        let newest = r.events.back().map(|x| x.0);
        if r.seq > r.recorded_seq {
            if with_ctx(r.ctx, sync_ctx) != CUDA_SUCCESS {
                if let Some(e) = newest {
                    with_ctx(r.ctx, || sync_event(e));
                }
            }
        } else if let Some(e) = newest {
            with_ctx(r.ctx, || sync_event(e));
        }
        let n = r.recorded_seq - r.done_seq;
        let done: Vec<usize> = r.events.drain(..).map(|x| x.0).collect();
        // Held at the gate: the stream's run is broken (its estimate stays).
        r.all_done();
        r.free.extend(done);
        entry.inflight.fetch_sub(n as u32, Relaxed);
    }
    entry.gate_ack.store(c, SeqCst);
    if let Some(p) = crate::page::page() {
        p.bump_and_wake();
    }
    Some((m.epoch, c))
}
