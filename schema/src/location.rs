//! The location record: what the KV index stores for each block.
//!
//! Encoding, version 1 (60 bytes, little-endian):
//!
//! | offset | size | field                                                   |
//! |-------:|-----:|---------------------------------------------------------|
//! | 0      | 1    | format version (`1`)                                    |
//! | 1      | 1    | codec id ([`Codec::id`])                                |
//! | 2      | 2    | reserved, zero                                          |
//! | 4      | 8    | segment id                                              |
//! | 12     | 8    | offset of the record in the segment file                |
//! | 20     | 4    | record length in bytes (header, key, payload, checksum) |
//! | 24     | 8    | KV layout ([`KvLayout::encode`])                        |
//! | 32     | 4    | token count of the block                                |
//! | 36     | 16   | token digest of the whole prefix ending with this block |
//! | 52     | 4    | CRC32C of the encoded payload                           |
//! | 56     | 4    | reserved, zero                                          |
//!
//! Decoders accept longer records (fields appended by later versions of the same major layout
//! bump the version byte), and reject versions they do not know.

use crate::{KvLayout, SchemaError, TokenDigest};

/// Current location encoding version.
pub const LOCATION_VERSION: u8 = 1;
const LEN_V1: usize = 60;

/// How a block's payload is encoded in the tensor log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Codec {
    /// Raw layer-major bytes.
    None,
    /// LZ4 block compression.
    Lz4,
    /// Zstandard.
    Zstd,
    /// Byte planes (byte `i` of every element together), then LZ4.
    Lz4Planes,
    /// Byte planes, then Zstandard.
    ZstdPlanes,
    /// Lossy: int8 with one f32 scale per (layer, K/V, head) over the block.
    Int8,
    /// Lossy: 8 bits per value, per token in groups of 64 (or 32) with f16 scales.
    Q8,
    /// Lossy: 4 bits per value, keys per channel and values per token, f16 scale and
    /// minimum per group; planes too coarse at 4 bits kept at 8.
    Q4,
}

impl Codec {
    /// Every codec, in id order.
    pub const ALL: [Codec; 8] = [
        Codec::None,
        Codec::Lz4,
        Codec::Zstd,
        Codec::Lz4Planes,
        Codec::ZstdPlanes,
        Codec::Int8,
        Codec::Q8,
        Codec::Q4,
    ];

    /// Stable one-byte id used on disk.
    pub const fn id(self) -> u8 {
        match self {
            Codec::None => 0,
            Codec::Lz4 => 1,
            Codec::Zstd => 2,
            Codec::Lz4Planes => 3,
            Codec::ZstdPlanes => 4,
            Codec::Int8 => 5,
            Codec::Q8 => 6,
            Codec::Q4 => 7,
        }
    }

    /// Inverse of [`Codec::id`].
    pub fn from_id(id: u8) -> Result<Self, SchemaError> {
        Codec::ALL
            .get(id as usize)
            .copied()
            .ok_or(SchemaError::InvalidField {
                what: "location",
                field: "codec",
                value: id.into(),
            })
    }

    /// Whether decoding gives back exactly the bytes that were encoded.
    pub const fn is_lossless(self) -> bool {
        !matches!(self, Codec::Int8 | Codec::Q8 | Codec::Q4)
    }

    /// Name used in configuration files.
    pub const fn name(self) -> &'static str {
        match self {
            Codec::None => "none",
            Codec::Lz4 => "lz4",
            Codec::Zstd => "zstd",
            Codec::Lz4Planes => "lz4-planes",
            Codec::ZstdPlanes => "zstd-planes",
            Codec::Int8 => "int8",
            Codec::Q8 => "q8",
            Codec::Q4 => "q4",
        }
    }

    /// Parses [`Codec::name`].
    pub fn from_name(s: &str) -> Option<Self> {
        Codec::ALL.into_iter().find(|c| c.name() == s)
    }
}

impl std::fmt::Display for Codec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Where a block's KV lives and what it must verify as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    /// Segment file id.
    pub segment: u64,
    /// Byte offset of the record in the segment.
    pub offset: u64,
    /// Length of the whole record (header, key, payload, trailer).
    pub length: u32,
    /// Codec of the payload.
    pub codec: Codec,
    /// KV layout of the block.
    pub layout: KvLayout,
    /// Tokens in the block.
    pub tokens: u32,
    /// Digest of the token prefix up to the block's end, checked on read.
    pub digest: TokenDigest,
    /// CRC32C of the encoded payload, checked on read.
    pub payload_crc: u32,
}

impl Location {
    /// Encodes the record at [`LOCATION_VERSION`].
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(LEN_V1);
        b.push(LOCATION_VERSION);
        b.push(self.codec.id());
        b.extend_from_slice(&[0, 0]);
        b.extend_from_slice(&self.segment.to_le_bytes());
        b.extend_from_slice(&self.offset.to_le_bytes());
        b.extend_from_slice(&self.length.to_le_bytes());
        b.extend_from_slice(&self.layout.encode());
        b.extend_from_slice(&self.tokens.to_le_bytes());
        b.extend_from_slice(&self.digest.0);
        b.extend_from_slice(&self.payload_crc.to_le_bytes());
        b.extend_from_slice(&[0u8; 4]);
        debug_assert_eq!(b.len(), LEN_V1);
        b
    }

    /// Decodes a record written by [`Location::encode`].
    pub fn decode(b: &[u8]) -> Result<Self, SchemaError> {
        let Some(&version) = b.first() else {
            return Err(SchemaError::Truncated {
                what: "location",
                got: 0,
                need: LEN_V1,
            });
        };
        if version != LOCATION_VERSION {
            return Err(SchemaError::UnsupportedVersion {
                what: "location",
                version,
            });
        }
        if b.len() < LEN_V1 {
            return Err(SchemaError::Truncated {
                what: "location",
                got: b.len(),
                need: LEN_V1,
            });
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        Ok(Location {
            codec: Codec::from_id(b[1])?,
            segment: u64_at(4),
            offset: u64_at(12),
            length: u32_at(20),
            layout: KvLayout::decode(&b[24..32])?,
            tokens: u32_at(32),
            digest: TokenDigest(b[36..52].try_into().unwrap()),
            payload_crc: u32_at(52),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;
    use proptest::prelude::*;

    fn arb_location() -> impl Strategy<Value = Location> {
        (
            any::<u64>(),
            any::<u64>(),
            any::<u32>(),
            0u8..6,
            (1u16.., 1u16.., 1u16.., 0u8..3),
            any::<u32>(),
            any::<[u8; 16]>(),
            any::<u32>(),
        )
            .prop_map(
                |(segment, offset, length, codec, l, tokens, d, crc)| Location {
                    segment,
                    offset,
                    length,
                    codec: Codec::from_id(codec).unwrap(),
                    layout: KvLayout {
                        layers: l.0,
                        kv_heads: l.1,
                        head_dim: l.2,
                        dtype: DType::from_id(l.3).unwrap(),
                    },
                    tokens,
                    digest: TokenDigest(d),
                    payload_crc: crc,
                },
            )
    }

    proptest! {
        #[test]
        fn location_round_trips(loc in arb_location()) {
            prop_assert_eq!(Location::decode(&loc.encode()).unwrap(), loc);
        }

        #[test]
        fn truncated_locations_are_rejected(loc in arb_location(), cut in 0usize..LEN_V1) {
            prop_assert!(Location::decode(&loc.encode()[..cut]).is_err());
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
            let _ = Location::decode(&bytes);
        }
    }

    #[test]
    fn unknown_version_and_codec_are_rejected() {
        let loc = Location {
            segment: 1,
            offset: 2,
            length: 3,
            codec: Codec::Zstd,
            layout: KvLayout {
                layers: 1,
                kv_heads: 1,
                head_dim: 1,
                dtype: DType::F32,
            },
            tokens: 4,
            digest: TokenDigest::EMPTY,
            payload_crc: 5,
        };
        let mut b = loc.encode();
        b[0] = 2;
        assert!(matches!(
            Location::decode(&b),
            Err(SchemaError::UnsupportedVersion { version: 2, .. })
        ));
        let mut b = loc.encode();
        b[1] = 77;
        assert!(Location::decode(&b).is_err());
        for c in Codec::ALL {
            assert_eq!(Codec::from_name(c.name()), Some(c));
        }
    }
}
