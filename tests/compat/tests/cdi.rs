//! The CDI spec `coloc-node-setup --cdi-spec` writes, applied by a real container runtime:
//! Podman (Debian 12's 4.3, whose CDI library is the one containerd and CRI-O vendor) with
//! runc, on a Debian bullseye userland. A container given `gpu-coloc.dev/shim=offline-1`
//! must see its slot's doorbell directory read-write at the doorbell path (a file it makes
//! there lands in the slot's directory on the host), the shim's and the gate's directories
//! read-only, and the shim's environment; one given `online-0` gets no gate.

use coloc_compat::userland;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Removes the spec from the runtime's directory, passing or failing.
struct SpecFile(PathBuf);
impl Drop for SpecFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn node_setup() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.ancestors().nth(2).unwrap().join("coloc-node-setup")
}

fn have(cmd: &str) -> bool {
    Command::new(cmd)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Runs `script` in a container of `root`, with CDI device `device` if any; (success,
/// output).
fn podman(root: &Path, device: Option<&str>, script: &str) -> (bool, String) {
    let out = Command::new("timeout")
        .arg("120")
        .args([
            "podman",
            "--runtime",
            "runc",
            "run",
            "--rm",
            "--network",
            "none",
        ])
        // The defaults (nofile 1048576) may exceed what this host lets root raise.
        .args([
            "--ulimit",
            "nofile=1024:1024",
            "--ulimit",
            "nproc=1024:1024",
        ])
        .args(device.map(|d| vec!["--device", d]).unwrap_or_default())
        .arg("--rootfs")
        // An overlay on the cached userland: the mount points runc makes stay out of it.
        .arg(format!("{}:O", root.display()))
        .args(["/bin/sh", "-c", script])
        .output()
        .expect("run podman");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn a_real_runtime_mounts_a_slot_as_the_spec_says() {
    if !have("podman") || !have("runc") {
        eprintln!("NOTE: podman or runc is not installed (Debian: apt-get install podman runc): the CDI spec is checked as JSON only (webhook/tests/node_setup.rs)");
        return;
    }
    let Some(root) = userland("bullseye") else {
        return;
    };
    // A host where Podman cannot run a container at all (no runtime support for its
    // cgroups or overlays) says nothing about the spec: said, and the JSON check stands.
    let (ok, text) = podman(&root, None, "true");
    if !ok {
        eprintln!("NOTE: Podman cannot run a container on this host ({}): the CDI spec is checked as JSON only (webhook/tests/node_setup.rs)", text.trim());
        return;
    }
    let cdi_dir = Path::new("/var/run/cdi");
    std::fs::create_dir_all(cdi_dir).unwrap();
    // Another spec of the kind (an installed agent's) would make the devices ambiguous.
    for e in std::fs::read_dir(cdi_dir).unwrap().flatten() {
        let text = std::fs::read_to_string(e.path()).unwrap_or_default();
        if text.contains("\"gpu-coloc.dev/shim\"") {
            panic!(
                "{} already defines gpu-coloc.dev/shim devices (an installed agent?): this test needs the kind to itself",
                e.path().display()
            );
        }
    }
    let tmp = tempfile::Builder::new()
        .prefix("coloc-compat-cdi-")
        .tempdir()
        .unwrap();
    let d = tmp.path();
    std::fs::write(d.join("libcoloc_cuda.so"), b"shim").unwrap();
    let sum = Command::new("sha256sum")
        .arg(d.join("libcoloc_cuda.so"))
        .output()
        .unwrap();
    std::fs::write(d.join("sum"), &sum.stdout).unwrap();
    let (lib, bells, gate) = (d.join("lib"), d.join("bells"), d.join("gate"));
    let spec = SpecFile(cdi_dir.join(format!("gpu-coloc-compat-{}.json", std::process::id())));
    let out = Command::new(node_setup())
        .arg("--install")
        .arg(d.join("libcoloc_cuda.so"))
        .arg("--sha256")
        .arg(d.join("sum"))
        .arg("--into")
        .arg(&lib)
        .arg("--doorbell-dir")
        .arg(&bells)
        .arg("--gate-dir")
        .arg(&gate)
        .arg("--cdi-spec")
        .arg(&spec.0)
        .args(["--slots", "2"])
        .output()
        .expect("coloc-node-setup (built by cargo build --workspace)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (b, l, g) = (bells.display(), lib.display(), gate.display());
    let (ok, text) = podman(
        &root,
        Some("gpu-coloc.dev/shim=offline-1"),
        &format!(
            "env | grep ^COLOC_; echo x > {b}/1-1.bell && echo bell-written; \
             touch {l}/x 2>/dev/null || echo lib-read-only; touch {g}/x 2>/dev/null || echo gate-read-only; \
             cat {l}/libcoloc_cuda.so"
        ),
    );
    assert!(ok, "podman: {text}");
    for want in [
        "COLOC_SHIM_CLASS=offline".to_string(),
        format!("COLOC_DOORBELL_DIR={b}"),
        format!("COLOC_GATE_FILE={g}/gates"),
        "bell-written".into(),
        "lib-read-only".into(),
        "gate-read-only".into(),
        "shim".into(),
    ] {
        assert!(
            text.contains(&want),
            "{want:?} not in the container's output:\n{text}"
        );
    }
    let landed = bells.join("pods/slot-offline-1/1-1.bell");
    assert!(
        landed.exists(),
        "the container's page is not in its slot's directory on the host"
    );
    assert!(
        !bells.join("1-1.bell").exists(),
        "the page landed in the shared directory"
    );
    let (ok, text) = podman(
        &root,
        Some("gpu-coloc.dev/shim=online-0"),
        &format!("env | grep ^COLOC_; grep -q ' {g} ' /proc/self/mountinfo && echo has-gate; touch {b}/2-2.bell && echo bell-written"),
    );
    assert!(ok, "podman: {text}");
    assert!(
        text.contains("COLOC_SHIM_CLASS=online") && text.contains("bell-written"),
        "{text}"
    );
    assert!(
        !text.contains("COLOC_GATE_FILE") && !text.contains("has-gate"),
        "an online slot got the gate:\n{text}"
    );
    assert!(bells.join("pods/slot-online-0/2-2.bell").exists());
    // A device the spec does not define is refused by the runtime.
    let (ok, text) = podman(&root, Some("gpu-coloc.dev/shim=offline-2"), "true");
    assert!(!ok, "an undefined slot was accepted: {text}");
}
