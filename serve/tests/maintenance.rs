//! Re-materialization and GC over real models: after a model fingerprint change, after segment
//! files are deleted, after records are corrupted. Each ends with every live chunk verified,
//! and a second run that finds nothing to do. A run stopped midway (the server's shutdown)
//! keeps what it redid, and the next run does the rest.

mod common;

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ingest::{Counters, IngestConfig, RematOptions, Scope};

/// Twelve short documents of two or three 48-token chunks each.
fn docs() -> ingest::Source {
    let docs = (0..12)
        .map(|i| ingest::Doc {
            id: format!("doc-{i}"),
            text: format!(
                "Station {i} of the Harwick survey lies {} kilometres north of the river. \
                 Its keeper in the year {} was a surveyor named Odile Marchetti-{i}, who \
                 recorded rainfall, wind and the arrival of migrating geese each morning. \
                 The station house has {} rooms, a brass barometer and a small library of \
                 maps. Visitors reach it by a gravel road that floods every spring, and \
                 the keeper's log of {} winters is kept in the regional archive.",
                3 * i + 2,
                1900 + 7 * i,
                i % 5 + 2,
                i + 10
            ),
            metadata: Default::default(),
            origin: format!("doc-{i}"),
        })
        .collect();
    ingest::Source::Docs(docs)
}

fn config() -> IngestConfig {
    IngestConfig {
        chunk_tokens: 48,
        ..IngestConfig::default()
    }
}

/// Asserts the index and store agree and every point's KV reads back verified.
fn all_verified(engine: &ingest::Engine) -> usize {
    let c = engine.check(false).unwrap();
    assert!(c.ok(), "{:?}", c.problems);
    assert_eq!(c.kv_missing, 0, "{c:?}");
    assert_eq!(c.kv_verified, c.points, "{c:?}");
    assert!(engine
        .corpus()
        .store()
        .verify()
        .unwrap()
        .failures
        .is_empty());
    c.points
}

fn remat(engine: &ingest::Engine, scope: Scope, dry_run: bool) -> ingest::RematReport {
    let opts = RematOptions {
        scope,
        limit: None,
        dry_run,
    };
    engine.rematerialize(&opts, &Counters::default()).unwrap()
}

/// Distinct chunk texts (the same sentence in two documents is one stored chunk).
fn unique(engine: &ingest::Engine) -> usize {
    let texts: std::collections::HashSet<String> = engine
        .corpus()
        .index()
        .points()
        .unwrap()
        .into_iter()
        .map(|(_, p)| p.text)
        .collect();
    texts.len()
}

fn ingest_all(dir: &Path) -> usize {
    let engine = common::engine(dir, config(), docs(), 12);
    all_verified(&engine)
}

#[test]
fn a_model_change_is_migrated_by_rematerialize_and_the_old_namespace_collected() {
    let dir = tempfile::tempdir().unwrap();
    let points = ingest_all(dir.path());
    assert!(points >= 24, "{points}");

    // A new fingerprint (KV kept as bf16 now): a new namespace, nothing stored under it.
    let grace = IngestConfig {
        namespace_grace_hours: 0.0,
        ..config()
    };
    let engine = common::open_engine(dir.path(), grace, model::DType::BF16);
    let c = engine.check(false).unwrap();
    assert!(c.ok(), "{:?}", c.problems);
    assert_eq!((c.kv_missing, c.kv_verified), (points, 0));
    assert_eq!(engine.corpus().store().namespaces().len(), 2);

    let dry = remat(&engine, Scope::All, true);
    assert_eq!(
        (dry.stale, dry.planned, dry.plan.len()),
        (points, points, points)
    );
    assert_eq!(dry.prefilled, 0);
    assert_eq!(
        engine.check(false).unwrap().kv_missing,
        points,
        "dry run changed nothing"
    );
    // A limit takes the hottest first; all are cold here, so any two.
    let distinct = unique(&engine);
    let two = engine
        .rematerialize(
            &RematOptions {
                scope: Scope::Stale,
                limit: Some(2),
                dry_run: false,
            },
            &Counters::default(),
        )
        .unwrap();
    assert_eq!((two.planned, two.prefilled + two.attached), (2, 2));

    let r = remat(&engine, Scope::Stale, false);
    assert_eq!((r.stale, r.planned), (points - 2, points - 2));
    assert_eq!(r.prefilled + two.prefilled, distinct, "{r:?}");
    assert_eq!(r.prefilled + r.attached, points - 2, "{r:?}");
    assert!(r.failures.is_empty(), "{:?}", r.failures);
    assert_eq!(all_verified(&engine), points);
    let again = remat(&engine, Scope::All, false);
    assert_eq!((again.planned, again.present), (0, points), "idempotent");

    // GC: the old namespace is past its (zero) grace; the current one stays.
    let gc = engine.gc().unwrap();
    assert_eq!(gc.namespaces_dropped.len(), 1, "{gc:?}");
    assert!(gc.blocks_dropped > 0 && gc.bytes_reclaimed > 0, "{gc:?}");
    let nss = engine.corpus().store().namespaces();
    assert_eq!(nss.len(), 1);
    assert_eq!(nss[0].id, engine.corpus().namespace());
    assert_eq!(all_verified(&engine), points);
}

/// `kvstore.codec` changed to a lossy codec: a namespace of its own, served from the lossless
/// copy until rematerialize fills it from that copy (re-encoded, nothing prefilled), smaller
/// per token, and served from it.
#[test]
fn a_lossy_codec_change_is_re_encoded_from_the_lossless_copy_without_prefill() {
    let dir = tempfile::tempdir().unwrap();
    let points = ingest_all(dir.path());
    let distinct = {
        let engine = common::open_engine(dir.path(), config(), model::DType::F16);
        unique(&engine)
    };
    let q4 = kvstore::StoreOptions {
        default_codec: kvstore::Codec::Q4,
        ..kvstore::StoreOptions::default()
    };
    let engine = std::sync::Arc::new(common::open_engine_opts(
        dir.path(),
        config(),
        model::DType::F16,
        common::model(),
        q4,
    ));
    assert_eq!(engine.check(false).unwrap().kv_missing, points);
    let query = serve::Query {
        question: "Who kept station 3 of the Harwick survey?".into(),
        top_k: 3,
        filter: Default::default(),
        params: model::GenerateParams {
            max_tokens: 8,
            ..Default::default()
        },
        kv: serve::KvMode::On,
        assembly: serve::Assembly::default(),
    };
    let served = |what: &str| {
        let rag = serve::Rag::start(engine.clone(), serve::ServeConfig::default()).unwrap();
        let hits = rag.retrieve(&query).unwrap();
        let f = common::answer(&rag, query.clone(), hits.clone());
        assert_eq!(f.kv_hits, hits.len(), "{what}: {:?}", f.citations);
        assert!(!f.answer.is_empty());
    };
    served("from the lossless copy");
    let r = remat(&engine, Scope::Stale, false);
    assert_eq!((r.stale, r.prefilled), (points, 0), "{r:?}");
    assert_eq!(r.reencoded, distinct, "{r:?}");
    assert_eq!(r.reencoded + r.attached, points, "{r:?}");
    assert_eq!(all_verified(&engine), points);
    let nss = engine.corpus().store().namespaces();
    let of = |c: kvstore::Codec| nss.iter().find(|n| n.codec == c).unwrap();
    let (none, q4) = (of(kvstore::Codec::None), of(kvstore::Codec::Q4));
    assert_eq!(q4.id, engine.corpus().namespace());
    assert_eq!(q4.tokens, none.tokens);
    let ratio = none.bytes_per_token() / q4.bytes_per_token();
    assert!(ratio > 3.0, "q4 stores {ratio:.2}x fewer bytes per token");
    // The lossless copy goes; the q4 one serves.
    engine.corpus().store().drop_namespace(none.id).unwrap();
    served("from q4");
}

#[test]
fn deleted_segment_files_are_rematerialized() {
    let dir = tempfile::tempdir().unwrap();
    let points = ingest_all(dir.path());
    for seg in std::fs::read_dir(dir.path().join("kv/segments")).unwrap() {
        std::fs::remove_file(seg.unwrap().path()).unwrap();
    }
    let engine = common::open_engine(dir.path(), config(), model::DType::F16);
    let c = engine.check(false).unwrap();
    assert_eq!(c.kv_missing, points, "{c:?}");
    let r = remat(&engine, Scope::All, false);
    assert_eq!((r.missing, r.planned), (points, points), "{r:?}");
    assert_eq!(
        (r.prefilled, r.attached),
        (unique(&engine), points - unique(&engine))
    );
    assert_eq!(all_verified(&engine), points);
    assert_eq!(remat(&engine, Scope::All, false).planned, 0);
}

#[test]
fn corrupt_records_are_found_deleted_and_rematerialized() {
    let dir = tempfile::tempdir().unwrap();
    let points = ingest_all(dir.path());
    // Flip bytes in the middle of every segment file (payload bytes of some record).
    let mut flipped = 0;
    for seg in std::fs::read_dir(dir.path().join("kv/segments")).unwrap() {
        let path = seg.unwrap().path();
        let mut bytes = std::fs::read(&path).unwrap();
        for at in [bytes.len() / 3, bytes.len() / 2, 2 * bytes.len() / 3] {
            bytes[at] ^= 0x5a;
            flipped += 1;
        }
        std::fs::write(&path, bytes).unwrap();
    }
    assert!(flipped >= 3);
    let engine = common::open_engine(dir.path(), config(), model::DType::F16);
    let c = engine.check(false).unwrap();
    assert!(!c.ok(), "corruption must be reported");
    let r = remat(&engine, Scope::All, false);
    assert!(r.corrupt >= 1, "{r:?}");
    assert_eq!(r.prefilled + r.attached, r.corrupt + r.missing, "{r:?}");
    assert_eq!(all_verified(&engine), points);
    assert_eq!(remat(&engine, Scope::All, false).planned, 0);
}

#[test]
fn hot_scope_redoes_only_chunks_that_were_read() {
    let dir = tempfile::tempdir().unwrap();
    let points = ingest_all(dir.path());
    let engine = common::open_engine(dir.path(), config(), model::DType::F16);
    // Read three chunks twice, then evict everything.
    let mut count: std::collections::BTreeMap<String, usize> = Default::default();
    for (_, p) in engine.corpus().index().points().unwrap() {
        *count.entry(p.text).or_default() += 1;
    }
    let texts: Vec<String> = count
        .into_iter()
        .filter(|(_, n)| *n == 1)
        .map(|(t, _)| t)
        .take(3)
        .collect();
    assert_eq!(texts.len(), 3);
    let mut buf = Vec::new();
    for t in texts.iter().chain(&texts) {
        let tokens = engine.corpus().chunk_tokens(t).unwrap();
        engine
            .corpus()
            .store()
            .get_batch_into(engine.corpus().namespace(), &tokens, tokens.len(), &mut buf)
            .unwrap();
    }
    let r = engine
        .corpus()
        .store()
        .evict(kvstore::DEFAULT_GROUP, 0)
        .unwrap();
    assert_eq!(r.sequences, unique(&engine));
    let c = engine.check(false).unwrap();
    assert!(c.ok(), "evicted chunks are not problems: {:?}", c.problems);
    assert_eq!(c.kv_missing, points);
    let r = remat(&engine, Scope::Hot { min_reads: 2 }, false);
    assert_eq!((r.missing, r.planned, r.prefilled), (points, 3, 3), "{r:?}");
    assert!(engine.check(false).unwrap().kv_verified >= 3);
    remat(&engine, Scope::All, false);
    assert_eq!(all_verified(&engine), points);
}

/// A change of tokenization (here the chunk preamble; a new tokenizer behaves the same): the
/// points keep their old token counts, `check` counts them as re-tokenized, not as problems,
/// and rematerialize stores their KV under the new tokens.
#[test]
fn a_tokenization_change_is_migrated_and_checked_by_the_current_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let points = ingest_all(dir.path());
    let engine = common::open_engine(
        dir.path(),
        IngestConfig {
            chunk_preamble: "Passage:\n".into(),
            ..config()
        },
        model::DType::F16,
    );
    let c = engine.check(false).unwrap();
    assert!(c.ok(), "{:?}", c.problems);
    assert_eq!((c.retokenized, c.kv_missing), (points, points), "{c:?}");
    let r = remat(&engine, Scope::Stale, false);
    assert_eq!(r.planned, points, "{r:?}");
    let c = engine.check(false).unwrap();
    assert!(c.ok(), "{:?}", c.problems);
    assert_eq!((c.retokenized, c.kv_verified), (points, points), "{c:?}");
}

/// Ingests the twelve documents, deletes every segment file, and reopens: every chunk to redo.
fn all_missing(dir: &Path) -> (usize, ingest::Engine) {
    let points = ingest_all(dir);
    for seg in std::fs::read_dir(dir.join("kv/segments")).unwrap() {
        std::fs::remove_file(seg.unwrap().path()).unwrap();
    }
    let engine = common::open_engine(dir, config(), model::DType::F16);
    (points, engine)
}

#[test]
fn a_stopped_run_keeps_what_it_redid_and_the_next_run_does_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let (points, engine) = all_missing(dir.path());
    let all = RematOptions {
        scope: Scope::All,
        limit: None,
        dry_run: false,
    };
    // Stopped before the first chunk: nothing planned, nothing changed.
    let r = engine
        .rematerialize_until(&all, &Counters::default(), || true)
        .unwrap();
    assert!(r.interrupted, "{r:?}");
    assert_eq!((r.planned, r.prefilled, r.attached), (0, 0, 0), "{r:?}");
    assert_eq!(engine.check(false).unwrap().kv_missing, points);
    // Stopped once the first chunk is stored.
    let counters = Counters::default();
    let r = engine
        .rematerialize_until(&all, &counters, || {
            counters.tokens_done.load(Ordering::Relaxed) > 0
        })
        .unwrap();
    assert!(r.interrupted, "{r:?}");
    assert_eq!(
        (r.planned, r.prefilled, r.attached),
        (points, 1, 0),
        "{r:?}"
    );
    let c = engine.check(false).unwrap();
    assert!(c.ok(), "{:?}", c.problems);
    assert!(c.kv_missing < points && c.kv_verified > 0, "{c:?}");
    let r = remat(&engine, Scope::All, false);
    assert!(!r.interrupted, "{r:?}");
    assert_eq!(r.planned, c.kv_missing, "{r:?}");
    assert_eq!(all_verified(&engine), points);
}

#[test]
fn shutdown_stops_a_scheduled_run_and_refuses_later_jobs() {
    let dir = tempfile::tempdir().unwrap();
    let (points, engine) = all_missing(dir.path());
    let to_redo = unique(&engine) as u64;
    let engine = Arc::new(engine);
    let rag = serve::Rag::start(
        engine.clone(),
        serve::ServeConfig {
            rematerialize_cron: "* * * * * *".into(),
            ..serve::ServeConfig::default()
        },
    )
    .unwrap();
    // The scheduled run holds the maintenance lock while it works.
    let t = Instant::now();
    while rag.maintenance.try_exclusive().is_some() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the scheduled run never started"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let t = Instant::now();
    rag.shutdown();
    let took = t.elapsed();
    let runs = rag.metrics.maintenance_runs.load(Ordering::SeqCst);
    let redone = rag.metrics.maintenance_chunks.load(Ordering::SeqCst);
    assert!(
        redone < to_redo,
        "the run went on to its end ({redone} of {to_redo} chunks) after shutdown ({took:?})"
    );
    assert_eq!(runs, 1);
    let all = RematOptions {
        scope: Scope::All,
        limit: None,
        dry_run: false,
    };
    for wait in [false, true] {
        let e = rag.maintenance.rematerialize(&all, wait).unwrap_err();
        assert!(matches!(e, serve::JobError::Closing), "{e}");
    }
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        rag.metrics.maintenance_runs.load(Ordering::SeqCst),
        runs,
        "the schedule ran after shutdown"
    );
    drop(rag);
    assert_eq!(
        Arc::strong_count(&engine),
        1,
        "a maintenance or pipeline thread still holds the engine"
    );
    // What the run stored is kept; the next run does the rest.
    let r = remat(&engine, Scope::All, false);
    assert_eq!(r.prefilled as u64, to_redo - redone, "{r:?}");
    assert_eq!(all_verified(&engine), points);
}
