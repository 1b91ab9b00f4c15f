//! Log lines a tenant can cause, limited per owner.
//!
//! A tenant owns what is in its doorbell directory: a page rewritten in a loop would make
//! the agent log a line per page ("Doorbell page found", "not attributed"), hundreds a
//! second, burying every other line. [`LogBudget`] lets each owner cause at most
//! [`PER_SECOND`] lines of one kind in a second; what it holds back is counted and said in
//! one summary line per owner and kind when that second is over ([`LogBudget::flush`],
//! called from the loop's ticks, or at the owner's next line). No I/O: the caller logs.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Lines of one kind one owner may cause in a second.
pub const PER_SECOND: u32 = 5;

/// What the caller does with a line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Log it.
    Say,
    /// Held back (counted for the summary).
    Hold,
}

/// A summary of lines held back: `held` lines of `kind` from `owner` in the second that
/// ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// What the lines were about (a short, fixed name).
    pub kind: &'static str,
    /// Whose they were.
    pub owner: String,
    /// How many were not logged.
    pub held: u64,
}

#[derive(Debug, Clone, Copy)]
struct Window {
    start: Instant,
    said: u32,
    held: u64,
}

/// See the module.
#[derive(Debug, Default)]
pub struct LogBudget {
    windows: HashMap<(&'static str, String), Window>,
}

impl LogBudget {
    /// Whether `owner` may cause one more line of `kind` at `now`; a second that ended
    /// with lines held back is summarised in `out`.
    pub fn allow(
        &mut self,
        kind: &'static str,
        owner: &str,
        now: Instant,
        out: &mut Vec<Held>,
    ) -> Verdict {
        let w = self
            .windows
            .entry((kind, owner.to_string()))
            .or_insert(Window {
                start: now,
                said: 0,
                held: 0,
            });
        if now.saturating_duration_since(w.start) >= Duration::from_secs(1) {
            if w.held > 0 {
                out.push(Held {
                    kind,
                    owner: owner.to_string(),
                    held: w.held,
                });
            }
            *w = Window {
                start: now,
                said: 0,
                held: 0,
            };
        }
        if w.said < PER_SECOND {
            w.said += 1;
            Verdict::Say
        } else {
            w.held += 1;
            Verdict::Hold
        }
    }

    /// The summaries of the seconds that ended by `now` with lines held back; owners
    /// quiet for 10 s are forgotten.
    pub fn flush(&mut self, now: Instant) -> Vec<Held> {
        let mut out = Vec::new();
        self.windows.retain(|(kind, owner), w| {
            let age = now.saturating_duration_since(w.start);
            if age >= Duration::from_secs(1) && w.held > 0 {
                out.push(Held {
                    kind,
                    owner: owner.clone(),
                    held: w.held,
                });
                w.held = 0;
            }
            age < Duration::from_secs(10)
        });
        out
    }
}

/// Logs the summaries.
pub fn say(held: &[Held]) {
    for h in held {
        tracing::warn!(kind = h.kind, owner = %h.owner, held = h.held,
            "Lines a tenant caused in the last second, not logged one by one (at most 5 a second per owner)");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_owner_gets_its_own_lines_and_a_summary_of_the_rest() {
        let mut b = LogBudget::default();
        let t0 = Instant::now();
        let mut out = Vec::new();
        let said = |b: &mut LogBudget, owner: &str, at: Instant, out: &mut Vec<Held>| {
            (0..100)
                .filter(|_| b.allow("page found", owner, at, out) == Verdict::Say)
                .count()
        };
        assert_eq!(said(&mut b, "ml/flood", t0, &mut out), PER_SECOND as usize);
        // Another owner, and another kind of line, are not held back by the flood.
        assert_eq!(said(&mut b, "ml/quiet", t0, &mut out), PER_SECOND as usize);
        assert_eq!(
            b.allow("not attributed", "ml/flood", t0, &mut out),
            Verdict::Say
        );
        assert!(out.is_empty());
        assert!(b.flush(t0 + Duration::from_millis(999)).is_empty());
        let held = b.flush(t0 + Duration::from_secs(1));
        assert_eq!(held.len(), 2, "{held:?}");
        assert!(held.iter().all(|h| h.held == 95 && h.kind == "page found"));
        // Said once: the next second starts afresh.
        assert!(b.flush(t0 + Duration::from_millis(1500)).is_empty());
        assert_eq!(
            said(&mut b, "ml/flood", t0 + Duration::from_secs(2), &mut out),
            PER_SECOND as usize
        );
        // Quiet owners are forgotten.
        b.flush(t0 + Duration::from_secs(20));
        assert!(b.windows.is_empty());
    }
}
