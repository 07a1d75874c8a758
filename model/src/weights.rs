//! Loading weights and metadata from GGUF files and HF safetensors directories.
//!
//! Tensors are held under their HF names (`model.layers.0.self_attn.q_proj.weight`, ...).
//! GGUF matrices in a quantized block type stay quantized (see [`crate::linear`]) unless the
//! caller asks for dense weights; everything else is converted at load to the requested dtype. Llama GGUF files keep the
//! q/k row order llama.cpp's converter gave them (pairs interleaved), so those models run with
//! [`RopeStyle::Interleaved`]; [`Weights::to_hf`] undoes the permutation for export.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};

use crate::config::{Arch, HfConfig, ModelConfig, RopeStyle};
use crate::error::{Ctx, Error, Result};
use crate::quant::packed::{PackKind, Packed};

/// Where a model comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// A `.gguf` file (weights, tokenizer and chat template inside).
    Gguf(PathBuf),
    /// An HF directory: `config.json`, `*.safetensors`, `tokenizer.json`, optionally
    /// `tokenizer_config.json` (chat template).
    HfDir(PathBuf),
}

impl ModelSource {
    /// A configured model: a hub reference (`hf:ORG/REPO[:FILE]`, fetched into the model
    /// cache, see [`crate::hub`]) or a path ([`ModelSource::from_path`]).
    pub fn resolve(spec: &str) -> Result<ModelSource> {
        if crate::hub::is_reference(spec) {
            crate::hub::resolve(&spec.parse()?, &crate::hub::HubOptions::default())
        } else {
            ModelSource::from_path(spec)
        }
    }

    /// The file or directory name (for messages).
    pub fn name(&self) -> String {
        let p = match self {
            ModelSource::Gguf(p) | ModelSource::HfDir(p) => p,
        };
        p.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| p.display().to_string())
    }

    /// A `.gguf` path or a directory.
    pub fn from_path(path: impl AsRef<Path>) -> Result<ModelSource> {
        let path = path.as_ref();
        if path.is_dir() {
            if !path.join("config.json").exists() {
                return Err(Error::NotFound {
                    what: "config.json".into(),
                    path: path.to_path_buf(),
                });
            }
            Ok(ModelSource::HfDir(path.to_path_buf()))
        } else if path.is_file() {
            Ok(ModelSource::Gguf(path.to_path_buf()))
        } else {
            Err(Error::NotFound {
                what: "model file or directory".into(),
                path: path.to_path_buf(),
            })
        }
    }
}

/// Weights by HF name: dense tensors, and matrices kept in their GGUF block type.
#[derive(Debug)]
pub struct Weights {
    pub(crate) tensors: HashMap<String, Tensor>,
    pub(crate) quant: HashMap<String, Arc<QTensor>>,
    /// Matrices repacked for the CPU's tiled kernels ([`PackKind::of`]; instead of `quant`:
    /// one copy in memory).
    pub(crate) packed: HashMap<String, Arc<Packed>>,
}

impl Weights {
    /// A dense tensor (1-D weights are always dense).
    pub(crate) fn get(&self, name: &str) -> Result<&Tensor> {
        self.tensors.get(name).ok_or_else(|| Error::Weight {
            name: name.into(),
            why: if self.quant.contains_key(name) {
                "quantized where a dense tensor is needed".into()
            } else {
                "missing".into()
            },
        })
    }

    pub(crate) fn opt(&self, name: &str) -> Option<&Tensor> {
        self.tensors.get(name)
    }

    /// A matrix kept quantized, if it is.
    pub(crate) fn quantized(&self, name: &str) -> Option<&Arc<QTensor>> {
        self.quant.get(name)
    }

    /// A matrix kept quantized and repacked, if it is.
    pub(crate) fn packed(&self, name: &str) -> Option<&Arc<Packed>> {
        self.packed.get(name)
    }

    /// Whether any matrix is kept quantized.
    pub(crate) fn has_quantized(&self) -> bool {
        !self.quant.is_empty() || !self.packed.is_empty()
    }

    /// Whether `name` exists, dense or quantized.
    pub(crate) fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
            || self.quant.contains_key(name)
            || self.packed.contains_key(name)
    }

    /// Bytes the weights hold in memory.
    pub fn resident_bytes(&self) -> usize {
        let dense: usize = self
            .tensors
            .values()
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum();
        dense
            + self
                .quant
                .values()
                .map(|q| q.storage_size_in_bytes())
                .sum::<usize>()
            + self.packed.values().map(|p| p.bytes()).sum::<usize>()
    }

    /// The weights in HF layout (q/k rows un-permuted for interleaved-RoPE GGUF models),
    /// quantized ones dequantized to f32.
    pub fn to_hf(&self, cfg: &ModelConfig) -> Result<HashMap<String, Tensor>> {
        let mut dequantized = HashMap::new();
        for (name, q) in &self.quant {
            let t = q
                .dequantize(&Device::Cpu)
                .ctx(&format!("dequantizing {name}"))?;
            dequantized.insert(name.clone(), t);
        }
        for (name, p) in &self.packed {
            dequantized.insert(name.clone(), p.dequantize()?);
        }
        let mut out = HashMap::new();
        for (name, t) in self.tensors.iter().chain(&dequantized) {
            let t = if cfg.rope_style == RopeStyle::Interleaved
                && (name.ends_with("q_proj.weight") || name.ends_with("k_proj.weight"))
            {
                let heads = if name.ends_with("q_proj.weight") {
                    cfg.heads
                } else {
                    cfg.kv_heads
                };
                unpermute(t, heads)?
            } else {
                t.clone()
            };
            out.insert(name.clone(), t);
        }
        Ok(out)
    }
}

/// Inverse of llama.cpp's `permute`: rows `(head, pair, 2)` back to `(head, 2, pair)`.
fn unpermute(w: &Tensor, heads: usize) -> Result<Tensor> {
    let (out, inp) = w.dims2().ctx("unpermute")?;
    w.reshape((heads, out / heads / 2, 2, inp))
        .and_then(|t| t.transpose(1, 2))
        .and_then(|t| t.reshape((out, inp)))
        .ctx("unpermute")
}

/// GGUF metadata accessors.
pub(crate) struct GgufMeta<'a>(pub &'a HashMap<String, gguf_file::Value>);

impl GgufMeta<'_> {
    pub fn get(&self, key: &str) -> Option<&gguf_file::Value> {
        self.0.get(key)
    }

    pub fn usize(&self, key: &str) -> Result<usize> {
        use gguf_file::Value as V;
        match self.get(key) {
            Some(V::U8(x)) => Ok(*x as usize),
            Some(V::U16(x)) => Ok(*x as usize),
            Some(V::U32(x)) => Ok(*x as usize),
            Some(V::U64(x)) => Ok(*x as usize),
            Some(V::I32(x)) if *x >= 0 => Ok(*x as usize),
            Some(V::I64(x)) if *x >= 0 => Ok(*x as usize),
            Some(other) => Err(Error::Config {
                why: format!("{key}: expected an unsigned integer, found {other:?}"),
            }),
            None => Err(Error::Config {
                why: format!("{key}: missing from GGUF metadata"),
            }),
        }
    }

    pub fn f64(&self, key: &str) -> Result<f64> {
        use gguf_file::Value as V;
        match self.get(key) {
            Some(V::F32(x)) => Ok(*x as f64),
            Some(V::F64(x)) => Ok(*x),
            Some(other) => Err(Error::Config {
                why: format!("{key}: expected a float, found {other:?}"),
            }),
            None => Err(Error::Config {
                why: format!("{key}: missing from GGUF metadata"),
            }),
        }
    }

    pub fn str(&self, key: &str) -> Result<&str> {
        match self.get(key) {
            Some(gguf_file::Value::String(s)) => Ok(s),
            Some(other) => Err(Error::Config {
                why: format!("{key}: expected a string, found {other:?}"),
            }),
            None => Err(Error::Config {
                why: format!("{key}: missing from GGUF metadata"),
            }),
        }
    }

    pub fn array(&self, key: &str) -> Result<&Vec<gguf_file::Value>> {
        match self.get(key) {
            Some(gguf_file::Value::Array(a)) => Ok(a),
            Some(other) => Err(Error::Config {
                why: format!("{key}: expected an array, found {:?}", other.value_type()),
            }),
            None => Err(Error::Config {
                why: format!("{key}: missing from GGUF metadata"),
            }),
        }
    }
}

/// Whether a GGUF tensor stays in its file's blocks: a matrix in a quantized block type, or in
/// F16 / BF16 (multiplied as they are, half of f32's bytes); f32 ones are converted like any
/// dense weight.
fn keep_quantized(info: &gguf_file::TensorInfo) -> bool {
    info.shape.rank() == 2 && info.ggml_dtype != GgmlDType::F32
}

/// Reads a GGUF file: config, weights (matrices kept quantized when `quantized`, see
/// [`keep_quantized`]), and the raw metadata (for the tokenizer).
pub(crate) fn load_gguf(
    path: &Path,
    dtype: DType,
    quantized: bool,
    device: &Device,
) -> Result<(ModelConfig, Weights, HashMap<String, gguf_file::Value>)> {
    let mut file = fs_err::File::open(path)?;
    let content = gguf_file::Content::read(&mut file).map_err(|e| Error::Config {
        why: format!("{} is not a readable GGUF file: {e}", path.display()),
    })?;
    let meta = GgufMeta(&content.metadata);
    let arch_name = meta.str("general.architecture")?.to_string();
    // llama.cpp's converter writes Mistral (v0.1-v0.3, Nemo) as `llama`; the sliding window
    // of v0.1 is not in its metadata (llama.cpp attends to the whole context).
    let arch = match arch_name.as_str() {
        "llama" => Arch::Llama,
        "qwen2" => Arch::Qwen2,
        "qwen3" => Arch::Qwen3,
        other => {
            return Err(Error::Unsupported {
                what: format!("GGUF architecture {other:?} (supported: llama, qwen2, qwen3)"),
            })
        }
    };
    let k = |s: &str| format!("{arch_name}.{s}");
    let heads = meta.usize(&k("attention.head_count"))?;
    let hidden = meta.usize(&k("embedding_length"))?;
    let vocab = meta.array("tokenizer.ggml.tokens")?.len();
    let cfg = ModelConfig {
        arch,
        vocab_size: vocab,
        hidden,
        intermediate: meta.usize(&k("feed_forward_length"))?,
        layers: meta.usize(&k("block_count"))?,
        heads,
        kv_heads: meta.usize(&k("attention.head_count_kv")).unwrap_or(heads),
        head_dim: meta
            .usize(&k("attention.key_length"))
            .or_else(|_| meta.usize(&k("rope.dimension_count")))
            .unwrap_or(hidden / heads),
        rms_eps: meta.f64(&k("attention.layer_norm_rms_epsilon"))?,
        rope_theta: meta.f64(&k("rope.freq_base")).unwrap_or(10_000.0),
        rope_scaling: None,
        rope_freq_factors: None,
        rope_style: if arch == Arch::Llama {
            RopeStyle::Interleaved
        } else {
            RopeStyle::Half
        },
        tie_embeddings: !content.tensor_infos.contains_key("output.weight"),
        attn_bias: content.tensor_infos.contains_key("blk.0.attn_q.bias"),
        qk_norm: content
            .tensor_infos
            .contains_key("blk.0.attn_q_norm.weight"),
        sliding_window: None,
        max_positions: meta.usize(&k("context_length")).unwrap_or(4096),
    };
    let mut cfg = cfg;
    if content.tensor_infos.contains_key("rope_freqs.weight") {
        let factors = content
            .tensor(&mut file, "rope_freqs.weight", &Device::Cpu)
            .and_then(|q| q.dequantize(&Device::Cpu))
            .and_then(|t| t.to_dtype(DType::F64))
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f64>())
            .ctx("reading rope_freqs.weight")?;
        if factors.len() != cfg.head_dim / 2 {
            return Err(Error::Weight {
                name: "rope_freqs.weight".into(),
                why: format!("{} factors for head dim {}", factors.len(), cfg.head_dim),
            });
        }
        cfg.rope_freq_factors = Some(factors);
    }
    cfg.validate()?;

    let mut tensors = HashMap::new();
    let mut quant = HashMap::new();
    let mut packed = HashMap::new();
    let repack = device.is_cpu();
    let names: Vec<String> = content.tensor_infos.keys().cloned().collect();
    for name in names {
        let Some(hf) = hf_name(&name) else {
            tracing::debug!(tensor = %name, "ignoring GGUF tensor");
            continue;
        };
        if quantized && keep_quantized(&content.tensor_infos[&name]) {
            let q = content
                .tensor(&mut file, &name, device)
                .ctx(&format!("reading {name}"))?;
            match PackKind::of(q.dtype()).filter(|_| repack) {
                Some(kind) => {
                    let (n, k) = q.shape().dims2().ctx(&format!("{name} dims"))?;
                    let data = q.data().ctx(&format!("reading {name}"))?;
                    packed.insert(hf, Arc::new(Packed::new(kind, &data, n, k)));
                }
                None => {
                    quant.insert(hf, Arc::new(q));
                }
            }
            continue;
        }
        let q = content
            .tensor(&mut file, &name, &Device::Cpu)
            .ctx(&format!("reading {name}"))?;
        let t = q
            .dequantize(&Device::Cpu)
            .and_then(|t| t.to_dtype(dtype))
            .and_then(|t| t.to_device(device))
            .ctx(&format!("dequantizing {name}"))?;
        tensors.insert(hf, t);
    }
    let weights = Weights {
        tensors,
        quant,
        packed,
    };
    release_freed_memory();
    Ok((cfg, weights, content.metadata))
}

/// Returns the heap's free pages to the system: each tensor was read into a buffer that
/// repacking copied and freed, and glibc keeps such memory mapped (the holes between live
/// matrices), which measured 1.2-1.4x the file's size resident instead of 1.1x.
fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free memory to the system.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// GGUF (llama.cpp) tensor names and their HF names: whole names, then per-layer suffixes
/// (`blk.N.` / `model.layers.N.`).
const GLOBAL_NAMES: &[(&str, &str)] = &[
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
];
const LAYER_NAMES: &[(&str, &str)] = &[
    ("attn_norm.weight", "input_layernorm.weight"),
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_q.bias", "self_attn.q_proj.bias"),
    ("attn_k.bias", "self_attn.k_proj.bias"),
    ("attn_v.bias", "self_attn.v_proj.bias"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("attn_q_norm.weight", "self_attn.q_norm.weight"),
    ("attn_k_norm.weight", "self_attn.k_norm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
];

/// Maps a name through the tables, `from` side to the other (`gguf_side`: from GGUF to HF).
fn map_name(name: &str, gguf_side: bool) -> Option<String> {
    let pick = |&(g, h): &(&'static str, &'static str)| if gguf_side { (g, h) } else { (h, g) };
    if let Some((_, to)) = GLOBAL_NAMES
        .iter()
        .map(pick)
        .find(|(from, _)| *from == name)
    {
        return Some(to.into());
    }
    let (prefix, other) = if gguf_side {
        ("blk.", "model.layers.")
    } else {
        ("model.layers.", "blk.")
    };
    let (layer, tail) = name.strip_prefix(prefix)?.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (_, to) = LAYER_NAMES
        .iter()
        .map(pick)
        .find(|(from, _)| *from == tail)?;
    Some(format!("{other}{layer}.{to}"))
}

/// Maps a GGUF tensor name to its HF name.
fn hf_name(gguf: &str) -> Option<String> {
    map_name(gguf, true)
}

/// Maps an HF tensor name to its GGUF name.
pub(crate) fn gguf_name(hf: &str) -> Option<String> {
    map_name(hf, false)
}

/// Reads an HF directory's config and safetensors weights.
pub(crate) fn load_hf(dir: &Path, dtype: DType, device: &Device) -> Result<(ModelConfig, Weights)> {
    let cfg_path = dir.join("config.json");
    let text = fs_err::read_to_string(&cfg_path)?;
    let hf: HfConfig = serde_json::from_str(&text).map_err(|e| Error::Config {
        why: format!("{}: {e}", cfg_path.display()),
    })?;
    let cfg = hf.resolve()?;
    let mut files: Vec<PathBuf> = fs_err::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(Error::NotFound {
            what: "*.safetensors".into(),
            path: dir.to_path_buf(),
        });
    }
    let mut tensors = HashMap::new();
    for f in &files {
        let loaded = candle_core::safetensors::load(f, &Device::Cpu)
            .ctx(&format!("reading {}", f.display()))?;
        for (name, t) in loaded {
            let t = t
                .to_dtype(dtype)
                .and_then(|t| t.to_device(device))
                .ctx(&format!("converting {name}"))?;
            tensors.insert(name, t);
        }
    }
    Ok((
        cfg,
        Weights {
            tensors,
            quant: HashMap::new(),
            packed: HashMap::new(),
        },
    ))
}

/// Content hash of the model files (blake3, hex): every byte of the GGUF file, or of every
/// safetensors file in name order. About 1 GB/s on one core: ~0.1 s for SmolLM2-135M.
pub(crate) fn content_hash(source: &ModelSource) -> Result<String> {
    let mut h = blake3::Hasher::new();
    let files = match source {
        ModelSource::Gguf(p) => vec![p.clone()],
        ModelSource::HfDir(d) => {
            let mut v: Vec<PathBuf> = fs_err::read_dir(d)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            v.sort();
            v
        }
    };
    for f in files {
        let mut file = fs_err::File::open(&f)?;
        h.update_reader(&mut file)?;
    }
    Ok(h.finalize().to_hex().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_names_map_both_ways() {
        for (g, h) in [
            ("token_embd.weight", "model.embed_tokens.weight"),
            (
                "blk.3.attn_q_norm.weight",
                "model.layers.3.self_attn.q_norm.weight",
            ),
            (
                "blk.12.ffn_down.weight",
                "model.layers.12.mlp.down_proj.weight",
            ),
        ] {
            assert_eq!(hf_name(g).as_deref(), Some(h));
            assert_eq!(gguf_name(h).as_deref(), Some(g));
        }
        for unknown in [
            "rope_freqs.weight",
            "blk.x.attn_q.weight",
            "blk.0.nope",
            "model.layers.0",
        ] {
            assert_eq!(hf_name(unknown), None, "{unknown}");
            assert_eq!(gguf_name(unknown), None, "{unknown}");
        }
    }
}
