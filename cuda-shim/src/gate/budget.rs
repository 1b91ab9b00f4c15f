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

/// The ring's bound now: K (`UNBOUNDED_CAP` for 0), and with a budget B the number of
/// submissions whose estimated time fits in B, at least 1 and at most that (1 until
/// [`FIRST_SAMPLES`] samples).
fn limit(r: &Ring) -> usize {
    let k = INFLIGHT.load(Relaxed) as usize;
    let cap = if k == 0 { UNBOUNDED_CAP } else { k };
    match BUDGET_NS.load(Relaxed) {
        0 => cap,
        _ if r.samples < FIRST_SAMPLES => 1,
        b => ((b / r.est_ns) as usize).clamp(1, cap),
    }
}

/// Keeps the ring within the in-flight bound before a submission: waits for the oldest
/// event while the bound is reached (K = 0 without a budget: only recycles those already
/// complete). With a budget, each wait that blocks also times the submission it waited
/// for: from its start (its submission when it was alone in flight, else the previous
/// wait's return, the stream having stayed backlogged since) to the wait's return. That is
/// the wall-clock time the stream took for it, wake-ups and other contexts' time slices
/// included, not its GPU time alone. (When the bound is never reached, nothing is timed
/// and the estimate stays: the application itself keeps fewer in flight than the budget
/// allows. Time held at the gate breaks the run.)
pub(super) fn bound(r: &mut Ring, entry: &Entry, closed: Option<&AtomicU32>) {
    let budget = BUDGET_NS.load(Relaxed) != 0;
    if INFLIGHT.load(Relaxed) == 0 && !budget {
        while let Some(&e) = r.events.front() {
            if !event_done(e) {
                break;
            }
            r.events.pop_front();
            r.free.push(e);
            entry.inflight.fetch_sub(1, Relaxed);
        }
    }
    let limit = limit(r);
    if r.events.len() < limit {
        // Not backlogged at the bound: the next wait has no previous one to start from.
        r.prev_done_ns = 0;
        return;
    }
    let lead = lead_ns(r, limit);
    let keep = if lead > 0 { limit + 1 } else { limit };
    while r.events.len() >= keep {
        wait_oldest(r, entry, budget);
    }
    if lead > 0 && r.events.len() == limit && !submit_ahead(r, lead, closed) {
        wait_oldest(r, entry, budget);
    }
}

/// Waits for the oldest submission in flight and recycles its event; with a budget, a
/// wait that blocks times it (see [`bound`]).
fn wait_oldest(r: &mut Ring, entry: &Entry, budget: bool) {
    let start = if r.events.len() == 1 {
        r.last_sub_ns.max(r.prev_done_ns)
    } else {
        r.prev_done_ns
    };
    let Some(e) = r.events.pop_front() else {
        return;
    };
    // Only a wait that blocks times anything: an event already complete finished at
    // some unknown time before (and breaks the run for the next one).
    let done_already = budget && event_done(e);
    if !done_already {
        sync_event(e);
    }
    r.free.push(e);
    entry.inflight.fetch_sub(1, Relaxed);
    if done_already {
        r.prev_done_ns = 0;
    } else if budget {
        let done = mono_ns();
        if start != 0 && done > start {
            r.est_ns = estimate(r.est_ns, done - start);
            r.samples = (r.samples + 1).min(FIRST_SAMPLES);
        }
        r.prev_done_ns = done;
    }
}

/// Where the budget holds a stream to one submission in flight and has room for part of
/// one more (3 ms, kernels of 2 ms: 1 ms), that part (ns, at most [`LEAD_MAX_NS`]), else
/// 0: the next submission may go in when the one in flight has about that much left, so
/// the GPU has it queued when the first ends instead of waiting for this thread to wake
/// and submit it. Work in flight by the estimate stays within the budget. Only at a
/// bound of one (with two or more in flight, one is always queued behind the running
/// one), under a budget (not K = 1), once the estimate is settled.
fn lead_ns(r: &Ring, limit: usize) -> u64 {
    let (b, k) = (BUDGET_NS.load(Relaxed), INFLIGHT.load(Relaxed) as usize);
    let cap = if k == 0 { UNBOUNDED_CAP } else { k };
    if b == 0 || r.samples < FIRST_SAMPLES || limit != 1 || cap == 1 || r.est_ns == 0 {
        return 0;
    }
    b.saturating_sub(r.est_ns.saturating_mul(limit as u64))
        .min(r.est_ns)
        .min(LEAD_MAX_NS)
}

/// The most a lead may be: enough to cover the submitting thread's wake-up on a loaded
/// host (100–200 µs on a busy 2-core machine) with room to spare, and no more, since
/// every microsecond of lead is work in flight that online waits for after a close.
const LEAD_MAX_NS: u64 = 500_000;

/// At the bound with a lead: waits until the oldest submission in flight is expected to
/// have `lead` left (its start, the previous wait's return or its submission when it was
/// alone, plus the estimate), or the gate closes, then lets the next one in (true).
/// Without a start (the run broke), false: the caller waits for the oldest as without a
/// lead.
fn submit_ahead(r: &mut Ring, lead: u64, closed: Option<&AtomicU32>) -> bool {
    let start = if r.events.len() == 1 {
        r.last_sub_ns.max(r.prev_done_ns)
    } else {
        r.prev_done_ns
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
    if r.events.front().is_some_and(|&e| event_done(e)) {
        shorten(r, mono_ns().saturating_sub(start));
    }
    true
}

/// The submission in flight ended within `t` (ns) of the previous wait's return: the
/// estimate comes down an eighth of itself towards `t` if over. Not to `t` at once: the
/// previous wait returned a wake-up after the true end, so `t` may be short by that much;
/// and never so far that the bound grows (only the timed waits may do that).
fn shorten(r: &mut Ring, t: u64) {
    let floor = BUDGET_NS.load(Relaxed) / (limit(r) as u64 + 1) + 1;
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
    use crate::config::{DEFAULT_INFLIGHT, DEFAULT_INFLIGHT_MS};
    use std::collections::VecDeque;

    fn ring(est_ns: u64, samples: u32) -> Ring {
        Ring {
            key: None,
            ctx: 0,
            record_on: 0,
            events: VecDeque::new(),
            free: Vec::new(),
            est_ns,
            last_sub_ns: 0,
            prev_done_ns: 0,
            samples,
        }
    }

    /// The lead is what the budget leaves beyond the one submission it allows, at most
    /// `LEAD_MAX_NS`, and none where K sets the bound, two or more fit, or the estimate
    /// is not settled;
    /// an overshot sleep brings the estimate down an eighth, never so far that the
    /// bound grows. (The only test here that sets the budget and K.)
    #[test]
    fn the_lead_and_its_correction() {
        BUDGET_NS.store(3_000_000, Relaxed);
        INFLIGHT.store(4, Relaxed);
        let r = ring(2_000_000, FIRST_SAMPLES);
        assert_eq!(limit(&r), 1);
        assert_eq!(lead_ns(&r, 1), LEAD_MAX_NS, "1 ms left over, capped");
        let r = ring(2_800_000, FIRST_SAMPLES);
        assert_eq!(lead_ns(&r, 1), 200_000, "what is left when under the cap");
        assert_eq!(lead_ns(&ring(2_000_000, 1), 1), 0, "not settled");
        let r = ring(500_000, FIRST_SAMPLES);
        assert_eq!(limit(&r), 4);
        assert_eq!(lead_ns(&r, 4), 0, "K sets the bound");
        let r = ring(1_200_000, FIRST_SAMPLES);
        assert_eq!(limit(&r), 2);
        assert_eq!(lead_ns(&r, 2), 0, "two in flight: one is always queued");
        INFLIGHT.store(1, Relaxed);
        assert_eq!(
            lead_ns(&ring(2_000_000, FIRST_SAMPLES), 1),
            0,
            "K = 1 sets it"
        );
        INFLIGHT.store(4, Relaxed);
        BUDGET_NS.store(0, Relaxed);
        assert_eq!(lead_ns(&ring(2_000_000, FIRST_SAMPLES), 1), 0, "no budget");
        BUDGET_NS.store(3_000_000, Relaxed);
        let mut r = ring(2_000_000, FIRST_SAMPLES);
        shorten(&mut r, 100_000);
        assert_eq!(r.est_ns, 1_750_000, "an eighth at a time");
        for _ in 0..20 {
            shorten(&mut r, 100_000);
        }
        assert_eq!(r.est_ns, 1_500_001, "never to where two fit the budget");
        assert_eq!(limit(&r), 1);
        shorten(&mut r, 1_600_000);
        assert_eq!(r.est_ns, 1_500_001, "never up");
        BUDGET_NS.store(DEFAULT_INFLIGHT_MS * 1_000_000, Relaxed);
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
