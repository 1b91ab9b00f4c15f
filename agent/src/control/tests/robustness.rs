//! The loop where holds overlap and where things fail mid-way: two gate holds over one
//! cgroup, a watchdog trip during a gate's wait, a panic in the middle of a suspension, a
//! resume that fails; each test failed before its fix.

use super::*;
use crate::edges::actuator::{Actuator, Progress, Target};
use crate::edges::doorbell::Owner;
use crate::testutil::TmpDir;

fn gate_closed(path: &std::path::Path, gpu: u32) -> bool {
    super::gates::closed(path, gpu).is_some()
}

/// The harness with a gate file in a scratch directory, removed when the guard drops
/// (passing or failing).
fn gate_setup(name: &str, gpus: u32, mut cfg: LoopConfig) -> (H, PathBuf, TmpDir) {
    let dir = TmpDir::new(&format!("coloc-robust-{name}"));
    let path = dir.join("gates");
    cfg.gate_timeout = Duration::from_millis(50);
    let h = harness_edges(gpus, cfg, Some(path.clone()));
    (h, path, dir)
}

/// The NVML watchdog trips while a gate hold waits for its acknowledgement (or any
/// suspension or resume is pending): `forget_all` drops the hold with no completion, and
/// the Preempt event waits for it forever. The tracker never empties, so `next_wait`
/// stays at --poll-interval for the rest of the agent's life, and the event is never
/// emitted.
#[test]
fn a_watchdog_trip_leaves_no_event_waiting_forever() {
    let (mut h, path, _dir) = gate_setup("wd", 1, default_config());
    h.spawn(0, 10, class(Class::Offline, None));
    h.spawn(0, 20, class(Class::Online, None));
    h.bells.offline_page(1, Owner::Pid(10), 0);
    h.bells.ack(1, 0, 0);
    h.ticks(3);
    h.active(0, 20);
    h.tick();
    assert!(gate_closed(&path, 0), "online busy: the gate closed");
    assert!(
        !h.lp.ctl.sub.tracker.is_empty(),
        "the preemption waits for its hold"
    );
    // What the watchdog does while the loop is stuck in NVML, then what the loop does
    // when the call returns.
    let budget = h.lp.cfg.confirm_timeout;
    let n = h.lp.hands().resume_everything(budget);
    assert_eq!(n, 1);
    let now = h.now();
    let _ = now;
    h.lp.tell(crate::control::io::Obs::WatchdogTripped);
    assert!(!gate_closed(&path, 0), "the watchdog opened the gate");
    // Online stays idle from now on: nothing more happens on this GPU.
    h.ticks(500);
    assert!(
        h.lp.ctl.sub.tracker.is_empty(),
        "an event still waits for a hold the book forgot ({:?}); next_wait = {:?} forever",
        h.lp.ctl.sub.tracker,
        h.lp.next_wait(h.now())
    );
}

/// While a gate waits for its acknowledgement the loop sleeps its minimum (50 µs) every
/// time, although the acknowledgement itself wakes it (the page's wake word).
#[test]
fn the_loop_does_not_spin_while_a_gate_waits_for_its_ack() {
    let (mut h, path, _dir) = gate_setup("spin", 1, user_config());
    h.spawn(0, 10, class(Class::Offline, None));
    h.spawn(0, 20, class(Class::Online, None));
    h.bells.offline_page(1, Owner::Pid(10), 0);
    h.bells.ack(1, 0, 0);
    h.ticks(3);
    let mut n = 0;
    while !gate_closed(&path, 0) {
        h.active(0, 20);
        h.tick();
        n += 1;
        assert!(n < 200, "the gate never closed");
    }
    let mut waits = Vec::new();
    for _ in 0..10 {
        h.tick();
        waits.push(h.lp.next_wait(h.now()));
    }
    let short = waits
        .iter()
        .filter(|w| **w <= Duration::from_micros(50))
        .count();
    assert!(
        short == 0,
        "the loop sleeps 50 µs at a time while it waits for the ack: {waits:?}"
    );
}

/// A data-parallel offline job: one container (one cgroup), one process per GPU, each
/// under the shim, so each gets a gate hold whose fallback freezes the same cgroup. The
/// holds' keys differ (Gate(10), Gate(11)) where without the gate they share
/// Cgroup(/batch): GPU 1 going idle releases 11's hold, which thaws the cgroup, and 10
/// runs while online work on GPU 0 is still busy (until a re-check freezes it again and
/// counts a "break" the tenant did not cause).
#[test]
fn two_gate_holds_sharing_a_cgroup_fallback_do_not_thaw_each_other() {
    for gate in [false, true] {
        let root = TmpDir::new(&format!("coloc-robust-ddp-{gate}"));
        let dir = root.join("batch");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("cgroup.freeze"), "0").unwrap();
        let mut cfg = default_config();
        cfg.cgroups.v2 = Some(root.to_path_buf());
        cfg.actuator = Kind::Freezer;
        let (mut h, path, _gates) = if gate {
            let (h, path, dir) = gate_setup("ddp", 2, cfg);
            (h, path, Some(dir))
        } else {
            (harness_with(2, cfg), PathBuf::new(), None)
        };
        for (gpu, pid) in [(0, 10), (1, 11)] {
            h.procs.add(pid, 100 + pid as u64, "train", "/batch");
            h.gpu.add(gpu, pid);
            h.source.set(pid, class(Class::Offline, Some("/batch")));
            h.bells.offline_page(pid as u64, Owner::Pid(pid), 0);
            h.bells.ack(pid as u64, gpu, 0);
        }
        h.procs
            .members
            .lock()
            .unwrap()
            .insert(dir.clone(), vec![10, 11]);
        h.spawn(0, 20, class(Class::Online, None));
        h.spawn(1, 21, class(Class::Online, None));
        h.ticks(3);
        // Online busy on both GPUs; both shims acknowledge their closes.
        h.active(0, 20);
        h.active(1, 21);
        h.tick();
        if gate {
            let epoch = {
                use coloc_doorbell::gate::{Gates, GATE_FILE_SIZE};
                let bytes = std::fs::read(&path).unwrap();
                let mut buf = vec![0u64; GATE_FILE_SIZE / 8];
                for (i, w) in buf.iter_mut().enumerate() {
                    *w = u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap());
                }
                // SAFETY: as above.
                let g = unsafe { Gates::from_raw(buf.as_ptr().cast()) };
                g.read()
                    .into_iter()
                    .map(|(_, u, c, _)| (u, c))
                    .collect::<Vec<_>>()
            };
            for (gpu, pid) in [(0u32, 10u64), (1, 11)] {
                let e = epoch.iter().find(|(u, _)| *u == fake_uuid(gpu)).unwrap().1;
                assert_ne!(e, 0, "gate of GPU {gpu} not closed");
                h.bells.ack(pid, gpu, e);
            }
        }
        h.tick();
        let cg = RecordEntry::Cgroup {
            dir: dir.clone(),
            version: crate::edges::actuator::CgroupVersion::V2,
            cell: None,
        };
        let froze = h
            .act
            .calls()
            .iter()
            .any(|c| c.op == Op::Suspend && c.targets.contains(&cg));
        assert!(
            froze,
            "gate={gate}: the cgroup was not frozen: {:?}",
            h.act.calls()
        );
        // GPU 1 goes idle; GPU 0 stays busy for 200 ms more.
        let before = h.act.calls().len();
        for _ in 0..200 {
            h.active(0, 20);
            h.tick();
        }
        let thaws: Vec<_> = h.act.calls()[before..]
            .iter()
            .filter(|c| c.op == Op::Resume && c.targets.contains(&cg))
            .cloned()
            .collect();
        assert!(
            thaws.is_empty(),
            "gate={gate}: the cgroup holding 10 was thawed while online on GPU 0 was busy: {thaws:?}"
        );
    }
}

/// An actuator whose resumes fail (a thaw the kernel refuses, a SIGCONT that fails).
#[derive(Clone)]
struct NoResume(FakeActuator);

impl Actuator for NoResume {
    fn start(&mut self, t: &[Target], op: Op, budget: Duration) -> Vec<Progress> {
        let p = self.0.start(t, op, budget);
        match op {
            Op::Suspend => p,
            Op::Resume => t
                .iter()
                .map(|_| {
                    Progress::Failed(crate::edges::actuator::ActError::Signal {
                        pid: 0,
                        source: std::io::ErrorKind::PermissionDenied.into(),
                    })
                })
                .collect(),
        }
    }
    fn check(&mut self, t: &[Target], op: Op, budget: Duration) -> Vec<Progress> {
        self.0.check(t, op, budget)
    }
}

/// The watchdog's `resume_everything` clears the hands' ledger whether or not each resume
/// worked, and the loop then forgets every hold: a target whose resume failed stays
/// stopped, in the record, and nothing in this agent tries it again (only a restart).
#[test]
fn a_failed_watchdog_resume_is_not_forgotten() {
    use crate::control::holds::HoldCmd;
    use crate::control::shell::hands::Hands;
    let procs = FakeProc::default();
    let key = procs.add(10, 110, "train", "/w");
    let rec = FakeRecord::default();
    let clock = FakeClock::default();
    let act = FakeActuator {
        disk: rec.disk.clone(),
        ..Default::default()
    };
    let mut hands = Hands::new(
        Box::new(NoResume(act)),
        Arc::new(procs.clone()),
        Arc::new(clock),
        None,
        Err("none in this test".into()),
        Arc::new(crate::control::shell::pins::Pins::default()),
    );
    let t = crate::control::target::Target::Process { key };
    let mut rec = rec;
    crate::edges::record::RecordStore::add(&mut rec, &[t.record()]).unwrap();
    hands.perform(HoldCmd::Start {
        req: 2,
        op: Op::Suspend,
        targets: vec![t.clone()],
        budget: Duration::ZERO,
    });
    // The watchdog trips: the resume fails.
    assert_eq!(hands.resume_everything(Duration::from_millis(10)), 1);
    assert!(
        rec.disk.lock().unwrap().contains(&t.record()),
        "still recorded"
    );
    // The watchdog trips again later (or shutdown): is the stopped target tried again?
    let again = hands.resume_everything(Duration::from_millis(10));
    assert_eq!(
        again, 1,
        "a target whose resume failed is no longer known to the hands (nor the book, after forget_all)"
    );
}

/// An actuator that stops its targets, then panics (a bug anywhere in the hands).
struct PanicAfterSuspend(FakeActuator);

impl Actuator for PanicAfterSuspend {
    fn start(&mut self, t: &[Target], op: Op, budget: Duration) -> Vec<Progress> {
        let p = self.0.start(t, op, budget);
        if op == Op::Suspend {
            panic!("a panic in the hands after the stop");
        }
        p
    }
    fn check(&mut self, t: &[Target], op: Op, budget: Duration) -> Vec<Progress> {
        self.0.check(t, op, budget)
    }
}

/// A panic in the hands mid-conversation: the Loop's Drop (release_everything) should
/// resume what was stopped. In a debug build the drain's debug_assert fires inside Drop
/// during the unwind (the book still waits for the lost answer): panic while panicking,
/// the process aborts; in a release build release_all skips the staged hold.
#[test]
fn a_panic_in_the_hands_resumes_what_was_stopped() {
    let clock = FakeClock::default();
    clock.set(T0);
    let gpu = FakeGpu::new(1);
    let procs = FakeProc::default();
    let source = FakeSource::default();
    let rec = FakeRecord::default();
    let bells = FakeBells::default();
    let act = FakeActuator {
        disk: rec.disk.clone(),
        clock: Some(clock.clone()),
        act_ns: MS / 2,
        ..Default::default()
    };
    let edges = Edges {
        gpu: Box::new(gpu.clone()),
        procfs: Arc::new(procs.clone()),
        source: Arc::new(source.clone()),
        clock: Arc::new(clock.clone()),
        actuator: Box::new(PanicAfterSuspend(act.clone())),
        record: Box::new(rec.clone()),
        bells: Box::new(bells.clone()),
        gates: None,
        driver: None,
    };
    let mut cfg = default_config();
    cfg.record_off_loop = false;
    let mut lp = Loop::new(cfg, edges, Arc::new(Shared::default())).unwrap();
    for (pid, c) in [(10, Class::Offline), (20, Class::Online)] {
        procs.add(pid, 100 + pid as u64, "work", "/w");
        gpu.add(0, pid);
        source.set(pid, class(c, None));
    }
    lp.tick();
    clock.advance(MS);
    gpu.sample(0, 20, clock.0.load(Ordering::SeqCst));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        let mut lp = lp;
        lp.tick();
    }));
    assert!(r.is_err());
    let calls = act.calls();
    assert!(
        calls.iter().any(|c| c.op == Op::Resume),
        "stopped and never resumed: {calls:?}"
    );
}

/// Table: an online process classified again as offline keeps its activity; the machine
/// counts activity as online demand by class, so the kept activity must not keep the GPU
/// busy past the idle window of its last online launch, nor re-preempt later.
#[test]
fn an_online_process_reclassified_offline_is_no_online_demand() {
    let mut h = harness(1);
    h.spawn(0, 10, class(Class::Offline, None));
    h.spawn(0, 20, class(Class::Online, None));
    h.ticks(3);
    for _ in 0..20 {
        h.active(0, 20);
        h.tick();
    }
    assert!(h.suspended(10));
    let last = h.now() - MS;
    // The pod source changes: 20 is offline from now on, and idle.
    h.source.set(20, class(Class::Offline, None));
    while h.now() < last + 99 * MS {
        h.tick();
    }
    h.ticks(5);
    assert!(
        !h.suspended(10),
        "10 still held past the window of 20's last online launch"
    );
    assert!(!h.suspended(20), "20 (offline now) held");
    h.ticks(300);
    assert!(
        !h.suspended(10) && !h.suspended(20),
        "re-preempted by kept activity"
    );
}

/// The controller holds no file descriptor: the pidfd of a process it names lives in the
/// shell, and is closed once the controller names the process no more (it left the GPU).
#[test]
fn a_process_pin_is_closed_once_the_controller_names_it_no_more() {
    let mut h = harness(1);
    h.spawn(0, 10, class(Class::Offline, None));
    h.spawn(0, 20, class(Class::Online, None));
    h.ticks(2);
    let (ten, twenty) = (h.key(10), h.key(20));
    assert!(
        h.lp.pins.get(&ten).is_some(),
        "a classified process is pinned"
    );
    assert!(h.lp.pins.get(&twenty).is_some());
    // 10 leaves the GPU (it lives on): the table forgets it.
    h.gpu
        .state
        .lock()
        .unwrap()
        .procs
        .get_mut(&0)
        .unwrap()
        .retain(|p| *p != 10);
    for _ in 0..5 {
        h.clock.advance(60 * MS);
        h.tick();
    }
    assert!(h.lp.ctl.table().entry(&ten).is_none(), "still in the table");
    assert!(h.lp.pins.get(&ten).is_none(), "its pidfd is still open");
    assert!(
        h.lp.pins.get(&twenty).is_some(),
        "a named process lost its pin"
    );
}

/// No file of the controller (everything under `control/` but the shell and the tests)
/// imports an edge or names a file descriptor type: its model types are its own
/// (`control/model/`), the edges re-export them, and descriptors live in the shell,
/// looked up by process key. Nor does a controller file reach into the shell (which
/// imports the edges), but for `mod.rs`, which declares it, nor log or count: it hands
/// its notes and events to the shell as data, and the shell's renderer says them.
#[test]
fn no_file_of_the_controller_imports_an_edge_or_holds_a_file_descriptor() {
    fn walk(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                if !p.ends_with("shell") && !p.ends_with("tests") {
                    walk(&p, out);
                }
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/control");
    let mut files = Vec::new();
    walk(&root, &mut files);
    assert!(
        files.len() > 20,
        "the controller's files were not found: {files:?}"
    );
    let mut found = Vec::new();
    for p in &files {
        let s = std::fs::read_to_string(p).unwrap();
        for word in [
            "edges::",
            "OwnedFd",
            "BorrowedFd",
            "RawFd",
            "tracing::",
            "metrics::",
            "use tracing",
            "use metrics",
        ] {
            if s.contains(word) {
                found.push(format!("{}: {word}", p.display()));
            }
        }
        if !p.ends_with("control/mod.rs") && s.contains("shell::") {
            found.push(format!("{}: shell::", p.display()));
        }
    }
    assert!(
        found.is_empty(),
        "the controller reaches outside itself: {found:#?}"
    );
}

/// The hands act on a process through its pin, by key: a process whose pin was closed is
/// pinned again (start time checked) and stopped; one that exited (or whose PID is another
/// process's now) cannot be pinned, and is gone: nothing is signalled, nothing is left in
/// the ledger.
#[test]
fn the_hands_pin_by_key_and_a_process_that_cannot_be_pinned_is_gone() {
    use crate::control::holds::{HoldCmd, HoldObs};
    use crate::control::shell::hands::Hands;
    use crate::control::shell::pins::Pins;
    let procs = FakeProc::default();
    let live = procs.add(10, 110, "train", "/w");
    let act = FakeActuator::default();
    let pins = Arc::new(Pins::default());
    let mut hands = Hands::new(
        Box::new(act.clone()),
        Arc::new(procs.clone()),
        Arc::new(FakeClock::default()),
        None,
        Err("none in this test".into()),
        pins.clone(),
    );
    let gone = crate::control::model::ProcKey {
        pid: 11,
        start: 111,
    };
    let start = |hands: &mut Hands, key| {
        let answer = hands.perform(HoldCmd::Start {
            req: 1,
            op: Op::Suspend,
            targets: vec![crate::control::target::Target::Process { key }],
            budget: Duration::ZERO,
        });
        match answer {
            Some(HoldObs::Progress { progress, .. }) => progress,
            a => panic!("{a:?}"),
        }
    };
    assert!(pins.is_empty());
    let p = start(&mut hands, live);
    assert!(matches!(p[..], [Progress::Done]), "{p:?}");
    assert!(pins.get(&live).is_some(), "pinned on demand");
    let p = start(&mut hands, gone);
    assert!(matches!(p[..], [Progress::Gone]), "{p:?}");
    assert_eq!(
        act.calls().len(),
        1,
        "the gone process reached the actuator"
    );
    assert_eq!(
        hands.resume_everything(Duration::ZERO),
        1,
        "the ledger holds the stopped process alone"
    );
}
