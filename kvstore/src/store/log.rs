//! The tensor log's write side and the two-phase commit: records are appended to the active
//! segment (rolled when full; synced per policy), then one index batch makes them visible
//! together with the accounting of every segment it changed. A failed commit cuts the appended
//! bytes off again, so readers never see an entry whose payload is not there.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::inner::{bump, io_err, now_ms, Change, Inner, Located, Writer};
use crate::error::Result;
use crate::index::{self, Batch, Family};
use crate::options::SyncPolicy;
use crate::record::{self, ALIGN, SEGMENT_HEADER_LEN};
use crate::segment::{self, Direct, Segment, SegmentMeta};

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_err(dir, "syncing directory", e))
}

impl Inner {
    /// Marks segment `id` sealed (no more appends; committed with the caller's next batch)
    /// and closes its direct-I/O descriptor.
    pub(super) fn seal(&self, w: &mut Writer, id: u64) {
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
    pub(super) fn append(&self, w: &mut Writer, bytes: &[u8]) -> Result<(u64, u64)> {
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

    /// Appends a batch with direct I/O: `padded` (records then zeros, a multiple of [`ALIGN`]
    /// long and aligned in memory) goes at the first [`ALIGN`] boundary at or after the active
    /// segment's end; the gap before it stays a hole. Returns `(segment, offset)` like
    /// [`Inner::append`], to which it falls back, with the first `len` bytes, where direct I/O
    /// is unavailable.
    pub(super) fn append_direct(
        &self,
        w: &mut Writer,
        padded: &[u8],
        len: usize,
    ) -> Result<(u64, u64)> {
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
    pub(super) fn commit(
        &self,
        w: &mut Writer,
        before: Writer,
        mut batch: Batch,
        located: Located,
    ) -> Result<()> {
        for (id, m) in &w.metas {
            if before.metas.get(id) != Some(m) {
                batch.put(
                    &self.index,
                    Family::Segments,
                    &index::segment_key(*id),
                    &m.encode(),
                );
            }
        }
        for id in before.metas.keys() {
            if !w.metas.contains_key(id) {
                batch.delete(&self.index, Family::Segments, &index::segment_key(*id));
            }
        }
        if let Err(e) = self.index.write(batch, "commit") {
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
            return Err(e);
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
        if deleted > 0 {
            // After the batch is durable and before the caller returns: a reader that sees
            // the old count read the blocks before they left (see `Store::removals`).
            self.counters.removals.fetch_add(1, Ordering::SeqCst);
        }
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
}
