//! Payload codecs, chosen per namespace and applied per block (never per token).
//!
//! - `none`: raw layer-major bytes.
//! - `lz4`, `zstd`: general-purpose compression of the raw bytes.
//! - `lz4-planes`, `zstd-planes`: the bytes of every element are first split into byte planes
//!   (all first bytes, then all second bytes, ...). The sign/exponent bytes of KV values are
//!   highly repetitive while mantissa bytes are noise; splitting lets the compressor find that.
//! - `int8` (lossy, opt-in): one f32 scale per `(layer, K/V, head)` over the block, values
//!   rounded to `round(x / scale)` in `-127..=127`. Encoded as `planes × kv_heads` little-endian
//!   f32 scales, then one i8 per element in layout order. Decodes back to the layout's dtype.
//!   Superseded by `q8`, whose groups are smaller; kept so stores that use it stay readable.
//! - `q8`, `q4` (lossy): grouped quantization with f16 scales, formats in [`crate::quant`];
//!   decoded straight into the block's place in the reader's buffer
//!   ([`crate::quant::decode_into_place`]).

use schema::{Codec, KvLayout};

use crate::quant::{read_elem, write_elem};

/// Encodes `raw` (layer-major KV of `tokens` tokens; `first`: the block starts its chunk).
pub(crate) fn encode(
    codec: Codec,
    layout: &KvLayout,
    tokens: usize,
    raw: &[u8],
    zstd_level: i32,
    first: bool,
) -> Result<Vec<u8>, String> {
    Ok(match codec {
        Codec::None => raw.to_vec(),
        Codec::Lz4 => lz4_flex::block::compress(raw),
        Codec::Zstd => zstd::bulk::compress(raw, zstd_level).map_err(|e| e.to_string())?,
        Codec::Lz4Planes => lz4_flex::block::compress(&split_planes(raw, layout.dtype.size())),
        Codec::ZstdPlanes => {
            zstd::bulk::compress(&split_planes(raw, layout.dtype.size()), zstd_level)
                .map_err(|e| e.to_string())?
        }
        Codec::Int8 => int8_encode(layout, tokens, raw),
        Codec::Q8 => crate::quant::encode(layout, tokens, raw, 8, first)?,
        Codec::Q4 => crate::quant::encode(layout, tokens, raw, 4, first)?,
    })
}

/// Decodes `enc` into `out`, which must be exactly the decoded length.
pub(crate) fn decode_into(
    codec: Codec,
    layout: &KvLayout,
    tokens: usize,
    enc: &[u8],
    out: &mut [u8],
) -> Result<(), String> {
    let want = out.len();
    let check = |n: usize| {
        if n == want {
            Ok(())
        } else {
            Err(format!("decoded {n} bytes, expected {want}"))
        }
    };
    match codec {
        Codec::None => {
            check(enc.len())?;
            out.copy_from_slice(enc);
        }
        Codec::Lz4 => {
            let n = lz4_flex::block::decompress_into(enc, out).map_err(|e| e.to_string())?;
            check(n)?;
        }
        Codec::Zstd => {
            let n = zstd::bulk::decompress_to_buffer(enc, out).map_err(|e| e.to_string())?;
            check(n)?;
        }
        Codec::Lz4Planes | Codec::ZstdPlanes => {
            let mut planes = vec![0u8; out.len()];
            let n = if codec == Codec::Lz4Planes {
                lz4_flex::block::decompress_into(enc, &mut planes).map_err(|e| e.to_string())?
            } else {
                zstd::bulk::decompress_to_buffer(enc, &mut planes).map_err(|e| e.to_string())?
            };
            check(n)?;
            join_planes(&planes, layout.dtype.size(), out);
        }
        Codec::Int8 => int8_decode(layout, tokens, enc, out)?,
        Codec::Q8 | Codec::Q4 => {
            crate::quant::decode_into_place(layout, tokens, enc, out, tokens, 0)?
        }
    }
    Ok(())
}

/// Encodes one block of KV (`tokens` tokens of layer-major `raw` in `layout`, starting at
/// token `start` of its chunk) as the store writes it with `codec` (zstd at level 3). For
/// tools and measurements; the store encodes on its own.
pub fn encode_block(
    codec: Codec,
    layout: &KvLayout,
    tokens: usize,
    raw: &[u8],
    start: usize,
) -> crate::Result<Vec<u8>> {
    check_len(layout, tokens, raw.len())?;
    encode(codec, layout, tokens, raw, 3, start == 0).map_err(|why| crate::Error::Invalid {
        what: "KV block",
        why,
    })
}

/// Decodes a block [`encode_block`] wrote into `out` (its layer-major bytes in `layout`'s
/// dtype, exactly `layout.bytes_for(tokens)` long), as a read does.
pub fn decode_block(
    codec: Codec,
    layout: &KvLayout,
    tokens: usize,
    enc: &[u8],
    out: &mut [u8],
) -> crate::Result<()> {
    check_len(layout, tokens, out.len())?;
    decode_into(codec, layout, tokens, enc, out).map_err(|why| crate::Error::Invalid {
        what: "KV block",
        why,
    })
}

/// `len` must be the raw bytes of `tokens` tokens in `layout`.
fn check_len(layout: &KvLayout, tokens: usize, len: usize) -> crate::Result<()> {
    if len == layout.bytes_for(tokens) {
        return Ok(());
    }
    Err(crate::Error::KvSize {
        got: len,
        expected: layout.bytes_for(tokens),
        tokens,
        layout: *layout,
    })
}

/// Whether `codec` decodes a block straight into its place in a layer-major buffer
/// ([`crate::quant::decode_into_place`]); the others decode into a scratch buffer that is
/// then scattered.
pub(crate) fn decodes_in_place(codec: Codec) -> bool {
    matches!(codec, Codec::Q8 | Codec::Q4)
}

fn split_planes(raw: &[u8], size: usize) -> Vec<u8> {
    let n = raw.len() / size;
    let mut out = vec![0u8; raw.len()];
    for (i, elem) in raw.chunks_exact(size).enumerate() {
        for (p, b) in elem.iter().enumerate() {
            out[p * n + i] = *b;
        }
    }
    // A trailing partial element (never produced by a valid layout) is kept as is.
    let tail = n * size;
    out[tail..].copy_from_slice(&raw[tail..]);
    out
}

fn join_planes(planes: &[u8], size: usize, out: &mut [u8]) {
    let n = planes.len() / size;
    for (i, elem) in out.chunks_exact_mut(size).enumerate() {
        for (p, b) in elem.iter_mut().enumerate() {
            *b = planes[p * n + i];
        }
    }
    let tail = n * size;
    out[tail..].copy_from_slice(&planes[tail..]);
}

/// Visits `(scale group, element index)` in layout order: group = plane * kv_heads + head.
fn for_each_elem(layout: &KvLayout, tokens: usize, mut f: impl FnMut(usize, usize)) {
    let (heads, dim) = (layout.kv_heads as usize, layout.head_dim as usize);
    let mut i = 0;
    for plane in 0..layout.planes() {
        for _t in 0..tokens {
            for h in 0..heads {
                for _d in 0..dim {
                    f(plane * heads + h, i);
                    i += 1;
                }
            }
        }
    }
}

fn int8_encode(layout: &KvLayout, tokens: usize, raw: &[u8]) -> Vec<u8> {
    let size = layout.dtype.size();
    let groups = layout.planes() * layout.kv_heads as usize;
    let mut max = vec![0f32; groups];
    for_each_elem(layout, tokens, |g, i| {
        let x = read_elem(layout.dtype, &raw[i * size..]).abs();
        if x.is_finite() && x > max[g] {
            max[g] = x;
        }
    });
    let scales: Vec<f32> = max
        .iter()
        .map(|m| if *m > 0.0 { m / 127.0 } else { 1.0 })
        .collect();
    let mut out = Vec::with_capacity(groups * 4 + raw.len() / size);
    for s in &scales {
        out.extend_from_slice(&s.to_le_bytes());
    }
    for_each_elem(layout, tokens, |g, i| {
        let x = read_elem(layout.dtype, &raw[i * size..]);
        out.push((x / scales[g]).round().clamp(-127.0, 127.0) as i8 as u8);
    });
    out
}

fn int8_decode(layout: &KvLayout, tokens: usize, enc: &[u8], out: &mut [u8]) -> Result<(), String> {
    let size = layout.dtype.size();
    let groups = layout.planes() * layout.kv_heads as usize;
    let elems = out.len() / size;
    if enc.len() != groups * 4 + elems || elems * size != out.len() {
        return Err(format!(
            "int8 payload has {} bytes, expected {}",
            enc.len(),
            groups * 4 + elems
        ));
    }
    let scales: Vec<f32> = enc[..groups * 4]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let q = &enc[groups * 4..];
    for_each_elem(layout, tokens, |g, i| {
        let x = q[i] as i8 as f32 * scales[g];
        write_elem(layout.dtype, x, &mut out[i * size..(i + 1) * size]);
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use schema::DType;

    fn layout(dtype: DType) -> KvLayout {
        KvLayout {
            layers: 2,
            kv_heads: 2,
            head_dim: 4,
            dtype,
        }
    }

    fn kv(dtype: DType, tokens: usize, seed: u32) -> Vec<u8> {
        let l = layout(dtype);
        let n = l.bytes_for(tokens) / dtype.size();
        let mut out = vec![0u8; l.bytes_for(tokens)];
        for i in 0..n {
            let x = ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 2000) as f32 / 100.0
                - 10.0;
            write_elem(dtype, x, &mut out[i * dtype.size()..(i + 1) * dtype.size()]);
        }
        out
    }

    proptest! {
        #[test]
        fn lossless_codecs_round_trip(dt in 0u8..3, tokens in 1usize..20, seed in any::<u32>(), c in 0u8..5) {
            let dtype = DType::from_id(dt).unwrap();
            let codec = Codec::from_id(c).unwrap();
            let l = layout(dtype);
            let raw = kv(dtype, tokens, seed);
            let enc = encode(codec, &l, tokens, &raw, 3, true).unwrap();
            let mut out = vec![0u8; raw.len()];
            decode_into(codec, &l, tokens, &enc, &mut out).unwrap();
            prop_assert_eq!(out, raw);
        }

        #[test]
        fn planes_round_trip(raw in proptest::collection::vec(any::<u8>(), 0..300), size in 1usize..5) {
            let planes = split_planes(&raw, size);
            let mut out = vec![0u8; raw.len()];
            join_planes(&planes, size, &mut out);
            prop_assert_eq!(out, raw);
        }

        #[test]
        fn corrupt_compressed_input_is_an_error_not_a_panic(
            garbage in proptest::collection::vec(any::<u8>(), 0..200), c in 1u8..8,
        ) {
            let l = layout(DType::F32);
            let mut out = vec![0u8; l.bytes_for(3)];
            let _ = decode_into(Codec::from_id(c).unwrap(), &l, 3, &garbage, &mut out);
        }
    }

    #[test]
    fn int8_error_is_within_half_a_step() {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let l = layout(dtype);
            let raw = kv(dtype, 7, 1);
            let enc = encode(Codec::Int8, &l, 7, &raw, 0, false).unwrap();
            assert!(enc.len() < raw.len() / dtype.size() + 64);
            let mut out = vec![0u8; raw.len()];
            decode_into(Codec::Int8, &l, 7, &enc, &mut out).unwrap();
            let n = raw.len() / dtype.size();
            for i in 0..n {
                let a = read_elem(dtype, &raw[i * dtype.size()..]);
                let b = read_elem(dtype, &out[i * dtype.size()..]);
                // max |x| is 10, so a step is 10/127; bf16 adds its own rounding.
                assert!(
                    (a - b).abs() <= 10.0 / 127.0 * 0.5 + a.abs() * 0.01,
                    "{dtype}: {a} vs {b}"
                );
            }
        }
    }
}
