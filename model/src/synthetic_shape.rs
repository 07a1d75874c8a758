//! Random-weight GGUF files of real models' shapes: the same layers, widths, heads, vocabulary
//! size and block types as the file users download, so that both ragkv and llama.cpp load
//! them and every timing (prefill, decode, KV bytes, GPU transfers) is that model's, without
//! shipping gigabytes. The answers are noise; correctness on such a file is checked as one
//! engine's tokens against another's (GPU against CPU), never against text.
//!
//! | part          | what is written                                                         |
//! |---------------|-------------------------------------------------------------------------|
//! | matrices      | uniform in ±√(3/fan_in), quantized to the asked block type; a matrix    |
//! |               | whose rows do not divide into that type's blocks falls back to Q8_0     |
//! |               | (llama.cpp's quantizer falls back the same way for K-quants)            |
//! | embedding     | uniform in ±1, same block type (fallback as above); tied output head     |
//! | norms, biases | f32; norms near 1, biases near 0                                        |
//! | vocabulary    | the 256 byte symbols, 4 merges, the family's special tokens, then       |
//! |               | filler tokens `<|fill_N|>` up to the real vocabulary size               |
//!
//! The writer's own tests use a tiny custom shape; the presets ([`SHAPES`]) are the
//! benchmark models' (`ragkv bench model --synthetic NAME:TYPE`).

use std::path::Path;

use candle_core::quantized::{gguf_file::Value, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};

use crate::config::Arch;
use crate::error::{Ctx, Error, Result};
pub use crate::synthetic_gguf::Shape;
use crate::synthetic_gguf::{byte_vocab, family, gguf_metadata};

/// The benchmark models' shapes (their `config.json`s): SmolLM2-135M-Instruct, Qwen2.5-0.5B,
/// Llama-3.2-1B (without its RoPE scaling, which costs nothing at these lengths) and
/// Qwen2.5-1.5B. Every one ties its output head to the embedding, as the real ones do.
pub const SHAPES: &[Shape] = &[
    Shape {
        name: "smollm2-135m",
        arch: Arch::Llama,
        hidden: 576,
        layers: 30,
        heads: 9,
        kv_heads: 3,
        head_dim: 64,
        intermediate: 1536,
        vocab: 49152,
        rope_theta: 100_000.0,
        context: 8192,
    },
    Shape {
        name: "qwen2.5-0.5b",
        arch: Arch::Qwen2,
        hidden: 896,
        layers: 24,
        heads: 14,
        kv_heads: 2,
        head_dim: 64,
        intermediate: 4864,
        vocab: 151_936,
        rope_theta: 1_000_000.0,
        context: 32768,
    },
    Shape {
        name: "llama-3.2-1b",
        arch: Arch::Llama,
        hidden: 2048,
        layers: 16,
        heads: 32,
        kv_heads: 8,
        head_dim: 64,
        intermediate: 8192,
        vocab: 128_256,
        rope_theta: 500_000.0,
        context: 8192,
    },
    Shape {
        name: "qwen2.5-1.5b",
        arch: Arch::Qwen2,
        hidden: 1536,
        layers: 28,
        heads: 12,
        kv_heads: 2,
        head_dim: 128,
        intermediate: 8960,
        vocab: 151_936,
        rope_theta: 1_000_000.0,
        context: 32768,
    },
];

/// A preset by name.
pub fn shape(name: &str) -> Result<&'static Shape> {
    SHAPES.iter().find(|s| s.name == name).ok_or_else(|| {
        let known: Vec<&str> = SHAPES.iter().map(|s| s.name).collect();
        Error::Input {
            why: format!("unknown model shape {name:?} (known: {})", known.join(", ")),
        }
    })
}

/// A block type by its llama.cpp name: `f16`, `bf16`, `q4_0`, `q4_1`, `q5_0`, `q5_1`, `q8_0`,
/// `q2_k`, `q3_k`, `q4_k`, `q5_k`, `q6_k` (case-insensitive, `q4k` too).
pub fn block_type(name: &str) -> Result<GgmlDType> {
    let n = name.to_ascii_lowercase().replace('_', "");
    Ok(match n.as_str() {
        "f16" => GgmlDType::F16,
        "bf16" => GgmlDType::BF16,
        "q40" => GgmlDType::Q4_0,
        "q41" => GgmlDType::Q4_1,
        "q50" => GgmlDType::Q5_0,
        "q51" => GgmlDType::Q5_1,
        "q80" => GgmlDType::Q8_0,
        "q2k" => GgmlDType::Q2K,
        "q3k" => GgmlDType::Q3K,
        "q4k" => GgmlDType::Q4K,
        "q5k" => GgmlDType::Q5K,
        "q6k" => GgmlDType::Q6K,
        _ => {
            return Err(Error::Input {
                why: format!(
                    "unknown block type {name:?} \
                 (f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k, q6_k)"
                ),
            })
        }
    })
}

/// One tensor to write: its GGUF name, dims (HF order: rows, columns), how it is filled.
struct Plan {
    name: String,
    dims: Vec<usize>,
    fill: Fill,
}

#[derive(Clone, Copy)]
enum Fill {
    /// Uniform in ±bound, quantized.
    Matrix(f32),
    /// `base` + uniform in ±0.05, f32.
    Vector(f32),
}

fn plans(s: &Shape) -> Vec<Plan> {
    let (h, q, kv, ff) = (
        s.hidden,
        s.heads * s.head_dim,
        s.kv_heads * s.head_dim,
        s.intermediate,
    );
    let m = |name: String, rows: usize, cols: usize| Plan {
        name,
        dims: vec![rows, cols],
        fill: Fill::Matrix((3.0 / cols as f32).sqrt()),
    };
    let v = |name: String, n: usize, base: f32| Plan {
        name,
        dims: vec![n],
        fill: Fill::Vector(base),
    };
    let mut out = vec![Plan {
        name: "token_embd.weight".into(),
        dims: vec![s.vocab, h],
        fill: Fill::Matrix(1.0),
    }];
    for i in 0..s.layers {
        let b = |t: &str| format!("blk.{i}.{t}");
        out.push(v(b("attn_norm.weight"), h, 1.0));
        out.push(m(b("attn_q.weight"), q, h));
        out.push(m(b("attn_k.weight"), kv, h));
        out.push(m(b("attn_v.weight"), kv, h));
        if s.arch == Arch::Qwen2 {
            out.push(v(b("attn_q.bias"), q, 0.0));
            out.push(v(b("attn_k.bias"), kv, 0.0));
            out.push(v(b("attn_v.bias"), kv, 0.0));
        }
        if s.arch == Arch::Qwen3 {
            out.push(v(b("attn_q_norm.weight"), s.head_dim, 1.0));
            out.push(v(b("attn_k_norm.weight"), s.head_dim, 1.0));
        }
        out.push(m(b("attn_output.weight"), h, q));
        out.push(v(b("ffn_norm.weight"), h, 1.0));
        out.push(m(b("ffn_gate.weight"), ff, h));
        out.push(m(b("ffn_up.weight"), ff, h));
        out.push(m(b("ffn_down.weight"), h, ff));
    }
    out.push(v("output_norm.weight".into(), h, 1.0));
    out
}

/// The block type a matrix of `cols` columns gets: `want`, or Q8_0 when its rows do not
/// divide into `want`'s blocks.
fn fitting(want: GgmlDType, cols: usize) -> GgmlDType {
    if cols.is_multiple_of(want.block_size()) {
        want
    } else {
        GgmlDType::Q8_0
    }
}

/// Fills and quantizes one tensor (seeded by its index, so that threads need not share a
/// generator and the file is the same on every machine).
fn build(p: &Plan, index: usize, seed: u64, dtype: GgmlDType) -> Result<QTensor> {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(
        seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
    );
    let n: usize = p.dims.iter().product();
    let (bound, base) = match p.fill {
        Fill::Matrix(b) => (b, 0.0),
        Fill::Vector(base) => (0.05, base),
    };
    let data: Vec<f32> = (0..n)
        .map(|_| base + bound * (rng.gen::<f32>() * 2.0 - 1.0))
        .collect();
    let t = Tensor::from_vec(data, p.dims.as_slice(), &Device::Cpu).ctx("random tensor")?;
    let dtype = match p.fill {
        Fill::Matrix(_) => fitting(dtype, *p.dims.last().unwrap_or(&1)),
        Fill::Vector(_) => GgmlDType::F32,
    };
    QTensor::quantize(&t, dtype).ctx("quantizing a synthetic tensor")
}

/// Writes a random-weight GGUF of `shape` with matrices in `dtype` to `path` (every CPU
/// quantizes a share of the tensors).
pub fn write_shaped(shape: &Shape, dtype: GgmlDType, path: &Path, seed: u64) -> Result<()> {
    let plans = plans(shape);
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(plans.len());
    let mut built: Vec<Option<Result<QTensor>>> = (0..plans.len()).map(|_| None).collect();
    let per = plans.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let plans = &plans;
        let mut handles = Vec::new();
        for (c, slots) in built.chunks_mut(per).enumerate() {
            handles.push(
                std::thread::Builder::new()
                    .name("synthetic-quantize".into())
                    .spawn_scoped(scope, move || {
                        for (j, slot) in slots.iter_mut().enumerate() {
                            let i = c * per + j;
                            *slot = Some(build(&plans[i], i, seed, dtype));
                        }
                    }),
            );
        }
        for h in handles {
            if h.map_err(Error::Io)?.join().is_err() {
                return Err(Error::Input {
                    why: "a quantizing thread panicked".into(),
                });
            }
        }
        Ok(())
    })?;
    let mut tensors = Vec::with_capacity(plans.len());
    for (p, t) in plans.iter().zip(built) {
        let t = t.ok_or_else(|| Error::Input {
            why: format!("{} was not built", p.name),
        })??;
        tensors.push((p.name.clone(), t));
    }
    let meta = metadata(shape);
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let qt_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    if let Some(dir) = path.parent() {
        fs_err::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("gguf.partial");
    let mut f = std::io::BufWriter::new(fs_err::File::create(&tmp)?);
    candle_core::quantized::gguf_file::write(&mut f, &meta_refs, &qt_refs).ctx("writing gguf")?;
    std::io::Write::flush(&mut f)?;
    drop(f);
    fs_err::rename(&tmp, path)?;
    Ok(())
}

fn metadata(s: &Shape) -> Vec<(String, Value)> {
    let (specials, pre, template) = family(s.arch);
    let (vocab, _) = byte_vocab(specials, s.vocab);
    let mut meta = gguf_metadata(s, &vocab, pre, template);
    meta.sort_by(|a, b| a.0.cmp(&b.0));
    meta
}

/// A Qwen2 shape small enough for unit tests (writes in milliseconds).
#[cfg(test)]
pub(crate) fn tiny() -> Shape {
    Shape {
        name: "tiny",
        arch: Arch::Qwen2,
        hidden: 64,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        intermediate: 256,
        vocab: 400,
        rope_theta: 10_000.0,
        context: 512,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_files_load_with_the_shape_they_claim() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        write_shaped(&tiny(), GgmlDType::Q4_0, &path, 3).unwrap();
        let src = crate::ModelSource::from_path(&path).unwrap();
        let model = crate::Model::load(&src, &crate::LoadOptions::default()).unwrap();
        let cfg = model.config();
        assert_eq!(
            (cfg.hidden, cfg.layers, cfg.heads, cfg.kv_heads),
            (64, 2, 4, 2)
        );
        assert_eq!((cfg.head_dim, cfg.vocab_size), (16, 400));
        assert!(cfg.tie_embeddings && cfg.attn_bias);
        // It runs: a prefill gives finite logits.
        let (_, logits) = model.decoder().prefill(&[1, 2, 3, 300], 0).unwrap();
        let v: Vec<f32> = logits.flatten_all().unwrap().to_vec1().unwrap();
        assert!(v.iter().all(|x| x.is_finite()));
        let mut f = fs_err::File::open(&path).unwrap();
        let c = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
        // Q4_0 where the rows divide into 32-blocks (all of them here), f32 vectors.
        assert_eq!(
            c.tensor_infos["blk.0.ffn_down.weight"].ggml_dtype,
            GgmlDType::Q4_0
        );
        assert_eq!(
            c.tensor_infos["blk.1.attn_norm.weight"].ggml_dtype,
            GgmlDType::F32
        );
        assert!(!c.tensor_infos.contains_key("output.weight"), "tied head");
        // The same seed writes the same file.
        let again = dir.path().join("again.gguf");
        write_shaped(&tiny(), GgmlDType::Q4_0, &again, 3).unwrap();
        assert_eq!(fs_err::read(&path).unwrap(), fs_err::read(&again).unwrap());
    }

    #[test]
    fn rows_that_do_not_divide_into_k_blocks_fall_back_to_q8_0() {
        assert_eq!(fitting(GgmlDType::Q4K, 896), GgmlDType::Q8_0);
        assert_eq!(fitting(GgmlDType::Q4K, 4864), GgmlDType::Q4K);
        assert_eq!(fitting(GgmlDType::Q4_1, 576), GgmlDType::Q4_1);
    }

    #[test]
    fn presets_and_block_types_by_name() {
        assert_eq!(shape("qwen2.5-0.5b").unwrap().vocab, 151_936);
        assert!(shape("gpt-5")
            .unwrap_err()
            .to_string()
            .contains("smollm2-135m"));
        assert_eq!(block_type("Q4_K").unwrap(), GgmlDType::Q4K);
        assert_eq!(block_type("q3_k").unwrap(), GgmlDType::Q3K);
        assert_eq!(block_type("q8_0").unwrap(), GgmlDType::Q8_0);
        assert_eq!(block_type("BF16").unwrap(), GgmlDType::BF16);
        assert!(block_type("iq2_xxs").is_err());
        for s in SHAPES {
            assert_eq!(s.heads % s.kv_heads, 0, "{}", s.name);
        }
    }
}
