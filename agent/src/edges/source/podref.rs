//! Which pod (and container) a cgroup path belongs to, on real kubelet layouts.
//!
//! | driver   | example path (v1 or v2)                                                                   |
//! |----------|--------------------------------------------------------------------------------------------|
//! | cgroupfs | `/kubepods/burstable/pod0f2c7a54-…/3d8f…`                                                  |
//! | cgroupfs | `/kubepods/pod0f2c7a54-…/3d8f…` (guaranteed)                                               |
//! | systemd  | `/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0f2c7a54_….slice/cri-containerd-3d8f….scope` |
//! | systemd  | `…/kubepods-pod0f2c….slice/crio-3d8f….scope`, `…/docker-3d8f….scope`                        |
//!
//! The kubelet may sit below another prefix (kind, nested runtimes): the pod segment is
//! found wherever it is. Pod UIDs are written with `_` instead of `-` by the systemd
//! driver; they are returned with `-`.

/// QoS tier of the pod's cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QosTier {
    /// `kubepods/pod…` directly.
    Guaranteed,
    /// `burstable`.
    Burstable,
    /// `besteffort`.
    BestEffort,
}

/// A pod found in a cgroup path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodCgroup {
    /// Pod UID, with dashes.
    pub uid: String,
    /// Container ID (runtime prefix and `.scope` stripped), if the path goes below the pod.
    pub container: Option<String>,
    /// QoS tier.
    pub tier: QosTier,
    /// The path up to and including the pod's directory.
    pub pod_path: String,
}

fn is_uid(s: &str) -> bool {
    s.len() == 36
        && s.chars().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-' || c == '_',
            _ => c.is_ascii_hexdigit(),
        })
}

fn pod_uid_of_segment(seg: &str) -> Option<String> {
    // cgroupfs: "pod<uid>"; systemd: "kubepods[-tier]-pod<uid>.slice".
    let s = seg.strip_suffix(".slice").unwrap_or(seg);
    let idx = s.rfind("pod")?;
    let uid = &s[idx + 3..];
    if !is_uid(uid) {
        return None;
    }
    let prefix = &s[..idx];
    if !(prefix.is_empty() || prefix.ends_with('-')) {
        return None;
    }
    Some(uid.replace('_', "-"))
}

fn container_of_segment(seg: &str) -> String {
    let s = seg.strip_suffix(".scope").unwrap_or(seg);
    for p in [
        "cri-containerd-",
        "crio-",
        "docker-",
        "containerd-",
        "cri-o-",
    ] {
        if let Some(id) = s.strip_prefix(p) {
            return id.to_string();
        }
    }
    s.to_string()
}

/// Finds the pod in a cgroup path; `None` for paths outside any pod.
pub fn parse(path: &str) -> Option<PodCgroup> {
    let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let (i, uid) = segs
        .iter()
        .enumerate()
        .find_map(|(i, s)| pod_uid_of_segment(s).map(|u| (i, u)))?;
    let before = segs[..i].join("/").to_ascii_lowercase();
    let seg = segs[i].to_ascii_lowercase();
    let tier = if before.contains("besteffort") || seg.contains("besteffort") {
        QosTier::BestEffort
    } else if before.contains("burstable") || seg.contains("burstable") {
        QosTier::Burstable
    } else {
        QosTier::Guaranteed
    };
    Some(PodCgroup {
        uid,
        container: segs.get(i + 1).map(|s| container_of_segment(s)),
        tier,
        pod_path: format!("/{}", segs[..=i].join("/")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::edges::procfs::Cgroups;

    const UID: &str = "0f2c7a54-9a3b-4c1e-8d2f-6b5a4c3d2e1f";

    #[test]
    fn real_layouts() {
        // Each: a real /proc/<pid>/cgroup content shape for one layout.
        let cases = [
            // cgroup v2, systemd driver, containerd, besteffort
            ("0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0f2c7a54_9a3b_4c1e_8d2f_6b5a4c3d2e1f.slice/cri-containerd-3d8fa1b2c3.scope\n", QosTier::BestEffort, Some("3d8fa1b2c3")),
            // cgroup v2, systemd, CRI-O, burstable
            ("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0f2c7a54_9a3b_4c1e_8d2f_6b5a4c3d2e1f.slice/crio-77aa.scope\n", QosTier::Burstable, Some("77aa")),
            // cgroup v2, systemd, guaranteed, docker
            ("0::/kubepods.slice/kubepods-pod0f2c7a54_9a3b_4c1e_8d2f_6b5a4c3d2e1f.slice/docker-abcd.scope\n", QosTier::Guaranteed, Some("abcd")),
            // cgroup v1, cgroupfs driver, burstable (containerd id as plain dir)
            ("12:freezer:/kubepods/burstable/pod0f2c7a54-9a3b-4c1e-8d2f-6b5a4c3d2e1f/9f8e7d\n11:memory:/kubepods/burstable/pod0f2c7a54-9a3b-4c1e-8d2f-6b5a4c3d2e1f/9f8e7d\n1:name=systemd:/kubepods/burstable/pod0f2c7a54-9a3b-4c1e-8d2f-6b5a4c3d2e1f/9f8e7d\n", QosTier::Burstable, Some("9f8e7d")),
            // cgroup v1, cgroupfs, guaranteed
            ("4:freezer:/kubepods/pod0f2c7a54-9a3b-4c1e-8d2f-6b5a4c3d2e1f/c0ffee\n0::/\n", QosTier::Guaranteed, Some("c0ffee")),
            // cgroup v1, systemd driver
            ("7:freezer:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0f2c7a54_9a3b_4c1e_8d2f_6b5a4c3d2e1f.slice/cri-containerd-5a5a.scope\n", QosTier::BestEffort, Some("5a5a")),
            // nested under another runtime (kind)
            ("0::/system.slice/docker-1234.scope/kubepods/besteffort/pod0f2c7a54-9a3b-4c1e-8d2f-6b5a4c3d2e1f/beef\n", QosTier::BestEffort, Some("beef")),
        ];
        for (text, tier, container) in cases {
            let cg = Cgroups::parse(text);
            let p = parse(cg.primary().unwrap()).unwrap_or_else(|| panic!("no pod in {text}"));
            assert_eq!(p.uid, UID, "{text}");
            assert_eq!(p.tier, tier, "{text}");
            assert_eq!(p.container.as_deref(), container, "{text}");
            assert!(p.pod_path.contains("pod0f2c7a54"), "{text}");
        }
    }

    #[test]
    fn not_pods() {
        for p in [
            "/",
            "/system.slice/sshd.service",
            "/user.slice/user-0.slice/session-1.scope",
            "/kubepods/burstable",
            "/kubepods/podnotauid/x",
            "/batch/pod12",
        ] {
            assert_eq!(parse(p), None, "{p}");
        }
    }
}
