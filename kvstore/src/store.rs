//! The store: a RocksDB index of small location records over append-only tensor-log segments.
//!
//! Column families of the index:
//!
//! | family     | key                                   | value                                  |
//! |------------|---------------------------------------|----------------------------------------|
//! | `kv`       | block key (`key.rs`)                  | `schema::Location`                     |
//! | `docs`     | u16 BE length, document id, seq key   | version `1`, token count u32 LE        |
//! | `seqs`     | seq key (key of a sequence's last block) | number of documents attaching it, u32 LE |
//! | `segments` | segment id u64 BE                     | `SegmentMeta` (see `segment.rs`)       |
//! | `meta`     | `ns/` + namespace id                  | namespace record (below)               |
//! | `access`   | sequence key                          | access statistics (`capacity.rs`)      |
//!
//! Namespace record, version 2 (version 1 is bytes 0..10 alone, read as group `default`):
//!
//! | bytes   | field                                   |
//! |---------|-----------------------------------------|
//! | 0       | version, `2`                            |
//! | 1..9    | `KvLayout` (`schema`)                   |
//! | 9       | codec id                                |
//! | 10..18  | registered, ms since the epoch, u64 LE  |
//! | 18..26  | last registered ("active"), ms, u64 LE  |
//! | 26      | group name length                       |
//! | 27..    | group name, UTF-8                       |
//!
//! # Point lookups
//! A block is looked up in three tiers, each answering only what it knows for sure: the
//! presence filter (`presence.rs`: "certainly absent"), the location cache (`locations.rs`: a
//! location record the index holds), then the index itself. Every commit of an index batch
//! carries its block changes ([`Located`]) to both in-memory tiers, and the read that follows
//! a location still verifies the record it finds (key, digest, checksums).
//!
//! # Writes
//! A put encodes the records of its absent blocks outside the writer lock, straight into one
//! batch buffer (for the uncompressed codec: one copy from the caller's KV, CRC32C on the way),
//! then, under the lock, appends the batch to the active segment and commits one index batch
//! (two-phase: payload first, synced by policy). Batches of at least
//! `StoreOptions::direct_write_min_bytes` are written with `O_DIRECT` from a 4 KiB-aligned
//! buffer, zero-padded to the next 4 KiB boundary (`record.rs`, padding): on the VMs we measure
//! on, the copy into the page cache was most of a buffered put (docs/BENCHMARKS.md, kvstore),
//! and a bulk load through the page cache leaves gigabytes dirty that throttle every writer.
//! Merges and small batches go through the page cache.
//!
//! # Blocking
//! Every method blocks on disk I/O (RocksDB and `pread`/`pwrite`) and must be called from a
//! blocking context (a dedicated thread or `spawn_blocking`), never from an async worker.
//! Reads take no lock beyond short map lookups; mutations serialize on one writer lock.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::{Condvar, Mutex, RwLock};
use rocksdb::{BlockBasedOptions, Cache, ColumnFamilyDescriptor, WriteBatch, WriteOptions, DB};
use schema::{Codec, KvLayout, Location, NamespaceId};

use crate::codec;
use crate::error::{Error, Result};
use crate::hot::{HotBlock, HotTier};
use crate::key::{self, BlockRef};
use crate::locations::{BlockId, LocationCache};
use crate::options::{StoreOptions, SyncPolicy};
use crate::presence::Presence;
use crate::record::{
    self, RecordHeader, ALIGN, RECORD_HEADER_LEN, RECORD_TRAILER_LEN, SEGMENT_HEADER_LEN,
};
use crate::segment::{self, Direct, Segment, SegmentMeta};

pub(crate) const CF_KV: &str = "kv";
pub(crate) const CF_DOCS: &str = "docs";
pub(crate) const CF_SEQS: &str = "seqs";
pub(crate) const CF_SEGMENTS: &str = "segments";
pub(crate) const CF_META: &str = "meta";
pub(crate) const CF_ACCESS: &str = "access";
const CFS: [&str; 6] = [CF_KV, CF_DOCS, CF_SEQS, CF_SEGMENTS, CF_META, CF_ACCESS];

/// Group of namespaces registered without one.
pub const DEFAULT_GROUP: &str = "default";

/// Largest byte range fetched with one read.
const MAX_RUN_BYTES: usize = 64 << 20;
/// Runs up to this size are read whole into a buffer and copied into place
/// ([`Inner::read_small_run`]); larger ones are read into place ([`Inner::read_large_run`]).
const SMALL_RUN_BYTES: usize = 256 << 10;

/// One sequence to store: KV for `tokens`, starting at position 0, in the layer-major layout.
#[derive(Debug, Clone, Copy)]
pub struct PutItem<'a> {
    pub tokens: &'a [u32],
    /// Layer-major KV of `tokens`. Empty: the sequence is already stored and is only
    /// attached to `doc` (an [`Error::Miss`] if any of its blocks is absent).
    pub kv: &'a [u8],
    /// Attach the sequence to this document, so `delete_document` can drop it later.
    /// Sequences stored without a document stay until deleted explicitly.
    pub doc: Option<&'a str>,
}

/// What a `put_batch` did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PutReport {
    /// Blocks appended to the tensor log.
    pub blocks_written: usize,
    /// Blocks that were already stored and not written again.
    pub blocks_present: usize,
    /// Record bytes appended.
    pub bytes_written: u64,
}

/// KV read back from the store.
#[derive(Debug, Clone, PartialEq)]
pub struct KvData {
    pub layout: KvLayout,
    pub tokens: usize,
    /// Layer-major bytes (`schema::KvLayout` docs) for `tokens` tokens.
    pub bytes: Vec<u8>,
}

/// What a delete removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeleteReport {
    /// Document sequences detached.
    pub sequences: usize,
    /// Block entries removed from the index.
    pub blocks: usize,
    /// Record bytes that became dead (reclaimed by the merger).
    pub bytes: u64,
}

/// Result of [`Store::verify`].
#[derive(Debug, Default)]
pub struct VerifyReport {
    pub entries: u64,
    pub ok: u64,
    /// Keys that failed, with the reason.
    pub failures: Vec<(Vec<u8>, Error)>,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct NamespaceInfo {
    pub layout: KvLayout,
    pub codec: Codec,
}

/// Group and lifetime of a namespace (the rest of its record).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NsMeta {
    pub group: String,
    pub registered_ms: u64,
    pub active_ms: u64,
}

/// A namespace as [`Store::namespaces`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamespaceStats {
    pub id: NamespaceId,
    pub layout: KvLayout,
    pub codec: Codec,
    pub group: String,
    /// First registered, ms since the epoch (0 for namespaces of format version 1).
    pub registered_ms: u64,
    /// Last registered: when a process last declared it its current namespace.
    pub active_ms: u64,
    /// Record bytes in the tensor log.
    pub bytes: u64,
}

/// What an index batch does to one block, for the location cache and the presence filter.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Change {
    /// Newly stored (it was absent).
    Stored,
    /// Moved here by the merger.
    Moved(Location),
    Deleted,
}

/// The block changes that go with an index batch, applied by [`Inner::commit`] once the batch
/// is durable.
pub(crate) type Located = Vec<(BlockId, Change)>;

/// What a run of [`Inner::delete_range`] calls deleted.
#[derive(Debug, Default)]
pub(crate) struct Deleted {
    /// Keys deleted (each once, however the ranges overlap).
    pub keys: BTreeSet<Vec<u8>>,
    /// The same blocks, for the in-memory lookup tiers.
    pub located: Located,
}

#[derive(Debug, Clone)]
pub(crate) struct Writer {
    pub active: Option<u64>,
    pub metas: BTreeMap<u64, SegmentMeta>,
    pub next_id: u64,
    /// Live record bytes per namespace (quota accounting).
    pub ns_bytes: BTreeMap<NamespaceId, u64>,
}

impl Writer {
    pub(crate) fn charge(&mut self, key: &[u8], delta: i64) {
        if let Some(ns) = key::namespace_of(key) {
            let b = self.ns_bytes.entry(ns).or_insert(0);
            *b = b.saturating_add_signed(delta);
        }
    }
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
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
    pub merges: AtomicU64,
    pub bytes_merged: AtomicU64,
    pub evicted_sequences: AtomicU64,
    pub evicted_bytes: AtomicU64,
    pub refused_writes: AtomicU64,
}

pub(crate) fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

pub(crate) struct Inner {
    pub dir: PathBuf,
    pub seg_dir: PathBuf,
    pub opts: StoreOptions,
    pub db: DB,
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
    /// The index's options, kept when statistics are on (tickers live there).
    pub db_opts: Option<rocksdb::Options>,
    /// Read options of probe lookups, made once (the default per call allocates a pair).
    pub probe_read: rocksdb::ReadOptions,
    /// Set when the file system refused direct I/O: every append then goes through the page
    /// cache (warned once).
    pub direct_unavailable: AtomicBool,
    _lock: File,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

/// The KV storage engine. `Send + Sync`; share it behind an `Arc`.
#[derive(Debug)]
pub struct Store {
    pub(crate) inner: Arc<Inner>,
    workers: Vec<std::thread::JoinHandle<()>>,
}

fn io_err(path: &Path, what: &str, e: std::io::Error) -> Error {
    Error::Io(std::io::Error::new(
        e.kind(),
        format!("{what} {}: {e}", path.display()),
    ))
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn doc_prefix(doc: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(2 + doc.len());
    k.extend_from_slice(&(doc.len() as u16).to_be_bytes());
    k.extend_from_slice(doc.as_bytes());
    k
}

fn ns_meta_key(ns: &NamespaceId) -> Vec<u8> {
    let mut k = b"ns/".to_vec();
    k.extend_from_slice(&ns.0);
    k
}

/// Copies block `raw` (layer-major for `n` tokens) into `out` (layer-major for `total` tokens)
/// at token offset `start`.
fn scatter(out: &mut [u8], total: usize, raw: &[u8], start: usize, n: usize, layout: &KvLayout) {
    let tb = layout.plane_token_bytes();
    for p in 0..layout.planes() {
        let dst = (p * total + start) * tb;
        let src = p * n * tb;
        out[dst..dst + n * tb].copy_from_slice(&raw[src..src + n * tb]);
    }
}

/// The inverse of [`scatter`]: the layer-major bytes of tokens `start..start + n`.
fn gather(kv: &[u8], total: usize, start: usize, n: usize, layout: &KvLayout) -> Vec<u8> {
    let mut out = Vec::with_capacity(layout.bytes_for(n));
    gather_into(&mut out, kv, total, start, n, layout);
    out
}

/// [`gather`], appending to `out`.
fn gather_into(
    out: &mut Vec<u8>,
    kv: &[u8],
    total: usize,
    start: usize,
    n: usize,
    layout: &KvLayout,
) {
    let tb = layout.plane_token_bytes();
    for p in 0..layout.planes() {
        let src = (p * total + start) * tb;
        out.extend_from_slice(&kv[src..src + n * tb]);
    }
}

/// The records of one put batch, encoded in place and laid out for a direct write: they start
/// on an [`ALIGN`] boundary in memory.
struct BatchBuf {
    v: Vec<u8>,
    /// Where the records start in `v`.
    start: usize,
}

impl BatchBuf {
    /// An empty buffer with room for `bytes` of records and their padding.
    fn with_capacity(bytes: usize) -> Self {
        let mut v: Vec<u8> = Vec::with_capacity(bytes + 2 * ALIGN);
        let start = v.as_ptr().align_offset(ALIGN);
        v.resize(start, 0);
        BatchBuf { v, start }
    }

    /// The vector records are appended to (offsets relative to [`BatchBuf::len`]).
    fn vec(&mut self) -> &mut Vec<u8> {
        &mut self.v
    }

    /// Bytes of records.
    fn len(&self) -> usize {
        self.v.len() - self.start
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn records(&self) -> &[u8] {
        &self.v[self.start..]
    }

    /// Appends zeros up to a multiple of [`ALIGN`] and returns the whole buffer, which starts
    /// on an [`ALIGN`] boundary in memory (the records are copied once if growth moved them
    /// off it). The last use of the buffer: its length now counts the padding.
    fn pad(&mut self) -> &[u8] {
        let len = self.len();
        let padded = record::align_up(len as u64) as usize;
        let aligned = (self.v.as_ptr() as usize + self.start) % ALIGN == 0;
        if !aligned || self.v.capacity() < self.start + padded {
            let mut fresh = BatchBuf::with_capacity(padded);
            fresh.v.extend_from_slice(self.records());
            *self = fresh;
        }
        // Within capacity: no reallocation, so the start stays aligned.
        self.v.resize(self.start + padded, 0);
        &self.v[self.start..]
    }
}

/// Takes an exclusive `flock` on `path`, writing our pid into it.
fn lock_dir(path: &Path) -> Result<File> {
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|e| io_err(path, "opening lock file", e))?;
    // SAFETY: flock on a valid, owned file descriptor.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let mut holder = String::new();
        let _ = f.read_to_string(&mut holder);
        return Err(Error::Locked {
            path: path.to_path_buf(),
            holder: if holder.trim().is_empty() {
                "unknown".into()
            } else {
                holder.trim().to_string()
            },
        });
    }
    f.set_len(0)
        .map_err(|e| io_err(path, "truncating lock file", e))?;
    writeln!(f, "pid {}", std::process::id()).map_err(|e| io_err(path, "writing lock file", e))?;
    Ok(f)
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_err(dir, "syncing directory", e))
}

impl Store {
    /// Opens (or creates) the store in `dir`, recovering from any crash: bytes past the last
    /// committed record are cut off, segment files the index does not know are removed, and
    /// index entries whose segment file is missing or short are dropped (and logged).
    ///
    /// `dir` holds `index/` (RocksDB), `segments/` and a lock file; a second process that
    /// opens the same directory gets [`Error::Locked`].
    pub fn open(dir: impl AsRef<Path>, opts: StoreOptions) -> Result<Store> {
        opts.validate()?;
        let dir = dir.as_ref().to_path_buf();
        let seg_dir = dir.join("segments");
        fs_err::create_dir_all(&seg_dir)?;
        let lock = lock_dir(&dir.join("kvstore.lock"))?;

        let mut db_opts = rocksdb::Options::default();
        db_opts.create_if_missing(true);
        db_opts.create_missing_column_families(true);
        db_opts.set_max_background_jobs(2);
        db_opts.set_bytes_per_sync(1 << 20);
        if opts.index_statistics || opts.adaptive.is_some() {
            db_opts.enable_statistics();
        }
        let cache = Cache::new_lru_cache(opts.index_cache_bytes);
        let cf_opts = |name: &str| {
            let mut bb = BlockBasedOptions::default();
            bb.set_block_cache(&cache);
            bb.set_bloom_filter(opts.bloom_bits_per_key, false);
            // Location records are tiny: at a million keys the filters are ~1.3 MB and the
            // index blocks ~2 MB. Held by the table readers rather than in the block cache, a
            // point lookup costs one cache lookup (the data block) instead of three per level.
            bb.set_cache_index_and_filter_blocks(false);
            let mut o = rocksdb::Options::default();
            if name == CF_KV {
                // Point lookups dominate: a hash index inside data blocks, and a whole-key
                // bloom filter in the memtable as well as in the tables.
                bb.set_data_block_index_type(rocksdb::DataBlockIndexType::BinaryAndHash);
                bb.set_data_block_hash_ratio(0.75);
                o.set_memtable_whole_key_filtering(true);
                o.set_memtable_prefix_bloom_ratio(0.1);
                o.set_compression_type(rocksdb::DBCompressionType::Lz4);
                o.set_write_buffer_size(opts.index_write_buffer_bytes);
                // Level 1 holds what L0 compacts into: the run trigger times the memtable
                // (the adaptive controller keeps this relation when it changes the trigger).
                let t = crate::Tuning::DEFAULT;
                o.set_level_zero_file_num_compaction_trigger(t.l0_trigger as i32);
                o.set_max_bytes_for_level_multiplier(t.size_ratio as f64);
                o.set_max_bytes_for_level_base(
                    t.l0_trigger as u64 * opts.index_write_buffer_bytes as u64,
                );
            }
            o.set_block_based_table_factory(&bb);
            ColumnFamilyDescriptor::new(name, o)
        };
        let index_dir = dir.join("index");
        let db = DB::open_cf_descriptors(&db_opts, &index_dir, CFS.iter().map(|n| cf_opts(n)))
            .map_err(Error::index("open"))?;

        let inner = Inner {
            seg_dir: seg_dir.clone(),
            hot: HotTier::new(opts.hot_tier_bytes),
            locations: LocationCache::new(opts.location_cache_bytes),
            presence: Presence::new(0),
            opts: opts.clone(),
            db,
            segments: RwLock::new(BTreeMap::new()),
            writer: Mutex::new(Writer {
                active: None,
                metas: BTreeMap::new(),
                next_id: 1,
                ns_bytes: BTreeMap::new(),
            }),
            counters: Counters::default(),
            namespaces: RwLock::new(HashMap::new()),
            ns_meta: RwLock::new(HashMap::new()),
            access: crate::capacity::AccessLog::default(),
            adaptive: crate::adaptive::Controller::default(),
            db_opts: (opts.index_statistics || opts.adaptive.is_some()).then_some(db_opts),
            direct_unavailable: AtomicBool::new(false),
            probe_read: rocksdb::ReadOptions::default(),
            poisoned: Mutex::new(None),
            shutdown: (Mutex::new(false), Condvar::new()),
            dir,
            _lock: lock,
        };
        inner.recover()?;
        let inner = Arc::new(inner);

        let mut workers = Vec::new();
        if opts.background_merge {
            let w = inner.clone();
            workers.push(
                std::thread::Builder::new()
                    .name("kvstore-merger".into())
                    .spawn(move || {
                        w.background(w.opts.merge.interval, |s| s.merge_once().map(drop))
                    })?,
            );
        }
        {
            // Wakes often enough to apply logged reads off the readers' threads; persists
            // statistics and sweeps every `flush_interval`.
            let w = inner.clone();
            let every = w.opts.capacity.flush_interval;
            let wake = every.min(crate::capacity::APPLY_READS_EVERY);
            let last = Mutex::new(std::time::Instant::now());
            workers.push(
                std::thread::Builder::new()
                    .name("kvstore-capacity".into())
                    .spawn(move || {
                        w.background(wake, |s| {
                            drop(s.access.lock());
                            if s.presence.needs_rebuild() {
                                s.rebuild_presence()?;
                            }
                            let mut last = last.lock();
                            if last.elapsed() >= every {
                                *last = std::time::Instant::now();
                                s.capacity_tick()?;
                            }
                            Ok(())
                        })
                    })?,
            );
        }
        if let Some(a) = &opts.adaptive {
            let (w, every) = (inner.clone(), a.interval);
            workers.push(
                std::thread::Builder::new()
                    .name("kvstore-adaptive".into())
                    .spawn(move || w.background(every, |s| s.adapt_tick()))?,
            );
        }
        if let SyncPolicy::Interval(every) = opts.sync {
            let w = inner.clone();
            workers.push(
                std::thread::Builder::new()
                    .name("kvstore-syncer".into())
                    .spawn(move || w.background(every, |s| s.sync_now()))?,
            );
        }
        Ok(Store { inner, workers })
    }

    /// Options the store was opened with.
    pub fn options(&self) -> &StoreOptions {
        &self.inner.opts
    }

    /// Registers a namespace with its layout and codec, and marks it active now (see
    /// [`NamespaceStats::active_ms`]). Idempotent for the same layout; the codec may be changed
    /// (it applies to blocks written from now on). A namespace keeps its group; a new one joins
    /// `StoreOptions::namespace_group`. A namespace that is used without registering gets
    /// `StoreOptions::default_codec`.
    pub fn register_namespace(
        &self,
        ns: NamespaceId,
        layout: KvLayout,
        codec: Codec,
    ) -> Result<()> {
        let group = self.inner.group_of(&ns);
        self.register_namespace_in(ns, layout, codec, &group)
    }

    /// [`Store::register_namespace`] into namespace group `group` (quotas apply per group).
    pub fn register_namespace_in(
        &self,
        ns: NamespaceId,
        layout: KvLayout,
        codec: Codec,
        group: &str,
    ) -> Result<()> {
        if group.is_empty() || group.len() > 255 {
            return Err(Error::Invalid {
                what: "namespace group",
                why: format!("{group:?} (must be 1..=255 bytes)"),
            });
        }
        let _w = self.inner.writer.lock();
        self.inner.check_layout(&ns, &layout)?;
        let now = now_ms();
        let registered = self
            .inner
            .ns_meta
            .read()
            .get(&ns)
            .map_or(now, |m| m.registered_ms);
        self.inner.ns_meta.write().insert(
            ns,
            NsMeta {
                group: group.to_string(),
                registered_ms: registered,
                active_ms: now,
            },
        );
        self.inner
            .write_namespace(ns, NamespaceInfo { layout, codec })
    }

    /// Every namespace with its group, lifetime and bytes, oldest first.
    pub fn namespaces(&self) -> Vec<NamespaceStats> {
        let w = self.inner.writer.lock();
        let infos = self.inner.namespaces.read();
        let metas = self.inner.ns_meta.read();
        let mut out: Vec<NamespaceStats> = infos
            .iter()
            .map(|(ns, info)| {
                let m = metas.get(ns);
                NamespaceStats {
                    id: *ns,
                    layout: info.layout,
                    codec: info.codec,
                    group: m.map_or(DEFAULT_GROUP.into(), |m| m.group.clone()),
                    registered_ms: m.map_or(0, |m| m.registered_ms),
                    active_ms: m.map_or(0, |m| m.active_ms),
                    bytes: w.ns_bytes.get(ns).copied().unwrap_or(0),
                }
            })
            .collect();
        out.sort_by_key(|n| (n.registered_ms, n.id));
        out
    }

    /// Drops a namespace: every block, document attachment and statistic under it, and its
    /// record. Space returns through the merger. Returns what was removed.
    pub fn drop_namespace(&self, ns: NamespaceId) -> Result<DeleteReport> {
        self.inner.drop_namespace(ns)
    }

    /// Record bytes held by the namespaces of `group`.
    pub fn group_bytes(&self, group: &str) -> u64 {
        let w = self.inner.writer.lock();
        self.inner.group_bytes(&w, group)
    }

    /// Access statistics of the sequence `tokens` (as stored by one put item), if known.
    pub fn access(&self, ns: NamespaceId, tokens: &[u32]) -> Option<crate::AccessInfo> {
        let blocks = key::blocks(&ns, tokens, self.inner.opts.block_tokens);
        let last = blocks.last()?;
        self.inner.access.lock().seqs.get(&last.key).copied()
    }

    /// Evicts, in policy order, until `group` holds at most `target_bytes` (ignores the water
    /// levels; for operators and tests). Returns what was evicted.
    pub fn evict(&self, group: &str, target_bytes: u64) -> Result<crate::EvictReport> {
        let mut w = self.inner.writer.lock();
        self.inner.check_poisoned()?;
        self.inner
            .evict_locked(&mut w, group, target_bytes, &[], false)
    }

    /// Runs the periodic capacity work now: persist access statistics, TTL / cost sweep.
    pub fn capacity_tick(&self) -> Result<()> {
        self.inner.capacity_tick()
    }

    /// Runs one adaptive-controller evaluation now (no-op without `StoreOptions::adaptive`).
    pub fn adapt_now(&self) -> Result<()> {
        self.inner.adapt_tick()
    }

    /// Index compaction and flush I/O since open, from RocksDB's statistics (`None` unless
    /// `index_statistics` or `adaptive` is set).
    pub fn index_io(&self) -> Option<IndexIo> {
        let o = self.inner.db_opts.as_ref()?;
        use rocksdb::statistics::Ticker;
        Some(IndexIo {
            compact_read_bytes: o.get_ticker_count(Ticker::CompactReadBytes),
            compact_write_bytes: o.get_ticker_count(Ticker::CompactWriteBytes),
            flush_write_bytes: o.get_ticker_count(Ticker::FlushWriteBytes),
        })
    }

    /// Sorted runs of the index's `kv` family: L0 files plus non-empty deeper levels.
    pub fn index_runs(&self) -> Result<u64> {
        let db = &self.inner.db;
        let cf = self.inner.cf(CF_KV);
        let prop = |p: &str| {
            db.property_int_value_cf(cf, p)
                .map_err(Error::index("property"))
                .map(|v| v.unwrap_or(0))
        };
        let mut runs = prop("rocksdb.num-files-at-level0")?;
        for l in 1..7 {
            runs += (prop(&format!("rocksdb.num-files-at-level{l}"))? > 0) as u64;
        }
        Ok(runs)
    }

    /// The layout stored under `ns`, if the namespace exists.
    pub fn namespace_layout(&self, ns: &NamespaceId) -> Option<KvLayout> {
        self.inner.namespaces.read().get(ns).map(|i| i.layout)
    }

    /// Stores KV for each item's token sequence (which starts at position 0), split into
    /// blocks of `block_tokens`. Blocks already stored are not written again. Payloads are
    /// appended (and synced per [`SyncPolicy`]) before one atomic index batch makes them
    /// visible.
    pub fn put_batch(
        &self,
        ns: NamespaceId,
        layout: KvLayout,
        items: &[PutItem<'_>],
    ) -> Result<PutReport> {
        self.inner.put_batch(ns, layout, items)
    }

    /// Length in tokens of the longest cached prefix of `tokens` (a multiple of the block
    /// size, or `tokens.len()`): a binary search over bloom-filtered point lookups.
    pub fn probe(&self, ns: NamespaceId, tokens: &[u32]) -> Result<usize> {
        self.inner.probe(ns, tokens)
    }

    /// KV of `tokens[..up_to]`, verified (checksums, key, token digest). Adjacent blocks are
    /// fetched with one read. A block that is absent or fails verification makes the whole
    /// call fail with an error for which [`Error::is_miss`] is true; bytes that did not
    /// verify are never returned.
    pub fn get_batch(&self, ns: NamespaceId, tokens: &[u32], up_to: usize) -> Result<KvData> {
        let mut bytes = Vec::new();
        let layout = self
            .inner
            .get_batch_into(ns, tokens, up_to, &mut bytes, true)?;
        Ok(KvData {
            layout,
            tokens: up_to,
            bytes,
        })
    }

    /// [`Store::get_batch`] into a caller's buffer, which is resized to fit and reused: a
    /// loader that keeps its buffers pays no allocation or page faults per read. On error the
    /// buffer's contents are unspecified.
    pub fn get_batch_into(
        &self,
        ns: NamespaceId,
        tokens: &[u32],
        up_to: usize,
        out: &mut Vec<u8>,
    ) -> Result<KvLayout> {
        self.inner.get_batch_into(ns, tokens, up_to, out, true)
    }

    /// [`Store::get_batch_into`] for maintenance (verification, re-materialization scans): the
    /// read is not counted in the sequence's access statistics, so it does not make a chunk
    /// look hot to the eviction policy.
    pub fn peek_into(
        &self,
        ns: NamespaceId,
        tokens: &[u32],
        up_to: usize,
        out: &mut Vec<u8>,
    ) -> Result<KvLayout> {
        self.inner.get_batch_into(ns, tokens, up_to, out, false)
    }

    /// Maintenance view of the sequence `tokens` (read into `out`, not counted in its access
    /// statistics): present and verified, cleanly absent (evicted or deleted: no block from
    /// the first missing one on), or damaged (a record fails verification, its segment is
    /// gone, or a block inside it is missing while later ones remain). Errors of the store
    /// itself are returned as errors.
    pub fn inspect(&self, ns: NamespaceId, tokens: &[u32], out: &mut Vec<u8>) -> Result<SeqState> {
        match self.peek_into(ns, tokens, tokens.len(), out) {
            Ok(_) => Ok(SeqState::Present),
            Err(Error::Miss { .. }) if self.probe(ns, tokens)? < tokens.len() => {
                Ok(SeqState::Absent)
            }
            Err(e) if e.is_miss() => Ok(SeqState::Damaged(e)),
            Err(e) => Err(e),
        }
    }

    /// Drops the blocks of `tokens` from the block containing token `from` on, and every
    /// cached sequence that extends them. Returns what was removed.
    pub fn delete(&self, ns: NamespaceId, tokens: &[u32], from: usize) -> Result<DeleteReport> {
        self.inner.delete_prefix_range(ns, tokens, from)
    }

    /// Detaches every sequence of `doc`, and drops the blocks no other document's sequence
    /// still uses.
    pub fn delete_document(&self, doc: &str) -> Result<DeleteReport> {
        self.inner.delete_document(doc)
    }

    /// Every document id with at least one attached sequence, sorted.
    pub fn documents(&self) -> Result<Vec<String>> {
        self.inner.documents()
    }

    /// Sequences attached to `doc`: `(namespace, token count)` for each.
    pub fn document_sequences(&self, doc: &str) -> Result<Vec<(NamespaceId, usize)>> {
        self.inner.document_sequences(doc)
    }

    /// Reads and verifies every indexed block. Failures are reported, never repaired.
    pub fn verify(&self) -> Result<VerifyReport> {
        self.inner.verify()
    }

    /// Runs one merger pass now; see [`crate::MergePolicy`].
    pub fn merge_now(&self) -> Result<crate::MergeReport> {
        self.inner.merge_once()
    }

    /// Rewrites every sealed segment that has any dead bytes (a full garbage collection).
    pub fn compact_all(&self) -> Result<crate::MergeReport> {
        self.inner.merge_all()
    }

    /// Syncs the active segment and the index WAL.
    pub fn sync(&self) -> Result<()> {
        self.inner.sync_now()
    }

    /// After a bulk load: flushes the index's memtables and waits (up to `limit`) until
    /// RocksDB has no compaction running or pending, so that reads do not compete with
    /// background compaction. Returns how long it waited.
    pub fn settle(&self, limit: Duration) -> Result<Duration> {
        let t = std::time::Instant::now();
        let db = &self.inner.db;
        for name in CFS {
            let cf = self.inner.cf(name);
            db.flush_cf(cf).map_err(Error::index("flush"))?;
        }
        loop {
            let prop = |p: &str| {
                db.property_int_value(p)
                    .map_err(Error::index("property"))
                    .map(|v| v.unwrap_or(0))
            };
            let busy = prop("rocksdb.num-running-compactions")? > 0
                || CFS.iter().try_fold(false, |acc, n| -> Result<bool> {
                    Ok(acc
                        || db
                            .property_int_value_cf(self.inner.cf(n), "rocksdb.compaction-pending")
                            .map_err(Error::index("property"))?
                            .unwrap_or(0)
                            > 0)
                })?;
            if !busy || t.elapsed() >= limit {
                return Ok(t.elapsed());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Counters and space accounting.
    pub fn stats(&self) -> crate::Stats {
        self.inner.stats()
    }

    /// Paths of the segment files, oldest first (for tools that read them directly).
    pub fn segment_paths(&self) -> Vec<PathBuf> {
        self.inner
            .segments
            .read()
            .values()
            .map(|s| s.path.clone())
            .collect()
    }

    /// The data directory.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }
}

/// What [`Store::inspect`] found.
#[derive(Debug)]
pub enum SeqState {
    Present,
    Absent,
    /// Stored but unusable; the error says why.
    Damaged(Error),
}

/// Index I/O counters (RocksDB statistics), bytes since open.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexIo {
    pub compact_read_bytes: u64,
    pub compact_write_bytes: u64,
    pub flush_write_bytes: u64,
}

impl Drop for Store {
    fn drop(&mut self) {
        *self.inner.shutdown.0.lock() = true;
        self.inner.shutdown.1.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
        if let Err(e) = self.inner.flush_access() {
            tracing::warn!(error = %e, "persisting access statistics failed");
        }
        if let Err(e) = self.inner.sync_now() {
            tracing::warn!(error = %e, "final sync failed");
        }
    }
}

impl Inner {
    pub(crate) fn cf(&self, name: &str) -> &rocksdb::ColumnFamily {
        self.db
            .cf_handle(name)
            .expect("column family created at open")
    }

    fn write_opts(&self) -> WriteOptions {
        let mut w = WriteOptions::default();
        w.set_sync(self.opts.sync == SyncPolicy::EveryBatch);
        w
    }

    pub(crate) fn check_poisoned(&self) -> Result<()> {
        match &*self.poisoned.lock() {
            Some(why) => Err(Error::Poisoned(why.clone())),
            None => Ok(()),
        }
    }

    /// Runs `f` every `every` until shutdown; a panic poisons the store.
    fn background(&self, every: Duration, f: impl Fn(&Inner) -> Result<()>) {
        loop {
            {
                let mut stop = self.shutdown.0.lock();
                if !*stop {
                    self.shutdown.1.wait_for(&mut stop, every);
                }
                if *stop {
                    return;
                }
            }
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(self))) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "background store task failed"),
                Err(_) => {
                    let why = format!(
                        "{} panicked",
                        std::thread::current().name().unwrap_or("worker")
                    );
                    tracing::error!("{why}; refusing further writes");
                    *self.poisoned.lock() = Some(why);
                    return;
                }
            }
        }
    }

    pub(crate) fn sync_now(&self) -> Result<()> {
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
        self.db.flush_wal(true).map_err(Error::index("flush wal"))
    }

    // ---------------------------------------------------------------- recovery

    fn recover(&self) -> Result<()> {
        // Namespaces.
        let mut nss = HashMap::new();
        let mut ns_metas = HashMap::new();
        for item in self.db.prefix_iterator_cf(self.cf(CF_META), b"ns/") {
            let (k, v) = item.map_err(Error::index("load namespaces"))?;
            if !k.starts_with(b"ns/") {
                break;
            }
            let ns = NamespaceId(k[3..].try_into().map_err(|_| Error::Invalid {
                what: "namespace record",
                why: format!("bad key length {}", k.len()),
            })?);
            let bad = || Error::Invalid {
                what: "namespace record",
                why: format!("unsupported encoding for {ns}"),
            };
            if v.len() < 10 || !(1..=2).contains(&v[0]) {
                return Err(bad());
            }
            let layout =
                KvLayout::decode(&v[1..9]).map_err(Error::schema(format!("namespace {ns}")))?;
            let codec = Codec::from_id(v[9]).map_err(Error::schema(format!("namespace {ns}")))?;
            nss.insert(ns, NamespaceInfo { layout, codec });
            let meta = if v[0] == 1 {
                NsMeta {
                    group: DEFAULT_GROUP.into(),
                    registered_ms: 0,
                    active_ms: 0,
                }
            } else {
                let n = *v.get(26).ok_or_else(bad)? as usize;
                let group = v.get(27..27 + n).ok_or_else(bad)?;
                NsMeta {
                    group: String::from_utf8(group.to_vec()).map_err(|_| bad())?,
                    registered_ms: u64::from_le_bytes(v[10..18].try_into().unwrap()),
                    active_ms: u64::from_le_bytes(v[18..26].try_into().unwrap()),
                }
            };
            ns_metas.insert(ns, meta);
        }
        *self.namespaces.write() = nss;
        *self.ns_meta.write() = ns_metas;

        // Segment accounting.
        let mut metas = BTreeMap::new();
        for item in self
            .db
            .iterator_cf(self.cf(CF_SEGMENTS), rocksdb::IteratorMode::Start)
        {
            let (k, v) = item.map_err(Error::index("load segments"))?;
            let id = u64::from_be_bytes(k.as_ref().try_into().map_err(|_| Error::Invalid {
                what: "segment record",
                why: format!("bad key length {}", k.len()),
            })?);
            let meta = SegmentMeta::decode(&v).map_err(|why| Error::Invalid {
                what: "segment record",
                why: format!("segment {id}: {why}"),
            })?;
            metas.insert(id, meta);
        }

        // Files on disk.
        let mut files = BTreeMap::new();
        let mut max_id = metas.keys().next_back().copied().unwrap_or(0);
        for entry in fs_err::read_dir(&self.seg_dir)? {
            let entry = entry?;
            let name = entry.file_name();
            let Some(id) = name.to_str().and_then(segment::parse_file_name) else {
                continue;
            };
            max_id = max_id.max(id);
            files.insert(id, entry.path());
        }

        // Files the index does not know: a segment created by a batch that never committed, or
        // one the merger retired before the process ended.
        for (id, path) in &files {
            if !metas.contains_key(id) {
                tracing::info!(segment = id, "removing uncommitted or retired segment file");
                fs_err::remove_file(path)?;
            }
        }

        let mut lost: HashMap<u64, u64> = HashMap::new(); // segment -> valid length
        let mut open = BTreeMap::new();
        for (id, meta) in metas.iter_mut() {
            let path = segment::path_of(&self.seg_dir, *id);
            if !files.contains_key(id) {
                tracing::error!(segment = id, path = %path.display(), "segment file missing; dropping its index entries");
                lost.insert(*id, 0);
                continue;
            }
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(|e| io_err(&path, "opening segment", e))?;
            let mut header = [0u8; SEGMENT_HEADER_LEN];
            let header_ok = file
                .read_exact_at(&mut header, 0)
                .ok()
                .and_then(|_| record::decode_segment_header(&header).ok())
                == Some(*id);
            if !header_ok {
                let aside = path.with_extension("corrupt");
                tracing::error!(
                    segment = id,
                    "segment header damaged; moving it aside to {}",
                    aside.display()
                );
                fs_err::rename(&path, &aside)?;
                lost.insert(*id, 0);
                continue;
            }
            let len = file.metadata().map_err(|e| io_err(&path, "stat", e))?.len();
            if len > meta.len {
                tracing::info!(
                    segment = id,
                    bytes = len - meta.len,
                    "reclaiming uncommitted tail"
                );
                file.set_len(meta.len)
                    .map_err(|e| io_err(&path, "truncating", e))?;
                file.sync_all().map_err(|e| io_err(&path, "syncing", e))?;
            } else if len < meta.len {
                tracing::error!(
                    segment = id,
                    committed = meta.len,
                    len,
                    "segment shorter than committed; dropping entries past its end"
                );
                lost.insert(*id, len);
                meta.len = len;
            }
            open.insert(*id, Arc::new(Segment::new(*id, path, file)));
        }

        if !lost.is_empty() {
            self.drop_lost_entries(&lost, &mut metas)?;
        }

        let active = metas
            .iter()
            .rev()
            .find(|(_, m)| !m.sealed)
            .map(|(id, _)| *id);
        *self.segments.write() = open;
        let ns_bytes = self.load_capacity()?;
        *self.writer.lock() = Writer {
            active,
            metas,
            next_id: max_id + 1,
            ns_bytes,
        };
        Ok(())
    }

    /// Bytes per namespace and the access map, from one scan of the `kv` family: statistics
    /// of sequences whose blocks are gone become non-resident, and stored sequences without
    /// statistics (leaves of the key tree) are adopted as stored now.
    fn load_capacity(&self) -> Result<BTreeMap<NamespaceId, u64>> {
        let mut access = crate::capacity::Access::default();
        for item in self
            .db
            .iterator_cf(self.cf(CF_ACCESS), rocksdb::IteratorMode::Start)
        {
            let (k, v) = item.map_err(Error::index("load access statistics"))?;
            match crate::capacity::decode_access(&v) {
                Some(s) => {
                    access.seqs.insert(k.to_vec(), s);
                }
                None => tracing::warn!("skipping an access record of an unknown format"),
            }
        }
        let mut ns_bytes: BTreeMap<NamespaceId, u64> = BTreeMap::new();
        // The same scan builds the presence filter.
        let estimate = self
            .db
            .property_int_value_cf(self.cf(CF_KV), "rocksdb.estimate-num-keys")
            .map_err(Error::index("property"))?
            .unwrap_or(0);
        let filter = self.presence.begin(estimate);
        let mut scanned = 0u64;
        let mut present: HashSet<Vec<u8>> = HashSet::new();
        let mut prev: Option<(Vec<u8>, Location)> = None;
        let now = now_ms();
        let adopt = |k: &[u8], loc: &Location, access: &mut crate::capacity::Access| {
            if !access.seqs.contains_key(k) {
                let tokens = (key::depth_of(k) * self.opts.block_tokens) as u32 + loc.tokens;
                access.stored(k, tokens, loc.layout.bytes_for(tokens as usize) as u64, now);
            }
        };
        for item in self
            .db
            .iterator_cf(self.cf(CF_KV), rocksdb::IteratorMode::Start)
        {
            let (k, v) = item.map_err(Error::index("capacity scan"))?;
            let loc = Location::decode(&v).map_err(Error::schema("location"))?;
            if let Some(ns) = key::namespace_of(&k) {
                *ns_bytes.entry(ns).or_insert(0) += loc.length as u64;
                let digest = loc.digest;
                Presence::scan_insert(&filter, &BlockId { ns, digest });
                scanned += 1;
            }
            if let Some((pk, ploc)) = prev.take() {
                if !k.starts_with(&pk) {
                    adopt(&pk, &ploc, &mut access);
                }
            }
            if access.seqs.contains_key(k.as_ref()) {
                present.insert(k.to_vec());
            }
            prev = Some((k.to_vec(), loc));
        }
        if let Some((pk, ploc)) = prev {
            adopt(&pk, &ploc, &mut access);
        }
        self.presence.finish(filter, scanned);
        for (k, s) in access.seqs.iter_mut() {
            if s.resident && !present.contains(k) && !access.dirty.contains(k) {
                s.resident = false;
                access.dirty.insert(k.clone());
            }
        }
        *self.access.lock() = access;
        Ok(ns_bytes)
    }

    /// Drops index entries that point into lost segments (or past a short segment's end).
    fn drop_lost_entries(
        &self,
        lost: &HashMap<u64, u64>,
        metas: &mut BTreeMap<u64, SegmentMeta>,
    ) -> Result<()> {
        let mut batch = WriteBatch::default();
        let mut dropped = 0u64;
        for item in self
            .db
            .iterator_cf(self.cf(CF_KV), rocksdb::IteratorMode::Start)
        {
            let (k, v) = item.map_err(Error::index("scan for lost entries"))?;
            let loc = Location::decode(&v).map_err(Error::schema("location"))?;
            if let Some(valid) = lost.get(&loc.segment) {
                if loc.offset + loc.length as u64 > *valid {
                    batch.delete_cf(self.cf(CF_KV), &k);
                    dropped += 1;
                    if let Some(m) = metas.get_mut(&loc.segment) {
                        m.live_bytes = m.live_bytes.saturating_sub(loc.length as u64);
                        m.live_records = m.live_records.saturating_sub(1);
                    }
                }
            }
        }
        for (id, valid) in lost {
            if *valid == 0 {
                metas.remove(id);
                batch.delete_cf(self.cf(CF_SEGMENTS), id.to_be_bytes());
            } else if let Some(m) = metas.get(id) {
                batch.put_cf(self.cf(CF_SEGMENTS), id.to_be_bytes(), m.encode());
            }
        }
        tracing::error!(
            entries = dropped,
            segments = lost.len(),
            "dropped index entries of lost segments"
        );
        self.db
            .write_opt(batch, &self.write_opts())
            .map_err(Error::index("drop lost entries"))
    }

    /// Rebuilds the presence filter from a scan of the index, sized for its live blocks
    /// (see `presence.rs`: blocks committed during the scan land in the new filter too).
    pub(crate) fn rebuild_presence(&self) -> Result<()> {
        let live: u64 = self
            .writer
            .lock()
            .metas
            .values()
            .map(|m| m.live_records)
            .sum();
        let t = std::time::Instant::now();
        let filter = self.presence.begin(live);
        let mut scanned = 0u64;
        let mut scan = || -> Result<()> {
            let mut it = self.db.raw_iterator_cf(self.cf(CF_KV));
            it.seek_to_first();
            while let (Some(k), Some(v)) = (it.key(), it.value()) {
                if let Some(ns) = key::namespace_of(k) {
                    let digest = Location::decode(v)
                        .map_err(Error::schema("location"))?
                        .digest;
                    Presence::scan_insert(&filter, &BlockId { ns, digest });
                    scanned += 1;
                }
                it.next();
            }
            it.status().map_err(Error::index("presence scan"))
        };
        if let Err(e) = scan() {
            self.presence.abort();
            return Err(e);
        }
        self.presence.finish(filter, scanned);
        tracing::debug!(blocks = scanned, took = ?t.elapsed(), "rebuilt the presence filter");
        Ok(())
    }

    // ---------------------------------------------------------------- namespaces

    fn check_layout(&self, ns: &NamespaceId, layout: &KvLayout) -> Result<Option<NamespaceInfo>> {
        match self.namespaces.read().get(ns) {
            Some(info) if info.layout != *layout => Err(Error::LayoutMismatch {
                ns: *ns,
                stored: info.layout,
                given: *layout,
            }),
            other => Ok(other.copied()),
        }
    }

    fn write_namespace(&self, ns: NamespaceId, info: NamespaceInfo) -> Result<()> {
        let meta = self.ns_meta.read().get(&ns).cloned().unwrap_or_else(|| {
            let now = now_ms();
            NsMeta {
                group: self.opts.namespace_group.clone(),
                registered_ms: now,
                active_ms: now,
            }
        });
        let mut v = vec![2u8];
        v.extend_from_slice(&info.layout.encode());
        v.push(info.codec.id());
        v.extend_from_slice(&meta.registered_ms.to_le_bytes());
        v.extend_from_slice(&meta.active_ms.to_le_bytes());
        v.push(meta.group.len() as u8);
        v.extend_from_slice(meta.group.as_bytes());
        self.ns_meta.write().insert(ns, meta);
        self.db
            .put_cf_opt(self.cf(CF_META), ns_meta_key(&ns), v, &self.write_opts())
            .map_err(Error::index("register namespace"))?;
        self.namespaces.write().insert(ns, info);
        Ok(())
    }

    // ---------------------------------------------------------------- writes

    /// Marks segment `id` sealed (no more appends; committed with the caller's next batch)
    /// and closes its direct-I/O descriptor.
    pub(crate) fn seal(&self, w: &mut Writer, id: u64) {
        w.metas
            .get_mut(&id)
            .expect("sealed segment has meta")
            .sealed = true;
        if let Some(seg) = self.segments.read().get(&id) {
            seg.close_direct();
        }
    }

    /// Makes sure the active segment can take `len` more bytes, rolling to a new one if not.
    /// Returns the id of a segment sealed by the roll.
    fn ensure_room(&self, w: &mut Writer, len: usize) -> Result<Option<u64>> {
        if let Some(id) = w.active {
            let m = &w.metas[&id];
            if m.len == SEGMENT_HEADER_LEN as u64 || m.len + len as u64 <= self.opts.segment_bytes {
                return Ok(None);
            }
        }
        let sealed = w.active;
        if let Some(id) = sealed {
            self.seal(w, id);
        }
        let id = w.next_id;
        w.next_id += 1;
        let path = segment::path_of(&self.seg_dir, id);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| io_err(&path, "creating segment", e))?;
        file.write_all_at(&record::encode_segment_header(id, now_ms()), 0)
            .map_err(|e| io_err(&path, "writing segment header", e))?;
        if self.opts.sync == SyncPolicy::EveryBatch {
            file.sync_all().map_err(|e| io_err(&path, "syncing", e))?;
            sync_dir(&self.seg_dir)?;
        }
        self.segments
            .write()
            .insert(id, Arc::new(Segment::new(id, path, file)));
        w.metas.insert(id, SegmentMeta::fresh());
        w.active = Some(id);
        Ok(sealed)
    }

    /// The active segment, rolled first if `len` more bytes do not fit.
    fn active_segment(&self, w: &mut Writer, len: usize) -> Result<(u64, Arc<Segment>)> {
        self.ensure_room(w, len)?;
        let id = w.active.expect("ensure_room sets an active segment");
        let seg = self
            .segments
            .read()
            .get(&id)
            .cloned()
            .expect("active segment is open");
        Ok((id, seg))
    }

    /// Syncs what was just appended to `seg`, as the sync policy says.
    fn sync_appended(&self, seg: &Segment) -> Result<()> {
        if self.opts.sync == SyncPolicy::EveryBatch {
            seg.file
                .sync_data()
                .map_err(|e| io_err(&seg.path, "syncing", e))?;
        }
        Ok(())
    }

    /// Appends `bytes` to the active segment (rolling first if needed); returns
    /// `(segment, offset)`. The caller commits an index batch through [`Inner::commit`].
    pub(crate) fn append(&self, w: &mut Writer, bytes: &[u8]) -> Result<(u64, u64)> {
        let (id, seg) = self.active_segment(w, bytes.len())?;
        let meta = w.metas.get_mut(&id).expect("active segment has meta");
        let offset = meta.len;
        seg.file
            .write_all_at(bytes, offset)
            .map_err(|e| io_err(&seg.path, "appending to", e))?;
        self.sync_appended(&seg)?;
        meta.len += bytes.len() as u64;
        Ok((id, offset))
    }

    /// Appends a batch with direct I/O: `padded` (records then zeros, see
    /// [`BatchBuf::pad`]) goes at the first [`ALIGN`] boundary at or after the active
    /// segment's end; the gap before it stays a hole. Returns `(segment, offset)` like
    /// [`Inner::append`], to which it falls back, with the first `len` bytes, where direct I/O
    /// is unavailable.
    fn append_direct(&self, w: &mut Writer, padded: &[u8], len: usize) -> Result<(u64, u64)> {
        if self.direct_unavailable.load(Ordering::Relaxed) {
            return self.append(w, &padded[..len]);
        }
        let (id, seg) = self.active_segment(w, padded.len() + ALIGN)?;
        let meta = w.metas.get_mut(&id).expect("active segment has meta");
        let offset = record::align_up(meta.len);
        if let Direct::Unavailable(why) = seg.write_direct_at(padded, offset)? {
            if !self.direct_unavailable.swap(true, Ordering::Relaxed) {
                tracing::warn!(%why, "direct I/O unavailable; writing through the page cache");
            }
            return self.append(w, &padded[..len]);
        }
        self.sync_appended(&seg)?;
        meta.len = offset + padded.len() as u64;
        bump(&self.counters.bytes_written_direct, len as u64);
        Ok((id, offset))
    }

    /// Commits `batch` plus the accounting of every segment whose meta differs from `before`,
    /// then applies `located` (the kv entries the batch stores, moves or deletes) to the
    /// presence filter and the location cache. On failure the writer state is restored to
    /// `before` and appended bytes are cut off.
    pub(crate) fn commit(
        &self,
        w: &mut Writer,
        before: Writer,
        mut batch: WriteBatch,
        located: Located,
    ) -> Result<()> {
        for (id, m) in &w.metas {
            if before.metas.get(id) != Some(m) {
                batch.put_cf(self.cf(CF_SEGMENTS), id.to_be_bytes(), m.encode());
            }
        }
        for id in before.metas.keys() {
            if !w.metas.contains_key(id) {
                batch.delete_cf(self.cf(CF_SEGMENTS), id.to_be_bytes());
            }
        }
        if let Err(e) = self.db.write_opt(batch, &self.write_opts()) {
            // Undo: cut appended bytes, forget segments created by this operation.
            let segs = self.segments.read().clone();
            for (id, m) in &before.metas {
                if let Some(seg) = segs.get(id) {
                    if w.metas.get(id).map(|n| n.len) != Some(m.len) {
                        let _ = seg.file.set_len(m.len);
                    }
                }
            }
            for id in w.metas.keys() {
                if !before.metas.contains_key(id) {
                    if let Some(seg) = self.segments.write().remove(id) {
                        seg.retire();
                    }
                }
            }
            let next_id = w.next_id;
            *w = before;
            w.next_id = next_id;
            return Err(Error::index("commit")(e));
        }
        // Blocks enter the presence filter before the caller returns (no false negative
        // for a write that completed); see `presence.rs` and `locations.rs`.
        let mut deleted = 0;
        for (id, change) in &located {
            match change {
                Change::Stored => self.presence.insert(id),
                Change::Deleted => deleted += 1,
                Change::Moved(_) => {}
            }
        }
        self.presence.removed(deleted);
        // The location cache is filled by reads only (a bulk load would otherwise push the
        // blocks being read out of it). A stored block was absent, so no entry can name it;
        // moved and deleted ones may be cached.
        let changed: Vec<_> = located
            .iter()
            .filter_map(|(id, c)| match c {
                Change::Stored => None,
                Change::Moved(l) => Some((*id, Some(l))),
                Change::Deleted => Some((*id, None)),
            })
            .collect();
        if !changed.is_empty() {
            self.locations.update(changed);
        }
        Ok(())
    }

    fn put_batch(
        &self,
        ns: NamespaceId,
        layout: KvLayout,
        items: &[PutItem<'_>],
    ) -> Result<PutReport> {
        self.check_poisoned()?;
        let info = match self.check_layout(&ns, &layout)? {
            Some(info) => info,
            None => {
                let _w = self.writer.lock();
                match self.check_layout(&ns, &layout)? {
                    Some(info) => info,
                    None => {
                        let info = NamespaceInfo {
                            layout,
                            codec: self.opts.default_codec,
                        };
                        self.write_namespace(ns, info)?;
                        info
                    }
                }
            }
        };
        let bt = self.opts.block_tokens;
        let mut plans = Vec::with_capacity(items.len());
        for item in items {
            if item.tokens.is_empty() {
                return Err(Error::Invalid {
                    what: "put_batch item",
                    why: "empty token sequence".into(),
                });
            }
            let expected = layout.bytes_for(item.tokens.len());
            // Empty KV: attach an already stored sequence to the item's document.
            if !item.kv.is_empty() && item.kv.len() != expected {
                return Err(Error::KvSize {
                    got: item.kv.len(),
                    expected,
                    tokens: item.tokens.len(),
                    layout,
                });
            }
            if let Some(doc) = item.doc {
                if doc.is_empty() || doc.len() > u16::MAX as usize {
                    return Err(Error::Invalid {
                        what: "document id",
                        why: format!("length {} (must be 1..=65535 bytes)", doc.len()),
                    });
                }
            }
            plans.push(key::blocks(&ns, item.tokens, bt));
        }

        // Encode the blocks that look absent, outside the writer lock.
        let mut seen = HashSet::new();
        let mut candidates: Vec<(usize, usize)> = Vec::new(); // (item, block)
        for (i, blocks) in plans.iter().enumerate() {
            if items[i].kv.is_empty() {
                continue;
            }
            for (j, b) in blocks.iter().enumerate() {
                if seen.insert(b.key.as_slice()) {
                    candidates.push((i, j));
                }
            }
        }
        let present = self.exists_many(ns, candidates.iter().map(|&(i, j)| &plans[i][j]))?;
        let absent: Vec<(usize, usize)> = candidates
            .iter()
            .zip(present)
            .filter(|(_, present)| !present)
            .map(|(c, _)| *c)
            .collect();
        // Exact for the uncompressed codec; a compressing one rarely outgrows it.
        let estimate = absent
            .iter()
            .map(|&(i, j)| {
                let b = &plans[i][j];
                RECORD_HEADER_LEN + b.key.len() + layout.bytes_for(b.tokens()) + RECORD_TRAILER_LEN
            })
            .sum();
        let mut out = BatchBuf::with_capacity(estimate);
        let mut encoded: Vec<(usize, usize, usize, usize, u32)> = Vec::new(); // item, block, offset, len, crc
        for (i, j) in absent {
            let b = &plans[i][j];
            let total = items[i].tokens.len();
            let raw_len = layout.bytes_for(b.tokens());
            let mut header = RecordHeader {
                codec: info.codec,
                key_len: b.key.len(),
                tokens: b.tokens() as u32,
                raw_len,
                payload_len: raw_len,
                layout,
                digest: b.digest,
            };
            let at = out.len();
            let crc = if info.codec == Codec::None {
                // Gathered straight into the batch: one copy from the caller's KV.
                record::append_record_with(out.vec(), &b.key, &header, |o| {
                    gather_into(o, items[i].kv, total, b.start, b.tokens(), &layout)
                })
            } else {
                let raw = gather(items[i].kv, total, b.start, b.tokens(), &layout);
                let payload =
                    codec::encode(info.codec, &layout, b.tokens(), &raw, self.opts.zstd_level)
                        .map_err(|why| Error::Invalid { what: "codec", why })?;
                header.payload_len = payload.len();
                record::append_record(out.vec(), &b.key, &header, &payload)
            };
            encoded.push((i, j, at, out.len() - at, crc));
        }

        let mut w = self.writer.lock();
        self.check_poisoned()?;
        // Attach-only items need every block stored already (the lock keeps them there).
        for (item, blocks) in items.iter().zip(&plans) {
            if item.kv.is_empty() {
                let present = self.exists_many(ns, blocks.iter())?;
                if let Some(first_absent) = present.iter().position(|p| !p) {
                    return Err(Error::Miss {
                        requested: item.tokens.len(),
                        cached: blocks[first_absent].start,
                    });
                }
            }
        }
        // Quota: make room (or refuse) before anything is appended. The bound counts every
        // encoded record, even one another writer stores meanwhile.
        let incoming = out.len() as u64;
        {
            let protect: Vec<&[u8]> = plans.iter().flatten().map(|b| b.key.as_slice()).collect();
            if let Err(e) = self.make_room(&mut w, &ns, incoming, &protect) {
                if matches!(e, Error::QuotaExceeded { .. }) {
                    bump(&self.counters.refused_writes, 1);
                }
                return Err(e);
            }
        }
        let before = w.clone();
        // Another writer may have stored some of them meanwhile (rare: then the batch is
        // rebuilt without them).
        let still = self.exists_many(ns, encoded.iter().map(|(i, j, ..)| &plans[*i][*j]))?;
        if still.iter().any(|p| *p) {
            let mut kept = BatchBuf::with_capacity(out.len());
            let mut kept_enc = Vec::new();
            for (&(i, j, at, len, crc), present) in encoded.iter().zip(&still) {
                if !present {
                    kept_enc.push((i, j, kept.len(), len, crc));
                    kept.vec().extend_from_slice(&out.records()[at..at + len]);
                }
            }
            out = kept;
            encoded = kept_enc;
        }
        let report = PutReport {
            blocks_written: encoded.len(),
            blocks_present: candidates.len() - encoded.len(),
            bytes_written: out.len() as u64,
        };
        let mut batch = WriteBatch::default();
        let mut located = Located::new();
        if !out.is_empty() {
            let len = out.len();
            let (seg, base) = match self.opts.direct_write_min_bytes {
                Some(min) if len >= min => self.append_direct(&mut w, out.pad(), len)?,
                _ => self.append(&mut w, out.records())?,
            };
            let meta = w.metas.get_mut(&seg).expect("segment meta");
            for &(i, j, off, len, crc) in &encoded {
                let b = &plans[i][j];
                let loc = Location {
                    segment: seg,
                    offset: base + off as u64,
                    length: len as u32,
                    codec: info.codec,
                    layout,
                    tokens: b.tokens() as u32,
                    digest: b.digest,
                    payload_crc: crc,
                };
                batch.put_cf(self.cf(CF_KV), &b.key, loc.encode());
                located.push((
                    BlockId {
                        ns,
                        digest: b.digest,
                    },
                    Change::Stored,
                ));
                meta.live_bytes += len as u64;
                meta.live_records += 1;
            }
            *w.ns_bytes.entry(ns).or_insert(0) += len as u64;
        }
        // Document bookkeeping: one reference per (document, sequence).
        let mut refs: HashMap<Vec<u8>, u32> = HashMap::new();
        let mut docs_seen = HashSet::new();
        for (item, blocks) in items.iter().zip(&plans) {
            let Some(doc) = item.doc else { continue };
            let seq = &blocks.last().expect("non-empty").key;
            let mut dk = doc_prefix(doc);
            dk.extend_from_slice(seq);
            if !docs_seen.insert(dk.clone()) || self.get(CF_DOCS, &dk)?.is_some() {
                continue;
            }
            let mut v = vec![1u8];
            v.extend_from_slice(&(item.tokens.len() as u32).to_le_bytes());
            batch.put_cf(self.cf(CF_DOCS), &dk, v);
            let r = match refs.get(seq) {
                Some(r) => *r,
                None => self.seq_refs(seq)?,
            };
            refs.insert(seq.clone(), r + 1);
        }
        for (seq, r) in &refs {
            batch.put_cf(self.cf(CF_SEQS), seq, r.to_le_bytes());
        }
        if !batch.is_empty() {
            self.commit(&mut w, before, batch, located)?;
        }
        drop(w);
        {
            let now = now_ms();
            let mut access = self.access.lock();
            for (item, blocks) in items.iter().zip(&plans) {
                let last = blocks.last().expect("non-empty");
                let n = item.tokens.len();
                access.stored(&last.key, n as u32, layout.bytes_for(n) as u64, now);
            }
        }
        bump(&self.counters.blocks_written, report.blocks_written as u64);
        bump(&self.counters.blocks_deduped, report.blocks_present as u64);
        bump(&self.counters.bytes_written, report.bytes_written);
        Ok(report)
    }

    fn get(&self, cf: &str, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.db
            .get_cf(self.cf(cf), key)
            .map_err(Error::index("get"))
    }

    fn seq_refs(&self, seq: &[u8]) -> Result<u32> {
        Ok(self
            .get(CF_SEQS, seq)?
            .and_then(|v| {
                v.get(..4)
                    .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
            })
            .unwrap_or(0))
    }

    /// Whether each block is in the index: the presence filter rules out most absent ones,
    /// the rest are looked up in one batch.
    fn exists_many<'a>(
        &self,
        ns: NamespaceId,
        blocks: impl Iterator<Item = &'a BlockRef>,
    ) -> Result<Vec<bool>> {
        let blocks: Vec<&BlockRef> = blocks.collect();
        let mut out = vec![false; blocks.len()];
        let maybe: Vec<usize> = (0..blocks.len())
            .filter(|&i| {
                let digest = blocks[i].digest;
                self.presence.may_contain(&BlockId { ns, digest })
            })
            .collect();
        let keys: Vec<&[u8]> = maybe.iter().map(|&i| blocks[i].key.as_slice()).collect();
        for (r, &i) in self
            .db
            .batched_multi_get_cf(self.cf(CF_KV), &keys, false)
            .into_iter()
            .zip(&maybe)
        {
            out[i] = r.map_err(Error::index("multi get"))?.is_some();
        }
        Ok(out)
    }

    // ---------------------------------------------------------------- reads

    fn probe(&self, ns: NamespaceId, tokens: &[u32]) -> Result<usize> {
        bump(&self.counters.probes, 1);
        // Keys are built only for lookups that reach the index.
        let blocks = key::digests(tokens, self.opts.block_tokens);
        if blocks.is_empty() {
            return Ok(0);
        }
        let cf = self.cf(CF_KV);
        let exists = |i: usize| -> Result<bool> {
            let id = BlockId {
                ns,
                digest: blocks[i].1,
            };
            if !self.presence.may_contain(&id) {
                return Ok(false);
            }
            if self.locations.get(&id).is_some() {
                return Ok(true);
            }
            let ticket = self.locations.ticket();
            let Some(v) = self
                .db
                .get_pinned_cf_opt(cf, key::key_of(&ns, &blocks[..=i]), &self.probe_read)
                .map_err(Error::index("probe"))?
            else {
                return Ok(false);
            };
            // A record that does not decode or name this block is left for reads to report.
            if let Ok(loc) = Location::decode(&v) {
                if loc.digest == id.digest {
                    self.locations.fill(ticket, id, loc);
                }
            }
            Ok(true)
        };
        // Stored sequences are prefix-closed: if block i is stored, so is every block before it.
        // The common case is a whole chunk that is cached: one lookup of its last block.
        let last = blocks.len() - 1;
        if exists(last)? {
            return Ok(blocks[last].0);
        }
        if last == 0 || !exists(0)? {
            bump(&self.counters.empty_probes, 1);
            return Ok(0);
        }
        let (mut lo, mut hi) = (0usize, last - 1);
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if exists(mid)? {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        Ok(blocks[lo].0)
    }

    fn get_batch_into(
        &self,
        ns: NamespaceId,
        tokens: &[u32],
        up_to: usize,
        out: &mut Vec<u8>,
        record: bool,
    ) -> Result<KvLayout> {
        if up_to == 0 || up_to > tokens.len() {
            return Err(Error::Invalid {
                what: "get_batch up_to",
                why: format!("{up_to} (must be 1..={})", tokens.len()),
            });
        }
        let Some(info) = self.namespaces.read().get(&ns).copied() else {
            bump(&self.counters.misses, 1);
            return Err(Error::Miss {
                requested: up_to,
                cached: 0,
            });
        };
        let blocks = key::blocks(&ns, &tokens[..up_to], self.opts.block_tokens);
        // Every byte of `out` is overwritten below; only growth needs initializing.
        let need = info.layout.bytes_for(up_to);
        if out.len() > need {
            out.truncate(need);
        } else {
            out.resize(need, 0);
        }
        let mut attempt = 0;
        loop {
            match self.read_blocks(ns, &blocks, up_to, &info.layout, out) {
                Err(Retry::Again) if attempt < 3 => {
                    // The location came from a segment retired since: ask the index again.
                    self.locations.update(blocks.iter().map(|b| {
                        let digest = b.digest;
                        (BlockId { ns, digest }, None)
                    }));
                    attempt += 1
                }
                Err(Retry::Again) => {
                    return Err(Error::Invalid {
                        what: "get_batch",
                        why: "segments kept moving under the read".into(),
                    })
                }
                Err(Retry::Fail(e)) => {
                    if e.is_miss() {
                        bump(&self.counters.misses, 1);
                        // Demand counts, hit or miss: an evicted chunk that keeps being asked
                        // for earns its way back.
                        if let Some(last) = blocks.last().filter(|_| record) {
                            self.access.read(&last.key, now_ms());
                        }
                    }
                    if matches!(e, Error::Corrupt { .. }) {
                        bump(&self.counters.corrupt, 1);
                        tracing::warn!(error = %e, "corrupt KV record served as a miss");
                    }
                    return Err(e);
                }
                Ok(()) => {
                    bump(&self.counters.hits, 1);
                    if let Some(last) = blocks.last().filter(|_| record) {
                        self.access.read(&last.key, now_ms());
                    }
                    return Ok(info.layout);
                }
            }
        }
    }

    /// Reads `blocks` into `out` (already sized for `total` tokens). Records of a run that is
    /// contiguous on disk are read with one read (`read_small_run`, `read_large_run`), and
    /// each is verified against the request and the index before its bytes count. On any
    /// error `out` holds garbage and is not returned.
    fn read_blocks(
        &self,
        ns: NamespaceId,
        blocks: &[BlockRef],
        total: usize,
        layout: &KvLayout,
        out: &mut [u8],
    ) -> std::result::Result<(), Retry> {
        let mut pending = Vec::with_capacity(blocks.len());
        for (i, b) in blocks.iter().enumerate() {
            match self.hot.get(&b.key) {
                Some(h)
                    if h.digest == b.digest && h.layout == *layout && h.tokens == b.tokens() =>
                {
                    scatter(out, total, &h.bytes, b.start, b.tokens(), layout);
                    bump(&self.counters.hot_hits, 1);
                }
                _ => pending.push(i),
            }
        }
        if pending.is_empty() {
            return Ok(());
        }
        // Locations: from the location cache, the rest with one batched index lookup.
        let id = |i: usize| BlockId {
            ns,
            digest: blocks[i].digest,
        };
        let mut cached: Vec<Option<Location>> = pending
            .iter()
            .map(|&i| self.locations.get(&id(i)))
            .collect();
        let missing: Vec<usize> = (0..pending.len())
            .filter(|&k| cached[k].is_none())
            .collect();
        if !missing.is_empty() {
            let ticket = self.locations.ticket();
            let keys: Vec<&[u8]> = missing
                .iter()
                .map(|&k| blocks[pending[k]].key.as_slice())
                .collect();
            let cf = self.cf(CF_KV);
            // A sequence's block keys are strictly increasing (each extends the one before).
            for (r, &k) in self
                .db
                .batched_multi_get_cf(cf, &keys, true)
                .into_iter()
                .zip(&missing)
            {
                let i = pending[k];
                let v = r.map_err(|e| Retry::Fail(Error::index("get_batch")(e)))?;
                // `missing` is in block order and earlier blocks were found: this is the
                // first absent one.
                let Some(v) = v else {
                    return Err(Retry::Fail(Error::Miss {
                        requested: total,
                        cached: blocks[i].start,
                    }));
                };
                let loc =
                    Location::decode(&v).map_err(|e| Retry::Fail(Error::schema("location")(e)))?;
                if loc.digest == blocks[i].digest {
                    self.locations.fill(ticket, id(i), loc);
                }
                cached[k] = Some(loc);
            }
        }
        let mut locs = Vec::with_capacity(pending.len());
        for (&i, loc) in pending.iter().zip(cached) {
            let b = &blocks[i];
            let loc = loc.expect("every location found above");
            let fixed = RECORD_HEADER_LEN + b.key.len() + RECORD_TRAILER_LEN;
            if loc.digest != b.digest
                || loc.tokens as usize != b.tokens()
                || loc.layout != *layout
                || (loc.length as usize) < fixed
            {
                return Err(Retry::Fail(Error::Corrupt {
                    segment: loc.segment,
                    offset: loc.offset,
                    what: "index entry does not match the requested tokens or layout".into(),
                }));
            }
            locs.push(loc);
        }
        // Runs of records that are adjacent in one segment: one read each.
        let mut r = 0;
        while r < pending.len() {
            let mut e = r + 1;
            let mut len = locs[r].length as usize;
            while e < pending.len()
                && locs[e].segment == locs[r].segment
                && locs[e].offset == locs[e - 1].offset + locs[e - 1].length as u64
                && len + locs[e].length as usize <= MAX_RUN_BYTES
            {
                len += locs[e].length as usize;
                e += 1;
            }
            let seg_id = locs[r].segment;
            let Some(seg) = self.segments.read().get(&seg_id).cloned() else {
                // The merger may have moved these records; their new location is in the index.
                if self.writer.lock().metas.contains_key(&seg_id) {
                    return Err(Retry::Fail(Error::SegmentMissing {
                        segment: seg_id,
                        path: segment::path_of(&self.seg_dir, seg_id),
                    }));
                }
                return Err(Retry::Again);
            };

            let read_run = if len <= SMALL_RUN_BYTES {
                Self::read_small_run
            } else {
                Self::read_large_run
            };
            read_run(
                self,
                &seg,
                &locs[r..e],
                &pending[r..e],
                blocks,
                total,
                layout,
                out,
            )?;
            bump(&self.counters.bytes_read, len as u64);
            r = e;
        }
        Ok(())
    }

    /// A run of at most [`SMALL_RUN_BYTES`]: one `pread` of the whole run into a per-thread
    /// buffer, then each record is checked there and its planes copied into place. For small
    /// records this beats reading into place: a `preadv` with a dozen small pieces per record
    /// costs the kernel more than the second copy, which runs from the CPU cache.
    #[allow(clippy::too_many_arguments)]
    fn read_small_run(
        &self,
        seg: &Segment,
        locs: &[Location],
        which: &[usize],
        blocks: &[BlockRef],
        total: usize,
        layout: &KvLayout,
        out: &mut [u8],
    ) -> std::result::Result<(), Retry> {
        thread_local! {
            static RUN: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        let len: usize = locs.iter().map(|l| l.length as usize).sum();
        RUN.with_borrow_mut(|buf| {
            // Grown once per thread; every byte used is overwritten by the read.
            if buf.len() < len {
                buf.resize(len, 0);
            }
            let buf = &mut buf[..len];
            seg.read_at(locs[0].offset, buf)
                .map_err(|e| self.read_error(e, &locs[0]))?;
            let mut at = 0;
            for (loc, &i) in locs.iter().zip(which) {
                let b = &blocks[i];
                let rec = &buf[at..at + loc.length as usize];
                at += loc.length as usize;
                let head = RECORD_HEADER_LEN + b.key.len();
                let payload = &rec[head..rec.len() - RECORD_TRAILER_LEN];
                let stored_crc =
                    u32::from_le_bytes(rec[rec.len() - RECORD_TRAILER_LEN..].try_into().unwrap());
                self.check_record(
                    loc,
                    b,
                    layout,
                    &rec[..head],
                    stored_crc,
                    crc32c::crc32c(payload),
                )?;
                self.place(loc, b, total, layout, payload, out)?;
            }
            Ok(())
        })
    }

    /// A larger run: one `preadv` whose pieces land directly in their layer-major place in
    /// `out` (headers and trailers go to a scratch buffer, compressed payloads to buffers of
    /// their own); checksums are then computed over those pieces.
    #[allow(clippy::too_many_arguments)]
    fn read_large_run(
        &self,
        seg: &Segment,
        locs: &[Location],
        which: &[usize],
        blocks: &[BlockRef],
        total: usize,
        layout: &KvLayout,
        out: &mut [u8],
    ) -> std::result::Result<(), Retry> {
        let tb = layout.plane_token_bytes();
        let planes = layout.planes();
        let mut scratch_len = 0;
        let mut side: Vec<Vec<u8>> = Vec::new(); // encoded payloads of compressed records
        for (loc, &i) in locs.iter().zip(which) {
            let fixed = RECORD_HEADER_LEN + blocks[i].key.len() + RECORD_TRAILER_LEN;
            scratch_len += fixed;
            if loc.codec != Codec::None {
                side.push(vec![0u8; loc.length as usize - fixed]);
            }
        }
        let mut scratch = vec![0u8; scratch_len];
        let mut iovs: Vec<libc::iovec> = Vec::new();
        let iov = |ptr: *mut u8, len: usize| libc::iovec {
            iov_base: ptr as *mut libc::c_void,
            iov_len: len,
        };
        {
            let (out_ptr, scratch_ptr) = (out.as_mut_ptr(), scratch.as_mut_ptr());
            let mut sc = 0;
            let mut si = 0;
            for (loc, &i) in locs.iter().zip(which) {
                let b = &blocks[i];
                let head = RECORD_HEADER_LEN + b.key.len();
                let payload = loc.length as usize - head - RECORD_TRAILER_LEN;
                if loc.codec == Codec::None && payload != layout.bytes_for(b.tokens()) {
                    return Err(Retry::Fail(Error::Corrupt {
                        segment: loc.segment,
                        offset: loc.offset,
                        what: "record length does not match its layout".into(),
                    }));
                }
                // SAFETY: every range is in bounds of its buffer (sizes computed above) and
                // the ranges are disjoint; the buffers outlive the read and are not moved.
                unsafe {
                    iovs.push(iov(scratch_ptr.add(sc), head));
                    sc += head;
                    if loc.codec == Codec::None {
                        for p in 0..planes {
                            iovs.push(iov(
                                out_ptr.add((p * total + b.start) * tb),
                                b.tokens() * tb,
                            ));
                        }
                    } else {
                        iovs.push(iov(side[si].as_mut_ptr(), payload));
                        si += 1;
                    }
                    iovs.push(iov(scratch_ptr.add(sc), RECORD_TRAILER_LEN));
                    sc += RECORD_TRAILER_LEN;
                }
            }
        }
        let len: usize = locs.iter().map(|l| l.length as usize).sum();
        seg.will_need(locs[0].offset, len);
        seg.read_vectored_at(locs[0].offset, &mut iovs)
            .map_err(|e| self.read_error(e, &locs[0]))?;

        // Verify, then decode compressed records into place.
        let mut sc = 0;
        let mut si = 0;
        for (loc, &i) in locs.iter().zip(which) {
            let b = &blocks[i];
            let head = RECORD_HEADER_LEN + b.key.len();
            let stored_crc =
                u32::from_le_bytes(scratch[sc + head..sc + head + 4].try_into().unwrap());
            let n = b.tokens();
            if loc.codec == Codec::None {
                let crc = (0..planes).fold(0u32, |crc, p| {
                    let d = (p * total + b.start) * tb;
                    crc32c::crc32c_append(crc, &out[d..d + n * tb])
                });
                self.check_record(loc, b, layout, &scratch[sc..sc + head], stored_crc, crc)?;
                self.keep_hot(b, total, layout, out);
            } else {
                let crc = crc32c::crc32c(&side[si]);
                self.check_record(loc, b, layout, &scratch[sc..sc + head], stored_crc, crc)?;
                self.place(loc, b, total, layout, &side[si], out)?;
                si += 1;
            }
            sc += head + RECORD_TRAILER_LEN;
        }
        Ok(())
    }

    /// A read of a segment failed: past its end means the index points at bytes the file
    /// does not have.
    fn read_error(&self, e: Error, first: &Location) -> Retry {
        match e {
            Error::Io(io) if io.kind() == std::io::ErrorKind::UnexpectedEof => {
                Retry::Fail(Error::Corrupt {
                    segment: first.segment,
                    offset: first.offset,
                    what: "record extends past the end of the segment".into(),
                })
            }
            e => Retry::Fail(e),
        }
    }

    /// Checks a record read for block `b` against the index entry `loc` and the request: its
    /// header (`head`: fixed part and key), both stored checksums against the computed `crc`
    /// of the encoded payload, and its shape.
    fn check_record(
        &self,
        loc: &Location,
        b: &BlockRef,
        layout: &KvLayout,
        head: &[u8],
        stored_crc: u32,
        crc: u32,
    ) -> std::result::Result<(), Retry> {
        let corrupt = |what: String| {
            Retry::Fail(Error::Corrupt {
                segment: loc.segment,
                offset: loc.offset,
                what,
            })
        };
        let (header, key) = record::decode_header(head).map_err(corrupt)?;
        if key != b.key.as_slice() {
            return Err(corrupt("record belongs to another key".into()));
        }
        if header.digest != b.digest
            || header.codec != loc.codec
            || header.record_len() != loc.length as usize
        {
            return Err(corrupt("record header differs from the index".into()));
        }
        if header.layout != *layout
            || header.tokens as usize != b.tokens()
            || header.raw_len != layout.bytes_for(b.tokens())
        {
            return Err(corrupt("record shape differs from the index".into()));
        }
        if crc != stored_crc || crc != loc.payload_crc {
            return Err(corrupt(format!(
                "payload checksum mismatch (stored {stored_crc:#010x}, index {:#010x}, computed {crc:#010x})",
                loc.payload_crc
            )));
        }
        Ok(())
    }

    /// Puts the verified, encoded `payload` of block `b` into its layer-major place in `out`.
    fn place(
        &self,
        loc: &Location,
        b: &BlockRef,
        total: usize,
        layout: &KvLayout,
        payload: &[u8],
        out: &mut [u8],
    ) -> std::result::Result<(), Retry> {
        let n = b.tokens();
        if loc.codec == Codec::None {
            if payload.len() != layout.bytes_for(n) {
                return Err(Retry::Fail(Error::Corrupt {
                    segment: loc.segment,
                    offset: loc.offset,
                    what: "record length does not match its layout".into(),
                }));
            }
            scatter(out, total, payload, b.start, n, layout);
        } else {
            let mut raw = vec![0u8; layout.bytes_for(n)];
            codec::decode_into(loc.codec, layout, n, payload, &mut raw).map_err(|e| {
                Retry::Fail(Error::Corrupt {
                    segment: loc.segment,
                    offset: loc.offset,
                    what: format!("payload does not decode: {e}"),
                })
            })?;
            scatter(out, total, &raw, b.start, n, layout);
        }
        self.keep_hot(b, total, layout, out);
        Ok(())
    }

    /// Copies block `b`, verified and in place in `out`, into the hot tier (if it has room).
    fn keep_hot(&self, b: &BlockRef, total: usize, layout: &KvLayout, out: &[u8]) {
        if self.opts.hot_tier_bytes > 0 {
            let n = b.tokens();
            self.hot.insert(
                b.key.clone(),
                Arc::new(HotBlock {
                    digest: b.digest,
                    layout: *layout,
                    tokens: n,
                    bytes: gather(out, total, b.start, n, layout),
                }),
            );
        }
    }

    fn verify(&self) -> Result<VerifyReport> {
        let mut report = VerifyReport::default();
        for item in self
            .db
            .iterator_cf(self.cf(CF_KV), rocksdb::IteratorMode::Start)
        {
            let (k, v) = item.map_err(Error::index("verify scan"))?;
            report.entries += 1;
            match self.verify_one(&k, &v) {
                Ok(()) => report.ok += 1,
                Err(e) => report.failures.push((k.to_vec(), e)),
            }
        }
        Ok(report)
    }

    fn verify_one(&self, k: &[u8], v: &[u8]) -> Result<()> {
        let loc = Location::decode(v).map_err(Error::schema("location"))?;
        let seg = self
            .segments
            .read()
            .get(&loc.segment)
            .cloned()
            .ok_or(Error::SegmentMissing {
                segment: loc.segment,
                path: segment::path_of(&self.seg_dir, loc.segment),
            })?;
        let corrupt = |what: String| Error::Corrupt {
            segment: loc.segment,
            offset: loc.offset,
            what,
        };
        let mut buf = vec![0u8; loc.length as usize];
        seg.read_at(loc.offset, &mut buf)
            .map_err(|e| corrupt(e.to_string()))?;
        let rec = record::decode_record(&buf).map_err(corrupt)?;
        if rec.key != k || rec.payload_crc != loc.payload_crc || rec.header.digest != loc.digest {
            return Err(corrupt("record does not match its index entry".into()));
        }
        let mut raw = vec![0u8; rec.header.raw_len];
        codec::decode_into(
            rec.header.codec,
            &rec.header.layout,
            rec.header.tokens as usize,
            rec.payload,
            &mut raw,
        )
        .map_err(|e| corrupt(format!("payload does not decode: {e}")))?;
        Ok(())
    }

    // ---------------------------------------------------------------- deletes

    /// Adds the deletion of every kv entry under `prefix` to `batch`.
    pub(crate) fn delete_range(
        &self,
        w: &mut Writer,
        batch: &mut WriteBatch,
        prefix: &[u8],
        done: &mut Deleted,
        report: &mut DeleteReport,
    ) -> Result<()> {
        let cf = self.cf(CF_KV);
        let mut it = self.db.raw_iterator_cf(cf);
        it.seek(prefix);
        while let (Some(k), Some(v)) = (it.key(), it.value()) {
            if !k.starts_with(prefix) {
                break;
            }
            if done.keys.insert(k.to_vec()) {
                let loc = Location::decode(v).map_err(Error::schema("location"))?;
                batch.delete_cf(cf, k);
                self.hot.remove(k);
                if let Some(ns) = key::namespace_of(k) {
                    let digest = loc.digest;
                    done.located.push((BlockId { ns, digest }, Change::Deleted));
                }
                w.charge(k, -(loc.length as i64));
                if let Some(m) = w.metas.get_mut(&loc.segment) {
                    m.live_bytes = m.live_bytes.saturating_sub(loc.length as u64);
                    m.dead_bytes += loc.length as u64;
                    m.live_records = m.live_records.saturating_sub(1);
                }
                report.blocks += 1;
                report.bytes += loc.length as u64;
            }
            it.next();
        }
        it.status().map_err(Error::index("delete scan"))
    }

    fn delete_prefix_range(
        &self,
        ns: NamespaceId,
        tokens: &[u32],
        from: usize,
    ) -> Result<DeleteReport> {
        self.check_poisoned()?;
        let blocks = key::blocks(&ns, tokens, self.opts.block_tokens);
        let first = from / self.opts.block_tokens;
        let mut report = DeleteReport::default();
        let Some(b) = blocks.get(first) else {
            return Ok(report);
        };
        let mut w = self.writer.lock();
        let before = w.clone();
        let mut batch = WriteBatch::default();
        let mut done = Deleted::default();
        self.delete_range(&mut w, &mut batch, &b.key, &mut done, &mut report)?;
        if report.blocks > 0 {
            self.forget(&mut batch, &done);
            self.commit(&mut w, before, batch, std::mem::take(&mut done.located))?;
            self.forgotten(&done);
        }
        Ok(report)
    }

    fn delete_document(&self, doc: &str) -> Result<DeleteReport> {
        self.check_poisoned()?;
        let prefix = doc_prefix(doc);
        let mut w = self.writer.lock();
        let before = w.clone();
        let mut batch = WriteBatch::default();
        let mut report = DeleteReport::default();
        let mut released = Vec::new();
        let mut removed_seqs = HashSet::new();
        for item in self.db.prefix_iterator_cf(self.cf(CF_DOCS), &prefix) {
            let (k, _) = item.map_err(Error::index("document scan"))?;
            if !k.starts_with(&prefix) {
                break;
            }
            let seq = k[prefix.len()..].to_vec();
            batch.delete_cf(self.cf(CF_DOCS), &k);
            report.sequences += 1;
            let refs = self.seq_refs(&seq)?;
            if refs > 1 {
                batch.put_cf(self.cf(CF_SEQS), &seq, (refs - 1).to_le_bytes());
            } else {
                batch.delete_cf(self.cf(CF_SEQS), &seq);
                removed_seqs.insert(seq.clone());
                released.push(seq);
            }
        }
        // A block is still needed while some attached sequence runs through it, i.e. while
        // some key in `seqs` starts with its key. Find the shallowest unneeded ancestor of each
        // released sequence and drop it with everything below it.
        let mut done = Deleted::default();
        for seq in released {
            if key::namespace_of(&seq).is_none() {
                continue;
            }
            let depth = key::depth_of(&seq);
            let mut cut = None;
            for d in (0..=depth).rev() {
                let anc = &seq[..key::NS_LEN + key::BLOCK_HASH_LEN * (d + 1)];
                if self.needed(anc, &removed_seqs)? {
                    break;
                }
                cut = Some(anc.to_vec());
            }
            if let Some(anc) = cut {
                self.delete_range(&mut w, &mut batch, &anc, &mut done, &mut report)?;
            }
        }
        if report.sequences > 0 {
            self.forget(&mut batch, &done);
            self.commit(&mut w, before, batch, std::mem::take(&mut done.located))?;
            self.forgotten(&done);
        }
        Ok(report)
    }

    /// Adds the deletion of the access statistics of deleted blocks to `batch`.
    fn forget(&self, batch: &mut WriteBatch, deleted: &Deleted) {
        let access = self.access.lock();
        for k in deleted.keys.iter().filter(|k| access.seqs.contains_key(*k)) {
            batch.delete_cf(self.cf(CF_ACCESS), k);
        }
    }

    /// Drops the in-memory statistics of deleted blocks (after their batch committed).
    fn forgotten(&self, deleted: &Deleted) {
        let mut access = self.access.lock();
        for k in &deleted.keys {
            access.seqs.remove(k);
            access.dirty.remove(k);
        }
    }

    fn drop_namespace(&self, ns: NamespaceId) -> Result<DeleteReport> {
        self.check_poisoned()?;
        let mut w = self.writer.lock();
        let before = w.clone();
        let mut batch = WriteBatch::default();
        let mut report = DeleteReport::default();
        let mut done = Deleted::default();
        self.delete_range(&mut w, &mut batch, &ns.0, &mut done, &mut report)?;
        for (cf, what) in [(CF_SEQS, "seqs scan"), (CF_ACCESS, "access scan")] {
            let mut it = self.db.raw_iterator_cf(self.cf(cf));
            it.seek(ns.0);
            while let Some(k) = it.key() {
                if !k.starts_with(&ns.0) {
                    break;
                }
                batch.delete_cf(self.cf(cf), k);
                it.next();
            }
            it.status().map_err(Error::index(what))?;
        }
        // Document attachments: `docs` is keyed by document first, so scan it all.
        let mut it = self.db.raw_iterator_cf(self.cf(CF_DOCS));
        it.seek_to_first();
        while let Some(k) = it.key() {
            let len = k
                .get(..2)
                .map_or(0, |b| u16::from_be_bytes([b[0], b[1]]) as usize);
            if k.get(2 + len..).is_some_and(|seq| seq.starts_with(&ns.0)) {
                batch.delete_cf(self.cf(CF_DOCS), k);
                report.sequences += 1;
            }
            it.next();
        }
        it.status().map_err(Error::index("docs scan"))?;
        batch.delete_cf(self.cf(CF_META), ns_meta_key(&ns));
        w.ns_bytes.remove(&ns);
        self.commit(&mut w, before, batch, done.located)?;
        self.namespaces.write().remove(&ns);
        self.ns_meta.write().remove(&ns);
        let mut access = self.access.lock();
        let keys: Vec<Vec<u8>> = access
            .seqs
            .range(ns.0.to_vec()..)
            .take_while(|(k, _)| k.starts_with(&ns.0))
            .map(|(k, _)| k.clone())
            .collect();
        for k in keys {
            access.seqs.remove(&k);
            access.dirty.remove(&k);
        }
        tracing::info!(%ns, ?report, "dropped namespace");
        Ok(report)
    }

    fn needed(&self, block_key: &[u8], removed: &HashSet<Vec<u8>>) -> Result<bool> {
        let mut it = self.db.raw_iterator_cf(self.cf(CF_SEQS));
        it.seek(block_key);
        while let Some(k) = it.key() {
            if !k.starts_with(block_key) {
                break;
            }
            if !removed.contains(k) {
                return Ok(true);
            }
            it.next();
        }
        it.status().map_err(Error::index("seqs scan"))?;
        Ok(false)
    }

    fn documents(&self) -> Result<Vec<String>> {
        let mut out: Vec<String> = Vec::new();
        let mut it = self.db.raw_iterator_cf(self.cf(CF_DOCS));
        it.seek_to_first();
        while let Some(k) = it.key() {
            let len = k
                .get(..2)
                .map_or(0, |b| u16::from_be_bytes([b[0], b[1]]) as usize);
            let Some(id) = k.get(2..2 + len) else {
                return Err(Error::Invalid {
                    what: "docs family key",
                    why: "shorter than its length prefix".into(),
                });
            };
            let id = String::from_utf8_lossy(id).into_owned();
            if out.last() != Some(&id) {
                out.push(id);
            }
            it.next();
        }
        it.status().map_err(Error::index("docs scan"))?;
        Ok(out)
    }

    fn document_sequences(&self, doc: &str) -> Result<Vec<(NamespaceId, usize)>> {
        let prefix = doc_prefix(doc);
        let mut out = Vec::new();
        for item in self.db.prefix_iterator_cf(self.cf(CF_DOCS), &prefix) {
            let (k, v) = item.map_err(Error::index("document scan"))?;
            if !k.starts_with(&prefix) {
                break;
            }
            let seq = &k[prefix.len()..];
            let Some(ns) = key::namespace_of(seq) else {
                continue;
            };
            let tokens = v
                .get(1..5)
                .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
                .unwrap_or(0);
            out.push((ns, tokens as usize));
        }
        Ok(out)
    }

    fn stats(&self) -> crate::Stats {
        let w = self.writer.lock();
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
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
            merges: get(&c.merges),
            bytes_merged: get(&c.bytes_merged),
            evicted_sequences: get(&c.evicted_sequences),
            evicted_bytes: get(&c.evicted_bytes),
            refused_writes: get(&c.refused_writes),
            tuning: self.adaptive.current(),
            tuning_transitions: get(&self.adaptive.transitions),
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

pub(crate) enum Retry {
    Again,
    Fail(Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_buffers_stay_aligned_and_zero_padded() {
        for (estimate, fill) in [(0, 1), (100, 100), (5000, 4096), (10, 20_000), (8192, 9000)] {
            let mut b = BatchBuf::with_capacity(estimate);
            // Grows past the estimate when `fill` exceeds it; `pad` realigns then.
            b.vec().extend((0..fill).map(|i| (i % 251) as u8 + 1));
            assert_eq!(b.len(), fill);
            let p = b.pad();
            assert_eq!(
                p.as_ptr() as usize % ALIGN,
                0,
                "estimate {estimate}, fill {fill}"
            );
            assert_eq!(p.len(), record::align_up(fill as u64) as usize);
            assert!(p[..fill]
                .iter()
                .enumerate()
                .all(|(i, &x)| x == (i % 251) as u8 + 1));
            assert!(p[fill..].iter().all(|&x| x == 0));
        }
    }
}
