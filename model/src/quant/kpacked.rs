//! K-quant matrices (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) repacked at load for tiled products:
//! sixteen weight rows interleaved per super-block, so one integer instruction multiplies four
//! elements of sixteen rows with one activation row's four quants (`vpdpbusd` on AVX-512 VNNI;
//! on AVX2 each half of the tile is eight rows for `pmaddubsw`), and a decoded super-block
//! serves several activation rows from registers (the prefill's GEMM) instead of one (the row
//! kernels of [`super::kquant`], which decode every weight block again for each four rows).
//!
//! **Layout** (in memory only, built from the GGUF blocks at load; all offsets in bytes): the
//! matrix is a sequence of *tiles*, group by group (rows `16g..16g+16`), super-block by
//! super-block within a group. Element `32j + 4i + c` of row `r` (sub-block `j < 8`, vector
//! `i < 8`, `c < 4`) sits at byte `4r + c` of a 64-byte vector: the order `vpdpbusd` takes
//! four bytes per 32-bit lane in. Quants are unsigned (`u`: Q6_K's `q + 32`, Q3_K's `q + 4`).
//!
//! | type | tile bytes | tile layout (offsets) | value |
//! |---|---:|---|---|
//! | Q2_K | 1,344 | `d[16]` 0, `dmin[16]` 32, `sm[8][16][2]` 64, `lo2[8][2][64]` 320 | `d sc_g u - dmin m_g` |
//! | Q3_K | 1,824 | `d[16]` 0, `scp[8][16][2]` 32, `lo2[8][2][64]` 288, `hb[8][64]` 1,312 | `d sc_g (u - 4)` |
//! | Q4_K | 2,368 | `d[16]` 0, `dmin[16]` 32, `sc[8][16]` 64, `mp[4][16][2]` 192, `planes[8][4][64]` 320 | `d sc_j u - dmin m_j` |
//! | Q5_K | 2,880 | as Q4_K, then `qh[8][64]` 2,368 | `d sc_j u - dmin m_j` |
//! | Q6_K | 3,360 | `d[16]` 0, `scp[8][16][2]` 32, `planes[8][4][64]` 288, `hi[8][2][64]` 2,336 | `d sc_g (u - 32)` |
//! | IQ4_XS | 2,208 | `d[16]` 0, `sx[8][16]` 32, `planes[8][4][64]` 160 | `d sx_j T[u]` |
//!
//! `d`, `dmin`: f16 per row. `sc` (u8): sub-block `j`'s scale for row `r` at `16j + r`. `mp`
//! (u8), `scp` (i8): a pair per row, widened to i16 pairs (one 32-bit lane per row) when
//! used: `mp[p]` the minimums of sub-blocks `2p`, `2p + 1`; `scp[j]` the scales of the
//! 16-element groups `g = 2j`, `2j + 1` (Q6_K's, Q3_K's less 32). `sm` (Q2_K): the same pair
//! per row, each byte group `g`'s 4-bit scale in its low nibble and 4-bit minimum in its high
//! one (the file's own bytes). Planes: byte `4r + c` of `planes[j][i]` holds vector `i`'s low
//! four bits in its low nibble and vector `i + 4`'s in its high nibble. Q5_K `qh[j]`: bit `i`
//! of byte `4r + c` is vector `i`'s fifth bit. Q6_K `hi[j][h]`: bits `2i'..2i'+2` of byte
//! `4r + c` are vector `4h + i'`'s two high bits; Q2_K's and Q3_K's `lo2[j][h]` hold their
//! two low bits the same way, and Q3_K's `hb[j]` its third bit as Q5_K's `qh` does.
//! IQ4_XS (`super::iq4`): `sx` (i8) is sub-block `j`'s scale less 32 for row `r` at `16j + r`,
//! the planes hold 4-bit indices into the table `T` of 16 levels, which the kernels look up
//! by a byte shuffle (as `T[u] + 128`, unsigned, for `vpdpbusd`, the 128 taken back through
//! the activation sums; signed for AVX2's `pmaddubsw` sign trick).
//!
//! Sixteen rows' integer sums come out of a sub-block (or 16-element group) at once; the
//! scales multiply them per lane, the minimums (Q2_K, Q4_K, Q5_K) and the offsets of Q3_K and
//! Q6_K apply through the activation block's sums (pairs of i16 against `mp` / `sm` / `scp`,
//! `vpdpwssd` or `pmaddwd`; IQ4_XS's 128 starts each sub-block's sums). Q2_K and Q6_K tiles
//! have exactly the file's bytes, IQ4_XS's 2 more per row and super-block (1.5 %), Q3_K's 4
//! more (its 6-bit scales unpacked to bytes, 3.6 %), Q4_K's and Q5_K's 4 more as well
//! (scales and minimums unpacked: 2-3 %).

use half::f16;

use super::kquant::{self, BlockQ8K, KKind, QK_K};

mod amx;
mod x86;

/// Rows interleaved in a tile.
pub(crate) const ROWS: usize = 16;

// Offsets of the tile parts (module docs).
pub(super) const D: usize = 0;
pub(super) const DMIN: usize = 32;
pub(super) const SC: usize = 64;
pub(super) const MP: usize = 192;
pub(super) const Q45: usize = 320;
pub(super) const QH5: usize = 2368;
pub(super) const SCP6: usize = 32;
pub(super) const Q6: usize = 288;
pub(super) const HI6: usize = 2336;
pub(super) const SCP3: usize = 32;
pub(super) const LO3: usize = 288;
pub(super) const HB3: usize = 1312;
pub(super) const SM2: usize = 64;
pub(super) const LO2: usize = 320;
pub(super) const SX: usize = 32;
pub(super) const QX: usize = 160;

/// Whether `kind` has a repacked layout.
pub(crate) fn repacks(kind: KKind) -> bool {
    matches!(
        kind,
        KKind::Q2K | KKind::Q3K | KKind::Q4K | KKind::Q5K | KKind::Q6K | KKind::Iq4Xs
    )
}

/// Bytes of a tile (16 rows of one super-block).
pub(crate) fn tile_bytes(kind: KKind) -> usize {
    match kind {
        KKind::Q4K => 2368,
        KKind::Q5K => 2880,
        KKind::Q6K => 3360,
        KKind::Q3K => 1824,
        KKind::Q2K => 1344,
        KKind::Iq4Xs => 2208,
    }
}

/// Repacks `raw`: `n` rows of `k` elements in GGUF `kind` super-blocks, row after row.
pub(crate) fn pack(kind: KKind, raw: &[u8], n: usize, k: usize) -> Vec<u8> {
    assert!(repacks(kind), "{kind:?} is not repacked");
    assert_eq!(k % QK_K, 0, "columns are whole super-blocks");
    let (nb, bb, tb) = (k / QK_K, kind.block_bytes(), tile_bytes(kind));
    assert_eq!(raw.len(), n * nb * bb, "{kind:?} ({n}, {k}) matrix bytes");
    let mut tiles = vec![0u8; n.div_ceil(ROWS) * nb * tb];
    for (t, tile) in tiles.chunks_exact_mut(tb).enumerate() {
        let (g, b) = (t / nb, t % nb);
        for r in 0..ROWS.min(n - g * ROWS) {
            let u = kquant::unpack(kind, &raw[((g * ROWS + r) * nb + b) * bb..][..bb]);
            pack_row(kind, &u, tile, r);
        }
    }
    tiles
}

/// Row `r`'s scales and quants of one super-block (`u`) into its place in `tile`.
fn pack_row(kind: KKind, u: &kquant::Unpacked, tile: &mut [u8], r: usize) {
    let half = |tile: &mut [u8], at: usize, v: f32| {
        tile[at + 2 * r..at + 2 * r + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes())
    };
    half(tile, D, u.d);
    match kind {
        KKind::Q6K | KKind::Q3K => {
            let at = if kind == KKind::Q6K { SCP6 } else { SCP3 };
            for j in 0..8 {
                tile[at + 32 * j + 2 * r] = u.sc[2 * j] as i8 as u8;
                tile[at + 32 * j + 2 * r + 1] = u.sc[2 * j + 1] as i8 as u8;
            }
        }
        KKind::Q2K => {
            half(tile, DMIN, u.dmin);
            for j in 0..8 {
                for h in 0..2 {
                    let g = 2 * j + h;
                    tile[SM2 + 32 * j + 2 * r + h] = (u.sc[g] | u.mn[g] << 4) as u8;
                }
            }
        }
        KKind::Iq4Xs => {
            for j in 0..8 {
                tile[SX + 16 * j + r] = u.sc[2 * j] as i8 as u8;
            }
        }
        KKind::Q4K | KKind::Q5K => {
            half(tile, DMIN, u.dmin);
            for j in 0..8 {
                tile[SC + 16 * j + r] = u.sc[2 * j] as u8;
            }
            for p in 0..4 {
                tile[MP + 32 * p + 2 * r] = u.mn[4 * p] as u8;
                tile[MP + 32 * p + 2 * r + 1] = u.mn[4 * p + 2] as u8;
            }
        }
    }
    for (e, q) in u.q.iter().enumerate() {
        let (j, i, pos) = (e / 32, e % 32 / 4, 4 * r + e % 4);
        // Two bits of vector `i` in `lo2[j][i / 4]` (Q6_K's high bits, Q2_K/Q3_K's low ones).
        let mut two =
            |at: usize, v: u8| tile[at + 128 * j + 64 * (i / 4) + pos] |= v << (2 * (i % 4));
        match kind {
            KKind::Q2K => two(LO2, *q as u8),
            KKind::Q3K => {
                let uq = (*q + 4) as u8;
                two(LO3, uq & 3);
                tile[HB3 + 64 * j + pos] |= (uq >> 2) << i;
            }
            _ => {
                let (planes, uq) = match kind {
                    KKind::Q6K => (Q6, (*q + 32) as u8),
                    KKind::Iq4Xs => (QX, super::iq4::CODES[usize::from(*q as u8)]),
                    _ => (Q45, *q as u8),
                };
                match kind {
                    KKind::Q5K => tile[QH5 + 64 * j + pos] |= (uq >> 4 & 1) << i,
                    KKind::Q6K => two(HI6, uq >> 4 & 3),
                    _ => {}
                }
                tile[planes + 256 * j + 64 * (i % 4) + pos] |= (uq & 0xF) << (4 * (i / 4));
            }
        }
    }
}

/// Row `j` of a repacked `(n, k)` matrix, dequantized into `out` (`k` long).
pub(crate) fn dequantize_row(kind: KKind, tiles: &[u8], k: usize, j: usize, out: &mut [f32]) {
    assert_eq!(out.len(), k);
    let (nb, tb) = (k / QK_K, tile_bytes(kind));
    let (g, r) = (j / ROWS, j % ROWS);
    let half = |t: &[u8], at: usize| f16::from_le_bytes([t[at], t[at + 1]]).to_f32();
    for (b, out) in out.chunks_exact_mut(QK_K).enumerate() {
        let t = &tiles[(g * nb + b) * tb..][..tb];
        let d = half(t, D + 2 * r);
        for (e, o) in out.iter_mut().enumerate() {
            let (sb, i, pos) = (e / 32, e % 32 / 4, 4 * r + e % 4);
            let two = |at: usize| t[at + 128 * sb + 64 * (i / 4) + pos] >> (2 * (i % 4)) & 3;
            // Group `2 sb + i / 4`'s byte of a pair per row (`scp`, `sm`).
            let pair = |at: usize| t[at + 32 * sb + 2 * r + i / 4];
            let nibbles = |at: usize| t[at + 256 * sb + 64 * (i % 4) + pos] >> (4 * (i / 4)) & 0xF;
            *o = match kind {
                KKind::Q2K => {
                    let sm = pair(SM2);
                    let (sc, m) = (f32::from(sm & 0xF), f32::from(sm >> 4));
                    d * sc * f32::from(two(LO2)) - half(t, DMIN + 2 * r) * m
                }
                KKind::Q3K => {
                    let u = two(LO3) | (t[HB3 + 64 * sb + pos] >> i & 1) << 2;
                    d * pair(SCP3) as i8 as f32 * (f32::from(u) - 4.0)
                }
                KKind::Q6K => {
                    let u = nibbles(Q6) | two(HI6) << 4;
                    d * pair(SCP6) as i8 as f32 * (f32::from(u) - 32.0)
                }
                KKind::Iq4Xs => {
                    let level = super::iq4::LEVELS[usize::from(nibbles(QX))];
                    d * t[SX + 16 * sb + r] as i8 as f32 * f32::from(level)
                }
                KKind::Q4K | KKind::Q5K => {
                    let mut u = nibbles(Q45);
                    if kind == KKind::Q5K {
                        u |= (t[QH5 + 64 * sb + pos] >> i & 1) << 4;
                    }
                    let sc = t[SC + 16 * sb + r] as f32;
                    let m = t[MP + 32 * (sb / 2) + 2 * r + sb % 2] as f32;
                    d * sc * u as f32 - half(t, DMIN + 2 * r) * m
                }
            };
        }
    }
}

/// One matrix of a [`matmul_many`]: `tiles` of `n` rows (padded to 16) in `kind`.
pub(crate) struct Mat<'a> {
    pub(crate) kind: KKind,
    pub(crate) tiles: &'a [u8],
    pub(crate) n: usize,
}

/// A kernel over one group's tiles: `(tiles, act, b32, nb, r, out, stride, lanes)`: `nb`
/// super-blocks of 16 rows against `r` activation rows (`nb` blocks each, row after row in
/// `act`; `b32` their sums of 32 quants), row `i`'s results to `out + i * stride`, the first
/// `lanes` of 16.
pub(super) type TileKernel =
    unsafe fn(&[u8], &[BlockQ8K], &[[i16; 8]], usize, usize, *mut f32, usize, usize);

/// The tiled kernels this CPU runs for `kind` (AVX-512 VNNI, else AVX2 where the kernel
/// path allows it), and the activation rows each call takes at most.
fn kernel(kind: KKind) -> Option<(TileKernel, usize)> {
    #[cfg(target_arch = "x86_64")]
    {
        if super::avx512_vnni() {
            return Some((x86::vnni(kind), x86::VNNI_ROWS));
        }
        if crate::simd::avx2() {
            return Some((x86::avx2(kind), x86::AVX2_ROWS));
        }
    }
    let _ = kind;
    None
}

/// Whether this CPU runs the tiled K-quant kernels (repacked matrices are made only then).
pub(crate) fn available() -> bool {
    kernel(KKind::Q4K).is_some()
}

/// Each activation block's sums of 32 quants (for the minimums of Q4_K/Q5_K sub-blocks).
fn sums32(act: &[BlockQ8K]) -> Vec<[i16; 8]> {
    act.iter()
        .map(|y| std::array::from_fn(|j| y.bsums[2 * j] + y.bsums[2 * j + 1]))
        .collect()
}

/// `m` rows of `k` as Q8_K blocks, row after row, on the thread pool when there are many.
fn quantize(x: &[f32], k: usize) -> Vec<BlockQ8K> {
    let zero = BlockQ8K {
        d: 0.0,
        bsums: [0; QK_K / 16],
        qs: [0; QK_K],
    };
    super::quantize_rows(x, k, k / QK_K, zero, kquant::quantize_row)
}

/// `x @ w.T` for each repacked matrix of `mats` (all of `k` columns), `x` quantized once and
/// one pass over the thread pool for all of them. Only where [`available`].
pub(crate) fn matmul_many(mats: &[Mat<'_>], k: usize, x: &[f32]) -> Vec<Vec<f32>> {
    matmul_many_with(mats, k, x, crate::simd::amx(), |kind| {
        kernel(kind).expect("tiled kernels available")
    })
}

/// [`matmul_many`] by the kernels `pick` gives, with every whole sixteen rows on AMX's tile
/// unit (`use_amx`, only where the CPU has it: `amx.rs`).
fn matmul_many_with(
    mats: &[Mat<'_>],
    k: usize,
    x: &[f32],
    use_amx: bool,
    pick: impl Fn(KKind) -> (TileKernel, usize),
) -> Vec<Vec<f32>> {
    assert!(
        !use_amx || crate::simd::cpu_has_amx(),
        "AMX products where the CPU runs them"
    );
    let m = x.len() / k;
    let nb = k / QK_K;
    let act = quantize(x, k);
    let b32 = sums32(&act);
    let kernels: Vec<(TileKernel, usize)> = mats.iter().map(|w| pick(w.kind)).collect();
    for w in mats {
        debug_assert_eq!(w.tiles.len(), w.n.div_ceil(ROWS) * nb * tile_bytes(w.kind));
    }
    let heights: Vec<usize> = mats.iter().map(|w| w.n).collect();
    let fewest = kernels.iter().map(|k| k.1).min().unwrap_or(1);
    let step = if use_amx { super::amx::ROWS } else { fewest };
    let row_bytes = nb * std::mem::size_of::<BlockQ8K>();
    super::tiled_matmul(&heights, m, row_bytes, step, |p| {
        let (mat, (kern, most)) = (&mats[p.w], kernels[p.w]);
        let tb = tile_bytes(mat.kind);
        let t = &mat.tiles[p.g * nb * tb..(p.g + 1) * nb * tb];
        let (kern, most) = if use_amx && p.rows.len() == super::amx::ROWS {
            (amx::amx(mat.kind), super::amx::ROWS)
        } else {
            (kern, most.min(fewest))
        };
        for (c, i) in p.rows.clone().step_by(most).enumerate() {
            let rows = i * nb..(i + most).min(p.rows.end) * nb;
            // SAFETY: the kernel is one `kernel` returned for this CPU (or the AMX one where
            // the CPU runs AMX, asserted above, for exactly its sixteen rows); `t`
            // holds the group's `nb` tiles, `act`/`b32` the rows (at most the kernel's);
            // their outputs, `c * most` rows into the pass's, are this call's to write.
            unsafe {
                kern(
                    t,
                    &act[rows.clone()],
                    &b32[rows.clone()],
                    nb,
                    rows.len() / nb,
                    p.out.add(c * most * p.stride),
                    p.stride,
                    p.lanes,
                )
            };
        }
    })
}

/// [`matmul_many`] of one matrix without SIMD (dequantized rows times quantized
/// activations): the reference the kernels are tested against.
pub(crate) fn matmul_portable(
    kind: KKind,
    tiles: &[u8],
    n: usize,
    k: usize,
    x: &[f32],
) -> Vec<f32> {
    let m = x.len() / k;
    let act: Vec<f32> = x
        .chunks_exact(k)
        .flat_map(kquant::quantize_row)
        .flat_map(|y| y.qs.map(|q| q as f32 * y.d))
        .collect();
    let mut out = vec![0f32; m * n];
    let mut w = vec![0f32; k];
    for j in 0..n {
        dequantize_row(kind, tiles, k, j, &mut w);
        for i in 0..m {
            out[i * n + j] = w
                .iter()
                .zip(&act[i * k..(i + 1) * k])
                .map(|(w, a)| w * a)
                .sum();
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{assert_product, iq4_xs_weights as iq4_xs, uniform, weights};
    use super::*;
    use candle_core::quantized::GgmlDType;
    use proptest::prelude::*;

    const KINDS: [(KKind, GgmlDType); 5] = [
        (KKind::Q2K, GgmlDType::Q2K),
        (KKind::Q3K, GgmlDType::Q3K),
        (KKind::Q4K, GgmlDType::Q4K),
        (KKind::Q5K, GgmlDType::Q5K),
        (KKind::Q6K, GgmlDType::Q6K),
    ];

    /// Every tiled kernel this machine runs for `kind`, whatever the process's kernel path.
    fn every_path(kind: KKind) -> Vec<(&'static str, (TileKernel, usize))> {
        #[allow(unused_mut)]
        let mut all = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            use super::x86;
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vnni")
                && is_x86_feature_detected!("f16c")
            {
                all.push(("vnni", (x86::vnni(kind), x86::VNNI_ROWS)));
            }
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                all.push(("avx2", (x86::avx2(kind), x86::AVX2_ROWS)));
            }
        }
        let _ = kind;
        all
    }

    fn check(vals: &[f32], x: &[f32], n: usize, k: usize) {
        for (kind, dtype) in KINDS {
            let (w, wd) = weights(vals, n, k, dtype);
            check_tiles(kind, &w, &wd, x, n, k);
        }
    }

    /// `w` (`n` rows of `k` in `kind`'s file blocks, `wd` their values) repacked: its rows
    /// are `wd` exactly, and every path's product with `x` is `wd`'s with `x` quantized.
    fn check_tiles(kind: KKind, w: &[u8], wd: &[f32], x: &[f32], n: usize, k: usize) {
        let tiles = pack(kind, w, n, k);
        assert_eq!(tiles.len(), n.div_ceil(ROWS) * k / QK_K * tile_bytes(kind));
        // The repacked rows are candle's (ggml's) dequantized rows, exactly.
        let mut row = vec![0f32; k];
        for j in 0..n {
            dequantize_row(kind, &tiles, k, j, &mut row);
            assert_eq!(row, wd[j * k..(j + 1) * k], "{kind:?} repacked row {j}");
        }
        let xq: Vec<f32> = x
            .chunks_exact(k)
            .flat_map(kquant::quantize_row)
            .flat_map(|y| y.qs.map(|q| q as f32 * y.d))
            .collect();
        let mut results = vec![("portable", matmul_portable(kind, &tiles, n, k, x))];
        let mat = Mat {
            kind,
            tiles: &tiles,
            n,
        };
        for (name, kern) in every_path(kind) {
            results.push((
                name,
                matmul_many_with(std::slice::from_ref(&mat), k, x, false, |_| kern).remove(0),
            ));
        }
        for (name, got) in results {
            assert_product(&got, wd, &xq, n, k, 1e-4, &format!("{kind:?} {name}"));
        }
    }

    #[test]
    fn every_kind_and_path_matches_the_dequantized_weights() {
        // 37 rows: two full groups of 16 and a partial one.
        let (n, k) = (37, 2 * QK_K);
        let vals: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1.0 + (i % 13) as f32))
            .collect();
        // One row (decode), five, eleven (a full call of eight and three more), and zeros.
        for m in [1, 2, 5, 11] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 9.0)
                .collect();
            check(&vals, &x, n, k);
        }
        check(&vals, &vec![0.0; k], n, k);
    }

    /// Extreme quants: activations at ±127 against weights at their largest and smallest
    /// codes, where a 16-bit partial sum would overflow first.
    #[test]
    fn extreme_values_do_not_overflow() {
        let (n, k) = (16, QK_K);
        let vals: Vec<f32> = (0..n * k)
            .map(|i| if (i / 7) % 2 == 0 { 1.0 } else { -1.0 } * (1 + i % 3) as f32)
            .collect();
        let x: Vec<f32> = (0..3 * k)
            .map(|i| if (i / 5) % 3 == 0 { -1.0 } else { 1.0 })
            .collect();
        check(&vals, &x, n, k);
    }

    #[test]
    fn iq4_xs_tiles_match_ggml_values() {
        let mut next = uniform(7);
        let (n, k) = (37, 2 * QK_K);
        for m in [1, 2, 5, 11] {
            let (w, wd) = iq4_xs(n, k, 0.01, &mut next);
            let x: Vec<f32> = (0..m * k).map(|_| next() * 4.0).collect();
            check_tiles(KKind::Iq4Xs, &w, &wd, &x, n, k);
        }
        // Extremes: every code 0 (level -127) at the largest and smallest scales (6-bit
        // scales 0 and 63: -32 and +31), against activations at ±127.
        let (n, k) = (16, QK_K);
        let mut w = vec![0u8; n * super::super::iq4::XS_BYTES];
        for (r, b) in w.chunks_exact_mut(super::super::iq4::XS_BYTES).enumerate() {
            b[..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
            let (h, l) = if r % 2 == 0 {
                (0u16, 0u8)
            } else {
                (0xFFFF, 0xFF)
            };
            b[2..4].copy_from_slice(&h.to_le_bytes());
            b[4..8].fill(l);
        }
        let wd = super::super::test_util::iq4_xs_reference(&w);
        let x: Vec<f32> = (0..3 * k)
            .map(|i| if i % 3 == 0 { -1.0 } else { 1.0 })
            .collect();
        check_tiles(KKind::Iq4Xs, &w, &wd, &x, n, k);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn random_iq4_xs_matrices_match(
            n in 1usize..40,
            blocks in 1usize..4,
            m in 1usize..12,
            seed in any::<u64>(),
            spread in 1e-3f32..10.0,
        ) {
            let k = blocks * QK_K;
            let mut next = uniform(seed);
            let (w, wd) = iq4_xs(n, k, spread, &mut next);
            let x: Vec<f32> = (0..m * k).map(|_| next() * 3.0).collect();
            check_tiles(KKind::Iq4Xs, &w, &wd, &x, n, k);
        }

        #[test]
        fn random_matrices_match(
            n in 1usize..40,
            blocks in 1usize..4,
            m in 1usize..12,
            seed in any::<u64>(),
            spread in 0.01f32..100.0,
        ) {
            let k = blocks * QK_K;
            let mut next = uniform(seed);
            let vals: Vec<f32> = (0..n * k).map(|_| next() * spread).collect();
            let x: Vec<f32> = (0..m * k).map(|_| next() * 3.0).collect();
            check(&vals, &x, n, k);
        }
    }
}
