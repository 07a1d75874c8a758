//! The ingest pipeline.
//!
//! Stages run on named threads joined by bounded queues, so the slowest stage (prefill) sets
//! the pace and the others overlap with it:
//!
//! ```text
//! read ─▶ plan+chunk ─▶ embed ─▶ prefill (model) ─▶ write
//!  (sources)   (index lookup,     (ONNX)    (KV per chunk)   (KV puts as they come;
//!               skip unchanged)                               vectors last, per document)
//! ```
//!
//! # Commit order (crash safety)
//! For a document `D` whose content hash is `H`:
//! 1. every chunk's KV is stored and attached to the KV-store document `D@H` (synced per the
//!    store's policy); with a shared tier (`remote.write`), each chunk's object and reference
//!    marker too, then `D@H`'s manifest ([`remote`]);
//! 2. all of `D`'s points are upserted in one index operation (atomic through Qdrant's WAL),
//!    each carrying `doc_hash = H` and `doc_chunks`: from here `D` is searchable;
//! 3. points of an older version that the new one does not overwrite are deleted, then the
//!    older versions' KV documents `D@H0` are detached (their blocks freed unless shared),
//!    and released on the shared tier.
//!
//! A crash before 2 leaves KV that no point references; a crash inside 3 leaves stale points or
//! KV. The next run treats a document as unchanged only if all of its points carry `H`, their
//! ordinals are exactly `0..doc_chunks`, and (eager) its KV is attached; otherwise it is redone,
//! which re-uses the KV already stored (probe first, attach without prefilling). A final
//! reconciliation detaches KV documents that no point references. So no point ever lacks its
//! KV (eager), no point is duplicated (ids derive from document and ordinal), and nothing is
//! orphaned once a run completes.
//!
//! # Concurrent writers
//! Ingest runs, deletes, reconciliation and rematerialization may run at once (the server
//! does). Each holds a document's claim while it reads and writes that document's state
//! (see `ingest/src/claims.rs`), so operations on one document are ordered and a version being
//! written is never detached as an orphan. The reconciliation at the end of a run looks only
//! at the documents the run touched (a seek per document in the KV store and the index), so
//! an ingest costs what its documents cost, not what the corpus does; `gc` and `--prune`
//! reconcile everything.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, Sender};
use kvstore::PutItem;
use parking_lot::Mutex;
use retrieval::{ChunkPayload, ChunkPoint, SearchFilter};
use schema::NamespaceId;
use uuid::Uuid;

use crate::chunk::{chunk_text, Chunk};
use crate::claims::{Claim, Claims};
use crate::config::{Materialize, RunOptions};
use crate::corpus::{kv_doc, kv_key, split_kv_doc, Corpus};
use crate::error::{Error, Result};
use crate::progress::Counters;
use crate::report::{secs, Failure, Report, StageTimes};
use crate::source::{self, Doc, Item, ReadLimits, Source};

mod prefill;
mod reconcile;
mod write;

pub use prefill::prefill_groups;

/// The writer of a [`Corpus`]: ingest runs, deletes, write-backs, re-materialization and
/// garbage collection, ordered per document by write claims (`ingest/src/claims.rs`).
#[derive(Debug)]
pub struct Engine {
    pub(crate) corpus: Arc<Corpus>,
    pub(crate) claims: Claims,
    /// Milliseconds each document's commit waits after its KV is stored and before its points
    /// are upserted: widens that window for tests of concurrent writers; 0 in production.
    pub(crate) commit_delay_ms: std::sync::atomic::AtomicU64,
}

impl Engine {
    /// The writer of `corpus`.
    pub fn new(corpus: Corpus) -> Engine {
        Engine {
            corpus: Arc::new(corpus),
            claims: Claims::default(),
            commit_delay_ms: Default::default(),
        }
    }

    /// What this engine writes: store, index, embedder, model and how chunks are stored.
    pub fn corpus(&self) -> &Arc<Corpus> {
        &self.corpus
    }

    /// Test hook: each document's commit waits `ms` after its KV is stored and before its
    /// points are upserted, widening that window for tests of concurrent writers.
    #[cfg(feature = "testing")]
    pub fn set_commit_delay_ms(&self, ms: u64) {
        self.commit_delay_ms
            .store(ms, std::sync::atomic::Ordering::SeqCst);
    }

    /// Removes a document: its points, then its KV (every version). Returns whether it existed.
    /// Ordered with any ingest of the same document (see `ingest/src/claims.rs`).
    pub fn delete_document(&self, doc: &str) -> Result<bool> {
        let _claim = self.claims.claim(doc);
        let points = self.corpus.index.count(&SearchFilter::document(doc))?;
        self.corpus.index.delete_document(doc)?;
        self.corpus.index.flush()?;
        let versions = self.corpus.kv_versions(doc)?;
        for d in &versions {
            self.corpus.store.delete_document(d)?;
        }
        let mut remote = 0;
        if let Some(r) = self.corpus.remote_writes() {
            for ns in self.corpus.tier_namespaces() {
                remote += r.delete_doc(ns, doc, None)?.manifests;
            }
        }
        Ok(points > 0 || !versions.is_empty() || remote > 0)
    }

    /// Runs the pipeline over `sources`.
    pub fn ingest(
        &self,
        sources: &[Source],
        opts: &RunOptions,
        counters: &Counters,
    ) -> Result<Report> {
        let start = Instant::now();
        let shared = Shared {
            report: Mutex::new(Report::default()),
            fatal: Mutex::new(None),
            stop: std::sync::atomic::AtomicBool::new(false),
            counters,
        };
        let depth = self.corpus.config.queue_depth;
        let (read_tx, read_rx) = bounded::<Doc>(depth);
        let (plan_tx, plan_rx) = bounded::<Planned<'_>>(depth);
        let (embed_tx, embed_rx) = bounded::<Embedded<'_>>(depth);
        let (write_tx, write_rx) = bounded::<ToWriter<'_>>(depth * 4);
        let seen: Mutex<HashSet<String>> = Mutex::new(HashSet::new());
        let mut times = StageTimes::default();
        std::thread::scope(|s| -> Result<()> {
            let reader = std::thread::Builder::new()
                .name("ragkv-read".into())
                .spawn_scoped(s, || {
                    self.read_stage(opts, sources, read_tx, &shared, &seen)
                })
                .map_err(spawn_err)?;
            let planner = std::thread::Builder::new()
                .name("ragkv-chunk".into())
                .spawn_scoped(s, || self.plan_stage(opts, read_rx, plan_tx, &shared))
                .map_err(spawn_err)?;
            let embedder = std::thread::Builder::new()
                .name("ragkv-embed".into())
                .spawn_scoped(s, || self.embed_stage(plan_rx, embed_tx, &shared))
                .map_err(spawn_err)?;
            let prefiller = std::thread::Builder::new()
                .name("ragkv-prefill".into())
                .spawn_scoped(s, || self.prefill_stage(opts, embed_rx, write_tx, &shared))
                .map_err(spawn_err)?;
            let (write_kv, upsert) = self.write_stage(opts, write_rx, &shared);
            times.read_s = join(reader);
            times.chunk_s = join(planner);
            times.embed_s = join(embedder);
            times.prefill_s = join(prefiller);
            times.write_kv_s = write_kv;
            times.upsert_s = upsert;
            Ok(())
        })?;
        if let Some(e) = shared.fatal.lock().take() {
            return Err(e);
        }
        self.corpus.index.flush()?;
        self.corpus.store.sync()?;
        let mut report = shared.report.into_inner();
        let seen = seen.into_inner();
        self.finish(opts, &seen, &mut report)?;
        report.stages = times;
        report.elapsed_s = secs(start.elapsed());
        Ok(report)
    }

    /// Holds `doc`'s write claim until the returned value is dropped.
    pub(crate) fn claim(&self, doc: &str) -> Claim<'_> {
        self.claims.claim(doc)
    }

    fn read_stage(
        &self,
        opts: &RunOptions,
        sources: &[Source],
        tx: Sender<Doc>,
        shared: &Shared<'_>,
        seen: &Mutex<HashSet<String>>,
    ) -> f64 {
        let limits = ReadLimits {
            max_doc_bytes: self.corpus.config.max_doc_bytes,
        };
        let mut busy = Duration::ZERO;
        let mut t = Instant::now();
        for src in sources {
            let ok = source::read_source(src, limits, &mut |item| {
                if shared.stopped() {
                    return false;
                }
                shared.counters.docs_seen.fetch_add(1, Ordering::Relaxed);
                match item {
                    Item::Skipped { origin, reason } => {
                        shared.fail(origin, reason);
                        true
                    }
                    Item::Doc(doc) if opts.shard.is_some_and(|s| !s.contains(&doc.id)) => {
                        shared.report.lock().docs_other_shards += 1;
                        shared.counters.docs_done.fetch_add(1, Ordering::Relaxed);
                        true
                    }
                    Item::Doc(doc) => {
                        if !seen.lock().insert(doc.id.clone()) {
                            shared.fail(
                                doc.origin.clone(),
                                format!("duplicate document id {:?} in this run", doc.id),
                            );
                            return true;
                        }
                        busy += t.elapsed();
                        let sent = tx.send(doc).is_ok();
                        t = Instant::now();
                        sent
                    }
                }
            });
            if !ok {
                break;
            }
        }
        busy += t.elapsed();
        secs(busy)
    }

    fn plan_stage<'a>(
        &'a self,
        opts: &RunOptions,
        rx: Receiver<Doc>,
        tx: Sender<Planned<'a>>,
        shared: &Shared<'_>,
    ) -> f64 {
        let chunker = self.corpus.config.chunker();
        let mut busy = Duration::ZERO;
        for doc in rx {
            let t = Instant::now();
            let hash = doc.content_hash();
            // Held until the document is committed (or abandoned) downstream.
            let claim = self.claims.claim(&doc.id);
            let old = match self.corpus.index.document(&doc.id) {
                Ok(o) => o,
                Err(e) => {
                    shared.fatal(e.into());
                    break;
                }
            };
            if self.is_current(&doc.id, &hash, &old, opts.materialize) {
                shared.report.lock().docs_unchanged += 1;
                shared.counters.docs_done.fetch_add(1, Ordering::Relaxed);
                busy += t.elapsed();
                continue;
            }
            let mut chunks = chunk_text(&doc.text, self.corpus.model.tokenizer(), &chunker);
            for c in chunks
                .iter_mut()
                .filter(|_| !self.corpus.preamble.is_empty())
            {
                c.tokens.splice(0..0, self.corpus.preamble.iter().copied());
            }
            if chunks.is_empty() {
                shared.fail(doc.origin.clone(), "no text to index after chunking".into());
                continue;
            }
            let tokens: usize = chunks.iter().map(|c| c.tokens.len()).sum();
            shared
                .counters
                .chunks_total
                .fetch_add(chunks.len() as u64, Ordering::Relaxed);
            shared
                .counters
                .tokens_total
                .fetch_add(tokens as u64, Ordering::Relaxed);
            busy += t.elapsed();
            if tx
                .send(Planned {
                    _claim: claim,
                    doc,
                    hash,
                    old,
                    chunks,
                })
                .is_err()
            {
                break;
            }
        }
        secs(busy)
    }

    /// Whether the index already holds exactly version `hash` of `doc`, materialized as asked.
    fn is_current(
        &self,
        doc: &str,
        hash: &str,
        old: &[(Uuid, ChunkPayload)],
        materialize: Materialize,
    ) -> bool {
        let Some((_, first)) = old.first() else {
            return false;
        };
        let n = first.doc_chunks as usize;
        let complete = old.len() == n
            && old
                .iter()
                .enumerate()
                .all(|(i, (_, p))| p.doc_hash == hash && p.ordinal as usize == i);
        if !complete {
            return false;
        }
        match materialize {
            Materialize::Eager => {
                old.iter().all(|(_, p)| !p.kv_key.is_empty())
                    && self
                        .corpus
                        .store
                        .document_sequences(&kv_doc(doc, hash))
                        .is_ok_and(|s| !s.is_empty())
            }
            Materialize::Lazy | Materialize::None => true,
        }
    }

    fn embed_stage<'a>(
        &'a self,
        rx: Receiver<Planned<'a>>,
        tx: Sender<Embedded<'a>>,
        shared: &Shared<'_>,
    ) -> f64 {
        let mut busy = Duration::ZERO;
        for planned in rx {
            let t = Instant::now();
            let texts: Vec<&str> = planned.chunks.iter().map(|c| c.text.as_str()).collect();
            let vectors = match self.corpus.embedder.embed(&texts) {
                Ok(v) => v,
                Err(e) => {
                    shared.fail(planned.doc.id.clone(), format!("embedding failed: {e}"));
                    continue;
                }
            };
            busy += t.elapsed();
            if tx.send(Embedded { planned, vectors }).is_err() {
                break;
            }
        }
        secs(busy)
    }
}

struct Planned<'a> {
    /// The document's write claim, released when the plan is committed or dropped.
    _claim: Claim<'a>,
    doc: Doc,
    hash: String,
    old: Vec<(Uuid, ChunkPayload)>,
    chunks: Vec<Chunk>,
}

struct Embedded<'a> {
    planned: Planned<'a>,
    vectors: Vec<Vec<f32>>,
}

enum ToWriter<'a> {
    /// One chunk's KV (`None`: already stored, attach only).
    Kv {
        kv_doc: String,
        tokens: Vec<u32>,
        bytes: Option<Vec<u8>>,
        /// Under `ingest.exact_first`: its copy for the first place (with `bytes`).
        first: Option<Vec<u8>>,
    },
    /// All of a document's KV was sent: commit its vectors.
    Doc(Embedded<'a>),
    /// The document's prefill failed; its KV so far stays unreferenced until reconciliation.
    Abandon,
}

struct Shared<'a> {
    report: Mutex<Report>,
    fatal: Mutex<Option<Error>>,
    stop: std::sync::atomic::AtomicBool,
    counters: &'a Counters,
}

impl Shared<'_> {
    fn fail(&self, origin: String, reason: String) {
        tracing::warn!(%origin, %reason, "document skipped");
        let mut r = self.report.lock();
        r.docs_failed += 1;
        r.failures.push(Failure { origin, reason });
        self.counters.docs_done.fetch_add(1, Ordering::Relaxed);
    }

    fn fatal(&self, e: Error) {
        tracing::error!(error = %e, "ingest stopped");
        self.stop.store(true, Ordering::Relaxed);
        self.fatal.lock().get_or_insert(e);
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }
}

fn spawn_err(e: std::io::Error) -> Error {
    Error::Io {
        what: "spawning a pipeline thread".into(),
        cause: e,
    }
}

fn join(h: std::thread::ScopedJoinHandle<'_, f64>) -> f64 {
    match h.join() {
        Ok(t) => t,
        Err(p) => std::panic::resume_unwind(p),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_doc_ids_split_at_the_last_at_sign() {
        let d = kv_doc("mail/a@b.txt", "ff00");
        assert_eq!(split_kv_doc(&d), Some(("mail/a@b.txt", "ff00")));
        assert_eq!(kv_key(&[1, 2, 3]).len(), 32);
        assert_ne!(kv_key(&[1, 2, 3]), kv_key(&[1, 2, 4]));
    }
}
