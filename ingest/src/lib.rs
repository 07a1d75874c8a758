#![deny(missing_docs)]
//! ragkv ingestion: document sources, token-aware chunking, and the pipeline that embeds
//! chunks into the vector index and materializes their KV into the store
//! ([`Engine::ingest`]; the commit order that makes it crash-safe is documented in
//! [`pipeline`]); re-materialization and garbage collection ([`Engine::rematerialize`],
//! [`Engine::gc`]).

mod check;
pub mod chunk;
mod claims;
mod config;
mod error;
pub mod pipeline;
pub mod progress;
mod remat;
mod report;
pub mod source;

pub use check::CheckReport;
pub use chunk::{chunk_text, Chunk, ChunkerConfig, Tokenize};
pub use config::{IngestConfig, Materialize, RunOptions, Shard};
pub use error::{Error, Result};
pub use pipeline::{kv_doc, kv_key, prefill_groups, split_kv_doc, Engine, CHUNK_TEMPLATE};
pub use progress::{Counters, Progress, ProgressMode};
pub use remat::{GcReport, Planned, Reason, RematOptions, RematReport, Scope};
pub use report::{Failure, Report, StageTimes};
pub use source::{Doc, Item, Source};
