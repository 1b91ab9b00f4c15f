//! What the crate's unit tests share.

use std::path::{Path, PathBuf};

/// A test's scratch directory, `{prefix}-{pid}` under the temporary directory (what an
/// earlier run left there is removed first). Removed when dropped, so a test that fails
/// (panics) leaves nothing behind either.
pub(crate) struct TmpDir(PathBuf);

impl TmpDir {
    pub(crate) fn new(prefix: &str) -> TmpDir {
        let dir = std::env::temp_dir().join(format!("{prefix}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        TmpDir(dir)
    }
}

impl std::ops::Deref for TmpDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for TmpDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TmpDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
