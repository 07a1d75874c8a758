//! Capacity: quotas and water levels under a write flood for every policy, refusal, suffix-first
//! eviction, the cost-aware policy against LRU on a skewed workload, access statistics across a
//! reopen, namespace drop, and the adaptive compaction controller.

mod common;

use std::time::Duration;

use common::*;
use kvstore::{
    AdaptiveOptions, CapacityOptions, CostModel, EvictionPolicy, OnFull, StoreOptions,
    DEFAULT_GROUP,
};

/// A chunk of 64 tokens (four 16-token blocks) unique to `i`.
fn chunk(i: u32) -> Vec<u32> {
    (0..64).map(|t| i * 1000 + t).collect()
}

/// Record bytes of one chunk (measured, so the test does not depend on the record format).
fn chunk_bytes() -> u64 {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), small_options());
    put_seq(&store, &chunk(0), None);
    store.group_bytes(DEFAULT_GROUP)
}

fn with_quota(quota: u64, policy: EvictionPolicy, on_full: OnFull) -> StoreOptions {
    StoreOptions {
        capacity: CapacityOptions {
            quota_bytes: Some(quota),
            high_water: 0.9,
            low_water: 0.6,
            policy,
            on_full,
            flush_interval: Duration::from_secs(3600),
        },
        ..small_options()
    }
}

fn policies() -> Vec<EvictionPolicy> {
    vec![
        EvictionPolicy::Lru,
        EvictionPolicy::Lfu,
        EvictionPolicy::Ttl {
            ttl: Duration::from_secs(3600),
        },
        EvictionPolicy::CostAware(CostModel::default()),
    ]
}

fn readable(store: &kvstore::Store, tokens: &[u32]) -> bool {
    store.get_batch(NS, tokens, tokens.len()).is_ok()
}

#[test]
fn quota_and_water_levels_hold_under_a_write_flood_for_every_policy() {
    let per = chunk_bytes();
    let quota = 40 * per;
    for policy in policies() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path(), with_quota(quota, policy, OnFull::Evict));
        let mut passes = 0;
        for i in 0..300u32 {
            let evicted_before = store.stats().evicted_sequences;
            let used_before = store.group_bytes(DEFAULT_GROUP);
            put_seq(&store, &chunk(i), Some(&format!("doc-{i}")));
            // Reads in between: a skew, so that the policies differ.
            for j in (0..=i).step_by(7) {
                let _ = store.get_batch(NS, &chunk(j), 64);
            }
            let used = store.group_bytes(DEFAULT_GROUP);
            assert!(used <= quota, "{}: {used} > quota {quota}", policy.name());
            if store.stats().evicted_sequences > evicted_before {
                passes += 1;
                // Eviction started at the high mark and stopped at the low mark.
                assert!(used_before + per > (quota as f64 * 0.9) as u64);
                assert!(
                    used <= (quota as f64 * 0.6) as u64 + per,
                    "{}: {used} after an eviction pass (low mark {})",
                    policy.name(),
                    quota as f64 * 0.6
                );
            }
        }
        assert!(passes >= 5, "{}: {passes} eviction passes", policy.name());
        // Evicted chunks are misses (never wrong data); resident ones still read back.
        let resident = (0..300).filter(|i| readable(&store, &chunk(*i))).count();
        assert!(
            (20..=40).contains(&resident),
            "{}: {resident}",
            policy.name()
        );
        let v = store.verify().unwrap();
        assert!(v.failures.is_empty(), "{:?}", v.failures);
        // Space comes back through the merger.
        store.compact_all().unwrap();
        let s = store.stats();
        assert_eq!(s.dead_bytes, 0);
        assert!(s.live_bytes <= quota);
    }
}

#[test]
fn refuse_policy_refuses_writes_beyond_the_quota_and_evicts_nothing() {
    let per = chunk_bytes();
    let dir = tempfile::tempdir().unwrap();
    let store = open(
        dir.path(),
        with_quota(10 * per, EvictionPolicy::Lru, OnFull::Refuse),
    );
    for i in 0..10 {
        put_seq(&store, &chunk(i), None);
    }
    let kv = kv_for(&layout(), &chunk(10));
    let err = store
        .put_batch(
            NS,
            layout(),
            &[kvstore::PutItem {
                tokens: &chunk(10),
                kv: &kv,
                doc: None,
            }],
        )
        .unwrap_err();
    assert!(matches!(err, kvstore::Error::QuotaExceeded { .. }), "{err}");
    assert!(err.to_string().contains("quota"), "{err}");
    let s = store.stats();
    assert_eq!((s.evicted_sequences, s.refused_writes), (0, 1));
    assert!((0..10).all(|i| readable(&store, &chunk(i))));
    // A chunk already stored is still accepted (it needs no bytes).
    put_seq(&store, &chunk(3), Some("again"));
}

#[test]
fn suffix_blocks_go_before_their_parents() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), small_options());
    let parent = chunk(1)[..32].to_vec();
    let child = chunk(1);
    put_seq(&store, &parent, None); // older: first in LRU order
    std::thread::sleep(Duration::from_millis(5));
    put_seq(&store, &child, None);
    let total = store.group_bytes(DEFAULT_GROUP);
    let r = store.evict(DEFAULT_GROUP, total - 1).unwrap();
    assert_eq!(r.sequences, 1);
    assert_eq!(r.blocks, 2, "only the child's own two blocks");
    assert!(readable(&store, &parent));
    assert!(!readable(&store, &child));
    assert_eq!(store.probe(NS, &child).unwrap(), 32);
    assert!(!store.access(NS, &child).unwrap().resident);
    let mut buf = Vec::new();
    assert!(matches!(
        store.inspect(NS, &child, &mut buf).unwrap(),
        kvstore::SeqState::Absent
    ));
    assert!(matches!(
        store.inspect(NS, &parent, &mut buf).unwrap(),
        kvstore::SeqState::Present
    ));
    // Then the parent.
    let r = store.evict(DEFAULT_GROUP, 0).unwrap();
    assert_eq!((r.sequences, r.blocks), (1, 2));
    assert_eq!(store.group_bytes(DEFAULT_GROUP), 0);
}

/// A hot set read over and over while a flood of one-off chunks is written through a budget
/// that holds about a third of them: LRU lets the flood push hot chunks out between their
/// reads; the cost-aware policy keeps what is read.
#[test]
fn cost_aware_keeps_frequently_read_chunks_that_lru_loses() {
    let per = chunk_bytes();
    let survivors = |policy: EvictionPolicy| {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path(), with_quota(30 * per, policy, OnFull::Evict));
        let hot: Vec<u32> = (0..10).collect();
        let mut cold = 1000u32;
        for round in 0..20 {
            for h in &hot {
                if !readable(&store, &chunk(*h)) {
                    put_seq(&store, &chunk(*h), None); // a miss re-materializes
                }
            }
            // Between two reads of the hot set, more one-off chunks than the budget holds.
            for _ in 0..(25 + round % 3) {
                put_seq(&store, &chunk(cold), None);
                cold += 1;
            }
        }
        hot.iter().filter(|h| readable(&store, &chunk(**h))).count()
    };
    let lru = survivors(EvictionPolicy::Lru);
    let cost = survivors(EvictionPolicy::CostAware(CostModel::default()));
    let lfu = survivors(EvictionPolicy::Lfu);
    assert_eq!(cost, 10, "cost-aware kept {cost} of 10 hot chunks");
    assert!(lru < cost, "LRU kept {lru}, cost-aware {cost}");
    assert!(lfu >= lru, "LFU kept {lfu}, LRU {lru}");
}

#[test]
fn ttl_sweep_evicts_idle_chunks_without_pressure() {
    let dir = tempfile::tempdir().unwrap();
    let opts = StoreOptions {
        capacity: CapacityOptions {
            policy: EvictionPolicy::Ttl {
                ttl: Duration::from_millis(300),
            },
            ..CapacityOptions::default()
        },
        ..small_options()
    };
    let store = open(dir.path(), opts);
    put_seq(&store, &chunk(1), None);
    put_seq(&store, &chunk(2), None);
    std::thread::sleep(Duration::from_millis(200));
    assert!(readable(&store, &chunk(2))); // read: its clock restarts
    std::thread::sleep(Duration::from_millis(150));
    store.capacity_tick().unwrap();
    assert!(!readable(&store, &chunk(1)), "idle for 350 ms > ttl");
    assert!(readable(&store, &chunk(2)), "read 150 ms ago");
}

#[test]
fn access_statistics_survive_a_reopen_and_evicted_ones_are_kept() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = open(dir.path(), small_options());
        put_seq(&store, &chunk(1), None);
        put_seq(&store, &chunk(2), None);
        store.get_batch(NS, &chunk(2), 64).unwrap();
        // Distinct read times (the clock has millisecond resolution).
        std::thread::sleep(Duration::from_millis(5));
        for _ in 0..5 {
            store.get_batch(NS, &chunk(1), 64).unwrap();
        }
        // LRU: chunk 1 was read last, chunk 2 goes.
        let r = store
            .evict(DEFAULT_GROUP, store.group_bytes(DEFAULT_GROUP) - 1)
            .unwrap();
        assert_eq!(r.sequences, 1);
    }
    let store = open(dir.path(), small_options());
    let a = store.access(NS, &chunk(1)).unwrap();
    assert_eq!((a.reads, a.resident, a.tokens), (5, true, 64));
    let b = store.access(NS, &chunk(2)).unwrap();
    assert_eq!((b.reads, b.resident), (1, false));
    // Re-materialized: resident again, history kept.
    put_seq(&store, &chunk(2), None);
    let b = store.access(NS, &chunk(2)).unwrap();
    assert_eq!((b.reads, b.resident), (1, true));
    // Deleting forgets.
    store.delete(NS, &chunk(2), 0).unwrap();
    assert!(store.access(NS, &chunk(2)).is_none());
}

#[test]
fn chunks_stored_before_statistics_existed_are_adopted_at_open() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = open(dir.path(), small_options());
        put_seq(&store, &chunk(7), None);
    }
    // Simulate an older store: drop the statistics family's content.
    {
        let db = rocksdb::DB::open_cf(
            &rocksdb::Options::default(),
            dir.path().join("index"),
            ["kv", "docs", "seqs", "segments", "meta", "access"],
        )
        .unwrap();
        let cf = db.cf_handle("access").unwrap();
        let keys: Vec<Vec<u8>> = db
            .iterator_cf(cf, rocksdb::IteratorMode::Start)
            .map(|r| r.unwrap().0.to_vec())
            .collect();
        assert_eq!(keys.len(), 1);
        for k in keys {
            db.delete_cf(cf, k).unwrap();
        }
    }
    let store = open(dir.path(), small_options());
    let a = store.access(NS, &chunk(7)).unwrap();
    assert_eq!((a.tokens, a.resident, a.reads), (64, true, 0));
    assert_eq!(store.evict(DEFAULT_GROUP, 0).unwrap().sequences, 1);
    assert!(!readable(&store, &chunk(7)));
}

#[test]
fn namespaces_are_grouped_listed_and_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), small_options());
    let old = kvstore::NamespaceId([9; 16]);
    store
        .register_namespace_in(old, layout(), kvstore::Codec::None, "qwen")
        .unwrap();
    store
        .register_namespace_in(NS, layout(), kvstore::Codec::None, "qwen")
        .unwrap();
    let kv = kv_for(&layout(), &chunk(1));
    let item = kvstore::PutItem {
        tokens: &chunk(1),
        kv: &kv,
        doc: Some("d@1"),
    };
    store.put_batch(old, layout(), &[item]).unwrap();
    put_seq(&store, &chunk(1), Some("d@1"));
    let per = store.group_bytes("qwen") / 2;
    assert_eq!(store.group_bytes(DEFAULT_GROUP), 0);
    let list = store.namespaces();
    assert_eq!(list.len(), 2);
    assert!(list.iter().all(|n| n.group == "qwen" && n.bytes == per));
    assert_eq!(store.document_sequences("d@1").unwrap().len(), 2);

    let r = store.drop_namespace(old).unwrap();
    assert_eq!((r.blocks, r.sequences), (4, 1));
    assert_eq!(store.group_bytes("qwen"), per);
    assert_eq!(store.document_sequences("d@1").unwrap(), vec![(NS, 64)]);
    assert!(store.get_batch(old, &chunk(1), 64).is_err());
    assert!(readable(&store, &chunk(1)));
    drop(store);
    let store = open(dir.path(), small_options());
    assert_eq!(store.namespaces().len(), 1);
    assert_eq!(store.namespaces()[0].group, "qwen");
    assert_eq!(store.group_bytes("qwen"), per);
    store.compact_all().unwrap();
    assert!(store.verify().unwrap().failures.is_empty());
}

#[test]
fn adaptive_controller_moves_to_more_runs_under_writes_and_back_under_reads() {
    let dir = tempfile::tempdir().unwrap();
    let window = Duration::from_millis(500);
    let opts = StoreOptions {
        index_write_buffer_bytes: 64 << 10,
        adaptive: Some(AdaptiveOptions {
            window,
            interval: Duration::from_secs(3600), // driven by hand below
            min_ops: 100,
            ..AdaptiveOptions::default()
        }),
        ..small_options()
    };
    let store = open(dir.path(), opts);
    assert_eq!(store.stats().tuning, kvstore::Tuning::DEFAULT);
    // Write-heavy: a bulk load.
    let one = |i: u32| vec![i, i + 1, 7];
    for i in 0..30_000 {
        put_seq(&store, &one(i), None);
    }
    store.adapt_now().unwrap();
    assert_eq!(
        store.stats().tuning_transitions,
        0,
        "one evaluation is not enough"
    );
    store.adapt_now().unwrap();
    let s = store.stats();
    assert_eq!(s.tuning_transitions, 1);
    assert!(
        s.tuning.l0_trigger > kvstore::Tuning::DEFAULT.l0_trigger,
        "{:?}",
        s.tuning
    );
    // Then read-heavy, after a full window.
    std::thread::sleep(window + Duration::from_millis(100));
    for i in 0..5_000 {
        store.get_batch(NS, &one(i), 3).unwrap();
    }
    store.adapt_now().unwrap();
    store.adapt_now().unwrap();
    let s = store.stats();
    assert_eq!(s.tuning_transitions, 2);
    assert!(
        s.tuning.l0_trigger <= kvstore::Tuning::DEFAULT.l0_trigger,
        "{:?}",
        s.tuning
    );
    let io = store.index_io().unwrap();
    assert!(io.flush_write_bytes > 0, "{io:?}");
    // Stable: no further change without a change in the workload.
    store.adapt_now().unwrap();
    store.adapt_now().unwrap();
    assert_eq!(store.stats().tuning_transitions, 2);
}

const CRASH_CHILD_ENV: &str = "KVSTORE_CAPACITY_CRASH_DIR";

fn crash_options() -> StoreOptions {
    let per = 4 * 16 * layout().plane_token_bytes() as u64 * layout().planes() as u64;
    StoreOptions {
        capacity: CapacityOptions {
            flush_interval: Duration::from_millis(20),
            ..with_quota(40 * (per + 200), EvictionPolicy::Lfu, OnFull::Evict).capacity
        },
        ..small_options()
    }
}

/// The child: a write flood through the quota, with reads, until killed.
#[test]
fn capacity_crash_child() {
    let Ok(dir) = std::env::var(CRASH_CHILD_ENV) else {
        return; // only meaningful as a child of the test below
    };
    let store = open(std::path::Path::new(&dir), crash_options());
    let start: u32 = std::env::var("KVSTORE_CAPACITY_CRASH_FROM")
        .unwrap()
        .parse()
        .unwrap();
    for i in start.. {
        put_seq(&store, &chunk(i), Some(&format!("doc-{i}")));
        println!("put {i}");
        for j in (start..=i).rev().step_by(3).take(5) {
            let _ = store.get_batch(NS, &chunk(j), 64);
        }
    }
}

/// Kill the flood at random moments: after each reopen every chunk reads back exactly or is a
/// clean miss, the statistics agree with what is stored, and the quota still holds.
#[test]
fn a_killed_write_flood_leaves_a_consistent_store_within_quota() {
    use rand::{Rng, SeedableRng};
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let quota = crash_options().capacity.quota_bytes.unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let mut acked = Vec::new();
    let mut last = (0, 0);
    for round in 0..6u32 {
        let from = round * 10_000;
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "capacity_crash_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CRASH_CHILD_ENV, dir.path())
            .env("KVSTORE_CAPACITY_CRASH_FROM", from.to_string())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let out = std::io::BufReader::new(child.stdout.take().unwrap());
        let kill_after = rng.gen_range(30..150);
        let mut n = 0;
        for line in out.lines() {
            let line = line.unwrap();
            if let Some(i) = line.strip_prefix("put ") {
                acked.push(i.parse::<u32>().unwrap());
                n += 1;
                if n == kill_after {
                    child.kill().unwrap();
                    break;
                }
            }
        }
        child.wait().unwrap();
        assert!(
            n >= kill_after,
            "round {round}: the child stopped after {n} puts"
        );

        let store = open(dir.path(), crash_options());
        assert!(store.group_bytes(DEFAULT_GROUP) <= quota);
        let v = store.verify().unwrap();
        assert!(v.failures.is_empty(), "{:?}", v.failures);
        let mut resident = 0;
        for &i in &acked {
            let t = chunk(i);
            match store.get_batch(NS, &t, 64) {
                Ok(kv) => {
                    assert_eq!(kv.bytes, kv_for(&layout(), &t), "chunk {i}");
                    resident += 1;
                    assert!(store.access(NS, &t).unwrap().resident, "chunk {i}");
                }
                Err(e) => {
                    assert!(matches!(e, kvstore::Error::Miss { .. }), "chunk {i}: {e}");
                    assert_eq!(store.probe(NS, &t).unwrap(), 0, "chunk {i}: half evicted");
                    if let Some(a) = store.access(NS, &t) {
                        assert!(!a.resident, "chunk {i} is a miss but marked resident");
                    }
                }
            }
        }
        assert!(resident > 0);
        last = (resident, acked.len());
    }
    assert!(last.0 < last.1, "the flood never evicted: {last:?}");
}
