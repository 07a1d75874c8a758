//! Every assembly strategy answering planted questions through the serving pipeline, teacher
//! forcing against the pipeline's own answers, chunk preambles, and the whole prompt `full`
//! prefills (SmolLM2-135M, MiniLM; generated documents).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::max_abs_diff;
use model::Tensor;
use serve::{Assembly, CacheDtype, KvMode, Query, Rag, ServeConfig};

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

/// A greedy query over every planted document (in the prompt together: the planted one is not
/// always first).
fn planted_query(question: &str, assembly: Assembly, max_tokens: usize, ignore_eos: bool) -> Query {
    Query {
        question: question.to_string(),
        top_k: PLANTED.len(),
        filter: Default::default(),
        params: model::GenerateParams {
            max_tokens,
            ignore_eos,
            ..Default::default()
        },
        kv: KvMode::On,
        assembly,
    }
}

/// Stops the pipeline and waits until its threads have let go of the engine (which closes
/// its index before the directory goes).
fn close(rag: Arc<Rag>, engine: Arc<ingest::Engine>) {
    drop(rag);
    let start = Instant::now();
    while Arc::strong_count(&engine) > 1 && start.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn every_strategy_answers_planted_questions() {
    let dir = tempfile::tempdir().unwrap();
    let engine = planted_engine(dir.path(), "");
    let rag = Rag::start(engine.clone(), ServeConfig::default()).unwrap();

    for asm in Assembly::ALL {
        for (id, _, question, want) in PLANTED {
            let q = planted_query(question, asm, 24, false);
            let hits = rag.retrieve(&q).unwrap();
            assert_eq!(hits[0].payload.doc_id, *id);
            let f = common::answer(&rag, q, hits);
            eprintln!("{asm} | {question} -> {:?}", f.answer);
            assert_eq!(f.assembly, asm);
            let stored = f.citations.iter().filter(|c| c.kv.is_stored()).count();
            if asm == Assembly::Full {
                assert_eq!(stored, 0);
            } else {
                assert_eq!(stored, PLANTED.len(), "{:?}", f.citations);
            }
            let repairs = matches!(
                asm,
                Assembly::Recompute(_)
                    | Assembly::Link(_)
                    | Assembly::Sensitive(_)
                    | Assembly::QueryAware(_)
                    | Assembly::Window(_)
            );
            assert_eq!(f.recomputed_tokens > 0, repairs, "{f:?}");
            assert!(
                f.answer.to_lowercase().contains(&want.to_lowercase()),
                "{asm}: {question} -> {:?}",
                f.answer
            );
        }
    }
    close(rag, engine);
}

/// Teacher forcing: the reference answers as the pipeline does, and feeding its answer back
/// through the same strategy reproduces its decisions; another strategy's rows line up with
/// it. With f32 decoding caches, and with f16 ones (the default), where `full` rounds each
/// prompt row into the cache as it is fed while a repair of every token computes the whole
/// context in f32 and rounds it once: a wider tolerance, the same decisions.
#[test]
fn teacher_forcing_reproduces_the_reference() {
    teacher_forcing_with(CacheDtype::F32, 1e-2);
    teacher_forcing_with(CacheDtype::F16, 3e-2);
}

fn teacher_forcing_with(cache_dtype: CacheDtype, tol: f32) {
    let dir = tempfile::tempdir().unwrap();
    let engine = planted_engine(dir.path(), "");
    let config = ServeConfig {
        cache_dtype,
        ..ServeConfig::default()
    };
    let rag = Rag::start(engine.clone(), config).unwrap();
    let (_, _, question, want) = PLANTED[0];
    let query = |assembly| planted_query(question, assembly, 20, false);
    let hits = rag.retrieve(&query(Assembly::Full)).unwrap();
    let r = rag.reference(&query(Assembly::Full), hits.clone()).unwrap();
    eprintln!("reference: {:?} {:?}", r.generation.text, r.targets);
    assert!(r.generation.text.contains(want), "{:?}", r.generation.text);
    let vocab = engine.corpus().model().config().vocab_size;
    assert_eq!(r.logits.dims(), [r.targets.len(), vocab]);
    assert!(r.targets.len() >= r.generation.tokens.len());
    assert!(r.first_token_ms > 0.0);

    // The pipeline's own `full` answer is the reference's.
    let piped = common::answer(&rag, query(Assembly::Full), hits.clone());
    assert_eq!(piped.answer, r.generation.text);

    let argmaxes =
        |t: &Tensor| -> Vec<u32> { t.argmax(model::D::Minus1).unwrap().to_vec1().unwrap() };
    let f = rag
        .forced(&query(Assembly::Full), hits.clone(), &r.targets)
        .unwrap();
    assert_eq!(argmaxes(&f), r.targets);
    let d = max_abs_diff(&f, &r.logits);
    eprintln!("forced full vs reference logits: {d:e}");
    assert!(d < tol, "{cache_dtype:?}: {d}");
    // A repair of every chunk token is full prefill; it runs the question in its own pass,
    // whose logits start both the forced rows and the pipeline's answer.
    let whole = Assembly::Link(Some(4096));
    let f = rag.forced(&query(whole), hits.clone(), &r.targets).unwrap();
    assert_eq!(argmaxes(&f), r.targets);
    let d = max_abs_diff(&f, &r.logits);
    eprintln!("forced {whole} vs reference logits: {d:e}");
    assert!(d < tol, "{cache_dtype:?}: {d}");
    let piped = common::answer(&rag, query(whole), hits.clone());
    assert_eq!(piped.answer, r.generation.text);
    for asm in [Assembly::Reposition, Assembly::Link(Some(2))] {
        let f = rag.forced(&query(asm), hits.clone(), &r.targets).unwrap();
        assert_eq!(f.dims(), r.logits.dims(), "{asm}");
        let agree = argmaxes(&f)
            .iter()
            .zip(&r.targets)
            .filter(|(a, b)| a == b)
            .count();
        eprintln!("{asm}: {agree}/{} token decisions agree", r.targets.len());
    }
    assert!(rag.forced(&query(Assembly::Full), hits, &[]).is_err());
    close(rag, engine);
}

#[test]
fn a_chunk_preamble_is_prefilled_with_every_chunk() {
    let dir = tempfile::tempdir().unwrap();
    let plain = planted_engine(&dir.path().join("plain"), "");
    let with = planted_engine(&dir.path().join("with"), "Passage:\n");
    assert_ne!(
        plain.corpus().namespace(),
        with.corpus().namespace(),
        "the preamble is part of the namespace"
    );
    let pre = with
        .corpus()
        .model()
        .tokenizer()
        .encode("Passage:\n")
        .unwrap();
    let (_, text, _, _) = PLANTED[0];
    let tokens = with.corpus().chunk_tokens(text).unwrap();
    assert_eq!(tokens[..pre.len()], pre[..]);
    assert_eq!(
        tokens[pre.len()..],
        plain.corpus().chunk_tokens(text).unwrap()[..]
    );
    // What ingest stored is exactly those tokens' KV, found by the same lookup serve does.
    let hit = &with.corpus().index().document(PLANTED[0].0).unwrap()[0].1;
    let stored = with.corpus().chunk_tokens(&hit.text).unwrap();
    assert_eq!(
        with.corpus()
            .store()
            .probe(with.corpus().namespace(), &stored)
            .unwrap(),
        stored.len()
    );
    assert!(with.check(false).unwrap().ok());
}

/// `Rag::prompt_tokens` is the prompt `full` prefills (what `bench peer` hands llama.cpp):
/// same length as the pipeline's, and the model answers it as the pipeline does; and
/// `ignore_eos` makes the pipeline answer exactly `max_tokens`.
#[test]
fn the_whole_prompt_is_what_full_prefills() {
    let dir = tempfile::tempdir().unwrap();
    let engine = planted_engine(dir.path(), "");
    let rag = Rag::start(engine.clone(), ServeConfig::default()).unwrap();
    let (_, _, question, want) = PLANTED[1];
    let query = |ignore_eos| planted_query(question, Assembly::Full, 24, ignore_eos);
    let hits = rag.retrieve(&query(false)).unwrap();
    let prompt = rag.prompt_tokens(question, &hits).unwrap();
    let f = common::answer(&rag, query(false), hits.clone());
    assert!(f.answer.contains(want), "{:?}", f.answer);
    assert_eq!(prompt.len(), f.prompt_tokens);
    let alone = engine
        .corpus()
        .model()
        .generate(&prompt, &query(false).params, |_| true)
        .unwrap();
    assert_eq!(alone.text, f.answer);
    assert!(f.completion_tokens < 24, "{f:?}");
    let long = common::answer(&rag, query(true), hits);
    assert_eq!(long.completion_tokens, 24, "{long:?}");
    assert_eq!(long.finish_reason, "length");
    close(rag, engine);
}

/// `serve.cache_dtype = "q8"`: every planted question answered from stored KV with 8-bit
/// decoding caches still names its fact, and teacher-forcing the f16 cache's answers through
/// q8 caches agrees with nearly every decision.
#[test]
fn q8_decoding_caches_answer_as_f16_ones_do() {
    let dir = tempfile::tempdir().unwrap();
    let engine = planted_engine(dir.path(), "");
    let start = |cache_dtype| {
        let config = ServeConfig {
            cache_dtype,
            ..ServeConfig::default()
        };
        Rag::start(engine.clone(), config).unwrap()
    };
    let (f16, q8) = (start(CacheDtype::F16), start(CacheDtype::Q8));
    let argmaxes =
        |t: &Tensor| -> Vec<u32> { t.argmax(model::D::Minus1).unwrap().to_vec1().unwrap() };
    let (mut agree, mut total) = (0, 0);
    for &(_, _, question, want) in PLANTED {
        for asm in [Assembly::Full, Assembly::Reposition, Assembly::default()] {
            let query = planted_query(question, asm, 20, false);
            let hits = q8.retrieve(&query).unwrap();
            let f = common::answer(&q8, query.clone(), hits.clone());
            assert!(
                f.answer.to_lowercase().contains(&want.to_lowercase()),
                "q8 {asm}: {question} -> {:?}",
                f.answer
            );
            let r = f16.reference(&query, hits.clone()).unwrap();
            let forced = q8.forced(&query, hits, &r.targets).unwrap();
            let same = argmaxes(&forced)
                .iter()
                .zip(&r.targets)
                .filter(|(a, b)| a == b)
                .count();
            agree += same;
            total += r.targets.len();
        }
    }
    eprintln!("q8 vs f16 caches: {agree} of {total} decisions agree");
    assert!(agree as f64 >= 0.95 * total as f64, "{agree} of {total}");
    drop(f16);
    close(q8, engine);
}
