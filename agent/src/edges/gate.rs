//! The launch gate file, agent side: the one file per node whose per-GPU gate words the
//! offline processes' CUDA shim blocks its submissions on (layout and protocol:
//! `coloc_doorbell::gate`). Not wired into the loop yet.
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

use anyhow::{bail, Context, Result};
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
        let ctmp = CString::new(tmp.as_os_str().as_bytes())?;
        let cpath = CString::new(path.as_os_str().as_bytes())?;
        // SAFETY: a valid C path; a new file only (O_EXCL), never through a link.
        let fd = unsafe {
            libc::open(
                ctmp.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                0o644 as libc::c_uint,
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("creating {}", tmp.display()));
        }
        // SAFETY: `fd` is ours: fchmod, ftruncate, mmap of the length just set; closed
        // once; the temporary name is removed on every failure.
        let base = unsafe {
            let ok = libc::fchmod(fd, 0o644) == 0
                && libc::ftruncate(fd, GATE_FILE_SIZE as libc::off_t) == 0;
            let base = if ok {
                libc::mmap(
                    std::ptr::null_mut(),
                    GATE_FILE_SIZE,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd,
                    0,
                )
            } else {
                libc::MAP_FAILED
            };
            let err = std::io::Error::last_os_error();
            libc::close(fd);
            if base == libc::MAP_FAILED {
                libc::unlink(ctmp.as_ptr());
                return Err(err).with_context(|| format!("sizing and mapping {}", tmp.display()));
            }
            base
        };
        let g = GateFile {
            path: path.to_path_buf(),
            base,
        };
        g.gates().init(std::process::id(), now_ns());
        // SAFETY: two valid C paths in the same directory; rename replaces whatever is at
        // `path` (a link included) without following it.
        if unsafe { libc::rename(ctmp.as_ptr(), cpath.as_ptr()) } != 0 {
            let err = std::io::Error::last_os_error();
            // SAFETY: a valid C path.
            unsafe { libc::unlink(ctmp.as_ptr()) };
            return Err(err).with_context(|| format!("placing the gate file {}", path.display()));
        }
        Ok(g)
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

#[cfg(test)]
mod tests {
    use super::*;
    use coloc_doorbell::gate::{DEFAULT_STALE_NS, GATE_MAGIC};
    use std::sync::atomic::Ordering::SeqCst;
    use std::time::{Duration, Instant};

    fn tmpdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("coloc-gate-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    /// A read-only mapping of the file at `path`, as a shim makes it.
    fn map_ro(path: &Path) -> (*mut libc::c_void, Gates<'static>) {
        let f = std::fs::File::open(path).unwrap();
        use std::os::fd::AsRawFd;
        // SAFETY: a read-only shared mapping of a gate-file-long regular file.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                GATE_FILE_SIZE,
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        // SAFETY: the mapping outlives the test (never unmapped; tests only read).
        (base, unsafe { Gates::from_raw(base as *const u8) })
    }

    #[test]
    fn creates_the_directory_and_a_file_readers_see() {
        let root = tmpdir("create");
        let path = root.join("gate").join("gates");
        let g = GateFile::create(&path).unwrap();
        assert_eq!(g.path(), path);
        let dmode = std::fs::metadata(root.join("gate")).unwrap().mode() & 0o7777;
        assert_eq!(dmode, 0o755);
        let md = std::fs::metadata(&path).unwrap();
        assert_eq!(md.mode() & 0o7777, 0o644);
        assert_eq!(md.len(), GATE_FILE_SIZE as u64);
        let (_, r) = map_ro(&path);
        assert_eq!(r.header().magic.load(SeqCst), GATE_MAGIC);
        assert!(!r.stale(now_ns(), DEFAULT_STALE_NS));
        let u = [1u8; 16];
        let e = g.close(&u).unwrap();
        assert!(r.is_closed(&u), "the reader's mapping sees the close");
        assert_eq!(r.find(&u).unwrap().closed_epoch(), Some(e));
        assert!(g.is_closed(&u));
        assert_eq!(g.close(&u).unwrap(), e.wrapping_add(1));
        assert!(g.open(&u));
        assert!(!g.open(&u), "already open");
        assert!(!r.is_closed(&u));
        // Heartbeat.
        let hb = r.header().heartbeat_ns.load(SeqCst);
        std::thread::sleep(Duration::from_millis(2));
        g.beat();
        assert!(r.header().heartbeat_ns.load(SeqCst) > hb);
        // More GPUs than slots (u holds one).
        for i in 1..coloc_doorbell::MAX_GPUS as u8 {
            g.close(&[i + 10; 16]).unwrap();
        }
        assert!(g.close(&[200; 16]).is_err());
        assert_eq!(g.open_all(), coloc_doorbell::MAX_GPUS - 1);
        // Dropping the agent's handle opens every gate.
        g.close(&u).unwrap();
        drop(g);
        assert!(!r.is_closed(&u));
        std::fs::remove_dir_all(&root).ok();
    }

    #[test]
    fn replaces_a_file_or_a_link_without_following_it() {
        let root = tmpdir("replace");
        let dir = root.join("gate");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = dir.join("gates");
        let first = GateFile::create(&path).unwrap();
        let ino1 = std::fs::metadata(&path).unwrap().ino();
        let second = GateFile::create(&path).unwrap();
        let ino2 = std::fs::metadata(&path).unwrap().ino();
        assert_ne!(
            ino1, ino2,
            "a new inode: shims of the old one see it go stale"
        );
        drop(first);
        drop(second);
        // A symbolic link at the path is replaced, its target untouched.
        let victim = root.join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink(&victim, &path).unwrap();
        let g = GateFile::create(&path).unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
        assert!(!std::fs::symlink_metadata(&path)
            .unwrap()
            .file_type()
            .is_symlink());
        drop(g);
        // No temporary files left behind.
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(left, vec![std::ffi::OsString::from("gates")]);
        std::fs::remove_dir_all(&root).ok();
    }

    #[test]
    fn refuses_an_unsafe_directory() {
        let root = tmpdir("unsafe");
        std::fs::create_dir_all(&root).unwrap();
        let open = root.join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = GateFile::create(&open.join("gates")).unwrap_err();
        assert!(
            format!("{e:#}").contains("writable by group or others"),
            "{e:#}"
        );
        let group = root.join("group");
        std::fs::create_dir(&group).unwrap();
        std::fs::set_permissions(&group, std::fs::Permissions::from_mode(0o775)).unwrap();
        assert!(GateFile::create(&group.join("gates")).is_err());
        let real = root.join("real");
        std::fs::create_dir(&real).unwrap();
        std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o755)).unwrap();
        let link = root.join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let e = GateFile::create(&link.join("gates")).unwrap_err();
        assert!(format!("{e:#}").contains("symbolic link"), "{e:#}");
        assert!(!real.join("gates").exists());
        let file = root.join("file");
        std::fs::write(&file, b"").unwrap();
        assert!(GateFile::create(&file.join("gates")).is_err());
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            let theirs = root.join("theirs");
            std::fs::create_dir(&theirs).unwrap();
            std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o755)).unwrap();
            std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
            let e = GateFile::create(&theirs.join("gates")).unwrap_err();
            assert!(format!("{e:#}").contains("belongs to user 65534"), "{e:#}");
        }
        std::fs::remove_dir_all(&root).ok();
    }

    #[test]
    fn close_and_open_wake_waiters_at_once() {
        let root = tmpdir("wake");
        let path = root.join("gate").join("gates");
        let g = GateFile::create(&path).unwrap();
        let (_, r) = map_ro(&path);
        let u = [5u8; 16];
        // A waiter on the generation (the shim's watcher) wakes at the close.
        let gen = r.generation();
        let t = std::thread::spawn(move || {
            let t0 = Instant::now();
            coloc_doorbell::futex_wait(&r.header().generation, gen, 5_000_000_000);
            t0.elapsed()
        });
        std::thread::sleep(Duration::from_millis(50));
        let e = g.close(&u).unwrap();
        let waited = t.join().unwrap();
        assert!(
            waited < Duration::from_secs(2),
            "woken by the close: {waited:?}"
        );
        // A waiter on the closed word (a blocked submission) wakes at the open.
        let slot = r.find(&u).unwrap();
        let t = std::thread::spawn(move || {
            let t0 = Instant::now();
            coloc_doorbell::futex_wait(&slot.closed, e, 5_000_000_000);
            t0.elapsed()
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(g.open(&u));
        let waited = t.join().unwrap();
        assert!(
            waited < Duration::from_secs(2),
            "woken by the open: {waited:?}"
        );
        drop(g);
        std::fs::remove_dir_all(&root).ok();
    }
}
