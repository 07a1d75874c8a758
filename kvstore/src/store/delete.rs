//! Deletion: of a block range (`Store::delete`), of a document's sequences (only the blocks no
//! other attached sequence runs through), and of a whole namespace. Deletes drop index entries
//! and move their bytes to their segment's dead share; the merger reclaims the space.
//! Also the document views (`documents`, `document_sequences`) of the `docs` family.

use std::collections::HashSet;

use schema::{Location, NamespaceId};

use super::inner::{Change, Deleted, Inner, Writer};
use super::reports::DeleteReport;
use crate::error::{Error, Result};
use crate::index::{self, Batch, Family};
use crate::key;
use crate::locations::BlockId;

impl Inner {
    /// Adds the deletion of every kv entry under `prefix` to `batch`.
    pub(super) fn delete_range(
        &self,
        w: &mut Writer,
        batch: &mut Batch,
        prefix: &[u8],
        done: &mut Deleted,
        report: &mut DeleteReport,
    ) -> Result<()> {
        self.index
            .scan_prefix(Family::Kv, prefix, "delete scan", |k, v| {
                if done.keys.insert(k.to_vec()) {
                    let loc = Location::decode(v).map_err(Error::schema("location"))?;
                    batch.delete(&self.index, Family::Kv, k);
                    self.hot.remove(k);
                    if let Some(ns) = key::namespace_of(k) {
                        let digest = loc.digest;
                        done.located.push((BlockId { ns, digest }, Change::Deleted));
                    }
                    w.charge(k, -(loc.length as i64), -i64::from(loc.tokens));
                    w.kill(loc.segment, loc.length as u64);
                    report.blocks += 1;
                    report.bytes += loc.length as u64;
                }
                Ok(())
            })
    }

    /// See `Store::delete`.
    pub(super) fn delete_prefix_range(
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
        let mut batch = Batch::default();
        let mut done = Deleted::default();
        self.delete_range(&mut w, &mut batch, &b.key, &mut done, &mut report)?;
        if report.blocks > 0 {
            self.forget(&mut batch, &done);
            self.commit(&mut w, before, batch, std::mem::take(&mut done.located))?;
            self.forgotten(&done);
        }
        Ok(report)
    }

    /// See `Store::delete_document`.
    pub(super) fn delete_document(&self, doc: &str) -> Result<DeleteReport> {
        self.check_poisoned()?;
        let prefix = index::doc_prefix(doc);
        let mut w = self.writer.lock();
        let before = w.clone();
        let mut batch = Batch::default();
        let mut report = DeleteReport::default();
        let mut released = Vec::new();
        let mut removed_seqs = HashSet::new();
        self.index
            .scan_prefix(Family::Docs, &prefix, "document scan", |k, _| {
                let seq = k[prefix.len()..].to_vec();
                batch.delete(&self.index, Family::Docs, k);
                report.sequences += 1;
                let refs = self.index.seq_refs(&seq)?;
                if refs > 1 {
                    batch.put(&self.index, Family::Seqs, &seq, &(refs - 1).to_le_bytes());
                } else {
                    batch.delete(&self.index, Family::Seqs, &seq);
                    removed_seqs.insert(seq.clone());
                    released.push(seq);
                }
                Ok(())
            })?;
        // A block is still needed while some attached sequence runs through it, i.e. while
        // some key in `seqs` starts with its key. Find the shallowest unneeded ancestor of each
        // released sequence and drop it with everything below it.
        let mut done = Deleted::default();
        for seq in released {
            if key::namespace_of(&seq).is_none() {
                continue;
            }
            let cut = key::unneeded_ancestor(&seq, |anc| self.needed(anc, &removed_seqs))?;
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
    fn forget(&self, batch: &mut Batch, deleted: &Deleted) {
        let access = self.access.lock();
        for k in deleted.keys.iter().filter(|k| access.seqs.contains_key(*k)) {
            batch.delete(&self.index, Family::Access, k);
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

    /// See `Store::drop_namespace`.
    pub(super) fn drop_namespace(&self, ns: NamespaceId) -> Result<DeleteReport> {
        self.check_poisoned()?;
        let mut w = self.writer.lock();
        let before = w.clone();
        let mut batch = Batch::default();
        let mut report = DeleteReport::default();
        let mut done = Deleted::default();
        self.delete_range(&mut w, &mut batch, &ns.0, &mut done, &mut report)?;
        for (family, what) in [(Family::Seqs, "seqs scan"), (Family::Access, "access scan")] {
            self.index.scan_prefix(family, &ns.0, what, |k, _| {
                batch.delete(&self.index, family, k);
                Ok(())
            })?;
        }
        // Document attachments: `docs` is keyed by document first, so scan it all.
        self.index.scan(Family::Docs, &[], "docs scan", |k, _| {
            if index::split_doc_key(k).is_some_and(|(_, seq)| seq.starts_with(&ns.0)) {
                batch.delete(&self.index, Family::Docs, k);
                report.sequences += 1;
            }
            Ok(true)
        })?;
        self.index.scan_prefix(
            Family::Meta,
            &index::note_key(&ns, None),
            "notes scan",
            |k, _| {
                batch.delete(&self.index, Family::Meta, k);
                Ok(())
            },
        )?;
        batch.delete(&self.index, Family::Meta, &index::ns_meta_key(&ns));
        w.ns_bytes.remove(&ns);
        w.ns_tokens.remove(&ns);
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

    /// Whether some attached sequence other than those in `removed` runs through the block
    /// with key `block_key`.
    fn needed(&self, block_key: &[u8], removed: &HashSet<Vec<u8>>) -> Result<bool> {
        let mut found = false;
        self.index
            .scan(Family::Seqs, block_key, "seqs scan", |k, _| {
                if !k.starts_with(block_key) {
                    return Ok(false);
                }
                found = !removed.contains(k);
                Ok(!found)
            })?;
        Ok(found)
    }

    /// See `Store::documents`.
    pub(super) fn documents(&self) -> Result<Vec<String>> {
        let mut out: Vec<String> = Vec::new();
        self.index.scan(Family::Docs, &[], "docs scan", |k, _| {
            let Some((id, _)) = index::split_doc_key(k) else {
                return Err(Error::Invalid {
                    what: "docs family key",
                    why: "shorter than its length prefix".into(),
                });
            };
            let id = String::from_utf8_lossy(id).into_owned();
            if out.last() != Some(&id) {
                out.push(id);
            }
            Ok(true)
        })?;
        Ok(out)
    }

    /// See `Store::documents_with_prefix`.
    pub(super) fn documents_with_prefix(&self, prefix: &str, len: usize) -> Result<Vec<String>> {
        let Ok(n) = u16::try_from(len) else {
            return Ok(Vec::new());
        };
        let mut start = n.to_be_bytes().to_vec();
        start.extend_from_slice(prefix.as_bytes());
        let mut out: Vec<String> = Vec::new();
        self.index
            .scan_prefix(Family::Docs, &start, "docs prefix scan", |k, _| {
                if let Some((id, _)) = index::split_doc_key(k) {
                    let id = String::from_utf8_lossy(id).into_owned();
                    if out.last() != Some(&id) {
                        out.push(id);
                    }
                }
                Ok(())
            })?;
        Ok(out)
    }

    /// See `Store::document_sequences`.
    pub(super) fn document_sequences(&self, doc: &str) -> Result<Vec<(NamespaceId, usize)>> {
        let prefix = index::doc_prefix(doc);
        let mut out = Vec::new();
        self.index
            .scan_prefix(Family::Docs, &prefix, "document scan", |k, v| {
                if let Some(ns) = key::namespace_of(&k[prefix.len()..]) {
                    out.push((ns, index::decode_doc_value(v) as usize));
                }
                Ok(())
            })?;
        Ok(out)
    }
}
