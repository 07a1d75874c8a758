//! AVX2 kernels over the repacked 32-element block types ([`super::packed`]), for CPUs
//! without AVX-512 VNNI (and `model.kernels = "avx2"` or `"avxvnni"`): each 512-bit tile
//! vector is read as two halves of eight rows; `pmaddubsw` multiplies four elements of eight
//! rows with one activation row's four quants (broadcast), sums stay in 16 bits for up to
//! eight vectors (4-bit quants) or four (5-bit) and `pmaddwd` widens them, and the block's
//! scales apply to eight outputs at once. A decoded plane serves [`ROWS_PER_CALL`] activation
//! rows. CPUs with AVX-VNNI (and no AVX-512) take [`tile_vnni`] instead: one `vpdpbusd` per
//! vector and row, every type's quants unsigned as in the AVX-512 kernel.
//!
//! IQ4_NL's 4-bit indices become their signed levels by a byte shuffle and are multiplied
//! as Q8_0's are.
//!
//! Q8_0's quants are stored `q + 128`, which `pmaddubsw` cannot take unsigned against signed
//! activations without overflowing 16 bits: they are turned back to `q` and multiplied as
//! `|q|` times the activation with `q`'s sign (llama.cpp's `mul_sum_i8_pairs`).

use std::arch::x86_64::*;

use super::{BlockQ8, Kind, QK};

/// Activation rows per kernel call.
pub(super) const ROWS_PER_CALL: usize = 4;

/// One matrix of a [`matmul`]: `tiles` of `n` rows (padded to 16) in `kind`'s blocks.
pub(super) struct Mat<'a> {
    pub kind: Kind,
    pub tiles: &'a [u8],
    pub n: usize,
}

/// `x @ w.T` for each repacked matrix of `mats` (all of `k` columns), `x` quantized once
/// and one pass over the thread pool; with AVX-VNNI where the kernel path allows it.
/// Callers check `crate::simd::avx2()`.
pub(super) fn matmul(mats: &[Mat<'_>], k: usize, x: &[f32]) -> Vec<Vec<f32>> {
    matmul_with(mats, k, x, crate::simd::avx_vnni())
}

/// [`matmul`] by the AVX-VNNI kernels (`vnni`: the CPU must have AVX-VNNI) or the plain AVX2
/// ones.
pub(super) fn matmul_with(mats: &[Mat<'_>], k: usize, x: &[f32], vnni: bool) -> Vec<Vec<f32>> {
    assert!(
        !vnni || is_x86_feature_detected!("avxvnni"),
        "AVX-VNNI kernels on a CPU without it"
    );
    let m = x.len() / k;
    let nb = k / QK;
    let act = quantize(x, k);
    for w in mats {
        debug_assert_eq!(w.tiles.len(), w.n.div_ceil(16) * nb * w.kind.tile_bytes());
    }
    let heights: Vec<usize> = mats.iter().map(|w| w.n).collect();
    let row_bytes = nb * std::mem::size_of::<BlockQ8>();
    super::tiled_matmul(&heights, m, row_bytes, ROWS_PER_CALL, |p| {
        let mat = &mats[p.w];
        let tb = mat.kind.tile_bytes();
        let t = &mat.tiles[p.g * nb * tb..(p.g + 1) * nb * tb];
        // SAFETY: the callers checked AVX2/FMA/F16C (and AVX-VNNI with `vnni`, asserted
        // above); `t` holds the group's `nb` tiles, `act` the pass's rows (at most
        // `ROWS_PER_CALL`); its outputs, lanes `0..p.lanes`, are this call's to write
        // (`tiled_matmul`).
        unsafe {
            rows(
                vnni,
                mat.kind,
                t,
                &act[p.rows.start * nb..p.rows.end * nb],
                nb,
                p.rows.len(),
                p.out,
                p.stride,
                p.lanes,
            )
        };
    })
}

/// `m` rows of `k` as 8-bit blocks, row after row, on the thread pool when there are many.
fn quantize(x: &[f32], k: usize) -> Vec<BlockQ8> {
    let zero = BlockQ8 {
        d: 0.0,
        s: 0.0,
        qs: [0; QK],
    };
    super::quantize_rows(x, k, k / QK, zero, super::quantize_row)
}

/// Lanes `0..lanes` (≤ 16) of one group's `nb` tiles against `r` activation rows, by
/// [`tile_vnni`] with `vnni`, else [`tile`].
///
/// # Safety
/// As [`tile`] (and [`tile_vnni`] with `vnni`), with `r ≤ 4`, for lanes `0..lanes`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows(
    vnni: bool,
    kind: Kind,
    tiles: &[u8],
    act: &[BlockQ8],
    nb: usize,
    r: usize,
    out: *mut f32,
    stride: usize,
    lanes: usize,
) {
    // One or two activation rows (decode steps) walk both halves of each tile at once: the
    // tile's lines come from memory once and every byte is used while they are in cache
    // (half by half, the first half's pass streamed Q8_0 at 20 GB/s where plain reads reach
    // 34). More rows fill the registers with one half, so they take the halves in turn.
    macro_rules! by_rows {
        ($k:expr, $tile:ident) => {{
            if r <= 2 && lanes > 8 {
                // SAFETY: the caller's contract, for lanes `0..lanes`.
                unsafe {
                    match r {
                        1 => $tile::<$k, 1, 2>(tiles, act, nb, 0, out, stride, lanes),
                        _ => $tile::<$k, 2, 2>(tiles, act, nb, 0, out, stride, lanes),
                    }
                }
                return;
            }
            for half in 0..lanes.div_ceil(8) {
                let n = (lanes - 8 * half).min(8);
                // SAFETY: the caller's contract, for lanes `8 half..8 half + n`.
                unsafe {
                    match r {
                        1 => $tile::<$k, 1, 1>(tiles, act, nb, half, out, stride, n),
                        2 => $tile::<$k, 2, 1>(tiles, act, nb, half, out, stride, n),
                        3 => $tile::<$k, 3, 1>(tiles, act, nb, half, out, stride, n),
                        _ => $tile::<$k, 4, 1>(tiles, act, nb, half, out, stride, n),
                    }
                }
            }
        }};
    }
    macro_rules! by_kind {
        ($tile:ident) => {
            match kind {
                Kind::Q4_0 => by_rows!(0, $tile),
                Kind::Q4_1 => by_rows!(1, $tile),
                Kind::Q5_0 => by_rows!(2, $tile),
                Kind::Q5_1 => by_rows!(3, $tile),
                Kind::Q8_0 => by_rows!(4, $tile),
                Kind::Iq4Nl => by_rows!(5, $tile),
            }
        };
    }
    if vnni {
        by_kind!(tile_vnni)
    } else {
        by_kind!(tile)
    }
}

/// Rows `8 first..8 first + n` of one group's `nb` tiles (`H` halves of eight rows from
/// half `first`) against `R` activation rows (`nb` blocks each in `act`); row `i`'s results
/// to `out + i * stride + 8 first`. `K`: 0 Q4_0, 1 Q4_1, 2 Q5_0, 3 Q5_1, 4 Q8_0, 5 IQ4_NL.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `first + H ≤ 2`; `out + i * stride + 8 first + l` is
/// writable for `i < R`, `l < n ≤ 8H`.
// Row and half indices address several register arrays in step (`s`, `part`, `acc`).
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const K: u8, const R: usize, const H: usize>(
    tiles: &[u8],
    act: &[BlockQ8],
    nb: usize,
    first: usize,
    out: *mut f32,
    stride: usize,
    n: usize,
) {
    assert!(tiles.len() >= nb * tile_bytes(K) && act.len() >= R * nb);
    assert!(first + H <= 2 && n <= 8 * H);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); H]; R];
    for b in 0..nb {
        let blk = Block::<R>::new::<K>(tiles, act, nb, b, first);
        // The reads below stay in this tile (`Block::load`'s contract): the layout's offsets
        // `at` have `at + 64 ≤` its bytes, and `first + e < 2`.
        // SAFETY: as said.
        let load = |at: usize, e: usize| unsafe { blk.load(at, e) };
        // SAFETY: word `i < 8` of a 32-quant block, `r < R`.
        let word = |r: usize, i: usize| unsafe { blk.word(r, i) };
        let mut s = [[_mm256_setzero_si256(); H]; R];
        if K == 5 {
            // Each index to its signed level, then multiplied as Q8_0's quants are.
            // SAFETY: `LEVELS` is 16 bytes.
            let lut = _mm256_broadcastsi128_si256(unsafe {
                _mm_loadu_si128(super::iq4::LEVELS.as_ptr().cast())
            });
            for j in 0..4 {
                for e in 0..H {
                    // SAFETY: the tile is of kind `K` (`rows`' dispatch), `first + e < 2`.
                    let (lo, hi) = unsafe { blk.nibbles::<K>(j, e) };
                    let (lo, hi) = (_mm256_shuffle_epi8(lut, lo), _mm256_shuffle_epi8(lut, hi));
                    for (v, w) in [(j, lo), (j + 4, hi)] {
                        let aw = _mm256_abs_epi8(w);
                        for i in 0..R {
                            let p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(word(i, v), w));
                            s[i][e] = _mm256_add_epi32(s[i][e], _mm256_madd_epi16(p, ones));
                        }
                    }
                }
            }
        } else if K == 4 {
            let flip = _mm256_set1_epi8(-128);
            for v in 0..8 {
                for e in 0..H {
                    let w = _mm256_xor_si256(load(32 + 64 * v, e), flip);
                    let aw = _mm256_abs_epi8(w);
                    for i in 0..R {
                        let p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(word(i, v), w));
                        s[i][e] = _mm256_add_epi32(s[i][e], _mm256_madd_epi16(p, ones));
                    }
                }
            }
        } else {
            for e in 0..H {
                let mut part = [_mm256_setzero_si256(); R];
                for j in 0..4 {
                    // SAFETY: the tile is of kind `K` (`rows`' dispatch), `first + e < 2`.
                    let (lo, hi) = unsafe { blk.nibbles::<K>(j, e) };
                    for (i, part) in part.iter_mut().enumerate() {
                        let pq = _mm256_add_epi16(
                            _mm256_maddubs_epi16(lo, word(i, j)),
                            _mm256_maddubs_epi16(hi, word(i, j + 4)),
                        );
                        *part = _mm256_add_epi16(*part, pq);
                    }
                    // 4-bit quants: eight products of ≤ 15 · 127 per lane half fit 16 bits;
                    // 5-bit ones four.
                    if j == 3 || ((K == 2 || K == 3) && j == 1) {
                        for i in 0..R {
                            s[i][e] = _mm256_add_epi32(s[i][e], _mm256_madd_epi16(part[i], ones));
                            part[i] = _mm256_setzero_si256();
                        }
                    }
                }
            }
        }
        // Q8_0 and IQ4_NL were multiplied signed here: no offset to take back.
        // SAFETY: the tile is of kind `K`, `first + H ≤ 2` (asserted).
        unsafe { blk.accumulate::<K, H>(&s, K != 4 && K != 5, &mut acc) };
    }
    // SAFETY: the caller's contract: rows `i < R`, lanes `8 first..8 first + n`.
    unsafe { crate::simd::x86::store_lanes(&acc, out, stride, first, n) };
}

/// [`tile`] on CPUs with AVX-VNNI (`vpdpbusd` on 256-bit vectors: Intel's cores since Alder
/// Lake and its E-core Xeons, none of which have AVX-512; AMD Zen 5): the tile's unsigned
/// quants (Q8_0's `q + 128`, IQ4_NL's level + 128 by a byte shuffle) times the activation's
/// signed bytes, four products summed into each 32-bit lane by one instruction, where the
/// AVX2 kernel spends two or four (`pmaddubsw`, `pmaddwd` and adds, or the sign trick). The
/// offsets come back out through the activation sums (`m' s_y`), as in the AVX-512 kernel.
///
/// # Safety
/// As [`tile`], and the CPU has AVX-VNNI.
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn tile_vnni<const K: u8, const R: usize, const H: usize>(
    tiles: &[u8],
    act: &[BlockQ8],
    nb: usize,
    first: usize,
    out: *mut f32,
    stride: usize,
    n: usize,
) {
    assert!(tiles.len() >= nb * tile_bytes(K) && act.len() >= R * nb);
    assert!(first + H <= 2 && n <= 8 * H);
    // IQ4_NL: each index to its level + 128.
    // SAFETY: `LEVELS_U8` is 16 bytes.
    let lut = _mm256_broadcastsi128_si256(unsafe {
        _mm_loadu_si128(super::iq4::LEVELS_U8.as_ptr().cast())
    });
    let mut acc = [[_mm256_setzero_ps(); H]; R];
    for b in 0..nb {
        let blk = Block::<R>::new::<K>(tiles, act, nb, b, first);
        // SAFETY: as in `tile`.
        let load = |at: usize, e: usize| unsafe { blk.load(at, e) };
        // SAFETY: word `i < 8` of a 32-quant block, `r < R`.
        let word = |r: usize, i: usize| unsafe { blk.word(r, i) };
        // Two sums per row and half, so that one or two rows (decode steps) do not wait on
        // `vpdpbusd`'s latency from one vector to the next.
        let mut s = [[_mm256_setzero_si256(); H]; R];
        let mut s2 = [[_mm256_setzero_si256(); H]; R];
        for e in 0..H {
            if K == 4 {
                for v in (0..8).step_by(2) {
                    let (w, w2) = (load(32 + 64 * v, e), load(32 + 64 * (v + 1), e));
                    for i in 0..R {
                        s[i][e] = _mm256_dpbusd_avx_epi32(s[i][e], w, word(i, v));
                        s2[i][e] = _mm256_dpbusd_avx_epi32(s2[i][e], w2, word(i, v + 1));
                    }
                }
                continue;
            }
            for j in 0..4 {
                // SAFETY: the tile is of kind `K` (`rows`' dispatch), `first + e < 2`.
                let (mut lo, mut hi) = unsafe { blk.nibbles::<K>(j, e) };
                if K == 5 {
                    lo = _mm256_shuffle_epi8(lut, lo);
                    hi = _mm256_shuffle_epi8(lut, hi);
                }
                for i in 0..R {
                    s[i][e] = _mm256_dpbusd_avx_epi32(s[i][e], lo, word(i, j));
                    s2[i][e] = _mm256_dpbusd_avx_epi32(s2[i][e], hi, word(i, j + 4));
                }
            }
        }
        for e in 0..H {
            for i in 0..R {
                s[i][e] = _mm256_add_epi32(s[i][e], s2[i][e]);
            }
        }
        // SAFETY: the tile is of kind `K`, `first + H ≤ 2` (asserted).
        unsafe { blk.accumulate::<K, H>(&s, true, &mut acc) };
    }
    // SAFETY: the caller's contract: rows `i < R`, lanes `8 first..8 first + n`.
    unsafe { crate::simd::x86::store_lanes(&acc, out, stride, first, n) };
}

/// Bytes of a tile of kind `K` (`tile`'s numbering).
const fn tile_bytes(k: u8) -> usize {
    [288, 320, 352, 384, 544, 288][k as usize]
}

/// Where kind `K`'s quants start in its tile.
const fn planes_at(k: u8) -> usize {
    [32, 64, 96, 128, 32, 32][k as usize]
}

/// Block `b` of a group's tiles and of the activation rows, as both tile kernels read it:
/// the tile from half `first`, and each row's block.
struct Block<'a, const R: usize> {
    t: *const u8,
    first: usize,
    ys: [&'a BlockQ8; R],
}

impl<'a, const R: usize> Block<'a, R> {
    /// Block `b` of `tiles` (kind `K`) and of the `R` rows of `act` (`nb` blocks each); the
    /// first half's pass prefetches the tile after next (decode steps stream the weights from
    /// memory).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn new<const K: u8>(
        tiles: &[u8],
        act: &'a [BlockQ8],
        nb: usize,
        b: usize,
        first: usize,
    ) -> Self {
        let tb = tile_bytes(K);
        let t = tiles[b * tb..(b + 1) * tb].as_ptr();
        if first == 0 {
            _mm_prefetch::<_MM_HINT_T0>(t.wrapping_add(2 * tb).cast());
            _mm_prefetch::<_MM_HINT_T0>(t.wrapping_add(2 * tb + 64).cast());
        }
        Block {
            t,
            first,
            ys: std::array::from_fn(|i| &act[i * nb + b]),
        }
    }

    /// Half `e`'s 32 bytes of the 64 at offset `at` of the tile.
    ///
    /// # Safety
    /// `at + 64` is at most the tile's bytes; `first + e < 2`.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load(&self, at: usize, e: usize) -> __m256i {
        // SAFETY: the caller's contract: the 32 bytes lie inside this tile.
        unsafe { _mm256_loadu_si256(self.t.add(at + 32 * (self.first + e)).cast()) }
    }

    /// Half `e`'s eight f16 at offset `at` (the rows' `d` or `m`), as f32.
    ///
    /// # Safety
    /// As [`Block::load`].
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn half8(&self, at: usize, e: usize) -> __m256 {
        // SAFETY: the caller's contract: the 16 bytes lie inside this tile.
        unsafe {
            _mm256_cvtph_ps(_mm_loadu_si128(
                self.t.add(at + 16 * (self.first + e)).cast(),
            ))
        }
    }

    /// Row `r`'s quants `4i..4i + 4`, broadcast.
    ///
    /// # Safety
    /// `r < R`, `i < 8`.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn word(&self, r: usize, i: usize) -> __m256i {
        let q: *const i32 = self.ys[r].qs.as_ptr().cast();
        // SAFETY: the caller's contract: word `i < 8` of a 32-quant block.
        _mm256_set1_epi32(unsafe { std::ptr::read_unaligned(q.add(i)) })
    }

    /// Plane `j`'s low and high nibbles (vectors `j` and `j + 4`) of half `e`, with their
    /// fifth bits for the Q5 kinds: unsigned quants (`K` < 4) or IQ4_NL indices.
    ///
    /// # Safety
    /// The tile is of kind `K` (not Q8_0); `j < 4`, `first + e < 2`.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn nibbles<const K: u8>(&self, j: usize, e: usize) -> (__m256i, __m256i) {
        let m4 = _mm256_set1_epi8(0x0F);
        // SAFETY: the caller's contract; the planes end at the tile's end.
        let p = unsafe { self.load(planes_at(K) + 64 * j, e) };
        let mut lo = _mm256_and_si256(p, m4);
        let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(p), m4);
        if K == 2 || K == 3 {
            // SAFETY: the `qh` plane (32 or 64) lies inside a Q5 tile.
            let h = unsafe { self.load(if K == 2 { 32 } else { 64 }, e) };
            // Vector `j`'s fifth bit is bit j of `h`, vector `j + 4`'s bit j + 4.
            let bit = _mm256_set1_epi8(0x10);
            let l = _mm256_sll_epi16(h, _mm_cvtsi32_si128(4 - j as i32));
            let u = _mm256_srl_epi16(h, _mm_cvtsi32_si128(j as i32));
            lo = _mm256_or_si256(lo, _mm256_and_si256(l, bit));
            hi = _mm256_or_si256(hi, _mm256_and_si256(u, bit));
        }
        (lo, hi)
    }

    /// `acc += d d_y s (+ m' s_y with `offset`)` for each row and half: the block's integer
    /// sums `s` scaled, and the unsigned quants' offset (`m'`: Q4_1/Q5_1's minimum, else
    /// `-bias d`, 128 for Q8_0 and IQ4_NL's level + 128) taken back through the activation
    /// sums.
    ///
    /// # Safety
    /// The tile is of kind `K`; `first + H ≤ 2`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn accumulate<const K: u8, const H: usize>(
        &self,
        s: &[[__m256i; H]; R],
        offset: bool,
        acc: &mut [[__m256; H]; R],
    ) {
        for e in 0..H {
            // SAFETY: the caller's contract: `d` at 0, `m` at 32 in Q4_1/Q5_1 tiles.
            let d = unsafe { self.half8(0, e) };
            let m = match K {
                0 => _mm256_mul_ps(d, _mm256_set1_ps(-8.0)),
                2 => _mm256_mul_ps(d, _mm256_set1_ps(-16.0)),
                // SAFETY: as above.
                1 | 3 => unsafe { self.half8(32, e) },
                _ => _mm256_mul_ps(d, _mm256_set1_ps(-128.0)),
            };
            for ((acc, s), y) in acc.iter_mut().zip(s).zip(&self.ys) {
                let scale = _mm256_mul_ps(d, _mm256_set1_ps(y.d));
                acc[e] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[e]), scale, acc[e]);
                if offset {
                    acc[e] = _mm256_fmadd_ps(m, _mm256_set1_ps(y.s), acc[e]);
                }
            }
        }
    }
}
