//! Rotary position embeddings, and re-positioning of cached keys.
//!
//! RoPE rotates each pair of key/query dimensions by `pos * inv_freq[i]`. Rotations compose:
//! `R(p + δ) = R(δ) R(p)`, so keys cached at positions `p` are moved to `p + δ` by rotating
//! them once more by `δ`: [`Rope::shift`]. Angles are computed in f64 and rounded once, so a
//! shifted key differs from one computed at `p + δ` only by float rounding of the rotation.

use candle_core::{DType, Device, Tensor};

use crate::config::{ModelConfig, RopeStyle};
use crate::error::{Ctx, Result};

/// Precomputed inverse frequencies for one model.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f64>,
    style: RopeStyle,
}

impl Rope {
    pub fn new(cfg: &ModelConfig) -> Rope {
        let d = cfg.head_dim;
        let mut inv_freq: Vec<f64> = (0..d / 2)
            .map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f64 / d as f64))
            .collect();
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
    pub(crate) fn apply(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let x = x.contiguous().ctx("rope input")?;
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

    /// Rotates `x` (batch, heads, seq, head_dim) for the given positions, one per row.
    pub fn at(&self, x: &Tensor, positions: &[usize]) -> Result<Tensor> {
        let (cos, sin) = self.tables(positions.iter().map(|&p| p as i64), x.device(), x.dtype())?;
        self.apply(x, &cos, &sin)
    }

    /// Moves keys (batch, heads, seq, head_dim), `seq` rows in each of `ks` (a chunk's
    /// layers), already rotated for their positions, by `delta` positions (which may be
    /// negative). Every row turns by the same angles, so the sines and cosines are taken once
    /// (for a 512-token chunk of a 30-layer model, 32 of each instead of ~1M).
    pub fn shift_all(&self, ks: &[Tensor], delta: i64, seq: usize) -> Result<Vec<Tensor>> {
        let Some(k0) = ks.first() else {
            return Ok(Vec::new());
        };
        if delta == 0 {
            return Ok(ks.to_vec());
        }
        let (cos1, sin1) = self.tables(std::iter::once(delta), k0.device(), DType::F32)?;
        let rows = |t: Tensor| {
            t.broadcast_as((seq, self.inv_freq.len()))
                .and_then(|t| t.contiguous())
                .and_then(|t| t.to_dtype(k0.dtype()))
                .ctx("rope shift")
        };
        let (cos, sin) = (rows(cos1)?, rows(sin1)?);
        ks.iter().map(|k| self.apply(k, &cos, &sin)).collect()
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
            rope_freq_factors: None,
            rope_style: RopeStyle::Half,
            tie_embeddings: true,
            attn_bias: false,
            qk_norm: false,
            sliding_window: None,
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

    #[test]
    fn shifting_composes_with_rotation() -> Result<()> {
        let rope = Rope::new(&cfg());
        let x = Tensor::randn(0f32, 1.0, (1, 2, 5, 64), &Device::Cpu).ctx("randn")?;
        let at3 = rope.forward(&x, 3)?;
        let shifted = rope.shift_all(&[rope.forward(&x, 0)?], 3, 5)?.remove(0);
        let d = (at3 - shifted)
            .and_then(|t| t.abs())
            .and_then(|t| t.max_all())
            .and_then(|t| t.to_scalar::<f32>())
            .ctx("diff")?;
        assert!(d < 1e-5, "{d}");
        Ok(())
    }
}
