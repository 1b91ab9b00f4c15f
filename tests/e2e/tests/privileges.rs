//! Least privilege, end to end: the real agent runs with its capability sets reduced to
//! exactly what the Helm chart grants (read from the rendered chart), as root (uid 0, as
//! in the DaemonSet), and the offline work belongs to another user (uid 65534).
//!
//! - the freezer freezes and thaws a root-owned test cgroup without `DAC_OVERRIDE`;
//! - the signal actuator stops and continues a process of another user with `KILL` only
//!   (and, as a control, cannot without it);
//! - Kubernetes-mode classification (pod by cgroup, through a fake API server) and
//!   `cmdline` rules work without `SYS_PTRACE`; an `exe` rule does not match a process of
//!   another user without it (its `/proc/<pid>/exe` cannot be read) and does with
//!   `agent.sysPtrace=true`.
//!
//! Capabilities are reduced with `setpriv` (util-linux), or `capsh` (libcap) where setpriv
//! is missing; the test checks the agent's `/proc/<pid>/status` shows exactly the chart's
//! set before it relies on it, and fails (it never passes without checking) when neither
//! tool is installed.

use coloc_e2e::fakeapi::{pod, FakeApi};
use coloc_e2e::*;
use std::ffi::{CString, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// The other user the offline work runs as (nobody).
const NOBODY: u32 = 65534;
const SOON: Duration = Duration::from_secs(3);

/// What the chart grants by default, and with `agent.sysPtrace=true`; checked against the
/// rendered chart by [`chart_caps`].
const CHART_DEFAULT: &[&str] = &["KILL"];
const CHART_SYS_PTRACE: &[&str] = &["KILL", "SYS_PTRACE"];

/// Capability numbers (linux/capability.h) of the capabilities named here.
fn cap_number(name: &str) -> u32 {
    match name {
        "DAC_OVERRIDE" => 1,
        "KILL" => 5,
        "SYS_PTRACE" => 19,
        "SYS_NICE" => 23,
        other => panic!("capability {other} unknown to this test"),
    }
}

fn cap_mask(caps: &[String]) -> u64 {
    caps.iter().fold(0, |m, c| m | 1 << cap_number(c))
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The capabilities the chart's agent container adds, rendered with `sets`
/// (`deploy/scripts/render-chart.py`), checked to equal `expect`. Where the chart cannot
/// be rendered here (no python3 with PyYAML), says so and uses `expect`.
fn chart_caps(sets: &[&str], expect: &[&str]) -> Vec<String> {
    let script = "import json,subprocess,sys,yaml\n\
        args=[sys.executable, sys.argv[1]]\n\
        for s in sys.argv[2:]: args += ['--set', s]\n\
        out=subprocess.run(args, check=True, capture_output=True, text=True).stdout\n\
        ds=[d for d in yaml.safe_load_all(out) if d and d['kind']=='DaemonSet'][0]\n\
        print(json.dumps(ds['spec']['template']['spec']['containers'][0]['securityContext']))";
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(repo_root().join("deploy/scripts/render-chart.py"))
        .args(sets)
        .output();
    let expect: Vec<String> = expect.iter().map(|s| s.to_string()).collect();
    match out {
        Ok(o) if o.status.success() => {
            let sc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
            assert_eq!(sc["runAsUser"], 0, "the chart's agent runs as root: {sc}");
            assert_eq!(sc["privileged"], false, "{sc}");
            assert_eq!(sc["allowPrivilegeEscalation"], false, "{sc}");
            assert_eq!(
                sc["capabilities"]["drop"],
                serde_json::json!(["ALL"]),
                "{sc}"
            );
            let add: Vec<String> = sc["capabilities"]["add"]
                .as_array()
                .expect("capabilities.add")
                .iter()
                .map(|c| c.as_str().unwrap().to_string())
                .collect();
            assert_eq!(
                add, expect,
                "the chart (--set {sets:?}) grants other capabilities than this test checks"
            );
            eprintln!("chart (--set {sets:?}) grants the agent {add:?}");
            add
        }
        other => {
            let why = match other {
                Ok(o) => String::from_utf8_lossy(&o.stderr).trim().to_string(),
                Err(e) => e.to_string(),
            };
            eprintln!(
                "NOTE: cannot render the Helm chart here ({why}): using {expect:?}, what this \
                 test expects the chart to grant, WITHOUT checking it against the chart \
                 (deploy/scripts/check-deploy.py checks the chart)"
            );
            expect
        }
    }
}

fn which(tool: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(tool))
            .find(|f| f.is_file())
    })
}

/// A command that runs `program` as root with exactly `caps` (effective, permitted and
/// bounding sets; inheritable and ambient empty; no new privileges where the tool can).
fn with_only_caps(caps: &[String], program: &Path) -> Command {
    let forced = std::env::var("COLOC_E2E_CAPS_TOOL").ok();
    let tool = match forced.as_deref() {
        Some(t) => Some(t.to_string()),
        None if which("setpriv").is_some() => Some("setpriv".into()),
        None if which("capsh").is_some() => Some("capsh".into()),
        None => None,
    };
    match tool.as_deref() {
        Some("setpriv") => {
            let keep: String = caps
                .iter()
                .map(|c| format!(",+{}", c.to_lowercase()))
                .collect();
            let mut c = Command::new("setpriv");
            c.args([
                "--no-new-privs",
                "--inh-caps=-all",
                "--ambient-caps=-all",
                &format!("--bounding-set=-all{keep}"),
                "--",
            ])
            .arg(program);
            c
        }
        Some("capsh") => {
            // capsh drops from the bounding set by number; root's exec then keeps only
            // what is left. It has no no-new-privs switch in every version: not set here.
            let last: u32 = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
                .unwrap()
                .trim()
                .parse()
                .unwrap();
            let keep = cap_mask(caps);
            let drop: Vec<String> = (0..=last)
                .filter(|n| keep & (1 << n) == 0)
                .map(|n| n.to_string())
                .collect();
            eprintln!("NOTE: setpriv not used: capsh reduces the capabilities (no no_new_privs)");
            let mut c = Command::new("capsh");
            c.arg("--inh=")
                .arg(format!("--drop={}", drop.join(",")))
                .args(["--", "-c", "exec \"$0\" \"$@\""])
                .arg(program);
            c
        }
        other => panic!(
            "cannot reduce the agent's capabilities on this host: neither setpriv \
             (util-linux) nor capsh (libcap2-bin) is installed{}; install one of them. \
             Nothing was checked.",
            other
                .map(|t| format!(" (COLOC_E2E_CAPS_TOOL={t})"))
                .unwrap_or_default()
        ),
    }
}

/// Reads `Cap*` and `NoNewPrivs` from `/proc/<pid>/status`.
fn status_field(pid: u32, field: &str) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .map(|v| v.trim().to_string())
}

fn status_hex(pid: u32, field: &str) -> u64 {
    u64::from_str_radix(&status_field(pid, field).unwrap_or_default(), 16)
        .unwrap_or_else(|e| panic!("{field} of pid {pid}: {e}"))
}

/// Starts the real agent (same arguments as the harness's) with only `caps`; waits until
/// it has executed and checks its capability sets; does not wait for readiness.
fn start_agent(sim: &Sim, caps: &[String], args: &[&str], env: &[(&str, &OsStr)]) -> Agent {
    // Removed if this fails before the agent takes it over (as its scratch).
    let dir = TempPath::dir("coloc-e2e-priv");
    let state_dir = PathBuf::from("/dev/shm").join(unique("coloc-e2e-priv-state"));
    let port = free_port();
    let log = dir.join("agent.log");
    let doorbell_dir = PathBuf::from("/dev/shm").join(unique("coloc-e2e-priv-bells"));
    let agent_bin = bin("coloc-agent");
    let mut cmd = with_only_caps(caps, &agent_bin);
    cmd.arg("run")
        .arg("--nvml-lib")
        .arg(bin("libfake_nvml.so"))
        .arg("--state-dir")
        .arg(&state_dir)
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--cgroup-root")
        .arg("/sys/fs/cgroup")
        .args(args)
        // As the chart sets it: a raised loop priority only with SYS_NICE.
        .env(
            "COLOC_LOOP_NICE",
            if caps.iter().any(|c| c == "SYS_NICE") {
                "-10"
            } else {
                "0"
            },
        )
        .stderr(std::fs::File::create(&log).unwrap());
    test_agent_env(&mut cmd, sim, &doorbell_dir);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = cmd.spawn().expect("start coloc-agent under setpriv/capsh");
    let agent = Agent {
        child: Some(child),
        port,
        scratch: vec![dir.keep(), state_dir.clone()],
        state_dir,
        doorbell_dir,
        log,
    };
    let pid = agent.child.as_ref().unwrap().id();
    wait_for("the agent executed", Duration::from_secs(5), || {
        std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|e| e == agent_bin)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log_text()));
    let want = cap_mask(caps);
    let (eff, prm, bnd, inh, amb) = (
        status_hex(pid, "CapEff"),
        status_hex(pid, "CapPrm"),
        status_hex(pid, "CapBnd"),
        status_hex(pid, "CapInh"),
        status_hex(pid, "CapAmb"),
    );
    eprintln!(
        "agent pid {pid} (uid {:?}): CapEff {eff:016x} CapPrm {prm:016x} CapBnd {bnd:016x} \
         CapInh {inh:016x} CapAmb {amb:016x} NoNewPrivs {:?}; wanted {caps:?} = {want:016x}",
        status_field(pid, "Uid"),
        status_field(pid, "NoNewPrivs")
    );
    assert!(
        status_field(pid, "Uid").is_some_and(|u| u.split_whitespace().all(|x| x == "0")),
        "the agent must run as uid 0, as in the DaemonSet"
    );
    assert_eq!(
        (eff, prm, bnd, inh, amb),
        (want, want, want, 0, 0),
        "the agent's capability sets are not exactly {caps:?}"
    );
    agent
}

fn wait_ready(agent: &Agent) {
    wait_for("agent ready", Duration::from_secs(15), || {
        http_get(agent.port, "/readyz").is_ok_and(|r| r.0 == 200)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log_text()));
}

/// A rules file `rules.toml` with `text`, in a directory of its own: the directory
/// (removed when dropped) and the file.
fn write_rules(text: &str) -> (TempPath, PathBuf) {
    let dir = TempPath::dir("coloc-e2e-priv-rules");
    let p = dir.join("rules.toml");
    std::fs::write(&p, text).unwrap();
    (dir, p)
}

/// A simulated GPU whose state the other user's workloads can open too.
fn shared_sim() -> Sim {
    let sim = Sim::start(1, &[]);
    std::fs::set_permissions(&sim.state, std::fs::Permissions::from_mode(0o666)).unwrap();
    sim
}

/// Spawns a `coloc-sim` workload as uid/gid 65534 with no supplementary groups, first
/// joining cgroup `cg` (as root, before dropping to that user), so it is never seen
/// anywhere else.
fn spawn_as_nobody(sim: &Sim, cg: Option<&TestCgroup>, args: &[&str]) -> Proc {
    let mut c = sim.cmd(args);
    c.stdout(Stdio::null()).stderr(Stdio::null());
    let procs = cg.map(|cg| {
        let f = if cg.dir.join("cgroup.procs").exists() {
            "cgroup.procs"
        } else {
            "tasks"
        };
        CString::new(cg.dir.join(f).as_os_str().as_bytes()).unwrap()
    });
    // SAFETY: only async-signal-safe calls (open, write, close, setgroups, setgid,
    // setuid) between fork and exec; "0" written to cgroup.procs moves the writer itself.
    unsafe {
        c.pre_exec(move || {
            if let Some(p) = &procs {
                let fd = libc::open(p.as_ptr(), libc::O_WRONLY);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let n = libc::write(fd, b"0".as_ptr().cast(), 1);
                let err = std::io::Error::last_os_error();
                libc::close(fd);
                if n != 1 {
                    return Err(err);
                }
            }
            if libc::setgroups(0, std::ptr::null()) != 0
                || libc::setgid(NOBODY) != 0
                || libc::setuid(NOBODY) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let p = Proc(c.spawn().expect("spawn workload as uid 65534"));
    let pid = p.pid();
    wait_for("workload running as uid 65534", SOON, || {
        status_field(pid, "Uid").is_some_and(|u| u.split_whitespace().all(|x| x == "65534"))
    })
    .unwrap();
    p
}

fn offline_args(tag: &str) -> Vec<&str> {
    vec!["offline", "--gpu", "0", "--step-ms", "2", "--tag", tag]
}

/// An online workload: 400 ms of GPU work, then idle but alive.
fn online_args() -> Vec<&'static str> {
    vec![
        "busy", "--gpu", "0", "--ms", "400", "--repeat", "2", "--gap-ms", "600000",
    ]
}

/// Offline runs while the GPU has no online work; online work suspends it soon; it stays
/// suspended while online works, and runs again once online has been idle for the
/// window; the latency histograms count the cycle under `actuator`.
fn preempt_and_release(
    agent: &Agent,
    online: impl FnOnce() -> Proc,
    suspended: impl Fn() -> bool,
    actuator: &str,
) {
    holds_for(
        "offline running with no online work",
        Duration::from_millis(300),
        || !suspended(),
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log_text()));
    let _online = online();
    let took = wait_for("offline suspended", SOON, &suspended)
        .unwrap_or_else(|e| panic!("{e}\n{}", agent.log_text()));
    holds_for(
        "offline suspended while online works",
        Duration::from_millis(150),
        &suspended,
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log_text()));
    let back = wait_for("offline released", Duration::from_secs(5), || !suspended())
        .unwrap_or_else(|e| panic!("{e}\n{}", agent.log_text()));
    eprintln!(
        "{actuator}: offline suspended {took:?} after online started, released {:?} later \
         (online: 400 ms of work, then the 100 ms idle window)",
        back + Duration::from_millis(150)
    );
    let labels = ["gpu=\"0\"".to_string(), format!("actuator=\"{actuator}\"")];
    let labels: Vec<&str> = labels.iter().map(String::as_str).collect();
    wait_for("latency histograms count the cycle", SOON, || {
        let m = agent.metrics();
        metric(&m, "coloc_preemption_latency_seconds_count", &labels) >= 1.0
            && metric(&m, "coloc_release_latency_seconds_count", &labels) >= 1.0
    })
    .unwrap_or_else(|e| panic!("{e}:\n{}", agent.metrics()));
}

/// `class` and `owner` of `pid` in the agent's `/state`, once it lists it.
fn seen_as(agent: &Agent, pid: u32) -> (String, String) {
    let mut found = None;
    wait_for("agent lists the process", SOON, || {
        found = agent.state()["gpus"][0]["processes"]
            .as_array()
            .and_then(|ps| ps.iter().find(|p| p["pid"] == pid).cloned());
        found.is_some()
    })
    .unwrap_or_else(|e| panic!("{e}\n{}\n{}", agent.state(), agent.log_text()));
    let p = found.unwrap();
    (
        p["class"].as_str().unwrap_or_default().to_string(),
        p["owner"].as_str().unwrap_or_default().to_string(),
    )
}

fn test_cgroup(test: &str, name: &str) -> TestCgroup {
    let cg = TestCgroup::try_v2(name).unwrap_or_else(|why| {
        eprintln!("NOTE: {test}: cgroup v2 freezer not usable ({why}): using the v1 freezer");
        TestCgroup::try_v1(name)
            .unwrap_or_else(|why1| panic!("a cgroup freezer is required: v2: {why}; v1: {why1}"))
    });
    eprintln!(
        "{test}: exercising the cgroup {} freezer at {}",
        cg.version,
        cg.dir.display()
    );
    cg
}

/// The file the freezer writes, checked to be owned by root and writable by its owner
/// only: the write succeeds through owner permission, not `DAC_OVERRIDE`.
fn assert_root_owned_control_file(cg: &TestCgroup) {
    let f = cg.dir.join(if cg.version == "v2" {
        "cgroup.freeze"
    } else {
        "freezer.state"
    });
    let md = std::fs::metadata(&f).unwrap();
    eprintln!(
        "{}: uid {} gid {} mode {:o}",
        f.display(),
        md.uid(),
        md.gid(),
        md.mode() & 0o7777
    );
    assert_eq!(md.uid(), 0, "{} is not owned by root", f.display());
    assert_eq!(
        md.mode() & 0o022,
        0,
        "{} is writable by group or others",
        f.display()
    );
}

#[test]
fn freezer_works_with_only_the_charts_capabilities() {
    let test = "freezer_works_with_only_the_charts_capabilities";
    let caps = chart_caps(&[], CHART_DEFAULT);
    assert!(!caps.iter().any(|c| c == "DAC_OVERRIDE"));
    let cg = test_cgroup(test, &unique("coloc-e2e-priv-frz"));
    assert_root_owned_control_file(&cg);
    let sim = shared_sim();
    let (_rules_dir, rules) = write_rules(&format!(
        "[[rule]]\nname = \"off\"\nclass = \"reclaimed_cores\"\ncgroup = \"{}\"\n",
        cg.path
    ));
    let agent = start_agent(
        &sim,
        &caps,
        &["--rules", rules.to_str().unwrap(), "--actuator", "freezer"],
        &[],
    );
    wait_ready(&agent);
    let off = spawn_as_nobody(&sim, Some(&cg), &offline_args("priv-frz"));
    assert_eq!(seen_as(&agent, off.pid()).0, "offline");
    preempt_and_release(
        &agent,
        || spawn_as_nobody(&sim, None, &online_args()),
        || cg.frozen(),
        "freezer",
    );
    assert_no_permission_error(&agent);
}

/// Nothing the agent did was refused: no actuation error counted, none logged.
fn assert_no_permission_error(agent: &Agent) {
    let m = agent.metrics();
    assert_eq!(
        metric(&m, "coloc_actuation_errors_total", &[]),
        0.0,
        "actuation errors:\n{m}\n{}",
        agent.log_text()
    );
    let log = agent.log_text();
    assert!(
        !log.contains("Permission denied") && !log.contains("Operation not permitted"),
        "{log}"
    );
}

#[test]
fn signal_to_another_user_needs_kill_and_nothing_else() {
    let caps = chart_caps(&[], CHART_DEFAULT);
    let sim = shared_sim();
    let (_rules_dir, rules) = write_rules(
        "[[rule]]\nname = \"off\"\nclass = \"reclaimed_cores\"\ncmdline = \"*--tag priv-sig*\"\n",
    );
    let run_args = ["--rules", rules.to_str().unwrap(), "--actuator", "signal"];
    let off = spawn_as_nobody(&sim, None, &offline_args("priv-sig"));

    // Control: with no capability at all, the agent cannot stop another user's process.
    {
        let agent = start_agent(&sim, &[], &run_args, &[]);
        wait_ready(&agent);
        assert_eq!(
            seen_as(&agent, off.pid()),
            ("offline".into(), "rule:off".into())
        );
        let _online = spawn_as_nobody(&sim, None, &online_args());
        wait_for(
            "the agent tries to stop it and counts the failure",
            SOON,
            || {
                metric(
                    &agent.metrics(),
                    "coloc_actuation_errors_total",
                    &["actuator=\"signal\""],
                ) >= 1.0
            },
        )
        .unwrap_or_else(|e| panic!("{e}\n{}\n{}", agent.metrics(), agent.log_text()));
        holds_for(
            "another user's process is never stopped without KILL",
            Duration::from_millis(300),
            || off.state() != Some('T'),
        )
        .unwrap();
        eprintln!(
            "control: without KILL the agent cannot stop uid {NOBODY}'s process (actuation errors counted)"
        );
    }
    // The online workload of the control is gone; let the GPU go idle before the cycle.
    std::thread::sleep(Duration::from_millis(200));

    let agent = start_agent(&sim, &caps, &run_args, &[]);
    wait_ready(&agent);
    assert_eq!(
        seen_as(&agent, off.pid()),
        ("offline".into(), "rule:off".into()),
        "a cmdline rule matches without SYS_PTRACE"
    );
    preempt_and_release(
        &agent,
        || spawn_as_nobody(&sim, None, &online_args()),
        || off.state() == Some('T'),
        "signal",
    );
    assert_no_permission_error(&agent);
}

#[test]
fn exe_rules_need_sys_ptrace_for_other_users() {
    let sim = shared_sim();
    let sim_bin = bin("coloc-sim");
    let (_rules_dir, rules) = write_rules(&format!(
        "unmatched = \"unmanaged\"\n[[rule]]\nname = \"by-exe\"\nclass = \"reclaimed_cores\"\nexe = \"{}\"\n",
        sim_bin.display()
    ));
    let run_args = ["--rules", rules.to_str().unwrap(), "--actuator", "signal"];
    let off = spawn_as_nobody(&sim, None, &offline_args("priv-exe"));

    // The chart's default: /proc/<pid>/exe of another user's process cannot be read, the
    // process has no executable, and the exe rule does not match it (unmanaged).
    {
        let agent = start_agent(&sim, &chart_caps(&[], CHART_DEFAULT), &run_args, &[]);
        wait_ready(&agent);
        let seen = seen_as(&agent, off.pid());
        eprintln!("without SYS_PTRACE, exe rule: uid {NOBODY}'s process is {seen:?}");
        assert_eq!(
            seen.0, "unmanaged",
            "an exe rule matched without SYS_PTRACE"
        );
    }
    // agent.sysPtrace=true: the exe is read and the rule matches.
    let caps = chart_caps(&["agent.sysPtrace=true"], CHART_SYS_PTRACE);
    let agent = start_agent(&sim, &caps, &run_args, &[]);
    wait_ready(&agent);
    let seen = seen_as(&agent, off.pid());
    eprintln!("with SYS_PTRACE, exe rule: uid {NOBODY}'s process is {seen:?}");
    assert_eq!(seen, ("offline".into(), "rule:by-exe".into()));
}

fn kube_cgroup(base: &TestCgroup, tier: &str, uid: &str, cid: &str) -> TestCgroup {
    let rel = format!(
        "{}/kubepods/{tier}/pod{uid}/{cid}",
        base.path.trim_start_matches('/')
    );
    match base.version {
        "v2" => TestCgroup::v2(&rel),
        _ => TestCgroup::v1(&rel),
    }
    .expect("nested cgroup")
}

#[test]
fn kubernetes_mode_needs_no_sys_ptrace() {
    let test = "kubernetes_mode_needs_no_sys_ptrace";
    let caps = chart_caps(&[], CHART_DEFAULT);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(FakeApi::start());
    let off_uid = "12121212-3434-5656-7878-909090909090";
    let on_uid = "abababab-cdcd-efef-0101-232323232323";
    api.apply(pod(off_uid, "trainer", "node1", Some("reclaimed_cores")));
    api.apply(pod(on_uid, "server", "node1", None));

    let base = test_cgroup(test, &unique("coloc-e2e-priv-kube"));
    let off_cg = kube_cgroup(&base, "besteffort", off_uid, "cri-containerd-0ff.scope");
    let on_cg = kube_cgroup(&base, "burstable", on_uid, "cri-containerd-0a.scope");
    assert_root_owned_control_file(&off_cg);

    let sim = shared_sim();
    let dir = TempPath::dir("coloc-e2e-priv-kubecfg");
    let kubeconfig = api.kubeconfig(&dir);
    let mut agent = start_agent(
        &sim,
        &caps,
        &["--node-name", "node1", "--actuator", "freezer"],
        &[("KUBECONFIG", kubeconfig.as_os_str())],
    );
    wait_ready(&agent);

    let off = spawn_as_nobody(&sim, Some(&off_cg), &offline_args("priv-kube"));
    assert_eq!(
        seen_as(&agent, off.pid()),
        ("offline".into(), "ml/trainer".into()),
        "classified by pod (cgroup -> pod UID) without SYS_PTRACE"
    );
    preempt_and_release(
        &agent,
        || spawn_as_nobody(&sim, Some(&on_cg), &online_args()),
        || off_cg.frozen(),
        "freezer",
    );
    assert_no_permission_error(&agent);
    agent.signal(libc::SIGTERM);
    assert!(agent.wait().success(), "{}", agent.log_text());
    assert!(!off_cg.frozen(), "SIGTERM resumes everything");
    drop(off);
    drop((on_cg, off_cg));
    for d in [
        format!("kubepods/besteffort/pod{off_uid}"),
        format!("kubepods/burstable/pod{on_uid}"),
        "kubepods/besteffort".into(),
        "kubepods/burstable".into(),
        "kubepods".into(),
    ] {
        let _ = std::fs::remove_dir(base.dir.join(d));
    }
}
