//! What an ingest run did.

use std::time::Duration;

use serde::Serialize;

/// Time one pipeline stage spent working (not waiting on its queues).
#[derive(Debug, Clone, Default, Serialize)]
pub struct StageTimes {
    /// Reading sources.
    pub read_s: f64,
    /// Chunking and tokenizing.
    pub chunk_s: f64,
    /// Embedding.
    pub embed_s: f64,
    /// Prefilling chunk KV.
    pub prefill_s: f64,
    /// Writing KV to the store (and the shared tier).
    pub write_kv_s: f64,
    /// Upserting points into the index.
    pub upsert_s: f64,
}

/// One document that failed or was skipped, with the reason.
#[derive(Debug, Clone, Serialize)]
pub struct Failure {
    /// Document id, or the file/line it would have come from.
    pub origin: String,
    /// What went wrong.
    pub reason: String,
}

/// The final report of a run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    /// Documents indexed for the first time.
    pub docs_new: usize,
    /// Documents already indexed with the same content.
    pub docs_unchanged: usize,
    /// Documents whose content changed, re-indexed.
    pub docs_replaced: usize,
    /// Documents pruned (`prune`).
    pub docs_deleted: usize,
    /// Documents that could not be ingested (bad input or a failing stage).
    pub docs_failed: usize,
    /// Chunks written (new and replaced documents).
    pub chunks: usize,
    /// Model tokens in those chunks.
    pub tokens: usize,
    /// Chunks prefilled now (the rest were stored already, or not materialized).
    pub chunks_prefilled: usize,
    /// Tokens prefilled now.
    pub tokens_prefilled: usize,
    /// Tokens prefilled beside those as their context (`ingest.context`: the neighbours, and
    /// under `mean:N` the chunk again in each context after the first; computed, not
    /// stored): the extra cost of neighbour materialization.
    #[serde(default)]
    pub context_tokens_prefilled: usize,
    /// KV bytes appended to the tensor log.
    pub kv_bytes: u64,
    /// Orphaned KV (left by an interrupted earlier run) removed.
    pub orphans_removed: usize,
    /// Documents read but left to other shards (`--shard`).
    pub docs_other_shards: usize,
    /// Wall time of the run.
    pub elapsed_s: f64,
    /// Time per stage.
    pub stages: StageTimes,
    /// Documents that failed or were skipped.
    pub failures: Vec<Failure>,
}

impl Report {
    /// Whether anything failed (the command's exit status).
    pub fn ok(&self) -> bool {
        self.docs_failed == 0
    }

    /// A short human summary.
    pub fn summary(&self) -> String {
        let s = &self.stages;
        let rate = if self.elapsed_s > 0.0 {
            self.tokens_prefilled as f64 / self.elapsed_s
        } else {
            0.0
        };
        format!(
            "documents: {} new, {} unchanged, {} replaced, {} deleted, {} failed\n\
             chunks: {} ({} tokens), prefilled {} ({} tokens, {rate:.0} tokens/s{}), KV written {:.1} MiB\n\
             time: {:.1} s (read {:.1}, chunk {:.1}, embed {:.1}, prefill {:.1}, write KV {:.1}, upsert {:.1})",
            self.docs_new,
            self.docs_unchanged,
            self.docs_replaced,
            self.docs_deleted,
            self.docs_failed,
            self.chunks,
            self.tokens,
            self.chunks_prefilled,
            self.tokens_prefilled,
            match self.context_tokens_prefilled {
                0 => String::new(),
                n => format!(", after {n} tokens of context"),
            },
            self.kv_bytes as f64 / (1u64 << 20) as f64,
            self.elapsed_s,
            s.read_s,
            s.chunk_s,
            s.embed_s,
            s.prefill_s,
            s.write_kv_s,
            s.upsert_s,
        )
    }
}

pub(crate) fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}
