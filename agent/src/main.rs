//! `coloc-agent`: see `coloc-agent --help`.
use anyhow::{Context, Result};
use clap::Parser;
use coloc_agent::cli::{Cli, Command, LogFormat, RunArgs};
use coloc_agent::control::state::Shared;
use coloc_agent::control::{Edges, Loop};
use coloc_agent::edges::actuator::{self, dry_run::DryRun, Actuator, Host, Progress};
use coloc_agent::edges::deviceplugin::{self, SlotOwners};
use coloc_agent::edges::doorbell::{DirBells, Doorbells, Layout, NoBells};
use coloc_agent::edges::gate::{GateFile, GateKeeper};
use coloc_agent::edges::record::{FileRecord, MemRecord, RecordStore};
use coloc_agent::edges::source::{kube::KubeSource, PodSource, Rules};
use coloc_agent::edges::{clock::SystemClock, gpu, procfs::HostProc};
use coloc_agent::{http, sched, telemetry};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tracing::{error, info, warn};

fn main() {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    let result = match cli.cmd {
        Command::Run(args) => {
            match coloc_agent::cli::unknown_settings(std::env::vars().map(|(k, _)| k)).as_slice() {
                [] => run(args),
                unknown => {
                    eprintln!(
                    "error: {} {} no setting of coloc-agent (misspelt?); the settings are the flags' COLOC_* variables: coloc-agent run --help",
                    unknown.join(", "),
                    if unknown.len() == 1 { "is" } else { "are" }
                );
                    std::process::exit(2);
                }
            }
        }
        Command::CheckRules { file } => check_rules(&file),
        Command::Status(args) => coloc_agent::cmd::status::run(args),
        Command::Probe(args) => std::process::exit(coloc_agent::cmd::probe::run(&args)),
        Command::Resume(args) => coloc_agent::cmd::resume::run(args),
        Command::Exec(args) => coloc_agent::cmd::exec::run(args),
    };
    if let Err(err) = result {
        // One line: the error and its causes.
        eprintln!("coloc-agent: {err:#}");
        std::process::exit(1);
    }
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("COLOC_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    use std::io::IsTerminal;
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => b.init(),
        LogFormat::Json => b.json().init(),
    }
}

fn check_rules(file: &std::path::Path) -> Result<()> {
    let rules = Rules::load(file)?;
    println!("{}: {} rule(s), valid", file.display(), rules.rules().len());
    for r in rules.rules() {
        println!("  {:<20} -> {}", r.name, r.class);
    }
    Ok(())
}

/// Signals that end a process by default and can be caught: each one resumes all offline
/// work before the agent exits.
const TERMINATING: &[(i32, &str)] = &[
    (libc::SIGTERM, "SIGTERM"),
    (libc::SIGINT, "SIGINT"),
    (libc::SIGHUP, "SIGHUP"),
    (libc::SIGQUIT, "SIGQUIT"),
    (libc::SIGUSR1, "SIGUSR1"),
    (libc::SIGUSR2, "SIGUSR2"),
    (libc::SIGALRM, "SIGALRM"),
    (libc::SIGVTALRM, "SIGVTALRM"),
    (libc::SIGPROF, "SIGPROF"),
    (libc::SIGXCPU, "SIGXCPU"),
    (libc::SIGXFSZ, "SIGXFSZ"),
    (libc::SIGPWR, "SIGPWR"),
    (libc::SIGSTKFLT, "SIGSTKFLT"),
    (libc::SIGIO, "SIGIO"),
    (libc::SIGSYS, "SIGSYS"),
    (libc::SIGTRAP, "SIGTRAP"),
];

fn run(args: RunArgs) -> Result<()> {
    let prom = telemetry::install()?;
    // Fail-open first: whatever a previous run left suspended runs again before anything
    // else (the other flags, the rules file, the Kubernetes client, NVML) can fail.
    let record: Box<dyn RecordStore> = if args.dry_run {
        Box::new(MemRecord::default())
    } else {
        // Held until the agent exits: `coloc-agent resume` never acts behind its back.
        coloc_agent::cmd::resume::lock_for_agent(&args.state_dir)?;
        let (mut record, leftover) = FileRecord::open(&args.state_dir)?;
        if !leftover.is_empty() {
            warn!(count = leftover.len(), record = %record.path().display(), "Found work a previous run left suspended, or recorded as suspendable: resuming all of it");
            resume_leftovers(&mut record, &leftover, args.confirm_timeout, &args.cuda_lib);
        }
        // Empty cells that no record holds any more (a run killed between a release's
        // move and its removal): removed. A populated one is never touched here.
        let mounts = coloc_agent::edges::cgroupfs::CgroupMounts::detect(&args.cgroup_root);
        let swept = coloc_agent::edges::actuator::cell::sweep(&mounts);
        if swept > 0 {
            info!(swept, "Removed empty cells a previous run left behind");
        }
        Box::new(record)
    };
    let cfg = args.loop_config()?;
    let _cpu_latency = args.cpu_wake_latency.and_then(hold_cpu_wake_latency);
    let http_limits = args.http_limits()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    // The pod watch, also the device plugin's index of pods by name.
    let mut kube_pods: Option<Arc<dyn deviceplugin::PodIndex>> = None;
    let source: Arc<dyn PodSource> = match &args.rules {
        Some(path) => Arc::new(Rules::load(path)?),
        None => {
            let node = args.node_name.as_deref().context(
                "no pod source: pass --rules FILE (standalone host; see `coloc-agent check-rules`), \
                 or --node-name / NODE_NAME to watch this node's pods on Kubernetes",
            )?;
            let client = rt
                .block_on(kube::Client::try_default())
                .context("Kubernetes client (in-cluster service account, or KUBECONFIG)")?;
            let _guard = rt.enter();
            info!(node, "Watching this node's pods");
            let mapping = qos_core::PriorityMapping {
                offline_classes: args.offline_priority_class.clone(),
                offline_below: args.offline_priority_below,
            };
            let kube = KubeSource::start_with(client, node, mapping);
            kube_pods = Some(Arc::new(kube.clone()));
            Arc::new(kube)
        }
    };
    let sampler = gpu::Nvml::open(&args.nvml_lib, &args.gpus)?;
    let shared = Arc::new(Shared::default());
    metrics::gauge!("coloc_agent_info", "version" => env!("CARGO_PKG_VERSION"), "actuator" => cfg.actuator.as_str(), "dry_run" => cfg.dry_run.to_string()).set(1.0);
    let stall_ns = (cfg.poll.as_nanos() as u64)
        .saturating_mul(1000)
        .max(5_000_000_000);
    let actuator: Box<dyn Actuator> = if cfg.dry_run {
        Box::new(DryRun)
    } else {
        Box::new(Host::default())
    };
    let mut gates: Option<Box<dyn coloc_agent::edges::gate::LaunchGates>> = None;
    if args.gate && cfg.dry_run {
        warn!("--gate with --dry-run: no gate is ever closed");
    } else if args.gate {
        let file = GateFile::create(&args.gate_file)
            .with_context(|| format!("--gate-file {}", args.gate_file.display()))?;
        info!(file = %args.gate_file.display(), timeout = ?args.gate_timeout, "Launch gates: offline processes with the shim drain at their gate before they are stopped");
        gates = Some(Box::new(GateKeeper::new(file)));
    }
    let procfs = HostProc::new(&cfg.cgroups);
    if procfs.roots() != &Default::default() {
        info!(roots = ?procfs.roots(), "The agent runs in a cgroup namespace of its own: cgroup paths are re-rooted at these host paths");
    }
    let bells: Box<dyn Doorbells> = if args.no_doorbells {
        info!("--no-doorbells: online work is seen through NVML alone");
        Box::new(NoBells::default())
    } else {
        // Kubernetes: pods write only in their own directory, which the agent makes.
        let layout = if args.rules.is_some() {
            Layout::Standalone
        } else {
            Layout::Kubernetes
        };
        match DirBells::open(&args.doorbell_dir, layout) {
            Ok(b) => {
                info!(dir = %args.doorbell_dir.display(), "Watching CUDA shim doorbells");
                match (args.device_plugin, &kube_pods) {
                    (Some(delivery), Some(pods)) => {
                        let owners = Arc::new(SlotOwners::default());
                        let b = b.with_slots(owners.clone());
                        let cfg = deviceplugin::Config {
                            plugin_dir: args.device_plugin_dir.clone(),
                            pod_resources: args.pod_resources_socket.clone(),
                            slots: args.shim_slots,
                            delivery,
                            paths: qos_core::cdi::ShimPaths {
                                library_dir: args
                                    .shim_library
                                    .parent()
                                    .map(|p| p.display().to_string())
                                    .unwrap_or_default(),
                                doorbell_dir: args.doorbell_dir.display().to_string(),
                                gate_dir: args
                                    .gate_file
                                    .parent()
                                    .map(|p| p.display().to_string())
                                    .unwrap_or_default(),
                            },
                        };
                        let _guard = rt.enter();
                        deviceplugin::start(
                            cfg,
                            args.doorbell_dir.clone(),
                            owners,
                            pods.clone(),
                            b.waker(),
                        );
                        Box::new(b)
                    }
                    _ => Box::new(b),
                }
            }
            Err(err) => {
                warn!(error = %format!("{err:#}"), "No doorbells: online work is seen through NVML alone (later)");
                Box::new(NoBells::default())
            }
        }
    };
    let mut cfg = cfg;
    let procfs: Arc<dyn coloc_agent::edges::procfs::ProcFs> = Arc::new(procfs);
    let driver = open_driver(&args, &mut cfg).map(
        |api| -> Box<dyn coloc_agent::edges::checkpoint::DriverWork> {
            Box::new(coloc_agent::edges::checkpoint::DriverCalls::new(
                api,
                procfs.clone(),
            ))
        },
    );
    let waker = bells.waker();
    let edges = Edges {
        driver,
        bells,
        gpu: Box::new(sampler),
        procfs,
        source: source.clone(),
        clock: Arc::new(SystemClock),
        actuator,
        record,
        gates,
    };
    let agent = Loop::new(cfg.clone(), edges, shared.clone())?;

    let listener = rt
        .block_on(async { listen(args.listen) })
        .with_context(|| format!("binding --listen {}", args.listen))?;
    let addr = listener.local_addr()?;
    // Histograms are drained only on a scrape or an upkeep: without a scraper (standalone
    // hosts) the recorder would grow without bound.
    let upkeep = prom.clone();
    rt.spawn(async move {
        let mut every = tokio::time::interval(std::time::Duration::from_secs(5));
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });
    let app_state = http::AppState {
        shared: shared.clone(),
        prom,
        source,
        stall_ns,
        state_cmdlines: args.state_cmdlines,
        state_public: args.state_public,
        process_info: !args.metrics_without_pods,
        metrics_cache: Arc::default(),
    };
    // What /healthz and /readyz say, in the state directory too, for exec probes (no
    // listener a tenant could crowd).
    let health = args.state_dir.join(http::health_file::FILE);
    if let Err(err) = http::health_file::write(&health, &http::health_file::Health::now(&app_state))
    {
        warn!(file = %health.display(), %err, "Cannot write the health file: coloc-agent probe will say the agent is not live");
    }
    rt.spawn(http::health_file::keep_written(app_state.clone(), health));
    let app = http::router(app_state);
    // On the runtime's one worker thread, never on the control loop's.
    rt.spawn(http::serve(listener, app, http_limits));
    info!(
        listen = %addr,
        actuator = cfg.actuator.as_str(),
        dry_run = cfg.dry_run,
        poll = ?cfg.poll,
        idle_poll = ?cfg.idle_poll,
        idle_window = ?args.idle_window,
        http = ?http_limits,
        state_cmdlines = args.state_cmdlines,
        "Agent started"
    );
    // The terminating signals are caught before the loop can suspend anything: one that
    // came between the two would end the agent by its default action, with offline work
    // left stopped (until the resume guard or the next start resumed it).
    let mut streams = {
        use tokio::signal::unix::{signal, SignalKind};
        let _rt = rt.enter();
        let mut streams = Vec::new();
        for (sig, name) in TERMINATING {
            let s =
                signal(SignalKind::from_raw(*sig)).with_context(|| format!("handling {name}"))?;
            streams.push((s, *name));
        }
        streams
    };
    let lp = std::thread::Builder::new()
        .name("coloc-loop".into())
        .spawn(move || agent.run())?;

    rt.block_on(async {
        let any = futures_lite_select(&mut streams);
        tokio::select! {
            name = any => info!(signal = name, "Shutting down: resuming offline work first"),
            _ = async { while !lp.is_finished() { tokio::time::sleep(std::time::Duration::from_millis(100)).await } } => {}
        }
        anyhow::Ok(())
    })?;
    shared.stop.store(true, Ordering::SeqCst);
    waker.wake();
    match lp.join() {
        Ok(()) => {
            info!("All offline work resumed; exiting");
            Ok(())
        }
        Err(_) => anyhow::bail!("control loop panicked (offline work was resumed on the way out)"),
    }
}

/// Holds `--cpu-wake-latency` until the agent exits; a request that cannot be made is
/// logged, and the agent runs on without it.
fn hold_cpu_wake_latency(latency: std::time::Duration) -> Option<sched::CpuWakeLatency> {
    let device = std::path::Path::new(sched::CPU_LATENCY_DEVICE);
    match sched::CpuWakeLatency::hold(device, latency) {
        Ok(held) => {
            let in_force_us = sched::cpu_latency_in_force(device).ok();
            info!(
                requested_us = held.micros(),
                ?in_force_us,
                device = %device.display(),
                "Holding a CPU wake-up latency request: idle CPUs stay in states they leave within it, so a doorbell wakes the loop at once"
            );
            Some(held)
        }
        Err(error) => {
            error!(
                device = %device.display(),
                %error,
                "Cannot hold the CPU wake-up latency request (--cpu-wake-latency; needs write access to the device): running on without it, so a doorbell that rings while the loop's CPU sleeps deeply is seen later"
            );
            None
        }
    }
}

/// Waits for the first of several signal streams; returns its name.
async fn futures_lite_select(
    streams: &mut [(tokio::signal::unix::Signal, &'static str)],
) -> &'static str {
    let futs = streams.iter_mut().map(|(s, name)| {
        let name = *name;
        Box::pin(async move {
            s.recv().await;
            name
        })
    });
    futures::future::select_all(futs).await.0
}

/// Resumes what a previous run left suspended; what cannot be resumed stays recorded.
/// The CUDA driver's checkpoint API, when `--driver-lock` or `--memory-reserve` asks for
/// it: a driver without it is named, and the agent goes on with its other holds.
fn open_driver(
    args: &RunArgs,
    cfg: &mut coloc_agent::control::LoopConfig,
) -> Option<Arc<dyn coloc_agent::edges::checkpoint::DriverApi>> {
    use coloc_agent::edges::checkpoint::CudaCheckpoint;
    if !(args.driver_lock || args.memory_reserve.is_some()) {
        return None;
    }
    if cfg.dry_run {
        warn!("--driver-lock/--memory-reserve with --dry-run: the CUDA driver is never called");
        return None;
    }
    match CudaCheckpoint::open(&args.cuda_lib) {
        Ok(c) => {
            info!(lib = c.library(), driver_version = ?c.driver_version(), lock = args.driver_lock,
                reserve = ?args.memory_reserve.map(|r| r.to_string()), restore_after = ?args.restore_after,
                pods = ?args.checkpoint_pods,
                "The CUDA driver's checkpoint API: offline processes are held by its lock{}",
                if args.memory_reserve.is_some() { ", and checkpointed while online work needs their memory" } else { "" });
            cfg.driver_book.api = true;
            Some(Arc::new(c))
        }
        Err(err) => {
            warn!(error = %err, lib = %args.cuda_lib,
                "No CUDA driver checkpoint API: offline work is held by --actuator alone, and no memory is given back");
            metrics::counter!("coloc_driver_call_failures_total", "op" => "load", "reason" => "no_api").increment(1);
            None
        }
    }
}

fn resume_leftovers(
    record: &mut FileRecord,
    leftover: &[actuator::RecordEntry],
    timeout: std::time::Duration,
    cuda_lib: &str,
) {
    use coloc_agent::cmd::resume::resume_entries;
    for step in resume_entries(
        record,
        leftover,
        timeout,
        Clone::clone,
        cuda_lib,
        coloc_agent::edges::checkpoint::START_CALL_BUDGET,
    ) {
        let e = &step.entry;
        match &step.progress {
            Progress::Failed(err) => {
                error!(entry = ?e, %err, "Failed to resume work a previous run left suspended");
                metrics::counter!("coloc_actuation_errors_total", "actuator" => "record", "op" => "resume", "reason" => err.reason()).increment(1);
                continue;
            }
            Progress::Gone => info!(entry = ?e, "Work a previous run suspended is gone"),
            _ => info!(entry = ?e, "Resumed work a previous run left suspended"),
        }
        if let Some(err) = &step.record_error {
            error!(error = %err, "Failed to update the suspension record");
        }
    }
}

/// Connections the kernel queues for the HTTP server before it accepts them. Under a flood
/// of connections (the HTTP tests open 1,000 at once) tokio's default of 1,024 overflowed
/// now and then: the kernel dropped a SYN, and the client that sent it, a kubelet probe
/// as likely as any other, waited a second for its retransmission. The kernel caps this at
/// `net.core.somaxconn` (4,096 by default since Linux 5.4).
const LISTEN_BACKLOG: u32 = 4096;

fn listen(addr: std::net::SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let sock = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    sock.set_reuseaddr(true)?;
    sock.bind(addr)?;
    sock.listen(LISTEN_BACKLOG)
}
