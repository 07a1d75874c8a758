//! The presence filter: an in-memory blocked Bloom filter over every block in the index, the
//! first tier of a point lookup.
//!
//! A probe of a chunk that was never stored (half of all probes in a RAG workload that
//! materializes lazily) would otherwise cost two RocksDB `Get`s, each checking the filter of
//! every sorted run of the LSM (and each run's file metadata) before it answers "absent".
//! This filter answers for the whole store with one cache line per lookup, so an absent
//! block costs one memory access; a block it may contain goes on to the location cache and
//! then RocksDB (whose own filters remain the second tier).
//!
//! Layout: `lines` cache lines of 512 bits; a key sets [`PROBES`] bits in one line, chosen by
//! double hashing of the second half of its 128-bit hash; the first half picks the line.
//! Sized at [`BITS_PER_KEY`] bits per key of its capacity (≈0.1-0.2 % false positives
//! when full).
//!
//! Exactness. A false positive only costs the lookup it would have saved; a false negative
//! would hide stored KV, so none may occur for a committed block: every index commit that adds
//! a block inserts it ([`Presence::insert`], called by `Inner::commit` before the write
//! returns), the filter is built from a full scan of the index at open, and a rebuild
//! (`Inner::rebuild_presence`) publishes the new filter as `next` *before* it starts its scan,
//! so a block committed during the scan lands in both. Bits of deleted blocks stay set (a
//! Bloom filter cannot unset them); they are counted as stale, and the filter is rebuilt once a
//! quarter of its keys are stale or it holds more keys than it was sized for.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use crate::locations::BlockId;

/// Bits of filter per key of capacity.
const BITS_PER_KEY: u64 = 16;
/// Bits set per key, all in one 512-bit line.
const PROBES: u32 = 8;
/// Smallest capacity, in keys (a 512 KiB filter).
const MIN_CAPACITY: u64 = 1 << 18;
/// A filter is sized for this many times the keys it starts with, so that a growing store
/// rebuilds it once per 4x growth (8 bytes of filter per live key at the start).
const GROWTH: u64 = 4;

/// One cache line of filter bits.
#[repr(align(64))]
#[derive(Debug, Default)]
struct Line([AtomicU64; 8]);

/// A fixed-size blocked Bloom filter with atomic bits (inserts and lookups need no lock).
#[derive(Debug)]
pub(crate) struct Bloom {
    lines: Box<[Line]>,
    capacity: u64,
}

/// The 128-bit hash of a block id: the digest is a blake3 output, so its halves are already
/// uniform; the namespace is mixed in because equal tokens have equal digests in every one.
fn hash(id: &BlockId) -> (u64, u64) {
    let half = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap());
    let (d0, d1) = (half(&id.digest.0[..8]), half(&id.digest.0[8..]));
    let (n0, n1) = (half(&id.ns.0[..8]), half(&id.ns.0[8..]));
    (
        d0 ^ n0.wrapping_mul(0x9e37_79b9_7f4a_7c15),
        d1 ^ n1.wrapping_mul(0xc2b2_ae3d_27d4_eb4f),
    )
}

impl Bloom {
    fn new(capacity: u64) -> Self {
        let capacity = capacity.max(MIN_CAPACITY);
        let lines = (capacity * BITS_PER_KEY).div_ceil(512) as usize;
        Bloom {
            lines: (0..lines).map(|_| Line::default()).collect(),
            capacity,
        }
    }

    /// The line and the bit positions (0..512) of a key.
    fn place(&self, (h0, h1): (u64, u64)) -> (&Line, impl Iterator<Item = u32>) {
        // Multiply-shift maps h0 onto 0..lines without a division.
        let line = ((h0 as u128 * self.lines.len() as u128) >> 64) as usize;
        let (a, b) = (h1 as u32, (h1 >> 32) as u32 | 1);
        (
            &self.lines[line],
            (0..PROBES).map(move |i| a.wrapping_add(i.wrapping_mul(b)) & 511),
        )
    }

    fn insert(&self, h: (u64, u64)) {
        let (line, bits) = self.place(h);
        for bit in bits {
            line.0[(bit >> 6) as usize].fetch_or(1 << (bit & 63), Ordering::Relaxed);
        }
    }

    fn may_contain(&self, h: (u64, u64)) -> bool {
        let (line, mut bits) = self.place(h);
        bits.all(|bit| line.0[(bit >> 6) as usize].load(Ordering::Relaxed) & (1 << (bit & 63)) != 0)
    }

    fn bytes(&self) -> usize {
        self.lines.len() * 64
    }
}

/// See the module docs.
#[derive(Debug)]
pub(crate) struct Presence {
    current: RwLock<Arc<Bloom>>,
    /// A filter being built by a rebuild's scan; inserts go to it as well.
    next: Mutex<Option<Arc<Bloom>>>,
    /// Keys inserted into `current` (by its build and since; a key inserted while a rebuild
    /// scans may be counted twice, which only brings the next rebuild forward).
    keys: AtomicU64,
    /// `keys` when the running rebuild began.
    keys_at_begin: AtomicU64,
    /// Keys deleted since `current` was built (their bits stay set).
    stale: AtomicU64,
    rebuilds: AtomicU64,
}

/// What the filter holds, for statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PresenceStats {
    /// Keys inserted since the last build (including the build's own), and its capacity.
    pub keys: u64,
    /// Keys the filter was sized for.
    pub capacity: u64,
    /// Deleted keys whose bits are still set.
    pub stale: u64,
    /// Memory of the filter.
    pub bytes: u64,
    /// Builds since open (the first at open).
    pub rebuilds: u64,
}

impl Presence {
    /// An empty filter sized for `expected` keys (and growth).
    pub fn new(expected: u64) -> Self {
        Presence {
            current: RwLock::new(Arc::new(Bloom::new(expected.saturating_mul(GROWTH)))),
            next: Mutex::new(None),
            keys: AtomicU64::new(0),
            keys_at_begin: AtomicU64::new(0),
            stale: AtomicU64::new(0),
            rebuilds: AtomicU64::new(0),
        }
    }

    /// False only if `id` is certainly not in the index.
    pub fn may_contain(&self, id: &BlockId) -> bool {
        self.current.read().may_contain(hash(id))
    }

    /// `id` was committed to the index (or moved: inserting twice is harmless).
    pub fn insert(&self, id: &BlockId) {
        let h = hash(id);
        // Held across both inserts: `finish` swaps `current` under the write lock, so an
        // insert lands either in the old filter and `next`, or in the new one.
        let current = self.current.read();
        current.insert(h);
        if let Some(next) = self.next.lock().as_ref() {
            next.insert(h);
        }
        self.keys.fetch_add(1, Ordering::Relaxed);
    }

    /// `n` blocks were deleted from the index.
    pub fn removed(&self, n: u64) {
        self.stale.fetch_add(n, Ordering::Relaxed);
    }

    /// Whether a rebuild would pay: more keys than the filter was sized for (its false
    /// positive rate climbs), or a quarter of its keys deleted (each costs an index lookup
    /// when asked for).
    pub fn needs_rebuild(&self) -> bool {
        let capacity = self.current.read().capacity;
        let keys = self.keys.load(Ordering::Relaxed);
        keys > capacity || self.stale.load(Ordering::Relaxed).saturating_mul(4) > keys.max(1024)
    }

    /// Starts a rebuild for `expected` live keys: the returned filter receives every insert
    /// from now on; the caller scans the index into it, then calls [`Presence::finish`].
    pub fn begin(&self, expected: u64) -> Arc<Bloom> {
        let next = Arc::new(Bloom::new(expected.saturating_mul(GROWTH)));
        let mut slot = self.next.lock();
        *slot = Some(next.clone());
        self.keys_at_begin
            .store(self.keys.load(Ordering::Relaxed), Ordering::Relaxed);
        drop(slot);
        next
    }

    /// Inserts one scanned key into a filter being built.
    pub fn scan_insert(next: &Bloom, id: &BlockId) {
        next.insert(hash(id));
    }

    /// Abandons a rebuild whose scan failed (the current filter stays).
    pub fn abort(&self) {
        *self.next.lock() = None;
    }

    /// Publishes the filter `next`, built from a scan of `scanned` keys.
    pub fn finish(&self, next: Arc<Bloom>, scanned: u64) {
        let mut current = self.current.write();
        *current = next;
        *self.next.lock() = None;
        let during = self.keys.load(Ordering::Relaxed) - self.keys_at_begin.load(Ordering::Relaxed);
        self.keys.store(scanned + during, Ordering::Relaxed);
        self.stale.store(0, Ordering::Relaxed);
        self.rebuilds.fetch_add(1, Ordering::Relaxed);
    }

    pub fn stats(&self) -> PresenceStats {
        let current = self.current.read();
        PresenceStats {
            keys: self.keys.load(Ordering::Relaxed),
            capacity: current.capacity,
            stale: self.stale.load(Ordering::Relaxed),
            bytes: current.bytes() as u64,
            rebuilds: self.rebuilds.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use schema::{NamespaceId, TokenDigest};

    fn id(ns: u8, i: u32) -> BlockId {
        BlockId {
            ns: NamespaceId([ns; 16]),
            digest: TokenDigest::of(&[i]),
        }
    }

    proptest! {
        // No false negatives, whatever was inserted.
        #[test]
        fn inserted_keys_are_always_found(keys in proptest::collection::vec((0u8..4, 0u32..1_000_000), 1..500)) {
            let p = Presence::new(100);
            for &(ns, i) in &keys {
                p.insert(&id(ns, i));
            }
            for &(ns, i) in &keys {
                prop_assert!(p.may_contain(&id(ns, i)));
            }
        }
    }

    #[test]
    fn false_positives_stay_rare_up_to_capacity() {
        let n = 200_000u32;
        let p = Presence::new(n as u64 / GROWTH); // exactly n keys of capacity
        for i in 0..n {
            p.insert(&id(1, i));
        }
        assert!(!p.needs_rebuild());
        let fp = (n..n + 100_000)
            .filter(|&i| p.may_contain(&id(1, i)))
            .count();
        assert!(fp < 500, "{fp} false positives in 100k (> 0.5 %)");
        // Another namespace with the same tokens is another key.
        let other = (0..100_000).filter(|&i| p.may_contain(&id(2, i))).count();
        assert!(other < 500, "{other}");
    }

    #[test]
    fn a_rebuild_keeps_keys_inserted_during_its_scan_and_drops_stale_ones() {
        let p = Presence::new(10);
        for i in 0..1000 {
            p.insert(&id(1, i));
        }
        p.removed(500);
        let next = p.begin(500);
        p.insert(&id(1, 5000)); // committed while the scan runs
        for i in 500..1000 {
            Presence::scan_insert(&next, &id(1, i)); // the scan sees the live keys
        }
        p.finish(next, 500);
        assert!(p.may_contain(&id(1, 5000)));
        assert!((500..1000).all(|i| p.may_contain(&id(1, i))));
        let gone = (0..500).filter(|&i| p.may_contain(&id(1, i))).count();
        assert!(gone < 10, "{gone} deleted keys still present");
        // The 500 scanned, plus the one committed during the scan (not in this scan's view).
        let s = p.stats();
        assert_eq!((s.keys, s.stale, s.rebuilds), (501, 0, 1));
    }

    #[test]
    fn growth_and_deletes_ask_for_a_rebuild() {
        let p = Presence::new(0);
        let cap = p.stats().capacity;
        for i in 0..=cap as u32 {
            p.insert(&id(1, i));
        }
        assert!(p.needs_rebuild());
        let q = Presence::new(0);
        for i in 0..4000 {
            q.insert(&id(1, i));
        }
        q.removed(999);
        assert!(!q.needs_rebuild());
        q.removed(2);
        assert!(q.needs_rebuild());
    }
}
