//! The launch gate file, agent side: the one file per node whose per-GPU gate words the
//! offline processes' CUDA shim blocks its submissions on (layout and protocol:
//! `coloc_doorbell::gate`).
//!
//! ```text
//!  GateFile::create(path)   dir: created 0755 if missing; refused if a symlink, not a
//!                           directory, writable by group or others, or owned by another
//!                           user than us or root
//!                           file: <dir>/.gates.<pid>.<ns> (O_EXCL, O_NOFOLLOW, 0644),
//!                           initialised, renamed over the path (never follows a link
//!                           there; a shim with the old file sees its heartbeat go stale)
//!  close(uuid) -> epoch     closed = epoch; generation += 1; FUTEX_WAKE(generation)
//!  open(uuid), open_all()   closed = 0; generation += 1; FUTEX_WAKE(closed), (generation)
//!  beat()                   heartbeat = now (at least every HEARTBEAT_NS while the agent
//!                           runs: shims treat an older one as an open gate)
//!  drop                     every gate opened (the file stays; its heartbeat goes stale)
//! ```
//!
//! The acknowledgements come back in the processes' doorbell pages
//! (`coloc_doorbell::Page::read_gate`): a close is acknowledged by a page when its
//! `gate_ack` equals the close's epoch (equal, not greater: a replaced file's epochs are
//! seeded afresh).
//!
//! [`GateKeeper`] (in `act`) closes and opens these gates for the loop's holds.

use anyhow::{bail, Context, Result};
use coloc_doorbell::file::{create_mapped, Place, Step};
use coloc_doorbell::gate::{Gates, GATE_FILE_SIZE};
use coloc_doorbell::{futex_wake, now_ns};
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The agent's read-write mapping of the gate file.
pub struct GateFile {
    path: PathBuf,
    base: *mut libc::c_void,
}

// SAFETY: the mapping is shared memory accessed only through atomics; it is unmapped once,
// on drop.
unsafe impl Send for GateFile {}
// SAFETY: as above: every access is an atomic operation.
unsafe impl Sync for GateFile {}

impl std::fmt::Debug for GateFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GateFile")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// Checks (creating it if missing) the directory that holds the gate file.
fn check_dir(dir: &Path) -> Result<()> {
    if std::fs::symlink_metadata(dir).is_err() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)
            .with_context(|| format!("creating the gate directory {}", dir.display()))?;
        // The umask may have cut the mode.
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
            .with_context(|| format!("setting the mode of {}", dir.display()))?;
    }
    let md = std::fs::symlink_metadata(dir)
        .with_context(|| format!("reading the gate directory {}", dir.display()))?;
    if md.file_type().is_symlink() {
        bail!(
            "the gate directory {} is a symbolic link: refusing it",
            dir.display()
        );
    }
    if !md.is_dir() {
        bail!("the gate directory {} is not a directory", dir.display());
    }
    if md.mode() & 0o022 != 0 {
        bail!(
            "the gate directory {} is writable by group or others (mode {:o}): another user could replace the gate file",
            dir.display(),
            md.mode() & 0o7777
        );
    }
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if md.uid() != me && md.uid() != 0 {
        bail!(
            "the gate directory {} belongs to user {}, not to us ({me}) or root",
            dir.display(),
            md.uid()
        );
    }
    Ok(())
}

/// Maps `GATE_FILE_SIZE` bytes of `fd` read-write and shared; `MAP_FAILED` on failure.
///
/// # Safety
/// `fd` must be an open descriptor of a regular file at least `GATE_FILE_SIZE` long.
unsafe fn map_rw(fd: libc::c_int) -> *mut libc::c_void {
    // SAFETY: the caller's promise; a fresh mapping at an address the kernel picks.
    unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            GATE_FILE_SIZE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    }
}

impl GateFile {
    /// Creates (or replaces) the gate file at `path`, every gate open, heartbeat now.
    pub fn create(path: &Path) -> Result<GateFile> {
        let dir = path
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        check_dir(dir)?;
        let name = path
            .file_name()
            .with_context(|| format!("{} names no file", path.display()))?;
        let tmp = dir.join(format!(
            ".{}.{}.{}",
            name.to_string_lossy(),
            std::process::id(),
            now_ns()
        ));
        let base = create_mapped(&tmp, path, GATE_FILE_SIZE, Place::Replace, |b| {
            // SAFETY: a fresh read-write shared mapping of GATE_FILE_SIZE bytes.
            unsafe { Gates::from_raw(b.as_ptr()) }.init(std::process::id(), now_ns())
        })
        .map_err(|e| {
            let what = match e.step {
                Step::Create => format!("creating {}", tmp.display()),
                Step::Map => format!("sizing and mapping {}", tmp.display()),
                Step::Place => format!("placing the gate file {}", path.display()),
            };
            anyhow::Error::new(e.err).context(what)
        })?;
        Ok(GateFile {
            path: path.to_path_buf(),
            base: base.as_ptr().cast(),
        })
    }

    /// Maps the gate file a previous run left at `path`, read-write, without replacing it
    /// (to open its gates: `coloc-agent resume`, leftovers at start). `None` when there is
    /// no file; an error when it is not a regular file of this layout.
    pub fn attach(path: &Path) -> Result<Option<GateFile>> {
        let cpath = CString::new(path.as_os_str().as_bytes())?;
        // SAFETY: a valid C path; never through a link.
        let fd = unsafe {
            libc::open(
                cpath.as_ptr(),
                libc::O_RDWR | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK,
            )
        };
        if fd < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::NotFound {
                return Ok(None);
            }
            return Err(err).with_context(|| format!("opening {}", path.display()));
        }
        // SAFETY: `fd` is ours: fstat, then a mapping of the length checked; closed once.
        let base = unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            let ok = libc::fstat(fd, &mut st) == 0
                && (st.st_mode & libc::S_IFMT) == libc::S_IFREG
                && st.st_size as usize >= GATE_FILE_SIZE;
            let base = if ok { map_rw(fd) } else { libc::MAP_FAILED };
            libc::close(fd);
            if !ok {
                bail!(
                    "{} is not a regular file of a gate file's size",
                    path.display()
                );
            }
            if base == libc::MAP_FAILED {
                return Err(std::io::Error::last_os_error())
                    .with_context(|| format!("mapping {}", path.display()));
            }
            base
        };
        let g = GateFile {
            path: path.to_path_buf(),
            base,
        };
        if !g.gates().valid() {
            bail!("{} is not a gate file of this version", path.display());
        }
        Ok(Some(g))
    }

    /// Where the file is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The layout view.
    pub fn gates(&self) -> Gates<'_> {
        // SAFETY: a live read-write shared mapping of GATE_FILE_SIZE bytes, page-aligned.
        unsafe { Gates::from_raw(self.base as *const u8) }
    }

    /// Closes `uuid`'s gate: returns the close's epoch, which the processes' pages
    /// acknowledge in `gate_ack`. Fails when every slot is another GPU's.
    pub fn close(&self, uuid: &[u8; 16]) -> Result<u32> {
        let g = self.gates();
        let epoch = g.close(uuid).with_context(|| {
            format!(
                "no gate slot left for {} (at most {} GPUs)",
                coloc_doorbell::format_uuid(uuid),
                coloc_doorbell::MAX_GPUS
            )
        })?;
        futex_wake(&g.header().generation);
        Ok(epoch)
    }

    /// Opens `uuid`'s gate; true if it was closed.
    pub fn open(&self, uuid: &[u8; 16]) -> bool {
        let g = self.gates();
        let was = g.open(uuid);
        if let Some(s) = was {
            futex_wake(&s.closed);
        }
        futex_wake(&g.header().generation);
        was.is_some()
    }

    /// Opens every gate; returns how many were closed.
    pub fn open_all(&self) -> usize {
        let g = self.gates();
        let was = g.open_all();
        for s in &was {
            futex_wake(&s.closed);
        }
        futex_wake(&g.header().generation);
        was.len()
    }

    /// Refreshes the heartbeat (at least every `coloc_doorbell::gate::HEARTBEAT_NS`).
    pub fn beat(&self) {
        self.gates().beat(now_ns());
    }

    /// Whether `uuid`'s gate is closed.
    pub fn is_closed(&self, uuid: &[u8; 16]) -> bool {
        self.gates().is_closed(uuid)
    }
}

impl Drop for GateFile {
    fn drop(&mut self) {
        self.open_all();
        // SAFETY: our own mapping, unmapped once.
        unsafe { libc::munmap(self.base, GATE_FILE_SIZE) };
    }
}

mod act;
pub use act::{open_recorded, GateKeeper, LaunchGates};

#[cfg(test)]
mod tests;
