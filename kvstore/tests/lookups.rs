//! The in-memory lookup tiers in front of the index (presence filter, location cache) and the
//! read paths (small runs through a buffer, large runs read into place, large runs of encoded
//! records decoded piece by piece as a read-ahead thread fetches them) and the announce ahead
//! of a read (`prefetch`): every answer must be the index's, through puts, deletes, merges,
//! namespace drops, filter rebuilds, reopens and concurrent writers.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use kvstore::{Codec, DType, KvLayout, NamespaceId, PutItem, Store};

fn put(store: &Store, ns: NamespaceId, layout: KvLayout, tokens: &[u32], doc: Option<&str>) {
    let kv = kv_for(&layout, tokens);
    store
        .put_batch(
            ns,
            layout,
            &[PutItem {
                tokens,
                kv: &kv,
                doc,
            }],
        )
        .unwrap();
}

fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (seed.wrapping_mul(2_654_435_761) ^ i.wrapping_mul(40_503)) % 50_000)
        .collect()
}

/// 4 KiB of f16 KV per token.
fn wide() -> KvLayout {
    KvLayout {
        layers: 4,
        kv_heads: 4,
        head_dim: 64,
        dtype: DType::F16,
    }
}

/// [`small_options`] with segments large enough that a test's sequences share one.
fn one_segment() -> kvstore::StoreOptions {
    kvstore::StoreOptions {
        segment_bytes: 64 << 20,
        ..small_options()
    }
}

#[test]
fn small_and_large_runs_read_back_exactly_with_every_lossless_codec() {
    // 4 KiB of KV per token: a 128-token sequence is one 512 KiB run (read into place), a
    // 16-token prefix is a 64 KiB run (read through a buffer).
    let big = wide();
    for (k, codec) in [
        Codec::None,
        Codec::Lz4,
        Codec::Zstd,
        Codec::Lz4Planes,
        Codec::ZstdPlanes,
    ]
    .into_iter()
    .enumerate()
    {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path(), small_options());
        let ns = NamespaceId([k as u8 + 10; 16]);
        store.register_namespace(ns, big, codec).unwrap();
        let t = tokens(k as u32, 128);
        put(&store, ns, big, &t, None);
        let kv = kv_for(&big, &t);
        for up_to in [128, 96, 16] {
            let got = store.get_batch(ns, &t, up_to).unwrap();
            assert_eq!(
                got.bytes,
                kv_for(&big, &t[..up_to]),
                "{codec} up to {up_to}"
            );
        }
        assert_eq!(store.get_batch(ns, &t, 128).unwrap().bytes, kv);
        assert_eq!(store.probe(ns, &t).unwrap(), 128);
    }
}

#[test]
fn large_runs_of_quantized_records_read_back_as_their_blocks_decode() {
    // 4 KiB of f16 KV per token: 512 tokens are ~600 KiB of `q4` records in one segment, a
    // large run read record by record (each decoded as it arrives); the expected bytes are
    // each block's own encode + decode, placed layer-major.
    let big = wide();
    let opts = one_segment();
    let (n, block) = (512, opts.block_tokens);
    let tb = big.plane_token_bytes();
    let t = tokens(11, n);
    // Finite values with a per-channel offset and scale (the codecs refuse NaN).
    let kv: Vec<u8> = (0..big.bytes_for(n) / 2)
        .flat_map(|i| {
            let (ch, row) = (i % 256, i / 256);
            let x = (ch as f32 * 0.37).sin() * 4.0 + ((row * 31 + ch) as f32 * 0.11).cos();
            half::f16::from_f32(x).to_le_bytes()
        })
        .collect();
    for (k, codec) in [Codec::Q8, Codec::Q4].into_iter().enumerate() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path(), opts.clone());
        let ns = NamespaceId([k as u8 + 40; 16]);
        store.register_namespace(ns, big, codec).unwrap();
        store
            .put_batch(
                ns,
                big,
                &[PutItem {
                    tokens: &t,
                    kv: &kv,
                    doc: None,
                }],
            )
            .unwrap();
        let mut want = vec![0u8; kv.len()];
        for start in (0..n).step_by(block) {
            let mut raw = Vec::new();
            for p in 0..big.planes() {
                raw.extend_from_slice(&kv[(p * n + start) * tb..(p * n + start + block) * tb]);
            }
            let enc = kvstore::encode_block(codec, &big, block, &raw, start).unwrap();
            let mut back = vec![0u8; raw.len()];
            kvstore::decode_block(codec, &big, block, &enc, &mut back).unwrap();
            for p in 0..big.planes() {
                want[(p * n + start) * tb..(p * n + start + block) * tb]
                    .copy_from_slice(&back[p * block * tb..(p + 1) * block * tb]);
            }
        }
        let stored = store.stats().live_bytes as usize;
        assert!(
            stored > 256 << 10,
            "{codec}: {stored} bytes is no large run"
        );
        // Warm (the page cache holds the run: read here), then cold (read by the read-ahead
        // thread while this one decodes).
        let mut buf = Vec::new();
        store.get_batch_into(ns, &t, n, &mut buf).unwrap();
        assert!(
            buf == want,
            "{codec}: the large run differs from its blocks' decoding"
        );
        if drop_cached_pages(dir.path()) {
            let before = store.stats().bytes_read_ahead;
            buf.fill(0);
            store.get_batch_into(ns, &t, n, &mut buf).unwrap();
            assert!(buf == want, "{codec}: the cold large run differs");
            let ahead = store.stats().bytes_read_ahead - before;
            assert!(ahead > 0, "{codec}: the cold run was not read ahead");
        }
        assert_eq!(store.stats().corrupt, 0);
    }
}

#[test]
fn prefetch_announces_what_the_read_then_reads_and_nothing_it_would_not() {
    // 4 KiB of KV per token: 200 tokens are an 800 KiB run (announced); 16 tokens a 64 KiB
    // one, left to the kernel's readahead.
    let l = wide();
    let opts = one_segment();
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), opts.clone());
    store.register_namespace(NS, l, Codec::None).unwrap();
    // Three sequences, each its own run of records.
    let (a, b, c) = (tokens(1, 200), tokens(2, 90), tokens(3, 300));
    let small = tokens(6, 16);
    for (t, doc) in [(&a, "a"), (&b, "b"), (&c, "c"), (&small, "small")] {
        put(&store, NS, l, t, Some(doc));
    }
    let cold = drop_cached_pages(dir.path());
    for t in [&a, &b, &c] {
        let s0 = store.stats();
        let announced = store.prefetch(NS, t).unwrap();
        assert!(announced as usize > l.bytes_for(t.len()), "{announced}");
        let s1 = store.stats();
        assert_eq!(s1.bytes_prefetched - s0.bytes_prefetched, announced);
        // The read that follows fetches exactly the announced records, and reads them right.
        let mut buf = Vec::new();
        store.get_batch_into(NS, t, t.len(), &mut buf).unwrap();
        assert_eq!(store.stats().bytes_read - s1.bytes_read, announced);
        assert!(buf == kv_for(&l, t), "cold={cold}");
    }
    // Nothing to announce: a small run, a sequence not stored whole, an unknown namespace, a
    // deleted one.
    assert_eq!(store.prefetch(NS, &small).unwrap(), 0);
    assert!(store.get_batch(NS, &small, small.len()).unwrap().bytes == kv_for(&l, &small));
    let mut longer = a.clone();
    longer.extend(tokens(4, 40));
    assert_eq!(store.prefetch(NS, &longer).unwrap(), 0);
    assert_eq!(store.prefetch(NS, &tokens(5, 64)).unwrap(), 0);
    assert_eq!(store.prefetch(NamespaceId([99; 16]), &a).unwrap(), 0);
    store.delete_document("b").unwrap();
    assert_eq!(store.prefetch(NS, &b).unwrap(), 0);
    assert_eq!(store.prefetch(NS, &[]).unwrap(), 0);

    // Blocks the hot tier serves are not announced: they are not read from disk.
    let dir = tempfile::tempdir().unwrap();
    let hot = kvstore::StoreOptions {
        hot_tier_bytes: 64 << 20,
        ..opts
    };
    let store = open(dir.path(), hot);
    store.register_namespace(NS, l, Codec::None).unwrap();
    put(&store, NS, l, &a, None);
    assert!(store.prefetch(NS, &a).unwrap() > 0);
    store.get_batch(NS, &a, a.len()).unwrap();
    assert_eq!(store.prefetch(NS, &a).unwrap(), 0);
}

/// Writes back and drops from the page cache every file under `dir`; false where the file
/// system keeps its files in memory (tmpfs), so that nothing can be dropped.
fn drop_cached_pages(dir: &std::path::Path) -> bool {
    use std::os::unix::io::AsRawFd;
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: `statfs` is plain data, for which all zeros is a valid value.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid C path and a writable `statfs`.
    let rc = unsafe { libc::statfs(c.as_ptr(), &mut fs) };
    if rc != 0 || fs.f_type as i64 == TMPFS_MAGIC {
        return false;
    }
    for entry in walk(dir) {
        let f = std::fs::File::open(&entry).unwrap();
        f.sync_all().unwrap();
        // SAFETY: fadvise on a descriptor open for the call.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
    true
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let path = e.unwrap().path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else {
            files.push(path);
        }
    }
    files
}

#[test]
fn a_flipped_byte_in_a_large_run_is_a_miss_never_data() {
    let big = wide();
    let dir = tempfile::tempdir().unwrap();
    let t = tokens(7, 128);
    {
        let store = open(dir.path(), small_options());
        put(&store, NS, big, &t, None);
    }
    // Flip one byte in the middle of the segment holding the run.
    let seg = std::fs::read_dir(dir.path().join("segments"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .max_by_key(|p| std::fs::metadata(p).unwrap().len())
        .unwrap();
    let mut bytes = std::fs::read(&seg).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&seg, &bytes).unwrap();
    let store = open(dir.path(), small_options());
    let e = store.get_batch(NS, &t, 128).unwrap_err();
    assert!(e.is_miss(), "{e}");
    assert_eq!(store.stats().corrupt, 1);
}

#[test]
fn the_location_cache_follows_deletes_merges_and_namespace_drops() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), small_options());
    let seqs: Vec<Vec<u32>> = (0..60).map(|i| tokens(i, 40 + i as usize)).collect();
    for (i, t) in seqs.iter().enumerate() {
        put(&store, NS, layout(), t, Some(&format!("doc-{}", i % 6)));
    }
    // The first read of each fills the cache, the second is served from it.
    for _ in 0..2 {
        for t in &seqs {
            assert_eq!(
                store.get_batch(NS, t, t.len()).unwrap().bytes,
                kv_for(&layout(), t)
            );
        }
    }
    let s = store.stats().location_cache;
    assert!(s.hits > 0 && s.entries > 0, "{s:?}");
    // Puts and reads remove nothing; each delete that removes blocks counts once.
    assert_eq!(store.removals(), 0);

    // Deleted documents are gone for probes and gets at once.
    for d in 0..3 {
        store.delete_document(&format!("doc-{d}")).unwrap();
    }
    assert_eq!(store.removals(), 3);
    for (i, t) in seqs.iter().enumerate() {
        if i % 6 < 3 {
            assert_eq!(store.probe(NS, t).unwrap(), 0, "deleted sequence {i}");
            assert!(store.get_batch(NS, t, t.len()).unwrap_err().is_miss());
        }
    }
    // The merger moves the survivors; reads follow them to their new segment.
    let r = store.compact_all().unwrap();
    assert!(r.segments_removed > 0, "{r:?}");
    assert_eq!(
        store.removals(),
        3,
        "moving blocks changes none of their bytes"
    );
    for (i, t) in seqs.iter().enumerate() {
        if i % 6 >= 3 {
            assert_eq!(
                store.get_batch(NS, t, t.len()).unwrap().bytes,
                kv_for(&layout(), t)
            );
        }
    }
    // A dropped namespace leaves nothing behind; storing again works.
    store.drop_namespace(NS).unwrap();
    assert_eq!(store.removals(), 4);
    for t in &seqs {
        assert_eq!(store.probe(NS, t).unwrap(), 0);
    }
    put(&store, NS, layout(), &seqs[5], None);
    assert_eq!(store.probe(NS, &seqs[5]).unwrap(), seqs[5].len());
    drop(store);

    // After a reopen both tiers start from the index.
    let store = open(dir.path(), small_options());
    assert_eq!(store.stats().location_cache.entries, 0);
    assert_eq!(store.probe(NS, &seqs[5]).unwrap(), seqs[5].len());
    assert_eq!(store.probe(NS, &seqs[4]).unwrap(), 0);
    assert_eq!(
        store.get_batch(NS, &seqs[5], seqs[5].len()).unwrap().bytes,
        kv_for(&layout(), &seqs[5])
    );
}

#[test]
fn the_presence_filter_grows_and_forgets_deleted_blocks_by_rebuilding() {
    let tiny = KvLayout {
        layers: 1,
        kv_heads: 1,
        head_dim: 1,
        dtype: DType::F16,
    };
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), small_options());
    let first = store.stats().presence;
    // More blocks than the first filter was sized for (sequences of 32 blocks).
    let n = (first.capacity / 32 + 1024) as u32;
    let seq = |i: u32| tokens(i + 1_000, 512);
    for chunk in (0..n).collect::<Vec<_>>().chunks(64) {
        let ts: Vec<Vec<u32>> = chunk.iter().map(|&i| seq(i)).collect();
        let kvs: Vec<Vec<u8>> = ts.iter().map(|t| kv_for(&tiny, t)).collect();
        let docs: Vec<String> = chunk.iter().map(|i| format!("d{}", i % 4)).collect();
        let items: Vec<PutItem<'_>> = (0..ts.len())
            .map(|k| PutItem {
                tokens: &ts[k],
                kv: &kvs[k],
                doc: Some(&docs[k]),
            })
            .collect();
        store.put_batch(NS, tiny, &items).unwrap();
    }
    let wait_for = |what: &str, f: &dyn Fn(&kvstore::PresenceStats) -> bool| {
        let t = Instant::now();
        loop {
            let p = store.stats().presence;
            if f(&p) {
                return p;
            }
            assert!(t.elapsed() < Duration::from_secs(60), "{what}: {p:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let grown = wait_for("growth rebuild", &|p| {
        p.capacity > first.capacity && p.keys <= p.capacity
    });
    assert!(grown.rebuilds > first.rebuilds, "{grown:?}");
    for i in (0..n).step_by(97) {
        assert_eq!(store.probe(NS, &seq(i)).unwrap(), 512, "sequence {i}");
    }
    // Three quarters deleted: the stale bits trigger a rebuild that leaves them out.
    for d in ["d0", "d1", "d2"] {
        store.delete_document(d).unwrap();
    }
    let after = wait_for("stale rebuild", &|p| {
        p.rebuilds > grown.rebuilds && p.stale == 0
    });
    assert!(after.keys < grown.keys, "{grown:?} -> {after:?}");
    for i in (0..n).step_by(97) {
        let want = if i % 4 < 3 { 0 } else { 512 };
        assert_eq!(store.probe(NS, &seq(i)).unwrap(), want, "sequence {i}");
    }
}

#[test]
fn readers_racing_deletes_and_reputs_see_exact_bytes_or_misses() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(open(dir.path(), small_options()));
    let seqs: Arc<Vec<Vec<u32>>> = Arc::new((0..24).map(|i| tokens(i + 500, 70)).collect());
    for t in seqs.iter() {
        put(&store, NS, layout(), t, None);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..3)
        .map(|r| {
            let (store, seqs, stop) = (store.clone(), seqs.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut i = r;
                let (mut hits, mut misses) = (0u64, 0u64);
                while !stop.load(Ordering::Relaxed) {
                    let t = &seqs[i % seqs.len()];
                    match store.get_batch(NS, t, t.len()) {
                        Ok(kv) => {
                            assert_eq!(kv.bytes, kv_for(&layout(), t), "wrong bytes for {i}");
                            hits += 1;
                        }
                        Err(e) => {
                            assert!(e.is_miss(), "{e}");
                            misses += 1;
                        }
                    }
                    let p = store.probe(NS, t).unwrap();
                    assert!(p == 0 || p % 16 == 0 || p == t.len(), "probe {p}");
                    i += 7;
                }
                (hits, misses)
            })
        })
        .collect();
    // The writer deletes and stores again, and merges; after each of its calls returns, its
    // own view must agree.
    let deadline = Instant::now() + Duration::from_secs(4);
    let mut round = 0;
    while Instant::now() < deadline {
        for (k, t) in seqs.iter().enumerate() {
            if (k + round) % 3 == 0 {
                store.delete(NS, t, 0).unwrap();
                assert_eq!(store.probe(NS, t).unwrap(), 0);
            } else if store.probe(NS, t).unwrap() < t.len() {
                put(&store, NS, layout(), t, None);
                assert_eq!(store.probe(NS, t).unwrap(), t.len());
            }
        }
        if round % 4 == 3 {
            store.compact_all().unwrap();
        }
        round += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let (mut hits, mut misses) = (0, 0);
    for r in readers {
        let (h, m) = r.join().unwrap();
        hits += h;
        misses += m;
    }
    assert!(hits > 0 && misses > 0, "hits {hits}, misses {misses}");
    // Final state: exactly what the writer left.
    for (k, t) in seqs.iter().enumerate() {
        let present = (k + round - 1) % 3 != 0;
        assert_eq!(
            store.probe(NS, t).unwrap() == t.len(),
            present,
            "sequence {k}"
        );
    }
    let v = store.verify().unwrap();
    assert!(v.failures.is_empty(), "{v:?}");
}
