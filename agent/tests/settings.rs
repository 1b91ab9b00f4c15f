//! The real `coloc-agent` binary refuses a `COLOC_*` setting that nothing reads (a
//! misspelt `agent.settings` key reaches it as one), at once and by name, before it
//! touches anything; and takes durations as humantime writes them.

use std::process::Command;
use std::time::{Duration, Instant};

fn agent() -> Command {
    Command::new(env!("CARGO_BIN_EXE_coloc-agent"))
}

#[test]
fn a_misspelt_setting_stops_the_agent_at_once() {
    let dir = std::env::temp_dir().join(format!("coloc-settings-{}", std::process::id()));
    let t = Instant::now();
    let out = agent()
        .args(["run", "--rules", "/nonexistent.toml"])
        .env("COLOC_STATE_DIR", &dir)
        .env("COLOC_BOGUS", "1")
        .env("COLOC_IDLE_WINDW", "200ms")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("COLOC_BOGUS, COLOC_IDLE_WINDW are no setting"),
        "{err}"
    );
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(!dir.exists(), "the state directory was touched");
}

#[test]
fn durations_as_humantime_writes_them() {
    // A bad duration is refused by the flag's parser, naming the value; 1m30s is not.
    let out = agent()
        .args(["run", "--idle-window", "1m30"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("\"1m30\" is not a duration"), "{err}");
    let out = agent()
        .args([
            "probe",
            "live",
            "--state-dir",
            "/nonexistent",
            "--max-age",
            "1m30s",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("is not a duration"), "{err}");
}
