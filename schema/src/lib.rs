#![deny(missing_docs)]
//! Shared types for every ragkv layer: model identity and KV namespaces, the KV tensor layout,
//! token digests, and the location record the KV index stores. No I/O lives here.
//!
//! Everything that is persisted has a versioned binary encoding documented next to its type.

mod fingerprint;
mod layout;
mod location;

pub use fingerprint::{ModelFingerprint, NamespaceId, TokenDigest};
pub use layout::{DType, KvLayout};
pub use location::{Codec, Location, LOCATION_VERSION};

/// Errors from decoding persisted schema records.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum SchemaError {
    /// The record is shorter than its version requires.
    #[error("{what}: record truncated ({got} bytes, need {need})")]
    Truncated {
        /// Which record.
        what: &'static str,
        /// Bytes present.
        got: usize,
        /// Bytes the version needs.
        need: usize,
    },
    /// The record carries a format version this build cannot read.
    #[error("{what}: unsupported format version {version}")]
    UnsupportedVersion {
        /// Which record.
        what: &'static str,
        /// The version byte found.
        version: u8,
    },
    /// A field holds a value outside its domain.
    #[error("{what}: invalid {field} value {value}")]
    InvalidField {
        /// Which record.
        what: &'static str,
        /// Which field.
        field: &'static str,
        /// The value found.
        value: u64,
    },
}

/// The project cache (models, ONNX Runtime, wheels): `$RAGKV_CACHE`, else `~/.cache/ragkv`,
/// else `.ragkv-cache` in the working directory. Never inside the repository by default.
pub fn cache_dir() -> std::path::PathBuf {
    std::env::var_os("RAGKV_CACHE")
        .filter(|d| !d.is_empty())
        .map(std::path::PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache/ragkv"))
        })
        .unwrap_or_else(|| std::path::PathBuf::from(".ragkv-cache"))
}
