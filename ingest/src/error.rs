//! The ingest crate's one error type.

/// Errors that stop an ingest run (bad documents do not: they are reported and skipped).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("KV store: {0}")]
    Store(#[from] kvstore::Error),
    #[error(transparent)]
    Remote(#[from] remote::Error),
    #[error("retrieval: {0}")]
    Retrieval(#[from] retrieval::Error),
    #[error("model: {0}")]
    Model(#[from] model::Error),
    #[error("invalid {what}: {why}")]
    Invalid { what: &'static str, why: String },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

/// Shorthand for this crate's results.
pub type Result<T, E = Error> = std::result::Result<T, E>;
