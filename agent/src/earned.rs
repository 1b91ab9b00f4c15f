//! What co-location earned, and what it cost: per (namespace, class), the GPU time offline
//! work ran beside online work, the time it was held, and for online work the time it
//! shared its GPU with running offline work and the time it waited for offline work to get
//! out of the way. Counted from each `/state` document the control loop publishes (every
//! 100 ms), so it reads what `/state` shows and decides nothing.
//!
//! | series (counter, fractional seconds) | class | what is counted, per GPU |
//! |---|---|---|
//! | `coloc_offline_harvested_seconds_total` | `offline` | wall time during which some process of the namespace ran (not held) on a GPU where an online process has a context: GPU time the online pods' GPU gave to offline work |
//! | `coloc_offline_held_seconds_total` | `offline` | wall time during which every process of the namespace on the GPU was held |
//! | `coloc_online_beside_offline_seconds_total` | `online`, `online_exclusive` | wall time during which the namespace's online work shared the GPU with offline work that ran (its exposure) |
//! | `coloc_online_waited_seconds_total` | `online`, `online_exclusive` | the preemption latencies (onset → every offline process confirmed stopped) of the GPU's preemptions: how long online work that had started ran beside offline work before it was out of the way; each preemption counts once for every online namespace on that GPU |
//!
//! A GPU counts once per namespace, however many of its processes are on it; two GPUs
//! count twice (GPU-seconds). `namespace` is the pod's namespace; for a standalone rule
//! it is `rule:NAME`, and `-` for a process of no known pod. A GPU failed open (NVML
//! failing) counts nothing: its offline work runs unmanaged. A gap of more than
//! [`MAX_GAP_NS`] between two documents (a stalled loop) counts nothing.
//!
//! **Runs of online work** ([`Runs`]): where an online process's doorbell page stamps
//! completions (page version 3), a run (its first launch after a gap to the moment it saw
//! all its work complete) is timed, and split by whether offline work was running on that
//! GPU when the run began: `coloc_online_run_seconds{gpu, offline="running"|"stopped"}`,
//! and `/state`'s `online_runs`. The difference between the two is the latency offline
//! work added to online work. A run is the page's: launches closer together than the
//! page's wake gap (100 ms by default; the learned release's 2 ms) are one run, so with
//! the default gap a run may span several requests. Pages that state the online class are
//! read (the class is the page's word).

use crate::control::events::Event;
use crate::control::state::StateDoc;
use crate::edges::doorbell::{BellReading, PageInfo};
use qos_core::stats::Summary;
use qos_core::Class;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};

/// The longest gap between two documents that is counted.
pub const MAX_GAP_NS: u64 = 5_000_000_000;

/// One (namespace, class) in `/state`'s `earned` and `coloc-agent status`: since the
/// agent started.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EarnedRow {
    /// The pod's namespace; `rule:NAME` for a standalone rule; `-` for no known pod.
    pub namespace: String,
    /// `offline`, `online` or `online_exclusive`.
    pub class: String,
    /// Offline: GPU-seconds its work ran on a GPU where online work has a context.
    #[serde(default)]
    pub harvested_s: f64,
    /// Offline: GPU-seconds all its work on a GPU was held.
    #[serde(default)]
    pub held_s: f64,
    /// Online: GPU-seconds its work shared its GPU with offline work that ran.
    #[serde(default)]
    pub beside_offline_s: f64,
    /// Online: the sum of the preemption latencies on its GPUs, seconds.
    #[serde(default)]
    pub waited_s: f64,
    /// Online: preemptions on its GPUs.
    #[serde(default)]
    pub preemptions: u64,
}

/// How many recent runs each side of `/state`'s `online_runs` keeps.
pub const RUN_HISTORY: usize = 1024;
/// A run longer than this is not timed (a stale or wrong stamp).
pub const MAX_RUN_NS: u64 = 10_000_000_000;
/// How many of its latest changes (offline work starting or stopping) each GPU keeps.
const CHANGES: usize = 256;

/// Online work's runs, launch to completion, as `/state` shows them (ms).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunsDoc {
    /// Runs that began while offline work ran on the GPU.
    pub offline_running_ms: Summary,
    /// Runs that began while no offline work ran there (held, or none on the GPU).
    pub offline_stopped_ms: Summary,
}

/// Times online work's runs from its doorbell pages (see the module).
#[derive(Debug, Default)]
pub struct Runs {
    uuid_gpu: HashMap<[u8; 16], u32>,
    online_pages: HashSet<u64>,
    /// Per (page, GPU): the start of the latest run timed (a run starting no later is not
    /// timed: a page that goes back cannot have a run timed twice).
    timed: HashMap<(u64, u32), u64>,
    /// Per GPU: when offline work started (true) or stopped (false) running, oldest first.
    changes: BTreeMap<u32, VecDeque<(u64, bool)>>,
    running: VecDeque<f64>,
    stopped: VecDeque<f64>,
}

impl Runs {
    /// The pages mapped now: the online ones are read.
    pub fn pages(&mut self, pages: &[PageInfo]) {
        self.online_pages = pages
            .iter()
            .filter(|p| p.class == coloc_doorbell::CLASS_ONLINE)
            .map(|p| p.id)
            .collect();
        self.timed.retain(|k, _| self.online_pages.contains(&k.0));
    }

    /// Whether offline work runs on `gpu` as of `now` (the latest decision).
    pub fn offline_running(&mut self, gpu: u32, now: u64, running: bool) {
        let c = self.changes.entry(gpu).or_default();
        if c.back().map(|l| l.1) != Some(running) {
            if c.len() == CHANGES {
                c.pop_front();
            }
            c.push_back((now, running));
        }
    }

    fn running_at(&self, gpu: u32, t: u64) -> Option<bool> {
        let c = self.changes.get(&gpu)?;
        // Older than everything kept: unknown.
        c.iter().rev().find(|(at, _)| *at <= t).map(|(_, r)| *r)
    }

    /// Times the runs `readings` show complete for the first time, given the GPUs' UUIDs;
    /// returns each (GPU, offline running when it began, seconds).
    pub fn observe(
        &mut self,
        readings: &[BellReading],
        uuids: &BTreeMap<u32, String>,
    ) -> Vec<(u32, bool, f64)> {
        if self.uuid_gpu.len() != uuids.len() {
            self.uuid_gpu = uuids
                .iter()
                .filter_map(|(g, u)| Some((coloc_doorbell::parse_uuid(u)?, *g)))
                .collect();
        }
        let mut out = Vec::new();
        for r in readings {
            let (since, last, done) = (
                r.reading.busy_since_ns,
                r.reading.last_launch_ns,
                r.drained_ns,
            );
            // Complete: seen done after its last launch (a stamp covers every launch
            // before it).
            if !self.online_pages.contains(&r.page) || since == 0 || last < since || done < last {
                continue;
            }
            let Some(gpu) = self.uuid_gpu.get(&r.reading.uuid).copied() else {
                continue;
            };
            // Runs only move forward: a start at or before the latest one timed is old.
            if self.timed.get(&(r.page, gpu)).is_some_and(|t| since <= *t) {
                continue;
            }
            self.timed.insert((r.page, gpu), since);
            let took = done - since;
            let Some(running) = self.running_at(gpu, since) else {
                continue;
            };
            if took == 0 || took > MAX_RUN_NS {
                continue;
            }
            let s = took as f64 / 1e9;
            let q = if running {
                &mut self.running
            } else {
                &mut self.stopped
            };
            if q.len() == RUN_HISTORY {
                q.pop_front();
            }
            q.push_back(s);
            out.push((gpu, running, s));
        }
        out
    }

    /// `/state`'s `online_runs`: `None` before any run was timed.
    pub fn doc(&self) -> Option<RunsDoc> {
        (!self.running.is_empty() || !self.stopped.is_empty()).then(|| RunsDoc {
            offline_running_ms: Summary::of(self.running.iter().map(|s| s * 1e3)),
            offline_stopped_ms: Summary::of(self.stopped.iter().map(|s| s * 1e3)),
        })
    }
}

/// Records the runs [`Runs::observe`] timed in `coloc_online_run_seconds`.
pub fn record_runs(runs: &[(u32, bool, f64)]) {
    for (gpu, running, s) in runs {
        metrics::histogram!("coloc_online_run_seconds", "gpu" => gpu.to_string(),
            "offline" => if *running { "running" } else { "stopped" })
        .record(*s);
    }
}

/// The running totals.
#[derive(Debug, Default)]
pub struct Book {
    /// Online work's runs, timed from its doorbell pages.
    pub runs: Runs,
    last_ns: Option<u64>,
    /// Preemptions already counted, as (GPU, decision time), among those the document
    /// still lists.
    counted: HashSet<(u32, u64)>,
    rows: BTreeMap<(String, &'static str), EarnedRow>,
}

/// The namespace label of a `/state` owner.
pub fn namespace_of(owner: &str) -> &str {
    match owner.split_once('/') {
        Some((ns, _)) if !owner.contains(':') => ns,
        _ if owner.starts_with("rule:") => owner,
        _ => "-",
    }
}

fn online(c: Class) -> bool {
    matches!(c, Class::Online | Class::OnlineExclusive)
}

impl Book {
    fn row(&mut self, namespace: &str, class: Class) -> &mut EarnedRow {
        self.rows
            .entry((namespace.to_string(), class.as_str()))
            .or_insert_with(|| EarnedRow {
                namespace: namespace.to_string(),
                class: class.as_str().to_string(),
                ..EarnedRow::default()
            })
    }

    /// Counts the time since the previous document and the preemptions not counted yet,
    /// and sets `doc.earned`.
    pub fn account(&mut self, doc: &mut StateDoc) {
        let now = doc.updated_ns;
        let dt = match self.last_ns {
            Some(t) if now > t && now - t <= MAX_GAP_NS => (now - t) as f64 / 1e9,
            _ => 0.0,
        };
        self.last_ns = Some(now.max(self.last_ns.unwrap_or(0)));
        let mut on_gpu: BTreeMap<u32, BTreeSet<(&str, Class)>> = BTreeMap::new();
        for g in doc.gpus.iter().filter(|g| !g.degraded) {
            let onl: BTreeSet<(&str, Class)> = g
                .processes
                .iter()
                .filter(|p| online(p.class))
                .map(|p| (namespace_of(&p.owner), p.class))
                .collect();
            // Per offline namespace: does some process of it run?
            let mut off: BTreeMap<&str, bool> = BTreeMap::new();
            for p in g.processes.iter().filter(|p| p.class == Class::Offline) {
                *off.entry(namespace_of(&p.owner)).or_default() |= !p.suspended;
            }
            // Every namespace seen has its series from then on, at 0 until something counts
            // (so that `increase()` sees the first).
            for (ns, running) in &off {
                let r = self.row(ns, Class::Offline);
                if !running {
                    r.held_s += dt;
                } else if !onl.is_empty() {
                    r.harvested_s += dt;
                }
            }
            let beside = if off.values().any(|r| *r) { dt } else { 0.0 };
            for (ns, class) in &onl {
                self.row(ns, *class).beside_offline_s += beside;
            }
            on_gpu.insert(g.index, onl);
        }
        // Preemptions: their latency is how long online work there ran beside offline work.
        let mut listed = HashSet::new();
        for ev in &doc.recent_events {
            let Event::Preempt(p) = ev else { continue };
            let key = (p.gpu, p.decided_ns);
            listed.insert(key);
            if self.counted.contains(&key) {
                continue;
            }
            self.counted.insert(key);
            let Some(waited) = p.preemption_s.filter(|_| !p.dry_run) else {
                continue;
            };
            for (ns, class) in on_gpu.get(&p.gpu).into_iter().flatten() {
                let r = self.row(ns, *class);
                r.waited_s += waited;
                r.preemptions += 1;
            }
        }
        self.counted.retain(|k| listed.contains(k));
        doc.earned = self.rows.values().cloned().collect();
        doc.online_runs = self.runs.doc();
    }

    /// The four counters, in Prometheus text.
    pub fn render(&self, out: &mut String) {
        type Get = fn(&EarnedRow) -> f64;
        let series: [(&str, bool, &str, Get); 4] = [
            ("coloc_offline_harvested_seconds_total", false,
             "Wall time during which some offline process of the namespace ran (not held) on a GPU where an online process has a context, summed over GPUs: GPU time online pods' GPUs gave to offline work.",
             |r| r.harvested_s),
            ("coloc_offline_held_seconds_total", false,
             "Wall time during which every offline process of the namespace on a GPU was held, summed over GPUs.",
             |r| r.held_s),
            ("coloc_online_beside_offline_seconds_total", true,
             "Wall time during which online work of the namespace shared a GPU with offline work that ran, summed over GPUs.",
             |r| r.beside_offline_s),
            ("coloc_online_waited_seconds_total", true,
             "Preemption latencies (onset of online work to every offline process confirmed stopped) of the preemptions on the GPUs of the namespace's online work: how long its work ran beside offline work before that was out of the way.",
             |r| r.waited_s),
        ];
        for (name, of_online, help, get) in series {
            out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} counter\n"));
            for r in self.rows.values() {
                if (r.class != "offline") == of_online {
                    out.push_str(&format!(
                        "{name}{{namespace=\"{}\",class=\"{}\"}} {}\n",
                        r.namespace.replace('\\', "\\\\").replace('"', "\\\""),
                        r.class,
                        get(r)
                    ));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::events::Preempt;
    use crate::control::state::{GpuDoc, ProcDoc};

    fn proc(class: Class, owner: &str, suspended: bool) -> ProcDoc {
        ProcDoc {
            pid: 1,
            class,
            owner: owner.into(),
            cmd: String::new(),
            suspended,
            actuator: None,
            last_active_ms_ago: None,
            driver: None,
            checkpointed_bytes: None,
            container: None,
            escaping: false,
            gate: None,
            shim: None,
        }
    }

    fn doc(t_ms: u64, gpus: Vec<Vec<ProcDoc>>) -> StateDoc {
        StateDoc {
            updated_ns: t_ms * 1_000_000,
            gpus: gpus
                .into_iter()
                .enumerate()
                .map(|(i, processes)| GpuDoc {
                    index: i as u32,
                    processes,
                    ..GpuDoc::default()
                })
                .collect(),
            ..StateDoc::default()
        }
    }

    fn preempt(gpu: u32, decided_ms: u64, latency_s: f64) -> Event {
        Event::Preempt(Preempt {
            gpu,
            onset_ns: 0,
            signal: qos_core::Signal::Doorbell,
            decided_ns: decided_ms * 1_000_000,
            detection_s: 0.0,
            offline: 1,
            actuator: None,
            dry_run: false,
            confirmed_ns: None,
            actuation_s: None,
            preemption_s: Some(latency_s),
            slept_ns: None,
            woke_ns: None,
        })
    }

    fn row<'a>(d: &'a StateDoc, ns: &str, class: &str) -> &'a EarnedRow {
        d.earned
            .iter()
            .find(|r| r.namespace == ns && r.class == class)
            .unwrap_or_else(|| panic!("no row {ns} {class}: {:?}", d.earned))
    }

    #[test]
    fn offline_time_beside_online_is_harvested_held_time_is_held_and_online_pays_the_waits() {
        let mut b = Book::default();
        // GPU 0: online serving/web beside batch's two processes (one held); GPU 1: batch
        // alone (no online work there: not harvested); GPU 2: research held.
        let gpus = |held: bool| {
            vec![
                vec![
                    proc(Class::Online, "serving/web-0", false),
                    proc(Class::Offline, "batch/train-0", held),
                    proc(Class::Offline, "batch/train-1", true),
                ],
                vec![proc(Class::Offline, "batch/train-2", false)],
                vec![
                    proc(Class::OnlineExclusive, "rule:infer", false),
                    proc(Class::Offline, "research/x", true),
                ],
            ]
        };
        let mut d = doc(1000, gpus(false));
        b.account(&mut d);
        assert!(
            d.earned
                .iter()
                .all(|r| r.harvested_s == 0.0 && r.held_s == 0.0),
            "the first document counts no time"
        );
        let mut d = doc(1500, gpus(false));
        d.recent_events = vec![preempt(0, 1200, 0.004), preempt(2, 1300, 0.25)];
        b.account(&mut d);
        let mut d = doc(2500, gpus(true));
        // The same preemptions listed again count once; a new one counts.
        d.recent_events = vec![
            preempt(0, 1200, 0.004),
            preempt(2, 1300, 0.25),
            preempt(0, 2400, 0.006),
        ];
        b.account(&mut d);
        // batch ran beside online on GPU 0 for 0.5 s, then was held there for 1 s; on GPU 1
        // it ran alone (nothing harvested) for 1.5 s.
        assert_eq!(row(&d, "batch", "offline").harvested_s, 0.5);
        assert_eq!(row(&d, "batch", "offline").held_s, 1.0);
        assert_eq!(row(&d, "research", "offline").held_s, 1.5);
        assert_eq!(row(&d, "research", "offline").harvested_s, 0.0);
        let web = row(&d, "serving", "online");
        assert_eq!(web.beside_offline_s, 0.5);
        assert_eq!(web.preemptions, 2);
        assert!((web.waited_s - 0.010).abs() < 1e-12, "{web:?}");
        let infer = row(&d, "rule:infer", "online_exclusive");
        assert_eq!(
            (infer.beside_offline_s, infer.preemptions, infer.waited_s),
            (0.0, 1, 0.25)
        );
        // A stalled loop's gap counts nothing.
        let mut d = doc(2500 + 6000, gpus(true));
        b.account(&mut d);
        assert_eq!(row(&d, "batch", "offline").held_s, 1.0);
        let mut out = String::new();
        b.render(&mut out);
        assert!(out.contains("coloc_offline_harvested_seconds_total{namespace=\"batch\",class=\"offline\"} 0.5\n"), "{out}");
        assert!(out.contains("coloc_online_waited_seconds_total{namespace=\"rule:infer\",class=\"online_exclusive\"} 0.25\n"), "{out}");
        assert!(
            !out.contains("coloc_offline_held_seconds_total{namespace=\"serving\""),
            "{out}"
        );
    }

    #[test]
    fn a_failed_open_gpu_counts_nothing() {
        let mut b = Book::default();
        for t in [0, 100] {
            let mut d = doc(
                1000 + t,
                vec![vec![
                    proc(Class::Online, "s/w", false),
                    proc(Class::Offline, "b/t", false),
                ]],
            );
            d.gpus[0].degraded = true;
            b.account(&mut d);
            assert!(d.earned.is_empty(), "{:?}", d.earned);
        }
    }

    #[test]
    fn namespaces() {
        assert_eq!(namespace_of("ml/train-0"), "ml");
        assert_eq!(namespace_of("rule:nightly"), "rule:nightly");
        assert_eq!(namespace_of("pod-uid:0f2c"), "-");
        assert_eq!(namespace_of("-"), "-");
    }

    #[test]
    fn runs_are_timed_once_and_split_by_whether_offline_ran_when_they_began() {
        use crate::edges::doorbell::Owner;
        let uuid = "GPU-5f1c0a2e-7d3b-4c19-9e6a-000000000000";
        let uuids: BTreeMap<u32, String> = [(0, uuid.to_string())].into();
        let page = |id: u64, class: u32| PageInfo {
            id,
            path: format!("/run/bells/{id}.bell").into(),
            owner: Owner::Pid(100 + id as u32),
            file_uid: 0,
            wake_gap_ns: 2_000_000,
            pid: 100 + id as u32,
            class,
        };
        let reading = |page: u64, since_ms: u64, last_ms: u64, done_ms: u64| BellReading {
            page,
            reading: coloc_doorbell::Reading {
                index: 0,
                uuid: coloc_doorbell::parse_uuid(uuid).unwrap(),
                last_launch_ns: last_ms * 1_000_000,
                busy_since_ns: since_ms * 1_000_000,
            },
            drained_ns: done_ms * 1_000_000,
        };
        let mut r = Runs::default();
        r.pages(&[
            page(1, coloc_doorbell::CLASS_ONLINE),
            page(2, coloc_doorbell::CLASS_OFFLINE),
        ]);
        // Offline ran until 1000 ms, held until 2000 ms, ran again after.
        r.offline_running(0, 500_000_000, true);
        r.offline_running(0, 1_000_000_000, false);
        r.offline_running(0, 1_000_000_000, false);
        r.offline_running(0, 2_000_000_000, true);
        // Before anything is known of the GPU: not timed.
        let early = r.observe(&[reading(1, 400, 401, 403)], &uuids);
        assert!(early.is_empty(), "{early:?}");
        // A run that began while offline ran (it caused the preemption at 1000 ms)...
        let got = r.observe(&[reading(1, 999, 1004, 1012)], &uuids);
        assert_eq!(got, [(0, true, 0.013)]);
        // ...seen again, or still running (launched after its stamp): not timed again.
        assert!(r.observe(&[reading(1, 999, 1004, 1012)], &uuids).is_empty());
        assert!(r
            .observe(&[reading(1, 1500, 1505, 1499)], &uuids)
            .is_empty());
        // A run that began with offline held, and the offline page's entry: ignored.
        let got = r.observe(
            &[reading(1, 1500, 1505, 1510), reading(2, 1500, 1505, 1510)],
            &uuids,
        );
        assert_eq!(got, [(0, false, 0.01)]);
        let d = r.doc().unwrap();
        assert_eq!(
            (d.offline_running_ms.count, d.offline_stopped_ms.count),
            (1, 1)
        );
        assert_eq!(d.offline_running_ms.p50, Some(13.0));
        // A page that is gone forgets its runs; a run over 10 s is not timed.
        r.pages(&[page(1, coloc_doorbell::CLASS_ONLINE)]);
        assert!(r
            .observe(&[reading(1, 2500, 2501, 2500 + 10_001)], &uuids)
            .is_empty());
    }

    /// A tenant's pages are its word: two pages of one tenant (one stating the offline
    /// class, one online) that claim runs on a GPU the agent does not manage, inverted or
    /// endless runs, or the same run over and over, add nothing but their own well-formed
    /// runs, each once.
    #[test]
    fn forged_pages_add_nothing_but_their_own_runs_once() {
        use crate::edges::doorbell::Owner;
        let managed = "GPU-5f1c0a2e-7d3b-4c19-9e6a-000000000000";
        let other = "GPU-5f1c0a2e-7d3b-4c19-9e6a-0000000000ff";
        let uuids: BTreeMap<u32, String> = [(0, managed.to_string())].into();
        let page = |id: u64, class: u32| PageInfo {
            id,
            path: format!("/run/bells/pods/u/{id}.bell").into(),
            owner: Owner::Pod("u".into()),
            file_uid: 1000,
            wake_gap_ns: 100_000_000,
            pid: 7,
            class,
        };
        let reading = |page: u64, uuid: &str, since: u64, last: u64, done: u64| BellReading {
            page,
            reading: coloc_doorbell::Reading {
                index: 0,
                uuid: coloc_doorbell::parse_uuid(uuid).unwrap(),
                last_launch_ns: last,
                busy_since_ns: since,
            },
            drained_ns: done,
        };
        let mut r = Runs::default();
        r.pages(&[
            page(1, coloc_doorbell::CLASS_ONLINE),
            page(2, coloc_doorbell::CLASS_OFFLINE),
        ]);
        r.offline_running(0, 1, true);
        let s = 1_000_000_000;
        let forged = [
            reading(1, other, 2 * s, 2 * s, 3 * s),   // a GPU not managed
            reading(1, managed, 3 * s, 2 * s, 4 * s), // begun after its last launch
            reading(1, managed, 2 * s, 3 * s, 3 * s - 1), // done before its last launch
            reading(1, managed, s, s, s + MAX_RUN_NS + 1), // endless
            reading(2, managed, 2 * s, 2 * s, 2 * s + 5_000_000), // the offline page
            reading(1, managed, 5 * s, 5 * s, 5 * s + 4_000_000), // its one real run
        ];
        for _ in 0..3 {
            let got = r.observe(&forged, &uuids);
            assert!(got.len() <= 1, "{got:?}");
        }
        let d = r.doc().unwrap();
        assert_eq!(
            (d.offline_running_ms.count, d.offline_stopped_ms.count),
            (1, 0)
        );
        assert_eq!(d.offline_running_ms.max, Some(4.0));
    }
}
