//! `ragkv bench ttft`: time to first token with stored KV against full recompute, and the
//! loader overlapping decode against loading and decoding in sequence, on LongBench-HotpotQA.
//!
//! Every query goes through the server's real pipeline ([`serve::Rag`]: retrieval, loader
//! thread, model thread); only HTTP is left out. Time to first token is measured from before
//! retrieval to the first generated text. Stored-KV queries read cold: the segment files'
//! pages are dropped before each one. `--strategy S` also times each query assembled by `S`
//! (a repair such as `link:16`) against `reposition` timed again beside it, both reading the
//! chunks the first query left in the store's hot tier.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use retrieval::SearchFilter;
use serve::{Event, KvMode, Query, Rag, ServeConfig};

use crate::engine::wait;
use crate::{dataset, median, percentile, Error, Line};

/// Arguments of `ragkv bench ttft`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Dev questions.
    #[arg(long, default_value_t = 20)]
    pub questions: usize,
    /// Chunks per question.
    #[arg(long, default_value_t = 4)]
    pub top_k: usize,
    /// Corpus documents indexed (vectors for all; KV only for the chunks the questions use).
    #[arg(long, default_value_t = 100_000)]
    pub docs: usize,
    /// Model tokens per chunk.
    #[arg(long, default_value_t = 512)]
    pub chunk_tokens: usize,
    /// Tokens generated per question in the throughput comparison.
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// LongBench-HotpotQA directory (default: the shared datasets).
    #[arg(long)]
    pub dataset: Option<PathBuf>,
    /// The model.
    #[command(flatten)]
    pub llm: crate::engine::ModelArgs,
    /// Working directory (default: a fresh temporary directory). With an index already
    /// there, ingestion is skipped.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Codec of the stored chunk KV (`kvstore.codec`: none, q8, q4, ...); use a separate
    /// `--dir` per codec.
    #[arg(long, default_value = "none", value_parser = crate::qa::parse_codec)]
    pub codec: kvstore::Codec,
    /// What the chunks are prefilled after (`--context`, `--exact-first`).
    #[command(flatten)]
    pub materialization: crate::engine::Materialization,
    /// Threads loading a query's chunks side by side (`serve.load_threads`; 0: the device's
    /// default, 1 on the CPU).
    #[arg(long, default_value_t = 0)]
    pub load_threads: usize,
    /// Assembly strategies to time against `reposition` on the same stored KV (`link:16`;
    /// repeat the flag): one `ttft_vs_reposition.<strategy>` line each, the repair's cost in
    /// time to first token (issue 39 allows 1.5x `reposition`'s mean).
    #[arg(long = "strategy")]
    pub strategies: Vec<serve::Assembly>,
    /// Chunk KV kept on the model's device between queries (`serve.resident_mb`; 0: none,
    /// as by default). With it, each question is asked again right after its cold query,
    /// its chunks then resident: a `ttft_resident_p50` line. Every other timing starts with
    /// the tier emptied, as it starts with the store's pages dropped.
    #[arg(long, default_value_t = 0)]
    pub resident_mb: usize,
}

fn check<E: std::fmt::Display>(what: &str) -> impl Fn(E) -> Error + '_ {
    move |e| Error::Check(format!("{what}: {e}"))
}

pub(crate) fn drop_segment_pages(engine: &ingest::Engine) -> Result<(), Error> {
    for p in engine.corpus().store().segment_paths() {
        crate::kvstore::drop_pages(&p)?;
    }
    Ok(())
}

/// Before a timing that reads cold: the store's pages dropped and the resident tier emptied
/// (the store's own hot tier of decoded blocks stays; see [`run`]).
pub(crate) fn cold(engine: &ingest::Engine, rag: &Rag) -> Result<(), Error> {
    rag.drop_resident();
    drop_segment_pages(engine)
}

/// Retrieves and submits one query; returns a receiver of its events.
fn submit(
    rag: &Rag,
    question: &str,
    top_k: usize,
    max_tokens: usize,
    kv: KvMode,
    assembly: serve::Assembly,
) -> Result<tokio::sync::mpsc::Receiver<Event>, Error> {
    let q = Query {
        question: question.to_string(),
        top_k,
        filter: SearchFilter::default(),
        params: model::GenerateParams {
            max_tokens,
            ..model::GenerateParams::default()
        },
        kv,
        assembly,
    };
    let arrived = Instant::now();
    let hits = rag.retrieve(&q).map_err(check("retrieve"))?;
    crate::engine::submit(rag, q, hits, arrived)
}

/// Runs the benchmark.
pub fn run(args: &Args) -> Result<Vec<Line>, Error> {
    let ds = dataset::resolve(args.dataset.as_deref())?;
    let work_dir = crate::WorkDir::new(args.dir.as_deref())?;
    let work = work_dir.path().to_path_buf();
    let engine = std::sync::Arc::new(crate::engine::open_indexed(
        &work,
        &args.llm,
        args.materialization.config(args.chunk_tokens),
        &ds,
        args.docs,
        "ttft",
        args.codec,
    )?);
    let questions = dataset::questions(&ds, args.questions)?;
    let rag = Rag::start(
        engine.clone(),
        ServeConfig {
            max_inflight: questions.len().max(1) * 2,
            load_threads: args.load_threads,
            resident_mb: args.resident_mb,
            ..ServeConfig::default()
        },
    )
    .map_err(check("server pipeline"))?;

    // Materialize the chunks the questions retrieve (what eager ingest would have stored).
    let t = Instant::now();
    let mut materialized = 0;
    for q in &questions {
        let v = engine
            .corpus()
            .embedder()
            .embed_one(&q.question)
            .map_err(|e| check("embed")(e.to_string()))?;
        let hits = engine
            .corpus()
            .index()
            .search(&v, args.top_k, &SearchFilter::default())
            .map_err(|e| check("search")(e.to_string()))?;
        materialized += crate::engine::materialize(&engine, &hits)?;
    }
    engine.corpus().store().sync()?;
    eprintln!(
        "[ttft] materialized {materialized} chunks in {:.1} s",
        t.elapsed().as_secs_f64()
    );

    // Time to first token, one query at a time.
    let mut stored = Vec::new();
    let mut recompute = Vec::new();
    let mut agree = 0;
    let mut loads = Vec::new();
    let reposition = serve::Assembly::Reposition;
    let mut resident = Timed::new(reposition);
    // With `--strategy`: `reposition` timed again, then each strategy, all after the pair
    // above and so alike: their chunks come from the store's hot tier (decoded blocks kept in
    // memory), where the first query read them from disk (SmolLM2, top-4: load p50 ~100 ms
    // first, 30-45 ms after). Each with its times to first token, its loads, and its answers
    // equal to `reposition`'s.
    let mut timed: Vec<Timed> = if args.strategies.is_empty() {
        Vec::new()
    } else {
        std::iter::once(reposition)
            .chain(args.strategies.iter().copied())
            .map(Timed::new)
            .collect()
    };
    for q in &questions {
        // One query of this question, 8 tokens, answered in full.
        let ask = |kv, assembly| wait(submit(&rag, &q.question, args.top_k, 8, kv, assembly)?);
        cold(&engine, &rag)?;
        let on = ask(KvMode::On, reposition)?;
        if on.kv_hits != on.citations.len() {
            return Err(Error::Check(format!(
                "expected only KV hits: {:?}",
                on.citations
            )));
        }
        if args.resident_mb > 0 {
            resident.add(&ask(KvMode::On, reposition)?, &on);
        }
        let off = ask(KvMode::Off, reposition)?;
        for s in &mut timed {
            cold(&engine, &rag)?;
            let r = ask(KvMode::On, s.assembly)?;
            s.add(&r, &on);
        }
        agree += usize::from(on.answer == off.answer);
        stored.push(on.timings.first_token_ms);
        loads.push(on.timings.load_ms);
        recompute.push(off.timings.first_token_ms);
    }
    stored.sort_by(f64::total_cmp);
    recompute.sort_by(f64::total_cmp);
    loads.sort_by(f64::total_cmp);
    let base = "full recompute: every retrieved chunk prefilled at query time (kv=off)";
    let mut lines = vec![
        Line::lower(
            "ttft_p50",
            percentile(&stored, 0.5),
            percentile(&recompute, 0.5),
            "ms",
            base,
        )
        .bar(10.0),
        Line::lower(
            "ttft_p90",
            percentile(&stored, 0.9),
            percentile(&recompute, 0.9),
            "ms",
            base,
        )
        .bar(10.0),
    ];
    lines[0].detail = Some(serde_json::json!({
        "questions": questions.len(), "top_k": args.top_k, "chunk_tokens": args.chunk_tokens,
        "identical_greedy_answers": agree, "kv_load_ms_p50": percentile(&loads, 0.5),
        "load_threads": args.load_threads,
    }));
    if args.resident_mb > 0 {
        let mut line = Line::lower(
            "ttft_resident_p50",
            median(resident.ttft.clone()),
            percentile(&recompute, 0.5),
            "ms",
            &format!("{base}; ragkv's chunks resident on the model's device (serve.resident_mb)"),
        )
        .bar(10.0);
        line.detail = Some(serde_json::json!({
            "resident_mb": args.resident_mb,
            "kv_load_ms_p50": median(resident.loads.clone()),
            "cold_ttft_p50_ms": percentile(&stored, 0.5),
            "cold_kv_load_ms_p50": percentile(&loads, 0.5),
            "answers_as_cold": resident.same,
            "questions": questions.len(),
            "resident": rag.resident_stats(),
        }));
        lines.push(line);
    }
    if let Some((base, repairs)) = timed.split_first() {
        for s in repairs {
            let mut line = Line::lower(
                &format!("ttft_vs_reposition.{}", s.assembly),
                mean(&s.ttft),
                mean(&base.ttft),
                "ms",
                "the same stored KV assembled by `reposition` (mean time to first token)",
            )
            .bar(1.0 / 1.5);
            line.detail = Some(serde_json::json!({
                "ttft_p50_ms": median(s.ttft.clone()),
                "reposition_ttft_p50_ms": median(base.ttft.clone()),
                "kv_load_ms_p50": median(s.loads.clone()),
                "reposition_kv_load_ms_p50": median(base.loads.clone()),
                "answers_as_reposition": s.same,
                "answers_digest": s.answers_digest(),
                "reposition_answers_digest": base.answers_digest(),
                "questions": questions.len(),
            }));
            lines.push(line);
        }
    }

    // Back to back: the loader overlapping decode vs one query after another.
    let answer = |question: &str| {
        submit(
            &rag,
            question,
            args.top_k,
            args.max_tokens,
            KvMode::On,
            reposition,
        )
    };
    cold(&engine, &rag)?;
    let t = Instant::now();
    let (mut seq_load, mut seq_hidden) = (0.0, 0.0);
    for q in &questions {
        let f = wait(answer(&q.question)?)?;
        seq_load += f.timings.load_ms;
        seq_hidden += f.timings.load_hidden_ms;
    }
    let sequential = t.elapsed();
    cold(&engine, &rag)?;
    let t = Instant::now();
    let receivers = questions
        .iter()
        .map(|q| answer(&q.question))
        .collect::<Result<Vec<_>, _>>()?;
    let (mut load, mut hidden) = (0.0, 0.0);
    for rx in receivers {
        let f = wait(rx)?;
        load += f.timings.load_ms;
        hidden += f.timings.load_hidden_ms;
    }
    let overlapped = t.elapsed();
    let n = questions.len() as f64;
    let secs = |d: Duration| d.as_secs_f64();
    let mut thr = Line::higher(
        "batch_queries_per_s",
        n / secs(overlapped),
        n / secs(sequential),
        "queries/s",
        "the same queries loaded and decoded one after another",
    );
    thr.detail = Some(serde_json::json!({
        "sequential_s": secs(sequential), "overlapped_s": secs(overlapped),
        "max_tokens": args.max_tokens,
    }));
    lines.push(thr);
    // Measured on the timeline: loader time during which the model thread was computing
    // another query. One after another it must be ~0 (nothing to hide behind).
    let mut share = Line::higher(
        "kv_load_hidden_share",
        hidden / load,
        1.0,
        "fraction",
        "all KV load time hidden behind compute",
    )
    .bar(0.9);
    share.detail = Some(serde_json::json!({
        "kv_load_ms": load, "kv_load_hidden_ms": hidden,
        "sequential_kv_load_ms": seq_load, "sequential_kv_load_hidden_ms": seq_hidden,
        "wall_saved_ms": (secs(sequential) - secs(overlapped)) * 1e3,
    }));
    lines.push(share);
    drop(rag);
    crate::engine::close(engine);
    Ok(lines)
}

/// One strategy's queries in `--strategy`'s comparison.
struct Timed {
    assembly: serve::Assembly,
    /// Times to first token, ms.
    ttft: Vec<f64>,
    /// KV load times, ms.
    loads: Vec<f64>,
    /// Answers equal to the question's first `reposition` answer.
    same: usize,
    /// Every answer in question order, hashed: two runs of a strategy (e.g. with and without
    /// a GPU path switched on) gave the same answers when their digests are equal.
    digest: blake3::Hasher,
}

impl Timed {
    fn new(assembly: serve::Assembly) -> Timed {
        Timed {
            assembly,
            ttft: Vec::new(),
            loads: Vec::new(),
            same: 0,
            digest: blake3::Hasher::new(),
        }
    }

    /// One query's figures; `first` is the question's first (`reposition`) answer.
    fn add(&mut self, r: &serve::Final, first: &serve::Final) {
        self.ttft.push(r.timings.first_token_ms);
        self.loads.push(r.timings.load_ms);
        self.same += usize::from(r.answer == first.answer);
        // Length first, so that no two lists of answers hash alike.
        self.digest.update(&(r.answer.len() as u64).to_le_bytes());
        self.digest.update(r.answer.as_bytes());
    }

    /// The answers' digest (16 hex digits).
    fn answers_digest(&self) -> String {
        self.digest.finalize().to_hex()[..16].to_string()
    }
}

/// The mean of `v` (0 for none).
fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}
