//! The record book: what the fail-open record must hold, what it holds on disk, and the
//! writes that bring the two together — performed off the loop's thread, one at a time,
//! in the order asked.
//!
//! Two kinds of entries are wanted on disk:
//! - **ahead**: every target the process table could suspend (an offline process's plan,
//!   and its GPU's gate with `--gate`), written when it becomes suspendable, so that a
//!   preemption finds it on disk already and waits for no write;
//! - **held**: what the hold book asked for (a hold's members, a signalled cgroup's
//!   processes, a freezer escalation), until it lets them go.
//!
//! Record before act: the hold book's `RecordAdd` is answered `Recorded { ok: true }` only
//! once a write that holds every one of its entries has landed (at once when they are on
//! disk already and no write on its way removes them); the book starts a suspension only
//! on that answer. A write that fails answers `ok: false` to the requests it was for; the
//! book fails those suspensions open. An entry leaves the disk only when neither kind
//! wants it, so what may be stopped is always on disk, and what was written ahead stays
//! there while its target could be stopped: after a `kill -9` at any moment, the next
//! start resumes everything that was or may have been stopped.
//!
//! ```text
//!  table ─ahead─┐                       ┌─► Write { add, remove } ─► (shell, off the loop)
//!  book ─RecordAdd/Remove─► RecordBook ─┤                                   │
//!       ◄─Recorded{ok} (at once, or ────┘◄──────────── Written { ok } ◄──────┘
//!          when the write lands)
//! ```

use crate::control::holds::Req;
use crate::control::model::act::RecordEntry;
use std::collections::BTreeSet;

/// How long after a failed write the record is written again when no suspension waits
/// for it.
pub const RETRY_NS: u64 = 1_000_000_000;

/// A write on its way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Write {
    /// Names the write in its answer.
    pub id: u64,
    /// Entries to add.
    pub add: Vec<RecordEntry>,
    /// Entries to remove.
    pub remove: Vec<RecordEntry>,
}

/// See the module.
#[derive(Debug, Default)]
pub struct RecordBook {
    ahead: BTreeSet<RecordEntry>,
    held: BTreeSet<RecordEntry>,
    durable: BTreeSet<RecordEntry>,
    flight: Option<Write>,
    next_id: u64,
    /// Requests waiting for a write: (request, its entries, those it added to `held`).
    waiters: Vec<(Req, Vec<RecordEntry>, Vec<RecordEntry>)>,
    /// After a write failed: the same write is not tried again before this time, ns,
    /// unless a suspension waits for one.
    quiet_until: u64,
    failed: Option<(Vec<RecordEntry>, Vec<RecordEntry>)>,
    /// What is wanted may differ from the disk (else `next_write` has nothing to look at:
    /// it is asked at every round of the loop).
    dirty: bool,
    /// The agent stops: nothing is wanted ahead any more, whatever the table says later.
    stopped: bool,
}

impl RecordBook {
    /// A book over a record that holds `on_disk` (what a previous run left and could not
    /// resume stays there: it is held until this run resumes it).
    pub fn new(on_disk: BTreeSet<RecordEntry>) -> RecordBook {
        RecordBook {
            held: on_disk.clone(),
            durable: on_disk,
            dirty: true,
            ..RecordBook::default()
        }
    }

    /// What the table wants written ahead from now on.
    pub fn want_ahead(&mut self, entries: BTreeSet<RecordEntry>) {
        // A table change seen in the shutdown's last rounds must not bring back what the
        // shutdown let go (it would stay recorded after the exit).
        if self.stopped {
            return;
        }
        if entries != self.ahead {
            self.ahead = entries;
            self.dirty = true;
        }
    }

    /// The hold book asks for `entries` on disk (request `req`). `Some(true)`: they are on
    /// disk already; `None`: the answer comes when a write lands ([`RecordBook::written`]).
    pub fn add(&mut self, req: Req, entries: Vec<RecordEntry>) -> Option<bool> {
        let fresh: Vec<RecordEntry> = entries
            .iter()
            .filter(|e| self.held.insert((*e).clone()))
            .cloned()
            .collect();
        if entries.iter().all(|e| self.on_disk(e)) {
            return Some(true);
        }
        self.waiters.push((req, entries, fresh));
        self.dirty = true;
        None
    }

    /// The hold book (or the driver book) lets `entries` go: their targets were resumed,
    /// or what asked for them ended before its write. A request that asked for one of them
    /// waits for a write that will never bring it on disk: it is dropped, and returned so
    /// that its asker stops waiting for it.
    pub fn remove(&mut self, entries: &[RecordEntry]) -> Vec<Req> {
        for e in entries {
            self.dirty |= self.held.remove(e);
        }
        let mut dropped = Vec::new();
        self.waiters.retain(|(req, asked, _)| {
            let keep = !asked.iter().any(|e| entries.contains(e));
            if !keep {
                dropped.push(*req);
            }
            keep
        });
        dropped
    }

    /// Whether `e` is on disk and no write on its way removes it.
    pub fn on_disk(&self, e: &RecordEntry) -> bool {
        self.durable.contains(e) && self.flight.as_ref().is_none_or(|w| !w.remove.contains(e))
    }

    /// Everything held was resumed behind the book's back (the NVML watchdog): nothing is
    /// held any more.
    pub fn forget_holds(&mut self) {
        self.held.clear();
        // The hold book abandoned its requests too.
        self.waiters.clear();
        self.dirty = true;
    }

    /// The hold book abandoned its requests that wait for a write (everything is being
    /// resumed): nothing was acted on for them, so what they alone asked for is let go.
    /// The driver book's requests (`driver_book::REQ_BASE` and above) stay.
    pub fn abandon_book_requests(&mut self) {
        let base = crate::control::driver_book::REQ_BASE;
        let (book, driver_book): (Vec<_>, Vec<_>) = std::mem::take(&mut self.waiters)
            .into_iter()
            .partition(|(req, _, _)| *req < base);
        self.waiters = driver_book;
        for (_, _, fresh) in book {
            for e in fresh {
                self.dirty |= self.held.remove(&e);
            }
        }
    }

    /// The agent stops: nothing is wanted ahead any more.
    pub fn stop(&mut self) {
        self.stopped = true;
        self.ahead.clear();
        // The last writes are tried whatever failed before.
        self.failed = None;
        self.dirty = true;
    }

    /// The next write to ask for, if the disk does not hold what is wanted and no write is
    /// on its way.
    pub fn next_write(&mut self, now: u64) -> Option<Write> {
        if self.flight.is_some() || !self.dirty {
            return None;
        }
        let (add, remove) = self.diff();
        if add.is_empty() && remove.is_empty() {
            self.dirty = false;
            return None;
        }
        let again = self.failed.as_ref() == Some(&(add.clone(), remove.clone()));
        if again && self.waiters.is_empty() && now < self.quiet_until {
            return None;
        }
        self.next_id += 1;
        let w = Write {
            id: self.next_id,
            add,
            remove,
        };
        self.flight = Some(w.clone());
        Some(w)
    }

    /// What the disk lacks and what it holds that nothing wants.
    fn diff(&self) -> (Vec<RecordEntry>, Vec<RecordEntry>) {
        let add = self
            .ahead
            .union(&self.held)
            .filter(|e| !self.durable.contains(*e))
            .cloned()
            .collect();
        let remove = self
            .durable
            .iter()
            .filter(|e| !self.ahead.contains(*e) && !self.held.contains(*e))
            .cloned()
            .collect();
        (add, remove)
    }

    /// Write `id` landed (`ok`) or failed. Returns the answers for the hold book's
    /// requests it settles.
    pub fn written(&mut self, id: u64, ok: bool, now: u64) -> Vec<(Req, bool)> {
        let Some(w) = self.flight.take_if(|w| w.id == id) else {
            debug_assert!(false, "an answer to no write: {id}");
            return Vec::new();
        };
        // What landed or failed: the next write looks again.
        self.dirty = true;
        if ok {
            self.durable.extend(w.add.iter().cloned());
            for e in &w.remove {
                self.durable.remove(e);
            }
            self.failed = None;
        } else {
            self.quiet_until = now + RETRY_NS;
        }
        let mut out = Vec::new();
        let waiters = std::mem::take(&mut self.waiters);
        for (req, entries, fresh) in waiters {
            if entries.iter().all(|e| self.durable.contains(e)) {
                out.push((req, true));
            } else if !ok && entries.iter().any(|e| w.add.contains(e)) {
                // Not on disk: the book fails the suspension open, and what this request
                // asked for is not held (what was held before stays).
                for e in &fresh {
                    self.held.remove(e);
                }
                out.push((req, false));
            } else {
                self.waiters.push((req, entries, fresh));
            }
        }
        if !ok {
            // What the failure left wanted (the failed requests' entries let go): the same
            // write again waits for the quiet time.
            self.failed = Some(self.diff());
        }
        out
    }

    /// A write is on its way.
    pub fn writing(&self) -> bool {
        self.flight.is_some()
    }
}

/// Views the tests read.
#[cfg(test)]
impl RecordBook {
    /// No write is on its way and the disk holds what is wanted.
    pub fn settled(&self) -> bool {
        self.flight.is_none()
            && self.durable.len() == self.ahead.union(&self.held).count()
            && self
                .ahead
                .iter()
                .chain(&self.held)
                .all(|e| self.durable.contains(e))
    }

    /// What is wanted ahead.
    pub fn ahead(&self) -> &BTreeSet<RecordEntry> {
        &self.ahead
    }

    /// What the disk holds, as of the latest write that landed.
    pub fn durable(&self) -> &BTreeSet<RecordEntry> {
        &self.durable
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(pid: u32) -> RecordEntry {
        RecordEntry::Process { pid, start: 1 }
    }

    #[test]
    fn a_request_is_answered_once_its_entries_are_on_disk() {
        let mut b = RecordBook::new(BTreeSet::new());
        b.want_ahead([p(1)].into());
        let w = b.next_write(0).unwrap();
        assert_eq!((w.add.clone(), w.remove.clone()), (vec![p(1)], vec![]));
        // Asked while the write is on its way: waits for it.
        assert_eq!(b.add(7, vec![p(1)]), None);
        assert!(b.next_write(0).is_none(), "one write at a time");
        assert_eq!(b.written(w.id, true, 0), vec![(7, true)]);
        // On disk already: at once, no write.
        assert_eq!(b.add(8, vec![p(1)]), Some(true));
        assert!(b.next_write(0).is_none());
        assert!(b.settled());
    }

    #[test]
    fn an_entry_leaves_the_disk_only_when_nothing_wants_it() {
        let mut b = RecordBook::new(BTreeSet::new());
        b.want_ahead([p(1)].into());
        let w = b.next_write(0).unwrap();
        b.written(w.id, true, 0);
        assert_eq!(b.add(1, vec![p(1)]), Some(true));
        b.remove(&[p(1)]);
        assert!(b.next_write(0).is_none(), "still wanted ahead");
        b.want_ahead(BTreeSet::new());
        let w = b.next_write(0).unwrap();
        assert_eq!(w.remove, vec![p(1)]);
        // While it is being removed, a request for it waits for a write that adds it.
        b.want_ahead([p(1)].into());
        assert_eq!(b.add(2, vec![p(1)]), None);
        assert!(b.written(w.id, true, 0).is_empty());
        let w = b.next_write(0).unwrap();
        assert_eq!(w.add, vec![p(1)]);
        assert_eq!(b.written(w.id, true, 0), vec![(2, true)]);
    }

    #[test]
    fn a_failed_write_fails_its_requests_and_waits_before_trying_again() {
        let mut b = RecordBook::new(BTreeSet::new());
        assert_eq!(b.add(1, vec![p(1)]), None);
        let w = b.next_write(0).unwrap();
        assert_eq!(b.written(w.id, false, 0), vec![(1, false)]);
        assert!(b.durable().is_empty());
        assert!(
            b.next_write(0).is_none(),
            "the failed request's entry is let go"
        );
        // Something new is tried at once; the same write again only after the quiet time.
        b.want_ahead([p(2)].into());
        let w = b.next_write(0).unwrap();
        assert!(b.written(w.id, false, 0).is_empty());
        assert!(
            b.next_write(RETRY_NS - 1).is_none(),
            "hammering a failing disk"
        );
        assert!(b.next_write(RETRY_NS).is_some());
        let w = b.next_write(0);
        assert!(w.is_none(), "one write at a time");
        // A suspension that waits does not wait for the quiet time.
        let mut b = RecordBook::new(BTreeSet::new());
        b.want_ahead([p(2)].into());
        let w = b.next_write(0).unwrap();
        b.written(w.id, false, 0);
        assert_eq!(b.add(2, vec![p(2)]), None);
        assert!(b.next_write(1).is_some());
    }

    /// A request whose entries the hold book lets go before any write carried them (its
    /// hold was cancelled while another write was on its way) is dropped: it waits for
    /// nothing any more, and a failing disk keeps its quiet time.
    #[test]
    fn a_request_let_go_before_its_write_waits_for_nothing() {
        let mut b = RecordBook::new(BTreeSet::new());
        b.want_ahead([p(2)].into());
        let w = b.next_write(0).unwrap();
        // Asked while another write is on its way, and let go before that one lands.
        assert_eq!(b.add(1, vec![p(1)]), None);
        b.remove(&[p(1)]);
        assert!(b.written(w.id, false, 0).is_empty());
        assert!(
            b.next_write(RETRY_NS - 1).is_none(),
            "a request let go keeps a failing disk from its quiet time"
        );
        assert!(b.next_write(RETRY_NS).is_some());
    }

    /// After the agent's stop, what the table wants ahead is not written any more (the
    /// gate property found an entry written back by the shutdown's last round, and left
    /// recorded after the exit).
    #[test]
    fn nothing_is_wanted_ahead_after_the_stop() {
        let mut b = RecordBook::new(BTreeSet::new());
        b.want_ahead([p(1)].into());
        let w = b.next_write(0).unwrap();
        b.written(w.id, true, 0);
        b.stop();
        b.want_ahead([p(1), p(2)].into());
        let w = b.next_write(0).unwrap();
        assert_eq!((w.add.clone(), w.remove.clone()), (vec![], vec![p(1)]));
        b.written(w.id, true, 0);
        assert!(b.durable().is_empty());
        assert!(b.next_write(0).is_none());
    }

    #[test]
    fn what_a_previous_run_left_stays_until_resumed_here() {
        let mut b = RecordBook::new([p(9)].into());
        assert!(b.next_write(0).is_none());
        assert_eq!(b.add(1, vec![p(9)]), Some(true));
        b.remove(&[p(9)]);
        assert_eq!(b.next_write(0).unwrap().remove, vec![p(9)]);
    }
}
