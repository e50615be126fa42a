//! Reproducible OCI image archives, built with no image builder and no registry.
//!
//! An [`Image`] is one uncompressed layer of files, an entrypoint, env and labels.
//! [`Image::write_archive`] writes an OCI image-layout tar that `ctr images import`
//! (and `skopeo copy oci-archive:…`) takes. Every timestamp is zero and every list
//! is sorted, so the same inputs give the same bytes and digests: an image can be
//! rebuilt and checked rather than trusted.
//!
//! [`Image::add_binary`] adds a dynamically linked binary with every library `ldd`
//! says it loads, at the path it has on the build machine, the loader included: the
//! image runs wherever that loader does, with no base image to patch.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

/// What went wrong building an image, naming the file or command.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// `ldd` could not be run or refused the binary.
    #[error("ldd {binary}: {message}")]
    Ldd {
        /// The binary.
        binary: PathBuf,
        /// What ldd (or starting it) said.
        message: String,
    },
    /// A library the binary loads is not on this machine.
    #[error("{binary} loads {library}, which ldd cannot find")]
    MissingLibrary {
        /// The binary.
        binary: PathBuf,
        /// The library's name.
        library: String,
    },
    /// A path in the image that is not relative and plain.
    #[error("image path {0:?}: must be absolute with no `..`, `.` or empty parts")]
    BadPath(String),
}

/// The digest and size of a written archive's manifest: what a registry would
/// call the image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// `sha256:<hex>` of the manifest.
    pub manifest_digest: String,
    /// The archive's path.
    pub path: PathBuf,
}

/// An image to write: one layer, its config.
#[derive(Debug, Clone, Default)]
pub struct Image {
    reference: String,
    /// Path in the image (no leading `/`) → (bytes, mode). Sorted: reproducible.
    files: BTreeMap<String, (Vec<u8>, u32)>,
    entrypoint: Vec<String>,
    args: Vec<String>,
    env: Vec<String>,
    labels: BTreeMap<String, String>,
}

impl Image {
    /// An empty image that `ctr images import` names `reference`.
    pub fn new(reference: impl Into<String>) -> Self {
        Self {
            reference: reference.into(),
            ..Self::default()
        }
    }

    /// The name it is imported as.
    pub fn reference(&self) -> &str {
        &self.reference
    }

    /// Adds a file at absolute `path` in the image.
    pub fn file(mut self, path: &str, bytes: Vec<u8>, mode: u32) -> Result<Self, ImageError> {
        let relative = image_path(path)?;
        self.files.insert(relative, (bytes, mode));
        Ok(self)
    }

    /// Adds the binary at `host` as `path` in the image, with every shared library
    /// it loads at the path it has here (read through symlinks).
    pub fn add_binary(self, host: &Path, path: &str) -> Result<Self, ImageError> {
        let bytes = read(host)?;
        let mut image = self.file(path, bytes, 0o755)?;
        for library in shared_libraries(host)? {
            let bytes = read(&library)?;
            let path = library.to_string_lossy().into_owned();
            image = image.file(&path, bytes, 0o755)?;
        }
        Ok(image)
    }

    /// The entrypoint: the program and its fixed arguments.
    pub fn entrypoint(mut self, entrypoint: &[&str]) -> Self {
        self.entrypoint = entrypoint.iter().map(|s| (*s).to_owned()).collect();
        self
    }

    /// Default arguments after the entrypoint (a pod's `args` replace them).
    pub fn args(mut self, args: &[&str]) -> Self {
        self.args = args.iter().map(|s| (*s).to_owned()).collect();
        self
    }

    /// Env the runtime sets unless the container's own overrides it (`KEY=VALUE`).
    pub fn env(mut self, env: &[&str]) -> Self {
        self.env = env.iter().map(|s| (*s).to_owned()).collect();
        self
    }

    /// A label in the image config (`org.opencontainers.image.*` and the like).
    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.labels.insert(key.to_owned(), value.to_owned());
        self
    }

    /// Paths in the image, sorted.
    pub fn paths(&self) -> impl Iterator<Item = &str> {
        self.files.keys().map(String::as_str)
    }

    /// Writes the OCI image-layout archive to `out`.
    pub fn write_archive(&self, out: &Path) -> Result<Written, ImageError> {
        let io = |source| ImageError::Io {
            path: out.to_path_buf(),
            source,
        };
        let mut layer = tar::Builder::new(Vec::new());
        for (path, (bytes, mode)) in &self.files {
            append(&mut layer, path, bytes, *mode).map_err(io)?;
        }
        let layer = layer.into_inner().map_err(io)?;
        let config = serde_json::to_vec(&serde_json::json!({
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "Entrypoint": self.entrypoint,
                "Cmd": self.args,
                "Env": self.env,
                "Labels": self.labels,
            },
            "rootfs": { "type": "layers", "diff_ids": [digest(&layer)] },
        }))
        .map_err(|e| io(e.into()))?;
        let manifest = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": { "mediaType": "application/vnd.oci.image.config.v1+json", "digest": digest(&config), "size": config.len() },
            "layers": [{ "mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": digest(&layer), "size": layer.len() }],
        }))
        .map_err(|e| io(e.into()))?;
        let index = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "manifests": [{
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": digest(&manifest),
                "size": manifest.len(),
                "annotations": {
                    "io.containerd.image.name": self.reference,
                    "org.opencontainers.image.ref.name": self.reference,
                },
            }],
        }))
        .map_err(|e| io(e.into()))?;
        let file = std::fs::File::create(out).map_err(io)?;
        let mut archive = tar::Builder::new(std::io::BufWriter::new(file));
        append(
            &mut archive,
            "oci-layout",
            br#"{"imageLayoutVersion":"1.0.0"}"#,
            0o644,
        )
        .map_err(io)?;
        append(&mut archive, "index.json", &index, 0o644).map_err(io)?;
        for blob in [&layer, &config, &manifest] {
            let name = digest(blob).replace(':', "/");
            append(&mut archive, &format!("blobs/{name}"), blob, 0o644).map_err(io)?;
        }
        archive
            .into_inner()
            .and_then(|mut w| w.flush())
            .map_err(io)?;
        Ok(Written {
            manifest_digest: digest(&manifest),
            path: out.to_path_buf(),
        })
    }
}

fn read(path: &Path) -> Result<Vec<u8>, ImageError> {
    std::fs::read(path).map_err(|source| ImageError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// `/usr/bin/x` → `usr/bin/x`; anything that could land outside the root is refused.
fn image_path(path: &str) -> Result<String, ImageError> {
    let relative = path
        .strip_prefix('/')
        .ok_or_else(|| ImageError::BadPath(path.to_owned()))?;
    if relative
        .split('/')
        .any(|part| part.is_empty() || part == "." || part == "..")
    {
        return Err(ImageError::BadPath(path.to_owned()));
    }
    Ok(relative.to_owned())
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

/// The shared libraries `ldd` says `binary` loads, the dynamic loader included;
/// none for a static binary.
pub fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>, ImageError> {
    let output = Command::new("ldd")
        .arg(binary)
        .output()
        .map_err(|e| ImageError::Ldd {
            binary: binary.to_path_buf(),
            message: format!("cannot run ldd (install libc-bin): {e}"),
        })?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        // glibc's ldd says so, and exits 1, for a static binary.
        if stdout.contains("not a dynamic executable")
            || String::from_utf8_lossy(&output.stderr).contains("not a dynamic executable")
        {
            return Ok(Vec::new());
        }
        return Err(ImageError::Ldd {
            binary: binary.to_path_buf(),
            message: format!(
                "exited with {}: {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            ),
        });
    }
    parse_ldd(binary, &stdout)
}

/// Paths in `ldd` output: `libc.so.6 => /lib/.../libc.so.6 (0x...)` and the
/// loader's `/lib64/ld-linux-x86-64.so.2 (0x...)`; the vDSO has no file. A library
/// ldd cannot find is an error: the image would fail only when started.
fn parse_ldd(binary: &Path, text: &str) -> Result<Vec<PathBuf>, ImageError> {
    let mut paths = Vec::new();
    for line in text.lines().map(str::trim) {
        let path = match line.split_once("=>") {
            Some((name, target)) if target.trim() == "not found" => {
                return Err(ImageError::MissingLibrary {
                    binary: binary.to_path_buf(),
                    library: name.trim().to_owned(),
                });
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

#[cfg(test)]
mod tests {
    use super::*;

    const LDD: &str = "\tlinux-vdso.so.1 (0x00007ffd)\n\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f)\n\t/lib64/ld-linux-x86-64.so.2 (0x00007f)\n";

    #[test]
    fn ldd_output_names_libraries_and_the_loader_but_not_the_vdso() {
        assert_eq!(
            parse_ldd(Path::new("/bin/x"), LDD).expect("test step"),
            [
                PathBuf::from("/lib/x86_64-linux-gnu/libc.so.6"),
                PathBuf::from("/lib64/ld-linux-x86-64.so.2"),
            ]
        );
    }

    #[test]
    fn a_library_ldd_cannot_find_is_an_error_naming_it() {
        let text = format!("{LDD}\tlibmissing.so.1 => not found\n");
        let error = parse_ldd(Path::new("/bin/x"), &text).expect_err("refused");
        assert_eq!(
            error.to_string(),
            "/bin/x loads libmissing.so.1, which ldd cannot find"
        );
    }

    #[test]
    fn paths_that_could_leave_the_root_are_refused() {
        for bad in ["usr/bin/x", "/usr/../etc/passwd", "/usr//x", "/./x", "/"] {
            assert!(
                matches!(image_path(bad), Err(ImageError::BadPath(_))),
                "{bad} accepted"
            );
        }
        assert_eq!(image_path("/usr/bin/x").expect("test step"), "usr/bin/x");
    }

    fn entries(archive: &Path) -> BTreeMap<String, Vec<u8>> {
        let mut tar = tar::Archive::new(std::fs::File::open(archive).expect("test step"));
        tar.entries()
            .expect("test step")
            .map(|entry| {
                let mut entry = entry.expect("test step");
                let path = entry.path().expect("test step").display().to_string();
                let mut bytes = Vec::new();
                std::io::Read::read_to_end(&mut entry, &mut bytes).expect("test step");
                (path, bytes)
            })
            .collect()
    }

    #[test]
    fn the_same_inputs_give_the_same_bytes_and_a_layout_containerd_reads() {
        let dir = tempfile::tempdir().expect("test step");
        let build = |name: &str| {
            Image::new("tessera.local/x:1")
                .file("/usr/bin/x", b"#!x".to_vec(), 0o755)
                .expect("test step")
                .file("/etc/a", b"a".to_vec(), 0o644)
                .expect("test step")
                .entrypoint(&["/usr/bin/x"])
                .env(&["A=1"])
                .label("org.opencontainers.image.version", "1")
                .write_archive(&dir.path().join(name))
                .expect("test step")
        };
        let (one, two) = (build("one.tar"), build("two.tar"));
        assert_eq!(one.manifest_digest, two.manifest_digest);
        assert_eq!(
            std::fs::read(&one.path).expect("test step"),
            std::fs::read(&two.path).expect("test step")
        );

        let files = entries(&one.path);
        let index: serde_json::Value =
            serde_json::from_slice(&files["index.json"]).expect("test step");
        let manifest_ref = &index["manifests"][0];
        assert_eq!(manifest_ref["digest"], one.manifest_digest.as_str());
        assert_eq!(
            manifest_ref["annotations"]["io.containerd.image.name"],
            "tessera.local/x:1"
        );
        let blob = |digest: &str| files[&format!("blobs/{}", digest.replace(':', "/"))].clone();
        let manifest: serde_json::Value =
            serde_json::from_slice(&blob(&one.manifest_digest)).expect("test step");
        let config: serde_json::Value = serde_json::from_slice(&blob(
            manifest["config"]["digest"].as_str().expect("test step"),
        ))
        .expect("test step");
        assert_eq!(config["config"]["Entrypoint"][0], "/usr/bin/x");
        assert_eq!(config["config"]["Env"][0], "A=1");
        // Every blob is named by its own digest.
        for (path, bytes) in &files {
            if let Some(hex) = path.strip_prefix("blobs/sha256/") {
                assert_eq!(digest(bytes), format!("sha256:{hex}"));
            }
        }
        let layer = blob(manifest["layers"][0]["digest"].as_str().expect("test step"));
        let mut tar = tar::Archive::new(layer.as_slice());
        let paths: Vec<String> = tar
            .entries()
            .expect("test step")
            .map(|e| {
                e.expect("test step")
                    .path()
                    .expect("test step")
                    .display()
                    .to_string()
            })
            .collect();
        assert_eq!(paths, ["etc/a", "usr/bin/x"]);
    }

    #[test]
    fn a_binary_comes_with_the_libraries_it_loads() {
        // This test's own executable is dynamically linked against glibc.
        let exe = std::env::current_exe().expect("test step");
        let image = Image::new("x")
            .add_binary(&exe, "/usr/bin/t")
            .expect("test step");
        let paths: Vec<&str> = image.paths().collect();
        assert!(paths.contains(&"usr/bin/t"), "{paths:?}");
        assert!(
            paths.iter().any(|p| p.contains("libc.so")),
            "no libc in {paths:?}"
        );
        assert!(
            paths.iter().any(|p| p.contains("ld-linux")),
            "no loader in {paths:?}"
        );
    }
}
