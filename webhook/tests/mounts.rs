//! What a pod may mount of the node's gpu-coloc directories, through the router as the
//! API server calls it: `/inject` (which drops a pod's own mounts of the injected
//! volumes), then `/mutate`, then `/validate` and `/validate-mounts` (which deny anything
//! but the injected mounts, in every container type, and `hostPath` volumes at or under
//! the node's gpu-coloc directories). An UPDATE of `pods/ephemeralcontainers` is checked
//! as the debug container it adds.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use coloc_webhook::inject::ShimSettings;
use coloc_webhook::server::{router, AppState, Limits};
use coloc_webhook::translate::{Backend, Settings};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower::ServiceExt;

const VICTIM: &str = "0b7c9f6e-1111-2222-3333-444455556666";

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

fn app() -> axum::Router {
    let s = Settings {
        shim: Some(ShimSettings::default()),
        protected_host_paths: vec!["/run/coloc-agent".into()],
        ..Settings::with_priority_class(Backend::Hami, "gpu-coloc-offline", -10)
    };
    router(AppState::new(s, Limits::default(), None))
}

/// The response to `review` at `path`, and its patch applied to the review's object.
async fn call(app: &axum::Router, path: &str, review: &Value) -> (Value, Value) {
    let resp = app
        .clone()
        .oneshot(
            Request::post(path)
                .header("content-type", "application/json")
                .body(Body::from(serde_json::to_vec(review).unwrap()))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK, "{path}");
    let r: Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    let mut pod = review["request"]["object"].clone();
    if let Some(p) = r["response"]["patch"].as_str() {
        use base64::Engine;
        let bytes = base64::engine::general_purpose::STANDARD.decode(p).unwrap();
        let patch: json_patch::Patch = serde_json::from_slice(&bytes).unwrap();
        json_patch::patch(&mut pod, &patch).unwrap();
    }
    (r, pod)
}

fn with_object(envelope: &Value, pod: &Value) -> Value {
    let mut e = envelope.clone();
    e["request"]["object"] = pod.clone();
    e
}

fn allowed(r: &Value) -> bool {
    r["response"]["allowed"] == true
}

fn message(r: &Value) -> String {
    r["response"]["status"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// The pod as the API server would hold it after `/inject` and `/mutate`, and what
/// `/validate` and `/validate-mounts` say about it.
async fn admit(envelope: &Value) -> (Value, Value, Value) {
    let app = app();
    let (r, pod) = call(&app, "/inject", envelope).await;
    assert!(allowed(&r), "/inject never denies: {r}");
    let (r, pod) = call(&app, "/mutate", &with_object(envelope, &pod)).await;
    assert!(allowed(&r), "/mutate: {r}");
    let (v, _) = call(&app, "/validate", &with_object(envelope, &pod)).await;
    let (m, _) = call(&app, "/validate-mounts", &with_object(envelope, &pod)).await;
    (pod, v, m)
}

/// Straight to the validating endpoints (the pod was not injected: an opted-out pod or
/// namespace, or /inject unreachable under failurePolicy Ignore).
async fn validate_only(envelope: &Value) -> (Value, Value) {
    let app = app();
    let (v, _) = call(&app, "/validate", envelope).await;
    let (m, _) = call(&app, "/validate-mounts", envelope).await;
    (v, m)
}

fn our_mounts(pod: &Value) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for list in ["initContainers", "containers", "ephemeralContainers"] {
        for c in pod["spec"][list].as_array().into_iter().flatten() {
            for m in c["volumeMounts"].as_array().into_iter().flatten() {
                if m["name"].as_str().unwrap_or("").starts_with("gpu-coloc-") {
                    out.push((c["name"].as_str().unwrap().to_string(), m.clone()));
                }
            }
        }
    }
    out
}

/// Every mount of ours in `pod` is one the injection writes.
fn only_injected(pod: &Value) {
    for (c, m) in our_mounts(pod) {
        let ok = match m["name"].as_str().unwrap() {
            "gpu-coloc-shim" | "gpu-coloc-gate" => {
                m["readOnly"] == true && m.get("subPath").is_none()
            }
            "gpu-coloc-doorbells" => {
                m["subPathExpr"] == "$(COLOC_POD_UID)" && m.get("subPath").is_none()
            }
            _ => false,
        };
        assert!(ok, "{c} keeps {m}");
    }
}

fn offline_pod_with_sidecar(sidecar: Value) -> Value {
    let mut e = fixture("offline-deployment-create");
    e["request"]["object"]["spec"]["containers"]
        .as_array_mut()
        .unwrap()
        .push(sidecar);
    e
}

fn rw_mounts() -> Value {
    json!([
        {"name": "gpu-coloc-shim", "mountPath": "/var/lib/gpu-coloc/lib"},
        {"name": "gpu-coloc-doorbells", "mountPath": "/run/gpu-coloc/doorbells"},
        {"name": "gpu-coloc-gate", "mountPath": "/run/gpu-coloc/gate"}
    ])
}

#[tokio::test]
async fn a_sidecar_mounting_the_volumes_read_write_keeps_nothing_of_them() {
    // The tenant writes no hostPath: the volumes come from the injection, the mounts
    // from the sidecar.
    let e = offline_pod_with_sidecar(
        json!({"name": "sidecar", "image": "busybox", "volumeMounts": rw_mounts()}),
    );
    let (pod, v, m) = admit(&e).await;
    only_injected(&pod);
    assert!(
        our_mounts(&pod).iter().all(|(c, _)| c == "train"),
        "{:?}",
        our_mounts(&pod)
    );
    assert!(allowed(&v) && allowed(&m), "{v} {m}");
    // Had the injection not run, the validating side refuses the same pod.
    let (v, m) = validate_only(&e).await;
    for r in [&v, &m] {
        assert!(!allowed(r), "{r}");
        assert!(message(r).contains("sidecar"), "{}", message(r));
        assert_eq!(r["response"]["status"]["code"], 403);
    }
}

#[tokio::test]
async fn the_gpu_container_cannot_pre_mount_the_whole_doorbell_directory() {
    for mount in [
        json!({"name": "gpu-coloc-doorbells", "mountPath": "/run/gpu-coloc/doorbells"}),
        json!({"name": "gpu-coloc-doorbells", "mountPath": "/run/gpu-coloc/doorbells", "subPath": VICTIM}),
        json!({"name": "gpu-coloc-doorbells", "mountPath": "/bells", "subPathExpr": "$(COLOC_POD_UID)"}),
        json!({"name": "gpu-coloc-shim", "mountPath": "/var/lib/gpu-coloc/lib"}),
    ] {
        let mut e = fixture("offline-deployment-create");
        e["request"]["object"]["spec"]["containers"][0]["volumeMounts"] = json!([mount.clone()]);
        let (pod, v, m) = admit(&e).await;
        only_injected(&pod);
        let names: Vec<String> = our_mounts(&pod)
            .iter()
            .map(|(_, m)| m["name"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(
            names,
            ["gpu-coloc-shim", "gpu-coloc-doorbells", "gpu-coloc-gate"],
            "{mount}"
        );
        assert!(allowed(&v) && allowed(&m), "{mount}: {v} {m}");
        let (v, m) = validate_only(&e).await;
        assert!(!allowed(&v) && !allowed(&m), "{mount}: {v} {m}");
    }
    // Its own UID chosen by the pod (another pod's directory): replaced by the injection,
    // refused without it.
    let mut e = fixture("offline-deployment-create");
    let c = &mut e["request"]["object"]["spec"]["containers"][0];
    c["env"] = json!([{"name": "COLOC_POD_UID", "value": VICTIM}]);
    c["volumeMounts"] = json!([{"name": "gpu-coloc-doorbells", "mountPath": "/run/gpu-coloc/doorbells", "subPathExpr": "$(COLOC_POD_UID)"}]);
    let (pod, v, m) = admit(&e).await;
    assert!(allowed(&v) && allowed(&m), "{v} {m}");
    let env = &pod["spec"]["containers"][0]["env"];
    assert!(!env.to_string().contains(VICTIM), "{env}");
    let (v, m) = validate_only(&e).await;
    assert!(!allowed(&v) && !allowed(&m), "{v} {m}");
    assert!(message(&m).contains("COLOC_POD_UID"), "{}", message(&m));
}

#[tokio::test]
async fn an_init_container_is_held_to_the_same_rule() {
    let mut e = fixture("offline-deployment-create");
    e["request"]["object"]["spec"]["initContainers"] =
        json!([{"name": "prep", "image": "busybox", "volumeMounts": rw_mounts()}]);
    let (pod, v, m) = admit(&e).await;
    only_injected(&pod);
    assert!(our_mounts(&pod).iter().all(|(c, _)| c == "train"));
    assert!(allowed(&v) && allowed(&m), "{v} {m}");
    let (v, m) = validate_only(&e).await;
    assert!(
        !allowed(&m) && message(&m).contains("init container \"prep\""),
        "{m}"
    );
    assert!(!allowed(&v), "{v}");
}

/// `kubectl debug`: an UPDATE of the `pods/ephemeralcontainers` subresource.
fn debug(pod: &Value, mounts: Value) -> Value {
    let mut e = fixture("offline-deployment-create");
    let mut new = pod.clone();
    new["spec"]["ephemeralContainers"] =
        json!([{"name": "debugger", "image": "busybox", "volumeMounts": mounts}]);
    e["request"]["operation"] = json!("UPDATE");
    e["request"]["subResource"] = json!("ephemeralcontainers");
    e["request"]["options"] = json!({"apiVersion": "meta.k8s.io/v1", "kind": "UpdateOptions"});
    e["request"]["oldObject"] = pod.clone();
    e["request"]["object"] = new;
    e
}

#[tokio::test]
async fn an_ephemeral_container_cannot_mount_them_later() {
    let (pod, _, _) = admit(&fixture("offline-deployment-create")).await;
    let app = app();
    for mount in [
        json!({"name": "gpu-coloc-shim", "mountPath": "/var/lib/gpu-coloc/lib"}),
        json!({"name": "gpu-coloc-gate", "mountPath": "/run/gpu-coloc/gate"}),
        json!({"name": "gpu-coloc-doorbells", "mountPath": "/run/gpu-coloc/doorbells"}),
    ] {
        let (r, _) = call(
            &app,
            "/validate-mounts",
            &debug(&pod, json!([mount.clone()])),
        )
        .await;
        assert!(!allowed(&r), "{mount}: {r}");
        assert!(
            message(&r).contains("ephemeral container \"debugger\""),
            "{r}"
        );
    }
    // Read-only, as injected: nothing more than the pod's own containers have.
    let ro = json!([{"name": "gpu-coloc-shim", "mountPath": "/var/lib/gpu-coloc/lib", "readOnly": true}]);
    let (r, _) = call(&app, "/validate-mounts", &debug(&pod, ro)).await;
    assert!(allowed(&r), "{r}");
    // Without mounts of ours, and other subresources: allowed.
    let (r, _) = call(&app, "/validate-mounts", &debug(&pod, json!([]))).await;
    assert!(allowed(&r), "{r}");
    let mut status = debug(&pod, rw_mounts());
    status["request"]["subResource"] = json!("status");
    let (r, _) = call(&app, "/validate-mounts", &status).await;
    assert!(allowed(&r), "{r}");
}

#[tokio::test]
async fn host_paths_at_or_under_the_node_directories_are_refused() {
    let app = app();
    // Any pod, mGPU or not.
    for base in ["plain-pod", "offline-deployment-create"] {
        for (path, read_only, ok) in [
            ("/run/gpu-coloc/doorbells", true, false),
            ("/run/gpu-coloc/doorbells/pods", false, false),
            ("/run/gpu-coloc/./doorbells/", false, false),
            ("//run//gpu-coloc//gate", true, false),
            ("/run/gpu-coloc/x/../gate", false, false),
            ("/run/../run/gpu-coloc/doorbells/pods/", false, false),
            ("/var/run/gpu-coloc/doorbells", false, false),
            ("/var/lib/gpu-coloc/lib/", true, false),
            ("/var/lib/gpu-coloc/lib/../lib", false, false),
            ("/run/coloc-agent", true, false),
            // Other spellings of the same directories.
            ("/proc/1/root/run/gpu-coloc/gate", true, false),
            (
                "/proc/self/root//var/run/./gpu-coloc/doorbells",
                false,
                false,
            ),
            ("/proc/1/task/1/root/var/lib/gpu-coloc/lib", true, false),
            ("/proc/1/root/../run/gpu-coloc/gate", false, false),
            // The gpu-coloc parents are ours too.
            ("/var/lib/gpu-coloc", false, false),
            ("/run/gpu-coloc", true, false),
            // Containing them only: not ours to refuse, writable or not (`kubectl debug
            // node/…` mounts `/`; HAMi's vgpu-monitor `/var`).
            ("/run", false, true),
            ("/", false, true),
            ("/var", false, true),
            ("/proc", false, true),
            ("/run", true, true),
            ("/", true, true),
            // Elsewhere: not ours to judge.
            ("/data/scratch", false, true),
            ("/run/gpu-coloc-other", false, true),
        ] {
            let mut e = fixture(base);
            let p = &mut e["request"]["object"]["spec"];
            p["volumes"] = json!([{"name": "host", "hostPath": {"path": path}}]);
            p["containers"][0]["volumeMounts"] =
                json!([{"name": "host", "mountPath": "/host", "readOnly": read_only}]);
            let (r, _) = call(&app, "/validate-mounts", &e).await;
            assert_eq!(
                allowed(&r),
                ok,
                "{base}: hostPath {path} ro={read_only}: {r}"
            );
            if !ok {
                assert_eq!(r["response"]["status"]["code"], 403);
            }
        }
    }
    // The volumes' own names, declared by the pod as something else.
    for v in [
        json!({"name": "gpu-coloc-shim", "emptyDir": {}}),
        json!({"name": "gpu-coloc-doorbells", "hostPath": {"path": "/run/gpu-coloc/doorbells"}}),
    ] {
        let mut e = fixture("plain-pod");
        e["request"]["object"]["spec"]["volumes"] = json!([v.clone()]);
        let (r, _) = call(&app, "/validate-mounts", &e).await;
        assert!(!allowed(&r) && message(&r).contains("reserved"), "{v}: {r}");
    }
}

#[tokio::test]
async fn injected_pods_pass_and_a_second_pass_changes_nothing() {
    for name in [
        "offline-deployment-create",
        "online-create-no-annotations",
        "offline-multi-container-init",
    ] {
        let e = fixture(name);
        let (pod, v, m) = admit(&e).await;
        assert!(allowed(&v) && allowed(&m), "{name}: {v} {m}");
        assert!(!our_mounts(&pod).is_empty(), "{name}: not injected");
        let (r, again) = call(&app(), "/inject", &with_object(&e, &pod)).await;
        assert!(r["response"]["patch"].is_null(), "{name}: {r}");
        assert_eq!(again, pod);
    }
}

/// The pods the issue names, as their tools write them: `kubectl debug node/…` (the node's
/// `/` at `/host`, writable) and HAMi's vgpu-monitor (`/var` writable, outside
/// `kube-system`) are allowed; the same pod reaching the gate through `/proc/1/root` is
/// not.
#[tokio::test]
async fn node_debuggers_and_monitors_are_not_ours_to_refuse() {
    let app = app();
    let debug = json!({
        "name": "node-debugger-node1-abcde", "namespace": "default",
        "spec": {"hostPID": true, "hostNetwork": true, "hostIPC": true, "nodeName": "node1",
            "containers": [{"name": "debugger", "image": "busybox", "stdin": true, "tty": true,
                "volumeMounts": [{"name": "host-root", "mountPath": "/host"}]}],
            "volumes": [{"name": "host-root", "hostPath": {"path": "/"}}]}
    });
    let monitor = json!({
        "name": "hami-device-plugin-x", "namespace": "hami-system",
        "spec": {"containers": [{"name": "vgpu-monitor", "image": "projecthami/hami",
                "volumeMounts": [{"name": "hosttmp", "mountPath": "/hostvar"}]}],
            "volumes": [{"name": "hosttmp", "hostPath": {"path": "/var"}}]}
    });
    let mut reach = debug.clone();
    reach["spec"]["volumes"][0]["hostPath"]["path"] = json!("/proc/1/root/run/gpu-coloc/gate");
    let mut sub = debug.clone();
    sub["spec"]["containers"][0]["volumeMounts"][0]["subPath"] = json!("run/gpu-coloc/doorbells");
    for (what, pod, ok) in [
        ("kubectl debug node", debug, true),
        ("HAMi vgpu-monitor", monitor, true),
        ("the gate through /proc/1/root", reach, false),
        ("the doorbells through a subPath of /", sub, false),
    ] {
        let mut e = fixture("plain-pod");
        e["request"]["namespace"] = pod["namespace"].clone();
        e["request"]["object"]["metadata"]["name"] = pod["name"].clone();
        e["request"]["object"]["spec"] = pod["spec"].clone();
        let (r, _) = call(&app, "/validate-mounts", &e).await;
        assert_eq!(allowed(&r), ok, "{what}: {r}");
    }
}
