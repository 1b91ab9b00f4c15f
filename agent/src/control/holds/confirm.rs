//! Waiting for a confirmation: what is not confirmed yet, when it is looked at next (50 µs
//! after the start, the gap doubling to 1 ms), and its deadline (`--confirm-timeout`).
//! A suspension waits in its hold's state ([`super::State::Confirming`]); a resume, whose
//! hold is gone once released, waits as a [`Resume`].

use super::{Failure, HoldKey, Outcome, CHECK_FIRST_NS, CHECK_MAX_NS};
use crate::control::model::act::{Kind, Progress};
use crate::control::target::Target;
use std::time::Duration;

/// See the module.
#[derive(Debug, Clone)]
pub(super) struct Confirm {
    /// Members not confirmed yet.
    pub(super) members: Vec<Target>,
    pub(super) deadline_ns: u64,
    /// When it is looked at next, and the gap after that, ns.
    pub(super) next_check_ns: u64,
    pub(super) gap_ns: u64,
    /// When the operation started, ns (a suspension by signal still running long after its
    /// SIGSTOP was resumed by someone: see `HoldBook::restop_pending`).
    pub(super) started_ns: u64,
}

impl Confirm {
    /// Waiting for `members`, started at `now`, for up to `timeout`.
    pub(super) fn new(members: Vec<Target>, now: u64, timeout: Duration) -> Confirm {
        Confirm {
            members,
            deadline_ns: now + timeout.as_nanos() as u64,
            next_check_ns: now + CHECK_FIRST_NS,
            gap_ns: CHECK_FIRST_NS,
            started_ns: now,
        }
    }

    /// When it is due to be looked at, ns.
    pub(super) fn due_ns(&self) -> u64 {
        self.next_check_ns.min(self.deadline_ns)
    }

    /// Looked at, still not confirmed: `members` are what is left, looked at again after
    /// twice the gap.
    pub(super) fn later(&mut self, members: Vec<Target>, now: u64) {
        self.members = members;
        self.gap_ns = (self.gap_ns * 2).min(CHECK_MAX_NS);
        self.next_check_ns = now + self.gap_ns;
    }
}

/// A released hold's resume (or a failed suspension's undo) not confirmed yet. The hold
/// itself is gone: its key may be held again meanwhile.
pub(super) struct Resume {
    pub(super) key: HoldKey,
    pub(super) kind: Kind,
    /// Every member resumed (what leaves the record once it is confirmed).
    pub(super) all: Vec<Target>,
    pub(super) confirm: Confirm,
}

/// How a batch of targets ended, if it did (`None`: some are still pending).
pub(super) fn members_progress(p: &[Progress]) -> Option<Outcome> {
    if let Some(Progress::Failed(e)) = p.iter().find(|p| matches!(p, Progress::Failed(_))) {
        return Some(Outcome::Failed(Failure::of(e)));
    }
    if p.iter().any(|p| matches!(p, Progress::Pending)) {
        return None;
    }
    Some(if p.iter().any(|p| matches!(p, Progress::Done)) {
        Outcome::Done
    } else if p.iter().all(|p| matches!(p, Progress::Skipped)) {
        Outcome::Skipped
    } else {
        Outcome::Gone
    })
}

pub(super) fn pending_members(members: &[Target], p: &[Progress]) -> Vec<Target> {
    members
        .iter()
        .zip(p)
        .filter(|(_, p)| matches!(p, Progress::Pending))
        .map(|(t, _)| t.clone())
        .collect()
}
