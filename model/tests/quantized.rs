//! The quantized-weights path (`LoadOptions::quantized`) on SmolLM2-135M-Instruct (GGUF Q4_1,
//! Q8_0 embeddings) and, when `RAGKV_MODELS=bench scripts/setup.sh` fetched it,
//! Qwen2.5-Coder-0.5B Q4_K_M (its down projections are Q4_K and Q6_K): the weights take about
//! the file's size, and the greedy next token agrees with the dequantized reference's over a
//! prompt's prefixes. (The kernels themselves are held to the dequantized weights by
//! `model/src/quant.rs`'s and `model/src/quant/kquant.rs`'s unit and property tests.)

use std::path::PathBuf;

use model::{Decoder, LoadOptions, Logits, Model, ModelSource};

fn model_path() -> PathBuf {
    if let Ok(p) = std::env::var("RAGKV_TEST_MODEL") {
        return PathBuf::from(p);
    }
    model::models_dir().join(model::SMOLLM2_FILE)
}

#[test]
fn quantized_weights_stay_small_and_agree_with_the_reference() {
    let path = model_path();
    assert!(path.exists(), "run scripts/setup.sh: {}", path.display());
    agrees_with_the_reference(path);
}

#[test]
fn k_quant_weights_agree_with_the_reference() {
    let path = model::models_dir().join("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    if !path.exists() {
        eprintln!(
            "skipped: {} not fetched (RAGKV_MODELS=bench scripts/setup.sh)",
            path.display()
        );
        return;
    }
    agrees_with_the_reference(path);
}

fn agrees_with_the_reference(path: PathBuf) {
    let source = ModelSource::Gguf(path.clone());
    let quantized = LoadOptions {
        quantized: true,
        ..LoadOptions::default()
    };
    let q = Model::load(&source, &quantized).unwrap();
    let d = Model::load(&source, &LoadOptions::default()).unwrap();
    let file = std::fs::metadata(&path).unwrap().len() as usize;
    assert!(
        q.weights_bytes() <= file * 3 / 2,
        "quantized weights take {} bytes for a {file}-byte file",
        q.weights_bytes()
    );
    assert!(
        d.weights_bytes() > file * 3,
        "the dequantized reference should be several times the file"
    );
    // Different numerics, different KV namespaces.
    assert_ne!(q.weights_hash(), d.weights_hash());

    let prompt = q
        .tokenizer()
        .encode("The capital of France is a city on the Seine")
        .unwrap();
    let mut agree = 0;
    for n in 1..=prompt.len() {
        let next = |m: &Model| {
            let mut cache = m.decoder().new_cache(prompt.len()).unwrap();
            let logits = m
                .decoder()
                .forward(&mut cache, &prompt[..n], Logits::Last)
                .unwrap();
            Decoder::argmax(&logits).unwrap()
        };
        agree += usize::from(next(&q) == next(&d));
    }
    assert!(
        agree * 10 >= prompt.len() * 8,
        "greedy next tokens agree on {agree} of {} prefixes",
        prompt.len()
    );
}
