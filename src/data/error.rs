//! Errors of the indexed dataset reader and writer.

use std::path::PathBuf;

/// What can be wrong with a `.bin`/`.idx` pair, or with writing one.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    /// A file could not be opened, read, written or renamed.
    #[error("{}: {cause}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        cause: std::io::Error,
    },
    /// The `.idx` is not a valid Megatron index (or does not fit its `.bin`).
    #[error("{}: {reason}", path.display())]
    Corrupt {
        /// The file found wrong.
        path: PathBuf,
        /// What was expected and what was found.
        reason: String,
    },
    /// The index is valid but of a kind ferrotron does not handle.
    #[error("{}: {reason}", path.display())]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A request outside the dataset (a document or sequence number too large, ...).
    #[error("{0}")]
    OutOfRange(String),
    /// Datasets that cannot be combined or a token that does not fit the dtype.
    #[error("{0}")]
    Mismatch(String),
}

impl DatasetError {
    /// Wraps an I/O error with the path it happened on.
    pub fn io(path: impl Into<PathBuf>, cause: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            cause,
        }
    }
}
