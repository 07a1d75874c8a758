//! Assembly strategies: positions on the assembled cache, and every strategy answering planted
//! questions through the serving pipeline (SmolLM2-135M, MiniLM; generated documents).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use model::{Kv, Tensor};
use serve::assembly::assemble;
use serve::{Assembly, Event, KvMode, Query, Rag, ServeConfig};

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar()
        .unwrap()
}

/// Largest key difference between `kv`'s rows `start..start + want.len()` and `want`.
fn key_diff(kv: &Kv, start: usize, want: &Kv) -> f32 {
    kv.layers
        .iter()
        .zip(&want.layers)
        .map(|((k, _), (w, _))| max_abs_diff(&k.narrow(2, start, want.len()).unwrap(), w))
        .fold(0.0, f32::max)
}

#[test]
fn naive_and_reposition_put_chunks_where_they_claim() {
    let m = common::model();
    let t = m.tokenizer();
    let prefix = t
        .encode_markup("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nContext:\n")
        .unwrap();
    let a = t
        .encode("The access code for the Orion vault is 4817.\n")
        .unwrap();
    let b = t
        .encode("Captain Ines Valbuena commands the research ship Calder Wren.\n")
        .unwrap();
    let (pkv, _) = m.prefill(&prefix, 0).unwrap();
    let tokens: Vec<u32> = [&prefix[..], &a, &b].concat();
    let (pa, pb) = (prefix.len(), prefix.len() + a.len());
    // Each chunk computed alone at 0.., as stored; and computed alone at its prompt place.
    let (a0, b0) = (m.prefill(&a, 0).unwrap().0, m.prefill(&b, 0).unwrap().0);
    let (a_at, b_at) = (m.prefill(&a, pa).unwrap().0, m.prefill(&b, pb).unwrap().0);

    for asm in [Assembly::Naive, Assembly::Reposition] {
        let chunks = vec![
            asm.place(&m, a0.clone(), pa).unwrap(),
            asm.place(&m, b0.clone(), pb).unwrap(),
        ];
        let (kv, recomputed) = assemble(&m, asm, 0.15, &pkv, chunks, &tokens).unwrap();
        assert_eq!((kv.len(), recomputed), (tokens.len(), 0));
        assert_eq!(key_diff(&kv, 0, &pkv), 0.0, "{asm}: the prefix moved");
        let (da0, db0) = (key_diff(&kv, pa, &a0), key_diff(&kv, pb, &b0));
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
    let chunks = vec![
        Assembly::Recompute.place(&m, a0.clone(), pa).unwrap(),
        Assembly::Recompute.place(&m, b0.clone(), pb).unwrap(),
    ];
    let (kv, recomputed) = assemble(&m, Assembly::Recompute, 0.5, &pkv, chunks, &tokens).unwrap();
    assert_eq!(recomputed, (a.len() + b.len()).div_ceil(2));
    assert_eq!(key_diff(&kv, 0, &pkv), 0.0);
}

const PLANTED: &[(&str, &str, &str, &str)] = &[
    (
        "orion-vault",
        "The Harrowgate archive keeps its oldest survey maps in the Orion vault, below the \
         reading room. The access code for the Orion vault is 4817. Only the head archivist \
         may open it, and every visit is written in the vault ledger.",
        "What is the access code for the Orion vault?",
        "4817",
    ),
    (
        "calder-wren",
        "The research ship Calder Wren was launched in 2011 to study plankton in the North \
         Atlantic. The captain of the Calder Wren is Ines Valbuena. The ship carries a crew \
         of twenty-two and a laboratory for water samples.",
        "Who is the captain of the Calder Wren?",
        "Valbuena",
    ),
    (
        "quillby-lanterns",
        "The village of Quillby holds a lantern festival every winter. The festival's \
         lanterns are made of blue paper, and the lanterns are floated on Lake Morrow at \
         midnight. Visitors bring their own candles.",
        "What colour is the paper of the Quillby lanterns?",
        "blue",
    ),
];

/// An engine over the planted documents (eagerly materialized) in `dir`.
fn planted_engine(dir: &std::path::Path, chunk_preamble: &str) -> Arc<ingest::Engine> {
    let docs = PLANTED
        .iter()
        .map(|(id, text, _, _)| ingest::Doc {
            id: id.to_string(),
            text: text.to_string(),
            metadata: Default::default(),
            origin: id.to_string(),
        })
        .collect();
    Arc::new(common::engine(
        dir,
        ingest::IngestConfig {
            chunk_preamble: chunk_preamble.into(),
            ..ingest::IngestConfig::default()
        },
        ingest::Source::Docs(docs),
        PLANTED.len(),
    ))
}

#[test]
fn every_strategy_answers_planted_questions() {
    let dir = tempfile::tempdir().unwrap();
    let engine = planted_engine(dir.path(), "");
    let rag = Rag::start(engine.clone(), ServeConfig::default()).unwrap();

    for asm in Assembly::ALL {
        for (id, _, question, want) in PLANTED {
            let q = Query {
                question: question.to_string(),
                // Every document in the prompt: the planted one is not always first.
                top_k: PLANTED.len(),
                filter: Default::default(),
                params: model::GenerateParams {
                    max_tokens: 24,
                    ..Default::default()
                },
                kv: KvMode::On,
                assembly: asm,
            };
            let hits = rag.retrieve(&q).unwrap();
            assert_eq!(hits[0].payload.doc_id, *id);
            let (tx, mut rx) = tokio::sync::mpsc::channel(256);
            let ticket = rag.admit().unwrap();
            rag.submit(ticket, q, hits, tx, Instant::now(), Duration::ZERO)
                .unwrap();
            let f = loop {
                match rx.blocking_recv().expect("query ended") {
                    Event::Token(_) => {}
                    Event::Done(f) => break f,
                    Event::Error(_, e) => panic!("{asm}: {e}"),
                }
            };
            eprintln!("{asm} | {question} -> {:?}", f.answer);
            assert_eq!(f.assembly, asm);
            let stored = f.citations.iter().filter(|c| c.kv.is_stored()).count();
            if asm == Assembly::Full {
                assert_eq!(stored, 0);
            } else {
                assert_eq!(stored, PLANTED.len(), "{:?}", f.citations);
            }
            assert_eq!(f.recomputed_tokens > 0, asm == Assembly::Recompute, "{f:?}");
            assert!(
                f.answer.to_lowercase().contains(&want.to_lowercase()),
                "{asm}: {question} -> {:?}",
                f.answer
            );
        }
    }
    drop(rag);
    let start = Instant::now();
    while Arc::strong_count(&engine) > 1 && start.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_chunk_preamble_is_prefilled_with_every_chunk() {
    let dir = tempfile::tempdir().unwrap();
    let plain = planted_engine(&dir.path().join("plain"), "");
    let with = planted_engine(&dir.path().join("with"), "Passage:\n");
    assert_ne!(
        plain.namespace(),
        with.namespace(),
        "the preamble is part of the namespace"
    );
    let pre = with.model.tokenizer().encode("Passage:\n").unwrap();
    let (_, text, _, _) = PLANTED[0];
    let tokens = with.chunk_tokens(text).unwrap();
    assert_eq!(tokens[..pre.len()], pre[..]);
    assert_eq!(tokens[pre.len()..], plain.chunk_tokens(text).unwrap()[..]);
    // What ingest stored is exactly those tokens' KV, found by the same lookup serve does.
    let hit = &with.index.document(PLANTED[0].0).unwrap()[0].1;
    let stored = with.chunk_tokens(&hit.text).unwrap();
    assert_eq!(
        with.store.probe(with.namespace(), &stored).unwrap(),
        stored.len()
    );
    assert!(with.check(false).unwrap().ok());
}
