//! The read paths: `probe` (the longest stored prefix) and `get_batch` (a sequence's KV,
//! verified); `verify.rs` checks every record.
//!
//! A block is looked up in three tiers, each answering only what it knows for sure: the
//! presence filter (`presence.rs`: "certainly absent"), the location cache (`locations.rs`: a
//! location record the index holds), then the index itself. Every commit of an index batch
//! carries its block changes to both in-memory tiers (`log.rs`), and the read that follows a
//! location still verifies the record it finds (key, digest, checksums): a record that fails is
//! a miss, never returned bytes.
//!
//! Records of a run that is contiguous on disk are fetched with one read: small runs into a
//! per-thread buffer and copied into place, large ones with one `preadv` straight into their
//! layer-major place in the caller's buffer. A large run of encoded (`q8`, `q4`, compressed)
//! records is read in pieces by a helper thread while this one verifies and decodes each
//! piece as soon as it is in (`read_ahead.rs`), so that decoding overlaps the run's I/O.

use std::sync::Arc;

use schema::{Codec, KvLayout, Location, NamespaceId};

use super::inner::{bump, now_ms, Inner};
use super::planes::{gather, scatter};
use crate::codec;
use crate::error::{Error, Result};
use crate::hot::HotBlock;
use crate::key::{self, BlockRef};
use crate::locations::BlockId;
use crate::record::{self, RECORD_HEADER_LEN, RECORD_TRAILER_LEN};
use crate::segment::{self, Segment};

/// Largest byte range fetched with one read.
const MAX_RUN_BYTES: usize = 64 << 20;
/// Runs up to this size are read whole into a buffer and copied into place
/// ([`Inner::read_small_run`]); larger ones are read into place ([`Inner::read_large_run`]).
pub(super) const SMALL_RUN_BYTES: usize = 256 << 10;

impl Inner {
    pub(super) fn probe(&self, ns: NamespaceId, tokens: &[u32]) -> Result<usize> {
        bump(&self.counters.probes, 1);
        // Keys are built only for lookups that reach the index.
        let blocks = key::digests(tokens, self.opts.block_tokens);
        if blocks.is_empty() {
            return Ok(0);
        }
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
            let key = key::key_of(&ns, &blocks[..=i]);
            let Some(loc) = self.index.probe_get(&key, |v| Location::decode(v).ok())? else {
                return Ok(false);
            };
            // A record that does not decode or name this block is left for reads to report.
            if let Some(loc) = loc.filter(|l| l.digest == id.digest) {
                self.locations.fill(ticket, id, loc);
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

    pub(super) fn get_batch_into(
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
                Some(h) if h.holds(b, layout) => {
                    scatter(out, total, &h.bytes, b.start, b.tokens(), layout);
                    bump(&self.counters.hot_hits, 1);
                }
                _ => pending.push(i),
            }
        }
        if pending.is_empty() {
            return Ok(());
        }
        let locs = self.locate(ns, blocks, &pending, total, layout)?;
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

            let encoded = locs[r..e].iter().all(|l| l.codec != Codec::None);
            if len > SMALL_RUN_BYTES && encoded {
                // Encoded records are decoded one by one as they arrive, while a helper
                // thread reads the rest of the run (`read_ahead.rs`).
                let run = &locs[r..e];
                self.read_encoded_run(&seg, run, &pending[r..e], blocks, total, layout, out)?;
            } else {
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
            }
            bump(&self.counters.bytes_read, len as u64);
            r = e;
        }
        Ok(())
    }

    /// A run of at most [`SMALL_RUN_BYTES`]: one `pread` of the whole run into a per-thread
    /// buffer (which keeps the size of the largest run it held), then each record is checked
    /// there and its planes copied or decoded into place. For small records this beats reading
    /// into place: a `preadv` with a dozen small pieces per record costs the kernel more than
    /// the second copy, which runs from the CPU cache.
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
        let len: usize = locs.iter().map(|l| l.length as usize).sum();
        with_run_buffer(len, |buf| {
            seg.read_at(locs[0].offset, buf)
                .map_err(|e| self.read_error(e, &locs[0]))?;
            let mut at = 0;
            for (loc, &i) in locs.iter().zip(which) {
                let rec = &buf[at..at + loc.length as usize];
                at += loc.length as usize;
                self.finish_record(loc, &blocks[i], rec, total, layout, out)?;
            }
            Ok(())
        })
    }

    /// Checks one whole record `rec` read from `loc` and puts block `b`'s planes in place.
    pub(super) fn finish_record(
        &self,
        loc: &Location,
        b: &BlockRef,
        rec: &[u8],
        total: usize,
        layout: &KvLayout,
        out: &mut [u8],
    ) -> std::result::Result<(), Retry> {
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
        self.place(loc, b, total, layout, payload, out)
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
        // Not announced first: the kernel's own readahead under one large read fetched cold
        // unencoded chunks 1.1-1.5x faster than a `POSIX_FADV_WILLNEED` over the whole run
        // (docs/BENCHMARKS.md, "The cold read").
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
    pub(super) fn read_error(&self, e: Error, first: &Location) -> Retry {
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
        } else if codec::decodes_in_place(loc.codec) {
            crate::quant::decode_into_place(layout, n, payload, out, total, b.start).map_err(
                |e| {
                    Retry::Fail(Error::Corrupt {
                        segment: loc.segment,
                        offset: loc.offset,
                        what: format!("payload does not decode: {e}"),
                    })
                },
            )?;
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
}

/// Why a read did not return KV.
pub(super) enum Retry {
    Again,
    Fail(Error),
}

/// Runs `f` on this thread's run buffer, cut to `len` bytes: grown once per thread to the
/// largest run it held, its bytes left from earlier reads (every byte a read path uses, it
/// overwrites first).
pub(super) fn with_run_buffer<R>(len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    thread_local! {
        static RUN: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    RUN.with_borrow_mut(|buf| {
        if buf.len() < len {
            buf.resize(len, 0);
        }
        f(&mut buf[..len])
    })
}
