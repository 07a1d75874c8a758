//! What a query produces: text events, then its final record (citations, KV sources,
//! timings) or a failure with its kind.

use serde::Serialize;

use crate::assembly::Assembly;

/// Where a retrieved chunk's KV came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KvSource {
    /// Read from the store (or the shared tier), verified.
    Stored,
    /// Missing or failed verification: prefilled inline, written back in the background.
    Recomputed,
    /// `kv=off`.
    Off,
    /// Prefilled with the question (`full` assembly).
    Full,
}

impl KvSource {
    /// Served from stored KV.
    pub fn is_stored(self) -> bool {
        self == KvSource::Stored
    }
}

/// One retrieved chunk, as reported to the client.
#[derive(Debug, Clone, Serialize)]
pub struct Citation {
    /// The chunk's document.
    pub doc_id: String,
    /// Its position in the document.
    pub chunk: u32,
    /// Retrieval score (cosine similarity).
    pub score: f32,
    /// Its tokens.
    pub tokens: usize,
    /// Where its KV came from.
    pub kv: KvSource,
}

/// Milliseconds spent in each stage of one query.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Timings {
    /// Embedding the question and searching.
    pub retrieve_ms: f64,
    /// Waiting for the loader and the model (queues).
    pub queue_ms: f64,
    /// Reading, verifying, importing and re-positioning the chunks' stored KV.
    pub load_ms: f64,
    /// The part of `load_ms` during which the model was computing another query.
    pub load_hidden_ms: f64,
    /// Placing the chunks' KV in the query's cache (and any repair).
    pub assemble_ms: f64,
    /// Question prefill up to the first token.
    pub prefill_ms: f64,
    /// From arrival to the first token.
    pub first_token_ms: f64,
    /// From the first token to the last.
    pub decode_ms: f64,
    /// From arrival to the last token.
    pub total_ms: f64,
}

/// The last event of a query.
#[derive(Debug, Clone, Serialize)]
pub struct Final {
    /// The answer's text.
    pub answer: String,
    /// The retrieved chunks, best first.
    pub citations: Vec<Citation>,
    /// Chunks served from stored KV.
    pub kv_hits: usize,
    /// Chunks whose KV was recomputed.
    pub kv_misses: usize,
    /// The assembly strategy used.
    pub assembly: Assembly,
    /// Chunk tokens recomputed with full attention (the strategy's repair).
    pub recomputed_tokens: usize,
    /// Tokens of the assembled prompt (prefix + chunks + question) and of the answer.
    pub prompt_tokens: usize,
    /// Tokens of the answer.
    pub completion_tokens: usize,
    /// `stop`, `length` or `cancelled`.
    pub finish_reason: String,
    /// Time per stage.
    pub timings: Timings,
}

/// Why a query failed; decides the status of a non-streaming answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailKind {
    /// The request cannot be served as asked (400).
    Invalid,
    /// No room now (429).
    Busy,
    /// It did not finish within `request_timeout_ms` (504).
    Timeout,
    /// The pipeline is shutting down or stopped (503).
    Unavailable,
    /// A fault of the server (500).
    Internal,
}

/// What a query's channel receives: text pieces, then one `Done` or `Error`.
#[derive(Debug, Clone)]
pub enum Event {
    /// A piece of the answer's text.
    Token(String),
    /// The query finished.
    Done(Box<Final>),
    /// The query failed, with the kind and a message.
    Error(FailKind, String),
}
