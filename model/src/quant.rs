//! Matrix products over GGUF's 32-element block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) with
//! f32 activations, on the CPU: the decode step's kernel.
//!
//! candle multiplies these block types with a portable scalar dot product; most small GGUF
//! models are made of them (SmolLM2-135M Q4_1, Qwen2.5-0.5B Q4_K_M's Q5_0 attention and
//! gate/up matrices, whose 896 columns do not fit K-quants' 256-element super-blocks). This
//! module follows llama.cpp's scheme: each activation row is quantized to 8 bits per block
//! ([`BlockQ8`]), and a weight row's dot product with it runs in integer SIMD (AVX2 + FMA,
//! detected at run time, with a scalar fallback that the tests hold it to), one block scale
//! product per 32 elements. Output rows are split over candle's persistent spinning thread
//! pool (the caller takes a share; waking rayon's sleeping workers for each of a decode
//! step's ~200 products cost more than the products on SmolLM2); each weight row is read once
//! for every activation row of the batch (`m` rows: a batched decode step).
//!
//! Where the CPU has AVX-512 VNNI (Zen 4/5, Ice Lake and later) the matrices are repacked at
//! load, sixteen rows interleaved per block ([`packed`], kernels in `avx512`), and multiply
//! there; elsewhere the AVX2 kernels below (four activation rows per decoded block) run on
//! the file's blocks, and the portable loop is the reference both are tested against.
//!
//! Block layouts (ggml's, little endian; `d`/`m` are f16; element `j < 16` is the low nibble
//! of `qs[j]`, element `j + 16` its high nibble; Q5 high bits: bit `j` of `qh` for element `j`):
//!
//! | type | bytes | layout | value |
//! |---|---:|---|---|
//! | Q4_0 | 18 | `d, qs[16]` | `(q - 8) d` |
//! | Q4_1 | 20 | `d, m, qs[16]` | `q d + m` |
//! | Q5_0 | 22 | `d, qh[4], qs[16]` | `(q - 16) d` |
//! | Q5_1 | 24 | `d, m, qh[4], qs[16]` | `q d + m` |
//! | Q8_0 | 34 | `d, qs[32]` (i8) | `q d` |
//! | IQ4_NL | 18 | `d, qs[16]` | `T[q] d` ([`iq4::LEVELS`]: 16 signed levels) |
//!
//! `IQ4_NL` (and `IQ4_XS`, whose groups become `IQ4_NL` blocks at load) is not a candle type:
//! ragkv's GGUF reader hands its blocks straight to the repacked layout where the AVX2 kernels
//! run ([`iq4`]), and converts them to `Q8_0` elsewhere.

use candle_core::quantized::GgmlDType;
use half::f16;

/// Elements per block.
pub(crate) const QK: usize = 32;

/// A block type this module multiplies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    /// llama.cpp's non-linear 4-bit type (not a [`GgmlDType`]: see [`iq4`]).
    Iq4Nl,
}

impl Kind {
    pub(crate) fn of(dtype: GgmlDType) -> Option<Kind> {
        Some(match dtype {
            GgmlDType::Q4_0 => Kind::Q4_0,
            GgmlDType::Q4_1 => Kind::Q4_1,
            GgmlDType::Q5_0 => Kind::Q5_0,
            GgmlDType::Q5_1 => Kind::Q5_1,
            GgmlDType::Q8_0 => Kind::Q8_0,
            _ => return None,
        })
    }

    /// Bytes per block.
    pub(crate) fn block_bytes(self) -> usize {
        match self {
            Kind::Q4_0 => 18,
            Kind::Q4_1 => 20,
            Kind::Q5_0 => 22,
            Kind::Q5_1 => 24,
            Kind::Q8_0 => 34,
            Kind::Iq4Nl => 18,
        }
    }
}

/// One block of an activation row: scale, scale times the sum of the quants (for the
/// `+ m` term of Q4_1/Q5_1), and the quants.
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub(crate) struct BlockQ8 {
    d: f32,
    s: f32,
    qs: [i8; QK],
}

/// The largest `|x|` of a block (a multiple of 8 long), eight lanes at a time (a form the
/// compiler vectorizes).
pub(crate) fn amax(b: &[f32]) -> f32 {
    let mut m = [0f32; 8];
    for c in b.chunks_exact(8) {
        for (m, v) in m.iter_mut().zip(c) {
            *m = m.max(v.abs());
        }
    }
    m.into_iter().fold(0f32, f32::max)
}

/// `v` (within ±2^22) rounded to the nearest integer, ties to even, as ggml's `nearest_int`:
/// adding 1.5 · 2^23 leaves the integer in the float's low mantissa bits. No call to `roundf`
/// (which the x86-64 baseline lacks an instruction for), so the loops using it vectorize.
#[inline]
pub(crate) fn nearest(v: f32) -> i32 {
    const MAGIC: f32 = 12_582_912.0;
    ((v + MAGIC).to_bits() & 0x007F_FFFF) as i32 - 0x0040_0000
}

/// Quantizes `x` (a multiple of [`QK`] long) to 8 bits per block: `d = max|x| / 127`.
pub(crate) fn quantize_row(x: &[f32]) -> Vec<BlockQ8> {
    x.chunks_exact(QK)
        .map(|b| {
            let d = amax(b) / 127.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            let mut qs = [0i8; QK];
            for (q, v) in qs.iter_mut().zip(b) {
                *q = nearest(v * id) as i8;
            }
            let sum: i32 = qs.iter().map(|&q| q as i32).sum();
            BlockQ8 {
                d,
                s: d * sum as f32,
                qs,
            }
        })
        .collect()
}

fn half(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// A block type's kernels against activation rows of blocks `A`: one weight row's dot
/// product with one activation row, and with four (the weight blocks decoded once for all
/// four).
pub(crate) struct RowKernels<A> {
    pub(crate) one: fn(&[u8], &[A]) -> f32,
    pub(crate) four: fn(&[u8], [&[A]; 4]) -> [f32; 4],
}

/// The kernels of the 32-element block types.
type Kernels = RowKernels<BlockQ8>;

/// A block's integer quants (with the `- 8`/`- 16` offsets applied) and its `m` (0 for the
/// symmetric types).
fn unpack(kind: Kind, blk: &[u8]) -> ([i32; QK], f32) {
    let mut q = [0i32; QK];
    let nibbles = |q: &mut [i32; QK], qs: &[u8], qh: u32, bias: i32| {
        for j in 0..QK / 2 {
            let lo = (qs[j] & 0xF) as u32 | ((qh >> j) & 1) << 4;
            let hi = (qs[j] >> 4) as u32 | ((qh >> (j + 16)) & 1) << 4;
            q[j] = lo as i32 - bias;
            q[j + QK / 2] = hi as i32 - bias;
        }
    };
    match kind {
        Kind::Q4_0 => nibbles(&mut q, &blk[2..18], 0, 8),
        Kind::Q4_1 => nibbles(&mut q, &blk[4..20], 0, 0),
        Kind::Q5_0 => nibbles(&mut q, &blk[6..22], u32_at(blk, 2), 16),
        Kind::Q5_1 => nibbles(&mut q, &blk[8..24], u32_at(blk, 4), 0),
        Kind::Q8_0 => {
            for (v, b) in q.iter_mut().zip(&blk[2..34]) {
                *v = *b as i8 as i32;
            }
        }
        Kind::Iq4Nl => {
            for (j, b) in blk[2..18].iter().enumerate() {
                q[j] = i32::from(iq4::LEVELS[usize::from(b & 0xF)]);
                q[j + QK / 2] = i32::from(iq4::LEVELS[usize::from(b >> 4)]);
            }
        }
    }
    let m = match kind {
        Kind::Q4_1 | Kind::Q5_1 => half(blk, 2),
        _ => 0.0,
    };
    (q, m)
}

/// Portable reference: exact integer sums per block, as the SIMD kernels compute them.
fn dot_scalar(kind: Kind, w: &[u8], a: &[BlockQ8]) -> f32 {
    let mut acc = 0f32;
    for (blk, y) in w.chunks_exact(kind.block_bytes()).zip(a) {
        let (q, m) = unpack(kind, blk);
        let sum: i32 = q.iter().zip(&y.qs).map(|(w, x)| w * *x as i32).sum();
        acc += half(blk, 0) * y.d * sum as f32 + m * y.s;
    }
    acc
}

fn scalar_kernels(kind: Kind) -> Kernels {
    macro_rules! k {
        ($kind:expr) => {
            Kernels {
                one: |w, a| dot_scalar($kind, w, a),
                four: |w, a| a.map(|a| dot_scalar($kind, w, a)),
            }
        };
    }
    match kind {
        Kind::Q4_0 => k!(Kind::Q4_0),
        Kind::Q4_1 => k!(Kind::Q4_1),
        Kind::Q5_0 => k!(Kind::Q5_0),
        Kind::Q5_1 => k!(Kind::Q5_1),
        Kind::Q8_0 => k!(Kind::Q8_0),
        Kind::Iq4Nl => k!(Kind::Iq4Nl),
    }
}

/// The fastest kernels this CPU runs for `kind`.
fn kernels(kind: Kind) -> Kernels {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::avx2() {
        return avx2::kernels(kind);
    }
    scalar_kernels(kind)
}

/// `x @ w.T`: `w` holds `n` rows of `k` elements in `kind` blocks, `x` holds `m` rows of `k`
/// f32; the result is `m` rows of `n`.
pub(crate) fn matmul(kind: Kind, w: &[u8], n: usize, k: usize, x: &[f32]) -> Vec<f32> {
    matmul_with(kernels(kind), kind, w, n, k, x)
}

fn matmul_with(kern: Kernels, kind: Kind, w: &[u8], n: usize, k: usize, x: &[f32]) -> Vec<f32> {
    debug_assert_eq!(k % QK, 0);
    let row_bytes = k / QK * kind.block_bytes();
    let rows: Vec<Vec<BlockQ8>> = x.chunks_exact(k).map(quantize_row).collect();
    matmul_rows(&kern, w, n, row_bytes, &rows, 32)
}

/// Weight rows multiplied together against a chunk of activation rows (their chunk of
/// weights stays in L1 while the activation rows stream past).
const WEIGHT_ROWS: usize = 16;

/// The products of `n` weight rows (`row_bytes` each, one after the other in `w`) with the
/// quantized activation rows `rows` (all of the same number of blocks), as `rows.len()` rows
/// of `n`. The weight rows are split over candle's barrier pool; within its share a thread
/// takes [`WEIGHT_ROWS`] weight rows at a time and, for several activation rows (a prefill),
/// `chunk` blocks of the rows at a time, so that a chunk of activations (four rows) and of
/// weights stay in L1 while they are multiplied together, instead of every weight row
/// streaming all activation rows from L3 or memory (the products are summed over chunks).
/// One activation row (a decode step) is taken whole.
pub(crate) fn matmul_rows<A: Sync>(
    kern: &RowKernels<A>,
    w: &[u8],
    n: usize,
    row_bytes: usize,
    rows: &[Vec<A>],
    chunk: usize,
) -> Vec<f32> {
    let m = rows.len();
    let nb = rows.first().map_or(0, Vec::len);
    debug_assert_eq!(w.len(), n * row_bytes);
    if m == 0 || nb == 0 {
        return vec![0f32; m * n];
    }
    let block_bytes = row_bytes / nb;
    let chunk = if m > 4 { chunk.clamp(1, nb) } else { nb };
    // Output transposed (`n` rows of `m`), so each range of weight rows owns a contiguous
    // run of it.
    let mut out_t = vec![0f32; n * m];
    let dst = SharedOut(out_t.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(n, |range| {
        let dst = &dst;
        // SAFETY: the pool hands out disjoint ranges of `0..n`; rows `range` of `out_t` are
        // written by this call only, and `out_t` outlives `execute_chunked`.
        let d =
            unsafe { std::slice::from_raw_parts_mut(dst.0.add(range.start * m), range.len() * m) };
        let mut j0 = range.start;
        while j0 < range.end {
            let js = j0..(j0 + WEIGHT_ROWS).min(range.end);
            for b0 in (0..nb).step_by(chunk) {
                let bs = b0..(b0 + chunk).min(nb);
                let wr = |j: usize| {
                    &w[j * row_bytes + bs.start * block_bytes..j * row_bytes + bs.end * block_bytes]
                };
                let mut i = 0;
                while i + 4 <= m {
                    let a = [
                        &rows[i][bs.clone()],
                        &rows[i + 1][bs.clone()],
                        &rows[i + 2][bs.clone()],
                        &rows[i + 3][bs.clone()],
                    ];
                    for j in js.clone() {
                        let r = (kern.four)(wr(j), a);
                        let o = &mut d[(j - range.start) * m + i..][..4];
                        for (o, r) in o.iter_mut().zip(r) {
                            *o += r;
                        }
                    }
                    i += 4;
                }
                for i in i..m {
                    for j in js.clone() {
                        d[(j - range.start) * m + i] += (kern.one)(wr(j), &rows[i][bs.clone()]);
                    }
                }
            }
            j0 = js.end;
        }
    });
    transpose(out_t, m, n)
}

/// `n` rows of `m` (the kernels' output, one weight row's results together) as `m` rows of
/// `n`.
fn transpose(out_t: Vec<f32>, m: usize, n: usize) -> Vec<f32> {
    if m == 1 {
        return out_t;
    }
    let mut out = vec![0f32; m * n];
    for (j, col) in out_t.chunks_exact(m).enumerate() {
        for (i, v) in col.iter().enumerate() {
            out[i * n + j] = *v;
        }
    }
    out
}

/// The output buffer, written in disjoint ranges by the pool's threads.
pub(crate) struct SharedOut(pub(crate) *mut f32);
// SAFETY: each thread writes only the rows of the range it was handed.
unsafe impl Sync for SharedOut {}

#[cfg(target_arch = "x86_64")]
/// Whether the CPU (and `RAGKV_KERNELS`) allows the AVX-512 VNNI kernels (`avx512f`,
/// `avx512bw`, `avx512vnni`, `f16c`).
fn avx512_vnni() -> bool {
    crate::simd::allows_avx512()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("f16c")
}

mod amx;
pub(crate) mod packed;
mod tile_pool;
pub(crate) use tile_pool::{quantize_rows, tiled_matmul};
#[cfg(test)]
pub(crate) mod test_util;

#[cfg(target_arch = "x86_64")]
mod avx2;
pub(crate) mod half_rows;
pub(crate) mod iq4;
pub(crate) mod kpacked;
#[cfg(target_arch = "x86_64")]
pub(crate) mod kquant;
#[cfg(target_arch = "x86_64")]
mod kquant_avx2;
#[cfg(target_arch = "x86_64")]
mod packed_avx2;

#[cfg(test)]
mod tests {
    use super::test_util::{iq4_nl_weights, uniform, weights};
    use super::*;
    use proptest::prelude::*;

    const KINDS: [(Kind, GgmlDType); 5] = [
        (Kind::Q4_0, GgmlDType::Q4_0),
        (Kind::Q4_1, GgmlDType::Q4_1),
        (Kind::Q5_0, GgmlDType::Q5_0),
        (Kind::Q5_1, GgmlDType::Q5_1),
        (Kind::Q8_0, GgmlDType::Q8_0),
    ];

    fn dequantized_q8(row: &[BlockQ8]) -> Vec<f32> {
        row.iter()
            .flat_map(|b| b.qs.iter().map(move |q| *q as f32 * b.d))
            .collect()
    }

    fn check(vals: &[f32], x: &[f32], n: usize, k: usize) {
        let kinds = KINDS.iter().map(|&(kind, dtype)| (kind, Some(dtype)));
        for (kind, dtype) in kinds.chain([(Kind::Iq4Nl, None)]) {
            let (w, wd) = match dtype {
                Some(dtype) => {
                    assert_eq!(Kind::of(dtype), Some(kind));
                    weights(vals, n, k, dtype)
                }
                None => iq4_nl_weights(vals, n, k),
            };
            assert_eq!(w.len(), n * k / QK * kind.block_bytes(), "{kind:?} layout");
            let m = x.len() / k;
            // Reference: the dequantized weights times the quantized activations, in f64.
            let xq: Vec<f32> = x
                .chunks_exact(k)
                .flat_map(|r| dequantized_q8(&quantize_row(r)))
                .collect();
            // The file-order path (AVX2 where the CPU has it, else the portable one again)
            // and the portable one.
            let fast = matmul(kind, &w, n, k, x);
            let scalar = matmul_with(scalar_kernels(kind), kind, &w, n, k, x);
            // The repacked layout: its rows are the weights, and its products (VNNI where
            // the CPU has it, else the portable loop again) match too.
            let p = packed::Packed::new(kind, &w, n, k);
            let mut row = vec![0f32; k];
            for j in 0..n {
                p.dequantize_row(j, &mut row);
                assert_eq!(row, wd[j * k..(j + 1) * k], "{kind:?} repacked row {j}");
            }
            let packed = p.matmul(x);
            let portable = p.matmul_portable(x);
            // The repacked layout's AVX2 kernels, without and with AVX-VNNI where the CPU has
            // it, whatever the process's kernel path says.
            #[allow(unused_mut)]
            let (mut avx2_packed, mut vnni256_packed) = (portable.clone(), portable.clone());
            #[cfg(target_arch = "x86_64")]
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                avx2_packed = p.matmul_avx2(x, false);
                if is_x86_feature_detected!("avxvnni") {
                    vnni256_packed = p.matmul_avx2(x, true);
                }
            }
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|c| wd[j * k + c] as f64 * xq[i * k + c] as f64)
                        .sum();
                    let scale: f64 = (0..k)
                        .map(|c| (wd[j * k + c] as f64 * xq[i * k + c] as f64).abs())
                        .sum::<f64>()
                        + 1e-6;
                    for (name, got) in [
                        ("file order", fast[i * n + j]),
                        ("scalar", scalar[i * n + j]),
                        ("packed", packed[i * n + j]),
                        ("packed portable", portable[i * n + j]),
                        ("packed avx2", avx2_packed[i * n + j]),
                        ("packed avx-vnni", vnni256_packed[i * n + j]),
                    ] {
                        let err = (got as f64 - want).abs() / scale;
                        assert!(
                            err < 1e-3,
                            "{kind:?} {name} ({i},{j}): {got} vs {want} (rel {err})"
                        );
                    }
                }
            }
        }
    }

    /// `nearest` rounds as `round_ties_even` over the activation quants' range and beyond,
    /// ties included; `amax` is the largest magnitude wherever it sits.
    #[test]
    fn rounding_and_the_largest_magnitude() {
        for i in -2000..=2000 {
            for v in [i as f32 * 0.0625, i as f32 * 0.5, i as f32 * 0.37 + 1e-3] {
                assert_eq!(nearest(v), v.round_ties_even() as i32, "{v}");
            }
        }
        assert_eq!(nearest(4_194_303.0), 4_194_303);
        let mut b = vec![0.5f32; 256];
        for at in [0, 7, 8, 100, 255] {
            b[at] = -9.0;
            assert_eq!(amax(&b), 9.0, "at {at}");
            b[at] = 0.5;
        }
        assert_eq!(amax(&[0.0; 32]), 0.0);
    }

    #[test]
    fn every_kind_matches_its_dequantized_weights() {
        let (n, k) = (37, 96);
        let vals: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1.0 + (i % 13) as f32))
            .collect();
        let x: Vec<f32> = (0..3 * k)
            .map(|i| ((i * 31 % 97) as f32 - 48.0) / 17.0)
            .collect();
        check(&vals, &x, n, k);
        // Five rows (a tile of four and one more), one row (the decode shape), and an
        // all-zero activation row.
        let x5: Vec<f32> = (0..5 * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 9.0)
            .collect();
        check(&vals, &x5, n, k);
        check(&vals, &x[..k], n, k);
        check(&vals, &vec![0.0; k], n, k);
        // Eleven rows: a full tile of eight and three more.
        let x11: Vec<f32> = (0..11 * k)
            .map(|i| ((i * 41 % 103) as f32 - 51.0) / 7.0)
            .collect();
        check(&vals, &x11, n, k);
        // Thirty-five rows: two AMX tiles of sixteen where the CPU has AMX, and three more.
        let x35: Vec<f32> = (0..35 * k)
            .map(|i| ((i * 43 % 107) as f32 - 53.0) / 8.0)
            .collect();
        check(&vals, &x35, n, k);
    }

    /// Quants at their largest codes (a block's first element of one sign, the rest of the
    /// other) against activations at ±127: where a kernel's 16-bit partial sums overflow
    /// first.
    #[test]
    fn extreme_quants_do_not_overflow() {
        let (n, k) = (19, 2 * QK);
        for first in [1.0f32, -1.0] {
            let vals: Vec<f32> = (0..n * k)
                .map(|i| if i % QK == 0 { first } else { -first } * (1 + i / k) as f32)
                .collect();
            for a in [1.0f32, -1.0] {
                check(&vals, &vec![a; 5 * k], n, k);
            }
        }
    }

    /// Matrices of different kinds and heights multiplied together (one quantization of
    /// the input, one pass) give each one's own product, bit for bit.
    #[test]
    fn many_matrices_at_once_are_each_alone() {
        let k = 96;
        let x: Vec<f32> = (0..11 * k)
            .map(|i| ((i * 41 % 103) as f32 - 51.0) / 7.0)
            .collect();
        let mats: Vec<packed::Packed> = KINDS
            .iter()
            .zip([37, 16, 5, 64, 21])
            .map(|(&(kind, dtype), n)| {
                let vals: Vec<f32> = (0..n * k)
                    .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1.0 + (i % 13) as f32))
                    .collect();
                packed::Packed::new(kind, &weights(&vals, n, k, dtype).0, n, k)
            })
            .collect();
        let all: Vec<&packed::Packed> = mats.iter().chain(&mats[..2]).collect();
        for rows in [1, 8, 11] {
            let x = &x[..rows * k];
            let together = packed::Packed::matmul_many(&all, x);
            assert_eq!(together.len(), all.len());
            for (i, (w, got)) in all.iter().zip(&together).enumerate() {
                assert_eq!(got, &w.matmul(x), "matrix {i}, {rows} rows");
                let alone = packed::Packed::matmul_many(&[w], x);
                assert_eq!(got, &alone[0], "matrix {i}, {rows} rows");
            }
        }
    }

    /// Both layouts (32-element types and K-quants) in one product, in any order, give each
    /// matrix's own product.
    #[test]
    fn both_layouts_at_once_are_each_alone() {
        use super::kquant::KKind;
        let k = 2 * kquant::QK_K;
        let mut next = uniform(5);
        let x: Vec<f32> = (0..9 * k).map(|_| next() * 2.0).collect();
        let mut mat = |kind: packed::PackKind, dtype, n| {
            let vals: Vec<f32> = (0..n * k).map(|_| next()).collect();
            packed::Packed::new(kind, &weights(&vals, n, k, dtype).0, n, k)
        };
        let mats = [
            mat(KKind::Q4K.into(), GgmlDType::Q4K, 37),
            mat(Kind::Q4_0.into(), GgmlDType::Q4_0, 20),
            mat(KKind::Q6K.into(), GgmlDType::Q6K, 16),
            mat(Kind::Q8_0.into(), GgmlDType::Q8_0, 5),
            mat(KKind::Q5K.into(), GgmlDType::Q5K, 3),
        ];
        let all: Vec<&packed::Packed> = mats.iter().collect();
        for rows in [1, 9] {
            let x = &x[..rows * k];
            let together = packed::Packed::matmul_many(&all, x);
            for (i, (w, got)) in all.iter().zip(&together).enumerate() {
                assert_eq!(got, &w.matmul(x), "matrix {i}, {rows} rows");
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn random_matrices_match(
            n in 1usize..40,
            blocks in 1usize..5,
            m in 1usize..20,
            seed in any::<u64>(),
            spread in 0.01f32..100.0,
        ) {
            let k = blocks * QK;
            let mut next = uniform(seed);
            let vals: Vec<f32> = (0..n * k).map(|_| next() * spread).collect();
            let x: Vec<f32> = (0..m * k).map(|_| next() * 3.0).collect();
            check(&vals, &x, n, k);
        }
    }
}
