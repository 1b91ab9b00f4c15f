//! The fail-open record: what the agent has suspended, written down *before* it acts.
//!
//! If the agent dies (even `kill -9`), the next start reads this file and resumes
//! everything in it before doing anything else. The file is replaced atomically (write a
//! temporary file, fsync, rename), so a crash mid-write leaves the old or the new version,
//! never a torn one.
//!
//! Promise: an entry is in memory only if it is on disk. [`RecordStore::add`] that fails
//! to persist leaves the record as it was, so the caller does not suspend, and the next
//! suspension of the same target tries the write again. The state directory is checked
//! when the record is opened (a write at start), so an unwritable directory stops the
//! agent at start with its name, instead of failing open on every preemption.
//!
//! May touch: the state directory (default `/run/coloc-agent`).

use crate::edges::actuator::RecordEntry;
use anyhow::{Context, Result};
use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Where suspensions are written down.
pub trait RecordStore: Send {
    /// Adds entries and persists them; on error nothing changes (call before suspending).
    fn add(&mut self, es: &[RecordEntry]) -> Result<()>;
    /// Removes entries and persists (call after resuming them).
    fn remove(&mut self, es: &[RecordEntry]) -> Result<()>;
    /// Adds `add` and removes `remove` (disjoint), persisting once where the store can;
    /// on error, what is persisted is the record before the call or after `add` alone.
    fn update(&mut self, add: &[RecordEntry], remove: &[RecordEntry]) -> Result<()> {
        if !add.is_empty() {
            self.add(add)?;
        }
        if !remove.is_empty() {
            self.remove(remove)?;
        }
        Ok(())
    }
    /// Entries currently recorded.
    fn entries(&self) -> &BTreeSet<RecordEntry>;
}

/// The record file and its in-memory copy.
#[derive(Debug)]
pub struct FileRecord {
    path: PathBuf,
    entries: BTreeSet<RecordEntry>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct OnDisk {
    version: u32,
    suspended: Vec<RecordEntry>,
}

impl FileRecord {
    /// Opens (creating the directory) the record in `dir`, and checks that it can be
    /// written. Returns it with the entries a previous run left behind, which the caller
    /// must resume.
    pub fn open(dir: &Path) -> Result<(FileRecord, Vec<RecordEntry>)> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating state directory {}", dir.display()))?;
        let path = dir.join("suspended.json");
        let leftover = match std::fs::read(&path) {
            Ok(bytes) => {
                let d: OnDisk = serde_json::from_slice(&bytes).with_context(|| {
                    format!(
                        "{} is corrupt; remove it after checking nothing is frozen",
                        path.display()
                    )
                })?;
                d.suspended
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => vec![],
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        let record = FileRecord {
            path,
            entries: leftover.iter().cloned().collect(),
        };
        // Nothing may be suspended that is not on disk: find out now whether it can be.
        write_file(&record.path, &record.entries).with_context(|| {
            format!(
                "state directory {} is not writable (--state-dir); the agent writes down \
                 what it suspends before it acts",
                dir.display()
            )
        })?;
        Ok((record, leftover))
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn write_file(path: &Path, entries: &BTreeSet<RecordEntry>) -> Result<()> {
    let tmp = path.with_extension("json.tmp");
    let body = serde_json::to_vec_pretty(&OnDisk {
        version: 1,
        suspended: entries.iter().cloned().collect(),
    })?;
    // A stale temporary file (or a symlink planted in its place) is removed, never
    // followed: the new one is created exclusively (O_EXCL does not follow symlinks).
    if std::fs::symlink_metadata(&tmp).is_ok_and(|m| !m.is_dir()) {
        std::fs::remove_file(&tmp).with_context(|| format!("removing {}", tmp.display()))?;
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .with_context(|| format!("writing {}", tmp.display()))?;
    f.write_all(&body)
        .and_then(|()| f.sync_data())
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("replacing {}", path.display()))?;
    Ok(())
}

impl RecordStore for FileRecord {
    fn add(&mut self, es: &[RecordEntry]) -> Result<()> {
        let mut next = self.entries.clone();
        next.extend(es.iter().cloned());
        if next.len() != self.entries.len() {
            write_file(&self.path, &next)?;
            self.entries = next;
        }
        Ok(())
    }

    fn remove(&mut self, es: &[RecordEntry]) -> Result<()> {
        let mut next = self.entries.clone();
        for e in es {
            next.remove(e);
        }
        if next.len() != self.entries.len() {
            write_file(&self.path, &next)?;
            self.entries = next;
        }
        Ok(())
    }

    fn update(&mut self, add: &[RecordEntry], remove: &[RecordEntry]) -> Result<()> {
        let mut next = self.entries.clone();
        next.extend(add.iter().cloned());
        for e in remove {
            next.remove(e);
        }
        if next != self.entries {
            write_file(&self.path, &next)?;
            self.entries = next;
        }
        Ok(())
    }

    fn entries(&self) -> &BTreeSet<RecordEntry> {
        &self.entries
    }
}

/// A record kept in memory only: for `--dry-run`, which suspends nothing and so has
/// nothing to resume after a crash.
#[derive(Debug, Default)]
pub struct MemRecord {
    entries: BTreeSet<RecordEntry>,
}

impl RecordStore for MemRecord {
    fn add(&mut self, es: &[RecordEntry]) -> Result<()> {
        self.entries.extend(es.iter().cloned());
        Ok(())
    }
    fn remove(&mut self, es: &[RecordEntry]) -> Result<()> {
        for e in es {
            self.entries.remove(e);
        }
        Ok(())
    }
    fn entries(&self) -> &BTreeSet<RecordEntry> {
        &self.entries
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::edges::actuator::CgroupVersion;

    fn tmpdir(name: &str) -> crate::testutil::TmpDir {
        crate::testutil::TmpDir::new(&format!("coloc-record-{name}"))
    }

    #[test]
    fn survives_reopen() {
        let dir = tmpdir("reopen");
        let (mut r, left) = FileRecord::open(&dir).unwrap();
        assert!(left.is_empty());
        let a = RecordEntry::Process { pid: 1, start: 2 };
        let b = RecordEntry::Cgroup {
            dir: "/sys/fs/cgroup/x".into(),
            version: CgroupVersion::V2,
            cell: None,
        };
        r.add(&[a.clone(), b.clone()]).unwrap();
        r.remove(&[a]).unwrap();
        let (_, left) = FileRecord::open(&dir).unwrap();
        assert_eq!(left, vec![b]);
        std::fs::write(dir.join("suspended.json"), b"{not json").unwrap();
        let e = FileRecord::open(&dir).unwrap_err();
        assert!(format!("{e:#}").contains("corrupt"), "{e:#}");
    }

    /// A write that fails leaves nothing in memory, so the next add writes again.
    #[test]
    fn failed_add_keeps_nothing() {
        let dir = tmpdir("failed-add");
        let (mut r, _) = FileRecord::open(&dir).unwrap();
        // A directory where the temporary file goes makes every write fail, even as root.
        std::fs::create_dir(dir.join("suspended.json.tmp")).unwrap();
        let a = RecordEntry::Process { pid: 7, start: 8 };
        assert!(r.add(std::slice::from_ref(&a)).is_err());
        assert!(
            r.entries().is_empty(),
            "an unwritten entry stayed in memory"
        );
        std::fs::remove_dir(dir.join("suspended.json.tmp")).unwrap();
        r.add(std::slice::from_ref(&a)).unwrap();
        let (_, left) = FileRecord::open(&dir).unwrap();
        assert_eq!(left, vec![a], "the retried add reached the disk");
    }

    /// A symlink planted where the temporary file goes is replaced, not followed.
    #[test]
    fn a_planted_symlink_is_not_followed() {
        let dir = tmpdir("symlink");
        let (mut r, _) = FileRecord::open(&dir).unwrap();
        let victim = dir.join("victim");
        std::fs::write(&victim, "keep").unwrap();
        std::os::unix::fs::symlink(&victim, dir.join("suspended.json.tmp")).unwrap();
        r.add(&[RecordEntry::Process { pid: 1, start: 1 }]).unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
    }

    #[test]
    fn unwritable_state_dir_is_an_error_at_open() {
        let dir = tmpdir("unwritable");
        std::fs::create_dir_all(dir.join("suspended.json.tmp")).unwrap();
        let e = FileRecord::open(&dir).unwrap_err();
        let msg = format!("{e:#}");
        assert!(
            msg.contains("not writable") && msg.contains(&dir.display().to_string()),
            "{msg}"
        );
    }
}
