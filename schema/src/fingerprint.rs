//! Identity: which computation produced a KV cache, and which tokens it covers.
//!
//! A [`NamespaceId`] is derived from a [`ModelFingerprint`]: every input that changes the KV a
//! prefill produces is part of it, so a change of any of them is a new namespace and nothing is
//! ever reused across namespaces (docs/DESIGN.md, rule 1).

use serde::{Deserialize, Serialize};

use crate::layout::KvLayout;
use crate::location::Codec;

/// Everything that determines the KV a prefill produces.
///
/// Fields are free-form strings produced by the layer that owns them (for example the model
/// crate hashes its weights, the ingest crate describes its chunker settings); the namespace is a
/// hash of their canonical encoding.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelFingerprint {
    /// Content hash (or pinned revision) of the weights.
    pub weights: String,
    /// KV layout, including the dtype the KV is computed in.
    pub layout: KvLayout,
    /// Hash of the tokenizer definition.
    pub tokenizer: String,
    /// RoPE parameters (theta, scaling) and position scheme.
    pub positions: String,
    /// Chunker version and settings.
    pub chunker: String,
    /// Prompt template placed around each chunk.
    pub template: String,
}

impl ModelFingerprint {
    /// The namespace this fingerprint maps to.
    pub fn namespace(&self) -> NamespaceId {
        self.hash(None)
    }

    /// The namespace of this fingerprint's KV stored with `codec`. A lossless codec changes
    /// no value, so its KV is the fingerprint's own namespace ([`Self::namespace`]; its
    /// records name their codec, and stores may mix them); a lossy one (`q8`, `q4`, `int8`)
    /// stores other values, so each is a namespace of its own, fixed at creation: a store
    /// moves to another lossy codec by re-materializing into the new namespace.
    pub fn namespace_with_codec(&self, codec: Codec) -> NamespaceId {
        if codec.is_lossless() {
            self.hash(None)
        } else {
            self.hash(Some(codec.name()))
        }
    }

    fn hash(&self, codec: Option<&str>) -> NamespaceId {
        let mut h = blake3::Hasher::new();
        h.update(b"ragkv-namespace-v1\0");
        let codec = codec.map(|c| format!("lossy-kv-codec:{c}"));
        for field in [
            self.weights.as_bytes(),
            &self.layout.encode(),
            self.tokenizer.as_bytes(),
            self.positions.as_bytes(),
            self.chunker.as_bytes(),
            self.template.as_bytes(),
        ]
        .into_iter()
        .chain(codec.as_ref().map(|c| c.as_bytes()))
        {
            // Length-prefixed, so that field boundaries cannot shift.
            h.update(&(field.len() as u64).to_le_bytes());
            h.update(field);
        }
        let mut id = [0u8; 16];
        id.copy_from_slice(&h.finalize().as_bytes()[..16]);
        NamespaceId(id)
    }
}

/// A KV namespace: 16 bytes of the fingerprint hash.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NamespaceId(pub [u8; 16]);

impl NamespaceId {
    /// Hex form, as shown to operators.
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }

    /// Parses the hex form.
    pub fn from_hex(s: &str) -> Option<Self> {
        let b = unhex(s)?;
        Some(NamespaceId(b.try_into().ok()?))
    }
}

impl std::fmt::Debug for NamespaceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ns:{}", self.to_hex())
    }
}

impl std::fmt::Display for NamespaceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// Digest of a token sequence (blake3 over the token ids as u32 little-endian, first 16 bytes).
///
/// Digests chain: `d.extend(piece)` hashes `d`, the piece's length and its tokens, so a store can
/// digest every block prefix of a sequence in one pass. A chained digest covers the tokens *and*
/// how they were cut into pieces; the store always cuts at fixed block boundaries, so equal
/// prefixes give equal digests.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct TokenDigest(pub [u8; 16]);

impl TokenDigest {
    /// The digest of the empty sequence.
    pub const EMPTY: TokenDigest = TokenDigest([0u8; 16]);

    /// Digest of `tokens`.
    pub fn of(tokens: &[u32]) -> Self {
        Self::EMPTY.extend(tokens)
    }

    /// Digest of the sequence this digest covers followed by `tokens`: the first 16 bytes of
    /// blake3(previous digest ‖ u64 LE token count ‖ tokens as u32 LE).
    pub fn extend(&self, tokens: &[u32]) -> Self {
        let mut h = blake3::Hasher::new();
        h.update(&self.0);
        h.update(&(tokens.len() as u64).to_le_bytes());
        // Tokens go to the hasher in runs of 64 from a stack buffer: one `update` per token
        // costs more than the hashing itself at block sizes (the digest is the same).
        let mut buf = [0u8; 256];
        for run in tokens.chunks(64) {
            for (b, t) in buf.chunks_exact_mut(4).zip(run) {
                b.copy_from_slice(&t.to_le_bytes());
            }
            h.update(&buf[..run.len() * 4]);
        }
        let mut d = [0u8; 16];
        d.copy_from_slice(&h.finalize().as_bytes()[..16]);
        TokenDigest(d)
    }
}

impl std::fmt::Debug for TokenDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "digest:{}", hex(&self.0))
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    fn fp() -> ModelFingerprint {
        ModelFingerprint {
            weights: "w".into(),
            layout: KvLayout {
                layers: 2,
                kv_heads: 1,
                head_dim: 8,
                dtype: DType::F32,
            },
            tokenizer: "t".into(),
            positions: "rope:10000".into(),
            chunker: "c".into(),
            template: "".into(),
        }
    }

    #[test]
    fn every_field_changes_the_namespace() {
        let base = fp().namespace();
        let mut f = fp();
        f.weights.push('x');
        assert_ne!(f.namespace(), base);
        let mut f = fp();
        f.layout.dtype = DType::F16;
        assert_ne!(f.namespace(), base);
        let mut f = fp();
        f.chunker = "c2".into();
        assert_ne!(f.namespace(), base);
        // Shifting bytes between fields is a different namespace too.
        let mut f = fp();
        f.tokenizer = "".into();
        f.positions = "trope:10000".into();
        assert_ne!(f.namespace(), base);
        assert_eq!(fp().namespace(), base);
        assert_eq!(NamespaceId::from_hex(&base.to_hex()), Some(base));
    }

    #[test]
    fn lossless_codecs_share_the_namespace_and_lossy_ones_each_have_their_own() {
        let base = fp().namespace();
        // What this fingerprint hashed to before codecs entered the namespace: stores written
        // then must keep their namespaces.
        assert_eq!(base.to_hex(), "9111dc7bb355a4747514c2d664734830");
        for c in [Codec::None, Codec::Lz4, Codec::Zstd, Codec::ZstdPlanes] {
            assert_eq!(fp().namespace_with_codec(c), base, "{c}");
        }
        let lossy: Vec<NamespaceId> = [Codec::Q8, Codec::Q4, Codec::Int8]
            .iter()
            .map(|c| fp().namespace_with_codec(*c))
            .collect();
        assert!(lossy.iter().all(|n| *n != base));
        assert!(lossy[0] != lossy[1] && lossy[1] != lossy[2] && lossy[0] != lossy[2]);
    }

    #[test]
    fn digests_chain_and_see_every_token() {
        let all = [1u32, 2, 3, 4, 5];
        let chained = TokenDigest::of(&all[..2]).extend(&all[2..]);
        assert_eq!(
            chained,
            TokenDigest::EMPTY.extend(&[1, 2]).extend(&[3, 4, 5])
        );
        let mut other = all;
        for i in 0..all.len() {
            other[i] += 1;
            assert_ne!(TokenDigest::of(&other[..2]).extend(&other[2..]), chained);
            other[i] -= 1;
        }
        assert_ne!(TokenDigest::of(&all), TokenDigest::of(&all[..4]));
        assert_ne!(TokenDigest::of(&[1, 2]), TokenDigest::of(&[2, 1]));
    }

    #[test]
    fn token_digest_is_the_documented_hash() {
        // Reference: one `update` per field and token, as the on-disk keys were first written.
        let reference = |prev: &TokenDigest, tokens: &[u32]| {
            let mut h = blake3::Hasher::new();
            h.update(&prev.0);
            h.update(&(tokens.len() as u64).to_le_bytes());
            for t in tokens {
                h.update(&t.to_le_bytes());
            }
            TokenDigest(h.finalize().as_bytes()[..16].try_into().unwrap())
        };
        let tokens: Vec<u32> = (0..300u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
        let prev = TokenDigest::of(&[7, 8, 9]);
        for n in [0, 1, 15, 16, 63, 64, 65, 128, 255, 300] {
            assert_eq!(
                prev.extend(&tokens[..n]),
                reference(&prev, &tokens[..n]),
                "{n}"
            );
        }
    }
}
