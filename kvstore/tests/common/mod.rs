//! Helpers shared by the kvstore integration tests: deterministic sequences and KV.
#![allow(dead_code)]

use kvstore::{DType, KvLayout, NamespaceId, Store, StoreOptions, SyncPolicy};
use rand::{Rng, SeedableRng};

pub const NS: NamespaceId = NamespaceId([3u8; 16]);

pub fn layout() -> KvLayout {
    KvLayout {
        layers: 2,
        kv_heads: 1,
        head_dim: 16,
        dtype: DType::F16,
    }
}

/// Small blocks and segments, so that tests roll segments and merge often. Batches of 8 KiB
/// and more (sequences over ~60 tokens) are written with direct I/O, smaller ones through the
/// page cache, so segments mix both and hold padding.
pub fn small_options() -> StoreOptions {
    StoreOptions {
        block_tokens: 16,
        segment_bytes: 256 << 10,
        direct_write_min_bytes: Some(8 << 10),
        sync: SyncPolicy::Never,
        background_merge: false,
        hot_tier_bytes: 0,
        ..StoreOptions::default()
    }
}

pub fn open(dir: &std::path::Path, opts: StoreOptions) -> Store {
    Store::open(dir, opts).expect("open store")
}

/// KV as a real model would give it: the bytes at position `p` depend on `tokens[..=p]` only.
pub fn kv_for(layout: &KvLayout, tokens: &[u32]) -> Vec<u8> {
    let n = tokens.len();
    let tb = layout.plane_token_bytes();
    let mut out = vec![0u8; layout.bytes_for(n)];
    let mut h: u64 = 0xcbf29ce484222325;
    for (p, t) in tokens.iter().enumerate() {
        h = (h ^ *t as u64).wrapping_mul(0x100000001b3);
        for plane in 0..layout.planes() {
            let base = (plane * n + p) * tb;
            for j in 0..tb {
                let x = h
                    ^ (plane as u64).wrapping_mul(0x9e3779b97f4a7c15)
                    ^ (j as u64).wrapping_mul(131);
                out[base + j] = (x >> ((j % 8) * 8)) as u8;
            }
        }
    }
    out
}

/// Stores `tokens` with their deterministic KV (`kv_for`), attached to `doc` if given.
pub fn put_seq(store: &Store, tokens: &[u32], doc: Option<&str>) -> kvstore::PutReport {
    let kv = kv_for(&layout(), tokens);
    store
        .put_batch(
            NS,
            layout(),
            &[kvstore::PutItem {
                tokens,
                kv: &kv,
                doc,
            }],
        )
        .expect("put")
}

/// Sequence `i`: a deterministic token list; every third one shares a 48-token prefix with
/// its neighbours so that blocks are shared and deduplicated.
pub fn sequence(i: u64) -> Vec<u32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(i);
    let len = rng.gen_range(1..=200);
    let mut toks: Vec<u32> = Vec::with_capacity(len + 48);
    if i.is_multiple_of(3) {
        let mut shared = rand::rngs::StdRng::seed_from_u64(1_000_000 + i / 9);
        toks.extend((0..48).map(|_| shared.gen_range(0..50_000)));
    }
    toks.extend((0..len).map(|_| rng.gen_range(0..50_000)));
    toks
}

pub fn doc_of(i: u64) -> String {
    format!("doc-{}", i / 4)
}

/// Sum of the sizes of the files under `dir`.
pub fn dir_bytes(dir: &std::path::Path) -> u64 {
    let mut total = 0;
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let m = e.metadata().unwrap();
        if m.is_dir() {
            total += dir_bytes(&e.path());
        } else {
            total += m.len();
        }
    }
    total
}
