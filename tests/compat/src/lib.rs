//! # coloc-compat — the CUDA shim where users run it
//!
//! Harness for the compatibility tests (`tests/`): the shim as images ship it
//! (`scripts/build-compat`: glibc 2.17 floor, built with Zig), old userlands made from
//! Debian's packages (`debootstrap --variant=minbase`, cached outside the repository in
//! [`CACHE`], made by the tests when missing), and a runner that puts a program into such
//! a userland (a private mount namespace and `chroot`: nothing is mounted or written
//! outside it, the host's `/etc/ld.so.preload` is never touched).
//!
//! What a test cannot have here (no Zig, not root, no `debootstrap` or no network to
//! Debian's archive) it says in a `NOTE` line and checks what it can without it.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Where the userlands are kept between runs.
pub const CACHE: &str = "/var/cache/gpu-coloc-test";
/// The shim's glibc floor: no symbol version newer than this is needed.
pub const FLOOR: (u32, u32) = (2, 17);

/// The repository's root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The cargo target directory (this test runs from `<target>/<profile>/deps/`).
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    exe.ancestors().nth(3).expect("target dir").to_path_buf()
}

/// What `scripts/build-compat` made.
#[derive(Debug, Clone)]
pub struct Builds {
    /// The shim for x86_64, glibc 2.17 floor.
    pub shim: PathBuf,
    /// The same for aarch64, where the toolchain could build it.
    pub shim_aarch64: Option<PathBuf>,
    /// The directory with the fake driver as `libcuda.so.1` (same floor).
    pub fake_cuda_dir: PathBuf,
    /// The C driver-API program (`tests/compat/c/probe.c`).
    pub probe: PathBuf,
    /// The HAMi-core-like stand-in interposer (`tests/compat/c/standin.c`).
    pub standin: PathBuf,
}

/// Runs `scripts/build-compat` once per test program; `None` (with a NOTE) where Zig or
/// cargo-zigbuild is missing. Any other failure fails the test.
pub fn builds() -> Option<Builds> {
    static B: OnceLock<Option<Builds>> = OnceLock::new();
    B.get_or_init(|| {
        let t = target_dir();
        let out = Command::new(repo().join("scripts/build-compat"))
            .env("CARGO_TARGET_DIR", &t)
            .stdout(Stdio::inherit())
            .output()
            .expect("run scripts/build-compat");
        let err = String::from_utf8_lossy(&out.stderr);
        eprint!("{err}");
        match out.status.code() {
            Some(0) => {}
            Some(3) => return None,
            _ => panic!("scripts/build-compat failed: {err}"),
        }
        let arm = t.join("aarch64-unknown-linux-gnu/release/libcoloc_cuda.so");
        Some(Builds {
            shim: t.join("x86_64-unknown-linux-gnu/release/libcoloc_cuda.so"),
            shim_aarch64: arm.exists().then_some(arm),
            fake_cuda_dir: t.join("compat/fake-cuda"),
            probe: t.join("compat/probe"),
            standin: t.join("compat/libstandin.so"),
        })
    })
    .clone()
}

/// The GLIBC symbol versions a shared object needs (`objdump -T`), newest last.
pub fn glibc_versions(so: &Path) -> Vec<(u32, u32, u32)> {
    let out = Command::new("objdump")
        .arg("-T")
        .arg(so)
        .output()
        .expect("objdump (binutils)");
    assert!(out.status.success(), "objdump -T {}", so.display());
    let text = String::from_utf8_lossy(&out.stdout);
    let mut v: Vec<(u32, u32, u32)> = text
        .split(|c: char| c.is_whitespace() || c == '(' || c == ')')
        .filter_map(|w| w.strip_prefix("GLIBC_"))
        .filter_map(|v| {
            let mut it = v.split('.').map(|n| n.parse::<u32>().ok());
            Some((it.next()??, it.next()??, it.next().flatten().unwrap_or(0)))
        })
        .collect();
    v.sort();
    v.dedup();
    v
}

/// The strong undefined symbols of a shared object that name no version (`objdump -T`):
/// each is bound to whatever defines it at run time, so a function newer than the floor
/// would fail only there (weak ones, which Rust's standard library looks up and does
/// without, are left out).
pub fn unversioned_imports(so: &Path) -> Vec<String> {
    let out = Command::new("objdump")
        .arg("-T")
        .arg(so)
        .output()
        .expect("objdump (binutils)");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let (flags, rest) = l.split_once("*UND*")?;
            let words: Vec<&str> = rest.split_whitespace().collect();
            let weak = flags.split_whitespace().any(|w| w == "w");
            (words.len() == 2 && !weak).then(|| words[1].to_string())
        })
        .collect()
}

/// A Debian userland made with `debootstrap --variant=minbase SUITE`, kept in [`CACHE`];
/// made now when missing (a few minutes). `None`, with a NOTE, where that cannot be done.
pub fn userland(suite: &str) -> Option<PathBuf> {
    static LOCK: Mutex<()> = Mutex::new(());
    let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let root = Path::new(CACHE).join(suite);
    if !root.join("usr/bin/env").exists() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("NOTE: not root: cannot make or enter the {suite} userland");
            return None;
        }
        let tmp = Path::new(CACHE).join(format!("{suite}.tmp"));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(CACHE).ok()?;
        let t = Instant::now();
        let ok = Command::new("debootstrap")
            .args(["--variant=minbase", suite])
            .arg(&tmp)
            .arg("http://deb.debian.org/debian")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            let _ = std::fs::remove_dir_all(&tmp);
            eprintln!(
                "NOTE: debootstrap {suite} failed (is debootstrap installed, is Debian's archive reachable?)"
            );
            return None;
        }
        std::fs::rename(&tmp, &root).ok()?;
        eprintln!(
            "made the {suite} userland in {:.0} s ({})",
            t.elapsed().as_secs_f64(),
            root.display()
        );
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("NOTE: not root: cannot enter the {suite} userland");
        return None;
    }
    // Mount points the runner binds over (inside the cached tree only).
    for d in ["t", "x", "dev/shm", "proc"] {
        std::fs::create_dir_all(root.join(d)).ok()?;
    }
    let preload = root.join("etc/ld.so.preload");
    if !preload.exists() {
        std::fs::write(&preload, b"").ok()?;
    }
    Some(root)
}

/// A program to run in a userland.
#[derive(Debug)]
pub struct Run {
    root: PathBuf,
    binds: Vec<(PathBuf, String)>,
    preload_file: Option<PathBuf>,
    env: Vec<(String, String)>,
}

impl Run {
    /// In `root`, with the target directory at `/t` and `/dev/shm` (the simulated GPU's
    /// state) bound in, `/proc` mounted, and a clean environment.
    pub fn new(root: &Path) -> Run {
        Run {
            root: root.to_path_buf(),
            binds: vec![
                (target_dir(), "/t".into()),
                ("/dev/shm".into(), "/dev/shm".into()),
            ],
            preload_file: None,
            env: vec![("PATH".into(), "/usr/bin:/bin".into())],
        }
    }

    /// Binds host directory `dir` at `/x` inside.
    pub fn with_x(mut self, dir: &Path) -> Run {
        self.binds.push((dir.to_path_buf(), "/x".into()));
        self
    }

    /// `/etc/ld.so.preload` inside lists `libs` (a file bound over it in this run's
    /// mount namespace only).
    pub fn etc_preload(mut self, scratch: &Path, libs: &[&str]) -> Run {
        let f = scratch.join(format!("ld.so.preload.{}", std::process::id()));
        std::fs::write(&f, libs.join("\n") + "\n").unwrap();
        self.preload_file = Some(f);
        self
    }

    /// Sets `k=v` in the program's environment.
    pub fn env(mut self, k: &str, v: &str) -> Run {
        self.env.push((k.into(), v.into()));
        self
    }

    /// The command: `unshare -m` (private mounts), the binds, `chroot`, `env -i`.
    pub fn command(&self, program: &str, args: &[&str]) -> Command {
        let r = self.root.display().to_string();
        let mut script = format!("set -e; mount -t proc proc {r}/proc; ");
        for (host, inner) in &self.binds {
            script += &format!("mount --bind '{}' '{r}{inner}'; ", host.display());
        }
        if let Some(f) = &self.preload_file {
            script += &format!("mount --bind '{}' '{r}/etc/ld.so.preload'; ", f.display());
        }
        script += &format!("exec chroot '{r}' /usr/bin/env -i");
        for (k, v) in &self.env {
            script += &format!(" '{k}={v}'");
        }
        script += " \"$@\"";
        let mut c = Command::new("unshare");
        c.args([
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            &script,
            "sh",
            program,
        ])
        .args(args);
        c
    }
}

/// A running program whose stdout lines are collected; killed on drop.
#[derive(Debug)]
pub struct Running {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Running {
    /// Spawns `c` with stdin and stdout piped (stderr: `stderr`).
    pub fn spawn(mut c: Command, stderr: Stdio) -> Running {
        let mut child = c
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("spawn");
        let out = child.stdout.take().unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let l = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                l.lock().unwrap().push(line);
            }
        });
        Running { child, lines }
    }

    /// The lines so far.
    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// The last "launched N" line's N (0: none yet).
    pub fn launched(&self) -> u64 {
        self.lines()
            .iter()
            .rev()
            .find_map(|l| l.strip_prefix("launched ")?.parse().ok())
            .unwrap_or(0)
    }

    /// Waits (bounded) until `f` holds of the lines; fails if the program exits first.
    pub fn wait_for(&mut self, what: &str, timeout: Duration, f: impl Fn(&[String]) -> bool) {
        let t = Instant::now();
        while !f(&self.lines()) {
            if let Ok(Some(s)) = self.child.try_wait() {
                panic!(
                    "{what}: the program exited ({s}); output: {:?}",
                    self.lines()
                );
            }
            assert!(
                t.elapsed() < timeout,
                "timed out waiting for {what}; output: {:?}",
                self.lines()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Closes stdin and waits (10 s at most) for the exit; the status and every line.
    pub fn finish(mut self) -> (std::process::ExitStatus, Vec<String>) {
        drop(self.child.stdin.take());
        let t = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                // The reader thread ends with the pipe.
                std::thread::sleep(Duration::from_millis(20));
                return (s, self.lines());
            }
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "the program did not exit"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A fresh scratch directory under the system's temporary directory, removed on drop.
#[derive(Debug)]
pub struct Scratch(pub PathBuf);

impl Scratch {
    /// Makes it (mode 0755: the programs inside the userland are root too).
    pub fn new(what: &str) -> Scratch {
        let d = std::env::temp_dir().join(coloc_e2e::unique(&format!("coloc-compat-{what}")));
        std::fs::create_dir_all(&d).unwrap();
        Scratch(d)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The one `.bell` page in `dir`, once it appears (5 s at most).
pub fn page_in(dir: &Path) -> PathBuf {
    let t = Instant::now();
    loop {
        if let Some(p) = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|e| e == "bell"))
        {
            return p;
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "no page in {}",
            dir.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The agent's side of the gate, played by the test: the agent's own gate file, beaten
/// every 20 ms until dropped.
#[derive(Debug)]
pub struct GateAgent {
    /// The gate file.
    pub gate: Arc<coloc_agent::edges::gate::GateFile>,
    beating: Arc<std::sync::atomic::AtomicBool>,
    beater: Option<std::thread::JoinHandle<()>>,
}

impl GateAgent {
    /// Creates the gate file at `path` and starts beating it.
    pub fn start(path: &Path) -> GateAgent {
        let gate = Arc::new(coloc_agent::edges::gate::GateFile::create(path).unwrap());
        let beating = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let (g, b) = (gate.clone(), beating.clone());
        let beater = std::thread::spawn(move || {
            while b.load(std::sync::atomic::Ordering::SeqCst) {
                g.beat();
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        GateAgent {
            gate,
            beating,
            beater: Some(beater),
        }
    }

    /// With `p` launching on GPU 0 (its page at `page`): closes the gate, waits for the
    /// acknowledgement, checks that the launches stop and a thread is blocked, opens it,
    /// and waits for the launches to go on.
    pub fn holds_and_opens(&self, p: &mut Running, page: &coloc_e2e::MappedPage) {
        let uuid = coloc_sim::gpu_uuid(0);
        let epoch = self.gate.close(&uuid).unwrap();
        let t = Instant::now();
        while page.ack() != epoch {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "the close was never acknowledged (ack {}, epoch {epoch}); output {:?}",
                page.ack(),
                p.lines().last()
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        // Acknowledged: no submission is in progress; the printing of the last one may
        // still come.
        let n = p.launched();
        std::thread::sleep(Duration::from_millis(400));
        assert!(
            p.launched() <= n + 1,
            "launches went on while closed: {n} → {}",
            p.launched()
        );
        assert!(
            page.gate().is_some_and(|g| g.blocked_ns != 0),
            "a thread is blocked at the gate"
        );
        self.gate.open(&uuid);
        let held = p.launched();
        p.wait_for("launches after the open", Duration::from_secs(5), |l| {
            l.iter()
                .rev()
                .find_map(|l| l.strip_prefix("launched ")?.parse::<u64>().ok())
                .is_some_and(|k| k > held + 3)
        });
    }
}

impl Drop for GateAgent {
    fn drop(&mut self) {
        self.beating
            .store(false, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.beater.take() {
            let _ = t.join();
        }
    }
}

/// A submission entry point by the shim's rule of thumb (its list, by prefix).
pub fn submits(name: &str) -> bool {
    name.starts_with("cuLaunch")
        || name.starts_with("cuGraphLaunch")
        || ((name.starts_with("cuMemcpy") || name.starts_with("cuMemset"))
            && name.contains("Async"))
}

/// A watched entry point by the shim's rule of thumb (its list in `watch.rs`): what waits
/// for or reports completion, the event calls, the synchronous copies and memsets, and the
/// calls that change the current context or open and close a capture.
pub fn watched(name: &str) -> bool {
    matches!(
        name,
        "cuStreamSynchronize"
            | "cuStreamQuery"
            | "cuCtxSynchronize"
            | "cuEventSynchronize"
            | "cuEventQuery"
            | "cuEventRecord"
            | "cuEventRecordWithFlags"
            | "cuEventCreate"
            | "cuEventDestroy"
            // Watched so that the shim's cached current context and its count of open
            // captures follow them.
            | "cuCtxSetCurrent"
            | "cuCtxPushCurrent"
            | "cuCtxPopCurrent"
            | "cuCtxCreate"
            | "cuCtxCreate_v4"
            | "cuCtxDestroy"
            | "cuDevicePrimaryCtxRelease"
            | "cuDevicePrimaryCtxReset"
            | "cuStreamBeginCapture"
            | "cuStreamBeginCaptureToGraph"
            | "cuStreamEndCapture"
    ) || ((name.starts_with("cuMemcpy") || name.starts_with("cuMemset")) && !name.contains("Async"))
}
