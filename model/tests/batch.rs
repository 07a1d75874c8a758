//! Continuous batching ([`Decoder::step`]): a sequence decoded in a batch, joining and leaving
//! while others run, gets the logits (within float tolerance) and the greedy tokens it gets
//! alone. Synthetic models of every family (Mistral with a sliding window shorter than the
//! prompts) and, when set up, SmolLM2-135M with quantized weights (the serving configuration
//! where the batch goes through the 8-bit kernels' four-row path), with f32 caches and f16
//! ones (`serve.cache_dtype`'s default).

mod common;

use std::path::PathBuf;

use candle_core::{DType, Tensor};
use common::max_diff;
use model::synthetic::{self, SyntheticSpec};
use model::{Arch, Decoder, KvCache, LoadOptions, Logits, Model, ModelSource, StepSeq};

/// An empty cache for `m` in `dtype`.
fn cache(m: &Model, capacity: usize, dtype: DType) -> KvCache {
    let c = m.config();
    KvCache::new(
        c.layers,
        c.kv_heads,
        c.head_dim,
        capacity,
        dtype,
        m.device(),
    )
    .unwrap()
}

/// Greedy decoding of `prompt` alone, over a cache in `dtype`: the logits of every step and
/// the tokens.
fn alone(m: &Model, prompt: &[u32], steps: usize, dtype: DType) -> (Vec<Tensor>, Vec<u32>) {
    let d = m.decoder();
    let mut cache = cache(m, prompt.len() + steps, dtype);
    let mut logits = d.forward(&mut cache, prompt, Logits::Last).unwrap();
    let (mut all, mut tokens) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        let next = Decoder::argmax(&logits).unwrap();
        all.push(logits);
        tokens.push(next);
        logits = d.forward(&mut cache, &[next], Logits::Last).unwrap();
    }
    (all, tokens)
}

/// Sequence `i` joins at step `join[i]` (its whole prompt in that step, beside the others'
/// decoding tokens) and leaves after `steps` tokens; every step runs the sequences present as
/// one batch. Each one's logits must match its solo run within `tol`, and its greedy tokens
/// must be the same. Every cache is in `dtype`.
fn check(m: &Model, prompts: &[Vec<u32>], join: &[usize], steps: usize, tol: f32, dtype: DType) {
    let solo: Vec<_> = prompts.iter().map(|p| alone(m, p, steps, dtype)).collect();
    let d = m.decoder();
    let mut caches: Vec<KvCache> = prompts
        .iter()
        .map(|p| cache(m, p.len() + steps, dtype))
        .collect();
    let mut fed: Vec<Vec<u32>> = prompts.to_vec();
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut worst = 0f32;
    let mut batch_sizes = Vec::new();
    for t in 0.. {
        let present: Vec<usize> = (0..prompts.len())
            .filter(|&i| join[i] <= t && got[i].len() < steps)
            .collect();
        if present.is_empty() && (0..prompts.len()).all(|i| got[i].len() == steps) {
            break;
        }
        if present.is_empty() {
            continue;
        }
        batch_sizes.push(present.len());
        let mut seqs: Vec<StepSeq<'_>> = Vec::new();
        for (i, c) in caches.iter_mut().enumerate() {
            if present.contains(&i) {
                seqs.push(StepSeq::new(c, fed[i].as_slice()));
            }
        }
        let logits = d.step(&mut seqs).unwrap();
        assert_eq!(logits.dim(0).unwrap(), present.len());
        for (row, &i) in present.iter().enumerate() {
            let l = logits.get(row).unwrap();
            let n = got[i].len();
            worst = worst.max(max_diff(&l, &solo[i].0[n]));
            let next = Decoder::argmax(&l).unwrap();
            got[i].push(next);
            fed[i] = vec![next];
        }
    }
    assert!(
        batch_sizes.contains(&prompts.len()),
        "the schedule never ran every sequence together: {batch_sizes:?}"
    );
    assert!(worst <= tol, "batched logits differ from solo by {worst}");
    for (i, (_, tokens)) in solo.iter().enumerate() {
        assert_eq!(
            &got[i], tokens,
            "sequence {i}: batched greedy tokens differ"
        );
    }
}

fn prompts(vocab: usize) -> Vec<Vec<u32>> {
    let v = vocab as u32;
    vec![
        (0..11).map(|i| (i * 7 + 3) % v).collect(),
        vec![5 % v],
        (0..23).map(|i| (i * 13 + 1) % v).collect(),
        (0..4).map(|i| (i * 3 + 2) % v).collect(),
    ]
}

#[test]
fn batched_steps_match_solo_decoding_in_every_family() {
    for (arch, window) in [
        (Arch::Llama, None),
        (Arch::Qwen2, None),
        (Arch::Qwen3, None),
        (Arch::Mistral, Some(8)),
        (Arch::Gemma3, Some(8)),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut spec = SyntheticSpec::new(arch);
        spec.sliding_window = window;
        let files = synthetic::write(&spec, dir.path()).unwrap();
        let source = if window.is_some() {
            ModelSource::HfDir(files.hf_dir)
        } else {
            ModelSource::Gguf(files.gguf)
        };
        let m = Model::load(&source, &LoadOptions::default()).unwrap();
        let p = prompts(m.config().vocab_size);
        // Together from the start, then staggered: later prompts prefill beside decoding.
        // An f16 cache rounds each row once: a last-bit difference of the batched products
        // can round a key to the neighbouring f16 value (~5e-4 relative), hence the wider
        // tolerance; the greedy tokens must still be equal.
        for (dtype, tol) in [(DType::F32, 1e-4), (DType::F16, 2e-3)] {
            check(&m, &p, &[0, 0, 0, 0], 12, tol, dtype);
            check(&m, &p, &[0, 2, 3, 7], 12, tol, dtype);
        }
    }
}

#[test]
fn batched_steps_match_solo_decoding_on_quantized_smollm2() {
    let path = std::env::var("RAGKV_TEST_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|_| model::models_dir().join(model::SMOLLM2_FILE));
    assert!(path.exists(), "run scripts/setup.sh: {}", path.display());
    let opts = LoadOptions {
        quantized: true,
        ..LoadOptions::default()
    };
    let m = Model::load(&ModelSource::Gguf(path), &opts).unwrap();
    let tok = m.tokenizer();
    let p: Vec<Vec<u32>> = [
        "The capital of France is",
        "Rust is a programming language that",
        "Once upon a time, in a small village by the sea, there lived",
        "1, 2, 3, 4,",
        "The quick brown fox",
    ]
    .iter()
    .map(|s| tok.encode(s).unwrap())
    .collect();
    for dtype in [DType::F32, DType::F16] {
        check(&m, &p, &[0, 0, 0, 0, 0], 16, 1e-3, dtype);
        check(&m, &p, &[0, 1, 1, 5, 9], 16, 1e-3, dtype);
    }
}

#[test]
fn prefill_many_matches_each_chunk_prefilled_alone() {
    let path = std::env::var("RAGKV_TEST_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|_| model::models_dir().join(model::SMOLLM2_FILE));
    assert!(path.exists(), "run scripts/setup.sh: {}", path.display());
    for quantized in [true, false] {
        let opts = LoadOptions {
            quantized,
            ..LoadOptions::default()
        };
        let m = Model::load(&ModelSource::Gguf(path.clone()), &opts).unwrap();
        let p = prompts(m.config().vocab_size);
        let chunks: Vec<&[u32]> = p.iter().map(|c| c.as_slice()).collect();
        let many = m.decoder().prefill_many(&chunks).unwrap();
        assert_eq!(many.len(), chunks.len());
        for (c, kv) in chunks.iter().zip(&many) {
            let (alone, _) = m.decoder().prefill(c, 0).unwrap();
            assert_eq!(kv.len(), c.len());
            for ((ak, av), (bk, bv)) in alone.layers.iter().zip(&kv.layers) {
                let d = max_diff(ak, bk).max(max_diff(av, bv));
                assert!(d < 1e-4, "quantized {quantized}: KV differs by {d}");
            }
        }
    }
}

/// A deferred repair ([`Decoder::step`] with `redo`): rows recomputed in place and a question
/// appended in a step beside another sequence's decoding token give the logits and the cache
/// that [`Decoder::recompute_in`] gives alone, and the other sequence's logits are its solo
/// ones.
#[test]
fn a_repair_in_a_batch_step_matches_the_repair_alone() {
    let dir = tempfile::tempdir().unwrap();
    let files = synthetic::write(&SyntheticSpec::new(Arch::Llama), dir.path()).unwrap();
    let m = Model::load(&ModelSource::Gguf(files.gguf), &LoadOptions::default()).unwrap();
    let d = m.decoder();
    let p = prompts(m.config().vocab_size);
    let (context, question, other) = (&p[2], &p[3], &p[0]);
    for dtype in [DType::F32, DType::F16] {
        let fresh = || {
            let mut c = cache(&m, context.len() + question.len(), dtype);
            d.forward(&mut c, context, Logits::Last).unwrap();
            c
        };
        let redo = [0usize, 5, 6, 17];
        let mut alone = fresh();
        let want = d
            .recompute_in(&mut alone, context, &redo, question)
            .unwrap()
            .unwrap();
        let mut batched = fresh();
        let mut beside = cache(&m, other.len() + 1, dtype);
        let solo = d.forward(&mut beside, other, Logits::Last).unwrap();
        let next = Decoder::argmax(&solo).unwrap();
        let mut solo_cache = cache(&m, other.len() + 1, dtype);
        d.forward(&mut solo_cache, other, Logits::Last).unwrap();
        let solo_next = d.forward(&mut solo_cache, &[next], Logits::Last).unwrap();
        let mut ids: Vec<u32> = redo.iter().map(|&i| context[i]).collect();
        ids.extend_from_slice(question);
        let logits = d
            .step(&mut [
                StepSeq::new(&mut beside, &[next]),
                StepSeq {
                    cache: &mut batched,
                    tokens: &ids,
                    redo: &redo,
                },
            ])
            .unwrap();
        assert!(max_diff(&logits.get(1).unwrap(), &want) < 1e-4, "{dtype:?}");
        assert!(
            max_diff(&logits.get(0).unwrap(), &solo_next) < 1e-4,
            "{dtype:?}"
        );
        assert_eq!(batched.len(), alone.len());
        for ((bk, bv), (ak, av)) in batched
            .to_kv()
            .unwrap()
            .layers
            .iter()
            .zip(&alone.to_kv().unwrap().layers)
        {
            let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let diff = max_diff(&f(bk), &f(ak)).max(max_diff(&f(bv), &f(av)));
            assert!(diff < 2e-3, "{dtype:?}: caches differ by {diff}");
        }
        // Rows to recompute must ascend within the cache.
        let mut bad = fresh();
        let err = d.step(&mut [StepSeq {
            cache: &mut bad,
            tokens: &ids,
            redo: &[6, 5, 0, 17],
        }]);
        assert!(err.is_err());
    }
}
