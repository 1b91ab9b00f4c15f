//! The shim as a Kubernetes device: a device plugin for `gpu-coloc.dev/shim-online` and
//! `gpu-coloc.dev/shim-offline`, so that a pod gets the shim's directories without a
//! `hostPath` volume in its spec (which Pod Security `baseline` and policy engines refuse).
//!
//! ```text
//!  kubelet ──Register──◄ agent (one endpoint per class, in --device-plugin-dir)
//!  kubelet ──ListAndWatch──► slots online-0..N, offline-0..N, all healthy
//!  kubelet ──Allocate(["offline-7"])──► fresh <doorbell dir>/pods/slot-offline-7, then
//!             cdi:    CDI device gpu-coloc.dev/shim=offline-7 (the spec the node setup wrote)
//!             mounts: the same mounts and environment, directly
//!  agent ──List──► kubelet's pod-resources API: which pod holds which slot ──► SlotOwners
//!                  (the doorbell reads a slot's pages as that pod's)
//! ```
//!
//! Trust: which pod a slot's directory belongs to comes from the kubelet alone. A pod can
//! ask for a slot of the other class: the slot's class decides only what is mounted; its
//! pages count only for processes the agent itself classifies online, and its gate only
//! holds work. A container that asks for more than one slot of a class is refused (its
//! mounts would collide); the webhook never asks for more.

pub mod grpc;
pub mod wire;

use crate::edges::doorbell::Waker;
use grpc::{Handler, Reply, Status};
use qos_core::cdi::{ShimPaths, Slot, SlotClass};
use std::collections::HashMap;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tracing::{debug, info, warn};

/// How a slot reaches the container.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Delivery {
    /// A CDI device (`gpu-coloc.dev/shim=<slot>`, the spec the node setup writes); needs a
    /// runtime with CDI (containerd ≥ 1.7 with `enable_cdi`, on by default from 2.0;
    /// CRI-O ≥ 1.23) and a kubelet that passes CDI devices (1.29 on by default).
    Cdi,
    /// The same mounts and environment in the allocation itself: any kubelet, any runtime.
    Mounts,
}

/// The device plugin's settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// The kubelet's device-plugin directory (its `kubelet.sock`, and the plugin's sockets).
    pub plugin_dir: PathBuf,
    /// The kubelet's pod-resources socket.
    pub pod_resources: PathBuf,
    /// Slots per class.
    pub slots: u32,
    /// How slots are delivered.
    pub delivery: Delivery,
    /// The shim's paths on the node.
    pub paths: ShimPaths,
}

/// The kubelet's registration socket in the plugin directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";

/// The plugin's socket name for a class.
pub fn endpoint(class: SlotClass) -> String {
    format!("gpu-coloc-shim-{}.sock", class.as_str())
}

/// Which pod holds each slot (doorbell directory name → pod UID), from the kubelet.
#[derive(Debug, Default)]
pub struct SlotOwners {
    map: RwLock<HashMap<String, String>>,
    generation: AtomicU64,
}

impl SlotOwners {
    /// The pod UID holding the slot whose directory is `dir_name`.
    pub fn owner(&self, dir_name: &str) -> Option<String> {
        self.map.read().ok()?.get(dir_name).cloned()
    }

    /// Bumped on every change.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Replaces the map; true (and the generation bumped) when it changed.
    pub fn set(&self, new: HashMap<String, String>) -> bool {
        let mut m = self.map.write().unwrap_or_else(|e| e.into_inner());
        if *m == new {
            return false;
        }
        for (dir, uid) in &new {
            if m.get(dir) != Some(uid) {
                info!(slot = %dir, pod_uid = %uid, "Doorbell slot now holds this pod's pages");
            }
        }
        *m = new;
        self.generation.fetch_add(1, Ordering::AcqRel);
        true
    }
}

/// Pod UIDs by `namespace/name` (the agent's pod watch).
pub trait PodIndex: Send + Sync {
    /// The UID of the pod `namespace/name` on this node.
    fn uid_of(&self, owner: &str) -> Option<String>;
}

impl PodIndex for crate::edges::source::kube::KubeSource {
    fn uid_of(&self, owner: &str) -> Option<String> {
        crate::edges::source::kube::KubeSource::uid_of(self, owner)
    }
}

/// Empties a slot's doorbell directory (what an earlier holder left), or makes it: root's,
/// mode 1777, like a pod's own directory. Never follows a link.
pub fn reset_slot_dir(doorbell_dir: &Path, slot: Slot) -> std::io::Result<PathBuf> {
    let d = doorbell_dir.join("pods").join(slot.dir_name());
    match std::fs::symlink_metadata(&d) {
        Ok(m) if m.is_dir() => {
            empty_tree(&d)?;
            std::fs::remove_dir(&d)?
        }
        Ok(_) => std::fs::remove_file(&d)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    std::fs::DirBuilder::new().mode(0o1777).create(&d)?;
    // The umask narrowed it.
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o1777))?;
    let m = std::fs::symlink_metadata(&d)?;
    // SAFETY: geteuid cannot fail.
    if !m.is_dir() || m.uid() != unsafe { libc::geteuid() } {
        return Err(std::io::Error::other(
            "slot directory replaced while it was made",
        ));
    }
    Ok(d)
}

/// Empties directory `top` (a tenant's: any depth, any number of entries) without
/// recursion and without following a link: every entry that is not a directory is
/// unlinked; an empty subdirectory is removed; a subdirectory with entries has them moved
/// up into `top` and is then removed. Each round lifts every chain by one level, so a
/// chain of any depth costs one round per level, with two directory descriptors open and
/// no path longer than one name (`std::fs::remove_dir_all` recurses per level: a chain of
/// 50,000 directories overflows a 2 MiB stack).
pub fn empty_tree(top: &Path) -> std::io::Result<()> {
    use rustix::fs::{
        openat, renameat_with, statat, unlinkat, AtFlags, Dir, FileType, Mode, OFlags, RenameFlags,
    };
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let topfd = openat(rustix::fs::CWD, top, flags, Mode::empty())?;
    let mut lifted = 0u64;
    let kind = |fd: &std::os::fd::OwnedFd, e: &rustix::fs::DirEntry| match e.file_type() {
        FileType::Unknown => statat(fd, e.file_name(), AtFlags::SYMLINK_NOFOLLOW)
            .map(|st| FileType::from_raw_mode(st.st_mode))
            .unwrap_or(FileType::Unknown),
        t => t,
    };
    loop {
        let mut subdirs = Vec::new();
        let mut dir = Dir::read_from(&topfd)?;
        while let Some(e) = dir.read() {
            let e = e?;
            let name = e.file_name();
            if name.to_bytes() == b"." || name.to_bytes() == b".." {
                continue;
            }
            if kind(&topfd, &e) == FileType::Directory {
                subdirs.push(name.to_owned());
            } else {
                unlinkat(&topfd, name, AtFlags::empty())?;
            }
        }
        if subdirs.is_empty() {
            return Ok(());
        }
        for sub in subdirs {
            match unlinkat(&topfd, &sub, AtFlags::REMOVEDIR) {
                Ok(()) => continue,
                Err(e) if e == rustix::io::Errno::NOTEMPTY || e == rustix::io::Errno::EXIST => {}
                Err(e) => return Err(e.into()),
            }
            let subfd = openat(&topfd, &sub, flags, Mode::empty())?;
            let mut inner = Dir::read_from(&subfd)?;
            while let Some(e) = inner.read() {
                let e = e?;
                let name = e.file_name();
                if name.to_bytes() == b"." || name.to_bytes() == b".." {
                    continue;
                }
                // A name of the tenant's own may be taken already: never replaced.
                loop {
                    lifted += 1;
                    match renameat_with(
                        &subfd,
                        name,
                        &topfd,
                        format!(".lifted-{lifted}"),
                        RenameFlags::NOREPLACE,
                    ) {
                        Ok(()) => break,
                        Err(rustix::io::Errno::EXIST) => continue,
                        Err(e) => return Err(e.into()),
                    }
                }
            }
            unlinkat(&topfd, &sub, AtFlags::REMOVEDIR)?;
        }
    }
}

/// What `Allocate` answers for one container asking for `ids` of `class`.
pub fn allocate(
    cfg: &Config,
    doorbell_dir: &Path,
    class: SlotClass,
    ids: &[String],
) -> Result<wire::ContainerAllocation, Status> {
    let [id] = ids else {
        return Err(Status::new(
            9,
            format!(
                "{} container asks for {} {}: exactly one per container",
                ids.len(),
                class.resource(),
                if ids.len() == 1 { "slot" } else { "slots" }
            ),
        ));
    };
    let slot = Slot::parse(id)
        .filter(|s| s.class == class && s.index < cfg.slots)
        .ok_or_else(|| Status::new(3, format!("{id:?} is not a slot of {}", class.resource())))?;
    let dir = reset_slot_dir(doorbell_dir, slot).map_err(|e| {
        Status::new(
            13,
            format!("cannot prepare the doorbell directory of slot {id}: {e}"),
        )
    })?;
    debug!(slot = %id, dir = %dir.display(), "Slot allocated: its doorbell directory is empty");
    Ok(match cfg.delivery {
        Delivery::Cdi => wire::ContainerAllocation {
            cdi_devices: vec![slot.cdi_name()],
            ..Default::default()
        },
        Delivery::Mounts => wire::ContainerAllocation {
            envs: cfg
                .paths
                .env(slot)
                .into_iter()
                .filter_map(|e| {
                    e.split_once('=')
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                })
                .collect(),
            mounts: cfg
                .paths
                .mounts(slot)
                .into_iter()
                .map(|m| {
                    let ro = m.read_only();
                    (m.container_path, m.host_path, ro)
                })
                .collect(),
            cdi_devices: Vec::new(),
        },
    })
}

fn handler(
    cfg: Arc<Config>,
    doorbell_dir: PathBuf,
    class: SlotClass,
    refresh: Arc<tokio::sync::Notify>,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Handler {
    Arc::new(move |path: &str, msg: &[u8]| {
        let method = path.strip_prefix("/v1beta1.DevicePlugin/").unwrap_or(path);
        match method {
            // No pre-start call, no preferred allocation: every option false.
            "GetDevicePluginOptions" | "PreStartContainer" => Ok(Reply::Unary(Vec::new())),
            "ListAndWatch" => {
                let ids: Vec<String> = (0..cfg.slots)
                    .map(|index| Slot { class, index }.id())
                    .collect();
                let mut stop = stop.clone();
                Ok(Reply::Hold(
                    wire::list_and_watch_response(&ids),
                    Box::pin(async move {
                        let _ = stop.wait_for(|s| *s).await;
                    }),
                ))
            }
            "Allocate" => {
                let req = wire::allocate_request(msg).map_err(|e| Status::new(3, e.to_string()))?;
                let mut out = Vec::with_capacity(req.len());
                for ids in &req {
                    match allocate(&cfg, &doorbell_dir, class, ids) {
                        Ok(a) => out.push(a),
                        Err(s) => {
                            warn!(resource = class.resource(), ids = ?ids, error = %s.message, "Slot allocation refused: the container does not start");
                            return Err(s);
                        }
                    }
                }
                info!(resource = class.resource(), slots = ?req, "Slots allocated");
                refresh.notify_one();
                Ok(Reply::Unary(wire::allocate_response(&out)))
            }
            _ => Err(Status::new(12, format!("{path} is not implemented"))),
        }
    })
}

/// Asks the kubelet which pod holds which slot; true besides when a holder is not in the
/// pod watch yet (asked again soon).
async fn owners_now(
    cfg: &Config,
    pods: &dyn PodIndex,
) -> Result<(HashMap<String, String>, bool), Status> {
    let resp = grpc::unary(&cfg.pod_resources, "/v1.PodResourcesLister/List", &[]).await?;
    let assigned =
        wire::list_pod_resources_response(&resp).map_err(|e| Status::new(13, e.to_string()))?;
    let mut out = HashMap::new();
    let mut unresolved = false;
    for a in assigned {
        let Some(class) = SlotClass::of_resource(&a.resource) else {
            continue;
        };
        let Some(uid) = pods.uid_of(&a.pod) else {
            debug!(pod = %a.pod, "A pod holding a slot is not in the pod watch yet");
            unresolved = true;
            continue;
        };
        for id in &a.ids {
            if let Some(slot) = Slot::parse(id).filter(|s| s.class == class) {
                out.insert(slot.dir_name(), uid.clone());
            }
        }
    }
    Ok((out, unresolved))
}

/// Starts the plugin on the current tokio runtime: registers both classes with the kubelet
/// (again whenever the kubelet restarts: it removes every plugin socket), and keeps
/// `owners` up to date, waking the loop through `waker` on a change.
pub fn start(
    cfg: Config,
    doorbell_dir: PathBuf,
    owners: Arc<SlotOwners>,
    pods: Arc<dyn PodIndex>,
    waker: Waker,
) {
    tokio::spawn(run(Arc::new(cfg), doorbell_dir, owners, pods, waker));
}

fn ident(p: &Path) -> Option<(u64, u64)> {
    std::fs::symlink_metadata(p)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

async fn run(
    cfg: Arc<Config>,
    doorbell_dir: PathBuf,
    owners: Arc<SlotOwners>,
    pods: Arc<dyn PodIndex>,
    waker: Waker,
) {
    let refresh = Arc::new(tokio::sync::Notify::new());
    let kubelet = cfg.plugin_dir.join(KUBELET_SOCKET);
    let mut failures = 0u32;
    loop {
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let mut servers = Vec::new();
        let mut ours = Vec::new();
        let mut ok = true;
        for class in SlotClass::ALL {
            let sock = cfg.plugin_dir.join(endpoint(class));
            let _ = std::fs::remove_file(&sock);
            match tokio::net::UnixListener::bind(&sock) {
                Ok(l) => {
                    servers.push(tokio::spawn(grpc::serve(
                        l,
                        handler(
                            cfg.clone(),
                            doorbell_dir.clone(),
                            class,
                            refresh.clone(),
                            stop_rx.clone(),
                        ),
                    )));
                    ours.push((sock.clone(), ident(&sock)));
                }
                Err(e) => {
                    if failures == 0 {
                        warn!(socket = %sock.display(), %e, "Cannot listen for the kubelet: the shim's slots are not offered (tried again every 5 s)");
                    }
                    ok = false;
                }
            }
        }
        let kubelet_at_start = ident(&kubelet);
        if ok {
            for class in SlotClass::ALL {
                let req = wire::register_request(&endpoint(class), class.resource());
                if let Err(e) = grpc::unary(&kubelet, "/v1beta1.Registration/Register", &req).await
                {
                    if failures == 0 {
                        warn!(socket = %kubelet.display(), resource = class.resource(), error = %e, "Cannot register with the kubelet: pods asking for the shim's slots wait (tried again every 5 s)");
                    }
                    ok = false;
                    break;
                }
            }
        }
        if ok {
            info!(dir = %cfg.plugin_dir.display(), slots = cfg.slots, delivery = ?cfg.delivery, "Registered the shim's slots with the kubelet (gpu-coloc.dev/shim-online, gpu-coloc.dev/shim-offline)");
            failures = 0;
            let mut next_tick = tokio::time::Instant::now() + Duration::from_secs(1);
            let mut tick = 0u32;
            let mut listed_ok = true;
            // An allocation answered just now may not be listed yet: asked again after this.
            let mut recheck: Option<tokio::time::Instant> = None;
            loop {
                let wake_at = recheck.map_or(next_tick, |r| r.min(next_tick));
                let allocated = tokio::select! {
                    _ = refresh.notified() => true,
                    _ = tokio::time::sleep_until(wake_at) => false,
                };
                let now = tokio::time::Instant::now();
                let mut ask = allocated;
                if allocated {
                    recheck = Some(now + Duration::from_millis(500));
                } else if recheck.is_some_and(|r| r <= now) {
                    recheck = None;
                    ask = true;
                }
                if now >= next_tick {
                    next_tick = now + Duration::from_secs(1);
                    tick += 1;
                    // The kubelet restarted (new socket) or removed ours: register again.
                    if ident(&kubelet) != kubelet_at_start
                        || ours.iter().any(|(p, id)| ident(p) != *id)
                    {
                        info!("The kubelet restarted: registering the shim's slots again");
                        break;
                    }
                    ask |= tick.is_multiple_of(10);
                }
                if !ask {
                    continue;
                }
                // The kubelet records an allocation once Allocate has answered.
                if allocated {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                match owners_now(&cfg, pods.as_ref()).await {
                    Ok((map, unresolved)) => {
                        if unresolved {
                            // The pod watch lags the kubelet: look again soon, not in 10 s.
                            recheck.get_or_insert(
                                tokio::time::Instant::now() + Duration::from_millis(500),
                            );
                        }
                        if !listed_ok {
                            info!("The kubelet's pod-resources API answers again");
                        }
                        listed_ok = true;
                        if owners.set(map) {
                            waker.wake();
                        }
                    }
                    Err(e) => {
                        if listed_ok {
                            warn!(socket = %cfg.pod_resources.display(), error = %e, "Cannot ask the kubelet which pod holds which slot: new slots' doorbells are not read until it answers");
                        }
                        listed_ok = false;
                    }
                }
            }
        } else {
            failures += 1;
        }
        let _ = stop_tx.send(true);
        tokio::time::sleep(Duration::from_millis(100)).await;
        for s in servers {
            s.abort();
        }
        if !ok {
            tokio::time::sleep(Duration::from_secs(5)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::TmpDir;

    fn cfg(delivery: Delivery) -> Config {
        Config {
            plugin_dir: "/nonexistent".into(),
            pod_resources: "/nonexistent".into(),
            slots: 4,
            delivery,
            paths: ShimPaths {
                library_dir: "/lib/coloc".into(),
                doorbell_dir: "/run/bells".into(),
                gate_dir: "/run/gate".into(),
            },
        }
    }

    #[test]
    fn a_container_gets_one_fresh_slot_of_its_class_or_nothing() {
        let dir = TmpDir::new("coloc-dp-alloc");
        std::fs::create_dir_all(dir.join("pods")).unwrap();
        let one = |id: &str| vec![id.to_string()];
        // CDI: the device's name alone.
        let a = allocate(
            &cfg(Delivery::Cdi),
            &dir,
            SlotClass::Offline,
            &one("offline-3"),
        )
        .unwrap();
        assert_eq!(
            a.cdi_devices,
            vec!["gpu-coloc.dev/shim=offline-3".to_string()]
        );
        assert!(a.mounts.is_empty() && a.envs.is_empty());
        // Mounts: the same mounts and environment the CDI spec has.
        let a = allocate(
            &cfg(Delivery::Mounts),
            &dir,
            SlotClass::Online,
            &one("online-0"),
        )
        .unwrap();
        assert!(a.cdi_devices.is_empty());
        assert!(
            a.mounts.contains(&(
                "/run/bells".into(),
                "/run/bells/pods/slot-online-0".into(),
                false
            )),
            "{a:?}"
        );
        assert!(
            a.mounts
                .contains(&("/lib/coloc".into(), "/lib/coloc".into(), true)),
            "{a:?}"
        );
        assert!(
            !a.mounts.iter().any(|m| m.1 == "/run/gate"),
            "online gets no gate: {a:?}"
        );
        assert!(a
            .envs
            .contains(&("COLOC_DOORBELL_DIR".into(), "/run/bells".into())));
        // Refused: two slots, none, the other class's, one past the end, a made-up id.
        for (class, ids) in [
            (
                SlotClass::Online,
                vec!["online-1".to_string(), "online-2".into()],
            ),
            (SlotClass::Online, vec![]),
            (SlotClass::Online, one("offline-1")),
            (SlotClass::Offline, one("offline-4")),
            (SlotClass::Offline, one("../../etc")),
        ] {
            let e = allocate(&cfg(Delivery::Cdi), &dir, class, &ids).unwrap_err();
            assert!(e.code == 9 || e.code == 3, "{ids:?}: {e}");
        }
        assert!(!dir.join("pods/slot-offline-4").exists());
    }

    /// What an earlier holder left in a slot's directory goes, links included, without
    /// following them; a link put where the directory was is replaced, its target kept.
    #[test]
    fn a_slot_directory_is_handed_over_empty() {
        let dir = TmpDir::new("coloc-dp-reset");
        let victim = TmpDir::new("coloc-dp-reset-victim");
        std::fs::create_dir_all(&*victim).unwrap();
        std::fs::write(victim.join("keep"), b"x").unwrap();
        let slot = Slot {
            class: SlotClass::Offline,
            index: 1,
        };
        let d = dir.join("pods").join(slot.dir_name());
        std::fs::create_dir_all(d.join("sub")).unwrap();
        std::fs::write(d.join("9-9.bell"), b"old").unwrap();
        std::os::unix::fs::symlink(&*victim, d.join("sub/link")).unwrap();
        let got = reset_slot_dir(&dir, slot).unwrap();
        assert_eq!(got, d);
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 0);
        assert_eq!(
            std::fs::metadata(&d).unwrap().permissions().mode() & 0o7777,
            0o1777
        );
        std::fs::remove_dir(&d).unwrap();
        std::os::unix::fs::symlink(&*victim, &d).unwrap();
        reset_slot_dir(&dir, slot).unwrap();
        assert!(std::fs::symlink_metadata(&d).unwrap().is_dir());
        assert!(victim.join("keep").exists(), "a link was followed");
    }

    /// A tenant holding a slot leaves a chain of 20,000 directories in it (and a name of
    /// the kind the reset lifts entries to): the next allocation empties it on a 2 MiB
    /// stack, as a runtime worker has (with `remove_dir_all` the agent aborted with a
    /// stack overflow, and again at every later allocation of that slot).
    #[test]
    fn a_deep_tree_left_in_a_slot_is_emptied_without_recursion() {
        use rustix::fs::{mkdirat, openat, Mode, OFlags};
        let dir = TmpDir::new("coloc-dp-deep");
        let slot = Slot {
            class: SlotClass::Offline,
            index: 0,
        };
        let d = dir.join("pods").join(slot.dir_name());
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join(".lifted-1"), b"mine").unwrap();
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
        let mut fd = openat(rustix::fs::CWD, &d, flags, Mode::empty()).unwrap();
        for _ in 0..20_000 {
            mkdirat(&fd, "a", Mode::from_raw_mode(0o755)).unwrap();
            fd = openat(&fd, "a", flags, Mode::empty()).unwrap();
        }
        rustix::fs::openat(
            &fd,
            "f",
            OFlags::CREATE | OFlags::WRONLY,
            Mode::from_raw_mode(0o644),
        )
        .unwrap();
        drop(fd);
        let root: PathBuf = dir.to_path_buf();
        let r = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || reset_slot_dir(&root, slot))
            .unwrap()
            .join()
            .expect("the reset thread panicked");
        assert_eq!(r.unwrap(), d);
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 0, "not emptied");
    }

    #[test]
    fn owners_change_only_when_the_kubelet_says_something_new() {
        let o = SlotOwners::default();
        let g = o.generation();
        let m = HashMap::from([("slot-online-1".to_string(), "u".to_string())]);
        assert!(o.set(m.clone()));
        assert!(!o.set(m));
        assert_eq!(o.generation(), g + 1);
        assert_eq!(o.owner("slot-online-1").as_deref(), Some("u"));
        assert_eq!(o.owner("slot-online-2"), None);
    }
}
