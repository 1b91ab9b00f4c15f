//! GPU activity through NVML: the running-process list and per-process utilisation
//! samples with their timestamps.
//!
//! One trait, [`GpuSampler`], implemented by [`Nvml`] (the real driver, or the fake one
//! used in tests, loaded from a configurable library path). This module is the agent's
//! only FFI boundary; the unsafe code lives inside `nvml-wrapper`.
//!
//! Transient answers are not failures. Both calls the loop makes are two-step in NVML (ask
//! for the count, then for the data); when samples or processes arrive in between, the
//! driver answers `INSUFFICIENT_SIZE`. Each call retries that answer up to
//! [`TRANSIENT_RETRIES`] times at once and counts it in
//! `coloc_nvml_transient_answers_total`; only what is left after that reaches the loop,
//! whose health policy decides when a failure persists (see `control::health`).
//!
//! May touch: the NVML library.

pub use crate::control::model::gpu::{Activity, GpuMemory};
use std::ffi::OsStr;
use std::time::Instant;

/// Errors from the GPU sampler.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// The library could not be loaded or initialised.
    #[error(
        "no NVIDIA driver: cannot use NVML library {lib:?} ({cause}). Install the NVIDIA \
         driver, or pass --nvml-lib; to try gpu-coloc without a GPU, run `coloc-demo`"
    )]
    NoDriver {
        /// Library path tried.
        lib: String,
        /// Cause, once: the innermost error of NVML's chain (the loader's own message).
        /// Not a `#[source]`, so the message does not repeat it.
        cause: String,
    },
    /// A call failed.
    #[error("NVML {function} on GPU {gpu} failed: {source}")]
    Call {
        /// NVML function.
        function: &'static str,
        /// GPU index.
        gpu: u32,
        /// Cause.
        #[source]
        source: nvml_wrapper::error::NvmlError,
    },
    /// A GPU index that does not exist.
    #[error("GPU {gpu} does not exist (this node has {count})")]
    NoSuchGpu {
        /// Requested.
        gpu: u32,
        /// Present.
        count: u32,
    },
}

/// How many times a call is repeated at once after a transient `INSUFFICIENT_SIZE`.
pub const TRANSIENT_RETRIES: usize = 3;

impl GpuError {
    /// Short, bounded name for metric labels.
    pub fn reason(&self) -> &'static str {
        use nvml_wrapper::error::NvmlError as E;
        match self {
            GpuError::NoDriver { .. } => "no_driver",
            GpuError::NoSuchGpu { .. } => "no_such_gpu",
            GpuError::Call { source, .. } => match source {
                E::InsufficientSize(_) => "insufficient_size",
                E::GpuLost => "gpu_lost",
                E::DriverNotLoaded => "driver_not_loaded",
                E::Uninitialized => "uninitialized",
                E::Timeout => "timeout",
                E::NotFound => "not_found",
                E::NoPermission => "no_permission",
                E::NotSupported => "not_supported",
                _ => "other",
            },
        }
    }
}

/// Source of GPU activity.
pub trait GpuSampler: Send {
    /// GPU indices, in order.
    fn gpus(&self) -> Vec<u32>;
    /// UUID of a GPU (for `/state`).
    fn uuid(&self, gpu: u32) -> String;
    /// PIDs with a compute context on `gpu`.
    fn processes(&mut self, gpu: u32) -> Result<Vec<u32>, GpuError>;
    /// Appends to `out` the activity samples on `gpu` newer than `since_us` (driver
    /// timestamp, µs). The caller reuses `out`, so a tick allocates nothing.
    fn samples(&mut self, gpu: u32, since_us: u64, out: &mut Vec<Activity>)
        -> Result<(), GpuError>;
    /// The GPU's memory and what each process holds there; `None` where this sampler
    /// cannot say.
    fn memory(&mut self, _gpu: u32) -> Result<Option<GpuMemory>, GpuError> {
        Ok(None)
    }
}

/// The NVML-backed sampler.
pub struct Nvml {
    nvml: &'static nvml_wrapper::Nvml,
    devices: Vec<(u32, String, nvml_wrapper::Device<'static>)>,
    /// Reused sample buffer: one driver call per GPU per tick instead of two (NVML's
    /// count-then-data), and no allocation.
    buf: Vec<RawSample>,
    hist_samples: metrics::Histogram,
    hist_procs: metrics::Histogram,
    /// `INSUFFICIENT_SIZE` answers retried at once, both calls (also in the metric; kept
    /// here for `coloc-bench --nvml-probe`, which runs without a metrics recorder).
    transient: u64,
}

/// `nvmlProcessUtilizationSample_t`, laid out as the C struct.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct RawSample {
    pid: std::ffi::c_uint,
    time_stamp: std::ffi::c_ulonglong,
    sm_util: std::ffi::c_uint,
    mem_util: std::ffi::c_uint,
    enc_util: std::ffi::c_uint,
    dec_util: std::ffi::c_uint,
}

/// Largest sample buffer the sampler grows to.
const MAX_SAMPLES: usize = 65_536;

impl std::fmt::Debug for Nvml {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nvml")
            .field("gpus", &self.devices.len())
            .finish()
    }
}

fn call_histogram(function: &'static str) -> metrics::Histogram {
    metrics::histogram!("coloc_nvml_call_duration_seconds", "function" => function)
}

impl Nvml {
    /// Loads NVML from `lib` and opens the GPUs in `only` (all when empty).
    pub fn open(lib: &str, only: &[u32]) -> Result<Nvml, GpuError> {
        let nvml = nvml_wrapper::Nvml::builder()
            .lib_path(OsStr::new(lib))
            .init()
            .map_err(|source| {
                // The innermost cause (e.g. the loader's "cannot open shared object
                // file"), said once.
                let mut cause: &dyn std::error::Error = &source;
                while let Some(next) = cause.source() {
                    cause = next;
                }
                GpuError::NoDriver {
                    lib: lib.to_string(),
                    cause: cause.to_string(),
                }
            })?;
        // The agent keeps NVML for its whole life; leaking it gives devices a 'static
        // borrow, and the driver is shut down when the process exits.
        let nvml: &'static nvml_wrapper::Nvml = Box::leak(Box::new(nvml));
        let count = nvml.device_count().map_err(|source| GpuError::Call {
            function: "nvmlDeviceGetCount",
            gpu: 0,
            source,
        })?;
        let wanted: Vec<u32> = if only.is_empty() {
            (0..count).collect()
        } else {
            only.to_vec()
        };
        let mut devices = Vec::new();
        for gpu in wanted {
            if gpu >= count {
                return Err(GpuError::NoSuchGpu { gpu, count });
            }
            let dev = nvml.device_by_index(gpu).map_err(|source| GpuError::Call {
                function: "nvmlDeviceGetHandleByIndex",
                gpu,
                source,
            })?;
            let uuid = dev.uuid().unwrap_or_else(|_| format!("GPU-{gpu}"));
            devices.push((gpu, uuid, dev));
        }
        Ok(Nvml {
            nvml,
            devices,
            buf: vec![RawSample::default(); 256],
            hist_samples: call_histogram("nvmlDeviceGetProcessUtilization"),
            hist_procs: call_histogram("nvmlDeviceGetComputeRunningProcesses"),
            transient: 0,
        })
    }

    /// How many `INSUFFICIENT_SIZE` answers this sampler has retried since it opened.
    pub fn transient_answers(&self) -> u64 {
        self.transient
    }

    fn device(&self, gpu: u32) -> Result<&nvml_wrapper::Device<'static>, GpuError> {
        device_in(&self.devices, gpu)
    }
}

type Devices = [(u32, String, nvml_wrapper::Device<'static>)];

fn device_in(devices: &Devices, gpu: u32) -> Result<&nvml_wrapper::Device<'static>, GpuError> {
    devices
        .iter()
        .find(|d| d.0 == gpu)
        .map(|d| &d.2)
        .ok_or(GpuError::NoSuchGpu {
            gpu,
            count: devices.len() as u32,
        })
}

/// Repeats `call` while it answers `INSUFFICIENT_SIZE` (the count grew between NVML's two
/// steps), up to [`TRANSIENT_RETRIES`] times.
fn retry_transient<T>(
    function: &'static str,
    retried: &mut u64,
    mut call: impl FnMut() -> Result<T, nvml_wrapper::error::NvmlError>,
) -> Result<T, nvml_wrapper::error::NvmlError> {
    let mut r = call();
    for _ in 0..TRANSIENT_RETRIES {
        if !matches!(r, Err(nvml_wrapper::error::NvmlError::InsufficientSize(_))) {
            break;
        }
        metrics::counter!("coloc_nvml_transient_answers_total", "function" => function)
            .increment(1);
        *retried += 1;
        r = call();
    }
    r
}

impl GpuSampler for Nvml {
    fn gpus(&self) -> Vec<u32> {
        self.devices.iter().map(|d| d.0).collect()
    }

    fn uuid(&self, gpu: u32) -> String {
        self.devices
            .iter()
            .find(|d| d.0 == gpu)
            .map(|d| d.1.clone())
            .unwrap_or_default()
    }

    fn processes(&mut self, gpu: u32) -> Result<Vec<u32>, GpuError> {
        // The device through its field alone: `self.transient` is borrowed beside it.
        let dev = device_in(&self.devices, gpu)?;
        let t = Instant::now();
        let r = retry_transient(
            "nvmlDeviceGetComputeRunningProcesses",
            &mut self.transient,
            || dev.running_compute_processes(),
        );
        self.hist_procs.record(t.elapsed().as_secs_f64());
        let procs = r.map_err(|source| GpuError::Call {
            function: "nvmlDeviceGetComputeRunningProcesses",
            gpu,
            source,
        })?;
        Ok(procs.into_iter().map(|p| p.pid).collect())
    }

    fn memory(&mut self, gpu: u32) -> Result<Option<GpuMemory>, GpuError> {
        use nvml_wrapper::enums::device::UsedGpuMemory;
        let dev = device_in(&self.devices, gpu)?;
        let info = dev.memory_info().map_err(|source| GpuError::Call {
            function: "nvmlDeviceGetMemoryInfo_v2",
            gpu,
            source,
        })?;
        let procs = retry_transient(
            "nvmlDeviceGetComputeRunningProcesses",
            &mut self.transient,
            || dev.running_compute_processes(),
        )
        .map_err(|source| GpuError::Call {
            function: "nvmlDeviceGetComputeRunningProcesses",
            gpu,
            source,
        })?;
        Ok(Some(GpuMemory {
            total: info.total,
            free: info.free,
            processes: procs
                .into_iter()
                .map(|p| {
                    let bytes = match p.used_gpu_memory {
                        UsedGpuMemory::Used(b) => b,
                        UsedGpuMemory::Unavailable => 0,
                    };
                    (p.pid, bytes)
                })
                .collect(),
        }))
    }

    fn samples(
        &mut self,
        gpu: u32,
        since_us: u64,
        out: &mut Vec<Activity>,
    ) -> Result<(), GpuError> {
        use nvml_wrapper::error::{nvml_try, NvmlError};
        const F: &str = "nvmlDeviceGetProcessUtilization";
        let call = |source| GpuError::Call {
            function: F,
            gpu,
            source,
        };
        let handle = {
            let dev = self.device(gpu)?;
            // SAFETY: the handle is only passed to NVML below, while `self.nvml` (leaked,
            // 'static) keeps the library initialised.
            unsafe { dev.handle() }
        };
        let sym = self
            .nvml
            .lib()
            .nvmlDeviceGetProcessUtilization
            .as_ref()
            .map_err(|e| call(NvmlError::FailedToLoadSymbol(e.to_string())))?;
        let t = Instant::now();
        let mut result = Err(NvmlError::InsufficientSize(None));
        for attempt in 0..=TRANSIENT_RETRIES {
            let mut count = self.buf.len() as std::ffi::c_uint;
            // SAFETY: `buf` holds `count` initialised samples with the C layout; the driver
            // writes at most `count` of them and sets `count` to how many it wrote (or, on
            // INSUFFICIENT_SIZE, how many it needs).
            let code = unsafe { sym(handle, self.buf.as_mut_ptr().cast(), &mut count, since_us) };
            result = nvml_try(code).map(|()| (count as usize).min(self.buf.len()));
            match &result {
                Err(NvmlError::InsufficientSize(_)) => {
                    // Samples arrived, or the buffer is too small: grow it and ask again.
                    let want = (count as usize).max(self.buf.len()) + 16;
                    self.buf.resize(want.min(MAX_SAMPLES), RawSample::default());
                    if attempt < TRANSIENT_RETRIES {
                        metrics::counter!("coloc_nvml_transient_answers_total", "function" => F)
                            .increment(1);
                        self.transient += 1;
                    }
                }
                _ => break,
            }
        }
        self.hist_samples.record(t.elapsed().as_secs_f64());
        match result {
            Ok(n) => {
                out.extend(
                    self.buf[..n]
                        .iter()
                        .filter(|s| {
                            s.sm_util > 0 || s.mem_util > 0 || s.enc_util > 0 || s.dec_util > 0
                        })
                        .map(|s| Activity {
                            pid: s.pid,
                            at_ns: s.time_stamp.saturating_mul(1000),
                            sm_util: s.sm_util.max(s.enc_util).max(s.dec_util).min(100),
                        }),
                );
                Ok(())
            }
            // The driver says NOT_FOUND when no sample is newer than `since_us`.
            Err(NvmlError::NotFound) => Ok(()),
            Err(source) => Err(call(source)),
        }
    }
}
