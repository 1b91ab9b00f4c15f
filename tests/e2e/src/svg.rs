//! Rendering a picture the tests produce, to check that it shows something.

use anyhow::{bail, Context, Result};
use std::path::Path;
use std::process::Command;

/// Renders an SVG to PNG with `rsvg-convert` and checks the picture is not blank: returns
/// the number of distinct byte values in the decoded pixel data (a blank image has ~2).
pub fn render_svg(svg: &Path) -> Result<usize> {
    let png = svg.with_extension("png");
    let out = Command::new("rsvg-convert")
        .arg("-o")
        .arg(&png)
        .arg(svg)
        .output()
        .context(
            "rsvg-convert is not installed (the README's test command installs librsvg2-bin)",
        )?;
    if !out.status.success() {
        bail!(
            "rsvg-convert failed on {}: {}",
            svg.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let script = "import sys,zlib\nd=open(sys.argv[1],'rb').read()\nassert d[:8]==b'\\x89PNG\\r\\n\\x1a\\n'\ni=8;idat=b''\nwhile i<len(d):\n  n=int.from_bytes(d[i:i+4],'big');t=d[i+4:i+8]\n  if t==b'IDAT': idat+=d[i+8:i+8+n]\n  i+=12+n\nprint(len(set(zlib.decompress(idat))))";
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(&png)
        .output()?;
    if !out.status.success() {
        bail!(
            "{} is not a PNG: {}",
            png.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
}
