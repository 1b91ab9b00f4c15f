//! The real CUDA runtime in front of the shim: a program linked against `libcudart` from
//! NVIDIA's PyPI wheels (`nvidia-cuda-runtime-cu12`, `-cu11`; scripts/test-all installs
//! them) runs under the shim (`COLOC_SHIM_TRACE=1`) on the fake driver. Every submission
//! entry point and every synchronising call the runtime looks up comes back wrapped, the
//! per-thread-default-stream variants (getter flag 2) too; everything else is passed.
//! Without a real driver the runtime stops after loading its table (the line printed says
//! where); what it looks up is what the fake driver has.

use coloc_compat::*;
use coloc_e2e::Sim;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The wheels' library directory (`None`, with a NOTE, when they are not installed).
fn wheel_lib() -> Option<PathBuf> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import nvidia.cuda_runtime as m, os; print(os.path.join(list(m.__path__)[0], 'lib'))",
        ])
        .output()
        .ok()?;
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    (out.status.success() && dir.is_dir()).then_some(dir)
}

/// One `libcoloc_cuda: trace: VIA NAME ver=V flags=F wrapped|passed` line.
#[derive(Debug)]
struct Request {
    via: String,
    name: String,
    flags: u64,
    wrapped: bool,
}

fn requests(stderr: &str) -> Vec<Request> {
    stderr
        .lines()
        .filter_map(|l| l.strip_prefix("libcoloc_cuda: trace: "))
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            let flags = w.get(3)?.strip_prefix("flags=0x")?;
            Some(Request {
                via: w.first()?.to_string(),
                name: w.get(1)?.to_string(),
                flags: u64::from_str_radix(flags, 16).ok()?,
                wrapped: *w.get(4)? == "wrapped",
            })
        })
        .collect()
}

fn run(lib: &Path, so: &str, x: &Scratch, sim: &Sim) -> Option<(String, Vec<Request>)> {
    let so = lib.join(so);
    if !so.exists() {
        eprintln!("NOTE: {} is not installed", so.display());
        return None;
    }
    let exe =
        x.0.join(format!("cudart-{}", so.file_name()?.to_string_lossy()));
    let cc = Command::new("cc")
        .arg("-o")
        .arg(&exe)
        .arg(repo().join("tests/compat/c/cudart.c"))
        .arg(&so)
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
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some((
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
        requests(&String::from_utf8_lossy(&out.stderr)),
    ))
}

#[test]
fn every_submission_and_synchronising_entry_point_the_runtime_looks_up_comes_back_wrapped() {
    let sim = Sim::start(1, &[]);
    let x = Scratch::new("cudart");
    let Some(lib) = wheel_lib() else {
        eprintln!(
            "NOTE: NVIDIA's CUDA runtime wheels are not installed (pip install \
             nvidia-cuda-runtime-cu12 nvidia-cuda-runtime-cu11): the real runtime is not run"
        );
        // What is checked without it: the getter's answers for a driver-API program.
        let out = Command::new(coloc_e2e::bin("coloc-sim"))
            .args([
                "online",
                "--gpu",
                "0",
                "--rate",
                "50",
                "--work-ms",
                "1",
                "--duration-s",
                "1",
                "--cuda",
            ])
            .env("LD_PRELOAD", coloc_e2e::bin("libcoloc_cuda.so"))
            .env("LD_LIBRARY_PATH", coloc_e2e::fake_cuda())
            .env("COLOC_SIM_STATE", &sim.state)
            .env("COLOC_SHIM_TRACE", "1")
            .stdout(Stdio::null())
            .output()
            .unwrap();
        let r = requests(&String::from_utf8_lossy(&out.stderr));
        assert!(
            r.iter().any(|q| q.name == "cuLaunchKernel" && q.wrapped),
            "{r:?}"
        );
        return;
    };
    let mut ran = 0;
    for so in ["libcudart.so.12", "libcudart.so.11.0"] {
        let Some((said, reqs)) = run(&lib, so, &x, &sim) else {
            continue;
        };
        ran += 1;
        let getter = reqs
            .iter()
            .find(|q| q.via == "dlsym" && q.name.starts_with("cuGetProcAddress"))
            .unwrap_or_else(|| panic!("{so}: the runtime's dlsym of the getter: {reqs:?}"));
        assert!(getter.wrapped, "{so}: {getter:?}");
        assert!(
            reqs.iter()
                .any(|q| q.via == "cuGetProcAddress" && q.name == "cuGetProcAddress" && q.wrapped),
            "{so}: the getter asked for itself comes back wrapped"
        );
        let subs: Vec<&Request> = reqs.iter().filter(|q| submits(&q.name)).collect();
        for q in &subs {
            assert!(
                q.wrapped,
                "{so}: a submission entry point passed unwrapped: {q:?}"
            );
        }
        let syncs: Vec<&Request> = reqs.iter().filter(|q| watched(&q.name)).collect();
        for q in &syncs {
            assert!(
                q.wrapped,
                "{so}: a watched entry point passed unwrapped: {q:?}"
            );
        }
        for q in reqs.iter().filter(|q| {
            !submits(&q.name) && !watched(&q.name) && !q.name.starts_with("cuGetProcAddress")
        }) {
            assert!(!q.wrapped, "{so}: {q:?} is neither submission nor watched");
        }
        // The synchronising calls a request ends with, in both stream semantics.
        for (must, flags) in [
            ("cuStreamSynchronize", 0),
            ("cuStreamSynchronize", 2),
            ("cuCtxSynchronize", 0),
            ("cuEventSynchronize", 0),
            ("cuEventRecord", 2),
            ("cuMemcpyDtoH", 0),
            ("cuMemcpyDtoH", 2),
        ] {
            assert!(
                syncs.iter().any(|q| q.name == must && q.flags == flags),
                "{so}: {must} (flags {flags}) was looked up and wrapped: {syncs:?}"
            );
        }
        let names: std::collections::BTreeSet<&str> =
            subs.iter().map(|q| q.name.as_str()).collect();
        let ptds: std::collections::BTreeSet<&str> = subs
            .iter()
            .filter(|q| q.flags & 2 != 0)
            .map(|q| q.name.as_str())
            .collect();
        for must in [
            "cuLaunchKernel",
            "cuLaunchKernelEx",
            "cuMemcpyHtoDAsync",
            "cuGraphLaunch",
        ] {
            assert!(
                names.contains(must),
                "{so}: {must} was looked up: {names:?}"
            );
        }
        assert!(
            ptds.contains("cuLaunchKernel"),
            "{so}: per-thread variants: {ptds:?}"
        );
        let sync_names: Vec<String> = syncs
            .iter()
            .map(|q| format!("{}{}", q.name, if q.flags & 2 != 0 { "(ptds)" } else { "" }))
            .collect();
        eprintln!(
            "{so}: {} lookups answered by the driver, {} of submission entry points ({} names, \
             {} also per-thread), all wrapped; watched, all wrapped: {}; the runtime says: \
             {said}",
            reqs.len(),
            subs.len(),
            names.len(),
            ptds.len(),
            sync_names.join(" ")
        );
    }
    assert!(ran > 0, "neither runtime is in {}", lib.display());
}
