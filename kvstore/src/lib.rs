#![deny(missing_docs)]
//! ragkv's KV-cache storage engine.
//!
//! Key-value separation in the manner of WiscKey: a RocksDB index maps block keys to small
//! location records, and the KV tensors themselves live in append-only segment files (the
//! tensor log). See `store/mod.rs` for the data paths (one file each), `index.rs` for the
//! index's families and records, `record.rs` for the on-disk record format, `key.rs` for the
//! prefix-preserving key encoding, and `capacity.rs`, `merge.rs` and `adaptive.rs` for the
//! policies of eviction, space reclamation and index tuning.
//!
//! ```no_run
//! use kvstore::{PutItem, Store, StoreOptions};
//! use schema::{DType, KvLayout, NamespaceId};
//!
//! let store = Store::open("/tmp/kv", StoreOptions::default())?;
//! let layout = KvLayout { layers: 2, kv_heads: 1, head_dim: 8, dtype: DType::F16 };
//! let ns = NamespaceId([1; 16]);
//! let tokens: Vec<u32> = (0..100).collect();
//! let kv = vec![0u8; layout.bytes_for(tokens.len())];
//! store.put_batch(ns, layout, &[PutItem { tokens: &tokens, kv: &kv, doc: Some("doc-1") }])?;
//! assert_eq!(store.probe(ns, &tokens)?, 100);
//! let back = store.get_batch(ns, &tokens, 100)?;
//! assert_eq!(back.bytes, kv);
//! # Ok::<(), kvstore::Error>(())
//! ```

mod adaptive;
mod capacity;
mod codec;
mod error;
mod hot;
mod index;
mod key;
mod locations;
mod merge;
mod options;
mod presence;
mod quant;
mod record;
mod segment;
mod store;

pub use adaptive::{AdaptiveOptions, Tuning};
pub use capacity::{AccessInfo, CapacityOptions, CostModel, EvictReport, EvictionPolicy, OnFull};
pub use codec::{decode_block, encode_block};
pub use error::{Error, Result};
pub use index::{IndexIo, DEFAULT_GROUP};
pub use merge::MergeReport;
pub use options::{MergePolicy, StoreOptions, SyncPolicy};
pub use presence::PresenceStats;
pub use schema::{Codec, DType, KvLayout, NamespaceId};
pub use store::{
    DeleteReport, KvData, NamespaceStats, PutItem, PutReport, SeqState, Store, VerifyReport,
    UNREFERENCED_DIR,
};

/// Space accounting of one segment file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentStats {
    /// Segment file id.
    pub id: u64,
    /// Committed file length in bytes.
    pub len: u64,
    /// Bytes of records the index still names.
    pub live_bytes: u64,
    /// Bytes of records deleted or replaced (reclaimed when the merger rewrites the file).
    pub dead_bytes: u64,
    /// Records the index still names.
    pub live_records: u64,
    /// No longer appended to.
    pub sealed: bool,
}

/// Counters and space accounting; counters are since open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stats {
    /// Blocks in the index.
    pub entries: u64,
    /// Live record bytes over all segments.
    pub live_bytes: u64,
    /// Dead record bytes over all segments.
    pub dead_bytes: u64,
    /// Every segment file.
    pub segments: Vec<SegmentStats>,
    /// Registered namespaces.
    pub namespaces: usize,
    /// `probe` calls.
    pub probes: u64,
    /// Probes that found not even the first block.
    pub empty_probes: u64,
    /// `get_batch` calls that returned KV.
    pub hits: u64,
    /// `get_batch` calls that returned a miss (absent, corrupt or lost).
    pub misses: u64,
    /// Reads that failed verification.
    pub corrupt: u64,
    /// Blocks served from the hot tier.
    pub hot_hits: u64,
    /// Bytes the hot tier holds.
    pub hot_bytes: u64,
    /// Blocks appended to the tensor log.
    pub blocks_written: u64,
    /// Blocks a put found already stored.
    pub blocks_deduped: u64,
    /// Record bytes appended.
    pub bytes_written: u64,
    /// Of `bytes_written`, those written with direct I/O (`StoreOptions::direct_write_min_bytes`).
    pub bytes_written_direct: u64,
    /// Bytes read from segment files.
    pub bytes_read: u64,
    /// Of `bytes_read`, those a read-ahead thread fetched while the reader decoded (encoded
    /// runs the page cache did not hold whole).
    pub bytes_read_ahead: u64,
    /// Record bytes announced to the kernel ahead of their read ([`Store::prefetch`]).
    pub bytes_prefetched: u64,
    /// Segments retired by the merger.
    pub merges: u64,
    /// Bytes the merger copied into new segments.
    pub bytes_merged: u64,
    /// Sequences evicted by the capacity policy (since open).
    pub evicted_sequences: u64,
    /// Record bytes they held.
    pub evicted_bytes: u64,
    /// Writes refused by a quota.
    pub refused_writes: u64,
    /// Index LSM parameters in force, and how often the adaptive controller changed them.
    pub tuning: Tuning,
    /// Changes of `tuning` by the adaptive controller since open.
    pub tuning_transitions: u64,
    /// The in-memory filter of every stored block (`presence.rs`).
    pub presence: PresenceStats,
    /// The in-memory cache of location records (`locations.rs`).
    pub location_cache: LocationCacheStats,
}

/// What the location cache holds; counters are since open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LocationCacheStats {
    /// Locations held.
    pub entries: u64,
    /// Most it holds.
    pub capacity: u64,
    /// Lookups it answered.
    pub hits: u64,
    /// Lookups that went to the index.
    pub misses: u64,
}

#[cfg(test)]
mod tests {
    #[test]
    fn store_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<crate::Store>();
    }
}
