//! Who may write where under the doorbell directory, and the pods' own directories.
//!
//! - **Standalone** (a rules file): the directory is mode 1777, so that any user's process
//!   may add its page and none may remove another's (at most 64 pages per file owner are
//!   mapped there).
//! - **Kubernetes**: the directory and its `pods/` are root's, mode 0755: no tenant can
//!   add, swap or remove anything in them. Each pod's `pods/<uid>/` (the pod's
//!   `subPathExpr` mount) is made by the agent from its pod watch, mode 1777, so that a
//!   process of any user in the pod may add its page. A pod's directory that the kubelet
//!   made first (with the mode of `pods/`, 0755, owned by root) is widened to 1777 when
//!   the agent sees the pod: processes that tried to add their page before that ran
//!   without the doorbell (NVML still sees them).
//!
//! Every step is relative to a directory descriptor opened without following links; a
//! pod's directory that is not a real directory of root's is left alone.

use rustix::fs::{fchmod, fstat, mkdirat, openat, Mode, OFlags, CWD};
use std::collections::HashSet;
use std::path::Path;
use tracing::{info, warn};

/// Who may write where (see the module).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// A host without Kubernetes: the directory is shared by its users' processes.
    Standalone,
    /// A Kubernetes node: pods write only in their own `pods/<uid>/`.
    Kubernetes,
}

impl Layout {
    /// The mode of the directory and of `pods/`.
    pub fn top_mode(self) -> u32 {
        match self {
            Layout::Standalone => 0o1777,
            Layout::Kubernetes => 0o755,
        }
    }
}

/// The mode of a pod's own directory.
pub const POD_DIR_MODE: u32 = 0o1777;

const DIR_FLAGS: OFlags = OFlags::RDONLY
    .union(OFlags::DIRECTORY)
    .union(OFlags::NOFOLLOW)
    .union(OFlags::CLOEXEC);

/// Makes `d` a directory of mode `mode`, created if missing. On Kubernetes an existing
/// world-writable one of root's is narrowed (it was made 1777 by an earlier version);
/// one of another owner is an error.
pub(super) fn prepare(d: &Path, layout: Layout) -> anyhow::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    let mode = layout.top_mode();
    let created = !d.exists();
    if created {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(mode)
            .create(d)
            .map_err(|e| anyhow::anyhow!("creating --doorbell-dir {}: {e}", d.display()))?;
    }
    let fd = openat(CWD, d, DIR_FLAGS, Mode::empty())
        .map_err(|e| anyhow::anyhow!("--doorbell-dir {}: not a directory: {e}", d.display()))?;
    let st = fstat(&fd)?;
    let have = st.st_mode & 0o7777;
    let me = rustix::process::geteuid().as_raw();
    if layout == Layout::Kubernetes && st.st_uid != me {
        anyhow::bail!(
            "--doorbell-dir {}: owned by UID {}, not the agent's ({me}): its owner could swap pods' directories",
            d.display(),
            st.st_uid
        );
    }
    if have == mode {
        return Ok(());
    }
    // A fresh directory (the umask cut its mode), or one to narrow or widen.
    fchmod(&fd, Mode::from_raw_mode(mode))
        .map_err(|e| anyhow::anyhow!("chmod {:o} {}: {e}", mode, d.display()))?;
    if !created {
        info!(dir = %d.display(), from = format!("{have:o}"), to = format!("{mode:o}"), "Doorbell directory mode set");
    }
    Ok(())
}

/// Makes `pods/<uid>/` for each pod in `uids` not done yet (`done`): created mode 1777,
/// or widened to 1777 when the kubelet made it first. Returns how many were created or
/// widened.
pub(super) fn ensure(pods: &Path, uids: &[String], done: &mut HashSet<String>) -> usize {
    let todo: Vec<&String> = uids
        .iter()
        .filter(|u| !done.contains(*u) && super::dir::is_pod_uid(u))
        .collect();
    if todo.is_empty() {
        return 0;
    }
    let Ok(pods_fd) = openat(CWD, pods, DIR_FLAGS, Mode::empty()) else {
        return 0;
    };
    let mut changed = 0;
    for uid in todo {
        let made = match mkdirat(&pods_fd, uid.as_str(), Mode::from_raw_mode(POD_DIR_MODE)) {
            Ok(()) => true,
            Err(rustix::io::Errno::EXIST) => false,
            Err(err) => {
                warn!(pod_uid = %uid, dir = %pods.display(), %err, "Cannot make the pod's doorbell directory: its processes run without the doorbell");
                continue;
            }
        };
        // A link in its place is not followed, and anything but a directory of root's
        // is left alone (only root can write to `pods/`).
        let Ok(fd) = openat(&pods_fd, uid.as_str(), DIR_FLAGS, Mode::empty()) else {
            warn!(pod_uid = %uid, dir = %pods.display(), "The pod's doorbell directory is not a directory: left alone");
            done.insert(uid.clone());
            continue;
        };
        let Ok(st) = fstat(&fd) else { continue };
        let have = st.st_mode & 0o7777;
        if st.st_uid != rustix::process::geteuid().as_raw() {
            // (Left from when `pods/` was world-writable: the agent neither uses nor
            // watches it.)
            warn!(pod_uid = %uid, owner = st.st_uid, "The pod's doorbell directory has another owner: left alone");
            done.insert(uid.clone());
            continue;
        }
        if have != POD_DIR_MODE {
            // A fresh one (the umask cut its mode), or the kubelet's.
            if let Err(err) = fchmod(&fd, Mode::from_raw_mode(POD_DIR_MODE)) {
                warn!(pod_uid = %uid, %err, "Cannot widen the pod's doorbell directory");
                continue;
            }
            if !made {
                info!(pod_uid = %uid, from = format!("{have:o}"), "Widened the pod's doorbell directory (made before the agent saw the pod)");
            }
        }
        changed += usize::from(made || have != POD_DIR_MODE);
        done.insert(uid.clone());
    }
    changed
}
