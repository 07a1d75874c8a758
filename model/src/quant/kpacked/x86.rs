//! The tiled K-quant kernels over [`super::kpacked`]'s layout: AVX-512 VNNI (`vpdpbusd`, one
//! instruction per four elements of sixteen rows and one activation row) and AVX2 (each
//! 512-bit tile vector read as two halves of eight rows, `pmaddubsw` pairs summed in 16 bits
//! and `pmaddwd` with the sub-block scales into 32-bit sums, as llama.cpp's AVX2 K-quant
//! kernels do). Each decoded plane of a tile serves every activation row of the call
//! (`VNNI_ROWS` / `AVX2_ROWS`), their sums held in registers.
//!
//! Overflow bounds (activation quants in `[-127, 127]`): a 16-bit partial sum takes at most
//! two planes (four `pmaddubsw` of Q4_K/Q5_K quants < 32, or two of Q6_K's < 64: ≤ 32,004);
//! a super-block's 32-bit sum stays below 2^29.

use std::arch::x86_64::*;

use super::super::kquant::{BlockQ8K, KKind};
use super::{TileKernel, D, DMIN, HI6, MP, Q45, Q6, QH5, SC, SCP6};

/// Activation rows per call of the AVX-512 kernels.
pub(super) const VNNI_ROWS: usize = 8;
/// Activation rows per call of the AVX2 kernels.
pub(super) const AVX2_ROWS: usize = 4;

const fn kind_code(kind: KKind) -> u8 {
    match kind {
        KKind::Q4K => 0,
        KKind::Q5K => 1,
        _ => 2,
    }
}

const TILE: [usize; 3] = [2368, 2880, 3360];

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
        _ => vnni_rows::<2>,
    }
}

/// The AVX2 kernel for `kind` (callers check `crate::simd::avx2()`).
pub(super) fn avx2(kind: KKind) -> TileKernel {
    match kind_code(kind) {
        0 => avx2_rows::<0>,
        1 => avx2_rows::<1>,
        _ => avx2_rows::<2>,
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
    let m4 = _mm512_set1_epi8(0x0F);
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        let t = tiles[b * tb..(b + 1) * tb].as_ptr();
        // The loads below read at the layout's offsets `at`, all with `at + 64 ≤ tb`.
        // SAFETY: 64 bytes at `at` lie inside this tile.
        let load = |at: usize| unsafe { _mm512_loadu_si512(t.add(at).cast()) };
        // SAFETY: 32 bytes at `at` lie inside this tile.
        let half16 = |at: usize| unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(t.add(at).cast())) };
        // Sixteen rows' pairs of bytes (32 at `at`) as pairs of i16.
        // SAFETY: 32 bytes at `at` lie inside this tile.
        let widen_u8 =
            |at: usize| unsafe { _mm512_cvtepu8_epi16(_mm256_loadu_si256(t.add(at).cast())) };
        // SAFETY: as above.
        let widen_i8 =
            |at: usize| unsafe { _mm512_cvtepi8_epi16(_mm256_loadu_si256(t.add(at).cast())) };
        let ys: [&BlockQ8K; R] = std::array::from_fn(|i| &act[i * nb + b]);
        let q: [*const i32; R] = ys.map(|y| y.qs.as_ptr().cast());
        let mut isum = [_mm512_setzero_si512(); R];
        if T < 2 {
            for j in 0..8 {
                // Decode steps stream the weights from memory.
                prefetch_part(t, tb, j);
                // SAFETY: 16 bytes at `SC + 16j`, inside the tile.
                let sc =
                    _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(t.add(SC + 16 * j).cast()) });
                let h = if T == 1 {
                    load(QH5 + 64 * j)
                } else {
                    _mm512_setzero_si512()
                };
                let mut s = [_mm512_setzero_si512(); R];
                for p in 0..4 {
                    let plane = load(Q45 + 256 * j + 64 * p);
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
            let (d, dmin) = (half16(D), half16(DMIN));
            for i in 0..R {
                let bs: *const i32 = b32[i * nb + b].as_ptr().cast();
                let mut ms = _mm512_setzero_si512();
                for p in 0..4 {
                    // SAFETY: words `p < 4` of eight i16 sums.
                    ms = _mm512_dpwssd_epi32(ms, widen_u8(MP + 32 * p), unsafe { bcast512(bs, p) });
                }
                let yd = _mm512_set1_ps(ys[i].d);
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), _mm512_mul_ps(d, yd), acc[i]);
                acc[i] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ms), _mm512_mul_ps(dmin, yd), acc[i]);
            }
        } else {
            let m30 = _mm512_set1_epi8(0x30);
            for j in 0..8 {
                prefetch_part(t, tb, j);
                let pair = widen_i8(SCP6 + 32 * j);
                for h in 0..2 {
                    let sc = if h == 0 {
                        _mm512_srai_epi32::<16>(_mm512_slli_epi32::<16>(pair))
                    } else {
                        _mm512_srai_epi32::<16>(pair)
                    };
                    let hv = load(HI6 + 128 * j + 64 * h);
                    let mut s = [_mm512_setzero_si512(); R];
                    for p in 0..4 {
                        let plane = load(Q6 + 256 * j + 64 * p);
                        let low = if h == 0 {
                            plane
                        } else {
                            _mm512_srli_epi16::<4>(plane)
                        };
                        // Bits 2p, 2p + 1 of `hv` to bits 4, 5.
                        let up = if p < 2 {
                            _mm512_sll_epi16(hv, _mm_cvtsi32_si128(4 - 2 * p as i32))
                        } else {
                            _mm512_srl_epi16(hv, _mm_cvtsi32_si128(2 * p as i32 - 4))
                        };
                        let v =
                            _mm512_or_si512(_mm512_and_si512(low, m4), _mm512_and_si512(up, m30));
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
            let d = half16(D);
            for i in 0..R {
                let bs: *const i32 = ys[i].bsums.as_ptr().cast();
                let mut off = _mm512_setzero_si512();
                for j in 0..8 {
                    // SAFETY: words `j < 8` of sixteen i16 sums.
                    off = _mm512_dpwssd_epi32(off, widen_i8(SCP6 + 32 * j), unsafe {
                        bcast512(bs, j)
                    });
                }
                // The quants were taken as `q + 32`: less 32 Σ sc_g (sum of group g).
                let s = _mm512_sub_epi32(isum[i], _mm512_slli_epi32::<5>(off));
                let yd = _mm512_set1_ps(ys[i].d);
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, yd), acc[i]);
            }
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        // SAFETY: the caller's contract: lanes in `mask` of row `i` are writable.
        unsafe { _mm512_mask_storeu_ps(out.add(i * stride), mask, *acc) };
    }
}

/// # Safety
/// The CPU has AVX2, FMA and F16C; otherwise as [`vnni_rows`] with `r ≤ 4`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_rows<const T: u8>(
    tiles: &[u8],
    act: &[BlockQ8K],
    b32: &[[i16; 8]],
    nb: usize,
    r: usize,
    out: *mut f32,
    stride: usize,
    lanes: usize,
) {
    // One or two activation rows (decode steps) walk both halves of each tile at once: the
    // tile's lines come from memory once and every byte of them is used while they are in
    // cache, with two independent chains of work per plane. More rows fill the registers
    // with one half, so they take the halves one after the other.
    if r <= 2 && lanes > 8 {
        // SAFETY: the caller's contract is `avx2_tile`'s, for lanes `0..lanes`.
        unsafe {
            match r {
                1 => avx2_tile::<T, 1, 2>(tiles, act, b32, nb, 0, out, stride, lanes),
                _ => avx2_tile::<T, 2, 2>(tiles, act, b32, nb, 0, out, stride, lanes),
            }
        }
        return;
    }
    for half in 0..2 {
        if 8 * half >= lanes {
            break;
        }
        let n = (lanes - 8 * half).min(8);
        // SAFETY: the caller's contract is `avx2_tile`'s, for lanes `8 half..8 half + n`.
        unsafe {
            match r {
                1 => avx2_tile::<T, 1, 1>(tiles, act, b32, nb, half, out, stride, n),
                2 => avx2_tile::<T, 2, 1>(tiles, act, b32, nb, half, out, stride, n),
                3 => avx2_tile::<T, 3, 1>(tiles, act, b32, nb, half, out, stride, n),
                _ => avx2_tile::<T, 4, 1>(tiles, act, b32, nb, half, out, stride, n),
            }
        }
    }
}

/// Broadcast of the 32-bit word `i` at `p`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn bcast256(p: *const i32, i: usize) -> __m256i {
    // SAFETY: the caller passes `i` inside the block `p` points into.
    _mm256_set1_epi32(unsafe { std::ptr::read_unaligned(p.add(i)) })
}

/// Rows `8 first..8 first + n` of a group (`H` halves of eight rows from half `first`)
/// against `R` activation rows.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_tile<const T: u8, const R: usize, const H: usize>(
    tiles: &[u8],
    act: &[BlockQ8K],
    b32: &[[i16; 8]],
    nb: usize,
    first: usize,
    out: *mut f32,
    stride: usize,
    n: usize,
) {
    let tb = TILE[T as usize];
    assert!(tiles.len() >= nb * tb && act.len() >= R * nb && b32.len() >= R * nb);
    assert!(first + H <= 2 && n <= 8 * H);
    let m4 = _mm256_set1_epi8(0x0F);
    let mut acc = [[_mm256_setzero_ps(); H]; R];
    for b in 0..nb {
        let t = tiles[b * tb..(b + 1) * tb].as_ptr();
        // The loads below read at the layout's offsets `at`, all with `at + 64 ≤ tb`, and
        // `first + e < 2`.
        // Half `e`'s 32 bytes of the 64 at `at`.
        // SAFETY: the 32 bytes lie inside this tile.
        let load = |at: usize, e: usize| unsafe {
            _mm256_loadu_si256(t.add(at + 32 * (first + e)).cast())
        };
        // SAFETY: the 16 bytes lie inside this tile.
        let half8 = |at: usize, e: usize| unsafe {
            _mm256_cvtph_ps(_mm_loadu_si128(t.add(at + 16 * (first + e)).cast()))
        };
        // Half `e`'s eight rows' pairs of bytes (16 of the 32 at `at`) as pairs of i16.
        // SAFETY: the 16 bytes lie inside this tile.
        let widen_u8 = |at: usize, e: usize| unsafe {
            _mm256_cvtepu8_epi16(_mm_loadu_si128(t.add(at + 16 * (first + e)).cast()))
        };
        // SAFETY: as above.
        let widen_i8 = |at: usize, e: usize| unsafe {
            _mm256_cvtepi8_epi16(_mm_loadu_si128(t.add(at + 16 * (first + e)).cast()))
        };
        let ys: [&BlockQ8K; R] = std::array::from_fn(|i| &act[i * nb + b]);
        let q: [*const i32; R] = ys.map(|y| y.qs.as_ptr().cast());
        let mut isum = [[_mm256_setzero_si256(); H]; R];
        if T < 2 {
            for j in 0..8 {
                // The first half's pass brings the tile for both.
                if first == 0 {
                    prefetch_part(t, tb, j);
                }
                let sc: [__m256i; H] = std::array::from_fn(|e| {
                    // SAFETY: 8 bytes at `SC + 16j + 8 (first + e)`, inside the tile.
                    let sc = _mm256_cvtepu8_epi32(unsafe {
                        _mm_loadl_epi64(t.add(SC + 16 * j + 8 * (first + e)).cast())
                    });
                    _mm256_or_si256(sc, _mm256_slli_epi32::<16>(sc))
                });
                let h: [__m256i; H] = std::array::from_fn(|e| {
                    if T == 1 {
                        load(QH5 + 64 * j, e)
                    } else {
                        _mm256_setzero_si256()
                    }
                });
                let mut part = [[_mm256_setzero_si256(); H]; R];
                for p in 0..4 {
                    // SAFETY: words `8j + p (+ 4) < 64` of a 256-quant block.
                    let ac: [(__m256i, __m256i); R] = std::array::from_fn(|i| unsafe {
                        (bcast256(q[i], 8 * j + p), bcast256(q[i], 8 * j + p + 4))
                    });
                    for e in 0..H {
                        let plane = load(Q45 + 256 * j + 64 * p, e);
                        let mut lo = _mm256_and_si256(plane, m4);
                        let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(plane), m4);
                        if T == 1 {
                            let bit = _mm256_set1_epi8(0x10);
                            let l = _mm256_sll_epi16(h[e], _mm_cvtsi32_si128(4 - p as i32));
                            let u = _mm256_srl_epi16(h[e], _mm_cvtsi32_si128(p as i32));
                            lo = _mm256_or_si256(lo, _mm256_and_si256(l, bit));
                            hi = _mm256_or_si256(hi, _mm256_and_si256(u, bit));
                        }
                        for i in 0..R {
                            let (a, c) = ac[i];
                            let pq = _mm256_add_epi16(
                                _mm256_maddubs_epi16(lo, a),
                                _mm256_maddubs_epi16(hi, c),
                            );
                            part[i][e] = _mm256_add_epi16(part[i][e], pq);
                        }
                    }
                    if p % 2 == 1 {
                        for i in 0..R {
                            for e in 0..H {
                                let s = _mm256_madd_epi16(part[i][e], sc[e]);
                                isum[i][e] = _mm256_add_epi32(isum[i][e], s);
                                part[i][e] = _mm256_setzero_si256();
                            }
                        }
                    }
                }
            }
            for e in 0..H {
                let (d, dmin) = (half8(D, e), half8(DMIN, e));
                for i in 0..R {
                    let bs: *const i32 = b32[i * nb + b].as_ptr().cast();
                    let mut ms = _mm256_setzero_si256();
                    for p in 0..4 {
                        // SAFETY: words `p < 4` of eight i16 sums.
                        let y = unsafe { bcast256(bs, p) };
                        ms = _mm256_add_epi32(ms, _mm256_madd_epi16(widen_u8(MP + 32 * p, e), y));
                    }
                    let yd = _mm256_set1_ps(ys[i].d);
                    let a = &mut acc[i][e];
                    *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i][e]), _mm256_mul_ps(d, yd), *a);
                    *a = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ms), _mm256_mul_ps(dmin, yd), *a);
                }
            }
        } else {
            let m30 = _mm256_set1_epi8(0x30);
            let lo16 = _mm256_set1_epi32(0xFFFF);
            for j in 0..8 {
                if first == 0 {
                    prefetch_part(t, tb, j);
                }
                let pair: [__m256i; H] = std::array::from_fn(|e| widen_i8(SCP6 + 32 * j, e));
                for h in 0..2 {
                    // Group `2j + h`'s scale in both i16 halves of each lane.
                    let sc: [__m256i; H] = std::array::from_fn(|e| {
                        let p = pair[e];
                        if h == 0 {
                            _mm256_or_si256(_mm256_and_si256(p, lo16), _mm256_slli_epi32::<16>(p))
                        } else {
                            _mm256_or_si256(
                                _mm256_andnot_si256(lo16, p),
                                _mm256_srli_epi32::<16>(p),
                            )
                        }
                    });
                    let hv: [__m256i; H] = std::array::from_fn(|e| load(HI6 + 128 * j + 64 * h, e));
                    let mut part = [[_mm256_setzero_si256(); H]; R];
                    for p in 0..4 {
                        // SAFETY: word `8j + 4h + p < 64` of a 256-quant block.
                        let a: [__m256i; R] =
                            std::array::from_fn(|i| unsafe { bcast256(q[i], 8 * j + 4 * h + p) });
                        for e in 0..H {
                            let plane = load(Q6 + 256 * j + 64 * p, e);
                            let low = if h == 0 {
                                plane
                            } else {
                                _mm256_srli_epi16::<4>(plane)
                            };
                            let up = if p < 2 {
                                _mm256_sll_epi16(hv[e], _mm_cvtsi32_si128(4 - 2 * p as i32))
                            } else {
                                _mm256_srl_epi16(hv[e], _mm_cvtsi32_si128(2 * p as i32 - 4))
                            };
                            let v = _mm256_or_si256(
                                _mm256_and_si256(low, m4),
                                _mm256_and_si256(up, m30),
                            );
                            for i in 0..R {
                                let pq = _mm256_maddubs_epi16(v, a[i]);
                                part[i][e] = _mm256_add_epi16(part[i][e], pq);
                            }
                        }
                        if p % 2 == 1 {
                            for i in 0..R {
                                for e in 0..H {
                                    let s = _mm256_madd_epi16(part[i][e], sc[e]);
                                    isum[i][e] = _mm256_add_epi32(isum[i][e], s);
                                    part[i][e] = _mm256_setzero_si256();
                                }
                            }
                        }
                    }
                }
            }
            for e in 0..H {
                let d = half8(D, e);
                for i in 0..R {
                    let bs: *const i32 = ys[i].bsums.as_ptr().cast();
                    let mut off = _mm256_setzero_si256();
                    for j in 0..8 {
                        // SAFETY: words `j < 8` of sixteen i16 sums.
                        let y = unsafe { bcast256(bs, j) };
                        let w = widen_i8(SCP6 + 32 * j, e);
                        off = _mm256_add_epi32(off, _mm256_madd_epi16(w, y));
                    }
                    let s = _mm256_sub_epi32(isum[i][e], _mm256_slli_epi32::<5>(off));
                    let yd = _mm256_set1_ps(ys[i].d);
                    let a = &mut acc[i][e];
                    *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, yd), *a);
                }
            }
        }
    }
    // SAFETY: the caller's contract: rows `i < R`, lanes `8 first..8 first + n`.
    unsafe { crate::simd::x86::store_lanes(&acc, out, stride, first, n) };
}
