//! Classification of a whole pod, in every vocabulary gpu-coloc reads, with the rule that
//! what a pod cannot change after admission decides first.
//!
//! ```text
//!  immutable (the API server refuses changes after creation)     mutable (the tenant's)
//!  ─────────────────────────────────────────────────────────     ──────────────────────
//!  extended resources a container asks for                       annotation katalyst.kubewharf.io/qos_level
//!    vke.volcengine.com/reclaimed-mgpu-core                      annotation gpu-coloc.dev/class
//!    resource.katalyst.kubewharf.io/reclaimed_millicpu|_memory   label koordinator.sh/qosClass
//!    kubernetes.io/batch-cpu|batch-memory   (Koordinator)
//!    nvidia.com/priority = 1                (HAMi: low priority)
//!  spec.priorityClassName koord-batch, koord-free, or configured
//!  spec.priority below a configured value
//!          │                                                             │
//!          └── any of these says offline ──► Offline        all that speak agree ──► their class
//!                                                           one offline, one not ──► Online + warning
//!                                                           none speaks          ──► Online
//! ```
//!
//! **Immutable offline wins.** A pod whose immutable fields say offline is offline whatever
//! its annotations and labels say: a pod that could make itself online would never be
//! suspended and would suspend others. The immutable evidence makes the class right even
//! for a pod whose annotation or label was changed before the agent first saw it; the agent
//! also keeps a pod it has seen offline offline until the pod is deleted
//! (`agent/src/edges/source/kube.rs`).
//!
//! **Disagreement is online.** Where the mutable vocabularies disagree (one says offline,
//! another online or system), the pod is online, never suspended, and the warning names
//! both: only a pod positively identified as offline is ever touched.
//!
//! Extended resources (everything but `cpu`, `memory`, `hugepages-*` and
//! `ephemeral-storage`) cannot be resized in place, and `spec.priorityClassName` and
//! `spec.priority` cannot be changed after creation: that is why they are trusted. Labels
//! and annotations can be changed by whoever may update the pod.

use crate::class::{classify, Class, QOS_LEVEL_ANNOTATION};
use crate::resources::RECLAIMED_MGPU_CORE;

/// Koordinator's QoS label (`LSE`, `LSR`, `LS`, `BE`, `SYSTEM`).
pub const KOORDINATOR_QOS_LABEL: &str = "koordinator.sh/qosClass";
/// Koordinator's priority classes of batch work (`koord-batch`, 5000–5999) and of free
/// resources (`koord-free`, 3000–3999): best effort.
pub const KOORDINATOR_OFFLINE_PRIORITY_CLASSES: [&str; 2] = ["koord-batch", "koord-free"];
/// Koordinator's batch (overcommitted) extended resources, asked for by `BE` pods.
pub const KOORDINATOR_BATCH_RESOURCES: [&str; 2] =
    ["kubernetes.io/batch-cpu", "kubernetes.io/batch-memory"];
/// Katalyst's reclaimed extended resources, asked for by `reclaimed_cores` pods.
pub const KATALYST_RECLAIMED_RESOURCES: [&str; 2] = [
    "resource.katalyst.kubewharf.io/reclaimed_millicpu",
    "resource.katalyst.kubewharf.io/reclaimed_memory",
];
/// HAMi's task priority resource: `0` high (online), `1` low (offline).
pub const HAMI_PRIORITY_RESOURCE: &str = "nvidia.com/priority";

/// Our own, neutral annotation: `online`, `offline` or `system` (mutable).
pub const COLOC_CLASS_ANNOTATION: &str = "gpu-coloc.dev/class";

/// Which priority classes are offline, beyond Koordinator's (`--offline-priority-class`,
/// `--offline-priority-below` on the agent; `[classes]` in the webhook's settings file).
/// Both read what a pod cannot change after creation: `spec.priorityClassName`, and
/// `spec.priority`, which the API server sets from the class at admission.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PriorityMapping {
    /// Priority classes whose pods are offline (besides `koord-batch` and `koord-free`).
    pub offline_classes: Vec<String>,
    /// Pods whose `spec.priority` is below this value are offline.
    pub offline_below: Option<i32>,
}

/// What decided a pod's class (for logs and `/state`; bounded).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Evidence {
    /// An extended resource a container asks for (immutable).
    Resource(&'static str),
    /// `spec.priorityClassName` (immutable).
    PriorityClass(String),
    /// `spec.priority` below the configured threshold (immutable).
    Priority(i32),
    /// The `katalyst.kubewharf.io/qos_level` annotation (mutable).
    QosLevel,
    /// The `koordinator.sh/qosClass` label (mutable).
    KoordinatorQos,
    /// The `gpu-coloc.dev/class` annotation (mutable).
    ColocClass,
    /// HAMi's `nvidia.com/priority: 0` (high priority).
    HamiPriority,
    /// Vocabularies disagreed: online, never suspended.
    Disagreement,
    /// Nothing said anything: online by default.
    Default,
}

impl Evidence {
    /// Whether the API server keeps this fixed for the pod's life.
    pub fn immutable(&self) -> bool {
        matches!(
            self,
            Evidence::Resource(_)
                | Evidence::PriorityClass(_)
                | Evidence::Priority(_)
                | Evidence::HamiPriority
        )
    }

    /// Whether some vocabulary named the class (not the default).
    pub fn explicit(&self) -> bool {
        !matches!(self, Evidence::Default)
    }
}

impl std::fmt::Display for Evidence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Evidence::Resource(r) => write!(f, "resource {r}"),
            Evidence::PriorityClass(p) => write!(f, "priorityClassName {p}"),
            Evidence::Priority(v) => write!(f, "priority {v}"),
            Evidence::QosLevel => write!(f, "annotation {QOS_LEVEL_ANNOTATION}"),
            Evidence::KoordinatorQos => write!(f, "label {KOORDINATOR_QOS_LABEL}"),
            Evidence::ColocClass => write!(f, "annotation {COLOC_CLASS_ANNOTATION}"),
            Evidence::HamiPriority => write!(f, "resource {HAMI_PRIORITY_RESOURCE}"),
            Evidence::Disagreement => f.write_str("disagreement"),
            Evidence::Default => f.write_str("default"),
        }
    }
}

/// What a pod says about its class. Built by the agent from the API server's pod and by
/// the webhook from the admission request; nothing here reads anything.
#[derive(Debug, Clone, Default)]
pub struct PodFacts<'a> {
    /// The `katalyst.kubewharf.io/qos_level` annotation.
    pub qos_level: Option<&'a str>,
    /// The `koordinator.sh/qosClass` label.
    pub koordinator_qos: Option<&'a str>,
    /// The `gpu-coloc.dev/class` annotation.
    pub coloc_class: Option<&'a str>,
    /// `spec.priorityClassName`.
    pub priority_class: Option<&'a str>,
    /// `spec.priority` (set by the API server from the priority class).
    pub priority: Option<i32>,
    /// Every resource a container or init container asks for, in `requests` or `limits`:
    /// (name, quantity as written).
    pub resources: Vec<(&'a str, &'a str)>,
}

/// The class of a pod and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodClassification {
    /// What the agent does with the pod's processes.
    pub class: Class,
    /// What decided it.
    pub evidence: Evidence,
    /// An unknown value was read (treated as online), or two vocabularies disagreed; the
    /// caller logs it and counts it (`coloc_unknown_qos_level_total`).
    pub warning: Option<String>,
}

/// The first immutable fact that makes the pod offline, if any (Koordinator's priority
/// classes only).
pub fn immutable_offline(f: &PodFacts) -> Option<Evidence> {
    immutable_offline_with(f, &PriorityMapping::default())
}

/// The first immutable fact that makes the pod offline, if any, with `map`'s priority
/// classes and threshold.
pub fn immutable_offline_with(f: &PodFacts, map: &PriorityMapping) -> Option<Evidence> {
    for (name, value) in &f.resources {
        let quantity_set = !value.trim().is_empty() && value.trim() != "0";
        let offline_resource = [RECLAIMED_MGPU_CORE]
            .iter()
            .chain(KATALYST_RECLAIMED_RESOURCES.iter())
            .chain(KOORDINATOR_BATCH_RESOURCES.iter())
            .find(|r| **r == *name);
        if let (Some(r), true) = (offline_resource, quantity_set) {
            return Some(Evidence::Resource(r));
        }
        if *name == HAMI_PRIORITY_RESOURCE && value.trim() == "1" {
            return Some(Evidence::Resource(HAMI_PRIORITY_RESOURCE));
        }
    }
    if let Some(pc) = f.priority_class.map(str::trim) {
        if KOORDINATOR_OFFLINE_PRIORITY_CLASSES.contains(&pc)
            || map.offline_classes.iter().any(|c| c == pc)
        {
            return Some(Evidence::PriorityClass(pc.to_string()));
        }
    }
    match (f.priority, map.offline_below) {
        (Some(p), Some(below)) if p < below => Some(Evidence::Priority(p)),
        _ => None,
    }
}

/// Koordinator's label as a class; `Err` with a warning for an unknown value.
fn koordinator(value: &str) -> Result<Class, String> {
    match value.trim() {
        "BE" => Ok(Class::Offline),
        "LS" => Ok(Class::Online),
        "LSR" | "LSE" => Ok(Class::OnlineExclusive),
        "SYSTEM" => Ok(Class::System),
        other => Err(format!(
            "unknown {KOORDINATOR_QOS_LABEL} value {other:?}: treated as online \
             (expected LSE, LSR, LS, BE or SYSTEM)"
        )),
    }
}

/// Our neutral annotation as a class; `Err` with a warning for an unknown value.
fn coloc_class(value: &str) -> Result<Class, String> {
    match value.trim() {
        "online" => Ok(Class::Online),
        "offline" => Ok(Class::Offline),
        "system" => Ok(Class::System),
        other => Err(format!(
            "unknown {COLOC_CLASS_ANNOTATION} value {other:?}: treated as online \
             (expected online, offline or system)"
        )),
    }
}

/// Classifies a pod (DESIGN.md, "Classification") with Koordinator's offline priority
/// classes only.
pub fn classify_pod(f: &PodFacts) -> PodClassification {
    classify_pod_with(f, &PriorityMapping::default())
}

/// Classifies a pod (DESIGN.md, "Classification"). Never fails: unknown values are
/// online, with a warning.
///
/// 1. What the pod cannot change after creation and says offline decides: an offline
///    resource, HAMi's `nvidia.com/priority: 1`, an offline priority class or a priority
///    below `map.offline_below`.
/// 2. Otherwise the mutable vocabularies vote (`qos_level`, `gpu-coloc.dev/class`,
///    Koordinator's label; HAMi's `nvidia.com/priority: 0` votes online). Where one says
///    offline and another says anything else, the pod is online (never suspended) and the
///    warning names both. Between online classes, the first in that order decides.
/// 3. Nothing said anything: online.
pub fn classify_pod_with(f: &PodFacts, map: &PriorityMapping) -> PodClassification {
    if let Some(evidence) = immutable_offline_with(f, map) {
        return PodClassification {
            class: Class::Offline,
            evidence,
            warning: None,
        };
    }
    let mut warning: Option<String> = None;
    let mut votes: Vec<(Class, Evidence, String)> = Vec::new();
    if let Some(v) = f.qos_level {
        let c = classify(Some(v));
        match c.warning {
            Some(w) => warning = Some(w),
            None => votes.push((
                c.class,
                Evidence::QosLevel,
                format!("{QOS_LEVEL_ANNOTATION}={}", v.trim()),
            )),
        }
    }
    for (value, read, evidence, name) in [
        (
            f.coloc_class,
            coloc_class as fn(&str) -> Result<Class, String>,
            Evidence::ColocClass,
            COLOC_CLASS_ANNOTATION,
        ),
        (
            f.koordinator_qos,
            koordinator,
            Evidence::KoordinatorQos,
            KOORDINATOR_QOS_LABEL,
        ),
    ] {
        match value.map(read) {
            Some(Ok(c)) => votes.push((
                c,
                evidence,
                format!("{name}={}", value.unwrap_or("").trim()),
            )),
            Some(Err(w)) => warning = warning.or(Some(w)),
            None => {}
        }
    }
    if f.resources
        .iter()
        .any(|(n, v)| *n == HAMI_PRIORITY_RESOURCE && v.trim() == "0")
    {
        votes.push((
            Class::Online,
            Evidence::HamiPriority,
            format!("{HAMI_PRIORITY_RESOURCE}=0"),
        ));
    }
    let offline = votes.iter().find(|v| v.0 == Class::Offline);
    let other = votes.iter().find(|v| v.0 != Class::Offline);
    if let (Some(off), Some(on)) = (offline, other) {
        return PodClassification {
            class: Class::Online,
            evidence: Evidence::Disagreement,
            warning: Some(format!(
                "{} says offline but {} says {}: treated as online (never suspended); make them agree",
                off.2, on.2, on.0
            )),
        };
    }
    let (class, evidence) = match votes.into_iter().next() {
        Some((c, e, _)) => (c, e),
        None if f.qos_level.is_some() => (Class::Online, Evidence::QosLevel),
        None if f.coloc_class.is_some() => (Class::Online, Evidence::ColocClass),
        None if f.koordinator_qos.is_some() => (Class::Online, Evidence::KoordinatorQos),
        None => (Class::Online, Evidence::Default),
    };
    PodClassification {
        class,
        evidence,
        warning,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts<'a>(
        qos: Option<&'a str>,
        koord: Option<&'a str>,
        pc: Option<&'a str>,
        res: &[(&'a str, &'a str)],
    ) -> PodFacts<'a> {
        PodFacts {
            qos_level: qos,
            koordinator_qos: koord,
            priority_class: pc,
            resources: res.to_vec(),
            ..PodFacts::default()
        }
    }

    /// The table in DESIGN.md §2, row by row.
    #[test]
    fn design_table() {
        let cases: &[(PodFacts, Class, bool)] = &[
            (facts(None, None, None, &[]), Class::Online, false),
            (
                facts(Some("reclaimed_cores"), None, None, &[]),
                Class::Offline,
                false,
            ),
            (
                facts(Some("dedicated_cores"), None, None, &[]),
                Class::OnlineExclusive,
                false,
            ),
            (
                facts(Some("system_cores"), None, None, &[]),
                Class::System,
                false,
            ),
            (facts(Some("batch"), None, None, &[]), Class::Online, true),
            (facts(None, Some("BE"), None, &[]), Class::Offline, false),
            (facts(None, Some("LS"), None, &[]), Class::Online, false),
            (
                facts(None, Some("LSR"), None, &[]),
                Class::OnlineExclusive,
                false,
            ),
            (
                facts(None, Some("LSE"), None, &[]),
                Class::OnlineExclusive,
                false,
            ),
            (facts(None, Some("SYSTEM"), None, &[]), Class::System, false),
            (facts(None, Some("be"), None, &[]), Class::Online, true),
            (
                facts(None, None, Some("koord-batch"), &[]),
                Class::Offline,
                false,
            ),
            (
                facts(None, None, Some("koord-free"), &[]),
                Class::Offline,
                false,
            ),
            (
                facts(None, None, Some("koord-prod"), &[]),
                Class::Online,
                false,
            ),
            (
                facts(None, None, None, &[("nvidia.com/priority", "1")]),
                Class::Offline,
                false,
            ),
            (
                facts(None, None, None, &[("nvidia.com/priority", "0")]),
                Class::Online,
                false,
            ),
            (
                facts(None, None, None, &[(RECLAIMED_MGPU_CORE, "30")]),
                Class::Offline,
                false,
            ),
            (
                facts(None, None, None, &[("kubernetes.io/batch-cpu", "2k")]),
                Class::Offline,
                false,
            ),
            (
                facts(
                    None,
                    None,
                    None,
                    &[("resource.katalyst.kubewharf.io/reclaimed_millicpu", "2000")],
                ),
                Class::Offline,
                false,
            ),
            (
                facts(None, None, None, &[("vke.volcengine.com/mgpu-core", "30")]),
                Class::Online,
                false,
            ),
        ];
        for (f, class, warns) in cases {
            let c = classify_pod(f);
            assert_eq!(c.class, *class, "{f:?}");
            assert_eq!(c.warning.is_some(), *warns, "{f:?}: {:?}", c.warning);
        }
    }

    /// The attack: a pod that asks for offline resources, or has an offline priority
    /// class, says online in every mutable place it has. It stays offline, and the
    /// evidence is the immutable field.
    #[test]
    fn immutable_offline_beats_every_mutable_online_claim() {
        type Resources<'a> = &'a [(&'a str, &'a str)];
        let immutable: &[(Resources, Option<&str>)] = &[
            (&[(RECLAIMED_MGPU_CORE, "50")], None),
            (
                &[("nvidia.com/gpu", "1"), ("nvidia.com/priority", "1")],
                None,
            ),
            (&[("kubernetes.io/batch-memory", "4Gi")], None),
            (
                &[("resource.katalyst.kubewharf.io/reclaimed_memory", "1Gi")],
                None,
            ),
            (&[], Some("koord-batch")),
        ];
        for (res, pc) in immutable {
            for qos in [
                None,
                Some("shared_cores"),
                Some("dedicated_cores"),
                Some("system_cores"),
            ] {
                for koord in [None, Some("LS"), Some("LSE"), Some("SYSTEM")] {
                    for ours in [None, Some("online"), Some("system")] {
                        let c = classify_pod(&PodFacts {
                            coloc_class: ours,
                            ..facts(qos, koord, *pc, res)
                        });
                        assert_eq!(
                            c.class,
                            Class::Offline,
                            "{res:?} {pc:?} {qos:?} {koord:?} {ours:?}"
                        );
                        assert!(c.evidence.immutable(), "{:?}", c.evidence);
                    }
                }
            }
        }
    }

    /// Mutable vocabularies that disagree about offline make the pod online (never
    /// suspended), with a warning that names both; agreeing ones decide.
    #[test]
    fn disagreement_is_online_and_named() {
        let c = classify_pod(&facts(Some("shared_cores"), Some("BE"), None, &[]));
        assert_eq!(
            (c.class, c.evidence.clone()),
            (Class::Online, Evidence::Disagreement)
        );
        let w = c.warning.unwrap();
        assert!(
            w.contains("koordinator.sh/qosClass=BE") && w.contains("qos_level=shared_cores"),
            "{w}"
        );
        let c = classify_pod(&facts(Some("reclaimed_cores"), Some("LS"), None, &[]));
        assert_eq!(c.class, Class::Online);
        let c = classify_pod(&PodFacts {
            coloc_class: Some("offline"),
            resources: vec![("nvidia.com/gpu", "1"), ("nvidia.com/priority", "0")],
            ..PodFacts::default()
        });
        assert_eq!(c.class, Class::Online);
        assert!(c.warning.unwrap().contains("nvidia.com/priority=0"));
        // Agreeing vocabularies decide.
        let c = classify_pod(&facts(Some("reclaimed_cores"), Some("BE"), None, &[]));
        assert_eq!((c.class, c.warning), (Class::Offline, None));
        // qos_level decides between the online classes when both are present.
        let c = classify_pod(&facts(Some("system_cores"), Some("LS"), None, &[]));
        assert_eq!(c.class, Class::System);
        // An unknown qos_level does not hide Koordinator's answer.
        let c = classify_pod(&facts(Some("bogus"), Some("LSR"), None, &[]));
        assert_eq!(c.class, Class::OnlineExclusive);
        assert!(c.warning.is_some());
    }

    /// Our neutral annotation, alone and with the others.
    #[test]
    fn neutral_annotation() {
        for (v, class, warns) in [
            ("offline", Class::Offline, false),
            ("online", Class::Online, false),
            ("system", Class::System, false),
            ("Offline", Class::Online, true),
            ("reclaimed_cores", Class::Online, true),
        ] {
            let c = classify_pod(&PodFacts {
                coloc_class: Some(v),
                ..PodFacts::default()
            });
            assert_eq!((c.class, c.warning.is_some()), (class, warns), "{v}");
        }
        let c = classify_pod(&PodFacts {
            coloc_class: Some("offline"),
            koordinator_qos: Some("BE"),
            qos_level: Some("reclaimed_cores"),
            ..PodFacts::default()
        });
        assert_eq!((c.class, c.evidence), (Class::Offline, Evidence::QosLevel));
    }

    /// The PriorityClass mapping: configured names and a value threshold, both immutable,
    /// both beating an online annotation.
    #[test]
    fn priority_mapping() {
        let map = PriorityMapping {
            offline_classes: vec!["batch-low".into()],
            offline_below: Some(1000),
        };
        let pod = |pc: Option<&'static str>, p: Option<i32>| PodFacts {
            priority_class: pc,
            priority: p,
            qos_level: Some("shared_cores"),
            ..PodFacts::default()
        };
        let c = classify_pod_with(&pod(Some("batch-low"), Some(5000)), &map);
        assert_eq!(
            (c.class, c.evidence),
            (Class::Offline, Evidence::PriorityClass("batch-low".into()))
        );
        let c = classify_pod_with(&pod(Some("whatever"), Some(999)), &map);
        assert_eq!(
            (c.class, c.evidence),
            (Class::Offline, Evidence::Priority(999))
        );
        assert!(Evidence::Priority(1).immutable());
        for (pc, p) in [
            (Some("whatever"), Some(1000)),
            (None, None),
            (Some("batch-low2"), Some(1000)),
        ] {
            assert_eq!(
                classify_pod_with(&pod(pc, p), &map).class,
                Class::Online,
                "{pc:?} {p:?}"
            );
        }
        // Without the mapping neither says anything.
        assert_eq!(
            classify_pod(&pod(Some("batch-low"), Some(0))).class,
            Class::Online
        );
    }

    /// A zero or empty quantity asks for nothing; HAMi's priority is exactly "1".
    #[test]
    fn zero_quantities_and_other_priorities_are_not_offline() {
        for res in [
            (RECLAIMED_MGPU_CORE, "0"),
            ("kubernetes.io/batch-cpu", ""),
            ("nvidia.com/priority", "0"),
            ("nvidia.com/priority", "2"),
        ] {
            assert_eq!(
                classify_pod(&facts(None, None, None, &[res])).class,
                Class::Online,
                "{res:?}"
            );
        }
    }
}
