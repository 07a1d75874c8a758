#![deny(missing_docs)]
//! ragkv retrieval: text embeddings ([`Embedder`], fastembed on a dynamically loaded ONNX
//! Runtime) and the vector index ([`VectorIndex`], Qdrant: embedded Qdrant Edge by default, a
//! remote server or cluster when a URL is configured).
//!
//! Both are blocking: the ingest pipeline calls them from its worker threads, the server from
//! `spawn_blocking`.

mod embed;
mod error;
mod index;
mod point;

pub use embed::{cache_dir, find_onnxruntime, normalize, Embedder, EmbedderConfig, ORT_ENV};
pub use error::{Error, Result};
pub use index::{EdgeIndex, IndexConfig, IndexInfo, RemoteIndex, VectorIndex, DOC_ID_FIELD};
pub use point::{point_id, ChunkPayload, ChunkPoint, Hit, SearchFilter};
