//! Open, write, drop, reopen: everything committed is still there, byte for byte.

mod common;

use common::*;
use kvstore::{Codec, Error, PutItem, Store};

fn put(store: &Store, ids: std::ops::Range<u64>) {
    let seqs: Vec<(Vec<u32>, Vec<u8>, String)> = ids
        .map(|i| {
            let t = sequence(i);
            let kv = kv_for(&layout(), &t);
            (t, kv, doc_of(i))
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

fn check_all(store: &Store, ids: std::ops::Range<u64>) {
    for i in ids {
        let t = sequence(i);
        assert_eq!(store.probe(NS, &t).unwrap(), t.len(), "probe seq {i}");
        let got = store.get_batch(NS, &t, t.len()).unwrap();
        assert_eq!(got.bytes, kv_for(&layout(), &t), "bytes of seq {i}");
    }
}

#[test]
fn reopen_keeps_everything() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = open(dir.path(), small_options());
        for b in 0..10 {
            put(&store, b * 20..(b + 1) * 20);
        }
        check_all(&store, 0..200);
        assert!(store.stats().segments.len() > 1, "small segments roll");
        // Settling after a bulk load flushes the index; everything still reads back.
        store.settle(std::time::Duration::from_secs(60)).unwrap();
        check_all(&store, 0..200);
    }
    let store = open(dir.path(), small_options());
    check_all(&store, 0..200);
    let report = store.verify().unwrap();
    assert!(report.failures.is_empty(), "{:?}", report.failures);
    assert_eq!(report.entries, store.stats().entries);
}

#[test]
fn prefixes_probe_and_read_back() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), small_options());
    let t: Vec<u32> = (0..100).collect();
    let kv = kv_for(&layout(), &t);
    let r = store
        .put_batch(
            NS,
            layout(),
            &[PutItem {
                tokens: &t,
                kv: &kv,
                doc: None,
            }],
        )
        .unwrap();
    assert_eq!(r.blocks_written, 7); // 6 full blocks of 16 + 4 tokens
                                     // A longer query shares the 6 full blocks; its 7th block differs from the stored tail.
    let mut longer = t.clone();
    longer.extend(100..140);
    assert_eq!(store.probe(NS, &longer).unwrap(), 96);
    let got = store.get_batch(NS, &longer, 96).unwrap();
    assert_eq!(got.bytes, kv_for(&layout(), &t[..96]));
    // Asking for more than is cached is a miss that says how much is there.
    match store.get_batch(NS, &longer, 112) {
        Err(Error::Miss { cached, requested }) => assert_eq!((cached, requested), (96, 112)),
        other => panic!("expected a miss, got {other:?}"),
    }
    assert_eq!(store.probe(NS, &[9, 9, 9]).unwrap(), 0);
    assert_eq!(store.stats().empty_probes, 1);
    // Putting the same sequence again writes nothing.
    let again = store
        .put_batch(
            NS,
            layout(),
            &[PutItem {
                tokens: &t,
                kv: &kv,
                doc: None,
            }],
        )
        .unwrap();
    assert_eq!((again.blocks_written, again.blocks_present), (0, 7));
}

/// Finite f16 KV in `-4..4` (the lossy codecs refuse NaN and infinities, which random bytes
/// hold), spread over several 16-token blocks.
fn finite_kv(layout: &kvstore::KvLayout, tokens: usize) -> Vec<f32> {
    let n = layout.bytes_for(tokens) / 2;
    (0..n)
        .map(|i| ((i as u32).wrapping_mul(2654435761) % 8000) as f32 / 1000.0 - 4.0)
        .collect()
}

#[test]
fn every_codec_round_trips_lossless_ones_exactly() {
    let mut per_token = Vec::new();
    for codec in Codec::ALL {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path(), small_options());
        let ns = kvstore::NamespaceId([codec.id(); 16]);
        store.register_namespace(ns, layout(), codec).unwrap();
        let t = sequence(40);
        let values = finite_kv(&layout(), t.len());
        let kv: Vec<u8> = if codec.is_lossless() {
            kv_for(&layout(), &t)
        } else {
            values
                .iter()
                .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
                .collect()
        };
        store
            .put_batch(
                ns,
                layout(),
                &[PutItem {
                    tokens: &t,
                    kv: &kv,
                    doc: None,
                }],
            )
            .unwrap();
        drop(store);
        let store = open(dir.path(), small_options());
        let got = store.get_batch(ns, &t, t.len()).unwrap();
        // Bytes per token, counted on open from the index.
        let stats = store.namespaces().into_iter().find(|n| n.id == ns).unwrap();
        assert_eq!((stats.codec, stats.tokens), (codec, t.len() as u64));
        per_token.push((codec, stats.bytes_per_token()));
        if codec.is_lossless() {
            assert_eq!(got.bytes, kv, "{codec}");
        } else {
            assert_eq!(got.bytes.len(), kv.len(), "{codec}");
            // Each block's values back in their layer-major place: within a 4-bit step of the
            // 8-wide range (the coarsest codec), element by element.
            for (i, b) in got.bytes.chunks_exact(2).enumerate() {
                let x = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                assert!(
                    (x - values[i]).abs() <= 8.0 / 15.0,
                    "{codec} element {i}: {x} vs {}",
                    values[i]
                );
            }
        }
    }
    let of = |c: Codec| per_token.iter().find(|p| p.0 == c).unwrap().1;
    assert!(
        of(Codec::Q4) < of(Codec::Q8) && of(Codec::Q8) < of(Codec::None),
        "{per_token:?}"
    );
}

#[test]
fn bad_input_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), small_options());
    let t = sequence(1);
    let kv = kv_for(&layout(), &t);
    let err = store
        .put_batch(
            NS,
            layout(),
            &[PutItem {
                tokens: &t,
                kv: &kv[1..],
                doc: None,
            }],
        )
        .unwrap_err();
    assert!(matches!(err, Error::KvSize { .. }), "{err}");
    store
        .put_batch(
            NS,
            layout(),
            &[PutItem {
                tokens: &t,
                kv: &kv,
                doc: None,
            }],
        )
        .unwrap();
    let mut other = layout();
    other.layers = 3;
    let err = store
        .put_batch(
            NS,
            other,
            &[PutItem {
                tokens: &t,
                kv: &kv,
                doc: None,
            }],
        )
        .unwrap_err();
    assert!(matches!(err, Error::LayoutMismatch { .. }), "{err}");
    assert!(store.get_batch(NS, &t, 0).is_err());
    // A second process (here: a second open) is refused with a message naming the holder.
    let err = Store::open(dir.path(), small_options()).unwrap_err();
    assert!(matches!(err, Error::Locked { .. }), "{err}");
    assert!(err.to_string().contains("pid"), "{err}");
}

#[test]
fn documents_share_blocks_and_delete_only_what_no_one_else_uses() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), small_options());
    let shared: Vec<u32> = (0..32).collect();
    let mut a = shared.clone();
    a.extend(1000..1040);
    let mut b = shared.clone();
    b.extend(2000..2040);
    for (t, d) in [(&a, "A"), (&b, "B"), (&a, "C")] {
        put_seq(&store, t, Some(d));
    }
    assert_eq!(store.document_sequences("A").unwrap(), vec![(NS, 72)]);
    assert_eq!(store.documents().unwrap(), vec!["A", "B", "C"]);
    for (t, d) in [(&b, "A@1"), (&b, "A@22"), (&b, "AB@2")] {
        put_seq(&store, t, Some(d));
    }
    assert_eq!(store.documents_with_prefix("A@", 3).unwrap(), vec!["A@1"]);
    assert_eq!(store.documents_with_prefix("A@", 4).unwrap(), vec!["A@22"]);
    assert!(store.documents_with_prefix("B@", 3).unwrap().is_empty());
    for d in ["A@1", "A@22", "AB@2"] {
        store.delete_document(d).unwrap();
    }
    // A and C attach the same sequence: deleting A keeps it.
    let r = store.delete_document("A").unwrap();
    assert_eq!((r.sequences, r.blocks), (1, 0));
    assert_eq!(store.probe(NS, &a).unwrap(), 72);
    // Deleting C drops a's own blocks but keeps the shared prefix B still uses.
    let r = store.delete_document("C").unwrap();
    assert_eq!(r.blocks, 3); // blocks 2, 3 (full) and 4 (8-token tail) of a
    assert_eq!(store.probe(NS, &a).unwrap(), 32);
    assert_eq!(store.probe(NS, &b).unwrap(), 72);
    store.delete_document("B").unwrap();
    assert!(store.documents().unwrap().is_empty());
    assert_eq!(store.probe(NS, &b).unwrap(), 0);
    assert_eq!(store.stats().entries, 0);
    // Deleting an unknown document is a no-op.
    assert_eq!(store.delete_document("nope").unwrap().sequences, 0);
}

#[test]
fn empty_kv_attaches_a_stored_sequence_to_another_document() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), small_options());
    let t = sequence(4);
    put_seq(&store, &t, Some("A"));
    let attach = |tokens: &[u32], doc| {
        store.put_batch(
            NS,
            layout(),
            &[PutItem {
                tokens,
                kv: &[],
                doc: Some(doc),
            }],
        )
    };
    let r = attach(&t, "B").unwrap();
    assert_eq!((r.blocks_written, r.bytes_written), (0, 0));
    assert_eq!(store.documents().unwrap(), vec!["A", "B"]);
    store.delete_document("A").unwrap();
    assert_eq!(store.probe(NS, &t).unwrap(), t.len());
    // A sequence that is not fully stored cannot be attached.
    let mut longer = t.clone();
    longer.extend(9000..9040);
    assert!(attach(&longer, "C").unwrap_err().is_miss());
    assert_eq!(store.documents().unwrap(), vec!["B"]);
    store.delete_document("B").unwrap();
    assert_eq!(store.probe(NS, &t).unwrap(), 0);
}

#[test]
fn explicit_delete_drops_the_suffix_and_everything_extending_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), small_options());
    let t: Vec<u32> = (0..64).collect();
    let mut ext = t.clone();
    ext.extend(500..532);
    for s in [&t, &ext] {
        put_seq(&store, s, None);
    }
    let r = store.delete(NS, &t, 32).unwrap();
    assert_eq!(r.blocks, 4); // blocks 2, 3 of t and blocks 4, 5 of ext
    assert_eq!(store.probe(NS, &t).unwrap(), 32);
    assert_eq!(store.probe(NS, &ext).unwrap(), 32);
    drop(store);
    let store = open(dir.path(), small_options());
    assert_eq!(store.probe(NS, &ext).unwrap(), 32);
    assert_eq!(store.stats().entries, 2);
}

#[test]
fn hot_tier_serves_repeated_reads_with_the_same_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(
        dir.path(),
        kvstore::StoreOptions {
            hot_tier_bytes: 1 << 20,
            ..small_options()
        },
    );
    let t = sequence(11);
    put_seq(&store, &t, Some("d"));
    let kv = kv_for(&layout(), &t);
    let mut buf = Vec::new();
    store.get_batch_into(NS, &t, t.len(), &mut buf).unwrap();
    assert_eq!(buf, kv);
    let disk_reads = store.stats().bytes_read;
    store.get_batch_into(NS, &t, t.len(), &mut buf).unwrap();
    assert_eq!(buf, kv);
    let s = store.stats();
    assert!(s.hot_hits > 0 && s.bytes_read == disk_reads, "{s:?}");
    // Deleting drops the blocks from the hot tier too.
    store.delete_document("d").unwrap();
    assert!(store.get_batch(NS, &t, t.len()).unwrap_err().is_miss());
}

#[test]
fn unknown_segment_files_newer_than_the_index_are_moved_aside_not_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let seg_dir = dir.path().join("segments");
    let ids = |d: &std::path::Path| -> Vec<u64> {
        let mut v: Vec<u64> = std::fs::read_dir(d)
            .unwrap()
            .filter_map(|e| {
                let n = e.unwrap().file_name().into_string().unwrap();
                u64::from_str_radix(n.strip_suffix(".tlog")?, 16).ok()
            })
            .collect();
        v.sort();
        v
    };
    {
        let store = open(dir.path(), small_options());
        for i in 0..3 {
            put_seq(&store, &sequence(i), None);
        }
        store.sync().unwrap();
    }
    let known = ids(&seg_dir);
    let newest = *known.last().unwrap();
    let src = seg_dir.join(format!("{newest:016x}.tlog"));
    // As if restored with an index from before these segments were written.
    let newer = seg_dir.join(format!("{:016x}.tlog", newest + 7));
    std::fs::copy(&src, &newer).unwrap();
    // As if the merger had retired it just before the process ended (an id the index skipped).
    let retired = seg_dir.join(format!("{:016x}.tlog", newest - 1));
    let had_retired_slot = !known.contains(&(newest - 1)) && newest > 0;
    if had_retired_slot {
        std::fs::copy(&src, &retired).unwrap();
    }
    let store = open(dir.path(), small_options());
    assert!(!newer.exists());
    let aside = seg_dir
        .join(kvstore::UNREFERENCED_DIR)
        .join(newer.file_name().unwrap());
    assert!(aside.exists(), "newer segment must be kept aside");
    if had_retired_slot {
        assert!(!retired.exists(), "a retired segment is removed");
    }
    for i in 0..3 {
        assert_eq!(store.probe(NS, &sequence(i)).unwrap(), sequence(i).len());
    }
    // Reopening again leaves the set-aside file alone.
    drop(store);
    drop(open(dir.path(), small_options()));
    assert!(aside.exists());
}
