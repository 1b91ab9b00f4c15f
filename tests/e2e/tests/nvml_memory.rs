//! The agent's NVML sampler reports a GPU's memory through the fake NVML library
//! (`nvmlDeviceGetMemoryInfo_v2`, and what each process holds), and a process the driver
//! has checkpointed holds none. Its own test binary: NVML is loaded once per process, and
//! finds the simulated GPU through the environment.

use coloc_agent::edges::gpu::{GpuSampler, Nvml};
use coloc_e2e::*;
use std::process::{Command, Stdio};
use std::time::Duration;

#[test]
fn memory_is_reported_per_gpu_and_per_process_and_a_checkpoint_frees_it() {
    let sim = Sim::start(
        1,
        &[
            "--memory-gib",
            "16",
            "--checkpoint-ms-per-gb",
            "5",
            "--restore-ms-per-gb",
            "5",
        ],
    );
    // The only test in this binary: nothing else reads the environment meanwhile.
    std::env::set_var("COLOC_SIM_STATE", &sim.state);
    let job = Proc(
        sim.cmd(&["offline", "--cuda", "--step-ms", "2", "--mem-mib", "4096"])
            .env("LD_LIBRARY_PATH", fake_cuda())
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let s = sim.open();
    wait_for("the job's memory", Duration::from_secs(10), || {
        s.mem_used(0) == 4 << 30
    })
    .unwrap();
    let mut nvml = Nvml::open(&bin("libfake_nvml.so").display().to_string(), &[]).unwrap();
    let m = nvml.memory(0).unwrap().expect("NVML reports memory");
    assert_eq!((m.total, m.free), (16 << 30, 12 << 30));
    assert_eq!(m.processes, [(job.pid(), 4 << 30)]);
    let out = output_within(
        Command::new(bin("coloc-bench"))
            .args([
                "--cuda-checkpoint",
                "lock,checkpoint",
                "--pid",
                &job.pid().to_string(),
            ])
            .args([
                "--cuda-lib",
                &fake_cuda().join("libcuda.so.1").display().to_string(),
            ])
            .env("COLOC_SIM_STATE", &sim.state),
        Duration::from_secs(20),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let m = nvml.memory(0).unwrap().unwrap();
    assert_eq!((m.free, m.processes.len()), (16 << 30, 0), "{m:?}");
}
