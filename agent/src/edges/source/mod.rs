//! Pod sources: who owns a GPU process, and what class it is.
//!
//! One trait, [`PodSource`], with the standalone implementation [`Rules`] (a TOML file of
//! rules for a host without Kubernetes). The Kubernetes watcher implements the same trait.
//!
//! May touch: the rules file (read once at start).

pub use crate::control::model::process::{Classified, ShimNote};
pub mod kube;
pub mod podref;

use crate::edges::procfs::ProcInfo;
use qos_core::{Class, ComputePolicy, Share};
use serde::Deserialize;
use std::path::Path;

impl ShimNote {
    /// Reads the webhook's annotations of a pod (`get` looks one up).
    pub fn from_annotations<'a>(get: impl Fn(&str) -> Option<&'a str>) -> ShimNote {
        let nonempty = |k: &str| get(k).is_some_and(|v| !v.trim().is_empty());
        if get("gpu-coloc.dev/shim").map(str::trim) == Some("disabled") {
            ShimNote::OptedOut
        } else if nonempty("gpu-coloc.dev/shim-skipped") {
            ShimNote::Refused
        } else if nonempty("gpu-coloc.dev/shim-injected") {
            ShimNote::Injected
        } else {
            ShimNote::NotInjected
        }
    }
}

impl Classified {
    /// A process nobody claims.
    pub fn unmanaged(class: Class) -> Classified {
        Classified {
            class,
            share: Share::Burst,
            owner: "-".into(),
            freeze_cgroup: None,
            checkpoint: None,
            shim: None,
            container: None,
        }
    }
}

/// Source of classification. Implementations must be cheap: `classify` is called once per
/// new GPU process, on the control loop's thread.
pub trait PodSource: Send + Sync {
    /// Classifies a process.
    fn classify(&self, p: &ProcInfo) -> Classified;
    /// Whether the source has its initial state (the agent is not ready before).
    fn ready(&self) -> bool;
    /// Increases each time what `classify` answers may have changed.
    fn generation(&self) -> u64 {
        0
    }
    /// Whether a cgroup this source declares offline (`Classified::freeze_cgroup`) holds
    /// only that owner's processes, so all of them share its class (a pod's container
    /// cgroup: yes). When not (standalone rules: a `cgroup` rule may share its cgroup with
    /// processes other rules match), the agent checks every member before it freezes or
    /// stops the cgroup as a whole.
    fn whole_cgroups(&self) -> bool {
        false
    }
    /// Whether the pod with this UID is known to be gone from this node: `false` when it
    /// exists or when the source cannot tell (not Kubernetes, or not synced yet).
    fn pod_gone(&self, _uid: &str) -> bool {
        false
    }
    /// The UIDs of the pods known on this node (Kubernetes), for their doorbell
    /// directories; `None`: not Kubernetes.
    fn pod_uids(&self) -> Option<Vec<String>> {
        None
    }
}

/// Errors in a rules file; each names the file, the rule and the bad value.
#[derive(Debug, thiserror::Error)]
pub enum RulesError {
    /// The file cannot be read.
    #[error("cannot read rules file {path}")]
    Read {
        /// The file.
        path: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Not UTF-8, not valid TOML, or unknown/missing fields.
    #[error("rules file {path}:{line}:{column}: {message}")]
    Syntax {
        /// The file.
        path: String,
        /// Where, from 1.
        line: usize,
        /// Column (in characters), from 1.
        column: usize,
        /// What is wrong.
        message: String,
    },
    /// A rule is well-formed TOML but means nothing valid.
    #[error("rules file {path}:{line}:{column}: rule {rule}: {message}")]
    Invalid {
        /// The file.
        path: String,
        /// Line of the bad value (or of the rule) in the file, from 1.
        line: usize,
        /// Column (in characters), from 1.
        column: usize,
        /// The rule's name or position.
        rule: String,
        /// What is wrong.
        message: String,
    },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    /// Class of GPU processes no rule matches (default `unmanaged`).
    unmatched: Option<toml::Spanned<String>>,
    #[serde(default, rename = "rule")]
    rules: Vec<toml::Spanned<RawRule>>,
}

/// The line and column (in characters, both from 1) of byte offset `at` in `text`.
fn pos(text: &str, at: usize) -> (usize, usize) {
    let mut at = at.min(text.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    let before = &text[..at];
    let line = before.matches('\n').count() + 1;
    let col = before[before.rfind('\n').map_or(0, |i| i + 1)..]
        .chars()
        .count()
        + 1;
    (line, col)
}

/// Does `pattern` match every string (only `*`s)?
fn matches_all(pattern: &Option<String>) -> bool {
    pattern
        .as_deref()
        .is_none_or(|p| !p.is_empty() && p.chars().all(|c| c == '*'))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    name: Option<toml::Spanned<String>>,
    class: toml::Spanned<String>,
    cgroup: Option<String>,
    exe: Option<String>,
    cmdline: Option<String>,
    uid: Option<u32>,
    policy: Option<toml::Spanned<String>>,
    share: Option<toml::Spanned<u32>>,
    checkpoint: Option<bool>,
}

/// One compiled rule: every matcher given must match.
#[derive(Debug, Clone)]
pub struct Rule {
    /// Name for logs.
    pub name: String,
    /// Class given to matching processes.
    pub class: Class,
    cgroup: Option<Glob>,
    exe: Option<Glob>,
    cmdline: Option<Glob>,
    uid: Option<u32>,
    share: Share,
    checkpoint: Option<bool>,
}

/// A compiled glob (the `glob` crate): `*` any run of characters, `/` included; `?` one
/// character; `[abc]`, `[a-z]`, `[!a]` one of a set. Matched case-sensitively.
#[derive(Debug, Clone)]
pub struct Glob(glob::Pattern);

impl Glob {
    /// Compiles `pattern`; the error says what is wrong with it.
    pub fn new(pattern: &str) -> Result<Glob, String> {
        glob::Pattern::new(pattern).map(Glob).map_err(|e| {
            format!(
                "{pattern:?} is not a glob: {} (at character {})",
                e.msg,
                e.pos + 1
            )
        })
    }

    /// Whether `text` matches the whole pattern.
    pub fn matches(&self, text: &str) -> bool {
        const OPTIONS: glob::MatchOptions = glob::MatchOptions {
            case_sensitive: true,
            require_literal_separator: false,
            require_literal_leading_dot: false,
        };
        self.0.matches_with(text, OPTIONS)
    }
}

/// The standalone pod source: rules by cgroup path, executable, command line and UID.
///
/// ```toml
/// # First matching rule wins. Globs: `*` any run of characters, `?` one character, `[a-z]` a set.
/// unmatched = "unmanaged"          # class of GPU processes no rule matches
///
/// [[rule]]
/// name = "training"
/// class = "reclaimed_cores"        # or offline / shared_cores / online / system_cores ...
/// cgroup = "/batch.slice/*"        # the whole cgroup is offline: the freezer may freeze it
///
/// [[rule]]
/// name = "inference"
/// class = "shared_cores"
/// exe = "/usr/bin/python3*"
/// cmdline = "*serve.py*"
/// uid = 1000
///
/// [[rule]]
/// name = "capped-batch"
/// class = "offline"
/// cmdline = "*batch*"
/// policy = "fixed-share"           # with share = percent of wall time
/// share = 30
/// ```
#[derive(Debug, Clone)]
pub struct Rules {
    rules: Vec<Rule>,
    unmatched: Class,
}

fn parse_class(path: &str, at: (usize, usize), rule: &str, v: &str) -> Result<Class, RulesError> {
    Class::parse_config(v).ok_or_else(|| RulesError::Invalid {
        path: path.into(),
        line: at.0,
        column: at.1,
        rule: rule.into(),
        message: format!(
            "class {v:?} is not a class; allowed: shared_cores, dedicated_cores, \
             reclaimed_cores, system_cores (or online, online_exclusive, offline, system, unmanaged)"
        ),
    })
}

impl Rules {
    /// Reads and validates a rules file.
    pub fn load(path: &Path) -> Result<Rules, RulesError> {
        let bytes = std::fs::read(path).map_err(|source| RulesError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let text = String::from_utf8(bytes).map_err(|e| {
            let good = &e.as_bytes()[..e.utf8_error().valid_up_to()];
            // The prefix up to `valid_up_to` is valid UTF-8 by definition.
            let good = std::str::from_utf8(good).unwrap_or_default();
            let (line, column) = pos(good, good.len());
            RulesError::Syntax {
                path: path.display().to_string(),
                line,
                column,
                message: "not UTF-8 text".into(),
            }
        })?;
        Rules::parse(&path.display().to_string(), &text)
    }

    /// Parses and validates rules text; `path` is only used in messages.
    pub fn parse(path: &str, text: &str) -> Result<Rules, RulesError> {
        let raw: RawFile = toml::from_str(text).map_err(|e| {
            let (line, column) = pos(text, e.span().map_or(0, |s| s.start));
            RulesError::Syntax {
                path: path.into(),
                line,
                column,
                message: e.message().trim_end().replace('\n', " "),
            }
        })?;
        let unmatched = match &raw.unmatched {
            Some(v) => parse_class(path, pos(text, v.span().start), "unmatched", v.get_ref())?,
            None => Class::Unmanaged,
        };
        let mut rules = Vec::new();
        // Rule name -> line, for duplicates; the first rule that matches every process.
        let mut names: std::collections::HashMap<String, usize> = Default::default();
        let mut catch_all: Option<(String, usize, String)> = None;
        for (i, spanned) in raw.rules.into_iter().enumerate() {
            let r = spanned.into_inner();
            // Where the rule is: its name, else its class (a table's own span is not where
            // it starts for every form of table).
            let at = pos(
                text,
                r.name
                    .as_ref()
                    .map_or(r.class.span().start, |n| n.span().start),
            );
            let line = at.0;
            let name = r
                .name
                .as_ref()
                .map(|n| n.get_ref().clone())
                .unwrap_or_else(|| format!("#{}", i + 1));
            let invalid_at = |at: (usize, usize), message: String| RulesError::Invalid {
                path: path.into(),
                line: at.0,
                column: at.1,
                rule: name.clone(),
                message,
            };
            let invalid = |message: String| invalid_at(at, message);
            let share_at = r.share.as_ref().map(|s| pos(text, s.span().start));
            let policy_at = r.policy.as_ref().map_or(at, |p| pos(text, p.span().start));
            if let Some((first, first_line, what)) = &catch_all {
                return Err(invalid(format!(
                    "never matches: rule {first} (line {first_line}) before it matches every process ({what}); \
                     put the catch-all last, or use `unmatched = \"<class>\"`"
                )));
            }
            if r.name.is_some() {
                if let Some(prev) = names.insert(name.clone(), line) {
                    return Err(invalid(format!(
                        "the name {name:?} is already used by the rule at line {prev}; names identify rules in logs and /state"
                    )));
                }
            }
            let class = parse_class(
                path,
                pos(text, r.class.span().start),
                &name,
                r.class.get_ref(),
            )?;
            if r.cgroup.is_none() && r.exe.is_none() && r.cmdline.is_none() && r.uid.is_none() {
                return Err(invalid(
                    "has no matcher; give at least one of cgroup, exe, cmdline, uid".into(),
                ));
            }
            let policy =
                ComputePolicy::from_annotation(r.policy.as_ref().map(|p| p.get_ref().as_str()))
                    .map_err(|e| invalid_at(policy_at, e.to_string()))?;
            let share = match (policy, r.share.as_ref().map(|s| *s.get_ref())) {
                (ComputePolicy::FixedShare, Some(p @ 1..=100)) => Share::Fixed { percent: p },
                (ComputePolicy::FixedShare, Some(p)) => {
                    return Err(invalid_at(
                        share_at.unwrap_or(at),
                        format!("share = {p} is out of range; allowed: 1-100"),
                    ))
                }
                (ComputePolicy::FixedShare, None) => {
                    return Err(invalid_at(
                        policy_at,
                        "policy = \"fixed-share\" needs share = <percent of wall time, 1-100>"
                            .into(),
                    ))
                }
                (ComputePolicy::NativeBurstShare, _) if class == Class::Offline => {
                    return Err(invalid_at(
                        policy_at,
                        "policy \"native-burst-share\" is not supported for offline work \
                         (co-location supports fixed-share and guaranteed-burst-share)"
                            .into(),
                    ))
                }
                (_, Some(_)) => {
                    return Err(invalid_at(
                        share_at.unwrap_or(at),
                        "share is only meaningful with policy = \"fixed-share\"".into(),
                    ))
                }
                _ => Share::Burst,
            };
            if r.uid.is_none()
                && matches_all(&r.cgroup)
                && matches_all(&r.exe)
                && matches_all(&r.cmdline)
            {
                let what = [
                    ("cgroup", &r.cgroup),
                    ("exe", &r.exe),
                    ("cmdline", &r.cmdline),
                ]
                .iter()
                .filter_map(|(k, v)| v.as_ref().map(|v| format!("{k} = {v:?}")))
                .collect::<Vec<_>>()
                .join(", ");
                catch_all = Some((name.clone(), line, what));
            }
            let compile =
                |p: Option<String>| p.as_deref().map(Glob::new).transpose().map_err(invalid);
            rules.push(Rule {
                cgroup: compile(r.cgroup)?,
                exe: compile(r.exe)?,
                cmdline: compile(r.cmdline)?,
                name,
                class,
                uid: r.uid,
                share,
                checkpoint: r.checkpoint,
            });
        }
        Ok(Rules { rules, unmatched })
    }

    /// The compiled rules, in order.
    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    fn matching(&self, p: &ProcInfo) -> Option<(&Rule, Option<String>)> {
        self.rules.iter().find_map(|r| {
            let cgroup = match &r.cgroup {
                Some(pat) => Some(
                    p.cgroups
                        .paths()
                        .find(|path| pat.matches(path))?
                        .to_string(),
                ),
                None => None,
            };
            if let Some(pat) = &r.exe {
                let exe = p.exe.as_ref()?.to_string_lossy();
                if !pat.matches(&exe) {
                    return None;
                }
            }
            if let Some(pat) = &r.cmdline {
                if !pat.matches(&p.cmdline) {
                    return None;
                }
            }
            if r.uid.is_some_and(|u| u != p.uid) {
                return None;
            }
            Some((r, cgroup))
        })
    }
}

impl PodSource for Rules {
    fn classify(&self, p: &ProcInfo) -> Classified {
        match self.matching(p) {
            Some((rule, cgroup)) => Classified {
                class: rule.class,
                share: rule.share,
                owner: format!("rule:{}", rule.name),
                // Only a cgroup rule declares the whole cgroup offline; the root never is.
                freeze_cgroup: cgroup.filter(|c| c != "/"),
                checkpoint: rule.checkpoint,
                shim: None,
                container: None,
            },
            None => Classified::unmanaged(self.unmatched),
        }
    }

    fn ready(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests;
