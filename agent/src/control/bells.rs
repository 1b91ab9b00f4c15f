//! Doorbells in the loop: the CUDA shim's launch times, attributed to online processes.
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
//! sooner, which that owner could cause anyway by launching work.
//!
//! Corroboration: launch times are the tenant's word, clamped to now. An owner whose pages
//! kept a GPU busy without a break for `--doorbell-trust-window` while no NVML sample of
//! its processes on that GPU showed any work in that time is distrusted on that GPU (an
//! event, a metric, a log line, `/state`): its launches count for nothing until a sample
//! shows it at work. Owners are pods (all their processes and pages) or, standalone,
//! processes.

use super::table::Activity;
use super::Loop;
use crate::edges::doorbell::{BellReading, Doorbells, Owner, PageInfo};
use qos_core::{Class, Signal};
use std::collections::HashMap;
use tracing::{info, warn};

/// Why a reading was not attributed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reject {
    /// The reading names a GPU this node does not have.
    UnknownGpu,
    /// No known process owns the page.
    UnknownOwner,
    /// Its owner is not online.
    NotOnline,
    /// The page's file owner is not the process's user.
    UidMismatch,
    /// Its owner does not use the GPU the reading names.
    NotOnGpu,
    /// Its owner's claims kept the GPU busy while NVML never showed the owner at work.
    Uncorroborated,
}

impl Reject {
    const ALL: [Reject; 6] = [
        Reject::UnknownGpu,
        Reject::UnknownOwner,
        Reject::NotOnline,
        Reject::UidMismatch,
        Reject::NotOnGpu,
        Reject::Uncorroborated,
    ];

    /// Metric label.
    fn as_str(self) -> &'static str {
        match self {
            Reject::UnknownGpu => "unknown_gpu",
            Reject::UnknownOwner => "unknown_owner",
            Reject::NotOnline => "not_online",
            Reject::UidMismatch => "uid_mismatch",
            Reject::NotOnGpu => "not_on_gpu",
            Reject::Uncorroborated => "uncorroborated",
        }
    }
}

/// The loop's doorbell state.
pub(super) struct Bells {
    edge: Box<dyn Doorbells>,
    /// GPU UUID bytes → GPU index.
    uuid_gpu: HashMap<[u8; 16], u32>,
    pages: HashMap<u64, PageState>,
    buf: Vec<BellReading>,
    /// Readings older than this are history (the agent's start).
    started_ns: u64,
    next_scan_ns: u64,
    /// When the directories of pods that are gone are next looked for.
    next_sweep_ns: u64,
    window_ns: u64,
    /// `--doorbell-trust-window`, ns (0: never distrust).
    trust_ns: u64,
    /// Per owner and GPU: the run its pages' claims keep going, and whether it is trusted.
    claims: HashMap<(Owner, u32), Claim>,
    /// The attributed pages last handed to the edge to wait on first.
    preferred: Vec<u64>,
}

/// An owner's claims on one GPU, in the agent's terms (clamped, merged across its pages).
#[derive(Debug, Clone, Copy)]
struct Claim {
    /// Start and end of the current run: claims less than the idle window apart.
    run_start: u64,
    run_end: u64,
    /// Distrusted since.
    distrusted_at: Option<u64>,
}

/// How long a page found and not rejected counts as new (waited on first).
const NEW_PAGE_NS: u64 = 10_000_000_000;
/// How often the directories of pods that are gone are looked for.
const SWEEP_EVERY_NS: u64 = 60_000_000_000;
/// A pod's directory is removed only when nothing changed in it for this long (and the
/// pod source says the pod is gone).
const POD_DIR_IDLE: std::time::Duration = std::time::Duration::from_secs(300);

struct PageState {
    info: PageInfo,
    /// The latest rejection logged for this page.
    rejected: Option<Reject>,
    attributed: bool,
    refresh_asked_ns: u64,
    /// When the agent found the page.
    found_ns: u64,
    /// The readings last attributed, per GPU UUID: (last launch, run start). The same
    /// reading again is not attributed again (most ticks read pages that did not change).
    noted: Vec<([u8; 16], u64, u64)>,
}

impl std::fmt::Debug for Bells {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bells")
            .field("pages", &self.pages.len())
            .finish_non_exhaustive()
    }
}

impl Bells {
    pub(super) fn new(
        edge: Box<dyn Doorbells>,
        uuids: &[(u32, String)],
        now: u64,
        window_ns: u64,
        trust_ns: u64,
    ) -> Bells {
        for r in Reject::ALL {
            metrics::counter!("coloc_doorbell_rejected_total", "reason" => r.as_str()).absolute(0);
        }
        metrics::counter!("coloc_doorbell_wakeups_total").absolute(0);
        let mut uuid_gpu = HashMap::new();
        for (gpu, s) in uuids {
            match coloc_doorbell::parse_uuid(s) {
                Some(u) => {
                    uuid_gpu.insert(u, *gpu);
                }
                None => {
                    warn!(gpu, uuid = %s, "GPU UUID not in NVML's form: doorbells cannot name this GPU")
                }
            }
        }
        Bells {
            edge,
            uuid_gpu,
            pages: HashMap::new(),
            buf: Vec::new(),
            started_ns: now,
            next_scan_ns: 0,
            next_sweep_ns: now + SWEEP_EVERY_NS,
            window_ns,
            trust_ns,
            claims: HashMap::new(),
            preferred: Vec::new(),
        }
    }

    /// Owners distrusted now, per GPU, for `/state` (also sets the gauge).
    pub(super) fn distrusted(&self) -> Vec<crate::control::state::DistrustedPage> {
        let mut out: Vec<_> = self
            .claims
            .iter()
            .filter_map(|((owner, gpu), c)| {
                c.distrusted_at
                    .map(|since_ns| crate::control::state::DistrustedPage {
                        owner: owner_label(owner),
                        gpu: *gpu,
                        since_ns,
                    })
            })
            .collect();
        out.sort_by(|a, b| (a.gpu, &a.owner).cmp(&(b.gpu, &b.owner)));
        metrics::gauge!("coloc_doorbell_distrusted_pages").set(out.len() as f64);
        out
    }

    /// Sleeps until a doorbell rings or `timeout` passes; true when woken early.
    /// A run started (or the waker was woken) since the latest read.
    pub(super) fn rang(&self) -> bool {
        self.edge.rang()
    }

    pub(super) fn wait(&mut self, timeout: std::time::Duration) -> bool {
        self.edge.wait(timeout)
    }

    /// The pages found so far.
    pub(super) fn page_infos(&self) -> impl Iterator<Item = &PageInfo> {
        self.pages.values().map(|p| &p.info)
    }

    /// Page `page`'s launch-gate fields.
    pub(super) fn read_gate(&self, page: u64, out: &mut Vec<coloc_doorbell::GateReading>) {
        self.edge.read_gate(page, out);
    }

    /// The UUID bytes of `gpu`.
    pub(super) fn uuid_of(&self, gpu: u32) -> Option<[u8; 16]> {
        self.uuid_gpu
            .iter()
            .find(|(_, g)| **g == gpu)
            .map(|(u, _)| *u)
    }
}

impl Loop {
    /// Reads every doorbell page and notes the launches of online processes.
    pub(super) fn ring_bells(&mut self, now: u64) {
        let found_ns = now;
        if now >= self.bells.next_sweep_ns {
            // Kubernetes: the directories of deleted pods (the kubelet leaves host paths).
            self.bells.next_sweep_ns = now + SWEEP_EVERY_NS;
            let source = &self.classifier.source;
            let removed = self
                .bells
                .edge
                .sweep_pods(&|uid| source.pod_gone(uid), POD_DIR_IDLE);
            if !removed.is_empty() {
                metrics::counter!("coloc_doorbell_pod_dirs_removed_total")
                    .increment(removed.len() as u64);
            }
        }
        // Claims live as long as their owner has a page or a process here: an owner that
        // swaps its page keeps its run and its distrust.
        let table = &self.table;
        let alive = |owner: &Owner| match owner {
            Owner::Pid(pid) => table.by_pid(*pid).is_some(),
            Owner::Pod(uid) => table
                .entries()
                .any(|e| e.pod_uid.as_deref() == Some(uid.as_str())),
        };
        let b = &mut self.bells;
        let force = now >= b.next_scan_ns;
        if force {
            b.next_scan_ns = now + 1_000_000_000;
        }
        if b.edge.rescan(force) {
            let infos = b.edge.pages();
            b.pages.retain(|id, _| infos.iter().any(|i| i.id == *id));
            b.claims
                .retain(|(owner, _), _| infos.iter().any(|i| &i.owner == owner) || alive(owner));
            for info in infos {
                if info.wake_gap_ns > b.window_ns {
                    warn!(page = %info.path.display(), wake_gap_ms = info.wake_gap_ns as f64 / 1e6, idle_window_ms = b.window_ns as f64 / 1e6,
                        "Doorbell wake gap longer than the idle window: a launch after a pause between the two is seen at the next tick, not at once (set COLOC_SHIM_WAKE_GAP_MS to the idle window)");
                }
                b.pages.entry(info.id).or_insert(PageState {
                    info,
                    rejected: None,
                    attributed: false,
                    refresh_asked_ns: 0,
                    found_ns,
                    noted: Vec::new(),
                });
            }
        }
        let mut buf = std::mem::take(&mut b.buf);
        buf.clear();
        // Always, pages or not: the read also notes the wake words for the next sleep.
        b.edge.read(&mut buf);
        for r in &buf {
            self.attribute(r, now);
        }
        self.bells.buf = buf;
        // The pages whose launches count are the ones worth a wake-up: attributed ones,
        // and new ones not rejected yet (a new process's first launch).
        let b = &mut self.bells;
        let mut ids: Vec<u64> = b
            .pages
            .iter()
            .filter(|(_, p)| {
                p.attributed
                    || (p.rejected.is_none() && now.saturating_sub(p.found_ns) < NEW_PAGE_NS)
            })
            .map(|(id, _)| *id)
            .collect();
        ids.sort_unstable();
        if ids != b.preferred {
            b.edge.prefer(&ids);
            b.preferred = ids;
        }
    }

    fn attribute(&mut self, r: &BellReading, now: u64) {
        // A launch time is the tenant's word: one in the future would keep its idle window
        // open (and offline work frozen) without any GPU work. Clamped to now.
        let last = r.reading.last_launch_ns.min(now);
        let Some(gpu) = self.bells.uuid_gpu.get(&r.reading.uuid).copied() else {
            self.reject(r.page, Reject::UnknownGpu);
            return;
        };
        let blind = self
            .blind_until
            .get(&gpu)
            .copied()
            .unwrap_or(0)
            .max(self.bells.started_ns);
        if last <= blind || self.health.degraded(gpu) {
            return;
        }
        let Some(page) = self.bells.pages.get(&r.page) else {
            return;
        };
        // The page's own words, so that a claim clamped to a later now is not new each tick.
        let reading = (
            r.reading.uuid,
            r.reading.last_launch_ns,
            r.reading.busy_since_ns,
        );
        if page.attributed && page.noted.contains(&reading) {
            return;
        }
        let found = self.owner_of(&page.info, gpu);
        let key = match found {
            Ok(k) => k,
            Err(why) => {
                // A process that just started is listed by the driver before the next
                // periodic read: read the lists now (at most once a second per page).
                if matches!(why, Reject::UnknownOwner | Reject::NotOnGpu) {
                    let p = self.bells.pages.get_mut(&r.page).expect("checked above");
                    if now.saturating_sub(p.refresh_asked_ns) >= 1_000_000_000 {
                        p.refresh_asked_ns = now;
                        self.refresh_asked = Some(super::observe::Refresh::Doorbell);
                        return;
                    }
                }
                self.reject(r.page, why);
                return;
            }
        };
        let start = r.reading.busy_since_ns.min(last).max(blind);
        if !self.corroborated(r.page, gpu, start, last, now) {
            return;
        }
        let p = self.bells.pages.get_mut(&r.page).expect("checked above");
        p.noted.retain(|n| n.0 != reading.0);
        p.noted.push(reading);
        if !p.attributed {
            p.attributed = true;
            p.rejected = None;
            info!(page = %p.info.path.display(), pid = key.pid, gpu, "Doorbell page attributed to an online process");
        }
        self.table.note(
            &key,
            gpu,
            Activity {
                start,
                end: last,
                through_end: false,
                signal: Signal::Doorbell,
                window: self.bells.window_ns,
            },
        );
    }

    /// Notes a page's claim `[start, end]` on `gpu` in its owner's run; false when the owner
    /// is distrusted there (the claim then counts for nothing). An owner whose run has
    /// lasted `--doorbell-trust-window` with no NVML sample of its processes at work on
    /// that GPU in that time becomes distrusted; a sample after that restores it.
    fn corroborated(&mut self, page: u64, gpu: u32, start: u64, end: u64, now: u64) -> bool {
        let Some(p) = self.bells.pages.get(&page) else {
            return false;
        };
        let owner = p.info.owner.clone();
        let path = p.info.path.display().to_string();
        let seen = self.nvml_seen_by(&owner, gpu);
        let (window, trust) = (self.bells.window_ns, self.bells.trust_ns);
        let c = self
            .bells
            .claims
            .entry((owner.clone(), gpu))
            .or_insert(Claim {
                run_start: start,
                run_end: end,
                distrusted_at: None,
            });
        // A pause starts a new run only when it let offline work run: longer than the idle
        // window with a margin (a pause of exactly the window re-arms the hold in the tick
        // that would release it).
        if start >= c.run_end.saturating_add(2 * window) {
            c.run_start = start;
        }
        c.run_end = c.run_end.max(end);
        let claimed_s = c.run_end.saturating_sub(c.run_start) as f64 / 1e9;
        let event = match c.distrusted_at {
            Some(at) if seen.is_some_and(|s| s > at) => {
                c.distrusted_at = None;
                c.run_start = start;
                Some(true)
            }
            Some(_) => return false,
            None if trust > 0
                && c.run_end.saturating_sub(c.run_start) >= trust
                && seen.is_none_or(|s| s.saturating_add(trust) < now) =>
            {
                c.distrusted_at = Some(now);
                Some(false)
            }
            None => None,
        };
        let Some(restored) = event else {
            return true;
        };
        if !restored {
            metrics::counter!("coloc_doorbell_rejected_total", "reason" => Reject::Uncorroborated.as_str())
                .increment(1);
        }
        self.telemetry
            .emit(super::events::Event::Distrust(super::events::Distrust {
                gpu,
                at_ns: now,
                page: path,
                owner: owner_label(&owner),
                claimed_s,
                nvml_seen_ns: seen,
                restored,
            }));
        restored
    }

    /// End of the latest sampled period that showed any process of `owner` at work on
    /// `gpu`.
    fn nvml_seen_by(&self, owner: &Owner, gpu: u32) -> Option<u64> {
        let of = |e: &&super::entry::Entry| match owner {
            Owner::Pid(pid) => e.key.pid == *pid,
            Owner::Pod(uid) => e.pod_uid.as_deref() == Some(uid.as_str()),
        };
        self.table
            .entries()
            .filter(of)
            .filter_map(|e| e.nvml_seen.get(&gpu).copied())
            .max()
    }

    /// The online process a page's reading for `gpu` counts for, or why none does.
    fn owner_of(&self, info: &PageInfo, gpu: u32) -> Result<crate::edges::procfs::ProcKey, Reject> {
        match &info.owner {
            Owner::Pid(pid) => match self.table.by_pid(*pid) {
                None => Err(Reject::UnknownOwner),
                Some(e) if e.cls.class != Class::Online => Err(Reject::NotOnline),
                Some(e) if e.uid != info.file_uid => Err(Reject::UidMismatch),
                Some(e) if !e.gpus.contains(&gpu) => Err(Reject::NotOnGpu),
                Some(e) => Ok(e.key),
            },
            Owner::Pod(uid) => {
                let mut of_pod = self
                    .table
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

    fn reject(&mut self, page: u64, why: Reject) {
        debug_assert!(why != Reject::Uncorroborated, "counted where it is decided");
        let now = self.clock.now_ns();
        let Some(p) = self.bells.pages.get_mut(&page) else {
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
            metrics::counter!("coloc_doorbell_rejected_total", "reason" => why.as_str())
                .increment(1);
            warn!(page = %p.info.path.display(), owner = ?p.info.owner, file_uid = p.info.file_uid, reason = why.as_str(),
                "Doorbell page not attributed: its launches count for nothing");
        }
    }
}

/// `pid:<n>` or `pod:<uid>`.
fn owner_label(owner: &Owner) -> String {
    match owner {
        Owner::Pid(pid) => format!("pid:{pid}"),
        Owner::Pod(uid) => format!("pod:{uid}"),
    }
}
