//! The vector index: one API over two Qdrant backends.
//!
//! - **Embedded** (default): Qdrant Edge in-process, persistent under the data directory. It has
//!   no background optimizer, so the index builds its HNSW graph by calling `optimize()` once
//!   `optimize_after` points have been written since the last build, and whenever the caller
//!   says a bulk load ended ([`VectorIndex::optimize`]). One process per directory.
//! - **Remote**: a Qdrant server or cluster through `qdrant-client` (gRPC), chosen by setting
//!   `url`. The collection is created with the right dimension and cosine distance when absent;
//!   transient failures are retried with exponential backoff.
//!
//! Every method blocks: call from a worker thread or `spawn_blocking`, not from an async task.

mod edge;
mod remote;

use std::path::Path;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::point::{ChunkPayload, ChunkPoint, Hit, SearchFilter};

pub use edge::EdgeIndex;
pub use remote::RemoteIndex;

/// Payload field with a keyword index: the document id.
pub const DOC_ID_FIELD: &str = "doc_id";

/// `[index]` configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IndexConfig {
    /// Qdrant server URL for the remote backend (gRPC port, e.g. `http://localhost:6334`;
    /// `https://` for TLS). Empty: the embedded backend.
    pub url: String,
    /// API key for the remote server. Empty: `$QDRANT_API_KEY` if set, else none.
    pub api_key: String,
    /// Remote collection name.
    pub collection: String,
    /// Remote request timeout, milliseconds.
    pub timeout_ms: u64,
    /// Remote retries for transient failures (unavailable, deadline, resource exhausted).
    pub retries: u32,
    /// Points per remote upsert request.
    pub upsert_batch: usize,
    /// Embedded: build the HNSW index once this many points were written since the last build.
    pub optimize_after: usize,
    /// HNSW `ef` at search time (0: Qdrant's default).
    pub hnsw_ef: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            url: String::new(),
            api_key: String::new(),
            collection: "ragkv".into(),
            timeout_ms: 10_000,
            retries: 5,
            upsert_batch: 256,
            optimize_after: 20_000,
            hnsw_ef: 0,
        }
    }
}

impl IndexConfig {
    /// Checks ranges; the error names the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |what, reason: String| Err(Error::Invalid { what, reason });
        let scheme_ok = self.url.starts_with("http://") || self.url.starts_with("https://");
        if !self.url.is_empty() && !scheme_ok {
            return bad(
                "index.url",
                format!("{:?} must start with http:// or https://", self.url),
            );
        }
        if self.collection.is_empty()
            || !self
                .collection
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            return bad(
                "index.collection",
                format!("{:?}: use letters, digits, _ and -", self.collection),
            );
        }
        if self.timeout_ms == 0 {
            return bad("index.timeout_ms", "must be positive".into());
        }
        if !(1..=10_000).contains(&self.upsert_batch) {
            return bad(
                "index.upsert_batch",
                format!("{} is outside 1..=10000", self.upsert_batch),
            );
        }
        if self.optimize_after == 0 {
            return bad("index.optimize_after", "must be positive".into());
        }
        Ok(())
    }

    /// Whether this configuration selects the remote backend.
    pub fn is_remote(&self) -> bool {
        !self.url.is_empty()
    }
}

/// Counts describing the index.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct IndexInfo {
    /// `embedded` or `remote`.
    pub backend: &'static str,
    /// Vector dimension.
    pub dim: usize,
    /// Points stored (approximate for the embedded backend until optimized).
    pub points: usize,
    /// Points covered by an HNSW index (the rest are searched by brute force).
    pub indexed: usize,
    /// Storage segments.
    pub segments: usize,
}

/// The vector index (see the module documentation). One per process: the size difference
/// between the variants does not matter.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub enum VectorIndex {
    /// A Qdrant Edge shard in the data directory.
    Embedded(EdgeIndex),
    /// A collection of a Qdrant server.
    Remote(RemoteIndex),
}

impl VectorIndex {
    /// Opens (creating if absent) the index for `dim`-dimensional vectors: embedded under
    /// `dir`, or remote when `config.url` is set. An existing index with another dimension is
    /// an [`Error::Dimension`].
    pub fn open(dir: &Path, dim: usize, config: &IndexConfig) -> Result<VectorIndex> {
        config.validate()?;
        if dim == 0 {
            return Err(Error::Invalid {
                what: "vector dimension",
                reason: "must be positive".into(),
            });
        }
        if config.is_remote() {
            Ok(VectorIndex::Remote(RemoteIndex::open(dim, config)?))
        } else {
            Ok(VectorIndex::Embedded(EdgeIndex::open(dir, dim, config)?))
        }
    }

    /// Dimension of the vectors this index holds.
    pub fn dim(&self) -> usize {
        match self {
            VectorIndex::Embedded(i) => i.dim(),
            VectorIndex::Remote(i) => i.dim(),
        }
    }

    /// Inserts or replaces points (by id). Every vector must have the index's dimension.
    pub fn upsert(&self, points: &[ChunkPoint]) -> Result<()> {
        check_dims(self.dim(), points.iter().map(|p| p.vector.len()))?;
        match self {
            VectorIndex::Embedded(i) => i.upsert(points),
            VectorIndex::Remote(i) => i.upsert(points),
        }
    }

    /// The `k` nearest chunks to `vector` (cosine), best first, among those `filter` admits.
    pub fn search(&self, vector: &[f32], k: usize, filter: &SearchFilter) -> Result<Vec<Hit>> {
        check_dims(self.dim(), [vector.len()])?;
        if k == 0 {
            return Ok(Vec::new());
        }
        match self {
            VectorIndex::Embedded(i) => i.search(vector, k, filter),
            VectorIndex::Remote(i) => i.search(vector, k, filter),
        }
    }

    /// Every chunk of `doc_id`, by ordinal.
    pub fn document(&self, doc_id: &str) -> Result<Vec<(Uuid, ChunkPayload)>> {
        let mut v = match self {
            VectorIndex::Embedded(i) => i.scroll(&SearchFilter::document(doc_id))?,
            VectorIndex::Remote(i) => i.scroll(&SearchFilter::document(doc_id))?,
        };
        v.sort_by_key(|(_, p)| p.ordinal);
        Ok(v)
    }

    /// Every point's id and payload (a full scan).
    pub fn points(&self) -> Result<Vec<(Uuid, ChunkPayload)>> {
        match self {
            VectorIndex::Embedded(i) => i.scroll(&SearchFilter::default()),
            VectorIndex::Remote(i) => i.scroll(&SearchFilter::default()),
        }
    }

    /// Removes every point of `doc_id`.
    pub fn delete_document(&self, doc_id: &str) -> Result<()> {
        match self {
            VectorIndex::Embedded(i) => i.delete_document(doc_id),
            VectorIndex::Remote(i) => i.delete_document(doc_id),
        }
    }

    /// Removes points by id (absent ids are ignored).
    pub fn delete_points(&self, ids: &[Uuid]) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        match self {
            VectorIndex::Embedded(i) => i.delete_points(ids),
            VectorIndex::Remote(i) => i.delete_points(ids),
        }
    }

    /// Exact number of points `filter` admits.
    pub fn count(&self, filter: &SearchFilter) -> Result<usize> {
        match self {
            VectorIndex::Embedded(i) => i.count(filter),
            VectorIndex::Remote(i) => i.count(filter),
        }
    }

    /// Makes everything written so far durable.
    pub fn flush(&self) -> Result<()> {
        match self {
            VectorIndex::Embedded(i) => i.flush(),
            VectorIndex::Remote(_) => Ok(()), // the server acknowledges writes with wait=true
        }
    }

    /// Builds indexes now (after a bulk load). Returns whether anything was rebuilt. The remote
    /// server optimizes on its own: a no-op there.
    pub fn optimize(&self) -> Result<bool> {
        match self {
            VectorIndex::Embedded(i) => i.optimize(),
            VectorIndex::Remote(_) => Ok(false),
        }
    }

    /// Deletes a server's collection with every point in it (a benchmark's scratch
    /// collection). The embedded index is a directory: an [`Error::Invalid`]; remove that.
    pub fn delete_collection(self) -> Result<()> {
        match self {
            VectorIndex::Embedded(_) => Err(Error::Invalid {
                what: "delete_collection",
                reason: "the embedded index is a directory: remove it instead".into(),
            }),
            VectorIndex::Remote(i) => i.delete_collection(),
        }
    }

    /// Counts describing the index.
    pub fn info(&self) -> Result<IndexInfo> {
        match self {
            VectorIndex::Embedded(i) => Ok(i.info()),
            VectorIndex::Remote(i) => i.info(),
        }
    }
}

fn check_dims(expected: usize, got: impl IntoIterator<Item = usize>) -> Result<()> {
    for got in got {
        if got != expected {
            return Err(Error::Dimension { expected, got });
        }
    }
    Ok(())
}

/// Payload JSON of a point.
fn payload_json(p: &ChunkPayload) -> serde_json::Value {
    serde_json::to_value(p).expect("ChunkPayload serializes")
}

/// A stored payload back as a [`ChunkPayload`].
fn payload_from(
    id: &Uuid,
    map: serde_json::Map<String, serde_json::Value>,
) -> Result<ChunkPayload> {
    serde_json::from_value(serde_json::Value::Object(map)).map_err(|e| Error::Payload {
        id: id.to_string(),
        reason: e.to_string(),
    })
}

/// Payload key of a metadata filter, checked so it cannot address other fields.
fn metadata_key(key: &str) -> Result<String> {
    if key.is_empty()
        || !key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        return Err(Error::Invalid {
            what: "metadata filter key",
            reason: format!("{key:?}: use letters, digits, _ and -"),
        });
    }
    Ok(format!("metadata.{key}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_is_validated() {
        assert!(IndexConfig::default().validate().is_ok());
        let c = IndexConfig {
            url: "localhost:6334".into(),
            ..IndexConfig::default()
        };
        assert!(c.validate().unwrap_err().to_string().contains("index.url"));
        let c = IndexConfig {
            collection: "a b".into(),
            ..IndexConfig::default()
        };
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("index.collection"));
    }

    #[test]
    fn metadata_keys_cannot_escape_the_metadata_object() {
        assert_eq!(metadata_key("lang").unwrap(), "metadata.lang");
        assert!(metadata_key("a.b").is_err());
        assert!(metadata_key("").is_err());
        assert!(metadata_key("doc_id\"").is_err());
    }
}
