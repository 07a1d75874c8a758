//! Two nodes over one shared KV tier: node A ingests (writing through to the tier), node B,
//! with its own empty KV store, answers from the KV it fetches there, without prefilling;
//! a document deleted through A leaves the tier. The vector index is one shared instance
//! (the role a Qdrant server plays between machines). Against a directory always; against a
//! real S3 server (Garage, `scripts/test-servers.sh`) with `--ignored` and `RAGKV_TEST_S3_*`.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use remote::{ReadMode, Remote, RemoteConfig, WriteMode};
use serve::{KvMode, Query, Rag, ServeConfig};

const DOCS: &[(&str, &str)] = &[
    (
        "orion-vault",
        "The Harrowgate archive keeps its oldest survey maps in the Orion vault, below the \
         reading room. The access code for the Orion vault is 4817. Only the head archivist \
         may open it.",
    ),
    (
        "calder-wren",
        "The research ship Calder Wren was launched in 2011 to study plankton in the North \
         Atlantic. The captain of the Calder Wren is Ines Valbuena.",
    ),
];

/// A corpus in `dir` with the default settings and f16 KV.
fn corpus(dir: &std::path::Path) -> ingest::Corpus {
    common::open_corpus(
        dir,
        Default::default(),
        model::DType::F16,
        common::model(),
        Default::default(),
    )
}

fn tier(base: &RemoteConfig, prefix: &str, write: WriteMode) -> Arc<Remote> {
    Arc::new(
        Remote::open(&RemoteConfig {
            prefix: prefix.into(),
            write,
            read: ReadMode::Through,
            timeout_ms: 10_000,
            ..base.clone()
        })
        .unwrap(),
    )
}

fn query(question: &str) -> Query {
    Query {
        question: question.into(),
        top_k: 1,
        filter: Default::default(),
        params: model::GenerateParams {
            max_tokens: 16,
            ..Default::default()
        },
        kv: KvMode::On,
        assembly: serve::Assembly::Reposition,
    }
}

/// A node with its own empty KV store in `dir` (`store` options) beside `a`: the same index,
/// embedder, model and ingest settings, and `tier` behind its store.
fn second_node(
    dir: &std::path::Path,
    a: &ingest::Engine,
    store: kvstore::StoreOptions,
    tier: Arc<Remote>,
) -> Arc<ingest::Engine> {
    let b_store = kvstore::Store::open(dir.join("kv"), store).unwrap();
    Arc::new(ingest::Engine::new(
        ingest::Corpus::new(
            Arc::new(b_store),
            a.corpus().index().clone(),
            a.corpus().embedder().clone(),
            a.corpus().model().clone(),
            a.corpus().config().clone(),
            model::DType::F16,
        )
        .unwrap()
        .with_remote(tier),
    ))
}

/// A node in `dir/a` (ingest settings `config`, `store` options, f16 KV) writing through to a
/// tier in `dir/tier`, and that tier's configuration.
fn writing_node(
    dir: &std::path::Path,
    config: ingest::IngestConfig,
    store: kvstore::StoreOptions,
) -> (Arc<ingest::Engine>, RemoteConfig) {
    let base = RemoteConfig {
        url: format!("file://{}", dir.join("tier").display()),
        ..RemoteConfig::default()
    };
    let corpus = common::open_corpus(
        &dir.join("a"),
        config,
        model::DType::F16,
        common::model(),
        store,
    );
    let a = corpus.with_remote(tier(&base, "ragkv", WriteMode::Through));
    (Arc::new(ingest::Engine::new(a)), base)
}

/// The tokens of a correct answer to the vault question, to teacher-force.
fn vault_answer(e: &ingest::Engine) -> Vec<u32> {
    let tokenizer = e.corpus().model().tokenizer();
    tokenizer.encode("The code is 4817.").unwrap()
}

/// Retrieves, then answers through the pipeline.
fn answer(rag: &Rag, q: Query) -> Box<serve::Final> {
    let hits = rag.retrieve(&q).unwrap();
    common::answer(rag, q, hits)
}

fn two_nodes(base: RemoteConfig, prefix: &str) {
    let dir = tempfile::tempdir().unwrap();
    // Node A: ingests, writing every chunk through to the tier.
    let a = ingest::Engine::new(corpus(&dir.path().join("a")).with_remote(tier(
        &base,
        prefix,
        WriteMode::Through,
    )));
    let report = common::ingest_eager(&a, common::docs(DOCS));
    assert_eq!(report.docs_new, DOCS.len());
    let shared = a.corpus().remote().cloned().unwrap();
    let ns = a.corpus().namespace();
    let stored = shared.usage().unwrap();
    assert_eq!(stored[&ns.to_hex()].0, report.chunks, "{stored:?}");

    // Node B: its own empty KV store, the same index and model; reads through, writes nothing.
    let b = second_node(
        &dir.path().join("b"),
        &a,
        Default::default(),
        tier(&base, prefix, WriteMode::Off),
    );
    assert_eq!(b.corpus().namespace(), ns);
    let rag = Rag::start(b.clone(), ServeConfig::default()).unwrap();
    let q = "What is the access code for the Orion vault?";
    let f = answer(&rag, query(q));
    assert!(f.answer.contains("4817"), "{:?}", f.answer);
    assert_eq!((f.kv_hits, f.kv_misses), (1, 0), "{:?}", f.citations);
    let m = &rag.metrics;
    assert_eq!(m.remote_hits.load(Ordering::Relaxed), 1);
    assert!(m.remote_bytes.load(Ordering::Relaxed) > 0);
    assert_eq!(m.remote_errors.load(Ordering::Relaxed), 0);
    // Kept locally: the second time is a local hit, the tier is not asked.
    let f = answer(&rag, query(q));
    assert_eq!((f.kv_hits, f.kv_misses), (1, 0));
    assert_eq!(m.remote_hits.load(Ordering::Relaxed), 1);
    assert!(
        b.corpus()
            .store()
            .probe(ns, &b.corpus().chunk_tokens(DOCS[0].1).unwrap())
            .unwrap()
            > 0
    );

    // Deleted through A: gone from the index (B no longer retrieves it) and from the tier.
    assert!(a.delete_document("orion-vault").unwrap());
    let hits = rag.retrieve(&query(q)).unwrap();
    assert!(
        hits.iter().all(|h| h.payload.doc_id != "orion-vault"),
        "{hits:?}"
    );
    let left = shared.usage().unwrap();
    assert_eq!(
        left.get(&ns.to_hex()).map_or(0, |u| u.0),
        report.chunks - 1,
        "{left:?}"
    );
    assert!(shared.manifests(ns, "orion-vault").unwrap().is_empty());
    drop(rag);
}

#[test]
fn a_second_node_serves_what_the_first_stored_in_a_shared_directory() {
    let d = tempfile::tempdir().unwrap();
    two_nodes(
        RemoteConfig {
            url: format!("file://{}", d.path().display()),
            ..RemoteConfig::default()
        },
        "ragkv",
    );
}

#[test]
#[ignore = "needs an S3 server: scripts/test-servers.sh starts Garage and sets RAGKV_TEST_S3_*"]
fn a_second_node_serves_what_the_first_stored_in_an_s3_bucket() {
    let var = |k: &str| std::env::var(k).expect("RAGKV_TEST_S3_* name the server");
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    two_nodes(
        RemoteConfig {
            url: var("RAGKV_TEST_S3_URL"),
            bucket: var("RAGKV_TEST_S3_BUCKET"),
            credentials: var("RAGKV_TEST_S3_CREDENTIALS"),
            region: "garage".into(),
            ..RemoteConfig::default()
        },
        &format!("test/two-nodes-{t}"),
    );
}

/// With a lossy codec the tier holds a chunk's KV as computed and each node's store holds it
/// encoded: a node that fetches a chunk must answer from it exactly as it will from its kept
/// copy, and as the ingesting node does from its own (same logits, bit for bit).
#[test]
fn a_fetched_chunk_answers_as_the_stored_copies_do() {
    let dir = tempfile::tempdir().unwrap();
    let q8 = kvstore::StoreOptions {
        default_codec: kvstore::Codec::Q8,
        ..Default::default()
    };
    let (a, base) = writing_node(dir.path(), Default::default(), q8.clone());
    let (id, text) = DOCS[0];
    let doc = ingest::Doc {
        id: id.into(),
        text: text.into(),
        metadata: Default::default(),
        origin: id.into(),
    };
    common::ingest_eager(&a, ingest::Source::Docs(vec![doc]));
    let b = second_node(
        &dir.path().join("b"),
        &a,
        q8,
        tier(&base, "ragkv", WriteMode::Off),
    );
    let (rag_a, rag_b) = (
        Rag::start(a.clone(), ServeConfig::default()).unwrap(),
        Rag::start(b.clone(), ServeConfig::default()).unwrap(),
    );
    let q = query("What is the access code for the Orion vault?");
    let hits = rag_b.retrieve(&q).unwrap();
    let answer = vault_answer(&a);
    let logits = |rag: &Rag| -> Vec<Vec<f32>> {
        rag.forced(&q, hits.clone(), &answer)
            .unwrap()
            .to_dtype(model::DType::F32)
            .unwrap()
            .to_vec2()
            .unwrap()
    };
    let differ = |x: &[Vec<f32>], y: &[Vec<f32>]| {
        x.iter()
            .flatten()
            .zip(y.iter().flatten())
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max)
    };
    let fetched = logits(&rag_b);
    assert_eq!(rag_b.metrics.remote_hits.load(Ordering::Relaxed), 1);
    let kept = logits(&rag_b);
    assert_eq!(
        rag_b.metrics.remote_hits.load(Ordering::Relaxed),
        1,
        "read locally"
    );
    assert_eq!(
        differ(&fetched, &kept),
        0.0,
        "the fetched chunk answers as its kept copy"
    );
    let ingesting = logits(&rag_a);
    assert_eq!(
        differ(&fetched, &ingesting),
        0.0,
        "and as the ingesting node's copy"
    );
    assert_eq!(fetched.len(), answer.len());
}

/// Under the binary's default materialization (`prompt+mean:2` with `exact_first`) the tier
/// holds each chunk's copy for the first place beside its own KV: a node that fetches a chunk
/// placed first reads its copy, so it answers as the ingesting node does (same logits, no
/// token of the first chunk repaired); deleting the document removes both from the tier.
#[test]
fn a_second_node_reads_the_first_places_copy_from_the_tier() {
    let dir = tempfile::tempdir().unwrap();
    let (a, base) = writing_node(
        dir.path(),
        ingest::IngestConfig::recommended(),
        Default::default(),
    );
    let report = common::ingest_eager(&a, common::docs(DOCS));
    let (ns, first_ns) = (
        a.corpus().namespace(),
        a.corpus().first_namespace().unwrap(),
    );
    let shared = a.corpus().remote().cloned().unwrap();
    let stored = shared.usage().unwrap();
    for n in [ns, first_ns] {
        assert_eq!(stored[&n.to_hex()].0, report.chunks, "{stored:?}");
        assert_eq!(shared.manifests(n, "orion-vault").unwrap().len(), 1);
    }
    let b = second_node(
        &dir.path().join("b"),
        &a,
        Default::default(),
        tier(&base, "ragkv", WriteMode::Off),
    );
    let (rag_a, rag_b) = (
        Rag::start(a.clone(), ServeConfig::default()).unwrap(),
        Rag::start(b.clone(), ServeConfig::default()).unwrap(),
    );
    let q = Query {
        assembly: serve::Assembly::Link(Some(2)),
        ..query("What is the access code for the Orion vault?")
    };
    let hits = rag_b.retrieve(&q).unwrap();
    let f = common::answer(&rag_b, q.clone(), hits.clone());
    assert_eq!((f.kv_hits, f.kv_misses), (1, 0), "{:?}", f.citations);
    assert_eq!(f.recomputed_tokens, 0, "the first chunk read exact");
    // The copy and the chunk's own KV, both kept locally.
    assert_eq!(rag_b.metrics.remote_hits.load(Ordering::Relaxed), 2);
    let tokens = b.corpus().chunk_tokens(DOCS[0].1).unwrap();
    for n in [ns, first_ns] {
        assert!(b.corpus().store().probe(n, &tokens).unwrap() > 0);
    }
    let answer = vault_answer(&a);
    let logits = |rag: &Rag| -> Vec<f32> {
        let t = rag.forced(&q, hits.clone(), &answer).unwrap();
        t.to_dtype(model::DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    let (from_b, from_a) = (logits(&rag_b), logits(&rag_a));
    assert_eq!(
        rag_b.metrics.remote_hits.load(Ordering::Relaxed),
        2,
        "read locally"
    );
    assert_eq!(from_b, from_a, "both nodes answer from the same exact copy");

    assert!(a.delete_document("orion-vault").unwrap());
    let left = shared.usage().unwrap();
    for n in [ns, first_ns] {
        assert_eq!(
            left.get(&n.to_hex()).map_or(0, |u| u.0),
            report.chunks - 1,
            "{left:?}"
        );
        assert!(shared.manifests(n, "orion-vault").unwrap().is_empty());
    }
}

/// N shard workers (`--shard I/N`), each taking its own documents, into one index and one
/// shared tier: the same points and the same KV objects as one worker over everything.
#[test]
fn shard_workers_together_store_what_one_worker_stores() {
    let dir = tempfile::tempdir().unwrap();
    let docs = || -> Vec<ingest::Doc> {
        (0..8)
            .map(|i| ingest::Doc {
                id: format!("doc-{i}"),
                text: format!(
                    "Record {i}: the lighthouse on island {i} was rebuilt in {}. Its keeper \
                     that year was keeper number {}.",
                    1900 + 7 * i,
                    i * 3 + 1
                ),
                metadata: Default::default(),
                origin: format!("doc-{i}"),
            })
            .collect()
    };
    let run = |name: &str, shards: &[Option<ingest::Shard>]| {
        let base = RemoteConfig {
            url: format!("file://{}", dir.path().join(name).join("tier").display()),
            ..RemoteConfig::default()
        };
        let e = ingest::Engine::new(corpus(&dir.path().join(name)).with_remote(tier(
            &base,
            "ragkv",
            WriteMode::Through,
        )));
        let mut new = 0;
        for &shard in shards {
            let r = e
                .ingest(
                    &[ingest::Source::Docs(docs())],
                    &ingest::RunOptions {
                        materialize: ingest::Materialize::Eager,
                        prune: true,
                        shard,
                    },
                    &ingest::Counters::default(),
                )
                .unwrap();
            // Each worker takes its own documents and prunes none of the others'.
            assert_eq!(r.docs_new + r.docs_other_shards, 8, "{r:?}");
            assert_eq!(r.docs_deleted, 0);
            if shard.is_some() {
                assert!(r.docs_new > 0 && r.docs_other_shards > 0, "{r:?}");
            }
            new += r.docs_new;
        }
        assert_eq!(new, 8);
        let mut points: Vec<(String, u32, String)> = e
            .corpus()
            .index()
            .points()
            .unwrap()
            .into_iter()
            .map(|(_, p)| (p.doc_id, p.ordinal, p.kv_key))
            .collect();
        points.sort();
        let usage = e.corpus().remote().unwrap().usage().unwrap();
        (points, usage)
    };
    let halves: Vec<Option<ingest::Shard>> = ["0/2", "1/2"]
        .iter()
        .map(|s| Some(s.parse().unwrap()))
        .collect();
    let (sharded, sharded_tier) = run("sharded", &halves);
    let (whole, whole_tier) = run("whole", &[None]);
    assert_eq!(sharded.len(), 8);
    assert_eq!(sharded, whole);
    assert_eq!(sharded_tier, whole_tier);
}
