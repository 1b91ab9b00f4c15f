//! The shim's environment, read once at the first submission.
//!
//! `COLOC_SHIM_CLASS` (`online`, `offline`; anything else: pass-through),
//! `COLOC_DOORBELL_DIR` (none: pass-through); online: `COLOC_SHIM_WAKE_GAP_MS`; offline:
//! `COLOC_SHIM_INFLIGHT`, `COLOC_SHIM_INFLIGHT_MS`, `COLOC_GATE_STALE_MS`,
//! `COLOC_GATE_FILE`. Only the variables of the process's class are read, so a value meant
//! for the other class never turns the shim off. Every millisecond value goes through
//! [`ms_to_ns`]: a decimal number of milliseconds (surrounding blanks allowed), finite,
//! never negative; a positive value is at least 1 ns, so that only 0 means 0.

use coloc_doorbell::gate::{DEFAULT_GATE_FILE, DEFAULT_STALE_NS};
use coloc_doorbell::{CLASS_OFFLINE, CLASS_ONLINE, DEFAULT_WAKE_GAP_NS};
use std::ffi::{CString, OsString};

/// Default ceiling on submissions in flight per stream (`COLOC_SHIM_INFLIGHT`): the budget
/// sets the bound; K only caps it where kernels are so short that the budget would let
/// hundreds in. See the crate docs for the measurement behind it.
pub const DEFAULT_INFLIGHT: u32 = 64;
/// Default in-flight budget per process and GPU, µs of estimated GPU time
/// (`COLOC_SHIM_INFLIGHT_MS` = 0.5; see the crate docs).
pub const DEFAULT_INFLIGHT_US: u64 = 500;

/// What the environment asks of the shim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// `CLASS_ONLINE` or `CLASS_OFFLINE`.
    pub class: u32,
    /// Where the page goes.
    pub doorbell_dir: OsString,
    /// Online: a launch this long after the previous one on a GPU wakes the agent.
    pub wake_gap_ns: u64,
    /// Offline: the launch gate's settings.
    pub gate: GateConfig,
}

/// The launch gate's settings (offline processes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GateConfig {
    /// K: submissions in flight per stream (0: unbounded).
    pub inflight: u32,
    /// The in-flight budget per stream, ns of estimated GPU time (0: none).
    pub budget_ns: u64,
    /// An agent heartbeat older than this opens the gate.
    pub stale_ns: u64,
    /// The agent's gate file.
    pub gate_file: CString,
}

impl Default for GateConfig {
    fn default() -> Self {
        GateConfig {
            inflight: DEFAULT_INFLIGHT,
            budget_ns: DEFAULT_INFLIGHT_US * 1_000,
            stale_ns: DEFAULT_STALE_NS,
            gate_file: CString::new(DEFAULT_GATE_FILE).expect("no NUL"),
        }
    }
}

/// Whether a millisecond value may be 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Zero {
    /// 0 means "none" (the budget).
    Allowed,
    /// The value must be positive.
    Refused,
}

/// `name=value`, a number of milliseconds, in ns (see the module doc); an error is the
/// line to print.
pub fn ms_to_ns(name: &str, value: &str, zero: Zero) -> Result<u64, String> {
    match value.trim().parse::<f64>() {
        Ok(ms) if ms.is_finite() && (ms > 0.0 || (ms == 0.0 && zero == Zero::Allowed)) => {
            Ok(((ms * 1e6) as u64).max(u64::from(ms > 0.0)))
        }
        _ => Err(match zero {
            Zero::Allowed => format!("{name}={value:?} is not a number of milliseconds (0: none)"),
            Zero::Refused => {
                format!("{name}={value:?} is not a positive number of milliseconds")
            }
        }),
    }
}

impl Config {
    /// The configuration in the process's environment.
    pub fn from_env() -> Result<Option<Config>, String> {
        Config::from(|k| std::env::var_os(k))
    }

    /// The configuration in `get`'s variables: `None` when the shim is to pass every call
    /// through silently (no class it knows, no doorbell directory); an error is the line
    /// to print (the shim then passes through too).
    pub fn from(get: impl Fn(&str) -> Option<OsString>) -> Result<Option<Config>, String> {
        let text = |k: &str| get(k).map(|v| v.to_string_lossy().into_owned());
        let class = match text("COLOC_SHIM_CLASS").as_deref() {
            Some("online") => CLASS_ONLINE,
            Some("offline") => CLASS_OFFLINE,
            _ => return Ok(None),
        };
        let Some(doorbell_dir) = get("COLOC_DOORBELL_DIR") else {
            return Ok(None);
        };
        let mut c = Config {
            class,
            doorbell_dir,
            wake_gap_ns: DEFAULT_WAKE_GAP_NS,
            gate: GateConfig::default(),
        };
        if class == CLASS_ONLINE {
            if let Some(v) = text("COLOC_SHIM_WAKE_GAP_MS") {
                c.wake_gap_ns = ms_to_ns("COLOC_SHIM_WAKE_GAP_MS", &v, Zero::Refused)?;
            }
            return Ok(Some(c));
        }
        if let Some(v) = text("COLOC_SHIM_INFLIGHT") {
            c.gate.inflight = v.trim().parse::<u32>().map_err(|_| {
                format!(
                    "COLOC_SHIM_INFLIGHT={v:?} is not a whole number of submissions (0: unbounded)"
                )
            })?;
        }
        if let Some(v) = text("COLOC_SHIM_INFLIGHT_MS") {
            c.gate.budget_ns = ms_to_ns("COLOC_SHIM_INFLIGHT_MS", &v, Zero::Allowed)?;
        }
        if let Some(v) = text("COLOC_GATE_STALE_MS") {
            c.gate.stale_ns = ms_to_ns("COLOC_GATE_STALE_MS", &v, Zero::Refused)?;
        }
        if let Some(p) = get("COLOC_GATE_FILE") {
            c.gate.gate_file = CString::new(p.into_encoded_bytes())
                .map_err(|_| "COLOC_GATE_FILE contains a NUL byte".to_string())?;
        }
        Ok(Some(c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(vars: &[(&str, &str)]) -> Result<Option<Config>, String> {
        Config::from(|k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| OsString::from(v))
        })
    }

    #[test]
    fn milliseconds() {
        assert_eq!(ms_to_ns("X", "3", Zero::Refused), Ok(3_000_000));
        assert_eq!(ms_to_ns("X", " 0.5 ", Zero::Refused), Ok(500_000));
        assert_eq!(ms_to_ns("X", "0", Zero::Allowed), Ok(0));
        assert_eq!(
            ms_to_ns("X", "1e-9", Zero::Allowed),
            Ok(1),
            "positive: at least 1 ns"
        );
        for bad in ["0", "-1", "nan", "inf", "", "3ms"] {
            let e = ms_to_ns("X", bad, Zero::Refused).unwrap_err();
            assert!(e.contains("positive number of milliseconds"), "{bad}: {e}");
        }
        assert!(ms_to_ns("X", "-0.1", Zero::Allowed).is_err());
    }

    #[test]
    fn a_class_and_a_directory_or_nothing() {
        assert_eq!(cfg(&[]), Ok(None));
        assert_eq!(
            cfg(&[("COLOC_SHIM_CLASS", "online")]),
            Ok(None),
            "no directory"
        );
        assert_eq!(
            cfg(&[("COLOC_SHIM_CLASS", "batch"), ("COLOC_DOORBELL_DIR", "/d")]),
            Ok(None)
        );
        let c = cfg(&[("COLOC_SHIM_CLASS", "online"), ("COLOC_DOORBELL_DIR", "/d")])
            .unwrap()
            .unwrap();
        assert_eq!(
            (c.class, c.wake_gap_ns),
            (CLASS_ONLINE, DEFAULT_WAKE_GAP_NS)
        );
        assert_eq!(c.gate, GateConfig::default());
    }

    #[test]
    fn only_the_class_s_own_variables_are_read() {
        let bad_gate = [
            ("COLOC_SHIM_CLASS", "online"),
            ("COLOC_DOORBELL_DIR", "/d"),
            ("COLOC_SHIM_INFLIGHT", "x"),
            ("COLOC_GATE_STALE_MS", "-1"),
        ];
        assert!(cfg(&bad_gate).unwrap().is_some());
        let bad_gap = [
            ("COLOC_SHIM_CLASS", "offline"),
            ("COLOC_DOORBELL_DIR", "/d"),
            ("COLOC_SHIM_WAKE_GAP_MS", "0"),
        ];
        assert!(cfg(&bad_gap).unwrap().is_some());
        let e = cfg(&[
            ("COLOC_SHIM_CLASS", "online"),
            ("COLOC_DOORBELL_DIR", "/d"),
            ("COLOC_SHIM_WAKE_GAP_MS", "0"),
        ])
        .unwrap_err();
        assert!(e.starts_with("COLOC_SHIM_WAKE_GAP_MS=\"0\""), "{e}");
    }

    #[test]
    fn the_gate_s_settings() {
        let c = cfg(&[
            ("COLOC_SHIM_CLASS", "offline"),
            ("COLOC_DOORBELL_DIR", "/d"),
            ("COLOC_SHIM_INFLIGHT", " 0 "),
            ("COLOC_SHIM_INFLIGHT_MS", "0"),
            ("COLOC_GATE_STALE_MS", "250"),
            ("COLOC_GATE_FILE", "/g"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            c.gate,
            GateConfig {
                inflight: 0,
                budget_ns: 0,
                stale_ns: 250_000_000,
                gate_file: CString::new("/g").unwrap(),
            }
        );
        let e = cfg(&[
            ("COLOC_SHIM_CLASS", "offline"),
            ("COLOC_DOORBELL_DIR", "/d"),
            ("COLOC_SHIM_INFLIGHT", "-1"),
        ])
        .unwrap_err();
        assert!(e.contains("whole number of submissions"), "{e}");
    }
}
