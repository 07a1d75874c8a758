//! Where a sequence's records are (`locate`: the location cache, then one batched index
//! lookup, each entry checked against the request), and announcing them to the kernel before
//! they are read (`prefetch`).
//!
//! A cold read of one chunk waits on the disk for its whole length, and the disk idles while
//! the caller then works on what came in. A caller that knows what it reads next (the serving
//! loader: a query's chunks) announces it once the current read is done and before its own
//! work on the bytes (the loader's import), so that the disk fetches the next chunk meanwhile.
//! What was measured (docs/BENCHMARKS.md, "The cold read"): announced *before* the current
//! read, the next chunk shares the disk with the read that is waited for, and chunks come
//! slower (1.16 against 1.44 GB/s); and small runs (up to the read path's small-run size) are
//! better left to the kernel's own sequential readahead: a 32 KB chunk it has fetched ahead is
//! read in tens of microseconds, about what an announce's lookups and system call cost, so
//! announcing each one halved their speed. They are not announced. The announce costs the lookups (kept in the location cache for the read that
//! follows) and the advisory call, which queues the reads and returns.

use schema::{KvLayout, Location, NamespaceId};

use super::inner::{bump, Inner};
use super::read::{Retry, SMALL_RUN_BYTES};
use super::verify::entry_in_bounds;
use crate::error::{Error, Result};
use crate::index::Family;
use crate::key::{self, BlockRef};
use crate::locations::BlockId;

impl Inner {
    /// The locations of `blocks[i]` for every `i` in `pending` (block order), from the
    /// location cache and, for the rest, one batched index lookup; each checked against its
    /// block and `layout` (a mismatch is corruption). A block the index lacks is a miss at its
    /// start (`total`: the tokens asked for).
    pub(super) fn locate(
        &self,
        ns: NamespaceId,
        blocks: &[BlockRef],
        pending: &[usize],
        total: usize,
        layout: &KvLayout,
    ) -> std::result::Result<Vec<Location>, Retry> {
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
            // A sequence's block keys are strictly increasing (each extends the one before).
            self.index
                .multi_get(Family::Kv, &keys, true, "get_batch", |m, v| {
                    let k = missing[m];
                    let i = pending[k];
                    // `missing` is in block order and earlier blocks were found: this is the
                    // first absent one.
                    let Some(v) = v.map_err(Retry::Fail)? else {
                        return Err(Retry::Fail(Error::Miss {
                            requested: total,
                            cached: blocks[i].start,
                        }));
                    };
                    let loc = Location::decode(v)
                        .map_err(|e| Retry::Fail(Error::schema("location")(e)))?;
                    if loc.digest == blocks[i].digest {
                        self.locations.fill(ticket, id(i), loc);
                    }
                    cached[k] = Some(loc);
                    Ok(())
                })?;
        }
        let mut locs = Vec::with_capacity(pending.len());
        for (&i, loc) in pending.iter().zip(cached) {
            let b = &blocks[i];
            let loc = loc.expect("every location found above");
            if loc.digest != b.digest
                || loc.tokens as usize != b.tokens()
                || loc.layout != *layout
                || !entry_in_bounds(&loc, b.key.len())
            {
                return Err(Retry::Fail(Error::Corrupt {
                    segment: loc.segment,
                    offset: loc.offset,
                    what: "index entry does not match the requested tokens or layout".into(),
                }));
            }
            locs.push(loc);
        }
        Ok(locs)
    }

    /// Announces the records of `tokens` (the whole sequence) in `ns` to the kernel, one
    /// advisory call per run of adjacent records larger than a small run; returns the bytes
    /// announced. Advisory: a sequence that is not stored whole, a namespace that does not
    /// exist or an entry that does not check out announces nothing (the read reports it), and
    /// blocks the hot tier serves are left out.
    pub(super) fn prefetch(&self, ns: NamespaceId, tokens: &[u32]) -> Result<u64> {
        let Some(info) = self.namespaces.read().get(&ns).copied() else {
            return Ok(0);
        };
        let blocks = key::blocks(&ns, tokens, self.opts.block_tokens);
        let layout = &info.layout;
        let pending: Vec<usize> = (0..blocks.len())
            .filter(|&i| {
                self.opts.hot_tier_bytes == 0
                    || !self
                        .hot
                        .get(&blocks[i].key)
                        .is_some_and(|h| h.holds(&blocks[i], layout))
            })
            .collect();
        if pending.is_empty() {
            return Ok(0);
        }
        let locs = match self.locate(ns, &blocks, &pending, tokens.len(), layout) {
            Ok(locs) => locs,
            // The index failing is the caller's to know; what the entries say is the read's.
            Err(Retry::Fail(e @ (Error::Io(_) | Error::Index { .. }))) => return Err(e),
            Err(Retry::Fail(_)) => return Ok(0),
            Err(Retry::Again) => return Ok(0),
        };
        let mut announced = 0u64;
        for run in runs(&locs) {
            let first = &locs[run.start];
            let len: u64 = locs[run].iter().map(|l| l.length as u64).sum();
            if len <= SMALL_RUN_BYTES as u64 {
                continue; // left to the kernel's own readahead (see the module doc)
            }
            let Some(seg) = self.segments.read().get(&first.segment).cloned() else {
                continue; // retired since: the read asks the index again
            };
            seg.will_need(first.offset, len as usize);
            announced += len;
        }
        bump(&self.counters.bytes_prefetched, announced);
        Ok(announced)
    }
}

/// `locs` cut into runs of records that follow one another in one segment.
fn runs(locs: &[Location]) -> Vec<std::ops::Range<usize>> {
    let mut runs = Vec::new();
    let mut start = 0;
    for e in 1..=locs.len() {
        let adjacent = e < locs.len()
            && locs[e].segment == locs[e - 1].segment
            && locs[e].offset == locs[e - 1].offset + locs[e - 1].length as u64;
        if !adjacent {
            runs.push(start..e);
            start = e;
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;
    use schema::{Codec, DType, TokenDigest};

    fn at(segment: u64, offset: u64, length: u32) -> Location {
        Location {
            segment,
            offset,
            length,
            codec: Codec::None,
            layout: KvLayout {
                layers: 1,
                kv_heads: 1,
                head_dim: 8,
                dtype: DType::F16,
            },
            tokens: 4,
            digest: TokenDigest::EMPTY,
            payload_crc: 0,
        }
    }

    #[test]
    fn runs_break_at_gaps_and_segments() {
        let locs = [
            at(1, 0, 10),
            at(1, 10, 5),
            at(1, 20, 5), // gap
            at(2, 25, 5), // other segment
            at(2, 30, 1),
        ];
        assert_eq!(runs(&locs), vec![0..2, 2..3, 3..5]);
        assert_eq!(runs(&locs[..1]), vec![0..1]);
        assert!(runs(&[]).is_empty());
    }
}
