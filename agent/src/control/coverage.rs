//! Coverage of the CUDA shim: which GPU processes of online and offline pods run without
//! it, and why. Reported (`/state`, `coloc_shim_coverage_processes`, `coloc-agent
//! status`), never decided on: nothing here changes a class or a plan.
//!
//! A process runs with the shim when a doorbell page of its own is mapped (the page's
//! owner is its pod, or its PID standalone, and the page's PID is the process's PID in its
//! own namespace: the page the gate and the doorbell read). Without one, the reason comes
//! from what the webhook wrote on its pod ([`ShimNote`]):
//!
//! | reason | the pod's annotations | what it means |
//! |---|---|---|
//! | `opted_out` | `gpu-coloc.dev/shim: disabled` | the pod asked not to have it |
//! | `refused` | `gpu-coloc.dev/shim-skipped` | the webhook left a container out (its `LD_PRELOAD` could not be appended to, a path was taken) |
//! | `not_loaded` | `gpu-coloc.dev/shim-injected` only | injected, but the process has no page (a static binary, an `LD_PRELOAD` replaced at start, a node without the shim, or no CUDA launch yet) |
//! | `not_injected` | none | the webhook did not see the pod (a namespace opted out or refusing `hostPath`, the webhook down, a GPU resource it does not know), or a standalone process |

use super::bells::Bells;
use super::state::{CoverageRow, StateDoc};
use super::table::Table;
use crate::control::model::bell::Owner;
use crate::control::model::process::ShimNote;
use qos_core::Class;

/// The label value of a process that runs with the shim.
pub const WITH_SHIM: &str = "page";
/// Every reason, in the order `/state` lists them (bounded label values).
pub const REASONS: [&str; 4] = ["not_injected", "refused", "opted_out", "not_loaded"];

/// The coverage class of `class`: `online` or `offline`, `None` for the classes the shim
/// does not concern (system, unmanaged).
pub fn class_label(class: Class) -> Option<&'static str> {
    match class {
        Class::Online | Class::OnlineExclusive => Some("online"),
        Class::Offline => Some("offline"),
        Class::System | Class::Unmanaged => None,
    }
}

/// Why a process without a page of its own runs without the shim.
pub fn reason(note: Option<ShimNote>) -> &'static str {
    match note {
        Some(ShimNote::OptedOut) => "opted_out",
        Some(ShimNote::Refused) => "refused",
        Some(ShimNote::Injected) => "not_loaded",
        Some(ShimNote::NotInjected) | None => "not_injected",
    }
}

/// Marks every process of `doc` with its coverage (`page` or a reason; nothing for system
/// and unmanaged processes) and sums them per class and coverage, each process once.
pub fn mark(doc: &mut StateDoc, table: &Table, bells: &Bells) {
    let mut rows: Vec<CoverageRow> = Vec::new();
    let mut counted = std::collections::HashSet::new();
    for g in &mut doc.gpus {
        for p in &mut g.processes {
            let Some(e) = table.by_pid(p.pid) else {
                continue;
            };
            let Some(class) = class_label(e.cls.class) else {
                continue;
            };
            let page = bells.page_infos().any(|pg| match &pg.owner {
                Owner::Pid(pid) => *pid == e.key.pid && pg.file_uid == e.uid,
                Owner::Pod(uid) => {
                    e.pod_uid.as_deref() == Some(uid.as_str())
                        && e.ns_pid.unwrap_or(e.key.pid) == pg.pid
                }
            });
            let shim = if page { WITH_SHIM } else { reason(e.cls.shim) };
            p.shim = Some(shim.to_string());
            if !counted.insert(e.key) {
                continue;
            }
            match rows.iter_mut().find(|r| r.class == class && r.shim == shim) {
                Some(r) => r.processes += 1,
                None => rows.push(CoverageRow {
                    class: class.into(),
                    shim: shim.into(),
                    processes: 1,
                }),
            }
        }
    }
    rows.sort_by(|a, b| (&a.class, &a.shim).cmp(&(&b.class, &b.shim)));
    doc.shim_coverage = rows;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_follow_the_webhooks_word() {
        let get = |pairs: &'static [(&'static str, &'static str)]| {
            ShimNote::from_annotations(move |k| {
                pairs.iter().find(|(a, _)| *a == k).map(|(_, v)| *v)
            })
        };
        assert_eq!(reason(Some(get(&[]))), "not_injected");
        assert_eq!(reason(None), "not_injected");
        assert_eq!(
            reason(Some(get(&[("gpu-coloc.dev/shim-injected", "main")]))),
            "not_loaded"
        );
        assert_eq!(
            reason(Some(get(&[
                ("gpu-coloc.dev/shim-injected", "main"),
                (
                    "gpu-coloc.dev/shim-skipped",
                    "side: its LD_PRELOAD comes from valueFrom"
                )
            ]))),
            "refused"
        );
        assert_eq!(
            reason(Some(get(&[
                ("gpu-coloc.dev/shim", "disabled"),
                ("gpu-coloc.dev/shim-injected", "main")
            ]))),
            "opted_out"
        );
        assert_eq!(
            reason(Some(get(&[("gpu-coloc.dev/shim-injected", " ")]))),
            "not_injected"
        );
        for r in REASONS {
            assert!(!r.is_empty());
        }
        assert_eq!(class_label(Class::System), None);
        assert_eq!(class_label(Class::OnlineExclusive), Some("online"));
    }
}
