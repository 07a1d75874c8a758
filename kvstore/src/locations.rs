//! The location cache: a bounded in-memory map from block to location record, in front of the
//! RocksDB index.
//!
//! The index stays the only durable source of truth; this cache memoizes its answers for
//! point lookups (probes and chunk gets), which otherwise cost a RocksDB `Get` each: memtable,
//! the filter of every sorted run above the one holding the key, an index-block search, a
//! block-cache lookup and a data-block search. A hit here is one hash-map lookup. Absent keys
//! are never cached: a miss falls through to RocksDB, whose bloom filters answer for absent
//! blocks.
//!
//! An entry is keyed by (namespace, token digest of the block's whole prefix): the digest
//! chains every token up to the end of the block (and each block's length), so it names the
//! block key as surely as the key itself (a collision needs a 128-bit blake3 collision), in 32
//! fixed bytes. Readers verify every record they read against the requested key and digest
//! anyway, so even a wrong entry could only produce a miss, never wrong data.
//!
//! Coherence. Writers change the index first, then call [`LocationCache::update`] for every
//! key they put, moved or deleted (a global generation is bumped first). A reader that misses
//! takes the generation before its RocksDB read and fills only if it is unchanged, checked
//! under the shard lock: a fill that read a value older than a concurrent commit is either
//! refused (the bump came first) or lands before the writer's update, which then replaces it.
//! Between a writer's commit and its update, readers may still be handed the previous
//! location, as if their read had run just before the commit; a moved record stays readable
//! there because the merger retires a segment only after its updates.
//!
//! Memory: about [`ENTRY_BYTES`] per entry (key, location, LRU links, table slot); the
//! capacity in bytes is divided into entries and spread over [`SHARDS`] LRU shards.

use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use hashlink::LruCache;
use parking_lot::Mutex;
use schema::{Location, NamespaceId, TokenDigest};

/// Shards, each its own lock and LRU (a power of two).
const SHARDS: usize = 64;
/// Estimated bytes per entry: 32 of key, 56 of location, two LRU links, the node's allocation
/// overhead and the hash table's slot.
pub(crate) const ENTRY_BYTES: usize = 136;

/// (namespace, digest of the prefix the block ends).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BlockId {
    pub ns: NamespaceId,
    pub digest: TokenDigest,
}

impl Hash for BlockId {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // The digest is a blake3 output: its bytes are already uniformly distributed. The
        // namespace is mixed in because the same tokens have the same digest in every one.
        let d = u64::from_le_bytes(self.digest.0[..8].try_into().unwrap());
        let n = u64::from_le_bytes(self.ns.0[..8].try_into().unwrap());
        state.write_u64(d ^ n.rotate_left(29));
    }
}

/// Passes a `write_u64` through: [`BlockId`]'s hash is already a good one.
#[derive(Debug, Default)]
pub(crate) struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Not used by BlockId; a fold keeps the type correct for any other caller.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ b as u64;
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

type Shard = LruCache<BlockId, Location, BuildHasherDefault<PassThrough>>;

/// See the module docs.
pub(crate) struct LocationCache {
    shards: Box<[Mutex<Shard>]>,
    per_shard: usize,
    generation: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl std::fmt::Debug for LocationCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocationCache")
            .field("capacity", &(self.per_shard * SHARDS))
            .finish_non_exhaustive()
    }
}

/// A reader's ticket for a fill: the generation it saw before reading the index.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ticket(u64);

impl LocationCache {
    /// A cache of about `bytes` (0 disables it).
    pub fn new(bytes: usize) -> Self {
        let per_shard = bytes / ENTRY_BYTES / SHARDS;
        LocationCache {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(LruCache::with_hasher(per_shard.max(1), Default::default())))
                .collect(),
            per_shard,
            generation: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    fn enabled(&self) -> bool {
        self.per_shard > 0
    }

    fn shard(&self, id: &BlockId) -> &Mutex<Shard> {
        let mut h = PassThrough::default();
        id.hash(&mut h);
        // High bits pick the shard; the table inside uses the low ones.
        &self.shards[(h.finish() >> 58) as usize & (SHARDS - 1)]
    }

    /// The cached location of `id`, if any.
    pub fn get(&self, id: &BlockId) -> Option<Location> {
        if !self.enabled() {
            return None;
        }
        let hit = self.shard(id).lock().get(id).copied();
        let c = if hit.is_some() {
            &self.hits
        } else {
            &self.misses
        };
        c.fetch_add(1, Ordering::Relaxed);
        hit
    }

    /// Taken before reading the index for a key this cache missed.
    pub fn ticket(&self) -> Ticket {
        Ticket(self.generation.load(Ordering::SeqCst))
    }

    /// Caches what the index said, unless a writer changed the index since `ticket`.
    pub fn fill(&self, ticket: Ticket, id: BlockId, loc: Location) {
        if !self.enabled() {
            return;
        }
        let mut shard = self.shard(&id).lock();
        if self.generation.load(Ordering::SeqCst) == ticket.0 {
            shard.insert(id, loc);
        }
    }

    /// Called by a writer after its index batch committed: each key now has the location
    /// given (`None`: deleted). One generation bump covers the whole batch.
    pub fn update<'a>(&self, changes: impl IntoIterator<Item = (BlockId, Option<&'a Location>)>) {
        self.generation.fetch_add(1, Ordering::SeqCst);
        if !self.enabled() {
            return;
        }
        for (id, loc) in changes {
            let mut shard = self.shard(&id).lock();
            match loc {
                Some(l) => {
                    shard.insert(id, *l);
                }
                None => {
                    shard.remove(&id);
                }
            }
        }
    }

    /// Entries it can hold.
    pub fn capacity(&self) -> usize {
        self.per_shard * SHARDS
    }

    /// Entries held now.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }

    /// (hits, misses) since open.
    pub fn counters(&self) -> (u64, u64) {
        (
            self.hits.load(Ordering::Relaxed),
            self.misses.load(Ordering::Relaxed),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use schema::{Codec, DType, KvLayout};

    fn loc(segment: u64, digest: TokenDigest) -> Location {
        Location {
            segment,
            offset: 32,
            length: 100,
            codec: Codec::None,
            layout: KvLayout {
                layers: 1,
                kv_heads: 1,
                head_dim: 8,
                dtype: DType::F16,
            },
            tokens: 4,
            digest,
            payload_crc: 7,
        }
    }

    fn id(i: u32) -> BlockId {
        BlockId {
            ns: NamespaceId([1; 16]),
            digest: TokenDigest::of(&[i]),
        }
    }

    #[test]
    fn fills_hits_updates_and_deletes() {
        let c = LocationCache::new(1 << 20);
        let t = c.ticket();
        assert_eq!(c.get(&id(1)), None);
        c.fill(t, id(1), loc(1, id(1).digest));
        assert_eq!(c.get(&id(1)).map(|l| l.segment), Some(1));
        c.update([(id(1), Some(&loc(2, id(1).digest)))]);
        assert_eq!(c.get(&id(1)).map(|l| l.segment), Some(2));
        c.update([(id(1), None)]);
        assert_eq!(c.get(&id(1)), None);
        assert_eq!(c.counters(), (2, 2));
    }

    #[test]
    fn a_fill_older_than_a_commit_is_refused() {
        let c = LocationCache::new(1 << 20);
        let t = c.ticket(); // a reader is about to read the index...
        c.update([(id(1), None)]); // ...a writer deletes the key and updates...
        c.fill(t, id(1), loc(1, id(1).digest)); // ...the reader's stale fill is dropped.
        assert_eq!(c.get(&id(1)), None);
    }

    #[test]
    fn namespaces_are_distinct_and_capacity_is_bounded() {
        let c = LocationCache::new(SHARDS * ENTRY_BYTES * 4);
        let other = BlockId {
            ns: NamespaceId([2; 16]),
            ..id(1)
        };
        let t = c.ticket();
        c.fill(t, id(1), loc(1, id(1).digest));
        assert_eq!(c.get(&other), None);
        for i in 0..10_000 {
            c.fill(t, id(i), loc(1, id(i).digest));
        }
        assert!(c.len() <= SHARDS * 4, "{}", c.len());
        let off = LocationCache::new(0);
        off.fill(off.ticket(), id(1), loc(1, id(1).digest));
        assert_eq!(off.get(&id(1)), None);
    }
}
