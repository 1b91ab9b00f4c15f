//! An operation waiting for its confirmation: what is still pending, when it is checked
//! next, its deadline, and for a gate close the bound of its drain.

use super::{Failure, HoldKey, Outcome, CHECK_FIRST_NS};
use crate::control::model::act::{Kind, Op, Progress};
use crate::control::target::Target;
use std::time::Duration;

/// See the module.
pub(super) struct Pending {
    pub(super) key: HoldKey,
    /// The hold's serial (an answer after a release belongs to the hold it was asked for).
    pub(super) serial: u64,
    pub(super) op: Op,
    pub(super) kind: Kind,
    /// Members not confirmed yet.
    pub(super) members: Vec<Target>,
    /// All members of the operation (what leaves the record when a resume completes).
    pub(super) all: Vec<Target>,
    pub(super) deadline_ns: u64,
    /// When it is checked next, and the gap after that, ns.
    pub(super) next_check_ns: u64,
    pub(super) gap_ns: u64,
    /// While set, a gate close waits for its acknowledgement (the drain), and escalates to
    /// the hold's fallback when it comes or at this time, ns.
    pub(super) escalate_ns: Option<u64>,
    /// The gate drained before the fallback started (the completion says `gate`).
    pub(super) drained: bool,
    /// When the operation started, ns (a suspension still running long after its
    /// SIGSTOP was resumed by someone: see [`HoldBook::restop_pending`]).
    ///
    /// [`HoldBook::restop_pending`]: super::HoldBook
    pub(super) started_ns: u64,
}

impl Pending {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        key: HoldKey,
        serial: u64,
        op: Op,
        kind: Kind,
        members: Vec<Target>,
        all: Vec<Target>,
        now: u64,
        timeout: Duration,
    ) -> Pending {
        Pending {
            key,
            serial,
            op,
            kind,
            members,
            all,
            deadline_ns: now + timeout.as_nanos() as u64,
            next_check_ns: now + CHECK_FIRST_NS,
            gap_ns: CHECK_FIRST_NS,
            escalate_ns: None,
            drained: false,
            started_ns: now,
        }
    }
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
