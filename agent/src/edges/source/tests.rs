use super::*;
use crate::edges::procfs::{Cgroups, ProcKey};

fn proc(cmd: &str, cg: &str, uid: u32) -> ProcInfo {
    ProcInfo {
        key: ProcKey { pid: 1, start: 1 },
        uid,
        exe: Some("/usr/bin/python3.11".into()),
        cmdline: cmd.into(),
        cgroups: Cgroups::parse(&format!("0::{cg}\n")),
        ns_pid: None,
    }
}

#[test]
fn semantic_errors_give_file_and_line() {
    let text = "unmatched = \"unmanaged\"\n\n[[rule]]\nname = \"a\"\nclass = \"offline\"\ncmdline = \"*x*\"\n\n[[rule]]\nname = \"b\"\nclass = \"offline\"\nshare = 30\ncmdline = \"*y*\"\n";
    let e = Rules::parse("r.toml", text).unwrap_err().to_string();
    assert!(
        e.starts_with("rules file r.toml:11:9: rule b: share"),
        "{e}"
    );
    let e = Rules::parse("r.toml", "\nunmatched = \"nope\"\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("rules file r.toml:2:13: rule unmatched:"),
        "{e}"
    );
}

#[test]
fn duplicate_names_are_refused() {
    let text = "[[rule]]\nname = \"a\"\nclass = \"offline\"\ncmdline = \"*x*\"\n[[rule]]\nname = \"a\"\nclass = \"online\"\nuid = 3\n";
    let e = Rules::parse("r.toml", text).unwrap_err().to_string();
    assert!(
        e.contains("r.toml:6:8: rule a:") && e.contains("already used by the rule at line 2"),
        "{e}"
    );
}

#[test]
fn a_catch_all_rule_before_others_is_refused_and_is_fine_last() {
    let shadowing = "[[rule]]\nname = \"all\"\nclass = \"offline\"\ncmdline = \"*\"\n[[rule]]\nname = \"serve\"\nclass = \"online\"\ncmdline = \"*serve*\"\n";
    let e = Rules::parse("r.toml", shadowing).unwrap_err().to_string();
    assert!(
        e.contains("r.toml:6:8: rule serve: never matches: rule all (line 2)")
            && e.contains("cmdline = \"*\""),
        "{e}"
    );
    // Narrowed by a uid, or last: valid.
    let by_uid = shadowing.replace("cmdline = \"*\"\n", "cmdline = \"*\"\nuid = 7\n");
    assert!(Rules::parse("r.toml", &by_uid).is_ok());
    let last = "[[rule]]\nname = \"serve\"\nclass = \"online\"\ncmdline = \"*serve*\"\n[[rule]]\nname = \"all\"\nclass = \"offline\"\nexe = \"**\"\n";
    assert!(Rules::parse("r.toml", last).is_ok());
}

/// Every error names file:line:column of the value at fault: an unknown class on line 3,
/// a share out of range on line 6, a syntax error, a file that is not UTF-8.
#[test]
fn errors_name_file_line_and_column() {
    let e = Rules::parse(
        "r.toml",
        "[[rule]]\nname = \"a\"\nclass = \"bogus\"\ncmdline = \"x\"\n",
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.starts_with("rules file r.toml:3:9: rule a: class \"bogus\""),
        "{e}"
    );
    let e = Rules::parse(
        "r.toml",
        "[[rule]]\nname = \"a\"\nclass = \"offline\"\ncmdline = \"x\"\npolicy = \"fixed-share\"\nshare = 130\n",
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.starts_with("rules file r.toml:6:9: rule a: share = 130"),
        "{e}"
    );
    let e = Rules::parse(
        "r.toml",
        "[[rule]]\nname = \"a\"\nclass = \"offline\"\ncmdline = \"x\"\ncolour = 1\n",
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.starts_with("rules file r.toml:5:1: ") && e.contains("colour"),
        "{e}"
    );
    let dir = crate::testutil::TmpDir::new("coloc-rules-utf8");
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("r.toml");
    std::fs::write(&f, b"[[rule]]\nname = \"a\"\nclass = \"off\xffline\"\n").unwrap();
    let e = Rules::load(&f).unwrap_err().to_string();
    assert!(e.ends_with("r.toml:3:13: not UTF-8 text"), "{e}");
}

#[test]
fn globs() {
    let glob = |p: &str, t: &str| Glob::new(p).unwrap().matches(t);
    assert!(glob("*train*", "python train.py"));
    assert!(glob("/batch/*", "/batch/a/b"));
    assert!(glob("a?c", "abc"));
    assert!(!glob("a?c", "ac"));
    assert!(glob("*", ""));
    assert!(!glob("/batch/*", "/other"));
    assert!(glob("/jobs/[a-c]*", "/jobs/b1"));
    assert!(!glob("*Train*", "python train.py"));
    // A pattern that is not a glob is an error with the rule's line.
    let e = Rules::parse(
        "r.toml",
        "[[rule]]\nname = \"a\"\nclass = \"offline\"\ncmdline = \"[x\"\n",
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.starts_with("rules file r.toml:2:8: rule a: \"[x\" is not a glob"),
        "{e}"
    );
}

#[test]
fn first_match_wins_and_all_matchers_must_match() {
    let r = Rules::parse(
        "t.toml",
        r#"
        [[rule]]
        name = "train"
        class = "reclaimed_cores"
        cgroup = "/batch/*"
        [[rule]]
        name = "serve"
        class = "shared_cores"
        exe = "/usr/bin/python3*"
        uid = 1000
        [[rule]]
        name = "capped"
        class = "offline"
        cmdline = "*capped*"
        policy = "fixed-share"
        share = 30
        "#,
    )
    .unwrap();
    let c = r.classify(&proc("python x", "/batch/job1", 0));
    assert_eq!(c.class, Class::Offline);
    assert_eq!(c.freeze_cgroup.as_deref(), Some("/batch/job1"));
    assert_eq!(
        r.classify(&proc("python x", "/svc", 1000)).class,
        Class::Online
    );
    assert_eq!(
        r.classify(&proc("python x", "/svc", 1001)).class,
        Class::Unmanaged
    );
    let c = r.classify(&proc("run capped", "/svc", 5));
    assert_eq!(c.share, Share::Fixed { percent: 30 });
    assert_eq!(
        c.freeze_cgroup, None,
        "a cmdline rule never declares a cgroup offline"
    );
}

#[test]
fn errors_name_the_bad_input() {
    let cases = [
        ("[[rule]]\nclass = \"reclaimed\"\ncmdline = \"x\"\n", "\"reclaimed\""),
        ("[[rule]]\nname = \"a\"\nclass = \"offline\"\n", "no matcher"),
        ("[[rule]]\nclass = \"offline\"\ncmdline = \"x\"\ncolour = 1\n", "colour"),
        ("[[rule]\n", "t.toml"),
        ("[[rule]]\nclass = \"offline\"\ncmdline = \"x\"\npolicy = \"fixed-share\"\nshare = 130\n", "130"),
        ("[[rule]]\nclass = \"offline\"\ncmdline = \"x\"\npolicy = \"native-burst-share\"\n", "native-burst-share"),
        ("[[rule]]\nclass = \"offline\"\ncmdline = \"x\"\npolicy = \"fixed\"\n", "\"fixed\""),
        ("unmatched = \"whatever\"\n", "\"whatever\""),
    ];
    for (text, needle) in cases {
        let e = Rules::parse("t.toml", text).unwrap_err().to_string();
        assert!(e.contains(needle), "{e:?} should contain {needle:?}");
        assert!(e.contains("t.toml"), "{e}");
    }
}
