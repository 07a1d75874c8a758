//! The orthonormal rotation `R = H D / √b` of mode-`5` rows (see [`crate::quant`]), per block
//! of `b` = [`block`] elements of a row: `D` the fixed signs of [`negative`], `H` the
//! Walsh-Hadamard transform of size `b` (natural order); `Rᵀ = D H / √b`.
//! Part of the stored format: the signs and the block size must never change for mode `5`.
//!
//! Decoding turns rows back with [`unrotate_codes`], which works on the codes: `Rᵀ` is the
//! Walsh-Hadamard transform of each 8-element step (within one quantization group), exact in
//! integers, then of the block across its steps in f32, then the signs. The AVX2 decoder
//! (`x86.rs`) computes the same operations in the same order, so both give the same bits.

/// Elements a rotation block spans in rows of `c`: the largest power of two dividing `c`, at
/// most 64 (heads of 64 and 128 elements: 64; 64 measured better than 128 on Qwen2.5-0.5B).
pub(crate) fn block(c: usize) -> usize {
    (1usize << c.trailing_zeros()).min(64)
}

/// The smallest block mode `5` is written with (rows of an odd multiple of 8 or less keep
/// mode `2`): the decoders transform 16 codes (two 8-element steps) at a time.
pub(crate) const MIN_BLOCK: usize = 16;

/// The sign of element `i` of a block: a fixed pseudo-random pattern (the bits of four
/// well-known 64-bit mixing constants: SplitMix64's and xorshift64*'s). Part of the format.
#[inline]
pub(crate) fn negative(i: usize) -> bool {
    const BITS: [u64; 4] = [
        0x9e37_79b9_7f4a_7c15,
        0xbf58_476d_1ce4_e5b9,
        0x94d0_49bb_1331_11eb,
        0x2545_f491_4f6c_dd1d,
    ];
    BITS[(i / 64) % 4] >> (i % 64) & 1 == 1
}

/// The Walsh-Hadamard transform of `x` (a power of two long), unnormalized, in place:
/// butterflies of span 1, 2, 4, … in turn, `(a, b) ← (a + b, a − b)`.
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

/// `x ← R x` for every block of `b` elements in `x`.
pub(crate) fn rotate(x: &mut [f32], b: usize) {
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

/// Per group of a plane rotated in blocks of `b`: its scale × `1/√b` and its minimum ×
/// `8/√b`, the factors [`unrotate_codes`] takes for each of the group's 8-element steps.
pub(crate) fn group_factors(scales: &[f32], mins: &[f32], b: usize) -> (Vec<f32>, Vec<f32>) {
    let norm = 1.0 / (b as f32).sqrt();
    (
        scales.iter().map(|s| s * norm).collect(),
        mins.iter().map(|m| m * (8.0 * norm)).collect(),
    )
}

/// The integer Walsh-Hadamard transform of one 8-element step of codes (each `0..=15`, so
/// every result is within `±120`).
pub(crate) fn fwht8(q: [u8; 8]) -> [i8; 8] {
    let mut h = q.map(i32::from);
    for span in [1, 2, 4] {
        for i in (0..8).filter(|i| i & span == 0) {
            (h[i], h[i + span]) = (h[i] + h[i + span], h[i] - h[i + span]);
        }
    }
    h.map(|v| v as i8)
}

/// One rotated block of `y.len() = b` elements decoded and turned back: `h[k]` the
/// [`fwht8`] of step `k`'s codes, `f[k]` its group's [`group_factors`] (the transform of a
/// constant step is 8 × it in the step's first element).
pub(crate) fn unrotate_codes(h: &[[i8; 8]], f: &[(f32, f32)], y: &mut [f32]) {
    for (k, step) in y.chunks_exact_mut(8).enumerate() {
        let (s, m) = f[k];
        for (l, v) in step.iter_mut().enumerate() {
            *v = f32::from(h[k][l]).mul_add(s, if l == 0 { m } else { 0.0 });
        }
    }
    // The block's steps across: spans 8, 16, ….
    let b = y.len();
    let mut span = 8;
    while span < b {
        for pair in y.chunks_exact_mut(2 * span) {
            let (a, c) = pair.split_at_mut(span);
            for (a, c) in a.iter_mut().zip(c) {
                (*a, *c) = (*a + *c, *a - *c);
            }
        }
        span *= 2;
    }
    for (i, v) in y.iter_mut().enumerate() {
        if negative(i) {
            *v = -*v;
        }
    }
}

/// `x ← Rᵀ x`: [`rotate`] undone (in f32; the decoders use [`unrotate_codes`]).
#[cfg(test)]
pub(crate) fn unrotate(x: &mut [f32], b: usize) {
    let norm = 1.0 / (b as f32).sqrt();
    for blk in x.chunks_exact_mut(b) {
        fwht(blk);
        for (i, v) in blk.iter_mut().enumerate() {
            *v *= if negative(i) { -norm } else { norm };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn blocks_follow_the_rows_power_of_two() {
        assert_eq!(block(192), 64);
        assert_eq!(block(128), 64);
        assert_eq!(block(1024), 64);
        assert_eq!(block(80), 16);
        assert_eq!(block(6), 2);
    }

    proptest! {
        #[test]
        fn rotation_keeps_norms_and_turns_back(
            x in proptest::collection::vec(-100f32..100.0, 128), b in prop::sample::select(vec![16usize, 32, 64]),
        ) {
            let mut y = x.clone();
            rotate(&mut y, b);
            for (xb, yb) in x.chunks_exact(b).zip(y.chunks_exact(b)) {
                let (nx, ny) = (xb.iter().map(|v| v * v).sum::<f32>(), yb.iter().map(|v| v * v).sum::<f32>());
                prop_assert!((nx - ny).abs() <= 1e-4 * nx.max(1.0), "{nx} vs {ny}");
            }
            unrotate(&mut y, b);
            for (a, b) in x.iter().zip(&y) {
                prop_assert!((a - b).abs() <= 1e-4 * a.abs().max(1.0), "{a} vs {b}");
            }
        }

        #[test]
        fn one_large_element_is_spread_over_its_block(j in 0usize..64, v in 1f32..1000.0) {
            let mut x = vec![0f32; 64];
            x[j] = v;
            rotate(&mut x, 64);
            for y in &x {
                prop_assert!((y.abs() - v / 8.0).abs() <= 1e-3 * v, "{y}");
            }
        }
    }
}
