//! AVX2 + FMA + F16C kernels for the K-quants (llama.cpp's `ggml_vec_dot_q{4,5,6}_K_q8_K`
//! AVX2 paths), each for one activation row or four at once: a weight super-block is decoded
//! into bytes once and multiplied with every row's quants (`maddubs` pairs, `madd` with the
//! sub-block scales into 32-bit sums). The minimums (Q4_K, Q5_K) and Q6_K's `-32` offset are
//! applied through each activation block's sums of 16 quants, one `madd` per block and row
//! (Q2_K's minimums and Q3_K's `-4` likewise).
//!
//! The kernels are safe `#[target_feature]` functions; [`kernels`] wraps them in plain
//! function pointers, which its callers hand out only after `crate::simd::avx2()`.

use std::arch::x86_64::*;

use super::kquant::{scale_min, scales_q3, BlockQ8K, KKind};
use super::RowKernels;

pub(super) fn kernels(kind: KKind) -> RowKernels<BlockQ8K> {
    match kind {
        KKind::Q2K => RowKernels {
            // SAFETY: AVX2, FMA and F16C were detected (`crate::simd::avx2()`).
            one: |w, a| unsafe { q23k::<false, 1>(w, [a])[0] },
            // SAFETY: AVX2, FMA and F16C were detected (`crate::simd::avx2()`).
            four: |w, a| unsafe { q23k::<false, 4>(w, a) },
        },
        KKind::Q3K => RowKernels {
            // SAFETY: AVX2, FMA and F16C were detected (`crate::simd::avx2()`).
            one: |w, a| unsafe { q23k::<true, 1>(w, [a])[0] },
            // SAFETY: AVX2, FMA and F16C were detected (`crate::simd::avx2()`).
            four: |w, a| unsafe { q23k::<true, 4>(w, a) },
        },
        KKind::Q4K => RowKernels {
            // SAFETY: AVX2, FMA and F16C were detected (`crate::simd::avx2()`).
            one: |w, a| unsafe { q45k::<false, 1>(w, [a])[0] },
            // SAFETY: AVX2, FMA and F16C were detected (`crate::simd::avx2()`).
            four: |w, a| unsafe { q45k::<false, 4>(w, a) },
        },
        KKind::Q5K => RowKernels {
            // SAFETY: AVX2, FMA and F16C were detected (`crate::simd::avx2()`).
            one: |w, a| unsafe { q45k::<true, 1>(w, [a])[0] },
            // SAFETY: AVX2, FMA and F16C were detected (`crate::simd::avx2()`).
            four: |w, a| unsafe { q45k::<true, 4>(w, a) },
        },
        KKind::Q6K => RowKernels {
            // SAFETY: AVX2, FMA and F16C were detected (`crate::simd::avx2()`).
            one: |w, a| unsafe { q6k::<1>(w, [a])[0] },
            // SAFETY: AVX2, FMA and F16C were detected (`crate::simd::avx2()`).
            four: |w, a| unsafe { q6k::<4>(w, a) },
        },
        // Not reached: row kernels take the file types candle reads, which IQ4_XS is not (its
        // matrices are tiled, or rewritten as IQ4_NL); the portable loop stands in.
        KKind::Iq4Xs => super::kquant::scalar_kernels(kind),
    }
}

#[inline]
#[target_feature(enable = "avx2")]
fn load(b: &[u8; 32]) -> __m256i {
    // SAFETY: `b` is 32 readable bytes; `loadu` takes any alignment.
    unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2")]
fn load_i8(b: &[i8; 32]) -> __m256i {
    // SAFETY: `b` is 32 readable bytes; `loadu` takes any alignment.
    unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
}

/// An activation block's sixteen sums of 16 quants, as i16 lanes.
#[inline]
#[target_feature(enable = "avx2")]
fn load_sums(s: &[i16; 16]) -> __m256i {
    // SAFETY: `s` is 32 readable bytes; `loadu` takes any alignment.
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

/// The quants of activation block `y` from element `32 i`.
#[inline]
#[target_feature(enable = "avx2")]
fn quants(y: &BlockQ8K, i: usize) -> __m256i {
    load_i8(y.qs[32 * i..32 * i + 32].try_into().expect("32 quants"))
}

/// The f16 in `b` (hardware conversion).
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn half(b: [u8; 2]) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(
        _mm_cvtsi32_si128(u16::from_le_bytes(b) as i32),
    ))
}

/// The sum of a vector's eight lanes.
#[inline]
#[target_feature(enable = "avx2")]
fn hsum(v: __m256) -> f32 {
    crate::simd::x86::hsum256(v)
}

/// One weight row of Q4_K (`Q5 = false`) or Q5_K blocks against `R` activation rows.
#[target_feature(enable = "avx2,fma,f16c")]
fn q45k<const Q5: bool, const R: usize>(w: &[u8], a: [&[BlockQ8K]; R]) -> [f32; R] {
    let bb = if Q5 { 176 } else { 144 };
    let nb = a[0].len();
    assert!(w.len() >= nb * bb && a.iter().all(|r| r.len() == nb));
    let m4 = _mm256_set1_epi8(0xF);
    let bit5 = _mm256_set1_epi8(0x10);
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        let blk = &w[b * bb..(b + 1) * bb];
        let d = half([blk[0], blk[1]]);
        let dmin = half([blk[2], blk[3]]);
        let mut sc = [0i16; 8];
        let mut mins = [0i16; 16];
        for j in 0..8 {
            let (s, m) = scale_min(j, &blk[4..16]);
            sc[j] = s as i16;
            // Each minimum applies to two sums of 16 activation quants.
            mins[2 * j] = m as i16;
            mins[2 * j + 1] = m as i16;
        }
        let mins = load_sums(&mins);
        let (qh, qs) = if Q5 {
            (
                load(blk[16..48].try_into().expect("32 bytes")),
                &blk[48..176],
            )
        } else {
            (_mm256_setzero_si256(), &blk[16..144])
        };
        let mut sumi = [_mm256_setzero_si256(); R];
        for j in 0..4 {
            let bits = load(qs[32 * j..32 * j + 32].try_into().expect("32 bytes"));
            let mut lo = _mm256_and_si256(bits, m4);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4);
            if Q5 {
                // Fifth bits: bit 2j of `qh` for the low sub-block, 2j + 1 for the high one.
                let ml = _mm256_set1_epi8(1 << (2 * j));
                let mh = _mm256_set1_epi8((2 << (2 * j)) as u8 as i8);
                let fl = _mm256_cmpeq_epi8(_mm256_and_si256(qh, ml), ml);
                let fh = _mm256_cmpeq_epi8(_mm256_and_si256(qh, mh), mh);
                lo = _mm256_or_si256(lo, _mm256_and_si256(fl, bit5));
                hi = _mm256_or_si256(hi, _mm256_and_si256(fh, bit5));
            }
            let sl = _mm256_set1_epi16(sc[2 * j]);
            let sh = _mm256_set1_epi16(sc[2 * j + 1]);
            for r in 0..R {
                let y = &a[r][b];
                let pl = _mm256_madd_epi16(sl, _mm256_maddubs_epi16(lo, quants(y, 2 * j)));
                let ph = _mm256_madd_epi16(sh, _mm256_maddubs_epi16(hi, quants(y, 2 * j + 1)));
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(pl, ph));
            }
        }
        for r in 0..R {
            let y = &a[r][b];
            // Σ m_j (sums of the sub-block's activation quants), as 8 lanes of i32.
            let msum = _mm256_madd_epi16(mins, load_sums(&y.bsums));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * y.d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
            acc[r] = _mm256_fmadd_ps(
                _mm256_set1_ps(-dmin * y.d),
                _mm256_cvtepi32_ps(msum),
                acc[r],
            );
        }
    }
    let mut out = [0f32; R];
    for (o, v) in out.iter_mut().zip(acc) {
        *o = hsum(v);
    }
    out
}

/// One weight row of Q6_K blocks against `R` activation rows.
#[target_feature(enable = "avx2,fma,f16c")]
fn q6k<const R: usize>(w: &[u8], a: [&[BlockQ8K]; R]) -> [f32; R] {
    const BB: usize = 210;
    let nb = a[0].len();
    assert!(w.len() >= nb * BB && a.iter().all(|r| r.len() == nb));
    let m4 = _mm256_set1_epi8(0xF);
    let m2 = _mm256_set1_epi8(3);
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        let blk = &w[b * BB..(b + 1) * BB];
        let d = half([blk[208], blk[209]]);
        let mut sc = [0i16; 16];
        for (s, v) in sc.iter_mut().zip(&blk[192..208]) {
            *s = *v as i8 as i16;
        }
        let scales = load_sums(&sc);
        let mut sumi = [_mm256_setzero_si256(); R];
        for n in 0..2 {
            let b1 = load(blk[64 * n..64 * n + 32].try_into().expect("32 bytes"));
            let b2 = load(blk[64 * n + 32..64 * n + 64].try_into().expect("32 bytes"));
            let h = load(
                blk[128 + 32 * n..160 + 32 * n]
                    .try_into()
                    .expect("32 bytes"),
            );
            let q = [
                _mm256_or_si256(
                    _mm256_and_si256(b1, m4),
                    _mm256_slli_epi16::<4>(_mm256_and_si256(h, m2)),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(b2, m4),
                    _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<2>(h), m2)),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(b1), m4),
                    _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<4>(h), m2)),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(b2), m4),
                    _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<6>(h), m2)),
                ),
            ];
            for (i, q) in q.iter().enumerate() {
                // Vector `i` of half `n` covers two groups of 16: scales 8n + 2i and + 1.
                let s = 8 * n + 2 * i;
                let s = _mm256_setr_m128i(_mm_set1_epi16(sc[s]), _mm_set1_epi16(sc[s + 1]));
                for r in 0..R {
                    let p = _mm256_maddubs_epi16(*q, quants(&a[r][b], 4 * n + i));
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(s, p));
                }
            }
        }
        for r in 0..R {
            let y = &a[r][b];
            // The quants were taken unsigned (q + 32): less 32 Σ sc_g (sum of group g).
            let off = _mm256_madd_epi16(scales, load_sums(&y.bsums));
            let s = _mm256_sub_epi32(sumi[r], _mm256_slli_epi32::<5>(off));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * y.d), _mm256_cvtepi32_ps(s), acc[r]);
        }
    }
    let mut out = [0f32; R];
    for (o, v) in out.iter_mut().zip(acc) {
        *o = hsum(v);
    }
    out
}

/// One weight row of Q2_K (`Q3 = false`) or Q3_K blocks against `R` activation rows.
#[target_feature(enable = "avx2,fma,f16c")]
fn q23k<const Q3: bool, const R: usize>(w: &[u8], a: [&[BlockQ8K]; R]) -> [f32; R] {
    let bb = if Q3 { 110 } else { 84 };
    let nb = a[0].len();
    assert!(w.len() >= nb * bb && a.iter().all(|r| r.len() == nb));
    let m3 = _mm256_set1_epi8(3);
    let four = _mm256_set1_epi8(4);
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        let blk = &w[b * bb..(b + 1) * bb];
        let mut sc = [0i16; 16];
        // `corr` lanes times each activation block's sums of 16 quants, scaled by `cfac`: Q2_K's
        // minimums, or Q3_K's offset (its quants are taken as `q + 4`, unsigned).
        let (d, cfac, corr, qs, hm);
        if Q3 {
            d = half([blk[108], blk[109]]);
            for (s, v) in sc.iter_mut().zip(scales_q3(&blk[96..108])) {
                *s = v as i16 - 32;
            }
            corr = load_sums(&sc);
            cfac = -4.0 * d;
            qs = &blk[32..96];
            hm = load(blk[0..32].try_into().expect("32 bytes"));
        } else {
            d = half([blk[80], blk[81]]);
            let mut mins = [0i16; 16];
            for (g, s) in blk[0..16].iter().enumerate() {
                sc[g] = (s & 0xF) as i16;
                mins[g] = (s >> 4) as i16;
            }
            corr = load_sums(&mins);
            cfac = -half([blk[82], blk[83]]);
            qs = &blk[16..80];
            hm = _mm256_setzero_si256();
        }
        let mut sumi = [_mm256_setzero_si256(); R];
        for n in 0..2 {
            let mut bits = load(qs[32 * n..32 * n + 32].try_into().expect("32 bytes"));
            for j in 0..4 {
                let mut q = _mm256_and_si256(bits, m3);
                if Q3 {
                    let bit = _mm256_set1_epi8((1u8 << (4 * n + j)) as i8);
                    let h = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
                    q = _mm256_or_si256(q, _mm256_and_si256(h, four));
                }
                bits = _mm256_srli_epi16::<2>(bits);
                let g = 8 * n + 2 * j;
                let s = _mm256_setr_m128i(_mm_set1_epi16(sc[g]), _mm_set1_epi16(sc[g + 1]));
                for r in 0..R {
                    let p = _mm256_maddubs_epi16(q, quants(&a[r][b], 4 * n + j));
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(s, p));
                }
            }
        }
        for r in 0..R {
            let y = &a[r][b];
            let c = _mm256_madd_epi16(corr, load_sums(&y.bsums));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * y.d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(cfac * y.d), _mm256_cvtepi32_ps(c), acc[r]);
        }
    }
    let mut out = [0f32; R];
    for (o, v) in out.iter_mut().zip(acc) {
        *o = hsum(v);
    }
    out
}
