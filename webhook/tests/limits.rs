//! The HTTPS server's limits, in process on 127.0.0.1:0 (the same `server::serve` the
//! binary runs): slow and half-open clients are closed within their timeout while a normal
//! review still succeeds; a body over the limit is 413; connections over the limit are
//! closed at once. Every wait is bounded (socket read timeouts), so a regression fails in
//! seconds instead of hanging.

use coloc_webhook::server::{router, serve, AppState, Limits};
use coloc_webhook::translate::{Backend, Settings};
use rcgen::{CertificateParams, KeyPair};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

struct Server {
    port: u16,
    ca_der: Vec<u8>,
    handle: axum_server::Handle<std::net::SocketAddr>,
    _rt: tokio::runtime::Runtime,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.handle.shutdown();
    }
}

fn start(limits: Limits) -> Server {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let tls = rt
        .block_on(axum_server::tls_rustls::RustlsConfig::from_pem(
            cert.pem().into_bytes(),
            key.serialize_pem().into_bytes(),
        ))
        .unwrap();
    let app = router(AppState::new(Settings::new(Backend::Hami), limits, None));
    let handle = axum_server::Handle::new();
    rt.spawn(serve(listener, app, Some(tls), limits, handle.clone()));
    Server {
        port,
        ca_der: cert.der().to_vec(),
        handle,
        _rt: rt,
    }
}

type Tls = rustls::StreamOwned<rustls::ClientConnection, TcpStream>;

fn tcp(port: u16) -> TcpStream {
    let sock = TcpStream::connect(("127.0.0.1", port)).unwrap();
    // No wait below is unbounded.
    sock.set_read_timeout(Some(Duration::from_secs(8))).unwrap();
    sock.set_write_timeout(Some(Duration::from_secs(8)))
        .unwrap();
    sock
}

/// A TLS connection with the handshake done.
fn tls(s: &Server) -> Tls {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(rustls::pki_types::CertificateDer::from(s.ca_der.clone()))
        .unwrap();
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let conn = rustls::ClientConnection::new(Arc::new(cfg), name).unwrap();
    let mut t = rustls::StreamOwned::new(conn, tcp(s.port));
    while t.conn.is_handshaking() {
        t.conn.complete_io(&mut t.sock).unwrap();
    }
    t
}

/// Reads until the server closes the connection; returns what it sent and when it closed
/// (measured from `since`). Panics if it is still open after `bound`.
fn closed_within(r: &mut impl Read, since: Instant, bound: Duration) -> (String, Duration) {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match r.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                panic!("still open after {:?}", since.elapsed())
            }
            // Closed without close_notify, or reset: closed.
            Err(_) => break,
        }
        assert!(
            since.elapsed() < bound,
            "still open after {:?}",
            since.elapsed()
        );
    }
    let took = since.elapsed();
    assert!(took < bound, "closed only after {took:?} (bound {bound:?})");
    (String::from_utf8_lossy(&out).to_string(), took)
}

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(format!(
        "{}/tests/data/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap()
}

/// One complete review over a fresh connection.
fn review(s: &Server) -> (String, Duration) {
    let t = Instant::now();
    let body = fixture("offline-deployment-create");
    let mut c = tls(s);
    write!(c, "POST /mutate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len()).unwrap();
    c.write_all(&body).unwrap();
    c.flush().unwrap();
    closed_within(&mut c, t, Duration::from_secs(5))
}

fn status(response: &str) -> &str {
    response.split_whitespace().nth(1).unwrap_or("none")
}

#[test]
fn slow_and_half_open_clients_are_closed_while_reviews_go_on() {
    let limits = Limits {
        header_read_timeout: Duration::from_secs(1),
        body_read_timeout: Duration::from_secs(1),
        // Longer than the others, so that each closure is told apart by when it happens.
        idle_timeout: Duration::from_secs(3),
        max_connections: 128,
        // Every client here is 127.0.0.1.
        max_connections_per_source: 128,
        // More than the slow bodies below: they are not to starve the reviews (that
        // limit is checked in router.rs).
        max_concurrent_reviews: 32,
        max_body: 64 * 1024,
    };
    let s = Arc::new(start(limits));
    let (first, _) = review(&s);
    assert_eq!(status(&first), "200", "{first}");

    let slack = Duration::from_secs(1);
    let mut clients = Vec::new();
    let spawn = |clients: &mut Vec<std::thread::JoinHandle<(String, String, Duration)>>,
                 kind: &'static str,
                 f: fn(&Server) -> (String, Duration)| {
        let s = s.clone();
        clients.push(std::thread::spawn(move || {
            let (out, took) = f(&s);
            (kind.to_string(), out, took)
        }));
    };
    for _ in 0..8 {
        // TCP only: never starts TLS. Closed by the handshake timeout (header timeout).
        spawn(&mut clients, "no-tls", |s| {
            let t = Instant::now();
            closed_within(&mut tcp(s.port), t, Duration::from_secs(2))
        });
        // TLS, then nothing: closed by the idle timeout.
        spawn(&mut clients, "tls-silent", |s| {
            let mut c = tls(s);
            let t = Instant::now();
            closed_within(&mut c, t, Duration::from_secs(4))
        });
        // Headers never finished: closed by the header read timeout.
        spawn(&mut clients, "half-headers", |s| {
            let mut c = tls(s);
            let t = Instant::now();
            c.write_all(b"POST /mutate HTTP/1.1\r\nHost: localhost\r\nContent-Type: appl")
                .unwrap();
            c.flush().unwrap();
            closed_within(&mut c, t, Duration::from_secs(2))
        });
        // A body that stops: 408 after the body read timeout.
        spawn(&mut clients, "body-stalls", |s| {
            let mut c = tls(s);
            let t = Instant::now();
            c.write_all(b"POST /mutate HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1000\r\n\r\n{\"apiVersi")
                .unwrap();
            c.flush().unwrap();
            closed_within(&mut c, t, Duration::from_secs(2))
        });
    }
    for _ in 0..4 {
        // A body that trickles, one byte every 100 ms: still 408 after the body read
        // timeout, however steadily it sends.
        spawn(&mut clients, "body-trickles", |s| {
            let mut c = tls(s);
            c.sock
                .set_read_timeout(Some(Duration::from_millis(100)))
                .unwrap();
            let t = Instant::now();
            c.write_all(
                b"POST /mutate HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1000\r\n\r\n",
            )
            .unwrap();
            c.flush().unwrap();
            let bound = Duration::from_secs(2);
            let mut out = Vec::new();
            let mut buf = [0u8; 4096];
            loop {
                assert!(t.elapsed() < bound, "still open after {:?}", t.elapsed());
                if c.write_all(b" ").and_then(|()| c.flush()).is_err() {
                    break;
                }
                match c.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => out.extend_from_slice(&buf[..n]),
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                        ) => {}
                    Err(_) => break,
                }
            }
            (String::from_utf8_lossy(&out).to_string(), t.elapsed())
        });
    }

    // Meanwhile, reviews go on.
    std::thread::sleep(Duration::from_millis(300));
    for _ in 0..3 {
        let (out, took) = review(&s);
        assert_eq!(status(&out), "200", "{out}");
        assert!(
            out.contains("\"allowed\":true"),
            "{}",
            &out[..out.len().min(300)]
        );
        assert!(took < Duration::from_secs(1), "a review took {took:?}");
    }

    for c in clients {
        let (kind, out, took) = c.join().unwrap();
        let timeout = match kind.as_str() {
            "tls-silent" => limits.idle_timeout,
            "no-tls" | "half-headers" => limits.header_read_timeout,
            _ => limits.body_read_timeout,
        };
        // Closed by the timeout, not before it (nor long after: closed_within).
        assert!(
            took >= timeout.mul_f64(0.8) && took < timeout + slack,
            "{kind}: closed after {took:?}"
        );
        if kind.starts_with("body-") {
            assert_eq!(status(&out), "408", "{kind}: {out}");
        }
    }

    // A body declared over the limit: 413 at once.
    let t = Instant::now();
    let mut c = tls(&s);
    c.write_all(b"POST /validate HTTP/1.1\r\nHost: localhost\r\nContent-Length: 65537\r\n\r\n")
        .unwrap();
    c.flush().unwrap();
    let (out, took) = closed_within(&mut c, t, Duration::from_secs(3));
    assert_eq!(status(&out), "413", "{out}");
    assert!(took < Duration::from_secs(1), "{took:?}");
}

/// With every connection slot taken, a new connection evicts the one on which bytes
/// moved least recently (here the first one held), and is served.
#[test]
fn a_new_connection_evicts_the_least_recently_active_one() {
    let limits = Limits {
        header_read_timeout: Duration::from_secs(2),
        max_connections: 4,
        max_connections_per_source: 64,
        ..Limits::default()
    };
    let s = start(limits);
    let (first, _) = review(&s);
    assert_eq!(status(&first), "200", "{first}");
    let settle = |n: usize| {
        let t = Instant::now();
        while s.handle.connection_count() != n {
            assert!(
                t.elapsed() < Duration::from_secs(3),
                "{} connections open, expected {n}",
                s.handle.connection_count()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    settle(0);
    let mut held: Vec<TcpStream> = Vec::new();
    for _ in 0..4 {
        held.push(tcp(s.port));
        // Distinct last-activity times.
        std::thread::sleep(Duration::from_millis(20));
    }
    settle(4);
    // The fifth gets in; the oldest held one is closed at once.
    let fifth = tcp(s.port);
    let t = Instant::now();
    let (_, took) = closed_within(&mut held[0], t, Duration::from_secs(1));
    assert!(took < Duration::from_millis(500), "{took:?}");
    settle(4);
    fifth.set_nonblocking(true).unwrap();
    assert!(
        matches!((&fifth).read(&mut [0u8; 1]), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the new connection was closed instead"
    );
    // A review gets in too (evicting the next oldest).
    let (out, _) = review(&s);
    assert_eq!(status(&out), "200", "{out}");
}

/// A source with `max_connections_per_source` open gets its next connection closed at
/// once; others are not affected.
#[test]
fn connections_over_a_sources_share_are_closed_at_once() {
    let limits = Limits {
        header_read_timeout: Duration::from_secs(2),
        max_connections_per_source: 3,
        ..Limits::default()
    };
    let s = start(limits);
    let mut held: Vec<TcpStream> = Vec::new();
    for n in 1..=3 {
        held.push(tcp(s.port));
        let t = Instant::now();
        while s.handle.connection_count() != n {
            assert!(t.elapsed() < Duration::from_secs(3), "{n} not accepted");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let t = Instant::now();
    let (_, took) = closed_within(&mut tcp(s.port), t, Duration::from_secs(1));
    assert!(took < Duration::from_millis(500), "{took:?}");
    drop(held);
    std::thread::sleep(Duration::from_millis(100));
    let (out, _) = review(&s);
    assert_eq!(status(&out), "200", "{out}");
}
