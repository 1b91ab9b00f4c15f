//! Creating a shared file that appears complete: the one sequence both writers use (the
//! shim for its doorbell page, the agent for the gate file).
//!
//! ```text
//!  open(tmp, O_CREAT | O_EXCL | O_NOFOLLOW)   a new file only, never through a link
//!  fchmod(MODE)                               whatever the umask
//!  ftruncate(len); mmap(shared, read-write)   the caller's mapping
//!  init(base)                                 the caller writes the contents
//!  close; place(tmp → path)                   readers that watch `path` see it complete
//! ```
//!
//! On any failure the temporary file is removed and the mapping undone. Placing is
//! [`Place::NoReplace`] (`renameat2(RENAME_NOREPLACE)`, or `link` + `unlink` where that is
//! refused for any reason but the name being taken: a filesystem without the flag, a
//! seccomp profile without `renameat2`) or [`Place::Replace`] (`rename`, which replaces
//! whatever is at `path`, a link included, without following it). `renameat2` is called
//! as a system call, not through glibc's wrapper (glibc 2.28), so that the shim needs no
//! newer glibc than its floor.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::ptr::NonNull;

/// The mode of every file made here: the writer reads and writes it, everyone reads it
/// (the agent maps pages read-only; the shim maps the gate file read-only).
pub const MODE: libc::mode_t = 0o644;

/// How the finished file takes its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// Never replace a file that has the name (a doorbell page: the name is the
    /// process's own).
    NoReplace,
    /// Replace whatever has the name (the gate file: a restarted agent's new file).
    Replace,
}

/// Which step failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Creating the temporary file.
    Create,
    /// Setting its mode and size, or mapping it.
    Map,
    /// Giving it its name.
    Place,
}

/// A failed [`create_mapped`]: the step and the system's error. Nothing is left behind.
#[derive(Debug)]
pub struct CreateError {
    /// Where it failed.
    pub step: Step,
    /// Why.
    pub err: std::io::Error,
}

impl std::fmt::Display for CreateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self.step {
            Step::Create => "creating the file",
            Step::Map => "sizing and mapping the file",
            Step::Place => "placing the file",
        };
        write!(f, "{what}: {}", self.err)
    }
}

impl std::error::Error for CreateError {}

fn fail<T>(step: Step, err: std::io::Error) -> Result<T, CreateError> {
    Err(CreateError { step, err })
}

/// Creates `tmp` (a new file, never through a link), mode [`MODE`], `len` bytes, maps it
/// read-write and shared, lets `init` write it, and gives it the name `path` as `place`
/// says. Returns the mapping (`len` bytes, the caller's to keep or unmap).
pub fn create_mapped(
    tmp: &Path,
    path: &Path,
    len: usize,
    place: Place,
    init: impl FnOnce(NonNull<u8>),
) -> Result<NonNull<u8>, CreateError> {
    let nul = |p: &Path| {
        CString::new(p.as_os_str().as_bytes())
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))
    };
    let (ctmp, cpath) = match (nul(tmp), nul(path)) {
        (Ok(t), Ok(p)) => (t, p),
        (Err(e), _) | (_, Err(e)) => return fail(Step::Create, e),
    };
    // SAFETY: a valid C path; a new file only (O_EXCL), never through a link.
    let fd = unsafe {
        libc::open(
            ctmp.as_ptr(),
            libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            MODE as libc::c_uint,
        )
    };
    if fd < 0 {
        return fail(Step::Create, std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is ours: fchmod, ftruncate, a mapping of the length just set; closed
    // once; the temporary name is removed on every failure.
    let base = unsafe {
        let ok = libc::fchmod(fd, MODE) == 0 && libc::ftruncate(fd, len as libc::off_t) == 0;
        let base = if ok {
            libc::mmap(
                std::ptr::null_mut(),
                len,
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
            return fail(Step::Map, err);
        }
        base
    };
    // SAFETY: mmap never returns null for a mapping at an address it picks.
    let base = unsafe { NonNull::new_unchecked(base.cast::<u8>()) };
    init(base);
    if let Err(e) = place_file(&ctmp, &cpath, place) {
        // SAFETY: the mapping made above, never handed out; the temporary file, ours.
        unsafe {
            libc::munmap(base.as_ptr().cast(), len);
            libc::unlink(ctmp.as_ptr());
        }
        return fail(Step::Place, e);
    }
    Ok(base)
}

fn place_file(from: &CString, to: &CString, place: Place) -> std::io::Result<()> {
    if place == Place::Replace {
        // SAFETY: two valid C paths.
        return match unsafe { libc::rename(from.as_ptr(), to.as_ptr()) } {
            0 => Ok(()),
            _ => Err(std::io::Error::last_os_error()),
        };
    }
    // SAFETY: valid C paths; renameat2 with AT_FDCWD and a flag, as a system call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if r == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    // The name is taken: never replace a file. Any other refusal: try a link.
    if err.raw_os_error() == Some(libc::EEXIST) {
        return Err(err);
    }
    // SAFETY: valid C paths.
    if unsafe { libc::link(from.as_ptr(), to.as_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a valid C path.
    unsafe { libc::unlink(from.as_ptr()) };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A scratch directory, removed when dropped (passing or failing).
    fn dir(name: &str) -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix(&format!("coloc-doorbell-file-{name}-"))
            .tempdir()
            .unwrap()
    }

    fn unmap(p: NonNull<u8>, len: usize) {
        // SAFETY: a mapping made by create_mapped, unmapped once.
        unsafe { libc::munmap(p.as_ptr().cast(), len) };
    }

    #[test]
    fn the_file_appears_complete_with_its_mode_whatever_the_umask() {
        let d = dir("complete");
        let (tmp, path) = (d.path().join("x.new"), d.path().join("x"));
        // SAFETY: umask has no preconditions (restored below).
        let old = unsafe { libc::umask(0o077) };
        let p = create_mapped(&tmp, &path, 4096, Place::NoReplace, |b| {
            assert!(!path.exists(), "not named before it is written");
            // SAFETY: a fresh 4096-byte read-write mapping.
            unsafe { *b.as_ptr() = 7 };
        });
        // SAFETY: as above.
        unsafe { libc::umask(old) };
        let p = p.unwrap();
        assert!(!tmp.exists());
        let md = std::fs::metadata(&path).unwrap();
        assert_eq!(md.len(), 4096);
        assert_eq!(md.permissions().mode() & 0o777, 0o644);
        assert_eq!(std::fs::read(&path).unwrap()[0], 7);
        unmap(p, 4096);
    }

    #[test]
    fn no_replace_keeps_the_file_that_has_the_name_and_leaves_nothing() {
        let d = dir("noreplace");
        let (tmp, path) = (d.path().join("x.new"), d.path().join("x"));
        std::fs::write(&path, b"theirs").unwrap();
        let e = create_mapped(&tmp, &path, 4096, Place::NoReplace, |_| {}).unwrap_err();
        assert_eq!(e.step, Step::Place);
        assert_eq!(std::fs::read(&path).unwrap(), b"theirs");
        assert!(!tmp.exists(), "the temporary file is removed");
        // Replace does replace it.
        let p = create_mapped(&tmp, &path, 4096, Place::Replace, |_| {}).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 4096);
        unmap(p, 4096);
    }

    #[test]
    fn a_link_or_a_file_at_the_temporary_name_is_refused() {
        let d = dir("link");
        let (tmp, path) = (d.path().join("x.new"), d.path().join("x"));
        let target = d.path().join("target");
        std::os::unix::fs::symlink(&target, &tmp).unwrap();
        let e = create_mapped(&tmp, &path, 4096, Place::Replace, |_| {}).unwrap_err();
        assert_eq!(e.step, Step::Create);
        assert!(!target.exists(), "never created through the link");
        assert!(!path.exists());
        std::fs::remove_file(&tmp).unwrap();
        std::fs::write(&tmp, b"x").unwrap();
        let e = create_mapped(&tmp, &path, 4096, Place::Replace, |_| {}).unwrap_err();
        assert_eq!(e.err.raw_os_error(), Some(libc::EEXIST));
    }
}
