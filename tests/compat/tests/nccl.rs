//! NCCL in front of the shim: NCCL reaches the driver through a CUDA runtime of its own
//! (linked into `libnccl.so.2`, from NVIDIA's PyPI wheel `nvidia-nccl-cu12`; scripts/test-all
//! installs it). A program that asks NCCL for a communicator runs under the shim
//! (`COLOC_SHIM_TRACE=1`) on the fake driver: the driver's getter comes back wrapped, and
//! every submission entry point and synchronising call NCCL looks up comes back wrapped;
//! nothing else is. Without a real driver NCCL stops after it has loaded its table (the
//! line printed says where); what it looks up is what the fake driver has.

use coloc_compat::*;
use coloc_e2e::Sim;
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// The wheel's library directory (`None` when it is not installed).
fn wheel_lib() -> Option<PathBuf> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import nvidia.nccl as m, os; print(os.path.join(list(m.__path__)[0], 'lib'))",
        ])
        .output()
        .ok()?;
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    (out.status.success() && dir.join("libnccl.so.2").exists()).then_some(dir)
}

#[test]
fn every_submission_and_synchronising_entry_point_nccl_looks_up_comes_back_wrapped() {
    let Some(lib) = wheel_lib() else {
        eprintln!(
            "NOTE: NVIDIA's NCCL wheel is not installed (pip install nvidia-nccl-cu12): NCCL is \
             not run; the CUDA runtime's test (cudart.rs) checks the same path"
        );
        return;
    };
    let sim = Sim::start(1, &[]);
    let x = Scratch::new("nccl");
    let exe = x.0.join("nccl");
    let cc = Command::new("cc")
        .arg("-o")
        .arg(&exe)
        .arg(repo().join("tests/compat/c/nccl.c"))
        .arg(lib.join("libnccl.so.2"))
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .status()
        .expect("cc");
    assert!(cc.success());
    let out = Command::new(&exe)
        .env("LD_PRELOAD", coloc_e2e::bin("libcoloc_cuda.so"))
        .env("LD_LIBRARY_PATH", coloc_e2e::fake_cuda())
        .env("COLOC_SIM_STATE", &sim.state)
        .env("COLOC_SHIM_CLASS", "online")
        .env("COLOC_DOORBELL_DIR", &x.0)
        .env("COLOC_SHIM_TRACE", "1")
        .env("NCCL_DEBUG", "WARN")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    let said = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(out.status.success(), "{said}\n{stderr}");
    let reqs: Vec<(String, String, bool)> = stderr
        .lines()
        .filter_map(|l| l.strip_prefix("libcoloc_cuda: trace: "))
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            Some((
                w.first()?.to_string(),
                w.get(1)?.to_string(),
                *w.get(4)? == "wrapped",
            ))
        })
        .collect();
    assert!(
        reqs.iter().any(|(via, name, wrapped)| via == "dlsym"
            && name.starts_with("cuGetProcAddress")
            && *wrapped),
        "NCCL's runtime did not get the wrapped getter: {said}\n{stderr}"
    );
    let subs: Vec<_> = reqs.iter().filter(|(_, n, _)| submits(n)).collect();
    for (via, name, wrapped) in &subs {
        assert!(
            *wrapped,
            "a submission entry point passed unwrapped: {via} {name}"
        );
    }
    let syncs: Vec<_> = reqs.iter().filter(|(_, n, _)| watched(n)).collect();
    for (via, name, wrapped) in &syncs {
        assert!(
            *wrapped,
            "a watched entry point passed unwrapped: {via} {name}"
        );
    }
    for (via, name, wrapped) in reqs
        .iter()
        .filter(|(_, n, _)| !submits(n) && !watched(n) && !n.starts_with("cuGetProcAddress"))
    {
        assert!(!wrapped, "{via} {name} is neither submission nor watched");
    }
    assert!(
        subs.iter().any(|(_, n, _)| n == "cuLaunchKernel"),
        "NCCL looked up no kernel launch: {reqs:?}"
    );
    let mut sync_names: Vec<&str> = syncs.iter().map(|(_, n, _)| n.as_str()).collect();
    sync_names.dedup();
    eprintln!(
        "NCCL: {} lookups answered by the driver, {} of submission entry points, all wrapped; \
         watched, all wrapped: {}; it says: {said}",
        reqs.len(),
        subs.len(),
        sync_names.join(" ")
    );
}
