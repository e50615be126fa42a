//! NVML loaded the one way every daemon loads it: from the library a flag names
//! (`--nvml-library`, a file name the loader searches or a path), telling a library
//! that does not load from a driver that does not answer.

use std::path::Path;

pub use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;

/// NVML could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum NvmlOpenError {
    /// The library is not there, or lacks NVML's symbols.
    #[error("loading NVML from {library}")]
    Library {
        /// The library as given.
        library: String,
        /// What the loader said.
        #[source]
        source: NvmlError,
    },
    /// The library loaded but NVML did not initialise (no kernel driver, say).
    #[error("initialising NVML from {library}")]
    Init {
        /// The library as given.
        library: String,
        /// What NVML said.
        #[source]
        source: NvmlError,
    },
}

impl NvmlOpenError {
    /// What NVML or the loader said.
    pub fn nvml_error(&self) -> &NvmlError {
        match self {
            Self::Library { source, .. } | Self::Init { source, .. } => source,
        }
    }
}

/// Loads NVML from `library` and initialises it.
pub fn open(library: &Path) -> Result<Nvml, NvmlOpenError> {
    let name = || library.display().to_string();
    Nvml::builder()
        .lib_path(library.as_os_str())
        .init()
        .map_err(|source| match source {
            NvmlError::LibloadingError(_) | NvmlError::FailedToLoadSymbol(_) => {
                NvmlOpenError::Library {
                    library: name(),
                    source,
                }
            }
            other => NvmlOpenError::Init {
                library: name(),
                source: other,
            },
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_library_that_is_not_there_is_named() {
        let error = open(Path::new("/nonexistent/libnvidia-ml.so.1")).expect_err("no library");
        assert!(matches!(error, NvmlOpenError::Library { .. }), "{error:?}");
        assert_eq!(
            error.to_string(),
            "loading NVML from /nonexistent/libnvidia-ml.so.1"
        );
    }
}
