//! `verify`: every record the index names read back and checked against its entry (bounds,
//! key, checksums, digest, payload decoding).

use schema::Location;

use super::inner::Inner;
use super::reports::VerifyReport;
use crate::codec;
use crate::error::{Error, Result};
use crate::index::Family;
use crate::record::{self, RECORD_HEADER_LEN, RECORD_TRAILER_LEN};
use crate::segment;

impl Inner {
    pub(super) fn verify(&self) -> Result<VerifyReport> {
        let mut report = VerifyReport::default();
        self.index.scan(Family::Kv, &[], "verify scan", |k, v| {
            report.entries += 1;
            match self.verify_one(k, v) {
                Ok(()) => report.ok += 1,
                Err(e) => report.failures.push((k.to_vec(), e)),
            }
            Ok(true)
        })?;
        Ok(report)
    }

    fn verify_one(&self, k: &[u8], v: &[u8]) -> Result<()> {
        let loc = Location::decode(v).map_err(Error::schema("location"))?;
        if !entry_in_bounds(&loc, k.len()) {
            return Err(Error::Corrupt {
                segment: loc.segment,
                offset: loc.offset,
                what: format!("index entry length {} is out of bounds", loc.length),
            });
        }
        let seg = self
            .segments
            .read()
            .get(&loc.segment)
            .cloned()
            .ok_or(Error::SegmentMissing {
                segment: loc.segment,
                path: segment::path_of(&self.seg_dir, loc.segment),
            })?;
        let corrupt = |what: String| Error::Corrupt {
            segment: loc.segment,
            offset: loc.offset,
            what,
        };
        let mut buf = vec![0u8; loc.length as usize];
        seg.read_at(loc.offset, &mut buf)
            .map_err(|e| corrupt(e.to_string()))?;
        let rec = record::decode_record(&buf).map_err(corrupt)?;
        if rec.key != k || rec.payload_crc != loc.payload_crc || rec.header.digest != loc.digest {
            return Err(corrupt("record does not match its index entry".into()));
        }
        let mut raw = vec![0u8; rec.header.raw_len];
        codec::decode_into(
            rec.header.codec,
            &rec.header.layout,
            rec.header.tokens as usize,
            rec.payload,
            &mut raw,
        )
        .map_err(|e| corrupt(format!("payload does not decode: {e}")))?;
        Ok(())
    }
}

/// Whether an index entry's record length is possible for its key, token count and layout
/// (at least the fixed parts, at most the raw payload plus any codec's worst-case growth) and
/// its end fits in a file offset: a damaged entry must not size a read or an allocation.
pub(super) fn entry_in_bounds(loc: &Location, key_len: usize) -> bool {
    let fixed = RECORD_HEADER_LEN + key_len + RECORD_TRAILER_LEN;
    let raw = loc.layout.bytes_for(loc.tokens as usize);
    let max = fixed + raw + raw / 8 + 4096;
    let len = loc.length as usize;
    (fixed..=max).contains(&len) && loc.offset.checked_add(loc.length as u64).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;
    use schema::{Codec, DType, KvLayout, TokenDigest};

    #[test]
    fn index_entry_lengths_are_bounded_by_layout_and_offset() {
        let layout = KvLayout {
            layers: 2,
            kv_heads: 2,
            head_dim: 8,
            dtype: DType::F16,
        };
        let loc = |length: u32, offset: u64| Location {
            segment: 1,
            offset,
            length,
            codec: Codec::None,
            layout,
            tokens: 16,
            digest: TokenDigest::of(&[1, 2, 3]),
            payload_crc: 0,
        };
        let fixed = (RECORD_HEADER_LEN + 24 + RECORD_TRAILER_LEN) as u32;
        let raw = layout.bytes_for(16) as u32;
        assert!(entry_in_bounds(&loc(fixed + raw, 64), 24));
        assert!(!entry_in_bounds(&loc(fixed - 1, 64), 24));
        assert!(!entry_in_bounds(&loc(u32::MAX, 64), 24));
        assert!(!entry_in_bounds(&loc(fixed + raw, u64::MAX - 10), 24));
    }
}
