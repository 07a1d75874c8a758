//! Projections of one input joined into one matrix on a GPU.
//!
//! A decode step on the GPU is bound by kernel launches, not by arithmetic: each of candle's
//! quantized products is two launches (the activations quantized to 8 bits, then the product)
//! with their own output allocations. Where the projections of one input (Q, K and V; gate and
//! up) are in the same block type over the same input width, their rows are concatenated at
//! load into one matrix (GGUF blocks are row-major: the join is the files' bytes one after the
//! other), multiplied once; the outputs are views of the product's columns. On the CPU the
//! projections stay apart: the repacked kernels already quantize the input once for all of
//! them ([`Proj::forward_many`]).

use std::borrow::Cow;
use std::sync::Arc;

use candle_core::quantized::{QMatMul, QStorage, QTensor};
use candle_core::{Tensor, D};

use crate::error::{Ctx, Result};
use crate::linear::{Kernel, Proj};

/// `N` projections of the same input, apart or joined.
#[derive(Debug)]
pub(crate) enum Joined<const N: usize> {
    Apart([Proj; N]),
    /// One matrix whose output columns are the projections' outputs, `widths` wide each.
    Joined {
        proj: Proj,
        widths: [usize; N],
    },
}

impl<const N: usize> Joined<N> {
    /// Joins `projs` when they run candle's quantized product on a GPU with one block type
    /// and input width (and all or none have a bias); keeps them apart otherwise.
    pub(crate) fn new(projs: [Proj; N]) -> Result<Joined<N>> {
        let on_gpu = projs.iter().all(|p| match p {
            Proj::Quant {
                mm: Kernel::Candle(QMatMul::QTensor(w)),
                ..
            } => w.device().is_cuda(),
            _ => false,
        });
        if on_gpu && std::env::var("RAGKV_CUDA_JOIN").as_deref() != Ok("off") {
            if let Some(joined) = join(&projs)? {
                return Ok(joined);
            }
        }
        Ok(Joined::Apart(projs))
    }

    /// Whether the projections are one matrix.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn is_joined(&self) -> bool {
        matches!(self, Joined::Joined { .. })
    }

    /// The joined product of `x` (`(…, in)`): `(…, Σ out_i)`, the projections' outputs side
    /// by side; `None` when the projections are apart.
    pub(crate) fn joined(&self, x: &Tensor) -> Result<Option<Tensor>> {
        match self {
            Joined::Apart(_) => Ok(None),
            Joined::Joined { proj, .. } => proj.forward(x).map(Some),
        }
    }

    /// [`Joined::joined`] of rows already normed and quantized on the GPU; `None` when the
    /// projections are apart or not candle's quantized product.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn joined_q8(&self, y: &crate::gpu_ops::Q8Rows) -> Result<Option<Tensor>> {
        match self {
            Joined::Apart(_) => Ok(None),
            Joined::Joined { proj, .. } => proj.forward_q8(y),
        }
    }

    /// Each projection of `x` (`(…, in)`): `(…, out_i)`.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<[Tensor; N]> {
        match self {
            Joined::Apart(projs) => Proj::forward_many(std::array::from_fn(|i| &projs[i]), x),
            Joined::Joined { proj, widths } => {
                let y = proj.forward(x)?;
                let mut at = 0;
                let mut outs = Vec::with_capacity(N);
                for w in widths {
                    outs.push(y.narrow(D::Minus1, at, *w).ctx("joined projection")?);
                    at += w;
                }
                Ok(outs.try_into().expect("N outputs"))
            }
        }
    }
}

/// The joined matrix of `projs`, or `None` when they cannot be joined.
fn join<const N: usize>(projs: &[Proj; N]) -> Result<Option<Joined<N>>> {
    let mut ws: Vec<&Arc<QTensor>> = Vec::with_capacity(N);
    let mut biases = Vec::with_capacity(N);
    let mut dtype = None;
    for p in projs {
        let Proj::Quant {
            mm: Kernel::Candle(QMatMul::QTensor(w)),
            b,
            dtype: dt,
            ..
        } = p
        else {
            return Ok(None);
        };
        ws.push(w);
        biases.extend(b.iter());
        dtype = Some(*dt);
    }
    let (first, dtype) = (ws[0], dtype.expect("N > 0"));
    let in_dim = first.shape().dims2().ctx("weight dims")?.1;
    let same = ws.iter().all(|w| {
        w.dtype() == first.dtype()
            && w.shape().dims2().is_ok_and(|(_, k)| k == in_dim)
            && w.device().same_device(&first.device())
    });
    if !same || !(biases.is_empty() || biases.len() == N) {
        return Ok(None);
    }
    let mut widths = [0usize; N];
    let mut bytes = Vec::new();
    for (i, w) in ws.iter().enumerate() {
        widths[i] = w.shape().dims2().ctx("weight dims")?.0;
        bytes.extend_from_slice(&w.data().ctx("joining projections")?);
    }
    let rows: usize = widths.iter().sum();
    let storage = QStorage::from_data(Cow::Owned(bytes), &first.device(), first.dtype())
        .ctx("joining projections")?;
    let w = QTensor::new(storage, (rows, in_dim)).ctx("joining projections")?;
    let b = if biases.is_empty() {
        None
    } else {
        Some(Tensor::cat(&biases, 0).ctx("joining biases")?)
    };
    let proj = Proj::Quant {
        mm: Kernel::Candle(QMatMul::from_arc(Arc::new(w)).ctx("joined weight")?),
        dims: (rows, in_dim),
        b,
        dtype,
    };
    Ok(Some(Joined::Joined { proj, widths }))
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::GgmlDType;
    use candle_core::{DType, Device};

    use super::*;

    fn candle_proj(rows: usize, k: usize, seed: f32, bias: bool) -> Proj {
        let dev = Device::Cpu;
        let w = Tensor::arange(0f32, (rows * k) as f32, &dev)
            .and_then(|t| t.affine(0.37, seed as f64)?.sin())
            .and_then(|t| t.reshape((rows, k)))
            .unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q4_0).unwrap();
        let b = bias.then(|| {
            Tensor::arange(0f32, rows as f32, &dev)
                .and_then(|t| t.affine(0.01, 0.0))
                .unwrap()
        });
        Proj::Quant {
            mm: Kernel::Candle(QMatMul::from_arc(Arc::new(q)).unwrap()),
            dims: (rows, k),
            b,
            dtype: DType::F32,
        }
    }

    /// The joined product's columns are the separate products, bit for bit (the same blocks,
    /// the same activations).
    #[test]
    fn joined_columns_are_the_separate_products() {
        for bias in [false, true] {
            let parts = [(64, 0.1), (32, 0.7), (32, 1.3)];
            let apart: [Proj; 3] = parts.map(|(r, s)| candle_proj(r, 128, s, bias));
            let joined = join(&parts.map(|(r, s)| candle_proj(r, 128, s, bias)))
                .unwrap()
                .expect("same block type and width");
            assert!(matches!(
                joined,
                Joined::Joined {
                    widths: [64, 32, 32],
                    ..
                }
            ));
            let x = Tensor::arange(0f32, 3.0 * 128.0, &Device::Cpu)
                .and_then(|t| t.affine(0.05, 0.0)?.cos())
                .and_then(|t| t.reshape((1, 3, 128)))
                .unwrap();
            let got = joined.forward(&x).unwrap();
            for (p, g) in apart.iter().zip(&got) {
                let want = p.forward(&x).unwrap();
                assert_eq!(g.dims(), want.dims());
                let (g, w) = (
                    g.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    want.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                );
                assert_eq!(g, w);
            }
        }
    }

    /// Different block types or input widths stay apart.
    #[test]
    fn mismatched_projections_are_not_joined() {
        let a = candle_proj(32, 128, 0.1, false);
        let b = candle_proj(32, 256, 0.2, false);
        assert!(join(&[a, b]).unwrap().is_none());
        let c = candle_proj(32, 128, 0.1, true);
        let d = candle_proj(32, 128, 0.2, false);
        assert!(join(&[c, d]).unwrap().is_none());
    }
}
