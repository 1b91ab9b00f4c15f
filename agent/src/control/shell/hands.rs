//! The shell's hands: the edges that the hold book's commands go through (the actuator,
//! the launch gates, `/proc` for a signalled cgroup's members), performed in the order
//! asked. A resume of a gate hold resumes its fallback first and opens the gate last. The
//! record is not theirs: the controller's record book asks the shell's scribe for it.
//!
//! Shared with the NVML watchdog, which resumes everything through them while the loop is
//! stuck in a driver call: the hands keep a ledger of every target they suspended that is
//! not confirmed resumed, so that resuming needs nothing from the book.
//!
//! The controller names its targets ([`crate::control::target::Target`]: a process by its
//! key); the hands turn each into the actuator's, a process's through its pin
//! ([`super::pins`]). A process that can no longer be pinned is gone: nothing to suspend
//! or resume.
//!
//! May touch: what the actuator touches, the gate file; reads `/proc` and `cgroup.procs`;
//! opens pidfds.

use super::pins::Pins;
use crate::control::holds::{HoldCmd, HoldObs};
use crate::control::target::Target as Named;
use crate::edges::actuator::cell::Cells;
use crate::edges::actuator::{ActError, Actuator, Op, Progress, RecordEntry, Target};
use crate::edges::clock::Clock;
use crate::edges::gate::LaunchGates;
use crate::edges::procfs::{ProcFs, ProcKey};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tracing::{info, warn};

/// The edges that act.
pub struct Hands {
    actuator: Box<dyn Actuator>,
    procfs: Arc<dyn ProcFs>,
    clock: Arc<dyn Clock>,
    gates: Option<Box<dyn LaunchGates>>,
    /// Where cells of the agent's own are made, or why none can be.
    cells: Result<Cells, String>,
    /// Every target suspended through these hands and not confirmed resumed.
    ledger: BTreeMap<RecordEntry, Target>,
    /// Signalled cgroups found gone, said once each (bounded: cleared past 4096).
    gone_said: std::collections::HashSet<std::path::PathBuf>,
    /// The pidfds of the processes the controller names.
    pins: Arc<Pins>,
}

impl std::fmt::Debug for Hands {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hands")
            .field("ledger", &self.ledger.len())
            .finish_non_exhaustive()
    }
}

impl Hands {
    /// Hands over these edges.
    pub fn new(
        actuator: Box<dyn Actuator>,
        procfs: Arc<dyn ProcFs>,
        clock: Arc<dyn Clock>,
        gates: Option<Box<dyn LaunchGates>>,
        cells: Result<Cells, String>,
        pins: Arc<Pins>,
    ) -> Hands {
        Hands {
            actuator,
            procfs,
            clock,
            gates,
            cells,
            ledger: BTreeMap::new(),
            gone_said: Default::default(),
            pins,
        }
    }

    /// The actuator's target for the controller's `t`: a process's through its pin
    /// (`None`: it cannot be pinned, it is gone).
    fn target(&self, t: &Named) -> Option<Target> {
        Some(match t {
            Named::Cgroup { dir, version, cell } => Target::Cgroup {
                dir: dir.clone(),
                version: *version,
                cell: cell.clone(),
            },
            Named::Process { key } => Target::Process {
                key: *key,
                pidfd: self.pins.get_or_open(*key, &*self.procfs).ok()?,
            },
            Named::Gate { key, uuid, file } => Target::Gate {
                key: *key,
                uuid: *uuid,
                file: file.clone(),
            },
            Named::Lock { key } => Target::Lock { key: *key },
        })
    }

    /// Starts (or checks) `op` on the controller's `targets` (see [`Hands::act`]); a
    /// process that cannot be pinned is gone.
    fn act_named(
        &mut self,
        targets: &[Named],
        op: Op,
        budget: Duration,
        start: bool,
    ) -> Vec<Progress> {
        let found: Vec<Option<Target>> = targets.iter().map(|t| self.target(t)).collect();
        if start && op == Op::Suspend {
            for t in found.iter().flatten() {
                self.ledger.insert(t.record(), t.clone());
            }
        }
        let batch: Vec<Target> = found.iter().flatten().cloned().collect();
        let mut progress = self.act(&batch, op, budget, start).into_iter();
        found
            .iter()
            .map(|t| match t {
                Some(_) => progress.next().unwrap_or(Progress::Pending),
                None => Progress::Gone,
            })
            .collect()
    }

    /// Performs `cmd`; returns its answer (`None`: a record command, which is not theirs).
    pub fn perform(&mut self, cmd: HoldCmd) -> Option<HoldObs> {
        Some(match cmd {
            HoldCmd::Members { req, dir, leader } => {
                let (members, gone) = self.members(&dir, leader);
                HoldObs::Members { req, members, gone }
            }
            HoldCmd::RecordAdd { .. } | HoldCmd::RecordRemove { .. } => return None,
            HoldCmd::Isolate { req, key } => {
                let cell = match &self.cells {
                    Err(why) => Err(format!("no cell of the agent's own: {why}")),
                    Ok(cells) => match self.procfs.read_proc(key.pid) {
                        Ok(info) if info.key == key => cells.cell_for(key, &info.cgroups),
                        _ => Err(format!("pid {} has exited", key.pid)),
                    },
                };
                let cell = cell.and_then(|t| match t {
                    Target::Cgroup { dir, version, cell } => {
                        Ok(Named::Cgroup { dir, version, cell })
                    }
                    t => Err(format!("a cell is a cgroup, not {t}")),
                });
                HoldObs::Cell { req, cell }
            }
            HoldCmd::CloseGate { req, gate } => {
                if let Some(t) = self.target(&gate) {
                    self.ledger.insert(t.record(), t);
                }
                let epoch = match (&gate, &mut self.gates) {
                    (Named::Gate { key, uuid, file }, Some(g)) => g.close(*key, *uuid, file),
                    _ => Err(ActError::NoGate(format!("{gate}: no launch gate here"))),
                };
                if let Err(err) = &epoch {
                    warn!(%gate, %err, "Cannot close the launch gate");
                }
                HoldObs::GateClosed {
                    req,
                    epoch: epoch.ok(),
                }
            }
            HoldCmd::Start {
                req,
                op,
                targets,
                budget,
            } => {
                let progress = self.act_named(&targets, op, budget, true);
                self.settle(op, targets.iter().map(Named::record), &progress);
                HoldObs::Progress {
                    req,
                    progress,
                    at_ns: self.clock.now_ns(),
                }
            }
            HoldCmd::Check { req, op, targets } => {
                let progress = self.act_named(&targets, op, Duration::ZERO, false);
                self.settle(op, targets.iter().map(Named::record), &progress);
                HoldObs::Progress {
                    req,
                    progress,
                    at_ns: self.clock.now_ns(),
                }
            }
        })
    }

    /// Targets (their records) confirmed resumed (or gone) leave the ledger.
    fn settle(
        &mut self,
        op: Op,
        targets: impl Iterator<Item = RecordEntry>,
        progress: &[Progress],
    ) {
        if op != Op::Resume {
            return;
        }
        for (t, p) in targets.zip(progress) {
            if matches!(p, Progress::Done | Progress::Gone | Progress::Skipped) {
                self.ledger.remove(&t);
            }
        }
    }

    /// Starts (or checks) `op` on `targets`: the gates after everything else, so that a
    /// release resumes a hold's fallback before it opens the gate. A gate is opened by a
    /// resume and confirms nothing else (its drain is the book's to judge).
    fn act(&mut self, targets: &[Target], op: Op, budget: Duration, start: bool) -> Vec<Progress> {
        let (gates, others): (Vec<usize>, Vec<usize>) =
            (0..targets.len()).partition(|i| matches!(targets[*i], Target::Gate { .. }));
        let mut out: Vec<Option<Progress>> = targets.iter().map(|_| None).collect();
        if !others.is_empty() {
            let batch: Vec<Target> = others.iter().map(|i| targets[*i].clone()).collect();
            let p = if start {
                self.actuator.start(&batch, op, budget)
            } else {
                self.actuator.check(&batch, op, budget)
            };
            for (i, p) in others.into_iter().zip(p) {
                out[i] = Some(p);
            }
        }
        for i in gates {
            let Target::Gate { key, uuid, .. } = &targets[i] else {
                continue;
            };
            out[i] = Some(match (op, start, &mut self.gates) {
                (Op::Resume, true, Some(g)) => {
                    g.open(*key, *uuid);
                    Progress::Done
                }
                (Op::Resume, _, _) => Progress::Done,
                (Op::Suspend, true, _) => Progress::Failed(ActError::NoGate(format!(
                    "{}: closed by CloseGate only",
                    targets[i]
                ))),
                // A gate is never what holds a process: nothing runs behind it to find.
                (Op::Suspend, false, _) => Progress::Done,
            });
        }
        out.into_iter()
            .map(|p| p.unwrap_or(Progress::Pending))
            .collect()
    }

    /// The processes of signalled cgroup `dir` now, `leader` first, each pinned by a
    /// pidfd; the agent is never among them. True when the cgroup is gone (its processes
    /// all exited and it was removed): said once per directory.
    fn members(&mut self, dir: &std::path::Path, leader: Named) -> (Vec<Named>, bool) {
        let me = self.procfs.self_pid();
        let lead = match &leader {
            Named::Process { key } => key.pid,
            Named::Cgroup { .. } | Named::Gate { .. } | Named::Lock { .. } => 0,
        };
        let mut out = vec![leader];
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
                        self.pins.insert(key, fd);
                        out.push(Named::Process { key });
                    }
                }
            }
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
                if self.gone_said.len() > 4096 {
                    self.gone_said.clear();
                }
                if self.gone_said.insert(dir.to_path_buf()) {
                    info!(dir = %dir.display(), "The offline cgroup is gone (its processes exited): its hold ends");
                }
                return (out, true);
            }
            Err(err) => {
                warn!(dir = %dir.display(), %err, "Cannot list the offline cgroup: stopping only its GPU process")
            }
        }
        (out, false)
    }

    /// Resumes every target suspended through these hands, waiting up to `budget` (the
    /// NVML watchdog's fail-open, while the loop is stuck; the loop's last word when it
    /// ends). What was resumed stays in the record until the controller lets it go: the
    /// record holds what was or may have been stopped. Returns how many targets it tried
    /// to resume.
    pub fn resume_everything(&mut self, budget: Duration) -> usize {
        let targets: Vec<Target> = self.ledger.values().cloned().collect();
        if targets.is_empty() {
            return 0;
        }
        let progress = self.act(&targets, Op::Resume, budget, true);
        if let Some(g) = &mut self.gates {
            g.open_all();
        }
        // What could not be resumed stays known: the next call tries again.
        self.settle(Op::Resume, targets.iter().map(Target::record), &progress);
        targets.len()
    }

    /// The gate file's heartbeat.
    pub fn keepalive(&mut self) {
        if let Some(g) = &self.gates {
            g.beat();
        }
    }
}
