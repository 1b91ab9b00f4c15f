//! Pure translation of a Pod's mGPU requests for a GPU backend. No I/O.
//!
//! Input: the Pod as JSON (as the API server sends it). Output: RFC 6902 operations, or a
//! denial whose message names the container, the field and the allowed values.
//!
//! Rules (DESIGN.md):
//! - `mgpu-core` (online) and `reclaimed-mgpu-core` (offline): 1–100 or a multiple of 100;
//!   `mgpu-memory` in MiB, only together with cores;
//! - one container may not ask for both; one pod may not mix online and offline containers;
//! - `qos_level` is set when missing (`reclaimed_cores` for offline, `shared_cores` for
//!   online) and must not contradict the request;
//! - the compute policy defaults to `guaranteed-burst-share`; offline pods may not use
//!   `native-burst-share`;
//! - a second pass over the mutated pod yields no operation (idempotent).

use qos_core::resources::{
    parse_memory_mib, CorePercent, COMPUTE_POLICY_ANNOTATION, MGPU_CORE, MGPU_MEMORY,
    RECLAIMED_MGPU_CORE,
};
use qos_core::{ComputePolicy, QosLevel, QOS_LEVEL_ANNOTATION};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use std::fmt;
use std::str::FromStr;

/// Annotation recording which backend translated the pod.
pub const BACKEND_ANNOTATION: &str = "gpu-coloc.dev/backend";
/// Annotation recording the original mGPU requests (JSON, per container).
pub const REQUESTS_ANNOTATION: &str = "gpu-coloc.dev/requests";
/// The MPS client priority hint for offline containers on `nvidia-shared`.
pub const MPS_PRIORITY_ENV: &str = "CUDA_MPS_CLIENT_PRIORITY";

/// The cluster's GPU backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Backend {
    /// Volcengine mGPU: requests stay as they are; annotations only.
    Vke,
    /// NVIDIA device plugin with time-slicing/MPS replicas: `nvidia.com/gpu` plus
    /// annotations and MPS hints.
    NvidiaShared,
    /// HAMi: `nvidia.com/gpu`, `gpucores`, `gpumem`, `priority`.
    Hami,
}

impl Backend {
    /// Name as written in configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Vke => "vke",
            Backend::NvidiaShared => "nvidia-shared",
            Backend::Hami => "hami",
        }
    }
}

impl FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "vke" => Ok(Backend::Vke),
            "nvidia-shared" => Ok(Backend::NvidiaShared),
            "hami" => Ok(Backend::Hami),
            _ => Err(format!(
                "backend {s:?} is not known; allowed: vke, nvidia-shared, hami"
            )),
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Translation settings.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// Backend for namespaces that do not choose one.
    pub backend: Backend,
    /// Priority class given to offline pods that have none (none when unset).
    #[serde(default)]
    pub offline_priority_class: Option<String>,
}

/// A denial: the message shown to the user, and a bounded reason for metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denial {
    /// Message (names container, field, allowed values).
    pub message: String,
    /// Bounded metric label.
    pub reason: &'static str,
}

fn deny(reason: &'static str, message: String) -> Denial {
    Denial { message, reason }
}

/// JSON-pointer escaping of one path segment (RFC 6901).
pub fn esc(s: &str) -> String {
    s.replace('~', "~0").replace('/', "~1")
}

#[derive(Debug, Clone)]
struct ContainerReq {
    name: String,
    path: String,
    online: Option<CorePercent>,
    offline: Option<CorePercent>,
    memory: Option<u64>,
}

fn quantity(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

fn read_container(name: &str, path: String, c: &Value) -> Result<Option<ContainerReq>, Denial> {
    let res = &c["resources"];
    let mut got: [Option<String>; 3] = [None, None, None];
    for (i, key) in [MGPU_CORE, RECLAIMED_MGPU_CORE, MGPU_MEMORY]
        .iter()
        .enumerate()
    {
        let mut seen: Option<String> = None;
        for part in ["limits", "requests"] {
            if let Some(v) = res[part].get(*key) {
                let q = quantity(v).ok_or_else(|| {
                    deny("malformed", format!("container {name:?}: resources.{part}[{key}] must be a quantity string, got {v}"))
                })?;
                if let Some(prev) = &seen {
                    if prev.trim() != q.trim() {
                        return Err(deny(
                            "mismatch",
                            format!("container {name:?}: {key} differs between requests ({q}) and limits ({prev}); extended resources must be equal"),
                        ));
                    }
                }
                seen = Some(q);
            }
        }
        got[i] = seen;
    }
    let [core, reclaimed, memory] = got;
    if core.is_none() && reclaimed.is_none() && memory.is_none() {
        return Ok(None);
    }
    let ctx =
        |e: qos_core::ResourceError| deny(e.metric_label(), format!("container {name:?}: {e}"));
    let online = core
        .as_deref()
        .map(|v| CorePercent::parse(MGPU_CORE, v))
        .transpose()
        .map_err(ctx)?;
    let offline = reclaimed
        .as_deref()
        .map(|v| CorePercent::parse(RECLAIMED_MGPU_CORE, v))
        .transpose()
        .map_err(ctx)?;
    let memory = memory
        .as_deref()
        .map(parse_memory_mib)
        .transpose()
        .map_err(ctx)?;
    if online.is_some() && offline.is_some() {
        return Err(deny(
            "both_online_and_offline",
            format!("container {name:?} asks for both {MGPU_CORE} (online) and {RECLAIMED_MGPU_CORE} (offline); allowed: one of them"),
        ));
    }
    if memory.is_some() && online.is_none() && offline.is_none() {
        return Err(deny(
            "memory_without_cores",
            format!("container {name:?} asks for {MGPU_MEMORY} without cores; add {MGPU_CORE} (online) or {RECLAIMED_MGPU_CORE} (offline)"),
        ));
    }
    Ok(Some(ContainerReq {
        name: name.to_string(),
        path,
        online,
        offline,
        memory,
    }))
}

/// Translates `pod` for `backend`. `Ok(vec![])` means: allowed, nothing to change.
pub fn translate(pod: &Value, backend: Backend, s: &Settings) -> Result<Vec<Value>, Denial> {
    let mut reqs = Vec::new();
    for list in ["initContainers", "containers"] {
        if let Some(cs) = pod["spec"][list].as_array() {
            for (i, c) in cs.iter().enumerate() {
                let name = c["name"].as_str().unwrap_or("?");
                if let Some(r) = read_container(name, format!("/spec/{list}/{i}"), c)? {
                    reqs.push(r);
                }
            }
        }
    }
    if reqs.is_empty() {
        return Ok(vec![]);
    }
    let offline = reqs.iter().any(|r| r.offline.is_some());
    let online = reqs.iter().any(|r| r.online.is_some());
    if offline && online {
        let on: Vec<_> = reqs
            .iter()
            .filter(|r| r.online.is_some())
            .map(|r| r.name.as_str())
            .collect();
        let off: Vec<_> = reqs
            .iter()
            .filter(|r| r.offline.is_some())
            .map(|r| r.name.as_str())
            .collect();
        return Err(deny(
            "mixed_pod",
            format!("pod mixes online containers {on:?} ({MGPU_CORE}) and offline containers {off:?} ({RECLAIMED_MGPU_CORE}); a pod is either online or offline"),
        ));
    }
    let empty = Map::new();
    let annotations = pod["metadata"]["annotations"].as_object().unwrap_or(&empty);
    let mut ops = Vec::new();
    let add_annotation = |ops: &mut Vec<Value>, key: &str, value: &str| {
        if annotations.get(key).and_then(Value::as_str) == Some(value) {
            return;
        }
        let op = if annotations.contains_key(key) {
            "replace"
        } else {
            "add"
        };
        ops.push(json!({"op": op, "path": format!("/metadata/annotations/{}", esc(key)), "value": value}));
    };
    if pod["metadata"]["annotations"].as_object().is_none() {
        ops.push(json!({"op": "add", "path": "/metadata/annotations", "value": {}}));
    }

    // qos_level.
    let level = QosLevel::parse(
        annotations
            .get(QOS_LEVEL_ANNOTATION)
            .and_then(Value::as_str),
    );
    match (&level, offline) {
        (QosLevel::Missing, true) => add_annotation(&mut ops, QOS_LEVEL_ANNOTATION, "reclaimed_cores"),
        (QosLevel::Missing, false) => add_annotation(&mut ops, QOS_LEVEL_ANNOTATION, "shared_cores"),
        (QosLevel::ReclaimedCores, true) | (QosLevel::SharedCores | QosLevel::DedicatedCores, false) => {}
        (QosLevel::SharedCores | QosLevel::DedicatedCores | QosLevel::SystemCores, true) => {
            return Err(deny(
                "qos_contradiction",
                format!(
                    "pod is {QOS_LEVEL_ANNOTATION}={} but asks for {RECLAIMED_MGPU_CORE}; allowed: reclaimed_cores for offline requests, or use {MGPU_CORE}",
                    level.as_annotation().unwrap_or("")
                ),
            ))
        }
        (QosLevel::ReclaimedCores | QosLevel::SystemCores, false) => {
            return Err(deny(
                "qos_contradiction",
                format!(
                    "pod is {QOS_LEVEL_ANNOTATION}={} but asks for {MGPU_CORE} (online cores); allowed: shared_cores or dedicated_cores, or use {RECLAIMED_MGPU_CORE}",
                    level.as_annotation().unwrap_or("")
                ),
            ))
        }
        (QosLevel::Unknown(v), _) => {
            return Err(deny(
                "qos_unknown",
                format!("{QOS_LEVEL_ANNOTATION}={v:?} is not a QoS level; allowed: shared_cores, dedicated_cores, reclaimed_cores, system_cores"),
            ))
        }
    }

    // Compute policy.
    let policy_raw = annotations
        .get(COMPUTE_POLICY_ANNOTATION)
        .and_then(Value::as_str);
    let policy = ComputePolicy::from_annotation(policy_raw)
        .map_err(|e| deny(e.metric_label(), e.to_string()))?;
    if offline && !policy.allowed_for_offline() {
        return Err(deny(
            "native_burst_offline",
            format!("{COMPUTE_POLICY_ANNOTATION}=native-burst-share is not supported for offline (reclaimed) pods: co-location supports fixed-share and guaranteed-burst-share"),
        ));
    }
    if policy_raw.is_none() {
        add_annotation(&mut ops, COMPUTE_POLICY_ANNOTATION, policy.as_str());
    }

    // Priority class for offline pods.
    if offline && pod["spec"]["priorityClassName"].is_null() && pod["spec"]["priority"].is_null() {
        if let Some(pc) = &s.offline_priority_class {
            ops.push(json!({"op": "add", "path": "/spec/priorityClassName", "value": pc}));
        }
    }

    if backend != Backend::Vke {
        let record: Map<String, Value> = reqs
            .iter()
            .map(|r| {
                let core = r.online.or(r.offline).map(|c| c.0);
                (r.name.clone(), json!({"class": if r.offline.is_some() {"offline"} else {"online"}, "core": core, "memory_mib": r.memory}))
            })
            .collect();
        add_annotation(
            &mut ops,
            REQUESTS_ANNOTATION,
            &Value::Object(record).to_string(),
        );
        for r in &reqs {
            translate_container(&mut ops, pod, r, backend);
        }
    }
    add_annotation(&mut ops, BACKEND_ANNOTATION, backend.as_str());
    // Only the annotations block was to be created: nothing else to do, no patch.
    if ops.len() == 1 && ops[0]["path"] == "/metadata/annotations" {
        ops.clear();
    }
    Ok(ops)
}

fn translate_container(ops: &mut Vec<Value>, pod: &Value, r: &ContainerReq, backend: Backend) {
    let c = pod.pointer(&r.path).cloned().unwrap_or(Value::Null);
    let core = r.online.or(r.offline).unwrap_or(CorePercent(100));
    for part in ["limits", "requests"] {
        let Some(map) = c["resources"][part].as_object() else {
            continue;
        };
        let mut m = map.clone();
        m.remove(MGPU_CORE);
        m.remove(RECLAIMED_MGPU_CORE);
        m.remove(MGPU_MEMORY);
        m.insert("nvidia.com/gpu".into(), json!(core.gpus().to_string()));
        if backend == Backend::Hami {
            m.insert(
                "nvidia.com/gpucores".into(),
                json!(core.percent_of_one().to_string()),
            );
            if let Some(mem) = r.memory {
                m.insert("nvidia.com/gpumem".into(), json!(mem.to_string()));
            }
            // HAMi: 0 is high priority (online), 1 low (offline).
            m.insert(
                "nvidia.com/priority".into(),
                json!(if r.offline.is_some() { "1" } else { "0" }),
            );
        }
        ops.push(
            json!({"op": "replace", "path": format!("{}/resources/{part}", r.path), "value": m}),
        );
    }
    if backend == Backend::NvidiaShared && r.offline.is_some() {
        let env = c["env"].as_array();
        let has = env.is_some_and(|e| e.iter().any(|v| v["name"] == MPS_PRIORITY_ENV));
        if !has {
            let var = json!({"name": MPS_PRIORITY_ENV, "value": "1"});
            match env {
                Some(_) => ops
                    .push(json!({"op": "add", "path": format!("{}/env/-", r.path), "value": var})),
                None => ops
                    .push(json!({"op": "add", "path": format!("{}/env", r.path), "value": [var]})),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(b: Backend) -> Settings {
        Settings {
            backend: b,
            offline_priority_class: Some("gpu-coloc-offline".into()),
        }
    }

    fn pod(annotations: Value, resources: Value) -> Value {
        json!({
            "metadata": {"name": "p", "annotations": annotations},
            "spec": {"containers": [{"name": "main", "image": "x", "resources": resources}]}
        })
    }

    fn apply(pod: &Value, ops: &[Value]) -> Value {
        let mut p = pod.clone();
        let patch: json_patch::Patch = serde_json::from_value(Value::Array(ops.to_vec())).unwrap();
        json_patch::patch(&mut p, &patch).unwrap();
        p
    }

    #[test]
    fn offline_for_each_backend_is_idempotent() {
        let p = pod(
            json!({}),
            json!({"limits": {"vke.volcengine.com/reclaimed-mgpu-core": "30", "vke.volcengine.com/mgpu-memory": "4096", "cpu": "1"}}),
        );
        for b in [Backend::Vke, Backend::NvidiaShared, Backend::Hami] {
            let ops = translate(&p, b, &settings(b)).unwrap();
            let out = apply(&p, &ops);
            assert_eq!(
                out["metadata"]["annotations"][QOS_LEVEL_ANNOTATION],
                "reclaimed_cores"
            );
            assert_eq!(
                out["metadata"]["annotations"][COMPUTE_POLICY_ANNOTATION],
                "guaranteed-burst-share"
            );
            assert_eq!(out["spec"]["priorityClassName"], "gpu-coloc-offline");
            let limits = &out["spec"]["containers"][0]["resources"]["limits"];
            assert_eq!(limits["cpu"], "1");
            match b {
                Backend::Vke => assert_eq!(limits[RECLAIMED_MGPU_CORE], "30"),
                Backend::NvidiaShared => {
                    assert_eq!(limits["nvidia.com/gpu"], "1");
                    assert!(limits.get(RECLAIMED_MGPU_CORE).is_none());
                    assert_eq!(
                        out["spec"]["containers"][0]["env"][0]["name"],
                        MPS_PRIORITY_ENV
                    );
                }
                Backend::Hami => {
                    assert_eq!(limits["nvidia.com/gpucores"], "30");
                    assert_eq!(limits["nvidia.com/gpumem"], "4096");
                    assert_eq!(limits["nvidia.com/priority"], "1");
                }
            }
            assert_eq!(
                translate(&out, b, &settings(b)).unwrap(),
                Vec::<Value>::new(),
                "{b}: second pass must be empty"
            );
        }
    }

    #[test]
    fn denials_name_container_field_and_allowed() {
        let cases = [
            (
                json!({QOS_LEVEL_ANNOTATION: "shared_cores"}),
                json!({"limits": {RECLAIMED_MGPU_CORE: "30"}}),
                "reclaimed_cores",
            ),
            (
                json!({}),
                json!({"limits": {RECLAIMED_MGPU_CORE: "30", MGPU_CORE: "20"}}),
                "both",
            ),
            (
                json!({}),
                json!({"limits": {RECLAIMED_MGPU_CORE: "130"}}),
                "allowed",
            ),
            (json!({}), json!({"limits": {MGPU_CORE: "0.5"}}), "allowed"),
            (
                json!({}),
                json!({"limits": {MGPU_MEMORY: "1024"}}),
                "without cores",
            ),
            (
                json!({COMPUTE_POLICY_ANNOTATION: "native-burst-share"}),
                json!({"limits": {RECLAIMED_MGPU_CORE: "30"}}),
                "native-burst-share",
            ),
            (
                json!({COMPUTE_POLICY_ANNOTATION: "weird"}),
                json!({"limits": {MGPU_CORE: "30"}}),
                "allowed",
            ),
            (
                json!({}),
                json!({"limits": {MGPU_CORE: "30"}, "requests": {MGPU_CORE: "40"}}),
                "differs",
            ),
        ];
        for (ann, res, needle) in cases {
            let d = translate(
                &pod(ann, res.clone()),
                Backend::Hami,
                &settings(Backend::Hami),
            )
            .unwrap_err();
            assert!(d.message.contains(needle), "{res}: {}", d.message);
            if needle != "native-burst-share" && needle != "reclaimed_cores" {
                assert!(
                    d.message.contains("main") || d.message.contains("compute-policy"),
                    "{}",
                    d.message
                );
            }
        }
    }

    #[test]
    fn plain_pods_are_untouched() {
        let p = pod(json!(null), json!({"limits": {"cpu": "1"}}));
        assert!(translate(&p, Backend::Hami, &settings(Backend::Hami))
            .unwrap()
            .is_empty());
    }

    #[test]
    fn escaping() {
        assert_eq!(
            esc("katalyst.kubewharf.io/qos_level"),
            "katalyst.kubewharf.io~1qos_level"
        );
        assert_eq!(esc("a~b"), "a~0b");
    }
}
