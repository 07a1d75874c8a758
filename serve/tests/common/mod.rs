//! Shared by the serve test binaries: an engine over real models (SmolLM2-135M, MiniLM).
#![allow(dead_code)]

use std::path::Path;

pub mod router;

/// Three short documents, two of them about the Orion vault (each one chunk): a chunk's
/// nearest neighbours are the other two.
pub const VAULT_DOCS: &[(&str, &str)] = &[
    (
        "vault",
        "The Harrowgate archive keeps its oldest survey maps in the Orion vault. The access \
         code for the Orion vault is 4817.",
    ),
    (
        "vault-ledger",
        "Every visit to the Orion vault of the Harrowgate archive is written in the vault \
         ledger, which the head archivist signs each evening.",
    ),
    (
        "ship",
        "The research ship Calder Wren studies plankton in the North Atlantic. Its captain \
         is Ines Valbuena.",
    ),
];

/// SmolLM2-135M from the model cache.
pub fn model() -> model::Model {
    let path = model::models_dir().join(model::SMOLLM2_FILE);
    model::Model::load(
        &model::ModelSource::from_path(&path).unwrap(),
        &model::LoadOptions::default(),
    )
    .unwrap()
}

/// An engine (store, embedded index, MiniLM, SmolLM2) over the data in `dir`, storing KV in
/// `kv_dtype` (part of the namespace).
pub fn open_engine(
    dir: &Path,
    config: ingest::IngestConfig,
    kv_dtype: model::DType,
) -> ingest::Engine {
    open_engine_with(dir, config, kv_dtype, model())
}

/// [`open_engine`] with another model.
pub fn open_engine_with(
    dir: &Path,
    config: ingest::IngestConfig,
    kv_dtype: model::DType,
    llm: model::Model,
) -> ingest::Engine {
    open_engine_opts(dir, config, kv_dtype, llm, kvstore::StoreOptions::default())
}

/// [`open_engine_with`] with store options (a codec, ...).
pub fn open_engine_opts(
    dir: &Path,
    config: ingest::IngestConfig,
    kv_dtype: model::DType,
    llm: model::Model,
    store: kvstore::StoreOptions,
) -> ingest::Engine {
    ingest::Engine::new(open_corpus(dir, config, kv_dtype, llm, store))
}

/// The corpus [`open_engine_opts`] writes: a store and an index in `dir`, the default
/// embedder, `llm`.
pub fn open_corpus(
    dir: &Path,
    config: ingest::IngestConfig,
    kv_dtype: model::DType,
    llm: model::Model,
    store: kvstore::StoreOptions,
) -> ingest::Corpus {
    let store = kvstore::Store::open(dir.join("kv"), store).unwrap();
    let embedder = retrieval::Embedder::new(&retrieval::EmbedderConfig::default()).unwrap();
    let index = retrieval::VectorIndex::open(
        &dir.join("vectors"),
        embedder.dim(),
        &retrieval::IndexConfig::default(),
    )
    .unwrap();
    ingest::Corpus::new(
        std::sync::Arc::new(store),
        std::sync::Arc::new(index),
        std::sync::Arc::new(embedder),
        std::sync::Arc::new(llm),
        config,
        kv_dtype,
    )
    .unwrap()
}

/// [`open_engine`] with KV as f16, and `source` ingested eagerly; asserts that `docs`
/// documents were new.
pub fn engine(
    dir: &Path,
    config: ingest::IngestConfig,
    source: ingest::Source,
    docs: usize,
) -> ingest::Engine {
    let engine = open_engine(dir, config, model::DType::F16);
    let report = ingest_eager(&engine, source);
    assert_eq!(report.docs_new, docs, "{report:?}");
    engine
}

/// Ingests `source` with its KV, no pruning.
pub fn ingest_eager(engine: &ingest::Engine, source: ingest::Source) -> ingest::Report {
    engine
        .ingest(
            &[source],
            &ingest::RunOptions {
                materialize: ingest::Materialize::Eager,
                prune: false,
                shard: None,
            },
            &ingest::Counters::default(),
        )
        .unwrap()
}

/// A pipeline on `engine` with `system_prompt` (the one its chunks were materialized after
/// under `ingest.context = "prompt..."`).
pub fn pipeline(
    engine: &std::sync::Arc<ingest::Engine>,
    system_prompt: &str,
) -> std::sync::Arc<serve::Rag> {
    let config = serve::ServeConfig {
        system_prompt: system_prompt.into(),
        ..serve::ServeConfig::default()
    };
    serve::Rag::start(engine.clone(), config).unwrap()
}

/// Stops `rag` and waits (up to 30 s) until its threads have let go of `engine`.
pub fn stop(rag: std::sync::Arc<serve::Rag>, engine: &std::sync::Arc<ingest::Engine>) {
    drop(rag);
    let start = std::time::Instant::now();
    while std::sync::Arc::strong_count(engine) > 1 && start.elapsed().as_secs() < 30 {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// A query's final record through the pipeline (its text pieces skipped).
pub fn answer(rag: &serve::Rag, q: serve::Query, hits: Vec<retrieval::Hit>) -> Box<serve::Final> {
    let asm = q.assembly;
    let (tx, mut rx) = tokio::sync::mpsc::channel(256);
    let ticket = rag.admit().unwrap();
    rag.submit(
        ticket,
        q,
        hits,
        tx,
        std::time::Instant::now(),
        std::time::Duration::ZERO,
    )
    .unwrap();
    loop {
        match rx.blocking_recv().expect("query ended") {
            serve::Event::Token(_) => {}
            serve::Event::Done(f) => return f,
            serve::Event::Error(_, e) => panic!("{asm}: {e}"),
        }
    }
}

/// In-memory documents `(id, text)` as an ingest source.
pub fn docs(texts: &[(&str, &str)]) -> ingest::Source {
    ingest::Source::Docs(
        texts
            .iter()
            .map(|(id, text)| ingest::Doc {
                id: id.to_string(),
                text: text.to_string(),
                metadata: Default::default(),
                origin: id.to_string(),
            })
            .collect(),
    )
}

/// Largest absolute difference between two tensors of one shape (compared in f32).
pub fn max_abs_diff(a: &model::Tensor, b: &model::Tensor) -> f32 {
    let f = |t: &model::Tensor| t.to_dtype(model::DType::F32).unwrap();
    (f(a) - f(b))
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar()
        .unwrap()
}
