//! Turning f16 rows in one pass: each element widened, turned in f32 and rounded back once,
//! exactly as widening the whole tensor, [`super::Rope::turn_rows`] and narrowing it again
//! would (the same products and sums, round to nearest even), without the two whole-tensor
//! conversions and copies. This is the loader's repositioning of stored f16 keys. Its x86
//! kernels stay `unsafe fn`s over raw pointers (a safe slice-based version was measurably
//! slower in the dev profile, as the AVX2 attention loops were).

use half::f16;

use crate::config::RopeStyle;

/// Writes `x`'s rows (`2 * cos.len()` elements each) turned by the angles whose cosines and
/// sines are given into `out` (as long as `x`).
pub(super) fn turn(style: RopeStyle, x: &[f16], out: &mut [f16], cos: &[f32], sin: &[f32]) {
    debug_assert_eq!(x.len(), out.len());
    #[cfg(target_arch = "x86_64")]
    if cos.len().is_multiple_of(8)
        && crate::simd::allows_avx2()
        && is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("f16c")
    {
        // SAFETY: AVX2 and F16C were just detected.
        unsafe {
            match style {
                RopeStyle::Half => x86::half(x, out, cos, sin),
                RopeStyle::Interleaved => x86::interleaved(x, out, cos, sin),
            }
        }
        return;
    }
    portable(style, x, out, cos, sin);
}

/// [`turn`] element by element.
fn portable(style: RopeStyle, x: &[f16], out: &mut [f16], cos: &[f32], sin: &[f32]) {
    let h = cos.len();
    for (row, o) in x.chunks_exact(2 * h).zip(out.chunks_exact_mut(2 * h)) {
        for i in 0..h {
            let (a, b) = match style {
                RopeStyle::Half => (i, h + i),
                RopeStyle::Interleaved => (2 * i, 2 * i + 1),
            };
            let (x1, x2) = (row[a].to_f32(), row[b].to_f32());
            o[a] = f16::from_f32(x1 * cos[i] - x2 * sin[i]);
            o[b] = f16::from_f32(x1 * sin[i] + x2 * cos[i]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use half::f16;

    /// Eight f16 at `p`, widened.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load8(p: *const f16) -> __m256 {
        // SAFETY: the caller's contract: eight f16 readable at `p`, and the features.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }

    /// Eight f32 rounded to f16 (nearest, ties to even) at `p`.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn store8(p: *mut f16, v: __m256) {
        // SAFETY: the caller's contract: eight f16 writable at `p`, and the features.
        unsafe {
            _mm_storeu_si128(
                p as *mut __m128i,
                _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v),
            )
        }
    }

    /// [`super::turn`] for [`crate::RopeStyle::Half`] (element `i` pairs with `h + i`);
    /// `cos.len()` a multiple of 8.
    ///
    /// # Safety
    /// The CPU has AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn half(x: &[f16], out: &mut [f16], cos: &[f32], sin: &[f32]) {
        let h = cos.len();
        for (row, o) in x.chunks_exact(2 * h).zip(out.chunks_exact_mut(2 * h)) {
            for i in (0..h).step_by(8) {
                // SAFETY: `i + 8 <= h`, rows are `2h` long, tables `h`.
                unsafe {
                    let x1 = load8(row.as_ptr().add(i));
                    let x2 = load8(row.as_ptr().add(h + i));
                    let c = _mm256_loadu_ps(cos.as_ptr().add(i));
                    let s = _mm256_loadu_ps(sin.as_ptr().add(i));
                    let a = _mm256_sub_ps(_mm256_mul_ps(x1, c), _mm256_mul_ps(x2, s));
                    let b = _mm256_add_ps(_mm256_mul_ps(x1, s), _mm256_mul_ps(x2, c));
                    store8(o.as_mut_ptr().add(i), a);
                    store8(o.as_mut_ptr().add(h + i), b);
                }
            }
        }
    }

    /// [`super::turn`] for [`crate::RopeStyle::Interleaved`] (elements `2i` and `2i + 1`
    /// pair): each lane times its pair's cosine, plus its neighbour's value times the sine
    /// with the sign the lane needs (`x1 c + x2 (-s)`, `x2 c + x1 s`: the portable arithmetic,
    /// operands in another order). `cos.len()` a multiple of 8.
    ///
    /// # Safety
    /// The CPU has AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn interleaved(x: &[f16], out: &mut [f16], cos: &[f32], sin: &[f32]) {
        let d = 2 * cos.len();
        let cc: Vec<f32> = (0..d).map(|j| cos[j / 2]).collect();
        let ss: Vec<f32> = (0..d)
            .map(|j| if j % 2 == 0 { -sin[j / 2] } else { sin[j / 2] })
            .collect();
        for (row, o) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
            for j in (0..d).step_by(8) {
                // SAFETY: `j + 8 <= d`, rows and tables are `d` long.
                unsafe {
                    let v = load8(row.as_ptr().add(j));
                    // Each pair's two lanes swapped.
                    let w = _mm256_permute_ps::<0b10_11_00_01>(v);
                    let c = _mm256_loadu_ps(cc.as_ptr().add(j));
                    let s = _mm256_loadu_ps(ss.as_ptr().add(j));
                    let t = _mm256_add_ps(_mm256_mul_ps(v, c), _mm256_mul_ps(w, s));
                    store8(o.as_mut_ptr().add(j), t);
                }
            }
        }
    }
}
