//! The remote tier's errors: each names the object or setting it is about.

/// What went wrong in the remote tier.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A setting is missing or unusable (named as in the `[remote]` config section).
    #[error("remote.{what}: {why}")]
    Config { what: &'static str, why: String },
    /// The caller passed something the tier cannot store.
    #[error("remote tier: {why}")]
    Input { why: String },
    /// The object store refused or failed an operation (after its retries).
    #[error("remote tier: {op} {key}: {source}")]
    Store {
        op: &'static str,
        key: String,
        #[source]
        source: Box<object_store::Error>,
    },
    /// An object or manifest that does not verify.
    #[error("remote tier: {key} is corrupt: {why}")]
    Corrupt { key: String, why: String },
    /// An operation ran past `remote.timeout_ms` (retries included).
    #[error("remote tier: {op} {key} timed out after {ms} ms")]
    Timeout {
        op: &'static str,
        key: String,
        ms: u64,
    },
    /// The tier's I/O threads could not start.
    #[error("remote tier: starting its I/O threads: {0}")]
    Runtime(#[source] std::io::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
