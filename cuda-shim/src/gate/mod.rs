//! The launch gate, in offline processes (`COLOC_SHIM_CLASS=offline`).
//!
//! ```text
//!  submission (any wrapped entry point), mode gated:
//!    stream → pool (ring) and GPU (page entry, gate slot); context cached per thread
//!    one taken from the ring's quota (one CAS: left -= 1, inside += 1, at the cached
//!    generation); in_submit += 1
//!    taken and the gate open (unlocked): the driver's submission; inside -= 1 (a failed
//!      call: unmade += 1); in_submit -= 1   (no lock, no driver call)
//!    else (locked: the ring's lock; its quota withdrawn, the threads inside it waited
//!      for (each in a driver call), the unlocked ones settled into its sequence):
//!    closed? ─ yes ─► in_submit -= 1; FUTEX_WAIT(closed, 50 ms); again
//!    the bound reached on this stream (the budget's share in estimated GPU time, at
//!    least one submission, at most K)? ask the event that brings it under the bound
//!    (cuEventQuery), wait for it if not complete (cuEventSynchronize; timed), retire it
//!    and those before; at a bound of one with a lead, wait instead until the oldest is
//!    due to have that much left (FUTEX_WAIT on the gate word) and let one more in
//!    the driver's submission; seq += 1; a batch full (half the bound, at most 32) or
//!    the gate closing: cuEventRecord after it; quota: room up to one short of the bound
//!    and of the next record (none while closing); unlock; in_submit -= 1
//!  under the bound with the gate open and no capture in progress: no driver call
//!  watcher thread (FUTEX_WAIT on the gate file's generation, 100 ms):
//!    a GPU of ours closed with an epoch not yet acknowledged (in this file):
//!    in_submit == 0 → every ring's unlocked submissions settled, its quota withdrawn;
//!    every stream on that GPU drained (its newest event, or, with
//!    submissions since its last event, cuCtxSynchronize of its context)
//!    → entry.gate_ack = epoch; page wake += 1, FUTEX_WAKE
//!    once a period: every ring nobody holds with unlocked submissions not yet counted
//!    settled (the page's `submitted` true for a stream gone quiet), its quota withdrawn
//! ```
//!
//! - **Gate off** (no gate file, an invalid one, or one whose heartbeat is stale when it
//!   is first seen): mode *open*, every call passes straight through (one load and a
//!   branch). The watcher looks for the file once a second, so an agent started later is
//!   picked up; a file replaced by a restarted agent (a new inode) is picked up once the
//!   old one's heartbeat is stale.
//! - **Fail-open**: a blocked submission re-checks every 50 ms (and at every wake-up);
//!   when the agent's heartbeat is older than `COLOC_GATE_STALE_MS` (default 1000) the
//!   gate counts as open, with one line on stderr the first time.
//! - **Which GPU**: the stream's context's (for the default streams: the calling thread's
//!   current context), by UUID, as the doorbell.
//! - **Streams**: the legacy default stream (`0` in a plain entry point, or
//!   `CU_STREAM_LEGACY`) is one per context; the per-thread default stream (`0` in a
//!   `_ptsz` entry point, or `CU_STREAM_PER_THREAD`) one per thread and context; any other
//!   handle is a stream of its own. Each has a ring of events (created with the driver's
//!   own functions, flags `CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC`), one event
//!   per batch of submissions, at most [`MAX_POOLS`] rings at once (the least recently
//!   assigned idle ring is drained and reused beyond that).
//! - **Driver calls**: none per launch in the steady state with the gate open. The calling
//!   thread's context is cached until a call that can change a context (`cuCtxSetCurrent`,
//!   push, pop, create, destroy, the primary context's release and reset, all wrapped:
//!   `crate::watch::W_CTX_SWITCH`), and checked against the driver every 256 uses (a
//!   change made out of the shim's sight turns the cache off, with one line on stderr);
//!   whether a stream captures is asked only while a capture begun through
//!   `cuStreamBeginCapture[ToGraph]` has not ended; an event is recorded once per batch
//!   (half the stream's bound, at most 32 submissions) and asked when the bound is reached.
//! - **CUDA graph capture**: a submission to a stream in capture (`cuStreamIsCapturing`;
//!   `CU_STREAM_PER_THREAD` for stream 0 of a `_ptsz` entry point; never asked of the
//!   legacy stream, which cannot be captured) runs nothing on the GPU: it adds a node to the
//!   application's graph, whose later `cuGraphLaunch` is the submission that is gated. So
//!   it is forwarded untouched: no wait at the gate, no ring, no event (recorded there, our
//!   event would become a node of the graph, and waiting for it is illegal), not counted.
//!   Every event query or wait of the shim's own ([`relaxed`]: the bound, the watcher,
//!   ring reclaim) runs, while some capture is in progress, with the thread's capture mode
//!   exchanged to RELAXED and restored:
//!   while another thread captures in mode GLOBAL (PyTorch's default), the driver refuses
//!   such a call from a thread in another mode (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`)
//!   and invalidates that capture. Both entry points are optional (a driver older than
//!   CUDA 10.1: nothing is capturing, no mode to exchange).
//! - Any internal failure: [`crate::mode::disable`] (pass-through for good, one line).

mod budget;
mod events;
mod gpus;
mod map;
mod streams;
mod submit;
mod watch;

pub use submit::{submit, submitting};
pub use watch::{map_at_start, start_watcher};

use crate::config::{GateConfig, DEFAULT_INFLIGHT, DEFAULT_INFLIGHT_US};
use coloc_doorbell::gate::DEFAULT_STALE_NS;
use std::ffi::{c_int, CString};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::*};
use std::sync::OnceLock;

/// `CUDA_SUCCESS`.
const CUDA_SUCCESS: c_int = 0;

/// K: submissions in flight per stream (`COLOC_SHIM_INFLIGHT`; 0: unbounded).
static INFLIGHT: AtomicU32 = AtomicU32::new(DEFAULT_INFLIGHT);

/// In-flight budget per process and GPU, ns of estimated GPU time
/// (`COLOC_SHIM_INFLIGHT_MS`; 0: off), shared evenly among the process's streams there.
static BUDGET_NS: AtomicU64 = AtomicU64::new(DEFAULT_INFLIGHT_US * 1_000);

/// An agent heartbeat older than this opens the gate (`COLOC_GATE_STALE_MS`).
static STALE_NS: AtomicU64 = AtomicU64::new(DEFAULT_STALE_NS);

/// The agent's gate file (`COLOC_GATE_FILE`).
static GATE_PATH: OnceLock<CString> = OnceLock::new();

/// Takes the gate's settings and resolves its driver functions (offline processes, at the
/// first submission). An error is the line to print.
pub fn configure(c: &GateConfig) -> Result<(), String> {
    INFLIGHT.store(c.inflight, Relaxed);
    BUDGET_NS.store(c.budget_ns, Relaxed);
    STALE_NS.store(c.stale_ns, Relaxed);
    let _ = GATE_PATH.set(c.gate_file.clone());
    crate::driver::resolve_gate_fns()
}
