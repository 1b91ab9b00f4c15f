//! # coloc-agent — the gpu-coloc node agent
//!
//! Watches GPU activity through NVML, classifies GPU processes (standalone rules, or pods
//! on Kubernetes), and suspends offline work while online work on the same GPU is busy,
//! resuming it after the idle window. The decisions come from `qos-core`; this crate is
//! the hands:
//!
//! ```text
//!  edges/ (one trait per I/O edge)          control/ (the loop, one room per job)
//!   gpu (NVML) ──────────────┐              table ─► qos_core::Machine ─► execute
//!   procfs (/proc, pidfds) ──┼────────────► target     (decide)           holds ──► edges/actuator
//!   source (rules, kube) ────┘              health, watchdog               │  └───► edges/record
//!   clock                                   events ──► telemetry (metrics, event log)
//!                                           state ───► http (/metrics /healthz /readyz /state)
//!  cmd/ (status, timeline): read /state and events back as the same types
//! ```
//!
//! Only `edges::gpu` talks to a C library (through `nvml-wrapper`), and only
//! `edges::actuator` and `edges::record` change anything on the host.

pub mod cli;
pub mod cmd;
pub mod control;
pub mod edges;
pub mod http;
pub mod sched;
pub mod telemetry;
