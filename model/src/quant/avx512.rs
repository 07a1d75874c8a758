//! AVX-512 VNNI kernels for the 32-element block types (CPUs with `avx512f`, `avx512bw`,
//! `avx512vnni`: Intel since Ice Lake, AMD since Zen 4): two weight blocks per 512-bit
//! integer product (`vpdpbusd`: unsigned weight bytes times signed activation bytes, summed
//! in fours into 32-bit lanes), each decoded pair of weight blocks used for up to eight
//! activation rows (a batched decode step's rows, or a tile of a prompt's).
//!
//! Weights are read in their GGUF blocks (no repacking; memory stays the file's). A block's
//! quants become unsigned bytes `u = q + bias` (`bias`: 8 for Q4_0, 16 for Q5_0, 128 for Q8_0,
//! 0 for Q4_1/Q5_1), so its value is `u d + m'` with `m' = m - bias d`, and a block's share
//! of a dot product with activation block `(d_y, q_y, s_y = d_y Σ q_y)` is
//! `d d_y Σ u q_y + m' s_y`. Activations are laid out for that ([`Pair`]): two blocks' quants
//! in the order the weights' nibbles unpack to, with their scales and `s_y` spread over the
//! 32-bit lanes each block's products land in, so both terms are lane-wise multiply-adds and
//! one horizontal sum ends a row.
//!
//! | pair lanes (32-bit) | 0-3 | 4-7 | 8-11 | 12-15 |
//! |---|---|---|---|---|
//! | elements | A 0-15 | B 0-15 | A 16-31 | B 16-31 |
//!
//! A row with an odd number of blocks ends in a pair whose second block is zero. Activations
//! are quantized as [`super::quantize_row`] does, but with ties rounded to even.

#![allow(unused_unsafe)]

use std::arch::x86_64::*;

use super::{Kind, SharedOut};

pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("f16c")
}

/// Activation rows per decoded weight pair (16 accumulators of the 32 registers).
const TILE: usize = 8;

/// How far ahead of the pair being decoded the weights are prefetched, bytes.
const PREFETCH: usize = 1024;

/// Two activation blocks in the kernel's layout (module docs): quants, each lane's scale
/// `d_y`, and each lane's share of `s_y` (an eighth: a block spans eight lanes).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Pair {
    q: [i8; 64],
    d: [f32; 16],
    s: [f32; 16],
}

impl Pair {
    const ZERO: Pair = Pair {
        q: [0; 64],
        d: [0.0; 16],
        s: [0.0; 16],
    };
}

/// Activation rows of one tile group: the tiles of a group share the weight rows a thread
/// reads, and the group's pairs stay in the core's L2 (32 rows of 1,536 elements: 147 KiB).
const GROUP: usize = 32;

/// `m` activation rows of `k` elements as pairs, `(k / 32).div_ceil(2)` per row, row after
/// row; the rows are quantized on the thread pool when there are several.
fn quantize(x: &[f32], k: usize, m: usize) -> Vec<Pair> {
    let np = (k / super::QK).div_ceil(2);
    let mut out = vec![Pair::ZERO; m * np];
    if m < 4 {
        for (x, o) in x.chunks_exact(k).zip(out.chunks_exact_mut(np)) {
            // SAFETY: the caller's dispatch checked `available()`.
            unsafe { quantize_row_into(x, o) };
        }
        return out;
    }
    struct Dst(*mut Pair);
    // SAFETY: each task writes the rows of its own range only.
    unsafe impl Sync for Dst {}
    let dst = Dst(out.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(m, |range| {
        let dst = &dst;
        for i in range {
            // SAFETY: rows `range` of `out` belong to this task; `out` outlives the call;
            // `available()` was checked by the caller's dispatch.
            unsafe {
                let o = std::slice::from_raw_parts_mut(dst.0.add(i * np), np);
                quantize_row_into(&x[i * k..(i + 1) * k], o);
            }
        }
    });
    out
}

/// One activation row as pairs (as [`super::quantize_row`]: `d = max|x| / 127` per block, quants
/// rounded to nearest, ties to even), vectorized.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
unsafe fn quantize_row_into(x: &[f32], out: &mut [Pair]) {
    unsafe {
        let nb = x.len() / super::QK;
        for (p, pair) in out.iter_mut().enumerate() {
            for half in 0..2 {
                let b = 2 * p + half;
                if b >= nb {
                    break;
                }
                let v0 = _mm512_loadu_ps(x.as_ptr().add(b * 32));
                let v1 = _mm512_loadu_ps(x.as_ptr().add(b * 32 + 16));
                let amax =
                    _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
                let d = amax / 127.0;
                let id = _mm512_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
                let q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id));
                let q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
                let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
                let at = pair.q.as_mut_ptr().add(half * 16);
                _mm_storeu_si128(at as *mut __m128i, _mm512_cvtepi32_epi8(q0));
                _mm_storeu_si128(at.add(32) as *mut __m128i, _mm512_cvtepi32_epi8(q1));
                let s = d * sum as f32 / 8.0;
                for l in [0, 1, 2, 3, 8, 9, 10, 11] {
                    pair.d[l + 4 * half] = d;
                    pair.s[l + 4 * half] = s;
                }
            }
        }
    }
}

/// `x @ w.T` (see [`super::matmul`]).
pub(super) fn matmul(kind: Kind, w: &[u8], n: usize, k: usize, x: &[f32]) -> Vec<f32> {
    debug_assert!(available());
    let m = x.len() / k;
    let np = (k / super::QK).div_ceil(2);
    let row_bytes = k / super::QK * kind.block_bytes();
    debug_assert_eq!(w.len(), n * row_bytes);
    let rows = quantize(x, k, m);
    let row = match kind {
        Kind::Q4_0 => row::<0>,
        Kind::Q4_1 => row::<1>,
        Kind::Q5_0 => row::<2>,
        Kind::Q5_1 => row::<3>,
        Kind::Q8_0 => row::<4>,
    };
    let mut out = vec![0f32; m * n];
    let dst = SharedOut(out.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(n, |range| {
        let dst = &dst;
        for g in (0..m).step_by(GROUP) {
            let g_end = (g + GROUP).min(m);
            for j in range.clone() {
                let wr = &w[j * row_bytes..(j + 1) * row_bytes];
                for i in (g..g_end).step_by(TILE) {
                    let r = TILE.min(g_end - i);
                    // SAFETY: `available()` (the caller's dispatch); `wr` holds the row's
                    // blocks, `rows[i * np..]` at least `r` rows of pairs; column `j` of
                    // `out` is written by this task only (disjoint ranges of `0..n`), and
                    // `out` outlives `execute_chunked`.
                    unsafe { row(wr, &rows[i * np..], np, r, dst.0.add(i * n + j), n) };
                }
            }
        }
    });
    out
}

/// One weight row against `r ≤ TILE` activation rows (`np` pairs each, from `act` on),
/// results to `out`, `out + stride`, ...; `K`: 0 Q4_0, 1 Q4_1, 2 Q5_0, 3 Q5_1, 4 Q8_0.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
unsafe fn row<const K: u8>(
    w: &[u8],
    act: &[Pair],
    np: usize,
    r: usize,
    out: *mut f32,
    stride: usize,
) {
    unsafe {
        match r {
            1 => rows::<K, 1>(w, act, np, out, stride),
            2 => rows::<K, 2>(w, act, np, out, stride),
            3 => rows::<K, 3>(w, act, np, out, stride),
            4 => rows::<K, 4>(w, act, np, out, stride),
            5 => rows::<K, 5>(w, act, np, out, stride),
            6 => rows::<K, 6>(w, act, np, out, stride),
            7 => rows::<K, 7>(w, act, np, out, stride),
            _ => rows::<K, 8>(w, act, np, out, stride),
        }
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
unsafe fn rows<const K: u8, const R: usize>(
    w: &[u8],
    act: &[Pair],
    np: usize,
    out: *mut f32,
    stride: usize,
) {
    unsafe {
        let bb = [18, 20, 22, 24, 34][K as usize];
        let nb = w.len() / bb;
        assert!(np == nb.div_ceil(2) && act.len() >= R * np);
        let ptrs: [*const Pair; R] = std::array::from_fn(|r| act.as_ptr().add(r * np));
        let mut acc = [_mm512_setzero_ps(); R];
        let mut off = [_mm512_setzero_ps(); R];
        for p in 0..np {
            let a = w.as_ptr().add(2 * p * bb);
            // The last pair of an odd row has no second block.
            let b = (2 * p + 1 < nb).then(|| w.as_ptr().add((2 * p + 1) * bb));
            _mm_prefetch::<_MM_HINT_T0>(a.add(PREFETCH) as *const i8);
            let (q, wd, wm) = decode::<K>(a, b);
            for r in 0..R {
                let y = &*ptrs[r].add(p);
                let dot = _mm512_dpbusd_epi32(
                    _mm512_setzero_si512(),
                    q,
                    _mm512_load_si512(y.q.as_ptr() as *const _),
                );
                let scale = _mm512_mul_ps(wd, _mm512_load_ps(y.d.as_ptr()));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
                off[r] = _mm512_fmadd_ps(wm, _mm512_load_ps(y.s.as_ptr()), off[r]);
            }
        }
        for r in 0..R {
            *out.add(r * stride) = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], off[r]));
        }
    }
}

/// The nibbles of two blocks' 16 quant bytes (`qs` at offset `at`; a missing second block
/// reads as zeros), in pair order: low nibbles of A, of B, then high nibbles of A, of B.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
unsafe fn nibbles(a: *const u8, b: Option<*const u8>, at: usize) -> __m512i {
    unsafe {
        let lo128 = _mm_loadu_si128(a.add(at) as *const __m128i);
        let hi128 = b.map_or(_mm_setzero_si128(), |b| {
            _mm_loadu_si128(b.add(at) as *const __m128i)
        });
        let t = _mm256_inserti128_si256(_mm256_castsi128_si256(lo128), hi128, 1);
        let mask = _mm256_set1_epi8(0x0F);
        let lo = _mm256_and_si256(t, mask);
        let hi = _mm256_and_si256(_mm256_srli_epi16(t, 4), mask);
        _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)
    }
}

/// Byte mask of the fifth bits of two Q5 blocks (their `qh` at `at`), in pair order.
///
/// # Safety
/// `a` and `b` point at blocks holding `qh` at `at..at + 4`.
#[inline]
unsafe fn high_bits(a: *const u8, b: Option<*const u8>, at: usize) -> u64 {
    let qh = |p: *const u8| {
        // SAFETY: the caller's contract.
        u64::from(u32::from_le(unsafe {
            std::ptr::read_unaligned(p.add(at) as *const u32)
        }))
    };
    let (ha, hb) = (qh(a), b.map_or(0, qh));
    (ha & 0xFFFF) | (hb & 0xFFFF) << 16 | (ha >> 16) << 32 | (hb >> 16) << 48
}

/// A pair of weight blocks: unsigned quants in pair order, each lane's weight scale `d` and
/// offset `m'` (module docs).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
unsafe fn decode<const K: u8>(a: *const u8, b: Option<*const u8>) -> (__m512i, __m512, __m512) {
    unsafe {
        // Each block starts with `d` (f16), then `m` for Q4_1/Q5_1: both blocks' first four
        // bytes, converted at once to [d_a, m_a, d_b, m_b] (lanes 1 and 3 unused for types
        // without `m`). A missing second block reads as zeros.
        let head = |p: *const u8| std::ptr::read_unaligned(p as *const i32);
        let h = _mm_cvtph_ps(_mm_setr_epi32(head(a), b.map_or(0, head), 0, 0));
        let v = _mm512_castps128_ps512(h);
        let d = _mm512_permutexvar_ps(
            _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2),
            v,
        );
        let m = |bias: f32| _mm512_mul_ps(d, _mm512_set1_ps(-bias));
        let m_field = || {
            _mm512_permutexvar_ps(
                _mm512_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3, 1, 1, 1, 1, 3, 3, 3, 3),
                v,
            )
        };
        let (q, m) = match K {
            // Q4_0: (q - 8) d
            0 => (nibbles(a, b, 2), m(8.0)),
            // Q4_1: q d + m
            1 => (nibbles(a, b, 4), m_field()),
            // Q5_0: (q - 16) d, fifth bits in qh
            2 => {
                let q = nibbles(a, b, 6);
                let q = _mm512_mask_add_epi8(q, high_bits(a, b, 2), q, _mm512_set1_epi8(16));
                (q, m(16.0))
            }
            // Q5_1: q d + m
            3 => {
                let q = nibbles(a, b, 8);
                let q = _mm512_mask_add_epi8(q, high_bits(a, b, 4), q, _mm512_set1_epi8(16));
                (q, m_field())
            }
            // Q8_0: signed bytes, made unsigned by + 128
            _ => {
                let qa = _mm256_loadu_si256(a.add(2) as *const __m256i);
                let qb = b.map_or(_mm256_set1_epi8(0), |b| {
                    _mm256_loadu_si256(b.add(2) as *const __m256i)
                });
                let lo = _mm256_permute2x128_si256(qa, qb, 0x20);
                let hi = _mm256_permute2x128_si256(qa, qb, 0x31);
                let q = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
                (q, m(128.0))
            }
        };
        let q = if K == 4 {
            _mm512_xor_si512(q, _mm512_set1_epi8(-128))
        } else {
            q
        };
        (q, d, m)
    }
}
