//! Teacher forcing, for evaluation (`ragkv eval qa`): how closely a strategy's assembled
//! context predicts a reference answer, one token decision at a time.
//!
//! [`Rag::reference`] answers a query greedily (usually with `full`) and keeps the logits
//! behind every answer token; [`Rag::forced`] feeds that answer after another strategy's
//! context and returns the logits at the same positions, so every answer token is one
//! comparison (agreement of the argmax, divergence of the distribution) instead of one per
//! question. Both build the context with the pipeline's own functions ([`crate::pipeline`]:
//! the same chunk reads, assembly and repair) and feed the prompt `serve.prefill_chunk`
//! tokens at a time, as the batch does. Both block the calling thread (never call them from an
//! async worker) and store nothing: KV prefilled for missing chunks is not written back.

use std::time::Instant;

use model::{Decoder, Decoding, Generation, KvCache, Logits, Tensor};
use retrieval::Hit;

use crate::assembly::{LinkTiming, Target};
use crate::error::{Error, Result};
use crate::pipeline::{
    assemble, ms, read_chunks, AssembleRequest as Request, Fanout, Query, Source,
};
use crate::rag::Rag;

/// A reference answer and what predicted it.
#[derive(Debug)]
pub struct Reference {
    /// The reference's tokens and text.
    pub generation: Generation,
    /// The answer's tokens, then the stop token if it stopped on one (greedy: the argmax of
    /// the last row).
    pub targets: Vec<u32>,
    /// Logits before each target, `(targets.len(), vocab)`: row `i` predicts `targets[i]`.
    pub logits: Tensor,
    /// From the call to the first token's logits (reading, assembly, prompt prefill).
    pub first_token_ms: f64,
}

/// A tensor operation's error.
fn tensor(op: &'static str) -> impl FnOnce(model::TensorError) -> Error {
    move |source| Error::Tensor { op, source }
}

impl Rag {
    /// Answers `query` over `hits` with its own parameters on the calling thread, keeping the
    /// logits behind every token (see the module docs).
    pub fn reference(&self, query: &Query, hits: Vec<Hit>) -> Result<Reference> {
        let t = Instant::now();
        let decoder = self.corpus().model().decoder();
        let (mut cache, pending, ready) = self.context(query, hits, query.params.max_tokens + 1)?;
        let mut logits = match ready {
            Some(l) => l,
            None => self.feed(decoder, &mut cache, &pending)?,
        };
        let first_token_ms = ms(t.elapsed());
        let mut decoding = Decoding::new(self.corpus().model().tokenizer(), &query.params)?;
        let mut rows = Vec::new();
        loop {
            rows.push(logits.clone());
            match decoding.advance(&logits)?.next {
                Some(next) => logits = decoder.forward(&mut cache, &[next], Logits::Last)?,
                None => break,
            }
        }
        let generation = decoding.finish();
        let mut targets = generation.tokens.clone();
        // One row more than tokens: the last one sampled the stop token.
        if let Some(last) = rows.get(targets.len()) {
            targets.push(Decoder::argmax(last)?);
        }
        let logits = Tensor::stack(&rows, 0).map_err(tensor("stack"))?;
        Ok(Reference {
            generation,
            targets,
            logits,
            first_token_ms,
        })
    }

    /// Feeds `answer` after `query`'s context over `hits` (its strategy, on the calling
    /// thread) and returns the logits before each answer token, `(answer.len(), vocab)`.
    pub fn forced(&self, query: &Query, hits: Vec<Hit>, answer: &[u32]) -> Result<Tensor> {
        let Some((_, head)) = answer.split_last() else {
            return Err(Error::Invalid {
                why: "forced: an empty answer".into(),
            });
        };
        let decoder = self.corpus().model().decoder();
        let (mut cache, pending, ready) = self.context(query, hits, answer.len())?;
        if let Some(first) = ready {
            // The repair ran the question: its logits predict the first answer token.
            let first = first.unsqueeze(0).map_err(tensor("unsqueeze"))?;
            if head.is_empty() {
                return Ok(first);
            }
            let rest = decoder.forward(&mut cache, head, Logits::All)?;
            return Tensor::cat(&[&first, &rest], 0).map_err(tensor("cat"));
        }
        let (last, prompt) = pending.split_last().ok_or(Error::Invariant {
            what: "forced: an empty prompt",
        })?;
        if !prompt.is_empty() {
            self.feed(decoder, &mut cache, prompt)?;
        }
        let mut tail = Vec::with_capacity(answer.len());
        tail.push(*last);
        tail.extend_from_slice(head);
        Ok(decoder.forward(&mut cache, &tail, Logits::All)?)
    }

    /// The query's assembled cache, with room for what follows, the tokens to feed, and the
    /// logits after the question when the repair ran it.
    fn context(
        &self,
        query: &Query,
        hits: Vec<Hit>,
        room: usize,
    ) -> Result<(KvCache, Vec<u32>, Option<Tensor>)> {
        let corpus = &**self.corpus();
        let gpu = corpus.model().device().is_cuda();
        let mut fanout = Fanout::new(self.config.load_threads(gpu));
        let start = self.prefix.tokens.len();
        let dtype = self.config.cache_dtype.dtype();
        let src = Source {
            corpus,
            metrics: &self.metrics,
            resident: &self.resident,
            cache_dtype: dtype,
        };
        let chunks = read_chunks(&src, query, hits, start, &mut fanout)?;
        let question = self.prefix.question(corpus, &query.question)?;
        let repair = self.config.repair();
        let req = Request {
            prefix: &self.prefix,
            repair: &repair,
            query,
            chunks,
            question,
            target: Target {
                room,
                dtype,
                link: LinkTiming::Now,
            },
        };
        let a = assemble(corpus, req)?;
        Ok((a.cache, a.pending, a.logits))
    }

    /// Feeds `tokens` in `serve.prefill_chunk` pieces; the logits after the last.
    fn feed(&self, decoder: &Decoder, cache: &mut KvCache, tokens: &[u32]) -> Result<Tensor> {
        let mut logits = None;
        for piece in tokens.chunks(self.config.prefill_chunk.max(1)) {
            logits = Some(decoder.forward(cache, piece, Logits::Last)?);
        }
        logits.ok_or(Error::Invariant {
            what: "nothing to feed",
        })
    }
}
