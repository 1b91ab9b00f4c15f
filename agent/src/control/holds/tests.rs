//! The book alone, with no edge: what it asks, in which order, and what it does with the
//! answers.

use super::*;
use crate::edges::actuator::ActError;
use std::os::fd::OwnedFd;
use std::sync::Arc;

const MS: u64 = 1_000_000;

fn proc_target(pid: u32) -> (ProcKey, Target) {
    let key = ProcKey { pid, start: 7 };
    let fd: OwnedFd = std::fs::File::open("/dev/null").unwrap().into();
    (
        key,
        Target::Process {
            key,
            pidfd: Arc::new(fd),
        },
    )
}

fn req_of(c: &HoldCmd) -> Req {
    match c {
        HoldCmd::Members { req, .. }
        | HoldCmd::RecordAdd { req, .. }
        | HoldCmd::Start { req, .. }
        | HoldCmd::CloseGate { req, .. }
        | HoldCmd::Check { req, .. } => *req,
        HoldCmd::RecordRemove { .. } => panic!("no answer to a removal"),
    }
}

#[test]
fn a_suspension_is_asked_for_only_after_the_record_says_it_holds_it() {
    let mut b = HoldBook::new(Duration::from_secs(1));
    let (k, t) = proc_target(10);
    let started = b.suspend(&[(k, Plan::Signal(t))], 0);
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
    let (k, t) = proc_target(10);
    b.suspend(&[(k, Plan::Signal(t))], 0);
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
    let (k1, t1) = proc_target(10);
    let (k2, t2) = proc_target(11);
    b.suspend(&[(k1, Plan::Signal(t1)), (k2, Plan::Signal(t2))], 0);
    let cmds = b.take_commands();
    assert!(
        matches!(&cmds[..], [HoldCmd::RecordAdd { entries, .. }] if entries.len() == 2),
        "one write for both: {cmds:?}"
    );
    b.observe(
        vec![HoldObs::Recorded {
            req: req_of(&cmds[0]),
            ok: true,
        }],
        MS,
    );
    let cmds = b.take_commands();
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
    let (k, t) = proc_target(10);
    b.suspend(&[(k, Plan::Signal(t))], 0);
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
            vec![HoldObs::Progress {
                req: req_of(&c[0]),
                progress: vec![Progress::Pending],
                at_ns: now,
            }],
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
