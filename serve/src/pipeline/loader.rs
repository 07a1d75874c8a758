//! The loader thread (`ragkv-loader`): reads each admitted query's chunk KV from the store
//! (verified; what the local store misses, from the shared tier; what is resident on the
//! model's device, from there: [`crate::resident`]), imports it into tensors placed at the
//! chunk's prompt positions, tokenizes the question, and hands the loaded query to the
//! scheduler. It runs one query ahead of the model; how much of each load ran
//! while the model was busy is measured ([`crate::overlap`]), and a query loaded while the
//! model computes nothing gets the idle thread count ([`super::idle_load_threads`]). Each
//! chunk read announces the one its thread reads next ([`kvstore::Store::prefetch`]) before
//! it is imported, so that the disk fetches it meanwhile.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use ingest::Corpus;
use model::{DType, Kv};
use retrieval::Hit;

use super::fanout::Fanout;
use super::job::{finish_err, ms, ComputeJob, KvMode, LoadJob, Loaded, Prefix, Query, Worker};
use super::place::{exact_in_first_place, import, place};
use crate::assembly::Assembly;
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::overlap::Timeline;
use crate::resident::Resident;
use crate::supervise::{contain, Faults};

/// Where a query's chunk KV comes from, and what it goes into.
pub(crate) struct Source<'a> {
    pub corpus: &'a Corpus,
    pub metrics: &'a Metrics,
    pub resident: &'a Resident,
    /// `serve.cache_dtype`.
    pub cache_dtype: DType,
}

/// The loader loop; returns when its input queue closes or the scheduler's has gone.
pub(crate) fn run(
    w: &Worker,
    timeline: &Timeline,
    prefix: &Prefix,
    rx: Receiver<LoadJob>,
    tx: &Sender<ComputeJob>,
) {
    let m = &w.metrics;
    let mut fanout = Fanout::new(w.load_threads);
    for job in rx {
        m.load_queue.fetch_sub(1, Ordering::Relaxed);
        if Faults::take(&w.faults.kill_loader) {
            return; // as a bug outside any job would: health reports it
        }
        let events = job.events.clone();
        match contain("ragkv-loader", m, || {
            if Faults::take(&w.faults.panic_loader) {
                panic!("injected loader fault");
            }
            load(w, timeline, prefix, &mut fanout, job)
        }) {
            Ok(Some(cj)) => {
                m.compute_queue.fetch_add(1, Ordering::Relaxed);
                if tx.send(cj).is_err() {
                    return;
                }
            }
            Ok(None) => {}
            Err(e) => finish_err(m, &events, e),
        }
    }
}

/// Reads one query's chunks and tokenizes its question; `None` when the query ended here
/// (cancelled, or failed and told).
fn load(
    w: &Worker,
    timeline: &Timeline,
    prefix: &Prefix,
    fanout: &mut Fanout,
    mut job: LoadJob,
) -> Option<ComputeJob> {
    let (corpus, m) = (&*w.corpus, &*w.metrics);
    if job.events.is_closed() {
        m.cancelled.fetch_add(1, Ordering::Relaxed);
        return None;
    }
    let t = Instant::now();
    job.timings.queue_ms += ms(job.arrived.elapsed()) - job.timings.retrieve_ms;
    // A model with nothing to compute loses no core to the loader: the query is loaded with
    // every thread the idle setting allows, since its load is all its wait.
    let idle = !timeline.busy() && m.compute_queue.load(Ordering::Relaxed) == 0;
    fanout.set_threads(if idle {
        w.idle_load_threads
    } else {
        w.load_threads
    });
    let hits = std::mem::take(&mut job.hits);
    let start = prefix.tokens.len();
    let src = Source {
        corpus,
        metrics: m,
        resident: &w.resident,
        cache_dtype: w.cache_dtype,
    };
    let chunks = match read_chunks(&src, &job.query, hits, start, fanout) {
        Ok(c) => c,
        Err(e) => {
            finish_err(m, &job.events, e);
            return None;
        }
    };
    let end = Instant::now();
    let (took, hidden) = (end - t, timeline.overlap(t, end));
    job.timings.load_ms = ms(took);
    job.timings.load_hidden_ms = ms(hidden);
    m.kv_load_us
        .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
    m.kv_load_hidden_us
        .fetch_add(hidden.as_micros() as u64, Ordering::Relaxed);
    let question = match prefix.question(corpus, &job.query.question) {
        Ok(q) => q,
        Err(e) => {
            finish_err(m, &job.events, e.into());
            return None;
        }
    };
    let context: usize = chunks.iter().map(|c| c.tokens.len()).sum();
    let prompt_tokens = prefix.tokens.len() + context + question.len();
    let limit = corpus.model().max_positions();
    if prompt_tokens + job.query.params.max_tokens > limit {
        let why = format!(
            "the prompt ({prompt_tokens} tokens) and max_tokens ({}) exceed the model's \
             context ({limit} positions): lower top_k or max_tokens",
            job.query.params.max_tokens
        );
        finish_err(m, &job.events, Error::Invalid { why });
        return None;
    }
    Some(ComputeJob {
        job,
        chunks,
        question,
        prompt_tokens,
        queued_at: Instant::now(),
    })
}

/// Where [`read_stored`] found a chunk's KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Found {
    /// The corpus's namespace.
    Own,
    /// The same KV losslessly: chunks are stored with a lossy codec, and this store was
    /// written before (it serves as it did until `ragkv rematerialize` re-encodes it).
    Lossless,
    /// The chunk prefilled alone ([`ingest::Corpus::plain_sources`]): a store written under
    /// the earlier default materialization, served as it was until it is re-materialized.
    Plain,
}

/// A chunk's stored KV into `buf`: from the corpus's namespace, or, when that misses, from
/// the same model's lossless namespace, then its KV of the chunk prefilled alone.
fn read_stored(corpus: &Corpus, tokens: &[u32], buf: &mut Vec<u8>) -> kvstore::Result<Found> {
    let (store, n) = (corpus.store(), tokens.len());
    let miss = match store.get_batch_into(corpus.namespace(), tokens, n, buf) {
        Err(e) if e.is_miss() && !e.is_damage() => e,
        r => return r.map(|_| Found::Own),
    };
    let lossless = corpus.lossless_source().map(|ns| (ns, Found::Lossless));
    let plain = corpus.plain_sources().iter().map(|&ns| (ns, Found::Plain));
    for (ns, found) in lossless.into_iter().chain(plain) {
        if store.get_batch_into(ns, tokens, n, buf).is_ok() {
            return Ok(found);
        }
    }
    Err(miss)
}

/// Reads the stored KV of a query's chunks (verified, imported, placed from position `pos`
/// on), as many chunks at once as `fanout` has threads; a chunk whose KV is missing, damaged
/// or not wanted (`kv=off`, `full`) comes without it. Chunks whose text tokenizes to nothing
/// are left out.
pub(crate) fn read_chunks(
    src: &Source<'_>,
    query: &Query,
    hits: Vec<Hit>,
    mut pos: usize,
    fanout: &mut Fanout,
) -> Result<Vec<Loaded>> {
    let (corpus, m) = (src.corpus, src.metrics);
    let assembly = query.assembly;
    let dtype = assembly.chunk_dtype(corpus.model().dtype(), src.cache_dtype);
    let mut placed = Vec::with_capacity(hits.len());
    for hit in hits {
        let tokens = match corpus.chunk_tokens(&hit.payload.text) {
            Ok(t) if !t.is_empty() => t,
            Ok(_) => continue,
            Err(e) => return Err(e.into()),
        };
        let n = tokens.len();
        placed.push((pos, hit, tokens));
        pos += n;
    }
    let stored = query.kv == KvMode::On && assembly.uses_stored_kv();
    let loads = if stored {
        // Once a thread has read its chunk, the chunk `threads` places on is announced: the
        // disk fetches it while this one is imported. (Announced before the read, it would
        // share the disk with the read that is waited for: slower, measured.)
        let ahead = fanout.threads().min(placed.len());
        fanout.run(placed.len(), |i, buf| {
            let next = placed.get(i + ahead).map(|(_, _, t)| t.as_slice());
            load_one(src, (assembly, dtype), (&placed[i], next), i == 0, buf)
        })
    } else {
        placed.iter().map(|_| ChunkLoad::default()).collect()
    };
    if stored {
        let (read, import) = loads
            .iter()
            .fold((0.0, 0.0), |(r, i), l| (r + ms(l.read), i + ms(l.import)));
        tracing::debug!(
            chunks = loads.len(),
            resident = loads.iter().filter(|l| l.resident).count(),
            threads = fanout.threads().min(loads.len()),
            read_ms = read,
            import_ms = import,
            "chunk KV loaded (each chunk's read and import added up)"
        );
    }
    let ranked = stored && matches!(assembly, Assembly::Sensitive(_));
    let mut chunks: Vec<(usize, Loaded)> = placed
        .into_iter()
        .zip(loads)
        .map(|((pos, hit, tokens), l)| {
            if l.corrupt {
                m.kv_corrupt.fetch_add(1, Ordering::Relaxed);
            }
            let ranked = if ranked {
                corpus.ranked_offsets(&tokens)?
            } else {
                Vec::new()
            };
            let loaded = Loaded {
                hit,
                tokens,
                kv: l.kv,
                corrupt: l.corrupt,
                exact: l.exact,
                ranked,
            };
            Ok((pos, loaded))
        })
        .collect::<Result<_>>()?;
    if stored {
        super::tier::fetch(corpus, m, (assembly, dtype), &mut chunks, fanout.buf());
    }
    Ok(chunks.into_iter().map(|(_, c)| c).collect())
}

/// Tells the store that a chunk's KV is read soon ([`kvstore::Store::prefetch`]), unless
/// the resident tier holds it. Advisory: a failure costs only the head start.
fn announce(src: &Source<'_>, tokens: &[u32]) {
    let ns = src.corpus.namespace();
    if src.resident.holds(ns, tokens) {
        return;
    }
    if let Err(e) = src.corpus.store().prefetch(ns, tokens) {
        tracing::debug!(error = %e, "announcing a chunk's KV read failed");
    }
}

/// A chunk to load: its prompt position, its hit and its tokens.
type Placed = (usize, Hit, Vec<u32>);

/// One chunk's stored KV, as [`read_chunks`] loads it.
#[derive(Default)]
struct ChunkLoad {
    kv: Option<Kv>,
    /// Its stored KV failed verification or import (to be recomputed and replaced).
    corrupt: bool,
    /// `kv` is what full prefill computes at the chunk's place (the first).
    exact: bool,
    /// It came from the resident tier.
    resident: bool,
    read: Duration,
    import: Duration,
}

/// One chunk's stored KV as `dtype` (by `assembly`), placed at its prompt position `pos`:
/// from the resident tier, or read (into `buf`), verified and imported (and then kept in
/// the tier); `next`, the chunk this thread's next one may be, announced between the read
/// and the import. The chunk placed `first` reads its copy for that place where
/// `ingest.exact_first` stored one ([`ingest::Corpus::first_namespace`]).
fn load_one(
    src: &Source<'_>,
    (assembly, dtype): (Assembly, DType),
    ((pos, hit, tokens), next): (&Placed, Option<&[u32]>),
    first: bool,
    buf: &mut Vec<u8>,
) -> ChunkLoad {
    let (corpus, m, resident) = (src.corpus, src.metrics, src.resident);
    let pos = *pos;
    let mut out = ChunkLoad::default();
    let first_ns = corpus.first_namespace().filter(|_| first);
    let mut ns = first_ns.unwrap_or(corpus.namespace());
    // Before the read: an entry kept from it is dropped once anything leaves the store.
    let removals = corpus.store().removals();
    if let Some(kv) = resident.get(ns, tokens, removals) {
        let t = Instant::now();
        match place(corpus, kv, assembly, pos, dtype) {
            Ok(kv) => {
                out.kv = Some(kv);
                out.resident = true;
                out.exact = first && exact_in_first_place(corpus, first_ns == Some(ns), true);
                out.import = t.elapsed();
                return out;
            }
            // Not the store's fault: read it as if it were not resident.
            Err(e) => tracing::warn!(error = %e, "resident chunk KV does not place; reading it"),
        }
    }
    let t = Instant::now();
    let mut read = None;
    if let Some(f) = first_ns {
        match corpus.store().get_batch_into(f, tokens, tokens.len(), buf) {
            Ok(_) => read = Some(Ok(Found::Own)),
            // Served from the chunk's own KV meanwhile; `rematerialize` replaces a damaged
            // or missing copy.
            Err(e) if e.is_damage() || !e.is_miss() => {
                tracing::warn!(error = %e, doc = %hit.payload.doc_id, "the first place's copy could not be read; reading the chunk's own KV");
            }
            Err(_) => {}
        }
        if read.is_none() {
            ns = corpus.namespace();
        }
    }
    let read = read.unwrap_or_else(|| read_stored(corpus, tokens, buf));
    out.read = t.elapsed();
    if let Some(next) = next {
        announce(src, next);
    }
    match read {
        Ok(found) => {
            m.kv_bytes_loaded
                .fetch_add(buf.len() as u64, Ordering::Relaxed);
            let t = Instant::now();
            let keep = found == Found::Own && resident.enabled();
            let imported = if keep {
                // The tier keeps the chunk as imported, before it is placed.
                Kv::from_bytes(buf, &corpus.layout(), corpus.model().device()).and_then(|kv| {
                    let placed = place(corpus, kv.clone(), assembly, pos, dtype)?;
                    resident.insert(ns, tokens, kv, buf.len(), removals);
                    Ok(placed)
                })
            } else {
                import(corpus, buf, assembly, pos, dtype)
            };
            match imported {
                Ok(kv) => {
                    out.kv = Some(kv);
                    let own = found != Found::Plain;
                    out.exact = first && exact_in_first_place(corpus, first_ns == Some(ns), own);
                }
                Err(e) if e.is_kv_mismatch() => {
                    tracing::warn!(error = %e, doc = %hit.payload.doc_id, "stored KV does not fit the model; recomputing and replacing it");
                    out.corrupt = true;
                }
                // The device failed (e.g. out of memory), not the data: recomputed, the stored
                // copy left as it is.
                Err(e) => {
                    tracing::warn!(error = %e, doc = %hit.payload.doc_id, "stored KV could not be imported; recomputing");
                }
            }
            out.import = t.elapsed();
        }
        Err(e) if e.is_damage() => {
            tracing::warn!(error = %e, doc = %hit.payload.doc_id, "stored KV failed verification; recomputing and replacing it");
            out.corrupt = true;
        }
        Err(e) => {
            if !e.is_miss() {
                tracing::warn!(error = %e, doc = %hit.payload.doc_id, "KV read failed; recomputing");
            }
        }
    }
    out
}
