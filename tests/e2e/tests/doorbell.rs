//! The launch doorbell end to end, through the real dynamic linker: simulated workloads
//! `dlopen("libcuda.so.1")` (the fake driver) and look up `cuGetProcAddress_v2` as the
//! CUDA runtime does; `libcoloc_cuda.so` is `LD_PRELOAD`ed into them. The simulated driver
//! samples every 100 ms, as real drivers do, and the agent reads NVML at its defaults.

use coloc_e2e::*;
use std::process::{Command, Stdio};
use std::time::Duration;

const RULES: &str = "[[rule]]\nname = \"off\"\nclass = \"reclaimed_cores\"\ncmdline = \"*coloc-sim offline*\"\n\
                     [[rule]]\nname = \"svc\"\nclass = \"shared_cores\"\ncmdline = \"*coloc-sim online*\"\n";

/// A `coloc-sim` workload on the fake driver, optionally under the shim with a class.
fn workload(sim: &Sim, args: &[&str], shim: Option<(&str, &std::path::Path)>) -> Command {
    let mut c = sim.cmd(args);
    c.arg("--cuda").env("LD_LIBRARY_PATH", fake_cuda());
    if let Some((class, dir)) = shim {
        c.env("LD_PRELOAD", bin("libcoloc_cuda.so"))
            .env("COLOC_SHIM_CLASS", class)
            .env("COLOC_DOORBELL_DIR", dir);
    }
    c
}

/// The agent at its NVML defaults (100 ms), with an event log (removed when dropped).
fn agent(sim: &Sim) -> (Agent, TempPath) {
    let log = TempPath::at(
        std::env::temp_dir()
            .join(unique("coloc-e2e-events"))
            .with_extension("jsonl"),
    );
    let a = Agent::start(
        sim,
        AgentOpts {
            rules: RULES,
            extra: vec!["--event-log".into(), log.display().to_string()],
            env: vec![
                ("COLOC_NVML_INTERVAL", "100ms".into()),
                ("COLOC_NVML_SAMPLE_PERIOD", "100ms".into()),
            ],
            ..Default::default()
        },
    );
    (a, log)
}

fn preempts(log: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == "preempt")
        .collect()
}

fn online_args(out: &str) -> Vec<&str> {
    vec![
        "online",
        "--gpu",
        "0",
        "--rate",
        "4",
        "--work-ms",
        "20",
        "--duration-s",
        "3",
        "--seed",
        "7",
        "--out",
        out,
    ]
}

/// A 100 ms simulated driver, the agent (and its event log), and one offline process it
/// has seen.
fn node_with_offline() -> (Sim, Agent, TempPath, Proc) {
    let sim = Sim::start(1, &["--sample-period-ms", "100"]);
    let (a, log) = agent(&sim);
    let off = Proc(
        workload(&sim, &["offline", "--gpu", "0", "--step-ms", "2"], None)
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    a.wait_processes(1);
    (sim, a, log, off)
}

/// A short online workload: 50 requests/s of 2 ms for `secs`, its summary to `out`.
fn short_online(
    sim: &Sim,
    secs: &str,
    out: &str,
    shim: Option<(&str, &std::path::Path)>,
) -> Command {
    workload(
        sim,
        &[
            "online",
            "--gpu",
            "0",
            "--rate",
            "50",
            "--work-ms",
            "2",
            "--duration-s",
            secs,
            "--out",
            out,
        ],
        shim,
    )
}

/// A fresh path for an online workload's JSON summary (removed when dropped).
fn result_file() -> TempPath {
    TempPath::at(
        std::env::temp_dir()
            .join(unique("coloc-e2e-online"))
            .with_extension("json"),
    )
}

#[test]
fn a_launch_under_the_shim_rings_and_offline_is_stopped_from_the_ring() {
    let (sim, a, log, _off) = node_with_offline();
    let out = result_file();
    let out_s = out.display().to_string();
    let mut on = Proc(
        workload(
            &sim,
            &online_args(&out_s),
            Some(("online", &a.doorbell_dir)),
        )
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap(),
    );
    wait_for("a doorbell page", Duration::from_secs(5), || {
        std::fs::read_dir(&a.doorbell_dir)
            .map(|d| {
                d.flatten()
                    .any(|e| e.file_name().to_string_lossy().ends_with(".bell"))
            })
            .unwrap_or(false)
    })
    .unwrap();
    assert!(on.wait_within("online", Duration::from_secs(20)).success());
    let ev = preempts(&log);
    let bell: Vec<&serde_json::Value> = ev.iter().filter(|e| e["signal"] == "doorbell").collect();
    assert!(
        bell.len() >= 3,
        "preemptions seen by the doorbell: {} of {}; log:\n{}",
        bell.len(),
        ev.len(),
        a.log_text()
    );
    for e in &bell {
        let d = e["detection_s"].as_f64().unwrap();
        // NVML alone would take up to its 100 ms period plus the read interval.
        assert!(
            d < 0.010,
            "doorbell detection {d} s: {e}\nall: {ev:?}\nlog:\n{}",
            a.log_text()
        );
        assert!(
            e["confirmed_ns"].as_u64().is_some(),
            "offline confirmed stopped: {e}"
        );
    }
    assert!(
        metric(&a.metrics(), "coloc_doorbell_wakeups_total", &[]) >= 1.0,
        "the loop was woken by the doorbell"
    );
    // The shim removes its page when the process exits.
    wait_for("the page removed", Duration::from_secs(5), || {
        std::fs::read_dir(&a.doorbell_dir)
            .map(|d| {
                !d.flatten()
                    .any(|e| e.file_name().to_string_lossy().ends_with(".bell"))
            })
            .unwrap_or(true)
    })
    .unwrap();
}

#[test]
fn without_the_shim_nvml_still_preempts() {
    let (sim, a, log, _off) = node_with_offline();
    let out = result_file();
    let out_s = out.display().to_string();
    let mut on = Proc(
        workload(&sim, &online_args(&out_s), None)
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    assert!(on.wait_within("online", Duration::from_secs(20)).success());
    let ev = preempts(&log);
    assert!(
        !ev.is_empty(),
        "no preemption through NVML: {}",
        a.log_text()
    );
    assert!(ev.iter().all(|e| e["signal"] == "nvml"), "{ev:?}");
}

#[test]
fn a_forged_ring_from_an_offline_process_suspends_nothing() {
    let sim = Sim::start(1, &["--sample-period-ms", "100"]);
    let (a, log) = agent(&sim);
    // An offline process that claims to be online to the shim: its page is its own, but
    // the agent classifies it offline, so its launches count for nothing.
    let victim = Proc(
        workload(&sim, &["offline", "--gpu", "0", "--step-ms", "2"], None)
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let _forger = Proc(
        workload(
            &sim,
            &["offline", "--gpu", "0", "--step-ms", "2"],
            Some(("online", &a.doorbell_dir)),
        )
        .stdout(Stdio::null())
        .spawn()
        .unwrap(),
    );
    a.wait_processes(2);
    holds_for("offline never stopped", Duration::from_secs(2), || {
        victim.state() != Some('T')
    })
    .unwrap();
    assert!(preempts(&log).is_empty(), "{:?}", preempts(&log));
    assert!(
        metric(
            &a.metrics(),
            "coloc_doorbell_rejected_total",
            &["reason=\"not_online\""]
        ) >= 1.0,
        "the forged page was rejected as not online:\n{}",
        a.metrics()
    );
}

#[test]
fn with_no_agent_the_shim_passes_through() {
    let sim = Sim::start(1, &[]);
    let out = result_file();
    let out_s = out.display().to_string();
    // No doorbell directory at all (no agent on this host).
    let missing = TempPath::new("coloc-e2e-no-agent");
    let r = output_within(
        short_online(&sim, "1", &out_s, Some(("online", &missing))).stdout(Stdio::null()),
        Duration::from_secs(20),
    );
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert!(v["requests"].as_u64().unwrap() > 10, "{v}");
    let stderr = String::from_utf8_lossy(&r.stderr);
    let shim_lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("libcoloc_cuda:"))
        .collect();
    assert_eq!(
        shim_lines.len(),
        1,
        "one line says why it passes through: {stderr}"
    );
    assert!(!missing.exists());
    // Not online (no class): silent.
    let r = output_within(
        workload(
            &sim,
            &[
                "online",
                "--gpu",
                "0",
                "--rate",
                "50",
                "--work-ms",
                "2",
                "--duration-s",
                "1",
            ],
            None,
        )
        .env("LD_PRELOAD", bin("libcoloc_cuda.so"))
        .stdout(Stdio::null()),
        Duration::from_secs(20),
    );
    assert!(r.status.success());
    assert!(!String::from_utf8_lossy(&r.stderr).contains("libcoloc_cuda"));
}

/// The shim's page appears in the directory complete: written as `….bell.new`, then
/// renamed. (Created under its final name, the agent would see an empty file at the
/// creation and no event after it — the close that follows does not count for inotify
/// while the process keeps the file mapped — and would map the page only at its next
/// look, up to a millisecond after the first launch.)
#[test]
fn the_shim_publishes_its_page_complete_by_rename() {
    let sim = Sim::start(1, &[]);
    let dir = TempPath::dir("coloc-e2e-publish");
    // SAFETY: plain inotify calls on a fresh descriptor and a valid C path.
    let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
    assert!(fd >= 0);
    let cdir = std::ffi::CString::new(dir.to_str().unwrap()).unwrap();
    let mask = libc::IN_CREATE | libc::IN_MOVED_TO | libc::IN_CLOSE_WRITE;
    assert!(unsafe { libc::inotify_add_watch(fd, cdir.as_ptr(), mask) } >= 0);
    let out = result_file();
    let out_s = out.display().to_string();
    let r = output_within(
        short_online(&sim, "0.5", &out_s, Some(("online", &dir))).stdout(Stdio::null()),
        Duration::from_secs(20),
    );
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    // (mask, name) of every event.
    let mut events: Vec<(u32, String)> = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // SAFETY: reading into a buffer we own.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n <= 0 {
            break;
        }
        let mut off = 0usize;
        while off + 16 <= n as usize {
            let word = |i: usize| u32::from_ne_bytes(buf[off + i..off + i + 4].try_into().unwrap());
            let (ev_mask, len) = (word(4), word(12) as usize);
            let name = String::from_utf8_lossy(&buf[off + 16..off + 16 + len])
                .trim_end_matches('\0')
                .to_string();
            events.push((ev_mask, name));
            off += 16 + len;
        }
    }
    // SAFETY: our descriptor, closed once.
    unsafe { libc::close(fd) };
    let named = |m: u32, suffix: &str| {
        events
            .iter()
            .filter(|(em, n)| em & m != 0 && n.ends_with(suffix))
            .count()
    };
    assert_eq!(
        named(libc::IN_MOVED_TO, ".bell"),
        1,
        "the page was renamed into place once: {events:?}"
    );
    assert_eq!(
        named(libc::IN_CREATE, ".bell"),
        0,
        "a page was created under its final name (seen before it was complete): {events:?}"
    );
    assert_eq!(named(libc::IN_CREATE, ".bell.new"), 1, "{events:?}");
}

/// `COLOC_SHIM_TRACE=1` lists, once each, the entry points the process looks up and
/// whether the shim wrapped them: the runtime's `dlsym` of the getter, and the getter's
/// requests with their CUDA version and flags.
#[test]
fn the_shim_traces_what_the_process_looks_up() {
    let sim = Sim::start(1, &[]);
    let dir = TempPath::dir("coloc-e2e-trace");
    let out = result_file();
    let out_s = out.display().to_string();
    let run = |trace: &str| {
        let r = output_within(
            short_online(&sim, "0.3", &out_s, Some(("online", &dir)))
                .env("COLOC_SHIM_TRACE", trace)
                .stdout(Stdio::null()),
            Duration::from_secs(20),
        );
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        String::from_utf8_lossy(&r.stderr).to_string()
    };
    let err = run("1");
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("libcoloc_cuda: trace: "))
        .collect();
    let has = |needle: &str| lines.iter().any(|l| l.contains(needle));
    assert!(
        has("trace: dlsym cuGetProcAddress_v2 ver=0 flags=0x0 wrapped"),
        "{err}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("cuGetProcAddress cuLaunchKernel ver=") && l.ends_with(" wrapped")),
        "{err}"
    );
    assert!(
        lines.iter().any(|l| l.ends_with(" passed")),
        "names the shim does not wrap are listed too: {err}"
    );
    // Once each: no line twice.
    let mut sorted = lines.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), lines.len(), "{err}");
    // Off by default (and with 0).
    assert!(!run("0").contains("trace:"));
}

/// An online process capturing a CUDA graph starts no run: a captured launch runs nothing
/// (no wake-up, no stamp); the graph's launch, when it runs, does.
#[test]
fn captured_launches_do_not_ring_the_graph_launch_does() {
    use std::io::{BufRead, Write};
    let sim = Sim::start(1, &[]);
    let dir = TempPath::dir("coloc-e2e-capture-bell");
    let mut c = Command::new(bin("coloc-capture"));
    c.env("COLOC_SIM_STATE", &sim.state)
        .env("LD_LIBRARY_PATH", fake_cuda())
        .env("LD_PRELOAD", bin("libcoloc_cuda.so"))
        .env("COLOC_SHIM_CLASS", "online")
        .env("COLOC_DOORBELL_DIR", &dir)
        .env("COLOC_CAPTURE_ALONE", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut p = Proc(c.spawn().unwrap());
    let mut stdin = p.0.stdin.take().unwrap();
    let mut out = std::io::BufReader::new(p.0.stdout.take().unwrap());
    let mut next = || {
        let mut l = String::new();
        out.read_line(&mut l).unwrap();
        l.trim().to_string()
    };
    let mut send = |s: &str| writeln!(stdin, "{s}").and_then(|_| stdin.flush()).unwrap();
    // (page wake word, runs started on the GPU's entry): what the agent would see.
    let runs = || {
        let path = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .find(|p| p.to_string_lossy().ends_with(coloc_doorbell::SUFFIX))
            .expect("the process's page");
        let m = MappedPage::open(&path);
        let mut r = Vec::new();
        m.page().read(&mut r);
        let wakes: u64 = r.iter().map(|x| m.page().wakes(x.index)).sum();
        let stamped = r.iter().filter(|x| x.last_launch_ns != 0).count();
        (
            m.page()
                .header()
                .wake
                .load(std::sync::atomic::Ordering::SeqCst),
            wakes,
            stamped,
        )
    };
    assert_eq!(next(), "capturing");
    send("go");
    assert!(next().starts_with("more "));
    assert_eq!(runs(), (0, 0, 0), "captured launches started a run");
    send("end");
    let captured = next();
    assert!(captured.contains("\"end\":0"), "{captured}");
    send("replay");
    let launched = next();
    assert!(launched.contains("\"launch\":0"), "{launched}");
    let (word, wakes, stamped) = runs();
    assert_eq!(
        (wakes, stamped),
        (1, 1),
        "the graph's launch started one run"
    );
    assert!(word >= 1);
    send("exit");
    drop(stdin);
    assert!(p
        .wait_within("coloc-capture", Duration::from_secs(10))
        .success());
}

/// A container can start before the agent has made its pod's doorbell directory: the
/// shim passes through meanwhile, says so once, and makes its page when the directory is
/// there (tried once a second), then rings as usual. A page is never made twice.
#[test]
fn the_shim_makes_its_page_once_the_directory_is_there() {
    let sim = Sim::start(1, &[]);
    let root = TempPath::new("coloc-e2e-late-dir");
    let dir = root
        .join("pods")
        .join("11111111-2222-3333-4444-555555555555");
    let err = TempPath::at(root.with_extension("err"));
    let mut on = Proc(
        workload(
            &sim,
            &[
                "online",
                "--gpu",
                "0",
                "--rate",
                "50",
                "--work-ms",
                "1",
                "--duration-s",
                "4",
            ],
            Some(("online", &dir)),
        )
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap(),
    );
    let pages = |d: &std::path::Path| {
        std::fs::read_dir(d)
            .map(|r| {
                r.flatten()
                    .filter(|e| e.file_name().to_string_lossy().ends_with(".bell"))
                    .count()
            })
            .unwrap_or(0)
    };
    std::thread::sleep(Duration::from_millis(700));
    std::fs::create_dir_all(&dir).unwrap();
    let t = std::time::Instant::now();
    wait_for(
        "the page, once the directory is there",
        Duration::from_millis(2500),
        || pages(&dir) == 1,
    )
    .unwrap_or_else(|e| panic!("{e}: {}", std::fs::read_to_string(&err).unwrap_or_default()));
    eprintln!("page made {:?} after the directory", t.elapsed());
    assert!(on.wait_within("online", Duration::from_secs(10)).success());
    let said = std::fs::read_to_string(&err).unwrap();
    assert_eq!(
        said.matches("trying again every second").count(),
        1,
        "{said}"
    );
}

/// The doorbell's online path makes no driver call after a run's first launch: the same
/// requests (8 kernels and a stream synchronize each) with the shim ringing its page and
/// without the shim make the same driver calls, but for a handful (the shim's setup at the
/// first submission, the context checked against the driver every 256 uses).
#[test]
fn the_online_path_makes_no_driver_call_per_launch() {
    let sim = Sim::start(1, &[]);
    let bells = TempPath::dir("coloc-e2e-bells");
    let dir = bells.to_path_buf();
    let run = |shim: Option<(&str, &std::path::Path)>| {
        let out = TempPath::at(
            std::env::temp_dir()
                .join(unique("coloc-e2e-online"))
                .with_extension("json"),
        );
        let out_s = out.display().to_string();
        let args = [
            "online",
            "--gpu",
            "0",
            "--rate",
            "100",
            "--work-ms",
            "0.5",
            "--kernels",
            "8",
            "--duration-s",
            "3",
            "--seed",
            "7",
            "--out",
            &out_s,
        ];
        let mut p = Proc(
            workload(&sim, &args, shim)
                .stdout(Stdio::null())
                .spawn()
                .unwrap(),
        );
        assert!(p.wait_within("online", Duration::from_secs(20)).success());
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&*out).unwrap()).unwrap();
        (
            v["driver_calls"].as_u64().unwrap(),
            v["requests"].as_u64().unwrap(),
        )
    };
    let (with, n_with) = run(Some(("online", &dir)));
    let (without, n_without) = run(None);
    assert!(
        n_with > 100 && n_with == n_without,
        "{n_with} / {n_without} requests"
    );
    let launches = n_with * 8;
    assert!(
        with <= without + 16 + launches / 256,
        "the doorbell made {} driver calls over {launches} launches",
        with.saturating_sub(without)
    );
}
