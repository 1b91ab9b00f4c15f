//! Doorbells in the loop: a launch of an online process preempts at once, measured from
//! the launch; a page that does not belong to an online process suspends nothing.

use super::*;
use crate::control::note::{self, Note};
use crate::control::nvml::Refresh;
use crate::edges::doorbell::Owner;

/// Offline 10 and online 20 on GPU 0, with the user's defaults (NVML read every 100 ms).
fn setup() -> H {
    let mut h = harness_with(1, user_config());
    h.spawn(0, 10, class(Class::Offline, None));
    h.spawn(0, 20, class(Class::Online, None));
    h.ticks(3);
    h
}

#[test]
fn a_launch_preempts_at_once_measured_from_the_launch() {
    let mut h = setup();
    h.bells.page(1, Owner::Pid(20), 0);
    h.clock.advance(10 * MS);
    let launch = h.now();
    h.clock.advance(MS / 5);
    h.bells.ring(1, 0, launch, launch);
    h.lp.tick();
    assert!(
        h.suspended(10),
        "the doorbell preempts without waiting for NVML"
    );
    h.ticks(3);
    let ev = h.events();
    let Some(Event::Preempt(p)) = ev.iter().find(|e| matches!(e, Event::Preempt(_))) else {
        panic!("{ev:?}")
    };
    assert_eq!(p.signal, qos_core::Signal::Doorbell);
    assert_eq!(p.onset_ns, launch, "onset is the launch time");
    assert_eq!(p.detection_s, 0.0002);
    // Launches keep it busy; the window counts from the last launch.
    let last = h.now();
    h.bells.ring(1, 0, launch, last);
    h.tick();
    while h.now() < last + 99 * MS {
        h.tick();
        assert!(h.suspended(10), "released before the window's end");
    }
    h.clock.set(last + 100 * MS);
    h.tick();
    assert!(
        !h.suspended(10),
        "released at the window's end after the last launch"
    );
}

#[test]
fn pages_that_are_not_an_online_owners_suspend_nothing() {
    let mut h = setup();
    h.spawn(0, 30, class(Class::Online, None));
    h.procs.procs.lock().unwrap().get_mut(&30).unwrap().uid = 1000;
    h.ticks(1);
    // The offline process's own page; a page naming an online PID but owned by another
    // UID; a page naming a PID the driver does not list; a page for a GPU that is not
    // the owner's; a pod page for a pod nobody runs in.
    h.bells.page(1, Owner::Pid(10), 0);
    h.bells.page(2, Owner::Pid(30), 0);
    h.bells.page(3, Owner::Pid(4242), 0);
    h.bells.page(4, Owner::Pid(20), 0);
    h.bells.page(
        5,
        Owner::Pod("0b7f7c1e-8d52-4c4a-9b0e-2f0b1d6c5a11".into()),
        0,
    );
    for _ in 0..50 {
        let now = h.now();
        h.bells.ring(1, 0, now, now);
        h.bells.ring(2, 0, now, now);
        h.bells.ring(3, 0, now, now);
        h.bells.ring(4, 3, now, now);
        h.bells.ring(5, 0, now, now);
        h.tick();
        assert!(!h.suspended(10), "a forged ring suspended offline work");
    }
    assert!(h.events().is_empty(), "{:?}", h.events());
    // The same launches from the online owner's own page preempt.
    h.bells.page(6, Owner::Pid(20), 0);
    let now = h.now();
    h.bells.ring(6, 0, now, now);
    h.tick();
    assert!(h.suspended(10));
}

/// Kubernetes layout: a page in a pod's directory counts for that pod's online process.
#[test]
fn a_pod_page_counts_for_the_pods_online_process() {
    let mut h = harness_with(1, user_config());
    let uid = "0b7f7c1e-8d52-4c4a-9b0e-2f0b1d6c5a11";
    h.spawn(0, 10, class(Class::Offline, None));
    h.procs.add(
        20,
        120,
        "serve",
        &format!("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-abc.scope", uid.replace('-', "_")),
    );
    h.gpu.add(0, 20);
    h.source.set(20, class(Class::Online, None));
    h.ticks(3);
    // Another pod's page first: nothing.
    h.bells.page(
        1,
        Owner::Pod("11111111-2222-3333-4444-555555555555".into()),
        0,
    );
    let now = h.now();
    h.bells.ring(1, 0, now, now);
    h.ticks(3);
    assert!(!h.suspended(10), "a page of a pod with no process here");
    h.bells.page(2, Owner::Pod(uid.into()), 0);
    let now = h.now();
    h.bells.ring(2, 0, now, now);
    h.lp.tick();
    assert!(h.suspended(10), "the pod's own page preempts");
}

/// What the shell judges a page's launch by while it gathers the snapshot
/// (`Known::names_unknown`), as the controller attributes it: the lists are read for a
/// process the table does not hold, or an online one it does not hold on that GPU yet;
/// never for an offline owner, a page of another user, a pod whose online process is known
/// on that GPU, a pod with no online process, or a GPU failed open.
#[test]
fn the_shell_reads_the_lists_for_the_owners_the_controller_cannot_attribute() {
    use crate::edges::doorbell::{BellReading, PageInfo};
    let mut h = harness_with(2, user_config());
    let pod = "0b7f7c1e-8d52-4c4a-9b0e-2f0b1d6c5a11";
    let cgroup = format!(
        "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-abc.scope",
        pod.replace('-', "_")
    );
    let other = "11111111-2222-3333-4444-555555555555";
    let other_cgroup = cgroup.replace(&pod.replace('-', "_"), &other.replace('-', "_"));
    h.spawn(0, 10, class(Class::Offline, None));
    h.procs.add(20, 120, "serve", &cgroup);
    h.gpu.add(0, 20);
    h.source.set(20, class(Class::Online, None));
    h.procs.add(30, 130, "batch", &other_cgroup);
    h.gpu.add(0, 30);
    h.source.set(30, class(Class::Offline, None));
    h.ticks(3);
    let known = h.lp.ctl.known();
    let at = h.now();
    let judge = |owner: Owner, file_uid: u32, gpu: u32| {
        let page = PageInfo {
            id: 1,
            path: "/run/gpu-coloc/doorbells/1.bell".into(),
            owner,
            file_uid,
            wake_gap_ns: 0,
            pid: 1,
            class: coloc_doorbell::CLASS_ONLINE,
        };
        let r = BellReading {
            page: 1,
            reading: coloc_doorbell::Reading {
                index: 0,
                uuid: crate::edges::fake::fake_uuid(gpu),
                last_launch_ns: at,
                busy_since_ns: at,
            },
            drained_ns: 0,
        };
        // Every PID is the process the table knows under it.
        let procs = h.procs.clone();
        known.names_unknown(&page, &r, &mut |pid| {
            crate::edges::procfs::ProcFs::read_stat(&procs, pid)
                .ok()
                .map(|s| s.start)
        })
    };
    assert!(judge(Owner::Pid(99), 0, 0), "a PID the table does not hold");
    assert!(!judge(Owner::Pid(20), 0, 0), "online 20 is held on GPU 0");
    assert!(
        judge(Owner::Pid(20), 0, 1),
        "online 20 is not held on GPU 1 yet"
    );
    assert!(!judge(Owner::Pid(20), 7, 1), "a page of another user");
    assert!(!judge(Owner::Pid(10), 0, 1), "an offline owner");
    assert!(
        judge(
            Owner::Pod("22222222-0000-0000-0000-000000000000".into()),
            0,
            0
        ),
        "a pod the table does not hold"
    );
    assert!(
        !judge(Owner::Pod(pod.into()), 0, 0),
        "the pod's online process on GPU 0"
    );
    assert!(
        judge(Owner::Pod(pod.into()), 0, 1),
        "the pod's online process is not on GPU 1 yet"
    );
    assert!(
        !judge(Owner::Pod(other.into()), 0, 0),
        "a pod with no online process"
    );
}

/// A launch that rings while a round of NVML reads runs is decided before the round ends:
/// a ring before the round puts it off whole (once in a row), one during it stops it
/// after the GPU in progress, and the round goes on from there at the next tick.
#[test]
fn a_ring_interrupts_a_round_of_nvml_reads() {
    let mut h = harness_with(3, user_config());
    h.spawn(0, 10, class(Class::Offline, None));
    h.spawn(0, 20, class(Class::Online, None));
    h.ticks(3);
    h.clock.advance(100 * MS);
    h.gpu.state.lock().unwrap().sampled.clear();
    h.bells.state.lock().unwrap().rang_after = Some(0);
    h.lp.tick();
    assert_eq!(
        h.gpu.state.lock().unwrap().sampled,
        Vec::<u32>::new(),
        "a ring before the round puts it off"
    );
    h.clock.advance(MS / 10);
    h.lp.tick();
    assert_eq!(
        h.gpu.state.lock().unwrap().sampled,
        vec![0],
        "put off once in a row at most; then the ring stops the round after one GPU"
    );
    h.bells.state.lock().unwrap().rang_after = None;
    h.clock.advance(MS / 10);
    h.lp.tick();
    assert_eq!(
        h.gpu.state.lock().unwrap().sampled,
        vec![0, 1, 2],
        "the round goes on where it stopped"
    );
    h.clock.advance(MS / 10);
    h.lp.tick();
    assert_eq!(
        h.gpu.state.lock().unwrap().sampled,
        vec![0, 1, 2],
        "the round is complete: the next one waits for --nvml-interval"
    );
}

/// The first launch of an online process that started after the latest read of the
/// driver's process lists preempts in the tick that reads it: the lists are read then and
/// there, not one poll interval later.
#[test]
fn a_new_processs_first_launch_preempts_in_the_same_tick() {
    let mut h = harness_with(1, user_config());
    h.spawn(0, 10, class(Class::Offline, None));
    // Its pod is known (no change of the pod source follows).
    h.source.set(20, class(Class::Online, None));
    h.ticks(3);
    // Started after the latest list read; the driver lists it now.
    h.procs.add(20, 120, "serve", "/w");
    h.gpu.add(0, 20);
    first_launch(&mut h, 20);
    assert!(
        h.suspended(10),
        "the first launch of a process not yet in the lists waited for another tick"
    );
}

/// Page 1 of `pid` rings on GPU 0 a millisecond from now: the loop's next tick reads it.
fn first_launch(h: &mut H, pid: u32) {
    h.bells.page(1, Owner::Pid(pid), 0);
    h.clock.advance(MS);
    let launch = h.now();
    h.bells.ring(1, 0, launch, launch);
    h.lp.tick();
}

/// How many times the lists were read for a doorbell page so far.
fn doorbell_list_reads(h: &H) -> usize {
    (h.lp.said.iter())
        .filter(|n| {
            matches!(
                n,
                Note::ListRefresh(note::ListRefresh {
                    why: Refresh::Doorbell
                })
            )
        })
        .count()
}

/// A just-started online process whose PID an offline process held until lately (its
/// entry not yet dropped by a list read): its first launch preempts in the tick that reads
/// it, as any new process's does; the stale offline entry does not speak for it.
#[test]
fn a_reused_pid_of_an_offline_process_does_not_delay_the_new_processs_first_launch() {
    let mut h = harness_with(1, user_config());
    h.spawn(0, 10, class(Class::Offline, None));
    h.spawn(0, 11, class(Class::Offline, None));
    h.ticks(3);
    // 11 exits and a new online process takes its PID; its pod was known before (no
    // change of the pod source follows).
    h.procs.add(11, 999, "serve", "/w");
    h.source
        .classes
        .lock()
        .unwrap()
        .insert(11, class(Class::Online, None));
    first_launch(&mut h, 11);
    assert!(
        h.suspended(10),
        "the first launch of a process that reuses an offline PID waited for the next list read"
    );
    assert!(!h.suspended(11), "the new online process was held");
}

/// A tenant's online page that names its own offline process (alive, the same process
/// the table knows), ringing at every tick: no list read for it, and the offline process
/// is no online demand.
#[test]
fn a_page_naming_a_live_offline_process_costs_no_list_read() {
    let mut h = harness_with(1, user_config());
    h.spawn(0, 10, class(Class::Offline, None));
    h.spawn(0, 11, class(Class::Offline, None));
    h.ticks(3);
    h.bells.page(1, Owner::Pid(11), 0);
    for _ in 0..1500 {
        let now = h.now();
        h.bells.ring(1, 0, now, now);
        h.tick();
    }
    let for_pages = doorbell_list_reads(&h);
    assert_eq!(for_pages, 0, "list reads for a page of a known process");
    assert!(
        !h.suspended(10),
        "an offline process's page is online demand"
    );
}

/// A tenant's pages that name processes the driver never lists (two of them, ringing in
/// turn at every tick) have the lists read for them at most once a second each: the reads
/// a launch of a just-started process gets are not a tenant's to spend.
#[test]
fn a_page_naming_a_process_that_never_comes_costs_one_list_read_a_second() {
    let mut h = harness_with(1, user_config());
    h.spawn(0, 10, class(Class::Offline, None));
    h.spawn(0, 20, class(Class::Online, None));
    h.ticks(3);
    h.bells.page(1, Owner::Pid(999), 0);
    h.bells.page(2, Owner::Pid(998), 0);
    for i in 0..1500 {
        let now = h.now();
        h.bells.ring(1 + i % 2, 0, now, now);
        h.tick();
    }
    let for_pages = doorbell_list_reads(&h);
    assert!(
        (1..=4).contains(&for_pages),
        "{for_pages} list reads for the pages in 1.5 s"
    );
}

/// A page that claims a launch an hour from now keeps the window open only as if the
/// launch were now: launch times are clamped to the agent's clock.
#[test]
fn a_launch_time_in_the_future_counts_as_now() {
    let mut h = setup();
    h.bells.page(1, Owner::Pid(20), 0);
    let now = h.now();
    h.bells.ring(1, 0, now, now + 3_600_000 * MS);
    h.lp.tick();
    assert!(h.suspended(10), "a launch now preempts");
    h.clock.set(now + 100 * MS);
    h.tick();
    h.tick();
    assert!(
        !h.suspended(10),
        "still held a window after a launch claimed for an hour from now"
    );
}

/// Offline 10 and online 20 on GPU 0 (the user's defaults), pages distrusted after 1 s.
fn setup_trust() -> H {
    let mut cfg = user_config();
    cfg.doorbell_trust_window = Duration::from_secs(1);
    let mut h = harness_with(1, cfg);
    h.spawn(0, 10, class(Class::Offline, None));
    h.spawn(0, 20, class(Class::Online, None));
    h.ticks(3);
    h.bells.page(1, Owner::Pid(20), 0);
    h
}

fn distrusts(h: &H) -> Vec<crate::control::events::Distrust> {
    h.events()
        .into_iter()
        .filter_map(|e| match e {
            Event::Distrust(d) => Some(d),
            _ => None,
        })
        .collect()
}

/// An online process that writes launch times without running anything (its page says
/// "busy", NVML never shows it at work) holds offline work for the trust window, then its
/// launches count for nothing and offline runs, whatever the page says; a sample showing
/// it at work makes its page count again.
#[test]
fn launches_nvml_never_corroborates_stop_counting_after_the_trust_window() {
    let mut h = setup_trust();
    let t0 = h.now();
    let mut freed_at = None;
    while h.now() < t0 + 1_500 * MS {
        let now = h.now();
        h.bells.ring(1, 0, t0, now);
        h.tick();
        if freed_at.is_none() && !h.suspended(10) && h.now() > t0 + 10 * MS {
            freed_at = Some(h.now());
        }
    }
    let freed = freed_at.expect("offline work stayed held by claims NVML never saw");
    assert!(
        freed >= t0 + 1_000 * MS && freed <= t0 + 1_000 * MS + 110 * MS,
        "held for the trust window, then released within the idle window: {} ms",
        (freed - t0) / MS
    );
    let d = distrusts(&h);
    assert_eq!(d.len(), 1, "{d:?}");
    assert!(
        !d[0].restored && d[0].owner == "pid:20" && d[0].gpu == 0,
        "{d:?}"
    );
    assert!(
        d[0].nvml_seen_ns.is_none() && d[0].claimed_s >= 1.0,
        "{d:?}"
    );
    let listed = h.lp.ctl.sub.observed.bells.distrusted();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].owner, "pid:20");
    // Still distrusted, however it rings, until the driver shows it at work.
    distrusted_until_seen(&mut h, 1, 20);
    let d = distrusts(&h);
    assert!(d.last().is_some_and(|d| d.restored), "{d:?}");
    assert!(h.lp.ctl.sub.observed.bells.distrusted().is_empty());
}

/// Real work keeps its page trusted: continuous launches with the driver showing the
/// process at work at least once per trust window are never distrusted, and breaks in
/// the claims start the count again.
#[test]
fn corroborated_or_interrupted_claims_stay_trusted() {
    let mut h = setup_trust();
    let t0 = h.now();
    let mut next_sample = t0;
    while h.now() < t0 + 3_500 * MS {
        let now = h.now();
        h.bells.ring(1, 0, t0, now);
        if now >= next_sample {
            h.active(0, 20);
            next_sample = now + 800 * MS;
        }
        h.tick();
        if now > t0 + 5 * MS {
            assert!(
                h.suspended(10),
                "corroborated work released at {} ms: {:?} {:?}",
                (now - t0) / MS,
                distrusts(&h),
                h.lp.ctl
                    .sub
                    .observed
                    .table
                    .by_pid(20)
                    .map(|e| e.nvml_seen.clone())
            );
        }
    }
    assert!(distrusts(&h).is_empty(), "{:?}", distrusts(&h));
    // Uncorroborated bursts of 600 ms with 250 ms breaks (offline runs in each): no run
    // reaches the trust window.
    let mut h = setup_trust();
    let t0 = h.now();
    while h.now() < t0 + 4_000 * MS {
        let now = h.now();
        if (now - t0) % (850 * MS) < 600 * MS {
            h.bells.ring(1, 0, now, now);
        }
        h.tick();
    }
    assert!(distrusts(&h).is_empty(), "{:?}", distrusts(&h));
}

/// Claims relayed between two online processes that do no GPU work, each pausing in turn
/// while the other covers the pause (the pauses are long enough to start each one's own
/// run again), hold offline work no longer than one process alone: the GPU's claims,
/// together, are judged against the trust window, and each relaying owner is distrusted.
/// A sample showing either at work restores it.
#[test]
fn relayed_claims_hold_offline_work_no_longer_than_one_owner() {
    let mut h = setup_trust();
    h.spawn(0, 21, class(Class::Online, None));
    h.ticks(3);
    h.bells.page(2, Owner::Pid(21), 0);
    let t0 = h.now();
    let mut freed_at = None;
    // Each rings 700 ms and pauses 500 ms; the other starts 100 ms before it stops.
    while h.now() < t0 + 3_000 * MS {
        let now = h.now();
        let phase = (now - t0) % (1_200 * MS);
        if phase < 700 * MS {
            h.bells.ring(1, 0, now, now);
        }
        if phase >= 600 * MS || (now - t0 >= 1_200 * MS && phase < 100 * MS) {
            h.bells.ring(2, 0, now, now);
        }
        h.tick();
        if freed_at.is_none() && !h.suspended(10) && now > t0 + 10 * MS {
            freed_at = Some(now);
        }
    }
    let freed = freed_at.expect("relayed claims held offline work for 3 s");
    assert!(
        freed <= t0 + 1_000 * MS + 110 * MS,
        "held {} ms by relayed claims (trust window 1 s)",
        (freed - t0) / MS
    );
    let d = distrusts(&h);
    let owners: std::collections::BTreeSet<&str> = d.iter().map(|d| d.owner.as_str()).collect();
    assert!(
        owners.contains("pid:20") && owners.contains("pid:21"),
        "both relaying owners distrusted: {d:?}"
    );
    assert!(d.iter().all(|d| !d.restored && d.claimed_s >= 1.0), "{d:?}");
    // Trusted again once the driver shows it at work.
    distrusted_until_seen(&mut h, 2, 21);
}

/// A pod is one owner: distrust earned by one of its processes stays with the pod when a
/// new process of it maps a new page.
#[test]
fn distrust_stays_with_the_pod_across_its_processes() {
    let mut cfg = user_config();
    cfg.doorbell_trust_window = Duration::from_secs(1);
    let mut h = harness_with(1, cfg);
    let uid = "0b7f7c1e-8d52-4c4a-9b0e-2f0b1d6c5a11";
    let cg = format!(
        "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-abc.scope",
        uid.replace('-', "_")
    );
    h.spawn(0, 10, class(Class::Offline, None));
    for pid in [20, 21] {
        h.procs.add(pid, 100 + pid as u64, "serve", &cg);
        h.gpu.add(0, pid);
        h.source.set(pid, class(Class::Online, None));
    }
    h.ticks(3);
    h.bells.page(1, Owner::Pod(uid.into()), 0);
    let t0 = h.now();
    while h.now() < t0 + 1_200 * MS {
        let now = h.now();
        h.bells.ring(1, 0, t0, now);
        h.tick();
    }
    assert_eq!(distrusts(&h).len(), 1, "{:?}", distrusts(&h));
    assert_eq!(
        h.lp.ctl.sub.observed.bells.distrusted()[0].owner,
        format!("pod:{uid}")
    );
    // Another process of the pod, another page: still nothing counts, until any of its
    // processes is seen at work by the driver.
    h.bells.page(2, Owner::Pod(uid.into()), 0);
    distrusted_until_seen(&mut h, 2, 21);
}

/// Page `page`'s rings preempt nothing (offline 10 runs) until a sample shows `pid` at
/// work; then they preempt again.
fn distrusted_until_seen(h: &mut H, page: u64, pid: u32) {
    for _ in 0..200 {
        let now = h.now();
        h.bells.ring(page, 0, now, now);
        h.tick();
        assert!(!h.suspended(10), "a distrusted owner's page preempted");
    }
    h.active(0, pid);
    h.clock.advance(250 * MS);
    h.ticks(2);
    let now = h.now();
    h.bells.ring(page, 0, now, now);
    h.tick();
    assert!(
        h.suspended(10),
        "trusted again after a sample showed it at work"
    );
}

/// With more pages than the sleep can wait on, the loop asks for the pages whose launches
/// count first: attributed pages and new ones, not pages it rejected.
#[test]
fn the_pages_that_count_are_waited_on_first() {
    let mut h = setup();
    h.bells.page(1, Owner::Pid(20), 0); // the online process's
    h.bells.page(2, Owner::Pid(10), 0); // the offline process's: rejected once it rings
    let now = h.now();
    h.bells.ring(1, 0, now, now);
    h.bells.ring(2, 0, now, now);
    h.tick();
    let state = h.bells.state.clone();
    let preferred = || state.lock().unwrap().preferred.clone();
    assert_eq!(preferred(), vec![1], "attributed yes, rejected no");
    h.bells.page(3, Owner::Pid(20), 0);
    h.tick();
    assert_eq!(preferred(), vec![1, 3], "a new page is waited on");
    h.clock.advance(11_000 * MS);
    h.tick();
    assert_eq!(
        preferred(),
        vec![1],
        "a page new for 10 s that never rang no longer is"
    );
}

/// A tenant that swaps its page (removes it, publishes a new one) keeps its owner's run and
/// its distrust: neither is tied to a page.
#[test]
fn a_page_swap_keeps_the_run_and_the_distrust() {
    let mut h = setup_trust();
    let unpage = |h: &H, id: u64| {
        let mut s = h.bells.state.lock().unwrap();
        s.pages.retain(|p| p.id != id);
        s.readings.retain(|r| r.page != id);
        s.changed = true;
    };
    let t0 = h.now();
    let (mut page, mut swapped) = (1u64, t0);
    while h.now() < t0 + 1_500 * MS {
        if h.now() - swapped >= 400 * MS {
            unpage(&h, page);
            h.tick();
            page += 1;
            h.bells.page(page, Owner::Pid(20), 0);
            swapped = h.now();
        }
        let now = h.now();
        h.bells.ring(page, 0, swapped, now);
        h.tick();
    }
    assert_eq!(
        distrusts(&h).len(),
        1,
        "swapping pages escaped the trust window"
    );
    assert!(!h.suspended(10));
    // Distrusted, a new page changes nothing.
    unpage(&h, page);
    h.tick();
    h.bells.page(page + 1, Owner::Pid(20), 0);
    for _ in 0..50 {
        let now = h.now();
        h.bells.ring(page + 1, 0, now, now);
        h.tick();
        assert!(!h.suspended(10), "a new page restored a distrusted owner");
    }
}

/// Pauses of exactly the idle window (the release would fall in the tick the next claim
/// re-arms the hold) do not restart the count.
#[test]
fn a_pause_of_one_idle_window_does_not_restart_the_count() {
    let mut h = setup_trust();
    let t0 = h.now();
    let (mut run_start, mut last) = (t0, t0);
    while h.now() < t0 + 3_000 * MS {
        let now = h.now();
        if now - run_start < 450 * MS {
            h.bells.ring(1, 0, run_start, now);
            last = now;
        } else if now >= last + 100 * MS {
            run_start = now;
            h.bells.ring(1, 0, now, now);
            last = now;
        }
        h.tick();
    }
    assert_eq!(distrusts(&h).len(), 1, "{:?}", distrusts(&h));
}

/// A launch that rings while the loop is inside a 2 ms NVML call is acted on as soon as
/// that call returns: the NVML reads still due in the tick (the rest of the samples, every
/// GPU's process list) wait for the next tick, and the doorbells are read before them.
#[test]
fn a_launch_during_an_nvml_call_is_acted_on_within_200us_of_its_end() {
    let mut h = harness_with(8, user_config());
    h.spawn(0, 10, class(Class::Offline, None));
    h.spawn(0, 20, class(Class::Online, None));
    h.bells.page(1, Owner::Pid(20), 0);
    h.ticks(3);
    assert!(!h.suspended(10));
    {
        let mut c = h.gpu.call_time.lock().unwrap();
        c.clock = Some(h.clock.clone());
        c.ns = 2 * MS;
        let bells = h.bells.clone();
        c.midway = Some(Box::new(move |now| {
            bells.ring(1, 0, now, now);
            let mut s = bells.state.lock().unwrap();
            s.rang_after = Some(s.rang_calls);
        }));
    }
    // The samples and the process lists (every 50 ms) are both due.
    h.clock.advance(200 * MS);
    h.lp.tick();
    assert!(h.suspended(10), "the launch was not acted on in its tick");
    let ends = h.gpu.call_time.lock().unwrap().ends.clone();
    let call_end = ends[0];
    let acted = h
        .act
        .calls()
        .iter()
        .find(|c| c.op == Op::Suspend)
        .and_then(|c| c.at_ns)
        .expect("a suspension");
    assert!(
        acted >= call_end && acted - call_end <= 200_000,
        "acted on {} µs after the NVML call the launch arrived in returned ({} NVML calls \
         of 2 ms in between)",
        (acted - call_end) / 1000,
        ends.iter().filter(|e| **e <= acted).count() - 1
    );
}

/// A ring puts the due process lists off to the next tick, once in a row at most: pages
/// that keep ringing never starve them.
#[test]
fn a_ring_puts_the_lists_off_once_in_a_row_at_most() {
    let mut h = harness_with(1, user_config());
    h.spawn(0, 10, class(Class::Offline, None));
    h.spawn(0, 20, class(Class::Online, None));
    h.ticks(3);
    h.bells.state.lock().unwrap().rang_after = Some(0);
    // The lists are due (every 50 ms).
    h.clock.advance(60 * MS);
    h.gpu.state.lock().unwrap().listed.clear();
    h.lp.tick();
    assert_eq!(
        h.gpu.state.lock().unwrap().listed,
        Vec::<u32>::new(),
        "a ring did not put the lists off"
    );
    h.clock.advance(MS / 10);
    h.lp.tick();
    assert_eq!(
        h.gpu.state.lock().unwrap().listed,
        vec![0],
        "put off twice in a row"
    );
}
