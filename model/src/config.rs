//! Model hyper-parameters, read from GGUF metadata or an HF `config.json`.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Decoder families ragkv runs. They share one implementation; the differences are flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama, TinyLlama, SmolLM2, Llama 3.x.
    Llama,
    /// Qwen2 / Qwen2.5: attention biases on q, k, v.
    Qwen2,
    /// Qwen3: RMSNorm over each query and key head before RoPE, no attention biases.
    Qwen3,
    /// Mistral: Llama's layer, with an optional sliding attention window.
    Mistral,
    /// Gemma 3: windowed layers interleaved with global ones (each with its own RoPE base),
    /// per-head q/k norms, a norm after attention and after the MLP as well as before,
    /// GeGLU, embeddings scaled by `sqrt(hidden)`, RMSNorm weights applied as `1 + w`.
    Gemma3,
}

impl Arch {
    /// The HF `model_type` (and GGUF `general.architecture`, except Mistral, which GGUF
    /// files describe as `llama`).
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Mistral => "mistral",
            Arch::Gemma3 => "gemma3",
        }
    }

    /// The HF `architectures` entry.
    pub fn hf_class(self) -> &'static str {
        match self {
            Arch::Llama => "LlamaForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
            Arch::Mistral => "MistralForCausalLM",
            Arch::Gemma3 => "Gemma3ForCausalLM",
        }
    }
}

/// Which dimensions RoPE rotates together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Pairs `(2i, 2i+1)`: llama.cpp's layout for Llama GGUF files, whose q/k weights the
    /// converter permuted.
    Interleaved,
    /// Pairs `(i, i + d/2)`: HF checkpoints, and Qwen2 GGUF files.
    Half,
}

/// Llama 3 frequency scaling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeScaling {
    /// Frequency divisor applied to the lowest frequencies.
    pub factor: f64,
    /// Wavelengths above `original_max_position_embeddings / low_freq_factor` get the full `factor`.
    pub low_freq_factor: f64,
    /// Wavelengths below `original_max_position_embeddings / high_freq_factor` stay unscaled.
    pub high_freq_factor: f64,
    /// The context the model was pretrained at.
    pub original_max_position_embeddings: usize,
}

/// The feed-forward's gate activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `silu(gate) * up` (SwiGLU): Llama, Mistral, Qwen.
    Silu,
    /// `gelu_tanh(gate) * up` (GeGLU, GELU's tanh approximation): Gemma.
    GeluTanh,
}

/// Layers that attend to a window alternating with layers that attend to everything
/// (Gemma 3: five windowed layers, then one global, with different RoPE bases).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerPattern {
    /// Layer `i` attends to the whole context when `(i + 1) % global_every == 0`; the others
    /// to [`ModelConfig::sliding_window`].
    pub global_every: usize,
    /// The RoPE base of the windowed layers ([`ModelConfig::rope_theta`] is the global
    /// layers'), which never take the RoPE scaling.
    pub local_rope_theta: f64,
}

/// Everything the decoder needs to know about a model's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Model family.
    pub arch: Arch,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Width of the feed-forward's hidden layer.
    pub intermediate: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads per layer.
    pub heads: usize,
    /// Key/value heads per layer (grouped-query attention when fewer than `heads`).
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f64,
    /// RoPE base frequency.
    pub rope_theta: f64,
    /// Llama 3 frequency scaling, when the model uses it.
    pub rope_scaling: Option<RopeScaling>,
    /// Linear RoPE scaling (positions divided by this factor; Gemma 3's global layers at
    /// 4B and up); `None`: none.
    pub rope_linear_factor: Option<f64>,
    /// Per-frequency divisors (GGUF `rope_freqs.weight`, how llama.cpp stores Llama 3 scaling).
    pub rope_freq_factors: Option<Vec<f64>>,
    /// Which elements RoPE rotates together.
    pub rope_style: RopeStyle,
    /// The output head is the embedding matrix.
    pub tie_embeddings: bool,
    /// Query, key and value projections have biases (Qwen2).
    pub attn_bias: bool,
    /// Per-head RMSNorm of queries and keys before RoPE (Qwen3).
    pub qk_norm: bool,
    /// A query attends to the `w` most recent positions only, itself included (Mistral
    /// v0.1's 4096); `None`: the whole context.
    pub sliding_window: Option<usize>,
    /// Which layers the window applies to; `None`: every layer (Mistral).
    pub layer_pattern: Option<LayerPattern>,
    /// The attention scores' scale is `attn_scalar^-0.5`; `None`: `head_dim^-0.5` (Gemma's
    /// `query_pre_attn_scalar`).
    pub attn_scalar: Option<f64>,
    /// The feed-forward's gate activation.
    pub activation: Activation,
    /// Longest context the model supports.
    pub max_positions: usize,
}

impl ModelConfig {
    /// Checks that the shapes are consistent.
    pub fn validate(&self) -> Result<()> {
        let bad = |why: String| Err(Error::Config { why });
        if self.heads == 0 || self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            return bad(format!(
                "heads {} not a multiple of kv heads {}",
                self.heads, self.kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) || self.head_dim == 0 {
            return bad(format!("head dim {} must be even", self.head_dim));
        }
        if self.layers == 0 || self.hidden == 0 || self.vocab_size == 0 {
            return bad("empty model".into());
        }
        if self.sliding_window == Some(0) {
            return bad("sliding window of 0 positions".into());
        }
        if let Some(p) = self.layer_pattern {
            if p.global_every == 0 || self.sliding_window.is_none() {
                return bad(format!(
                    "a layer pattern (global every {} layers) needs a sliding window",
                    p.global_every
                ));
            }
        }
        if self
            .rope_linear_factor
            .is_some_and(|f| f.is_nan() || f <= 0.0)
        {
            return bad("linear RoPE factor must be positive".into());
        }
        if self.attn_scalar.is_some_and(|s| s.is_nan() || s <= 0.0) {
            return bad("attention scalar must be positive".into());
        }
        Ok(())
    }

    /// The attention window of layer `i`: the sliding window unless the layer pattern makes
    /// it a global layer.
    pub fn window_of(&self, i: usize) -> Option<usize> {
        match self.layer_pattern {
            Some(p) if (i + 1).is_multiple_of(p.global_every) => None,
            _ => self.sliding_window,
        }
    }

    /// Whether layer `i` takes the windowed layers' RoPE ([`LayerPattern::local_rope_theta`]).
    pub fn local_rope(&self, i: usize) -> bool {
        self.layer_pattern.is_some() && self.window_of(i).is_some()
    }

    /// The scale of the attention scores.
    pub fn attn_scale(&self) -> f64 {
        1.0 / self.attn_scalar.unwrap_or(self.head_dim as f64).sqrt()
    }

    /// A description of the position scheme (RoPE variant, scaling, attention window), part of
    /// the KV namespace fingerprint. Models without a window keep the description they had
    /// before windows existed.
    pub fn positions_fingerprint(&self) -> String {
        let mut s = format!(
            "rope theta={} style={:?} scaling={:?} factors={:?} head_dim={}",
            self.rope_theta,
            self.rope_style,
            self.rope_scaling,
            self.rope_freq_factors,
            self.head_dim
        );
        if let Some(w) = self.sliding_window {
            s.push_str(&format!(" window={w}"));
        }
        if let Some(f) = self.rope_linear_factor {
            s.push_str(&format!(" linear={f}"));
        }
        if let Some(p) = self.layer_pattern {
            s.push_str(&format!(
                " global_every={} local_theta={}",
                p.global_every, p.local_rope_theta
            ));
        }
        s
    }
}

/// The fields of an HF `config.json` that ragkv reads and writes: one type for the loader
/// ([`HfConfig::resolve`]), the exporter ([`HfConfig::of`]) and the synthetic models.
/// Absent options are left out when written.
#[derive(Debug, Default, Deserialize, Serialize)]
pub(crate) struct HfConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_type: Option<String>,
    /// The HF class (written for other readers; ragkv reads `model_type`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub architectures: Vec<String>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_key_value_heads: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<HfRopeScaling>,
    /// Default: tied for Gemma 3, untied for the others.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tie_word_embeddings: Option<bool>,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_bias: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<usize>,
    /// Qwen2/Qwen3 ship a `sliding_window` they do not use unless this is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_sliding_window: Option<bool>,
    /// Gemma's spelling of the activation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden_activation: Option<String>,
    /// The others' spelling.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden_act: Option<String>,
    /// Gemma 3: the attention scale's denominator squared.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        serialize_with = "whole_if_integral"
    )]
    pub query_pre_attn_scalar: Option<f64>,
    /// Gemma 3 (older configs): every n-th layer is global.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window_pattern: Option<usize>,
    /// Gemma 3 (newer configs): `sliding_attention` or `full_attention` per layer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_types: Option<Vec<String>>,
    /// Gemma 3: the windowed layers' RoPE base.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_local_base_freq: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_logit_softcapping: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attn_logit_softcapping: Option<f64>,
    /// Written for Qwen2 readers that require it; ragkv does not read it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_window_layers: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bos_token_id: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eos_token_id: Option<u32>,
}

#[derive(Debug, Default, Deserialize, Serialize)]
pub(crate) struct HfRopeScaling {
    /// `type` in older configs.
    #[serde(default, alias = "type", skip_serializing_if = "Option::is_none")]
    pub rope_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub low_freq_factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub high_freq_factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub original_max_position_embeddings: Option<usize>,
}

/// Writes a whole number without a fraction (HF's Gemma readers want `query_pre_attn_scalar`
/// as an integer).
fn whole_if_integral<S: serde::Serializer>(
    v: &Option<f64>,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    match *v {
        Some(x) if x.fract() == 0.0 && x.abs() < 9.0e15 => s.serialize_some(&(x as i64)),
        Some(x) => s.serialize_some(&x),
        None => s.serialize_none(),
    }
}

fn default_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    10_000.0
}
fn default_max_pos() -> usize {
    4096
}

impl HfConfig {
    /// The `config.json` of a model configured as `c` (Llama, Mistral, Qwen families).
    pub(crate) fn of(c: &ModelConfig) -> HfConfig {
        HfConfig {
            model_type: Some(c.arch.name().into()),
            architectures: vec![c.arch.hf_class().into()],
            vocab_size: c.vocab_size,
            hidden_size: c.hidden,
            intermediate_size: c.intermediate,
            num_hidden_layers: c.layers,
            num_attention_heads: c.heads,
            num_key_value_heads: Some(c.kv_heads),
            head_dim: Some(c.head_dim),
            rms_norm_eps: c.rms_eps,
            rope_theta: c.rope_theta,
            rope_scaling: c.rope_scaling.map(|r| HfRopeScaling {
                rope_type: Some("llama3".into()),
                factor: Some(r.factor),
                low_freq_factor: Some(r.low_freq_factor),
                high_freq_factor: Some(r.high_freq_factor),
                original_max_position_embeddings: Some(r.original_max_position_embeddings),
            }),
            tie_word_embeddings: Some(c.tie_embeddings),
            max_position_embeddings: c.max_positions,
            attention_bias: Some(c.attn_bias),
            sliding_window: c.sliding_window,
            ..HfConfig::default()
        }
    }

    /// Writes `dir/config.json`.
    pub(crate) fn write(&self, dir: &std::path::Path) -> Result<()> {
        let text = serde_json::to_vec_pretty(self).map_err(|e| Error::Config {
            why: format!("encoding config.json: {e}"),
        })?;
        fs_err::write(dir.join("config.json"), text)?;
        Ok(())
    }

    /// The model configuration this file describes.
    pub fn resolve(self) -> Result<ModelConfig> {
        let arch = match self.model_type.as_deref() {
            Some("qwen2") => Arch::Qwen2,
            Some("qwen3") => Arch::Qwen3,
            Some("mistral") => Arch::Mistral,
            Some("gemma3_text") => Arch::Gemma3,
            Some("llama") | None => Arch::Llama,
            Some(other) => {
                return Err(Error::Unsupported {
                    what: format!(
                    "model_type {other:?} (supported: llama, mistral, qwen2, qwen3, gemma3_text)"
                ),
                })
            }
        };
        if self.final_logit_softcapping.is_some() || self.attn_logit_softcapping.is_some() {
            return Err(Error::Unsupported {
                what: "logit soft-capping (Gemma 2)".into(),
            });
        }
        let gemma = arch == Arch::Gemma3;
        let activation = match self
            .hidden_activation
            .as_deref()
            .or(self.hidden_act.as_deref())
        {
            None if gemma => Activation::GeluTanh,
            None | Some("silu") | Some("swish") => Activation::Silu,
            Some("gelu_pytorch_tanh") | Some("gelu_tanh") => Activation::GeluTanh,
            Some(other) => {
                return Err(Error::Unsupported {
                    what: format!("activation {other:?} (supported: silu, gelu_pytorch_tanh)"),
                })
            }
        };
        let layer_pattern = if gemma {
            Some(LayerPattern {
                global_every: self.global_every()?,
                local_rope_theta: self.rope_local_base_freq.unwrap_or(10_000.0),
            })
        } else {
            None
        };
        let sliding_window = match arch {
            Arch::Mistral => self.sliding_window,
            Arch::Gemma3 => Some(self.sliding_window.unwrap_or(4096)),
            Arch::Qwen2 | Arch::Qwen3 if self.use_sliding_window == Some(true) => {
                return Err(Error::Unsupported {
                    what: format!("{} with use_sliding_window", arch.name()),
                })
            }
            _ => None,
        };
        let mut rope_linear_factor = None;
        let rope_scaling = match &self.rope_scaling {
            Some(s) if matches!(s.rope_type.as_deref(), Some("default") | None) => None,
            Some(s) if s.rope_type.as_deref() == Some("linear") => {
                rope_linear_factor = Some(s.factor.unwrap_or(1.0));
                None
            }
            Some(s) if s.rope_type.as_deref() == Some("llama3") => Some(RopeScaling {
                factor: s.factor.unwrap_or(8.0),
                low_freq_factor: s.low_freq_factor.unwrap_or(1.0),
                high_freq_factor: s.high_freq_factor.unwrap_or(4.0),
                original_max_position_embeddings: s
                    .original_max_position_embeddings
                    .unwrap_or(8192),
            }),
            Some(s) => {
                return Err(Error::Unsupported {
                    what: format!("rope scaling {:?}", s.rope_type),
                })
            }
            None => None,
        };
        let cfg = ModelConfig {
            arch,
            vocab_size: self.vocab_size,
            hidden: self.hidden_size,
            intermediate: self.intermediate_size,
            layers: self.num_hidden_layers,
            heads: self.num_attention_heads,
            kv_heads: self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            head_dim: self
                .head_dim
                .unwrap_or(self.hidden_size / self.num_attention_heads),
            rms_eps: self.rms_norm_eps,
            rope_theta: self.rope_theta,
            rope_scaling,
            rope_linear_factor,
            rope_freq_factors: None,
            rope_style: RopeStyle::Half,
            tie_embeddings: self.tie_word_embeddings.unwrap_or(gemma),
            attn_bias: self.attention_bias.unwrap_or(arch == Arch::Qwen2),
            qk_norm: arch == Arch::Qwen3 || gemma,
            sliding_window,
            layer_pattern,
            attn_scalar: if gemma {
                Some(self.query_pre_attn_scalar.unwrap_or(256.0))
            } else {
                None
            },
            activation,
            max_positions: self.max_position_embeddings,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Gemma 3's period of global layers: `sliding_window_pattern`, or read off
    /// `layer_types` (which must repeat windowed layers then one global layer).
    fn global_every(&self) -> Result<usize> {
        let Some(types) = &self.layer_types else {
            return Ok(self.sliding_window_pattern.unwrap_or(6));
        };
        let every = types
            .iter()
            .position(|t| t == "full_attention")
            .map_or(types.len() + 1, |i| i + 1);
        let regular = types.iter().enumerate().all(|(i, t)| {
            let global = (i + 1).is_multiple_of(every);
            t == if global {
                "full_attention"
            } else {
                "sliding_attention"
            }
        });
        if !regular {
            return Err(Error::Unsupported {
                what: format!("layer_types {types:?}: not a repeating window/global pattern"),
            });
        }
        Ok(every)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gemma(extra: serde_json::Value) -> Result<ModelConfig> {
        let mut v = serde_json::json!({
            "model_type": "gemma3_text",
            "vocab_size": 100,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 12,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "sliding_window": 512,
        });
        v.as_object_mut()
            .expect("object")
            .extend(extra.as_object().expect("object").clone());
        serde_json::from_value::<HfConfig>(v)
            .expect("config")
            .resolve()
    }

    /// Gemma 3's HF defaults and both ways of naming the global layers; linear scaling
    /// applies to the global layers' rotation; an irregular pattern is refused by name.
    #[test]
    fn gemma3_configs_resolve() {
        let c = gemma(serde_json::json!({})).unwrap();
        assert_eq!(c.activation, Activation::GeluTanh);
        assert!(c.tie_embeddings && c.qk_norm && !c.attn_bias);
        assert_eq!(c.attn_scale(), 1.0 / 16.0); // query_pre_attn_scalar 256 by default
        assert_eq!(
            (0..12)
                .map(|i| c.window_of(i).is_none())
                .collect::<Vec<_>>(),
            [false, false, false, false, false, true, false, false, false, false, false, true]
        );
        let mut types = vec!["sliding_attention"; 12];
        types[3] = "full_attention";
        types[7] = "full_attention";
        types[11] = "full_attention";
        let c = gemma(serde_json::json!({
            "layer_types": types,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "query_pre_attn_scalar": 32,
        }))
        .unwrap();
        assert_eq!(c.layer_pattern.map(|p| p.global_every), Some(4));
        assert_eq!(c.rope_linear_factor, Some(8.0));
        assert!((c.attn_scale() - 32f64.powf(-0.5)).abs() < 1e-15);
        types[7] = "sliding_attention";
        let err = gemma(serde_json::json!({ "layer_types": types })).unwrap_err();
        assert!(err.to_string().contains("layer_types"), "{err}");
        let err = gemma(serde_json::json!({ "final_logit_softcapping": 30.0 })).unwrap_err();
        assert!(err.to_string().contains("soft-capping"), "{err}");
    }

    /// Models without a layer pattern keep the window on every layer and their old
    /// position fingerprint.
    #[test]
    fn windows_without_a_pattern_cover_every_layer() {
        let v = serde_json::json!({
            "model_type": "mistral", "vocab_size": 10, "hidden_size": 64,
            "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
            "sliding_window": 16,
        });
        let c = serde_json::from_value::<HfConfig>(v)
            .unwrap()
            .resolve()
            .unwrap();
        assert!((0..3).all(|i| c.window_of(i) == Some(16) && !c.local_rope(i)));
        assert!(c.positions_fingerprint().ends_with("head_dim=16 window=16"));
        assert_eq!(c.activation, Activation::Silu);
    }
}
