//! The model thread (`ragkv-model`): continuous batching.
//!
//! `ragkv-model` runs a scheduler over the queries the loader hands it, loaded:
//! - **Join, between steps.** While the batch has room (`serve.max_batch`) and the next
//!   query's KV fits the budget (`serve.kv_budget_mb`: each admitted query reserves its whole
//!   cache, prompt and `max_tokens`, when it joins), the query is assembled (the system
//!   prefix, its chunks' KV by its [`Assembly`] strategy, chunks without stored KV prefilled
//!   inline and queued for write-back) and joins. A query that does not fit waits, and the
//!   queues behind it fill: the loader stops reading ahead, and admission answers 429 past
//!   `serve.max_inflight`. KV memory stays bounded by the budget plus the few loaded queries
//!   the queues hold (the model's input queue holds one; the scheduler keeps one waiting).
//! - **Step.** Every query in the batch runs in one [`model::Decoder::step`]: a query that
//!   just joined feeds its question (at most `serve.prefill_chunk` tokens per step, so a long
//!   prompt does not stall the others' next token for long), the others feed the token they
//!   sampled last. Projections and MLP see the step's tokens as one batch (each weight read
//!   once per step); attention runs per query over its own cache.
//! - **Sample and stream.** Each query samples from its own row with its own parameters
//!   ([`model::Decoding`]). Text is never sent blocking: it waits in the query's outbox while
//!   its channel is full, so a slow reader cannot hold up the batch.
//! - **Leave.** A query leaves when it finishes or when its client has gone (checked every
//!   step); its cache and budget are freed at once and its admission ticket given back before
//!   the final event is sent. Final events a full channel cannot take yet are retried between
//!   steps.
//!
//! A panic while a query joins fails that query only; a panic in a step fails the queries in
//! that step (their caches may be half-written), and the scheduler goes on with the next ones.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use model::{Decoding, KvCache, StepSeq, Tensor};
use tokio::sync::mpsc::{self, error::TrySendError};

use super::assemble::{assemble, Request};
use super::job::{finish_err, ms, ComputeJob, LoadJob, Prefix, Worker, Writeback};
use crate::assembly::{LinkTiming, Repair, Target};
use crate::error::{Error, Result};
use crate::events::{Event, Final, Timings};
use crate::metrics::Metrics;
use crate::overlap::Timeline;
use crate::supervise::{contain, Faults, Ticket};

/// How long, at shutdown, final events wait for clients whose channels are full.
const LINGER: Duration = Duration::from_secs(2);

/// How the scheduler bounds a batch (`[serve]`'s settings).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub max_batch: usize,
    /// Bytes of KV cache the admitted queries may reserve together.
    pub kv_budget: u64,
    pub prefill_chunk: usize,
    pub repair: Repair,
    /// Dtype of the decoding caches (`serve.cache_dtype`).
    pub cache_dtype: model::DType,
}

impl Limits {
    /// Bytes of decoding cache per token: what the budget counts.
    pub fn cache_token_bytes(&self, model: &model::Model) -> u64 {
        model
            .kv_layout()
            .and_then(|mut l| {
                if self.cache_dtype == model::Q8_CACHE {
                    let (layers, heads) = (l.layers as usize, l.kv_heads as usize);
                    return Ok(model::q8_bytes_per_token(
                        layers,
                        heads,
                        l.head_dim as usize,
                    ));
                }
                l.dtype = model::kv_schema_dtype(self.cache_dtype)?;
                Ok(l.bytes_per_token())
            })
            .map_or(0, |b| b as u64)
    }
}

/// A query in the batch.
struct Active<'m> {
    /// Admission: given back when the query leaves the batch.
    ticket: Ticket,
    events: mpsc::Sender<Event>,
    arrived: Instant,
    timings: Timings,
    report: Final,
    cache: KvCache,
    decoding: Decoding<'m>,
    /// Tokens for the next steps: the question, then the token sampled last.
    pending: Vec<u32>,
    /// Logits its assembly already computed (a repair runs the question in its own pass):
    /// its first step samples from them instead of feeding anything.
    ready: Option<Tensor>,
    /// Cache rows its `link` repair still has to recompute: the first `redo.len()` tokens of
    /// `pending` are theirs, fed in the query's first step with the start of its question.
    redo: Vec<usize>,
    /// Budget bytes held.
    reserved: u64,
    /// When its first step began; when its first and latest text came.
    started: Option<Instant>,
    first: Option<Instant>,
    last: Instant,
    outbox: String,
    gone: bool,
}

/// A query that has left the batch, with events its channel could not take yet.
struct Leaving {
    events: mpsc::Sender<Event>,
    queue: VecDeque<Event>,
}

/// Sends what `events` takes now; `Err(())` when the receiver is gone.
fn flush(events: &mpsc::Sender<Event>, queue: &mut VecDeque<Event>) -> Result<(), ()> {
    while let Some(e) = queue.pop_front() {
        match events.try_send(e) {
            Ok(()) => {}
            Err(TrySendError::Full(e)) => {
                queue.push_front(e);
                return Ok(());
            }
            Err(TrySendError::Closed(_)) => return Err(()),
        }
    }
    Ok(())
}

/// The scheduler loop; returns when the input queue is closed and every query has left.
pub(crate) fn run(
    w: &Worker,
    timeline: &Timeline,
    prefix: &Prefix,
    limits: Limits,
    rx: Receiver<ComputeJob>,
    wb: &Sender<Writeback>,
) {
    let m = &*w.metrics;
    let token_bytes = limits.cache_token_bytes(w.corpus.model());
    let mut active: Vec<Active<'_>> = Vec::new();
    let mut leaving: Vec<Leaving> = Vec::new();
    let mut waiting: Option<ComputeJob> = None;
    let mut used = 0u64;
    let mut open = true;
    let mut closing: Option<Instant> = None;
    loop {
        leaving.retain_mut(|l| flush(&l.events, &mut l.queue).is_ok() && !l.queue.is_empty());
        // Join: queued queries while they fit.
        loop {
            let cj = match waiting.take() {
                Some(cj) => cj,
                None if !open => break,
                None => {
                    let got = if active.is_empty() && leaving.is_empty() {
                        timeline.stop(Instant::now());
                        rx.recv().map_err(|_| TryRecvError::Disconnected)
                    } else if active.is_empty() {
                        rx.recv_timeout(Duration::from_millis(5))
                            .map_err(|e| match e {
                                RecvTimeoutError::Timeout => TryRecvError::Empty,
                                RecvTimeoutError::Disconnected => TryRecvError::Disconnected,
                            })
                    } else {
                        rx.try_recv()
                    };
                    match got {
                        Ok(cj) => {
                            m.compute_queue.fetch_sub(1, Ordering::Relaxed);
                            cj
                        }
                        Err(TryRecvError::Empty) => break,
                        Err(TryRecvError::Disconnected) => {
                            open = false;
                            break;
                        }
                    }
                }
            };
            if cj.job.events.is_closed() {
                m.cancelled.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let need = cj.cache_tokens() as u64 * token_bytes;
            if need > limits.kv_budget {
                let why = format!(
                    "the query needs {} MiB of KV cache ({} tokens); serve.kv_budget_mb is {}: \
                     lower top_k or max_tokens",
                    need >> 20,
                    cj.cache_tokens(),
                    limits.kv_budget >> 20
                );
                finish_err(m, &cj.job.events, Error::Invalid { why });
                continue;
            }
            if active.len() >= limits.max_batch || used + need > limits.kv_budget {
                waiting = Some(cj);
                break;
            }
            timeline.start(Instant::now());
            let events = cj.job.events.clone();
            let r = contain("ragkv-model", m, || {
                if Faults::take(&w.faults.panic_model) {
                    panic!("injected model fault");
                }
                join(w, prefix, &limits, cj, wb)
            });
            match r.and_then(|r| r) {
                Ok(mut a) => {
                    a.reserved = need;
                    used += need;
                    active.push(a);
                }
                Err(e) => finish_err(m, &events, e),
            }
        }
        if active.is_empty() {
            if !open && waiting.is_none() {
                // Shutting down: last events wait a little for slow readers, then go.
                let deadline = *closing.get_or_insert_with(|| Instant::now() + LINGER);
                if leaving.is_empty() || Instant::now() > deadline {
                    timeline.stop(Instant::now());
                    return;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            continue;
        }
        m.batch_size.store(active.len() as u64, Ordering::Relaxed);
        m.kv_reserved_bytes.store(used, Ordering::Relaxed);
        m.batch_steps.fetch_add(1, Ordering::Relaxed);
        m.batch_rows
            .fetch_add(active.len() as u64, Ordering::Relaxed);
        let r = contain("ragkv-model", m, || {
            step(w, &mut active, limits.prefill_chunk)
        });
        if let Err(e) = r.and_then(|r| r) {
            tracing::warn!(error = %e.chain(), queries = active.len(), "a batch step failed");
            let (kind, message) = (e.kind(), e.public_message());
            used = 0;
            m.batch_size.store(0, Ordering::Relaxed);
            m.kv_reserved_bytes.store(0, Ordering::Relaxed);
            for Active { ticket, events, .. } in active.drain(..) {
                drop(ticket);
                m.failed.fetch_add(1, Ordering::Relaxed);
                // Never blocking: a client whose channel is full sees its stream end.
                let _ = events.try_send(Event::Error(kind, message.clone()));
            }
        }
        // Leave: finished, cancelled or gone.
        let mut i = 0;
        while i < active.len() {
            if !(active[i].decoding.is_done() || active[i].gone) {
                i += 1;
                continue;
            }
            let a = active.swap_remove(i);
            used -= a.reserved;
            // The gauges first: the ticket goes back in `leave`.
            m.batch_size.store(active.len() as u64, Ordering::Relaxed);
            m.kv_reserved_bytes.store(used, Ordering::Relaxed);
            if let Some(l) = leave(m, a) {
                leaving.push(l);
            }
        }
    }
}

/// Assembles a query's prompt cache and makes it ready to join the batch.
fn join<'m>(
    w: &'m Worker,
    prefix: &Prefix,
    limits: &Limits,
    cj: ComputeJob,
    wb: &Sender<Writeback>,
) -> Result<Active<'m>> {
    let corpus = &*w.corpus;
    let m = &*w.metrics;
    let ComputeJob {
        job,
        chunks,
        question,
        prompt_tokens,
        queued_at,
    } = cj;
    let LoadJob {
        ticket,
        query,
        events,
        arrived,
        mut timings,
        ..
    } = job;
    timings.queue_ms += ms(queued_at.elapsed());

    // Assemble: prefix, then each chunk at its place (the loader placed stored KV there).
    let t = Instant::now();
    let req = Request {
        prefix,
        repair: &limits.repair,
        query: &query,
        chunks,
        question,
        target: Target {
            room: query.params.max_tokens + 1,
            dtype: limits.cache_dtype,
            link: LinkTiming::Deferred,
        },
    };
    let a = assemble(corpus, req)?;
    m.kv_hits.fetch_add(a.hits as u64, Ordering::Relaxed);
    m.kv_misses.fetch_add(a.misses as u64, Ordering::Relaxed);
    for wbm in a.writebacks {
        if wb.try_send(wbm).is_err() {
            tracing::warn!("write-back queue full; chunk stays unmaterialized");
        }
    }
    debug_assert_eq!(
        prompt_tokens,
        a.cache.len() + a.pending.len() - a.redo.len()
    );
    let cache = a.cache;
    timings.assemble_ms = ms(t.elapsed());
    let decoding = Decoding::new(corpus.model().tokenizer(), &query.params)
        .map_err(|e| Error::Invalid { why: e.to_string() })?;
    Ok(Active {
        ticket,
        events,
        arrived,
        timings,
        report: Final {
            answer: String::new(),
            citations: a.citations,
            kv_hits: a.hits,
            kv_misses: a.misses,
            assembly: query.assembly,
            recomputed_tokens: a.recomputed,
            prompt_tokens,
            completion_tokens: 0,
            finish_reason: String::new(),
            timings: Timings::default(),
        },
        cache,
        decoding,
        pending: a.pending,
        ready: a.logits,
        redo: a.redo,
        reserved: 0,
        started: None,
        first: None,
        last: Instant::now(),
        outbox: String::new(),
        gone: false,
    })
}

/// One step of every query in the batch: feed, sample, stream.
fn step(w: &Worker, active: &mut [Active<'_>], prefill_chunk: usize) -> Result<()> {
    let m = &*w.metrics;
    let now = Instant::now();
    let mut seqs = Vec::with_capacity(active.len());
    let mut fed = Vec::with_capacity(active.len());
    for a in active.iter_mut() {
        a.started.get_or_insert(now);
        // A query whose assembly left logits ready feeds nothing this step; one whose repair
        // was deferred feeds all of the repair's rows, then a piece of its question.
        let r = a.redo.len();
        let n = if a.ready.is_some() {
            0
        } else {
            r + (a.pending.len() - r).min(prefill_chunk.max(1))
        };
        fed.push(n);
        if n > 0 {
            seqs.push(StepSeq {
                cache: &mut a.cache,
                tokens: &a.pending[..n],
                redo: a.redo.as_slice(),
            });
        }
    }
    let fed_rows: usize = seqs.iter().map(|s| s.tokens.len()).sum();
    let (sequences, t_model) = (seqs.len(), Instant::now());
    let logits = if seqs.is_empty() {
        None
    } else {
        let d = w.corpus.model().decoder();
        Some(d.step(&mut seqs)?)
    };
    drop(seqs);
    let model_ms = ms(t_model.elapsed());
    let mut row = 0;
    for (a, n) in active.iter_mut().zip(fed) {
        let l = if n == 0 {
            a.ready.take().ok_or(Error::Invariant {
                what: "a query with nothing to feed",
            })?
        } else {
            a.pending.drain(..n);
            a.redo.clear();
            row += 1;
            if !a.pending.is_empty() {
                continue; // the rest of its prompt runs in the next steps
            }
            let logits = logits.as_ref().ok_or(Error::Invariant {
                what: "no step logits",
            })?;
            model::logits_row(logits, row - 1)?
        };
        let adv = a.decoding.advance(&l)?;
        let now = Instant::now();
        match a.first {
            None => {
                a.first = Some(now);
                m.ttft.observe((now - a.arrived).as_secs_f64());
            }
            Some(_) => m.itl.observe((now - a.last).as_secs_f64()),
        }
        a.last = now;
        if let Some(text) = adv.text {
            a.outbox.push_str(&text);
        }
        if let Some(next) = adv.next {
            a.pending.push(next);
        }
        if !a.outbox.is_empty() {
            match a
                .events
                .try_send(Event::Token(std::mem::take(&mut a.outbox)))
            {
                Ok(()) => {}
                Err(TrySendError::Full(Event::Token(t))) => a.outbox = t,
                Err(_) => {
                    a.gone = true;
                    a.decoding.cancel();
                }
            }
        } else if a.events.is_closed() {
            a.gone = true;
            a.decoding.cancel();
        }
    }
    // Where a step's time goes (the model's work is queued on a GPU: its time shows up in
    // the sampling, the first read of the logits).
    tracing::debug!(
        sequences,
        rows = fed_rows,
        model_ms,
        total_ms = ms(now.elapsed()),
        "batch step"
    );
    Ok(())
}

/// Ends a query that left the batch: its ticket and cache go now; its last events are sent,
/// or returned to be retried if its channel is full.
fn leave(m: &Metrics, a: Active<'_>) -> Option<Leaving> {
    let Active {
        ticket,
        events,
        arrived,
        mut timings,
        mut report,
        cache,
        decoding,
        started,
        first,
        outbox,
        gone,
        ..
    } = a;
    drop((ticket, cache));
    let generation = decoding.finish();
    m.tokens_generated
        .fetch_add(generation.tokens.len() as u64, Ordering::Relaxed);
    if gone || generation.finish == model::FinishReason::Cancelled {
        m.cancelled.fetch_add(1, Ordering::Relaxed);
        return None;
    }
    let end = Instant::now();
    let first = first.unwrap_or(end);
    timings.prefill_ms = ms(first - started.unwrap_or(first));
    timings.first_token_ms = ms(first - arrived);
    timings.decode_ms = ms(end - first);
    timings.total_ms = ms(end - arrived);
    report.answer = generation.text;
    report.completion_tokens = generation.tokens.len();
    report.finish_reason = match generation.finish {
        model::FinishReason::Stop => "stop",
        model::FinishReason::Length => "length",
        model::FinishReason::Cancelled => "cancelled",
    }
    .into();
    report.timings = timings;
    let mut queue = VecDeque::with_capacity(2);
    if !outbox.is_empty() {
        queue.push_back(Event::Token(outbox));
    }
    queue.push_back(Event::Done(Box::new(report)));
    match flush(&events, &mut queue) {
        Ok(()) if !queue.is_empty() => Some(Leaving { events, queue }),
        Ok(()) => None,
        Err(()) => {
            m.cancelled.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}
