//! The merger: reclaims the space of deleted records and keeps the file count bounded.
//!
//! The policy is a pure function, [`choose`], over the segment accounting; the worker carries
//! out its choice. Rewriting a segment copies its live records (byte for byte: a record does
//! not depend on where it lives) to the active segment, in steps of `step_bytes`. Each step
//! appends, syncs per policy, then commits the new locations in one index batch, re-checking
//! under the writer lock that each record is still the one the index points at. When a
//! segment has no live record left, its accounting is deleted in an index batch and the file is
//! retired: unlinked once the last reader holding it is done.

use std::collections::{BTreeMap, BTreeSet};

use rocksdb::WriteBatch;
use schema::Location;

use crate::error::{Error, Result};
use crate::key;
use crate::locations::BlockId;
use crate::options::MergePolicy;
use crate::record::{self, RECORD_HEADER_LEN, SEGMENT_HEADER_LEN};
use crate::segment::SegmentMeta;
use crate::store::{bump, Change, Inner, CF_KV};

/// What a merger pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MergeReport {
    /// Segments whose live records were copied elsewhere.
    pub segments_rewritten: usize,
    /// Segment files retired (unlinked when their last reader is done).
    pub segments_removed: usize,
    /// Record bytes copied.
    pub bytes_copied: u64,
    /// File bytes given back.
    pub bytes_reclaimed: u64,
    /// Live records dropped because they failed verification while being copied.
    pub corrupt_dropped: usize,
}

/// A record found while walking a victim segment: its key, its offset, and its bytes (or why
/// it failed verification).
struct Scanned {
    key: Vec<u8>,
    offset: u64,
    record: Result<Vec<u8>, String>,
}

/// Which sealed segments to rewrite: those whose dead share reaches `dead_ratio` (or that
/// hold nothing live), plus every small one once there are more than `max_small_segments`.
pub(crate) fn choose(
    metas: &BTreeMap<u64, SegmentMeta>,
    active: Option<u64>,
    policy: &MergePolicy,
    segment_bytes: u64,
) -> Vec<u64> {
    let sealed: Vec<(u64, &SegmentMeta)> = metas
        .iter()
        .filter(|(id, m)| m.sealed && Some(**id) != active)
        .map(|(id, m)| (*id, m))
        .collect();
    let mut out: BTreeSet<u64> = sealed
        .iter()
        .filter(|(_, m)| m.live_records == 0 || m.dead_ratio() >= policy.dead_ratio)
        .map(|(id, _)| *id)
        .collect();
    let small_limit = (segment_bytes as f64 * policy.small_ratio) as u64;
    let small: Vec<u64> = sealed
        .iter()
        .filter(|(id, m)| m.len < small_limit && !out.contains(id))
        .map(|(id, _)| *id)
        .collect();
    if small.len() > policy.max_small_segments {
        out.extend(small);
    }
    out.into_iter().collect()
}

impl Inner {
    pub(crate) fn merge_once(&self) -> Result<MergeReport> {
        let victims = {
            let w = self.writer.lock();
            choose(
                &w.metas,
                w.active,
                &self.opts.merge,
                self.opts.segment_bytes,
            )
        };
        self.merge_segments(&victims)
    }

    /// Seals the active segment if it holds dead bytes, then rewrites every segment with any.
    pub(crate) fn merge_all(&self) -> Result<MergeReport> {
        let victims = {
            let mut w = self.writer.lock();
            if let Some(id) = w.active {
                if w.metas[&id].dead_bytes > 0 {
                    let before = w.clone();
                    self.seal(&mut w, id);
                    w.active = None;
                    self.commit(&mut w, before, WriteBatch::default(), Vec::new())?;
                }
            }
            w.metas
                .iter()
                .filter(|(id, m)| {
                    m.sealed && Some(**id) != w.active && (m.dead_bytes > 0 || m.live_records == 0)
                })
                .map(|(id, _)| *id)
                .collect::<Vec<_>>()
        };
        self.merge_segments(&victims)
    }

    fn merge_segments(&self, victims: &[u64]) -> Result<MergeReport> {
        let mut report = MergeReport::default();
        for &id in victims {
            self.check_poisoned()?;
            self.merge_segment(id, &mut report)?;
        }
        if report.segments_removed > 0 {
            tracing::info!(?report, "merged segments");
        }
        Ok(report)
    }

    fn merge_segment(&self, id: u64, report: &mut MergeReport) -> Result<()> {
        let Some(seg) = self.segments.read().get(&id).cloned() else {
            return Ok(());
        };
        let Some(meta) = self.writer.lock().metas.get(&id).copied() else {
            return Ok(());
        };
        if meta.live_records > 0 {
            let step = self.opts.merge.step_bytes;
            let mut pending: Vec<Scanned> = Vec::new();
            let mut pending_bytes = 0usize;
            let mut pos = SEGMENT_HEADER_LEN as u64;
            while pos < meta.len {
                let want = step.max(RECORD_HEADER_LEN).min((meta.len - pos) as usize);
                let mut buf = vec![0u8; want];
                seg.read_at(pos, &mut buf)?;
                let mut c = 0usize;
                while c < buf.len() {
                    // Padding after a direct-I/O batch runs to the next boundary.
                    if let Some(next) = record::padding_end(&buf[c..], pos + c as u64) {
                        c = (next - pos) as usize;
                        continue;
                    }
                    let header = match record::decode_header(&buf[c..]) {
                        Ok((h, _)) => h,
                        Err(_)
                            if buf.len() - c < RECORD_HEADER_LEN + u16::MAX as usize
                                && (pos + buf.len() as u64) < meta.len =>
                        {
                            break
                        }
                        Err(why) => {
                            // Without a valid header the next record boundary is unknown: leave the
                            // segment (its live records still verify on read) and say so.
                            tracing::error!(segment = id, offset = pos + c as u64, %why, "cannot walk segment; not merging it");
                            return Ok(());
                        }
                    };
                    let len = header.record_len();
                    let rec = if c + len <= buf.len() {
                        buf[c..c + len].to_vec()
                    } else if c == 0 {
                        let mut big = vec![0u8; len];
                        seg.read_at(pos, &mut big).map_err(|e| Error::Corrupt {
                            segment: id,
                            offset: pos,
                            what: format!("record runs past the segment end: {e}"),
                        })?;
                        big
                    } else {
                        break;
                    };
                    let off = pos + c as u64;
                    let checked = record::decode_record(&rec).map(|r| r.key.to_vec());
                    let key = match &checked {
                        Ok(k) => k.clone(),
                        Err(_) => {
                            rec[RECORD_HEADER_LEN..RECORD_HEADER_LEN + header.key_len].to_vec()
                        }
                    };
                    pending_bytes += rec.len();
                    pending.push(Scanned {
                        key,
                        offset: off,
                        record: checked.map(|_| rec),
                    });
                    c += len;
                    if pending_bytes >= step {
                        self.move_records(id, &mut pending, report)?;
                        pending_bytes = 0;
                    }
                }
                if c == 0 {
                    break;
                }
                pos += c as u64;
            }
            self.move_records(id, &mut pending, report)?;
            report.segments_rewritten += 1;
        }

        let mut w = self.writer.lock();
        let Some(m) = w.metas.get(&id).copied() else {
            return Ok(());
        };
        if m.live_records > 0 {
            tracing::warn!(
                segment = id,
                live = m.live_records,
                "segment still has live records after merge"
            );
            return Ok(());
        }
        let before = w.clone();
        w.metas.remove(&id);
        self.commit(&mut w, before, WriteBatch::default(), Vec::new())?;
        drop(w);
        if let Some(seg) = self.segments.write().remove(&id) {
            seg.retire();
        }
        report.segments_removed += 1;
        report.bytes_reclaimed += m.len;
        bump(&self.counters.merges, 1);
        Ok(())
    }

    /// Copies the records of `pending` that the index still points at (in segment `from`) to
    /// the active segment and commits their new locations.
    fn move_records(
        &self,
        from: u64,
        pending: &mut Vec<Scanned>,
        report: &mut MergeReport,
    ) -> Result<()> {
        if pending.is_empty() {
            return Ok(());
        }
        let cf = self.db.cf_handle(CF_KV).expect("kv family");
        let mut w = self.writer.lock();
        let before = w.clone();
        let keys: Vec<&[u8]> = pending.iter().map(|p| p.key.as_slice()).collect();
        let current = self.db.batched_multi_get_cf(cf, &keys, false);
        let mut batch = WriteBatch::default();
        let mut located = Vec::new();
        let mut buf = Vec::new();
        let mut moved: Vec<(usize, usize, Location)> = Vec::new(); // (pending index, offset in buf, old location)
        for (
            i,
            (
                Scanned {
                    key,
                    offset: off,
                    record: rec,
                },
                cur,
            ),
        ) in pending.iter().zip(current).enumerate()
        {
            let Some(v) = cur.map_err(Error::index("merge lookup"))? else {
                continue;
            };
            let loc = Location::decode(&v).map_err(Error::schema("location"))?;
            if loc.segment != from || loc.offset != *off {
                continue; // deleted or rewritten since: dead
            }
            match rec {
                Ok(rec) => {
                    moved.push((i, buf.len(), loc));
                    buf.extend_from_slice(rec);
                }
                Err(why) => {
                    tracing::error!(segment = from, offset = off, %why, "dropping corrupt record while merging");
                    batch.delete_cf(cf, key);
                    self.hot.remove(key);
                    if let Some(ns) = key::namespace_of(key) {
                        let digest = loc.digest;
                        located.push((BlockId { ns, digest }, Change::Deleted));
                    }
                    w.charge(key, -(loc.length as i64));
                    let m = w.metas.get_mut(&from).expect("victim meta");
                    m.live_records = m.live_records.saturating_sub(1);
                    m.live_bytes = m.live_bytes.saturating_sub(loc.length as u64);
                    m.dead_bytes += loc.length as u64;
                    report.corrupt_dropped += 1;
                }
            }
        }
        if !buf.is_empty() {
            let (to, base) = self.append(&mut w, &buf)?;
            for &(i, off_in_buf, loc) in &moved {
                let new = Location {
                    segment: to,
                    offset: base + off_in_buf as u64,
                    ..loc
                };
                batch.put_cf(cf, &pending[i].key, new.encode());
                if let Some(ns) = key::namespace_of(&pending[i].key) {
                    let digest = new.digest;
                    located.push((BlockId { ns, digest }, Change::Moved(new)));
                }
                let len = loc.length as u64;
                let src = w.metas.get_mut(&from).expect("victim meta");
                src.live_records = src.live_records.saturating_sub(1);
                src.live_bytes = src.live_bytes.saturating_sub(len);
                src.dead_bytes += len;
                let dst = w.metas.get_mut(&to).expect("active meta");
                dst.live_records += 1;
                dst.live_bytes += len;
            }
            report.bytes_copied += buf.len() as u64;
            bump(&self.counters.bytes_merged, buf.len() as u64);
        }
        if !batch.is_empty() {
            self.commit(&mut w, before, batch, located)?;
        }
        pending.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(sealed: bool, len: u64, live: u64, dead: u64) -> SegmentMeta {
        SegmentMeta {
            sealed,
            len,
            live_bytes: live,
            dead_bytes: dead,
            live_records: if live > 0 { 1 } else { 0 },
        }
    }

    #[test]
    fn chooses_sparse_and_empty_sealed_segments_never_the_active_one() {
        let p = MergePolicy::default();
        let mut m = BTreeMap::new();
        m.insert(1, meta(true, 1000, 400, 600)); // 60 % dead
        m.insert(2, meta(true, 1000, 600, 400)); // 40 % dead
        m.insert(3, meta(true, 1000, 0, 1000)); // empty
        m.insert(4, meta(false, 1000, 0, 1000)); // active
        assert_eq!(choose(&m, Some(4), &p, 1000), vec![1, 3]);
    }

    #[test]
    fn packs_small_segments_once_there_are_too_many() {
        let p = MergePolicy {
            max_small_segments: 2,
            ..MergePolicy::default()
        };
        let mut m = BTreeMap::new();
        for id in 1..=2 {
            m.insert(id, meta(true, 100, 100, 0));
        }
        m.insert(9, meta(true, 900, 900, 0));
        assert!(choose(&m, None, &p, 1000).is_empty());
        m.insert(3, meta(true, 100, 100, 0));
        assert_eq!(choose(&m, None, &p, 1000), vec![1, 2, 3]);
    }
}
