#![deny(missing_docs)]
//! ragkv's LLM runtime on candle, with a KV cache that can be exported, stored, re-positioned
//! and imported.
//!
//! - [`Model::load`] reads a GGUF file (weights dequantized to the requested dtype, or kept in
//!   their quantized blocks with [`LoadOptions::quantized`]: `linear.rs`, `quant.rs`;
//!   tokenizer and chat template from its metadata) or an HF directory (`config.json`,
//!   safetensors, `tokenizer.json`).
//! - [`Model::prefill`] computes a chunk's [`Kv`] at any start position; [`Kv::to_bytes`] /
//!   [`Kv::from_bytes`] convert to the store's layer-major layout; [`Model::reposition`] moves
//!   stored keys to new positions; [`Model::recompute`] repairs an assembled context by
//!   recomputing chosen tokens with full attention, chosen by [`Model::blend`] (layer-1
//!   deviation), [`link_positions`] (every chunk's first tokens) or
//!   [`Model::question_attention`] ([`top_share`] of what the question attends to);
//!   [`KvCache::from_kv`] resumes decoding from stored KV.
//! - [`generate`] decodes with greedy / temperature / top-k / top-p sampling, stop tokens and
//!   stop strings, streaming text incrementally. For many sequences at once,
//!   [`Decoder::step`] runs one batched step (each sequence over its own [`KvCache`]) and a
//!   [`Decoding`] per sequence samples from its row of the logits.
//!
//! Everything here is blocking compute: call it from a dedicated thread, never from an async
//! worker.

mod attention;
mod config;
mod decoder;
mod error;
mod generate;
mod gguf;
pub mod hub;
mod kv;
mod kv_q8;
mod linear;
mod quant;
mod rope;
mod simd;
mod swiglu;
pub mod synthetic;
mod synthetic_gguf;
mod synthetic_shape;
mod template;
mod tokenizer;
mod upload;
mod weights;

use std::collections::HashMap;
use std::path::Path;

pub use candle_core::{DType, Device, Tensor, D};
pub use config::{Activation, Arch, LayerPattern, ModelConfig, RopeScaling, RopeStyle};
pub use decoder::{link_positions, top_share, Decoder, Logits, Repaired};
pub use error::{Error, Result};
pub use generate::{
    generate, Advance, Decoding, FinishReason, GenerateParams, Generation, Sampler,
};
pub use kv::{to_schema_dtype as kv_schema_dtype, Kv, KvCache};
pub use kv_q8::{q8_bytes_per_token, Q8_CACHE};
pub use simd::{kernel_path, set_kernel_path, KernelPath, KERNELS_ENV};
pub use synthetic_shape::{block_type, shape as shape_preset, write_shaped, Shape, SHAPES};
pub use template::{chatml, Message, Piece, RagPrompt};
pub use tokenizer::{TokenStream, Tokenizer};
pub use weights::ModelSource;

use error::Ctx;

/// How to load a model.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Compute (and KV) dtype. Default f32; dense weights are converted to it.
    pub dtype: DType,
    /// Where the weights and compute go.
    pub device: Device,
    /// Keep GGUF matrices in their quantized block types: memory near the file's size and a
    /// decode step that reads 4-8x fewer bytes, with 8-bit activations (llama.cpp's scheme).
    /// Default `false` (every weight dequantized to `dtype` at load): on SmolLM2-135M the
    /// quantized path changes greedy answers of the planted-fact test, not yet judged against
    /// llama.cpp's. For HF directories on the CPU: BF16/F16 matrices stay 16-bit (half of
    /// f32's memory and decode bytes) instead of being widened to `dtype`.
    pub quantized: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            dtype: DType::F32,
            device: Device::Cpu,
            quantized: false,
        }
    }
}

/// Fixes the compute thread count for the process: `RAYON_NUM_THREADS`, when unset, becomes
/// the number of CPUs this process may use. Call it first thing in `main`, before any thread
/// starts (it sets an environment variable).
///
/// Without it candle looks the count up on every f32 matrix product, and where the kernel
/// reports no CPU capacities (most VMs) that means parsing `/proc/cpuinfo`: measured at
/// several milliseconds per decoded token on SmolLM2-135M (`perf`, 2-core VM).
pub fn pin_thread_count() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
}

/// A compute device by name: `cpu`, `cuda` (GPU 0) or `cuda:N`.
///
/// Parsing checks the name only; [`DeviceSpec::open`] opens the device. CUDA needs a build with
/// the `cuda` feature (`cargo build --features cuda`, see `scripts/cuda-toolkit.sh`); without it
/// opening a CUDA device is an [`Error::Unsupported`] that says so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSpec {
    /// The CPU.
    Cpu,
    /// A CUDA GPU by ordinal.
    Cuda(usize),
}

impl std::str::FromStr for DeviceSpec {
    type Err = Error;

    fn from_str(name: &str) -> Result<DeviceSpec> {
        let name = name.trim();
        let bad = || Error::Config {
            why: format!("device {name:?}: expected cpu, cuda or cuda:N"),
        };
        if name.eq_ignore_ascii_case("cpu") {
            return Ok(DeviceSpec::Cpu);
        }
        match name.strip_prefix("cuda") {
            Some("") => Ok(DeviceSpec::Cuda(0)),
            Some(rest) => rest
                .strip_prefix(':')
                .and_then(|n| n.parse().ok())
                .map(DeviceSpec::Cuda)
                .ok_or_else(bad),
            None => Err(bad()),
        }
    }
}

impl DeviceSpec {
    /// Opens the device (for CUDA: creates its context and stream).
    pub fn open(self) -> Result<Device> {
        match self {
            DeviceSpec::Cpu => Ok(Device::Cpu),
            DeviceSpec::Cuda(ordinal) => cuda_device(ordinal),
        }
    }
}

/// Parses and opens a device name (see [`DeviceSpec`]).
pub fn device(name: &str) -> Result<Device> {
    name.parse::<DeviceSpec>()?.open()
}

#[cfg(feature = "cuda")]
fn cuda_device(ordinal: usize) -> Result<Device> {
    Device::new_cuda(ordinal).ctx(&format!("opening CUDA device {ordinal}"))
}

#[cfg(not(feature = "cuda"))]
fn cuda_device(ordinal: usize) -> Result<Device> {
    Err(Error::Unsupported {
        what: format!(
            "device cuda:{ordinal}: this build has no CUDA support (rebuild with `--features cuda`)"
        ),
    })
}

/// A loaded model: decoder, tokenizer and identity.
#[derive(Debug)]
pub struct Model {
    decoder: Decoder,
    tokenizer: Tokenizer,
    weights: weights::Weights,
    weights_hash: String,
    /// The file or directory name, for messages.
    name: String,
}

impl Model {
    /// Loads a model from a GGUF file or an HF directory.
    pub fn load(source: &ModelSource, opts: &LoadOptions) -> Result<Model> {
        let t = std::time::Instant::now();
        let (cfg, weights, tokenizer) = match source {
            ModelSource::Gguf(path) => {
                let (cfg, w, md) =
                    weights::load_gguf(path, opts.dtype, opts.quantized, &opts.device)?;
                let tokenizer = Tokenizer::from_gguf(&md)?;
                drop(md);
                // The metadata and the tokenizer's build left freed heap behind (a 262k
                // SentencePiece vocabulary: ~100 MB).
                weights::release_freed_memory();
                (cfg, w, tokenizer)
            }
            ModelSource::HfDir(dir) => {
                let (cfg, w) = weights::load_hf(dir, opts.dtype, opts.quantized, &opts.device)?;
                (cfg, w, Tokenizer::from_hf_dir(dir)?)
            }
        };
        // Quantized matrices compute with 8-bit activations (llama.cpp's scheme): KV differs
        // slightly from the dequantized path's, so the two get different namespaces.
        let mut weights_hash = weights::content_hash(source)?;
        if weights.has_quantized() {
            weights_hash.push_str("+q8-activations");
        }
        let name = source.name();
        let decoder = Decoder::new(cfg, &weights, opts.dtype, &opts.device)?;
        tracing::info!(arch = decoder.config().arch.name(), layers = decoder.config().layers, elapsed = ?t.elapsed(), "model loaded");
        Ok(Model {
            decoder,
            tokenizer,
            weights,
            weights_hash,
            name,
        })
    }

    /// The model's file or directory name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The longest sequence the model takes (prompt and answer), in tokens.
    pub fn max_positions(&self) -> usize {
        self.config().max_positions
    }

    /// The model's shape.
    pub fn config(&self) -> &ModelConfig {
        self.decoder.config()
    }

    /// The decoder (prefill, batched steps, KV operations).
    pub fn decoder(&self) -> &Decoder {
        &self.decoder
    }

    /// The model's tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Compute (and KV) dtype.
    pub fn dtype(&self) -> DType {
        self.decoder.dtype()
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        self.decoder.device()
    }

    /// Waits until the work this thread queued on the model's device is done (a no-op on the
    /// CPU). On CUDA each thread queues on its own stream, and nothing orders one thread's
    /// stream after another's: a loader thread calls this before handing the tensors it made
    /// to the decoding thread.
    pub fn settle(&self) -> Result<()> {
        upload::settle(self.device())
    }

    /// Bytes the loaded weights hold in memory (quantized matrices at their block size).
    pub fn weights_bytes(&self) -> usize {
        self.weights.resident_bytes()
    }

    /// blake3 of the weight files (with `+q8-activations` when matrices stay quantized: their
    /// KV is computed with 8-bit activations).
    pub fn weights_hash(&self) -> &str {
        &self.weights_hash
    }

    /// The store layout of this model's KV.
    pub fn kv_layout(&self) -> Result<schema::KvLayout> {
        let c = self.config();
        Ok(schema::KvLayout {
            layers: c.layers as u16,
            kv_heads: c.kv_heads as u16,
            head_dim: c.head_dim as u16,
            dtype: kv::to_schema_dtype(self.dtype())?,
        })
    }

    /// The KV namespace fingerprint of this model with the given chunker settings and chunk
    /// template. Computing it costs nothing beyond the weight hash taken at load (blake3 over
    /// the weight files, ~1 GB/s).
    pub fn fingerprint(&self, chunker: &str, template: &str) -> Result<schema::ModelFingerprint> {
        Ok(schema::ModelFingerprint {
            weights: self.weights_hash.clone(),
            layout: self.kv_layout()?,
            tokenizer: self.tokenizer.hash.clone(),
            positions: self.config().positions_fingerprint(),
            chunker: chunker.into(),
            template: template.into(),
        })
    }

    /// KV of `tokens` computed alone at positions `start_pos..`, and the logits after the last.
    pub fn prefill(&self, tokens: &[u32], start_pos: usize) -> Result<(Kv, Tensor)> {
        self.decoder.prefill(tokens, start_pos)
    }

    /// KV of each chunk computed alone from position 0, in one batched forward pass; see
    /// [`Decoder::prefill_many`].
    pub fn prefill_many(&self, chunks: &[&[u32]]) -> Result<Vec<Kv>> {
        self.decoder.prefill_many(chunks)
    }

    /// Moves `kv` by `delta` positions (keys rotated, values unchanged).
    pub fn reposition(&self, kv: &Kv, delta: i64) -> Result<Kv> {
        self.decoder.reposition(kv, delta)
    }

    /// Recomputes the `share` of an assembled context's tokens whose KV deviates most from
    /// full attention, then runs `question`; see [`Decoder::blend`].
    pub fn blend(
        &self,
        kv: &Kv,
        tokens: &[u32],
        exact: usize,
        share: f64,
        question: &[u32],
    ) -> Result<Repaired> {
        self.decoder.blend(kv, tokens, exact, share, question)
    }

    /// Recomputes the tokens at `positions` of an assembled context with full attention and
    /// runs `question` after it, in one pass; see [`Decoder::recompute`].
    pub fn recompute(
        &self,
        kv: &Kv,
        tokens: &[u32],
        positions: &[usize],
        question: &[u32],
    ) -> Result<Repaired> {
        self.decoder.recompute(kv, tokens, positions, question)
    }

    /// Attention of a question to each position of an assembled context on the first
    /// `layers` layers; see [`Decoder::question_attention`].
    pub fn question_attention(&self, kv: &Kv, question: &[u32], layers: usize) -> Result<Vec<f32>> {
        self.decoder.question_attention(kv, question, layers)
    }

    /// An empty decoding cache.
    pub fn new_cache(&self, capacity: usize) -> Result<KvCache> {
        self.decoder.new_cache(capacity)
    }

    /// The spellings of the BOS and first EOS tokens, as templates see them.
    fn bos_eos(&self) -> (String, String) {
        let t = &self.tokenizer;
        let name = |id: Option<u32>| id.and_then(|i| t.id_to_token(i)).unwrap_or_default();
        (name(t.bos), name(t.eos.first().copied()))
    }

    /// Tokenizes a chat through the model's template (ChatML if it has none). Message
    /// contents are plain text: only the template's markup produces control tokens.
    pub fn chat_tokens(&self, messages: &[Message]) -> Result<Vec<u32>> {
        let (bos, eos) = self.bos_eos();
        let pieces = template::chat_pieces(
            self.tokenizer.chat_template.as_deref(),
            messages,
            &bos,
            &eos,
        );
        self.prompt_tokens(&pieces)
    }

    /// Where the model's chat template puts a RAG prompt's system prompt, context and
    /// question; an error naming the model if it cannot be split around the context.
    pub fn rag_prompt(&self) -> Result<RagPrompt> {
        let (bos, eos) = self.bos_eos();
        RagPrompt::new(
            self.tokenizer.chat_template.as_deref(),
            &bos,
            &eos,
            &self.name,
        )
    }

    /// Tokenizes the start of a prompt (markup and outside text), with the BOS token the
    /// model expects in front if the markup did not spell it.
    pub fn prompt_tokens(&self, pieces: &[Piece]) -> Result<Vec<u32>> {
        let t = &self.tokenizer;
        let mut ids = t.encode_pieces(pieces)?;
        if t.add_bos {
            if let Some(bos) = t.bos {
                if ids.first() != Some(&bos) {
                    ids.insert(0, bos);
                }
            }
        }
        Ok(ids)
    }

    /// Generates after `prompt` with a fresh cache.
    pub fn generate(
        &self,
        prompt: &[u32],
        params: &GenerateParams,
        on_text: impl FnMut(&str) -> bool,
    ) -> Result<Generation> {
        let mut cache = self.new_cache(prompt.len() + params.max_tokens)?;
        generate(
            &self.decoder,
            &self.tokenizer,
            &mut cache,
            prompt,
            params,
            on_text,
        )
    }

    /// Writes the model as an HF directory (`config.json`, `model.safetensors`,
    /// `tokenizer.json`, `tokenizer_config.json`), q/k weights in HF order. Used to test the
    /// safetensors path and to run other runtimes on the same weights.
    pub fn export_hf(&self, dir: &Path) -> Result<()> {
        let c = self.config();
        if c.arch == Arch::Gemma3 {
            return Err(Error::Unsupported {
                what: "exporting a Gemma 3 model to an HF directory".into(),
            });
        }
        if c.rope_freq_factors.is_some() {
            return Err(Error::Unsupported {
                what: "exporting a GGUF model with rope_freqs factors to an HF directory".into(),
            });
        }
        fs_err::create_dir_all(dir)?;
        let tensors: HashMap<String, Tensor> = self.weights.to_hf(c)?;
        candle_core::safetensors::save(&tensors, dir.join("model.safetensors"))
            .ctx("writing safetensors")?;
        let config = serde_json::json!({
            "model_type": c.arch.name(),
            "architectures": [c.arch.hf_class()],
            "vocab_size": c.vocab_size,
            "hidden_size": c.hidden,
            "intermediate_size": c.intermediate,
            "num_hidden_layers": c.layers,
            "num_attention_heads": c.heads,
            "num_key_value_heads": c.kv_heads,
            "head_dim": c.head_dim,
            "rms_norm_eps": c.rms_eps,
            "rope_theta": c.rope_theta,
            "tie_word_embeddings": c.tie_embeddings,
            "max_position_embeddings": c.max_positions,
            "attention_bias": c.attn_bias,
            "sliding_window": c.sliding_window,
            "rope_scaling": c.rope_scaling.map(|r| serde_json::json!({
                "rope_type": "llama3",
                "factor": r.factor,
                "low_freq_factor": r.low_freq_factor,
                "high_freq_factor": r.high_freq_factor,
                "original_max_position_embeddings": r.original_max_position_embeddings,
            })),
            "bos_token_id": self.tokenizer.bos,
            "eos_token_id": self.tokenizer.eos.first(),
        });
        fs_err::write(
            dir.join("config.json"),
            serde_json::to_vec_pretty(&config).expect("json"),
        )?;
        self.tokenizer
            .inner()
            .save(dir.join("tokenizer.json"), false)
            .map_err(|e| Error::Tokenizer { why: e.to_string() })?;
        let t = &self.tokenizer;
        let name = |id: Option<u32>| id.and_then(|i| t.id_to_token(i));
        let tcfg = serde_json::json!({
            "bos_token": name(t.bos),
            "eos_token": name(t.eos.first().copied()),
            "add_bos_token": t.add_bos,
            "chat_template": t.chat_template,
        });
        fs_err::write(
            dir.join("tokenizer_config.json"),
            serde_json::to_vec_pretty(&tcfg).expect("json"),
        )?;
        Ok(())
    }
}

/// Where `scripts/fetch-models.sh` puts models: `$RAGKV_CACHE/models`, default
/// `~/.cache/ragkv/models`.
pub fn models_dir() -> std::path::PathBuf {
    schema::cache_dir().join("models")
}

/// The CI / default model file name inside [`models_dir`].
pub const SMOLLM2_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// The benchmark model file name inside [`models_dir`].
pub const QWEN_CODER_FILE: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

/// Helpers the crate's unit tests share with its integration tests (one file for both).
#[cfg(test)]
#[path = "../tests/common/mod.rs"]
pub(crate) mod test_util;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_parse() {
        let parse = |s: &str| s.parse::<DeviceSpec>();
        assert_eq!(parse("cpu").unwrap(), DeviceSpec::Cpu);
        assert_eq!(parse(" CPU ").unwrap(), DeviceSpec::Cpu);
        assert_eq!(parse("cuda").unwrap(), DeviceSpec::Cuda(0));
        assert_eq!(parse("cuda:3").unwrap(), DeviceSpec::Cuda(3));
        assert!(matches!(device("cpu"), Ok(Device::Cpu)));
        for bad in ["gpu", "cuda:", "cuda:x", "cuda0", "metal", ""] {
            assert!(
                matches!(parse(bad), Err(Error::Config { .. })),
                "{bad:?} accepted"
            );
        }
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_says_how_to_get_it() {
        for name in ["cuda", "cuda:1"] {
            let err = device(name).unwrap_err().to_string();
            assert!(err.contains("--features cuda"), "{err}");
        }
    }
}
