#![deny(missing_docs)]
//! ragkv's LLM runtime on candle, with a KV cache that can be exported, stored, re-positioned
//! and imported.
//!
//! - [`Model::load`] reads a GGUF file (weights dequantized to the requested dtype, or kept in
//!   their quantized blocks with [`LoadOptions::quantized`]: `linear.rs`, `quant.rs`;
//!   tokenizer and chat template from its metadata) or an HF directory (`config.json`,
//!   safetensors, `tokenizer.json`).
//! - [`Decoder::prefill`] computes a chunk's [`Kv`] at any start position; [`Kv::to_bytes`] /
//!   [`Kv::from_bytes`] convert to the store's layer-major layout; [`Decoder::reposition`] moves
//!   stored keys to new positions; [`Decoder::recompute`] repairs an assembled context by
//!   recomputing chosen tokens with full attention, chosen by [`Decoder::blend`] (layer-1
//!   deviation), [`link_positions`] (every chunk's first tokens), [`sensitive_positions`]
//!   (the tokens whose rows moved most between the contexts ingest prefilled them in,
//!   [`Kv::drift`]) or
//!   [`Decoder::question_attention`] ([`top_share`] of what the question attends to, or
//!   [`window_positions`]: contiguous windows at the chunk boundaries and around it);
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
mod device;
mod error;
mod generate;
mod gguf;
mod gguf_reader;
mod gpu_graph;
mod gpu_ops;
mod heap;
pub mod hub;
mod joined;
mod kv;
mod kv_q8;
mod linear;
mod loaded;
mod quant;
mod rope;
mod simd;
mod source;
mod swiglu;
/// Tiny random-weight models in every supported family, for tests (the `testing` feature).
#[cfg(any(test, feature = "testing"))]
pub mod synthetic;
mod synthetic_gguf;
mod synthetic_shape;
mod template;
mod tokenizer;
mod upload;
mod weights;

pub use candle_core::{DType, Device, Error as TensorError, Tensor, D};
pub use config::{Activation, Arch, LayerPattern, ModelConfig, RopeScaling, RopeStyle};
pub use decoder::{
    link_positions, sensitive_positions, top_share, window_positions, Decoder, Logits, Repaired,
    StepSeq,
};
pub use device::{device, pin_thread_count, DeviceSpec};
pub use error::{Error, Result};
pub use generate::{
    generate, logits_row, Advance, Decoding, FinishReason, GenerateParams, Generation, Sampler,
};
pub use heap::tune_heap;
pub use kv::{to_schema_dtype as kv_schema_dtype, Kv, KvCache};
pub use kv_q8::{q8_bytes_per_token, Q8_CACHE};
pub use loaded::{models_dir, LoadOptions, Model, QWEN_CODER_FILE, SMOLLM2_FILE};
pub use simd::{kernel_path, set_kernel_path, KernelPath, KERNELS_ENV};
pub use source::ModelSource;
pub use synthetic_shape::{block_type, shape as shape_preset, write_shaped, Shape, SHAPES};
pub use template::{chatml, Message, Piece, RagPrompt};
pub use tokenizer::{TokenStream, Tokenizer};

/// Helpers the crate's unit tests share with its integration tests (one file for both).
#[cfg(test)]
#[path = "../tests/common/mod.rs"]
pub(crate) mod test_util;
