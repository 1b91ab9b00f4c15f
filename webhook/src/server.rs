//! HTTPS wiring: routes, limits against slow or greedy clients, metrics, certificate
//! reload.
//!
//! May touch: one TCP listener; the certificate and key files (read, re-read on change).
//!
//! ## Limits ([`Limits`], flags in `main.rs`)
//!
//! A client that connects and then sends slowly, or not at all, must not hold memory,
//! connections or review slots for long, nor keep the API server's reviews out. Tenants'
//! pods can usually reach the webhook's port (the chart's NetworkPolicy narrows that
//! where the CNI enforces it), so these hold without it:
//!
//! - **connections**: at most `max_connections` open at once, and at most
//!   `max_connections_per_source` from one source address; a connection over the
//!   per-source limit is closed as it is accepted (before TLS). When all
//!   `max_connections` are open, a new connection **evicts** the one on which bytes moved
//!   least recently (an idle keep-alive, a silent or stalled client) instead of being
//!   refused: one source, or a few, cannot hold the listener. Accepted sockets get
//!   `TCP_NODELAY` (a review is one small request and one small response).
//! - **header read timeout**: the TLS handshake, and each request's headers (HTTP/1.1),
//!   must arrive within it. Hyper starts that clock when it begins waiting for a request,
//!   so an HTTP/1.1 keep-alive connection that sends nothing is closed after it too.
//! - **idle timeout**: a connection on which no byte moves either way for this long is
//!   closed (HTTP/2 connections, a client that completes TLS and then sends nothing).
//! - **body read timeout**: a review's body must arrive within it, counted from the end of
//!   its headers, however slowly bytes trickle in; else HTTP 408.
//! - **body memory**: bodies being read hold at most `max_concurrent_reviews × max_body`
//!   bytes together; a chunk that would go past it is HTTP 503. A half-sent body holds
//!   only what it has sent.
//! - **concurrent reviews**: at most `max_concurrent_reviews` reviews are handled at once.
//!   A review takes its slot only once its body has fully arrived, so bodies that never
//!   finish hold no slot; a review that waits for one past its body read timeout is
//!   HTTP 503.
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
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::sync::Mutex;
use std::task::Waker;
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
    /// Connections open at once (more evict the least recently active).
    pub max_connections: usize,
    /// Connections open at once from one source address (more are closed at once).
    pub max_connections_per_source: usize,
    /// Reviews read and handled at once.
    pub max_concurrent_reviews: usize,
    /// Largest review body, bytes.
    pub max_body: usize,
}

impl Default for Limits {
    /// The flags' defaults.
    fn default() -> Self {
        Limits {
            header_read_timeout: Duration::from_secs(3),
            body_read_timeout: Duration::from_secs(3),
            idle_timeout: Duration::from_secs(120),
            max_connections: 256,
            max_connections_per_source: 32,
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
    /// Bytes of bodies being read, all reviews together.
    body_bytes: Arc<Semaphore>,
}

impl AppState {
    /// State for [`router`].
    pub fn new(settings: Settings, limits: Limits, prom: Option<PrometheusHandle>) -> Self {
        AppState {
            settings: Arc::new(settings),
            limits,
            prom,
            reviews: Arc::new(Semaphore::new(limits.max_concurrent_reviews.max(1))),
            body_bytes: Arc::new(Semaphore::new(body_budget(&limits) as usize)),
        }
    }
}

/// Bytes all bodies being read may hold together: `max_concurrent_reviews × max_body`
/// (what the slots bounded when a body was read only with one), as semaphore permits.
fn body_budget(l: &Limits) -> u32 {
    let b = l
        .max_concurrent_reviews
        .max(1)
        .saturating_mul(l.max_body.max(1));
    u32::try_from(b).unwrap_or(u32::MAX)
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
    NoMemory,
}

/// Reads `body`, at most `max` bytes, each chunk taken from `budget` (held until the
/// returned permit is dropped).
async fn read_body(
    mut body: Body,
    max: usize,
    hint: usize,
    budget: &Arc<Semaphore>,
) -> Result<(Vec<u8>, Option<OwnedSemaphorePermit>), BodyError> {
    use axum::body::HttpBody;
    let mut buf = Vec::with_capacity(hint.min(max).min(64 * 1024));
    let mut held: Option<OwnedSemaphorePermit> = None;
    while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
        let frame = frame.map_err(|_| BodyError::Unreadable)?;
        if let Ok(data) = frame.into_data() {
            if buf.len() + data.len() > max {
                return Err(BodyError::TooLarge);
            }
            let n = u32::try_from(data.len()).map_err(|_| BodyError::TooLarge)?;
            if n > 0 {
                let p = budget
                    .clone()
                    .try_acquire_many_owned(n)
                    .map_err(|_| BodyError::NoMemory)?;
                match &mut held {
                    Some(h) => h.merge(p),
                    None => held = Some(p),
                }
            }
            buf.extend_from_slice(&data);
        }
    }
    Ok((buf, held))
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
    let hint = declared.unwrap_or(0) as usize;
    // The body first, without a slot: a body that never finishes holds none.
    let (bytes, _memory) =
        match tokio::time::timeout_at(deadline, read_body(body, l.max_body, hint, &s.body_bytes))
            .await
        {
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
            Ok(Err(BodyError::NoMemory)) => {
                return refuse(
                    mode,
                    t,
                    StatusCode::SERVICE_UNAVAILABLE,
                    "body_memory",
                    format!(
                        "more than {} bytes of request bodies in flight\n",
                        body_budget(&l)
                    ),
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
    // Then a slot, to review it.
    let slot_deadline = tokio::time::Instant::now() + l.body_read_timeout;
    let _slot =
        match tokio::time::timeout_at(slot_deadline, s.reviews.clone().acquire_owned()).await {
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
        "Requests and connections refused or closed by a limit: connections (evicted: least recently active when all are open), source_connections (too many from one source), idle, body_timeout (408), body_size (413), body_memory (503), reviews (503)."
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
        "source_connections",
        "body_memory",
        "idle",
        "body_timeout",
        "body_size",
        "reviews",
    ] {
        metrics::counter!("coloc_webhook_limited_total", "limit" => limit).increment(0);
    }
    Ok(h)
}

/// One open connection, as the registry sees it.
#[derive(Debug)]
struct Conn {
    source: IpAddr,
    /// When bytes last moved, ms since the registry's start.
    last_ms: AtomicU64,
    /// Set when evicted: the stream fails at its next poll.
    evicted: AtomicBool,
    waker: Mutex<Option<Waker>>,
}

/// The open connections: per source, and by last activity.
#[derive(Debug)]
struct Registry {
    start: std::time::Instant,
    next: u64,
    conns: HashMap<u64, Arc<Conn>>,
    per_source: HashMap<IpAddr, usize>,
}

impl Registry {
    fn new() -> Self {
        Registry {
            start: std::time::Instant::now(),
            next: 0,
            conns: HashMap::new(),
            per_source: HashMap::new(),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn remove(&mut self, id: u64) {
        if let Some(c) = self.conns.remove(&id) {
            if let Some(n) = self.per_source.get_mut(&c.source) {
                *n -= 1;
                if *n == 0 {
                    self.per_source.remove(&c.source);
                }
            }
        }
    }

    /// Closes the connection on which bytes moved least recently.
    fn evict_one(&mut self) {
        let Some((&id, _)) = self
            .conns
            .iter()
            .min_by_key(|(_, c)| c.last_ms.load(Ordering::Relaxed))
        else {
            return;
        };
        if let Some(c) = self.conns.get(&id).cloned() {
            c.evicted.store(true, Ordering::SeqCst);
            let w = c.waker.lock().ok().and_then(|mut w| w.take());
            if let Some(w) = w {
                w.wake();
            }
        }
        self.remove(id);
        metrics::counter!("coloc_webhook_limited_total", "limit" => "connections").increment(1);
    }
}

/// An accepted connection: registered while open (per source, last activity), evicted on
/// demand, and fails with `TimedOut` once no byte has moved either way for the idle
/// timeout while it waits.
#[derive(Debug)]
struct LimitedStream {
    inner: TcpStream,
    idle: Duration,
    last: tokio::time::Instant,
    timer: Pin<Box<tokio::time::Sleep>>,
    id: u64,
    conn: Arc<Conn>,
    registry: Arc<Mutex<Registry>>,
}

impl Drop for LimitedStream {
    fn drop(&mut self) {
        if let Ok(mut r) = self.registry.lock() {
            r.remove(self.id);
        }
    }
}

impl LimitedStream {
    fn progress(&mut self) {
        self.last = tokio::time::Instant::now();
        if let Ok(r) = self.registry.lock() {
            self.conn.last_ms.store(r.now_ms(), Ordering::Relaxed);
        }
    }

    fn evicted(&self) -> bool {
        self.conn.evicted.load(Ordering::SeqCst)
    }

    /// Called when the socket is not ready: evicted meanwhile, or idle too long?
    fn should_close(&mut self, cx: &mut Context<'_>) -> bool {
        if let Ok(mut w) = self.conn.waker.lock() {
            *w = Some(cx.waker().clone());
        }
        if self.evicted() {
            return true;
        }
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

    fn closed(&self) -> io::Error {
        if self.evicted() {
            io::Error::new(io::ErrorKind::ConnectionAborted, "connection evicted")
        } else {
            io::Error::new(io::ErrorKind::TimedOut, "connection idle")
        }
    }
}

impl AsyncRead for LimitedStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.evicted() {
            return Poll::Ready(Err(this.closed()));
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(r) => {
                if buf.filled().len() > before {
                    this.progress();
                }
                Poll::Ready(r)
            }
            Poll::Pending if this.should_close(cx) => Poll::Ready(Err(this.closed())),
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
        if this.evicted() {
            return Poll::Ready(Err(this.closed()));
        }
        match Pin::new(&mut this.inner).poll_write(cx, buf) {
            Poll::Ready(r) => {
                if matches!(r, Ok(n) if n > 0) {
                    this.progress();
                }
                Poll::Ready(r)
            }
            Poll::Pending if this.should_close(cx) => Poll::Ready(Err(this.closed())),
            Poll::Pending => Poll::Pending,
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.evicted() {
            return Poll::Ready(Err(this.closed()));
        }
        match Pin::new(&mut this.inner).poll_write_vectored(cx, bufs) {
            Poll::Ready(r) => {
                if matches!(r, Ok(n) if n > 0) {
                    this.progress();
                }
                Poll::Ready(r)
            }
            Poll::Pending if this.should_close(cx) => Poll::Ready(Err(this.closed())),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_flush(cx) {
            Poll::Pending if this.should_close(cx) => Poll::Ready(Err(this.closed())),
            other => other,
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// Accepts a TCP connection: closed at once when its source has
/// `max_connections_per_source` open; when `max_connections` are open, the least
/// recently active one is evicted for it. `TCP_NODELAY`, idle timeout.
#[derive(Debug, Clone)]
struct LimitAcceptor {
    registry: Arc<Mutex<Registry>>,
    max: usize,
    per_source: usize,
    idle: Duration,
}

impl LimitAcceptor {
    fn admit(&self, stream: TcpStream) -> io::Result<LimitedStream> {
        let source = stream
            .peer_addr()
            .map(|a| a.ip().to_canonical())
            .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        let mut r = self
            .registry
            .lock()
            .map_err(|_| io::Error::other("connection registry poisoned"))?;
        if r.per_source.get(&source).copied().unwrap_or(0) >= self.per_source.max(1) {
            metrics::counter!("coloc_webhook_limited_total", "limit" => "source_connections")
                .increment(1);
            return Err(io::Error::other("too many connections from this source"));
        }
        while r.conns.len() >= self.max.max(1) {
            r.evict_one();
        }
        stream.set_nodelay(true)?;
        let id = r.next;
        r.next += 1;
        let conn = Arc::new(Conn {
            source,
            last_ms: AtomicU64::new(r.now_ms()),
            evicted: AtomicBool::new(false),
            waker: Mutex::new(None),
        });
        r.conns.insert(id, conn.clone());
        *r.per_source.entry(source).or_insert(0) += 1;
        drop(r);
        let now = tokio::time::Instant::now();
        Ok(LimitedStream {
            inner: stream,
            idle: self.idle,
            last: now,
            timer: Box::pin(tokio::time::sleep_until(now + self.idle)),
            id,
            conn,
            registry: self.registry.clone(),
        })
    }
}

impl<S> axum_server::accept::Accept<TcpStream, S> for LimitAcceptor {
    type Stream = LimitedStream;
    type Service = S;
    type Future = std::future::Ready<io::Result<(LimitedStream, S)>>;

    fn accept(&self, stream: TcpStream, service: S) -> Self::Future {
        std::future::ready(self.admit(stream).map(|s| (s, service)))
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
        registry: Arc::new(Mutex::new(Registry::new())),
        max: limits.max_connections,
        per_source: limits.max_connections_per_source,
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
