//! The agent's gate actuator end to end (`coloc-agent run --gate`), through the real
//! dynamic linker: offline `coloc-sim offline --cuda` under `libcoloc_cuda.so`
//! (`COLOC_SHIM_CLASS=offline`) is held at its gate — never stopped — while an online
//! workload under the shim is busy; an offline process without the shim is stopped with
//! signals as before; `kill -9` of the agent opens the gate within the shim's bound, and
//! the restarted agent finds nothing blocked. Every wait is bounded.

use coloc_e2e::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const RULES: &str = "[[rule]]\nname = \"off\"\nclass = \"reclaimed_cores\"\ncmdline = \"*coloc-sim offline*\"\n\
                     [[rule]]\nname = \"svc\"\nclass = \"shared_cores\"\ncmdline = \"*coloc-sim online*\"\n";

struct Node {
    sim: Sim,
    root: PathBuf,
    gate_file: PathBuf,
    events: PathBuf,
}

impl Node {
    fn new() -> Node {
        let root = std::env::temp_dir().join(unique("coloc-e2e-gate-agent"));
        std::fs::create_dir_all(&root).unwrap();
        Node {
            sim: Sim::start(1, &["--sample-period-ms", "100"]),
            gate_file: root.join("gate").join("gates"),
            events: root.join("events.jsonl"),
            root,
        }
    }

    fn agent(&self, state_dir: Option<PathBuf>) -> Agent {
        Agent::start(
            &self.sim,
            AgentOpts {
                rules: RULES,
                extra: vec![
                    "--gate".into(),
                    "--gate-file".into(),
                    self.gate_file.display().to_string(),
                    "--event-log".into(),
                    self.events.display().to_string(),
                ],
                env: vec![
                    ("COLOC_NVML_INTERVAL", "100ms".into()),
                    ("COLOC_NVML_SAMPLE_PERIOD", "100ms".into()),
                ],
                state_dir,
                ..Default::default()
            },
        )
    }

    /// A workload on the fake driver; under the shim with `class` unless `None`.
    fn workload(&self, a: &Agent, args: &[&str], class: Option<&str>, stale_ms: u64) -> Command {
        let mut c = self.sim.cmd(args);
        c.arg("--cuda").env("LD_LIBRARY_PATH", fake_cuda());
        if let Some(class) = class {
            c.env("LD_PRELOAD", bin("libcoloc_cuda.so"))
                .env("COLOC_SHIM_CLASS", class)
                .env("COLOC_DOORBELL_DIR", &a.doorbell_dir)
                .env("COLOC_GATE_FILE", &self.gate_file)
                .env("COLOC_GATE_STALE_MS", stale_ms.to_string());
        }
        c
    }

    /// Offline, 2 ms kernels, 16 queued by the application, until killed; with the shim,
    /// started the way a plain host does it: `coloc-agent exec --class offline -- …`.
    fn offline(&self, a: &Agent, shim: bool, err: &Path) -> Proc {
        let args = [
            "offline",
            "--gpu",
            "0",
            "--step-ms",
            "2",
            "--queue-depth",
            "16",
        ];
        let mut c = self.workload(a, &args, None, 300);
        if shim {
            let mut e = Command::new(bin("coloc-agent"));
            e.arg("exec")
                .args(["--class", "offline", "--shim"])
                .arg(bin("libcoloc_cuda.so"))
                .arg("--doorbell-dir")
                .arg(&a.doorbell_dir)
                .arg("--gate-file")
                .arg(&self.gate_file)
                .arg("--")
                .arg(c.get_program())
                .args(c.get_args())
                .env("COLOC_SIM_STATE", &self.sim.state)
                .env("LD_LIBRARY_PATH", fake_cuda())
                .env("COLOC_GATE_STALE_MS", "300");
            c = e;
        }
        Proc(
            c.stdout(Stdio::null())
                .stderr(std::fs::File::create(err).unwrap())
                .spawn()
                .unwrap(),
        )
    }

    /// Online under the shim: `rate` requests/s of `work_ms`, for `secs`.
    fn online(&self, a: &Agent, rate: u32, work_ms: u32, secs: u32) -> Proc {
        let out = self.root.join(unique("online")).with_extension("json");
        let (r, w, s, o) = (
            rate.to_string(),
            work_ms.to_string(),
            secs.to_string(),
            out.display().to_string(),
        );
        let args = [
            "online",
            "--gpu",
            "0",
            "--rate",
            &r,
            "--work-ms",
            &w,
            "--duration-s",
            &s,
            "--seed",
            "3",
            "--out",
            &o,
        ];
        Proc(
            self.workload(a, &args, Some("online"), 1000)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        )
    }

    /// Kernel time `pid` has submitted on GPU 0, ns.
    fn submitted(&self, pid: u32) -> u64 {
        self.sim
            .open()
            .slot_info(pid, 0)
            .map_or(0, |s| s.submitted_ns)
    }

    fn preempts(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(&self.events)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["event"] == "preempt")
            .collect()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// The gate accelerates, it never decides: the process with the shim drains at its gate
/// (acknowledged in time: no escalation) and is then stopped by its fallback, like the
/// one without the shim, which is stopped at once.
#[test]
fn offline_with_the_shim_drains_at_its_gate_then_is_stopped_as_without_it() {
    let n = Node::new();
    let a = n.agent(None);
    let gated = n.offline(&a, true, &n.root.join("gated.err"));
    let plain = n.offline(&a, false, &n.root.join("plain.err"));
    a.wait_processes(2);
    let mut on = n.online(&a, 4, 20, 3);
    let (mut gated_stopped, mut plain_stopped) = (0, 0);
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(20) {
        if on.0.try_wait().unwrap().is_some() {
            break;
        }
        gated_stopped += (proc_state(gated.pid()) == Some('T')) as u32;
        plain_stopped += (proc_state(plain.pid()) == Some('T')) as u32;
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(on.wait_within("online", Duration::from_secs(5)).success());
    let ev = n.preempts();
    let bell: Vec<_> = ev.iter().filter(|e| e["signal"] == "doorbell").collect();
    assert!(bell.len() >= 3, "{ev:?}\nlog:\n{}", a.log_text());
    for e in &bell {
        assert!(e["confirmed_ns"].as_u64().is_some(), "not confirmed: {e}");
    }
    assert!(
        gated_stopped > 0,
        "the process with the shim was never stopped after its drain (the gate alone held it)"
    );
    assert!(
        plain_stopped > 0,
        "the process without the shim was never stopped"
    );
    assert!(
        bell.iter().any(|e| e["actuator"] == "gate"),
        "no preemption was drained by the gate: {bell:?}"
    );
    let m = a.metrics();
    assert_eq!(
        metric(&m, "coloc_gate_escalations_total", &[]),
        0.0,
        "a gate was not acknowledged in time:\n{}",
        a.log_text()
    );
    assert!(
        metric(
            &m,
            "coloc_preemption_latency_seconds_count",
            &["actuator=\"gate\""]
        ) >= 1.0
            || metric(
                &m,
                "coloc_preemption_latency_seconds_count",
                &["actuator=\"signal\""]
            ) >= 1.0,
        "{m}"
    );
    // Online is over: the gate opens and the process with the shim runs on.
    let from = n.submitted(gated.pid());
    wait_for("gated offline to run again", Duration::from_secs(3), || {
        n.submitted(gated.pid()) > from + 20_000_000
    })
    .unwrap();
    wait_for("nothing suspended", Duration::from_secs(2), || {
        a.state()["suspended_targets"] == 0
    })
    .unwrap();
}

/// kill -9 of the agent while a gated process is held: the hold (its fallback, recorded)
/// outlives the agent, as any hold does, and the restarted agent resumes what the record
/// holds, opens the old gate, holds the process again while online is busy, and lets it
/// run once online is gone; nothing stays blocked on the old gate file.
#[test]
fn kill_9_of_the_agent_leaves_the_hold_to_the_record_and_a_restart_blocks_nothing() {
    let n = Node::new();
    let mut a = n.agent(None);
    let err = n.root.join("gated.err");
    let gated = n.offline(&a, true, &err);
    a.wait_processes(1);
    // Online launches 2 ms of work 200 times a second: busy, gaps far under the window.
    let _on = n.online(&a, 200, 2, 30);
    // Held: what it submitted stops moving for 300 ms.
    let mut last = n.submitted(gated.pid());
    let mut still_since = Instant::now();
    wait_for(
        "the gated process to be held",
        Duration::from_secs(10),
        || {
            let now = n.submitted(gated.pid());
            if now != last {
                last = now;
                still_since = Instant::now();
            }
            still_since.elapsed() >= Duration::from_millis(300)
        },
    )
    .unwrap_or_else(|e| panic!("{e}\nlog:\n{}", a.log_text()));
    wait_for("drained, then stopped", Duration::from_secs(2), || {
        proc_state(gated.pid()) == Some('T')
    })
    .unwrap_or_else(|e| panic!("{e}: the gate alone held it\nlog:\n{}", a.log_text()));
    let state_dir = a.state_dir.clone();
    a.signal(libc::SIGKILL);
    let _ = a.wait();
    // The stop outlives the agent (it is in the record), whatever the gate file's
    // heartbeat does.
    holds_for(
        "stopped while no agent runs",
        Duration::from_millis(500),
        || proc_state(gated.pid()) == Some('T'),
    )
    .unwrap();
    // The restarted agent: the record's gate is handled, and the process is held again
    // (online is still busy), by the new file's gate, not left blocked on the old one.
    let b = n.agent(Some(state_dir));
    let text = b.log_text();
    assert!(
        text.contains("previous run left"),
        "the leftover gate was not reported:\n{text}"
    );
    drop(_on);
    let from = n.submitted(gated.pid());
    wait_for(
        "offline to run once online is gone",
        Duration::from_secs(5),
        || n.submitted(gated.pid()) > from + 20_000_000,
    )
    .unwrap_or_else(|e| panic!("{e}\nlog:\n{}", b.log_text()));
}

/// A tenant's offline process runs without the shim, and a helper of the tenant writes an
/// offline page in that process's name and acknowledges every close of its GPU's gate at
/// once (the review's attack: 4,910 of 4,910 samples running while online was busy). The
/// agent takes the page at its word, closes the gate and sees it acknowledged: then the
/// fallback stops the process all the same. Lying earns what ignoring the gate earns.
#[test]
fn a_forged_gate_acknowledgement_earns_nothing() {
    use coloc_doorbell::{gate::Gates, Page, CLASS_OFFLINE, PAGE};
    use std::os::fd::AsRawFd;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
    let n = Node::new();
    let a = n.agent(None);
    let victim = n.offline(&a, false, &n.root.join("victim.err"));
    a.wait_processes(1);
    let uuid_s = a.state()["gpus"][0]["uuid"].as_str().unwrap().to_string();
    let hex: String = uuid_s.trim_start_matches("GPU-").replace('-', "");
    let uuid: [u8; 16] =
        std::array::from_fn(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap());
    // The helper's page, named for the victim (the agent attributes it to that process).
    let page_path = a
        .doorbell_dir
        .join(format!("{}-f0f0f0f0.bell", victim.pid()));
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&page_path)
        .unwrap();
    f.set_len(PAGE as u64).unwrap();
    // SAFETY: a fresh shared read-write mapping of a page-long file, unmapped below.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(base, libc::MAP_FAILED);
    // SAFETY: the mapping above, alive until the munmap at the end.
    let page = unsafe { Page::from_raw(base as *mut u8) };
    page.init_class(victim.pid(), CLASS_OFFLINE, 0, coloc_sim::now_ns());
    let entry = page.entry_for(&uuid).unwrap();
    let (stop, acks) = (AtomicBool::new(false), AtomicU64::new(0));
    let (mut yes, mut samples) = (0u32, 0u32);
    /// Stops the helper however the sampling ends (a failed wait must not hang the test).
    struct StopOnDrop<'a>(&'a AtomicBool);
    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Relaxed);
        }
    }
    std::thread::scope(|s| {
        let _stop = StopOnDrop(&stop);
        // The helper: every close acknowledged within about 0.2 ms, nothing in flight.
        s.spawn(|| {
            let mut gates = None;
            while !stop.load(Relaxed) {
                if gates.is_none() {
                    gates = std::fs::File::open(&n.gate_file).ok().map(|g| {
                        // SAFETY: a shared read-only mapping of the agent's gate file
                        // (one page), never unmapped while the test runs.
                        let p = unsafe {
                            libc::mmap(
                                std::ptr::null_mut(),
                                PAGE,
                                libc::PROT_READ,
                                libc::MAP_SHARED,
                                g.as_raw_fd(),
                                0,
                            )
                        };
                        assert_ne!(p, libc::MAP_FAILED);
                        // SAFETY: the mapping just made.
                        unsafe { Gates::from_raw(p as *const u8) }
                    });
                }
                if let Some(epoch) = gates
                    .and_then(|g| g.find(&uuid))
                    .and_then(|s| s.closed_epoch())
                {
                    if entry.gate_ack.swap(epoch, AcqRel) != epoch {
                        acks.fetch_add(1, Relaxed);
                        page.bump_and_wake();
                    }
                }
                std::thread::sleep(Duration::from_micros(200));
            }
        });
        // Online busy for 2.5 s (seen through NVML: no shim), sampled from 0.5 s in.
        let _online = n.sim.spawn(&["busy", "--gpu", "0", "--ms", "2500"]);
        wait_for("the victim stopped", Duration::from_secs(2), || {
            victim.state() == Some('T')
        })
        .unwrap_or_else(|e| panic!("{e}\n{}", a.log_text()));
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(1500) {
            samples += 1;
            yes += u32::from(victim.state() == Some('T'));
            std::thread::sleep(Duration::from_millis(1));
        }
    });
    // SAFETY: the page's mapping, no longer used.
    unsafe { libc::munmap(base, PAGE) };
    assert!(
        acks.load(Relaxed) >= 1,
        "the agent never closed the gate for the forged page: the attack was not tried\n{}",
        a.log_text()
    );
    assert!(
        yes * 100 >= samples * 99,
        "the victim was stopped in only {yes} of {samples} samples while online was busy\n{}",
        a.log_text()
    );
    let _ = std::fs::remove_file(&page_path);
}

/// The tenant's environment is the tenant's: an offline process whose `COLOC_GATE_FILE`
/// points at a file of its own (the real shim, through the dynamic linker) never
/// acknowledges the agent's close. The first busy period waits `--gate-timeout` for it;
/// from then on the agent knows its gate is silent, says so (`/state`'s `gate`,
/// `coloc_gate_silent_processes`) and stops it at once, without waiting again.
#[test]
fn a_gate_file_pointed_elsewhere_is_found_silent_counted_and_not_waited_for_again() {
    let n = Node::new();
    let a = n.agent(None);
    // The tenant's own gate file, kept fresh the way an agent keeps its own: the shim
    // takes it for a live gate, makes its entries, and follows it alone.
    let elsewhere = n.root.join("mine").join("gates");
    let own = std::sync::Arc::new(coloc_agent::edges::gate::GateFile::create(&elsewhere).unwrap());
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let beater = {
        let (own, stop) = (own.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                own.beat();
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    struct Stop(
        std::sync::Arc<std::sync::atomic::AtomicBool>,
        Option<std::thread::JoinHandle<()>>,
    );
    impl Drop for Stop {
        fn drop(&mut self) {
            self.0.store(true, std::sync::atomic::Ordering::Relaxed);
            let _ = self.1.take().map(|h| h.join());
        }
    }
    let _beating = Stop(stop, Some(beater));
    let args = [
        "offline",
        "--gpu",
        "0",
        "--step-ms",
        "2",
        "--queue-depth",
        "16",
    ];
    let off = Proc(
        n.workload(&a, &args, Some("offline"), 300)
            .env("COLOC_GATE_FILE", &elsewhere)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    a.wait_processes(1);
    // Requests 500 ms apart, each its own busy period (the idle window is 100 ms).
    let mut on = n.online(&a, 2, 30, 3);
    let mut silent_seen = false;
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(20) && on.0.try_wait().unwrap().is_none() {
        let st = a.state();
        silent_seen |= st["gate_silent_processes"] == 1
            && st["gpus"][0]["processes"].as_array().is_some_and(|ps| {
                ps.iter()
                    .any(|p| p["pid"] == off.pid() && p["gate"] == "silent")
            });
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(on.wait_within("online", Duration::from_secs(5)).success());
    let ev: Vec<_> = n
        .preempts()
        .into_iter()
        .filter(|e| e["confirmed_ns"].as_u64().is_some())
        .collect();
    assert!(ev.len() >= 3, "{ev:?}\nlog:\n{}", a.log_text());
    let took_ms = |e: &serde_json::Value| e["actuation_s"].as_f64().unwrap() * 1e3;
    assert!(
        took_ms(&ev[0]) >= 45.0,
        "the first preemption did not wait for the gate: {}",
        ev[0]
    );
    for e in &ev[1..] {
        assert!(
            took_ms(e) < 45.0 && e["actuator"] == "signal",
            "waited for a gate already found silent: {e}\nlog:\n{}",
            a.log_text()
        );
    }
    assert!(
        silent_seen,
        "/state never said the gate was silent: {}",
        a.state()
    );
    assert_eq!(
        metric(&a.metrics(), "coloc_gate_silent_processes", &[]),
        1.0
    );
    assert_eq!(
        metric(&a.metrics(), "coloc_gate_escalations_total", &[]),
        1.0,
        "waited for the silent gate more than once"
    );
}
