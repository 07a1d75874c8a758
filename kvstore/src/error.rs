//! The kvstore's error type.

use std::path::PathBuf;

/// Everything that can go wrong in the store. Variants carry the facts an operator needs.
///
/// [`Error::is_miss`] separates "this KV cannot be served, recompute it" (a miss, possibly with
/// a reason worth logging) from failures of the store itself.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// File-system I/O failed; the message names the file.
    #[error(transparent)]
    Io(#[from] std::io::Error),

    /// The RocksDB index failed.
    #[error("index ({op}): {cause}")]
    Index {
        /// The index operation.
        op: &'static str,
        /// RocksDB's error.
        cause: rocksdb::Error,
    },

    /// A persisted record could not be decoded.
    #[error("{context}: {cause}")]
    Schema {
        /// Which record, where.
        context: String,
        /// The decoding error.
        cause: schema::SchemaError,
    },

    /// A tensor-log record failed verification: the payload or header checksum, the key or
    /// the token digest did not match. The KV is not returned; treat it as a miss.
    #[error("corrupt record in segment {segment} at offset {offset}: {what}")]
    Corrupt {
        /// Segment file id.
        segment: u64,
        /// Byte offset of the record.
        offset: u64,
        /// What failed to verify.
        what: String,
    },

    /// An index entry points into a segment file that no longer exists.
    #[error("segment {segment} is missing ({path})")]
    SegmentMissing {
        /// Segment file id.
        segment: u64,
        /// Where the file should be.
        path: PathBuf,
    },

    /// The requested prefix is not (fully) cached.
    #[error("not cached: {cached} of {requested} tokens are stored")]
    Miss {
        /// Tokens asked for.
        requested: usize,
        /// Tokens of the longest stored prefix.
        cached: usize,
    },

    /// The caller's KV bytes do not match the layout and token count.
    #[error("kv has {got} bytes, layout {layout} needs {expected} for {tokens} tokens")]
    KvSize {
        /// Bytes passed.
        got: usize,
        /// Bytes the layout needs.
        expected: usize,
        /// Tokens passed.
        tokens: usize,
        /// The layout passed.
        layout: schema::KvLayout,
    },

    /// The namespace stores a different KV layout than the caller passed.
    #[error("namespace {ns} stores layout {stored}, caller passed {given}")]
    LayoutMismatch {
        /// The namespace.
        ns: schema::NamespaceId,
        /// Its layout.
        stored: schema::KvLayout,
        /// The caller's.
        given: schema::KvLayout,
    },

    /// Invalid options or arguments.
    #[error("invalid {what}: {why}")]
    Invalid {
        /// The option or argument.
        what: &'static str,
        /// What is wrong with it.
        why: String,
    },

    /// A write would leave less than `min_free_bytes` free on the file system.
    #[error(
        "disk nearly full: {path} has {free} bytes free, a write of {needed} would go below the \
         reserve of {reserve} (kvstore min_free_bytes): free space, then run again"
    )]
    DiskFull {
        /// The store's directory.
        path: std::path::PathBuf,
        /// Bytes free on its file system.
        free: u64,
        /// Bytes the write needs.
        needed: u64,
        /// `min_free_bytes`.
        reserve: u64,
    },

    /// A write would take its namespace group over its byte quota (after any eviction the
    /// capacity policy allows).
    #[error(
        "quota of group {group:?} exceeded: {used} of {quota} bytes used, write needs {needed}"
    )]
    QuotaExceeded {
        /// The namespace group.
        group: String,
        /// Bytes it holds.
        used: u64,
        /// Its quota.
        quota: u64,
        /// Bytes the write needs.
        needed: u64,
    },

    /// Another process holds the store's lock.
    #[error("data directory {path} is locked by another process ({holder})")]
    Locked {
        /// The lock file.
        path: PathBuf,
        /// Who holds it (from the lock file).
        holder: String,
    },

    /// A background worker panicked; the store refuses further writes rather than risk
    /// corrupting data.
    #[error("store poisoned: {0}")]
    Poisoned(String),
}

impl Error {
    /// A miss because stored data failed verification or its segment is gone (a part of
    /// [`Error::is_miss`]): the index entry exists, so writing the sequence again must
    /// replace it, not skip it as present.
    pub fn is_damage(&self) -> bool {
        matches!(self, Error::Corrupt { .. } | Error::SegmentMissing { .. })
    }

    /// True when the error means "serve this KV by recomputing it": a miss, a corrupt record or
    /// a missing segment. Anything else is a failure of the store itself.
    pub fn is_miss(&self) -> bool {
        matches!(
            self,
            Error::Miss { .. } | Error::Corrupt { .. } | Error::SegmentMissing { .. }
        )
    }

    pub(crate) fn index(op: &'static str) -> impl FnOnce(rocksdb::Error) -> Error {
        move |cause| Error::Index { op, cause }
    }

    pub(crate) fn schema(context: impl Into<String>) -> impl FnOnce(schema::SchemaError) -> Error {
        let context = context.into();
        move |cause| Error::Schema { context, cause }
    }
}

/// Result alias for the store.
pub type Result<T, E = Error> = std::result::Result<T, E>;
