//! Tiny models with random weights, written by the code that uses them: one GGUF file and one
//! HF directory (`config.json`, `model.safetensors`, tokenizer files) from the same weights.
//!
//! They let tests check each architecture against a reference implementation, and the
//! server's prompt handling against each family's chat template, without downloading a
//! model. The vocabulary is byte-level BPE: the 256 byte symbols, a few merges, then the
//! family's special tokens.
//!
//! | family  | GGUF `general.architecture` | RoPE in GGUF       | extra                          |
//! |---------|-----------------------------|--------------------|--------------------------------|
//! | Llama   | `llama`                     | q/k rows permuted  | Llama 3: `rope_freqs.weight`   |
//! | Mistral | `llama`                     | q/k rows permuted  | HF: `sliding_window`           |
//! | Qwen2   | `qwen2`                     | half split         | q/k/v biases                   |
//! | Qwen3   | `qwen3`                     | half split         | per-head q/k norms             |
//! | Gemma 3 | `gemma3`                    | half split         | four norms a layer (GGUF: `1 + w`), GeGLU, window on layer 0 of 2 |

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::{gguf_file::Value, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};

use crate::config::{Arch, HfConfig, HfRopeScaling};
use crate::error::{Ctx, Error, Result};
use crate::synthetic_gguf::{byte_vocab, family, gguf_arch, gguf_metadata, Shape};

/// What to build.
#[derive(Debug, Clone)]
pub struct SyntheticSpec {
    /// Model family.
    pub arch: Arch,
    /// Llama 3 RoPE scaling (HF `rope_scaling`, GGUF `rope_freqs.weight`); Llama only.
    pub llama3_scaling: bool,
    /// Mistral's attention window (HF only: GGUF files do not carry it), or Gemma 3's
    /// (both files; default 4096), which applies to its first layer of two.
    pub sliding_window: Option<usize>,
    /// The chat template; `None`: the family's usual one.
    pub chat_template: Option<String>,
    /// Weights such that every step's most likely token is the end of turn: the answer ends
    /// at once, whatever the prompt (for tests of stop handling).
    pub ends_turn_at_once: bool,
    /// More control tokens (e.g. a custom template's end of turn).
    pub extra_specials: Vec<String>,
    /// Seed of the random weights.
    pub seed: u64,
}

impl SyntheticSpec {
    /// The family's defaults, seed 7.
    pub fn new(arch: Arch) -> SyntheticSpec {
        SyntheticSpec {
            arch,
            llama3_scaling: false,
            sliding_window: None,
            chat_template: None,
            ends_turn_at_once: false,
            extra_specials: Vec::new(),
            seed: 7,
        }
    }
}

/// Where it was written.
#[derive(Debug, Clone)]
pub struct Synthetic {
    /// The GGUF file.
    pub gguf: PathBuf,
    /// The HF directory (config, safetensors, tokenizer).
    pub hf_dir: PathBuf,
}

const HIDDEN_HEADS: usize = 4;
const KV_HEADS: usize = 2;
const LAYERS: usize = 2;
const INTERMEDIATE: usize = 96;
const MAX_POSITIONS: usize = 4096;
const RMS_EPS: f64 = 1e-5;

/// Writes the model into `dir` (`model.gguf` and `hf/`).
pub fn write(spec: &SyntheticSpec, dir: &Path) -> Result<Synthetic> {
    let arch = spec.arch;
    let (specials, pre, default_template) = family(arch);
    let template = spec
        .chat_template
        .clone()
        .unwrap_or_else(|| default_template.to_string());
    // Qwen3's head dim is not hidden / heads; the others' is.
    let head_dim = 16;
    let hidden = if arch == Arch::Qwen3 {
        48
    } else {
        HIDDEN_HEADS * head_dim
    };
    let theta: f64 = match arch {
        Arch::Llama => 500_000.0,
        Arch::Qwen2 | Arch::Qwen3 | Arch::Gemma3 => 1_000_000.0,
        Arch::Mistral => 10_000.0,
    };
    let gemma = arch == Arch::Gemma3;
    // HF Gemma norms hold `w` of `1 + w`: random around 0 instead of 1.
    let norm_base = if gemma { 0.0 } else { 1.0 };
    let gemma_window = spec.sliding_window.unwrap_or(MAX_POSITIONS);

    // Vocabulary: bytes, merges, specials.
    let all_specials: Vec<&str> = specials
        .iter()
        .copied()
        .chain(spec.extra_specials.iter().map(String::as_str))
        .collect();
    let (words, ids) = byte_vocab(&all_specials, 0);
    let vocab = words.tokens.len();
    let (bos, eos, eot) = (ids[0], ids[1], ids[2]);

    // Weights, HF names and layout.
    let mut rng = rand::rngs::SmallRng::seed_from_u64(spec.seed);
    let mut rand_t = |shape: &[usize], scale: f32, base: f32| -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| base + scale * (rng.gen::<f32>() * 2.0 - 1.0))
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).ctx("random tensor")
    };
    let q_out = HIDDEN_HEADS * head_dim;
    let kv_out = KV_HEADS * head_dim;
    // Llama 3.2 ties the output head to the embedding; a model that must end its turn at
    // once needs the two apart.
    let tied = (arch == Arch::Llama || gemma) && !spec.ends_turn_at_once;
    let mut hf: Vec<(String, Tensor)> = Vec::new();
    hf.push((
        "model.embed_tokens.weight".into(),
        rand_t(&[vocab, hidden], 0.5, 0.0)?,
    ));
    for i in 0..LAYERS {
        let p = format!("model.layers.{i}");
        hf.push((
            format!("{p}.input_layernorm.weight"),
            rand_t(&[hidden], 0.1, norm_base)?,
        ));
        hf.push((
            format!("{p}.self_attn.q_proj.weight"),
            rand_t(&[q_out, hidden], 0.3, 0.0)?,
        ));
        hf.push((
            format!("{p}.self_attn.k_proj.weight"),
            rand_t(&[kv_out, hidden], 0.3, 0.0)?,
        ));
        hf.push((
            format!("{p}.self_attn.v_proj.weight"),
            rand_t(&[kv_out, hidden], 0.3, 0.0)?,
        ));
        if arch == Arch::Qwen2 {
            for (name, n) in [("q", q_out), ("k", kv_out), ("v", kv_out)] {
                hf.push((
                    format!("{p}.self_attn.{name}_proj.bias"),
                    rand_t(&[n], 0.1, 0.0)?,
                ));
            }
        }
        if arch == Arch::Qwen3 || gemma {
            hf.push((
                format!("{p}.self_attn.q_norm.weight"),
                rand_t(&[head_dim], 0.2, norm_base)?,
            ));
            hf.push((
                format!("{p}.self_attn.k_norm.weight"),
                rand_t(&[head_dim], 0.2, norm_base)?,
            ));
        }
        hf.push((
            format!("{p}.self_attn.o_proj.weight"),
            rand_t(&[hidden, q_out], 0.2, 0.0)?,
        ));
        hf.push((
            format!("{p}.post_attention_layernorm.weight"),
            rand_t(&[hidden], 0.1, norm_base)?,
        ));
        if gemma {
            for name in ["pre_feedforward_layernorm", "post_feedforward_layernorm"] {
                hf.push((
                    format!("{p}.{name}.weight"),
                    rand_t(&[hidden], 0.1, norm_base)?,
                ));
            }
        }
        hf.push((
            format!("{p}.mlp.gate_proj.weight"),
            rand_t(&[INTERMEDIATE, hidden], 0.2, 0.0)?,
        ));
        hf.push((
            format!("{p}.mlp.up_proj.weight"),
            rand_t(&[INTERMEDIATE, hidden], 0.2, 0.0)?,
        ));
        hf.push((
            format!("{p}.mlp.down_proj.weight"),
            rand_t(&[hidden, INTERMEDIATE], 0.2, 0.0)?,
        ));
    }
    hf.push((
        "model.norm.weight".into(),
        rand_t(&[hidden], 0.1, norm_base)?,
    ));
    if !tied {
        hf.push(("lm_head.weight".into(), rand_t(&[vocab, hidden], 0.3, 0.0)?));
    }
    if spec.ends_turn_at_once {
        ends_turn(&mut hf, eot as usize, norm_base)?;
    }

    fs_err::create_dir_all(dir)?;
    let hf_dir = dir.join("hf");
    fs_err::create_dir_all(&hf_dir)?;
    let map: HashMap<String, Tensor> = hf.iter().cloned().collect();
    candle_core::safetensors::save(&map, hf_dir.join("model.safetensors"))
        .ctx("writing safetensors")?;

    // GGUF: llama.cpp's names; Llama-family q/k rows permuted as its converter does.
    let gguf_arch = gguf_arch(arch);
    let permuted = gguf_arch == "llama";
    let mut qt: Vec<(String, QTensor)> = Vec::new();
    for (name, t) in &hf {
        let gname = crate::gguf::gguf_name(name, arch).ok_or_else(|| Error::Weight {
            name: name.clone(),
            why: "no GGUF name".into(),
        })?;
        let t = match (permuted, name.as_str()) {
            (true, n) if n.ends_with("q_proj.weight") => permute(t, HIDDEN_HEADS)?,
            (true, n) if n.ends_with("k_proj.weight") => permute(t, KV_HEADS)?,
            // llama.cpp's converter writes Gemma's norms as `1 + w`.
            (_, n) if crate::gguf::shifted_norm(arch, n) => (t + 1.0).ctx("norm shift")?,
            _ => t.clone(),
        };
        qt.push((
            gname,
            QTensor::quantize(&t, GgmlDType::F32).ctx("gguf tensor")?,
        ));
    }
    let scaling = (arch == Arch::Llama && spec.llama3_scaling).then_some(LLAMA3_SCALING);
    if let Some(s) = scaling {
        let factors: Vec<f32> = llama3_freq_factors(head_dim, theta, s);
        let t = Tensor::from_vec(factors, head_dim / 2, &Device::Cpu).ctx("rope_freqs")?;
        qt.push((
            "rope_freqs.weight".into(),
            QTensor::quantize(&t, GgmlDType::F32).ctx("rope_freqs")?,
        ));
    }
    let k = |s: &str| format!("{gguf_arch}.{s}");
    let shape = Shape {
        name: arch.name(),
        arch,
        hidden,
        layers: LAYERS,
        heads: HIDDEN_HEADS,
        kv_heads: KV_HEADS,
        head_dim,
        intermediate: INTERMEDIATE,
        vocab,
        rope_theta: theta as f32,
        context: MAX_POSITIONS,
    };
    let mut meta = gguf_metadata(&shape, &words, pre, &template);
    if gemma {
        meta.push((
            k("attention.sliding_window"),
            Value::U32(gemma_window as u32),
        ));
        // llama.cpp fixes Gemma 3's pattern at 6 and reads no key; ragkv reads this one
        // when present (real files have 6 or more layers, this one 2).
        meta.push((
            k("attention.sliding_window_pattern"),
            Value::U32(LAYERS as u32),
        ));
    }
    meta.sort_by(|a, b| a.0.cmp(&b.0));
    let gguf = dir.join("model.gguf");
    let mut f = std::io::BufWriter::new(fs_err::File::create(&gguf)?);
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let qt_refs: Vec<(&str, &QTensor)> = qt.iter().map(|(k, v)| (k.as_str(), v)).collect();
    candle_core::quantized::gguf_file::write(&mut f, &meta_refs, &qt_refs).ctx("writing gguf")?;
    std::io::Write::flush(&mut f)?;
    drop(f);

    // HF side: config, tokenizer (the one the GGUF describes), tokenizer config.
    let tok = crate::Tokenizer::load(&crate::ModelSource::Gguf(gguf.clone()))?;
    tok.inner()
        .save(hf_dir.join("tokenizer.json"), false)
        .map_err(|e| Error::Tokenizer { why: e.to_string() })?;
    let mut config = HfConfig {
        model_type: Some(arch.name().into()),
        architectures: vec![arch.hf_class().into()],
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: INTERMEDIATE,
        num_hidden_layers: LAYERS,
        num_attention_heads: HIDDEN_HEADS,
        num_key_value_heads: Some(KV_HEADS),
        head_dim: Some(head_dim),
        hidden_act: Some("silu".into()),
        rms_norm_eps: RMS_EPS,
        rope_theta: theta,
        rope_scaling: scaling.map(|s| HfRopeScaling {
            rope_type: Some("llama3".into()),
            factor: Some(s.0),
            low_freq_factor: Some(s.1),
            high_freq_factor: Some(s.2),
            original_max_position_embeddings: Some(s.3),
        }),
        max_position_embeddings: MAX_POSITIONS,
        tie_word_embeddings: Some(tied),
        attention_bias: Some(arch == Arch::Qwen2),
        sliding_window: if arch == Arch::Mistral {
            spec.sliding_window
        } else {
            Some(MAX_POSITIONS)
        },
        use_sliding_window: Some(false),
        max_window_layers: Some(LAYERS),
        bos_token_id: Some(bos),
        eos_token_id: Some(eos),
        ..HfConfig::default()
    };
    if gemma {
        config.model_type = Some("gemma3_text".into());
        config.hidden_act = None;
        config.hidden_activation = Some("gelu_pytorch_tanh".into());
        config.query_pre_attn_scalar = Some(head_dim as f64);
        config.sliding_window = Some(gemma_window);
        config.sliding_window_pattern = Some(LAYERS);
        config.rope_local_base_freq = Some(10_000.0);
    }
    config.write(&hf_dir)?;
    let json = |v: &serde_json::Value| serde_json::to_vec_pretty(v).expect("json");
    let tcfg = serde_json::json!({
        "bos_token": specials[0],
        "eos_token": specials[1],
        "add_bos_token": matches!(arch, Arch::Llama | Arch::Mistral | Arch::Gemma3),
        "chat_template": template,
    });
    fs_err::write(hf_dir.join("tokenizer_config.json"), json(&tcfg))?;
    Ok(Synthetic { gguf, hf_dir })
}

/// (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings), with a
/// small original context so that the tiny head dim has frequencies in all three bands.
const LLAMA3_SCALING: (f64, f64, f64, usize) = (8.0, 1.0, 4.0, 64);

/// llama.cpp's `rope_freqs` for Llama 3 scaling: the divisor of each frequency.
fn llama3_freq_factors(head_dim: usize, theta: f64, s: (f64, f64, f64, usize)) -> Vec<f32> {
    let (factor, low, high, old) = s;
    let old = old as f64;
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / theta.powf(2.0 * i as f64 / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            if wavelen < old / high {
                1.0
            } else if wavelen > old / low {
                factor as f32
            } else {
                let smooth = (old / wavelen - low) / (high - low);
                (1.0 / ((1.0 - smooth) / factor + smooth)) as f32
            }
        })
        .collect()
}

/// llama.cpp's converter's `permute`: rows `(head, 2, pair)` to `(head, pair, 2)`.
fn permute(w: &Tensor, heads: usize) -> Result<Tensor> {
    let (out, inp) = w.dims2().ctx("permute")?;
    w.reshape((heads, 2, out / heads / 2, inp))
        .and_then(|t| t.transpose(1, 2))
        .and_then(|t| t.contiguous())
        .and_then(|t| t.reshape((out, inp)))
        .ctx("permute")
}

/// Makes `eot` the most likely next token everywhere: the residual stream's dimension 0 is 1
/// for every token (embedding column 0) and no layer writes it (row 0 of every output and
/// down projection is zero); the final norm keeps only that dimension, and only `eot`'s row of
/// the output head reads it. `norm_base`: the value of a norm weight that scales by 1 (0 for
/// Gemma's `1 + w`).
fn ends_turn(hf: &mut [(String, Tensor)], eot: usize, norm_base: f32) -> Result<()> {
    let set = |t: &Tensor, f: &dyn Fn(&mut [f32], usize)| -> Result<Tensor> {
        let dims = t.dims().to_vec();
        let cols = *dims.last().unwrap_or(&1);
        let mut v: Vec<f32> = t.flatten_all().and_then(|t| t.to_vec1()).ctx("weights")?;
        f(&mut v, cols);
        Tensor::from_vec(v, dims, &Device::Cpu).ctx("weights")
    };
    for (name, t) in hf.iter_mut() {
        let n = name.as_str();
        *t = if n == "model.embed_tokens.weight" {
            set(t, &|v, cols| v.chunks_mut(cols).for_each(|r| r[0] = 1.0))?
        } else if n.ends_with("o_proj.weight") || n.ends_with("down_proj.weight") {
            set(t, &|v, cols| v[..cols].iter_mut().for_each(|x| *x = 0.0))?
        } else if n == "model.norm.weight" {
            set(t, &|v, _| {
                v.iter_mut().for_each(|x| *x = norm_base - 1.0);
                v[0] = norm_base;
            })?
        } else if n == "lm_head.weight" {
            set(t, &|v, cols| {
                for (row, r) in v.chunks_mut(cols).enumerate() {
                    r[0] = if row == eot { 1.0 } else { 0.0 };
                }
            })?
        } else {
            t.clone()
        };
    }
    Ok(())
}
