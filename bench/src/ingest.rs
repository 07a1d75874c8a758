//! `ragkv bench ingest`: the whole pipeline (read, chunk, embed, index, prefill, store) against
//! bare prefill of the same chunks, on LongBench-HotpotQA documents.

use std::path::PathBuf;
use std::time::Instant;

use crate::{dataset, Error, Line};

/// Arguments of `ragkv bench ingest`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Documents of the corpus to ingest.
    #[arg(long, default_value_t = 40)]
    pub docs: usize,
    /// LongBench-HotpotQA directory.
    #[arg(long)]
    pub dataset: Option<PathBuf>,
    /// Chunk size in model tokens.
    #[arg(long, default_value_t = 512)]
    pub chunk_tokens: usize,
    /// The model.
    #[command(flatten)]
    pub llm: crate::engine::ModelArgs,
    /// Working directory (default: a fresh temporary directory).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// `ingest.prefill_batch_tokens` for the pipeline and the batched bare prefill (1: one
    /// chunk per forward pass).
    #[arg(long, default_value_t = ingest::IngestConfig::default().prefill_batch_tokens)]
    pub prefill_batch_tokens: usize,
}

/// Runs the benchmark.
pub fn run(args: &Args) -> Result<Vec<Line>, Error> {
    let ds = dataset::resolve(args.dataset.as_deref())?;
    let corpus = dataset::documents(&ds, args.docs)?;
    let tmp = tempfile::tempdir().map_err(crate::io("temporary directory"))?;
    let work = args.dir.clone().unwrap_or_else(|| tmp.path().to_path_buf());
    let _ = std::fs::remove_dir_all(work.join("kv"));
    let _ = std::fs::remove_dir_all(work.join("vectors"));
    let mut stored = crate::engine::corpus(
        &work,
        &args.llm,
        crate::engine::chunks_alone(args.chunk_tokens, ""),
        kvstore::Codec::None,
    )?;
    stored
        .set_prefill_batch_tokens(args.prefill_batch_tokens)
        .map_err(|e| Error::Check(e.to_string()))?;
    let engine = ingest::Engine::new(stored);

    // Baseline: bare prefill of exactly the chunks the pipeline will prefill.
    let chunker = engine.corpus().config().chunker();
    let docs: Vec<Vec<Vec<u32>>> = corpus
        .iter()
        .map(|d| {
            ingest::chunk_text(&d.text, engine.corpus().model().tokenizer(), &chunker)
                .into_iter()
                .map(|c| c.tokens)
                .collect()
        })
        .collect();
    let chunks: Vec<&Vec<u32>> = docs.iter().flatten().collect();
    let tokens: usize = chunks.iter().map(|c| c.len()).sum();
    eprintln!(
        "[ingest] {} documents, {} chunks, {tokens} tokens; bare prefill first",
        corpus.len(),
        chunks.len()
    );
    let t = Instant::now();
    for c in &chunks {
        engine
            .corpus()
            .model()
            .decoder()
            .prefill(c, 0)
            .map_err(|e| Error::Check(format!("prefill: {e}")))?;
    }
    let bare = tokens as f64 / t.elapsed().as_secs_f64();

    // The same chunks grouped as the pipeline groups them (`ingest::prefill_groups`), one
    // forward pass per group.
    let t = Instant::now();
    let mut passes = 0;
    for doc in &docs {
        let lens: Vec<(usize, bool)> = doc.iter().map(|c| (c.len(), true)).collect();
        for group in ingest::prefill_groups(&lens, args.prefill_batch_tokens) {
            let chunks: Vec<&[u32]> = doc[group].iter().map(Vec::as_slice).collect();
            engine
                .corpus()
                .model()
                .decoder()
                .prefill_many(&chunks)
                .map_err(|e| Error::Check(format!("prefill: {e}")))?;
            passes += 1;
        }
    }
    let batched = tokens as f64 / t.elapsed().as_secs_f64();

    // Ours: the pipeline, end to end, until everything is committed and indexed.
    let t = Instant::now();
    let report = crate::engine::ingest(
        &engine,
        ingest::Source::Docs(crate::engine::docs(&corpus)),
        ingest::Materialize::Eager,
    )?;
    let wall = t.elapsed().as_secs_f64();
    if report.tokens_prefilled != tokens {
        return Err(Error::Check(format!(
            "the pipeline prefilled {} tokens, bare prefill {tokens}",
            report.tokens_prefilled
        )));
    }
    let ours = tokens as f64 / wall;
    eprintln!("[ingest] {}", report.summary());
    let mut line = Line::higher(
        "ingest_tokens_per_s",
        ours,
        bare,
        "tokens/s",
        "bare prefill of the same chunks (no embedding, indexing or storage)",
    )
    .bar(0.9);
    line.detail = Some(serde_json::json!({
        "documents": corpus.len(), "chunks": chunks.len(), "tokens": tokens,
        "wall_s": wall, "kv_bytes": report.kv_bytes, "stages_busy_s": report.stages,
        "prefill_batch_tokens": args.prefill_batch_tokens,
    }));
    let mut grouped = Line::higher(
        "ingest.prefill_grouped",
        batched,
        bare,
        "tokens/s",
        "bare prefill, one chunk per forward pass",
    );
    grouped.detail = Some(serde_json::json!({
        "prefill_batch_tokens": args.prefill_batch_tokens,
        "forward_passes": passes, "chunks": chunks.len(),
    }));
    Ok(vec![line, grouped])
}
