//! The state every data path of the store shares ([`Inner`]), the writer's state, counters, and
//! the block changes an index batch carries to the in-memory lookup tiers. Each data path adds
//! its methods to [`Inner`] in a file of its own (`open`, `log`, `write`, `read`, `delete`,
//! `evict`, `merger`, `workers`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::{Condvar, Mutex, RwLock};
use schema::{Location, NamespaceId};

use crate::error::{Error, Result};
use crate::hot::HotTier;
use crate::index::{Index, NamespaceInfo, NsMeta};
use crate::key;
use crate::locations::{BlockId, LocationCache};
use crate::options::StoreOptions;
use crate::presence::Presence;
use crate::segment::{Segment, SegmentMeta};

/// What an index batch does to one block, for the location cache and the presence filter.
#[derive(Debug, Clone, Copy)]
pub(super) enum Change {
    /// Newly stored (it was absent).
    Stored,
    /// Moved here by the merger.
    Moved(Location),
    Deleted,
}

/// The block changes that go with an index batch, applied by `Inner::commit` once the batch
/// is durable.
pub(super) type Located = Vec<(BlockId, Change)>;

/// What a run of `Inner::delete_range` calls deleted.
#[derive(Debug, Default)]
pub(super) struct Deleted {
    /// Keys deleted (each once, however the ranges overlap).
    pub keys: BTreeSet<Vec<u8>>,
    /// The same blocks, for the in-memory lookup tiers.
    pub located: Located,
}

/// State that changes only under the writer lock: segment accounting and quota bytes.
#[derive(Debug, Clone)]
pub(super) struct Writer {
    pub active: Option<u64>,
    pub metas: BTreeMap<u64, SegmentMeta>,
    pub next_id: u64,
    /// Live record bytes per namespace (quota accounting).
    pub ns_bytes: BTreeMap<NamespaceId, u64>,
    /// Tokens of the live blocks per namespace (each block's own tokens): with `ns_bytes`,
    /// the stored bytes per token a codec achieves.
    pub ns_tokens: BTreeMap<NamespaceId, u64>,
}

impl Writer {
    /// Adds `delta` record bytes and `tokens` block tokens to the namespace of block key `key`.
    pub(super) fn charge(&mut self, key: &[u8], delta: i64, tokens: i64) {
        if let Some(ns) = key::namespace_of(key) {
            let b = self.ns_bytes.entry(ns).or_insert(0);
            *b = b.saturating_add_signed(delta);
            let t = self.ns_tokens.entry(ns).or_insert(0);
            *t = t.saturating_add_signed(tokens);
        }
    }

    /// Moves a record of `len` bytes out of segment `id`'s live share into its dead share.
    pub(super) fn kill(&mut self, id: u64, len: u64) {
        if let Some(m) = self.metas.get_mut(&id) {
            m.live_bytes = m.live_bytes.saturating_sub(len);
            m.dead_bytes += len;
            m.live_records = m.live_records.saturating_sub(1);
        }
    }
}

#[derive(Debug, Default)]
pub(super) struct Counters {
    pub probes: AtomicU64,
    pub empty_probes: AtomicU64,
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub corrupt: AtomicU64,
    pub hot_hits: AtomicU64,
    pub blocks_written: AtomicU64,
    pub blocks_deduped: AtomicU64,
    pub bytes_written: AtomicU64,
    pub bytes_written_direct: AtomicU64,
    pub bytes_read: AtomicU64,
    pub bytes_read_ahead: AtomicU64,
    pub bytes_prefetched: AtomicU64,
    pub merges: AtomicU64,
    pub bytes_merged: AtomicU64,
    pub evicted_sequences: AtomicU64,
    pub evicted_bytes: AtomicU64,
    pub refused_writes: AtomicU64,
    /// Index batches that removed blocks (see `Store::removals`).
    pub removals: AtomicU64,
}

pub(super) fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

pub(super) fn get(c: &AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

pub(super) struct Inner {
    pub dir: PathBuf,
    pub seg_dir: PathBuf,
    pub opts: StoreOptions,
    pub index: Index,
    pub segments: RwLock<BTreeMap<u64, Arc<Segment>>>,
    pub writer: Mutex<Writer>,
    pub hot: HotTier,
    pub locations: LocationCache,
    pub presence: Presence,
    pub counters: Counters,
    pub namespaces: RwLock<HashMap<NamespaceId, NamespaceInfo>>,
    pub ns_meta: RwLock<HashMap<NamespaceId, NsMeta>>,
    pub access: crate::capacity::AccessLog,
    pub adaptive: crate::adaptive::Controller,
    pub poisoned: Mutex<Option<String>>,
    pub shutdown: (Mutex<bool>, Condvar),
    /// Set when the file system refused direct I/O: every append then goes through the page
    /// cache (warned once).
    pub direct_unavailable: AtomicBool,
    pub _lock: File,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

pub(super) fn io_err(path: &Path, what: &str, e: std::io::Error) -> Error {
    Error::Io(std::io::Error::new(
        e.kind(),
        format!("{what} {}: {e}", path.display()),
    ))
}

pub(super) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl Inner {
    pub(super) fn check_poisoned(&self) -> Result<()> {
        match &*self.poisoned.lock() {
            Some(why) => Err(Error::Poisoned(why.clone())),
            None => Ok(()),
        }
    }

    /// Syncs the active segment and the index's write-ahead log.
    pub(super) fn sync_now(&self) -> Result<()> {
        let active = {
            let w = self.writer.lock();
            w.active
                .and_then(|id| self.segments.read().get(&id).cloned())
        };
        if let Some(seg) = active {
            seg.file
                .sync_data()
                .map_err(|e| io_err(&seg.path, "syncing", e))?;
        }
        self.index.flush_wal()
    }

    pub(super) fn stats(&self) -> crate::Stats {
        let w = self.writer.lock();
        let c = &self.counters;
        crate::Stats {
            entries: w.metas.values().map(|m| m.live_records).sum(),
            live_bytes: w.metas.values().map(|m| m.live_bytes).sum(),
            dead_bytes: w.metas.values().map(|m| m.dead_bytes).sum(),
            segments: w
                .metas
                .iter()
                .map(|(id, m)| crate::SegmentStats {
                    id: *id,
                    len: m.len,
                    live_bytes: m.live_bytes,
                    dead_bytes: m.dead_bytes,
                    live_records: m.live_records,
                    sealed: m.sealed,
                })
                .collect(),
            namespaces: self.namespaces.read().len(),
            probes: get(&c.probes),
            empty_probes: get(&c.empty_probes),
            hits: get(&c.hits),
            misses: get(&c.misses),
            corrupt: get(&c.corrupt),
            hot_hits: get(&c.hot_hits),
            hot_bytes: self.hot.bytes() as u64,
            blocks_written: get(&c.blocks_written),
            blocks_deduped: get(&c.blocks_deduped),
            bytes_written: get(&c.bytes_written),
            bytes_written_direct: get(&c.bytes_written_direct),
            bytes_read: get(&c.bytes_read),
            bytes_read_ahead: get(&c.bytes_read_ahead),
            bytes_prefetched: get(&c.bytes_prefetched),
            merges: get(&c.merges),
            bytes_merged: get(&c.bytes_merged),
            evicted_sequences: get(&c.evicted_sequences),
            evicted_bytes: get(&c.evicted_bytes),
            refused_writes: get(&c.refused_writes),
            tuning: self.adaptive.current(),
            tuning_transitions: self.adaptive.transitions(),
            presence: self.presence.stats(),
            location_cache: {
                let (hits, misses) = self.locations.counters();
                crate::LocationCacheStats {
                    entries: self.locations.len() as u64,
                    capacity: self.locations.capacity() as u64,
                    hits,
                    misses,
                }
            },
        }
    }
}
