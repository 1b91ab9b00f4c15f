//! The command line's parsing and validation.

use super::*;

#[test]
fn durations() {
    assert_eq!(parse_duration("1ms").unwrap(), Duration::from_millis(1));
    assert_eq!(parse_duration("500us").unwrap(), Duration::from_micros(500));
    assert_eq!(parse_duration("1m30s").unwrap(), Duration::from_secs(90));
    assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
    assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
    assert!(parse_duration("100")
        .unwrap_err()
        .to_string()
        .contains("a number and a unit"));
    assert!(parse_duration("5 parsecs").is_err());
}

/// A `COLOC_*` variable that nothing reads is refused by name; flags of any subcommand,
/// the webhook's and the shim's are not.
#[test]
fn unknown_settings_are_named() {
    let vars = [
        "COLOC_BOGUS",
        "COLOC_IDLE_WINDOW",
        "COLOC_IDLE_WINDW",
        "COLOC_STATUS_URL",
        "COLOC_SHIM_INFLIGHT_MS",
        "COLOC_WEBHOOK_LISTEN",
        "PATH",
    ]
    .map(String::from);
    assert_eq!(unknown_settings(vars), ["COLOC_BOGUS", "COLOC_IDLE_WINDW"]);
}

/// Every `COLOC_*` name the project's own sources use is a flag or another component's:
/// none of them is refused when it reaches the agent's environment (the demo, the tests
/// and the benchmarks pass theirs on).
#[test]
fn every_name_the_project_uses_is_known() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut names = std::collections::BTreeSet::new();
    let mut dirs = vec![root.clone()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if p.is_dir() && !name.starts_with('.') && name != "target" {
                dirs.push(p);
            } else if (name.ends_with(".rs") || name.ends_with(".c"))
                // The refusal's own tests name misspelt settings on purpose.
                && !p.ends_with("agent/src/cli/tests.rs")
                && !p.ends_with("agent/tests/settings.rs")
            {
                let text = std::fs::read_to_string(&p).unwrap_or_default();
                for (i, _) in text.match_indices("\"COLOC_") {
                    let n: String = text[i + 1..]
                        .chars()
                        .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                        .collect();
                    if n.len() > "COLOC_".len() && !n.ends_with('_') {
                        names.insert(n);
                    }
                }
            }
        }
    }
    assert!(names.len() > 40, "{names:?}");
    assert_eq!(unknown_settings(names), Vec::<String>::new());
}

/// The defaults a user gets are the ones DESIGN names (idle window 100 ms).
#[test]
fn defaults() {
    let cli = Cli::try_parse_from(["coloc-agent", "run", "--actuator", "signal"]).unwrap();
    let Command::Run(args) = cli.cmd else {
        panic!()
    };
    let cfg = args.loop_config().unwrap();
    assert_eq!(cfg.machine.idle_window, 100_000_000);
    assert_eq!(cfg.poll, Duration::from_millis(1));
    assert_eq!(cfg.idle_poll, Duration::from_millis(100));
    assert_eq!(cfg.nvml_interval, Duration::from_millis(100));
    assert_eq!(cfg.nvml_grace, Duration::from_millis(50));
    assert!(cfg.machine.unmanaged_is_online);
    assert!(!args.state_cmdlines);
    let http = args.http_limits().unwrap();
    assert_eq!(http.header_timeout, Duration::from_secs(5));
    assert_eq!(http.idle_timeout, Duration::from_secs(30));
    assert_eq!(http.max_connections, 64);
}

#[test]
fn http_limits_are_validated() {
    let parse = |extra: &[&str]| {
        let mut argv = vec!["coloc-agent", "run", "--actuator", "signal"];
        argv.extend_from_slice(extra);
        Cli::try_parse_from(argv).map(|cli| match cli.cmd {
            Command::Run(args) => args,
            _ => panic!(),
        })
    };
    assert!(parse(&["--http-max-connections", "0"]).is_err());
    for flag in [
        "--nvml-interval",
        "--process-interval",
        "--recheck-interval",
        "--idle-poll-interval",
    ] {
        let r = parse(&[flag, "0"]).unwrap().loop_config();
        assert!(r.is_err(), "{flag} 0 accepted: the loop would spin");
    }
    for (slice, ok) in [
        ("50us", false),
        ("101ms", false),
        ("0", true),
        ("1ms", true),
    ] {
        let r = parse(&["--loop-slice", slice]).unwrap().loop_config();
        assert_eq!(r.is_ok(), ok, "--loop-slice {slice}: {:?}", r.err());
    }
    let a = parse(&["--http-header-timeout", "10ms"]).unwrap();
    assert!(a
        .http_limits()
        .unwrap_err()
        .to_string()
        .contains("--http-header-timeout"));
    let a = parse(&["--http-idle-timeout", "2s", "--state-cmdlines"]).unwrap();
    assert_eq!(
        a.http_limits().unwrap().idle_timeout,
        Duration::from_secs(2)
    );
    assert!(a.state_cmdlines);
}

#[test]
fn help_is_valid() {
    use clap::CommandFactory;
    Cli::command().debug_assert();
}
