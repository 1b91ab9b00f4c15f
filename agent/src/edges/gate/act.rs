//! The gate keeper: closes and opens one GPU's launch gate for the loop's holds, and keeps
//! the gate file's heartbeat. A gate is per GPU: it is closed for its first holder and
//! opened when its last holder is released.
//!
//! ```text
//!  close(pid, gpu) -> epoch   first holder of the GPU: beat, close → epoch
//!                             later ones: the same epoch
//!  open(pid, gpu)             last holder of the GPU gone: open
//!  beat()                     the heartbeat (the loop calls it at least every 20 ms while
//!                             a gate is closed: shims read a stale heartbeat as open)
//! ```
//!
//! The keeper confirms nothing: whether the process drained is what its page's
//! acknowledgement says, which the loop reads and the hold book judges; what holds the
//! process is its fallback (the freezer or a signal), which the book starts once the gate
//! has drained or its bound has passed. A tenant that forges the acknowledgement only gets
//! stopped sooner.

use super::GateFile;
use crate::edges::actuator::{ActError, Progress};
use crate::edges::procfs::ProcKey;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use tracing::{debug, info};

/// A GPU whose gate the keeper closed.
#[derive(Debug)]
struct Closed {
    epoch: u32,
    holders: BTreeSet<ProcKey>,
}

/// What the loop's hands close and open launch gates through: the [`GateKeeper`] over the
/// node's gate file (tests: a model of the shims behind it).
pub trait LaunchGates: Send + std::fmt::Debug {
    /// Where the gate file is (the record names it in each gate entry).
    fn path(&self) -> &Path;
    /// Closes `uuid`'s gate for `key` (if `file` is this keeper's): the close's epoch.
    fn close(&mut self, key: ProcKey, uuid: [u8; 16], file: &Path) -> Result<u32, ActError>;
    /// Releases `key`'s hold on `uuid`'s gate.
    fn open(&mut self, key: ProcKey, uuid: [u8; 16]);
    /// Opens every gate (the NVML watchdog's fail-open, the loop's last word).
    fn open_all(&mut self);
    /// Refreshes the heartbeat.
    fn beat(&self);
}

impl LaunchGates for GateKeeper {
    fn path(&self) -> &Path {
        GateKeeper::path(self)
    }
    fn close(&mut self, key: ProcKey, uuid: [u8; 16], file: &Path) -> Result<u32, ActError> {
        GateKeeper::close(self, key, uuid, file)
    }
    fn open(&mut self, key: ProcKey, uuid: [u8; 16]) {
        GateKeeper::open(self, key, uuid)
    }
    fn open_all(&mut self) {
        GateKeeper::open_all(self)
    }
    fn beat(&self) {
        GateKeeper::beat(self)
    }
}

/// Closes and opens gates in the node's gate file.
#[derive(Debug)]
pub struct GateKeeper {
    file: GateFile,
    closed: BTreeMap<[u8; 16], Closed>,
}

impl GateKeeper {
    /// Gates in `file` (every gate open now).
    pub fn new(file: GateFile) -> GateKeeper {
        GateKeeper {
            file,
            closed: BTreeMap::new(),
        }
    }

    /// Where the gate file is.
    pub fn path(&self) -> &Path {
        self.file.path()
    }

    /// Closes `uuid`'s gate for `key` (if `file` is this keeper's): the close's epoch.
    pub fn close(&mut self, key: ProcKey, uuid: [u8; 16], file: &Path) -> Result<u32, ActError> {
        if file != self.file.path() {
            return Err(ActError::NoGate(format!(
                "its gate file {} is not this agent's {}",
                file.display(),
                self.file.path().display()
            )));
        }
        if let Some(c) = self.closed.get_mut(&uuid) {
            c.holders.insert(key);
            return Ok(c.epoch);
        }
        // A heartbeat older than the shims' bound would make them read the close as open:
        // beat first.
        self.file.beat();
        let epoch = self
            .file
            .close(&uuid)
            .map_err(|err| ActError::NoGate(format!("{err:#}")))?;
        debug!(gpu = %coloc_doorbell::format_uuid(&uuid), epoch, "Gate closed");
        self.closed.insert(
            uuid,
            Closed {
                epoch,
                holders: BTreeSet::from([key]),
            },
        );
        Ok(epoch)
    }

    /// Releases `key`'s hold on `uuid`'s gate; the last holder opens it.
    pub fn open(&mut self, key: ProcKey, uuid: [u8; 16]) {
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

    /// Opens every gate (the NVML watchdog's fail-open).
    pub fn open_all(&mut self) {
        self.closed.clear();
        self.file.open_all();
    }

    /// Refreshes the heartbeat.
    pub fn beat(&self) {
        self.file.beat();
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
