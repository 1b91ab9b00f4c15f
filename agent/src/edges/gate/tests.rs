use super::*;
use crate::testutil::TmpDir;
use coloc_doorbell::gate::{DEFAULT_STALE_NS, GATE_MAGIC};
use std::sync::atomic::Ordering::SeqCst;
use std::time::{Duration, Instant};

fn tmpdir(name: &str) -> TmpDir {
    TmpDir::new(&format!("coloc-gate-{name}"))
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
}
