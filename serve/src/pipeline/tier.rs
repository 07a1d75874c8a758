//! What a query's chunks miss in the local store, from the shared tier (`remote.read`): each
//! missing chunk's KV under the corpus's namespace and, under `ingest.exact_first`, the copy
//! for the first place of the chunk placed first when it was not read here, all requests in
//! flight at once. What is found is verified, kept in the local store (a cache of the tier,
//! under its quota) and placed at its prompt position. Whatever the tier misses or fails to
//! give stays as the local store left it (missing: recomputed; a chunk's own KV in the first
//! place: repaired as the strategy says): a remote failure is never a query's error.
//!
//! The tier holds a chunk's KV as computed; with a lossy codec the local store holds it
//! encoded. A fetched chunk is used as the local store gives it back (read again after it is
//! kept), so that a chunk answers alike on every node and every later query, whichever path
//! brought it (measured before: 7 of 16 greedy answers differed between two nodes).

use std::sync::atomic::Ordering;

use ingest::Corpus;
use kvstore::NamespaceId;
use model::DType;

use super::job::Loaded;
use super::place::{exact_in_first_place, import};
use crate::assembly::Assembly;
use crate::metrics::Metrics;

/// Fetches what `chunks` (each with its prompt position) miss from the shared tier, if one
/// is read; `buf` holds a kept chunk read back.
pub(super) fn fetch(
    corpus: &Corpus,
    m: &Metrics,
    (assembly, dtype): (Assembly, DType),
    chunks: &mut [(usize, Loaded)],
    buf: &mut Vec<u8>,
) {
    let Some(tier) = corpus.remote().filter(|r| r.reads()) else {
        return;
    };
    // The first place's copy is asked before the chunk's own KV, so that it is the one
    // placed when the tier has both.
    let mut asks: Vec<(usize, NamespaceId)> = Vec::new();
    if let (Some(f), Some((_, c))) = (corpus.first_namespace(), chunks.first()) {
        if !c.exact {
            asks.push((0, f));
        }
    }
    let own = corpus.namespace();
    asks.extend(
        (0..chunks.len())
            .filter(|&i| chunks[i].1.kv.is_none())
            .map(|i| (i, own)),
    );
    if asks.is_empty() {
        return;
    }
    let keys: Vec<(NamespaceId, &[u32])> = asks
        .iter()
        .map(|&(i, ns)| (ns, chunks[i].1.tokens.as_slice()))
        .collect();
    let got = tier.get_each(&keys);
    for (&(i, ns), r) in asks.iter().zip(got) {
        let (pos, c) = &mut chunks[i];
        let doc = &c.hit.payload.doc_id;
        let f = match r {
            Ok(Some(f)) if f.layout == corpus.layout() => f,
            Ok(Some(f)) => {
                tracing::warn!(%doc, layout = ?f.layout, "shared-tier KV has another layout; recomputing");
                m.remote_errors.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            Ok(None) => {
                m.remote_misses.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, %doc, "shared-tier fetch failed; recomputing");
                m.remote_errors.fetch_add(1, Ordering::Relaxed);
                continue;
            }
        };
        m.remote_fetch.observe(f.ms / 1e3);
        m.remote_bytes
            .fetch_add(f.kv.len() as u64, Ordering::Relaxed);
        // Kept locally under the document version's KV id, as ingest would have stored it
        // (a failure here costs only the next fetch).
        let kv_doc = ingest::kv_doc(doc, &c.hit.payload.doc_hash);
        let put = corpus.store().put_batch(
            ns,
            corpus.layout(),
            &[kvstore::PutItem {
                tokens: &c.tokens,
                kv: &f.kv,
                doc: Some(&kv_doc),
            }],
        );
        if let Err(e) = &put {
            tracing::warn!(error = %e, %doc, "keeping shared-tier KV locally failed");
        }
        let copy = ns != own;
        if !copy && c.kv.is_some() {
            // Placed first from its copy: its own KV is only kept.
            m.remote_hits.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        // With a lossy codec, the local store's copy, as every later query will read it.
        let lossy = corpus.lossless_source().is_some();
        let bytes: &[u8] = match put {
            Ok(_) if lossy => {
                match corpus
                    .store()
                    .get_batch_into(ns, &c.tokens, c.tokens.len(), buf)
                {
                    Ok(_) => buf,
                    Err(e) => {
                        tracing::warn!(error = %e, %doc, "reading back the kept copy failed; using the fetched KV");
                        &f.kv
                    }
                }
            }
            _ => &f.kv,
        };
        let kv = match import(corpus, bytes, assembly, *pos, dtype) {
            Ok(kv) => kv,
            Err(e) => {
                tracing::warn!(error = %e, %doc, "shared-tier KV does not import; recomputing");
                m.remote_errors.fetch_add(1, Ordering::Relaxed);
                continue;
            }
        };
        m.remote_hits.fetch_add(1, Ordering::Relaxed);
        c.kv = Some(kv);
        c.exact = i == 0 && exact_in_first_place(corpus, copy, true);
        if !copy {
            c.corrupt = false;
        }
    }
}
