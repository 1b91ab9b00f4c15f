//! The book alone, with no edge: what it asks, in which order, and what it does with the
//! answers.

use super::*;
use crate::control::model::act::Op;
use crate::control::model::act::{ActError, CgroupVersion};
use crate::control::target::{GateSlot, Held, Stop};

const MS: u64 = 1_000_000;

fn proc_target(pid: u32) -> (ProcKey, Target) {
    let key = ProcKey { pid, start: 7 };
    (key, Target::Process { key })
}

thread_local! {
    /// [`shell`] answers that this host has no cells.
    static NO_CELLS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The cell a host with cgroup v2 at `/cg` gives process `key` (home `/cg/user`).
fn cell_of(key: ProcKey) -> Target {
    Target::Cgroup {
        dir: format!("/cg/gpu-coloc.held/{}-{}", key.pid, key.start).into(),
        version: CgroupVersion::V2,
        cell: Some(crate::control::model::act::Cell {
            pid: key.pid,
            start: key.start,
            home: "/cg/user".into(),
        }),
    }
}

fn req_of(c: &HoldCmd) -> Req {
    match c {
        HoldCmd::Members { req, .. }
        | HoldCmd::RecordAdd { req, .. }
        | HoldCmd::Start { req, .. }
        | HoldCmd::CloseGate { req, .. }
        | HoldCmd::Isolate { req, .. }
        | HoldCmd::Check { req, .. } => *req,
        HoldCmd::RecordRemove { .. } => panic!("no answer to a removal"),
    }
}

#[test]
fn a_suspension_is_asked_for_only_after_the_record_says_it_holds_it() {
    let mut b = HoldBook::new(Duration::from_secs(1));
    let (k, _) = proc_target(10);
    let started = b.suspend(&[(k, Plan::signal(k))], 0);
    assert_eq!(started.started.len(), 1);
    let cmds = b.take_commands();
    assert!(
        matches!(&cmds[..], [HoldCmd::RecordAdd { entries, .. }] if entries.len() == 1),
        "the record first, and nothing else: {cmds:?}"
    );
    assert!(b.holds(&k), "a hold on its way is a hold");
    b.observe(
        vec![HoldObs::Recorded {
            req: req_of(&cmds[0]),
            ok: true,
        }],
        MS,
    );
    let cmds = b.take_commands();
    assert!(
        matches!(&cmds[..], [HoldCmd::Start { op: Op::Suspend, targets, .. }] if targets.len() == 1),
        "{cmds:?}"
    );
    b.observe(
        vec![HoldObs::Progress {
            req: req_of(&cmds[0]),
            progress: vec![Progress::Done],
            at_ns: 2 * MS,
        }],
        2 * MS,
    );
    assert!(!b.waiting());
    let done = b.take_done();
    assert!(
        matches!(&done[..], [c] if c.op == Op::Suspend && c.outcome == Outcome::Done && c.at_ns == 2 * MS),
        "{done:?}"
    );
}

#[test]
fn a_record_that_cannot_be_written_means_no_suspension_and_a_retry() {
    let mut b = HoldBook::new(Duration::from_secs(1));
    let (k, _) = proc_target(10);
    b.suspend(&[(k, Plan::signal(k))], 0);
    let cmds = b.take_commands();
    b.observe(
        vec![HoldObs::Recorded {
            req: req_of(&cmds[0]),
            ok: false,
        }],
        MS,
    );
    assert!(
        b.take_commands().is_empty(),
        "asked to act after the record failed"
    );
    assert!(b.is_empty() && !b.holds(&k));
    assert_eq!(b.take_failed(), vec![k]);
    let done = b.take_done();
    assert!(
        matches!(&done[..], [c] if c.outcome == Outcome::Failed(Failure::Record)),
        "{done:?}"
    );
}

#[test]
fn a_failed_suspension_is_undone_and_a_release_leaves_the_record_in_one_write() {
    let mut b = HoldBook::new(Duration::from_secs(1));
    let (k1, _) = proc_target(10);
    let (k2, _) = proc_target(11);
    b.suspend(&[(k1, Plan::signal(k1)), (k2, Plan::signal(k2))], 0);
    let cmds = b.take_commands();
    // One request per hold (the record book writes whatever is missing in one write, and
    // a hold already on disk waits for no other's write); answered together, they start
    // in one batch.
    assert!(
        matches!(&cmds[..], [HoldCmd::RecordAdd { entries: a, .. }, HoldCmd::RecordAdd { entries: b, .. }] if a.len() == 1 && b.len() == 1),
        "one request per hold: {cmds:?}"
    );
    b.observe(
        cmds.iter()
            .map(|c| HoldObs::Recorded {
                req: req_of(c),
                ok: true,
            })
            .collect(),
        MS,
    );
    let cmds = b.take_commands();
    assert!(
        matches!(&cmds[..], [HoldCmd::Start { op: Op::Suspend, targets, .. }] if targets.len() == 2),
        "one batch: {cmds:?}"
    );
    let fail = Progress::Failed(ActError::Signal {
        pid: 11,
        source: std::io::ErrorKind::PermissionDenied.into(),
    });
    b.observe(
        vec![HoldObs::Progress {
            req: req_of(&cmds[0]),
            progress: vec![Progress::Done, fail],
            at_ns: MS,
        }],
        MS,
    );
    // The failed one is undone: resumed, then out of the record.
    let cmds = b.take_commands();
    assert!(
        matches!(&cmds[..], [HoldCmd::Start { op: Op::Resume, targets, .. }] if targets.len() == 1),
        "{cmds:?}"
    );
    b.observe(
        vec![HoldObs::Progress {
            req: req_of(&cmds[0]),
            progress: vec![Progress::Done],
            at_ns: MS,
        }],
        MS,
    );
    let cmds = b.take_commands();
    assert!(
        matches!(&cmds[..], [HoldCmd::RecordRemove { entries }] if entries == &vec![RecordEntry::Process { pid: 11, start: 7 }]),
        "{cmds:?}"
    );
    assert_eq!(b.take_failed(), vec![k2]);
    assert!(b.holds(&k1) && !b.holds(&k2));
    // Released: resumed, and then the record loses it.
    let started = b.resume(&[k1], 2 * MS);
    assert_eq!(started.len(), 1);
    let cmds = b.take_commands();
    assert!(
        matches!(&cmds[..], [HoldCmd::Start { op: Op::Resume, .. }]),
        "{cmds:?}"
    );
    b.observe(
        vec![HoldObs::Progress {
            req: req_of(&cmds[0]),
            progress: vec![Progress::Done],
            at_ns: 2 * MS,
        }],
        2 * MS,
    );
    let cmds = b.take_commands();
    assert!(
        matches!(&cmds[..], [HoldCmd::RecordRemove { entries }] if entries.len() == 1),
        "{cmds:?}"
    );
    assert!(b.is_empty());
}

#[test]
fn a_pending_suspension_is_checked_on_a_doubling_schedule_and_times_out() {
    let mut b = HoldBook::new(Duration::from_millis(10));
    let (k, _) = proc_target(10);
    b.suspend(&[(k, Plan::signal(k))], 0);
    let c = b.take_commands();
    b.observe(
        vec![HoldObs::Recorded {
            req: req_of(&c[0]),
            ok: true,
        }],
        0,
    );
    let c = b.take_commands();
    b.observe(
        vec![HoldObs::Progress {
            req: req_of(&c[0]),
            progress: vec![Progress::Pending],
            at_ns: 0,
        }],
        0,
    );
    assert_eq!(b.next_check_ns(), Some(CHECK_FIRST_NS));
    b.poll(CHECK_FIRST_NS - 1);
    assert!(b.take_commands().is_empty(), "checked before it was due");
    let mut now = CHECK_FIRST_NS;
    let mut gaps = Vec::new();
    loop {
        b.poll(now);
        let c = b.take_commands();
        if c.is_empty() {
            now = b.next_check_ns().unwrap();
            continue;
        }
        // A process not seen stopped 1 ms after its SIGSTOP is sent it again (a plain
        // process hold has no freezer to escalate to): answered, and not a check.
        let (restops, c): (Vec<_>, Vec<_>) = c.into_iter().partition(|c| {
            matches!(
                c,
                HoldCmd::Start {
                    op: Op::Suspend,
                    ..
                }
            )
        });
        assert!(
            restops.is_empty() || now >= CHECK_FIRST_NS + super::signal::RESTOP_AFTER_NS,
            "stopped again at {now} ns: {restops:?}"
        );
        assert!(
            matches!(
                &c[..],
                [HoldCmd::Check {
                    op: Op::Suspend,
                    ..
                }]
            ),
            "{c:?}"
        );
        b.observe(
            restops
                .iter()
                .map(|r| HoldObs::Progress {
                    req: req_of(r),
                    progress: vec![Progress::Pending],
                    at_ns: now,
                })
                .chain([HoldObs::Progress {
                    req: req_of(&c[0]),
                    progress: vec![Progress::Pending],
                    at_ns: now,
                }])
                .collect(),
            now,
        );
        match b.next_check_ns() {
            Some(next) => {
                gaps.push(next - now);
                now = next;
            }
            None => break,
        }
    }
    assert_eq!(&gaps[..5], &[100_000, 200_000, 400_000, 800_000, 1_000_000]);
    assert!(now >= 10 * MS, "timed out at {now}");
    let done = b.take_done();
    assert!(
        matches!(&done[..], [c] if c.outcome == Outcome::Failed(Failure::Timeout)),
        "{done:?}"
    );
    assert_eq!(b.take_failed(), vec![k]);
}

// Holds that overlap, a gate's wait, a conversation cut short.

fn gate_plan(pid: u32) -> (ProcKey, Plan) {
    let (k, _) = proc_target(pid);
    let gate = GateSlot {
        key: k,
        uuid: [7; 16],
        file: "/tmp/coloc-book-gates".into(),
    };
    (
        k,
        Plan::Gate {
            gate,
            fallback: Held::Stop(Stop::Signal(k)),
        },
    )
}

/// Answers one command of the book with `obs(req)`; returns the command.
fn answer(b: &mut HoldBook, now: u64, obs: impl FnOnce(Req) -> HoldObs) -> HoldCmd {
    let c = b.take_commands();
    assert_eq!(c.len(), 1, "{c:?}");
    let cmd = c.into_iter().next().unwrap();
    b.observe(vec![obs(req_of(&cmd))], now);
    cmd
}

/// A gate's fallback is a suspension like any other: it gets `--confirm-timeout` from
/// when it starts. The CLI accepts --gate-timeout = --confirm-timeout; then the fallback
/// started at the gate timeout is already past its deadline and is undone at its first
/// check (fail open, retried, closed again, undone again ...).
#[test]
fn a_gate_fallback_gets_its_own_confirm_timeout() {
    let mut b = HoldBook::new(Duration::from_millis(50));
    b.gate_timeout = Duration::from_millis(50);
    let (k, plan) = gate_plan(10);
    b.suspend(&[(k, plan)], 0);
    answer(&mut b, 0, |req| HoldObs::Recorded { req, ok: true });
    let c = answer(&mut b, 0, |req| HoldObs::GateClosed {
        req,
        epoch: Some(3),
    });
    assert!(matches!(c, HoldCmd::CloseGate { .. }), "{c:?}");
    // No acknowledgement: the fallback at --gate-timeout.
    b.poll(50 * MS);
    let c = answer(&mut b, 50 * MS, |req| HoldObs::Recorded { req, ok: true });
    assert!(matches!(c, HoldCmd::RecordAdd { .. }), "{c:?}");
    let c = answer(&mut b, 50 * MS, |req| HoldObs::Progress {
        req,
        progress: vec![Progress::Pending],
        at_ns: 50 * MS,
    });
    assert!(
        matches!(
            c,
            HoldCmd::Start {
                op: Op::Suspend,
                ..
            }
        ),
        "{c:?}"
    );
    // The SIGSTOP takes effect when the target next runs: 200 µs later it still shows
    // as running.
    b.poll(50 * MS + 200_000);
    let c = answer(&mut b, 50 * MS + 200_000, |req| HoldObs::Progress {
        req,
        progress: vec![Progress::Pending],
        at_ns: 50 * MS + 200_000,
    });
    assert!(matches!(c, HoldCmd::Check { .. }), "{c:?}");
    let done = b.take_done();
    assert!(
        done.iter()
            .all(|c| c.outcome != Outcome::Failed(Failure::Timeout)),
        "the fallback was undone 0.2 ms after it started: {done:?}"
    );
    assert!(b.take_failed().is_empty());
}

/// While a gate waits for its acknowledgement (which wakes the loop through the page's
/// wake word) nothing is due before the gate timeout; the book says a check is due at
/// close + 50 µs for the whole wait, so the loop wakes every 50 µs (its minimum sleep)
/// for up to --gate-timeout.
#[test]
fn a_gate_waiting_for_its_ack_is_not_due_in_the_past() {
    let mut b = HoldBook::new(Duration::from_secs(1));
    let (k, plan) = gate_plan(10);
    b.suspend(&[(k, plan)], 0);
    answer(&mut b, 0, |req| HoldObs::Recorded { req, ok: true });
    answer(&mut b, 0, |req| HoldObs::GateClosed {
        req,
        epoch: Some(3),
    });
    for now in [MS, 5 * MS, 20 * MS] {
        b.poll(now);
        assert!(b.take_commands().is_empty());
        let next = b.next_check_ns().unwrap();
        assert!(
            next > now,
            "at {now} ns the book says a check is due at {next} ns (in the past): the loop sleeps 50 µs"
        );
    }
}

/// A hold released while its record write is still on its way is cancelled: the record
/// book drops the request with the entries the hold book lets go, and the hold book waits
/// for no answer for it any more (none will come).
#[test]
fn a_hold_cancelled_before_its_record_answered_waits_for_nothing() {
    let mut record = crate::control::record::RecordBook::new(Default::default());
    // Another write is on its way: the hold's entry waits for the next one.
    record.want_ahead([RecordEntry::Process { pid: 99, start: 1 }].into());
    let _flight = record.next_write(0).unwrap();
    let mut b = HoldBook::new(Duration::from_secs(1));
    let (k, _) = proc_target(10);
    b.suspend(&[(k, Plan::signal(k))], 0);
    let c = b.take_commands();
    let [HoldCmd::RecordAdd { req, entries }] = &c[..] else {
        panic!("{c:?}")
    };
    let req = *req;
    assert_eq!(record.add(req, entries.clone()), None);
    b.resume(&[k], MS);
    let c = b.take_commands();
    let [HoldCmd::RecordRemove { entries }] = &c[..] else {
        panic!("{c:?}")
    };
    let dropped = record.remove(entries);
    assert_eq!(dropped, vec![req], "the record book dropped the request");
    b.dropped(&dropped);
    assert!(!b.waiting(), "a cancelled hold still waits for its record");
    assert!(b.is_empty());
}

/// A panic between a command and its answer (in the hands, or in the book) leaves a hold
/// `Starting` whose Start(Suspend) or CloseGate may already have acted. Drop → release_all
/// resumes it with the holds that started, not only those.
#[test]
fn release_all_resumes_a_hold_whose_suspension_started_but_was_not_answered() {
    let mut b = HoldBook::new(Duration::from_secs(1));
    let (k, _) = proc_target(10);
    b.suspend(&[(k, Plan::signal(k))], 0);
    answer(&mut b, 0, |req| HoldObs::Recorded { req, ok: true });
    let c = b.take_commands();
    assert!(matches!(
        &c[..],
        [HoldCmd::Start {
            op: Op::Suspend,
            ..
        }]
    ));
    // The shell performed it (the process is stopped) and panicked before answering.
    assert!(!b.is_empty(), "the Loop's Drop calls release_everything");
    let n = b.release_all(crate::control::ReleaseAll::Panic);
    let c = b.take_commands();
    assert!(
        n == 1
            && matches!(&c[..], [HoldCmd::Start { op: Op::Resume, targets, .. }] if targets.len() == 1),
        "release_all resumed {n} holds, asked {c:?}; still waiting: {}",
        b.waiting()
    );
}

/// Plays the shell: answers every command with `progress(op, target, start)`; records
/// what the record holds. Returns the commands performed.
fn shell(
    b: &mut HoldBook,
    now: u64,
    record: &mut std::collections::BTreeSet<RecordEntry>,
    members: &[Target],
    progress: &mut dyn FnMut(Op, &Target, bool) -> Progress,
) -> Vec<HoldCmd> {
    shell_with(b, now, record, members, false, progress)
}

/// [`shell`], the signalled cgroup's directory gone when `gone`.
fn shell_with(
    b: &mut HoldBook,
    now: u64,
    record: &mut std::collections::BTreeSet<RecordEntry>,
    members: &[Target],
    gone: bool,
    progress: &mut dyn FnMut(Op, &Target, bool) -> Progress,
) -> Vec<HoldCmd> {
    let mut all = Vec::new();
    loop {
        let cmds = b.take_commands();
        if cmds.is_empty() {
            return all;
        }
        let mut obs = Vec::new();
        for c in &cmds {
            match c {
                HoldCmd::Members { req, .. } => obs.push(HoldObs::Members {
                    req: *req,
                    members: members.to_vec(),
                    gone,
                }),
                HoldCmd::RecordAdd { req, entries } => {
                    record.extend(entries.iter().cloned());
                    obs.push(HoldObs::Recorded {
                        req: *req,
                        ok: true,
                    })
                }
                HoldCmd::RecordRemove { entries } => {
                    for e in entries {
                        record.remove(e);
                    }
                }
                HoldCmd::CloseGate { req, .. } => obs.push(HoldObs::GateClosed {
                    req: *req,
                    epoch: Some(1),
                }),
                HoldCmd::Isolate { req, key } => obs.push(HoldObs::Cell {
                    req: *req,
                    cell: if NO_CELLS.get() {
                        Err("no cgroup v2 hierarchy and no v1 freezer is mounted".into())
                    } else {
                        Ok(cell_of(*key))
                    },
                }),
                HoldCmd::Start {
                    req, op, targets, ..
                } => obs.push(HoldObs::Progress {
                    req: *req,
                    progress: targets.iter().map(|t| progress(*op, t, true)).collect(),
                    at_ns: now,
                }),
                HoldCmd::Check { req, op, targets } => obs.push(HoldObs::Progress {
                    req: *req,
                    progress: targets.iter().map(|t| progress(*op, t, false)).collect(),
                    at_ns: now,
                }),
            }
        }
        all.extend(cmds);
        b.observe(obs, now);
    }
}

/// Two gate holds of one signalled cgroup D (one offline pod, one process per GPU, the
/// signal fallback): both escalate to freezing D. When the second freeze fails, its
/// RecordRemove(D) bypasses flush_forgotten's "still covered" filter: D, frozen by the
/// first hold, leaves the record (and the hands' ledger), so a crash or the watchdog
/// leaves it frozen.
#[test]
fn a_failed_escalation_does_not_unrecord_a_cgroup_another_hold_froze() {
    use crate::control::model::act::CgroupVersion;
    let dir: std::path::PathBuf = "/sys/fs/cgroup/pod/c".into();
    let cg = Target::Cgroup {
        dir: dir.clone(),
        version: CgroupVersion::V2,
        cell: None,
    };
    let (k1, t1) = proc_target(10);
    let (k2, t2) = proc_target(11);
    let plan = |k: ProcKey, _: &Target, uuid: u8| Plan::Gate {
        gate: GateSlot {
            key: k,
            uuid: [uuid; 16],
            file: "/tmp/coloc-book-gates".into(),
        },
        fallback: Held::Stop(Stop::SignalCgroup {
            dir: dir.clone(),
            version: CgroupVersion::V2,
            leader: k,
        }),
    };
    let mut b = HoldBook::new(Duration::from_secs(1));
    b.recheck_ns = MS;
    let mut rec = std::collections::BTreeSet::new();
    let members = vec![t1.clone(), t2.clone()];
    b.suspend(&[(k1, plan(k1, &t1, 1)), (k2, plan(k2, &t2, 2))], 0);
    let mut done = |_: Op, _: &Target, _: bool| Progress::Done;
    shell(&mut b, 0, &mut rec, &members, &mut done);
    // No acknowledgement: both fallbacks (SIGSTOP of D's processes) at the gate timeout.
    b.poll(60 * MS);
    shell(&mut b, 60 * MS, &mut rec, &members, &mut done);
    assert!(rec.contains(&t1.record()) && rec.contains(&t2.record()));
    // A sibling keeps sending SIGCONT: every re-check finds them running, and each hold
    // escalates to freezing D after two breaks. D's first freeze works; the second fails.
    let mut freezes = 0;
    let mut now = 60 * MS;
    let mut tenant = |op: Op, t: &Target, start: bool| match (op, t, start) {
        (Op::Suspend, Target::Process { .. }, false) => Progress::Pending, // running again
        (Op::Suspend, Target::Cgroup { .. }, true) => {
            freezes += 1;
            if freezes == 1 {
                Progress::Done
            } else {
                Progress::Failed(ActError::Write {
                    file: "cgroup.freeze".into(),
                    source: std::io::ErrorKind::Other.into(),
                })
            }
        }
        _ => Progress::Done,
    };
    for _ in 0..20 {
        now += 2 * MS;
        b.recheck(now);
        shell(&mut b, now, &mut rec, &members, &mut tenant);
    }
    let _ = &tenant;
    assert!(freezes >= 2, "both holds escalated ({freezes} freezes)");
    assert!(
        rec.contains(&cg.record()),
        "D is frozen by the first hold but no longer in the fail-open record: {rec:?}"
    );
}

/// Process 10 in cgroup `/sys/fs/cgroup/pod/c` (v2), suspended by signals to the cgroup's
/// processes: (the process, its target, the cgroup's freezer target, the plan).
/// What the shell observed of the cgroup `plan` signals: declared offline as a whole,
/// every member offline.
fn declared(plan: &Plan) -> crate::control::plan::CgroupFacts {
    let (dir, version) = plan.signalled_cgroup().expect("a signalled cgroup");
    crate::control::plan::CgroupFacts {
        declared: Some(dir.display().to_string()),
        dir: Some((dir.to_path_buf(), version)),
        holds_agent: false,
        members: crate::control::plan::Members::Offline,
    }
}

/// The plan the controller chooses for `k` at `now`, with `--actuator signal`, its cgroup
/// as `cgroup` says, and what book `b` remembers of it.
fn chosen(b: &HoldBook, k: ProcKey, cgroup: &crate::control::plan::CgroupFacts, now: u64) -> Plan {
    crate::control::plan::choose(&crate::control::plan::Facts {
        key: k,
        preferred: crate::control::model::act::Kind::Signal,
        cgroup,
        lock: false,
        gate: None,
        remembered: b.remembered(&k, cgroup.whole_dir(), now),
    })
}

fn signalled_cgroup() -> (ProcKey, Target, Target, Plan) {
    use crate::control::model::act::CgroupVersion;
    let dir: std::path::PathBuf = "/sys/fs/cgroup/pod/c".into();
    let cg = Target::Cgroup {
        dir: dir.clone(),
        version: CgroupVersion::V2,
        cell: None,
    };
    let (k, t) = proc_target(10);
    let plan = Plan::Now(Held::Stop(Stop::SignalCgroup {
        dir,
        version: CgroupVersion::V2,
        leader: k,
    }));
    (k, t, cg, plan)
}

/// A sibling sends SIGCONT faster than the agent looks: the stopped state is never seen.
/// The SIGSTOP is sent again, and the signalled cgroup is frozen (recorded first) instead
/// of the suspension timing out and being undone (which left the job running, fail open,
/// for a whole `--confirm-timeout` at a time).
#[test]
fn a_suspension_never_seen_stopped_is_stopped_again_then_frozen_not_given_up() {
    let (k, t, cg, plan) = signalled_cgroup();
    let mut b = HoldBook::new(Duration::from_millis(50));
    let mut rec = std::collections::BTreeSet::new();
    let members = vec![t.clone()];
    b.suspend(&[(k, plan)], 0);
    let (mut stops, mut freezes) = (0, 0);
    let mut frozen_recorded = false;
    let mut events: Vec<String> = Vec::new();
    let mut now = 0;
    while now <= 100 * MS {
        let mut tenant = |op: Op, t: &Target, start: bool| match (op, t, start) {
            (Op::Suspend, Target::Process { .. }, true) => {
                stops += 1;
                Progress::Pending
            }
            // Never seen stopped: resumed by the sibling before every look.
            (Op::Suspend, Target::Process { .. }, false) => Progress::Pending,
            (Op::Suspend, Target::Cgroup { .. }, _) => {
                freezes += 1;
                Progress::Done
            }
            _ => Progress::Done,
        };
        let cmds = shell(&mut b, now, &mut rec, &members, &mut tenant);
        for c in &cmds {
            match c {
                HoldCmd::RecordAdd { entries, .. } if entries.contains(&cg.record()) => {
                    frozen_recorded = true;
                    events.push("record cgroup".into());
                }
                HoldCmd::Start {
                    op: Op::Suspend,
                    targets,
                    ..
                } if targets.iter().any(|t| t.record() == cg.record()) => {
                    assert!(frozen_recorded, "frozen before it was recorded: {events:?}");
                    events.push("freeze".into());
                }
                HoldCmd::Start { op: Op::Resume, .. } => events.push("resume".into()),
                _ => {}
            }
        }
        b.poll(now);
        now += 100_000;
    }
    assert!(stops >= 3, "the SIGSTOP was sent {stops} times, not again");
    assert!(freezes >= 1, "never frozen: {events:?}");
    assert!(
        !events.iter().any(|e| e == "resume"),
        "the suspension was given up: {events:?}"
    );
    let done = b.take_done();
    assert!(
        matches!(&done[..], [c] if c.op == Op::Suspend && c.outcome == Outcome::Done),
        "{done:?}"
    );
    assert!(b.take_failed().is_empty());
    assert!(b.holds(&k));
    let broken = b.take_broken();
    assert!(
        broken.iter().any(|x| x.escalated),
        "the escalation was not reported: {broken:?}"
    );
}

/// Online goes idle while a freezer escalation is on its way: its record write lands after
/// the release. Nothing is frozen then, and the cgroup leaves the record again; had the
/// freeze already started, it is thawed and leaves the record only once the thaw is
/// confirmed (the review saw a freeze after the release, and the entry dropped before the
/// thaw).
#[test]
fn an_escalation_that_lands_after_the_release_freezes_nothing_and_leaves_nothing_frozen() {
    let (_, _, cg, _) = signalled_cgroup();
    let is_cg = |t: &Target| t.record() == cg.record();
    for freeze_started in [false, true] {
        let (k, t, _, plan) = signalled_cgroup();
        let mut b = HoldBook::new(Duration::from_secs(1));
        b.recheck_ns = MS;
        let mut rec = std::collections::BTreeSet::new();
        let members = vec![t.clone()];
        b.suspend(&[(k, plan)], 0);
        let mut done = |_: Op, _: &Target, _: bool| Progress::Done;
        shell(&mut b, 0, &mut rec, &members, &mut done);
        // Found running at two re-checks: the escalation is asked for.
        let mut now = 0;
        let mut held_back = None;
        for _ in 0..10 {
            now += 2 * MS;
            b.recheck(now);
            let mut obs = Vec::new();
            for c in b.take_commands() {
                match c {
                    HoldCmd::Check { req, targets, .. } => obs.push(HoldObs::Progress {
                        req,
                        progress: targets.iter().map(|_| Progress::Pending).collect(),
                        at_ns: now,
                    }),
                    HoldCmd::RecordAdd { req, entries } if entries.contains(&cg.record()) => {
                        rec.extend(entries);
                        held_back = Some(req);
                    }
                    other => obs.push(match other {
                        HoldCmd::Start { req, targets, .. } => HoldObs::Progress {
                            req,
                            progress: targets.iter().map(|_| Progress::Done).collect(),
                            at_ns: now,
                        },
                        HoldCmd::Members { req, .. } => HoldObs::Members {
                            req,
                            members: members.clone(),
                            gone: false,
                        },
                        HoldCmd::RecordAdd { req, entries } => {
                            rec.extend(entries);
                            HoldObs::Recorded { req, ok: true }
                        }
                        c => panic!("unexpected {c:?}"),
                    }),
                }
            }
            b.observe(obs, now);
            if held_back.is_some() {
                break;
            }
        }
        let req = held_back.expect("no escalation was asked for");
        // Another process of the cgroup: the freeze on its way to the record stops it too
        // (a driver call asked now would find it frozen).
        let Target::Cgroup { dir, .. } = &cg else {
            unreachable!()
        };
        let other = ProcKey { pid: 999, start: 7 };
        assert!(b.stops(&other, Some(&dir.join("sub"))));
        let mut freeze = None;
        if freeze_started {
            b.observe(vec![HoldObs::Recorded { req, ok: true }], now);
            let c = b.take_commands();
            freeze = c.iter().find_map(|c| match c {
                HoldCmd::Start {
                    req,
                    op: Op::Suspend,
                    targets,
                    ..
                } if targets.iter().any(is_cg) => Some(*req),
                _ => None,
            });
            assert!(freeze.is_some(), "{c:?}");
        }
        // Online is idle: released.
        now += MS;
        b.resume(&[k], now);
        let mut log = Vec::new();
        let mut first = true;
        let mut thaws = 0;
        let mut thawed = false;
        loop {
            let cmds = b.take_commands();
            let mut obs = Vec::new();
            if first {
                first = false;
                match freeze {
                    None => obs.push(HoldObs::Recorded { req, ok: true }),
                    Some(f) => obs.push(HoldObs::Progress {
                        req: f,
                        progress: vec![Progress::Done],
                        at_ns: now,
                    }),
                }
            }
            if cmds.is_empty() && obs.is_empty() {
                break;
            }
            for c in cmds {
                match &c {
                    HoldCmd::Start {
                        req, op, targets, ..
                    } => {
                        if targets.iter().any(is_cg) {
                            log.push(format!("{op:?} cgroup"));
                            // The first thaw is not confirmed yet: still recorded.
                            if *op == Op::Resume && thaws == 0 {
                                thaws += 1;
                                assert!(
                                    rec.contains(&cg.record()),
                                    "dropped before the thaw: {log:?}"
                                );
                                obs.push(HoldObs::Progress {
                                    req: *req,
                                    progress: vec![Progress::Pending],
                                    at_ns: now,
                                });
                                continue;
                            }
                        }
                        thawed |= *op == Op::Resume && targets.iter().any(is_cg);
                        obs.push(HoldObs::Progress {
                            req: *req,
                            progress: targets.iter().map(|_| Progress::Done).collect(),
                            at_ns: now,
                        });
                    }
                    HoldCmd::RecordRemove { entries } => {
                        if entries.contains(&cg.record()) {
                            log.push("unrecord cgroup".into());
                            assert!(
                                thawed || !freeze_started,
                                "out of the record before its thaw was confirmed: {log:?}"
                            );
                        }
                        for e in entries {
                            rec.remove(e);
                        }
                    }
                    HoldCmd::Check { req, targets, .. } => {
                        thawed |= targets.iter().any(is_cg);
                        obs.push(HoldObs::Progress {
                            req: *req,
                            progress: targets.iter().map(|_| Progress::Done).collect(),
                            at_ns: now,
                        })
                    }
                    c => panic!("unexpected {c:?}"),
                }
            }
            b.observe(obs, now);
            now += MS;
            b.poll(now);
        }
        assert!(
            !log.iter().any(|l| l == "Suspend cgroup"),
            "frozen after the release: {log:?}"
        );
        if freeze_started {
            assert_eq!(
                log.first().map(String::as_str),
                Some("Resume cgroup"),
                "{log:?}"
            );
        }
        assert!(
            !rec.contains(&cg.record()),
            "the cgroup stays in the record (freeze started: {freeze_started}): {log:?} {rec:?}"
        );
    }
}

/// A signalled cgroup that had to be frozen (its processes kept resuming themselves) is
/// frozen at once by the next suspension, recorded first, instead of giving the job its
/// first 10 ms of every busy period again; ten minutes later it starts with signals again.
#[test]
fn a_cgroup_that_resumed_itself_is_frozen_at_once_next_time() {
    let (k, t, cg, plan) = signalled_cgroup();
    let mut b = HoldBook::new(Duration::from_millis(50));
    let mut rec = std::collections::BTreeSet::new();
    let members = vec![t.clone()];
    // Never seen stopped: frozen within the first 10 ms.
    let mut tenant = |op: Op, t: &Target, start: bool| match (op, t, start) {
        (Op::Suspend, Target::Process { .. }, _) => Progress::Pending,
        _ => Progress::Done,
    };
    b.suspend(&[(k, plan.clone())], 0);
    let mut now = 0;
    while now <= 20 * MS {
        shell(&mut b, now, &mut rec, &members, &mut tenant);
        b.poll(now);
        now += 100_000;
    }
    assert!(b.take_broken().iter().any(|x| x.escalated));
    b.resume(&[k], now);
    shell(&mut b, now, &mut rec, &members, &mut tenant);
    assert!(!b.holds(&k));
    // The next busy period: the plan the controller chooses with what the book remembers
    // is the freezer, which goes first, after the record.
    let first_stop = |b: &mut HoldBook,
                      now: u64,
                      rec: &mut std::collections::BTreeSet<RecordEntry>| {
        let plan = chosen(b, k, &declared(&plan), now);
        b.suspend(&[(k, plan)], now);
        let cmds = shell(b, now, rec, &members, &mut |_, _, _| Progress::Done);
        let i = cmds
            .iter()
            .position(|c| {
                matches!(
                    c,
                    HoldCmd::Start {
                        op: Op::Suspend,
                        ..
                    }
                )
            })
            .expect("nothing started");
        let recorded = cmds[..i].iter().any(
            |c| matches!(c, HoldCmd::RecordAdd { entries, .. } if entries.contains(&cg.record())),
        );
        let frozen = matches!(&cmds[i], HoldCmd::Start { targets, .. } if targets.iter().any(|t| t.record() == cg.record()));
        b.resume(&[k], now + MS);
        shell(b, now + MS, rec, &members, &mut |_, _, _| Progress::Done);
        (recorded, frozen)
    };
    now += 5 * MS;
    assert_eq!(
        first_stop(&mut b, now, &mut rec),
        (true, true),
        "not frozen at once, recorded first"
    );
    now += super::signal::REMEMBER_NS;
    assert_eq!(
        first_stop(&mut b, now, &mut rec),
        (false, false),
        "still frozen at once after ten minutes"
    );
}

/// A held signalled cgroup whose processes were killed and whose directory the runtime
/// removed: the hold ends at the first look that finds it gone (its resume finds nothing,
/// it leaves the record), and the directory is not asked for again (the review saw it
/// asked every re-check, with a warning each time, until the process list was read).
#[test]
fn a_cgroup_that_is_gone_ends_its_hold_and_is_not_asked_for_again() {
    let (k, t, _cg, plan) = signalled_cgroup();
    let mut b = HoldBook::new(Duration::from_millis(50));
    let mut rec = std::collections::BTreeSet::new();
    let members = vec![t.clone()];
    b.suspend(&[(k, plan)], 0);
    let mut alive = |_: Op, _: &Target, _: bool| Progress::Done;
    shell(&mut b, 0, &mut rec, &members, &mut alive);
    assert!(b.holds(&k) && !rec.is_empty(), "held and recorded");
    // Killed; its cgroup removed.
    let mut dead = |_: Op, _: &Target, _: bool| Progress::Gone;
    let mut asked = 0;
    let mut now = 0;
    while now <= 200 * MS {
        now += MS;
        b.recheck(now);
        b.poll(now);
        let cmds = shell_with(&mut b, now, &mut rec, &members, true, &mut dead);
        asked += cmds
            .iter()
            .filter(|c| matches!(c, HoldCmd::Members { .. }))
            .count();
    }
    assert_eq!(asked, 1, "the gone cgroup was asked for {asked} times");
    assert!(!b.holds(&k), "still held");
    assert!(rec.is_empty(), "left in the record: {rec:?}");
    assert!(b
        .take_notes()
        .iter()
        .any(|n| matches!(n, Note::HoldGone(_))));
}

/// A process held alone by signal (matched by cmdline or uid: no cgroup of its own) that
/// keeps resuming itself (a ptrace parent cancelling every SIGSTOP) is moved into a cell
/// of the agent's own and frozen there: the cell is asked for once, recorded before the
/// freeze starts, and the next busy period freezes it in the cell at once. Its release
/// resumes the cell (which moves it home).
#[test]
fn a_process_held_alone_that_keeps_resuming_is_frozen_in_a_cell_recorded_first() {
    let (k, _) = proc_target(10);
    let cell = cell_of(k);
    let mut b = HoldBook::new(Duration::from_millis(50));
    let mut rec = std::collections::BTreeSet::new();
    let mut tenant = |op: Op, t: &Target, _: bool| match (op, t) {
        (Op::Suspend, Target::Process { .. }) => Progress::Pending,
        _ => Progress::Done,
    };
    b.suspend(&[(k, Plan::signal(k))], 0);
    let mut cmds = Vec::new();
    let mut now = 0;
    while now <= 30 * MS {
        b.recheck(now);
        cmds.extend(shell(&mut b, now, &mut rec, &[], &mut tenant));
        b.poll(now);
        cmds.extend(shell(&mut b, now, &mut rec, &[], &mut tenant));
        now += 100_000;
    }
    let isolates = cmds
        .iter()
        .filter(|c| matches!(c, HoldCmd::Isolate { key, .. } if *key == k))
        .count();
    assert_eq!(isolates, 1, "the cell is asked for once: {cmds:?}");
    let recorded = cmds.iter().position(
        |c| matches!(c, HoldCmd::RecordAdd { entries, .. } if entries.contains(&cell.record())),
    );
    let frozen = cmds.iter().position(|c| {
        matches!(c, HoldCmd::Start { op: Op::Suspend, targets, .. } if targets.iter().any(|t| t.record() == cell.record()))
    });
    assert!(
        matches!((recorded, frozen), (Some(r), Some(f)) if r < f),
        "the cell recorded before its freeze: {cmds:?}"
    );
    let broken = b.take_broken();
    assert!(broken.iter().any(|x| x.escalated), "{broken:?}");
    assert_eq!(b.escaping().count(), 0, "frozen in its cell: not escaping");
    // Released: the cell is resumed (the actuator moves it home), and leaves the record.
    b.resume(&[k], now);
    let cmds = shell(&mut b, now, &mut rec, &[], &mut tenant);
    assert!(
        cmds.iter().any(|c| matches!(c, HoldCmd::Start { op: Op::Resume, targets, .. } if targets.iter().any(|t| t.record() == cell.record()))),
        "{cmds:?}"
    );
    assert!(!rec.contains(&cell.record()), "{rec:?}");
    // The next busy period: the plan the controller chooses with what the book remembers
    // moves it into the cell and freezes it at once, recorded first.
    now += 5 * MS;
    let plan = chosen(&b, k, &crate::control::plan::CgroupFacts::default(), now);
    b.suspend(&[(k, plan)], now);
    let cmds = shell(&mut b, now, &mut rec, &[], &mut |_, _, _| Progress::Done);
    let recorded = cmds.iter().position(
        |c| matches!(c, HoldCmd::RecordAdd { entries, .. } if entries.contains(&cell.record())),
    );
    let first_start = cmds.iter().position(|c| {
        matches!(
            c,
            HoldCmd::Start {
                op: Op::Suspend,
                ..
            }
        )
    });
    assert!(
        matches!((recorded, first_start), (Some(r), Some(s)) if r < s),
        "{cmds:?}"
    );
    assert!(
        matches!(&cmds[first_start.unwrap()], HoldCmd::Start { targets, .. } if targets.len() == 1 && targets[0].record() == cell.record()),
        "not frozen in its cell at once: {cmds:?}"
    );
}

/// Where no cell can be made, a process held alone that keeps resuming itself cannot be
/// held: the break says why (`unheld`), the book lists it as escaping while it is found
/// running, the cell is not asked for again at every break, and it stops escaping once a
/// check finds it stopped.
#[test]
fn a_process_that_no_cell_can_hold_is_reported_escaping_and_the_cell_asked_once() {
    NO_CELLS.set(true);
    let (k, _) = proc_target(10);
    let mut b = HoldBook::new(Duration::from_secs(1));
    let mut rec = std::collections::BTreeSet::new();
    let running = std::rc::Rc::new(std::cell::Cell::new(true));
    let r = running.clone();
    let mut tenant = move |op: Op, t: &Target, _: bool| match (op, t) {
        (Op::Suspend, Target::Process { .. }) if r.get() => Progress::Pending,
        _ => Progress::Done,
    };
    b.suspend(&[(k, Plan::signal(k))], 0);
    let mut cmds = Vec::new();
    let mut now = 0;
    let mut unheld = Vec::new();
    while now <= 40 * MS {
        b.recheck(now);
        cmds.extend(shell(&mut b, now, &mut rec, &[], &mut tenant));
        b.poll(now);
        cmds.extend(shell(&mut b, now, &mut rec, &[], &mut tenant));
        unheld.extend(b.take_broken().into_iter().filter_map(|x| x.unheld));
        now += 100_000;
    }
    NO_CELLS.set(false);
    assert_eq!(
        cmds.iter()
            .filter(|c| matches!(c, HoldCmd::Isolate { .. }))
            .count(),
        1,
        "asked once: {cmds:?}"
    );
    assert!(
        matches!(&unheld[..], [why] if why.contains("no cgroup v2")),
        "{unheld:?}"
    );
    assert_eq!(b.escaping().copied().collect::<Vec<_>>(), vec![k]);
    assert!(b.holds(&k), "still held on the books (by signal)");
    // The tenant gives up: the next look finds it stopped.
    running.set(false);
    for _ in 0..3 {
        now += 10 * MS;
        b.recheck(now);
        shell(&mut b, now, &mut rec, &[], &mut tenant);
    }
    assert_eq!(b.escaping().count(), 0);
}

/// A signalled cgroup's hold on its way (its processes not listed yet) already stops every
/// process of that cgroup for the driver's sake: a lock asked then would be performed
/// after the stop, and wait in the driver (the property `the_drivers_holds_keep_the_same_
/// promises` found it, at random, with two offline processes sharing a cgroup).
#[test]
fn a_cgroup_hold_on_its_way_stops_its_processes_for_the_driver() {
    let (k, _t, _cg, plan) = signalled_cgroup();
    let dir = plan.cgroup().expect("a signalled cgroup").to_path_buf();
    let other = ProcKey { pid: 99, start: 1 };
    let mut b = HoldBook::new(Duration::from_secs(1));
    assert!(!b.stops(&other, Some(&dir)));
    b.suspend(&[(k, plan)], 0);
    assert!(
        b.stops(&other, Some(&dir)),
        "a process of the cgroup is not counted stopped before the members are listed"
    );
    assert!(!b.stops(&other, Some(std::path::Path::new("/elsewhere"))));
}

/// The state of the hold on `key`, by name (`None`: there is none).
fn state(b: &HoldBook, key: &HoldKey) -> Option<&'static str> {
    b.holds.get(key).map(|h| match &h.state {
        State::Listing => "Listing",
        State::Listed => "Listed",
        State::Recording => "Recording",
        State::Recorded => "Recorded",
        State::Closing => "Closing",
        State::Starting => "Starting",
        State::Confirming { .. } => "Confirming",
        State::Gated { .. } => "Gated",
        State::FallingBack { drained: true, .. } => "FallingBack (drained)",
        State::FallingBack { drained: false, .. } => "FallingBack",
        State::Held => "Held",
    })
}

/// A gate hold on process 10, its gate closed at `epoch` at 0: (the book, the process, the
/// hold).
fn gated(epoch: u32) -> (HoldBook, ProcKey, HoldKey) {
    let (k, plan) = gate_plan(10);
    let key = plan.hold_key();
    let mut b = HoldBook::new(Duration::from_secs(1));
    b.suspend(&[(k, plan)], 0);
    answer(&mut b, 0, |req| HoldObs::Recorded { req, ok: true });
    answer(&mut b, 0, |req| HoldObs::GateClosed {
        req,
        epoch: Some(epoch),
    });
    assert_eq!(state(&b, &key), Some("Gated"));
    (b, k, key)
}

/// The life of a hold on a signalled cgroup, state by state: its processes listed, then
/// recorded, then stopped; confirmed at a poll; released; its resume confirmed at a poll,
/// and only then out of the record.
#[test]
fn the_life_of_a_hold_listed_recorded_started_confirmed_held_then_released() {
    let (k, leader, _, plan) = signalled_cgroup();
    let (_, child) = proc_target(11);
    let key = plan.hold_key();
    let mut b = HoldBook::new(Duration::from_secs(1));
    b.suspend(&[(k, plan)], 0);
    assert_eq!(state(&b, &key), Some("Listing"));
    let c = answer(&mut b, 0, |req| HoldObs::Members {
        req,
        members: vec![leader.clone(), child.clone()],
        gone: false,
    });
    assert!(matches!(c, HoldCmd::Members { .. }), "{c:?}");
    // Listed, and asked of the record at the end of the same step.
    assert_eq!(state(&b, &key), Some("Recording"));
    let c = answer(&mut b, 0, |req| HoldObs::Recorded { req, ok: true });
    assert!(
        matches!(&c, HoldCmd::RecordAdd { entries, .. } if entries.len() == 2),
        "{c:?}"
    );
    assert_eq!(state(&b, &key), Some("Starting"));
    let c = answer(&mut b, 0, |req| HoldObs::Progress {
        req,
        progress: vec![Progress::Done, Progress::Pending],
        at_ns: 0,
    });
    assert!(
        matches!(&c, HoldCmd::Start { op: Op::Suspend, targets, .. } if targets.len() == 2),
        "{c:?}"
    );
    assert_eq!(state(&b, &key), Some("Confirming"));
    assert!(b.take_done().is_empty(), "not confirmed yet");
    // Not due before its first check.
    b.poll(CHECK_FIRST_NS - 1);
    assert!(b.take_commands().is_empty());
    b.poll(CHECK_FIRST_NS);
    let c = answer(&mut b, CHECK_FIRST_NS, |req| HoldObs::Progress {
        req,
        progress: vec![Progress::Done],
        at_ns: CHECK_FIRST_NS,
    });
    assert!(
        matches!(&c, HoldCmd::Check { op: Op::Suspend, targets, .. } if *targets == [child.clone()]),
        "only what was not confirmed is looked at: {c:?}"
    );
    assert_eq!(state(&b, &key), Some("Held"));
    let done = b.take_done();
    assert!(
        matches!(
            &done[..],
            [Completion {
                op: Op::Suspend,
                outcome: Outcome::Done,
                ..
            }]
        ),
        "{done:?}"
    );
    // The release: the hold ends, its resume waits for its confirmation.
    let resumed = b.resume(&[k], MS);
    assert_eq!(resumed, vec![(k, key.clone())]);
    assert_eq!(state(&b, &key), None);
    assert!(!b.holds(&k) && b.is_empty());
    let c = answer(&mut b, MS, |req| HoldObs::Progress {
        req,
        progress: vec![Progress::Done, Progress::Pending],
        at_ns: MS,
    });
    assert!(matches!(&c, HoldCmd::Start { op: Op::Resume, .. }), "{c:?}");
    assert!(
        b.take_commands().is_empty() && b.pending(),
        "nothing leaves the record before the resume is confirmed"
    );
    assert!(
        b.stops(&ProcKey { pid: 11, start: 7 }, None),
        "still stopped"
    );
    b.poll(MS + CHECK_FIRST_NS);
    let c = answer(&mut b, MS + CHECK_FIRST_NS, |req| HoldObs::Progress {
        req,
        progress: vec![Progress::Done],
        at_ns: MS + CHECK_FIRST_NS,
    });
    assert!(matches!(&c, HoldCmd::Check { op: Op::Resume, .. }), "{c:?}");
    let c = b.take_commands();
    assert!(
        matches!(&c[..], [HoldCmd::RecordRemove { entries }] if entries.len() == 2),
        "one write takes both out of the record: {c:?}"
    );
    assert!(!b.pending());
}

/// A gate hold: recorded, its gate closed, `Gated` until its process acknowledges the
/// close at that epoch (an older epoch does not count), then its fallback is recorded and
/// started, and the hold keeps the gate's label.
#[test]
fn a_gate_hold_is_gated_until_acknowledged_at_its_epoch_then_falls_back() {
    let (k, plan) = gate_plan(10);
    let key = plan.hold_key();
    let mut b = HoldBook::new(Duration::from_secs(1));
    b.suspend(&[(k, plan)], 0);
    assert_eq!(state(&b, &key), Some("Recording"));
    let c = answer(&mut b, 0, |req| HoldObs::Recorded { req, ok: true });
    assert!(matches!(c, HoldCmd::RecordAdd { .. }), "{c:?}");
    assert_eq!(state(&b, &key), Some("Closing"));
    let c = answer(&mut b, 0, |req| HoldObs::GateClosed {
        req,
        epoch: Some(3),
    });
    assert!(matches!(c, HoldCmd::CloseGate { .. }), "{c:?}");
    assert_eq!(state(&b, &key), Some("Gated"));
    assert_eq!(b.wanted_acks(), vec![(k, [7; 16])]);
    assert!(b.gates_closed());
    b.gate_acks(k, &[3, 2]);
    assert_eq!(
        state(&b, &key),
        Some("Gated"),
        "a page still at an older epoch has work in flight"
    );
    assert!(b.take_commands().is_empty());
    b.gate_acks(k, &[3, 3]);
    assert_eq!(state(&b, &key), Some("FallingBack (drained)"));
    assert!(b.wanted_acks().is_empty());
    assert_eq!(b.take_gate_answers(), vec![(k, true)]);
    let c = answer(&mut b, MS, |req| HoldObs::Recorded { req, ok: true });
    assert!(
        matches!(&c, HoldCmd::RecordAdd { entries, .. } if entries.len() == 1),
        "the fallback is recorded first: {c:?}"
    );
    let c = answer(&mut b, MS, |req| HoldObs::Progress {
        req,
        progress: vec![Progress::Done],
        at_ns: MS,
    });
    assert!(
        matches!(&c, HoldCmd::Start { op: Op::Suspend, targets, .. }
            if matches!(targets[..], [Target::Process { .. }])),
        "{c:?}"
    );
    assert_eq!(state(&b, &key), Some("Held"));
    let done = b.take_done();
    assert!(
        matches!(
            &done[..],
            [Completion {
                op: Op::Suspend,
                outcome: Outcome::Done,
                kind: Kind::Gate,
                ..
            }]
        ),
        "{done:?}"
    );
}

/// A gate that cannot close (no free slot in the gate file) falls back at once: no wait for
/// an acknowledgement, and no answer for the gate book.
#[test]
fn a_gate_that_cannot_close_falls_back_at_once() {
    let (k, plan) = gate_plan(10);
    let key = plan.hold_key();
    let mut b = HoldBook::new(Duration::from_secs(1));
    b.suspend(&[(k, plan)], 0);
    answer(&mut b, 0, |req| HoldObs::Recorded { req, ok: true });
    answer(&mut b, 0, |req| HoldObs::GateClosed { req, epoch: None });
    assert_eq!(state(&b, &key), Some("FallingBack"));
    assert!(b.wanted_acks().is_empty() && b.take_gate_answers().is_empty());
    let c = b.take_commands();
    assert!(
        matches!(&c[..], [HoldCmd::RecordAdd { .. }]),
        "the fallback's record, at once: {c:?}"
    );
}

/// A gate hold whose acknowledgement never came and whose fallback the record refuses
/// ends: its gate opens again (undone), its holder is retried, and the gate book hears
/// the silence.
#[test]
fn a_gate_silent_until_its_timeout_whose_fallback_is_not_recorded_ends_undone() {
    let (mut b, k, key) = gated(1);
    b.poll(DEFAULT_GATE_TIMEOUT.as_nanos() as u64 - 1);
    assert_eq!(state(&b, &key), Some("Gated"));
    let at = DEFAULT_GATE_TIMEOUT.as_nanos() as u64;
    assert_eq!(b.next_check_ns(), Some(at));
    b.poll(at);
    assert_eq!(state(&b, &key), Some("FallingBack"));
    assert_eq!(b.take_gate_answers(), vec![(k, false)]);
    answer(&mut b, at, |req| HoldObs::Recorded { req, ok: false });
    assert_eq!(state(&b, &key), None);
    assert_eq!(b.take_failed(), vec![k]);
    let c = b.take_commands();
    assert!(
        matches!(&c[..], [HoldCmd::Start { op: Op::Resume, targets, .. }]
            if matches!(targets[..], [Target::Gate { .. }])),
        "the gate opens again: {c:?}"
    );
    let done = b.take_done();
    assert!(
        done.iter()
            .any(|c| c.op == Op::Suspend && c.outcome == Outcome::Failed(Failure::Record)),
        "{done:?}"
    );
}

/// A release overtakes a suspension not confirmed yet: `Gated` (or `Confirming`) ends
/// `Skipped`, and what it closed or stopped is resumed.
#[test]
fn a_release_overtakes_a_gate_waiting_for_its_acknowledgement() {
    let (mut b, k, key) = gated(1);
    assert_eq!(state(&b, &key), Some("Gated"));
    b.resume(&[k], MS);
    assert_eq!(state(&b, &key), None);
    let done = b.take_done();
    assert!(
        matches!(
            &done[..],
            [Completion {
                op: Op::Suspend,
                outcome: Outcome::Skipped,
                ..
            }]
        ),
        "{done:?}"
    );
    let c = b.take_commands();
    assert!(
        matches!(&c[..], [HoldCmd::Start { op: Op::Resume, targets, .. }]
            if matches!(targets[..], [Target::Gate { .. }])),
        "{c:?}"
    );
    assert!(b.wanted_acks().is_empty() && !b.gates_closed());
}

/// A hold released while its entries are on their way to the record is cancelled: it
/// ends at once (`Skipped`, then resumed), and the record's late answer starts nothing.
#[test]
fn a_hold_released_while_recording_is_never_started() {
    let (k, _) = proc_target(10);
    let key = Plan::signal(k).hold_key();
    let mut b = HoldBook::new(Duration::from_secs(1));
    b.suspend(&[(k, Plan::signal(k))], 0);
    let c = b.take_commands();
    assert_eq!(state(&b, &key), Some("Recording"));
    b.resume(&[k], MS);
    assert_eq!(state(&b, &key), None);
    let done = b.take_done();
    assert!(
        matches!(
            &done[..],
            [
                Completion {
                    op: Op::Suspend,
                    outcome: Outcome::Skipped,
                    ..
                },
                Completion {
                    op: Op::Resume,
                    outcome: Outcome::Done,
                    ..
                },
            ]
        ),
        "{done:?}"
    );
    b.observe(
        vec![HoldObs::Recorded {
            req: req_of(&c[0]),
            ok: true,
        }],
        2 * MS,
    );
    let c = b.take_commands();
    assert!(
        c.iter().all(|c| !matches!(c, HoldCmd::Start { .. })),
        "nothing is stopped for a cancelled hold: {c:?}"
    );
}

/// Two gate holds (one process per GPU of one offline pod) whose fallbacks freeze the
/// same cgroup C, both falling back with C's record write on its way. The first is
/// released before the write lands. The write's answer then starts the second hold's
/// freeze of C: C must stay in the record as long as it is frozen, whatever the released
/// hold's late answer says.
#[test]
fn a_late_fallback_answer_of_a_released_hold_does_not_unrecord_another_holds_freeze() {
    let dir: std::path::PathBuf = "/sys/fs/cgroup/pod/c".into();
    let cg = Target::Cgroup {
        dir: dir.clone(),
        version: CgroupVersion::V2,
        cell: None,
    };
    let plan = |pid: u32, uuid: u8| {
        let (k, _) = proc_target(pid);
        (
            k,
            Plan::Gate {
                gate: GateSlot {
                    key: k,
                    uuid: [uuid; 16],
                    file: "/tmp/coloc-book-gates".into(),
                },
                fallback: Held::Stop(Stop::Freeze(crate::control::target::Frozen {
                    dir: dir.clone(),
                    version: CgroupVersion::V2,
                    cell: None,
                })),
            },
        )
    };
    let (k1, p1) = plan(10, 1);
    let (k2, p2) = plan(11, 2);
    let key2 = p2.hold_key();
    let mut b = HoldBook::new(Duration::from_secs(1));
    let mut rec = std::collections::BTreeSet::new();
    b.suspend(&[(k1, p1), (k2, p2)], 0);
    let mut done = |_: Op, _: &Target, _: bool| Progress::Done;
    shell(&mut b, 0, &mut rec, &[], &mut done);
    // Both drained: each fallback asks the record for C; the write is on its way.
    b.gate_acks(k1, &[1]);
    b.gate_acks(k2, &[1]);
    let adds = b.take_commands();
    assert!(
        matches!(
            &adds[..],
            [HoldCmd::RecordAdd { .. }, HoldCmd::RecordAdd { .. }]
        ),
        "{adds:?}"
    );
    // The first holder is released meanwhile: its gate opens.
    b.resume(&[k1], MS);
    let c = b.take_commands();
    assert!(
        matches!(&c[..], [HoldCmd::Start { op: Op::Resume, targets, .. }]
            if matches!(targets[..], [Target::Gate { .. }])),
        "{c:?}"
    );
    // The write lands: both requests are answered at once.
    rec.insert(cg.record());
    b.observe(
        adds.iter()
            .map(|a| HoldObs::Recorded {
                req: req_of(a),
                ok: true,
            })
            .collect(),
        2 * MS,
    );
    let cmds = shell(&mut b, 2 * MS, &mut rec, &[], &mut done);
    assert!(
        cmds.iter().any(
            |c| matches!(c, HoldCmd::Start { op: Op::Suspend, targets, .. }
            if targets.contains(&cg))
        ),
        "the second hold freezes C: {cmds:?}"
    );
    assert_eq!(state(&b, &key2), Some("Held"));
    assert!(
        rec.contains(&cg.record()),
        "C is frozen by the second hold but out of the fail-open record: {cmds:?}"
    );
}

/// A gate hold whose fallback froze cgroup C is released while another hold that freezes
/// C is on its way to the record. That hold has stopped nothing yet, and its write fails:
/// C must not stay frozen with no hold on it.
#[test]
fn a_release_thaws_what_a_hold_still_on_its_way_to_the_record_has_not_stopped() {
    let dir: std::path::PathBuf = "/sys/fs/cgroup/pod/c".into();
    let frozen = crate::control::target::Frozen {
        dir: dir.clone(),
        version: CgroupVersion::V2,
        cell: None,
    };
    let cg = Target::Cgroup {
        dir: dir.clone(),
        version: CgroupVersion::V2,
        cell: None,
    };
    let (k1, _) = proc_target(10);
    let gate = Plan::Gate {
        gate: GateSlot {
            key: k1,
            uuid: [1; 16],
            file: "/tmp/coloc-book-gates".into(),
        },
        fallback: Held::Stop(Stop::Freeze(frozen.clone())),
    };
    let (k2, _) = proc_target(11);
    let mut b = HoldBook::new(Duration::from_secs(1));
    let mut rec = std::collections::BTreeSet::new();
    let mut frozen_now = false;
    let mut act = |op: Op, t: &Target, start: bool| {
        if start && matches!(t, Target::Cgroup { .. }) {
            frozen_now = op == Op::Suspend;
        }
        Progress::Done
    };
    b.suspend(&[(k1, gate)], 0);
    shell(&mut b, 0, &mut rec, &[], &mut act);
    b.gate_acks(k1, &[1]);
    shell(&mut b, MS, &mut rec, &[], &mut act);
    assert_eq!(
        state(
            &b,
            &Plan::Now(Held::Stop(Stop::Freeze(frozen.clone()))).hold_key()
        ),
        None
    );
    assert!(rec.contains(&cg.record()));
    // Another process of the pod is suspended by freezing C: its write is on its way.
    b.suspend(
        &[(k2, Plan::Now(Held::Stop(Stop::Freeze(frozen.clone()))))],
        2 * MS,
    );
    let add = b.take_commands();
    assert!(matches!(&add[..], [HoldCmd::RecordAdd { .. }]), "{add:?}");
    // The gate hold is released.
    b.resume(&[k1], 3 * MS);
    shell(&mut b, 3 * MS, &mut rec, &[], &mut act);
    // The write fails: the second hold never stops anything.
    b.observe(
        vec![HoldObs::Recorded {
            req: req_of(&add[0]),
            ok: false,
        }],
        4 * MS,
    );
    shell(&mut b, 4 * MS, &mut rec, &[], &mut act);
    let _ = &act;
    assert!(b.is_empty(), "{b:?}");
    assert!(!frozen_now, "C is left frozen by no hold");
    assert!(
        !rec.contains(&cg.record()),
        "C stays in the record with nothing holding it: {rec:?}"
    );
}

/// A hold released while on its way to the record and made again on the same key: the
/// late answers to the first hold's write decide nothing for the second. Neither a late
/// `ok` (the second's own entries may not be on disk yet) starts it, nor a late refusal
/// fails it.
#[test]
fn a_late_record_answer_for_a_released_hold_decides_nothing_for_its_key_made_again() {
    let (k, _) = proc_target(10);
    let key = Plan::signal(k).hold_key();
    for first_ok in [true, false] {
        let mut b = HoldBook::new(Duration::from_secs(1));
        b.suspend(&[(k, Plan::signal(k))], 0);
        let first = b.take_commands();
        b.resume(&[k], MS);
        b.take_done();
        b.take_commands();
        b.suspend(&[(k, Plan::signal(k))], 2 * MS);
        let second = b.take_commands();
        assert!(
            matches!(&second[..], [HoldCmd::RecordAdd { .. }]),
            "{second:?}"
        );
        b.observe(
            vec![HoldObs::Recorded {
                req: req_of(&first[0]),
                ok: first_ok,
            }],
            3 * MS,
        );
        let c = b.take_commands();
        assert!(
            c.iter().all(|c| !matches!(c, HoldCmd::Start { .. })),
            "started on the first hold's answer (ok: {first_ok}): {c:?}"
        );
        assert_eq!(state(&b, &key), Some("Recording"), "ok: {first_ok}");
        assert!(b.take_failed().is_empty() && b.take_done().is_empty());
        b.observe(
            vec![HoldObs::Recorded {
                req: req_of(&second[0]),
                ok: true,
            }],
            4 * MS,
        );
        let c = b.take_commands();
        assert!(
            matches!(
                &c[..],
                [HoldCmd::Start {
                    op: Op::Suspend,
                    ..
                }]
            ),
            "started on its own answer: {c:?}"
        );
    }
}

/// A release overtakes a gate hold whose fallback is on its way to the record: the
/// suspension ends `Skipped` (the loop's preemption event waits for a suspension's end,
/// and would wait forever), the gate opens, and the fallback's late record answer stops
/// nothing.
#[test]
fn a_release_overtakes_a_gate_hold_falling_back() {
    let (mut b, k, key) = gated(1);
    b.gate_acks(k, &[1]);
    assert_eq!(state(&b, &key), Some("FallingBack (drained)"));
    let add = b.take_commands();
    assert!(matches!(&add[..], [HoldCmd::RecordAdd { .. }]), "{add:?}");
    b.resume(&[k], MS);
    assert_eq!(state(&b, &key), None);
    let done = b.take_done();
    let ops: Vec<(Op, Outcome)> = done.iter().map(|c| (c.op, c.outcome.clone())).collect();
    assert!(
        ops.contains(&(Op::Suspend, Outcome::Skipped)),
        "the suspension never ends: {done:?}"
    );
    let c = b.take_commands();
    assert!(
        matches!(&c[..], [HoldCmd::Start { op: Op::Resume, targets, .. }]
            if matches!(targets[..], [Target::Gate { .. }])),
        "{c:?}"
    );
    b.observe(
        vec![HoldObs::Recorded {
            req: req_of(&add[0]),
            ok: true,
        }],
        2 * MS,
    );
    let c = b.take_commands();
    assert!(
        c.iter().all(|c| !matches!(c, HoldCmd::Start { .. })),
        "the fallback of a released hold is not started: {c:?}"
    );
}

/// A gate hold whose fallback signals its process is on its way to stop it (the fallback's
/// record write not landed yet): a driver call asked now would find the process stopped,
/// so the book says it stops it.
#[test]
fn a_gate_holds_fallback_on_its_way_stops_its_process() {
    let (mut b, k, key) = gated(1);
    assert!(!b.stops(&k, None), "a closed gate stops nothing");
    b.gate_acks(k, &[1]);
    assert_eq!(state(&b, &key), Some("FallingBack (drained)"));
    assert!(
        b.stops(&k, None),
        "the fallback on its way stops the process"
    );
    assert!(!b.stops(&ProcKey { pid: 99, start: 7 }, None));
}

/// Process `pid`'s cgroup `/sys/fs/cgroup/pod/c`, held frozen: (its key, the cgroup's
/// target, the plan).
fn frozen_cgroup(pid: u32) -> (ProcKey, Target, Plan) {
    let (k, _) = proc_target(pid);
    let frozen = crate::control::target::Frozen {
        dir: "/sys/fs/cgroup/pod/c".into(),
        version: CgroupVersion::V2,
        cell: None,
    };
    let t = Target::Cgroup {
        dir: frozen.dir.clone(),
        version: CgroupVersion::V2,
        cell: None,
    };
    (k, t, Plan::Now(Held::Stop(Stop::Freeze(frozen))))
}

/// A cgroup released and frozen again at once, its thaw not confirmed yet (the earlier
/// hold's `Resume` still looked at, and never confirmed: the new freeze holds it): the new
/// hold is re-checked like any other, so a tenant that thaws its (delegated) cgroup is
/// found running and frozen again within a few `--recheck-interval`s, not once the old
/// resume gives up at `--confirm-timeout`.
#[test]
fn a_hold_made_again_while_its_keys_resume_is_unconfirmed_is_rechecked() {
    let (k, t, plan) = frozen_cgroup(10);
    let mut b = HoldBook::new(Duration::from_secs(1));
    let mut rec = std::collections::BTreeSet::new();
    let running = std::cell::Cell::new(false);
    let mut act = |op: Op, _: &Target, start: bool| match (op, start) {
        // The thaw is not seen at once; the new freeze holds it frozen.
        (Op::Resume, _) => Progress::Pending,
        (Op::Suspend, true) => Progress::Done,
        (Op::Suspend, false) if running.get() => Progress::Pending,
        (Op::Suspend, false) => Progress::Done,
    };
    b.suspend(&[(k, plan.clone())], 0);
    shell(&mut b, 0, &mut rec, &[], &mut act);
    b.resume(&[k], MS);
    shell(&mut b, MS, &mut rec, &[], &mut act);
    assert!(b.pending(), "the resume waits for its confirmation");
    b.suspend(&[(k, plan.clone())], 2 * MS);
    shell(&mut b, 2 * MS, &mut rec, &[], &mut act);
    assert_eq!(state(&b, &plan.hold_key()), Some("Held"));
    // The tenant thaws it.
    running.set(true);
    let mut restopped_at = None;
    let mut now = 2 * MS;
    while now < 100 * MS && restopped_at.is_none() {
        now += MS;
        // The loop's order: the poll's answers are in before the re-check.
        b.poll(now);
        let mut cmds = shell(&mut b, now, &mut rec, &[], &mut act);
        b.recheck(now);
        cmds.extend(shell(&mut b, now, &mut rec, &[], &mut act));
        if cmds.iter().any(|c| {
            matches!(c, HoldCmd::Start { op: Op::Suspend, targets, .. } if targets.contains(&t))
        }) {
            restopped_at = Some(now);
        }
    }
    assert!(
        restopped_at.is_some_and(|at| at <= 2 * MS + 3 * b.recheck_ns),
        "found running and stopped again at {restopped_at:?} ns"
    );
}

/// A cgroup released and frozen again before its thaw was confirmed: the old resume can
/// never be confirmed now (the new freeze holds the cgroup). It ends overtaken (`Skipped`)
/// at its next look, not as a resume that timed out, and its entry stays recorded for the
/// hold that covers it.
#[test]
fn a_resume_overtaken_by_a_hold_made_again_ends_without_timing_out() {
    let (k, t, plan) = frozen_cgroup(10);
    let mut b = HoldBook::new(Duration::from_secs(1));
    let mut rec = std::collections::BTreeSet::new();
    let mut act = |op: Op, _: &Target, _: bool| match op {
        Op::Resume => Progress::Pending,
        Op::Suspend => Progress::Done,
    };
    b.suspend(&[(k, plan.clone())], 0);
    shell(&mut b, 0, &mut rec, &[], &mut act);
    b.resume(&[k], MS);
    shell(&mut b, MS, &mut rec, &[], &mut act);
    b.suspend(&[(k, plan.clone())], 2 * MS);
    shell(&mut b, 2 * MS, &mut rec, &[], &mut act);
    b.take_done();
    b.take_notes();
    let mut now = 2 * MS;
    let mut ended = None;
    while now < 2_000 * MS && ended.is_none() {
        now += MS;
        b.poll(now);
        shell(&mut b, now, &mut rec, &[], &mut act);
        ended = (b.take_done().into_iter()).find(|c| c.op == Op::Resume);
    }
    let ended = ended.expect("the old resume never ended");
    assert_eq!(ended.outcome, Outcome::Skipped, "{ended:?}");
    assert!(
        ended.at_ns < 100 * MS,
        "ended at {} ms: waited for --confirm-timeout",
        ended.at_ns / MS
    );
    let notes = b.take_notes();
    assert!(
        !notes.iter().any(|n| matches!(
            n,
            Note::TimedOut(crate::control::note::TimedOut { op: Op::Resume, .. })
        )),
        "{notes:?}"
    );
    assert!(
        rec.contains(&t.record()),
        "the new hold's entry left the record"
    );
    assert_eq!(state(&b, &plan.hold_key()), Some("Held"));
}

/// A signalled cgroup released and held again before one of its processes was seen
/// resumed, that process no longer among the cgroup's members (moved out meanwhile): the
/// new hold does not cover it, so the old resume is not overtaken. It is looked at as any
/// other, and the process stays recorded while it may still be stopped.
#[test]
fn a_resume_with_a_member_the_new_hold_does_not_cover_is_not_overtaken() {
    let (k, t, _, plan) = signalled_cgroup();
    let (_, moved) = proc_target(11);
    let mut b = HoldBook::new(Duration::from_secs(1));
    let mut rec = std::collections::BTreeSet::new();
    let mut act = |op: Op, target: &Target, _: bool| match op {
        Op::Resume if *target == moved => Progress::Pending,
        _ => Progress::Done,
    };
    b.suspend(&[(k, plan.clone())], 0);
    shell(&mut b, 0, &mut rec, &[t.clone(), moved.clone()], &mut act);
    b.resume(&[k], MS);
    shell(&mut b, MS, &mut rec, &[], &mut act);
    b.suspend(&[(k, plan.clone())], 2 * MS);
    shell(&mut b, 2 * MS, &mut rec, std::slice::from_ref(&t), &mut act);
    b.take_done();
    let mut now = 2 * MS;
    while now < 100 * MS {
        now += MS;
        b.poll(now);
        shell(&mut b, now, &mut rec, &[], &mut act);
        let done = b.take_done();
        assert!(
            !done.iter().any(|c| c.op == Op::Resume),
            "the resume of a process the new hold does not cover ended: {done:?}"
        );
        assert!(
            rec.contains(&moved.record()),
            "a process that may still be stopped left the record"
        );
    }
}

/// Shutdown (or a panic) with a hold in each state the loop can leave between ticks:
/// `Held`, `Confirming`, `Gated`, `FallingBack` (its fallback's write on its way) and
/// `Recording` (its write on its way). Everything stopped is resumed, every gate closed
/// is opened, and the writes that land afterwards start nothing.
#[test]
fn release_all_leaves_nothing_stopped_or_gated_whatever_state_each_hold_is_in() {
    use std::cell::RefCell;
    let stopped: RefCell<std::collections::BTreeSet<RecordEntry>> = RefCell::default();
    let mut act = |op: Op, t: &Target, start: bool| {
        if start {
            match op {
                Op::Suspend => stopped.borrow_mut().insert(t.record()),
                Op::Resume => stopped.borrow_mut().remove(&t.record()),
            };
        }
        match (op, t) {
            // A freeze not confirmed yet.
            (Op::Suspend, Target::Cgroup { .. }) => Progress::Pending,
            _ => Progress::Done,
        }
    };
    let mut rec = std::collections::BTreeSet::new();
    let mut b = HoldBook::new(Duration::from_secs(1));
    let (k1, _) = proc_target(1);
    let (k2, p2) = gate_plan(2);
    let (k3, p3) = gate_plan(3);
    let (k4, _) = proc_target(4);
    let (k5, _) = proc_target(5);
    let frozen = crate::control::target::Frozen {
        dir: "/sys/fs/cgroup/pod/c".into(),
        version: CgroupVersion::V2,
        cell: None,
    };
    let p5 = Plan::Now(Held::Stop(Stop::Freeze(frozen)));
    b.suspend(
        &[
            (k1, Plan::signal(k1)),
            (k2, p2.clone()),
            (k3, p3.clone()),
            (k5, p5.clone()),
        ],
        0,
    );
    shell(&mut b, 0, &mut rec, &[], &mut act);
    b.gate_acks(k3, &[1]);
    let fallback_add = b.take_commands();
    b.suspend(&[(k4, Plan::signal(k4))], MS);
    let fresh_add = b.take_commands();
    let states: Vec<_> = [
        Plan::signal(k1).hold_key(),
        p5.hold_key(),
        p2.hold_key(),
        p3.hold_key(),
        Plan::signal(k4).hold_key(),
    ]
    .iter()
    .map(|k| state(&b, k))
    .collect();
    assert_eq!(
        states,
        [
            Some("Held"),
            Some("Confirming"),
            Some("Gated"),
            Some("FallingBack (drained)"),
            Some("Recording")
        ]
    );
    assert!(!stopped.borrow().is_empty());
    assert_eq!(b.release_all(crate::control::ReleaseAll::Shutdown), 5);
    let cmds = shell(&mut b, 2 * MS, &mut rec, &[], &mut act);
    let opened: Vec<ProcKey> = cmds
        .iter()
        .flat_map(|c| match c {
            HoldCmd::Start {
                op: Op::Resume,
                targets,
                ..
            } => targets.clone(),
            _ => Vec::new(),
        })
        .filter_map(|t| match t {
            Target::Gate { key, .. } => Some(key),
            _ => None,
        })
        .collect();
    assert!(opened.contains(&k2) && opened.contains(&k3), "{cmds:?}");
    // The writes that were on their way land.
    b.observe(
        fallback_add
            .iter()
            .chain(&fresh_add)
            .map(|c| HoldObs::Recorded {
                req: req_of(c),
                ok: true,
            })
            .collect(),
        3 * MS,
    );
    shell(&mut b, 3 * MS, &mut rec, &[], &mut act);
    assert!(b.is_empty());
    assert!(
        stopped.borrow().is_empty(),
        "left stopped: {:?}",
        stopped.borrow()
    );
}

/// Two gate holds whose fallbacks freeze cgroup C: the first holds C, the second's
/// fallback write is on its way when the first is released, and that write fails. C is
/// thawed, and leaves the record: nothing holds it.
#[test]
fn a_fallback_whose_write_fails_after_another_holds_release_leaves_nothing_behind() {
    let frozen = crate::control::target::Frozen {
        dir: "/sys/fs/cgroup/pod/c".into(),
        version: CgroupVersion::V2,
        cell: None,
    };
    let cg = Target::Cgroup {
        dir: frozen.dir.clone(),
        version: CgroupVersion::V2,
        cell: None,
    };
    let plan = |pid: u32, uuid: u8| {
        let (k, _) = proc_target(pid);
        let gate = GateSlot {
            key: k,
            uuid: [uuid; 16],
            file: "/tmp/coloc-book-gates".into(),
        };
        let fallback = Held::Stop(Stop::Freeze(frozen.clone()));
        (k, Plan::Gate { gate, fallback })
    };
    let (k1, p1) = plan(10, 1);
    let (k2, p2) = plan(11, 2);
    let mut b = HoldBook::new(Duration::from_secs(1));
    let mut rec = std::collections::BTreeSet::new();
    let frozen_now = std::cell::Cell::new(false);
    let mut act = |op: Op, t: &Target, start: bool| {
        if start && matches!(t, Target::Cgroup { .. }) {
            frozen_now.set(op == Op::Suspend);
        }
        Progress::Done
    };
    b.suspend(&[(k1, p1), (k2, p2)], 0);
    shell(&mut b, 0, &mut rec, &[], &mut act);
    b.gate_acks(k1, &[1]);
    shell(&mut b, MS, &mut rec, &[], &mut act);
    assert!(frozen_now.get() && rec.contains(&cg.record()));
    b.gate_acks(k2, &[1]);
    let add = b.take_commands();
    assert!(matches!(&add[..], [HoldCmd::RecordAdd { .. }]), "{add:?}");
    b.resume(&[k1], 2 * MS);
    shell(&mut b, 2 * MS, &mut rec, &[], &mut act);
    b.observe(
        vec![HoldObs::Recorded {
            req: req_of(&add[0]),
            ok: false,
        }],
        3 * MS,
    );
    shell(&mut b, 3 * MS, &mut rec, &[], &mut act);
    assert!(b.is_empty(), "{b:?}");
    assert!(!frozen_now.get(), "C is left frozen by no hold");
    assert!(
        !rec.contains(&cg.record()),
        "C stays in the record with nothing holding it: {rec:?}"
    );
}
