//! The GGUF-built tokenizer reproduces reference token ids produced by an independent
//! implementation (transformers' GGUF converter + the tokenizers library; see
//! `reference/make_tokenizer_refs.py` and the provenance inside each reference file).

use model::{LoadOptions, Model, ModelSource};

#[derive(serde::Deserialize)]
struct Refs {
    provenance: serde_json::Value,
    cases: Vec<Case>,
}

#[derive(serde::Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
}

fn check(file: &str, refs_json: &str) {
    let path = model::models_dir().join(file);
    assert!(
        path.exists(),
        "model missing at {}: run scripts/setup.sh",
        path.display()
    );
    let m = Model::load(&ModelSource::Gguf(path), &LoadOptions::default()).unwrap();
    let refs: Refs = serde_json::from_str(refs_json).unwrap();
    assert!(refs.cases.len() >= 10, "reference set too small");
    eprintln!("references: {}", refs.provenance);
    let mut failures = Vec::new();
    for c in &refs.cases {
        // The references recognize special tokens, as template markup does.
        let ids = m.tokenizer().encode_markup(&c.text).unwrap();
        // Outside text never does: it gets the same ids unless it spells a special token,
        // and then none of its ids is a control token.
        let plain = m.tokenizer().encode(&c.text).unwrap();
        if c.ids.iter().any(|i| m.tokenizer().is_special(*i)) {
            assert!(
                !plain.iter().any(|i| m.tokenizer().is_special(*i)),
                "{:?} became control tokens: {plain:?}",
                c.text
            );
        } else {
            assert_eq!(plain, c.ids, "{:?}", c.text);
        }
        if ids != c.ids {
            failures.push(format!(
                "{:?}\n  ours: {ids:?}\n  ref:  {:?}",
                c.text, c.ids
            ));
        }
        // Decoding gives the text back (special tokens are skipped, so only for plain text).
        if !c.text.contains("<|") {
            assert_eq!(m.tokenizer().decode(&ids).unwrap(), c.text);
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} differ:\n{}",
        failures.len(),
        refs.cases.len(),
        failures.join("\n")
    );
}

#[test]
fn smollm2_gguf_tokenizer_matches_reference_ids() {
    check(
        model::SMOLLM2_FILE,
        include_str!("reference/smollm2_tokens.json"),
    );
}

#[test]
#[ignore = "needs the benchmark model: RAGKV_MODELS=bench scripts/setup.sh, then cargo test -- --ignored"]
fn qwen2_gguf_tokenizer_matches_reference_ids() {
    check(
        model::QWEN_CODER_FILE,
        include_str!("reference/qwen2_5_coder_tokens.json"),
    );
}
