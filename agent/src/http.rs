//! The agent's HTTP endpoints: `/metrics`, `/healthz`, `/readyz`, `/state`, served over the
//! control loop's [`Shared`] handle (the loop never waits for HTTP).
//!
//! May touch: one TCP listener.

use crate::control::state::Shared;
use crate::edges::clock::now_ns;
use crate::edges::source::PodSource;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// What the handlers need.
#[derive(Clone)]
pub struct AppState {
    /// Shared with the control loop.
    pub shared: Arc<Shared>,
    /// Prometheus renderer.
    pub prom: PrometheusHandle,
    /// Pod source (for readiness).
    pub source: Arc<dyn PodSource>,
    /// Longest time without a tick that still counts as healthy.
    pub stall_ns: u64,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState").finish_non_exhaustive()
    }
}

/// The router.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/state", get(state_doc))
        .with_state(state)
}

async fn metrics(State(s): State<AppState>) -> impl IntoResponse {
    (
        [("content-type", "text/plain; version=0.0.4")],
        s.prom.render() + &s.shared.render_seconds(),
    )
}

async fn healthz(State(s): State<AppState>) -> impl IntoResponse {
    let last = s.shared.last_tick_ns.load(Ordering::Relaxed);
    if !s.shared.ticked.load(Ordering::Relaxed) {
        return (StatusCode::OK, "starting\n");
    }
    if now_ns().saturating_sub(last) > s.stall_ns {
        return (StatusCode::SERVICE_UNAVAILABLE, "control loop stalled\n");
    }
    (StatusCode::OK, "ok\n")
}

async fn readyz(State(s): State<AppState>) -> impl IntoResponse {
    if !s.shared.ticked.load(Ordering::Relaxed) {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "control loop not started\n".to_string(),
        );
    }
    if !s.source.ready() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "pod source not synced\n".to_string(),
        );
    }
    if let Some(why) = s.shared.degraded() {
        return (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n"));
    }
    (StatusCode::OK, "ready\n".to_string())
}

async fn state_doc(State(s): State<AppState>) -> impl IntoResponse {
    Json(s.shared.state())
}
