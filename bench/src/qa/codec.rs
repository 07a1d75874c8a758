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

use crate::qa::{Answer, QaLine, RunHeader, VsUncompressed};
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
        let base = base.corpus();
        let store = kvstore::Store::open(
            work.join(format!("kv-{codec}")),
            kvstore::StoreOptions {
                default_codec: codec,
                ..kvstore::StoreOptions::default()
            },
        )?;
        let corpus = ingest::Corpus::new(
            Arc::new(store),
            base.index().clone(),
            base.embedder().clone(),
            base.model().clone(),
            base.config().clone(),
            model::DType::F16,
        )
        .map_err(|e| Error::Check(format!("codec engine: {e}")))?;
        let engine = Arc::new(ingest::Engine::new(corpus));
        let rag = Rag::start(engine.clone(), config)
            .map_err(|e| Error::Check(format!("codec pipeline: {e}")))?;
        Ok(Coded { codec, engine, rag })
    }

    /// Copies the stored f16 KV of `hits`' chunks from `base` into this store (encoded by its
    /// codec), where missing.
    pub fn copy(&self, base: &ingest::Engine, hits: &[Hit]) -> Result<(), Error> {
        let (base, ours) = (base.corpus(), self.engine.corpus());
        for h in hits {
            let tokens = base
                .chunk_tokens(&h.payload.text)
                .map_err(|e| Error::Check(format!("tokenize: {e}")))?;
            let ns = ours.namespace();
            if ours.store().probe(ns, &tokens)? == tokens.len() {
                continue;
            }
            let kv = base
                .store()
                .get_batch(base.namespace(), &tokens, tokens.len())?;
            let doc = ingest::kv_doc(&h.payload.doc_id, &h.payload.doc_hash);
            ours.store().put_batch(
                ns,
                ours.layout(),
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

/// With a codec, fills `line`'s comparison with the f16 store from its answers' logs.
pub(crate) fn vs_uncompressed(line: &mut QaLine, xs: &[&Answer], header: &RunHeader) {
    let pairs: Vec<(&Answer, &VsUncompressed)> = xs
        .iter()
        .filter_map(|a| a.uncompressed.as_ref().map(|u| (*a, u)))
        .collect();
    if header.codec.is_empty() || pairs.is_empty() {
        return;
    }
    let n = pairs.len() as f64;
    let diffs: Vec<f64> = pairs.iter().map(|(a, u)| a.f1 - u.f1).collect();
    let (lo, hi) = score::bootstrap_ci95(&diffs, score::RESAMPLES);
    let tokens = pairs.iter().map(|(_, u)| u.tokens).sum::<usize>();
    let agree = pairs.iter().map(|(_, u)| u.agree).sum::<usize>();
    let per_question: Vec<(f64, f64)> = pairs
        .iter()
        .map(|(_, u)| (u.agree as f64, u.tokens as f64))
        .collect();
    line.codec = Some(header.codec.clone());
    line.f1_points_vs_uncompressed = Some(diffs.iter().sum::<f64>() / n * 100.0);
    line.f1_points_vs_uncompressed_ci95 = Some((lo * 100.0, hi * 100.0));
    line.agreement_tokens_vs_uncompressed = Some(agree as f64 / tokens.max(1) as f64);
    line.agreement_tokens_vs_uncompressed_ci95 =
        Some(score::bootstrap_ratio_ci95(&per_question, score::RESAMPLES));
    line.kl_vs_uncompressed =
        Some(pairs.iter().map(|(_, u)| u.kl_sum).sum::<f64>() / tokens.max(1) as f64);
}

/// Parses a codec name (`--codec`).
pub(crate) fn parse_codec(s: &str) -> Result<kvstore::Codec, String> {
    kvstore::Codec::from_name(s).ok_or_else(|| {
        let names: Vec<&str> = kvstore::Codec::ALL.iter().map(|c| c.name()).collect();
        format!("{s:?} is not a codec ({})", names.join(", "))
    })
}
