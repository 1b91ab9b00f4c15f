//! HTTPS wiring: routes, body limit, metrics, certificate reload.
//!
//! May touch: one TCP listener; the certificate and key files (read, re-read on change).

use crate::review::{review, Mode};
use crate::translate::{Backend, Settings};
use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

/// Shared by the handlers.
#[derive(Clone)]
pub struct AppState {
    /// Translation settings.
    pub settings: Arc<Settings>,
    /// Largest request body accepted.
    pub max_body: usize,
    /// Prometheus renderer (None: `/metrics` answers 404).
    pub prom: Option<PrometheusHandle>,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

/// The router.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/mutate", post(mutate))
        .route("/validate", post(validate))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(|| async { "ready\n" }))
        .route("/metrics", get(metrics))
        .with_state(state)
}

async fn mutate(
    State(s): State<AppState>,
    q: Query<HashMap<String, String>>,
    body: Body,
) -> Response {
    handle(s, Mode::Mutate, q, body).await
}

async fn validate(
    State(s): State<AppState>,
    q: Query<HashMap<String, String>>,
    body: Body,
) -> Response {
    handle(s, Mode::Validate, q, body).await
}

async fn handle(
    s: AppState,
    mode: Mode,
    Query(q): Query<HashMap<String, String>>,
    body: Body,
) -> Response {
    let t = Instant::now();
    let bytes: Bytes = match axum::body::to_bytes(body, s.max_body).await {
        Ok(b) => b,
        Err(_) => {
            count(mode, "invalid", None, t);
            return (
                StatusCode::BAD_REQUEST,
                format!(
                    "request body larger than {} bytes or unreadable\n",
                    s.max_body
                ),
            )
                .into_response();
        }
    };
    // The backend may be chosen per namespace: the webhook configuration sends namespaces
    // labelled gpu-coloc.dev/backend=X to /mutate?backend=X.
    let backend = match q.get("backend").map(|b| b.parse::<Backend>()) {
        None => None,
        Some(Ok(b)) => Some(b),
        Some(Err(e)) => {
            count(mode, "invalid", None, t);
            return (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response();
        }
    };
    let settings = s.settings.clone();
    let r = review(&bytes, mode, backend, &settings);
    count(mode, r.result, r.reason, t);
    let status = StatusCode::from_u16(r.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let ctype = if r.status == 200 {
        "application/json"
    } else {
        "text/plain"
    };
    (status, [("content-type", ctype)], r.body).into_response()
}

fn count(mode: Mode, result: &'static str, reason: Option<&'static str>, t: Instant) {
    metrics::counter!("coloc_webhook_admissions_total", "endpoint" => mode.as_str(), "result" => result).increment(1);
    if let Some(reason) = reason {
        metrics::counter!("coloc_webhook_denials_total", "endpoint" => mode.as_str(), "reason" => reason).increment(1);
    }
    metrics::histogram!("coloc_webhook_review_duration_seconds", "endpoint" => mode.as_str())
        .record(t.elapsed().as_secs_f64());
}

async fn metrics(State(s): State<AppState>) -> Response {
    match &s.prom {
        Some(p) => ([("content-type", "text/plain; version=0.0.4")], p.render()).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

/// Installs the Prometheus recorder with help text for the webhook's metrics.
pub fn install_metrics() -> anyhow::Result<PrometheusHandle> {
    use metrics::{describe_counter, describe_histogram, Unit};
    let h = metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Suffix("_seconds".into()),
            &[
                0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                1.0,
            ],
        )?
        .install_recorder()?;
    describe_counter!(
        "coloc_webhook_admissions_total",
        "Admission reviews handled, by endpoint and result (allowed, patched, denied, invalid)."
    );
    describe_counter!(
        "coloc_webhook_denials_total",
        "Admission reviews denied, by endpoint and bounded reason."
    );
    describe_histogram!(
        "coloc_webhook_review_duration_seconds",
        Unit::Seconds,
        "Time to handle one admission review, body read included."
    );
    Ok(h)
}

fn mtimes(cert: &Path, key: &Path) -> (Option<SystemTime>, Option<SystemTime>) {
    let m = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    (m(cert), m(key))
}

/// Re-reads the certificate and key whenever either file changes (cert-manager rotates
/// them in place). Connections in flight keep the old configuration; new handshakes get
/// the new one. A bad new pair is logged and the old one kept.
pub async fn reload_certificates(
    config: axum_server::tls_rustls::RustlsConfig,
    cert: PathBuf,
    key: PathBuf,
    every: Duration,
) {
    let mut seen = mtimes(&cert, &key);
    loop {
        tokio::time::sleep(every).await;
        let now = mtimes(&cert, &key);
        if now == seen {
            continue;
        }
        match config.reload_from_pem_file(&cert, &key).await {
            Ok(()) => {
                tracing::info!(cert = %cert.display(), "Reloaded TLS certificate");
                seen = now;
            }
            Err(error) => {
                tracing::error!(%error, cert = %cert.display(), "New TLS certificate unusable; keeping the old one")
            }
        }
    }
}
