//! The fast path for a pod that asks for `nvidia.com/gpu`, not mGPU: two pods go through
//! the webhook's own output (`coloc-webhook --translate`, backend `nvidia-shared`, with
//! `[shim]` pointing at the agent's directories) — an offline one classified by
//! Koordinator's `koordinator.sh/qosClass: BE` alone, and an online one that says nothing
//! (online by default). They are then run as a kubelet would run them: each container's
//! environment as the pod spec gives it, its paths resolved through the pod's volumes
//! (`hostPath` plus `subPathExpr: $(COLOC_POD_UID)`), in a kubelet-style cgroup of the pod,
//! and listed by the fake API server the agent watches. The agent must see the online
//! pod's doorbell in its own directory and hold the offline pod at its gate. A third pod,
//! offline by the same label but opted out (`gpu-coloc.dev/shim: disabled`), runs without
//! the shim, and the agent's coverage says so, per process and as a metric.

use coloc_e2e::fakeapi::FakeApi;
use coloc_e2e::*;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

const OFF_UID: &str = "5b1f0c2e-7a43-4d6b-9e21-0c3d4e5f6a7b";
const ON_UID: &str = "5b1f0c2e-7a43-4d6b-9e21-0c3d4e5f6a7c";
const OUT_UID: &str = "5b1f0c2e-7a43-4d6b-9e21-0c3d4e5f6a7d";

/// The pod as a user writes it (what the API server sends the webhook at CREATE).
fn user_pod(name: &str, label: Option<(&str, &str)>) -> Value {
    let mut p = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "ml", "labels": {"app": name}},
        "spec": {"containers": [{
            "name": "main", "image": "registry.example.com/cuda-app:1",
            "resources": {"limits": {"nvidia.com/gpu": "1"}}
        }]}
    });
    if let Some((k, v)) = label {
        p["metadata"]["labels"][k] = json!(v);
    }
    p
}

/// `coloc-webhook --translate` of `pod` with `settings`: /inject, /mutate,
/// /validate-mounts, as the API server calls them.
fn through_the_webhook(dir: &Path, settings: &str, pod: &Value) -> Value {
    let conf = dir.join("webhook.toml");
    std::fs::write(&conf, settings).unwrap();
    let file = dir.join(unique("pod")).with_extension("json");
    std::fs::write(&file, pod.to_string()).unwrap();
    let out = output_within(
        Command::new(bin("coloc-webhook"))
            .arg("--config")
            .arg(&conf)
            .arg("--translate")
            .arg(&file),
        Duration::from_secs(20),
    );
    assert!(
        out.status.success(),
        "coloc-webhook --translate: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// What a kubelet gives container `main` of `pod` (stored with `uid`): its environment,
/// with `fieldRef metadata.uid` resolved and every path that lies under a volume mount
/// mapped to the host path the mount shows there.
fn kubelet_env(pod: &Value, uid: &str) -> HashMap<String, String> {
    let c = &pod["spec"]["containers"][0];
    let mut env = HashMap::new();
    for e in c["env"].as_array().into_iter().flatten() {
        let name = e["name"].as_str().unwrap().to_string();
        let value = if e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid" {
            uid.to_string()
        } else {
            e["value"].as_str().unwrap_or_default().to_string()
        };
        env.insert(name, value);
    }
    let volumes: HashMap<&str, &str> = pod["spec"]["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| Some((v["name"].as_str()?, v["hostPath"]["path"].as_str()?)))
        .collect();
    // (container path, host path), longest first.
    let mut mounts: Vec<(String, PathBuf)> = Vec::new();
    for m in c["volumeMounts"].as_array().into_iter().flatten() {
        let host = volumes[m["name"].as_str().unwrap()];
        let mut host = PathBuf::from(host);
        if let Some(expr) = m["subPathExpr"].as_str() {
            let mut sub = expr.to_string();
            for (k, v) in &env {
                sub = sub.replace(&format!("$({k})"), v);
            }
            host = host.join(sub);
            std::fs::create_dir_all(&host).unwrap();
        }
        mounts.push((m["mountPath"].as_str().unwrap().to_string(), host));
    }
    mounts.sort_by_key(|(p, _)| std::cmp::Reverse(p.len()));
    let map = |v: &str| -> String {
        for (inside, host) in &mounts {
            if v == inside {
                return host.display().to_string();
            }
            if let Some(rest) = v.strip_prefix(&format!("{inside}/")) {
                return host.join(rest).display().to_string();
            }
        }
        v.to_string()
    };
    for key in ["LD_PRELOAD", "COLOC_DOORBELL_DIR", "COLOC_GATE_FILE"] {
        if let Some(v) = env.get(key).cloned() {
            let mapped: Vec<String> = v.split(':').map(map).collect();
            env.insert(key.to_string(), mapped.join(":"));
        }
    }
    env
}

fn kube_cgroup(base: &TestCgroup, uid: &str, cid: &str) -> TestCgroup {
    let rel = format!(
        "{}/kubepods/besteffort/pod{uid}/{cid}",
        base.path.trim_start_matches('/')
    );
    match base.version {
        "v2" => TestCgroup::v2(&rel),
        _ => TestCgroup::v1(&rel),
    }
    .expect("nested cgroup")
}

/// A `coloc-sim` workload on the fake driver in `cg` with the kubelet's environment.
fn spawn(sim: &Sim, cg: &TestCgroup, env: &HashMap<String, String>, args: &[&str]) -> Proc {
    let mut c = coloc_sim::command_in_cgroup(&cg.dir, &bin("coloc-sim"));
    c.args(args)
        .arg("--cuda")
        .envs(env)
        .env("COLOC_SIM_STATE", &sim.state)
        .env("LD_LIBRARY_PATH", fake_cuda())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    Proc(c.spawn().expect("spawn workload"))
}

/// The test's cgroup: v2 where usable, else the v1 freezer hierarchy (said).
fn base_cgroup(name: &str) -> TestCgroup {
    TestCgroup::try_v2(name).unwrap_or_else(|why| {
        eprintln!("NOTE: cgroup v2 not usable ({why}): using the v1 freezer hierarchy");
        TestCgroup::try_v1(name)
            .unwrap_or_else(|why1| panic!("a cgroup hierarchy is required: v2: {why}; v1: {why1}"))
    })
}

/// The kubelet-style directories the pods' cgroups left under `base`.
fn remove_kube_cgroups(base: &TestCgroup) {
    for uid in [OFF_UID, ON_UID, OUT_UID] {
        let _ = std::fs::remove_dir(base.dir.join(format!("kubepods/besteffort/pod{uid}")));
    }
    for d in ["kubepods/besteffort", "kubepods"] {
        let _ = std::fs::remove_dir(base.dir.join(d));
    }
}

/// `pod` as the API server stores it (with `uid`), scheduled to node1 and running, its
/// first container with the runtime's ID `container_id` (its cgroup's scope).
fn store(api: &FakeApi, pod: &Value, uid: &str, container_id: &str) {
    let mut stored = pod.clone();
    stored["metadata"]["uid"] = json!(uid);
    stored["metadata"]["resourceVersion"] = json!("1");
    stored["spec"]["nodeName"] = json!("node1");
    stored["status"] = json!({"phase": "Running", "containerStatuses": [{
        "name": pod["spec"]["containers"][0]["name"], "containerID": format!("containerd://{container_id}"),
        "image": "registry.example.com/cuda-app:1", "imageID": "", "ready": true, "restartCount": 0}]});
    api.apply(stored);
}

/// Runs the online pod's process (4 requests/s of 20 ms for 3 s) and checks that the agent
/// saw it through its doorbell and held the offline pod at its gate, confirmed.
fn online_is_seen_and_offline_gated(
    sim: &Sim,
    on_cg: &TestCgroup,
    on_env: &HashMap<String, String>,
    dir: &Path,
    events: &Path,
    agent: &Agent,
) {
    let out = dir.join("online.json");
    let args = "online --gpu 0 --rate 4 --work-ms 20 --duration-s 3 --seed 3 --out";
    let mut args: Vec<&str> = args.split(' ').collect();
    let out_s = out.display().to_string();
    args.push(&out_s);
    let mut on = spawn(sim, on_cg, on_env, &args);
    assert!(on.wait_within("online", Duration::from_secs(20)).success());
    let preempts: Vec<Value> = std::fs::read_to_string(events)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["event"] == "preempt")
        .collect();
    let gated: Vec<&Value> = preempts
        .iter()
        .filter(|e| e["signal"] == "doorbell" && e["actuator"] == "gate")
        .collect();
    assert!(
        !gated.is_empty(),
        "no preemption seen by the online pod's doorbell and drained at the offline pod's gate: {preempts:?}\n{}",
        agent.log_text()
    );
    for e in &gated {
        assert!(e["confirmed_ns"].as_u64().is_some(), "not confirmed: {e}");
    }
}

#[test]
fn an_nvidia_gpu_pod_classified_be_by_koordinator_is_held_at_its_gate() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(FakeApi::start());
    let name = unique("coloc-e2e-kshim");
    let base = base_cgroup(&name);
    let off_cg = kube_cgroup(&base, OFF_UID, "cri-containerd-0ff.scope");
    let out_cg = kube_cgroup(&base, OUT_UID, "cri-containerd-00d.scope");
    let on_cg = kube_cgroup(&base, ON_UID, "cri-containerd-0a.scope");

    let sim = Sim::start(1, &["--sample-period-ms", "100"]);
    let dir = TempPath::dir("coloc-e2e-kshim");
    let kubeconfig = api.kubeconfig(&dir);
    let gate_dir = dir.join("gate");
    let events = dir.join("events.jsonl");
    let (gd, ev) = (gate_dir.display().to_string(), events.display().to_string());
    let gate_file = format!("{gd}/gates");
    let agent = Agent::spawn_with(
        &sim,
        &[
            "--node-name",
            "node1",
            "--actuator",
            "freezer",
            "--gate",
            "--gate-file",
            &gate_file,
            "--event-log",
            &ev,
        ],
        &[
            ("KUBECONFIG", kubeconfig.as_os_str()),
            ("COLOC_NVML_INTERVAL", "100ms".as_ref()),
            ("COLOC_NVML_SAMPLE_PERIOD", "100ms".as_ref()),
        ],
    );
    rt.block_on(api.watching(Duration::from_secs(15)));

    // The webhook's settings: the chart's [shim], on this node's directories.
    let settings = format!(
        "backend = \"nvidia-shared\"\n[shim]\nlibrary = \"{}\"\ndoorbell_dir = \"{}\"\ngate_dir = \"{gd}\"\n",
        bin("libcoloc_cuda.so").display(),
        agent.doorbell_dir.display()
    );
    let offline = through_the_webhook(
        &dir,
        &settings,
        &user_pod("trainer", Some(("koordinator.sh/qosClass", "BE"))),
    );
    let online = through_the_webhook(&dir, &settings, &user_pod("server", None));
    let mut opted = user_pod("batch", Some(("koordinator.sh/qosClass", "BE")));
    opted["metadata"]["annotations"] = json!({"gpu-coloc.dev/shim": "disabled"});
    let opted = through_the_webhook(&dir, &settings, &opted);
    assert!(
        opted["spec"]["containers"][0]["env"].is_null(),
        "opted out, yet injected: {opted}"
    );
    for (p, class) in [(&offline, "offline"), (&online, "online")] {
        assert_eq!(
            p["metadata"]["annotations"]["gpu-coloc.dev/shim-injected"], "main",
            "{p}"
        );
        let c = &p["spec"]["containers"][0];
        let shim_class = c["env"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == "COLOC_SHIM_CLASS")
            .map(|e| e["value"].clone());
        assert_eq!(shim_class, Some(json!(class)), "{p}");
        assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], "1", "unchanged");
    }

    // Stored by the API server, scheduled to node1, running.
    for (p, uid, id) in [
        (&offline, OFF_UID, "0ff"),
        (&online, ON_UID, "0a"),
        (&opted, OUT_UID, "00d"),
    ] {
        store(&api, p, uid, id);
    }
    let pods = agent.doorbell_dir.join("pods");
    wait_for(
        "the pods' doorbell directories",
        Duration::from_secs(5),
        || pods.join(OFF_UID).is_dir() && pods.join(ON_UID).is_dir(),
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log_text()));

    let off_env = kubelet_env(&offline, OFF_UID);
    let on_env = kubelet_env(&online, ON_UID);
    assert_eq!(
        PathBuf::from(&on_env["COLOC_DOORBELL_DIR"]),
        pods.join(ON_UID),
        "the online pod writes to its own directory only"
    );
    assert_eq!(off_env["COLOC_GATE_FILE"], gate_file);
    let off = spawn(
        &sim,
        &off_cg,
        &off_env,
        &[
            "offline",
            "--gpu",
            "0",
            "--step-ms",
            "2",
            "--queue-depth",
            "16",
        ],
    );
    let _out = spawn(
        &sim,
        &out_cg,
        &HashMap::new(),
        &["offline", "--gpu", "0", "--step-ms", "2"],
    );
    // Coverage: the gated pod's process has its page; the opted-out one has none, and
    // says why.
    let shim_of = |owner: &str| -> Option<String> {
        agent.state()["gpus"][0]["processes"]
            .as_array()?
            .iter()
            .find(|p| p["owner"] == owner && p["class"] == "offline")
            .and_then(|p| p["shim"].as_str().map(String::from))
    };
    wait_for(
        "the agent's coverage of both offline pods",
        Duration::from_secs(5),
        || {
            shim_of("ml/trainer").as_deref() == Some("page")
                && shim_of("ml/batch").as_deref() == Some("opted_out")
        },
    )
    .unwrap_or_else(|e| panic!("{e}: {}\n{}", agent.state(), agent.log_text()));
    wait_for("the coverage metric", Duration::from_secs(5), || {
        let m = agent.metrics();
        let n = |shim: &str| {
            metric(
                &m,
                "coloc_shim_coverage_processes",
                &["class=\"offline\"", &format!("shim=\"{shim}\"")],
            )
        };
        n("opted_out") == 1.0 && n("page") == 1.0 && n("not_injected") == 0.0
    })
    .unwrap_or_else(|e| panic!("{e}: {}", agent.metrics()));
    // The same per pod: coloc_process_info names each pod's namespace, pod, container
    // (from its status, by the ID in its cgroup path), the GPU's UUID, its hold and shim.
    let state = agent.state();
    let uuid = state["gpus"][0]["uuid"].as_str().unwrap().to_string();
    for (pod, shim) in [("trainer", "page"), ("batch", "opted_out")] {
        // The hold /state names for it: what stops it (its launch gate, where its page is
        // seen, only drains it first).
        let actuator = state["gpus"][0]["processes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["owner"] == format!("ml/{pod}"))
            .and_then(|p| p["actuator"].as_str())
            .unwrap_or_else(|| panic!("ml/{pod} has no actuator in {state}"))
            .to_string();
        let want = format!(
            "coloc_process_info{{namespace=\"ml\",pod=\"{pod}\",container=\"main\",class=\"offline\",gpu=\"0\",UUID=\"{uuid}\",actuator=\"{actuator}\",shim=\"{shim}\"}} 1"
        );
        let m = agent.metrics();
        assert!(m.lines().any(|l| l == want), "no {want} in\n{m}");
    }
    online_is_seen_and_offline_gated(&sim, &on_cg, &on_env, &dir, &events, &agent);
    wait_for("nothing suspended", Duration::from_secs(3), || {
        agent.state()["suspended_targets"] == 0
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log_text()));
    drop(off);
    drop(agent);
    drop((off_cg, on_cg, out_cg));
    remove_kube_cgroups(&base);
}

/// The kubelet's side of the device plugin (`tests/e2e/kubelet/kubelet.py`: real gRPC from
/// grpcio, real protobuf from the kubelet's field numbers), its events as they come.
struct Kubelet {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    events: std::sync::mpsc::Receiver<Value>,
}

impl Kubelet {
    fn start(plugin_dir: &Path, pod_resources: &Path) -> Kubelet {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("kubelet/kubelet.py");
        let mut child = Command::new("python3")
            .arg(&script)
            .arg("--dir")
            .arg(plugin_dir)
            .arg("--pod-resources")
            .arg(pod_resources)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3");
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, events) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                if let Ok(v) = serde_json::from_str::<Value>(&line) {
                    let _ = tx.send(v);
                }
            }
        });
        let mut k = Kubelet {
            child,
            stdin,
            events,
        };
        k.next("ready", Duration::from_secs(30)).unwrap_or_else(|| {
            panic!("{} did not start: it needs grpcio and grpcio-tools (PyPI; scripts/test-all installs them)", script.display())
        });
        k
    }

    /// The next event named `name` (others skipped), within `timeout`.
    fn next(&mut self, name: &str, timeout: Duration) -> Option<Value> {
        let end = std::time::Instant::now() + timeout;
        while let Some(left) = end.checked_duration_since(std::time::Instant::now()) {
            match self.events.recv_timeout(left) {
                Ok(v) if v["event"] == name => return Some(v),
                Ok(_) => continue,
                Err(_) => return None,
            }
        }
        None
    }

    fn send(&mut self, cmd: Value) {
        use std::io::Write;
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
    }

    /// Allocates `ids` of `resource` to container `main` of pod `pod`: the plugin's answer.
    fn allocate(&mut self, resource: &str, ids: &[&str], pod: &str) -> Value {
        self.send(json!({"allocate": {"resource": resource, "ids": ids, "pod": pod, "container": "main"}}));
        let end = std::time::Instant::now() + Duration::from_secs(10);
        while let Some(left) = end.checked_duration_since(std::time::Instant::now()) {
            match self.events.recv_timeout(left) {
                Ok(v) if v["event"] == "allocated" || v["event"] == "refused" => return v,
                Ok(_) => continue,
                Err(_) => break,
            }
        }
        panic!("no answer to the allocation of {ids:?}");
    }

    /// The two classes' registrations, by resource.
    fn registrations(&mut self) -> HashMap<String, Value> {
        let mut out = HashMap::new();
        while out.len() < 2 {
            let v = self
                .next("registered", Duration::from_secs(15))
                .expect("the agent registered both classes with the kubelet");
            out.insert(v["resource"].as_str().unwrap().to_string(), v);
        }
        out
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The environment a container gets from its pod spec and from the device plugin's
/// allocation (`mounts` delivery): paths under an allocated mount mapped to its host path.
fn device_env(pod: &Value, uid: &str, allocation: &Value) -> HashMap<String, String> {
    let mut env = kubelet_env(pod, uid);
    for (k, v) in allocation["envs"].as_object().into_iter().flatten() {
        env.insert(k.clone(), v.as_str().unwrap().to_string());
    }
    let mut mounts: Vec<(String, PathBuf)> = allocation["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["container_path"].as_str().unwrap().to_string(),
                PathBuf::from(m["host_path"].as_str().unwrap()),
            )
        })
        .collect();
    mounts.sort_by_key(|(p, _)| std::cmp::Reverse(p.len()));
    for key in ["COLOC_DOORBELL_DIR", "COLOC_GATE_FILE"] {
        if let Some(v) = env.get(key).cloned() {
            for (inside, host) in &mounts {
                if v == *inside {
                    env.insert(key.into(), host.display().to_string());
                    break;
                }
                if let Some(rest) = v.strip_prefix(&format!("{inside}/")) {
                    env.insert(key.into(), host.join(rest).display().to_string());
                    break;
                }
            }
        }
    }
    env
}

/// The shim as a device, with no host path in the pod: the webhook (`delivery =
/// "device"`) gives an `nvidia.com/gpu` pod classified BE by Koordinator one offline slot
/// and an unclassified one an online slot; the agent registers both classes with a kubelet
/// that speaks real gRPC, answers its allocations (and refuses two slots in a container),
/// learns from the pod-resources API which pod holds which slot, reads the online pod's
/// doorbell from its slot and holds the offline pod at its gate. When the kubelet
/// restarts, the agent registers again.
#[test]
fn an_nvidia_gpu_pod_gets_the_shim_as_a_device_and_is_held_at_its_gate() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(FakeApi::start());
    let name = unique("coloc-e2e-kdev");
    let base = base_cgroup(&name);
    let off_cg = kube_cgroup(&base, OFF_UID, "cri-containerd-1ff.scope");
    let on_cg = kube_cgroup(&base, ON_UID, "cri-containerd-1a.scope");
    let sim = Sim::start(1, &["--sample-period-ms", "100"]);
    let dir = TempPath::dir("coloc-e2e-kdev");
    let plugin_dir = dir.join("device-plugins");
    let pod_resources = dir.join("pod-resources.sock");
    std::fs::create_dir_all(&plugin_dir).unwrap();
    let mut kubelet = Kubelet::start(&plugin_dir, &pod_resources);
    let kubeconfig = api.kubeconfig(&dir);
    let gate_dir = dir.join("gate");
    let events = dir.join("events.jsonl");
    let (gd, ev) = (gate_dir.display().to_string(), events.display().to_string());
    let gate_file = format!("{gd}/gates");
    let lib = bin("libcoloc_cuda.so").display().to_string();
    let (pd, prs) = (
        plugin_dir.display().to_string(),
        pod_resources.display().to_string(),
    );
    let agent = Agent::spawn_with(
        &sim,
        &[
            "--node-name",
            "node1",
            "--actuator",
            "freezer",
            "--gate",
            "--gate-file",
            &gate_file,
            "--event-log",
            &ev,
            "--device-plugin",
            "mounts",
            "--device-plugin-dir",
            &pd,
            "--pod-resources-socket",
            &prs,
            "--shim-slots",
            "8",
            "--shim-library",
            &lib,
        ],
        &[
            ("KUBECONFIG", kubeconfig.as_os_str()),
            ("COLOC_NVML_INTERVAL", "100ms".as_ref()),
            ("COLOC_NVML_SAMPLE_PERIOD", "100ms".as_ref()),
        ],
    );
    rt.block_on(api.watching(Duration::from_secs(15)));
    let regs = kubelet.registrations();
    for class in ["online", "offline"] {
        let r = &regs[&format!("gpu-coloc.dev/shim-{class}")];
        let ids: Vec<&str> = r["devices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| {
                assert_eq!(d["health"], "Healthy");
                d["id"].as_str().unwrap()
            })
            .collect();
        let want: Vec<String> = (0..8).map(|i| format!("{class}-{i}")).collect();
        assert_eq!(ids, want, "{r}");
        assert_eq!(r["options"]["pre_start_required"], false);
    }

    let settings = format!(
        "backend = \"nvidia-shared\"\n[shim]\ndelivery = \"device\"\nlibrary = \"{lib}\"\ndoorbell_dir = \"{}\"\ngate_dir = \"{gd}\"\n",
        agent.doorbell_dir.display()
    );
    let offline = through_the_webhook(
        &dir,
        &settings,
        &user_pod("trainer", Some(("koordinator.sh/qosClass", "BE"))),
    );
    let online = through_the_webhook(&dir, &settings, &user_pod("server", None));
    for (p, class) in [(&offline, "offline"), (&online, "online")] {
        assert!(!p.to_string().contains("hostPath"), "{p}");
        assert_eq!(
            p["spec"]["containers"][0]["resources"]["limits"]
                [format!("gpu-coloc.dev/shim-{class}")],
            "1",
            "{p}"
        );
    }
    for (p, uid, id) in [(&offline, OFF_UID, "1ff"), (&online, ON_UID, "1a")] {
        store(&api, p, uid, id);
    }

    // Two slots in one container: refused (their mounts would collide).
    let r = kubelet.allocate(
        "gpu-coloc.dev/shim-offline",
        &["offline-1", "offline-2"],
        "ml/trainer",
    );
    assert_eq!(r["event"], "refused", "{r}");
    assert_eq!(r["code"], 9, "FAILED_PRECONDITION: {r}");
    let off_alloc = kubelet.allocate("gpu-coloc.dev/shim-offline", &["offline-5"], "ml/trainer");
    assert_eq!(off_alloc["event"], "allocated", "{off_alloc}");
    let on_alloc = kubelet.allocate("gpu-coloc.dev/shim-online", &["online-2"], "ml/server");
    assert_eq!(on_alloc["event"], "allocated", "{on_alloc}");
    let slot_dir = agent.doorbell_dir.join("pods/slot-offline-5");
    let m = off_alloc["response"]["mounts"].as_array().unwrap();
    assert!(
        m.iter()
            .any(|m| m["host_path"] == slot_dir.display().to_string()
                && m["container_path"] == agent.doorbell_dir.display().to_string()
                && m["read_only"] == false),
        "{m:?}"
    );
    assert!(
        m.iter()
            .any(|m| m["host_path"] == gd.as_str() && m["read_only"] == true),
        "{m:?}"
    );

    let off_env = device_env(&offline, OFF_UID, &off_alloc["response"]);
    let on_env = device_env(&online, ON_UID, &on_alloc["response"]);
    assert_eq!(PathBuf::from(&off_env["COLOC_DOORBELL_DIR"]), slot_dir);
    assert_eq!(off_env["COLOC_GATE_FILE"], gate_file);
    let off = spawn(
        &sim,
        &off_cg,
        &off_env,
        &[
            "offline",
            "--gpu",
            "0",
            "--step-ms",
            "2",
            "--queue-depth",
            "16",
        ],
    );
    let shim_of = |owner: &str| -> Option<String> {
        agent.state()["gpus"][0]["processes"]
            .as_array()?
            .iter()
            .find(|p| p["owner"] == owner && p["class"] == "offline")
            .and_then(|p| p["shim"].as_str().map(String::from))
    };
    wait_for(
        "the offline pod's page, read from its slot",
        Duration::from_secs(8),
        || shim_of("ml/trainer").as_deref() == Some("page"),
    )
    .unwrap_or_else(|e| panic!("{e}: {}\n{}", agent.state(), agent.log_text()));
    online_is_seen_and_offline_gated(&sim, &on_cg, &on_env, &dir, &events, &agent);

    // The kubelet restarts: its sockets are gone, the agent registers again.
    kubelet.send(json!({"restart": true}));
    kubelet
        .next("restarted", Duration::from_secs(10))
        .expect("restarted");
    let again = kubelet.registrations();
    assert_eq!(again.len(), 2);
    drop(off);
    drop(agent);
    drop(kubelet);
    drop((off_cg, on_cg));
    remove_kube_cgroups(&base);
}
