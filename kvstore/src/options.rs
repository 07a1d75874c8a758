//! Store options. Every default is documented with its trade-off.

use std::time::Duration;

use schema::Codec;

use crate::adaptive::AdaptiveOptions;
use crate::capacity::CapacityOptions;

use crate::error::{Error, Result};

/// When appended payload bytes (and the index batch that references them) reach stable storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncPolicy {
    /// Default. `put_batch` syncs the segment (`fdatasync`) before it commits the index batch,
    /// and commits that batch with a synced WAL. When it returns, the KV survives power loss,
    /// and no index entry ever points at bytes that are not durable.
    EveryBatch,
    /// A background thread syncs the active segment and the index WAL this often. A process
    /// crash loses nothing committed; a power loss loses at most the last interval, and an
    /// index entry whose payload did not reach the disk fails its checksum: a miss, never
    /// wrong data.
    Interval(Duration),
    /// Never sync explicitly; the OS writes back when it likes. Same guarantees as `Interval`
    /// against process crashes, and no bound on power-loss window. For benchmarks and
    /// throw-away caches.
    Never,
}

/// When the background merger rewrites segments. See `merge::choose`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MergePolicy {
    /// Rewrite a sealed segment once this share of its record bytes is dead. Default 0.5:
    /// each rewrite then at least halves the segment, so write amplification stays ≤ 2.
    pub dead_ratio: f64,
    /// A sealed segment smaller than this share of `segment_bytes` counts as small. Default 0.25.
    pub small_ratio: f64,
    /// Pack all small sealed segments together once there are more than this many. Default 8;
    /// bounds the file count that deletes and restarts can leave behind.
    pub max_small_segments: usize,
    /// How often the background merger looks. Default 10 s.
    pub interval: Duration,
    /// Bytes copied per index commit while merging; the writer lock is released between
    /// steps so puts are never stalled for a whole segment. Default 8 MiB.
    pub step_bytes: usize,
}

impl Default for MergePolicy {
    fn default() -> Self {
        MergePolicy {
            dead_ratio: 0.5,
            small_ratio: 0.25,
            max_small_segments: 8,
            interval: Duration::from_secs(10),
            step_bytes: 8 << 20,
        }
    }
}

/// Options for [`crate::Store::open`].
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Tokens per block. Default 64. Smaller blocks find longer shared prefixes but cost more
    /// index entries (one per block) and probes.
    pub block_tokens: usize,
    /// Size at which the active segment is sealed and a new one started. Default 256 MiB.
    /// Larger segments mean fewer files; smaller ones make merges cheaper and finer-grained.
    pub segment_bytes: u64,
    /// Durability; default [`SyncPolicy::EveryBatch`].
    pub sync: SyncPolicy,
    /// Put batches of at least this many record bytes are written with direct I/O
    /// (`O_DIRECT`), bypassing the page cache. Default 64 KiB. The page-cache copy is most of
    /// a buffered put's cost (docs/BENCHMARKS.md, kvstore), and a bulk load through the page
    /// cache fills memory with dirty pages that throttle every writer and push hot data out.
    /// Costs: a batch starts and ends on a 4 KiB boundary of the segment (up to 4 KiB of
    /// zero padding per batch, not counted as live or dead), and freshly written KV is not in
    /// the page cache, so its first read comes from the device. Smaller batches (and merges)
    /// go through the page cache. `None`: every write does. Where the file system refuses
    /// direct I/O the store falls back to the page cache, with one warning.
    pub direct_write_min_bytes: Option<usize>,
    /// Codec for namespaces registered without one. Default [`Codec::None`]: KV in f16/bf16
    /// compresses poorly (≈10-20 % with byte planes) and decoding costs read bandwidth.
    pub default_codec: Codec,
    /// Zstandard level for the zstd codecs. Default 1 (fast).
    pub zstd_level: i32,
    /// Capacity of the in-memory hot tier of decoded blocks. Default 256 MiB; 0 disables it.
    pub hot_tier_bytes: usize,
    /// Merger policy.
    pub merge: MergePolicy,
    /// Run the merger on a background thread. Default true. `Store::merge_now` works either way.
    pub background_merge: bool,
    /// RocksDB block cache for the index's data blocks (filters and index blocks are held by
    /// the table readers, ~3.5 MB per million keys). Default 64 MiB: location records are 60
    /// bytes, so this keeps about half a million hot entries in memory.
    pub index_cache_bytes: usize,
    /// In-memory cache of location records in front of the index (`locations.rs`), 91 bytes
    /// per block. Default 64 MiB (about 730,000 blocks), filled by reads. A hit answers a
    /// probe or a block of a chunk get with one bucket lookup instead of a RocksDB point
    /// lookup (memtable, filters of every sorted run, index block, block cache, data block).
    /// 0 disables it.
    pub location_cache_bytes: usize,
    /// Bloom filter bits per key for the index. Default 20 (≈0.03 % false positives where 10
    /// gives ≈1 %): a lookup checks the filter of every sorted run above the one holding its
    /// key, and each false positive costs an index search and a data block, which set the
    /// probe tail at 10 bits (docs/BENCHMARKS.md, kvstore). ~2.5 MB per million keys.
    pub bloom_bits_per_key: f64,
    /// Memtable size of the index's `kv` family. Default 64 MiB (RocksDB's default). The
    /// adaptive controller sizes level 1 from it.
    pub index_write_buffer_bytes: usize,
    /// Keep RocksDB statistics (compaction and flush bytes, `Store::index_io`). Default false:
    /// they cost a few percent of index throughput.
    pub index_statistics: bool,
    /// Quota, water levels and eviction policy; default: no quota.
    pub capacity: CapacityOptions,
    /// The adaptive compaction controller; default `None` (RocksDB's static defaults).
    pub adaptive: Option<AdaptiveOptions>,
    /// Group that namespaces first seen by this process join (quotas apply per group).
    /// Default [`crate::DEFAULT_GROUP`].
    pub namespace_group: String,
    /// Free bytes a write must leave on the file system holding the segments; a write that
    /// would go below fails with [`crate::Error::DiskFull`] instead of filling the disk (where
    /// other writers, the vector index's memory-mapped files among them, would fail worse).
    /// Default 256 MiB; 0 disables the check.
    pub min_free_bytes: u64,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            block_tokens: 64,
            segment_bytes: 256 << 20,
            sync: SyncPolicy::EveryBatch,
            direct_write_min_bytes: Some(64 << 10),
            default_codec: Codec::None,
            zstd_level: 1,
            hot_tier_bytes: 256 << 20,
            merge: MergePolicy::default(),
            background_merge: true,
            index_cache_bytes: 64 << 20,
            location_cache_bytes: 64 << 20,
            bloom_bits_per_key: 20.0,
            index_write_buffer_bytes: 64 << 20,
            index_statistics: false,
            capacity: CapacityOptions::default(),
            adaptive: None,
            namespace_group: crate::DEFAULT_GROUP.into(),
            min_free_bytes: 256 << 20,
        }
    }
}

impl StoreOptions {
    /// Checks every option; the error names the offending one.
    pub fn validate(&self) -> Result<()> {
        let bad = |what, why: String| Err(Error::Invalid { what, why });
        if self.block_tokens == 0 || self.block_tokens > 1 << 16 {
            return bad(
                "block_tokens",
                format!("{} (must be 1..=65536)", self.block_tokens),
            );
        }
        if self.segment_bytes < 1 << 16 {
            return bad(
                "segment_bytes",
                format!("{} (must be ≥ 64 KiB)", self.segment_bytes),
            );
        }
        if !(0.0..=1.0).contains(&self.merge.dead_ratio) || self.merge.dead_ratio == 0.0 {
            return bad(
                "merge.dead_ratio",
                format!("{} (must be in (0, 1])", self.merge.dead_ratio),
            );
        }
        if !(0.0..1.0).contains(&self.merge.small_ratio) {
            return bad(
                "merge.small_ratio",
                format!("{} (must be in [0, 1))", self.merge.small_ratio),
            );
        }
        if self.merge.step_bytes == 0 {
            return bad("merge.step_bytes", "0".into());
        }
        if let SyncPolicy::Interval(d) = self.sync {
            if d.is_zero() {
                return bad("sync", "interval must be > 0".into());
            }
        }
        if self.index_write_buffer_bytes < 64 << 10 {
            return bad(
                "index_write_buffer_bytes",
                format!("{} (must be ≥ 64 KiB)", self.index_write_buffer_bytes),
            );
        }
        if self.namespace_group.is_empty() || self.namespace_group.len() > 255 {
            return bad(
                "namespace_group",
                format!("{:?} (must be 1..=255 bytes)", self.namespace_group),
            );
        }
        self.capacity.validate()?;
        if let Some(a) = &self.adaptive {
            a.validate()?;
        }
        if !(-7..=22).contains(&self.zstd_level) {
            return bad(
                "zstd_level",
                format!("{} (must be -7..=22)", self.zstd_level),
            );
        }
        Ok(())
    }
}
