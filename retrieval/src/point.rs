//! What a point in the vector index carries, and how its id is derived.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The payload every ragkv point carries. Field names are the payload keys in Qdrant; `doc_id`
/// has a keyword index so that filtering and deleting by document are index lookups.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChunkPayload {
    /// Stable document id (given by the source, or the path relative to the source root).
    pub doc_id: String,
    /// Position of the chunk within its document, from 0.
    pub ordinal: u32,
    /// The chunk's text as the model sees it.
    pub text: String,
    /// Number of model tokens in the chunk.
    pub tokens: u32,
    /// Key of the chunk's KV in the store (hex), empty when not materialized.
    pub kv_key: String,
    /// Content hash of the document version this chunk belongs to (hex).
    #[serde(default)]
    pub doc_hash: String,
    /// Number of chunks of that document version (a version is complete when all are there).
    #[serde(default)]
    pub doc_chunks: u32,
    /// Free-form string metadata from the source; filterable as `metadata.<key>`.
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub metadata: serde_json::Map<String, serde_json::Value>,
}

/// A point to upsert: its id, its embedding and its payload.
#[derive(Debug, Clone, PartialEq)]
pub struct ChunkPoint {
    /// The point's id (derived from the chunk, [`point_id`]).
    pub id: Uuid,
    /// The chunk's embedding.
    pub vector: Vec<f32>,
    /// What the point describes.
    pub payload: ChunkPayload,
}

impl ChunkPoint {
    /// A point whose id is derived from the chunk's identity (see [`point_id`]).
    pub fn new(vector: Vec<f32>, payload: ChunkPayload) -> ChunkPoint {
        ChunkPoint {
            id: point_id(&payload.doc_id, payload.ordinal),
            vector,
            payload,
        }
    }
}

/// One search result.
#[derive(Debug, Clone, PartialEq)]
pub struct Hit {
    /// The point's id.
    pub id: Uuid,
    /// Cosine similarity (higher is closer).
    pub score: f32,
    /// The chunk it names.
    pub payload: ChunkPayload,
}

/// Restricts a search: every given condition must hold.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SearchFilter {
    /// Only chunks of these documents (any of them); empty means all documents.
    pub doc_ids: Vec<String>,
    /// `metadata.<key>` must equal the value, for every pair.
    pub metadata: Vec<(String, String)>,
}

impl SearchFilter {
    /// Only chunks of one document.
    pub fn document(doc_id: impl Into<String>) -> SearchFilter {
        SearchFilter {
            doc_ids: vec![doc_id.into()],
            metadata: Vec::new(),
        }
    }

    /// Whether it lets every chunk through.
    pub fn is_empty(&self) -> bool {
        self.doc_ids.is_empty() && self.metadata.is_empty()
    }
}

/// Namespace of ragkv point ids (UUID v5-style: blake3 of this tag, the document id and ordinal).
const POINT_ID_TAG: &[u8] = b"ragkv.point.v1";

/// The point id of chunk `ordinal` of document `doc_id`: deterministic, so re-running an
/// interrupted ingest overwrites the same points instead of duplicating them.
pub fn point_id(doc_id: &str, ordinal: u32) -> Uuid {
    let mut h = blake3::Hasher::new();
    h.update(POINT_ID_TAG);
    h.update(&(doc_id.len() as u64).to_le_bytes());
    h.update(doc_id.as_bytes());
    h.update(&ordinal.to_le_bytes());
    let mut b = [0u8; 16];
    b.copy_from_slice(&h.finalize().as_bytes()[..16]);
    // Mark as an RFC 4122 variant, version 8 (custom), so the UUID is well-formed.
    b[6] = (b[6] & 0x0f) | 0x80;
    b[8] = (b[8] & 0x3f) | 0x80;
    Uuid::from_bytes(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn point_ids_are_stable_and_distinct() {
        assert_eq!(point_id("a", 0), point_id("a", 0));
        assert_ne!(point_id("a", 0), point_id("a", 1));
        assert_ne!(point_id("a", 1), point_id("b", 1));
        // Length prefix: ("ab", n) and ("a", n') never collide by concatenation.
        assert_ne!(point_id("ab", 0), point_id("a", 0x62));
        assert_eq!(point_id("a", 0).get_version_num(), 8);
    }

    #[test]
    fn payload_round_trips_through_json() {
        let mut metadata = serde_json::Map::new();
        metadata.insert("lang".into(), "en".into());
        let p = ChunkPayload {
            doc_id: "docs/a.md".into(),
            ordinal: 3,
            text: "hello".into(),
            tokens: 2,
            kv_key: "00ff".into(),
            doc_hash: "ab".into(),
            doc_chunks: 4,
            metadata,
        };
        let v = serde_json::to_value(&p).unwrap();
        assert_eq!(v["doc_id"], "docs/a.md");
        assert_eq!(serde_json::from_value::<ChunkPayload>(v).unwrap(), p);
    }
}
