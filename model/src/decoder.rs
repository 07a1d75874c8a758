//! The transformer: one implementation for the Llama (Llama 2/3.x, SmolLM2), Mistral, Qwen2
//! and Qwen3 families; their differences are flags in [`ModelConfig`] (attention biases,
//! per-head q/k norms, RoPE layout and scaling, sliding window).
//!
//! Weights are immutable; per-sequence state lives in a [`KvCache`] the caller owns, so one
//! model serves many sequences and a cache can be filled from stored KV.

use candle_core::{DType, Device, Tensor, D};

use crate::config::ModelConfig;
use crate::error::{Ctx, Error, Result};
use crate::kv::{Kv, KvCache};
use crate::linear::{Embedding, Proj};
use crate::rope::Rope;
use crate::weights::Weights;

mod repair;

pub use repair::{link_positions, top_share, Repaired};

#[derive(Debug)]
struct Layer {
    attn_norm: Tensor,
    q: Proj,
    k: Proj,
    v: Proj,
    o: Proj,
    /// Per-head RMSNorm weights of queries and keys (Qwen3).
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    ffn_norm: Tensor,
    gate: Proj,
    up: Proj,
    down: Proj,
}

/// Which logits a forward pass returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position: `(vocab,)`. What prefill and decoding need.
    Last,
    /// Every position: `(tokens, vocab)`.
    All,
}

/// The decoder.
#[derive(Debug)]
pub struct Decoder {
    cfg: ModelConfig,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Proj,
    rope: Rope,
    dtype: DType,
    device: Device,
}

/// The matrix `name` (`(out, in)`, quantized if the weights keep it so) as a projection in
/// `dtype`.
fn matrix(w: &Weights, name: &str, b: Option<Tensor>, dtype: DType) -> Result<Proj> {
    if let Some(p) = w.packed(name) {
        return Ok(Proj::packed(p.clone(), b, dtype));
    }
    match w.quantized(name) {
        Some(q) => Proj::quant(q.clone(), b, dtype),
        None => Ok(Proj::dense(w.get(name)?.clone(), b)),
    }
}

fn linear(
    w: &Weights,
    name: &str,
    bias: bool,
    shape: (usize, usize),
    dtype: DType,
) -> Result<Proj> {
    let b = if bias {
        Some(w.get(&format!("{name}.bias"))?.clone())
    } else {
        w.opt(&format!("{name}.bias")).cloned()
    };
    let p = matrix(w, &format!("{name}.weight"), b, dtype)?;
    let dims = p.dims()?;
    if dims != shape {
        return Err(Error::Weight {
            name: format!("{name}.weight"),
            why: format!("shape {dims:?}, expected {shape:?}"),
        });
    }
    Ok(p)
}

/// A per-head norm's weight: required (of `dim` values) when `wanted`, absent otherwise.
fn norm(w: &Weights, name: &str, wanted: bool, dim: usize) -> Result<Option<Tensor>> {
    if !wanted {
        return Ok(None);
    }
    let t = w.get(name)?.clone();
    if t.dims() != [dim] {
        return Err(Error::Weight {
            name: name.into(),
            why: format!("shape {:?}, expected [{dim}]", t.dims()),
        });
    }
    Ok(Some(t))
}

/// One sequence of a step, as [`Decoder::layers_over`] lays it out: its first row among the
/// step's, how many rows it recomputes and appends, the cache index of every row when it
/// recomputes any (else its rows are the cache's last), its mask on the general path, and
/// the scatter index of its recomputed rows.
struct Span {
    first: usize,
    redo: usize,
    appended: usize,
    at: Option<Vec<usize>>,
    mask: Option<Tensor>,
    scatter: Option<Tensor>,
}

impl Decoder {
    pub(crate) fn new(
        cfg: ModelConfig,
        w: &Weights,
        dtype: DType,
        device: &Device,
    ) -> Result<Decoder> {
        let (h, kv, hd) = (cfg.hidden, cfg.kv_heads, cfg.head_dim);
        let q_out = cfg.heads * hd;
        let mut layers = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let p = format!("model.layers.{i}");
            layers.push(Layer {
                attn_norm: w.get(&format!("{p}.input_layernorm.weight"))?.clone(),
                q: linear(
                    w,
                    &format!("{p}.self_attn.q_proj"),
                    cfg.attn_bias,
                    (q_out, h),
                    dtype,
                )?,
                k: linear(
                    w,
                    &format!("{p}.self_attn.k_proj"),
                    cfg.attn_bias,
                    (kv * hd, h),
                    dtype,
                )?,
                v: linear(
                    w,
                    &format!("{p}.self_attn.v_proj"),
                    cfg.attn_bias,
                    (kv * hd, h),
                    dtype,
                )?,
                o: linear(
                    w,
                    &format!("{p}.self_attn.o_proj"),
                    false,
                    (h, q_out),
                    dtype,
                )?,
                q_norm: norm(w, &format!("{p}.self_attn.q_norm.weight"), cfg.qk_norm, hd)?,
                k_norm: norm(w, &format!("{p}.self_attn.k_norm.weight"), cfg.qk_norm, hd)?,
                ffn_norm: w
                    .get(&format!("{p}.post_attention_layernorm.weight"))?
                    .clone(),
                gate: linear(
                    w,
                    &format!("{p}.mlp.gate_proj"),
                    false,
                    (cfg.intermediate, h),
                    dtype,
                )?,
                up: linear(
                    w,
                    &format!("{p}.mlp.up_proj"),
                    false,
                    (cfg.intermediate, h),
                    dtype,
                )?,
                down: linear(
                    w,
                    &format!("{p}.mlp.down_proj"),
                    false,
                    (h, cfg.intermediate),
                    dtype,
                )?,
            });
        }
        const EMBED: &str = "model.embed_tokens.weight";
        let head = if w.has("lm_head.weight") && !cfg.tie_embeddings {
            "lm_head.weight"
        } else {
            EMBED
        };
        let lm_head = matrix(w, head, None, dtype)?;
        let embed = match (w.packed(EMBED), w.quantized(EMBED)) {
            (Some(table), _) => Embedding::Packed {
                table: table.clone(),
                dtype,
                device: device.clone(),
            },
            (None, Some(q)) => Embedding::Quant {
                table: q.clone(),
                dtype,
            },
            (None, None) => Embedding::Dense(w.get(EMBED)?.clone()),
        };
        Ok(Decoder {
            rope: Rope::new(&cfg),
            norm: w.get("model.norm.weight")?.clone(),
            embed,
            lm_head,
            layers,
            cfg,
            dtype,
            device: device.clone(),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// An empty cache with room for `capacity` tokens.
    pub fn new_cache(&self, capacity: usize) -> Result<KvCache> {
        KvCache::new(
            self.cfg.layers,
            self.cfg.kv_heads,
            self.cfg.head_dim,
            capacity,
            self.dtype,
            &self.device,
        )
    }

    /// Runs `tokens` through the model after what `cache` holds, appending their KV.
    pub fn forward(&self, cache: &mut KvCache, tokens: &[u32], logits: Logits) -> Result<Tensor> {
        let s = tokens.len();
        let x = self.layers_over(&mut [(cache, tokens, &[])])?;
        let x = match logits {
            Logits::Last => x.narrow(0, s.saturating_sub(1), 1).ctx("last")?,
            Logits::All => x,
        };
        let out = self.logits(&x)?;
        match logits {
            Logits::Last => out.squeeze(0).ctx("logits"),
            Logits::All => Ok(out),
        }
    }

    /// One step over several sequences (continuous batching): each sequence's tokens run
    /// after what its own cache holds (one token for a decoding sequence, several for a
    /// prompt or a piece of one), all of them as one batch through the projections and the
    /// MLP (each weight read once per step, whatever the batch), while attention runs per
    /// sequence over its own cache. Returns the logits of each sequence's last token,
    /// `(sequences, vocab)`. A sequence's logits do not depend on the others in the step
    /// beyond float rounding of the batched products.
    pub fn step(&self, seqs: &mut [(&mut KvCache, &[u32])]) -> Result<Tensor> {
        let mut seqs: Vec<_> = seqs
            .iter_mut()
            .map(|(c, t)| (&mut **c, *t, &[][..]))
            .collect();
        self.step_repairing(&mut seqs)
    }

    /// [`Decoder::step`] where a sequence may also repair its cache: the first `redo.len()`
    /// of its tokens are recomputed at the cache indices `redo` (ascending, below the cache's
    /// length: their rows are overwritten layer by layer, as [`Decoder::recompute_in`] does),
    /// the rest appended. A query joining a batch runs its repair and its question this way,
    /// beside the others' decoding tokens, in one read of the weights.
    pub fn step_repairing(&self, seqs: &mut [(&mut KvCache, &[u32], &[usize])]) -> Result<Tensor> {
        let x = self.layers_over(seqs)?;
        let mut last = Vec::with_capacity(seqs.len());
        let mut end = 0u32;
        for (_, t, _) in seqs.iter() {
            end += t.len() as u32;
            last.push(end - 1);
        }
        let idx = Tensor::new(last, &self.device).ctx("last rows")?;
        let x = x.index_select(&idx, 0).ctx("last rows")?;
        self.logits(&x)
    }

    /// The final norm and the output projection of hidden rows `(n, hidden)`: f32 logits
    /// `(n, vocab)`.
    fn logits(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.rms(x, &self.norm)?;
        let out = self.lm_head.forward(&x)?;
        out.to_dtype(DType::F32).ctx("logits")
    }

    /// Every layer over the sequences' tokens (concatenated, in order): each sequence's first
    /// `redo.len()` tokens overwrite the rows at those cache indices, the rest are appended to
    /// its cache. The hidden states `(tokens, hidden)` before the final norm.
    fn layers_over(&self, seqs: &mut [(&mut KvCache, &[u32], &[usize])]) -> Result<Tensor> {
        if seqs.is_empty() {
            return Err(Error::Input {
                why: "no sequences".into(),
            });
        }
        // On the CPU with f32 compute and f32 or f16 caches every sequence attends in place,
        // all in one pass ([`crate::attention`]: causal and windowed by cache index, no
        // mask); other devices and dtypes take the general path with a mask per prompt (and
        // per windowed token), the cache's rows converted to the compute dtype.
        let in_place = self.device.is_cpu()
            && self.dtype == DType::F32
            && seqs
                .iter()
                .all(|(c, _, _)| crate::attention::takes(c.dtype()));
        let (kvh, hd) = (self.cfg.kv_heads, self.cfg.head_dim);
        let mut all = Vec::new();
        let mut positions = Vec::new();
        let mut spans = Vec::with_capacity(seqs.len());
        for (cache, tokens, redo) in seqs.iter() {
            self.check_tokens(tokens)?;
            let (r, past) = (redo.len(), cache.len());
            if r > tokens.len()
                || !redo.windows(2).all(|w| w[0] < w[1])
                || redo.last().is_some_and(|&p| p >= past)
            {
                return Err(Error::Input {
                    why: format!(
                        "{r} rows to recompute for {} tokens: they must ascend within 0..{past}",
                        tokens.len()
                    ),
                });
            }
            let s = tokens.len() - r;
            // Cache index of every row: the recomputed ones, then the appended ones.
            let at: Vec<usize> = redo.iter().copied().chain(past..past + s).collect();
            let windowed = self.cfg.sliding_window.is_some_and(|w| past + s > w);
            let mask = if !in_place && (tokens.len() > 1 || windowed) {
                Some(self.mask_at(at.iter().copied(), past + s)?)
            } else {
                None
            };
            // Where the recomputed rows go (`scatter_set`'s index: every head and element).
            let scatter = if r > 0 {
                let idx: Vec<u32> = (0..kvh)
                    .flat_map(|_| redo.iter().flat_map(|&p| std::iter::repeat_n(p as u32, hd)))
                    .collect();
                Some(Tensor::from_vec(idx, (1, kvh, r, hd), &self.device).ctx("selection")?)
            } else {
                None
            };
            let start = cache.start_pos();
            positions.extend(at.iter().map(|&i| (start + i) as i64));
            spans.push(Span {
                first: all.len(),
                redo: r,
                appended: s,
                at: (r > 0).then_some(at),
                mask,
                scatter,
            });
            all.extend_from_slice(tokens);
        }
        let ids = Tensor::new(all.as_slice(), &self.device).ctx("token ids")?;
        let mut x = self.embed.lookup(&ids)?.unsqueeze(0).ctx("embed")?;
        // One rotation table for the step, shared by every layer's queries and keys.
        let (cos, sin) = self
            .rope
            .tables(positions.into_iter(), &self.device, self.dtype)?;
        let scale = 1.0 / (self.cfg.head_dim as f32).sqrt();
        for (i, layer) in self.layers.iter().enumerate() {
            let _span = tracing::trace_span!("layer", i).entered();
            let h = self.rms(&x, &layer.attn_norm)?;
            let (q, k, v) = self.qkv(layer, &h)?;
            let q = self.rope.apply(&q, &cos, &sin)?;
            let k = self.rope.apply(&k, &cos, &sin)?;
            // Every sequence's fresh keys and values go into its cache (recomputed rows in
            // place, the others appended); its live rows come back.
            let mut views = Vec::with_capacity(spans.len());
            for ((cache, _, _), sp) in seqs.iter_mut().zip(&spans) {
                let rows = |t: &Tensor, from: usize, n: usize| {
                    t.narrow(2, sp.first + from, n).ctx("sequence rows")
                };
                if let Some(idx) = &sp.scatter {
                    let r = sp.redo;
                    cache.set_rows(i, &rows(&k, 0, r)?, &rows(&v, 0, r)?, idx)?;
                }
                views.push(if sp.appended > 0 {
                    let (r, s) = (sp.redo, sp.appended);
                    cache.append(i, &rows(&k, r, s)?, &rows(&v, r, s)?)?
                } else {
                    cache.rows(i, cache.len())?
                });
            }
            let y = if in_place {
                let parts: Vec<_> = spans
                    .iter()
                    .zip(&views)
                    .map(|(sp, (k, v))| crate::attention::Seq {
                        row: sp.first,
                        len: sp.redo + sp.appended,
                        k,
                        v,
                        pos: sp.at.as_deref(),
                    })
                    .collect();
                crate::attention::attend(&q, &parts, self.cfg.sliding_window, scale)
                    .and_then(|y| y.unsqueeze(0))
                    .ctx("attention")?
            } else {
                let mut ys = Vec::with_capacity(spans.len());
                for (sp, (ck, cv)) in spans.iter().zip(&views) {
                    let q = q
                        .narrow(2, sp.first, sp.redo + sp.appended)
                        .ctx("sequence rows")?;
                    let (ck, cv) = (
                        ck.to_dtype(self.dtype).ctx("cache rows")?,
                        cv.to_dtype(self.dtype).ctx("cache rows")?,
                    );
                    ys.push(self.attend_heads(&q, &ck, &cv, sp.mask.as_ref())?);
                }
                if ys.len() == 1 {
                    ys.pop().expect("one")
                } else {
                    Tensor::cat(&ys, 1).ctx("batch attention")?
                }
            };
            x = (x + layer.o.forward(&y)?).ctx("residual")?;
            x = self.mlp(layer, x)?;
        }
        for ((cache, _, _), sp) in seqs.iter_mut().zip(&spans) {
            cache.advance(sp.appended);
        }
        x.squeeze(0).ctx("squeeze")
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        if tokens.is_empty() {
            return Err(Error::Input {
                why: "no tokens".into(),
            });
        }
        if let Some(bad) = tokens.iter().find(|t| **t as usize >= self.cfg.vocab_size) {
            return Err(Error::Input {
                why: format!(
                    "token id {bad} is outside the vocabulary ({})",
                    self.cfg.vocab_size
                ),
            });
        }
        Ok(())
    }

    /// Whether the query at cache index `q` sees the key at `k`: causal, and within the
    /// sliding window if the model has one (HF's rule: `q - k < window`).
    fn visible(&self, q: usize, k: usize) -> bool {
        k <= q && self.cfg.sliding_window.is_none_or(|w| q - k < w)
    }

    /// Additive mask `(queries.len(), t)` for queries at the given cache indices over keys
    /// `0..t`.
    fn mask_at(&self, queries: impl Iterator<Item = usize>, t: usize) -> Result<Tensor> {
        let mut m = Vec::new();
        let mut s = 0;
        for q in queries {
            s += 1;
            m.extend((0..t).map(|k| {
                if self.visible(q, k) {
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

    /// Causal mask `(s, t)`: query `i` (at cache index `t - s + i`) sees keys `0..=t - s + i`
    /// (within the sliding window).
    fn mask(&self, s: usize, t: usize) -> Result<Tensor> {
        self.mask_at((t - s)..t, t)
    }

    fn rms(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        candle_nn::ops::rms_norm(x, w, self.cfg.rms_eps as f32).ctx("rms norm")
    }

    /// `x + mlp(norm(x))`.
    fn mlp(&self, layer: &Layer, x: Tensor) -> Result<Tensor> {
        let h = self.rms(&x, &layer.ffn_norm)?;
        let [g, u] = Proj::forward_many([&layer.gate, &layer.up], &h)?;
        let m = layer
            .down
            .forward(&crate::swiglu::swiglu(&g, &u).ctx("swiglu")?)?;
        (x + m).ctx("residual")
    }

    /// Q, K, V projections of `h` (b, s, hidden), not yet rotated: `(b, heads, s, head_dim)`.
    fn qkv(&self, layer: &Layer, h: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let cfg = &self.cfg;
        let (b, s, _) = h.dims3().ctx("attn input")?;
        let (nh, nkv, hd) = (cfg.heads, cfg.kv_heads, cfg.head_dim);
        let [q, k, v] = Proj::forward_many([&layer.q, &layer.k, &layer.v], h)?;
        let q = q.reshape((b, s, nh, hd)).ctx("q")?;
        let k = k.reshape((b, s, nkv, hd)).ctx("k")?;
        let (q, k) = match (&layer.q_norm, &layer.k_norm) {
            (Some(qn), Some(kn)) => (self.rms(&q, qn)?, self.rms(&k, kn)?),
            _ => (q, k),
        };
        let q = q.transpose(1, 2).ctx("q")?;
        let k = k.transpose(1, 2).ctx("k")?;
        let v = v
            .reshape((b, s, nkv, hd))
            .and_then(|t| t.transpose(1, 2))
            .and_then(|t| t.contiguous())
            .ctx("v")?;
        Ok((q, k, v))
    }

    /// [`Decoder::attend_heads`] through the layer's output projection.
    fn attend(
        &self,
        layer: &Layer,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        layer.o.forward(&self.attend_heads(q, k, v, mask)?)
    }

    /// Attention of rotated queries `q` (b, heads, s, d) over keys and values
    /// (b, kv_heads, t, d), with an optional additive mask `(s, t)`: the heads' outputs
    /// `(b, s, heads * d)`, before the output projection.
    fn attend_heads(
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
    fn grouped(&self, q: &Tensor) -> Result<Tensor> {
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
    fn probs(&self, q: &Tensor, k: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
        let (b, nkv, rs, _) = q.dims4().ctx("q dims")?;
        let t = k.dim(2).ctx("k len")?;
        let scale = 1.0 / (self.cfg.head_dim as f64).sqrt();
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

    /// KV of `tokens` computed alone, as if they sat at positions `start_pos..`.
    pub fn prefill(&self, tokens: &[u32], start_pos: usize) -> Result<(Kv, Tensor)> {
        let mut cache = self.new_cache(tokens.len())?;
        cache.set_start_pos(start_pos)?;
        let logits = self.forward(&mut cache, tokens, Logits::Last)?;
        Ok((cache.to_kv()?, logits))
    }

    /// KV of each of `chunks` computed alone from position 0, as [`Decoder::prefill`] would,
    /// in one batched forward pass ([`Decoder::step`]): short chunks share the projections'
    /// weight reads (ingest).
    pub fn prefill_many(&self, chunks: &[&[u32]]) -> Result<Vec<Kv>> {
        let mut caches = chunks
            .iter()
            .map(|c| self.new_cache(c.len()))
            .collect::<Result<Vec<_>>>()?;
        let mut seqs: Vec<(&mut KvCache, &[u32])> =
            caches.iter_mut().zip(chunks.iter().copied()).collect();
        self.step(&mut seqs)?;
        caches.iter().map(KvCache::to_kv).collect()
    }

    /// Moves `kv` by `delta` positions: keys are rotated (in f32, the result in their own
    /// dtype), values are unchanged.
    pub fn reposition(&self, kv: &Kv, delta: i64) -> Result<Kv> {
        let keys: Vec<Tensor> = kv.layers.iter().map(|(k, _)| k.clone()).collect();
        let keys = self.rope.shift_all(&keys, delta)?;
        let layers = keys
            .into_iter()
            .zip(&kv.layers)
            .map(|(k, (_, v))| (k, v.clone()))
            .collect();
        Kv::new(layers)
    }

    /// Greedy argmax of logits.
    pub fn argmax(logits: &Tensor) -> Result<u32> {
        logits
            .argmax(D::Minus1)
            .and_then(|t| t.to_scalar::<u32>())
            .ctx("argmax")
    }
}
