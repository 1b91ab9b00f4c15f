//! # coloc-agent — the gpu-coloc node agent
//!
//! Watches GPU activity through NVML, classifies GPU processes (standalone rules, or pods
//! on Kubernetes), and suspends offline work while online work on the same GPU is busy,
//! resuming it after the idle window. The decisions come from `qos-core`; this crate is
//! the hands:
//!
//! ```text
//!  edges/ (one trait per I/O edge)     control/ (a controller that decides, in a shell that acts)
//!   gpu (NVML) ──────────────┐          shell: eyes ──Obs──► Controller::step ──Cmd──► hands ──► edges/actuator
//!   procfs (/proc, pidfds) ──┼────────►        (table, health, bells, gates,           scribe ─► edges/record
//!   source (rules, kube) ────┘                  qos_core::Machine, holds, record)       telemetry (metrics, event log)
//!   clock, doorbell, gate                 state ───► http (/metrics /healthz /readyz /state)
//!  cmd/ (status, timeline): read /state and events back as the same types
//! ```
//!
//! Only `edges::gpu` talks to a C library (through `nvml-wrapper`), and only
//! `edges::actuator` and `edges::record` change anything on the host.

pub mod cli;
pub mod cmd;
pub mod control;
pub mod earned;
pub mod edges;
pub mod http;
pub mod logbudget;
pub mod sched;
pub mod telemetry;
#[cfg(test)]
mod testutil;
