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
//! A row with an odd number of blocks ends in a pair whose second block is zero.

#![allow(unused_unsafe)]

use std::arch::x86_64::*;

use super::{quantize_row, Kind, SharedOut};

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

/// One activation row (`k` elements) as pairs.
fn pairs(x: &[f32]) -> Vec<Pair> {
    let blocks = quantize_row(x);
    blocks
        .chunks(2)
        .map(|c| {
            let (a, b) = (&c[0], c.get(1));
            let mut p = Pair {
                q: [0; 64],
                d: [0.0; 16],
                s: [0.0; 16],
            };
            p.q[..16].copy_from_slice(&a.qs[..16]);
            p.q[32..48].copy_from_slice(&a.qs[16..]);
            if let Some(b) = b {
                p.q[16..32].copy_from_slice(&b.qs[..16]);
                p.q[48..].copy_from_slice(&b.qs[16..]);
            }
            let (db, sb) = b.map_or((0.0, 0.0), |b| (b.d, b.s));
            for l in 0..16 {
                let first = (l / 4) % 2 == 0;
                p.d[l] = if first { a.d } else { db };
                p.s[l] = if first { a.s } else { sb } / 8.0;
            }
            p
        })
        .collect()
}

/// `x @ w.T` (see [`super::matmul`]).
pub(super) fn matmul(kind: Kind, w: &[u8], n: usize, k: usize, x: &[f32]) -> Vec<f32> {
    debug_assert!(available());
    let m = x.len() / k;
    let row_bytes = k / super::QK * kind.block_bytes();
    debug_assert_eq!(w.len(), n * row_bytes);
    let rows: Vec<Vec<Pair>> = x.chunks_exact(k).map(pairs).collect();
    let row = match kind {
        Kind::Q4_0 => row::<0>,
        Kind::Q4_1 => row::<1>,
        Kind::Q5_0 => row::<2>,
        Kind::Q5_1 => row::<3>,
        Kind::Q8_0 => row::<4>,
    };
    let mut out_t = vec![0f32; n * m];
    let dst = SharedOut(out_t.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(n, |range| {
        let dst = &dst;
        // SAFETY: disjoint ranges of `0..n` (see `super::matmul_with`).
        let d =
            unsafe { std::slice::from_raw_parts_mut(dst.0.add(range.start * m), range.len() * m) };
        for (j, d) in range.zip(d.chunks_exact_mut(m)) {
            let wr = &w[j * row_bytes..(j + 1) * row_bytes];
            for (tile, o) in rows.chunks(TILE).zip(d.chunks_mut(TILE)) {
                // SAFETY: `available()` (the caller's dispatch); `wr` holds the row's blocks.
                unsafe { row(wr, tile, o) };
            }
        }
    });
    super::transpose(out_t, m, n)
}

/// One weight row against up to [`TILE`] activation rows; `K`: 0 Q4_0, 1 Q4_1, 2 Q5_0,
/// 3 Q5_1, 4 Q8_0.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
unsafe fn row<const K: u8>(w: &[u8], tile: &[Vec<Pair>], out: &mut [f32]) {
    unsafe {
        match tile.len() {
            1 => rows::<K, 1>(w, tile, out),
            2 => rows::<K, 2>(w, tile, out),
            3 => rows::<K, 3>(w, tile, out),
            4 => rows::<K, 4>(w, tile, out),
            5 => rows::<K, 5>(w, tile, out),
            6 => rows::<K, 6>(w, tile, out),
            7 => rows::<K, 7>(w, tile, out),
            _ => rows::<K, 8>(w, tile, out),
        }
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
unsafe fn rows<const K: u8, const R: usize>(w: &[u8], tile: &[Vec<Pair>], out: &mut [f32]) {
    unsafe {
        let bb = [18, 20, 22, 24, 34][K as usize];
        let nb = w.len() / bb;
        let np = nb.div_ceil(2);
        assert!(tile.len() >= R && out.len() >= R && tile[..R].iter().all(|r| r.len() == np));
        let ptrs: [*const Pair; R] = std::array::from_fn(|r| tile[r].as_ptr());
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
            out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], off[r]));
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
