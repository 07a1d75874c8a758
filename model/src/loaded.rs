//! [`Model`]: a loaded model (decoder, tokenizer, identity) and how to load one.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};

use crate::config::{Arch, HfConfig, ModelConfig};
use crate::decoder::Decoder;
use crate::error::{Ctx, Error, Result};
use crate::generate::{generate, GenerateParams, Generation};
use crate::source::ModelSource;
use crate::template::{Message, Piece, RagPrompt};
use crate::tokenizer::Tokenizer;
use crate::{kv, template, upload, weights};

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
        // IQ4_XS in K-quant tiles rounds activations per 256 values, IQ4_NL tiles per 32.
        if weights.has_iq4_xs_tiles() {
            weights_hash.push_str("+iq4xs-q8k");
        }
        // BF16 matrices' prefill rounds activations to BF16 where the CPU multiplies BF16.
        if opts.device.is_cpu()
            && weights.has_bf16()
            && crate::quant::half_rows::rounds_bf16_activations()
        {
            weights_hash.push_str("+bf16-activations");
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
        let mut cache = self.decoder.new_cache(prompt.len() + params.max_tokens)?;
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
        HfConfig {
            bos_token_id: self.tokenizer.bos,
            eos_token_id: self.tokenizer.eos.first().copied(),
            ..HfConfig::of(c)
        }
        .write(dir)?;
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
