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
use hyper_util::rt::TokioIo;
use metrics_exporter_prometheus::PrometheusHandle;
use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tower::ServiceExt;
use tracing::{debug, warn};

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
            let body = Bytes::from(s.prom.render() + &s.shared.render_seconds());
            *cache = Some((std::time::Instant::now(), body.clone()));
            body
        }
    };
    ([("content-type", "text/plain; version=0.0.4")], body)
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
    let mut doc = s.shared.state();
    if !s.state_cmdlines {
        // Command lines carry secrets (`--token=…`) and the port is reachable by any pod.
        for g in &mut doc.gpus {
            for p in &mut g.processes {
                p.cmd.clear();
            }
        }
    }
    Json(doc)
}

/// Bounds on what HTTP clients can hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// A request head must be complete this long after the accept (or after the first byte
    /// of a following request).
    pub header_timeout: Duration,
    /// A connection that moves no byte for this long is closed.
    pub idle_timeout: Duration,
    /// Open connections at most.
    pub max_connections: usize,
}

/// Why the server closed a connection (the `reason` of
/// `coloc_http_connections_closed_total`).
const CLOSE_REASONS: &[&str] = &["header_timeout", "idle_timeout", "evicted"];

fn describe() {
    metrics::describe_counter!(
        "coloc_http_connections_closed_total",
        "HTTP connections the agent closed: header_timeout (no complete request head in time), idle_timeout (no byte moved in time), evicted (at --http-max-connections, for a newer connection)."
    );
    metrics::describe_gauge!(
        "coloc_http_open_connections",
        "HTTP connections open on the agent's port."
    );
    for reason in CLOSE_REASONS {
        metrics::counter!("coloc_http_connections_closed_total", "reason" => *reason).increment(0);
    }
}

/// Microseconds since the server started, plus one (0 means "none").
#[derive(Debug, Clone, Copy)]
struct Clock(tokio::time::Instant);

impl Clock {
    fn now(&self) -> u64 {
        self.0.elapsed().as_micros() as u64 + 1
    }
    fn at(&self, us: u64) -> tokio::time::Instant {
        self.0 + Duration::from_micros(us.saturating_sub(1))
    }
}

/// One open connection, as its task, its I/O and the accept loop see it.
#[derive(Debug)]
struct Conn {
    /// Latest byte read or written ([`Clock`] µs).
    last_io: AtomicU64,
    /// When the current request head started (the accept, or the first byte after the
    /// previous request); 0 while none is being read.
    head_since: AtomicU64,
    /// Set to close the connection now.
    evict: Notify,
}

impl Conn {
    fn new(now: u64) -> Conn {
        Conn {
            last_io: AtomicU64::new(now),
            head_since: AtomicU64::new(now),
            evict: Notify::new(),
        }
    }

    fn on_io(&self, now: u64, read: bool) {
        self.last_io.store(now, Ordering::Relaxed);
        if read && self.head_since.load(Ordering::Relaxed) == 0 {
            self.head_since.store(now, Ordering::Relaxed);
        }
    }

    fn on_request(&self) {
        self.head_since.store(0, Ordering::Relaxed);
    }

    fn reading_head(&self) -> bool {
        self.head_since.load(Ordering::Relaxed) != 0
    }

    /// When the connection expires, and why.
    fn expiry(&self, lim: &Limits) -> (u64, &'static str) {
        let idle = self.last_io.load(Ordering::Relaxed) + lim.idle_timeout.as_micros() as u64;
        match self.head_since.load(Ordering::Relaxed) {
            0 => (idle, "idle_timeout"),
            since => {
                let head = since + lim.header_timeout.as_micros() as u64;
                if head <= idle {
                    (head, "header_timeout")
                } else {
                    (idle, "idle_timeout")
                }
            }
        }
    }
}

/// A TCP stream that tells its [`Conn`] when bytes move.
struct Tracked {
    io: TcpStream,
    conn: Arc<Conn>,
    clock: Clock,
}

impl AsyncRead for Tracked {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let me = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut me.io).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            me.conn.on_io(me.clock.now(), true);
        }
        r
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let me = self.get_mut();
        let r = Pin::new(&mut me.io).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            me.conn.on_io(me.clock.now(), false);
        }
        r
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let me = self.get_mut();
        let r = Pin::new(&mut me.io).poll_write_vectored(cx, bufs);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            me.conn.on_io(me.clock.now(), false);
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

type Open = Arc<Mutex<BTreeMap<u64, Arc<Conn>>>>;

fn lock(open: &Open) -> std::sync::MutexGuard<'_, BTreeMap<u64, Arc<Conn>>> {
    open.lock().unwrap_or_else(|e| e.into_inner())
}

/// Serves `app` on `listener` within `limits` (HTTP/1.1, TCP_NODELAY), until the runtime
/// stops.
pub async fn serve(listener: TcpListener, app: Router, limits: Limits) {
    describe();
    let clock = Clock(tokio::time::Instant::now());
    let open: Open = Arc::default();
    let open_gauge = metrics::gauge!("coloc_http_open_connections");
    let mut next_id = 0u64;
    let mut warned: Option<tokio::time::Instant> = None;
    loop {
        let tcp = match listener.accept().await {
            Ok((tcp, _)) => tcp,
            Err(err) => {
                // Out of file descriptors, an aborted handshake: wait a little, never spin.
                if warned.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
                    warn!(%err, "HTTP accept failed (further failures within 10 s not logged)");
                    warned = Some(tokio::time::Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        if let Err(err) = tcp.set_nodelay(true) {
            debug!(%err, "TCP_NODELAY");
        }
        next_id += 1;
        let conn = Arc::new(Conn::new(clock.now()));
        {
            let mut map = lock(&open);
            while map.len() >= limits.max_connections.max(1) {
                let victim = map
                    .iter()
                    .find(|(_, c)| c.reading_head())
                    .or_else(|| map.iter().next())
                    .map(|(id, _)| *id);
                let Some(c) = victim.and_then(|id| map.remove(&id)) else {
                    break;
                };
                c.evict.notify_one();
                metrics::counter!("coloc_http_connections_closed_total", "reason" => "evicted")
                    .increment(1);
            }
            map.insert(next_id, conn.clone());
            open_gauge.set(map.len() as f64);
        }
        tokio::spawn(serve_conn(
            tcp,
            app.clone(),
            conn,
            next_id,
            open.clone(),
            clock,
            limits,
        ));
    }
}

async fn serve_conn(
    tcp: TcpStream,
    app: Router,
    conn: Arc<Conn>,
    id: u64,
    open: Open,
    clock: Clock,
    limits: Limits,
) {
    let svc = {
        let conn = conn.clone();
        hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
            conn.on_request();
            app.clone().oneshot(req)
        })
    };
    let io = TokioIo::new(Tracked {
        io: tcp,
        conn: conn.clone(),
        clock,
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.keep_alive(true).max_buf_size(MAX_HEAD_BYTES);
    let http = builder.serve_connection(io, svc);
    tokio::pin!(http);
    let closed = loop {
        let (deadline, _) = conn.expiry(&limits);
        tokio::select! {
            res = &mut http => {
                if let Err(err) = res {
                    debug!(%err, "HTTP connection ended");
                }
                break None;
            }
            _ = conn.evict.notified() => break None, // counted by the accept loop
            _ = tokio::time::sleep_until(clock.at(deadline)) => {
                let (deadline, why) = conn.expiry(&limits);
                if clock.now() >= deadline {
                    break Some(why);
                }
            }
        }
    };
    if let Some(why) = closed {
        metrics::counter!("coloc_http_connections_closed_total", "reason" => why).increment(1);
    }
    let mut map = lock(&open);
    map.remove(&id);
    metrics::gauge!("coloc_http_open_connections").set(map.len() as f64);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::state::{GpuDoc, ProcDoc, StateDoc};
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpStream};
    use std::time::Instant;

    struct Server {
        addr: SocketAddr,
        _rt: tokio::runtime::Runtime,
    }

    fn start(limits: Limits, state_cmdlines: bool) -> Server {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let listener = rt.block_on(TcpListener::bind("127.0.0.1:0")).unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared::default());
        *shared.state.lock().unwrap() = StateDoc {
            gpus: vec![GpuDoc {
                processes: vec![ProcDoc {
                    pid: 7,
                    class: qos_core::Class::Offline,
                    owner: "rule:off".into(),
                    cmd: "train.py --token=s3cret".into(),
                    suspended: false,
                    actuator: None,
                    last_active_ms_ago: None,
                }],
                ..Default::default()
            }],
            ..Default::default()
        };
        let app = router(AppState {
            shared,
            prom: metrics_exporter_prometheus::PrometheusBuilder::new()
                .build_recorder()
                .handle(),
            source: Arc::new(crate::edges::fake::FakeSource::default()),
            stall_ns: u64::MAX,
            state_cmdlines,
            metrics_cache: Arc::default(),
        });
        rt.spawn(serve(listener, app, limits));
        Server { addr, _rt: rt }
    }

    fn limits(header_ms: u64, idle_ms: u64, max: usize) -> Limits {
        Limits {
            header_timeout: Duration::from_millis(header_ms),
            idle_timeout: Duration::from_millis(idle_ms),
            max_connections: max,
        }
    }

    fn connect(s: &Server, send: &str) -> TcpStream {
        let mut c = TcpStream::connect(s.addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        c.write_all(send.as_bytes()).unwrap();
        c
    }

    /// Reads until the server closes the connection; how long that took.
    fn closed_after(c: &mut TcpStream, t: Instant) -> Duration {
        let mut buf = [0u8; 4096];
        loop {
            match c.read(&mut buf) {
                Ok(0) => return t.elapsed(),
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return t.elapsed(),
                Err(e) => panic!("connection not closed after {:?}: {e}", t.elapsed()),
            }
        }
    }

    /// One response (status, body) read off a kept-alive connection.
    fn response(c: &mut TcpStream) -> (u16, String) {
        let mut buf = Vec::new();
        let mut b = [0u8; 1];
        while !buf.ends_with(b"\r\n\r\n") {
            assert_eq!(c.read(&mut b).unwrap(), 1, "closed mid-head");
            buf.push(b[0]);
        }
        let head = String::from_utf8(buf).unwrap();
        let len: usize = head
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-length: ")
                    .map(|v| v.trim().parse().unwrap())
            })
            .unwrap_or(0);
        let mut body = vec![0u8; len];
        c.read_exact(&mut body).unwrap();
        let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
        (status, String::from_utf8(body).unwrap())
    }

    fn get(s: &Server, path: &str) -> (u16, String) {
        let mut c = connect(s, &format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n"));
        response(&mut c)
    }

    #[test]
    fn half_sent_request_is_closed_after_the_header_timeout() {
        let s = start(limits(300, 10_000, 64), false);
        let t = Instant::now();
        let mut c = connect(&s, "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ");
        // Trickling bytes does not extend it.
        for _ in 0..3 {
            std::thread::sleep(Duration::from_millis(50));
            c.write_all(b"a").unwrap();
        }
        let took = closed_after(&mut c, t);
        assert!(
            took >= Duration::from_millis(250) && took < Duration::from_secs(2),
            "{took:?}"
        );
        // A silent connection too.
        let t = Instant::now();
        let mut c = connect(&s, "");
        let took = closed_after(&mut c, t);
        assert!(
            took >= Duration::from_millis(250) && took < Duration::from_secs(2),
            "{took:?}"
        );
    }

    #[test]
    fn kept_alive_connection_is_closed_after_the_idle_timeout() {
        let s = start(limits(200, 600, 64), false);
        let mut c = connect(&s, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
        assert_eq!(response(&mut c).0, 200);
        // Waiting for the next request is idle time, not header time: 400 ms > 200 ms.
        std::thread::sleep(Duration::from_millis(400));
        c.write_all(b"GET /state HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        assert_eq!(response(&mut c).0, 200);
        let t = Instant::now();
        let took = closed_after(&mut c, t);
        assert!(
            took >= Duration::from_millis(500) && took < Duration::from_secs(3),
            "{took:?}"
        );
    }

    #[test]
    fn at_the_limit_the_oldest_half_sent_connection_makes_room() {
        let s = start(limits(10_000, 10_000, 2), false);
        // A kept-alive connection that has been served, then two half-sent ones.
        let mut served = connect(&s, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
        assert_eq!(response(&mut served).0, 200);
        let mut half = connect(&s, "GET /healthz HTTP/1.1\r\n");
        std::thread::sleep(Duration::from_millis(50));
        // Both slots taken: the newcomer evicts a connection that is still reading its head
        // (the served one is older, but it sent a whole request).
        let t = Instant::now();
        assert_eq!(get(&s, "/healthz").0, 200);
        assert!(closed_after(&mut half, t) < Duration::from_secs(2));
        // A hundred more: served without waiting for any timeout.
        let mut flood: Vec<TcpStream> = (0..100).map(|_| connect(&s, "GET /")).collect();
        let t = Instant::now();
        assert_eq!(get(&s, "/healthz").0, 200);
        assert!(t.elapsed() < Duration::from_secs(2));
        for c in flood.iter_mut().take(50) {
            assert!(closed_after(c, t) < Duration::from_secs(2));
        }
        drop(served);
    }

    #[test]
    fn bodies_and_large_heads_are_refused() {
        let s = start(limits(2_000, 2_000, 64), false);
        let mut c = connect(
            &s,
            "GET /state HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n",
        );
        assert_eq!(response(&mut c).0, 413);
        assert!(closed_after(&mut c, Instant::now()) < Duration::from_secs(1));
        let mut c = connect(
            &s,
            "GET /state HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
        );
        assert_eq!(response(&mut c).0, 413);
        let big = format!(
            "GET /state HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
            "a".repeat(64 * 1024)
        );
        let mut c = TcpStream::connect(s.addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let _ = c.write_all(big.as_bytes()); // the server may close before it has read it all
        let mut text = String::new();
        let _ = c.read_to_string(&mut text);
        assert!(
            text.is_empty() || text.starts_with("HTTP/1.1 431"),
            "{text}"
        );
        // A small body is fine.
        let mut c = connect(
            &s,
            "GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi",
        );
        assert_eq!(response(&mut c).0, 200);
    }

    #[test]
    fn state_hides_command_lines_unless_asked() {
        let s = start(limits(2_000, 2_000, 64), false);
        let (code, body) = get(&s, "/state");
        assert_eq!(code, 200);
        assert!(!body.contains("s3cret"), "{body}");
        let doc: StateDoc = serde_json::from_str(&body).unwrap();
        assert_eq!(doc.gpus[0].processes[0].cmd, "");
        assert_eq!(doc.gpus[0].processes[0].owner, "rule:off");
        let s = start(limits(2_000, 2_000, 64), true);
        let doc: StateDoc = serde_json::from_str(&get(&s, "/state").1).unwrap();
        assert_eq!(doc.gpus[0].processes[0].cmd, "train.py --token=s3cret");
    }
}
