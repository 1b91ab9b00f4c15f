//! Holds in rules mode: mixed cgroups, and suspensions that something else resumes.

use super::*;

/// Offline 10 in the offline cgroup `offline`, online 13 in `online_in` (the same cgroup or
/// one beneath it), with `members` as their `cgroup.procs` (none: unreadable); online busy
/// on GPU 0. Returns the targets of the first suspension.
fn first_suspension(
    root: &std::path::Path,
    preferred: Kind,
    offline: &str,
    online_in: &str,
    members: &[(&str, Vec<u32>)],
) -> Vec<RecordEntry> {
    let mut cfg = default_config();
    cfg.cgroups.v2 = Some(root.to_path_buf());
    cfg.actuator = preferred;
    let mut h = harness_with(1, cfg);
    h.procs.add(10, 110, "train", offline);
    h.procs.add(13, 113, "serve", online_in);
    for (cg, pids) in members {
        let dir = root.join(cg.trim_start_matches('/'));
        h.procs.members.lock().unwrap().insert(dir, pids.clone());
    }
    h.gpu.add(0, 10);
    h.source.set(10, class(Class::Offline, Some(offline)));
    h.source.set(13, class(Class::Online, None));
    h.spawn(0, 20, class(Class::Online, None));
    h.tick();
    h.active(0, 20);
    h.tick();
    h.act.calls()[0].targets.clone()
}

const ALONE: RecordEntry = RecordEntry::Process {
    pid: 10,
    start: 110,
};

/// Rules mode: a cgroup declared offline that also holds a process another rule made
/// online is never frozen or stopped whole; only the offline process is stopped.
#[test]
fn a_cgroup_holding_online_work_is_not_stopped_whole() {
    let root = TmpDir::new("coloc-loop-mixed");
    std::fs::create_dir_all(root.join("batch")).unwrap();
    std::fs::write(root.join("batch/cgroup.freeze"), "0").unwrap();
    for preferred in [Kind::Freezer, Kind::Signal] {
        let members = [("/batch", vec![10, 13])];
        let targets = first_suspension(&root, preferred, "/batch", "/batch", &members);
        assert_eq!(targets, vec![ALONE], "{preferred:?}");
    }
}

/// Freezing a cgroup freezes every cgroup beneath it: an online process in a child cgroup
/// of the offline one makes it mixed as well, and so does a membership that cannot be read.
#[test]
fn online_work_in_a_child_cgroup_or_an_unreadable_one_is_not_frozen_with_it() {
    let root = TmpDir::new("coloc-loop-mixed-child");
    std::fs::create_dir_all(root.join("x/mixed/child")).unwrap();
    std::fs::write(root.join("x/mixed/cgroup.freeze"), "0").unwrap();
    let readable = [("/x/mixed", vec![10]), ("/x/mixed/child", vec![13])];
    for members in [&readable[..], &[]] {
        let targets = first_suspension(&root, Kind::Freezer, "/x/mixed", "/x/mixed/child", members);
        assert_eq!(
            targets,
            vec![ALONE],
            "members readable: {}",
            !members.is_empty()
        );
    }
}

/// Rules mode: online work that joins an offline cgroup after its process was classified
/// is seen at the next read of the lists (their members are read with them): the cgroup
/// is then not stopped whole.
#[test]
fn online_work_that_joins_an_offline_cgroup_later_keeps_it_from_being_stopped_whole() {
    let root = TmpDir::new("coloc-loop-mixed-later");
    let dir = root.join("batch");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("cgroup.freeze"), "0").unwrap();
    let mut cfg = default_config();
    cfg.cgroups.v2 = Some(root.to_path_buf());
    cfg.actuator = Kind::Freezer;
    let mut h = harness_with(1, cfg);
    h.procs.add(10, 110, "train", "/batch");
    h.procs
        .members
        .lock()
        .unwrap()
        .insert(dir.clone(), vec![10]);
    h.gpu.add(0, 10);
    h.source.set(10, class(Class::Offline, Some("/batch")));
    // Its rule is known already (no change of the pod source follows).
    h.source.set(13, class(Class::Online, None));
    h.spawn(0, 20, class(Class::Online, None));
    h.ticks(2);
    // Classified alone in its cgroup: it would be frozen whole. Online 13 joins it.
    h.procs.add(13, 113, "serve", "/batch");
    h.procs
        .members
        .lock()
        .unwrap()
        .insert(dir.clone(), vec![10, 13]);
    // The lists are due (every 50 ms); then online is busy.
    h.clock.advance(60 * MS);
    h.tick();
    h.active(0, 20);
    h.tick();
    let calls = h.act.calls();
    assert_eq!(calls[0].targets, vec![ALONE], "{calls:?}");
}

/// A held process that something else resumes (a SIGCONT from a sibling in its pod) is
/// stopped again; a signalled cgroup that keeps doing it is frozen.
#[test]
fn a_suspension_holds_against_sigcont_and_escalates_to_the_freezer() {
    let root = TmpDir::new("coloc-loop-hold");
    let dir = root.join("batch");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("cgroup.freeze"), "0").unwrap();
    let mut cfg = default_config();
    cfg.cgroups.v2 = Some(root.to_path_buf());
    let mut h = harness_with(1, cfg);
    h.procs.add(10, 110, "train", "/batch");
    h.procs
        .members
        .lock()
        .unwrap()
        .insert(dir.clone(), vec![10]);
    h.gpu.add(0, 10);
    h.source.set(10, class(Class::Offline, Some("/batch")));
    h.spawn(0, 20, class(Class::Online, None));
    h.tick();
    h.active(0, 20);
    h.tick();
    assert_eq!(h.suspends_of(10), 1);
    let me = RecordEntry::Process {
        pid: 10,
        start: 110,
    };
    // A tenant resumes it; within the re-check period it is stopped again.
    h.act.resumed_by_tenant.lock().unwrap().insert(me.clone());
    for _ in 0..12 {
        h.active(0, 20);
        h.tick();
    }
    assert_eq!(
        h.suspends_of(10),
        2,
        "not stopped again: {:?}",
        h.act.calls()
    );
    // Again: now the cgroup is frozen too (recorded first), at the next re-check.
    h.act.resumed_by_tenant.lock().unwrap().insert(me.clone());
    for _ in 0..12 {
        h.active(0, 20);
        h.tick();
    }
    let cg = RecordEntry::Cgroup {
        dir: dir.clone(),
        version: crate::edges::actuator::CgroupVersion::V2,
        cell: None,
    };
    let calls = h.act.calls();
    let frozen = calls
        .iter()
        .find(|c| c.op == Op::Suspend && c.targets.contains(&cg));
    assert!(
        frozen.is_some_and(|c| c.unrecorded.is_empty()),
        "not escalated to the freezer (recorded first): {calls:?}"
    );
    // The release resumes both.
    h.clock.advance(200 * MS);
    h.ticks(2);
    let last = h
        .act
        .calls()
        .into_iter()
        .rev()
        .find(|c| c.op == Op::Resume)
        .unwrap();
    assert!(
        last.targets.contains(&cg) && last.targets.contains(&me),
        "{last:?}"
    );
    assert_eq!(h.recorded_beyond_ahead(), vec![]);
    // The next busy period: the plan chosen with what the hold book remembers freezes
    // the cgroup at once, its first act.
    let before = h.act.calls().len();
    h.active(0, 20);
    h.tick();
    let calls = h.act.calls();
    let first = calls[before..].iter().find(|c| c.op == Op::Suspend);
    assert!(
        first.is_some_and(|c| c.targets.contains(&cg)),
        "not frozen at once the next time: {:?}",
        &calls[before..]
    );
}

/// Rules mode: a PID of the offline cgroup reused by online work before the lists are
/// read again is judged as the process it is now, not as the offline one the table still
/// holds under that PID: the cgroup is then not stopped whole.
#[test]
fn a_reused_pid_in_an_offline_cgroup_keeps_it_from_being_stopped_whole() {
    let root = TmpDir::new("coloc-loop-mixed-reused");
    let dir = root.join("batch");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("cgroup.freeze"), "0").unwrap();
    let mut cfg = default_config();
    cfg.cgroups.v2 = Some(root.to_path_buf());
    cfg.actuator = Kind::Freezer;
    let mut h = harness_with(1, cfg);
    h.procs.add(10, 110, "train", "/batch");
    h.procs.add(11, 111, "train", "/batch");
    h.procs
        .members
        .lock()
        .unwrap()
        .insert(dir.clone(), vec![10, 11]);
    h.gpu.add(0, 10);
    h.gpu.add(0, 11);
    h.source.set(10, class(Class::Offline, Some("/batch")));
    h.source.set(11, class(Class::Offline, Some("/batch")));
    h.spawn(0, 20, class(Class::Online, None));
    h.ticks(2);
    // Offline 11 exits; its PID is reused by online work in the same cgroup, on the GPU.
    h.procs.remove(11);
    h.procs.add(11, 211, "serve", "/batch");
    h.source.set(11, class(Class::Online, None));
    h.clock.advance(60 * MS);
    h.tick();
    h.active(0, 20);
    h.tick();
    let calls = h.act.calls();
    assert!(!calls.is_empty(), "offline 10 is held");
    assert_eq!(calls[0].targets, vec![ALONE], "{calls:?}");
}
