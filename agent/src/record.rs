//! The fail-open record: what the agent has suspended, written down *before* it acts.
//!
//! If the agent dies (even `kill -9`), the next start reads this file and resumes
//! everything in it before doing anything else. The file is replaced atomically (write a
//! temporary file, fsync, rename), so a crash mid-write leaves the old or the new version,
//! never a torn one.
//!
//! May touch: the state directory (default `/run/coloc-agent`).

use crate::actuator::RecordEntry;
use anyhow::{Context, Result};
use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The record file and its in-memory copy.
#[derive(Debug)]
pub struct Record {
    path: PathBuf,
    entries: BTreeSet<RecordEntry>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct OnDisk {
    version: u32,
    suspended: Vec<RecordEntry>,
}

impl Record {
    /// Opens (creating the directory) the record in `dir`. Returns it with the entries a
    /// previous run left behind, which the caller must resume.
    pub fn open(dir: &Path) -> Result<(Record, Vec<RecordEntry>)> {
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
        let record = Record {
            path,
            entries: leftover.iter().cloned().collect(),
        };
        Ok((record, leftover))
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Entries currently recorded.
    pub fn entries(&self) -> &BTreeSet<RecordEntry> {
        &self.entries
    }

    /// Adds entries and persists (call before suspending them).
    pub fn add(&mut self, es: impl IntoIterator<Item = RecordEntry>) -> Result<()> {
        let before = self.entries.len();
        self.entries.extend(es);
        if self.entries.len() != before {
            self.persist()?;
        }
        Ok(())
    }

    /// Removes entries and persists (call after resuming them).
    pub fn remove<'a>(&mut self, es: impl IntoIterator<Item = &'a RecordEntry>) -> Result<()> {
        let mut changed = false;
        for e in es {
            changed |= self.entries.remove(e);
        }
        if changed {
            self.persist()?;
        }
        Ok(())
    }

    fn persist(&self) -> Result<()> {
        let tmp = self.path.with_extension("json.tmp");
        let body = serde_json::to_vec_pretty(&OnDisk {
            version: 1,
            suspended: self.entries.iter().cloned().collect(),
        })?;
        let mut f =
            std::fs::File::create(&tmp).with_context(|| format!("writing {}", tmp.display()))?;
        f.write_all(&body)?;
        f.sync_data()?;
        std::fs::rename(&tmp, &self.path)
            .with_context(|| format!("replacing {}", self.path.display()))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::actuator::CgroupVersion;

    #[test]
    fn survives_reopen() {
        let dir = std::env::temp_dir().join(format!("coloc-record-{}", std::process::id()));
        let (mut r, left) = Record::open(&dir).unwrap();
        assert!(left.is_empty());
        let a = RecordEntry::Process { pid: 1, start: 2 };
        let b = RecordEntry::Cgroup {
            dir: "/sys/fs/cgroup/x".into(),
            version: CgroupVersion::V2,
        };
        r.add([a.clone(), b.clone()]).unwrap();
        r.remove([&a]).unwrap();
        let (_, left) = Record::open(&dir).unwrap();
        assert_eq!(left, vec![b]);
        std::fs::write(dir.join("suspended.json"), b"{not json").unwrap();
        let e = Record::open(&dir).unwrap_err();
        assert!(format!("{e:#}").contains("corrupt"), "{e:#}");
        std::fs::remove_dir_all(dir).ok();
    }
}
