//! The orthonormal rotation a q8 cache applies to every row before quantizing it: fixed
//! signs, then a Walsh-Hadamard transform, per block of [`block`] elements. A key row's few
//! large channels (Qwen2.5's key biases, llama.cpp #21385) set its block's scale and so
//! coarsen every other code; rotated, each of them is spread evenly over the
//! whole block, and the scale follows the row's norm instead of its largest channel. The
//! signs keep a row whose channels are all alike (a constant offset) from collapsing into one
//! coefficient, which would be the same problem again.
//!
//! The rotation `R` is orthonormal (`Rᵀ R = I`), so attention needs no unrotated rows:
//! scores `q · k = (R q) · (R k)` with the query rotated once per head, and the weighted sum
//! of rotated values is `R` of the sum, turned back once per head with [`unrotate`].

/// Elements a rotation block of a row of `d` spans: the largest power of two dividing `d`,
/// at most 256 (q8 rows are whole blocks of 32, so at least 32).
pub(crate) fn block(d: usize) -> usize {
    (1usize << d.trailing_zeros()).min(256)
}

/// The sign of element `i` of a block: a fixed pseudo-random pattern (the bits of four
/// well-known 64-bit mixing constants: SplitMix64's and xorshift64*'s).
#[inline]
fn negative(i: usize) -> bool {
    const BITS: [u64; 4] = [
        0x9e37_79b9_7f4a_7c15,
        0xbf58_476d_1ce4_e5b9,
        0x94d0_49bb_1331_11eb,
        0x2545_f491_4f6c_dd1d,
    ];
    BITS[(i / 64) % 4] >> (i % 64) & 1 == 1
}

/// The Walsh-Hadamard transform of `x` (a power of two long), unnormalized, in place.
fn fwht(x: &mut [f32]) {
    let n = x.len();
    let mut h = 1;
    while h < n {
        for pair in x.chunks_exact_mut(2 * h) {
            let (a, b) = pair.split_at_mut(h);
            for (a, b) in a.iter_mut().zip(b) {
                (*a, *b) = (*a + *b, *a - *b);
            }
        }
        h *= 2;
    }
}

/// `x ← R x` for every row of `d` in `x` (a whole number of them): AVX2 where the CPU has it,
/// else [`rotate_portable`].
pub(crate) fn rotate(x: &mut [f32], d: usize) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::avx2() {
        // SAFETY: AVX2 was detected just above.
        return unsafe { x86::apply(x, block(d), true) };
    }
    rotate_portable(x, d)
}

/// `x ← Rᵀ x` for every row of `d` in `x`: [`rotate`] undone.
pub(crate) fn unrotate(x: &mut [f32], d: usize) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::avx2() {
        // SAFETY: AVX2 was detected just above.
        return unsafe { x86::apply(x, block(d), false) };
    }
    unrotate_portable(x, d)
}

/// [`rotate`] one element at a time.
fn rotate_portable(x: &mut [f32], d: usize) {
    let b = block(d);
    let norm = 1.0 / (b as f32).sqrt();
    for blk in x.chunks_exact_mut(b) {
        for (i, v) in blk.iter_mut().enumerate() {
            if negative(i) {
                *v = -*v;
            }
        }
        fwht(blk);
        blk.iter_mut().for_each(|v| *v *= norm);
    }
}

/// [`unrotate`] one element at a time.
fn unrotate_portable(x: &mut [f32], d: usize) {
    let b = block(d);
    let norm = 1.0 / (b as f32).sqrt();
    for blk in x.chunks_exact_mut(b) {
        fwht(blk);
        for (i, v) in blk.iter_mut().enumerate() {
            *v *= if negative(i) { -norm } else { norm };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Signs, the in-vector butterflies of the transform (spans 1, 2, 4 by lane shuffles and
    /// blends), the cross-vector ones, and the normalization, for every block of `b` (32-256)
    /// elements of `x`; `forward`: signs first ([`super::rotate`]), else last.
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn apply(x: &mut [f32], b: usize, forward: bool) {
        assert!(b.is_power_of_two() && (32..=256).contains(&b) && x.len().is_multiple_of(b));
        // SAFETY: AVX2 (the caller's contract); `b` is 32, 64, 128 or 256 (asserted), so
        // each instance's blocks are `8 V` elements of `x`, a whole number of them.
        unsafe {
            match b / 8 {
                4 => blocks::<4>(x, forward),
                8 => blocks::<8>(x, forward),
                16 => blocks::<16>(x, forward),
                _ => blocks::<32>(x, forward),
            }
        }
    }

    /// [`apply`] for blocks of `V` vectors: a block's vectors held in registers through
    /// every butterfly (a dynamic count kept them in memory, a load and a store per
    /// butterfly and a bounds check per index).
    ///
    /// # Safety
    /// The CPU has AVX2; `x` is a whole number of blocks of `8 V` elements.
    #[target_feature(enable = "avx2")]
    unsafe fn blocks<const V: usize>(x: &mut [f32], forward: bool) {
        let signs: [__m256; V] = std::array::from_fn(|c| {
            let bits: [u32; 8] = std::array::from_fn(|l| {
                if super::negative(8 * c + l) {
                    1 << 31
                } else {
                    0
                }
            });
            // SAFETY: eight u32 in `bits`.
            _mm256_castsi256_ps(unsafe { _mm256_loadu_si256(bits.as_ptr().cast()) })
        });
        let norm = _mm256_set1_ps(1.0 / ((8 * V) as f32).sqrt());
        for blk in x.chunks_exact_mut(8 * V) {
            let p = blk.as_mut_ptr();
            let mut r: [__m256; V] = std::array::from_fn(|c| {
                // SAFETY: vector `c < V` of the block.
                let mut r = unsafe { _mm256_loadu_ps(p.add(8 * c)) };
                if forward {
                    r = _mm256_xor_ps(r, signs[c]);
                }
                // Spans 1, 2 and 4: each lane with its partner, sums low, differences high.
                let s = _mm256_permute_ps::<0b10_11_00_01>(r);
                r = _mm256_blend_ps::<0b1010_1010>(_mm256_add_ps(r, s), _mm256_sub_ps(s, r));
                let s = _mm256_permute_ps::<0b01_00_11_10>(r);
                r = _mm256_blend_ps::<0b1100_1100>(_mm256_add_ps(r, s), _mm256_sub_ps(s, r));
                let s = _mm256_permute2f128_ps::<1>(r, r);
                _mm256_blend_ps::<0b1111_0000>(_mm256_add_ps(r, s), _mm256_sub_ps(s, r))
            });
            // Spans of whole vectors: 1, 2, 4, ... up to `V / 2`.
            let mut h = 1;
            while h < V {
                for i in (0..V).step_by(2 * h) {
                    for j in i..i + h {
                        let (a, c) = (r[j], r[j + h]);
                        r[j] = _mm256_add_ps(a, c);
                        r[j + h] = _mm256_sub_ps(a, c);
                    }
                }
                h *= 2;
            }
            for (c, r) in r.iter_mut().enumerate() {
                *r = _mm256_mul_ps(*r, norm);
                if !forward {
                    *r = _mm256_xor_ps(*r, signs[c]);
                }
                // SAFETY: as for the loads.
                unsafe { _mm256_storeu_ps(p.add(8 * c), *r) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// `R` is orthonormal: it keeps dot products (hence norms), and `unrotate` undoes it,
        /// for every head size a q8 cache takes.
        #[test]
        fn rotation_is_orthonormal(
            (d, x, y) in (1..9usize).prop_flat_map(|k| {
                let n = 32 * k;
                (Just(n), proptest::collection::vec(-9f32..9.0, n),
                 proptest::collection::vec(-9f32..9.0, n))
            })
        ) {
            let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(p, q)| p * q).sum::<f32>();
            let (mut rx, mut ry) = (x.clone(), y.clone());
            rotate(&mut rx, d);
            rotate(&mut ry, d);
            let (want, got) = (dot(&x, &y), dot(&rx, &ry));
            let tol = 1e-4 * dot(&x, &x).sqrt() * dot(&y, &y).sqrt() + 1e-4;
            prop_assert!((want - got).abs() <= tol, "{want} vs {got}");
            unrotate(&mut rx, d);
            for (a, b) in x.iter().zip(&rx) {
                prop_assert!((a - b).abs() <= 1e-4 * (1.0 + a.abs()), "{a} vs {b}");
            }
        }
    }

    /// A row with one large channel, or a constant one, comes out with no channel much
    /// larger than the row's norm spread evenly.
    #[test]
    fn large_channels_are_spread() {
        let d = 64;
        let mut spike = vec![0.1f32; d];
        spike[5] = 40.0;
        let constant = vec![3.0f32; d];
        for x in [spike, constant] {
            let norm = x.iter().map(|v| v * v).sum::<f32>().sqrt();
            let mut r = x.clone();
            rotate(&mut r, d);
            let amax = r.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(
                amax < 3.0 * norm / (d as f32).sqrt(),
                "{amax} against {norm}"
            );
        }
    }

    /// The AVX2 transform (where the CPU has it) equals the portable one, both ways.
    #[test]
    fn simd_matches_the_portable_rotation() {
        for d in [32, 64, 96, 128, 256, 512] {
            let x: Vec<f32> = (0..3 * d)
                .map(|i| ((i as f32) * 0.71).sin() * 5.0)
                .collect();
            let (mut fast, mut slow) = (x.clone(), x.clone());
            rotate(&mut fast, d);
            rotate_portable(&mut slow, d);
            let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(p, q)| (p - q).abs() < 1e-5);
            assert!(close(&fast, &slow), "rotate, heads of {d}");
            unrotate(&mut fast, d);
            unrotate_portable(&mut slow, d);
            assert!(close(&fast, &slow), "unrotate, heads of {d}");
            assert!(close(&fast, &x), "round trip, heads of {d}");
        }
    }

    #[test]
    fn blocks_span_the_largest_power_of_two() {
        assert_eq!(
            [32, 64, 96, 128, 160, 256, 512].map(block),
            [32, 64, 32, 128, 32, 256, 256]
        );
    }
}
