//! # coloc-agent — the gpu-coloc node agent
//!
//! Watches GPU activity through NVML, classifies GPU processes (standalone rules, or pods
//! on Kubernetes), and suspends offline work while online work on the same GPU is busy,
//! resuming it after the idle window. The decisions come from `qos-core`; this crate is
//! the hands:
//!
//! ```text
//!  gpu (NVML) ─┐                                   ┌─► actuator (freezer / signal)
//!  procinfo ───┼─► control (loop, 1 ms) ─► qos-core├─► record (fail-open file)
//!  source ─────┘            │                      └─► metrics, event log
//!                           └─► http (/metrics /healthz /readyz /state)
//! ```
//!
//! Only `gpu` talks to a C library (through `nvml-wrapper`), and only `actuator` and
//! `record` change anything on the host.

pub mod actuator;
pub mod cli;
pub mod control;
pub mod demo;
pub mod gpu;
pub mod http;
pub mod kube_source;
pub mod metrics_setup;
pub mod podref;
pub mod procinfo;
pub mod record;
pub mod source;
pub mod status;
pub mod timeline;
