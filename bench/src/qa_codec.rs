//! `ragkv eval qa --codec C`: answers from quantized stored KV against the same stored KV in
//! f16, strategy by strategy, so that the codec's loss is measured apart from chunk assembly's.
//!
//! A second engine shares the first one's index, embedder and model but keeps its chunk KV in
//! a store of its own (`<dir>/kv-C`) whose namespace uses codec `C`. Every chunk a question
//! retrieves is materialized once in the f16 store and then copied, encoded, into the codec's
//! ([`Coded::copy`]): both stores hold the same KV, one of them quantized. Per strategy, the
//! f16 store answers greedily ([`serve::Rag::reference`], logits kept) and the codec's store is
//! teacher-forced on that answer: agreement of each token decision and KL(f16 ‖ codec).

use std::path::Path;
use std::sync::Arc;

use retrieval::Hit;
use serve::{Query, Rag, ServeConfig};

use crate::score;
use crate::Error;

/// The quantized side of a codec evaluation: its engine and pipeline.
pub struct Coded {
    pub codec: kvstore::Codec,
    pub engine: Arc<ingest::Engine>,
    pub rag: Arc<Rag>,
}

impl Coded {
    /// Opens (or reopens) `<work>/kv-<codec>` beside `base`'s store and starts a pipeline on it
    /// with `config`.
    pub fn open(
        base: &ingest::Engine,
        work: &Path,
        codec: kvstore::Codec,
        config: ServeConfig,
    ) -> Result<Coded, Error> {
        let store = kvstore::Store::open(
            work.join(format!("kv-{codec}")),
            kvstore::StoreOptions {
                default_codec: codec,
                ..kvstore::StoreOptions::default()
            },
        )?;
        let engine = ingest::Engine::new(
            Arc::new(store),
            base.index.clone(),
            base.embedder.clone(),
            base.model.clone(),
            base.config.clone(),
            model::DType::F16,
        )
        .map_err(|e| Error::Check(format!("codec engine: {e}")))?;
        let engine = Arc::new(engine);
        let rag = Rag::start(engine.clone(), config)
            .map_err(|e| Error::Check(format!("codec pipeline: {e}")))?;
        Ok(Coded { codec, engine, rag })
    }

    /// Copies the stored f16 KV of `hits`' chunks from `base` into this store (encoded by its
    /// codec), where missing.
    pub fn copy(&self, base: &ingest::Engine, hits: &[Hit]) -> Result<(), Error> {
        for h in hits {
            let tokens = base
                .chunk_tokens(&h.payload.text)
                .map_err(|e| Error::Check(format!("tokenize: {e}")))?;
            let ns = self.engine.namespace();
            if self.engine.store.probe(ns, &tokens)? == tokens.len() {
                continue;
            }
            let kv = base
                .store
                .get_batch(base.namespace(), &tokens, tokens.len())?;
            let doc = ingest::kv_doc(&h.payload.doc_id, &h.payload.doc_hash);
            self.engine.store.put_batch(
                ns,
                self.engine.layout(),
                &[kvstore::PutItem {
                    tokens: &tokens,
                    kv: &kv.bytes,
                    doc: Some(&doc),
                }],
            )?;
        }
        Ok(())
    }

    /// Teacher-forces `targets` (the f16 store's greedy answer to `query`) after the context
    /// of each store, `base`'s pipeline reading the f16 one: each position's decision from
    /// quantized KV against the decision from f16 KV, and KL(f16 ‖ codec). Both sides go
    /// through the same forced pass, so that only the stored KV differs (the greedy pass that
    /// produced `targets` rounds differently: against its own logits even f16 KV agrees with
    /// itself on only ~98 % of 64-token continuations).
    pub fn forced(
        &self,
        base: &Rag,
        query: &Query,
        hits: Vec<Hit>,
        targets: &[u32],
    ) -> Result<score::Forced, Error> {
        if targets.is_empty() {
            return Ok(score::Forced::default());
        }
        let run = |rag: &Rag, what: &str| {
            rag.forced(query, hits.clone(), targets)
                .map_err(|e| Error::Check(format!("{what} teacher forcing: {e}")))
                .and_then(|l| crate::qa::rows(&l))
        };
        let f16 = run(base, "f16")?;
        let coded = run(&self.rag, self.codec.name())?;
        let decisions: Vec<u32> = f16.iter().map(|r| score::argmax(r) as u32).collect();
        Ok(score::forced(&f16, &coded, &decisions))
    }

    /// Stops the pipeline and closes the engine.
    pub fn close(self) {
        drop(self.rag);
        crate::engine::close(self.engine);
    }
}
