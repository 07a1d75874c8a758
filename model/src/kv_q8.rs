//! 8-bit decoding caches (`serve.cache_dtype = "q8"`, llama.cpp's `-ctk q8_0 -ctv q8_0`): a
//! [`crate::KvCache`] of dtype [`Q8_CACHE`] keeps every key and value row of `d` elements as
//! `d` signed bytes followed by the row's f32 scale (little-endian), `x = q × scale`, `q` in
//! `-127..=127`: `d + 4` bytes a row instead of f16's `2d` (SmolLM2's and Qwen2.5's heads of 64:
//! 68 bytes instead of 128). Attention reads the codes and folds the scales into each score
//! and each value weight ([`crate::attention`]), so a decoding step reads half the bytes of an
//! f16 cache and dequantizes nothing in memory. Rows go in quantized as they are appended;
//! everything that needs floats (export, the general attention path) widens them again.

use candle_core::{DType, Device, Tensor};

use crate::error::{Ctx, Result};

/// The candle dtype a q8 cache's tensors have (rows of codes and a scale, see the module).
pub const Q8_CACHE: DType = DType::U8;

/// Bytes of a q8 row of `d` elements.
pub(crate) const fn row_bytes(d: usize) -> usize {
    d + 4
}

/// One row of `x` into `out` (`row_bytes(x.len())` bytes).
pub(crate) fn quantize_row(x: &[f32], out: &mut [u8]) {
    let d = x.len();
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = if amax > 0.0 && amax.is_finite() {
        amax / 127.0
    } else {
        0.0
    };
    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    for (o, v) in out[..d].iter_mut().zip(x) {
        *o = (v * inv).round().clamp(-127.0, 127.0) as i8 as u8;
    }
    out[d..d + 4].copy_from_slice(&scale.to_le_bytes());
}

/// The scale of the q8 row at `row` (its codes first).
pub(crate) fn row_scale(row: &[u8], d: usize) -> f32 {
    f32::from_le_bytes([row[d], row[d + 1], row[d + 2], row[d + 3]])
}

/// One q8 row widened to `out` (`d` floats).
pub(crate) fn dequantize_row(row: &[u8], out: &mut [f32]) {
    let d = out.len();
    let s = row_scale(row, d);
    for (o, q) in out.iter_mut().zip(&row[..d]) {
        *o = f32::from(*q as i8) * s;
    }
}

/// `(1, heads, n, d)` rows of any float dtype as a q8 tensor `(1, heads, n, d + 4)`.
pub(crate) fn quantize(t: &Tensor) -> Result<Tensor> {
    let (b, h, n, d) = t.dims4().ctx("q8 rows")?;
    let x = t
        .to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .ctx("q8 rows")?;
    let w = row_bytes(d);
    let mut out = vec![0u8; b * h * n * w];
    for (row, o) in x.chunks_exact(d).zip(out.chunks_exact_mut(w)) {
        quantize_row(row, o);
    }
    Tensor::from_vec(out, (b, h, n, w), t.device()).ctx("q8 rows")
}

/// A q8 tensor `(1, heads, n, d + 4)` widened to `dtype` `(1, heads, n, d)`.
pub(crate) fn dequantize(t: &Tensor, dtype: DType, device: &Device) -> Result<Tensor> {
    let (b, h, n, w) = t.dims4().ctx("q8 rows")?;
    let d = w - 4;
    let bytes = t
        .flatten_all()
        .and_then(|t| t.to_vec1::<u8>())
        .ctx("q8 rows")?;
    let mut out = vec![0f32; b * h * n * d];
    for (row, o) in bytes.chunks_exact(w).zip(out.chunks_exact_mut(d)) {
        dequantize_row(row, o);
    }
    Tensor::from_vec(out, (b, h, n, d), device)
        .and_then(|t| t.to_dtype(dtype))
        .ctx("q8 rows")
}

/// Rows of a q8 cache (`stride` bytes apart, `rows` of them from `src`) widened to f32 one
/// after the other into `dst`: the scratch the non-AVX-512 attention loops read.
pub(crate) fn widen_rows(
    src: &[u8],
    stride: usize,
    rows: std::ops::RangeInclusive<usize>,
    d: usize,
    dst: &mut Vec<f32>,
) {
    dst.clear();
    dst.resize(rows.clone().count() * d, 0.0);
    for (out, j) in dst.chunks_exact_mut(d).zip(rows) {
        dequantize_row(&src[j * stride..j * stride + row_bytes(d)], out);
    }
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
        fn rows_come_back_within_half_a_step(x in proptest::collection::vec(-50f32..50.0, 1..130)) {
            let d = x.len();
            let mut q = vec![0u8; row_bytes(d)];
            quantize_row(&x, &mut q);
            let mut y = vec![0f32; d];
            dequantize_row(&q, &mut y);
            let step = x.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            for (a, b) in x.iter().zip(&y) {
                prop_assert!((a - b).abs() <= step * 0.5 + 1e-6, "{a} vs {b}");
            }
        }
    }

    #[test]
    fn tensors_round_trip_in_shape() {
        let dev = Device::Cpu;
        let t = Tensor::randn(0f32, 1.0, (1, 3, 5, 64), &dev).unwrap();
        let q = quantize(&t).unwrap();
        assert_eq!(q.dims(), &[1, 3, 5, 68]);
        let back = dequantize(&q, DType::F32, &dev).unwrap();
        let diff = (back - &t)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(diff < 0.05, "{diff}");
        let zeros = Tensor::zeros((1, 1, 2, 8), DType::F16, &dev).unwrap();
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
}
