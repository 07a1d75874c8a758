//! The tensor-log formats: segment files and the records they hold.
//!
//! A segment file is a header followed by records, appended and never modified in place.
//!
//! Segment header, version 1 (32 bytes, little-endian):
//!
//! | offset | size | field                           |
//! |-------:|-----:|---------------------------------|
//! | 0      | 8    | magic `RAGKVTL\0`               |
//! | 8      | 2    | format version (`1`)            |
//! | 10     | 2    | reserved, zero                  |
//! | 12     | 8    | segment id                      |
//! | 20     | 8    | creation time, Unix ms          |
//! | 28     | 4    | CRC32C of bytes 0..28           |
//!
//! Record, version 1 (52 + K + P bytes, little-endian), one block of KV:
//!
//! | offset   | size | field                                                       |
//! |---------:|-----:|-------------------------------------------------------------|
//! | 0        | 4    | magic `RKVB`                                                |
//! | 4        | 1    | record version (`1`)                                        |
//! | 5        | 1    | codec id (`schema::Codec::id`)                              |
//! | 6        | 2    | key length K                                                |
//! | 8        | 4    | token count                                                 |
//! | 12       | 4    | decoded payload length                                      |
//! | 16       | 4    | encoded payload length P                                    |
//! | 20       | 8    | KV layout (`schema::KvLayout::encode`)                      |
//! | 28       | 16   | token digest of the whole prefix this block ends            |
//! | 44       | 4    | CRC32C of bytes 0..44 followed by the key                   |
//! | 48       | K    | block key (see `key.rs`)                                    |
//! | 48+K     | P    | payload, encoded by the codec; decoded it is layer-major KV |
//! | 48+K+P   | 4    | CRC32C of the encoded payload                               |
//!
//! Records are self-describing, so recovery and the merger can walk a segment without the index,
//! and a reader verifies that the record it was pointed at is the one it asked for (key, digest,
//! both checksums) before it decodes anything. The blocks of one `put_batch` call are written
//! back to back, so a sequence of blocks is one contiguous byte range.
//!
//! Padding: a batch written with direct I/O (bypassing the page cache, see
//! `StoreOptions::direct_write_min_bytes`) starts and ends on an [`ALIGN`]-byte boundary of the
//! file, so zero bytes may sit between the end of one record and the next boundary (written
//! zeros, or a hole). Records never start with zero (the magic), so a walker that finds a zero
//! magic at an unaligned offset skips to the next boundary; a zero magic at an aligned offset
//! is damage. Segments of format version 1 written before padding existed hold none; a walker
//! that predates it stops at the first padding and leaves the segment unmerged (its records
//! still read).

use schema::{Codec, KvLayout, TokenDigest};

pub(crate) const SEGMENT_MAGIC: &[u8; 8] = b"RAGKVTL\0";
pub(crate) const SEGMENT_VERSION: u16 = 1;
pub(crate) const SEGMENT_HEADER_LEN: usize = 32;

pub(crate) const RECORD_MAGIC: &[u8; 4] = b"RKVB";
pub(crate) const RECORD_VERSION: u8 = 1;
pub(crate) const RECORD_HEADER_LEN: usize = 48;
pub(crate) const RECORD_TRAILER_LEN: usize = 4;
/// Upper bound on one record's payload, to reject absurd lengths from a corrupt header.
pub(crate) const MAX_PAYLOAD: usize = 1 << 30;
/// Alignment of direct-I/O batches in the file and in memory: 4096 satisfies the logical block
/// size of every common device and file system (512 or 4096).
pub(crate) const ALIGN: usize = 4096;

/// `n` rounded up to a multiple of [`ALIGN`].
pub(crate) fn align_up(n: u64) -> u64 {
    n.div_ceil(ALIGN as u64) * ALIGN as u64
}

/// Whether the bytes at file offset `offset` (`b` starting there, at least 4 of them) are
/// padding: a zero magic at an unaligned offset. Returns where the next record may start.
pub(crate) fn padding_end(b: &[u8], offset: u64) -> Option<u64> {
    (b.len() >= 4 && b[..4] == [0u8; 4] && !offset.is_multiple_of(ALIGN as u64))
        .then(|| align_up(offset))
}

pub(crate) fn encode_segment_header(id: u64, created_ms: u64) -> [u8; SEGMENT_HEADER_LEN] {
    let mut h = [0u8; SEGMENT_HEADER_LEN];
    h[0..8].copy_from_slice(SEGMENT_MAGIC);
    h[8..10].copy_from_slice(&SEGMENT_VERSION.to_le_bytes());
    h[12..20].copy_from_slice(&id.to_le_bytes());
    h[20..28].copy_from_slice(&created_ms.to_le_bytes());
    let crc = crc32c::crc32c(&h[..28]);
    h[28..32].copy_from_slice(&crc.to_le_bytes());
    h
}

/// Checks a segment header; returns the segment id it names.
pub(crate) fn decode_segment_header(h: &[u8]) -> Result<u64, String> {
    if h.len() < SEGMENT_HEADER_LEN {
        return Err(format!("segment header truncated ({} bytes)", h.len()));
    }
    if &h[0..8] != SEGMENT_MAGIC {
        return Err("bad segment magic".into());
    }
    let version = u16::from_le_bytes([h[8], h[9]]);
    if version != SEGMENT_VERSION {
        return Err(format!("unsupported segment version {version}"));
    }
    let crc = u32::from_le_bytes(h[28..32].try_into().unwrap());
    if crc != crc32c::crc32c(&h[..28]) {
        return Err("segment header checksum mismatch".into());
    }
    Ok(u64::from_le_bytes(h[12..20].try_into().unwrap()))
}

/// What a record header says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RecordHeader {
    pub codec: Codec,
    pub key_len: usize,
    pub tokens: u32,
    pub raw_len: usize,
    pub payload_len: usize,
    pub layout: KvLayout,
    pub digest: TokenDigest,
}

impl RecordHeader {
    /// Total bytes of the record this header starts.
    pub fn record_len(&self) -> usize {
        RECORD_HEADER_LEN + self.key_len + self.payload_len + RECORD_TRAILER_LEN
    }
}

/// Appends one record to `out`; returns the CRC32C of the payload.
pub(crate) fn append_record(
    out: &mut Vec<u8>,
    key: &[u8],
    header: &RecordHeader,
    payload: &[u8],
) -> u32 {
    debug_assert_eq!(payload.len(), header.payload_len);
    append_record_with(out, key, header, |out| out.extend_from_slice(payload))
}

/// Appends one record to `out` whose payload `fill` appends in place (exactly
/// `header.payload_len` bytes), saving the copy through an intermediate buffer; returns the
/// CRC32C of the payload.
pub(crate) fn append_record_with(
    out: &mut Vec<u8>,
    key: &[u8],
    header: &RecordHeader,
    fill: impl FnOnce(&mut Vec<u8>),
) -> u32 {
    debug_assert_eq!(key.len(), header.key_len);
    let start = out.len();
    out.extend_from_slice(RECORD_MAGIC);
    out.push(RECORD_VERSION);
    out.push(header.codec.id());
    out.extend_from_slice(&(key.len() as u16).to_le_bytes());
    out.extend_from_slice(&header.tokens.to_le_bytes());
    out.extend_from_slice(&(header.raw_len as u32).to_le_bytes());
    out.extend_from_slice(&(header.payload_len as u32).to_le_bytes());
    out.extend_from_slice(&header.layout.encode());
    out.extend_from_slice(&header.digest.0);
    let hcrc = crc32c::crc32c_append(crc32c::crc32c(&out[start..start + 44]), key);
    out.extend_from_slice(&hcrc.to_le_bytes());
    out.extend_from_slice(key);
    let p0 = out.len();
    fill(out);
    assert_eq!(
        out.len() - p0,
        header.payload_len,
        "record payload length differs from its header"
    );
    let pcrc = crc32c::crc32c(&out[p0..]);
    out.extend_from_slice(&pcrc.to_le_bytes());
    pcrc
}

/// Parses and checks the fixed header and the key of the record at the start of `b`.
/// Needs the 48 header bytes and the key; the payload is not looked at.
pub(crate) fn decode_header(b: &[u8]) -> Result<(RecordHeader, &[u8]), String> {
    if b.len() < RECORD_HEADER_LEN {
        return Err(format!("record header truncated ({} bytes)", b.len()));
    }
    if &b[0..4] != RECORD_MAGIC {
        return Err("bad record magic".into());
    }
    if b[4] != RECORD_VERSION {
        return Err(format!("unsupported record version {}", b[4]));
    }
    let key_len = u16::from_le_bytes([b[6], b[7]]) as usize;
    let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
    if b.len() < RECORD_HEADER_LEN + key_len {
        return Err("record key truncated".into());
    }
    let key = &b[RECORD_HEADER_LEN..RECORD_HEADER_LEN + key_len];
    let hcrc = crc32c::crc32c_append(crc32c::crc32c(&b[..44]), key);
    if hcrc != u32_at(44) {
        return Err("record header checksum mismatch".into());
    }
    let header = RecordHeader {
        codec: Codec::from_id(b[5]).map_err(|e| e.to_string())?,
        key_len,
        tokens: u32_at(8),
        raw_len: u32_at(12) as usize,
        payload_len: u32_at(16) as usize,
        layout: KvLayout::decode(&b[20..28]).map_err(|e| e.to_string())?,
        digest: TokenDigest(b[28..44].try_into().unwrap()),
    };
    if header.payload_len > MAX_PAYLOAD || header.raw_len > MAX_PAYLOAD {
        return Err(format!(
            "record payload length {} out of range",
            header.payload_len
        ));
    }
    Ok((header, key))
}

/// A record that passed every check.
#[derive(Debug)]
pub(crate) struct VerifiedRecord<'a> {
    pub header: RecordHeader,
    pub key: &'a [u8],
    pub payload: &'a [u8],
    pub payload_crc: u32,
}

/// Parses a whole record from the start of `b` and verifies both checksums.
pub(crate) fn decode_record(b: &[u8]) -> Result<VerifiedRecord<'_>, String> {
    let (header, key) = decode_header(b)?;
    let len = header.record_len();
    if b.len() < len {
        return Err(format!("record truncated ({} of {len} bytes)", b.len()));
    }
    let p0 = RECORD_HEADER_LEN + header.key_len;
    let payload = &b[p0..p0 + header.payload_len];
    let stored = u32::from_le_bytes(b[len - 4..len].try_into().unwrap());
    let crc = crc32c::crc32c(payload);
    if stored != crc {
        return Err(format!(
            "payload checksum mismatch (stored {stored:#010x}, computed {crc:#010x})"
        ));
    }
    Ok(VerifiedRecord {
        header,
        key,
        payload,
        payload_crc: crc,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use schema::DType;

    fn header(key_len: usize, payload_len: usize, codec: u8) -> RecordHeader {
        RecordHeader {
            codec: Codec::from_id(codec).unwrap(),
            key_len,
            tokens: 16,
            raw_len: payload_len * 2,
            payload_len,
            layout: KvLayout {
                layers: 2,
                kv_heads: 1,
                head_dim: 8,
                dtype: DType::F16,
            },
            digest: TokenDigest::of(&[1, 2, 3]),
        }
    }

    proptest! {
        #[test]
        fn records_round_trip(
            key in proptest::collection::vec(any::<u8>(), 0..100),
            payload in proptest::collection::vec(any::<u8>(), 0..3000),
            codec in 0u8..6,
        ) {
            let h = header(key.len(), payload.len(), codec);
            let mut buf = vec![0xAA; 3]; // records need not start at offset 0
            let crc = append_record(&mut buf, &key, &h, &payload);
            prop_assert_eq!(buf.len(), 3 + h.record_len());
            let r = decode_record(&buf[3..]).unwrap();
            prop_assert_eq!(&r.header, &h);
            prop_assert_eq!(r.key, &key[..]);
            prop_assert_eq!(r.payload, &payload[..]);
            prop_assert_eq!(r.payload_crc, crc);
        }

        #[test]
        fn any_flipped_bit_is_detected(
            key in proptest::collection::vec(any::<u8>(), 1..40),
            payload in proptest::collection::vec(any::<u8>(), 1..500),
            pos in any::<prop::sample::Index>(),
            bit in 0u8..8,
        ) {
            let h = header(key.len(), payload.len(), 1);
            let mut buf = Vec::new();
            append_record(&mut buf, &key, &h, &payload);
            let i = pos.index(buf.len());
            buf[i] ^= 1 << bit;
            prop_assert!(decode_record(&buf).is_err(), "flip at {} undetected", i);
        }

        #[test]
        fn truncation_is_detected(
            payload in proptest::collection::vec(any::<u8>(), 1..500),
            cut in any::<prop::sample::Index>(),
        ) {
            let h = header(24, payload.len(), 0);
            let mut buf = Vec::new();
            append_record(&mut buf, &[9u8; 24], &h, &payload);
            let n = cut.index(buf.len());
            prop_assert!(decode_record(&buf[..n]).is_err());
        }

        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode_record(&bytes);
            let _ = decode_segment_header(&bytes);
        }
    }

    #[test]
    fn padding_is_recognised_only_between_boundaries() {
        assert_eq!(align_up(0), 0);
        assert_eq!(align_up(1), ALIGN as u64);
        assert_eq!(align_up(ALIGN as u64), ALIGN as u64);
        let zeros = [0u8; 8];
        assert_eq!(padding_end(&zeros, 100), Some(ALIGN as u64));
        assert_eq!(
            padding_end(&zeros, 3 * ALIGN as u64 + 1),
            Some(4 * ALIGN as u64)
        );
        // A zero magic on a boundary is damage, not padding.
        assert_eq!(padding_end(&zeros, 2 * ALIGN as u64), None);
        // A record is never padding, and fewer than 4 bytes cannot tell.
        let mut rec = Vec::new();
        append_record(&mut rec, &[1; 4], &header(4, 8, 0), &[7; 8]);
        assert_eq!(padding_end(&rec, 100), None);
        assert_eq!(padding_end(&zeros[..3], 100), None);
    }

    #[test]
    fn segment_header_round_trips_and_detects_damage() {
        let mut h = encode_segment_header(42, 1_700_000_000_000);
        assert_eq!(decode_segment_header(&h), Ok(42));
        h[13] ^= 1;
        assert!(decode_segment_header(&h).is_err());
    }
}
