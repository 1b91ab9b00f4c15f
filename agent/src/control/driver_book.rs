//! The driver book: every use of the CUDA driver's checkpoint API, decided here and carried out
//! off the loop by the shell (its driver calls, a thread each).
//!
//! Two things want a process held by the driver, and the driver book keeps one driver state per
//! process that satisfies both:
//!
//! - **the lock hold** (`--driver-lock`, and every process memory preemption may take): a
//!   suspension whose plan holds the process by the driver's lock
//!   ([`crate::control::target::Held::Lock`], after the launch gate where there is one)
//!   asks the driver book to lock the process; its release asks for the unlock. The hold book
//!   records the lock before it asks (its `Lock` entry) and reads the driver book's answer as it
//!   reads an actuator's ([`DriverBook::hold`]). A process the driver refuses is stopped
//!   instead (freezer or signal) from its next suspension on.
//! - **memory preemption** (`--memory-reserve`): while online work is present on a GPU and
//!   its free memory is under the reserve, the opted-in offline processes there are locked
//!   and checkpointed, largest first, until what they hold covers what is missing; each is
//!   recorded (`Checkpoint` entry) before its lock. A GPU out of pressure for
//!   `--restore-after`, with room for a process and the reserve, gets it back: restored,
//!   then unlocked unless a lock hold still wants it locked.
//!
//! ```text
//!                 want: evict ──► checkpointed      (memory)
//!                       hold  ──► locked            (time)
//!                       else  ──► running
//!   running ──lock──► locked ──checkpoint──► checkpointed ──restore──► locked ──unlock──► running
//! ```
//!
//! Rules the driver imposes (measured on an H100, `benches/RESULTS.md`): every call that
//! changes a process waits until the process runs, so nothing the agent stops may be
//! locked, checkpointed, restored or unlocked. The lock hold replaces the stop for the
//! processes it covers; a restore starts only when no hold of the hold book stops the
//! process (thaw first, [`DriverBook::calls`]'s `stopped`); at exit the holds are released
//! before the driver book restores.
//!
//! No I/O: the driver book asks for calls, record entries and memory reads, and is told what
//! came of them.

use crate::control::events::{DriverEvent, Event};
use crate::control::holds::Req;
use crate::control::model::act::{ActError, Progress, RecordEntry};
use crate::control::model::driver::{CallEnd, CuError, Done, Op as DriverOp};
use crate::control::model::gpu::GpuMemory;
use crate::control::model::ProcKey;
use crate::control::note::{self, Note};
use crate::control::table::Table;
use crate::control::target::Target;
use qos_core::Class;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

/// The driver book's requests to the record book are numbered from here (the hold book's below).
pub const REQ_BASE: Req = 1 << 62;

/// The free memory to keep on a GPU while online work is present there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reserve {
    /// Bytes.
    Bytes(u64),
    /// Percent of the GPU's total memory.
    Percent(u8),
}

impl Reserve {
    /// Bytes on a GPU with `total` bytes.
    pub fn bytes(self, total: u64) -> u64 {
        match self {
            Reserve::Bytes(b) => b,
            Reserve::Percent(p) => total / 100 * u64::from(p),
        }
    }

    /// `8GiB`, `512MiB`, `1.5GB`, `4096` (bytes), `10%`.
    pub fn parse(s: &str) -> Result<Reserve, String> {
        let t = s.trim();
        if let Some(p) = t.strip_suffix('%') {
            return match p.trim().parse::<u8>() {
                Ok(p) if (1..=90).contains(&p) => Ok(Reserve::Percent(p)),
                _ => Err(format!(
                    "{s:?}: a percent of the GPU's memory must be 1% to 90%"
                )),
            };
        }
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let mult: u64 = match unit.trim() {
            "" | "B" => 1,
            "KiB" => 1 << 10,
            "MiB" => 1 << 20,
            "GiB" => 1 << 30,
            "TiB" => 1 << 40,
            "KB" | "kB" => 1_000,
            "MB" => 1_000_000,
            "GB" => 1_000_000_000,
            u => {
                return Err(format!(
                    "{s:?}: unit {u:?} is not one of B, KiB, MiB, GiB, TiB, KB, MB, GB (or a percent, 10%)"
                ))
            }
        };
        let n: f64 = num
            .parse()
            .map_err(|_| format!("{s:?}: not a size (e.g. 8GiB, 512MiB, 10%)"))?;
        let b = n * mult as f64;
        if !(b.is_finite() && (1.0..1e15).contains(&b)) {
            return Err(format!("{s:?}: a reserve is from 1 byte to 1 PB"));
        }
        Ok(Reserve::Bytes(b as u64))
    }
}

impl std::fmt::Display for Reserve {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reserve::Bytes(b) => write!(f, "{:.2} GiB", *b as f64 / (1u64 << 30) as f64),
            Reserve::Percent(p) => write!(f, "{p}%"),
        }
    }
}

/// Which offline pods memory preemption may checkpoint (`--checkpoint-pods`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum PodsPolicy {
    /// Only pods annotated `gpu-coloc.dev/checkpoint: "true"` (rules: `checkpoint = true`).
    #[default]
    OptIn,
    /// Every offline pod but those annotated `"false"` (rules: `checkpoint = false`).
    OptOut,
}

/// The driver book's settings.
#[derive(Debug, Clone)]
pub struct DriverBookConfig {
    /// The driver offers the checkpoint API (`--cuda-lib` loaded with every entry point).
    pub api: bool,
    /// `--driver-lock`: every offline process is held by the driver's lock.
    pub lock: bool,
    /// `--memory-reserve`: memory preemption is on.
    pub reserve: Option<Reserve>,
    /// `--restore-after`, ns.
    pub restore_after_ns: u64,
    /// `--checkpoint-pods`.
    pub pods: PodsPolicy,
    /// `--memory-interval`, ns.
    pub memory_interval_ns: u64,
    /// How long a lock may wait for the process's submitted work (the driver's timeout).
    pub lock_timeout: Duration,
}

impl Default for DriverBookConfig {
    fn default() -> DriverBookConfig {
        DriverBookConfig {
            api: false,
            lock: false,
            reserve: None,
            restore_after_ns: 30_000_000_000,
            pods: PodsPolicy::OptIn,
            memory_interval_ns: 200_000_000,
            lock_timeout: Duration::from_secs(1),
        }
    }
}

/// Where the driver has a process, as far as the driver book's calls say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DState {
    /// Its CUDA calls run.
    Running,
    /// Its CUDA calls block.
    Locked,
    /// Its device memory is on the host; locked.
    Checkpointed,
    /// The driver said `failed`: nothing more can be done with it.
    Failed,
}

impl DState {
    /// `/state` and log label.
    pub fn as_str(self) -> &'static str {
        match self {
            DState::Running => "running",
            DState::Locked => "locked",
            DState::Checkpointed => "checkpointed",
            DState::Failed => "failed",
        }
    }
}

/// Where a checkpoint entry of the record stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CheckpointRecord {
    /// Not asked for.
    No,
    /// Asked for (this request).
    Asked(Req),
    /// On disk.
    OnDisk,
}

/// One process the driver book knows.
#[derive(Debug)]
struct Slot {
    state: DState,
    /// The call in flight: (operation, started at, ns).
    call: Option<(DriverOp, u64)>,
    /// A lock hold wants it locked.
    time_hold: bool,
    /// Memory preemption wants it checkpointed.
    evict: bool,
    /// Its `Checkpoint` record entry.
    rec: CheckpointRecord,
    gpu: Option<u32>,
    /// Device memory it held when last seen (what a checkpoint moved).
    bytes: u64,
    /// The shell pins it (exit is seen through the shell's list of known processes).
    pinned: bool,
    owner: String,
    /// The cgroup its own plan freezes or signals, if any: a hold on it stops the process.
    cgroup: Option<PathBuf>,
    /// Why the driver refused it (then it is held by its other plan from now on).
    refused: Option<String>,
    /// When its checkpoint completed, ns.
    checkpointed_ns: u64,
    /// A call failed: ask the driver where the process is before anything else.
    probe: bool,
    /// No restore before this time, ns (after one failed).
    restore_not_before_ns: u64,
    /// At exit, its restore was refused: left checkpointed, and in the record, for
    /// `coloc-agent resume` once the GPU has room.
    given_up: bool,
    /// Its call was said to be stuck.
    said_stuck: bool,
    /// When to ask the driver next whether a checkpointed process still lives, ns (it has
    /// left the driver's lists, so its exit is not seen there).
    next_probe_ns: u64,
}

impl Slot {
    fn new() -> Slot {
        Slot {
            state: DState::Running,
            call: None,
            time_hold: false,
            evict: false,
            rec: CheckpointRecord::No,
            gpu: None,
            bytes: 0,
            pinned: false,
            owner: "-".into(),
            cgroup: None,
            refused: None,
            checkpointed_ns: 0,
            probe: false,
            restore_not_before_ns: 0,
            given_up: false,
            said_stuck: false,
            next_probe_ns: 0,
        }
    }

    /// Held by the driver (locked or checkpointed) with no call that could change that.
    fn held(&self) -> bool {
        matches!(self.state, DState::Locked | DState::Checkpointed)
            && !matches!(self.call, Some((DriverOp::Unlock, _)))
    }
}

/// A GPU's memory as the driver book sees it.
#[derive(Debug, Clone, Default)]
struct Mem {
    read: Option<GpuMemory>,
    /// Online present and free under the reserve at the latest read.
    pressure: bool,
    /// The latest read under pressure, ns.
    last_pressure_ns: u64,
    /// The reserve, bytes (from the total).
    reserve: u64,
}

/// Per GPU, for `/state` and the gauges.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MemorySummary {
    /// Installed, bytes.
    pub total_bytes: u64,
    /// Free at the latest read, bytes.
    pub free_bytes: u64,
    /// The reserve, bytes.
    pub reserve_bytes: u64,
    /// Online needs memory offline holds.
    pub pressure: bool,
    /// Processes checkpointed here.
    pub checkpointed: usize,
    /// What they hold on the host, bytes.
    pub checkpointed_bytes: u64,
}

/// A call for the shell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    /// The process.
    pub key: ProcKey,
    /// The operation.
    pub op: DriverOp,
    /// A lock's timeout.
    pub timeout: Duration,
}

/// What the driver book asks of the record book.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordAsk {
    /// Hold these on disk (answered through [`DriverBook::recorded`]).
    Add(Req, Vec<RecordEntry>),
    /// Let these go.
    Remove(Vec<RecordEntry>),
}

/// See the module.
#[derive(Debug, Default)]
pub struct DriverBook {
    cfg: DriverBookConfig,
    slots: BTreeMap<ProcKey, Slot>,
    mem: BTreeMap<u32, Mem>,
    next_read_ns: u64,
    next_req: Req,
    /// For the shell, in order.
    calls: Vec<Call>,
    records: Vec<RecordAsk>,
    notes: Vec<Note>,
    events: Vec<Event>,
    /// The agent stops: everything goes back to running.
    stopping: bool,
    /// Processes passed over for want of room under their memory limit (said once).
    no_room: BTreeSet<ProcKey>,
    /// Processes a driver call found gone before the lists said so: never asked of the
    /// driver again (the table still holds them until the lists name them gone).
    dead: BTreeSet<ProcKey>,
}

/// What a checkpoint of `bytes` of device memory adds to the process's host memory: the
/// bytes, and an eighth more with 64 MiB (on an H100 with driver 580, 4 GiB of device
/// memory raised a process's resident memory from 22 MB to about 4.5 GiB).
pub fn checkpoint_host_bytes(bytes: u64) -> u64 {
    bytes.saturating_add(bytes / 8).saturating_add(64 << 20)
}

fn rec_entry(key: ProcKey) -> RecordEntry {
    RecordEntry::Checkpoint {
        pid: key.pid,
        start: key.start,
    }
}

impl DriverBook {
    /// A driver book under `cfg`.
    pub fn new(cfg: DriverBookConfig) -> DriverBook {
        DriverBook {
            cfg,
            next_req: REQ_BASE,
            ..DriverBook::default()
        }
    }

    /// Whether the driver book does anything at all.
    pub fn active(&self) -> bool {
        self.cfg.api && (self.cfg.lock || self.cfg.reserve.is_some())
    }

    /// Whether memory preemption may checkpoint a process classified `cls`.
    fn opted_in(&self, cls: &crate::control::model::process::Classified) -> bool {
        cls.class == Class::Offline
            && self.cfg.reserve.is_some()
            && match self.cfg.pods {
                PodsPolicy::OptIn => cls.checkpoint == Some(true),
                PodsPolicy::OptOut => cls.checkpoint != Some(false),
            }
    }

    /// Whether `key` (classified `cls`) is held by the driver's lock when suspended: not
    /// once the driver refused it, unless the driver holds it still (a stop would make
    /// the unlock wait).
    fn lockable(&self, key: &ProcKey, cls: &crate::control::model::process::Classified) -> bool {
        if !self.cfg.api || cls.class != Class::Offline || self.dead.contains(key) {
            return false;
        }
        // Whatever its pod says now: a stop would make the driver's call on it wait.
        if self
            .slots
            .get(key)
            .is_some_and(|s| s.held() || s.call.is_some())
        {
            return true;
        }
        (self.cfg.lock || self.opted_in(cls))
            && self.slots.get(key).is_none_or(|s| s.refused.is_none())
    }

    /// Whether a suspension of the table's `key` now would be a lock (the fact
    /// [`crate::control::plan::choose`] takes).
    pub fn would_lock(&self, table: &Table, key: &ProcKey) -> bool {
        table.entry(key).is_some_and(|e| self.lockable(key, &e.cls))
    }

    /// What the record should hold ahead: the lock of every process a suspension would
    /// lock, so that a preemption waits for no write.
    pub fn ahead(&self, table: &Table) -> BTreeSet<RecordEntry> {
        table
            .entries()
            .filter(|e| !e.gpus.is_empty() && e.pinned && self.lockable(&e.key, &e.cls))
            .map(|e| Target::Lock { key: e.key }.record())
            .collect()
    }

    fn slot(&mut self, key: ProcKey, table: &Table) -> &mut Slot {
        let s = self.slots.entry(key).or_insert_with(Slot::new);
        if let Some(e) = table.entry(&key) {
            s.pinned |= e.pinned;
            s.owner = e.cls.owner.clone();
            if let Some(g) = e.gpus.iter().next() {
                s.gpu = Some(*g);
            }
            s.cgroup = e.stopped_with().map(std::path::Path::to_path_buf);
        }
        s
    }

    /// A lock hold's `Start` or `Check` of `op` on `key`: where it stands. `stopped(key,
    /// cgroup)`: another hold stops the process (its cgroup shared with a process held by
    /// a stop): it is held already, and its lock waits until it runs again (a lock asked
    /// of a stopped process would wait in the driver for it to run).
    pub fn hold(
        &mut self,
        key: ProcKey,
        op: crate::control::model::act::Op,
        table: &Table,
        stopped: impl Fn(&ProcKey, Option<&std::path::Path>) -> bool,
    ) -> Progress {
        use crate::control::model::act::Op;
        if !self.cfg.api {
            return match op {
                Op::Suspend => Progress::Failed(ActError::Driver(
                    "the CUDA driver's checkpoint API is not loaded".into(),
                )),
                Op::Resume => Progress::Done,
            };
        }
        if self.dead.contains(&key) {
            // A driver call found it gone: nothing to lock or unlock.
            return Progress::Gone;
        }
        let stopping = self.stopping;
        let s = self.slot(key, table);
        s.time_hold = op == Op::Suspend && !stopping;
        match op {
            Op::Suspend => {
                if s.held() {
                    Progress::Done
                } else if let Some(why) = &s.refused {
                    Progress::Failed(ActError::Driver(why.clone()))
                } else if s.call.is_none() && stopped(&key, s.cgroup.as_deref()) {
                    // Held by that stop; locked at a re-check once it runs again.
                    Progress::Done
                } else {
                    Progress::Pending
                }
            }
            Op::Resume => {
                let running =
                    s.call.is_none() && matches!(s.state, DState::Running | DState::Failed);
                if s.evict && !stopping {
                    // Memory preemption still holds it: the lock hold ends here.
                    Progress::Done
                } else if running {
                    Progress::Done
                } else if stopping {
                    // Everything is resumed at once and the hold book does not wait for the
                    // driver: the driver book keeps the process recorded (its own entry, in the
                    // same write that lets the lock's go) until it is unlocked.
                    self.claim(key);
                    Progress::Done
                } else {
                    Progress::Pending
                }
            }
        }
    }

    /// Keeps `key` in the record under the driver book's own entry (until it runs again).
    fn claim(&mut self, key: ProcKey) {
        let req = self.next_req;
        let Some(s) = self.slots.get_mut(&key) else {
            return;
        };
        if s.rec == CheckpointRecord::No {
            self.next_req += 1;
            s.rec = CheckpointRecord::Asked(req);
            self.records.push(RecordAsk::Add(req, vec![rec_entry(key)]));
        }
    }

    /// Whether memory should be read now; the GPUs to read.
    pub fn memory_due(&self, now: u64, table: &Table) -> Option<Vec<u32>> {
        if !self.cfg.api || self.cfg.reserve.is_none() || now < self.next_read_ns {
            return None;
        }
        let evicted = self.slots.values().any(|s| s.evict);
        if !evicted && !table.offline_present() {
            return None;
        }
        let mut gpus: BTreeSet<u32> = table
            .entries()
            .flat_map(|e| e.gpus.iter().copied())
            .collect();
        gpus.extend(
            self.slots
                .values()
                .filter(|s| s.evict)
                .filter_map(|s| s.gpu),
        );
        Some(gpus.into_iter().collect())
    }

    /// The memory read at `now`: per GPU, pressure judged, evictions and restores decided.
    /// `online(gpu)`: online demand is present there.
    pub fn memory(
        &mut self,
        now: u64,
        reads: Vec<(u32, Result<Option<GpuMemory>, String>)>,
        room: &BTreeMap<u32, u64>,
        table: &Table,
        online: impl Fn(u32) -> bool,
        stopped: impl Fn(&ProcKey, Option<&std::path::Path>) -> bool,
    ) {
        self.next_read_ns = now + self.cfg.memory_interval_ns;
        let Some(reserve) = self.cfg.reserve else {
            return;
        };
        for (gpu, read) in reads {
            let m = match read {
                Ok(Some(m)) => m,
                Ok(None) => continue,
                Err(error) => {
                    self.notes.push(note::MemoryUnread { gpu, error }.into());
                    continue;
                }
            };
            let want = reserve.bytes(m.total);
            let pressure = online(gpu) && m.free < want;
            let entry = self.mem.entry(gpu).or_default();
            if pressure != entry.pressure {
                self.notes.push(
                    note::MemoryPressure {
                        gpu,
                        on: pressure,
                        free: m.free,
                        reserve: want,
                    }
                    .into(),
                );
            }
            entry.pressure = pressure;
            entry.reserve = want;
            if pressure {
                entry.last_pressure_ns = now;
            }
            for (pid, bytes) in &m.processes {
                for (k, s) in self.slots.iter_mut() {
                    if k.pid == *pid && s.gpu == Some(gpu) && s.state != DState::Checkpointed {
                        s.bytes = *bytes;
                    }
                }
            }
            if pressure {
                self.evict(gpu, &m, want, room, table, now, &stopped);
            } else {
                self.restore_due(gpu, &m, want, now, online(gpu));
            }
            if let Some(e) = self.mem.get_mut(&gpu) {
                e.read = Some(m);
            }
        }
    }

    /// Marks offline processes on `gpu` for eviction, largest first, until what they hold
    /// covers what the reserve misses (evictions on their way count).
    #[allow(clippy::too_many_arguments)]
    fn evict(
        &mut self,
        gpu: u32,
        m: &GpuMemory,
        want: u64,
        room: &BTreeMap<u32, u64>,
        table: &Table,
        now: u64,
        stopped: &dyn Fn(&ProcKey, Option<&std::path::Path>) -> bool,
    ) {
        let missing = want.saturating_sub(m.free);
        // What evictions on their way will free: those not checkpointed yet, and those
        // whose memory NVML still counts (its reading may lag the driver's answer).
        // A call that has not returned long after it should (its process stopped by its
        // owner: the driver waits for it to run) frees nothing: others are taken instead.
        let coming: u64 = self
            .slots
            .iter()
            .filter(|(k, s)| {
                s.evict
                    && s.gpu == Some(gpu)
                    && !self.stuck(s, now)
                    && (s.state != DState::Checkpointed
                        || m.processes.iter().any(|(pid, _)| *pid == k.pid))
            })
            .map(|(_, s)| s.bytes)
            .sum();
        if coming >= missing {
            return;
        }
        let mut cands: Vec<(u64, ProcKey)> = m
            .processes
            .iter()
            .filter_map(|(pid, bytes)| {
                let e = table.by_pid(*pid)?;
                let ok = e.gpus.contains(&gpu)
                    && e.pinned
                    // A stopped process cannot be locked until it runs.
                    && !stopped(&e.key, e.stopped_with())
                    && self.opted_in(&e.cls)
                    && self.lockable(&e.key, &e.cls)
                    && self.slots.get(&e.key).is_none_or(|s| {
                        !s.evict && s.refused.is_none() && s.state != DState::Failed
                    });
                (ok && *bytes > 0).then_some((*bytes, e.key))
            })
            .collect();
        // The driver keeps a checkpoint in the process's own memory, charged to its memory
        // limit: one without room for it would be OOM-killed by it.
        cands.retain(|(bytes, key)| {
            let need = checkpoint_host_bytes(*bytes);
            match room.get(&key.pid) {
                Some(r) if *r < need => {
                    if self.no_room.insert(*key) {
                        self.notes.push(
                            note::NoRoomForCheckpoint {
                                pid: key.pid,
                                room: *r,
                                need,
                            }
                            .into(),
                        );
                    }
                    false
                }
                _ => true,
            }
        });
        cands.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut covered = coming;
        for (bytes, key) in cands {
            if covered >= missing {
                break;
            }
            covered += bytes;
            let req = self.next_req;
            self.next_req += 1;
            let s = self.slot(key, table);
            s.evict = true;
            s.bytes = bytes;
            s.gpu = Some(gpu);
            s.rec = CheckpointRecord::Asked(req);
            self.records.push(RecordAsk::Add(req, vec![rec_entry(key)]));
            self.notes.push(
                note::Evicting {
                    gpu,
                    pid: key.pid,
                    bytes,
                    missing,
                }
                .into(),
            );
        }
    }

    /// Gives back checkpointed processes of `gpu` once the GPU has been out of pressure
    /// for `--restore-after`: the largest first, as many as the free memory holds with the
    /// reserve (without it when no online work is there), restores on their way counted as
    /// taken. Side by side: one restore that does not return (its process stopped by its
    /// owner) keeps no other process checkpointed.
    fn restore_due(&mut self, gpu: u32, m: &GpuMemory, want: u64, now: u64, online: bool) {
        let quiet_since = self.mem.get(&gpu).map_or(0, |e| e.last_pressure_ns);
        if now.saturating_sub(quiet_since) < self.cfg.restore_after_ns {
            return;
        }
        let keep = if online { want } else { 0 };
        let restoring: u64 = self
            .slots
            .values()
            .filter(|s| s.gpu == Some(gpu) && matches!(s.call, Some((DriverOp::Restore, _))))
            .map(|s| s.bytes)
            .sum();
        let mut free = m.free.saturating_sub(restoring);
        let mut cands: Vec<(u64, ProcKey)> = self
            .slots
            .iter()
            .filter(|(_, s)| {
                s.evict
                    && s.gpu == Some(gpu)
                    && s.state == DState::Checkpointed
                    && s.call.is_none()
                    && now >= s.restore_not_before_ns
            })
            .map(|(k, s)| (s.bytes, *k))
            .collect();
        cands.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        for (bytes, k) in cands {
            if bytes.saturating_add(keep) <= free {
                free -= bytes;
                if let Some(s) = self.slots.get_mut(&k) {
                    s.evict = false;
                }
            }
        }
    }

    /// Whether `s`'s call has run far past what it should take (its process stopped by its
    /// owner, most likely: the driver waits for it to run). Said once.
    fn stuck(&self, s: &Slot, now: u64) -> bool {
        let Some((op, at)) = s.call else {
            return false;
        };
        let gib = s.bytes / (1 << 30);
        let bound = match op {
            DriverOp::Lock => self.cfg.lock_timeout.as_nanos() as u64 + 250_000_000,
            DriverOp::Checkpoint => 10_000_000_000 + 2_000_000_000 * gib,
            DriverOp::Restore => 10_000_000_000 + 1_000_000_000 * gib,
            _ => 5_000_000_000,
        };
        now.saturating_sub(at) > bound
    }

    /// The record answered request `req`.
    pub fn recorded(&mut self, req: Req, ok: bool) {
        for (k, s) in self.slots.iter_mut() {
            if s.rec == CheckpointRecord::Asked(req) {
                if ok {
                    s.rec = CheckpointRecord::OnDisk;
                } else {
                    // Not on disk: not evicted.
                    s.rec = CheckpointRecord::No;
                    s.evict = false;
                    self.notes
                        .push(note::EvictionNotRecorded { pid: k.pid }.into());
                }
            }
        }
    }

    /// The next calls to make: per process with no call in flight, the one step toward
    /// what is wanted of it. `stopped(key, cgroup)`: a hold of the hold book stops the
    /// process (itself, or the cgroup its plan names) — a restore waits for the thaw.
    pub fn calls(
        &mut self,
        now: u64,
        stopped: impl Fn(&ProcKey, Option<&std::path::Path>) -> bool,
    ) {
        let timeout = self.cfg.lock_timeout;
        let mut forget = Vec::new();
        let stuck: Vec<ProcKey> = self
            .slots
            .iter()
            .filter(|(_, s)| !s.said_stuck && self.stuck(s, now))
            .map(|(k, _)| *k)
            .collect();
        for k in stuck {
            if let Some(s) = self.slots.get_mut(&k) {
                s.said_stuck = true;
                if let Some((op, at)) = s.call {
                    self.notes.push(
                        note::DriverCallStuck {
                            op,
                            pid: k.pid,
                            owner: s.owner.clone(),
                            secs: now.saturating_sub(at) as f64 / 1e9,
                        }
                        .into(),
                    );
                }
            }
        }
        for (key, s) in self.slots.iter_mut() {
            if s.call.is_some() {
                continue;
            }
            // A checkpointed process has left the driver's lists: whether it still lives
            // is asked of the driver (the call finds it gone) every 2 s.
            if s.state == DState::Checkpointed && !s.probe && now >= s.next_probe_ns {
                if s.next_probe_ns != 0 {
                    s.probe = true;
                }
                s.next_probe_ns = now + 2_000_000_000;
            }
            let want = if s.evict && !self.stopping {
                DState::Checkpointed
            } else if s.time_hold && !self.stopping {
                DState::Locked
            } else {
                DState::Running
            };
            let op = match (s.state, want) {
                _ if s.given_up => None,
                _ if s.probe => Some(DriverOp::State),
                (DState::Failed, _) => None,
                // Never again once the driver refused (the hold book learns it at its
                // next check and falls back).
                // Not while another hold stops it: the driver would wait for it to run.
                (DState::Running, DState::Locked) => (s.refused.is_none()
                    && !stopped(key, s.cgroup.as_deref()))
                .then_some(DriverOp::Lock),
                // Memory preemption locks only once its entry is on disk.
                (DState::Running, DState::Checkpointed) => (s.rec == CheckpointRecord::OnDisk
                    && !stopped(key, s.cgroup.as_deref()))
                .then_some(DriverOp::Lock),
                (DState::Locked, DState::Checkpointed) => {
                    (s.rec == CheckpointRecord::OnDisk).then_some(DriverOp::Checkpoint)
                }
                (DState::Checkpointed, DState::Locked | DState::Running) => {
                    // Thaw first: the driver restores on a thread inside the process.
                    (now >= s.restore_not_before_ns && !stopped(key, s.cgroup.as_deref()))
                        .then_some(DriverOp::Restore)
                }
                (DState::Locked, DState::Running) => Some(DriverOp::Unlock),
                _ => None,
            };
            match op {
                Some(op) => {
                    s.call = Some((op, now));
                    self.calls.push(Call {
                        key: *key,
                        op,
                        timeout,
                    });
                }
                None => {
                    // Nothing held any more that the entry covers: let it go (a lock the
                    // lock hold keeps is covered by the hold's own entry).
                    let settled = s.call.is_none()
                        && !s.evict
                        && (matches!(s.state, DState::Running | DState::Failed)
                            || (s.state == DState::Locked && s.time_hold));
                    if settled && s.rec == CheckpointRecord::OnDisk {
                        s.rec = CheckpointRecord::No;
                        self.records.push(RecordAsk::Remove(vec![rec_entry(*key)]));
                    }
                    // Forgotten once nothing is left of it (a write asked for lands first,
                    // and is then let go).
                    if settled
                        && s.rec == CheckpointRecord::No
                        && s.state == DState::Running
                        && !s.time_hold
                        && s.refused.is_none()
                    {
                        forget.push(*key);
                    }
                }
            }
        }
        for k in forget {
            self.slots.remove(&k);
        }
    }

    /// A call ended.
    pub fn done(&mut self, d: Done, now: u64) {
        let Some(s) = self.slots.get_mut(&d.key) else {
            return;
        };
        if s.call.map(|c| c.0) != Some(d.op) {
            return;
        }
        s.call = None;
        s.said_stuck = false;
        if d.op == DriverOp::State {
            s.probe = false;
            match d.state {
                Some(st) => {
                    s.state = match st {
                        crate::control::model::driver::ProcessState::Running => DState::Running,
                        crate::control::model::driver::ProcessState::Locked => DState::Locked,
                        crate::control::model::driver::ProcessState::Checkpointed => {
                            DState::Checkpointed
                        }
                        _ => DState::Failed,
                    };
                    if s.state == DState::Failed {
                        self.notes.push(
                            note::DriverFailedState {
                                pid: d.key.pid,
                                owner: s.owner.clone(),
                            }
                            .into(),
                        );
                    }
                }
                None if matches!(d.end, CallEnd::Gone) => self.died(d.key),
                // The driver does not say: taken as it was; the next failure asks again.
                None => {}
            }
            return;
        }
        let took_s = d.elapsed.as_secs_f64();
        let (ok, reason, error) = match &d.end {
            CallEnd::Answered(Ok(())) => (true, None, None),
            CallEnd::Answered(Err(e)) => (false, Some(e.reason()), Some(e.to_string())),
            CallEnd::Gone => (false, Some("gone".to_string()), None),
        };
        if ok {
            s.state = match d.op {
                DriverOp::Lock | DriverOp::Restore => DState::Locked,
                DriverOp::Checkpoint => DState::Checkpointed,
                DriverOp::Unlock => DState::Running,
                _ => s.state,
            };
        }
        if ok && d.op == DriverOp::Checkpoint {
            s.checkpointed_ns = now;
        }
        if let CallEnd::Answered(Err(e)) = &d.end {
            self::failed(s, d.op, e, now, self.cfg.restore_after_ns);
            // At exit a restore the driver refuses (no room while online holds the
            // memory) is not waited for: the process stays checkpointed and recorded.
            if self.stopping && d.op == DriverOp::Restore {
                s.given_up = true;
                self.notes.push(
                    note::RestoreGivenUp {
                        pid: d.key.pid,
                        owner: s.owner.clone(),
                    }
                    .into(),
                );
            }
        }
        let gone = matches!(d.end, CallEnd::Gone);
        self.notes.push(
            note::DriverCall {
                op: d.op,
                pid: d.key.pid,
                owner: s.owner.clone(),
                took_s,
                bytes: s.bytes,
                reason: reason.clone(),
                error,
                fallback: s.refused.is_some() && !ok,
            }
            .into(),
        );
        if matches!(d.op, DriverOp::Checkpoint | DriverOp::Restore) {
            let ev = DriverEvent {
                at_ns: now,
                gpu: s.gpu,
                pid: d.key.pid,
                owner: s.owner.clone(),
                bytes: s.bytes,
                took_s,
                ok,
                reason,
            };
            self.events.push(if d.op == DriverOp::Checkpoint {
                Event::Checkpoint(ev)
            } else {
                Event::Restore(ev)
            });
        }
        if gone {
            self.died(d.key);
        }
    }

    /// A driver call found process `key` gone: forgotten, and not asked of the driver
    /// again until the lists name it gone too (its slot, with what the driver refused, is
    /// gone with it).
    fn died(&mut self, key: ProcKey) {
        self.gone(&[key]);
        self.dead.insert(key);
    }

    /// Processes that no longer live: forgotten, their entries let go.
    pub fn gone(&mut self, keys: &[ProcKey]) {
        for k in keys {
            self.no_room.remove(k);
            self.dead.remove(k);
            if let Some(s) = self.slots.remove(k) {
                if s.rec != CheckpointRecord::No {
                    self.records.push(RecordAsk::Remove(vec![rec_entry(*k)]));
                }
            }
        }
    }

    /// Whether the driver book keeps `key`.
    pub fn knows(&self, key: &ProcKey) -> bool {
        self.slots.contains_key(key)
    }

    /// The processes the driver book keeps, pinned (so that their exit is seen while the driver's
    /// lists do not show them: a checkpointed process has left them).
    pub fn known(&self) -> Vec<(ProcKey, bool)> {
        self.slots.iter().map(|(k, s)| (*k, s.pinned)).collect()
    }

    /// The agent stops: everything is restored and unlocked (after the holds' thaw).
    pub fn release_all(&mut self) {
        self.stopping = true;
        for s in self.slots.values_mut() {
            s.evict = false;
            s.time_hold = false;
            s.restore_not_before_ns = 0;
        }
    }

    /// Everything the driver holds was let go (or nothing was ever held).
    pub fn idle(&self) -> bool {
        self.slots.values().all(|s| {
            s.call.is_none() && (s.given_up || matches!(s.state, DState::Running | DState::Failed))
        })
    }

    /// Every process the driver book knows: (process, GPU, driver state, bytes, owner).
    pub fn view(&self) -> Vec<(ProcKey, Option<u32>, DState, u64, String)> {
        self.slots
            .iter()
            .map(|(k, s)| (*k, s.gpu, s.state, s.bytes, s.owner.clone()))
            .collect()
    }

    /// Forgets every lock hold (the NVML watchdog resumed everything the hold book
    /// held): the locks are let go; memory preemption keeps what it checkpointed.
    pub fn forget_holds(&mut self) {
        for s in self.slots.values_mut() {
            s.time_hold = false;
        }
        // The record forgot every hold, and every request on its way: what the driver still
        // holds, and what memory preemption is about to take, is asked for again.
        let held: Vec<ProcKey> = self
            .slots
            .iter()
            .filter(|(_, s)| {
                s.state != DState::Running
                    || s.call.is_some()
                    || s.evict
                    || matches!(s.rec, CheckpointRecord::Asked(_))
            })
            .map(|(k, _)| *k)
            .collect();
        for k in held {
            if let Some(s) = self.slots.get_mut(&k) {
                s.rec = CheckpointRecord::No;
            }
            self.claim(k);
        }
    }

    /// Processes the driver's lock holds (locked or checkpointed).
    pub fn locked(&self) -> usize {
        self.slots.values().filter(|s| s.held()).count()
    }

    /// Per GPU read, the memory summary.
    pub fn summary(&self) -> BTreeMap<u32, MemorySummary> {
        let mut out: BTreeMap<u32, MemorySummary> = self
            .mem
            .iter()
            .map(|(g, m)| {
                let r = m.read.clone().unwrap_or_default();
                (
                    *g,
                    MemorySummary {
                        total_bytes: r.total,
                        free_bytes: r.free,
                        reserve_bytes: m.reserve,
                        pressure: m.pressure,
                        ..MemorySummary::default()
                    },
                )
            })
            .collect();
        for s in self.slots.values() {
            if let (Some(g), DState::Checkpointed) = (s.gpu, s.state) {
                let e = out.entry(g).or_default();
                e.checkpointed += 1;
                e.checkpointed_bytes += s.bytes;
            }
        }
        out
    }

    /// What the driver book asks of the shell, in order.
    pub fn take_calls(&mut self) -> Vec<Call> {
        std::mem::take(&mut self.calls)
    }

    /// What the driver book asks of the record book, in order.
    pub fn take_records(&mut self) -> Vec<RecordAsk> {
        std::mem::take(&mut self.records)
    }

    /// What the driver book has to say.
    pub fn take_notes(&mut self) -> (Vec<Note>, Vec<Event>) {
        (
            std::mem::take(&mut self.notes),
            std::mem::take(&mut self.events),
        )
    }

    /// When the driver book needs to look again, ns: at its next memory read, soon while a call
    /// is in flight (the shell brings its end at the next step), and when a restore may be
    /// tried again.
    pub fn next_due_ns(&self, now: u64) -> Option<u64> {
        let retry = self
            .slots
            .values()
            .filter(|s| s.state == DState::Checkpointed && s.restore_not_before_ns > now)
            .map(|s| s.restore_not_before_ns)
            .min();
        // Soon after a call started (a lock ends in a millisecond), then less often.
        let call = self
            .slots
            .values()
            .filter_map(|s| s.call.map(|(_, at)| now.saturating_sub(at)))
            .min()
            .map(|age| now + (age / 10).clamp(1_000_000, 100_000_000))
            .or(retry);
        let read = (self.cfg.api && self.cfg.reserve.is_some() && !self.mem.is_empty()
            || self.slots.values().any(|s| s.evict))
        .then_some(self.next_read_ns.max(now));
        match (call, read) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

/// The driver refused `op`: what that means for the process. Where it is now is asked of
/// the driver before the next call (`probe`).
fn failed(s: &mut Slot, op: DriverOp, e: &CuError, now: u64, restore_after_ns: u64) {
    let why = e.to_string();
    s.probe = true;
    match op {
        // The lock did not take (a lock that times out leaves the process running): held
        // by its other plan from now on, and not evicted.
        DriverOp::Lock => {
            s.refused = Some(why);
            s.evict = false;
        }
        // Not checkpointed: it stays locked (unlocked when nothing wants it held), and is
        // not evicted again.
        DriverOp::Checkpoint => {
            s.evict = false;
            s.refused = Some(why);
        }
        // Still checkpointed (no room, or the driver refused): tried again after
        // --restore-after.
        DriverOp::Restore => {
            s.evict = true;
            s.restore_not_before_ns = now + restore_after_ns;
        }
        // Still locked: tried again at the next step.
        DriverOp::Unlock => {}
        _ => {}
    }
}

/// Views the tests read.
#[cfg(test)]
impl DriverBook {
    /// The settings.
    pub fn config(&self) -> &DriverBookConfig {
        &self.cfg
    }

    /// Whether a lock hold wants `key` locked.
    pub fn time_held(&self, key: &ProcKey) -> bool {
        self.slots.get(key).is_some_and(|s| s.time_hold)
    }

    /// Whether memory preemption wants `key` checkpointed (or keeps it so).
    pub fn evicting(&self, key: &ProcKey) -> bool {
        self.slots.get(key).is_some_and(|s| s.evict)
    }
}

#[cfg(test)]
mod reserve_tests {
    use super::Reserve;

    #[test]
    fn reserves_parse_with_units_and_percents_and_name_what_is_wrong() {
        assert_eq!(Reserve::parse("8GiB"), Ok(Reserve::Bytes(8 << 30)));
        assert_eq!(Reserve::parse("512MiB"), Ok(Reserve::Bytes(512 << 20)));
        assert_eq!(Reserve::parse("1.5GB"), Ok(Reserve::Bytes(1_500_000_000)));
        assert_eq!(Reserve::parse("4096"), Ok(Reserve::Bytes(4096)));
        assert_eq!(Reserve::parse("10%"), Ok(Reserve::Percent(10)));
        assert_eq!(
            Reserve::Percent(10).bytes(80 << 30),
            (80u64 << 30) / 100 * 10
        );
        for bad in ["0", "95%", "0%", "8 parsecs", "GiB", "-1GiB", "1e30"] {
            let e = Reserve::parse(bad).expect_err(bad);
            assert!(e.contains(bad), "{e}");
        }
    }
}
