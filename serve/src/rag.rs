//! The request path: retrieve → load stored KV → assemble → prefill the question → decode.
//!
//! Three named threads, joined by bounded queues:
//! - `ragkv-loader` reads each admitted query's chunk KV from the store (verified), imports
//!   it into tensors and rotates each chunk's keys to the positions it takes in the prompt
//!   (consecutive, after the system prefix). It works ahead of the model: the queue to the
//!   model holds one loaded query, so query N+1's KV is read while query N decodes. How much
//!   of each load ran while the model was busy is measured ([`crate::overlap`]) and reported.
//! - `ragkv-model` assembles the prompt cache (the system prefix, computed once, then the
//!   chunks' KV, by the query's [`Assembly`] strategy), prefills the question and decodes,
//!   sending text to the query's own channel. A chunk whose KV is missing or fails verification is
//!   prefilled inline, and its KV is queued for writing back.
//! - `ragkv-materialize` writes those KVs back to the store, attached to the chunk's
//!   document version, so the next query finds them.
//!
//! Retrieval (embedding the question, vector search) runs in `spawn_blocking` before a query
//! enters the loader queue. Admission is bounded by `max_inflight`: each admitted query's
//! [`Ticket`] travels with its job and is given back when the job leaves the pipeline, so the
//! queues (sized to `max_inflight`) never block a sender. A panic on one job fails that job
//! only; a worker that stops makes `/healthz` fail ([`crate::supervise`]). [`Rag::shutdown`]
//! drains the queues and joins the threads, so pending write-backs are stored.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, Sender, TrySendError};
use ingest::Engine;
use model::{GenerateParams, Kv, KvCache};
use parking_lot::Mutex;
use retrieval::{Hit, SearchFilter};
use serde::Serialize;
use tokio::sync::mpsc;

use crate::assembly::{assemble, Assembly};
use crate::config::ServeConfig;
use crate::metrics::Metrics;
use crate::overlap::Timeline;
use crate::supervise::{contain, Faults, Health, Ticket};

pub use crate::events::{Citation, Event, FailKind, Final, KvSource, Timings};

/// Whether stored KV is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KvMode {
    /// Load stored KV; prefill (and write back) only what is missing.
    On,
    /// Recompute every chunk's KV now, exactly as ingest computes it (same positions, same
    /// dtype rounding), then assemble identically: for comparison and debugging.
    Off,
}

/// A validated query.
#[derive(Debug, Clone)]
pub struct Query {
    pub question: String,
    pub top_k: usize,
    pub filter: SearchFilter,
    pub params: GenerateParams,
    pub kv: KvMode,
    pub assembly: Assembly,
}

type Failure = (FailKind, String);

fn internal(e: impl std::fmt::Display) -> Failure {
    (FailKind::Internal, e.to_string())
}

struct LoadJob {
    /// Admission: given back when the job is dropped, wherever that happens.
    _ticket: Ticket,
    query: Query,
    hits: Vec<Hit>,
    events: mpsc::Sender<Event>,
    arrived: Instant,
    timings: Timings,
}

struct Loaded {
    hit: Hit,
    tokens: Vec<u32>,
    /// Stored KV, already at the chunk's place in the prompt; `None`: prefill it.
    kv: Option<Kv>,
    /// The stored copy failed verification: write the recomputed KV over it.
    corrupt: bool,
}

struct ComputeJob {
    job: LoadJob,
    chunks: Vec<Loaded>,
    queued_at: Instant,
}

struct Writeback {
    doc: String,
    hash: String,
    tokens: Vec<u32>,
    bytes: Vec<u8>,
    replace: bool,
}

/// The system prompt's KV, computed once, and where the model's chat template puts the
/// question.
struct Prefix {
    tokens: Vec<u32>,
    kv: Kv,
    prompt: model::RagPrompt,
}

/// The serving pipeline. Cheap to share (`Arc`); dropping the last handle stops its threads
/// once their queues drain.
pub struct Rag {
    pub engine: Arc<Engine>,
    pub config: ServeConfig,
    pub metrics: Arc<Metrics>,
    /// Rematerialize and GC jobs (requested, or on the configured schedule).
    pub maintenance: Arc<crate::Maintenance>,
    /// Faults tests inject (never set in production).
    pub faults: Arc<Faults>,
    /// A random id of this server process: `/healthz` sends it (`x-ragkv-instance`) so that
    /// the CLI can tell the server that wrote `server.json` from whatever listens there now.
    pub instance: String,
    health: Arc<Health>,
    /// Tokens of the system prefix.
    prefix_tokens: usize,
    /// `max_inflight` permits; see [`Rag::admit`].
    admission: Arc<tokio::sync::Semaphore>,
    /// `None` once shut down.
    load_tx: Mutex<Option<Sender<LoadJob>>>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

impl std::fmt::Debug for Rag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rag")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Rag {
    /// Starts the loader, model and write-back threads.
    pub fn start(engine: Arc<Engine>, config: ServeConfig) -> Result<Arc<Rag>, String> {
        config.validate()?;
        // The prompt follows the model's own chat template (ChatML without one); the system
        // prompt is configuration, the question outside text: neither can spell control
        // tokens.
        let prompt = engine.model.rag_prompt().map_err(|e| e.to_string())?;
        let tokens = engine
            .model
            .prompt_tokens(&prompt.prefix(&config.system_prompt))
            .map_err(|e| e.to_string())?;
        let (kv, _) = engine
            .model
            .prefill(&tokens, 0)
            .map_err(|e| e.to_string())?;
        let prefix = Arc::new(Prefix { tokens, kv, prompt });
        let prefix_tokens = prefix.tokens.len();
        // A configuration whose default query cannot fit is refused at start-up.
        fits_context(
            &engine,
            prefix_tokens,
            config.default_top_k,
            config.default_max_tokens,
        )
        .map_err(|e| format!("serve.default_top_k / serve.default_max_tokens: {e}"))?;
        let metrics = Arc::new(Metrics::default());
        let faults = Arc::new(Faults::default());
        let health = Arc::new(Health::default());
        let (load_tx, load_rx) = bounded::<LoadJob>(config.max_inflight);
        // One loaded query waits while another computes: the loader runs one ahead.
        let (compute_tx, compute_rx) = bounded::<ComputeJob>(1);
        let (wb_tx, wb_rx) = bounded::<Writeback>(64);
        let mut workers = Vec::new();
        let mut spawn = |name: &'static str, f: Box<dyn FnOnce() + Send>| {
            let alive = health.register(name);
            std::thread::Builder::new()
                .name(name.into())
                .spawn(move || {
                    let _alive = alive;
                    f()
                })
                .map(|h| workers.push(h))
                .map_err(|e| format!("spawning {name}: {e}"))
        };
        let timeline = Arc::new(Timeline::default());
        {
            let w = Worker {
                engine: engine.clone(),
                metrics: metrics.clone(),
                faults: faults.clone(),
            };
            let tl = timeline.clone();
            let start = prefix.tokens.len();
            spawn(
                "ragkv-loader",
                Box::new(move || loader(&w, &tl, start, load_rx, compute_tx)),
            )?;
        }
        {
            let w = Worker {
                engine: engine.clone(),
                metrics: metrics.clone(),
                faults: faults.clone(),
            };
            let p = prefix.clone();
            let share = config.recompute_share;
            spawn(
                "ragkv-model",
                Box::new(move || compute(&w, &timeline, &p, share, compute_rx, wb_tx)),
            )?;
        }
        {
            let w = Worker {
                engine: engine.clone(),
                metrics: metrics.clone(),
                faults: faults.clone(),
            };
            spawn("ragkv-materialize", Box::new(move || writeback(&w, wb_rx)))?;
        }
        let maintenance = crate::Maintenance::new(engine.clone(), metrics.clone());
        maintenance.schedule(config.schedules()?)?;
        let admission = Arc::new(tokio::sync::Semaphore::new(config.max_inflight));
        Ok(Arc::new(Rag {
            engine,
            config,
            metrics,
            maintenance,
            faults,
            instance: uuid::Uuid::new_v4().simple().to_string(),
            health,
            prefix_tokens,
            admission,
            load_tx: Mutex::new(Some(load_tx)),
            workers: Mutex::new(workers),
        }))
    }

    /// Admits one query if fewer than `max_inflight` are in the pipeline: its ticket goes to
    /// [`Rag::submit`] with the query. `None`: at capacity (answer 429).
    pub fn admit(&self) -> Option<Ticket> {
        let permit = self.admission.clone().try_acquire_owned().ok()?;
        Some(Ticket::new(permit, self.metrics.clone()))
    }

    /// Pipeline workers that stopped while the pipeline was open (empty: healthy).
    pub fn dead_workers(&self) -> Vec<&'static str> {
        self.health.dead()
    }

    /// Stops taking queries, lets the queued ones finish (or cancel, if their clients left),
    /// stores every pending write-back, and joins the threads. Later queries fail with
    /// [`FailKind::Unavailable`].
    pub fn shutdown(&self) {
        self.health.closing();
        drop(self.load_tx.lock().take());
        for h in self.workers.lock().drain(..) {
            let name = h.thread().name().unwrap_or("?").to_string();
            if h.join().is_err() {
                tracing::error!(worker = %name, "pipeline worker had panicked");
            }
        }
    }

    /// Retrieval: blocking (embedding, vector search); call from `spawn_blocking`.
    pub fn retrieve(&self, q: &Query) -> Result<Vec<Hit>, String> {
        Faults::delay(&self.faults.retrieval_delay_ms);
        let v = self
            .engine
            .embedder
            .embed_one(&q.question)
            .map_err(|e| e.to_string())?;
        self.engine
            .index
            .search(&v, q.top_k, &q.filter)
            .map_err(|e| e.to_string())
    }

    /// Hands a retrieved query to the loader. Never blocks for admitted queries (the queue
    /// holds `max_inflight`, one per ticket); fails if the pipeline is gone.
    pub fn submit(
        &self,
        ticket: Ticket,
        query: Query,
        hits: Vec<Hit>,
        events: mpsc::Sender<Event>,
        arrived: Instant,
        retrieve: Duration,
    ) -> Result<(), (FailKind, String)> {
        let job = LoadJob {
            _ticket: ticket,
            query,
            hits,
            events,
            arrived,
            timings: Timings {
                retrieve_ms: ms(retrieve),
                ..Timings::default()
            },
        };
        let stopped = || {
            (
                FailKind::Unavailable,
                "the serving pipeline has stopped".into(),
            )
        };
        let tx = self.load_tx.lock().clone().ok_or_else(stopped)?;
        self.metrics.load_queue.fetch_add(1, Ordering::Relaxed);
        let r = tx.try_send(job);
        if r.is_err() {
            self.metrics.load_queue.fetch_sub(1, Ordering::Relaxed);
        }
        match r {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => {
                self.metrics.rejected.fetch_add(1, Ordering::Relaxed);
                Err((FailKind::Busy, "the loader queue is full".into()))
            }
            Err(TrySendError::Disconnected(_)) => Err(stopped()),
        }
    }

    /// Whether `top_k` chunks, the question and `max_tokens` fit the model's context (the
    /// bound, before the question is tokenized; the exact count is checked on the model
    /// thread).
    pub fn fits_context(&self, top_k: usize, max_tokens: usize) -> Result<(), String> {
        fits_context(&self.engine, self.prefix_tokens, top_k, max_tokens)
    }
}

/// Whether a system prompt of `prefix` tokens, `top_k` chunks of the longest size and
/// `max_tokens` of answer fit the model's positions.
fn fits_context(
    engine: &Engine,
    prefix: usize,
    top_k: usize,
    max_tokens: usize,
) -> Result<(), String> {
    let (m, chunk) = (engine.model.max_positions(), engine.max_chunk_tokens());
    let need = prefix + top_k * chunk + max_tokens;
    if need > m {
        return Err(format!(
            "top_k {top_k} chunks of up to {chunk} tokens, the system prompt ({prefix}) and \
             max_tokens {max_tokens} need up to {need} positions; the model has {m}"
        ));
    }
    Ok(())
}

/// What each pipeline thread works with.
struct Worker {
    engine: Arc<Engine>,
    metrics: Arc<Metrics>,
    faults: Arc<Faults>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// A chunk's KV bytes (stored layout, positions `0..n`) as tensors in the model's dtype on the
/// model's device (the host-to-device copy happens here, on the loader thread, overlapping
/// the decoder's work), placed for a prompt where the chunk starts at `pos`.
fn import(engine: &Engine, bytes: &[u8], assembly: Assembly, pos: usize) -> model::Result<Kv> {
    let model = &engine.model;
    Kv::from_bytes(bytes, &engine.layout(), model.device())
        .and_then(|kv| kv.to(model.device(), model.dtype()))
        .and_then(|kv| assembly.place(model, kv, pos))
}

/// `start`: the first chunk's position (the system prefix's length).
fn loader(
    w: &Worker,
    timeline: &Timeline,
    start: usize,
    rx: Receiver<LoadJob>,
    tx: Sender<ComputeJob>,
) {
    let m = &w.metrics;
    let mut buf = Vec::new();
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
            load(w, timeline, start, &mut buf, job)
        }) {
            Ok(Some(cj)) => {
                m.compute_queue.fetch_add(1, Ordering::Relaxed);
                if tx.send(cj).is_err() {
                    return;
                }
            }
            Ok(None) => {}
            Err(e) => finish_err(m, &events, internal(e)),
        }
    }
}

/// Reads one query's chunks; `None` when the query ended here (cancelled, or failed and told).
fn load(
    w: &Worker,
    timeline: &Timeline,
    start: usize,
    buf: &mut Vec<u8>,
    mut job: LoadJob,
) -> Option<ComputeJob> {
    let (engine, m) = (&*w.engine, &*w.metrics);
    if job.events.is_closed() {
        m.cancelled.fetch_add(1, Ordering::Relaxed);
        return None;
    }
    let t = Instant::now();
    job.timings.queue_ms += ms(job.arrived.elapsed()) - job.timings.retrieve_ms;
    let mut chunks = Vec::with_capacity(job.hits.len());
    let mut pos = start;
    for hit in std::mem::take(&mut job.hits) {
        let tokens = match engine.chunk_tokens(&hit.payload.text) {
            Ok(t) if !t.is_empty() => t,
            Ok(_) => continue,
            Err(e) => {
                finish_err(m, &job.events, internal(format!("loading chunks: {e}")));
                return None;
            }
        };
        let mut corrupt = false;
        let kv = if job.query.kv == KvMode::On && job.query.assembly.uses_stored_kv() {
            match engine
                .store
                .get_batch_into(engine.namespace(), &tokens, tokens.len(), buf)
            {
                Ok(_) => {
                    m.kv_bytes_loaded
                        .fetch_add(buf.len() as u64, Ordering::Relaxed);
                    match import(engine, buf, job.query.assembly, pos) {
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
        pos += tokens.len();
        chunks.push(Loaded {
            hit,
            tokens,
            kv,
            corrupt,
        });
    }
    let end = Instant::now();
    let (took, hidden) = (end - t, timeline.overlap(t, end));
    job.timings.load_ms = ms(took);
    job.timings.load_hidden_ms = ms(hidden);
    m.kv_load_us
        .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
    m.kv_load_hidden_us
        .fetch_add(hidden.as_micros() as u64, Ordering::Relaxed);
    Some(ComputeJob {
        job,
        chunks,
        queued_at: Instant::now(),
    })
}

fn finish_err(m: &Metrics, events: &mpsc::Sender<Event>, (kind, e): Failure) {
    tracing::warn!(error = %e, ?kind, "query failed");
    m.failed.fetch_add(1, Ordering::Relaxed);
    let _ = events.blocking_send(Event::Error(kind, e));
}

fn compute(
    w: &Worker,
    timeline: &Timeline,
    prefix: &Prefix,
    recompute_share: f64,
    rx: Receiver<ComputeJob>,
    wb: Sender<Writeback>,
) {
    let m = &*w.metrics;
    for cj in rx {
        m.compute_queue.fetch_sub(1, Ordering::Relaxed);
        let events = cj.job.events.clone();
        if events.is_closed() {
            m.cancelled.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        timeline.start(Instant::now());
        let r = contain("ragkv-model", m, || {
            if Faults::take(&w.faults.panic_model) {
                panic!("injected model fault");
            }
            answer(&w.engine, m, prefix, recompute_share, cj, &wb)
        });
        timeline.stop(Instant::now());
        // The job (and its ticket) is gone by now: the answer is final.
        match r.map_err(internal).and_then(|r| r) {
            Ok(Some(f)) => {
                if f.finish_reason == "cancelled" {
                    m.cancelled.fetch_add(1, Ordering::Relaxed);
                }
                let _ = events.blocking_send(Event::Done(Box::new(f)));
            }
            Ok(None) => {
                m.cancelled.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => finish_err(m, &events, e),
        }
    }
}

/// Assembles, prefills and decodes one query. `Ok(None)`: the client went away.
fn answer(
    engine: &Engine,
    m: &Metrics,
    prefix: &Prefix,
    recompute_share: f64,
    cj: ComputeJob,
    wb: &Sender<Writeback>,
) -> Result<Option<Final>, Failure> {
    let ComputeJob {
        job,
        chunks,
        queued_at,
    } = cj;
    let LoadJob {
        query,
        events,
        arrived,
        mut timings,
        ..
    } = job;
    timings.queue_ms += ms(queued_at.elapsed());
    let model = &engine.model;
    let s = internal;

    // Assemble: prefix, then each chunk at its place (the loader placed stored KV there).
    let t = Instant::now();
    let full = query.assembly == Assembly::Full;
    let mut parts = Vec::with_capacity(chunks.len());
    let mut context = prefix.tokens.clone();
    let mut citations = Vec::with_capacity(chunks.len());
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
                let kv = import(engine, &bytes, query.assembly, pos).map_err(s)?;
                if query.kv == KvMode::On {
                    misses += 1;
                    let wbm = Writeback {
                        doc: c.hit.payload.doc_id.clone(),
                        hash: c.hit.payload.doc_hash.clone(),
                        tokens: c.tokens.clone(),
                        bytes,
                        replace: c.corrupt,
                    };
                    if wb.try_send(wbm).is_err() {
                        tracing::warn!("write-back queue full; chunk stays unmaterialized");
                    }
                    (kv, KvSource::Recomputed)
                } else {
                    (kv, KvSource::Off)
                }
            }
        };
        citations.push(citation(source));
        parts.push(kv);
    }
    m.kv_hits.fetch_add(hits as u64, Ordering::Relaxed);
    m.kv_misses.fetch_add(misses as u64, Ordering::Relaxed);
    let mut question = model
        .tokenizer()
        .encode_pieces(&prefix.prompt.question(&query.question))
        .map_err(s)?;
    let prompt_tokens = context.len() + question.len();
    let limit = model.max_positions();
    if prompt_tokens + query.params.max_tokens > limit {
        return Err((
            FailKind::Invalid,
            format!(
                "the prompt ({prompt_tokens} tokens) and max_tokens ({}) exceed the model's \
                 context ({limit} positions): lower top_k or max_tokens",
                query.params.max_tokens
            ),
        ));
    }
    let (all, recomputed) = if full {
        // The reference: the chunks are prefilled with the question, after the exact prefix.
        question.splice(0..0, context[prefix.tokens.len()..].iter().copied());
        (prefix.kv.clone(), 0)
    } else {
        assemble(
            model,
            query.assembly,
            recompute_share,
            &prefix.kv,
            parts,
            &context,
        )
        .map_err(s)?
    };
    let mut cache =
        KvCache::from_kv(&all, question.len() + query.params.max_tokens + 1).map_err(s)?;
    timings.assemble_ms = ms(t.elapsed());

    // Prefill the question, decode.
    let t = Instant::now();
    let mut first: Option<Instant> = None;
    let mut last = Instant::now();
    let mut gone = false;
    let generation = model::generate(
        model.decoder(),
        model.tokenizer(),
        &mut cache,
        &question,
        &query.params,
        |piece| {
            let now = Instant::now();
            match first {
                None => {
                    first = Some(now);
                    m.ttft.observe((now - arrived).as_secs_f64());
                }
                Some(_) => m.itl.observe((now - last).as_secs_f64()),
            }
            last = now;
            if events
                .blocking_send(Event::Token(piece.to_string()))
                .is_err()
            {
                gone = true;
                return false;
            }
            true
        },
    )
    .map_err(s)?;
    if gone {
        return Ok(None);
    }
    let end = Instant::now();
    let first = first.unwrap_or(end);
    timings.prefill_ms = ms(first - t);
    timings.first_token_ms = ms(first - arrived);
    timings.decode_ms = ms(end - first);
    timings.total_ms = ms(end - arrived);
    m.tokens_generated
        .fetch_add(generation.tokens.len() as u64, Ordering::Relaxed);
    Ok(Some(Final {
        answer: generation.text,
        citations,
        kv_hits: hits,
        kv_misses: misses,
        prompt_tokens,
        assembly: query.assembly,
        recomputed_tokens: recomputed,
        completion_tokens: generation.tokens.len(),
        finish_reason: match generation.finish {
            model::FinishReason::Stop => "stop",
            model::FinishReason::Length => "length",
            model::FinishReason::Cancelled => "cancelled",
        }
        .into(),
        timings,
    }))
}

fn writeback(w: &Worker, rx: Receiver<Writeback>) {
    let m = &*w.metrics;
    for wb in rx {
        Faults::delay(&w.faults.writeback_delay_ms);
        let r = contain("ragkv-materialize", m, || {
            if Faults::take(&w.faults.panic_writeback) {
                panic!("injected write-back fault");
            }
            w.engine
                .write_back(&wb.doc, &wb.hash, &wb.tokens, &wb.bytes, wb.replace)
                .map_err(|e| e.to_string())
        });
        match r.and_then(|r| r) {
            Ok(true) => {
                m.rematerialized.fetch_add(1, Ordering::Relaxed);
            }
            Ok(false) => {
                tracing::debug!(doc = %wb.doc, "write-back skipped: the version is gone")
            }
            Err(e) => tracing::warn!(error = %e, doc = %wb.doc, "KV write-back failed"),
        }
    }
}
