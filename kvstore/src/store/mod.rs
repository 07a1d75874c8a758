//! The store: a RocksDB index of small location records over append-only tensor-log segments.
//!
//! [`Store`] is the public face; the work is done by the shared state ([`inner`]) along one
//! file per data path:
//!
//! | file            | what it does                                                          |
//! |-----------------|-----------------------------------------------------------------------|
//! | `open.rs`       | directory lock, index open, crash recovery, state rebuilt from a scan  |
//! | `namespaces.rs` | namespace layout, codec, group and lifetime                           |
//! | `write.rs`      | the put path: encode outside the lock, quota, append, commit          |
//! | `log.rs`        | segment appends (buffered and direct), rolls, the two-phase commit    |
//! | `read.rs`       | probe, get (small- and large-run reads), record verification          |
//! | `delete.rs`     | deletion of ranges, documents and namespaces; the document views      |
//! | `evict.rs`      | the capacity worker: quota room, eviction, statistics, sweeps         |
//! | `merger.rs`     | the merger worker: rewrites sparse segments, retires empty ones       |
//! | `workers.rs`    | the named background threads and their panic containment              |
//! | `planes.rs`     | layer-major copies between a sequence's KV and a block's              |
//! | `reports.rs`    | the public argument and report types                                  |
//!
//! The index's families and record layouts are documented in `index.rs`, the only module that
//! talks to RocksDB; the pure policies the workers carry out live outside this module
//! (`capacity.rs`, `merge.rs`, `adaptive.rs`), and none of them reaches into the store.
//!
//! # Blocking
//! Every method blocks on disk I/O (RocksDB and `pread`/`pwrite`) and must be called from a
//! blocking context (a dedicated thread or `spawn_blocking`), never from an async worker.
//! Reads take no lock beyond short map lookups; mutations serialize on one writer lock.

mod delete;
mod evict;
mod inner;
mod locate;
mod log;
mod merger;
mod namespaces;
mod open;
pub use open::UNREFERENCED_DIR;
mod planes;
mod read;
mod read_ahead;
mod reports;
mod verify;
mod workers;
mod write;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use schema::{Codec, KvLayout, NamespaceId};

use crate::error::{Error, Result};
use crate::index::IndexIo;
use crate::key;
use crate::options::StoreOptions;
use inner::Inner;
pub use reports::{
    DeleteReport, KvData, NamespaceStats, PutItem, PutReport, SeqState, VerifyReport,
};

/// The KV storage engine. `Send + Sync`; share it behind an `Arc`.
#[derive(Debug)]
pub struct Store {
    inner: Arc<Inner>,
    workers: Vec<std::thread::JoinHandle<()>>,
}

impl Store {
    /// Opens (or creates) the store in `dir`, recovering from any crash: bytes past the last
    /// committed record are cut off, segment files the index does not know are removed, and
    /// index entries whose segment file is missing or short are dropped (and logged).
    ///
    /// `dir` holds `index/` (RocksDB), `segments/` and a lock file; a second process that
    /// opens the same directory gets [`Error::Locked`].
    pub fn open(dir: impl AsRef<Path>, opts: StoreOptions) -> Result<Store> {
        let inner = Arc::new(Inner::open(dir.as_ref(), &opts)?);
        let workers = workers::spawn(&inner)?;
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
        self.inner.register_namespace(ns, layout, codec, group)
    }

    /// Records `note` (the caller's bytes, at most 64 KiB) with the token sequence `tokens`
    /// of `ns`, replacing an earlier one: what a stored chunk's KV was computed from beyond
    /// its own tokens (ingest records a chunk's neighbours). Kept until replaced or the
    /// namespace is dropped; deleting the sequence leaves it (a later put of the same tokens
    /// writes its own).
    pub fn put_note(&self, ns: NamespaceId, tokens: &[u32], note: &[u8]) -> Result<()> {
        if note.len() > 64 << 10 {
            return Err(Error::Invalid {
                what: "note",
                why: format!("{} bytes (at most 65536)", note.len()),
            });
        }
        let d = schema::TokenDigest::of(tokens);
        self.inner.index.put(
            crate::index::Family::Meta,
            &crate::index::note_key(&ns, Some(&d.0)),
            note,
            "put note",
        )
    }

    /// The note recorded with `tokens` of `ns` ([`Store::put_note`]), if any.
    pub fn note(&self, ns: NamespaceId, tokens: &[u32]) -> Result<Option<Vec<u8>>> {
        let d = schema::TokenDigest::of(tokens);
        self.inner.index.get(
            crate::index::Family::Meta,
            &crate::index::note_key(&ns, Some(&d.0)),
        )
    }

    /// Every namespace with its group, lifetime and bytes, oldest first.
    pub fn namespaces(&self) -> Vec<NamespaceStats> {
        self.inner.namespace_stats()
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
        self.inner.index.io()
    }

    /// Sorted runs of the index's `kv` family: L0 files plus non-empty deeper levels.
    pub fn index_runs(&self) -> Result<u64> {
        self.inner.index.kv_runs()
    }

    /// The layout stored under `ns`, if the namespace exists.
    pub fn namespace_layout(&self, ns: &NamespaceId) -> Option<KvLayout> {
        self.inner.namespaces.read().get(ns).map(|i| i.layout)
    }

    /// Stores KV for each item's token sequence (which starts at position 0), split into
    /// blocks of `block_tokens`. Blocks already stored are not written again. Payloads are
    /// appended (and synced per [`crate::SyncPolicy`]) before one atomic index batch makes them
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

    /// Announces the stored records of the whole sequence `tokens` in `ns` to the kernel, so
    /// that the disk fetches them while the caller does other work: a reader that knows what
    /// it reads next (a query's next chunk) calls this after reading the current one and
    /// before working on its bytes. Returns the bytes announced. Advisory: a sequence that is
    /// not stored whole, or whose entries do not check out, announces nothing (its read
    /// reports why); blocks the hot tier serves, and runs small enough for the kernel's own
    /// readahead (256 KiB), are left out. Only an index or I/O failure is an error.
    pub fn prefetch(&self, ns: NamespaceId, tokens: &[u32]) -> Result<u64> {
        self.inner.prefetch(ns, tokens)
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

    /// The document ids of exactly `len` bytes that start with `prefix` and have at least one
    /// attached sequence, sorted: one seek and a scan of just those (ids are keyed by length,
    /// then bytes), so a caller whose ids have a fixed-length part finds a family of ids
    /// without listing every document.
    pub fn documents_with_prefix(&self, prefix: &str, len: usize) -> Result<Vec<String>> {
        self.inner.documents_with_prefix(prefix, len)
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
        self.inner.index.flush()?;
        while self.inner.index.compacting()? && t.elapsed() < limit {
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(t.elapsed())
    }

    /// How many index batches have removed blocks since the store opened (deletes of
    /// ranges, documents and namespaces, eviction, corrupt records dropped while merging).
    /// Stored blocks are otherwise immutable (a block already stored is never written
    /// again), so a caller that keeps decoded KV of its own reads this before its read, and
    /// while it still reads the same number nothing it keeps can have left the store or been
    /// replaced.
    pub fn removals(&self) -> u64 {
        self.inner
            .counters
            .removals
            .load(std::sync::atomic::Ordering::SeqCst)
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

impl Drop for Store {
    fn drop(&mut self) {
        self.inner.stop_workers();
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
