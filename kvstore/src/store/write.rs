//! The put path. A put encodes the records of its absent blocks outside the writer lock,
//! straight into one batch buffer (for the uncompressed codec: one copy from the caller's KV,
//! CRC32C on the way), then, under the lock, makes room under the quota, appends the batch to
//! the active segment and commits one index batch (two-phase: payload first, synced by policy).
//! Batches of at least `StoreOptions::direct_write_min_bytes` are written with `O_DIRECT` from
//! a 4 KiB-aligned buffer, zero-padded to the next 4 KiB boundary (`record.rs`, padding): on
//! the VMs we measure on, the copy into the page cache was most of a buffered put
//! (docs/BENCHMARKS.md, kvstore), and a bulk load through the page cache leaves gigabytes dirty
//! that throttle every writer. Merges and small batches go through the page cache.

use std::collections::{HashMap, HashSet};

use schema::{Codec, KvLayout, Location, NamespaceId};

use super::inner::{bump, now_ms, Change, Inner, Located};
use super::planes::{gather, gather_into};
use super::reports::{PutItem, PutReport};
use crate::codec;
use crate::error::{Error, Result};
use crate::index::{self, Batch, Family};
use crate::key::{self, BlockRef};
use crate::locations::BlockId;
use crate::record::{self, RecordHeader, ALIGN, RECORD_HEADER_LEN, RECORD_TRAILER_LEN};

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
        let aligned = (self.v.as_ptr() as usize + self.start).is_multiple_of(ALIGN);
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

impl Inner {
    /// Fails with [`Error::DiskFull`] if writing `needed` bytes would leave less than
    /// `min_free_bytes` free where the segments live.
    fn check_free_space(&self, needed: u64) -> Result<()> {
        let reserve = self.opts.min_free_bytes;
        if reserve == 0 || needed == 0 {
            return Ok(());
        }
        let Some(free) = free_bytes(&self.seg_dir) else {
            return Ok(()); // statvfs unavailable: the write's own error will tell
        };
        if free < reserve.saturating_add(needed) {
            return Err(Error::DiskFull {
                path: self.seg_dir.clone(),
                free,
                needed,
                reserve,
            });
        }
        Ok(())
    }

    pub(super) fn put_batch(
        &self,
        ns: NamespaceId,
        layout: KvLayout,
        items: &[PutItem<'_>],
    ) -> Result<PutReport> {
        self.check_poisoned()?;
        self.check_free_space(items.iter().map(|i| i.kv.len() as u64).sum())?;
        let info = self.namespace_for_write(ns, layout)?;
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
                let payload = codec::encode(
                    info.codec,
                    &layout,
                    b.tokens(),
                    &raw,
                    self.opts.zstd_level,
                    b.start == 0,
                )
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
        let mut batch = Batch::default();
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
                batch.put(&self.index, Family::Kv, &b.key, &loc.encode());
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
            let tokens: usize = encoded.iter().map(|&(i, j, ..)| plans[i][j].tokens()).sum();
            *w.ns_tokens.entry(ns).or_insert(0) += tokens as u64;
        }
        // Document bookkeeping: one reference per (document, sequence).
        let mut refs: HashMap<Vec<u8>, u32> = HashMap::new();
        let mut docs_seen = HashSet::new();
        for (item, blocks) in items.iter().zip(&plans) {
            let Some(doc) = item.doc else { continue };
            let seq = &blocks.last().expect("non-empty").key;
            let mut dk = index::doc_prefix(doc);
            dk.extend_from_slice(seq);
            if !docs_seen.insert(dk.clone()) || self.index.get(Family::Docs, &dk)?.is_some() {
                continue;
            }
            let v = index::encode_doc_value(item.tokens.len() as u32);
            batch.put(&self.index, Family::Docs, &dk, &v);
            let r = match refs.get(seq) {
                Some(r) => *r,
                None => self.index.seq_refs(seq)?,
            };
            refs.insert(seq.clone(), r + 1);
        }
        for (seq, r) in &refs {
            batch.put(&self.index, Family::Seqs, seq, &r.to_le_bytes());
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

    /// Whether each block is in the index: the presence filter rules out most absent ones,
    /// the rest are looked up in one batch.
    pub(super) fn exists_many<'a>(
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
        self.index
            .multi_get(Family::Kv, &keys, false, "multi get", |k, v| {
                out[maybe[k]] = v?.is_some();
                Ok::<(), Error>(())
            })?;
        Ok(out)
    }
}

/// Bytes available to unprivileged writers on the file system holding `path`.
fn free_bytes(path: &std::path::Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a NUL-terminated path; `st` is written by statvfs before it is read.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it filled `st`.
    let st = unsafe { st.assume_init() };
    #[allow(clippy::unnecessary_cast)] // c_ulong / fsblkcnt_t differ by platform
    Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
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
