//! What NVML says: a process's activity sample, a GPU's memory.

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
