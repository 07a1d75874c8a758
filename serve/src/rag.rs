//! The request path: retrieve → load stored KV → assemble → prefill the question → decode.
//!
//! Three named threads, joined by bounded queues:
//! - `ragkv-loader` reads each admitted query's chunk KV from the store (verified), imports
//!   it into tensors, rotates each chunk's keys to the positions it takes in the prompt
//!   (consecutive, after the system prefix), and tokenizes the question. It works ahead of
//!   the model: the queue to the model holds one loaded query, so the next query's KV is read
//!   while the batch decodes. How much of each load ran while the model was busy is measured
//!   ([`crate::overlap`]) and reported.
//! - `ragkv-model` runs the continuous-batching scheduler ([`crate::batch`]): loaded queries
//!   join the batch between steps while it has room and their KV fits the budget (assembled
//!   from the system prefix, computed once, and the chunks' KV by the query's [`Assembly`]
//!   strategy; a chunk whose KV is missing or fails verification is prefilled inline and
//!   queued for writing back), every query in the batch advances by one step at a time, and
//!   each streams text to its own channel.
//! - `ragkv-materialize` writes those KVs back to the store, attached to the chunk's
//!   document version, so the next query finds them.
//!
//! Retrieval (embedding the question, vector search) runs in `spawn_blocking` before a query
//! enters the loader queue. Admission is bounded by `max_inflight`: each admitted query's
//! [`Ticket`] travels with its job and is given back when the job leaves the pipeline, so the
//! queues (sized to `max_inflight`) never block a sender. A panic on one job fails that job
//! only (a panic in a batch step, the queries of that step); a worker that stops makes
//! `/healthz` fail ([`crate::supervise`]). [`Rag::shutdown`] drains the queues and joins the
//! threads, so pending write-backs are stored.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, Sender, TrySendError};
use ingest::Engine;
use model::{GenerateParams, Kv};
use parking_lot::Mutex;
use retrieval::{Hit, SearchFilter};
use serde::Serialize;
use tokio::sync::mpsc;

use crate::assembly::Assembly;
use crate::config::ServeConfig;
use crate::context::{read_chunks, Loaded, Writeback};
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
    /// The question.
    pub question: String,
    /// Chunks to retrieve.
    pub top_k: usize,
    /// Which documents may be retrieved.
    pub filter: SearchFilter,
    /// Generation options.
    pub params: GenerateParams,
    /// Whether stored KV is used.
    pub kv: KvMode,
    /// How the chunks' KV is assembled.
    pub assembly: Assembly,
}

pub(crate) type Failure = (FailKind, String);

pub(crate) fn internal(e: impl std::fmt::Display) -> Failure {
    (FailKind::Internal, e.to_string())
}

pub(crate) struct LoadJob {
    /// Admission: given back when the job is dropped, wherever that happens.
    pub ticket: Ticket,
    pub query: Query,
    pub hits: Vec<Hit>,
    pub events: mpsc::Sender<Event>,
    pub arrived: Instant,
    pub timings: Timings,
}

/// A loaded query, ready to join the model's batch.
pub(crate) struct ComputeJob {
    pub job: LoadJob,
    pub chunks: Vec<Loaded>,
    /// The question's tokens in the chat template.
    pub question: Vec<u32>,
    /// Tokens of the whole prompt: prefix, chunks, question.
    pub prompt_tokens: usize,
    pub queued_at: Instant,
}

impl ComputeJob {
    /// Tokens the query's cache holds at most: the prompt and the answer.
    pub fn cache_tokens(&self) -> usize {
        self.prompt_tokens + self.job.query.params.max_tokens + 1
    }
}

/// The system prompt's KV, computed once, and where the model's chat template puts the
/// question.
pub(crate) struct Prefix {
    pub tokens: Vec<u32>,
    pub kv: Kv,
    pub prompt: model::RagPrompt,
}

impl Prefix {
    /// The question's tokens, in the chat template after the chunks.
    pub fn question(&self, engine: &Engine, text: &str) -> model::Result<Vec<u32>> {
        engine
            .model
            .tokenizer()
            .encode_pieces(&self.prompt.question(text))
    }
}

/// The serving pipeline. Cheap to share (`Arc`); dropping the last handle stops its threads
/// once their queues drain.
pub struct Rag {
    /// Store, index, embedder and model.
    pub engine: Arc<Engine>,
    /// `[serve]` settings.
    pub config: ServeConfig,
    /// What the server exports.
    pub metrics: Arc<Metrics>,
    /// Rematerialize and GC jobs (requested, or on the configured schedule).
    pub maintenance: Arc<crate::Maintenance>,
    /// Faults tests inject (never set in production).
    pub faults: Arc<Faults>,
    /// A random id of this server process: `/healthz` sends it (`x-ragkv-instance`) so that
    /// the CLI can tell the server that wrote `server.json` from whatever listens there now.
    pub instance: String,
    health: Arc<Health>,
    /// The system prefix's tokens and KV.
    pub(crate) prefix: Arc<Prefix>,
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
        // The model thread takes this KV: on a GPU this thread's stream must be done with it.
        engine.model.settle().map_err(|e| e.to_string())?;
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
        // ... and so is a KV budget that cannot hold one default query.
        let per_token = config.limits().cache_token_bytes(&engine.model) as usize;
        let tokens = prefix_tokens
            + config.default_top_k * engine.max_chunk_tokens()
            + config.default_max_tokens;
        let need = (tokens * per_token) as u64;
        if need > config.limits().kv_budget {
            return Err(format!(
                "serve.kv_budget_mb: {} MiB cannot hold one default query ({tokens} tokens of \
                 KV, {} MiB)",
                config.kv_budget_mb,
                need.div_ceil(1 << 20)
            ));
        }
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
        let worker = || Worker {
            engine: engine.clone(),
            cache_dtype: config.cache_dtype.dtype(),
            metrics: metrics.clone(),
            faults: faults.clone(),
        };
        let timeline = Arc::new(Timeline::default());
        {
            let w = worker();
            let tl = timeline.clone();
            let p = prefix.clone();
            spawn(
                "ragkv-loader",
                Box::new(move || loader(&w, &tl, &p, load_rx, compute_tx)),
            )?;
        }
        {
            let w = worker();
            let p = prefix.clone();
            let limits = config.limits();
            spawn(
                "ragkv-model",
                Box::new(move || crate::batch::run(&w, &timeline, &p, limits, compute_rx, wb_tx)),
            )?;
        }
        {
            let w = worker();
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
            prefix,
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
    /// stores every pending write-back, stops maintenance ([`crate::Maintenance::close`]),
    /// and joins the threads. Later queries fail with [`FailKind::Unavailable`].
    pub fn shutdown(&self) {
        self.health.closing();
        self.maintenance.close();
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

    /// The whole prompt of `question` over `hits` as the model sees it: the system prefix,
    /// each chunk's tokens in order (chunks that tokenize to nothing left out, as the loader
    /// does), then the question in the chat template. What `full` prefills; what a peer that
    /// recomputes everything must be given to answer the same prompt.
    pub fn prompt_tokens(&self, question: &str, hits: &[Hit]) -> Result<Vec<u32>, String> {
        let mut tokens = self.prefix.tokens.clone();
        for hit in hits {
            let chunk = self
                .engine
                .chunk_tokens(&hit.payload.text)
                .map_err(|e| format!("chunk tokens: {e}"))?;
            tokens.extend_from_slice(&chunk);
        }
        let q = self
            .prefix
            .question(&self.engine, question.trim())
            .map_err(|e| format!("question tokens: {e}"))?;
        tokens.extend_from_slice(&q);
        Ok(tokens)
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
            ticket,
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
        fits_context(&self.engine, self.prefix.tokens.len(), top_k, max_tokens)
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
pub(crate) struct Worker {
    pub engine: Arc<Engine>,
    /// `serve.cache_dtype`.
    pub cache_dtype: model::DType,
    pub metrics: Arc<Metrics>,
    pub faults: Arc<Faults>,
}

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn loader(
    w: &Worker,
    timeline: &Timeline,
    prefix: &Prefix,
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
            load(w, timeline, prefix, &mut buf, job)
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

/// Reads one query's chunks and tokenizes its question; `None` when the query ended here
/// (cancelled, or failed and told).
fn load(
    w: &Worker,
    timeline: &Timeline,
    prefix: &Prefix,
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
    let hits = std::mem::take(&mut job.hits);
    let start = prefix.tokens.len();
    let chunks = match read_chunks(engine, m, &job.query, hits, start, buf, w.cache_dtype) {
        Ok(c) => c,
        Err(e) => {
            finish_err(m, &job.events, internal(e));
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
    let question = match prefix.question(engine, &job.query.question) {
        Ok(q) => q,
        Err(e) => {
            finish_err(m, &job.events, internal(e));
            return None;
        }
    };
    let context: usize = chunks.iter().map(|c| c.tokens.len()).sum();
    let prompt_tokens = prefix.tokens.len() + context + question.len();
    let limit = engine.model.max_positions();
    if prompt_tokens + job.query.params.max_tokens > limit {
        let e = format!(
            "the prompt ({prompt_tokens} tokens) and max_tokens ({}) exceed the model's \
             context ({limit} positions): lower top_k or max_tokens",
            job.query.params.max_tokens
        );
        finish_err(m, &job.events, (FailKind::Invalid, e));
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

pub(crate) fn finish_err(m: &Metrics, events: &mpsc::Sender<Event>, (kind, e): Failure) {
    tracing::warn!(error = %e, ?kind, "query failed");
    m.failed.fetch_add(1, Ordering::Relaxed);
    let _ = events.blocking_send(Event::Error(kind, e));
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
