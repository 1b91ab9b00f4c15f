//! A process's doorbell page truncated under it (another process of its pod can write the
//! pod's directory) does not kill it: the shim's SIGBUS guard puts zeros where the page
//! was, says so once, and passes every call through; the launches go on. Online (every
//! launch rings the page) and offline with the gate in force (every submission writes
//! the page's gate fields). The host's build of the shim, the fake driver, a driver-API
//! program built here with the host's C compiler.

use coloc_compat::*;
use coloc_e2e::Sim;
use std::process::{Command, Stdio};
use std::time::Duration;

fn launches_go_on_after_the_page_is_truncated(class: &str) {
    let sim = Sim::start(1, &[]);
    let x = Scratch::new(&format!("truncate-{class}"));
    let bells = x.0.join("bells");
    std::fs::create_dir_all(&bells).unwrap();
    let probe = x.0.join("probe");
    let cc = Command::new("cc")
        .arg("-O1")
        .arg("-o")
        .arg(&probe)
        .arg(repo().join("tests/compat/c/probe.c"))
        .arg("-ldl")
        .status()
        .expect("cc");
    assert!(cc.success());
    let _agent = (class == "offline").then(|| GateAgent::start(&x.0.join("gate/gates")));
    let mut c = Command::new(&probe);
    c.args(["launch", "2000", "1000000"])
        .env("LD_PRELOAD", coloc_e2e::bin("libcoloc_cuda.so"))
        .env("LD_LIBRARY_PATH", coloc_e2e::fake_cuda())
        .env("COLOC_SIM_STATE", &sim.state)
        .env("COLOC_SHIM_CLASS", class)
        .env("COLOC_DOORBELL_DIR", &bells)
        .env("COLOC_GATE_FILE", x.0.join("gate/gates"));
    let stderr = std::fs::File::create(x.0.join("stderr")).unwrap();
    let mut p = Running::spawn(c, Stdio::from(stderr));
    p.wait_for("5 launches", Duration::from_secs(10), |l| l.len() >= 5);
    let page = page_in(&bells);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&page)
        .unwrap()
        .set_len(0)
        .unwrap();
    let n = p.launched();
    p.wait_for(
        "launches after the truncation",
        Duration::from_secs(10),
        |l| {
            l.iter()
                .rev()
                .find_map(|l| l.strip_prefix("launched ")?.parse::<u64>().ok())
                .is_some_and(|k| k > n + 50)
        },
    );
    let (status, _) = p.finish();
    let err = std::fs::read_to_string(x.0.join("stderr")).unwrap();
    assert!(status.success(), "{class}: {status}: {err}");
    assert!(
        err.contains("a file the shim maps was truncated"),
        "{class}: the rescue is said: {err}"
    );
}

#[test]
fn online_launches_go_on_after_the_page_is_truncated() {
    launches_go_on_after_the_page_is_truncated("online");
}

#[test]
fn gated_launches_go_on_after_the_page_is_truncated() {
    launches_go_on_after_the_page_is_truncated("offline");
}
