//! The host as the agent's configuration describes it: where its cgroup hierarchies are
//! mounted (found at start by the cgroup edge).

use std::path::PathBuf;

/// The cgroup mounts of this host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CgroupMounts {
    /// Mount point of the unified (v2) hierarchy, if any.
    pub v2: Option<PathBuf>,
    /// Mount point of the v1 freezer hierarchy, if any.
    pub v1_freezer: Option<PathBuf>,
    /// Mount point of the v1 memory hierarchy, if any (memory limits where the v2
    /// hierarchy has no memory controller).
    pub v1_memory: Option<PathBuf>,
}
