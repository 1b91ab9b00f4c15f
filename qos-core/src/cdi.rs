//! The CUDA shim as a node device: what a container gets when the webhook delivers the shim
//! without `hostPath` volumes.
//!
//! ```text
//!  webhook: container asks for 1 × gpu-coloc.dev/shim-offline (or -online)
//!     ▼ kubelet picks a free device id, e.g. "offline-7", and calls the agent's
//!  device plugin: Allocate(["offline-7"]) ──► CDI device gpu-coloc.dev/shim=offline-7
//!     ▼ (or the same mounts and environment directly, without CDI)
//!  container runtime (CDI spec written by the node setup) mounts:
//!     <library dir>                      ro  at the same path
//!     <doorbell dir>/pods/slot-offline-7 rw  at <doorbell dir>
//!     <gate dir>                         ro  at the same path (offline slots only)
//! ```
//!
//! A slot's doorbell directory is mounted into one container at a time (the kubelet never
//! hands one device to two running containers); the agent learns which pod holds it from
//! the kubelet's pod-resources API, never from anything the pod writes. Pure: names, paths
//! and the spec's shape; the agent and the node setup do the I/O.

use serde::Serialize;

/// The CDI kind (`vendor/class`) of the shim's devices.
pub const CDI_KIND: &str = "gpu-coloc.dev/shim";
/// The extended resource online containers ask for (one each).
pub const RESOURCE_ONLINE: &str = "gpu-coloc.dev/shim-online";
/// The extended resource offline containers ask for (one each).
pub const RESOURCE_OFFLINE: &str = "gpu-coloc.dev/shim-offline";
/// The CDI spec version written (understood by every runtime with CDI: containerd ≥ 1.7,
/// CRI-O ≥ 1.23, Podman ≥ 4.1).
pub const CDI_VERSION: &str = "0.5.0";
/// Slots per class when nothing else is asked for: more than the containers a node runs
/// (110 pods by default).
pub const DEFAULT_SLOTS: u32 = 128;
/// Most slots per class (the spec stays under a megabyte).
pub const MAX_SLOTS: u32 = 1024;
/// Prefix of a slot's doorbell directory in `<doorbell dir>/pods/`.
pub const SLOT_DIR_PREFIX: &str = "slot-";

/// Which shim a slot delivers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SlotClass {
    /// The doorbell only.
    Online,
    /// The doorbell and the read-only gate.
    Offline,
}

impl SlotClass {
    /// Both classes.
    pub const ALL: [SlotClass; 2] = [SlotClass::Online, SlotClass::Offline];

    /// `online` or `offline`.
    pub fn as_str(self) -> &'static str {
        match self {
            SlotClass::Online => "online",
            SlotClass::Offline => "offline",
        }
    }

    /// The extended resource of this class.
    pub fn resource(self) -> &'static str {
        match self {
            SlotClass::Online => RESOURCE_ONLINE,
            SlotClass::Offline => RESOURCE_OFFLINE,
        }
    }

    /// The class of an extended resource name.
    pub fn of_resource(name: &str) -> Option<SlotClass> {
        SlotClass::ALL.into_iter().find(|c| c.resource() == name)
    }
}

/// One slot: a device id of the plugin and a CDI device name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Slot {
    /// Its class.
    pub class: SlotClass,
    /// Its number, `0..slots`.
    pub index: u32,
}

impl Slot {
    /// The device id (`offline-7`), also the CDI device's name.
    pub fn id(self) -> String {
        format!("{}-{}", self.class.as_str(), self.index)
    }

    /// Reads a device id; anything else is `None`.
    pub fn parse(id: &str) -> Option<Slot> {
        let (class, n) = id.split_once('-')?;
        let class = SlotClass::ALL.into_iter().find(|c| c.as_str() == class)?;
        // Digits only, no sign, no leading zero: one spelling per slot.
        if n.is_empty()
            || !n.bytes().all(|b| b.is_ascii_digit())
            || (n.len() > 1 && n.starts_with('0'))
        {
            return None;
        }
        let index = n.parse().ok()?;
        Some(Slot { class, index })
    }

    /// The fully qualified CDI device name (`gpu-coloc.dev/shim=offline-7`).
    pub fn cdi_name(self) -> String {
        format!("{CDI_KIND}={}", self.id())
    }

    /// Its doorbell directory's name in `<doorbell dir>/pods/` (`slot-offline-7`).
    pub fn dir_name(self) -> String {
        format!("{SLOT_DIR_PREFIX}{}", self.id())
    }

    /// The slot a directory name in `<doorbell dir>/pods/` stands for.
    pub fn of_dir_name(name: &str) -> Option<Slot> {
        Slot::parse(name.strip_prefix(SLOT_DIR_PREFIX)?)
    }
}

/// Where the shim's files are on the node (each mounted at the same path in containers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShimPaths {
    /// The directory holding `libcoloc_cuda.so`.
    pub library_dir: String,
    /// The agent's doorbell directory.
    pub doorbell_dir: String,
    /// The node's gate directory.
    pub gate_dir: String,
}

impl ShimPaths {
    /// The slot's doorbell directory on the node.
    pub fn slot_dir(&self, slot: Slot) -> String {
        format!("{}/pods/{}", self.doorbell_dir, slot.dir_name())
    }

    /// What a container holding `slot` gets mounted, in order.
    pub fn mounts(&self, slot: Slot) -> Vec<Mount> {
        let mut out = vec![
            Mount::new(&self.library_dir, &self.library_dir, true),
            Mount::new(&self.slot_dir(slot), &self.doorbell_dir, false),
        ];
        if slot.class == SlotClass::Offline {
            out.push(Mount::new(&self.gate_dir, &self.gate_dir, true));
        }
        out
    }

    /// The environment a container holding `slot` gets (`NAME=value`): where the shim finds
    /// its doorbell directory and, offline, the gate file. `LD_PRELOAD` stays the webhook's
    /// (appended to the container's own).
    pub fn env(&self, slot: Slot) -> Vec<String> {
        let mut out = vec![
            format!("COLOC_DOORBELL_DIR={}", self.doorbell_dir),
            format!("COLOC_SHIM_CLASS={}", slot.class.as_str()),
        ];
        if slot.class == SlotClass::Offline {
            out.push(format!("COLOC_GATE_FILE={}/gates", self.gate_dir));
        }
        out
    }

    /// The CDI spec with `slots` devices of each class.
    pub fn cdi_spec(&self, slots: u32) -> CdiSpec {
        let devices = SlotClass::ALL
            .into_iter()
            .flat_map(|class| (0..slots).map(move |index| Slot { class, index }))
            .map(|slot| CdiDevice {
                name: slot.id(),
                container_edits: Edits {
                    env: self.env(slot),
                    mounts: self.mounts(slot),
                },
            })
            .collect();
        CdiSpec {
            cdi_version: CDI_VERSION,
            kind: CDI_KIND,
            devices,
        }
    }
}

/// A bind mount.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Mount {
    /// On the node.
    pub host_path: String,
    /// In the container.
    pub container_path: String,
    /// CDI mount options (`rbind`, `ro`/`rw`, `nosuid`, `nodev`).
    pub options: Vec<&'static str>,
}

impl Mount {
    fn new(host: &str, container: &str, read_only: bool) -> Mount {
        Mount {
            host_path: host.into(),
            container_path: container.into(),
            options: vec![
                "rbind",
                if read_only { "ro" } else { "rw" },
                "nosuid",
                "nodev",
            ],
        }
    }

    /// Whether it is read-only.
    pub fn read_only(&self) -> bool {
        self.options.contains(&"ro")
    }
}

/// A CDI spec file (the fields this spec uses).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CdiSpec {
    /// [`CDI_VERSION`].
    pub cdi_version: &'static str,
    /// [`CDI_KIND`].
    pub kind: &'static str,
    /// One per slot.
    pub devices: Vec<CdiDevice>,
}

/// A CDI device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CdiDevice {
    /// The slot's id.
    pub name: String,
    /// What it changes in the container.
    pub container_edits: Edits,
}

/// A CDI device's container edits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Edits {
    /// `NAME=value`.
    pub env: Vec<String>,
    /// Bind mounts.
    pub mounts: Vec<Mount>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paths() -> ShimPaths {
        ShimPaths {
            library_dir: "/var/lib/gpu-coloc/lib".into(),
            doorbell_dir: "/run/gpu-coloc/doorbells".into(),
            gate_dir: "/run/gpu-coloc/gate".into(),
        }
    }

    #[test]
    fn a_slot_has_one_spelling() {
        let s = Slot {
            class: SlotClass::Offline,
            index: 7,
        };
        assert_eq!(s.id(), "offline-7");
        assert_eq!(s.cdi_name(), "gpu-coloc.dev/shim=offline-7");
        assert_eq!(s.dir_name(), "slot-offline-7");
        assert_eq!(Slot::parse("offline-7"), Some(s));
        assert_eq!(Slot::of_dir_name("slot-offline-7"), Some(s));
        for bad in [
            "offline-07",
            "offline-",
            "offline--1",
            "offline-+1",
            "other-1",
            "online",
            "slot-online-1",
            "online-1 ",
            "online-99999999999",
        ] {
            assert_eq!(Slot::parse(bad), None, "{bad:?}");
        }
        assert_eq!(Slot::of_dir_name("online-1"), None);
        assert_eq!(
            SlotClass::of_resource("gpu-coloc.dev/shim-online"),
            Some(SlotClass::Online)
        );
        assert_eq!(SlotClass::of_resource("gpu-coloc.dev/shim"), None);
    }

    #[test]
    fn only_offline_slots_get_the_gate_and_only_their_own_doorbell_directory_is_writable() {
        let p = paths();
        let on = p.mounts(Slot {
            class: SlotClass::Online,
            index: 3,
        });
        let off = p.mounts(Slot {
            class: SlotClass::Offline,
            index: 3,
        });
        assert_eq!(on.len(), 2);
        assert_eq!(off.len(), 3);
        for m in on.iter().chain(&off) {
            let own = m.host_path.ends_with("/pods/slot-online-3")
                || m.host_path.ends_with("/pods/slot-offline-3");
            assert_eq!(!m.read_only(), own, "{m:?}");
        }
        assert_eq!(
            off[1].host_path,
            "/run/gpu-coloc/doorbells/pods/slot-offline-3"
        );
        assert_eq!(off[1].container_path, "/run/gpu-coloc/doorbells");
        assert!(p
            .env(Slot {
                class: SlotClass::Offline,
                index: 0
            })
            .contains(&"COLOC_GATE_FILE=/run/gpu-coloc/gate/gates".to_string()));
        assert!(!p
            .env(Slot {
                class: SlotClass::Online,
                index: 0
            })
            .iter()
            .any(|e| e.starts_with("COLOC_GATE_FILE")));
        let spec = p.cdi_spec(4);
        assert_eq!(spec.devices.len(), 8);
        let names: std::collections::HashSet<_> =
            spec.devices.iter().map(|d| d.name.clone()).collect();
        assert_eq!(names.len(), 8, "device names are unique");
    }
}
