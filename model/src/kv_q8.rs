//! 8-bit decoding caches (`serve.cache_dtype = "q8"`, llama.cpp's `-ctk q8_0 -ctv q8_0`): a
//! [`crate::KvCache`] of dtype [`Q8_CACHE`] keeps every key and value row of `d` elements as
//! `d` signed bytes, then one f32 scale per block of [`BLOCK`] elements (little-endian; heads
//! of a multiple of 32 elements, as every common model's), `x = q × scale`, `q` in `-127..=127`:
//! `d + d/8` bytes a row instead of f16's `2d` (heads of 64: 72 bytes instead of 128). Blocks
//! of 32, as llama.cpp's `q8_0`. Each row is rotated before it is quantized ([`rotation`]:
//! fixed signs and a Walsh-Hadamard transform, orthonormal, as llama.cpp now does for its
//! quantized caches), so a key's few large channels no longer set its blocks' scales and
//! coarsen all the others: the codes are of `R x`, not `x`. Attention widens the codes and
//! applies their block's scale in registers as it loads a row, or (the AVX2 kernel)
//! multiplies them in integers with the query's and weights' 16-bit codes
//! ([`crate::attention`]), with the query rotated the same way and the weighted sum of values turned back, so a decoding
//! step reads about half the bytes of an f16 cache and dequantizes nothing in memory. Rows go
//! in quantized as they are appended; everything that needs floats (export, the general
//! attention path) widens them again and undoes the rotation ([`dequantize`]).

use candle_core::{DType, Device, Tensor};

use crate::error::{Ctx, Result};

mod rotation;

pub(crate) use rotation::{rotate, unrotate};

/// The candle dtype a q8 cache's tensors have (rows of codes and scales, see the module).
pub const Q8_CACHE: DType = DType::U8;

/// Elements per scale.
pub(crate) const BLOCK: usize = 32;

/// Whether heads of `d` elements fit q8 rows (a whole number of blocks).
pub(crate) const fn supports(d: usize) -> bool {
    d > 0 && d.is_multiple_of(BLOCK)
}

/// Bytes of a q8 row of `d` elements ([`supports`]).
pub(crate) const fn row_bytes(d: usize) -> usize {
    d + 4 * (d / BLOCK)
}

/// Elements of a q8 row of `w` bytes.
pub(crate) const fn dim_of(w: usize) -> usize {
    w / (BLOCK + 4) * BLOCK
}

/// Rounds half away from zero, without a call into libm.
#[inline]
fn round_i8(x: f32) -> u8 {
    let r = if x >= 0.0 { x + 0.5 } else { x - 0.5 };
    (r as i32).clamp(-127, 127) as i8 as u8
}

/// One row of `x` into `out` (`row_bytes(x.len())` bytes).
pub(crate) fn quantize_row(x: &[f32], out: &mut [u8]) {
    let d = x.len();
    let b = BLOCK;
    for (k, blk) in x.chunks_exact(b).enumerate() {
        let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = if amax > 0.0 && amax.is_finite() {
            amax / 127.0
        } else {
            0.0
        };
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        for (o, v) in out[k * b..(k + 1) * b].iter_mut().zip(blk) {
            *o = round_i8(v * inv);
        }
        out[d + 4 * k..d + 4 * k + 4].copy_from_slice(&scale.to_le_bytes());
    }
}

/// Rows of `d` floats (`x`, a whole number of them) into q8 rows in `out`: AVX2 where the CPU
/// has it (rounding to nearest even), else [`quantize_row`] (half away from zero); both
/// within half a step of every value.
pub(crate) fn quantize_rows(x: &[f32], d: usize, out: &mut [u8]) {
    let w = row_bytes(d);
    debug_assert_eq!(x.len() / d * w, out.len());
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        for (row, o) in x.chunks_exact(d).zip(out.chunks_exact_mut(w)) {
            // SAFETY: AVX2 was detected just above.
            unsafe { x86::quantize_row(row, o) };
        }
        return;
    }
    for (row, o) in x.chunks_exact(d).zip(out.chunks_exact_mut(w)) {
        quantize_row(row, o);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::BLOCK;

    /// [`super::quantize_row`] in AVX2, four vectors of eight per block.
    #[target_feature(enable = "avx2")]
    pub(super) fn quantize_row(x: &[f32], out: &mut [u8]) {
        let d = x.len();
        assert!(d.is_multiple_of(BLOCK) && out.len() >= super::row_bytes(d));
        let sign = _mm256_set1_ps(-0.0);
        for k in 0..d / BLOCK {
            // SAFETY: elements `32k..32k + 32` of `x` are in bounds (asserted).
            let v: [__m256; 4] = std::array::from_fn(|i| unsafe {
                _mm256_loadu_ps(x.as_ptr().add(BLOCK * k + 8 * i))
            });
            let m = v.iter().fold(_mm256_setzero_ps(), |m, x| {
                _mm256_max_ps(m, _mm256_andnot_ps(sign, *x))
            });
            let mut lanes = [0f32; 8];
            // SAFETY: eight floats fit `lanes`.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), m) };
            let amax = lanes.iter().fold(0f32, |a, b| a.max(*b));
            let scale = if amax > 0.0 && amax.is_finite() {
                amax / 127.0
            } else {
                0.0
            };
            let inv = _mm256_set1_ps(if scale > 0.0 { 1.0 / scale } else { 0.0 });
            let q: [__m256i; 4] =
                std::array::from_fn(|i| _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)));
            // i32 → i16 → i8 with saturation; the packs interleave 128-bit lanes, the
            // permutation puts the 32 codes back in order.
            let w01 = _mm256_packs_epi32(q[0], q[1]);
            let w23 = _mm256_packs_epi32(q[2], q[3]);
            let b = _mm256_packs_epi16(w01, w23);
            let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            // Codes never reach -128: |x · inv| ≤ 127 (rounding cannot pass it).
            // SAFETY: bytes `32k..32k + 32` of `out` are in bounds (asserted).
            unsafe { _mm256_storeu_si256(out.as_mut_ptr().add(BLOCK * k).cast(), b) };
            out[d + 4 * k..d + 4 * k + 4].copy_from_slice(&scale.to_le_bytes());
        }
    }
}

/// The scale of block `k` of the q8 row `row` of `d` elements.
pub(crate) fn block_scale(row: &[u8], d: usize, k: usize) -> f32 {
    let at = d + 4 * k;
    f32::from_le_bytes([row[at], row[at + 1], row[at + 2], row[at + 3]])
}

/// One q8 row widened to `out` (`d` floats).
pub(crate) fn dequantize_row(row: &[u8], out: &mut [f32]) {
    let d = out.len();
    let b = BLOCK;
    for (k, blk) in out.chunks_exact_mut(b).enumerate() {
        let s = block_scale(row, d, k);
        for (o, q) in blk.iter_mut().zip(&row[k * b..(k + 1) * b]) {
            *o = f32::from(*q as i8) * s;
        }
    }
}

/// `(1, heads, n, d)` rows of any float dtype as a q8 tensor `(1, heads, n, row_bytes(d))`,
/// rotated ([`rotate`]) then quantized.
pub(crate) fn quantize(t: &Tensor) -> Result<Tensor> {
    let (b, h, n, d) = t.dims4().ctx("q8 rows")?;
    let mut x = floats(t)?;
    let w = row_bytes(d);
    let mut out = vec![0u8; b * h * n * w];
    rotate(&mut x, d);
    quantize_rows(&x, d, &mut out);
    Tensor::from_vec(out, (b, h, n, w), t.device()).ctx("q8 rows")
}

/// `t`'s elements as f32, in order. f16 rows (a store's, the loader's) are widened eight
/// at a time (F16C where the CPU has it): candle's `to_dtype` converts one element per call,
/// which took half of a loader thread's time for q8 caches.
fn floats(t: &Tensor) -> Result<Vec<f32>> {
    let flat = t.flatten_all().ctx("q8 rows")?;
    if flat.dtype() != DType::F16 {
        return flat
            .to_dtype(DType::F32)
            .and_then(|t| t.to_vec1::<f32>())
            .ctx("q8 rows");
    }
    let h = flat.to_vec1::<half::f16>().ctx("q8 rows")?;
    let mut x = vec![0f32; h.len()];
    half::slice::HalfFloatSliceExt::convert_to_f32_slice(&h[..], &mut x);
    Ok(x)
}

/// A q8 tensor `(1, heads, n, row_bytes(d))` widened to `dtype` `(1, heads, n, d)`, the
/// rotation undone.
pub(crate) fn dequantize(t: &Tensor, dtype: DType, device: &Device) -> Result<Tensor> {
    let (b, h, n, w) = t.dims4().ctx("q8 rows")?;
    let d = dim_of(w);
    let bytes = t
        .flatten_all()
        .and_then(|t| t.to_vec1::<u8>())
        .ctx("q8 rows")?;
    let mut out = vec![0f32; b * h * n * d];
    for (row, o) in bytes.chunks_exact(w).zip(out.chunks_exact_mut(d)) {
        dequantize_row(row, o);
    }
    unrotate(&mut out, d);
    Tensor::from_vec(out, (b, h, n, d), device)
        .and_then(|t| t.to_dtype(dtype))
        .ctx("q8 rows")
}

/// The bytes a token's KV takes in a q8 cache of `layers × kv_heads` rows of `d`.
pub fn q8_bytes_per_token(layers: usize, kv_heads: usize, d: usize) -> usize {
    2 * layers * kv_heads * row_bytes(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn rows_come_back_within_half_a_step(x in (1..5usize).prop_flat_map(|n| proptest::collection::vec(-50f32..50.0, n * 32))) {
            let d = x.len();
            let mut q = vec![0u8; row_bytes(d)];
            quantize_row(&x, &mut q);
            let mut y = vec![0f32; d];
            dequantize_row(&q, &mut y);
            let b = BLOCK;
            for (blk, got) in x.chunks(b).zip(y.chunks(b)) {
                let step = blk.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
                for (a, g) in blk.iter().zip(got) {
                    prop_assert!((a - g).abs() <= step * 0.5 + 1e-5, "{a} vs {g}");
                }
            }
        }
    }

    /// The SIMD rows equal the portable ones but where a value sits exactly half-way
    /// between two codes (nearest even against away from zero): one code apart at most.
    #[test]
    fn simd_rows_match_the_portable_ones() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::SmallRng::seed_from_u64(3);
        let d = 128;
        let x: Vec<f32> = (0..d * 40)
            .map(|i| rng.gen_range(-3.0f32..3.0) * (1 + i % 7) as f32)
            .collect();
        let mut fast = vec![0u8; 40 * row_bytes(d)];
        quantize_rows(&x, d, &mut fast);
        let mut slow = vec![0u8; 40 * row_bytes(d)];
        for (row, o) in x.chunks_exact(d).zip(slow.chunks_exact_mut(row_bytes(d))) {
            quantize_row(row, o);
        }
        for (r, (a, b)) in fast
            .chunks_exact(row_bytes(d))
            .zip(slow.chunks_exact(row_bytes(d)))
            .enumerate()
        {
            assert_eq!(a[d..], b[d..], "row {r}: scales");
            for (j, (p, q)) in a[..d].iter().zip(&b[..d]).enumerate() {
                assert!(
                    (*p as i8 as i32 - *q as i8 as i32).abs() <= 1,
                    "row {r} elem {j}: {p} vs {q}"
                );
            }
        }
    }

    #[test]
    fn tensors_round_trip_in_shape() {
        let dev = Device::Cpu;
        let t = Tensor::randn(0f32, 1.0, (1, 3, 5, 64), &dev).unwrap();
        let q = quantize(&t).unwrap();
        assert_eq!(q.dims(), &[1, 3, 5, 72]);
        let back = dequantize(&q, DType::F32, &dev).unwrap();
        let diff = crate::test_util::max_diff(&back, &t);
        assert!(diff < 0.05, "{diff}");
        let zeros = Tensor::zeros((1, 1, 2, 32), DType::F16, &dev).unwrap();
        let back = dequantize(&quantize(&zeros).unwrap(), DType::F16, &dev).unwrap();
        assert_eq!(
            back.to_dtype(DType::F32)
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap(),
            0.0
        );
    }

    /// Parts already quantized for a q8 cache (the loader's) go in as they are, first or
    /// after float ones, and come back within a few q8 steps of the floats (rotated rows:
    /// each element's error is a mix of its block's, whose norm the rotation keeps).
    #[test]
    fn q8_parts_go_in_as_they_are() {
        let dev = Device::Cpu;
        let part = |len: usize, seed: f32| {
            let t = |o: f32| {
                let data: Vec<f32> = (0..2 * len * 32)
                    .map(|i| (i as f32 * 0.37 + seed + o).sin())
                    .collect();
                Tensor::from_vec(data, (1, 2, len, 32), &dev).unwrap()
            };
            crate::Kv::new((0..2).map(|l| (t(l as f32), t(l as f32 + 0.5))).collect()).unwrap()
        };
        let (a, b) = (part(5, 0.0), part(7, 1.0));
        let qa = a.to(&dev, Q8_CACHE).unwrap();
        for (parts, floats) in [
            (vec![qa.clone(), b.clone()], vec![a.clone(), b.clone()]),
            (vec![b.clone(), qa.clone()], vec![b.clone(), a.clone()]),
        ] {
            let cache = crate::KvCache::from_parts_in(&parts, 3, Q8_CACHE).unwrap();
            assert_eq!((cache.len(), cache.dtype()), (12, Q8_CACHE));
            let back = cache.to_kv().unwrap();
            let want = crate::Kv::concat(&floats).unwrap();
            for ((k, v), (wk, wv)) in back.layers.iter().zip(&want.layers) {
                for (x, y) in [(k, wk), (v, wv)] {
                    let diff = crate::test_util::max_diff(x, y);
                    assert!(diff < 3.0 / 127.0, "{diff}");
                }
            }
        }
    }
}
