#![deny(missing_docs)]
//! ragkv ingestion: document sources, token-aware chunking, and the pipeline that embeds
//! chunks into the vector index and materializes their KV into the store
//! ([`Engine::ingest`]; the commit order that makes it crash-safe is documented in the
//! pipeline module, `src/pipeline.rs`); re-materialization and garbage collection
//! ([`Engine::rematerialize`], [`Engine::gc`]). What a stored chunk lives in and how its KV is
//! keyed is a [`Corpus`], which the server reads and an [`Engine`] writes.

mod check;
mod chunk;
mod claims;
mod config;
mod context;
mod corpus;
mod error;
mod pipeline;
mod progress;
mod remat;
mod report;
mod source;
mod write_back;

pub use check::CheckReport;
pub use chunk::{chunk_text, Chunk, ChunkerConfig, Tokenize};
pub use config::{Context, IngestConfig, Materialize, RunOptions, Shard, DEFAULT_SYSTEM_PROMPT};
pub use context::{decode_note, decode_ranked, encode_note, ChunkKv, RANKED_MAX};
pub use corpus::{kv_doc, kv_key, split_kv_doc, Corpus, CHUNK_TEMPLATE};
pub use error::{Error, Result};
pub use pipeline::{prefill_groups, Engine};
pub use progress::{Counters, Progress, ProgressMode};
pub use remat::{GcReport, Planned, Reason, RematOptions, RematReport, Scope};
pub use report::{Failure, Report, StageTimes};
pub use source::{read_source, Doc, Item, ReadLimits, Source, CONTENT_HASH_LEN};
