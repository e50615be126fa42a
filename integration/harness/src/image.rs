//! The test images, built with `tessera-image` and imported with `ctr images import`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use tessera_image::Image;

/// The sandbox image every harness containerd uses.
pub const PAUSE_IMAGE: &str = "tessera.local/pause:1";
/// A test image whose entrypoint prints the GPU device nodes it sees, then sleeps.
pub const PROBE_IMAGE: &str = "tessera.local/probe:1";
/// The probe as a CUDA image: its config sets `NVIDIA_VISIBLE_DEVICES=all` as
/// NVIDIA's CUDA images do. The hook never sees an image's env (it is not in the
/// CRI request); containerd puts it before the request's, and the NVIDIA toolkit
/// obeys the last entry.
pub const CUDA_PROBE_IMAGE: &str = "tessera.local/cuda-probe:1";
/// A dynamically linked test image whose entrypoint reports whether a preloaded
/// `libvgpu.so` is mapped into it and into a child started with an empty
/// environment (`preload-probe.c`).
pub const PRELOAD_PROBE_IMAGE: &str = "tessera.local/preload-probe:1";
/// NVIDIA's device plugin binary with the libraries it and NVML load, as NVIDIA's
/// image ships it (its config sets `NVIDIA_VISIBLE_DEVICES=all` too).
pub const DEVICE_PLUGIN_IMAGE: &str = "tessera.local/nvidia-device-plugin:1";

/// The device env NVIDIA's CUDA and device-plugin images set in their config.
const NVIDIA_IMAGE_ENV: [&str; 2] = [
    "NVIDIA_VISIBLE_DEVICES=all",
    "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
];

/// Compiles `integration/harness/images/<name>.c` into a static binary under `out`.
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

/// Compiles `integration/harness/images/<name>.c` with `cc` and `flags` into `out`.
fn compile(name: &str, flags: &[&str], output: &Path) -> anyhow::Result<()> {
    let source = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("images")
        .join(format!("{name}.c"));
    let status = Command::new("cc")
        .args(flags)
        .arg("-o")
        .arg(output)
        .arg(&source)
        .status()
        .context("running cc (install gcc and libc6-dev)")?;
    if !status.success() {
        bail!("cc {flags:?} {} failed with {status}", source.display());
    }
    Ok(())
}

/// Builds the stand-in for HAMi-core's `libvgpu.so` (`vgpu-stand-in.c`) as
/// `<dir>/libvgpu.so`; returns its path.
pub fn vgpu_stand_in(dir: &Path) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let library = dir.join("libvgpu.so");
    compile(
        "vgpu-stand-in",
        &["-shared", "-fPIC", "-O2", "-ldl", "-lpthread"],
        &library,
    )?;
    Ok(library)
}

/// Builds the preload-probe image archive under `dir`: the dynamic binary and
/// the libraries it loads; returns its path.
pub fn preload_probe_archive(dir: &Path) -> anyhow::Result<PathBuf> {
    let binary = dir.join("preload-probe");
    compile("preload-probe", &["-O2"], &binary)?;
    let archive = archive_path(PRELOAD_PROBE_IMAGE, dir);
    Image::new(PRELOAD_PROBE_IMAGE)
        .add_binary(&binary, "/preload-probe")?
        .entrypoint(&["/preload-probe"])
        .write_archive(&archive)?;
    Ok(archive)
}

/// The archive of an image: `tessera.local/cuda-probe:1` → `<dir>/cuda-probe.tar`.
fn archive_path(reference: &str, dir: &Path) -> PathBuf {
    let image = reference.rsplit('/').next().unwrap_or(reference);
    let image = image.split(':').next().unwrap_or(image);
    dir.join(format!("{image}.tar"))
}

/// Builds the archive of an image named `reference` holding only the static
/// binary compiled from `images/<name>.c`, as `/<name>`, its entrypoint, with
/// `env` in its config.
pub fn static_image_archive(
    name: &str,
    reference: &str,
    env: &[&str],
    dir: &Path,
) -> anyhow::Result<PathBuf> {
    let binary = compile_static(name, dir)?;
    let entrypoint = format!("/{name}");
    let archive = archive_path(reference, dir);
    Image::new(reference)
        .file(&entrypoint, std::fs::read(binary)?, 0o755)?
        .entrypoint(&[&entrypoint])
        .env(env)
        .write_archive(&archive)?;
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

/// Builds the device-plugin image archive under `dir` from the `plugin` binary,
/// with every library it and `nvml` (the NVML library the node's driver would
/// inject) load; returns its path.
pub fn device_plugin_archive(plugin: &Path, nvml: &Path, dir: &Path) -> anyhow::Result<PathBuf> {
    let mut image = Image::new(DEVICE_PLUGIN_IMAGE)
        .add_binary(plugin, "/usr/bin/nvidia-device-plugin")?
        .entrypoint(&["/usr/bin/nvidia-device-plugin"])
        .env(&NVIDIA_IMAGE_ENV);
    // NVML's own libraries, not NVML itself: that comes from the host, as the
    // toolkit injects the driver's.
    for library in tessera_image::shared_libraries(nvml)? {
        let bytes =
            std::fs::read(&library).with_context(|| format!("reading {}", library.display()))?;
        image = image.file(&library.to_string_lossy(), bytes, 0o755)?;
    }
    let archive = archive_path(DEVICE_PLUGIN_IMAGE, dir);
    image.write_archive(&archive)?;
    Ok(archive)
}
