//! The scalar-and-vector loops of one attention group for shapes the AVX-512 kernel does not
//! take: AVX2+FMA where the CPU has them (with ggml's vectorized `exp`), a portable loop
//! otherwise; [`super::attend`] picks with [`Kernel::best`].

/// The loops of one group, for the CPU's instruction set.
#[derive(Clone, Copy)]
pub(super) enum Kernel {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl Kernel {
    pub(super) fn best() -> Kernel {
        #[cfg(target_arch = "x86_64")]
        if crate::simd::allows_avx2()
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
        {
            return Kernel::Avx2;
        }
        Kernel::Portable
    }

    /// Heads `q` (`rep` rows of `d`) over `n` keys at offsets `krows` of `k` and values at
    /// `vrows` of `v`: the weighted sums into `o` (zeroed), `p` scratch.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn group(
        self,
        q: &[f32],
        k: &[f32],
        krows: impl Iterator<Item = usize>,
        v: &[f32],
        vrows: impl Iterator<Item = usize>,
        n: usize,
        d: usize,
        scale: f32,
        p: &mut Vec<f32>,
        o: &mut [f32],
    ) {
        let rep = q.len() / d;
        p.clear();
        p.resize(rep * n, 0.0);
        // Scores, head-major: p[r * n + j].
        for (j, at) in krows.enumerate() {
            let key = &k[at..at + d];
            for r in 0..rep {
                p[r * n + j] = self.dot(&q[r * d..(r + 1) * d], key) * scale;
            }
        }
        for r in 0..rep {
            let s = &mut p[r * n..(r + 1) * n];
            let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum = self.exp_sub(s, max);
            let inv = 1.0 / sum;
            s.iter_mut().for_each(|x| *x *= inv);
        }
        o.fill(0.0);
        for (j, at) in vrows.enumerate() {
            let val = &v[at..at + d];
            for r in 0..rep {
                self.axpy(&mut o[r * d..(r + 1) * d], p[r * n + j], val);
            }
        }
    }

    #[inline]
    pub(super) fn dot(self, a: &[f32], b: &[f32]) -> f32 {
        match self {
            // SAFETY: `best` checked the CPU features.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => unsafe { avx2::dot(a, b) },
            Kernel::Portable => portable::dot(a, b),
        }
    }

    #[inline]
    pub(super) fn axpy(self, o: &mut [f32], w: f32, x: &[f32]) {
        match self {
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => unsafe { avx2::axpy(o, w, x) },
            Kernel::Portable => portable::axpy(o, w, x),
        }
    }

    /// `x = exp(x - max)` in place; returns the sum.
    #[inline]
    pub(super) fn exp_sub(self, x: &mut [f32], max: f32) -> f32 {
        match self {
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => unsafe { avx2::exp_sub(x, max) },
            Kernel::Portable => portable::exp_sub(x, max),
        }
    }
}

mod portable {
    /// `a · b`, eight lanes at a time (a form the compiler vectorizes).
    pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
        let mut acc = [0f32; 8];
        let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
        let tail: f32 = ac
            .remainder()
            .iter()
            .zip(bc.remainder())
            .map(|(x, y)| x * y)
            .sum();
        for (x, y) in ac.zip(bc) {
            for l in 0..8 {
                acc[l] += x[l] * y[l];
            }
        }
        acc.iter().sum::<f32>() + tail
    }

    pub(super) fn axpy(o: &mut [f32], w: f32, x: &[f32]) {
        for (o, x) in o.iter_mut().zip(x) {
            *o += w * x;
        }
    }

    pub(super) fn exp_sub(x: &mut [f32], max: f32) -> f32 {
        let mut sum = 0f32;
        for v in x.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        sum
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! AVX2 + FMA loops. Every function needs those features: callers check first. They
    //! stay `unsafe fn`s over raw pointers with one block per body: as safe
    //! `#[target_feature]` functions over bounds-checked slices they ran SmolLM2's AVX2
    //! decode ~20 % slower in the dev profile.
    #![allow(unused_unsafe)]
    use std::arch::x86_64::*;

    use crate::simd::x86::{exp8, hsum256 as hsum};

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        // SAFETY: the caller's contract (AVX2, FMA); every load is below `n`, the shorter
        // length.
        unsafe {
            let (mut c0, mut c1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut i = 0;
            while i + 16 <= n {
                c0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), c0);
                c1 = _mm256_fmadd_ps(
                    _mm256_loadu_ps(pa.add(i + 8)),
                    _mm256_loadu_ps(pb.add(i + 8)),
                    c1,
                );
                i += 16;
            }
            if i + 8 <= n {
                c0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), c0);
                i += 8;
            }
            let mut s = hsum(_mm256_add_ps(c0, c1));
            while i < n {
                s += a[i] * b[i];
                i += 1;
            }
            s
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn axpy(o: &mut [f32], w: f32, x: &[f32]) {
        let n = o.len().min(x.len());
        let (po, px) = (o.as_mut_ptr(), x.as_ptr());
        // SAFETY: the caller's contract (AVX2, FMA); every load and store is below `n`, the
        // shorter length.
        unsafe {
            let wv = _mm256_set1_ps(w);
            let mut i = 0;
            while i + 8 <= n {
                let y = _mm256_fmadd_ps(wv, _mm256_loadu_ps(px.add(i)), _mm256_loadu_ps(po.add(i)));
                _mm256_storeu_ps(po.add(i), y);
                i += 8;
            }
            while i < n {
                o[i] += w * x[i];
                i += 1;
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_sub(x: &mut [f32], max: f32) -> f32 {
        let n = x.len();
        let p = x.as_mut_ptr();
        // SAFETY: the caller's contract (AVX2, FMA); every load and store is below `n`.
        unsafe {
            let m = _mm256_set1_ps(max);
            let mut acc = _mm256_setzero_ps();
            let mut i = 0;
            while i + 8 <= n {
                let y = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), m));
                _mm256_storeu_ps(p.add(i), y);
                acc = _mm256_add_ps(acc, y);
                i += 8;
            }
            let mut sum = hsum(acc);
            while i < n {
                x[i] = (x[i] - max).exp();
                sum += x[i];
                i += 1;
            }
            sum
        }
    }
}
