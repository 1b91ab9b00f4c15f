//! The agent's HTTP endpoints: `/metrics`, `/healthz`, `/readyz`, `/state`, served over the
//! control loop's [`Shared`] handle (the loop never waits for HTTP), and the server that
//! bounds what clients can hold ([`serve`]):
//!
//! - a request head must arrive within the header timeout (counted from the accept, or from
//!   the first byte of a following request on a kept-alive connection);
//! - a connection that moves no byte in either direction for the idle timeout is closed
//!   (a kept-alive connection waiting for its next request, a client that stops reading
//!   a response);
//! - at most `max_connections` are open: one more evicts the oldest connection still
//!   waiting for a complete request head (else the oldest one), so a flood of half-sent
//!   requests can neither grow memory nor lock out a health probe;
//! - request heads are read into at most [`MAX_HEAD_BYTES`], request bodies (every
//!   endpoint is a GET) are refused above [`MAX_BODY_BYTES`];
//! - `/metrics` is rendered at most every [`METRICS_MIN_INTERVAL`] (a scrape flood costs a
//!   few renders a second, not one per request).
//!
//! It runs on the agent's 1-worker tokio runtime, not on the control loop's thread.
//!
//! May touch: one TCP listener.

use crate::control::state::Shared;
use crate::edges::clock::now_ns;
use crate::edges::source::PodSource;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Largest request body accepted: every endpoint is a GET.
pub const MAX_BODY_BYTES: u64 = 1024;
/// Read buffer of a connection: a request head larger than this is refused (431).
pub const MAX_HEAD_BYTES: usize = 16 * 1024;
/// `/metrics` is rendered at most this often; requests in between get the last rendering.
pub const METRICS_MIN_INTERVAL: Duration = Duration::from_millis(100);

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
    /// `/state` shows command lines (`--state-cmdlines`); otherwise `cmd` is empty.
    pub state_cmdlines: bool,
    /// `/state` answers any client (`--state-public`); otherwise loopback clients only.
    pub state_public: bool,
    /// `/metrics` has `coloc_process_info` (not `--metrics-without-pods`).
    pub process_info: bool,
    /// The latest `/metrics` rendering and when it was made.
    pub metrics_cache: Arc<Mutex<Option<(std::time::Instant, Bytes)>>>,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("stall_ns", &self.stall_ns)
            .field("state_cmdlines", &self.state_cmdlines)
            .finish_non_exhaustive()
    }
}

/// The router.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/state", get(state_doc))
        .layer(axum::middleware::from_fn(refuse_bodies))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES as usize))
        .with_state(state)
}

/// Refuses a request that announces a body over [`MAX_BODY_BYTES`] (or a chunked one, whose
/// size is unknown) before anything reads it, and closes the connection after answering.
async fn refuse_bodies(req: Request, next: Next) -> Response {
    let h = req.headers();
    let too_long = h
        .get(header::CONTENT_LENGTH)
        .map(|v| v.to_str().ok().and_then(|v| v.parse::<u64>().ok()))
        .is_some_and(|n| n.is_none_or(|n| n > MAX_BODY_BYTES));
    if too_long || h.contains_key(header::TRANSFER_ENCODING) {
        return (
            StatusCode::PAYLOAD_TOO_LARGE,
            [(header::CONNECTION, "close")],
            "request bodies are not accepted\n",
        )
            .into_response();
    }
    next.run(req).await
}

async fn metrics(State(s): State<AppState>) -> impl IntoResponse {
    let mut cache = s.metrics_cache.lock().unwrap_or_else(|e| e.into_inner());
    let body = match &*cache {
        Some((at, body)) if at.elapsed() < METRICS_MIN_INTERVAL => body.clone(),
        _ => {
            let body = Bytes::from(render_metrics(&s));
            *cache = Some((std::time::Instant::now(), body.clone()));
            body
        }
    };
    ([("content-type", "text/plain; version=0.0.4")], body)
}

/// The `/metrics` text: the recorder's series and the fractional-second counters, every
/// per-GPU series labelled with its GPU's UUID, what co-location earned, and (unless
/// `--metrics-without-pods`) `coloc_process_info` from the latest `/state` document.
pub fn render_metrics(s: &AppState) -> String {
    let text = s.prom.render() + &s.shared.render_seconds();
    let mut body = String::new();
    match s.shared.gpu_uuids.get() {
        Some(uuids) => crate::telemetry::label_gpus(&text, uuids, &mut body),
        None => body = text,
    }
    (s.shared.earned.lock().unwrap_or_else(|e| e.into_inner())).render(&mut body);
    if s.process_info {
        let doc = s.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        crate::telemetry::render_process_info(&doc, &mut body);
    }
    body
}

/// Liveness: `Ok` with a word, or why not (the control loop stalled).
pub fn live(s: &AppState) -> Result<&'static str, String> {
    let last = s.shared.last_tick_ns.load(Ordering::Relaxed);
    if !s.shared.ticked.load(Ordering::Relaxed) {
        return Ok("starting");
    }
    if now_ns().saturating_sub(last) > s.stall_ns {
        return Err("control loop stalled".into());
    }
    Ok("ok")
}

/// Readiness: `Ok`, or why not (not started, pod source not synced, degraded).
pub fn ready(s: &AppState) -> Result<&'static str, String> {
    if !s.shared.ticked.load(Ordering::Relaxed) {
        return Err("control loop not started".into());
    }
    if !s.source.ready() {
        return Err("pod source not synced".into());
    }
    if let Some(why) = s.shared.degraded() {
        return Err(why);
    }
    Ok("ready")
}

async fn healthz(State(s): State<AppState>) -> impl IntoResponse {
    match live(&s) {
        Ok(w) => (StatusCode::OK, format!("{w}\n")),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
    }
}

async fn readyz(State(s): State<AppState>) -> impl IntoResponse {
    match ready(&s) {
        Ok(w) => (StatusCode::OK, format!("{w}\n")),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
    }
}

/// Who sent a request (set by the server for each connection).
#[derive(Debug, Clone, Copy)]
pub struct Peer(pub std::net::SocketAddr);

/// Whether `/state` answers `peer`: loopback clients (`coloc-agent status` on the node or in
/// the agent's pod, `kubectl port-forward`) always; others only with `--state-public`. A
/// request without a known peer is refused unless public.
pub fn state_allowed(peer: Option<Peer>, public: bool) -> bool {
    public || peer.is_some_and(|p| p.0.ip().is_loopback() || is_mapped_loopback(p.0.ip()))
}

fn is_mapped_loopback(ip: std::net::IpAddr) -> bool {
    match ip {
        std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback()),
        std::net::IpAddr::V4(_) => false,
    }
}

async fn state_doc(State(s): State<AppState>, peer: Option<axum::Extension<Peer>>) -> Response {
    if !state_allowed(peer.map(|p| p.0), s.state_public) {
        // Every pod's processes and their activity to the millisecond: not for any client
        // that reaches the node's port.
        return (
            StatusCode::FORBIDDEN,
            "/state answers loopback clients only (coloc-agent status on the node or in the agent's pod, or kubectl port-forward); --state-public opens it\n",
        )
            .into_response();
    }
    let mut doc = s.shared.state();
    if !s.state_cmdlines {
        // Command lines carry secrets (`--token=…`) and the port is reachable by any pod.
        for g in &mut doc.gpus {
            for p in &mut g.processes {
                p.cmd.clear();
            }
        }
    }
    Json(doc).into_response()
}

pub mod health_file;
mod server;
pub use server::{serve, Limits};

#[cfg(test)]
mod tests;
