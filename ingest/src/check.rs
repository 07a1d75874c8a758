//! Consistency of the vector index with the KV store: what `ragkv verify` reports.

use std::collections::{BTreeMap, HashMap, HashSet};

use kvstore::SeqState;
use retrieval::SearchFilter;
use serde::Serialize;

use crate::corpus::{kv_doc, kv_key, split_kv_doc};
use crate::error::Result;
use crate::pipeline::Engine;

/// What [`Engine::check`] found. `problems` is empty when everything holds.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CheckReport {
    /// Documents in the index.
    pub documents: usize,
    /// Points (chunks) in the index.
    pub points: usize,
    /// Points whose KV was read back and verified (checksums, key, token digest).
    pub kv_verified: usize,
    /// Points indexed without KV (lazy or none materialization).
    pub kv_absent: usize,
    /// Points whose KV is not stored (evicted by the capacity policy, deleted, or lost with a
    /// segment): served by recompute, restored by `rematerialize`. Not a problem.
    pub kv_missing: usize,
    /// Points whose text now tokenizes to another length than when it was indexed (the model's
    /// tokenizer or the chunk preamble changed). Their KV is checked under the current
    /// tokenization; the payload keeps the old token count and key. Not a problem.
    pub retokenized: usize,
    /// Points found by searching with their own text (when `search` was asked).
    pub searchable: usize,
    /// What does not hold, one line each.
    pub problems: Vec<String>,
}

impl CheckReport {
    /// Whether nothing is wrong.
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }
}

impl Engine {
    /// Checks every invariant ingest promises: each document's points are one complete version
    /// (ordinals `0..doc_chunks`, one hash); each point that names a KV key has its KV either
    /// stored, readable and verified, or cleanly absent (`kv_missing`: evicted or lost, never
    /// half-present or corrupt), and attached to its document version; no KV document lacks
    /// points.
    /// With `search`, each chunk must also come back in the top 3 when searching its own text.
    pub fn check(&self, search: bool) -> Result<CheckReport> {
        let mut r = CheckReport::default();
        let points = self.corpus.index.points()?;
        r.points = points.len();
        let mut by_doc: BTreeMap<String, Vec<(uuid::Uuid, retrieval::ChunkPayload)>> =
            BTreeMap::new();
        for p in points {
            by_doc.entry(p.1.doc_id.clone()).or_default().push(p);
        }
        r.documents = by_doc.len();
        let mut versions: HashMap<String, String> = HashMap::new();
        let mut buf = Vec::new();
        for (doc, mut pts) in by_doc {
            pts.sort_by_key(|(_, p)| p.ordinal);
            let hashes: HashSet<&str> = pts.iter().map(|(_, p)| p.doc_hash.as_str()).collect();
            if hashes.len() != 1 {
                r.problems
                    .push(format!("{doc}: points of {} versions", hashes.len()));
            }
            let n = pts[0].1.doc_chunks as usize;
            let ordinals: Vec<u32> = pts.iter().map(|(_, p)| p.ordinal).collect();
            if pts.len() != n || ordinals.iter().enumerate().any(|(i, o)| *o as usize != i) {
                r.problems.push(format!(
                    "{doc}: {} points with ordinals {ordinals:?}, expected 0..{n}",
                    pts.len()
                ));
            }
            let hash = pts[0].1.doc_hash.clone();
            let attached: HashSet<usize> = self
                .corpus
                .store
                .document_sequences(&kv_doc(&doc, &hash))?
                .into_iter()
                .filter(|(ns, _)| *ns == self.corpus.namespace())
                .map(|(_, n)| n)
                .collect();
            for (id, p) in &pts {
                let tokens = self.corpus.chunk_tokens(&p.text)?;
                // Indexed under another tokenization (a model change): its KV identity is its
                // tokens now; the payload's count and key are the old tokenizer's.
                let retokenized = tokens.len() != p.tokens as usize;
                r.retokenized += retokenized as usize;
                if p.kv_key.is_empty() {
                    r.kv_absent += 1;
                } else if !retokenized && kv_key(&tokens) != p.kv_key {
                    r.problems.push(format!(
                        "{doc}#{}: KV key does not match its text",
                        p.ordinal
                    ));
                } else {
                    let state =
                        self.corpus
                            .store
                            .inspect(self.corpus.namespace(), &tokens, &mut buf)?;
                    match &state {
                        SeqState::Present => r.kv_verified += 1,
                        SeqState::Absent => r.kv_missing += 1,
                        SeqState::Damaged(e) => r
                            .problems
                            .push(format!("{doc}#{}: KV unreadable: {e}", p.ordinal)),
                    }
                    // Missing KV is attached when it is stored again.
                    if matches!(state, SeqState::Present) && !attached.contains(&tokens.len()) {
                        r.problems.push(format!(
                            "{doc}#{}: KV not attached to document version {hash}",
                            p.ordinal
                        ));
                    }
                }
                if search {
                    let v = self.corpus.embedder.embed_one(&p.text)?;
                    let hits = self.corpus.index.search(&v, 3, &SearchFilter::default())?;
                    if hits.iter().any(|h| h.id == *id) {
                        r.searchable += 1;
                    } else {
                        r.problems
                            .push(format!("{doc}#{}: not found by its own text", p.ordinal));
                    }
                }
            }
            versions.insert(doc, hash);
        }
        for d in self.corpus.store.documents()? {
            if let Some((doc, hash)) = split_kv_doc(&d) {
                if versions.get(doc).map(String::as_str) != Some(hash) {
                    r.problems
                        .push(format!("KV document {d} has no points (orphaned)"));
                }
            }
        }
        Ok(r)
    }
}
