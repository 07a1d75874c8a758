//! The Qwen2 path (attention biases, untied output, half-split RoPE) with
//! Qwen2.5-Coder-0.5B-Instruct. Not in CI, which fetches only SmolLM2: run with
//! `RAGKV_MODELS=bench scripts/setup.sh && cargo test --workspace --test qwen2 -- --ignored`
//! (`scripts/test.sh` runs it whenever the model has been fetched).

mod common;

use common::max_diff;
use model::{GenerateParams, Kv, KvCache, LoadOptions, Logits, Message, Model, ModelSource};

fn qwen() -> Model {
    let path = model::models_dir().join(model::QWEN_CODER_FILE);
    assert!(
        path.exists(),
        "model missing at {}: run RAGKV_MODELS=bench scripts/setup.sh",
        path.display()
    );
    Model::load(&ModelSource::Gguf(path), &LoadOptions::default()).unwrap()
}

#[test]
#[ignore = "needs the benchmark model (Qwen2.5-Coder-0.5B); see the module docs"]
fn qwen2_answers_and_reuses_stored_kv_exactly() {
    let m = qwen();
    let c = m.config();
    assert_eq!(
        (c.arch, c.layers, c.kv_heads, c.head_dim),
        (model::Arch::Qwen2, 24, 2, 64)
    );
    assert!(c.attn_bias && !c.tie_embeddings);

    let prompt = m
        .chat_tokens(&[Message::new("user", "What is the capital of France?")])
        .unwrap();
    let params = GenerateParams {
        max_tokens: 16,
        ..GenerateParams::default()
    };
    let out = m.generate(&prompt, &params, |_| true).unwrap();
    eprintln!("qwen answer: {:?}", out.text);
    assert!(out.text.contains("Paris"), "{:?}", out.text);

    // Prefill + forward equals one forward; stored KV bytes resume decoding identically.
    let (kv, _) = m.decoder().prefill(&prompt[..20], 0).unwrap();
    let mut full = m.decoder().new_cache(prompt.len()).unwrap();
    let all = m
        .decoder()
        .forward(&mut full, &prompt, Logits::All)
        .unwrap();
    let mut cache = KvCache::from_kv(&kv, 64).unwrap();
    let rest = m
        .decoder()
        .forward(&mut cache, &prompt[20..], Logits::All)
        .unwrap();
    let d = max_diff(&all.narrow(0, 20, prompt.len() - 20).unwrap(), &rest);
    eprintln!("qwen max |logit diff| {d:e}");
    assert!(d <= 1e-3, "{d}");
    let bytes = kv.to_bytes(m.dtype()).unwrap();
    let back = Kv::from_bytes(&bytes, &m.kv_layout().unwrap(), m.device()).unwrap();
    let gen = |kv: &Kv| {
        let mut cache = KvCache::from_kv(kv, 64).unwrap();
        model::generate(
            m.decoder(),
            m.tokenizer(),
            &mut cache,
            &prompt[20..],
            &params,
            |_| true,
        )
        .unwrap()
    };
    assert_eq!(gen(&kv).tokens, gen(&back).tokens);
}
