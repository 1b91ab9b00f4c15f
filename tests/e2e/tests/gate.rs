//! The launch gate end to end, through the real dynamic linker: `coloc-sim offline --cuda`
//! (and `online --cuda` as an idle process; `coloc-capture` for CUDA graph capture)
//! `dlopen("libcuda.so.1")` (the fake driver) with `libcoloc_cuda.so` preloaded and
//! `COLOC_SHIM_CLASS=offline`. No agent: the test
//! plays it, with the agent's own `GateFile` on a gate file in a temporary directory, and
//! reads the processes' doorbell pages with `coloc-doorbell`, as the agent will.
//!
//! What a process submitted is read from the simulated GPU (its slot's `submitted_ns` and
//! `completed_ns`, live); the most kernels in flight on a stream from the fake driver's
//! counters, in the workload's summary. Every wait is bounded: a test fails, never hangs.

use coloc_agent::edges::gate::GateFile;
use coloc_doorbell::CLASS_OFFLINE;
use coloc_e2e::*;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const STEP_MS: u64 = 2;
const STEP_NS: u64 = STEP_MS * 1_000_000;

/// A simulated GPU, a doorbell directory, and a gate file with an agent's heartbeat.
struct Node {
    sim: Sim,
    root: PathBuf,
    bells: PathBuf,
    gate_path: PathBuf,
    gate: Option<Arc<GateFile>>,
    beating: Arc<AtomicBool>,
    beater: Option<std::thread::JoinHandle<()>>,
}

impl Node {
    /// With a gate file (and its heartbeat every 20 ms), or without one.
    fn new(with_gate: bool) -> Node {
        let sim = Sim::start(1, &[]);
        let root = std::env::temp_dir().join(unique("coloc-e2e-gate"));
        let bells = root.join("bells");
        std::fs::create_dir_all(&bells).unwrap();
        let mut n = Node {
            sim,
            gate_path: root.join("gate").join("gates"),
            root,
            bells,
            gate: None,
            beating: Arc::new(AtomicBool::new(false)),
            beater: None,
        };
        if with_gate {
            n.start_agent();
        }
        n
    }

    /// Creates (or replaces) the gate file and beats it every 20 ms, as an agent would.
    fn start_agent(&mut self) {
        self.stop_beating();
        let g = Arc::new(GateFile::create(&self.gate_path).unwrap());
        let beating = Arc::new(AtomicBool::new(true));
        let (gb, bb) = (g.clone(), beating.clone());
        self.beater = Some(std::thread::spawn(move || {
            while bb.load(Ordering::SeqCst) {
                gb.beat();
                std::thread::sleep(Duration::from_millis(20));
            }
        }));
        self.gate = Some(g);
        self.beating = beating;
    }

    /// Stops the heartbeat (an agent killed with -9); returns when the last beat was.
    fn stop_beating(&mut self) -> Option<u64> {
        self.beating.store(false, Ordering::SeqCst);
        if let Some(t) = self.beater.take() {
            t.join().unwrap();
        }
        self.gate
            .as_ref()
            .map(|g| g.gates().header().heartbeat_ns.load(Ordering::SeqCst))
    }

    fn gate(&self) -> &GateFile {
        self.gate.as_ref().expect("a gate file")
    }

    /// A workload under the shim, class offline, with `env` on top.
    fn workload(&self, args: &[&str], env: &[(&str, &str)]) -> Command {
        let mut c = self.sim.cmd(args);
        c.arg("--cuda")
            .env("LD_LIBRARY_PATH", fake_cuda())
            .env("LD_PRELOAD", bin("libcoloc_cuda.so"))
            .env("COLOC_SHIM_CLASS", "offline")
            .env("COLOC_DOORBELL_DIR", &self.bells)
            .env("COLOC_GATE_FILE", &self.gate_path)
            // K alone unless a test asks for the budget (it would bound 2 ms kernels to 1).
            .env("COLOC_SHIM_INFLIGHT_MS", "0");
        for (k, v) in env {
            c.env(k, v);
        }
        c
    }

    /// A test program that drives the (fake) driver itself, under the shim, class
    /// offline, with this node's gate and in-flight bound `k`.
    fn driver_user(&self, program: &std::path::Path, k: u32) -> Command {
        let mut c = Command::new(program);
        c.env("COLOC_SIM_STATE", &self.sim.state)
            .env("LD_LIBRARY_PATH", fake_cuda())
            .env("LD_PRELOAD", bin("libcoloc_cuda.so"))
            .env("COLOC_SHIM_CLASS", "offline")
            .env("COLOC_DOORBELL_DIR", &self.bells)
            .env("COLOC_GATE_FILE", &self.gate_path)
            .env("COLOC_SHIM_INFLIGHT", k.to_string())
            .env("COLOC_SHIM_INFLIGHT_MS", "0");
        c
    }

    /// `offline --cuda` with 2 ms kernels, the application keeping `depth` in flight, for
    /// `secs` seconds (0: until killed), stderr to a file.
    fn offline(&self, depth: u32, secs: f64, env: &[(&str, &str)], extra: &[&str]) -> Job {
        self.offline_step(STEP_MS as f64, depth, secs, env, extra)
    }

    /// The same with kernels of `step_ms`.
    fn offline_step(
        &self,
        step_ms: f64,
        depth: u32,
        secs: f64,
        env: &[(&str, &str)],
        extra: &[&str],
    ) -> Job {
        let out = self.root.join(unique("offline")).with_extension("json");
        let err = self.root.join(unique("offline")).with_extension("err");
        let (d, s, o) = (
            depth.to_string(),
            secs.to_string(),
            out.display().to_string(),
        );
        let step = step_ms.to_string();
        let mut args = vec![
            "offline",
            "--gpu",
            "0",
            "--step-ms",
            &step,
            "--queue-depth",
            &d,
            "--duration-s",
            &s,
            "--out",
            &o,
        ];
        args.extend_from_slice(extra);
        let p = Proc(
            self.workload(&args, env)
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&err).unwrap())
                .spawn()
                .unwrap(),
        );
        Job { p, out, err }
    }

    /// What `pid` has submitted and completed on GPU 0, ns of kernel time.
    fn progress(&self, pid: u32) -> (u64, u64) {
        self.sim
            .open()
            .slot_info(pid, 0)
            .map_or((0, 0), |s| (s.submitted_ns, s.completed_ns))
    }

    /// The page of `pid` (waits for it).
    fn page(&self, pid: u32) -> MappedPage {
        let mut found = None;
        wait_for(
            "the process's doorbell page",
            Duration::from_secs(10),
            || {
                found = std::fs::read_dir(&self.bells).ok().and_then(|d| {
                    d.flatten().map(|e| e.path()).find(|p| {
                        p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                            n.starts_with(&format!("{pid}-")) && n.ends_with(coloc_doorbell::SUFFIX)
                        })
                    })
                });
                found.is_some()
            },
        )
        .unwrap();
        MappedPage::open(&found.unwrap())
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.stop_beating();
        self.gate = None;
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

struct Job {
    p: Proc,
    out: PathBuf,
    err: PathBuf,
}

impl Job {
    fn pid(&self) -> u32 {
        self.p.pid()
    }
    /// Waits for the end and returns its summary.
    fn summary(mut self) -> serde_json::Value {
        let st = self
            .p
            .wait_within("offline workload", Duration::from_secs(30));
        assert!(st.success(), "{st}: {}", self.stderr());
        serde_json::from_slice(&std::fs::read(&self.out).unwrap()).unwrap()
    }
    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }
}

/// GPU 0's UUID, as the fake driver answers `cuDeviceGetUuid`.
fn gpu0() -> [u8; 16] {
    coloc_sim::gpu_uuid(0)
}

/// Waits (polling every 100 µs) for the page to acknowledge `epoch`; returns how long it
/// took and what the process had submitted and completed at that moment.
fn wait_ack(
    n: &Node,
    page: &MappedPage,
    pid: u32,
    epoch: u32,
    limit: Duration,
) -> (Duration, u64, u64) {
    let t0 = Instant::now();
    loop {
        if page.ack() == epoch {
            let (s, c) = n.progress(pid);
            return (t0.elapsed(), s, c);
        }
        assert!(
            t0.elapsed() < limit,
            "no acknowledgement of epoch {epoch} within {limit:?}: {:?}",
            page.gate()
        );
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// Waits for `pid` to have submitted at least `ns` more than `from`.
fn wait_progress(n: &Node, pid: u32, from: u64, ns: u64, limit: Duration) -> Duration {
    wait_for("submissions", limit, || n.progress(pid).0 >= from + ns).unwrap()
}

#[test]
fn a_closed_gate_lets_no_submission_through_and_opening_it_lets_them_through() {
    let n = Node::new(true);
    let job = n.offline(4, 0.0, &[], &[]);
    let pid = job.pid();
    let page = n.page(pid);
    assert_eq!(page.page().class(), CLASS_OFFLINE);
    wait_progress(&n, pid, 0, 20 * STEP_NS, Duration::from_secs(10));
    let epoch = n.gate().close(&gpu0()).unwrap();
    let (_, at_ack, _) = wait_ack(&n, &page, pid, epoch, Duration::from_secs(2));
    let counted = page.gate().unwrap().submitted;
    // Closed for 300 ms: not one more submission.
    holds_for(
        "no submission while closed",
        Duration::from_millis(300),
        || n.progress(pid).0 == at_ack,
    )
    .unwrap();
    let g = page.gate().unwrap();
    assert_eq!(g.inflight, 0, "nothing in flight once acknowledged: {g:?}");
    assert!(g.blocked_ns != 0, "a thread is blocked at the gate: {g:?}");
    // Opened: submissions resume at once.
    assert!(n.gate().open(&gpu0()));
    let resumed = wait_progress(&n, pid, at_ack, 10 * STEP_NS, Duration::from_secs(2));
    assert!(
        resumed < Duration::from_millis(500),
        "resumed after {resumed:?}"
    );
    wait_for("blocked_ns cleared", Duration::from_secs(2), || {
        page.gate().is_some_and(|g| g.blocked_ns == 0)
    })
    .unwrap();
    // Closed again: a new epoch, acknowledged again.
    let e2 = n.gate().close(&gpu0()).unwrap();
    assert_ne!(e2, epoch);
    let (_, again, _) = wait_ack(&n, &page, pid, e2, Duration::from_secs(2));
    holds_for(
        "no submission while closed again",
        Duration::from_millis(100),
        || n.progress(pid).0 == again,
    )
    .unwrap();
    assert_eq!(
        (page.gate().unwrap().submitted - counted) * STEP_NS,
        again - at_ack,
        "the page counts the submissions made through the gate"
    );
    assert!(job.stderr().is_empty(), "silent: {}", job.stderr());
}

#[test]
fn the_close_is_acknowledged_only_once_in_flight_work_is_complete() {
    let n = Node::new(true);
    // 5 ms kernels, the application keeps 8 in flight, the shim bounds them to 4.
    let job = n.offline_step(5.0, 8, 0.0, &[("COLOC_SHIM_INFLIGHT", "4")], &[]);
    let pid = job.pid();
    let page = n.page(pid);
    wait_progress(&n, pid, 0, 20 * 5_000_000, Duration::from_secs(10));
    for _ in 0..3 {
        let (s, c) = n.progress(pid);
        assert!(s > c, "work in flight before the close ({s} > {c})");
        let epoch = n.gate().close(&gpu0()).unwrap();
        let (took, s, c) = wait_ack(&n, &page, pid, epoch, Duration::from_secs(2));
        assert!(
            c >= s,
            "acknowledged after {took:?} with {} ms of kernels still queued",
            (s - c) / 1_000_000
        );
        // At most K kernels were in flight plus one being submitted: 25 ms, with slack.
        assert!(took < Duration::from_millis(500), "drain took {took:?}");
        assert!(n.gate().open(&gpu0()));
        wait_progress(&n, pid, s, 4 * 5_000_000, Duration::from_secs(2));
    }
    // 5 ms kernels, eight in flight, under K = 64 and no budget: after a drain the 32nd
    // submission records an event, and the 30 or so after it go without the ring's lock
    // (the room it leaves under K and in the next batch). Closed there (the 40th), the
    // drain must wait for those too, not only for the event.
    let quick = n.offline_step(5.0, 8, 0.0, &[("COLOC_SHIM_INFLIGHT_MS", "0")], &[]);
    let qpage = n.page(quick.pid());
    wait_progress(&n, quick.pid(), 0, 40 * 5_000_000, Duration::from_secs(10));
    for _ in 0..5 {
        let epoch = n.gate().close(&gpu0()).unwrap();
        let (took, s, c) = wait_ack(&n, &qpage, quick.pid(), epoch, Duration::from_secs(2));
        assert!(
            c >= s,
            "unlocked submissions: acknowledged after {took:?} with {} µs of kernels queued",
            (s - c) / 1_000
        );
        assert!(n.gate().open(&gpu0()));
        wait_progress(&n, quick.pid(), s, 40 * 5_000_000, Duration::from_secs(2));
    }
    drop(quick);
    // An idle process (five kernels, then nothing) acknowledges at once.
    let idle = n.offline(2, 0.0, &[], &["--idle-after-steps", "5"]);
    let ipage = n.page(idle.pid());
    wait_for("its kernels done", Duration::from_secs(10), || {
        let (s, c) = n.progress(idle.pid());
        s >= 5 * STEP_NS && c >= s
    })
    .unwrap();
    let epoch = n.gate().close(&gpu0()).unwrap();
    let (took, _, _) = wait_ack(&n, &ipage, idle.pid(), epoch, Duration::from_secs(2));
    assert!(
        took < Duration::from_millis(20),
        "idle acknowledged after {took:?}"
    );
    n.gate().open(&gpu0());
    drop((job, idle));
}

#[test]
fn a_stale_heartbeat_opens_the_gate_within_the_bound() {
    let mut n = Node::new(true);
    let job = n.offline(4, 0.0, &[("COLOC_GATE_STALE_MS", "300")], &[]);
    let pid = job.pid();
    let page = n.page(pid);
    wait_progress(&n, pid, 0, 10 * STEP_NS, Duration::from_secs(10));
    let epoch = n.gate().close(&gpu0()).unwrap();
    let (_, at_ack, _) = wait_ack(&n, &page, pid, epoch, Duration::from_secs(2));
    // Beating: closed stays closed past the bound.
    holds_for(
        "closed while the agent beats",
        Duration::from_millis(500),
        || n.progress(pid).0 == at_ack,
    )
    .unwrap();
    // The agent stops beating (killed with -9): the gate opens once the heartbeat is
    // older than 300 ms, at the next 50 ms re-check.
    let last = n.stop_beating().unwrap();
    let mut opened_ns = 0;
    wait_for("the gate to fail open", Duration::from_secs(3), || {
        let moved = n.progress(pid).0 > at_ack;
        if moved {
            opened_ns = coloc_doorbell::now_ns();
        }
        moved
    })
    .unwrap();
    let after = (opened_ns - last) as f64 / 1e6;
    assert!(
        (300.0..=300.0 + 50.0 + 150.0).contains(&after),
        "opened {after:.1} ms after the last beat (bound 300 ms + 50 ms re-check)"
    );
    assert!(n.gate().is_closed(&gpu0()), "the file still says closed");
    wait_progress(&n, pid, at_ack, 20 * STEP_NS, Duration::from_secs(2));
    let err = job.stderr();
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("libcoloc_cuda:"))
        .collect();
    assert_eq!(lines.len(), 1, "one line says so: {err}");
    assert!(lines[0].contains("stale"), "{err}");
}

#[test]
fn the_inflight_bound_caps_work_in_flight_per_stream() {
    let n = Node::new(true);
    let ran: Vec<(&str, Vec<&str>)> = vec![
        ("created stream", vec![]),
        ("legacy default stream", vec!["--default-stream"]),
        (
            "per-thread default stream",
            vec!["--default-stream", "--per-thread-stream"],
        ),
    ];
    for (what, extra) in ran {
        let v = n
            .offline(8, 1.0, &[("COLOC_SHIM_INFLIGHT", "2")], &extra)
            .summary();
        assert!(v["launches"].as_u64().unwrap() > 100, "{what}: {v}");
        assert!(
            v["max_outstanding_stream"].as_u64().unwrap() <= 2,
            "{what}: K = 2 but more in flight: {v}"
        );
    }
    // Short kernels under K = 8 (no budget): most submissions go without the ring's lock
    // (those the last locked one left room for), and the bound holds for them too.
    keeps_k8_with_short_kernels(&n, "unlocked submissions", &[]);
    // Unbounded (0): the application's own depth, 8, is reached: the counter is real.
    let v = n
        .offline(8, 1.0, &[("COLOC_SHIM_INFLIGHT", "0")], &[])
        .summary();
    assert!(v["max_outstanding_stream"].as_u64().unwrap() >= 7, "{v}");
}

/// Four threads on one stream, most of their submissions unlocked (1 ms kernels, K = 64,
/// eight queued per thread): each close is acknowledged only once every kernel submitted
/// is complete, with nothing in flight or inside a submission on the page, and the page's
/// count of submissions is every kernel the simulated GPU received.
#[test]
fn a_close_waits_for_every_thread_sharing_a_stream() {
    let n = Node::new(true);
    let job = n.offline_step(
        1.0,
        8,
        0.0,
        &[
            ("COLOC_SHIM_INFLIGHT", "64"),
            ("COLOC_SHIM_INFLIGHT_MS", "0"),
        ],
        &["--threads", "4"],
    );
    let pid = job.pid();
    let page = n.page(pid);
    wait_progress(&n, pid, 0, 100 * 1_000_000, Duration::from_secs(10));
    for i in 0..8u64 {
        // Closed at a different point of the batch each time.
        std::thread::sleep(Duration::from_micros(700 * i));
        let epoch = n.gate().close(&gpu0()).unwrap();
        let (took, s, c) = wait_ack(&n, &page, pid, epoch, Duration::from_secs(2));
        assert!(
            c >= s,
            "acknowledged after {took:?} with {} µs of kernels queued",
            (s - c) / 1_000
        );
        let g = page.gate().unwrap();
        assert_eq!(
            (g.inflight, g.in_submit),
            (0, 0),
            "at the acknowledgement: {g:?}"
        );
        assert_eq!(
            g.submitted * 1_000_000,
            s,
            "the page's count against the kernels the GPU received: {g:?}"
        );
        assert!(n.gate().open(&gpu0()));
        wait_progress(&n, pid, s, 40 * 1_000_000, Duration::from_secs(2));
    }
    drop(job);
}

/// The page's count of submissions stays true for a process gone idle: ten kernels under
/// K = 64 (all but the first go without the ring's lock, counted only when the ring is
/// settled), then nothing submitted: the page says ten within a few of the watcher's
/// periods (100 ms), with no close to settle them.
#[test]
fn the_page_counts_the_unlocked_submissions_of_a_process_gone_idle() {
    let n = Node::new(true);
    let idle = n.offline(
        2,
        0.0,
        &[("COLOC_SHIM_INFLIGHT", "64")],
        &["--idle-after-steps", "10"],
    );
    let pid = idle.pid();
    let page = n.page(pid);
    wait_progress(&n, pid, 0, 10 * STEP_NS, Duration::from_secs(5));
    let counted = wait_for(
        "the page's count of submissions",
        Duration::from_secs(1),
        || page.gate().is_some_and(|g| g.submitted == 10),
    );
    assert!(
        counted.is_ok(),
        "ten kernels submitted, the page says {:?}; stderr: {}",
        page.gate(),
        idle.stderr()
    );
}

/// Several threads submitting to one stream share its bound: short kernels (most of them
/// going without the ring's lock) from four threads, each keeping 16 of its own queued,
/// on a created stream and on the legacy default stream, never put more than K = 8 in
/// flight there.
#[test]
fn threads_sharing_a_stream_keep_its_inflight_bound() {
    let n = Node::new(true);
    for (what, extra) in [
        ("created stream", vec!["--threads", "4"]),
        (
            "legacy default stream",
            vec!["--threads", "4", "--default-stream"],
        ),
    ] {
        keeps_k8_with_short_kernels(&n, what, &extra);
    }
}

/// Short kernels (0.05 ms) under K = 8 and no budget, the application keeping 16 queued
/// (per thread), for a second: at most 8 in flight on the stream, and at least 6 (K is
/// used).
fn keeps_k8_with_short_kernels(n: &Node, what: &str, extra: &[&str]) {
    let v = n
        .offline_step(
            0.05,
            16,
            1.0,
            &[
                ("COLOC_SHIM_INFLIGHT", "8"),
                ("COLOC_SHIM_INFLIGHT_MS", "0"),
            ],
            extra,
        )
        .summary();
    assert!(v["launches"].as_u64().unwrap() > 1000, "{what}: {v}");
    assert!(
        v["max_outstanding_stream"].as_u64().unwrap() <= 8,
        "{what}: K = 8 but more in flight: {v}"
    );
    assert!(
        v["max_outstanding_stream"].as_u64().unwrap() >= 6,
        "{what}: K = 8 is used (the application keeps 16): {v}"
    );
}

/// The budget bounds work in flight by its estimated time: kernels of 2 ms under a 3 ms
/// budget run one at a time, 0.5 ms ones about four at a time under 2 ms (each sample
/// includes a wake-up, and the simulator's completions move by up to its tick: 2 to 8),
/// whatever K allows (here unbounded) and the application queues (16); with K = 2 the
/// budget never allows more than K.
#[test]
fn the_budget_caps_work_in_flight_by_time() {
    let n = Node::new(true);
    let budget = |ms| [("COLOC_SHIM_INFLIGHT", "0"), ("COLOC_SHIM_INFLIGHT_MS", ms)];
    let v = n.offline(16, 1.0, &budget("3"), &[]).summary();
    let launches = v["launches"].as_u64().unwrap();
    assert!(launches > 100, "{v}");
    assert!(
        v["max_outstanding_stream"].as_u64().unwrap() <= 2,
        "2 ms kernels, 3 ms budget: {v}"
    );
    // What the budget leaves over (1 ms, capped at 0.5) is a lead: the next kernel goes
    // in when the one in flight has about that much left, so the GPU waits for the host
    // less often than with one kernel in flight and no lead (K = 1, no budget: nearly
    // every submission finds the stream idle; with the lead, under 10 % on a quiet
    // machine, under half beside two CPU hogs on 2 cores).
    let idle = v["idle_stream_submissions"].as_u64().unwrap();
    let k1 = n
        .offline(
            16,
            1.0,
            &[
                ("COLOC_SHIM_INFLIGHT", "1"),
                ("COLOC_SHIM_INFLIGHT_MS", "0"),
            ],
            &[],
        )
        .summary();
    let (k1_idle, k1_launches) = (
        k1["idle_stream_submissions"].as_u64().unwrap(),
        k1["launches"].as_u64().unwrap(),
    );
    assert!(
        k1_idle * 10 > k1_launches * 9,
        "K = 1 without a lead waits for the host at every submission: {k1}"
    );
    assert!(
        (idle as f64 / launches as f64) < 0.75 * (k1_idle as f64 / k1_launches as f64),
        "2 ms kernels, 3 ms budget: the GPU waited for {idle} of {launches} submissions \
         (K = 1: {k1_idle} of {k1_launches}): {v}"
    );
    let v = n.offline_step(0.5, 16, 1.0, &budget("2"), &[]).summary();
    let most = v["max_outstanding_stream"].as_u64().unwrap();
    assert!(
        (2..=8).contains(&most),
        "0.5 ms kernels, 2 ms budget: about 4 in flight, not 1 nor 16: {v}"
    );
    let v = n
        .offline_step(
            0.2,
            16,
            1.0,
            &[
                ("COLOC_SHIM_INFLIGHT", "2"),
                ("COLOC_SHIM_INFLIGHT_MS", "3"),
            ],
            &[],
        )
        .summary();
    assert_eq!(v["max_outstanding_stream"], 2, "K = 2 caps the budget: {v}");
    // No budget: K alone (unbounded), the application's depth is reached.
    let v = n.offline(16, 1.0, &budget("0"), &[]).summary();
    assert!(v["max_outstanding_stream"].as_u64().unwrap() >= 15, "{v}");
}

#[test]
fn with_no_gate_file_the_offline_shim_passes_everything_through() {
    let n = Node::new(false);
    let job = n.offline(8, 1.0, &[], &[]);
    let pid = job.pid();
    let page = n.page(pid);
    assert_eq!(page.page().class(), CLASS_OFFLINE);
    let err_path = job.err.clone();
    let v = job.summary();
    // Not bounded (the default K would cap it at 4), nothing blocked, nothing said.
    assert!(v["max_outstanding_stream"].as_u64().unwrap() >= 7, "{v}");
    assert!(v["launches"].as_u64().unwrap() > 200, "{v}");
    assert_eq!(std::fs::read_to_string(err_path).unwrap(), "");
    // The page is removed at exit.
    wait_for("the page removed", Duration::from_secs(5), || {
        std::fs::read_dir(&n.bells).unwrap().next().is_none()
    })
    .unwrap();
}

#[test]
fn a_gate_file_that_appears_later_or_is_replaced_is_picked_up() {
    let mut n = Node::new(false);
    let job = n.offline(4, 0.0, &[("COLOC_GATE_STALE_MS", "300")], &[]);
    let pid = job.pid();
    let page = n.page(pid);
    wait_progress(&n, pid, 0, 10 * STEP_NS, Duration::from_secs(10));
    // The agent starts after the process: within about a second the gate is in force.
    n.start_agent();
    let epoch = n.gate().close(&gpu0()).unwrap();
    let (took, at_ack, _) = wait_ack(&n, &page, pid, epoch, Duration::from_secs(3));
    assert!(
        took < Duration::from_millis(1_500),
        "picked up after {took:?}"
    );
    holds_for("closed", Duration::from_millis(100), || {
        n.progress(pid).0 == at_ack
    })
    .unwrap();
    // The agent restarts (killed, then a new file replaces the old): the old one goes
    // stale, the process fails open, then finds the new file and obeys it.
    n.stop_beating();
    n.start_agent();
    assert!(!n.gate().is_closed(&gpu0()), "a new file starts open");
    wait_progress(&n, pid, at_ack, 5 * STEP_NS, Duration::from_secs(3));
    let epoch2 = n.gate().close(&gpu0()).unwrap();
    assert_ne!(epoch2, epoch);
    let (took, at_ack2, _) = wait_ack(&n, &page, pid, epoch2, Duration::from_secs(3));
    assert!(
        took < Duration::from_millis(2_500),
        "new file picked up after {took:?}"
    );
    holds_for("closed by the new file", Duration::from_millis(100), || {
        n.progress(pid).0 == at_ack2
    })
    .unwrap();
}

/// CUDA graph stream capture (research G6): a thread captures a stream in mode GLOBAL
/// (PyTorch's default) while another thread keeps submitting with the in-flight bound at 1
/// (so the shim waits for its own events during the capture) and while the gate closes
/// (so the watcher waits for them too). The capture must survive: the shim makes its own
/// event waits in mode RELAXED, and leaves submissions to the capturing stream alone (not
/// held at the closed gate, not counted); the graph's launch is then gated like any
/// submission. The fake driver enforces the real driver's rule (900, then 901).
#[test]
fn a_stream_capture_survives_the_gate_and_its_graph_launch_is_gated() {
    use std::io::{BufRead, Write};
    let n = Node::new(true);
    let err = n.root.join("capture.err");
    let mut c = n.driver_user(&bin("coloc-capture"), 1);
    c.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&err).unwrap());
    let mut p = Proc(c.spawn().unwrap());
    let pid = p.pid();
    let mut stdin = p.0.stdin.take().unwrap();
    let stdout = p.0.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for l in std::io::BufReader::new(stdout).lines() {
            let Ok(l) = l else { break };
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let stderr = || std::fs::read_to_string(&err).unwrap_or_default();
    let next = |what: &str, limit: Duration| -> String {
        rx.recv_timeout(limit)
            .unwrap_or_else(|e| panic!("no {what:?} line within {limit:?} ({e}): {}", stderr()))
    };
    let mut send = |s: &str| writeln!(stdin, "{s}").and_then(|_| stdin.flush()).unwrap();
    let page = n.page(pid);

    assert_eq!(next("capturing", Duration::from_secs(10)), "capturing");
    // The gate closes during the capture: the watcher waits for the other stream's events.
    let epoch = n.gate().close(&gpu0()).unwrap();
    wait_ack(&n, &page, pid, epoch, Duration::from_secs(2));
    // Submissions to the capturing stream are not held at the closed gate.
    send("go");
    let more = next("more", Duration::from_secs(5));
    let ms: f64 = more.strip_prefix("more ").unwrap().parse().unwrap();
    assert!(ms < 100.0, "captured launches waited at the gate: {more}");
    assert!(n.gate().open(&gpu0()));
    std::thread::sleep(Duration::from_millis(50));
    send("end");
    let line = next("captured", Duration::from_secs(5));
    let v: serde_json::Value =
        serde_json::from_str(line.strip_prefix("captured ").unwrap()).unwrap();
    assert_eq!(v["begin"], 0, "{v}");
    assert!(v["codes"].as_array().unwrap().iter().all(|c| c == 0), "{v}");
    assert_eq!(v["end"], 0, "the capture was invalidated: {v}");
    assert_eq!(v["instantiate"], 0, "{v}");
    assert_eq!(v["other_failed"], 0, "{v}");
    let other = v["other_launches"].as_u64().unwrap();
    assert!(
        other >= v["other_at_begin"].as_u64().unwrap() + 5,
        "the other thread kept submitting during the capture: {v}"
    );
    // Only the other thread's submissions went through the gate.
    let g = page.gate().unwrap();
    assert_eq!(
        g.submitted, other,
        "captured launches not counted: {g:?} {v}"
    );
    assert!(g.inflight <= 1, "K = 1: {g:?}");

    // The graph's launch waits at a closed gate like any submission.
    let e2 = n.gate().close(&gpu0()).unwrap();
    wait_ack(&n, &page, pid, e2, Duration::from_secs(2));
    let before = n.progress(pid).0;
    send("launch");
    holds_for(
        "the graph launch held at the closed gate",
        Duration::from_millis(300),
        || n.progress(pid).0 == before && page.gate().unwrap().submitted == other,
    )
    .unwrap();
    assert!(
        rx.try_recv().is_err(),
        "the graph launch returned while closed"
    );
    assert!(n.gate().open(&gpu0()));
    let line = next("launched", Duration::from_secs(5));
    let l: serde_json::Value =
        serde_json::from_str(line.strip_prefix("launched ").unwrap()).unwrap();
    assert_eq!(l, serde_json::json!({"launch": 0, "sync": 0}));
    let graph_ns = v["graph_ns"].as_u64().unwrap();
    assert_eq!(
        n.progress(pid).0,
        before + graph_ns,
        "one graph of 8 kernels ran"
    );
    assert_eq!(page.gate().unwrap().submitted, other + 1);
    send("exit");
    let st = p.wait_within("capture workload", Duration::from_secs(10));
    assert!(st.success(), "{st}: {}", stderr());
    assert!(stderr().is_empty(), "silent: {}", stderr());
}

/// Batched copies (`cuMemcpyBatchAsync`) are gated submissions in both ABIs (and a forked
/// child's exit leaves the parent's page in place): asked for at
/// CUDA 12.8 the stream follows `failIdx`, at 13.0 (`_v2`) there is no `failIdx`. The shim
/// must take the stream from the right argument: with the wrong one it would record its
/// event on a pointer that is not a stream, fail, and pass everything through from then
/// on (one stderr line, nothing counted).
#[test]
fn batched_copies_are_gated_in_both_abis() {
    let n = Node::new(true);
    let err = n.root.join("batch.err");
    let mut c = n.driver_user(&bin("coloc-batch"), 1);
    c.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&err).unwrap());
    let mut p = Proc(c.spawn().unwrap());
    let pid = p.pid();
    let stdin = p.0.stdin.take().unwrap();
    let mut out = std::io::BufReader::new(p.0.stdout.take().unwrap());
    let mut line = String::new();
    use std::io::BufRead;
    out.read_line(&mut line).unwrap();
    let stderr = std::fs::read_to_string(&err).unwrap_or_default();
    let v: serde_json::Value =
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}; stderr: {stderr}"));
    let all_ok = |k: &str| v[k].as_array().unwrap().iter().all(|c| c == 0);
    assert!(all_ok("v1") && all_ok("v2"), "{v}");
    assert_eq!(v["sync"], 0, "{v}");
    assert_eq!(v["fail_idx"], -1, "the 12.8 ABI's failIdx was written: {v}");
    // The forked child's exit left the page alone.
    let ours = std::fs::read_dir(&n.bells).unwrap().flatten().any(|e| {
        let name = e.file_name().to_string_lossy().to_string();
        name.starts_with(&format!("{pid}-")) && name.ends_with(coloc_doorbell::SUFFIX)
    });
    assert!(ours, "the page was removed by a forked child's exit");
    let page = n.page(pid);
    let g = page.gate().expect("the process's GPU entry");
    assert_eq!(
        g.submitted, 40,
        "every batched copy counted as a gated submission; stderr: {stderr}"
    );
    assert!(g.inflight <= 1, "K = 1 held: {g:?}");
    drop(stdin);
    assert!(p
        .wait_within("coloc-batch", Duration::from_secs(10))
        .success());
    assert_eq!(
        std::fs::read_to_string(&err).unwrap(),
        "",
        "the shim passed through (an internal failure)"
    );
}

/// With the gate open, the gate makes no driver call per launch in the steady state:
/// completions are tracked one event per batch, the context is cached, and the stream is
/// asked whether it captures only while some capture is in progress. The shim's calls are
/// the fake driver's count with the gate against the same program without a gate file
/// (pass-through), per launch: tiny kernels (1 µs: the bound is K = 64, a batch 32
/// submissions) make at most one call per 8 launches (per batch an event record, a query
/// of the event that brings the stream under the bound and, while the application keeps
/// more queued than K, a wait for it), on a created stream and on the legacy default
/// stream (whose context the shim must know).
#[test]
fn with_the_gate_open_the_steady_state_makes_no_driver_call_per_launch() {
    let n = Node::new(true);
    // The slot exists and is open (a close and an open, as the agent does).
    n.gate().close(&gpu0()).unwrap();
    assert!(n.gate().open(&gpu0()));
    let per_launch = |v: &serde_json::Value| {
        v["driver_calls"].as_u64().unwrap() as f64 / v["launches"].as_u64().unwrap() as f64
    };
    for (what, extra) in [
        ("created stream", vec![]),
        ("legacy default stream", vec!["--default-stream"]),
    ] {
        let gated = n.offline_step(0.001, 64, 1.0, &[], &extra).summary();
        assert!(
            gated["launches"].as_u64().unwrap() > 2_000,
            "{what}: {gated}"
        );
        let bare = Node::new(false)
            .offline_step(0.001, 64, 1.0, &[], &extra)
            .summary();
        let shim = per_launch(&gated) - per_launch(&bare);
        assert!(
            shim <= 1.0 / 8.0,
            "{what}: the gate made {shim:.3} driver calls per launch (gated {gated}, \
             pass-through {bare})"
        );
    }
}
