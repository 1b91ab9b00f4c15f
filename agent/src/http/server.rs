//! The server that bounds what clients can hold: timeouts, a connection limit with
//! eviction, byte tracking per connection.

use axum::Router;
use hyper_util::rt::TokioIo;
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

use super::*;

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
        let (tcp, peer) = match listener.accept().await {
            Ok((tcp, peer)) => (tcp, peer),
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
            peer,
            app.clone(),
            conn,
            next_id,
            open.clone(),
            clock,
            limits,
        ));
    }
}

#[allow(clippy::too_many_arguments)] // one connection's whole context, passed once
async fn serve_conn(
    tcp: TcpStream,
    peer: std::net::SocketAddr,
    app: Router,
    conn: Arc<Conn>,
    id: u64,
    open: Open,
    clock: Clock,
    limits: Limits,
) {
    let svc = {
        let conn = conn.clone();
        hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
            conn.on_request();
            req.extensions_mut().insert(super::Peer(peer));
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
