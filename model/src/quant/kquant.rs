//! Matrix products over GGUF's K-quants (256-element super-blocks: Q2_K, Q3_K, Q4_K, Q5_K,
//! Q6_K) with f32 activations, on the CPU: what Q4_K_M / Q5_K_M / Q6_K (and Q2_K / Q3_K_*)
//! files are mostly made of.
//!
//! The scheme is llama.cpp's: each activation row is quantized once to 8 bits per 256
//! elements ([`BlockQ8K`], with the sums of each 16 quants kept beside them), and a weight
//! row's dot product with it is integer arithmetic per sub-block (a sub-block scale times an
//! exact sum of products, the minimums applied through the kept sums), one float product per
//! super-block. The AVX2 kernels (`kquant_avx2`, one activation row or four per decoded weight
//! block) are checked against the portable loop here, which is checked against candle's
//! dequantized weights; the rows are split over the same thread pool as the 32-element types
//! ([`super::matmul_rows`]).
//!
//! Block layouts (ggml's, little endian; `d`, `dmin` f16; 4/5-bit quants: element `64j + l`
//! (`l < 32`) is the low nibble of `qs[32j + l]`, element `64j + 32 + l` its high nibble; Q5_K's
//! fifth bits: bit `2j` (low) / `2j + 1` (high) of `qh[l]`):
//!
//! | type | bytes | layout (offsets) | value of element `e` |
//! |---|---:|---|---|
//! | Q2_K | 84 | `scales[16]` 0, `qs[64]` 16, `d` 80, `dmin` 82 | `d (s & 15) q - dmin (s >> 4)`, `s = scales[e/16]` |
//! | Q3_K | 110 | `hmask[32]` 0, `qs[64]` 32, `scales[12]` 96, `d` 108 | `d (sc(e/16) - 32) (q - 4 (1 - h))` |
//! | Q4_K | 144 | `d` 0, `dmin` 2, `scales[12]` 4, `qs[128]` 16 | `d sc(e/32) q - dmin m(e/32)` |
//! | Q5_K | 176 | `d` 0, `dmin` 2, `scales[12]` 4, `qh[32]` 16, `qs[128]` 48 | `d sc(e/32) q - dmin m(e/32)` |
//! | Q6_K | 210 | `ql[128]` 0, `qh[64]` 128, `scales[16]` (i8) 192, `d` 208 | `d sc(e/16) (q - 32)` |
//!
//! Q4_K/Q5_K `scales`: eight 6-bit scales and eight 6-bit minimums (sub-block `j < 4`: scale
//! `s[j] & 63`, minimum `s[j + 4] & 63`; `j ≥ 4`: scale `s[j + 4] & 15 | (s[j - 4] >> 6) << 4`,
//! minimum `s[j + 4] >> 4 | (s[j] >> 6) << 4`). Q6_K: in each half `n` (128 elements, `ql`
//! from `64n`, `qh` from `32n`), element `128n + 32i + l` (`l < 32`) has its low four bits in
//! `ql[64n + l + 32 (i & 1)]` (high nibble for `i ≥ 2`) and its two high bits at bit `2i` of
//! `qh[32n + l]`.
//!
//! Q2_K/Q3_K: in each half `n`, element `128n + 32j + l` (`l < 32`) has its two low bits at bit
//! `2j` of `qs[32n + l]`; Q3_K's third bit `h` is bit `4n + j` of `hmask[l]`, and its sixteen
//! 6-bit scales are `scales[i] & 15 | (scales[8 + i] >> 0 & 3) << 4` (`i < 4`; then `i - 4`
//! over `scales[4..8]` with `>> 2`, high nibbles of `scales[0..4]` with `>> 4`, high nibbles
//! of `scales[4..8]` with `>> 6`).

use candle_core::quantized::GgmlDType;
use half::f16;

use super::RowKernels;

/// Elements per super-block.
pub(crate) const QK_K: usize = 256;

/// A K-quant block type this module multiplies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KKind {
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    /// llama.cpp's `IQ4_XS` (`super::iq4`'s table): 4-bit indices into 16 levels, a 6-bit
    /// scale per 32 values. Not a K-quant, but multiplied as one (256-value super-blocks,
    /// integer sub-block scales) where the tiled kernels run; candle has no such type.
    Iq4Xs,
}

impl KKind {
    pub(crate) fn of(dtype: GgmlDType) -> Option<KKind> {
        Some(match dtype {
            GgmlDType::Q2K => KKind::Q2K,
            GgmlDType::Q3K => KKind::Q3K,
            GgmlDType::Q4K => KKind::Q4K,
            GgmlDType::Q5K => KKind::Q5K,
            GgmlDType::Q6K => KKind::Q6K,
            _ => return None,
        })
    }

    /// Bytes per super-block.
    pub(crate) fn block_bytes(self) -> usize {
        match self {
            KKind::Q2K => 84,
            KKind::Q3K => 110,
            KKind::Q4K => 144,
            KKind::Q5K => 176,
            KKind::Q6K => 210,
            KKind::Iq4Xs => super::iq4::XS_BYTES,
        }
    }
}

/// One super-block of an activation row: scale, quants, and the sum of each 16 quants.
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub(crate) struct BlockQ8K {
    pub(crate) d: f32,
    pub(crate) bsums: [i16; QK_K / 16],
    pub(crate) qs: [i8; QK_K],
}

/// Quantizes `x` (a multiple of [`QK_K`] long) to 8 bits per super-block: `d = max|x| / 127`.
pub(crate) fn quantize_row(x: &[f32]) -> Vec<BlockQ8K> {
    x.chunks_exact(QK_K)
        .map(|b| {
            let d = super::amax(b) / 127.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            let mut y = BlockQ8K {
                d,
                bsums: [0; QK_K / 16],
                qs: [0; QK_K],
            };
            for (q, v) in y.qs.iter_mut().zip(b) {
                *q = super::nearest(v * id) as i8;
            }
            for (s, q) in y.bsums.iter_mut().zip(y.qs.chunks_exact(16)) {
                *s = q.iter().map(|q| *q as i16).sum();
            }
            y
        })
        .collect()
}

fn half(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Sub-block `j`'s 6-bit scale and minimum from Q4_K/Q5_K's 12 scale bytes.
pub(super) fn scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Q3_K's sixteen 6-bit scales (before the `- 32`) from its 12 scale bytes.
pub(super) fn scales_q3(s: &[u8]) -> [u8; 16] {
    let mut out = [0u8; 16];
    for k in 0..4 {
        let h = s[8 + k];
        out[k] = (s[k] & 0xF) | (h & 3) << 4;
        out[4 + k] = (s[4 + k] & 0xF) | (h >> 2 & 3) << 4;
        out[8 + k] = (s[k] >> 4) | (h >> 4 & 3) << 4;
        out[12 + k] = (s[4 + k] >> 4) | (h >> 6 & 3) << 4;
    }
    out
}

/// A super-block's quants and scales: element `e` is `d sc[e / 16] q[e] - dmin mn[e / 16]`.
pub(crate) struct Unpacked {
    pub(crate) q: [i8; QK_K],
    pub(crate) sc: [i32; 16],
    pub(crate) mn: [i32; 16],
    pub(crate) d: f32,
    pub(crate) dmin: f32,
}

/// The portable decoding of one block (the module docs' table).
pub(crate) fn unpack(kind: KKind, blk: &[u8]) -> Unpacked {
    let mut u = Unpacked {
        q: [0; QK_K],
        sc: [0; 16],
        mn: [0; 16],
        d: 0.0,
        dmin: 0.0,
    };
    match kind {
        KKind::Q2K | KKind::Q3K => {
            let (qs, hmask) = match kind {
                KKind::Q2K => (&blk[16..80], None),
                _ => (&blk[32..96], Some(&blk[0..32])),
            };
            if kind == KKind::Q2K {
                u.d = half(blk, 80);
                u.dmin = half(blk, 82);
                for (g, s) in blk[0..16].iter().enumerate() {
                    u.sc[g] = (s & 0xF) as i32;
                    u.mn[g] = (s >> 4) as i32;
                }
            } else {
                u.d = half(blk, 108);
                for (g, s) in scales_q3(&blk[96..108]).iter().enumerate() {
                    u.sc[g] = *s as i32 - 32;
                }
            }
            for n in 0..2 {
                for j in 0..4 {
                    for l in 0..32 {
                        let low = (qs[32 * n + l] >> (2 * j) & 3) as i8;
                        u.q[128 * n + 32 * j + l] = match hmask {
                            Some(h) if h[l] >> (4 * n + j) & 1 == 0 => low - 4,
                            _ => low,
                        };
                    }
                }
            }
        }
        KKind::Q4K | KKind::Q5K => {
            u.d = half(blk, 0);
            u.dmin = half(blk, 2);
            let scales = &blk[4..16];
            for j in 0..8 {
                let (sc, m) = scale_min(j, scales);
                u.sc[2 * j..2 * j + 2].fill(sc as i32);
                u.mn[2 * j..2 * j + 2].fill(m as i32);
            }
            let (qh, qs) = match kind {
                KKind::Q5K => (Some(&blk[16..48]), &blk[48..176]),
                _ => (None, &blk[16..144]),
            };
            for j in 0..4 {
                for l in 0..32 {
                    let b = qs[32 * j + l];
                    let (lo, hi) = match qh {
                        Some(h) => ((h[l] >> (2 * j) & 1) << 4, (h[l] >> (2 * j + 1) & 1) << 4),
                        None => (0, 0),
                    };
                    u.q[64 * j + l] = ((b & 0xF) | lo) as i8;
                    u.q[64 * j + 32 + l] = ((b >> 4) | hi) as i8;
                }
            }
        }
        KKind::Iq4Xs => {
            u.d = half(blk, 0);
            for g in 0..8 {
                let s = super::iq4::xs_scale(blk, g) - 32;
                u.sc[2 * g..2 * g + 2].fill(s);
                for (l, b) in blk[8 + 16 * g..8 + 16 * (g + 1)].iter().enumerate() {
                    u.q[32 * g + l] = super::iq4::LEVELS[usize::from(b & 0xF)];
                    u.q[32 * g + 16 + l] = super::iq4::LEVELS[usize::from(b >> 4)];
                }
            }
        }
        KKind::Q6K => {
            let (ql, qh, scales) = (&blk[0..128], &blk[128..192], &blk[192..208]);
            u.d = half(blk, 208);
            for (s, b) in u.sc.iter_mut().zip(scales) {
                *s = *b as i8 as i32;
            }
            for n in 0..2 {
                for i in 0..4 {
                    for l in 0..32 {
                        let low = ql[64 * n + l + 32 * (i & 1)] >> (4 * (i / 2)) & 0xF;
                        let high = qh[32 * n + l] >> (2 * i) & 3;
                        u.q[128 * n + 32 * i + l] = (low | high << 4) as i8 - 32;
                    }
                }
            }
        }
    }
    u
}

/// Row `w` (whole blocks of `kind`) dequantized into `out` (the tests' reference).
#[cfg(test)]
fn dequantize_row(kind: KKind, w: &[u8], out: &mut [f32]) {
    for (blk, out) in w
        .chunks_exact(kind.block_bytes())
        .zip(out.chunks_exact_mut(QK_K))
    {
        let u = unpack(kind, blk);
        for (e, o) in out.iter_mut().enumerate() {
            let g = e / 16;
            *o = u.d * u.sc[g] as f32 * u.q[e] as f32 - u.dmin * u.mn[g] as f32;
        }
    }
}

/// Portable reference: exact integer sums per sub-block, as the SIMD kernels compute them.
fn dot_scalar(kind: KKind, w: &[u8], a: &[BlockQ8K]) -> f32 {
    let mut acc = 0f32;
    for (blk, y) in w.chunks_exact(kind.block_bytes()).zip(a) {
        let u = unpack(kind, blk);
        let (mut sum, mut mins) = (0i32, 0i32);
        for g in 0..16 {
            let s: i32 = (16 * g..16 * g + 16)
                .map(|e| u.q[e] as i32 * y.qs[e] as i32)
                .sum();
            sum += u.sc[g] * s;
            mins += u.mn[g] * y.bsums[g] as i32;
        }
        acc += y.d * (u.d * sum as f32 - u.dmin * mins as f32);
    }
    acc
}

pub(super) fn scalar_kernels(kind: KKind) -> RowKernels<BlockQ8K> {
    macro_rules! k {
        ($kind:expr) => {
            RowKernels {
                one: |w, a| dot_scalar($kind, w, a),
                four: |w, a| a.map(|a| dot_scalar($kind, w, a)),
            }
        };
    }
    match kind {
        KKind::Q2K => k!(KKind::Q2K),
        KKind::Q3K => k!(KKind::Q3K),
        KKind::Q4K => k!(KKind::Q4K),
        KKind::Q5K => k!(KKind::Q5K),
        KKind::Q6K => k!(KKind::Q6K),
        KKind::Iq4Xs => k!(KKind::Iq4Xs),
    }
}

/// The fastest kernels this CPU (and the kernel path) runs for `kind`.
fn kernels(kind: KKind) -> RowKernels<BlockQ8K> {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::avx2() {
        return super::kquant_avx2::kernels(kind);
    }
    scalar_kernels(kind)
}

/// `x @ w.T`: `w` holds `n` rows of `k` elements in `kind` blocks, `x` holds `m` rows of `k`
/// f32; the result is `m` rows of `n`.
pub(crate) fn matmul(kind: KKind, w: &[u8], n: usize, k: usize, x: &[f32]) -> Vec<f32> {
    matmul_with(&kernels(kind), kind, w, n, k, x)
}

fn matmul_with(
    kern: &RowKernels<BlockQ8K>,
    kind: KKind,
    w: &[u8],
    n: usize,
    k: usize,
    x: &[f32],
) -> Vec<f32> {
    debug_assert_eq!(k % QK_K, 0);
    let rows: Vec<Vec<BlockQ8K>> = x.chunks_exact(k).map(quantize_row).collect();
    super::matmul_rows(kern, w, n, k / QK_K * kind.block_bytes(), &rows, usize::MAX)
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{assert_product, uniform, weights};
    use super::*;
    use proptest::prelude::*;

    const KINDS: [(KKind, GgmlDType); 5] = [
        (KKind::Q2K, GgmlDType::Q2K),
        (KKind::Q3K, GgmlDType::Q3K),
        (KKind::Q4K, GgmlDType::Q4K),
        (KKind::Q5K, GgmlDType::Q5K),
        (KKind::Q6K, GgmlDType::Q6K),
    ];

    fn dequantized_q8(row: &[BlockQ8K]) -> Vec<f32> {
        row.iter()
            .flat_map(|b| b.qs.iter().map(move |q| *q as f32 * b.d))
            .collect()
    }

    /// Every kernel set this machine can run for `kind`: the portable loop, and AVX2 where
    /// the CPU has it (whatever the process's kernel path says).
    fn every_path(kind: KKind) -> Vec<(&'static str, RowKernels<BlockQ8K>)> {
        #[allow(unused_mut)]
        let mut all = vec![("portable", scalar_kernels(kind))];
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            all.push(("avx2", super::super::kquant_avx2::kernels(kind)));
        }
        all
    }

    fn check(vals: &[f32], x: &[f32], n: usize, k: usize) {
        for (kind, dtype) in KINDS {
            assert_eq!(KKind::of(dtype), Some(kind));
            let (w, wd) = weights(vals, n, k, dtype);
            let row_bytes = k / QK_K * kind.block_bytes();
            assert_eq!(w.len(), n * row_bytes, "{kind:?} layout");
            // Our decoding of the blocks is candle's (ggml's) dequantization.
            let mut row = vec![0f32; k];
            for j in 0..n {
                dequantize_row(kind, &w[j * row_bytes..(j + 1) * row_bytes], &mut row);
                assert_eq!(row, wd[j * k..(j + 1) * k], "{kind:?} row {j}");
            }
            let xq: Vec<f32> = x
                .chunks_exact(k)
                .flat_map(|r| dequantized_q8(&quantize_row(r)))
                .collect();
            for (name, kern) in every_path(kind) {
                let got = matmul_with(&kern, kind, &w, n, k, x);
                assert_product(&got, &wd, &xq, n, k, 1e-4, &format!("{kind:?} {name}"));
            }
        }
    }

    #[test]
    fn every_kind_matches_its_dequantized_weights() {
        let (n, k) = (13, 2 * QK_K);
        let vals: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1.0 + (i % 13) as f32))
            .collect();
        // One row (decode), five (a tile of four and one more), nine, and zeros.
        for m in [1, 5, 9] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 9.0)
                .collect();
            check(&vals, &x, n, k);
        }
        check(&vals, &vec![0.0; k], n, k);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn random_matrices_match(
            n in 1usize..20,
            blocks in 1usize..4,
            m in 1usize..10,
            seed in any::<u64>(),
            spread in 0.01f32..100.0,
        ) {
            let k = blocks * QK_K;
            let mut next = uniform(seed);
            let vals: Vec<f32> = (0..n * k).map(|_| next() * spread).collect();
            let x: Vec<f32> = (0..m * k).map(|_| next() * 3.0).collect();
            check(&vals, &x, n, k);
        }
    }
}
