//! AVX2 + FMA + F16C kernels (llama.cpp's `ggml_vec_dot_*` for these block types). Every
//! function here needs those features: the callers check [`crate::simd::avx2`] first.
//!
//! These stay `unsafe fn`s with one block per body, unlike the other kernels: written as safe
//! `#[target_feature]` functions over bounds-checked slices they ran SmolLM2's AVX2 decode
//! 45 % slower in the dev profile (its tied Q8_0 output matrix goes through [`dot4`]).
// Intrinsics without pointer arguments are safe to call from newer compilers on.
#![allow(unused_unsafe)]
use std::arch::x86_64::*;

use super::{u32_at, BlockQ8, Kernels, Kind};
use crate::simd::x86::hsum256 as hsum;

/// The f16 at `at` (hardware conversion).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn half(b: &[u8], at: usize) -> f32 {
    let h = u16::from_le_bytes([b[at], b[at + 1]]);
    // SAFETY: register intrinsics only; the caller's contract provides the features.
    unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32))) }
}

pub(super) fn kernels(kind: Kind) -> Kernels {
    macro_rules! k {
        ($k:literal) => {
            Kernels {
                // SAFETY: the caller checked `crate::simd::avx2()` (AVX2, FMA, F16C).
                one: |w, a| unsafe { dot::<$k>(w, a) },
                // SAFETY: as above.
                four: |w, a| unsafe { dot4::<$k>(w, a) },
            }
        };
    }
    match kind {
        Kind::Q4_0 => k!(0),
        Kind::Q4_1 => k!(1),
        Kind::Q5_0 => k!(2),
        Kind::Q5_1 => k!(3),
        Kind::Q8_0 => k!(4),
        // Only ever repacked (`packed_avx2`); the file-order path keeps the reference.
        Kind::Iq4Nl => super::scalar_kernels(kind),
    }
}

/// A weight block as bytes ready for `maddubs`: unsigned quants (Q4_1, Q5_1) or the
/// absolute values of signed ones, the signs to move onto the activations (`None` for
/// unsigned), the scale `d` and the offset `m`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode<const K: u8>(blk: &[u8]) -> (__m256i, Option<__m256i>, f32, f32) {
    // SAFETY: the caller's contract (the features; `blk` is one whole block of kind `K`, so
    // every offset read below is inside it).
    unsafe {
        let p = blk.as_ptr();
        let d = half(blk, 0);
        match K {
            0 => {
                let x = _mm256_sub_epi8(nibbles(p.add(2)), _mm256_set1_epi8(8));
                (_mm256_sign_epi8(x, x), Some(x), d, 0.0)
            }
            1 => (nibbles(p.add(4)), None, d, half(blk, 2)),
            2 => {
                let hi = _mm256_andnot_si256(
                    bytes_from_bits(u32_at(blk, 2)),
                    _mm256_set1_epi8(0xF0u8 as i8),
                );
                let x = _mm256_or_si256(nibbles(p.add(6)), hi);
                (_mm256_sign_epi8(x, x), Some(x), d, 0.0)
            }
            3 => {
                let hi = _mm256_and_si256(bytes_from_bits(u32_at(blk, 4)), _mm256_set1_epi8(0x10));
                (
                    _mm256_or_si256(nibbles(p.add(8)), hi),
                    None,
                    d,
                    half(blk, 2),
                )
            }
            _ => {
                let x = _mm256_loadu_si256(p.add(2) as *const __m256i);
                (_mm256_sign_epi8(x, x), Some(x), d, 0.0)
            }
        }
    }
}

/// [`dot`] against four activation rows, each weight block decoded once. Written out per
/// row (no arrays, no bounds checks in the loop) so the accumulators stay in registers.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot4<const K: u8>(w: &[u8], a: [&[BlockQ8]; 4]) -> [f32; 4] {
    // SAFETY: the caller's contract (the features); every block read is inside `w` and the
    // rows (lengths asserted below).
    unsafe {
        let bb = [18, 20, 22, 24, 34][K as usize];
        let nb = a[0].len();
        assert!(w.len() >= nb * bb && a.iter().all(|r| r.len() == nb));
        let (a0, a1, a2, a3) = (a[0].as_ptr(), a[1].as_ptr(), a[2].as_ptr(), a[3].as_ptr());
        let (mut c0, mut c1, mut c2, mut c3) = (
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
        );
        let (mut o0, mut o1, mut o2, mut o3) = (0f32, 0f32, 0f32, 0f32);
        for b in 0..nb {
            // SAFETY: `b < nb` and the lengths were checked above.
            let blk = std::slice::from_raw_parts(w.as_ptr().add(b * bb), bb);
            let (x, sign, d, m) = decode::<K>(blk);
            macro_rules! row {
                ($ptr:expr, $acc:ident, $off:ident) => {{
                    let y = &*$ptr.add(b);
                    let qy = _mm256_loadu_si256(y.qs.as_ptr() as *const __m256i);
                    let qy = match sign {
                        Some(s) => _mm256_sign_epi8(qy, s),
                        None => qy,
                    };
                    $acc = _mm256_fmadd_ps(_mm256_set1_ps(d * y.d), mul_sum_us8(x, qy), $acc);
                    if K == 1 || K == 3 {
                        $off += m * y.s;
                    }
                }};
            }
            row!(a0, c0, o0);
            row!(a1, c1, o1);
            row!(a2, c2, o2);
            row!(a3, c3, o3);
        }
        [hsum(c0) + o0, hsum(c1) + o1, hsum(c2) + o2, hsum(c3) + o3]
    }
}

/// The 32 nibbles of 16 bytes: low nibbles in bytes 0..16, high ones in 16..32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles(p: *const u8) -> __m256i {
    // SAFETY: the caller's contract: 16 readable bytes at `p`, and the features.
    unsafe {
        let tmp = _mm_loadu_si128(p as *const __m128i);
        let both = _mm256_insertf128_si256(_mm256_castsi128_si256(tmp), _mm_srli_epi16(tmp, 4), 1);
        _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
    }
}

/// Byte `i` is 0xFF where bit `i` of `x` is set.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bytes_from_bits(x: u32) -> __m256i {
    // SAFETY: register intrinsics only; the caller's contract provides the features.
    unsafe {
        let shuf = _mm256_set_epi64x(
            0x0303030303030303,
            0x0202020202020202,
            0x0101010101010101,
            0x0000000000000000,
        );
        let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x as i32), shuf);
        let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
        _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1))
    }
}

/// Sums of products of unsigned `x` and signed `y` bytes, as 8 f32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn mul_sum_us8(x: __m256i, y: __m256i) -> __m256 {
    // SAFETY: register intrinsics only; the caller's contract provides the features.
    unsafe {
        let pairs = _mm256_maddubs_epi16(x, y);
        _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_set1_epi16(1), pairs))
    }
}

/// One weight row against one activation row. `K`: 0 Q4_0, 1 Q4_1, 2 Q5_0, 3 Q5_1,
/// 4 Q8_0 (a constant, so each kind compiles to its own loop).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot<const K: u8>(w: &[u8], a: &[BlockQ8]) -> f32 {
    // SAFETY: the caller's contract (the features); `chunks_exact` hands `decode` whole
    // blocks, and each activation block is 32 readable quants.
    unsafe {
        let bb = [18, 20, 22, 24, 34][K as usize];
        let mut acc = _mm256_setzero_ps();
        let mut offsets = 0f32;
        for (blk, y) in w.chunks_exact(bb).zip(a) {
            let (x, sign, d, m) = decode::<K>(blk);
            let qy = _mm256_loadu_si256(y.qs.as_ptr() as *const __m256i);
            let qy = match sign {
                Some(s) => _mm256_sign_epi8(qy, s),
                None => qy,
            };
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d * y.d), mul_sum_us8(x, qy), acc);
            offsets += m * y.s;
        }
        hsum(acc) + offsets
    }
}
