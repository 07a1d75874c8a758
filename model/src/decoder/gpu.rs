//! The decoder's fused steps on a GPU ([`crate::gpu_ops`]): where a layer's Q/K/V projection
//! is one joined matrix ([`crate::joined`]), its output rows are rotated and stored into every
//! sequence's cache in one launch per sequence (rows recomputed in place too, at the indices
//! the step gives them), instead of candle's reshapes, copies, two rotations, dtype
//! conversions and slice writes; the MLP's gate is one launch over the joined gate/up output.
//! Anything else (the CPU, per-head norms, a q8 cache) answers `None` and takes the general
//! path.

use candle_core::{DType, Tensor};

use super::{Decoder, Layer, Span};
use crate::error::{Ctx, Result};
use crate::kv::KvCache;

impl Decoder {
    /// Layer `i`'s queries `(1, heads, n, d)` over the normed input `h` `(1, n, hidden)`, its
    /// keys and values stored into each sequence's cache (past its length, recomputed rows at
    /// their own indices), and each cache's live rows after them; `None` (nothing computed or
    /// written) where the fused path does not apply.
    #[allow(clippy::type_complexity)]
    pub(super) fn qkv_stored(
        &self,
        layer: &Layer,
        i: usize,
        h: &Tensor,
        seqs: &mut [(&mut KvCache, &[u32], &[usize])],
        spans: &[Span],
        (cos, sin): (&Tensor, &Tensor),
    ) -> Result<Option<(Tensor, Vec<(Tensor, Tensor)>)>> {
        let applies = self.device.is_cuda()
            && self.dtype == DType::F32
            && layer.q_norm.is_none()
            && layer.k_norm.is_none()
            && spans
                .iter()
                .all(|sp| sp.redo + sp.appended > 0 && (sp.redo == 0 || sp.at_dev.is_some()))
            && seqs
                .iter()
                .all(|(c, _, _)| matches!(c.dtype(), DType::F16 | DType::F32));
        if !applies {
            return Ok(None);
        }
        let (heads, d) = (self.cfg.heads, self.cfg.head_dim);
        let n = h.dim(1).ctx("layer input")?;
        let Some(q) = crate::gpu_ops::new_queries(h, heads, n, d).ctx("queries")? else {
            return Ok(None);
        };
        let Some(y) = layer.qkv.joined(h)? else {
            return Ok(None);
        };
        let y = y.contiguous().ctx("qkv")?;
        let interleaved = self.rope_of(i).interleaved();
        let mut views = Vec::with_capacity(spans.len());
        for (k, ((cache, _, _), sp)) in seqs.iter_mut().zip(spans).enumerate() {
            cache.reserve(sp.appended)?;
            let at = cache.len();
            let n = sp.redo + sp.appended;
            let rows = |t: &Tensor, dim: usize| t.narrow(dim, sp.first, n);
            let (kc, vc) = cache.buffers(i);
            let stored = crate::gpu_ops::rope_store(
                &rows(&y, 1).ctx("qkv rows")?,
                (
                    &rows(cos, 0).ctx("rope rows")?,
                    &rows(sin, 0).ctx("rope rows")?,
                ),
                &q,
                sp.first,
                (kc, vc),
                at,
                interleaved,
                None,
                // Rows recomputed in place: every row's cache index (each below the length
                // after this step's appended rows, which `reserve` made room for).
                sp.at_dev.as_ref(),
            )
            .ctx("rope and store")?;
            if !stored {
                // Only the first sequence can be refused (every check is the same for all);
                // nothing has been written then.
                debug_assert_eq!(k, 0, "rope_store refused a later sequence");
                return Ok(None);
            }
            views.push(cache.rows(i, at + sp.appended)?);
        }
        Ok(Some((q, views)))
    }

    /// `silu(gate) · up` of the normed input `h` over the joined gate/up projection on a
    /// GPU; `None` where it does not apply.
    pub(super) fn gate_fused(&self, layer: &Layer, h: &Tensor) -> Result<Option<Tensor>> {
        if !self.device.is_cuda() || self.cfg.activation != crate::config::Activation::Silu {
            return Ok(None);
        }
        let Some(gu) = layer.gate_up.joined(h)? else {
            return Ok(None);
        };
        let gu = gu.contiguous().ctx("gate/up")?;
        match crate::gpu_ops::swiglu_joined(&gu).ctx("swiglu")? {
            Some(y) => Ok(Some(y)),
            None => {
                let w = gu.dim(candle_core::D::Minus1).ctx("gate/up")? / 2;
                let g = gu.narrow(candle_core::D::Minus1, 0, w).ctx("gate")?;
                let u = gu.narrow(candle_core::D::Minus1, w, w).ctx("up")?;
                crate::swiglu::swiglu(&g, &u).map(Some).ctx("swiglu")
            }
        }
    }
}
