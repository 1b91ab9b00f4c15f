//! `/inject`: the CUDA shim into GPU pods, through the router with AdmissionReview
//! fixtures (tests/data/). Every patch is applied as the RFC 6902 patch the API server
//! applies, and every resulting pod is checked against the Kubernetes Pod type (no
//! unknown or mistyped field: it round-trips through k8s-openapi's `Pod`) and against the
//! API server's own rules for what the patch adds (volume and mount names and paths,
//! `subPathExpr`, env entries). `deploy/scripts/check-deploy.py` validates the same pods
//! against the Kubernetes 1.33 OpenAPI schemas.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use coloc_webhook::inject::{Delivery, ShimSettings};
use coloc_webhook::server::{router, AppState, Limits};
use coloc_webhook::translate::{Backend, Settings};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use tower::ServiceExt;

const SHIM: &str = "/var/lib/gpu-coloc/lib/libcoloc_cuda.so";

fn fixture(name: &str) -> Value {
    serde_json::from_slice(
        &std::fs::read(format!(
            "{}/tests/data/{name}.json",
            env!("CARGO_MANIFEST_DIR")
        ))
        .unwrap(),
    )
    .unwrap()
}

fn settings(backend: Backend, shim: Option<ShimSettings>) -> Settings {
    Settings {
        shim,
        ..Settings::with_priority_class(backend, "gpu-coloc-offline", -10)
    }
}

fn app(s: Settings) -> axum::Router {
    router(AppState::new(s, Limits::default(), None))
}

fn shim() -> Option<ShimSettings> {
    Some(ShimSettings {
        inflight: Some(2),
        inflight_ms: Some(1.5),
        online_wake_gap_ms: Some(2.0),
        ..ShimSettings::default()
    })
}

/// Reviews `pod` (in `envelope`'s request) at `path`; returns the response and the pod
/// with its patch applied.
async fn review(app: &axum::Router, path: &str, envelope: &Value, pod: &Value) -> (Value, Value) {
    let mut req = envelope.clone();
    req["request"]["object"] = pod.clone();
    let resp = app
        .clone()
        .oneshot(
            Request::post(path)
                .header("content-type", "application/json")
                .body(Body::from(serde_json::to_vec(&req).unwrap()))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let r: Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(r["response"]["allowed"], true, "{path}: {r}");
    let mut out = pod.clone();
    if let Some(p) = r["response"]["patch"].as_str() {
        use base64::Engine;
        let bytes = base64::engine::general_purpose::STANDARD.decode(p).unwrap();
        let patch: json_patch::Patch = serde_json::from_slice(&bytes).unwrap();
        json_patch::patch(&mut out, &patch)
            .unwrap_or_else(|e| panic!("{path}: the patch does not apply to the pod: {e}"));
    }
    (r, out)
}

/// What the API server does to a stored pod that the next review sees: defaults
/// (`fieldRef.apiVersion`).
fn as_stored(pod: &Value) -> Value {
    let mut p = pod.clone();
    for list in ["containers", "initContainers"] {
        for c in p["spec"][list].as_array_mut().into_iter().flatten() {
            for e in c["env"].as_array_mut().into_iter().flatten() {
                if e["valueFrom"]["fieldRef"].is_object() {
                    e["valueFrom"]["fieldRef"]["apiVersion"] = json!("v1");
                }
            }
        }
    }
    p
}

fn prune_nulls(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .filter(|(_, x)| !x.is_null())
                .map(|(k, x)| (k.clone(), prune_nulls(x)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(prune_nulls).collect()),
        x => x.clone(),
    }
}

fn dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// The pod as the API server would accept it: the Pod type, and the validation rules
/// (pkg/apis/core/validation) for what injection touches.
fn assert_valid_pod(pod: &Value, what: &str) {
    let typed: k8s_openapi::api::core::v1::Pod =
        serde_json::from_value(pod.clone()).unwrap_or_else(|e| panic!("{what}: not a Pod: {e}"));
    let back = serde_json::to_value(&typed).unwrap();
    assert_eq!(
        prune_nulls(&back),
        prune_nulls(pod),
        "{what}: fields the Pod type does not know, or of the wrong type"
    );
    let volumes: Vec<&Value> = pod["spec"]["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .collect();
    let names: BTreeSet<&str> = volumes.iter().filter_map(|v| v["name"].as_str()).collect();
    assert_eq!(names.len(), volumes.len(), "{what}: duplicate volume names");
    for n in &names {
        assert!(dns_label(n), "{what}: volume name {n:?}");
    }
    for v in &volumes {
        if let Some(p) = v["hostPath"]["path"].as_str() {
            assert!(
                p.starts_with('/') && !p.split('/').any(|s| s == ".."),
                "{what}: hostPath {p}"
            );
        }
    }
    for list in ["initContainers", "containers"] {
        for c in pod["spec"][list].as_array().into_iter().flatten() {
            let mut paths = BTreeSet::new();
            for m in c["volumeMounts"].as_array().into_iter().flatten() {
                let name = m["name"].as_str().unwrap();
                assert!(
                    names.contains(name),
                    "{what}: mount of a missing volume {name}"
                );
                let path = m["mountPath"].as_str().unwrap();
                assert!(
                    paths.insert(path),
                    "{what}: {path} mounted twice in {}",
                    c["name"]
                );
                assert!(
                    !(m.get("subPath").is_some() && m.get("subPathExpr").is_some()),
                    "{what}: subPath and subPathExpr are mutually exclusive"
                );
                if let Some(e) = m["subPathExpr"].as_str() {
                    // Expanded from the container's own env: every $(VAR) must be defined there.
                    for var in e.split("$(").skip(1).filter_map(|r| r.split(')').next()) {
                        assert!(
                            c["env"]
                                .as_array()
                                .into_iter()
                                .flatten()
                                .any(|x| x["name"] == var),
                            "{what}: subPathExpr {e} needs env {var} in {}",
                            c["name"]
                        );
                    }
                }
            }
            for e in c["env"].as_array().into_iter().flatten() {
                let n = e["name"].as_str().unwrap();
                assert!(
                    !n.is_empty()
                        && !n.starts_with(|ch: char| ch.is_ascii_digit())
                        && n.chars()
                            .all(|ch| ch.is_ascii_alphanumeric() || "-._".contains(ch)),
                    "{what}: env name {n:?}"
                );
                assert!(
                    !(e.get("value").is_some_and(|v| v != "") && e.get("valueFrom").is_some()),
                    "{what}: env {n} has both value and valueFrom"
                );
            }
        }
    }
}

fn container<'a>(pod: &'a Value, name: &str) -> &'a Value {
    ["initContainers", "containers"]
        .iter()
        .flat_map(|l| pod["spec"][*l].as_array().into_iter().flatten())
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

fn env<'a>(c: &'a Value, name: &str) -> Option<&'a Value> {
    c["env"]
        .as_array()?
        .iter()
        .rev()
        .find(|e| e["name"] == name)
}

fn mount<'a>(c: &'a Value, volume: &str) -> Option<&'a Value> {
    c["volumeMounts"]
        .as_array()?
        .iter()
        .find(|m| m["name"] == volume)
}

/// What every injected container carries.
fn assert_injected(pod: &Value, name: &str, class: &str) {
    let c = container(pod, name);
    assert_env(c, name, class);
    let shim = mount(c, "gpu-coloc-shim").unwrap();
    assert_eq!(shim["mountPath"], "/var/lib/gpu-coloc/lib");
    assert_eq!(shim["readOnly"], true);
    let bells = mount(c, "gpu-coloc-doorbells").unwrap();
    assert_eq!(bells["mountPath"], "/run/gpu-coloc/doorbells");
    assert_eq!(bells["subPathExpr"], "$(COLOC_POD_UID)");
    assert!(
        bells.get("readOnly").is_none_or(|r| r == false),
        "the shim writes its page"
    );
    let gate = mount(c, "gpu-coloc-gate");
    if class == "offline" {
        assert_eq!(gate.unwrap()["readOnly"], true);
        assert_eq!(gate.unwrap()["mountPath"], "/run/gpu-coloc/gate");
    } else {
        assert!(gate.is_none(), "{name}: online has no gate");
    }
    let vols: Vec<(&str, &str)> = pod["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| Some((v["name"].as_str()?, v["hostPath"]["path"].as_str()?)))
        .collect();
    assert!(
        vols.contains(&("gpu-coloc-shim", "/var/lib/gpu-coloc/lib")),
        "{vols:?}"
    );
    assert!(
        vols.contains(&("gpu-coloc-doorbells", "/run/gpu-coloc/doorbells/pods")),
        "{vols:?}"
    );
    assert_eq!(
        vols.contains(&("gpu-coloc-gate", "/run/gpu-coloc/gate")),
        class == "offline"
    );
}

/// The shim's environment in container `name` of class `class` (either delivery).
fn assert_env(c: &Value, name: &str, class: &str) {
    let preload = env(c, "LD_PRELOAD").unwrap()["value"].as_str().unwrap();
    assert!(
        preload.split([':', ' ']).any(|p| p == SHIM),
        "{name}: LD_PRELOAD {preload}"
    );
    assert_eq!(env(c, "COLOC_SHIM_CLASS").unwrap()["value"], class);
    assert_eq!(
        env(c, "COLOC_POD_UID").unwrap()["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.uid"
    );
    assert_eq!(
        env(c, "COLOC_DOORBELL_DIR").unwrap()["value"],
        "/run/gpu-coloc/doorbells"
    );
    if class == "offline" {
        assert_eq!(
            env(c, "COLOC_GATE_FILE").unwrap()["value"],
            "/run/gpu-coloc/gate/gates"
        );
        assert_eq!(env(c, "COLOC_SHIM_INFLIGHT").unwrap()["value"], "2");
        assert_eq!(env(c, "COLOC_SHIM_INFLIGHT_MS").unwrap()["value"], "1.5");
        assert!(
            env(c, "COLOC_SHIM_WAKE_GAP_MS").is_none(),
            "{name}: the wake gap is online's"
        );
    } else {
        assert!(
            env(c, "COLOC_GATE_FILE").is_none(),
            "{name}: online has no gate"
        );
        assert_eq!(env(c, "COLOC_SHIM_WAKE_GAP_MS").unwrap()["value"], "2");
    }
}

/// The shim delivered as a device: the environment, exactly one slot of the class asked
/// for in the container, and no host path anywhere in the pod.
fn assert_injected_as_device(pod: &Value, name: &str, class: &str) {
    let c = container(pod, name);
    assert_env(c, name, class);
    let want = format!("gpu-coloc.dev/shim-{class}");
    assert_eq!(c["resources"]["limits"][&want], "1", "{name}: {c}");
    for k in ["limits", "requests"] {
        for (r, q) in c["resources"][k].as_object().into_iter().flatten() {
            if r.starts_with("gpu-coloc.dev/") {
                assert!(*r == want && q == "1", "{name}: {k} {r}: {q}");
            }
        }
    }
    assert!(
        !pod.to_string().contains("hostPath"),
        "{name}: a host path in the pod: {pod}"
    );
}

fn assert_untouched(before: &Value, after: &Value, name: &str) {
    assert_eq!(
        container(before, name),
        container(after, name),
        "{name} was changed"
    );
}

#[tokio::test]
async fn gpu_pods_get_the_shim_once_before_and_after_translation() {
    for (fixture_name, gpu, others, class) in [
        (
            "offline-deployment-create",
            vec!["train"],
            vec![],
            "offline",
        ),
        (
            "online-create-no-annotations",
            vec!["server"],
            vec![],
            "online",
        ),
        (
            "offline-multi-container-init",
            vec!["fetch", "worker"],
            vec!["sidecar"],
            "offline",
        ),
    ] {
        let envelope = fixture(fixture_name);
        let pod = envelope["request"]["object"].clone();
        for name in gpu.iter().chain(&others) {
            container(&pod, name);
        }
        for backend in [Backend::Vke, Backend::NvidiaShared, Backend::Hami] {
            let what = format!("{fixture_name} ({backend})");
            let app = app(settings(backend, shim()));
            // As the API server calls them: /inject (first), then /mutate.
            let (r, injected) = review(&app, "/inject", &envelope, &pod).await;
            assert!(
                r["response"]["patch"].is_string(),
                "{what}: not patched: {r}"
            );
            for name in &gpu {
                assert_injected(&injected, name, class);
            }
            for name in &others {
                assert_untouched(&pod, &injected, name);
            }
            assert_eq!(
                injected["metadata"]["annotations"]["gpu-coloc.dev/shim-injected"],
                gpu.join(","),
                "{what}"
            );
            assert_valid_pod(&injected, &what);
            // A second review of the stored pod adds nothing.
            let (r, _) = review(&app, "/inject", &envelope, &as_stored(&injected)).await;
            assert!(
                r["response"]["patch"].is_null(),
                "{what}: second review patched: {r}"
            );
            // Translation, then the reinvocation of /inject on the translated pod.
            let (r, translated) = review(&app, "/mutate", &envelope, &as_stored(&injected)).await;
            assert_eq!(r["response"]["allowed"], true);
            assert_valid_pod(&translated, &format!("{what}, translated"));
            let (r, _) = review(&app, "/inject", &envelope, &as_stored(&translated)).await;
            assert!(
                r["response"]["patch"].is_null(),
                "{what}: reinvocation patched: {r}"
            );
            // And translation before injection gives the same containers the shim.
            let (_, first) = review(&app, "/mutate", &envelope, &pod).await;
            let (_, second) = review(&app, "/inject", &envelope, &as_stored(&first)).await;
            for name in &gpu {
                assert_injected(&second, name, class);
            }
            assert_valid_pod(&second, &format!("{what}, translated first"));
        }
    }
}

/// A pod with `env` (and `envFrom`) on its one GPU container `main`.
fn pod_with(env: Value, env_from: Value) -> Value {
    let mut env_pod = fixture("offline-deployment-create");
    let c = &mut env_pod["request"]["object"]["spec"]["containers"][0];
    c["name"] = json!("main");
    if !env.is_null() {
        c["env"] = env;
    }
    if !env_from.is_null() {
        c["envFrom"] = env_from;
    }
    env_pod
}

async fn inject_into(envelope: &Value) -> (Value, Value) {
    let app = app(settings(Backend::Vke, shim()));
    let pod = envelope["request"]["object"].clone();
    let (r, out) = review(&app, "/inject", envelope, &pod).await;
    if r["response"]["patch"].is_string() {
        assert_valid_pod(&out, "injected");
        let (again, _) = review(&app, "/inject", envelope, &as_stored(&out)).await;
        assert!(
            again["response"]["patch"].is_null(),
            "second review patched: {again}"
        );
    }
    (r, out)
}

#[tokio::test]
async fn an_existing_ld_preload_is_appended_to_never_replaced() {
    let jemalloc = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2";
    for (env, expected) in [
        (
            json!([{"name": "LD_PRELOAD", "value": jemalloc}]),
            format!("{jemalloc}:{SHIM}"),
        ),
        (
            json!([{"name": "LD_PRELOAD", "value": format!("{jemalloc} /opt/x.so")}]),
            format!("{jemalloc} /opt/x.so:{SHIM}"),
        ),
        (
            json!([{"name": "LD_PRELOAD", "value": ""}]),
            SHIM.to_string(),
        ),
        (json!([{"name": "LD_PRELOAD"}]), SHIM.to_string()),
        (
            json!([{"name": "LD_PRELOAD", "value": format!("{SHIM}:{jemalloc}")}]),
            format!("{SHIM}:{jemalloc}"),
        ),
        // The kubelet lets the last entry win: that is the one extended.
        (
            json!([{"name": "LD_PRELOAD", "value": "/first.so"}, {"name": "A", "value": "1"}, {"name": "LD_PRELOAD", "value": jemalloc}]),
            format!("{jemalloc}:{SHIM}"),
        ),
        // Set in env next to an envFrom: the env value is the one that counts.
        (
            json!([{"name": "LD_PRELOAD", "value": jemalloc}]),
            format!("{jemalloc}:{SHIM}"),
        ),
    ] {
        let (_, out) = inject_into(&pod_with(env.clone(), Value::Null)).await;
        let c = container(&out, "main");
        assert_eq!(env_of(c, "LD_PRELOAD"), expected, "from {env}");
        assert_injected(&out, "main", "offline");
        // Other variables are kept, in place.
        for (i, e) in env.as_array().unwrap().iter().enumerate() {
            if e["name"] != "LD_PRELOAD" {
                assert_eq!(&c["env"][i], e);
            }
        }
    }
    let (_, out) = inject_into(&pod_with(
        json!([{"name": "LD_PRELOAD", "value": jemalloc}]),
        json!([{"configMapRef": {"name": "settings"}}]),
    ))
    .await;
    assert_eq!(
        env_of(container(&out, "main"), "LD_PRELOAD"),
        format!("{jemalloc}:{SHIM}")
    );
}

fn env_of(c: &Value, name: &str) -> String {
    env(c, name).unwrap()["value"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn containers_whose_ld_preload_cannot_be_seen_are_left_out_and_said_so() {
    let from_secret =
        json!([{"name": "LD_PRELOAD", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]);
    for (env, env_from, why) in [
        (from_secret, Value::Null, "valueFrom"),
        (
            Value::Null,
            json!([{"configMapRef": {"name": "settings"}}]),
            "ConfigMap",
        ),
        (
            Value::Null,
            json!([{"secretRef": {"name": "creds"}, "prefix": "LD_"}]),
            "Secret",
        ),
    ] {
        let envelope = pod_with(env, env_from);
        let before = envelope["request"]["object"].clone();
        let (r, out) = inject_into(&envelope).await;
        assert_eq!(
            container(&out, "main"),
            container(&before, "main"),
            "{why}: container changed"
        );
        let warnings: Vec<&str> = r["response"]["warnings"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        assert!(
            warnings.len() == 1 && warnings[0].contains("\"main\"") && warnings[0].contains(why),
            "{why}: {r}"
        );
        let skipped = out["metadata"]["annotations"]["gpu-coloc.dev/shim-skipped"]
            .as_str()
            .unwrap();
        assert!(
            skipped.starts_with("main: ") && skipped.contains(why),
            "{skipped}"
        );
        assert!(
            out["spec"].get("volumes").is_none(),
            "{why}: volumes for nobody"
        );
    }
    // An envFrom whose prefix cannot make LD_PRELOAD is no obstacle.
    let (_, out) = inject_into(&pod_with(
        Value::Null,
        json!([{"configMapRef": {"name": "c"}, "prefix": "APP_"}]),
    ))
    .await;
    assert_injected(&out, "main", "offline");
}

#[tokio::test]
async fn opt_outs_updates_and_other_pods_are_not_touched() {
    let app_on = app(settings(Backend::Vke, shim()));
    let envelope = fixture("offline-deployment-create");
    let pod = envelope["request"]["object"].clone();
    // Per pod.
    let mut opted = pod.clone();
    opted["metadata"]["annotations"]["gpu-coloc.dev/shim"] = json!("disabled");
    let (r, _) = review(&app_on, "/inject", &envelope, &opted).await;
    assert!(r["response"]["patch"].is_null(), "{r}");
    // No [shim] settings (the chart's shim.enabled=false).
    let (r, _) = review(
        &app(settings(Backend::Vke, None)),
        "/inject",
        &envelope,
        &pod,
    )
    .await;
    assert!(r["response"]["patch"].is_null(), "{r}");
    // UPDATE: a pod's containers cannot change after creation.
    let mut update = envelope.clone();
    update["request"]["operation"] = json!("UPDATE");
    update["request"]["oldObject"] = pod.clone();
    let (r, _) = review(&app_on, "/inject", &update, &pod).await;
    assert!(r["response"]["patch"].is_null(), "{r}");
    // Pods that ask for no mGPU, or are denied by the translation (mixed, malformed).
    for name in [
        "plain-pod",
        "deny-mixed-pod",
        "deny-malformed-quantity",
        "deny-memory-without-cores",
    ] {
        let e = fixture(name);
        let (r, _) = review(&app_on, "/inject", &e, &e["request"]["object"].clone()).await;
        assert!(r["response"]["patch"].is_null(), "{name}: {r}");
    }
    // The namespace opt-out is the chart's namespaceSelector (check-deploy.py).
}

#[tokio::test]
async fn the_pod_uid_and_the_paths_are_the_webhooks() {
    // A container cannot point its doorbell mount at another pod's directory, nor move
    // the directories away from the mounts: those variables are replaced.
    let envelope = pod_with(
        json!([
            {"name": "COLOC_POD_UID", "value": "0b7c9f6e-1111-2222-3333-444455556666"},
            {"name": "COLOC_SHIM_CLASS", "value": "online"},
            {"name": "COLOC_DOORBELL_DIR", "value": "/tmp"},
            {"name": "COLOC_SHIM_INFLIGHT", "value": "8"}
        ]),
        Value::Null,
    );
    let (_, out) = inject_into(&envelope).await;
    let c = container(&out, "main");
    for name in ["COLOC_POD_UID", "COLOC_SHIM_CLASS", "COLOC_DOORBELL_DIR"] {
        assert_eq!(
            c["env"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|e| e["name"] == name)
                .count(),
            1,
            "{name}"
        );
    }
    assert_injected_but_inflight(&out);
    // K the container chose is kept.
    assert_eq!(env_of(c, "COLOC_SHIM_INFLIGHT"), "8");
}

fn assert_injected_but_inflight(pod: &Value) {
    let c = container(pod, "main");
    assert_eq!(env_of(c, "COLOC_SHIM_CLASS"), "offline");
    assert_eq!(
        env(c, "COLOC_POD_UID").unwrap()["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.uid"
    );
    assert_eq!(env_of(c, "COLOC_DOORBELL_DIR"), "/run/gpu-coloc/doorbells");
}

#[tokio::test]
async fn taken_paths_and_names_are_not_overridden() {
    // A mount at the doorbell path from another volume: that container is left out.
    let mut envelope = fixture("offline-deployment-create");
    let pod = &mut envelope["request"]["object"];
    pod["spec"]["volumes"] = json!([{"name": "scratch", "emptyDir": {}}]);
    pod["spec"]["containers"][0]["volumeMounts"] =
        json!([{"name": "scratch", "mountPath": "/run/gpu-coloc/doorbells"}]);
    let (r, out) = inject_into(&envelope).await;
    assert!(
        r["response"]["warnings"]
            .to_string()
            .contains("/run/gpu-coloc/doorbells"),
        "{r}"
    );
    assert_eq!(
        out["spec"]["volumes"],
        json!([{"name": "scratch", "emptyDir": {}}])
    );
    // A volume of ours by name, but something else: the pod is left alone.
    let mut envelope = fixture("offline-deployment-create");
    envelope["request"]["object"]["spec"]["volumes"] =
        json!([{"name": "gpu-coloc-shim", "emptyDir": {}}]);
    let (r, out) = inject_into(&envelope).await;
    assert!(r["response"]["patch"].is_null(), "{r}");
    assert!(
        r["response"]["warnings"]
            .to_string()
            .contains("gpu-coloc-shim"),
        "{r}"
    );
    assert_eq!(out, envelope["request"]["object"]);
}

#[test]
fn shim_settings_are_checked_at_start() {
    for bad in [
        "relative/libcoloc_cuda.so",
        "/libcoloc_cuda.so",
        "/a/../b/libcoloc_cuda.so",
        "/a b/libcoloc_cuda.so",
        "/a:b/libcoloc_cuda.so",
    ] {
        let s = Settings {
            shim: Some(ShimSettings {
                library: bad.into(),
                ..ShimSettings::default()
            }),
            ..Settings::new(Backend::Vke)
        };
        assert!(s.check().is_err(), "{bad} accepted");
    }
    for bad in [-1.0, f64::NAN, f64::INFINITY] {
        let s = Settings {
            shim: Some(ShimSettings {
                inflight_ms: Some(bad),
                ..ShimSettings::default()
            }),
            ..Settings::new(Backend::Vke)
        };
        let e = s.check().unwrap_err();
        assert!(e.contains("inflight_ms"), "{bad}: {e}");
        let s = Settings {
            shim: Some(ShimSettings {
                online_wake_gap_ms: Some(if bad < 0.0 { 0.0 } else { bad }),
                ..ShimSettings::default()
            }),
            ..Settings::new(Backend::Vke)
        };
        let e = s.check().unwrap_err();
        assert!(e.contains("online_wake_gap_ms"), "{bad}: {e}");
    }
    let toml_text =
        "backend = \"vke\"\n[shim]\nlibrary = \"/opt/gpu/libcoloc_cuda.so\"\ninflight = 4\ninflight_ms = 0\n";
    let s: Settings = toml::from_str(toml_text).unwrap();
    s.check().unwrap();
    let shim = s.shim.unwrap();
    assert_eq!(shim.doorbell_dir, "/run/gpu-coloc/doorbells");
    assert_eq!(shim.inflight, Some(4));
    assert_eq!(shim.inflight_ms, Some(0.0));
    assert!(
        toml::from_str::<Settings>("backend = \"vke\"\n[shim]\nlibary = \"/x/y.so\"\n").is_err()
    );
}

/// Settings with the PriorityClass mapping of `[classes]`.
fn settings_with_classes(backend: Backend) -> Settings {
    let mut s = settings(backend, shim());
    s.classes.offline_priority_classes = vec!["batch-low".into()];
    s.classes.offline_priority_below = Some(1000);
    s
}

/// `fixture`'s pod with its GPU container `train` asking for `gpu` and saying its class
/// through `say`.
fn classified_pod(gpu: &Value, say: &dyn Fn(&mut Value)) -> (Value, Value) {
    let envelope = fixture("offline-deployment-create");
    let mut pod = envelope["request"]["object"].clone();
    let mut res = json!({"cpu": "4", "memory": "16Gi"});
    for (k, v) in gpu.as_object().unwrap() {
        res[k] = v.clone();
    }
    pod["spec"]["containers"][0]["resources"] = json!({"limits": res, "requests": res});
    say(&mut pod);
    (envelope, pod)
}

/// Every vocabulary × every GPU resource × every backend: the GPU container gets the shim
/// for its class, the translation admits the result, a second `/inject` adds nothing and
/// `/validate-mounts` allows it.
#[tokio::test]
async fn every_vocabulary_and_gpu_resource_gets_the_shim_on_every_backend() {
    type Say = Box<dyn Fn(&mut Value)>;
    let ann = |k: &'static str, v: &'static str| -> Say {
        Box::new(move |p: &mut Value| p["metadata"]["annotations"][k] = json!(v))
    };
    let label = |k: &'static str, v: &'static str| -> Say {
        Box::new(move |p: &mut Value| p["metadata"]["labels"][k] = json!(v))
    };
    let hami = |v: &'static str| -> Say {
        Box::new(move |p: &mut Value| {
            for part in ["limits", "requests"] {
                p["spec"]["containers"][0]["resources"][part]["nvidia.com/priority"] = json!(v);
            }
        })
    };
    let priority = |name: &'static str, value: i64| -> Say {
        Box::new(move |p: &mut Value| {
            p["spec"]["priorityClassName"] = json!(name);
            p["spec"]["priority"] = json!(value);
        })
    };
    let vocabularies: Vec<(&str, Say, &str)> = vec![
        (
            "katalyst reclaimed_cores",
            ann("katalyst.kubewharf.io/qos_level", "reclaimed_cores"),
            "offline",
        ),
        (
            "katalyst shared_cores",
            ann("katalyst.kubewharf.io/qos_level", "shared_cores"),
            "online",
        ),
        (
            "katalyst dedicated_cores",
            ann("katalyst.kubewharf.io/qos_level", "dedicated_cores"),
            "online",
        ),
        (
            "koordinator BE",
            label("koordinator.sh/qosClass", "BE"),
            "offline",
        ),
        (
            "koordinator LS",
            label("koordinator.sh/qosClass", "LS"),
            "online",
        ),
        ("hami priority 1", hami("1"), "offline"),
        ("hami priority 0", hami("0"), "online"),
        (
            "priority class by name",
            priority("batch-low", 5000),
            "offline",
        ),
        ("priority class by value", priority("cheap", 100), "offline"),
        (
            "priority class above the threshold",
            priority("prod", 100000),
            "online",
        ),
        (
            "gpu-coloc.dev/class offline",
            ann("gpu-coloc.dev/class", "offline"),
            "offline",
        ),
        (
            "gpu-coloc.dev/class online",
            ann("gpu-coloc.dev/class", "online"),
            "online",
        ),
        (
            "nothing said (online by default)",
            Box::new(|_: &mut Value| {}),
            "online",
        ),
    ];
    let resources = |class: &str| {
        let mgpu = if class == "offline" {
            json!({"vke.volcengine.com/reclaimed-mgpu-core": "30"})
        } else {
            json!({"vke.volcengine.com/mgpu-core": "30"})
        };
        vec![
            ("nvidia.com/gpu", json!({"nvidia.com/gpu": "1"})),
            (
                "hami",
                json!({"nvidia.com/gpu": "1", "nvidia.com/gpucores": "30", "nvidia.com/gpumem": "4000"}),
            ),
            ("mgpu", mgpu),
        ]
    };
    for (backend, delivery) in [Backend::Vke, Backend::NvidiaShared, Backend::Hami]
        .into_iter()
        .flat_map(|b| [(b, Delivery::HostPath), (b, Delivery::Device)])
    {
        let mut settings = settings_with_classes(backend);
        settings.shim.as_mut().unwrap().delivery = delivery;
        let app = app(settings);
        for (vocab, say, class) in &vocabularies {
            for (rname, gpu) in resources(class) {
                // mGPU online requests contradict HAMi's low priority; offline ones with
                // HAMi's high priority make a pod the translation denies: both covered by
                // the translation's own tests.
                if rname == "mgpu" && vocab.starts_with("hami") {
                    continue;
                }
                let what = format!("{vocab} × {rname} × {backend} × {delivery:?}");
                let (envelope, pod) = classified_pod(&gpu, say.as_ref());
                let (r, injected) = review(&app, "/inject", &envelope, &pod).await;
                assert!(
                    r["response"]["patch"].is_string(),
                    "{what}: not patched: {r}"
                );
                match delivery {
                    Delivery::HostPath => assert_injected(&injected, "train", class),
                    Delivery::Device => assert_injected_as_device(&injected, "train", class),
                }
                assert_eq!(
                    injected["metadata"]["annotations"]["gpu-coloc.dev/shim-injected"], "train",
                    "{what}"
                );
                assert_valid_pod(&injected, &what);
                let (r, translated) =
                    review(&app, "/mutate", &envelope, &as_stored(&injected)).await;
                assert_eq!(r["response"]["allowed"], true, "{what}: {r}");
                let (r, _) = review(&app, "/inject", &envelope, &as_stored(&translated)).await;
                assert!(r["response"]["patch"].is_null(), "{what}: reinjected: {r}");
                if delivery == Delivery::Device {
                    // The translation kept the slot.
                    assert_injected_as_device(&translated, "train", class);
                }
                let (r, _) =
                    review(&app, "/validate-mounts", &envelope, &as_stored(&translated)).await;
                assert_eq!(r["response"]["allowed"], true, "{what}: {r}");
            }
        }
    }
}

/// The two pods, as the CLI reads them: `nvidia.com/gpu: 1` with Katalyst's
/// `reclaimed_cores` or Koordinator's `BE` get the offline shim on `nvidia-shared`.
#[tokio::test]
async fn nvidia_gpu_pods_classified_offline_get_the_shim() {
    for name in ["nvidia-gpu-katalyst-reclaimed", "nvidia-gpu-koordinator-be"] {
        let envelope = fixture(name);
        let pod = envelope["request"]["object"].clone();
        let (r, injected) = review(
            &app(settings(Backend::NvidiaShared, shim())),
            "/inject",
            &envelope,
            &pod,
        )
        .await;
        assert!(r["response"]["patch"].is_string(), "{name}: {r}");
        assert_injected(&injected, "train", "offline");
    }
}

/// What the shim does not go into: a system pod, a pod without a GPU, a DRA resource
/// claim (the webhook cannot see the claim's device class) unless the pod opts in, and a
/// container without a GPU beside one with it. Vocabularies that disagree make the pod
/// online.
#[tokio::test]
async fn system_pods_claims_and_disagreements() {
    let app = app(settings(Backend::NvidiaShared, shim()));
    let gpu = json!({"nvidia.com/gpu": "1"});
    let (envelope, pod) = classified_pod(&gpu, &|p| {
        p["metadata"]["annotations"]["katalyst.kubewharf.io/qos_level"] = json!("system_cores")
    });
    let (r, _) = review(&app, "/inject", &envelope, &pod).await;
    assert!(r["response"]["patch"].is_null(), "system: {r}");
    let (envelope, pod) = classified_pod(&json!({"nvidia.com/gpu": "0"}), &|p| {
        p["metadata"]["labels"]["koordinator.sh/qosClass"] = json!("BE")
    });
    let (r, _) = review(&app, "/inject", &envelope, &pod).await;
    assert!(r["response"]["patch"].is_null(), "no GPU: {r}");
    // MIG slices: the agent does not manage MIG.
    let (envelope, pod) = classified_pod(&json!({"nvidia.com/mig-1g.10gb": "1"}), &|p| {
        p["metadata"]["labels"]["koordinator.sh/qosClass"] = json!("BE")
    });
    let (r, _) = review(&app, "/inject", &envelope, &pod).await;
    assert!(r["response"]["patch"].is_null(), "MIG: {r}");
    let claim = |p: &mut Value| {
        p["metadata"]["labels"]["koordinator.sh/qosClass"] = json!("BE");
        p["spec"]["resourceClaims"] = json!([{"name": "gpu", "resourceClaimName": "one-gpu"}]);
        p["spec"]["containers"][0]["resources"]["claims"] = json!([{"name": "gpu"}]);
    };
    let (envelope, pod) = classified_pod(&json!({}), &claim);
    let (r, _) = review(&app, "/inject", &envelope, &pod).await;
    assert!(r["response"]["patch"].is_null(), "claim: {r}");
    let (envelope, pod) = classified_pod(&json!({}), &|p| {
        claim(p);
        p["metadata"]["annotations"]["gpu-coloc.dev/shim"] = json!("enabled");
    });
    let (r, injected) = review(&app, "/inject", &envelope, &pod).await;
    assert!(r["response"]["patch"].is_string(), "claim, opted in: {r}");
    assert_injected(&injected, "train", "offline");
    let (envelope, pod) = classified_pod(&gpu, &|p| {
        p["metadata"]["labels"]["koordinator.sh/qosClass"] = json!("BE");
        p["metadata"]["annotations"]["katalyst.kubewharf.io/qos_level"] = json!("shared_cores");
        let mut side = p["spec"]["containers"][0].clone();
        side["name"] = json!("sidecar");
        side["resources"] = json!({});
        p["spec"]["containers"].as_array_mut().unwrap().push(side);
    });
    let (r, injected) = review(&app, "/inject", &envelope, &pod).await;
    assert_injected(&injected, "train", "online");
    assert_untouched(&pod, &injected, "sidecar");
    let warned = r["response"]["warnings"].to_string();
    assert!(
        warned.contains("koordinator.sh/qosClass=BE") && warned.contains("qos_level=shared_cores"),
        "the warning names both: {r}"
    );
    assert!(r["response"]["patch"].is_string());
}

/// A tenant asking for slots itself: an offline pod's container that asks for the online
/// slot, or for several, gets exactly one slot of its own class (its pod's class decides,
/// not the request); a container without a GPU that asks for a slot keeps its request (the
/// device plugin refuses more than one per container, and a slot gives no class).
#[tokio::test]
async fn a_pod_asking_for_slots_itself_gets_one_of_its_class() {
    let mut settings = settings(Backend::NvidiaShared, shim());
    settings.shim.as_mut().unwrap().delivery = Delivery::Device;
    let app = app(settings);
    for (asked, requests) in [
        (json!({"gpu-coloc.dev/shim-online": "1"}), true),
        (json!({"gpu-coloc.dev/shim-offline": "3"}), false),
        (
            json!({"gpu-coloc.dev/shim-online": "2", "gpu-coloc.dev/shim-offline": "1"}),
            true,
        ),
    ] {
        let envelope = fixture("nvidia-gpu-koordinator-be");
        let mut pod = envelope["request"]["object"].clone();
        for (k, v) in asked.as_object().unwrap() {
            pod["spec"]["containers"][0]["resources"]["limits"][k] = v.clone();
            if requests {
                pod["spec"]["containers"][0]["resources"]["requests"][k] = v.clone();
            }
        }
        let (r, injected) = review(&app, "/inject", &envelope, &pod).await;
        assert!(r["response"]["patch"].is_string(), "{asked}: {r}");
        assert_injected_as_device(&injected, "train", "offline");
        assert_valid_pod(&injected, &asked.to_string());
        let (r, _) = review(&app, "/inject", &envelope, &as_stored(&injected)).await;
        assert!(r["response"]["patch"].is_null(), "{asked}: reinjected: {r}");
    }
}
