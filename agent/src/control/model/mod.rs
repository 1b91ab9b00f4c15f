//! The controller's model: the data it reasons about, owned here so that no file of the
//! controller imports an edge. The edges re-export these types and implement their I/O
//! (a [`process::ProcKey`] is read from `/proc`, a [`bell::BellReading`] from a page); the
//! controller only ever receives and gives them as values.
//!
//! [`process`] (identity, classification), [`act`] (actuator kinds, suspend or resume,
//! progress, the fail-open record's entries), [`bell`] (doorbell pages and readings),
//! [`gpu`] (NVML samples and memory, why the lists are read), [`driver`] (the CUDA
//! driver's checkpoint calls), [`host`] (the cgroup mounts), [`hold`] (what a hold reports:
//! how an operation ended, a gate's escalation, a hold found running).

pub mod act;
pub mod bell;
pub mod driver;
pub mod gpu;
pub mod hold;
pub mod host;
pub mod process;

pub use act::{Kind, Op, Progress, RecordEntry};
pub use process::ProcKey;
