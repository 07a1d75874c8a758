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

/// Sixteen 16-bit floats of `w` from element `at` (the first `valid`, the rest zero) as f32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
fn widen16<const BF: bool>(w: &[u8], at: usize, valid: usize) -> __m512i {
    let h = if valid >= 16 {
        let bytes: &[u8; 32] = w[2 * at..2 * at + 32].try_into().expect("32 bytes");
        // SAFETY: `bytes` is 32 readable bytes; `loadu` takes any alignment.
        unsafe { _mm256_loadu_si256(bytes.as_ptr().cast()) }
    } else {
        let bytes = &w[2 * at..2 * (at + valid)];
        // SAFETY: the masked load reads only the `valid` elements `bytes` holds.
        unsafe { _mm256_maskz_loadu_epi16((1u16 << valid) - 1, bytes.as_ptr().cast()) }
    };
    if BF {
        _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h))
    } else {
        _mm512_castps_si512(_mm512_cvtph_ps(h))
    }
}

/// Sixteen f32 of `x` from `at` (the first `valid`, the rest zero).
#[inline]
#[target_feature(enable = "avx512f")]
fn acts16(x: &[f32], at: usize, valid: usize) -> __m512 {
    if valid >= 16 {
        let v: &[f32; 16] = x[at..at + 16].try_into().expect("16 values");
        // SAFETY: `v` is 16 readable f32; `loadu` takes any alignment.
        unsafe { _mm512_loadu_ps(v.as_ptr()) }
    } else {
        let v = &x[at..at + valid];
        // SAFETY: the masked load reads only the `valid` values `v` holds.
        unsafe { _mm512_maskz_loadu_ps((1u16 << valid) - 1, v.as_ptr()) }
    }
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
    let mut c = 0;
    while c < k {
        let valid = (k - c).min(16);
        let wv: [__m512; RM] =
            std::array::from_fn(|j| _mm512_castsi512_ps(widen16::<BF>(w, j * k + c, valid)));
        for i in 0..R {
            let xv = acts16(x, i * k + c, valid);
            for j in 0..RM {
                acc[j][i] = _mm512_fmadd_ps(wv[j], xv, acc[j][i]);
            }
        }
        c += 16;
    }
    for (j, acc) in acc.iter().enumerate() {
        for (i, a) in acc.iter().enumerate() {
            // SAFETY: the caller's contract: output `(i, j)` is writable.
            unsafe { *out.add(i * stride + j) = _mm512_reduce_add_ps(*a) };
        }
    }
}
