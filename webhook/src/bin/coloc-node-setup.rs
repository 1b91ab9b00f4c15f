//! `coloc-node-setup`: prepares a node for pods that the webhook gives the CUDA shim. The
//! chart runs it as the agent pod's init container (as root, from the agent image); it is
//! part of this package because the webhook's injection is what needs it.
//!
//! - `--install SRC --into DIR`: copies the shim to `DIR/<name of SRC>` atomically (a
//!   temporary file in DIR, fsync, rename): processes that loaded the old file keep its
//!   inode, new ones get the new file, nobody sees half a file. An identical file is left
//!   as it is.
//! - `--doorbell-dir DIR`: makes `DIR` and `DIR/pods` mode 1777. The kubelet creates each
//!   pod's `pods/<pod UID>` (the `subPathExpr` mount) with the mode of `pods` and owner
//!   root (`SafeMakeDir` with the volume root's mode), so with `pods` at 1777 a process of
//!   any user in the pod can create its doorbell page there, and none can remove another's.
//!   Per-pod directories made while `pods` had a narrower mode are widened too.
//! - `--gate-dir DIR`: makes `DIR` (root, 0755; the agent writes the gate file in it,
//!   offline pods mount it read-only), and narrows a group- or world-writable one.
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
  coloc-node-setup --install /opt/coloc/lib/libcoloc_cuda.so --into /var/lib/gpu-coloc/lib \\
    --doorbell-dir /run/gpu-coloc/doorbells --gate-dir /run/gpu-coloc/gate"
)]
struct Args {
    /// The file to install (the shim in the agent image).
    #[arg(long, requires = "into")]
    install: Option<PathBuf>,
    /// The host directory to install it into (created, mode 0755).
    #[arg(long, requires = "install")]
    into: Option<PathBuf>,
    /// The agent's doorbell directory: it and its `pods/` become mode 1777.
    #[arg(long)]
    doorbell_dir: Option<PathBuf>,
    /// The node's gate directory: created root 0755 (never group- or world-writable).
    #[arg(long)]
    gate_dir: Option<PathBuf>,
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
    if a.install.is_none() && a.doorbell_dir.is_none() && a.gate_dir.is_none() {
        bail!(
            "nothing to do: pass --install/--into, --doorbell-dir and/or --gate-dir (see --help)"
        );
    }
    if let (Some(src), Some(dir)) = (&a.install, &a.into) {
        install(src, dir, out)?;
    }
    if let Some(dir) = &a.doorbell_dir {
        doorbells(dir, out)?;
    }
    if let Some(dir) = &a.gate_dir {
        gate(dir, out)?;
    }
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

fn install(src: &Path, dir: &Path, out: &mut dyn Write) -> Result<()> {
    let name = src
        .file_name()
        .with_context(|| format!("--install {}: not a file name", src.display()))?;
    let bytes = fs::read(src).with_context(|| format!("reading {}", src.display()))?;
    if ensure_dir(dir, 0o755)? {
        writeln!(out, "created {} (0755)", dir.display())?;
    }
    let dest = dir.join(name);
    if fs::symlink_metadata(&dest).is_ok_and(|m| m.is_file())
        && fs::read(&dest).ok().as_ref() == Some(&bytes)
    {
        writeln!(out, "unchanged {} ({} bytes)", dest.display(), bytes.len())?;
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
            .mode(0o644)
            .open(&tmp)?;
        f.write_all(&bytes)?;
        f.set_permissions(fs::Permissions::from_mode(0o644))?;
        f.sync_all()?;
        fs::rename(&tmp, &dest)?;
        fs::File::open(dir)?.sync_all()
    })();
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(e)
            .with_context(|| format!("installing {} as {}", src.display(), dest.display()));
    }
    writeln!(
        out,
        "installed {} ({} bytes, replaced atomically)",
        dest.display(),
        bytes.len()
    )?;
    Ok(())
}

fn doorbells(dir: &Path, out: &mut dyn Write) -> Result<()> {
    for d in [dir.to_path_buf(), dir.join("pods")] {
        if ensure_dir(&d, 0o1777)? {
            writeln!(out, "created {} (1777)", d.display())?;
            continue;
        }
        widen(&d, out)?;
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
