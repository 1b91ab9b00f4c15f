//! The in-flight bound of a stream: K submissions, or fewer where the budget says so, and
//! the lead (see the crate docs for the estimator and its figures).

use super::events::{event_done, sync_event};
use super::streams::{Ring, UNBOUNDED_CAP};
use super::{BUDGET_NS, INFLIGHT};
use coloc_doorbell::{futex_wait, Entry};
use std::sync::atomic::{AtomicU32, Ordering::*};

/// CLOCK_MONOTONIC, ns (the budget's timing: no jumps).
pub(super) fn mono_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Samples a stream's estimate takes before the budget lets more than one submission in
/// flight: one odd first sample (a submission stamped late, a wake-up early) does not set
/// the bound.
pub(super) const FIRST_SAMPLES: u32 = 4;

/// At most this many submissions share one event of ours: completions are tracked in
/// batches, so that a stream of short kernels makes one `cuEventRecord` per this many
/// launches and no other driver call while it stays under its bound.
pub(super) const BATCH_MAX: u64 = 32;

/// The ring's bound now: K (`UNBOUNDED_CAP` for 0), and with a budget B the number of
/// submissions whose estimated time fits in this ring's share of B (B split evenly among
/// the process's streams on the ring's GPU, `rings`), at least 1 and at most that (1
/// until [`FIRST_SAMPLES`] samples).
pub(super) fn limit(r: &Ring) -> u64 {
    let k = INFLIGHT.load(Relaxed) as u64;
    let cap = if k == 0 { UNBOUNDED_CAP } else { k };
    match r.share_ns {
        0 => cap,
        _ if r.samples < FIRST_SAMPLES => 1,
        b => (b / r.est_ns.max(1)).clamp(1, cap),
    }
}

/// This ring's share of the budget with `rings` streams on its GPU (0: no budget).
pub(super) fn share_ns(rings: u32) -> u64 {
    BUDGET_NS.load(Relaxed) / u64::from(rings.max(1))
}

/// Submissions per event at bound `limit`: half the bound (so that waiting for events can
/// always bring the work in flight under it), at most [`BATCH_MAX`], at least 1.
pub(super) fn batch(limit: u64) -> u64 {
    (limit / 2).clamp(1, BATCH_MAX)
}

/// Keeps the ring within the in-flight bound before a submission. Under the bound:
/// nothing (no driver call). At the bound: the oldest event that brings the stream under
/// the bound is asked (one query; with short kernels it is complete) and waited for if it
/// is not, retiring the events before it too. Each completion found is a
/// sample of the time per submission: from its start (the previous completion found while
/// the stream stayed backlogged, or the first submission it covers) to when it was found,
/// over the submissions it covers. A wait that blocked ends at the completion (a wake-up
/// late); a query found complete ends some time after it, so its sample leans long, which
/// errs towards less in flight. (When the bound is never reached, nothing is timed and the
/// estimate stays: the application itself keeps less in flight than the budget allows.
/// Time held at the gate breaks the run.)
pub(super) fn bound(r: &mut Ring, entry: &Entry, rings: u32, closed: Option<&AtomicU32>) {
    r.share_ns = share_ns(rings);
    let limit = limit(r);
    if r.in_flight() < limit {
        return;
    }
    let lead = lead_ns(r, limit);
    let keep = if lead > 0 { limit + 1 } else { limit };
    while r.in_flight() >= keep {
        wait_for(r, entry, r.seq + 1 - keep);
    }
    if lead > 0 && r.in_flight() == limit && !submit_ahead(r, lead, closed) {
        wait_for(r, entry, r.seq + 1 - limit);
    }
}

/// Waits until the submissions up to `target` (a sequence number) are complete: waits
/// for the oldest event that covers it (or the newest) and retires it and those before.
fn wait_for(r: &mut Ring, entry: &Entry, target: u64) {
    let Some(i) = r
        .events
        .iter()
        .position(|x| x.1 >= target)
        .or(r.events.len().checked_sub(1))
    else {
        // Nothing recorded covers it (a submission left untracked): count it done.
        r.done_seq = r.done_seq.max(target.min(r.seq));
        r.prev_done_ns = 0;
        return;
    };
    let (e, _, _) = r.events[i];
    // Only a wait that blocks times anything: an event already complete finished at some
    // unknown time before (its sample then ends now, leaning long).
    let blocked = !event_done(e);
    if blocked {
        sync_event(e);
    }
    let now = mono_ns();
    for _ in 0..=i {
        if let Some(x) = r.events.pop_front() {
            retire(r, entry, x, now, blocked);
        }
    }
}

/// Retires event `x` (`(event, seq covered, when recorded)`), found complete at `now`:
/// its submissions are done, its time a sample. A sample is exact when the wait blocked
/// (it ends at the completion, a wake-up late) and it starts at a known point: the
/// previous completion found while the stream stayed backlogged, or the submission that
/// found the stream idle. Any other sample (an event found complete some time after its
/// completion, or one starting at its record while earlier work was queued) is an upper
/// bound on the time per submission: it may bring the estimate down, or settle a new one,
/// never raise it.
fn retire(r: &mut Ring, entry: &Entry, x: (usize, u64, u64), now: u64, blocked: bool) {
    let (e, seq, recorded) = x;
    let n = seq.saturating_sub(r.done_seq);
    let (start, known) = if r.prev_done_ns != 0 {
        (r.prev_done_ns, true)
    } else {
        (r.batch_start_ns, r.start_known)
    };
    r.done_seq = r.done_seq.max(seq);
    r.free.push(e);
    entry.inflight.fetch_sub(n as u32, Relaxed);
    if r.share_ns != 0 && n > 0 && start != 0 && now > start {
        let t = (now - start) / n;
        if (blocked && known) || r.samples < FIRST_SAMPLES || t < r.est_ns {
            r.est_ns = estimate(r.est_ns, t);
            r.samples = (r.samples + 1).min(FIRST_SAMPLES);
        }
    }
    // The next batch starts from here if the stream stays backlogged; a query found
    // complete (not blocked) may have been idle since: the next sample starts at this
    // event's record (every submission of the next batch came after it), an upper bound.
    r.prev_done_ns = if blocked && r.in_flight() > 0 { now } else { 0 };
    if r.prev_done_ns == 0 {
        r.batch_start_ns = recorded;
        r.start_known = false;
    }
}

/// Where the budget holds a stream to one submission in flight, a lead (ns, at most
/// [`LEAD_MAX_NS`] and at most the submission's estimate), else 0: the next submission
/// may go in when the one in flight has about that much left, so the GPU has it queued
/// when the first ends instead of waiting for this thread to wake and submit it. The lead
/// is what the budget leaves beyond the one submission (budget 0.8 ms, kernels of 0.6 ms:
/// 0.2 ms), or, for a submission longer than the budget, the budget itself: work in flight
/// by the estimate stays within max(budget, one submission + the budget). Only at a bound
/// of one (with two or more in flight, one is always queued behind the running one),
/// under a budget (not K = 1), once the estimate is settled.
fn lead_ns(r: &Ring, limit: u64) -> u64 {
    let (b, k) = (r.share_ns, INFLIGHT.load(Relaxed) as u64);
    let cap = if k == 0 { UNBOUNDED_CAP } else { k };
    if b == 0 || r.samples < FIRST_SAMPLES || limit != 1 || cap == 1 || r.est_ns == 0 {
        return 0;
    }
    // A submission longer than the budget: the budget's worth of it.
    let room = if b > r.est_ns { b - r.est_ns } else { b };
    room.min(r.est_ns).min(LEAD_MAX_NS)
}

/// The most a lead may be: enough to cover the submitting thread's wake-up on a loaded
/// host (100–200 µs on a busy 2-core machine) with room to spare, and no more, since
/// every microsecond of lead is work in flight that online waits for after a close.
const LEAD_MAX_NS: u64 = 500_000;

/// At the bound with a lead: waits until the oldest submission in flight is expected to
/// have `lead` left (its start plus the estimate), or the gate closes, then lets the next
/// one in (true). Without a start (the run broke), false: the caller waits for the oldest
/// as without a lead.
fn submit_ahead(r: &mut Ring, lead: u64, closed: Option<&AtomicU32>) -> bool {
    let start = if r.prev_done_ns != 0 {
        r.prev_done_ns
    } else {
        r.batch_start_ns
    };
    let now = mono_ns();
    if start == 0 {
        return false;
    }
    let due = start.saturating_add(r.est_ns);
    let wake = due.saturating_sub(lead);
    if wake > now {
        match closed {
            // Woken at once by a close (the caller then goes back to the gate).
            Some(w) => {
                let c = w.load(SeqCst);
                if c == 0 {
                    futex_wait(w, 0, wake - now);
                }
            }
            None => std::thread::sleep(std::time::Duration::from_nanos(wake - now)),
        }
    }
    // Overslept: the oldest ended before its due time minus the lead, so the estimate
    // is too long (it leans long, and a stall can lift it). The one place it comes down
    // outside the timed waits: the wait for this event will find it complete and time
    // nothing, so without this a long estimate would never be corrected.
    if r.events.front().is_some_and(|x| event_done(x.0)) {
        shorten(r, mono_ns().saturating_sub(start));
    }
    true
}

/// The submission in flight ended within `t` (ns) of its start: the estimate comes down
/// an eighth of itself towards `t` if over. Not to `t` at once: the start was a wake-up
/// after the true end of the one before, so `t` may be short by that much; and never so
/// far that two fit the budget (only the timed waits may do that).
fn shorten(r: &mut Ring, t: u64) {
    let floor = r.share_ns / 2 + 1;
    let next = t.max(r.est_ns - r.est_ns / 8).max(floor);
    if next < r.est_ns {
        r.est_ns = next;
    }
}

/// The estimate after sample `t` (ns; `est` 0: none yet): a quarter of the way up to a
/// longer sample, an eighth of the way down to a shorter one, a sample counting at most 8
/// times the estimate. Samples are noisy both ways (each is a wake-up late at its end and
/// starts from the previous wake-up): leaning a little long keeps the bound near the
/// budget on a loaded host; leaning more (half of the way up) held 50 µs kernels under
/// K = 4 at 14 % of submissions on this development VM (a quarter: 0.2 %).
pub(super) fn estimate(est: u64, t: u64) -> u64 {
    let next = match est {
        0 => t,
        e => {
            let t = t.min(e.saturating_mul(8));
            if t > e {
                e + (t - e) / 4
            } else {
                e - (e - t) / 8
            }
        }
    };
    next.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{DEFAULT_INFLIGHT, DEFAULT_INFLIGHT_US};

    /// The tests that set K and the budget run one at a time.
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn ring(est_ns: u64, samples: u32, share_ns: u64) -> Ring {
        Ring {
            est_ns,
            samples,
            share_ns,
            ..Ring::EMPTY
        }
    }

    /// The bound is the number of submissions whose estimate fits the ring's share of the
    /// budget (the budget split among the process's streams on the GPU), at least one, at
    /// most K; events are recorded every half bound, at most every `BATCH_MAX`.
    #[test]
    fn the_bound_and_the_batch() {
        let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        INFLIGHT.store(32, Relaxed);
        BUDGET_NS.store(500_000, Relaxed);
        assert_eq!(share_ns(1), 500_000);
        assert_eq!(share_ns(4), 125_000, "four streams share the budget");
        assert_eq!(limit(&ring(2_000_000, FIRST_SAMPLES, 500_000)), 1, "2 ms");
        assert_eq!(limit(&ring(200_000, FIRST_SAMPLES, 500_000)), 2, "0.2 ms");
        assert_eq!(limit(&ring(50_000, FIRST_SAMPLES, 500_000)), 10, "0.05 ms");
        assert_eq!(limit(&ring(50_000, FIRST_SAMPLES, 125_000)), 2, "a quarter");
        assert_eq!(limit(&ring(1_000, FIRST_SAMPLES, 500_000)), 32, "K caps it");
        INFLIGHT.store(64, Relaxed);
        assert_eq!(limit(&ring(1_000, 1, 500_000)), 1, "not settled");
        assert_eq!(limit(&ring(1_000, 0, 0)), 64, "no budget: K");
        assert_eq!(batch(1), 1);
        assert_eq!(batch(2), 1);
        assert_eq!(batch(10), 5);
        assert_eq!(batch(32), 16);
        assert_eq!(batch(64), BATCH_MAX);
        assert_eq!(batch(4096), BATCH_MAX);
        INFLIGHT.store(DEFAULT_INFLIGHT, Relaxed);
        BUDGET_NS.store(DEFAULT_INFLIGHT_US * 1_000, Relaxed);
    }

    /// The lead is what the share leaves beyond the one submission it allows (or the share
    /// itself for a longer submission), at most `LEAD_MAX_NS` and the estimate, and none
    /// where K sets the bound, two or more fit, or the estimate is not settled; an
    /// overshot sleep brings the estimate down an eighth, never so far that two fit.
    #[test]
    fn the_lead_and_its_correction() {
        let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        INFLIGHT.store(4, Relaxed);
        let r = ring(2_000_000, FIRST_SAMPLES, 3_000_000);
        assert_eq!(limit(&r), 1);
        assert_eq!(lead_ns(&r, 1), LEAD_MAX_NS, "1 ms left over, capped");
        let r = ring(2_800_000, FIRST_SAMPLES, 3_000_000);
        assert_eq!(lead_ns(&r, 1), 200_000, "what is left when under the cap");
        let r = ring(2_000_000, FIRST_SAMPLES, 300_000);
        assert_eq!(lead_ns(&r, 1), 300_000, "longer than the share: the share");
        assert_eq!(lead_ns(&ring(2_000_000, 1, 3_000_000), 1), 0, "not settled");
        let r = ring(500_000, FIRST_SAMPLES, 3_000_000);
        assert_eq!(limit(&r), 4);
        assert_eq!(lead_ns(&r, 4), 0, "K sets the bound");
        let r = ring(1_200_000, FIRST_SAMPLES, 3_000_000);
        assert_eq!(limit(&r), 2);
        assert_eq!(lead_ns(&r, 2), 0, "two in flight: one is always queued");
        INFLIGHT.store(1, Relaxed);
        assert_eq!(
            lead_ns(&ring(2_000_000, FIRST_SAMPLES, 3_000_000), 1),
            0,
            "K = 1 sets it"
        );
        INFLIGHT.store(4, Relaxed);
        assert_eq!(
            lead_ns(&ring(2_000_000, FIRST_SAMPLES, 0), 1),
            0,
            "no budget"
        );
        let mut r = ring(2_000_000, FIRST_SAMPLES, 3_000_000);
        shorten(&mut r, 100_000);
        assert_eq!(r.est_ns, 1_750_000, "an eighth at a time");
        for _ in 0..20 {
            shorten(&mut r, 100_000);
        }
        assert_eq!(r.est_ns, 1_500_001, "never to where two fit the budget");
        assert_eq!(limit(&r), 1);
        shorten(&mut r, 1_600_000);
        assert_eq!(r.est_ns, 1_500_001, "never up");
        INFLIGHT.store(DEFAULT_INFLIGHT, Relaxed);
    }

    #[test]
    fn the_estimate_leans_long_and_caps_a_stall() {
        assert_eq!(
            estimate(0, 2_000),
            2_000,
            "the first sample is the estimate"
        );
        assert_eq!(estimate(1_000, 2_000), 1_250, "a quarter of the way up");
        assert_eq!(estimate(2_000, 1_000), 1_875, "an eighth of the way down");
        // A stall of 100 times the estimate counts as 8 times it.
        assert_eq!(estimate(1_000, 100_000), 1_000 + 7_000 / 4);
        // Kernels that became 10 times longer are followed within a few samples.
        let mut e = 1_000;
        for _ in 0..6 {
            e = estimate(e, 10_000);
        }
        assert!(e > 8_000, "{e}");
        // Short samples now and then do not pull a 2 ms estimate under 1.5 ms (where a
        // 3 ms budget would allow two kernels of 2 ms): one in four at a quarter.
        let mut e = 2_000_000;
        for i in 0..400 {
            e = estimate(e, if i % 4 == 0 { 500_000 } else { 2_000_000 });
        }
        assert!(e > 1_500_000, "{e}");
        assert_eq!(estimate(1, 0), 1, "never 0 (0 means none)");
    }
}
