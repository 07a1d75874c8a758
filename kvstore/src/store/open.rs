//! Opening a store: the directory lock, the index, and recovery from whatever a crash left
//! (uncommitted segment tails, segment files the index does not know, entries whose segment is
//! missing or short), then the in-memory state rebuilt from one scan of the index.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use parking_lot::{Condvar, Mutex, RwLock};
use schema::{Location, NamespaceId};

use super::inner::{io_err, now_ms, Counters, Inner, Writer};
use crate::capacity::{decode_access, Access};
use crate::error::{Error, Result};
use crate::hot::HotTier;
use crate::index::{self, Batch, Family, Index};
use crate::key;
use crate::locations::{BlockId, LocationCache};
use crate::options::StoreOptions;
use crate::presence::Presence;
use crate::record::{self, SEGMENT_HEADER_LEN};
use crate::segment::{self, Segment, SegmentMeta};

/// Where segment files newer than the index are moved at open (inside the segments directory).
pub const UNREFERENCED_DIR: &str = "unreferenced";

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

impl Inner {
    /// Locks `dir`, opens its index and segments, and recovers (see `Store::open`).
    pub(super) fn open(dir: &Path, opts: &StoreOptions) -> Result<Inner> {
        opts.validate()?;
        let seg_dir = dir.join("segments");
        fs_err::create_dir_all(&seg_dir)?;
        let lock = lock_dir(&dir.join("kvstore.lock"))?;
        let index = Index::open(&dir.join("index"), opts)?;
        let inner = Inner {
            dir: dir.to_path_buf(),
            seg_dir,
            opts: opts.clone(),
            index,
            segments: RwLock::new(BTreeMap::new()),
            writer: Mutex::new(Writer {
                active: None,
                metas: BTreeMap::new(),
                next_id: 1,
                ns_bytes: BTreeMap::new(),
                ns_tokens: BTreeMap::new(),
            }),
            hot: HotTier::new(opts.hot_tier_bytes),
            locations: LocationCache::new(opts.location_cache_bytes),
            presence: Presence::new(0),
            counters: Counters::default(),
            namespaces: RwLock::new(HashMap::new()),
            ns_meta: RwLock::new(HashMap::new()),
            access: crate::capacity::AccessLog::default(),
            adaptive: crate::adaptive::Controller::default(),
            poisoned: Mutex::new(None),
            shutdown: (Mutex::new(false), Condvar::new()),
            direct_unavailable: AtomicBool::new(false),
            _lock: lock,
        };
        inner.recover()?;
        Ok(inner)
    }

    fn recover(&self) -> Result<()> {
        // Namespaces.
        let mut nss = HashMap::new();
        let mut ns_metas = HashMap::new();
        self.index.scan_prefix(
            Family::Meta,
            index::NS_META_PREFIX,
            "load namespaces",
            |k, v| {
                let (ns, info, meta) = index::decode_namespace(k, v)?;
                nss.insert(ns, info);
                ns_metas.insert(ns, meta);
                Ok(())
            },
        )?;
        *self.namespaces.write() = nss;
        *self.ns_meta.write() = ns_metas;

        // Segment accounting.
        let mut metas = BTreeMap::new();
        self.index
            .scan(Family::Segments, &[], "load segments", |k, v| {
                let id = index::decode_segment_key(k)?;
                let meta = SegmentMeta::decode(v).map_err(|why| Error::Invalid {
                    what: "segment record",
                    why: format!("segment {id}: {why}"),
                })?;
                metas.insert(id, meta);
                Ok(true)
            })?;

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

        // Files the index does not know. Below the index's newest segment: one the merger
        // retired before the process ended: removed. Above it: one created by a batch or a
        // merge that never committed, or data newer than this index (an older index restored
        // from a backup): moved aside into `unreferenced/`, never deleted.
        let known_max = metas.keys().next_back().copied().unwrap_or(0);
        for (id, path) in &files {
            if metas.contains_key(id) {
                continue;
            }
            if *id < known_max {
                tracing::info!(segment = id, "removing retired segment file");
                fs_err::remove_file(path)?;
            } else {
                let aside_dir = self.seg_dir.join(UNREFERENCED_DIR);
                fs_err::create_dir_all(&aside_dir)?;
                let aside = aside_dir.join(path.file_name().unwrap_or_default());
                tracing::warn!(
                    segment = id,
                    "segment file newer than the index; moving it aside to {} (delete it once \
                     sure it holds nothing wanted)",
                    aside.display()
                );
                fs_err::rename(path, &aside)?;
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
        let (ns_bytes, ns_tokens) = self.load_capacity()?;
        *self.writer.lock() = Writer {
            active,
            metas,
            next_id: max_id + 1,
            ns_bytes,
            ns_tokens,
        };
        Ok(())
    }

    /// Bytes and tokens per namespace and the access map, from one scan of the `kv` family: statistics
    /// of sequences whose blocks are gone become non-resident, and stored sequences without
    /// statistics (leaves of the key tree) are adopted as stored now.
    #[allow(clippy::type_complexity)]
    fn load_capacity(&self) -> Result<(BTreeMap<NamespaceId, u64>, BTreeMap<NamespaceId, u64>)> {
        let mut access = Access::default();
        self.index
            .scan(Family::Access, &[], "load access statistics", |k, v| {
                match decode_access(v) {
                    Some(s) => {
                        access.seqs.insert(k.to_vec(), s);
                    }
                    None => tracing::warn!("skipping an access record of an unknown format"),
                }
                Ok(true)
            })?;
        let mut ns_bytes: BTreeMap<NamespaceId, u64> = BTreeMap::new();
        let mut ns_tokens: BTreeMap<NamespaceId, u64> = BTreeMap::new();
        // The same scan builds the presence filter.
        let estimate = self.index.kv_property("rocksdb.estimate-num-keys")?;
        let filter = self.presence.begin(estimate);
        let mut scanned = 0u64;
        let mut present: HashSet<Vec<u8>> = HashSet::new();
        let mut prev: Option<(Vec<u8>, Location)> = None;
        let now = now_ms();
        let adopt = |k: &[u8], loc: &Location, access: &mut Access| {
            if !access.seqs.contains_key(k) {
                let tokens = (key::depth_of(k) * self.opts.block_tokens) as u32 + loc.tokens;
                access.stored(k, tokens, loc.layout.bytes_for(tokens as usize) as u64, now);
            }
        };
        self.index.scan(Family::Kv, &[], "capacity scan", |k, v| {
            let loc = Location::decode(v).map_err(Error::schema("location"))?;
            if let Some(ns) = key::namespace_of(k) {
                *ns_bytes.entry(ns).or_insert(0) += loc.length as u64;
                *ns_tokens.entry(ns).or_insert(0) += u64::from(loc.tokens);
                let digest = loc.digest;
                Presence::scan_insert(&filter, &BlockId { ns, digest });
                scanned += 1;
            }
            if let Some((pk, ploc)) = prev.take() {
                if !k.starts_with(&pk) {
                    adopt(&pk, &ploc, &mut access);
                }
            }
            if access.seqs.contains_key(k) {
                present.insert(k.to_vec());
            }
            prev = Some((k.to_vec(), loc));
            Ok(true)
        })?;
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
        Ok((ns_bytes, ns_tokens))
    }

    /// Drops index entries that point into lost segments (or past a short segment's end).
    fn drop_lost_entries(
        &self,
        lost: &HashMap<u64, u64>,
        metas: &mut BTreeMap<u64, SegmentMeta>,
    ) -> Result<()> {
        let mut batch = Batch::default();
        let mut dropped = 0u64;
        self.index
            .scan(Family::Kv, &[], "scan for lost entries", |k, v| {
                let loc = Location::decode(v).map_err(Error::schema("location"))?;
                if let Some(valid) = lost.get(&loc.segment) {
                    if loc.offset + loc.length as u64 > *valid {
                        batch.delete(&self.index, Family::Kv, k);
                        dropped += 1;
                        if let Some(m) = metas.get_mut(&loc.segment) {
                            m.live_bytes = m.live_bytes.saturating_sub(loc.length as u64);
                            m.live_records = m.live_records.saturating_sub(1);
                        }
                    }
                }
                Ok(true)
            })?;
        for (id, valid) in lost {
            let key = index::segment_key(*id);
            if *valid == 0 {
                metas.remove(id);
                batch.delete(&self.index, Family::Segments, &key);
            } else if let Some(m) = metas.get(id) {
                batch.put(&self.index, Family::Segments, &key, &m.encode());
            }
        }
        tracing::error!(
            entries = dropped,
            segments = lost.len(),
            "dropped index entries of lost segments"
        );
        self.index.write(batch, "drop lost entries")
    }

    /// Rebuilds the presence filter from a scan of the index, sized for its live blocks
    /// (see `presence.rs`: blocks committed during the scan land in the new filter too).
    pub(super) fn rebuild_presence(&self) -> Result<()> {
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
        let scan = self.index.scan(Family::Kv, &[], "presence scan", |k, v| {
            if let Some(ns) = key::namespace_of(k) {
                let digest = Location::decode(v)
                    .map_err(Error::schema("location"))?
                    .digest;
                Presence::scan_insert(&filter, &BlockId { ns, digest });
                scanned += 1;
            }
            Ok(true)
        });
        if let Err(e) = scan {
            self.presence.abort();
            return Err(e);
        }
        self.presence.finish(filter, scanned);
        tracing::debug!(blocks = scanned, took = ?t.elapsed(), "rebuilt the presence filter");
        Ok(())
    }
}
