//! Builds OCI image archives from static binaries, to import with `ctr images import`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use sha2::{Digest, Sha256};

/// The sandbox image every harness containerd uses.
pub const PAUSE_IMAGE: &str = "tessera.local/pause:1";
/// A test image whose entrypoint prints the GPU device nodes it sees, then sleeps.
pub const PROBE_IMAGE: &str = "tessera.local/probe:1";

/// Compiles `integration/images/<name>.c` into a static binary under `out`.
pub fn compile_static(name: &str, out: &Path) -> anyhow::Result<PathBuf> {
    let source = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("images")
        .join(format!("{name}.c"));
    let binary = out.join(name);
    let status = Command::new("cc")
        .args(["-static", "-O2", "-o"])
        .arg(&binary)
        .arg(&source)
        .status()
        .context("running cc (install gcc and libc6-dev)")?;
    if !status.success() {
        bail!("cc -static {} failed with {status}", source.display());
    }
    Ok(binary)
}

fn digest(bytes: &[u8]) -> String {
    let hash = Sha256::digest(bytes);
    let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

fn append(
    archive: &mut tar::Builder<impl Write>,
    path: &str,
    bytes: &[u8],
    mode: u32,
) -> std::io::Result<()> {
    let mut header = tar::Header::new_ustar();
    header.set_size(bytes.len() as u64);
    header.set_mode(mode);
    header.set_mtime(0);
    header.set_cksum();
    archive.append_data(&mut header, path, bytes)
}

/// Writes an OCI image-layout archive named `reference` whose single layer holds
/// `files` (path in image, bytes, mode) and whose entrypoint is `entrypoint`.
pub fn write_oci_archive(
    reference: &str,
    files: &[(&str, Vec<u8>, u32)],
    entrypoint: &[&str],
    out: &Path,
) -> anyhow::Result<()> {
    let mut layer = tar::Builder::new(Vec::new());
    for (path, bytes, mode) in files {
        append(&mut layer, path, bytes, *mode)?;
    }
    let layer = layer.into_inner()?;
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": { "Entrypoint": entrypoint },
        "rootfs": { "type": "layers", "diff_ids": [digest(&layer)] },
    }))?;
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": { "mediaType": "application/vnd.oci.image.config.v1+json", "digest": digest(&config), "size": config.len() },
        "layers": [{ "mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": digest(&layer), "size": layer.len() }],
    }))?;
    let index = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": digest(&manifest),
            "size": manifest.len(),
            "annotations": { "io.containerd.image.name": reference },
        }],
    }))?;
    let mut archive = tar::Builder::new(std::fs::File::create(out)?);
    append(
        &mut archive,
        "oci-layout",
        br#"{"imageLayoutVersion":"1.0.0"}"#,
        0o644,
    )?;
    append(&mut archive, "index.json", &index, 0o644)?;
    for blob in [&layer, &config, &manifest] {
        let name = digest(blob).replace(':', "/");
        append(&mut archive, &format!("blobs/{name}"), blob, 0o644)?;
    }
    archive.finish()?;
    Ok(())
}

/// Builds the archive of an image named `reference` holding only the static
/// binary compiled from `images/<name>.c`, as `/<name>`, its entrypoint.
pub fn static_image_archive(name: &str, reference: &str, dir: &Path) -> anyhow::Result<PathBuf> {
    let binary = compile_static(name, dir)?;
    let archive = dir.join(format!("{name}.tar"));
    let entrypoint = format!("/{name}");
    write_oci_archive(
        reference,
        &[(name, std::fs::read(binary)?, 0o755)],
        &[&entrypoint],
        &archive,
    )?;
    Ok(archive)
}

/// Builds the pause image archive under `dir`; returns its path.
pub fn pause_archive(dir: &Path) -> anyhow::Result<PathBuf> {
    static_image_archive("pause", PAUSE_IMAGE, dir)
}

/// Builds the probe image archive under `dir`; returns its path.
pub fn probe_archive(dir: &Path) -> anyhow::Result<PathBuf> {
    static_image_archive("probe", PROBE_IMAGE, dir)
}
