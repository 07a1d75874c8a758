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

use crate::config::{Activation, Arch, HfConfig, LayerPattern, ModelConfig, RopeStyle};
use crate::error::{Ctx, Error, Result};
use crate::gguf::{hf_name, shifted_norm, GgufMeta};
use crate::gguf_reader::{GgufFile, TensorEntry, TensorType};
use crate::quant::packed::{PackKind, Packed};
use crate::quant::Kind;
use crate::source::ModelSource;

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

    /// Whether some `IQ4_XS` matrix is multiplied in K-quant tiles (its activations rounded
    /// per 256 values, not per 32 as in the IQ4_NL tiles other kernel paths use).
    pub(crate) fn has_iq4_xs_tiles(&self) -> bool {
        self.packed
            .values()
            .any(|p| p.kind() == PackKind::K(crate::quant::kquant::KKind::Iq4Xs))
    }

    /// Whether some matrix is kept in BF16 ([`crate::quant::half_rows`]).
    pub(crate) fn has_bf16(&self) -> bool {
        self.quant.values().any(|q| q.dtype() == GgmlDType::BF16)
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

/// Whether a GGUF tensor stays in its file's blocks: a matrix in a quantized block type, or in
/// F16 / BF16 (multiplied as they are, half of f32's bytes); f32 ones are converted like any
/// dense weight.
fn keep_quantized(info: &TensorEntry) -> bool {
    info.dims.len() == 2 && info.ty != TensorType::Ggml(GgmlDType::F32)
}

/// Reads a GGUF file: config, weights (matrices kept quantized when `quantized`, see
/// [`keep_quantized`]), and the raw metadata (for the tokenizer).
pub(crate) fn load_gguf(
    path: &Path,
    dtype: DType,
    quantized: bool,
    device: &Device,
) -> Result<(ModelConfig, Weights, HashMap<String, gguf_file::Value>)> {
    let (content, mut file) = GgufFile::open(path)?;
    let meta = GgufMeta(&content.metadata);
    let arch_name = meta.str("general.architecture")?.to_string();
    // llama.cpp's converter writes Mistral (v0.1-v0.3, Nemo) as `llama`; the sliding window
    // of v0.1 is not in its metadata (llama.cpp attends to the whole context).
    let arch = match arch_name.as_str() {
        "llama" => Arch::Llama,
        "qwen2" => Arch::Qwen2,
        "qwen3" => Arch::Qwen3,
        "gemma3" => Arch::Gemma3,
        other => {
            return Err(Error::Unsupported {
                what: format!(
                    "GGUF architecture {other:?} (supported: llama, qwen2, qwen3, gemma3)"
                ),
            })
        }
    };
    let gemma = arch == Arch::Gemma3;
    let k = |s: &str| format!("{arch_name}.{s}");
    let heads = meta.usize(&k("attention.head_count"))?;
    let hidden = meta.usize(&k("embedding_length"))?;
    let vocab = meta.array("tokenizer.ggml.tokens")?.len();
    let layers = meta.usize(&k("block_count"))?;
    let head_dim = meta
        .usize(&k("attention.key_length"))
        .or_else(|_| meta.usize(&k("rope.dimension_count")))
        .unwrap_or(hidden / heads);
    let cfg = ModelConfig {
        arch,
        vocab_size: vocab,
        hidden,
        intermediate: meta.usize(&k("feed_forward_length"))?,
        layers,
        heads,
        kv_heads: meta.usize(&k("attention.head_count_kv")).unwrap_or(heads),
        head_dim,
        rms_eps: meta.f64(&k("attention.layer_norm_rms_epsilon"))?,
        rope_theta: meta.f64(&k("rope.freq_base")).unwrap_or(10_000.0),
        rope_scaling: None,
        rope_linear_factor: match meta.str(&k("rope.scaling.type")) {
            Ok("linear") => Some(meta.f64(&k("rope.scaling.factor"))?),
            Ok("none") | Err(_) => None,
            Ok(other) => {
                return Err(Error::Unsupported {
                    what: format!("GGUF rope scaling {other:?}"),
                })
            }
        },
        rope_freq_factors: None,
        rope_style: if arch == Arch::Llama {
            RopeStyle::Interleaved
        } else {
            RopeStyle::Half
        },
        tie_embeddings: !content.tensors.contains_key("output.weight"),
        attn_bias: content.tensors.contains_key("blk.0.attn_q.bias"),
        qk_norm: content.tensors.contains_key("blk.0.attn_q_norm.weight"),
        // Gemma 3's window comes with the file; its pattern and local base are llama.cpp's
        // constants unless the file names them.
        sliding_window: if gemma {
            Some(meta.usize(&k("attention.sliding_window"))?)
        } else {
            None
        },
        layer_pattern: gemma.then(|| LayerPattern {
            global_every: meta
                .usize(&k("attention.sliding_window_pattern"))
                .unwrap_or(6),
            local_rope_theta: meta.f64(&k("rope.local.freq_base")).unwrap_or(10_000.0),
        }),
        // llama.cpp's rule: `query_pre_attn_scalar` is hidden / heads for the 62-layer 27B
        // and the head dim for every other size.
        attn_scalar: gemma.then(|| {
            if layers == 62 {
                (hidden / heads) as f64
            } else {
                head_dim as f64
            }
        }),
        activation: if gemma {
            Activation::GeluTanh
        } else {
            Activation::Silu
        },
        max_positions: meta.usize(&k("context_length")).unwrap_or(4096),
    };
    let mut cfg = cfg;
    if content.tensors.contains_key("rope_freqs.weight") {
        let factors = content
            .tensor(&mut file, "rope_freqs.weight", &Device::Cpu)?
            .dequantize(&Device::Cpu)
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
    let names: Vec<String> = content.tensors.keys().cloned().collect();
    for name in names {
        let Some(hf) = hf_name(&name, arch) else {
            tracing::debug!(tensor = %name, "ignoring GGUF tensor");
            continue;
        };
        if quantized && keep_quantized(&content.tensors[&name]) {
            // IQ4 matrices keep their 4-bit blocks where the tile kernels run (AVX2, and
            // AVX-512 VNNI whose CPUs all have AVX2): IQ4_XS in K-quant tiles where those
            // kernels take it, else as IQ4_NL blocks; elsewhere they are read as Q8_0 below.
            if repack && crate::simd::avx2() {
                let dims = &content.tensors[&name].dims;
                let blocks = match PackKind::iq4_xs() {
                    Some(kind) => content.iq4_xs_blocks(&mut file, &name)?.map(|b| (kind, b)),
                    None => None,
                };
                let blocks = match blocks {
                    Some(b) => Some(b),
                    None => content
                        .iq4_nl_blocks(&mut file, &name)?
                        .map(|b| (PackKind::from(Kind::Iq4Nl), b)),
                };
                if let Some((kind, blocks)) = blocks {
                    let (n, k) = (dims[0], dims[1]);
                    packed.insert(hf, Arc::new(Packed::new(kind, &blocks, n, k)));
                    continue;
                }
            }
            let q = content.tensor(&mut file, &name, device)?;
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
        let q = content.tensor(&mut file, &name, &Device::Cpu)?;
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
pub(crate) fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free memory to the system.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Reads an HF directory's config and safetensors weights. With `quantized`, on the CPU,
/// 16-bit matrices (BF16 and F16 checkpoints) stay 16-bit and multiply with their own
/// kernels ([`crate::quant::half_rows`]): half of f32's memory, and a decode step reads two
/// bytes per weight; everything else converts to `dtype`.
pub(crate) fn load_hf(
    dir: &Path,
    dtype: DType,
    quantized: bool,
    device: &Device,
) -> Result<(ModelConfig, Weights)> {
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
    let mut quant = HashMap::new();
    for f in &files {
        let loaded = candle_core::safetensors::load(f, &Device::Cpu)
            .ctx(&format!("reading {}", f.display()))?;
        for (name, t) in loaded {
            let half = match t.dtype() {
                DType::BF16 => Some(GgmlDType::BF16),
                DType::F16 => Some(GgmlDType::F16),
                _ => None,
            };
            if let (Some(g), true, 2) = (half, quantized && device.is_cpu(), t.rank()) {
                // Exact: the 16-bit values pass through f32 and back.
                let q = QTensor::quantize(&t, g).ctx(&format!("keeping {name} 16-bit"))?;
                quant.insert(name, Arc::new(q));
                continue;
            }
            let t = if shifted_norm(cfg.arch, &name) {
                t.to_dtype(DType::F32)
                    .and_then(|t| t + 1.0)
                    .ctx(&format!("shifting {name}"))?
            } else {
                t
            };
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
            quant,
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
