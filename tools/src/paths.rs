//! Where things are: the binaries in the cargo target directory, the simulated driver's
//! directory, and unique names for scratch files.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

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
