//! Assembly on the model thread: the prompt cache of a loaded query, from the system
//! prefix and its chunks' KV by the query's [`Assembly`] strategy (chunks without stored KV
//! prefilled now, exactly as ingest stores them, and queued for writing back). Teacher forcing
//! ([`crate::teacher`]) assembles with the same function.

use ingest::Corpus;
use model::{KvCache, Tensor};

use super::job::{KvMode, Loaded, Prefix, Query, Writeback};
use super::place::{exact_in_first_place, import};
use crate::assembly::{assemble_into, Assembly, Prompt, Repair, Target};
use crate::error::Result;
use crate::events::{Citation, KvSource};

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
    /// `pending` are theirs, fed with [`model::Decoder::step`] (`StepSeq::redo`).
    pub redo: Vec<usize>,
    pub citations: Vec<Citation>,
    /// Chunks served from stored KV, and chunks prefilled now to be written back.
    pub hits: usize,
    pub misses: usize,
    pub recomputed: usize,
    /// The KV of chunks prefilled now (missing or damaged), for the store.
    pub writebacks: Vec<Writeback>,
}

/// One query's assembly: what [`assemble`] takes besides the corpus.
pub(crate) struct Request<'a> {
    /// The system prefix.
    pub prefix: &'a Prefix,
    /// `[serve]`'s repair settings.
    pub repair: &'a Repair,
    /// The query (its strategy and KV mode).
    pub query: &'a Query,
    /// Its chunks as the loader read them.
    pub chunks: Vec<Loaded>,
    /// The question's tokens in the chat template.
    pub question: Vec<u32>,
    /// The cache to assemble into: its dtype (`serve.cache_dtype`), its room after the
    /// prompt, and when a `link` repair runs.
    pub target: Target,
}

/// The prompt cache of a query: the exact system prefix, then each chunk at its place (stored
/// KV as read, or prefilled now exactly as ingest stores it), repaired as the strategy says;
/// with `full`, just the prefix, the chunks to be prefilled with the question. The cache has
/// room for what is pending and `target.room` more tokens. A deferred `link` repair is left
/// to the caller's feeding ([`Assembled::redo`]).
pub(crate) fn assemble(corpus: &Corpus, req: Request<'_>) -> Result<Assembled> {
    let Request {
        prefix,
        repair,
        query,
        chunks,
        mut question,
        target,
    } = req;
    let (room, dtype) = (target.room, target.dtype);
    let model = &corpus.model();
    let full = query.assembly == Assembly::Full;
    let mut parts = Vec::with_capacity(chunks.len());
    let mut ranked = Vec::with_capacity(chunks.len());
    let mut context = prefix.tokens.clone();
    let mut citations = Vec::with_capacity(chunks.len());
    let mut writebacks = Vec::new();
    let (mut hits, mut misses) = (0, 0);
    // Whether the chunk placed first holds what full prefill computes there: no repair then.
    let mut first_exact = false;
    for (i, c) in chunks.into_iter().enumerate() {
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
                first_exact |= i == 0 && c.exact;
                ranked.push(c.ranked);
                (kv, KvSource::Stored)
            }
            None => {
                // Exactly what ingest stores: KV at positions 0.., rounded to the KV dtype,
                // computed after the prompt's start and/or the chunk's neighbours under
                // `ingest.context` (a neighbour note is recorded now, before the write-back
                // stores the bytes).
                let computed = corpus.chunk_kv_of_text(&c.tokens, &c.hit.payload.text)?;
                if query.kv == KvMode::On {
                    corpus.put_note(&c.tokens, &computed)?;
                }
                ranked.push(computed.ranked);
                let (bytes, first) = (computed.bytes, computed.first);
                let chunk_dtype = query.assembly.chunk_dtype(model.dtype(), dtype);
                // The chunk placed first, under `ingest.exact_first`: its copy for that place.
                let copy = first.as_ref().filter(|_| i == 0);
                first_exact |= i == 0 && exact_in_first_place(corpus, copy.is_some(), true);
                let placed = copy.unwrap_or(&bytes);
                let kv = import(corpus, placed, query.assembly, pos, chunk_dtype)?;
                if query.kv == KvMode::On {
                    misses += 1;
                    writebacks.push(Writeback {
                        doc: c.hit.payload.doc_id.clone(),
                        hash: c.hit.payload.doc_hash.clone(),
                        tokens: c.tokens.clone(),
                        bytes,
                        first,
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
        let cache = KvCache::from_kv_in(&prefix.kv, extra, dtype)?;
        (cache, 0, None, Vec::new())
    } else {
        let prompt = Prompt {
            prefix: &prefix.kv,
            chunks: parts,
            tokens: &context,
            question: &question,
            ranked,
            exact_chunks: usize::from(first_exact),
        };
        let r = assemble_into(model, query.assembly, repair, prompt, target)?;
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
