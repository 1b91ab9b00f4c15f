//! Doorbell pages: the launch times that `libcoloc_cuda.so` writes in online processes,
//! and the loop's sleep, which a launch cuts short.
//!
//! ```text
//!  <dir>/<pid>-<nonce>.bell              standalone: a page of process <pid>
//!  <dir>/pods/<pod-uid>/<pid>-<nonce>.bell  Kubernetes: a page of pod <pod-uid>
//!     │ inotify (renamed into place, gone) ─► rescan ─► map read-only, check the layout
//!     │ futex_waitv on every page's wake word (+ our own word for inotify and stop)
//!     ▼
//!  read(): (page, GPU UUID, last launch, run start) for the loop to attribute
//! ```
//!
//! This module decides nothing about trust: it reports where a page lies (its claimed
//! owner), the page file's owner UID, and what the page says, bounds-checked. The loop
//! attributes a page only to a process it already classifies as online (see
//! `control::bells`). Pages are mapped read-only: nothing a tenant writes can make the
//! agent write anywhere.

pub use crate::control::model::bell::{BellReading, Owner, PageInfo};
mod dir;
use coloc_doorbell::guard;
mod pod_dirs;
mod wait;

pub use dir::DirBells;
pub use pod_dirs::{Layout, POD_DIR_MODE};

use std::sync::atomic::{AtomicU32, Ordering::*};
use std::sync::Arc;
use std::time::Duration;
use wait::waitv;

/// Source of doorbell readings and the loop's sleep.
pub trait Doorbells: Send {
    /// Picks up new pages and drops vanished ones when something changed (or when
    /// `force`); returns true when the set changed.
    fn rescan(&mut self, force: bool) -> bool;
    /// Pages mapped now.
    fn pages(&self) -> Vec<PageInfo>;
    /// Appends every mapped page's entries. Also notes each page's wake word (and the
    /// waker's) before reading it: [`Doorbells::wait`] returns at once if any changed
    /// since, so a run that starts while the loop works on the readings is never missed.
    fn read(&mut self, out: &mut Vec<BellReading>);
    /// Sleeps for at most `timeout`; returns early (true) when a launch starts a run on a
    /// mapped page (after the latest [`Doorbells::read`]), a page appears or goes, or
    /// [`Doorbells::waker`] is woken.
    fn wait(&mut self, timeout: Duration) -> bool;
    /// A handle that cuts the current or next [`Doorbells::wait`] short (shutdown).
    fn waker(&self) -> Waker;
    /// Whether [`Doorbells::wait`] would return at once: a run started on a page, or the
    /// waker was woken, since the latest [`Doorbells::read`]. A few loads, no system call.
    fn rang(&self) -> bool;
    /// The pages whose launches count (attributed to an online process): with more pages
    /// than `futex_waitv` takes, these are waited on first, and the rest are read every
    /// tick without being waited on (their launches count for nothing anyway).
    fn prefer(&mut self, _pages: &[u64]) {}
    /// Appends the launch-gate fields of page `page`'s entries (nothing if not mapped).
    fn read_gate(&self, page: u64, out: &mut Vec<coloc_doorbell::GateReading>);
    /// Removes the directories `pods/<uid>` whose pod is gone (`gone(uid)`) and that
    /// nothing changed for `idle`: their files (never following a link) and the
    /// directory. Returns the UIDs removed.
    fn sweep_pods(&mut self, _gone: &dyn Fn(&str) -> bool, _idle: Duration) -> Vec<String> {
        Vec::new()
    }
    /// Makes the directories `pods/<uid>` of the pods in `uids` (Kubernetes: the node's
    /// pods, from the pod watch) that are not made yet, mode 1777, and widens those the
    /// kubelet made first. Returns how many were made or widened.
    fn ensure_pod_dirs(&mut self, _uids: &[String]) -> usize {
        0
    }
}

/// The wall clock's current second (for per-second rate limits).
fn now_sec() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Wakes a waiting loop from another thread.
#[derive(Debug, Clone, Default)]
pub struct Waker(Arc<AtomicU32>);

impl Waker {
    /// Cuts the loop's sleep short.
    pub fn wake(&self) {
        self.0.fetch_add(1, Release);
        coloc_doorbell::futex_wake(&self.0);
    }
}

/// No doorbells (`--no-doorbells`): a plain sleep, cut short only by the waker.
#[derive(Debug, Default)]
pub struct NoBells {
    waker: Waker,
    seen: u32,
}

impl Doorbells for NoBells {
    fn rescan(&mut self, _force: bool) -> bool {
        false
    }
    fn pages(&self) -> Vec<PageInfo> {
        Vec::new()
    }
    fn read(&mut self, _out: &mut Vec<BellReading>) {
        self.seen = self.waker.0.load(Acquire);
    }
    fn wait(&mut self, timeout: Duration) -> bool {
        waitv(&[(&self.waker.0, self.seen)], timeout).unwrap_or_else(|| {
            std::thread::sleep(timeout);
            false
        })
    }
    fn waker(&self) -> Waker {
        self.waker.clone()
    }
    fn rang(&self) -> bool {
        self.waker.0.load(Acquire) != self.seen
    }
    fn read_gate(&self, _page: u64, _out: &mut Vec<coloc_doorbell::GateReading>) {}
}

#[cfg(test)]
mod tests;
