//! The HTTP server's limits and routes.
use super::*;
use crate::control::state::{GpuDoc, ProcDoc, StateDoc};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Instant;
use tokio::net::TcpListener;

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
                shim: None,
                pid: 7,
                class: qos_core::Class::Offline,
                owner: "rule:off".into(),
                cmd: "train.py --token=s3cret".into(),
                suspended: false,
                actuator: None,
                last_active_ms_ago: None,
                driver: None,
                checkpointed_bytes: None,
                escaping: false,
                gate: None,
                container: None,
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
        state_public: false,
        process_info: true,
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

/// `/state` answers loopback clients only unless `--state-public`; the other endpoints
/// answer everyone.
#[test]
fn state_answers_loopback_clients_only_unless_public() {
    use tower::ServiceExt;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let app = |public: bool| {
        router(AppState {
            shared: Arc::new(Shared::default()),
            prom: metrics_exporter_prometheus::PrometheusBuilder::new()
                .build_recorder()
                .handle(),
            source: Arc::new(crate::edges::fake::FakeSource::default()),
            stall_ns: u64::MAX,
            state_cmdlines: false,
            state_public: public,
            process_info: true,
            metrics_cache: Arc::default(),
        })
    };
    let status = |public: bool, path: &str, peer: Option<&str>| {
        let mut req = axum::http::Request::get(path)
            .body(axum::body::Body::empty())
            .unwrap();
        if let Some(p) = peer {
            req.extensions_mut().insert(Peer(p.parse().unwrap()));
        }
        rt.block_on(app(public).oneshot(req)).unwrap().status()
    };
    for local in [
        "127.0.0.1:40000",
        "127.3.2.1:1",
        "[::1]:5",
        "[::ffff:127.0.0.1]:6",
    ] {
        assert_eq!(
            status(false, "/state", Some(local)),
            StatusCode::OK,
            "{local}"
        );
    }
    for remote in ["10.1.2.3:40000", "[fd00::1]:7", "192.0.2.8:9"] {
        assert_eq!(
            status(false, "/state", Some(remote)),
            StatusCode::FORBIDDEN,
            "{remote}"
        );
        assert_eq!(
            status(true, "/state", Some(remote)),
            StatusCode::OK,
            "{remote}"
        );
        assert_eq!(
            status(false, "/metrics", Some(remote)),
            StatusCode::OK,
            "{remote}"
        );
        assert_eq!(
            status(false, "/healthz", Some(remote)),
            StatusCode::OK,
            "{remote}"
        );
    }
    assert_eq!(
        status(false, "/state", None),
        StatusCode::FORBIDDEN,
        "no peer known"
    );
}

/// `/metrics` names each GPU process's pod (`coloc_process_info`, the GPU's UUID on it and
/// on every per-GPU series) unless `--metrics-without-pods`; what co-location earned stays.
#[test]
fn metrics_name_pods_unless_asked_not_to() {
    let shared = Arc::new(Shared::default());
    shared
        .gpu_uuids
        .set([(0, "GPU-aaaa".to_string())].into())
        .unwrap();
    let mut doc = StateDoc {
        updated_ns: 1,
        gpus: vec![GpuDoc {
            index: 0,
            uuid: "GPU-aaaa".into(),
            processes: vec![ProcDoc {
                shim: Some("page".into()),
                pid: 7,
                class: qos_core::Class::Offline,
                owner: "ml/train-0".into(),
                cmd: String::new(),
                suspended: false,
                actuator: Some(crate::edges::actuator::Kind::Freezer),
                last_active_ms_ago: None,
                driver: None,
                checkpointed_bytes: None,
                container: Some("trainer".into()),
                escaping: false,
                gate: None,
            }],
            ..Default::default()
        }],
        ..Default::default()
    };
    shared.earned.lock().unwrap().account(&mut doc);
    *shared.state.lock().unwrap() = doc;
    let render = |process_info: bool| {
        render_metrics(&AppState {
            shared: shared.clone(),
            prom: metrics_exporter_prometheus::PrometheusBuilder::new()
                .build_recorder()
                .handle(),
            source: Arc::new(crate::edges::fake::FakeSource::default()),
            stall_ns: u64::MAX,
            state_cmdlines: false,
            state_public: false,
            process_info,
            metrics_cache: Arc::default(),
        })
    };
    let with = render(true);
    assert!(
        with.lines().any(|l| l
            == r#"coloc_process_info{namespace="ml",pod="train-0",container="trainer",class="offline",gpu="0",UUID="GPU-aaaa",actuator="freezer",shim="page"} 1"#),
        "{with}"
    );
    let without = render(false);
    assert!(!without.contains("train-0"), "{without}");
    assert!(!without.contains("coloc_process_info"), "{without}");
    for text in [&with, &without] {
        assert!(
            text.contains(r#"coloc_offline_held_seconds_total{namespace="ml",class="offline"} 0"#),
            "{text}"
        );
    }
}
