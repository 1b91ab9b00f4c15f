//! Retries of failed suspensions.
//!
//! A suspension that fails (the actuator refused, or it was not confirmed within
//! `--confirm-timeout`, or the record could not be written) is undone. The state machine
//! still believes the process suspended, so without a word from the loop it would never
//! try again while online stays busy. This room tells it: after a backoff (10 ms, doubling
//! to 1.28 s; back to 10 ms after 10 s without failures) the machine forgets the
//! suspension, and the next tick suspends the process again if online is still busy.

use crate::control::model::ProcKey;
use std::collections::BTreeMap;

const FIRST_NS: u64 = 10_000_000;
const MAX_SHIFT: u32 = 7;
const FORGIVE_NS: u64 = 10_000_000_000;

#[derive(Debug, Clone, Copy)]
struct Retry {
    due_ns: Option<u64>,
    attempts: u32,
    last_ns: u64,
}

/// Failed suspensions waiting to be retried.
#[derive(Debug, Default)]
pub struct Retries {
    keys: BTreeMap<ProcKey, Retry>,
}

impl Retries {
    /// `key`'s suspension failed at `now`; returns when it will be retried.
    pub fn failed(&mut self, key: ProcKey, now: u64) -> u64 {
        let r = self.keys.entry(key).or_insert(Retry {
            due_ns: None,
            attempts: 0,
            last_ns: now,
        });
        if now.saturating_sub(r.last_ns) > FORGIVE_NS {
            r.attempts = 0;
        } else if r.due_ns.is_none() && r.last_ns != now {
            r.attempts += 1;
        }
        r.last_ns = now;
        let due = now + (FIRST_NS << r.attempts.min(MAX_SHIFT));
        r.due_ns = Some(due);
        due
    }

    /// The keys whose retry is due at `now` (each returned once per failure).
    pub fn due(&mut self, now: u64) -> Vec<ProcKey> {
        let mut out = Vec::new();
        for (k, r) in self.keys.iter_mut() {
            if r.due_ns.is_some_and(|d| d <= now) {
                r.due_ns = None;
                out.push(*k);
            }
        }
        out
    }

    /// Keeps only the keys `keep` names (processes still present).
    pub fn retain(&mut self, keep: impl Fn(&ProcKey) -> bool) {
        self.keys.retain(|k, _| keep(k));
    }

    /// Nothing is waiting.
    pub fn is_empty(&self) -> bool {
        self.keys.values().all(|r| r.due_ns.is_none())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    const MS: u64 = 1_000_000;

    #[test]
    fn backoff_doubles_and_is_forgiven() {
        let k = ProcKey { pid: 1, start: 1 };
        let mut r = Retries::default();
        assert_eq!(r.failed(k, 0), 10 * MS);
        assert!(r.due(9 * MS).is_empty());
        assert_eq!(r.due(10 * MS), vec![k]);
        assert!(r.due(11 * MS).is_empty(), "returned twice");
        assert_eq!(r.failed(k, 20 * MS), 40 * MS);
        r.due(40 * MS);
        assert_eq!(r.failed(k, 50 * MS), 90 * MS);
        // Long after: back to the first step.
        r.due(90 * MS);
        assert_eq!(r.failed(k, 20_000 * MS), 20_010 * MS);
    }
}
