//! # coloc-doorbell — the launch doorbell's shared page
//!
//! One page (4 KiB) per process that loaded `libcoloc_cuda.so`, in a file the agent and
//! the process both map (`MAP_SHARED`). The shim in an online process writes the time of
//! its latest submission per GPU; the agent reads it. Nothing in it is a command: the
//! agent bounds-checks every field and decides whom to suspend from its own process
//! table, never from this page.
//!
//! ```text
//!  online process (shim)                        node agent (maps it read-only)
//!  cuLaunchKernel ─► entry[uuid].last_launch ──►  read at each wake-up and tick
//!   first launch after a pause ≥ wake_gap:
//!     entry.busy_since = now, header.wake += 1, FUTEX_WAKE ──► futex_waitv returns
//! ```
//!
//! - **Fast path** (launches closer together than the wake gap): a clock read, two loads,
//!   one store. No system call.
//! - **Idle → busy**: a launch at least `header.wake_gap_ns` after the previous one on
//!   the same GPU starts a *run*: `busy_since` takes its time (the onset the agent
//!   reports), the header's futex word is bumped and woken. One `futex` system call per
//!   run, not per launch. The gap defaults to the agent's default idle window (100 ms), so
//!   "busy" means the same thing on both sides.
//! - The agent never writes the page: it maps it read-only, so a page can be owned by the
//!   process that writes it (mode 0644) and nothing the agent does depends on a tenant
//!   granting it write access.
//!
//! Layout (all fields little-endian atomics, offsets fixed by `#[repr(C)]`), version 3:
//! [`Header`] (64 bytes: magic `"COLOCDB1"`, version, PID, `wake` futex word, `class`
//! (1 online, 2 offline: informational, never trusted), wake gap, creation time), then
//! [`MAX_GPUS`] × [`Entry`] (128 bytes each: state, UUID, `last_launch_ns`,
//! `busy_since_ns`, `wakes`, the launch gate's `inflight`, `in_submit`, `gate_ack`,
//! `blocked_ns`, `submitted`, and `drained_ns`). Readers accept versions 1 and 2 too (the
//! same layout with the fields added since 0; a version 1 or 2 page's `drained_ns` reads
//! as 0 whatever its word holds).
//!
//! **Completion** (version 3, online processes): [`Entry::drained_ns`] is when the
//! process last saw all the work it had submitted on that GPU complete — a synchronising
//! call (a context, stream or event synchronize or query, a device-to-host copy) returned
//! successfully, it covered every submission the process had made on that GPU, and no
//! submission on that GPU began between the start of that call and the stamp. A launch
//! time says when work was queued; this says when it was seen done, so a reader can tell
//! "launched 2 ms ago and still running" from "launched 2 ms ago and finished". 0: never
//! seen. It is the tenant's word like every field here: the most it can claim is that its
//! own work is done. Read it with [`Page::drained_ns`]: work launched after it
//! (`last_launch_ns > drained_ns`) is not covered.
//!
//! **Offline processes** write a page too (class 2), for the launch gate ([`gate`]): they
//! never stamp launch times; they keep the gate fields of the entry of each GPU they
//! submit to, and every time they write [`Entry::gate_ack`] they bump the header's `wake`
//! word and wake it ([`Page::bump_and_wake`]), so an agent asleep in `futex_waitv` on the
//! pages learns of the acknowledgement at once. The agent reads them with
//! [`Page::read_gate`].
//!
//! **A truncated mapping** ([`guard`]): either side's file can be shrunk under its
//! mapping by someone else (a tenant, another process of the pod); both the agent and the
//! shim register their mappings with the one SIGBUS guard here, which puts private zeros
//! in place of such a page instead of letting the fault end the process.
//!
//! Clock: `CLOCK_REALTIME` nanoseconds (the clock of NVML's sample timestamps).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::*};

pub mod file;
pub mod gate;
pub mod guard;

/// Identifies a doorbell page of this layout ("COLOCDB1").
pub const MAGIC: u64 = 0x3142_4443_4f4c_4f43;
/// Layout version written by this crate (2: the header's `class`, and the gate fields of
/// [`Entry`]; 3: [`Entry::drained_ns`]). Readers also accept version 1 and 2 pages (the
/// same layout with the later fields 0).
pub const VERSION: u32 = 3;
/// First layout version with [`Entry::drained_ns`].
pub const DRAINED_VERSION: u32 = 3;
/// Oldest layout version readers accept.
pub const MIN_VERSION: u32 = 1;
/// [`Header::class`] of an online process (informational: the agent never trusts it).
pub const CLASS_ONLINE: u32 = 1;
/// [`Header::class`] of an offline process (informational: the agent never trusts it).
pub const CLASS_OFFLINE: u32 = 2;
/// Most GPUs one process can ring for.
pub const MAX_GPUS: usize = 16;
/// Size of the page (and of the file).
pub const PAGE: usize = 4096;
/// File name suffix of a doorbell page.
pub const SUFFIX: &str = ".bell";
/// Suffix of a page while its writer prepares it (`<name>.bell.new`): readers ignore it;
/// the writer renames it to its `.bell` name once the page is complete.
pub const TEMP_SUFFIX: &str = ".new";
/// Default wake gap: a launch this long after the previous one on the same GPU starts a
/// new run and wakes the agent (the agent's default idle window).
pub const DEFAULT_WAKE_GAP_NS: u64 = 100_000_000;

const ENTRY_FREE: u32 = 0;
const ENTRY_CLAIMING: u32 = 1;
const ENTRY_READY: u32 = 2;

/// The page's header.
#[repr(C)]
#[derive(Debug)]
pub struct Header {
    /// [`MAGIC`] once initialised (written last by the creator).
    pub magic: AtomicU64,
    /// [`VERSION`].
    pub version: AtomicU32,
    /// The writer's PID as it sees itself (informational: never trusted).
    pub pid: AtomicU32,
    /// Futex word: bumped, then woken, at the start of every run (online), and whenever
    /// an offline process writes an [`Entry::gate_ack`].
    pub wake: AtomicU32,
    /// [`CLASS_ONLINE`], [`CLASS_OFFLINE`], or 0 (not stated). Informational only.
    pub class: AtomicU32,
    /// The writer's wake gap, ns (0: [`DEFAULT_WAKE_GAP_NS`]).
    pub wake_gap_ns: AtomicU64,
    /// When the page was created, ns.
    pub created_ns: AtomicU64,
    _reserved: [u64; 3],
}

/// One GPU the process submitted work to.
#[repr(C)]
#[derive(Debug)]
pub struct Entry {
    /// Free / claiming / ready.
    state: AtomicU32,
    _pad: u32,
    /// GPU UUID, bytes 0–7 (as `u64::from_le_bytes`).
    uuid_lo: AtomicU64,
    /// GPU UUID, bytes 8–15.
    uuid_hi: AtomicU64,
    /// Time of the latest submission, ns.
    pub last_launch_ns: AtomicU64,
    /// Time of the first submission of the current run, ns.
    pub busy_since_ns: AtomicU64,
    /// Runs started (wake-ups sent) on this GPU.
    pub wakes: AtomicU64,
    /// Launch gate (offline processes): this process's submissions on this GPU not yet
    /// known complete.
    pub inflight: AtomicU32,
    /// Launch gate: threads between the gate check and the end of their submission.
    pub in_submit: AtomicU32,
    /// Launch gate: the last gate epoch this process acknowledged: every submitting
    /// thread is blocked at the gate or idle, and the work it had in flight before the
    /// close is complete. Every write is followed by a bump and wake of [`Header::wake`].
    pub gate_ack: AtomicU32,
    _pad2: u32,
    /// Launch gate: when a thread first blocked at the gate in the current close, ns
    /// (`CLOCK_REALTIME`); 0 when none is blocked.
    pub blocked_ns: AtomicU64,
    /// Launch gate: submissions made on this GPU (counted by the offline shim).
    pub submitted: AtomicU64,
    /// Online (version 3): when the process last saw every submission it had made on this
    /// GPU complete, ns (`CLOCK_REALTIME`); 0: never. Written only after a synchronising
    /// call that covered all of them returned successfully with no submission on this GPU
    /// begun since the call started (see the crate docs); never moves back.
    pub drained_ns: AtomicU64,
    _reserved: [u64; 5],
}

const _: () = assert!(std::mem::size_of::<Header>() == 64);
const _: () = assert!(std::mem::size_of::<Entry>() == 128);
// Fields keep their offsets across versions (older readers and writers share the page).
const _: () = assert!(std::mem::offset_of!(Entry, last_launch_ns) == 24);
const _: () = assert!(std::mem::offset_of!(Entry, blocked_ns) == 64);
const _: () = assert!(std::mem::offset_of!(Entry, submitted) == 72);
const _: () = assert!(std::mem::offset_of!(Entry, drained_ns) == 80);
const _: () =
    assert!(std::mem::size_of::<Header>() + MAX_GPUS * std::mem::size_of::<Entry>() <= PAGE);

/// What the agent reads from one entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reading {
    /// Entry index.
    pub index: usize,
    /// GPU UUID bytes.
    pub uuid: [u8; 16],
    /// Latest submission, ns.
    pub last_launch_ns: u64,
    /// Start of the current run, ns (never after `last_launch_ns`).
    pub busy_since_ns: u64,
}

/// A view of one mapped page. The mapping is owned by whoever made the view.
#[derive(Debug, Clone, Copy)]
pub struct Page<'a> {
    header: &'a Header,
    entries: &'a [Entry; MAX_GPUS],
}

impl<'a> Page<'a> {
    /// A view of `PAGE` bytes at `base`.
    ///
    /// # Safety
    /// `base` must be valid, 8-aligned, for reads and writes of [`PAGE`] bytes for `'a`,
    /// and only accessed through atomics by everyone who maps it.
    pub unsafe fn from_raw(base: *mut u8) -> Page<'a> {
        // SAFETY: the caller guarantees size, alignment and lifetime; every field is an
        // atomic integer, valid for any bit pattern.
        unsafe {
            Page {
                header: &*(base as *const Header),
                entries: &*(base.add(std::mem::size_of::<Header>()) as *const [Entry; MAX_GPUS]),
            }
        }
    }

    /// The header.
    pub fn header(&self) -> &'a Header {
        self.header
    }

    /// Initialises a fresh (zeroed) page for the writer `pid` with its wake gap (class not
    /// stated).
    pub fn init(&self, pid: u32, wake_gap_ns: u64, now_ns: u64) {
        self.init_class(pid, 0, wake_gap_ns, now_ns);
    }

    /// Initialises a fresh (zeroed) page for the writer `pid` of `class`
    /// ([`CLASS_ONLINE`], [`CLASS_OFFLINE`]) with its wake gap.
    pub fn init_class(&self, pid: u32, class: u32, wake_gap_ns: u64, now_ns: u64) {
        self.header.class.store(class, Relaxed);
        self.header.version.store(VERSION, Relaxed);
        self.header.pid.store(pid, Relaxed);
        self.header.wake_gap_ns.store(wake_gap_ns, Relaxed);
        self.header.created_ns.store(now_ns, Relaxed);
        self.header.magic.store(MAGIC, Release);
    }

    /// The writer's wake gap, ns.
    pub fn wake_gap_ns(&self) -> u64 {
        match self.header.wake_gap_ns.load(Relaxed) {
            0 => DEFAULT_WAKE_GAP_NS,
            g => g,
        }
    }

    /// The page carries this layout (version [`MIN_VERSION`] to [`VERSION`]).
    pub fn valid(&self) -> bool {
        self.header.magic.load(Acquire) == MAGIC
            && (MIN_VERSION..=VERSION).contains(&self.header.version.load(Relaxed))
    }

    /// The class the writer states ([`CLASS_ONLINE`], [`CLASS_OFFLINE`], 0 or anything
    /// else: not stated). Informational: never trusted.
    pub fn class(&self) -> u32 {
        self.header.class.load(Relaxed)
    }

    /// Entry `index` (bounds-checked).
    pub fn entry(&self, index: usize) -> Option<&'a Entry> {
        self.entries.get(index)
    }

    /// The index of entry `e` of this page (`None` if `e` is not one of its entries).
    pub fn index_of(&self, e: &Entry) -> Option<usize> {
        self.entries.iter().position(|x| std::ptr::eq(x, e))
    }

    /// Bumps the header's wake word and wakes whoever waits on it (writer side; an offline
    /// process after it wrote an [`Entry::gate_ack`]).
    pub fn bump_and_wake(&self) {
        self.header.wake.fetch_add(1, Release);
        futex_wake(&self.header.wake);
    }

    /// Reads the launch-gate fields of every ready entry (agent side).
    pub fn read_gate(&self, out: &mut Vec<GateReading>) {
        for (index, e) in self.entries.iter().enumerate() {
            if e.state.load(Acquire) != ENTRY_READY {
                continue;
            }
            out.push(GateReading {
                index,
                uuid: e.uuid(),
                gate_ack: e.gate_ack.load(Acquire),
                inflight: e.inflight.load(Relaxed),
                in_submit: e.in_submit.load(Relaxed),
                blocked_ns: e.blocked_ns.load(Relaxed),
                submitted: e.submitted.load(Relaxed),
            });
        }
    }

    /// The entry for `uuid`, claiming a free one if needed (writer side). `None` when all
    /// [`MAX_GPUS`] are taken by other GPUs.
    pub fn entry_for(&self, uuid: &[u8; 16]) -> Option<&'a Entry> {
        self.entries
            .iter()
            .find(|e| claim(&e.state, &e.uuid_lo, &e.uuid_hi, uuid) == Claim::Mine)
    }

    /// The ready entry for `uuid`, if there is one (never claims one).
    pub fn find(&self, uuid: &[u8; 16]) -> Option<&'a Entry> {
        self.entries
            .iter()
            .find(|e| is_for(&e.state, &e.uuid_lo, &e.uuid_hi, uuid))
    }

    /// Records a submission at `now_ns` on entry `e` (writer side), with the writer's wake
    /// gap. Returns true when it started a run: the caller must then wake the agent
    /// ([`Page::wake`]).
    #[inline]
    pub fn ring(&self, e: &Entry, now_ns: u64, wake_gap_ns: u64) -> bool {
        self.ring_unless(e, now_ns, wake_gap_ns, || false)
    }

    /// [`Page::ring`], except that a submission that would start a run is not recorded
    /// at all when `skip()` says so. `skip` is asked only of such a submission: once per
    /// run start, and of every submission it skips while the GPU stays idle for this
    /// page (a skipped one stamps nothing).
    #[inline]
    pub fn ring_unless(
        &self,
        e: &Entry,
        now_ns: u64,
        wake_gap_ns: u64,
        skip: impl FnOnce() -> bool,
    ) -> bool {
        let prev = e.last_launch_ns.load(Relaxed);
        let edge = now_ns.saturating_sub(prev) >= wake_gap_ns;
        if edge && skip() {
            return false;
        }
        if edge {
            e.busy_since_ns.store(now_ns, Relaxed);
        }
        e.last_launch_ns.store(now_ns, Release);
        if edge {
            e.wakes.fetch_add(1, Relaxed);
            self.header.wake.fetch_add(1, Release);
        }
        edge
    }

    /// Wakes whoever waits on the header's futex word (writer side, after [`Page::ring`]
    /// returned true).
    pub fn wake(&self) {
        futex_wake(&self.header.wake);
    }

    /// Reads every ready entry (agent side): bounds-checked, torn values impossible (one
    /// atomic per field), `busy_since` clamped to `last_launch`.
    pub fn read(&self, out: &mut Vec<Reading>) {
        for (index, e) in self.entries.iter().enumerate() {
            if e.state.load(Acquire) != ENTRY_READY {
                continue;
            }
            let last = e.last_launch_ns.load(Acquire);
            let since = e.busy_since_ns.load(Relaxed);
            out.push(Reading {
                index,
                uuid: e.uuid(),
                last_launch_ns: last,
                busy_since_ns: if since == 0 || since > last {
                    last
                } else {
                    since
                },
            });
        }
    }

    /// When the writer last saw all its work on entry `index`'s GPU complete
    /// ([`Entry::drained_ns`]), as a reader at `now_ns` may take it: 0 (not known) for a
    /// page older than version 3, an entry that is not ready, or a time after `now_ns`
    /// (a claim from the future is no evidence of anything). Evidence about the writer's
    /// own work only, never more: launches after it are not covered.
    pub fn drained_ns(&self, index: usize, now_ns: u64) -> u64 {
        if self.header.version.load(Relaxed) < DRAINED_VERSION {
            return 0;
        }
        match self.entries.get(index) {
            Some(e) if e.state.load(Acquire) == ENTRY_READY => match e.drained_ns.load(Acquire) {
                t if t <= now_ns => t,
                _ => 0,
            },
            _ => 0,
        }
    }

    /// Records that every submission this process made on entry `e`'s GPU was seen
    /// complete at `now_ns` (writer side; see [`Entry::drained_ns`]). Never moves the stamp
    /// back (two threads may stamp at once).
    pub fn stamp_drained(&self, e: &Entry, now_ns: u64) {
        e.drained_ns.fetch_max(now_ns, Release);
    }

    /// Wake-ups taken on entry `index`.
    pub fn wakes(&self, index: usize) -> u64 {
        self.entries.get(index).map_or(0, |e| e.wakes.load(Relaxed))
    }
}

impl Entry {
    /// The GPU UUID this entry is for (meaningful once the entry is ready).
    pub fn uuid(&self) -> [u8; 16] {
        join(self.uuid_lo.load(Relaxed), self.uuid_hi.load(Relaxed))
    }
}

/// What the agent reads from one entry about the launch gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GateReading {
    /// Entry index.
    pub index: usize,
    /// GPU UUID bytes.
    pub uuid: [u8; 16],
    /// [`Entry::gate_ack`].
    pub gate_ack: u32,
    /// [`Entry::inflight`].
    pub inflight: u32,
    /// [`Entry::in_submit`].
    pub in_submit: u32,
    /// [`Entry::blocked_ns`].
    pub blocked_ns: u64,
    /// [`Entry::submitted`].
    pub submitted: u64,
}

#[derive(PartialEq, Eq)]
pub(crate) enum Claim {
    /// The record is (now) for this UUID.
    Mine,
    /// The record is another UUID's, or not a claimable state.
    Other,
}

/// Finds or claims a record (`state`, `lo`, `hi`: free / claiming / ready) for `uuid`.
pub(crate) fn claim(
    state: &AtomicU32,
    lo_w: &AtomicU64,
    hi_w: &AtomicU64,
    uuid: &[u8; 16],
) -> Claim {
    let (lo, hi) = split(uuid);
    loop {
        match state.load(Acquire) {
            ENTRY_READY => {
                return if lo_w.load(Relaxed) == lo && hi_w.load(Relaxed) == hi {
                    Claim::Mine
                } else {
                    Claim::Other
                };
            }
            ENTRY_FREE => {
                if state
                    .compare_exchange(ENTRY_FREE, ENTRY_CLAIMING, AcqRel, Acquire)
                    .is_ok()
                {
                    lo_w.store(lo, Relaxed);
                    hi_w.store(hi, Relaxed);
                    state.store(ENTRY_READY, Release);
                    return Claim::Mine;
                }
            }
            // Another thread is writing this record's UUID: it is ready in a few
            // instructions.
            ENTRY_CLAIMING => std::hint::spin_loop(),
            // Garbage (a reader's view of a page it does not own): never claimable.
            _ => return Claim::Other,
        }
    }
}

/// Whether `uuid`'s record is ready (reader side: never claims, never spins).
pub(crate) fn is_for(
    state: &AtomicU32,
    lo_w: &AtomicU64,
    hi_w: &AtomicU64,
    uuid: &[u8; 16],
) -> bool {
    let (lo, hi) = split(uuid);
    state.load(Acquire) == ENTRY_READY && lo_w.load(Relaxed) == lo && hi_w.load(Relaxed) == hi
}

pub(crate) const READY: u32 = ENTRY_READY;

pub(crate) fn join(lo: u64, hi: u64) -> [u8; 16] {
    let mut uuid = [0u8; 16];
    uuid[..8].copy_from_slice(&lo.to_le_bytes());
    uuid[8..].copy_from_slice(&hi.to_le_bytes());
    uuid
}

fn split(uuid: &[u8; 16]) -> (u64, u64) {
    let mut lo = [0u8; 8];
    let mut hi = [0u8; 8];
    lo.copy_from_slice(&uuid[..8]);
    hi.copy_from_slice(&uuid[8..]);
    (u64::from_le_bytes(lo), u64::from_le_bytes(hi))
}

/// Parses NVML's UUID form (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, also without the
/// `GPU-` prefix) into bytes.
pub fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let s = s
        .strip_prefix("GPU-")
        .or_else(|| s.strip_prefix("MIG-"))
        .unwrap_or(s);
    let hex: Vec<u8> = s.bytes().filter(|b| *b != b'-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, pair) in hex.chunks(2).enumerate() {
        let h = (pair[0] as char).to_digit(16)?;
        let l = (pair[1] as char).to_digit(16)?;
        out[i] = (h * 16 + l) as u8;
    }
    Some(out)
}

/// NVML's UUID form of `uuid`: `GPU-` + 8-4-4-4-12 lowercase hex.
pub fn format_uuid(uuid: &[u8; 16]) -> String {
    let h: String = uuid.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

/// `CLOCK_REALTIME` in ns (vDSO: no system call).
#[inline]
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer; CLOCK_REALTIME always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// `FUTEX_WAKE` on a word in a shared mapping (not private: other processes wait on it).
pub fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE only uses the address as a key; `word` is a live reference.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

/// `FUTEX_WAIT` on a word in a shared mapping (read-only mappings too): sleeps while
/// `word == expected`, until a wake, a signal, or `timeout_ns`. Returns at once when the
/// word already differs. Spurious returns are possible: callers re-check.
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout_ns: u64) {
    let ts = libc::timespec {
        tv_sec: (timeout_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (timeout_ns % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: `word` is a live reference; FUTEX_WAIT (shared, not private) only reads it;
    // `ts` outlives the call.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[repr(C, align(4096))]
    struct Buf([u8; PAGE]);

    fn page(buf: &mut Buf) -> Page<'_> {
        // SAFETY: a page-aligned, page-sized buffer that outlives the view.
        unsafe { Page::from_raw(buf.0.as_mut_ptr()) }
    }

    #[test]
    fn a_skipped_run_start_stamps_nothing_and_skip_is_asked_only_at_a_start() {
        let mut b = Buf([0; PAGE]);
        let p = page(&mut b);
        p.init(42, 100, 1);
        let e = p.entry_for(&[3u8; 16]).unwrap();
        let asked = std::cell::Cell::new(0);
        let skip = |yes: bool| {
            let asked = &asked;
            move || {
                asked.set(asked.get() + 1);
                yes
            }
        };
        // A captured launch that would start a run: nothing recorded.
        assert!(!p.ring_unless(e, 1_000, 100, skip(true)));
        assert_eq!(e.last_launch_ns.load(Relaxed), 0);
        assert_eq!(p.header().wake.load(Relaxed), 0);
        // The next, not captured: it starts the run.
        assert!(p.ring_unless(e, 1_010, 100, skip(false)));
        assert_eq!(e.busy_since_ns.load(Relaxed), 1_010);
        assert_eq!(asked.get(), 2);
        // Inside the run: never asked.
        assert!(!p.ring_unless(e, 1_020, 100, skip(true)));
        assert_eq!(asked.get(), 2);
        assert_eq!(e.last_launch_ns.load(Relaxed), 1_020);
        assert_eq!(p.header().wake.load(Relaxed), 1);
    }

    #[test]
    fn a_run_start_wakes_and_the_rest_is_silent() {
        let mut b = Buf([0; PAGE]);
        let p = page(&mut b);
        assert!(!p.valid());
        p.init(42, 100, 1);
        assert!(p.valid());
        assert_eq!(p.wake_gap_ns(), 100);
        let u = [7u8; 16];
        let e = p.entry_for(&u).unwrap();
        assert!(p.ring(e, 1_000, 100), "the first launch starts a run");
        assert!(!p.ring(e, 1_050, 100), "50 ns later: same run, no wake");
        assert!(!p.ring(e, 1_149, 100), "99 ns gap: same run");
        assert_eq!(p.header().wake.load(Relaxed), 1);
        let mut r = Vec::new();
        p.read(&mut r);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].uuid, u);
        assert_eq!(r[0].last_launch_ns, 1_149);
        assert_eq!(r[0].busy_since_ns, 1_000);
        assert!(p.ring(e, 1_249, 100), "100 ns gap: a new run wakes");
        r.clear();
        p.read(&mut r);
        assert_eq!(r[0].busy_since_ns, 1_249);
        assert_eq!(p.wakes(r[0].index), 2);
        assert_eq!(p.header().wake.load(Relaxed), 2);
    }

    #[test]
    fn entries_are_per_uuid_and_bounded() {
        let mut b = Buf([0; PAGE]);
        let p = page(&mut b);
        p.init(1, 0, 1);
        for i in 0..MAX_GPUS as u8 {
            assert!(p.entry_for(&[i; 16]).is_some());
        }
        assert!(std::ptr::eq(
            p.entry_for(&[3; 16]).unwrap(),
            p.entry_for(&[3; 16]).unwrap()
        ));
        assert!(p.entry_for(&[200; 16]).is_none(), "a 17th GPU has no entry");
        assert!(std::ptr::eq(
            p.find(&[3; 16]).unwrap(),
            p.entry_for(&[3; 16]).unwrap()
        ));
        assert!(p.find(&[200; 16]).is_none());
    }

    #[test]
    fn garbage_is_read_safely() {
        let mut b = Buf([0xff; PAGE]);
        let p = page(&mut b);
        assert!(!p.valid());
        let mut r = Vec::new();
        p.read(&mut r); // state words are 0xffffffff: not ready, nothing read
        assert!(r.is_empty());
    }

    #[test]
    fn version_2_carries_class_and_gate_fields_and_version_1_still_reads() {
        let mut b = Buf([0; PAGE]);
        let p = page(&mut b);
        p.init_class(9, CLASS_OFFLINE, 0, 1);
        assert!(p.valid());
        assert_eq!(p.class(), CLASS_OFFLINE);
        assert_eq!(p.header().version.load(Relaxed), VERSION);
        let e = p.entry_for(&[1; 16]).unwrap();
        assert_eq!(p.index_of(e), Some(0));
        assert!(std::ptr::eq(p.entry(0).unwrap(), e));
        assert!(p.entry(MAX_GPUS).is_none());
        e.inflight.store(3, Relaxed);
        e.in_submit.store(1, Relaxed);
        e.gate_ack.store(5, Relaxed);
        e.blocked_ns.store(77, Relaxed);
        e.submitted.store(1000, Relaxed);
        let w = p.header().wake.load(Relaxed);
        p.bump_and_wake();
        assert_eq!(p.header().wake.load(Relaxed), w.wrapping_add(1));
        let mut r = Vec::new();
        p.read_gate(&mut r);
        assert_eq!(
            r,
            vec![GateReading {
                index: 0,
                uuid: [1; 16],
                gate_ack: 5,
                inflight: 3,
                in_submit: 1,
                blocked_ns: 77,
                submitted: 1000
            }]
        );
        // The launch fields did not move.
        let mut l = Vec::new();
        p.read(&mut l);
        assert_eq!(l[0].last_launch_ns, 0);
        // Version 1 and 2 pages (older shims) are still read; a future version is not.
        for v in [1, 2, 3] {
            p.header().version.store(v, Relaxed);
            assert!(p.valid(), "version {v}");
        }
        p.header().version.store(4, Relaxed);
        assert!(!p.valid());
    }

    #[test]
    fn version_3_carries_the_drained_stamp_and_older_pages_read_0() {
        let mut b = Buf([0; PAGE]);
        let p = page(&mut b);
        p.init_class(9, CLASS_ONLINE, 0, 1);
        let e = p.entry_for(&[5; 16]).unwrap();
        let i = p.index_of(e).unwrap();
        assert_eq!(p.drained_ns(i, 10_000), 0, "never stamped");
        p.ring(e, 1_000, 100);
        p.stamp_drained(e, 3_000);
        assert_eq!(p.drained_ns(i, 10_000), 3_000);
        // Two threads stamping at once: the later time stays.
        p.stamp_drained(e, 2_500);
        assert_eq!(p.drained_ns(i, 10_000), 3_000, "a stamp never moves back");
        // The launch fields are untouched by a stamp.
        let mut r = Vec::new();
        p.read(&mut r);
        assert_eq!((r[0].last_launch_ns, r[0].busy_since_ns), (1_000, 1_000));
        // A stamp after the reader's now is no evidence.
        assert_eq!(p.drained_ns(i, 2_999), 0);
        assert_eq!(p.drained_ns(i, 3_000), 3_000);
        // Entries that are not ready, or out of range, read 0.
        assert_eq!(p.drained_ns(i + 1, 10_000), 0);
        assert_eq!(p.drained_ns(MAX_GPUS, 10_000), 0);
        // The same word in a version 1 or 2 page (its reserved space then): 0, whatever
        // it holds.
        for v in [1, 2] {
            p.header().version.store(v, Relaxed);
            assert!(p.valid());
            assert_eq!(p.drained_ns(i, 10_000), 0, "version {v}");
        }
        p.header().version.store(VERSION, Relaxed);
        assert_eq!(p.drained_ns(i, 10_000), 3_000);
        // Where the word lies: byte 80 of the entry, after `submitted`.
        let at = e as *const Entry as usize + 80;
        // SAFETY: byte 80 of a live entry of the page, 8-aligned.
        assert_eq!(unsafe { (at as *const u64).read_volatile() }, 3_000);
    }

    #[test]
    fn uuid_round_trip() {
        let s = "GPU-c010c517-0000-0000-0000-000000000003";
        let u = parse_uuid(s).unwrap();
        assert_eq!(u[15], 3);
        assert_eq!(format_uuid(&u), s);
        assert!(parse_uuid("GPU-fake0000-0000-0000-0000-000000000003").is_none());
        assert!(parse_uuid("GPU-12").is_none());
    }
}
