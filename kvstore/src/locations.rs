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
//! Entries are filled by reads only: a put adds blocks that were absent, which no entry can
//! name, and filling on write would let a bulk load push the blocks being read out.
//!
//! Coherence. Writers change the index first, then call [`LocationCache::update`] for every
//! key they moved or deleted (a global generation is bumped first). A reader that misses
//! takes the generation before its RocksDB read and fills only if it is unchanged, checked
//! under the shard lock: a fill that read a value older than a concurrent commit is either
//! refused (the bump came first) or lands before the writer's update, which then replaces it.
//! Between a writer's commit and its update, readers may still be handed the previous
//! location, as if their read had run just before the commit; a moved record stays readable
//! there because the merger retires a segment only after its updates.
//!
//! Layout: [`SHARDS`] shards, each behind its own lock, each an array of buckets of [`WAYS`]
//! slots (set-associative, like a CPU cache): a key hashes to one bucket, whose 16-bit tags
//! sit together in one array and whose entries are stored inline, so a lookup touches the
//! tag line and the one entry it matches, and nothing is allocated per entry. A full bucket
//! evicts by CLOCK (a used bit per slot, a hand per bucket). Memory: [`entry_bytes`] per
//! entry (91 bytes).

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use schema::{Codec, DType, KvLayout, Location, NamespaceId, TokenDigest};

/// Shards, each its own lock (a power of two).
const SHARDS: usize = 64;
/// Slots per bucket.
const WAYS: usize = 8;

/// (namespace, digest of the prefix the block ends).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BlockId {
    pub ns: NamespaceId,
    pub digest: TokenDigest,
}

impl BlockId {
    /// A 64-bit hash: the digest is a blake3 output, so its bytes are already uniformly
    /// distributed; the namespace is mixed in because the same tokens have the same digest
    /// in every one.
    fn hash(&self) -> u64 {
        let d = u64::from_le_bytes(self.digest.0[..8].try_into().unwrap());
        let n = u64::from_le_bytes(self.ns.0[..8].try_into().unwrap());
        d ^ n.rotate_left(29)
    }
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    id: BlockId,
    loc: Location,
}

/// What an empty slot holds (its tag, 0, says it is empty).
const VACANT: Slot = Slot {
    id: BlockId {
        ns: NamespaceId([0; 16]),
        digest: TokenDigest([0; 16]),
    },
    loc: Location {
        segment: 0,
        offset: 0,
        length: 0,
        codec: Codec::None,
        layout: KvLayout {
            layers: 0,
            kv_heads: 0,
            head_dim: 0,
            dtype: DType::F16,
        },
        tokens: 0,
        digest: TokenDigest([0; 16]),
        payload_crc: 0,
    },
};

/// Bytes per entry: the slot, its tag, and its share of the used bits and hands.
pub(crate) fn entry_bytes() -> usize {
    std::mem::size_of::<Slot>() + 3
}

#[derive(Debug)]
struct Shard {
    /// Per bucket, the tag of each slot (0: empty).
    tags: Box<[[u16; WAYS]]>,
    /// Per bucket, a bit per slot: used since the hand last passed it.
    used: Box<[u8]>,
    /// Per bucket, the CLOCK hand.
    hand: Box<[u8]>,
    slots: Box<[[Slot; WAYS]]>,
    len: usize,
}

impl Shard {
    fn new(buckets: usize) -> Self {
        Shard {
            tags: vec![[0; WAYS]; buckets].into(),
            used: vec![0; buckets].into(),
            hand: vec![0; buckets].into(),
            slots: vec![[VACANT; WAYS]; buckets].into(),
            len: 0,
        }
    }

    /// The bucket and tag of a hash (the shard took the top bits).
    fn place(&self, h: u64) -> (usize, u16) {
        let bucket = ((h & 0xffff_ffff) * self.tags.len() as u64) >> 32;
        (bucket as usize, (h >> 32) as u16 | 1)
    }

    fn find(&self, b: usize, tag: u16, id: &BlockId) -> Option<usize> {
        (0..WAYS).find(|&w| self.tags[b][w] == tag && self.slots[b][w].id == *id)
    }

    fn get(&mut self, h: u64, id: &BlockId) -> Option<Location> {
        let (b, tag) = self.place(h);
        let w = self.find(b, tag, id)?;
        self.used[b] |= 1 << w;
        Some(self.slots[b][w].loc)
    }

    fn insert(&mut self, h: u64, id: BlockId, loc: Location) {
        let (b, tag) = self.place(h);
        let w = match self.find(b, tag, &id) {
            Some(w) => w,
            None => match (0..WAYS).find(|&w| self.tags[b][w] == 0) {
                Some(w) => {
                    self.len += 1;
                    w
                }
                // CLOCK: the first slot not used since the hand last passed goes.
                None => loop {
                    let w = self.hand[b] as usize;
                    self.hand[b] = ((w + 1) % WAYS) as u8;
                    if self.used[b] & (1 << w) == 0 {
                        break w;
                    }
                    self.used[b] &= !(1 << w);
                },
            },
        };
        self.tags[b][w] = tag;
        self.slots[b][w] = Slot { id, loc };
        self.used[b] |= 1 << w;
    }

    fn remove(&mut self, h: u64, id: &BlockId) {
        let (b, tag) = self.place(h);
        if let Some(w) = self.find(b, tag, id) {
            self.tags[b][w] = 0;
            self.used[b] &= !(1 << w);
            self.len -= 1;
        }
    }
}

/// See the module docs.
#[derive(Debug)]
pub(crate) struct LocationCache {
    shards: Box<[Mutex<Shard>]>,
    /// Buckets per shard (0: disabled).
    buckets: usize,
    generation: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
}

/// A reader's ticket for a fill: the generation it saw before reading the index.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ticket(u64);

impl LocationCache {
    /// A cache of about `bytes` (0 disables it).
    pub fn new(bytes: usize) -> Self {
        let buckets = bytes / entry_bytes() / WAYS / SHARDS;
        LocationCache {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(Shard::new(buckets)))
                .collect(),
            buckets,
            generation: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    fn enabled(&self) -> bool {
        self.buckets > 0
    }

    fn shard(&self, h: u64) -> &Mutex<Shard> {
        // The top bits pick the shard; the bucket and tag come from the others.
        &self.shards[(h >> 58) as usize & (SHARDS - 1)]
    }

    /// The cached location of `id`, if any.
    pub fn get(&self, id: &BlockId) -> Option<Location> {
        if !self.enabled() {
            return None;
        }
        let h = id.hash();
        let hit = self.shard(h).lock().get(h, id);
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
        let h = id.hash();
        let mut shard = self.shard(h).lock();
        if self.generation.load(Ordering::SeqCst) == ticket.0 {
            shard.insert(h, id, loc);
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
            let h = id.hash();
            let mut shard = self.shard(h).lock();
            match loc {
                Some(l) => shard.insert(h, id, *l),
                None => shard.remove(h, &id),
            }
        }
    }

    /// Entries it can hold.
    pub fn capacity(&self) -> usize {
        self.buckets * WAYS * SHARDS
    }

    /// Entries held now.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len).sum()
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
    fn entries_are_91_bytes() {
        assert_eq!(entry_bytes(), 91);
    }

    #[test]
    fn a_full_bucket_evicts_by_clock_and_keeps_what_was_used() {
        let mut s = Shard::new(1);
        // Distinct tags (bits 32..48), all in the one bucket.
        let h = |i: u64| i << 33;
        for i in 0..WAYS as u32 {
            s.insert(h(i as u64), id(i), loc(1, id(i).digest));
        }
        assert_eq!(s.len, WAYS);
        s.insert(h(8), id(8), loc(1, id(8).digest)); // a full sweep clears every used bit
        assert_eq!(s.get(h(0), &id(0)), None, "the hand's first slot went");
        assert!(s.get(h(3), &id(3)).is_some()); // used again
        for i in 9..12u32 {
            s.insert(h(i as u64), id(i), loc(1, id(i).digest));
        }
        assert!(
            s.get(h(3), &id(3)).is_some(),
            "a used entry gets a second chance"
        );
        for gone in [1, 2, 4] {
            assert_eq!(s.get(h(gone as u64), &id(gone)), None, "{gone}");
        }
        assert_eq!(s.len, WAYS);
        s.remove(h(3), &id(3));
        assert_eq!((s.get(h(3), &id(3)), s.len), (None, WAYS - 1));
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
        let c = LocationCache::new(SHARDS * entry_bytes() * WAYS * 4);
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
        assert_eq!(c.capacity(), SHARDS * WAYS * 4);
        assert!(c.len() <= c.capacity(), "{}", c.len());
        assert!(c.len() > c.capacity() / 2, "{}", c.len());
        let off = LocationCache::new(0);
        off.fill(off.ticket(), id(1), loc(1, id(1).digest));
        assert_eq!(off.get(&id(1)), None);
    }
}
