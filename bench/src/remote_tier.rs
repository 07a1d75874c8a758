//! `ragkv bench remote`: the shared KV tier against the local store and against recompute.
//!
//! Node A ingests the first `--docs` documents of LongBench-HotpotQA, writing every chunk's KV
//! through to the tier (`--url`/`--bucket`/`--credentials`: an S3-compatible server; default: a
//! directory in the work dir). Then, over those chunks: one chunk read from A's local store
//! (cold: its segment pages dropped first), from the tier (one request, and `--top-k` at once
//! as the loader asks), and prefilled again. Last, node B (an empty local store, the same
//! index and model, reading through the tier) answers the dev questions with every chunk
//! remote-only (B's copies are dropped after each query) and with `kv=off`: time to first
//! token from the tier against recompute.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use remote::{ReadMode, Remote, RemoteConfig, WriteMode};
use retrieval::SearchFilter;
use serve::{KvMode, Query, Rag, ServeConfig};

use crate::engine::{submit, wait};
use crate::{dataset, percentile, Error, Line};

/// Arguments of `ragkv bench remote`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Corpus documents ingested (their chunks are the ones read).
    #[arg(long, default_value_t = 16)]
    pub docs: usize,
    /// Dev questions for the time to first token.
    #[arg(long, default_value_t = 8)]
    pub questions: usize,
    /// Chunks per question.
    #[arg(long, default_value_t = 4)]
    pub top_k: usize,
    /// Model tokens per chunk.
    #[arg(long, default_value_t = 512)]
    pub chunk_tokens: usize,
    /// Chunks prefilled again for the recompute baseline.
    #[arg(long, default_value_t = 8)]
    pub recompute_chunks: usize,
    /// The tier: `http://host:port` of an S3-compatible server; default: a directory.
    #[arg(long)]
    pub url: Option<String>,
    /// The bucket (S3 tiers).
    #[arg(long, default_value = "ragkv-test")]
    pub bucket: String,
    /// The region (S3 tiers).
    #[arg(long, default_value = "garage")]
    pub region: String,
    /// `env` or a file with `access_key_id = ...` and `secret_access_key = ...`.
    #[arg(long, default_value = "env")]
    pub credentials: String,
    /// LongBench-HotpotQA directory (default: the shared datasets).
    #[arg(long)]
    pub dataset: Option<PathBuf>,
    /// The model.
    #[command(flatten)]
    pub llm: crate::engine::ModelArgs,
    /// Working directory (default: a fresh temporary directory).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

fn check<E: std::fmt::Display>(what: &str) -> impl Fn(E) -> Error + '_ {
    move |e| Error::Check(format!("{what}: {e}"))
}

/// The tier's settings; each run writes under a prefix of its own.
fn tier_config(args: &Args, work: &std::path::Path) -> RemoteConfig {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    RemoteConfig {
        url: args
            .url
            .clone()
            .unwrap_or_else(|| format!("file://{}", work.join("tier").display())),
        bucket: args.bucket.clone(),
        region: args.region.clone(),
        credentials: args.credentials.clone(),
        prefix: format!("bench/{t}"),
        read: ReadMode::Through,
        ..RemoteConfig::default()
    }
}

fn tier(cfg: &RemoteConfig, write: WriteMode) -> Result<Arc<Remote>, Error> {
    let cfg = RemoteConfig {
        write,
        ..cfg.clone()
    };
    Ok(Arc::new(
        Remote::open(&cfg).map_err(|e| check("remote tier")(e.to_string()))?,
    ))
}

/// Runs the benchmark.
pub fn run(args: &Args) -> Result<Vec<Line>, Error> {
    let ds = dataset::resolve(args.dataset.as_deref())?;
    let work_dir = crate::WorkDir::new(args.dir.as_deref())?;
    let work = work_dir.path().to_path_buf();
    let cfg = tier_config(args, &work);
    let writer = tier(&cfg, WriteMode::Through)?;
    let a = Arc::new(ingest::Engine::new(
        crate::engine::corpus(
            &work.join("a"),
            &args.llm,
            crate::engine::chunks_alone(args.chunk_tokens, ""),
            kvstore::Codec::None,
        )?
        .with_remote(writer.clone()),
    ));
    let a_corpus = a.corpus();
    let t = Instant::now();
    let corpus = dataset::documents(&ds, args.docs)?;
    let report = crate::engine::ingest(
        &a,
        ingest::Source::Docs(crate::engine::docs(&corpus)),
        ingest::Materialize::Eager,
    )?;
    eprintln!(
        "[remote] ingested {} docs ({} chunks) in {:.1} s",
        args.docs,
        report.chunks,
        t.elapsed().as_secs_f64()
    );

    // Every stored chunk, as the loader would ask for it.
    let mut chunks: Vec<Vec<u32>> = Vec::new();
    for (_, p) in a_corpus
        .index()
        .points()
        .map_err(|e| check("points")(e.to_string()))?
    {
        chunks.push(
            a_corpus
                .chunk_tokens(&p.text)
                .map_err(|e| check("tokenize")(e.to_string()))?,
        );
    }
    let ns = a_corpus.namespace();
    let bytes: usize = chunks
        .iter()
        .map(|c| a_corpus.layout().bytes_for(c.len()))
        .sum();
    let gb = bytes as f64 / 1e9;

    // Local store, cold.
    for p in a_corpus.store().segment_paths() {
        crate::kvstore::drop_pages(&p)?;
    }
    let t = Instant::now();
    for c in &chunks {
        a_corpus.store().get_batch(ns, c, c.len())?;
    }
    let local_s = t.elapsed().as_secs_f64();
    // The tier: one request at a time, then `top_k` at once.
    let t = Instant::now();
    for c in &chunks {
        writer
            .get(ns, c)
            .map_err(|e| check("remote get")(e.to_string()))?
            .ok_or_else(|| Error::Check("a stored chunk is missing from the tier".into()))?;
    }
    let remote_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for group in chunks.chunks(args.top_k.max(1)) {
        let seqs: Vec<&[u32]> = group.iter().map(Vec::as_slice).collect();
        for r in writer.get_many(ns, &seqs) {
            r.map_err(|e| check("remote get")(e.to_string()))?
                .ok_or_else(|| Error::Check("a stored chunk is missing from the tier".into()))?;
        }
    }
    let parallel_s = t.elapsed().as_secs_f64();
    // Recompute: the same chunks prefilled again (a sample).
    let sample = &chunks[..args.recompute_chunks.min(chunks.len())];
    let t = Instant::now();
    for c in sample {
        a_corpus
            .prefill_bytes(c)
            .map_err(|e| check("prefill")(e.to_string()))?;
    }
    let recompute_ms = t.elapsed().as_secs_f64() * 1e3 / sample.len().max(1) as f64;
    let n = chunks.len().max(1) as f64;
    let (local_ms, remote_ms, parallel_ms) =
        (local_s * 1e3 / n, remote_s * 1e3 / n, parallel_s * 1e3 / n);
    let detail = serde_json::json!({
        "chunks": chunks.len(), "kv_bytes": bytes,
        "local_ms_per_chunk": local_ms, "local_gb_per_s": gb / local_s,
        "remote_ms_per_chunk": remote_ms, "remote_gb_per_s": gb / remote_s,
        "remote_top_k_ms_per_chunk": parallel_ms, "remote_top_k_gb_per_s": gb / parallel_s,
        "recompute_ms_per_chunk": recompute_ms, "tier": args.url.as_deref().unwrap_or("directory"),
    });
    let mut lines = vec![
        Line::lower(
            "remote_chunk_get_vs_recompute",
            parallel_ms,
            recompute_ms,
            "ms/chunk",
            "prefilling the chunk again",
        ),
        Line::lower(
            "remote_chunk_get_vs_local",
            parallel_ms,
            local_ms,
            "ms/chunk",
            "the local store, cold (page cache dropped)",
        ),
    ];
    lines[0].detail = Some(detail);

    // Node B: nothing local; every query's chunks come from the tier, or are recomputed.
    let b_store = kvstore::Store::open(work.join("b/kv"), kvstore::StoreOptions::default())?;
    let b = Arc::new(ingest::Engine::new(
        ingest::Corpus::new(
            Arc::new(b_store),
            a_corpus.index().clone(),
            a_corpus.embedder().clone(),
            a_corpus.model().clone(),
            a_corpus.config().clone(),
            model::DType::F16,
        )
        .map_err(|e| check("node b")(e.to_string()))?
        .with_remote(tier(&cfg, WriteMode::Off)?),
    ));
    if b.corpus().namespace() != ns {
        return Err(Error::Check("node B computes another KV namespace".into()));
    }
    let rag = Rag::start(b.clone(), ServeConfig::default()).map_err(check("server pipeline"))?;
    let query = |question: &str, kv| Query {
        question: question.to_string(),
        top_k: args.top_k,
        filter: SearchFilter::default(),
        params: model::GenerateParams {
            max_tokens: 8,
            ..model::GenerateParams::default()
        },
        kv,
        assembly: serve::Assembly::Reposition,
    };
    let (mut fetched, mut recomputed) = (Vec::new(), Vec::new());
    for q in dataset::questions(&ds, args.questions)? {
        let on = query(&q.question, KvMode::On);
        let arrived = Instant::now();
        let hits = rag.retrieve(&on).map_err(check("retrieve"))?;
        let f = wait(submit(&rag, on, hits.clone(), arrived)?)?;
        let remote_hits = rag
            .metrics
            .remote_hits
            .load(std::sync::atomic::Ordering::Relaxed);
        if f.kv_misses != 0 {
            return Err(Error::Check(format!(
                "chunks recomputed on B: {:?}",
                f.citations
            )));
        }
        fetched.push(f.timings.first_token_ms);
        // Remote-only again for the next question: B's copies go.
        for h in &hits {
            b.corpus()
                .store()
                .delete_document(&ingest::kv_doc(&h.payload.doc_id, &h.payload.doc_hash))?;
        }
        let off = query(&q.question, KvMode::Off);
        let arrived = Instant::now();
        let f = wait(submit(&rag, off, hits, arrived)?)?;
        recomputed.push(f.timings.first_token_ms);
        eprintln!(
            "[remote] q{}: tier {:.0} ms, recompute {:.0} ms ({remote_hits} chunks fetched so far)",
            fetched.len(),
            fetched.last().copied().unwrap_or(0.0),
            f.timings.first_token_ms
        );
    }
    fetched.sort_by(f64::total_cmp);
    recomputed.sort_by(f64::total_cmp);
    let mut ttft = Line::lower(
        "remote_only_ttft_p50",
        percentile(&fetched, 0.5),
        percentile(&recomputed, 0.5),
        "ms",
        "every retrieved chunk prefilled at query time (kv=off) on the same node",
    )
    .bar(3.0);
    ttft.detail = Some(serde_json::json!({
        "questions": fetched.len(), "top_k": args.top_k,
        "remote_p90_ms": percentile(&fetched, 0.9), "recompute_p90_ms": percentile(&recomputed, 0.9),
    }));
    lines.push(ttft);
    drop(rag);
    crate::engine::close(b);
    crate::engine::close(a);
    Ok(lines)
}
