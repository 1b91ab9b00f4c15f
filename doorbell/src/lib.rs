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
//! Layout (all fields little-endian atomics, offsets fixed by `#[repr(C)]`):
//! [`Header`] (64 bytes), then [`MAX_GPUS`] × [`Entry`] (128 bytes each).
//!
//! Clock: `CLOCK_REALTIME` nanoseconds (the clock of NVML's sample timestamps).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::*};

/// Identifies a doorbell page of this layout ("COLOCDB1").
pub const MAGIC: u64 = 0x3142_4443_4f4c_4f43;
/// Layout version.
pub const VERSION: u32 = 1;
/// Most GPUs one process can ring for.
pub const MAX_GPUS: usize = 16;
/// Size of the page (and of the file).
pub const PAGE: usize = 4096;
/// File name suffix of a doorbell page.
pub const SUFFIX: &str = ".bell";
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
    /// Futex word: bumped, then woken, at the start of every run.
    pub wake: AtomicU32,
    _pad: u32,
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
    _reserved: [u64; 10],
}

const _: () = assert!(std::mem::size_of::<Header>() == 64);
const _: () = assert!(std::mem::size_of::<Entry>() == 128);
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

    /// Initialises a fresh (zeroed) page for the writer `pid` with its wake gap.
    pub fn init(&self, pid: u32, wake_gap_ns: u64, now_ns: u64) {
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

    /// The page carries this layout.
    pub fn valid(&self) -> bool {
        self.header.magic.load(Acquire) == MAGIC && self.header.version.load(Relaxed) == VERSION
    }

    /// The entry for `uuid`, claiming a free one if needed (writer side). `None` when all
    /// [`MAX_GPUS`] are taken by other GPUs.
    pub fn entry_for(&self, uuid: &[u8; 16]) -> Option<&'a Entry> {
        let (lo, hi) = split(uuid);
        for e in self.entries.iter() {
            loop {
                match e.state.load(Acquire) {
                    ENTRY_READY => {
                        if e.uuid_lo.load(Relaxed) == lo && e.uuid_hi.load(Relaxed) == hi {
                            return Some(e);
                        }
                        break;
                    }
                    ENTRY_FREE => {
                        if e.state
                            .compare_exchange(ENTRY_FREE, ENTRY_CLAIMING, AcqRel, Acquire)
                            .is_ok()
                        {
                            e.uuid_lo.store(lo, Relaxed);
                            e.uuid_hi.store(hi, Relaxed);
                            e.state.store(ENTRY_READY, Release);
                            return Some(e);
                        }
                    }
                    // Another thread is writing this entry's UUID: it is ready in a few
                    // instructions.
                    _ => std::hint::spin_loop(),
                }
            }
        }
        None
    }

    /// Records a submission at `now_ns` on entry `e` (writer side), with the writer's wake
    /// gap. Returns true when it started a run: the caller must then wake the agent
    /// ([`Page::wake`]).
    #[inline]
    pub fn ring(&self, e: &Entry, now_ns: u64, wake_gap_ns: u64) -> bool {
        let prev = e.last_launch_ns.load(Relaxed);
        let edge = now_ns.saturating_sub(prev) >= wake_gap_ns;
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
            let mut uuid = [0u8; 16];
            uuid[..8].copy_from_slice(&e.uuid_lo.load(Relaxed).to_le_bytes());
            uuid[8..].copy_from_slice(&e.uuid_hi.load(Relaxed).to_le_bytes());
            out.push(Reading {
                index,
                uuid,
                last_launch_ns: last,
                busy_since_ns: if since == 0 || since > last {
                    last
                } else {
                    since
                },
            });
        }
    }

    /// Wake-ups taken on entry `index`.
    pub fn wakes(&self, index: usize) -> u64 {
        self.entries.get(index).map_or(0, |e| e.wakes.load(Relaxed))
    }
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
    fn uuid_round_trip() {
        let s = "GPU-c010c517-0000-0000-0000-000000000003";
        let u = parse_uuid(s).unwrap();
        assert_eq!(u[15], 3);
        assert_eq!(format_uuid(&u), s);
        assert!(parse_uuid("GPU-fake0000-0000-0000-0000-000000000003").is_none());
        assert!(parse_uuid("GPU-12").is_none());
    }
}
