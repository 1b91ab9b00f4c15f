//! Corroboration of doorbell claims: launch times are the tenant's word, so an owner's
//! claims are checked against the driver's samples.
//!
//! Per owner (a pod; standalone, a process) and GPU, the run its pages' claims keep going
//! (claims less than twice the idle window apart, merged across its pages). An owner whose
//! run has lasted `--doorbell-trust-window` while no NVML sample of its processes on that
//! GPU showed work in that time is distrusted there: its launches count for nothing until
//! a sample shows it at work again.
//!
//! Per GPU as well, across owners: the run that all owners' claims keep going together. A
//! pause of one owner covered by another's claims lets no offline work run, so it does not
//! end the GPU's run. Once that run has lasted the trust window while no NVML sample showed
//! any online process at work on the GPU, every owner that claims in it is distrusted
//! there: claims relayed between two processes (or pods) that each pause in turn hold
//! offline work no longer than one alone.

use crate::control::events::{Distrust, Event};
use crate::control::model::bell::Owner;
use crate::control::note::{self, Note};
use crate::control::state::DistrustedPage;
use std::collections::HashMap;

/// An owner's claims on one GPU, in the agent's terms (clamped, merged across its pages).
#[derive(Debug, Clone, Copy)]
struct Claim {
    /// Start and end of the current run: claims less than the idle window apart.
    run_start: u64,
    run_end: u64,
    /// Distrusted since.
    distrusted_at: Option<u64>,
}

/// A GPU's claims, all owners together.
#[derive(Debug, Clone, Copy)]
struct GpuRun {
    /// Start and end of the run the claims of every owner keep going.
    start: u64,
    end: u64,
}

/// Every owner's claims.
#[derive(Debug, Default)]
pub struct Claims {
    claims: HashMap<(Owner, u32), Claim>,
    gpus: HashMap<u32, GpuRun>,
    window_ns: u64,
    /// `--doorbell-trust-window`, ns (0: never distrust).
    trust_ns: u64,
}

/// A claim to judge.
#[derive(Debug)]
pub struct Claimed<'a> {
    /// Whose.
    pub owner: &'a Owner,
    /// Its page (for the event).
    pub page: &'a std::path::Path,
    /// On which GPU.
    pub gpu: u32,
    /// The claimed run's start and last launch, clamped, ns.
    pub start: u64,
    /// The latest launch, ns.
    pub end: u64,
    /// End of the latest sampled period that showed any process of the owner at work on
    /// that GPU.
    pub seen: Option<u64>,
    /// End of the latest sampled period that showed any online process at work on that
    /// GPU.
    pub gpu_seen: Option<u64>,
}

impl Claims {
    /// Claims judged with this idle window and trust window, ns.
    pub fn new(window_ns: u64, trust_ns: u64) -> Claims {
        Claims {
            claims: HashMap::new(),
            gpus: HashMap::new(),
            window_ns,
            trust_ns,
        }
    }

    /// Keeps only the owners `keep` names.
    pub fn retain(&mut self, keep: impl Fn(&Owner) -> bool) {
        self.claims.retain(|(owner, _), _| keep(owner));
    }

    /// Notes a claim in its owner's run; false when the owner is distrusted there (the
    /// claim then counts for nothing). Distrust and restoration are events.
    pub fn judge(
        &mut self,
        c: Claimed<'_>,
        now: u64,
        out: &mut Vec<Event>,
        notes: &mut Vec<Note>,
    ) -> bool {
        let (window, trust) = (self.window_ns, self.trust_ns);
        // The GPU's run, every owner's claims together: only a pause no claim covers lets
        // offline work run.
        let run = self.gpus.entry(c.gpu).or_insert(GpuRun {
            start: c.start,
            end: c.end,
        });
        if c.start >= run.end.saturating_add(2 * window) {
            run.start = c.start;
        }
        run.end = run.end.max(c.end);
        let gpu_uncorroborated = trust > 0
            && run.end.saturating_sub(run.start) >= trust
            && c.gpu_seen.is_none_or(|s| s.saturating_add(trust) < now);
        let gpu_claimed_s = run.end.saturating_sub(run.start) as f64 / 1e9;
        let claim = self
            .claims
            .entry((c.owner.clone(), c.gpu))
            .or_insert(Claim {
                run_start: c.start,
                run_end: c.end,
                distrusted_at: None,
            });
        // A pause starts a new run only when it let offline work run: longer than the idle
        // window with a margin (a pause of exactly the window re-arms the hold in the tick
        // that would release it).
        if c.start >= claim.run_end.saturating_add(2 * window) {
            claim.run_start = c.start;
        }
        claim.run_end = claim.run_end.max(c.end);
        let mut claimed_s = claim.run_end.saturating_sub(claim.run_start) as f64 / 1e9;
        let restored = match claim.distrusted_at {
            Some(at) if c.seen.is_some_and(|s| s > at) => {
                claim.distrusted_at = None;
                claim.run_start = c.start;
                true
            }
            Some(_) => return false,
            None if trust > 0
                && claim.run_end.saturating_sub(claim.run_start) >= trust
                && c.seen.is_none_or(|s| s.saturating_add(trust) < now) =>
            {
                claim.distrusted_at = Some(now);
                false
            }
            // Relayed: the GPU's claims, all owners together, lasted the trust window
            // with no online work seen there.
            None if gpu_uncorroborated => {
                claim.distrusted_at = Some(now);
                claimed_s = gpu_claimed_s;
                false
            }
            None => return true,
        };
        if !restored {
            notes.push(note::Uncorroborated.into());
        }
        out.push(Event::Distrust(Distrust {
            gpu: c.gpu,
            at_ns: now,
            page: c.page.display().to_string(),
            owner: owner_label(c.owner),
            claimed_s,
            nvml_seen_ns: c.seen,
            restored,
        }));
        restored
    }

    /// Owners distrusted now, per GPU, for `/state`.
    pub fn distrusted(&self) -> Vec<DistrustedPage> {
        let mut out: Vec<_> = self
            .claims
            .iter()
            .filter_map(|((owner, gpu), c)| {
                c.distrusted_at.map(|since_ns| DistrustedPage {
                    owner: owner_label(owner),
                    gpu: *gpu,
                    since_ns,
                })
            })
            .collect();
        out.sort_by(|a, b| (a.gpu, &a.owner).cmp(&(b.gpu, &b.owner)));
        out
    }
}

/// `pid:<n>` or `pod:<uid>`.
fn owner_label(owner: &Owner) -> String {
    match owner {
        Owner::Pid(pid) => format!("pid:{pid}"),
        Owner::Pod(uid) => format!("pod:{uid}"),
    }
}
