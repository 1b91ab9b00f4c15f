//! The launch gate in the loop: a process whose shim listens drains at its gate and is
//! stopped by its fallback once it acknowledges (or the gate's bound passes); one without a
//! shim is stopped as before; the gate is recorded before it closes and opens at the
//! release, after the process resumes.

use super::*;
use crate::edges::doorbell::Owner;

pub(super) fn closed(path: &std::path::Path, gpu: u32) -> Option<u32> {
    gate_words(path)
        .into_iter()
        .find(|(u, _)| *u == fake_uuid(gpu))
        .map(|(_, c)| c)
        .filter(|c| *c != 0)
}

/// Offline 10 (its shim's page 1 has an entry for GPU 0) and online 20 on GPU 0.
fn setup(name: &str) -> (H, PathBuf) {
    setup_with(name, None, |_| {})
}

/// [`setup`], with a cgroup v2 root, and `before` done before the processes are seen (and
/// written ahead).
fn setup_with(name: &str, root: Option<PathBuf>, before: impl FnOnce(&mut H)) -> (H, PathBuf) {
    let dir = TmpDir::new(&format!("coloc-gate-{name}"));
    let path = dir.join("gates");
    let mut cfg = default_config();
    cfg.gate_timeout = Duration::from_millis(50);
    if root.is_some() {
        cfg.cgroups.v2 = root;
    }
    let mut h = harness_edges(1, cfg, Some(path.clone()));
    h.scratch.push(dir);
    before(&mut h);
    if !h.procs.procs.lock().unwrap().contains_key(&10) {
        h.spawn(0, 10, class(Class::Offline, None));
    }
    h.spawn(0, 20, class(Class::Online, None));
    h.bells.offline_page(1, Owner::Pid(10), 0);
    h.bells.ack(1, 0, 0);
    h.ticks(3);
    (h, path)
}

/// The preemption, once it is confirmed (an event is emitted when its holds are).
fn preempt_event(h: &H) -> Option<crate::control::events::Preempt> {
    h.events().into_iter().find_map(|e| match e {
        Event::Preempt(p) => Some(p),
        _ => None,
    })
}

/// The gate accelerates; it never decides: the process drains at its gate, and its
/// acknowledgement brings the stop that holds it.
#[test]
fn a_process_with_the_shim_drains_at_its_gate_then_its_fallback_holds_it() {
    let (mut h, path) = setup("ack");
    h.active(0, 20);
    h.tick();
    let epoch = closed(&path, 0).expect("online busy on GPU 0: its gate is closed");
    assert!(h.suspended(10));
    assert_eq!(h.suspends_of(10), 0, "stopped before its work drained");
    let gate_rec = RecordEntry::Gate {
        file: path.clone(),
        uuid: coloc_doorbell::format_uuid(&fake_uuid(0)),
    };
    assert!(
        h.rec.disk.lock().unwrap().contains(&gate_rec),
        "the closed gate is in the fail-open record"
    );
    // Not acknowledged yet: the preemption is not confirmed.
    h.ticks(5);
    assert!(preempt_event(&h).is_none(), "confirmed before the ack");
    // An ack of an older epoch does not count.
    h.bells.ack(1, 0, epoch.wrapping_sub(1));
    h.tick();
    assert!(preempt_event(&h).is_none(), "an old epoch confirmed it");
    let acked_at = h.now();
    h.bells.ack(1, 0, epoch);
    h.tick();
    assert_eq!(
        h.suspends_of(10),
        1,
        "drained: its fallback stops it at once"
    );
    let p = preempt_event(&h).expect("confirmed by the stop after the ack");
    assert_eq!(p.actuator, Some(Kind::Gate), "the gate drained it");
    assert_eq!(
        p.confirmed_ns,
        Some(acked_at + MS / 2),
        "confirmed when the stop after the ack was (the fake's 0.5 ms actuation)"
    );
    // Past the gate timeout: one stop, no second one.
    for _ in 0..60 {
        h.active(0, 20);
        h.tick();
    }
    assert_eq!(h.suspends_of(10), 1, "stopped again past the gate timeout");
    assert_eq!(
        closed(&path, 0),
        Some(epoch),
        "one close for the whole busy period"
    );
    // Release: the process resumes, the gate opens, and both leave the record.
    h.ticks(110);
    assert!(!h.suspended(10));
    assert!(
        h.act.calls().last().is_some_and(|c| c.op == Op::Resume),
        "not resumed at the release"
    );
    assert_eq!(closed(&path, 0), None, "the release opens the gate");
    assert_eq!(h.recorded_beyond_ahead(), vec![], "{:?}", h.rec.disk);
}

/// A process whose shim has nothing in flight acknowledges a close at once: it is held
/// (drained at its gate, then stopped by its fallback) within the tick that saw the launch
/// of online work, not at the next one.
#[test]
fn a_gated_process_is_held_within_the_tick_that_saw_its_launch() {
    let (mut h, path) = setup("same-tick");
    h.bells.state.lock().unwrap().acks_at_once = Some((1, path.clone()));
    h.bells.page(2, Owner::Pid(20), 0);
    h.tick();
    let launch = h.now();
    h.bells.ring(2, 0, launch, launch);
    h.lp.tick();
    assert!(closed(&path, 0).is_some(), "the launch closed no gate");
    assert_eq!(
        h.suspends_of(10),
        1,
        "not stopped by its fallback in the tick that saw the launch"
    );
    let p = preempt_event(&h).expect("not held in the tick that saw the launch");
    assert_eq!(p.actuator, Some(Kind::Gate), "the gate drained it");
    assert_eq!(p.signal, qos_core::Signal::Doorbell);
}

/// The first launch of an online process that started after the latest read of the
/// driver's process lists holds a gated process within the tick that saw it too: the
/// lists are read in that tick's snapshot, not asked for after it.
#[test]
fn a_just_started_processs_first_launch_holds_a_gated_process_in_its_tick() {
    let (mut h, path) = setup_with("new-online", None, |h| {
        // Its pod is known (no change of the pod source follows).
        h.source.set(21, class(Class::Online, None));
    });
    h.bells.state.lock().unwrap().acks_at_once = Some((1, path.clone()));
    h.procs.add(21, 121, "serve", "/w");
    h.gpu.add(0, 21);
    h.bells.page(2, Owner::Pid(21), 0);
    h.tick();
    let launch = h.now();
    h.bells.ring(2, 0, launch, launch);
    h.lp.tick();
    assert!(closed(&path, 0).is_some(), "the launch closed no gate");
    assert_eq!(
        h.suspends_of(10),
        1,
        "not stopped by its fallback in the tick that saw the launch"
    );
    let p = preempt_event(&h).expect("not held in the tick that saw the launch");
    assert_eq!(p.signal, qos_core::Signal::Doorbell);
}

#[test]
fn a_gate_not_acknowledged_in_time_escalates_to_the_fallback() {
    let (mut h, path) = setup("late");
    h.active(0, 20);
    h.tick();
    let closed_at = h.now();
    assert!(closed(&path, 0).is_some());
    while h.now() < closed_at + 49 * MS {
        h.active(0, 20);
        h.tick();
        assert_eq!(h.suspends_of(10), 0, "escalated before --gate-timeout");
    }
    h.ticks(3);
    assert_eq!(h.suspends_of(10), 1, "not stopped after --gate-timeout");
    assert!(
        h.act.calls().iter().all(|c| c.unrecorded.is_empty()),
        "the fallback acted before it was recorded"
    );
    let p = preempt_event(&h).expect("confirmed by the fallback");
    assert_eq!(p.actuator, Some(Kind::Signal), "confirmed by the fallback");
    assert!(p.confirmed_ns.is_some());
    assert!(
        closed(&path, 0).is_some(),
        "the gate stays closed beside it"
    );
    no_broken_hold_while_busy(
        &mut h,
        "the unacknowledged gate of a stopped process counted as a broken hold",
    );
    // Release: both undone.
    h.ticks(110);
    assert!(!h.suspended(10));
    assert_eq!(closed(&path, 0), None);
    let resumed = h.act.calls().iter().any(|c| {
        c.op == Op::Resume
            && c.targets
                .iter()
                .any(|t| matches!(t, RecordEntry::Process { pid: 10, .. }))
    });
    assert!(resumed, "the fallback's stop was not undone");
    assert_eq!(h.recorded_beyond_ahead(), vec![], "{:?}", h.rec.disk);
    // Its gate stayed silent (its shim follows another gate file, or none): said in
    // /state, and the next busy period stops it at once instead of waiting 50 ms again.
    let doc = h.lp.ctl.sub.state_doc(h.now());
    assert_eq!(doc.gate_silent_processes, 1);
    assert!(
        doc.gpus[0]
            .processes
            .iter()
            .any(|p| p.pid == 10 && p.gate.as_deref() == Some("silent")),
        "{doc:?}"
    );
    let stops = h.suspends_of(10);
    h.active(0, 20);
    h.tick();
    assert_eq!(closed(&path, 0), None, "closed the gate that stayed silent");
    assert_eq!(h.suspends_of(10), stops + 1, "not stopped at once");
    h.ticks(110);
    assert!(!h.suspended(10));
    // A minute later its gate is tried again (a shim finds a gate file within 1 s).
    h.clock.advance(crate::control::gates::SILENT_NS);
    h.ticks(2);
    h.active(0, 20);
    h.tick();
    assert!(closed(&path, 0).is_some(), "never tried again");
    assert_eq!(h.lp.ctl.sub.state_doc(h.now()).gate_silent_processes, 0);
}

#[test]
fn without_a_listening_shim_the_process_is_stopped_and_no_gate_closes() {
    let (mut h, path) = setup("noshim");
    // Offline 11 on GPU 0 has no page; 12 has a page owned by another UID; 13's page names
    // only GPU 1.
    h.spawn(0, 11, class(Class::Offline, None));
    h.spawn(0, 12, class(Class::Offline, None));
    h.spawn(0, 13, class(Class::Offline, None));
    h.bells.offline_page(2, Owner::Pid(12), 4242);
    h.bells.ack(2, 0, 0);
    h.bells.offline_page(3, Owner::Pid(13), 0);
    h.bells.ack(3, 1, 0);
    h.ticks(2);
    h.active(0, 20);
    h.tick();
    for pid in [11, 12, 13] {
        assert_eq!(h.suspends_of(pid), 1, "pid {pid} was not stopped");
    }
    assert_eq!(h.suspends_of(10), 0, "10 has the shim: held at the gate");
    assert!(closed(&path, 0).is_some());
    // A forged ack in a page that is not 10's confirms nothing for 10.
    let epoch = closed(&path, 0).unwrap();
    h.bells.ack(2, 0, epoch);
    h.tick();
    assert!(
        preempt_event(&h).is_none(),
        "a forged ack confirmed 10's gate"
    );
}

/// The record breaks before the gate could be written ahead: the close needs a write.
#[test]
fn a_gate_is_never_closed_before_it_is_recorded() {
    let (mut h, path) = setup_with("record", None, |h| {
        h.rec.broken.store(true, Ordering::SeqCst)
    });
    h.active(0, 20);
    h.tick();
    assert_eq!(closed(&path, 0), None, "closed although the record failed");
    assert!(!h.lp.holds().holds(&h.key(10)));
}

/// 30 ms of online work later, a re-check finds nothing broken (`why` otherwise).
fn no_broken_hold_while_busy(h: &mut H, why: &str) {
    for _ in 0..30 {
        h.active(0, 20);
        h.tick();
    }
    assert!(
        !h.lp
            .said
            .iter()
            .any(|n| matches!(n, crate::control::note::Note::Broken(_))),
        "{why}"
    );
}

/// Another holder of the gate file at `path` takes every slot (other GPUs' gates, closed).
fn fill_gate_slots(path: &std::path::Path) {
    let other = crate::edges::gate::GateFile::attach(path)
        .unwrap()
        .expect("the agent's gate file");
    for i in 0..coloc_doorbell::MAX_GPUS {
        other
            .close(&[0xee, i as u8, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
            .unwrap();
    }
}

/// A gate file holds at most `MAX_GPUS` gates: when every slot is another GPU's, the
/// suspension goes to the fallback in the same tick (recorded first), not through a
/// failure and a retry.
#[test]
fn a_gate_that_cannot_close_falls_back_at_once() {
    let (mut h, path) = setup("full");
    fill_gate_slots(&path);
    h.active(0, 20);
    h.tick();
    assert_eq!(closed(&path, 0), None, "GPU 0's gate found a slot");
    assert_eq!(h.suspends_of(10), 1, "not stopped by the fallback at once");
    assert!(
        h.act.calls().iter().all(|c| c.unrecorded.is_empty()),
        "the fallback acted before it was recorded"
    );
    h.ticks(2);
    let p = preempt_event(&h).expect("confirmed by the fallback");
    assert_eq!(p.actuator, Some(Kind::Signal));
    no_broken_hold_while_busy(
        &mut h,
        "the gate that never closed counted as a broken hold",
    );
    h.ticks(110);
    assert!(!h.suspended(10));
    assert_eq!(h.suspends_of(10), 1, "a retry stopped it again");
    assert_eq!(h.recorded_beyond_ahead(), vec![], "{:?}", h.rec.disk);
}

/// The gate cannot close and the fallback cannot be recorded: nothing is suspended (fail
/// open), nothing is left in the record, and a later try suspends it. The fallback stops
/// a signalled cgroup whose second process is written at suspension (the GPU process and
/// the gate were written ahead); that write fails.
#[test]
fn a_gate_that_cannot_close_and_an_unrecordable_fallback_fail_open() {
    let root = TmpDir::new("coloc-gate-cg");
    std::fs::create_dir_all(root.join("batch")).unwrap();
    std::fs::write(root.join("batch/cgroup.freeze"), "0").unwrap();
    let dir = root.join("batch");
    let (mut h, path) = setup_with("full-record", Some(root.to_path_buf()), |h| {
        h.procs.add(10, 110, "train", "/batch");
        h.procs.add(12, 112, "loader", "/batch");
        h.procs
            .members
            .lock()
            .unwrap()
            .insert(dir.clone(), vec![10, 12]);
        h.gpu.add(0, 10);
        for pid in [10, 12] {
            h.source.set(pid, class(Class::Offline, Some("/batch")));
        }
    });
    fill_gate_slots(&path);
    // The GPU process and the gate are on disk; the loader's write fails.
    *h.rec.adds_left.lock().unwrap() = Some(0);
    h.active(0, 20);
    h.tick();
    assert_eq!(h.suspends_of(10), 0, "stopped without a record");
    assert!(
        !h.lp.holds().holds(&h.key(10)),
        "held with nothing holding it"
    );
    assert_eq!(h.recorded_beyond_ahead(), vec![], "{:?}", h.rec.disk);
    // The record works again: the retry stops it through the fallback.
    *h.rec.adds_left.lock().unwrap() = None;
    for _ in 0..1100 {
        h.active(0, 20);
        h.tick();
        if h.suspends_of(10) > 0 {
            break;
        }
    }
    assert_eq!(h.suspends_of(10), 1, "the retry did not stop it");
}

/// Kubernetes: the pod's directory still holds the page of an offline process that was
/// killed (its shim never removed it). It names a PID no live process of the pod has, so
/// the live process's own acknowledgement confirms the gate; the stale page is not waited
/// for, and nothing escalates.
#[test]
fn a_dead_processs_page_in_the_pod_is_not_waited_for() {
    let dir = TmpDir::new("coloc-gate-stale");
    let path = dir.join("gates");
    let mut cfg = default_config();
    cfg.gate_timeout = Duration::from_millis(50);
    let mut h = harness_edges(1, cfg, Some(path.clone()));
    h.scratch.push(dir);
    let uid = "0b7f7c1e-8d52-4c4a-9b0e-2f0b1d6c5a11";
    h.procs.add(
        10,
        110,
        "train",
        &format!("/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/cri-containerd-abc.scope", uid.replace('-', "_")),
    );
    // PID 7 in its container.
    h.procs.procs.lock().unwrap().get_mut(&10).unwrap().ns_pid = Some(7);
    h.gpu.add(0, 10);
    h.source.set(10, class(Class::Offline, None));
    h.spawn(0, 20, class(Class::Online, None));
    // The killed process's page (PID 8), and the live one's (PID 7).
    h.bells.offline_page(1, Owner::Pod(uid.into()), 0);
    h.bells.set_pid(1, 8);
    h.bells.ack(1, 0, 0);
    h.bells.offline_page(2, Owner::Pod(uid.into()), 0);
    h.bells.set_pid(2, 7);
    h.bells.ack(2, 0, 0);
    h.ticks(3);
    h.active(0, 20);
    h.tick();
    let epoch = closed(&path, 0).expect("held at the gate");
    h.bells.ack(2, 0, epoch);
    h.tick();
    let p = preempt_event(&h).expect("drained by the live process's ack");
    assert_eq!(
        p.actuator,
        Some(Kind::Gate),
        "stopped by the timeout: the dead process's page was waited for"
    );
    assert_eq!(h.suspends_of(10), 1, "drained, then stopped at once");
    for _ in 0..80 {
        h.active(0, 20);
        h.tick();
    }
    assert_eq!(h.suspends_of(10), 1, "stopped again past the gate timeout");
}

/// Two containers of one pod, each with its own PID namespace: their offline processes
/// can have the same PID there. A page cannot tell whose it is, so neither is gated (one
/// could be confirmed by the other's acknowledgement): both are stopped.
#[test]
fn two_processes_of_a_pod_with_the_same_pid_are_stopped_not_gated() {
    let dir = TmpDir::new("coloc-gate-twins");
    let path = dir.join("gates");
    let mut h = harness_edges(1, default_config(), Some(path.clone()));
    h.scratch.push(dir);
    let uid = "0b7f7c1e-8d52-4c4a-9b0e-2f0b1d6c5a11";
    for (pid, container) in [(10, "abc"), (11, "def")] {
        h.procs.add(
            pid,
            100 + pid as u64,
            "train",
            &format!("/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/cri-containerd-{container}.scope", uid.replace('-', "_")),
        );
        h.procs.procs.lock().unwrap().get_mut(&pid).unwrap().ns_pid = Some(7);
        h.gpu.add(0, pid);
        h.source.set(pid, class(Class::Offline, None));
    }
    h.spawn(0, 20, class(Class::Online, None));
    h.bells.offline_page(1, Owner::Pod(uid.into()), 0);
    h.bells.set_pid(1, 7);
    h.bells.ack(1, 0, 0);
    h.ticks(3);
    h.active(0, 20);
    h.tick();
    assert_eq!(
        closed(&path, 0),
        None,
        "a gate closed for a process its page cannot name"
    );
    assert_eq!(h.suspends_of(10), 1);
    assert_eq!(h.suspends_of(11), 1);
}

/// The targets the fake actuator holds stopped now (each one's latest operation).
fn stopped(h: &H) -> std::collections::BTreeSet<RecordEntry> {
    let mut out = std::collections::BTreeSet::new();
    for c in h.act.calls() {
        for t in c.targets {
            match c.op {
                Op::Suspend => out.insert(t),
                Op::Resume => out.remove(&t),
            };
        }
    }
    out
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig {
        cases: 48,
        failure_persistence: None,
        ..Default::default()
    })]

    /// Whatever the process's page says (nothing, the close's epoch at once — a forged
    /// drain —, an old or a made-up epoch), a gate closed for longer than
    /// `--gate-timeout` (and a tick) always has its process stopped beside it: the gate
    /// bounds the drain, the stop holds the process.
    #[test]
    fn a_closed_gate_never_outlasts_its_bound_without_a_stop(
        steps in proptest::collection::vec((0u8..5, 1u32..40), 1..30)
    ) {
        let (mut h, path) = setup("prop");
        let proc10 = RecordEntry::Process { pid: 10, start: h.key(10).start };
        let mut closed_since: Option<u64> = None;
        for (what, ms) in steps {
            let epoch = closed(&path, 0);
            match (what, epoch) {
                (2, Some(e)) => h.bells.ack(1, 0, e),
                (3, Some(e)) => h.bells.ack(1, 0, e.wrapping_sub(1)),
                (4, _) => h.bells.ack(1, 0, 0xdead),
                _ => {}
            }
            for _ in 0..ms {
                if what != 1 {
                    h.active(0, 20);
                }
                h.tick();
                let now = h.now();
                closed_since = match (closed(&path, 0), closed_since) {
                    (Some(_), None) => Some(now),
                    (Some(_), s) => s,
                    (None, _) => None,
                };
                if let Some(t) = closed_since {
                    proptest::prop_assert!(
                        now < t + 51 * MS || stopped(&h).contains(&proc10),
                        "gate closed since {} ms, process not stopped at {} ms",
                        (t - T0) / MS,
                        (now - T0) / MS
                    );
                }
            }
        }
    }
}
