//! # coloc-webhook — admission webhook for mGPU requests
//!
//! ```text
//!  API server ──AdmissionReview──► /mutate   ─► review::review ─► translate::translate ─► JSON patch
//!                                  /validate ─►        (pure)          (pure, qos-core parsing)
//!                                  /inject   ─►                    ─► inject::inject (the CUDA shim)
//!                                  /validate-mounts ─►             ─► mounts::check_pod / check_ephemeral
//! ```
//!
//! `translate`, `inject`, `mounts` and `review` are pure (no I/O); `server` is the HTTPS wiring:
//! axum + rustls (ring), certificates reloaded from files when they change; `bootstrap`
//! is the certificate Jobs' client of the API server.
#![forbid(unsafe_code)]

pub mod bootstrap;
pub mod inject;
pub mod mounts;
pub mod review;
pub mod server;
pub mod translate;
