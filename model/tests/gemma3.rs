//! Gemma 3 270M Q4_K_M, a real Gemma 3 GGUF (`RAGKV_MODELS=large scripts/setup.sh`; skipped
//! when absent): its SentencePiece vocabulary tokenizes as llama.cpp's does, its chat
//! template comes from the family when the file has none, and greedy decoding continues a
//! prompt as llama.cpp does on the same file. The ids below are llama-server's
//! (`/tokenize`, `/completion` at temperature 0; llama.cpp from the llama-cpp-python 0.3.36
//! sdist, `scripts/llama-server.sh`).

use model::{Decoder, LoadOptions, Logits, Model, ModelSource};

const FILE: &str = "gemma-3-270m-q4_k_m.gguf";

fn load() -> Option<Model> {
    let path = model::models_dir().join(FILE);
    if !path.exists() {
        eprintln!(
            "skipped: {} not fetched (RAGKV_MODELS=large scripts/setup.sh)",
            path.display()
        );
        return None;
    }
    let opts = LoadOptions {
        quantized: true,
        ..LoadOptions::default()
    };
    Some(Model::load(&ModelSource::Gguf(path), &opts).unwrap())
}

#[test]
fn tokenizes_as_llama_cpp() {
    let Some(m) = load() else { return };
    let t = m.tokenizer();
    for (text, want) in [
        (
            "The capital of France is a city on the Seine",
            &[818, 5279, 529, 7001, 563, 496, 3207, 580, 506, 69598][..],
        ),
        (
            "Hello world!  Multiple   spaces\n\nnewlines\ttabs",
            &[
                9259, 1902, 236888, 138, 48873, 139, 35220, 108, 208697, 255968, 39218,
            ],
        ),
        (
            "naïve café — 東京 123456 émoji 🙂 ",
            &[
                1789, 238527, 560, 33443, 2192, 86459, 236743, 236770, 236778, 236800, 236812,
                236810, 236825, 1559, 58197, 57235, 236743,
            ],
        ),
        (
            "def f(x):\n    return x**2  # comment",
            &[
                2063, 517, 236769, 236781, 1473, 107, 140, 2060, 1123, 1018, 236778, 138, 236865,
                5739,
            ],
        ),
    ] {
        let ids = t.encode(text).unwrap();
        assert_eq!(ids, want, "{text:?}");
        assert_eq!(t.decode(&ids).unwrap(), text);
    }
    // A special token's spelling in outside text stays text.
    let ids = t.encode("<start_of_turn>").unwrap();
    assert!(ids.len() > 1, "{ids:?}");
    assert_eq!(t.bos, Some(2));
    assert!(t.add_bos);
    let eot = t.token_to_id("<end_of_turn>").unwrap();
    assert!(t.eos.contains(&eot) && t.eos.contains(&1), "{:?}", t.eos);
}

#[test]
fn renders_the_gemma_template() {
    let Some(m) = load() else { return };
    let msgs = [
        model::Message::new("system", "Be brief."),
        model::Message::new("user", "Hi"),
    ];
    let ids = m.chat_tokens(&msgs).unwrap();
    let text = m.tokenizer().inner().decode(&ids, false).unwrap();
    assert_eq!(ids[0], 2, "one BOS");
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 1);
    assert!(
        text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n",
        "{text:?}"
    );
}

#[test]
fn greedy_decoding_continues_as_llama_cpp() {
    let Some(m) = load() else { return };
    let prompt = m
        .prompt_tokens(&[model::Piece::Text("The capital of France is".into())])
        .unwrap();
    assert_eq!(prompt, [2, 818, 5279, 529, 7001, 563]);
    // llama-server's 24 greedy tokens after the prompt.
    let want = [
        506, 5279, 529, 506, 2891, 529, 7001, 236761, 1030, 563, 506, 7488, 3207, 528, 7001,
        236761, 1030, 563, 506, 5279, 529, 506, 2891, 529,
    ];
    let mut cache = m.decoder().new_cache(prompt.len() + want.len()).unwrap();
    let mut logits = m
        .decoder()
        .forward(&mut cache, &prompt, Logits::Last)
        .unwrap();
    let mut got = Vec::new();
    for _ in 0..want.len() {
        let next = Decoder::argmax(&logits).unwrap();
        got.push(next);
        logits = m
            .decoder()
            .forward(&mut cache, &[next], Logits::Last)
            .unwrap();
    }
    assert_eq!(got, want, "{:?}", m.tokenizer().decode(&got));
}
