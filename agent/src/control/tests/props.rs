//! The loop's invariants as properties: random sequences of what the world does (processes
//! start, exit and reuse PIDs, online work runs, the record and NVML fail, suspensions
//! fail, tenants resume their own processes), played against the loop through the fakes of
//! every edge, with the invariants checked after every tick:
//!
//! - **record before act:** no suspension reaches the actuator before the record holds
//!   every one of its targets;
//! - **only offline work is acted on:** every process the actuator touches was started as
//!   offline under that (PID, start time); a reused PID's new process is never touched;
//! - **released in time:** once online work on a GPU has been idle for the idle window, no
//!   offline process of that GPU stays suspended a tick later, whatever failed meanwhile;
//! - **suspended in time:** offline work on a healthy GPU is suspended by the tick after
//!   online work there is busy (where nothing failed that makes the loop fail open);
//! - **fail-open per GPU:** a GPU whose NVML calls keep failing past the grace has none of
//!   its offline work suspended, while the other GPUs stay protected (the previous rule);
//! - **resume everything on shutdown:** nothing suspended and nothing in the record after.
//!
//! The properties judge what reached the fake actuator and the fake record, not the loop's
//! own state: they hold whatever the loop's insides look like.

use super::*;
use crate::edges::procfs::ProcKey;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

const SLOTS: u32 = 6;
const GPUS: u32 = 2;
const WINDOW: u64 = 100 * MS;

#[derive(Debug, Clone)]
enum Act {
    /// A process starts on a GPU (nothing if the slot's process is alive).
    Spawn { slot: u32, gpu: u32, online: bool },
    /// The slot's process exits.
    Exit { slot: u32 },
    /// The slot's process exits and a new one takes its PID at once, of either class.
    Reuse { slot: u32, online: bool },
    /// The slot's process, if online, is busy now (an NVML sample stamped now).
    Busy { slot: u32 },
    /// The loop ticks every millisecond for this long.
    Run { ms: u32 },
    /// The record's disk fails (or works again).
    RecordBroken(bool),
    /// A GPU's NVML calls fail (or answer again).
    NvmlFails { gpu: u32, on: bool },
    /// Suspending the slot's process fails from now on.
    SuspendFails { slot: u32 },
    /// The tenant resumes the slot's process while it is held.
    TenantResumes { slot: u32 },
}

fn act() -> impl Strategy<Value = Act> {
    prop_oneof![
        3 => (0..SLOTS, 0..GPUS, any::<bool>()).prop_map(|(slot, gpu, online)| Act::Spawn { slot, gpu, online }),
        1 => (0..SLOTS).prop_map(|slot| Act::Exit { slot }),
        1 => (0..SLOTS, any::<bool>()).prop_map(|(slot, online)| Act::Reuse { slot, online }),
        6 => (0..SLOTS).prop_map(|slot| Act::Busy { slot }),
        6 => (1u32..130).prop_map(|ms| Act::Run { ms }),
        1 => any::<bool>().prop_map(Act::RecordBroken),
        1 => (0..GPUS, any::<bool>()).prop_map(|(gpu, on)| Act::NvmlFails { gpu, on }),
        1 => (0..SLOTS).prop_map(|slot| Act::SuspendFails { slot }),
        1 => (0..SLOTS).prop_map(|slot| Act::TenantResumes { slot }),
    ]
}

#[derive(Debug, Clone, Copy)]
struct Proc {
    key: ProcKey,
    gpu: u32,
    online: bool,
    /// When it started (classification takes up to one process-list period).
    born: u64,
}

/// The world the loop runs in, and what the properties remember of it.
struct Play {
    h: H,
    procs: BTreeMap<u32, Proc>,
    next_start: u64,
    /// Every (PID, start) that started as offline: the only processes the loop may touch.
    offline: BTreeSet<RecordEntry>,
    /// The latest online activity per GPU.
    last_busy: BTreeMap<u32, u64>,
    /// A GPU's NVML calls fail since then.
    nvml_failing: BTreeMap<u32, u64>,
    /// The latest time a GPU's NVML calls failed.
    nvml_failed_at: BTreeMap<u32, u64>,
    /// The latest time the record could not be written.
    record_failed_at: Option<u64>,
    /// Busy samples given on this tick: GPU → when each busy process started.
    busy_now: BTreeMap<u32, Vec<u64>>,
    grace: u64,
}

fn entry(k: ProcKey) -> RecordEntry {
    RecordEntry::Process {
        pid: k.pid,
        start: k.start,
    }
}

impl Play {
    fn new() -> Play {
        let h = harness(GPUS);
        let grace = h.lp.cfg.nvml_grace.as_nanos() as u64;
        Play {
            h,
            procs: BTreeMap::new(),
            next_start: 1000,
            offline: BTreeSet::new(),
            last_busy: BTreeMap::new(),
            nvml_failing: BTreeMap::new(),
            nvml_failed_at: BTreeMap::new(),
            record_failed_at: None,
            busy_now: BTreeMap::new(),
            grace,
        }
    }

    fn pid(slot: u32) -> u32 {
        10 + slot
    }

    fn start(&mut self, slot: u32, gpu: u32, online: bool) {
        let pid = Self::pid(slot);
        self.next_start += 1;
        let key = self.h.procs.add(pid, self.next_start, "work", "/w");
        self.h.source.set(
            pid,
            class(
                if online {
                    Class::Online
                } else {
                    Class::Offline
                },
                None,
            ),
        );
        let mut s = self.h.gpu.state.lock().unwrap();
        for list in s.procs.values_mut() {
            list.retain(|p| *p != pid);
        }
        s.procs.entry(gpu).or_default().push(pid);
        drop(s);
        if !online {
            self.offline.insert(entry(key));
        }
        let born = self.h.now();
        self.procs.insert(
            slot,
            Proc {
                key,
                gpu,
                online,
                born,
            },
        );
    }

    fn exit(&mut self, slot: u32) {
        let pid = Self::pid(slot);
        if self.procs.remove(&slot).is_some() {
            self.h.procs.remove(pid);
            let mut s = self.h.gpu.state.lock().unwrap();
            for list in s.procs.values_mut() {
                list.retain(|p| *p != pid);
            }
        }
    }

    fn apply(&mut self, a: &Act) -> Result<(), TestCaseError> {
        match *a {
            Act::Spawn { slot, gpu, online } => {
                if !self.procs.contains_key(&slot) {
                    self.start(slot, gpu, online);
                }
            }
            Act::Exit { slot } => self.exit(slot),
            Act::Reuse { slot, online } => {
                if let Some(p) = self.procs.get(&slot).copied() {
                    self.start(slot, p.gpu, online);
                }
            }
            Act::Busy { slot } => {
                if let Some(p) = self.procs.get(&slot).filter(|p| p.online).copied() {
                    let now = self.h.now();
                    self.h.gpu.sample(p.gpu, p.key.pid, now);
                    self.last_busy.insert(p.gpu, now);
                    self.busy_now.entry(p.gpu).or_default().push(p.born);
                    self.tick()?;
                }
            }
            Act::Run { ms } => {
                for _ in 0..ms {
                    self.tick()?;
                }
            }
            Act::RecordBroken(on) => {
                self.h.rec.broken.store(on, Ordering::SeqCst);
                if on {
                    self.record_failed_at = Some(self.h.now());
                }
            }
            Act::NvmlFails { gpu, on } => {
                self.h.gpu.fail(gpu, on);
                if on {
                    let now = self.h.now();
                    self.nvml_failing.entry(gpu).or_insert(now);
                } else {
                    self.nvml_failing.remove(&gpu);
                }
            }
            Act::SuspendFails { slot } => {
                if let Some(p) = self.procs.get(&slot) {
                    self.h.act.fail.lock().unwrap().insert(entry(p.key));
                }
            }
            Act::TenantResumes { slot } => {
                if let Some(p) = self.procs.get(&slot) {
                    self.h
                        .act
                        .resumed_by_tenant
                        .lock()
                        .unwrap()
                        .insert(entry(p.key));
                }
            }
        }
        Ok(())
    }

    /// What the actuator holds stopped now: each target's latest operation.
    fn stopped(&self) -> BTreeSet<RecordEntry> {
        let mut out = BTreeSet::new();
        for c in self.h.act.calls() {
            for t in c.targets {
                match c.op {
                    Op::Suspend => out.insert(t),
                    Op::Resume => out.remove(&t),
                };
            }
        }
        out
    }

    fn tick(&mut self) -> Result<(), TestCaseError> {
        let before = self.h.now();
        for (g, since) in &self.nvml_failing {
            let _ = since;
            self.nvml_failed_at.insert(*g, before);
        }
        if self.h.rec.broken.load(Ordering::SeqCst) {
            self.record_failed_at = Some(before);
        }
        self.h.lp.tick();
        self.check(before)?;
        self.busy_now.clear();
        self.h.clock.advance(MS);
        Ok(())
    }

    /// The invariants, after the tick that started at `at`.
    fn check(&self, at: u64) -> Result<(), TestCaseError> {
        let calls = self.h.act.calls();
        for c in &calls {
            prop_assert!(
                c.op != Op::Suspend || c.unrecorded.is_empty(),
                "suspended before the record held it: {c:?}"
            );
            for t in &c.targets {
                prop_assert!(
                    self.offline.contains(t),
                    "acted on a process that was never offline under that PID and start: {c:?}"
                );
            }
        }
        let stopped = self.stopped();
        let now = self.h.now();
        for p in self.procs.values().filter(|p| !p.online) {
            let g = p.gpu;
            let held = stopped.contains(&entry(p.key));
            // Released in time: online on this GPU idle for the window, and a tick more.
            let quiet = self.last_busy.get(&g).is_none_or(|b| at > b + WINDOW + MS);
            prop_assert!(
                !(held && quiet),
                "pid {} on GPU {g} still suspended at {} ms, online last busy at {:?} ms",
                p.key.pid,
                (at - T0) / MS,
                self.last_busy.get(&g).map(|b| (b - T0) / MS)
            );
            // Fail-open per GPU: NVML failing past the grace (and the ticks it needs).
            if let Some(since) = self.nvml_failing.get(&g) {
                let bound = self
                    .grace
                    .max(crate::control::health::MIN_FAILED_TICKS as u64 * MS)
                    + 2 * MS;
                prop_assert!(
                    !(held && at >= since + bound),
                    "pid {} suspended on GPU {g} whose NVML has failed since {} ms (now {} ms)",
                    p.key.pid,
                    (since - T0) / MS,
                    (now - T0) / MS
                );
            }
            // Suspended in time: online busy on a healthy GPU this tick, offline known to
            // the loop, nothing failing that makes it fail open or retry.
            let healthy = self
                .nvml_failed_at
                .get(&g)
                .is_none_or(|t| at > t + 300 * MS);
            let record_ok = self.record_failed_at.is_none_or(|t| at > t + 2_000 * MS);
            let can_fail = self.h.act.fail.lock().unwrap().contains(&entry(p.key));
            let known = |born: u64| at >= born + 60 * MS;
            let online_known = self
                .busy_now
                .get(&g)
                .is_some_and(|b| b.iter().any(|b| known(*b)));
            if self.busy_now.contains_key(&g)
                && healthy
                && record_ok
                && !can_fail
                && known(p.born)
                && online_known
            {
                prop_assert!(
                    held,
                    "pid {} not suspended while online work is busy on GPU {g} at {} ms",
                    p.key.pid,
                    (at - T0) / MS
                );
            }
        }
        Ok(())
    }
}

fn play(acts: &[Act]) -> Result<(), TestCaseError> {
    let mut w = Play::new();
    // The loop's first tick (start-up), then the world moves.
    w.tick()?;
    for a in acts {
        w.apply(a)?;
    }
    w.h.lp
        .release_everything(super::super::ReleaseAll::Shutdown);
    prop_assert!(
        w.stopped().is_empty(),
        "suspended after shutdown: {:?}",
        w.stopped()
    );
    prop_assert!(
        w.h.rec.disk.lock().unwrap().is_empty(),
        "left in the record after shutdown: {:?}",
        w.h.rec.disk.lock().unwrap()
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 96,
        max_shrink_iters: 2_000,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Every invariant above, after every tick of a random sequence.
    #[test]
    fn the_loop_keeps_its_promises_whatever_the_world_does(acts in proptest::collection::vec(act(), 1..60)) {
        play(&acts)?;
    }
}

/// A sequence the property found: a busy sample read in the tick whose process-list
/// refresh classifies its process again (the pod source changed) was dropped with the old
/// entry, and the offline work beside it ran on.
#[test]
fn a_sample_read_in_the_tick_that_reclassifies_its_process_still_counts() {
    let acts = vec![
        Act::Spawn {
            slot: 0,
            gpu: 1,
            online: false,
        },
        Act::Spawn {
            slot: 4,
            gpu: 1,
            online: false,
        },
        Act::Reuse {
            slot: 4,
            online: true,
        },
        Act::Run { ms: 60 },
        Act::Spawn {
            slot: 1,
            gpu: 0,
            online: false,
        },
        Act::Busy { slot: 4 },
    ];
    play(&acts).unwrap();
}
