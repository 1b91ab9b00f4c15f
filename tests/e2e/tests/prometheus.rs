//! Proof against a real Prometheus: the agent (simulated GPU, real processes) and the
//! webhook are scraped by Debian's `prometheus` on 127.0.0.1; every dashboard query must
//! return data and every alert expression must parse and load. Needs `prometheus` and
//! `promtool` on PATH (the README's test command installs them).

use coloc_e2e::*;
use serde_json::Value;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn prom_query(port: u16, q: &str) -> Value {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    use std::io::{Read, Write};
    let enc: String = q
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect();
    let body = format!("query={enc}");
    write!(s, "POST /api/v1/query HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
    let mut buf = String::new();
    s.read_to_string(&mut buf).unwrap();
    let json = buf.split_once("\r\n\r\n").map(|x| x.1).unwrap_or("");
    // Chunked or not: take the JSON object.
    let start = json.find('{').unwrap_or(0);
    let end = json.rfind('}').map(|e| e + 1).unwrap_or(json.len());
    serde_json::from_str(&json[start..end]).unwrap_or(Value::Null)
}

fn substitute(expr: &str) -> String {
    expr.replace("$__rate_interval", "1m")
        .replace("$__range", "1m")
        .replace("$cluster", ".*")
        .replace("$node", ".*")
        .replace("$gpu", ".*")
}

struct Kill(std::process::Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn dashboard_and_alerts_against_real_prometheus() {
    assert!(
        Command::new("prometheus").arg("--version").output().is_ok(),
        "prometheus is not installed: run the README's test command (it installs Debian's prometheus)"
    );
    // promtool: rules parse and their unit tests pass.
    let rules_dir = root().join("deploy/prometheus");
    let out = Command::new("promtool")
        .args(["test", "rules", "rules_test.yaml"])
        .current_dir(&rules_dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "promtool test rules:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // The system under observation.
    let sim = Sim::start(1, &[]);
    // The online work by a rule of its own, so the info series names both classes.
    let agent = Agent::start(
        &sim,
        AgentOpts {
            rules: "[[rule]]\nname = \"off\"\nclass = \"reclaimed_cores\"\ncmdline = \"*coloc-sim offline*\"\n\n[[rule]]\nname = \"web\"\nclass = \"shared_cores\"\ncmdline = \"*coloc-sim busy*\"\n\n[[rule]]\nname = \"svc\"\nclass = \"shared_cores\"\ncmdline = \"*coloc-sim online*\"\n",
            ..AgentOpts::default()
        },
    );
    let _off = sim.spawn(&["offline", "--step-ms", "2"]);
    let _online = sim.spawn(&["busy", "--ms", "20", "--repeat", "200", "--gap-ms", "150"]);
    // Online requests under the CUDA shim (the fake driver): their doorbell page stamps
    // completions, so the agent times their runs.
    let _requests = Kill(
        sim.cmd(&[
            "online",
            "--gpu",
            "0",
            "--rate",
            "8",
            "--work-ms",
            "5",
            "--duration-s",
            "60",
            "--cuda",
        ])
        .env("LD_LIBRARY_PATH", fake_cuda())
        .env("LD_PRELOAD", bin("libcoloc_cuda.so"))
        .env("COLOC_SHIM_CLASS", "online")
        .env("COLOC_DOORBELL_DIR", &agent.doorbell_dir)
        .stdout(Stdio::null())
        .spawn()
        .unwrap(),
    );
    let wport = free_port();
    let _webhook = Kill(
        Command::new(bin("coloc-webhook"))
            .args([
                "--insecure-http",
                "--backend",
                "hami",
                "--listen",
                &format!("127.0.0.1:{wport}"),
            ])
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for("webhook", Duration::from_secs(10), || {
        http_get(wport, "/healthz")
            .map(|r| r.0 == 200)
            .unwrap_or(false)
    })
    .unwrap();
    let post = |path: &str, body: &[u8]| {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", wport)).unwrap();
        write!(s, "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len()).unwrap();
        s.write_all(body).unwrap();
        let mut b = String::new();
        s.read_to_string(&mut b).unwrap();
    };
    let data = root().join("webhook/tests/data");
    for f in ["offline-deployment-create", "deny-both-cores", "plain-pod"] {
        post(
            "/mutate",
            &std::fs::read(data.join(format!("{f}.json"))).unwrap(),
        );
        post(
            "/validate",
            &std::fs::read(data.join(format!("{f}.json"))).unwrap(),
        );
    }
    post("/mutate", b"{not json");
    // Counters that alerts wait on exist at 0 before their first event, so that
    // `increase()` sees that event.
    let before = agent.metrics();
    for series in [
        r#"coloc_fail_open_total{reason="nvml"} 0"#,
        r#"coloc_actuation_errors_total{actuator="freezer",op="suspend",reason="timeout"} 0"#,
    ] {
        assert!(
            before.contains(series),
            "{series} not in /metrics:\n{before}"
        );
    }
    // One fail-open episode.
    let probe = sim.open();
    probe
        .header()
        .nvml_fail
        .store(1, std::sync::atomic::Ordering::SeqCst);
    wait_for("fail-open counted", Duration::from_secs(5), || {
        metric(&agent.metrics(), "coloc_fail_open_total", &[]) >= 1.0
    })
    .unwrap();
    probe
        .header()
        .nvml_fail
        .store(0, std::sync::atomic::Ordering::SeqCst);

    // Prometheus scraping both every second, with the alert rules loaded.
    let dir = TempPath::dir("coloc-e2e-prom");
    let cfg = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n  - job_name: gpu-coloc-agent\n    static_configs:\n      - targets: ['127.0.0.1:{}']\n        labels:\n          node: node1\n  - job_name: gpu-coloc-webhook\n    static_configs:\n      - targets: ['127.0.0.1:{}']\n",
        rules_dir.join("rules.yaml").display(),
        agent.port,
        wport
    );
    std::fs::write(dir.join("prometheus.yml"), cfg).unwrap();
    let pport = free_port();
    let _prom = Kill(
        Command::new("prometheus")
            .arg(format!(
                "--config.file={}",
                dir.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{pport}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("prometheus.log")).unwrap())
            .spawn()
            .unwrap(),
    );
    wait_for("prometheus up", Duration::from_secs(20), || {
        http_get(pport, "/-/ready")
            .map(|r| r.0 == 200)
            .unwrap_or(false)
    })
    .unwrap();
    // Enough scrapes for rate() and histogram_quantile() to have two points with changes.
    let t = Instant::now();
    wait_for(
        "8 scrapes with preemptions",
        Duration::from_secs(30),
        || {
            let v = prom_query(
                pport,
                "count_over_time(coloc_preemption_latency_seconds_count{actuator=\"signal\"}[1m])",
            );
            v["data"]["result"][0]["value"][1]
                .as_str()
                .and_then(|s| s.parse::<f64>().ok())
                .unwrap_or(0.0)
                >= 8.0
        },
    )
    .unwrap();
    eprintln!("prometheus had 8 scrapes after {:?}", t.elapsed());

    // Every per-GPU series carries its GPU's UUID (the label DCGM's exporter uses), and
    // the per-process info series joins to them on it.
    let rows = |q: &str| {
        let r = prom_query(pport, q);
        assert_eq!(r["status"], "success", "{q}: {r}");
        r["data"]["result"].as_array().cloned().unwrap_or_default()
    };
    let without = rows(r#"count by (__name__) ({__name__=~"coloc_.+", gpu=~"[0-9]+", UUID=""})"#);
    assert!(
        without.is_empty(),
        "per-GPU series without a UUID: {without:?}"
    );
    assert!(
        !rows(r#"coloc_gpu_online_busy{UUID=~"GPU-[0-9a-f-]+"}"#).is_empty(),
        "no UUID in NVML's form on coloc_gpu_online_busy"
    );
    for class in ["online", "offline"] {
        let joined = rows(&format!(
            r#"coloc_process_info{{class="{class}"}} * on (UUID) group_left coloc_gpu_online_busy"#
        ));
        assert!(
            !joined.is_empty(),
            "coloc_process_info{{class={class}}} joins no GPU on UUID"
        );
    }

    // Every dashboard query returns data.
    let dash: Value = serde_json::from_slice(
        &std::fs::read(root().join("deploy/grafana/gpu-coloc.json")).unwrap(),
    )
    .unwrap();
    let mut empty = Vec::new();
    let mut checked = 0;
    for panel in dash["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let q = substitute(target["expr"].as_str().unwrap());
            let r = prom_query(pport, &q);
            assert_eq!(
                r["status"], "success",
                "panel {:?}: query does not parse: {q}\n{r}",
                panel["title"]
            );
            let n = r["data"]["result"].as_array().map(Vec::len).unwrap_or(0);
            if n == 0 {
                empty.push(format!(
                    "{} / {}: {q}",
                    panel["title"], target["legendFormat"]
                ));
            }
            checked += 1;
        }
    }
    // Template variables: the series they read exist.
    for v in dash["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["type"] == "query")
    {
        let q = v["query"]["query"].as_str().unwrap();
        let (inner, label) = q
            .trim_start_matches("label_values(")
            .trim_end_matches(')')
            .rsplit_once(',')
            .map(|(a, b)| (a, b.trim()))
            .unwrap_or((q, ""));
        let r = prom_query(pport, &substitute(inner));
        let series = r["data"]["result"].as_array().cloned().unwrap_or_default();
        // The cluster label exists only where Prometheus adds one; every other variable
        // lists values (the node label comes from the scrape config, as the chart's
        // ServiceMonitor sets it).
        if series.is_empty()
            || (label != "cluster" && !series.iter().any(|s| s["metric"][label].is_string()))
        {
            empty.push(format!("variable {}: {inner} has no {label}", v["name"]));
        }
    }
    assert!(
        empty.is_empty(),
        "dashboard queries that return nothing:\n{}",
        empty.join("\n")
    );
    eprintln!("{checked} dashboard queries returned data");

    // What co-location earned, as Prometheus and `coloc-agent status` show it: offline work
    // ran beside the online process's GPU and was held; online work waited for it.
    for q in [
        r#"coloc_offline_harvested_seconds_total{namespace="rule:off", class="offline"} > 0"#,
        r#"coloc_offline_held_seconds_total{namespace="rule:off", class="offline"} > 0"#,
        r#"coloc_online_waited_seconds_total{namespace="rule:web", class="online"} > 0"#,
        r#"coloc_online_beside_offline_seconds_total{namespace="rule:web", class="online"} > 0"#,
        // The shim's requests timed, begun with offline running and with it stopped.
        r#"coloc_online_run_seconds_count{offline="running"} > 0"#,
        r#"coloc_online_run_seconds_count{offline="stopped"} > 0"#,
    ] {
        assert!(!rows(q).is_empty(), "nothing for {q}");
    }
    let out = Command::new(bin("coloc-agent"))
        .args([
            "status",
            "--url",
            &format!("http://127.0.0.1:{}", agent.port),
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let earned = text
        .split_once("What co-location earned")
        .unwrap_or_else(|| panic!("no earned section:\n{text}"))
        .1;
    let row = |class: &str, ns: &str| {
        earned
            .lines()
            .find(|l| l.split_whitespace().take(2).eq([class, ns]))
            .unwrap_or_else(|| panic!("no {class} {ns} row:\n{text}"))
            .to_string()
    };
    let off = row("offline", "rule:off");
    let web = row("online", "rule:web");
    assert!(
        !off.contains(" 0.00 s "),
        "offline ran beside online for no time: {off}"
    );
    assert!(
        !web.ends_with("(0)"),
        "no preemption counted for the online work: {web}"
    );
    assert!(
        earned
            .lines()
            .any(|l| l.trim_start().starts_with("online runs")),
        "no online runs line:\n{text}"
    );
    eprintln!("coloc-agent status:{earned}");
    // A picture of the dashboard's first screen from this run, when asked for
    // (DASHBOARD_SVG=FILE: what docs/operate.md shows).
    if let Some(svg) = std::env::var_os("DASHBOARD_SVG") {
        let out = Command::new("python3")
            .arg(root().join("deploy/grafana/render.py"))
            .args(["--prometheus", &format!("http://127.0.0.1:{pport}")])
            .args(["--range-seconds", "60"])
            .arg("--out")
            .arg(&svg)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "render.py: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    // Every alert expression parses and its rule loaded healthy.
    let rules: Value = {
        let (_, body) = http_get(pport, "/api/v1/rules").unwrap();
        let s = body.find('{').unwrap();
        serde_json::from_str(&body[s..body.rfind('}').unwrap() + 1]).unwrap()
    };
    let loaded: Vec<&Value> = rules["data"]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap())
        .collect();
    // Every alert and recording rule of the rules file, none dropped.
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/prometheus/rules.yaml"),
    )
    .unwrap();
    let count = |kind: &str| {
        text.lines()
            .filter(|l| l.trim_start().starts_with(kind))
            .count()
    };
    let (alerts, records) = (count("- alert:"), count("- record:"));
    assert!(alerts >= 10, "{alerts} alerts in rules.yaml");
    assert!(records >= 1, "no recording rule in rules.yaml");
    assert_eq!(loaded.len(), alerts + records, "{rules}");
    for r in loaded {
        assert_eq!(r["health"], "ok", "rule {} unhealthy: {r}", r["name"]);
        let q = prom_query(pport, r["query"].as_str().unwrap());
        assert_eq!(
            q["status"], "success",
            "alert {} does not evaluate: {q}",
            r["name"]
        );
    }
}
