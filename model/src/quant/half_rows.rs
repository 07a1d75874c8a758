//! Matrix products over 16-bit float matrices (GGUF F16 and BF16 tensors) with f32
//! activations, on the CPU, without widening the matrix: each weight row is widened in
//! registers as it is read, so memory stays the file's (half of f32) and a decode step reads
//! two bytes per weight. Activations stay f32 (no quantization: the products are f32 sums).
//!
//! | type | bytes per element | value |
//! |---|---:|---|
//! | F16 | 2 | IEEE binary16 |
//! | BF16 | 2 | the high 16 bits of an f32 |

use candle_core::quantized::GgmlDType;
use half::{bf16, f16};

use super::RowKernels;

/// A 16-bit float matrix type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HalfKind {
    F16,
    BF16,
}

impl HalfKind {
    pub(crate) fn of(dtype: GgmlDType) -> Option<HalfKind> {
        match dtype {
            GgmlDType::F16 => Some(HalfKind::F16),
            GgmlDType::BF16 => Some(HalfKind::BF16),
            _ => None,
        }
    }
}

fn widen(kind: HalfKind, b: &[u8]) -> f32 {
    let bytes = [b[0], b[1]];
    match kind {
        HalfKind::F16 => f16::from_le_bytes(bytes).to_f32(),
        HalfKind::BF16 => bf16::from_le_bytes(bytes).to_f32(),
    }
}

/// Portable reference.
fn dot_scalar(kind: HalfKind, w: &[u8], x: &[f32]) -> f32 {
    w.chunks_exact(2)
        .zip(x)
        .map(|(b, x)| widen(kind, b) * x)
        .sum()
}

fn scalar_kernels(kind: HalfKind) -> RowKernels<f32> {
    match kind {
        HalfKind::F16 => RowKernels {
            one: |w, x| dot_scalar(HalfKind::F16, w, x),
            four: |w, x| x.map(|x| dot_scalar(HalfKind::F16, w, x)),
        },
        HalfKind::BF16 => RowKernels {
            one: |w, x| dot_scalar(HalfKind::BF16, w, x),
            four: |w, x| x.map(|x| dot_scalar(HalfKind::BF16, w, x)),
        },
    }
}

fn kernels(kind: HalfKind) -> RowKernels<f32> {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::avx2() {
        let mut kernels = avx2::kernels(kind);
        if gemm512::available() {
            kernels.one = gemm512::dot_one(kind);
        }
        return kernels;
    }
    scalar_kernels(kind)
}

/// Activation rows from which a product takes a GEMM (prefill) instead of the row kernels
/// (decode): for BF16 on CPUs with AVX-512 BF16 `gemm_bf16dp`'s (activations rounded to
/// BF16), else the register-tile one of `gemm512` / `gemm_avx2` where AVX-512 or AVX2 runs,
/// else blocks of weight rows widened to f32 for candle's GEMM (the widening paid once per
/// block for every row; memory holds one block of f32 at a time, never the matrix).
const GEMM_ROWS: usize = 16;
/// Weight rows widened at a time (k = 2048: 8 MiB of f32).
const BLOCK: usize = 1024;
/// How far ahead of its reads (bytes) a decode row kernel prefetches the weights: a decode
/// step streams the whole matrix once, and the hardware prefetcher alone left a quarter of
/// the bandwidth unused (Qwen2.5-1.5B F16 on Zen 5, AVX2 kernels: 89 ms/token without, 82
/// with 1 KiB, 64-77 with 2 KiB, 70 with 4 KiB).
#[cfg(target_arch = "x86_64")]
const PREFETCH: usize = 2048;

/// Whether BF16 products with many activation rows round the activations to BF16 here
/// (`gemm_bf16dp`: AVX-512 BF16 and the AVX-512 kernel path).
pub(crate) fn rounds_bf16_activations() -> bool {
    #[cfg(target_arch = "x86_64")]
    if gemm_bf16dp::available() {
        return true;
    }
    false
}

/// `x @ w.T`: `w` holds `n` rows of `k` 16-bit floats, `x` holds `m` rows of `k` f32; the
/// result is `m` rows of `n`.
pub(crate) fn matmul(kind: HalfKind, w: &[u8], n: usize, k: usize, x: &[f32]) -> Vec<f32> {
    if x.len() / k >= GEMM_ROWS {
        #[cfg(target_arch = "x86_64")]
        if kind == HalfKind::BF16 && gemm_bf16dp::available() {
            return gemm_bf16dp::matmul(w, n, k, x);
        }
        #[cfg(target_arch = "x86_64")]
        if gemm512::available() {
            return tiled_gemm(gemm512::kernel(kind), w, n, k, x);
        }
        #[cfg(target_arch = "x86_64")]
        if crate::simd::avx2() {
            return tiled_gemm(gemm_avx2::kernel(kind), w, n, k, x);
        }
        if let Ok(y) = matmul_gemm(kind, w, n, k, x) {
            return y;
        }
    }
    matmul_with(&kernels(kind), w, n, k, x)
}

/// A register-tile kernel over one group of weight rows: `(w, k, x, out, stride, lanes)`,
/// the group's `lanes` (≤ 16) rows of `k` 16-bit floats in `w` against the activation rows
/// `x` (at most the kernel's count), output `(i, l)` to `out + i * stride + l`.
///
/// # Safety
/// The CPU has the features of the kernel's instruction set (its module checks them when it
/// hands the kernel out); those outputs are writable.
#[cfg(target_arch = "x86_64")]
type GroupKernel = unsafe fn(&[u8], usize, &[f32], *mut f32, usize, usize);

/// [`matmul`] by a register-tile kernel (`gemm512`, `gemm_avx2`) taking `rows` activation rows
/// a call, its groups of 16 weight rows shared over the thread pool.
#[cfg(target_arch = "x86_64")]
fn tiled_gemm(
    (kern, rows): (GroupKernel, usize),
    w: &[u8],
    n: usize,
    k: usize,
    x: &[f32],
) -> Vec<f32> {
    assert_eq!(w.len(), 2 * n * k, "({n}, {k}) 16-bit matrix bytes");
    let m = x.len() / k;
    super::tiled_matmul(&[n], m, 4 * k, rows, |p| {
        let act = &x[p.rows.start * k..p.rows.end * k];
        let group = &w[2 * 16 * p.g * k..2 * (16 * p.g + p.lanes) * k];
        // SAFETY: the kernel's module checked its CPU features when it handed it out; the
        // pass's outputs, lanes `0..p.lanes` of rows `0..p.rows.len()` at `p.out` with
        // `p.stride`, are this call's to write (`tiled_matmul`), and `group` holds `p.lanes`
        // rows.
        unsafe { kern(group, k, act, p.out, p.stride, p.lanes) }
    })
    .remove(0)
}

/// [`matmul`] by blocks of [`BLOCK`] weight rows widened to f32 and candle's GEMM.
fn matmul_gemm(
    kind: HalfKind,
    w: &[u8],
    n: usize,
    k: usize,
    x: &[f32],
) -> candle_core::Result<Vec<f32>> {
    use candle_core::{Device, Tensor};
    let m = x.len() / k;
    let xt = Tensor::from_slice(x, (m, k), &Device::Cpu)?;
    let mut out = vec![0f32; m * n];
    let mut block = vec![0f32; BLOCK.min(n) * k];
    for r0 in (0..n).step_by(BLOCK) {
        let rows = BLOCK.min(n - r0);
        widen_into(
            kind,
            &w[2 * r0 * k..2 * (r0 + rows) * k],
            &mut block[..rows * k],
        );
        let wt = Tensor::from_slice(&block[..rows * k], (rows, k), &Device::Cpu)?;
        let y: Vec<f32> = xt.matmul(&wt.t()?)?.flatten_all()?.to_vec1()?;
        for (o, y) in out.chunks_exact_mut(n).zip(y.chunks_exact(rows)) {
            o[r0..r0 + rows].copy_from_slice(y);
        }
    }
    Ok(out)
}

/// `src`'s 16-bit floats widened into `dst` (as many), eight per instruction where AVX2 runs.
fn widen_into(kind: HalfKind, src: &[u8], dst: &mut [f32]) {
    assert_eq!(src.len(), 2 * dst.len());
    #[cfg(target_arch = "x86_64")]
    if crate::simd::avx2() {
        // SAFETY: AVX2 and F16C were detected (`crate::simd::avx2()`).
        return unsafe { avx2::widen_into(kind, src, dst) };
    }
    for (d, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = widen(kind, b);
    }
}

fn matmul_with(kern: &RowKernels<f32>, w: &[u8], n: usize, k: usize, x: &[f32]) -> Vec<f32> {
    let rows: Vec<Vec<f32>> = x.chunks_exact(k).map(<[f32]>::to_vec).collect();
    super::matmul_rows(kern, w, n, 2 * k, &rows, 1024)
}

#[cfg(target_arch = "x86_64")]
mod gemm512;
#[cfg(target_arch = "x86_64")]
mod gemm_avx2;
#[cfg(target_arch = "x86_64")]
mod gemm_bf16dp;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! AVX2 + FMA + F16C: eight weights widened per load; one activation row keeps four
    //! independent sums, four rows one each.
    use std::arch::x86_64::*;

    use super::{widen, HalfKind, RowKernels, PREFETCH};

    pub(super) fn kernels(kind: HalfKind) -> RowKernels<f32> {
        match kind {
            HalfKind::F16 => RowKernels {
                // SAFETY: AVX2, FMA and F16C were detected (`crate::simd::avx2()`).
                one: |w, x| unsafe { dot1::<false>(w, x) },
                // SAFETY: AVX2, FMA and F16C were detected (`crate::simd::avx2()`).
                four: |w, x| unsafe { dot::<false, 4>(w, x) },
            },
            HalfKind::BF16 => RowKernels {
                // SAFETY: AVX2, FMA and F16C were detected (`crate::simd::avx2()`).
                one: |w, x| unsafe { dot1::<true>(w, x) },
                // SAFETY: AVX2, FMA and F16C were detected (`crate::simd::avx2()`).
                four: |w, x| unsafe { dot::<true, 4>(w, x) },
            },
        }
    }

    /// Eight weights from `w` (16 bytes) as f32.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    fn weights8<const BF: bool>(w: &[u8; 16]) -> __m256 {
        // SAFETY: `w` is 16 readable bytes; `loadu` takes any alignment.
        widen8::<BF>(unsafe { _mm_loadu_si128(w.as_ptr().cast()) })
    }

    /// Eight 16-bit floats (`BF`: BF16, else F16) as f32.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    pub(super) fn widen8<const BF: bool>(h: __m128i) -> __m256 {
        if BF {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        } else {
            _mm256_cvtph_ps(h)
        }
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn acts8(x: &[f32; 8]) -> __m256 {
        // SAFETY: `x` is 8 readable f32; `loadu` takes any alignment.
        unsafe { _mm256_loadu_ps(x.as_ptr()) }
    }

    /// [`super::widen_into`] eight values at a time.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) fn widen_into(kind: HalfKind, src: &[u8], dst: &mut [f32]) {
        let body = dst.len() / 8 * 8;
        for (d, w) in dst[..body]
            .chunks_exact_mut(8)
            .zip(src[..2 * body].chunks_exact(16))
        {
            let w: &[u8; 16] = w.try_into().expect("16 bytes");
            let v = match kind {
                HalfKind::F16 => weights8::<false>(w),
                HalfKind::BF16 => weights8::<true>(w),
            };
            // SAFETY: `d` is 8 writable f32; `storeu` takes any alignment.
            unsafe { _mm256_storeu_ps(d.as_mut_ptr(), v) };
        }
        for (d, b) in dst[body..].iter_mut().zip(src[2 * body..].chunks_exact(2)) {
            *d = widen(kind, b);
        }
    }

    /// One weight row against one activation row (a decode step), four independent sums so
    /// that the multiply-adds do not wait on each other's latency: the step then reads the
    /// weights at memory speed, which one chain of sums could not.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot1<const BF: bool>(w: &[u8], x: &[f32]) -> f32 {
        let k = x.len();
        assert!(w.len() >= 2 * k);
        let mut acc = [_mm256_setzero_ps(); 4];
        let body = k / 32 * 32;
        for i in (0..body).step_by(32) {
            // The cache line of weights `PREFETCH` bytes ahead (the next rows' when this one
            // ends, rows lie one after the other; a prefetch never faults).
            _mm_prefetch::<_MM_HINT_T0>(w.as_ptr().wrapping_add(2 * i + PREFETCH).cast());
            for (u, acc) in acc.iter_mut().enumerate() {
                let at = i + 8 * u;
                let wv = weights8::<BF>(w[2 * at..2 * at + 16].try_into().expect("16 bytes"));
                let xv = acts8(x[at..at + 8].try_into().expect("8 values"));
                *acc = _mm256_fmadd_ps(wv, xv, *acc);
            }
        }
        let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let [rest] = dot::<BF, 1>(&w[2 * body..], [&x[body..]]);
        crate::simd::x86::hsum256(sum) + rest
    }

    /// One weight row (`BF`: BF16, else F16) against `R` activation rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot<const BF: bool, const R: usize>(w: &[u8], x: [&[f32]; R]) -> [f32; R] {
        let k = x[0].len();
        assert!(w.len() >= 2 * k && x.iter().all(|r| r.len() == k));
        let mut acc = [_mm256_setzero_ps(); R];
        let body = k / 8 * 8;
        for i in (0..body).step_by(8) {
            let wv = weights8::<BF>(w[2 * i..2 * i + 16].try_into().expect("16 bytes"));
            for r in 0..R {
                let xv = acts8(x[r][i..i + 8].try_into().expect("8 values"));
                acc[r] = _mm256_fmadd_ps(wv, xv, acc[r]);
            }
        }
        let kind = if BF { HalfKind::BF16 } else { HalfKind::F16 };
        let mut out = [0f32; R];
        for r in 0..R {
            out[r] = crate::simd::x86::hsum256(acc[r]);
            for i in body..k {
                out[r] += widen(kind, &w[2 * i..2 * i + 2]) * x[r][i];
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::uniform;
    use super::*;
    use proptest::prelude::*;

    fn every_path(kind: HalfKind) -> Vec<(&'static str, RowKernels<f32>)> {
        #[allow(unused_mut)]
        let mut all = vec![("portable", scalar_kernels(kind))];
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            all.push(("avx2", avx2::kernels(kind)));
            if gemm512::available() {
                let mut k = avx2::kernels(kind);
                k.one = gemm512::dot_one(kind);
                all.push(("avx512 one", k));
            }
        }
        all
    }

    fn check(vals: &[f32], x: &[f32], n: usize, k: usize) {
        for kind in [HalfKind::F16, HalfKind::BF16] {
            let w: Vec<u8> = vals
                .iter()
                .flat_map(|v| match kind {
                    HalfKind::F16 => f16::from_f32(*v).to_le_bytes(),
                    HalfKind::BF16 => bf16::from_f32(*v).to_le_bytes(),
                })
                .collect();
            let wd: Vec<f32> = w.chunks_exact(2).map(|b| widen(kind, b)).collect();
            let m = x.len() / k;
            let mut paths: Vec<(&str, Vec<f32>)> = every_path(kind)
                .into_iter()
                .map(|(name, kern)| (name, matmul_with(&kern, &w, n, k, x)))
                .collect();
            // The prefill paths, whatever the row count.
            paths.push(("gemm", matmul_gemm(kind, &w, n, k, x).unwrap()));
            #[cfg(target_arch = "x86_64")]
            if gemm512::available() {
                paths.push(("gemm512", tiled_gemm(gemm512::kernel(kind), &w, n, k, x)));
            }
            #[cfg(target_arch = "x86_64")]
            if crate::simd::avx2() {
                paths.push((
                    "gemm_avx2",
                    tiled_gemm(gemm_avx2::kernel(kind), &w, n, k, x),
                ));
            }
            #[cfg(target_arch = "x86_64")]
            if kind == HalfKind::BF16 && gemm_bf16dp::available() {
                // Its activations are rounded to BF16: held to the sums of those.
                let got = gemm_bf16dp::matmul(&w, n, k, x);
                let xr: Vec<f32> = x.iter().map(|&v| gemm_bf16dp::rounded(v)).collect();
                assert_close("gemm_bf16dp", kind, &got, &wd, &xr, (m, n, k));
                assert_ne!(
                    xr, x,
                    "the activations were all BF16 already: the rounding goes untested"
                );
            }
            for (name, got) in paths {
                assert_close(name, kind, &got, &wd, x, (m, n, k));
            }
        }
    }

    /// `got` (`m` rows of `n`) against f64 sums of `wd` (`n` rows of `k`) times `x` (`m` rows
    /// of `k`), within 1e-5 of the terms' magnitudes.
    fn assert_close(
        name: &str,
        kind: HalfKind,
        got: &[f32],
        wd: &[f32],
        x: &[f32],
        (m, n, k): (usize, usize, usize),
    ) {
        for i in 0..m {
            for j in 0..n {
                let terms = (0..k).map(|c| wd[j * k + c] as f64 * x[i * k + c] as f64);
                let want: f64 = terms.clone().sum();
                let scale: f64 = terms.map(f64::abs).sum::<f64>() + 1e-6;
                let err = (got[i * n + j] as f64 - want).abs() / scale;
                assert!(err < 1e-5, "{kind:?} {name} ({i},{j}) rel {err}");
            }
        }
    }

    /// More weight rows than a widened block, more activation rows than the GEMM threshold
    /// (through `matmul` itself): blocks land in their columns.
    #[test]
    fn prefill_sized_products_take_blocks() {
        let (n, k, m) = (BLOCK + 37, 24, GEMM_ROWS + 3);
        let mut next = uniform(11);
        let vals: Vec<f32> = (0..n * k).map(|_| next() * 2.0).collect();
        let x: Vec<f32> = (0..m * k).map(|_| next()).collect();
        check(&vals, &x, n, k);
        let w: Vec<u8> = vals
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
            .collect();
        // Where `matmul` rounds BF16 products' activations to BF16, the rows take them so.
        #[allow(unused_mut)]
        let mut xr = x.clone();
        #[cfg(target_arch = "x86_64")]
        if gemm_bf16dp::available() {
            xr = x.iter().map(|&v| gemm_bf16dp::rounded(v)).collect();
        }
        let rows = matmul_with(&kernels(HalfKind::BF16), &w, n, k, &xr);
        let gemm = matmul(HalfKind::BF16, &w, n, k, &x);
        for (a, b) in rows.iter().zip(&gemm) {
            assert!((a - b).abs() <= 1e-4 * (1.0 + a.abs()), "{a} vs {b}");
        }
    }

    /// Rows long enough for several passes of every kernel's main loop (the AVX-512 decode
    /// kernel takes 64 values a pass), and a tail.
    #[test]
    fn long_rows_take_several_passes() {
        let (n, k) = (5, 4 * 64 + 8 * 3 + 5);
        let mut next = uniform(3);
        let vals: Vec<f32> = (0..n * k).map(|_| next() * 2.0).collect();
        for m in [1, 2, 5] {
            let x: Vec<f32> = (0..m * k).map(|_| next()).collect();
            check(&vals, &x, n, k);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn random_matrices_match(
            n in 1usize..20,
            k in 1usize..80,
            m in 1usize..10,
            seed in any::<u64>(),
        ) {
            let mut next = uniform(seed);
            let vals: Vec<f32> = (0..n * k).map(|_| next() * 4.0).collect();
            let x: Vec<f32> = (0..m * k).map(|_| next() * 3.0).collect();
            check(&vals, &x, n, k);
        }
    }
}
