//! # libcoloc_cuda.so — the gpu-coloc CUDA driver-API shim
//!
//! Loaded with `LD_PRELOAD` into a GPU process. In an **online** process
//! (`COLOC_SHIM_CLASS=online`) it is a doorbell: every submission of GPU work stamps its
//! time for the GPU it targets in a one-page shared file (`coloc-doorbell`), and the
//! first submission after a pause wakes the node agent; and when a synchronising call
//! shows all the process's work on a GPU complete, it stamps that time too ([`drain`]).
//! In an **offline** process
//! (`COLOC_SHIM_CLASS=offline`) it is the **launch gate** ([`gate`]): while the agent holds
//! a GPU's gate closed, the process's next submission to that GPU blocks, and at most K
//! submissions per stream are in flight, so what keeps running after a close is short.
//! Every other call, and every call in a process of any other class, passes straight
//! through.
//!
//! ```text
//!  libcudart / cuBLAS / Triton / NCCL
//!     │ dlopen("libcuda.so.1"); dlsym(h, "cuGetProcAddress_v2")
//!     ▼
//!  dlsym (ours, naked) ── a cu* name we wrap? ──► our wrapper (real pointer kept)
//!     │ otherwise: tail-jump to the next dlsym (the caller's RTLD_NEXT stays the caller's)
//!  cuGetProcAddress[_v2] (ours) ── launch entry point? ──► a forwarding slot
//!     │                        └─ synchronising call, event call, synchronous copy?
//!     │                                                ──► a watch slot
//!     │ anything else: the driver's pointer, untouched
//!  slot N: online: ring the doorbell │ offline, gate in force: the gate │ else nothing;
//!          then call the driver's pointer for slot N
//!  watch slot N: online: the driver's pointer, and a completion stamp if it showed all
//!          work done │ else: the driver's pointer, nothing more
//! ```
//!
//! - **How the CUDA 12 runtime is caught**: it looks up `cuGetProcAddress_v2` with `dlsym`
//!   on its own handle of `libcuda.so.1`, which `LD_PRELOAD` alone never sees, and then asks
//!   that getter for every entry point by base name. `hooks::dlsym` interposes `dlsym`;
//!   [`hooks`]
//!   wraps the getters (both versions, and themselves when asked for) and hands out a
//!   forwarding slot per real launch pointer, so every variant (`_ptsz`, old ABIs) calls
//!   exactly the pointer the driver returned for it. Programs linked against `libcuda`
//!   directly reach the exported launch symbols instead. Each slot also knows where its
//!   entry point takes the stream (`launch::kind_of`) and whether stream 0 means the
//!   per-thread default stream (a `_ptsz` name, or the getter's
//!   `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM` flag), which only the gate uses.
//! - **Which GPU**: the current context's device, by UUID (`cuCtxGetCurrent` →
//!   `cuCtxGetDevice` → `cuDeviceGetUuid`), cached per thread and context, so
//!   `CUDA_VISIBLE_DEVICES` remapping does not matter. The gate uses the stream's
//!   context for a created stream (`cuStreamGetCtx`, once per stream).
//! - **Cost**: see `benches/RESULTS.md` (`cargo bench -p coloc-e2e --bench shim_launch`).
//!   Pass-through (no class, no `COLOC_DOORBELL_DIR`, or offline without a gate file) costs
//!   one load and a branch beyond the forwarding; the online busy path a clock read, a few
//!   loads and stores and one atomic swap (the thread's mark that it is inside a
//!   submission, [`threads`]); the gated path (gate open) three atomic read-modify-writes
//!   and a per-stream lock, and no driver call in the steady state (one `cuEventRecord`
//!   per batch of submissions, one `cuEventQuery` each time the bound is reached; the
//!   context cached): about 60–70 ns over no shim on the fake driver (legacy stream).
//! - **Never breaks its host process**: any internal failure turns the shim into a
//!   pass-through and prints one line on stderr; nothing panics across the C boundary. A
//!   forked child passes through (it must not ring or gate on its parent's page). A page
//!   or gate file truncated under the process does not kill it with SIGBUS ([`guard`]):
//!   zeros take its place and the shim passes through.
//! - **Beside other interposers** (HAMi-core): `hooks::dlsym` also interposes `dlvsym`,
//!   so that an interposer loaded before the shim that asks for "the real `dlsym`" with
//!   `dlvsym(RTLD_NEXT, "dlsym", …)` gets the shim's; the shim's own `dlsym` goes on to
//!   the next one after it ([`dl`]). A submission an interposer's hook makes while the
//!   shim's wrapper of the same submission is calling it passes through (gated once).
//! - **Where it loads**: glibc 2.17 and later when built by `scripts/build-compat` (Zig);
//!   in a musl process it finds no glibc and passes every call through.
//!
//! ## The launch gate (offline)
//!
//! Protocol and layout: `coloc_doorbell::gate` (the agent's gate file) and
//! `coloc_doorbell::Entry` (the process's page). In short:
//!
//! - At the first submission the shim creates its page (class 2) in `COLOC_DOORBELL_DIR`
//!   (none: no page, no gate, pass-through) and maps the gate file read-only
//!   (`COLOC_GATE_FILE`, default `/run/gpu-coloc/gate/gates`). No valid file with a fresh
//!   heartbeat: the gate is off (pass-through); a watcher thread looks for the file once a
//!   second and turns the gate on when it appears (or when a restarted agent replaces it).
//! - Gate on, per submission, for the GPU it targets: `in_submit += 1`, read the gate
//!   word; closed: `in_submit -= 1`, note `blocked_ns`, `FUTEX_WAIT` on the word (50 ms at
//!   a time, re-checking), and go on when it opens — or when the agent's heartbeat is
//!   older than `COLOC_GATE_STALE_MS` (fail-open, one stderr line). Only the calling thread
//!   waits. Then, with the bound reached on the stream (the budget's share, at least one
//!   submission, at most K), ask the event that brings it under the bound and wait for it
//!   if it is not complete (`cuEventSynchronize`), retiring it and those before; go back
//!   to the gate if it closed meanwhile; the driver's submission; `cuEventRecord` after
//!   it when its batch is full or the gate is closing (`inflight += ` the batch),
//!   `in_submit -= 1`.
//! - The watcher thread (started at the first submission, never in a constructor or a
//!   fork child) sleeps on the gate file's generation word. For a GPU of this process
//!   closed with an epoch it has not acknowledged (in this file): it waits until
//!   `in_submit == 0`, then for every stream on that GPU to drain (its newest event; with
//!   submissions since its last event, `cuCtxSynchronize` of its context, the newest
//!   event where the driver refuses that), then writes
//!   `gate_ack = epoch` and bumps and wakes the page's `wake` word. An idle process
//!   acknowledges at once; a busy one once its in-flight work has drained.
//! - **K** (`COLOC_SHIM_INFLIGHT`, default 64; 0 = unbounded): a ceiling on submissions
//!   in flight per stream. The budget sets the bound; K only caps it where kernels are so
//!   short that the budget would let hundreds in (the driver blocks a stream at about a
//!   thousand), and sets it alone with the budget off.
//! - **The budget** (`COLOC_SHIM_INFLIGHT_MS`, default 0.5; 0 = none): estimated GPU time
//!   in flight per process and GPU, shared evenly among the process's streams on that GPU
//!   (at least one submission per stream, at most K): 0.5 ms, half of a 1 ms inference
//!   request, so that the work a release leaves in flight when the next request comes is
//!   a fraction of it (the H100's drain step measured 6.1 ms of queued work at the old
//!   K = 4 / 3 ms per stream; `benches/RESULTS.md`). Completions are tracked one event per
//!   batch of submissions (half the bound, at most 32): every completion found at the
//!   bound times the submissions its event covers, from the previous completion found
//!   while the stream stayed backlogged (or its batch's first submission) to when it was
//!   found, over their number: the wall-clock time the stream took for each, wake-ups
//!   and other contexts' time slices included. The estimate moves a quarter of the way up
//!   to a longer sample and an eighth of the way down to a shorter one (samples are noisy
//!   both ways; leaning long keeps the bound near the budget on a loaded host), a sample
//!   counting at most 8 times the estimate (so that a stall of the thread itself does not
//!   throttle short kernels); the bound is the number of submissions whose estimate fits
//!   the stream's share, at least 1 and at most K (1 until four samples). Where one
//!   submission is the bound, a lead (what the share leaves beyond it, or the share itself
//!   for a submission longer than it; at most 0.5 ms): the next submission goes in when
//!   the oldest is due (by the estimate) to have that much left, instead of after it
//!   ends, so the GPU does not wait for the thread's wake-up between two kernels. A sleep
//!   that overshot (the oldest was done already) brings the estimate down. What runs on
//!   after a close is then about max(budget, one kernel + the lead) per process and GPU;
//!   figures in `benches/RESULTS.md` (simulated; real CUDA unchecked).
//! - **Not gated**: the synchronous copies and memsets, `cuStreamWaitEvent`, and work
//!   that `cuLaunchCooperativeKernelMultiDevice` queues (gated on the current GPU, its
//!   work not tracked). A submission already past the mode check when the gate file first
//!   appears is not counted (one driver call's window).
//!
//! Environment: `COLOC_SHIM_CLASS` (`online`, `offline`; anything else: pass-through),
//! `COLOC_DOORBELL_DIR` (where to create `<pid>-<nonce>.bell`), `COLOC_SHIM_WAKE_GAP_MS`
//! (online: a launch this long after the previous one on the same GPU wakes the agent;
//! default 100), `COLOC_GATE_FILE`, `COLOC_SHIM_INFLIGHT`, `COLOC_SHIM_INFLIGHT_MS`,
//! `COLOC_GATE_STALE_MS` (offline: the gate file, K, the budget and the heartbeat bound;
//! defaults `/run/gpu-coloc/gate/gates`, 4, 3, 1000), `COLOC_SHIM_TRACE` (`1`: one stderr line per distinct lookup, see [`trace`]).
//!
//! ## Files, and which uses which
//!
//! Each file uses only the ones above it, never one below (no import circle):
//!
//! ```text
//!  dl        glibc's own dlsym (the shim's lookups never go through its own dlsym)
//!  mode      the mode (unset, on, off, open, gated) and the one-line failure
//!  config    the environment (millisecond values parsed in one place)
//!  trace     COLOC_SHIM_TRACE lines
//!  guard     SIGBUS on a truncated mapping: zeros, pass-through          ← mode
//!  driver    the driver's functions the shim calls itself            ← dl
//!  launch    submission entry points: names, stream argument, capture ← driver
//!  watch     synchronising calls, event calls, synchronous copies: names ← launch
//!  threads   each thread's record of its submissions per GPU              ← mode
//!  page      the doorbell page: create, ring            ← driver, guard, mode, threads
//!  drain     completion stamps (online)          ← launch, page, threads, watch
//!  gate/     the launch gate (offline)           ← config, driver, guard, launch, mode, page
//!    mod (settings) → map, gpus, events → streams → budget → submit, watch
//!  setup     the first submission decides the mode      ← config, driver, gate, mode, page
//!  hooks/    the entry points: getters, slots and watch slots (mod), dlsym, exported
//!            symbols                                    ← everything above
//! ```
//!

#![allow(clippy::missing_safety_doc)]

mod config;
mod dl;
mod drain;
mod driver;
mod gate;
mod guard;
mod hooks;
mod launch;
mod mode;
mod page;
mod setup;
mod threads;
pub mod trace;
mod watch;
