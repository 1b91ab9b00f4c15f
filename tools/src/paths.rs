//! Where things are: the binaries in the cargo target directory, the simulated driver's
//! directory, and unique names for scratch files.

use std::path::PathBuf;
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
