//! The Kubernetes pod source against a scripted API server (`tower_test::mock::pair`):
//! the initial list (by this node's field selector), a watch event flipping a pod from
//! `shared_cores` to `reclaimed_cores`, `410 Gone`, and the relist that follows.

use coloc_agent::edges::source::kube::KubeSource;
use coloc_agent::edges::source::PodSource;
use http::{Request, Response};
use kube::client::Body;
use qos_core::Class;
use serde_json::json;
use std::pin::pin;
use std::time::{Duration, Instant};

const UA: &str = "aaaaaaaa-0000-0000-0000-000000000001";
const UB: &str = "bbbbbbbb-0000-0000-0000-000000000002";

fn pod(uid: &str, name: &str, qos: &str, rv: &str) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "ml", "uid": uid, "resourceVersion": rv,
                     "annotations": {"katalyst.kubewharf.io/qos_level": qos}},
        "spec": {"nodeName": "node1", "containers": [{"name": "c", "image": "i"}]}})
}

fn list(rv: &str, items: Vec<serde_json::Value>) -> Response<Body> {
    let l = json!({"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": rv}, "items": items});
    Response::new(Body::from(serde_json::to_vec(&l).unwrap()))
}

async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn list_watch_flip_gone_relist() {
    let (svc, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let src = KubeSource::start(kube::Client::new(svc, "default"), "node1");
    let mut handle = pin!(handle);

    // 1. The initial list asks for this node's pods only.
    let (req, send) = handle.next_request().await.expect("initial list");
    let uri = req.uri().to_string();
    assert!(uri.starts_with("/api/v1/pods?"), "{uri}");
    assert!(uri.contains("fieldSelector=spec.nodeName%3Dnode1"), "{uri}");
    assert!(!uri.contains("watch=true"), "{uri}");
    assert!(!src.ready(), "not ready before the list is in");
    send.send_response(list("10", vec![pod(UA, "a", "shared_cores", "9")]));

    // 2. The watch continues from the list's resource version; a pod flips to offline,
    //    then the server says 410 Gone.
    let (req, send) = handle.next_request().await.expect("watch");
    let uri = req.uri().to_string();
    assert!(
        uri.contains("watch=true") && uri.contains("resourceVersion=10"),
        "{uri}"
    );
    until("ready after the first list", || src.ready()).await;
    assert_eq!(src.get(UA).map(|e| e.class), Some(Class::Online));
    let mut body = serde_json::to_vec(
        &json!({"type": "MODIFIED", "object": pod(UA, "a", "reclaimed_cores", "11")}),
    )
    .unwrap();
    body.push(b'\n');
    body.extend(serde_json::to_vec(&json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1",
        "status": "Failure", "reason": "Expired", "message": "too old resource version", "code": 410}})).unwrap());
    body.push(b'\n');
    send.send_response(Response::new(Body::from(body)));
    until("flip to offline", || {
        src.get(UA).map(|e| e.class) == Some(Class::Offline)
    })
    .await;

    // 3. After 410 the watcher relists; pod a was deleted meanwhile, pod b created.
    let (req, send) = handle.next_request().await.expect("relist after 410");
    let uri = req.uri().to_string();
    assert!(
        !uri.contains("watch=true"),
        "410 must lead to a relist: {uri}"
    );
    send.send_response(list("20", vec![pod(UB, "b", "reclaimed_cores", "19")]));
    until("relist replaces the index", || {
        src.get(UA).is_none() && src.get(UB).is_some()
    })
    .await;
    assert!(src.ready());
}

/// A pod seen offline that later asks to be online (its annotation changed, perhaps while
/// the webhook could not review the update) stays offline; online → offline is allowed.
#[tokio::test]
async fn a_pod_seen_offline_never_turns_online() {
    let (svc, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let src = KubeSource::start(kube::Client::new(svc, "default"), "node1");
    let mut handle = pin!(handle);
    let (_, send) = handle.next_request().await.expect("initial list");
    send.send_response(list(
        "10",
        vec![
            pod(UA, "a", "reclaimed_cores", "9"),
            pod(UB, "b", "shared_cores", "9"),
        ],
    ));
    let (_, send) = handle.next_request().await.expect("watch");
    until("ready", || src.ready()).await;
    let mut body = Vec::new();
    for (uid, name, qos, rv) in [
        (UA, "a", "shared_cores", "11"),
        (UB, "b", "reclaimed_cores", "12"),
        (UB, "b", "shared_cores", "13"),
    ] {
        body.extend(
            serde_json::to_vec(&json!({"type": "MODIFIED", "object": pod(uid, name, qos, rv)}))
                .unwrap(),
        );
        body.push(b'\n');
    }
    send.send_response(Response::new(Body::from(body)));
    // The last event applied: b, offline once, asks for online again.
    until("b seen offline", || {
        src.get(UB).map(|e| e.class) == Some(Class::Offline)
    })
    .await;
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    assert_eq!(
        src.get(UA).map(|e| e.class),
        Some(Class::Offline),
        "a pod listed offline turned online"
    );
    assert_eq!(
        src.get(UB).map(|e| e.class),
        Some(Class::Offline),
        "a pod that turned offline turned online again"
    );
}

/// The attack on the first sight: pods whose mutable annotation and label were set to
/// online before the agent ever saw them, but whose immutable fields say offline (a
/// `vke.volcengine.com/reclaimed-mgpu-core` request, HAMi's `nvidia.com/priority: 1`,
/// Koordinator's `koord-batch` class or batch resources). They are offline from the first
/// list on, and later edits of the annotation and label change nothing; a plain pod with
/// the same annotation and label is online.
#[tokio::test]
async fn immutable_fields_decide_the_first_class_seen() {
    const UC: &str = "cccccccc-0000-0000-0000-000000000003";
    const UD: &str = "dddddddd-0000-0000-0000-000000000004";
    const UE: &str = "eeeeeeee-0000-0000-0000-000000000005";
    let claims_online = |uid: &str, name: &str, rv: &str, spec: serde_json::Value| {
        let mut p = pod(uid, name, "dedicated_cores", rv);
        p["metadata"]["labels"] = json!({"koordinator.sh/qosClass": "LSE"});
        for (k, v) in spec.as_object().unwrap() {
            p["spec"][k] = v.clone();
        }
        p
    };
    let limits = |res: serde_json::Value| json!({"containers": [{"name": "c", "image": "i", "resources": {"limits": res}}]});
    let pods = |rv: &str| {
        vec![
            claims_online(
                UA,
                "vke",
                rv,
                limits(json!({"vke.volcengine.com/reclaimed-mgpu-core": "50"})),
            ),
            claims_online(
                UB,
                "hami",
                rv,
                limits(json!({"nvidia.com/gpu": "1", "nvidia.com/priority": "1"})),
            ),
            claims_online(
                UC,
                "koord",
                rv,
                json!({"priorityClassName": "koord-batch", "priority": 5500}),
            ),
            claims_online(
                UD,
                "batch",
                rv,
                limits(json!({"kubernetes.io/batch-cpu": "2000"})),
            ),
            claims_online(
                UE,
                "plain",
                rv,
                limits(json!({"nvidia.com/gpu": "1", "nvidia.com/priority": "0"})),
            ),
        ]
    };
    let (svc, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let src = KubeSource::start(kube::Client::new(svc, "default"), "node1");
    let mut handle = pin!(handle);
    let (_, send) = handle.next_request().await.expect("initial list");
    send.send_response(list("10", pods("9")));
    let (_, send) = handle.next_request().await.expect("watch");
    until("ready", || src.ready()).await;
    for uid in [UA, UB, UC, UD] {
        assert_eq!(
            src.get(uid).map(|e| e.class),
            Some(Class::Offline),
            "{uid}: first seen online"
        );
    }
    assert_eq!(src.get(UE).map(|e| e.class), Some(Class::OnlineExclusive));
    // The tenant edits the mutable fields again (a MODIFIED event each): nothing changes.
    let mut body = Vec::new();
    for mut p in pods("11") {
        p["metadata"]["annotations"]["katalyst.kubewharf.io/qos_level"] = json!("shared_cores");
        p["metadata"]["labels"]["koordinator.sh/qosClass"] = json!("LS");
        body.extend(serde_json::to_vec(&json!({"type": "MODIFIED", "object": p})).unwrap());
        body.push(b'\n');
    }
    send.send_response(Response::new(Body::from(body)));
    until("the plain pod's edit applied", || {
        src.get(UE).map(|e| e.class) == Some(Class::Online)
    })
    .await;
    for uid in [UA, UB, UC, UD] {
        assert_eq!(
            src.get(uid).map(|e| e.class),
            Some(Class::Offline),
            "{uid}: turned online by an edit"
        );
    }
}
