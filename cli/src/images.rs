//! `tessera image build`: OCI image archives of Tessera's cluster daemons, built
//! from this machine's binaries with no image builder and no registry.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use tessera_image::Image;

/// The binaries that run as pods (`tessera`: the chart's node installer), and what
/// each image's entrypoint is.
pub const IMAGES: &[&str] = &[
    "tessera-scheduler",
    "tessera-reporter",
    "tessera-gpu-hook",
    "tessera",
];

/// Where an image is imported under: `<registry>/<name>:<tag>`.
pub fn reference(registry: &str, name: &str, tag: &str) -> String {
    format!("{}/{name}:{tag}", registry.trim_end_matches('/'))
}

/// A binary split by [`strip`]: what goes in the image, and its debug info.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stripped {
    /// The binary without debug info or symbol table, linked to `debug` by
    /// `.gnu_debuglink` (gdb and perf find it beside, or under /usr/lib/debug).
    pub binary: PathBuf,
    /// Its debug info and symbols.
    pub debug: PathBuf,
}

/// Splits `binary` with objcopy: the stripped copy goes to `dir`, the debug info
/// to `debug`. Images carry a release daemon at a sixth of its size (the
/// scheduler: 136 MB to about 21 MB); its backtraces show addresses, which
/// `debug` turns back into functions and lines (docs/install.md).
pub fn strip(binary: &Path, dir: &Path, debug: &Path) -> anyhow::Result<Stripped> {
    let name = binary
        .file_name()
        .with_context(|| format!("{}: not a file name", binary.display()))?;
    let stripped = dir.join(name);
    let objcopy = |args: &[&std::ffi::OsStr]| -> anyhow::Result<()> {
        let output = std::process::Command::new("objcopy")
            .args(args)
            .output()
            .context("running objcopy (Debian: apt-get install binutils)")?;
        if !output.status.success() {
            bail!(
                "objcopy {}: {}",
                args.iter()
                    .map(|a| a.to_string_lossy())
                    .collect::<Vec<_>>()
                    .join(" "),
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        Ok(())
    };
    objcopy(&[
        "--only-keep-debug".as_ref(),
        binary.as_os_str(),
        debug.as_os_str(),
    ])?;
    objcopy(&[
        "--strip-all".as_ref(),
        binary.as_os_str(),
        stripped.as_os_str(),
    ])?;
    let mut link = std::ffi::OsString::from("--add-gnu-debuglink=");
    link.push(debug);
    objcopy(&[&link, stripped.as_os_str()])?;
    Ok(Stripped {
        binary: stripped,
        debug: debug.to_path_buf(),
    })
}

/// One image built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Built {
    /// `<registry>/<name>:<tag>`.
    pub reference: String,
    /// Its manifest's digest.
    pub digest: String,
    /// The archive.
    pub archive: PathBuf,
    /// The binary's debug info, kept beside the archive (`<name>.debug`).
    pub debug: PathBuf,
}

/// Builds the images `names` (all of [`IMAGES`] when empty) from the binaries in
/// `bin_dir` into `out/<name>.tar`, each binary stripped, its debug info kept in
/// `out/<name>.debug`.
pub fn build(
    bin_dir: &Path,
    registry: &str,
    tag: &str,
    names: &[String],
    out: &Path,
) -> anyhow::Result<Vec<Built>> {
    let names: Vec<&str> = if names.is_empty() {
        IMAGES.to_vec()
    } else {
        names.iter().map(String::as_str).collect()
    };
    if let Some(unknown) = names.iter().find(|n| !IMAGES.contains(n)) {
        bail!("no image {unknown:?}: the images are {}", IMAGES.join(", "));
    }
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let scratch = tempfile::tempdir_in(out)
        .with_context(|| format!("a scratch directory in {}", out.display()))?;
    let mut built = Vec::new();
    for name in names {
        let binary = bin_dir.join(name);
        if !binary.is_file() {
            bail!(
                "{}: no such binary (build it with `cargo build --release -p …`, or pass --bin-dir)",
                binary.display()
            );
        }
        let entrypoint = format!("/usr/local/bin/{name}");
        let reference = reference(registry, name, tag);
        let archive = out.join(format!("{name}.tar"));
        let stripped = strip(&binary, scratch.path(), &out.join(format!("{name}.debug")))?;
        let written = Image::new(&reference)
            .add_binary(&stripped.binary, &entrypoint)?
            .entrypoint(&[&entrypoint])
            .label("org.opencontainers.image.title", name)
            .label("org.opencontainers.image.version", tag)
            .label("org.opencontainers.image.licenses", "Apache-2.0")
            .write_archive(&archive)?;
        built.push(Built {
            reference,
            digest: written.manifest_digest,
            archive,
            debug: stripped.debug,
        });
    }
    Ok(built)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_join_registry_name_and_tag() {
        assert_eq!(
            reference("registry.example/tessera/", "tessera-reporter", "0.1.0"),
            "registry.example/tessera/tessera-reporter:0.1.0"
        );
    }

    #[test]
    fn an_unknown_image_or_a_missing_binary_is_named() {
        let dir = tempfile::tempdir().expect("test step");
        let error = build(dir.path(), "r", "t", &["nope".into()], dir.path()).expect_err("refused");
        assert!(error.to_string().contains("no image \"nope\""), "{error}");
        let error = build(
            dir.path(),
            "r",
            "t",
            &["tessera-reporter".into()],
            dir.path(),
        )
        .expect_err("refused");
        assert!(
            error
                .to_string()
                .contains("tessera-reporter: no such binary"),
            "{error}"
        );
    }

    #[test]
    fn an_image_holds_the_binary_as_its_entrypoint_with_its_libraries() {
        let dir = tempfile::tempdir().expect("test step");
        // Any dynamically linked binary stands in for a daemon here.
        std::fs::copy(
            std::env::current_exe().expect("test step"),
            dir.path().join("tessera-reporter"),
        )
        .expect("test step");
        let out = dir.path().join("out");
        let built = build(
            dir.path(),
            "tessera.local",
            "1",
            &["tessera-reporter".into()],
            &out,
        )
        .expect("test step");
        assert_eq!(built.len(), 1);
        assert_eq!(built[0].reference, "tessera.local/tessera-reporter:1");
        assert!(built[0].digest.starts_with("sha256:"));
        assert!(out.join("tessera-reporter.tar").is_file());
        assert_eq!(built[0].debug, out.join("tessera-reporter.debug"));
        assert_eq!(
            std::fs::read_dir(&out).expect("test step").count(),
            2,
            "the archive and the debug info, no scratch left"
        );
        // Rebuilt, it is the same image.
        let again = build(
            dir.path(),
            "tessera.local",
            "1",
            &["tessera-reporter".into()],
            &out,
        )
        .expect("test step");
        assert_eq!(again[0].digest, built[0].digest);
    }

    fn sections(binary: &Path) -> String {
        let output = std::process::Command::new("readelf")
            .args(["-S", "-W"])
            .arg(binary)
            .output()
            .expect("readelf");
        assert!(output.status.success(), "{output:?}");
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    #[test]
    fn a_stripped_binary_keeps_its_debug_info_beside_it_and_still_runs() {
        let dir = tempfile::tempdir().expect("test step");
        // This test binary has line tables and a symbol table (the dev profile's).
        let original = dir.path().join("daemon");
        std::fs::copy(std::env::current_exe().expect("test step"), &original).expect("test step");
        let scratch = dir.path().join("scratch");
        std::fs::create_dir(&scratch).expect("test step");
        let split = strip(&original, &scratch, &dir.path().join("daemon.debug")).expect("strip");
        let (before, after, debug) = (
            sections(&original),
            sections(&split.binary),
            sections(&split.debug),
        );
        assert!(
            before.contains(".debug_line") && before.contains(".symtab"),
            "{before}"
        );
        assert!(
            !after.contains(".debug_line") && !after.contains(".symtab"),
            "{after}"
        );
        assert!(after.contains(".gnu_debuglink"), "{after}");
        assert!(
            debug.contains(".debug_line") && debug.contains(".symtab"),
            "{debug}"
        );
        let size = |p: &Path| std::fs::metadata(p).expect("test step").len();
        assert!(size(&split.binary) < size(&original));
        // Still a working program: list this test binary's tests.
        let listed = std::process::Command::new(&split.binary)
            .arg("--list")
            .output()
            .expect("run the stripped binary");
        assert!(
            String::from_utf8_lossy(&listed.stdout).contains("a_stripped_binary_keeps"),
            "{listed:?}"
        );
        // A binary objcopy cannot read is named.
        std::fs::write(dir.path().join("junk"), b"not elf").expect("test step");
        let error = strip(
            &dir.path().join("junk"),
            &scratch,
            &dir.path().join("junk.debug"),
        )
        .expect_err("refused");
        assert!(
            error.to_string().contains("objcopy --only-keep-debug"),
            "{error}"
        );
    }
}
