//! The Kubernetes pod source against a fake API server (real kube-rs client over HTTP on
//! 127.0.0.1), and the agent on a simulated GPU node with kubelet-style cgroups.

use coloc_agent::edges::procfs::{Cgroups, ProcInfo, ProcKey};
use coloc_agent::edges::source::kube::KubeSource;
use coloc_agent::edges::source::PodSource;
use coloc_e2e::fakeapi::{pod, FakeApi};
use coloc_e2e::*;
use qos_core::Class;
use std::time::{Duration, Instant};

const UA: &str = "0f2c7a54-9a3b-4c1e-8d2f-6b5a4c3d2e1a";
const UB: &str = "0f2c7a54-9a3b-4c1e-8d2f-6b5a4c3d2e1b";
const UC: &str = "0f2c7a54-9a3b-4c1e-8d2f-6b5a4c3d2e1c";
const UD: &str = "0f2c7a54-9a3b-4c1e-8d2f-6b5a4c3d2e1d";
const UE: &str = "0f2c7a54-9a3b-4c1e-8d2f-6b5a4c3d2e1e";

async fn until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < timeout, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn class(src: &KubeSource, uid: &str) -> Option<Class> {
    src.get(uid).map(|e| e.class)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_list_events_gone_disconnect_and_flip() {
    let api = FakeApi::start().await;
    api.apply(pod(UA, "a", "node1", Some("reclaimed_cores")));
    api.apply(pod(UB, "b", "node1", Some("shared_cores")));
    api.apply(pod(UC, "c", "node2", Some("reclaimed_cores")));
    // The server holds its answer to the first list until the source has been seen not
    // ready: no race between the list completing and the assertion.
    api.hold_lists(true);
    let src = KubeSource::start(api.client(), "node1");
    until("the first list request", Duration::from_secs(10), || {
        api.list_requests() > 0
    })
    .await;
    assert!(!src.ready(), "ready before the first list was answered");
    assert!(
        !src.pod_gone(UA),
        "a pod called gone before the first list (its doorbell directory would go)"
    );
    assert_eq!(class(&src, UA), None, "pods known before the first list");
    api.hold_lists(false);
    until("first list", Duration::from_secs(10), || src.ready()).await;
    assert_eq!(class(&src, UA), Some(Class::Offline));
    assert_eq!(class(&src, UB), Some(Class::Online));
    assert_eq!(class(&src, UC), None, "pods of other nodes are not listed");
    assert!(!src.pod_gone(UA) && src.pod_gone(UC));
    api.watching(Duration::from_secs(10)).await;

    // Add, then a process in that pod's (systemd, containerd) cgroup is classified by it.
    api.apply(pod(UD, "d", "node1", Some("reclaimed_cores")));
    until("ADDED", Duration::from_secs(5), || src.get(UD).is_some()).await;
    let proc = ProcInfo {
        key: ProcKey { pid: 1, start: 1 },
        uid: 0,
        exe: None,
        cmdline: "python train.py".into(),
        cgroups: Cgroups::parse(&format!(
            "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/cri-containerd-abc.scope\n",
            UD.replace('-', "_")
        )),
        ns_pid: None,
    };
    let c = src.classify(&proc);
    assert_eq!((c.class, c.owner.as_str()), (Class::Offline, "ml/d"));
    assert!(c
        .freeze_cgroup
        .unwrap()
        .ends_with("cri-containerd-abc.scope"));

    // Annotation flips from shared_cores to reclaimed_cores.
    let g = src.generation();
    api.apply(pod(UB, "b", "node1", Some("reclaimed_cores")));
    until("MODIFIED", Duration::from_secs(5), || {
        class(&src, UB) == Some(Class::Offline)
    })
    .await;
    assert!(src.generation() > g, "a class change bumps the generation");

    // Delete.
    api.delete(UA, false);
    until("DELETED", Duration::from_secs(5), || src.get(UA).is_none()).await;
    assert!(src.pod_gone(UA), "a deleted pod is not gone");

    // 410 Gone: the watcher relists and sees what changed while it was not watching.
    let lists = api.lists();
    api.delete(UB, true);
    api.apply_silently(pod(UE, "e", "node1", Some("shared_cores")));
    api.expire_watches();
    until("relist after 410", Duration::from_secs(10), || {
        api.lists() > lists
    })
    .await;
    until(
        "index replaced by the relist",
        Duration::from_secs(5),
        || src.get(UB).is_none() && src.get(UE).is_some(),
    )
    .await;

    // Disconnect while the API server fails lists: keep the last known pods and stay ready.
    api.fail_lists(true);
    api.disconnect();
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(1500) {
        assert!(
            src.ready(),
            "not ready {:?} after the disconnect",
            t.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        class(&src, UD),
        Some(Class::Offline),
        "last known pods are kept"
    );
    api.fail_lists(false);
    // A dropped watch is re-opened from the last resource version (no relist needed).
    api.watching(Duration::from_secs(30)).await;
    api.apply(pod(UA, "a2", "node1", Some("system_cores")));
    until("events after recovery", Duration::from_secs(5), || {
        class(&src, UA) == Some(Class::System)
    })
    .await;
}

/// Raises the calling thread's priority to nice -10, as the agent's loop runs, so that a
/// latency measured beside other CPU-bound work (the rest of the suite, a loaded CI
/// machine) is the code's, not the scheduler's. Says so where the host refuses.
fn nice_thread() {
    // SAFETY: setpriority(2) on the calling thread (PRIO_PROCESS with 0 is the caller's
    // thread on Linux); no memory is passed.
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, -10) } != 0 {
        eprintln!(
            "NOTE: cannot raise this thread's priority ({}): the latency is measured at normal priority",
            std::io::Error::last_os_error()
        );
    }
}

/// The pod source's own latency, from the API server's write to the index: the test's
/// runtime (the fake API server and the kube-rs client alike) runs at nice -10.
#[test]
fn event_to_classification_latency() {
    nice_thread();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .on_thread_start(nice_thread)
        .enable_all()
        .build()
        .unwrap()
        .block_on(event_to_classification_latency_in())
}

async fn event_to_classification_latency_in() {
    let api = FakeApi::start().await;
    let src = KubeSource::start(api.client(), "node1");
    until("first list", Duration::from_secs(10), || src.ready()).await;
    api.watching(Duration::from_secs(10)).await;
    let mut rx = src.subscribe().unwrap();
    let mut lat = Vec::new();
    for i in 0..200u32 {
        let uid = format!("0f2c7a54-9a3b-4c1e-8d2f-{i:012}");
        let (qos, want) = if i % 2 == 0 {
            ("reclaimed_cores", Class::Offline)
        } else {
            ("shared_cores", Class::Online)
        };
        rx.borrow_and_update();
        api.apply(pod(&uid, &format!("p{i}"), "node1", Some(qos)));
        tokio::time::timeout(Duration::from_secs(5), rx.changed())
            .await
            .unwrap_or_else(|_| panic!("event {i} not classified within 5 s"))
            .unwrap();
        let seen = Instant::now();
        // From the moment the fake API server wrote the event to the watch connection (not
        // when the test queued it: the server's own broadcast is not the agent's latency)
        // to the source's change notification, which follows the index update.
        let written = api
            .written_at(&uid)
            .expect("the event went out on the watch");
        assert_eq!(class(&src, &uid), Some(want), "pod {i} ({qos})");
        lat.push(seen.saturating_duration_since(written).as_secs_f64() * 1e3);
    }
    let pct = |q: f64| percentile(&lat, q);
    let (p50, p90, p99, max) = (pct(50.0), pct(90.0), pct(99.0), pct(100.0));
    eprintln!("pod event written by the API server -> classified in the agent's index: p50 {p50:.3} ms, p90 {p90:.3} ms, p99 {p99:.3} ms, max {max:.3} ms over {} events", lat.len());
    // Target: 5 ms (benches/RESULTS.md). This debug build measures p50 0.2-0.6 ms, p90
    // 0.3-1.5 ms, max 1-9 ms per 200 events on a 2-core machine at load 4-6 (two busy
    // loops beside other builds). So the bulk must meet the target itself, with room for
    // load: p50 < 2 ms, p90 < 5 ms; p99 (the third-worst of 200) < 20 ms leaves two
    // scheduling stalls of any length to the machine, and the tail to the benchmark.
    assert!(p50 < 2.0, "p50 {p50:.3} ms");
    assert!(p90 < 5.0, "p90 {p90:.3} ms (target 5 ms)");
    assert!(p99 < 20.0, "p99 {p99:.3} ms");
}

fn kube_cgroup(base: &TestCgroup, tier: &str, uid: &str, cid: &str) -> TestCgroup {
    let rel = format!(
        "{}/kubepods/{tier}/pod{uid}/{cid}",
        base.path.trim_start_matches('/')
    );
    match base.version {
        "v2" => TestCgroup::v2(&rel),
        _ => TestCgroup::v1(&rel),
    }
    .expect("nested cgroup")
}

#[test]
fn agent_on_a_kubernetes_node() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(FakeApi::start());
    let off_uid = "11111111-2222-3333-4444-555555555555";
    let on_uid = "66666666-7777-8888-9999-000000000000";
    let flip_uid = "aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee";
    api.apply(pod(off_uid, "trainer", "node1", Some("reclaimed_cores")));
    api.apply(pod(on_uid, "server", "node1", None));
    api.apply(pod(flip_uid, "flipper", "node1", Some("shared_cores")));
    api.fail_lists(true);

    let name = unique("coloc-e2e-kube");
    let base = TestCgroup::try_v2(&name).unwrap_or_else(|why| {
        eprintln!("NOTE: cgroup v2 freezer not usable ({why}): using the v1 freezer");
        TestCgroup::try_v1(&name)
            .unwrap_or_else(|why1| panic!("a cgroup freezer is required: v2: {why}; v1: {why1}"))
    });
    eprintln!(
        "agent_on_a_kubernetes_node: exercising the cgroup {} freezer",
        base.version
    );
    let off_cg = kube_cgroup(&base, "besteffort", off_uid, "cri-containerd-0ff.scope");
    let on_cg = kube_cgroup(&base, "burstable", on_uid, "cri-containerd-0a.scope");
    let flip_cg = kube_cgroup(&base, "besteffort", flip_uid, "cri-containerd-f1.scope");

    let sim = Sim::start(1, &[]);
    let dir = TempPath::dir("coloc-e2e-kubecfg");
    let kubeconfig = api.kubeconfig(&dir);
    let mut agent = Agent::spawn_with(
        &sim,
        &["--node-name", "node1", "--actuator", "freezer"],
        &[("KUBECONFIG", kubeconfig.as_os_str())],
    );
    // Not ready until the first pod list is in: lists fail, so once the agent has tried
    // one (and its HTTP endpoint is up) it must still say 503.
    wait_for(
        "the agent's first pod list and its HTTP endpoint",
        Duration::from_secs(15),
        || api.list_requests() > 0 && http_get(agent.port, "/readyz").is_ok(),
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log_text()));
    assert_eq!(
        http_get(agent.port, "/readyz").map(|r| r.0).unwrap_or(0),
        503,
        "{}",
        agent.log_text()
    );
    api.fail_lists(false);
    wait_for(
        "ready after the first list",
        Duration::from_secs(15),
        || {
            http_get(agent.port, "/readyz")
                .map(|r| r.0 == 200)
                .unwrap_or(false)
        },
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log_text()));

    // Each pod's own doorbell directory, made from the pod watch, 1777; no tenant can add
    // anything to pods/ (root's 0755).
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &std::path::Path| {
            std::fs::symlink_metadata(p)
                .map(|m| m.permissions().mode() & 0o7777)
                .ok()
        };
        let pods = agent.doorbell_dir.join("pods");
        wait_for(
            "the pods' doorbell directories",
            Duration::from_secs(3),
            || {
                [off_uid, on_uid, flip_uid]
                    .iter()
                    .all(|u| mode(&pods.join(u)) == Some(0o1777))
            },
        )
        .unwrap_or_else(|e| {
            panic!(
                "{e}
{}",
                agent.log_text()
            )
        });
        assert_eq!(mode(&pods), Some(0o755));
        assert_eq!(mode(&agent.doorbell_dir), Some(0o755));
    }

    let _off = sim.spawn_in_cgroup(&off_cg.dir, &["offline", "--step-ms", "2"]);
    let flip = sim.spawn_in_cgroup(&flip_cg.dir, &["offline", "--step-ms", "2"]);
    wait_for("agent classifies both", Duration::from_secs(5), || {
        agent.state()["gpus"][0]["processes"]
            .as_array()
            .is_some_and(|p| p.len() == 2)
    })
    .unwrap();
    let st = agent.state();
    let owners: Vec<String> = st["gpus"][0]["processes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            format!(
                "{}={}",
                p["owner"].as_str().unwrap(),
                p["class"].as_str().unwrap()
            )
        })
        .collect();
    assert!(
        owners.contains(&"ml/trainer=offline".to_string())
            && owners.contains(&"ml/flipper=online".to_string()),
        "{owners:?}"
    );

    // Online pod busy: only the offline pod's container cgroup is frozen.
    let _online = sim.spawn_in_cgroup(&on_cg.dir, &["busy", "--ms", "4000"]);
    wait_for("offline pod frozen", Duration::from_secs(3), || {
        off_cg.frozen()
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log_text()));
    holds_for(
        "shared_cores pod untouched",
        Duration::from_millis(300),
        || !flip_cg.frozen() && flip.state() != Some('T'),
    )
    .unwrap();

    // Its annotation flips to reclaimed_cores: frozen at once (GPU is busy).
    rt.block_on(api.watching(Duration::from_secs(10)));
    api.apply(pod(flip_uid, "flipper", "node1", Some("reclaimed_cores")));
    wait_for("flipped pod frozen", Duration::from_secs(3), || {
        flip_cg.frozen()
    })
    .unwrap();

    // The offline pod is deleted while frozen: the agent lets it go and forgets it.
    api.delete(off_uid, false);
    wait_for("deleted pod thawed", Duration::from_secs(3), || {
        !off_cg.frozen()
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log_text()));
    // The record is updated right after the thaw is confirmed.
    let read_record =
        || std::fs::read_to_string(agent.state_dir.join("suspended.json")).unwrap_or_default();
    wait_for(
        "record forgets the deleted pod",
        Duration::from_secs(2),
        || !read_record().contains(off_uid),
    )
    .unwrap_or_else(|e| panic!("{e}: {}", read_record()));
    let record = read_record();
    assert!(
        record.contains(flip_uid),
        "the still-offline pod stays recorded: {record}"
    );

    agent.signal(libc::SIGTERM);
    assert!(agent.wait().success());
    assert!(!flip_cg.frozen(), "SIGTERM resumes everything");
    drop((flip_cg, on_cg, off_cg));
    // Remove the intermediate directories, deepest first.
    for d in [
        format!("kubepods/besteffort/pod{off_uid}"),
        format!("kubepods/besteffort/pod{flip_uid}"),
        format!("kubepods/burstable/pod{on_uid}"),
        "kubepods/besteffort".into(),
        "kubepods/burstable".into(),
        "kubepods".into(),
    ] {
        let _ = std::fs::remove_dir(base.dir.join(d));
    }
}

/// `gpu-coloc.dev/checkpoint` is the tenant's own annotation and says only whether its own
/// memory may be checkpointed: "true" and "false" are read, anything else says nothing,
/// and a change (a tenant flipping it at any time) is followed. Nothing else of the
/// pod's classification moves with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_checkpoint_annotation_is_read_and_followed_and_changes_nothing_else() {
    let api = FakeApi::start().await;
    let with = |v: &str| {
        let mut p = pod(UA, "a", "node1", Some("reclaimed_cores"));
        p["metadata"]["annotations"]["gpu-coloc.dev/checkpoint"] = serde_json::json!(v);
        p["metadata"]["resourceVersion"] = serde_json::json!(format!("{}", v.len() + 1));
        p
    };
    api.apply(with("true"));
    let src = KubeSource::start(api.client(), "node1");
    until("first list", Duration::from_secs(10), || src.ready()).await;
    api.watching(Duration::from_secs(10)).await;
    assert_eq!(src.get(UA).and_then(|e| e.checkpoint), Some(true));
    for (v, want) in [
        ("false", Some(false)),
        ("yes please", None),
        ("true", Some(true)),
    ] {
        api.apply(with(v));
        until(
            &format!("the annotation {v:?} read"),
            Duration::from_secs(5),
            || src.get(UA).is_some_and(|e| e.checkpoint == want),
        )
        .await;
        assert_eq!(class(&src, UA), Some(Class::Offline), "{v:?}");
    }
}
