//! The feed-forward's gate, `silu(g) · u` (SwiGLU), in one pass over the two projections
//! instead of candle's three (a scalar `exp` per element for `silu`, then a product): on the
//! CPU with f32 tensors, split over the thread pool, with ggml's vectorized `exp` where the
//! CPU has AVX2 and FMA. Other devices and dtypes take candle's operations.

use candle_core::{CpuStorage, DType, Storage, Tensor};

/// Elements per task of the thread pool.
const CHUNK: usize = 4096;

/// `silu(g) · u` for tensors of one shape.
pub(crate) fn swiglu(g: &Tensor, u: &Tensor) -> candle_core::Result<Tensor> {
    let fused = g.device().is_cpu()
        && g.dtype() == DType::F32
        && u.dtype() == DType::F32
        && g.dims() == u.dims();
    if !fused {
        return candle_nn::ops::silu(g)? * u;
    }
    let (g, u) = (g.contiguous()?, u.contiguous()?);
    let (gs, gl) = g.storage_and_layout();
    let (us, ul) = u.storage_and_layout();
    let (Storage::Cpu(CpuStorage::F32(gd)), Storage::Cpu(CpuStorage::F32(ud))) = (&*gs, &*us)
    else {
        candle_core::bail!("swiglu: f32 CPU tensors expected");
    };
    let (Some((g0, g1)), Some((u0, u1))) = (gl.contiguous_offsets(), ul.contiguous_offsets())
    else {
        candle_core::bail!("swiglu: contiguous tensors expected");
    };
    let (gv, uv) = (&gd[g0..g1], &ud[u0..u1]);
    let mut out = vec![0f32; gv.len()];
    let simd = crate::simd::avx2();
    let tasks = gv.len().div_ceil(CHUNK);
    let dst = crate::quant::SharedOut(out.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(tasks, |range| {
        let dst = &dst;
        let (lo, hi) = (range.start * CHUNK, (range.end * CHUNK).min(gv.len()));
        // SAFETY: elements `lo..hi` of `out` belong to this task's range of chunks only, and
        // `out` outlives `execute_chunked`.
        let o = unsafe { std::slice::from_raw_parts_mut(dst.0.add(lo), hi - lo) };
        gate(simd, &gv[lo..hi], &uv[lo..hi], o);
    });
    let dims = g.dims().to_vec();
    drop((gs, us));
    Tensor::from_vec(out, dims, g.device())
}

/// `o = silu(g) · u`, eight lanes at a time when `simd` (AVX2 and FMA checked).
fn gate(simd: bool, g: &[f32], u: &[f32], o: &mut [f32]) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: the caller checked AVX2 and FMA.
        done = unsafe { x86::gate(g, u, o) };
    }
    let _ = simd;
    for ((o, &g), &u) in o[done..].iter_mut().zip(&g[done..]).zip(&u[done..]) {
        *o = g / (1.0 + (-g).exp()) * u;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use crate::simd::x86::exp8;

    /// [`super::gate`] over the whole vectors of eight; returns how many elements it did.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn gate(g: &[f32], u: &[f32], o: &mut [f32]) -> usize {
        let n = g.len().min(u.len()).min(o.len()) / 8 * 8;
        let one = _mm256_set1_ps(1.0);
        // `exp(-g)` for `g ≥ -87`; below, `silu(g)` is `g · e^g` < 1e-36, and `exp8` at 87
        // makes it that small too.
        let top = _mm256_set1_ps(87.0);
        for i in (0..n).step_by(8) {
            // SAFETY: `i + 8 ≤ n`, within all three slices.
            unsafe {
                let x = _mm256_loadu_ps(g.as_ptr().add(i));
                let e = exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), x), top));
                let s = _mm256_div_ps(x, _mm256_add_ps(one, e));
                let y = _mm256_mul_ps(s, _mm256_loadu_ps(u.as_ptr().add(i)));
                _mm256_storeu_ps(o.as_mut_ptr().add(i), y);
            }
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    /// The fused gate equals candle's `silu(g) * u` (to a few ulp of `exp`), over a range
    /// that reaches both saturated ends, on the SIMD loop and the portable one, for lengths
    /// that leave a tail and span several tasks.
    #[test]
    fn matches_candles_silu_product() {
        let dev = Device::Cpu;
        for n in [1, 7, 8, 37, CHUNK * 2 + 13] {
            let g: Vec<f32> = (0..n)
                .map(|i| ((i * 7919) % 2001) as f32 / 10.0 - 100.0)
                .collect();
            let u: Vec<f32> = (0..n)
                .map(|i| ((i * 104_729) % 97) as f32 / 30.0 - 1.5)
                .collect();
            let (gt, ut) = (
                Tensor::new(g.as_slice(), &dev).unwrap(),
                Tensor::new(u.as_slice(), &dev).unwrap(),
            );
            let want = (candle_nn::ops::silu(&gt).unwrap() * &ut)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let got = swiglu(&gt, &ut).unwrap().to_vec1::<f32>().unwrap();
            let mut portable = vec![0f32; n];
            gate(false, &g, &u, &mut portable);
            for (name, got) in [("fused", &got), ("portable", &portable)] {
                for (i, (x, y)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (x - y).abs() <= 2e-6 * y.abs() + 1e-30,
                        "{name} n={n} [{i}] g={}: {x} vs {y}",
                        g[i]
                    );
                }
            }
        }
    }
}
