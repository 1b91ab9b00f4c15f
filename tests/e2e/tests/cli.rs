//! Command-line behaviour a user notices, on the real binaries.

use coloc_agent::control::state::{GpuDoc, StateDoc};
use coloc_e2e::*;
use std::process::{Command, Stdio};

/// Serves one `/state` document per connection; returns the agent URL.
fn fake_agent(doc: &StateDoc) -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let body = serde_json::to_string(doc).unwrap();
    std::thread::spawn(move || {
        for mut c in l.incoming().flatten() {
            use std::io::{Read, Write};
            // The whole request head, then the answer.
            let (mut head, mut buf) = (Vec::new(), [0u8; 256]);
            while !head.ends_with(b"\r\n\r\n") {
                match c.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
            let _ = write!(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
        }
    });
    url
}

#[test]
fn status_json_into_a_closed_pipe_ends_quietly() {
    // Many GPUs: the JSON is larger than a pipe buffer, so the write meets the closed pipe.
    let doc = StateDoc {
        node: "n1".into(),
        gpus: (0..400)
            .map(|i| GpuDoc {
                index: i,
                uuid: format!("GPU-{i:04}"),
                state: "offline_running".into(),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };
    let url = fake_agent(&doc);
    // `coloc-agent status --json | head -1`, with head done reading at once.
    let mut child = Command::new(bin("coloc-agent"))
        .args(["status", "--json", "--url", &url])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert!(out.status.success(), "{:?}: {err}", out.status);
}

#[test]
fn bench_help_prints_help_and_runs_nothing() {
    let out = output_within(
        Command::new(bin("coloc-bench")).arg("--help"),
        std::time::Duration::from_secs(10),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("Modes:"), "{text}");
}
