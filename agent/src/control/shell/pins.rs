//! The pidfds that pin the processes the controller names. The controller holds no file
//! descriptor: a process is named by its key ([`crate::control::target::Target::Process`]),
//! and its pidfd lives here, opened when the process is classified (or found in a
//! signalled cgroup), looked up by that key when a command names it, and closed once the
//! controller names it no more ([`Pins::retain`] after each tick).
//!
//! A key whose pin was closed is pinned again on demand: `open_pidfd` checks the start
//! time after opening, so a PID reused since can never be signalled in its place.
//!
//! May touch: opens pidfds (through the `/proc` edge).

use crate::edges::procfs::{ProcFs, ProcKey};
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, MutexGuard};

/// See the module. Shared by the classifier (which opens pins) and the hands (which
/// signal through them).
#[derive(Debug, Default)]
pub struct Pins(Mutex<HashMap<ProcKey, Arc<OwnedFd>>>);

impl Pins {
    fn map(&self) -> MutexGuard<'_, HashMap<ProcKey, Arc<OwnedFd>>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Pins `key` with `fd`.
    pub fn insert(&self, key: ProcKey, fd: OwnedFd) {
        self.map().insert(key, Arc::new(fd));
    }

    /// `key`'s pin, if it has one.
    pub fn get(&self, key: &ProcKey) -> Option<Arc<OwnedFd>> {
        self.map().get(key).cloned()
    }

    /// `key`'s pin, opened now if it has none (an error: the process is gone, or its PID
    /// is another process's now).
    pub fn get_or_open(&self, key: ProcKey, procfs: &dyn ProcFs) -> std::io::Result<Arc<OwnedFd>> {
        if let Some(fd) = self.get(&key) {
            return Ok(fd);
        }
        let fd = Arc::new(procfs.open_pidfd(key)?);
        self.map().insert(key, fd.clone());
        Ok(fd)
    }

    /// Closes the pins of the processes `keep` does not name.
    pub fn retain(&self, keep: impl Fn(&ProcKey) -> bool) {
        self.map().retain(|k, _| keep(k));
    }

    /// How many processes are pinned.
    pub fn len(&self) -> usize {
        self.map().len()
    }

    /// Whether no process is pinned.
    pub fn is_empty(&self) -> bool {
        self.map().is_empty()
    }
}
