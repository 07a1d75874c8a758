//! `ragkv bench retrieval`: embedding throughput, embedded (Qdrant Edge) search latency before
//! and after `optimize()` at 100,000 points, HNSW recall@10 against exact search on the same
//! vectors, and answer recall@5 on LongBench-HotpotQA.

use std::path::PathBuf;
use std::time::Instant;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use retrieval::{
    ChunkPayload, ChunkPoint, Embedder, EmbedderConfig, IndexConfig, SearchFilter, VectorIndex,
};

use crate::{dataset, percentile, Error, Line};

/// Arguments of `ragkv bench retrieval`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Points in the latency/recall index.
    #[arg(long, default_value_t = 100_000)]
    pub points: usize,
    /// Vector dimension of the latency/recall index.
    #[arg(long, default_value_t = 384)]
    pub dim: usize,
    /// Timed searches per phase (the first 10 % are warm-up and not counted).
    #[arg(long, default_value_t = 1_000)]
    pub queries: usize,
    /// Queries whose top-10 is compared with exact search.
    #[arg(long, default_value_t = 500)]
    pub recall_queries: usize,
    /// HNSW ef at search time (0: Qdrant's default).
    #[arg(long, default_value_t = 0)]
    pub hnsw_ef: usize,
    /// Synthetic vectors: `clustered` (1,000 centers, each point at cosine ~0.75 from its
    /// center, queries near points: the neighborhood structure embeddings have) or
    /// `isotropic` (uniform on the sphere: every point nearly equidistant, the worst case for
    /// any graph index).
    #[arg(long, default_value = "clustered")]
    pub vectors: String,
    /// LongBench-HotpotQA directory.
    #[arg(long)]
    pub dataset: Option<PathBuf>,
    /// Corpus documents embedded for answer recall (0 skips the dataset part).
    #[arg(long, default_value_t = 100_000)]
    pub docs: usize,
    /// Dev questions for answer recall.
    #[arg(long, default_value_t = 100)]
    pub questions: usize,
    /// Chunks embedded for the throughput comparison.
    #[arg(long, default_value_t = 256)]
    pub embed_chunks: usize,
    /// Chunk size in model (SmolLM2) tokens.
    #[arg(long, default_value_t = 512)]
    pub chunk_tokens: usize,
    /// Working directory (default: a fresh temporary directory).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

pub(crate) fn rerr(e: retrieval::Error) -> Error {
    Error::Check(format!("retrieval: {e}"))
}

fn gaussian_unit(rng: &mut SmallRng, dim: usize) -> Vec<f32> {
    // Box-Muller: isotropic directions (uniform on the sphere once normalized).
    let mut v: Vec<f32> = (0..dim)
        .map(|_| {
            let u1: f32 = rng.gen_range(f32::EPSILON..1.0);
            let u2: f32 = rng.gen_range(0.0..1.0);
            (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
        })
        .collect();
    retrieval::normalize(&mut v);
    v
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Exact top-k ids by brute force.
pub(crate) fn exact_top(vectors: &[Vec<f32>], q: &[f32], k: usize) -> Vec<usize> {
    let mut scored: Vec<(f32, usize)> = vectors
        .iter()
        .enumerate()
        .map(|(i, v)| (dot(v, q), i))
        .collect();
    let k = k.min(scored.len());
    scored.select_nth_unstable_by(k.saturating_sub(1), |a, b| b.0.total_cmp(&a.0));
    let mut top: Vec<(f32, usize)> = scored[..k].to_vec();
    top.sort_by(|a, b| b.0.total_cmp(&a.0));
    top.into_iter().map(|(_, i)| i).collect()
}

/// A chunk's payload without KV or document facts (the benchmarks' indexes).
pub(crate) fn payload(doc: String, ordinal: u32, text: String, tokens: u32) -> ChunkPayload {
    ChunkPayload {
        doc_id: doc,
        ordinal,
        text,
        tokens,
        kv_key: String::new(),
        doc_hash: String::new(),
        doc_chunks: 0,
        metadata: Default::default(),
    }
}

/// The first `docs` documents of the dataset cut into chunks of `chunk_tokens` SmolLM2
/// tokens, as ingest cuts them: (document id, ordinal, text, tokens).
pub(crate) fn corpus_chunks(
    ds: &std::path::Path,
    docs: usize,
    chunk_tokens: usize,
) -> Result<Vec<(String, u32, String, u32)>, Error> {
    let tok_path = model::models_dir().join(model::SMOLLM2_FILE);
    let source = model::ModelSource::from_path(&tok_path)
        .map_err(|e| Error::Check(format!("tokenizer: {e}")))?;
    let tokenizer =
        model::Tokenizer::load(&source).map_err(|e| Error::Check(format!("tokenizer: {e}")))?;
    let chunker = ingest::ChunkerConfig {
        chunk_tokens,
        overlap_tokens: 0,
    };
    let mut chunks = Vec::new();
    for d in &dataset::documents(ds, docs)? {
        for c in ingest::chunk_text(&d.text, &tokenizer, &chunker) {
            chunks.push((d.id.clone(), c.ordinal, c.text, c.tokens.len() as u32));
        }
    }
    Ok(chunks)
}

fn time_searches(index: &VectorIndex, queries: &[Vec<f32>], k: usize) -> Result<(f64, f64), Error> {
    let warm = queries.len() / 10;
    let mut lat = Vec::with_capacity(queries.len());
    for (i, q) in queries.iter().enumerate() {
        let t = Instant::now();
        let hits = index.search(q, k, &SearchFilter::default()).map_err(rerr)?;
        let us = t.elapsed().as_secs_f64() * 1e6;
        if hits.len() != k {
            return Err(Error::Check(format!(
                "search returned {} of {k}",
                hits.len()
            )));
        }
        if i >= warm {
            lat.push(us);
        }
    }
    lat.sort_by(|a, b| a.total_cmp(b));
    Ok((percentile(&lat, 0.5), percentile(&lat, 0.99)))
}

/// Recall@`k` of `index` against exact search over `vectors` (point ids `ids`) per query.
pub(crate) fn recall_at(
    index: &VectorIndex,
    vectors: &[Vec<f32>],
    ids: &[uuid::Uuid],
    queries: &[Vec<f32>],
    k: usize,
) -> Result<f64, Error> {
    let mut found = 0usize;
    for q in queries {
        let exact: std::collections::HashSet<uuid::Uuid> = exact_top(vectors, q, k)
            .into_iter()
            .map(|i| ids[i])
            .collect();
        let got = index.search(q, k, &SearchFilter::default()).map_err(rerr)?;
        found += got.iter().filter(|h| exact.contains(&h.id)).count();
    }
    Ok(found as f64 / (queries.len() * k) as f64)
}

/// Runs the benchmark.
pub fn run(args: &Args) -> Result<Vec<Line>, Error> {
    let tmp = tempfile::tempdir().map_err(crate::io("temporary directory"))?;
    let work = args.dir.clone().unwrap_or_else(|| tmp.path().to_path_buf());
    let mut lines = Vec::new();

    // 1. Search latency and recall on synthetic vectors.
    eprintln!(
        "[retrieval] {} {} unit vectors of dimension {}",
        args.points, args.vectors, args.dim
    );
    let mut rng = SmallRng::seed_from_u64(42);
    let clustered = match args.vectors.as_str() {
        "clustered" => true,
        "isotropic" => false,
        other => {
            return Err(Error::Invalid {
                what: "--vectors",
                why: format!("{other:?} (clustered or isotropic)"),
            })
        }
    };
    let centers: Vec<Vec<f32>> = (0..1000)
        .map(|_| gaussian_unit(&mut rng, args.dim))
        .collect();
    // Point = normalize(center + noise); noise of norm 0.9 puts it at cosine ~0.75 from the
    // center. Queries: a random point plus noise of norm 0.6.
    fn near(rng: &mut SmallRng, c: &[f32], scale: f32) -> Vec<f32> {
        let n = gaussian_unit(rng, c.len());
        let mut v: Vec<f32> = c.iter().zip(&n).map(|(a, b)| a + scale * b).collect();
        retrieval::normalize(&mut v);
        v
    }
    let vectors: Vec<Vec<f32>> = (0..args.points)
        .map(|i| {
            if clustered {
                near(&mut rng, &centers[i % centers.len()], 0.9)
            } else {
                gaussian_unit(&mut rng, args.dim)
            }
        })
        .collect();
    let config = IndexConfig {
        optimize_after: usize::MAX, // the bench decides when to optimize
        hnsw_ef: args.hnsw_ef,
        ..IndexConfig::default()
    };
    let index_dir = work.join("vectors");
    let _ = std::fs::remove_dir_all(&index_dir);
    let index = VectorIndex::open(&index_dir, args.dim, &config).map_err(rerr)?;
    let mut ids = Vec::with_capacity(vectors.len());
    let t = Instant::now();
    for (b, batch) in vectors.chunks(1000).enumerate() {
        let points: Vec<ChunkPoint> = batch
            .iter()
            .enumerate()
            .map(|(i, v)| {
                ChunkPoint::new(
                    v.clone(),
                    payload(format!("d{b}"), i as u32, String::new(), 0),
                )
            })
            .collect();
        ids.extend(points.iter().map(|p| p.id));
        index.upsert(&points).map_err(rerr)?;
    }
    index.flush().map_err(rerr)?;
    let upsert_s = t.elapsed().as_secs_f64();
    let queries: Vec<Vec<f32>> = (0..args.queries)
        .map(|_| {
            if clustered {
                let i = rng.gen_range(0..vectors.len());
                near(&mut rng, &vectors[i], 0.6)
            } else {
                gaussian_unit(&mut rng, args.dim)
            }
        })
        .collect();
    let recall_q = &queries[..args.recall_queries.min(queries.len())];
    let (p50_before, p99_before) = time_searches(&index, &queries, 10)?;
    let recall_before = recall_at(&index, &vectors, &ids, recall_q, 10)?;
    let t = Instant::now();
    index.optimize().map_err(rerr)?;
    let optimize_s = t.elapsed().as_secs_f64();
    let info = index.info().map_err(rerr)?;
    let (p50_after, p99_after) = time_searches(&index, &queries, 10)?;
    let recall_after = recall_at(&index, &vectors, &ids, recall_q, 10)?;
    eprintln!(
        "[retrieval] upsert {upsert_s:.1} s, optimize {optimize_s:.1} s, {} of {} points indexed in {} segments; \
         recall@10 before optimize {recall_before:.4}",
        info.indexed, info.points, info.segments
    );
    let base = "same index before optimize() (unindexed segments, exact scan)";
    lines.push(Line::lower(
        "search_p50_top10",
        p50_after,
        p50_before,
        "us",
        base,
    ));
    lines.push(Line::lower(
        "search_p99_top10",
        p99_after,
        p99_before,
        "us",
        base,
    ));
    lines.push(
        Line::higher(
            "recall_at_10",
            recall_after,
            1.0,
            "fraction",
            "exact brute-force search over the same vectors",
        )
        .bar(0.95),
    );
    drop(index);

    // 2. Embedding throughput and answer recall on the corpus.
    if args.docs > 0 {
        let ds = dataset::resolve(args.dataset.as_deref())?;
        let chunks = corpus_chunks(&ds, args.docs, args.chunk_tokens)?;
        let mean_tokens =
            chunks.iter().map(|c| c.3 as f64).sum::<f64>() / chunks.len().max(1) as f64;
        eprintln!(
            "[retrieval] {} chunks of {} tokens max (mean {mean_tokens:.0})",
            chunks.len(),
            args.chunk_tokens
        );

        // Throughput: one text per call (the default) vs batches of 16, same model, same chunks.
        let one_by_one = Embedder::new(&EmbedderConfig::default()).map_err(rerr)?;
        let embedder = Embedder::new(&EmbedderConfig {
            batch_size: 16,
            ..EmbedderConfig::default()
        })
        .map_err(rerr)?;
        let sample: Vec<&str> = chunks
            .iter()
            .take(args.embed_chunks)
            .map(|c| c.2.as_str())
            .collect();
        let t = Instant::now();
        embedder.embed(&sample).map_err(rerr)?;
        let batched = sample.len() as f64 / t.elapsed().as_secs_f64();
        let t = Instant::now();
        one_by_one.embed(&sample).map_err(rerr)?;
        let single = sample.len() as f64 / t.elapsed().as_secs_f64();
        lines.push(Line::higher(
            "embed_throughput",
            single,
            batched,
            "chunks/s",
            "same model, batches of 16 padded to their longest chunk",
        ));

        // Answer recall@5: ours (the default truncation) vs truncating at 512.
        let qs = dataset::questions(&ds, args.questions)?;
        let mut recall = Vec::new();
        let ours_tokens = EmbedderConfig::default().max_tokens;
        for max_tokens in [ours_tokens, 512usize] {
            let e = Embedder::new(&EmbedderConfig {
                max_tokens,
                ..EmbedderConfig::default()
            })
            .map_err(rerr)?;
            let t = Instant::now();
            let texts: Vec<&str> = chunks.iter().map(|c| c.2.as_str()).collect();
            let vecs = e.embed(&texts).map_err(rerr)?;
            eprintln!(
                "[retrieval] embedded {} chunks at max_tokens {max_tokens} in {:.1} s",
                texts.len(),
                t.elapsed().as_secs_f64()
            );
            let dir = work.join(format!("corpus-{max_tokens}"));
            let _ = std::fs::remove_dir_all(&dir);
            let idx = VectorIndex::open(&dir, e.dim(), &IndexConfig::default()).map_err(rerr)?;
            let points: Vec<ChunkPoint> = chunks
                .iter()
                .zip(vecs)
                .map(|(c, v)| ChunkPoint::new(v, payload(c.0.clone(), c.1, c.2.clone(), c.3)))
                .collect();
            for b in points.chunks(512) {
                idx.upsert(b).map_err(rerr)?;
            }
            idx.optimize().map_err(rerr)?;
            let mut hit = 0usize;
            for q in &qs {
                let qv = e.embed_one(&q.question).map_err(rerr)?;
                let top = idx.search(&qv, 5, &SearchFilter::default()).map_err(rerr)?;
                if top
                    .iter()
                    .any(|h| dataset::contains_answer(&h.payload.text, &q.answer))
                {
                    hit += 1;
                }
            }
            recall.push(hit as f64 / qs.len().max(1) as f64);
        }
        lines.push(Line::higher(
            "answer_recall_at_5",
            recall[0],
            recall[1],
            "fraction",
            "embedder truncating at 512 word pieces (whole chunks)",
        ));
    }
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_top_orders_by_similarity() {
        let v = vec![
            vec![1.0, 0.0],
            vec![0.0, 1.0],
            vec![std::f32::consts::FRAC_1_SQRT_2; 2],
        ];
        assert_eq!(exact_top(&v, &[1.0, 0.1], 2), vec![0, 2]);
        assert_eq!(exact_top(&v, &[0.0, 1.0], 5), vec![1, 2, 0]);
    }
}
