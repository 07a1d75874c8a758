//! A repacked tile's decoding ([`super`]'s layout table) into the eight byte vectors both
//! the VNNI kernel (`avx512`) and the AMX kernel (`amx`) multiply.

use std::arch::x86_64::*;

/// A tile's eight quant vectors (unsigned bytes, four elements per row lane), its rows'
/// scales `d` and offsets `m'` (see [`super`]).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
pub(super) unsafe fn packed_decode<const K: u8>(t: *const u8) -> ([__m512i; 8], __m512, __m512) {
    // SAFETY: the caller's contract: `t` points at a whole tile of kind `K` (every offset
    // read below is inside one).
    unsafe {
        let half16 = |at: usize| _mm512_cvtph_ps(_mm256_loadu_si256(t.add(at) as *const __m256i));
        let d = half16(0);
        let m = match K {
            0 => _mm512_mul_ps(d, _mm512_set1_ps(-8.0)),
            2 => _mm512_mul_ps(d, _mm512_set1_ps(-16.0)),
            4 | 5 => _mm512_mul_ps(d, _mm512_set1_ps(-128.0)),
            _ => half16(32),
        };
        let load = |at: usize| _mm512_loadu_si512(t.add(at) as *const _);
        if K == 4 {
            return (std::array::from_fn(|i| load(32 + 64 * i)), d, m);
        }
        let planes = [32, 64, 96, 128, 0, 32][K as usize];
        let lo = _mm512_set1_epi8(0x0F);
        let mut v = [_mm512_setzero_si512(); 8];
        for j in 0..4 {
            let p = load(planes + 64 * j);
            v[j] = _mm512_and_si512(p, lo);
            v[j + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(p), lo);
        }
        if K == 5 {
            // Each 4-bit index becomes its level + 128 (unsigned, 1..=241): one byte shuffle
            // per vector through the table in every 128-bit lane; `m' = -128 d` takes the
            // offset back out.
            let table = _mm512_broadcast_i32x4(_mm_loadu_si128(
                super::super::iq4::LEVELS_U8.as_ptr().cast(),
            ));
            for v in v.iter_mut() {
                *v = _mm512_shuffle_epi8(table, *v);
            }
        }
        if K == 2 || K == 3 {
            let h = load(if K == 2 { 32 } else { 64 });
            let bit = _mm512_set1_epi8(0x10);
            // Bit i of each qh byte is vector i's fifth bit: moved to bit 4, OR-ed in.
            let at4 = [
                _mm512_slli_epi16::<4>(h),
                _mm512_slli_epi16::<3>(h),
                _mm512_slli_epi16::<2>(h),
                _mm512_slli_epi16::<1>(h),
                h,
                _mm512_srli_epi16::<1>(h),
                _mm512_srli_epi16::<2>(h),
                _mm512_srli_epi16::<3>(h),
            ];
            for (v, s) in v.iter_mut().zip(at4) {
                *v = _mm512_ternarylogic_epi32::<0xF8>(*v, s, bit);
            }
        }
        (v, d, m)
    }
}
