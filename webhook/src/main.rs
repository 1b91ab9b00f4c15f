//! `coloc-webhook`: see `coloc-webhook --help`.
use anyhow::{Context, Result};
use clap::Parser;
use coloc_webhook::server::{
    install_metrics, reload_certificates, router, serve, AppState, Limits,
};
use coloc_webhook::translate::{Backend, Settings};
use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    /// Human-readable lines (colours only on a terminal).
    Text,
    /// One JSON object per line.
    Json,
}

#[derive(clap::Subcommand, Debug)]
enum Cmd {
    /// Create (or keep, while valid) the webhook's TLS Secret with a self-signed CA, and set
    /// that CA as `caBundle` in the webhook configurations. Talks to the API server
    /// (in-cluster service account, or KUBECONFIG).
    ///
    /// The chart runs it in two Helm hook Jobs when cert-manager is not used: before the
    /// release's objects (pre-install/pre-upgrade) with no configuration named, which makes
    /// the Secret only (the webhook's pods mount it, so `helm install --wait` does not wait
    /// for a Secret that comes later); after them (post-install/post-upgrade) with
    /// --patch-only, which sets caBundle from that Secret on the configurations, which
    /// exist by then. Run with the configurations named and without --patch-only, it does
    /// both (plain manifests).
    #[command(after_help = "\
Examples:
  # the Secret only (the configurations may not exist yet)
  coloc-webhook bootstrap-cert --namespace gpu-coloc --service gpu-coloc-webhook --secret gpu-coloc-webhook-tls
  # caBundle from that Secret, which must exist; the Secret is never written
  coloc-webhook bootstrap-cert --patch-only --namespace gpu-coloc --service gpu-coloc-webhook \\
    --secret gpu-coloc-webhook-tls --mutating-config gpu-coloc-webhook --validating-config gpu-coloc-webhook")]
    BootstrapCert(BootstrapArgs),
}

#[derive(clap::Args, Debug)]
struct BootstrapArgs {
    /// Namespace of the webhook's Service and Secret.
    #[arg(long, env = "COLOC_WEBHOOK_NAMESPACE")]
    namespace: String,
    /// The webhook's Service (the certificate is for its cluster DNS names).
    #[arg(long)]
    service: String,
    /// The TLS Secret the webhook's pods mount (tls.crt, tls.key, ca.crt).
    #[arg(long)]
    secret: String,
    /// MutatingWebhookConfiguration to give the CA (repeatable). None named (and no
    /// validating one): the Secret only.
    #[arg(long = "mutating-config")]
    mutating: Vec<String>,
    /// ValidatingWebhookConfiguration to give the CA (repeatable).
    #[arg(long = "validating-config")]
    validating: Vec<String>,
    /// Only set caBundle on the named configurations, from the Secret as it is (it must
    /// exist and be for --service); never write the Secret.
    #[arg(long)]
    patch_only: bool,
    /// Validity of a new certificate, days.
    #[arg(long, default_value_t = 3650)]
    validity_days: u64,
    /// Replace a certificate with fewer days than this left.
    #[arg(long, default_value_t = 30)]
    renew_before_days: u64,
}

/// gpu-coloc admission webhook: validates vke.volcengine.com mGPU requests and translates
/// them for the cluster's GPU backend (vke, nvidia-shared, hami).
#[derive(Parser, Debug)]
#[command(
    version,
    about,
    after_help = "\
Endpoints: POST /mutate[?backend=B], POST /validate[?backend=B], POST /inject,
POST /validate-mounts, POST /unsupported-backend, GET /healthz /readyz /metrics.
Example config (TOML):
  backend = \"hami\"                          # default backend
  protected_host_paths = [\"/run/coloc-agent\"] # /validate-mounts: more host dirs pods may not mount writable
  offline_priority_class = \"gpu-coloc-offline\"
  offline_priority = -10                      # that PriorityClass's value
  offline_preemption_policy = \"Never\"        # and its preemptionPolicy
  [shim]                                      # /inject: the CUDA shim into GPU pods
  library = \"/var/lib/gpu-coloc/lib/libcoloc_cuda.so\"
  doorbell_dir = \"/run/gpu-coloc/doorbells\"
  gate_dir = \"/run/gpu-coloc/gate\"
  inflight = 2                                # optional: COLOC_SHIM_INFLIGHT of offline pods
  inflight_ms = 3                             # optional: COLOC_SHIM_INFLIGHT_MS of offline pods
  online_wake_gap_ms = 2                      # optional: COLOC_SHIM_WAKE_GAP_MS of online pods (the agent runs --release learned)"
)]
struct Args {
    #[command(subcommand)]
    command: Option<Cmd>,
    /// Log format.
    #[arg(
        long,
        env = "COLOC_LOG_FORMAT",
        value_enum,
        default_value = "text",
        global = true
    )]
    log_format: LogFormat,
    /// Settings file (TOML): `backend`, `offline_priority_class`, `offline_priority`,
    /// `offline_preemption_policy`, and a `[shim]` table (`library`, `doorbell_dir`,
    /// `gate_dir`, `inflight`) for /inject.
    #[arg(long, env = "COLOC_WEBHOOK_CONFIG")]
    config: Option<PathBuf>,
    /// Default backend (overrides the file).
    #[arg(long, env = "COLOC_WEBHOOK_BACKEND", value_enum)]
    backend: Option<Backend>,
    /// TLS certificate chain (PEM). Re-read when it changes.
    #[arg(
        long,
        env = "COLOC_WEBHOOK_CERT",
        default_value = "/etc/coloc-webhook/tls/tls.crt"
    )]
    cert: PathBuf,
    /// TLS private key (PEM). Re-read when it changes.
    #[arg(
        long,
        env = "COLOC_WEBHOOK_KEY",
        default_value = "/etc/coloc-webhook/tls/tls.key"
    )]
    key: PathBuf,
    /// Address to listen on.
    #[arg(long, env = "COLOC_WEBHOOK_LISTEN", default_value = "0.0.0.0:8443")]
    listen: SocketAddr,
    /// Largest AdmissionReview accepted, bytes (larger: HTTP 413). The default is the API
    /// server's own limit on a request body: a pod is at most 1.5 MiB (etcd), and an
    /// UPDATE review carries two of them.
    #[arg(long, env = "COLOC_WEBHOOK_MAX_BODY", default_value_t = 3 * 1024 * 1024)]
    max_body_bytes: usize,
    /// Seconds allowed for the TLS handshake and for each request's headers (an HTTP/1.1
    /// keep-alive connection waiting for its next request is closed after this too). The
    /// API server sends a review's headers and body at once, in-cluster.
    #[arg(long, env = "COLOC_WEBHOOK_HEADER_READ_TIMEOUT_SECS", default_value = "3", value_parser = parse_secs)]
    header_read_timeout_secs: Duration,
    /// Seconds allowed for a review's body, from the end of its headers, however slowly
    /// it trickles in (larger: HTTP 408). The chart's API server timeout for the webhook
    /// is 5 s (webhook.timeoutSeconds): a body later than that is answered to nobody.
    #[arg(long, env = "COLOC_WEBHOOK_BODY_READ_TIMEOUT_SECS", default_value = "3", value_parser = parse_secs)]
    body_read_timeout_secs: Duration,
    /// Seconds a connection may stay with no byte moving either way before it is closed;
    /// longer than the API server's own idle timeout for its connections (90 s), so that
    /// it, not the webhook, closes idle connections (while connection slots are free).
    #[arg(long, env = "COLOC_WEBHOOK_IDLE_TIMEOUT_SECS", default_value = "120", value_parser = parse_secs)]
    idle_timeout_secs: Duration,
    /// Connections open at once; a new one past this evicts the connection on which bytes
    /// moved least recently.
    #[arg(long, env = "COLOC_WEBHOOK_MAX_CONNECTIONS", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    max_connections: u32,
    /// Connections open at once from one source address; more are closed as they are
    /// accepted. The API server needs a few (HTTP/2: one per API server instance).
    #[arg(long, env = "COLOC_WEBHOOK_MAX_CONNECTIONS_PER_SOURCE", default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..))]
    max_connections_per_source: u32,
    /// Reviews handled at once, each taking its slot once its body has arrived; others
    /// wait up to the body read timeout (then HTTP 503). Bodies being read hold at most
    /// this times --max-body-bytes together (more: HTTP 503).
    #[arg(long, env = "COLOC_WEBHOOK_MAX_CONCURRENT_REVIEWS", default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    max_concurrent_reviews: u32,
    /// How often to check the certificate files for changes.
    #[arg(long, env = "COLOC_WEBHOOK_RELOAD_SECS", default_value_t = 10)]
    reload_secs: u64,
    /// Serve plain HTTP instead of HTTPS (local testing only: the API server requires TLS).
    #[arg(long)]
    insecure_http: bool,
    /// Worker threads.
    #[arg(long, env = "COLOC_WEBHOOK_THREADS", default_value_t = 2)]
    threads: usize,
    /// Instead of serving: translate the Pod (JSON) in this file for the backend (after
    /// injecting the CUDA shim when the settings have a [shim] table), check its mounts
    /// (/validate-mounts) and print the result, or the denial (exit 1). `-` reads
    /// standard input.
    #[arg(long, value_name = "POD_JSON")]
    translate: Option<PathBuf>,
}

/// Seconds, possibly fractional ("0.5"), more than 0 and at most a day.
fn parse_secs(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if !(v > 0.0 && v <= 86_400.0) {
        return Err(format!(
            "{s:?}: allowed: more than 0 and at most 86400 seconds"
        ));
    }
    Ok(Duration::from_secs_f64(v))
}

fn translate_file(a: &Args, settings: &Settings, path: &std::path::Path) -> Result<()> {
    use std::io::Read;
    let mut text = String::new();
    if path == std::path::Path::new("-") {
        std::io::stdin().read_to_string(&mut text)?;
    } else {
        text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    }
    let mut pod: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{}: not a JSON Pod", path.display()))?;
    let backend = a.backend.unwrap_or(settings.backend);
    // As the API server calls them: /inject (first in the chart's configuration), then
    // /mutate.
    if let Some(shim) = &settings.shim {
        let inj = coloc_webhook::inject::inject(&pod, shim, &settings.classes.mapping());
        for w in &inj.warnings {
            eprintln!("warning: {w}");
        }
        let patch: json_patch::Patch = serde_json::from_value(serde_json::Value::Array(inj.ops))?;
        json_patch::patch(&mut pod, &patch).context("applying the shim injection")?;
    }
    match coloc_webhook::translate::translate(&pod, backend, settings) {
        Ok(ops) => {
            let patch: json_patch::Patch = serde_json::from_value(serde_json::Value::Array(ops))?;
            json_patch::patch(&mut pod, &patch).context("applying the patch")?;
            // Then /validate-mounts, as the API server calls it last.
            let shim = settings.shim.clone().unwrap_or_default();
            if let Err(d) =
                coloc_webhook::mounts::check_pod(&pod, &shim, &settings.protected_host_paths)
            {
                anyhow::bail!("denied: {}", d.message);
            }
            println!("{}", serde_json::to_string_pretty(&pod)?);
            Ok(())
        }
        Err(d) => anyhow::bail!("denied: {}", d.message),
    }
}

fn load_settings(a: &Args) -> Result<Settings> {
    let mut s = match &a.config {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            toml::from_str::<Settings>(&text).map_err(|e| {
                anyhow::anyhow!(
                    "{}: {}",
                    p.display(),
                    e.to_string().trim().replace('\n', " ")
                )
            })?
        }
        None => Settings::new(Backend::Vke),
    };
    if let Some(b) = a.backend {
        s.backend = b;
    }
    s.check().map_err(|e| match &a.config {
        Some(p) => anyhow::anyhow!("{}: {e}", p.display()),
        None => anyhow::anyhow!("{e}"),
    })?;
    Ok(s)
}

fn main() {
    let args = Args::parse();
    let b = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colour codes only for a person at a terminal, never into a log collector.
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("COLOC_LOG")
                .unwrap_or_else(|_| "info".into()),
        );
    match args.log_format {
        LogFormat::Text => b.init(),
        LogFormat::Json => b.json().init(),
    }
    let result = match &args.command {
        Some(Cmd::BootstrapCert(b)) => bootstrap_cert(b),
        None => run(args),
    };
    if let Err(e) = result {
        eprintln!("coloc-webhook: {e:#}");
        std::process::exit(1);
    }
}

fn bootstrap_cert(b: &BootstrapArgs) -> Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let target = coloc_webhook::bootstrap::Target {
        namespace: b.namespace.clone(),
        service: b.service.clone(),
        secret: b.secret.clone(),
        mutating: b.mutating.clone(),
        validating: b.validating.clone(),
        validity_days: b.validity_days,
        renew_before_days: b.renew_before_days,
        mode: if b.patch_only {
            coloc_webhook::bootstrap::Mode::PatchOnly
        } else {
            coloc_webhook::bootstrap::Mode::Secret
        },
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let client = kube::Client::try_default()
            .await
            .context("Kubernetes client (in-cluster service account, or KUBECONFIG)")?;
        let out = coloc_webhook::bootstrap::bootstrap(client, &target, now).await?;
        let secret = match out.secret {
            Some(o) => format!("{o:?}"),
            None => "read (--patch-only)".into(),
        };
        let bundles = if target.mutating.is_empty() && target.validating.is_empty() {
            "no webhook configuration named: caBundle left to a --patch-only run".to_string()
        } else {
            format!("caBundle set on {} webhook(s)", out.webhooks_patched)
        };
        println!(
            "secret {}/{}: {secret}; {bundles}",
            target.namespace, target.secret
        );
        Ok(())
    })
}

fn run(a: Args) -> Result<()> {
    let settings = load_settings(&a)?;
    if let Some(p) = &a.translate {
        return translate_file(&a, &settings, p);
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let prom = install_metrics()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(a.threads.max(1))
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let limits = Limits {
            header_read_timeout: a.header_read_timeout_secs,
            body_read_timeout: a.body_read_timeout_secs,
            idle_timeout: a.idle_timeout_secs,
            max_connections: a.max_connections as usize,
            max_connections_per_source: a.max_connections_per_source as usize,
            max_concurrent_reviews: a.max_concurrent_reviews as usize,
            max_body: a.max_body_bytes,
        };
        let app = router(AppState::new(settings.clone(), limits, Some(prom)));
        tracing::info!(listen = %a.listen, backend = %settings.backend, tls = !a.insecure_http, ?limits, "Webhook started");
        let listener = std::net::TcpListener::bind(a.listen).with_context(|| format!("binding {}", a.listen))?;
        let tls = if a.insecure_http {
            None
        } else {
            let tls = axum_server::tls_rustls::RustlsConfig::from_pem_file(&a.cert, &a.key)
                .await
                .with_context(|| format!("loading TLS certificate {} and key {}", a.cert.display(), a.key.display()))?;
            tokio::spawn(reload_certificates(tls.clone(), a.cert.clone(), a.key.clone(), Duration::from_secs(a.reload_secs.max(1))));
            Some(tls)
        };
        serve(listener, app, tls, limits, axum_server::Handle::new()).await?;
        Ok(())
    })
}
