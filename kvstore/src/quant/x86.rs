//! AVX2 + F16C decoding of `q8`/`q4` planes into f16 (see [`crate::quant`] for the format):
//! 16 elements per step, codes widened to f32, `q × scale (+ min)` in one fused multiply-add,
//! rounded to f16 with the hardware conversion. Bit for bit what the portable decoder writes.

use crate::quant::Mode;

/// Decodes one plane into `dst` (`n × c` f16) if this CPU and shape allow; `false`: use the
/// portable decoder.
pub(crate) fn decode_f16(mode: Mode, body: &[u8], n: usize, c: usize, dst: &mut [u8]) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        if c.is_multiple_of(16)
            && dst.len() == n * c * 2
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            // SAFETY: the CPU has every feature the kernels are compiled for (checked above).
            unsafe { avx2::decode(mode, body, n, c, dst) };
            return true;
        }
    }
    let _ = (mode, body, n, c, dst);
    false
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use crate::quant::{q4_group, q8_group, Mode, KEY_TOKEN_GROUP};

    /// Lengths are the caller's: `dst` holds `n × c` f16 and `body` is the plane's whole body
    /// (checked against the format before decoding), `c` a multiple of 16. Scales and
    /// minimums are widened to f32 once per plane (or key group), not per step.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn decode(mode: Mode, body: &[u8], n: usize, c: usize, dst: &mut [u8]) {
        let mut sm = Vec::new();
        match mode {
            Mode::Q8Token => {
                let g = q8_group(c);
                let (scales, q) = body.split_at(n * (c / g) * 2);
                assert!(q.len() >= n * c && dst.len() >= n * c * 2);
                widen(scales, &mut sm);
                for (k, &sk) in sm.iter().enumerate() {
                    let s = _mm256_set1_ps(sk);
                    for i in (k * g..(k + 1) * g).step_by(16) {
                        // SAFETY: `i + 16 <= n × c <= q.len()` (g is a multiple of 16).
                        let b = unsafe { _mm_loadu_si128(q.as_ptr().add(i).cast()) };
                        let lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
                        let hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(b)));
                        store16(dst, i, _mm256_mul_ps(lo, s), _mm256_mul_ps(hi, s));
                    }
                }
            }
            Mode::Q4Channel | Mode::Q8Channel => {
                let wide = mode == Mode::Q8Channel;
                let mut at = 0;
                let mut row0 = 0;
                while row0 < n {
                    let t = KEY_TOKEN_GROUP.min(n - row0);
                    let len = if wide { t * c } else { t * c / 2 };
                    widen(&body[at..at + 4 * c], &mut sm);
                    let (s, m) = sm.split_at(c);
                    let codes = &body[at + 4 * c..at + 4 * c + len];
                    // Channel-outer: a channel block's scales and minimums stay in registers
                    // over the group's rows.
                    for j in (0..c).step_by(16) {
                        let (s0, s1) = (load8(s, j), load8(s, j + 8));
                        let (m0, m1) = (load8(m, j), load8(m, j + 8));
                        for r in 0..t {
                            let (q0, q1) = if wide {
                                bytes16(codes, r * c + j)
                            } else {
                                nibbles16(codes, (r * c + j) / 2)
                            };
                            let (y0, y1) =
                                (_mm256_fmadd_ps(q0, s0, m0), _mm256_fmadd_ps(q1, s1, m1));
                            store16(dst, (row0 + r) * c + j, y0, y1);
                        }
                    }
                    at += 4 * c + len;
                    row0 += t;
                }
            }
            Mode::Q4Token => {
                let g = q4_group(c);
                let groups = n * (c / g);
                let (head, codes) = body.split_at(groups * 4);
                widen(head, &mut sm);
                let (scales, mins) = sm.split_at(groups);
                for (k, (&sk, &mk)) in scales.iter().zip(mins).enumerate() {
                    let (s, m) = (_mm256_set1_ps(sk), _mm256_set1_ps(mk));
                    for i in (k * g..(k + 1) * g).step_by(16) {
                        let (q0, q1) = nibbles16(codes, i / 2);
                        store16(dst, i, _mm256_fmadd_ps(q0, s, m), _mm256_fmadd_ps(q1, s, m));
                    }
                }
            }
        }
    }

    /// Little-endian f16 bytes widened to f32 into `out` (replacing its contents).
    #[target_feature(enable = "avx2,fma,f16c")]
    fn widen(bytes: &[u8], out: &mut Vec<f32>) {
        let n = bytes.len() / 2;
        out.clear();
        out.resize(n, 0.0);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: elements `i..i + 8` are in bounds of both `bytes` and `out`.
            unsafe {
                let h = _mm_loadu_si128(bytes.as_ptr().add(2 * i).cast());
                _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            }
            i += 8;
        }
        for k in i..n {
            out[k] = half::f16::from_le_bytes([bytes[2 * k], bytes[2 * k + 1]]).to_f32();
        }
    }

    /// Eight f32 of `v` from `j`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn load8(v: &[f32], j: usize) -> __m256 {
        assert!(j + 8 <= v.len());
        // SAFETY: `j + 8 <= v.len()` (asserted).
        unsafe { _mm256_loadu_ps(v.as_ptr().add(j)) }
    }

    /// The 16 8-bit codes in `codes[at..at + 16]`, as two vectors of f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn bytes16(codes: &[u8], at: usize) -> (__m256, __m256) {
        assert!(at + 16 <= codes.len());
        // SAFETY: 16 bytes from `at` are in bounds (asserted).
        let b = unsafe { _mm_loadu_si128(codes.as_ptr().add(at).cast()) };
        (
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(b))),
        )
    }

    /// The 16 4-bit codes in `codes[at..at + 8]`, in element order, as two vectors of f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn nibbles16(codes: &[u8], at: usize) -> (__m256, __m256) {
        assert!(at + 8 <= codes.len());
        // SAFETY: 8 bytes from `at` are in bounds (asserted).
        let b = unsafe { _mm_loadl_epi64(codes.as_ptr().add(at).cast()) };
        let mask = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(b, mask);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(b), mask);
        let q = _mm_unpacklo_epi8(lo, hi);
        (
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(q))),
        )
    }

    /// Rounds 16 values to f16 and stores them as elements `i..i + 16` of `dst`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn store16(dst: &mut [u8], i: usize, lo: __m256, hi: __m256) {
        assert!(2 * (i + 16) <= dst.len());
        let (a, b) = (
            _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(lo),
            _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(hi),
        );
        // SAFETY: bytes `2i..2i + 32` are in bounds (asserted).
        unsafe {
            _mm_storeu_si128(dst.as_mut_ptr().add(2 * i).cast(), a);
            _mm_storeu_si128(dst.as_mut_ptr().add(2 * i + 16).cast(), b);
        }
    }
}
