//! Builds an ingest engine (store, embedded index, embedder, model) in a scratch directory.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::Error;

fn e<E: std::fmt::Display>(what: &str) -> impl Fn(E) -> Error + '_ {
    move |why| Error::Check(format!("{what}: {why}"))
}

/// Which model a benchmark's engine runs.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ModelArgs {
    /// GGUF file or HF directory (default: SmolLM2-135M-Instruct from scripts/setup.sh).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Keep GGUF weights quantized in memory (`model.weights = "quantized"`).
    #[arg(long)]
    pub quantized: bool,
    /// Compute device of the model: cpu, cuda or cuda:N (`model.device`; CUDA needs a
    /// `--features cuda` build).
    #[arg(long, default_value = "cpu")]
    pub device: String,
}

impl ModelArgs {
    /// The model file's name, for reports.
    pub fn name(&self) -> String {
        self.model.as_ref().map_or_else(
            || model::SMOLLM2_FILE.to_string(),
            |p| p.file_name().unwrap_or_default().to_string_lossy().into(),
        )
    }
}

/// The engine benchmarks run: SmolLM2 by default, KV stored as f16, chunks alone.
pub fn open(dir: &Path, llm: &ModelArgs, chunk_tokens: usize) -> Result<ingest::Engine, Error> {
    open_with(dir, llm, chunk_tokens, "")
}

/// [`open`] with a chunk preamble (`ingest.chunk_preamble`).
pub fn open_with(
    dir: &Path,
    llm: &ModelArgs,
    chunk_tokens: usize,
    chunk_preamble: &str,
) -> Result<ingest::Engine, Error> {
    let config = chunks_alone(chunk_tokens, chunk_preamble);
    open_coded(dir, llm, config, kvstore::Codec::None)
}

/// What a serving benchmark's chunks are prefilled after (`bench peer`, `bench ttft`): chunks
/// alone by default, like its codec, so that its figures stay comparable with earlier runs.
#[derive(Debug, Clone, clap::Args)]
pub struct Materialization {
    /// What ragkv's chunks are prefilled after (`ingest.context`; `ragkv ingest` uses
    /// `prompt+mean:2` by default); use a separate `--dir` per mode. A `kv=off` baseline then
    /// recomputes each chunk as ingest does, after its context too.
    #[arg(long, default_value = "none")]
    pub context: ingest::Context,
    /// With `--context prompt+mean:N` (or `prompt+neighbours:N`): each chunk's copy after the
    /// prompt's start alone too, read for the chunk placed first (`ingest.exact_first`;
    /// default: on where it applies).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub exact_first: Option<bool>,
}

impl Materialization {
    /// [`chunks_alone`]'s settings with this materialization.
    pub fn config(&self, chunk_tokens: usize) -> ingest::IngestConfig {
        ingest::IngestConfig {
            context: self.context,
            exact_first: self.exact_first.unwrap_or(self.context.takes_exact_first()),
            ..chunks_alone(chunk_tokens, "")
        }
    }
}

/// The ingest settings of most benchmarks: chunks of `chunk_tokens` with `chunk_preamble`,
/// each prefilled alone (`ingest.context = "none"`).
pub fn chunks_alone(chunk_tokens: usize, chunk_preamble: &str) -> ingest::IngestConfig {
    ingest::IngestConfig {
        chunk_tokens,
        chunk_preamble: chunk_preamble.into(),
        ..ingest::IngestConfig::default()
    }
}

/// An engine with `config` storing chunk KV with `codec`.
pub fn open_coded(
    dir: &Path,
    llm: &ModelArgs,
    config: ingest::IngestConfig,
    codec: kvstore::Codec,
) -> Result<ingest::Engine, Error> {
    corpus(dir, llm, config, codec).map(ingest::Engine::new)
}

/// The corpus in `dir` (KV store, vector index, embedder, model) that [`open_coded`] writes.
pub fn corpus(
    dir: &Path,
    llm: &ModelArgs,
    config: ingest::IngestConfig,
    codec: kvstore::Codec,
) -> Result<ingest::Corpus, Error> {
    let opts = kvstore::StoreOptions {
        default_codec: codec,
        ..kvstore::StoreOptions::default()
    };
    let store = kvstore::Store::open(dir.join("kv"), opts)?;
    let embedder = retrieval::Embedder::new(&retrieval::EmbedderConfig::default())
        .map_err(|x| e("embedder")(x.to_string()))?;
    let index = retrieval::VectorIndex::open(
        &dir.join("vectors"),
        embedder.dim(),
        &retrieval::IndexConfig::default(),
    )
    .map_err(|x| e("index")(x.to_string()))?;
    let path = llm
        .model
        .clone()
        .unwrap_or_else(|| model::models_dir().join(model::SMOLLM2_FILE));
    let device = model::device(if llm.device.is_empty() {
        "cpu"
    } else {
        &llm.device
    })
    .map_err(|x| e("model.device")(x.to_string()))?;
    let opts = model::LoadOptions {
        quantized: llm.quantized,
        device,
        ..model::LoadOptions::default()
    };
    let llm = model::ModelSource::from_path(&path)
        .and_then(|s| model::Model::load(&s, &opts))
        .map_err(|x| e("model")(x.to_string()))?;
    ingest::Corpus::new(
        Arc::new(store),
        Arc::new(index),
        Arc::new(embedder),
        Arc::new(llm),
        config,
        model::DType::F16,
    )
    .map_err(|x| e("engine")(x.to_string()))
}

/// [`open_coded`] in `work`, indexing the first `docs` corpus documents (vectors only)
/// unless `work` already holds their whole index (an interrupted indexing goes on: ingest
/// skips what it has). `tag` prefixes the progress lines.
pub fn open_indexed(
    work: &Path,
    llm: &ModelArgs,
    config: ingest::IngestConfig,
    dataset: &Path,
    docs: usize,
    tag: &str,
    codec: kvstore::Codec,
) -> Result<ingest::Engine, Error> {
    let marker = work.join(format!("indexed-{docs}"));
    let engine = open_coded(work, llm, config, codec)?;
    if !marker.exists() {
        let corpus = crate::dataset::documents(dataset, docs)?;
        eprintln!("[{tag}] indexing {} documents (vectors only)", corpus.len());
        let progress = ingest::Progress::start(ingest::ProgressMode::Auto);
        let r = engine
            .ingest(
                &[ingest::Source::Docs(self::docs(&corpus))],
                &ingest::RunOptions {
                    materialize: ingest::Materialize::None,
                    prune: false,
                    shard: None,
                },
                &progress.counters,
            )
            .map_err(|x| e("ingest")(x.to_string()))?;
        drop(progress);
        eprintln!("[{tag}] {}", r.summary());
        std::fs::write(&marker, r.summary()).map_err(crate::io("index marker"))?;
    }
    Ok(engine)
}

/// Hands an already retrieved query to the serving pipeline; returns its event channel.
pub fn submit(
    rag: &serve::Rag,
    query: serve::Query,
    hits: Vec<retrieval::Hit>,
    arrived: std::time::Instant,
) -> Result<tokio::sync::mpsc::Receiver<serve::Event>, Error> {
    let (tx, rx) = tokio::sync::mpsc::channel(1024);
    let ticket = rag
        .admit()
        .ok_or_else(|| Error::Check("the pipeline is at serve.max_inflight".into()))?;
    rag.submit(ticket, query, hits, tx, arrived, arrived.elapsed())
        .map_err(e("submit"))?;
    Ok(rx)
}

/// The query's final event (its text pieces are skipped).
pub fn wait(mut rx: tokio::sync::mpsc::Receiver<serve::Event>) -> Result<serve::Final, Error> {
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            serve::Event::Token(_) => {}
            serve::Event::Done(f) => return Ok(*f),
            serve::Event::Error(_, why) => return Err(Error::Check(format!("query: {why}"))),
        }
    }
    Err(Error::Check("query ended without a result".into()))
}

/// Ingests `source` with `materialize`, no pruning, no progress display.
pub fn ingest(
    engine: &ingest::Engine,
    source: ingest::Source,
    materialize: ingest::Materialize,
) -> Result<ingest::Report, Error> {
    engine
        .ingest(
            &[source],
            &ingest::RunOptions {
                materialize,
                prune: false,
                shard: None,
            },
            &ingest::Counters::default(),
        )
        .map_err(|x| e("ingest")(x.to_string()))
}

/// Stores the KV of every retrieved chunk not stored yet (what eager ingest would have
/// stored, attached to the chunk's document version); returns how many were prefilled.
pub fn materialize(engine: &ingest::Engine, hits: &[retrieval::Hit]) -> Result<usize, Error> {
    let corpus = engine.corpus();
    let mut n = 0;
    for h in hits {
        let tokens = corpus
            .chunk_tokens(&h.payload.text)
            .map_err(|x| e("tokenize")(x.to_string()))?;
        let doc = ingest::kv_doc(&h.payload.doc_id, &h.payload.doc_hash);
        if corpus
            .stored(&tokens)
            .map_err(|x| e("probe")(x.to_string()))?
        {
            continue;
        }
        if corpus.store().probe(corpus.namespace(), &tokens)? == tokens.len() {
            // Under `ingest.exact_first`, only the copy for the first place is missing.
            corpus
                .first_kv(&tokens)
                .and_then(|first| corpus.put_first(&doc, &tokens, first.as_deref()))
                .map_err(|x| e("prefill")(x.to_string()))?;
            n += 1;
            continue;
        }
        // Under `ingest.context`, after the chunk's neighbours, its note recorded first.
        let kv = corpus
            .chunk_kv_of_text(&tokens, &h.payload.text)
            .and_then(|kv| corpus.put_note(&tokens, &kv).map(|()| kv))
            .and_then(|kv| {
                corpus
                    .put_first(&doc, &tokens, kv.first.as_deref())
                    .map(|_| kv)
            })
            .map_err(|x| e("prefill")(x.to_string()))?;
        corpus.store().put_batch(
            corpus.namespace(),
            corpus.layout(),
            &[kvstore::PutItem {
                tokens: &tokens,
                kv: &kv.bytes,
                doc: Some(&doc),
            }],
        )?;
        n += 1;
    }
    Ok(n)
}

/// Dataset documents as in-memory ingest documents.
pub fn docs(dataset: &[crate::dataset::Document]) -> Vec<ingest::Doc> {
    dataset
        .iter()
        .map(|d| ingest::Doc {
            id: d.id.clone(),
            text: d.text.clone(),
            metadata: Default::default(),
            origin: d.id.clone(),
        })
        .collect()
}

/// Waits (up to 30 s) until the server threads holding `engine` have exited, then drops it:
/// the engine must close its index before the working directory is removed.
pub fn close(engine: Arc<ingest::Engine>) {
    let t = std::time::Instant::now();
    while Arc::strong_count(&engine) > 1 && t.elapsed() < std::time::Duration::from_secs(30) {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// An engine in `work` with the repository's example corpus ingested eagerly (SmolLM2,
/// 512-token chunks): what the serving benchmarks run against.
pub fn example(work: &Path, llm: &ModelArgs) -> Result<Arc<ingest::Engine>, Error> {
    let engine = Arc::new(open(work, llm, 512)?);
    let corpus = example_corpus()?;
    ingest(
        &engine,
        ingest::Source::Dir(corpus),
        ingest::Materialize::Eager,
    )?;
    Ok(engine)
}

/// The repository's example corpus: in the checkout the binary was built from, else
/// `examples/corpus` under the working directory (a binary copied out of its build tree and
/// run from a checkout).
pub fn example_corpus() -> Result<PathBuf, Error> {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/corpus");
    let here = PathBuf::from("examples/corpus");
    [built.clone(), here]
        .into_iter()
        .find(|p| p.is_dir())
        .ok_or_else(|| {
            Error::Check(format!(
                "the example corpus is neither at {} nor at ./examples/corpus: run from the checkout",
                built.display()
            ))
        })
}

/// Starts `engine`'s serving pipeline with `config` behind the production server loop on a
/// free loopback port, on a runtime of its own; dropping the runtime stops the server.
pub fn serve_loopback(
    engine: &Arc<ingest::Engine>,
    config: serve::ServeConfig,
) -> Result<
    (
        tokio::runtime::Runtime,
        std::net::SocketAddr,
        Arc<serve::Rag>,
    ),
    Error,
> {
    let limits = serve::listen::Limits::from_config(&config);
    let rag = serve::Rag::start(engine.clone(), config).map_err(e("server pipeline"))?;
    let app = serve::app(serve::AppState::new(rag.clone()));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(crate::io("tokio runtime"))?;
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .map_err(crate::io("bind"))?;
    let addr = listener.local_addr().map_err(crate::io("bind"))?;
    rt.spawn(serve::listen::serve(
        listener,
        app,
        limits,
        std::future::pending(),
    ));
    Ok((rt, addr, rag))
}
