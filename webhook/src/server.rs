//! HTTPS wiring: routes, limits against slow or greedy clients, metrics, certificate
//! reload.
//!
//! May touch: one TCP listener; the certificate and key files (read, re-read on change).
//!
//! ## Limits ([`Limits`], flags in `main.rs`)
//!
//! A client that connects and then sends slowly, or not at all, must not hold memory or
//! connections for long:
//!
//! - **connections**: at most `max_connections` open at once; more are closed as they are
//!   accepted (before TLS). Accepted sockets get `TCP_NODELAY` (a review is one small
//!   request and one small response: no reason to wait for Nagle).
//! - **header read timeout**: the TLS handshake, and each request's headers (HTTP/1.1),
//!   must arrive within it. Hyper starts that clock when it begins waiting for a request,
//!   so an HTTP/1.1 keep-alive connection that sends nothing is closed after it too.
//! - **idle timeout**: a connection on which no byte moves either way for this long is
//!   closed (HTTP/2 connections, a client that completes TLS and then sends nothing).
//! - **body read timeout**: a review's body must arrive within it, counted from the end of
//!   its headers, however slowly bytes trickle in; else HTTP 408.
//! - **concurrent reviews**: at most `max_concurrent_reviews` bodies are read and reviewed
//!   at once; the others wait (within their body read timeout), else HTTP 503. This
//!   bounds the memory held by bodies to about `max_concurrent_reviews × max_body`.
//! - **body size**: a review larger than `max_body` is HTTP 413 (from its Content-Length
//!   before reading anything, or as soon as it is read past the limit).

use crate::review::{review, Mode};
use crate::translate::{Backend, Settings};
use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Limits on the HTTP server (module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// TLS handshake and HTTP/1.1 request headers.
    pub header_read_timeout: Duration,
    /// One review's body, from the end of its headers (waiting for a review slot included).
    pub body_read_timeout: Duration,
    /// No byte moving either way on a connection.
    pub idle_timeout: Duration,
    /// Connections open at once.
    pub max_connections: usize,
    /// Reviews read and handled at once.
    pub max_concurrent_reviews: usize,
    /// Largest review body, bytes.
    pub max_body: usize,
}

impl Default for Limits {
    /// The flags' defaults.
    fn default() -> Self {
        Limits {
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(120),
            max_connections: 256,
            max_concurrent_reviews: 8,
            max_body: 3 * 1024 * 1024,
        }
    }
}

/// Shared by the handlers.
#[derive(Clone)]
pub struct AppState {
    /// Translation settings.
    pub settings: Arc<Settings>,
    /// Limits (the handlers use the body ones).
    pub limits: Limits,
    /// Prometheus renderer (None: `/metrics` answers 404).
    pub prom: Option<PrometheusHandle>,
    reviews: Arc<Semaphore>,
}

impl AppState {
    /// State for [`router`].
    pub fn new(settings: Settings, limits: Limits, prom: Option<PrometheusHandle>) -> Self {
        AppState {
            settings: Arc::new(settings),
            limits,
            prom,
            reviews: Arc::new(Semaphore::new(limits.max_concurrent_reviews.max(1))),
        }
    }
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("settings", &self.settings)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

/// The router.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/mutate", post(mutate))
        .route("/validate", post(validate))
        .route("/unsupported-backend", post(unsupported))
        .route("/inject", post(inject))
        .route("/validate-mounts", post(validate_mounts))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(|| async { "ready\n" }))
        .route("/metrics", get(metrics))
        .with_state(state)
}

async fn mutate(
    State(s): State<AppState>,
    q: Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(s, Mode::Mutate, q, headers, body).await
}

async fn validate(
    State(s): State<AppState>,
    q: Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(s, Mode::Validate, q, headers, body).await
}

async fn unsupported(
    State(s): State<AppState>,
    q: Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(s, Mode::Unsupported, q, headers, body).await
}

async fn inject(
    State(s): State<AppState>,
    q: Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(s, Mode::Inject, q, headers, body).await
}

async fn validate_mounts(
    State(s): State<AppState>,
    q: Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(s, Mode::Mounts, q, headers, body).await
}

enum BodyError {
    TooLarge,
    Unreadable,
}

/// Reads `body`, at most `max` bytes.
async fn read_body(mut body: Body, max: usize, hint: usize) -> Result<Vec<u8>, BodyError> {
    use axum::body::HttpBody;
    let mut buf = Vec::with_capacity(hint.min(max));
    while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
        let frame = frame.map_err(|_| BodyError::Unreadable)?;
        if let Ok(data) = frame.into_data() {
            if buf.len() + data.len() > max {
                return Err(BodyError::TooLarge);
            }
            buf.extend_from_slice(&data);
        }
    }
    Ok(buf)
}

fn refuse(
    mode: Mode,
    t: Instant,
    status: StatusCode,
    limit: &'static str,
    msg: String,
) -> Response {
    count(mode, "invalid", None, t);
    metrics::counter!("coloc_webhook_limited_total", "limit" => limit).increment(1);
    (status, [("content-type", "text/plain")], msg).into_response()
}

async fn handle(
    s: AppState,
    mode: Mode,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let t = Instant::now();
    let l = s.limits;
    let declared = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > l.max_body as u64) {
        return refuse(
            mode,
            t,
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_size",
            format!("request body larger than {} bytes\n", l.max_body),
        );
    }
    let deadline = tokio::time::Instant::from_std(t) + l.body_read_timeout;
    // Bodies are read only with a slot: memory held by bodies stays bounded.
    let _slot = match tokio::time::timeout_at(deadline, s.reviews.clone().acquire_owned()).await {
        Ok(Ok(p)) => p,
        _ => {
            return refuse(
                mode,
                t,
                StatusCode::SERVICE_UNAVAILABLE,
                "reviews",
                format!(
                    "more than {} reviews in flight for {:?}\n",
                    l.max_concurrent_reviews, l.body_read_timeout
                ),
            )
        }
    };
    let hint = declared.unwrap_or(0) as usize;
    let bytes = match tokio::time::timeout_at(deadline, read_body(body, l.max_body, hint)).await {
        Ok(Ok(b)) => b,
        Ok(Err(BodyError::TooLarge)) => {
            return refuse(
                mode,
                t,
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_size",
                format!("request body larger than {} bytes\n", l.max_body),
            )
        }
        Ok(Err(BodyError::Unreadable)) => {
            count(mode, "invalid", None, t);
            return (StatusCode::BAD_REQUEST, "request body unreadable\n").into_response();
        }
        Err(_) => {
            return refuse(
                mode,
                t,
                StatusCode::REQUEST_TIMEOUT,
                "body_timeout",
                format!(
                    "request body not received within {:?}\n",
                    l.body_read_timeout
                ),
            )
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
    describe_counter!(
        "coloc_webhook_limited_total",
        "Requests and connections refused or closed by a limit: connections (too many open), idle, body_timeout (408), body_size (413), reviews (503)."
    );
    // Every bounded label value at 0 from the start, so that `increase()` and `rate()` see
    // the first event (a series born at its first increment has no earlier sample).
    for mode in [
        Mode::Mutate,
        Mode::Validate,
        Mode::Unsupported,
        Mode::Inject,
        Mode::Mounts,
    ] {
        for result in ["allowed", "patched", "denied", "invalid"] {
            metrics::counter!("coloc_webhook_admissions_total", "endpoint" => mode.as_str(), "result" => result).increment(0);
        }
        for reason in crate::translate::DENIAL_REASONS {
            metrics::counter!("coloc_webhook_denials_total", "endpoint" => mode.as_str(), "reason" => *reason).increment(0);
        }
    }
    for limit in [
        "connections",
        "idle",
        "body_timeout",
        "body_size",
        "reviews",
    ] {
        metrics::counter!("coloc_webhook_limited_total", "limit" => limit).increment(0);
    }
    Ok(h)
}

/// An accepted connection: counts against `max_connections` while open, and fails with
/// `TimedOut` once no byte has moved either way for the idle timeout while it waits.
#[derive(Debug)]
struct LimitedStream {
    inner: TcpStream,
    idle: Duration,
    last: tokio::time::Instant,
    timer: Pin<Box<tokio::time::Sleep>>,
    _slot: OwnedSemaphorePermit,
}

impl LimitedStream {
    fn progress(&mut self) {
        self.last = tokio::time::Instant::now();
    }

    /// Called when the socket is not ready: has the connection been idle too long?
    fn idle_expired(&mut self, cx: &mut Context<'_>) -> bool {
        let deadline = self.last + self.idle;
        if self.timer.deadline() != deadline {
            self.timer.as_mut().reset(deadline);
        }
        if self.timer.as_mut().poll(cx).is_ready() {
            metrics::counter!("coloc_webhook_limited_total", "limit" => "idle").increment(1);
            return true;
        }
        false
    }

    fn timed_out() -> io::Error {
        io::Error::new(io::ErrorKind::TimedOut, "connection idle")
    }
}

impl AsyncRead for LimitedStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(r) => {
                if buf.filled().len() > before {
                    this.progress();
                }
                Poll::Ready(r)
            }
            Poll::Pending if this.idle_expired(cx) => Poll::Ready(Err(Self::timed_out())),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncWrite for LimitedStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_write(cx, buf) {
            Poll::Ready(r) => {
                if matches!(r, Ok(n) if n > 0) {
                    this.progress();
                }
                Poll::Ready(r)
            }
            Poll::Pending if this.idle_expired(cx) => Poll::Ready(Err(Self::timed_out())),
            Poll::Pending => Poll::Pending,
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_write_vectored(cx, bufs) {
            Poll::Ready(r) => {
                if matches!(r, Ok(n) if n > 0) {
                    this.progress();
                }
                Poll::Ready(r)
            }
            Poll::Pending if this.idle_expired(cx) => Poll::Ready(Err(Self::timed_out())),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_flush(cx) {
            Poll::Pending if this.idle_expired(cx) => Poll::Ready(Err(Self::timed_out())),
            other => other,
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// Accepts a TCP connection if a connection slot is free: `TCP_NODELAY`, idle timeout.
/// Without a slot the connection is closed at once.
#[derive(Debug, Clone)]
struct LimitAcceptor {
    slots: Arc<Semaphore>,
    idle: Duration,
}

impl<S> axum_server::accept::Accept<TcpStream, S> for LimitAcceptor {
    type Stream = LimitedStream;
    type Service = S;
    type Future = std::future::Ready<io::Result<(LimitedStream, S)>>;

    fn accept(&self, stream: TcpStream, service: S) -> Self::Future {
        std::future::ready(match self.slots.clone().try_acquire_owned() {
            Err(_) => {
                metrics::counter!("coloc_webhook_limited_total", "limit" => "connections")
                    .increment(1);
                Err(io::Error::other("too many connections"))
            }
            Ok(slot) => stream.set_nodelay(true).map(|()| {
                let now = tokio::time::Instant::now();
                let stream = LimitedStream {
                    inner: stream,
                    idle: self.idle,
                    last: now,
                    timer: Box::pin(tokio::time::sleep_until(now + self.idle)),
                    _slot: slot,
                };
                (stream, service)
            }),
        })
    }
}

fn configure(
    builder: &mut hyper_util::server::conn::auto::Builder<hyper_util::rt::TokioExecutor>,
    l: &Limits,
) {
    builder
        .http1()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(l.header_read_timeout)
        // Headers and read buffering: an AdmissionReview request has a handful of headers.
        .max_buf_size(64 * 1024);
    builder
        .http2()
        .timer(hyper_util::rt::TokioTimer::new())
        .max_concurrent_streams(
            u32::try_from(l.max_concurrent_reviews.max(1))
                .unwrap_or(u32::MAX)
                .saturating_mul(4),
        )
        .max_header_list_size(64 * 1024);
}

/// Serves `app` on `listener` with `limits`: HTTPS when `tls` is given, else plain HTTP
/// (local testing). `handle` allows a caller to shut the server down.
pub async fn serve(
    listener: std::net::TcpListener,
    app: Router,
    tls: Option<axum_server::tls_rustls::RustlsConfig>,
    limits: Limits,
    handle: axum_server::Handle<SocketAddr>,
) -> io::Result<()> {
    listener.set_nonblocking(true)?;
    let acceptor = LimitAcceptor {
        slots: Arc::new(Semaphore::new(limits.max_connections.max(1))),
        idle: limits.idle_timeout,
    };
    let make = app.into_make_service();
    match tls {
        Some(tls) => {
            let tls = axum_server::tls_rustls::RustlsAcceptor::new(tls)
                .handshake_timeout(limits.header_read_timeout)
                .acceptor(acceptor);
            let mut server = axum_server::from_tcp(listener)?
                .acceptor(tls)
                .handle(handle);
            configure(server.http_builder(), &limits);
            server.serve(make).await
        }
        None => {
            let mut server = axum_server::from_tcp(listener)?
                .acceptor(acceptor)
                .handle(handle);
            configure(server.http_builder(), &limits);
            server.serve(make).await
        }
    }
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
