//! The serving pipeline's handle: [`Rag`] starts the loader, model and write-back threads
//! ([`crate::pipeline`] describes them and the request path), admits queries, hands them to
//! the loader after retrieval, and shuts the threads down.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Sender, TrySendError};
use ingest::{Corpus, Engine};
use parking_lot::Mutex;
use retrieval::Hit;
use tokio::sync::mpsc;

use crate::config::ServeConfig;
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::overlap::Timeline;
use crate::pipeline::{ms, ComputeJob, LoadJob, Prefix, Worker, Writeback};
use crate::resident::{Resident, ResidentStats};
use crate::supervise::{Alive, Faults, Health, Ticket};

use crate::events::{Event, Timings};
use crate::pipeline::Query;

/// The serving pipeline. Cheap to share (`Arc`); dropping the last handle stops its threads
/// once their queues drain.
pub struct Rag {
    /// The writer of the corpus queries read (ingest, deletes, write-backs, maintenance).
    pub engine: Arc<Engine>,
    /// `[serve]` settings.
    pub config: ServeConfig,
    /// What the server exports.
    pub metrics: Arc<Metrics>,
    /// Chunk KV kept on the model's device (`serve.resident_mb`).
    pub(crate) resident: Arc<Resident>,
    /// Rematerialize and GC jobs (requested, or on the configured schedule).
    pub maintenance: Arc<crate::Maintenance>,
    /// Faults tests inject ([`Rag::faults`]; never set in production).
    faults: Arc<Faults>,
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
    pub fn start(engine: Arc<Engine>, config: ServeConfig) -> Result<Arc<Rag>> {
        config.validate()?;
        // The prompt follows the model's own chat template (ChatML without one); the system
        // prompt is configuration, the question outside text: neither can spell control
        // tokens.
        let prompt = engine.corpus().model().rag_prompt()?;
        let tokens = engine
            .corpus()
            .model()
            .prompt_tokens(&prompt.prefix(&config.system_prompt))?;
        let ingest = engine.corpus().config();
        if ingest.context.prompt() && ingest.system_prompt != config.system_prompt {
            // Still sound (chunks keep a prompt's start as their sink), but the first chunk's
            // KV is no longer what a full prefill of this prompt computes.
            tracing::warn!(
                context = %ingest.context,
                "chunk KV was prefilled after another system prompt than serve.system_prompt"
            );
        }
        let (kv, _) = engine.corpus().model().decoder().prefill(&tokens, 0)?;
        // The model thread takes this KV: on a GPU this thread's stream must be done with it.
        engine.corpus().model().settle()?;
        let prefix = Arc::new(Prefix { tokens, kv, prompt });
        let prefix_tokens = prefix.tokens.len();
        // A configuration whose default query cannot fit is refused at start-up.
        fits_context(
            engine.corpus(),
            prefix_tokens,
            config.default_top_k,
            config.default_max_tokens,
        )
        .map_err(|e| Error::Config {
            key: "serve.default_top_k / serve.default_max_tokens",
            why: e.to_string(),
        })?;
        // ... and so is a KV budget that cannot hold one default query.
        let per_token = config.limits().cache_token_bytes(engine.corpus().model()) as usize;
        let tokens = prefix_tokens
            + config.default_top_k * engine.corpus().max_chunk_tokens()
            + config.default_max_tokens;
        let need = (tokens * per_token) as u64;
        if need > config.limits().kv_budget {
            return Err(Error::Config {
                key: "serve.kv_budget_mb",
                why: format!(
                    "{} MiB cannot hold one default query ({tokens} tokens of KV, {} MiB)",
                    config.kv_budget_mb,
                    need.div_ceil(1 << 20)
                ),
            });
        }
        let metrics = Arc::new(Metrics::default());
        let resident = Arc::new(Resident::new(config.resident_mb << 20));
        let faults = Arc::new(Faults::default());
        let health = Arc::new(Health::default());
        let (load_tx, load_rx) = bounded::<LoadJob>(config.max_inflight);
        // One loaded query waits while another computes: the loader runs one ahead.
        let (compute_tx, compute_rx) = bounded::<ComputeJob>(1);
        let (wb_tx, wb_rx) = bounded::<Writeback>(64);
        let mut workers = Vec::new();
        // Each worker gets its health guard and drops it before the queues it feeds close
        // (their senders live in its closure, dropped after it returns): a worker that stops
        // is reported stopped before the workers downstream see their input end and stop
        // too, so health names the first to stop.
        let mut spawn = |name: &'static str, f: Box<dyn FnOnce(Alive) + Send>| {
            let alive = health.register(name);
            std::thread::Builder::new()
                .name(name.into())
                .spawn(move || f(alive))
                .map(|h| workers.push(h))
                .map_err(|source| Error::Spawn {
                    thread: name,
                    source,
                })
        };
        let worker = || Worker {
            corpus: engine.corpus().clone(),
            engine: engine.clone(),
            cache_dtype: config.cache_dtype.dtype(),
            load_threads: config.load_threads(engine.corpus().model().device().is_cuda()),
            idle_load_threads: config.idle_load_threads(engine.corpus().model().device().is_cuda()),
            resident: resident.clone(),
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
                Box::new(move |alive| {
                    crate::pipeline::loader(&w, &tl, &p, load_rx, &compute_tx);
                    drop(alive);
                }),
            )?;
        }
        {
            let w = worker();
            let p = prefix.clone();
            let limits = config.limits();
            spawn(
                "ragkv-model",
                Box::new(move |alive| {
                    crate::pipeline::scheduler(&w, &timeline, &p, limits, compute_rx, &wb_tx);
                    drop(alive);
                }),
            )?;
        }
        {
            let w = worker();
            spawn(
                "ragkv-materialize",
                Box::new(move |_alive| crate::pipeline::writeback(&w, wb_rx)),
            )?;
        }
        if resident.enabled() && config.resident_warm {
            workers.push(crate::pipeline::start_warm(
                resident.clone(),
                engine.corpus().clone(),
                metrics.clone(),
                health.clone(),
            )?);
        }
        let maintenance = crate::Maintenance::new(engine.clone(), metrics.clone());
        maintenance.schedule(config.schedules()?)?;
        let admission = Arc::new(tokio::sync::Semaphore::new(config.max_inflight));
        Ok(Arc::new(Rag {
            engine,
            config,
            metrics,
            resident,
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

    /// The resident tier's figures (`serve.resident_mb`).
    pub fn resident_stats(&self) -> ResidentStats {
        self.resident.stats()
    }

    /// Empties the resident tier: the next query of every chunk reads the store (benchmarks
    /// that time cold reads call it with the page cache dropped).
    pub fn drop_resident(&self) {
        self.resident.clear()
    }

    /// Admits one query if fewer than `max_inflight` are in the pipeline: its ticket goes to
    /// [`Rag::submit`] with the query. `None`: at capacity (answer 429).
    pub fn admit(&self) -> Option<Ticket> {
        let permit = self.admission.clone().try_acquire_owned().ok()?;
        Some(Ticket::new(permit, self.metrics.clone()))
    }

    /// Test hook: the faults a test injects into the pipeline's workers.
    #[cfg(feature = "testing")]
    pub fn faults(&self) -> &Faults {
        &self.faults
    }

    /// Pipeline workers that stopped while the pipeline was open (empty: healthy).
    pub fn dead_workers(&self) -> Vec<&'static str> {
        self.health.dead()
    }

    /// What queries read: store, index, embedder, model (the engine's corpus).
    pub fn corpus(&self) -> &Arc<Corpus> {
        self.engine.corpus()
    }

    /// Stops taking queries, lets the queued ones finish (or cancel, if their clients left),
    /// stores every pending write-back, stops maintenance ([`crate::Maintenance::close`]),
    /// and joins the threads. Later queries fail with [`Error::Stopped`].
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
    pub fn retrieve(&self, q: &Query) -> Result<Vec<Hit>> {
        Faults::delay(&self.faults.retrieval_delay_ms);
        let v = self.corpus().embedder().embed_one(&q.question)?;
        Ok(self.corpus().index().search(&v, q.top_k, &q.filter)?)
    }

    /// The whole prompt of `question` over `hits` as the model sees it: the system prefix,
    /// each chunk's tokens in order (chunks that tokenize to nothing left out, as the loader
    /// does), then the question in the chat template. What `full` prefills; what a peer that
    /// recomputes everything must be given to answer the same prompt.
    pub fn prompt_tokens(&self, question: &str, hits: &[Hit]) -> Result<Vec<u32>> {
        let mut tokens = self.prefix.tokens.clone();
        for hit in hits {
            let chunk = self.corpus().chunk_tokens(&hit.payload.text)?;
            tokens.extend_from_slice(&chunk);
        }
        let q = self.prefix.question(self.corpus(), question.trim())?;
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
    ) -> Result<()> {
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
        let tx = self.load_tx.lock().clone().ok_or(Error::Stopped)?;
        self.metrics.load_queue.fetch_add(1, Ordering::Relaxed);
        let r = tx.try_send(job);
        if r.is_err() {
            self.metrics.load_queue.fetch_sub(1, Ordering::Relaxed);
        }
        match r {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => {
                self.metrics.rejected.fetch_add(1, Ordering::Relaxed);
                Err(Error::Busy {
                    queue: "loader queue",
                })
            }
            Err(TrySendError::Disconnected(_)) => Err(Error::Stopped),
        }
    }

    /// Whether `top_k` chunks, the question and `max_tokens` fit the model's context (the
    /// bound, before the question is tokenized; the exact count is checked on the model
    /// thread).
    pub fn fits_context(&self, top_k: usize, max_tokens: usize) -> Result<()> {
        fits_context(self.corpus(), self.prefix.tokens.len(), top_k, max_tokens)
    }
}

/// Whether a system prompt of `prefix` tokens, `top_k` chunks of the longest size and
/// `max_tokens` of answer fit the model's positions.
fn fits_context(corpus: &Corpus, prefix: usize, top_k: usize, max_tokens: usize) -> Result<()> {
    let (m, chunk) = (corpus.model().max_positions(), corpus.max_chunk_tokens());
    let need = prefix + top_k * chunk + max_tokens;
    if need > m {
        return Err(Error::Invalid {
            why: format!(
                "top_k {top_k} chunks of up to {chunk} tokens, the system prompt ({prefix}) \
                 and max_tokens {max_tokens} need up to {need} positions; the model has {m}"
            ),
        });
    }
    Ok(())
}
