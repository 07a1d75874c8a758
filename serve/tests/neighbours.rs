//! Neighbour materialization (`ingest.context = "neighbours:1"`) with SmolLM2-135M and MiniLM:
//! a chunk's stored KV holds only its own rows, computed after its nearest chunk and moved back
//! to positions `0..n`; arranged by neighbour, it is placed after that neighbour; a neighbour
//! that changes makes it stale, and `rematerialize` redoes it. Under `ingest.context =
//! "prompt"`, a chunk is stored as a full prefill of the prompt computes it when it comes first.

mod common;

use model::{Kv, Tensor};

use common::VAULT_DOCS as DOCS;

/// The stored KV of `tokens`.
fn stored(corpus: &ingest::Corpus, tokens: &[u32]) -> Kv {
    let data = corpus
        .store()
        .get_batch(corpus.namespace(), tokens, tokens.len())
        .unwrap();
    Kv::from_bytes(&data.bytes, &corpus.layout(), &model::Device::Cpu).unwrap()
}

/// Largest difference of keys and of values relative to the largest magnitude, over layers.
fn relative_diff(a: &Kv, b: &Kv) -> (f32, f32) {
    let rel = |a: &Tensor, b: &Tensor| {
        let top: f32 = b
            .to_dtype(model::DType::F32)
            .and_then(|t| t.abs())
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.max(0))
            .and_then(|t| t.to_scalar())
            .unwrap();
        common::max_abs_diff(a, b) / top.max(1e-6)
    };
    let (mut dk, mut dv) = (0f32, 0f32);
    for ((k, v), (bk, bv)) in a.layers.iter().zip(&b.layers) {
        dk = dk.max(rel(k, bk));
        dv = dv.max(rel(v, bv));
    }
    (dk, dv)
}

/// The rows of `tokens` in a prefill of `before` and `tokens` together from position 0.
fn rows_after(m: &model::Model, before: &[u32], tokens: &[u32]) -> Kv {
    m.decoder()
        .prefill(&[before, tokens].concat(), 0)
        .unwrap()
        .0
        .narrow(before.len(), tokens.len())
        .unwrap()
}

/// The question about the vault, over `top_k` chunks, answered by `assembly`.
fn vault_query(assembly: serve::Assembly, top_k: usize) -> serve::Query {
    serve::Query {
        question: "What is the access code for the Orion vault?".into(),
        top_k,
        filter: Default::default(),
        params: model::GenerateParams::default(),
        kv: serve::KvMode::On,
        assembly,
    }
}

fn remat(engine: &ingest::Engine) -> ingest::RematReport {
    engine
        .rematerialize(
            &ingest::RematOptions::default(),
            &ingest::Counters::default(),
        )
        .unwrap()
}

#[test]
fn a_chunk_is_stored_after_its_neighbour_and_redone_when_it_changes() {
    let dir = tempfile::tempdir().unwrap();
    let config = ingest::IngestConfig {
        context: "neighbours:1".parse().unwrap(),
        ..ingest::IngestConfig::default()
    };
    let engine = common::engine(dir.path(), config, common::docs(DOCS), DOCS.len());
    let corpus = engine.corpus();
    let plain = common::open_corpus(
        &dir.path().join("plain"),
        ingest::IngestConfig::default(),
        model::DType::F16,
        common::model(),
        kvstore::StoreOptions::default(),
    );
    assert_ne!(
        corpus.namespace(),
        plain.namespace(),
        "the mode names the namespace"
    );

    // The first document found no neighbour in the index when it was ingested: stale, and
    // redone after the whole corpus is indexed; a second run finds nothing to do.
    let r = remat(&engine);
    eprintln!("first rematerialize: {r:?}");
    assert!(
        r.neighbours_changed >= 1 && r.prefilled == r.neighbours_changed,
        "{r:?}"
    );
    let r = remat(&engine);
    assert_eq!((r.planned, r.neighbours_changed), (0, 0), "{r:?}");

    let tokens = corpus.chunk_tokens(DOCS[0].1).unwrap();
    let vector = corpus.embedder().embed_one(DOCS[0].1).unwrap();
    let context = corpus.neighbours(&tokens, &vector).unwrap();
    assert_eq!(context.len(), 1);
    assert_eq!(
        context[0],
        corpus.chunk_tokens(DOCS[1].1).unwrap(),
        "the ledger is the vault's nearest chunk"
    );
    let note = ingest::decode_note(
        &corpus
            .store()
            .note(corpus.namespace(), &tokens)
            .unwrap()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(note, [schema::TokenDigest::of(&context[0])]);

    // Arranged by neighbour (`ragkv eval qa --chunk-order neighbours`), the vault's chunk goes
    // right after the ledger's, whatever their ranks: its KV sees the context it was computed in.
    let ship = corpus.chunk_tokens(DOCS[2].1).unwrap();
    let order = corpus
        .neighbour_order(&[tokens.clone(), ship, context[0].clone()])
        .unwrap();
    eprintln!("order of [vault, ship, ledger]: {order:?}");
    let at = |i: usize| order.iter().position(|&x| x == i).unwrap();
    assert_eq!(at(2) + 1, at(0), "{order:?}");
    assert_eq!(
        plain
            .neighbour_order(&[tokens.clone(), context[0].clone()])
            .unwrap(),
        [0, 1],
        "plain KV keeps the retrieval order"
    );

    // Only the chunk's rows are stored, at positions 0..n: rotated forward by the context's
    // length they are the joint prefill's rows (keys within f16 rounding, values as they are).
    let kv = stored(corpus, &tokens);
    assert_eq!(kv.len(), tokens.len());
    let m = corpus.model();
    let offset = context[0].len();
    let joint = rows_after(m, &context[0], &tokens);
    let moved = m.decoder().reposition(&kv, offset as i64).unwrap();
    let (dk, dv) = relative_diff(&moved, &joint);
    // ... and not what the chunk computes alone.
    let alone = m.decoder().prefill(&tokens, 0).unwrap().0;
    let d_alone = kv
        .layers
        .iter()
        .zip(&alone.layers)
        .map(|((_, v), (_, av))| common::max_abs_diff(v, av))
        .fold(0f32, f32::max);
    eprintln!(
        "stored vs joint prefill (relative): keys {dk:e}, values {dv:e}; values vs alone {d_alone:e}"
    );
    assert!(dk < 5e-3 && dv < 2e-3, "{dk} {dv}");
    assert!(d_alone > 0.05, "{d_alone}");

    // The neighbour changes: the vault's chunk is stale and prefilled again after the new
    // ledger; the ship's chunk (whose neighbour is unchanged or the new ledger) follows suit.
    let changed = [(
        "vault-ledger",
        "Every visit to the Orion vault is written in the ledger of the Harrowgate archive; \
         the head archivist signs it each evening and locks it in the map room.",
    )];
    let rep = common::ingest_eager(&engine, common::docs(&changed));
    assert_eq!(rep.docs_replaced, 1, "{rep:?}");
    assert!(rep.context_tokens_prefilled > 0, "{rep:?}");
    let dry = engine
        .rematerialize(
            &ingest::RematOptions {
                scope: ingest::Scope::Stale,
                dry_run: true,
                limit: None,
            },
            &ingest::Counters::default(),
        )
        .unwrap();
    assert!(
        dry.plan
            .iter()
            .any(|p| p.doc_id == "vault" && p.reason == ingest::Reason::Neighbours),
        "{dry:?}"
    );
    let r = remat(&engine);
    assert!(r.neighbours_changed >= 1, "{r:?}");
    let after = stored(corpus, &tokens);
    // (Layer 0's rows depend on the token alone: the last layer's show the context.)
    let last = kv.layers.len() - 1;
    let d = common::max_abs_diff(&after.layers[last].1, &kv.layers[last].1);
    eprintln!("vault's values after its neighbour changed: {d:e}");
    assert!(d > 0.0, "the vault's KV did not change");
    assert_eq!(remat(&engine).planned, 0);
}

#[test]
fn a_chunk_stored_after_the_prompt_start_is_what_full_prefill_computes_first() {
    let dir = tempfile::tempdir().unwrap();
    let config = |context: &str, system: &str| ingest::IngestConfig {
        context: context.parse().unwrap(),
        system_prompt: system.into(),
        ..ingest::IngestConfig::default()
    };
    let docs = &DOCS[..1];
    let passage = ingest::IngestConfig {
        context_passage: DOCS[2].1.into(),
        ..config("prompt", "Be brief.")
    };
    let engine = common::engine(
        dir.path(),
        config("prompt", "Be brief."),
        common::docs(docs),
        docs.len(),
    );
    let corpus = engine.corpus();
    let open = |name: &str, c: ingest::IngestConfig| {
        common::open_corpus(
            &dir.path().join(name),
            c,
            model::DType::F16,
            common::model(),
            kvstore::StoreOptions::default(),
        )
        .namespace()
    };
    // The mode and the system prompt name the namespace.
    let others = [
        open("plain", ingest::IngestConfig::default()),
        open("other-prompt", config("prompt", "Be very brief.")),
        open(
            "with-neighbours",
            config("prompt+neighbours:1", "Be brief."),
        ),
    ];
    let with_passage = common::open_corpus(
        &dir.path().join("with-passage"),
        passage,
        model::DType::F16,
        common::model(),
        kvstore::StoreOptions::default(),
    );
    let others = [&others[..], &[with_passage.namespace()]].concat();
    assert!(!others.contains(&corpus.namespace()), "{others:?}");
    assert_ne!(others[1], others[2]);
    assert_ne!(others[1], others[3]);

    // Only the chunk's rows are stored, at positions 0..n; moved after the prompt's start they
    // are the rows of a prefill of the start and the chunk (the server's `full` for a
    // one-chunk prompt, the first chunk of any): keys within f16 rounding.
    let m = corpus.model();
    let start = m
        .prompt_tokens(&m.rag_prompt().unwrap().prefix("Be brief."))
        .unwrap();
    let tokens = corpus.chunk_tokens(docs[0].1).unwrap();
    let kv = stored(corpus, &tokens);
    assert_eq!(kv.len(), tokens.len());
    let joint = rows_after(m, &start, &tokens);
    let moved = m.decoder().reposition(&kv, start.len() as i64).unwrap();
    let (dk, dv) = relative_diff(&moved, &joint);
    // Not what the chunk computes alone (its first token is no sink here).
    let alone = m.decoder().prefill(&tokens, 0).unwrap().0;
    let (_, d_alone) = relative_diff(&kv, &alone);
    eprintln!(
        "stored vs prefill after the prompt's start (relative): keys {dk:e}, values {dv:e}; \
         values vs alone {d_alone:e}"
    );
    assert!(dk < 5e-3 && dv < 2e-3, "{dk} {dv}");
    assert!(d_alone > 0.05, "{d_alone}");
    let r = remat(&engine);
    assert_eq!(r.planned, 0, "{r:?}");

    // With a passage, what goes before the chunk is the prompt's start and then the passage.
    let before = [&start[..], &m.tokenizer().encode(DOCS[2].1).unwrap()].concat();
    let joint = rows_after(m, &before, &tokens);
    let bytes = with_passage.prefill_after(&[], &tokens).unwrap();
    let kv = Kv::from_bytes(&bytes, &corpus.layout(), &model::Device::Cpu).unwrap();
    let moved = m.decoder().reposition(&kv, before.len() as i64).unwrap();
    let (dk, dv) = relative_diff(&moved, &joint);
    assert!(dk < 5e-3 && dv < 2e-3, "after a passage: {dk} {dv}");

    // Short chunks share a forward pass (ingest groups them): each is still what it is alone
    // after the prompt's start.
    let other = corpus.chunk_tokens(DOCS[2].1).unwrap();
    let many = corpus.prefill_many_bytes(&[&tokens, &other]).unwrap();
    let layout = corpus.layout();
    for (bytes, t) in many.iter().zip([&tokens, &other]) {
        let one = corpus.prefill_after(&[], t).unwrap();
        let [a, b] =
            [bytes, &one].map(|b| Kv::from_bytes(b, &layout, &model::Device::Cpu).unwrap());
        let (dk, dv) = relative_diff(&a, &b);
        assert!(dk < 5e-3 && dv < 2e-3, "grouped vs alone: {dk} {dv}");
    }
}

#[test]
fn a_chunk_stored_under_mean_is_the_mean_of_its_rows_after_each_neighbour() {
    let dir = tempfile::tempdir().unwrap();
    let config = |context: &str| ingest::IngestConfig {
        context: context.parse().unwrap(),
        system_prompt: "Be brief.".into(),
        ..ingest::IngestConfig::default()
    };
    let engine = common::engine(
        dir.path(),
        config("prompt+mean:2"),
        common::docs(DOCS),
        DOCS.len(),
    );
    let corpus = engine.corpus();
    let joint = common::open_corpus(
        &dir.path().join("joint"),
        config("prompt+neighbours:2"),
        model::DType::F16,
        common::model(),
        kvstore::StoreOptions::default(),
    );
    assert_ne!(
        corpus.namespace(),
        joint.namespace(),
        "the mode names the namespace"
    );
    // The first documents found fewer neighbours than two when they were ingested.
    let r = remat(&engine);
    assert!(r.neighbours_changed >= 1, "{r:?}");
    assert_eq!(remat(&engine).planned, 0);

    let tokens = corpus.chunk_tokens(DOCS[0].1).unwrap();
    let vector = corpus.embedder().embed_one(DOCS[0].1).unwrap();
    let context = corpus.neighbours(&tokens, &vector).unwrap();
    assert_eq!(context.len(), 2);
    let note = corpus.store().note(corpus.namespace(), &tokens).unwrap();
    let note = note.unwrap();
    let named = ingest::decode_note(&note).unwrap();
    let digests: Vec<_> = context.iter().map(|c| schema::TokenDigest::of(c)).collect();
    assert_eq!(named, digests, "the note names both neighbours");
    let ranked = ingest::decode_ranked(&note).unwrap();
    assert_eq!(corpus.ranked_offsets(&tokens).unwrap(), ranked);

    // The stored rows are the mean of the chunk's rows prefilled after the prompt's start and
    // each neighbour alone, every one moved back to 0..n first (within f16 rounding).
    let m = corpus.model();
    let start = m
        .prompt_tokens(&m.rag_prompt().unwrap().prefix("Be brief."))
        .unwrap();
    let each: Vec<Kv> = context
        .iter()
        .map(|c| {
            let before = [&start[..], c].concat();
            let rows = rows_after(m, &before, &tokens);
            m.decoder()
                .reposition(&rows, -(before.len() as i64))
                .unwrap()
        })
        .collect();
    let kv = stored(corpus, &tokens);
    assert_eq!(kv.len(), tokens.len());
    let (dk, dv) = relative_diff(&kv, &Kv::mean(&each).unwrap());
    // Each context alone gives other rows; the mean sits between them.
    let (_, apart) = relative_diff(&each[0], &each[1]);
    let (_, from_first) = relative_diff(&kv, &each[0]);
    eprintln!(
        "stored vs the mean (relative): keys {dk:e}, values {dv:e}; the two contexts' values \
         {apart:e} apart, the stored {from_first:e} from the first"
    );
    assert!(dk < 5e-3 && dv < 2e-3, "{dk} {dv}");
    assert!(apart > 0.02, "{apart}");
    // The note ranks the chunk's tokens by how far their rows moved between the contexts:
    // distinct offsets inside the chunk, led by one of the most moved of this recomputation
    // (its batching rounds differently from ingest's).
    let drift = Kv::drift(&each).unwrap();
    let mut distinct = ranked.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), ranked.len());
    assert_eq!(ranked.len(), tokens.len().min(ingest::RANKED_MAX));
    assert!(ranked.iter().all(|&o| usize::from(o) < tokens.len()));
    let above = drift
        .iter()
        .filter(|&&d| d > drift[usize::from(ranked[0])])
        .count();
    eprintln!(
        "drift of the ranked first token: {} ({above} above it); ranked {ranked:?}; the \
         first tokens' drift {:?}",
        drift[usize::from(ranked[0])],
        &drift[..8.min(drift.len())]
    );
    assert!(above < 3, "{ranked:?} {drift:?}");
    assert!(
        from_first > apart / 4.0 && from_first < apart,
        "{from_first} {apart}"
    );

    // Through the server, `sensitive:2` reads each chunk's ranking from its note and
    // recomputes its two most moved tokens: other tokens than `link:2`'s first two wherever
    // the ranking leads with others, so other logits.
    let engine = std::sync::Arc::new(engine);
    let corpus = engine.corpus();
    let rag = common::pipeline(&engine, "Be brief.");
    let query = |assembly| vault_query(assembly, 2);
    let sensitive = query(serve::Assembly::Sensitive(Some(2)));
    let hits = rag.retrieve(&sensitive).unwrap();
    let reordered = hits.iter().any(|h| {
        let t = corpus.chunk_tokens(&h.payload.text).unwrap();
        let mut top: Vec<u16> = corpus.ranked_offsets(&t).unwrap()[..2].to_vec();
        top.sort_unstable();
        top != [0, 1]
    });
    assert!(
        reordered,
        "every retrieved chunk ranks its first two tokens first"
    );
    let answer = &tokens[..3];
    let s = rag.forced(&sensitive, hits.clone(), answer).unwrap();
    let link = query(serve::Assembly::Link(Some(2)));
    let l = rag.forced(&link, hits.clone(), answer).unwrap();
    let d = common::max_abs_diff(&s, &l);
    assert!(
        d > 1e-4,
        "sensitive:2 and link:2 gave the same logits ({d})"
    );
    common::stop(rag, &engine);
}

#[test]
fn under_exact_first_the_chunk_placed_first_reads_its_copy_after_the_prompt_start_alone() {
    let dir = tempfile::tempdir().unwrap();
    let config = |context: &str, exact_first| ingest::IngestConfig {
        context: context.parse().unwrap(),
        exact_first,
        system_prompt: "Be brief.".into(),
        ..ingest::IngestConfig::default()
    };
    let engine = common::engine(
        dir.path(),
        config("prompt+mean:2", true),
        common::docs(DOCS),
        DOCS.len(),
    );
    let corpus = engine.corpus();
    // The copies share `context = "prompt"`'s namespace; the main one is the mode's own.
    let prompt = common::open_corpus(
        &dir.path().join("prompt"),
        config("prompt", false),
        model::DType::F16,
        common::model(),
        kvstore::StoreOptions::default(),
    );
    let first_ns = corpus.first_namespace().unwrap();
    assert_eq!(first_ns, prompt.namespace());
    assert_ne!(first_ns, corpus.namespace());
    remat(&engine); // the first documents had fewer than two neighbours
    assert_eq!(remat(&engine).planned, 0);

    // The copy is the chunk's rows after the prompt's start alone; the main KV is the mean.
    let m = corpus.model();
    let start = m
        .prompt_tokens(&m.rag_prompt().unwrap().prefix("Be brief."))
        .unwrap();
    let tokens = corpus.chunk_tokens(DOCS[0].1).unwrap();
    let read = |ns| {
        let data = corpus.store().get_batch(ns, &tokens, tokens.len()).unwrap();
        Kv::from_bytes(&data.bytes, &corpus.layout(), &model::Device::Cpu).unwrap()
    };
    let copy = m
        .decoder()
        .reposition(&read(first_ns), start.len() as i64)
        .unwrap();
    let (dk, dv) = relative_diff(&copy, &rows_after(m, &start, &tokens));
    assert!(dk < 5e-3 && dv < 2e-3, "{dk} {dv}");
    let (_, apart) = relative_diff(&read(first_ns), &stored(corpus, &tokens));
    assert!(apart > 0.02, "{apart}");

    // Through the server, `reposition` over one chunk is full prefill (within rounding) when
    // the copy is read; without it (deleted: the chunk's own mean KV is read) it is not, and
    // `rematerialize` puts the copy back.
    let engine = std::sync::Arc::new(engine);
    let corpus = engine.corpus();
    let rag = common::pipeline(&engine, "Be brief.");
    let query = |assembly| vault_query(assembly, 1);
    let hits = rag.retrieve(&query(serve::Assembly::Full)).unwrap();
    let first = corpus.chunk_tokens(&hits[0].payload.text).unwrap();
    let answer = &tokens[..3];
    let forced = |asm| rag.forced(&query(asm), hits.clone(), answer).unwrap();
    let full = forced(serve::Assembly::Full);
    let exact = common::max_abs_diff(&forced(serve::Assembly::Reposition), &full);
    // `link` leaves the copy as it is: nothing of it to repair.
    let linked = || {
        let f = common::answer(&rag, query(serve::Assembly::Link(Some(2))), hits.clone());
        f.recomputed_tokens
    };
    assert_eq!(linked(), 0);
    corpus.store().delete(first_ns, &first, 0).unwrap();
    assert!(!corpus.stored(&first).unwrap());
    let mean = common::max_abs_diff(&forced(serve::Assembly::Reposition), &full);
    assert_eq!(linked(), 2, "the chunk's own (mean) KV is repaired");
    let r = remat(&engine);
    assert_eq!((r.missing, r.prefilled), (1, 1), "{r:?}");
    assert!(corpus.stored(&first).unwrap());
    let again = common::max_abs_diff(&forced(serve::Assembly::Reposition), &full);
    eprintln!("reposition vs full, one chunk: its copy {exact:e}, its mean {mean:e}, the copy redone {again:e}");
    assert!(exact < 0.1 && again < 0.1, "{exact} {again}");
    assert!(mean > 4.0 * exact.max(again), "{mean} {exact} {again}");

    // Not stored at all, the chunk is prefilled while answering: placed first, its copy is
    // what it reads, and the pipeline writes both back.
    for ns in [corpus.namespace(), first_ns] {
        corpus.store().delete(ns, &first, 0).unwrap();
    }
    let computed = common::max_abs_diff(&forced(serve::Assembly::Reposition), &full);
    assert!(computed < 0.1, "{computed}");
    assert!(!corpus.stored(&first).unwrap());
    common::answer(&rag, query(serve::Assembly::Reposition), hits.clone());
    let t = std::time::Instant::now();
    while !corpus.stored(&first).unwrap() && t.elapsed().as_secs() < 30 {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(corpus.stored(&first).unwrap(), "both copies written back");
    common::stop(rag, &engine);
}
