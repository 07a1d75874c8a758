//! The resident tier's warm-up (`ragkv-resident-warm`, `serve.resident_warm`): when a server
//! starts with `serve.resident_mb`, the chunks queries read most often (the store's access
//! statistics, which outlive the process) are imported onto the model's device in the
//! background (as many as the tier's budget holds, hottest first), so that a restart does not
//! cost the hot chunks' first reads. Reads go through the store's maintenance path (not
//! counted as accesses); a chunk missing or damaged is skipped (a query will recompute it).
//! The thread stops early once the server is gone or closing.

use std::time::Instant;

use ingest::Corpus;
use model::Kv;

use crate::error::Result;
use crate::resident::Resident;

/// What a warm-up did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Warmed {
    /// Chunks imported into the tier.
    pub chunks: usize,
    /// Their bytes.
    pub bytes: usize,
}

/// Imports the most-read chunks of `corpus` into `resident` until its budget is full, or
/// `stop` says to end. Chunks never read are left out: nothing says they will be.
pub(crate) fn warm(
    resident: &Resident,
    corpus: &Corpus,
    stop: impl Fn() -> bool,
) -> Result<Warmed> {
    let t = Instant::now();
    let ns = corpus.namespace();
    let store = corpus.store();
    let layout = corpus.layout();
    let mut hot: Vec<(u32, Vec<u32>)> = Vec::new();
    for (_, p) in corpus.index().points()? {
        if stop() {
            return Ok(Warmed::default());
        }
        if p.kv_key.is_empty() {
            continue; // not materialized (lazy, or vectors only)
        }
        let tokens = corpus.chunk_tokens(&p.text)?;
        if let Some(a) = store.access(ns, &tokens).filter(|a| a.reads > 0) {
            hot.push((a.reads, tokens));
        }
    }
    // Hottest first (equal counts in a stable order) while they fit; then imported coldest
    // first, so that the hottest are the tier's most recently used.
    hot.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    hot.dedup_by(|a, b| a.1 == b.1);
    let mut room = resident.budget();
    hot.retain(|(_, tokens)| {
        let bytes = layout.bytes_for(tokens.len());
        // A chunk that does not fit leaves room for a smaller one.
        let fits = bytes <= room;
        room -= if fits { bytes } else { 0 };
        fits
    });
    let mut done = Warmed::default();
    let mut buf = Vec::new();
    for (_, tokens) in hot.into_iter().rev() {
        if stop() {
            break;
        }
        let bytes = layout.bytes_for(tokens.len());
        let removals = store.removals();
        if store
            .peek_into(ns, &tokens, tokens.len(), &mut buf)
            .is_err()
        {
            continue;
        }
        let kv = match Kv::from_bytes(&buf, &layout, corpus.model().device())
            .and_then(|kv| corpus.model().settle().map(|()| kv))
        {
            Ok(kv) => kv,
            Err(e) => {
                tracing::warn!(error = %e, "resident warm-up: stored KV does not import; skipped");
                continue;
            }
        };
        resident.insert(ns, &tokens, kv, bytes, removals);
        done.chunks += 1;
        done.bytes += bytes;
    }
    tracing::info!(
        chunks = done.chunks,
        mib = done.bytes >> 20,
        secs = t.elapsed().as_secs_f64(),
        "resident tier warmed with the most-read chunks"
    );
    Ok(done)
}
