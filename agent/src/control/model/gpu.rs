//! What NVML says: a process's activity sample, a GPU's memory; why its process lists are
//! read ([`Refresh`]).

/// One activity sample of one process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Activity {
    /// Process ID.
    pub pid: u32,
    /// The driver's timestamp: the END of the sampled period, ns since the Unix epoch.
    pub at_ns: u64,
    /// Percent of the period the process had work on the GPU (1–100).
    pub sm_util: u32,
}

/// A GPU's memory, as the driver reports it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GpuMemory {
    /// Installed, bytes.
    pub total: u64,
    /// Not allocated, bytes.
    pub free: u64,
    /// (PID, bytes) of each process with a compute context.
    pub processes: Vec<(u32, u64)>,
}

/// Why the process lists are read now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refresh {
    /// A sample named a PID the table does not know.
    UnknownPid,
    /// The pod source changed (a pod came, went or changed class).
    PodSource,
    /// A doorbell rang for a process the lists did not hold yet.
    Doorbell,
    /// `--process-interval` passed.
    Interval,
}

impl Refresh {
    /// Metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Refresh::UnknownPid => "unknown_pid",
            Refresh::PodSource => "pod_source",
            Refresh::Doorbell => "doorbell",
            Refresh::Interval => "interval",
        }
    }
}
