//! The controller's promises as properties of the loop over the world model
//! ([`super::world`], every edge of the real shell): random sequences of what the world does,
//! record writes that land at once or ticks later, and, with `--gate`, shims that
//! acknowledge at once, late, falsely or never. Checked at every call of an edge that acts
//! and after every tick:
//!
//! 1. **record before act:** no process is stopped and no gate closed before a write that
//!    holds it has landed (checked at the call), and no write lets go of it while it is
//!    held (checked as each write lands);
//! 2. **released in time:** once online work on a GPU has been idle for the idle window,
//!    no offline process of that GPU is held a tick later, whatever failed meanwhile;
//! 3. **fail-open per GPU:** a GPU whose NVML keeps failing past the grace has none of its
//!    offline work held, while the other GPUs stay protected (offline work on a healthy
//!    GPU is held by the tick after online work there is busy, when writes land at once);
//! 4. **a reused PID is never acted on:** only a live process, under the (PID, start) it
//!    started offline with, is ever stopped or gated (checked at the call);
//! 5. **a gate never keeps offline work running past its bound:** a gate closed for a
//!    process that is still busy-held has the process stopped by its fallback within
//!    `--gate-timeout` (and the writes' delay), whatever the shim acknowledges;
//! 6. **resume everything on shutdown:** nothing held, no gate closed, nothing recorded;
//!    with the driver's checkpoint API, nothing locked or checkpointed either (restored,
//!    then unlocked).
//!
//! With the driver's API (`--driver-lock`, `--memory-reserve`), a driver that refuses some
//! processes' locks and whose calls wait while their process is stopped, also:
//!
//! 7. **record before lock:** no lock is asked of the driver before a write that holds the
//!    process's lock or checkpoint entry has landed (checked at the call);
//! 8. **thaw before restore:** no call that changes a process is asked while the process is
//!    stopped, and no process is stopped while the driver holds it or a call waits for it
//!    (checked at the call);
//! 9. **a lock is a hold like the others:** properties 2 and 3 hold for processes the
//!    driver's lock holds (memory preemption's checkpoints excepted: they end with
//!    `--restore-after`).

use super::world::{ack, Ack, Model, World};
use super::*;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

const SLOTS: u32 = 6;
const GPUS: u32 = 2;
const WINDOW: u64 = 100 * MS;
const GATE_TIMEOUT: u64 = 50 * MS;

#[derive(Debug, Clone)]
enum Act {
    Spawn {
        slot: u32,
        gpu: u32,
        online: bool,
    },
    Exit {
        slot: u32,
    },
    Reuse {
        slot: u32,
        online: bool,
    },
    Busy {
        slot: u32,
    },
    Run {
        ms: u32,
    },
    RecordBroken(bool),
    NvmlFails {
        gpu: u32,
        on: bool,
    },
    /// The slot's process, if online, is busy, then its GPU's NVML fails.
    BusyThenFails {
        slot: u32,
    },
    SuspendFails {
        slot: u32,
    },
    TenantResumes {
        slot: u32,
    },
    /// The slot's process, if online, is busy every millisecond for `ms`.
    BusyFor {
        slot: u32,
        ms: u32,
    },
    /// The slot's pod opts out of memory preemption (`gpu-coloc.dev/checkpoint: "false"`):
    /// held by its plan, not by the driver's lock.
    OptOut {
        slot: u32,
    },
    /// The driver refuses the slot's process's lock from now on.
    DriverRefuses {
        slot: u32,
    },
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
        1 => (0..SLOTS).prop_map(|slot| Act::BusyThenFails { slot }),
        1 => (0..SLOTS).prop_map(|slot| Act::SuspendFails { slot }),
        1 => (0..SLOTS).prop_map(|slot| Act::TenantResumes { slot }),
        1 => (0..SLOTS).prop_map(|slot| Act::DriverRefuses { slot }),
        1 => (0..SLOTS, 100u32..700).prop_map(|(slot, ms)| Act::BusyFor { slot, ms }),
        1 => (0..SLOTS).prop_map(|slot| Act::OptOut { slot }),
    ]
}

/// What the properties remember of the world.
struct Play {
    w: World,
    last_busy: BTreeMap<u32, u64>,
    nvml_failing: BTreeMap<u32, u64>,
    nvml_failed_at: BTreeMap<u32, u64>,
    record_failed_at: Option<u64>,
    faulted: BTreeSet<crate::edges::procfs::ProcKey>,
    /// When a tenant last resumed a process (held again at a re-check).
    tenant: BTreeMap<crate::edges::procfs::ProcKey, u64>,
    /// Busy samples given on this tick: GPU → when each busy process started.
    busy_now: BTreeMap<u32, Vec<u64>>,
    grace: u64,
    /// The world's driver has the checkpoint API.
    driver_book: bool,
}

impl Play {
    fn apply(&mut self, a: &Act) -> Result<(), TestCaseError> {
        match *a {
            Act::Spawn { slot, gpu, online } => {
                if !self.w.m().procs.contains_key(&slot) {
                    self.w.start(slot, gpu, online);
                }
            }
            Act::Exit { slot } => self.w.exit(slot),
            Act::Reuse { slot, online } => {
                let found = self.w.m().procs.get(&slot).cloned();
                if let Some(p) = found {
                    self.w.start(slot, p.gpu, online);
                }
            }
            Act::Busy { slot } => {
                let found = self.w.m().procs.get(&slot).filter(|p| p.online).cloned();
                if let Some(p) = found {
                    self.w.busy(p.gpu, p.key.pid);
                    self.last_busy.insert(p.gpu, self.w.now());
                    self.busy_now.entry(p.gpu).or_default().push(p.born);
                    self.tick()?;
                }
            }
            Act::Run { ms } => {
                for _ in 0..ms {
                    self.tick()?;
                }
            }
            Act::BusyFor { slot, ms } => {
                if self.w.m().procs.get(&slot).is_some_and(|p| p.online) {
                    for _ in 0..ms {
                        self.apply(&Act::Busy { slot })?;
                    }
                }
            }
            Act::OptOut { slot } => {
                let found = self.w.m().procs.get(&slot).cloned();
                if let Some(p) = found {
                    self.w.m().opt_out.insert(p.key);
                    self.w.m().generation += 1;
                }
            }
            Act::RecordBroken(on) => {
                self.w.m().record_broken = on;
                if on {
                    self.record_failed_at = Some(self.w.now());
                }
            }
            Act::NvmlFails { gpu, on } => {
                if on {
                    self.w.m().nvml_failing.insert(gpu);
                    self.nvml_failing.entry(gpu).or_insert(self.w.now());
                } else {
                    self.w.m().nvml_failing.remove(&gpu);
                    self.nvml_failing.remove(&gpu);
                }
            }
            Act::BusyThenFails { slot } => {
                let found = self.w.m().procs.get(&slot).filter(|p| p.online).cloned();
                if let Some(p) = found {
                    self.apply(&Act::Busy { slot })?;
                    self.apply(&Act::NvmlFails {
                        gpu: p.gpu,
                        on: true,
                    })?;
                }
            }
            Act::SuspendFails { slot } => {
                let found = self.w.m().procs.get(&slot).cloned();
                if let Some(p) = found {
                    self.w.m().suspend_fails.insert(p.key);
                    self.faulted.insert(p.key);
                }
            }
            Act::DriverRefuses { slot } => {
                let found = self.w.m().procs.get(&slot).cloned();
                if let Some(p) = found {
                    self.w.m().refuse.insert(p.key);
                }
            }
            Act::TenantResumes { slot } => {
                let found = self.w.m().procs.get(&slot).cloned();
                if let Some(p) = found {
                    let key = p.key;
                    self.w.m().stopped.remove(&key);
                    self.tenant.insert(key, self.w.now());
                }
            }
        }
        Ok(())
    }

    fn tick(&mut self) -> Result<(), TestCaseError> {
        let at = self.w.now();
        for g in self.nvml_failing.keys() {
            self.nvml_failed_at.insert(*g, at);
        }
        if self.w.m().record_broken {
            self.record_failed_at = Some(at);
        }
        self.w.tick();
        if let Some(v) = self.w.violation() {
            return Err(TestCaseError::fail(v));
        }
        self.check(at)?;
        self.no_leaked_lock()?;
        self.busy_now.clear();
        Ok(())
    }

    /// Held for online's sake: stopped, or held by the driver for a lock hold.
    fn held(&self, m: &Model, key: &crate::edges::procfs::ProcKey) -> bool {
        m.stopped.contains(key)
            || (m.driver_state(key) != crate::control::driver_book::DState::Running
                && self.w.lp.ctl.sub.driver_book.time_held(key))
    }

    /// Property 9's other half: whatever the driver holds, the driver book wants held (a lock
    /// hold, or memory preemption), or a call that lets it go is on its way.
    fn no_leaked_lock(&self) -> Result<(), TestCaseError> {
        let m = self.w.m();
        for p in m.procs.values() {
            let k = &p.key;
            let driver_book = &self.w.lp.ctl.sub.driver_book;
            prop_assert!(
                m.driver_state(k) == crate::control::driver_book::DState::Running
                    || driver_book.time_held(k)
                    || driver_book.evicting(k)
                    || m.call_for(k),
                "pid {} left {:?} by the driver with nothing wanting it so",
                k.pid,
                m.driver_state(k)
            );
        }
        Ok(())
    }

    /// Properties 2, 3 and 5, after the tick that started at `at`.
    fn check(&self, at: u64) -> Result<(), TestCaseError> {
        let m = self.w.m();
        let delay = m.write_delay as u64 * MS;
        // An unlock is a driver call: it ends this much later than a SIGCONT.
        let unlock = if self.driver_book {
            m.call_ms * MS + 2 * MS
        } else {
            0
        };
        for p in m.procs.values().filter(|p| !p.online) {
            let g = p.gpu;
            // Held again by a re-check (every 10 ms, two targets at a time).
            let resumed = self.tenant.get(&p.key).is_some_and(|t| at < t + 40 * MS);
            let held = self.held(&m, &p.key);
            let quiet = self
                .last_busy
                .get(&g)
                .is_none_or(|b| at > b + WINDOW + MS + unlock);
            prop_assert!(
                !(held && quiet),
                "pid {} on GPU {g} still held at {} ms, online last busy at {:?} ms",
                p.key.pid,
                (at - T0) / MS,
                self.last_busy.get(&g).map(|b| (b - T0) / MS)
            );
            if let Some(since) = self.nvml_failing.get(&g) {
                let bound = self
                    .grace
                    .max(crate::control::health::MIN_FAILED_TICKS as u64 * MS)
                    + 2 * MS
                    + unlock;
                prop_assert!(
                    !(held && at >= since + bound),
                    "pid {} held on GPU {g}, whose NVML has failed since {} ms",
                    p.key.pid,
                    (since - T0) / MS
                );
            }
            // Protected elsewhere: online busy on a healthy GPU this tick holds its
            // offline work (writes that land at once; nothing failing that fails open).
            let healthy = self
                .nvml_failed_at
                .get(&g)
                .is_none_or(|t| at > t + 300 * MS);
            let record_ok = self.record_failed_at.is_none_or(|t| at > t + 2_000 * MS);
            let known = |born: u64| at >= born + 60 * MS;
            let online_known = self
                .busy_now
                .get(&g)
                .is_some_and(|b| b.iter().any(|b| known(*b)));
            if delay == 0
                && !self.driver_book
                && !m.gate
                && self.busy_now.contains_key(&g)
                && healthy
                && record_ok
                && !self.faulted.contains(&p.key)
                && !resumed
                && known(p.born)
                && online_known
            {
                prop_assert!(
                    held,
                    "pid {} not held while online is busy on GPU {g}",
                    p.key.pid
                );
            }
            // The gate's bound: closed, still closed, and past --gate-timeout.
            if let Some((_, closed_at)) = m.closed.get(&p.key) {
                let busy = self.last_busy.get(&g).is_some_and(|b| at <= b + WINDOW);
                if busy
                    && record_ok
                    && healthy
                    && !self.faulted.contains(&p.key)
                    && !resumed
                    && at >= closed_at + GATE_TIMEOUT + delay + 2 * MS
                {
                    prop_assert!(
                        held,
                        "pid {} runs behind a gate closed at {} ms, past its bound (now {} ms)",
                        p.key.pid,
                        (closed_at - T0) / MS,
                        (at - T0) / MS
                    );
                }
            }
        }
        Ok(())
    }
}

fn play(acts: &[Act], gate: bool, ack: Ack, delay: u32) -> Result<(), TestCaseError> {
    play_in(World::new(GPUS, gate, ack, delay), false, acts)
}

/// With the driver's checkpoint API: the lock hold (`lock`), memory preemption (`reserve`).
fn play_driver(
    acts: &[Act],
    gate: bool,
    delay: u32,
    lock: bool,
    reserve: Option<crate::control::driver_book::Reserve>,
) -> Result<(), TestCaseError> {
    play_driver_timed(acts, gate, delay, lock, reserve, (None, None), false)
}

/// [`play_driver`] with the driver's lock and state query taking `(lock_ms, state_ms)`
/// (unset: as long as every other call), and each GPU's offline processes in one cgroup
/// stopped as a whole where `shared_cgroups`.
fn play_driver_timed(
    acts: &[Act],
    gate: bool,
    delay: u32,
    lock: bool,
    reserve: Option<crate::control::driver_book::Reserve>,
    (lock_ms, state_ms): (Option<u64>, Option<u64>),
    shared_cgroups: bool,
) -> Result<(), TestCaseError> {
    let w = World::with_driver_book(GPUS, gate, delay, lock, reserve);
    w.m().lock_ms = lock_ms;
    w.m().state_ms = state_ms;
    w.m().shared_cgroups = shared_cgroups;
    play_in(w, true, acts)
}

fn play_in(w: World, driver_book: bool, acts: &[Act]) -> Result<(), TestCaseError> {
    let grace = default_config().nvml_grace.as_nanos() as u64;
    let mut p = Play {
        w,
        driver_book,
        last_busy: BTreeMap::new(),
        nvml_failing: BTreeMap::new(),
        nvml_failed_at: BTreeMap::new(),
        record_failed_at: None,
        faulted: BTreeSet::new(),
        tenant: BTreeMap::new(),
        busy_now: BTreeMap::new(),
        grace,
    };
    p.tick()?;
    for a in acts {
        p.apply(a)?;
    }
    // Shutdown, the loop's own way: the disk works again; every hold released, the
    // record's last writes, the driver's restores and unlocks.
    p.w.shut_down();
    if let Some(v) = p.w.violation() {
        return Err(TestCaseError::fail(v));
    }
    let mut m = p.w.m();
    // What the driver still holds is a checkpoint whose restore it refused for want of
    // room (online holds the memory): left checkpointed, and recorded for `coloc-agent
    // resume`. Nothing else.
    let mut left = BTreeSet::new();
    for (k, st) in &m.dstate {
        let gpu = m.procs.values().find(|x| x.key == *k).map(|x| x.gpu);
        let entry = crate::edges::actuator::RecordEntry::Checkpoint {
            pid: k.pid,
            start: k.start,
        };
        prop_assert!(
            *st == crate::control::driver_book::DState::Checkpointed
                && gpu.is_some_and(|g| m.free(g) < m.proc_bytes)
                && m.disk.contains(&entry),
            "the driver still holds {k:?} after shutdown ({st:?}), with room or unrecorded: {:?}, record {:?}",
            m.dstate,
            m.disk
        );
        left.insert(entry);
    }
    m.disk.retain(|e| !left.contains(e));
    prop_assert!(m.stopped.is_empty(), "held after shutdown: {:?}", m.stopped);
    prop_assert!(
        m.closed.is_empty(),
        "a gate closed after shutdown: {:?}",
        m.closed
    );
    prop_assert!(m.disk.is_empty(), "recorded after shutdown: {:?}", m.disk);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 96,
        max_shrink_iters: 2_000,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Every property, after every tick, with writes that land at once or up to 8 ticks
    /// later.
    #[test]
    fn the_controller_keeps_its_promises(
        acts in proptest::collection::vec(act(), 1..60),
        delay in prop_oneof![Just(0u32), 1u32..8],
    ) {
        play(&acts, false, Ack::Never, delay)?;
    }

    /// With the driver's lock as the hold of every offline process, memory preemption
    /// over 16 GiB GPUs (each process holds 4 GiB, the reserve is 8 GiB), or both; some
    /// locks refused, never asked again; with and without gates; locks and state queries
    /// that answer before or after the hold book's next check; each GPU's offline
    /// processes alone or in one cgroup that a hold stops as a whole (a checkpointed
    /// process among them: its restore waits for the thaw).
    #[test]
    fn the_drivers_holds_keep_the_same_promises(
        acts in proptest::collection::vec(act(), 1..60),
        delay in prop_oneof![Just(0u32), 1u32..8],
        gate in any::<bool>(),
        mode in 0u8..3,
        lock_ms in prop_oneof![Just(None), Just(Some(0u64)), (1u64..25).prop_map(Some)],
        state_ms in prop_oneof![Just(None), Just(Some(0u64)), Just(Some(1u64))],
        shared in any::<bool>(),
        reserve_gib in prop_oneof![Just(8u64), Just(4u64)],
    ) {
        let reserve = (mode > 0).then_some(crate::control::driver_book::Reserve::Bytes(reserve_gib << 30));
        play_driver_timed(&acts, gate, delay, mode != 1, reserve, (lock_ms, state_ms), shared)?;
    }

    /// The same with launch gates, whatever the shims acknowledge.
    #[test]
    fn a_gate_never_holds_alone_and_never_past_its_bound(
        acts in proptest::collection::vec(act(), 1..60),
        ack in ack(),
        delay in prop_oneof![Just(0u32), 1u32..8],
    ) {
        play(&acts, true, ack, delay)?;
    }
}

/// A sequence the gate property found: two processes hold one GPU's gate (the first one's
/// PID reused by the second, both offline); when the first is released, its hold on the
/// gate was skipped because the gate's record entry (the GPU's) was still covered by the
/// second, so the gate keeper kept it as a holder and the gate never opened again.
#[test]
fn each_holder_of_a_gpus_gate_opens_its_own_hold() {
    let acts = vec![
        Act::Spawn {
            slot: 3,
            gpu: 0,
            online: false,
        },
        Act::Spawn {
            slot: 0,
            gpu: 0,
            online: true,
        },
        Act::Busy { slot: 0 },
        Act::Reuse {
            slot: 3,
            online: false,
        },
        Act::Run { ms: 50 },
    ];
    play(&acts, true, Ack::Never, 0).unwrap();
}

/// A sequence the driver's property found: five processes of 4 GiB on a 16 GiB GPU (the
/// online one among them); memory preemption checkpoints two, and at shutdown the GPU has
/// no room to restore them while online holds its memory: they are left checkpointed and
/// recorded, nothing else is.
#[test]
fn a_restore_refused_at_shutdown_leaves_the_checkpoint_recorded() {
    let acts = [
        Act::Spawn {
            slot: 2,
            gpu: 1,
            online: false,
        },
        Act::Spawn {
            slot: 1,
            gpu: 1,
            online: false,
        },
        Act::Spawn {
            slot: 0,
            gpu: 1,
            online: false,
        },
        Act::Spawn {
            slot: 5,
            gpu: 1,
            online: false,
        },
        Act::Spawn {
            slot: 3,
            gpu: 1,
            online: true,
        },
        Act::Run { ms: 52 },
    ];
    play_driver(
        &acts,
        false,
        0,
        false,
        Some(crate::control::driver_book::Reserve::Bytes(8 << 30)),
    )
    .unwrap();
}

/// A sequence the driver's property found: the lock hold of one offline process while
/// online is busy, then shutdown: nothing may stay recorded.
#[test]
fn a_lock_hold_at_shutdown_leaves_nothing_recorded() {
    let acts = [
        Act::Spawn {
            slot: 0,
            gpu: 0,
            online: false,
        },
        Act::Spawn {
            slot: 4,
            gpu: 0,
            online: true,
        },
        Act::Busy { slot: 4 },
        Act::Run { ms: 100 },
    ];
    play_driver(&acts, false, 0, true, None).unwrap();
}

/// A sequence the driver's property found: memory preemption's lock of a process whose
/// lock entry, written ahead, was lost while the record was broken. Its checkpoint entry
/// is on disk before the lock, as memory preemption records it, and that is what the world
/// must accept (it wanted the lock entry alone, and failed this case at random).
#[test]
fn an_eviction_is_locked_under_its_checkpoint_entry() {
    let acts = [
        Act::Spawn {
            slot: 3,
            gpu: 0,
            online: false,
        },
        Act::Spawn {
            slot: 0,
            gpu: 0,
            online: true,
        },
        Act::Spawn {
            slot: 2,
            gpu: 0,
            online: true,
        },
        Act::Run { ms: 77 },
        Act::Exit { slot: 2 },
        Act::Run { ms: 121 },
        Act::RecordBroken(true),
        Act::Spawn {
            slot: 2,
            gpu: 0,
            online: true,
        },
        Act::Run { ms: 75 },
        Act::Exit { slot: 0 },
        Act::Run { ms: 66 },
        Act::Run { ms: 37 },
        Act::Spawn {
            slot: 0,
            gpu: 0,
            online: true,
        },
        Act::Run { ms: 30 },
    ];
    play_driver(
        &acts,
        false,
        0,
        false,
        Some(crate::control::driver_book::Reserve::Bytes(8 << 30)),
    )
    .unwrap();
}

/// A sequence the driver's property found: an offline process opted out of memory
/// preemption is held by stopping its cgroup, which the process beside it shares; that
/// one, held by the driver's lock, was locked while the cgroup's stop held it (the driver
/// waits for a stopped process to run). It is held by the stop, and locked once it runs.
/// (The order of one decision's holds follows the targets' pidfd numbers here, so the
/// sequence found it only where the stop came first.)
#[test]
fn no_lock_is_asked_of_a_process_another_hold_stops() {
    let acts = [
        Act::Spawn {
            slot: 0,
            gpu: 0,
            online: true,
        },
        Act::BusyFor { slot: 0, ms: 100 },
        Act::Reuse {
            slot: 0,
            online: false,
        },
        Act::Spawn {
            slot: 1,
            gpu: 0,
            online: false,
        },
        Act::OptOut { slot: 0 },
        Act::Run { ms: 5 },
    ];
    play_driver_timed(
        &acts,
        false,
        0,
        false,
        Some(crate::control::driver_book::Reserve::Bytes(8 << 30)),
        (None, None),
        true,
    )
    .unwrap();
}

/// A sequence the gate property found: two offline processes behind gates that never
/// acknowledge, one of them resumed by its tenant. Each gate hold is two targets, the
/// re-check's whole budget, and the round robin's cursor moved past the hold it had no
/// budget left for: that hold was never checked again, and its tenant ran on.
#[test]
fn a_tenant_resuming_itself_leaves_the_other_gate_bounded() {
    let acts = vec![
        Act::Spawn {
            slot: 1,
            gpu: 0,
            online: false,
        },
        Act::Spawn {
            slot: 0,
            gpu: 0,
            online: true,
        },
        Act::Busy { slot: 0 },
        Act::Spawn {
            slot: 2,
            gpu: 0,
            online: false,
        },
        Act::BusyFor { slot: 0, ms: 100 },
        Act::TenantResumes { slot: 1 },
        Act::Run { ms: 41 },
    ];
    play(&acts, true, Ack::Never, 0).unwrap();
}
/// A sequence the gate property found (and, with a lock, the driver property): record
/// writes land 2 ms late, a gate drains at once, and its fallback's record request is
/// still waiting when the agent shuts down. The shutdown abandoned the request but the
/// record book kept its entry held: it stayed recorded after the exit.
#[test]
fn a_replaced_process_leaves_nothing_recorded_after_the_shutdown() {
    let acts = vec![
        Act::Spawn {
            slot: 4,
            gpu: 0,
            online: false,
        },
        Act::Run { ms: 49 },
        Act::Run { ms: 7 },
        Act::Spawn {
            slot: 0,
            gpu: 0,
            online: false,
        },
        Act::Spawn {
            slot: 0,
            gpu: 0,
            online: false,
        },
        Act::Spawn {
            slot: 3,
            gpu: 0,
            online: true,
        },
        Act::Busy { slot: 3 },
        Act::Busy { slot: 3 },
    ];
    play(&acts, true, Ack::AtOnce, 2).unwrap();
}

/// A process whose lock the driver refused, whose PID is reused before the lists are read
/// again: the call that asks where the driver has it finds it gone, and the driver book forgets
/// it (with the refusal); the retried suspension must not ask the driver to lock it again
/// (found by the property above: a lock asked of a refused process).
#[test]
fn a_refused_process_found_gone_by_the_driver_is_not_locked_again() {
    let acts = vec![
        Act::Spawn {
            slot: 4,
            gpu: 1,
            online: false,
        },
        Act::Spawn {
            slot: 2,
            gpu: 1,
            online: true,
        },
        Act::Reuse {
            slot: 3,
            online: false,
        },
        Act::DriverRefuses { slot: 4 },
        Act::Busy { slot: 2 },
        Act::Reuse {
            slot: 4,
            online: false,
        },
        Act::Run { ms: 1 },
    ];
    play_driver_timed(&acts, false, 0, true, None, (Some(0), Some(1)), false).unwrap();
}

/// The same through an exit: a refused process whose state query finds it gone is not
/// locked again while the table still lists it.
#[test]
fn a_refused_process_that_exits_is_not_locked_again() {
    let acts = vec![
        Act::Spawn {
            slot: 1,
            gpu: 0,
            online: false,
        },
        Act::Spawn {
            slot: 5,
            gpu: 0,
            online: false,
        },
        Act::Reuse {
            slot: 1,
            online: true,
        },
        Act::DriverRefuses { slot: 5 },
        Act::Busy { slot: 1 },
        Act::Exit { slot: 5 },
        Act::BusyFor { slot: 1, ms: 100 },
    ];
    play_driver_timed(&acts, false, 0, true, None, (Some(0), None), false).unwrap();
}

/// Two offline processes on a GPU; the PID of one is reused by online work once both are
/// known: the shell's pidfd says the old one has exited, the new one is classified online,
/// and its work holds the other offline process (the random sequences reach this seldom).
#[test]
fn a_pid_reused_by_online_work_is_seen_as_online_work() {
    let acts = vec![
        Act::Spawn {
            slot: 0,
            gpu: 0,
            online: false,
        },
        Act::Spawn {
            slot: 2,
            gpu: 0,
            online: false,
        },
        Act::Run { ms: 60 },
        Act::Reuse {
            slot: 0,
            online: true,
        },
        Act::Run { ms: 60 },
        Act::BusyFor { slot: 0, ms: 5 },
    ];
    play(&acts, false, Ack::Never, 0).unwrap();
}

/// A sequence the driver's property found (seldom: a refusal right before the lock): a
/// lock refused at once (0 ms), with the process's hold still waiting for it; the driver
/// book must not ask it again before the hold book falls back to the stop. Asked again,
/// the refusal came back at once, and the tick's conversation never ended.
#[test]
fn a_lock_refused_at_once_is_not_asked_again() {
    let acts = vec![
        Act::Spawn {
            slot: 0,
            gpu: 0,
            online: false,
        },
        Act::Spawn {
            slot: 5,
            gpu: 0,
            online: true,
        },
        Act::DriverRefuses { slot: 0 },
        Act::Busy { slot: 5 },
    ];
    play_driver_timed(&acts, false, 0, true, None, (Some(0), Some(0)), false).unwrap();
}
