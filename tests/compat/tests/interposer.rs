//! The shim beside another interposer that hooks `dlsym` and `cuGetProcAddress` the way
//! HAMi-core does (`tests/compat/c/standin.c`: finds "the real dlsym" with
//! `dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5")`, answers its own hooks, refuses
//! `cuMemAlloc_v2` over `CUDA_DEVICE_MEMORY_LIMIT`), in both load orders: the shim in
//! `LD_PRELOAD` and the stand-in in `/etc/ld.so.preload` (where HAMi's device plugin puts
//! HAMi-core), and the reverse. `/etc/ld.so.preload` is the old userland's, bound over in
//! the run's own mount namespace.
//!
//! In both orders: the stand-in sees every lookup the program makes (driver and NVML
//! names through `dlsym`, every entry point through the getter) and every launch, its
//! memory limit refuses an allocation over it, the shim wraps the launch entry point, the
//! doorbell rings (online) and the gate holds and opens (offline).

use coloc_compat::*;
use coloc_e2e::{MappedPage, Sim};
use std::process::Stdio;
use std::time::Duration;

const SHIM: &str = "/t/x86_64-unknown-linux-gnu/release/libcoloc_cuda.so";
const STANDIN: &str = "/t/compat/libstandin.so";

#[derive(Debug, Clone, Copy)]
enum Order {
    /// The shim in `LD_PRELOAD`, the stand-in in `/etc/ld.so.preload` (loaded after).
    ShimFirst,
    /// The stand-in in `LD_PRELOAD`, the shim in `/etc/ld.so.preload`.
    StandinFirst,
}

struct Node {
    root: std::path::PathBuf,
    sim: Sim,
    x: Scratch,
}

impl Node {
    fn new() -> Option<Node> {
        if builds().is_none() {
            eprintln!("NOTE: no Zig build: the interposer tests are skipped (see floor.rs)");
            return None;
        }
        let root = userland("bullseye")?;
        let x = Scratch::new("interposer");
        std::fs::create_dir_all(x.0.join("bells")).unwrap();
        Some(Node {
            root,
            sim: Sim::start(1, &[]),
            x,
        })
    }

    fn run(&self, order: Order, class: &str) -> Run {
        let (pre, etc) = match order {
            Order::ShimFirst => (SHIM, STANDIN),
            Order::StandinFirst => (STANDIN, SHIM),
        };
        let _ = std::fs::remove_file(self.x.0.join("standin.log"));
        Run::new(&self.root)
            .with_x(&self.x.0)
            .etc_preload(&self.x.0, &[etc])
            .env("LD_PRELOAD", pre)
            .env("LD_LIBRARY_PATH", "/t/compat/fake-cuda")
            .env("COLOC_SIM_STATE", &self.sim.state.display().to_string())
            .env("COLOC_SHIM_CLASS", class)
            .env("COLOC_DOORBELL_DIR", "/x/bells")
            .env("COLOC_GATE_FILE", "/x/gate/gates")
            .env("COLOC_SHIM_TRACE", "1")
            .env("STANDIN_LOG", "/x/standin.log")
            .env("CUDA_DEVICE_MEMORY_LIMIT", "1000000")
    }

    fn standin_log(&self) -> String {
        std::fs::read_to_string(self.x.0.join("standin.log")).unwrap_or_default()
    }

    fn stderr(&self) -> Stdio {
        std::fs::File::create(self.x.0.join("stderr"))
            .unwrap()
            .into()
    }

    fn stderr_text(&self) -> String {
        std::fs::read_to_string(self.x.0.join("stderr")).unwrap_or_default()
    }
}

fn both_see_every_lookup_and_the_doorbell_rings(order: Order) {
    let Some(n) = Node::new() else { return };
    let mut p = Running::spawn(
        n.run(order, "online")
            .command("/t/compat/probe", &["launch", "3", "1000000"]),
        n.stderr(),
    );
    p.wait_for("3 launches", Duration::from_secs(20), |l| {
        l.iter().any(|l| l == "launched 3")
    });
    let page = MappedPage::open(&page_in(&n.x.0.join("bells")));
    let mut r = Vec::new();
    page.page().read(&mut r);
    assert!(
        r.len() == 1 && r[0].last_launch_ns > 0,
        "{order:?}: the doorbell rang: {r:?}"
    );
    drop(page);
    let (status, _) = p.finish();
    assert!(status.success(), "{order:?}: {status}; {}", n.stderr_text());
    let log = n.standin_log();
    for seen in [
        "dlsym cuGetProcAddress_v2",
        "dlsym cuDriverGetVersion",
        "dlsym nvmlInit_v2",
        "getter cuInit",
        "getter cuCtxCreate",
        "getter cuLaunchKernel",
        "launches 3",
    ] {
        assert!(
            log.lines().any(|l| l == seen),
            "{order:?}: the stand-in did not see `{seen}`:\n{log}"
        );
    }
    let err = n.stderr_text();
    assert!(
        err.lines()
            .any(|l| l.contains(" cuLaunchKernel ") && l.ends_with(" wrapped")),
        "{order:?}: the shim did not wrap cuLaunchKernel:\n{err}"
    );
}

fn the_memory_limit_still_refuses(order: Order) {
    let Some(n) = Node::new() else { return };
    for (bytes, want) in [("2000000", "alloc 2"), ("1000", "alloc 0")] {
        let out = n
            .run(order, "online")
            .command("/t/compat/probe", &["alloc", bytes])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.trim() == want,
            "{order:?}: cuMemAlloc_v2({bytes}) under a 1000000-byte limit: {text} {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert!(n.standin_log().lines().any(|l| l == "getter cuMemAlloc"));
}

fn the_gate_holds_and_opens(order: Order) {
    let Some(n) = Node::new() else { return };
    let agent = GateAgent::start(&n.x.0.join("gate/gates"));
    let mut p = Running::spawn(
        n.run(order, "offline")
            .command("/t/compat/probe", &["launch", "0", "1000000"]),
        n.stderr(),
    );
    p.wait_for("5 launches", Duration::from_secs(20), |l| l.len() >= 5);
    let page = MappedPage::open(&page_in(&n.x.0.join("bells")));
    agent.holds_and_opens(&mut p, &page);
    drop(p);
    assert!(n
        .standin_log()
        .lines()
        .any(|l| l == "getter cuLaunchKernel"));
}

#[test]
fn shim_first_both_see_every_lookup_and_the_doorbell_rings() {
    both_see_every_lookup_and_the_doorbell_rings(Order::ShimFirst);
}

#[test]
fn standin_first_both_see_every_lookup_and_the_doorbell_rings() {
    both_see_every_lookup_and_the_doorbell_rings(Order::StandinFirst);
}

#[test]
fn shim_first_the_memory_limit_still_refuses() {
    the_memory_limit_still_refuses(Order::ShimFirst);
}

#[test]
fn standin_first_the_memory_limit_still_refuses() {
    the_memory_limit_still_refuses(Order::StandinFirst);
}

#[test]
fn shim_first_the_gate_holds_and_opens() {
    the_gate_holds_and_opens(Order::ShimFirst);
}

#[test]
fn standin_first_the_gate_holds_and_opens() {
    the_gate_holds_and_opens(Order::StandinFirst);
}
