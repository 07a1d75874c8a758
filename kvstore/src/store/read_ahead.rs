//! Large runs of encoded records (`q8`, `q4`, compressed), read ahead: what the page cache
//! already holds is copied without waiting (`RWF_NOWAIT`); if that is not the whole run, a
//! helper thread reads the rest in pieces of about [`PIECE_BYTES`] into the calling thread's
//! run buffer (`with_run_buffer`) and hands each piece over as soon as it is filled, while the
//! calling thread verifies and decodes the records of the pieces already in.
//!
//! Decoding a `q4` record into f16 takes about as long as reading it from a cold disk, so a
//! cold get done in series costs about the sum of the two, and overlapped little more than the
//! longer one (a cold q4 chunk was read 1.3× faster than by the path before). How the disk is
//! kept busy was measured (Cascade Lake VM, docs/BENCHMARKS.md): one `POSIX_FADV_WILLNEED`
//! over the whole run first made its pieces arrive nearly all at once, ~2 ms after the
//! request, so decoding waited for most of it; announcing only the next piece before each
//! read lets the first arrive in about a millisecond and keeps one piece in flight behind the
//! one being read. A warm run costs no thread. Unencoded runs gain nothing from this (there
//! is nothing to decode) and are read with one `preadv` into place instead.

use std::ops::Range;
use std::sync::mpsc;

use schema::{KvLayout, Location};

use super::inner::{bump, Inner};
use super::read::{with_run_buffer, Retry};
use crate::error::Error;
use crate::key::BlockRef;
use crate::segment::Segment;

/// A piece is the records that follow one another until they reach this many bytes (or the
/// run ends): small enough that the first one, whose read nothing hides, is short, large
/// enough that a read costs far more than its system call.
const PIECE_BYTES: usize = 256 << 10;

impl Inner {
    /// Reads the run `locs` (adjacent records of `seg`, the blocks `which` of `blocks`),
    /// checking and placing each record as it arrives. What the page cache holds is copied at
    /// once; if that is not the whole run, a helper thread reads the rest piece by piece while
    /// this one decodes. The first error stops both threads.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn read_encoded_run(
        &self,
        seg: &Segment,
        locs: &[Location],
        which: &[usize],
        blocks: &[BlockRef],
        total: usize,
        layout: &KvLayout,
        out: &mut [u8],
    ) -> Result<(), Retry> {
        let len: usize = locs.iter().map(|l| l.length as usize).sum();
        let pieces = pieces(locs.iter().map(|l| l.length as usize));
        with_run_buffer(len, |buf| {
            let cached = seg.read_cached_at(locs[0].offset, buf);
            // The run cut into its pieces, each with its offset in the segment.
            let mut parts = Vec::with_capacity(pieces.len());
            let (mut rest, mut offset) = (buf, locs[0].offset);
            for p in &pieces {
                let n: usize = locs[p.clone()].iter().map(|l| l.length as usize).sum();
                let (part, tail) = std::mem::take(&mut rest).split_at_mut(n);
                parts.push((offset, part));
                offset += n as u64;
                rest = tail;
            }
            // Pieces whole in the cached prefix are decoded here; the reader takes the rest.
            let end_of = |(o, p): &(u64, &mut [u8])| o - locs[0].offset + p.len() as u64;
            let ready = parts
                .iter()
                .take_while(|part| end_of(part) <= cached as u64)
                .count();
            let ahead = parts.split_off(ready);
            let finish = |p: &Range<usize>, part: &[u8], out: &mut [u8]| {
                let mut at = 0;
                for k in p.clone() {
                    let rec = &part[at..at + locs[k].length as usize];
                    at += locs[k].length as usize;
                    self.finish_record(&locs[k], &blocks[which[k]], rec, total, layout, out)?;
                }
                Ok(())
            };
            let finish_cached = |out: &mut [u8]| {
                (pieces.iter().zip(&parts)).try_for_each(|(p, (_, part))| finish(p, part, out))
            };
            if ahead.is_empty() {
                return finish_cached(out);
            }
            let bytes: usize = ahead.iter().map(|(_, part)| part.len()).sum();
            bump(&self.counters.bytes_read_ahead, bytes as u64);
            // Holds every piece: the reader never waits for this thread.
            let (tx, rx) = mpsc::sync_channel(ahead.len());
            std::thread::scope(|s| {
                let reader = std::thread::Builder::new()
                    .name("kvstore-read-ahead".into())
                    .spawn_scoped(s, move || read_pieces(seg, ahead, tx))
                    .map_err(|e| {
                        Retry::Fail(Error::Io(std::io::Error::new(
                            e.kind(),
                            format!("starting a read-ahead thread: {e}"),
                        )))
                    })?;
                let outcome = (|| {
                    finish_cached(out)?;
                    for p in &pieces[ready..] {
                        match rx.recv() {
                            Ok(Ok(part)) => finish(p, part, out)?,
                            Ok(Err(e)) => return Err(self.read_error(e, &locs[p.start])),
                            // The reader is gone without a word: it panicked (reported below).
                            Err(mpsc::RecvError) => return Ok(()),
                        }
                    }
                    Ok(())
                })();
                // A closed channel stops the reader at its next piece.
                drop(rx);
                if reader.join().is_err() {
                    return Err(Retry::Fail(Error::Io(std::io::Error::other(format!(
                        "the read-ahead thread panicked reading segment {}",
                        locs[0].segment
                    )))));
                }
                outcome
            })
        })
    }
}

/// The read-ahead thread: reads each piece in turn (the next one announced to the kernel
/// first, so that the disk is not idle while a read returns) and sends it on; stops at the
/// first error, which it sends, or when the channel is closed.
fn read_pieces<'a>(
    seg: &Segment,
    parts: Vec<(u64, &'a mut [u8])>,
    tx: mpsc::SyncSender<Result<&'a [u8], Error>>,
) {
    let spans: Vec<(u64, usize)> = parts.iter().map(|(o, p)| (*o, p.len())).collect();
    seg.will_need(spans[0].0, spans[0].1);
    for (k, (offset, part)) in parts.into_iter().enumerate() {
        if let Some(&(o, n)) = spans.get(k + 1) {
            seg.will_need(o, n);
        }
        let read = seg.read_at(offset, part);
        let failed = read.is_err();
        let piece: &[u8] = part;
        if tx.send(read.map(|()| piece)).is_err() || failed {
            return;
        }
    }
}

/// Splits a run of records of the given `lengths` into pieces: ranges of record indices of
/// about [`PIECE_BYTES`] each, the last one whatever remains.
fn pieces(lengths: impl ExactSizeIterator<Item = usize>) -> Vec<Range<usize>> {
    let n = lengths.len();
    let mut pieces = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (k, length) in lengths.enumerate() {
        bytes += length;
        if bytes >= PIECE_BYTES || k + 1 == n {
            pieces.push(start..k + 1);
            (start, bytes) = (k + 1, 0);
        }
    }
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_run_in_order_and_reach_the_piece_size() {
        let sizes = [100_000, 100_000, 100_000, 300_000, 10, 10];
        assert_eq!(pieces(sizes.into_iter()), vec![0..3, 3..4, 4..6]);
        assert_eq!(pieces(sizes[..1].iter().copied()), vec![0..1]);
        assert_eq!(pieces(sizes[..4].iter().copied()), vec![0..3, 3..4]);
    }
}
