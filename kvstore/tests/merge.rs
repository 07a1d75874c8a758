//! The merger: readers during a merge never fail or see wrong bytes; delete + merge returns
//! the disk space.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use common::*;
use kvstore::PutItem;

fn fill(store: &kvstore::Store, ids: std::ops::Range<u64>) {
    for chunk in ids.collect::<Vec<_>>().chunks(10) {
        let seqs: Vec<(Vec<u32>, Vec<u8>, String)> = chunk
            .iter()
            .map(|i| {
                let t = sequence(*i);
                (t.clone(), kv_for(&layout(), &t), doc_of(*i))
            })
            .collect();
        let items: Vec<PutItem<'_>> = seqs
            .iter()
            .map(|(t, kv, d)| PutItem {
                tokens: t,
                kv,
                doc: Some(d),
            })
            .collect();
        store.put_batch(NS, layout(), &items).unwrap();
    }
}

/// Direct-I/O batches (aligned, zero-padded) and page-cache ones share segments: the merger
/// walks across the padding, and every record survives merges, a reopen and later appends.
#[test]
fn merge_walks_direct_and_buffered_batches() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), small_options());
    let small = |i: u64| {
        let mut t = sequence(i);
        t.truncate(40); // 5 KiB of KV: below the direct threshold
        t
    };
    for k in 0..20u64 {
        fill(&store, k * 20..k * 20 + 10);
        for i in k * 20 + 10..k * 20 + 20 {
            put_seq(&store, &small(i), Some(&doc_of(i)));
        }
    }
    let s = store.stats();
    assert!(
        s.bytes_written_direct > 0 && s.bytes_written_direct < s.bytes_written,
        "both kinds of write: {s:?}"
    );
    let tokens = |i: u64| if i % 20 < 10 { sequence(i) } else { small(i) };
    for d in 0..100u64 {
        if d % 2 == 1 {
            store.delete_document(&format!("doc-{d}")).unwrap();
        }
    }
    let report = store.compact_all().unwrap();
    assert!(report.segments_removed > 0, "{report:?}");
    assert_eq!(
        store.stats().dead_bytes,
        0,
        "every segment was walked to its end"
    );
    drop(store);
    let store = open(dir.path(), small_options());
    fill(&store, 400..420);
    for i in (0..400u64).filter(|i| (i / 4) % 2 == 0).chain(400..420) {
        let t = if i < 400 { tokens(i) } else { sequence(i) };
        assert_eq!(
            store.get_batch(NS, &t, t.len()).unwrap().bytes,
            kv_for(&layout(), &t),
            "sequence {i}"
        );
    }
    assert!(store.verify().unwrap().failures.is_empty());
}

#[test]
fn delete_and_merge_return_disk_space() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), small_options());
    fill(&store, 0..400);
    let seg_dir = dir.path().join("segments");
    let before = dir_bytes(&seg_dir);
    let files_before = std::fs::read_dir(&seg_dir).unwrap().count();
    // Delete three quarters of the documents.
    for d in 0..100u64 {
        if d % 4 != 0 {
            store.delete_document(&format!("doc-{d}")).unwrap();
        }
    }
    let stats = store.stats();
    assert!(stats.dead_bytes > stats.live_bytes, "{stats:?}");
    let report = store.compact_all().unwrap();
    assert!(report.segments_removed > 0, "{report:?}");
    let after = dir_bytes(&seg_dir);
    let files_after = std::fs::read_dir(&seg_dir).unwrap().count();
    eprintln!("segments: {before} B in {files_before} files -> {after} B in {files_after} files; {report:?}");
    assert!(
        after * 2 < before,
        "space must come back: {before} -> {after}"
    );
    assert_eq!(store.stats().dead_bytes, 0);
    // What is left is intact, also after reopening.
    drop(store);
    let store = open(dir.path(), small_options());
    for i in 0..400u64 {
        let t = sequence(i);
        let still = (i / 4) % 4 == 0;
        if still {
            assert_eq!(
                store.get_batch(NS, &t, t.len()).unwrap().bytes,
                kv_for(&layout(), &t)
            );
        }
    }
    assert!(store.verify().unwrap().failures.is_empty());
}

#[test]
fn readers_during_merges_never_fail_or_see_wrong_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(open(dir.path(), small_options()));
    fill(&store, 0..300);
    let stop = Arc::new(AtomicBool::new(false));
    let reads = Arc::new(AtomicU64::new(0));
    // Documents 0..75 exist; readers read documents whose index is even, never deleted.
    let readers: Vec<_> = (0..3)
        .map(|r| {
            let (store, stop, reads) = (store.clone(), stop.clone(), reads.clone());
            std::thread::spawn(move || {
                let mut i = r as u64;
                while !stop.load(Ordering::Relaxed) {
                    let id = (i * 7) % 300;
                    i += 1;
                    if (id / 4) % 2 == 1 {
                        continue;
                    }
                    let t = sequence(id);
                    let got = store
                        .get_batch(NS, &t, t.len())
                        .unwrap_or_else(|e| panic!("read of seq {id} failed during merge: {e}"));
                    assert_eq!(got.bytes, kv_for(&layout(), &t), "seq {id}");
                    reads.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    // Meanwhile: delete the odd documents, write new ones, and merge, repeatedly.
    let mut removed = 0;
    for round in 0..6u64 {
        for d in (0..75u64).filter(|d| d % 2 == 1 && d % 6 == round) {
            store.delete_document(&format!("doc-{d}")).unwrap();
        }
        fill(&store, 1000 + round * 40..1000 + (round + 1) * 40);
        removed += store.compact_all().unwrap().segments_removed;
    }
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        r.join().unwrap();
    }
    let n = reads.load(Ordering::Relaxed);
    eprintln!("{n} verified reads while {removed} segments were merged away");
    assert!(
        removed > 0 && n > 100,
        "the test must overlap reads and merges ({n}, {removed})"
    );
}
