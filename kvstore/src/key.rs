//! Block keys: an encoding whose byte order follows token-prefix order.
//!
//! A sequence of tokens is cut into blocks of `block_tokens` (the last one may be shorter). The
//! key of block `i` is
//!
//! | bytes      | field                                                                 |
//! |-----------:|-----------------------------------------------------------------------|
//! | 16         | namespace id                                                          |
//! | 8 × (i+1)  | for each block `j` in `0..=i`: the first 8 bytes of the token digest of the prefix ending with block `j` |
//!
//! so the key of a block is a byte prefix of the keys of every block that extends it. Hence:
//! - all blocks of one namespace share a 16-byte prefix;
//! - the descendants of a block (every cached sequence that extends its prefix) are exactly the
//!   keys that start with its key: one range;
//! - the ancestors of a block are the truncations of its key at 8-byte steps.
//!
//! The token digest chains over blocks (`schema::TokenDigest::extend`), so one hash per block
//! gives both the key component and the 16-byte digest that every read verifies against the
//! record. 8 bytes per block make an accidental key collision astronomically unlikely, and the
//! digest check turns even that into a miss, never wrong data.

use schema::{NamespaceId, TokenDigest};

/// Bytes of the namespace prefix.
pub const NS_LEN: usize = 16;
/// Bytes each block adds to the key.
pub const BLOCK_HASH_LEN: usize = 8;

/// One block of a token sequence, with its key and the digest of the prefix it ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BlockRef {
    pub key: Vec<u8>,
    /// Token range of this block within the sequence.
    pub start: usize,
    pub end: usize,
    pub digest: TokenDigest,
}

impl BlockRef {
    pub fn tokens(&self) -> usize {
        self.end - self.start
    }
}

/// Keys and digests of every block of `tokens`, in order.
pub(crate) fn blocks(ns: &NamespaceId, tokens: &[u32], block_tokens: usize) -> Vec<BlockRef> {
    debug_assert!(block_tokens > 0);
    let mut out = Vec::with_capacity(tokens.len().div_ceil(block_tokens));
    let mut key = Vec::with_capacity(NS_LEN + BLOCK_HASH_LEN * out.capacity());
    key.extend_from_slice(&ns.0);
    let mut digest = TokenDigest::EMPTY;
    for (i, block) in tokens.chunks(block_tokens).enumerate() {
        digest = digest.extend(block);
        key.extend_from_slice(&digest.0[..BLOCK_HASH_LEN]);
        let start = i * block_tokens;
        out.push(BlockRef {
            key: key.clone(),
            start,
            end: start + block.len(),
            digest,
        });
    }
    out
}

/// The token digest of each block's prefix, with the block's end: what [`blocks`] computes,
/// without building keys (a probe answered from memory needs none).
pub(crate) fn digests(tokens: &[u32], block_tokens: usize) -> Vec<(usize, TokenDigest)> {
    debug_assert!(block_tokens > 0);
    let mut digest = TokenDigest::EMPTY;
    tokens
        .chunks(block_tokens)
        .enumerate()
        .map(|(i, block)| {
            digest = digest.extend(block);
            (i * block_tokens + block.len(), digest)
        })
        .collect()
}

/// The key of the block whose prefix digests are `digests` (from [`digests`], through that
/// block).
pub(crate) fn key_of(ns: &NamespaceId, digests: &[(usize, TokenDigest)]) -> Vec<u8> {
    let mut key = Vec::with_capacity(NS_LEN + BLOCK_HASH_LEN * digests.len());
    key.extend_from_slice(&ns.0);
    for (_, d) in digests {
        key.extend_from_slice(&d.0[..BLOCK_HASH_LEN]);
    }
    key
}

/// The namespace a key belongs to, if the key is well formed.
pub(crate) fn namespace_of(key: &[u8]) -> Option<NamespaceId> {
    if key.len() < NS_LEN + BLOCK_HASH_LEN || !(key.len() - NS_LEN).is_multiple_of(BLOCK_HASH_LEN) {
        return None;
    }
    Some(NamespaceId(key[..NS_LEN].try_into().ok()?))
}

/// Depth of a key: 0 for a first block.
pub(crate) fn depth_of(key: &[u8]) -> usize {
    (key.len() - NS_LEN) / BLOCK_HASH_LEN - 1
}

/// The shallowest ancestor of sequence key `seq` (`seq` included) such that `needed` holds for
/// none of the blocks from it down to `seq`: deleting everything under it drops `seq` and
/// every block above it that nothing else needs. `None` when `seq`'s own block is needed.
pub(crate) fn unneeded_ancestor<E>(
    seq: &[u8],
    mut needed: impl FnMut(&[u8]) -> Result<bool, E>,
) -> Result<Option<Vec<u8>>, E> {
    let mut cut = None;
    for d in (0..=depth_of(seq)).rev() {
        let anc = &seq[..NS_LEN + BLOCK_HASH_LEN * (d + 1)];
        if needed(anc)? {
            break;
        }
        cut = Some(anc.to_vec());
    }
    Ok(cut)
}

/// The smallest key greater than every key that starts with `prefix` (exclusive range end),
/// or `None` when no such key exists (all bytes are 0xff).
#[cfg(test)]
pub(crate) fn prefix_end(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return Some(end);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const NS: NamespaceId = NamespaceId([7u8; 16]);

    #[test]
    fn unneeded_ancestor_stops_below_the_first_needed_block() {
        let toks: Vec<u32> = (0..12).collect();
        let b = blocks(&NS, &toks, 4);
        let seq = &b[2].key;
        let never = |_: &[u8]| Ok::<bool, ()>(false);
        assert_eq!(unneeded_ancestor(seq, never), Ok(Some(b[0].key.clone())));
        let first_needed = |k: &[u8]| Ok::<bool, ()>(k == b[0].key.as_slice());
        assert_eq!(
            unneeded_ancestor(seq, first_needed),
            Ok(Some(b[1].key.clone()))
        );
        let own_needed = |k: &[u8]| Ok::<bool, ()>(k == seq.as_slice());
        assert_eq!(unneeded_ancestor(seq, own_needed), Ok(None));
    }

    #[test]
    fn block_keys_extend_each_other() {
        let toks: Vec<u32> = (0..10).collect();
        let b = blocks(&NS, &toks, 4);
        assert_eq!(b.len(), 3);
        assert_eq!((b[2].start, b[2].end), (8, 10));
        for w in b.windows(2) {
            assert!(w[1].key.starts_with(&w[0].key));
            assert!(w[0].key < w[1].key);
        }
        let chained = TokenDigest::of(&toks[..4])
            .extend(&toks[4..8])
            .extend(&toks[8..]);
        assert_eq!(b[2].digest, chained);
        assert_eq!(depth_of(&b[2].key), 2);
        assert_eq!(namespace_of(&b[1].key), Some(NS));
        assert_eq!(namespace_of(&b[1].key[..20]), None);
    }

    #[test]
    fn digests_and_key_of_agree_with_blocks() {
        let toks: Vec<u32> = (0..37).map(|i| i * 7919).collect();
        let b = blocks(&NS, &toks, 8);
        let d = digests(&toks, 8);
        assert_eq!(b.len(), d.len());
        for (i, r) in b.iter().enumerate() {
            assert_eq!((r.end, r.digest), d[i]);
            assert_eq!(r.key, key_of(&NS, &d[..=i]));
        }
    }

    #[test]
    fn partial_block_differs_from_full_block_with_same_start() {
        let full = blocks(&NS, &[1, 2, 3, 4], 4);
        let part = blocks(&NS, &[1, 2, 3], 4);
        assert_ne!(full[0].key, part[0].key);
    }

    #[test]
    fn prefix_end_bounds_the_range() {
        assert_eq!(prefix_end(&[1, 2, 0xff]), Some(vec![1, 3]));
        assert_eq!(prefix_end(&[0xff, 0xff]), None);
    }

    proptest! {
        // Prefix order: if sequence a is a block-aligned prefix of b, each key of a is a prefix of
        // the key of the same block in b; and every key of a sequence that does not share a's
        // prefix sorts outside the range [key(a), prefix_end(key(a))).
        #[test]
        fn keys_follow_token_prefix_order(
            a in proptest::collection::vec(0u32..50, 1..40),
            tail in proptest::collection::vec(0u32..50, 0..40),
            other in proptest::collection::vec(0u32..50, 1..40),
            bt in 1usize..9,
        ) {
            let mut b_toks = a.clone();
            b_toks.extend_from_slice(&tail);
            let ka = blocks(&NS, &a, bt);
            let kb = blocks(&NS, &b_toks, bt);
            let full_a = a.len() / bt; // blocks of `a` that are full, hence shared with b
            for i in 0..full_a {
                prop_assert_eq!(&ka[i].key, &kb[i].key);
                prop_assert_eq!(ka[i].digest, kb[i].digest);
            }
            for k in &kb[full_a.min(kb.len())..] {
                if full_a > 0 {
                    prop_assert!(k.key.starts_with(&ka[full_a - 1].key));
                }
            }
            let ko = blocks(&NS, &other, bt);
            let last_a = ka.last().unwrap();
            let end = prefix_end(&last_a.key).unwrap();
            let d = ka.len() - 1;
            // `other` extends a's last block when it has the same block at the same depth.
            let shares_last = ko.len() > d
                && ko[d].end == last_a.end
                && other[..last_a.end] == a[..last_a.end];
            for (j, k) in ko.iter().enumerate() {
                let in_range = k.key >= last_a.key && k.key < end;
                prop_assert_eq!(in_range, shares_last && j >= d, "in range iff it extends a");
            }
        }
    }
}
