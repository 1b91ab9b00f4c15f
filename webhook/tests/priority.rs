//! The offline priority class takes effect on a real API server.
//!
//! What the API server does with a pod CREATE (kubernetes `plugin/pkg/admission/priority`
//! and `apiserver/pkg/admission/reinvocation.go`, as of 1.33): the in-tree mutating
//! plugins run first, Priority among them: it resolves `spec.priorityClassName` (or the
//! global default class, or none: 0) into `spec.priority` and `spec.preemptionPolicy`,
//! and refuses a pod whose `spec.priority` (or policy) was given and differs from what
//! the class says. Then the mutating webhooks run. If a webhook changed the pod, the whole
//! in-tree chain runs again (Priority included), then the webhooks with
//! `reinvocationPolicy: IfNeeded`.
//!
//! So a webhook that only adds `priorityClassName` either has no effect (the priority was
//! already resolved to 0) or gets the pod refused by the second Priority pass. The model
//! below is that chain; the webhook is the real `review` function.

use base64::Engine;
use coloc_webhook::review::{review, Mode};
use coloc_webhook::translate::{Backend, Settings};
use serde_json::{json, Value};

const OFFLINE_CLASS: &str = "gpu-coloc-offline";

/// PriorityClasses in the model cluster: name → (value, preemptionPolicy, globalDefault).
type Classes<'a> = &'a [(&'a str, i32, &'a str, bool)];

/// The Priority admission plugin's CREATE path.
fn priority_admit(pod: &mut Value, classes: Classes) -> Result<(), String> {
    let spec = &mut pod["spec"];
    let name = spec["priorityClassName"].as_str().unwrap_or("").to_string();
    let (name, value, policy) = if name.is_empty() {
        match classes.iter().find(|c| c.3) {
            Some(c) => (c.0.to_string(), c.1, c.2),
            None => (String::new(), 0, "PreemptLowerPriority"),
        }
    } else {
        match classes.iter().find(|c| c.0 == name) {
            Some(c) => (name, c.1, c.2),
            None => return Err(format!("no PriorityClass with name {name} was found")),
        }
    };
    if !name.is_empty() {
        spec["priorityClassName"] = json!(name);
    }
    if let Some(given) = spec["priority"].as_i64() {
        if given != i64::from(value) {
            return Err(format!("the integer value of priority ({given}) must not be provided in pod spec; priority admission controller computed {value} from the given PriorityClass name"));
        }
    }
    spec["priority"] = json!(value);
    if let Some(given) = spec["preemptionPolicy"].as_str() {
        if given != policy {
            return Err(format!("the string value of PreemptionPolicy ({given}) must not be provided in pod spec; priority admission controller computed {policy} from the given PriorityClass name"));
        }
    }
    spec["preemptionPolicy"] = json!(policy);
    Ok(())
}

/// One pass of the mutating webhook (the real handler); `true` when it changed the pod.
fn webhook(pod: &mut Value, settings: &Settings) -> Result<bool, String> {
    let mut envelope: Value = serde_json::from_slice(
        &std::fs::read(format!(
            "{}/tests/data/offline-deployment-create.json",
            env!("CARGO_MANIFEST_DIR")
        ))
        .unwrap(),
    )
    .unwrap();
    envelope["request"]["object"] = pod.clone();
    let r = review(
        &serde_json::to_vec(&envelope).unwrap(),
        Mode::Mutate,
        None,
        settings,
    );
    let out: Value = serde_json::from_slice(&r.body).unwrap();
    if out["response"]["allowed"] != json!(true) {
        return Err(out["response"]["status"]["message"].to_string());
    }
    let Some(patch) = out["response"]["patch"].as_str() else {
        return Ok(false);
    };
    let patch: json_patch::Patch = serde_json::from_slice(
        &base64::engine::general_purpose::STANDARD
            .decode(patch)
            .unwrap(),
    )
    .unwrap();
    let before = pod.clone();
    json_patch::patch(pod, &patch).map_err(|e| e.to_string())?;
    Ok(*pod != before)
}

/// The API server's mutating admission of a pod CREATE: in-tree plugins, webhooks, and
/// once more if a webhook changed the pod.
fn admit(mut pod: Value, classes: Classes, settings: &Settings) -> Result<Value, String> {
    priority_admit(&mut pod, classes)?;
    if webhook(&mut pod, settings)? {
        priority_admit(&mut pod, classes)?;
        webhook(&mut pod, settings)?;
    }
    Ok(pod)
}

fn offline_pod(spec_extra: Value) -> Value {
    let mut pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "trainer", "namespace": "ml"},
        "spec": {"containers": [{"name": "train", "image": "x",
            "resources": {"limits": {"vke.volcengine.com/reclaimed-mgpu-core": "50"}}}]}
    });
    for (k, v) in spec_extra.as_object().unwrap() {
        pod["spec"][k] = v.clone();
    }
    pod
}

const CLASSES: Classes = &[
    (OFFLINE_CLASS, -10, "Never", false),
    ("high", 1000, "PreemptLowerPriority", false),
];

#[test]
fn offline_class_takes_effect_through_the_priority_plugin_and_reinvocation() {
    for backend in [Backend::Vke, Backend::NvidiaShared, Backend::Hami] {
        let settings = Settings::with_priority_class(backend, OFFLINE_CLASS, -10);
        let pod = admit(offline_pod(json!({})), CLASSES, &settings)
            .unwrap_or_else(|e| panic!("{backend}: refused: {e}"));
        assert_eq!(pod["spec"]["priorityClassName"], OFFLINE_CLASS, "{backend}");
        assert_eq!(
            pod["spec"]["priority"], -10,
            "{backend}: the scheduler reads spec.priority"
        );
        assert_eq!(pod["spec"]["preemptionPolicy"], "Never", "{backend}");
    }
}

#[test]
fn a_class_name_alone_would_be_refused_by_the_second_priority_pass() {
    // What the webhook used to do (name only, and only while spec.priority was unset,
    // which on a real API server it never is): the model refuses it, so it bites.
    let mut pod = offline_pod(json!({}));
    priority_admit(&mut pod, CLASSES).unwrap();
    assert_eq!(
        pod["spec"]["priority"], 0,
        "resolved before any webhook runs"
    );
    pod["spec"]["priorityClassName"] = json!(OFFLINE_CLASS);
    let e = priority_admit(&mut pod, CLASSES).unwrap_err();
    assert!(e.contains("priority (0) must not be provided"), "{e}");
}

#[test]
fn a_value_that_differs_from_the_class_is_refused_so_the_chart_passes_the_same() {
    // The webhook's settings must carry the class's own value: with another value the
    // second Priority pass refuses the pod (the chart renders both from one value).
    let settings = Settings::with_priority_class(Backend::Hami, OFFLINE_CLASS, -5);
    let e = admit(offline_pod(json!({})), CLASSES, &settings).unwrap_err();
    assert!(e.contains("computed -10"), "{e}");
}

#[test]
fn a_class_the_pod_or_the_cluster_default_chose_is_kept() {
    let settings = Settings::with_priority_class(Backend::Hami, OFFLINE_CLASS, -10);
    let pod = admit(
        offline_pod(json!({"priorityClassName": "high"})),
        CLASSES,
        &settings,
    )
    .unwrap();
    assert_eq!(
        (
            pod["spec"]["priorityClassName"].as_str(),
            pod["spec"]["priority"].as_i64()
        ),
        (Some("high"), Some(1000))
    );

    let with_default: Classes = &[
        (OFFLINE_CLASS, -10, "Never", false),
        ("batch-default", 10, "PreemptLowerPriority", true),
    ];
    let pod = admit(offline_pod(json!({})), with_default, &settings).unwrap();
    assert_eq!(
        (
            pod["spec"]["priorityClassName"].as_str(),
            pod["spec"]["priority"].as_i64()
        ),
        (Some("batch-default"), Some(10)),
        "the Priority plugin names the global default before the webhook runs"
    );
}

#[test]
fn settings_without_the_class_value_are_refused_at_start() {
    let mut s = Settings::new(Backend::Vke);
    s.offline_priority_class = Some(OFFLINE_CLASS.into());
    assert!(s.check().unwrap_err().contains("offline_priority"));
    s.offline_priority = Some(-10);
    s.offline_preemption_policy = Some("Sometimes".into());
    assert!(s
        .check()
        .unwrap_err()
        .contains("Never, PreemptLowerPriority"));
}
