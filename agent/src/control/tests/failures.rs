//! The loop when things go wrong.

use super::*;

/// A target that never confirms does not stop the loop: other GPUs are preempted on the
/// next tick, and after --confirm-timeout the stuck suspension is undone.
#[test]
fn confirmation_cannot_stall_other_gpus() {
    let mut h = harness(2);
    h.spawn(0, 10, class(Class::Offline, None));
    h.spawn(0, 20, class(Class::Online, None));
    h.spawn(1, 11, class(Class::Offline, None));
    h.spawn(1, 21, class(Class::Online, None));
    h.tick();
    h.act.stuck.lock().unwrap().insert(RecordEntry::Process {
        pid: 10,
        start: h.key(10).start,
    });
    h.active(0, 20);
    let t = Instant::now();
    h.tick();
    h.active(1, 21);
    h.tick();
    assert!(
        t.elapsed() < Duration::from_millis(200),
        "ticks blocked for {:?}",
        t.elapsed()
    );
    assert_eq!(
        h.suspends_of(11),
        1,
        "GPU 1 was not preempted while GPU 0's target was pending"
    );
    assert!(h
        .events()
        .iter()
        .any(|e| matches!(e, Event::Preempt(p) if p.gpu == 1 && p.confirmed_ns.is_some())));
    // Keep GPU 0 busy past the confirm timeout (1 s): the stuck suspension is undone.
    for _ in 0..11 {
        h.active(0, 20);
        h.clock.advance(100 * MS);
        h.tick();
    }
    assert!(h.act.calls().iter().any(|c| c.op == Op::Resume
        && c.targets
            .iter()
            .any(|t| matches!(t, RecordEntry::Process { pid: 10, .. }))));
    assert!(!h.lp.holds().holds(&h.key(10)));
}

/// Signals on a cgroup declared offline stop every process in it, not only the GPU one.
#[test]
fn the_signal_actuator_stops_every_process_of_an_offline_cgroup() {
    let root = TmpDir::new("coloc-loop-cg");
    let dir = root.join("batch");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("cgroup.freeze"), "0").unwrap();
    let mut cfg = default_config();
    cfg.cgroups.v2 = Some(root.to_path_buf());
    let mut h = harness_with(1, cfg);
    h.procs.add(10, 110, "train", "/batch");
    h.procs.add(12, 112, "loader", "/batch");
    h.procs.add(13, 113, "loader", "/batch");
    h.procs
        .members
        .lock()
        .unwrap()
        .insert(dir.clone(), vec![10, 12, 13]);
    h.gpu.add(0, 10);
    // The rule `cgroup = "/batch"` matches every process in it.
    for pid in [10, 12, 13] {
        h.source.set(pid, class(Class::Offline, Some("/batch")));
    }
    h.spawn(0, 20, class(Class::Online, None));
    h.tick();
    h.active(0, 20);
    h.tick();
    let calls = h.act.calls();
    let pids: Vec<u32> = calls[0]
        .targets
        .iter()
        .filter_map(|t| match t {
            RecordEntry::Process { pid, .. } => Some(*pid),
            _ => None,
        })
        .collect();
    assert_eq!(pids, vec![10, 12, 13], "{calls:?}");
    // A child forked after the stop joins the held cgroup: found at a re-check, recorded,
    // then stopped, while online stays busy; resumed with the rest at the release.
    h.procs.add(14, 114, "child", "/batch");
    h.procs
        .members
        .lock()
        .unwrap()
        .insert(dir.clone(), vec![10, 12, 13, 14]);
    let child = RecordEntry::Process {
        pid: 14,
        start: 114,
    };
    for _ in 0..25 {
        h.active(0, 20);
        h.tick();
    }
    let calls = h.act.calls();
    let stop = calls
        .iter()
        .find(|c| c.op == Op::Suspend && c.targets.contains(&child))
        .unwrap_or_else(|| panic!("the child that joined the held cgroup runs on: {calls:?}"));
    assert!(
        stop.unrecorded.is_empty(),
        "stopped before recorded: {stop:?}"
    );
    h.ticks(150);
    let calls = h.act.calls();
    assert!(
        calls
            .iter()
            .any(|c| c.op == Op::Resume && c.targets.contains(&child)),
        "the child was not resumed: {calls:?}"
    );
    assert_eq!(h.recorded_beyond_ahead(), vec![], "{:?}", h.rec.disk);
}

/// Samples of a PID that is not in /proc (it exited) are not online demand.
#[test]
fn an_exited_pid_is_never_online_demand() {
    let mut h = harness(1);
    h.spawn(0, 10, class(Class::Offline, None));
    h.tick();
    // The driver still lists PID 30 and has samples of it; /proc does not know it.
    h.gpu.add(0, 30);
    for _ in 0..5 {
        h.active(0, 30);
        h.tick();
    }
    assert_eq!(
        h.suspends_of(10),
        0,
        "offline suspended for an exited process"
    );
}

/// A transient NVML failure keeps the decisions; a persistent one fails open for that GPU
/// only, and the other GPU stays protected.
#[test]
fn nvml_failure_fails_open_only_when_it_persists_and_only_that_gpu() {
    let mut h = harness(2);
    h.spawn(0, 10, class(Class::Offline, None));
    h.spawn(0, 20, class(Class::Online, None));
    h.spawn(1, 11, class(Class::Offline, None));
    h.spawn(1, 21, class(Class::Online, None));
    h.tick();
    h.active(0, 20);
    h.active(1, 21);
    h.tick();
    assert!(h.suspended(10) && h.suspended(11));
    // Two failed ticks on GPU 0: transient.
    h.gpu.fail(0, true);
    for _ in 0..2 {
        h.active(1, 21);
        h.tick();
    }
    assert!(h.suspended(10), "a transient failure failed open");
    assert!(h.lp.shared.degraded().is_none());
    // Past the grace (50 ms) and 3 ticks: GPU 0 fails open, GPU 1 stays suspended.
    for _ in 0..60 {
        h.active(1, 21);
        h.tick();
    }
    assert!(!h.suspended(10), "a persistent failure did not fail open");
    assert!(
        h.suspended(11),
        "GPU 1 lost its protection because GPU 0 failed"
    );
    assert!(h.lp.shared.degraded().unwrap().contains("GPU 0"));
    assert!(h
        .events()
        .iter()
        .any(|e| matches!(e, Event::FailOpen(f) if f.gpu == Some(0) && f.reason == "nvml")));
    // NVML answers again, with samples from during the failure (old): they must not
    // start a busy period; a new sample does, measured from itself.
    let old = h.now() - 30 * MS;
    h.gpu.sample(0, 20, old);
    h.gpu.fail(0, false);
    h.ticks(2);
    assert!(h.lp.shared.degraded().is_none());
    assert!(!h.suspended(10), "an old sample after recovery preempted");
    h.active(0, 20);
    h.tick();
    assert!(h.suspended(10));
    let Some(Event::Preempt(p)) = h
        .events()
        .into_iter()
        .rev()
        .find(|e| matches!(e, Event::Preempt(p) if p.gpu == 0))
    else {
        panic!()
    };
    assert!(
        p.detection_s < 0.002,
        "detection measured from an old sample: {} s",
        p.detection_s
    );
}

/// A hung NVML call: the watchdog resumes everything, /readyz's reason is set, and when
/// the call returns the loop starts afresh.
#[test]
fn a_hung_nvml_call_trips_the_watchdog() {
    let mut h = harness(1);
    h.preempt(10, 20);
    assert!(h.suspended(10));
    h.gpu.set_hang(true);
    let hands = h.lp.hands.clone();
    let budget = h.lp.cfg.confirm_timeout;
    let shared = h.lp.shared.clone();
    let wd = h.lp.watchdog.clone();
    let clock = h.clock.clone();
    let gpu = h.gpu.clone();
    let act = h.act.clone();
    let lp = h.lp;
    let ticking = tick_into_a_hung_call(lp, &gpu);
    let timeout = Duration::from_millis(250);
    assert!(
        !wd.check(
            clock.elapsed_ns() + 200 * MS,
            timeout,
            &hands,
            budget,
            &shared
        ),
        "tripped before the timeout"
    );
    assert!(wd.check(
        clock.elapsed_ns() + 260 * MS,
        timeout,
        &hands,
        budget,
        &shared
    ));
    assert!(
        act.calls().last().is_some_and(|c| c.op == Op::Resume),
        "the watchdog did not resume"
    );
    assert!(shared.degraded().unwrap().contains("NVML call"));
    gpu.set_hang(false);
    h.lp = ticking.join().unwrap();
    assert!(
        h.lp.ctl.sub.machine.suspended().is_empty(),
        "the loop kept decisions the watchdog undid"
    );
    assert!(shared.degraded().is_none());
    assert_eq!(
        h.recorded_beyond_ahead(),
        vec![],
        "what the watchdog resumed stays recorded once the loop knows"
    );
    assert!(h
        .events()
        .iter()
        .any(|e| matches!(e, Event::FailOpen(f) if f.reason == "nvml_hung")));
}

/// Histograms and events carry the actuator that acted: a freezer preference that falls
/// back to signal (no cgroup declared) reports `signal`.
#[test]
fn events_name_the_actuator_that_acted() {
    let mut cfg = default_config();
    cfg.actuator = Kind::Freezer;
    let mut h = harness_with(1, cfg);
    h.preempt(10, 20);
    let ev = h.events();
    assert!(
        matches!(&ev[..], [Event::Preempt(p)] if p.actuator == Some(Kind::Signal)),
        "{ev:?}"
    );
}

/// `fixed-share` caps an offline process to its share of wall time with no online work.
#[test]
fn fixed_share_caps_offline_to_its_share() {
    let mut h = harness(1);
    let mut c = class(Class::Offline, None);
    c.share = Share::Fixed { percent: 30 };
    h.spawn(0, 10, c);
    let mut suspended_ticks = 0;
    for _ in 0..1000 {
        h.tick();
        if h.suspended(10) {
            suspended_ticks += 1;
        }
    }
    assert!(
        (650..=750).contains(&suspended_ticks),
        "suspended {suspended_ticks} of 1000 ms, want ~700"
    );
    assert!(h.suspends_of(10) >= 9, "the duty cycle did not cycle");
}

/// Shutdown resumes everything that is held.
#[test]
fn shutdown_resumes_everything() {
    let mut h = harness(1);
    h.preempt(10, 20);
    h.lp.release_everything(super::super::ReleaseAll::Shutdown);
    assert!(h.lp.holds().is_empty());
    assert_eq!(h.recorded_beyond_ahead(), vec![]);
    assert_eq!(h.act.calls().last().unwrap().op, Op::Resume);
    let _ = PathBuf::new();
}

/// A failed suspension is undone, and tried again (after a short backoff) while online
/// stays busy: the state machine is told what really happened.
#[test]
fn a_failed_suspension_is_retried_while_online_stays_busy() {
    let mut h = harness(1);
    h.spawn(0, 10, class(Class::Offline, None));
    h.spawn(0, 20, class(Class::Online, None));
    h.tick();
    let rec = RecordEntry::Process {
        pid: 10,
        start: h.key(10).start,
    };
    h.act.fail.lock().unwrap().insert(rec.clone());
    h.active(0, 20);
    h.tick();
    assert_eq!(h.suspends_of(10), 1);
    assert!(!h.lp.holds().holds(&h.key(10)));
    // The actuator works again; online is still busy.
    h.act.fail.lock().unwrap().remove(&rec);
    for _ in 0..20 {
        h.active(0, 20);
        h.tick();
    }
    assert_eq!(h.suspends_of(10), 2, "not retried: {:?}", h.act.calls());
    assert!(h.suspended(10), "the retry did not suspend");
}

/// A driver that writes the sample of each `period` at its end (plus `write` ns), for
/// online `pid` busy from `from` to `until`; the loop reads at the user's
/// `--nvml-interval`. Returns the release events seen while online was busy, the ticks
/// (after the first two periods) at which offline ran beside it, and when the release came
/// after it stopped.
fn nvml_only_busy(period: u64, write: u64, until_ms: u64) -> (usize, usize, Option<u64>) {
    let mut cfg = user_config();
    cfg.nvml_sample_period = Duration::from_nanos(period);
    let mut h = harness_with(1, cfg);
    h.spawn(0, 10, class(Class::Offline, None));
    h.spawn(0, 20, class(Class::Online, None));
    h.ticks(3);
    let start = h.now();
    let until = start + until_ms * MS;
    let mut next = start - start % period + period;
    let mut releases_while_busy = 0;
    let mut ran_beside = 0;
    let mut released_at = None;
    while h.now() < until + 3 * period + 500 * MS {
        // The driver writes the period ending at `next` a little after it ends, as busy
        // (the whole period) while online runs.
        if h.now() >= next + write {
            if next <= until {
                h.active_at(0, 20, next);
            }
            next += period;
        }
        h.tick();
        let released = h
            .events()
            .iter()
            .filter(|e| matches!(e, Event::Release(_)))
            .count();
        if h.now() <= until && released > releases_while_busy {
            releases_while_busy = released;
        }
        if h.now() > start + 2 * period + 10 * MS && h.now() <= until && !h.suspended(10) {
            ran_beside += 1;
        }
        if h.now() > until && released_at.is_none() && !h.suspended(10) {
            released_at = Some(h.now() - until);
        }
    }
    (releases_while_busy, ran_beside, released_at)
}

/// Online work seen through NVML alone, busy without a pause, never releases offline work
/// at the shipped defaults (a 100 ms window, a 100 ms driver period read every 100 ms: the
/// release fell due exactly when the next sample was written), nor at a 1 s period; once it
/// stops, the release comes within the window plus a period and a read.
#[test]
fn continuous_online_work_seen_through_nvml_alone_never_releases() {
    for (period_ms, write_us) in [(100, 500), (100, 5_000), (1_000, 500)] {
        let (releases, ran, after) = nvml_only_busy(period_ms * MS, write_us * 1_000, 3_000);
        assert_eq!(
            (releases, ran),
            (0, 0),
            "{period_ms} ms period, written {write_us} µs late: (releases, ticks offline ran) during continuous online work"
        );
        let after = after.expect("never released after online stopped");
        assert!(
            after <= (2 * period_ms + period_ms / 4 + 100 + 5) * MS,
            "{period_ms} ms period: released {} ms after online stopped",
            after / MS
        );
    }
}

/// A sample of a process that started after the latest read of the driver's process lists
/// has the lists read in the tick that reads it (no doorbell rang): the online process
/// is classified and preempts then, not when the lists are next due.
#[test]
fn a_sample_of_a_process_the_lists_do_not_hold_yet_preempts_in_its_tick() {
    let mut h = harness(1);
    h.spawn(0, 10, class(Class::Offline, None));
    // Its pod is known (no change of the pod source follows).
    h.source.set(30, class(Class::Online, None));
    h.ticks(3);
    // Started after the latest list read (due again only in 50 ms); the driver lists it
    // and has a sample of it at work.
    h.procs.add(30, 130, "serve", "/w");
    h.gpu.add(0, 30);
    h.active(0, 30);
    h.lp.tick();
    assert!(
        h.suspended(10),
        "a sample of a process not yet in the lists waited for their next read"
    );
}

/// A hung NVML call while the wall clock steps an hour back (NTP): the watchdog measures
/// the call in elapsed time, not on the wall clock, and still fails open once
/// `--nvml-hang-timeout` has passed.
#[test]
fn a_wall_clock_stepped_back_does_not_hide_a_hung_nvml_call() {
    let clock = SteppedClock::default();
    clock.time.set(T0);
    let gpu = FakeGpu::new(1);
    let edges = Edges {
        gpu: Box::new(gpu.clone()),
        procfs: Arc::new(FakeProc::default()),
        source: Arc::new(FakeSource::default()),
        clock: Arc::new(clock.clone()),
        actuator: Box::new(FakeActuator::default()),
        record: Box::new(FakeRecord::default()),
        bells: Box::new(FakeBells::default()),
        gates: None,
        driver: None,
    };
    let mut cfg = default_config();
    cfg.record_off_loop = false;
    let shared = Arc::new(Shared::default());
    let mut lp = Loop::new(cfg, edges, shared.clone()).unwrap();
    lp.tick();
    clock.time.advance(MS);
    let (wd, hands, budget) = (
        lp.watchdog.clone(),
        lp.hands.clone(),
        lp.cfg.confirm_timeout,
    );
    gpu.set_hang(true);
    let ticking = tick_into_a_hung_call(lp, &gpu);
    // The call has lasted 300 ms; meanwhile the wall clock stepped an hour back.
    clock.step(-3_600_000 * MS as i64);
    clock.time.advance(300 * MS);
    let timeout = Duration::from_millis(250);
    let watching = wd
        .spawn(
            timeout,
            hands,
            budget,
            shared.clone(),
            Arc::new(clock.clone()),
        )
        .unwrap();
    let t = Instant::now();
    while shared.degraded().is_none() && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let degraded = shared.degraded();
    shared.stop.store(true, Ordering::SeqCst);
    gpu.set_hang(false);
    watching.join().unwrap();
    drop(ticking.join().unwrap());
    assert!(
        degraded.is_some_and(|d| d.contains("NVML call")),
        "a call hung for 300 ms (timeout 250 ms) never failed open: the wall clock stepped back"
    );
}

/// Ticks `lp` on a thread of its own until its NVML call hangs on `gpu` (set to hang);
/// the thread ends with the loop once the call returns.
fn tick_into_a_hung_call(mut lp: Loop, gpu: &FakeGpu) -> std::thread::JoinHandle<Loop> {
    let ticking = std::thread::spawn(move || {
        lp.tick();
        lp
    });
    let t = Instant::now();
    while !gpu.in_hang.load(Ordering::SeqCst) {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the tick never reached NVML"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    ticking
}
