//! Pure translation of a Pod's mGPU requests for a GPU backend. No I/O.
//!
//! Input: the Pod as JSON (as the API server sends it). Output: RFC 6902 operations, or a
//! denial whose message names the container, the field, the offending value and the
//! allowed values.
//!
//! Rules at CREATE ([`translate`], DESIGN.md):
//! - `mgpu-core` (online) and `reclaimed-mgpu-core` (offline): 1–100 or a multiple of 100;
//!   `mgpu-memory` in MiB, only together with cores;
//! - one container may not ask for both; one pod may not mix online and offline containers;
//! - `qos_level` is set when missing (`reclaimed_cores` for offline, `shared_cores` for
//!   online) and must not contradict the request: offline requests need
//!   `reclaimed_cores`; online requests need `shared_cores` or `dedicated_cores`; an
//!   unknown value is denied;
//! - the compute policy defaults to `guaranteed-burst-share`; offline pods may not use
//!   `native-burst-share`;
//! - the pod gets [`REQUESTED_ANNOTATION`], the record of what it asked for (below); a pod
//!   that carries the record but no `vke.volcengine.com/*` requests (translated already:
//!   the webhook invoked again, or `/validate` after `/mutate`) is held to the record;
//! - a second pass over the mutated pod yields no operation (idempotent).
//!
//! Rules at UPDATE ([`review_update`]): the API server forbids changing a pod's resources,
//! env or priority class after creation, so an UPDATE is checked against what the pod
//! asked for at CREATE, and its patch only ever touches `/metadata/annotations`:
//! - [`REQUESTED_ANNOTATION`] (and the older per-container [`REQUESTS_ANNOTATION`]) may not
//!   be added, changed or removed;
//! - the new `qos_level` and compute policy must agree with the recorded requests, by the
//!   CREATE rules above. This matters for the `hami` and `nvidia-shared` backends, which
//!   remove the `vke.volcengine.com/*` requests from the pod at CREATE: without the record
//!   an offline pod could later declare itself `shared_cores` and never be suspended.
//!   Where the record is missing (a pod admitted by an older webhook), the per-container
//!   record or the `vke.volcengine.com/*` requests still in the spec are used;
//! - an UPDATE that leaves `qos_level` and the compute policy as they were is never denied
//!   for them (a pod admitted before the webhook was installed stays updatable, e.g. so
//!   that its finalizers can be removed).
//!
//! ## The record: `gpu-coloc.dev/requested`
//!
//! `offline-cores=<n>;online-cores=<n>;memory-mib=<n>`: exactly these three fields, in this
//! order, separated by `;`, each a non-negative decimal integer without sign or leading
//! zeros. Each is the sum over the pod's containers and init containers of the value asked
//! for: `vke.volcengine.com/reclaimed-mgpu-core`, `vke.volcengine.com/mgpu-core` (percent of
//! one GPU) and `vke.volcengine.com/mgpu-memory` (MiB). Since a pod is either online or
//! offline, one of the two core fields is 0. Example:
//! `gpu-coloc.dev/requested: "offline-cores=40;online-cores=0;memory-mib=2048"`. It is
//! written for every backend, and only for pods that ask for mGPU cores.

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
/// Annotation recording the original mGPU requests per container (JSON; `nvidia-shared`
/// and `hami` only). Kept for users and pods admitted by older versions; the guarded
/// record is [`REQUESTED_ANNOTATION`].
pub const REQUESTS_ANNOTATION: &str = "gpu-coloc.dev/requests";
/// Annotation recording, at CREATE, what the pod asked for ([`Requested`]); guarded on
/// UPDATE.
pub const REQUESTED_ANNOTATION: &str = "gpu-coloc.dev/requested";
/// Namespace label that picks the backend for the namespace's pods (the chart routes each
/// value to `/mutate?backend=<value>`, any other value to `/unsupported-backend`).
pub const BACKEND_LABEL: &str = "gpu-coloc.dev/backend";
/// The values [`BACKEND_LABEL`] may take.
pub const BACKEND_NAMES: [&str; 3] = ["vke", "nvidia-shared", "hami"];
/// The requests the webhook reviews, for messages.
pub const MGPU_RESOURCE_PREFIX: &str = "vke.volcengine.com/*";
/// The service's `coloc_webhook_denials_total` reasons (bounded; present at 0 from start).
pub const DENIAL_REASONS: &[&str] = &[
    "malformed",
    "mismatch",
    "out_of_range",
    "unknown_policy",
    "both_online_and_offline",
    "memory_without_cores",
    "mixed_pod",
    "qos_contradiction",
    "qos_unknown",
    "native_burst_offline",
    "record_inconsistent",
    "record_malformed",
    "record_changed",
    "backend_unsupported",
    "mount_forbidden",
    "internal",
];
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
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// Backend for namespaces that do not choose one.
    pub backend: Backend,
    /// Priority class given to offline pods that have none (none when unset).
    #[serde(default)]
    pub offline_priority_class: Option<String>,
    /// The value of that PriorityClass, written to `spec.priority` with the name (see
    /// [`translate`]); required with `offline_priority_class`.
    #[serde(default)]
    pub offline_priority: Option<i32>,
    /// The `preemptionPolicy` of that PriorityClass (`Never` or `PreemptLowerPriority`),
    /// written to `spec.preemptionPolicy` with the name; `Never` when unset.
    #[serde(default)]
    pub offline_preemption_policy: Option<String>,
    /// Where the CUDA shim is on the nodes, for `/inject` ([`crate::inject`]); without it
    /// `/inject` changes nothing.
    #[serde(default)]
    pub shim: Option<crate::inject::ShimSettings>,
    /// More host directories no pod may mount writable, besides the `[shim]` ones
    /// ([`crate::mounts`]; the chart: the agent's state directory).
    #[serde(default)]
    pub protected_host_paths: Vec<String>,
    /// Which priority classes make a pod offline (`[classes]`; the agent's
    /// `--offline-priority-class` and `--offline-priority-below` must say the same).
    #[serde(default)]
    pub classes: ClassSettings,
}

/// `[classes]` in the settings file: the PriorityClass mapping of `qos_core::classify_pod_with`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassSettings {
    /// Priority classes whose pods are offline, besides Koordinator's `koord-batch` and
    /// `koord-free`.
    #[serde(default)]
    pub offline_priority_classes: Vec<String>,
    /// Pods whose `spec.priority` is below this value are offline.
    #[serde(default)]
    pub offline_priority_below: Option<i32>,
}

impl ClassSettings {
    /// The mapping the classifier takes.
    pub fn mapping(&self) -> qos_core::PriorityMapping {
        qos_core::PriorityMapping {
            offline_classes: self.offline_priority_classes.clone(),
            offline_below: self.offline_priority_below,
        }
    }
}

impl Settings {
    /// `backend`, no priority class.
    pub fn new(backend: Backend) -> Settings {
        Settings {
            backend,
            offline_priority_class: None,
            offline_priority: None,
            offline_preemption_policy: None,
            shim: None,
            protected_host_paths: Vec::new(),
            classes: ClassSettings::default(),
        }
    }

    /// `backend`, offline pods get PriorityClass `name` of `value`, `preemptionPolicy: Never`.
    pub fn with_priority_class(backend: Backend, name: &str, value: i32) -> Settings {
        Settings {
            offline_priority_class: Some(name.into()),
            offline_priority: Some(value),
            ..Settings::new(backend)
        }
    }

    /// Settings that cannot work are refused at start, not at the first pod.
    pub fn check(&self) -> Result<(), String> {
        if self.offline_priority_class.is_some() && self.offline_priority.is_none() {
            return Err("offline_priority_class needs offline_priority, the value of that PriorityClass: the API server refuses a pod whose spec.priority is not its class's value".into());
        }
        if let Some(shim) = &self.shim {
            shim.check()?;
        }
        if let Some(p) = self
            .protected_host_paths
            .iter()
            .find(|p| !p.starts_with('/') || crate::mounts::normalise(p) == "/")
        {
            return Err(format!(
                "protected_host_paths: {p:?} is not an absolute directory below /"
            ));
        }
        match self.offline_preemption_policy.as_deref() {
            None | Some("Never" | "PreemptLowerPriority") => Ok(()),
            Some(p) => Err(format!(
                "offline_preemption_policy {p:?} is not a preemption policy; allowed: Never, PreemptLowerPriority"
            )),
        }
    }
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

/// What a pod asked for at creation: the value of [`REQUESTED_ANNOTATION`]. See the module
/// documentation for the format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Requested {
    /// Sum of `reclaimed-mgpu-core` (percent of one GPU).
    pub offline_cores: u64,
    /// Sum of `mgpu-core` (percent of one GPU).
    pub online_cores: u64,
    /// Sum of `mgpu-memory` (MiB).
    pub memory_mib: u64,
}

/// Whether a pod's mGPU requests are online or offline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodClass {
    /// `mgpu-core`: needs `qos_level` `shared_cores` or `dedicated_cores`.
    Online,
    /// `reclaimed-mgpu-core`: needs `qos_level` `reclaimed_cores`.
    Offline,
}

impl Requested {
    /// Online or offline; `None` when the record asks for no cores, or (never written by
    /// the webhook) for both.
    pub fn class(&self) -> Option<PodClass> {
        match (self.offline_cores > 0, self.online_cores > 0) {
            (true, false) => Some(PodClass::Offline),
            (false, true) => Some(PodClass::Online),
            _ => None,
        }
    }
}

impl fmt::Display for Requested {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "offline-cores={};online-cores={};memory-mib={}",
            self.offline_cores, self.online_cores, self.memory_mib
        )
    }
}

impl FromStr for Requested {
    type Err = String;
    /// Strict: the exact form [`fmt::Display`] writes.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || format!("{s:?} is not offline-cores=<n>;online-cores=<n>;memory-mib=<n>");
        let mut fields = s.split(';');
        let mut next = |key: &str| -> Result<u64, String> {
            let field = fields.next().ok_or_else(bad)?;
            let v = field
                .strip_prefix(key)
                .and_then(|r| r.strip_prefix('='))
                .ok_or_else(bad)?;
            let n: u64 = if v.bytes().all(|b| b.is_ascii_digit()) {
                v.parse().map_err(|_| bad())?
            } else {
                return Err(bad());
            };
            if n.to_string() != v {
                return Err(bad());
            }
            Ok(n)
        };
        let r = Requested {
            offline_cores: next("offline-cores")?,
            online_cores: next("online-cores")?,
            memory_mib: next("memory-mib")?,
        };
        if fields.next().is_some() {
            return Err(bad());
        }
        Ok(r)
    }
}

#[derive(Debug, Clone)]
struct ContainerReq {
    name: String,
    path: String,
    online: Option<CorePercent>,
    offline: Option<CorePercent>,
    memory: Option<u64>,
}

impl ContainerReq {
    /// `vke.volcengine.com/…-core=N` for `class`, as asked.
    fn cores(&self, class: PodClass) -> String {
        match class {
            PodClass::Online => format!("{MGPU_CORE}={}", self.online.map_or(0, |c| c.0)),
            PodClass::Offline => {
                format!("{RECLAIMED_MGPU_CORE}={}", self.offline.map_or(0, |c| c.0))
            }
        }
    }
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
    if let (Some(on), Some(off)) = (online, offline) {
        return Err(deny(
            "both_online_and_offline",
            format!("container {name:?} asks for both {MGPU_CORE}={} (online) and {RECLAIMED_MGPU_CORE}={} (offline); allowed: one of them", on.0, off.0),
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

/// The class a container's own mGPU requests make it (`None`: it asks for none); the
/// denial when they cannot be read or contradict each other.
pub fn container_class(c: &Value) -> Result<Option<PodClass>, Denial> {
    let name = c["name"].as_str().unwrap_or("?");
    Ok(
        read_container(name, String::new(), c)?.and_then(|r| match (r.online, r.offline) {
            (Some(_), None) => Some(PodClass::Online),
            (None, Some(_)) => Some(PodClass::Offline),
            _ => None,
        }),
    )
}

/// The containers (init containers first) that ask for mGPU resources.
fn read_requests(pod: &Value) -> Result<Vec<ContainerReq>, Denial> {
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
    Ok(reqs)
}

/// The pod's class; denies a pod that mixes online and offline containers. `reqs` is not
/// empty.
fn pod_class(reqs: &[ContainerReq]) -> Result<PodClass, Denial> {
    let on: Vec<&ContainerReq> = reqs.iter().filter(|r| r.online.is_some()).collect();
    let off: Vec<&ContainerReq> = reqs.iter().filter(|r| r.offline.is_some()).collect();
    if !on.is_empty() && !off.is_empty() {
        let list = |v: &[&ContainerReq], class| {
            v.iter()
                .map(|r| format!("container {:?} asks for {}", r.name, r.cores(class)))
                .collect::<Vec<_>>()
                .join(", ")
        };
        return Err(deny(
            "mixed_pod",
            format!(
                "pod mixes online and offline containers: {} (online); {} (offline); a pod is either online ({MGPU_CORE}) or offline ({RECLAIMED_MGPU_CORE})",
                list(&on, PodClass::Online),
                list(&off, PodClass::Offline)
            ),
        ));
    }
    Ok(if off.is_empty() {
        PodClass::Online
    } else {
        PodClass::Offline
    })
}

/// Names the containers whose requests make the pod `class`, for messages.
fn describe(reqs: &[ContainerReq], class: PodClass) -> String {
    let mut it = reqs.iter().filter(|r| match class {
        PodClass::Online => r.online.is_some(),
        PodClass::Offline => r.offline.is_some(),
    });
    let first = it.next().map_or_else(
        || "the pod asks for mGPU cores".to_string(),
        |r| format!("container {:?} asks for {}", r.name, r.cores(class)),
    );
    match it.count() {
        0 => first,
        n => format!(
            "{first} (and {n} more container{})",
            if n == 1 { "" } else { "s" }
        ),
    }
}

fn annotations_of(pod: &Value) -> Option<&Map<String, Value>> {
    pod["metadata"]["annotations"].as_object()
}

/// Adds or replaces one annotation unless it already has `value`.
fn set_annotation(ops: &mut Vec<Value>, annotations: &Map<String, Value>, key: &str, value: &str) {
    if annotations.get(key).and_then(Value::as_str) == Some(value) {
        return;
    }
    let op = if annotations.contains_key(key) {
        "replace"
    } else {
        "add"
    };
    ops.push(
        json!({"op": op, "path": format!("/metadata/annotations/{}", esc(key)), "value": value}),
    );
}

/// The pod-level annotation rules (`qos_level`, compute policy) for a pod of `class`;
/// `what` says which request makes it that class (for messages). Missing annotations
/// are added to `ops`; `ops` may only ever touch `/metadata/annotations` here.
fn check_annotations(
    class: PodClass,
    what: &str,
    annotations: &Map<String, Value>,
    ops: &mut Vec<Value>,
) -> Result<(), Denial> {
    let level = QosLevel::parse(
        annotations
            .get(QOS_LEVEL_ANNOTATION)
            .and_then(Value::as_str),
    );
    let shown = level.as_annotation().unwrap_or("");
    match (&level, class) {
        (QosLevel::Missing, PodClass::Offline) => {
            set_annotation(ops, annotations, QOS_LEVEL_ANNOTATION, "reclaimed_cores")
        }
        (QosLevel::Missing, PodClass::Online) => {
            set_annotation(ops, annotations, QOS_LEVEL_ANNOTATION, "shared_cores")
        }
        (QosLevel::ReclaimedCores, PodClass::Offline)
        | (QosLevel::SharedCores | QosLevel::DedicatedCores, PodClass::Online) => {}
        (
            QosLevel::SharedCores | QosLevel::DedicatedCores | QosLevel::SystemCores,
            PodClass::Offline,
        ) => {
            return Err(deny(
                "qos_contradiction",
                format!(
                    "{what} (offline), but the pod is {QOS_LEVEL_ANNOTATION}={shown}; allowed for offline requests: reclaimed_cores (or ask for {MGPU_CORE} instead)"
                ),
            ))
        }
        (QosLevel::ReclaimedCores | QosLevel::SystemCores, PodClass::Online) => {
            return Err(deny(
                "qos_contradiction",
                format!(
                    "{what} (online), but the pod is {QOS_LEVEL_ANNOTATION}={shown}; allowed for online requests: shared_cores or dedicated_cores (or ask for {RECLAIMED_MGPU_CORE} instead)"
                ),
            ))
        }
        (QosLevel::Unknown(v), _) => {
            return Err(deny(
                "qos_unknown",
                format!("{QOS_LEVEL_ANNOTATION}={v:?} is not a QoS level ({what}); allowed: shared_cores, dedicated_cores, reclaimed_cores, system_cores"),
            ))
        }
    }

    let policy_raw = annotations
        .get(COMPUTE_POLICY_ANNOTATION)
        .and_then(Value::as_str);
    let policy = ComputePolicy::from_annotation(policy_raw)
        .map_err(|e| deny(e.metric_label(), format!("{e} ({what})")))?;
    if class == PodClass::Offline && !policy.allowed_for_offline() {
        return Err(deny(
            "native_burst_offline",
            format!("{what} (offline), but {COMPUTE_POLICY_ANNOTATION}=native-burst-share is not supported for offline (reclaimed) pods; allowed: fixed-share, guaranteed-burst-share"),
        ));
    }
    if policy_raw.is_none() {
        set_annotation(ops, annotations, COMPUTE_POLICY_ANNOTATION, policy.as_str());
    }
    Ok(())
}

/// Starts a patch: creates `/metadata/annotations` (and `/metadata`) when missing.
fn start_ops(pod: &Value) -> Vec<Value> {
    if annotations_of(pod).is_some() {
        Vec::new()
    } else if pod["metadata"].is_object() {
        vec![json!({"op": "add", "path": "/metadata/annotations", "value": {}})]
    } else {
        vec![json!({"op": "add", "path": "/metadata", "value": {"annotations": {}}})]
    }
}

/// Drops a patch that would only create an empty annotations block.
fn finish_ops(mut ops: Vec<Value>) -> Vec<Value> {
    let path = ops.first().map(|op| &op["path"]);
    if ops.len() == 1
        && (path == Some(&json!("/metadata/annotations")) || path == Some(&json!("/metadata")))
    {
        ops.clear();
    }
    ops
}

/// Translates `pod` (CREATE) for `backend`. `Ok(vec![])` means: allowed, nothing to change.
pub fn translate(pod: &Value, backend: Backend, s: &Settings) -> Result<Vec<Value>, Denial> {
    let reqs = read_requests(pod)?;
    if reqs.is_empty() {
        return translate_recorded(pod);
    }
    let class = pod_class(&reqs)?;
    let empty = Map::new();
    let annotations = annotations_of(pod).unwrap_or(&empty);
    // A record that disagrees with the requests did not come from this webhook (one that
    // merely differs, or cannot be read, is rewritten below).
    if let Some((recorded, text)) = annotations
        .get(REQUESTED_ANNOTATION)
        .and_then(Value::as_str)
        .and_then(|t| recorded(t).ok().map(|(c, _)| (c, t)))
    {
        if recorded != class {
            return Err(deny(
                "record_inconsistent",
                format!("{REQUESTED_ANNOTATION}={text} disagrees with the pod's requests ({}); it is written by the gpu-coloc webhook (remove it)", describe(&reqs, class)),
            ));
        }
    }
    // What the pod cannot change after admission decides first (qos_core::classify_pod,
    // shared with the agent): an online request from a pod whose other immutable fields
    // say offline (HAMi's low priority, Koordinator's batch class or resources, Katalyst's
    // reclaimed resources) is a contradiction. The agent would hold it as offline; the
    // `hami` translation would even overwrite its low priority with a high one.
    if class == PodClass::Online {
        if let Some(evidence) =
            qos_core::pod::immutable_offline_with(&pod_facts(pod), &s.classes.mapping())
        {
            return Err(deny(
                "qos_contradiction",
                format!(
                    "{} (online), but its {evidence} makes it offline; allowed: ask for {RECLAIMED_MGPU_CORE} instead, or drop the {evidence}",
                    describe(&reqs, class)
                ),
            ));
        }
    }
    let mut ops = start_ops(pod);
    check_annotations(class, &describe(&reqs, class), annotations, &mut ops)?;
    let offline = class == PodClass::Offline;

    // Priority class for offline pods that have none. The API server's Priority admission
    // plugin has already run (it runs before the webhooks): it set `spec.priority` (and
    // `preemptionPolicy`) from the pod's class, or from no class (0). When a webhook
    // changes the pod, the API server runs the in-tree plugins again, and Priority then
    // refuses a pod whose `spec.priority` differs from its class's value. So the class
    // comes with its value and preemption policy, replacing what no class gave.
    let no_class = pod["spec"]["priorityClassName"]
        .as_str()
        .is_none_or(str::is_empty);
    if offline && no_class {
        if let (Some(pc), Some(value)) = (&s.offline_priority_class, s.offline_priority) {
            let policy = s.offline_preemption_policy.as_deref().unwrap_or("Never");
            ops.push(json!({"op": "add", "path": "/spec/priorityClassName", "value": pc}));
            ops.push(json!({"op": "add", "path": "/spec/priority", "value": value}));
            ops.push(json!({"op": "add", "path": "/spec/preemptionPolicy", "value": policy}));
        }
    }

    // The record checked on UPDATE, for every backend.
    let record = reqs.iter().fold(Requested::default(), |acc, r| Requested {
        offline_cores: acc
            .offline_cores
            .saturating_add(r.offline.map_or(0, |c| u64::from(c.0))),
        online_cores: acc
            .online_cores
            .saturating_add(r.online.map_or(0, |c| u64::from(c.0))),
        memory_mib: acc.memory_mib.saturating_add(r.memory.unwrap_or(0)),
    });
    set_annotation(
        &mut ops,
        annotations,
        REQUESTED_ANNOTATION,
        &record.to_string(),
    );

    if backend != Backend::Vke {
        let per_container: Map<String, Value> = reqs
            .iter()
            .map(|r| {
                let core = r.online.or(r.offline).map(|c| c.0);
                (r.name.clone(), json!({"class": if r.offline.is_some() {"offline"} else {"online"}, "core": core, "memory_mib": r.memory}))
            })
            .collect();
        set_annotation(
            &mut ops,
            annotations,
            REQUESTS_ANNOTATION,
            &Value::Object(per_container).to_string(),
        );
        for r in &reqs {
            translate_container(&mut ops, pod, r, backend);
        }
    }
    set_annotation(&mut ops, annotations, BACKEND_ANNOTATION, backend.as_str());
    Ok(finish_ops(ops))
}

/// What `pod` says about its class, for `qos_core::classify_pod`: its `qos_level` and
/// `gpu-coloc.dev/class` annotations, Koordinator's label, its priority class and
/// priority, and every resource its containers and init containers ask for.
pub fn pod_facts(pod: &Value) -> qos_core::PodFacts<'_> {
    let mut resources = Vec::new();
    for list in ["initContainers", "containers"] {
        for c in pod["spec"][list].as_array().into_iter().flatten() {
            for part in ["requests", "limits"] {
                if let Some(m) = c["resources"][part].as_object() {
                    resources.extend(
                        m.iter()
                            .filter_map(|(k, v)| Some((k.as_str(), v.as_str()?))),
                    );
                }
            }
        }
    }
    qos_core::PodFacts {
        qos_level: pod["metadata"]["annotations"][QOS_LEVEL_ANNOTATION].as_str(),
        koordinator_qos: pod["metadata"]["labels"][qos_core::pod::KOORDINATOR_QOS_LABEL].as_str(),
        coloc_class: pod["metadata"]["annotations"][qos_core::pod::COLOC_CLASS_ANNOTATION].as_str(),
        priority_class: pod["spec"]["priorityClassName"].as_str(),
        priority: pod["spec"]["priority"]
            .as_i64()
            .and_then(|p| i32::try_from(p).ok()),
        resources,
    }
}

/// Does `pod` ask for mGPU (any `vke.volcengine.com/*` request, readable or not, or the
/// record of one)? Pods that do not are never changed or denied by the webhook.
pub fn asks_for_mgpu(pod: &Value) -> bool {
    let recorded = annotations_of(pod).is_some_and(|a| {
        a.contains_key(REQUESTED_ANNOTATION) || a.contains_key(REQUESTS_ANNOTATION)
    });
    recorded || read_requests(pod).map_or(true, |r| !r.is_empty())
}

/// The class [`REQUESTED_ANNOTATION`] records, and a phrase for messages.
fn recorded(text: &str) -> Result<(PodClass, String), String> {
    let class = text
        .parse::<Requested>()?
        .class()
        .ok_or_else(|| format!("{text:?} records no cores, or both online and offline"))?;
    let asked = match class {
        PodClass::Offline => RECLAIMED_MGPU_CORE,
        PodClass::Online => MGPU_CORE,
    };
    Ok((
        class,
        format!("the pod asked for {asked} at creation ({REQUESTED_ANNOTATION}: {text})"),
    ))
}

/// CREATE of a pod without `vke.volcengine.com/*` requests. One that carries the record
/// was translated already (the webhook is invoked again after another webhook's
/// mutation, or this is `/validate` after `/mutate`): it is held to the record.
fn translate_recorded(pod: &Value) -> Result<Vec<Value>, Denial> {
    let empty = Map::new();
    let annotations = annotations_of(pod).unwrap_or(&empty);
    let Some(v) = annotations.get(REQUESTED_ANNOTATION) else {
        return Ok(vec![]);
    };
    let (class, what) = v.as_str().ok_or_else(|| v.to_string()).and_then(recorded).map_err(|e| {
        deny(
            "record_malformed",
            format!("{REQUESTED_ANNOTATION}: {e}; it is written by the gpu-coloc webhook (remove it)"),
        )
    })?;
    let mut ops = start_ops(pod);
    check_annotations(class, &what, annotations, &mut ops)?;
    Ok(finish_ops(ops))
}

/// The class an older webhook recorded in [`REQUESTS_ANNOTATION`] (per container).
fn legacy_class(text: &str) -> Option<PodClass> {
    let v: Value = serde_json::from_str(text).ok()?;
    let classes: Vec<&str> = v
        .as_object()?
        .values()
        .filter_map(|c| c["class"].as_str())
        .collect();
    match (classes.contains(&"offline"), classes.contains(&"online")) {
        (true, false) => Some(PodClass::Offline),
        (false, true) => Some(PodClass::Online),
        _ => None,
    }
}

/// Reviews an UPDATE of a pod: `old` is the pod as stored, `new` as updated (the module
/// documentation has the rules). The patch only touches `/metadata/annotations`.
pub fn review_update(old: &Value, new: &Value) -> Result<Vec<Value>, Denial> {
    let empty = Map::new();
    let old_ann = annotations_of(old).unwrap_or(&empty);
    let new_ann = annotations_of(new).unwrap_or(&empty);
    for key in [REQUESTED_ANNOTATION, REQUESTS_ANNOTATION] {
        let (o, n) = (old_ann.get(key), new_ann.get(key));
        let message = match (o, n) {
            _ if o == n => continue,
            (Some(o), None) => format!("{key} records what the pod asked for at creation and cannot be removed (it is {o})"),
            (None, Some(n)) => format!("{key} is written by the gpu-coloc webhook at creation and cannot be added later (got {n})"),
            (Some(o), Some(n)) => format!("{key} records what the pod asked for at creation and cannot be changed (from {o} to {n})"),
            (None, None) => continue,
        };
        return Err(deny("record_changed", message));
    }

    // What the pod asked for, from every source there is.
    let mut sources: Vec<(PodClass, String)> = Vec::new();
    if let Some(text) = old_ann.get(REQUESTED_ANNOTATION).and_then(Value::as_str) {
        if let Ok(source) = recorded(text) {
            sources.push(source);
        }
    }
    if let Some(text) = old_ann.get(REQUESTS_ANNOTATION).and_then(Value::as_str) {
        if let Some(class) = legacy_class(text) {
            sources.push((
                class,
                format!("the pod asked for mGPU cores at creation ({REQUESTS_ANNOTATION}: {text})"),
            ));
        }
    }
    let reqs = read_requests(new)?;
    if !reqs.is_empty() {
        let class = pod_class(&reqs)?;
        sources.push((class, describe(&reqs, class)));
    }
    let Some((class, what)) = sources.first().cloned() else {
        return Ok(vec![]);
    };
    if let Some((_, other)) = sources.iter().find(|(c, _)| *c != class) {
        return Err(deny(
            "record_inconsistent",
            format!("the pod's requests disagree: {what}; {other}"),
        ));
    }
    let mut ops = start_ops(new);
    match check_annotations(class, &what, new_ann, &mut ops) {
        Ok(()) => Ok(finish_ops(ops)),
        // A state the pod already had is not this UPDATE's doing.
        Err(_)
            if [QOS_LEVEL_ANNOTATION, COMPUTE_POLICY_ANNOTATION]
                .iter()
                .all(|k| old_ann.get(*k) == new_ann.get(*k)) =>
        {
            Ok(vec![])
        }
        Err(d) => Err(d),
    }
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
        Settings::with_priority_class(b, "gpu-coloc-offline", -10)
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

    /// An online request from a pod whose immutable fields say offline (the rule shared
    /// with the agent, `qos_core::classify_pod`) is denied on every backend: the agent
    /// would hold it as offline, and `hami` would overwrite its low priority with 0.
    #[test]
    fn online_request_with_immutable_offline_fields_is_denied() {
        let mut koord = pod(json!({}), json!({"limits": {MGPU_CORE: "20"}}));
        koord["spec"]["priorityClassName"] = json!("koord-batch");
        let cases = [
            (
                pod(
                    json!({}),
                    json!({"limits": {MGPU_CORE: "20", "nvidia.com/priority": "1"}}),
                ),
                "resource nvidia.com/priority",
            ),
            (
                pod(
                    json!({}),
                    json!({"limits": {MGPU_CORE: "20", "kubernetes.io/batch-cpu": "1000"}}),
                ),
                "resource kubernetes.io/batch-cpu",
            ),
            (koord, "priorityClassName koord-batch"),
        ];
        for (p, needle) in &cases {
            for b in [Backend::Vke, Backend::NvidiaShared, Backend::Hami] {
                let d = translate(p, b, &settings(b)).unwrap_err();
                assert_eq!(d.reason, "qos_contradiction");
                assert!(
                    d.message.contains(needle) && d.message.contains("online"),
                    "{b}: {}",
                    d.message
                );
            }
        }
        // HAMi's high priority and an online Koordinator class are fine.
        let ok = pod(
            json!({}),
            json!({"limits": {MGPU_CORE: "20", "nvidia.com/priority": "0"}}),
        );
        assert!(translate(&ok, Backend::Hami, &settings(Backend::Hami)).is_ok());
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
    fn record_format_round_trips_and_is_strict() {
        let r = Requested {
            offline_cores: 40,
            online_cores: 0,
            memory_mib: 2048,
        };
        let text = "offline-cores=40;online-cores=0;memory-mib=2048";
        assert_eq!(r.to_string(), text);
        assert_eq!(text.parse::<Requested>().unwrap(), r);
        assert_eq!(r.class(), Some(PodClass::Offline));
        for bad in [
            "",
            "offline-cores=40;online-cores=0",
            "offline-cores=40;online-cores=0;memory-mib=2048;",
            "online-cores=0;offline-cores=40;memory-mib=2048",
            "offline-cores=040;online-cores=0;memory-mib=2048",
            "offline-cores=+40;online-cores=0;memory-mib=2048",
            "offline-cores=-1;online-cores=0;memory-mib=2048",
            "offline-cores= 40;online-cores=0;memory-mib=2048",
            "offline-cores=99999999999999999999;online-cores=0;memory-mib=0",
        ] {
            assert!(bad.parse::<Requested>().is_err(), "{bad:?}");
        }
        assert_eq!(
            "offline-cores=0;online-cores=0;memory-mib=0"
                .parse::<Requested>()
                .unwrap()
                .class(),
            None
        );
    }

    #[test]
    fn update_patches_metadata_only() {
        // An offline vke pod admitted before the webhook: no annotations at all.
        let old = pod(json!(null), json!({"limits": {RECLAIMED_MGPU_CORE: "30"}}));
        let mut new = old.clone();
        new["metadata"]["labels"] = json!({"a": "b"});
        let ops = review_update(&old, &new).unwrap();
        assert!(!ops.is_empty());
        for op in &ops {
            assert!(
                op["path"]
                    .as_str()
                    .unwrap()
                    .starts_with("/metadata/annotations"),
                "{op}"
            );
        }
        let out = apply(&new, &ops);
        assert_eq!(
            out["metadata"]["annotations"][QOS_LEVEL_ANNOTATION],
            "reclaimed_cores"
        );
        assert!(review_update(&old, &out).unwrap().is_empty());
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
