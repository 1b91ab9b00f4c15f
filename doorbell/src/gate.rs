//! # The launch gate file
//!
//! One file per node, owned by the agent: per GPU a *gate word* that the agent closes
//! while online work on that GPU is busy. The CUDA shim in an offline process maps the
//! file **read-only**, blocks its next submission to a GPU whose gate is closed, and
//! acknowledges each close in its own doorbell page ([`crate::Entry::gate_ack`]) once its
//! in-flight work on that GPU has drained.
//!
//! ```text
//!  agent (maps read-write)                         offline shim (maps read-only)
//!  close(uuid): epoch += 1; closed = epoch;        submission: in_submit += 1; read closed
//!    generation += 1; FUTEX_WAKE(generation) ──►     closed: in_submit -= 1; FUTEX_WAIT(closed)
//!                                                  watcher (FUTEX_WAIT on generation):
//!                                                    in_submit == 0, in-flight work done
//!  futex_waitv on the pages' wake words ◄──────────   → page: gate_ack = epoch; wake += 1, FUTEX_WAKE
//!  open(uuid): closed = 0; generation += 1;
//!    FUTEX_WAKE(closed), FUTEX_WAKE(generation) ──►  blocked submissions go on
//!  beat(now) at least every HEARTBEAT_NS ─────────►  heartbeat older than the shim's bound
//!                                                    (COLOC_GATE_STALE_MS): gate open
//! ```
//!
//! - **Path**: [`DEFAULT_GATE_FILE`] (`/run/gpu-coloc/gate/gates`; the shim's
//!   `COLOC_GATE_FILE` overrides it). The agent creates it with mode 0644 in a root-owned
//!   0755 directory, by creating a temporary name with `O_EXCL` and renaming it over the
//!   path: a shim that mapped an earlier file keeps the old inode, sees its heartbeat go
//!   stale, and looks for the new file (at most once a second).
//! - **Layout** (4 KiB, all fields little-endian atomics, offsets fixed by `#[repr(C)]`):
//!   [`GateHeader`] (64 bytes: magic `"COLOCGT1"` written last, version, agent PID,
//!   `generation` futex word, `heartbeat_ns`), then [`MAX_GPUS`] × [`Slot`] (64 bytes:
//!   state free/claiming/ready, UUID, `closed` futex word (0 = open, otherwise the epoch of
//!   the close), `epoch` (the last close's, monotonic per slot, never 0 once closed)).
//! - **Fail-open**: a heartbeat older than the reader's bound (or a missing magic) makes
//!   every gate of the file count as open. An agent killed with `kill -9` never leaves
//!   offline work blocked for longer than that bound (plus the shim's 50 ms re-check).
//! - **Trust**: the shim never writes the file (it cannot: read-only mapping, root-owned
//!   file). The gate is cooperative: a tenant can unload the shim. It bounds the drain of
//!   work queued before a suspension; it does not replace the agent's freezer or signals.
//!
//! Clock: `CLOCK_REALTIME` nanoseconds ([`crate::now_ns`]).

use crate::{claim, is_for, join, Claim, MAX_GPUS, PAGE, READY};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::*};

/// Identifies a gate file of this layout ("COLOCGT1").
pub const GATE_MAGIC: u64 = 0x3154_4743_4f4c_4f43;
/// Gate file layout version.
pub const GATE_VERSION: u32 = 1;
/// Size of the gate file.
pub const GATE_FILE_SIZE: usize = PAGE;
/// Where the agent creates the gate file (the shim's `COLOC_GATE_FILE` overrides it).
pub const DEFAULT_GATE_FILE: &str = "/run/gpu-coloc/gate/gates";
/// The agent refreshes [`GateHeader::heartbeat_ns`] at least this often while it runs.
pub const HEARTBEAT_NS: u64 = 100_000_000;
/// The shim's default staleness bound (`COLOC_GATE_STALE_MS`): a heartbeat older than
/// this opens every gate of the file.
pub const DEFAULT_STALE_NS: u64 = 1_000_000_000;

/// The gate file's header.
#[repr(C)]
#[derive(Debug)]
pub struct GateHeader {
    /// [`GATE_MAGIC`] once initialised (written last by the agent).
    pub magic: AtomicU64,
    /// [`GATE_VERSION`].
    pub version: AtomicU32,
    /// The agent's PID as it sees itself (informational).
    pub agent_pid: AtomicU32,
    /// Futex word: bumped, then woken, by the agent on every close and open (and when it
    /// claims a slot).
    pub generation: AtomicU32,
    _pad: u32,
    /// `CLOCK_REALTIME` ns of the agent's latest beat.
    pub heartbeat_ns: AtomicU64,
    _reserved: [u64; 4],
}

/// One GPU's gate.
#[repr(C)]
#[derive(Debug)]
pub struct Slot {
    /// Free / claiming / ready (as the doorbell page's entries).
    state: AtomicU32,
    _pad: u32,
    /// GPU UUID bytes 0–7 (`u64::from_le_bytes`).
    uuid_lo: AtomicU64,
    /// GPU UUID bytes 8–15.
    uuid_hi: AtomicU64,
    /// Futex word: 0 = open, otherwise the epoch of the close in force.
    pub closed: AtomicU32,
    /// The latest close's epoch (monotonic per slot, never 0 after the first close).
    pub epoch: AtomicU32,
    _reserved: [u64; 4],
}

const _: () = assert!(std::mem::size_of::<GateHeader>() == 64);
const _: () = assert!(std::mem::size_of::<Slot>() == 64);
const _: () = assert!(
    std::mem::size_of::<GateHeader>() + MAX_GPUS * std::mem::size_of::<Slot>() <= GATE_FILE_SIZE
);

impl Slot {
    /// The GPU UUID (meaningful once the slot is ready).
    pub fn uuid(&self) -> [u8; 16] {
        join(self.uuid_lo.load(Relaxed), self.uuid_hi.load(Relaxed))
    }

    /// The close in force: `Some(epoch)`, or `None` when open.
    pub fn closed_epoch(&self) -> Option<u32> {
        match self.closed.load(SeqCst) {
            0 => None,
            e => Some(e),
        }
    }
}

/// `a` is a later epoch than `b` (wrapping: epochs are compared within 2³¹ of each other).
pub fn epoch_after(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) > 0
}

/// A view of one mapped gate file. The mapping is owned by whoever made the view; the
/// agent's mapping is read-write, a shim's read-only (a shim calls only the reader-side
/// methods: [`Gates::valid`], [`Gates::find`], [`Gates::find_index`], [`Gates::slot`],
/// [`Gates::stale`], [`Gates::generation`], [`Gates::is_closed`]).
#[derive(Debug, Clone, Copy)]
pub struct Gates<'a> {
    header: &'a GateHeader,
    slots: &'a [Slot; MAX_GPUS],
}

impl<'a> Gates<'a> {
    /// A view of [`GATE_FILE_SIZE`] bytes at `base`.
    ///
    /// # Safety
    /// `base` must be valid and 8-aligned for reads of [`GATE_FILE_SIZE`] bytes for `'a`
    /// (and for writes if a writer-side method is called), and only accessed through
    /// atomics by everyone who maps it.
    pub unsafe fn from_raw(base: *const u8) -> Gates<'a> {
        // SAFETY: the caller guarantees size, alignment and lifetime; every field is an
        // atomic integer (or padding), valid for any bit pattern.
        unsafe {
            Gates {
                header: &*(base as *const GateHeader),
                slots: &*(base.add(std::mem::size_of::<GateHeader>()) as *const [Slot; MAX_GPUS]),
            }
        }
    }

    /// The header.
    pub fn header(&self) -> &'a GateHeader {
        self.header
    }

    /// Initialises a fresh (zeroed) file for agent `pid` (agent side): version, PID, a
    /// first heartbeat, then the magic.
    pub fn init(&self, pid: u32, now_ns: u64) {
        self.header.version.store(GATE_VERSION, Relaxed);
        self.header.agent_pid.store(pid, Relaxed);
        self.header.heartbeat_ns.store(now_ns, Relaxed);
        self.header.magic.store(GATE_MAGIC, Release);
    }

    /// The file carries this layout.
    pub fn valid(&self) -> bool {
        self.header.magic.load(Acquire) == GATE_MAGIC
            && self.header.version.load(Relaxed) == GATE_VERSION
    }

    /// Refreshes the heartbeat (agent side).
    pub fn beat(&self, now_ns: u64) {
        self.header.heartbeat_ns.store(now_ns, Release);
    }

    /// The heartbeat is older than `bound_ns` at `now_ns` (or further than that in the
    /// future: the clock was set back), or the file is not a valid gate file. A stale file's
    /// gates count as open.
    pub fn stale(&self, now_ns: u64, bound_ns: u64) -> bool {
        !self.valid() || now_ns.abs_diff(self.header.heartbeat_ns.load(Acquire)) > bound_ns
    }

    /// The generation futex word's value.
    pub fn generation(&self) -> u32 {
        self.header.generation.load(SeqCst)
    }

    /// Slot `index` (bounds-checked).
    pub fn slot(&self, index: usize) -> Option<&'a Slot> {
        self.slots.get(index)
    }

    /// The index of `uuid`'s ready slot (reader side: never claims).
    pub fn find_index(&self, uuid: &[u8; 16]) -> Option<usize> {
        self.slots
            .iter()
            .position(|s| is_for(&s.state, &s.uuid_lo, &s.uuid_hi, uuid))
    }

    /// `uuid`'s ready slot (reader side: never claims).
    pub fn find(&self, uuid: &[u8; 16]) -> Option<&'a Slot> {
        self.find_index(uuid).and_then(|i| self.slot(i))
    }

    /// `uuid`'s slot, claiming a free one (agent side; bumps the generation when it
    /// claims, so readers that found no slot look again). `None` when all [`MAX_GPUS`]
    /// are other GPUs'.
    ///
    /// A claimed slot's epochs start after a seed taken from the heartbeat (milliseconds,
    /// truncated to 32 bits), so a file that replaces another (a restarted agent) does not
    /// repeat the epochs of the old one, which pages may still acknowledge.
    pub fn slot_for(&self, uuid: &[u8; 16]) -> Option<&'a Slot> {
        if let Some(s) = self.find(uuid) {
            return Some(s);
        }
        let s = self.slots.iter().find(|s| {
            s.state.load(Acquire) != READY
                && claim(&s.state, &s.uuid_lo, &s.uuid_hi, uuid) == Claim::Mine
        })?;
        if s.epoch.load(SeqCst) == 0 {
            let seed = (self.header.heartbeat_ns.load(Acquire) / 1_000_000) as u32;
            let _ = s.epoch.compare_exchange(0, seed, SeqCst, SeqCst);
        }
        self.header.generation.fetch_add(1, SeqCst);
        Some(s)
    }

    /// Closes `uuid`'s gate (agent side): a new epoch, `closed` = that epoch, generation
    /// bumped. Returns the epoch (`None`: no slot left). The caller wakes
    /// [`GateHeader::generation`] ([`crate::futex_wake`]).
    pub fn close(&self, uuid: &[u8; 16]) -> Option<u32> {
        let s = self.slot_for(uuid)?;
        let prev = s
            .epoch
            .fetch_update(SeqCst, SeqCst, |e| Some(next_epoch(e)))
            .unwrap_or_else(|e| e);
        let epoch = next_epoch(prev);
        s.closed.store(epoch, SeqCst);
        self.header.generation.fetch_add(1, SeqCst);
        Some(epoch)
    }

    /// Opens `uuid`'s gate (agent side). Returns the slot if it was closed (the caller
    /// wakes its `closed` word and the generation); `None` if it was open or has no slot.
    pub fn open(&self, uuid: &[u8; 16]) -> Option<&'a Slot> {
        let s = self.find(uuid)?;
        let was = s.closed.swap(0, SeqCst);
        self.header.generation.fetch_add(1, SeqCst);
        (was != 0).then_some(s)
    }

    /// Opens every gate (agent side). Returns the slots that were closed (to wake).
    pub fn open_all(&self) -> Vec<&'a Slot> {
        let mut out = Vec::new();
        for s in self.slots.iter() {
            if s.closed.swap(0, SeqCst) != 0 {
                out.push(s);
            }
        }
        self.header.generation.fetch_add(1, SeqCst);
        out
    }

    /// Whether `uuid`'s gate is closed (in this file, whatever the heartbeat says).
    pub fn is_closed(&self, uuid: &[u8; 16]) -> bool {
        self.find(uuid).is_some_and(|s| s.closed_epoch().is_some())
    }

    /// Every ready slot: (index, UUID, closed epoch or 0, latest epoch).
    pub fn read(&self) -> Vec<(usize, [u8; 16], u32, u32)> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.state.load(Acquire) == READY)
            .map(|(i, s)| (i, s.uuid(), s.closed.load(SeqCst), s.epoch.load(SeqCst)))
            .collect()
    }
}

fn next_epoch(e: u32) -> u32 {
    match e.wrapping_add(1) {
        0 => 1,
        n => n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::now_ns;

    #[repr(C, align(4096))]
    struct Buf([u8; GATE_FILE_SIZE]);

    fn gates(buf: &mut Buf) -> Gates<'_> {
        // SAFETY: a page-aligned, page-sized buffer that outlives the view.
        unsafe { Gates::from_raw(buf.0.as_mut_ptr()) }
    }

    #[test]
    fn close_and_open_move_epoch_closed_and_generation() {
        let mut b = Buf([0; GATE_FILE_SIZE]);
        let g = gates(&mut b);
        assert!(!g.valid());
        assert!(g.stale(now_ns(), DEFAULT_STALE_NS), "no magic: stale");
        g.init(7, now_ns());
        assert!(g.valid());
        assert!(!g.stale(now_ns(), DEFAULT_STALE_NS));
        let u = [3u8; 16];
        assert!(g.find(&u).is_none(), "readers never claim");
        let gen0 = g.generation();
        let e1 = g.close(&u).unwrap();
        assert_ne!(e1, 0);
        assert!(g.is_closed(&u));
        let s = g.find(&u).unwrap();
        assert_eq!(s.closed_epoch(), Some(e1));
        assert_eq!(s.uuid(), u);
        assert!(epoch_after(g.generation(), gen0));
        let gen1 = g.generation();
        assert!(g.open(&u).is_some());
        assert!(!g.is_closed(&u));
        assert!(g.open(&u).is_none(), "already open");
        assert!(epoch_after(g.generation(), gen1));
        let e2 = g.close(&u).unwrap();
        assert_eq!(e2, e1.wrapping_add(1), "epochs are monotonic per slot");
        assert_eq!(s.epoch.load(SeqCst), e2);
        assert!(g.close(&[4u8; 16]).is_some(), "per slot");
        assert_eq!(g.open_all().len(), 2);
        assert!(!g.is_closed(&u) && !g.is_closed(&[4u8; 16]));
        assert_eq!(g.read().len(), 2);
    }

    #[test]
    fn a_new_file_does_not_repeat_an_old_files_epochs() {
        let mut a = Buf([0; GATE_FILE_SIZE]);
        let mut b = Buf([0; GATE_FILE_SIZE]);
        let (old, new) = (gates(&mut a), gates(&mut b));
        old.init(1, 5_000_000_000);
        let u = [9u8; 16];
        assert_eq!(
            old.close(&u),
            Some(5_001),
            "seeded from the heartbeat's milliseconds"
        );
        new.init(2, 7_000_000_000);
        assert_eq!(new.close(&u), Some(7_001));
    }

    #[test]
    fn epochs_skip_zero_and_compare_wrapping() {
        assert_eq!(next_epoch(u32::MAX), 1);
        assert!(epoch_after(1, u32::MAX));
        assert!(epoch_after(5, 4));
        assert!(!epoch_after(4, 4));
        assert!(!epoch_after(3, 4));
        let mut b = Buf([0; GATE_FILE_SIZE]);
        let g = gates(&mut b);
        g.init(1, 1);
        let s = g.slot_for(&[1; 16]).unwrap();
        s.epoch.store(u32::MAX, SeqCst);
        assert_eq!(g.close(&[1; 16]), Some(1), "closed is never 0 while closed");
    }

    #[test]
    fn the_heartbeat_bounds_the_gate() {
        let mut b = Buf([0; GATE_FILE_SIZE]);
        let g = gates(&mut b);
        g.init(1, 1_000_000_000);
        assert!(!g.stale(1_500_000_000, 1_000_000_000));
        assert!(
            !g.stale(2_000_000_000, 1_000_000_000),
            "exactly the bound: fresh"
        );
        assert!(
            g.stale(2_000_000_001, 1_000_000_000),
            "older than the bound"
        );
        assert!(
            g.stale(1, 100),
            "a heartbeat far in the future (clock set back)"
        );
        g.beat(2_000_000_000);
        assert!(!g.stale(2_000_000_001, 1_000_000_000));
    }

    #[test]
    fn slots_are_bounded_and_garbage_is_read_safely() {
        let mut b = Buf([0; GATE_FILE_SIZE]);
        let g = gates(&mut b);
        g.init(1, 1);
        for i in 0..MAX_GPUS as u8 {
            assert!(g.close(&[i; 16]).is_some());
        }
        assert!(g.close(&[200; 16]).is_none(), "a 17th GPU has no slot");
        let mut junk = Buf([0xff; GATE_FILE_SIZE]);
        let j = gates(&mut junk);
        assert!(!j.valid());
        assert!(j.stale(now_ns(), u64::MAX / 2), "bad magic is stale");
        assert!(
            j.find(&[0xff; 16]).is_none(),
            "garbage states are never ready"
        );
        assert!(j.slot_for(&[0xff; 16]).is_none(), "nor claimable");
        assert!(j.read().is_empty());
        assert!(j.slot(MAX_GPUS).is_none());
    }
}
