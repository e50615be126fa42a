//! The plugin's checkpoint on disk: every prepared claim, written whole and
//! atomically (a temporary file in the same directory, synced, then renamed over
//! the old one), so a plugin restart, a crash mid-write or a node reboot finds
//! either the old book or the new one, never half of one.

use std::io::Write;
use std::path::{Path, PathBuf};

use tessera_api::dra::prepared::PreparedClaims;

/// Why the checkpoint could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a checkpoint this build reads.
    #[error("{path}: {problem}")]
    Format {
        /// The file.
        path: PathBuf,
        /// Why.
        problem: String,
    },
}

/// The checkpoint file.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    path: PathBuf,
}

impl Checkpoint {
    /// The checkpoint at `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The claims recorded; none when the file does not exist yet. An unreadable
    /// file is an error, never an empty book: claims kubelet still counts as
    /// prepared would be lost.
    pub fn load(&self) -> Result<PreparedClaims, StoreError> {
        match std::fs::read_to_string(&self.path) {
            Ok(text) => PreparedClaims::parse(&text).map_err(|problem| StoreError::Format {
                path: self.path.clone(),
                problem,
            }),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(PreparedClaims::new()),
            Err(source) => Err(StoreError::Io {
                path: self.path.clone(),
                source,
            }),
        }
    }

    /// Replaces the file with `claims`.
    pub fn save(&self, claims: &PreparedClaims) -> Result<(), StoreError> {
        let io = |source| StoreError::Io {
            path: self.path.clone(),
            source,
        };
        let dir = self.path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(io)?;
        let (temp, mut file) = tempfile_in(dir).map_err(io)?;
        let written = file
            .write_all(claims.to_json().as_bytes())
            .and_then(|()| file.sync_all())
            .and_then(|()| std::fs::rename(&temp, &self.path));
        if let Err(error) = written {
            let _ = std::fs::remove_file(&temp);
            return Err(io(error));
        }
        // The rename itself is made durable with the directory.
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io)?;
        Ok(())
    }
}

/// A new file beside the checkpoint, named for this process.
fn tempfile_in(dir: &Path) -> std::io::Result<(PathBuf, std::fs::File)> {
    let path = dir.join(format!(".claims.json.{}.tmp", std::process::id()));
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)?;
    Ok((path, file))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_api::dra::prepared::PreparedClaim;

    #[test]
    fn saves_and_loads_and_a_missing_file_is_an_empty_book() {
        let dir = tempfile::tempdir().expect("tempdir");
        let checkpoint = Checkpoint::new(dir.path().join("sub").join("claims.json"));
        assert_eq!(checkpoint.load().expect("missing"), PreparedClaims::new());
        let mut claims = PreparedClaims::new();
        claims.claims.insert(
            "u1".into(),
            PreparedClaim {
                namespace: "ns".into(),
                name: "c".into(),
                uid: "u1".into(),
                ..PreparedClaim::default()
            },
        );
        checkpoint.save(&claims).expect("saved");
        assert_eq!(checkpoint.load().expect("read"), claims);
        let leftovers: Vec<_> = std::fs::read_dir(dir.path().join("sub"))
            .expect("dir")
            .filter_map(Result::ok)
            .map(|e| e.file_name())
            .collect();
        assert_eq!(leftovers.len(), 1, "{leftovers:?}");
    }

    #[test]
    fn a_corrupt_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("claims.json");
        std::fs::write(&path, "{\"version\":1,").expect("write");
        let error = Checkpoint::new(&path).load().expect_err("corrupt");
        assert!(error.to_string().contains("claims.json"), "{error}");
    }
}
