//! The KV tensor layout shared by the model runtime and the store.
//!
//! KV bytes for `n` tokens are laid out **layer-major**, little-endian:
//!
//! ```text
//! for layer in 0..layers:
//!     for kv in [K, V]:
//!         for token in 0..n:
//!             for head in 0..kv_heads:
//!                 head_dim elements of `dtype`
//! ```
//!
//! Keys are stored after RoPE. Because every `(layer, K/V)` plane is token-contiguous, a block of
//! tokens is `2 * layers` contiguous slices, and blocks concatenate by plane.

use serde::{Deserialize, Serialize};

use crate::SchemaError;

/// Element type of stored KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// IEEE 754 single precision (4 bytes).
    F32,
    /// IEEE 754 half precision (2 bytes).
    F16,
    /// bfloat16 (2 bytes).
    BF16,
}

impl DType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// Stable one-byte id used in on-disk records.
    pub const fn id(self) -> u8 {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::BF16 => 2,
        }
    }

    /// Inverse of [`DType::id`].
    pub fn from_id(id: u8) -> Result<Self, SchemaError> {
        match id {
            0 => Ok(DType::F32),
            1 => Ok(DType::F16),
            2 => Ok(DType::BF16),
            v => Err(SchemaError::InvalidField {
                what: "kv layout",
                field: "dtype",
                value: v.into(),
            }),
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        })
    }
}

/// Shape of a model's KV cache per token: see the module docs for the byte order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvLayout {
    /// Decoder layers.
    pub layers: u16,
    /// Key/value heads per layer.
    pub kv_heads: u16,
    /// Elements per head.
    pub head_dim: u16,
    /// Element type.
    pub dtype: DType,
}

impl KvLayout {
    /// Encoded size in bytes.
    pub const ENCODED_LEN: usize = 8;

    /// Bytes of one token in one `(layer, K/V)` plane.
    pub const fn plane_token_bytes(&self) -> usize {
        self.kv_heads as usize * self.head_dim as usize * self.dtype.size()
    }

    /// Number of `(layer, K/V)` planes.
    pub const fn planes(&self) -> usize {
        self.layers as usize * 2
    }

    /// Bytes of KV per token across all layers, keys and values.
    pub const fn bytes_per_token(&self) -> usize {
        self.planes() * self.plane_token_bytes()
    }

    /// Bytes of KV for `tokens` tokens.
    pub const fn bytes_for(&self, tokens: usize) -> usize {
        self.bytes_per_token() * tokens
    }

    /// `layers u16 | kv_heads u16 | head_dim u16 | dtype u8 | reserved u8`, little-endian.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut b = [0u8; Self::ENCODED_LEN];
        b[0..2].copy_from_slice(&self.layers.to_le_bytes());
        b[2..4].copy_from_slice(&self.kv_heads.to_le_bytes());
        b[4..6].copy_from_slice(&self.head_dim.to_le_bytes());
        b[6] = self.dtype.id();
        b
    }

    /// Inverse of [`KvLayout::encode`].
    pub fn decode(b: &[u8]) -> Result<Self, SchemaError> {
        if b.len() < Self::ENCODED_LEN {
            return Err(SchemaError::Truncated {
                what: "kv layout",
                got: b.len(),
                need: Self::ENCODED_LEN,
            });
        }
        let layout = KvLayout {
            layers: u16::from_le_bytes([b[0], b[1]]),
            kv_heads: u16::from_le_bytes([b[2], b[3]]),
            head_dim: u16::from_le_bytes([b[4], b[5]]),
            dtype: DType::from_id(b[6])?,
        };
        if layout.bytes_per_token() == 0 {
            return Err(SchemaError::InvalidField {
                what: "kv layout",
                field: "bytes per token",
                value: 0,
            });
        }
        Ok(layout)
    }
}

impl std::fmt::Display for KvLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}L x {}H x {}D {}",
            self.layers, self.kv_heads, self.head_dim, self.dtype
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smollm2_kv_is_46_kb_per_token_in_f32() {
        let l = KvLayout {
            layers: 30,
            kv_heads: 3,
            head_dim: 64,
            dtype: DType::F32,
        };
        assert_eq!(l.bytes_per_token(), 46_080);
        assert_eq!(KvLayout::decode(&l.encode()).unwrap(), l);
    }

    #[test]
    fn bad_dtype_and_empty_layout_are_rejected() {
        let mut b = KvLayout {
            layers: 1,
            kv_heads: 1,
            head_dim: 1,
            dtype: DType::F16,
        }
        .encode();
        b[6] = 9;
        assert!(KvLayout::decode(&b).is_err());
        assert!(KvLayout::decode(&[0u8; 8]).is_err());
        assert!(KvLayout::decode(&[0u8; 3]).is_err());
    }
}
