//! The merger worker: carries out `merge.rs`'s choice. A victim segment is walked record by
//! record (skipping the padding after direct-I/O batches); the records the index still points
//! at are copied, in steps of `step_bytes`, to the active segment, and each step commits their
//! new locations in one index batch, re-checked under the writer lock. A segment with nothing
//! live left loses its accounting in an index batch and its file is retired: unlinked once the
//! last reader holding it is done.

use schema::Location;

use super::inner::{bump, Change, Inner};
use crate::error::{Error, Result};
use crate::index::{Batch, Family};
use crate::key;
use crate::locations::BlockId;
use crate::merge::{choose, MergeReport};
use crate::record::{self, RECORD_HEADER_LEN, SEGMENT_HEADER_LEN};

/// A record found while walking a victim segment: its key, its offset, and its bytes (or why
/// it failed verification).
struct Scanned {
    key: Vec<u8>,
    offset: u64,
    record: Result<Vec<u8>, String>,
}

impl Inner {
    pub(super) fn merge_once(&self) -> Result<MergeReport> {
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
    pub(super) fn merge_all(&self) -> Result<MergeReport> {
        let victims = {
            let mut w = self.writer.lock();
            if let Some(id) = w.active {
                if w.metas[&id].dead_bytes > 0 {
                    let before = w.clone();
                    self.seal(&mut w, id);
                    w.active = None;
                    self.commit(&mut w, before, Batch::default(), Vec::new())?;
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
        self.commit(&mut w, before, Batch::default(), Vec::new())?;
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
        let mut w = self.writer.lock();
        let before = w.clone();
        let keys: Vec<&[u8]> = pending.iter().map(|p| p.key.as_slice()).collect();
        let mut current: Vec<Option<Location>> = Vec::with_capacity(keys.len());
        self.index
            .multi_get(Family::Kv, &keys, false, "merge lookup", |_, v| {
                current.push(match v? {
                    Some(v) => Some(Location::decode(v).map_err(Error::schema("location"))?),
                    None => None,
                });
                Ok::<(), Error>(())
            })?;
        let mut batch = Batch::default();
        let mut located = Vec::new();
        let mut buf = Vec::new();
        let mut moved: Vec<(usize, usize, Location)> = Vec::new(); // (pending index, offset in buf, old location)
        for (i, (p, cur)) in pending.iter().zip(current).enumerate() {
            let Some(loc) = cur else { continue };
            if loc.segment != from || loc.offset != p.offset {
                continue; // deleted or rewritten since: dead
            }
            match &p.record {
                Ok(rec) => {
                    moved.push((i, buf.len(), loc));
                    buf.extend_from_slice(rec);
                }
                Err(why) => {
                    tracing::error!(segment = from, offset = p.offset, %why, "dropping corrupt record while merging");
                    batch.delete(&self.index, Family::Kv, &p.key);
                    self.hot.remove(&p.key);
                    if let Some(ns) = key::namespace_of(&p.key) {
                        let digest = loc.digest;
                        located.push((BlockId { ns, digest }, Change::Deleted));
                    }
                    w.charge(&p.key, -(loc.length as i64), -i64::from(loc.tokens));
                    w.kill(from, loc.length as u64);
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
                batch.put(&self.index, Family::Kv, &pending[i].key, &new.encode());
                if let Some(ns) = key::namespace_of(&pending[i].key) {
                    let digest = new.digest;
                    located.push((BlockId { ns, digest }, Change::Moved(new)));
                }
                let len = loc.length as u64;
                w.kill(from, len);
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
