//! The command line's parsing and validation.

use super::*;

#[test]
fn durations() {
    assert_eq!(parse_duration("1ms").unwrap(), Duration::from_millis(1));
    assert_eq!(parse_duration("500us").unwrap(), Duration::from_micros(500));
    assert_eq!(parse_duration("0.5s").unwrap(), Duration::from_millis(500));
    assert!(parse_duration("100")
        .unwrap_err()
        .to_string()
        .contains("unit"));
    assert!(parse_duration("5h").is_err());
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
