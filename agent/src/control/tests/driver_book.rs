//! The driver book through the control loop, over the world model's edges: the driver's lock
//! as a hold, memory preemption (largest first, recorded before the lock, restored after
//! `--restore-after` when there is room), refusals that fall back to the other holds, and
//! everything restored and unlocked at exit; a restore that waits for the thaw of the
//! cgroup another process's hold stops, and a refused lock that is never asked again,
//! whatever the order of the driver's answers and the hold book's checks.

use super::world::World;
use super::*;
use crate::control::driver_book::{DState, DriverBook, PodsPolicy, Reserve};
use crate::edges::checkpoint::Op as DriverOp;
use crate::edges::procfs::ProcKey;

fn ticks(w: &mut World, n: u64) {
    for _ in 0..n {
        w.tick();
        if let Some(v) = w.violation() {
            panic!("{v}");
        }
    }
}

fn busy_for(w: &mut World, slot: u32, ms: u64) {
    for _ in 0..ms {
        let p = w.m().procs[&slot].clone();
        w.busy(p.gpu, p.key.pid);
        ticks(w, 1);
    }
}

fn key(w: &World, slot: u32) -> ProcKey {
    w.m().procs[&slot].key
}

#[test]
fn the_drivers_lock_holds_offline_while_online_is_busy_and_unlocks_after_the_window() {
    let mut w = World::with_driver_book(1, false, 0, true, None);
    w.start(0, 0, false);
    w.start(1, 0, true);
    ticks(&mut w, 80);
    let off = key(&w, 0);
    assert_eq!(w.driver_state(&off), DState::Running);
    busy_for(&mut w, 1, 5);
    assert_eq!(
        w.driver_state(&off),
        DState::Locked,
        "locked while online is busy"
    );
    assert!(w.m().stopped.is_empty(), "the lock replaces the stop");
    assert!(
        w.m().disk.contains(&RecordEntry::Lock {
            pid: off.pid,
            start: off.start
        }),
        "the lock is recorded"
    );
    ticks(&mut w, 110);
    assert_eq!(
        w.driver_state(&off),
        DState::Running,
        "unlocked after the window"
    );
}

/// Whatever the order in which the driver's answers and the hold book's checks come: the
/// refusal, then the state query, both answered within the tick (0 ms) or ticks later, a
/// lock slower than a re-check of the holds.
#[test]
fn a_lock_the_driver_refuses_falls_back_to_the_stop() {
    for (lock_ms, state_ms) in [
        (None, None),
        (Some(0), Some(0)),
        (Some(0), Some(3)),
        (Some(15), Some(0)),
    ] {
        let mut w = World::with_driver_book(1, false, 0, true, None);
        w.m().lock_ms = lock_ms;
        w.m().state_ms = state_ms;
        w.start(0, 0, false);
        w.start(1, 0, true);
        ticks(&mut w, 80);
        let off = key(&w, 0);
        w.m().refuse.insert(off);
        busy_for(&mut w, 1, 60);
        let when = format!("lock {lock_ms:?} ms, state query {state_ms:?} ms");
        assert_eq!(w.driver_state(&off), DState::Running, "{when}");
        assert!(
            w.m().stopped.contains(&off),
            "stopped by its other plan once the driver refused ({when})"
        );
        assert_eq!(
            w.m().lock_calls[&off],
            1,
            "a refused lock is asked again ({when})"
        );
        assert_eq!(w.violation(), None, "{when}");
        ticks(&mut w, 150);
        assert!(w.m().stopped.is_empty(), "{when}");
    }
}

#[test]
fn memory_preemption_checkpoints_the_largest_first_until_the_reserve_is_met_and_restores_later() {
    // 16 GiB, each process 4 GiB: online plus three offline leave nothing free; a reserve
    // of 6 GiB needs two checkpoints (4 GiB free after the first).
    let mut w = World::with_driver_book(1, false, 0, false, Some(Reserve::Bytes(6 << 30)));
    w.start(0, 0, false);
    w.start(1, 0, false);
    w.start(2, 0, false);
    ticks(&mut w, 80);
    assert!(w.m().dstate.is_empty(), "no pressure without online work");
    w.start(3, 0, true);
    ticks(&mut w, 100);
    let checkpointed: Vec<u32> = (0..3)
        .filter(|s| w.driver_state(&key(&w, *s)) == DState::Checkpointed)
        .collect();
    assert_eq!(checkpointed.len(), 2, "two are enough: {:?}", w.m().dstate);
    assert!(w.free(0) >= 6 << 30);
    for s in &checkpointed {
        let k = key(&w, *s);
        assert!(
            w.m().disk.contains(&RecordEntry::Checkpoint {
                pid: k.pid,
                start: k.start
            }),
            "a checkpoint is recorded"
        );
    }
    // Online leaves: after --restore-after (300 ms here) both come back, unlocked.
    w.exit(3);
    ticks(&mut w, 200);
    assert_eq!(
        checkpointed
            .iter()
            .filter(|s| w.driver_state(&key(&w, **s)) == DState::Checkpointed)
            .count(),
        2,
        "kept before --restore-after"
    );
    ticks(&mut w, 300);
    assert!(
        w.m().dstate.is_empty(),
        "restored and unlocked: {:?}",
        w.m().dstate
    );
    ticks(&mut w, 5);
    assert!(
        !w.m()
            .disk
            .iter()
            .any(|e| matches!(e, RecordEntry::Checkpoint { .. })),
        "out of the record: {:?}",
        w.m().disk
    );
}

/// The driver keeps a checkpoint in the process's own memory: a process whose memory limit
/// has no room for its device memory would be OOM-killed by its checkpoint, so it is passed
/// over, and the next one taken.
#[test]
fn a_process_whose_memory_limit_has_no_room_is_not_checkpointed() {
    let mut w = World::with_driver_book(1, false, 0, false, Some(Reserve::Bytes(6 << 30)));
    w.start(0, 0, false);
    w.start(1, 0, false);
    w.start(2, 0, true);
    let (a, b) = (key(&w, 0), key(&w, 1));
    // 4 GiB on the GPU: a needs about 4.6 GiB of room; it has 4.
    w.set_room(a.pid, 4 << 30);
    w.set_room(b.pid, 8 << 30);
    ticks(&mut w, 100);
    assert_eq!(w.driver_state(&a), DState::Running, "{:?}", w.m().dstate);
    assert_eq!(
        w.driver_state(&b),
        DState::Checkpointed,
        "{:?}",
        w.m().dstate
    );
}

#[test]
fn a_restore_waits_for_room_for_the_process_and_the_reserve() {
    let mut w = World::with_driver_book(1, false, 0, false, Some(Reserve::Bytes(6 << 30)));
    w.start(0, 0, false);
    w.start(1, 0, false);
    w.start(2, 0, true);
    ticks(&mut w, 100);
    let held: Vec<ProcKey> = w.m().dstate.keys().copied().collect();
    assert_eq!(held.len(), 1, "{:?}", w.m().dstate);
    // Online stays (it holds its memory): 16 - 4 (online) - 4 (the other) = 8 free; the
    // process (4) and the reserve (6) do not fit: it stays checkpointed.
    ticks(&mut w, 600);
    assert_eq!(w.driver_state(&held[0]), DState::Checkpointed);
}

#[test]
fn memory_preemption_takes_only_the_pods_that_opted_in() {
    let mut w = World::with_driver_book(1, false, 0, false, Some(Reserve::Bytes(6 << 30)));
    w.start(0, 0, false);
    w.start(1, 0, true);
    // World entries say nothing of checkpointing: under opt-in, nobody is taken.
    let mut cfg = w.lp.ctl.sub.driver_book.config().clone();
    cfg.pods = PodsPolicy::OptIn;
    w.lp.ctl.sub.driver_book = DriverBook::new(cfg);
    w.m().proc_bytes = 7 << 30;
    ticks(&mut w, 100);
    assert!(w.m().dstate.is_empty(), "{:?}", w.m().dstate);
}

/// Two offline processes and online work on a GPU, writes that take `delay` ms: online
/// busy for 40 ms has one offline process checkpointed (memory preemption) and the other
/// locked (the lock hold).
fn one_checkpointed_one_locked(delay: u32) -> World {
    let mut w = World::with_driver_book(1, false, delay, true, Some(Reserve::Bytes(6 << 30)));
    w.start(0, 0, false);
    w.start(1, 0, false);
    w.start(2, 0, true);
    ticks(&mut w, 80);
    busy_for(&mut w, 2, 40);
    assert!(
        w.m().dstate.values().any(|s| *s == DState::Checkpointed),
        "{:?}",
        w.m().dstate
    );
    w
}

/// Shutdown: the restore, then the unlocks, and the record let go.
#[test]
fn at_exit_everything_is_restored_then_unlocked_and_leaves_the_record() {
    let mut w = one_checkpointed_one_locked(2);
    assert!(
        w.m().dstate.values().any(|s| *s == DState::Locked),
        "{:?}",
        w.m().dstate
    );
    w.shut_down();
    assert!(w.violation().is_none(), "{:?}", w.violation());
    assert!(w.m().dstate.is_empty(), "{:?}", w.m().dstate);
    assert!(w.m().disk.is_empty(), "{:?}", w.m().disk);
}

/// Thaw before restore: the driver restores on a thread inside the process, so a restore
/// asked while a hold stops the process would wait for it (at exit, behind the thaw it
/// waits for). The driver book asks only once no hold stops it.
#[test]
fn a_restore_is_asked_only_once_no_hold_stops_the_process() {
    let mut w = World::with_driver_book(1, false, 0, false, Some(Reserve::Bytes(6 << 30)));
    w.start(0, 0, false);
    w.start(1, 0, false);
    w.start(2, 0, true);
    ticks(&mut w, 100);
    let k = *w.m().dstate.keys().next().expect("one checkpointed");
    let mut v: DriverBook = std::mem::take(&mut w.lp.ctl.sub.driver_book);
    v.release_all();
    v.calls(w.now(), |key, _| *key == k);
    let asked = v.take_calls();
    assert!(
        !asked.iter().any(|c| c.key == k),
        "restore asked while stopped: {asked:?}"
    );
    v.calls(w.now(), |_, _| false);
    let asked = v.take_calls();
    assert!(
        asked
            .iter()
            .any(|c| c.key == k && c.op == DriverOp::Restore),
        "restore asked once thawed: {asked:?}"
    );
}

/// One restore that never returns (its tenant SIGSTOPped the checkpointed process:
/// its CPU threads run while it is checkpointed) must keep no other checkpointed
/// process of the GPU checkpointed: restores run side by side.
#[test]
fn a_restore_that_never_returns_keeps_no_other_process_checkpointed() {
    let mut w = World::with_driver_book(1, false, 0, false, Some(Reserve::Bytes(6 << 30)));
    w.start(0, 0, false);
    w.start(1, 0, false);
    w.start(2, 0, false);
    ticks(&mut w, 80);
    w.start(3, 0, true);
    ticks(&mut w, 100);
    let held: Vec<ProcKey> = (w.m().dstate.iter())
        .filter(|(_, s)| **s == DState::Checkpointed)
        .map(|(k, _)| *k)
        .collect();
    assert_eq!(held.len(), 2, "{:?}", w.m().dstate);
    // Equal sizes: the lowest key is restored first. Its tenant stops it.
    w.m().tenant_stopped.insert(held[0]);
    w.exit(3);
    ticks(&mut w, 2_000);
    assert_eq!(
        w.driver_state(&held[1]),
        DState::Running,
        "another pod's process stays checkpointed behind a restore that never returns: {:?}",
        w.m().dstate
    );
}

/// A lock that never returns (the largest offline process, SIGSTOPped by its tenant —
/// a stopped process keeps its device memory) must not count as memory on its way for
/// ever: once it is overdue other processes are taken, and online gets its reserve.
#[test]
fn a_lock_that_never_returns_does_not_keep_online_from_its_memory() {
    let mut w = World::with_driver_book(1, false, 0, false, Some(Reserve::Bytes(6 << 30)));
    w.start(0, 0, false);
    w.start(1, 0, false);
    w.start(2, 0, false);
    ticks(&mut w, 80);
    let k0 = key(&w, 0);
    w.m().tenant_stopped.insert(k0);
    w.start(3, 0, true);
    ticks(&mut w, 2_000);
    assert!(
        w.free(0) >= 6 << 30,
        "free {} GiB under a 6 GiB reserve after 2 s: {:?}",
        w.free(0) >> 30,
        w.m().dstate
    );
}

/// The NVML watchdog trips while the write of an eviction's checkpoint entry is on
/// its way: the record book drops its waiters; the driver book asks again, and the eviction
/// goes on.
#[test]
fn an_eviction_whose_record_write_was_on_its_way_at_a_watchdog_trip_goes_on() {
    let mut w = World::with_driver_book(1, false, 5, false, Some(Reserve::Bytes(6 << 30)));
    w.start(0, 0, false);
    w.start(1, 0, false);
    w.start(2, 0, false);
    ticks(&mut w, 80);
    w.start(3, 0, true);
    let mut tripped = false;
    for _ in 0..200 {
        ticks(&mut w, 1);
        let offline = w.m().offline.clone();
        let evicting: Vec<ProcKey> = offline
            .into_iter()
            .filter(|k| w.lp.ctl.driver_book().evicting(k))
            .collect();
        let on_disk = evicting.iter().any(|k| {
            w.m().disk.contains(&RecordEntry::Checkpoint {
                pid: k.pid,
                start: k.start,
            })
        });
        if !evicting.is_empty() && !on_disk && !w.m().writes.is_empty() {
            w.tell(crate::control::io::Obs::WatchdogTripped);
            tripped = true;
            break;
        }
    }
    assert!(tripped, "no eviction write seen in flight");
    ticks(&mut w, 3_000);
    assert!(
        w.free(0) >= 6 << 30,
        "free {} GiB under a 6 GiB reserve 3 s after the trip: {:?}",
        w.free(0) >> 30,
        w.m().dstate
    );
}

/// A tenant flips its pod to `gpu-coloc.dev/checkpoint: "false"` while memory
/// preemption is checkpointing it: the next suspension must still take the lock, not
/// stop a process with a driver call on its way (the world flags a stop there).
#[test]
fn a_pod_that_opts_out_mid_checkpoint_is_not_stopped_while_the_driver_holds_it() {
    let mut w = World::with_driver_book(1, false, 0, false, Some(Reserve::Bytes(6 << 30)));
    w.m().call_ms = 300;
    w.start(0, 0, false);
    w.start(1, 0, false);
    w.start(2, 0, false);
    ticks(&mut w, 80);
    w.start(3, 0, true);
    let mut victim = None;
    for _ in 0..800 {
        ticks(&mut w, 1);
        if let Some((k, _)) = w.m().dstate.iter().find(|(_, s)| **s == DState::Locked) {
            victim = Some(*k);
            break;
        }
    }
    let v = victim.expect("one locked");
    w.m().opt_out.insert(v);
    w.m().generation += 1;
    ticks(&mut w, 20);
    for _ in 0..100 {
        let p = w.m().procs[&3].clone();
        w.busy(p.gpu, p.key.pid);
        ticks(&mut w, 1);
    }
}

/// The same trip before any pressure: the same trip with no eviction write on its way; preemption works after it.
#[test]
fn a_watchdog_trip_before_any_pressure_leaves_preemption_working() {
    let mut w = World::with_driver_book(1, false, 5, false, Some(Reserve::Bytes(6 << 30)));
    w.start(0, 0, false);
    w.start(1, 0, false);
    w.start(2, 0, false);
    ticks(&mut w, 80);
    w.tell(crate::control::io::Obs::WatchdogTripped);
    w.start(3, 0, true);
    ticks(&mut w, 3_000);
    assert!(w.free(0) >= 6 << 30, "{:?}", w.m().dstate);
}

/// Thaw before restore inside the loop: three offline processes of 4 GiB share their
/// GPU's cgroup, stopped as a whole by a hold (16 GiB, a reserve of 4 GiB). Online arrives,
/// one is checkpointed; another exits, so the GPU has room to restore it while online
/// works. The hold of the third (opted out of memory preemption, so not held by the
/// driver's lock) stops the cgroup, the checkpointed process in it: its restore waits for
/// the thaw, then runs.
#[test]
fn a_restore_waits_for_the_thaw_of_a_cgroup_a_hold_stops() {
    let mut w = World::with_driver_book(1, false, 0, false, Some(Reserve::Bytes(4 << 30)));
    w.m().shared_cgroups = true;
    for s in 0..3 {
        w.start(s, 0, false);
    }
    // The third opted out of memory preemption: held by its plan, the cgroup's stop.
    let held = key(&w, 2);
    w.m().opt_out.insert(held);
    w.start(3, 0, true);
    ticks(&mut w, 100);
    let ck: Vec<u32> = (0..3)
        .filter(|s| w.driver_state(&key(&w, *s)) == DState::Checkpointed)
        .collect();
    assert_eq!(ck.len(), 1, "one is enough: {:?}", w.m().dstate);
    let ck = key(&w, ck[0]);
    let gone = (0..2).find(|s| key(&w, *s) != ck).unwrap();
    w.exit(gone);
    let mut stopped_ms = 0;
    for _ in 0..600 {
        busy_for(&mut w, 3, 1);
        if w.m().stopped.contains(&ck) {
            stopped_ms += 1;
            assert_eq!(
                w.driver_state(&ck),
                DState::Checkpointed,
                "restored while its cgroup is stopped"
            );
        }
    }
    assert!(
        stopped_ms > 400,
        "the checkpointed process was stopped with its cgroup for {stopped_ms} ms only"
    );
    // Online idle: the cgroup thaws, then the restore runs (--restore-after has passed).
    ticks(&mut w, 300);
    assert!(w.m().stopped.is_empty(), "{:?}", w.m().stopped);
    assert_eq!(w.driver_state(&ck), DState::Running, "{:?}", w.m().dstate);
}

/// Gates that never drain and memory preemption at once: gated processes are evicted (a
/// gate holds nothing) or held by the driver's lock as their gate's fallback, and none is
/// stopped while the driver holds it or a call waits for it (the world flags that stop).
#[test]
fn a_gated_process_being_evicted_is_not_stopped_by_its_gates_fallback() {
    for delay in [0, 3, 8] {
        let mut w = World::with_driver_book(1, true, delay, false, Some(Reserve::Bytes(8 << 30)));
        w.m().ack = super::world::Ack::Never;
        w.start(0, 0, false);
        w.start(1, 0, false);
        w.start(2, 0, false);
        ticks(&mut w, 80);
        w.start(3, 0, true);
        let mut seen = (0, 0, 0);
        for _ in 0..300 {
            busy_for(&mut w, 3, 1);
            let m = w.m();
            seen.0 += m.closed.len();
            seen.1 += m.stopped.len();
            seen.2 += m.dstate.len();
        }
        assert!(
            seen.0 > 0 && seen.2 > 0,
            "writes {delay} ms: no gate closed or nothing evicted ({seen:?})"
        );
        ticks(&mut w, 400);
    }
}

/// The wall clock (the loop's clock) steps an hour forward while the agent waits for the
/// driver's restores on its way out: the wait is measured in elapsed time, so the restores
/// and unlocks are still waited for, and nothing is left checkpointed or locked.
#[test]
fn a_wall_clock_step_on_the_way_out_does_not_cut_the_restores_short() {
    // Writes that land at once: the loop's first wait is for the driver.
    let mut w = one_checkpointed_one_locked(0);
    w.m().wall_step = 3_600_000 * MS;
    w.shut_down();
    assert_eq!(w.m().wall_step, 0, "the loop never waited on its way out");
    assert!(w.violation().is_none(), "{:?}", w.violation());
    assert!(w.m().dstate.is_empty(), "{:?}", w.m().dstate);
    assert!(w.m().disk.is_empty(), "{:?}", w.m().disk);
}
