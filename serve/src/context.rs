//! A query's context, the two halves of building it: reading its chunks' stored KV (on the
//! loader thread, [`read_chunks`]) and assembling the prompt cache from the system prefix and
//! those chunks by the query's strategy (on the model thread, [`assemble_query`]). Teacher
//! forcing ([`crate::teacher`]) builds its context with the same two functions.

use std::sync::atomic::Ordering;

use ingest::Engine;
use model::{DType, Kv, KvCache, Tensor};
use retrieval::Hit;

use crate::assembly::{assemble_into, Assembly, Repair};
use crate::events::{Citation, KvSource};
use crate::metrics::Metrics;
use crate::rag::{internal, Failure, KvMode, Prefix, Query};

/// A retrieved chunk, read for assembly.
pub(crate) struct Loaded {
    pub hit: Hit,
    pub tokens: Vec<u32>,
    /// Stored KV, already at the chunk's place in the prompt; `None`: prefill it.
    pub kv: Option<Kv>,
    /// The stored copy failed verification: write the recomputed KV over it.
    pub corrupt: bool,
}

/// A chunk's KV to store, computed because it was missing or damaged.
pub(crate) struct Writeback {
    pub doc: String,
    pub hash: String,
    pub tokens: Vec<u32>,
    pub bytes: Vec<u8>,
    pub replace: bool,
}

/// A chunk's KV bytes (stored layout, positions `0..n`) as tensors in `dtype` on the
/// model's device (the host-to-device copy happens here, on the loader thread, overlapping
/// the decoder's work), placed for a prompt where the chunk starts at `pos`. `dtype` is
/// [`Assembly::chunk_dtype`]'s: with the decoding cache's f16 the stored f16 values are used
/// as they are and only the keys are widened, turned and rounded (on the CPU in one pass on
/// this thread, [`model::Decoder::reposition`]), so the model thread just copies them in.
pub(crate) fn import(
    engine: &Engine,
    bytes: &[u8],
    assembly: Assembly,
    pos: usize,
    dtype: DType,
) -> model::Result<Kv> {
    let model = &engine.model;
    let kv = Kv::from_bytes(bytes, &engine.layout(), model.device())?;
    let kv = if dtype == model::Q8_CACHE {
        // Keys turn before they are quantized (re-positioning works on the stored floats);
        // the q8 cache then takes the rows as they are.
        assembly
            .place(model, kv, pos)
            .and_then(|kv| kv.to(model.device(), dtype))?
    } else {
        kv.to(model.device(), dtype)
            .and_then(|kv| assembly.place(model, kv, pos))?
    };
    // On a GPU the tensors go to the model thread: this thread's stream must be done.
    model.settle()?;
    Ok(kv)
}

/// A chunk's stored KV into `buf`: from the engine's namespace, or, when that misses and
/// chunks are stored with a lossy codec, from the same model's lossless namespace (a store
/// written before the codec changed serves as it did until `ragkv rematerialize` re-encodes
/// it).
fn read_stored(engine: &Engine, tokens: &[u32], buf: &mut Vec<u8>) -> kvstore::Result<()> {
    let n = tokens.len();
    match engine
        .store
        .get_batch_into(engine.namespace(), tokens, n, buf)
    {
        Err(e) if e.is_miss() && !e.is_damage() => match engine.lossless_source() {
            Some(src) => engine
                .store
                .get_batch_into(src, tokens, n, buf)
                .map(|_| ())
                .map_err(|_| e),
            None => Err(e),
        },
        r => r.map(|_| ()),
    }
}

/// Reads the stored KV of a query's chunks (verified, imported, placed from position `pos`
/// on); a chunk whose KV is missing, damaged or not wanted (`kv=off`, `full`) comes without
/// it. Chunks whose text tokenizes to nothing are left out.
pub(crate) fn read_chunks(
    engine: &Engine,
    m: &Metrics,
    query: &Query,
    hits: Vec<Hit>,
    mut pos: usize,
    buf: &mut Vec<u8>,
    cache_dtype: DType,
) -> Result<Vec<Loaded>, String> {
    let dtype = query
        .assembly
        .chunk_dtype(engine.model.dtype(), cache_dtype);
    let mut chunks = Vec::with_capacity(hits.len());
    for hit in hits {
        let tokens = match engine.chunk_tokens(&hit.payload.text) {
            Ok(t) if !t.is_empty() => t,
            Ok(_) => continue,
            Err(e) => return Err(format!("loading chunks: {e}")),
        };
        let mut corrupt = false;
        let kv = if query.kv == KvMode::On && query.assembly.uses_stored_kv() {
            match read_stored(engine, &tokens, buf) {
                Ok(_) => {
                    m.kv_bytes_loaded
                        .fetch_add(buf.len() as u64, Ordering::Relaxed);
                    match import(engine, buf, query.assembly, pos, dtype) {
                        Ok(kv) => Some(kv),
                        Err(e) => {
                            tracing::warn!(error = %e, doc = %hit.payload.doc_id, "stored KV does not import; recomputing and replacing it");
                            corrupt = true;
                            None
                        }
                    }
                }
                Err(e) if e.is_damage() => {
                    tracing::warn!(error = %e, doc = %hit.payload.doc_id, "stored KV failed verification; recomputing and replacing it");
                    corrupt = true;
                    None
                }
                Err(e) => {
                    if !e.is_miss() {
                        tracing::warn!(error = %e, doc = %hit.payload.doc_id, "KV read failed; recomputing");
                    }
                    None
                }
            }
        } else {
            None
        };
        if corrupt {
            m.kv_corrupt.fetch_add(1, Ordering::Relaxed);
        }
        chunks.push((
            pos,
            Loaded {
                hit,
                tokens,
                kv,
                corrupt,
            },
        ));
        pos += chunks.last().map_or(0, |(_, c)| c.tokens.len());
    }
    if query.kv == KvMode::On && query.assembly.uses_stored_kv() {
        fetch_remote(engine, m, query.assembly, dtype, &mut chunks);
    }
    Ok(chunks.into_iter().map(|(_, c)| c).collect())
}

/// The chunks the local store missed, from the shared tier (`remote.read`), all requests in
/// flight at once: each one found is verified, kept in the local store (a cache of the tier,
/// under its quota) and placed at its prompt position `pos`. Whatever the tier misses or
/// fails to give stays missing, to be recomputed: a remote failure is never a query's error.
fn fetch_remote(
    engine: &Engine,
    m: &Metrics,
    assembly: Assembly,
    dtype: DType,
    chunks: &mut [(usize, Loaded)],
) {
    let Some(tier) = engine.remote.as_deref().filter(|r| r.reads()) else {
        return;
    };
    let missing: Vec<usize> = (0..chunks.len())
        .filter(|&i| chunks[i].1.kv.is_none())
        .collect();
    if missing.is_empty() {
        return;
    }
    let seqs: Vec<&[u32]> = missing
        .iter()
        .map(|&i| chunks[i].1.tokens.as_slice())
        .collect();
    let got = tier.get_many(engine.namespace(), &seqs);
    for (&i, r) in missing.iter().zip(got) {
        let (pos, c) = &mut chunks[i];
        let doc = &c.hit.payload.doc_id;
        let f = match r {
            Ok(Some(f)) if f.layout == engine.layout() => f,
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
        let kv = match import(engine, &f.kv, assembly, *pos, dtype) {
            Ok(kv) => kv,
            Err(e) => {
                tracing::warn!(error = %e, %doc, "shared-tier KV does not import; recomputing");
                m.remote_errors.fetch_add(1, Ordering::Relaxed);
                continue;
            }
        };
        m.remote_hits.fetch_add(1, Ordering::Relaxed);
        // Kept locally under the document version's KV id, as ingest would have stored it
        // (a failure here costs only the next fetch).
        let kv_doc = ingest::kv_doc(doc, &c.hit.payload.doc_hash);
        let put = engine.store.put_batch(
            engine.namespace(),
            engine.layout(),
            &[kvstore::PutItem {
                tokens: &c.tokens,
                kv: &f.kv,
                doc: Some(&kv_doc),
            }],
        );
        if let Err(e) = put {
            tracing::warn!(error = %e, %doc, "keeping shared-tier KV locally failed");
        }
        c.kv = Some(kv);
        c.corrupt = false;
    }
}

/// A query's assembled prompt cache.
pub(crate) struct Assembled {
    /// The decoding cache, holding the prompt so far, with room for `pending` and the answer.
    pub cache: KvCache,
    /// What to feed after the cache's rows: the question's tokens; with `full`, the chunks'
    /// and the question's; none after a repair, which ran the question in its pass.
    pub pending: Vec<u32>,
    /// The logits after the question when the repair ran it (`pending` is then empty).
    pub logits: Option<Tensor>,
    /// Cache rows still to recompute (a deferred repair): the first `redo.len()` tokens of
    /// `pending` are theirs, fed with [`model::Decoder::step_repairing`].
    pub redo: Vec<usize>,
    pub citations: Vec<Citation>,
    /// Chunks served from stored KV, and chunks prefilled now to be written back.
    pub hits: usize,
    pub misses: usize,
    pub recomputed: usize,
    /// The KV of chunks prefilled now (missing or damaged), for the store.
    pub writebacks: Vec<Writeback>,
}

/// The prompt cache of `query`: the exact system prefix, then each chunk at its place (stored
/// KV as read, or prefilled now exactly as ingest stores it), repaired as the strategy says;
/// with `full`, just the prefix, the chunks to be prefilled with the question. The cache is
/// in `dtype` (`serve.cache_dtype`), with room for what is pending and `room` more tokens.
/// With `defer`, a `link` repair is left to the caller's feeding ([`Assembled::redo`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn assemble_query(
    engine: &Engine,
    prefix: &Prefix,
    repair: &Repair,
    query: &Query,
    chunks: Vec<Loaded>,
    mut question: Vec<u32>,
    room: usize,
    dtype: DType,
    defer: bool,
) -> Result<Assembled, Failure> {
    let model = &engine.model;
    let full = query.assembly == Assembly::Full;
    let mut parts = Vec::with_capacity(chunks.len());
    let mut context = prefix.tokens.clone();
    let mut citations = Vec::with_capacity(chunks.len());
    let mut writebacks = Vec::new();
    let (mut hits, mut misses) = (0, 0);
    for c in chunks {
        let pos = context.len();
        context.extend_from_slice(&c.tokens);
        let citation = |kv| Citation {
            doc_id: c.hit.payload.doc_id.clone(),
            chunk: c.hit.payload.ordinal,
            score: c.hit.score,
            tokens: c.tokens.len(),
            kv,
        };
        if full {
            citations.push(citation(KvSource::Full));
            continue;
        }
        let (kv, source) = match c.kv {
            Some(kv) => {
                hits += 1;
                (kv, KvSource::Stored)
            }
            None => {
                // Exactly what ingest stores: KV at positions 0.., rounded to the KV dtype.
                let bytes = engine.prefill_bytes(&c.tokens).map_err(internal)?;
                let chunk_dtype = query.assembly.chunk_dtype(model.dtype(), dtype);
                let kv =
                    import(engine, &bytes, query.assembly, pos, chunk_dtype).map_err(internal)?;
                if query.kv == KvMode::On {
                    misses += 1;
                    writebacks.push(Writeback {
                        doc: c.hit.payload.doc_id.clone(),
                        hash: c.hit.payload.doc_hash.clone(),
                        tokens: c.tokens.clone(),
                        bytes,
                        replace: c.corrupt,
                    });
                    (kv, KvSource::Recomputed)
                } else {
                    (kv, KvSource::Off)
                }
            }
        };
        citations.push(citation(source));
        parts.push(kv);
    }
    let (cache, recomputed, logits, redo) = if full {
        // The reference: the chunks are prefilled with the question, after the exact prefix.
        question.splice(0..0, context[prefix.tokens.len()..].iter().copied());
        let extra = question.len() + room;
        let cache = KvCache::from_kv_in(&prefix.kv, extra, dtype).map_err(internal)?;
        (cache, 0, None, Vec::new())
    } else {
        let r = assemble_into(
            model,
            query.assembly,
            repair,
            &prefix.kv,
            parts,
            &context,
            &question,
            room,
            dtype,
            defer,
        )
        .map_err(internal)?;
        let redo = if r.deferred {
            // The repair's tokens go first, then the question.
            question.splice(0..0, r.positions.iter().map(|&p| context[p]));
            r.positions.clone()
        } else {
            if r.logits.is_some() {
                question.clear();
            }
            Vec::new()
        };
        (r.cache, r.positions.len(), r.logits, redo)
    };
    Ok(Assembled {
        cache,
        redo,
        pending: question,
        logits,
        citations,
        hits,
        misses,
        recomputed,
        writebacks,
    })
}
