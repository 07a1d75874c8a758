//! Assembly strategies on the assembled cache: where each puts a chunk's rows, what each
//! repair recomputes, and that recomputing everything gives full prefill's logits
//! (SmolLM2-135M). The strategies answering through the serving pipeline: `planted.rs`.

mod common;

use common::max_abs_diff;

use model::{Kv, Tensor};
use serve::Assembly;
use serve::{assemble, Prompt, Repair};

const REPAIR: Repair = Repair {
    recompute_share: 0.15,
    link_tokens: 4,
};

/// The prompt of `chunks` after the prefix `pkv`, before `question`.
fn prompt<'a>(pkv: &'a Kv, chunks: Vec<Kv>, tokens: &'a [u32], question: &'a [u32]) -> Prompt<'a> {
    Prompt {
        prefix: pkv,
        chunks,
        tokens,
        question,
        ranked: Vec::new(),
        exact_chunks: 0,
    }
}

/// Largest key difference between `kv`'s rows `start..start + want.len()` and `want`.
fn key_diff(kv: &Kv, start: usize, want: &Kv) -> f32 {
    kv.layers
        .iter()
        .zip(&want.layers)
        .map(|((k, _), (w, _))| max_abs_diff(&k.narrow(2, start, want.len()).unwrap(), w))
        .fold(0.0, f32::max)
}

/// A system prefix and two chunks: the prefix's KV, and each chunk's computed alone at
/// `0..` (as ingest stores it); the chunks sit at `pa` and `pb` in the prompt.
struct TwoChunks {
    a: Vec<u32>,
    b: Vec<u32>,
    tokens: Vec<u32>,
    pkv: Kv,
    a0: Kv,
    b0: Kv,
    pa: usize,
    pb: usize,
}

impl TwoChunks {
    /// Both chunks' stored KV, placed by `asm` for the prompt.
    fn placed(&self, m: &model::Model, asm: Assembly) -> Vec<Kv> {
        vec![
            asm.place(m, self.a0.clone(), self.pa).unwrap(),
            asm.place(m, self.b0.clone(), self.pb).unwrap(),
        ]
    }
}

fn two_chunks(m: &model::Model) -> TwoChunks {
    let t = m.tokenizer();
    let prefix = t
        .encode_markup("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nContext:\n")
        .unwrap();
    let a = t
        .encode("The access code for the Orion vault is 4817. Only the archivist may open it.\n")
        .unwrap();
    let b = t
        .encode("Captain Ines Valbuena commands the research ship Calder Wren.\n")
        .unwrap();
    let (pkv, _) = m.decoder().prefill(&prefix, 0).unwrap();
    let tokens: Vec<u32> = [&prefix[..], &a, &b].concat();
    let (pa, pb) = (prefix.len(), prefix.len() + a.len());
    let (a0, b0) = (
        m.decoder().prefill(&a, 0).unwrap().0,
        m.decoder().prefill(&b, 0).unwrap().0,
    );
    TwoChunks {
        a,
        b,
        tokens,
        pkv,
        a0,
        b0,
        pa,
        pb,
    }
}

/// A loader's one-pass import (each layer's keys placed and converted as they are made,
/// `Kv::from_bytes_with`) gives exactly what importing, placing and converting the whole
/// chunk gives, for f16 and q8 decoding caches.
#[test]
fn one_pass_import_equals_import_then_place() {
    let m = common::model();
    let c = two_chunks(&m);
    let dev = m.device();
    let bytes = c.a0.to_bytes(model::DType::F16).unwrap();
    let layout = c.a0.layout(model::DType::F16).unwrap();
    for asm in [Assembly::Naive, Assembly::Reposition] {
        for dtype in [model::DType::F16, model::Q8_CACHE] {
            let whole = Kv::from_bytes(&bytes, &layout, dev).unwrap();
            let want = if dtype == model::Q8_CACHE {
                asm.place(&m, whole, c.pa).unwrap().to(dev, dtype).unwrap()
            } else {
                asm.place(&m, whole.to(dev, dtype).unwrap(), c.pa).unwrap()
            };
            let got = Kv::from_bytes_with(&bytes, &layout, dev, &mut |l, values, t| {
                if values {
                    return Kv::tensor_to(&t, dev, dtype);
                }
                if dtype == model::Q8_CACHE {
                    let k = asm.place_keys(&m, l, t, c.pa)?;
                    return Kv::tensor_to(&k, dev, dtype);
                }
                asm.place_keys(&m, l, Kv::tensor_to(&t, dev, dtype)?, c.pa)
            })
            .unwrap();
            assert_eq!(got.len(), want.len());
            for ((gk, gv), (wk, wv)) in got.layers.iter().zip(&want.layers) {
                assert_eq!((gk.dtype(), gk.dims()), (wk.dtype(), wk.dims()));
                assert_eq!(max_abs_diff(gk, wk), 0.0, "{asm} {dtype:?}: keys");
                assert_eq!(max_abs_diff(gv, wv), 0.0, "{asm} {dtype:?}: values");
            }
        }
    }
}

#[test]
fn naive_and_reposition_put_chunks_where_they_claim() {
    let m = common::model();
    let c = two_chunks(&m);
    let (tokens, pkv, pa, pb) = (&c.tokens, &c.pkv, c.pa, c.pb);
    // Each chunk computed alone at its prompt place.
    let (a_at, b_at) = (
        m.decoder().prefill(&c.a, pa).unwrap().0,
        m.decoder().prefill(&c.b, pb).unwrap().0,
    );

    for asm in [Assembly::Naive, Assembly::Reposition] {
        let chunks = c.placed(&m, asm);
        let r = assemble(&m, asm, &REPAIR, prompt(pkv, chunks, tokens, &[1])).unwrap();
        // No repair: the question is left to feed.
        assert!(r.logits.is_none());
        let (kv, recomputed) = (r.kv, r.positions.len());
        assert_eq!((kv.len(), recomputed), (tokens.len(), 0));
        assert_eq!(key_diff(&kv, 0, pkv), 0.0, "{asm}: the prefix moved");
        let (da0, db0) = (key_diff(&kv, pa, &c.a0), key_diff(&kv, pb, &c.b0));
        let (da, db) = (key_diff(&kv, pa, &a_at), key_diff(&kv, pb, &b_at));
        eprintln!("{asm}: keys vs at-0 {da0:e} {db0:e}, vs at-place {da:e} {db:e}");
        match asm {
            // As stored: positions 0..n, far from where they sit in the prompt.
            Assembly::Naive => {
                assert_eq!((da0, db0), (0.0, 0.0));
                assert!(da > 0.1 && db > 0.1);
            }
            // Rotated: what computing each chunk at its prompt position gives.
            _ => {
                assert!(da <= 1e-4 && db <= 1e-4);
                assert!(da0 > 0.1 && db0 > 0.1);
            }
        }
    }

    // With recompute, the recomputed rows move toward full prefill; the prefix stays exact.
    let half = Repair {
        recompute_share: 0.5,
        ..REPAIR
    };
    let asm = Assembly::Recompute(None);
    let chunks = c.placed(&m, asm);
    let r = assemble(&m, asm, &half, prompt(pkv, chunks, tokens, &[1])).unwrap();
    assert_eq!(r.positions.len(), (c.a.len() + c.b.len()).div_ceil(2));
    assert_eq!(key_diff(&r.kv, 0, pkv), 0.0);
    // The question ran in the repair's pass: its row appended, its logits returned.
    assert_eq!(r.kv.len(), tokens.len() + 1);
    assert!(r.logits.is_some());
}

/// The repairs that recompute every chunk token (`link` with k past the longest chunk,
/// `query-aware` (`prophet`), `window` and `reposition+recompute` at share 1) give full prefill's next-token
/// logits after the question; the partial ones recompute what they say, and land between
/// plain assembly and full prefill.
#[test]
fn whole_repairs_reproduce_full_prefill() {
    let m = common::model();
    let c = two_chunks(&m);
    let question = m
        .tokenizer()
        .encode_markup("Question: What is the access code?<|im_end|>\n<|im_start|>assistant\n")
        .unwrap();
    let next = |kv: &Kv| {
        let mut cache = model::KvCache::from_kv(kv, question.len() + 1).unwrap();
        m.decoder()
            .forward(&mut cache, &question, model::Logits::Last)
            .unwrap()
    };
    let (full_kv, _) = m.decoder().prefill(&c.tokens, 0).unwrap();
    let full = next(&full_kv);
    let run = |asm: Assembly| {
        let chunks = c.placed(&m, asm);
        let r = assemble(
            &m,
            asm,
            &REPAIR,
            prompt(&c.pkv, chunks, &c.tokens, &question),
        )
        .unwrap();
        // A repair runs the question in its own pass; plain assembly leaves it to feed.
        let logits = match &r.logits {
            Some(l) => {
                assert_eq!(r.kv.len(), c.tokens.len() + question.len(), "{asm}");
                l.clone()
            }
            None => next(&r.kv),
        };
        (max_abs_diff(&logits, &full), r.positions.len())
    };
    let (plain, none) = run(Assembly::Reposition);
    assert_eq!(none, 0);
    let every = c.a.len() + c.b.len();
    assert!(
        plain > 1e-2,
        "plain assembly is already full prefill? {plain}"
    );
    let whole: [Assembly; 4] = [
        Assembly::Link(Some(1000)),
        // Without a ranking, `sensitive` takes every chunk's first tokens, as `link`.
        Assembly::Sensitive(Some(1000)),
        "query-aware:1".parse().unwrap(),
        "reposition+recompute:1".parse().unwrap(),
    ];
    for asm in whole {
        let (d, n) = run(asm);
        eprintln!("{asm}: logits vs full {d:e} (plain assembly {plain:e})");
        assert_eq!(n, every, "{asm}");
        assert!(d < 1e-3, "{asm}: {d} vs plain {plain}");
    }
    // `prophet` is `query-aware`; `window` at a share of 1 covers every chunk token too.
    let (d, n) = run("prophet:1".parse().unwrap());
    assert!(n == every && d < 1e-3, "prophet:1: {n} tokens, {d}");
    let every_window = |asm: Assembly, share: f64| {
        let chunks = c.placed(&m, asm);
        let repair = Repair {
            recompute_share: share,
            ..REPAIR
        };
        let r = assemble(
            &m,
            asm,
            &repair,
            prompt(&c.pkv, chunks, &c.tokens, &question),
        )
        .unwrap();
        (
            max_abs_diff(r.logits.as_ref().unwrap(), &full),
            r.positions.len(),
        )
    };
    let (d, n) = every_window(Assembly::Window(Some(4)), 1.0);
    eprintln!("window:4 at share 1: logits vs full {d:e}");
    assert!(n == every && d < 1e-3, "window:4: {n} tokens, {d}");
    let (d_window, n) = every_window(Assembly::Window(Some(4)), 0.25);
    assert!(
        n >= (every as f64 * 0.25).ceil() as usize && n < every,
        "{n}"
    );
    assert!(d_window < plain, "window:4 at 0.25: {d_window} vs {plain}");
    // `sensitive` recomputes each chunk's ranked tokens (topped up with its first ones).
    let ranked = |asm: Assembly, ranked: Vec<Vec<u16>>| {
        let p = Prompt {
            ranked,
            ..prompt(&c.pkv, c.placed(&m, asm), &c.tokens, &question)
        };
        let r = assemble(&m, asm, &REPAIR, p).unwrap();
        (max_abs_diff(r.logits.as_ref().unwrap(), &full), r.positions)
    };
    let (d_sens, at) = ranked(Assembly::Sensitive(Some(2)), vec![vec![3, 1], vec![2]]);
    assert_eq!(at, [c.pa + 1, c.pa + 3, c.pb, c.pb + 2]);
    assert!(d_sens.is_finite());
    let (d_first, at) = ranked(Assembly::Sensitive(Some(2)), Vec::new());
    assert_eq!(at, [c.pa, c.pa + 1, c.pb, c.pb + 1]);
    assert_eq!(
        d_first,
        run(Assembly::Link(Some(2))).0,
        "no ranking: link's tokens"
    );
    // Partial repairs: k tokens of each chunk; the share of the chunk tokens.
    let (d_link, n) = run(Assembly::Link(Some(2)));
    assert_eq!(n, 4);
    let (d_qa, n) = run("query-aware:0.25".parse().unwrap());
    assert_eq!(n, (every as f64 * 0.25).ceil() as usize);
    eprintln!("link:2 {d_link:e}, query-aware:0.25 {d_qa:e}, plain {plain:e}");
    assert!(d_link < plain && d_qa < plain, "{d_link} {d_qa} vs {plain}");
}

/// A first chunk whose KV is what full prefill computes at its place (the first place's
/// copy, `ingest.exact_first`) is not repaired: `link`, `sensitive` and `window` recompute
/// only the later chunks' tokens, and with every one of those recomputed the logits are
/// full prefill's.
#[test]
fn an_exact_first_chunk_is_not_repaired() {
    let m = common::model();
    let c = two_chunks(&m);
    let question = m
        .tokenizer()
        .encode_markup("Question: Who commands the ship?<|im_end|>\n<|im_start|>assistant\n")
        .unwrap();
    let mut cache =
        model::KvCache::from_kv(&c.pkv, c.a.len() + c.b.len() + question.len()).unwrap();
    let rest: Vec<u32> = [&c.a[..], &c.b, &question].concat();
    let full = m
        .decoder()
        .forward(&mut cache, &rest, model::Logits::Last)
        .unwrap();
    // Chunk A after the prefix: full prefill's rows there, as the copy holds them.
    let (whole, _) = m.decoder().prefill(&c.tokens, 0).unwrap();
    let a_exact = whole.narrow(c.pa, c.a.len()).unwrap();
    let run = |asm: Assembly, exact_chunks: usize, ranked: Vec<Vec<u16>>| {
        let chunks = vec![a_exact.clone(), asm.place(&m, c.b0.clone(), c.pb).unwrap()];
        let p = Prompt {
            exact_chunks,
            ranked,
            ..prompt(&c.pkv, chunks, &c.tokens, &question)
        };
        let r = assemble(&m, asm, &REPAIR, p).unwrap();
        let logits = r.logits.clone().unwrap_or_else(|| {
            // Plain assembly leaves the question to feed.
            let mut cache = model::KvCache::from_kv(&r.kv, question.len()).unwrap();
            m.decoder()
                .forward(&mut cache, &question, model::Logits::Last)
                .unwrap()
        });
        (logits, r.positions)
    };
    let d = |l: &Tensor| max_abs_diff(l, &full);
    let b_all: Vec<usize> = (c.pb..c.pb + c.b.len()).collect();
    let (l, at) = run(Assembly::Link(Some(1000)), 1, Vec::new());
    assert_eq!(at, b_all, "link: only the second chunk");
    assert!(
        d(&l) < 1e-3,
        "the exact chunk and the second recomputed: {}",
        d(&l)
    );
    let (l, at) = run(Assembly::Link(Some(1000)), 0, Vec::new());
    assert_eq!(at.len(), c.a.len() + c.b.len());
    assert!(d(&l) < 1e-3, "{}", d(&l));
    // Recomputing the exact chunk's first tokens would only give its rows back.
    let (skipped, at) = run(Assembly::Link(Some(2)), 1, Vec::new());
    assert_eq!(at, [c.pb, c.pb + 1]);
    let (not, at) = run(Assembly::Link(Some(2)), 0, Vec::new());
    assert_eq!(at, [c.pa, c.pa + 1, c.pb, c.pb + 1]);
    let same = max_abs_diff(&skipped, &not);
    let (plain, _) = run(Assembly::Reposition, 1, Vec::new());
    assert!(
        same < 1e-3 && d(&plain) > 1e-2,
        "link:2 with and without the exact chunk's tokens: {same}; plain {}",
        d(&plain)
    );
    let (_, at) = run(Assembly::Sensitive(Some(2)), 1, vec![vec![3, 1], vec![2]]);
    assert_eq!(
        at,
        [c.pb, c.pb + 2],
        "sensitive: the second chunk's ranking"
    );
    let (_, at) = run(Assembly::Window(Some(2)), 1, Vec::new());
    assert!(
        !at.is_empty() && at.iter().all(|&p| p >= c.pb),
        "window: {at:?}"
    );
}
