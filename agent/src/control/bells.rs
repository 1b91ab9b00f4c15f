//! Doorbells in the controller: the CUDA shim's launch times, attributed to online
//! processes. The shell reads the pages (the doorbell edge); this room decides
//! what a reading counts for.
//!
//! Trust: a page's readings count only for a process the table already knows and
//! classifies as **online**, on the GPU the reading names, and that owns the page:
//! - standalone (`<dir>/<pid>-….bell`): the process with that PID, whose real UID owns
//!   the file;
//! - Kubernetes (`<dir>/pods/<uid>/…`): a process of the pod with that UID (the directory
//!   is mounted into that pod alone).
//!
//! Anything else is rejected, counted by reason, and logged once per page. A page never
//! names whom to suspend: it can only make its own online owner's activity visible
//! sooner, which that owner could cause anyway by launching work. Claims are corroborated
//! by NVML ([`crate::control::claims`]).

use super::claims::{Claimed, Claims};
use super::learn::Learner;
use super::note::{self, Note, Reject};
use super::table::{Activity, Table};
use crate::control::events::Event;
use crate::control::model::bell::{BellReading, Owner, PageInfo};
use crate::control::model::ProcKey;
use qos_core::{Class, Signal};
use std::collections::HashMap;

/// How long a page found and not rejected counts as new (waited on first).
const NEW_PAGE_NS: u64 = 10_000_000_000;
/// How often the directories of pods that are gone are looked for.
const SWEEP_EVERY_NS: u64 = 60_000_000_000;
/// How often every doorbell directory is rescanned, changed or not.
const RESCAN_EVERY_NS: u64 = 1_000_000_000;

/// The controller's doorbell state.
#[derive(Debug)]
pub struct Bells {
    /// GPU UUID bytes → GPU index.
    uuid_gpu: HashMap<[u8; 16], u32>,
    pages: HashMap<u64, PageState>,
    /// Readings older than this are history (the agent's start).
    started_ns: u64,
    next_scan_ns: u64,
    /// When the directories of pods that are gone are next looked for.
    next_sweep_ns: u64,
    window_ns: u64,
    claims: Claims,
    /// The attributed pages last handed to the edge to wait on first.
    preferred: Vec<u64>,
}

#[derive(Debug)]
struct PageState {
    info: PageInfo,
    /// The latest rejection logged for this page.
    rejected: Option<Reject>,
    attributed: bool,
    refresh_asked_ns: u64,
    /// When the agent found the page.
    found_ns: u64,
    /// The readings last attributed, per GPU UUID: (last launch, run start, completion
    /// stamp). The same reading again is not attributed again (most ticks read pages that
    /// did not change).
    noted: Vec<([u8; 16], u64, u64, u64)>,
}

/// What the rest of the tick needs from a round of readings.
#[derive(Debug, Default)]
pub struct Rung {
    /// A launch of a process the lists do not hold yet: read them now.
    pub refresh: bool,
}

impl Bells {
    /// Doorbells for GPUs with these UUID bytes, found from `now`, with the idle window and
    /// `--doorbell-trust-window`, ns.
    pub fn new(uuids: &[(u32, [u8; 16])], now: u64, window_ns: u64, trust_ns: u64) -> Bells {
        Bells {
            uuid_gpu: uuids.iter().map(|(g, u)| (*u, *g)).collect(),
            pages: HashMap::new(),
            started_ns: now,
            next_scan_ns: 0,
            next_sweep_ns: now + SWEEP_EVERY_NS,
            window_ns,
            claims: Claims::new(window_ns, trust_ns),
            preferred: Vec::new(),
        }
    }

    /// Whether this tick's read forces a rescan of every directory, and sweeps the
    /// directories of pods that are gone (each due at its own period).
    pub fn due(&mut self, now: u64) -> (bool, bool) {
        let force = now >= self.next_scan_ns;
        if force {
            self.next_scan_ns = now + RESCAN_EVERY_NS;
        }
        let sweep = now >= self.next_sweep_ns;
        if sweep {
            self.next_sweep_ns = now + SWEEP_EVERY_NS;
        }
        (force, sweep)
    }

    /// The pages changed: these are mapped now. Claims live as long as their owner has a
    /// page or a process here: an owner that swaps its page keeps its run and its distrust.
    pub fn pages_changed(
        &mut self,
        infos: Vec<PageInfo>,
        table: &Table,
        now: u64,
        notes: &mut Vec<Note>,
    ) {
        let alive = |owner: &Owner| match owner {
            Owner::Pid(pid) => table.by_pid(*pid).is_some(),
            Owner::Pod(uid) => table
                .entries()
                .any(|e| e.pod_uid.as_deref() == Some(uid.as_str())),
        };
        self.pages.retain(|id, _| infos.iter().any(|i| i.id == *id));
        self.claims
            .retain(|owner| infos.iter().any(|i| &i.owner == owner) || alive(owner));
        for info in infos {
            if info.wake_gap_ns > self.window_ns && !self.pages.contains_key(&info.id) {
                notes.push(
                    note::WakeGapTooLong {
                        page: info.path.clone(),
                        wake_gap_ns: info.wake_gap_ns,
                        window_ns: self.window_ns,
                    }
                    .into(),
                );
            }
            self.pages.entry(info.id).or_insert(PageState {
                info,
                rejected: None,
                attributed: false,
                refresh_asked_ns: 0,
                found_ns: now,
                noted: Vec::new(),
            });
        }
    }

    /// Attributes this round's readings; `blind(gpu)`: readings at or before it are
    /// history; `degraded(gpu)`: the GPU is unmanaged.
    #[allow(clippy::too_many_arguments)]
    pub fn attribute(
        &mut self,
        readings: &[BellReading],
        now: u64,
        table: &mut Table,
        learner: &mut Learner,
        blind: impl Fn(u32) -> u64,
        degraded: impl Fn(u32) -> bool,
        events: &mut Vec<Event>,
        notes: &mut Vec<Note>,
    ) -> Rung {
        let mut rung = Rung::default();
        for r in readings {
            // A launch time is the tenant's word: one in the future would keep its idle
            // window open (and offline work frozen) without any GPU work. Clamped to now.
            let last = r.reading.last_launch_ns.min(now);
            let Some(gpu) = self.uuid_gpu.get(&r.reading.uuid).copied() else {
                self.reject(r.page, Reject::UnknownGpu, now, notes);
                continue;
            };
            let blind = blind(gpu).max(self.started_ns);
            if last <= blind || degraded(gpu) {
                continue;
            }
            let Some(page) = self.pages.get(&r.page) else {
                continue;
            };
            // The page's own words, so that a claim clamped to a later now is not new each
            // tick.
            let reading = (
                r.reading.uuid,
                r.reading.last_launch_ns,
                r.reading.busy_since_ns,
                r.drained_ns,
            );
            if page.attributed && page.noted.contains(&reading) {
                continue;
            }
            let key = match owner_of(table, &page.info, gpu) {
                Ok(k) => k,
                Err(why) => {
                    // A process that just started is listed by the driver before the next
                    // periodic read: read the lists now (at most once a second per page).
                    if matches!(why, Reject::UnknownOwner | Reject::NotOnGpu) {
                        let p = self.pages.get_mut(&r.page).expect("checked above");
                        if now.saturating_sub(p.refresh_asked_ns) >= 1_000_000_000 {
                            p.refresh_asked_ns = now;
                            rung.refresh = true;
                            continue;
                        }
                    }
                    self.reject(r.page, why, now, notes);
                    continue;
                }
            };
            let start = r.reading.busy_since_ns.min(last).max(blind);
            let claimed = Claimed {
                owner: &page.info.owner,
                page: &page.info.path,
                gpu,
                start,
                end: last,
                seen: nvml_seen_by(table, &page.info.owner, gpu),
                gpu_seen: nvml_seen_online(table, gpu),
            };
            if !self.claims.judge(claimed, now, events, notes) {
                continue;
            }
            let p = self.pages.get_mut(&r.page).expect("checked above");
            p.noted.retain(|n| n.0 != reading.0);
            p.noted.push(reading);
            if !p.attributed {
                p.attributed = true;
                p.rejected = None;
                notes.push(
                    note::PageAttributed {
                        page: p.info.path.clone(),
                        pid: key.pid,
                        gpu,
                    }
                    .into(),
                );
            }
            // With the learned release window, activity ends when the work was seen complete
            // (the completion stamp, when later than the launch).
            let wake_gap = self
                .pages
                .get(&r.page)
                .map_or(u64::MAX, |p| p.info.wake_gap_ns);
            let end = learner.observe(
                key,
                gpu,
                (
                    last,
                    r.reading.busy_since_ns.min(last),
                    r.drained_ns.min(now),
                ),
                wake_gap,
            );
            table.note(
                &key,
                gpu,
                Activity {
                    start,
                    end,
                    through_end: false,
                    signal: Signal::Doorbell,
                    window: self.window_ns,
                },
            );
        }
        rung
    }

    /// The pages worth a wake-up, when they changed: attributed ones, and new ones not
    /// rejected yet (a new process's first launch).
    pub fn preferred(&mut self, now: u64) -> Option<Vec<u64>> {
        let mut ids: Vec<u64> = self
            .pages
            .iter()
            .filter(|(_, p)| {
                p.attributed
                    || (p.rejected.is_none() && now.saturating_sub(p.found_ns) < NEW_PAGE_NS)
            })
            .map(|(id, _)| *id)
            .collect();
        ids.sort_unstable();
        (ids != self.preferred).then(|| {
            self.preferred = ids.clone();
            ids
        })
    }

    /// Owners distrusted now, per GPU, for `/state`.
    pub fn distrusted(&self) -> Vec<crate::control::state::DistrustedPage> {
        self.claims.distrusted()
    }

    /// The pages found so far.
    pub fn page_infos(&self) -> impl Iterator<Item = &PageInfo> {
        self.pages.values().map(|p| &p.info)
    }

    /// The UUID bytes of `gpu`.
    pub fn uuid_of(&self, gpu: u32) -> Option<[u8; 16]> {
        self.uuid_gpu
            .iter()
            .find(|(_, g)| **g == gpu)
            .map(|(u, _)| *u)
    }

    fn reject(&mut self, page: u64, why: Reject, now: u64, notes: &mut Vec<Note>) {
        debug_assert!(why != Reject::Uncorroborated, "counted where it is decided");
        let Some(p) = self.pages.get_mut(&page) else {
            return;
        };
        // A process that just started may not be listed by the driver yet: only an owner
        // still unknown a second after its page appeared is a rejection.
        if why == Reject::UnknownOwner && now.saturating_sub(p.found_ns) < 1_000_000_000 {
            return;
        }
        if p.rejected != Some(why) {
            p.rejected = Some(why);
            p.attributed = false;
            notes.push(
                note::PageRejected {
                    page: p.info.path.clone(),
                    owner: p.info.owner.clone(),
                    file_uid: p.info.file_uid,
                    reason: why,
                }
                .into(),
            );
        }
    }
}

/// End of the latest sampled period that showed any process of `owner` at work on `gpu`.
fn nvml_seen_by(table: &Table, owner: &Owner, gpu: u32) -> Option<u64> {
    let of = |e: &&super::entry::Entry| match owner {
        Owner::Pid(pid) => e.key.pid == *pid,
        Owner::Pod(uid) => e.pod_uid.as_deref() == Some(uid.as_str()),
    };
    table
        .entries()
        .filter(of)
        .filter_map(|e| e.nvml_seen.get(&gpu).copied())
        .max()
}

/// End of the latest sampled period that showed any online process at work on `gpu`.
fn nvml_seen_online(table: &Table, gpu: u32) -> Option<u64> {
    table
        .entries()
        .filter(|e| e.cls.class == qos_core::Class::Online)
        .filter_map(|e| e.nvml_seen.get(&gpu).copied())
        .max()
}

/// The online process a page's reading for `gpu` counts for, or why none does.
fn owner_of(table: &Table, info: &PageInfo, gpu: u32) -> Result<ProcKey, Reject> {
    match &info.owner {
        Owner::Pid(pid) => match table.by_pid(*pid) {
            None => Err(Reject::UnknownOwner),
            Some(e) if e.cls.class != Class::Online => Err(Reject::NotOnline),
            Some(e) if e.uid != info.file_uid => Err(Reject::UidMismatch),
            Some(e) if !e.gpus.contains(&gpu) => Err(Reject::NotOnGpu),
            Some(e) => Ok(e.key),
        },
        Owner::Pod(uid) => {
            let mut of_pod = table
                .entries()
                .filter(|e| e.pod_uid.as_deref() == Some(uid.as_str()))
                .peekable();
            if of_pod.peek().is_none() {
                Err(Reject::UnknownOwner)
            } else {
                let mut online = of_pod.filter(|e| e.cls.class == Class::Online).peekable();
                if online.peek().is_none() {
                    Err(Reject::NotOnline)
                } else {
                    online
                        .find(|e| e.gpus.contains(&gpu))
                        .map(|e| e.key)
                        .ok_or(Reject::NotOnGpu)
                }
            }
        }
    }
}
