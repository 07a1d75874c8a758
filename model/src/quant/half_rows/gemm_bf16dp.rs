//! The prefill product of a BF16 matrix on CPUs with AVX-512 BF16 (Zen 4 and later, Sapphire
//! Rapids and later): the activation rows are rounded to BF16 once per product (round to
//! nearest even, on the thread pool), then `vdpbf16ps` multiplies 32 weights by 32
//! activations per instruction, pairs summed into sixteen f32 lanes: twice the products per
//! instruction of widening the weights to f32 ([`super::gemm512`]), and half the activation
//! bytes read. Register tile: four weight rows times six activation rows (24 accumulators,
//! reduced once at the end), as in `gemm512`.
//!
//! Numerics: each product is of two BF16 values (exact in f32) and the sums are f32, so the
//! only change from the f32-activation kernels is the activations' rounding to BF16 (eight
//! significant bits, a relative error below 2^-8 per value): what llama.cpp's BF16 kernels
//! compute. Stored KV computed this way has its own namespace (`+bf16-activations` in the
//! weights hash, [`crate::Model`]). Decode (one activation row) keeps f32 activations.

use std::arch::x86_64::*;

/// Activation rows per kernel call.
const ROWS: usize = 6;

/// Whether this CPU (and the kernel path) runs [`matmul`].
pub(crate) fn available() -> bool {
    super::gemm512::available() && is_x86_feature_detected!("avx512bf16")
}

/// `x @ w.T` for a BF16 matrix `w` of `n` rows of `k` and `m` f32 activation rows of `k` in
/// `x`, the activations rounded to BF16 first. Only where [`available`].
pub(super) fn matmul(w: &[u8], n: usize, k: usize, x: &[f32]) -> Vec<f32> {
    assert!(
        available(),
        "AVX-512 BF16 kernels on a CPU without AVX-512F/BW/VL/BF16"
    );
    assert_eq!(w.len(), 2 * n * k, "({n}, {k}) BF16 matrix bytes");
    let m = x.len() / k;
    let xb = super::super::quantize_rows(x, k, k, 0u16, |row| {
        // SAFETY: AVX-512F/BW/VL and BF16 were checked (asserted above).
        unsafe { round_row(row) }
    });
    super::super::tiled_matmul(&[n], m, 2 * k, ROWS, |p| {
        let act = &xb[p.rows.start * k..p.rows.end * k];
        let group = &w[2 * 16 * p.g * k..2 * (16 * p.g + p.lanes) * k];
        // SAFETY: the features were checked (above); the pass's outputs, lanes `0..p.lanes`
        // of rows `0..p.rows.len()` at `p.out` with `p.stride`, are this call's to write
        // (`tiled_matmul`), and `group` holds `p.lanes` rows.
        unsafe { group_rows(group, k, act, p.out, p.stride, p.lanes) }
    })
    .remove(0)
}

/// One activation row rounded to BF16 (nearest even), sixteen values per instruction.
///
/// # Safety
/// The CPU has AVX-512F/BW/VL and BF16.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn round_row(x: &[f32]) -> Vec<u16> {
    let k = x.len();
    let mut out = vec![0u16; k];
    let mut c = 0;
    while c < k {
        let valid = (k - c).min(16);
        let mask = ((1u32 << valid) - 1) as u16;
        // SAFETY: the masked load reads only values `c .. c + valid` of `x`.
        let v = unsafe { _mm512_maskz_loadu_ps(mask, x.as_ptr().add(c)) };
        let h: __m256i = bits256(_mm512_cvtneps_pbh(v));
        // SAFETY: the masked store writes only elements `c .. c + valid` of `out`.
        unsafe { _mm256_mask_storeu_epi16(out.as_mut_ptr().add(c).cast(), mask, h) };
        c += 16;
    }
    out
}

/// The bits of sixteen BF16 values as an integer vector.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
fn bits256(v: __m256bh) -> __m256i {
    // SAFETY: both are 256-bit vectors of plain bits; every bit pattern is valid in either.
    unsafe { std::mem::transmute::<__m256bh, __m256i>(v) }
}

/// Thirty-two BF16 values (`valid` of them, the rest zero) from `p`.
///
/// # Safety
/// `p .. p + valid` (elements) is readable; the CPU has AVX-512F/BW/BF16.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn load32(p: *const u16, valid: usize) -> __m512bh {
    let v = if valid >= 32 {
        // SAFETY: the caller's contract; `loadu` takes any alignment.
        unsafe { _mm512_loadu_si512(p.cast()) }
    } else {
        // SAFETY: the masked load reads only the `valid` elements the caller vouches for.
        unsafe { _mm512_maskz_loadu_epi16((1u32 << valid) - 1, p.cast()) }
    };
    // SAFETY: both are 512-bit vectors of plain bits; every bit pattern is valid in either.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
}

/// Up to 16 weight rows (`lanes`, `k` each in `w`) against the BF16 activation rows `x` (at
/// most [`ROWS`]), four weight rows at a time (then one at a time for the rest).
///
/// # Safety
/// The CPU has AVX-512F/BW/VL and BF16; `out + i * stride + l` is writable for each activation
/// row `i` and `l < lanes`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn group_rows(w: &[u8], k: usize, x: &[u16], out: *mut f32, stride: usize, lanes: usize) {
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
                        1 => tile::<$rm, 1>(wl, k, x, out.add(l), stride),
                        2 => tile::<$rm, 2>(wl, k, x, out.add(l), stride),
                        3 => tile::<$rm, 3>(wl, k, x, out.add(l), stride),
                        4 => tile::<$rm, 4>(wl, k, x, out.add(l), stride),
                        5 => tile::<$rm, 5>(wl, k, x, out.add(l), stride),
                        _ => tile::<$rm, 6>(wl, k, x, out.add(l), stride),
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

/// `RM` weight rows (`k` each in `w`) against `R` BF16 activation rows of `x`: output `(i, l)`
/// to `out + i * stride + l`.
///
/// # Safety
/// The CPU has AVX-512F/BW/VL and BF16; those outputs are writable.
// Row indices address the accumulators and the activation rows in step.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn tile<const RM: usize, const R: usize>(
    w: &[u8],
    k: usize,
    x: &[u16],
    out: *mut f32,
    stride: usize,
) {
    assert!(w.len() >= 2 * RM * k && x.len() >= R * k);
    let mut acc = [[_mm512_setzero_ps(); R]; RM];
    let (wp, xp) = (w.as_ptr().cast::<u16>(), x.as_ptr());
    // Thirty-two elements of every row from `c` (`valid` of them, the rest zero) into the
    // accumulators.
    macro_rules! step {
        ($c:expr, $valid:expr) => {
            let wv: [__m512bh; RM] = std::array::from_fn(|j| {
                // SAFETY: elements `jk + c .. + valid` lie in `w` (`c + valid ≤ k`, `j < RM`,
                // its length asserted above, two bytes each).
                unsafe { load32(wp.add(j * k + $c), $valid) }
            });
            for i in 0..R {
                // SAFETY: elements `ik + c .. + valid` lie in `x` (`i < R`, asserted above).
                let xv = unsafe { load32(xp.add(i * k + $c), $valid) };
                for j in 0..RM {
                    acc[j][i] = _mm512_dpbf16_ps(acc[j][i], wv[j], xv);
                }
            }
        };
    }
    let body = k / 32 * 32;
    for c in (0..body).step_by(32) {
        step!(c, 32);
    }
    if body < k {
        step!(body, k - body);
    }
    for (j, acc) in acc.iter().enumerate() {
        for (i, a) in acc.iter().enumerate() {
            // SAFETY: the caller's contract: output `(i, j)` is writable.
            unsafe { *out.add(i * stride + j) = _mm512_reduce_add_ps(*a) };
        }
    }
}

/// `v` rounded to BF16 as [`matmul`] rounds activations (nearest even), back in f32: for tests.
#[cfg(test)]
pub(super) fn rounded(v: f32) -> f32 {
    half::bf16::from_f32(v).to_f32()
}
