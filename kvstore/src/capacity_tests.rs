//! Unit tests of `capacity.rs` (a module of it, kept in its own file).

use super::*;

fn stat(reads: u32, last: u64) -> SeqStat {
    SeqStat {
        tokens: 256,
        bytes: 256 * 12_288,
        created_ms: 0,
        last_ms: last,
        reads,
        resident: true,
    }
}

#[test]
fn logged_reads_are_applied_before_anyone_sees_the_map() {
    let log = AccessLog::default();
    log.lock().stored(b"seq-a", 4, 10, 100);
    log.lock().stored(b"seq-bb", 4, 10, 100);
    log.read(b"seq-a", 150);
    log.read(b"seq-bb", 160);
    log.read(b"seq-a", 170);
    log.read(b"never-stored", 180);
    {
        let map = log.lock();
        assert_eq!(
            (
                map.seqs[&b"seq-a"[..]].reads,
                map.seqs[&b"seq-a"[..]].last_ms
            ),
            (2, 170)
        );
        assert_eq!(map.seqs[&b"seq-bb"[..]].reads, 1);
        assert!(!map.seqs.contains_key(&b"never-stored"[..]));
    }
    // A full log is applied without waiting for a lock.
    for i in 0..READ_LOG_MAX as u64 {
        log.read(b"seq-bb", 200 + i);
    }
    assert!(log.reads.lock().reads.is_empty());
    assert_eq!(
        log.map.lock().seqs[&b"seq-bb"[..]].reads,
        1 + READ_LOG_MAX as u32
    );
}

#[test]
fn access_records_round_trip() {
    let s = stat(7, 123_456);
    assert_eq!(decode_access(&encode_access(&s)), Some(s));
    assert_eq!(decode_access(&[2; ACCESS_LEN]), None);
    assert_eq!(decode_access(&[1; 3]), None);
}

#[test]
fn policies_order_as_documented() {
    let now = 1_000_000;
    let (old_hot, new_cold) = (stat(50, 1000), stat(0, 990_000));
    let lru = EvictionPolicy::Lru;
    assert!(order(&lru, &old_hot, now) < order(&lru, &new_cold, now));
    let lfu = EvictionPolicy::Lfu;
    assert!(order(&lfu, &new_cold, now) < order(&lfu, &old_hot, now));
    let cost = EvictionPolicy::CostAware(CostModel::default());
    assert!(order(&cost, &new_cold, now) < order(&cost, &old_hot, now));
    let ttl = EvictionPolicy::Ttl {
        ttl: Duration::from_secs(60),
    };
    assert!(sweep_out(&ttl, &old_hot, now));
    assert!(!sweep_out(&ttl, &new_cold, now));
}

#[test]
fn break_even_follows_the_prices() {
    let m = CostModel::default();
    // 256 tokens of a 0.5B model (12 KiB per token): a few days at the default prices.
    let t = m.break_even_s(256, 256 * 12_288);
    assert!((86_400.0..30.0 * 86_400.0).contains(&t), "{t}");
    let pricier_gpu = CostModel {
        gpu_dollars_per_hour: 4.0,
        ..m
    };
    assert!((pricier_gpu.break_even_s(256, 256 * 12_288) / t - 2.0).abs() < 1e-9);
    // A chunk never read for many break-even intervals is not worth keeping.
    let s = SeqStat {
        created_ms: 0,
        ..stat(0, 0)
    };
    let years = 3 * 365 * 86_400_000;
    assert!(m.net_per_s(&s, years) < 0.0);
    let cost = EvictionPolicy::CostAware(m);
    assert!(sweep_out(&cost, &s, years));
    // A large, cheap-to-recompute chunk is not worth keeping, but only after a prior window.
    let big = SeqStat {
        tokens: 16,
        bytes: 1 << 30,
        ..s
    };
    assert!(m.net_per_s(&big, 1000) < 0.0);
    assert!(!sweep_out(&cost, &big, 1000));
    assert!(sweep_out(&cost, &big, 2 * 86_400_000));
    assert!(m.net_per_s(&stat(1000, 0), 86_400_000) > 0.0);
}

/// Sequence keys as `key.rs` builds them: namespace, then one 8-byte hash per block.
fn seq(ns: u8, blocks: &[u8]) -> Vec<u8> {
    let mut k = vec![ns; key::NS_LEN];
    for b in blocks {
        k.extend_from_slice(&[*b; key::BLOCK_HASH_LEN]);
    }
    k
}

#[test]
fn eviction_takes_suffixes_first_and_spares_the_write() {
    let mut a = Access::default();
    let (parent, child, other) = (seq(1, &[1]), seq(1, &[1, 2]), seq(1, &[3]));
    for k in [&parent, &child, &other] {
        a.stored(k, 128, 1000, 0);
    }
    // The child extends the parent: the parent waits; the child goes alone.
    assert_eq!(a.eviction_cut(&parent, &[]), None);
    assert_eq!(a.eviction_cut(&child, &[]), Some(seq(1, &[1, 2])));
    // Once the child is evicted, the parent goes, down to its first block.
    assert!(a.evicted(&child).is_some());
    assert!(!a.seqs[&child].resident && a.dirty.contains(&child));
    assert_eq!(a.eviction_cut(&parent, &[]), Some(parent.clone()));
    // A block the write in progress uses is never cut.
    assert_eq!(a.eviction_cut(&other, &[&other]), None);
    let longer = seq(1, &[3, 4]);
    assert_eq!(a.eviction_cut(&other, &[&longer]), None);
}

#[test]
fn eviction_order_follows_the_policy_within_the_group() {
    let mut a = Access::default();
    let (old, new, foreign) = (seq(1, &[1]), seq(1, &[2]), seq(2, &[3]));
    a.stored(&old, 128, 1000, 10);
    a.stored(&new, 128, 1000, 20);
    a.stored(&foreign, 128, 1000, 0);
    let in_group = |ns: &NamespaceId| ns.0 == [1; 16];
    let lru = EvictionPolicy::Lru;
    assert_eq!(
        a.eviction_order(&lru, in_group, false, 30),
        vec![old.clone(), new.clone()]
    );
    // LRU has no sweep; TTL sweeps only what outlived it.
    assert!(a.eviction_order(&lru, in_group, true, 30).is_empty());
    let ttl = EvictionPolicy::Ttl {
        ttl: Duration::from_millis(15),
    };
    assert_eq!(
        a.eviction_order(&ttl, in_group, true, 30),
        vec![old.clone()]
    );
    a.evicted(&old);
    assert_eq!(a.eviction_order(&lru, in_group, false, 30), vec![new]);
}

#[test]
fn validation_names_the_option() {
    let mut o = CapacityOptions {
        low_water: 0.99,
        ..CapacityOptions::default()
    };
    assert!(o.validate().unwrap_err().to_string().contains("water"));
    o.low_water = 0.5;
    o.quota_bytes = Some(0);
    assert!(o.validate().unwrap_err().to_string().contains("quota"));
}
