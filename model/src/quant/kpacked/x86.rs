//! The tiled K-quant kernels over [`super::kpacked`]'s layout: AVX-512 VNNI (`vpdpbusd`, one
//! instruction per four elements of sixteen rows and one activation row) and AVX2 (each
//! 512-bit tile vector read as two halves of eight rows, `pmaddubsw` pairs summed in 16 bits
//! and `pmaddwd` with the sub-block scales into 32-bit sums, as llama.cpp's AVX2 K-quant
//! kernels do; in `x86/avx2.rs`). Each decoded plane of a tile serves every activation row of
//! the call (`VNNI_ROWS` / `AVX2_ROWS`), their sums held in registers.
//!
//! Overflow bounds (activation quants in `[-127, 127]`): a 16-bit partial sum takes at most
//! two planes (four `pmaddubsw` of Q4_K/Q5_K quants < 32, or two of Q6_K's < 64: ≤ 32,004),
//! or four of Q2_K's and Q3_K's (< 8: ≤ 7,112); IQ4_XS's levels (|level| ≤ 127) go from each
//! `pmaddubsw` (≤ 32,258) straight to `pmaddwd`. A super-block's 32-bit sum stays below 2^29
//! (IQ4_XS: below 2^28, eight sub-blocks of ≤ 32 · 127² times a scale ≤ 32).

use std::arch::x86_64::*;

use super::super::kquant::{BlockQ8K, KKind};
use super::{
    TileKernel, D, DMIN, HB3, HI6, LO2, LO3, MP, Q45, Q6, QH5, QX, SC, SCP3, SCP6, SM2, SX,
};

mod avx2;

/// Activation rows per call of the AVX-512 kernels.
pub(super) const VNNI_ROWS: usize = 8;
/// Activation rows per call of the AVX2 kernels.
pub(super) const AVX2_ROWS: usize = 4;

/// The kernels' numbering of the kinds (their `T`).
pub(super) const fn kind_code(kind: KKind) -> u8 {
    match kind {
        KKind::Q4K => 0,
        KKind::Q5K => 1,
        KKind::Q6K => 2,
        KKind::Q3K => 3,
        KKind::Q2K => 4,
        KKind::Iq4Xs => 5,
    }
}

/// Tile bytes by `T` (`super::tile_bytes`).
pub(super) const TILE: [usize; 6] = [2368, 2880, 3360, 1824, 1344, 2208];

/// Tiles ahead of the one being multiplied that are prefetched.
const PREFETCH: usize = 4;

/// Prefetches part `j` of 8 of the tile [`PREFETCH`] tiles after the one at `t` (`tb` bytes
/// each): a few lines per sub-block, spread over the tile's work. Prefetching a whole tile at
/// once (37-53 lines in a burst) held the core's miss buffers ahead of the demand loads:
/// the decode-shaped Q4_K product from memory ran at 23 GB/s with the burst, 33 without any
/// prefetch, on a VM whose plain multi-threaded reads of the same bytes reach 34.
#[inline(always)]
fn prefetch_part(t: *const u8, tb: usize, j: usize) {
    let lines = tb.div_ceil(64);
    let ahead = t.wrapping_add(PREFETCH * tb);
    for l in j * lines / 8..(j + 1) * lines / 8 {
        // SAFETY: a prefetch reads nothing and cannot fault.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * l).cast()) };
    }
}

macro_rules! by_rows {
    ($f:ident, $t:expr, $r:expr, $($arg:expr),*) => {
        match $r {
            1 => $f::<$t, 1>($($arg),*),
            2 => $f::<$t, 2>($($arg),*),
            3 => $f::<$t, 3>($($arg),*),
            4 => $f::<$t, 4>($($arg),*),
            5 => $f::<$t, 5>($($arg),*),
            6 => $f::<$t, 6>($($arg),*),
            7 => $f::<$t, 7>($($arg),*),
            _ => $f::<$t, 8>($($arg),*),
        }
    };
}

/// The AVX-512 VNNI kernel for `kind` (callers check `super::super::avx512_vnni()`).
pub(super) fn vnni(kind: KKind) -> TileKernel {
    match kind_code(kind) {
        0 => vnni_rows::<0>,
        1 => vnni_rows::<1>,
        2 => vnni_rows::<2>,
        3 => vnni_rows::<3>,
        4 => vnni_rows::<4>,
        _ => vnni_rows::<5>,
    }
}

/// The AVX2 kernel for `kind` (callers check `crate::simd::avx2()`).
pub(super) fn avx2(kind: KKind) -> TileKernel {
    match kind_code(kind) {
        0 => avx2::rows::<0>,
        1 => avx2::rows::<1>,
        2 => avx2::rows::<2>,
        3 => avx2::rows::<3>,
        4 => avx2::rows::<4>,
        _ => avx2::rows::<5>,
    }
}

/// # Safety
/// The CPU has AVX-512 F/BW/VNNI and F16C; `tiles` holds `nb` tiles of type `T`, `act` and
/// `b32` `r ≤ 8` rows of `nb` blocks; `out + i * stride + l` is writable for `i < r`, `l <
/// lanes ≤ 16`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
unsafe fn vnni_rows<const T: u8>(
    tiles: &[u8],
    act: &[BlockQ8K],
    b32: &[[i16; 8]],
    nb: usize,
    r: usize,
    out: *mut f32,
    stride: usize,
    lanes: usize,
) {
    let mask = ((1u32 << lanes) - 1) as u16;
    // SAFETY: the caller's contract is `vnni_tile`'s.
    unsafe { by_rows!(vnni_tile, T, r, tiles, act, b32, nb, out, stride, mask) }
}

/// Broadcast of the 32-bit word `i` at `p` (four activation quants, or two i16 sums).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn bcast512(p: *const i32, i: usize) -> __m512i {
    // SAFETY: the caller passes `i` inside the block `p` points into.
    _mm512_set1_epi32(unsafe { std::ptr::read_unaligned(p.add(i)) })
}

// Sub-block and row indices address several arrays in step (`s`, `isum`, `b32`).
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
unsafe fn vnni_tile<const T: u8, const R: usize>(
    tiles: &[u8],
    act: &[BlockQ8K],
    b32: &[[i16; 8]],
    nb: usize,
    out: *mut f32,
    stride: usize,
    mask: u16,
) {
    let tb = TILE[T as usize];
    assert!(tiles.len() >= nb * tb && act.len() >= R * nb && b32.len() >= R * nb);
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        let t = tiles[b * tb..(b + 1) * tb].as_ptr();
        // The loads below read at the layout's offsets `at`, all with `at + 64 ≤ tb`.
        // SAFETY: 64 bytes at `at` lie inside this tile.
        let load = |at: usize| unsafe { _mm512_loadu_si512(t.add(at).cast()) };
        let ys: [&BlockQ8K; R] = std::array::from_fn(|i| &act[i * nb + b]);
        let q: [*const i32; R] = ys.map(|y| y.qs.as_ptr().cast());
        let mut isum = [_mm512_setzero_si512(); R];
        if T == 5 {
            // IQ4_XS: each index to its level + 128 (`vpshufb` within each 128-bit lane).
            // SAFETY: `LEVELS_U8` is 16 bytes.
            let lut = _mm512_broadcast_i32x4(unsafe {
                _mm_loadu_si128(super::super::iq4::LEVELS_U8.as_ptr().cast())
            });
            for j in 0..8 {
                prefetch_part(t, tb, j);
                // SAFETY: sub-block `j < 8` of this tile.
                let sc = unsafe { sub_scales::<T>(t, j) };
                // The sums start at -128 times the activations' sum over the sub-block: the
                // levels were taken as `T[u] + 128`.
                let mut s: [__m512i; R] = std::array::from_fn(|i| {
                    _mm512_set1_epi32(-128 * i32::from(b32[i * nb + b][j]))
                });
                for p in 0..4 {
                    // SAFETY: sub-block `j < 8`, plane `p < 4` of this tile.
                    let (lo, hi) = unsafe { iq4xs_pair(t, j, p, lut) };
                    for i in 0..R {
                        // SAFETY: words `8j + p (+ 4) < 64` of a 256-quant block.
                        let (a, c) =
                            unsafe { (bcast512(q[i], 8 * j + p), bcast512(q[i], 8 * j + p + 4)) };
                        s[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s[i], lo, a), hi, c);
                    }
                }
                for i in 0..R {
                    isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(s[i], sc));
                }
            }
        } else if T < 2 {
            for j in 0..8 {
                // Decode steps stream the weights from memory.
                prefetch_part(t, tb, j);
                // SAFETY: sub-block `j < 8` of this tile.
                let sc = unsafe { sub_scales::<T>(t, j) };
                let h = if T == 1 {
                    load(QH5 + 64 * j)
                } else {
                    _mm512_setzero_si512()
                };
                let mut s = [_mm512_setzero_si512(); R];
                for p in 0..4 {
                    // SAFETY: sub-block `j < 8`, plane `p < 4` of this tile.
                    let (lo, hi) = unsafe { q45_pair::<T>(t, j, p, h) };
                    for i in 0..R {
                        // SAFETY: words `8j + p (+ 4) < 64` of a 256-quant block.
                        let (a, c) =
                            unsafe { (bcast512(q[i], 8 * j + p), bcast512(q[i], 8 * j + p + 4)) };
                        s[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s[i], lo, a), hi, c);
                    }
                }
                for i in 0..R {
                    isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(s[i], sc));
                }
            }
        } else {
            // Q6_K, Q3_K, Q2_K: a scale per 16-element group (vectors 0-3 and 4-7 of a
            // sub-block), a pair of them per row.
            for j in 0..8 {
                prefetch_part(t, tb, j);
                // SAFETY: sub-block `j < 8` of this tile.
                let (scales, hb) = unsafe { group_scales::<T>(t, j) };
                for (h, sc) in scales.into_iter().enumerate() {
                    // SAFETY: as above, half `h < 2`.
                    let two = unsafe { group_bits::<T>(t, j, h) };
                    let mut s = [_mm512_setzero_si512(); R];
                    for p in 0..4 {
                        // SAFETY: as above, vector `p < 4` of the half.
                        let v = unsafe { group_vector::<T>(t, j, h, p, two, hb) };
                        for i in 0..R {
                            // SAFETY: word `8j + 4h + p < 64` of a 256-quant block.
                            let a = unsafe { bcast512(q[i], 8 * j + 4 * h + p) };
                            s[i] = _mm512_dpbusd_epi32(s[i], v, a);
                        }
                    }
                    for i in 0..R {
                        isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(s[i], sc));
                    }
                }
            }
        }
        for i in 0..R {
            // SAFETY: `t` is a whole tile of type `T`.
            acc[i] = unsafe { close::<T>(t, ys[i], &b32[i * nb + b], isum[i], acc[i]) };
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        // SAFETY: the caller's contract: lanes in `mask` of row `i` are writable.
        unsafe { _mm512_mask_storeu_ps(out.add(i * stride), mask, *acc) };
    }
}

// The pieces of a tile both the VNNI kernel above and the AMX kernel (`super::amx`) decode
// and close with, so the two compute the same integers and round them the same way.

/// Vectors `p` and `p + 4` of sub-block `j` of a Q4_K (`T` 0) or Q5_K (`T` 1) tile, as
/// unsigned quants; `h` the sub-block's fifth bits (Q5_K: the 64 bytes at `QH5 + 64 j`).
///
/// # Safety
/// `t` is a whole tile of type `T`; `j < 8`, `p < 4`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn q45_pair<const T: u8>(
    t: *const u8,
    j: usize,
    p: usize,
    h: __m512i,
) -> (__m512i, __m512i) {
    let m4 = _mm512_set1_epi8(0x0F);
    // SAFETY: plane `p` of sub-block `j` lies inside the tile (the caller's contract).
    let plane = unsafe { _mm512_loadu_si512(t.add(Q45 + 256 * j + 64 * p).cast()) };
    let mut lo = _mm512_and_si512(plane, m4);
    let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(plane), m4);
    if T == 1 {
        // Vector `p`'s fifth bit (bit p) and vector `p + 4`'s to bit 4.
        let bit = _mm512_set1_epi8(0x10);
        let l = _mm512_sll_epi16(h, _mm_cvtsi32_si128(4 - p as i32));
        let u = _mm512_srl_epi16(h, _mm_cvtsi32_si128(p as i32));
        lo = _mm512_ternarylogic_epi32::<0xF8>(lo, l, bit);
        hi = _mm512_ternarylogic_epi32::<0xF8>(hi, u, bit);
    }
    (lo, hi)
}

/// Sub-block `j`'s scales of a Q4_K, Q5_K (`T` 0, 1: unsigned) or IQ4_XS (5: signed, less
/// 32) tile, one i32 per row.
///
/// # Safety
/// `t` is a whole tile of type `T`; `j < 8`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn sub_scales<const T: u8>(t: *const u8, j: usize) -> __m512i {
    if T == 5 {
        // SAFETY: 16 bytes at `SX + 16 j`, inside the tile.
        _mm512_cvtepi8_epi32(unsafe { _mm_loadu_si128(t.add(SX + 16 * j).cast()) })
    } else {
        // SAFETY: 16 bytes at `SC + 16 j`, inside the tile.
        _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(t.add(SC + 16 * j).cast()) })
    }
}

/// Vectors `p` and `p + 4` of sub-block `j` of an IQ4_XS tile, each index turned into its
/// level + 128 by `lut` (`iq4::LEVELS_U8` in every 128-bit lane).
///
/// # Safety
/// `t` is a whole IQ4_XS tile; `j < 8`, `p < 4`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn iq4xs_pair(
    t: *const u8,
    j: usize,
    p: usize,
    lut: __m512i,
) -> (__m512i, __m512i) {
    let m4 = _mm512_set1_epi8(0x0F);
    // SAFETY: plane `p` of sub-block `j` lies inside the tile (the caller's contract).
    let plane = unsafe { _mm512_loadu_si512(t.add(QX + 256 * j + 64 * p).cast()) };
    let lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(plane, m4));
    let hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16::<4>(plane), m4));
    (lo, hi)
}

/// Sub-block `j`'s two group scales of a Q6_K (`T` 2), Q3_K (3) or Q2_K (4) tile, one i32
/// per row, and Q3_K's third bits of the sub-block (zero for the others).
///
/// # Safety
/// `t` is a whole tile of type `T`; `j < 8`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn group_scales<const T: u8>(t: *const u8, j: usize) -> ([__m512i; 2], __m512i) {
    // SAFETY: 32 bytes of pairs at `SCP6/SCP3/SM2 + 32 j`, and Q3_K's 64 bytes at `HB3 +
    // 64 j`, lie inside the tile (the caller's contract).
    unsafe {
        let at = |o: usize| _mm256_loadu_si256(t.add(o + 32 * j).cast());
        let pair = match T {
            2 => _mm512_cvtepi8_epi16(at(SCP6)),
            3 => _mm512_cvtepi8_epi16(at(SCP3)),
            _ => _mm512_and_si512(_mm512_cvtepu8_epi16(at(SM2)), _mm512_set1_epi16(0x0F)),
        };
        let hb = if T == 3 {
            _mm512_loadu_si512(t.add(HB3 + 64 * j).cast())
        } else {
            _mm512_setzero_si512()
        };
        let scales = [
            _mm512_srai_epi32::<16>(_mm512_slli_epi32::<16>(pair)),
            _mm512_srai_epi32::<16>(pair),
        ];
        (scales, hb)
    }
}

/// Two bits of each of vectors `4h..4h + 4` of sub-block `j`: Q6_K's high ones, the low ones
/// of Q3_K and Q2_K.
///
/// # Safety
/// `t` is a whole tile of type `T` (2, 3 or 4); `j < 8`, `h < 2`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn group_bits<const T: u8>(t: *const u8, j: usize, h: usize) -> __m512i {
    let at = group_bits_at(T, j, h);
    // SAFETY: 64 bytes at `at` lie inside the tile (the caller's contract).
    unsafe { _mm512_loadu_si512(t.add(at).cast()) }
}

/// Where [`group_bits`] of sub-block `j`, half `h` lie in a tile of type `t` (2, 3 or 4).
pub(super) const fn group_bits_at(t: u8, j: usize, h: usize) -> usize {
    let base = match t {
        2 => HI6,
        3 => LO3,
        _ => LO2,
    };
    base + 128 * j + 64 * h
}

/// Vector `4h + p` of sub-block `j` of a Q6_K, Q3_K or Q2_K tile as unsigned quants, from
/// the half's [`group_bits`] `two` and Q3_K's third bits `hb` ([`group_scales`]).
///
/// # Safety
/// `t` is a whole tile of type `T` (2, 3 or 4); `j < 8`, `h < 2`, `p < 4`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn group_vector<const T: u8>(
    t: *const u8,
    j: usize,
    h: usize,
    p: usize,
    two: __m512i,
    hb: __m512i,
) -> __m512i {
    let (m4, m3, m30, bit2) = (
        _mm512_set1_epi8(0x0F),
        _mm512_set1_epi8(0x03),
        _mm512_set1_epi8(0x30),
        _mm512_set1_epi8(0x04),
    );
    if T == 2 {
        // SAFETY: Q6_K's plane `p` of sub-block `j` lies inside the tile.
        let plane = unsafe { _mm512_loadu_si512(t.add(Q6 + 256 * j + 64 * p).cast()) };
        let low = if h == 0 {
            plane
        } else {
            _mm512_srli_epi16::<4>(plane)
        };
        // Bits 2p, 2p + 1 of `two` to bits 4, 5.
        let up = if p < 2 {
            _mm512_sll_epi16(two, _mm_cvtsi32_si128(4 - 2 * p as i32))
        } else {
            _mm512_srl_epi16(two, _mm_cvtsi32_si128(2 * p as i32 - 4))
        };
        return _mm512_or_si512(_mm512_and_si512(low, m4), _mm512_and_si512(up, m30));
    }
    let low = _mm512_and_si512(_mm512_srl_epi16(two, _mm_cvtsi32_si128(2 * p as i32)), m3);
    if T != 3 {
        return low;
    }
    // Vector `4h + p`'s third bit (bit 4h + p of `hb`) to bit 2.
    let i = (4 * h + p) as i32;
    let up = if i >= 2 {
        _mm512_srl_epi16(hb, _mm_cvtsi32_si128(i - 2))
    } else {
        _mm512_sll_epi16(hb, _mm_cvtsi32_si128(2 - i))
    };
    _mm512_ternarylogic_epi32::<0xF8>(low, up, bit2)
}

/// One activation row's `acc` after a super-block of type `T`: its integer sums over the
/// sub-blocks (`isum`, sixteen rows' lanes, scales applied) to floats with the tile's `d`,
/// and the minimums (Q4_K, Q5_K, Q2_K) or quant offsets (Q6_K, Q3_K) through the row's
/// activation sums (`y.bsums`, `b32` the same per 32).
///
/// # Safety
/// `t` is a whole tile of type `T`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
pub(super) unsafe fn close<const T: u8>(
    t: *const u8,
    y: &BlockQ8K,
    b32: &[i16; 8],
    isum: __m512i,
    acc: __m512,
) -> __m512 {
    // SAFETY: every offset read below lies inside a tile of type `T` (the module's table);
    // the broadcasts read words of `y.bsums` (sixteen i16) and `b32` (eight).
    unsafe {
        let half16 = |at: usize| _mm512_cvtph_ps(_mm256_loadu_si256(t.add(at).cast()));
        let widen_u8 = |at: usize| _mm512_cvtepu8_epi16(_mm256_loadu_si256(t.add(at).cast()));
        let widen_i8 = |at: usize| _mm512_cvtepi8_epi16(_mm256_loadu_si256(t.add(at).cast()));
        let d = half16(D);
        let yd = _mm512_set1_ps(y.d);
        if T == 5 {
            return _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, yd), acc);
        }
        if T < 2 {
            let bs: *const i32 = b32.as_ptr().cast();
            let mut ms = _mm512_setzero_si512();
            for p in 0..4 {
                ms = _mm512_dpwssd_epi32(ms, widen_u8(MP + 32 * p), bcast512(bs, p));
            }
            let dmin = half16(DMIN);
            let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, yd), acc);
            return _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ms), _mm512_mul_ps(dmin, yd), acc);
        }
        let bs: *const i32 = y.bsums.as_ptr().cast();
        // Σ_g w_g (sum of group g): Q2_K's minimums, else the scales.
        let mut off = _mm512_setzero_si512();
        for j in 0..8 {
            let w = match T {
                2 => widen_i8(SCP6 + 32 * j),
                3 => widen_i8(SCP3 + 32 * j),
                _ => _mm512_srli_epi16::<4>(widen_u8(SM2 + 32 * j)),
            };
            off = _mm512_dpwssd_epi32(off, w, bcast512(bs, j));
        }
        let s = match T {
            // The quants were taken as `q + 32` (Q6_K), `q + 4` (Q3_K).
            2 => _mm512_sub_epi32(isum, _mm512_slli_epi32::<5>(off)),
            3 => _mm512_sub_epi32(isum, _mm512_slli_epi32::<2>(off)),
            _ => isum,
        };
        let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, yd), acc);
        if T == 4 {
            let dmin = half16(DMIN);
            return _mm512_fnmadd_ps(_mm512_cvtepi32_ps(off), _mm512_mul_ps(dmin, yd), acc);
        }
        acc
    }
}
