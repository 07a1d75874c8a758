//! `ragkv eval qa`: answer quality of each assembly strategy against full prefill of the same
//! assembled prompt, on LongBench-HotpotQA.
//!
//! The corpus is indexed once (vectors only; by default every document); for each question the
//! top-k chunks are retrieved once, their KV is materialized if missing (lazily: only chunks
//! some question uses are ever prefilled), and the same chunks are answered with every
//! strategy. Per question:
//! - **Reference** ([`serve::Rag::reference`]): `full` (the chunks prefilled with the question
//!   after the system prompt), greedy, keeping the logits behind every answer token. Its time
//!   to first token is measured in the same call (reading, assembly, prompt prefill; on the
//!   caller's thread, the pipeline idle).
//! - **Each strategy through the pipeline**: its greedy answer (F1, EM, identical to the
//!   reference's or not) and its time to first token from submission (retrieval excluded;
//!   includes loading the stored KV and the repair).
//! - **Teacher-forced** ([`serve::Rag::forced`]): the reference's answer tokens (and its stop
//!   token) fed after the strategy's context: the share of those token decisions whose argmax
//!   agrees with the reference, and the mean KL(full ‖ strategy) of the next-token
//!   distributions. Hundreds of decisions per run instead of one per question: what the
//!   strategies are steered by.
//!
//! With `--context neighbours:N` (or `prompt`, `prompt+neighbours:N`, `[prompt+]mean:N`),
//! every strategy answers from chunk KV materialized after the chunk's neighbours (or the
//! prompt's start; `ingest.context`; [`context`]), and `naive` on KV materialized alone
//! (`naive@context:none`) is the gap's baseline.
//!
//! `naive` (stored KV as it is: the gap to close) and the serve default (`link:2`) run whatever
//! strategies are named; every line reports `gap_closed`, the share of naive's gap to full
//! prefill in teacher-forced agreement the strategy closes ((agreement − naive's) /
//! (1 − naive's)), and the default's line carries `"default": true`.
//!
//! The first line of each answer is scored against the gold answer with the SQuAD/HotpotQA
//! normalization. Each strategy's F1 difference from full comes with a 95 % bootstrap interval
//! over questions (paired), and its token agreement with one resampling whole questions (an
//! answer's token decisions are not independent of each other).
//!
//! **Resumable**: with `--dir`, every finished question appends one JSON line to
//! `<dir>/qa-log.jsonl` (after a header line naming the run's settings); a run with the same
//! settings goes on after the last logged question, and the figures are computed from the log.
//! A line cut short by a crash is dropped and its question redone.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use retrieval::SearchFilter;
use serde::{Deserialize, Serialize};
use serve::{Assembly, KvMode, Query, Rag, ServeConfig};

use crate::score::{self, exact_match, f1, first_line};
use crate::{dataset, Error};
use codec::Coded;
use context::{arrange, parse_order, ChunkOrder, Contexted, PLAIN_NAIVE};
use log::Log;
use summary::summarize;

// `--codec` runs (a second engine reading lossy KV), `--context` runs (a second namespace
// materialized after neighbours) and the resumable question log.
pub(crate) mod codec;
mod context;
mod log;
mod summary;

pub(crate) use codec::parse_codec;

/// The LongBench prompt for HotpotQA, as a system prompt.
const SYSTEM: &str = "Answer the question based on the given passages. Only give me the answer \
                      and do not output any other words.";

/// The strategies compared when none is named: every one, links and query-aware at three
/// settings, windows of 32 tokens (`naive` and the default strategy run whatever is named).
const DEFAULT_STRATEGIES: &[&str] = &[
    "naive",
    "reposition",
    "reposition+recompute",
    "link:2",
    "link:8",
    "link:32",
    "query-aware:0.05",
    "query-aware:0.1",
    "query-aware:0.2",
    "window:32",
];

/// Arguments of `ragkv eval qa`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// LongBench-HotpotQA directory (default: the shared datasets).
    #[arg(long)]
    pub dataset: Option<PathBuf>,
    /// Dev questions (the first N; the dataset has 100).
    #[arg(long, default_value_t = 100)]
    pub questions: usize,
    /// Chunks per question.
    #[arg(long, default_value_t = 5)]
    pub top_k: usize,
    /// Strategies to compare with full prefill, with their parameter if any (`link:8`,
    /// `query-aware:0.1`; repeat the flag); default: naive, reposition,
    /// reposition+recompute, link:2/8/32, query-aware:0.05/0.1/0.2, window:32. `naive` (the gap's
    /// baseline) and the serve default (`link:2`) run whatever is named.
    #[arg(long = "strategy")]
    pub strategies: Vec<Assembly>,
    /// Share of chunk tokens `reposition+recompute` (and `query-aware` without a share)
    /// recomputes.
    #[arg(long, default_value_t = 0.15)]
    pub recompute_share: f64,
    /// Tokens per chunk `link` without a parameter recomputes.
    #[arg(long, default_value_t = 16)]
    pub link_tokens: usize,
    /// Corpus documents indexed (default: all).
    #[arg(long, default_value_t = 100_000)]
    pub docs: usize,
    /// Model tokens per chunk.
    #[arg(long, default_value_t = 512)]
    pub chunk_tokens: usize,
    /// Tokens per answer.
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// Text before every chunk (`ingest.chunk_preamble`; `\n` is a newline): to compare chunk
    /// boundary handling. Use a separate `--dir` per preamble.
    #[arg(long, default_value = "")]
    pub chunk_preamble: String,
    /// The model.
    #[command(flatten)]
    pub llm: crate::engine::ModelArgs,
    /// Working directory, reused across runs (index, KV and the question log of one model):
    /// a run goes on where the last one with the same settings stopped. Default: a fresh
    /// temporary directory.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Also answer from stored KV encoded with this codec (`q8`, `q4`, ...) and compare it,
    /// strategy by strategy, with the same stored KV in f16 (`*_vs_uncompressed` fields).
    #[arg(long, value_parser = codec::parse_codec)]
    pub codec: Option<kvstore::Codec>,
    /// Materialize chunk KV after each chunk's neighbours and/or the prompt's start
    /// (`ingest.context`: `none`, `prompt`, `neighbours:N`, `prompt+neighbours:N`, `mean:N`,
    /// `prompt+mean:N`; default: `ragkv`'s, `prompt+mean:2`); the strategies answer from it,
    /// `naive` from plain KV is the baseline.
    #[arg(long, default_value_t = ingest::IngestConfig::recommended().context)]
    pub context: ingest::Context,
    /// With `--context prompt` (or `prompt+neighbours:N`): a text file placed after the
    /// prompt's start, before every chunk, when its KV is materialized
    /// (`ingest.context_passage`); named in the lines' `context` (`+passage:` and a hash).
    #[arg(long)]
    pub context_passage: Option<PathBuf>,
    /// With `--context prompt+neighbours:N` or `prompt+mean:N`: each chunk's KV also
    /// materialized after the prompt's start alone and read for the chunk placed first
    /// (`ingest.exact_first`); named in the lines' `context` (`+first`). Default: as
    /// `ragkv`, on where it applies (`--exact-first false`: off).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub exact_first: Option<bool>,
    /// Order of the retrieved chunks in every prompt, full prefill's included: `score` (the
    /// retrieval order, as `ragkv serve`) or, with `--context`, `neighbours`: each chunk right
    /// after the retrieved chunk its KV was prefilled after (`Corpus::neighbour_order`).
    #[arg(long, default_value = "score", value_parser = parse_order)]
    pub chunk_order: ChunkOrder,
}

/// One strategy's result: the JSON line `ragkv eval qa` prints.
#[derive(Debug, Clone, Serialize)]
pub struct QaLine {
    /// Always `qa`.
    pub eval: &'static str,
    /// The assembly strategy.
    pub strategy: String,
    /// Questions answered.
    pub questions: usize,
    /// Mean answer F1 against the gold answers.
    pub f1: f64,
    /// Share of exact matches.
    pub em: f64,
    /// `f1 - f1(full)` in F1 points (×100), and its paired 95 % bootstrap interval.
    pub f1_points_vs_full: f64,
    /// Its interval.
    pub f1_points_ci95: (f64, f64),
    /// Share of answers identical to full prefill's.
    pub agreement_answers: f64,
    /// Teacher-forced: share of full prefill's answer tokens this strategy also predicts,
    /// over how many tokens, and the mean KL(full ‖ strategy) per token in nats.
    pub agreement_tokens: f64,
    /// 95 % bootstrap interval of `agreement_tokens`, resampling questions.
    pub agreement_tokens_ci95: (f64, f64),
    /// Tokens teacher-forced.
    pub forced_tokens: usize,
    /// Mean KL(full ‖ strategy) per token, nats.
    pub kl_mean: f64,
    /// Share of the gap between `naive` and full prefill this strategy closes in teacher-forced
    /// token agreement: (agreement − naive's) / (1 − naive's); `None` when naive agrees on
    /// every token (no gap to close).
    pub gap_closed: Option<f64>,
    /// The strategy `ragkv serve` answers with by default ([`default_strategy`]).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub default: bool,
    /// Mean time to first token, ms.
    pub ttft_ms_mean: f64,
    /// Mean chunk tokens recomputed per question.
    pub recomputed_tokens_mean: f64,
    /// Chunks per question.
    pub top_k: usize,
    /// The model file.
    pub model: String,
    /// `ingest.chunk_preamble` of the run.
    pub chunk_preamble: String,
    /// `ingest.context` of the KV this line's answers came from (`none`, `prompt`,
    /// `neighbours:N`, `prompt+neighbours:N`, `mean:N`, `prompt+mean:N`).
    pub context: String,
    /// With `--codec`: the codec the strategy's answers were read through (its F1, agreement
    /// and TTFT above are those answers'), and against the same strategy on f16 stored KV:
    /// the F1 difference in points with its paired 95 % interval, the share of the f16
    /// answer's tokens teacher-forcing agrees with (and its interval), and the mean KL.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub codec: Option<String>,
    /// F1 difference against f16 stored KV, points.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub f1_points_vs_uncompressed: Option<f64>,
    /// Its paired 95 % interval.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub f1_points_vs_uncompressed_ci95: Option<(f64, f64)>,
    /// Teacher-forced token agreement with the f16 answers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agreement_tokens_vs_uncompressed: Option<f64>,
    /// Its 95 % interval.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agreement_tokens_vs_uncompressed_ci95: Option<(f64, f64)>,
    /// Mean KL(f16 ‖ codec) per token, nats.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl_vs_uncompressed: Option<f64>,
}

/// The settings a log belongs to (its first line).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct RunHeader {
    model: String,
    quantized: bool,
    docs: usize,
    top_k: usize,
    chunk_tokens: usize,
    max_tokens: usize,
    chunk_preamble: String,
    recompute_share: f64,
    link_tokens: usize,
    strategies: Vec<String>,
    /// Codec of the quantized store compared with the f16 one (`--codec`); empty: none.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub(crate) codec: String,
    /// `ingest.context` of the strategies' KV (`--context`); empty: none.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub(crate) context: String,
    /// `neighbours` when a `--context` run placed chunks after their retrieved neighbours
    /// (`--chunk-order`); empty: retrieval order.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub(crate) chunk_order: String,
}

/// One answer's scores.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Answer {
    strategy: String,
    answer: String,
    pub(crate) f1: f64,
    em: bool,
    ttft_ms: f64,
    identical: bool,
    recomputed: usize,
    forced_tokens: usize,
    forced_agree: usize,
    kl_sum: f64,
    /// With `--codec`: the answer of the same strategy from the f16 store, its F1, and this
    /// answer's context teacher-forced on it (tokens, agreeing decisions, summed KL).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) uncompressed: Option<VsUncompressed>,
}

/// One answer from quantized stored KV against the same strategy's from f16 stored KV.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct VsUncompressed {
    pub(crate) f1: f64,
    pub(crate) tokens: usize,
    pub(crate) agree: usize,
    pub(crate) kl_sum: f64,
}

/// One question's line in the log: the reference (`full`) first, then each strategy.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Logged {
    q: usize,
    id: u64,
    gold: String,
    /// Chunks whose place in the prompt differs from their retrieval rank (`--chunk-order`).
    #[serde(default, skip_serializing_if = "is_zero")]
    moved: usize,
    answers: Vec<Answer>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// The strategy `ragkv serve` answers with by default, its parameter resolved from the serve
/// defaults (`link:2`): every evaluation runs it and marks its line `"default": true`.
pub(crate) fn default_strategy() -> Assembly {
    let c = ServeConfig::default();
    c.assembly.resolved(&c.repair())
}

/// The strategies to run, each once, `full` left out (it is the reference): `naive` first
/// (the gap every `gap_closed` is measured on), the default strategy, then those asked for.
fn strategies(args: &Args) -> Vec<Assembly> {
    let requested: Vec<Assembly> = if args.strategies.is_empty() {
        DEFAULT_STRATEGIES
            .iter()
            .map(|s| s.parse().expect("a valid default strategy"))
            .collect()
    } else {
        args.strategies.clone()
    };
    let mut out: Vec<Assembly> = Vec::new();
    for s in [Assembly::Naive, default_strategy()]
        .into_iter()
        .chain(requested)
    {
        if s != Assembly::Full && !out.contains(&s) {
            out.push(s);
        }
    }
    out
}

pub(crate) fn check<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> Error {
    move |why| Error::Check(format!("{what}: {why}"))
}

/// The rows of a `(n, vocab)` logits tensor.
pub(crate) fn rows(t: &model::Tensor) -> Result<Vec<Vec<f32>>, Error> {
    t.to_dtype(model::DType::F32)
        .and_then(|t| t.to_vec2::<f32>())
        .map_err(|e| Error::Check(format!("logits: {e}")))
}

/// Runs the evaluation (resuming a logged run); the last line is `full`.
pub fn run(args: &Args) -> Result<Vec<QaLine>, Error> {
    if args.questions == 0 || args.top_k == 0 {
        return Err(Error::Invalid {
            what: "--questions/--top-k",
            why: "must be positive".into(),
        });
    }
    let strategies = strategies(args);
    let ds = dataset::resolve(args.dataset.as_deref())?;
    let work_dir = crate::WorkDir::new(args.dir.as_deref())?;
    let work = work_dir.path().to_path_buf();
    let passage = context::passage(args.context, args.context_passage.as_deref())?;
    let header = RunHeader {
        model: args.llm.name(),
        quantized: args.llm.quantized,
        docs: args.docs,
        top_k: args.top_k,
        chunk_tokens: args.chunk_tokens,
        max_tokens: args.max_tokens,
        chunk_preamble: args.chunk_preamble.clone(),
        recompute_share: args.recompute_share,
        link_tokens: args.link_tokens,
        strategies: strategies.iter().map(Assembly::to_string).collect(),
        codec: args.codec.map(|c| c.to_string()).unwrap_or_default(),
        context: context::label(args.context, &passage, context::exact_first(args)),
        chunk_order: match (args.context, args.chunk_order) {
            (ingest::Context::None, _) | (_, ChunkOrder::Score) => String::new(),
            _ => "neighbours".into(),
        },
    };
    let mut log = Log::open(args.dir.as_deref(), &header)?;
    let questions = dataset::questions(&ds, args.questions)?;
    if log.done.len() < questions.len() {
        let preamble = args.chunk_preamble.replace("\\n", "\n");
        let alone = crate::engine::chunks_alone(args.chunk_tokens, &preamble);
        let (llm, none) = (&args.llm, kvstore::Codec::None);
        let engine = crate::engine::open_indexed(&work, llm, alone, &ds, args.docs, "qa", none);
        let engine = Arc::new(engine?);
        let config = ServeConfig {
            system_prompt: SYSTEM.into(),
            recompute_share: args.recompute_share,
            link_tokens: args.link_tokens,
            max_tokens_limit: args.max_tokens.max(1),
            default_max_tokens: args.max_tokens.max(1),
            ..ServeConfig::default()
        };
        let rag = Rag::start(engine.clone(), config.clone()).map_err(check("server pipeline"))?;
        let ctx = match args.context {
            ingest::Context::None => None,
            c => Some(Contexted::open(
                &engine,
                (c, context::exact_first(args)),
                &passage,
                config.clone(),
            )?),
        };
        let sides = Sides {
            plain: (&engine, &rag),
            ctx: ctx.as_ref(),
        };
        let coded = match args.codec {
            Some(c) => Some(Coded::open(sides.strategies().0, &work, c, config)?),
            None => None,
        };
        let progress = crate::progress::bar(questions.len() as u64, "qa");
        progress.set_position(log.done.len() as u64);
        let t0 = Instant::now();
        for (i, q) in questions.iter().enumerate().skip(log.done.len()) {
            let line = question(&sides, coded.as_ref(), args, &strategies, i, q)?;
            progress.println(format!(
                "[qa] {}/{} ({:.0} s) gold {:?} | {}",
                i + 1,
                questions.len(),
                t0.elapsed().as_secs_f64(),
                q.answer,
                line.answers
                    .iter()
                    .map(|a| format!("{}: {:?}", a.strategy, first_line(&a.answer)))
                    .collect::<Vec<_>>()
                    .join(" | ")
            ));
            log.append(line)?;
            progress.inc(1);
        }
        progress.finish_and_clear();
        if let Some(c) = coded {
            c.close();
        }
        if let Some(c) = ctx {
            c.close();
        }
        drop(rag);
        crate::engine::close(engine);
    }
    Ok(summarize(&log.done[..questions.len()], &header))
}

/// The engines and pipelines of a run: plain chunk KV, and with `--context` the namespace
/// materialized after neighbours.
struct Sides<'a> {
    plain: (&'a Arc<ingest::Engine>, &'a Rag),
    ctx: Option<&'a Contexted>,
}

impl Sides<'_> {
    /// The engine and pipeline the strategies answer from.
    fn strategies(&self) -> (&Arc<ingest::Engine>, &Rag) {
        match self.ctx {
            Some(c) => (&c.engine, &c.rag),
            None => self.plain,
        }
    }
}

/// One question: the reference, then every strategy through the pipeline and teacher-forced.
fn question(
    sides: &Sides<'_>,
    coded: Option<&Coded>,
    args: &Args,
    strategies: &[Assembly],
    i: usize,
    q: &dataset::Question,
) -> Result<Logged, Error> {
    let query = |assembly| Query {
        question: q.question.clone(),
        top_k: args.top_k,
        filter: SearchFilter::default(),
        params: model::GenerateParams {
            max_tokens: args.max_tokens,
            ..model::GenerateParams::default()
        },
        kv: KvMode::On,
        assembly,
    };
    let (engine, rag) = sides.strategies();
    let hits = rag
        .retrieve(&query(Assembly::Full))
        .map_err(check("retrieve"))?;
    crate::engine::materialize(sides.plain.0, &hits)?;
    if sides.ctx.is_some() {
        crate::engine::materialize(engine, &hits)?;
    }
    if let Some(c) = coded {
        c.copy(engine, &hits)?;
    }
    // Arranged once every chunk's KV (and neighbour note) is stored.
    let (hits, moved) = if args.chunk_order == ChunkOrder::Neighbours {
        arrange(engine.corpus(), hits)?
    } else {
        (hits, 0)
    };
    let reference = rag
        .reference(&query(Assembly::Full), hits.clone())
        .map_err(check("full prefill"))?;
    let full_rows = rows(&reference.logits)?;
    let full_text = reference.generation.text.clone();
    let scored = |strategy: String, answer: String, ttft_ms, recomputed, f: score::Forced| {
        let pred = first_line(&answer);
        Answer {
            strategy,
            f1: f1(pred, &q.answer),
            em: exact_match(pred, &q.answer),
            identical: answer == full_text,
            answer,
            ttft_ms,
            recomputed,
            forced_tokens: f.tokens,
            forced_agree: f.agree,
            kl_sum: f.kl_sum,
            uncompressed: None,
        }
    };
    let n = reference.targets.len();
    let mut answers = vec![scored(
        Assembly::Full.to_string(),
        full_text.clone(),
        reference.first_token_ms,
        0,
        score::Forced {
            tokens: n,
            agree: n,
            kl_sum: 0.0,
        },
    )];
    // With `--context`, `naive` on plain KV first: the gap's baseline.
    let plain_naive = sides.ctx.map(|_| (PLAIN_NAIVE, Assembly::Naive));
    let runs = plain_naive
        .into_iter()
        .chain(strategies.iter().map(|&a| ("", a)));
    for (name, a) in runs {
        let (rag, coded) = if name.is_empty() {
            (rag, coded)
        } else {
            (sides.plain.1, None)
        };
        // With a codec, the strategy's answers come from the quantized store, and the same
        // strategy on the f16 store is their reference.
        let (pipeline, unc) = match coded {
            Some(c) => {
                let r = rag
                    .reference(&query(a), hits.clone())
                    .map_err(check("f16 stored KV"))?;
                let f1_unc = f1(first_line(&r.generation.text), &q.answer);
                (&*c.rag, Some((r, f1_unc)))
            }
            None => (rag, None),
        };
        let rx = crate::engine::submit(pipeline, query(a), hits.clone(), Instant::now())?;
        let f = crate::engine::wait(rx)?;
        if f.kv_hits != hits.len() {
            return Err(Error::Check(format!(
                "{a}: expected stored KV for every chunk: {:?}",
                f.citations
            )));
        }
        let forced = if n == 0 {
            score::Forced::default()
        } else {
            let logits = pipeline
                .forced(&query(a), hits.clone(), &reference.targets)
                .map_err(check("teacher forcing"))?;
            score::forced(&full_rows, &rows(&logits)?, &reference.targets)
        };
        let mut answer = scored(
            if name.is_empty() {
                a.to_string()
            } else {
                name.to_string()
            },
            f.answer,
            f.timings.first_token_ms,
            f.recomputed_tokens,
            forced,
        );
        if let (Some(c), Some((r, f1_unc))) = (coded, unc) {
            let v = c.forced(rag, &query(a), hits.clone(), &r.targets)?;
            answer.uncompressed = Some(VsUncompressed {
                f1: f1_unc,
                tokens: v.tokens,
                agree: v.agree,
                kl_sum: v.kl_sum,
            });
        }
        answers.push(answer);
    }
    Ok(Logged {
        q: i,
        id: q.id,
        gold: q.answer.clone(),
        moved,
        answers,
    })
}

#[cfg(test)]
mod tests;
