//! `coloc-sim nvml ...` sets the same switches as the `SimGpu` methods.

use coloc_sim::{NvmlFunc, SimGpu};
use std::process::{Command, Output};

fn run(state: &std::path::Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_coloc-sim"))
        .arg("--state")
        .arg(state)
        .arg("nvml")
        .args(args)
        .output()
        .unwrap()
}

fn ok(state: &std::path::Path, args: &[&str]) -> String {
    let o = run(state, args);
    assert!(
        o.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

#[test]
fn nvml_subcommand_drives_the_switches() {
    // Removed when dropped, passing or failing.
    let p = tempfile::Builder::new()
        .prefix("coloc-sim-nvml-cli-")
        .tempfile()
        .unwrap()
        .into_temp_path();
    let sim = SimGpu::create(&p, 2, 1_000_000).unwrap();
    let util = NvmlFunc::DeviceGetProcessUtilization;

    ok(
        &p,
        &[
            "inject",
            "utilization",
            "--code",
            "INSUFFICIENT_SIZE",
            "--data-call",
            "--count",
            "2",
        ],
    );
    ok(
        &p,
        &["inject", "nvmlDeviceGetUUID", "--gpu", "1", "--code", "15"],
    );
    let st = sim.nvml_status();
    let inj = &st.functions[util as usize].injections;
    assert_eq!(inj.len(), 1);
    assert_eq!(
        (inj[0].code, inj[0].left, inj[0].data_call_only, inj[0].gpu),
        (7, Some(2), true, None)
    );
    let inj = &st.functions[NvmlFunc::DeviceGetUUID as usize].injections;
    assert_eq!((inj[0].code, inj[0].left, inj[0].gpu), (15, None, Some(1)));
    assert_eq!(sim.nvml_enter(util, Some(0), false).fault, None);
    assert_eq!(sim.nvml_enter(util, Some(0), true).fault, Some(7));

    ok(&p, &["delay", "processes", "--ms", "2.5"]);
    ok(&p, &["hang", "5"]);
    ok(&p, &["gone"]);
    let json: serde_json::Value = serde_json::from_str(&ok(&p, &["status"])).unwrap();
    assert_eq!(json["gone"], 9);
    assert_eq!(json["functions"][5]["delay_us"], 2500);
    assert_eq!(json["functions"][5]["hang"], true);
    assert_eq!(json["functions"][6]["calls"], 2);
    ok(&p, &["gone", "--off"]);
    assert_eq!(sim.nvml_status().gone, None);
    ok(&p, &["gone", "--code", "LIBRARY_NOT_FOUND"]);
    assert_eq!(sim.nvml_status().gone, Some(12));

    // wait-hung: fails while nothing is blocked, succeeds once a call is.
    let o = run(&p, &["wait-hung", "processes", "--timeout-s", "0.1"]);
    assert!(!o.status.success());
    let t = std::thread::spawn({
        let p = p.to_path_buf();
        move || {
            let sim = SimGpu::open(&p).unwrap();
            let fault = sim
                .nvml_enter(NvmlFunc::DeviceGetComputeRunningProcesses, Some(0), false)
                .fault;
            fault
        }
    });
    ok(&p, &["wait-hung", "processes", "--timeout-s", "10"]);
    ok(&p, &["hang", "processes", "--off"]);
    assert_eq!(t.join().unwrap(), Some(12), "released, then answers gone");

    ok(&p, &["uninject", "uuid"]);
    assert!(sim.nvml_status().functions[4].injections.is_empty());
    ok(&p, &["clear"]);
    let st = sim.nvml_status();
    assert_eq!(st.gone, None);
    assert!(st
        .functions
        .iter()
        .all(|f| f.injections.is_empty() && !f.hang && f.delay_us == 0));
    assert_eq!(st.functions[6].calls, 2, "counters are kept");

    // Mistakes are refused with a message.
    for bad in [
        &["inject", "nvmlDeviceGetFoo", "--code", "7"][..],
        &["inject", "uuid", "--code", "BOGUS"],
        &["inject", "uuid", "--code", "7", "--data-call"],
        &["inject", "count", "--gpu", "0", "--code", "7"],
        &["inject", "uuid", "--gpu", "2", "--code", "7"],
    ] {
        let o = run(&p, bad);
        assert!(!o.status.success(), "{bad:?} accepted");
        assert!(!o.stderr.is_empty());
    }
}
