//! # coloc-e2e — end-to-end tests
//!
//! Real processes, real signals, real cgroups; only the GPU is simulated (`coloc-sim gpu`
//! plus `libfake_nvml.so` loaded by the real agent). The harness that drives the binaries
//! (the simulated GPU, the agent, scratch cgroups, HTTP, the fake API server, the CUDA
//! driver client) is `coloc-tools`' library, shared with `coloc-bench`; it is re-exported
//! here with what only the tests use. Binaries come from the same cargo target directory
//! as the test executable, so run `cargo build --workspace` first (the README's test
//! command does).

pub mod agent_tests;
mod svg;

pub use coloc_tools::*;
pub use svg::render_svg;
