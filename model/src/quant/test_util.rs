//! What the kernel tests of [`super`], `kquant` and `half_rows` share: weights quantized by
//! candle (ggml's encoders) and a seeded source of uniform values.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

/// `(n, k)` weights quantized by candle, their bytes and their dequantized values.
pub(crate) fn weights(vals: &[f32], n: usize, k: usize, dtype: GgmlDType) -> (Vec<u8>, Vec<f32>) {
    let t = Tensor::from_slice(vals, (n, k), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&t, dtype).unwrap();
    let bytes = q.data().unwrap().into_owned();
    let back = q
        .dequantize(&Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    (bytes, back)
}

/// One 32-value group of ggml's IQ4 dequantization: scale `dl`, 16 bytes of 4-bit codes.
fn iq4_group(y: &mut Vec<f32>, dl: f32, qs: &[u8]) {
    let level = |q: u8| dl * f32::from(super::iq4::LEVELS[usize::from(q)]);
    y.extend(qs.iter().map(|&q| level(q & 0xF)));
    y.extend(qs.iter().map(|&q| level(q >> 4)));
}

fn f16_at(b: &[u8]) -> f32 {
    half::f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// ggml's `dequantize_row_iq4_nl` (blocks of 18 bytes).
pub(crate) fn iq4_nl_reference(raw: &[u8]) -> Vec<f32> {
    let mut y = Vec::new();
    for b in raw.chunks_exact(18) {
        iq4_group(&mut y, f16_at(b), &b[2..18]);
    }
    y
}

/// ggml's `dequantize_row_iq4_xs` (blocks of 136 bytes).
pub(crate) fn iq4_xs_reference(raw: &[u8]) -> Vec<f32> {
    let mut y = Vec::new();
    for b in raw.chunks_exact(136) {
        let (d, scales_h) = (f16_at(b), u16::from_le_bytes([b[2], b[3]]));
        for ib in 0..8 {
            let ls = i32::from((b[4 + ib / 2] >> (4 * (ib % 2))) & 0xf)
                | (i32::from((scales_h >> (2 * ib)) & 3) << 4);
            iq4_group(
                &mut y,
                d * (ls - 32) as f32,
                &b[8 + 16 * ib..8 + 16 * ib + 16],
            );
        }
    }
    y
}

/// IQ4_NL weights: Q4_0 blocks from candle (the same layout) read as IQ4_NL, and their
/// values by ggml's dequantization.
pub(crate) fn iq4_nl_weights(vals: &[f32], n: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
    let (w, _) = weights(vals, n, k, GgmlDType::Q4_0);
    let wd = iq4_nl_reference(&w);
    (w, wd)
}

/// Uniform values in `[-1, 1)` from `seed` (xorshift64).
pub(crate) fn uniform(seed: u64) -> impl FnMut() -> f32 {
    let mut s = seed | 1;
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 11) as f64 / (1u64 << 53) as f64) as f32 * 2.0 - 1.0
    }
}

/// Asserts that `got` (`m` rows of `n`) is `x @ w.T` for the dequantized weights `wd` (`n`
/// rows of `k`) and dequantized activations `xq` (`m` rows of `k`), each entry within `tol`
/// of the sum of its terms' magnitudes (computed in f64); `what` names the kernel in a failure.
pub(crate) fn assert_product(
    got: &[f32],
    wd: &[f32],
    xq: &[f32],
    n: usize,
    k: usize,
    tol: f64,
    what: &str,
) {
    let m = xq.len() / k;
    assert_eq!(got.len(), m * n, "{what}: result size");
    for i in 0..m {
        for j in 0..n {
            let terms = (0..k).map(|c| wd[j * k + c] as f64 * xq[i * k + c] as f64);
            let want: f64 = terms.clone().sum();
            let scale: f64 = terms.map(f64::abs).sum::<f64>() + 1e-6;
            let err = (got[i * n + j] as f64 - want).abs() / scale;
            assert!(
                err < tol,
                "{what} ({i},{j}): {} vs {want} (rel {err})",
                got[i * n + j]
            );
        }
    }
}

/// `n` rows of `k` in IQ4_XS blocks: codes and 6-bit scales from `next`, each block's `d` a
/// random f16 of magnitude up to `spread`; and ggml's values for them.
pub(crate) fn iq4_xs_weights(
    n: usize,
    k: usize,
    spread: f32,
    next: &mut impl FnMut() -> f32,
) -> (Vec<u8>, Vec<f32>) {
    let bytes = n * k / super::kquant::QK_K * super::iq4::XS_BYTES;
    let mut w: Vec<u8> = (0..bytes).map(|_| ((next() + 1.0) * 128.0) as u8).collect();
    for b in w.chunks_exact_mut(super::iq4::XS_BYTES) {
        b[..2].copy_from_slice(&half::f16::from_f32(next() * spread).to_le_bytes());
    }
    let wd = iq4_xs_reference(&w);
    (w, wd)
}

/// Whether the AMX tests have to skip: no AMX on this CPU, or its tile state not granted by
/// the kernel (said on stderr).
pub(crate) fn no_amx() -> bool {
    let missing = !crate::simd::cpu_has_amx();
    if missing {
        eprintln!("skipped: no AMX on this CPU (or not granted by the kernel)");
    }
    missing
}

/// Asserts that two kernels' results are the same floats, bit for bit; `what` names the case.
pub(crate) fn assert_same_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: result size");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{what} at {i}: {g} vs {w}");
    }
}
