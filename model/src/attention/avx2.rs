//! AVX2 attention for heads of a multiple of eight elements on CPUs without AVX-512 (or
//! shapes its kernel does not take). Sixteen vector registers cannot hold a group's queries
//! and outputs as the AVX-512 kernel does, so this one widens the cache instead of the
//! heads' work: the key rows of a chunk of [`CHUNK`] positions are widened to f32 once, into
//! a scratch block that stays in L1 (16 KB for heads of 128), and every query head of the
//! KV group reads them from there; likewise the value rows. A decode step therefore converts
//! each f16 row once per group instead of once per query head (three times for
//! SmolLM2, seven for Qwen2.5-0.5B), and reads the cache's bytes from memory once; a
//! prompt's rows (up to a task's sixteen) share each widened chunk of their prefix too.
//!
//! Scores go eight keys at a time: a head's query against eight widened keys in eight
//! accumulators (one multiply-add per vector and key, the key's lanes read straight from
//! L1), summed across lanes together by a transposing tree of `hadd`s (~9 instructions for
//! eight scores instead of ~5 each). The weighted sum of values keeps up to eight output
//! vectors of a head in registers over the chunk's rows. Softmax as the loops' (ggml's
//! vectorized `exp`), the normalization applied to the weights before the values' pass.
//!
//! q8 rows are not widened at all: each query head is rounded once to 16-bit codes and
//! multiplied with the keys' 8-bit codes where they lie, and each head's weights are rounded
//! likewise per chunk and multiplied with value rows paired in 16 bits ([`codes`]), as
//! llama.cpp scores `q8_0` keys against a quantized query.

use std::arch::x86_64::*;

use half::f16;

use crate::kv_q8::BLOCK;
use crate::simd::x86::hsum256 as hsum;

use super::loops::Kernel;
use super::Ahead;

mod codes;

#[cfg(test)]
pub(super) use codes::query_codes;

/// Cache positions widened together: 32 rows of 128 f32 are 16 KB, half an L1 data cache.
const CHUNK: usize = 32;

/// Whether this kernel takes heads of `d` elements.
pub(super) fn takes(d: usize) -> bool {
    d > 0 && d.is_multiple_of(8)
}

/// Cache elements this kernel widens to f32 a whole row at a time.
pub(super) trait WidenRow: Copy {
    /// Elements a row of `d` takes in the cache (more than `d` where scales follow).
    fn row_len(d: usize) -> usize {
        d
    }

    /// The row of `d` values (a multiple of 8) at `src` as f32 into `dst`.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; the row ([`WidenRow::row_len`]) is readable at `src`
    /// and `d` floats writable at `dst`.
    unsafe fn widen_row(src: *const Self, d: usize, dst: *mut f32);

    /// The row elements as q8 codes and scales, for dtypes whose rows the kernel multiplies
    /// in integers ([`codes`]) instead of widening them to f32.
    fn as_codes(rows: &[Self]) -> Option<&[u8]> {
        let _ = rows;
        None
    }
}

impl WidenRow for f32 {
    #[inline]
    unsafe fn widen_row(src: *const f32, d: usize, dst: *mut f32) {
        // SAFETY: the caller's contract; the scratch block never overlaps a cache.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, d) }
    }
}

impl WidenRow for f16 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn widen_row(src: *const f16, d: usize, dst: *mut f32) {
        for i in (0..d).step_by(8) {
            // SAFETY: the caller's contract: elements `i..i + 8 <= d` of both rows.
            unsafe {
                let x = _mm256_cvtph_ps(_mm_loadu_si128(src.add(i).cast()));
                _mm256_storeu_ps(dst.add(i), x);
            }
        }
    }
}

/// q8 cache rows (`crate::kv_q8`): `d` signed codes, then an f32 scale per block of 32.
/// Multiplied in integers ([`codes`]) where heads have at most 256 elements.
impl WidenRow for u8 {
    fn row_len(d: usize) -> usize {
        crate::kv_q8::row_bytes(d)
    }

    fn as_codes(rows: &[u8]) -> Option<&[u8]> {
        Some(rows)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn widen_row(src: *const u8, d: usize, dst: *mut f32) {
        for k in 0..d / BLOCK {
            // SAFETY: the caller's contract: codes `32k..32k + 32` and the block's scale at
            // `d + 4k` (q8 rows are whole blocks, `kv_q8::supports`), outputs likewise.
            unsafe {
                let s = _mm256_set1_ps(src.add(d + 4 * k).cast::<f32>().read_unaligned());
                for i in (BLOCK * k..BLOCK * (k + 1)).step_by(8) {
                    let codes = _mm256_cvtepi8_epi32(_mm_loadl_epi64(src.add(i).cast()));
                    _mm256_storeu_ps(dst.add(i), _mm256_mul_ps(_mm256_cvtepi32_ps(codes), s));
                }
            }
        }
    }
}

/// Query rows of one sequence, each with `rep` heads `q` (rows of `rep d`, [`takes`]), over
/// the key and value rows of their spans (`spans[i]` = first and last position of row `i`)
/// of `k` and `v` (row strides `ks`, `vs`): the softmax-weighted sums of values into `o`
/// (like `q`), scores scaled by `scale`; `p` and `wide` are scratch. Each chunk of rows is
/// widened (or, for q8 rows, paired: [`codes`]) once for every query row that sees it (a
/// prompt's rows share their prefix).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C (`crate::simd::avx2`).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn group<T: WidenRow>(
    q: &[f32],
    d: usize,
    k: &[T],
    ks: usize,
    v: &[T],
    vs: usize,
    spans: &[(usize, usize)],
    scale: f32,
    p: &mut Vec<f32>,
    wide: &mut Vec<f32>,
    o: &mut [f32],
) {
    let rows = spans.len();
    let rep = q.len() / (d * rows.max(1));
    let lo = spans.iter().map(|s| s.0).min().unwrap_or(0);
    let hi = spans.iter().map(|s| s.1).max().unwrap_or(0);
    assert!(
        takes(d)
            && rows > 0
            && q.len() == rows * rep * d
            && o.len() == q.len()
            && spans.iter().all(|&(from, pos)| from <= pos)
            && hi * ks + T::row_len(d) <= k.len()
            && hi * vs + T::row_len(d) <= v.len()
    );
    // q8 rows in integers: whole blocks of codes, at most `codes::MAX_BLOCKS` of them.
    let int = T::as_codes(k)
        .zip(T::as_codes(v))
        .filter(|_| d.is_multiple_of(BLOCK) && d / BLOCK <= codes::MAX_BLOCKS);
    // Scores of query row `i`, head `h`, at position `lo + j`: p[(i rep + h) n + j], written
    // for the row's own span only.
    let n = hi + 1 - lo;
    p.clear();
    p.resize(rows * rep * n, 0.0);
    wide.clear();
    wide.resize(CHUNK * d, 0.0);
    let (pp, wp) = (p.as_mut_ptr(), wide.as_mut_ptr());
    // Each row's lines asked for a few kilobytes ahead of its widening ([`Ahead`]).
    let ahead = Ahead::new(T::row_len(d) * std::mem::size_of::<T>());
    // The part of chunk `c0..c0 + m` (positions from `lo`) that row `i` sees.
    let seen = |i: usize, c0: usize, m: usize| {
        let (from, pos) = spans[i];
        let (a, b) = ((from - lo).max(c0), (pos - lo + 1).min(c0 + m));
        (a < b).then_some((a, b))
    };
    // For q8 rows, every query head's 16-bit codes (its scale times the scores').
    let (mut qcodes, mut qscale) = (Vec::new(), Vec::new());
    if int.is_some() {
        qcodes.resize(q.len(), 0i16);
        for (h, c) in q.chunks_exact(d).zip(qcodes.chunks_exact_mut(d)) {
            qscale.push(codes::query_codes(h, c) * scale);
        }
    }
    for c0 in (0..n).step_by(CHUNK) {
        let m = CHUNK.min(n - c0);
        for r in 0..m {
            let at = (lo + c0 + r + ahead.rows).min(hi);
            ahead.fetch(k.as_ptr().wrapping_add(at * ks).cast());
            if int.is_none() {
                // SAFETY: position `lo + c0 + r <= hi` is in bounds (asserted); the scratch
                // block holds `CHUNK` rows of `d`.
                unsafe { T::widen_row(k.as_ptr().add((lo + c0 + r) * ks), d, wp.add(r * d)) };
            }
        }
        for i in 0..rows {
            let Some((a, b)) = seen(i, c0, m) else {
                continue;
            };
            for h in 0..rep {
                let line = i * rep + h;
                let at = line * n;
                // SAFETY: head `h` of row `i` of `q`; scores `a..b` of its line of `p`
                // (resized to `rows rep n`); widened rows `a - c0..b - c0 <= m`, or the
                // cache's rows `lo + a..lo + b <= hi + 1` (asserted in bounds).
                unsafe {
                    if let Some((kc, _)) = int {
                        let qc = codes::QueryCodes {
                            codes: &qcodes[line * d..(line + 1) * d],
                            scale: qscale[line],
                        };
                        let keys = kc.as_ptr().add((lo + a) * ks);
                        codes::code_scores(&qc, d, keys, ks, b - a, pp.add(at + a));
                    } else {
                        let (qh, keys) = (q.as_ptr().add(line * d), wp.add((a - c0) * d));
                        scores(qh, d, keys, b - a, scale, pp.add(at + a));
                    }
                }
            }
        }
    }
    for (i, &(from, pos)) in spans.iter().enumerate() {
        for h in 0..rep {
            let at = (i * rep + h) * n;
            let s = &mut p[at + from - lo..at + pos - lo + 1];
            let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let inv = 1.0 / Kernel::Avx2.exp_sub(s, max);
            s.iter_mut().for_each(|x| *x *= inv);
        }
    }
    o.fill(0.0);
    let (pp, op) = (p.as_ptr(), o.as_mut_ptr());
    // q8 values: a chunk's rows paired in 16 bits, their block scales, a head's weights.
    let (mut pairs, mut vscales, mut wq) = (Vec::new(), Vec::new(), codes::Weights::new());
    if int.is_some() {
        pairs.resize(codes::pairs_len(d), 0i16);
        vscales.resize(CHUNK * d / BLOCK, 0f32);
    }
    for c0 in (0..n).step_by(CHUNK) {
        let m = CHUNK.min(n - c0);
        for r in 0..m {
            let at = (lo + c0 + r + ahead.rows).min(hi);
            ahead.fetch(v.as_ptr().wrapping_add(at * vs).cast());
            if int.is_none() {
                // SAFETY: as for the keys.
                unsafe { T::widen_row(v.as_ptr().add((lo + c0 + r) * vs), d, wp.add(r * d)) };
            }
        }
        if let Some((_, vc)) = int {
            // SAFETY: rows `lo + c0..lo + c0 + m <= hi + 1` are in bounds (asserted); the
            // scratch was sized for a chunk.
            unsafe {
                let from = vc.as_ptr().add((lo + c0) * vs);
                codes::pair_rows(from, vs, d, m, &mut pairs, &mut vscales);
            }
        }
        for i in 0..rows {
            let Some((a, b)) = seen(i, c0, m) else {
                continue;
            };
            for h in 0..rep {
                let line = i * rep + h;
                let (oh, ph) = (op.wrapping_add(line * d), pp.wrapping_add(line * n + a));
                if int.is_some() {
                    // SAFETY: the head's `d` outputs; weights `a..b` of its line; chunk rows
                    // `a - c0..b - c0 <= m` paired just above.
                    unsafe {
                        let rows = (ph, a - c0, b - c0);
                        codes::weighted(oh, d, &pairs, &vscales, rows, &mut wq);
                    }
                    continue;
                }
                let wr = wp.wrapping_add((a - c0) * d);
                // Up to eight output vectors at a time stay in registers over the chunk.
                let mut c = 0;
                while c < d {
                    let left = (d - c) / 8;
                    // SAFETY: columns `c..c + 8 NV <= d` of the head's output and of the
                    // widened rows `a - c0..b - c0`; weights `a..b` of the head's line.
                    unsafe {
                        let (oc, wc, m) = (oh.add(c), wr.add(c), b - a);
                        c += 8 * match left {
                            8.. => weighted::<8>(oc, wc, d, ph, m),
                            4..=7 => weighted::<4>(oc, wc, d, ph, m),
                            2..=3 => weighted::<2>(oc, wc, d, ph, m),
                            _ => weighted::<1>(oc, wc, d, ph, m),
                        };
                    }
                }
            }
        }
    }
}

/// Scores of the query at `q` (`d` floats) against `m` widened keys at `keys` (rows of `d`),
/// times `scale`, into `out[..m]`.
///
/// # Safety
/// AVX2 and FMA; the pointers are valid for those extents.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn scores(q: *const f32, d: usize, keys: *const f32, m: usize, scale: f32, out: *mut f32) {
    // SAFETY: the caller's contract; every offset is below `d` within a row, rows below `m`.
    unsafe {
        let sv = _mm256_set1_ps(scale);
        let mut r = 0;
        while r + 8 <= m {
            let mut acc = [_mm256_setzero_ps(); 8];
            for c in (0..d).step_by(8) {
                let qv = _mm256_loadu_ps(q.add(c));
                for (j, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys.add((r + j) * d + c)), *acc);
                }
            }
            _mm256_storeu_ps(out.add(r), _mm256_mul_ps(sum8(&acc), sv));
            r += 8;
        }
        while r < m {
            let mut acc = _mm256_setzero_ps();
            for c in (0..d).step_by(8) {
                acc = _mm256_fmadd_ps(
                    _mm256_loadu_ps(q.add(c)),
                    _mm256_loadu_ps(keys.add(r * d + c)),
                    acc,
                );
            }
            *out.add(r) = hsum(acc) * scale;
            r += 1;
        }
    }
}

/// `o[..8 NV] += Σ_r w[r] × rows[r][..8 NV]` over `m` rows of stride `d`; returns `NV`.
///
/// # Safety
/// AVX2 and FMA; the pointers are valid for those extents.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn weighted<const NV: usize>(
    o: *mut f32,
    rows: *const f32,
    d: usize,
    w: *const f32,
    m: usize,
) -> usize {
    // SAFETY: the caller's contract.
    unsafe {
        let mut acc: [__m256; NV] = std::array::from_fn(|c| _mm256_loadu_ps(o.add(8 * c)));
        for r in 0..m {
            let wv = _mm256_set1_ps(*w.add(r));
            for (c, acc) in acc.iter_mut().enumerate() {
                *acc = _mm256_fmadd_ps(wv, _mm256_loadu_ps(rows.add(r * d + 8 * c)), *acc);
            }
        }
        for (c, acc) in acc.iter().enumerate() {
            _mm256_storeu_ps(o.add(8 * c), *acc);
        }
    }
    NV
}

/// The sums of eight vectors' lanes, as one vector: lane `j` is the sum of `v[j]`'s lanes.
#[inline]
#[target_feature(enable = "avx2")]
fn sum8(v: &[__m256; 8]) -> __m256 {
    // Within each 128-bit half: pairs, then quads of lanes, four vectors per result.
    let t: [__m256; 4] = std::array::from_fn(|i| _mm256_hadd_ps(v[2 * i], v[2 * i + 1]));
    let (lo, hi) = (_mm256_hadd_ps(t[0], t[1]), _mm256_hadd_ps(t[2], t[3]));
    // `lo` holds vectors 0-3's low and high halves' sums, `hi` 4-7's: add the halves.
    _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(lo, hi),
        _mm256_permute2f128_ps::<0x31>(lo, hi),
    )
}
