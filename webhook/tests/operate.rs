//! What an operator sees of the running binary: counters present at 0 from the start (so
//! alerts on `increase()` see the first event) and logs fit for a collector.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn get(port: u16, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

/// Starts the webhook (plain HTTP) with `args`; returns its port, its first stderr line
/// and the child.
fn start(args: &[&str]) -> (u16, String, std::process::Child) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_coloc-webhook"))
        .args(["--insecure-http", "--listen", &format!("127.0.0.1:{port}")])
        .args(args)
        .env_remove("COLOC_LOG_FORMAT")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stderr.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let t = Instant::now();
    while get(port, "/healthz").is_none() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "webhook never answered; log: {line}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    (port, line, child)
}

#[test]
fn counters_start_at_zero_and_logs_have_no_colour_codes_off_a_terminal() {
    let (port, line, mut child) = start(&[]);
    let metrics = get(port, "/metrics").unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    for series in [
        r#"coloc_webhook_admissions_total{endpoint="mutate",result="denied"} 0"#,
        r#"coloc_webhook_denials_total{endpoint="mutate",reason="mixed_pod"} 0"#,
        r#"coloc_webhook_denials_total{endpoint="unsupported_backend",reason="backend_unsupported"} 0"#,
        r#"coloc_webhook_limited_total{limit="idle"} 0"#,
    ] {
        assert!(
            metrics.contains(series),
            "{series} missing from /metrics:\n{metrics}"
        );
    }
    assert!(line.contains("Webhook started"), "{line}");
    assert!(
        !line.contains('\u{1b}'),
        "ANSI escape codes in a log that is not a terminal: {line:?}"
    );

    let (_, line, mut child) = start(&["--log-format", "json"]);
    child.kill().unwrap();
    child.wait().unwrap();
    let v: serde_json::Value =
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
    assert_eq!(v["fields"]["message"], "Webhook started", "{line}");
}
