//! The AVX2 kernel's integer products over q8 cache rows (`crate::kv_q8`: `d` signed codes,
//! then an f32 scale per block of 32), so that neither keys nor values are widened to f32.
//!
//! | pass | operands | per block of 32 codes |
//! |---|---|---|
//! | scores ([`code_scores`]) | the query head's 16-bit codes ([`query_codes`], one scale) against a key row's codes | `vpmovsxbw` ×2, `vpmaddwd` ×2 (exact in i32), times the key block's scale in f32 |
//! | weighted sum ([`weighted`]) | each row's weight times its block's scale, as 16-bit codes per chunk and block ([`Weights`]), against two rows' codes interleaved ([`pair_rows`]) | `vpmaddwd` ×2 per two rows and 16 columns, summed in i32 over the chunk, times the weights' scale in f32 |
//!
//! Widening a q8 row to f32 takes four instructions per eight codes (sign-extend, convert,
//! scale, store); a row's products with the three query heads of a SmolLM2 group take about
//! as many, so the widening was half the kernel's instructions. Measured on a Zen 3 VM
//! (docs/BENCHMARKS.md, "q8 rows in integers"), the time gained is smaller than that: the
//! kernel waits mostly on the cache rows' loads. llama.cpp scores `q8_0` keys against a
//! query rounded to 8 bits; 15 bits here keep the query's and the weights' rounding some
//! 250× (32,767 / 127) finer than the codes' own. Sums stay in i32: a pair's products are
//! at most `2 × 32,767 × 127` (8.3 M), a chunk of [`CHUNK`] rows sums 16 of them (133 M <
//! 2³¹).

use std::arch::x86_64::*;

use crate::kv_q8::BLOCK;
use crate::simd::x86::hsum256 as hsum;

use super::{sum8, CHUNK};

/// One query head as 16-bit codes and one scale (`q ≈ codes × scale`).
pub(in crate::attention) struct QueryCodes<'a> {
    pub codes: &'a [i16],
    /// The codes' scale times the scores' (`scale` of the group).
    pub scale: f32,
}

/// The 16-bit codes of `q` into `codes` (as long), rounded to nearest: returns their scale
/// (0 for a zero or non-finite head, whose codes are then 0).
pub(in crate::attention) fn query_codes(q: &[f32], codes: &mut [i16]) -> f32 {
    let amax = q.iter().fold(0f32, |m, x| m.max(x.abs()));
    if !(amax > 0.0 && amax.is_finite()) {
        codes.fill(0);
        return 0.0;
    }
    let (scale, inv) = (amax / 32767.0, 32767.0 / amax);
    for (c, x) in codes.iter_mut().zip(q) {
        *c = (x * inv).round().clamp(-32767.0, 32767.0) as i16;
    }
    scale
}

/// Block `b` of the row at `row` against the query's codes at `qp`: the products, summed in
/// eight lanes, as f32.
///
/// # Safety
/// AVX2; codes `32b..32b + 32` of the row and of the query are readable.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn block(row: *const u8, qp: *const i16, b: usize) -> __m256 {
    // SAFETY: the caller's contract.
    unsafe {
        let k0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(row.add(BLOCK * b).cast()));
        let k1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(row.add(BLOCK * b + 16).cast()));
        let q0 = _mm256_loadu_si256(qp.add(BLOCK * b).cast());
        let q1 = _mm256_loadu_si256(qp.add(BLOCK * b + 16).cast());
        _mm256_cvtepi32_ps(_mm256_add_epi32(
            _mm256_madd_epi16(k0, q0),
            _mm256_madd_epi16(k1, q1),
        ))
    }
}

/// The scale of block `b` of the q8 row of `d` codes at `row`, in every lane.
///
/// # Safety
/// AVX2; the row's scales are readable.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn scale_of(row: *const u8, d: usize, b: usize) -> __m256 {
    // SAFETY: the caller's contract; scales follow a row's `d` codes, unaligned.
    unsafe { _mm256_set1_ps(row.add(d + 4 * b).cast::<f32>().read_unaligned()) }
}

/// Scores of the query `q` (`d` codes, a multiple of 32) against `m` q8 key rows from `keys`
/// (row stride `ks` bytes), times `q.scale`, into `out[..m]`: eight keys at a time in eight
/// accumulators, their lanes summed together as the f32 kernel's.
///
/// # Safety
/// AVX2 and FMA; `q.codes` holds `d` codes; rows `0..m` of `keys` are readable
/// (`row_bytes(d)` each) and `out[..m]` writable.
#[target_feature(enable = "avx2,fma")]
pub(in crate::attention) unsafe fn code_scores(
    q: &QueryCodes<'_>,
    d: usize,
    keys: *const u8,
    ks: usize,
    m: usize,
    out: *mut f32,
) {
    debug_assert!(q.codes.len() == d && d.is_multiple_of(BLOCK));
    let qp = q.codes.as_ptr();
    // SAFETY: the caller's contract.
    unsafe {
        let sv = _mm256_set1_ps(q.scale);
        let mut r = 0;
        while r + 8 <= m {
            let mut acc = [_mm256_setzero_ps(); 8];
            for b in 0..d / BLOCK {
                for (j, acc) in acc.iter_mut().enumerate() {
                    let row = keys.add((r + j) * ks);
                    *acc = _mm256_fmadd_ps(block(row, qp, b), scale_of(row, d, b), *acc);
                }
            }
            _mm256_storeu_ps(out.add(r), _mm256_mul_ps(sum8(&acc), sv));
            r += 8;
        }
        while r < m {
            let row = keys.add(r * ks);
            let mut acc = _mm256_setzero_ps();
            for b in 0..d / BLOCK {
                acc = _mm256_fmadd_ps(block(row, qp, b), scale_of(row, d, b), acc);
            }
            *out.add(r) = hsum(acc) * q.scale;
            r += 1;
        }
    }
}

/// `i16`s [`pair_rows`] writes for a chunk of rows of `d` codes.
pub(in crate::attention) fn pairs_len(d: usize) -> usize {
    CHUNK.div_ceil(2) * 2 * d
}

/// The value rows `0..m` (`m ≤ CHUNK`) from `rows` (stride `vs` bytes) for [`weighted`]:
/// rows `2p` and `2p + 1` sign-extended to 16 bits and interleaved column by column, per
/// group of 16 columns (`vpunpck[lh]wd`: columns 0-3 and 8-11, then 4-7 and 12-15) at
/// `pairs[(p (d / 16) + g) 32..]` (an odd last row paired with zeros), and each row's block
/// scales at `scales[b CHUNK + r]`.
///
/// # Safety
/// AVX2; rows `0..m` of `rows` are readable; `pairs` holds [`pairs_len`] and `scales`
/// `CHUNK d / 32`.
#[target_feature(enable = "avx2")]
pub(in crate::attention) unsafe fn pair_rows(
    rows: *const u8,
    vs: usize,
    d: usize,
    m: usize,
    pairs: &mut [i16],
    scales: &mut [f32],
) {
    debug_assert!(m <= CHUNK && pairs.len() >= pairs_len(d) && scales.len() >= CHUNK * d / BLOCK);
    let groups = d / 16;
    let out = pairs.as_mut_ptr();
    // SAFETY: the caller's contract; pair `p < CHUNK / 2`, group `g < d / 16`.
    unsafe {
        for p in 0..m.div_ceil(2) {
            // Row `2p + 1` is read only where it is one of the `m` (its address may be past
            // the rows otherwise).
            let (r0, r1) = (rows.add(2 * p * vs), rows.wrapping_add((2 * p + 1) * vs));
            let second = 2 * p + 1 < m;
            for g in 0..groups {
                let a = _mm256_cvtepi8_epi16(_mm_loadu_si128(r0.add(16 * g).cast()));
                let b = if second {
                    _mm256_cvtepi8_epi16(_mm_loadu_si128(r1.add(16 * g).cast()))
                } else {
                    _mm256_setzero_si256()
                };
                let at = out.add((p * groups + g) * 32);
                _mm256_storeu_si256(at.cast(), _mm256_unpacklo_epi16(a, b));
                _mm256_storeu_si256(at.add(16).cast(), _mm256_unpackhi_epi16(a, b));
            }
        }
        for r in 0..m {
            for b in 0..d / BLOCK {
                scales[b * CHUNK + r] = rows.add(r * vs + d + 4 * b).cast::<f32>().read_unaligned();
            }
        }
    }
}

/// One head's weights over a chunk's rows, per block of 32 columns: `w[r] × scale[b][r]` as
/// 16-bit codes (`codes[b CHUNK + r]`, zero outside the head's rows) and one scale per block.
pub(in crate::attention) struct Weights {
    codes: [i16; CHUNK * MAX_BLOCKS],
    scale: [f32; MAX_BLOCKS],
}

impl Weights {
    pub(in crate::attention) fn new() -> Weights {
        Weights {
            codes: [0; CHUNK * MAX_BLOCKS],
            scale: [0.0; MAX_BLOCKS],
        }
    }
}

/// Blocks a [`Weights`] holds: heads of up to 256 elements.
pub(in crate::attention) const MAX_BLOCKS: usize = 8;

/// `o[..d] += Σ_r w[r - a] × value row r` over the chunk's rows `a..b` that [`pair_rows`]
/// laid out in `pairs` and `scales`: the weights times each row's block scale rounded to
/// 16-bit codes per block ([`Weights`], `wq` scratch), then summed against the codes in i32.
///
/// # Safety
/// AVX2 and FMA; `a < b ≤ CHUNK`, the rows were laid out by [`pair_rows`] with this `d`
/// (`d / 32 ≤ MAX_BLOCKS`); `w[..b - a]` readable, `o[..d]` writable.
#[target_feature(enable = "avx2,fma")]
pub(in crate::attention) unsafe fn weighted(
    o: *mut f32,
    d: usize,
    pairs: &[i16],
    scales: &[f32],
    (w, a, b): (*const f32, usize, usize),
    wq: &mut Weights,
) {
    let blocks = d / BLOCK;
    debug_assert!(a < b && b <= CHUNK && blocks <= MAX_BLOCKS);
    // Rows `p0 2..p1 2` in pairs; the weights of rows outside `a..b` are zero.
    let (p0, p1) = (a / 2, b.div_ceil(2));
    // SAFETY: the caller's contract; every index below is within a chunk's rows or pairs.
    unsafe {
        let mut x = [0f32; CHUNK];
        std::ptr::copy_nonoverlapping(w, x.as_mut_ptr().add(a), b - a);
        for blk in 0..blocks {
            let sv = scales.as_ptr().add(blk * CHUNK);
            let mut v = [_mm256_setzero_ps(); CHUNK / 8];
            let mut max = _mm256_setzero_ps();
            for (i, v) in v.iter_mut().enumerate() {
                *v = _mm256_mul_ps(
                    _mm256_loadu_ps(x.as_ptr().add(8 * i)),
                    _mm256_loadu_ps(sv.add(8 * i)),
                );
                max = _mm256_max_ps(max, _mm256_andnot_ps(_mm256_set1_ps(-0.0), *v));
            }
            let amax = hmax(max);
            let (scale, inv) = if amax > 0.0 && amax.is_finite() {
                (amax / 32767.0, 32767.0 / amax)
            } else {
                (0.0, 0.0)
            };
            wq.scale[blk] = scale;
            let inv = _mm256_set1_ps(inv);
            let out = wq.codes.as_mut_ptr().add(blk * CHUNK);
            for i in 0..CHUNK / 16 {
                let lo = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * i], inv));
                let hi = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * i + 1], inv));
                // `packs` works within 128-bit lanes: put the quarters back in order.
                let packed = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(lo, hi));
                _mm256_storeu_si256(out.add(16 * i).cast(), packed);
            }
        }
        let groups = d / 16;
        let mut g0 = 0;
        while g0 < groups {
            g0 += if groups - g0 >= 4 {
                tile::<4>(o, groups, g0, pairs, wq, (p0, p1))
            } else {
                tile::<2>(o, groups, g0, pairs, wq, (p0, p1))
            };
        }
    }
}

/// Columns `16 g0..16 (g0 + G)` of [`weighted`]: `2G` i32 accumulators over pairs `p0..p1`.
///
/// # Safety
/// As [`weighted`]'s; `g0 + G ≤ groups` (`G` even: groups of a block come in twos).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile<const G: usize>(
    o: *mut f32,
    groups: usize,
    g0: usize,
    pairs: &[i16],
    wq: &Weights,
    (p0, p1): (usize, usize),
) -> usize {
    // SAFETY: the caller's contract.
    unsafe {
        let mut acc: [[__m256i; 2]; G] = [[_mm256_setzero_si256(); 2]; G];
        let pp = pairs.as_ptr();
        for p in p0..p1 {
            for (gi, acc) in acc.iter_mut().enumerate() {
                let g = g0 + gi;
                // Rows 2p and 2p + 1's codes of the group's block, one i32.
                let wv = _mm256_set1_epi32(
                    wq.codes
                        .as_ptr()
                        .add((g / 2) * CHUNK + 2 * p)
                        .cast::<i32>()
                        .read_unaligned(),
                );
                let at = pp.add((p * groups + g) * 32);
                acc[0] =
                    _mm256_add_epi32(acc[0], _mm256_madd_epi16(_mm256_loadu_si256(at.cast()), wv));
                acc[1] = _mm256_add_epi32(
                    acc[1],
                    _mm256_madd_epi16(_mm256_loadu_si256(at.add(16).cast()), wv),
                );
            }
        }
        for (gi, acc) in acc.iter().enumerate() {
            let g = g0 + gi;
            let s = _mm256_set1_ps(wq.scale[g / 2]);
            let lo = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[0]), s);
            let hi = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[1]), s);
            let (c0, c1) = (o.add(16 * g), o.add(16 * g + 8));
            _mm256_storeu_ps(
                c0,
                _mm256_add_ps(_mm256_loadu_ps(c0), _mm256_permute2f128_ps::<0x20>(lo, hi)),
            );
            _mm256_storeu_ps(
                c1,
                _mm256_add_ps(_mm256_loadu_ps(c1), _mm256_permute2f128_ps::<0x31>(lo, hi)),
            );
        }
    }
    G
}

/// The largest of a vector's lanes.
#[inline]
#[target_feature(enable = "avx2")]
fn hmax(v: __m256) -> f32 {
    let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_q8::{dequantize_row, quantize_row, row_bytes};

    /// `n` q8 rows of `d` from a smooth pattern, each row's magnitude its own.
    fn rows(n: usize, d: usize, seed: f32) -> Vec<u8> {
        let w = row_bytes(d);
        let mut out = vec![0u8; n * w];
        for (r, o) in out.chunks_exact_mut(w).enumerate() {
            let x: Vec<f32> = (0..d)
                .map(|c| ((r * d + c) as f32 * seed).sin() * (1.0 + r as f32 * 0.3))
                .collect();
            quantize_row(&x, o);
        }
        out
    }

    fn widened(rows: &[u8], d: usize) -> Vec<Vec<f32>> {
        rows.chunks_exact(row_bytes(d))
            .map(|r| {
                let mut x = vec![0f32; d];
                dequantize_row(r, &mut x);
                x
            })
            .collect()
    }

    /// Scores against the codes equal the f32 products with the keys' values within the
    /// query's rounding: Σ over blocks of scale × Σ |code| × half a query step.
    #[test]
    fn code_scores_are_the_products_within_the_query_rounding() {
        if !crate::simd::avx2() {
            return;
        }
        for d in [32, 64, 128, 256] {
            let (n, w) = (21, row_bytes(d));
            let keys = rows(n, d, 0.37);
            let wide = widened(&keys, d);
            let q: Vec<f32> = (0..d).map(|c| (c as f32 * 0.61).cos() * 1.7).collect();
            let mut codes = vec![0i16; d];
            let step = query_codes(&q, &mut codes);
            let qc = QueryCodes {
                codes: &codes,
                scale: step * 0.125,
            };
            let mut out = vec![0f32; n];
            // SAFETY: AVX2 checked above; `n` rows of `w` bytes, `n` scores.
            unsafe { code_scores(&qc, d, keys.as_ptr(), w, n, out.as_mut_ptr()) };
            for (r, (got, k)) in out.iter().zip(&wide).enumerate() {
                let want: f32 = q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * 0.125;
                let bound: f32 = k.iter().map(|x| x.abs()).sum::<f32>() * step * 0.5 * 0.125;
                assert!(
                    (got - want).abs() <= bound + 1e-5 * want.abs().max(1.0),
                    "d {d}, row {r}: {got} vs {want} (bound {bound})"
                );
            }
        }
    }

    /// The weighted sum of paired value rows equals the f32 one within the weights'
    /// rounding, for spans starting and ending at odd rows, a chunk's odd last row, and
    /// heads of 32 to 256 elements; the output is added to, not overwritten.
    #[test]
    fn weighted_codes_are_the_sums_within_the_weights_rounding() {
        if !crate::simd::avx2() {
            return;
        }
        for d in [32, 64, 96, 256] {
            let w = row_bytes(d);
            for (m, a, b) in [(32, 0, 32), (31, 3, 31), (7, 1, 6), (1, 0, 1), (32, 5, 6)] {
                let vals = rows(m, d, 0.23);
                let wide = widened(&vals, d);
                let p: Vec<f32> = (a..b).map(|r| ((r * 7) % 5) as f32 * 0.1 + 0.01).collect();
                let (mut pairs, mut scales) =
                    (vec![0i16; pairs_len(d)], vec![0f32; CHUNK * d / 32]);
                let mut wq = Weights::new();
                let mut o = vec![0.5f32; d];
                // SAFETY: AVX2 checked above; `m ≤ CHUNK` rows of `w`, scratch sized for a
                // chunk, weights `b - a`, outputs `d`.
                unsafe {
                    pair_rows(vals.as_ptr(), w, d, m, &mut pairs, &mut scales);
                    weighted(
                        o.as_mut_ptr(),
                        d,
                        &pairs,
                        &scales,
                        (p.as_ptr(), a, b),
                        &mut wq,
                    );
                }
                for c in 0..d {
                    let want: f32 = 0.5 + (a..b).map(|r| p[r - a] * wide[r][c]).sum::<f32>();
                    // Each row's weight × scale is within half a step of its block's codes.
                    let blk = c / 32;
                    let step = (a..b)
                        .map(|r| p[r - a] * scales[blk * CHUNK + r])
                        .fold(0f32, f32::max)
                        / 32767.0;
                    let bound: f32 = (a..b)
                        .map(|r| step * 0.5 * (wide[r][c] / scales[blk * CHUNK + r]).abs())
                        .sum();
                    assert!(
                        (o[c] - want).abs() <= bound + 1e-5 * want.abs().max(1.0),
                        "d {d}, rows {a}..{b} of {m}, column {c}: {} vs {want}",
                        o[c]
                    );
                }
            }
        }
    }
}
