//! The transformer: one implementation for the Llama (Llama 2/3.x, SmolLM2), Mistral, Qwen2,
//! Qwen3 and Gemma 3 families; their differences are flags in [`ModelConfig`] (attention
//! biases, per-head q/k norms, RoPE layout and scaling, sliding windows and which layers take
//! them, the gate's activation) and optional weights (Gemma's norms after attention and
//! the MLP).
//!
//! Weights are immutable; per-sequence state lives in a [`KvCache`] the caller owns, so one
//! model serves many sequences and a cache can be filled from stored KV.

use candle_core::{DType, Device, Tensor, D};

use crate::config::{Activation, Arch, ModelConfig};
use crate::error::{Ctx, Error, Result};
use crate::kv::{Kv, KvCache};
use crate::linear::{Embedding, Proj};
use crate::rope::Rope;
use crate::weights::Weights;

mod gpu;
#[cfg(feature = "cuda")]
mod graph;
mod heads;
mod layer;
mod repair;

use layer::{matrix, Layer};
pub use repair::{link_positions, sensitive_positions, top_share, window_positions, Repaired};

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
    /// The rotation of every layer, or of the global layers when the windowed ones have
    /// their own (`local_rope`).
    rope: Rope,
    local_rope: Option<Rope>,
    /// Embeddings are multiplied by this (Gemma: `sqrt(hidden)`).
    embed_scale: Option<f64>,
    dtype: DType,
    device: Device,
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
    /// `at` as i32 on the GPU, for the fused operations (rows recomputed there in place).
    at_dev: Option<Tensor>,
    /// Masks of the windowed layers and of the global ones (general path only).
    mask: Option<Tensor>,
    full_mask: Option<Tensor>,
    scatter: Option<Tensor>,
}

/// Whether rows recomputed in place take the GPU's fused kernels (`RAGKV_CUDA_REDO=on`). Off
/// by default until a GPU run has checked its answers against the general path's: it was
/// timed on an H200 (the question's prefill 10.5 ms instead of 13.0) but no answer was
/// compared.
fn fused_redo() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("RAGKV_CUDA_REDO").as_deref() == Ok("on"))
}

/// One sequence of a batched [`Decoder::step`].
#[derive(Debug)]
pub struct StepSeq<'a> {
    /// The sequence's own cache; its new rows are written here.
    pub cache: &'a mut KvCache,
    /// The tokens it feeds this step.
    pub tokens: &'a [u32],
    /// Cache rows its first `redo.len()` tokens recompute (ascending); empty: every token is
    /// appended.
    pub redo: &'a [usize],
}

impl<'a> StepSeq<'a> {
    /// `tokens` appended after what `cache` holds.
    pub fn new(cache: &'a mut KvCache, tokens: &'a [u32]) -> StepSeq<'a> {
        StepSeq {
            cache,
            tokens,
            redo: &[],
        }
    }
}

impl Decoder {
    pub(crate) fn new(
        cfg: ModelConfig,
        w: &Weights,
        dtype: DType,
        device: &Device,
    ) -> Result<Decoder> {
        let layers = (0..cfg.layers)
            .map(|i| Layer::load(w, &cfg, i, dtype))
            .collect::<Result<Vec<_>>>()?;
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
            local_rope: Rope::local(&cfg),
            embed_scale: (cfg.arch == Arch::Gemma3).then(|| (cfg.hidden as f64).sqrt()),
            norm: w.get("model.norm.weight")?.clone(),
            embed,
            lm_head,
            layers,
            cfg,
            dtype,
            device: device.clone(),
        })
    }

    /// The model's shape.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Compute (and KV) dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device the weights live on.
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
        if let Some(out) = self.graphed(cache, tokens)? {
            return out.squeeze(0).ctx("logits");
        }
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
    ///
    /// A sequence may also repair its cache ([`StepSeq::redo`]): its first `redo.len()`
    /// tokens are recomputed at those cache indices (ascending, below the cache's length:
    /// their rows are overwritten layer by layer, as [`Decoder::recompute_in`] does), the rest
    /// appended. A query joining a batch runs its repair and its question this way, beside
    /// the others' decoding tokens, in one read of the weights.
    pub fn step(&self, seqs: &mut [StepSeq<'_>]) -> Result<Tensor> {
        if let [one] = seqs {
            if one.redo.is_empty() {
                if let Some(out) = self.graphed(one.cache, one.tokens)? {
                    return Ok(out);
                }
            }
        }
        let mut seqs: Vec<(&mut KvCache, &[u32], &[usize])> = seqs
            .iter_mut()
            .map(|s| (&mut *s.cache, s.tokens, s.redo))
            .collect();
        let x = self.layers_over(&mut seqs)?;
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

    /// A one-token step's logits `(1, vocab)` from the cache's CUDA graph (`graph.rs`), or
    /// `None`: more tokens, no GPU, or a model or cache graphs do not take.
    fn graphed(&self, cache: &mut KvCache, tokens: &[u32]) -> Result<Option<Tensor>> {
        match tokens {
            #[cfg(feature = "cuda")]
            [token] => self.decode_graphed(cache, *token),
            _ => {
                let _ = cache;
                Ok(None)
            }
        }
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
                Some(self.mask_at(at.iter().copied(), past + s, self.cfg.sliding_window)?)
            } else {
                None
            };
            let full_mask = if !in_place && tokens.len() > 1 && self.cfg.layer_pattern.is_some() {
                Some(self.mask_at(at.iter().copied(), past + s, None)?)
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
            let at_dev = if r > 0 && self.device.is_cuda() && fused_redo() {
                let rows: Vec<i32> = at.iter().map(|&i| i as i32).collect();
                Some(Tensor::new(rows, &self.device).ctx("cache rows")?)
            } else {
                None
            };
            spans.push(Span {
                first: all.len(),
                redo: r,
                appended: s,
                at: (r > 0).then_some(at),
                at_dev,
                mask,
                full_mask,
                scatter,
            });
            all.extend_from_slice(tokens);
        }
        let ids = Tensor::new(all.as_slice(), &self.device).ctx("token ids")?;
        let mut x = self.embed(&ids)?;
        // One rotation table for the step (two with windowed layers of their own base),
        // shared by every layer's queries and keys.
        let tables = |rope: &Rope| rope.tables(positions.iter().copied(), &self.device, self.dtype);
        let global = tables(&self.rope)?;
        let local = self.local_rope.as_ref().map(tables).transpose()?;
        let scale = self.cfg.attn_scale() as f32;
        for (i, layer) in self.layers.iter().enumerate() {
            let _span = tracing::trace_span!("layer", i).entered();
            let window = self.cfg.window_of(i);
            let rope = self.rope_of(i);
            let (cos, sin) = match &local {
                Some(t) if self.cfg.local_rope(i) => t,
                _ => &global,
            };
            let h = self.rms(&x, &layer.attn_norm)?;
            let (q, views) = match self.qkv_stored(layer, i, &h, seqs, &spans, (cos, sin))? {
                Some(done) => done,
                None => {
                    let (q, k, v) = self.qkv(layer, &h)?;
                    let q = rope.apply(&q, cos, sin)?;
                    let k = rope.apply(&k, cos, sin)?;
                    // Every sequence's fresh keys and values go into its cache (recomputed
                    // rows in place, the others appended); its live rows come back.
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
                    (q, views)
                }
            };
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
                crate::attention::attend(&q, &parts, window, scale)
                    .and_then(|y| y.unsqueeze(0))
                    .ctx("attention")?
            } else {
                let mut ys = Vec::with_capacity(spans.len());
                for (sp, (ck, cv)) in spans.iter().zip(&views) {
                    let q = q
                        .narrow(2, sp.first, sp.redo + sp.appended)
                        .ctx("sequence rows")?;
                    if sp.redo == 0 || sp.at_dev.is_some() {
                        let rows_at = sp.at_dev.as_ref();
                        let fused = crate::attention::attend_device(
                            &q, ck, cv, window, scale, None, rows_at,
                        )
                        .ctx("attention")?;
                        if let Some(y) = fused {
                            ys.push(y);
                            continue;
                        }
                    }
                    let (ck, cv) = (
                        KvCache::float_rows(ck, self.dtype)?,
                        KvCache::float_rows(cv, self.dtype)?,
                    );
                    // A global layer between windowed ones takes the causal mask (none for
                    // one token); every other layer the span's mask.
                    let mask = if window.is_none() && self.cfg.layer_pattern.is_some() {
                        sp.full_mask.as_ref()
                    } else {
                        sp.mask.as_ref()
                    };
                    ys.push(self.attend_heads(&q, &ck, &cv, mask)?);
                }
                if ys.len() == 1 {
                    ys.pop().expect("one")
                } else {
                    Tensor::cat(&ys, 1).ctx("batch attention")?
                }
            };
            x = (x + self.attn_out(layer, &y)?).ctx("residual")?;
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

    fn rms(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        let eps = self.cfg.rms_eps as f32;
        if let Some(y) = crate::gpu_ops::rms_norm(x, w, eps).ctx("rms norm")? {
            return Ok(y);
        }
        candle_nn::ops::rms_norm(x, w, eps).ctx("rms norm")
    }

    /// Token embeddings `(1, n, hidden)` of `ids`, scaled if the model scales them.
    fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        let x = self.embed.lookup(ids)?;
        let x = match self.embed_scale {
            Some(s) => (x * s).ctx("embedding scale")?,
            None => x,
        };
        x.unsqueeze(0).ctx("embed")
    }

    /// The rotation of layer `i`'s queries and keys.
    fn rope_of(&self, i: usize) -> &Rope {
        match &self.local_rope {
            Some(local) if self.cfg.local_rope(i) => local,
            _ => &self.rope,
        }
    }

    /// What attention adds to the residual stream: the heads' outputs `y` through the
    /// output projection (and the layer's output norm, if it has one).
    fn attn_out(&self, layer: &Layer, y: &Tensor) -> Result<Tensor> {
        let a = layer.o.forward(y)?;
        match &layer.post_attn_norm {
            Some(n) => self.rms(&a, n),
            None => Ok(a),
        }
    }

    /// `x + mlp(norm(x))` (the MLP's output normed again where the model says so).
    fn mlp(&self, layer: &Layer, x: Tensor) -> Result<Tensor> {
        let h = self.rms(&x, &layer.ffn_norm)?;
        let gated = match self.gate_fused(layer, &h)? {
            Some(gated) => gated,
            None => {
                let [g, u] = layer.gate_up.forward(&h)?;
                match self.cfg.activation {
                    Activation::Silu => crate::swiglu::swiglu(&g, &u).ctx("swiglu")?,
                    Activation::GeluTanh => (g.gelu().ctx("gelu")? * u).ctx("geglu")?,
                }
            }
        };
        let m = layer.down.forward(&gated)?;
        let m = match &layer.post_ffn_norm {
            Some(n) => self.rms(&m, n)?,
            None => m,
        };
        (x + m).ctx("residual")
    }

    /// Q, K, V projections of `h` (b, s, hidden), not yet rotated: `(b, heads, s, head_dim)`.
    fn qkv(&self, layer: &Layer, h: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let cfg = &self.cfg;
        let (b, s, _) = h.dims3().ctx("attn input")?;
        let (nh, nkv, hd) = (cfg.heads, cfg.kv_heads, cfg.head_dim);
        let [q, k, v] = layer.qkv.forward(h)?;
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
        let mut seqs: Vec<StepSeq<'_>> = caches
            .iter_mut()
            .zip(chunks.iter().copied())
            .map(|(cache, tokens)| StepSeq::new(cache, tokens))
            .collect();
        self.step(&mut seqs)?;
        caches.iter().map(KvCache::to_kv).collect()
    }

    /// Moves `kv` by `delta` positions: keys are rotated (in f32, the result in their own
    /// dtype), values are unchanged. Each layer turns by its own rotation (Gemma's windowed
    /// and global layers have different bases).
    pub fn reposition(&self, kv: &Kv, delta: i64) -> Result<Kv> {
        let mut keys: Vec<Option<Tensor>> = vec![None; kv.layers.len()];
        let ropes =
            std::iter::once((false, &self.rope)).chain(self.local_rope.as_ref().map(|r| (true, r)));
        for (local, rope) in ropes {
            let idx: Vec<usize> = (0..kv.layers.len())
                .filter(|&i| self.cfg.local_rope(i) == local)
                .collect();
            let ks: Vec<Tensor> = idx.iter().map(|&i| kv.layers[i].0.clone()).collect();
            for (i, k) in idx.into_iter().zip(rope.shift_all(&ks, delta)?) {
                keys[i] = Some(k);
            }
        }
        let layers = keys
            .into_iter()
            .zip(&kv.layers)
            .map(|(k, (k0, v))| (k.unwrap_or_else(|| k0.clone()), v.clone()))
            .collect();
        Kv::new(layers)
    }

    /// Layer `layer`'s keys moved by `delta` positions, as [`Decoder::reposition`] moves
    /// them (a loader turns each layer's as it imports it).
    pub fn reposition_keys(&self, layer: usize, k: &Tensor, delta: i64) -> Result<Tensor> {
        let mut turned = self
            .rope_of(layer)
            .shift_all(std::slice::from_ref(k), delta)?;
        turned.pop().ok_or_else(|| Error::Input {
            why: "rope shift: no keys came back".into(),
        })
    }

    /// Greedy argmax of logits.
    pub fn argmax(logits: &Tensor) -> Result<u32> {
        logits
            .argmax(D::Minus1)
            .and_then(|t| t.to_scalar::<u32>())
            .ctx("argmax")
    }
}
