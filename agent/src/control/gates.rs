//! The gate book (`--gate`): which suspensions close a launch gate, what the offline
//! processes' pages say of their gates, and when the gate file's heartbeat is due.
//!
//! A suspension closes a gate before it stops the process when all of these hold:
//! - it is for online work on GPU g (not a `fixed-share` duty cycle: a gate is per GPU,
//!   and other offline work on g must keep running then);
//! - the process uses g alone (closing g's gate would not stop its work on another GPU,
//!   which a signal or the freezer would);
//! - it has a page of the offline class with an entry for g: its shim is listening. Whose
//!   page: standalone, the file `<pid>-….bell` of that PID whose file owner is the
//!   process's UID; Kubernetes, the offline pages under its pod's directory whose writer
//!   gives the process's PID in its own namespace (`NSpid`; all of them must acknowledge;
//!   without `NSpid`, every offline page of the pod). A page that a killed process left
//!   behind names a PID that no live process of the pod has, and is not waited for. Two
//!   live processes of one pod with the same PID (in two containers' namespaces) are
//!   stopped, never gated: a page could not tell whose it is.
//!
//! - its gate has not stayed silent: a process whose gate did not acknowledge a close
//!   within `--gate-timeout` (its shim follows another gate file, `COLOC_GATE_FILE` being
//!   the tenant's to set, or found none) is stopped at once for [`SILENT_NS`], and
//!   counted (`/state`'s `gate`, `coloc_gate_silent_processes`); then its gate is tried
//!   again (a shim looks for the gate file once a second).
//!
//! Otherwise the process is stopped as without `--gate`. A closed gate only bounds the
//! drain: the process is stopped by its fallback (freezer or signal) as soon as its pages
//! acknowledge the close, or when `--gate-timeout` passes without that (`holds::gate`).
//! Acknowledgements are plain observations (the shell reads every offline page's gate
//! fields with the doorbells); they are the tenant's word, and all a forged one does is
//! bring the stop sooner; see SECURITY.md.

use crate::control::bells::Bells;
use crate::control::model::bell::Owner;
use crate::control::model::ProcKey;
use crate::control::table::Table;
use crate::control::target::GateSlot;
use coloc_doorbell::GateReading;
use std::collections::HashMap;
use std::path::PathBuf;

/// How often the loop refreshes the gate file's heartbeat (the shims' bound is 1 s by
/// default; the file promises at most `coloc_doorbell::gate::HEARTBEAT_NS`).
pub const BEAT_NS: u64 = 20_000_000;

/// How long a process whose gate stayed silent is stopped without closing its gate, ns.
pub const SILENT_NS: u64 = 60_000_000_000;

/// See the module.
#[derive(Debug, Default)]
pub struct Gates {
    /// Processes whose gate stayed silent at its latest close, with when.
    silent: HashMap<ProcKey, u64>,
    /// The gate file (`--gate`), if any.
    file: Option<PathBuf>,
    /// The gate fields of every offline page, as of the latest read.
    readings: HashMap<u64, Vec<GateReading>>,
    /// When the heartbeat was last refreshed, ns.
    last_beat_ns: u64,
}

impl Gates {
    /// Gates through `file` (none: `--gate` is off).
    pub fn new(file: Option<PathBuf>) -> Gates {
        Gates {
            file,
            ..Gates::default()
        }
    }

    /// Whether `--gate` is on.
    pub fn on(&self) -> bool {
        self.file.is_some()
    }

    /// The gate file.
    pub fn file(&self) -> Option<&std::path::Path> {
        self.file.as_deref()
    }

    /// The offline pages' gate fields read now.
    pub fn read(&mut self, readings: Vec<(u64, Vec<GateReading>)>) {
        self.readings = readings.into_iter().collect();
    }

    /// How processes' gates answered their latest closes (true: acknowledged in time),
    /// at `now`; silences older than [`SILENT_NS`] are forgotten.
    pub fn answered(&mut self, answers: Vec<(ProcKey, bool)>, now: u64) {
        for (k, acked) in answers {
            if acked {
                self.silent.remove(&k);
            } else {
                self.silent.insert(k, now);
            }
        }
        self.silent
            .retain(|_, at| now.saturating_sub(*at) < SILENT_NS);
    }

    /// Whether `key`'s gate stayed silent at its latest close (it is stopped without it).
    pub fn silent(&self, key: &ProcKey) -> bool {
        self.silent.contains_key(key)
    }

    /// Whether the heartbeat is due at `now` (and, if so, it is taken as done).
    pub fn beat_due(&mut self, now: u64) -> bool {
        let due = self.on() && now.saturating_sub(self.last_beat_ns) >= BEAT_NS;
        if due {
            self.last_beat_ns = now;
        }
        due
    }

    /// When the heartbeat is next due, ns.
    pub fn next_beat_ns(&self) -> u64 {
        self.last_beat_ns + BEAT_NS
    }

    /// The `gate_ack` of every offline page of `key` with an entry for `uuid` (empty: its
    /// shim has no such entry, or `key` is unknown).
    pub fn acks(&self, table: &Table, bells: &Bells, key: &ProcKey, uuid: &[u8; 16]) -> Vec<u32> {
        let Some(e) = table.entry(key) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for p in bells.page_infos() {
            if p.class != coloc_doorbell::CLASS_OFFLINE {
                continue;
            }
            let mine = match &p.owner {
                Owner::Pid(pid) => *pid == key.pid && p.file_uid == e.uid,
                // The pod's pages of this process: the PID its shim writes is its PID in
                // its own namespace. A page of a process that died (killed before its
                // shim could remove the page) names a PID no live process of the pod has,
                // and is not waited for.
                Owner::Pod(uid) => {
                    e.pod_uid.as_deref() == Some(uid.as_str())
                        && e.ns_pid.is_none_or(|n| n == p.pid)
                }
            };
            if !mine {
                continue;
            }
            if let Some(rs) = self.readings.get(&p.id) {
                out.extend(rs.iter().filter(|r| r.uuid == *uuid).map(|r| r.gate_ack));
            }
        }
        out
    }

    /// Whether a suspension of `key` for online work on `gpu` would close its gate there
    /// first (the learned release window needs every offline process so bounded).
    pub fn gated(&self, table: &Table, bells: &Bells, key: &ProcKey, gpu: u32) -> bool {
        self.slot(table, bells, key, gpu).is_some()
    }

    /// The gate of `key` on `gpu`, when the module's rules give one (the fact
    /// [`crate::control::plan::choose`] takes for a suspension for online work there).
    pub fn slot(&self, table: &Table, bells: &Bells, key: &ProcKey, gpu: u32) -> Option<GateSlot> {
        let file = self.file.as_ref()?;
        if self.silent(key) {
            return None;
        }
        let e = table.entry(key)?;
        if e.gpus.len() != 1 || !e.gpus.contains(&gpu) {
            return None;
        }
        // Containers of a pod have PID namespaces of their own: two live processes of the
        // pod can give the same PID, and a page could not tell whose it is. Stop both.
        if let (Some(pod), Some(ns_pid)) = (&e.pod_uid, e.ns_pid) {
            let twin = table.entries().any(|o| {
                o.key != e.key && o.pod_uid.as_ref() == Some(pod) && o.ns_pid == Some(ns_pid)
            });
            if twin {
                return None;
            }
        }
        let uuid = bells.uuid_of(gpu)?;
        if self.acks(table, bells, key, &uuid).is_empty() {
            return None;
        }
        Some(GateSlot {
            key: *key,
            uuid,
            file: file.clone(),
        })
    }
}
