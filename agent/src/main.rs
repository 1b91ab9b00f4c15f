//! `coloc-agent`: see `coloc-agent --help`.
use anyhow::{Context, Result};
use clap::Parser;
use coloc_agent::cli::{Cli, Command, LogFormat, RunArgs};
use coloc_agent::control::{resume_leftovers, Agent, Shared};
use coloc_agent::source::{PodSource, Rules};
use coloc_agent::{gpu, http, metrics_setup, record};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tracing::{info, warn};

fn main() {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    let result = match cli.cmd {
        Command::Run(args) => run(args),
        Command::CheckRules { file } => check_rules(&file),
        Command::Demo(args) => coloc_agent::demo::run(args),
        Command::Status(args) => coloc_agent::status::run(args),
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

fn run(args: RunArgs) -> Result<()> {
    let cfg = args.loop_config()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
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
            Arc::new(coloc_agent::kube_source::KubeSource::start(client, node))
        }
    };
    let prom = metrics_setup::install()?;

    // Fail-open first: whatever a previous run left suspended runs again before anything
    // else can fail.
    let (mut record, leftover) = record::Record::open(&args.state_dir)?;
    if !leftover.is_empty() {
        warn!(count = leftover.len(), record = %record.path().display(), "Found work a previous run left suspended");
        resume_leftovers(&mut record, &leftover, cfg.confirm_timeout);
    }

    let sampler = gpu::Nvml::open(&args.nvml_lib, &args.gpus)?;
    let shared = Arc::new(Shared::default());
    metrics::gauge!("coloc_agent_info", "version" => env!("CARGO_PKG_VERSION"), "actuator" => cfg.actuator.as_str(), "dry_run" => cfg.dry_run.to_string()).set(1.0);
    let stall_ns = (cfg.poll.as_nanos() as u64)
        .saturating_mul(1000)
        .max(5_000_000_000);
    let agent = Agent::new(
        cfg.clone(),
        Box::new(sampler),
        source.clone(),
        record,
        shared.clone(),
    )?;

    let listener = rt
        .block_on(tokio::net::TcpListener::bind(args.listen))
        .with_context(|| format!("binding --listen {}", args.listen))?;
    let addr = listener.local_addr()?;
    let app = http::router(http::AppState {
        shared: shared.clone(),
        prom,
        source,
        stall_ns,
    });
    rt.spawn(async move {
        if let Err(err) = axum::serve(listener, app).await {
            tracing::error!(%err, "HTTP server failed");
        }
    });
    info!(
        listen = %addr,
        actuator = cfg.actuator.as_str(),
        dry_run = cfg.dry_run,
        poll = ?cfg.poll,
        idle_window = ?args.idle_window,
        "Agent started"
    );
    let lp = std::thread::Builder::new()
        .name("coloc-loop".into())
        .spawn(move || agent.run())?;

    rt.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        loop {
            tokio::select! {
                _ = term.recv() => { info!("SIGTERM: shutting down"); break; }
                _ = int.recv() => { info!("SIGINT: shutting down"); break; }
                _ = tokio::time::sleep(std::time::Duration::from_millis(100)) => {
                    if lp.is_finished() { break; }
                }
            }
        }
        anyhow::Ok(())
    })?;
    shared.stop.store(true, Ordering::SeqCst);
    match lp.join() {
        Ok(()) => {
            info!("All offline work resumed; exiting");
            Ok(())
        }
        Err(_) => anyhow::bail!("control loop panicked (offline work was resumed on the way out)"),
    }
}
