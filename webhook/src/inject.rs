//! Pure injection of the CUDA shim (`libcoloc_cuda.so`) into GPU pods, at CREATE. No I/O.
//!
//! Served on `/inject` (its own entry in the chart's MutatingWebhookConfiguration, first in
//! the list, CREATE only, so a namespace can opt out by label alone). For a pod that
//! `qos_core::classify_pod_with` calls online or offline (every vocabulary, with the
//! `[classes]` PriorityClass mapping), each container that asks for a GPU
//! ([`is_gpu_resource`]: `nvidia.com/gpu`, HAMi's, mGPU's; or a DRA resource claim in
//! a pod annotated `gpu-coloc.dev/shim: enabled`) gets:
//!
//! | what | online | offline |
//! |---|---|---|
//! | `LD_PRELOAD` += the shim (appended with `:` to a value set in `env`, never replaced) | yes | yes |
//! | `COLOC_SHIM_CLASS` | `online` | `offline` |
//! | `COLOC_POD_UID` (downward API `metadata.uid`) | yes | yes |
//! | `COLOC_DOORBELL_DIR`, and there the host's `<doorbell dir>/pods/<pod UID>` (`subPathExpr: $(COLOC_POD_UID)`), read-write | yes | yes |
//! | the shim's host directory, read-only, at the same path | yes | yes |
//! | the gate directory, read-only, and `COLOC_GATE_FILE` | | yes |
//! | `COLOC_SHIM_INFLIGHT`, `COLOC_SHIM_INFLIGHT_MS` (each when configured; a value the container sets is kept) | | yes |
//!
//! and the pod gets the three `hostPath` volumes (`DirectoryOrCreate`: a node without the
//! agent never keeps the pod from starting) and the annotation [`INJECTED_ANNOTATION`]
//! listing the containers, plus [`SKIPPED_ANNOTATION`] and an admission warning for each
//! container left out, with why:
//!
//! - its `LD_PRELOAD` comes from `valueFrom` (the webhook cannot append to a value it
//!   cannot see);
//! - it has no `LD_PRELOAD` in `env` but an `envFrom` source that could set one (no
//!   prefix, or a prefix `LD_PRELOAD` starts with): an `env` entry would replace it.
//!   Setting `LD_PRELOAD` in `env` (even to `""`) lifts this;
//! - one of the mount paths is taken by another volume.
//!
//! Opt-out: the pod annotation `gpu-coloc.dev/shim: disabled`, or the namespace label
//! `gpu-coloc.dev/shim=disabled` (the chart's namespace selector for `/inject`).
//! Mounts of these volumes that the pod brought itself go (removed, with a warning), in
//! every container, unless they are exactly the injected ones ([`crate::mounts`], which
//! `/validate-mounts` enforces on every pod): a tenant's read-write mount of the shim or
//! the gate, or of the whole doorbell directory, never survives the injection.
//! Idempotent: a container that already mounts [`SHIM_VOLUME`] as injected is done, so a second
//! review (reinvocation, or after the translation webhook changed the pod) adds nothing.
//! The pod's containers are found by their GPU requests or, once translated for another
//! backend, by the per-container record `gpu-coloc.dev/requests`.

use crate::translate::{self, esc, PodClass};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

/// Pod annotation that opts a pod out (value `disabled`); also the namespace label.
pub const OPT_OUT: &str = "gpu-coloc.dev/shim";
/// Pod annotation: the containers the shim was injected into, comma-separated.
pub const INJECTED_ANNOTATION: &str = "gpu-coloc.dev/shim-injected";
/// Pod annotation: the containers left out, each with why (`name: reason; …`).
pub const SKIPPED_ANNOTATION: &str = "gpu-coloc.dev/shim-skipped";
/// Volume with the shim's host directory (the marker of a container already injected).
pub const SHIM_VOLUME: &str = "gpu-coloc-shim";
/// Volume with the host's per-pod doorbell directories.
pub const DOORBELL_VOLUME: &str = "gpu-coloc-doorbells";
/// Volume with the node's gate directory (offline pods).
pub const GATE_VOLUME: &str = "gpu-coloc-gate";
/// The file in the gate directory.
pub const GATE_FILE: &str = "gates";

/// Where the shim and its directories are on the nodes (`[shim]` in the settings file).
/// Each host directory is mounted at the same path in the container.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ShimSettings {
    /// The shim on the host; its directory is mounted read-only.
    #[serde(default = "default_library")]
    pub library: String,
    /// The agent's doorbell directory (`coloc-agent run --doorbell-dir`); pods get
    /// `<doorbell_dir>/pods/<pod UID>` there.
    #[serde(default = "default_doorbell_dir")]
    pub doorbell_dir: String,
    /// The node's gate directory (offline pods, read-only; the file [`GATE_FILE`]).
    #[serde(default = "default_gate_dir")]
    pub gate_dir: String,
    /// `COLOC_SHIM_INFLIGHT` for offline containers (submissions in flight per stream);
    /// unset: the shim's default.
    #[serde(default)]
    pub inflight: Option<u32>,
    /// `COLOC_SHIM_INFLIGHT_MS` for offline containers (the in-flight budget, ms of
    /// estimated GPU time per stream; 0: K alone); unset: the shim's default.
    #[serde(default)]
    pub inflight_ms: Option<f64>,
    /// `COLOC_SHIM_WAKE_GAP_MS` for online containers: the shim wakes the agent when a
    /// launch follows a gap this long (the agent's `--release-floor` when it runs
    /// `--release learned`); unset: the shim's default (100 ms, the idle window).
    #[serde(default)]
    pub online_wake_gap_ms: Option<f64>,
    /// How the shim's directories reach the container (the environment is the same
    /// either way).
    #[serde(default)]
    pub delivery: Delivery,
}

/// How the shim's host directories reach a container (`[shim] delivery`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Delivery {
    /// Three `hostPath` volumes in the pod spec (`DirectoryOrCreate`: a node without the
    /// agent still starts the pod). Refused by Pod Security `baseline` and by policies
    /// that forbid `hostPath`.
    #[default]
    HostPath,
    /// One `gpu-coloc.dev/shim-online` or `gpu-coloc.dev/shim-offline` per container, a
    /// device the agent offers (`coloc-agent run --device-plugin`): the kubelet mounts the
    /// same directories (a CDI device, or the plugin's mounts); nothing in the pod spec
    /// names a host path. The pod then runs only on nodes whose agent offers the slots.
    Device,
}

fn default_library() -> String {
    "/var/lib/gpu-coloc/lib/libcoloc_cuda.so".into()
}
fn default_doorbell_dir() -> String {
    "/run/gpu-coloc/doorbells".into()
}
fn default_gate_dir() -> String {
    "/run/gpu-coloc/gate".into()
}

impl Default for ShimSettings {
    fn default() -> Self {
        ShimSettings {
            library: default_library(),
            doorbell_dir: default_doorbell_dir(),
            gate_dir: default_gate_dir(),
            inflight: None,
            inflight_ms: None,
            online_wake_gap_ms: None,
            delivery: Delivery::default(),
        }
    }
}

impl ShimSettings {
    /// Settings that cannot work are refused at start.
    pub fn check(&self) -> Result<(), String> {
        for (key, v) in [
            ("library", &self.library),
            ("doorbell_dir", &self.doorbell_dir),
            ("gate_dir", &self.gate_dir),
        ] {
            let clean = v.len() > 1
                && v.starts_with('/')
                && !v.ends_with('/')
                && !v.split('/').any(|s| s == ".." || s == ".")
                && !v.contains("//")
                && !v.contains(|c: char| {
                    c == ':' || c == '$' || c.is_whitespace() || c.is_control()
                });
            if !clean {
                return Err(format!("[shim] {key} = {v:?}: an absolute path without '..', '//', ':', '$' or spaces, not ending in '/'"));
            }
        }
        if let Some(ms) = self.inflight_ms {
            if !ms.is_finite() || ms < 0.0 {
                return Err(format!(
                    "[shim] inflight_ms = {ms}: a number of milliseconds, 0 or more"
                ));
            }
        }
        if let Some(ms) = self.online_wake_gap_ms {
            if !ms.is_finite() || ms <= 0.0 {
                return Err(format!(
                    "[shim] online_wake_gap_ms = {ms}: a positive number of milliseconds"
                ));
            }
        }
        if self.library_dir() == "/" {
            return Err(
                "[shim] library: not in the root directory (its directory is mounted into pods)"
                    .into(),
            );
        }
        Ok(())
    }

    /// The shim's directory (mounted read-only into pods).
    pub fn library_dir(&self) -> &str {
        match self.library.rfind('/') {
            Some(0) => "/",
            Some(i) => &self.library[..i],
            None => "/",
        }
    }

    fn gate_file(&self) -> String {
        format!("{}/{GATE_FILE}", self.gate_dir)
    }
}

/// The patch and what to tell the user.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Injection {
    /// RFC 6902 operations (empty: nothing to do).
    pub ops: Vec<Value>,
    /// Admission warnings (shown by kubectl).
    pub warnings: Vec<String>,
}

/// A container the shim is meant for.
struct Gpu {
    path: String,
    name: String,
}

/// Resources that give a container an NVIDIA GPU (or a share of one): the device
/// plugin's `nvidia.com/gpu` (and its renamed shared replicas `nvidia.com/gpu.shared`),
/// HAMi's `nvidia.com/gpucores`, `nvidia.com/gpumem`, `nvidia.com/gpumem-percentage`, and
/// mGPU's `vke.volcengine.com/mgpu-core`, `reclaimed-mgpu-core`. Not MIG slices
/// (`nvidia.com/mig-*`): the agent does not manage MIG.
pub fn is_gpu_resource(name: &str) -> bool {
    matches!(
        name,
        "nvidia.com/gpu"
            | "nvidia.com/gpu.shared"
            | "nvidia.com/gpucores"
            | "nvidia.com/gpumem"
            | "nvidia.com/gpumem-percentage"
            | qos_core::resources::MGPU_CORE
            | qos_core::resources::RECLAIMED_MGPU_CORE
    )
}

/// Pod annotation value of [`OPT_OUT`] that opts a pod in where the webhook cannot see
/// a GPU: containers that name a DRA resource claim (`resources.claims`) get the shim.
pub const OPT_IN: &str = "enabled";

/// Container `c` asks for a GPU resource (a quantity other than 0), or names a resource
/// claim in a pod that opted in.
fn asks_for_gpu(c: &Value, claims_opted_in: bool) -> bool {
    let asks = ["requests", "limits"].iter().any(|part| {
        c["resources"][*part].as_object().is_some_and(|m| {
            m.iter().any(|(k, v)| {
                is_gpu_resource(k)
                    && match v {
                        Value::String(q) => !q.trim().is_empty() && q.trim() != "0",
                        Value::Number(n) => n.as_f64().is_some_and(|n| n != 0.0),
                        _ => false,
                    }
            })
        })
    });
    asks || (claims_opted_in
        && c["resources"]["claims"]
            .as_array()
            .is_some_and(|a| !a.is_empty()))
}

/// The containers (init containers first) that ask for a GPU, and the class they get;
/// `None` for a pod with none, one the classifier does not call online or offline, or one
/// the translation webhook denies (unreadable or mixed mGPU requests).
///
/// The class is the pod's (`qos_core::classify_pod_with`: every vocabulary, what the pod
/// cannot change first); a container's own mGPU request must agree with it (the
/// translation webhook denies those that do not).
fn gpu_containers(pod: &Value, map: &qos_core::PriorityMapping) -> Option<(Vec<Gpu>, PodClass)> {
    let pod_class = match qos_core::classify_pod_with(&translate::pod_facts(pod), map).class {
        qos_core::Class::Online | qos_core::Class::OnlineExclusive => PodClass::Online,
        qos_core::Class::Offline => PodClass::Offline,
        qos_core::Class::System | qos_core::Class::Unmanaged => return None,
    };
    let opted_in = pod["metadata"]["annotations"][OPT_OUT].as_str() == Some(OPT_IN);
    let mut out = Vec::new();
    let recorded: Option<Map<String, Value>> = pod["metadata"]["annotations"]
        [translate::REQUESTS_ANNOTATION]
        .as_str()
        .and_then(|t| serde_json::from_str(t).ok());
    for list in ["initContainers", "containers"] {
        for (i, c) in pod["spec"][list]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
        {
            let name = c["name"].as_str().unwrap_or("?").to_string();
            let own = match translate::container_class(c) {
                Ok(Some(class)) => Some(class),
                Ok(None) => recorded.as_ref().and_then(|r| r.get(&name)).and_then(|e| {
                    match e["class"].as_str() {
                        Some("offline") => Some(PodClass::Offline),
                        Some("online") => Some(PodClass::Online),
                        _ => None,
                    }
                }),
                Err(_) => return None,
            };
            match own {
                // A pod that mixes the two, or whose request contradicts its class, is
                // denied by the translation webhook.
                Some(class) if class != pod_class => return None,
                Some(_) => {}
                None if asks_for_gpu(c, opted_in) => {}
                None => continue,
            }
            out.push(Gpu {
                path: format!("/spec/{list}/{i}"),
                name,
            });
        }
    }
    (!out.is_empty()).then_some((out, pod_class))
}

fn env_named<'a>(c: &'a Value, name: &str) -> Vec<(usize, &'a Value)> {
    c["env"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
        .filter(|(_, e)| e["name"] == name)
        .collect()
}

/// Why the shim cannot go into container `c`, if it cannot.
fn unsuitable(c: &Value, s: &ShimSettings) -> Option<String> {
    let preload = env_named(c, "LD_PRELOAD");
    if let Some((_, e)) = preload.last() {
        if e.get("valueFrom").is_some_and(|v| !v.is_null()) {
            return Some(
                "its LD_PRELOAD comes from valueFrom, which the webhook cannot append to".into(),
            );
        }
    } else if let Some(src) = c["envFrom"].as_array().into_iter().flatten().find(|src| {
        let prefix = src["prefix"].as_str().unwrap_or("");
        "LD_PRELOAD".starts_with(prefix)
    }) {
        let from = if src["configMapRef"].is_object() {
            format!("ConfigMap {}", src["configMapRef"]["name"])
        } else {
            format!("Secret {}", src["secretRef"]["name"])
        };
        return Some(format!("its envFrom ({from}) may set LD_PRELOAD, which an env entry would replace; set LD_PRELOAD in env (even to \"\") to get the shim appended"));
    }
    let ours = [
        (SHIM_VOLUME, s.library_dir()),
        (DOORBELL_VOLUME, s.doorbell_dir.as_str()),
        (GATE_VOLUME, s.gate_dir.as_str()),
    ];
    for m in c["volumeMounts"].as_array().into_iter().flatten() {
        let path = m["mountPath"].as_str().unwrap_or("").trim_end_matches('/');
        if let Some((_, p)) = ours.iter().find(|(v, p)| *p == path && m["name"] != *v) {
            return Some(format!(
                "its mount path {p} is taken by volume {}",
                m["name"]
            ));
        }
    }
    None
}

/// The same variable, as the API server stores it (it defaults `fieldRef.apiVersion`).
fn same_var(stored: &Value, ours: &Value) -> bool {
    match (
        &ours["valueFrom"]["fieldRef"],
        &stored["valueFrom"]["fieldRef"],
    ) {
        (Value::Object(_), Value::Object(got)) => {
            got.get("fieldPath") == ours["valueFrom"]["fieldRef"].get("fieldPath")
                && stored.get("value").is_none_or(|v| v.is_null() || v == "")
        }
        (Value::Object(_), _) => false,
        _ => stored["value"] == ours["value"] && stored["valueFrom"].is_null(),
    }
}

fn preload_with(value: &str, lib: &str) -> String {
    if value.split([':', ' ']).any(|p| p == lib) {
        value.to_string()
    } else if value.trim().is_empty() {
        lib.to_string()
    } else {
        format!("{value}:{lib}")
    }
}

/// Operations that give container `c` (at `path`) the shim.
fn container_ops(ops: &mut Vec<Value>, path: &str, c: &Value, class: PodClass, s: &ShimSettings) {
    let class_name = match class {
        PodClass::Online => "online",
        PodClass::Offline => "offline",
    };
    let mut set: Vec<Value> = vec![
        json!({"name": "COLOC_POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}),
        json!({"name": "COLOC_SHIM_CLASS", "value": class_name}),
        json!({"name": "COLOC_DOORBELL_DIR", "value": s.doorbell_dir}),
    ];
    if class == PodClass::Offline {
        set.push(json!({"name": "COLOC_GATE_FILE", "value": s.gate_file()}));
    }
    let mut add: Vec<Value> = Vec::new();
    // Ours, whatever the container said: the mounts below depend on them.
    for var in set {
        let found = env_named(c, var["name"].as_str().unwrap_or_default());
        for (j, e) in &found {
            if !same_var(e, &var) {
                ops.push(json!({"op": "replace", "path": format!("{path}/env/{j}"), "value": var}));
            }
        }
        if found.is_empty() {
            add.push(var);
        }
    }
    if class == PodClass::Offline {
        if let Some(k) = s.inflight {
            if env_named(c, "COLOC_SHIM_INFLIGHT").is_empty() {
                add.push(json!({"name": "COLOC_SHIM_INFLIGHT", "value": k.to_string()}));
            }
        }
        if let Some(ms) = s.inflight_ms {
            if env_named(c, "COLOC_SHIM_INFLIGHT_MS").is_empty() {
                add.push(json!({"name": "COLOC_SHIM_INFLIGHT_MS", "value": ms.to_string()}));
            }
        }
    }
    if class == PodClass::Online {
        if let Some(ms) = s.online_wake_gap_ms {
            if env_named(c, "COLOC_SHIM_WAKE_GAP_MS").is_empty() {
                add.push(json!({"name": "COLOC_SHIM_WAKE_GAP_MS", "value": ms.to_string()}));
            }
        }
    }
    match env_named(c, "LD_PRELOAD").last() {
        // The effective one (the kubelet lets a later entry win).
        Some((j, e)) => {
            let old = e["value"].as_str().unwrap_or("");
            let new = preload_with(old, &s.library);
            if new != old {
                let op = if e.get("value").is_some() {
                    "replace"
                } else {
                    "add"
                };
                ops.push(json!({"op": op, "path": format!("{path}/env/{j}/value"), "value": new}));
            }
        }
        None => add.push(json!({"name": "LD_PRELOAD", "value": s.library})),
    }
    append(ops, &format!("{path}/env"), c["env"].is_array(), add);

    if s.delivery == Delivery::Device {
        slot_ops(ops, path, c, class);
        return;
    }
    let mut mounts = vec![
        json!({"name": SHIM_VOLUME, "mountPath": s.library_dir(), "readOnly": true}),
        json!({"name": DOORBELL_VOLUME, "mountPath": s.doorbell_dir, "subPathExpr": "$(COLOC_POD_UID)"}),
    ];
    if class == PodClass::Offline {
        mounts.push(json!({"name": GATE_VOLUME, "mountPath": s.gate_dir, "readOnly": true}));
    }
    let have: Vec<&Value> = c["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| &m["name"])
        .collect();
    mounts.retain(|m| !have.contains(&&m["name"]));
    append(
        ops,
        &format!("{path}/volumeMounts"),
        c["volumeMounts"].is_array(),
        mounts,
    );
}

/// Whether container `c`'s effective `LD_PRELOAD` names `lib`.
fn preloads(c: &Value, lib: &str) -> bool {
    env_named(c, "LD_PRELOAD")
        .last()
        .and_then(|(_, e)| e["value"].as_str())
        .is_some_and(|v| v.split([':', ' ']).any(|p| p == lib))
}

/// The slot resource of `class`.
fn slot_resource(class: PodClass) -> &'static str {
    match class {
        PodClass::Online => qos_core::cdi::RESOURCE_ONLINE,
        PodClass::Offline => qos_core::cdi::RESOURCE_OFFLINE,
    }
}

/// Whether container `c` already asks for exactly its one slot of `class` (and no other).
fn has_slot(c: &Value, class: PodClass) -> bool {
    let want = slot_resource(class);
    ["limits", "requests"].iter().all(|k| {
        c["resources"][*k]
            .as_object()
            .into_iter()
            .flatten()
            .all(|(name, q)| {
                let ours = qos_core::cdi::SlotClass::of_resource(name).is_some();
                !ours || (name == want && (q == "1" || q == 1))
            })
    }) && c["resources"]["limits"][want].as_str() == Some("1")
}

/// Operations that give container `c` (at `path`) one slot of `class`, and take away any
/// other amount or class of slot it asked for itself (its pod's class decides).
fn slot_ops(ops: &mut Vec<Value>, path: &str, c: &Value, class: PodClass) {
    let want = slot_resource(class);
    for k in ["limits", "requests"] {
        for (name, q) in c["resources"][k].as_object().into_iter().flatten() {
            if qos_core::cdi::SlotClass::of_resource(name).is_some()
                && (name != want || (q != "1" && q != 1))
            {
                ops.push(
                    json!({"op": "remove", "path": format!("{path}/resources/{k}/{}", esc(name))}),
                );
            }
        }
    }
    if c["resources"]["limits"][want].as_str() == Some("1") {
        return;
    }
    if !c["resources"].is_object() {
        ops.push(json!({"op": "add", "path": format!("{path}/resources"), "value": {"limits": {want: "1"}}}));
    } else if !c["resources"]["limits"].is_object() {
        ops.push(
            json!({"op": "add", "path": format!("{path}/resources/limits"), "value": {want: "1"}}),
        );
    } else {
        ops.push(json!({"op": "add", "path": format!("{path}/resources/limits/{}", esc(want)), "value": "1"}));
    }
}

/// Adds `items` to the array at `path` (creating it when `exists` is false).
fn append(ops: &mut Vec<Value>, path: &str, exists: bool, items: Vec<Value>) {
    if items.is_empty() {
        return;
    }
    if exists {
        for v in items {
            ops.push(json!({"op": "add", "path": format!("{path}/-"), "value": v}));
        }
    } else {
        ops.push(json!({"op": "add", "path": path, "value": items}));
    }
}

/// Removes from every container of `pod` the mounts of our volumes that are not exactly
/// the injected ones (for a container about to be injected, as its environment will be:
/// `COLOC_POD_UID` is the webhook's); returns each container (by path) as left.
fn sanitise(
    pod: &Value,
    gpus: &[Gpu],
    s: &ShimSettings,
    ops: &mut Vec<Value>,
    warnings: &mut Vec<String>,
) -> Vec<(String, Value)> {
    let uid_only = json!({"env": [{"name": "COLOC_POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}]});
    let mut out = Vec::new();
    for list in ["initContainers", "containers"] {
        for (i, c) in pod["spec"][list]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
        {
            let path = format!("/spec/{list}/{i}");
            // A container the shim goes into now gets the webhook's COLOC_POD_UID; any
            // other keeps its own, which must then be the downward API's.
            let done = c["volumeMounts"].as_array().into_iter().flatten().any(|m| {
                m["name"] == SHIM_VOLUME && crate::mounts::mount_problem(c, m, s).is_none()
            });
            let injected_now =
                gpus.iter().any(|g| g.path == path) && !done && unsuitable(c, s).is_none();
            let env_as = if injected_now { &uid_only } else { c };
            let mut kept = c.clone();
            let mut gone = Vec::new();
            if let Some(mounts) = c["volumeMounts"].as_array() {
                let mut left = Vec::new();
                for (j, m) in mounts.iter().enumerate() {
                    let ours = [SHIM_VOLUME, DOORBELL_VOLUME, GATE_VOLUME]
                        .iter()
                        .any(|v| m["name"] == *v);
                    match ours
                        .then(|| crate::mounts::mount_problem(env_as, m, s))
                        .flatten()
                    {
                        Some(why) => gone.push((j, m["name"].clone(), why)),
                        None => left.push(m.clone()),
                    }
                }
                kept["volumeMounts"] = Value::Array(left);
            }
            for (j, name, why) in gone.iter().rev() {
                ops.push(json!({"op": "remove", "path": format!("{path}/volumeMounts/{j}")}));
                warnings.push(format!(
                    "gpu-coloc: removed container {:?}'s mount of volume {name} ({why}); only the gpu-coloc webhook mounts it",
                    c["name"].as_str().unwrap_or("?")
                ));
            }
            out.push((path, kept));
        }
    }
    out
}

/// The injection for `pod` at CREATE (see the module documentation).
pub fn inject(pod: &Value, s: &ShimSettings, map: &qos_core::PriorityMapping) -> Injection {
    let annotations = pod["metadata"]["annotations"].as_object();
    if annotations
        .and_then(|a| a.get(OPT_OUT))
        .and_then(Value::as_str)
        == Some("disabled")
    {
        return Injection::default();
    }
    let Some((gpus, class)) = gpu_containers(pod, map) else {
        return Injection::default();
    };
    // What the classifier had to say (an unknown value, vocabularies that disagree).
    let mut warnings: Vec<String> = qos_core::classify_pod_with(&translate::pod_facts(pod), map)
        .warning
        .map(|w| format!("gpu-coloc: {w}"))
        .into_iter()
        .collect();
    let volumes = [
        (SHIM_VOLUME, s.library_dir().to_string()),
        (DOORBELL_VOLUME, format!("{}/pods", s.doorbell_dir)),
        (GATE_VOLUME, s.gate_dir.clone()),
    ];
    let pod_volumes: Vec<&Value> = pod["spec"]["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .collect();
    for (name, host) in volumes.iter().filter(|_| s.delivery == Delivery::HostPath) {
        if let Some(v) = pod_volumes.iter().find(|v| v["name"] == *name) {
            if v["hostPath"]["path"].as_str() != Some(host.as_str()) {
                return Injection {
                    ops: vec![],
                    warnings: vec![format!("gpu-coloc: the CUDA shim was not injected: this pod already has a volume named {name} that is not the host directory {host}")],
                };
            }
        }
    }
    let mut ops = Vec::new();
    // The pod's own mounts of our volumes go, unless they are exactly what the injection
    // gives (crate::mounts): a tenant's read-write or whole-directory mount is never kept.
    let containers = sanitise(pod, &gpus, s, &mut ops, &mut warnings);
    let (mut injected, mut skipped) = (Vec::new(), Vec::new());
    for g in &gpus {
        let c = containers
            .iter()
            .find(|(p, _)| *p == g.path)
            .map_or(&Value::Null, |(_, c)| c);
        let done = match s.delivery {
            Delivery::HostPath => c["volumeMounts"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|m| m["name"] == SHIM_VOLUME),
            Delivery::Device => has_slot(c, class) && preloads(c, &s.library),
        };
        if done {
            continue;
        }
        match unsuitable(c, s) {
            Some(why) => {
                warnings.push(format!("gpu-coloc: the CUDA shim was not injected into container {:?}: {why}; its GPU work is seen through NVML only", g.name));
                skipped.push(format!("{}: {why}", g.name));
            }
            None => {
                container_ops(&mut ops, &g.path, c, class, s);
                injected.push(g.name.clone());
            }
        }
    }
    if injected.is_empty() && skipped.is_empty() {
        return Injection { ops, warnings };
    }
    if !injected.is_empty() && s.delivery == Delivery::HostPath {
        let mut wanted: Vec<Value> = vec![
            json!({"name": SHIM_VOLUME, "hostPath": {"path": volumes[0].1, "type": "DirectoryOrCreate"}}),
            json!({"name": DOORBELL_VOLUME, "hostPath": {"path": volumes[1].1, "type": "DirectoryOrCreate"}}),
        ];
        if class == PodClass::Offline {
            wanted.push(json!({"name": GATE_VOLUME, "hostPath": {"path": volumes[2].1, "type": "DirectoryOrCreate"}}));
        }
        wanted.retain(|w| !pod_volumes.iter().any(|v| v["name"] == w["name"]));
        append(
            &mut ops,
            "/spec/volumes",
            pod["spec"]["volumes"].is_array(),
            wanted,
        );
    }
    // What was done, on the pod itself: the containers injected so far, and those this
    // review left out (the same list again on a second review: no operation).
    let old = |k: &str| annotations.and_then(|a| a.get(k)).and_then(Value::as_str);
    let mut notes: Vec<(&str, String)> = Vec::new();
    if !injected.is_empty() {
        let mut all: Vec<String> = old(INJECTED_ANNOTATION)
            .filter(|o| !o.is_empty())
            .map(|o| o.split(',').map(str::to_string).collect())
            .unwrap_or_default();
        all.extend(injected);
        notes.push((INJECTED_ANNOTATION, all.join(",")));
    }
    if !skipped.is_empty() {
        notes.push((SKIPPED_ANNOTATION, skipped.join("; ")));
    }
    notes.retain(|(k, v)| old(k) != Some(v.as_str()));
    if annotations.is_none() {
        let map: Map<String, Value> = notes
            .into_iter()
            .map(|(k, v)| (k.to_string(), Value::String(v)))
            .collect();
        if !map.is_empty() {
            ops.push(if pod["metadata"].is_object() {
                json!({"op": "add", "path": "/metadata/annotations", "value": map})
            } else {
                json!({"op": "add", "path": "/metadata", "value": {"annotations": map}})
            });
        }
    } else {
        for (k, v) in notes {
            let op = if old(k).is_some() { "replace" } else { "add" };
            ops.push(
                json!({"op": op, "path": format!("/metadata/annotations/{}", esc(k)), "value": v}),
            );
        }
    }
    Injection { ops, warnings }
}
