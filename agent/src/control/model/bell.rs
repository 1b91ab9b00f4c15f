//! What a doorbell page says, as the shell reads it: where the page lies (its claimed
//! owner) and each entry's launch times.

use coloc_doorbell::Reading;
use std::path::PathBuf;

/// Who a page says it belongs to, from where it lies.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Owner {
    /// Standalone: the process with this PID (from the file name).
    Pid(u32),
    /// Kubernetes: the pod with this UID (from the directory name).
    Pod(String),
}

/// A mapped page, as the loop sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageInfo {
    /// Stable id while mapped.
    pub id: u64,
    /// Where it lies.
    pub path: PathBuf,
    /// Claimed owner.
    pub owner: Owner,
    /// UID owning the file.
    pub file_uid: u32,
    /// The writer's wake gap, ns.
    pub wake_gap_ns: u64,
    /// The PID the page's writer gives for itself (in its own PID namespace); never
    /// trusted, used only to tell which of a pod's pages are its live processes'.
    pub pid: u32,
    /// The class the page says its process is ([`coloc_doorbell::CLASS_ONLINE`],
    /// [`coloc_doorbell::CLASS_OFFLINE`]); routing only, never trust.
    pub class: u32,
}

/// One reading of one page entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BellReading {
    /// [`PageInfo::id`].
    pub page: u64,
    /// The entry.
    pub reading: Reading,
    /// The entry's completion stamp (page version 3): when the writer last saw all its
    /// work on that GPU complete, ns; 0 when unknown (older page, none yet, or later than
    /// the reader's now).
    pub drained_ns: u64,
}
