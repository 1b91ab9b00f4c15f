//! Completion stamps end to end (`coloc_doorbell::Entry::drained_ns`): the online shim,
//! through the real dynamic linker, in front of the fake driver, stamps when a
//! synchronising call showed all of the process's work on a GPU complete — and only then.
//! `coloc-sim online --cuda` is the service (kernels, then `cuStreamSynchronize`, per
//! request); `coloc-syncs` makes the orders each rule is about. The test reads the page as
//! the agent does (`Page::drained_ns`, read-only mapping).

use coloc_e2e::*;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, ChildStdout, Stdio};
use std::time::Duration;

/// A scratch directory, removed on drop (also when the test fails).
struct Dir(PathBuf);

impl Dir {
    fn new(what: &str) -> Dir {
        let d = std::env::temp_dir().join(unique(&format!("coloc-e2e-drain-{what}")));
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The one doorbell page in `dir`, mapped once it appears (5 s at most).
fn page_in(dir: &Path) -> MappedPage {
    let mut path = None;
    wait_for("a doorbell page", Duration::from_secs(5), || {
        path = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .find(|p| p.to_string_lossy().ends_with(coloc_doorbell::SUFFIX));
        path.is_some()
    })
    .unwrap();
    MappedPage::open(&path.unwrap())
}

/// (latest launch, drained stamp as the agent reads it) of the page's one GPU (`None`
/// before its first submission).
fn reading(m: &MappedPage) -> Option<(u64, u64)> {
    let mut r = Vec::new();
    m.page().read(&mut r);
    let e = r.first()?;
    let drained = m.page().drained_ns(e.index, coloc_doorbell::now_ns());
    Some((e.last_launch_ns, drained))
}

/// `coloc-syncs` under the shim.
struct Syncs {
    _p: Proc,
    stdin: ChildStdin,
    out: BufReader<ChildStdout>,
    dir: PathBuf,
    page: Option<MappedPage>,
}

impl Syncs {
    fn start(sim: &Sim, dir: &Dir, class: &str, args: &[&str], env: &[(&str, &Path)]) -> Syncs {
        Syncs::spawn(sim, dir, class, args, env, Stdio::inherit())
    }

    /// [`Syncs::start`], its stderr going to `stderr`.
    fn spawn(
        sim: &Sim,
        dir: &Dir,
        class: &str,
        args: &[&str],
        env: &[(&str, &Path)],
        stderr: Stdio,
    ) -> Syncs {
        let mut c = std::process::Command::new(bin("coloc-syncs"));
        c.args(args)
            .env("COLOC_SIM_STATE", &sim.state)
            .env("LD_LIBRARY_PATH", fake_cuda())
            .env("LD_PRELOAD", bin("libcoloc_cuda.so"))
            .env("COLOC_SHIM_CLASS", class)
            .env("COLOC_DOORBELL_DIR", &dir.0)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr);
        for (k, v) in env {
            c.env(k, v);
        }
        let mut p = Proc(c.spawn().unwrap());
        let stdin = p.0.stdin.take().unwrap();
        let mut out = BufReader::new(p.0.stdout.take().unwrap());
        let mut l = String::new();
        out.read_line(&mut l).unwrap();
        assert_eq!(l.trim(), "ready");
        Syncs {
            _p: p,
            stdin,
            out,
            dir: dir.0.clone(),
            page: None,
        }
    }

    /// Runs one command; its `CUresult`.
    fn step(&mut self, cmd: &str) -> i32 {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        let mut l = String::new();
        self.out.read_line(&mut l).unwrap();
        l.trim()
            .strip_prefix("ok ")
            .and_then(|r| r.parse().ok())
            .unwrap_or_else(|| panic!("{cmd}: {l:?}"))
    }

    /// Runs one command that must succeed.
    fn ok(&mut self, cmd: &str) {
        assert_eq!(self.step(cmd), 0, "{cmd}");
    }

    /// (latest launch, drained stamp) of the GPU.
    fn reading(&mut self) -> (u64, u64) {
        if self.page.is_none() {
            self.page = Some(page_in(&self.dir));
        }
        reading(self.page.as_ref().unwrap()).expect("an entry for the GPU")
    }

    /// The drained stamp.
    fn drained(&mut self) -> u64 {
        self.reading().1
    }
}

#[test]
fn a_request_s_sync_stamps_when_its_work_completed() {
    let sim = Sim::start(1, &[]);
    let dir = Dir::new("online");
    // 10 requests a second, each 4 kernels of 5 ms launched at once, then a stream sync.
    let mut on = Proc(
        sim.cmd(&[
            "online",
            "--gpu",
            "0",
            "--rate",
            "10",
            "--work-ms",
            "20",
            "--duration-s",
            "2",
            "--seed",
            "3",
            "--cuda",
        ])
        .env("LD_LIBRARY_PATH", fake_cuda())
        .env("LD_PRELOAD", bin("libcoloc_cuda.so"))
        .env("COLOC_SHIM_CLASS", "online")
        .env("COLOC_DOORBELL_DIR", &dir.0)
        .stdout(Stdio::null())
        .spawn()
        .unwrap(),
    );
    let m = page_in(&dir.0);
    // The longest time seen between a request's last launch and its stamp.
    let mut after_launch = 0u64;
    let mut stamped = 0;
    let mut last_stamp = 0;
    while on.0.try_wait().unwrap().is_none() {
        std::thread::sleep(Duration::from_millis(2));
        let Some((last, drained)) = reading(&m) else {
            continue;
        };
        assert!(drained <= coloc_doorbell::now_ns());
        if drained != 0 && drained != last_stamp {
            stamped += 1;
            last_stamp = drained;
        }
        if drained >= last && last != 0 {
            after_launch = after_launch.max(drained - last);
        }
    }
    assert!(on.wait_within("online", Duration::from_secs(10)).success());
    assert!(stamped >= 3, "stamps seen: {stamped}");
    // The kernels were all launched within microseconds; the stamp came when they had
    // run: about 20 ms later, not at the launch or the call.
    assert!(
        after_launch >= 15_000_000,
        "a request's stamp only {after_launch} ns after its last launch"
    );
}

#[test]
fn a_launch_during_the_wait_stamps_nothing() {
    let sim = Sim::start(1, &[]);
    let dir = Dir::new("during");
    let mut p = Syncs::start(&sim, &dir, "online", &[], &[]);
    p.ok("launch a 300");
    // Another thread launches on the same stream while this one waits for it.
    p.ok("thread a 1 30");
    p.ok("sync a");
    assert_eq!(p.step("join"), 0);
    assert_eq!(
        p.drained(),
        0,
        "the sync did not wait for the launch made during it"
    );
    // Nothing launched since the last call began: this one stamps.
    p.ok("sync a");
    let (last, drained) = p.reading();
    assert!(drained > last, "{drained} after {last}");
}

/// A launch that has rung but is not in the driver's queue yet (here: blocked in the
/// driver, whose queue is full) is not covered by a synchronise that starts meanwhile.
#[test]
fn a_submission_still_inside_the_driver_stamps_nothing() {
    let sim = Sim::start(1, &[]);
    let dir = Dir::new("inside");
    let mut p = Syncs::start(&sim, &dir, "online", &[], &[]);
    // Another thread: a kernel of 300 ms, 1023 empty ones behind it (the fake driver's
    // queue is then full), then one of 100 ms, which waits in the driver for room.
    p.ok("burst a 1023 300 100");
    p.ok("sleep 150");
    // An event recorded now is behind the empty kernels, not behind that launch.
    p.ok("record a");
    p.ok("ctx-sync");
    assert_eq!(
        p.drained(),
        0,
        "the context's sync began while a launch was inside the driver"
    );
    assert_eq!(p.step("join"), 0);
    p.ok("event-sync");
    assert_eq!(
        p.drained(),
        0,
        "the event was recorded while a launch was inside the driver"
    );
    p.ok("ctx-sync");
    let (last, drained) = p.reading();
    assert!(drained > last);
}

/// Work in two contexts on one GPU: one context's synchronize does not cover the other's.
#[test]
fn one_context_s_sync_does_not_cover_another_context_s_work() {
    let sim = Sim::start(1, &[]);
    let dir = Dir::new("contexts");
    let mut p = Syncs::start(&sim, &dir, "online", &[], &[]);
    p.ok("launch 0 20");
    p.ok("new-ctx");
    p.ok("launch 0 5");
    p.ok("ctx-sync");
    assert_eq!(
        p.drained(),
        0,
        "the primary context's work was not waited for"
    );
    p.ok("primary");
    p.ok("ctx-sync");
    assert_eq!(
        p.drained(),
        0,
        "nor, from the primary context, the other one's"
    );
}

#[test]
fn work_on_two_streams_is_covered_by_neither_stream_s_sync() {
    let sim = Sim::start(1, &[]);
    let dir = Dir::new("streams");
    let mut p = Syncs::start(&sim, &dir, "online", &[], &[]);
    p.ok("launch a 20");
    p.ok("launch b 1");
    p.ok("sync b");
    p.ok("sync a");
    assert_eq!(p.drained(), 0, "each sync covered one of two streams");
    // The context's sync covers both.
    p.ok("ctx-sync");
    let first = p.drained();
    assert!(first > p.reading().0);
    // Since that stamp, one stream only: its sync stamps again.
    p.ok("launch b 5");
    p.ok("sync b");
    let (last, drained) = p.reading();
    assert!(drained > last && last > first, "{first} {last} {drained}");
    // And a stream without work since (a) covers nothing of b's.
    p.ok("launch b 5");
    p.ok("sync a");
    assert_eq!(p.drained(), drained);
}

#[test]
fn a_failed_sync_stamps_nothing() {
    let sim = Sim::start(1, &[]);
    let dir = Dir::new("failed");
    let mut p = Syncs::start(&sim, &dir, "online", &[], &[]);
    p.ok("launch a 50");
    p.ok("destroy a");
    // The stream is gone (its kernel still runs): the driver refuses the sync.
    assert_ne!(p.step("sync a"), 0);
    assert_eq!(p.drained(), 0);
    p.ok("ctx-sync");
    assert!(p.drained() > p.reading().0);
}

#[test]
fn an_event_covers_the_work_before_its_record() {
    let sim = Sim::start(1, &[]);
    let dir = Dir::new("event");
    let mut p = Syncs::start(&sim, &dir, "online", &[], &[]);
    p.ok("launch a 10");
    p.ok("record a");
    p.ok("event-sync");
    let (last, first) = p.reading();
    assert!(first > last, "{first} after {last}");
    // A launch after the record: the event does not wait for it.
    p.ok("launch a 10");
    p.ok("record a");
    p.ok("launch a 30");
    p.ok("event-sync");
    assert_eq!(p.drained(), first);
    // Recorded on another stream than the work: nothing either.
    p.ok("sync a");
    let second = p.drained();
    assert!(second > first);
    p.ok("launch a 200");
    p.ok("record b");
    p.ok("event-sync");
    assert_eq!(p.drained(), second);
    // A query that finds it complete is as good as a wait.
    p.ok("record a");
    assert_eq!(p.step("event-query"), 600, "CUDA_ERROR_NOT_READY");
    assert_eq!(p.drained(), second);
    // Queried again until the 200 ms kernel is done (the simulated GPU runs it in real
    // time: on a loaded machine later than 200 ms); the queries that find it not done
    // stamp nothing.
    let t = std::time::Instant::now();
    let done = loop {
        let r = p.step("event-query");
        if r != 600 {
            break r;
        }
        assert_eq!(
            p.drained(),
            second,
            "a query that found the work running stamped"
        );
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the 200 ms kernel not complete after 10 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(done, 0, "event-query");
    let (last, third) = p.reading();
    assert!(third > last && last > second);
}

#[test]
fn a_device_to_host_copy_stamps_and_a_host_to_device_one_does_not() {
    let sim = Sim::start(1, &[]);
    let dir = Dir::new("copies");
    let mut p = Syncs::start(&sim, &dir, "online", &[], &[]);
    p.ok("launch 0 10");
    // Returns once the earlier work is done, its own copy maybe still queued: it rings
    // (its own launch time) and stamps nothing.
    let before = coloc_doorbell::now_ns();
    p.ok("htod");
    let (last, drained) = p.reading();
    assert_eq!(drained, 0);
    assert!(last >= before, "the copy is a submission: it rang");
    // Returns once the copy and the stream's earlier work are done.
    p.ok("dtoh");
    let (last, drained) = p.reading();
    assert!(drained > last, "{drained} after {last}");
    // A created stream's work is not the default stream's.
    p.ok("launch a 10");
    p.ok("dtoh");
    assert_eq!(p.drained(), drained);
}

#[test]
fn a_stream_query_that_finds_it_complete_stamps() {
    let sim = Sim::start(1, &[]);
    let dir = Dir::new("query");
    let mut p = Syncs::start(&sim, &dir, "online", &[], &[]);
    p.ok("launch a 200");
    assert_eq!(p.step("query a"), 600, "CUDA_ERROR_NOT_READY");
    assert_eq!(p.drained(), 0);
    std::thread::sleep(Duration::from_millis(250));
    p.ok("query a");
    let (last, drained) = p.reading();
    assert!(drained > last);
}

/// The per-thread default stream variants (`_ptsz`, `_ptds`, asked of the getter with
/// flag 2): stream 0 is the calling thread's own, and another thread's is not it.
#[test]
fn the_per_thread_default_stream_variants_stamp_for_their_own_thread() {
    let sim = Sim::start(1, &[]);
    let dir = Dir::new("ptds");
    let trace = Dir::new("ptds-trace");
    let log = trace.0.join("stderr");
    let mut p = Syncs::spawn(
        &sim,
        &dir,
        "online",
        &["--per-thread"],
        &[("COLOC_SHIM_TRACE", Path::new("1"))],
        std::fs::File::create(&log).unwrap().into(),
    );
    p.ok("launch 0 10");
    p.ok("sync 0");
    let (last, first) = p.reading();
    assert!(first > last, "{first} after {last}");
    // Another thread's own stream: this thread's sync does not wait for it.
    p.ok("thread 0 100 0");
    assert_eq!(p.step("join"), 0);
    p.ok("sync 0");
    assert_eq!(p.drained(), first);
    p.ok("ctx-sync");
    let second = p.drained();
    assert!(second > first);
    // The per-thread synchronous copy.
    p.ok("launch 0 10");
    p.ok("dtoh");
    let (last, third) = p.reading();
    assert!(third > last && last > second);
    let err = std::fs::read_to_string(&log).unwrap();
    for name in ["cuStreamSynchronize", "cuMemcpyDtoH", "cuLaunchKernel"] {
        assert!(
            err.lines().any(|l| l.contains(&format!(
                "trace: cuGetProcAddress {name} ver=12040 flags=0x2 wrapped"
            ))),
            "{name}: {err}"
        );
    }
}

#[test]
fn offline_processes_stamp_nothing() {
    use coloc_agent::edges::gate::GateFile;
    let sim = Sim::start(1, &[]);
    let dir = Dir::new("offline");
    let gate_path = dir.0.join("gate").join("gates");
    let gate = GateFile::create(&gate_path).unwrap();
    gate.beat();
    let bells = dir.0.join("bells");
    std::fs::create_dir_all(&bells).unwrap();
    let bells = Dir(bells);
    let mut p = Syncs::start(
        &sim,
        &bells,
        "offline",
        &[],
        &[("COLOC_GATE_FILE", gate_path.as_path())],
    );
    for cmd in ["launch a 5", "sync a", "ctx-sync", "launch 0 5", "dtoh"] {
        gate.beat();
        p.ok(cmd);
    }
    let m = page_in(&bells.0);
    let g = m.gate().expect("the gate keeps the GPU's entry");
    assert!(g.submitted >= 2, "{g:?}");
    assert_eq!(m.page().drained_ns(g.index, coloc_doorbell::now_ns()), 0);
}
