//! Pages under a directory: found by inotify and rescans, mapped read-only, read, and
//! waited on.

use super::guard;
use super::wait::{trusted_pod_dir, waitv, Dirty, Scope, Watcher, MAX_WAITERS};
use super::{BellReading, Doorbells, Owner, PageInfo, Waker};
use coloc_doorbell::{Page, PAGE, SUFFIX, TEMP_SUFFIX};
use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering::*};
use std::sync::Arc;
use std::time::Duration;
use tracing::{debug, info, warn};

struct Mapped {
    info: PageInfo,
    base: *mut libc::c_void,
    /// The wake word as of the latest read.
    seen: u32,
    /// Changes of the wake word seen in the current second (the second, the count).
    wakes: (u64, u32),
}

// SAFETY: the mapping is read-only shared memory accessed only through atomics; it is
// unmapped once, on drop, by whoever owns the `Mapped`.
unsafe impl Send for Mapped {}

impl Mapped {
    fn page(&self) -> Page<'_> {
        // SAFETY: `base` is a live PROT_READ mapping of PAGE bytes; `Page` only loads
        // through atomics (the agent never calls the writer-side methods on it).
        unsafe { Page::from_raw(self.base.cast()) }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        guard::unregister(self.base as usize);
        // SAFETY: our own mapping, unmapped once.
        unsafe { libc::munmap(self.base, PAGE) };
    }
}

/// How long a file that is not a valid page yet is looked at again at every rescan.
const INCOMPLETE_RETRY: Duration = Duration::from_secs(1);
/// Most pages mapped from one pod's directory: a pod cannot take the SIGBUS guard's slots
/// (4096 for the node) or the futex wait set from the others.
pub(super) const MAX_PAGES_PER_POD: usize = 32;
/// Most pages mapped from the top directory (standalone processes).
const MAX_PAGES_TOP: usize = 512;
/// Most directory entries one rescan looks at in one directory: a directory flooded with
/// files costs a bounded amount of work, and only its own pod's pages can go unseen.
pub(super) const MAX_ENTRIES_PER_DIR: usize = 1024;
/// Most pod directories read (a node runs at most a few hundred pods).
const MAX_POD_DIRS: usize = 1024;
/// Most pages mapped per file owner (UID) in the top directory, shared by every user.
const MAX_PAGES_PER_UID_TOP: usize = 64;
/// A directory that changed is rescanned at once up to this many times a second; beyond,
/// at most once per [`DIR_RESCAN_GAP`]: a directory whose files change in a loop costs a
/// bounded amount of work, and others are not held up by it.
const DIR_RESCANS_PER_SECOND: u32 = 20;
const DIR_RESCAN_GAP: Duration = Duration::from_millis(50);
/// A page whose wake word changes more often in a second than its writer's runs can
/// start (one per wake gap: a run needs a gap that long before it), and at least this
/// often, is not waited on for the rest of that second (still read every tick): a tenant
/// bumping it in a loop must not spin the loop.
const WAKES_PER_PAGE_PER_SECOND: u32 = 20;
/// The most a page's wake gap can raise its own limit to (a 2 ms gap: 500 a second).
const WAKES_PER_PAGE_MAX: u32 = 500;
/// All the pages of one owner (a pod, or a standalone process) together wake the loop at
/// most this often in a second: a tenant's pages share it, whatever wake gaps they state.
const WAKES_PER_OWNER_PER_SECOND: u32 = 500;

/// Who shares one wake budget: a pod's pages; in the top directory, the pages of one file
/// owner (a page's claimed PID is only a name: a user could name pages after many PIDs).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Budget {
    Pod(String),
    Uid(u32),
}

fn budget(info: &super::PageInfo) -> Budget {
    match &info.owner {
        super::Owner::Pod(uid) => Budget::Pod(uid.clone()),
        super::Owner::Pid(_) => Budget::Uid(info.file_uid),
    }
}

/// Whether `m` may still wake the loop in second `sec`: under its own limit and its
/// owner's.
fn calm(m: &Mapped, owners: &HashMap<Budget, (u64, u32)>, sec: u64) -> bool {
    let page = m.wakes.0 != sec || m.wakes.1 < page_wake_limit(m);
    let owner = owners
        .get(&budget(&m.info))
        .is_none_or(|o| o.0 != sec || o.1 < WAKES_PER_OWNER_PER_SECOND);
    page && owner
}

/// How often in a second `m`'s wake word may change before it is read at ticks only.
fn page_wake_limit(m: &Mapped) -> u32 {
    let per_s = 1_000_000_000 / m.info.wake_gap_ns.max(1);
    u32::try_from(per_s)
        .unwrap_or(u32::MAX)
        .clamp(WAKES_PER_PAGE_PER_SECOND, WAKES_PER_PAGE_MAX)
}
/// Warnings about pages that turned invalid, at most this many a second.
const WARN_PER_SECOND: u32 = 10;

/// A file as last seen: a rejected file that is still the same file is not opened again.
type Ident = (u64, u64, i64, i64, u64);

fn ident(m: &std::fs::Metadata) -> Ident {
    (m.dev(), m.ino(), m.mtime(), m.mtime_nsec(), m.size())
}

/// Pages under a directory, watched with inotify.
pub struct DirBells {
    dir: PathBuf,
    pages: HashMap<PathBuf, Mapped>,
    /// Files seen that are not (yet) valid pages, with the reason (logged once), when
    /// first seen, and the file as it was then.
    rejected: HashMap<PathBuf, (String, std::time::Instant, Option<Ident>)>,
    next_id: u64,
    /// Bumped by the inotify thread and by [`Waker`]s.
    waker: Waker,
    /// What the inotify thread saw change since the latest rescan.
    pub(super) dirty: Arc<Dirty>,
    /// Directories that changed but were rescanned less than [`DIR_RESCAN_GAP`] ago: when
    /// each is due.
    pending: HashMap<Scope, std::time::Instant>,
    /// When each directory was last rescanned, and the rescans a change asked for in the
    /// current second (when it began, how many).
    scanned: HashMap<Scope, (std::time::Instant, std::time::Instant, u32)>,
    /// Rate limit of the invalid-page warnings: the second and how many so far.
    warned: (u64, u32),
    /// "Doorbell page found" lines, limited per owner (a page rewritten in a loop is a new
    /// page each time).
    lines: crate::logbudget::LogBudget,
    /// "Doorbell page found" lines said, and lines held back and summarised, per owner
    /// (for tests: what the log says, without a log).
    pub(super) said: HashMap<String, u64>,
    pub(super) held_back: HashMap<String, u64>,
    /// Pages to wait on first (see [`Doorbells::prefer`]).
    preferred: std::collections::HashSet<u64>,
    /// Files opened to be mapped, and directory rescans, since the start (for tests).
    pub(super) opened: u64,
    pub(super) rescans: HashMap<Scope, u64>,
    /// `futex_waitv` is missing (Linux < 5.16): the loop polls instead.
    no_waitv: bool,
    /// The waker's word as of the latest read.
    waker_seen: u32,
    /// Wake-word changes per owner in the current second (the second, the count).
    owner_wakes: HashMap<Budget, (u64, u32)>,
    /// Pods whose `pods/<uid>` the agent made or found right.
    pod_dirs: std::collections::HashSet<String>,
    /// Which pod holds each slot directory `pods/slot-<class>-<n>` (the device plugin's
    /// delivery), and the generation last read.
    slots: Option<(Arc<crate::edges::deviceplugin::SlotOwners>, u64)>,
}

impl std::fmt::Debug for DirBells {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirBells")
            .field("dir", &self.dir)
            .field("pages", &self.pages.len())
            .finish_non_exhaustive()
    }
}

impl DirBells {
    /// Watches `dir` on a standalone host: see [`DirBells::open`].
    pub fn new(dir: &Path) -> anyhow::Result<DirBells> {
        Self::open(dir, super::Layout::Standalone)
    }

    /// Watches `dir`, with `pods/` inside, created if missing, with the modes of `layout`
    /// (standalone: 1777, any user's process may add its page and none may remove
    /// another's; Kubernetes: root's 0755, each pod writing only in its own `pods/<uid>`,
    /// which the agent makes: [`Doorbells::ensure_pod_dirs`]).
    pub fn open(dir: &Path, layout: super::Layout) -> anyhow::Result<DirBells> {
        for d in [dir.to_path_buf(), dir.join("pods")] {
            super::pod_dirs::prepare(&d, layout)?;
        }
        let waker = Waker::default();
        let dirty = Arc::new(Dirty::default());
        let watcher = Watcher::spawn(dir, waker.clone(), dirty.clone());
        if let Err(err) = &watcher {
            warn!(%err, dir = %dir.display(), "Cannot watch the doorbell directory: new pages are found every second instead of at once");
        }
        Ok(DirBells {
            dir: dir.to_path_buf(),
            pages: HashMap::new(),
            rejected: HashMap::new(),
            next_id: 1,
            waker,
            dirty,
            pending: HashMap::new(),
            scanned: HashMap::new(),
            warned: (0, 0),
            lines: Default::default(),
            said: HashMap::new(),
            held_back: HashMap::new(),
            preferred: Default::default(),
            opened: 0,
            rescans: HashMap::new(),
            no_waitv: false,
            waker_seen: 0,
            owner_wakes: HashMap::new(),
            pod_dirs: Default::default(),
            slots: None,
        })
    }

    fn note_held(&mut self, held: &[crate::logbudget::Held]) {
        for h in held {
            *self.held_back.entry(h.owner.clone()).or_default() += h.held;
        }
    }

    /// Reads the slot directories `pods/slot-<class>-<n>` too, each as the pages of the pod
    /// `owners` says holds the slot (from the kubelet); a slot no pod holds is not read.
    pub fn with_slots(mut self, owners: Arc<crate::edges::deviceplugin::SlotOwners>) -> DirBells {
        self.slots = Some((owners, u64::MAX));
        self
    }

    /// The pod whose pages a directory of `pods/` holds: its own (named by its UID), or the
    /// one holding the slot.
    fn owner_of_dir(&self, name: &str) -> Option<String> {
        if is_pod_uid(name) {
            return Some(name.to_string());
        }
        qos_core::cdi::Slot::of_dir_name(name)?;
        self.slots.as_ref()?.0.owner(name)
    }

    /// The pages a directory offers: at most [`MAX_ENTRIES_PER_DIR`] entries looked at.
    fn candidates(&self, scope: &Scope) -> (Vec<(PathBuf, Owner)>, bool) {
        let mut out = Vec::new();
        let mut truncated = false;
        let pid_of = |p: &Path| {
            p.file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.split(['-', '.']).next())
                .and_then(|n| n.parse::<u32>().ok())
        };
        let exited = |pid: u32| !Path::new(&format!("/proc/{pid}")).exists();
        let unfinished = format!("{SUFFIX}{TEMP_SUFFIX}");
        match scope {
            Scope::Top => {
                let listed: Vec<PathBuf> = std::fs::read_dir(&self.dir)
                    .map(|rd| {
                        rd.flatten()
                            .take(MAX_ENTRIES_PER_DIR + 1)
                            .map(|e| e.path())
                            .collect()
                    })
                    .unwrap_or_default();
                truncated = listed.len() > MAX_ENTRIES_PER_DIR;
                for p in listed {
                    let Some(name) = p.to_str() else { continue };
                    // A page being written (`.bell.new`) is never read; one left by a process
                    // killed before it renamed it is removed here.
                    if name.ends_with(&unfinished) {
                        if pid_of(&p).is_some_and(exited) && std::fs::remove_file(&p).is_ok() {
                            debug!(page = %p.display(), "Removed an unfinished doorbell page of an exited process");
                        }
                        continue;
                    }
                    if !name.ends_with(SUFFIX) {
                        continue;
                    }
                    if let Some(pid) = pid_of(&p) {
                        // A process killed before it could remove its page: remove it for it.
                        if exited(pid) {
                            if std::fs::remove_file(&p).is_ok() {
                                debug!(page = %p.display(), pid, "Removed the doorbell page of an exited process");
                            }
                            continue;
                        }
                        out.push((p, Owner::Pid(pid)));
                    }
                }
            }
            Scope::Pod(name) => {
                let d = self.dir.join("pods").join(name);
                let Some(uid) = self.owner_of_dir(name) else {
                    return (out, false);
                };
                if !trusted_pod_dir(&d) {
                    return (out, false);
                }
                if let Ok(rd) = std::fs::read_dir(&d) {
                    for (i, p) in rd.flatten().map(|e| e.path()).enumerate() {
                        if i >= MAX_ENTRIES_PER_DIR {
                            truncated = true;
                            break;
                        }
                        if p.to_str().is_some_and(|s| s.ends_with(SUFFIX)) {
                            out.push((p, Owner::Pod(uid.clone())));
                        }
                    }
                }
            }
        }
        (out, truncated)
    }

    /// Every directory there is to scan: the top one and each trusted pod directory.
    fn all_scopes(&self) -> Vec<Scope> {
        let mut out = vec![Scope::Top];
        if let Ok(rd) = std::fs::read_dir(self.dir.join("pods")) {
            for pod in rd.flatten() {
                // Directories only (no stat for anything else), then the owner check.
                if !pod.file_type().is_ok_and(|t| t.is_dir()) {
                    continue;
                }
                if let Some(uid) = pod.file_name().to_str() {
                    if is_pod_dir_name(uid) && trusted_pod_dir(&pod.path()) {
                        out.push(Scope::Pod(uid.to_string()));
                        if out.len() > MAX_POD_DIRS {
                            break;
                        }
                    }
                }
            }
        }
        out
    }

    fn scope_of(&self, path: &Path) -> Scope {
        match path.parent() {
            Some(p) if p == self.dir => Scope::Top,
            Some(p) => Scope::Pod(
                p.file_name()
                    .and_then(|n| n.to_str())
                    .unwrap_or_default()
                    .to_string(),
            ),
            None => Scope::Top,
        }
    }

    /// Brings the pages of `scope` up to date with its directory.
    fn rescan_scope(&mut self, scope: &Scope) -> bool {
        *self.rescans.entry(scope.clone()).or_default() += 1;
        let (found, truncated) = self.candidates(scope);
        let live: HashMap<&PathBuf, &Owner> = found.iter().map(|(p, o)| (p, o)).collect();
        // A listing cut short (a directory full of names) does not say a page is gone:
        // then only a page whose file is gone is dropped.
        let listed = |p: &PathBuf| {
            live.contains_key(p) || (truncated && std::fs::symlink_metadata(p).is_ok())
        };
        let before = self.pages.len();
        let dir = self.dir.clone();
        let of_scope = |p: &Path| match scope {
            Scope::Top => p.parent() == Some(dir.as_path()),
            Scope::Pod(uid) => p.parent() == Some(dir.join("pods").join(uid).as_path()),
        };
        // A page whose directory now belongs to another pod (a slot changed hands) is
        // dropped, and mapped again as the new holder's.
        self.pages.retain(|p, m| {
            !of_scope(p) || (listed(p) && live.get(p).is_none_or(|o| **o == m.info.owner))
        });
        self.rejected
            .retain(|p, _| !of_scope(p) || live.contains_key(p));
        let mut changed = self.pages.len() != before;
        let cap = match scope {
            Scope::Top => MAX_PAGES_TOP,
            Scope::Pod(_) => MAX_PAGES_PER_POD,
        };
        let mut mapped = self.pages.keys().filter(|p| of_scope(p)).count();
        // Top directory: pages mapped per file owner.
        let mut per_uid: HashMap<u32, usize> = HashMap::new();
        if *scope == Scope::Top {
            for m in self.pages.values().filter(|m| of_scope(&m.info.path)) {
                *per_uid.entry(m.info.file_uid).or_default() += 1;
            }
        }
        let now = std::time::Instant::now();
        for (path, owner) in found {
            if self.pages.contains_key(&path) {
                continue;
            }
            // A file rejected before that is still the same file (inode, mtime, size) and
            // had its second to become a page is not opened again.
            let md = std::fs::symlink_metadata(&path).ok();
            let id = md.as_ref().map(ident);
            if let Some((_, first, seen)) = self.rejected.get(&path) {
                if seen.is_some() && *seen == id && now.duration_since(*first) >= INCOMPLETE_RETRY {
                    continue;
                }
            }
            let file_uid = md.as_ref().map_or(u32::MAX, |m| m.uid());
            // A refusal for a cap is no verdict on the file: it is not remembered as the
            // file's (no ident), so the page is mapped once there is room.
            let (result, id) = if mapped >= cap {
                (
                    Err(format!("{cap} pages of this directory already mapped")),
                    None,
                )
            } else if per_uid.get(&file_uid).copied().unwrap_or(0) >= MAX_PAGES_PER_UID_TOP {
                let why =
                    format!("{MAX_PAGES_PER_UID_TOP} pages of this file owner already mapped");
                (Err(why), None)
            } else {
                self.opened += 1;
                (self.map(&path, owner), id)
            };
            match result {
                Ok(m) => {
                    let mut held = Vec::new();
                    let owner = format!("{:?}", m.info.owner);
                    if self
                        .lines
                        .allow("doorbell page found", &owner, now, &mut held)
                        == crate::logbudget::Verdict::Say
                    {
                        *self.said.entry(owner.clone()).or_default() += 1;
                        info!(page = %path.display(), owner = ?m.info.owner, uid = m.info.file_uid, "Doorbell page found");
                    }
                    self.note_held(&held);
                    crate::logbudget::say(&held);
                    self.rejected.remove(&path);
                    if *scope == Scope::Top {
                        *per_uid.entry(m.info.file_uid).or_default() += 1;
                    }
                    self.pages.insert(path, m);
                    mapped += 1;
                    changed = true;
                }
                Err(why) => {
                    let first = match self.rejected.get(&path) {
                        Some((w, first, _)) if *w == why => *first,
                        _ => {
                            debug!(page = %path.display(), %why, "Not a usable doorbell page");
                            now
                        }
                    };
                    self.rejected.insert(path.clone(), (why, first, id));
                    // Maybe still being written: look again for a while (its directory
                    // only, and no sooner than the gap: a tenant who keeps adding files that
                    // are not pages cannot make the agent poll).
                    if now.duration_since(first) < INCOMPLETE_RETRY {
                        self.pending
                            .entry(scope.clone())
                            .or_insert(now + DIR_RESCAN_GAP);
                    }
                }
            }
        }
        changed
    }

    fn map(&mut self, path: &Path, owner: Owner) -> Result<Mapped, String> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| format!("open: {e}"))?;
        let md = f.metadata().map_err(|e| format!("stat: {e}"))?;
        if !md.file_type().is_file() {
            return Err("not a regular file".into());
        }
        if md.len() < PAGE as u64 {
            return Err(format!("{} bytes, a page is {PAGE}", md.len()));
        }
        // SAFETY: mapping PAGE bytes of a regular file at least that long, read-only and
        // shared; the fd may be closed afterwards.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PAGE,
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(format!("mmap: {}", std::io::Error::last_os_error()));
        }
        // Guarded before the first load: a file truncated from now on cannot kill us.
        if !guard::register(base as usize, guard::Access::Read) {
            // SAFETY: the mapping just made, never read.
            unsafe { libc::munmap(base, PAGE) };
            return Err(format!(
                "no SIGBUS guard for it ({} pages already mapped, or the handler could not be installed)",
                guard::MAX_GUARDED
            ));
        }
        let mut m = Mapped {
            info: PageInfo {
                id: 0,
                path: path.to_path_buf(),
                owner,
                file_uid: md.uid(),
                wake_gap_ns: 0,
                class: 0,
                pid: 0,
            },
            base,
            seen: 0,
            wakes: (0, 0),
        };
        if !m.page().valid() {
            return Err("not a doorbell page of this version (yet)".into());
        }
        m.info.wake_gap_ns = m.page().wake_gap_ns();
        m.info.class = m.page().class();
        m.info.pid = m
            .page()
            .header()
            .pid
            .load(std::sync::atomic::Ordering::Relaxed);
        m.info.id = self.next_id;
        self.next_id += 1;
        Ok(m)
    }
}

use std::os::unix::fs::OpenOptionsExt;

/// Kubernetes pod UIDs are RFC 4122 strings; anything else under `pods/` is ignored.
pub(super) fn is_pod_uid(s: &str) -> bool {
    s.len() == 36 && s.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
}

/// A directory of `pods/` the agent reads: a pod's own (its UID) or a slot's.
pub(super) fn is_pod_dir_name(s: &str) -> bool {
    is_pod_uid(s) || qos_core::cdi::Slot::of_dir_name(s).is_some()
}

impl Doorbells for DirBells {
    fn rescan(&mut self, force: bool) -> bool {
        let held = self.lines.flush(std::time::Instant::now());
        self.note_held(&held);
        crate::logbudget::say(&held);
        // A page that stopped being valid (its file shrunk and the guard replaced it with
        // zeros, or it was rewritten): dropped now, its file looked at again below.
        let before = self.pages.len();
        let mut invalid = Vec::new();
        self.pages.retain(|p, m| {
            let ok = m.page().valid();
            if !ok {
                invalid.push(p.clone());
            }
            ok
        });
        for p in &invalid {
            metrics::counter!("coloc_doorbell_rejected_total", "reason" => "invalidated")
                .increment(1);
            // Rate-limited: a tenant truncating its pages in a loop must not flood the log
            // from the loop's thread.
            let sec = super::now_sec();
            if self.warned.0 != sec {
                if self.warned.1 > WARN_PER_SECOND {
                    warn!(suppressed = self.warned.1 - WARN_PER_SECOND, "Doorbell pages that turned invalid in the last second, not logged one by one");
                }
                self.warned = (sec, 0);
            }
            self.warned.1 += 1;
            if self.warned.1 <= WARN_PER_SECOND {
                warn!(page = %p.display(), faults_absorbed = guard::rescued(), "Doorbell page no longer valid (its file was truncated or rewritten): dropped");
            }
        }
        let dropped = self.pages.len() != before;
        let now = std::time::Instant::now();
        let mut scopes: std::collections::HashSet<Scope> = self.dirty.take().into_iter().collect();
        for p in &invalid {
            scopes.insert(self.scope_of(p));
        }
        if force {
            // Once a second: every directory.
            scopes.extend(self.all_scopes());
        }
        // A slot changed hands: its directory is read as the new holder's (or not at all).
        let slots_now = self.slots.as_ref().map(|(o, seen)| (o.generation(), *seen));
        if let Some((now_gen, seen)) = slots_now {
            if now_gen != seen {
                if let Some(s) = self.slots.as_mut() {
                    s.1 = now_gen;
                }
                scopes.extend(
                    self.all_scopes()
                        .into_iter()
                        .filter(|s| matches!(s, Scope::Pod(n) if !is_pod_uid(n))),
                );
            }
        }
        // Directories rescanned less than the gap ago wait their turn; others go ahead.
        let mut due: Vec<Scope> = Vec::new();
        for sc in scopes {
            if force {
                due.push(sc);
                continue;
            }
            let e = self.scanned.entry(sc.clone()).or_insert((now, now, 0));
            if now.duration_since(e.1) >= Duration::from_secs(1) {
                (e.1, e.2) = (now, 0);
            }
            e.2 += 1;
            if e.2 > DIR_RESCANS_PER_SECOND && now.duration_since(e.0) < DIR_RESCAN_GAP {
                let at = e.0 + DIR_RESCAN_GAP;
                self.dirty.mute(sc.clone());
                self.pending.entry(sc).or_insert(at);
            } else {
                due.push(sc);
            }
        }
        let ready: Vec<Scope> = self
            .pending
            .iter()
            .filter(|(_, at)| **at <= now)
            .map(|(s, _)| s.clone())
            .collect();
        for sc in ready {
            self.pending.remove(&sc);
            due.push(sc);
        }
        if due.is_empty() {
            return dropped;
        }
        let mut changed = dropped;
        due.sort_by(|a, b| format!("{a:?}").cmp(&format!("{b:?}")));
        due.dedup();
        for sc in &due {
            // Changes from now on wake the loop again; a retry the rescan asks for stays.
            self.dirty.unmute(sc);
            self.pending.remove(sc);
            changed |= self.rescan_scope(sc);
            self.scanned.entry(sc.clone()).or_insert((now, now, 0)).0 = now;
        }
        if force {
            // Directories that are gone: forget their bookkeeping.
            let all: std::collections::HashSet<Scope> = due.into_iter().collect();
            self.scanned.retain(|s, _| all.contains(s));
            self.rescans.retain(|s, _| all.contains(s));
            let before = self.pages.len();
            let dir = self.dir.clone();
            self.pages.retain(|p, _| {
                p.parent() == Some(dir.as_path())
                    || p.parent()
                        .and_then(|d| d.file_name())
                        .and_then(|n| n.to_str())
                        .is_some_and(|uid| all.contains(&Scope::Pod(uid.to_string())))
            });
            changed |= self.pages.len() != before;
        }
        metrics::gauge!("coloc_doorbell_pages").set(self.pages.len() as f64);
        changed
    }

    fn pages(&self) -> Vec<PageInfo> {
        self.pages.values().map(|m| m.info.clone()).collect()
    }

    fn read(&mut self, out: &mut Vec<BellReading>) {
        self.waker_seen = self.waker.0.load(Acquire);
        let mut tmp = Vec::with_capacity(coloc_doorbell::MAX_GPUS);
        let sec = super::now_sec();
        let now_ns = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        for m in self.pages.values_mut() {
            tmp.clear();
            // The word first: a run that starts after this load bumps it, and the wait
            // that follows returns at once.
            let word = m.page().header().wake.load(Acquire);
            if word != m.seen {
                if m.wakes.0 != sec {
                    m.wakes = (sec, 0);
                }
                m.wakes.1 += 1;
                let o = self.owner_wakes.entry(budget(&m.info)).or_insert((sec, 0));
                if o.0 != sec {
                    *o = (sec, 0);
                }
                o.1 += 1;
            }
            m.seen = word;
            m.page().read(&mut tmp);
            let page = m.page();
            out.extend(tmp.iter().map(|r| BellReading {
                page: m.info.id,
                reading: *r,
                drained_ns: page.drained_ns(r.index, now_ns),
            }));
        }
        if self.owner_wakes.len() > 2 * self.pages.len() + 16 {
            let pages = &self.pages;
            self.owner_wakes
                .retain(|o, _| pages.values().any(|m| &budget(&m.info) == o));
        }
    }

    fn wait(&mut self, timeout: Duration) -> bool {
        // A change the watcher saw since the latest rescan: rescan now.
        if self.dirty.any.load(Acquire) != 0 {
            return true;
        }
        // A directory waiting its turn to be rescanned: wake for it.
        let timeout = match self.pending.values().min() {
            Some(at) => timeout.min(at.saturating_duration_since(std::time::Instant::now())),
            None => timeout,
        };
        // The values seen by the latest read: a run started since then has changed its
        // word, and the wait returns at once (no lost wake-up).
        let mut words: Vec<(&AtomicU32, u32)> = Vec::with_capacity(MAX_WAITERS);
        words.push((&self.waker.0, self.waker_seen));
        let sec = super::now_sec();
        // A page that woke the loop too often this second, or whose owner's pages did, is
        // read at ticks only.
        let owners = &self.owner_wakes;
        let calm = |m: &&Mapped| calm(m, owners, sec);
        let polled = if self.pages.len() < MAX_WAITERS {
            for m in self.pages.values().filter(calm) {
                words.push((&m.page().header().wake, m.seen));
            }
            false
        } else {
            // More pages than futex_waitv takes: the attributed ones first. Only when
            // those alone are too many does the loop poll.
            let (first, rest): (Vec<&Mapped>, Vec<&Mapped>) = self
                .pages
                .values()
                .filter(calm)
                .partition(|m| self.preferred.contains(&m.info.id));
            let over = first.len() >= MAX_WAITERS;
            for m in first.into_iter().chain(rest).take(MAX_WAITERS - 1) {
                words.push((&m.page().header().wake, m.seen));
            }
            over
        };
        let timeout = if polled || self.no_waitv {
            // Attributed pages beyond futex_waitv's 128 (or an old kernel): read every ms.
            timeout.min(Duration::from_millis(1))
        } else {
            timeout
        };
        if !self.no_waitv {
            match waitv(&words, timeout) {
                Some(woken) => return woken,
                None => {
                    warn!("futex_waitv is not available (Linux < 5.16): doorbells are polled every millisecond");
                    self.no_waitv = true;
                }
            }
        }
        std::thread::sleep(timeout);
        false
    }

    fn waker(&self) -> Waker {
        self.waker.clone()
    }

    fn prefer(&mut self, pages: &[u64]) {
        self.preferred = pages.iter().copied().collect();
    }

    fn read_gate(&self, page: u64, out: &mut Vec<coloc_doorbell::GateReading>) {
        if let Some(m) = self.pages.values().find(|m| m.info.id == page) {
            m.page().read_gate(out);
        }
    }

    fn ensure_pod_dirs(&mut self, uids: &[String]) -> usize {
        super::pod_dirs::ensure(&self.dir.join("pods"), uids, &mut self.pod_dirs)
    }

    fn sweep_pods(&mut self, gone: &dyn Fn(&str) -> bool, idle: Duration) -> Vec<String> {
        use rustix::fs::{openat, unlinkat, AtFlags, Mode, OFlags, CWD};
        // Every step is relative to a directory descriptor opened without following links:
        // a tenant who can write to `pods/` and swaps its directory for a link while the
        // sweep runs redirects nothing (the descriptor is the directory that was checked;
        // names are removed inside it, and a link is removed, never followed).
        let dir_flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let pods = self.dir.join("pods");
        let Ok(pods_fd) = openat(CWD, &pods, dir_flags, Mode::empty()) else {
            return Vec::new();
        };
        let Ok(names) = rustix::fs::Dir::read_from(&pods_fd) else {
            return Vec::new();
        };
        let names: Vec<String> = names
            .flatten()
            .filter_map(|e| e.file_name().to_str().ok().map(str::to_string))
            .filter(|n| is_pod_uid(n))
            .collect();
        let mut removed = Vec::new();
        for uid in names {
            let path = pods.join(&uid);
            // A real directory (a link fails to open), named like a pod UID, untouched for
            // `idle`, of a pod that is gone.
            let Ok(fd) = openat(&pods_fd, uid.as_str(), dir_flags, Mode::empty()) else {
                continue;
            };
            let Ok(st) = rustix::fs::fstat(&fd) else {
                continue;
            };
            let modified = std::time::UNIX_EPOCH
                + Duration::new(st.st_mtime.max(0) as u64, st.st_mtime_nsec as u32);
            let quiet = modified.elapsed().is_ok_and(|age| age >= idle);
            if !quiet || !gone(&uid) {
                continue;
            }
            // Its pages are stale: unmap them first.
            self.pages.retain(|p, _| !p.starts_with(&path));
            self.rejected.retain(|p, _| !p.starts_with(&path));
            if let Ok(files) = rustix::fs::Dir::read_from(&fd) {
                for f in files.flatten() {
                    let name = f.file_name();
                    if name == c"." || name == c".." {
                        continue;
                    }
                    // A subdirectory is left (removing the pod's directory then fails, and
                    // says so); anything else, a link included, is unlinked by name.
                    if f.file_type() != rustix::fs::FileType::Directory {
                        let _ = unlinkat(&fd, name, AtFlags::empty());
                    }
                }
            }
            match unlinkat(&pods_fd, uid.as_str(), AtFlags::REMOVEDIR) {
                Ok(()) => {
                    self.pod_dirs.remove(&uid);
                    info!(pod_uid = %uid, dir = %path.display(), "Removed the doorbell directory of a pod that is gone");
                    removed.push(uid);
                }
                Err(err) => {
                    warn!(pod_uid = %uid, dir = %path.display(), %err, "Cannot remove the doorbell directory of a pod that is gone")
                }
            }
        }
        if !removed.is_empty() {
            metrics::gauge!("coloc_doorbell_pages").set(self.pages.len() as f64);
        }
        removed
    }

    fn rang(&self) -> bool {
        let sec = super::now_sec();
        self.waker.0.load(Acquire) != self.waker_seen
            || self.dirty.any.load(Acquire) != 0
            || self.pages.values().any(|m| {
                calm(m, &self.owner_wakes, sec) && m.page().header().wake.load(Acquire) != m.seen
            })
    }
}
