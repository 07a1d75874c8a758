//! The ingest crate's one error type.

/// Errors that stop an ingest run (bad documents do not: they are reported and skipped).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The KV store failed.
    #[error(transparent)]
    Store(#[from] kvstore::Error),
    /// The shared KV tier failed.
    #[error(transparent)]
    Remote(#[from] remote::Error),
    /// The embedder or the vector index failed.
    #[error(transparent)]
    Retrieval(#[from] retrieval::Error),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] model::Error),
    /// Bad options or arguments.
    #[error("invalid {what}: {why}")]
    Invalid {
        /// The option or argument.
        what: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// File-system I/O failed.
    #[error("{what}: {cause}")]
    Io {
        /// What was being read or written.
        what: String,
        /// The I/O error.
        cause: std::io::Error,
    },
}

/// Shorthand for this crate's results.
pub type Result<T, E = Error> = std::result::Result<T, E>;
