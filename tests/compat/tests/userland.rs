//! The shim as images ship it, inside an old userland made from Debian's packages
//! (bullseye: glibc 2.31, the oldest Debian release its archive still serves), through
//! the fake driver (same glibc floor) and a C driver-API program: the doorbell rings and
//! the gate holds. And where the shim cannot work (musl, static programs, a library that
//! cannot be loaded), the process runs on.

use coloc_compat::*;
use coloc_e2e::{MappedPage, Sim};
use std::process::{Command, Stdio};
use std::time::Duration;

const SUITE: &str = "bullseye";

fn setup() -> Option<(Builds, std::path::PathBuf)> {
    let Some(b) = builds() else {
        eprintln!("NOTE: no Zig build: the old-userland tests are skipped (see floor.rs)");
        return None;
    };
    let root = userland(SUITE)?;
    Some((b, root))
}

/// The probe in the userland, the shim preloaded with `class`, on the simulated GPU.
fn probe(root: &std::path::Path, sim: &Sim, x: &Scratch, class: &str) -> Run {
    Run::new(root)
        .with_x(&x.0)
        .env(
            "LD_PRELOAD",
            "/t/x86_64-unknown-linux-gnu/release/libcoloc_cuda.so",
        )
        .env("LD_LIBRARY_PATH", "/t/compat/fake-cuda")
        .env("COLOC_SIM_STATE", &sim.state.display().to_string())
        .env("COLOC_SHIM_CLASS", class)
        .env("COLOC_DOORBELL_DIR", "/x/bells")
        .env("COLOC_GATE_FILE", "/x/gate/gates")
}

#[test]
fn under_glibc_2_31_the_shim_loads_and_the_doorbell_rings() {
    let Some((_b, root)) = setup() else { return };
    let sim = Sim::start(1, &[]);
    let x = Scratch::new("ring");
    std::fs::create_dir_all(x.0.join("bells")).unwrap();
    let mut p = Running::spawn(
        probe(&root, &sim, &x, "online").command("/t/compat/probe", &["launch", "5", "1000000"]),
        Stdio::inherit(),
    );
    p.wait_for("5 launches", Duration::from_secs(20), |l| {
        l.iter().any(|l| l == "launched 5")
    });
    let page = MappedPage::open(&page_in(&x.0.join("bells")));
    let mut r = Vec::new();
    page.page().read(&mut r);
    assert_eq!(r.len(), 1, "one GPU rung: {r:?}");
    assert_eq!(r[0].uuid, coloc_sim::gpu_uuid(0));
    assert!(r[0].last_launch_ns > 0 && page.page().wakes(r[0].index) >= 1);
    drop(page);
    let (status, _) = p.finish();
    assert!(status.success(), "{status}");
}

#[test]
fn under_glibc_2_31_the_gate_holds_and_opens() {
    let Some((_b, root)) = setup() else { return };
    let sim = Sim::start(1, &[]);
    let x = Scratch::new("gate");
    std::fs::create_dir_all(x.0.join("bells")).unwrap();
    let agent = GateAgent::start(&x.0.join("gate/gates"));
    let mut p = Running::spawn(
        probe(&root, &sim, &x, "offline").command("/t/compat/probe", &["launch", "0", "1000000"]),
        Stdio::inherit(),
    );
    p.wait_for("5 launches", Duration::from_secs(20), |l| l.len() >= 5);
    let page = MappedPage::open(&page_in(&x.0.join("bells")));
    agent.holds_and_opens(&mut p, &page);
}

/// Why the images ship the Zig build: the host's build of the shim needs this
/// machine's glibc, and a process in the old userland with it preloaded does not start.
#[test]
fn under_glibc_2_31_a_build_against_a_newer_glibc_stops_the_process() {
    let Some((_b, root)) = setup() else { return };
    let host = coloc_e2e::bin("libcoloc_cuda.so");
    let newest = *glibc_versions(&host).last().unwrap();
    if (newest.0, newest.1) <= (2, 31) {
        eprintln!(
            "NOTE: this machine's build needs only GLIBC_{}.{}: nothing to show",
            newest.0, newest.1
        );
        return;
    }
    let inner = format!("/t/{}", host.strip_prefix(target_dir()).unwrap().display());
    let out = Run::new(&root)
        .env("LD_PRELOAD", &inner)
        .env("LD_LIBRARY_PATH", "/t/compat/fake-cuda")
        .command("/t/compat/probe", &["dlopen"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("not found"), "{err}");
    // The shipped build, the same way: runs.
    let out = Run::new(&root)
        .env(
            "LD_PRELOAD",
            "/t/x86_64-unknown-linux-gnu/release/libcoloc_cuda.so",
        )
        .env("LD_LIBRARY_PATH", "/t/compat/fake-cuda")
        .command("/t/compat/probe", &["dlopen"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "dlopen ok");
}

/// A program compiled by Zig for `target` (musl: static unless `dynamic`).
fn zig_program(x: &Scratch, name: &str, target: &str, dynamic: bool) -> Option<std::path::PathBuf> {
    let src = x.0.join(format!("{name}.c"));
    std::fs::write(
        &src,
        "#include <dlfcn.h>\n#include <stdio.h>\nint main(void){void *h = dlopen(\"libc.so\", RTLD_NOW);\n\
         void *p = dlsym(h ? h : RTLD_DEFAULT, \"printf\");\nprintf(\"ran %d\\n\", p != 0);\nreturn 0;}\n",
    )
    .unwrap();
    let exe = x.0.join(name);
    let mut c = Command::new("python3");
    c.args(["-m", "ziglang", "cc", "-target", target, "-o"])
        .arg(&exe)
        .arg(&src);
    if dynamic {
        c.arg("-dynamic");
    }
    c.status().ok()?.success().then_some(exe)
}

#[test]
fn where_the_shim_cannot_work_the_process_runs_on() {
    let Some(b) = builds() else {
        eprintln!("NOTE: no Zig build: nothing to preload here");
        return;
    };
    let x = Scratch::new("cannot");
    let run = |prog: &std::path::Path, preload: &std::path::Path| {
        let out = Command::new(prog)
            .env("LD_PRELOAD", preload)
            .env("COLOC_SHIM_CLASS", "offline")
            .env("COLOC_DOORBELL_DIR", &x.0)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        (
            out.status,
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // A static program: the dynamic loader never runs; LD_PRELOAD means nothing.
    let stat = zig_program(&x, "static-musl", "x86_64-linux-musl", false).expect("zig cc");
    let (s, out, _) = run(&stat, &b.shim);
    assert!(s.success() && out.starts_with("ran"), "static: {s} {out}");
    // A musl program: musl's loader loads the shim (its libc.so.6 and libdl.so.2 are
    // musl itself), which finds no glibc and passes dlsym through.
    if std::path::Path::new("/lib/ld-musl-x86_64.so.1").exists() {
        let dynm = zig_program(&x, "dynamic-musl", "x86_64-linux-musl", true).expect("zig cc");
        let (s, out, err) = run(&dynm, &b.shim);
        assert!(s.success(), "musl: {s} {out} {err}");
        assert_eq!(
            out.trim(),
            "ran 1",
            "dlsym works under the shim in a musl process: {err}"
        );
    } else {
        eprintln!("NOTE: no musl loader (apt-get install musl): the musl case is not run");
    }
    // A shim that cannot be loaded (missing, not an ELF file): one line from ld.so, and
    // the program runs.
    for bad in [
        x.0.join("missing.so"),
        std::path::PathBuf::from("/etc/hostname"),
    ] {
        let (s, out, err) = run(
            &stat
                .with_file_name("no-such-program")
                .with_file_name("static-musl"),
            &bad,
        );
        assert!(s.success() && out.starts_with("ran"), "{s} {out}");
        let _ = err;
        let (s, _, err) = run(std::path::Path::new("/bin/true"), &bad);
        assert!(
            s.success() && err.contains("cannot be preloaded"),
            "{s} {err}"
        );
    }
}
