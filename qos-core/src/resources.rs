//! Parsing and validation of the mGPU requests, shared by the agent and the webhook.
//!
//! - `vke.volcengine.com/mgpu-core` — online compute, percent of one GPU.
//! - `vke.volcengine.com/reclaimed-mgpu-core` — offline compute, same units.
//! - `vke.volcengine.com/mgpu-memory` — GPU memory in MiB.
//! - annotation `vke.volcengine.com/mgpu-compute-policy` — [`ComputePolicy`].
//!
//! Core values are 1–100 (a share of one GPU) or a multiple of 100 (whole GPUs). Every
//! error names the resource, the bad value and what is allowed.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Online compute request (percent of one GPU).
pub const MGPU_CORE: &str = "vke.volcengine.com/mgpu-core";
/// Offline compute request (percent of one GPU).
pub const RECLAIMED_MGPU_CORE: &str = "vke.volcengine.com/reclaimed-mgpu-core";
/// GPU memory request in MiB.
pub const MGPU_MEMORY: &str = "vke.volcengine.com/mgpu-memory";
/// Compute-policy annotation.
pub const COMPUTE_POLICY_ANNOTATION: &str = "vke.volcengine.com/mgpu-compute-policy";
/// Largest core value accepted (64 whole GPUs), to keep arithmetic bounded.
pub const MAX_CORE: u32 = 6400;
/// Largest memory value accepted, in MiB (16 TiB).
pub const MAX_MEMORY_MIB: u64 = 16 * 1024 * 1024;

/// Errors from parsing a request. Each names the resource and the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResourceError {
    /// Not a plain non-negative integer.
    #[error("{resource}: {value:?} is not a whole number ({reason}); allowed: {allowed}")]
    Malformed {
        /// The resource or annotation name.
        resource: &'static str,
        /// The value as given.
        value: String,
        /// What is wrong with it.
        reason: &'static str,
        /// What would be accepted.
        allowed: &'static str,
    },
    /// A number outside the allowed range.
    #[error("{resource}: {value} is out of range; allowed: {allowed}")]
    OutOfRange {
        /// The resource or annotation name.
        resource: &'static str,
        /// The value as given.
        value: String,
        /// What would be accepted.
        allowed: &'static str,
    },
    /// An unknown compute policy.
    #[error(
        "{COMPUTE_POLICY_ANNOTATION}: {value:?} is not a compute policy; allowed: \
         fixed-share, guaranteed-burst-share, native-burst-share"
    )]
    UnknownPolicy {
        /// The value as given.
        value: String,
    },
}

/// Short, bounded name of the error kind (metric label).
impl ResourceError {
    /// A bounded label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            ResourceError::Malformed { .. } => "malformed",
            ResourceError::OutOfRange { .. } => "out_of_range",
            ResourceError::UnknownPolicy { .. } => "unknown_policy",
        }
    }
}

const CORE_ALLOWED: &str = "1-100 (percent of one GPU) or a multiple of 100 (whole GPUs)";
const MEMORY_ALLOWED: &str = "a whole number of MiB, at least 1";

/// Parses a Kubernetes quantity that must be a plain integer. Kubernetes canonicalises
/// quantities, so `"50"` arrives as `"50"`; a suffixed form (`"1k"`) is accepted only when
/// it is a whole number, and fractions (`"0.5"`, `"500m"`) are rejected.
fn parse_integer_quantity(
    resource: &'static str,
    value: &str,
    allowed: &'static str,
) -> Result<u64, ResourceError> {
    let malformed = |reason| ResourceError::Malformed {
        resource,
        value: value.to_string(),
        reason,
        allowed,
    };
    let v = value.trim();
    if v.is_empty() {
        return Err(malformed("empty"));
    }
    let digits_end = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
    let (digits, suffix) = v.split_at(digits_end);
    if digits.is_empty() {
        return Err(malformed(if v.starts_with('-') {
            "negative"
        } else {
            "no digits"
        }));
    }
    let multiplier: u64 = match suffix {
        "" => 1,
        "k" => 1_000,
        "M" => 1_000_000,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        _ if suffix.starts_with('.') => return Err(malformed("fractions are not allowed")),
        "m" | "u" | "n" => return Err(malformed("fractions are not allowed")),
        _ => return Err(malformed("unknown suffix")),
    };
    let n: u64 = digits.parse().map_err(|_| malformed("too large"))?;
    n.checked_mul(multiplier)
        .ok_or_else(|| malformed("too large"))
}

/// A compute request in percent of one GPU (`mgpu-core` or `reclaimed-mgpu-core`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CorePercent(pub u32);

impl CorePercent {
    /// Parses and validates a core request for `resource` (one of [`MGPU_CORE`],
    /// [`RECLAIMED_MGPU_CORE`]). `"0"` is out of range: omit the resource instead.
    pub fn parse(resource: &'static str, value: &str) -> Result<CorePercent, ResourceError> {
        let n = parse_integer_quantity(resource, value, CORE_ALLOWED)?;
        let ok = (1..=100).contains(&n) || (n.is_multiple_of(100) && n <= MAX_CORE as u64 && n > 0);
        if !ok {
            return Err(ResourceError::OutOfRange {
                resource,
                value: value.trim().to_string(),
                allowed: CORE_ALLOWED,
            });
        }
        Ok(CorePercent(n as u32))
    }

    /// Whole GPUs this request needs (at least 1).
    pub fn gpus(self) -> u32 {
        self.0.div_ceil(100).max(1)
    }

    /// The share of one GPU (percent), capped at 100.
    pub fn percent_of_one(self) -> u32 {
        self.0.min(100)
    }
}

/// Parses and validates `mgpu-memory` (MiB).
pub fn parse_memory_mib(value: &str) -> Result<u64, ResourceError> {
    let n = parse_integer_quantity(MGPU_MEMORY, value, MEMORY_ALLOWED)?;
    if n == 0 || n > MAX_MEMORY_MIB {
        return Err(ResourceError::OutOfRange {
            resource: MGPU_MEMORY,
            value: value.trim().to_string(),
            allowed: MEMORY_ALLOWED,
        });
    }
    Ok(n)
}

/// The `vke.volcengine.com/mgpu-compute-policy` annotation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ComputePolicy {
    /// Capped to the requested percent of wall time (a duty cycle for offline pods).
    FixedShare,
    /// Guaranteed share, may use all idle time. The default.
    #[default]
    GuaranteedBurstShare,
    /// The driver's own burst sharing: not supported for co-located offline pods.
    NativeBurstShare,
}

impl ComputePolicy {
    /// The annotation value.
    pub fn as_str(self) -> &'static str {
        match self {
            ComputePolicy::FixedShare => "fixed-share",
            ComputePolicy::GuaranteedBurstShare => "guaranteed-burst-share",
            ComputePolicy::NativeBurstShare => "native-burst-share",
        }
    }

    /// Reads the annotation (`None` when absent → the default).
    pub fn from_annotation(value: Option<&str>) -> Result<ComputePolicy, ResourceError> {
        value.map_or(Ok(ComputePolicy::default()), str::parse)
    }

    /// Whether an offline (reclaimed) pod may use this policy.
    pub fn allowed_for_offline(self) -> bool {
        self != ComputePolicy::NativeBurstShare
    }
}

impl FromStr for ComputePolicy {
    type Err = ResourceError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "fixed-share" => Ok(ComputePolicy::FixedShare),
            "guaranteed-burst-share" => Ok(ComputePolicy::GuaranteedBurstShare),
            "native-burst-share" => Ok(ComputePolicy::NativeBurstShare),
            other => Err(ResourceError::UnknownPolicy {
                value: other.to_string(),
            }),
        }
    }
}

impl fmt::Display for ComputePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cores_in_range() {
        for (v, want) in [
            ("1", 1),
            ("50", 50),
            ("100", 100),
            ("200", 200),
            (" 30 ", 30),
        ] {
            assert_eq!(CorePercent::parse(MGPU_CORE, v).unwrap().0, want, "{v}");
        }
        assert_eq!(CorePercent(250 / 50 * 50).gpus(), 3);
        assert_eq!(CorePercent(30).gpus(), 1);
    }

    #[test]
    fn cores_rejected_with_names() {
        for v in [
            "0",
            "101",
            "150",
            "6500",
            "-5",
            "0.5",
            "500m",
            "abc",
            "",
            "10x",
            "99999999999999999999999",
        ] {
            let e = CorePercent::parse(RECLAIMED_MGPU_CORE, v).unwrap_err();
            let msg = e.to_string();
            assert!(msg.contains(RECLAIMED_MGPU_CORE), "{msg}");
            assert!(msg.contains("allowed"), "{msg}");
            // The message names the bad input as given: quoted when malformed (so an empty
            // value shows as `""`), plain when it is a number out of range.
            let named = msg.starts_with(&format!("{RECLAIMED_MGPU_CORE}: {:?} is not", v.trim()))
                || msg.starts_with(&format!(
                    "{RECLAIMED_MGPU_CORE}: {} is out of range",
                    v.trim()
                ));
            assert!(named, "{msg} should name {v:?}");
        }
    }

    #[test]
    fn memory() {
        assert_eq!(parse_memory_mib("1024").unwrap(), 1024);
        assert_eq!(parse_memory_mib("1k").unwrap(), 1000);
        assert!(parse_memory_mib("0").is_err());
        assert!(parse_memory_mib("1.5")
            .unwrap_err()
            .to_string()
            .contains(MGPU_MEMORY));
    }

    #[test]
    fn policy() {
        assert_eq!(
            ComputePolicy::from_annotation(None).unwrap(),
            ComputePolicy::GuaranteedBurstShare
        );
        assert_eq!(
            ComputePolicy::from_annotation(Some("fixed-share")).unwrap(),
            ComputePolicy::FixedShare
        );
        let e = ComputePolicy::from_annotation(Some("burst")).unwrap_err();
        assert!(e.to_string().contains("\"burst\""));
        assert!(!ComputePolicy::NativeBurstShare.allowed_for_offline());
    }
}
