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

/// One image built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Built {
    /// `<registry>/<name>:<tag>`.
    pub reference: String,
    /// Its manifest's digest.
    pub digest: String,
    /// The archive.
    pub archive: PathBuf,
}

/// Builds the images `names` (all of [`IMAGES`] when empty) from the binaries in
/// `bin_dir` into `out/<name>.tar`.
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
        let written = Image::new(&reference)
            .add_binary(&binary, &entrypoint)?
            .entrypoint(&[&entrypoint])
            .label("org.opencontainers.image.title", name)
            .label("org.opencontainers.image.version", tag)
            .label("org.opencontainers.image.licenses", "Apache-2.0")
            .write_archive(&archive)?;
        built.push(Built {
            reference,
            digest: written.manifest_digest,
            archive,
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
}
