//! Builds an ingest engine (store, embedded index, embedder, model) in a scratch directory.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::Error;

fn e(what: &str) -> impl Fn(String) -> Error + '_ {
    move |why| Error::Check(format!("{what}: {why}"))
}

/// The engine benchmarks run: SmolLM2 by default, KV stored as f16.
pub fn open(
    dir: &Path,
    model_path: Option<&PathBuf>,
    chunk_tokens: usize,
) -> Result<ingest::Engine, Error> {
    let store = kvstore::Store::open(dir.join("kv"), kvstore::StoreOptions::default())?;
    let embedder = retrieval::Embedder::new(&retrieval::EmbedderConfig::default())
        .map_err(|x| e("embedder")(x.to_string()))?;
    let index = retrieval::VectorIndex::open(
        &dir.join("vectors"),
        embedder.dim(),
        &retrieval::IndexConfig::default(),
    )
    .map_err(|x| e("index")(x.to_string()))?;
    let path = model_path
        .cloned()
        .unwrap_or_else(|| model::models_dir().join(model::SMOLLM2_FILE));
    let llm = model::ModelSource::from_path(&path)
        .and_then(|s| model::Model::load(&s, &model::LoadOptions::default()))
        .map_err(|x| e("model")(x.to_string()))?;
    ingest::Engine::new(
        Arc::new(store),
        Arc::new(index),
        Arc::new(embedder),
        Arc::new(llm),
        ingest::IngestConfig {
            chunk_tokens,
            ..ingest::IngestConfig::default()
        },
        model::DType::F16,
    )
    .map_err(|x| e("engine")(x.to_string()))
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
            },
            &ingest::Counters::default(),
        )
        .map_err(|x| e("ingest")(x.to_string()))
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
