//! Concurrent writers of one document (ingest, delete, gc's reconciliation, query
//! write-backs): whatever the interleaving, the document ends whole (every point with its KV
//! attached) or gone (no points, no KV), never in between. SmolLM2-135M, MiniLM.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

fn doc(text: &str) -> ingest::Source {
    ingest::Source::Docs(vec![ingest::Doc {
        id: "contested".into(),
        text: text.into(),
        metadata: Default::default(),
        origin: "contested".into(),
    }])
}

fn ingest_eager(engine: &ingest::Engine, text: &str) {
    let r = engine
        .ingest(
            &[doc(text)],
            &ingest::RunOptions {
                materialize: ingest::Materialize::Eager,
                prune: false,
                shard: None,
            },
            &ingest::Counters::default(),
        )
        .unwrap();
    assert!(r.ok(), "{r:?}");
}

#[test]
fn concurrent_ingest_delete_and_gc_of_one_document_leave_it_whole_or_gone() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Arc::new(common::open_engine(
        dir.path(),
        ingest::IngestConfig::default(),
        model::DType::F16,
    ));
    let texts = [
        "The Sellick dam was raised by two metres after the flood of the dry year.",
        "The Sellick dam keeper logs the water level every morning at six.",
    ];
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let e = &engine;
        let stop = &stop;
        s.spawn(move || {
            for i in 0..12 {
                ingest_eager(e, texts[i % 2]);
            }
            stop.store(true, Ordering::SeqCst);
        });
        s.spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                e.delete_document("contested").unwrap();
                std::thread::sleep(std::time::Duration::from_millis(7));
            }
        });
        s.spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                e.gc().unwrap();
            }
        });
    });
    let check = |e: &ingest::Engine| {
        let c = e.check(false).unwrap();
        assert!(c.ok(), "{:?}", c.problems);
        assert_eq!(c.kv_missing, 0, "a point lost its KV: {c:?}");
        c
    };
    let c = check(&engine);
    // Whole or gone, and the next writer finds it consistent either way.
    assert!(c.points == 0 || c.kv_verified == c.points, "{c:?}");
    ingest_eager(&engine, texts[0]);
    let c = check(&engine);
    assert!(c.points > 0 && c.kv_verified == c.points, "{c:?}");
    assert!(engine.delete_document("contested").unwrap());
    let c = check(&engine);
    assert_eq!(c.points, 0);
    assert!(engine
        .corpus()
        .store()
        .documents()
        .unwrap()
        .iter()
        .all(|d| !d.starts_with("contested@")));
}

/// Runs `other` once the ingest of a new version has stored its KV and is about to make it
/// searchable (the commit is held open for 400 ms), then checks the document is whole.
fn during_a_commit(other: impl FnOnce(&ingest::Engine) + Send) {
    let dir = tempfile::tempdir().unwrap();
    let engine = common::open_engine(
        dir.path(),
        ingest::IngestConfig::default(),
        model::DType::F16,
    );
    engine.set_commit_delay_ms(400);
    std::thread::scope(|s| {
        let e = &engine;
        s.spawn(move || ingest_eager(e, "The Sellick dam has three spillways and one gate."));
        let t = std::time::Instant::now();
        while e
            .corpus()
            .store()
            .documents()
            .unwrap()
            .iter()
            .all(|d| !d.starts_with("contested@"))
        {
            assert!(t.elapsed() < std::time::Duration::from_secs(60));
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        other(e);
    });
    let c = engine.check(false).unwrap();
    assert!(c.ok(), "{:?}", c.problems);
    assert_eq!(c.kv_missing, 0, "a point lost its KV: {c:?}");
}

#[test]
fn gc_during_a_commit_does_not_detach_the_version_being_committed() {
    during_a_commit(|e| {
        e.gc().unwrap();
    });
}

#[test]
fn a_delete_during_a_commit_is_ordered_after_it() {
    during_a_commit(|e| {
        assert!(e.delete_document("contested").unwrap());
    });
}
