//! Small SIMD helpers the kernels share ([`crate::quant`], [`crate::attention`]).

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    /// The sum of a vector's eight lanes.
    ///
    /// # Safety
    /// The CPU has AVX (every caller's AVX2 kernels imply it).
    #[inline]
    #[target_feature(enable = "avx")]
    pub(crate) unsafe fn hsum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }
}
