//! The learned release window in the loop (`--release learned`): once an online process
//! has shown its gaps (doorbell launches, completion stamps), a GPU whose offline work is
//! gated releases a short window after online's work was seen complete — never before,
//! never while its latest work is not stamped complete, and not at all where an offline
//! process has no gate, an online process's page would not wake the agent, or the policy
//! is off.

use super::*;
use crate::control::learn::Learning;
use crate::edges::doorbell::Owner;
use qos_core::release::Adaptive;

/// Offline 10 (gated: its page 1 has an entry for GPU 0) and online 20 (page 2, waking
/// after 1 ms gaps) on GPU 0, learning with a 2 ms floor and a 2 ms drain.
fn setup(name: &str, learning: bool) -> (H, PathBuf) {
    setup_waking(name, learning, MS)
}

/// [`setup`], online's page waking after gaps of `wake_gap`.
fn setup_waking(name: &str, learning: bool, wake_gap: u64) -> (H, PathBuf) {
    let dir = TmpDir::new(&format!("coloc-learn-{name}"));
    let path = dir.join("gates");
    let mut cfg = user_config();
    cfg.gate_timeout = Duration::from_millis(50);
    cfg.release = learning.then_some(Learning {
        adaptive: Adaptive::default(),
        drain_ns: 2 * MS,
        at_once: false,
    });
    let mut h = harness_edges(1, cfg, Some(path.clone()));
    h.scratch.push(dir);
    h.spawn(0, 10, class(Class::Offline, None));
    h.spawn(0, 20, class(Class::Online, None));
    h.bells.offline_page(1, Owner::Pid(10), 0);
    h.bells.ack(1, 0, 0);
    h.bells.page(2, Owner::Pid(20), 0);
    h.bells.set_wake_gap(2, wake_gap);
    h.ticks(3);
    (h, path)
}

/// One request of online 20: launched now, 20 ms of work, stamped complete when done;
/// the gate acknowledges each close at once. Returns the stamp.
fn request(h: &mut H, path: &std::path::Path) -> u64 {
    let start = h.now();
    h.bells.ring_drained(2, 0, start, start, 0);
    for _ in 0..20 {
        h.tick();
        if let Some(epoch) = super::gates::closed(path, 0) {
            h.bells.ack(1, 0, epoch);
        }
    }
    let done = h.now();
    h.bells.ring_drained(2, 0, start, start, done);
    h.tick();
    done
}

/// Runs `n` requests 50 ms apart; returns, per request after the first 22, how long after
/// its stamp offline was running again (None: not within the gap).
fn serve(h: &mut H, path: &std::path::Path, n: usize) -> Vec<Option<u64>> {
    let mut out = Vec::new();
    for i in 0..n {
        let start = h.now();
        let done = request(h, path);
        let mut released = None;
        while h.now() < start + 50 * MS {
            if released.is_none() && !h.suspended(10) {
                released = Some(h.now() - done);
            }
            h.tick();
        }
        if i >= 22 {
            out.push(released);
        }
    }
    out
}

#[test]
fn a_gated_gpu_releases_a_learned_window_after_online_work_completes() {
    let (mut h, path) = setup("learned", true);
    let after = serve(&mut h, &path, 30);
    for a in &after {
        let a = a.expect("released within the 30 ms gap");
        assert!(
            (2 * MS..=4 * MS).contains(&a),
            "released {a} ns after the stamp: the learned 2 ms window (and the fake's actuation)"
        );
    }
    let doc = h.lp.ctl.sub.state_doc(h.now());
    assert_eq!(
        doc.gpus[0].release_window_ms, 2.0,
        "/state shows the window"
    );
    // A launch not yet stamped complete: no release, however long it runs.
    let start = h.now();
    h.bells.ring_drained(2, 0, start, start, 0);
    h.ticks(60);
    assert!(
        h.suspended(10),
        "released while online's latest work was outstanding"
    );
}

#[test]
fn the_fixed_window_where_the_policy_is_off_a_page_would_not_wake_or_offline_is_not_gated() {
    // Off: 100 ms after the last launch, never within the 30 ms gaps.
    let (mut h, path) = setup("off", false);
    let after = serve(&mut h, &path, 26);
    assert!(after.iter().all(|a| a.is_none()), "{after:?}");
    // A page waking only after 100 ms gaps: a launch 30 ms into a gap would go unseen.
    let (mut h, path) = setup_waking("wake", true, 100 * MS);
    assert!(serve(&mut h, &path, 26).iter().all(|a| a.is_none()));
    // A second offline process without a gate on the GPU.
    let (mut h, path) = setup("ungated", true);
    h.spawn(0, 11, class(Class::Offline, None));
    h.ticks(2);
    let after = serve(&mut h, &path, 26);
    assert!(after.iter().all(|a| a.is_none()), "{after:?}");
}
