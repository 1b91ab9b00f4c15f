//! Classification of a pod by the `katalyst.kubewharf.io/qos_level` annotation.
//!
//! The table in DESIGN.md is the contract; [`classify`] implements it exactly:
//!
//! | value                  | class                  |
//! |------------------------|------------------------|
//! | `shared_cores`, absent | [`Class::Online`]      |
//! | `dedicated_cores`      | [`Class::OnlineExclusive`] |
//! | `reclaimed_cores`      | [`Class::Offline`]     |
//! | `system_cores`         | [`Class::System`]      |
//! | anything else          | [`Class::Online`] plus a warning |
//!
//! A GPU process that belongs to no known pod is [`Class::Unmanaged`]; that class never
//! comes from an annotation.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The pod annotation that carries the QoS level.
pub const QOS_LEVEL_ANNOTATION: &str = "katalyst.kubewharf.io/qos_level";

/// What gpu-coloc does with a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Class {
    /// Latency-sensitive work (`shared_cores`): never suspended, counts as online demand.
    Online,
    /// Exclusive online work (`dedicated_cores`): never suspended, counts as online demand.
    OnlineExclusive,
    /// Offline work (`reclaimed_cores`): suspended while online on the same GPU is busy.
    Offline,
    /// System work (`system_cores`): never suspended, not online demand.
    System,
    /// A GPU process that belongs to no known pod or rule: never suspended; counts as
    /// online demand unless configured otherwise.
    Unmanaged,
}

impl Class {
    /// Whether activity of this class makes a GPU busy.
    pub fn is_online_demand(self, unmanaged_is_online: bool) -> bool {
        match self {
            Class::Online | Class::OnlineExclusive => true,
            Class::Unmanaged => unmanaged_is_online,
            Class::Offline | Class::System => false,
        }
    }

    /// The safety rule: only a process positively identified as offline is ever touched.
    pub fn is_suspendable(self) -> bool {
        self == Class::Offline
    }

    /// Short, bounded name (also used as a metric label value).
    pub fn as_str(self) -> &'static str {
        match self {
            Class::Online => "online",
            Class::OnlineExclusive => "online_exclusive",
            Class::Offline => "offline",
            Class::System => "system",
            Class::Unmanaged => "unmanaged",
        }
    }

    /// Parses a class as written in configuration: either a class name (`online`,
    /// `offline`, `system`, `unmanaged`, `online_exclusive`) or a `qos_level` value
    /// (`shared_cores`, `dedicated_cores`, `reclaimed_cores`, `system_cores`). Unlike
    /// [`classify`], an unknown value is an error: configuration must be exact.
    pub fn parse_config(s: &str) -> Option<Class> {
        Some(match s {
            "online" | "shared_cores" => Class::Online,
            "online_exclusive" | "dedicated_cores" => Class::OnlineExclusive,
            "offline" | "reclaimed_cores" => Class::Offline,
            "system" | "system_cores" => Class::System,
            "unmanaged" => Class::Unmanaged,
            _ => return None,
        })
    }
}

impl fmt::Display for Class {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The annotation's value, as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QosLevel {
    /// `shared_cores`
    SharedCores,
    /// `dedicated_cores`
    DedicatedCores,
    /// `reclaimed_cores`
    ReclaimedCores,
    /// `system_cores`
    SystemCores,
    /// The annotation is absent.
    Missing,
    /// Any other value (kept for the warning).
    Unknown(String),
}

impl QosLevel {
    /// Reads the annotation value (`None` when the annotation is absent). Values are
    /// matched exactly, as katalyst does; surrounding whitespace is ignored.
    pub fn parse(value: Option<&str>) -> QosLevel {
        match value.map(str::trim) {
            None => QosLevel::Missing,
            Some("shared_cores") => QosLevel::SharedCores,
            Some("dedicated_cores") => QosLevel::DedicatedCores,
            Some("reclaimed_cores") => QosLevel::ReclaimedCores,
            Some("system_cores") => QosLevel::SystemCores,
            Some(other) => QosLevel::Unknown(other.to_string()),
        }
    }

    /// The annotation value this level is written as (`None` for missing).
    pub fn as_annotation(&self) -> Option<&str> {
        match self {
            QosLevel::SharedCores => Some("shared_cores"),
            QosLevel::DedicatedCores => Some("dedicated_cores"),
            QosLevel::ReclaimedCores => Some("reclaimed_cores"),
            QosLevel::SystemCores => Some("system_cores"),
            QosLevel::Missing => None,
            QosLevel::Unknown(s) => Some(s),
        }
    }
}

/// The result of classifying a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Classification {
    /// What the agent does with the pod's processes.
    pub class: Class,
    /// The annotation as read.
    pub level: QosLevel,
    /// Set for an unknown value: the pod is treated as online, and the caller should log
    /// this and count it (`coloc_unknown_qos_level_total`).
    pub warning: Option<String>,
}

/// Classifies a pod by the value of its `katalyst.kubewharf.io/qos_level` annotation
/// (`None` when absent). Never fails: an unknown value is online, with a warning.
pub fn classify(annotation: Option<&str>) -> Classification {
    let level = QosLevel::parse(annotation);
    let (class, warning) = match &level {
        QosLevel::SharedCores | QosLevel::Missing => (Class::Online, None),
        QosLevel::DedicatedCores => (Class::OnlineExclusive, None),
        QosLevel::ReclaimedCores => (Class::Offline, None),
        QosLevel::SystemCores => (Class::System, None),
        QosLevel::Unknown(v) => (
            Class::Online,
            Some(format!(
                "unknown {QOS_LEVEL_ANNOTATION} value {v:?}: treated as online \
                 (expected shared_cores, dedicated_cores, reclaimed_cores or system_cores)"
            )),
        ),
    };
    Classification {
        class,
        level,
        warning,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn design_table() {
        let cases = [
            (Some("shared_cores"), Class::Online, false),
            (None, Class::Online, false),
            (Some("dedicated_cores"), Class::OnlineExclusive, false),
            (Some("reclaimed_cores"), Class::Offline, false),
            (Some("system_cores"), Class::System, false),
            (Some("reclaimed"), Class::Online, true),
            (Some(""), Class::Online, true),
            (Some("Reclaimed_Cores"), Class::Online, true),
        ];
        for (value, class, warns) in cases {
            let c = classify(value);
            assert_eq!(c.class, class, "{value:?}");
            assert_eq!(c.warning.is_some(), warns, "{value:?}");
        }
    }

    #[test]
    fn only_offline_is_suspendable_and_not_demand() {
        for class in [
            Class::Online,
            Class::OnlineExclusive,
            Class::Offline,
            Class::System,
            Class::Unmanaged,
        ] {
            assert_eq!(class.is_suspendable(), class == Class::Offline);
            if class == Class::Offline || class == Class::System {
                assert!(!class.is_online_demand(true));
            }
        }
        assert!(Class::Unmanaged.is_online_demand(true));
        assert!(!Class::Unmanaged.is_online_demand(false));
    }

    #[test]
    fn warning_names_the_value() {
        let w = classify(Some("batch")).warning.unwrap();
        assert!(w.contains("\"batch\""), "{w}");
    }

    #[test]
    fn config_names() {
        assert_eq!(Class::parse_config("reclaimed_cores"), Some(Class::Offline));
        assert_eq!(Class::parse_config("offline"), Some(Class::Offline));
        assert_eq!(Class::parse_config("offlin"), None);
    }
}
