//! One-token decode steps replayed as CUDA graphs ([`crate::gpu_graph`]): a decode step on a
//! GPU is ~15 launches per layer, each costing the host more than the GPU spends on it at
//! these sizes; replayed from a graph they cost one launch.
//!
//! The first one-token step over a cache runs the step's body eagerly with its inputs in the
//! graph's buffers (it is this step's answer, and it loads the kernels, fills candle's
//! parameter cache and sizes the quantized products' workspace), then captures the same body
//! without running it. Later steps write their token, position and cache length into the
//! buffers and replay. Where the body cannot be captured (a model or cache the fused
//! operations do not take, or a capture error) the cache decodes eagerly from then on.

use candle_core::{DType, Device, Tensor};

use super::Decoder;
use crate::error::{Ctx, Error, Result};
use crate::gpu_graph::{Capture, StepGraph};
use crate::kv::KvCache;

impl Decoder {
    /// Logits `(1, vocab)` of `token` after what `cache` holds, its KV appended, from the
    /// cache's graph; `None` where graphs do not apply (the caller decodes eagerly).
    pub(super) fn decode_graphed(&self, cache: &mut KvCache, token: u32) -> Result<Option<Tensor>> {
        if !self.graphs_apply(cache) {
            return Ok(None);
        }
        self.check_tokens(&[token])?;
        cache.reserve(1)?;
        let owner = self as *const Decoder as usize;
        let mut g = match cache.graph.take() {
            Some(g) if g.owner == owner && g.capacity == cache.capacity() => g,
            _ => Box::new(
                StepGraph::new(
                    &self.device,
                    self.cfg.head_dim,
                    self.cfg.vocab_size,
                    cache.capacity(),
                    owner,
                )
                .ctx("graph buffers")?,
            ),
        };
        let past = cache.len();
        let pos = (cache.start_pos() + past) as i64;
        let (cos, sin) = self
            .rope
            .tables(std::iter::once(pos), &Device::Cpu, DType::F32)?;
        let row = |t: Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>());
        let (cos, sin) = (row(cos).ctx("rope")?, row(sin).ctx("rope")?);
        g.set(token, past, &cos, &sin).ctx("graph inputs")?;
        let out = if g.graph.is_some() {
            g.launch().ctx("graph replay")?;
            g.out.copy().ctx("logits")?
        } else {
            // This step eagerly (candle's parameter cache on, as during the capture), then
            // captured for the next ones.
            let t = std::time::Instant::now();
            let body = {
                let _params = crate::gpu_graph::param_cache(&self.device);
                self.step_body(cache, &g)
            };
            if let Err(e) = body {
                tracing::warn!("decoding without CUDA graphs for this sequence: {e}");
                cache.graph = Some(g); // without a graph: the sequence decodes eagerly
                return Ok(None);
            }
            let out = g.out.copy().ctx("logits")?;
            let eager = t.elapsed();
            match self.capture(cache, &g) {
                Ok(graph) => g.graph = Some(graph),
                Err(e) => tracing::warn!("decoding without CUDA graphs for this sequence: {e}"),
            }
            tracing::debug!(
                eager_ms = eager.as_secs_f64() * 1e3,
                capture_ms = (t.elapsed() - eager).as_secs_f64() * 1e3,
                capacity = cache.capacity(),
                "decode step graph captured"
            );
            out
        };
        cache.graph = Some(g);
        cache.advance(1);
        Ok(Some(out))
    }

    /// Whether this model and cache take graphed steps: a GPU, f32 compute, one rotation
    /// without per-head norms or embedding scale, every layer's projections joined, an f16
    /// or f32 cache, and no capture failed on this cache before.
    fn graphs_apply(&self, cache: &KvCache) -> bool {
        let failed = cache
            .graph
            .as_ref()
            .is_some_and(|g| g.graph.is_none() && g.capacity == cache.capacity());
        self.device.is_cuda()
            && crate::gpu_graph::enabled()
            && !failed
            && self.dtype == DType::F32
            && self.local_rope.is_none()
            && self.embed_scale.is_none()
            && matches!(cache.dtype(), DType::F16 | DType::F32)
            && self.layers.iter().all(|l| {
                l.q_norm.is_none()
                    && l.k_norm.is_none()
                    && l.qkv.is_joined()
                    && l.post_attn_norm.is_none()
            })
    }

    /// The step's body over the graph's buffers: every layer with the fused operations, the
    /// cache's rows written at `*past`, the logits copied into `g.out`. Reads no host data.
    fn step_body(&self, cache: &KvCache, g: &StepGraph) -> Result<()> {
        if self.cfg.activation == crate::config::Activation::Silu && crate::gpu_ops::q8_enabled() {
            return self.step_body_q8(cache, g);
        }
        let refused = |what: &str| Error::Input {
            why: format!("graphed step: {what} not taken by the fused GPU operations"),
        };
        let mut x = self.embed(&g.ids)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let h = self.rms(&x, &layer.attn_norm)?;
            let y = layer
                .qkv
                .joined(&h)?
                .ok_or_else(|| refused("Q/K/V"))?
                .contiguous()
                .ctx("qkv")?;
            let a = self.graphed_attention(i, &y, cache, g)?;
            x = (x + self.attn_out(layer, &a)?).ctx("residual")?;
            x = self.mlp(layer, x)?;
        }
        let logits = self.logits(&x.squeeze(0).ctx("squeeze")?)?;
        g.out.slice_set(&logits, 0, 0).ctx("logits")?;
        Ok(())
    }

    /// [`Decoder::step_body`] with each residual add, the norm after it and the quantization
    /// of the norm's output for the Q/K/V or gate/up product in one launch
    /// ([`crate::gpu_ops::norm_q8`]), and the MLP's gate quantized for the down projection in
    /// its own ([`crate::gpu_ops::swiglu_q8`]): 10 launches per layer where the other body
    /// takes 15.
    fn step_body_q8(&self, cache: &KvCache, g: &StepGraph) -> Result<()> {
        let refused = |what: &str| Error::Input {
            why: format!("graphed step: {what} not taken by the fused GPU operations"),
        };
        let mut x = self.embed(&g.ids)?;
        // What the last layer's MLP adds to `x` (added by the next norm's launch).
        let mut delta: Option<Tensor> = None;
        for (i, layer) in self.layers.iter().enumerate() {
            let (x1, y) = self.norm_product(x, delta.take(), &layer.attn_norm, &layer.qkv)?;
            x = x1;
            let a = self.graphed_attention(i, &y.contiguous().ctx("qkv")?, cache, g)?;
            let o = self.attn_out(layer, &a)?;
            let (x1, gu) = self.norm_product(x, Some(o), &layer.ffn_norm, &layer.gate_up)?;
            x = x1;
            let gu = gu.contiguous().ctx("gate/up")?;
            let quantized = crate::gpu_ops::swiglu_q8(&gu).ctx("swiglu")?;
            let m = match quantized.map(|q| layer.down.forward_q8(&q)).transpose()? {
                Some(Some(m)) => m,
                _ => {
                    let gated = crate::gpu_ops::swiglu_joined(&gu)
                        .ctx("swiglu")?
                        .ok_or_else(|| refused("swiglu"))?;
                    layer.down.forward(&gated)?
                }
            };
            delta = Some(match &layer.post_ffn_norm {
                Some(n) => self.rms(&m, n)?,
                None => m,
            });
        }
        if let Some(m) = delta {
            x = (x + m).ctx("residual")?;
        }
        let logits = self.logits(&x.squeeze(0).ctx("squeeze")?)?;
        g.out.slice_set(&logits, 0, 0).ctx("logits")?;
        Ok(())
    }

    /// Layer `i`'s attention in a graphed step: the joined Q/K/V output `y` `(1, 1, width)`
    /// rotated, its keys and values stored at the cache's row `*g.past`, the query attending
    /// over the cache: `(1, 1, heads * head_dim)`.
    fn graphed_attention(
        &self,
        i: usize,
        y: &Tensor,
        cache: &KvCache,
        g: &StepGraph,
    ) -> Result<Tensor> {
        let (heads, d) = (self.cfg.heads, self.cfg.head_dim);
        let refused = |what: &str| Error::Input {
            why: format!("graphed step: {what} not taken by the fused GPU operations"),
        };
        let q = crate::gpu_ops::new_queries(y, heads, 1, d)
            .ctx("queries")?
            .ok_or_else(|| refused("queries"))?;
        let (kc, vc) = cache.buffers(i);
        let stored = crate::gpu_ops::rope_store(
            y,
            (&g.cos, &g.sin),
            &q,
            0,
            (kc, vc),
            0,
            self.rope.interleaved(),
            Some(&g.past),
            None,
        )
        .ctx("rope and store")?;
        if !stored {
            return Err(refused("rope and store"));
        }
        let scale = self.cfg.attn_scale() as f32;
        let window = self.cfg.window_of(i);
        crate::attention::attend_device(&q, kc, vc, window, scale, Some(&g.past), None)
            .ctx("attention")?
            .ok_or_else(|| refused("attention"))
    }

    /// `x + delta` (or `x`) and the joined product `proj` of its norm by `norm`: the add, the
    /// norm and the input's quantization in one launch where the GPU takes them, else apart.
    fn norm_product<const N: usize>(
        &self,
        x: Tensor,
        delta: Option<Tensor>,
        norm: &Tensor,
        proj: &crate::joined::Joined<N>,
    ) -> Result<(Tensor, Tensor)> {
        let eps = self.cfg.rms_eps as f32;
        let refused = || Error::Input {
            why: "graphed step: a joined projection not taken by the fused GPU operations".into(),
        };
        if let Some((sum, q)) =
            crate::gpu_ops::norm_q8(&x, delta.as_ref(), norm, eps).ctx("norm and quantization")?
        {
            if let Some(y) = proj.joined_q8(&q)? {
                return Ok((sum.unwrap_or(x), y));
            }
        }
        let x = match delta {
            Some(m) => (x + m).ctx("residual")?,
            None => x,
        };
        let h = self.rms(&x, norm)?;
        let y = proj.joined(&h)?.ok_or_else(refused)?;
        Ok((x, y))
    }

    /// [`Decoder::step_body`] captured into a graph (not run).
    fn capture(&self, cache: &KvCache, g: &StepGraph) -> Result<crate::gpu_graph::Graph> {
        self.grow_workspace()?;
        let capture = Capture::begin(&self.device).ctx("graph capture")?;
        let body = self.step_body(cache, g);
        let graph = capture.end().ctx("graph capture");
        body?;
        graph
    }

    /// candle's quantized products of up to 8 rows share one scratch buffer per device, grown
    /// (reallocated) when a call needs more; a graph bakes in its address. So before a
    /// capture, every input width of this model is run with 8 rows once: the buffer is then
    /// at its largest for this model, and no later step (a batch of sequences) moves it.
    fn grow_workspace(&self) -> Result<()> {
        let Some(layer) = self.layers.first() else {
            return Ok(());
        };
        let rows = |k: usize| Tensor::zeros((1, 8, k), DType::F32, &self.device).ctx("workspace");
        let (hidden, inner) = (self.cfg.hidden, self.cfg.heads * self.cfg.head_dim);
        layer.qkv.forward(&rows(hidden)?)?;
        layer.o.forward(&rows(inner)?)?;
        layer.down.forward(&rows(self.cfg.intermediate)?)?;
        layer.gate_up.forward(&rows(hidden)?)?;
        self.lm_head
            .forward(&rows(hidden)?.squeeze(0).ctx("workspace")?)?;
        Ok(())
    }
}
