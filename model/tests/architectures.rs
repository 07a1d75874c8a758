//! Every architecture against candle-transformers' stock implementation of it, on tiny models
//! with random weights that the test writes itself ([`model::synthetic`]): our decoder loaded
//! from the GGUF file and from the HF directory (both written from the same weights) gives
//! the stock model's logits within 1e-4, on a prompt and on a decoding step after it; KV
//! survives export and import bit for bit; re-positioned keys match keys computed in place.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models as stock;
use common::max_diff;
use model::synthetic::{self, SyntheticSpec};
use model::{Arch, Kv, KvCache, LoadOptions, Logits, Model, ModelSource};

const TOL: f32 = 1e-4;

/// The stock model of a family, on the HF directory's weights and config.
enum Stock {
    Llama(stock::llama::Llama, stock::llama::Cache),
    Qwen2(stock::qwen2::ModelForCausalLM),
    Qwen3(stock::qwen3::ModelForCausalLM),
    Mistral(stock::mistral::Model),
    Gemma3(stock::gemma3::Model),
}

impl Stock {
    /// `window`: HF's window of `w` positions; candle's mistral mask keeps `w + 1` (it
    /// masks `j + w < i`), so it gets `w - 1`.
    fn load(arch: Arch, dir: &std::path::Path, window: Option<usize>) -> Stock {
        let dev = Device::Cpu;
        let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap();
        let tensors = candle_core::safetensors::load(dir.join("model.safetensors"), &dev).unwrap();
        let vb = VarBuilder::from_tensors(tensors, DType::F32, &dev);
        match arch {
            Arch::Llama => {
                let c: stock::llama::LlamaConfig = serde_json::from_str(&cfg).unwrap();
                let c = c.into_config(false);
                let cache = stock::llama::Cache::new(true, DType::F32, &c, &dev).unwrap();
                Stock::Llama(stock::llama::Llama::load(vb, &c).unwrap(), cache)
            }
            Arch::Qwen2 => {
                let c: stock::qwen2::Config = serde_json::from_str(&cfg).unwrap();
                Stock::Qwen2(stock::qwen2::ModelForCausalLM::new(&c, vb).unwrap())
            }
            Arch::Qwen3 => {
                let c: stock::qwen3::Config = serde_json::from_str(&cfg).unwrap();
                Stock::Qwen3(stock::qwen3::ModelForCausalLM::new(&c, vb).unwrap())
            }
            Arch::Mistral => {
                let mut c: stock::mistral::Config = serde_json::from_str(&cfg).unwrap();
                c.sliding_window = window.map(|w| w - 1);
                Stock::Mistral(stock::mistral::Model::new(&c, vb).unwrap())
            }
            // Fed one token at a time (below): a windowed layer's rotating cache of `w`
            // keys is HF's window of `w`.
            Arch::Gemma3 => {
                let mut c: stock::gemma3::Config = serde_json::from_str(&cfg).unwrap();
                if let Some(w) = window {
                    c.sliding_window = w;
                }
                Stock::Gemma3(stock::gemma3::Model::new(false, &c, vb).unwrap())
            }
        }
    }

    /// Logits after `tokens`, which follow `offset` tokens already seen: `(vocab,)`.
    ///
    /// The stock gemma3 (candle-transformers 0.11) fails on prompts of several tokens
    /// (its KV cache takes a non-contiguous tensor), so it gets one token at a time.
    fn forward(&mut self, tokens: &[u32], offset: usize) -> Tensor {
        if let (Stock::Gemma3(m), true) = (&mut *self, tokens.len() > 1) {
            let mut last = None;
            for (i, &t) in tokens.iter().enumerate() {
                let x = Tensor::new(&[t], &Device::Cpu)
                    .unwrap()
                    .unsqueeze(0)
                    .unwrap();
                last = Some(m.forward(&x, offset + i).unwrap());
            }
            return last.expect("tokens").flatten_all().unwrap();
        }
        let x = Tensor::new(tokens, &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let out = match self {
            Stock::Llama(m, cache) => m.forward(&x, offset, cache),
            Stock::Qwen2(m) => m.forward(&x, offset),
            Stock::Qwen3(m) => m.forward(&x, offset),
            Stock::Mistral(m) => m.forward(&x, offset),
            Stock::Gemma3(m) => m.forward(&x, offset),
        }
        .unwrap();
        out.flatten_all().unwrap()
    }
}

fn load(source: ModelSource) -> Model {
    Model::load(&source, &LoadOptions::default()).unwrap()
}

/// Our logits for the last of `prompt`, then for one more token after it.
fn ours(m: &Model, prompt: &[u32], next: u32) -> (Tensor, Tensor) {
    let mut cache = m.decoder().new_cache(prompt.len() + 1).unwrap();
    let all = m
        .decoder()
        .forward(&mut cache, prompt, Logits::All)
        .unwrap();
    let last = all.get(prompt.len() - 1).unwrap();
    let step = m
        .decoder()
        .forward(&mut cache, &[next], Logits::Last)
        .unwrap();
    (last, step)
}

fn prompt(n: usize, seed: u32) -> Vec<u32> {
    // Byte tokens (ids below 256 exist in every synthetic vocabulary), reproducibly spread.
    (0..n as u32)
        .map(|i| (i * 37 + seed * 11 + 5) % 256)
        .collect()
}

/// KV export/import is exact, and re-positioned keys match keys computed in place.
fn kv_round_trip_and_reposition(m: &Model, tokens: &[u32]) {
    let (kv, _) = m.decoder().prefill(tokens, 0).unwrap();
    let bytes = kv.to_bytes(DType::F32).unwrap();
    let back = Kv::from_bytes(&bytes, &m.kv_layout().unwrap(), m.device()).unwrap();
    assert_eq!(
        back.to_bytes(DType::F32).unwrap(),
        bytes,
        "KV bytes changed"
    );
    // Decoding from the imported KV equals decoding from the computed one, bit for bit.
    let next = |kv: &Kv| {
        let mut c = KvCache::from_kv(kv, 4).unwrap();
        m.decoder()
            .forward(&mut c, &[42], Logits::Last)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    assert_eq!(next(&kv), next(&back));
    // Moved by 9 positions vs computed at 9.
    let moved = m.decoder().reposition(&kv, 9).unwrap();
    let (at9, _) = m.decoder().prefill(tokens, 9).unwrap();
    for ((k, v), (k9, v9)) in moved.layers.iter().zip(&at9.layers) {
        let (dk, dv) = (max_diff(k, k9), max_diff(v, v9));
        assert!(
            dk < 1e-4 && dv < 1e-4,
            "reposition: keys {dk:e} values {dv:e}"
        );
    }
}

fn check(spec: SyntheticSpec, gguf_too: bool) {
    let dir = tempfile::tempdir().unwrap();
    let files = synthetic::write(&spec, dir.path()).unwrap();
    let name = format!(
        "{}{}{}",
        spec.arch.name(),
        if spec.llama3_scaling {
            "+llama3 rope"
        } else {
            ""
        },
        spec.sliding_window
            .map(|w| format!("+window {w}"))
            .unwrap_or_default()
    );
    let mut sources = vec![("safetensors", ModelSource::HfDir(files.hf_dir.clone()))];
    if gguf_too {
        sources.push(("gguf", ModelSource::Gguf(files.gguf.clone())));
    }
    let p = prompt(23, spec.seed as u32);
    let next = 77;
    for (format, source) in sources {
        let m = load(source);
        assert_eq!(m.config().arch == Arch::Qwen3, spec.arch == Arch::Qwen3);
        let mut reference = Stock::load(spec.arch, &files.hf_dir, spec.sliding_window);
        let want_last = reference.forward(&p, 0);
        let (last, step) = ours(&m, &p, next);
        let d = max_diff(&last, &want_last);
        eprintln!("{name} ({format}): prompt logits max |diff| {d:e}");
        assert!(d < TOL, "{name} ({format}): prompt logits differ by {d:e}");
        // Stock mistral ignores the window when decoding one token at a time.
        if spec.sliding_window.is_none() || spec.arch != Arch::Mistral {
            let want_step = reference.forward(&[next], p.len());
            let d = max_diff(&step, &want_step);
            eprintln!("{name} ({format}): decode-step logits max |diff| {d:e}");
            assert!(
                d < TOL,
                "{name} ({format}): decode-step logits differ by {d:e}"
            );
        }
        kv_round_trip_and_reposition(&m, &p[..11]);
    }
}

#[test]
fn llama3_matches_the_stock_llama_with_llama3_rope_scaling() {
    let spec = SyntheticSpec {
        llama3_scaling: true,
        ..SyntheticSpec::new(Arch::Llama)
    };
    check(spec, true);
}

#[test]
fn llama_without_scaling_matches_the_stock_llama() {
    check(SyntheticSpec::new(Arch::Llama), true);
}

#[test]
fn qwen3_matches_the_stock_qwen3() {
    check(SyntheticSpec::new(Arch::Qwen3), true);
}

#[test]
fn qwen2_matches_the_stock_qwen2() {
    check(SyntheticSpec::new(Arch::Qwen2), true);
}

#[test]
fn mistral_matches_the_stock_mistral() {
    check(SyntheticSpec::new(Arch::Mistral), true);
}

#[test]
fn mistral_sliding_window_matches_the_stock_mistral() {
    // GGUF files carry no window (llama.cpp attends to everything): HF directory only.
    let spec = SyntheticSpec {
        sliding_window: Some(6),
        ..SyntheticSpec::new(Arch::Mistral)
    };
    check(spec.clone(), false);
    // The window is part of the namespace fingerprint; without one it is as it always was.
    let dir = tempfile::tempdir().unwrap();
    let files = synthetic::write(&spec, dir.path()).unwrap();
    let m = load(ModelSource::HfDir(files.hf_dir));
    assert!(m.config().positions_fingerprint().ends_with("window=6"));
    let plain = load(ModelSource::Gguf(files.gguf));
    assert!(!plain.config().positions_fingerprint().contains("window"));
}

#[test]
fn position_schemes_are_part_of_the_fingerprint() {
    let dir = tempfile::tempdir().unwrap();
    let a = synthetic::write(&SyntheticSpec::new(Arch::Llama), &dir.path().join("a")).unwrap();
    let spec = SyntheticSpec {
        llama3_scaling: true,
        ..SyntheticSpec::new(Arch::Llama)
    };
    let b = synthetic::write(&spec, &dir.path().join("b")).unwrap();
    let (a, b) = (
        load(ModelSource::HfDir(a.hf_dir)),
        load(ModelSource::HfDir(b.hf_dir)),
    );
    assert_ne!(
        a.config().positions_fingerprint(),
        b.config().positions_fingerprint()
    );
}

#[test]
fn gemma3_matches_the_stock_gemma3() {
    check(SyntheticSpec::new(Arch::Gemma3), true);
}

/// Gemma 3's first layer (of two) attends to a window of 8, shorter than the prompt; its
/// second to everything, with another RoPE base. GGUF files carry the window.
#[test]
fn gemma3_windowed_and_global_layers_match_the_stock_gemma3() {
    let spec = SyntheticSpec {
        sliding_window: Some(8),
        ..SyntheticSpec::new(Arch::Gemma3)
    };
    check(spec.clone(), true);
    let dir = tempfile::tempdir().unwrap();
    let files = synthetic::write(&spec, dir.path()).unwrap();
    for source in [
        ModelSource::HfDir(files.hf_dir),
        ModelSource::Gguf(files.gguf),
    ] {
        let m = load(source);
        let c = m.config();
        assert_eq!((c.window_of(0), c.window_of(1)), (Some(8), None));
        assert!(c.local_rope(0) && !c.local_rope(1));
        assert!(c
            .positions_fingerprint()
            .ends_with("window=8 global_every=2 local_theta=10000"));
    }
}
