//! The launch gate in the loop (`--gate`): which suspensions close a gate, and the
//! acknowledgements the gate actuator waits for, read from the offline processes' pages.
//!
//! A suspension closes a gate instead of stopping the process when all of these hold:
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
//! Otherwise, and when the gate is not acknowledged within `--gate-timeout`, the process
//! is stopped as without `--gate`. Acknowledgements are the tenant's word: a shim that
//! acknowledges without draining only hurts the online work beside it, which the tenant
//! could do by unloading the shim; see SECURITY.md.

use super::Loop;
use crate::control::target::Plan;
use crate::edges::actuator::Target;
use crate::edges::doorbell::Owner;
use crate::edges::gate::AckBoard;
use crate::edges::procfs::ProcKey;
use std::path::PathBuf;
use std::sync::Arc;

/// What the loop needs of the gate actuator.
#[derive(Debug, Clone)]
pub struct GateLink {
    /// The acknowledgements the actuator reads.
    pub board: Arc<AckBoard>,
    /// The gate file (for the targets and the record).
    pub file: PathBuf,
}

/// How often the loop refreshes the gate file's heartbeat (the shims' bound is 1 s by
/// default; the file promises at most `coloc_doorbell::gate::HEARTBEAT_NS`).
pub(super) const BEAT_NS: u64 = 20_000_000;

impl Loop {
    /// The `gate_ack` of every offline page of `key` with an entry for `uuid` (empty: its
    /// shim has no such entry, or `key` is unknown).
    fn gate_acks(&self, key: &ProcKey, uuid: &[u8; 16]) -> Vec<u32> {
        let Some(e) = self.table.entry(key) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let mut buf = Vec::new();
        for p in self.bells.page_infos() {
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
            buf.clear();
            self.bells.read_gate(p.id, &mut buf);
            out.extend(buf.iter().filter(|r| r.uuid == *uuid).map(|r| r.gate_ack));
        }
        out
    }

    /// Refreshes the acknowledgements the gate actuator waits on, and the heartbeat.
    pub(super) fn follow_gates(&mut self, now: u64) {
        let Some(link) = &self.gates else {
            return;
        };
        let board = link.board.clone();
        for (key, uuid) in board.wanted() {
            board.set(key, uuid, self.gate_acks(&key, &uuid));
        }
        if now.saturating_sub(self.last_beat_ns) >= BEAT_NS {
            self.last_beat_ns = now;
            self.hands().keepalive();
        }
    }

    /// The plan for suspending `key` because online work is busy on `gpu`: a gate when it
    /// applies (see the module's rules), else `plan`.
    pub(super) fn gate_plan(&self, key: &ProcKey, gpu: u32, plan: Plan) -> Plan {
        let Some(link) = &self.gates else {
            return plan;
        };
        let Some(e) = self.table.entry(key) else {
            return plan;
        };
        if e.gpus.len() != 1 || !e.gpus.contains(&gpu) {
            return plan;
        }
        // Containers of a pod have PID namespaces of their own: two live processes of the
        // pod can give the same PID, and a page could not tell whose it is. Stop both.
        if let (Some(pod), Some(ns_pid)) = (&e.pod_uid, e.ns_pid) {
            let twin = self.table.entries().any(|o| {
                o.key != e.key && o.pod_uid.as_ref() == Some(pod) && o.ns_pid == Some(ns_pid)
            });
            if twin {
                return plan;
            }
        }
        let Some(uuid) = self.bells.uuid_of(gpu) else {
            return plan;
        };
        let acks = self.gate_acks(key, &uuid);
        if acks.is_empty() {
            return plan;
        }
        link.board.set(*key, uuid, acks);
        Plan::Gate {
            gate: Target::Gate {
                key: *key,
                uuid,
                file: link.file.clone(),
            },
            fallback: Box::new(plan),
        }
    }
}
