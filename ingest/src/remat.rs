//! Re-materialization and namespace garbage collection: what `ragkv rematerialize` and
//! `ragkv gc` (or the server's schedule) run.
//!
//! Every indexed chunk that was materialized (its point names a KV key) is classified under the
//! current namespace (the configured model's fingerprint):
//!
//! | state     | meaning                                                                 |
//! |-----------|-------------------------------------------------------------------------|
//! | present   | its KV reads back verified (checksums, key, token digest)               |
//! | missing   | not stored: evicted, deleted, or its segment file was lost               |
//! | corrupt   | stored but fails verification (or a block inside it is gone)            |
//! | stale     | missing here, but its document version has KV under another namespace   |
//! |           | (a model or lossy-codec change: migrate it)                              |
//! | neighbours| stored, but under `ingest.context = "neighbours:N"` a neighbour it was  |
//! |           | prefilled after is no longer indexed, or it has fewer than N (stale too) |
//!
//! Under `ingest.exact_first` a chunk is also missing or corrupt when its copy for the first
//! place is; a chunk whose own KV is present gets only that copy prefilled.
//!
//! Chunks to redo are ordered hottest first (reads recorded by the store, under this namespace
//! or the one being migrated from), then cut to the limit. Corrupt ones are deleted first;
//! each chunk is probed again just before its prefill: a chunk identical to one redone earlier
//! in the run (the same text in two documents) is attached to its document, not recomputed.
//! A second run finds nothing to do. Under a lossy codec (`kvstore.codec = "q4"`, a namespace
//! of its own), a chunk the same model holds losslessly is re-encoded from that copy instead
//! of prefilled: moving a store to `q8`/`q4` costs reads and writes, not compute.
//!
//! A run can be stopped ([`Engine::rematerialize_until`]: the server's shutdown) between two
//! chunks: every chunk redone so far is stored and synced, the report says `interrupted`, and
//! the next run picks up what is left.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvstore::{NamespaceId, PutItem, SeqState};
use serde::{Deserialize, Serialize};

use crate::corpus::kv_doc;
use crate::error::{Error, Result};
use crate::pipeline::Engine;
use crate::progress::Counters;

/// Which chunks a run redoes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "scope")]
pub enum Scope {
    /// Missing, corrupt and stale chunks.
    All,
    /// Stale chunks only (migration after a model change).
    Stale,
    /// Chunks to redo that were read at least `min_reads` times.
    Hot {
        /// Reads at least.
        min_reads: u32,
    },
}

/// Options of [`Engine::rematerialize`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RematOptions {
    /// Which chunks.
    #[serde(flatten)]
    pub scope: Scope,
    /// Redo at most this many chunks (hottest first).
    pub limit: Option<usize>,
    /// Classify and list, change nothing.
    pub dry_run: bool,
}

impl Default for RematOptions {
    fn default() -> Self {
        RematOptions {
            scope: Scope::All,
            limit: None,
            dry_run: false,
        }
    }
}

/// Why a chunk is redone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Reason {
    /// Not stored.
    Missing,
    /// Stored but not verifying.
    Corrupt,
    /// Stored under another model's namespace only.
    Stale,
    /// Prefilled after neighbours that changed (`ingest.context`).
    Neighbours,
}

/// One chunk a run redoes (or would, with `dry_run`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Planned {
    /// Its document.
    pub doc_id: String,
    /// Its position in the document.
    pub chunk: u32,
    /// Its tokens.
    pub tokens: usize,
    /// Why it is redone.
    pub reason: Reason,
    /// Times it was read (access statistics).
    pub reads: u32,
}

/// What a run found and did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RematReport {
    /// Nothing was changed.
    pub dry_run: bool,
    /// Materialized chunks examined.
    pub chunks: usize,
    /// Of those, stored and verifying.
    pub present: usize,
    /// Not stored.
    pub missing: usize,
    /// Stored but not verifying.
    pub corrupt: usize,
    /// Stored under another model's namespace only.
    pub stale: usize,
    /// Stored, but prefilled after neighbours that are no longer indexed (or too few).
    #[serde(default)]
    pub neighbours_changed: usize,
    /// Chunks selected by scope and limit.
    pub planned: usize,
    /// Chunks prefilled and stored.
    pub prefilled: usize,
    /// Chunks found stored by the time their turn came (an identical chunk), attached only.
    pub attached: usize,
    /// Chunks stored again with this namespace's lossy codec from the same model's lossless
    /// KV (a codec change), without prefill.
    #[serde(default)]
    pub reencoded: usize,
    /// Tokens prefilled.
    pub tokens_prefilled: usize,
    /// Chunks that could not be redone, with the reason.
    pub failures: Vec<String>,
    /// The selected chunks (listed for dry runs; empty otherwise).
    pub plan: Vec<Planned>,
    /// Wall time of the run.
    pub elapsed_s: f64,
    /// Stopped before the end ([`Engine::rematerialize_until`]): what is counted was done
    /// and stored; a later run redoes the rest.
    #[serde(default)]
    pub interrupted: bool,
}

/// What [`Engine::gc`] did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GcReport {
    /// Namespaces dropped (hex ids): not the current one, and inactive for the grace period.
    pub namespaces_dropped: Vec<String>,
    /// Index entries of dropped namespaces.
    pub blocks_dropped: usize,
    /// KV documents of versions no point references any more, detached.
    pub orphans_detached: usize,
    /// Segment files rewritten without their dead records.
    pub segments_rewritten: usize,
    /// Bytes those rewrites gave back.
    pub bytes_reclaimed: u64,
    /// On the shared tier (when ingest writes there): reference markers of document versions
    /// without a manifest, and KV objects nothing references, both older than
    /// `remote.gc_grace_minutes`, removed.
    #[serde(default)]
    pub remote_dead_references: usize,
    /// KV objects nothing references, removed from the shared tier.
    #[serde(default)]
    pub remote_orphans: usize,
    /// Their bytes.
    #[serde(default)]
    pub remote_orphan_bytes: u64,
}

struct Candidate {
    doc_id: String,
    kv_doc: String,
    chunk: u32,
    tokens: Vec<u32>,
    text: String,
    reason: Reason,
    reads: u32,
}

impl Engine {
    /// Finds chunks whose KV is missing, corrupt or stale and prefills them again; see the
    /// module documentation. `counters` drive a progress display (chunks and tokens).
    pub fn rematerialize(&self, opts: &RematOptions, counters: &Counters) -> Result<RematReport> {
        self.rematerialize_until(opts, counters, || false)
    }

    /// [`Engine::rematerialize`], stopping between two chunks once `stop` says so (asked
    /// before each chunk): the report then says `interrupted`, and what it counts is stored.
    pub fn rematerialize_until(
        &self,
        opts: &RematOptions,
        counters: &Counters,
        stop: impl Fn() -> bool,
    ) -> Result<RematReport> {
        let start = Instant::now();
        let ns = self.corpus.namespace();
        let mut report = RematReport {
            dry_run: opts.dry_run,
            ..RematReport::default()
        };
        let verify = opts.scope != Scope::Stale;
        let mut cands = Vec::new();
        let mut buf = Vec::new();
        let mut points = self.corpus.index.points()?;
        points.sort_by(|a, b| (&a.1.doc_id, a.1.ordinal).cmp(&(&b.1.doc_id, b.1.ordinal)));
        counters
            .chunks_total
            .store(points.len() as u64, Ordering::Relaxed);
        // The documents bar counts documents scanned; chunks and tokens, the whole run.
        let docs: HashSet<&str> = points.iter().map(|(_, p)| p.doc_id.as_str()).collect();
        counters
            .docs_seen
            .store(docs.len() as u64, Ordering::Relaxed);
        drop(docs);
        // Under neighbour materialization: every indexed chunk, to check what each stored
        // chunk was prefilled after.
        let live: HashSet<schema::TokenDigest> = if self.corpus.config.context.neighbours() > 0 {
            points
                .iter()
                .map(|(_, p)| Ok(schema::TokenDigest::of(&self.corpus.chunk_tokens(&p.text)?)))
                .collect::<Result<_>>()?
        } else {
            HashSet::new()
        };
        let mut last_doc = String::new();
        for (_, p) in points {
            if stop() {
                // Nothing was changed yet: the plan so far is dropped.
                report.interrupted = true;
                report.elapsed_s = start.elapsed().as_secs_f64();
                return Ok(report);
            }
            counters.chunks_done.fetch_add(1, Ordering::Relaxed);
            if p.doc_id != last_doc {
                counters.docs_done.fetch_add(1, Ordering::Relaxed);
                last_doc.clone_from(&p.doc_id);
            }
            if p.kv_key.is_empty() {
                continue; // lazy or vectors-only: materialized at first retrieval, if ever
            }
            report.chunks += 1;
            let tokens = self.corpus.chunk_tokens(&p.text)?;
            if tokens.is_empty() {
                continue;
            }
            let kv_doc = kv_doc(&p.doc_id, &p.doc_hash);
            // Under `ingest.exact_first`, the chunk's copy for the first place too.
            let mut state = None;
            for n in std::iter::once(ns).chain(self.corpus.first_namespace()) {
                state = state.or(if verify {
                    match self.corpus.store.inspect(n, &tokens, &mut buf)? {
                        SeqState::Present => None,
                        SeqState::Absent => Some(Reason::Missing),
                        SeqState::Damaged(_) => Some(Reason::Corrupt),
                    }
                } else {
                    (self.corpus.store.probe(n, &tokens)? < tokens.len()).then_some(Reason::Missing)
                });
            }
            let state = match state {
                None if self.corpus.context_changed(&tokens, &live)? => Some(Reason::Neighbours),
                s => s,
            };
            let Some(mut reason) = state else {
                report.present += 1;
                continue;
            };
            let others: Vec<NamespaceId> = self
                .corpus
                .store
                .document_sequences(&kv_doc)?
                .into_iter()
                .map(|(n, _)| n)
                .filter(|n| *n != ns && Some(*n) != self.corpus.first_namespace())
                .collect();
            if reason == Reason::Missing && !others.is_empty() {
                reason = Reason::Stale;
            }
            match reason {
                Reason::Missing => report.missing += 1,
                Reason::Corrupt => report.corrupt += 1,
                Reason::Stale => report.stale += 1,
                Reason::Neighbours => report.neighbours_changed += 1,
            }
            let reads = std::iter::once(ns)
                .chain(others)
                .filter_map(|n| self.corpus.store.access(n, &tokens))
                .map(|a| a.reads)
                .max()
                .unwrap_or(0);
            let wanted = match opts.scope {
                Scope::All => true,
                Scope::Stale => matches!(reason, Reason::Stale | Reason::Neighbours),
                Scope::Hot { min_reads } => reads >= min_reads,
            };
            if wanted {
                cands.push(Candidate {
                    doc_id: p.doc_id,
                    kv_doc,
                    chunk: p.ordinal,
                    tokens,
                    text: p.text,
                    reason,
                    reads,
                });
            }
        }
        cands.sort_by(|a, b| {
            b.reads
                .cmp(&a.reads)
                .then_with(|| a.doc_id.cmp(&b.doc_id))
                .then(a.chunk.cmp(&b.chunk))
        });
        if let Some(limit) = opts.limit {
            cands.truncate(limit);
        }
        report.planned = cands.len();
        if opts.dry_run {
            report.plan = cands
                .iter()
                .map(|c| Planned {
                    doc_id: c.doc_id.clone(),
                    chunk: c.chunk,
                    tokens: c.tokens.len(),
                    reason: c.reason,
                    reads: c.reads,
                })
                .collect();
            report.elapsed_s = start.elapsed().as_secs_f64();
            return Ok(report);
        }

        // Redo: corrupt ones and those with changed neighbours are deleted first, so their
        // blocks are written again.
        for c in cands
            .iter()
            .filter(|c| matches!(c.reason, Reason::Corrupt | Reason::Neighbours))
        {
            for n in std::iter::once(ns).chain(self.corpus.first_namespace()) {
                self.corpus.store.delete(n, &c.tokens, 0)?;
            }
        }
        counters
            .chunks_total
            .fetch_add(cands.len() as u64, Ordering::Relaxed);
        counters.tokens_total.fetch_add(
            cands.iter().map(|c| c.tokens.len() as u64).sum(),
            Ordering::Relaxed,
        );
        for c in &cands {
            if stop() {
                report.interrupted = true;
                break;
            }
            // The version may have been replaced or deleted since the scan: attaching KV to
            // it now would leave an orphan. Decided under the document's claim.
            let _claim = self.claim(&c.doc_id);
            let hash = crate::split_kv_doc(&c.kv_doc).map_or("", |(_, h)| h);
            if !self.indexes_version(&c.doc_id, hash)? {
                counters.chunks_done.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let stored = matches!(
                self.corpus.store.inspect(ns, &c.tokens, &mut buf)?,
                SeqState::Present
            );
            let first_stored = match self.corpus.first_namespace() {
                Some(f) => matches!(
                    self.corpus.store.inspect(f, &c.tokens, &mut buf)?,
                    SeqState::Present
                ),
                None => true,
            };
            let mut reencoded = false;
            let copy = match (stored, first_stored) {
                (false, true) => self.lossless_copy(&c.tokens, &mut buf, &live)?,
                _ => None,
            };
            let (bytes, first) = if stored && first_stored {
                (None, None)
            } else if stored {
                // Only the first place's copy is missing (`ingest.exact_first` turned on).
                match self.corpus.first_kv(&c.tokens) {
                    Ok(first) => (None, first),
                    Err(e) => {
                        report
                            .failures
                            .push(format!("{}#{}: prefill failed: {e}", c.doc_id, c.chunk));
                        continue;
                    }
                }
            } else if let Some(b) = copy {
                reencoded = true;
                (Some(b), None)
            } else {
                let kv = self
                    .corpus
                    .chunk_kv_of_text(&c.tokens, &c.text)
                    .and_then(|kv| self.corpus.put_note(&c.tokens, &kv).map(|()| kv));
                match kv {
                    Ok(kv) => (Some(kv.bytes), kv.first),
                    Err(e) => {
                        report
                            .failures
                            .push(format!("{}#{}: prefill failed: {e}", c.doc_id, c.chunk));
                        continue;
                    }
                }
            };
            // The first place's copy before the chunk's own bytes (a crash between leaves the
            // chunk missing, found by the next run).
            let put = self
                .corpus
                .put_first(&c.kv_doc, &c.tokens, first.as_deref())
                .and_then(|_| {
                    let own = PutItem {
                        tokens: &c.tokens,
                        kv: bytes.as_deref().unwrap_or(&[]),
                        doc: Some(&c.kv_doc),
                    };
                    Ok(self
                        .corpus
                        .store
                        .put_batch(ns, self.corpus.layout(), &[own])?)
                });
            let bytes = bytes.or(first);
            match put {
                Ok(_) if reencoded => report.reencoded += 1,
                Ok(_) if bytes.is_some() => {
                    report.prefilled += 1;
                    report.tokens_prefilled += c.tokens.len();
                }
                Ok(_) => report.attached += 1,
                Err(Error::Store(e @ kvstore::Error::QuotaExceeded { .. })) => {
                    report
                        .failures
                        .push(format!("{}#{}: {e}", c.doc_id, c.chunk));
                }
                Err(e) => return Err(e),
            }
            counters.chunks_done.fetch_add(1, Ordering::Relaxed);
            counters
                .tokens_done
                .fetch_add(c.tokens.len() as u64, Ordering::Relaxed);
        }
        self.corpus.store.sync()?;
        report.elapsed_s = start.elapsed().as_secs_f64();
        tracing::info!(
            planned = report.planned,
            prefilled = report.prefilled,
            failed = report.failures.len(),
            interrupted = report.interrupted,
            "rematerialized"
        );
        Ok(report)
    }

    /// The chunk's KV from the lossless namespace of the same model, when this namespace is
    /// lossy and that one holds all of it verified; `None`: prefill it.
    /// Under `ingest.context`, its neighbour note is copied with it; where that note is
    /// missing or names neighbours no longer in `live`, `None`.
    fn lossless_copy(
        &self,
        tokens: &[u32],
        buf: &mut Vec<u8>,
        live: &HashSet<schema::TokenDigest>,
    ) -> Result<Option<Vec<u8>>> {
        let Some(src) = self.corpus.lossless_source() else {
            return Ok(None);
        };
        if self.corpus.config.context.neighbours() > 0 {
            match self.corpus.store.note(src, tokens)? {
                Some(note) if self.corpus.note_current(Some(&note), tokens, live) => {
                    self.corpus.store.put_note(self.corpus.ns, tokens, &note)?;
                }
                _ => return Ok(None),
            }
        }
        match self
            .corpus
            .store
            .get_batch_into(src, tokens, tokens.len(), buf)
        {
            Ok(_) => Ok(Some(std::mem::take(buf))),
            Err(e) if e.is_miss() || e.is_damage() => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Garbage collection: drops every namespace other than the current one (and, under
    /// `ingest.exact_first`, its first place's copies') that no process has registered for
    /// `ingest.namespace_grace_hours`, detaches KV documents whose document no point
    /// references any more, then rewrites segments holding dead bytes; on
    /// the shared tier (when ingest writes there), removes what no manifest references
    /// ([`remote::Remote::gc`]).
    pub fn gc(&self) -> Result<GcReport> {
        let mut report = GcReport::default();
        let grace = Duration::from_secs_f64(self.corpus.config.namespace_grace_hours * 3600.0);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        for n in self.corpus.store.namespaces() {
            if n.id == self.corpus.namespace() || Some(n.id) == self.corpus.first_namespace() {
                continue;
            }
            if now.saturating_sub(n.active_ms) >= grace.as_millis() as u64 {
                let r = self.corpus.store.drop_namespace(n.id)?;
                report.blocks_dropped += r.blocks;
                report.namespaces_dropped.push(n.id.to_string());
            }
        }
        report.orphans_detached = self.detach_orphans(&self.indexed_versions()?)?;
        let m = self.corpus.store.compact_all()?;
        report.segments_rewritten = m.segments_rewritten;
        report.bytes_reclaimed = m.bytes_reclaimed;
        if let Some(r) = self.corpus.remote_writes() {
            let g = r.gc(r.gc_grace())?;
            report.remote_dead_references = g.dead_references;
            report.remote_orphans = g.orphans;
            report.remote_orphan_bytes = g.orphan_bytes;
        }
        Ok(report)
    }
}

impl std::str::FromStr for Scope {
    type Err = Error;
    /// `all`, `stale` or `hot:N`.
    fn from_str(s: &str) -> Result<Scope> {
        match s {
            "all" => Ok(Scope::All),
            "stale" => Ok(Scope::Stale),
            _ => s
                .strip_prefix("hot:")
                .and_then(|n| n.parse().ok())
                .map(|min_reads| Scope::Hot { min_reads })
                .ok_or_else(|| Error::Invalid {
                    what: "rematerialize scope",
                    why: format!("{s:?} (all, stale, or hot:N)"),
                }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_parse_and_serialize() {
        assert_eq!("all".parse::<Scope>().unwrap(), Scope::All);
        assert_eq!(
            "hot:3".parse::<Scope>().unwrap(),
            Scope::Hot { min_reads: 3 }
        );
        assert!("hot".parse::<Scope>().is_err());
        let o = RematOptions {
            scope: Scope::Hot { min_reads: 2 },
            limit: Some(5),
            dry_run: true,
        };
        let j = serde_json::to_value(o).unwrap();
        assert_eq!(j["scope"], "hot");
        assert_eq!(j["min_reads"], 2);
        assert_eq!(serde_json::from_value::<RematOptions>(j).unwrap(), o);
    }
}
