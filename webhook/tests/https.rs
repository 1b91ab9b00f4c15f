//! The real binary over real HTTPS: a client that verifies the certificate against its
//! CA, and a certificate rotated on disk while the server runs.

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

struct Pki {
    ca_pem: String,
    cert_pem: String,
    key_pem: String,
}

fn pki() -> Pki {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    Pki {
        ca_pem: ca.pem(),
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    }
}

fn write(dir: &Path, p: &Pki) {
    // Write the key first, then the certificate, each atomically (as a rotation would).
    for (name, body) in [("tls.key", &p.key_pem), ("tls.crt", &p.cert_pem)] {
        let tmp = dir.join(format!("{name}.tmp"));
        std::fs::write(&tmp, body).unwrap();
        std::fs::rename(&tmp, dir.join(name)).unwrap();
    }
}

fn client(ca_pems: &str) -> rustls::ClientConfig {
    // One or more concatenated CA certificates.
    let mut roots = rustls::RootCertStore::empty();
    for pem in ca_pems
        .split_inclusive("-----END CERTIFICATE-----\n")
        .filter(|p| p.contains("BEGIN"))
    {
        roots
            .add(rustls::pki_types::CertificateDer::from(pem_to_der(pem)))
            .unwrap();
    }

    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth()
}

fn pem_to_der(pem: &str) -> Vec<u8> {
    use base64::Engine;
    let b64: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
    base64::engine::general_purpose::STANDARD
        .decode(b64)
        .unwrap()
}

/// One HTTPS POST with certificate verification; Err if the handshake fails.
fn post(port: u16, ca_pem: &str, path: &str, body: &[u8]) -> Result<(u16, String), String> {
    let cfg = Arc::new(client(ca_pem));
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let mut conn = rustls::ClientConnection::new(cfg, name).map_err(|e| e.to_string())?;
    let mut sock = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut tls = rustls::Stream::new(&mut conn, &mut sock);
    write!(tls, "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len()).map_err(|e| e.to_string())?;
    tls.write_all(body).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    match tls.read_to_end(&mut out) {
        Ok(_) => {}
        Err(e) if !out.is_empty() && e.kind() == std::io::ErrorKind::UnexpectedEof => {}
        Err(e) => return Err(e.to_string()),
    }
    let text = String::from_utf8_lossy(&out).to_string();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or("no status")?;
    Ok((status, text))
}

struct Server(Child);
impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn https_with_verified_certificate_and_rotation() {
    // Removed when dropped, passing or failing.
    let scratch = tempfile::Builder::new()
        .prefix("coloc-webhook-tls-")
        .tempdir()
        .unwrap();
    let dir = scratch.path().to_path_buf();
    let first = pki();
    write(&dir, &first);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let _server = Server(
        Command::new(env!("CARGO_BIN_EXE_coloc-webhook"))
            .args([
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--reload-secs",
                "1",
                "--backend",
                "hami",
            ])
            .arg("--cert")
            .arg(dir.join("tls.crt"))
            .arg("--key")
            .arg(dir.join("tls.key"))
            .spawn()
            .unwrap(),
    );
    let body = std::fs::read(format!(
        "{}/tests/data/offline-deployment-create.json",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap();
    let t = Instant::now();
    let (status, text) = loop {
        match post(port, &first.ca_pem, "/mutate", &body) {
            Ok(r) => break r,
            Err(e) if t.elapsed() < Duration::from_secs(10) => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("webhook never answered over HTTPS: {e}"),
        }
    };
    assert_eq!(status, 200, "{text}");
    assert!(
        text.contains("\"allowed\":true") && text.contains("\"patchType\":\"JSONPatch\""),
        "{text}"
    );

    // A client that trusts another CA refuses the server.
    let stranger = pki();
    assert!(
        post(port, &stranger.ca_pem, "/mutate", &body).is_err(),
        "handshake must fail for an untrusted CA"
    );

    // Rotate while a client keeps sending reviews (trusting both CAs): no request fails.
    let both = format!("{}{}", first.ca_pem, stranger.ca_pem);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let (stop, both, body) = (stop.clone(), both.clone(), body.clone());
        std::thread::spawn(move || {
            let (mut ok, mut failed) = (0u32, Vec::new());
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                match post(port, &both, "/mutate", &body) {
                    Ok((200, _)) => ok += 1,
                    other => failed.push(format!("{other:?}")),
                }
            }
            (ok, failed)
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    // Rotate: the new certificate is served without a restart; the old CA stops working.
    write(&dir, &stranger);
    let t = Instant::now();
    loop {
        if let Ok((200, _)) = post(port, &stranger.ca_pem, "/mutate", &body) {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "rotated certificate never served"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(post(port, &first.ca_pem, "/mutate", &body).is_err());
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let (ok, failed) = load.join().unwrap();
    assert!(
        failed.is_empty(),
        "{} of {} requests failed during rotation: {:?}",
        failed.len(),
        ok as usize + failed.len(),
        &failed[..failed.len().min(3)]
    );
    assert!(ok > 10, "the load ran ({ok} requests)");
}

#[test]
fn limits_are_flags_with_env_and_defaults() {
    let out = Command::new(env!("CARGO_BIN_EXE_coloc-webhook"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for (flag, env, default) in [
        ("--max-body-bytes", "COLOC_WEBHOOK_MAX_BODY", "3145728"),
        (
            "--header-read-timeout-secs",
            "COLOC_WEBHOOK_HEADER_READ_TIMEOUT_SECS",
            "3",
        ),
        (
            "--body-read-timeout-secs",
            "COLOC_WEBHOOK_BODY_READ_TIMEOUT_SECS",
            "3",
        ),
        (
            "--idle-timeout-secs",
            "COLOC_WEBHOOK_IDLE_TIMEOUT_SECS",
            "120",
        ),
        ("--max-connections", "COLOC_WEBHOOK_MAX_CONNECTIONS", "256"),
        (
            "--max-connections-per-source",
            "COLOC_WEBHOOK_MAX_CONNECTIONS_PER_SOURCE",
            "32",
        ),
        (
            "--max-concurrent-reviews",
            "COLOC_WEBHOOK_MAX_CONCURRENT_REVIEWS",
            "8",
        ),
    ] {
        let at = help
            .find(flag)
            .unwrap_or_else(|| panic!("{flag} missing:\n{help}"));
        let section = &help[at..];
        let section = &section[..section[2..]
            .find("\n      --")
            .map_or(section.len(), |i| i + 2)];
        assert!(section.contains(&format!("[env: {env}=]")), "{section}");
        assert!(
            section.contains(&format!("[default: {default}]")),
            "{section}"
        );
    }
    // The defaults in --help are the library's.
    let d = coloc_webhook::server::Limits::default();
    assert_eq!(d.max_body, 3145728);
    assert_eq!(d.header_read_timeout, Duration::from_secs(3));
    assert_eq!(d.body_read_timeout, Duration::from_secs(3));
    assert_eq!(d.max_connections_per_source, 32);
    assert_eq!(d.idle_timeout, Duration::from_secs(120));
    assert_eq!((d.max_connections, d.max_concurrent_reviews), (256, 8));
    // Bad values are refused.
    let out = Command::new(env!("CARGO_BIN_EXE_coloc-webhook"))
        .args(["--idle-timeout-secs", "0", "--translate", "-"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("more than 0"));
}
