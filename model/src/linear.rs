//! Projections and the token embedding over dense or quantized weights.
//!
//! GGUF weights stay in their quantized blocks (candle's `QTensor`): a decode step multiplies
//! with them directly (activations quantized to 8 bits per block, llama.cpp's scheme), so
//! a decoded token reads the GGUF file's bytes instead of 4-8x as many f32 ones. On the CPU,
//! matrices are repacked at load into tiles of sixteen interleaved rows where the CPU runs
//! their tiled kernels ([`crate::quant::packed`]: the 32-element block types on AVX-512
//! VNNI, Q4_K/Q5_K/Q6_K on AVX-512 VNNI or AVX2); the rest stay in the file's blocks and run
//! the row kernels ([`crate::quant`], [`crate::quant::kquant`], [`crate::quant::half_rows`]);
//! CUDA runs candle's. Prefill runs the same kernels as decode (several activation rows per
//! decoded weight tile): one path keeps memory at the file's size, with no transient f32 copy
//! of a matrix.
//!
//! Dense weights (HF safetensors, or `model.weights = "dequantized"`) use the plain matmul.

use std::sync::Arc;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Module, Shape, Tensor};

use crate::error::{Ctx, Result};
use crate::quant::half_rows::{self, HalfKind};
use crate::quant::kquant::{self, KKind};
use crate::quant::packed::Packed;
use crate::quant::{self, Kind};

/// A linear layer `x @ w.T + b`, `w` of shape `(out, in)`.
#[derive(Debug)]
pub(crate) enum Proj {
    Dense {
        w: Tensor,
        b: Option<Tensor>,
    },
    Quant {
        mm: Kernel,
        /// `(out, in)`.
        dims: (usize, usize),
        b: Option<Tensor>,
        /// Compute dtype of the activations (the quantized kernels take f32).
        dtype: DType,
    },
}

impl Proj {
    pub(crate) fn dense(w: Tensor, b: Option<Tensor>) -> Proj {
        Proj::Dense { w, b }
    }

    /// A repacked matrix ([`crate::quant::packed::PackKind::of`] says which ones).
    pub(crate) fn packed(w: Arc<Packed>, b: Option<Tensor>, dtype: DType) -> Proj {
        Proj::Quant {
            dims: w.dims(),
            mm: Kernel::Packed(w),
            b,
            dtype,
        }
    }

    /// A projection in the file's blocks: on the CPU the 32-element block types, K-quants and
    /// F16/BF16 run our row kernels ([`Rows`]); CUDA and other types candle's.
    pub(crate) fn quant(w: Arc<QTensor>, b: Option<Tensor>, dtype: DType) -> Result<Proj> {
        let dims = w.shape().dims2().ctx("weight dims")?;
        let rows = match (
            Kind::of(w.dtype()),
            KKind::of(w.dtype()),
            HalfKind::of(w.dtype()),
        ) {
            (Some(kind), ..) => Some(Rows::Blocks(kind)),
            (_, Some(kind), _) => Some(Rows::K(kind)),
            (.., Some(kind)) => Some(Rows::Half(kind)),
            _ => None,
        };
        let mm = match rows {
            Some(rows) if w.device().is_cpu() => Kernel::Rows(FileRows { w: w.clone(), rows }),
            _ => Kernel::Candle(QMatMul::from_arc(w.clone()).ctx("quantized weight")?),
        };
        Ok(Proj::Quant { mm, dims, b, dtype })
    }

    fn bias(&self) -> Option<&Tensor> {
        match self {
            Proj::Dense { b, .. } | Proj::Quant { b, .. } => b.as_ref(),
        }
    }

    /// `(out, in)`.
    pub(crate) fn dims(&self) -> Result<(usize, usize)> {
        match self {
            Proj::Dense { w, .. } => w.dims2().ctx("weight dims"),
            Proj::Quant { dims, .. } => Ok(*dims),
        }
    }

    /// [`Proj::forward`] of each projection over the same `x`: the repacked matrices among
    /// them (f32 activations on the CPU) in one product ([`Packed::matmul_many`]: `x`
    /// quantized once, one pass over the thread pool), the others one after the other.
    pub(crate) fn forward_many<const N: usize>(
        projs: [&Proj; N],
        x: &Tensor,
    ) -> Result<[Tensor; N]> {
        let packed = |p: &Proj| match p {
            Proj::Quant {
                mm: Kernel::Packed(w),
                dtype: DType::F32,
                ..
            } if x.device().is_cpu() && x.dtype() == DType::F32 => Some(w.clone()),
            _ => None,
        };
        let ws: Vec<(usize, Arc<Packed>)> = projs
            .iter()
            .enumerate()
            .filter_map(|(i, p)| packed(p).map(|w| (i, w)))
            .collect();
        let mut ys: [Option<Tensor>; N] = std::array::from_fn(|_| None);
        if ws.len() > 1 {
            let x = x.contiguous().ctx("x")?;
            let (n, k) = ws[0].1.dims();
            let outs = {
                let (store, layout) = x.storage_and_layout();
                let xs = match &*store {
                    candle_core::Storage::Cpu(cpu) => f32_input(cpu, layout, n, k),
                    _ => Err(candle_core::Error::Msg("not a CPU tensor".into())),
                }
                .ctx("quantized matmul")?;
                let mats: Vec<&Packed> = ws.iter().map(|(_, w)| &**w).collect();
                Packed::matmul_many(&mats, xs)
            };
            let lead = &x.dims()[..x.rank() - 1];
            for ((i, w), y) in ws.iter().zip(outs) {
                let shape: Vec<usize> = lead.iter().copied().chain([w.dims().0]).collect();
                let y = Tensor::from_vec(y, shape, x.device()).ctx("quantized matmul")?;
                ys[*i] = Some(add_bias(y, projs[*i].bias())?);
            }
        }
        for (y, p) in ys.iter_mut().zip(projs) {
            if y.is_none() {
                *y = Some(p.forward(x)?);
            }
        }
        Ok(ys.map(|y| y.expect("every projection computed")))
    }

    /// `x @ w.T + b` for `x` of shape `(..., in)`.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Proj::Dense { w, b } => add_bias(gemm(x, w)?, b.as_ref()),
            Proj::Quant { mm, b, dtype, .. } => {
                let y = if *dtype == DType::F32 {
                    mm.forward(&x.contiguous().ctx("x")?)?
                } else {
                    let y = mm.forward(&x.to_dtype(DType::F32).ctx("x")?)?;
                    y.to_dtype(*dtype).ctx("qmatmul")?
                };
                add_bias(y, b.as_ref())
            }
        }
    }
}

impl Proj {
    /// [`Proj::forward`] of rows already normed and quantized on the GPU
    /// ([`crate::gpu_ops::norm_q8`]): `(1, rows, out)`; `None` where this projection is not
    /// candle's quantized product in f32 (the caller then runs the norm and the product apart).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn forward_q8(&self, y: &crate::gpu_ops::Q8Rows) -> Result<Option<Tensor>> {
        let Proj::Quant {
            mm: Kernel::Candle(QMatMul::QTensor(w)),
            b,
            dtype: DType::F32,
            ..
        } = self
        else {
            return Ok(None);
        };
        match crate::gpu_ops::product_q8(w, y).ctx("quantized matmul")? {
            Some(out) => add_bias(out, b.as_ref()).map(Some),
            None => Ok(None),
        }
    }
}

/// `x @ w.T` over a dense `w` `(out, in)`.
fn gemm(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    x.broadcast_matmul(&w.t().ctx("w.T")?).ctx("matmul")
}

/// The quantized product's implementation.
#[derive(Debug)]
pub(crate) enum Kernel {
    /// The repacked kernels ([`crate::quant::packed`], [`crate::quant::kpacked`]).
    Packed(Arc<Packed>),
    /// The file's blocks, multiplied by one of the CPU row kernels ([`Rows`]).
    Rows(FileRows),
    /// candle's (CUDA, and the block types the CPU kernels do not take).
    Candle(QMatMul),
}

impl Kernel {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Kernel::Packed(p) => x
                .apply_op1_no_bwd(&PackedOp(p.clone()))
                .ctx("quantized matmul"),
            // Prefill-sized inputs of the K-quants left in file order (no tiled kernels on
            // this CPU) take candle's product: the row kernels decode every weight block
            // again for each four rows, and lose prefill to it.
            Kernel::Rows(
                r @ FileRows {
                    rows: Rows::K(_), ..
                },
            ) if x.elem_count() / r.w.shape().dims2().ctx("dims")?.1 > 8 => {
                x.apply_op1_no_bwd(r.w.as_ref()).ctx("quantized matmul")
            }
            Kernel::Rows(r) => x.apply_op1_no_bwd(r).ctx("quantized matmul"),
            Kernel::Candle(mm) => mm.forward(x).ctx("quantized matmul"),
        }
    }
}

/// Which CPU row kernels multiply a matrix kept in its file's blocks.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Rows {
    /// [`quant::matmul`]: the 32-element block types.
    Blocks(Kind),
    /// [`kquant::matmul`]: K-quants.
    K(KKind),
    /// [`half_rows::matmul`]: F16 / BF16.
    Half(HalfKind),
}

/// A matrix in its file's blocks and its row kernels, as a candle operation on f32 CPU
/// tensors `(..., k)` -> `(..., n)`.
#[derive(Debug)]
pub(crate) struct FileRows {
    w: Arc<QTensor>,
    rows: Rows,
}

impl CustomOp1 for FileRows {
    fn name(&self) -> &'static str {
        "ragkv-rows-matmul"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (n, k) = self.w.shape().dims2()?;
        let x = f32_input(storage, layout, n, k)?;
        let data = self.w.data()?;
        let y = match self.rows {
            Rows::Blocks(kind) => quant::matmul(kind, &data, n, k, x),
            Rows::K(kind) => kquant::matmul(kind, &data, n, k, x),
            Rows::Half(kind) => half_rows::matmul(kind, &data, n, k, x),
        };
        let mut out = layout.dims().to_vec();
        *out.last_mut().expect("rank checked") = n;
        Ok((CpuStorage::F32(y), Shape::from(out)))
    }
}

/// [`Packed::matmul`] as a candle operation on f32 CPU tensors `(..., k)` -> `(..., n)`.
#[derive(Debug)]
struct PackedOp(Arc<Packed>);

impl CustomOp1 for PackedOp {
    fn name(&self) -> &'static str {
        "ragkv-packed-matmul"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (n, k) = self.0.dims();
        let x = f32_input(storage, layout, n, k)?;
        let y = self.0.matmul(x);
        let mut out = layout.dims().to_vec();
        *out.last_mut().expect("rank checked") = n;
        Ok((CpuStorage::F32(y), Shape::from(out)))
    }
}

/// The contiguous f32 input `(..., k)` of a product with an `(n, k)` weight.
fn f32_input<'a>(
    storage: &'a CpuStorage,
    layout: &Layout,
    n: usize,
    k: usize,
) -> candle_core::Result<&'a [f32]> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("quantized matmul: input is not contiguous");
    };
    let dims = layout.dims();
    if dims.last() != Some(&k) {
        candle_core::bail!("quantized matmul: input {dims:?} against weight ({n}, {k})");
    }
    let CpuStorage::F32(x) = storage else {
        candle_core::bail!("quantized matmul: the input is not f32");
    };
    Ok(&x[start..end])
}

fn add_bias(y: Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    match b {
        Some(b) => y.broadcast_add(b).ctx("bias"),
        None => Ok(y),
    }
}

/// The token embedding table `(vocab, hidden)`.
#[derive(Debug)]
pub(crate) enum Embedding {
    Dense(Tensor),
    /// Quantized rows, dequantized per lookup.
    Quant {
        table: Arc<QTensor>,
        dtype: DType,
    },
    /// A repacked matrix (shared with the output projection when tied), dequantized per
    /// lookup.
    Packed {
        table: Arc<Packed>,
        dtype: DType,
        device: Device,
    },
}

impl Embedding {
    /// Rows for `ids` `(n,)`: `(n, hidden)`.
    pub(crate) fn lookup(&self, ids: &Tensor) -> Result<Tensor> {
        match self {
            Embedding::Dense(t) => t.index_select(ids, 0).ctx("embed"),
            Embedding::Quant { table, dtype } => table
                .embedding(ids)
                .and_then(|t| t.to_dtype(*dtype))
                .ctx("embed"),
            Embedding::Packed {
                table,
                dtype,
                device,
            } => {
                let ids: Vec<u32> = ids.to_vec1().ctx("embed ids")?;
                let (vocab, hidden) = table.dims();
                let mut rows = vec![0f32; ids.len() * hidden];
                for (id, row) in ids.iter().zip(rows.chunks_exact_mut(hidden)) {
                    let id = *id as usize;
                    if id >= vocab {
                        return Err(crate::Error::Input {
                            why: format!("token id {id} outside the vocabulary ({vocab})"),
                        });
                    }
                    table.dequantize_row(id, row);
                }
                Tensor::from_vec(rows, (ids.len(), hidden), device)
                    .and_then(|t| t.to_dtype(*dtype))
                    .ctx("embed")
            }
        }
    }
}
