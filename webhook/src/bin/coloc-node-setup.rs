//! `coloc-node-setup`: prepares a node for pods that the webhook gives the CUDA shim. The
//! chart runs it as the agent pod's init container (as root, from the agent image); it is
//! part of this package because the webhook's injection is what needs it.
//!
//! - `--install SRC --sha256 FILE --into DIR`: checks SRC against the SHA-256 digest in
//!   FILE (written when the image was built: `sha256sum` format, or the hex digest alone)
//!   and refuses, exit 1, on a mismatch; then copies it to `DIR/<name of SRC>`, mode 0444,
//!   atomically (a temporary file in DIR, fsync, rename): processes that loaded the old
//!   file keep its inode, new ones get the new file, nobody sees half a file. The
//!   installed file is read back and checked against the digest too. DIR is made (or
//!   kept) a real directory of the installing user (root in the chart), mode 0755: a
//!   group- or world-writable one is narrowed, one of another owner refused, and so is a
//!   group- or world-writable parent without the sticky bit (someone could swap DIR). An
//!   identical file of the right owner and mode is left as it is; any other is replaced.
//! - `--doorbell-dir DIR`: makes `DIR` and `DIR/pods` root's, mode 0755 (a group- or
//!   world-writable one is narrowed: no tenant may add, swap or remove a pod's directory),
//!   and widens every pod's `pods/<pod UID>` to 1777, so that a process of any user in the
//!   pod can create its doorbell page there and none can remove another's. The agent makes
//!   each new pod's directory (1777) when it sees the pod; the kubelet, when it is first,
//!   makes it with the mode of `pods` (`SafeMakeDir` with the volume root's mode), and the
//!   agent widens it.
//! - `--gate-dir DIR`: makes `DIR` (root, 0755; the agent writes the gate file in it,
//!   offline pods mount it read-only), and narrows a group- or world-writable one.
//! - `--cdi-spec FILE --slots N` (with `--into`, `--doorbell-dir`, `--gate-dir`): writes
//!   the CDI spec of the shim's slots (`gpu-coloc.dev/shim=online-<i>`, `offline-<i>`,
//!   `i < N`; what the agent's device plugin names when the kubelet allocates a slot):
//!   each mounts the shim's directory read-only, its own `<doorbell dir>/pods/slot-…`
//!   read-write at the doorbell directory and, offline, the gate directory read-only;
//!   written atomically, mode 0644; and makes each slot's directory (root's, 1777).
//!
//! Everything it does is printed, one line each; it is idempotent.
#![forbid(unsafe_code)]

use anyhow::{bail, Context, Result};
use clap::Parser;
use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Prepares a node for pods with the gpu-coloc CUDA shim: installs the shim atomically and
/// gives the doorbell and gate directories the modes the shim and the agent need.
#[derive(Parser, Debug)]
#[command(
    version,
    after_help = "\
Example (what the chart's init container runs):
  coloc-node-setup --install /opt/coloc/lib/libcoloc_cuda.so \\
    --sha256 /opt/coloc/lib/libcoloc_cuda.so.sha256 --into /var/lib/gpu-coloc/lib \\
    --doorbell-dir /run/gpu-coloc/doorbells --gate-dir /run/gpu-coloc/gate"
)]
struct Args {
    /// The file to install (the shim in the agent image).
    #[arg(long, requires_all = ["into", "sha256"])]
    install: Option<PathBuf>,
    /// Its SHA-256 digest, written when the image was built (`sha256sum` output, or the
    /// 64 hex digits alone). The file is not installed unless it matches.
    #[arg(long, requires = "install")]
    sha256: Option<PathBuf>,
    /// The host directory to install it into (created, mode 0755).
    #[arg(long, requires = "install")]
    into: Option<PathBuf>,
    /// The agent's doorbell directory: it and its `pods/` become root's 0755, each pod's
    /// directory in `pods/` 1777.
    #[arg(long)]
    doorbell_dir: Option<PathBuf>,
    /// The node's gate directory: created root 0755 (never group- or world-writable).
    #[arg(long)]
    gate_dir: Option<PathBuf>,
    /// Write the CDI spec of the shim's slots here (e.g. /var/run/cdi/gpu-coloc.json; the
    /// runtime reads /etc/cdi and /var/run/cdi), for `coloc-agent run --device-plugin cdi`.
    /// Needs --into (the shim's directory), --doorbell-dir and --gate-dir.
    #[arg(long, requires_all = ["into", "doorbell_dir", "gate_dir"])]
    cdi_spec: Option<PathBuf>,
    /// Slots per class in the CDI spec (the agent's --shim-slots).
    #[arg(long, default_value_t = qos_core::cdi::DEFAULT_SLOTS,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(qos_core::cdi::MAX_SLOTS)))]
    slots: u32,
}

fn main() {
    let a = Args::parse();
    let mut out = std::io::stdout().lock();
    if let Err(e) = run(&a, &mut out) {
        eprintln!("coloc-node-setup: {e:#}");
        std::process::exit(1);
    }
}

fn run(a: &Args, out: &mut dyn Write) -> Result<()> {
    if a.install.is_none()
        && a.doorbell_dir.is_none()
        && a.gate_dir.is_none()
        && a.cdi_spec.is_none()
    {
        bail!(
            "nothing to do: pass --install/--into, --doorbell-dir and/or --gate-dir (see --help)"
        );
    }
    // The CDI spec's paths are checked before anything is made.
    let cdi_paths = match (&a.cdi_spec, &a.into, &a.doorbell_dir, &a.gate_dir) {
        (Some(_), Some(lib), Some(bells), Some(gate)) => Some(qos_core::cdi::ShimPaths {
            library_dir: abs_text(lib, "--into")?,
            doorbell_dir: abs_text(bells, "--doorbell-dir")?,
            gate_dir: abs_text(gate, "--gate-dir")?,
        }),
        _ => None,
    };
    if let (Some(src), Some(dir), Some(sum)) = (&a.install, &a.into, &a.sha256) {
        install(src, sum, dir, out)?;
    }
    if let Some(dir) = &a.doorbell_dir {
        doorbells(dir, out)?;
    }
    if let Some(dir) = &a.gate_dir {
        gate(dir, out)?;
    }
    if let (Some(spec), Some(paths), Some(bells)) = (&a.cdi_spec, &cdi_paths, &a.doorbell_dir) {
        cdi(spec, paths, bells, a.slots, out)?;
    }
    Ok(())
}

fn abs_text(p: &Path, what: &str) -> Result<String> {
    let t = p
        .to_str()
        .with_context(|| format!("{what} {}: not UTF-8", p.display()))?;
    if !p.is_absolute() || t.contains(',') || t.contains(':') {
        bail!("{what} {t}: an absolute path without ',' or ':' (CDI mount paths)");
    }
    Ok(t.trim_end_matches('/').to_string())
}

/// Writes the CDI spec of the slots and makes their doorbell directories.
fn cdi(
    spec: &Path,
    paths: &qos_core::cdi::ShimPaths,
    bells: &Path,
    slots: u32,
    out: &mut dyn Write,
) -> Result<()> {
    let ext_ok = matches!(
        spec.extension().and_then(|e| e.to_str()),
        Some("json" | "yaml")
    );
    if !ext_ok {
        bail!(
            "--cdi-spec {}: a .json or .yaml file (the runtime reads no other)",
            spec.display()
        );
    }
    let parent = spec
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if ensure_dir(parent, 0o755)? {
        writeln!(out, "created {} (0755)", parent.display())?;
    }
    let body = serde_json::to_vec_pretty(&paths.cdi_spec(slots))?;
    if fs::read(spec).is_ok_and(|old| old == body) {
        writeln!(
            out,
            "kept {} ({} slots per class, unchanged)",
            spec.display(),
            slots
        )?;
    } else {
        let tmp = parent.join(format!(
            ".{}.{}.tmp",
            spec.file_name().and_then(|n| n.to_str()).unwrap_or("spec"),
            std::process::id()
        ));
        let _ = fs::remove_file(&tmp);
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&tmp)
            .with_context(|| format!("creating {}", tmp.display()))?;
        f.write_all(&body)?;
        f.sync_all()?;
        drop(f);
        fs::set_permissions(&tmp, fs::Permissions::from_mode(0o644))?;
        fs::rename(&tmp, spec)
            .with_context(|| format!("renaming {} to {}", tmp.display(), spec.display()))?;
        writeln!(
            out,
            "wrote {} (CDI kind {}, {} slots per class)",
            spec.display(),
            qos_core::cdi::CDI_KIND,
            slots
        )?;
    }
    let pods = bells.join("pods");
    let me = own_uid(&pods)?;
    let mut made = 0;
    for class in qos_core::cdi::SlotClass::ALL {
        for index in 0..slots {
            let d = pods.join(qos_core::cdi::Slot { class, index }.dir_name());
            match fs::symlink_metadata(&d) {
                Ok(m) if m.is_dir() && m.uid() == me => {
                    if m.permissions().mode() & 0o7777 != 0o1777 {
                        fs::set_permissions(&d, fs::Permissions::from_mode(0o1777))?;
                        made += 1;
                    }
                }
                Ok(_) => {
                    // Not ours or not a directory: the agent replaces it at allocation;
                    // here it goes, never followed.
                    if fs::symlink_metadata(&d)?.is_dir() {
                        fs::remove_dir_all(&d)?;
                    } else {
                        fs::remove_file(&d)?;
                    }
                    ensure_dir(&d, 0o1777)?;
                    made += 1;
                }
                Err(_) => {
                    ensure_dir(&d, 0o1777)?;
                    made += 1;
                }
            }
        }
    }
    writeln!(
        out,
        "slot directories in {}: {made} made or fixed (1777)",
        pods.display()
    )?;
    Ok(())
}

/// A real directory (not a symlink), created with `mode` if missing; returns whether it
/// was created.
fn ensure_dir(dir: &Path, mode: u32) -> Result<bool> {
    match fs::symlink_metadata(dir) {
        Ok(m) if m.is_dir() => Ok(false),
        Ok(_) => bail!("{} exists and is not a directory", dir.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(mode)
                .create(dir)
                .with_context(|| format!("creating {}", dir.display()))?;
            // The umask may have cut the mode.
            fs::set_permissions(dir, fs::Permissions::from_mode(mode))
                .with_context(|| format!("setting the mode of {}", dir.display()))?;
            Ok(true)
        }
        Err(e) => Err(e).with_context(|| format!("reading {}", dir.display())),
    }
}

/// The SHA-256 of `bytes`, lower-case hex.
fn sha256_hex(bytes: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, bytes)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The digest in `file`: the first word (`sha256sum` output, or the digest alone).
fn expected_digest(file: &Path) -> Result<String> {
    let text = fs::read_to_string(file)
        .with_context(|| format!("reading the shim's digest {}", file.display()))?;
    let word = text.split_whitespace().next().unwrap_or_default();
    if word.len() != 64 || !word.bytes().all(|b| b.is_ascii_hexdigit()) {
        bail!(
            "{}: not a SHA-256 digest (64 hex digits): {word:?}",
            file.display()
        );
    }
    Ok(word.to_ascii_lowercase())
}

/// The user this process creates files as (the owner of a file it just made).
fn own_uid(dir: &Path) -> Result<u32> {
    let probe = dir.join(format!(".coloc-node-setup.{}.uid", std::process::id()));
    let _ = fs::remove_file(&probe);
    let f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&probe)
        .with_context(|| format!("creating {}", probe.display()))?;
    let uid = f.metadata()?.uid();
    drop(f);
    fs::remove_file(&probe).with_context(|| format!("removing {}", probe.display()))?;
    Ok(uid)
}

/// `dir` (existing) is a real directory owned by `uid`, not writable by group or others
/// (narrowed if it was), and no parent is writable by others without the sticky bit.
fn secure_dir(dir: &Path, uid: u32, out: &mut dyn Write) -> Result<()> {
    let m = fs::symlink_metadata(dir).with_context(|| format!("reading {}", dir.display()))?;
    if !m.is_dir() {
        bail!(
            "{} is not a directory (a symlink?): refusing to install the shim there",
            dir.display()
        );
    }
    if m.uid() != uid {
        bail!(
            "{} is owned by uid {}, not {uid}: refusing to install the shim there (whoever owns it could replace the library every GPU pod loads)",
            dir.display(),
            m.uid()
        );
    }
    let mode = m.permissions().mode() & 0o7777;
    if mode & 0o022 != 0 {
        fs::set_permissions(dir, fs::Permissions::from_mode(0o755))
            .with_context(|| format!("setting mode 0755 on {}", dir.display()))?;
        writeln!(
            out,
            "mode {} {mode:04o} -> 0755 (only root writes the shim's directory)",
            dir.display()
        )?;
    }
    let abs = fs::canonicalize(dir).with_context(|| format!("resolving {}", dir.display()))?;
    for parent in abs.ancestors().skip(1) {
        let pm = fs::metadata(parent).with_context(|| format!("reading {}", parent.display()))?;
        let pmode = pm.permissions().mode();
        if pmode & 0o022 != 0 && pmode & 0o1000 == 0 {
            bail!(
                "{} (a parent of {}) is writable by group or others without the sticky bit (mode {:04o}): refusing to install the shim below it",
                parent.display(),
                dir.display(),
                pmode & 0o7777
            );
        }
    }
    Ok(())
}

fn install(src: &Path, sum: &Path, dir: &Path, out: &mut dyn Write) -> Result<()> {
    let name = src
        .file_name()
        .with_context(|| format!("--install {}: not a file name", src.display()))?;
    let bytes = fs::read(src).with_context(|| format!("reading {}", src.display()))?;
    let want = expected_digest(sum)?;
    let got = sha256_hex(&bytes);
    if got != want {
        bail!(
            "DIGEST MISMATCH: {} has SHA-256 {got}, the image's digest {} says {want}: not installed (the image is corrupt or was tampered with)",
            src.display(),
            sum.display()
        );
    }
    if ensure_dir(dir, 0o755)? {
        writeln!(out, "created {} (0755)", dir.display())?;
    }
    let uid = own_uid(dir)?;
    secure_dir(dir, uid, out)?;
    let dest = dir.join(name);
    let current = fs::symlink_metadata(&dest).ok();
    if current
        .as_ref()
        .is_some_and(|m| m.is_file() && m.uid() == uid && m.permissions().mode() & 0o7777 == 0o444)
        && fs::read(&dest).ok().as_ref() == Some(&bytes)
    {
        writeln!(
            out,
            "unchanged {} ({} bytes, sha256 {got})",
            dest.display(),
            bytes.len()
        )?;
        return Ok(());
    }
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        name.to_string_lossy(),
        std::process::id()
    ));
    // Never through a planted symlink; a stale file of ours is replaced.
    if fs::symlink_metadata(&tmp).is_ok() {
        fs::remove_file(&tmp).with_context(|| format!("removing {}", tmp.display()))?;
    }
    let written = (|| -> std::io::Result<()> {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o444)
            .open(&tmp)?;
        f.write_all(&bytes)?;
        f.set_permissions(fs::Permissions::from_mode(0o444))?;
        f.sync_all()?;
        fs::rename(&tmp, &dest)?;
        fs::File::open(dir)?.sync_all()
    })();
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(e)
            .with_context(|| format!("installing {} as {}", src.display(), dest.display()));
    }
    // What the pods will load, read back.
    let back = fs::read(&dest).with_context(|| format!("reading back {}", dest.display()))?;
    if sha256_hex(&back) != want {
        bail!(
            "DIGEST MISMATCH: {} as installed has SHA-256 {}, expected {want}",
            dest.display(),
            sha256_hex(&back)
        );
    }
    writeln!(
        out,
        "installed {} ({} bytes, sha256 {got}, mode 0444, owner uid {uid}, replaced atomically)",
        dest.display(),
        bytes.len()
    )?;
    Ok(())
}

fn doorbells(dir: &Path, out: &mut dyn Write) -> Result<()> {
    for d in [dir.to_path_buf(), dir.join("pods")] {
        if ensure_dir(&d, 0o755)? {
            writeln!(out, "created {} (0755)", d.display())?;
            continue;
        }
        narrow(&d, out)?;
    }
    // Per-pod directories the kubelet made while pods/ had a narrower mode.
    for e in
        fs::read_dir(dir.join("pods")).with_context(|| format!("reading {}/pods", dir.display()))?
    {
        let p = e?.path();
        if fs::symlink_metadata(&p).is_ok_and(|m| m.is_dir()) {
            widen(&p, out)?;
        }
    }
    Ok(())
}

/// This process's effective UID (the owner of `/proc/self`).
fn euid() -> Result<u32> {
    Ok(fs::metadata("/proc/self")
        .context("reading /proc/self")?
        .uid())
}

/// No longer writable by anyone but its owner (an earlier version made it 1777: a
/// tenant could then swap pods' directories for links).
fn narrow(d: &Path, out: &mut dyn Write) -> Result<()> {
    let m = fs::symlink_metadata(d).with_context(|| format!("reading {}", d.display()))?;
    let me = euid()?;
    if m.uid() != me {
        bail!(
            "{} is owned by uid {}, not {me}: its owner could swap pods' directories; remove it or chown it",
            d.display(),
            m.uid()
        );
    }
    let mode = m.permissions().mode() & 0o7777;
    if mode & 0o022 == 0 {
        return Ok(());
    }
    let to = mode & !0o1022;
    fs::set_permissions(d, fs::Permissions::from_mode(to))
        .with_context(|| format!("narrowing the mode of {}", d.display()))?;
    writeln!(
        out,
        "mode {} {mode:04o} -> {to:04o} (pods write only in their own directory)",
        d.display()
    )?;
    Ok(())
}

/// Mode 1777 for a root-owned directory that is not already writable by everyone.
fn widen(d: &Path, out: &mut dyn Write) -> Result<()> {
    let m = fs::symlink_metadata(d).with_context(|| format!("reading {}", d.display()))?;
    let mode = m.permissions().mode() & 0o7777;
    if mode == 0o1777 {
        return Ok(());
    }
    if m.uid() != 0 {
        writeln!(
            out,
            "left {} as it is (mode {mode:04o}, owner uid {}, not root)",
            d.display(),
            m.uid()
        )?;
        return Ok(());
    }
    fs::set_permissions(d, fs::Permissions::from_mode(0o1777))
        .with_context(|| format!("setting mode 1777 on {}", d.display()))?;
    writeln!(out, "mode {} {mode:04o} -> 1777", d.display())?;
    Ok(())
}

fn gate(dir: &Path, out: &mut dyn Write) -> Result<()> {
    if ensure_dir(dir, 0o755)? {
        writeln!(out, "created {} (0755)", dir.display())?;
        return Ok(());
    }
    let mode = fs::symlink_metadata(dir)?.permissions().mode() & 0o7777;
    if mode & 0o022 != 0 {
        fs::set_permissions(dir, fs::Permissions::from_mode(mode & !0o022))
            .with_context(|| format!("narrowing the mode of {}", dir.display()))?;
        writeln!(
            out,
            "mode {} {mode:04o} -> {:04o} (only the agent writes the gate file)",
            dir.display(),
            mode & !0o022
        )?;
    }
    Ok(())
}
