//! The prefill product of a 16-bit float matrix on AVX-512: weight rows widened to f32 in
//! registers (`vcvtph2ps` for F16, a shift for BF16) as they are read, never into memory,
//! and multiplied with the activation rows by a register tile of four weight rows times up
//! to [`ROWS`] activation rows (24 accumulators of sixteen lanes each along `k`, reduced once
//! at the end): 24 multiply-adds per ten loads, so the loop runs at the multiply-add units'
//! rate. [`super::tiled_gemm`] shares the groups of 16 weight rows over the thread pool.

use std::arch::x86_64::*;

use super::HalfKind;

/// Activation rows per kernel call.
const ROWS: usize = 6;

/// Whether this CPU (and the kernel path) runs [`matmul`].
pub(super) fn available() -> bool {
    crate::simd::allows_avx512()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("f16c")
}

/// The group kernel for `kind` ([`super::GroupKernel`]) and the activation rows it takes.
/// Only where [`available`].
pub(super) fn kernel(kind: HalfKind) -> (super::GroupKernel, usize) {
    assert!(
        available(),
        "AVX-512 F16 kernels on a CPU without AVX-512F/BW/VL"
    );
    match kind {
        HalfKind::F16 => (group_rows::<false>, ROWS),
        HalfKind::BF16 => (group_rows::<true>, ROWS),
    }
}

/// Up to 16 weight rows (`lanes`, `k` each in `w`) against the activation rows `x` (at most
/// [`ROWS`]), four weight rows at a time (then one at a time for the rest).
///
/// # Safety
/// The CPU has AVX-512F/BW/VL and F16C; `out + i * stride + l` is writable for each activation
/// row `i` and `l < lanes`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
unsafe fn group_rows<const BF: bool>(
    w: &[u8],
    k: usize,
    x: &[f32],
    out: *mut f32,
    stride: usize,
    lanes: usize,
) {
    let r = x.len() / k;
    let mut l = 0;
    while l < lanes {
        let take = if lanes - l >= 4 { 4 } else { 1 };
        let wl = &w[2 * l * k..2 * (l + take) * k];
        macro_rules! by_rows {
            ($rm:literal) => {
                // SAFETY: the caller's contract, for lanes `l..l + take`.
                unsafe {
                    match r {
                        1 => tile::<BF, $rm, 1>(wl, k, x, out.add(l), stride),
                        2 => tile::<BF, $rm, 2>(wl, k, x, out.add(l), stride),
                        3 => tile::<BF, $rm, 3>(wl, k, x, out.add(l), stride),
                        4 => tile::<BF, $rm, 4>(wl, k, x, out.add(l), stride),
                        5 => tile::<BF, $rm, 5>(wl, k, x, out.add(l), stride),
                        _ => tile::<BF, $rm, 6>(wl, k, x, out.add(l), stride),
                    }
                }
            };
        }
        if take == 4 {
            by_rows!(4)
        } else {
            by_rows!(1)
        }
        l += take;
    }
}

/// Sixteen 16-bit floats (`BF`: BF16, else F16) as f32.
#[inline]
#[target_feature(enable = "avx512f,f16c")]
fn widen_half<const BF: bool>(h: __m256i) -> __m512 {
    if BF {
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    } else {
        _mm512_cvtph_ps(h)
    }
}

/// The last `valid` (< 16) 16-bit floats of a weight row from element `at`, the rest zero,
/// as f32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
fn widen16<const BF: bool>(w: &[u8], at: usize, valid: usize) -> __m512 {
    let bytes = &w[2 * at..2 * (at + valid)];
    // SAFETY: the masked load reads only the `valid` elements `bytes` holds.
    let h = unsafe { _mm256_maskz_loadu_epi16((1u16 << valid) - 1, bytes.as_ptr().cast()) };
    widen_half::<BF>(h)
}

/// The last `valid` (< 16) f32 of an activation row from `at`, the rest zero.
#[inline]
#[target_feature(enable = "avx512f")]
fn acts16(x: &[f32], at: usize, valid: usize) -> __m512 {
    let v = &x[at..at + valid];
    // SAFETY: the masked load reads only the `valid` values `v` holds.
    unsafe { _mm512_maskz_loadu_ps((1u16 << valid) - 1, v.as_ptr()) }
}

/// `RM` weight rows (`k` each in `w`) against `R` activation rows of `x`: output `(i, l)` to
/// `out + i * stride + l`.
///
/// # Safety
/// The CPU has AVX-512F/BW/VL and F16C; those outputs are writable.
// Row indices address the accumulators and the activation rows in step.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
unsafe fn tile<const BF: bool, const RM: usize, const R: usize>(
    w: &[u8],
    k: usize,
    x: &[f32],
    out: *mut f32,
    stride: usize,
) {
    assert!(w.len() >= 2 * RM * k && x.len() >= R * k);
    let mut acc = [[_mm512_setzero_ps(); R]; RM];
    let body = k / 16 * 16;
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    for c in (0..body).step_by(16) {
        // Raw loads: the slices' bounds checks cost a share of the multiply-adds' time.
        let wv: [__m512; RM] = std::array::from_fn(|j| {
            // SAFETY: bytes `2 (jk + c) .. + 32` lie in `w` (`c + 16 ≤ k`, `j < RM`, its
            // length asserted above); `loadu` takes any alignment.
            let h = unsafe { _mm256_loadu_si256(wp.add(2 * (j * k + c)).cast()) };
            widen_half::<BF>(h)
        });
        for i in 0..R {
            // SAFETY: values `ik + c .. + 16` lie in `x` (`c + 16 ≤ k`, `i < R`, asserted).
            let xv = unsafe { _mm512_loadu_ps(xp.add(i * k + c)) };
            for j in 0..RM {
                acc[j][i] = _mm512_fmadd_ps(wv[j], xv, acc[j][i]);
            }
        }
    }
    if body < k {
        let valid = k - body;
        let wv: [__m512; RM] = std::array::from_fn(|j| widen16::<BF>(w, j * k + body, valid));
        for i in 0..R {
            let xv = acts16(x, i * k + body, valid);
            for j in 0..RM {
                acc[j][i] = _mm512_fmadd_ps(wv[j], xv, acc[j][i]);
            }
        }
    }
    for (j, acc) in acc.iter().enumerate() {
        for (i, a) in acc.iter().enumerate() {
            // SAFETY: the caller's contract: output `(i, j)` is writable.
            unsafe { *out.add(i * stride + j) = _mm512_reduce_add_ps(*a) };
        }
    }
}

/// The decode kernel (one weight row against one activation row) for `kind` on AVX-512:
/// sixteen lanes and four independent sums, half the instructions of the AVX2 one per
/// weight. Only where [`available`].
pub(super) fn dot_one(kind: HalfKind) -> fn(&[u8], &[f32]) -> f32 {
    assert!(
        available(),
        "AVX-512 F16 kernels on a CPU without AVX-512F/BW/VL"
    );
    match kind {
        // SAFETY: AVX-512F/BW/VL and F16C were checked (asserted above).
        HalfKind::F16 => |w, x| unsafe { dot1::<false>(w, x) },
        // SAFETY: as above.
        HalfKind::BF16 => |w, x| unsafe { dot1::<true>(w, x) },
    }
}

/// One weight row (`k = x.len()` 16-bit floats in `w`) against one activation row.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
fn dot1<const BF: bool>(w: &[u8], x: &[f32]) -> f32 {
    let k = x.len();
    assert!(w.len() >= 2 * k);
    let mut acc = [_mm512_setzero_ps(); 4];
    let body = k / 64 * 64;
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    for c in (0..body).step_by(64) {
        // The two cache lines of weights `PREFETCH` bytes ahead (see `avx2::dot1`).
        let ahead = wp.wrapping_add(2 * c + super::PREFETCH);
        _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64).cast());
        for (u, acc) in acc.iter_mut().enumerate() {
            let at = c + 16 * u;
            // SAFETY: weights `at .. at + 16` (bytes `2 at .. + 32`) and values `at .. at + 16`
            // lie in `w` and `x` (`at + 16 ≤ body ≤ k`, lengths asserted); `loadu` takes any
            // alignment.
            let (h, xv) = unsafe {
                (
                    _mm256_loadu_si256(wp.add(2 * at).cast()),
                    _mm512_loadu_ps(xp.add(at)),
                )
            };
            *acc = _mm512_fmadd_ps(widen_half::<BF>(h), xv, *acc);
        }
    }
    let mut c = body;
    while c < k {
        let valid = (k - c).min(16);
        if valid == 16 {
            // SAFETY: as in the loop above, `c + 16 ≤ k`.
            let (h, xv) = unsafe {
                (
                    _mm256_loadu_si256(wp.add(2 * c).cast()),
                    _mm512_loadu_ps(xp.add(c)),
                )
            };
            acc[0] = _mm512_fmadd_ps(widen_half::<BF>(h), xv, acc[0]);
        } else {
            acc[0] = _mm512_fmadd_ps(widen16::<BF>(w, c, valid), acts16(x, c, valid), acc[0]);
        }
        c += 16;
    }
    let sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    _mm512_reduce_add_ps(sum)
}
