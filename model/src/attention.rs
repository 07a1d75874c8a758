//! Attention of one decoding token over its sequence's cache, on the CPU, reading the cache
//! in place.
//!
//! The general path (`Decoder::attend_heads`) is a dozen candle operations per layer, and
//! its products need the keys and values contiguous: every step copied the sequence's whole
//! cache of every layer (`capacity` rows per head, of which the first `t` are live). For one
//! query token this kernel reads the live rows where they are, one head per task on candle's
//! thread pool: scores, softmax and the weighted sum of values in f32, grouped-query heads
//! sharing their KV head. Used for f32 caches on the CPU; prompts (several tokens) and other
//! dtypes or devices take the general path.

use candle_core::{CpuStorage, CustomOp3, Layout, Shape};

use crate::quant::SharedOut;

/// The op: query `(1, heads, 1, d)` (any strides), keys and values `(1, kv_heads, t, d)` with
/// unit stride along `d` (a cache's live rows); output `(1, 1, heads * d)`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DecodeAttention {
    /// The first visible key (a sliding window's start; 0 without one).
    pub from: usize,
    pub scale: f32,
}

/// `a · b`, eight lanes at a time (a form the compiler vectorizes).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

impl CustomOp3 for DecodeAttention {
    fn name(&self) -> &'static str {
        "ragkv-decode-attention"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        ql: &Layout,
        k: &CpuStorage,
        kl: &Layout,
        v: &CpuStorage,
        vl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v)) = (q, k, v) else {
            candle_core::bail!("decode attention: f32 only");
        };
        let (&[1, heads, 1, d], &[1, kv_heads, t, kd]) = (ql.dims(), kl.dims()) else {
            candle_core::bail!(
                "decode attention: query {:?}, keys {:?}",
                ql.dims(),
                kl.dims()
            );
        };
        let (qs, ks, vs) = (ql.stride(), kl.stride(), vl.stride());
        if kd != d
            || vl.dims() != kl.dims()
            || ks[3] != 1
            || vs[3] != 1
            || kv_heads == 0
            || heads % kv_heads != 0
            || self.from >= t
        {
            candle_core::bail!(
                "decode attention: query {:?}, keys {:?} (strides {ks:?}), values {:?} \
                 (strides {vs:?}), from {}",
                ql.dims(),
                kl.dims(),
                vl.dims(),
                self.from
            );
        }
        let rep = heads / kv_heads;
        let (q0, k0, v0) = (ql.start_offset(), kl.start_offset(), vl.start_offset());
        let mut out = vec![0f32; heads * d];
        let dst = SharedOut(out.as_mut_ptr());
        candle_core::utils::barrier_pool().execute_chunked(heads, |range| {
            let dst = &dst;
            let mut qh = vec![0f32; d];
            let mut p = Vec::with_capacity(t - self.from);
            for h in range {
                for (i, x) in qh.iter_mut().enumerate() {
                    *x = q[q0 + h * qs[1] + i * qs[3]];
                }
                let g = h / rep;
                let (kb, vb) = (k0 + g * ks[1], v0 + g * vs[1]);
                p.clear();
                let mut max = f32::NEG_INFINITY;
                for j in self.from..t {
                    let at = kb + j * ks[2];
                    let s = dot(&qh, &k[at..at + d]) * self.scale;
                    max = max.max(s);
                    p.push(s);
                }
                let mut sum = 0f32;
                for s in p.iter_mut() {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                // SAFETY: the pool hands out disjoint ranges of heads; head `h` owns
                // `out[h * d..(h + 1) * d]`, and `out` outlives `execute_chunked`.
                let o = unsafe { std::slice::from_raw_parts_mut(dst.0.add(h * d), d) };
                for (j, w) in (self.from..t).zip(&p) {
                    let at = vb + j * vs[2];
                    let w = w / sum;
                    for (o, x) in o.iter_mut().zip(&v[at..at + d]) {
                        *o += w * x;
                    }
                }
            }
        });
        Ok((CpuStorage::F32(out), Shape::from((1, 1, heads * d))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// Against softmax(q kᵀ · scale) v with candle's operations, on cache-like views (live
    /// rows of a larger buffer), grouped heads, with and without a window start.
    #[test]
    fn matches_the_reference_on_cache_views() {
        let dev = Device::Cpu;
        let (heads, kv, d, cap, t) = (6, 2, 20, 40, 29);
        let q = Tensor::randn(0f32, 1.0, (1, heads, 3, d), &dev).unwrap();
        let q = q.narrow(2, 1, 1).unwrap(); // strided, as a batch's row is
        let kc = Tensor::randn(0f32, 1.0, (1, kv, cap, d), &dev).unwrap();
        let vc = Tensor::randn(0f32, 1.0, (1, kv, cap, d), &dev).unwrap();
        let (k, v) = (kc.narrow(2, 0, t).unwrap(), vc.narrow(2, 0, t).unwrap());
        let scale = 1.0 / (d as f32).sqrt();
        for from in [0, 11] {
            let op = DecodeAttention { from, scale };
            let got = q.apply_op3_no_bwd(&k, &v, &op).unwrap();
            let rep = heads / kv;
            let qg = q.contiguous().unwrap().reshape((1, kv, rep, d)).unwrap();
            let (kw, vw) = (
                k.narrow(2, from, t - from).unwrap().contiguous().unwrap(),
                v.narrow(2, from, t - from).unwrap().contiguous().unwrap(),
            );
            let att = (qg.matmul(&kw.t().unwrap()).unwrap() * scale as f64).unwrap();
            let att = candle_nn::ops::softmax_last_dim(&att).unwrap();
            let want = att.matmul(&vw).unwrap().reshape((1, 1, heads * d)).unwrap();
            let diff = (got - want)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(diff < 1e-5, "from {from}: differs by {diff}");
        }
    }
}
