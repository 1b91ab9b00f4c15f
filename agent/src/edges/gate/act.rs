//! The `gate` actuator: closes a GPU's launch gate for the offline processes that run the
//! shim, and confirms each process by its acknowledgement; every other target goes to the
//! actuator it wraps (freezer, signals).
//!
//! ```text
//!  start(Gate{pid, gpu}, Suspend)  first holder of the GPU: beat, close → epoch
//!                                  later ones: the same epoch (the gate is per GPU)
//!  check(Gate{pid, gpu}, Suspend)  the AckBoard's acks for (pid, gpu) — every offline page
//!                                  of the process (of its pod, on Kubernetes) that has an
//!                                  entry for the GPU — all equal the epoch: Done; else
//!                                  Pending (the loop escalates after --gate-timeout)
//!  start(Gate{pid, gpu}, Resume)   last holder of the GPU gone: open; Done at once
//! ```
//!
//! The loop fills the [`AckBoard`] from the pages it maps (it alone reads them), for the
//! (process, GPU) pairs this actuator says it waits on.

use super::GateFile;
use crate::edges::actuator::{ActError, Actuator, Op, Progress, Target};
use crate::edges::procfs::ProcKey;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::{debug, info};

/// Acknowledgements read from the offline processes' pages, by (process, GPU UUID).
#[derive(Debug, Default)]
pub struct AckBoard {
    inner: Mutex<Board>,
}

#[derive(Debug, Default)]
struct Board {
    /// Pairs the actuator holds a gate for.
    wanted: BTreeSet<(ProcKey, [u8; 16])>,
    /// The `gate_ack` of every page of the process with an entry for the GPU.
    acks: BTreeMap<(ProcKey, [u8; 16]), Vec<u32>>,
}

impl AckBoard {
    fn lock(&self) -> std::sync::MutexGuard<'_, Board> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The pairs whose acknowledgements the actuator needs.
    pub fn wanted(&self) -> Vec<(ProcKey, [u8; 16])> {
        self.lock().wanted.iter().copied().collect()
    }

    /// Sets what the pages of `key` say for `uuid` (empty: no page with such an entry).
    pub fn set(&self, key: ProcKey, uuid: [u8; 16], acks: Vec<u32>) {
        let mut b = self.lock();
        if acks.is_empty() {
            b.acks.remove(&(key, uuid));
        } else {
            b.acks.insert((key, uuid), acks);
        }
    }

    fn acked(&self, key: ProcKey, uuid: [u8; 16], epoch: u32) -> bool {
        self.lock()
            .acks
            .get(&(key, uuid))
            .is_some_and(|v| !v.is_empty() && v.iter().all(|a| *a == epoch))
    }
}

/// A GPU whose gate this actuator closed.
#[derive(Debug)]
struct Closed {
    epoch: u32,
    holders: BTreeSet<ProcKey>,
}

/// The gate actuator over another one.
pub struct Gated {
    inner: Box<dyn Actuator>,
    file: GateFile,
    board: Arc<AckBoard>,
    closed: BTreeMap<[u8; 16], Closed>,
}

impl std::fmt::Debug for Gated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gated")
            .field("file", &self.file)
            .field("closed", &self.closed.len())
            .finish_non_exhaustive()
    }
}

impl Gated {
    /// Gates in `file` (every gate open now), other targets through `inner`.
    pub fn new(inner: Box<dyn Actuator>, file: GateFile) -> Gated {
        Gated {
            inner,
            file,
            board: Arc::default(),
            closed: BTreeMap::new(),
        }
    }

    /// The board the loop fills.
    pub fn board(&self) -> Arc<AckBoard> {
        self.board.clone()
    }

    /// Where the gate file is.
    pub fn path(&self) -> &Path {
        self.file.path()
    }

    fn close(&mut self, key: ProcKey, uuid: [u8; 16]) -> Progress {
        let epoch = match self.closed.get_mut(&uuid) {
            Some(c) => {
                c.holders.insert(key);
                c.epoch
            }
            None => {
                // A heartbeat older than the shims' bound would make them read the close as
                // open: beat first.
                self.file.beat();
                let epoch = match self.file.close(&uuid) {
                    Ok(e) => e,
                    Err(err) => {
                        return Progress::Failed(ActError::NoGate(format!("{err:#}")));
                    }
                };
                debug!(gpu = %coloc_doorbell::format_uuid(&uuid), epoch, "Gate closed");
                self.closed.insert(
                    uuid,
                    Closed {
                        epoch,
                        holders: BTreeSet::from([key]),
                    },
                );
                epoch
            }
        };
        self.board.lock().wanted.insert((key, uuid));
        self.confirmed(key, uuid, epoch)
    }

    fn confirmed(&self, key: ProcKey, uuid: [u8; 16], epoch: u32) -> Progress {
        if self.board.acked(key, uuid, epoch) {
            Progress::Done
        } else {
            Progress::Pending
        }
    }

    fn open(&mut self, key: ProcKey, uuid: [u8; 16]) {
        {
            let mut b = self.board.lock();
            b.wanted.remove(&(key, uuid));
            b.acks.remove(&(key, uuid));
        }
        let Some(c) = self.closed.get_mut(&uuid) else {
            return;
        };
        c.holders.remove(&key);
        if c.holders.is_empty() {
            self.closed.remove(&uuid);
            self.file.open(&uuid);
            debug!(gpu = %coloc_doorbell::format_uuid(&uuid), "Gate opened");
        }
    }

    fn gate_op(&mut self, t: &Target, op: Op, start: bool) -> Progress {
        let Target::Gate { key, uuid, file } = t else {
            unreachable!("only gate targets come here")
        };
        if file != self.file.path() {
            return Progress::Failed(ActError::NoGate(format!(
                "{t}: its gate file {} is not this agent's {}",
                file.display(),
                self.file.path().display()
            )));
        }
        match (op, start) {
            (Op::Suspend, true) => self.close(*key, *uuid),
            (Op::Suspend, false) => match self.closed.get(uuid) {
                Some(c) if c.holders.contains(key) => self.confirmed(*key, *uuid, c.epoch),
                // Not closed for it (opened since): not suspended.
                _ => Progress::Pending,
            },
            (Op::Resume, true) => {
                self.open(*key, *uuid);
                Progress::Done
            }
            (Op::Resume, false) => Progress::Done,
        }
    }

    fn run(&mut self, targets: &[Target], op: Op, budget: Duration, start: bool) -> Vec<Progress> {
        let mut out: Vec<Option<Progress>> = targets
            .iter()
            .map(|t| matches!(t, Target::Gate { .. }).then(|| self.gate_op(t, op, start)))
            .collect();
        let others: Vec<Target> = targets
            .iter()
            .filter(|t| !matches!(t, Target::Gate { .. }))
            .cloned()
            .collect();
        if !others.is_empty() {
            let mut p = if start {
                self.inner.start(&others, op, budget)
            } else {
                self.inner.check(&others, op, budget)
            }
            .into_iter();
            for slot in out.iter_mut().filter(|o| o.is_none()) {
                *slot = p.next();
            }
        }
        out.into_iter()
            .map(|o| o.unwrap_or(Progress::Pending))
            .collect()
    }
}

impl Actuator for Gated {
    fn start(&mut self, targets: &[Target], op: Op, budget: Duration) -> Vec<Progress> {
        self.run(targets, op, budget, true)
    }
    fn check(&mut self, targets: &[Target], op: Op, budget: Duration) -> Vec<Progress> {
        self.run(targets, op, budget, false)
    }
    fn keepalive(&mut self) {
        self.file.beat();
    }
    fn gates_closed(&self) -> bool {
        !self.closed.is_empty()
    }
}

/// Opens `uuid`'s gate in the gate file at `path` that a previous run left (the
/// fail-open record's gate entries): the file must be a valid gate file; a missing one is
/// gone (a new agent replaced it, or the node rebooted).
pub fn open_recorded(path: &Path, uuid: &str) -> Progress {
    let Some(bytes) = coloc_doorbell::parse_uuid(uuid) else {
        return Progress::Failed(ActError::NoGate(format!(
            "recorded gate {uuid}: not a GPU UUID"
        )));
    };
    match GateFile::attach(path) {
        Ok(Some(f)) => {
            if f.open(&bytes) {
                info!(file = %path.display(), gpu = uuid, "Opened a gate a previous run left closed");
            }
            Progress::Done
        }
        Ok(None) => Progress::Gone,
        Err(err) => Progress::Failed(ActError::NoGate(format!(
            "gate file {}: {err:#}",
            path.display()
        ))),
    }
}
