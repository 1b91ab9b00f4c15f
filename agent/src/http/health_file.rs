//! The health file: what `/healthz` and `/readyz` say, written every second into the state
//! directory, for `coloc-agent probe` (the chart's exec probes). A probe that reads a file
//! needs no listener, so no tenant that reaches the agent's port can starve it.
//!
//! ```text
//!  <state-dir>/health.json   {"written_ns", "live", "live_reason", "ready", "ready_reason"}
//!                            replaced whole (temporary file + rename), every second, by the
//!                            HTTP runtime's thread (never the control loop's)
//! ```
//!
//! May touch: writes `health.json` (and its temporary file) in the state directory.

use super::AppState;
use coloc_doorbell::now_ns;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The file's name in the state directory.
pub const FILE: &str = "health.json";
/// How often it is written.
pub const EVERY: Duration = Duration::from_secs(1);

/// What the file holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Health {
    /// When it was written (wall clock, ns).
    pub written_ns: u64,
    /// `/healthz` would answer 200.
    pub live: bool,
    /// Its word or reason.
    pub live_reason: String,
    /// `/readyz` would answer 200.
    pub ready: bool,
    /// Its word or reason.
    pub ready_reason: String,
}

impl Health {
    /// What the agent says now.
    pub fn now(s: &AppState) -> Health {
        let (live, live_reason) = match super::live(s) {
            Ok(w) => (true, w.to_string()),
            Err(why) => (false, why),
        };
        let (ready, ready_reason) = match super::ready(s) {
            Ok(w) => (true, w.to_string()),
            Err(why) => (false, why),
        };
        Health {
            written_ns: now_ns(),
            live,
            live_reason,
            ready,
            ready_reason,
        }
    }
}

/// Replaces the file at `path` with `h`.
pub fn write(path: &Path, h: &Health) -> std::io::Result<()> {
    let tmp = path.with_extension(format!("json.{}.tmp", std::process::id()));
    std::fs::write(&tmp, serde_json::to_vec(h).map_err(std::io::Error::other)?)?;
    std::fs::rename(&tmp, path)
}

/// Writes the file every [`EVERY`] until the runtime stops.
pub async fn keep_written(state: AppState, path: PathBuf) {
    let mut every = tokio::time::interval(EVERY);
    let mut warned = false;
    loop {
        every.tick().await;
        if let Err(err) = write(&path, &Health::now(&state)) {
            if !warned {
                tracing::warn!(file = %path.display(), %err, "Cannot write the health file: coloc-agent probe will say the agent is not live");
                warned = true;
            }
        }
    }
}

/// Which probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Probe {
    /// Liveness (`/healthz`).
    Live,
    /// Readiness (`/readyz`).
    Ready,
}

/// What the probe says of the file at `path`: `Ok(word)` or `Err(why)`; a file older than
/// `max_age` (the agent stopped writing it) or missing is a failure.
pub fn judge(path: &Path, probe: Probe, max_age: Duration) -> Result<String, String> {
    let text = std::fs::read(path).map_err(|e| {
        format!(
            "no health file {} ({e}): the agent is not running, or not writing it",
            path.display()
        )
    })?;
    let h: Health = serde_json::from_slice(&text)
        .map_err(|e| format!("health file {}: {e}", path.display()))?;
    let age = now_ns().saturating_sub(h.written_ns);
    if age > max_age.as_nanos() as u64 {
        return Err(format!(
            "health file {} is {:.1} s old (more than {max_age:?}): the agent stopped writing it",
            path.display(),
            age as f64 / 1e9
        ));
    }
    match probe {
        Probe::Live if h.live => Ok(h.live_reason),
        Probe::Live => Err(h.live_reason),
        Probe::Ready if h.ready => Ok(h.ready_reason),
        Probe::Ready => Err(h.ready_reason),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_probe_reads_what_was_written_and_fails_when_it_is_stale_or_missing() {
        let dir = crate::testutil::TmpDir::new("coloc-health");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(FILE);
        let max = Duration::from_secs(10);
        assert!(judge(&path, Probe::Live, max)
            .unwrap_err()
            .contains("no health file"));
        let mut h = Health {
            written_ns: now_ns(),
            live: true,
            live_reason: "ok".into(),
            ready: false,
            ready_reason: "pod source not synced".into(),
        };
        write(&path, &h).unwrap();
        assert_eq!(judge(&path, Probe::Live, max), Ok("ok".into()));
        assert_eq!(
            judge(&path, Probe::Ready, max),
            Err("pod source not synced".into())
        );
        h.written_ns -= 20_000_000_000;
        write(&path, &h).unwrap();
        assert!(judge(&path, Probe::Live, max)
            .unwrap_err()
            .contains("stopped writing"));
        let leftovers: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
        assert_eq!(leftovers.len(), 1, "a temporary file stayed: {leftovers:?}");
    }
}
