//! `ragkv eval qa --context neighbours:N`: the strategies answer from chunk KV materialized
//! after each chunk's neighbours (`ingest.context`), and `naive` from KV materialized alone is
//! the gap's baseline.
//!
//! A second engine shares the first one's store, index, embedder and model; its
//! `ingest.context` gives it a namespace of its own in the same store. Every chunk a question
//! retrieves is materialized in both namespaces (lazily: only retrieved chunks are ever
//! prefilled; the neighbours are searched in the whole corpus's index). The plain engine's
//! pipeline answers `naive` (logged as [`PLAIN_NAIVE`]); every strategy runs on the
//! neighbour-materialized one. `--chunk-order neighbours` also places each retrieved chunk
//! after the retrieved chunk its KV was prefilled after ([`arrange`]).

use std::sync::Arc;

use retrieval::Hit;
use serve::{Rag, ServeConfig};

use crate::qa::check;
use crate::Error;

/// The strategy name `naive` on plainly materialized KV has in a `--context` run's log and
/// lines: the baseline of `gap_closed`.
pub(crate) const PLAIN_NAIVE: &str = "naive@context:none";

/// The neighbour-materialized side of a run: its engine and pipeline.
pub(crate) struct Contexted {
    pub engine: Arc<ingest::Engine>,
    pub rag: Arc<Rag>,
}

impl Contexted {
    /// An engine over `base`'s store, index, embedder and model with `ingest.context =
    /// context` (and `ingest.exact_first`), and a pipeline on it with `config`.
    pub fn open(
        base: &ingest::Engine,
        (context, exact_first): (ingest::Context, bool),
        passage: &str,
        config: ServeConfig,
    ) -> Result<Contexted, Error> {
        let base = base.corpus();
        let corpus = ingest::Corpus::new(
            base.store().clone(),
            base.index().clone(),
            base.embedder().clone(),
            base.model().clone(),
            ingest::IngestConfig {
                context,
                context_passage: passage.into(),
                exact_first,
                system_prompt: config.system_prompt.clone(),
                ..base.config().clone()
            },
            model::DType::F16,
        )
        .map_err(|e| Error::Check(format!("{context} engine: {e}")))?;
        let engine = Arc::new(ingest::Engine::new(corpus));
        let rag = Rag::start(engine.clone(), config)
            .map_err(|e| Error::Check(format!("{context} pipeline: {e}")))?;
        Ok(Contexted { engine, rag })
    }

    /// Stops the pipeline and closes the engine.
    pub fn close(self) {
        drop(self.rag);
        crate::engine::close(self.engine);
    }
}

/// The text of `--context-passage` (empty without one); refused unless `context` places the
/// prompt's start before chunks.
pub(crate) fn passage(
    context: ingest::Context,
    path: Option<&std::path::Path>,
) -> Result<String, Error> {
    let Some(path) = path else {
        return Ok(String::new());
    };
    if !context.prompt() {
        return Err(Error::Check(format!(
            "--context-passage needs --context prompt or prompt+neighbours:N, not {context}"
        )));
    }
    std::fs::read_to_string(path).map_err(|cause| Error::Io {
        what: path.display().to_string(),
        cause,
    })
}

/// Whether a run stores and reads the first place's copies: `--exact-first`, or, without
/// it, wherever they apply (as the `ragkv` binary's `ingest.exact_first` follows
/// `ingest.context`).
pub(crate) fn exact_first(args: &crate::qa::Args) -> bool {
    args.exact_first
        .unwrap_or(args.context.takes_exact_first() && args.context_passage.is_none())
}

/// The `context` of a run's header and lines: empty for `none`, else the mode, with
/// `+passage:` and the first 8 hex digits of the passage's hash when there is one, and
/// `+first` under `--exact-first`.
pub(crate) fn label(context: ingest::Context, passage: &str, exact_first: bool) -> String {
    let first = if exact_first { "+first" } else { "" };
    match (context, passage) {
        (ingest::Context::None, _) => String::new(),
        (c, "") => format!("{c}{first}"),
        (c, p) => format!(
            "{c}+passage:{}{first}",
            &blake3::hash(p.as_bytes()).to_hex()[..8]
        ),
    }
}

/// `--chunk-order`: the retrieved chunks' order in every prompt of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkOrder {
    /// As retrieved, best first (what `ragkv serve` does).
    Score,
    /// Each chunk right after the retrieved chunk its KV was prefilled after ([`arrange`]).
    Neighbours,
}

/// Parses `--chunk-order`.
pub(crate) fn parse_order(s: &str) -> Result<ChunkOrder, String> {
    match s {
        "score" => Ok(ChunkOrder::Score),
        "neighbours" => Ok(ChunkOrder::Neighbours),
        _ => Err(format!("{s:?}: expected score or neighbours")),
    }
}

/// `hits` with each chunk right after the retrieved chunk its KV was prefilled after
/// (`--chunk-order neighbours`), and how many changed place.
pub(crate) fn arrange(corpus: &ingest::Corpus, hits: Vec<Hit>) -> Result<(Vec<Hit>, usize), Error> {
    let tokens = hits
        .iter()
        .map(|h| corpus.chunk_tokens(&h.payload.text))
        .collect::<Result<Vec<_>, _>>()
        .map_err(check("chunk tokens"))?;
    let order = corpus
        .neighbour_order(&tokens)
        .map_err(check("neighbour order"))?;
    let moved = order.iter().enumerate().filter(|(i, o)| i != *o).count();
    let mut slots: Vec<Option<Hit>> = hits.into_iter().map(Some).collect();
    Ok((
        order.into_iter().filter_map(|i| slots[i].take()).collect(),
        moved,
    ))
}
