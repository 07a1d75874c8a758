//! AVX-512 VNNI kernels over repacked matrices ([`super`]; CPUs with `avx512f`,
//! `avx512bw`, `avx512vnni`: Intel since Ice Lake, AMD since Zen 4).
//!
//! A tile (16 weight rows, one 32-element block) decodes to eight vectors of unsigned bytes,
//! four elements per row lane; each activation row's block is broadcast four bytes at a time
//! and `vpdpbusd` (unsigned weight bytes times signed activation bytes, summed in fours into
//! 32-bit lanes) accumulates sixteen rows' integer dot products in eight instructions. The
//! block's scales then apply to sixteen outputs at once: `acc += d d_y Σ u q_y + m' s_y`.
//! Each decoded tile serves up to eight activation rows (a batched decode step's rows, or a
//! tile of a prompt's), held in registers. Activations are quantized as
//! [`quantize_row`](super::super::quantize_row) does, but vectorized (ties rounded to even)
//! and on the thread pool.
//!
//! This replaced a kernel over the file's own block order (two blocks per `vpdpbusd`, scales
//! applied per output): 3.1x the prompt throughput on SmolLM2-135M Q4_1 and 2.3x on
//! Qwen2.5-0.5B's Q5_0/Q8_0 matrices (docs/BENCHMARKS.md).

use std::arch::x86_64::*;

use super::super::amx::ROWS as AMX_ROWS;
use super::super::{avx512_vnni, tiled_matmul, BlockQ8, Kind, QK};
use super::amx::amx_rows;
use super::decode::packed_decode;
use super::ROWS;

/// Activation rows per pass over a repacked tile (each row's accumulator is a register,
/// beside the tile's eight decoded vectors).
const PACKED_TILE: usize = 8;

/// One matrix of a [`packed_matmul`]: `tiles` of `n` rows (padded to 16) in `kind`'s blocks.
pub(super) struct Mat<'a> {
    pub kind: Kind,
    pub tiles: &'a [u8],
    pub n: usize,
}

/// `x @ w.T` for each repacked matrix `w` of `mats` (all of `k` columns; [`super`]),
/// in one pass over the thread pool with `x` quantized once: the Q, K and V projections of a
/// layer (or its gate and up) share their input, so they share its quantization and one
/// barrier instead of three.
pub(super) fn packed_matmul(mats: &[Mat<'_>], k: usize, x: &[f32]) -> Vec<Vec<f32>> {
    packed_matmul_with(mats, k, x, crate::simd::amx())
}

/// [`packed_matmul`], with every whole sixteen rows of `x` on AMX's tile unit (`amx`, only
/// where the CPU has it: [`super::amx`]) or all of them on the VNNI kernel.
pub(super) fn packed_matmul_with(
    mats: &[Mat<'_>],
    k: usize,
    x: &[f32],
    amx: bool,
) -> Vec<Vec<f32>> {
    debug_assert!(avx512_vnni());
    assert!(
        !amx || crate::simd::cpu_has_amx(),
        "AMX products where the CPU runs them"
    );
    let m = x.len() / k;
    let nb = k / QK;
    let act = quantize_blocks(x, k, m);
    let kernel = |kind| match kind {
        Kind::Q4_0 => packed_rows::<0>,
        Kind::Q4_1 => packed_rows::<1>,
        Kind::Q5_0 => packed_rows::<2>,
        Kind::Q5_1 => packed_rows::<3>,
        Kind::Q8_0 => packed_rows::<4>,
        Kind::Iq4Nl => packed_rows::<5>,
    };
    for w in mats {
        let groups = w.n.div_ceil(ROWS);
        debug_assert_eq!(w.tiles.len(), groups * nb * w.kind.tile_bytes());
    }
    let amx_kernel = |kind| match kind {
        Kind::Q4_0 => amx_rows::<0>,
        Kind::Q4_1 => amx_rows::<1>,
        Kind::Q5_0 => amx_rows::<2>,
        Kind::Q5_1 => amx_rows::<3>,
        Kind::Q8_0 => amx_rows::<4>,
        Kind::Iq4Nl => amx_rows::<5>,
    };
    let heights: Vec<usize> = mats.iter().map(|w| w.n).collect();
    let row_bytes = nb * std::mem::size_of::<BlockQ8>();
    let step = if amx { AMX_ROWS } else { PACKED_TILE };
    tiled_matmul(&heights, m, row_bytes, step, |p| {
        let mat = &mats[p.w];
        let tb = mat.kind.tile_bytes();
        let t = &mat.tiles[p.g * nb * tb..(p.g + 1) * nb * tb];
        let mask = ((1u32 << p.lanes) - 1) as u16;
        if amx && p.rows.len() == AMX_ROWS {
            // SAFETY: `amx` holds only where the CPU runs AMX (asserted above);
            // `t` holds the group's `nb` tiles, `act` the pass's 16 rows of `nb` blocks;
            // the pass's outputs are this call's to write (`tiled_matmul`).
            unsafe {
                amx_kernel(mat.kind)(
                    t,
                    &act[p.rows.start * nb..p.rows.end * nb],
                    nb,
                    p.out,
                    p.stride,
                    mask,
                )
            };
            return;
        }
        // Passes of up to `PACKED_TILE` rows (a pass is at most 16: two of them).
        for (j, i) in p.rows.clone().step_by(PACKED_TILE).enumerate() {
            let rows = i..(i + PACKED_TILE).min(p.rows.end);
            // SAFETY: `available()` (the caller's dispatch); `t` holds the group's `nb`
            // tiles, `act` the rows (at most `PACKED_TILE`) of `nb` blocks each; their
            // outputs, `j * PACKED_TILE` rows into the pass's, are this call's to write.
            unsafe {
                kernel(mat.kind)(
                    t,
                    &act[rows.start * nb..rows.end * nb],
                    nb,
                    rows.len(),
                    p.out.add(j * PACKED_TILE * p.stride),
                    p.stride,
                    mask,
                )
            };
        }
    })
}

/// Tiles ahead of the one being multiplied whose lines are prefetched.
const PREFETCH_TILES: usize = 6;

/// Activation blocks below which quantizing is not worth a pass over the thread pool (a
/// block takes ~10 ns: a decode step's eight rows of 576 are 144 blocks).
const PARALLEL_BLOCKS: usize = 2048;

/// `m` activation rows of `k` elements as 8-bit blocks (as
/// [`quantize_row`](super::super::quantize_row), ties rounded to even), on the thread pool
/// when there are many.
fn quantize_blocks(x: &[f32], k: usize, m: usize) -> Vec<BlockQ8> {
    let nb = k / QK;
    let zero = BlockQ8 {
        d: 0.0,
        s: 0.0,
        qs: [0; QK],
    };
    let mut out = vec![zero; m * nb];
    if m * nb < PARALLEL_BLOCKS {
        for (x, o) in x.chunks_exact(k).zip(out.chunks_exact_mut(nb)) {
            // SAFETY: the caller's dispatch checked `available()`.
            unsafe { quantize_blocks_into(x, o) };
        }
        return out;
    }
    struct Dst(*mut BlockQ8);
    // SAFETY: each task writes the rows of its own range only.
    unsafe impl Sync for Dst {}
    let dst = Dst(out.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(m, |range| {
        let dst = &dst;
        for i in range {
            // SAFETY: rows `range` of `out` belong to this task; `out` outlives the call;
            // `available()` was checked by the caller's dispatch.
            unsafe {
                let o = std::slice::from_raw_parts_mut(dst.0.add(i * nb), nb);
                quantize_blocks_into(&x[i * k..(i + 1) * k], o);
            }
        }
    });
    out
}

/// `x` (`32 out.len()` elements) quantized into `out`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
fn quantize_blocks_into(x: &[f32], out: &mut [BlockQ8]) {
    let load = |x: &[f32]| {
        let x: &[f32; 16] = x.try_into().expect("16 values");
        // SAFETY: `x` is 16 readable f32; `loadu` takes any alignment.
        unsafe { _mm512_loadu_ps(x.as_ptr()) }
    };
    for (blk, x) in out.iter_mut().zip(x.chunks_exact(32)) {
        let (v0, v1) = (load(&x[..16]), load(&x[16..]));
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        let d = amax / 127.0;
        let id = _mm512_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
        let q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id));
        let q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
        let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        let (lo, hi) = blk.qs.split_at_mut(16);
        // SAFETY: `lo` is 16 writable bytes; `storeu` takes any alignment.
        unsafe { _mm_storeu_si128(lo.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(q0)) };
        // SAFETY: as above, for `hi`.
        unsafe { _mm_storeu_si128(hi.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(q1)) };
        blk.d = d;
        blk.s = d * sum as f32;
    }
}

/// One group's tiles (`nb` blocks of 16 rows) against `r ≤ PACKED_TILE` activation rows
/// (`nb` blocks each, row after row in `act`); row `i`'s 16 results go to `out + i *
/// stride` (lanes in `mask`). `K`: 0 Q4_0, 1 Q4_1, 2 Q5_0, 3 Q5_1, 4 Q8_0, 5 IQ4_NL.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
unsafe fn packed_rows<const K: u8>(
    tiles: &[u8],
    act: &[BlockQ8],
    nb: usize,
    r: usize,
    out: *mut f32,
    stride: usize,
    mask: u16,
) {
    // SAFETY: the caller's contract, which is `packed_tile`'s.
    unsafe {
        match r {
            1 => packed_tile::<K, 1>(tiles, act, nb, out, stride, mask),
            2 => packed_tile::<K, 2>(tiles, act, nb, out, stride, mask),
            3 => packed_tile::<K, 3>(tiles, act, nb, out, stride, mask),
            4 => packed_tile::<K, 4>(tiles, act, nb, out, stride, mask),
            5 => packed_tile::<K, 5>(tiles, act, nb, out, stride, mask),
            6 => packed_tile::<K, 6>(tiles, act, nb, out, stride, mask),
            7 => packed_tile::<K, 7>(tiles, act, nb, out, stride, mask),
            _ => packed_tile::<K, 8>(tiles, act, nb, out, stride, mask),
        }
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
unsafe fn packed_tile<const K: u8, const R: usize>(
    tiles: &[u8],
    act: &[BlockQ8],
    nb: usize,
    out: *mut f32,
    stride: usize,
    mask: u16,
) {
    // SAFETY: the caller's contract (the features; `out + i * stride` writable for the
    // lanes of `mask`, `i < R`); the tile and activation reads stay inside `tiles` and `act`
    // (their lengths asserted below; the prefetches read nothing).
    unsafe {
        let tb = [288, 320, 352, 384, 544, 288][K as usize];
        assert!(tiles.len() >= nb * tb && act.len() >= R * nb);
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..nb {
            let t = tiles.as_ptr().add(b * tb);
            // Every line of the tile `PREFETCH_TILES` ahead: a decode step streams the
            // matrix once, and two lines of the tile two ahead (before) left part of each
            // tile to the hardware prefetcher (docs/BENCHMARKS.md, Emerald Rapids).
            for l in (0..tb).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(t.wrapping_add(PREFETCH_TILES * tb + l) as *const i8);
            }
            let (v, d, m) = packed_decode::<K>(t);
            for (i, acc) in acc.iter_mut().enumerate() {
                let y = act.get_unchecked(i * nb + b);
                let q = y.qs.as_ptr() as *const i32;
                let mut s = _mm512_setzero_si512();
                for (j, v) in v.iter().enumerate() {
                    let a = _mm512_set1_epi32(std::ptr::read_unaligned(q.add(j)));
                    s = _mm512_dpbusd_epi32(s, *v, a);
                }
                let scale = _mm512_mul_ps(d, _mm512_set1_ps(y.d));
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, *acc);
                *acc = _mm512_fmadd_ps(m, _mm512_set1_ps(y.s), *acc);
            }
        }
        for (i, acc) in acc.iter().enumerate() {
            _mm512_mask_storeu_ps(out.add(i * stride), mask, *acc);
        }
    }
}
