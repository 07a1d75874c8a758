//! Weights of the 32-element block types repacked at load for AVX-512 VNNI: sixteen weight
//! rows interleaved per block (llama.cpp's "repacked" layout idea), so one `vpdpbusd` computes
//! four elements' products for sixteen output rows at once and a block's scales are applied
//! to sixteen outputs with a few vector operations, instead of scales per output row (the
//! earlier per-row kernel spent ~5 instructions per 64 products, this one ~12 per 512).
//!
//! The repacked matrix has exactly the GGUF file's bytes per block (same bits, another
//! order), so memory stays the file's; rows are padded to a multiple of 16 with zero rows.
//! [`Packed`] also holds K-quant matrices in [`super::kpacked`]'s layout ([`PackKind`]), so
//! the decoder sees one kind of repacked matrix.
//!
//! **Layout** (in memory only, built from the GGUF blocks at load): the matrix is a sequence
//! of *tiles*, group by group (rows `16g..16g+16`), block by block within a group (elements
//! `32b..32b+32`). Element `e` of a block is byte `c = e % 4` of 32-bit lane `r` (the row in
//! the group) of vector `i = e / 4`: the order `vpdpbusd` takes four bytes per lane in. Quants
//! are stored unsigned (`u`: the nibble, with the fifth bit for Q5, or `q + 128` for Q8_0).
//!
//! | type | tile bytes | tile layout (offsets) | value |
//! |---|---:|---|---|
//! | Q4_0 | 288 | `d[16]` 0, `planes[4][64]` 32 | `(u - 8) d` |
//! | Q4_1 | 320 | `d[16]` 0, `m[16]` 32, `planes` 64 | `u d + m` |
//! | Q5_0 | 352 | `d[16]` 0, `qh[64]` 32, `planes` 96 | `(u - 16) d` |
//! | Q5_1 | 384 | `d[16]` 0, `m[16]` 32, `qh[64]` 64, `planes` 128 | `u d + m` |
//! | Q8_0 | 544 | `d[16]` 0, `q[8][64]` 32 | `(u - 128) d` |
//! | IQ4_NL | 288 | `d[16]` 0, `planes[4][64]` 32 | `T[u] d` (`u`: the 4-bit index, `T`: the format's 16 levels) |
//!
//! `d`, `m`: f16, one per row. 4/5-bit planes: byte `4r + c` of plane `j` holds vector `j`'s
//! low four bits in its low nibble and vector `j + 4`'s in its high nibble; `qh` byte `4r + c`
//! holds vector `i`'s fifth bit in bit `i`. Q8_0: byte `4r + c` of `q[i]`.
//!
//! `IQ4_NL` tiles are Q4_0's with the table's levels in place of `u − 8`: the kernels turn each
//! index into its level by a byte shuffle (VNNI: the level + 128, unsigned as `vpdpbusd` takes
//! it, with `m' = -128 d`; AVX2: the signed level, multiplied as Q8_0's signed quants are).
//!
//! With activations quantized per block (`d_y`, `q_y`, `s_y = d_y Σ q_y`), a tile's share of
//! row `r`'s output is `d_r d_y Σ u q_y + m'_r s_y`, where `m' = m`, or `-bias · d` for the
//! symmetric types: sixteen rows' worth per vector operation.

use candle_core::quantized::GgmlDType;
use half::f16;

mod amx;
mod avx512;
mod decode;

use super::kpacked;
use super::kquant::KKind;
use super::{unpack, BlockQ8, Kind, QK};

/// Rows interleaved in a tile (the 32-bit lanes of a 512-bit vector).
pub(crate) const ROWS: usize = 16;

impl Kind {
    /// Bytes of a tile (16 rows of one block).
    pub(crate) fn tile_bytes(self) -> usize {
        ROWS * self.block_bytes()
    }

    /// Where the 4-bit planes (or Q8_0's bytes) start in a tile.
    fn quants_at(self) -> usize {
        match self {
            Kind::Q4_0 | Kind::Q8_0 | Kind::Iq4Nl => 32,
            Kind::Q4_1 => 64,
            Kind::Q5_0 => 96,
            Kind::Q5_1 => 128,
        }
    }

    /// Where the fifth-bit plane starts (Q5 types).
    fn qh_at(self) -> Option<usize> {
        match self {
            Kind::Q5_0 => Some(32),
            Kind::Q5_1 => Some(64),
            _ => None,
        }
    }

    /// `u = q + bias` makes the quants unsigned (`IQ4_NL` stores its index instead).
    fn bias(self) -> i32 {
        match self {
            Kind::Q4_0 => 8,
            Kind::Q5_0 => 16,
            Kind::Q8_0 => 128,
            Kind::Q4_1 | Kind::Q5_1 | Kind::Iq4Nl => 0,
        }
    }

    fn has_m(self) -> bool {
        matches!(self, Kind::Q4_1 | Kind::Q5_1)
    }
}

/// Which repacked layout a matrix has: this module's (32-element block types) or
/// [`super::kpacked`]'s (K-quants).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PackKind {
    Blocks(Kind),
    K(KKind),
}

impl From<Kind> for PackKind {
    fn from(kind: Kind) -> PackKind {
        PackKind::Blocks(kind)
    }
}

impl From<KKind> for PackKind {
    fn from(kind: KKind) -> PackKind {
        PackKind::K(kind)
    }
}

impl PackKind {
    /// The repacked layout a GGUF matrix of `dtype` gets on this CPU (and kernel path), if
    /// any: the 32-element types and the K-quants (Q2_K to Q6_K) wherever AVX2 (or AVX-512
    /// VNNI) runs.
    pub(crate) fn of(dtype: GgmlDType) -> Option<PackKind> {
        if let Some(kind) = Kind::of(dtype) {
            return (Packed::available() || crate::simd::avx2()).then_some(PackKind::Blocks(kind));
        }
        KKind::of(dtype)
            .filter(|k| kpacked::repacks(*k) && kpacked::available())
            .map(PackKind::K)
    }

    /// The layout an `IQ4_XS` matrix gets on this CPU when not the IQ4_NL blocks it can be
    /// rewritten as: K-quant tiles (256-value super-blocks, integer sub-block scales, one
    /// float product per super-block instead of eight) where the AVX-512 VNNI or plain AVX2
    /// tile kernels run; `None` where the 32-element tiles' AVX-VNNI kernel (256-bit
    /// `vpdpbusd`, which the K-quant tiles have no kernel for) multiplies IQ4_NL faster.
    pub(crate) fn iq4_xs() -> Option<PackKind> {
        (kpacked::available() && (super::avx512_vnni() || !crate::simd::avx_vnni()))
            .then_some(PackKind::K(KKind::Iq4Xs))
    }
}

/// A weight matrix `(n, k)` in a repacked layout (module docs, [`super::kpacked`]).
pub(crate) struct Packed {
    kind: PackKind,
    n: usize,
    k: usize,
    tiles: Vec<u8>,
}

impl std::fmt::Debug for Packed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Packed")
            .field("kind", &self.kind)
            .field("n", &self.n)
            .field("k", &self.k)
            .finish_non_exhaustive()
    }
}

impl Packed {
    /// Whether this CPU runs the AVX-512 VNNI kernels of the 32-element types (elsewhere
    /// their tiles take the AVX2 kernels of `packed_avx2`).
    pub(crate) fn available() -> bool {
        #[cfg(target_arch = "x86_64")]
        return super::avx512_vnni();
        #[allow(unreachable_code)]
        false
    }

    /// Repacks `raw`: `n` rows of `k` elements in GGUF `kind` blocks, row after row.
    pub(crate) fn new(kind: impl Into<PackKind>, raw: &[u8], n: usize, k: usize) -> Packed {
        let kind = kind.into();
        let tiles = match kind {
            PackKind::Blocks(kind) => pack_blocks(kind, raw, n, k),
            PackKind::K(kind) => kpacked::pack(kind, raw, n, k),
        };
        Packed { kind, n, k, tiles }
    }

    /// Its layout.
    pub(crate) fn kind(&self) -> PackKind {
        self.kind
    }

    /// `(n, k)`.
    pub(crate) fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// Bytes held in memory.
    pub(crate) fn bytes(&self) -> usize {
        self.tiles.len()
    }

    /// The whole matrix dequantized, `(n, k)` f32 on the CPU (export).
    pub(crate) fn dequantize(&self) -> crate::Result<candle_core::Tensor> {
        let mut all = vec![0f32; self.n * self.k];
        for (j, row) in all.chunks_exact_mut(self.k).enumerate() {
            self.dequantize_row(j, row);
        }
        candle_core::Tensor::from_vec(all, (self.n, self.k), &candle_core::Device::Cpu).map_err(
            |cause| crate::Error::Candle {
                context: "dequantizing a repacked matrix".into(),
                cause,
            },
        )
    }

    /// Row `j`, dequantized into `out` (`k` long): an embedding lookup.
    pub(crate) fn dequantize_row(&self, j: usize, out: &mut [f32]) {
        assert!(j < self.n && out.len() == self.k);
        match self.kind {
            PackKind::Blocks(kind) => dequantize_blocks_row(kind, &self.tiles, self.k, j, out),
            PackKind::K(kind) => kpacked::dequantize_row(kind, &self.tiles, self.k, j, out),
        }
    }

    /// `x @ w.T`: `x` holds `m` rows of `k`; the result is `m` rows of `n`.
    pub(crate) fn matmul(&self, x: &[f32]) -> Vec<f32> {
        Packed::matmul_many(&[self], x).pop().unwrap_or_default()
    }

    /// [`Packed::matmul`] of each of `ws` (all of the same `k`) over the same `x`, with `x`
    /// quantized once per activation format and one pass over the thread pool for each
    /// layout family among them.
    pub(crate) fn matmul_many(ws: &[&Packed], x: &[f32]) -> Vec<Vec<f32>> {
        let Some(k) = ws.first().map(|w| w.k) else {
            return Vec::new();
        };
        assert!(ws.iter().all(|w| w.k == k), "matrices of one width");
        let mut outs: Vec<Vec<f32>> = vec![Vec::new(); ws.len()];
        let blocks: Vec<usize> = (0..ws.len())
            .filter(|&i| matches!(ws[i].kind, PackKind::Blocks(_)))
            .collect();
        let kquants: Vec<usize> = (0..ws.len()).filter(|i| !blocks.contains(i)).collect();
        if !blocks.is_empty() {
            for (i, y) in blocks.iter().zip(matmul_blocks(ws, &blocks, k, x)) {
                outs[*i] = y;
            }
        }
        if !kquants.is_empty() {
            let ys = if kpacked::available() {
                let mats: Vec<kpacked::Mat<'_>> = kquants
                    .iter()
                    .map(|&i| kpacked::Mat {
                        kind: ws[i].k_kind(),
                        tiles: &ws[i].tiles,
                        n: ws[i].n,
                    })
                    .collect();
                kpacked::matmul_many(&mats, k, x)
            } else {
                kquants.iter().map(|&i| ws[i].matmul_portable(x)).collect()
            };
            for (i, y) in kquants.iter().zip(ys) {
                outs[*i] = y;
            }
        }
        outs
    }

    /// [`Packed::matmul`] by the AVX2 kernels of a 32-element type, with AVX-VNNI (`vnni`)
    /// or without (the tests' way to reach both on a CPU whose kernel path picks another).
    #[cfg(all(test, target_arch = "x86_64"))]
    pub(crate) fn matmul_avx2(&self, x: &[f32], vnni: bool) -> Vec<f32> {
        let mats = blocks_of(&[self], &[0], |kind, tiles, n| super::packed_avx2::Mat {
            kind,
            tiles,
            n,
        });
        super::packed_avx2::matmul_with(&mats, self.k, x, vnni).remove(0)
    }

    /// [`Packed::matmul`] of a 32-element type by the VNNI kernel, with every whole sixteen
    /// rows on AMX's tile unit (`amx`) or none (the tests' way to hold the AMX products to
    /// the VNNI kernel's on a CPU that runs both, whatever the kernel path).
    #[cfg(all(test, target_arch = "x86_64"))]
    pub(crate) fn matmul_vnni(&self, x: &[f32], amx: bool) -> Vec<f32> {
        assert!(Packed::available(), "the VNNI kernels run on this CPU");
        let mats = blocks_of(&[self], &[0], |kind, tiles, n| avx512::Mat {
            kind,
            tiles,
            n,
        });
        avx512::packed_matmul_with(&mats, self.k, x, amx).remove(0)
    }

    fn k_kind(&self) -> KKind {
        match self.kind {
            PackKind::K(kind) => kind,
            PackKind::Blocks(kind) => unreachable!("{kind:?} is not a K-quant"),
        }
    }

    /// [`Packed::matmul`] without SIMD (dequantized rows times quantized activations): the
    /// reference the kernels are tested against; repacked matrices are only made where the
    /// kernels run.
    pub(crate) fn matmul_portable(&self, x: &[f32]) -> Vec<f32> {
        let kind = match self.kind {
            PackKind::Blocks(kind) => kind,
            PackKind::K(kind) => {
                return kpacked::matmul_portable(kind, &self.tiles, self.n, self.k, x)
            }
        };
        let nb = self.k / QK;
        let m = x.len() / self.k;
        let mut out = vec![0f32; m * self.n];
        let mut w = vec![0f32; self.k];
        let rows: Vec<Vec<BlockQ8>> = x.chunks_exact(self.k).map(super::quantize_row).collect();
        for j in 0..self.n {
            dequantize_blocks_row(kind, &self.tiles, self.k, j, &mut w);
            for (i, row) in rows.iter().enumerate() {
                out[i * self.n + j] = (0..nb)
                    .map(|b| {
                        let y = &row[b];
                        (0..QK)
                            .map(|e| w[b * QK + e] * y.qs[e] as f32 * y.d)
                            .sum::<f32>()
                    })
                    .sum();
            }
        }
        out
    }
}

/// The 32-element-type matrices `which` of `ws` (VNNI where the CPU has it, else the
/// portable loop).
fn matmul_blocks(ws: &[&Packed], which: &[usize], k: usize, x: &[f32]) -> Vec<Vec<f32>> {
    #[cfg(target_arch = "x86_64")]
    if Packed::available() {
        let mats = blocks_of(ws, which, |kind, tiles, n| avx512::Mat { kind, tiles, n });
        return avx512::packed_matmul(&mats, k, x);
    }
    #[cfg(target_arch = "x86_64")]
    if crate::simd::avx2() {
        return super::packed_avx2::matmul(
            &blocks_of(ws, which, |kind, tiles, n| super::packed_avx2::Mat {
                kind,
                tiles,
                n,
            }),
            k,
            x,
        );
    }
    let _ = k;
    which.iter().map(|&i| ws[i].matmul_portable(x)).collect()
}

/// The matrices `which` of `ws` (32-element block types) as a kernel's `M`s.
#[cfg(target_arch = "x86_64")]
fn blocks_of<'a, M>(
    ws: &[&'a Packed],
    which: &[usize],
    mat: impl Fn(Kind, &'a [u8], usize) -> M,
) -> Vec<M> {
    which
        .iter()
        .map(|&i| match ws[i].kind {
            PackKind::Blocks(kind) => mat(kind, &ws[i].tiles, ws[i].n),
            PackKind::K(kind) => unreachable!("{kind:?} is not a 32-element block type"),
        })
        .collect()
}

/// This module's layout of `raw` (`n` rows of `k` in `kind` blocks).
fn pack_blocks(kind: Kind, raw: &[u8], n: usize, k: usize) -> Vec<u8> {
    assert_eq!(k % QK, 0, "columns are whole blocks");
    let (nb, bb, tb) = (k / QK, kind.block_bytes(), kind.tile_bytes());
    assert_eq!(raw.len(), n * nb * bb, "{kind:?} ({n}, {k}) matrix bytes");
    let groups = n.div_ceil(ROWS);
    let mut tiles = vec![0u8; groups * nb * tb];
    for (t, tile) in tiles.chunks_exact_mut(tb).enumerate() {
        let (g, b) = (t / nb, t % nb);
        for r in 0..ROWS.min(n - g * ROWS) {
            let j = g * ROWS + r;
            let blk = &raw[(j * nb + b) * bb..][..bb];
            tile[2 * r..2 * r + 2].copy_from_slice(&blk[..2]);
            if kind.has_m() {
                tile[32 + 2 * r..32 + 2 * r + 2].copy_from_slice(&blk[2..4]);
            }
            // IQ4_NL's tiles are Q4_0's: its 4-bit index stored, not its level.
            let layout = if kind == Kind::Iq4Nl {
                Kind::Q4_0
            } else {
                kind
            };
            let (q, _) = unpack(layout, blk);
            for (e, q) in q.iter().enumerate() {
                let u = (q + layout.bias()) as u8;
                let (i, pos) = (e / 4, 4 * r + e % 4);
                if kind == Kind::Q8_0 {
                    tile[kind.quants_at() + 64 * i + pos] = u;
                    continue;
                }
                tile[kind.quants_at() + 64 * (i % 4) + pos] |= (u & 0xF) << (4 * (i / 4));
                if let Some(at) = kind.qh_at() {
                    tile[at + pos] |= (u >> 4 & 1) << i;
                }
            }
        }
    }
    tiles
}

/// Row `j` of this module's layout (`k` columns of `kind`), dequantized into `out`.
fn dequantize_blocks_row(kind: Kind, tiles: &[u8], k: usize, j: usize, out: &mut [f32]) {
    let (nb, tb) = (k / QK, kind.tile_bytes());
    let (g, r) = (j / ROWS, j % ROWS);
    let half = |t: &[u8], at: usize| f16::from_le_bytes([t[at], t[at + 1]]).to_f32();
    for (b, out) in out.chunks_exact_mut(QK).enumerate() {
        let tile = &tiles[(g * nb + b) * tb..][..tb];
        let d = half(tile, 2 * r);
        let m = if kind.has_m() {
            half(tile, 32 + 2 * r)
        } else {
            -(kind.bias() as f32) * d
        };
        for (e, o) in out.iter_mut().enumerate() {
            let (i, pos) = (e / 4, 4 * r + e % 4);
            let u = if kind == Kind::Q8_0 {
                tile[kind.quants_at() + 64 * i + pos]
            } else {
                let lo = tile[kind.quants_at() + 64 * (i % 4) + pos] >> (4 * (i / 4)) & 0xF;
                let hi = kind.qh_at().map_or(0, |at| tile[at + pos] >> i & 1);
                lo | hi << 4
            };
            *o = if kind == Kind::Iq4Nl {
                f32::from(super::iq4::LEVELS[usize::from(u)]) * d
            } else {
                u as f32 * d + m
            };
        }
    }
}

/// Not a check: the rate of the repacked products on this CPU's kernel path, per row count
/// (1: a decode step; 8: eight sequences'; 64: a prompt), for SmolLM2's MLP shape (Q4_1) and a
/// K-quant one (Q4_K, Q6_K). `cargo test --workspace --lib tile_matmul_rate -- --ignored
/// --nocapture` (`RAYON_NUM_THREADS=1` for one core).
#[cfg(test)]
mod timing {
    use super::super::kquant::KKind;
    use super::super::test_util::{uniform, weights};
    use super::*;
    use candle_core::quantized::GgmlDType;

    #[test]
    #[ignore]
    fn tile_matmul_rate() {
        let mut next = uniform(7);
        let shapes = [
            (
                "q4_1 576x1536",
                PackKind::from(Kind::Q4_1),
                GgmlDType::Q4_1,
                576,
            ),
            ("q4_k 1536x1536", KKind::Q4K.into(), GgmlDType::Q4K, 1536),
            ("q6_k 1536x1536", KKind::Q6K.into(), GgmlDType::Q6K, 1536),
        ];
        let n = 1536;
        for (name, kind, dtype, k) in shapes {
            let vals: Vec<f32> = (0..n * k).map(|_| next()).collect();
            let p = Packed::new(kind, &weights(&vals, n, k, dtype).0, n, k);
            for m in [1usize, 8, 64] {
                let x: Vec<f32> = (0..m * k).map(|_| next()).collect();
                let reps = 2000 / m + 30;
                let _ = p.matmul(&x);
                let t = std::time::Instant::now();
                for _ in 0..reps {
                    std::hint::black_box(p.matmul(&x));
                }
                let dt = t.elapsed().as_secs_f64() / reps as f64;
                let rate = (m * n * k) as f64 / dt / 1e9;
                println!("{name}, {m} rows: {rate:.1} G multiply-adds/s");
            }
        }
    }
}
