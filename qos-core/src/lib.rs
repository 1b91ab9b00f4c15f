//! # qos-core — the brain of gpu-coloc
//!
//! Pure logic, no I/O: no files, no clocks, no threads, no `unsafe`. Everything that
//! touches the world (NVML, `/proc`, cgroups, Kubernetes, HTTP) lives in `agent/` and
//! `webhook/`; they feed this crate observations and carry out the actions it returns.
//!
//! ```text
//!  pod annotations ──► class::classify ──┐
//!                                        ▼
//!  NVML samples (per process, per GPU) ─► machine::Machine::tick(now, gpus) ──► Decision
//!                                         │                                   (suspend / resume,
//!  share policy (resources, duty) ────────┘                                    transitions)
//! ```
//!
//! - [`cdi`]: the shim as a node device (slots, the CDI spec, the extended resources).
//! - [`class`]: the `katalyst.kubewharf.io/qos_level` annotation → online/offline/system.
//! - [`pod`]: a whole pod in every vocabulary (Katalyst, Koordinator, HAMi, vke), what it
//!   cannot change after admission first; shared by the agent and the webhook.
//! - [`resources`]: parsing and validation of the `vke.volcengine.com/*` requests and the
//!   compute-policy annotation, shared by the agent and the admission webhook.
//! - [`machine`]: the per-GPU preempt/release state machine and the `fixed-share` duty cycle.
//! - [`release`]: the learned release window (shorter than the idle window where the
//!   doorbell sees onset and the gate bounds what a wrong release costs).
//! - [`stats`]: the one percentile (nearest rank) every report uses.
//!
//! Time is always an argument: a [`Nanos`] count on the same clock as NVML's sample
//! timestamps (the agent uses wall-clock nanoseconds since the Unix epoch).
#![forbid(unsafe_code)]

pub mod cdi;
pub mod class;
pub mod machine;
pub mod pod;
pub mod release;
pub mod resources;
pub mod stats;

pub use class::{classify, Class, Classification, QosLevel, QOS_LEVEL_ANNOTATION};
pub use machine::{
    Config, Decision, GpuInput, GpuState, Machine, ProcessObs, Share, Signal, Transition,
};
pub use pod::{
    classify_pod, classify_pod_with, Evidence, PodClassification, PodFacts, PriorityMapping,
};
pub use resources::{ComputePolicy, ResourceError};

/// Nanoseconds on the clock shared by NVML sample timestamps and the agent.
pub type Nanos = u64;

/// One millisecond in [`Nanos`].
pub const MS: Nanos = 1_000_000;
