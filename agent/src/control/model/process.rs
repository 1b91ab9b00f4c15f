//! A process as the controller knows it: its identity (PID and start time, which survive
//! PID reuse) and what the pod source says of it.

use qos_core::{Class, Share};

/// A process identity that survives PID reuse: the PID and its start time (clock ticks
/// since boot, `/proc/<pid>/stat` field 22).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct ProcKey {
    /// Process ID (host PID namespace).
    pub pid: u32,
    /// Start time in clock ticks since boot.
    pub start: u64,
}

impl std::fmt::Display for ProcKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.pid)
    }
}

/// The result of classifying one process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Classified {
    /// Class of the process.
    pub class: Class,
    /// Share policy (offline only).
    pub share: Share,
    /// Who it belongs to, for logs and `/state` (rule name, or `namespace/pod`).
    pub owner: String,
    /// A cgroup (path inside the hierarchy) that is offline as a whole, so the freezer may
    /// freeze it. `None`: only the process itself is known to be offline, and only the
    /// `signal` actuator may touch it.
    pub freeze_cgroup: Option<String>,
    /// What its pod or rule says of memory preemption (`gpu-coloc.dev/checkpoint`, a
    /// rule's `checkpoint`): `Some(true)` opts in, `Some(false)` out, `None` says nothing.
    pub checkpoint: Option<bool>,
    /// What the webhook did about the CUDA shim in its pod (the pod's annotations); `None`
    /// where the source knows no pod (standalone rules, unknown processes).
    pub shim: Option<ShimNote>,
    /// Its container's name in its pod (the pod's container statuses, by the container ID
    /// in the process's cgroup path); `None` where unknown. Reported, never decides.
    pub container: Option<String>,
}

/// What the webhook wrote on a pod about the CUDA shim (`gpu-coloc.dev/shim-injected`,
/// `gpu-coloc.dev/shim-skipped`, `gpu-coloc.dev/shim: disabled`). The agent reports it
/// for GPU processes that run without the shim's page; it decides nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShimNote {
    /// Injected into every GPU container.
    Injected,
    /// At least one container was left out (its `LD_PRELOAD` could not be appended to, a
    /// path was taken).
    Refused,
    /// The pod opted out (`gpu-coloc.dev/shim: disabled`).
    OptedOut,
    /// No word from the webhook: it did not see the pod (namespace opted out or refusing
    /// `hostPath`, webhook down, no GPU resource it knows, a `system` pod).
    NotInjected,
}
