//! The resident tier's warm-up (`ragkv-resident-warm`, `serve.resident_warm`): when a server
//! starts with `serve.resident_mb`, the chunks queries read most often (the store's access
//! statistics, which outlive the process) are imported onto the model's device in the
//! background (as many as the tier's budget holds, hottest first), so that a restart does not
//! cost the hot chunks' first reads. Reads go through the store's maintenance path (not
//! counted as accesses); a chunk missing or damaged is skipped (a query will recompute it).
//! The thread stops early once the server is gone or closing.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use ingest::Corpus;
use model::Kv;

use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::resident::Resident;
use crate::supervise::{contain, Health};

/// Starts the warm-up thread. Not a health-watched worker: it ends once the tier is full,
/// and early once the server is closing or gone (the thread then holds the last reference
/// to the tier); a panic in it is contained and counted.
pub(crate) fn start(
    resident: Arc<Resident>,
    corpus: Arc<Corpus>,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
) -> Result<JoinHandle<()>> {
    let run = move || {
        let stop = || health.is_closing() || Arc::strong_count(&resident) == 1;
        if let Ok(Err(e)) = contain("ragkv-resident-warm", &metrics, || {
            warm(&resident, &corpus, stop)
        }) {
            tracing::warn!(error = %e.chain(), "resident warm-up failed");
        }
    };
    std::thread::Builder::new()
        .name("ragkv-resident-warm".into())
        .spawn(run)
        .map_err(|source| Error::Spawn {
            thread: "ragkv-resident-warm",
            source,
        })
}

/// Imports the most-read chunks of `corpus` into `resident` until its budget is full, or
/// `stop` says to end. Chunks never read are left out: nothing says they will be.
fn warm(resident: &Resident, corpus: &Corpus, stop: impl Fn() -> bool) -> Result<()> {
    let t = Instant::now();
    let ns = corpus.namespace();
    let store = corpus.store();
    let layout = corpus.layout();
    let mut hot: Vec<(u32, Vec<u32>)> = Vec::new();
    for (_, p) in corpus.index().points()? {
        if stop() {
            return Ok(());
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
    let (mut chunks, mut total) = (0, 0);
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
        chunks += 1;
        total += bytes;
    }
    tracing::info!(
        chunks,
        mib = total >> 20,
        secs = t.elapsed().as_secs_f64(),
        "resident tier warmed with the most-read chunks"
    );
    Ok(())
}
