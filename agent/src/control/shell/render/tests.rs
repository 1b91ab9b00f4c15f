//! Notes and events said through their own `emit`, as a dashboard and an operator see
//! them: the Prometheus text of a recorder of the test's own, and the log lines of a
//! subscriber of its own.

use super::{event, Emit};
use crate::control::events::{Event, FailOpen, Preempt};
use crate::control::model::act::{Kind, Op};
use crate::control::model::bell::Owner;
use crate::control::model::hold;
use crate::control::model::ProcKey;
use crate::control::note::{self, FailWhy, Note, Reject};
use crate::control::target::HoldKey;
use crate::logbudget::PER_SECOND;
use crate::telemetry::Telemetry;
use metrics_exporter_prometheus::PrometheusBuilder;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The log lines written while `f` runs (plain text, no colours).
#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl Write for Lines {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Runs `f` with a recorder and a log of its own; returns the Prometheus text and the log.
fn said(f: impl FnOnce()) -> (String, String) {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let lines = Lines::default();
    let w = lines.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .with_writer(move || w.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, || metrics::with_local_recorder(&recorder, f));
    let log = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
    (handle.render(), log)
}

/// The value of the sample `series` (name and labels as Prometheus writes them).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

fn key(pid: u32) -> ProcKey {
    ProcKey { pid, start: 7 }
}

/// The counters the fail-open and actuation alerts (`deploy/`) read, with their labels,
/// and the log line each failure writes.
#[test]
fn failures_count_under_the_labels_the_alerts_read() {
    let (text, log) = said(|| {
        let mut t = Telemetry::new(&[0], None);
        let notes: [Note; 5] = [
            note::FailedOpen {
                why: FailWhy::Record,
            }
            .into(),
            note::NvmlFailOpen {
                gpu: 0,
                error: "GPU is lost".into(),
                grace: Duration::from_secs(2),
            }
            .into(),
            note::ActFailed {
                op: Op::Suspend,
                target: "pid 41".into(),
                actuator: Kind::Signal,
                reason: "signal",
                error: "No such process".into(),
            }
            .into(),
            note::TimedOut {
                op: Op::Resume,
                hold: HoldKey::Process(key(42)),
                actuator: Kind::Freezer,
                timeout: Duration::from_millis(500),
            }
            .into(),
            note::Suspending {
                reason: qos_core::machine::Reason::OnlineBusy { gpu: 0 },
            }
            .into(),
        ];
        for n in &notes {
            n.emit(&mut t);
        }
    });
    for (series, want) in [
        (r#"coloc_fail_open_total{reason="record"}"#, 1.0),
        (r#"coloc_fail_open_total{reason="nvml"}"#, 1.0),
        (
            r#"coloc_actuation_errors_total{actuator="signal",op="suspend",reason="signal"}"#,
            1.0,
        ),
        (
            r#"coloc_actuation_errors_total{actuator="freezer",op="resume",reason="timeout"}"#,
            1.0,
        ),
        (
            r#"coloc_suspensions_total{gpu="0",reason="online_busy"}"#,
            1.0,
        ),
    ] {
        assert_eq!(sample(&text, series), Some(want), "{series} in:\n{text}");
    }
    // The target a `COLOC_LOG` directive or a log pipeline selects notes by.
    for line in [
        "ERROR coloc_agent::control::note: Suspension failed: undoing it (fail open) target=pid 41 error=No such process",
        "ERROR coloc_agent::control::note: Resume not confirmed in time; left in the record for the next start hold=Process(ProcKey { pid: 42, start: 7 })",
        "ERROR coloc_agent::control::note: NVML keeps failing for this GPU: failing open, resuming its offline work; other GPUs stay managed gpu=0 error=GPU is lost grace=2s",
    ] {
        assert_eq!(log.matches(line).count(), 1, "{line:?} once in:\n{log}");
    }
}

/// A tenant rewriting its page in a loop causes at most `PER_SECOND` lines a second,
/// and a summary of the rest; every rejection is still counted.
#[test]
fn a_tenants_rejected_pages_are_all_counted_but_not_all_logged() {
    let n = 3 * PER_SECOND as usize;
    let (text, log) = said(|| {
        let mut t = Telemetry::new(&[0], None);
        for i in 0..n {
            let page: Note = note::PageRejected {
                page: format!("/run/coloc/pods/uid-a/{i}.page").into(),
                owner: Owner::Pod("uid-a".into()),
                file_uid: 1000,
                reason: Reject::UidMismatch,
            }
            .into();
            page.emit(&mut t);
        }
        note::Uncorroborated.emit(&mut t);
        t.flush_tenant_lines(std::time::Instant::now() + Duration::from_secs(2));
    });
    assert_eq!(
        sample(
            &text,
            r#"coloc_doorbell_rejected_total{reason="uid_mismatch"}"#
        ),
        Some(n as f64),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            r#"coloc_doorbell_rejected_total{reason="uncorroborated"}"#
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        log.matches("Doorbell page not attributed: its launches count for nothing")
            .count(),
        PER_SECOND as usize,
        "{log}"
    );
    let held = n - PER_SECOND as usize;
    assert!(
        log.contains(&format!(
            "kind=\"doorbell page not attributed\" owner=Pod(\"uid-a\") held={held}"
        )),
        "the summary of the {held} lines held back: {log}"
    );
}

/// A hold found running counts under its actuator (a panel and a recording rule read
/// it) and says what holds it now.
#[test]
fn a_broken_hold_counts_under_its_actuator() {
    let (text, log) = said(|| {
        let mut t = Telemetry::new(&[0], None);
        note::Broken {
            broken: hold::Broken {
                holders: vec![key(50)],
                resumed: 1,
                breaks: 1,
                escalated: false,
                unheld: Some("no cell".into()),
                kind: Kind::Signal,
            },
            owners: vec!["batch/train-0".into()],
        }
        .emit(&mut t);
    });
    assert_eq!(
        sample(&text, r#"coloc_suspension_breaks_total{actuator="signal"}"#),
        Some(1.0),
        "{text}"
    );
    assert!(
        log.contains("ERROR") && log.contains("nothing it cannot undo can hold it here"),
        "{log}"
    );
}

/// An event goes to the event log, its own histograms and history, and `/state`'s
/// recent events; a fail-open's line is an error.
#[test]
fn an_event_reaches_the_event_log_the_histograms_and_state() {
    struct Gone(std::path::PathBuf);
    impl Drop for Gone {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let path = std::env::temp_dir().join(format!("coloc-render-{}.jsonl", std::process::id()));
    let _gone = Gone(path.clone());
    let preempt = Event::Preempt(Preempt {
        gpu: 0,
        onset_ns: 1_000_000,
        signal: qos_core::Signal::Doorbell,
        decided_ns: 1_200_000,
        detection_s: 0.0002,
        offline: 1,
        actuator: Some(Kind::Gate),
        dry_run: false,
        confirmed_ns: Some(1_500_000),
        actuation_s: Some(0.0003),
        preemption_s: Some(0.0005),
        slept_ns: None,
        woke_ns: None,
    });
    let fail = Event::FailOpen(FailOpen {
        at_ns: 2_000_000,
        reason: "record".into(),
        gpu: None,
        resumed: 2,
    });
    let mut kept = None;
    let (text, log) = said(|| {
        let file = std::fs::File::create(&path).unwrap();
        let mut t = Telemetry::new(&[0], Some(file));
        event(&mut t, preempt.clone());
        event(&mut t, fail.clone());
        kept = Some((
            t.recent.iter().cloned().collect::<Vec<_>>(),
            t.history[&0]
                .preemption_ms
                .iter()
                .copied()
                .collect::<Vec<_>>(),
        ));
    });
    let (recent, preemption_ms) = kept.unwrap();
    assert_eq!(recent, [preempt.clone(), fail.clone()]);
    assert_eq!(preemption_ms, [0.5]);
    let logged = crate::control::events::parse_log(&std::fs::read_to_string(&path).unwrap());
    assert_eq!(logged, [preempt, fail]);
    assert_eq!(
        sample(
            &text,
            r#"coloc_preemption_latency_seconds_count{gpu="0",actuator="gate",signal="doorbell"}"#
        ),
        Some(1.0),
        "{text}"
    );
    // Under the target events were always logged with.
    assert!(
        log.lines().any(|l| l
            .contains("INFO coloc_agent::telemetry: Online busy: offline suspended")
            && l.contains("actuator=\"gate\"")),
        "{log}"
    );
    assert!(
        log.lines().any(|l| l.contains(
            "ERROR coloc_agent::telemetry: Failed open: offline work resumed reason=record resumed=2"
        )),
        "{log}"
    );
}
