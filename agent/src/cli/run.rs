//! `coloc-agent run`: its flags, and their validation into the loop's configuration.

use super::parse_duration;
use crate::control::learn::Learning;
use crate::control::LoopConfig;
use crate::edges::actuator::Kind;
use crate::edges::cgroupfs::CgroupMounts;
use anyhow::{bail, Result};
use clap::Args;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// When offline work resumes (`--release`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ReleaseRule {
    /// After the idle window.
    Fixed,
    /// After a window learned per online process, where the doorbell and the gate make it
    /// safe.
    Learned,
    /// At once (window 0) where the doorbell and the gate make it safe.
    AtOnce,
}

/// `coloc-agent run`.
#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// Standalone pod source: TOML rules (by cgroup, exe, cmdline, uid) that classify GPU
    /// processes on a host without Kubernetes. See `coloc-agent check-rules`. Without it,
    /// the agent watches this node's pods on Kubernetes (needs --node-name).
    #[arg(long, env = "COLOC_RULES")]
    pub rules: Option<PathBuf>,
    /// This node's name: the Kubernetes pod source watches pods with
    /// spec.nodeName=<name> (set from the downward API in the DaemonSet).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,
    /// A PriorityClass whose pods are offline, besides Koordinator's koord-batch and
    /// koord-free (repeat, or comma-separated). Read from spec.priorityClassName, which a
    /// pod cannot change; the webhook's [classes] offline_priority_classes must say the
    /// same.
    #[arg(long, env = "COLOC_OFFLINE_PRIORITY_CLASS", value_delimiter = ',')]
    pub offline_priority_class: Vec<String>,
    /// Pods whose spec.priority (set by the API server from their PriorityClass) is below
    /// this value are offline; the webhook's [classes] offline_priority_below must say the
    /// same.
    #[arg(long, env = "COLOC_OFFLINE_PRIORITY_BELOW", allow_hyphen_values = true)]
    pub offline_priority_below: Option<i32>,
    /// NVML library to load (the driver's libnvidia-ml.so.1, or the test fake).
    #[arg(long, env = "COLOC_NVML_LIB", default_value = "libnvidia-ml.so.1")]
    pub nvml_lib: String,
    /// Manage only these GPU indices (comma-separated); default all.
    #[arg(long, env = "COLOC_GPUS", value_delimiter = ',')]
    pub gpus: Vec<u32>,
    /// The loop's tick while failed suspensions, events, fixed-share duty cycles or a
    /// requested process-list read are in progress (e.g. 1ms, 500us). Confirmations are
    /// checked on their own schedule (50 µs after the operation, the gap doubling to 1 ms).
    /// Otherwise the loop sleeps until something is due (an NVML read, a release at the
    /// end of an idle window, a re-check) or a doorbell rings.
    #[arg(long, env = "COLOC_POLL_INTERVAL", default_value = "1ms", value_parser = parse_duration)]
    pub poll_interval: Duration,
    /// The loop's longest sleep when nothing is due (a doorbell still wakes it at once).
    #[arg(long, env = "COLOC_IDLE_POLL_INTERVAL", default_value = "100ms", value_parser = parse_duration)]
    pub idle_poll_interval: Duration,
    /// How often to read NVML's per-process utilisation samples, at most. An H100 (driver
    /// 580) writes them once per period of 200 ms (--nvml-sample-period), visible within
    /// 3 ms of the period's end, and one read costs 1.4-2.1 ms of CPU (p50; 3.4 ms p99).
    /// When the period is longer than this interval, each GPU is read 5 ms after each of
    /// its periods ends (the phase comes from the samples' timestamps) and not in between:
    /// work seen through NVML alone is then seen within the period plus 5 ms, with one read
    /// per period. Online work is seen at once by the CUDA shim's doorbell; NVML attributes
    /// work and covers processes without the shim.
    #[arg(long, env = "COLOC_NVML_INTERVAL", default_value = "100ms", value_parser = parse_duration)]
    pub nvml_interval: Duration,
    /// The driver's sample period: 200 ms on an H100 with driver 580 (measure yours with
    /// `coloc-bench --nvml-probe`). A sample's timestamp is the END of the period it covers,
    /// so the onset of work seen only by NVML is taken as timestamp minus this period, and
    /// work seen only through NVML counts as busy until a read 1.25 periods later.
    #[arg(long, env = "COLOC_NVML_SAMPLE_PERIOD", default_value = "200ms", value_parser = parse_duration)]
    pub nvml_sample_period: Duration,
    /// Directory of the CUDA shim's doorbell pages: `<pid>-<nonce>.bell` of standalone
    /// processes, and `pods/<pod-uid>/` per pod on Kubernetes. Created if missing: mode
    /// 1777 with --rules (any user's process may add its page); on Kubernetes root's 0755
    /// (a world-writable one is narrowed), and the agent makes each pod's `pods/<uid>/`
    /// (mode 1777) when it sees the pod.
    #[arg(
        long,
        env = "COLOC_DOORBELL_DIR",
        default_value = "/run/gpu-coloc/doorbells"
    )]
    pub doorbell_dir: PathBuf,
    /// No doorbells: see online work through NVML alone (one driver sample period or more
    /// after it starts).
    #[arg(long, env = "COLOC_NO_DOORBELLS")]
    pub no_doorbells: bool,
    /// Offer the CUDA shim to pods as a device (Kubernetes only): the agent registers a
    /// device plugin for gpu-coloc.dev/shim-online and gpu-coloc.dev/shim-offline, which
    /// the webhook asks for (its [shim] delivery = "device") instead of adding hostPath
    /// volumes. Each container gets a slot: `cdi` names the CDI device
    /// gpu-coloc.dev/shim=<slot> (the spec `coloc-node-setup --cdi-spec` writes; needs
    /// containerd >= 1.7 with CDI on, or CRI-O); `mounts` hands the same mounts and
    /// environment to the kubelet directly (any runtime). The agent reads a slot's
    /// doorbell pages as the pod's that the kubelet's pod-resources API says holds it.
    #[arg(long, env = "COLOC_DEVICE_PLUGIN", value_enum)]
    pub device_plugin: Option<crate::edges::deviceplugin::Delivery>,
    /// The kubelet's device-plugin directory (its registration socket, kubelet.sock,
    /// and the agent's two sockets).
    #[arg(
        long,
        env = "COLOC_DEVICE_PLUGIN_DIR",
        default_value = "/var/lib/kubelet/device-plugins"
    )]
    pub device_plugin_dir: PathBuf,
    /// The kubelet's pod-resources socket (which pod holds which slot).
    #[arg(
        long,
        env = "COLOC_POD_RESOURCES_SOCKET",
        default_value = "/var/lib/kubelet/pod-resources/kubelet.sock"
    )]
    pub pod_resources_socket: PathBuf,
    /// Slots per class offered to the kubelet (containers with the shim on this node at
    /// once); must match `coloc-node-setup --slots`.
    #[arg(long, env = "COLOC_SHIM_SLOTS", default_value_t = qos_core::cdi::DEFAULT_SLOTS,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(qos_core::cdi::MAX_SLOTS)))]
    pub shim_slots: u32,
    /// The shim on the node (its directory is what slots mount read-only).
    #[arg(
        long,
        env = "COLOC_SHIM_LIBRARY",
        default_value = "/var/lib/gpu-coloc/lib/libcoloc_cuda.so"
    )]
    pub shim_library: PathBuf,
    /// Close the launch gate of offline processes that run the CUDA shim before stopping
    /// them: while online work is busy on a GPU, the gate of that GPU is closed, the
    /// process's next submission there blocks and at most K kernels per stream are left
    /// in flight; once its shim says that work has drained (or --gate-timeout passes) the
    /// process is stopped with --actuator as without the gate, so what it left queued is
    /// short. The gate never replaces the stop: an acknowledgement only brings it sooner.
    /// Processes without the shim, on more than one GPU, or under a fixed share are
    /// stopped at once. Needs the doorbells (the acknowledgements come in the pages).
    #[arg(long, env = "COLOC_GATE")]
    pub gate: bool,
    /// The gate file the shims map (replaced at start, every gate open). Its directory is
    /// created 0755 if missing and must not be writable by others.
    #[arg(long, env = "COLOC_GATE_FILE", default_value = coloc_doorbell::gate::DEFAULT_GATE_FILE)]
    pub gate_file: PathBuf,
    /// How long a closed gate's acknowledgement is waited for before the process is
    /// stopped all the same. The acknowledgement comes once the work the process had in
    /// flight is done (at most K = COLOC_SHIM_INFLIGHT kernels per stream).
    #[arg(long, env = "COLOC_GATE_TIMEOUT", default_value = "50ms", value_parser = parse_duration)]
    pub gate_timeout: Duration,
    /// How long a doorbell page may keep its GPU busy without NVML ever showing its owner
    /// at work before its launches stop counting. A page's launch times are the tenant's
    /// word; the driver's samples are not. A page whose claims kept the GPU busy for this
    /// long, without interruption, while no sample of its owner's processes on that GPU
    /// showed any utilisation in that time, is distrusted (metric, event, log, `/state`)
    /// until a sample does. The driver reads under 1 % of a period as 0 %: a service busy
    /// that little for this long without a break loses its doorbell (NVML still counts).
    /// 0: pages are never distrusted.
    #[arg(long, env = "COLOC_DOORBELL_TRUST_WINDOW", default_value = "30s", value_parser = parse_duration)]
    pub doorbell_trust_window: Duration,
    /// How often to re-read the running-process list (a PID seen in samples but not yet
    /// known triggers a re-read at once).
    #[arg(long, env = "COLOC_PROCESS_INTERVAL", default_value = "50ms", value_parser = parse_duration)]
    pub process_interval: Duration,
    /// Offline work resumes after online work has been idle this long.
    #[arg(long, env = "COLOC_IDLE_WINDOW", default_value = "100ms", value_parser = parse_duration)]
    pub idle_window: Duration,
    /// When offline work resumes. `fixed`: after --idle-window everywhere. `learned`: on
    /// a GPU where every online process rings a doorbell that says when its work was
    /// complete (the CUDA shim, with COLOC_SHIM_WAKE_GAP_MS no longer than
    /// --release-floor) and every offline process sits behind a launch gate (--gate),
    /// after a window learned from each online process's own idle gaps (from its work
    /// seen complete to its next launch): the shortest one, from --release-floor up,
    /// whose gaps give offline on average --release-ratio times what a wrong release costs
    /// online (--release-drain); elsewhere, and until enough gaps were seen, --idle-window.
    /// `at-once`: under the same conditions, as soon as every online process's work there
    /// is stamped complete (within one --poll-interval of the stamp; 100us for the
    /// fastest), no gaps to learn first: with random arrivals the time since the last
    /// request says nothing about the next one, and the gate bounds what a release costs;
    /// elsewhere --idle-window.
    #[arg(long, env = "COLOC_RELEASE", value_enum, default_value_t = ReleaseRule::Fixed)]
    pub release: ReleaseRule,
    /// --release learned: no window is shorter than this (about ten times a release's and
    /// a re-preemption's own cost, and longer than the host's gaps between one request's
    /// launches). Both learned and at-once: an online page must wake the agent after gaps
    /// this short (COLOC_SHIM_WAKE_GAP_MS at most this).
    #[arg(long, env = "COLOC_RELEASE_FLOOR", default_value = "2ms", value_parser = parse_duration)]
    pub release_floor: Duration,
    /// --release learned: idle time offline must gain per unit of delay a wrong release
    /// may cost online.
    #[arg(long, env = "COLOC_RELEASE_RATIO", default_value_t = 10)]
    pub release_ratio: u32,
    /// --release learned: what a wrong release costs online at most: the offline
    /// processes' in-flight budget behind their gate (the shim's COLOC_SHIM_INFLIGHT_MS,
    /// 0.5 ms by default; set it to the longest kernel if kernels are longer).
    #[arg(long, env = "COLOC_RELEASE_DRAIN", default_value = "3ms", value_parser = parse_duration)]
    pub release_drain: Duration,
    /// How offline work is suspended.
    #[arg(long, env = "COLOC_ACTUATOR", value_enum, default_value_t = Kind::Freezer)]
    pub actuator: Kind,
    /// Hold offline GPU processes with the CUDA driver's lock (`cuCheckpointProcessLock`:
    /// the driver blocks the process's CUDA calls and completes the work it submitted;
    /// the process cannot lift it) instead of stopping them: their CPU threads run on.
    /// With --gate the gate closes first and the lock follows its drain. A process the
    /// driver refuses is held by --actuator from then on. Needs a driver with the
    /// checkpoint API (CUDA 12.8, display driver 570 or later); without it the agent says
    /// so at start and uses --actuator. Recorded before each lock; `coloc-agent resume`
    /// unlocks.
    #[arg(long, env = "COLOC_DRIVER_LOCK")]
    pub driver_lock: bool,

    /// The CUDA driver library whose checkpoint API --driver-lock and --memory-reserve
    /// use.
    #[arg(long, env = "COLOC_CUDA_LIB", default_value = "libcuda.so.1")]
    pub cuda_lib: String,

    /// Memory preemption: while online work is present on a GPU and its free memory
    /// (NVML) is under this reserve, the agent locks and checkpoints offline processes
    /// there (their device memory moves to host memory and the GPU's is freed: about 0.6 s
    /// per GB on an H100), largest first, until what they hold covers the reserve; each
    /// is recorded first. A size (`8GiB`, `512MiB`, `20GB`) or a percent of the GPU's
    /// memory (`10%`). Only pods --checkpoint-pods allows. Unset: off.
    #[arg(long, env = "COLOC_MEMORY_RESERVE", value_parser = crate::control::driver_book::Reserve::parse)]
    pub memory_reserve: Option<crate::control::driver_book::Reserve>,

    /// A checkpointed process is restored (about 0.2 s per GB on an H100), then unlocked,
    /// once its GPU has been out of memory pressure this long and has room for it and the
    /// reserve. Long enough that an eviction (seconds) is not undone by a pause in online's
    /// allocations.
    #[arg(long, env = "COLOC_RESTORE_AFTER", default_value = "30s", value_parser = parse_duration)]
    pub restore_after: Duration,

    /// Which offline pods memory preemption may checkpoint: `opt-in`, only pods annotated
    /// `gpu-coloc.dev/checkpoint: "true"` (a rule's `checkpoint = true`); `opt-out`, every
    /// offline pod but those annotated `"false"`.
    #[arg(long, env = "COLOC_CHECKPOINT_PODS", value_enum, default_value_t = crate::control::driver_book::PodsPolicy::OptIn)]
    pub checkpoint_pods: crate::control::driver_book::PodsPolicy,

    /// How often GPU memory is read (NVML) while memory preemption is on and offline work
    /// is present.
    #[arg(long, env = "COLOC_MEMORY_INTERVAL", default_value = "200ms", value_parser = parse_duration)]
    pub memory_interval: Duration,

    /// Decide, log and export metrics, but never suspend anything.
    #[arg(long, env = "COLOC_DRY_RUN")]
    pub dry_run: bool,
    /// Whether GPU processes of no known pod/rule count as online demand.
    #[arg(long, env = "COLOC_UNMANAGED_IS_ONLINE", default_value_t = true, action = clap::ArgAction::Set)]
    pub unmanaged_is_online: bool,
    /// Period of the fixed-share duty cycle.
    #[arg(long, env = "COLOC_DUTY_PERIOD", default_value = "100ms", value_parser = parse_duration)]
    pub duty_period: Duration,
    /// Give up confirming a suspend/resume after this long (the suspension is then undone).
    /// Confirmation is checked 50 µs after the operation, the gap doubling up to 1 ms,
    /// without blocking, so a target that never confirms does not delay the other GPUs.
    #[arg(long, env = "COLOC_CONFIRM_TIMEOUT", default_value = "1s", value_parser = parse_duration)]
    pub confirm_timeout: Duration,
    /// A GPU whose NVML calls keep failing for this long (and on at least 3 consecutive
    /// ticks) fails open: its offline work is resumed and it is left unmanaged until NVML
    /// answers again; other GPUs stay protected. Shorter failures keep the last decisions.
    #[arg(long, env = "COLOC_NVML_FAILURE_GRACE", default_value = "50ms", value_parser = parse_duration)]
    pub nvml_failure_grace: Duration,
    /// An NVML call that has not returned after this long trips the watchdog: all offline
    /// work is resumed, coloc_fail_open_total{reason="nvml_hung"} counts it, and /readyz
    /// answers 503 until the call returns.
    #[arg(long, env = "COLOC_NVML_HANG_TIMEOUT", default_value = "250ms", value_parser = parse_duration)]
    pub nvml_hang_timeout: Duration,
    /// How often suspended targets are checked again, and stopped again if something
    /// resumed them (a SIGCONT from inside the pod). Each time, at most 2 targets are
    /// checked (round robin, so with many held processes each is checked less often),
    /// plus every target found resumed before; a signalled cgroup that keeps resuming is
    /// frozen, and a process held alone that keeps resuming is frozen in a cgroup of the
    /// agent's own (`<cgroup root>/gpu-coloc.held/`) until its release.
    #[arg(long, env = "COLOC_RECHECK_INTERVAL", default_value = "10ms", value_parser = parse_duration)]
    pub recheck_interval: Duration,
    /// Root of the cgroup filesystem (pure v2 at the root, or hybrid with `unified/` and
    /// `freezer/` below it).
    #[arg(long, env = "COLOC_CGROUP_ROOT", default_value = "/sys/fs/cgroup")]
    pub cgroup_root: PathBuf,
    /// Directory for the fail-open record of what is suspended.
    #[arg(long, env = "COLOC_STATE_DIR", default_value = "/run/coloc-agent")]
    pub state_dir: PathBuf,
    /// Address for /metrics, /healthz, /readyz and /state.
    #[arg(long, env = "COLOC_LISTEN", default_value = "0.0.0.0:9400")]
    pub listen: SocketAddr,
    /// Nice value for the control-loop thread (-20..19; 0 leaves it unchanged). Negative
    /// values keep offline processes that compete for CPU from delaying preemption.
    #[arg(long, env = "COLOC_LOOP_NICE", default_value_t = -10, allow_negative_numbers = true, value_parser = clap::value_parser!(i32).range(-20..=19))]
    pub loop_nice: i32,
    /// Real-time priority (SCHED_FIFO, 1..99) for the control-loop thread; 0 keeps the
    /// normal scheduler (with --loop-nice and --loop-slice). A real-time loop runs as soon as a doorbell
    /// wakes it, ahead of every normal process; it sleeps between ticks, and the kernel
    /// caps real-time threads at 95 % of a CPU. Needs CAP_SYS_NICE.
    #[arg(long, env = "COLOC_LOOP_RT_PRIORITY", default_value_t = 0, value_parser = clap::value_parser!(i32).range(0..=99))]
    pub loop_rt_priority: i32,
    /// Scheduler time slice the control-loop thread asks for (EEVDF custom slice, Linux
    /// 6.12 or later; older kernels ignore it). A thread with a short slice preempts the
    /// running one as soon as a doorbell wakes it; with the kernel's default slice
    /// (0.75-3 ms) it waits until the running thread's slice ends, which is most of the
    /// doorbell's tail on a busy node. 0 keeps the kernel's default; else 100us to 100ms.
    /// Not used with --loop-rt-priority.
    #[arg(long, env = "COLOC_LOOP_SLICE", default_value = "100us", value_parser = parse_duration)]
    pub loop_slice: Duration,
    /// Ask the kernel to keep idle CPUs able to wake within this long (a PM QoS request on
    /// /dev/cpu_dma_latency, held while the agent runs; the kernel withdraws it when the
    /// agent exits, a crash included). A doorbell that rings while the loop's CPU is idle
    /// then runs the loop at once, not when that CPU leaves a deep idle state (bare-metal
    /// package C-states: tens to hundreds of µs; a VM's halted vCPU: when the host runs it
    /// again, up to milliseconds). It applies to every CPU of the node: 0 makes idle CPUs
    /// poll instead of halting (the fastest wake-up, paid in power, and in a VM in the
    /// host's CPU time); a few µs keeps the shallow states (C1) and only the deep ones out.
    /// Whole microseconds (rounded down), at most 1s. Unset: no request. Needs write access
    /// to /dev/cpu_dma_latency (root; in a container, that device node); without it the
    /// agent logs an error and runs on.
    #[arg(long, env = "COLOC_CPU_WAKE_LATENCY", value_parser = parse_duration)]
    pub cpu_wake_latency: Option<Duration>,
    /// Append every preemption and release, with its latencies, to this JSON-lines file.
    #[arg(long, env = "COLOC_EVENT_LOG")]
    pub event_log: Option<PathBuf>,
    /// Show each process's command line in /state (and so in `coloc-agent status`).
    /// Off by default: command lines often carry secrets (`--token=…`), and the port is
    /// reachable by anything that reaches the node. The agent's log keeps their first 120
    /// bytes, control characters escaped.
    #[arg(long, env = "COLOC_STATE_CMDLINES")]
    pub state_cmdlines: bool,
    /// Answer /state to any client. Off by default: /state shows every pod's GPU
    /// processes and when each was last active, to the millisecond, and the port is
    /// reachable by anything that reaches the node; without this flag it answers loopback
    /// clients only (`coloc-agent status` on the node or in the agent's pod, `kubectl
    /// port-forward`). /metrics, /healthz and /readyz answer everyone either way.
    #[arg(long, env = "COLOC_STATE_PUBLIC")]
    pub state_public: bool,
    /// Leave coloc_process_info out of /metrics. It names the namespace, pod and container
    /// of every GPU process on the node (what joins the agent's series to pods and to
    /// DCGM's), and /metrics answers any client that reaches the port; with this flag no
    /// series names a pod (the per-namespace counters of what co-location earned stay).
    #[arg(long, env = "COLOC_METRICS_WITHOUT_PODS")]
    pub metrics_without_pods: bool,
    /// HTTP: a request head must be complete this long after the connection is accepted
    /// (or after the first byte of a following request), else the connection is closed.
    /// Probes and scrapers send their few hundred bytes at once; 5 s is ample on a loaded
    /// node and frees a half-sent request's resources quickly.
    #[arg(long, env = "COLOC_HTTP_HEADER_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub http_header_timeout: Duration,
    /// HTTP: a connection that moves no byte for this long is closed (a kept-alive
    /// connection waiting for its next request, a client that stopped reading). 30 s
    /// keeps a scraper's connection across a 15 s scrape interval.
    #[arg(long, env = "COLOC_HTTP_IDLE_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub http_idle_timeout: Duration,
    /// HTTP: open connections at most; one more closes the oldest connection that has not
    /// sent a complete request yet (else the oldest), so a flood cannot lock probes out.
    /// 64 is far above what kubelet probes and a few scrapers use, and bounds the server's
    /// memory to a few MiB (16 KiB of read buffer per connection).
    #[arg(long, env = "COLOC_HTTP_MAX_CONNECTIONS", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub http_max_connections: u32,
}

impl RunArgs {
    /// The HTTP server's limits (validated).
    pub fn http_limits(&self) -> Result<crate::http::Limits> {
        for (flag, d) in [
            ("--http-header-timeout", self.http_header_timeout),
            ("--http-idle-timeout", self.http_idle_timeout),
        ] {
            if d < Duration::from_millis(100) || d > Duration::from_secs(3600) {
                bail!("{flag} {d:?}: allowed 100ms to 1h");
            }
        }
        Ok(crate::http::Limits {
            header_timeout: self.http_header_timeout,
            idle_timeout: self.http_idle_timeout,
            max_connections: self.http_max_connections as usize,
        })
    }

    /// Validates the arguments into the loop configuration.
    pub fn loop_config(&self) -> Result<LoopConfig> {
        if self.poll_interval < Duration::from_micros(100)
            || self.poll_interval > Duration::from_secs(1)
        {
            bail!(
                "--poll-interval {:?}: allowed 100us to 1s",
                self.poll_interval
            );
        }
        if self.idle_window.is_zero() {
            bail!("--idle-window must be positive");
        }
        for (flag, d) in [
            ("--nvml-interval", self.nvml_interval),
            ("--process-interval", self.process_interval),
            ("--recheck-interval", self.recheck_interval),
            ("--idle-poll-interval", self.idle_poll_interval),
        ] {
            if d < Duration::from_micros(100) {
                bail!("{flag} {d:?}: must be at least 100us (below it the loop would spin)");
            }
        }
        if self.nvml_interval > Duration::from_secs(10) {
            bail!(
                "--nvml-interval {:?}: allowed up to 10s",
                self.nvml_interval
            );
        }
        if self.nvml_sample_period > Duration::from_secs(10) {
            bail!(
                "--nvml-sample-period {:?}: allowed up to 10s",
                self.nvml_sample_period
            );
        }
        if self.nvml_hang_timeout < Duration::from_millis(10) {
            bail!(
                "--nvml-hang-timeout {:?}: must be at least 10ms (NVML calls take up to a few ms)",
                self.nvml_hang_timeout
            );
        }
        if self.release != ReleaseRule::Fixed {
            if !self.gate {
                bail!("--release {} needs --gate (the gate bounds what a release too early costs online)",
                    if self.release == ReleaseRule::AtOnce { "at-once" } else { "learned" });
            }
            if self.release_floor.is_zero() || self.release_floor > self.idle_window {
                bail!(
                    "--release-floor {:?}: must be positive and at most --idle-window ({:?})",
                    self.release_floor,
                    self.idle_window
                );
            }
            if self.release_ratio == 0 {
                bail!("--release-ratio must be at least 1");
            }
            if self.release_drain.is_zero() {
                bail!("--release-drain must be positive");
            }
        }
        if let Some(d) = self.device_plugin {
            let how = format!(
                "--device-plugin {}",
                if d == crate::edges::deviceplugin::Delivery::Cdi {
                    "cdi"
                } else {
                    "mounts"
                }
            );
            if self.rules.is_some() {
                bail!("{how} is for Kubernetes nodes (the kubelet asks for the slots): drop it with --rules");
            }
            if self.no_doorbells {
                bail!("{how} delivers the doorbell directories: drop --no-doorbells");
            }
            let lib = &self.shim_library;
            if !lib.is_absolute() || lib.parent().is_none_or(|p| p == std::path::Path::new("/")) {
                bail!("--shim-library {}: an absolute path of a file in a directory of its own (the directory is mounted into pods)", lib.display());
            }
        }
        if self.gate && self.no_doorbells {
            bail!("--gate needs the doorbells (the gate's acknowledgements come in the pages): drop --no-doorbells");
        }
        if self.gate_timeout.is_zero() || self.gate_timeout > self.confirm_timeout {
            bail!(
                "--gate-timeout {:?}: must be positive and at most --confirm-timeout ({:?})",
                self.gate_timeout,
                self.confirm_timeout
            );
        }
        if !self.loop_slice.is_zero()
            && (self.loop_slice < Duration::from_micros(100)
                || self.loop_slice > Duration::from_millis(100))
        {
            bail!(
                "--loop-slice {:?}: must be 0 (the kernel's default) or from 100us to 100ms (the kernel's bounds)",
                self.loop_slice
            );
        }
        if let Some(l) = self.cpu_wake_latency {
            if l > Duration::from_secs(1) {
                bail!("--cpu-wake-latency {l:?}: at most 1s (no idle state takes that long to leave; leave the flag out to make no request)");
            }
        }
        if self.duty_period < Duration::from_millis(10) {
            bail!(
                "--duty-period {:?}: must be at least 10ms",
                self.duty_period
            );
        }
        if self.memory_reserve.is_some() {
            if self.memory_interval < Duration::from_millis(10)
                || self.memory_interval > Duration::from_secs(10)
            {
                bail!(
                    "--memory-interval {:?}: allowed 10ms to 10s",
                    self.memory_interval
                );
            }
            if self.restore_after < Duration::from_secs(1) {
                bail!(
                    "--restore-after {:?}: at least 1s (a checkpoint takes seconds; restoring sooner would undo it at once)",
                    self.restore_after
                );
            }
        }
        let cgroups = CgroupMounts::detect(&self.cgroup_root);
        if self.actuator == Kind::Freezer && cgroups.v2.is_none() && cgroups.v1_freezer.is_none() {
            bail!(
                "--actuator freezer: no cgroup v2 hierarchy or v1 freezer found under {} \
                 (use --cgroup-root, or --actuator signal)",
                self.cgroup_root.display()
            );
        }
        Ok(LoopConfig {
            poll: self.poll_interval,
            idle_poll: self.idle_poll_interval,
            process_interval: self.process_interval,
            nvml_interval: self.nvml_interval,
            nvml_sample_period: self.nvml_sample_period,
            machine: qos_core::Config {
                idle_window: self.idle_window.as_nanos() as u64,
                unmanaged_is_online: self.unmanaged_is_online,
                duty_period: self.duty_period.as_nanos() as u64,
            },
            actuator: self.actuator,
            dry_run: self.dry_run,
            confirm_timeout: self.confirm_timeout,
            cgroups,
            event_log: self.event_log.clone(),
            loop_nice: self.loop_nice,
            loop_rt_priority: self.loop_rt_priority,
            loop_slice: self.loop_slice,
            nvml_grace: self.nvml_failure_grace,
            nvml_hang_timeout: self.nvml_hang_timeout,
            recheck: self.recheck_interval,
            gate_timeout: self.gate_timeout,
            doorbell_trust_window: self.doorbell_trust_window,
            record_off_loop: true,
            release: (self.release != ReleaseRule::Fixed).then(|| Learning {
                adaptive: qos_core::release::Adaptive {
                    floor: self.release_floor.as_nanos() as u64,
                    ratio: self.release_ratio,
                    ..qos_core::release::Adaptive::default()
                },
                drain_ns: self.release_drain.as_nanos() as u64,
                at_once: self.release == ReleaseRule::AtOnce,
            }),
            driver_book: crate::control::driver_book::DriverBookConfig {
                // Set by the caller once the driver's library is loaded.
                api: false,
                lock: self.driver_lock,
                reserve: self.memory_reserve,
                restore_after_ns: self.restore_after.as_nanos() as u64,
                pods: self.checkpoint_pods,
                memory_interval_ns: self.memory_interval.as_nanos() as u64,
                lock_timeout: self.confirm_timeout,
            },
            node: self
                .node_name
                .clone()
                .or_else(|| {
                    std::fs::read_to_string("/etc/hostname")
                        .ok()
                        .map(|s| s.trim().to_string())
                })
                .unwrap_or_else(|| "unknown".into()),
        })
    }
}
