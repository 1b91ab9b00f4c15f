//! Pure check of what a pod may mount of the node's gpu-coloc directories. No I/O.
//!
//! The doorbell pages, the gate file and the shim on a node are read by the agent and by
//! every GPU pod there, so what a pod can do with them must not depend on the pod's own
//! spec. The rule is on the shape of the pod, not on who wrote it: a volume or a mount a
//! tenant wrote exactly as [`crate::inject`] writes it gives the tenant nothing more than
//! the injection does; anything else is denied. Served on `/validate-mounts` (the chart's
//! `mounts.gpu-coloc.dev`: pods with a `hostPath` volume or a volume of ours, at CREATE
//! and when an ephemeral container is added) and part of `/validate`.
//!
//! At CREATE ([`check_pod`]):
//! - a volume named [`SHIM_VOLUME`], [`DOORBELL_VOLUME`] or [`GATE_VOLUME`] is exactly
//!   the injected one: nothing but its `hostPath`, at the injected path, of type
//!   `DirectoryOrCreate` (or `Directory`, or none);
//! - any other `hostPath` volume whose path ([`normalise`]d: `.`, `..`, `//`, a trailing
//!   `/`, `/proc/<pid>/root` as `/`, `/var/run` as `/run`, …) is one of the node's gpu-coloc
//!   directories or inside one is denied; one that only contains one (`/`, `/run`, `/var`,
//!   `/proc`) is not gpu-coloc's to refuse (`kubectl debug node/…`, HAMi's vgpu-monitor:
//!   a pod with a writable `/` owns the node whatever this webhook says; Pod Security
//!   `baseline` refuses it), except where a container mounts it with a `subPath` that
//!   resolves into the gpu-coloc directories, or a `subPathExpr` (not resolvable here);
//! - in every container (containers, init containers, ephemeral containers), a mount of
//!   one of our volumes is exactly the injected one: the shim's directory read-only at its
//!   path; the gate directory read-only at its path; the doorbell volume at the doorbell
//!   path with `subPathExpr: $(COLOC_POD_UID)` (the pod's own directory), in a container
//!   whose every `COLOC_POD_UID` entry is the downward API's `metadata.uid` — a value the
//!   pod chose would name another pod's directory. No `subPath`, no mount propagation.
//!
//! When an ephemeral container is added (UPDATE of `pods/ephemeralcontainers`,
//! [`check_ephemeral`]): the same mount rule for the ephemeral containers (the other
//! containers and the volumes cannot change after CREATE).
//!
//! The node's gpu-coloc directories: the `[shim]` settings' library directory, doorbell
//! directory and gate directory (their defaults where the settings have no `[shim]`),
//! each with its gpu-coloc parent (`/run/gpu-coloc`, `/var/lib/gpu-coloc`), and
//! `protected_host_paths` (the chart: the agent's state directory).

use crate::inject::{ShimSettings, DOORBELL_VOLUME, GATE_VOLUME, SHIM_VOLUME};
use crate::translate::Denial;
use serde_json::Value;

/// The bounded denial reason of every refusal here.
pub const REASON: &str = "mount_forbidden";

const OURS: [&str; 3] = [SHIM_VOLUME, DOORBELL_VOLUME, GATE_VOLUME];
const CONTAINER_LISTS: [&str; 3] = ["initContainers", "containers", "ephemeralContainers"];

fn deny(message: String) -> Denial {
    Denial {
        message,
        reason: REASON,
    }
}

/// `path` as the kernel would resolve it on the node, where that can be known without
/// reading the node: `.`, `..`, repeated and trailing `/`; `/proc/<pid>/root`,
/// `/proc/<pid>/cwd` and `/proc/<pid>/task/<tid>/root|cwd` read as `/` (the host's root
/// seen through a process: PID 1's is the node's); `/var/run` and `/var/lock` read as
/// `/run` and `/run/lock` (links on every current distribution); `/lib`, `/lib64`, `/bin`
/// and `/sbin` read as their `/usr` directories (merged `/usr`). Each rule applies as the
/// walk meets it, so `/proc/1/root/../run` is `/run`. A relative path is taken from `/`
/// (the kubelet's working directory).
pub fn normalise(path: &str) -> String {
    let mut parts: Vec<String> = Vec::new();
    for seg in path.split('/') {
        match seg {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            s => parts.push(s.to_string()),
        }
        let p: Vec<&str> = parts.iter().map(String::as_str).collect();
        match p.as_slice() {
            ["proc", _, "root" | "cwd"] | ["proc", _, "task", _, "root" | "cwd"] => parts.clear(),
            ["var", "run"] => parts = vec!["run".into()],
            ["var", "lock"] => parts = vec!["run".into(), "lock".into()],
            [top @ ("lib" | "lib64" | "bin" | "sbin")] => {
                parts = vec!["usr".into(), top.to_string()]
            }
            _ => {}
        }
    }
    format!("/{}", parts.join("/"))
}

/// `inner` is `outer` or below it (both normalised).
fn within(inner: &str, outer: &str) -> bool {
    outer == "/"
        || inner == outer
        || (inner.starts_with(outer) && inner.as_bytes().get(outer.len()) == Some(&b'/'))
}

/// A host path that reaches other processes' roots below it (`/proc`, `/proc/<pid>`):
/// a `subPathExpr` there may name any directory of the node.
fn reaches_roots(path: &str) -> bool {
    path == "/proc" || (path.starts_with("/proc/") && path[6..].split('/').count() <= 3)
}

/// The node's gpu-coloc directories, normalised: the `[shim]` settings' three, each with
/// its gpu-coloc parent (the nearest directory above it whose name has `gpu-coloc` or
/// `coloc` in it, e.g. `/run/gpu-coloc`), and `extra`.
fn node_dirs(s: &ShimSettings, extra: &[String]) -> Vec<String> {
    let mut v: Vec<String> = Vec::new();
    for p in [
        s.library_dir(),
        s.doorbell_dir.as_str(),
        s.gate_dir.as_str(),
    ] {
        let n = normalise(p);
        let segs: Vec<&str> = n.split('/').collect();
        let family = (1..segs.len())
            .find(|&i| segs[i].contains("coloc"))
            .map(|i| segs[..=i].join("/"));
        v.extend(family);
        v.push(n);
    }
    v.extend(extra.iter().map(|p| normalise(p)));
    v.sort();
    v.dedup();
    // Only the outermost of nested directories matters.
    let all = v.clone();
    v.retain(|d| !all.iter().any(|o| o != d && within(d, o)));
    v
}

/// The volume [`crate::inject`] adds under `name`, as its host path.
fn injected_host_path(name: &str, s: &ShimSettings) -> String {
    match name {
        SHIM_VOLUME => s.library_dir().to_string(),
        DOORBELL_VOLUME => format!("{}/pods", s.doorbell_dir),
        _ => s.gate_dir.clone(),
    }
}

fn present(v: &Value) -> bool {
    !v.is_null()
}

/// Volume `v` (named one of ours) is exactly the injected one.
fn exact_volume(v: &Value, s: &ShimSettings) -> bool {
    let name = v["name"].as_str().unwrap_or_default();
    let only_host_path = v.as_object().is_some_and(|m| {
        m.iter()
            .all(|(k, x)| k == "name" || k == "hostPath" || x.is_null())
    });
    let hp = &v["hostPath"];
    only_host_path
        && hp["path"].as_str() == Some(injected_host_path(name, s).as_str())
        && matches!(
            hp["type"].as_str(),
            None | Some("" | "DirectoryOrCreate" | "Directory")
        )
        && hp
            .as_object()
            .is_some_and(|m| m.keys().all(|k| k == "path" || k == "type"))
}

/// Every `COLOC_POD_UID` of container `c` is the downward API's `metadata.uid`, and there
/// is one.
fn pod_uid_from_api(c: &Value) -> bool {
    let entries: Vec<&Value> = c["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["name"] == "COLOC_POD_UID")
        .collect();
    !entries.is_empty()
        && entries.iter().all(|e| {
            e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"
                && e["value"].as_str().is_none_or(str::is_empty)
                && e["valueFrom"]
                    .as_object()
                    .is_some_and(|m| m.iter().all(|(k, x)| k == "fieldRef" || x.is_null()))
        })
}

/// Why mount `m` (of one of our volumes) in container `c` is not the injected one; `None`
/// when it is.
pub fn mount_problem(c: &Value, m: &Value, s: &ShimSettings) -> Option<String> {
    let name = m["name"].as_str().unwrap_or_default();
    let (path, read_only, expr) = match name {
        SHIM_VOLUME => (s.library_dir().to_string(), true, None),
        GATE_VOLUME => (s.gate_dir.clone(), true, None),
        _ => (s.doorbell_dir.clone(), false, Some("$(COLOC_POD_UID)")),
    };
    let allowed_keys = [
        "name",
        "mountPath",
        "readOnly",
        "subPath",
        "subPathExpr",
        "mountPropagation",
        "recursiveReadOnly",
    ];
    if let Some((k, _)) = m
        .as_object()
        .into_iter()
        .flatten()
        .find(|(k, x)| !allowed_keys.contains(&k.as_str()) && present(x))
    {
        return Some(format!("field {k} is not allowed"));
    }
    if m["mountPath"].as_str().map(|p| p.trim_end_matches('/')) != Some(path.as_str()) {
        return Some(format!("it must be mounted at {path}"));
    }
    let ro = m["readOnly"].as_bool().unwrap_or(false);
    if read_only && !ro {
        return Some("it must be read-only".into());
    }
    if !matches!(m["mountPropagation"].as_str(), None | Some("None")) {
        return Some("mount propagation is not allowed".into());
    }
    if !m["subPath"].as_str().unwrap_or_default().is_empty() {
        return Some("subPath is not allowed".into());
    }
    let got_expr = m["subPathExpr"].as_str().unwrap_or_default();
    match expr {
        None if !got_expr.is_empty() => Some("subPathExpr is not allowed".into()),
        Some(e) if got_expr != e => Some(format!(
            "only the pod's own directory may be mounted (subPathExpr: {e})"
        )),
        Some(_) if !pod_uid_from_api(c) => Some(
            "COLOC_POD_UID must come from the downward API (fieldRef metadata.uid) in every entry"
                .into(),
        ),
        _ => None,
    }
}

/// Mounts of our volumes in the containers of `lists` that are not the injected ones.
fn bad_mounts(pod: &Value, lists: &[&str], s: &ShimSettings) -> Option<String> {
    for list in lists {
        for c in pod["spec"][*list].as_array().into_iter().flatten() {
            for m in c["volumeMounts"].as_array().into_iter().flatten() {
                let Some(name) = m["name"].as_str().filter(|n| OURS.contains(n)) else {
                    continue;
                };
                if let Some(why) = mount_problem(c, m, s) {
                    return Some(format!(
                        "{} {:?} mounts volume {name}, which only the gpu-coloc webhook's injection may mount, and only as it injects it: {why}",
                        kind(list),
                        c["name"].as_str().unwrap_or("?")
                    ));
                }
            }
        }
    }
    None
}

fn kind(list: &str) -> &'static str {
    match list {
        "initContainers" => "init container",
        "ephemeralContainers" => "ephemeral container",
        _ => "container",
    }
}

/// Why container `c`'s mounts of volume `name` (host path `raw`, normalised `path`) reach
/// one of `dirs` through a `subPath` or `subPathExpr`, if they do.
fn sub_path_problem(
    c: &Value,
    name: &str,
    raw: &str,
    path: &str,
    dirs: &[String],
) -> Option<String> {
    for m in c["volumeMounts"].as_array().into_iter().flatten() {
        if m["name"] != name {
            continue;
        }
        let sub = m["subPath"].as_str().unwrap_or_default();
        if !sub.is_empty() {
            let full = normalise(&format!("{raw}/{sub}"));
            if let Some(d) = dirs.iter().find(|d| within(&full, d)) {
                return Some(format!(
                    "mounts hostPath {raw:?} (volume {name:?}) with subPath {sub:?}, which is the node's gpu-coloc directory {d} or inside it"
                ));
            }
        }
        let expr = m["subPathExpr"].as_str().unwrap_or_default();
        if !expr.is_empty() && (dirs.iter().any(|d| within(d, path)) || reaches_roots(path)) {
            return Some(format!(
                "mounts hostPath {raw:?} (volume {name:?}), which contains the node's gpu-coloc directories, with subPathExpr {expr:?}, which the webhook cannot resolve; use subPath or a narrower hostPath"
            ));
        }
    }
    None
}

/// The CREATE rule (module documentation). `extra`: more protected host directories.
pub fn check_pod(pod: &Value, s: &ShimSettings, extra: &[String]) -> Result<(), Denial> {
    let dirs = node_dirs(s, extra);
    for v in pod["spec"]["volumes"].as_array().into_iter().flatten() {
        let name = v["name"].as_str().unwrap_or_default();
        if OURS.contains(&name) {
            if !exact_volume(v, s) {
                return Err(deny(format!(
                    "volume {name} is reserved for the gpu-coloc webhook's injection (the host directory {}, nothing else); rename the pod's volume",
                    injected_host_path(name, s)
                )));
            }
            continue;
        }
        let Some(raw) = v["hostPath"]["path"].as_str() else {
            continue;
        };
        let path = normalise(raw);
        if let Some(d) = dirs.iter().find(|d| within(&path, d)) {
            return Err(deny(format!(
                "volume {name:?}: hostPath {raw:?} is the node's gpu-coloc directory {d} or inside it; pods get what they need of it from the gpu-coloc webhook"
            )));
        }
        for list in CONTAINER_LISTS {
            for c in pod["spec"][list].as_array().into_iter().flatten() {
                if let Some(why) = sub_path_problem(c, name, raw, &path, &dirs) {
                    return Err(deny(format!(
                        "{} {:?}: {why}",
                        kind(list),
                        c["name"].as_str().unwrap_or("?")
                    )));
                }
            }
        }
    }
    match bad_mounts(pod, &CONTAINER_LISTS, s) {
        Some(m) => Err(deny(m)),
        None => Ok(()),
    }
}

/// The rule when ephemeral containers are added (UPDATE of `pods/ephemeralcontainers`):
/// their mounts of our volumes, and of a writable `hostPath` that contains a gpu-coloc
/// directory.
pub fn check_ephemeral(pod: &Value, s: &ShimSettings, extra: &[String]) -> Result<(), Denial> {
    // The volumes are the pod's (unchanged since CREATE); only the ephemeral containers'
    // mounts are new. Checking them with the CREATE rule restricted to that list:
    let mut only = pod.clone();
    if let Some(spec) = only["spec"].as_object_mut() {
        spec.remove("containers");
        spec.remove("initContainers");
    }
    let dirs = node_dirs(s, extra);
    // A volume admitted before this webhook checked mounts may be anything: what the
    // ephemeral container may do with it is checked here.
    for v in only["spec"]["volumes"].as_array().into_iter().flatten() {
        let name = v["name"].as_str().unwrap_or_default();
        let Some(raw) = v["hostPath"]["path"].as_str() else {
            continue;
        };
        if OURS.contains(&name) && exact_volume(v, s) {
            continue;
        }
        let path = normalise(raw);
        let inside = dirs.iter().any(|d| within(&path, d));
        for c in only["spec"]["ephemeralContainers"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let mounted = c["volumeMounts"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|m| m["name"] == name);
            let why = if inside && mounted {
                Some(format!(
                    "mounts hostPath {raw:?} (volume {name:?}), the node's gpu-coloc directory or inside it"
                ))
            } else {
                sub_path_problem(c, name, raw, &path, &dirs)
            };
            if let Some(why) = why {
                return Err(deny(format!(
                    "ephemeral container {:?} {why}",
                    c["name"].as_str().unwrap_or("?")
                )));
            }
        }
    }
    match bad_mounts(&only, &["ephemeralContainers"], s) {
        Some(m) => Err(deny(m)),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn normalising() {
        for (raw, want) in [
            ("/run/gpu-coloc/doorbells", "/run/gpu-coloc/doorbells"),
            ("/run/gpu-coloc/doorbells/", "/run/gpu-coloc/doorbells"),
            ("//run//gpu-coloc///doorbells//", "/run/gpu-coloc/doorbells"),
            (
                "/run/x/../gpu-coloc/./doorbells",
                "/run/gpu-coloc/doorbells",
            ),
            ("/../../run/gpu-coloc", "/run/gpu-coloc"),
            ("/var/run/gpu-coloc/gate", "/run/gpu-coloc/gate"),
            ("/var/lib/../run/gpu-coloc", "/run/gpu-coloc"),
            ("run/gpu-coloc", "/run/gpu-coloc"),
            ("/", "/"),
            ("", "/"),
            ("/proc/1/root/run/gpu-coloc/gate", "/run/gpu-coloc/gate"),
            ("/proc/self/root//var/run/./gpu-coloc", "/run/gpu-coloc"),
            (
                "/proc/1/task/1/root/var/lib/gpu-coloc",
                "/var/lib/gpu-coloc",
            ),
            ("/proc/1/cwd/run", "/run"),
            ("/proc/1/root/../run/gpu-coloc", "/run/gpu-coloc"),
            ("/proc/1/root/proc/1/root/run", "/run"),
            ("/proc/1", "/proc/1"),
            ("/var/lock/x", "/run/lock/x"),
            ("/lib/gpu-coloc", "/usr/lib/gpu-coloc"),
            ("/run/../var/run/gpu-coloc", "/run/gpu-coloc"),
        ] {
            assert_eq!(normalise(raw), want, "{raw}");
        }
        assert!(within(
            "/run/gpu-coloc/doorbells/pods",
            "/run/gpu-coloc/doorbells"
        ));
        assert!(!within(
            "/run/gpu-coloc/doorbells2",
            "/run/gpu-coloc/doorbells"
        ));
        assert!(within("/run/gpu-coloc", "/"));
    }

    fn pod(volumes: Value, containers: Value) -> Value {
        json!({"spec": {"volumes": volumes, "containers": containers}})
    }

    #[test]
    fn host_paths_near_the_node_directories() {
        let s = ShimSettings::default();
        let extra = vec!["/run/coloc-agent".to_string()];
        let c = |ro: bool| json!([{"name": "c", "volumeMounts": [{"name": "h", "mountPath": "/h", "readOnly": ro}]}]);
        for (path, ro, ok) in [
            ("/run/gpu-coloc/doorbells", true, false),
            ("/run/gpu-coloc/doorbells/pods/abc", true, false),
            ("/run/gpu-coloc/x/../doorbells", true, false),
            ("//run/gpu-coloc//gate/", true, false),
            ("/var/run/gpu-coloc/gate", true, false),
            ("/var/lib/gpu-coloc/lib", true, false),
            ("/var/lib/gpu-coloc", false, false),
            ("/run/coloc-agent", true, false),
            ("/run/gpu-coloc", true, false),
            ("/run/gpu-coloc", false, false),
            ("/proc/1/root/run/gpu-coloc/gate", true, false),
            ("/proc/self/root/run/gpu-coloc/doorbells/pods", false, false),
            ("/proc/1/root/../run/gpu-coloc", false, false),
            ("/var/lock/../gpu-coloc/gate", false, false),
            // Unrelated host paths, and those that merely contain ours: allowed, writable
            // or not (`kubectl debug node/…` mounts `/`; HAMi's vgpu-monitor `/var`).
            ("/run", false, true),
            ("/run", true, true),
            ("/", false, true),
            ("/", true, true),
            ("/var", false, true),
            ("/var/lib", false, true),
            ("/proc", false, true),
            ("/proc/1/root", false, true),
            ("/run/gpu-coloc-other", false, true),
            ("/data", false, true),
            ("/run/containerd", false, true),
        ] {
            let p = pod(json!([{"name": "h", "hostPath": {"path": path}}]), c(ro));
            assert_eq!(
                check_pod(&p, &s, &extra).is_ok(),
                ok,
                "{path} ro={ro}: {:?}",
                check_pod(&p, &s, &extra)
            );
        }
    }

    /// A containing host path reaches ours through a subPath (resolved) or a subPathExpr
    /// (which cannot be resolved at admission): denied; elsewhere allowed.
    #[test]
    fn sub_paths_into_the_node_directories() {
        let s = ShimSettings::default();
        let m = |path: &str, mount: Value| {
            let mut mount = mount;
            mount["name"] = json!("h");
            mount["mountPath"] = json!("/h");
            pod(
                json!([{"name": "h", "hostPath": {"path": path}}]),
                json!([{"name": "c", "volumeMounts": [mount]}]),
            )
        };
        for (path, mount, ok) in [
            ("/", json!({"subPath": "run/gpu-coloc/doorbells"}), false),
            ("/run", json!({"subPath": "gpu-coloc"}), false),
            (
                "/proc",
                json!({"subPath": "1/root/run/gpu-coloc/gate"}),
                false,
            ),
            (
                "/var",
                json!({"subPath": "run/gpu-coloc", "readOnly": true}),
                false,
            ),
            ("/run", json!({"subPathExpr": "$(X)"}), false),
            ("/proc/1", json!({"subPathExpr": "root/$(X)"}), false),
            ("/", json!({"subPath": "etc"}), true),
            ("/run", json!({"subPath": "containerd"}), true),
            ("/data", json!({"subPathExpr": "$(POD)"}), true),
        ] {
            let p = m(path, mount.clone());
            assert_eq!(
                check_pod(&p, &s, &[]).is_ok(),
                ok,
                "{path} {mount}: {:?}",
                check_pod(&p, &s, &[])
            );
            let mut e = p.clone();
            e["spec"]["ephemeralContainers"] = e["spec"]["containers"].take();
            assert_eq!(
                check_ephemeral(&e, &s, &[]).is_ok(),
                ok,
                "ephemeral {path} {mount}"
            );
        }
    }

    #[test]
    fn volumes_of_ours_only_as_injected() {
        let s = ShimSettings::default();
        let ok = pod(
            json!([{"name": "gpu-coloc-shim", "hostPath": {"path": "/var/lib/gpu-coloc/lib", "type": "DirectoryOrCreate"}}]),
            json!([]),
        );
        check_pod(&ok, &s, &[]).unwrap();
        for v in [
            json!({"name": "gpu-coloc-shim", "emptyDir": {}}),
            json!({"name": "gpu-coloc-shim", "hostPath": {"path": "/var/lib/gpu-coloc"}}),
            json!({"name": "gpu-coloc-doorbells", "hostPath": {"path": "/run/gpu-coloc/doorbells"}}),
            json!({"name": "gpu-coloc-gate", "hostPath": {"path": "/run/gpu-coloc/gate", "type": "Socket"}}),
        ] {
            let p = pod(json!([v]), json!([]));
            let e = check_pod(&p, &s, &[]).unwrap_err();
            assert_eq!(e.reason, REASON);
            assert!(e.message.contains("reserved"), "{}", e.message);
        }
    }

    #[test]
    fn mounts_only_as_injected() {
        let s = ShimSettings::default();
        let uid = json!({"name": "COLOC_POD_UID", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.uid"}}});
        let good_bell = json!({"name": "gpu-coloc-doorbells", "mountPath": "/run/gpu-coloc/doorbells", "subPathExpr": "$(COLOC_POD_UID)"});
        let c =
            |mount: Value, env: Value| json!({"name": "c", "env": env, "volumeMounts": [mount]});
        let good = [
            c(
                json!({"name": "gpu-coloc-shim", "mountPath": "/var/lib/gpu-coloc/lib", "readOnly": true}),
                json!([]),
            ),
            c(
                json!({"name": "gpu-coloc-gate", "mountPath": "/run/gpu-coloc/gate", "readOnly": true, "mountPropagation": "None"}),
                json!([]),
            ),
            c(good_bell.clone(), json!([uid])),
        ];
        for g in &good {
            assert_eq!(mount_problem(g, &g["volumeMounts"][0], &s), None, "{g}");
        }
        let bad = [
            c(
                json!({"name": "gpu-coloc-shim", "mountPath": "/var/lib/gpu-coloc/lib"}),
                json!([]),
            ),
            c(
                json!({"name": "gpu-coloc-shim", "mountPath": "/var/lib/gpu-coloc/lib", "readOnly": false}),
                json!([]),
            ),
            c(
                json!({"name": "gpu-coloc-gate", "mountPath": "/gate", "readOnly": true}),
                json!([]),
            ),
            c(
                json!({"name": "gpu-coloc-gate", "mountPath": "/run/gpu-coloc/gate", "readOnly": true, "subPath": ".."}),
                json!([]),
            ),
            c(
                json!({"name": "gpu-coloc-doorbells", "mountPath": "/run/gpu-coloc/doorbells"}),
                json!([uid]),
            ),
            c(
                json!({"name": "gpu-coloc-doorbells", "mountPath": "/run/gpu-coloc/doorbells", "subPath": "0b7c9f6e-1111-2222-3333-444455556666"}),
                json!([uid]),
            ),
            c(good_bell.clone(), json!([])),
            c(
                good_bell.clone(),
                json!([uid, {"name": "COLOC_POD_UID", "value": "0b7c9f6e-1111-2222-3333-444455556666"}]),
            ),
            c(
                good_bell.clone(),
                json!([{"name": "COLOC_POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]),
            ),
            c(
                json!({"name": "gpu-coloc-doorbells", "mountPath": "/run/gpu-coloc/doorbells", "subPathExpr": "$(COLOC_POD_UID)", "mountPropagation": "HostToContainer"}),
                json!([uid]),
            ),
        ];
        for b in &bad {
            assert!(
                mount_problem(b, &b["volumeMounts"][0], &s).is_some(),
                "accepted {b}"
            );
        }
    }
}
