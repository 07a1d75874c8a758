//! The remote tier's object format: one immutable object per stored sequence.
//!
//! An object is named by its namespace and the digest of its tokens ([`crate::keys`]), so
//! two writers of the same chunk write the same name (whichever lands last is as good as the
//! other: both are the KV of those tokens under that model). A reader checks everything it
//! can before using the bytes: the magic and version, the checksum over the whole object,
//! and that the namespace and the tokens are the ones it asked for (a digest collision or a
//! misplaced object reads as corrupt, never as someone else's KV).
//!
//! Layout, version 1 (little endian):
//!
//! | offset | bytes | field |
//! |---:|---:|---|
//! | 0 | 4 | magic `RKVO` |
//! | 4 | 2 | format version (1) |
//! | 6 | 1 | codec (0: raw) |
//! | 7 | 1 | reserved (0) |
//! | 8 | 16 | namespace |
//! | 24 | 16 | token digest ([`schema::TokenDigest::of`]) |
//! | 40 | 8 | layout ([`KvLayout::encode`]) |
//! | 48 | 4 | token count `n` |
//! | 52 | 4 `n` | tokens, u32 each |
//! | 52 + 4 `n` | 8 | KV byte length `L` (= the layout's bytes for `n` tokens) |
//! | 60 + 4 `n` | `L` | KV, layer-major ([`schema::KvLayout`]) |
//! | end − 32 | 32 | blake3 of every byte before it |

use schema::{KvLayout, NamespaceId, TokenDigest};

use crate::error::{Error, Result};

/// First bytes of every object.
pub const MAGIC: [u8; 4] = *b"RKVO";
/// The format version this module writes and reads.
pub const VERSION: u16 = 1;
const HEADER: usize = 52;
const SUM: usize = 32;

/// The encoded object of `tokens`' KV (`kv`, `layout`) under `ns`.
pub fn encode(ns: NamespaceId, layout: KvLayout, tokens: &[u32], kv: &[u8]) -> Result<Vec<u8>> {
    let want = layout.bytes_for(tokens.len());
    if kv.len() != want || tokens.is_empty() {
        return Err(Error::Input {
            why: format!(
                "{} KV bytes for {} tokens; the layout needs {want}",
                kv.len(),
                tokens.len()
            ),
        });
    }
    let n = u32::try_from(tokens.len()).map_err(|_| Error::Input {
        why: format!("{} tokens in one object", tokens.len()),
    })?;
    let mut b = Vec::with_capacity(HEADER + 4 * tokens.len() + 8 + kv.len() + SUM);
    b.extend_from_slice(&MAGIC);
    b.extend_from_slice(&VERSION.to_le_bytes());
    b.extend_from_slice(&[0, 0]);
    b.extend_from_slice(&ns.0);
    b.extend_from_slice(&TokenDigest::of(tokens).0);
    b.extend_from_slice(&layout.encode());
    b.extend_from_slice(&n.to_le_bytes());
    for t in tokens {
        b.extend_from_slice(&t.to_le_bytes());
    }
    b.extend_from_slice(&(kv.len() as u64).to_le_bytes());
    b.extend_from_slice(kv);
    let sum = blake3::hash(&b);
    b.extend_from_slice(sum.as_bytes());
    Ok(b)
}

/// A verified object's layout and where its KV lies in the object's bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decoded {
    /// The KV layout the object states.
    pub layout: KvLayout,
    /// Where the layer-major KV bytes lie in the object.
    pub kv: std::ops::Range<usize>,
}

/// Verifies `b` as the object of `tokens` under `ns` (see the module docs); `key` names it
/// in errors.
pub fn decode(b: &[u8], ns: NamespaceId, tokens: &[u32], key: &str) -> Result<Decoded> {
    let corrupt = |why: String| Error::Corrupt {
        key: key.to_string(),
        why,
    };
    if b.len() < HEADER + 8 + SUM {
        return Err(corrupt(format!(
            "{} bytes is shorter than any object",
            b.len()
        )));
    }
    if b[..4] != MAGIC {
        return Err(corrupt("not a ragkv KV object (magic)".into()));
    }
    let version = u16::from_le_bytes([b[4], b[5]]);
    if version != VERSION {
        return Err(corrupt(format!(
            "format version {version}; this build reads {VERSION}"
        )));
    }
    let (body, sum) = b.split_at(b.len() - SUM);
    if blake3::hash(body).as_bytes() != sum {
        return Err(corrupt("checksum mismatch".into()));
    }
    if b[6] != 0 {
        return Err(corrupt(format!("codec {} is unknown", b[6])));
    }
    if b[8..24] != ns.0 {
        return Err(corrupt("written under another namespace".into()));
    }
    let layout = KvLayout::decode(&b[40..48]).map_err(|e| corrupt(format!("layout: {e}")))?;
    let n = u32::from_le_bytes(b[48..52].try_into().expect("4 bytes")) as usize;
    let kv_at = HEADER + 4 * n + 8;
    if n != tokens.len() || body.len() < kv_at {
        return Err(corrupt(format!(
            "{n} tokens stored, {} asked for",
            tokens.len()
        )));
    }
    let same = b[HEADER..HEADER + 4 * n]
        .chunks_exact(4)
        .zip(tokens)
        .all(|(c, t)| u32::from_le_bytes(c.try_into().expect("4 bytes")) == *t);
    if !same || b[24..40] != TokenDigest::of(tokens).0 {
        return Err(corrupt("stored for other tokens".into()));
    }
    let len = u64::from_le_bytes(b[kv_at - 8..kv_at].try_into().expect("8 bytes")) as usize;
    if len != layout.bytes_for(n) || kv_at + len != body.len() {
        return Err(corrupt(format!(
            "{len} KV bytes; the layout needs {} and the object holds {}",
            layout.bytes_for(n),
            body.len().saturating_sub(kv_at)
        )));
    }
    Ok(Decoded {
        layout,
        kv: kv_at..kv_at + len,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use schema::DType;

    fn layout(layers: u16) -> KvLayout {
        KvLayout {
            layers,
            kv_heads: 1,
            head_dim: 2,
            dtype: DType::F16,
        }
    }

    proptest! {
        #[test]
        fn round_trips_and_every_flipped_byte_is_caught(
            tokens in proptest::collection::vec(any::<u32>(), 1..40),
            layers in 1u16..4,
            seed in any::<u8>(),
            flip in any::<prop::sample::Index>(),
        ) {
            let l = layout(layers);
            let kv: Vec<u8> = (0..l.bytes_for(tokens.len())).map(|i| (i as u8) ^ seed).collect();
            let ns = NamespaceId([seed; 16]);
            let b = encode(ns, l, &tokens, &kv).unwrap();
            let d = decode(&b, ns, &tokens, "k").unwrap();
            prop_assert_eq!(d.layout, l);
            prop_assert_eq!(&b[d.kv.clone()], &kv[..]);
            let mut bad = b.clone();
            let i = flip.index(bad.len());
            bad[i] ^= 1;
            prop_assert!(decode(&bad, ns, &tokens, "k").is_err());
            // Truncated, or asked for under other tokens or another namespace: refused.
            prop_assert!(decode(&b[..b.len() - 1], ns, &tokens, "k").is_err());
            let mut other = tokens.clone();
            other[0] ^= 1;
            prop_assert!(decode(&b, ns, &other, "k").is_err());
            prop_assert!(decode(&b, NamespaceId([seed ^ 1; 16]), &tokens, "k").is_err());
        }
    }

    #[test]
    fn bad_input_is_refused_before_writing() {
        let l = layout(2);
        assert!(encode(NamespaceId([0; 16]), l, &[1, 2], &[0; 3]).is_err());
        assert!(encode(NamespaceId([0; 16]), l, &[], &[]).is_err());
        let e = decode(b"RKVO", NamespaceId([0; 16]), &[1], "kv/x").unwrap_err();
        assert!(e.to_string().contains("kv/x"), "{e}");
    }
}
