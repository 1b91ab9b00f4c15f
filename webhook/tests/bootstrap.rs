//! `coloc-webhook bootstrap-cert` (the chart's hook Job) against a fake API server on
//! 127.0.0.1:0 that speaks the part of the Kubernetes REST API the Job uses: Secrets (get,
//! create, replace with resourceVersion) and webhook configurations (get, JSON patch).
//! The certificate it writes is then served by the real webhook and verified by a client
//! that trusts only the `caBundle` the Job put in the configurations.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use base64::Engine;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const NS: &str = "gpu-coloc";
const SVC: &str = "gpu-coloc-webhook";
const SECRET: &str = "gpu-coloc-webhook-tls";
const CONFIG: &str = "gpu-coloc-webhook";

#[derive(Default)]
struct Store {
    rv: u64,
    /// (kind path segment, name) → object. Kinds: secrets, mutatingwebhookconfigurations,
    /// validatingwebhookconfigurations.
    objects: BTreeMap<(String, String), Value>,
    writes: Vec<String>,
}

type Shared = Arc<Mutex<Store>>;

fn status(code: u16, reason: &str, msg: String) -> Response {
    let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": msg, "reason": reason, "code": code});
    (StatusCode::from_u16(code).unwrap(), axum::Json(body)).into_response()
}

fn stamp(s: &mut Store, mut v: Value) -> Value {
    s.rv += 1;
    v["metadata"]["resourceVersion"] = json!(s.rv.to_string());
    v
}

async fn get_secret(
    State(s): State<Shared>,
    Path((_ns, name)): Path<(String, String)>,
) -> Response {
    get_obj(&s, "secrets", &name)
}

fn get_obj(s: &Shared, kind: &str, name: &str) -> Response {
    match s.lock().unwrap().objects.get(&(kind.into(), name.into())) {
        Some(v) => axum::Json(v.clone()).into_response(),
        None => status(404, "NotFound", format!("{kind} \"{name}\" not found")),
    }
}

async fn create_secret(State(s): State<Shared>, Path(_ns): Path<String>, body: Bytes) -> Response {
    let v: Value = serde_json::from_slice(&body).unwrap();
    let name = v["metadata"]["name"].as_str().unwrap().to_string();
    let mut st = s.lock().unwrap();
    if st.objects.contains_key(&("secrets".into(), name.clone())) {
        return status(
            409,
            "AlreadyExists",
            format!("secrets \"{name}\" already exists"),
        );
    }
    let v = stamp(&mut st, v);
    st.objects
        .insert(("secrets".into(), name.clone()), v.clone());
    st.writes.push(format!("create secret {name}"));
    (StatusCode::CREATED, axum::Json(v)).into_response()
}

async fn replace_secret(
    State(s): State<Shared>,
    Path((_ns, name)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    let v: Value = serde_json::from_slice(&body).unwrap();
    let mut st = s.lock().unwrap();
    let key = ("secrets".to_string(), name.clone());
    let Some(old) = st.objects.get(&key) else {
        return status(404, "NotFound", format!("secrets \"{name}\" not found"));
    };
    if v["metadata"]["resourceVersion"] != old["metadata"]["resourceVersion"] {
        return status(409, "Conflict", "the object has been modified".into());
    }
    let v = stamp(&mut st, v);
    st.objects.insert(key, v.clone());
    st.writes.push(format!("replace secret {name}"));
    axum::Json(v).into_response()
}

async fn patch_cfg(
    s: &Shared,
    kind: &str,
    name: &str,
    headers: &HeaderMap,
    body: &[u8],
) -> Response {
    if headers.get("content-type").and_then(|v| v.to_str().ok())
        != Some("application/json-patch+json")
    {
        return status(415, "UnsupportedMediaType", "expected a JSON patch".into());
    }
    let patch: json_patch::Patch = serde_json::from_slice(body).unwrap();
    let mut st = s.lock().unwrap();
    let key = (kind.to_string(), name.to_string());
    let Some(mut v) = st.objects.get(&key).cloned() else {
        return status(404, "NotFound", format!("{kind} \"{name}\" not found"));
    };
    if let Err(e) = json_patch::patch(&mut v, &patch) {
        return status(422, "Invalid", e.to_string());
    }
    let v = stamp(&mut st, v);
    st.objects.insert(key, v.clone());
    st.writes.push(format!("patch {kind} {name}"));
    axum::Json(v).into_response()
}

async fn get_mutating(State(s): State<Shared>, Path(name): Path<String>) -> Response {
    get_obj(&s, "mutatingwebhookconfigurations", &name)
}
async fn patch_mutating(
    State(s): State<Shared>,
    Path(name): Path<String>,
    h: HeaderMap,
    b: Bytes,
) -> Response {
    patch_cfg(&s, "mutatingwebhookconfigurations", &name, &h, &b).await
}
async fn get_validating(State(s): State<Shared>, Path(name): Path<String>) -> Response {
    get_obj(&s, "validatingwebhookconfigurations", &name)
}
async fn patch_validating(
    State(s): State<Shared>,
    Path(name): Path<String>,
    h: HeaderMap,
    b: Bytes,
) -> Response {
    patch_cfg(&s, "validatingwebhookconfigurations", &name, &h, &b).await
}

/// The fake API server on its own thread; returns its port and store.
fn fake_api() -> (u16, Shared) {
    let store: Shared = Arc::default();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let app = Router::new()
        .route(
            "/api/v1/namespaces/{ns}/secrets",
            axum::routing::post(create_secret),
        )
        .route(
            "/api/v1/namespaces/{ns}/secrets/{name}",
            get(get_secret).put(replace_secret),
        )
        .route(
            "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{name}",
            get(get_mutating).patch(patch_mutating),
        )
        .route(
            "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{name}",
            get(get_validating).patch(patch_validating),
        )
        .with_state(store.clone());
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let l = tokio::net::TcpListener::from_std(listener).unwrap();
            axum::serve(l, app).await.unwrap();
        });
    });
    (port, store)
}

fn webhook(name: &str, path: &str) -> Value {
    json!({"name": name, "admissionReviewVersions": ["v1"], "sideEffects": "None",
        "clientConfig": {"service": {"name": SVC, "namespace": NS, "path": path}}})
}

fn seed_configs(store: &Shared) {
    let mut st = store.lock().unwrap();
    let mutating = json!({"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": CONFIG, "resourceVersion": "1"},
        "webhooks": [webhook("mutate.gpu-coloc.dev", "/mutate"), webhook("mutate-hami.gpu-coloc.dev", "/mutate?backend=hami"), webhook("mutate-vke.gpu-coloc.dev", "/mutate?backend=vke")]});
    let validating = json!({"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": CONFIG, "resourceVersion": "1"},
        "webhooks": [webhook("validate.gpu-coloc.dev", "/validate")]});
    st.objects.insert(
        ("mutatingwebhookconfigurations".into(), CONFIG.into()),
        mutating,
    );
    st.objects.insert(
        ("validatingwebhookconfigurations".into(), CONFIG.into()),
        validating,
    );
}

fn kubeconfig(dir: &std::path::Path, port: u16) -> std::path::PathBuf {
    let p = dir.join("kubeconfig");
    std::fs::write(
        &p,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://127.0.0.1:{port}\nusers:\n- name: job\n  user: {{}}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: job\ncurrent-context: fake\n"
        ),
    )
    .unwrap();
    p
}

fn bootstrap(kubeconfig: &std::path::Path, extra: &[&str]) -> (bool, String) {
    let mut args = vec!["--mutating-config", CONFIG, "--validating-config", CONFIG];
    args.extend_from_slice(extra);
    bootstrap_cert(kubeconfig, &args)
}

/// `coloc-webhook bootstrap-cert` for the test's Service and Secret, plus `args`.
fn bootstrap_cert(kubeconfig: &std::path::Path, args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_coloc-webhook"))
        .args([
            "bootstrap-cert",
            "--namespace",
            NS,
            "--service",
            SVC,
            "--secret",
            SECRET,
        ])
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn secret_field(store: &Shared, key: &str) -> String {
    let st = store.lock().unwrap();
    let s = &st.objects[&("secrets".to_string(), SECRET.to_string())];
    let b64 = s["data"][key]
        .as_str()
        .unwrap_or_else(|| panic!("secret has no {key}: {s}"));
    String::from_utf8(
        base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap(),
    )
    .unwrap()
}

/// Every webhook's caBundle, decoded.
fn bundles(store: &Shared) -> Vec<String> {
    let st = store.lock().unwrap();
    let mut out = Vec::new();
    for kind in [
        "mutatingwebhookconfigurations",
        "validatingwebhookconfigurations",
    ] {
        for w in st.objects[&(kind.to_string(), CONFIG.to_string())]["webhooks"]
            .as_array()
            .unwrap()
        {
            let b = w["clientConfig"]["caBundle"].as_str().unwrap_or("");
            out.push(
                String::from_utf8(base64::engine::general_purpose::STANDARD.decode(b).unwrap())
                    .unwrap(),
            );
        }
    }
    out
}

fn pem_to_der(pem: &str) -> Vec<u8> {
    let b64: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
    base64::engine::general_purpose::STANDARD
        .decode(b64)
        .unwrap()
}

/// GET /healthz over HTTPS, trusting only `ca_pem`, asking for `name` (SNI + verification).
fn healthz(port: u16, ca_pem: &str, name: &str) -> Result<String, String> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(rustls::pki_types::CertificateDer::from(pem_to_der(ca_pem)))
        .unwrap();
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let server = rustls::pki_types::ServerName::try_from(name.to_string()).unwrap();
    let mut conn =
        rustls::ClientConnection::new(Arc::new(cfg), server).map_err(|e| e.to_string())?;
    let mut sock = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut tls = rustls::Stream::new(&mut conn, &mut sock);
    write!(
        tls,
        "GET /healthz HTTP/1.1\r\nHost: {name}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    match tls.read_to_end(&mut out) {
        Ok(_) => {}
        Err(e) if !out.is_empty() && e.kind() == std::io::ErrorKind::UnexpectedEof => {}
        Err(e) => return Err(e.to_string()),
    }
    Ok(String::from_utf8_lossy(&out).to_string())
}

struct Server(Child);
impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn bootstrap_creates_keeps_and_renews_the_certificate_and_sets_every_ca_bundle() {
    // Removed when dropped, passing or failing.
    let scratch = tempfile::Builder::new()
        .prefix("coloc-webhook-bootstrap-")
        .tempdir()
        .unwrap();
    let dir = scratch.path().to_path_buf();
    let (port, store) = fake_api();
    seed_configs(&store);
    let kc = kubeconfig(&dir, port);

    // Install: no Secret yet.
    let (ok, text) = bootstrap(&kc, &[]);
    assert!(ok, "{text}");
    assert!(
        text.contains("Created") && text.contains("caBundle set on 4 webhook(s)"),
        "{text}"
    );
    let ca = secret_field(&store, "ca.crt");
    assert!(ca.contains("BEGIN CERTIFICATE"), "{ca}");
    assert_eq!(
        bundles(&store),
        vec![ca.clone(); 4],
        "every webhook trusts the new CA"
    );

    // The real webhook serves the Secret's certificate; a client that trusts only the
    // caBundle accepts it under the Service's cluster name.
    std::fs::write(dir.join("tls.crt"), secret_field(&store, "tls.crt")).unwrap();
    std::fs::write(dir.join("tls.key"), secret_field(&store, "tls.key")).unwrap();
    let wport = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let _server = Server(
        Command::new(env!("CARGO_BIN_EXE_coloc-webhook"))
            .args(["--listen", &format!("127.0.0.1:{wport}")])
            .arg("--cert")
            .arg(dir.join("tls.crt"))
            .arg("--key")
            .arg(dir.join("tls.key"))
            .spawn()
            .unwrap(),
    );
    let t = Instant::now();
    let answer = loop {
        match healthz(wport, &bundles(&store)[0], &format!("{SVC}.{NS}.svc")) {
            Ok(r) => break r,
            Err(e) if t.elapsed() < Duration::from_secs(10) && e.contains("refused") => {
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(e) => panic!("the bootstrapped certificate is not accepted: {e}"),
        }
    };
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        healthz(wport, &bundles(&store)[0], "other.example.com").is_err(),
        "a name the certificate is not for is refused"
    );

    // Upgrade: a valid certificate is kept (no rotation on every helm upgrade), and the
    // bundle is set again (a re-rendered configuration has none).
    let writes = store.lock().unwrap().writes.len();
    let (ok, text) = bootstrap(&kc, &[]);
    assert!(ok && text.contains("Kept"), "{text}");
    assert_eq!(secret_field(&store, "ca.crt"), ca);
    let new_writes = store.lock().unwrap().writes[writes..].to_vec();
    assert!(
        new_writes.iter().all(|w| w.starts_with("patch")),
        "{new_writes:?}"
    );

    // Close to expiry: renewed, and the bundles follow.
    {
        let mut st = store.lock().unwrap();
        let s = st
            .objects
            .get_mut(&("secrets".to_string(), SECRET.to_string()))
            .unwrap();
        let soon = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
            + 86_400;
        s["metadata"]["annotations"]["gpu-coloc.dev/not-after"] = json!(soon.to_string());
    }
    let (ok, text) = bootstrap(&kc, &[]);
    assert!(ok && text.contains("Renewed"), "{text}");
    let renewed = secret_field(&store, "ca.crt");
    assert_ne!(renewed, ca);
    assert_eq!(bundles(&store), vec![renewed; 4]);

    // A Secret made by hand without the CA is replaced too.
    {
        let mut st = store.lock().unwrap();
        let s = st
            .objects
            .get_mut(&("secrets".to_string(), SECRET.to_string()))
            .unwrap();
        s["data"].as_object_mut().unwrap().remove("ca.crt");
    }
    let (ok, text) = bootstrap(&kc, &[]);
    assert!(ok && text.contains("Renewed"), "{text}");

    // A configuration that does not exist: the Job fails and says which.
    let (ok, text) = bootstrap(&kc, &["--validating-config", "missing"]);
    assert!(
        !ok && text.contains("ValidatingWebhookConfiguration missing"),
        "{text}"
    );
}

/// The chart's two hook Jobs: before the release's objects exist, the Secret alone (no
/// configuration to patch, and none is touched); after, the caBundle from that Secret,
/// which is read and never written.
#[test]
fn secret_only_before_the_configurations_then_patch_only_after() {
    // Removed when dropped, passing or failing.
    let scratch = tempfile::Builder::new()
        .prefix("coloc-webhook-steps-")
        .tempdir()
        .unwrap();
    let dir = scratch.path().to_path_buf();
    let (port, store) = fake_api();
    let kc = kubeconfig(&dir, port);

    // Patch-only before the Secret exists: refused, saying which step makes it.
    let patch = [
        "--patch-only",
        "--mutating-config",
        CONFIG,
        "--validating-config",
        CONFIG,
    ];
    seed_configs(&store);
    let (ok, text) = bootstrap_cert(&kc, &patch);
    assert!(
        !ok && text.contains("does not exist") && text.contains("pre-install"),
        "{text}"
    );
    // ... and --patch-only without a configuration is a usage error.
    let (ok, text) = bootstrap_cert(&kc, &["--patch-only"]);
    assert!(!ok && text.contains("--mutating-config"), "{text}");

    // pre-install: the configurations do not exist yet.
    store.lock().unwrap().objects.clear();
    let (ok, text) = bootstrap_cert(&kc, &[]);
    assert!(ok, "secret-only run failed: {text}");
    assert!(
        text.contains("Created") && text.contains("caBundle left to a --patch-only run"),
        "{text}"
    );
    assert_eq!(
        store.lock().unwrap().writes,
        vec![format!("create secret {SECRET}")],
        "the secret step writes the Secret and nothing else"
    );
    let ca = secret_field(&store, "ca.crt");

    // Helm creates the release's objects (the configurations, without a caBundle) ...
    seed_configs(&store);
    // ... and post-install sets every bundle from the Secret, writing no Secret.
    let writes = store.lock().unwrap().writes.len();
    let (ok, text) = bootstrap_cert(&kc, &patch);
    assert!(ok, "patch-only run failed: {text}");
    assert!(
        text.contains("read (--patch-only)") && text.contains("caBundle set on 4 webhook(s)"),
        "{text}"
    );
    assert_eq!(bundles(&store), vec![ca.clone(); 4]);
    let new_writes = store.lock().unwrap().writes[writes..].to_vec();
    assert!(
        new_writes.iter().all(|w| w.starts_with("patch")) && new_writes.len() == 2,
        "{new_writes:?}"
    );

    // pre-upgrade with a valid Secret: kept, nothing written.
    let writes = store.lock().unwrap().writes.len();
    let (ok, text) = bootstrap_cert(&kc, &[]);
    assert!(ok && text.contains("Kept"), "{text}");
    assert_eq!(store.lock().unwrap().writes.len(), writes);

    // A Secret for other names is not used by the patch step (the secret step replaces it).
    {
        let mut st = store.lock().unwrap();
        let s = st
            .objects
            .get_mut(&("secrets".to_string(), SECRET.to_string()))
            .unwrap();
        s["metadata"]["annotations"]["gpu-coloc.dev/dns-names"] = json!("other.example.com");
    }
    let (ok, text) = bootstrap_cert(&kc, &patch);
    assert!(!ok && text.contains("other names"), "{text}");
}
