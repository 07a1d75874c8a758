//! Attention on the general path (any device and dtype): masks and grouped-query attention
//! with candle's operations. The CPU's f32 path attends in place instead
//! ([`crate::attention`]).

use candle_core::Tensor;

use super::{Decoder, Layer};
use crate::error::{Ctx, Result};

impl Decoder {
    /// Whether the query at cache index `q` sees the key at `k`: causal, and within
    /// `window` if given (HF's rule: `q - k < window`).
    pub(super) fn visible(q: usize, k: usize, window: Option<usize>) -> bool {
        k <= q && window.is_none_or(|w| q - k < w)
    }

    /// Additive mask `(queries.len(), t)` for queries at the given cache indices over keys
    /// `0..t`, within `window`.
    pub(super) fn mask_at(
        &self,
        queries: impl Iterator<Item = usize>,
        t: usize,
        window: Option<usize>,
    ) -> Result<Tensor> {
        let mut m = Vec::new();
        let mut s = 0;
        for q in queries {
            s += 1;
            m.extend((0..t).map(|k| {
                if Self::visible(q, k, window) {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            }));
        }
        Tensor::from_vec(m, (s, t), &self.device)
            .and_then(|m| m.to_dtype(self.dtype))
            .ctx("mask")
    }

    /// Causal mask `(s, t)` of layer `layer`: query `i` (at cache index `t - s + i`) sees
    /// keys `0..=t - s + i` (within the layer's window).
    pub(super) fn mask(&self, s: usize, t: usize, layer: usize) -> Result<Tensor> {
        self.mask_at((t - s)..t, t, self.cfg.window_of(layer))
    }

    /// [`Decoder::attend_heads`] through the layer's output projection (and its output norm,
    /// if it has one): what the layer adds to the residual stream.
    pub(super) fn attend(
        &self,
        layer: &Layer,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        self.attn_out(layer, &self.attend_heads(q, k, v, mask)?)
    }

    /// Attention of rotated queries `q` (b, heads, s, d) over keys and values
    /// (b, kv_heads, t, d), with an optional additive mask `(s, t)`: the heads' outputs
    /// `(b, s, heads * d)`, before the output projection.
    pub(super) fn attend_heads(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (nh, hd) = (self.cfg.heads, self.cfg.head_dim);
        let (b, _, s, _) = q.dims4().ctx("q dims")?;
        let (k, v) = (k.contiguous().ctx("k")?, v.contiguous().ctx("v")?);
        let q = self.grouped(q)?;
        let att = self.probs(&q, &k, mask)?;
        let y = att.matmul(&v).ctx("av")?; // (b, nkv, rep * s, hd)
        y.reshape((b, nh, s, hd))
            .and_then(|y| y.transpose(1, 2))
            .and_then(|y| y.reshape((b, s, nh * hd)))
            .ctx("attn out")
    }

    /// Grouped-query attention without materializing repeated K/V: the `rep` query heads
    /// that share a KV head are stacked along the sequence axis, `(b, kv_heads, rep * s, d)`.
    pub(super) fn grouped(&self, q: &Tensor) -> Result<Tensor> {
        let cfg = &self.cfg;
        let (b, _, s, _) = q.dims4().ctx("q dims")?;
        let rep = cfg.heads / cfg.kv_heads;
        q.contiguous()
            .and_then(|q| q.reshape((b, cfg.kv_heads, rep * s, cfg.head_dim)))
            .ctx("q groups")
    }

    /// Attention probabilities of grouped queries `q` ([`Decoder::grouped`]) over contiguous
    /// keys `(b, kv_heads, t, d)` with an optional additive mask `(s, t)`:
    /// `(b, kv_heads, rep * s, t)`.
    pub(super) fn probs(&self, q: &Tensor, k: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
        let (b, nkv, rs, _) = q.dims4().ctx("q dims")?;
        let t = k.dim(2).ctx("k len")?;
        let scale = self.cfg.attn_scale();
        let att = (q.matmul(&k.t().ctx("k t")?).ctx("qk")? * scale).ctx("scale")?;
        let att = match mask {
            Some(m) => {
                let s = m.dim(0).ctx("mask rows")?;
                att.reshape((b, nkv, rs / s, s, t))
                    .and_then(|a| a.broadcast_add(m))
                    .and_then(|a| a.reshape((b, nkv, rs, t)))
                    .ctx("mask")?
            }
            None => att,
        };
        candle_nn::ops::softmax_last_dim(&att).ctx("softmax")
    }
}
