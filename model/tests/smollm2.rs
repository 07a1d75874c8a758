//! Acceptance tests of the model runtime with SmolLM2-135M-Instruct (GGUF Q4_1, dequantized
//! to f32). The model is fetched by `scripts/setup.sh` into `~/.cache/ragkv/models`
//! (`RAGKV_CACHE` moves it; `RAGKV_TEST_MODEL` names another file).

use std::path::PathBuf;
use std::sync::OnceLock;

use model::{
    GenerateParams, Kv, KvCache, LoadOptions, Logits, Message, Model, ModelSource, Tensor,
};

fn model_path() -> PathBuf {
    if let Ok(p) = std::env::var("RAGKV_TEST_MODEL") {
        return PathBuf::from(p);
    }
    let cache = std::env::var("RAGKV_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").expect("HOME")).join(".cache/ragkv")
        });
    cache.join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

fn smollm() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| {
        let path = model_path();
        assert!(
            path.exists(),
            "test model missing at {}: run scripts/setup.sh (or set RAGKV_TEST_MODEL)",
            path.display()
        );
        Model::load(&ModelSource::Gguf(path), &LoadOptions::default()).expect("load SmolLM2")
    })
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

const CHUNK: &str = "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. \
It is named after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889. \
It was the centrepiece of the 1889 World's Fair and is 330 metres tall.";

#[test]
fn prefill_then_forward_equals_full_forward() {
    let m = smollm();
    let toks = m.tokenizer().encode(CHUNK).unwrap();
    assert!(toks.len() > 40);
    let mut full = m.decoder().new_cache(toks.len()).unwrap();
    let all = m.decoder().forward(&mut full, &toks, Logits::All).unwrap();
    let split = toks.len() / 2;
    let (kv, _) = m.decoder().prefill(&toks[..split], 0).unwrap();
    let mut cache = KvCache::from_kv(&kv, toks.len()).unwrap();
    let rest = m
        .decoder()
        .forward(&mut cache, &toks[split..], Logits::All)
        .unwrap();
    let d = max_abs_diff(&all.narrow(0, split, toks.len() - split).unwrap(), &rest);
    eprintln!("max |logit diff| = {d:e}");
    assert!(d <= 1e-4, "max abs logit difference {d}");
}

#[test]
fn stored_kv_round_trips_and_generates_the_same_tokens() {
    let m = smollm();
    let chunk = m.tokenizer().encode(CHUNK).unwrap();
    let (kv, _) = m.decoder().prefill(&chunk, 0).unwrap();
    let layout = m.kv_layout().unwrap();
    let bytes = kv.to_bytes(m.dtype()).unwrap();
    assert_eq!(bytes.len(), layout.bytes_for(chunk.len()));
    let back = Kv::from_bytes(&bytes, &layout, m.device()).unwrap();
    assert_eq!(
        back.to_bytes(m.dtype()).unwrap(),
        bytes,
        "bytes must round-trip exactly"
    );

    let question = m
        .tokenizer()
        .encode(" Question: who designed the tower? Answer:")
        .unwrap();
    let params = GenerateParams {
        max_tokens: 12,
        ..GenerateParams::default()
    };
    let run = |kv: &Kv| {
        let mut cache = KvCache::from_kv(kv, 64).unwrap();
        model::generate(
            m.decoder(),
            m.tokenizer(),
            &mut cache,
            &question,
            &params,
            |_| true,
        )
        .unwrap()
    };
    let computed = run(&kv);
    let imported = run(&back);
    let mut prompt = chunk.clone();
    prompt.extend(&question);
    let from_scratch = m.generate(&prompt, &params, |_| true).unwrap();
    eprintln!("stored-KV answer: {:?}", imported.text);
    assert_eq!(imported.tokens, computed.tokens);
    assert_eq!(imported.tokens, from_scratch.tokens);
    assert!(!imported.tokens.is_empty());
}

#[test]
fn reposition_matches_prefill_at_the_shifted_position() {
    let m = smollm();
    let chunk = m.tokenizer().encode(CHUNK).unwrap();
    let (at0, _) = m.decoder().prefill(&chunk, 0).unwrap();
    for delta in [7usize, 333, 1500] {
        let moved = m.decoder().reposition(&at0, delta as i64).unwrap();
        let (direct, _) = m.decoder().prefill(&chunk, delta).unwrap();
        let mut kmax = 0f32;
        let mut vmax = 0f32;
        for ((mk, mv), (dk, dv)) in moved.layers.iter().zip(&direct.layers) {
            kmax = kmax.max(max_abs_diff(mk, dk));
            vmax = vmax.max(max_abs_diff(mv, dv));
        }
        // Values are carried over untouched by the shift.
        for ((_, mv), (_, v0)) in moved.layers.iter().zip(&at0.layers) {
            assert_eq!(max_abs_diff(mv, v0), 0.0);
        }
        eprintln!(
            "delta {delta}: max |key diff| {kmax:e}, max |value diff| vs direct prefill {vmax:e}"
        );
        assert!(kmax <= 1e-4, "delta {delta}: key difference {kmax}");
        assert!(vmax <= 1e-4, "delta {delta}: value difference {vmax}");
    }
    // Shifting back undoes a shift.
    let there = m.decoder().reposition(&at0, 100).unwrap();
    let back = m.decoder().reposition(&there, -100).unwrap();
    for ((a, _), (b, _)) in back.layers.iter().zip(&at0.layers) {
        assert!(max_abs_diff(a, b) <= 1e-5);
    }
}

#[test]
fn the_capital_of_france_is_paris() {
    let m = smollm();
    let prompt = m
        .chat_tokens(&[Message::new("user", "What is the capital of France?")])
        .unwrap();
    let out = m
        .generate(
            &prompt,
            &GenerateParams {
                max_tokens: 24,
                ..GenerateParams::default()
            },
            |_| true,
        )
        .unwrap();
    eprintln!("answer: {:?}", out.text);
    assert!(out.text.contains("Paris"), "answer was {:?}", out.text);
}

#[test]
fn safetensors_export_loads_and_computes_the_same_logits() {
    let m = smollm();
    let dir = tempfile::tempdir().unwrap();
    m.export_hf(dir.path()).unwrap();
    let hf = Model::load(
        &ModelSource::from_path(dir.path()).unwrap(),
        &LoadOptions::default(),
    )
    .unwrap();
    assert_eq!(hf.config().rope_style, model::RopeStyle::Half);
    let toks = m.tokenizer().encode(CHUNK).unwrap();
    assert_eq!(
        hf.tokenizer().encode(CHUNK).unwrap(),
        toks,
        "tokenizer.json must tokenize alike"
    );
    let (_, a) = m.decoder().prefill(&toks, 0).unwrap();
    let (_, b) = hf.decoder().prefill(&toks, 0).unwrap();
    let d = max_abs_diff(&a, &b);
    eprintln!("gguf vs safetensors: max |logit diff| {d:e}");
    assert!(d <= 1e-4, "{d}");
    let fa = m.fingerprint("c", "t").unwrap().namespace();
    let fb = hf.fingerprint("c", "t").unwrap().namespace();
    assert_ne!(
        fa, fb,
        "different weight files and rope layouts are different namespaces"
    );
}

#[test]
fn bad_inputs_are_clear_errors() {
    let m = smollm();
    assert!(m.decoder().prefill(&[], 0).is_err());
    let err = m.decoder().prefill(&[u32::MAX], 0).unwrap_err();
    assert!(err.to_string().contains("vocabulary"), "{err}");
    let bad = GenerateParams {
        top_p: 0.0,
        ..GenerateParams::default()
    };
    assert!(m.generate(&[1, 2], &bad, |_| true).is_err());
    assert!(Model::load(
        &ModelSource::Gguf("/nonexistent.gguf".into()),
        &LoadOptions::default()
    )
    .is_err());
}

#[test]
fn kv_round_trips_in_every_storable_dtype_and_concatenates_in_order() {
    let m = smollm();
    let toks = m.tokenizer().encode(CHUNK).unwrap();
    let (kv, _) = m.decoder().prefill(&toks, 0).unwrap();
    for dtype in [model::DType::F32, model::DType::F16, model::DType::BF16] {
        let layout = kv.layout(dtype).unwrap();
        let bytes = kv.to_bytes(dtype).unwrap();
        assert_eq!(bytes.len(), layout.bytes_for(toks.len()));
        let back = Kv::from_bytes(&bytes, &layout, m.device()).unwrap();
        assert_eq!(back.to_bytes(dtype).unwrap(), bytes, "{dtype:?}");
        // Importing into the compute dtype is a separate step.
        let f32 = back.to(m.device(), m.dtype()).unwrap();
        let err = max_abs_diff(&f32.layers[3].0, &kv.layers[3].0);
        assert!(
            err < if dtype == model::DType::F32 {
                1e-9
            } else {
                0.1
            },
            "{dtype:?}: {err}"
        );
    }
    // concat(a, b) holds a's tokens, then b's, layer by layer.
    let a = kv.prefix(10).unwrap();
    let joined = Kv::concat(&[a.clone(), kv.clone()]).unwrap();
    assert_eq!(joined.len(), 10 + kv.len());
    for ((jk, jv), ((ak, _), (k, v))) in joined.layers.iter().zip(a.layers.iter().zip(&kv.layers)) {
        assert_eq!(max_abs_diff(&jk.narrow(2, 0, 10).unwrap(), ak), 0.0);
        assert_eq!(max_abs_diff(&jk.narrow(2, 10, kv.len()).unwrap(), k), 0.0);
        assert_eq!(max_abs_diff(&jv.narrow(2, 10, kv.len()).unwrap(), v), 0.0);
    }
}

#[test]
fn sampling_options_behave() {
    let m = smollm();
    let prompt = m
        .chat_tokens(&[Message::new("user", "Write one sentence about the sea.")])
        .unwrap();
    let run = |p: GenerateParams| m.generate(&prompt, &p, |_| true).unwrap();
    let greedy = run(GenerateParams {
        max_tokens: 8,
        ..GenerateParams::default()
    });
    // top-k 1 and a tiny top-p leave only the most likely token: greedy, whatever the temperature.
    for p in [
        GenerateParams {
            max_tokens: 8,
            temperature: 1.0,
            top_k: 1,
            ..GenerateParams::default()
        },
        GenerateParams {
            max_tokens: 8,
            temperature: 1.0,
            top_p: 1e-6,
            ..GenerateParams::default()
        },
    ] {
        assert_eq!(run(p).tokens, greedy.tokens);
    }
    // Sampling is reproducible for a seed and varies across seeds.
    let hot = |seed| GenerateParams {
        max_tokens: 12,
        temperature: 1.5,
        seed,
        ..GenerateParams::default()
    };
    assert_eq!(run(hot(7)).tokens, run(hot(7)).tokens);
    let distinct: std::collections::HashSet<Vec<u32>> =
        (0..4).map(|s| run(hot(s)).tokens).collect();
    assert!(distinct.len() > 1, "four seeds gave the same sample");
    // Stop strings cut the text; max_tokens bounds it.
    let first_word = greedy.text.split_whitespace().next().unwrap().to_string();
    let stopped = run(GenerateParams {
        max_tokens: 8,
        stop_strings: vec![first_word.clone()],
        ..GenerateParams::default()
    });
    assert!(
        !stopped.text.contains(&first_word),
        "{:?} still holds {first_word:?}",
        stopped.text
    );
    assert_eq!(stopped.finish, model::FinishReason::Stop);
    assert_eq!(greedy.tokens.len(), 8);
    assert_eq!(greedy.finish, model::FinishReason::Length);
}

#[test]
fn ignore_eos_runs_to_max_tokens() {
    let m = smollm();
    let prompt = m
        .chat_tokens(&[Message::new(
            "user",
            "Answer with one word: what colour is snow?",
        )])
        .unwrap();
    let params = GenerateParams {
        max_tokens: 24,
        ..GenerateParams::default()
    };
    let stopped = m.generate(&prompt, &params, |_| true).unwrap();
    assert_eq!(stopped.finish, model::FinishReason::Stop, "{stopped:?}");
    assert!(stopped.tokens.len() < 24);
    let long = m
        .generate(
            &prompt,
            &GenerateParams {
                ignore_eos: true,
                ..params
            },
            |_| true,
        )
        .unwrap();
    // The same answer, then (the end-of-turn token banned) on to the limit.
    assert_eq!(long.finish, model::FinishReason::Length);
    assert_eq!(long.tokens.len(), 24);
    assert_eq!(long.tokens[..stopped.tokens.len()], stopped.tokens[..]);
}

/// Mean |a - b| over every layer's keys and values.
fn kv_mean_abs_diff(a: &Kv, b: &Kv) -> f32 {
    let mut sum = 0f32;
    let mut n = 0usize;
    for ((ak, av), (bk, bv)) in a.layers.iter().zip(&b.layers) {
        for (x, y) in [(ak, bk), (av, bv)] {
            let d = (x - y).unwrap().abs().unwrap().flatten_all().unwrap();
            n += d.dim(0).unwrap();
            sum += d.sum_all().unwrap().to_scalar::<f32>().unwrap();
        }
    }
    sum / n as f32
}

#[test]
fn blend_recomputes_toward_full_prefill() {
    let m = smollm();
    let t = m.tokenizer();
    let prefix = t
        .encode_markup("<|im_start|>system\nBe brief.<|im_end|>\n")
        .unwrap();
    let a = t.encode(CHUNK).unwrap();
    let b = t
        .encode(" The keeper's log was moved to the county museum after the storm.")
        .unwrap();
    let all: Vec<u32> = [&prefix[..], &a, &b].concat();
    let (full, _) = m.decoder().prefill(&all, 0).unwrap();
    let (p, _) = m.decoder().prefill(&prefix, 0).unwrap();
    let ka = m
        .decoder()
        .reposition(&m.decoder().prefill(&a, 0).unwrap().0, prefix.len() as i64)
        .unwrap();
    let kb = m
        .decoder()
        .reposition(
            &m.decoder().prefill(&b, 0).unwrap().0,
            (prefix.len() + a.len()) as i64,
        )
        .unwrap();
    let assembled = Kv::concat(&[p, ka, kb]).unwrap();
    let before = kv_mean_abs_diff(&assembled, &full);

    // Nothing to recompute: unchanged.
    let r = m
        .decoder()
        .blend(&assembled, &all, prefix.len(), 0.0, &[])
        .unwrap();
    assert!(r.positions.is_empty() && r.logits.is_none());
    assert_eq!(kv_mean_abs_diff(&r.kv, &assembled), 0.0);

    // Everything recomputed: full prefill.
    let r = m
        .decoder()
        .blend(&assembled, &all, prefix.len(), 1.0, &[])
        .unwrap();
    assert_eq!(r.positions, (prefix.len()..all.len()).collect::<Vec<_>>());
    let d = kv_mean_abs_diff(&r.kv, &full);
    eprintln!("assembled vs full: {before:e}; blend(1.0) vs full: {d:e}");
    assert!(d <= 1e-5, "blend(1.0) differs from full prefill by {d}");

    // A quarter: the chosen tokens, and closer to full prefill than plain assembly.
    let part = m
        .decoder()
        .blend(&assembled, &all, prefix.len(), 0.25, &[])
        .unwrap();
    let some = &part.positions;
    let want = ((all.len() - prefix.len()) as f64 * 0.25).ceil() as usize;
    assert_eq!(some.len(), want);
    assert!(some.windows(2).all(|w| w[0] < w[1]) && some[0] >= prefix.len());
    let d = kv_mean_abs_diff(&part.kv, &full);
    eprintln!("blend(0.25) vs full: {d:e}");
    assert!(d < before * 0.9, "blend(0.25) {d} vs assembled {before}");

    // The question in the same pass: what prefilling it after the repaired context gives
    // (its KV rows appended, the same next-token logits), for the same recomputed tokens.
    let question = m.tokenizer().encode(" Which colour was the ball?").unwrap();
    let one = m
        .decoder()
        .blend(&assembled, &all, prefix.len(), 0.25, &question)
        .unwrap();
    assert_eq!(&one.positions, some);
    assert_eq!(one.kv.len(), all.len() + question.len());
    let mut cache = KvCache::from_kv(&part.kv, question.len()).unwrap();
    let two = m
        .decoder()
        .forward(&mut cache, &question, Logits::Last)
        .unwrap();
    let d = max_abs_diff(one.logits.as_ref().unwrap(), &two);
    let dkv = kv_mean_abs_diff(&one.kv, &cache.to_kv().unwrap());
    eprintln!("one pass vs two: logits {d:e}, kv {dkv:e}");
    assert!(d < 1e-4 && dkv < 1e-6, "one pass {d} {dkv}");
    // Nothing to recompute: the question alone, as a plain prefill after the context.
    let q = m
        .decoder()
        .recompute(&assembled, &all, &[], &question)
        .unwrap();
    assert!(q.positions.is_empty() && q.kv.len() == all.len() + question.len());

    // Bad input.
    assert!(m
        .decoder()
        .blend(&assembled, &all[1..], prefix.len(), 0.5, &[])
        .is_err());
    assert!(m
        .decoder()
        .blend(&assembled, &all, prefix.len(), 1.5, &[])
        .is_err());
    assert!(m
        .decoder()
        .recompute(&assembled, &all, &[3, 2], &[])
        .is_err());
    assert!(m
        .decoder()
        .recompute(&assembled, &all, &[all.len()], &[])
        .is_err());
}
