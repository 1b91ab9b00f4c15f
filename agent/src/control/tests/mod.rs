//! The loop's promises, tested in one harness ([`H`]): the real loop (controller and
//! shell) over edges the test steers, with no root, no GPU and no real process touched,
//! and time a fake clock the test moves. The edges are the fakes of `edges/fake` (most
//! files here), or the world model of [`world`], every edge a view of one model (the
//! properties of `props_ctl`, the driver book's tests in `driver_book`). `failures`: what
//! goes wrong (stuck targets, NVML failing or hanging, exited PIDs) and what the loop does.

mod bells;
mod driver_book;
mod failures;
mod gates;
mod holds;
mod learned;
mod props;
mod props_ctl;
mod record;
mod robustness;
mod world;

use super::events::Event;
use super::state::Shared;
use super::{Edges, Loop, LoopConfig};
use crate::cli::{Cli, Command};
use crate::edges::actuator::{Kind, Op, RecordEntry};
use crate::edges::clock::Clock;
use crate::edges::fake::*;
use crate::edges::source::Classified;
use crate::testutil::TmpDir;
use clap::Parser;
use qos_core::{Class, Share};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

const MS: u64 = 1_000_000;
const T0: u64 = 1_000_000 * 1_000_000_000;

/// The configuration a user gets from `coloc-agent run --actuator signal`.
fn default_config() -> LoopConfig {
    let cli = Cli::try_parse_from(["coloc-agent", "run", "--actuator", "signal"]).unwrap();
    let Command::Run(args) = cli.cmd else {
        unreachable!()
    };
    let mut cfg = args.loop_config().unwrap();
    // These tests model a driver that samples every millisecond, read every tick (the
    // doorbell tests below use the real defaults).
    cfg.nvml_interval = Duration::ZERO;
    cfg.nvml_sample_period = Duration::from_millis(1);
    cfg
}

/// The configuration exactly as a user gets it.
fn user_config() -> LoopConfig {
    let cli = Cli::try_parse_from(["coloc-agent", "run", "--actuator", "signal"]).unwrap();
    let Command::Run(args) = cli.cmd else {
        unreachable!()
    };
    args.loop_config().unwrap()
}

/// The one harness of the loop's tests: the real [`Loop`] (controller and shell) over
/// edges the test steers, on a fake clock the test moves. The edges are the fakes of
/// `edges/fake` ([`Fakes`], one handle per edge), or the world model of [`world`] (every
/// edge a view of one model: [`world::World`]); the harness reaches them through `Deref`.
struct H<E = Fakes> {
    lp: Loop,
    clock: FakeClock,
    edges: E,
    /// Scratch directories the harness's files are in (a gate file, the model's cgroups):
    /// dropped last, after the loop that uses them.
    scratch: Vec<TmpDir>,
}

/// The fakes of every edge, one handle each.
struct Fakes {
    gpu: FakeGpu,
    procs: FakeProc,
    source: FakeSource,
    act: FakeActuator,
    rec: FakeRecord,
    bells: FakeBells,
}

impl<E> std::ops::Deref for H<E> {
    type Target = E;
    fn deref(&self) -> &E {
        &self.edges
    }
}

impl<E> std::ops::DerefMut for H<E> {
    fn deref_mut(&mut self) -> &mut E {
        &mut self.edges
    }
}

impl<E> H<E> {
    fn now(&self) -> u64 {
        self.clock.0.load(Ordering::SeqCst)
    }
    /// One tick, then 1 ms passes.
    fn tick(&mut self) {
        self.lp.tick();
        self.clock.advance(MS);
    }
    fn ticks(&mut self, n: usize) {
        for _ in 0..n {
            self.tick();
        }
    }
    fn events(&self) -> Vec<Event> {
        self.lp.telemetry.recent.iter().cloned().collect()
    }
}

fn harness(gpus: u32) -> H {
    harness_with(gpus, default_config())
}

fn harness_with(gpus: u32, cfg: LoopConfig) -> H {
    harness_edges(gpus, cfg, None)
}

/// A harness whose actuator is the gate actuator over the fake one, with its gate file at
/// `gate` (a real file: the test reads the gate words the shims would).
fn harness_edges(gpus: u32, mut cfg: LoopConfig, gate: Option<PathBuf>) -> H {
    // The record is written in the round that asks for it (a test of the thread that
    // writes it off the loop asks for it).
    cfg.record_off_loop = false;
    let clock = FakeClock::default();
    clock.set(T0);
    let gpu = FakeGpu::new(gpus);
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
    let actuator: Box<dyn crate::edges::actuator::Actuator> = Box::new(act.clone());
    let gates = gate.map(|path| -> Box<dyn crate::edges::gate::LaunchGates> {
        Box::new(crate::edges::gate::GateKeeper::new(
            crate::edges::gate::GateFile::create(&path).unwrap(),
        ))
    });
    let edges = Edges {
        gpu: Box::new(gpu.clone()),
        procfs: Arc::new(procs.clone()),
        source: Arc::new(source.clone()),
        clock: Arc::new(clock.clone()),
        actuator,
        record: Box::new(rec.clone()),
        bells: Box::new(bells.clone()),
        gates,
        driver: None,
    };
    let lp = Loop::new(cfg, edges, Arc::new(Shared::default())).unwrap();
    H {
        lp,
        clock,
        edges: Fakes {
            gpu,
            procs,
            source,
            act,
            rec,
            bells,
        },
        scratch: Vec::new(),
    }
}

fn class(c: Class, cgroup: Option<&str>) -> Classified {
    Classified {
        class: c,
        share: Share::Burst,
        owner: format!("test:{c}"),
        freeze_cgroup: cgroup.map(String::from),
        checkpoint: None,
        shim: None,
        container: None,
    }
}

impl H<Fakes> {
    fn spawn(&self, gpu: u32, pid: u32, c: Classified) {
        self.procs.add(pid, 100 + pid as u64, "work", "/w");
        self.gpu.add(gpu, pid);
        self.source.set(pid, c);
    }
    /// Online `pid` on `gpu` is active now (a sample stamped now).
    fn active(&self, gpu: u32, pid: u32) {
        self.gpu.sample(gpu, pid, self.now());
    }
    /// A sample of online `pid` on `gpu` stamped `at` (the end of its period).
    fn active_at(&self, gpu: u32, pid: u32, at: u64) {
        self.gpu.sample(gpu, pid, at);
    }
    /// Offline `off` and online `on` on GPU 0; one tick, then online is active: returns
    /// after the tick that preempts.
    fn preempt(&mut self, off: u32, on: u32) {
        self.spawn(0, off, class(Class::Offline, None));
        self.spawn(0, on, class(Class::Online, None));
        self.tick();
        self.active(0, on);
        self.tick();
    }
    fn suspended(&self, pid: u32) -> bool {
        self.lp
            .ctl
            .sub
            .machine
            .suspended()
            .keys()
            .any(|k| k.pid == pid)
            && self.lp.holds().holds(&self.key(pid))
    }
    fn key(&self, pid: u32) -> crate::edges::procfs::ProcKey {
        self.procs.read_proc_key(pid)
    }
    fn suspends_of(&self, pid: u32) -> usize {
        self.act
            .calls()
            .iter()
            .filter(|c| {
                c.op == Op::Suspend
                    && c.targets
                        .iter()
                        .any(|t| matches!(t, RecordEntry::Process { pid: p, .. } if *p == pid))
            })
            .count()
    }
    /// What the record holds besides what it holds ahead (targets that could be stopped).
    fn recorded_beyond_ahead(&self) -> Vec<RecordEntry> {
        let ahead = self.lp.ctl.record().ahead();
        self.rec
            .disk
            .lock()
            .unwrap()
            .iter()
            .filter(|e| !ahead.contains(e))
            .cloned()
            .collect()
    }
}

impl FakeProc {
    fn read_proc_key(&self, pid: u32) -> crate::edges::procfs::ProcKey {
        self.procs.lock().unwrap()[&pid].key
    }
}

/// Online work on a GPU suspends its offline work; the idle window (100 ms by default)
/// releases it exactly at its end, not a tick before.
#[test]
fn preempts_and_releases_at_the_end_of_the_idle_window() {
    let mut h = harness(1);
    h.spawn(0, 10, class(Class::Offline, None));
    h.spawn(0, 20, class(Class::Online, None));
    h.ticks(5);
    assert!(!h.suspended(10), "offline runs while online is idle");
    let last = h.now();
    h.active(0, 20);
    h.tick();
    assert!(h.suspended(10), "online activity suspends offline at once");
    // No more online activity: still suspended at last + 99 ms ...
    while h.now() < last + 99 * MS {
        h.tick();
        assert!(
            h.suspended(10),
            "released {} ms after online's last activity",
            (h.now() - last) / MS
        );
    }
    h.clock.set(last + 100 * MS);
    h.tick();
    assert!(
        !h.suspended(10),
        "not released at the end of the 100 ms window"
    );
    let ev = h.events();
    let Some(Event::Preempt(p)) = ev.iter().find(|e| matches!(e, Event::Preempt(_))) else {
        panic!("{ev:?}")
    };
    assert_eq!(p.actuator, Some(Kind::Signal));
    assert_eq!(p.signal, qos_core::Signal::Nvml);
    assert_eq!(
        p.onset_ns,
        last - MS,
        "onset: the start of the 1 ms sampled period that ends at the sample's timestamp"
    );
    assert_eq!(
        p.preemption_s,
        Some(0.0015),
        "from onset: the 1 ms sampled period, then the fake's 0.5 ms actuation"
    );
    let Some(Event::Release(r)) = ev.iter().find(|e| matches!(e, Event::Release(_))) else {
        panic!("{ev:?}")
    };
    assert_eq!(r.window_end_ns, last + 100 * MS);
    assert!(r.release_s.is_some());
}

/// Record before act: every suspension's targets are on disk when the actuator starts.
#[test]
fn a_suspension_happens_only_after_the_record_holds_it_on_disk() {
    let mut h = harness(1);
    h.spawn(0, 10, class(Class::Offline, None));
    h.spawn(0, 11, class(Class::Offline, None));
    h.spawn(0, 20, class(Class::Online, None));
    h.ticks(2);
    let ahead = h.rec.disk.lock().unwrap().clone();
    assert_eq!(
        ahead.len(),
        2,
        "written ahead, before any preemption: {ahead:?}"
    );
    h.active(0, 20);
    h.tick();
    let calls = h.act.calls();
    let suspends: Vec<_> = calls.iter().filter(|c| c.op == Op::Suspend).collect();
    assert_eq!(suspends.len(), 1, "{calls:?}");
    assert_eq!(suspends[0].targets.len(), 2);
    assert!(
        suspends[0].unrecorded.is_empty(),
        "suspended before recorded: {:?}",
        suspends[0].unrecorded
    );
    // After the release, the record holds only what it holds ahead: both stay recorded
    // while they could be stopped, so that the next preemption waits for no write.
    h.ticks(120);
    assert_eq!(h.recorded_beyond_ahead(), vec![]);
    assert_eq!(h.rec.disk.lock().unwrap().len(), 2);
}

/// An unwritable record means no suspension at all (and nothing stays in memory): here the
/// record breaks before the process is written ahead, so its preemption needs a write.
#[test]
fn nothing_is_suspended_that_is_not_on_disk() {
    let mut h = harness(1);
    h.rec.broken.store(true, Ordering::SeqCst);
    h.spawn(0, 10, class(Class::Offline, None));
    h.spawn(0, 20, class(Class::Online, None));
    h.tick();
    h.active(0, 20);
    h.tick();
    assert_eq!(
        h.suspends_of(10),
        0,
        "suspended although the record could not be written"
    );
    assert!(h.lp.holds().is_empty());
    let ev = h.events();
    assert!(
        matches!(&ev[..], [Event::Preempt(p)] if p.confirmed_ns.is_none()),
        "{ev:?}"
    );
}

/// A suspension that fails is undone, leaves the record, and the event says nothing was
/// confirmed.
#[test]
fn a_failed_suspension_is_undone_and_reported() {
    let mut h = harness(1);
    h.spawn(0, 10, class(Class::Offline, None));
    h.spawn(0, 20, class(Class::Online, None));
    h.tick();
    let key = h.key(10);
    h.act.fail.lock().unwrap().insert(RecordEntry::Process {
        pid: 10,
        start: key.start,
    });
    h.active(0, 20);
    h.tick();
    let calls = h.act.calls();
    assert!(
        matches!(&calls[..], [s, r] if s.op == Op::Suspend && r.op == Op::Resume),
        "{calls:?}"
    );
    assert!(h.lp.holds().is_empty());
    assert_eq!(
        h.recorded_beyond_ahead(),
        vec![],
        "undone suspension left in the record"
    );
    let ev = h.events();
    assert!(
        matches!(&ev[..], [Event::Preempt(p)] if p.confirmed_ns.is_none() && p.actuator.is_none()),
        "{ev:?}"
    );
}

/// A PID reused by another process is never acted on: the old key is resumed through its
/// own target, the new process is classified anew (here: online).
#[test]
fn a_reused_pid_is_never_signalled() {
    let mut h = harness(1);
    h.preempt(10, 20);
    assert!(h.suspended(10));
    // PID 10 exits and a new process (start time differs) takes the PID: online this time.
    h.procs.add(10, 999, "new", "/other");
    h.source.set(10, class(Class::Online, None));
    h.clock.advance(60 * MS);
    h.ticks(3);
    for c in h.act.calls() {
        for t in &c.targets {
            assert_ne!(
                *t,
                RecordEntry::Process {
                    pid: 10,
                    start: 999
                },
                "the new process was acted on: {c:?}"
            );
        }
    }
    assert!(!h.lp.holds().holds(&h.key(10)));
}

/// The loop sleeps until something is due: NVML's samples every `--nvml-interval`
/// (100 ms), the process lists every `--process-interval` (50 ms), the end of an idle
/// window; the fast tick only while a confirmation is pending.
#[test]
fn sleeps_until_due_and_reads_nvml_at_its_interval() {
    let mut h = harness_with(1, user_config());
    h.spawn(0, 20, class(Class::Online, None));
    h.ticks(1);
    let w = h.lp.next_wait(h.now());
    assert!(
        w > Duration::from_millis(40) && w <= Duration::from_millis(50),
        "nothing to do: asleep until the process list is due, {w:?}"
    );
    h.spawn(0, 10, class(Class::Offline, None));
    h.clock.advance(60 * MS);
    h.ticks(1);
    let before = h.gpu.state.lock().unwrap().calls;
    // 1000 ticks of 1 ms: samples 10 times, process lists 20 times (one GPU).
    h.ticks(1000);
    let calls = h.gpu.state.lock().unwrap().calls - before;
    assert!(
        (28..=32).contains(&calls),
        "{calls} NVML calls in 1 s: samples every 100 ms and lists every 50 ms expected"
    );
    // Online busy (a doorbell launch now): offline is suspended; while its confirmation
    // is pending the loop ticks fast, then sleeps until the window's end at the latest.
    h.bells.page(1, crate::edges::doorbell::Owner::Pid(20), 0);
    let now = h.now();
    h.bells.ring(1, 0, now, now);
    h.lp.tick();
    assert!(h.suspended(10));
    let w = h.lp.next_wait(h.now());
    assert!(w <= Duration::from_millis(100), "{w:?}");
}
