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
/// The probe as a CUDA image: its config sets `NVIDIA_VISIBLE_DEVICES=all` as
/// NVIDIA's CUDA images do. The hook never sees an image's env (it is not in the
/// CRI request); containerd puts it before the request's, and the NVIDIA toolkit
/// obeys the last entry.
pub const CUDA_PROBE_IMAGE: &str = "tessera.local/cuda-probe:1";
/// NVIDIA's device plugin binary with the libraries it and NVML load, as NVIDIA's
/// image ships it (its config sets `NVIDIA_VISIBLE_DEVICES=all` too).
pub const DEVICE_PLUGIN_IMAGE: &str = "tessera.local/nvidia-device-plugin:1";

/// The device env NVIDIA's CUDA and device-plugin images set in their config.
const NVIDIA_IMAGE_ENV: [&str; 2] = [
    "NVIDIA_VISIBLE_DEVICES=all",
    "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
];

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
/// `files` (path in image, bytes, mode), whose entrypoint is `entrypoint` and
/// whose config sets `env` (`KEY=VALUE`).
pub fn write_oci_archive(
    reference: &str,
    files: &[(impl AsRef<str>, Vec<u8>, u32)],
    entrypoint: &[&str],
    env: &[&str],
    out: &Path,
) -> anyhow::Result<()> {
    let mut layer = tar::Builder::new(Vec::new());
    for (path, bytes, mode) in files {
        append(&mut layer, path.as_ref(), bytes, *mode)?;
    }
    let layer = layer.into_inner()?;
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": { "Entrypoint": entrypoint, "Env": env },
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
/// The archive is named after the image (`tessera.local/cuda-probe:1` →
/// `cuda-probe.tar`).
pub fn static_image_archive(
    name: &str,
    reference: &str,
    env: &[&str],
    dir: &Path,
) -> anyhow::Result<PathBuf> {
    let binary = compile_static(name, dir)?;
    let image = reference.rsplit('/').next().unwrap_or(reference);
    let image = image.split(':').next().unwrap_or(image);
    let archive = dir.join(format!("{image}.tar"));
    let entrypoint = format!("/{name}");
    write_oci_archive(
        reference,
        &[(name, std::fs::read(binary)?, 0o755)],
        &[&entrypoint],
        env,
        &archive,
    )?;
    Ok(archive)
}

/// Builds the pause image archive under `dir`; returns its path.
pub fn pause_archive(dir: &Path) -> anyhow::Result<PathBuf> {
    static_image_archive("pause", PAUSE_IMAGE, &[], dir)
}

/// Builds the probe image archive under `dir`; returns its path.
pub fn probe_archive(dir: &Path) -> anyhow::Result<PathBuf> {
    static_image_archive("probe", PROBE_IMAGE, &[], dir)
}

/// Builds the CUDA-like probe image archive under `dir`; returns its path.
pub fn cuda_probe_archive(dir: &Path) -> anyhow::Result<PathBuf> {
    static_image_archive("probe", CUDA_PROBE_IMAGE, &NVIDIA_IMAGE_ENV, dir)
}

/// The shared libraries `ldd` says `binary` loads, the dynamic loader included.
fn shared_libraries(binary: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let output = Command::new("ldd")
        .arg(binary)
        .output()
        .context("running ldd (install libc-bin)")?;
    if !output.status.success() {
        bail!(
            "ldd {} failed with {}: {}",
            binary.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    parse_ldd(&String::from_utf8_lossy(&output.stdout))
        .with_context(|| format!("libraries of {}", binary.display()))
}

/// Paths in `ldd` output: `libc.so.6 => /lib/.../libc.so.6 (0x...)` and the
/// loader's `/lib64/ld-linux-x86-64.so.2 (0x...)`; the vDSO has no file. A
/// library ldd cannot find is an error: the image would fail only when started.
fn parse_ldd(text: &str) -> anyhow::Result<Vec<PathBuf>> {
    let mut paths = Vec::new();
    for line in text.lines().map(str::trim) {
        let path = match line.split_once("=>") {
            Some((name, target)) if target.trim() == "not found" => {
                bail!("ldd finds no {}", name.trim())
            }
            Some((_, target)) => target.trim(),
            None => line,
        };
        let path = path.split(" (").next().unwrap_or_default().trim();
        if path.starts_with('/') {
            paths.push(PathBuf::from(path));
        }
    }
    Ok(paths)
}

/// Builds the device-plugin image archive under `dir` from the `plugin` binary,
/// with every library it and `nvml` (the NVML library the node's driver would
/// inject) load, at the paths they have on this machine; returns its path.
pub fn device_plugin_archive(plugin: &Path, nvml: &Path, dir: &Path) -> anyhow::Result<PathBuf> {
    let mut libraries = shared_libraries(plugin)?;
    libraries.extend(shared_libraries(nvml)?);
    libraries.sort();
    libraries.dedup();
    let mut files = vec![(
        "usr/bin/nvidia-device-plugin".to_owned(),
        std::fs::read(plugin).with_context(|| format!("reading {}", plugin.display()))?,
        0o755,
    )];
    for library in libraries {
        // Read through symlinks: the image holds each file where the loader looks.
        let bytes =
            std::fs::read(&library).with_context(|| format!("reading {}", library.display()))?;
        let path = library.to_string_lossy().trim_start_matches('/').to_owned();
        files.push((path, bytes, 0o755));
    }
    let archive = dir.join("nvidia-device-plugin.tar");
    write_oci_archive(
        DEVICE_PLUGIN_IMAGE,
        &files,
        &["/usr/bin/nvidia-device-plugin"],
        &NVIDIA_IMAGE_ENV,
        &archive,
    )?;
    Ok(archive)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldd_output_names_libraries_and_the_loader_but_not_the_vdso() {
        let text = "\tlinux-vdso.so.1 (0x00007ffd)\n\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f)\n\t/lib64/ld-linux-x86-64.so.2 (0x00007f)\n";
        assert_eq!(
            parse_ldd(text).unwrap(),
            [
                PathBuf::from("/lib/x86_64-linux-gnu/libc.so.6"),
                PathBuf::from("/lib64/ld-linux-x86-64.so.2"),
            ]
        );
        let missing = format!("{text}\tlibmissing.so.1 => not found\n");
        let error = parse_ldd(&missing).unwrap_err().to_string();
        assert!(error.contains("libmissing.so.1"), "{error}");
    }
}
