//! The webhook driven through its router with AdmissionReview fixtures (tests/data/),
//! over real HTTPS once, and fuzzed for a bounded time.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use coloc_webhook::server::{router, AppState};
use coloc_webhook::translate::{Backend, Settings};
use http_body_util::BodyExt;
use serde_json::Value;
use std::sync::Arc;
use tower::ServiceExt;

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(format!(
        "{}/tests/data/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap()
}

fn app(backend: Backend) -> axum::Router {
    router(AppState {
        settings: Arc::new(Settings {
            backend,
            offline_priority_class: Some("gpu-coloc-offline".into()),
        }),
        max_body: 64 * 1024,
        prom: None,
    })
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
        vec![b'x'; 100 * 1024],
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

mod fuzz {
    use super::*;
    use coloc_webhook::review::{review, Mode};
    use proptest::prelude::*;

    fn settings() -> Settings {
        Settings {
            backend: Backend::Hami,
            offline_priority_class: Some("p".into()),
        }
    }

    fn seeds() -> Vec<Vec<u8>> {
        std::fs::read_dir(format!("{}/tests/data", env!("CARGO_MANIFEST_DIR")))
            .unwrap()
            .map(|e| std::fs::read(e.unwrap().path()).unwrap())
            .collect()
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

    proptest! {
        #![proptest_config(ProptestConfig { cases: 3000, failure_persistence: None, .. ProptestConfig::default() })]

        /// Mutated fixtures: flipped bytes, truncations, splices. Never a panic; always a
        /// 200 with a review or a 400.
        #[test]
        fn mutated_fixture_bytes(seed in 0usize..64, pos in any::<prop::sample::Index>(), byte in any::<u8>(), cut in any::<prop::sample::Index>(), op in 0u8..3) {
            let seeds = seeds();
            let mut b = seeds[seed % seeds.len()].clone();
            match op {
                0 => { let i = pos.index(b.len()); b[i] = byte; }
                1 => { let i = cut.index(b.len()); b.truncate(i); }
                _ => { let i = pos.index(b.len()); b.insert(i, byte); }
            }
            for mode in [Mode::Mutate, Mode::Validate] {
                let r = review(&b, mode, None, &settings());
                prop_assert!(r.status == 200 || r.status == 400);
            }
        }

        /// Structurally valid reviews whose pod is arbitrary JSON.
        #[test]
        fn arbitrary_pods(pod in arb_json(), spec in arb_json()) {
            let seeds = seeds();
            let mut req: Value = serde_json::from_slice(&seeds[0]).unwrap();
            req["request"]["object"] = serde_json::json!({"apiVersion": "v1", "kind": "Pod", "metadata": pod, "spec": spec});
            let b = serde_json::to_vec(&req).unwrap();
            let r = review(&b, Mode::Mutate, None, &settings());
            prop_assert!(r.status == 200 || r.status == 400);
            if r.status == 200 && r.result == "patched" {
                // Every patch applies to the object it was made for.
                let resp: Value = serde_json::from_slice(&r.body).unwrap();
                let pod = patched(&b, &resp);
                prop_assert!(pod.is_object());
            }
        }
    }
}
