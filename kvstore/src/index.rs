//! The index: the one module that talks to RocksDB. It opens the database with its column
//! families, reads and writes them, and owns the layouts of every record but the `kv` family's
//! values (`schema::Location`) and keys (`key.rs`).
//!
//! | family     | key                                      | value                                    |
//! |------------|------------------------------------------|------------------------------------------|
//! | `kv`       | block key (`key.rs`)                     | `schema::Location`                       |
//! | `docs`     | u16 BE length, document id, seq key      | version `1`, token count u32 LE          |
//! | `seqs`     | seq key (key of a sequence's last block) | number of documents attaching it, u32 LE |
//! | `segments` | segment id u64 BE                        | `SegmentMeta` (see `segment.rs`)         |
//! | `meta`     | `ns/` + namespace id                     | namespace record (below)                 |
//! | `meta`     | `note/` + namespace id + token digest    | a chunk's note, the caller's bytes        |
//! | `access`   | sequence key                             | access statistics (`capacity.rs`)        |
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

use std::path::Path;

use rocksdb::{BlockBasedOptions, Cache, ColumnFamilyDescriptor, WriteBatch, WriteOptions, DB};
use schema::{Codec, KvLayout, NamespaceId};

use crate::adaptive::Tuning;
use crate::error::{Error, Result};
use crate::options::{StoreOptions, SyncPolicy};

/// Group of namespaces registered without one.
pub const DEFAULT_GROUP: &str = "default";

/// A column family of the index (table above).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Family {
    Kv,
    Docs,
    Seqs,
    Segments,
    Meta,
    Access,
}

impl Family {
    const ALL: [Family; 6] = [
        Family::Kv,
        Family::Docs,
        Family::Seqs,
        Family::Segments,
        Family::Meta,
        Family::Access,
    ];

    fn name(self) -> &'static str {
        match self {
            Family::Kv => "kv",
            Family::Docs => "docs",
            Family::Seqs => "seqs",
            Family::Segments => "segments",
            Family::Meta => "meta",
            Family::Access => "access",
        }
    }
}

/// Index I/O counters (RocksDB statistics), bytes since open.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexIo {
    /// Read by compactions.
    pub compact_read_bytes: u64,
    /// Written by compactions.
    pub compact_write_bytes: u64,
    /// Written by memtable flushes.
    pub flush_write_bytes: u64,
}

/// Changes to commit atomically with [`Index::write`].
#[derive(Default)]
pub(crate) struct Batch(WriteBatch);

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch").field("len", &self.0.len()).finish()
    }
}

/// The RocksDB index of a store.
pub(crate) struct Index {
    db: DB,
    /// The database's options, kept when statistics are on (tickers live there).
    stats: Option<rocksdb::Options>,
    /// Read options of probe lookups, made once (the default per call allocates a pair).
    probe_read: rocksdb::ReadOptions,
    /// Every batch is synced ([`SyncPolicy::EveryBatch`]).
    sync: bool,
    write_buffer_bytes: u64,
}

impl std::fmt::Debug for Index {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Index")
            .field("path", &self.db.path())
            .finish_non_exhaustive()
    }
}

impl Index {
    /// Opens (or creates) the index in `path` with every family.
    pub(crate) fn open(path: &Path, opts: &StoreOptions) -> Result<Index> {
        let mut db_opts = rocksdb::Options::default();
        db_opts.create_if_missing(true);
        db_opts.create_missing_column_families(true);
        db_opts.set_max_background_jobs(2);
        db_opts.set_bytes_per_sync(1 << 20);
        let statistics = opts.index_statistics || opts.adaptive.is_some();
        if statistics {
            db_opts.enable_statistics();
        }
        let cache = Cache::new_lru_cache(opts.index_cache_bytes);
        let cf_opts = |family: Family| {
            let mut bb = BlockBasedOptions::default();
            bb.set_block_cache(&cache);
            bb.set_bloom_filter(opts.bloom_bits_per_key, false);
            // Location records are tiny: at a million keys the filters are ~1.3 MB and the
            // index blocks ~2 MB. Held by the table readers rather than in the block cache, a
            // point lookup costs one cache lookup (the data block) instead of three per level.
            bb.set_cache_index_and_filter_blocks(false);
            let mut o = rocksdb::Options::default();
            if family == Family::Kv {
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
                let t = Tuning::DEFAULT;
                o.set_level_zero_file_num_compaction_trigger(t.l0_trigger as i32);
                o.set_max_bytes_for_level_multiplier(t.size_ratio as f64);
                o.set_max_bytes_for_level_base(
                    t.l0_trigger as u64 * opts.index_write_buffer_bytes as u64,
                );
            }
            o.set_block_based_table_factory(&bb);
            ColumnFamilyDescriptor::new(family.name(), o)
        };
        let db = DB::open_cf_descriptors(&db_opts, path, Family::ALL.map(cf_opts))
            .map_err(Error::index("open"))?;
        Ok(Index {
            db,
            stats: statistics.then_some(db_opts),
            probe_read: rocksdb::ReadOptions::default(),
            sync: opts.sync == SyncPolicy::EveryBatch,
            write_buffer_bytes: opts.index_write_buffer_bytes as u64,
        })
    }

    fn cf(&self, family: Family) -> &rocksdb::ColumnFamily {
        self.db
            .cf_handle(family.name())
            .expect("column family created at open")
    }

    /// Commits `batch` atomically, synced per the store's [`SyncPolicy`].
    pub(crate) fn write(&self, batch: Batch, op: &'static str) -> Result<()> {
        let mut w = WriteOptions::default();
        w.set_sync(self.sync);
        self.db.write_opt(batch.0, &w).map_err(Error::index(op))
    }

    /// Commits `batch` without a sync of its own (the next synced write or flush carries it).
    pub(crate) fn write_unsynced(&self, batch: Batch, op: &'static str) -> Result<()> {
        let mut w = WriteOptions::default();
        w.set_sync(false);
        self.db.write_opt(batch.0, &w).map_err(Error::index(op))
    }

    /// One entry, synced per policy.
    pub(crate) fn put(
        &self,
        family: Family,
        key: &[u8],
        value: &[u8],
        op: &'static str,
    ) -> Result<()> {
        let mut b = Batch::default();
        b.put(self, family, key, value);
        self.write(b, op)
    }

    pub(crate) fn get(&self, family: Family, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.db
            .get_cf(self.cf(family), key)
            .map_err(Error::index("get"))
    }

    /// How many documents attach the sequence whose last block key is `seq`.
    pub(crate) fn seq_refs(&self, seq: &[u8]) -> Result<u32> {
        Ok(self.get(Family::Seqs, seq)?.map_or(0, |v| decode_refs(&v)))
    }

    /// Looks up one `kv` entry for a probe (read options made once) and hands its value to
    /// `f` without copying it.
    pub(crate) fn probe_get<R>(&self, key: &[u8], f: impl FnOnce(&[u8]) -> R) -> Result<Option<R>> {
        Ok(self
            .db
            .get_pinned_cf_opt(self.cf(Family::Kv), key, &self.probe_read)
            .map_err(Error::index("probe"))?
            .map(|v| f(&v)))
    }

    /// Looks up `keys` in one batch (`sorted`: they are in key order) and calls `each` with
    /// every key's position and value, in order, until it fails.
    pub(crate) fn multi_get<E>(
        &self,
        family: Family,
        keys: &[&[u8]],
        sorted: bool,
        op: &'static str,
        mut each: impl FnMut(usize, Result<Option<&[u8]>>) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        if keys.is_empty() {
            return Ok(());
        }
        for (i, r) in self
            .db
            .batched_multi_get_cf(self.cf(family), keys, sorted)
            .into_iter()
            .enumerate()
        {
            match r {
                Ok(v) => each(i, Ok(v.as_deref()))?,
                Err(e) => each(i, Err(Error::index(op)(e)))?,
            }
        }
        Ok(())
    }

    /// Calls `each` with every entry of `family` from `start` on, in key order, while it
    /// returns `true`.
    pub(crate) fn scan(
        &self,
        family: Family,
        start: &[u8],
        op: &'static str,
        mut each: impl FnMut(&[u8], &[u8]) -> Result<bool>,
    ) -> Result<()> {
        let mut it = self.db.raw_iterator_cf(self.cf(family));
        it.seek(start);
        while let (Some(k), Some(v)) = (it.key(), it.value()) {
            if !each(k, v)? {
                return Ok(());
            }
            it.next();
        }
        it.status().map_err(Error::index(op))
    }

    /// [`Index::scan`] over the entries whose key starts with `prefix`.
    pub(crate) fn scan_prefix(
        &self,
        family: Family,
        prefix: &[u8],
        op: &'static str,
        mut each: impl FnMut(&[u8], &[u8]) -> Result<()>,
    ) -> Result<()> {
        self.scan(family, prefix, op, |k, v| {
            if !k.starts_with(prefix) {
                return Ok(false);
            }
            each(k, v)?;
            Ok(true)
        })
    }

    /// An integer property of the `kv` family (0 when RocksDB has none).
    pub(crate) fn kv_property(&self, name: &str) -> Result<u64> {
        Ok(self
            .db
            .property_int_value_cf(self.cf(Family::Kv), name)
            .map_err(Error::index("property"))?
            .unwrap_or(0))
    }

    /// Flushes every family's memtable.
    pub(crate) fn flush(&self) -> Result<()> {
        for f in Family::ALL {
            self.db
                .flush_cf(self.cf(f))
                .map_err(Error::index("flush"))?;
        }
        Ok(())
    }

    /// Syncs the write-ahead log.
    pub(crate) fn flush_wal(&self) -> Result<()> {
        self.db.flush_wal(true).map_err(Error::index("flush wal"))
    }

    /// Whether a compaction is running or pending in any family.
    pub(crate) fn compacting(&self) -> Result<bool> {
        let running = self
            .db
            .property_int_value("rocksdb.num-running-compactions")
            .map_err(Error::index("property"))?
            .unwrap_or(0);
        if running > 0 {
            return Ok(true);
        }
        for f in Family::ALL {
            let pending = self
                .db
                .property_int_value_cf(self.cf(f), "rocksdb.compaction-pending")
                .map_err(Error::index("property"))?
                .unwrap_or(0);
            if pending > 0 {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Sorted runs of the `kv` family: L0 files plus non-empty deeper levels.
    pub(crate) fn kv_runs(&self) -> Result<u64> {
        let mut runs = self.kv_property("rocksdb.num-files-at-level0")?;
        for l in 1..7 {
            runs += (self.kv_property(&format!("rocksdb.num-files-at-level{l}"))? > 0) as u64;
        }
        Ok(runs)
    }

    /// Compaction and flush I/O since open (`None` without statistics).
    pub(crate) fn io(&self) -> Option<IndexIo> {
        use rocksdb::statistics::Ticker;
        let o = self.stats.as_ref()?;
        Some(IndexIo {
            compact_read_bytes: o.get_ticker_count(Ticker::CompactReadBytes),
            compact_write_bytes: o.get_ticker_count(Ticker::CompactWriteBytes),
            flush_write_bytes: o.get_ticker_count(Ticker::FlushWriteBytes),
        })
    }

    /// Applies LSM parameters `t` to the `kv` family (picked up at the next flush or
    /// compaction).
    pub(crate) fn apply_tuning(&self, t: Tuning) -> Result<()> {
        let opts = rocksdb_options(t, self.write_buffer_bytes);
        let pairs: Vec<(&str, &str)> = opts.iter().map(|(k, v)| (*k, v.as_str())).collect();
        self.db
            .set_options_cf(self.cf(Family::Kv), &pairs)
            .map_err(Error::index("set options"))
    }
}

impl Batch {
    pub(crate) fn put(&mut self, index: &Index, family: Family, key: &[u8], value: &[u8]) {
        self.0.put_cf(index.cf(family), key, value);
    }

    pub(crate) fn delete(&mut self, index: &Index, family: Family, key: &[u8]) {
        self.0.delete_cf(index.cf(family), key);
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// RocksDB options that set `t` (stall triggers scale with the run trigger so a larger `K`
/// never stalls writes earlier than the defaults would).
fn rocksdb_options(t: Tuning, write_buffer_bytes: u64) -> Vec<(&'static str, String)> {
    let k = t.l0_trigger as u64;
    vec![
        (
            "max_bytes_for_level_multiplier",
            format!("{}", t.size_ratio),
        ),
        ("level0_file_num_compaction_trigger", k.to_string()),
        (
            "level0_slowdown_writes_trigger",
            (20.max(3 * k)).to_string(),
        ),
        ("level0_stop_writes_trigger", (36.max(4 * k)).to_string()),
        (
            "max_bytes_for_level_base",
            (k * write_buffer_bytes).to_string(),
        ),
    ]
}

// ------------------------------------------------------------------- record layouts

/// Layout and codec of a namespace (the part of its record reads need).
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

/// Prefix of the namespace records in the `meta` family.
pub(crate) const NS_META_PREFIX: &[u8] = b"ns/";

/// Key of `ns`'s record in the `meta` family.
pub(crate) fn ns_meta_key(ns: &NamespaceId) -> Vec<u8> {
    let mut k = NS_META_PREFIX.to_vec();
    k.extend_from_slice(&ns.0);
    k
}

/// Prefix of the chunk notes in the `meta` family.
pub(crate) const NOTE_PREFIX: &[u8] = b"note/";

/// Key of the note on the sequence `digest` of `ns` in the `meta` family (`ns` alone: the
/// prefix of all of the namespace's notes).
pub(crate) fn note_key(ns: &NamespaceId, digest: Option<&[u8; 16]>) -> Vec<u8> {
    let mut k = NOTE_PREFIX.to_vec();
    k.extend_from_slice(&ns.0);
    if let Some(d) = digest {
        k.extend_from_slice(d);
    }
    k
}

/// A namespace record, version 2 (table above).
pub(crate) fn encode_namespace(info: &NamespaceInfo, meta: &NsMeta) -> Vec<u8> {
    let mut v = vec![2u8];
    v.extend_from_slice(&info.layout.encode());
    v.push(info.codec.id());
    v.extend_from_slice(&meta.registered_ms.to_le_bytes());
    v.extend_from_slice(&meta.active_ms.to_le_bytes());
    v.push(meta.group.len() as u8);
    v.extend_from_slice(meta.group.as_bytes());
    v
}

/// Decodes a `meta` entry written by [`encode_namespace`] (or of version 1).
pub(crate) fn decode_namespace(k: &[u8], v: &[u8]) -> Result<(NamespaceId, NamespaceInfo, NsMeta)> {
    let id = k
        .strip_prefix(NS_META_PREFIX)
        .and_then(|id| id.try_into().ok())
        .ok_or_else(|| Error::Invalid {
            what: "namespace record",
            why: format!("bad key length {}", k.len()),
        })?;
    let ns = NamespaceId(id);
    let bad = || Error::Invalid {
        what: "namespace record",
        why: format!("unsupported encoding for {ns}"),
    };
    if v.len() < 10 || !(1..=2).contains(&v[0]) {
        return Err(bad());
    }
    let layout = KvLayout::decode(&v[1..9]).map_err(Error::schema(format!("namespace {ns}")))?;
    let codec = Codec::from_id(v[9]).map_err(Error::schema(format!("namespace {ns}")))?;
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
    Ok((ns, NamespaceInfo { layout, codec }, meta))
}

/// Prefix of `doc`'s keys in the `docs` family; a key is this prefix and a sequence key.
pub(crate) fn doc_prefix(doc: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(2 + doc.len());
    k.extend_from_slice(&(doc.len() as u16).to_be_bytes());
    k.extend_from_slice(doc.as_bytes());
    k
}

/// Splits a `docs` key into document id and sequence key.
pub(crate) fn split_doc_key(k: &[u8]) -> Option<(&[u8], &[u8])> {
    let len = u16::from_be_bytes(k.get(..2)?.try_into().ok()?) as usize;
    Some((k.get(2..2 + len)?, &k[2 + len..]))
}

/// A `docs` value: the attached sequence's token count.
pub(crate) fn encode_doc_value(tokens: u32) -> [u8; 5] {
    let mut v = [1u8; 5];
    v[1..].copy_from_slice(&tokens.to_le_bytes());
    v
}

pub(crate) fn decode_doc_value(v: &[u8]) -> u32 {
    v.get(1..5)
        .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
        .unwrap_or(0)
}

/// A `seqs` value: the documents attaching a sequence.
pub(crate) fn decode_refs(v: &[u8]) -> u32 {
    v.get(..4)
        .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
        .unwrap_or(0)
}

/// Key of a segment's accounting in the `segments` family.
pub(crate) fn segment_key(id: u64) -> [u8; 8] {
    id.to_be_bytes()
}

pub(crate) fn decode_segment_key(k: &[u8]) -> Result<u64> {
    Ok(u64::from_be_bytes(k.try_into().map_err(|_| {
        Error::Invalid {
            what: "segment record",
            why: format!("bad key length {}", k.len()),
        }
    })?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use schema::DType;

    #[test]
    fn stall_triggers_never_drop_below_the_defaults() {
        let opts = rocksdb_options(
            Tuning {
                size_ratio: 4,
                l0_trigger: 16,
            },
            1 << 20,
        );
        let get = |k: &str| opts.iter().find(|(n, _)| *n == k).unwrap().1.clone();
        assert_eq!(get("level0_slowdown_writes_trigger"), "48");
        assert_eq!(get("level0_stop_writes_trigger"), "64");
        assert_eq!(get("max_bytes_for_level_base"), (16u64 << 20).to_string());
    }

    #[test]
    fn namespace_records_round_trip_and_read_version_1() {
        let ns = NamespaceId([7; 16]);
        let info = NamespaceInfo {
            layout: KvLayout {
                layers: 3,
                kv_heads: 2,
                head_dim: 64,
                dtype: DType::F16,
            },
            codec: Codec::None,
        };
        let meta = NsMeta {
            group: "tenant-a".into(),
            registered_ms: 11,
            active_ms: 22,
        };
        let v = encode_namespace(&info, &meta);
        let (id, back, m) = decode_namespace(&ns_meta_key(&ns), &v).unwrap();
        assert_eq!(
            (id, back.layout, back.codec, &m),
            (ns, info.layout, info.codec, &meta)
        );
        // Version 1: layout and codec only, group `default`.
        let mut v1 = v[..10].to_vec();
        v1[0] = 1;
        let (_, _, m) = decode_namespace(&ns_meta_key(&ns), &v1).unwrap();
        assert_eq!(m.group, DEFAULT_GROUP);
        assert!(decode_namespace(b"ns/short", &v).is_err());
        let mut v3 = v.clone();
        v3[0] = 3;
        assert!(decode_namespace(&ns_meta_key(&ns), &v3).is_err());
    }

    #[test]
    fn doc_keys_split_back() {
        let mut k = doc_prefix("doc-1");
        k.extend_from_slice(b"seqkey");
        assert_eq!(split_doc_key(&k), Some((&b"doc-1"[..], &b"seqkey"[..])));
        assert_eq!(split_doc_key(&[0, 9, b'x']), None);
        assert_eq!(decode_doc_value(&encode_doc_value(1234)), 1234);
    }
}
