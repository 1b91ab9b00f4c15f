//! How holds start: the members of a plan, the record written first, then the actuator.

use super::{
    members_progress, pending_members, Completion, Hold, HoldKey, Holds, Outcome, Pending, Started,
    INLINE_BUDGET,
};
use crate::control::target::Plan;
use crate::edges::actuator::{Op, Progress, RecordEntry, Target};
use crate::edges::procfs::ProcKey;
use std::collections::BTreeSet;
use std::sync::Arc;
use tracing::{error, warn};

impl Holds {
    /// Lists the members of a plan: for a signalled cgroup, every process in it now
    /// (except the agent), each pinned by a pidfd.
    pub(super) fn materialise(&self, plan: &Plan) -> Vec<Target> {
        match plan {
            Plan::Freeze(t) | Plan::Signal(t) => vec![t.clone()],
            Plan::Gate { gate, .. } => vec![gate.clone()],
            Plan::SignalCgroup { dir, leader, .. } => {
                let mut out = vec![leader.clone()];
                let me = self.procfs.self_pid();
                let lead = match leader {
                    Target::Process { key, .. } => key.pid,
                    Target::Cgroup { .. } | Target::Gate { .. } => 0,
                };
                match self.procfs.cgroup_members(dir) {
                    Ok(pids) => {
                        for pid in pids.into_iter().filter(|p| *p != me && *p != lead) {
                            let Ok(stat) = self.procfs.read_stat(pid) else {
                                continue;
                            };
                            let key = ProcKey {
                                pid,
                                start: stat.start,
                            };
                            if let Ok(fd) = self.procfs.open_pidfd(key) {
                                out.push(Target::Process {
                                    key,
                                    pidfd: Arc::new(fd),
                                });
                            }
                        }
                    }
                    Err(err) => {
                        warn!(dir = %dir.display(), %err, "Cannot list the offline cgroup: stopping only its GPU process")
                    }
                }
                out
            }
        }
    }

    /// Suspends on behalf of `reqs` (holder, plan) at `now`: writes the record first, then
    /// starts the actuator.
    pub fn suspend(&mut self, reqs: &[(ProcKey, Plan)], now: u64) -> Started {
        let mut out = Started::default();
        let mut fresh: Vec<(HoldKey, Hold)> = Vec::new();
        for (holder, plan) in reqs {
            let key = plan.hold_key();
            if let Some(h) = self.held.get_mut(&key) {
                h.holders.insert(*holder);
                continue;
            }
            if let Some((_, h)) = fresh.iter_mut().find(|(k, _)| *k == key) {
                h.holders.insert(*holder);
                out.started.push((*holder, key));
                continue;
            }
            let members = self.materialise(plan);
            fresh.push((
                key.clone(),
                Hold {
                    members,
                    holders: BTreeSet::from([*holder]),
                    kind: plan.kind(),
                    escalate: match plan {
                        Plan::SignalCgroup { dir, version, .. } => Some(Target::Cgroup {
                            dir: dir.clone(),
                            version: *version,
                        }),
                        _ => None,
                    },
                    fallback: match plan {
                        Plan::Gate { fallback, .. } => Some((**fallback).clone()),
                        _ => None,
                    },
                    checked_ns: now,
                    breaks: 0,
                },
            ));
            out.started.push((*holder, key));
        }
        if fresh.is_empty() {
            return out;
        }
        self.act_on_fresh(fresh, now, &mut out);
        self.flush_forgotten();
        out
    }

    /// Records the new holds, then starts suspending them.
    pub(super) fn act_on_fresh(
        &mut self,
        fresh: Vec<(HoldKey, Hold)>,
        now: u64,
        out: &mut Started,
    ) {
        let entries: Vec<RecordEntry> = fresh
            .iter()
            .flat_map(|(_, h)| h.members.iter().map(Target::record))
            .collect();
        if let Err(err) = self.record.add(&entries) {
            error!(error = %format!("{err:#}"), targets = fresh.len(), "Cannot write the suspension record: not suspending (fail open)");
            metrics::counter!("coloc_fail_open_total", "reason" => "record").increment(1);
            for (key, h) in fresh {
                self.failed.extend(h.holders.iter().copied());
                out.done.push(Completion {
                    key,
                    op: Op::Suspend,
                    outcome: Outcome::Failed("record"),
                    kind: h.kind,
                    at_ns: now,
                });
            }
            return;
        }
        let targets: Vec<Target> = fresh
            .iter()
            .flat_map(|(_, h)| h.members.iter().cloned())
            .collect();
        let mut progress = self
            .actuator
            .start(&targets, Op::Suspend, INLINE_BUDGET)
            .into_iter();
        let at = self.clock.now_ns();
        for (key, hold) in fresh {
            let p: Vec<Progress> = progress.by_ref().take(hold.members.len()).collect();
            match members_progress(&p) {
                None => {
                    let mut pending = Pending::new(
                        key.clone(),
                        Op::Suspend,
                        hold.kind,
                        pending_members(&hold.members, &p),
                        hold.members.clone(),
                        now,
                        self.confirm_timeout,
                    );
                    if hold.fallback.is_some() {
                        pending.escalate_ns = Some(now + self.gate_timeout.as_nanos() as u64);
                    }
                    self.pending.push(pending);
                    self.held.insert(key, hold);
                }
                Some(Outcome::Failed("no_gate")) if hold.fallback.is_some() => {
                    // The gate cannot close (no free slot in the gate file: more GPUs
                    // than it holds): the fallback at once, not a failure and a retry.
                    let pending = Pending::new(
                        key.clone(),
                        Op::Suspend,
                        hold.kind,
                        Vec::new(),
                        hold.members.clone(),
                        now,
                        self.confirm_timeout,
                    );
                    self.held.insert(key, hold);
                    if let Some(done) = self.escalate_gate(pending, now, "the gate cannot close") {
                        out.done.push(done);
                    }
                }
                Some(Outcome::Failed(reason)) => {
                    let kind = hold.kind;
                    self.fail_suspension(&key, hold, reason, &p, now);
                    out.done.push(Completion {
                        key,
                        op: Op::Suspend,
                        outcome: Outcome::Failed(reason),
                        kind,
                        at_ns: at,
                    });
                }
                Some(outcome) => {
                    let kind = hold.kind;
                    self.held.insert(key.clone(), hold);
                    out.done.push(Completion {
                        key,
                        op: Op::Suspend,
                        outcome,
                        kind,
                        at_ns: at,
                    });
                }
            }
        }
    }
}
