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
//! What the doorbell could add (launch → completion of online work with and without
//! offline work beside it) is not measured: the waited figure is the part of online
//! work's time that offline work was still running beside it, as preemption measures it.

use crate::control::events::Event;
use crate::control::state::StateDoc;
use qos_core::Class;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashSet};

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

/// The running totals.
#[derive(Debug, Default)]
pub struct Book {
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
}
