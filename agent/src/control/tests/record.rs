//! The record written ahead and off the loop: a slow state directory delays no GPU's
//! preemption, and what is stopped is still on disk first.

use super::*;

/// How long each write takes on the slow "disk".
const SLOW: Duration = Duration::from_millis(300);

/// A harness whose record is written by the scribe's own thread.
fn off_loop(gpus: u32) -> H {
    let mut h = harness(gpus);
    let mut cfg = h.lp.cfg.clone();
    cfg.record_off_loop = true;
    // Rebuilt on the same fakes, with the record's own thread.
    let edges = Edges {
        gpu: Box::new(h.gpu.clone()),
        procfs: Arc::new(h.procs.clone()),
        source: Arc::new(h.source.clone()),
        clock: Arc::new(h.clock.clone()),
        actuator: Box::new(h.act.clone()),
        record: Box::new(h.rec.clone()),
        bells: Box::new(h.bells.clone()),
        gates: None,
        driver: None,
    };
    h.lp = Loop::new(cfg, edges, Arc::new(Shared::default())).unwrap();
    h
}

/// Waits (real time) until the record holds `e`.
fn wait_recorded(h: &mut H, e: &RecordEntry) {
    let t = Instant::now();
    while !h.rec.disk.lock().unwrap().contains(e) {
        assert!(t.elapsed() < Duration::from_secs(5), "{e:?} never recorded");
        std::thread::sleep(Duration::from_millis(5));
        h.lp.tick();
    }
}

fn entry(h: &H, pid: u32) -> RecordEntry {
    let k = h.key(pid);
    RecordEntry::Process {
        pid: k.pid,
        start: k.start,
    }
}

/// Offline work is written down when it becomes suspendable, by a thread of its own, so
/// the preemption waits for no write; a process whose write has not landed yet waits for
/// it (on its own: the other GPU's preemption does not), and is stopped only after.
#[test]
fn a_slow_record_delays_no_preemption_and_nothing_is_stopped_before_it_is_on_disk() {
    let mut h = off_loop(2);
    h.spawn(0, 10, class(Class::Offline, None));
    h.spawn(0, 20, class(Class::Online, None));
    h.spawn(1, 21, class(Class::Online, None));
    h.tick();
    let ten = entry(&h, 10);
    wait_recorded(&mut h, &ten);
    // The state directory becomes slow; a new offline process appears on GPU 1.
    *h.rec.delay.lock().unwrap() = SLOW;
    h.spawn(1, 11, class(Class::Offline, None));
    h.clock.advance(60 * MS);
    h.tick();
    let eleven = entry(&h, 11);
    assert!(!h.rec.disk.lock().unwrap().contains(&eleven));
    // Online work on both GPUs: GPU 0's preemption completes in this tick.
    h.active(0, 20);
    h.active(1, 21);
    let t = Instant::now();
    h.tick();
    assert!(
        t.elapsed() < SLOW / 3,
        "the tick waited for the disk: {:?}",
        t.elapsed()
    );
    assert_eq!(h.suspends_of(10), 1, "GPU 0 waited for GPU 1's record");
    assert_eq!(h.suspends_of(11), 0, "stopped before its record landed");
    assert!(h
        .events()
        .iter()
        .any(|e| matches!(e, Event::Preempt(p) if p.gpu == 0 && p.confirmed_ns.is_some())));
    // Once the write lands, GPU 1's offline work is stopped, recorded first.
    wait_recorded(&mut h, &eleven);
    let t = Instant::now();
    while h.suspends_of(11) == 0 {
        assert!(t.elapsed() < Duration::from_secs(5), "never stopped");
        h.active(1, 21);
        h.tick();
        std::thread::sleep(Duration::from_millis(1));
    }
    for c in h.act.calls() {
        assert!(c.unrecorded.is_empty(), "stopped before recorded: {c:?}");
    }
    // Shutdown: everything resumed, and the record emptied before the loop ends.
    *h.rec.delay.lock().unwrap() = Duration::from_millis(20);
    h.lp.release_everything(crate::control::ReleaseAll::Shutdown);
    assert!(h.rec.disk.lock().unwrap().is_empty(), "{:?}", h.rec.disk);
    assert!(h.act.calls().last().is_some_and(|c| c.op == Op::Resume));
}

/// A slow state directory (writes land 100 ms later): an offline process held while
/// another process's write is on its way, whose entry no write carries yet, exits before
/// that write lands. Its hold is cancelled and its entry let go: neither the record book
/// nor the hold book waits for an answer that no write will bring.
#[test]
fn a_hold_cancelled_before_any_write_carried_it_waits_for_nothing() {
    let mut w = super::world::World::new(1, false, super::world::Ack::Never, 100);
    w.start(0, 0, false);
    w.start(2, 0, true);
    w.tick();
    // 0's entry is on its way to disk (written ahead); 1 starts and is listed at the next
    // list read, while that write is still on its way.
    w.start(1, 0, false);
    for _ in 0..54 {
        w.tick();
    }
    let online = w.m().procs[&2].key.pid;
    w.busy(0, online);
    w.tick();
    let one = w.m().procs[&1].key;
    assert!(
        w.lp.ctl.holds().holds(&one),
        "1 is held, waiting for its record"
    );
    w.exit(1);
    for _ in 0..300 {
        w.tick();
    }
    assert_eq!(w.violation(), None);
    assert!(!w.lp.ctl.holds().holds(&one));
    assert!(
        !w.lp.ctl.holds().waiting(),
        "the hold book still waits for the record of a hold that was cancelled"
    );
}
