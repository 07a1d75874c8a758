//! Every K-quant type end to end: a small random model whose matrices fit 256-value
//! super-blocks, written in each type, loaded with its matrices kept quantized (repacked into
//! tiles where the CPU has AVX2) and dequantized to f32 (the reference): a prompt's logits
//! (prefill, the tiles' GEMM) and a decoding step's (one activation row) agree within what
//! rounding the activations to 8 bits costs. The kernels themselves are held to the
//! dequantized weights by `model/src/quant/kpacked.rs`'s unit and property tests; this holds
//! the loading around them (which matrices are tiled, their shapes, the model's numerics).

mod common;

use candle_core::quantized::GgmlDType;
use common::max_diff;
use model::{Arch, LoadOptions, Logits, Model, ModelSource, Shape};

const SHAPE: Shape = Shape {
    name: "k-quant-tiles",
    arch: Arch::Qwen2,
    hidden: 256,
    layers: 2,
    heads: 4,
    kv_heads: 2,
    head_dim: 64,
    intermediate: 512,
    vocab: 1024,
    rope_theta: 1_000_000.0,
    context: 4096,
};

#[test]
fn every_k_quant_type_computes_as_its_dequantized_weights() {
    let dir = tempfile::tempdir().unwrap();
    for dtype in [
        GgmlDType::Q2K,
        GgmlDType::Q3K,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
    ] {
        let path = dir.path().join(format!("{dtype:?}.gguf"));
        model::write_shaped(&SHAPE, dtype, &path, 5).unwrap();
        let source = ModelSource::Gguf(path.clone());
        let load = |quantized| {
            let opts = LoadOptions {
                quantized,
                ..LoadOptions::default()
            };
            Model::load(&source, &opts).unwrap()
        };
        let (q, d) = (load(true), load(false));
        let file = std::fs::metadata(&path).unwrap().len() as usize;
        assert!(
            q.weights_bytes() <= file * 11 / 10,
            "{dtype:?}: {} bytes of weights for a {file}-byte file",
            q.weights_bytes()
        );
        // 20 prompt tokens: a GEMM of the tiles; then one step.
        let prompt: Vec<u32> = (0..20u32).map(|i| (i * 29 + 3) % 1000).collect();
        let run = |m: &Model| {
            let mut cache = m.decoder().new_cache(prompt.len() + 1).unwrap();
            let dec = m.decoder();
            let p = dec.forward(&mut cache, &prompt, Logits::Last).unwrap();
            let s = dec.forward(&mut cache, &[77], Logits::Last).unwrap();
            (p, s)
        };
        let ((qp, qs), (dp, ds)) = (run(&q), run(&d));
        let scale = |t: &candle_core::Tensor| {
            t.abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        };
        let (ep, es) = (
            max_diff(&qp, &dp) / scale(&dp),
            max_diff(&qs, &ds) / scale(&ds),
        );
        eprintln!("{dtype:?}: prompt {ep:e}, step {es:e} of the largest logit");
        assert!(
            ep < 0.05 && es < 0.05,
            "{dtype:?}: logits off by {ep:e} (prompt) and {es:e} (step) of the largest"
        );
    }
}
