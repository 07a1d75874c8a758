//! `ragkv bench index`: the dataset's chunks (the whole corpus by default) in the embedded
//! index (Qdrant Edge, after `optimize()`) and in a collection of a Qdrant server
//! (`--qdrant-url`, its default HNSW and optimizer settings, once its optimizer is idle),
//! side by side: recall@10 against exact search over the same vectors, and search latency
//! (p50, p99) as the engine sees it (the server's includes the loopback gRPC round trip).
//!
//! Queries are the dev questions, embedded as a query is at serve time; the timed phase
//! asks each of them `--rounds` times, alternating the backends question by question so
//! that neither gets a quieter machine.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use retrieval::{ChunkPoint, Embedder, EmbedderConfig, IndexConfig, SearchFilter, VectorIndex};

use crate::retrieval::{corpus_chunks, payload, recall_at, rerr};
use crate::{dataset, percentile, Error, Line};

/// Arguments of `ragkv bench index`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// The Qdrant server's gRPC URL.
    #[arg(long, env = "QDRANT_URL")]
    pub qdrant_url: String,
    /// Corpus documents chunked and embedded (default: all).
    #[arg(long, default_value_t = 100_000)]
    pub docs: usize,
    /// Dev questions used as queries.
    #[arg(long, default_value_t = 100)]
    pub questions: usize,
    /// Timed searches per question and backend.
    #[arg(long, default_value_t = 10)]
    pub rounds: usize,
    /// Chunk size in model (SmolLM2) tokens.
    #[arg(long, default_value_t = 512)]
    pub chunk_tokens: usize,
    /// LongBench-HotpotQA directory.
    #[arg(long)]
    pub dataset: Option<PathBuf>,
    /// Working directory (default: a fresh temporary directory).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// One backend's figures.
struct Side {
    recall: f64,
    p50_us: f64,
    p99_us: f64,
}

/// Waits until every point is counted and the count of HNSW-indexed points has not moved
/// for 5 s (the optimizer idle: below Qdrant's indexing threshold nothing is indexed), or
/// `limit` passes.
fn settle(
    index: &VectorIndex,
    points: usize,
    limit: Duration,
) -> Result<retrieval::IndexInfo, Error> {
    let t = Instant::now();
    let mut last = (usize::MAX, Instant::now());
    loop {
        let info = index.info().map_err(rerr)?;
        if info.indexed != last.0 {
            last = (info.indexed, Instant::now());
        }
        let idle = info.indexed >= points || last.1.elapsed() > Duration::from_secs(5);
        if (info.points >= points && idle) || t.elapsed() > limit {
            return Ok(info);
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Runs the benchmark.
pub fn run(args: &Args) -> Result<Vec<Line>, Error> {
    if args.rounds == 0 || args.questions == 0 {
        return Err(Error::Invalid {
            what: "--rounds/--questions",
            why: "at least 1".into(),
        });
    }
    let ds = dataset::resolve(args.dataset.as_deref())?;
    let work_dir = crate::WorkDir::new(args.dir.as_deref())?;
    let chunks = corpus_chunks(&ds, args.docs, args.chunk_tokens)?;
    let embedder = Embedder::new(&EmbedderConfig::default()).map_err(rerr)?;
    let t = Instant::now();
    let texts: Vec<&str> = chunks.iter().map(|c| c.2.as_str()).collect();
    let vectors = embedder.embed(&texts).map_err(rerr)?;
    eprintln!(
        "[index] embedded {} chunks in {:.0} s",
        vectors.len(),
        t.elapsed().as_secs_f64()
    );
    let points: Vec<ChunkPoint> = chunks
        .iter()
        .zip(&vectors)
        .map(|(c, v)| ChunkPoint::new(v.clone(), payload(c.0.clone(), c.1, c.2.clone(), c.3)))
        .collect();
    let ids: Vec<uuid::Uuid> = points.iter().map(|p| p.id).collect();
    let queries: Vec<Vec<f32>> = dataset::questions(&ds, args.questions)?
        .iter()
        .map(|q| embedder.embed_one(&q.question))
        .collect::<Result<_, _>>()
        .map_err(rerr)?;

    let embedded = VectorIndex::open(
        &work_dir.path().join("vectors"),
        embedder.dim(),
        &IndexConfig::default(),
    )
    .map_err(rerr)?;
    let stamp = crate::unix_secs();
    let server_config = IndexConfig {
        url: args.qdrant_url.clone(),
        collection: format!("ragkv-bench-index-{stamp}"),
        ..IndexConfig::default()
    };
    let server = VectorIndex::open(
        &work_dir.path().join("unused"),
        embedder.dim(),
        &server_config,
    )
    .map_err(rerr)?;
    for (name, index) in [("embedded", &embedded), ("server", &server)] {
        let t = Instant::now();
        for b in points.chunks(512) {
            index.upsert(b).map_err(rerr)?;
        }
        index.flush().map_err(rerr)?;
        index.optimize().map_err(rerr)?;
        let info = settle(index, points.len(), Duration::from_secs(600))?;
        eprintln!(
            "[index] {name}: {} points, {} indexed, {} segments, loaded in {:.1} s",
            info.points,
            info.indexed,
            info.segments,
            t.elapsed().as_secs_f64()
        );
    }
    let backends = [&embedded, &server];
    let mut lat: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    for q in queries
        .iter()
        .cycle()
        .take(queries.len() * (args.rounds + 1))
        .enumerate()
    {
        for (b, index) in backends.iter().enumerate() {
            let t = Instant::now();
            index
                .search(q.1, 10, &SearchFilter::default())
                .map_err(rerr)?;
            // The first pass over the questions warms both up and is not counted.
            if q.0 >= queries.len() {
                lat[b].push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    let mut sides = Vec::new();
    for (b, index) in backends.iter().enumerate() {
        lat[b].sort_by(f64::total_cmp);
        sides.push(Side {
            recall: recall_at(index, &vectors, &ids, &queries, 10)?,
            p50_us: percentile(&lat[b], 0.5),
            p99_us: percentile(&lat[b], 0.99),
        });
    }
    let server_info = server.info().map_err(rerr)?;
    server.delete_collection().map_err(rerr)?;
    let (e, s) = (&sides[0], &sides[1]);
    eprintln!(
        "[index] recall@10 embedded {:.4}, server {:.4}; p99 {:.0} vs {:.0} us",
        e.recall, s.recall, e.p99_us, s.p99_us
    );
    let detail = serde_json::json!({
        "points": points.len(), "queries": queries.len(), "timed_per_backend": lat[0].len(),
        "server_segments": server_info.segments, "server_indexed": server_info.indexed,
    });
    Ok(vec![
        Line::higher(
            "index.server_recall_at_10",
            s.recall,
            e.recall,
            "fraction",
            "embedded index (Qdrant Edge), same vectors",
        )
        .detail(serde_json::json!({"exact": 1.0, "embedded": e.recall, "server": s.recall})),
        Line::lower(
            "index.server_search_p50",
            s.p50_us,
            e.p50_us,
            "us",
            "embedded index (Qdrant Edge), same vectors",
        ),
        Line::lower(
            "index.server_search_p99",
            s.p99_us,
            e.p99_us,
            "us",
            "embedded index (Qdrant Edge), same vectors",
        )
        .detail(detail),
    ])
}
