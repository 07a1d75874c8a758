//! The scalar-and-vector loops of one attention group for shapes the AVX-512 kernel does not
//! take: AVX2+FMA where the CPU has them (with ggml's vectorized `exp`), a portable loop
//! otherwise; [`super::attend`] picks with [`Kernel::best`]. Cache rows are read where they
//! are, in the cache's own dtype ([`Elem`]): an f16 row is widened as it is loaded
//! (`vcvtph2ps`), a q8 row's codes times their block's scale, so a decode step reads the
//! cache's bytes once and writes no scratch copy. On AVX2 CPUs these loops only see heads
//! that are not a multiple of eight elements (`super::avx2` takes the rest).

use half::f16;

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
        if crate::simd::avx2() {
            return Kernel::Avx2;
        }
        Kernel::Portable
    }

    /// Heads `q` (`rep` rows of `d`) over `n` keys at offsets `krows` of `k` and values at
    /// `vrows` of `v` (rows of [`Elem::row_len`] elements): the weighted sums into `o`
    /// (zeroed), `p` scratch.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn group<E: Elem>(
        self,
        q: &[f32],
        k: &[E],
        krows: impl Iterator<Item = usize>,
        v: &[E],
        vrows: impl Iterator<Item = usize>,
        n: usize,
        d: usize,
        scale: f32,
        p: &mut Vec<f32>,
        o: &mut [f32],
    ) {
        let rep = q.len() / d;
        let w = E::row_len(d);
        p.clear();
        p.resize(rep * n, 0.0);
        // Scores, head-major: p[r * n + j].
        for (j, at) in krows.enumerate() {
            let key = &k[at..at + w];
            for r in 0..rep {
                p[r * n + j] = E::dot(self, &q[r * d..(r + 1) * d], key) * scale;
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
            let val = &v[at..at + w];
            for r in 0..rep {
                E::axpy(self, &mut o[r * d..(r + 1) * d], p[r * n + j], val);
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

/// Cache elements the loops read in place.
pub(super) trait Elem: Copy {
    /// Elements a row of `d` values takes (more than `d` where scales follow the codes).
    fn row_len(d: usize) -> usize {
        d
    }

    /// `q · row`, `row` of [`Elem::row_len`]`(q.len())` elements.
    fn dot(kernel: Kernel, q: &[f32], row: &[Self]) -> f32;

    /// `o += w × row`, `row` of [`Elem::row_len`]`(o.len())` elements.
    fn axpy(kernel: Kernel, o: &mut [f32], w: f32, row: &[Self]);
}

impl Elem for f32 {
    #[inline]
    fn dot(kernel: Kernel, q: &[f32], row: &[f32]) -> f32 {
        kernel.dot(q, row)
    }

    #[inline]
    fn axpy(kernel: Kernel, o: &mut [f32], w: f32, row: &[f32]) {
        kernel.axpy(o, w, row)
    }
}

impl Elem for f16 {
    #[inline]
    fn dot(kernel: Kernel, q: &[f32], row: &[f16]) -> f32 {
        match kernel {
            // SAFETY: `best` checked the CPU features.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => unsafe { avx2::dot(q, row) },
            Kernel::Portable => portable::dot(q, row),
        }
    }

    #[inline]
    fn axpy(kernel: Kernel, o: &mut [f32], w: f32, row: &[f16]) {
        match kernel {
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => unsafe { avx2::axpy(o, w, row) },
            Kernel::Portable => portable::axpy(o, w, row),
        }
    }
}

/// q8 cache rows (`crate::kv_q8`): `d` signed codes, then an f32 scale per block of 32. Only
/// the portable path reaches these loops with them: q8 heads are whole blocks of 32, which
/// the AVX2 and AVX-512 kernels take.
impl Elem for u8 {
    fn row_len(d: usize) -> usize {
        crate::kv_q8::row_bytes(d)
    }

    #[inline]
    fn dot(_: Kernel, q: &[f32], row: &[u8]) -> f32 {
        portable::dot_q8(q, row)
    }

    #[inline]
    fn axpy(_: Kernel, o: &mut [f32], w: f32, row: &[u8]) {
        portable::axpy_q8(o, w, row)
    }
}

/// Row elements read as f32 one at a time: f32 and f16 (the portable loops, and the AVX2
/// ones' tails).
pub(super) trait Widen: Copy {
    fn widen(self) -> f32;
}

impl Widen for f32 {
    #[inline]
    fn widen(self) -> f32 {
        self
    }
}

impl Widen for f16 {
    #[inline]
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

mod portable {
    use super::Widen;
    use crate::kv_q8::{block_scale, BLOCK};
    /// `a · b`, eight lanes at a time (a form the compiler vectorizes).
    pub(super) fn dot<T: Widen>(a: &[f32], b: &[T]) -> f32 {
        let mut acc = [0f32; 8];
        let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
        let tail: f32 = ac
            .remainder()
            .iter()
            .zip(bc.remainder())
            .map(|(x, y)| x * y.widen())
            .sum();
        for (x, y) in ac.zip(bc) {
            for l in 0..8 {
                acc[l] += x[l] * y[l].widen();
            }
        }
        acc.iter().sum::<f32>() + tail
    }

    pub(super) fn axpy<T: Widen>(o: &mut [f32], w: f32, x: &[T]) {
        for (o, x) in o.iter_mut().zip(x) {
            *o += w * x.widen();
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

    /// Per block: the codes' products summed, times the block's scale.
    pub(super) fn dot_q8(a: &[f32], row: &[u8]) -> f32 {
        let d = a.len();
        let mut sum = 0f32;
        for (k, (x, q)) in a
            .chunks_exact(BLOCK)
            .zip(row[..d].chunks_exact(BLOCK))
            .enumerate()
        {
            let mut acc = [0f32; 8];
            for (x, q) in x.chunks_exact(8).zip(q.chunks_exact(8)) {
                for l in 0..8 {
                    acc[l] += x[l] * f32::from(q[l] as i8);
                }
            }
            sum += acc.iter().sum::<f32>() * block_scale(row, d, k);
        }
        sum
    }

    pub(super) fn axpy_q8(o: &mut [f32], w: f32, row: &[u8]) {
        let d = o.len();
        for (k, (o, q)) in o
            .chunks_exact_mut(BLOCK)
            .zip(row[..d].chunks_exact(BLOCK))
            .enumerate()
        {
            let ws = w * block_scale(row, d, k);
            for (o, q) in o.iter_mut().zip(q) {
                *o += ws * f32::from(*q as i8);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! AVX2 + FMA + F16C loops. Every function needs those features: callers check first. They
    //! stay `unsafe fn`s over raw pointers with one block per body: as safe
    //! `#[target_feature]` functions over bounds-checked slices they ran SmolLM2's AVX2
    //! decode ~20 % slower in the dev profile.
    #![allow(unused_unsafe)]
    use std::arch::x86_64::*;

    use half::f16;

    use super::Widen;
    use crate::simd::x86::{exp8, hsum256 as hsum};

    /// Row elements the loops load eight at a time as f32 lanes: f32, and f16 widened as it
    /// loads (`vcvtph2ps`).
    pub(super) trait Load8: Widen {
        /// Eight elements from `p` as f32 lanes.
        ///
        /// # Safety
        /// The CPU has AVX2, FMA and F16C; eight elements are readable at `p`.
        unsafe fn load8(p: *const Self) -> __m256;
    }

    impl Load8 for f32 {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load8(p: *const f32) -> __m256 {
            // SAFETY: the caller's contract: eight f32 readable at `p`.
            unsafe { _mm256_loadu_ps(p) }
        }
    }

    impl Load8 for f16 {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load8(p: *const f16) -> __m256 {
            // SAFETY: the caller's contract: eight f16 readable at `p`.
            unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot<T: Load8>(a: &[f32], b: &[T]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        // SAFETY: the caller's contract (AVX2, FMA, F16C); every load is below `n`, the
        // shorter length.
        unsafe {
            let (mut c0, mut c1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut i = 0;
            while i + 16 <= n {
                c0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), T::load8(pb.add(i)), c0);
                c1 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8)), T::load8(pb.add(i + 8)), c1);
                i += 16;
            }
            if i + 8 <= n {
                c0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), T::load8(pb.add(i)), c0);
                i += 8;
            }
            let mut s = hsum(_mm256_add_ps(c0, c1));
            while i < n {
                s += a[i] * b[i].widen();
                i += 1;
            }
            s
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn axpy<T: Load8>(o: &mut [f32], w: f32, x: &[T]) {
        let n = o.len().min(x.len());
        let (po, px) = (o.as_mut_ptr(), x.as_ptr());
        // SAFETY: the caller's contract (AVX2, FMA, F16C); every load and store is below
        // `n`, the shorter length.
        unsafe {
            let wv = _mm256_set1_ps(w);
            let mut i = 0;
            while i + 8 <= n {
                let y = _mm256_fmadd_ps(wv, T::load8(px.add(i)), _mm256_loadu_ps(po.add(i)));
                _mm256_storeu_ps(po.add(i), y);
                i += 8;
            }
            while i < n {
                o[i] += w * x[i].widen();
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
