//! A small fake Kubernetes API server on 127.0.0.1:0, for the real client path: pod list
//! and watch (`/api/v1/pods`), with the failures a real API server produces: `410 Gone`
//! (expired resource version), dropped connections, failing lists.
//!
//! Like kube-apiserver, a watch from a resource version first sends every change made
//! after it, so a change a test makes between a client's list and its watch is not lost
//! (the client would otherwise never see it, and the test would wait for nothing). Only
//! [`FakeApi::apply_silently`] and a silent [`FakeApi::delete`] stay out of that history:
//! they model changes the watch missed, which a relist alone sees.

use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::broadcast;

#[derive(Debug, Clone)]
enum Msg {
    Line(String),
    Expire,
    Close,
}

#[derive(Debug, Default)]
struct ApiState {
    rv: u64,
    pods: BTreeMap<String, Value>,
    fail_lists: bool,
    lists: u64,
    watches_open: i64,
    last_sent: Option<Instant>,
    /// List requests received, answered or not (held, failed, served).
    list_requests: u64,
    /// Pod UID → when its latest event was handed to a watch connection's body.
    written: HashMap<String, Instant>,
    /// Every change sent to watches: (resource version, the event's line).
    history: Vec<(u64, String)>,
}

/// The server; stops with the runtime it was started on.
#[derive(Debug, Clone)]
pub struct FakeApi {
    /// Port on 127.0.0.1.
    pub port: u16,
    state: Arc<Mutex<ApiState>>,
    tx: broadcast::Sender<Msg>,
    /// `true`: list requests wait (unanswered) until set back to `false`.
    hold: Arc<tokio::sync::watch::Sender<bool>>,
}

/// A pod as the API server returns it.
pub fn pod(uid: &str, name: &str, node: &str, qos: Option<&str>) -> Value {
    let mut ann = serde_json::Map::new();
    if let Some(q) = qos {
        ann.insert("katalyst.kubewharf.io/qos_level".into(), json!(q));
    }
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "ml", "uid": uid, "annotations": ann, "resourceVersion": "0"},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "registry.example.com/x:1"}]},
        "status": {"phase": "Running"}
    })
}

impl FakeApi {
    /// Starts on the current tokio runtime.
    pub async fn start() -> FakeApi {
        let (tx, _) = broadcast::channel(4096);
        let state = Arc::new(Mutex::new(ApiState::default()));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let hold = Arc::new(tokio::sync::watch::Sender::new(false));
        let api = FakeApi {
            port,
            state,
            tx,
            hold,
        };
        let app = Router::new()
            .route("/api/v1/pods", get(pods))
            .with_state(api.clone());
        // Like kube-apiserver (Go sets TCP_NODELAY on every connection): without it the
        // first watch event after the response headers waits for the client's delayed ACK
        // (Nagle), about 40 ms, which is the fake server's latency, not the agent's.
        use axum::serve::ListenerExt;
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        tokio::spawn(async move { axum::serve(listener, app).await });
        api
    }

    /// A kubeconfig file that points at this server.
    pub fn kubeconfig(&self, dir: &std::path::Path) -> std::path::PathBuf {
        let p = dir.join("kubeconfig");
        std::fs::write(
            &p,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://127.0.0.1:{}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\ncurrent-context: fake\nusers:\n- name: fake\n  user:\n    token: fake\n",
                self.port
            ),
        )
        .unwrap();
        p
    }

    /// A client for this server.
    pub fn client(&self) -> kube::Client {
        let cfg = kube::Config::new(format!("http://127.0.0.1:{}", self.port).parse().unwrap());
        kube::Client::try_from(cfg).unwrap()
    }

    /// Sends a change to open watches and keeps it for watches opened later from an
    /// older resource version. Under the state's lock, so that a watch being opened gets
    /// each change once: from the history or live.
    fn send(&self, s: &mut ApiState, kind: &str, obj: &Value) {
        let line = json!({"type": kind, "object": obj}).to_string() + "\n";
        s.last_sent = Some(Instant::now());
        s.history.push((s.rv, line.clone()));
        let _ = self.tx.send(Msg::Line(line));
    }

    /// Adds or replaces a pod (ADDED / MODIFIED to watches, open or opened later from an
    /// older resource version).
    pub fn apply(&self, mut p: Value) {
        let uid = p["metadata"]["uid"].as_str().unwrap().to_string();
        let mut s = self.state.lock().unwrap();
        s.rv += 1;
        p["metadata"]["resourceVersion"] = json!(s.rv.to_string());
        let existed = s.pods.insert(uid, p.clone()).is_some();
        self.send(&mut s, if existed { "MODIFIED" } else { "ADDED" }, &p);
    }

    /// Changes a pod without telling open watches (as if the change happened while the
    /// watch was down): only a relist sees it.
    pub fn apply_silently(&self, p: Value) {
        let uid = p["metadata"]["uid"].as_str().unwrap().to_string();
        let mut s = self.state.lock().unwrap();
        s.rv += 1;
        s.pods.insert(uid, p);
    }

    /// Deletes a pod (DELETED to open watches); `silently`: only a relist sees it.
    pub fn delete(&self, uid: &str, silently: bool) {
        let mut s = self.state.lock().unwrap();
        s.rv += 1;
        let p = s.pods.remove(uid);
        if let (Some(p), false) = (p, silently) {
            self.send(&mut s, "DELETED", &p);
        }
    }

    /// Ends open watches with `410 Gone` (resource version too old).
    pub fn expire_watches(&self) {
        let _ = self.tx.send(Msg::Expire);
    }

    /// Drops every open watch connection.
    pub fn disconnect(&self) {
        let _ = self.tx.send(Msg::Close);
    }

    /// Makes lists fail with 500 (API server unavailable) or succeed again.
    pub fn fail_lists(&self, fail: bool) {
        self.state.lock().unwrap().fail_lists = fail;
    }

    /// Holds list requests unanswered (`true`) until released (`false`): what the client
    /// sees before its first list completes, without racing it.
    pub fn hold_lists(&self, hold: bool) {
        self.hold.send_replace(hold);
    }

    /// List requests received so far, answered or not.
    pub fn list_requests(&self) -> u64 {
        self.state.lock().unwrap().list_requests
    }

    /// When the latest event about pod `uid` was handed to an open watch connection (the
    /// moment the server writes it; later than [`FakeApi::last_sent`], which is when it
    /// was queued for the watches).
    pub fn written_at(&self, uid: &str) -> Option<Instant> {
        self.state.lock().unwrap().written.get(uid).copied()
    }

    /// Lists served so far.
    pub fn lists(&self) -> u64 {
        self.state.lock().unwrap().lists
    }

    /// Watches open now.
    pub fn watches_open(&self) -> i64 {
        self.state.lock().unwrap().watches_open
    }

    /// Waits until a watch is open, or panics after `timeout`. A test calls it before it
    /// changes a pod whose change it asserts on, so that the change reaches the client
    /// through the watch it means to test (a change made earlier would be replayed at the
    /// watch's start, or seen by a relist).
    pub async fn watching(&self, timeout: std::time::Duration) {
        let t = Instant::now();
        while self.watches_open() == 0 {
            assert!(
                t.elapsed() < timeout,
                "no watch opened on the fake API server within {timeout:?} ({} lists served)",
                self.lists()
            );
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }

    /// When the latest event was written to the watches.
    pub fn last_sent(&self) -> Option<Instant> {
        self.state.lock().unwrap().last_sent
    }
}

struct WatchGuard(Arc<Mutex<ApiState>>);
impl Drop for WatchGuard {
    fn drop(&mut self) {
        self.0.lock().unwrap().watches_open -= 1;
    }
}

async fn pods(State(api): State<FakeApi>, Query(q): Query<HashMap<String, String>>) -> Response {
    let node = q
        .get("fieldSelector")
        .and_then(|f| f.strip_prefix("spec.nodeName="))
        .map(str::to_string);
    let on_node = move |p: &Value| node.as_deref().is_none_or(|n| p["spec"]["nodeName"] == n);
    if q.get("watch").map(String::as_str) == Some("true") {
        // From the resource version asked for: the changes since, then live ones.
        let since: u64 = q
            .get("resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(u64::MAX);
        let (rx, backlog) = {
            let mut s = api.state.lock().unwrap();
            s.watches_open += 1;
            let backlog: std::collections::VecDeque<String> = s
                .history
                .iter()
                .filter(|(rv, _)| *rv > since)
                .map(|(_, l)| l.clone())
                .collect();
            (api.tx.subscribe(), backlog)
        };
        let guard = WatchGuard(api.state.clone());
        let state = api.state.clone();
        let start = (rx, backlog, guard, false);
        let stream = futures::stream::unfold(start, move |(mut rx, mut backlog, g, done)| {
            let on_node = on_node.clone();
            let state = state.clone();
            async move {
                if done {
                    return None;
                }
                loop {
                    let next = match backlog.pop_front() {
                        Some(l) => Ok(Msg::Line(l)),
                        None => rx.recv().await,
                    };
                    match next {
                        Ok(Msg::Line(l)) => {
                            let v: Value = serde_json::from_str(&l).unwrap();
                            if on_node(&v["object"]) {
                                if let Some(uid) = v["object"]["metadata"]["uid"].as_str() {
                                    state
                                        .lock()
                                        .unwrap()
                                        .written
                                        .insert(uid.to_string(), Instant::now());
                                }
                                return Some((
                                    Ok::<_, std::convert::Infallible>(Bytes::from(l)),
                                    (rx, backlog, g, false),
                                ));
                            }
                        }
                        Ok(Msg::Expire) => {
                            let e = json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                "message": "too old resource version", "reason": "Expired", "code": 410}});
                            return Some((
                                Ok(Bytes::from(e.to_string() + "\n")),
                                (rx, backlog, g, true),
                            ));
                        }
                        Ok(Msg::Close) | Err(broadcast::error::RecvError::Closed) => return None,
                        Err(broadcast::error::RecvError::Lagged(_)) => {}
                    }
                }
            }
        });
        return (
            [("content-type", "application/json")],
            Body::from_stream(stream),
        )
            .into_response();
    }
    api.state.lock().unwrap().list_requests += 1;
    let mut held = api.hold.subscribe();
    let _ = held.wait_for(|h| !*h).await;
    let mut s = api.state.lock().unwrap();
    if s.fail_lists {
        let e = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": "etcdserver: request timed out", "reason": "InternalError", "code": 500});
        return (
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            [("content-type", "application/json")],
            e.to_string(),
        )
            .into_response();
    }
    s.lists += 1;
    let items: Vec<Value> = s.pods.values().filter(|p| on_node(p)).cloned().collect();
    let list = json!({"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": s.rv.to_string()}, "items": items});
    ([("content-type", "application/json")], list.to_string()).into_response()
}
