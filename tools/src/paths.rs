//! Where things are: the binaries in the cargo target directory, the simulated driver's
//! directory, and unique names for scratch files.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Once;

static SEQ: AtomicU32 = AtomicU32::new(0);

/// A binary from the target directory (`target/<profile>/`).
pub fn bin(name: &str) -> PathBuf {
    // Tests live in target/<profile>/deps/, binaries (coloc-bench too) in target/<profile>/.
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().expect("exe dir");
    let dir = if dir.ends_with("deps") {
        dir.parent().expect("target dir")
    } else {
        dir
    };
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} missing: run `cargo build --workspace` before the end-to-end tests",
        p.display()
    );
    p
}

/// Where an end-to-end test keeps files: `/tmp` (or `TMPDIR`) and `/dev/shm`.
fn scratch_roots() -> [PathBuf; 2] {
    [std::env::temp_dir(), PathBuf::from("/dev/shm")]
}

/// Removes what earlier end-to-end test processes kept when a test failed (an agent's
/// state, record and log, named in that test's failure output): every `coloc-e2e-*` entry
/// in the scratch roots whose [`unique`] name carries the PID of a process that is gone.
/// Once per test process, before its first agent or simulated GPU; entries of a run still
/// going (its PID alive) are left alone. Returns what it removed.
pub fn sweep_leftovers() -> Vec<PathBuf> {
    static SWEPT: Once = Once::new();
    let mut removed = Vec::new();
    SWEPT.call_once(|| {
        for root in scratch_roots() {
            let Ok(dir) = std::fs::read_dir(&root) else {
                continue;
            };
            for e in dir.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if let Some(pid) = leftover_pid(&name) {
                    if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
                        remove_path(&e.path());
                        removed.push(e.path());
                    }
                }
            }
        }
        if !removed.is_empty() {
            eprintln!(
                "NOTE: removed {} files kept by earlier failed end-to-end tests: {removed:?}",
                removed.len()
            );
        }
    });
    removed
}

/// The PID in a [`unique`] name of the end-to-end tests (`coloc-e2e…-<pid>-<n>`).
fn leftover_pid(name: &str) -> Option<u32> {
    if !name.starts_with("coloc-e2e") {
        return None;
    }
    let mut parts = name.rsplit('-');
    parts.next()?.parse::<u32>().ok()?;
    parts.next()?.parse().ok()
}

/// A unique name for this test process.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::SeqCst)
    )
}

/// The directory of the simulated `libcuda.so.1` (for `LD_LIBRARY_PATH`).
pub fn fake_cuda() -> PathBuf {
    let profile = bin("coloc-sim").parent().unwrap().to_path_buf();
    coloc_sim::fake_libcuda_dir(&profile).expect("fake libcuda dir")
}

/// A scratch path of a test (a file, or a directory and all it holds), removed when
/// dropped: at the end of the test, and also when the test fails (panics). Made with
/// [`TempPath::new`] (a [`unique`] name under the temporary directory, not created) or
/// [`TempPath::at`]; reads as the [`Path`] it holds.
#[derive(Debug)]
pub struct TempPath(PathBuf);

impl TempPath {
    /// `<temporary directory>/<prefix>-<pid>-<n>`: nothing is created there.
    pub fn new(prefix: &str) -> TempPath {
        TempPath(std::env::temp_dir().join(unique(prefix)))
    }

    /// [`TempPath::new`], created as an empty directory.
    pub fn dir(prefix: &str) -> TempPath {
        let d = TempPath::new(prefix);
        std::fs::create_dir_all(&d.0).unwrap_or_else(|e| panic!("creating {}: {e}", d.0.display()));
        d
    }

    /// Takes charge of `path`: removed when the guard is dropped.
    pub fn at(path: impl Into<PathBuf>) -> TempPath {
        TempPath(path.into())
    }

    /// Gives up charge of the path (nothing is removed): the caller's from now on, e.g.
    /// handed to an [`Agent`](crate::Agent)'s `scratch`.
    pub fn keep(mut self) -> PathBuf {
        std::mem::take(&mut self.0)
    }
}

impl std::ops::Deref for TempPath {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for TempPath {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<std::ffi::OsStr> for TempPath {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.as_os_str()
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        remove_path(&self.0);
    }
}

/// Removes `path` whatever it is (a directory with everything in it, a file, a link: not
/// followed), if it is there.
fn remove_path(path: &Path) {
    if path.as_os_str().is_empty() {
        return; // given up (`keep`)
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => {
            let _ = std::fs::remove_dir_all(path);
        }
        Ok(_) => {
            let _ = std::fs::remove_file(path);
        }
        Err(_) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leftovers_of_gone_processes_are_swept_and_live_ones_kept() {
        assert_eq!(leftover_pid("coloc-e2e-state-123-4"), Some(123));
        assert_eq!(leftover_pid("coloc-e2e-123-0"), Some(123));
        assert_eq!(leftover_pid("coloc-robust-123-0"), None);
        assert_eq!(leftover_pid("coloc-e2e-state"), None);
        // A PID above the kernel's limit is never alive; ours is.
        let gone = std::env::temp_dir().join("coloc-e2e-sweep-4194305-0");
        let live = std::env::temp_dir().join(unique("coloc-e2e-sweep"));
        std::fs::create_dir_all(gone.join("state")).unwrap();
        std::fs::write(&live, b"x").unwrap();
        let _live = TempPath::at(&live);
        let removed = sweep_leftovers();
        assert!(removed.contains(&gone), "{removed:?}");
        assert!(!gone.exists());
        assert!(live.exists(), "a file of a live process was swept");
    }
}
