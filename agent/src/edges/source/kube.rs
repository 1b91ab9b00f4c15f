//! The Kubernetes pod source: a kube-rs watcher on this node's pods
//! (`spec.nodeName=<node>`), classified by `qos_core::classify_pod` (what a pod cannot
//! change after admission first: offline extended resources, HAMi's low priority,
//! Koordinator's batch priority classes; then `katalyst.kubewharf.io/qos_level` and
//! `koordinator.sh/qosClass`), looked up by the pod UID found in a process's cgroup path.
//!
//! ```text
//!  API server ──list+watch──► watcher (backoff, relist on 410) ──► index: pod UID → class
//!                                                                      ▲
//!  /proc/<pid>/cgroup ──► podref::parse ──► pod UID ──────────────────┘ classify_pod()
//! ```
//!
//! What a real API server does, and what the source does about it:
//! - watch timeout, `410 Gone`: the watcher relists; the old index stays in use until the
//!   new list is complete, then is replaced whole (pods deleted meanwhile disappear);
//! - disconnects and errors: logged and counted, retried with backoff; the last known pods
//!   stay in use, so online work stays protected;
//! - a pod deleted (or reclassified) while its processes are suspended: its entry goes, the
//!   generation changes, the agent reclassifies and resumes what is no longer offline;
//! - a pod seen offline stays offline: the annotation is the tenant's to change (an UPDATE
//!   while the webhook is unreachable is admitted unreviewed), and a pod that could turn
//!   itself online would never be suspended and would suspend others. The change is
//!   refused, logged and counted (`coloc_pod_class_change_refused_total`); online → offline
//!   is allowed (it only gives up protection).
//!
//! Readiness is false until the first list is complete.
//!
//! May touch: the Kubernetes API (get/list/watch pods).

use crate::edges::procfs::ProcInfo;
use crate::edges::source::{Classified, PodSource, ShimNote};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client, ResourceExt};
use qos_core::pod::KOORDINATOR_QOS_LABEL;
use qos_core::resources::{CorePercent, RECLAIMED_MGPU_CORE};
use qos_core::{classify_pod_with, Class, ComputePolicy, PodFacts, PriorityMapping, Share};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use tracing::{info, warn};

/// A pod's word on memory preemption: `"true"` lets the agent checkpoint its offline
/// processes' GPU memory while online work needs it (`--checkpoint-pods opt-in`), `"false"`
/// keeps it from doing so (`opt-out`).
pub const CHECKPOINT_ANNOTATION: &str = "gpu-coloc.dev/checkpoint";

/// What a value of [`CHECKPOINT_ANNOTATION`] says: `"true"` or `"false"` (surrounding
/// whitespace ignored, nothing else: not `"TRUE"`, `"yes"` nor `""`); anything else says
/// nothing, and the agent's `--checkpoint-pods` default applies.
pub fn checkpoint_word(value: &str) -> Option<bool> {
    match value.trim() {
        "true" => Some(true),
        "false" => Some(false),
        _ => None,
    }
}

/// What the agent needs to know about one pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodEntry {
    /// `namespace/name`.
    pub owner: String,
    /// Class from the QoS annotation.
    pub class: Class,
    /// Share policy (offline pods).
    pub share: Share,
    /// `gpu-coloc.dev/checkpoint`: `"true"` or `"false"`; anything else says nothing.
    pub checkpoint: Option<bool>,
    /// What the webhook wrote about the CUDA shim (reported, never decides).
    pub shim: ShimNote,
    /// Its containers by ID (the runtime's, without its `containerd://` scheme) and name,
    /// from the pod's container statuses (reported, never decides).
    pub containers: Vec<(String, String)>,
}

impl PodEntry {
    /// Reads a pod: its class from every vocabulary, what it cannot change after
    /// admission first (`qos_core::classify_pod`). Unknown values are online (and logged
    /// by the caller).
    pub fn from_pod(pod: &Pod, map: &PriorityMapping) -> (PodEntry, Option<String>) {
        let ann = pod.metadata.annotations.as_ref();
        let spec = pod.spec.as_ref();
        let resources = spec
            .into_iter()
            .flat_map(|s| {
                s.containers
                    .iter()
                    .chain(s.init_containers.iter().flatten())
            })
            .filter_map(|c| c.resources.as_ref())
            .flat_map(|r| r.requests.iter().flatten().chain(r.limits.iter().flatten()))
            .map(|(k, q)| (k.as_str(), q.0.as_str()))
            .collect();
        let c = classify_pod_with(
            &PodFacts {
                qos_level: ann
                    .and_then(|a| a.get(qos_core::QOS_LEVEL_ANNOTATION))
                    .map(String::as_str),
                coloc_class: ann
                    .and_then(|a| a.get(qos_core::pod::COLOC_CLASS_ANNOTATION))
                    .map(String::as_str),
                priority: spec.and_then(|s| s.priority),
                koordinator_qos: pod
                    .metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(KOORDINATOR_QOS_LABEL))
                    .map(String::as_str),
                priority_class: spec.and_then(|s| s.priority_class_name.as_deref()),
                resources,
            },
            map,
        );
        let policy = ComputePolicy::from_annotation(
            ann.and_then(|a| a.get(qos_core::resources::COMPUTE_POLICY_ANNOTATION))
                .map(String::as_str),
        )
        .unwrap_or_default();
        let share = if c.class == Class::Offline && policy == ComputePolicy::FixedShare {
            let percent = pod
                .spec
                .iter()
                .flat_map(|s| s.containers.iter())
                .filter_map(|c| {
                    c.resources
                        .as_ref()?
                        .limits
                        .as_ref()?
                        .get(RECLAIMED_MGPU_CORE)
                })
                .filter_map(|q| CorePercent::parse(RECLAIMED_MGPU_CORE, &q.0).ok())
                .map(CorePercent::percent_of_one)
                .max()
                .unwrap_or(100);
            Share::Fixed { percent }
        } else {
            Share::Burst
        };
        let owner = format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any());
        (
            PodEntry {
                owner,
                class: c.class,
                share,
                shim: ShimNote::from_annotations(|k| {
                    ann.and_then(|a| a.get(k)).map(String::as_str)
                }),
                checkpoint: ann
                    .and_then(|a| a.get(CHECKPOINT_ANNOTATION))
                    .and_then(|v| checkpoint_word(v)),
                containers: containers_of(pod),
            },
            c.warning,
        )
    }
}

/// A pod's containers (init and ephemeral ones too) by ID and name, from its statuses:
/// `containerd://3d8f…` (or `cri-o://`, `docker://`) gives the ID its cgroup path names.
fn containers_of(pod: &Pod) -> Vec<(String, String)> {
    let Some(st) = pod.status.as_ref() else {
        return Vec::new();
    };
    let mut out: Vec<(String, String)> = st
        .container_statuses
        .iter()
        .chain(st.init_container_statuses.iter())
        .chain(st.ephemeral_container_statuses.iter())
        .flatten()
        .filter_map(|c| {
            let id = c.container_id.as_deref()?;
            let id = id.split_once("://").map_or(id, |(_, id)| id);
            (!id.is_empty()).then(|| (id.to_string(), c.name.clone()))
        })
        .collect();
    out.sort();
    out
}

#[derive(Debug, Default)]
struct Inner {
    /// The PriorityClass mapping (`--offline-priority-class`, `--offline-priority-below`).
    mapping: PriorityMapping,
    index: RwLock<HashMap<String, PodEntry>>,
    /// UIDs of the pods seen offline (until they are deleted).
    offline_seen: RwLock<HashSet<String>>,
    ready: AtomicBool,
    generation: AtomicU64,
}

/// The Kubernetes pod source (cheap to clone).
#[derive(Debug, Clone, Default)]
pub struct KubeSource {
    inner: Arc<Inner>,
    changed: Option<tokio::sync::watch::Sender<u64>>,
}

impl KubeSource {
    /// Starts watching the pods of `node` on the current tokio runtime.
    pub fn start(client: Client, node: &str) -> KubeSource {
        KubeSource::start_with(client, node, PriorityMapping::default())
    }

    /// Starts watching the pods of `node`, classifying them with `mapping`'s priority
    /// classes and threshold besides Koordinator's.
    pub fn start_with(client: Client, node: &str, mapping: PriorityMapping) -> KubeSource {
        let (tx, _) = tokio::sync::watch::channel(0);
        let src = KubeSource {
            inner: Arc::new(Inner {
                mapping,
                ..Inner::default()
            }),
            changed: Some(tx),
        };
        let api: Api<Pod> = Api::all(client);
        let cfg = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
        let me = src.clone();
        let node = node.to_string();
        tokio::spawn(async move { me.run(api, cfg, node).await });
        src
    }

    /// Notified with the new generation on every relevant change.
    pub fn subscribe(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.changed.as_ref().map(|t| t.subscribe())
    }

    /// Number of pods known.
    pub fn len(&self) -> usize {
        self.inner.index.read().map(|i| i.len()).unwrap_or(0)
    }

    /// True when no pod is known.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The entry of a pod UID.
    pub fn get(&self, uid: &str) -> Option<PodEntry> {
        self.inner.index.read().ok()?.get(uid).cloned()
    }

    /// The UID of the pod `namespace/name`, if it is on this node.
    pub fn uid_of(&self, owner: &str) -> Option<String> {
        let index = self.inner.index.read().ok()?;
        index
            .iter()
            .find(|(_, e)| e.owner == owner)
            .map(|(uid, _)| uid.clone())
    }

    fn bump(&self) {
        let g = self.inner.generation.fetch_add(1, Ordering::SeqCst) + 1;
        if let Some(tx) = &self.changed {
            tx.send_replace(g);
        }
    }

    fn entry(&self, pod: &Pod) -> Option<(String, PodEntry)> {
        let uid = pod.metadata.uid.clone()?;
        let (mut e, warning) = PodEntry::from_pod(pod, &self.inner.mapping);
        if let Some(w) = warning {
            warn!(pod = %e.owner, "{w}");
            metrics::counter!("coloc_unknown_qos_level_total").increment(1);
        }
        let Ok(mut seen) = self.inner.offline_seen.write() else {
            return Some((uid, e));
        };
        if e.class == Class::Offline {
            seen.insert(uid.clone());
        } else if seen.contains(&uid) {
            warn!(pod = %e.owner, to = %e.class, "A pod seen offline asks to be online: refused, it stays offline (a pod's class is fixed once it was offline)");
            metrics::counter!("coloc_pod_class_change_refused_total").increment(1);
            e.class = Class::Offline;
            e.share = Share::Burst;
        }
        Some((uid, e))
    }

    async fn run(self, api: Api<Pod>, cfg: watcher::Config, node: String) {
        let mut stream = watcher::watcher(api, cfg).default_backoff().boxed();
        let mut relist: Option<HashMap<String, PodEntry>> = None;
        while let Some(ev) = stream.next().await {
            match ev {
                Ok(Event::Init) => relist = Some(HashMap::new()),
                Ok(Event::InitApply(pod)) => {
                    if let (Some(buf), Some((uid, e))) = (relist.as_mut(), self.entry(&pod)) {
                        buf.insert(uid, e);
                    }
                }
                Ok(Event::InitDone) => {
                    let new = relist.take().unwrap_or_default();
                    let count = new.len();
                    if let Ok(mut seen) = self.inner.offline_seen.write() {
                        seen.retain(|uid| new.contains_key(uid));
                    }
                    let changed = match self.inner.index.write() {
                        Ok(mut idx) => {
                            let changed = *idx != new;
                            *idx = new;
                            changed
                        }
                        Err(_) => false,
                    };
                    let first = !self.inner.ready.swap(true, Ordering::SeqCst);
                    if changed || first {
                        self.bump();
                    }
                    info!(node = %node, pods = count, "Pod list synced");
                }
                Ok(Event::Apply(pod)) => {
                    let Some((uid, e)) = self.entry(&pod) else {
                        continue;
                    };
                    let old = self
                        .inner
                        .index
                        .write()
                        .ok()
                        .and_then(|mut i| i.insert(uid, e.clone()));
                    match old {
                        Some(o) if o == e => {}
                        // Its containers started or restarted: names for /metrics.
                        Some(o) if o.class == e.class => self.bump(),
                        Some(o) => {
                            info!(pod = %e.owner, from = %o.class, to = %e.class, "Pod changed class");
                            self.bump();
                        }
                        None => self.bump(),
                    }
                }
                Ok(Event::Delete(pod)) => {
                    if let Some(uid) = &pod.metadata.uid {
                        if let Ok(mut seen) = self.inner.offline_seen.write() {
                            seen.remove(uid);
                        }
                        let gone = self
                            .inner
                            .index
                            .write()
                            .ok()
                            .and_then(|mut i| i.remove(uid));
                        if let Some(e) = gone {
                            info!(pod = %e.owner, class = %e.class, "Pod deleted");
                            self.bump();
                        }
                    }
                }
                Err(err) => {
                    metrics::counter!("coloc_pod_watch_errors_total").increment(1);
                    warn!(%err, "Pod watch failed: keeping the last known pods, retrying with backoff");
                }
            }
        }
    }
}

impl PodSource for KubeSource {
    fn classify(&self, p: &ProcInfo) -> Classified {
        // The v2 path first (pure v2 and hybrid nodes), then any v1 hierarchy.
        let found = p
            .cgroups
            .v2
            .as_deref()
            .and_then(|path| super::podref::parse(path).map(|pc| (pc, path.to_string(), true)))
            .or_else(|| {
                let path = p.cgroups.v1.get("freezer")?;
                super::podref::parse(path).map(|pc| (pc, path.clone(), false))
            })
            .or_else(|| {
                p.cgroups.paths().find_map(|path| {
                    super::podref::parse(path).map(|pc| (pc, path.to_string(), false))
                })
            });
        let Some((pc, path, _)) = found else {
            return Classified::unmanaged(Class::Unmanaged);
        };
        match self.get(&pc.uid) {
            Some(e) => Classified {
                class: e.class,
                share: e.share,
                owner: e.owner,
                // The container's own cgroup: every process in it belongs to this pod.
                freeze_cgroup: Some(path),
                checkpoint: e.checkpoint,
                shim: Some(e.shim),
                container: pc.container.as_deref().and_then(|id| {
                    e.containers
                        .iter()
                        .find(|(cid, _)| cid == id)
                        .map(|(_, name)| name.clone())
                }),
            },
            None => Classified {
                owner: format!("pod-uid:{}", pc.uid),
                ..Classified::unmanaged(Class::Unmanaged)
            },
        }
    }

    fn ready(&self) -> bool {
        self.inner.ready.load(Ordering::SeqCst)
    }

    fn pod_uids(&self) -> Option<Vec<String>> {
        Some(
            self.inner
                .index
                .read()
                .map(|i| i.keys().cloned().collect())
                .unwrap_or_default(),
        )
    }

    fn pod_gone(&self, uid: &str) -> bool {
        self.ready()
            && self
                .inner
                .index
                .read()
                .map(|i| !i.contains_key(uid))
                .unwrap_or(false)
    }

    fn generation(&self) -> u64 {
        self.inner.generation.load(Ordering::SeqCst)
    }

    fn whole_cgroups(&self) -> bool {
        // The container's cgroup holds that container's processes only.
        true
    }
}

#[cfg(test)]
mod checkpoint_word_tests {
    use super::checkpoint_word;

    #[test]
    fn only_true_and_false_say_anything() {
        for (v, want) in [
            ("true", Some(true)),
            ("false", Some(false)),
            (" true\n", Some(true)),
            ("\tfalse ", Some(false)),
        ] {
            assert_eq!(checkpoint_word(v), want, "{v:?}");
        }
        for v in [
            "yes please",
            "TRUE",
            "True",
            "FALSE",
            "",
            " ",
            "1",
            "0",
            "yes",
            "no",
            "on",
            "truee",
            "\"true\"",
            "true,false",
            "t rue",
        ] {
            assert_eq!(checkpoint_word(v), None, "{v:?} says something");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(v: serde_json::Value) -> Pod {
        serde_json::from_value(v).unwrap()
    }

    /// `--offline-priority-class` and `--offline-priority-below` read what a pod cannot
    /// change (its class name, and the priority the API server set from it), whatever its
    /// annotations say; the webhook's notes on the shim are read, never decide.
    #[test]
    fn the_priority_mapping_and_the_shim_notes() {
        let map = PriorityMapping {
            offline_classes: vec!["batch-low".into()],
            offline_below: Some(1000),
        };
        let p = |pc: &str, prio: i32, ann: serde_json::Value| {
            pod(serde_json::json!({
                "metadata": {"name": "p", "namespace": "ml", "uid": "u", "annotations": ann},
                "spec": {"containers": [{"name": "main"}], "priorityClassName": pc, "priority": prio}
            }))
        };
        let online = serde_json::json!({"katalyst.kubewharf.io/qos_level": "shared_cores",
            "gpu-coloc.dev/class": "online"});
        let (e, _) = PodEntry::from_pod(&p("batch-low", 5000, online.clone()), &map);
        assert_eq!(e.class, Class::Offline);
        let (e, _) = PodEntry::from_pod(&p("cheap", 10, online.clone()), &map);
        assert_eq!(e.class, Class::Offline);
        let (e, _) =
            PodEntry::from_pod(&p("cheap", 10, online.clone()), &PriorityMapping::default());
        assert_eq!(e.class, Class::Online, "without the flags");
        let (e, _) = PodEntry::from_pod(&p("prod", 100000, online), &map);
        assert_eq!((e.class, e.shim), (Class::Online, ShimNote::NotInjected));
        let (e, _) = PodEntry::from_pod(
            &p(
                "prod",
                100000,
                serde_json::json!({"gpu-coloc.dev/shim-injected": "main"}),
            ),
            &map,
        );
        assert_eq!(e.shim, ShimNote::Injected);
        let (e, _) = PodEntry::from_pod(
            &p(
                "prod",
                100000,
                serde_json::json!({"gpu-coloc.dev/shim": "disabled"}),
            ),
            &map,
        );
        assert_eq!(e.shim, ShimNote::OptedOut);
    }

    /// A process's container is named from its pod's statuses by the ID in its cgroup
    /// path (any runtime's scheme); a container the statuses do not list yet is unnamed.
    #[test]
    fn the_container_is_named_from_the_pods_statuses() {
        use crate::edges::procfs::{Cgroups, ProcKey};
        let p = pod(serde_json::json!({
            "metadata": {"name": "web-0", "namespace": "serving", "uid": "0f2c7a54-9a3b-4c1e-8d2f-6b5a4c3d2e1f"},
            "spec": {"containers": [{"name": "main"}, {"name": "side"}]},
            "status": {
                "containerStatuses": [
                    {"name": "main", "containerID": "containerd://3d8fa1b2c3", "image": "i", "imageID": "", "ready": true, "restartCount": 0},
                    {"name": "side", "containerID": "cri-o://77aa", "image": "i", "imageID": "", "ready": true, "restartCount": 0}
                ],
                "initContainerStatuses": [
                    {"name": "setup", "image": "i", "imageID": "", "ready": false, "restartCount": 0}
                ]
            }
        }));
        let (e, _) = PodEntry::from_pod(&p, &PriorityMapping::default());
        assert_eq!(
            e.containers,
            [
                ("3d8fa1b2c3".to_string(), "main".to_string()),
                ("77aa".into(), "side".into())
            ]
        );
        let src = KubeSource {
            inner: Arc::new(Inner::default()),
            changed: None,
        };
        src.inner
            .index
            .write()
            .unwrap()
            .insert("0f2c7a54-9a3b-4c1e-8d2f-6b5a4c3d2e1f".into(), e);
        let of = |container: &str| {
            src.classify(&ProcInfo {
                key: ProcKey { pid: 1, start: 1 },
                uid: 0,
                exe: None,
                cmdline: String::new(),
                cgroups: Cgroups::parse(&format!("0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0f2c7a54_9a3b_4c1e_8d2f_6b5a4c3d2e1f.slice/{container}\n")),
                ns_pid: None,
            })
        };
        let c = of("cri-containerd-3d8fa1b2c3.scope");
        assert_eq!(
            (c.owner.as_str(), c.container.as_deref()),
            ("serving/web-0", Some("main"))
        );
        assert_eq!(of("crio-77aa.scope").container.as_deref(), Some("side"));
        assert_eq!(
            of("cri-containerd-ffff.scope").container,
            None,
            "not in the statuses yet"
        );
    }
}
