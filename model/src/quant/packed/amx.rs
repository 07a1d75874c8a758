//! AMX tile products over the repacked 32-element block types ([`super`]) for prompts'
//! rows: CPUs with AMX-INT8 (Intel Xeon since Sapphire Rapids), where the kernel path is
//! `amx` ([`crate::simd::amx`]; `auto` keeps to the VNNI kernels, which measured faster).
//!
//! A repacked tile's eight quant vectors are already the weight operand AMX multiplies:
//! vector `i` holds elements `4i..4i + 4` of sixteen rows, four bytes per row, which is a B
//! tile of eight rows of 64 bytes (K = 32, N = 16). Sixteen activation rows' quants of the
//! same block are the A tile (sixteen rows of 32 signed bytes, read in place from the
//! quantized rows, a row stride apart), and one `tdpbsud` (signed A times unsigned B, summed
//! in fours into 32-bit lanes) computes the 16 × 16 block sums the VNNI kernel computes with
//! 128 `vpdpbusd`, on the tile unit beside the vector units. The integer sums then take the
//! VNNI kernel's scale and offset formula in the same order (`acc += cvt(Σ) (d d_y) + m'
//! s_y`), so the results are bit for bit the VNNI kernel's (a test holds them to it): no
//! namespace of stored KV changes with the path.
//!
//! Q8_0 tiles are loaded as they lie in memory; the 4- and 5-bit kinds and IQ4_NL are decoded
//! to bytes by the VNNI kernel's decoding and stored to a 512-byte buffer the tile is loaded
//! from. Two blocks are in flight per step: both products are issued before either's sums
//! are scaled, and the next two blocks are decoded while the tile unit multiplies, so the
//! tile unit works while the vector units decode and scale.
//!
//! The tile registers, their configuration and the products are [`super::super::amx`]'s.

use std::arch::x86_64::*;

use super::super::amx::{configure, products1, products2, Buf, ROWS};
use super::super::BlockQ8;
use super::decode::packed_decode;

/// One group's tiles (`nb` blocks of 16 weight rows, kind `K` as in `avx512::packed_rows`)
/// against [`ROWS`] activation rows (`nb` blocks each, row after row in `act`); row `i`'s 16
/// results go to `out + i * stride` (lanes in `mask`).
///
/// # Safety
/// `crate::simd::cpu_has_amx()` holds (with it the AVX-512 features enabled here); `out + i * stride`
/// is writable for the lanes of `mask`, `i < ROWS`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
pub(super) unsafe fn amx_rows<const K: u8>(
    tiles: &[u8],
    act: &[BlockQ8],
    nb: usize,
    out: *mut f32,
    stride: usize,
    mask: u16,
) {
    let tb = [288, 320, 352, 384, 544, 288][K as usize];
    assert!(tiles.len() >= nb * tb && act.len() >= ROWS * nb);
    configure();
    let mut acc = [_mm512_setzero_ps(); ROWS];
    // Two pairs of blocks' decoded weights (the next pair is decoded while the tile unit
    // multiplies this one) and two pairs' sums; written before they are read, so not
    // zeroed (a memset per call cost ~7 % of a prompt).
    let mut weights = std::mem::MaybeUninit::<Buf<2048>>::uninit();
    let mut sums = std::mem::MaybeUninit::<Buf<4096>>::uninit();
    let (wbuf, c) = (
        weights.as_mut_ptr().cast::<u8>(),
        sums.as_mut_ptr().cast::<u8>(),
    );
    let a_stride = nb * std::mem::size_of::<BlockQ8>();
    // Block `b`'s quants of the first row; the tile's rows follow `a_stride` apart.
    let quants = |b: usize| act[b].qs.as_ptr() as *const u8;
    // Blocks `b` and `b + 1` (where `< nb`) decoded into pair buffer `slot`: each block's
    // weight rows (B tile) and scales.
    let decode = |b: usize, slot: usize| {
        let mut scales = [(_mm512_setzero_ps(), _mm512_setzero_ps()); 2];
        let mut w = [std::ptr::null::<u8>(); 2];
        for h in 0..2.min(nb - b) {
            // SAFETY: block `b + h < nb` of the group: a whole tile inside `tiles` (asserted
            // above); the decoded vectors go to 512 bytes of `weights` (aligned).
            unsafe {
                let t = tiles.as_ptr().add((b + h) * tb);
                let (v, d, m) = packed_decode::<K>(t);
                scales[h] = (d, m);
                w[h] = if K == 4 {
                    // Q8_0: the tile's eight vectors, as they lie.
                    t.add(32)
                } else {
                    let dst = wbuf.add(1024 * slot + 512 * h);
                    for (i, v) in v.iter().enumerate() {
                        _mm512_store_si512(dst.add(64 * i) as *mut _, *v);
                    }
                    dst
                };
            }
        }
        (scales, w)
    };
    // Pair `p`'s sums (half `p % 2` of `sums`) are scaled while the tile unit computes pair
    // `p + 1`'s: the vector units never wait on a tile store just issued. Blocks are still
    // scaled in order, so the sums of floats are the VNNI kernel's.
    let scale_pair = |acc: &mut [__m512; ROWS], b: usize, scales: &[(__m512, __m512); 2]| {
        let c = c.wrapping_add(2048 * (b / 2 % 2));
        for (h, &(d, m)) in scales.iter().enumerate().take(2.min(nb - b)) {
            for (i, acc) in acc.iter_mut().enumerate() {
                // SAFETY: row `i < ROWS` of block `b + h < nb`: inside `act` (asserted);
                // sum row `i` of block `h` of the pair: 64 bytes of `sums` the tile store
                // wrote, aligned.
                let (y, s) = unsafe {
                    (
                        act.get_unchecked(i * nb + b + h),
                        _mm512_load_si512(c.add(1024 * h + 64 * i) as *const _),
                    )
                };
                // The VNNI kernel's formula, in its order (`avx512::packed_tile`).
                let scale = _mm512_mul_ps(d, _mm512_set1_ps(y.d));
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, *acc);
                *acc = _mm512_fmadd_ps(m, _mm512_set1_ps(y.s), *acc);
            }
        }
    };
    let mut next = decode(0, 0);
    let mut pending = None;
    let mut b = 0;
    while b < nb {
        let (scales, w) = next;
        let c = c.wrapping_add(2048 * (b / 2 % 2));
        // SAFETY: `configure` ran; the A tiles are blocks `b` (and `b + 1`) of rows
        // `0..ROWS`, inside `act` (asserted above); `w` as decoded; this pair's half of
        // `sums` is 2 KiB.
        unsafe {
            if b + 1 < nb {
                let (a0, a1) = (quants(b), quants(b + 1));
                products2(a0, a1, a_stride, w[0], w[1], c, c.add(1024));
            } else {
                products1(quants(b), a_stride, w[0], c);
            }
        }
        if b + 2 < nb {
            next = decode(b + 2, (b / 2 + 1) % 2);
        }
        if let Some((pb, ps)) = pending.replace((b, scales)) {
            scale_pair(&mut acc, pb, &ps);
        }
        b += 2;
    }
    if let Some((pb, ps)) = pending {
        scale_pair(&mut acc, pb, &ps);
    }
    for (i, acc) in acc.iter().enumerate() {
        // SAFETY: the caller's contract: row `i`'s lanes in `mask` are writable.
        unsafe { _mm512_mask_storeu_ps(out.add(i * stride), mask, *acc) };
    }
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::GgmlDType;

    use super::super::super::test_util::{
        assert_same_bits, iq4_nl_weights, no_amx, uniform, weights,
    };
    use super::super::super::{Kind, QK};
    use super::super::Packed;

    /// Where AMX runs, its products are the VNNI kernel's bit for bit (same integer sums,
    /// same scaling in the same order), for every kind, an odd and an even number of blocks
    /// (the last block alone or in a pair), whole tiles of sixteen rows and a tail.
    #[test]
    fn amx_products_are_the_vnni_kernels_bit_for_bit() {
        if no_amx() {
            return;
        }
        let kinds = [
            (Kind::Q4_0, Some(GgmlDType::Q4_0)),
            (Kind::Q4_1, Some(GgmlDType::Q4_1)),
            (Kind::Q5_0, Some(GgmlDType::Q5_0)),
            (Kind::Q5_1, Some(GgmlDType::Q5_1)),
            (Kind::Q8_0, Some(GgmlDType::Q8_0)),
            (Kind::Iq4Nl, None),
        ];
        let mut next = uniform(11);
        for k in [3 * QK, 4 * QK, 28 * QK] {
            let n = 37;
            let vals: Vec<f32> = (0..n * k).map(|_| next()).collect();
            let x: Vec<f32> = (0..35 * k).map(|_| next() * 3.0).collect();
            for (kind, dtype) in kinds {
                let w = match dtype {
                    Some(dtype) => weights(&vals, n, k, dtype).0,
                    None => iq4_nl_weights(&vals, n, k).0,
                };
                let p = Packed::new(kind, &w, n, k);
                for rows in [16, 35] {
                    let x = &x[..rows * k];
                    let (amx, vnni) = (p.matmul_vnni(x, true), p.matmul_vnni(x, false));
                    assert_same_bits(&amx, &vnni, &format!("{kind:?} k {k} rows {rows}"));
                }
            }
        }
    }
}
