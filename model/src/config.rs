//! Model hyper-parameters, read from GGUF metadata or an HF `config.json`.

use serde::Deserialize;

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
        }
    }

    /// The HF `architectures` entry.
    pub fn hf_class(self) -> &'static str {
        match self {
            Arch::Llama => "LlamaForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
            Arch::Mistral => "MistralForCausalLM",
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
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

/// Everything the decoder needs to know about a model's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rms_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    /// Per-frequency divisors (GGUF `rope_freqs.weight`, how llama.cpp stores Llama 3 scaling).
    pub rope_freq_factors: Option<Vec<f64>>,
    pub rope_style: RopeStyle,
    pub tie_embeddings: bool,
    pub attn_bias: bool,
    /// Per-head RMSNorm of queries and keys before RoPE (Qwen3).
    pub qk_norm: bool,
    /// A query attends to the `w` most recent positions only, itself included (Mistral
    /// v0.1's 4096); `None`: the whole context.
    pub sliding_window: Option<usize>,
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
        Ok(())
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
        s
    }
}

/// Mirror of the fields of an HF `config.json` that ragkv reads.
#[derive(Debug, Deserialize)]
pub(crate) struct HfConfig {
    #[serde(default)]
    pub model_type: Option<String>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: Option<HfRopeScaling>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub attention_bias: Option<bool>,
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// Qwen2/Qwen3 ship a `sliding_window` they do not use unless this is set.
    #[serde(default)]
    pub use_sliding_window: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct HfRopeScaling {
    /// `type` in older configs.
    #[serde(default, alias = "type")]
    pub rope_type: Option<String>,
    #[serde(default)]
    pub factor: Option<f64>,
    #[serde(default)]
    pub low_freq_factor: Option<f64>,
    #[serde(default)]
    pub high_freq_factor: Option<f64>,
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
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
    pub fn resolve(self) -> Result<ModelConfig> {
        let arch = match self.model_type.as_deref() {
            Some("qwen2") => Arch::Qwen2,
            Some("qwen3") => Arch::Qwen3,
            Some("mistral") => Arch::Mistral,
            Some("llama") | None => Arch::Llama,
            Some(other) => {
                return Err(Error::Unsupported {
                    what: format!("model_type {other:?} (supported: llama, mistral, qwen2, qwen3)"),
                })
            }
        };
        let sliding_window = match arch {
            Arch::Mistral => self.sliding_window,
            Arch::Qwen2 | Arch::Qwen3 if self.use_sliding_window == Some(true) => {
                return Err(Error::Unsupported {
                    what: format!("{} with use_sliding_window", arch.name()),
                })
            }
            _ => None,
        };
        let rope_scaling = match &self.rope_scaling {
            Some(s) if matches!(s.rope_type.as_deref(), Some("default") | None) => None,
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
            rope_freq_factors: None,
            rope_style: RopeStyle::Half,
            tie_embeddings: self.tie_word_embeddings,
            attn_bias: self.attention_bias.unwrap_or(arch == Arch::Qwen2),
            qk_norm: arch == Arch::Qwen3,
            sliding_window,
            max_positions: self.max_position_embeddings,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}
