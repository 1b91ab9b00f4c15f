//! The per-GPU preempt/release state machine.
//!
//! Each tick the agent hands [`Machine::tick`] the time and, per GPU, the processes on it
//! with their class and the timestamp of their latest observed activity. The machine
//! returns a [`Decision`]: which processes to suspend, which to resume, and which GPUs
//! changed state (for latency metrics and logs). It performs nothing itself.
//!
//! ```text
//!               online activity observed
//!   OfflineRunning ───────────────────────► OnlineBusy
//!        ▲                                      │
//!        └──────────────────────────────────────┘
//!          no online activity for idle_window
//! ```
//!
//! Rules (DESIGN.md):
//! - only [`Class::Offline`] processes are ever suspended (the safety rule);
//! - an offline process is suspended iff a GPU it is on is `OnlineBusy`, or its
//!   `fixed-share` duty cycle is in its off phase;
//! - a GPU is busy iff online activity was observed less than `idle_window` ago: at exactly
//!   `idle_window` after the last activity it is released;
//! - GPUs are independent; a suspended process that disappears from the input is resumed
//!   (so that nothing stays frozen because a listing flickered).

use crate::class::Class;
use crate::Nanos;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};

/// Tunables of the state machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// How long a GPU must see no online activity before offline work is resumed.
    pub idle_window: Nanos,
    /// Whether processes of no known pod count as online demand (DESIGN: yes by default).
    pub unmanaged_is_online: bool,
    /// Period of the `fixed-share` duty cycle.
    pub duty_period: Nanos,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            idle_window: 100 * crate::MS,
            unmanaged_is_online: true,
            duty_period: 100 * crate::MS,
        }
    }
}

/// How an offline process shares a GPU with idle time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case", tag = "policy")]
pub enum Share {
    /// `guaranteed-burst-share`: may use all idle time.
    #[default]
    Burst,
    /// `fixed-share`: capped to `percent` of wall time by a duty cycle.
    Fixed {
        /// Share of wall time, 1–100.
        percent: u32,
    },
}

/// One process on one GPU, as observed this tick.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessObs<K> {
    /// The caller's identity for the process (e.g. PID plus start time).
    pub key: K,
    /// Its class.
    pub class: Class,
    /// End of its latest observed GPU activity on this GPU (a launch, or the end of a
    /// sampled period), if any. The idle window counts from here.
    pub last_active: Option<Nanos>,
    /// Onset of its current run of activity: the earliest evidence that it started (a
    /// launch time, or the start of a sampled period). `None`: same as `last_active`.
    pub onset: Option<Nanos>,
    /// The signal that gave the onset.
    pub signal: Signal,
    /// Its share policy (only meaningful for offline processes).
    pub share: Share,
}

/// Which signal revealed online work.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Signal {
    /// The CUDA shim's launch doorbell: onset is the launch time.
    Doorbell,
    /// An NVML utilisation sample: onset is the start of the sampled period.
    #[default]
    Nvml,
}

impl Signal {
    /// Label value (`doorbell` / `nvml`).
    pub fn as_str(&self) -> &'static str {
        match self {
            Signal::Doorbell => "doorbell",
            Signal::Nvml => "nvml",
        }
    }
}

/// Everything observed on one GPU this tick.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInput<K> {
    /// GPU index.
    pub gpu: u32,
    /// Processes present on it.
    pub procs: Vec<ProcessObs<K>>,
    /// Online work here was busy in a sampled period whose successor has not been read
    /// yet: it may still be busy, so the GPU counts as busy (its offline work is suspended,
    /// or stays so past the idle window) until a read shows the next period. A sampled
    /// signal is late by a period; without this, a release fell due exactly when the next
    /// sample was written.
    pub sampled_busy: bool,
}

/// The state of one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum GpuState {
    /// No online activity within the idle window: offline work runs. Online activity
    /// observed → [`GpuState::OnlineBusy`], and every offline process here is suspended.
    OfflineRunning,
    /// Online activity was observed less than `idle_window` ago: offline work here is
    /// suspended, and offline processes that appear are suspended at once. A tick at
    /// `last_online + idle_window` or later → [`GpuState::OfflineRunning`], offline resumes.
    OnlineBusy {
        /// Onset of the online activity that made the GPU busy.
        since: Nanos,
        /// End of the latest online activity.
        last_online: Nanos,
    },
}

impl GpuState {
    /// Short name (`offline_running` / `online_busy`).
    pub fn as_str(&self) -> &'static str {
        match self {
            GpuState::OfflineRunning => "offline_running",
            GpuState::OnlineBusy { .. } => "online_busy",
        }
    }
}

/// Why a process is (to be) suspended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// Online work is busy on this GPU.
    OnlineBusy {
        /// The busy GPU.
        gpu: u32,
    },
    /// The `fixed-share` duty cycle is in its off phase.
    ShareCap,
}

/// A GPU changed state this tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Transition {
    /// `OfflineRunning` → `OnlineBusy`.
    Preempt {
        /// The GPU.
        gpu: u32,
        /// Onset: the earliest evidence of the online work that made the GPU busy (start
        /// of detection and preemption latency).
        onset: Nanos,
        /// The signal that gave the onset.
        signal: Signal,
        /// When the machine decided (end of detection, start of actuation).
        decided_at: Nanos,
        /// Offline processes present on the GPU.
        offline: usize,
    },
    /// `OnlineBusy` → `OfflineRunning`.
    Release {
        /// The GPU.
        gpu: u32,
        /// `last_online + window`: when the release was due (start of release latency).
        window_end: Nanos,
        /// The window that ran out: the fixed idle window, or a shorter learned one
        /// ([`Machine::set_release_window`]).
        window: Nanos,
        /// When the machine decided.
        decided_at: Nanos,
        /// How long the GPU was busy (from the first to the last online activity).
        busy_for: Nanos,
        /// Offline processes present on the GPU.
        offline: usize,
    },
}

/// What the caller should do after a tick.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision<K> {
    /// Processes to suspend now, with the reason.
    pub suspend: Vec<(K, Reason)>,
    /// Processes to resume now (including suspended ones that disappeared).
    pub resume: Vec<K>,
    /// GPUs that changed state.
    pub transitions: Vec<Transition>,
}

impl<K> Decision<K> {
    /// True when there is nothing to do.
    pub fn is_empty(&self) -> bool {
        self.suspend.is_empty() && self.resume.is_empty() && self.transitions.is_empty()
    }
}

/// The state machine over all GPUs of a node.
#[derive(Debug, Clone)]
pub struct Machine<K: Ord + Clone> {
    config: Config,
    gpus: BTreeMap<u32, GpuState>,
    suspended: BTreeMap<K, Reason>,
    /// Learned release windows per GPU (see [`crate::release`]), each already clamped.
    windows: BTreeMap<u32, Nanos>,
    /// No release window is ever shorter than this (the idle window until set).
    floor: Nanos,
}

impl<K: Ord + Clone> Machine<K> {
    /// A machine with no GPUs seen yet and nothing suspended.
    pub fn new(config: Config) -> Self {
        Machine {
            config,
            gpus: BTreeMap::new(),
            suspended: BTreeMap::new(),
            windows: BTreeMap::new(),
            floor: config.idle_window,
        }
    }

    /// Allows release windows down to `floor` (never above the idle window): without it,
    /// every GPU releases after the idle window.
    pub fn set_release_floor(&mut self, floor: Nanos) {
        self.floor = floor.min(self.config.idle_window);
        self.windows.clear();
    }

    /// The window after which `gpu` releases from now on: `Some(w)`, clamped to the floor
    /// and the idle window; `None`: the idle window.
    pub fn set_release_window(&mut self, gpu: u32, window: Option<Nanos>) {
        match window {
            Some(w) => {
                self.windows
                    .insert(gpu, w.clamp(self.floor, self.config.idle_window));
            }
            None => {
                self.windows.remove(&gpu);
            }
        }
    }

    /// The window `gpu` releases after.
    pub fn release_window(&self, gpu: u32) -> Nanos {
        self.windows
            .get(&gpu)
            .copied()
            .unwrap_or(self.config.idle_window)
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The state of `gpu` (GPUs never seen are `OfflineRunning`).
    pub fn state(&self, gpu: u32) -> GpuState {
        self.gpus
            .get(&gpu)
            .copied()
            .unwrap_or(GpuState::OfflineRunning)
    }

    /// All GPUs seen in the latest tick, with their state.
    pub fn states(&self) -> impl Iterator<Item = (u32, GpuState)> + '_ {
        self.gpus.iter().map(|(g, s)| (*g, *s))
    }

    /// Processes the machine currently wants suspended.
    pub fn suspended(&self) -> &BTreeMap<K, Reason> {
        &self.suspended
    }

    /// Forgets that `key` is suspended (its suspension failed and was undone): the next
    /// tick decides for it afresh, and suspends it again if it should be. Returns whether
    /// it was suspended.
    pub fn forget(&mut self, key: &K) -> bool {
        self.suspended.remove(key).is_some()
    }

    /// Forgets everything suspended and returns it (for a fail-open resume of all).
    pub fn release_all(&mut self) -> Vec<K> {
        let keys = std::mem::take(&mut self.suspended).into_keys().collect();
        for state in self.gpus.values_mut() {
            *state = GpuState::OfflineRunning;
        }
        keys
    }

    /// Whether the `fixed-share` duty cycle lets a process with `percent` run at `now`.
    pub fn duty_allows(&self, percent: u32, now: Nanos) -> bool {
        if percent >= 100 || self.config.duty_period == 0 {
            return true;
        }
        let period = self.config.duty_period as u128;
        let on = period * percent as u128 / 100;
        ((now as u128) % period) < on
    }

    /// Advances the machine to `now` with this tick's observations.
    ///
    /// GPUs absent from `gpus` are forgotten (their processes count as gone).
    pub fn tick(&mut self, now: Nanos, gpus: &[GpuInput<K>]) -> Decision<K> {
        let mut transitions = Vec::new();
        let mut desired: BTreeMap<K, Reason> = BTreeMap::new();
        let mut seen_gpus = BTreeSet::new();

        for input in gpus {
            seen_gpus.insert(input.gpu);
            let window = self.release_window(input.gpu);
            let is_online =
                |p: &ProcessObs<K>| p.class.is_online_demand(self.config.unmanaged_is_online);
            let online_times = input
                .procs
                .iter()
                .filter(|p| is_online(p))
                .filter_map(|p| p.last_active);
            let latest_obs = online_times.clone().max();
            let offline = input
                .procs
                .iter()
                .filter(|p| p.class.is_suspendable())
                .count();
            let prev = self.state(input.gpu);
            let last_online = match (prev, latest_obs) {
                (GpuState::OnlineBusy { last_online, .. }, Some(t)) => Some(last_online.max(t)),
                (GpuState::OnlineBusy { last_online, .. }, None) => Some(last_online),
                (GpuState::OfflineRunning, t) => t,
            };
            let held = input.sampled_busy;
            let busy = held || last_online.is_some_and(|t| now.saturating_sub(t) < window);
            let next = match (prev, busy) {
                (GpuState::OnlineBusy { since, .. }, true) => GpuState::OnlineBusy {
                    since,
                    last_online: last_online.unwrap_or(since),
                },
                (GpuState::OfflineRunning, true) => {
                    // The earliest onset among the online processes active inside the window.
                    let (first, signal) = input
                        .procs
                        .iter()
                        .filter(|p| is_online(p))
                        .filter(|p| {
                            p.last_active
                                .is_some_and(|t| held || now.saturating_sub(t) < window)
                        })
                        .map(|p| {
                            let end = p.last_active.unwrap_or(now);
                            (p.onset.unwrap_or(end).min(end), p.signal)
                        })
                        .min()
                        .unwrap_or((now, Signal::Nvml));
                    transitions.push(Transition::Preempt {
                        gpu: input.gpu,
                        onset: first,
                        signal,
                        decided_at: now,
                        offline,
                    });
                    GpuState::OnlineBusy {
                        since: first,
                        last_online: last_online.unwrap_or(first),
                    }
                }
                (GpuState::OnlineBusy { since, last_online }, false) => {
                    transitions.push(Transition::Release {
                        gpu: input.gpu,
                        window_end: last_online.saturating_add(window),
                        window,
                        decided_at: now,
                        busy_for: last_online.saturating_sub(since),
                        offline,
                    });
                    GpuState::OfflineRunning
                }
                (GpuState::OfflineRunning, false) => GpuState::OfflineRunning,
            };
            self.gpus.insert(input.gpu, next);

            for p in input.procs.iter().filter(|p| p.class.is_suspendable()) {
                let reason = if busy {
                    Some(Reason::OnlineBusy { gpu: input.gpu })
                } else {
                    match p.share {
                        Share::Fixed { percent } if !self.duty_allows(percent, now) => {
                            Some(Reason::ShareCap)
                        }
                        _ => None,
                    }
                };
                if let Some(reason) = reason {
                    // A busy GPU explains more than a share cap; keep the first busy one.
                    desired
                        .entry(p.key.clone())
                        .and_modify(|r| {
                            if *r == Reason::ShareCap {
                                *r = reason
                            }
                        })
                        .or_insert(reason);
                }
            }
        }
        self.gpus.retain(|g, _| seen_gpus.contains(g));
        self.windows.retain(|g, _| seen_gpus.contains(g));

        let suspend = desired
            .iter()
            .filter(|(k, _)| !self.suspended.contains_key(*k))
            .map(|(k, r)| (k.clone(), *r))
            .collect();
        let resume = self
            .suspended
            .keys()
            .filter(|k| !desired.contains_key(*k))
            .cloned()
            .collect();
        self.suspended = desired;
        Decision {
            suspend,
            resume,
            transitions,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MS;
    use proptest::prelude::*;

    fn p(key: u32, class: Class, last_active: Option<Nanos>) -> ProcessObs<u32> {
        ProcessObs {
            key,
            class,
            last_active,
            onset: None,
            signal: Signal::Nvml,
            share: Share::Burst,
        }
    }

    fn gpu(g: u32, procs: Vec<ProcessObs<u32>>) -> GpuInput<u32> {
        GpuInput {
            gpu: g,
            procs,
            sampled_busy: false,
        }
    }

    const T0: Nanos = 1_000_000 * MS;

    /// A release the sampled signal cannot vouch for yet waits for the next read; the
    /// window's end is still the release's reference. A sampled busy period not yet
    /// followed preempts even when it ended a window ago.
    #[test]
    fn a_held_release_waits_for_the_next_read() {
        let mut m = Machine::new(Config::default());
        let procs = vec![p(1, Class::Offline, None), p(2, Class::Online, Some(T0))];
        m.tick(T0, &[gpu(0, procs.clone())]);
        let mut held = gpu(0, procs.clone());
        held.sampled_busy = true;
        let d = m.tick(T0 + 150 * MS, &[held]);
        assert!(d.resume.is_empty() && d.transitions.is_empty(), "{d:?}");
        assert!(matches!(m.state(0), GpuState::OnlineBusy { .. }));
        let d = m.tick(T0 + 160 * MS, &[gpu(0, procs)]);
        assert!(matches!(
            d.transitions[..],
            [Transition::Release { window_end, .. }] if window_end == T0 + 100 * MS
        ));
        assert_eq!(d.resume, vec![1]);
        let mut late = gpu(
            0,
            vec![p(1, Class::Offline, None), p(2, Class::Online, Some(T0))],
        );
        late.sampled_busy = true;
        let d = m.tick(T0 + 300 * MS, &[late]);
        assert!(
            matches!(
                d.transitions[..],
                [Transition::Preempt { onset, .. }] if onset == T0
            ),
            "{d:?}"
        );
    }

    #[test]
    fn preemption_reports_the_earliest_onset_and_its_signal() {
        let mut m = Machine::new(Config::default());
        let bell = ProcessObs {
            onset: Some(T0 + 3 * MS),
            signal: Signal::Doorbell,
            ..p(2, Class::Online, Some(T0 + 4 * MS))
        };
        let sampled = ProcessObs {
            // A sampled period from T0 - 96 ms to T0 + 4 ms: its start is the onset.
            onset: Some(T0 - 96 * MS),
            ..p(3, Class::Online, Some(T0 + 4 * MS))
        };
        let old = ProcessObs {
            // Outside the window: it started nothing that is still going on.
            onset: Some(T0 - 500 * MS),
            signal: Signal::Doorbell,
            ..p(4, Class::Online, Some(T0 - 400 * MS))
        };
        let d = m.tick(
            T0 + 5 * MS,
            &[gpu(
                0,
                vec![p(1, Class::Offline, None), bell.clone(), old.clone()],
            )],
        );
        assert!(matches!(
            d.transitions[..],
            [Transition::Preempt { onset, signal: Signal::Doorbell, .. }] if onset == T0 + 3 * MS
        ));
        let mut m = Machine::new(Config::default());
        let d = m.tick(
            T0 + 5 * MS,
            &[gpu(0, vec![p(1, Class::Offline, None), bell, sampled, old])],
        );
        assert!(matches!(
            d.transitions[..],
            [Transition::Preempt { onset, signal: Signal::Nvml, .. }] if onset == T0 - 96 * MS
        ));
        // The window counts from the end of activity, not from the onset.
        assert_eq!(
            m.state(0),
            GpuState::OnlineBusy {
                since: T0 - 96 * MS,
                last_online: T0 + 4 * MS
            }
        );
    }

    #[test]
    fn online_activity_suspends_offline_and_idle_window_edges() {
        let mut m = Machine::new(Config::default());
        let d = m.tick(
            T0,
            &[gpu(
                0,
                vec![
                    p(1, Class::Offline, Some(T0 - MS)),
                    p(2, Class::Online, None),
                ],
            )],
        );
        assert!(d.is_empty());
        // Online activity sampled at T0+1ms, seen at T0+2ms.
        let act = T0 + MS;
        let d = m.tick(
            T0 + 2 * MS,
            &[gpu(
                0,
                vec![p(1, Class::Offline, None), p(2, Class::Online, Some(act))],
            )],
        );
        assert_eq!(d.suspend, vec![(1, Reason::OnlineBusy { gpu: 0 })]);
        assert_eq!(
            d.transitions,
            vec![Transition::Preempt {
                gpu: 0,
                onset: act,
                signal: Signal::Nvml,
                decided_at: T0 + 2 * MS,
                offline: 1
            }]
        );
        // 99 ms after the last activity: still busy.
        let d = m.tick(
            act + 99 * MS,
            &[gpu(
                0,
                vec![p(1, Class::Offline, None), p(2, Class::Online, Some(act))],
            )],
        );
        assert!(d.is_empty(), "{d:?}");
        assert!(matches!(m.state(0), GpuState::OnlineBusy { .. }));
        // Exactly 100 ms: released.
        let d = m.tick(
            act + 100 * MS,
            &[gpu(
                0,
                vec![p(1, Class::Offline, None), p(2, Class::Online, Some(act))],
            )],
        );
        assert_eq!(d.resume, vec![1]);
        assert_eq!(
            d.transitions,
            vec![Transition::Release {
                gpu: 0,
                window_end: act + 100 * MS,
                window: 100 * MS,
                decided_at: act + 100 * MS,
                busy_for: 0,
                offline: 1
            }]
        );
        assert_eq!(m.state(0), GpuState::OfflineRunning);
    }

    /// A learned window releases once it has run out, never before; it is clamped to the
    /// floor and the idle window; without a floor set none is shorter than the idle window;
    /// and it is per GPU.
    #[test]
    fn a_learned_window_is_clamped_and_per_gpu() {
        let procs = |t| vec![p(1, Class::Offline, None), p(2, Class::Online, Some(t))];
        let mut m = Machine::new(Config::default());
        m.set_release_window(0, Some(3 * MS));
        assert_eq!(
            m.release_window(0),
            100 * MS,
            "no floor set: the idle window"
        );
        m.set_release_floor(2 * MS);
        m.set_release_window(0, Some(MS));
        assert_eq!(m.release_window(0), 2 * MS, "under the floor: the floor");
        m.set_release_window(0, Some(500 * MS));
        assert_eq!(
            m.release_window(0),
            100 * MS,
            "over the idle window: the idle window"
        );
        m.set_release_window(0, Some(5 * MS));
        assert_eq!(
            m.release_window(1),
            100 * MS,
            "another GPU keeps the idle window"
        );
        m.tick(T0, &[gpu(0, procs(T0)), gpu(1, procs(T0))]);
        let d = m.tick(T0 + 5 * MS - 1, &[gpu(0, procs(T0)), gpu(1, procs(T0))]);
        assert!(
            d.resume.is_empty(),
            "released before the window ran out: {d:?}"
        );
        let d = m.tick(T0 + 5 * MS, &[gpu(0, procs(T0)), gpu(1, procs(T0))]);
        assert!(
            matches!(d.transitions[..], [Transition::Release { gpu: 0, window, window_end, .. }]
                if window == 5 * MS && window_end == T0 + 5 * MS),
            "{d:?}"
        );
        m.set_release_window(0, None);
        assert_eq!(m.release_window(0), 100 * MS);
    }

    #[test]
    fn idle_window_edges_with_custom_window() {
        let mut m = Machine::new(Config {
            idle_window: 10 * MS,
            ..Config::default()
        });
        let procs = |t| {
            vec![gpu(
                0,
                vec![p(1, Class::Offline, None), p(2, Class::Online, Some(t))],
            )]
        };
        m.tick(T0, &procs(T0));
        assert_eq!(m.suspended().len(), 1);
        m.tick(T0 + 10 * MS - 1, &procs(T0));
        assert_eq!(m.suspended().len(), 1, "1 ns before the window ends");
        m.tick(T0 + 10 * MS, &procs(T0));
        assert!(m.suspended().is_empty(), "at the window's end");
    }

    #[test]
    fn offline_appearing_while_busy_is_suspended_at_once() {
        let mut m = Machine::new(Config::default());
        m.tick(T0, &[gpu(0, vec![p(2, Class::Online, Some(T0))])]);
        let d = m.tick(
            T0 + MS,
            &[gpu(
                0,
                vec![p(2, Class::Online, Some(T0)), p(7, Class::Offline, None)],
            )],
        );
        assert_eq!(d.suspend, vec![(7, Reason::OnlineBusy { gpu: 0 })]);
        assert!(d.transitions.is_empty());
    }

    #[test]
    fn gpus_are_independent() {
        let mut m = Machine::new(Config::default());
        let d = m.tick(
            T0,
            &[
                gpu(
                    0,
                    vec![p(1, Class::Offline, None), p(2, Class::Online, Some(T0))],
                ),
                gpu(1, vec![p(3, Class::Offline, None)]),
            ],
        );
        assert_eq!(d.suspend, vec![(1, Reason::OnlineBusy { gpu: 0 })]);
        assert_eq!(m.state(1), GpuState::OfflineRunning);
    }

    #[test]
    fn system_offline_activity_never_makes_busy_and_unmanaged_is_configurable() {
        let mut m = Machine::new(Config::default());
        let d = m.tick(
            T0,
            &[gpu(
                0,
                vec![
                    p(1, Class::Offline, Some(T0)),
                    p(2, Class::System, Some(T0)),
                ],
            )],
        );
        assert!(d.is_empty());
        let d = m.tick(
            T0 + MS,
            &[gpu(
                0,
                vec![p(1, Class::Offline, None), p(3, Class::Unmanaged, Some(T0))],
            )],
        );
        assert_eq!(d.suspend.len(), 1);
        let mut m = Machine::new(Config {
            unmanaged_is_online: false,
            ..Config::default()
        });
        let d = m.tick(
            T0,
            &[gpu(
                0,
                vec![p(1, Class::Offline, None), p(3, Class::Unmanaged, Some(T0))],
            )],
        );
        assert!(d.is_empty());
    }

    #[test]
    fn online_process_exit_keeps_window() {
        let mut m = Machine::new(Config::default());
        m.tick(
            T0,
            &[gpu(
                0,
                vec![p(1, Class::Offline, None), p(2, Class::Online, Some(T0))],
            )],
        );
        // The online process is gone, but it was active 50 ms ago: stay busy.
        let d = m.tick(T0 + 50 * MS, &[gpu(0, vec![p(1, Class::Offline, None)])]);
        assert!(d.is_empty());
        let d = m.tick(T0 + 100 * MS, &[gpu(0, vec![p(1, Class::Offline, None)])]);
        assert_eq!(d.resume, vec![1]);
    }

    #[test]
    fn disappeared_suspended_process_is_resumed() {
        let mut m = Machine::new(Config::default());
        m.tick(
            T0,
            &[gpu(
                0,
                vec![p(1, Class::Offline, None), p(2, Class::Online, Some(T0))],
            )],
        );
        let d = m.tick(T0 + MS, &[gpu(0, vec![p(2, Class::Online, Some(T0))])]);
        assert_eq!(d.resume, vec![1]);
        assert!(m.suspended().is_empty());
    }

    #[test]
    fn reclassified_offline_to_online_is_resumed() {
        let mut m = Machine::new(Config::default());
        m.tick(
            T0,
            &[gpu(
                0,
                vec![p(1, Class::Offline, None), p(2, Class::Online, Some(T0))],
            )],
        );
        let d = m.tick(
            T0 + MS,
            &[gpu(
                0,
                vec![p(1, Class::Online, None), p(2, Class::Online, Some(T0))],
            )],
        );
        assert_eq!(d.resume, vec![1]);
    }

    #[test]
    fn fixed_share_duty_cycle() {
        let mut m = Machine::new(Config {
            duty_period: 100 * MS,
            ..Config::default()
        });
        let fixed = |t| {
            vec![gpu(
                0,
                vec![
                    ProcessObs {
                        key: 1,
                        class: Class::Offline,
                        last_active: None,
                        onset: None,
                        signal: Signal::Nvml,
                        share: Share::Fixed { percent: 30 },
                    },
                    p(2, Class::Offline, None),
                ],
            )]
            .into_iter()
            .map(|g| (t, g))
            .collect::<Vec<_>>()
        };
        let base = 1_000 * 100 * MS; // a period boundary
        let mut suspended_ms = 0;
        for ms in 0..1000u64 {
            let (t, g) = fixed(base + ms * MS).pop().unwrap();
            m.tick(t, &[g]);
            if m.suspended().contains_key(&1) {
                suspended_ms += 1;
                assert_eq!(m.suspended()[&1], Reason::ShareCap);
            }
            assert!(
                !m.suspended().contains_key(&2),
                "burst share is never capped"
            );
        }
        assert_eq!(suspended_ms, 700, "30 % share runs 30 ms of every 100 ms");
        assert!(m.duty_allows(100, base + 99 * MS));
    }

    #[test]
    fn release_all_forgets() {
        let mut m = Machine::new(Config::default());
        m.tick(
            T0,
            &[gpu(
                0,
                vec![p(1, Class::Offline, None), p(2, Class::Online, Some(T0))],
            )],
        );
        assert_eq!(m.release_all(), vec![1]);
        assert!(m.suspended().is_empty());
        assert_eq!(m.state(0), GpuState::OfflineRunning);
    }

    fn class_strategy() -> impl Strategy<Value = Class> {
        prop_oneof![
            Just(Class::Online),
            Just(Class::OnlineExclusive),
            Just(Class::Offline),
            Just(Class::System),
            Just(Class::Unmanaged),
        ]
    }

    proptest! {
        // A failing case is printed, never written into the tree.
        #![proptest_config(ProptestConfig {
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        /// Over random histories: only offline processes are ever suspended, and an
        /// offline process on GPU g is suspended iff online activity on g was observed
        /// less than g's release window ago: the idle window, or a learned window set
        /// before the tick, never under the floor nor over the idle window.
        #[test]
        fn invariants(
            steps in prop::collection::vec(
                (1u64..60, prop::collection::vec((0u32..3, 0u32..6, class_strategy(), prop::option::of(0u64..150)), 0..8),
                 prop::collection::vec(prop::option::of(0u64..150), 3)),
                1..40),
            window_ms in 1u64..120,
            floor_ms in prop::option::of(0u64..30),
            unmanaged_is_online in any::<bool>(),
        ) {
            let config = Config { idle_window: window_ms * MS, unmanaged_is_online, ..Config::default() };
            let mut m: Machine<(u32, u32)> = Machine::new(config);
            if let Some(f) = floor_ms {
                m.set_release_floor(f * MS);
            }
            // The model of a GPU's window: what was set, clamped; the idle window without a floor.
            let effective = |w: Option<u64>| match (w, floor_ms) {
                (Some(w), Some(f)) => (w * MS).clamp((f * MS).min(window_ms * MS), window_ms * MS),
                _ => window_ms * MS,
            };
            let mut now = T0;
            // Model: latest online activity seen per GPU.
            let mut last_online: BTreeMap<u32, Nanos> = BTreeMap::new();
            let mut suspended_model: BTreeSet<(u32, u32)> = BTreeSet::new();
            for (advance_ms, procs, wins) in steps {
                now += advance_ms * MS;
                for (g, w) in wins.iter().enumerate() {
                    m.set_release_window(g as u32, w.map(|w| w * MS));
                    prop_assert_eq!(m.release_window(g as u32), effective(*w));
                }
                let mut inputs: BTreeMap<u32, Vec<ProcessObs<(u32, u32)>>> = (0..3).map(|g| (g, vec![])).collect();
                let mut classes = BTreeMap::new();
                for (g, id, class, ago) in procs {
                    // Keys are unique per GPU (a process on one GPU).
                    let key = (g, id);
                    if classes.contains_key(&key) { continue; }
                    classes.insert(key, class);
                    let last_active = ago.map(|a| now - a * MS);
                    if class.is_online_demand(unmanaged_is_online) {
                        if let Some(t) = last_active {
                            let e = last_online.entry(g).or_insert(t);
                            *e = (*e).max(t);
                        }
                    }
                    inputs.get_mut(&g).unwrap().push(ProcessObs { key, class, last_active, onset: None, signal: Signal::Nvml, share: Share::Burst });
                }
                let inputs: Vec<_> = inputs.into_iter().map(|(gpu, procs)| GpuInput { gpu, procs, sampled_busy: false }).collect();
                let d = m.tick(now, &inputs);
                for (k, _) in &d.suspend {
                    prop_assert_eq!(classes.get(k), Some(&Class::Offline));
                    prop_assert!(suspended_model.insert(*k), "suspended twice");
                }
                for k in &d.resume {
                    prop_assert!(suspended_model.remove(k), "resumed something not suspended");
                }
                for (k, class) in &classes {
                    let busy = last_online.get(&k.0).is_some_and(|t| now - t < effective(wins[k.0 as usize]));
                    let want = *class == Class::Offline && busy;
                    prop_assert_eq!(m.suspended().contains_key(k), want, "{:?} {:?} busy={}", k, class, busy);
                }
                // Nothing absent from this tick stays suspended.
                for k in m.suspended().keys() {
                    prop_assert!(classes.contains_key(k));
                }
                prop_assert_eq!(m.suspended().keys().copied().collect::<BTreeSet<_>>(), suspended_model.clone());
                // A busy GPU's state agrees.
                for g in 0..3 {
                    let busy = last_online.get(&g).is_some_and(|t| now - t < effective(wins[g as usize]));
                    prop_assert_eq!(matches!(m.state(g), GpuState::OnlineBusy { .. }), busy);
                    if !busy { last_online.remove(&g); }
                }
            }
        }
    }
}
