//! `coloc-node-setup` (the agent pod's init container) on temporary directories standing
//! for the node's: the shim installed atomically (a process holding the old file keeps
//! it), idempotent; the doorbell directory and `pods/` made root's 0755, each pod's
//! `pods/<uid>` 1777; the gate directory root 0755.

use std::io::Read;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A scratch directory, removed when dropped (passing or failing).
fn tmpdir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("coloc-node-setup-{name}-"))
        .tempdir()
        .unwrap()
}

fn setup(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_coloc-node-setup"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
}

fn sha256_file(dir: &Path, content: &[u8]) -> PathBuf {
    // The digest as the image build writes it (`sha256sum` output), computed here by the
    // system's sha256sum where there is one, else by the library the binary uses.
    let p = dir.join("libcoloc_cuda.so.sha256");
    let line = match Command::new("sha256sum")
        .arg(dir.join("libcoloc_cuda.so"))
        .output()
    {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).to_string(),
        _ => {
            let d = ring::digest::digest(&ring::digest::SHA256, content);
            let hex: String = d.as_ref().iter().map(|b| format!("{b:02x}")).collect();
            format!("{hex}  libcoloc_cuda.so\n")
        }
    };
    std::fs::write(&p, line).unwrap();
    p
}

#[test]
fn installs_the_shim_atomically_and_once() {
    let dir = tmpdir("install");
    let d = dir.path();
    let (image, host) = (d.join("image"), d.join("host/var/lib/gpu-coloc/lib"));
    std::fs::create_dir_all(&image).unwrap();
    let src = image.join("libcoloc_cuda.so");
    std::fs::write(&src, b"version 1").unwrap();
    let sum = sha256_file(&image, b"version 1");
    let args = [
        "--install",
        src.to_str().unwrap(),
        "--sha256",
        sum.to_str().unwrap(),
        "--into",
        host.to_str().unwrap(),
    ];
    let (ok, text) = setup(&args);
    assert!(ok && text.contains("installed"), "{text}");
    let dest = host.join("libcoloc_cuda.so");
    assert_eq!(std::fs::read(&dest).unwrap(), b"version 1");
    // Read-only for everyone, in a directory only its owner writes; that owner is the
    // installing user (root in the chart).
    assert_eq!(mode(&dest), 0o444);
    assert_eq!(mode(&host), 0o755);
    let me = std::fs::metadata(d).unwrap().uid();
    assert_eq!(std::fs::metadata(&dest).unwrap().uid(), me);
    assert_eq!(std::fs::metadata(&host).unwrap().uid(), me);

    // Same file: nothing written (the inode stays).
    let ino = std::fs::metadata(&dest).unwrap().ino();
    let (ok, text) = setup(&args);
    assert!(ok && text.contains("unchanged"), "{text}");
    assert_eq!(std::fs::metadata(&dest).unwrap().ino(), ino);

    // Same content, but made writable on the node: replaced by a 0444 file.
    std::fs::set_permissions(&dest, std::fs::Permissions::from_mode(0o666)).unwrap();
    let (ok, text) = setup(&args);
    assert!(ok && text.contains("installed"), "{text}");
    assert_eq!(mode(&dest), 0o444);

    // A new version replaces it by rename: a process that has the old one open (loaded)
    // keeps reading the old content; the path gives the new one; no temporary file stays.
    let ino = std::fs::metadata(&dest).unwrap().ino();
    let mut loaded = std::fs::File::open(&dest).unwrap();
    std::fs::write(&src, b"version 2, longer").unwrap();
    sha256_file(&image, b"version 2, longer");
    let (ok, text) = setup(&args);
    assert!(ok && text.contains("replaced atomically"), "{text}");
    let mut old = String::new();
    loaded.read_to_string(&mut old).unwrap();
    assert_eq!(old, "version 1");
    assert_eq!(std::fs::read(&dest).unwrap(), b"version 2, longer");
    assert_ne!(std::fs::metadata(&dest).unwrap().ino(), ino);
    let left: Vec<_> = std::fs::read_dir(&host)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, vec![std::ffi::OsString::from("libcoloc_cuda.so")]);
}

#[test]
fn a_shim_that_does_not_match_its_digest_is_refused() {
    let dir = tmpdir("digest");
    let d = dir.path();
    let (image, host) = (d.join("image"), d.join("host/lib"));
    std::fs::create_dir_all(&image).unwrap();
    let src = image.join("libcoloc_cuda.so");
    std::fs::write(&src, b"the real shim").unwrap();
    let sum = sha256_file(&image, b"the real shim");
    let args = [
        "--install",
        src.to_str().unwrap(),
        "--sha256",
        sum.to_str().unwrap(),
        "--into",
        host.to_str().unwrap(),
    ];
    let (ok, text) = setup(&args);
    assert!(ok, "{text}");
    // The image's file altered after the digest was taken: refused loudly, the node's
    // copy left as it was.
    std::fs::write(&src, b"the real shim, patched").unwrap();
    let (ok, text) = setup(&args);
    assert!(!ok && text.contains("DIGEST MISMATCH"), "{text}");
    assert_eq!(
        std::fs::read(host.join("libcoloc_cuda.so")).unwrap(),
        b"the real shim"
    );
    // No digest, or not one: refused.
    std::fs::write(&sum, "not a digest\n").unwrap();
    let (ok, text) = setup(&args);
    assert!(!ok && text.contains("not a SHA-256 digest"), "{text}");
    let (ok, text) = setup(
        &args[..2]
            .iter()
            .chain(&args[4..])
            .copied()
            .collect::<Vec<_>>(),
    );
    assert!(!ok && text.contains("--sha256"), "{text}");
}

#[test]
fn the_shims_directory_is_its_owners_alone() {
    let dir = tmpdir("shimdir");
    let d = dir.path();
    let image = d.join("image");
    std::fs::create_dir_all(&image).unwrap();
    let src = image.join("libcoloc_cuda.so");
    std::fs::write(&src, b"shim").unwrap();
    let sum = sha256_file(&image, b"shim");
    let run = |host: &Path| {
        setup(&[
            "--install",
            src.to_str().unwrap(),
            "--sha256",
            sum.to_str().unwrap(),
            "--into",
            host.to_str().unwrap(),
        ])
    };
    // A world-writable directory is narrowed to 0755.
    let open = d.join("open");
    std::fs::create_dir_all(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let (ok, text) = run(&open);
    assert!(ok && text.contains("0777 -> 0755"), "{text}");
    assert_eq!(mode(&open), 0o755);
    // Below a world-writable parent without the sticky bit: refused (the directory could
    // be swapped).
    let parent = d.join("loose");
    std::fs::create_dir_all(parent.join("lib")).unwrap();
    std::fs::set_permissions(&parent, std::fs::Permissions::from_mode(0o777)).unwrap();
    let (ok, text) = run(&parent.join("lib"));
    assert!(!ok && text.contains("sticky"), "{text}");
    assert!(!parent.join("lib/libcoloc_cuda.so").exists());
    // A symlink where the directory belongs: refused.
    let link = d.join("link");
    std::os::unix::fs::symlink(&open, &link).unwrap();
    let (ok, text) = run(&link);
    assert!(!ok && text.contains("not a directory"), "{text}");
    // Owned by someone else: refused (needs root to make such a directory here).
    let theirs = d.join("theirs");
    std::fs::create_dir_all(&theirs).unwrap();
    let root = std::fs::metadata(d).unwrap().uid() == 0;
    if root && std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).is_ok() {
        std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o755)).unwrap();
        let (ok, text) = run(&theirs);
        assert!(!ok && text.contains("owned by uid 65534"), "{text}");
    } else {
        eprintln!("NOTE: not checked: a directory of another owner is refused (needs root)");
    }
}

#[test]
fn doorbell_directories_let_any_user_of_a_pod_add_its_page() {
    let dir = tmpdir("bells");
    let d = dir.path();
    let bells = d.join("run/gpu-coloc/doorbells");
    // What the kubelet leaves when a GPU pod started before the agent: pods/ made by the
    // hostPath volume (0755), and the pod's directory with the same mode.
    std::fs::create_dir_all(bells.join("pods/3f1c2d4e-0000-4000-8000-000000000001")).unwrap();
    for p in [
        bells.clone(),
        bells.join("pods"),
        bells.join("pods/3f1c2d4e-0000-4000-8000-000000000001"),
    ] {
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let pod_dir = bells.join("pods/3f1c2d4e-0000-4000-8000-000000000001");
    let page = pod_dir.join("7-1.bell");
    // As the kubelet leaves it, a non-root process of the pod cannot add its page.
    let root = std::fs::metadata(&bells).unwrap().uid() == 0;
    let as_nobody = |path: &Path| {
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "touch"])
            .arg(path)
            .status()
            .map(|s| s.success())
    };
    // (the temporary directory's parents must be traversable by that user)
    let traversable = d.ancestors().all(|a| mode(a) & 0o001 != 0);
    let check_user = root && traversable && as_nobody(Path::new("/dev/null")).is_ok();
    if check_user {
        assert!(
            !as_nobody(&page).unwrap(),
            "a 0755 root directory took a page"
        );
    }
    let (ok, text) = setup(&["--doorbell-dir", bells.to_str().unwrap()]);
    assert!(ok, "{text}");
    if check_user {
        assert!(
            as_nobody(&page).unwrap(),
            "uid 65534 cannot create its page in {}",
            pod_dir.display()
        );
        assert_eq!(std::fs::metadata(&page).unwrap().uid(), 65534);
    } else {
        eprintln!("not checked as another user: needs root and setpriv");
    }
    if root {
        assert_eq!(
            mode(&bells.join("pods/3f1c2d4e-0000-4000-8000-000000000001")),
            0o1777,
            "{text}"
        );
        // No tenant may add, swap or remove a pod's directory.
        for p in [bells.clone(), bells.join("pods")] {
            assert_eq!(mode(&p), 0o755, "{}: {text}", p.display());
        }
        if check_user {
            assert!(
                !as_nobody(&bells.join("pods/not-a-pod")).unwrap(),
                "uid 65534 added an entry to pods/"
            );
        }
    } else {
        assert!(text.contains("not root"), "{text}");
    }
    std::fs::remove_file(&page).ok();
    // Idempotent: nothing more to say.
    let (ok, again) = setup(&["--doorbell-dir", bells.to_str().unwrap()]);
    assert!(
        ok && (again.is_empty() || again.contains("not root")),
        "{again}"
    );
    // Created fresh.
    let fresh = d.join("fresh/doorbells");
    let (ok, text) = setup(&["--doorbell-dir", fresh.to_str().unwrap()]);
    assert!(ok && text.contains("created"), "{text}");
    assert_eq!(mode(&fresh.join("pods")), 0o755);
    // One an earlier version left world-writable is narrowed.
    std::fs::set_permissions(fresh.join("pods"), std::fs::Permissions::from_mode(0o1777)).unwrap();
    let (ok, text) = setup(&["--doorbell-dir", fresh.to_str().unwrap()]);
    assert!(ok && text.contains("1777 -> 0755"), "{text}");
    assert_eq!(mode(&fresh.join("pods")), 0o755);
    // One of another owner is refused, not narrowed: its owner could swap pods'
    // directories whatever its mode.
    if root {
        std::os::unix::fs::chown(fresh.join("pods"), Some(65534), Some(65534)).unwrap();
        let (ok, text) = setup(&["--doorbell-dir", fresh.to_str().unwrap()]);
        assert!(!ok && text.contains("owned by uid 65534"), "{text}");
    }
}

#[test]
fn the_gate_directory_is_writable_by_its_owner_only() {
    let dir = tmpdir("gate");
    let d = dir.path();
    let gate = d.join("gate");
    let (ok, text) = setup(&["--gate-dir", gate.to_str().unwrap()]);
    assert!(ok && text.contains("created"), "{text}");
    assert_eq!(mode(&gate), 0o755);
    std::fs::set_permissions(&gate, std::fs::Permissions::from_mode(0o777)).unwrap();
    let (ok, text) = setup(&["--gate-dir", gate.to_str().unwrap()]);
    assert!(ok && text.contains("0777 -> 0755"), "{text}");
    assert_eq!(mode(&gate), 0o755);
}

#[test]
fn refuses_to_do_nothing_and_a_file_where_a_directory_belongs() {
    let (ok, text) = setup(&[]);
    assert!(!ok && text.contains("nothing to do"), "{text}");
    let dir = tmpdir("file");
    let d = dir.path();
    std::fs::write(d.join("gate"), b"").unwrap();
    let (ok, text) = setup(&["--gate-dir", d.join("gate").to_str().unwrap()]);
    assert!(!ok && text.contains("not a directory"), "{text}");
}

/// The CDI spec of the shim's slots: every slot of both classes, each mounting its own
/// doorbell directory read-write at the doorbell path and the rest read-only; the slots'
/// directories made 1777; a slot directory someone replaced with a link is replaced, and
/// what the link pointed at is left alone; a second run changes nothing.
#[test]
fn writes_the_cdi_spec_of_the_slots_and_makes_their_directories() {
    let dir = tmpdir("cdi");
    let d = dir.path();
    let src = d.join("libcoloc_cuda.so");
    std::fs::write(&src, b"shim").unwrap();
    let sum = sha256_file(d, b"shim");
    let (lib, bells, gate) = (d.join("lib"), d.join("bells"), d.join("gate"));
    let spec = d.join("cdi").join("gpu-coloc.json");
    let victim = d.join("victim");
    std::fs::create_dir(&victim).unwrap();
    std::fs::write(victim.join("keep"), b"x").unwrap();
    std::fs::create_dir_all(bells.join("pods")).unwrap();
    std::os::unix::fs::symlink(&victim, bells.join("pods/slot-online-1")).unwrap();
    let args = [
        "--install",
        src.to_str().unwrap(),
        "--sha256",
        sum.to_str().unwrap(),
        "--into",
        lib.to_str().unwrap(),
        "--doorbell-dir",
        bells.to_str().unwrap(),
        "--gate-dir",
        gate.to_str().unwrap(),
        "--cdi-spec",
        spec.to_str().unwrap(),
        "--slots",
        "3",
    ];
    let (ok, out) = setup(&args);
    assert!(ok, "{out}");
    assert!(
        out.contains("wrote") && out.contains("3 slots per class"),
        "{out}"
    );
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&spec).unwrap()).unwrap();
    assert_eq!(v["kind"], "gpu-coloc.dev/shim");
    assert_eq!(mode(&spec), 0o644);
    let devices = v["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 6);
    let off2 = devices.iter().find(|d| d["name"] == "offline-2").unwrap();
    let mounts = off2["containerEdits"]["mounts"].as_array().unwrap();
    let rw: Vec<&serde_json::Value> = mounts
        .iter()
        .filter(|m| m["options"].as_array().unwrap().contains(&"rw".into()))
        .collect();
    assert_eq!(
        rw.len(),
        1,
        "only its own doorbell directory is writable: {mounts:?}"
    );
    assert_eq!(
        rw[0]["hostPath"],
        bells.join("pods/slot-offline-2").to_str().unwrap()
    );
    assert_eq!(rw[0]["containerPath"], bells.to_str().unwrap());
    assert!(mounts
        .iter()
        .any(|m| m["hostPath"] == gate.to_str().unwrap()));
    let on0 = devices.iter().find(|d| d["name"] == "online-0").unwrap();
    assert!(
        !on0.to_string().contains(gate.to_str().unwrap()),
        "online slots have no gate: {on0}"
    );
    for name in ["slot-online-0", "slot-online-1", "slot-offline-2"] {
        let p = bells.join("pods").join(name);
        assert!(std::fs::symlink_metadata(&p).unwrap().is_dir(), "{name}");
        assert_eq!(mode(&p), 0o1777, "{name}");
    }
    assert!(
        victim.join("keep").exists(),
        "the link's target was touched"
    );
    let (ok, out) = setup(&args);
    assert!(
        ok && out.contains("unchanged") && out.contains("0 made"),
        "{out}"
    );
    // Paths the CDI spec cannot carry are refused, naming the flag.
    let odd = d.join("odd,gate");
    let mut bad = args;
    bad[9] = odd.to_str().unwrap();
    let (ok, out) = setup(&bad);
    assert!(!ok && out.contains("--gate-dir"), "{out}");
    assert!(!odd.exists(), "made before the paths were checked");
}
