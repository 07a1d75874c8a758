//! llama.cpp's non-linear 4-bit blocks, `IQ4_NL` and `IQ4_XS`: as `IQ4_NL` blocks for the CPU's
//! repacked AVX2 kernels, or as `Q8_0` blocks of the same values for every other path (candle's
//! CUDA products, the portable one).
//!
//! Both index a fixed table of 16 signed 8-bit levels (denser near zero) with 4-bit codes;
//! layouts (ggml's, little endian; element `j < 16` of a 32-value group is the low nibble of
//! `qs[j]`, element `j + 16` its high nibble):
//!
//! | type | values | bytes | layout | value |
//! |---|---:|---:|---|---|
//! | IQ4_NL | 32 | 18 | `d: f16, qs[16]` | `d · T[q]` |
//! | IQ4_XS | 256 | 136 | `d: f16, scales_h: u16, scales_l[4], qs[128]` | `d · (s − 32) · T[q]`, `s` = 6 bits per group of 32: low 4 from `scales_l`, high 2 from `scales_h` |
//! | Q8_0 (out) | 32 | 34 | `d: f16, q[32]: i8` | `d · q` |
//!
//! Where ragkv's AVX2 kernels run, `IQ4_NL` blocks are kept as they are (repacked: 4.5 bits per
//! value) and multiplied through a byte shuffle of the table; `IQ4_XS` matrices go to the
//! K-quant tiles (`super::kpacked`: 256-value super-blocks, the 6-bit scales applied in
//! integers, 4.31 bits per value) where the AVX-512 VNNI or plain AVX2 tile kernels run, and
//! are rewritten as `IQ4_NL` blocks of 32 ([`xs_to_nl`]) for the AVX-VNNI kernels; elsewhere
//! (a GPU, the portable path) both become `Q8_0`.
//!
//! `IQ4_NL` becomes `Q8_0` exactly (its scale and the table's levels are `Q8_0`'s scale and
//! codes). An `IQ4_XS` group's scale `d · (s − 32)` is rounded to f16 (relative error at most
//! 2⁻¹¹ in f16's normal range, below the 8-bit rounding every activation row gets before the
//! product). As `Q8_0` the weights take 8.5 bits per value in memory, against the file's
//! 4.25-4.5.

use half::f16;

/// The table of levels (ggml's `kvalues_iq4nl`).
pub(crate) const LEVELS: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// [`LEVELS`] plus 128 (1..=241): the unsigned bytes the VNNI kernels multiply (`vpdpbusd`
/// takes unsigned weights); the offset comes back out through the activations' sums.
pub(crate) static LEVELS_U8: [u8; 16] = {
    let mut t = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = (LEVELS[i] as i16 + 128) as u8;
        i += 1;
    }
    t
};

/// The 4-bit index of each level of [`LEVELS`] (by the level's byte, `level as u8`; 0
/// elsewhere).
pub(crate) static CODES: [u8; 256] = {
    let mut t = [0u8; 256];
    let mut i = 0;
    while i < 16 {
        t[LEVELS[i] as u8 as usize] = i as u8;
        i += 1;
    }
    t
};

/// `IQ4_NL`: values and bytes per block.
pub(crate) const NL_VALUES: usize = 32;
pub(crate) const NL_BYTES: usize = 18;
/// `IQ4_XS`: values and bytes per block.
pub(crate) const XS_VALUES: usize = 256;
pub(crate) const XS_BYTES: usize = 136;
/// `Q8_0`: bytes per block of 32.
const Q8_BYTES: usize = 34;

/// One `Q8_0` block of scale `d` (f16 bits) from 16 bytes of 4-bit codes.
fn q8_block(out: &mut Vec<u8>, d: [u8; 2], qs: &[u8]) {
    out.extend_from_slice(&d);
    out.extend(qs.iter().map(|&b| LEVELS[usize::from(b & 0xf)] as u8));
    out.extend(qs.iter().map(|&b| LEVELS[usize::from(b >> 4)] as u8));
}

/// `IQ4_NL` blocks as `Q8_0` blocks (exact).
pub(crate) fn nl_to_q8_0(raw: &[u8]) -> Result<Vec<u8>, String> {
    if !raw.len().is_multiple_of(NL_BYTES) {
        return Err(format!(
            "{} bytes of IQ4_NL blocks of {NL_BYTES}",
            raw.len()
        ));
    }
    let mut out = Vec::with_capacity(raw.len() / NL_BYTES * Q8_BYTES);
    for b in raw.chunks_exact(NL_BYTES) {
        q8_block(&mut out, [b[0], b[1]], &b[2..]);
    }
    Ok(out)
}

/// Group `g`'s 6-bit scale of an `IQ4_XS` block.
pub(crate) fn xs_scale(b: &[u8], g: usize) -> i32 {
    let high = u16::from_le_bytes([b[2], b[3]]);
    let low = (b[4 + g / 2] >> (4 * (g % 2))) & 0xf;
    i32::from(low) | (i32::from((high >> (2 * g)) & 3) << 4)
}

/// `IQ4_XS` blocks as `IQ4_NL` blocks: each group of 32 with its scale `d · (s − 32)` rounded
/// to f16, and its codes as they are.
pub(crate) fn xs_to_nl(raw: &[u8]) -> Result<Vec<u8>, String> {
    if !raw.len().is_multiple_of(XS_BYTES) {
        return Err(format!(
            "{} bytes of IQ4_XS blocks of {XS_BYTES}",
            raw.len()
        ));
    }
    let mut out = Vec::with_capacity(raw.len() / XS_BYTES * 8 * NL_BYTES);
    for b in raw.chunks_exact(XS_BYTES) {
        let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
        for g in 0..8 {
            let s = xs_scale(b, g) - 32;
            let dl = f16::from_f32(d * s as f32);
            if !dl.is_finite() {
                return Err(format!("a group scale of {d} × {s} overflows f16"));
            }
            out.extend(dl.to_le_bytes());
            out.extend_from_slice(&b[8 + 16 * g..8 + 16 * (g + 1)]);
        }
    }
    Ok(out)
}

/// `IQ4_XS` blocks as `Q8_0` blocks (each group's scale rounded to f16).
pub(crate) fn xs_to_q8_0(raw: &[u8]) -> Result<Vec<u8>, String> {
    nl_to_q8_0(&xs_to_nl(raw)?)
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{iq4_nl_reference as ref_nl, iq4_xs_reference as ref_xs};
    use super::*;
    use proptest::prelude::*;

    /// `Q8_0` blocks' values.
    fn q8(out: &[u8]) -> Vec<f32> {
        out.chunks_exact(Q8_BYTES)
            .flat_map(|b| {
                let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                b[2..].iter().map(move |&q| d * f32::from(q as i8))
            })
            .collect()
    }

    /// `n` blocks of `size` bytes, codes and sub-scales from `seed`, block `i`'s f16 scale
    /// `scale · (i + 1)`.
    fn blocks(seed: &[u8], n: usize, size: usize, scale: f32) -> Vec<u8> {
        let mut raw: Vec<u8> = seed.iter().cycle().take(n * size).copied().collect();
        for (i, b) in raw.chunks_exact_mut(size).enumerate() {
            b[..2].copy_from_slice(&f16::from_f32(scale * (i as f32 + 1.0)).to_le_bytes());
        }
        raw
    }

    proptest! {
        #[test]
        fn iq4_nl_becomes_q8_0_exactly(seed in proptest::collection::vec(any::<u8>(), 1..64),
                                       n in 1usize..6, scale in -1.0f32..1.0) {
            let raw = blocks(&seed, n, NL_BYTES, scale);
            let out = nl_to_q8_0(&raw).unwrap();
            prop_assert_eq!(out.len(), n * Q8_BYTES);
            prop_assert_eq!(q8(&out), ref_nl(&raw));
        }

        // Scales from 1e-3 up keep every group's scale (at least 1e-3 · 1) in f16's normal
        // range, where its rounding is within 2^-11 relative.
        #[test]
        fn iq4_xs_becomes_q8_0_within_f16_rounding_of_each_scale(
            seed in proptest::collection::vec(any::<u8>(), 1..200), n in 1usize..3,
            scale in 1e-3f32..1.0,
        ) {
            let raw = blocks(&seed, n, XS_BYTES, scale);
            let out = xs_to_q8_0(&raw).unwrap();
            prop_assert_eq!(out.len(), n * 8 * Q8_BYTES);
            for (got, want) in q8(&out).iter().zip(ref_xs(&raw)) {
                prop_assert!((got - want).abs() <= want.abs() / 2048.0, "{} against {}", got, want);
            }
        }
    }

    #[test]
    fn a_known_block_of_each() {
        // IQ4_NL: d = 0.5, codes 0..16 then 15..0 (low nibble ascending, high descending).
        let mut nl = f16::from_f32(0.5).to_le_bytes().to_vec();
        nl.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let v = q8(&nl_to_q8_0(&nl).unwrap());
        assert_eq!(v[0], -63.5);
        assert_eq!(v[15], 56.5);
        assert_eq!(v[16], 56.5);
        assert_eq!(v[31], -63.5);
        // IQ4_XS: d = 0.25, group 0's scale 33 (low 1, high 2: 1 + 32), group 1's 31 (low 15,
        // high 1: 15 + 16), the others 32 (a scale of 0); every code 8 (level 1).
        let mut xs = f16::from_f32(0.25).to_le_bytes().to_vec();
        let high: u16 = 2
            | (1 << 2)
            | (0b10 << 4)
            | (0b10 << 6)
            | (0b10 << 8)
            | (0b10 << 10)
            | (0b10 << 12)
            | (0b10 << 14);
        xs.extend(high.to_le_bytes());
        xs.extend([0x01 | (0x0f << 4), 0, 0, 0]);
        xs.extend([0x88; 128]);
        let v = q8(&xs_to_q8_0(&xs).unwrap());
        assert_eq!(v.len(), 256);
        assert_eq!(v[0], 0.25); // (33 - 32) · 0.25 · 1
        assert_eq!(v[32], -0.25); // (31 - 32) · 0.25 · 1
        assert!(v[64..].iter().all(|&x| x == 0.0));
        // Wrong lengths are refused.
        assert!(nl_to_q8_0(&nl[..17]).is_err());
        assert!(xs_to_q8_0(&xs[..135]).is_err());
    }
}
