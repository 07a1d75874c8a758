//! Chunk KV kept on the model's device between queries (`serve.resident_mb`): the tier in
//! front of the store for the chunks queries keep retrieving.
//!
//! A chunk's stored KV costs a query a read (disk or page cache), verification, the codec's
//! decoding and, on a GPU, the host-to-device copy, every time it is retrieved. Entries here
//! hold it as the store gave it, already imported (tensors on the model's device, the store's
//! dtype, positions `0..n`), so a hit costs only what depends on the query: the conversion
//! to the cache's dtype and the keys' move to the chunk's prompt position. Bounded in bytes,
//! least recently used out first.
//!
//! Entries are never stale: stored blocks are immutable, and an entry remembers the store's
//! [`kvstore::Store::removals`] count from before its read; once blocks have been removed
//! since (a document deleted, eviction, a damaged chunk replaced), every older entry is
//! dropped at its next lookup and read again. Only chunks read from the corpus's own
//! namespace are kept (not a lossless source standing in for a codec's namespace, nor the
//! shared tier's copies: those pass through the store first).

use std::sync::atomic::{AtomicU64, Ordering};

use hashlink::LruCache;
use kvstore::NamespaceId;
use model::Kv;
use parking_lot::Mutex;

/// The tier (one per server, shared by its loading threads).
pub(crate) struct Resident {
    budget: usize,
    inner: Mutex<Inner>,
    hits: AtomicU64,
    misses: AtomicU64,
}

struct Inner {
    lru: LruCache<Key, Entry>,
    bytes: usize,
}

/// A chunk: its namespace and its tokens (compared whole: no hash collision can serve
/// another chunk's KV).
#[derive(Hash, PartialEq, Eq)]
struct Key(NamespaceId, Vec<u32>);

struct Entry {
    kv: Kv,
    bytes: usize,
    /// The store's removal count when the entry's bytes were read.
    removals: u64,
}

/// The resident tier's figures (`/v1/stats`' `resident`, and `/metrics`).
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct ResidentStats {
    /// Chunks kept.
    pub entries: usize,
    /// Their bytes.
    pub bytes: usize,
    /// `serve.resident_mb` in bytes.
    pub budget: usize,
    /// Chunk loads served from the tier.
    pub hits: u64,
    /// Chunk loads that looked and read the store.
    pub misses: u64,
}

impl ResidentStats {
    /// Prometheus text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for (name, kind, help, v) in [
            (
                "ragkv_resident_bytes",
                "gauge",
                "Chunk KV bytes kept on the model's device (serve.resident_mb).",
                self.bytes as u64,
            ),
            (
                "ragkv_resident_chunks",
                "gauge",
                "Chunks whose KV is kept on the model's device.",
                self.entries as u64,
            ),
            (
                "ragkv_resident_hits_total",
                "counter",
                "Chunk loads served from the resident tier.",
                self.hits,
            ),
            (
                "ragkv_resident_misses_total",
                "counter",
                "Chunk loads the resident tier did not hold (read from the store).",
                self.misses,
            ),
        ] {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"
            ));
        }
        out
    }
}

impl Resident {
    /// A tier of at most `budget` bytes (0: off).
    pub fn new(budget: usize) -> Resident {
        Resident {
            budget,
            inner: Mutex::new(Inner {
                lru: LruCache::new_unbounded(),
                bytes: 0,
            }),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    pub fn enabled(&self) -> bool {
        self.budget > 0
    }

    /// Bytes the tier may hold.
    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Whether the chunk is here (counting nothing, touching nothing): a chunk that is needs
    /// no read announced.
    pub fn holds(&self, ns: NamespaceId, tokens: &[u32]) -> bool {
        self.enabled()
            && self
                .inner
                .lock()
                .lru
                .contains_key(&Key(ns, tokens.to_vec()))
    }

    /// The chunk's imported KV if it is here and nothing has left the store since it was
    /// read (`removals`: the store's count now); an older entry is dropped.
    pub fn get(&self, ns: NamespaceId, tokens: &[u32], removals: u64) -> Option<Kv> {
        if !self.enabled() {
            return None;
        }
        let key = Key(ns, tokens.to_vec());
        let mut g = self.inner.lock();
        let found = match g.lru.get(&key) {
            Some(e) if e.removals == removals => Some(e.kv.clone()),
            Some(_) => {
                if let Some(e) = g.lru.remove(&key) {
                    g.bytes -= e.bytes;
                }
                None
            }
            None => None,
        };
        drop(g);
        let counter = if found.is_some() {
            &self.hits
        } else {
            &self.misses
        };
        counter.fetch_add(1, Ordering::Relaxed);
        found
    }

    /// Keeps `kv` (`bytes` of it; imported, and on a GPU settled, so that any thread may use
    /// it), read while the store's removal count was `removals`; the least recently used
    /// entries go to make room. A chunk larger than the whole budget is not kept.
    pub fn insert(&self, ns: NamespaceId, tokens: &[u32], kv: Kv, bytes: usize, removals: u64) {
        if bytes > self.budget {
            return;
        }
        let mut g = self.inner.lock();
        let entry = Entry {
            kv,
            bytes,
            removals,
        };
        if let Some(old) = g.lru.insert(Key(ns, tokens.to_vec()), entry) {
            g.bytes -= old.bytes;
        }
        g.bytes += bytes;
        while g.bytes > self.budget {
            match g.lru.remove_lru() {
                Some((_, e)) => g.bytes -= e.bytes,
                None => break,
            }
        }
    }

    /// Drops every entry (benchmarks that time cold reads).
    pub fn clear(&self) {
        let mut g = self.inner.lock();
        g.lru.clear();
        g.bytes = 0;
    }

    pub fn stats(&self) -> ResidentStats {
        let g = self.inner.lock();
        ResidentStats {
            entries: g.lru.len(),
            bytes: g.bytes,
            budget: self.budget,
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::{Device, Tensor};

    fn kv(tokens: usize) -> Kv {
        let t = Tensor::zeros((1, 1, tokens, 4), model::DType::F32, &Device::Cpu).unwrap();
        Kv::new(vec![(t.clone(), t)]).unwrap()
    }

    fn ns(b: u8) -> NamespaceId {
        NamespaceId([b; 16])
    }

    #[test]
    fn a_kept_chunk_is_found_until_blocks_leave_the_store() {
        let r = Resident::new(1000);
        assert!(r.get(ns(1), &[1, 2, 3], 0).is_none());
        r.insert(ns(1), &[1, 2, 3], kv(3), 100, 0);
        assert_eq!(r.get(ns(1), &[1, 2, 3], 0).map(|k| k.len()), Some(3));
        // Another namespace or other tokens are other chunks.
        assert!(r.get(ns(2), &[1, 2, 3], 0).is_none());
        assert!(r.get(ns(1), &[1, 2], 0).is_none());
        // Something left the store since the read: the entry is dropped, not served.
        assert!(r.get(ns(1), &[1, 2, 3], 1).is_none());
        let s = r.stats();
        assert_eq!((s.entries, s.bytes, s.hits, s.misses), (0, 0, 1, 4));
        // Read again under the new count, it is served again.
        r.insert(ns(1), &[1, 2, 3], kv(3), 100, 1);
        assert!(r.get(ns(1), &[1, 2, 3], 1).is_some());
    }

    #[test]
    fn the_least_recently_used_go_first_and_the_budget_holds() {
        let r = Resident::new(250);
        r.insert(ns(1), &[1], kv(1), 100, 0);
        r.insert(ns(1), &[2], kv(1), 100, 0);
        assert!(r.get(ns(1), &[1], 0).is_some()); // [2] is now the least recently used
        r.insert(ns(1), &[3], kv(1), 100, 0);
        assert!(r.get(ns(1), &[2], 0).is_none());
        assert!(r.get(ns(1), &[1], 0).is_some() && r.get(ns(1), &[3], 0).is_some());
        assert_eq!(r.stats().bytes, 200);
        // Replacing an entry counts its bytes once; one over the budget is never kept.
        r.insert(ns(1), &[3], kv(1), 120, 0);
        assert_eq!(r.stats().bytes, 220);
        r.insert(ns(1), &[4], kv(1), 251, 0);
        assert!(r.get(ns(1), &[4], 0).is_none());
        assert_eq!(r.stats().entries, 2);
        r.clear();
        assert_eq!((r.stats().entries, r.stats().bytes), (0, 0));
    }

    #[test]
    fn a_tier_of_no_bytes_keeps_nothing() {
        let r = Resident::new(0);
        r.insert(ns(1), &[1], kv(1), 1, 0);
        assert!(r.get(ns(1), &[1], 0).is_none());
        assert_eq!(r.stats().misses, 0);
    }
}
