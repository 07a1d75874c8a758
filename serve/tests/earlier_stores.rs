//! A store written under the earlier default materialization (each chunk alone, `ingest.context
//! = "none"`), opened with the `ragkv` binary's default since ([`ingest::IngestConfig::recommended`]:
//! `prompt+mean:2` with `exact_first`), SmolLM2-135M and MiniLM, chunks in `q8`: it answers as
//! it did, from its plain KV, writing nothing, until `rematerialize` re-materializes it.

mod common;

use std::sync::Arc;

use serve::Assembly;

use common::VAULT_DOCS as DOCS;

const SYSTEM: &str = "Be brief.";

fn query(assembly: Assembly) -> serve::Query {
    serve::Query {
        question: "What is the access code for the Orion vault?".into(),
        top_k: 2,
        filter: Default::default(),
        params: model::GenerateParams::default(),
        kv: serve::KvMode::On,
        assembly,
    }
}

fn open(dir: &std::path::Path, config: ingest::IngestConfig) -> Arc<ingest::Engine> {
    let q8 = kvstore::StoreOptions {
        default_codec: kvstore::Codec::Q8,
        ..kvstore::StoreOptions::default()
    };
    let config = ingest::IngestConfig {
        system_prompt: SYSTEM.into(),
        ..config
    };
    Arc::new(common::open_engine_opts(
        dir,
        config,
        model::DType::F16,
        common::model(),
        q8,
    ))
}

#[test]
fn a_store_written_under_the_earlier_default_serves_unchanged_until_rematerialized() {
    let dir = tempfile::tempdir().unwrap();
    let strategies = [Assembly::Reposition, Assembly::Link(Some(2))];

    // Written and answered with each chunk alone.
    let engine = open(dir.path(), ingest::IngestConfig::default());
    let report = common::ingest_eager(&engine, common::docs(DOCS));
    assert_eq!(report.docs_new, DOCS.len(), "{report:?}");
    let rag = common::pipeline(&engine, SYSTEM);
    let hits = rag.retrieve(&query(Assembly::Full)).unwrap();
    assert_eq!(hits.len(), 2);
    let chunks: Vec<Vec<u32>> = hits
        .iter()
        .map(|h| engine.corpus().chunk_tokens(&h.payload.text).unwrap())
        .collect();
    let answer = &chunks[0][..4];
    let forced = |rag: &serve::Rag, asm| rag.forced(&query(asm), hits.clone(), answer).unwrap();
    let before = strategies.map(|a| forced(&rag, a));
    common::stop(rag, &engine);
    drop(engine);

    // Reopened under the new default: none of its chunks is in the new namespaces, yet every
    // one is served from its plain KV, as before, and nothing is written.
    let engine = open(dir.path(), ingest::IngestConfig::recommended());
    let corpus = engine.corpus();
    assert_eq!(corpus.plain_sources().len(), 2, "q8, then lossless");
    assert!(chunks.iter().all(|c| !corpus.stored(c).unwrap()));
    let rag = common::pipeline(&engine, SYSTEM);
    for (asm, want) in strategies.iter().zip(&before) {
        let d = common::max_abs_diff(&forced(&rag, *asm), want);
        assert!(d < 1e-5, "{asm}: {d} from the same store's answer before");
    }
    let f = common::answer(&rag, query(Assembly::Link(Some(2))), hits.clone());
    assert_eq!((f.kv_hits, f.kv_misses), (2, 0));
    assert_eq!(
        f.recomputed_tokens, 4,
        "the plain first chunk is repaired as before"
    );
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert!(chunks.iter().all(|c| !corpus.stored(c).unwrap()));
    common::stop(rag, &engine);

    // `rematerialize` migrates it as after a model change (the chunks are stale: stored under
    // another namespace only): every chunk and its first place's copy prefilled under the new
    // mode, which the answers then come from.
    let r = engine
        .rematerialize(
            &ingest::RematOptions::default(),
            &ingest::Counters::default(),
        )
        .unwrap();
    assert_eq!((r.stale, r.prefilled), (DOCS.len(), DOCS.len()), "{r:?}");
    assert!(chunks.iter().all(|c| corpus.stored(c).unwrap()));
    let rag = common::pipeline(&engine, SYSTEM);
    let d = common::max_abs_diff(&forced(&rag, Assembly::Reposition), &before[0]);
    assert!(d > 1e-2, "answers still from the plain KV ({d})");
    let f = common::answer(&rag, query(Assembly::Link(Some(2))), hits.clone());
    assert_eq!(
        (f.kv_hits, f.recomputed_tokens),
        (2, 2),
        "the first chunk's copy is exact: only the second is repaired"
    );
    common::stop(rag, &engine);
}
