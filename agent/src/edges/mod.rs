//! The edges: one trait per thing the control loop reads or changes outside itself, each
//! with its real implementation and (in tests) a fake beside it.
//!
//! ```text
//!   gpu::GpuSampler ─── NVML (libnvidia-ml, or the test fake) ── samples, process lists
//!   procfs::ProcFs ──── /proc, cgroup.procs, pidfds ───────────── who a PID is
//!   source::PodSource ─ rules file, or the Kubernetes watcher ─── what class it is
//!   actuator::Actuator  freezer, signal, dry run ──────────────── stop / continue
//!   record::RecordStore the fail-open file ────────────────────── what is stopped
//!   clock::Clock ────── wall clock (NVML's timestamps) ────────── now
//!   doorbell::Doorbells launch pages of the CUDA shim, futex ─── onset; the loop's sleep
//!   checkpoint ──────── the CUDA driver's checkpoint API ─────── lock, checkpoint, restore
//! ```
//!
//! Only `gpu` (through `nvml-wrapper`) and `checkpoint` (the CUDA driver, by `dlopen`) call
//! a GPU library; only `actuator`, `checkpoint` and `record` change anything on the host.

pub mod actuator;
pub mod cgroupfs;
pub mod checkpoint;
pub mod clock;
pub mod deviceplugin;
pub mod doorbell;
pub mod gate;
pub mod gpu;
pub mod procfs;
pub mod record;
pub mod source;

#[cfg(test)]
pub mod fake;
