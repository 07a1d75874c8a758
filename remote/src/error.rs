//! The remote tier's errors: each names the object or setting it is about.

/// What went wrong in the remote tier.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A setting is missing or unusable (named as in the `[remote]` config section).
    #[error("remote.{what}: {why}")]
    Config {
        /// The setting.
        what: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// The caller passed something the tier cannot store.
    #[error("remote tier: {why}")]
    Input {
        /// What is wrong with it.
        why: String,
    },
    /// The object store refused or failed an operation (after its retries).
    #[error("remote tier: {op} {key}")]
    Store {
        /// The operation (`get`, `put`, `list`, `delete`).
        op: &'static str,
        /// The object's key.
        key: String,
        /// The object store's error.
        #[source]
        source: Box<object_store::Error>,
    },
    /// An object or manifest that does not verify.
    #[error("remote tier: {key} is corrupt: {why}")]
    Corrupt {
        /// The object's key.
        key: String,
        /// What did not verify.
        why: String,
    },
    /// An operation ran past `remote.timeout_ms` (retries included).
    #[error("remote tier: {op} {key} timed out after {ms} ms")]
    Timeout {
        /// The operation.
        op: &'static str,
        /// The object's key (or prefix).
        key: String,
        /// The limit that passed.
        ms: u64,
    },
    /// The tier's I/O threads could not start.
    #[error("remote tier: starting its I/O threads")]
    Runtime(#[source] std::io::Error),
}

/// The tier's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
