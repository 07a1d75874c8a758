//! AMX tile products over [`super`]'s K-quant tiles for prompts' rows (CPUs with AMX-INT8,
//! kernel path `amx`; the tile unit and its products are
//! [`super::super::amx`]'s).
//!
//! A sub-block of a tile (32 elements of sixteen rows) decodes, by the VNNI kernel's own
//! decoding (`x86`), to eight vectors in `vpdpbusd`'s order: a B tile of eight rows of 64
//! bytes. Sixteen activation rows' quants of the same sub-block (read in place from the Q8_K
//! rows) are the A tile, and one `tdpbsud` gives the sixteen rows' sums for sixteen weight
//! rows. For the types with a scale per 16-element group (Q6_K, Q3_K, Q2_K) each half of a
//! sub-block goes in its own B tile, the other half's rows zero, against the same A tile:
//! twice the tile unit's work, which it has to spare, for the same vector work. The sums then
//! take the VNNI kernel's integer scaling and its super-block closing (`x86::close`), in its
//! order: the results are bit for bit the VNNI kernel's (a test holds them to it).
//!
//! The integer sums of the sixteen rows stay in registers over a super-block; the float
//! accumulators, touched once per super-block, in a buffer.

use std::arch::x86_64::*;

use super::super::amx::{configure, products2, Buf, ROWS};
use super::super::kquant::{BlockQ8K, KKind};
use super::x86::{
    close, group_bits, group_scales, group_vector, iq4xs_pair, kind_code, q45_pair, sub_scales,
    TILE,
};
use super::{TileKernel, QH5};

/// The AMX kernel for `kind` (callers check [`crate::simd::cpu_has_amx`]); it takes exactly
/// [`ROWS`] activation rows a call.
pub(super) fn amx(kind: KKind) -> TileKernel {
    match kind_code(kind) {
        0 => amx_rows::<0>,
        1 => amx_rows::<1>,
        2 => amx_rows::<2>,
        3 => amx_rows::<3>,
        4 => amx_rows::<4>,
        _ => amx_rows::<5>,
    }
}

/// # Safety
/// [`crate::simd::cpu_has_amx`] holds (and with it the features enabled here); `tiles` holds `nb`
/// tiles of type `T`, `act` and `b32` `r` = [`ROWS`] rows of `nb` blocks; `out + i * stride +
/// l` is writable for `i < r`, `l < lanes ≤ 16`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
unsafe fn amx_rows<const T: u8>(
    tiles: &[u8],
    act: &[BlockQ8K],
    b32: &[[i16; 8]],
    nb: usize,
    r: usize,
    out: *mut f32,
    stride: usize,
    lanes: usize,
) {
    let tb = TILE[T as usize];
    assert!(
        r == ROWS && tiles.len() >= nb * tb && act.len() >= ROWS * nb && b32.len() >= ROWS * nb
    );
    configure();
    let mask = ((1u32 << lanes) - 1) as u16;
    // The rows' float sums, 64 bytes a row.
    let mut acc = Buf([0u8; 64 * ROWS]);
    // Two B tiles (512 bytes each); with group scales, rows 4..8 of the first and 0..4 of the
    // second stay zero.
    let mut weights = Buf([0u8; 1024]);
    let mut sums = Buf([0u8; 2048]);
    let a_stride = nb * std::mem::size_of::<BlockQ8K>();
    let w = weights.0.as_mut_ptr();
    let c = sums.0.as_mut_ptr();
    // SAFETY: `LEVELS_U8` is 16 bytes.
    let lut = _mm512_broadcast_i32x4(unsafe {
        _mm_loadu_si128(super::super::iq4::LEVELS_U8.as_ptr().cast())
    });
    for b in 0..nb {
        // SAFETY: block `b < nb`: a whole tile inside `tiles` (asserted above).
        let t = unsafe { tiles.as_ptr().add(b * tb) };
        // Row 0's quants of super-block `b`; row `i`'s are `i * a_stride` further.
        let a = act[b].qs.as_ptr() as *const u8;
        let mut isum = [_mm512_setzero_si512(); ROWS];
        // Each step: two sub-blocks (`T` 0, 1, 5), or the two halves of one (2, 3, 4).
        let steps: &[usize] = if T < 2 || T == 5 {
            &[0, 2, 4, 6]
        } else {
            &[0, 1, 2, 3, 4, 5, 6, 7]
        };
        for &j in steps {
            let mut scales = [_mm512_setzero_si512(); 2];
            // SAFETY: sub-blocks `j` (and `j + 1`) `< 8` of the tile at `t`; the decoded
            // vectors go to rows `0..8` of the two 512-byte halves of `weights`.
            unsafe {
                if T < 2 || T == 5 {
                    for (h, sc) in scales.iter_mut().enumerate() {
                        let jj = j + h;
                        *sc = sub_scales::<T>(t, jj);
                        let fifth = if T == 1 {
                            _mm512_loadu_si512(t.add(QH5 + 64 * jj).cast())
                        } else {
                            _mm512_setzero_si512()
                        };
                        for p in 0..4 {
                            let (lo, hi) = if T == 5 {
                                iq4xs_pair(t, jj, p, lut)
                            } else {
                                q45_pair::<T>(t, jj, p, fifth)
                            };
                            _mm512_store_si512(w.add(512 * h + 64 * p).cast(), lo);
                            _mm512_store_si512(w.add(512 * h + 64 * (p + 4)).cast(), hi);
                        }
                    }
                } else {
                    let (pair, hb) = group_scales::<T>(t, j);
                    scales = pair;
                    for h in 0..2 {
                        let two = group_bits::<T>(t, j, h);
                        for p in 0..4 {
                            let v = group_vector::<T>(t, j, h, p, two, hb);
                            _mm512_store_si512(w.add(512 * h + 64 * (4 * h + p)).cast(), v);
                        }
                    }
                }
            }
            let (a0, a1) = if T < 2 || T == 5 {
                (32 * j, 32 * (j + 1))
            } else {
                (32 * j, 32 * j)
            };
            // SAFETY: `configure` ran; the A tiles are 32 quants of rows `0..ROWS` of
            // super-block `b` (inside `act`, asserted above); `weights` as written above;
            // `sums` holds two 1 KiB halves.
            unsafe {
                products2(
                    a.add(a0),
                    a.add(a1),
                    a_stride,
                    w,
                    w.add(512),
                    c,
                    c.add(1024),
                )
            };
            for (h, sc) in scales.iter().enumerate() {
                for (i, isum) in isum.iter_mut().enumerate() {
                    // SAFETY: sum row `i` of half `h`: 64 bytes inside `sums`, aligned.
                    let mut s =
                        unsafe { _mm512_load_si512(c.add(1024 * h + 64 * i) as *const __m512i) };
                    if T == 5 {
                        // The levels were taken as `T[u] + 128` (as the VNNI kernel does).
                        let y = -128 * i32::from(b32[i * nb + b][j + h]);
                        s = _mm512_add_epi32(_mm512_set1_epi32(y), s);
                    }
                    *isum = _mm512_add_epi32(*isum, _mm512_mullo_epi32(s, *sc));
                }
            }
        }
        for (i, isum) in isum.iter().enumerate() {
            let at = acc.0.as_mut_ptr().wrapping_add(64 * i);
            // SAFETY: `t` is a whole tile of type `T`; row `i`'s sums are 64 bytes of `acc`.
            unsafe {
                let sum = close::<T>(
                    t,
                    &act[i * nb + b],
                    &b32[i * nb + b],
                    *isum,
                    _mm512_load_ps(at as *const f32),
                );
                _mm512_store_ps(at as *mut f32, sum);
            }
        }
    }
    for i in 0..ROWS {
        // SAFETY: the caller's contract: row `i`'s lanes in `mask` are writable; row `i` of
        // `acc` is 64 bytes.
        unsafe {
            let sum = _mm512_load_ps(acc.0.as_ptr().add(64 * i) as *const f32);
            _mm512_mask_storeu_ps(out.add(i * stride), mask, sum);
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::GgmlDType;

    use super::super::super::kquant::{KKind, QK_K};
    use super::super::super::test_util::{
        assert_same_bits, iq4_xs_weights, no_amx, uniform, weights,
    };
    use super::super::{matmul_many_with, pack, x86, Mat};

    /// Where AMX runs, its products are the VNNI kernel's bit for bit (same integer sums,
    /// same closing of each super-block in the same order), for every kind, one super-block
    /// and three, whole tiles of sixteen rows and a tail of three.
    #[test]
    fn amx_products_are_the_vnni_kernels_bit_for_bit() {
        if no_amx() {
            return;
        }
        let kinds = [
            (KKind::Q2K, GgmlDType::Q2K),
            (KKind::Q3K, GgmlDType::Q3K),
            (KKind::Q4K, GgmlDType::Q4K),
            (KKind::Q5K, GgmlDType::Q5K),
            (KKind::Q6K, GgmlDType::Q6K),
        ];
        let vnni = |kind| (x86::vnni(kind), x86::VNNI_ROWS);
        let mut next = uniform(13);
        for blocks in [1, 3] {
            let (n, k) = (37, blocks * QK_K);
            let vals: Vec<f32> = (0..n * k).map(|_| next()).collect();
            let x: Vec<f32> = (0..35 * k).map(|_| next() * 3.0).collect();
            let mut all: Vec<(KKind, Vec<u8>)> = kinds
                .iter()
                .map(|&(kind, dtype)| (kind, pack(kind, &weights(&vals, n, k, dtype).0, n, k)))
                .collect();
            let xs = iq4_xs_weights(n, k, 0.05, &mut next).0;
            all.push((KKind::Iq4Xs, pack(KKind::Iq4Xs, &xs, n, k)));
            for (kind, tiles) in &all {
                let mat = Mat {
                    kind: *kind,
                    tiles,
                    n,
                };
                for rows in [16, 35] {
                    let x = &x[..rows * k];
                    let one = std::slice::from_ref(&mat);
                    let amx = matmul_many_with(one, k, x, true, vnni).remove(0);
                    let alone = matmul_many_with(one, k, x, false, vnni).remove(0);
                    assert_same_bits(&amx, &alone, &format!("{kind:?} k {k} rows {rows}"));
                }
            }
        }
    }
}
