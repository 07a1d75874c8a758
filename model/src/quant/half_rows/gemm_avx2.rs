//! [`super::gemm512`]'s register-tile GEMM on AVX2 + FMA + F16C (CPUs without AVX-512): eight
//! lanes, two weight rows times six activation rows (twelve accumulators, fifteen registers
//! in all: twelve multiply-adds per two widened weight loads and six activation loads, enough
//! independent sums to keep both FMA units busy through their latency; two times four ran
//! 10 % slower), the remainder of `k` past a multiple of eight added in scalar code.

use std::arch::x86_64::*;

use super::{avx2::widen8, widen, HalfKind};

/// Activation rows per kernel call.
const ROWS: usize = 6;

/// The group kernel for `kind` ([`super::GroupKernel`]) and the activation rows it takes.
pub(super) fn kernel(kind: HalfKind) -> (super::GroupKernel, usize) {
    assert!(
        crate::simd::avx2(),
        "AVX2 F16 kernels on a CPU without AVX2/FMA/F16C"
    );
    match kind {
        HalfKind::F16 => (group_rows::<false>, ROWS),
        HalfKind::BF16 => (group_rows::<true>, ROWS),
    }
}

/// Up to 16 weight rows (`lanes`, `k` each in `w`) against the activation rows `x` (at most
/// [`ROWS`]), two weight rows at a time (then one).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `out + i * stride + l` is writable for each activation
/// row `i` and `l < lanes`.
#[target_feature(enable = "avx2,fma,f16c")]
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
        let take = if lanes - l >= 2 { 2 } else { 1 };
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
        match take {
            2 => by_rows!(2),
            _ => by_rows!(1),
        }
        l += take;
    }
}

/// `RM` weight rows (`k` each in `w`) against `R` activation rows of `x`: output `(i, l)` to
/// `out + i * stride + l`.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; those outputs are writable.
// Row indices address the accumulators and the activation rows in step.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const BF: bool, const RM: usize, const R: usize>(
    w: &[u8],
    k: usize,
    x: &[f32],
    out: *mut f32,
    stride: usize,
) {
    assert!(w.len() >= 2 * RM * k && x.len() >= R * k);
    let mut acc = [[_mm256_setzero_ps(); R]; RM];
    let body = k / 8 * 8;
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    for c in (0..body).step_by(8) {
        // Raw loads: the slices' bounds checks cost more than the multiply-adds here (eight
        // lanes each).
        let wv: [__m256; RM] = std::array::from_fn(|j| {
            // SAFETY: bytes `2 (jk + c) .. + 16` lie in `w` (`c + 8 ≤ k`, `j < RM`, its
            // length asserted above); `loadu` takes any alignment.
            let h = unsafe { _mm_loadu_si128(wp.add(2 * (j * k + c)).cast()) };
            widen8::<BF>(h)
        });
        for i in 0..R {
            // SAFETY: values `ik + c .. + 8` lie in `x` (`c + 8 ≤ k`, `i < R`, asserted above).
            let xv = unsafe { _mm256_loadu_ps(xp.add(i * k + c)) };
            for j in 0..RM {
                acc[j][i] = _mm256_fmadd_ps(wv[j], xv, acc[j][i]);
            }
        }
    }
    let kind = if BF { HalfKind::BF16 } else { HalfKind::F16 };
    for j in 0..RM {
        for i in 0..R {
            let mut sum = crate::simd::x86::hsum256(acc[j][i]);
            for c in body..k {
                sum += widen(kind, &w[2 * (j * k + c)..2 * (j * k + c) + 2]) * x[i * k + c];
            }
            // SAFETY: the caller's contract: output `(i, j)` is writable.
            unsafe { *out.add(i * stride + j) = sum };
        }
    }
}
