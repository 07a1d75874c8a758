//! Rotary position embeddings, and re-positioning of cached keys.
//!
//! RoPE rotates each pair of key/query dimensions by `pos * inv_freq[i]`. Rotations compose:
//! `R(p + δ) = R(δ) R(p)`, so keys cached at positions `p` are moved to `p + δ` by rotating
//! them once more by `δ`: [`Rope::shift`]. Angles are computed in f64 and rounded once, so a
//! shifted key differs from one computed at `p + δ` only by float rounding of the rotation.

use candle_core::{CpuStorage, DType, Device, Storage, Tensor};

use crate::config::{ModelConfig, RopeStyle};
use crate::error::{Ctx, Result};

mod f16_rows;

/// Precomputed inverse frequencies for one model.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f64>,
    style: RopeStyle,
}

impl Rope {
    /// The rotation of the model's (global) layers.
    pub fn new(cfg: &ModelConfig) -> Rope {
        let d = cfg.head_dim;
        let mut inv_freq = Self::base(cfg.rope_theta, d);
        if let Some(f) = cfg.rope_linear_factor {
            inv_freq.iter_mut().for_each(|x| *x /= f);
        }
        if let Some(s) = cfg.rope_scaling {
            // Llama 3: leave high frequencies, divide low ones by `factor`, blend between.
            let old = s.original_max_position_embeddings as f64;
            let low_wavelen = old / s.low_freq_factor;
            let high_wavelen = old / s.high_freq_factor;
            for f in inv_freq.iter_mut() {
                let wavelen = 2.0 * std::f64::consts::PI / *f;
                if wavelen < high_wavelen {
                    continue;
                } else if wavelen > low_wavelen {
                    *f /= s.factor;
                } else {
                    let smooth = (old / wavelen - s.low_freq_factor)
                        / (s.high_freq_factor - s.low_freq_factor);
                    *f = (1.0 - smooth) * *f / s.factor + smooth * *f;
                }
            }
        }
        if let Some(factors) = &cfg.rope_freq_factors {
            for (f, d) in inv_freq.iter_mut().zip(factors) {
                *f /= d;
            }
        }
        Rope {
            inv_freq,
            style: cfg.rope_style,
        }
    }

    /// The rotation of the windowed layers of a model with a [`crate::LayerPattern`]: their
    /// own base, no scaling.
    pub fn local(cfg: &ModelConfig) -> Option<Rope> {
        let p = cfg.layer_pattern?;
        Some(Rope {
            inv_freq: Self::base(p.local_rope_theta, cfg.head_dim),
            style: cfg.rope_style,
        })
    }

    /// `theta^(-2i/d)` for every pair `i`.
    fn base(theta: f64, d: usize) -> Vec<f64> {
        (0..d / 2)
            .map(|i| 1.0 / theta.powf(2.0 * i as f64 / d as f64))
            .collect()
    }

    /// Whether pairs are neighbours (`2i`, `2i + 1`) rather than halves (`i`, `i + d / 2`).
    pub(crate) fn interleaved(&self) -> bool {
        self.style == RopeStyle::Interleaved
    }

    /// cos and sin tables, shape `(positions.len(), head_dim / 2)`.
    pub(crate) fn tables(
        &self,
        positions: impl Iterator<Item = i64>,
        device: &Device,
        dtype: DType,
    ) -> Result<(Tensor, Tensor)> {
        let mut cos = Vec::new();
        let mut sin = Vec::new();
        let mut n = 0;
        for p in positions {
            n += 1;
            for f in &self.inv_freq {
                let a = p as f64 * f;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        let h = self.inv_freq.len();
        let cos = Tensor::from_vec(cos, (n, h), device)
            .and_then(|t| t.to_dtype(dtype))
            .ctx("rope cos")?;
        let sin = Tensor::from_vec(sin, (n, h), device)
            .and_then(|t| t.to_dtype(dtype))
            .ctx("rope sin")?;
        Ok((cos, sin))
    }

    /// Rotates `x` (batch, heads, seq, head_dim) by tables from [`Rope::tables`] (one row
    /// per `seq` row).
    ///
    /// f32 on the CPU: [`Rope::turn_rows`] on the calling thread, or on candle's barrier pool
    /// for large inputs (candle's own rope spreads even a decode step's few rows over the
    /// rayon pool: threads beside the barrier pool's, competing for the same cores).
    pub(crate) fn apply(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let x = x.contiguous().ctx("rope input")?;
        if x.device().is_cpu() && x.dtype() == DType::F32 && cos.dtype() == DType::F32 {
            return self.apply_cpu(&x, cos, sin);
        }
        match self.style {
            RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(&x, cos, sin),
            RopeStyle::Half => candle_nn::rotary_emb::rope(&x, cos, sin),
        }
        .ctx("rope")
    }

    /// Rotates `x` (batch, heads, seq, head_dim) for positions `start..start + seq`.
    pub fn forward(&self, x: &Tensor, start: usize) -> Result<Tensor> {
        let seq = x.dim(2).ctx("rope dims")?;
        let (cos, sin) =
            self.tables((start as i64)..(start + seq) as i64, x.device(), x.dtype())?;
        self.apply(x, &cos, &sin)
    }

    /// Moves keys (batch, heads, seq, head_dim), the same number of rows in each of `ks` (a
    /// chunk's layers), already rotated for their positions, by `delta` positions (which may be
    /// negative). Every row turns by the same angles, so the sines and cosines are taken once
    /// (for a 512-token chunk of a 30-layer model, 32 of each instead of ~1M). On the CPU
    /// the rows turn in one pass on the calling thread (the loader thread, whose work must not
    /// spread over the compute threads), the result in each key's dtype: f32 keys by
    /// [`Rope::turn_rows`], f16 ones widened, turned and rounded once, element by element
    /// ([`f16_rows`]); elsewhere candle's rope.
    pub fn shift_all(&self, ks: &[Tensor], delta: i64) -> Result<Vec<Tensor>> {
        let Some(k0) = ks.first() else {
            return Ok(Vec::new());
        };
        if delta == 0 {
            return Ok(ks.to_vec());
        }
        let (cos1, sin1) = self.tables(std::iter::once(delta), k0.device(), DType::F32)?;
        if k0.device().is_cpu() {
            let one = |t: &Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>());
            let (cos, sin) = (one(&cos1).ctx("rope shift")?, one(&sin1).ctx("rope shift")?);
            return ks
                .iter()
                .map(|k| {
                    if k.dtype() == DType::F16 {
                        return self.shift_f16(k, &cos, &sin);
                    }
                    let mut x = k
                        .to_dtype(DType::F32)
                        .and_then(|t| t.flatten_all())
                        .and_then(|t| t.to_vec1::<f32>())
                        .ctx("rope shift")?;
                    self.turn_rows(&mut x, &cos, &sin);
                    Tensor::from_vec(x, k.shape(), k.device())
                        .and_then(|t| t.to_dtype(k.dtype()))
                        .ctx("rope shift")
                })
                .collect();
        }
        let seq = k0.dim(2).ctx("rope dims")?;
        let rows = |t: Tensor| {
            t.broadcast_as((seq, self.inv_freq.len()))
                .and_then(|t| t.contiguous())
                .and_then(|t| t.to_dtype(k0.dtype()))
                .ctx("rope shift")
        };
        let (cos, sin) = (rows(cos1)?, rows(sin1)?);
        ks.iter().map(|k| self.apply(k, &cos, &sin)).collect()
    }

    /// An f16 tensor's rows turned by one angle, in one pass ([`f16_rows`]).
    fn shift_f16(&self, k: &Tensor, cos: &[f32], sin: &[f32]) -> Result<Tensor> {
        let k = k.contiguous().ctx("rope shift")?;
        let out = {
            let (store, layout) = k.storage_and_layout();
            let (Storage::Cpu(CpuStorage::F16(data)), Some((a, b))) =
                (&*store, layout.contiguous_offsets())
            else {
                return Err(crate::error::Error::Input {
                    why: "rope shift: the keys are not a contiguous f16 CPU tensor".into(),
                });
            };
            let x = &data[a..b];
            let mut out = vec![half::f16::ZERO; x.len()];
            f16_rows::turn(self.style, x, &mut out, cos, sin);
            out
        };
        Tensor::from_vec(out, k.shape(), k.device()).ctx("rope shift")
    }

    /// [`Rope::apply`] of contiguous f32 `x` (batch, heads, seq, d) with f32 tables
    /// `(seq, d / 2)`.
    fn apply_cpu(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let (_, _, s, d) = x.dims4().ctx("rope input")?;
        let flat = |t: &Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>());
        let mut data = flat(x).ctx("rope input")?;
        let (cos, sin) = (flat(cos).ctx("rope cos")?, flat(sin).ctx("rope sin")?);
        let h = d / 2;
        if cos.len() != s * h || sin.len() != s * h {
            return Err(crate::error::Error::Input {
                why: format!("rope: tables of {} for {s} rows of {d}", cos.len()),
            });
        }
        // Row r of the data is row r % s of the sequence.
        let turn = |rows: &mut [f32], first: usize| {
            for (i, row) in rows.chunks_exact_mut(d).enumerate() {
                let p = (first + i) % s;
                self.turn_rows(row, &cos[p * h..(p + 1) * h], &sin[p * h..(p + 1) * h]);
            }
        };
        const BLOCK_ROWS: usize = 64;
        let rows = data.len() / d;
        if data.len() < 1 << 16 {
            turn(&mut data, 0);
        } else {
            let out = crate::quant::SharedOut(data.as_mut_ptr());
            candle_core::utils::barrier_pool().execute_chunked(
                rows.div_ceil(BLOCK_ROWS),
                |range| {
                    let out = &out;
                    for b in range {
                        let (r0, r1) = (b * BLOCK_ROWS, ((b + 1) * BLOCK_ROWS).min(rows));
                        // SAFETY: blocks are disjoint row ranges of `data`, which outlives
                        // `execute_chunked`.
                        let block = unsafe {
                            std::slice::from_raw_parts_mut(out.0.add(r0 * d), (r1 - r0) * d)
                        };
                        turn(block, r0);
                    }
                },
            );
        }
        Tensor::from_vec(data, x.shape(), x.device()).ctx("rope")
    }

    /// Turns every row (`2 * cos.len()` elements) of `x` by the angles whose cosines and
    /// sines are given, pairing elements as the model's style does (candle's `rope` and
    /// `rope_i`, the same arithmetic).
    fn turn_rows(&self, x: &mut [f32], cos: &[f32], sin: &[f32]) {
        let h = cos.len();
        for row in x.chunks_exact_mut(2 * h) {
            match self.style {
                RopeStyle::Half => {
                    let (a, b) = row.split_at_mut(h);
                    for i in 0..h {
                        let (x1, x2) = (a[i], b[i]);
                        a[i] = x1 * cos[i] - x2 * sin[i];
                        b[i] = x1 * sin[i] + x2 * cos[i];
                    }
                }
                RopeStyle::Interleaved => {
                    for (i, p) in row.chunks_exact_mut(2).enumerate() {
                        let (x1, x2) = (p[0], p[1]);
                        p[0] = x1 * cos[i] - x2 * sin[i];
                        p[1] = x1 * sin[i] + x2 * cos[i];
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Arch, RopeScaling};

    fn cfg() -> ModelConfig {
        ModelConfig {
            arch: Arch::Llama,
            vocab_size: 10,
            hidden: 64,
            intermediate: 128,
            layers: 1,
            heads: 1,
            kv_heads: 1,
            head_dim: 64,
            rms_eps: 1e-5,
            rope_theta: 500_000.0,
            rope_scaling: None,
            rope_linear_factor: None,
            rope_freq_factors: None,
            rope_style: RopeStyle::Half,
            tie_embeddings: true,
            attn_bias: false,
            qk_norm: false,
            sliding_window: None,
            layer_pattern: None,
            attn_scalar: None,
            activation: crate::config::Activation::Silu,
            max_positions: 8192,
        }
    }

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let plain = Rope::new(&cfg());
        let scaled = Rope::new(&ModelConfig {
            rope_scaling: Some(RopeScaling {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            }),
            ..cfg()
        });
        assert_eq!(scaled.inv_freq[0], plain.inv_freq[0]);
        let last = plain.inv_freq.len() - 1;
        assert!((scaled.inv_freq[last] - plain.inv_freq[last] / 8.0).abs() < 1e-15);
        // Frequency factors (GGUF rope_freqs) divide the frequencies one by one.
        let factors: Vec<f64> = (0..32).map(|i| 1.0 + i as f64).collect();
        let f = Rope::new(&ModelConfig {
            rope_freq_factors: Some(factors.clone()),
            ..cfg()
        });
        for ((got, base), d) in f.inv_freq.iter().zip(&plain.inv_freq).zip(&factors) {
            assert!((got - base / d).abs() < 1e-15);
        }
    }

    /// Linear scaling divides every frequency (Gemma 3's global layers); the windowed layers
    /// of a layer pattern take their own base and no scaling; without a pattern there is no
    /// local rotation.
    #[test]
    fn linear_scaling_and_local_layers() {
        assert!(Rope::local(&cfg()).is_none());
        let c = ModelConfig {
            rope_linear_factor: Some(8.0),
            sliding_window: Some(16),
            layer_pattern: Some(crate::config::LayerPattern {
                global_every: 6,
                local_rope_theta: 10_000.0,
            }),
            ..cfg()
        };
        let (global, local) = (Rope::new(&c), Rope::local(&c).expect("local"));
        let plain = Rope::new(&cfg());
        for (g, p) in global.inv_freq.iter().zip(&plain.inv_freq) {
            assert!((g - p / 8.0).abs() < 1e-18);
        }
        assert_eq!(local.inv_freq[0], 1.0);
        assert!((local.inv_freq[1] - 10_000f64.powf(-2.0 / 64.0)).abs() < 1e-15);
        assert_eq!(c.window_of(0), Some(16));
        assert_eq!(c.window_of(5), None);
        assert!(c.local_rope(4) && !c.local_rope(11));
    }

    /// The CPU's own turn of the rows is candle's rope, bit for bit, in both pairings: per
    /// row positions (small inputs on the calling thread, large ones on the pool), and a
    /// shift by one angle for f32 keys and (rounded once) f16 ones.
    #[test]
    fn turning_rows_is_candles_rope() -> Result<()> {
        let diff = |a: &Tensor, b: &Tensor| -> candle_core::Result<f32> {
            (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()
        };
        for style in [RopeStyle::Half, RopeStyle::Interleaved] {
            let rope = Rope::new(&ModelConfig {
                rope_style: style,
                ..cfg()
            });
            let candle = |x: &Tensor, cos: &Tensor, sin: &Tensor| match style {
                RopeStyle::Half => candle_nn::rotary_emb::rope(x, cos, sin),
                RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(x, cos, sin),
            };
            for (heads, s) in [(3, 7), (4, 300)] {
                let x = Tensor::randn(0f32, 1.0, (1, heads, s, 64), &Device::Cpu).ctx("randn")?;
                let at = (0..s as i64).map(|p| p * 37 % 1000);
                let (cos, sin) = rope.tables(at, &Device::Cpu, DType::F32)?;
                let got = rope.apply(&x, &cos, &sin)?;
                let want = candle(&x, &cos, &sin).ctx("rope")?;
                assert_eq!(diff(&got, &want).ctx("diff")?, 0.0, "{style:?} {s} rows");
            }
            let x = Tensor::randn(0f32, 1.0, (1, 3, 7, 64), &Device::Cpu).ctx("randn")?;
            let (cos, sin) = rope.tables(std::iter::repeat_n(-41, 7), &Device::Cpu, DType::F32)?;
            let want = candle(&x, &cos, &sin).ctx("rope")?;
            let got = rope.shift_all(std::slice::from_ref(&x), -41)?.remove(0);
            assert_eq!(diff(&got, &want).ctx("diff")?, 0.0, "{style:?}");
            let half = x.to_dtype(DType::F16).ctx("f16")?;
            let got = rope.shift_all(std::slice::from_ref(&half), -41)?.remove(0);
            assert_eq!(got.dtype(), DType::F16);
            let want = candle(&half.to_dtype(DType::F32).ctx("f32")?, &cos, &sin)
                .and_then(|t| t.to_dtype(DType::F16))
                .ctx("f16")?;
            assert_eq!(diff(&got, &want).ctx("diff")?, 0.0, "{style:?} f16");
        }
        Ok(())
    }

    /// f16 keys shift in one pass, vectorized where pairs come in eights and element by element
    /// otherwise (here 12- and 20-element heads), both bit for bit the f32 turn rounded once.
    #[test]
    fn f16_keys_shift_as_the_f32_turn_rounded_once() -> Result<()> {
        for style in [RopeStyle::Half, RopeStyle::Interleaved] {
            for head_dim in [12, 16, 20, 64, 128] {
                let rope = Rope::new(&ModelConfig {
                    rope_style: style,
                    head_dim,
                    ..cfg()
                });
                let x = (Tensor::randn(0f32, 3.0, (1, 2, 9, head_dim), &Device::Cpu)
                    .and_then(|t| t.to_dtype(DType::F16)))
                .ctx("randn")?;
                for delta in [-700, 1, 5_000] {
                    let got = rope.shift_all(std::slice::from_ref(&x), delta)?.remove(0);
                    let wide = x.to_dtype(DType::F32).ctx("f32")?;
                    let want = rope.shift_all(&[wide], delta)?.remove(0);
                    let want = want.to_dtype(DType::F16).ctx("f16")?;
                    let bits = |t: &Tensor| {
                        t.flatten_all()
                            .and_then(|t| t.to_vec1::<half::f16>())
                            .map(|v| v.iter().map(|h| h.to_bits()).collect::<Vec<_>>())
                    };
                    assert_eq!(
                        bits(&got).ctx("bits")?,
                        bits(&want).ctx("bits")?,
                        "{style:?} head {head_dim}, delta {delta}"
                    );
                }
            }
        }
        Ok(())
    }

    #[test]
    fn shifting_composes_with_rotation() -> Result<()> {
        let rope = Rope::new(&cfg());
        let x = Tensor::randn(0f32, 1.0, (1, 2, 5, 64), &Device::Cpu).ctx("randn")?;
        let at3 = rope.forward(&x, 3)?;
        let shifted = rope.shift_all(&[rope.forward(&x, 0)?], 3)?.remove(0);
        let d = (at3 - shifted)
            .and_then(|t| t.abs())
            .and_then(|t| t.max_all())
            .and_then(|t| t.to_scalar::<f32>())
            .ctx("diff")?;
        assert!(d < 1e-5, "{d}");
        Ok(())
    }
}
