//! The jobs that travel between the pipeline's threads, and what every thread shares: a
//! leaf module (it imports no other part of the pipeline).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ingest::{Corpus, Engine};
use model::{GenerateParams, Kv};
use retrieval::{Hit, SearchFilter};
use serde::Serialize;
use tokio::sync::mpsc;

use crate::assembly::Assembly;
use crate::error::Error;
use crate::events::{Event, Timings};
use crate::metrics::Metrics;
use crate::supervise::{Faults, Ticket};

/// Whether stored KV is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KvMode {
    /// Load stored KV; prefill (and write back) only what is missing.
    On,
    /// Recompute every chunk's KV now, exactly as ingest computes it (same positions, same
    /// dtype rounding), then assemble identically: for comparison and debugging.
    Off,
}

/// A validated query.
#[derive(Debug, Clone)]
pub struct Query {
    /// The question.
    pub question: String,
    /// Chunks to retrieve.
    pub top_k: usize,
    /// Which documents may be retrieved.
    pub filter: SearchFilter,
    /// Generation options.
    pub params: GenerateParams,
    /// Whether stored KV is used.
    pub kv: KvMode,
    /// How the chunks' KV is assembled.
    pub assembly: Assembly,
}

pub(crate) struct LoadJob {
    /// Admission: given back when the job is dropped, wherever that happens.
    pub ticket: Ticket,
    pub query: Query,
    pub hits: Vec<Hit>,
    pub events: mpsc::Sender<Event>,
    pub arrived: Instant,
    pub timings: Timings,
}

/// A loaded query, ready to join the model's batch.
pub(crate) struct ComputeJob {
    pub job: LoadJob,
    pub chunks: Vec<Loaded>,
    /// The question's tokens in the chat template.
    pub question: Vec<u32>,
    /// Tokens of the whole prompt: prefix, chunks, question.
    pub prompt_tokens: usize,
    pub queued_at: Instant,
}

impl ComputeJob {
    /// Tokens the query's cache holds at most: the prompt and the answer.
    pub fn cache_tokens(&self) -> usize {
        self.prompt_tokens + self.job.query.params.max_tokens + 1
    }
}

/// The system prompt's KV, computed once, and where the model's chat template puts the
/// question.
pub(crate) struct Prefix {
    pub tokens: Vec<u32>,
    pub kv: Kv,
    pub prompt: model::RagPrompt,
}

impl Prefix {
    /// The question's tokens, in the chat template after the chunks.
    pub fn question(&self, corpus: &Corpus, text: &str) -> model::Result<Vec<u32>> {
        corpus
            .model()
            .tokenizer()
            .encode_pieces(&self.prompt.question(text))
    }
}

/// A retrieved chunk, read for assembly.
pub(crate) struct Loaded {
    pub hit: Hit,
    pub tokens: Vec<u32>,
    /// Stored KV, already at the chunk's place in the prompt; `None`: prefill it.
    pub kv: Option<Kv>,
    /// The stored copy failed verification: write the recomputed KV over it.
    pub corrupt: bool,
    /// `kv` is what full prefill computes at the chunk's place: placed first, its copy under
    /// `ingest.exact_first`, or its own KV under `ingest.context = "prompt"`.
    pub exact: bool,
    /// Its note's token offsets, the most moved between its ingest contexts first: read
    /// for `sensitive` only ([`ingest::Corpus::ranked_offsets`]).
    pub ranked: Vec<u16>,
}

/// A chunk's KV to store, computed because it was missing or damaged.
pub(crate) struct Writeback {
    pub doc: String,
    pub hash: String,
    pub tokens: Vec<u32>,
    pub bytes: Vec<u8>,
    /// Under `ingest.exact_first`: the chunk's copy for the first place.
    pub first: Option<Vec<u8>>,
    pub replace: bool,
}

/// What each pipeline thread works with.
pub(crate) struct Worker {
    /// What queries read.
    pub corpus: Arc<Corpus>,
    /// The writer, for write-backs of repaired chunks.
    pub engine: Arc<Engine>,
    /// `serve.cache_dtype`.
    pub cache_dtype: model::DType,
    /// `serve.load_threads`, resolved ([`super::load_threads`]): while the model computes.
    pub load_threads: usize,
    /// The same while the model computes nothing ([`super::idle_load_threads`]).
    pub idle_load_threads: usize,
    /// Chunk KV kept on the model's device (`serve.resident_mb`).
    pub resident: Arc<crate::resident::Resident>,
    pub metrics: Arc<Metrics>,
    pub faults: Arc<Faults>,
}

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Ends a query with `e`: logged with its causes, counted, and told to the client (a fault
/// of the server's own as a generic message, [`Error::public_message`]).
pub(crate) fn finish_err(m: &Metrics, events: &mpsc::Sender<Event>, e: Error) {
    tracing::warn!(error = %e.chain(), kind = ?e.kind(), "query failed");
    m.failed.fetch_add(1, Ordering::Relaxed);
    let _ = events.blocking_send(Event::Error(e.kind(), e.public_message()));
}
