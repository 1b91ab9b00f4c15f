//! Classification of a whole pod, in every vocabulary gpu-coloc reads, with the rule that
//! what a pod cannot change after admission decides first.
//!
//! ```text
//!  immutable (the API server refuses changes after creation)     mutable (the tenant's)
//!  ─────────────────────────────────────────────────────────     ──────────────────────
//!  extended resources a container asks for                       annotation katalyst.kubewharf.io/qos_level
//!    vke.volcengine.com/reclaimed-mgpu-core                      label koordinator.sh/qosClass
//!    resource.katalyst.kubewharf.io/reclaimed_millicpu|_memory
//!    kubernetes.io/batch-cpu|batch-memory   (Koordinator)
//!    nvidia.com/priority = 1                (HAMi: low priority)
//!  spec.priorityClassName koord-batch, koord-free (Koordinator)
//!          │                                                             │
//!          └──── any of these says offline ──► Offline ◄── or any says offline
//!                                                 otherwise: qos_level, else qosClass, else online
//! ```
//!
//! **Offline wins.** A pod is offline when anything it says, immutable or not, says offline:
//! offline only gives up protection, so a tenant gains nothing by claiming it, while a pod
//! that could make itself online would never be suspended and would suspend others. The
//! immutable evidence makes the class right even for a pod whose annotation or label was
//! changed before the agent first saw it; the agent also keeps a pod it has seen offline
//! offline until the pod is deleted (`agent/src/edges/source/kube.rs`).
//!
//! Extended resources (everything but `cpu`, `memory`, `hugepages-*` and
//! `ephemeral-storage`) cannot be resized in place, and `spec.priorityClassName` cannot be
//! changed after creation: that is why they are trusted. Labels and annotations can be
//! changed by whoever may update the pod.

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

/// What decided a pod's class (for logs and `/state`; bounded).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Evidence {
    /// An extended resource a container asks for (immutable).
    Resource(&'static str),
    /// `spec.priorityClassName` (immutable).
    PriorityClass(String),
    /// The `katalyst.kubewharf.io/qos_level` annotation (mutable).
    QosLevel,
    /// The `koordinator.sh/qosClass` label (mutable).
    KoordinatorQos,
    /// Nothing said anything: online by default.
    Default,
}

impl Evidence {
    /// Whether the API server keeps this fixed for the pod's life.
    pub fn immutable(&self) -> bool {
        matches!(self, Evidence::Resource(_) | Evidence::PriorityClass(_))
    }
}

impl std::fmt::Display for Evidence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Evidence::Resource(r) => write!(f, "resource {r}"),
            Evidence::PriorityClass(p) => write!(f, "priorityClassName {p}"),
            Evidence::QosLevel => write!(f, "annotation {QOS_LEVEL_ANNOTATION}"),
            Evidence::KoordinatorQos => write!(f, "label {KOORDINATOR_QOS_LABEL}"),
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
    /// `spec.priorityClassName`.
    pub priority_class: Option<&'a str>,
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
    /// An unknown value was read (treated as online); the caller logs it and counts it
    /// (`coloc_unknown_qos_level_total`).
    pub warning: Option<String>,
}

/// The first immutable fact that makes the pod offline, if any.
pub fn immutable_offline(f: &PodFacts) -> Option<Evidence> {
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
    let pc = f.priority_class.map(str::trim)?;
    KOORDINATOR_OFFLINE_PRIORITY_CLASSES
        .contains(&pc)
        .then(|| Evidence::PriorityClass(pc.to_string()))
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

/// Classifies a pod (DESIGN.md §2, "Classification"). Never fails: unknown values are
/// online, with a warning; anything that says offline makes the pod offline.
pub fn classify_pod(f: &PodFacts) -> PodClassification {
    if let Some(evidence) = immutable_offline(f) {
        return PodClassification {
            class: Class::Offline,
            evidence,
            warning: None,
        };
    }
    let katalyst = f.qos_level.map(|v| classify(Some(v)));
    let koord = f.koordinator_qos.map(koordinator);
    let mut warning = None;
    let mut decided: Option<(Class, Evidence)> = None;
    if let Some(c) = &katalyst {
        warning = c.warning.clone();
        if c.warning.is_none() {
            decided = Some((c.class, Evidence::QosLevel));
        }
    }
    match koord {
        Some(Ok(Class::Offline)) => decided = Some((Class::Offline, Evidence::KoordinatorQos)),
        Some(Ok(c)) if decided.is_none() => decided = Some((c, Evidence::KoordinatorQos)),
        Some(Err(w)) => warning = warning.or(Some(w)),
        _ => {}
    }
    let (class, evidence) = decided.unwrap_or(match katalyst {
        // Unknown qos_level: online, said by the annotation.
        Some(_) => (Class::Online, Evidence::QosLevel),
        None if f.koordinator_qos.is_some() => (Class::Online, Evidence::KoordinatorQos),
        None => (Class::Online, Evidence::Default),
    });
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
                    let c = classify_pod(&facts(qos, koord, *pc, res));
                    assert_eq!(c.class, Class::Offline, "{res:?} {pc:?} {qos:?} {koord:?}");
                    assert!(c.evidence.immutable(), "{:?}", c.evidence);
                }
            }
        }
    }

    /// Any mutable offline claim makes the pod offline too (it only gives up protection),
    /// whatever another vocabulary says.
    #[test]
    fn any_offline_claim_wins() {
        let c = classify_pod(&facts(Some("shared_cores"), Some("BE"), None, &[]));
        assert_eq!(
            (c.class, c.evidence),
            (Class::Offline, Evidence::KoordinatorQos)
        );
        let c = classify_pod(&facts(Some("reclaimed_cores"), Some("LS"), None, &[]));
        assert_eq!((c.class, c.evidence), (Class::Offline, Evidence::QosLevel));
        // qos_level decides between the online classes when both are present.
        let c = classify_pod(&facts(Some("system_cores"), Some("LS"), None, &[]));
        assert_eq!(c.class, Class::System);
        // An unknown qos_level does not hide Koordinator's answer.
        let c = classify_pod(&facts(Some("bogus"), Some("LSR"), None, &[]));
        assert_eq!(c.class, Class::OnlineExclusive);
        assert!(c.warning.is_some());
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
