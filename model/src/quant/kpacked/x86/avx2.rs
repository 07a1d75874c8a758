//! The AVX2 kernels of [`super`]: each 512-bit tile vector read as two halves of eight rows,
//! `pmaddubsw` pairs summed in 16 bits and `pmaddwd` with the scales into 32-bit sums.

use std::arch::x86_64::*;

use super::super::super::kquant::BlockQ8K;
use super::{prefetch_part, D, DMIN, HB3, MP, Q45, Q6, QH5, QX, SC, SCP3, SCP6, SM2, SX, TILE};

/// # Safety
/// The CPU has AVX2, FMA and F16C; otherwise as [`super::vnni_rows`] with `r ≤ 4`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn rows<const T: u8>(
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
        // SAFETY: the caller's contract is `tile`'s, for lanes `0..lanes`.
        unsafe {
            match r {
                1 => tile::<T, 1, 2>(tiles, act, b32, nb, 0, out, stride, lanes),
                _ => tile::<T, 2, 2>(tiles, act, b32, nb, 0, out, stride, lanes),
            }
        }
        return;
    }
    for half in 0..2 {
        if 8 * half >= lanes {
            break;
        }
        let n = (lanes - 8 * half).min(8);
        // SAFETY: the caller's contract is `tile`'s, for lanes `8 half..8 half + n`.
        unsafe {
            match r {
                1 => tile::<T, 1, 1>(tiles, act, b32, nb, half, out, stride, n),
                2 => tile::<T, 2, 1>(tiles, act, b32, nb, half, out, stride, n),
                3 => tile::<T, 3, 1>(tiles, act, b32, nb, half, out, stride, n),
                _ => tile::<T, 4, 1>(tiles, act, b32, nb, half, out, stride, n),
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

/// The 16-bit partial sums `part` of each row and half, times the scales `sc` (a pair of i16
/// per 32-bit lane), into the 32-bit sums `isum`; `part` starts again from zero.
#[inline]
#[target_feature(enable = "avx2")]
fn flush<const R: usize, const H: usize>(
    part: &mut [[__m256i; H]; R],
    sc: &[__m256i; H],
    isum: &mut [[__m256i; H]; R],
) {
    for (part, isum) in part.iter_mut().zip(isum.iter_mut()) {
        for ((p, s), sc) in part.iter_mut().zip(isum.iter_mut()).zip(sc) {
            *s = _mm256_add_epi32(*s, _mm256_madd_epi16(*p, *sc));
            *p = _mm256_setzero_si256();
        }
    }
}

/// Rows `8 first..8 first + n` of a group (`H` halves of eight rows from half `first`)
/// against `R` activation rows.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const T: u8, const R: usize, const H: usize>(
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
        if T == 5 {
            // IQ4_XS: each index to its signed level, multiplied as `|w|` times the
            // activation with `w`'s sign (a level times a quant fits `pmaddubsw`'s pairs
            // once, not twice: each pair goes to `pmaddwd` with the sub-block scale at once).
            // SAFETY: `LEVELS` is 16 bytes.
            let lut = _mm256_broadcastsi128_si256(unsafe {
                _mm_loadu_si128(super::super::super::iq4::LEVELS.as_ptr().cast())
            });
            let lo16 = _mm256_set1_epi32(0xFFFF);
            for j in 0..8 {
                if first == 0 {
                    prefetch_part(t, tb, j);
                }
                // Sub-block `j`'s scale in both i16 halves of each row's lane.
                let sc: [__m256i; H] = std::array::from_fn(|e| {
                    // SAFETY: 8 bytes at `SX + 16j + 8 (first + e)`, inside the tile.
                    let s = _mm256_cvtepi8_epi32(unsafe {
                        _mm_loadl_epi64(t.add(SX + 16 * j + 8 * (first + e)).cast())
                    });
                    _mm256_or_si256(_mm256_and_si256(s, lo16), _mm256_slli_epi32::<16>(s))
                });
                for p in 0..4 {
                    // SAFETY: words `8j + p (+ 4) < 64` of a 256-quant block.
                    let ac: [(__m256i, __m256i); R] = std::array::from_fn(|i| unsafe {
                        (bcast256(q[i], 8 * j + p), bcast256(q[i], 8 * j + p + 4))
                    });
                    for e in 0..H {
                        let plane = load(QX + 256 * j + 64 * p, e);
                        let lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(plane, m4));
                        let hi = _mm256_shuffle_epi8(
                            lut,
                            _mm256_and_si256(_mm256_srli_epi16::<4>(plane), m4),
                        );
                        let (alo, ahi) = (_mm256_abs_epi8(lo), _mm256_abs_epi8(hi));
                        for i in 0..R {
                            let (a, c) = ac[i];
                            let x = _mm256_maddubs_epi16(alo, _mm256_sign_epi8(a, lo));
                            let y = _mm256_maddubs_epi16(ahi, _mm256_sign_epi8(c, hi));
                            let xy = _mm256_add_epi32(
                                _mm256_madd_epi16(x, sc[e]),
                                _mm256_madd_epi16(y, sc[e]),
                            );
                            isum[i][e] = _mm256_add_epi32(isum[i][e], xy);
                        }
                    }
                }
            }
            for e in 0..H {
                let d = half8(D, e);
                for i in 0..R {
                    let yd = _mm256_set1_ps(ys[i].d);
                    let a = &mut acc[i][e];
                    *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i][e]), _mm256_mul_ps(d, yd), *a);
                }
            }
        } else if T < 2 {
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
                        flush(&mut part, &sc, &mut isum);
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
            // Q6_K, Q3_K, Q2_K: a scale per 16-element group, a pair of them per row.
            let (m3, m30, bit2) = (
                _mm256_set1_epi8(0x03),
                _mm256_set1_epi8(0x30),
                _mm256_set1_epi8(0x04),
            );
            let lo16 = _mm256_set1_epi32(0xFFFF);
            // Row pairs of group scales (`scp`, `sm`'s low nibbles) or of Q2_K's minimums.
            let pairs = |j: usize, e: usize, mins: bool| match T {
                2 => widen_i8(SCP6 + 32 * j, e),
                3 => widen_i8(SCP3 + 32 * j, e),
                _ if mins => _mm256_srli_epi16::<4>(widen_u8(SM2 + 32 * j, e)),
                _ => _mm256_and_si256(widen_u8(SM2 + 32 * j, e), _mm256_set1_epi16(0x0F)),
            };
            for j in 0..8 {
                if first == 0 {
                    prefetch_part(t, tb, j);
                }
                let pair: [__m256i; H] = std::array::from_fn(|e| pairs(j, e, false));
                let hb: [__m256i; H] = std::array::from_fn(|e| {
                    if T == 3 {
                        load(HB3 + 64 * j, e)
                    } else {
                        _mm256_setzero_si256()
                    }
                });
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
                    let at = super::group_bits_at(T, j, h);
                    let two: [__m256i; H] = std::array::from_fn(|e| load(at, e));
                    let mut part = [[_mm256_setzero_si256(); H]; R];
                    for p in 0..4 {
                        // SAFETY: word `8j + 4h + p < 64` of a 256-quant block.
                        let a: [__m256i; R] =
                            std::array::from_fn(|i| unsafe { bcast256(q[i], 8 * j + 4 * h + p) });
                        for e in 0..H {
                            let v = if T == 2 {
                                let plane = load(Q6 + 256 * j + 64 * p, e);
                                let low = if h == 0 {
                                    plane
                                } else {
                                    _mm256_srli_epi16::<4>(plane)
                                };
                                let up = if p < 2 {
                                    _mm256_sll_epi16(two[e], _mm_cvtsi32_si128(4 - 2 * p as i32))
                                } else {
                                    _mm256_srl_epi16(two[e], _mm_cvtsi32_si128(2 * p as i32 - 4))
                                };
                                _mm256_or_si256(
                                    _mm256_and_si256(low, m4),
                                    _mm256_and_si256(up, m30),
                                )
                            } else {
                                let shift = _mm_cvtsi32_si128(2 * p as i32);
                                let low = _mm256_and_si256(_mm256_srl_epi16(two[e], shift), m3);
                                if T == 3 {
                                    // Vector `4h + p`'s third bit to bit 2.
                                    let i = (4 * h + p) as i32;
                                    let up = if i >= 2 {
                                        _mm256_srl_epi16(hb[e], _mm_cvtsi32_si128(i - 2))
                                    } else {
                                        _mm256_sll_epi16(hb[e], _mm_cvtsi32_si128(2 - i))
                                    };
                                    _mm256_or_si256(low, _mm256_and_si256(up, bit2))
                                } else {
                                    low
                                }
                            };
                            for i in 0..R {
                                let pq = _mm256_maddubs_epi16(v, a[i]);
                                part[i][e] = _mm256_add_epi16(part[i][e], pq);
                            }
                        }
                        // Q6_K's quants (< 64) fill 16 bits in two planes, Q3_K's and
                        // Q2_K's (< 8) not in four.
                        if p == 3 || (T == 2 && p == 1) {
                            flush(&mut part, &sc, &mut isum);
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
                        off = _mm256_add_epi32(off, _mm256_madd_epi16(pairs(j, e, true), y));
                    }
                    let s = match T {
                        2 => _mm256_sub_epi32(isum[i][e], _mm256_slli_epi32::<5>(off)),
                        3 => _mm256_sub_epi32(isum[i][e], _mm256_slli_epi32::<2>(off)),
                        _ => isum[i][e],
                    };
                    let yd = _mm256_set1_ps(ys[i].d);
                    let a = &mut acc[i][e];
                    *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, yd), *a);
                    if T == 4 {
                        let dmin = half8(DMIN, e);
                        let m = _mm256_cvtepi32_ps(off);
                        *a = _mm256_fnmadd_ps(m, _mm256_mul_ps(dmin, yd), *a);
                    }
                }
            }
        }
    }
    // SAFETY: the caller's contract: rows `i < R`, lanes `8 first..8 first + n`.
    unsafe { crate::simd::x86::store_lanes(&acc, out, stride, first, n) };
}
