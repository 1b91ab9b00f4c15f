//! The webhook driven through its router with AdmissionReview fixtures (tests/data/),
//! over real HTTPS once, and fuzzed for a bounded time.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use coloc_webhook::server::{router, AppState, Limits};
use coloc_webhook::translate::{Backend, Settings};
use http_body_util::BodyExt;
use serde_json::Value;
use tower::ServiceExt;

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(format!(
        "{}/tests/data/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap()
}

fn app(backend: Backend) -> axum::Router {
    router(AppState::new(
        Settings::with_priority_class(backend, "gpu-coloc-offline", -10),
        Limits {
            max_body: 64 * 1024,
            ..Limits::default()
        },
        None,
    ))
}

async fn post(app: &axum::Router, path: &str, body: Vec<u8>) -> (StatusCode, Vec<u8>) {
    let req = Request::post(path)
        .header("content-type", "application/json")
        .body(Body::from(body))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    (
        status,
        resp.into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
}

/// Applies the response's patch to the request's object.
fn patched(request: &[u8], response: &Value) -> Value {
    let req: Value = serde_json::from_slice(request).unwrap();
    let mut pod = req["request"]["object"].clone();
    if let Some(p) = response["response"]["patch"].as_str() {
        use std::io::Read;
        let bytes = base64_decode(p);
        let mut s = String::new();
        bytes.as_slice().read_to_string(&mut s).unwrap();
        let patch: json_patch::Patch = serde_json::from_str(&s).unwrap();
        json_patch::patch(&mut pod, &patch).unwrap();
    }
    pod
}

fn base64_decode(s: &str) -> Vec<u8> {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD
        .decode(s)
        .expect("patch is base64")
}

fn rerun_with(request: &[u8], pod: &Value) -> Vec<u8> {
    let mut req: Value = serde_json::from_slice(request).unwrap();
    req["request"]["object"] = pod.clone();
    serde_json::to_vec(&req).unwrap()
}

#[tokio::test]
async fn fixtures_allowed_and_patched_idempotently_for_every_backend() {
    for backend in [Backend::Vke, Backend::NvidiaShared, Backend::Hami] {
        let app = app(backend);
        for name in [
            "offline-deployment-create",
            "online-create-no-annotations",
            "offline-dryrun",
            "offline-multi-container-init",
            "online-update",
            "plain-pod",
            "delete",
        ] {
            let body = fixture(name);
            let (status, out) = post(&app, "/mutate", body.clone()).await;
            assert_eq!(status, StatusCode::OK, "{backend} {name}");
            let resp: Value = serde_json::from_slice(&out).unwrap();
            assert_eq!(resp["apiVersion"], "admission.k8s.io/v1");
            assert_eq!(
                resp["response"]["uid"],
                "705ab4f5-6393-11e8-b7cc-42010a800002"
            );
            assert_eq!(
                resp["response"]["allowed"], true,
                "{backend} {name}: {resp}"
            );
            let pod = patched(&body, &resp);
            // A second review of the mutated pod changes nothing.
            let (_, out2) = post(&app, "/mutate", rerun_with(&body, &pod)).await;
            let resp2: Value = serde_json::from_slice(&out2).unwrap();
            assert!(
                resp2["response"]["patch"].is_null(),
                "{backend} {name}: second pass patched: {resp2}"
            );
            // And the validating path accepts what the mutating path produced.
            let (_, v) = post(&app, "/validate", rerun_with(&body, &pod)).await;
            assert_eq!(
                serde_json::from_slice::<Value>(&v).unwrap()["response"]["allowed"],
                true
            );
        }
    }
}

#[tokio::test]
async fn translation_per_backend() {
    let body = fixture("offline-multi-container-init");
    let hami = patched(
        &body,
        &serde_json::from_slice(&post(&app(Backend::Hami), "/mutate", body.clone()).await.1)
            .unwrap(),
    );
    let worker = &hami["spec"]["containers"][0]["resources"]["limits"];
    assert_eq!(worker["nvidia.com/gpucores"], "30");
    assert_eq!(worker["nvidia.com/gpumem"], "2048");
    assert_eq!(worker["nvidia.com/priority"], "1");
    assert_eq!(
        hami["spec"]["initContainers"][0]["resources"]["limits"]["nvidia.com/gpucores"],
        "10"
    );
    assert!(
        hami["spec"]["containers"][1]["resources"]["limits"]
            .get("nvidia.com/gpu")
            .is_none(),
        "sidecar untouched"
    );
    let shared = patched(
        &body,
        &serde_json::from_slice(
            &post(
                &app(Backend::NvidiaShared),
                "/mutate?backend=nvidia-shared",
                body.clone(),
            )
            .await
            .1,
        )
        .unwrap(),
    );
    assert_eq!(
        shared["spec"]["containers"][0]["env"][0]["name"],
        "CUDA_MPS_CLIENT_PRIORITY"
    );
    assert_eq!(
        shared["metadata"]["annotations"]["gpu-coloc.dev/backend"],
        "nvidia-shared"
    );
    // The namespace's backend (query) overrides the default.
    let vke = patched(
        &body,
        &serde_json::from_slice(
            &post(&app(Backend::Hami), "/mutate?backend=vke", body.clone())
                .await
                .1,
        )
        .unwrap(),
    );
    assert_eq!(
        vke["spec"]["containers"][0]["resources"]["limits"]
            ["vke.volcengine.com/reclaimed-mgpu-core"],
        "30"
    );
    let online = fixture("online-create-no-annotations");
    let p = patched(
        &online,
        &serde_json::from_slice(&post(&app(Backend::Vke), "/mutate", online.clone()).await.1)
            .unwrap(),
    );
    assert_eq!(
        p["metadata"]["annotations"]["katalyst.kubewharf.io/qos_level"],
        "shared_cores"
    );
    assert!(
        p["spec"].get("priorityClassName").is_none(),
        "online pods get no offline priority class"
    );
}

/// The pod as created through `/mutate?backend=B` (the patch applied).
async fn created(backend: Backend, name: &str) -> (Vec<u8>, Value) {
    let body = fixture(name);
    let (status, out) = post(
        &app(backend),
        &format!("/mutate?backend={backend}"),
        body.clone(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let resp: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(
        resp["response"]["allowed"], true,
        "{backend} {name}: {resp}"
    );
    let pod = patched(&body, &resp);
    (body, pod)
}

/// An UPDATE review of `old` to `new`, built from a CREATE fixture's envelope.
fn update_review(envelope: &[u8], old: &Value, new: &Value) -> Vec<u8> {
    let mut req: Value = serde_json::from_slice(envelope).unwrap();
    req["request"]["operation"] = "UPDATE".into();
    req["request"]["options"]["kind"] = "UpdateOptions".into();
    req["request"]["object"] = new.clone();
    req["request"]["oldObject"] = old.clone();
    serde_json::to_vec(&req).unwrap()
}

fn with_annotation(pod: &Value, key: &str, value: Option<&str>) -> Value {
    let mut p = pod.clone();
    let ann = p["metadata"]["annotations"].as_object_mut().unwrap();
    match value {
        Some(v) => ann.insert(key.into(), v.into()),
        None => ann.remove(key),
    };
    p
}

const QOS: &str = "katalyst.kubewharf.io/qos_level";
const POLICY: &str = "vke.volcengine.com/mgpu-compute-policy";
const REQUESTED: &str = "gpu-coloc.dev/requested";
const REQUESTS: &str = "gpu-coloc.dev/requests";

/// Reviews an UPDATE on both endpoints; returns the mutating response.
async fn review_update(backend: Backend, envelope: &[u8], old: &Value, new: &Value) -> Value {
    let body = update_review(envelope, old, new);
    let app = app(backend);
    let (status, out) = post(&app, &format!("/mutate?backend={backend}"), body.clone()).await;
    assert_eq!(status, StatusCode::OK);
    let m: Value = serde_json::from_slice(&out).unwrap();
    let (_, out) = post(&app, "/validate", body.clone()).await;
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(
        m["response"]["allowed"], v["response"]["allowed"],
        "/mutate and /validate agree: {m} {v}"
    );
    // The API server forbids changing resources, env or the priority class of a pod:
    // an UPDATE patch touches metadata only.
    if let Some(p) = m["response"]["patch"].as_str() {
        let ops: Value = serde_json::from_slice(&base64_decode(p)).unwrap();
        for op in ops.as_array().unwrap() {
            let path = op["path"].as_str().unwrap();
            assert!(
                path.starts_with("/metadata/annotations"),
                "UPDATE patch touches {path}: {ops}"
            );
        }
    }
    m
}

fn denial(r: &Value) -> String {
    assert_eq!(r["response"]["allowed"], false, "expected a denial: {r}");
    assert_eq!(r["response"]["status"]["code"], 403);
    r["response"]["status"]["message"]
        .as_str()
        .unwrap()
        .to_string()
}

#[tokio::test]
async fn creation_records_what_the_pod_asked_for() {
    for backend in [Backend::Vke, Backend::NvidiaShared, Backend::Hami] {
        for (name, record) in [
            (
                "offline-deployment-create",
                "offline-cores=50;online-cores=0;memory-mib=8192",
            ),
            (
                "offline-multi-container-init",
                "offline-cores=40;online-cores=0;memory-mib=2048",
            ),
            (
                "online-create-no-annotations",
                "offline-cores=0;online-cores=30;memory-mib=4096",
            ),
        ] {
            let (_, pod) = created(backend, name).await;
            assert_eq!(
                pod["metadata"]["annotations"][REQUESTED], record,
                "{backend} {name}"
            );
        }
        // A pod without mGPU requests gets no record.
        let (_, plain) = created(backend, "plain-pod").await;
        assert!(plain["metadata"]["annotations"].get(REQUESTED).is_none());
    }
}

/// The UPDATE bypass: after `hami`/`nvidia-shared` removed the vke requests, an UPDATE to
/// an online or system `qos_level` was allowed. Checked against the record, for every
/// backend.
#[tokio::test]
async fn update_cannot_change_what_an_offline_pod_is() {
    for backend in [Backend::Vke, Backend::NvidiaShared, Backend::Hami] {
        let (env, pod) = created(backend, "offline-deployment-create").await;
        for level in [
            "shared_cores",
            "system_cores",
            "dedicated_cores",
            "reclaimed",
        ] {
            let r = review_update(
                backend,
                &env,
                &pod,
                &with_annotation(&pod, QOS, Some(level)),
            )
            .await;
            let msg = denial(&r);
            assert!(
                msg.contains(level) && msg.contains("vke.volcengine.com/reclaimed-mgpu-core"),
                "{backend} {level}: {msg}"
            );
        }
        let r = review_update(
            backend,
            &env,
            &pod,
            &with_annotation(&pod, POLICY, Some("native-burst-share")),
        )
        .await;
        assert!(denial(&r).contains("native-burst-share"), "{backend}");

        // The record is guarded.
        let r = review_update(backend, &env, &pod, &with_annotation(&pod, REQUESTED, None)).await;
        assert!(denial(&r).contains("cannot be removed"), "{backend}");
        let forged = with_annotation(
            &pod,
            REQUESTED,
            Some("offline-cores=0;online-cores=50;memory-mib=8192"),
        );
        let r = review_update(backend, &env, &pod, &forged).await;
        assert!(denial(&r).contains("cannot be changed"), "{backend}");
        // Changing both the record and the qos_level at once does not help.
        let r = review_update(
            backend,
            &env,
            &pod,
            &with_annotation(&forged, QOS, Some("shared_cores")),
        )
        .await;
        assert!(denial(&r).contains(REQUESTED), "{backend}");

        // Removing qos_level: it is put back, as at creation.
        let r = review_update(backend, &env, &pod, &with_annotation(&pod, QOS, None)).await;
        assert_eq!(r["response"]["allowed"], true, "{r}");
        let fixed = patched(
            &update_review(&env, &pod, &with_annotation(&pod, QOS, None)),
            &r,
        );
        assert_eq!(fixed["metadata"]["annotations"][QOS], "reclaimed_cores");

        // An unrelated update is allowed and not patched.
        let mut labelled = pod.clone();
        labelled["metadata"]["labels"]["team"] = "ml".into();
        let r = review_update(backend, &env, &pod, &labelled).await;
        assert_eq!(r["response"]["allowed"], true, "{backend}: {r}");
        assert!(r["response"]["patch"].is_null(), "{backend}: {r}");
    }
}

#[tokio::test]
async fn update_cannot_make_an_online_pod_offline_or_system() {
    for backend in [Backend::Vke, Backend::NvidiaShared, Backend::Hami] {
        let (env, pod) = created(backend, "online-create-no-annotations").await;
        for level in ["reclaimed_cores", "system_cores"] {
            let r = review_update(
                backend,
                &env,
                &pod,
                &with_annotation(&pod, QOS, Some(level)),
            )
            .await;
            let msg = denial(&r);
            assert!(
                msg.contains(level) && msg.contains("vke.volcengine.com/mgpu-core"),
                "{backend} {level}: {msg}"
            );
        }
        let r = review_update(
            backend,
            &env,
            &pod,
            &with_annotation(&pod, QOS, Some("dedicated_cores")),
        )
        .await;
        assert_eq!(r["response"]["allowed"], true, "{backend}: {r}");
    }
}

/// Pods admitted by an older webhook carry only the per-container record (`hami`,
/// `nvidia-shared`) or nothing (`vke`, whose requests stay in the spec).
#[tokio::test]
async fn update_of_pods_admitted_before_the_record() {
    for backend in [Backend::Vke, Backend::NvidiaShared, Backend::Hami] {
        let (env, pod) = created(backend, "offline-deployment-create").await;
        let old = with_annotation(&pod, REQUESTED, None);
        let r = review_update(
            backend,
            &env,
            &old,
            &with_annotation(&old, QOS, Some("shared_cores")),
        )
        .await;
        let msg = denial(&r);
        assert!(msg.contains("shared_cores"), "{backend}: {msg}");
        // Adding the record later is not allowed either.
        let r = review_update(backend, &env, &old, &pod).await;
        assert!(denial(&r).contains("cannot be added"), "{backend}");
        if backend != Backend::Vke {
            let r =
                review_update(backend, &env, &old, &with_annotation(&old, REQUESTS, None)).await;
            assert!(denial(&r).contains("cannot be removed"), "{backend}");
        }
    }
    // A plain pod may not acquire a record.
    let (env, pod) = created(Backend::Hami, "plain-pod").await;
    let mut forged = pod.clone();
    forged["metadata"]["annotations"] =
        serde_json::json!({REQUESTED: "offline-cores=0;online-cores=30;memory-mib=0"});
    let r = review_update(Backend::Hami, &env, &pod, &forged).await;
    assert!(denial(&r).contains("cannot be added"));
}

#[tokio::test]
async fn denials_carry_clear_messages() {
    let app = app(Backend::Hami);
    for (name, needle) in [
        ("deny-shared-asks-reclaimed", "shared_cores"),
        ("deny-both-cores", "\"main\" asks for both"),
        ("deny-out-of-range", "150 is out of range"),
        ("deny-native-burst-offline", "native-burst-share"),
        ("deny-memory-without-cores", "without cores"),
        ("deny-malformed-quantity", "\"30%\""),
    ] {
        for path in ["/mutate", "/validate"] {
            let (status, out) = post(&app, path, fixture(name)).await;
            assert_eq!(status, StatusCode::OK);
            let r: Value = serde_json::from_slice(&out).unwrap();
            assert_eq!(r["response"]["allowed"], false, "{name}");
            let msg = r["response"]["status"]["message"].as_str().unwrap();
            assert!(msg.contains(needle), "{name}: {msg}");
            assert_eq!(r["response"]["status"]["code"], 403);
        }
    }
}

/// Each denial bites: the pod is denied on both endpoints for every backend, and the
/// message names the container and the offending value (and the metric reason is right).
#[tokio::test]
async fn denials_name_the_container_and_the_offending_value() {
    const R: &str = "vke.volcengine.com/reclaimed-mgpu-core";
    const M: &str = "vke.volcengine.com/mgpu-core";
    let cases: [(&str, &str, Vec<String>); 8] = [
        (
            "deny-shared-asks-reclaimed",
            "qos_contradiction",
            vec![
                "container \"main\"".into(),
                format!("{R}=30"),
                format!("{QOS}=shared_cores"),
            ],
        ),
        (
            "deny-mixed-pod",
            "mixed_pod",
            vec![
                "\"server\"".into(),
                format!("{M}=20"),
                "\"trainer\"".into(),
                format!("{R}=30"),
            ],
        ),
        (
            "deny-both-cores",
            "both_online_and_offline",
            vec!["\"main\"".into(), format!("{M}=20"), format!("{R}=30")],
        ),
        (
            "deny-unknown-qos",
            "qos_unknown",
            vec![
                format!("{QOS}=\"batch\""),
                "\"main\"".into(),
                format!("{R}=30"),
            ],
        ),
        (
            "deny-dedicated-asks-reclaimed",
            "qos_contradiction",
            vec![
                "\"main\"".into(),
                format!("{R}=30"),
                format!("{QOS}=dedicated_cores"),
            ],
        ),
        (
            "deny-system-asks-reclaimed",
            "qos_contradiction",
            vec![
                "\"main\"".into(),
                format!("{R}=40"),
                format!("{QOS}=system_cores"),
            ],
        ),
        (
            "deny-reclaimed-asks-online",
            "qos_contradiction",
            vec![
                "\"main\"".into(),
                format!("{M}=20"),
                format!("{QOS}=reclaimed_cores"),
            ],
        ),
        (
            "deny-system-asks-online",
            "qos_contradiction",
            vec![
                "\"main\"".into(),
                format!("{M}=25"),
                format!("{QOS}=system_cores"),
            ],
        ),
    ];
    for backend in [Backend::Vke, Backend::NvidiaShared, Backend::Hami] {
        let app = app(backend);
        for (name, reason, needles) in &cases {
            for path in ["/mutate", "/validate"] {
                let (status, out) = post(&app, path, fixture(name)).await;
                assert_eq!(status, StatusCode::OK);
                let r: Value = serde_json::from_slice(&out).unwrap();
                let msg = denial(&r);
                for needle in needles {
                    assert!(
                        msg.contains(needle.as_str()),
                        "{backend} {name} {path}: {needle:?} not in {msg}"
                    );
                }
            }
            let settings = Settings::new(backend);
            let r = coloc_webhook::review::review(
                &fixture(name),
                coloc_webhook::review::Mode::Mutate,
                None,
                &settings,
            );
            assert_eq!(r.result, "denied");
            assert_eq!(r.reason, Some(*reason), "{name}");
            assert!(
                coloc_webhook::translate::DENIAL_REASONS.contains(reason),
                "{reason} is not among the reasons counted from start"
            );
        }
    }
}

#[tokio::test]
async fn bad_input_is_400_never_a_panic() {
    let app = app(Backend::Hami);
    let cases: Vec<Vec<u8>> = vec![
        b"".to_vec(),
        b"{".to_vec(),
        b"null".to_vec(),
        br#"{"apiVersion":"admission.k8s.io/v1beta1","kind":"AdmissionReview","request":null}"#
            .to_vec(),
        br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#.to_vec(),
        br#"{"apiVersion":"v1","kind":"Pod"}"#.to_vec(),
    ];
    for body in cases {
        let (status, _) = post(&app, "/mutate", body.clone()).await;
        assert_eq!(
            status,
            StatusCode::BAD_REQUEST,
            "{}",
            String::from_utf8_lossy(&body[..body.len().min(80)])
        );
    }
    let (status, _) = post(&app, "/mutate?backend=volcano", fixture("plain-pod")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn bodies_over_the_limit_are_413() {
    let app = app(Backend::Hami);
    // Read past the limit (no Content-Length: streamed).
    let (status, _) = post(&app, "/mutate", vec![b'x'; 64 * 1024 + 1]).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    // Declared too large: refused before reading.
    let req = Request::post("/validate")
        .header("content-length", (64 * 1024 + 1).to_string())
        .body(Body::from(vec![b'x'; 64 * 1024 + 1]))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
    // At the limit: read (and a 400, as it is no review).
    let (status, _) = post(&app, "/mutate", vec![b'x'; 64 * 1024]).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

/// A body that never ends: 408 within the body read timeout; and it holds no review
/// slot meanwhile: with one slot, a normal review is answered at once.
#[tokio::test(start_paused = true)]
async fn slow_bodies_time_out_and_hold_no_review_slot() {
    use tokio::time::{Duration, Instant};
    let limits = Limits {
        body_read_timeout: Duration::from_secs(2),
        max_concurrent_reviews: 1,
        ..Limits::default()
    };
    let app = router(AppState::new(Settings::new(Backend::Hami), limits, None));
    let t = Instant::now();
    let slow = tokio::spawn(
        app.clone().oneshot(
            Request::post("/mutate")
                .body(Body::from_stream(trickle()))
                .unwrap(),
        ),
    );
    tokio::time::sleep(Duration::from_millis(10)).await;
    let normal = tokio::spawn(
        app.clone().oneshot(
            Request::post("/mutate")
                .body(Body::from(fixture("offline-deployment-create")))
                .unwrap(),
        ),
    );
    // Bounded (in virtual time) even if a limit is gone.
    let bound = Duration::from_secs(10);
    let normal = tokio::time::timeout(bound, normal)
        .await
        .expect("review never answered")
        .unwrap()
        .unwrap();
    let waited = t.elapsed();
    let slow = tokio::time::timeout(bound, slow)
        .await
        .expect("endless body never cut off")
        .unwrap()
        .unwrap();
    assert_eq!(slow.status(), StatusCode::REQUEST_TIMEOUT);
    assert_eq!(normal.status(), StatusCode::OK);
    assert!(waited < Duration::from_millis(100), "{waited:?}");
    assert!(t.elapsed() >= Duration::from_secs(2), "{:?}", t.elapsed());
}

/// Bodies being read hold at most `max_concurrent_reviews × max_body` bytes together:
/// past that, 503 at once (a half-sent body holds what it has sent, no more).
#[tokio::test]
async fn bodies_in_flight_are_bounded_in_memory() {
    let limits = Limits {
        max_concurrent_reviews: 1,
        max_body: 64 * 1024,
        ..Limits::default()
    };
    let app = router(AppState::new(Settings::new(Backend::Hami), limits, None));
    // 48 KiB sent, the rest never comes.
    let (mut tx, body) = futures::channel::mpsc::channel::<Result<Vec<u8>, std::io::Error>>(1);
    use futures::SinkExt;
    tx.send(Ok(vec![b' '; 48 * 1024])).await.unwrap();
    let held = tokio::spawn(
        app.clone().oneshot(
            Request::post("/mutate")
                .body(Body::from_stream(body))
                .unwrap(),
        ),
    );
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    // Another 32 KiB would pass the 64 KiB budget.
    let (status, _) = post(&app, "/mutate", vec![b' '; 32 * 1024]).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    // A small review still fits.
    let (status, _) = post(&app, "/mutate", fixture("offline-deployment-create")).await;
    assert_eq!(status, StatusCode::OK);
    drop(tx);
    let held = held.await.unwrap().unwrap();
    assert_eq!(held.status(), StatusCode::BAD_REQUEST);
}

/// An endless body: one byte every 100 ms.
fn trickle() -> impl futures::Stream<Item = Result<Vec<u8>, std::io::Error>> {
    futures::stream::unfold((), |()| async {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        Some((Ok(b" ".to_vec()), ()))
    })
}

/// A pod translated already (the webhook invoked again after another webhook's mutation,
/// or `/validate` with the default backend after `/mutate?backend=hami`) is held to its
/// record at CREATE too.
#[tokio::test]
async fn translated_pod_is_held_to_its_record() {
    for backend in [Backend::NvidiaShared, Backend::Hami] {
        let (env, pod) = created(backend, "offline-deployment-create").await;
        let flipped = with_annotation(&pod, QOS, Some("shared_cores"));
        for (b, path) in [
            (backend, format!("/mutate?backend={backend}")),
            (Backend::Vke, "/validate".to_string()),
        ] {
            let (_, out) = post(&app(b), &path, rerun_with(&env, &flipped)).await;
            let msg = denial(&serde_json::from_slice(&out).unwrap());
            assert!(
                msg.contains(REQUESTED) && msg.contains("shared_cores"),
                "{msg}"
            );
        }
        let (_, out) = post(
            &app(backend),
            "/validate",
            rerun_with(
                &env,
                &with_annotation(&pod, REQUESTED, Some("offline-cores=1")),
            ),
        )
        .await;
        assert!(denial(&serde_json::from_slice(&out).unwrap())
            .contains("written by the gpu-coloc webhook"));
    }
}

mod fuzz {
    //! Bounded fuzzing (a few seconds on 2 cores). Every 200 response echoes the request's
    //! uid; every allowed response satisfies the invariants in [`check`].
    use super::*;
    use coloc_webhook::review::{review, Mode, Reviewed};
    use proptest::prelude::*;

    const R: &str = "vke.volcengine.com/reclaimed-mgpu-core";
    const M: &str = "vke.volcengine.com/mgpu-core";
    const MEM: &str = "vke.volcengine.com/mgpu-memory";

    fn settings(backend: Backend) -> Settings {
        Settings::with_priority_class(backend, "p", -10)
    }

    fn seeds() -> Vec<Vec<u8>> {
        let mut paths: Vec<_> =
            std::fs::read_dir(format!("{}/tests/data", env!("CARGO_MANIFEST_DIR")))
                .unwrap()
                .map(|e| e.unwrap().path())
                .collect();
        paths.sort();
        paths.iter().map(|p| std::fs::read(p).unwrap()).collect()
    }

    /// Which cores the pod asks for, read independently of the webhook: the
    /// `vke.volcengine.com/*` requests in its spec and the record.
    fn asks(pod: &Value) -> (bool, bool) {
        let (mut online, mut offline) = (false, false);
        for list in ["initContainers", "containers"] {
            for c in pod["spec"][list].as_array().into_iter().flatten() {
                for part in ["limits", "requests"] {
                    let res = &c["resources"][part];
                    online |= res.get(M).is_some();
                    offline |= res.get(R).is_some();
                }
            }
        }
        if let Some(rec) = pod["metadata"]["annotations"][REQUESTED].as_str() {
            let n = |key: &str| -> u64 {
                rec.split(';')
                    .find_map(|f| f.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
                    .unwrap_or(0)
            };
            match (n("offline-cores") > 0, n("online-cores") > 0) {
                (true, false) => offline = true,
                (false, true) => online = true,
                _ => {}
            }
        }
        (online, offline)
    }

    /// The invariants of one reviewed request.
    fn check(
        request: &[u8],
        mode: Mode,
        backend: Option<Backend>,
        r: &Reviewed,
    ) -> Result<(), TestCaseError> {
        prop_assert!(r.status == 200 || r.status == 400, "status {}", r.status);
        if r.status != 200 {
            return Ok(());
        }
        let req: Value = serde_json::from_slice(request).unwrap();
        let resp: Value = serde_json::from_slice(&r.body).unwrap();
        // The response answers this request.
        prop_assert_eq!(&resp["response"]["uid"], &req["request"]["uid"]);
        if resp["response"]["allowed"] != true {
            prop_assert_eq!(r.result, "denied");
            return Ok(());
        }
        if mode == Mode::Validate {
            prop_assert!(resp["response"]["patch"].is_null(), "/validate patched");
        }
        // The patch applies to the object it was made for.
        let pod = patched(request, &resp);
        if req["request"]["operation"] == "UPDATE" {
            if let Some(p) = resp["response"]["patch"].as_str() {
                let ops: Value = serde_json::from_slice(&base64_decode(p)).unwrap();
                for op in ops.as_array().unwrap() {
                    let path = op["path"].as_str().unwrap_or("");
                    prop_assert!(
                        path == "/metadata" || path.starts_with("/metadata/annotations"),
                        "UPDATE patch touches {}",
                        path
                    );
                }
            }
        }
        // Idempotent: the patched object reviewed again is allowed and not patched.
        let again = rerun_with(request, &pod);
        let r2 = review(
            &again,
            mode,
            backend,
            &settings(backend.unwrap_or(Backend::Hami)),
        );
        prop_assert_eq!(r2.status, 200);
        let resp2: Value = serde_json::from_slice(&r2.body).unwrap();
        prop_assert_eq!(
            &resp2["response"]["allowed"],
            &Value::Bool(true),
            "second pass: {}",
            resp2
        );
        prop_assert!(
            resp2["response"]["patch"].is_null(),
            "second pass patched: {}",
            resp2
        );
        // Only Pods are ours: the core group's Pod kind, no subresource, CREATE or UPDATE
        // (the API server sets these; a mutated envelope that names another kind, group or
        // operation is not a pod review, and is allowed unchanged).
        let r = &req["request"];
        let is_pod = r["kind"]["kind"] == "Pod"
            && r["kind"]["group"].as_str() == Some("")
            && r["subResource"].is_null()
            && matches!(r["operation"].as_str(), Some("CREATE" | "UPDATE"));
        if !is_pod || !pod.is_object() {
            return Ok(());
        }
        let qos = pod["metadata"]["annotations"][QOS].as_str().map(str::trim);
        let (online, offline) = asks(&pod);
        // Never an offline pod without reclaimed cores (when it asks for mGPU cores at
        // all; a CPU-only reclaimed_cores pod is none of the webhook's business), nor
        // one that asks for online cores.
        if qos == Some("reclaimed_cores") && (online || offline) {
            prop_assert!(
                offline && !online,
                "reclaimed_cores pod asks for online cores: {}",
                pod
            );
        }
        // And never a pod asking for reclaimed cores that is anything but reclaimed_cores
        // (missing only on /validate, which does not patch).
        if offline {
            prop_assert!(!online, "pod asks for online and offline cores: {}", pod);
            let ok = qos == Some("reclaimed_cores") || (mode == Mode::Validate && qos.is_none());
            prop_assert!(ok, "pod asks for reclaimed cores but is {:?}: {}", qos, pod);
        }
        if online {
            let ok = matches!(qos, Some("shared_cores" | "dedicated_cores"))
                || (mode == Mode::Validate && qos.is_none());
            prop_assert!(ok, "pod asks for online cores but is {:?}: {}", qos, pod);
        }
        Ok(())
    }

    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            "[ -~]{0,12}".prop_map(Value::String),
            prop_oneof![
                Just("30"),
                Just("100"),
                Just("-1"),
                Just("1e3"),
                Just("9999999999999999999999")
            ]
            .prop_map(|s| Value::String(s.into())),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map(
                    prop_oneof![
                        Just("vke.volcengine.com/reclaimed-mgpu-core".to_string()),
                        Just("vke.volcengine.com/mgpu-core".to_string()),
                        Just("vke.volcengine.com/mgpu-memory".to_string()),
                        Just("limits".to_string()),
                        Just("resources".to_string()),
                        Just("annotations".to_string()),
                        "[a-z]{1,6}",
                    ],
                    inner,
                    0..4
                )
                .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    fn arb_backend() -> impl Strategy<Value = Backend> {
        prop_oneof![
            Just(Backend::Vke),
            Just(Backend::NvidiaShared),
            Just(Backend::Hami)
        ]
    }

    fn arb_quantity() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("1"),
            Just("30"),
            Just("100"),
            Just("200"),
            Just(" 30 "),
            Just("1k"),
            Just("0"),
            Just("150"),
            Just("0.5"),
            Just("abc"),
        ]
        .prop_map(String::from)
    }

    /// One container's resources: mostly plausible mGPU requests, sometimes wrong ones.
    fn arb_resources() -> impl Strategy<Value = Value> {
        (
            prop::option::weighted(0.4, arb_quantity()),
            prop::option::weighted(0.4, arb_quantity()),
            prop::option::weighted(0.3, arb_quantity()),
            0u8..3,
            prop::option::weighted(0.05, arb_quantity()),
        )
            .prop_map(|(online, offline, memory, parts, other)| {
                let mut m = serde_json::Map::new();
                m.insert("cpu".into(), "1".into());
                for (k, v) in [(M, online), (R, offline), (MEM, memory)] {
                    if let Some(v) = v {
                        m.insert(k.into(), v.into());
                    }
                }
                let mut requests = m.clone();
                if let Some(other) = other {
                    requests.insert(R.into(), other.into());
                }
                match parts {
                    0 => serde_json::json!({"limits": m}),
                    1 => serde_json::json!({"requests": requests}),
                    _ => serde_json::json!({"limits": m, "requests": requests}),
                }
            })
    }

    fn arb_annotation(values: &'static [&'static str]) -> impl Strategy<Value = Option<String>> {
        prop::option::weighted(0.6, prop::sample::select(values).prop_map(String::from))
    }

    /// A pod: containers, init containers, annotations (a record, right or forged, now and
    /// then), sometimes without vke requests (as translated by another backend).
    fn arb_pod() -> impl Strategy<Value = Value> {
        (
            prop::collection::vec(arb_resources(), 1..3),
            prop::collection::vec(arb_resources(), 0..2),
            arb_annotation(&["shared_cores", "dedicated_cores", "reclaimed_cores", "system_cores", "batch", ""]),
            arb_annotation(&["fixed-share", "guaranteed-burst-share", "native-burst-share", "weird"]),
            prop::option::weighted(0.3, prop::sample::select(&[
                "offline-cores=30;online-cores=0;memory-mib=0",
                "offline-cores=0;online-cores=30;memory-mib=0",
                "offline-cores=0;online-cores=0;memory-mib=0",
                "garbage",
            ][..])),
            any::<bool>(),
            // As a backend other than vke leaves it: no vke.volcengine.com/* requests.
            prop::bool::weighted(0.25),
        )
            .prop_map(|(cs, inits, qos, policy, record, priority, translated)| {
                let container = |prefix: &str, i: usize, res: &Value| {
                    let res = if translated { serde_json::json!({"limits": {"nvidia.com/gpu": "1"}}) } else { res.clone() };
                    serde_json::json!({"name": format!("{prefix}{i}"), "image": "x", "resources": res})
                };
                let mut ann = serde_json::Map::new();
                for (k, v) in [(QOS, qos), (POLICY, policy), (REQUESTED, record.map(String::from))] {
                    if let Some(v) = v {
                        ann.insert(k.into(), v.into());
                    }
                }
                let mut spec = serde_json::json!({
                    "containers": cs.iter().enumerate().map(|(i, r)| container("c", i, r)).collect::<Vec<_>>(),
                });
                if !inits.is_empty() {
                    spec["initContainers"] = inits.iter().enumerate().map(|(i, r)| container("init", i, r)).collect();
                }
                if priority {
                    spec["priorityClassName"] = "batch".into();
                }
                let mut metadata = serde_json::json!({"name": "p", "namespace": "ml"});
                if !ann.is_empty() {
                    metadata["annotations"] = Value::Object(ann);
                }
                serde_json::json!({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec})
            })
    }

    /// An edit an UPDATE makes to the created pod's annotations or labels.
    fn arb_edit() -> impl Strategy<Value = (usize, Option<&'static str>)> {
        (
            0usize..5,
            prop::option::weighted(
                0.8,
                prop::sample::select(
                    &[
                        "shared_cores",
                        "dedicated_cores",
                        "reclaimed_cores",
                        "system_cores",
                        "batch",
                        "native-burst-share",
                        "fixed-share",
                        "offline-cores=0;online-cores=30;memory-mib=0",
                        "offline-cores=30;online-cores=0;memory-mib=0",
                    ][..],
                ),
            ),
        )
    }

    fn envelope(
        name: &str,
        uid: &str,
        operation: &str,
        object: &Value,
        old: Option<&Value>,
    ) -> Vec<u8> {
        let mut req: Value = serde_json::from_slice(&fixture(name)).unwrap();
        req["request"]["uid"] = uid.into();
        req["request"]["operation"] = operation.into();
        req["request"]["object"] = object.clone();
        req["request"]["oldObject"] = old.cloned().unwrap_or(Value::Null);
        serde_json::to_vec(&req).unwrap()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, .. ProptestConfig::default() })]

        /// Mutated fixtures: flipped bytes, truncations, splices. Never a panic; always a
        /// 200 with a review or a 400; the invariants hold.
        #[test]
        fn mutated_fixture_bytes(seed in 0usize..64, pos in any::<prop::sample::Index>(), byte in any::<u8>(), cut in any::<prop::sample::Index>(), op in 0u8..3, backend in arb_backend()) {
            let seeds = seeds();
            let mut b = seeds[seed % seeds.len()].clone();
            match op {
                0 => { let i = pos.index(b.len()); b[i] = byte; }
                1 => { let i = cut.index(b.len()); b.truncate(i); }
                _ => { let i = pos.index(b.len()); b.insert(i, byte); }
            }
            for mode in [Mode::Mutate, Mode::Validate] {
                let r = review(&b, mode, Some(backend), &settings(backend));
                check(&b, mode, Some(backend), &r)?;
            }
        }

        /// Structurally valid reviews whose pod is arbitrary JSON.
        #[test]
        fn arbitrary_pods(pod in arb_json(), spec in arb_json(), backend in arb_backend()) {
            let object = serde_json::json!({"apiVersion": "v1", "kind": "Pod", "metadata": pod, "spec": spec});
            let b = envelope("offline-deployment-create", "fuzz-uid", "CREATE", &object, None);
            for mode in [Mode::Mutate, Mode::Validate] {
                let r = review(&b, mode, Some(backend), &settings(backend));
                check(&b, mode, Some(backend), &r)?;
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 1000, failure_persistence: None, .. ProptestConfig::default() })]

        /// Plausible pods created, then updated: the invariants hold at every step, on
        /// both endpoints, for every backend.
        #[test]
        fn created_then_updated(pod in arb_pod(), backend in arb_backend(), uid in "[a-f0-9-]{1,36}", edits in prop::collection::vec(arb_edit(), 0..3)) {
            let create = envelope("offline-deployment-create", &uid, "CREATE", &pod, None);
            for mode in [Mode::Mutate, Mode::Validate] {
                let r = review(&create, mode, Some(backend), &settings(backend));
                check(&create, mode, Some(backend), &r)?;
            }
            let r = review(&create, Mode::Mutate, Some(backend), &settings(backend));
            let resp: Value = serde_json::from_slice(&r.body).unwrap();
            if resp["response"]["allowed"] != true {
                return Ok(());
            }
            let old = patched(&create, &resp);
            let mut new = old.clone();
            for (field, value) in edits {
                let key = [QOS, POLICY, REQUESTED, REQUESTS, "team"][field];
                if key == "team" {
                    new["metadata"]["labels"]["team"] = "ml".into();
                    continue;
                }
                let ann = &mut new["metadata"]["annotations"];
                match value {
                    Some(v) => ann[key] = v.into(),
                    None => { ann.as_object_mut().map(|a| a.remove(key)); }
                }
            }
            let update = envelope("offline-deployment-create", &uid, "UPDATE", &new, Some(&old));
            for mode in [Mode::Mutate, Mode::Validate] {
                let r = review(&update, mode, Some(backend), &settings(backend));
                check(&update, mode, Some(backend), &r)?;
            }
        }
    }
}

/// Every value of the namespace label `gpu-coloc.dev/backend` either works or is refused:
/// the chart sends `vke`, `nvidia-shared` and `hami` to `/mutate?backend=<value>` (and
/// `/validate?backend=<value>`), any other value to `/unsupported-backend`
/// (deploy/scripts/check-deploy.py checks that routing on the rendered chart).
#[tokio::test]
async fn every_backend_label_value_works_or_is_refused() {
    let app = app(Backend::Vke);
    for value in coloc_webhook::translate::BACKEND_NAMES {
        let (status, out) = post(
            &app,
            &format!("/mutate?backend={value}"),
            fixture("offline-deployment-create"),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{value}");
        let r: Value = serde_json::from_slice(&out).unwrap();
        let pod = patched(&fixture("offline-deployment-create"), &r);
        assert_eq!(
            pod["metadata"]["annotations"]["gpu-coloc.dev/backend"], value,
            "{value}: translated for that backend"
        );
        let (status, out) = post(
            &app,
            &format!("/validate?backend={value}"),
            fixture("offline-deployment-create"),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(
            serde_json::from_slice::<Value>(&out).unwrap()["response"]["allowed"],
            true,
            "{value}"
        );
    }
    // Any other label value: mGPU pods are refused with a message that says what to do;
    // other pods, and updates of pods admitted earlier, pass.
    let (status, out) = post(
        &app,
        "/unsupported-backend",
        fixture("offline-deployment-create"),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let msg = denial(&serde_json::from_slice(&out).unwrap());
    assert!(
        msg.contains("gpu-coloc.dev/backend") && msg.contains("vke, nvidia-shared, hami"),
        "{msg}"
    );
    for allowed in ["plain-pod", "online-update"] {
        let (_, out) = post(&app, "/unsupported-backend", fixture(allowed)).await;
        let r: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(r["response"]["allowed"], true, "{allowed}: {r}");
        assert!(r["response"]["patch"].is_null(), "{allowed}");
    }
    // A typo in ?backend= (a chart bug, not a tenant's) is a 400, never a translation.
    let (status, _) = post(
        &app,
        "/mutate?backend=vk",
        fixture("offline-deployment-create"),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}
